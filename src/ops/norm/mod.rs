//! Layer norm in f32 whatever the model computes in, as a backend extension; RMSNorm
//! ([`rms_norm`], `rms.rs`).
//!
//! Composed ([`composed`]) it is a cast to f32, Burn's `layer_norm` and a cast back. On the CPU
//! backend Burn's `layer_norm` is one fused pass. On the wgpu backend it is two mean
//! reductions and the elementwise passes around them, several passes over the rows, where one
//! would do (BENCHMARKS.md has their share of a pass on a hardware GPU). There
//! `shaders/norm/layer_norm.wgsl` does it in one launch (`wgsl.rs`), on hardware GPUs
//! ([`NormKernel`]).

mod rms;
mod wgsl;

pub use rms::rms_norm;

use burn::backend::{
    Backend, Dispatch, Flex, TensorMetadata, backend_extension, tensor::FloatTensor,
};
use burn::tensor::{DType, FloatDType, Tensor};

use crate::ops::hardware;
use crate::runtime::device::{DeviceClass, RuntimeDevice};

/// Which implementation runs a layer norm on the wgpu backend (the CPU backend has one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NormKernel {
    /// `NormBackend::layer_norm_f32`: `shaders/norm/layer_norm.wgsl`, for hardware GPUs.
    Fused,
    /// Burn's ops (`composed`): for software GPUs, where the kernel's workgroup barriers cost
    /// more than the passes they save (measured on lavapipe: BENCHMARKS.md).
    #[default]
    Composed,
}

impl NormKernel {
    /// The implementation for `device`: the kernel on a hardware GPU once it has passed its
    /// tests on one (`ops/hardware.rs`), else Burn's ops.
    pub fn for_device(device: &RuntimeDevice) -> Self {
        if device.class() == DeviceClass::HardwareGpu
            && hardware::elem_shader_checked("norm", wgsl::SHADER)
        {
            NormKernel::Fused
        } else {
            NormKernel::Composed
        }
    }
}

/// Layer norms with a faster implementation than their composition on some backend.
#[backend_extension(Cube, Flex, Fusion)]
pub trait NormBackend: Backend {
    /// Each row of `x` (`[rows, width]`) normalised in f32, `weight` and `bias` (`[width]`, f32)
    /// applied in f32, the result in `x`'s dtype: `(x − mean) / sqrt(var + epsilon) · weight +
    /// bias`, mean and (biased) var over the row.
    #[fusion(dtype = x, shape = x)]
    fn layer_norm_f32(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        composed::<Self>(x, weight, bias, epsilon)
    }
}

/// The CPU backend's own `layer_norm` is already one pass.
impl NormBackend for Flex {}

/// [`NormBackend::layer_norm_f32`] from the backend's own ops: a cast to f32, the backend's
/// `layer_norm` and a cast back to `x`'s dtype.
pub fn composed<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: FloatTensor<B>,
    epsilon: f64,
) -> FloatTensor<B> {
    let dtype = x.dtype();
    let normed = B::layer_norm(
        B::float_cast(x, FloatDType::F32),
        weight,
        Some(bias),
        epsilon,
    );
    B::float_cast(normed, FloatDType::from(dtype))
}

/// Each row of `x` normalised in f32 with `weight` and `bias` (f32), the result in `x`'s dtype
/// (as PyTorch's autocast runs layer_norm: an f16 variance overflows), by `kernel` on the
/// backend of `x`'s device.
pub fn layer_norm(
    x: Tensor<2>,
    weight: &Tensor<1>,
    bias: &Tensor<1>,
    epsilon: f64,
    kernel: NormKernel,
) -> Tensor<2> {
    match kernel {
        NormKernel::Fused => Tensor::from_dispatch(<Dispatch as NormBackend>::layer_norm_f32(
            x.into_dispatch(),
            weight.clone().into_dispatch(),
            bias.clone().into_dispatch(),
            epsilon,
        )),
        NormKernel::Composed => {
            let dtype = x.dtype();
            let normed = burn::tensor::module::layer_norm(
                x.cast(DType::F32),
                weight.clone(),
                Some(bias.clone()),
                epsilon,
            );
            normed.cast(dtype)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::runtime::device::{self, RuntimeDevice};
    use burn::tensor::{DType, Distribution};

    /// Rows of `width` values on `device` in `dtype`, with f32 weight and bias: random rows
    /// around an offset, and the last row nearly constant (its variance below epsilon, so a
    /// kernel that drops epsilon is caught).
    fn inputs(
        rows: usize,
        width: usize,
        dtype: DType,
        device: &RuntimeDevice,
    ) -> (Tensor<2>, Tensor<1>, Tensor<1>) {
        let d = &device.device;
        let x = Tensor::<2>::random([rows, width], Distribution::Uniform(-3.0, 5.0), d);
        let flat = Tensor::<2>::random([1, width], Distribution::Uniform(0.999, 1.001), d);
        let x = Tensor::cat(vec![x.slice(0..rows - 1), flat], 0).cast(dtype);
        let weight = Tensor::<1>::random([width], Distribution::Uniform(0.5, 1.5), d);
        let bias = Tensor::<1>::random([width], Distribution::Uniform(-0.5, 0.5), d);
        (x, weight, bias)
    }

    fn floats<const D: usize>(t: Tensor<D>) -> Vec<f64> {
        let values = t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
        values.into_iter().map(f64::from).collect()
    }

    /// [`layer_norm`] on `device` in `dtype` against float64, row by row. Tolerance: the two
    /// sums over a row of `width` values are each within γ_width = width·u of exact (u = 2⁻²⁴),
    /// relative to the sum of magnitudes, and the rest adds a few roundings; so each output is
    /// within (width + 8)·u · (|weight|·(|x| + mean |x|) / σ + |bias|) of exact, σ = sqrt(var +
    /// epsilon), plus one rounding to f16 (2⁻¹¹ of the value) in f16. (The mean's error scales
    /// with the mean of the magnitudes, not with |mean|, which can be near 0.)
    pub(crate) fn check(
        device: &RuntimeDevice,
        kernel: NormKernel,
        rows: usize,
        width: usize,
        dtype: DType,
    ) {
        let epsilon = 1e-6;
        let (x, weight, bias) = inputs(rows, width, dtype, device);
        let y = layer_norm(x.clone(), &weight, &bias, epsilon, kernel);
        assert_eq!((y.dtype(), y.dims()), (dtype, [rows, width]));
        let (x, y) = (floats(x), floats(y));
        let (weight, bias) = (floats(weight), floats(bias));
        let u = f64::from(f32::EPSILON) / 2.0;
        let gamma = (width + 8) as f64 * u;
        let rounding = if dtype == DType::F16 {
            2f64.powi(-11)
        } else {
            0.0
        };
        for (row, (x, y)) in x.chunks(width).zip(y.chunks(width)).enumerate() {
            let mean = x.iter().sum::<f64>() / width as f64;
            let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
            let sigma = (var + epsilon).sqrt();
            let magnitude = x.iter().map(|v| v.abs()).sum::<f64>() / width as f64;
            for c in 0..width {
                let want = (x[c] - mean) / sigma * weight[c] + bias[c];
                let bound = gamma
                    * (weight[c].abs() * (x[c].abs() + magnitude) / sigma + bias[c].abs())
                    + rounding * want.abs();
                let error = (y[c] - want).abs();
                assert!(
                    error <= bound,
                    "{dtype:?} row {row} column {c}: {} against {want}, error {error:e} > {bound:e}",
                    y[c]
                );
            }
        }
    }

    /// Both implementations on the CPU backend (where both are Flex's one pass), and the
    /// composed form on the GPU in both precisions.
    #[test]
    fn the_composed_form_matches_float64() {
        for kernel in [NormKernel::Fused, NormKernel::Composed] {
            check(&device::cpu(), kernel, 37, 1280, DType::F32);
            check(&device::cpu(), kernel, 5, 6, DType::F32);
        }
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        check(&gpu, NormKernel::Composed, 37, 1280, DType::F32);
        if device::f16_for_tests(&gpu) {
            check(&gpu, NormKernel::Composed, 37, 1280, DType::F16);
        }
    }

    /// The kernel on hardware GPUs only, once it has passed its tests on one: not yet, so
    /// Burn's ops everywhere (seen through a GPU marked as hardware, too, since CI has none).
    #[test]
    fn the_kernel_on_hardware_gpus_only() {
        assert_eq!(NormKernel::for_device(&device::cpu()), NormKernel::Composed);
        if let Some(gpu) = device::gpu_for_tests() {
            let hardware = RuntimeDevice {
                hardware_gpu: true,
                ..gpu.clone()
            };
            assert!(
                !hardware::elem_shader_checked("norm", wgsl::SHADER),
                "update this test with CHECKED"
            );
            assert_eq!(NormKernel::for_device(&hardware), NormKernel::Composed);
            assert_eq!(NormKernel::for_device(&gpu), NormKernel::Composed);
        }
    }
}
