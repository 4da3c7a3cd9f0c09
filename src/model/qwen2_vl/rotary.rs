//! 2-D rotary position embedding over the patch grid, in merge-block order: the angles
//! ([`tables`]); [`crate::model::rope`] rotates `q` and `k` by them.

use burn::tensor::{Device, Tensor};

use super::{VisionConfig, host_tensor};

/// Rotary base.
const THETA: f32 = 10_000.0;

/// One forward's rotary tables, `cos` then `sin`, each `[rows, 1, head_dim]` in f32.
pub(super) struct Rotary {
    /// For `q`, with the attention's scale `1/√head_dim` folded in: the rotated `q` comes out
    /// scaled, so `q·kᵀ` is the scaled scores. In f16, the unscaled product could overflow
    /// where the scaled one is far from it (PyTorch's SDPA scales before the product too).
    pub q: [Tensor<3>; 2],
    /// For `k`.
    pub k: [Tensor<3>; 2],
}

/// The rotary tables of `grids`: per row, the first quarter of the head rotates with the
/// patch's row, the second with its column, and the second half repeats the first.
pub(super) fn tables(grids: &[[usize; 3]], config: &VisionConfig, device: &Device) -> Rotary {
    let hd = config.head_dim();
    let spatial = hd / 2;
    let inv_freq: Vec<f32> = (0..spatial)
        .step_by(2)
        .map(|i| 1.0 / THETA.powf(i as f32 / spatial as f32))
        .collect();
    let m = config.spatial_merge_size;
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
    let table = |values: Vec<f32>| host_tensor(values, [rows, 1, hd], device);
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
