//! The rotary embedding's rotation, `x·cos + rotate_half(x)·sin`, as a backend extension.
//!
//! Composed from Burn's ops it is two slices, a negation, a concatenation, two broadcast
//! products and a sum: five passes over `q` (and five over `k`) per block, each on one core on
//! Flex (the CPU backend), which runs one pass of its own instead (`flex.rs`).
//!
//! The tower rotates `q` and `k` where the packed `qkv` output holds them, in f32 whatever the
//! precision ([`rotate_packed`]). Composed, that is a copy of the part out of `qkv`, two casts
//! and the five passes (BENCHMARKS.md has their share of a pass on a hardware GPU). On the wgpu
//! backend `shaders/rotary/rotary.wgsl` does it in one pass that reads the part where it lies
//! (`wgsl.rs`); elsewhere it stays composed.

mod flex;
mod wgsl;

use std::ops::Range;

use burn::backend::{Backend, Dispatch, TensorMetadata, backend_extension, tensor::FloatTensor};
use burn::tensor::{FloatDType, Shape, Tensor};

use crate::ops::hardware;
use crate::runtime::device::{DeviceClass, RuntimeDevice};

/// Rotations with a faster implementation than their composition on some backend.
#[backend_extension(Cube, Flex, Fusion)]
pub trait RopeBackend: Backend {
    /// `x·cos + rotate_half(x)·sin` for `x`: `[rows, heads, head_dim]` (`head_dim` even) and
    /// `cos`, `sin`: `[rows, 1, head_dim]`, where `rotate_half` maps each head's halves
    /// `(a, b)` to `(−b, a)`.
    #[fusion(default)]
    fn rotate(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        composed::<Self>(x, cos, sin)
    }

    /// Part `part` of `qkv` (`[rows, parts, heads, head_dim]`, `head_dim` even), rotated as
    /// [`RopeBackend::rotate`] does but in f32 whatever `qkv`'s dtype, and returned in that
    /// dtype, `[rows, heads, head_dim]`; `cos`, `sin`: `[rows, 1, head_dim]` in f32.
    #[fusion(dtype = qkv, shape = Shape::from([qkv[0], qkv[2], qkv[3]]))]
    fn rotate_packed(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        part: usize,
    ) -> FloatTensor<Self> {
        packed_composed::<Self>(qkv, cos, sin, part)
    }
}

/// The rotation from Burn's ops, on any backend.
pub fn composed<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    let [rows, heads, head_dim] = x.shape().dims::<3>();
    let half = |columns: Range<usize>| {
        B::float_slice(
            x.clone(),
            &[(0..rows).into(), (0..heads).into(), columns.into()],
        )
    };
    let first = half(0..head_dim / 2);
    let second = half(head_dim / 2..head_dim);
    let rotated = B::float_cat(vec![B::float_neg(second), first], 2);
    B::float_add(B::float_mul(x, cos), B::float_mul(rotated, sin))
}

/// [`RopeBackend::rotate_packed`] from the backend's own ops: the part sliced out, cast to f32,
/// rotated by [`RopeBackend::rotate`] and cast back.
pub fn packed_composed<B: RopeBackend>(
    qkv: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    part: usize,
) -> FloatTensor<B> {
    let [rows, _, heads, head_dim] = qkv.shape().dims::<4>();
    let dtype = qkv.dtype();
    let x = B::float_slice(
        qkv,
        &[
            (0..rows).into(),
            (part..part + 1).into(),
            (0..heads).into(),
            (0..head_dim).into(),
        ],
    );
    let x = B::float_cast(
        B::float_reshape(x, Shape::from([rows, heads, head_dim])),
        FloatDType::F32,
    );
    B::float_cast(B::rotate(x, cos, sin), FloatDType::from(dtype))
}

/// `x·cos + rotate_half(x)·sin` on the backend of `x`'s device (shapes as in
/// [`RopeBackend::rotate`]); the models rotate packed rows ([`rotate_packed`]).
#[cfg(test)]
pub fn rotate(x: Tensor<3>, cos: &Tensor<3>, sin: &Tensor<3>) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as RopeBackend>::rotate(
        x.into_dispatch(),
        cos.clone().into_dispatch(),
        sin.clone().into_dispatch(),
    ))
}

/// How rotary runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RotaryKernel {
    /// The backend's own (`RopeBackend::rotate_packed`): one pass on Flex, one WGSL kernel
    /// (`shaders/rotary/rotary.wgsl`) on the wgpu backend.
    #[default]
    Fused,
    /// Burn's ops (`packed_composed`): on hardware GPUs until the kernel has passed its tests
    /// on one.
    Composed,
}

impl RotaryKernel {
    /// The implementation for `device`: the backend's own, but on a hardware GPU the kernel
    /// only once it has passed its tests on one (`ops/hardware.rs`).
    pub fn for_device(device: &RuntimeDevice) -> Self {
        if device.class() == DeviceClass::HardwareGpu
            && !hardware::elem_shader_checked("rotary", wgsl::SHADER)
        {
            RotaryKernel::Composed
        } else {
            RotaryKernel::Fused
        }
    }
}

/// Part `part` of `qkv` (`[rows, parts, heads, head_dim]`) rotated in f32 whatever `qkv`'s
/// dtype, the result `[rows, heads, head_dim]` in that dtype: under f16, transformers' Qwen2-VL
/// rotates `q` and `k` in f32 with f32 angles and casts back (`apply_rotary_pos_emb_vision`),
/// one rounding to f16 per value. `cos` and `sin` are `[rows, 1, head_dim]` in f32.
pub fn rotate_packed(
    qkv: &Tensor<4>,
    part: usize,
    cos: &Tensor<3>,
    sin: &Tensor<3>,
    kernel: RotaryKernel,
) -> Tensor<3> {
    let (qkv, cos, sin) = (
        qkv.clone().into_dispatch(),
        cos.clone().into_dispatch(),
        sin.clone().into_dispatch(),
    );
    Tensor::from_dispatch(match kernel {
        RotaryKernel::Fused => <Dispatch as RopeBackend>::rotate_packed(qkv, cos, sin, part),
        RotaryKernel::Composed => packed_composed::<Dispatch>(qkv, cos, sin, part),
    })
}

#[cfg(test)]
mod tests {
    use super::flex::ROWS_PER_TASK;
    use super::*;
    use crate::runtime::device::{self, RuntimeDevice};
    use burn::backend::Flex;
    use burn::tensor::DType;
    use burn::tensor::Distribution;

    /// Flex's pass gives the composed form's bits: at the 2B shape (rows spanning several
    /// tasks and a short last one), on a strided `x` (a slice of a packed qkv, as the tower
    /// passes it), and leaving the `x` a caller still holds as it was.
    #[test]
    fn flex_gives_the_composed_bits() {
        let cpu = device::cpu();
        let (rows, heads, head_dim) = (3 * ROWS_PER_TASK + 5, 16, 80);
        let qkv = Tensor::<4>::random(
            [rows, 3, heads, head_dim],
            Distribution::Uniform(-4.0, 4.0),
            &cpu.device,
        );
        let angles = |seed: f64| {
            Tensor::<3>::random(
                [rows, 1, head_dim],
                Distribution::Uniform(-seed, seed),
                &cpu.device,
            )
        };
        let (cos, sin) = (angles(1.0), angles(1.0));
        let dense_x =
            Tensor::<3>::random([rows, heads, head_dim], Distribution::Default, &cpu.device);
        let strided_x = qkv.slice([0..rows, 1..2]).reshape([rows, heads, head_dim]);
        for x in [dense_x, strided_x] {
            let before = x.clone().into_data();
            let expected = Tensor::<3>::from_primitive::<Flex>(composed::<Flex>(
                x.clone().try_into_primitive::<Flex>().unwrap(),
                cos.clone().try_into_primitive::<Flex>().unwrap(),
                sin.clone().try_into_primitive::<Flex>().unwrap(),
            ));
            // Tolerance: none; the same f32 products and sums in the same order.
            rotate(x.clone(), &cos, &sin)
                .into_data()
                .assert_eq(&expected.into_data(), true);
            x.into_data().assert_eq(&before, true);
        }
    }

    /// [`rotate_packed`] on every device there is (Flex, and our kernel on the GPU), and Burn's
    /// ops ([`RotaryKernel::Composed`]) beside it, in f32 and in f16 where the GPU has it: each
    /// value is the float64 rotation of the inputs, rounded
    /// once to the output's type, as transformers computes it (rotating in f16 rounds each
    /// product and the sum too, and misses this bound). Shapes: the 2B tower's heads with
    /// every part of the packed tensor, and heads whose halves are odd.
    #[test]
    fn packed_parts_rotate_in_f32_and_round_once() {
        let mut runs = vec![(device::cpu(), DType::F32)];
        if let Some(gpu) = device::gpu_for_tests() {
            runs.push((gpu.clone(), DType::F32));
            if device::f16_for_tests(&gpu) {
                runs.push((gpu, DType::F16));
            }
        }
        for (on, dtype) in runs {
            for (rows, parts, heads, head_dim) in [(37, 3, 16, 80), (5, 2, 3, 6)] {
                for (part, kernel) in (0..parts).flat_map(|p| KERNELS.map(|k| (p, k))) {
                    check_packed(&on, dtype, [rows, parts, heads, head_dim], part, kernel);
                }
            }
        }
    }

    /// More rows than one dispatch may hold: the rows past the first launch come out of the
    /// second one, right.
    #[test]
    fn packed_rows_beyond_one_dispatch() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let rows = crate::runtime::wgsl::MAX_WORKGROUPS_PER_DIM as usize + 3;
        check_packed(&gpu, DType::F32, [rows, 2, 1, 2], 1, RotaryKernel::Fused);
    }

    const KERNELS: [RotaryKernel; 2] = [RotaryKernel::Fused, RotaryKernel::Composed];

    /// On a hardware GPU the kernel waits for a hardware run; elsewhere the backend's own runs.
    /// Seen through a GPU marked as hardware, too, since CI has none.
    #[test]
    fn the_kernel_on_hardware_gpus_once_checked_there() {
        assert_eq!(
            RotaryKernel::for_device(&device::cpu()),
            RotaryKernel::Fused
        );
        if let Some(gpu) = device::gpu_for_tests() {
            let hardware = RuntimeDevice {
                hardware_gpu: true,
                ..gpu.clone()
            };
            assert_eq!(RotaryKernel::for_device(&hardware), RotaryKernel::Composed);
            let software = RuntimeDevice {
                hardware_gpu: false,
                ..gpu
            };
            assert_eq!(RotaryKernel::for_device(&software), RotaryKernel::Fused);
        }
    }

    /// [`rotate_packed`] with `kernel` of part `part` of a random `[rows, parts, heads,
    /// head_dim]` tensor of `dtype` on `on`, against float64.
    fn check_packed(
        on: &RuntimeDevice,
        dtype: DType,
        shape: [usize; 4],
        part: usize,
        kernel: RotaryKernel,
    ) {
        let [rows, _, heads, head_dim] = shape;
        // Values up to 8 and angles of every sign, so sums cancel.
        let qkv =
            Tensor::<4>::random(shape, Distribution::Uniform(-8.0, 8.0), &on.device).cast(dtype);
        let angle = || {
            Tensor::<3>::random(
                [rows, 1, head_dim],
                Distribution::Uniform(-1.0, 1.0),
                &on.device,
            )
        };
        let (cos, sin) = (angle(), angle());
        let got = rotate_packed(&qkv, part, &cos, &sin, kernel);
        assert_eq!(got.dims(), [rows, heads, head_dim]);
        assert_eq!(got.dtype(), dtype);
        let floats = |t: Tensor<3>| -> Vec<f64> {
            let values = t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
            values.into_iter().map(f64::from).collect()
        };
        let x = floats(
            qkv.slice([0..rows, part..part + 1])
                .reshape([rows, heads, head_dim]),
        );
        let (cos, sin, got) = (floats(cos), floats(sin), floats(got));
        let half = head_dim / 2;
        for (i, &y) in got.iter().enumerate() {
            let (row, j) = (i / (heads * head_dim), i % head_dim);
            let head = i - j;
            let angle = row * head_dim + j;
            let partner = if j < half {
                -x[head + j + half]
            } else {
                x[head + j - half]
            };
            let (a, b) = (x[i] * cos[angle], partner * sin[angle]);
            let exact = a + b;
            // Tolerance: f32's two products and sum, 2^-23 · (|a| + |b|), plus in f16 half an
            // f16 ulp of the result (its one rounding; 2^-24 below f16's normal range).
            let rounding = if dtype == DType::F16 {
                let ulp = if exact.abs() < 2f64.powi(-14) {
                    2f64.powi(-24)
                } else {
                    2f64.powi(exact.abs().log2().floor() as i32 - 10)
                };
                ulp / 2.0
            } else {
                0.0
            };
            let bound = rounding + 2f64.powi(-23) * (a.abs() + b.abs());
            assert!(
                (y - exact).abs() <= bound,
                "{} {dtype:?} {shape:?} part {part}, value {i}: {y} against {exact}, bound \
                 {bound:e}",
                on.description
            );
        }
    }

    /// The rotation itself, on one head against float64: `(a, b) → (a·c − b·s, b·c + a·s)`.
    #[test]
    fn rotates_each_half_pair() {
        let cpu = device::cpu();
        let x = Tensor::<3>::from_floats([[[1.0, 2.0, 3.0, 4.0]]], &cpu.device);
        let cos = Tensor::<3>::from_floats([[[0.5, 0.25, 2.0, 4.0]]], &cpu.device);
        let sin = Tensor::<3>::from_floats([[[1.0, -1.0, 0.5, 0.125]]], &cpu.device);
        let y = rotate(x, &cos, &sin)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        // Exact in f32: every product and sum is a small dyadic rational. Halves (1, 2) and
        // (3, 4): 1·0.5 − 3·1, 2·0.25 − 4·(−1), 3·2 + 1·0.5, 4·4 + 2·0.125.
        assert_eq!(y, [-2.5, 4.5, 6.5, 16.25]);
    }
}
