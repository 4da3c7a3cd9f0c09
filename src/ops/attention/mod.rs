//! Scaled dot-product attention within segments, `softmax(q·kᵀ·scale)·v`, as a backend extension.
//!
//! Composed from Burn's ops it is two batched matmuls around a scale and a softmax, with copies
//! of `q`, `k` and `v` into head-major order and of the output back; on Flex (the CPU backend)
//! most of its time is the softmax's scalar `exp` (BENCHMARKS.md has the figures). Flex runs its
//! own pass instead (`flex.rs`); the GPU backends keep the composed form (`composed`), which
//! Burn's fusion compiles with its neighbours, or run one WGSL kernel (`wgsl.rs`).

mod flex;
mod wgsl;

use burn::backend::{Backend, Dispatch, TensorMetadata, backend_extension, tensor::FloatTensor};
use burn::tensor::{DType, Tensor};

use crate::named::named_choice;
use crate::ops::hardware;
use crate::runtime::device::{DeviceClass, RuntimeDevice};

/// Attention with a faster implementation than its composition on some backend.
#[backend_extension(Cube, Flex, Fusion)]
pub(crate) trait SdpaBackend: Backend {
    /// For `q`: `[segments, queries, heads, head_dim]` and `k`, `v`: `[segments, len, heads,
    /// head_dim]` (all of one dtype), each segment's queries attend to its own `len` keys, head
    /// by head: `softmax(q·kᵀ·scale)·v`, the softmax taken in f32. Output shaped as `q`.
    #[fusion(default)]
    fn attend(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        composed::<Self>(q, k, v, scale)
    }

    /// The same attention (shapes as in [`SdpaBackend::attend`]) in one kernel that never
    /// writes the scores out, where the backend has one: on the wgpu backend
    /// `wgsl.rs`; elsewhere [`SdpaBackend::attend`].
    #[fusion(dtype = q, shape = q)]
    fn attend_fused(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        Self::attend(q, k, v, scale)
    }
}

named_choice! {
    /// Which implementation computes attention.
    #[derive(Hash, Default)]
    pub enum AttentionKernel {
        /// Per device ([`AttentionKernel::resolve`]): `fused` on a hardware GPU (once its shader
        /// has passed its tests on one), `burn` elsewhere. Unresolved, it runs as `burn`.
        #[default]
        Auto,
        /// `SdpaBackend::attend`: Burn's ops on the GPU (`composed`), mmlora's own pass on the
        /// CPU.
        Burn,
        /// `SdpaBackend::attend_fused`: one WGSL kernel on the GPU, the same pass as `Burn` on
        /// the CPU.
        Fused,
    }
}

impl AttentionKernel {
    /// The two implementations `Auto` picks from.
    pub const BOTH: [AttentionKernel; 2] = [AttentionKernel::Burn, AttentionKernel::Fused];

    /// The implementation this choice runs on `device`. `Auto` takes the fused kernel on a
    /// hardware GPU, where Burn's composition writes every score out to memory and reads it
    /// back, once the kernel's shader has passed its tests on one (`ops/hardware.rs`).
    /// It takes Burn's on a software GPU, where the kernel's workgroup barriers cost more than
    /// the passes they save (both measured in BENCHMARKS.md), and on the CPU, where both are
    /// mmlora's own pass.
    pub fn resolve(self, device: &RuntimeDevice) -> Self {
        match (self, device.class()) {
            (AttentionKernel::Auto, DeviceClass::HardwareGpu)
                if hardware::checked("attention/attention.wgsl", wgsl::SHADER) =>
            {
                AttentionKernel::Fused
            }
            (AttentionKernel::Auto, _) => AttentionKernel::Burn,
            (chosen, _) => chosen,
        }
    }
}

impl AttentionKernel {
    /// Whether this choice, resolved, writes every score out to device memory for heads of
    /// `head_dim`: Burn's composition does, and so does the fused kernel where it does not take
    /// that width ([`SdpaBackend::attend_fused`] then runs the composition).
    pub(crate) fn writes_scores(self, head_dim: usize) -> bool {
        !(self == AttentionKernel::Fused && wgsl::takes(head_dim))
    }
}

/// The attention from Burn's ops, on any backend: the scores cast to f32 for the softmax (as
/// PyTorch's autocast runs it) and the weights back to the inputs' dtype.
pub(crate) fn composed<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    scale: f64,
) -> FloatTensor<B> {
    let dtype = q.dtype();
    let head_major = |t: FloatTensor<B>| B::float_swap_dims(t, 1, 2);
    let k_t = B::float_swap_dims(head_major(k), 2, 3);
    let scores = B::float_cast(B::float_matmul(head_major(q), k_t), DType::F32.into());
    // A pass over every score, skipped where `q` carries the scale (as the tower's does).
    let scores = if scale == 1.0 {
        scores
    } else {
        B::float_mul_scalar(scores, scale.into())
    };
    let weights = B::float_cast(B::softmax(scores, 3), dtype.into());
    B::float_swap_dims(B::float_matmul(weights, head_major(v)), 1, 2)
}

/// `softmax(q·kᵀ·scale)·v` per segment and head on the backend of `q`'s device (shapes as in
/// `SdpaBackend::attend`), computed by `kernel`.
pub fn attend(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    kernel: AttentionKernel,
) -> Tensor<4> {
    let (q, k, v) = (q.into_dispatch(), k.into_dispatch(), v.into_dispatch());
    Tensor::from_dispatch(match kernel {
        AttentionKernel::Fused => <Dispatch as SdpaBackend>::attend_fused(q, k, v, scale),
        AttentionKernel::Burn | AttentionKernel::Auto => {
            <Dispatch as SdpaBackend>::attend(q, k, v, scale)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::flex::QUERY_BLOCK;
    use super::*;
    use crate::runtime::device;
    use crate::runtime::wgsl;
    use burn::backend::Flex;
    use burn::tensor::Distribution;
    use burn::tensor::TensorData;

    /// `[segments, rows, heads, head_dim]` values, row-major.
    type Values = (Vec<f32>, [usize; 4]);

    fn host(t: &Tensor<4>) -> Values {
        let values = t.clone().into_data().try_to_vec::<f32>().unwrap();
        (values, t.dims())
    }

    /// Checks `got` against float64 attention of `q`, `k`, `v` with a bound from the f32
    /// arithmetic's roundings, plus `rounding` (relative) for an output stored narrower than
    /// f32, element by element.
    fn assert_matches_float64(
        got: &Tensor<4>,
        q: &Tensor<4>,
        k: &Tensor<4>,
        v: &Tensor<4>,
        scale: f64,
        rounding: f64,
    ) {
        let ((q, [segments, queries, heads, head_dim]), (k, [_, len, _, _]), (v, _)) =
            (host(q), host(k), host(v));
        let (got, dims) = host(got);
        assert_eq!(dims, [segments, queries, heads, head_dim]);
        let epsilon = f64::from(f32::EPSILON);
        let at =
            |rows: usize, s: usize, r: usize, h: usize| ((s * rows + r) * heads + h) * head_dim;
        for (s, i, h) in every_segment_query_head(segments, queries, heads) {
            let qi = &q[at(queries, s, i, h)..][..head_dim];
            let key = |j: usize| &k[at(len, s, j, h)..][..head_dim];
            let scores: Vec<f64> = (0..len)
                .map(|j| {
                    scale
                        * qi.iter()
                            .zip(key(j))
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                })
                .collect();
            // How far each f32 score can be off: `head_dim` products summed and the scale.
            let score_error = (0..len)
                .map(|j| {
                    let magnitude: f64 = qi
                        .iter()
                        .zip(key(j))
                        .map(|(&a, &b)| f64::from(a * b).abs())
                        .sum();
                    (head_dim + 1) as f64 * epsilon * scale * magnitude
                })
                .fold(0.0, f64::max);
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let spread = scores.iter().map(|s| max - s).fold(0.0, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            // Tolerance: a weight's relative error is twice the scores' (its own and the max's),
            // the shift's rounding (ε · spread), `exp`'s (ε), the sum's (len · ε) and the
            // division's (ε); the weighted sum of values adds len · ε of Σ p·|v|.
            let relative =
                2.0 * score_error + spread * epsilon + (2 * len + 4) as f64 * epsilon + rounding;
            for d in 0..head_dim {
                let value = |j: usize| f64::from(v[at(len, s, j, h) + d]);
                let expected: f64 = (0..len).map(|j| weights[j] / total * value(j)).sum();
                let magnitude: f64 = (0..len).map(|j| weights[j] / total * value(j).abs()).sum();
                let got = f64::from(got[at(queries, s, i, h) + d]);
                assert!(
                    (got - expected).abs() <= relative * magnitude,
                    "segment {s}, query {i}, head {h}, dim {d}: {got} vs {expected} (bound {:e})",
                    relative * magnitude
                );
            }
        }
    }

    /// Every `(segment, query, head)` index, in order.
    fn every_segment_query_head(
        segments: usize,
        queries: usize,
        heads: usize,
    ) -> impl Iterator<Item = (usize, usize, usize)> {
        (0..segments)
            .flat_map(move |s| (0..queries).flat_map(move |q| (0..heads).map(move |h| (s, q, h))))
    }

    /// Segments of `len` rows sliced from a packed `[rows, 3, heads, head_dim]` qkv, as the
    /// tower passes them: `q` from row `first` of each segment (`queries` of them).
    fn packed(
        segments: usize,
        len: usize,
        first: usize,
        queries: usize,
        heads: usize,
        head_dim: usize,
        range: f64,
    ) -> [Tensor<4>; 3] {
        let cpu = device::cpu();
        let rows = segments * len;
        let qkv = Tensor::<4>::random(
            [rows, 3, heads, head_dim],
            Distribution::Uniform(-range, range),
            &cpu.device,
        );
        let part = |i: usize| {
            qkv.clone()
                .slice([0..rows, i..i + 1])
                .reshape([segments, len, heads, head_dim])
        };
        let q = part(0).slice([0..segments, first..first + queries]);
        [q, part(1), part(2)]
    }

    /// Flex's pass and the composed ops against float64: segments longer than a query block
    /// (a short last block), a block of queries from the middle of each segment, strided
    /// views of a packed qkv, and scores large enough that an unshifted `exp` would overflow.
    #[test]
    fn flex_and_composed_match_float64() {
        let cases = [
            // (segments, len, first query, queries, heads, head_dim, value range, scale)
            (3, QUERY_BLOCK + 44, 0, QUERY_BLOCK + 44, 2, 16, 1.0, 0.25),
            (2, 40, 7, 20, 3, 8, 1.0, 8f64.powf(-0.5)),
            (1, 24, 0, 24, 2, 80, 4.0, 1.0),
        ];
        for (segments, len, first, queries, heads, head_dim, range, scale) in cases {
            let [q, k, v] = packed(segments, len, first, queries, heads, head_dim, range);
            let flex = attend(
                q.clone(),
                k.clone(),
                v.clone(),
                scale,
                AttentionKernel::Burn,
            );
            assert_matches_float64(&flex, &q, &k, &v, scale, 0.0);
            let prim = |t: &Tensor<4>| t.clone().try_into_primitive::<Flex>().unwrap();
            let composed = Tensor::<4>::from_primitive::<Flex>(composed::<Flex>(
                prim(&q),
                prim(&k),
                prim(&v),
                scale,
            ));
            assert_matches_float64(&composed, &q, &k, &v, scale, 0.0);
        }
    }

    /// A key far above the others takes all the weight, and a segment of one key returns its
    /// value whatever the score.
    #[test]
    fn softmax_limits() {
        let cpu = device::cpu();
        let tensor = |values: Vec<f32>, rows: usize| {
            Tensor::<4>::from_data(TensorData::new(values, [1, rows, 1, 2]), &cpu.device)
        };
        let q = tensor(vec![1.0, 0.0], 1);
        let k = tensor(vec![1000.0, 0.0, 0.0, 0.0, -1000.0, 0.0], 3);
        let v = tensor(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3);
        let y = attend(q.clone(), k, v, 1.0, AttentionKernel::Burn)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        // Exact: the other weights are exp(−1000) and exp(−2000), zero in f32.
        assert_eq!(y, [1.0, 2.0]);
        let y = attend(
            q,
            tensor(vec![-1e30, 0.0], 1),
            tensor(vec![7.0, 8.0], 1),
            1.0,
            AttentionKernel::Burn,
        );
        assert_eq!(y.into_data().try_to_vec::<f32>().unwrap(), [7.0, 8.0]);
    }

    /// No keys: every output an empty sum, zero; no queries: no output.
    #[test]
    fn no_keys_or_no_queries() {
        let cpu = device::cpu();
        let zeros = |rows: usize| Tensor::<4>::zeros([2, rows, 3, 4], &cpu.device);
        let ones = |rows: usize| Tensor::<4>::ones([2, rows, 3, 4], &cpu.device);
        let y = attend(ones(5), zeros(0), zeros(0), 1.0, AttentionKernel::Burn);
        assert_eq!(y.dims(), [2, 5, 3, 4]);
        assert_eq!(y.into_data().try_to_vec::<f32>().unwrap(), vec![0.0; 120]);
        assert_eq!(
            attend(ones(0), ones(5), ones(5), 1.0, AttentionKernel::Burn).dims(),
            [2, 0, 3, 4]
        );
    }

    /// The fused kernel on the GPU against float64 in f32: the CPU test's cases, a short last
    /// block of queries and tile of keys, one key, and the widest head it takes. In f16 against
    /// float64 of the same f16 values, on the towers' head width (80) alone: the kernel is
    /// compiled for each head width and element type, the f16 one differs only in its loads
    /// and stores, and on lavapipe each compilation of a wide head costs a minute of LLVM.
    /// Burn's composition on the GPU too, on the case of the 2B tower's head width (each new
    /// shape autotunes Burn's matmul, seconds on lavapipe).
    #[test]
    fn gpu_kernels_match_float64() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let f16 = device::f16_for_tests(&gpu);
        let cases = [
            // (segments, len, first query, queries, heads, head_dim, value range, scale)
            (3, 300, 0, 300, 2, 16, 1.0, 0.25),
            (2, 40, 7, 20, 3, 8, 1.0, 8f64.powf(-0.5)),
            (1, 24, 0, 24, 2, 80, 4.0, 1.0),
            (2, 70, 0, 70, 2, 4, 2.0, 1.0),
            (2, 1, 0, 1, 3, 80, 1.0, 1.0),
            (1, 33, 0, 33, 1, 128, 1.0, 128f64.powf(-0.5)),
        ];
        for (segments, len, first, queries, heads, head_dim, range, scale) in cases {
            let [q, k, v] = packed(segments, len, first, queries, heads, head_dim, range);
            let on_gpu = |t: &Tensor<4>| t.clone().to_device(&gpu.device);
            let kernels: &[AttentionKernel] = if (len, head_dim) == (24, 80) {
                &AttentionKernel::BOTH
            } else {
                &[AttentionKernel::Fused]
            };
            for &kernel in kernels {
                let got = attend(on_gpu(&q), on_gpu(&k), on_gpu(&v), scale, kernel);
                assert_matches_float64(&got, &q, &k, &v, scale, 0.0);
            }
            if f16 && head_dim == 80 {
                // The f16 values, in f32 on the CPU for the reference.
                let half = |t: &Tensor<4>| on_gpu(t).cast(DType::F16);
                let [q, k, v] = [half(&q), half(&k), half(&v)];
                let wide = |t: &Tensor<4>| t.clone().cast(DType::F32);
                let got = attend(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    scale,
                    AttentionKernel::Fused,
                );
                // The output's rounding to f16: half an ulp, 2⁻¹¹ relative.
                let rounding = 2f64.powi(-11);
                assert_matches_float64(
                    &wide(&got),
                    &wide(&q),
                    &wide(&k),
                    &wide(&v),
                    scale,
                    rounding,
                );
            }
        }
    }

    /// The fused kernel's limits on the GPU: a key far above the others takes all the weight, a
    /// segment of one key returns its value whatever the score (in launches past one dispatch's
    /// (segment, head) pairs), no keys give zeros and no queries no output.
    #[test]
    fn gpu_fused_limits() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let tensor = |values: Vec<f32>, dims: [usize; 4]| {
            Tensor::<4>::from_data(TensorData::new(values, dims), &gpu.device)
        };
        let values = |t: Tensor<4>| t.into_data().try_to_vec::<f32>().unwrap();
        let fused = AttentionKernel::Fused;
        let q = tensor(vec![1.0, 0.0, 0.0, 0.0], [1, 1, 1, 4]);
        let k = [1000.0, -1000.0, 0.0]
            .iter()
            .flat_map(|&key| [key, 0.0, 0.0, 0.0])
            .collect();
        let v = (1..=12).map(|i| i as f32).collect();
        let y = attend(
            q.clone(),
            tensor(k, [1, 3, 1, 4]),
            tensor(v, [1, 3, 1, 4]),
            1.0,
            fused,
        );
        // Exact: the other weights are exp(−2000) and exp(−1000), zero in f32.
        assert_eq!(values(y), [1.0, 2.0, 3.0, 4.0]);

        let segments = wgsl::MAX_WORKGROUPS_PER_DIM as usize + 2;
        let distinct = |offset: f32| (0..segments * 4).map(|i| i as f32 + offset).collect();
        let ones = tensor(vec![1.0; segments * 4], [segments, 1, 1, 4]);
        let v: Vec<f32> = distinct(0.5);
        let y = attend(
            ones.clone(),
            tensor(distinct(-1e6), [segments, 1, 1, 4]),
            tensor(v.clone(), [segments, 1, 1, 4]),
            1.0,
            fused,
        );
        assert_eq!(values(y), v);

        let zeros = |rows: usize| Tensor::<4>::zeros([2, rows, 3, 4], &gpu.device);
        let y = attend(
            ones.clone().slice(0..2).repeat_dim(2, 3),
            zeros(0),
            zeros(0),
            1.0,
            fused,
        );
        assert_eq!(y.dims(), [2, 1, 3, 4]);
        assert_eq!(values(y), vec![0.0; 24]);
        assert_eq!(
            attend(zeros(0), zeros(5), zeros(5), 1.0, fused).dims(),
            [2, 0, 3, 4]
        );
    }
}
