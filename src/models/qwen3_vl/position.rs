//! Qwen3-VL's learned absolute positions: a square table of `side × side` rows resampled to each
//! image's patch grid, bilinearly with aligned corners, as transformers'
//! `get_vision_interpolation_indices_and_weights(mode="bilinear", align_corners=True)` computes
//! it for `fast_pos_embed_interpolate`: each patch reads four rows of the table, with weights
//! computed in f32 in the same order of operations, so they are bit for bit transformers'.

/// Each tower row's four table rows and their weights, rows in the processor's order (images
/// one after the other, frames repeating their grid, patches in merge-block order).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Interpolation {
    /// `[rows · 4]` rows of the table: (top, left), (top, right), (bottom, left), (bottom,
    /// right).
    pub indices: Vec<i32>,
    /// `[rows · 4]` their weights.
    pub weights: Vec<f32>,
}

/// The two taps along one axis for position `index` of `size` on a table side of `side`, and
/// their weights, in transformers' f32 arithmetic (`align_corners=True`: the ends meet).
fn axis(index: usize, size: usize, side: usize) -> [(usize, f32); 2] {
    let src = (index as f32 * (side - 1) as f32) / (size.saturating_sub(1).max(1) as f32);
    let floor = src.floor();
    [0.0f32, 1.0].map(|offset| {
        let tap = (floor + offset).clamp(0.0, (side - 1) as f32) as usize;
        let distance = ((src - floor) - offset).abs();
        (tap, (1.0 - distance).max(0.0))
    })
}

/// The interpolation for `grids` (`(t, h, w)` each) on a table of `side × side`, merge blocks
/// of `merge × merge` patches.
pub(crate) fn interpolation(grids: &[[usize; 3]], side: usize, merge: usize) -> Interpolation {
    let rows: usize = grids.iter().map(|[t, h, w]| t * h * w).sum();
    let mut indices = Vec::with_capacity(rows * 4);
    let mut weights = Vec::with_capacity(rows * 4);
    for &[t, h, w] in grids {
        let mut frame_indices = Vec::with_capacity(h * w * 4);
        let mut frame_weights = Vec::with_capacity(h * w * 4);
        for block_row in 0..h / merge {
            for block_col in 0..w / merge {
                for in_row in 0..merge {
                    for in_col in 0..merge {
                        let vertical = axis(block_row * merge + in_row, h, side);
                        let horizontal = axis(block_col * merge + in_col, w, side);
                        for (row, row_weight) in vertical {
                            for (col, col_weight) in horizontal {
                                frame_indices.push((row * side + col) as i32);
                                frame_weights.push(row_weight * col_weight);
                            }
                        }
                    }
                }
            }
        }
        for _ in 0..t {
            indices.extend_from_slice(&frame_indices);
            weights.extend_from_slice(&frame_weights);
        }
    }
    Interpolation { indices, weights }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bilinear resampling with aligned corners in float64, at (row, col) of an h × w grid.
    fn reference(
        table: &[f64],
        side: usize,
        (row, col): (usize, usize),
        (h, w): (usize, usize),
    ) -> f64 {
        let at = |i: usize, n: usize| {
            if n == 1 {
                0.0
            } else {
                i as f64 * (side - 1) as f64 / (n - 1) as f64
            }
        };
        let (y, x) = (at(row, h), at(col, w));
        let (y0, x0) = (y.floor() as usize, x.floor() as usize);
        let (y1, x1) = ((y0 + 1).min(side - 1), (x0 + 1).min(side - 1));
        let (fy, fx) = (y - y0 as f64, x - x0 as f64);
        let v = |r: usize, c: usize| table[r * side + c];
        (1.0 - fy) * ((1.0 - fx) * v(y0, x0) + fx * v(y0, x1))
            + fy * ((1.0 - fx) * v(y1, x0) + fx * v(y1, x1))
    }

    /// On grids smaller than, equal to and larger than the table (and of two frames), each
    /// row's weighted taps give float64's bilinear value at that patch, which the processor's
    /// merge-block order puts at that row.
    #[test]
    fn taps_resample_the_table_bilinearly_in_merge_block_order() {
        let side = 5;
        let table: Vec<f64> = (0..side * side)
            .map(|i| ((i * 37) % 11) as f64 - 4.0)
            .collect();
        let grids = [[1, 2, 4], [1, 6, 4], [2, 4, 6], [1, 10, 2]];
        let interp = interpolation(&grids, side, 2);
        let mut row = 0;
        for [t, h, w] in grids {
            for _ in 0..t {
                for (r, c) in merge_block_order(h, w, 2) {
                    let got: f64 = (0..4)
                        .map(|k| {
                            let i = row * 4 + k;
                            f64::from(interp.weights[i]) * table[interp.indices[i] as usize]
                        })
                        .sum();
                    let want = reference(&table, side, (r, c), (h, w));
                    // Tolerance: the f32 weights (a few roundings each, of values ≤ 1) times
                    // table values ≤ 6.
                    assert!(
                        (got - want).abs() <= 1e-5,
                        "{h}×{w} ({r}, {c}): {got} vs {want}"
                    );
                    row += 1;
                }
            }
        }
        assert_eq!(row * 4, interp.indices.len());
    }

    /// The grid's patches in the processor's order: merge blocks row by row, each block's
    /// patches row by row.
    fn merge_block_order(h: usize, w: usize, m: usize) -> Vec<(usize, usize)> {
        let mut order = Vec::new();
        for br in 0..h / m {
            for bc in 0..w / m {
                for ir in 0..m {
                    for ic in 0..m {
                        order.push((br * m + ir, bc * m + ic));
                    }
                }
            }
        }
        order
    }

    /// A grid the size of the table reads the table's own rows with weight 1.
    #[test]
    fn a_grid_the_size_of_the_table_reads_it_as_it_is() {
        let interp = interpolation(&[[1, 4, 4]], 4, 1);
        for (row, taps) in interp.indices.chunks(4).enumerate() {
            let weights = &interp.weights[row * 4..row * 4 + 4];
            let read: Vec<(i32, f32)> = taps
                .iter()
                .zip(weights)
                .filter(|(_, w)| **w != 0.0)
                .map(|(&i, &w)| (i, w))
                .collect();
            assert_eq!(read, [(row as i32, 1.0)], "row {row}");
        }
    }
}
