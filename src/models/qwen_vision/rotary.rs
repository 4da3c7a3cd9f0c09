//! 2-D rotary position embedding over the patch grid, in merge-block order: the angles
//! ([`tables`]); [`crate::ops::rotary`] rotates `q` and `k` by them.

use burn::tensor::{Device, Int, Tensor, TensorData};

/// One forward's rotary tables, `cos` then `sin`, each `[rows, 1, head_dim]` in f32.
pub(crate) struct Rotary {
    /// For `q`, with the attention's scale `1/√head_dim` folded in: the rotated `q` comes out
    /// scaled, so `q·kᵀ` is the scaled scores. In f16, the unscaled product could overflow
    /// where the scaled one is far from it (PyTorch's SDPA scales before the product too).
    pub q: [Tensor<3>; 2],
    /// For `k`.
    pub k: [Tensor<3>; 2],
}

impl Rotary {
    /// The tables of the rows `rows` (indices into these), in that order.
    pub(crate) fn select(&self, rows: &Tensor<1, Int>) -> Self {
        let pick = |table: &Tensor<3>| table.clone().select(0, rows.clone());
        Self {
            q: self.q.each_ref().map(pick),
            k: self.k.each_ref().map(pick),
        }
    }
}

/// The rotary tables of `grids` for heads of `hd` values, merge blocks of `m`² patches and the
/// rotary base `theta`: per row, the first quarter of the head rotates with the patch's row,
/// the second with its column, and the second half repeats the first.
pub(crate) fn tables(
    grids: &[[usize; 3]],
    m: usize,
    hd: usize,
    theta: f32,
    device: &Device,
) -> Rotary {
    let spatial = hd / 2;
    let inv_freq: Vec<f32> = (0..spatial)
        .step_by(2)
        .map(|i| 1.0 / theta.powf(i as f32 / spatial as f32))
        .collect();
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &[t, h, w] in grids {
        for _ in 0..t {
            for bh in 0..h / m {
                for bw in 0..w / m {
                    for mh in 0..m {
                        for mw in 0..m {
                            let (row, col) = ((bh * m + mh) as f32, (bw * m + mw) as f32);
                            let angles: Vec<f32> = inv_freq
                                .iter()
                                .map(|f| row * f)
                                .chain(inv_freq.iter().map(|f| col * f))
                                .collect();
                            for _ in 0..2 {
                                cos.extend(angles.iter().map(|a| a.cos()));
                                sin.extend(angles.iter().map(|a| a.sin()));
                            }
                        }
                    }
                }
            }
        }
    }
    let rows = cos.len() / hd;
    let scale = (hd as f64).powf(-0.5);
    let table =
        |values: Vec<f32>| Tensor::from_data(TensorData::new(values, [rows, 1, hd]), device);
    let scaled = |values: &[f32]| {
        table(
            values
                .iter()
                .map(|&v| (f64::from(v) * scale) as f32)
                .collect(),
        )
    };
    Rotary {
        q: [scaled(&cos), scaled(&sin)],
        k: [table(cos), table(sin)],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen2_vl::{DEFAULT_ROPE_THETA, VisionConfig};
    use crate::runtime::device;

    /// The angles as transformers computes them: position × θ^(−2i/(head_dim/2)), the patch's
    /// row for the first quarter of the head and its column for the second, from the config's
    /// base. Tolerance: f32's rounding of the angle and of cos (a few ulps of values ≤ 3).
    #[test]
    fn angles_follow_the_configs_rotary_base() {
        let cpu = device::cpu();
        for theta in [DEFAULT_ROPE_THETA, 100.0] {
            let config = VisionConfig::tiny();
            let (hd, quarter) = (config.head_dim(), config.head_dim() / 4);
            let Rotary { k: [cos, _], .. } = tables(
                &[[1, 2, 4]],
                config.spatial_merge_size,
                hd,
                theta,
                &cpu.device,
            );
            let cos = cos.into_data().try_to_vec::<f32>().unwrap();
            // Merge-block order: the second block of 2×2 starts at row 0, column 2.
            let (row, column) = (0.0, 2.0);
            for i in 0..quarter {
                let inv_freq = f64::from(theta).powf(-((2 * i) as f64) / (hd / 2) as f64);
                for (offset, position) in [(0, row), (quarter, column)] {
                    let want = (position * inv_freq).cos();
                    let got = f64::from(cos[4 * hd + offset + i]);
                    assert!(
                        (got - want).abs() <= 1e-6,
                        "θ {theta}, i {i}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
