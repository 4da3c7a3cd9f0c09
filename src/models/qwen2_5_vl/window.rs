//! Qwen2.5-VL's attention windows, laid out as transformers' `get_vision_window_index` does:
//! each frame of each image cut into windows of `units` × `units` merged tokens from its top
//! left (the last row and column of windows cut short), the merged tokens taken window by
//! window, row by row within one. The windowed blocks attend within each window; the rows, the
//! rotary tables and each row's adapter slot move into this order together, and the outputs
//! move back.

/// The window order of one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Windows {
    /// Merged tokens (connector rows) in window order: each entry is the token's index in the
    /// processor's order.
    pub units: Vec<usize>,
    /// Tower rows (patches) per window, in window order; no window is empty.
    pub rows: Vec<usize>,
    /// Patches per merged token.
    merge_unit: usize,
}

impl Windows {
    /// The windows of `grids` (`(t, h, w)` in patches) with merge blocks of `merge`² patches and
    /// windows of `units`² merged tokens.
    pub(super) fn of(grids: &[[usize; 3]], merge: usize, units: usize) -> Self {
        let merge_unit = merge * merge;
        let (mut order, mut rows) = (Vec::new(), Vec::new());
        let mut first = 0;
        for &[t, h, w] in grids {
            let (tokens_h, tokens_w) = (h / merge, w / merge);
            for frame in 0..t {
                let frame_first = first + frame * tokens_h * tokens_w;
                for top in (0..tokens_h).step_by(units) {
                    for left in (0..tokens_w).step_by(units) {
                        let before = order.len();
                        for row in top..(top + units).min(tokens_h) {
                            for column in left..(left + units).min(tokens_w) {
                                order.push(frame_first + row * tokens_w + column);
                            }
                        }
                        rows.push((order.len() - before) * merge_unit);
                    }
                }
            }
            first += t * tokens_h * tokens_w;
        }
        Self {
            units: order,
            rows,
            merge_unit,
        }
    }

    /// Tower rows in window order: each merged token's patches, in their order.
    pub(super) fn tower_rows(&self) -> Vec<usize> {
        let unit = self.merge_unit;
        self.units
            .iter()
            .flat_map(|&token| token * unit..(token + 1) * unit)
            .collect()
    }
}

/// The order that puts `order`'s rows back: `inverse(order)[order[i]] = i`.
pub(super) fn inverse(order: &[usize]) -> Vec<usize> {
    let mut back = vec![0; order.len()];
    for (at, &row) in order.iter().enumerate() {
        back[row] = at;
    }
    back
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 6×4-patch image in windows of 2×2 merged tokens (3×2 tokens): one whole window, then
    /// one cut short by the image's bottom edge; a 2-frame 4×6 image of 2×3 tokens: per frame,
    /// a whole window and one cut short at the right, the second frame after the first.
    #[test]
    fn windows_follow_transformers_layout() {
        let windows = Windows::of(&[[1, 6, 4], [2, 4, 6]], 2, 2);
        // Tokens of the first image: row-major 3×2 → [0 1; 2 3; 4 5].
        // Second image, frame 0 from 6: [6 7 8; 9 10 11]; frame 1 from 12: [12 13 14; 15 16 17].
        assert_eq!(
            windows.units,
            [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 8, 11, 12, 13, 15, 16, 14, 17]
        );
        assert_eq!(windows.rows, [16, 8, 16, 8, 16, 8]);
        assert_eq!(&windows.tower_rows()[..8], [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(&windows.tower_rows()[32..36], [36, 37, 38, 39]);
        // A grid whose tokens fill its windows exactly gets no empty window (transformers
        // pads a whole window there, and drops its zero length).
        let exact = Windows::of(&[[1, 4, 4]], 2, 2);
        assert_eq!((exact.units, exact.rows), (vec![0, 1, 2, 3], vec![16]));
    }

    #[test]
    fn inverse_puts_rows_back() {
        let order = Windows::of(&[[1, 10, 6], [1, 4, 4]], 2, 2).tower_rows();
        let back = inverse(&order);
        let restored: Vec<usize> = back.iter().map(|&at| order[at]).collect();
        assert_eq!(restored, (0..order.len()).collect::<Vec<_>>());
    }
}
