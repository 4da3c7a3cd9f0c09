//! RMSNorm (Qwen2.5-VL's norms) from Burn's ops, on any backend: each row divided by the root
//! of its mean square plus epsilon in f32, cast back to the input's dtype, then multiplied by
//! the weight in that dtype, in transformers' `Qwen2RMSNorm` order (an f16 mean of squares
//! would overflow).

use burn::tensor::{DType, Tensor};

/// Each row of `x` (`[rows, width]`) over `sqrt(mean(x²) + epsilon)` in f32, then times
/// `weight` (`[width]`, kept in f32) in `x`'s dtype.
pub fn rms_norm(x: Tensor<2>, weight: &Tensor<1>, epsilon: f64) -> Tensor<2> {
    let dtype = x.dtype();
    let x = x.cast(DType::F32);
    let mean_square = (x.clone() * x.clone()).mean_dim(1);
    let normed = x / (mean_square + epsilon).sqrt();
    normed.cast(dtype) * weight.clone().cast(dtype).unsqueeze::<2>()
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;
    use crate::runtime::device::{self, RuntimeDevice};

    fn floats<const D: usize>(t: Tensor<D>) -> Vec<f64> {
        let values = t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
        values.into_iter().map(f64::from).collect()
    }

    /// [`rms_norm`] on `device` in `dtype` against float64, row by row; the last row nearly
    /// zero, so that a norm that drops epsilon is caught. Tolerance: the mean of `width`
    /// squares (all positive) is within (width + 1)·u of exact, relatively (u = 2⁻²⁴); the
    /// root halves that and adds one rounding, the divide and the product with the weight one
    /// each; so each output is within ((width + 1)/2 + 4)·u of its value, plus in f16 the
    /// casts of the normalised row and of the weight and the product, 2⁻¹¹ of the value each,
    /// or half of f16's subnormal spacing (2⁻²⁵) below its normal range.
    fn check(device: &RuntimeDevice, rows: usize, width: usize, dtype: DType) {
        let epsilon = 1e-6;
        let d = &device.device;
        let x = Tensor::<2>::random([rows, width], Distribution::Uniform(-3.0, 5.0), d);
        let tiny = Tensor::<2>::random([1, width], Distribution::Uniform(-1e-4, 1e-4), d);
        let x = Tensor::cat(vec![x, tiny], 0).cast(dtype);
        let weight = Tensor::<1>::random([width], Distribution::Uniform(0.5, 1.5), d);
        let y = rms_norm(x.clone(), &weight, epsilon);
        assert_eq!((y.dtype(), y.dims()), (dtype, [rows + 1, width]));
        let (x, y, weight) = (floats(x), floats(y), floats(weight));
        let u = f64::from(f32::EPSILON) / 2.0;
        let f16 = dtype == DType::F16;
        let relative =
            ((width + 1) as f64 / 2.0 + 4.0) * u + if f16 { 3.0 * 2f64.powi(-11) } else { 0.0 };
        let absolute = if f16 { 3.0 * 2f64.powi(-25) } else { 0.0 };
        for (row, (x, y)) in x.chunks(width).zip(y.chunks(width)).enumerate() {
            let mean_square = x.iter().map(|v| v * v).sum::<f64>() / width as f64;
            let scale = (mean_square + epsilon).sqrt().recip();
            for c in 0..width {
                let want = x[c] * scale * weight[c];
                let error = (y[c] - want).abs();
                assert!(
                    error <= relative * want.abs() + absolute,
                    "{dtype:?} row {row} column {c}: {} against {want}",
                    y[c]
                );
            }
        }
    }

    #[test]
    fn matches_float64_on_every_backend() {
        check(&device::cpu(), 37, 1280, DType::F32);
        check(&device::cpu(), 5, 6, DType::F32);
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        check(&gpu, 37, 1280, DType::F32);
        if device::f16_for_tests(&gpu) {
            check(&gpu, 37, 1280, DType::F16);
        }
    }
}
