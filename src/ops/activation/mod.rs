//! The sigmoid-gated activations `x · sigmoid(s · x)` as a backend extension: QuickGELU (s =
//! 1.702, the MLP activation of Qwen2-VL's vision blocks), SiLU (s = 1, Qwen2.5-VL's, in its
//! gated MLP [`swiglu`]) and GELU's tanh approximation (Qwen3-VL's, `x · sigmoid(2k · (x +
//! 0.044715 x³))` with k = √(2/π), which is `x/2 · (1 + tanh(k · (x + 0.044715 x³)))`); and
//! GELU (the mergers') in f32 whatever the dtype.
//!
//! Composed from Burn's ops QuickGELU is three passes over the MLP's widest activation, and on
//! Flex (the CPU backend) each of them runs on one core with a scalar `exp`, a sizeable share of
//! a block (BENCHMARKS.md). Flex runs one pass of its own instead (`flex.rs`). The GPU backends
//! keep the composed form ([`composed`]), which Burn's fusion compiles into one kernel with its
//! neighbours.

mod flex;

use burn::backend::{Backend, Dispatch, backend_extension, tensor::FloatTensor, wgpu::CubeBackend};
use burn::tensor::activation::gelu;
use burn::tensor::{DType, Tensor};

/// QuickGELU's slope: `x · sigmoid(1.702 · x)` approximates GELU.
pub const QUICK_GELU_SLOPE: f32 = 1.702;

/// SiLU's slope: `x · sigmoid(x)`.
pub const SILU_SLOPE: f32 = 1.0;

/// GELU-tanh's gate slope, 2·√(2/π): `0.5 · (1 + tanh(z)) = sigmoid(2z)`.
pub const GELU_TANH_SLOPE: f32 = 2.0 * 0.797_884_6;

/// GELU-tanh's cubic coefficient.
pub const GELU_TANH_CUBIC: f32 = 0.044_715;

/// Activations with a faster implementation than their composition on some backend.
#[backend_extension(Cube, Flex, Fusion)]
pub trait ActivationBackend: Backend {
    /// `x · sigmoid(1.702 · x)`, element-wise.
    #[fusion(default)]
    fn quick_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::<Self>(x, QUICK_GELU_SLOPE)
    }

    /// `x · sigmoid(x)`, element-wise.
    #[fusion(default)]
    fn silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::<Self>(x, SILU_SLOPE)
    }

    /// `x · sigmoid(2k · (x + 0.044715 x³))` (GELU's tanh approximation), element-wise.
    #[fusion(default)]
    fn gelu_tanh(x: FloatTensor<Self>) -> FloatTensor<Self> {
        composed_gelu_tanh::<Self>(x)
    }
}

/// `x · sigmoid(slope · x)` from Burn's element-wise ops, on any backend.
pub fn composed<B: Backend>(x: FloatTensor<B>, slope: f32) -> FloatTensor<B> {
    let gate = B::sigmoid(B::float_mul_scalar(x.clone(), slope.into()));
    B::float_mul(x, gate)
}

/// GELU-tanh from Burn's element-wise ops, on any backend.
pub fn composed_gelu_tanh<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let cube = B::float_mul(B::float_mul(x.clone(), x.clone()), x.clone());
    let inner = B::float_add(x.clone(), B::float_mul_scalar(cube, GELU_TANH_CUBIC.into()));
    let gate = B::sigmoid(B::float_mul_scalar(inner, GELU_TANH_SLOPE.into()));
    B::float_mul(x, gate)
}

/// QuickGELU of `x` on the backend of its device.
pub fn quick_gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as ActivationBackend>::quick_gelu(
        x.into_dispatch(),
    ))
}

/// SiLU of `x` on the backend of its device.
pub fn silu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as ActivationBackend>::silu(x.into_dispatch()))
}

/// GELU-tanh (`gelu_pytorch_tanh`, Qwen3-VL's MLP activation) of `x` on the backend of its
/// device, computed in f32 whatever `x`'s dtype, as PyTorch computes it in half precision.
pub fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let dtype = x.dtype();
    let y = <Dispatch as ActivationBackend>::gelu_tanh(x.cast(DType::F32).into_dispatch());
    Tensor::<D>::from_dispatch(y).cast(dtype)
}

/// The gated MLP's activation (SwiGLU): `silu(gate) · up`, element-wise.
pub fn swiglu(gate: Tensor<2>, up: Tensor<2>) -> Tensor<2> {
    silu(gate) * up
}

/// GELU, `x · Φ(x)` with the error function (the merger's activation), computed in f32
/// whatever `x`'s dtype, the result in `x`'s dtype: PyTorch's f16 GELU computes in f32 and
/// rounds once, while Burn's composed GELU on an f16 tensor evaluates its `erf` polynomial in
/// f16 and loses the negative tail (on lavapipe, −0 for GELU(−5.02) = −1.3·10⁻⁶).
pub fn gelu_in_f32<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let dtype = x.dtype();
    gelu(x.cast(DType::F32)).cast(dtype)
}

impl ActivationBackend for CubeBackend {}

#[cfg(test)]
mod tests {
    use super::flex::CHUNK;
    use super::*;
    use crate::runtime::device;
    use burn::backend::Flex;
    use burn::tensor::{Distribution, TensorData};

    /// An activation `x · sigmoid(z(x))` under test: the op, its gate's argument `z` in
    /// float64, and how many roundings f32 makes computing `z` (each moves `exp`'s argument by
    /// up to |z|·ε, which `exp` turns into that relative error).
    struct Gated {
        op: fn(Tensor<1>) -> Tensor<1>,
        z: fn(f64) -> f64,
        roundings: f64,
    }

    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

    const GATED: [Gated; 3] = [
        Gated {
            op: quick_gelu::<1>,
            z: |x| 1.702 * x,
            roundings: 1.0,
        },
        Gated {
            op: silu::<1>,
            z: |x| x,
            roundings: 1.0,
        },
        // The cube (2), the products with the cubic's coefficient and the slope, the sum, and
        // the f32 slope itself.
        Gated {
            op: gelu_tanh::<1>,
            z: |x| 2.0 * SQRT_2_OVER_PI * (x + 0.044715 * x * x * x),
            roundings: 6.0,
        },
    ];

    /// Flex's pass against float64 over the range that matters and past both ends, with a
    /// length that leaves a remainder after the 8-value lanes and spans several rayon tasks.
    #[test]
    fn flex_matches_float64() {
        for gated in GATED {
            check_flex(&gated);
        }
    }

    fn check_flex(gated: &Gated) {
        let cpu = device::cpu();
        let n = 3 * CHUNK + 5;
        let x = Tensor::<2>::random([n, 1], Distribution::Uniform(-12.0, 12.0), &cpu.device);
        let mut values = x.into_data().try_to_vec::<f32>().unwrap();
        values.extend([
            0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0, 60.0, -60.0, 100.0, -100.0,
        ]);
        let len = values.len();
        let x = Tensor::<1>::from_data(TensorData::new(values.clone(), [len]), &cpu.device);
        let y = (gated.op)(x).into_data().try_to_vec::<f32>().unwrap();
        let epsilon = f64::from(f32::EPSILON);
        for (&x, &y) in values.iter().zip(&y) {
            let z = (gated.z)(f64::from(x));
            let expected = f64::from(x) / (1.0 + (-z).exp());
            let error = (f64::from(y) - expected).abs();
            if -z >= f64::from(f32::MAX).ln() {
                // exp(−z) overflows f32 (GELU-tanh from x ≈ −10 on, where the value is still
                // normal): the quotient flushes to ±0, off by |x| / (1 + exp(−z)) < |x| / MAX.
                let bound = f64::from(x).abs() / f64::from(f32::MAX);
                assert!(error <= bound, "x = {x}: {y} vs {expected}");
                continue;
            }
            if expected.abs() < f64::from(f32::MIN_POSITIVE) {
                // Below f32's normal range (x · exp(z) under 2⁻¹²⁶): flushing towards zero is
                // all f32 can do.
                assert!(
                    error < f64::from(f32::MIN_POSITIVE),
                    "x = {x}: {y} vs {expected}"
                );
                continue;
            }
            // Tolerance: the roundings of z, times |z| (what exp makes of them); exp's own
            // (≤ 2 ulp), the add and the divide add 4 ε.
            let bound = (gated.roundings * z.abs() + 4.0) * epsilon * expected.abs();
            assert!(
                error <= bound,
                "x = {x}: {y} vs {expected} (bound {bound:e})"
            );
        }
        assert_eq!(
            y[len - 1].to_bits(),
            (-0.0f32).to_bits(),
            "the activation at −100 is −0"
        );
    }

    /// Flex's pass and Burn's composed ops agree, on a strided view too, and the input a caller
    /// still holds is left as it was.
    #[test]
    fn flex_matches_composed_ops() {
        let cpu = device::cpu();
        let x = Tensor::<2>::random([96, 40], Distribution::Uniform(-8.0, 8.0), &cpu.device);
        let before = x.clone().into_data();
        let on_flex = |x: Tensor<2>, composed: &dyn Fn(FloatTensor<Flex>) -> FloatTensor<Flex>| {
            Tensor::<2>::from_primitive::<Flex>(composed(x.try_into_primitive::<Flex>().unwrap()))
        };
        for input in [x.clone(), x.clone().transpose()] {
            for (flex, expected) in [
                (
                    quick_gelu(input.clone()),
                    on_flex(input.clone(), &|x| composed::<Flex>(x, QUICK_GELU_SLOPE)),
                ),
                (
                    silu(input.clone()),
                    on_flex(input.clone(), &|x| composed::<Flex>(x, SILU_SLOPE)),
                ),
                (
                    gelu_tanh(input.clone()),
                    on_flex(input.clone(), &composed_gelu_tanh::<Flex>),
                ),
            ] {
                // Tolerance: two f32 evaluations of the same value, each within a few ulp.
                flex.into_data().assert_approx_eq::<f32>(
                    &expected.into_data(),
                    burn::tensor::Tolerance::relative(1e-5),
                );
            }
        }
        x.into_data().assert_eq(&before, true);
    }

    /// In f16 (on a GPU with `SHADER_F16`), each value is float64's GELU of the f16 input
    /// rounded to f16 once, within what Burn's f32 `erf` polynomial adds: computed in f16, the
    /// polynomial misses this bound (at −5.02 first, counting from −8).
    #[test]
    fn f16_gelu_computes_in_f32_and_rounds_once() {
        let Some(gpu) = device::gpu_for_tests().filter(device::f16_for_tests) else {
            return;
        };
        let mut values: Vec<f32> = (-1600..=1600).map(|i| i as f32 / 200.0).collect();
        values.extend([-20.0, -10.0, 10.0, 20.0, 1e-4, -1e-4]);
        let len = values.len();
        let x =
            Tensor::<1>::from_data(TensorData::new(values, [len]), &gpu.device).cast(DType::F16);
        let got = gelu_in_f32(x.clone());
        assert_eq!(got.dtype(), DType::F16);
        let floats = |t: Tensor<1>| t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
        for (x, y) in floats(x).into_iter().zip(floats(got)) {
            let (x, y) = (f64::from(x), f64::from(y));
            let exact = 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
            // Tolerance: half an f16 ulp of the result (its one rounding; 2^-24 below f16's
            // normal range); Burn's f32 erf, within 1.5e-7 (Abramowitz and Stegun 7.1.26) plus
            // its f32 arithmetic, taken as 5e-7, times |x| / 2; and the f32 products, 2^-22
            // of the result.
            let ulp = if exact.abs() < 2f64.powi(-14) {
                2f64.powi(-24)
            } else {
                2f64.powi(exact.abs().log2().floor() as i32 - 10)
            };
            let bound = ulp / 2.0 + 5e-7 * x.abs() / 2.0 + 2f64.powi(-22) * exact.abs();
            assert!(
                (y - exact).abs() <= bound,
                "GELU({x}): {y} against {exact}, bound {bound:e}"
            );
        }
    }
}
