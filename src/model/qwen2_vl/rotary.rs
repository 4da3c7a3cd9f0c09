//! 2-D rotary position embedding over the patch grid, in merge-block order: the angles
//! ([`cos_sin`]); [`crate::model::rope`] rotates `q` and `k` by them.

use burn::tensor::{Device, Tensor};

use super::{VisionConfig, host_tensor};

/// Rotary base.
const THETA: f32 = 10_000.0;

/// `cos` and `sin` per row, `[rows, 1, head_dim]`: the first quarter of the head rotates with
/// the patch's row, the second with its column, and the second half repeats the first.
pub(super) fn cos_sin(
    grids: &[[usize; 3]],
    config: &VisionConfig,
    device: &Device,
) -> (Tensor<3>, Tensor<3>) {
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
    (
        host_tensor(cos, [rows, 1, hd], device),
        host_tensor(sin, [rows, 1, hd], device),
    )
}
