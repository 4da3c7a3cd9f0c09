//! Which kernel computes each linear's base product: one named kernel, or the fastest of the
//! device's candidates for each shape, timed on the device by the runtime's one tuner
//! ([`crate::runtime::tuner`]).
//!
//! [`LinearChoice::Timed`] (what `auto` takes on a hardware GPU, where no one kernel is the
//! fastest on every GPU) decides the first time a product of a shape runs, on that product's
//! own rows: each candidate's output is checked against Burn's matmul in f32 within the
//! rounding bound a correct kernel keeps to ([`reference`]), and the fastest of those that
//! pass is kept per device, dtype and shape (rows rounded up to a power of two). Burn's matmul
//! is what runs where nothing is kept.

use burn::backend::{Device as _, DeviceId};
use burn::tensor::{DType, Tensor};

use super::{LinearKernel, linear};
use crate::runtime::device::RuntimeDevice;
use crate::runtime::tuner::{self, Reference, Timing, Trial, Tuner};

/// How a layer's base product picks its kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearChoice {
    /// Always this kernel (never `Auto` or `Timed`).
    Fixed(LinearKernel),
    /// The fastest of these for each shape (Burn's among them: the reference).
    Timed(&'static [LinearKernel]),
}

/// A shape picks are kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ShapeKey {
    device: DeviceId,
    dtype: DType,
    /// Rows rounded up to a power of two.
    rows: usize,
    in_features: usize,
    out_features: usize,
    bias: bool,
    candidates: &'static [LinearKernel],
}

static TUNER: Tuner<ShapeKey, LinearKernel> = Tuner::new("linear kernel");

impl LinearChoice {
    /// What `kernel` means on `device` for tensors of `dtype`: `Timed` over the device's
    /// `LinearKernel::candidates` (`Fixed` where there is one), any other kernel `Fixed`.
    /// `auto` times only the kernels checked on a hardware GPU; `timed`, chosen by name, all.
    pub fn new(kernel: LinearKernel, device: &RuntimeDevice, dtype: DType) -> Self {
        let hardware_checked = kernel == LinearKernel::Auto;
        match kernel.resolve(device) {
            LinearKernel::Timed => {
                match LinearKernel::candidates(device, dtype, hardware_checked) {
                    [only] => LinearChoice::Fixed(*only),
                    all => LinearChoice::Timed(all),
                }
            }
            fixed => LinearChoice::Fixed(fixed),
        }
    }

    /// `x · weight_t (+ bias)` ([`linear`]) with the kernel this choice picks for the shape,
    /// timing the candidates first if it is a new one.
    pub fn linear(
        &self,
        x: Tensor<2>,
        weight_t: &Tensor<2>,
        bias: Option<&Tensor<1>>,
    ) -> Tensor<2> {
        let kernel = self.kernel(&x, weight_t, bias);
        linear(x, weight_t, bias, kernel)
    }

    /// The kernel this choice picks for the product `x · weight_t (+ bias)`, timing the
    /// candidates first if its shape is a new one.
    pub fn kernel(
        &self,
        x: &Tensor<2>,
        weight_t: &Tensor<2>,
        bias: Option<&Tensor<1>>,
    ) -> LinearKernel {
        match *self {
            LinearChoice::Fixed(kernel) => kernel,
            LinearChoice::Timed(candidates) => pick(candidates, x, weight_t, bias).0,
        }
    }
}

/// The kernel for `x`'s shape among `candidates`, with the timings when this call made them
/// (`None`: the pick was kept from an earlier call, there were no rows to time on, the batch
/// could not decide or the timing failed; Burn's matmul for the last three).
fn pick(
    candidates: &'static [LinearKernel],
    x: &Tensor<2>,
    weight_t: &Tensor<2>,
    bias: Option<&Tensor<1>>,
) -> (LinearKernel, Option<Vec<Timing<LinearKernel>>>) {
    let [rows, in_features] = x.dims();
    let [_, out_features] = weight_t.dims();
    if rows == 0 {
        return (LinearKernel::Burn, None);
    }
    let key = ShapeKey {
        device: x.device().as_dispatch().to_id(),
        dtype: x.dtype(),
        rows: rows.next_power_of_two(),
        in_features,
        out_features,
        bias: bias.is_some(),
        candidates,
    };
    let run = |kernel| linear(x.clone(), weight_t, bias, kernel);
    let trial = Trial {
        candidates,
        fallback: LinearKernel::Burn,
        calls: 1,
        run: &run,
    };
    TUNER.pick(key, &x.device(), &trial, || reference(x, weight_t, bias))
}

/// What a candidate's output is checked against: the product in f32 by Burn's matmul (of the
/// inputs as they are, f16 values being exact in f32), and per element twice the worst-case
/// error of an f32 sum of its `in + 1` terms, `γ(in + 1) · (|x|·|Wᵀ| + |b|)`
/// ([`tuner::gamma`]), plus, with a bias, one rounding of the product to the output's dtype,
/// `u · |x|·|Wᵀ|`: a kernel may round `x·Wᵀ` before adding `b` (Burn's matmul, then its add),
/// and where `b` cancels part of the product that rounding exceeds what the check allows for
/// rounding the output ([`Reference::disagreement`]). `None` where the batch cannot decide
/// ([`Reference::new`]).
pub(crate) fn reference(
    x: &Tensor<2>,
    weight_t: &Tensor<2>,
    bias: Option<&Tensor<1>>,
) -> Result<Option<Reference>, String> {
    let [_, in_features] = x.dims();
    let output_dtype = x.dtype();
    let x = x.clone().cast(DType::F32);
    let weight_t = weight_t.clone().cast(DType::F32);
    let bias = bias.map(|b| b.clone().cast(DType::F32));
    let product = linear(x.clone(), &weight_t, bias.as_ref(), LinearKernel::Burn);
    let magnitudes = x.abs().matmul(weight_t.abs());
    let sums = 2.0 * tuner::gamma(in_features + 1);
    let bound = match bias {
        Some(bias) => {
            let rounded = magnitudes.clone() * tuner::unit_roundoff(output_dtype);
            (magnitudes + bias.abs().unsqueeze_dim(0)) * sums + rounded
        }
        None => magnitudes * sums,
    };
    Reference::new(product, bound, output_dtype)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, s};

    use std::time::Duration;

    use super::*;
    use crate::ops::linear::coop_for_tests;
    use crate::runtime::device;
    use crate::runtime::timing::read;
    use crate::runtime::tuner::{TIMING_TRIES, UNDECIDED_TRIES};

    /// The CPU backend and, where wgpu finds one, the GPU.
    fn devices() -> Vec<RuntimeDevice> {
        [Some(device::cpu()), device::gpu_for_tests()]
            .into_iter()
            .flatten()
            .collect()
    }

    /// `x` `[rows, in]`, `Wᵀ` `[in, out]` and `b`, uniform in ±1, on `device` in f32.
    fn random(
        rows: usize,
        in_features: usize,
        out_features: usize,
        device: &Device,
    ) -> (Tensor<2>, Tensor<2>, Tensor<1>) {
        let uniform = Distribution::Uniform(-1.0, 1.0);
        (
            Tensor::random([rows, in_features], uniform, device),
            Tensor::random([in_features, out_features], uniform, device),
            Tensor::random([out_features], uniform, device),
        )
    }

    #[test]
    fn the_check_passes_a_correct_product_and_fails_a_wrong_one() {
        for on in devices() {
            let (x, weight_t, bias) = random(37, 96, 40, &on.device);
            let reference = reference(&x, &weight_t, Some(&bias)).unwrap().unwrap();
            let check = |output: Tensor<2>| reference.disagreement(&output).unwrap();

            // The same product summed in another order: the halves of `in` apart.
            let half = |range: std::ops::Range<usize>| {
                x.clone()
                    .slice(s![.., range.clone()])
                    .matmul(weight_t.clone().slice(s![range, ..]))
            };
            let reordered = half(48..96) + (half(0..48) + bias.clone().unsqueeze_dim(0));
            let ratio = check(reordered);
            assert!(
                ratio <= 1.0,
                "{}: reordered sums at {ratio}",
                on.description
            );

            // A kernel that drops the last 4 columns of `x`: off by about 2/3 an element,
            // where the bound is about 6e-4.
            let dropped = x
                .clone()
                .slice_assign(s![.., 92..], Tensor::zeros([37, 4], &on.device));
            let ratio = check(linear(dropped, &weight_t, Some(&bias), LinearKernel::Burn));
            assert!(
                ratio > 100.0,
                "{}: a dropped slice at {ratio}",
                on.description
            );

            let with_nan = linear(x.clone(), &weight_t, Some(&bias), LinearKernel::Burn)
                .slice_assign(s![5..6, 7..8], Tensor::full([1, 1], f32::NAN, &on.device));
            let ratio = check(with_nan);
            assert!(ratio.is_nan(), "{}: a NaN at {ratio}", on.description);

            let infinite = x.clone().slice_assign(
                s![0..1, 0..1],
                Tensor::full([1, 1], f32::INFINITY, &on.device),
            );
            assert!(
                super::reference(&infinite, &weight_t, Some(&bias))
                    .unwrap()
                    .is_none()
            );
        }
    }

    /// Every kernel that may be timed, whichever the device offers, but the coop ones.
    const ALL: &[LinearKernel] = &[LinearKernel::Burn, LinearKernel::Wgsl, LinearKernel::Tiled];

    /// The dtypes `on` computes in: f32, and f16 where it has it.
    fn dtypes(on: &RuntimeDevice) -> Vec<DType> {
        let mut dtypes = vec![DType::F32];
        if on.wgpu.is_some() && device::f16_for_tests(on) {
            dtypes.push(DType::F16);
        }
        dtypes
    }

    /// The kernels to time on `on` in `dtype`: [`ALL`], and in f16 each coop kernel the device
    /// runs (under `MMLORA_EXPECT_COOP=1` a GPU that does not run them all fails the test).
    fn timed_here(on: &RuntimeDevice, dtype: DType) -> &'static [LinearKernel] {
        let mut kernels = ALL.to_vec();
        if on.wgpu.is_some() && dtype == DType::F16 {
            for kernel in LinearKernel::COOP {
                if coop_for_tests(on, kernel.coop_tiling().unwrap()).is_some() {
                    kernels.push(kernel);
                }
            }
        }
        // The choice keeps its candidates for the process, as `LinearKernel::candidates` does.
        kernels.leak()
    }

    #[test]
    fn timing_picks_the_fastest_once_per_shape() {
        for on in devices() {
            for dtype in dtypes(&on) {
                let what = format!("{} in {dtype:?}", on.description);
                let all = timed_here(&on, dtype);
                let (x, weight_t, bias) = random(300, 96, 160, &on.device);
                let (x, weight_t, bias) = (x.cast(dtype), weight_t.cast(dtype), bias.cast(dtype));
                let (picked, timings) = pick(all, &x, &weight_t, Some(&bias));
                let timings = timings.expect("a new shape is timed");
                let kernels: Vec<_> = timings.iter().map(|t| t.candidate).collect();
                assert_eq!(kernels, all, "{what}");
                let times: Vec<Duration> = timings
                    .iter()
                    .map(|t| {
                        t.outcome
                            .clone()
                            .unwrap_or_else(|why| panic!("{what}: {why}"))
                    })
                    .collect();
                let fastest = (0..all.len()).min_by_key(|&i| times[i]).unwrap();
                assert_eq!(picked, all[fastest], "{what}: {times:?}");

                // 400 rows round up to 512 as 300 do: the same shape, not timed again.
                let more =
                    Tensor::<2>::random([400, 96], Distribution::Default, &on.device).cast(dtype);
                assert_eq!(
                    pick(all, &more, &weight_t, Some(&bias)),
                    (picked, None),
                    "{what}"
                );
                // The choice computes with the kernel it picked.
                let chosen = LinearChoice::Timed(all).linear(more.clone(), &weight_t, Some(&bias));
                let direct = linear(more, &weight_t, Some(&bias), picked);
                chosen.into_data().assert_eq(&direct.into_data(), true);
            }
        }
    }

    /// Inputs over the device's buffer limit fail every timing: Burn's matmul is kept for the
    /// shape at the last try, and nothing is timed after it.
    #[test]
    fn a_shape_whose_timing_keeps_failing_keeps_burns_matmul() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let limit = gpu.buffer_limit.unwrap();
        let (in_features, out_features) = (4, 8);
        let rows = usize::try_from(limit).unwrap() / (4 * in_features) + 1;
        let x = Tensor::<2>::zeros([rows, in_features], &gpu.device);
        let (_, weight_t, bias) = random(1, in_features, out_features, &gpu.device);
        let this = |key: &ShapeKey| key.rows == rows.next_power_of_two() && key.in_features == 4;
        for tries in 1..=TIMING_TRIES {
            assert_eq!(
                pick(ALL, &x, &weight_t, Some(&bias)),
                (LinearKernel::Burn, None)
            );
            let failed = (tries, 0);
            let expected = if tries < TIMING_TRIES {
                (Some(failed), None)
            } else {
                (None, Some(LinearKernel::Burn))
            };
            assert_eq!(held(this), expected, "after {tries} tries");
        }
    }

    /// What the process holds of the one shape `this` picks out: its tries that kept nothing
    /// (failed, undecided), its kept kernel.
    fn held(this: impl Fn(&ShapeKey) -> bool) -> (Option<(usize, usize)>, Option<LinearKernel>) {
        TUNER.held(this)
    }

    /// Batches that cannot decide (a NaN input; in f16, a product past f16's range, where both
    /// candidates give infinities) time nothing and leave nothing out; after
    /// [`UNDECIDED_TRIES`] of them the shape keeps Burn's matmul, and no later batch of it
    /// builds a reference.
    #[test]
    fn batches_that_cannot_decide_keep_burns_matmul_after_a_few() {
        for on in devices() {
            for dtype in dtypes(&on) {
                let what = format!("{} in {dtype:?}", on.description);
                // Widths no other test of this module takes, so that no other test's picks
                // are this one's.
                let (in_features, out_features) = (28, 20);
                let (x, weight_t, bias) = random(9, in_features, out_features, &on.device);
                let (x, weight_t, bias) = (x.cast(dtype), weight_t.cast(dtype), bias.cast(dtype));
                let nan = x.clone().slice_assign(
                    s![2..3, 3..4],
                    Tensor::<2>::full([1, 1], f32::NAN, &on.device).cast(dtype),
                );
                let mut undecided = vec![(nan, weight_t.clone())];
                if dtype == DType::F16 {
                    // 28 terms of 100 · 100 (and a bias within ±1): 280000, past f16's 65504.
                    undecided.push((x.ones_like() * 100.0, weight_t.ones_like() * 100.0));
                }
                for (i, (x, weight_t)) in undecided.into_iter().enumerate() {
                    let rows: usize = 16 << i;
                    let x = x.repeat_dim(0, rows.div_ceil(9)).slice(s![0..rows, ..]);
                    let this = |key: &ShapeKey| {
                        key.device == x.device().as_dispatch().to_id()
                            && key.dtype == dtype
                            && key.rows == rows
                            && key.in_features == in_features
                    };
                    for tries in 1..=UNDECIDED_TRIES {
                        assert_eq!(
                            pick(ALL, &x, &weight_t, Some(&bias)),
                            (LinearKernel::Burn, None),
                            "{what}"
                        );
                        let undecided = (0, tries);
                        let expected = if tries < UNDECIDED_TRIES {
                            (Some(undecided), None)
                        } else {
                            (None, Some(LinearKernel::Burn))
                        };
                        assert_eq!(held(this), expected, "{what}: after {tries} tries");
                    }
                }
            }
        }
    }

    /// In f16 a correctly rounded subnormal output (the product `7 · 2⁻²⁷` rounded to `2⁻²⁴`,
    /// off by `2⁻²⁷`, far more than its relative rounding `2⁻¹¹ · |y|`) passes the check, and
    /// one two subnormal steps further off does not.
    #[test]
    fn the_check_passes_a_correctly_rounded_f16_subnormal() {
        for on in devices() {
            if !dtypes(&on).contains(&DType::F16) {
                continue;
            }
            let d = &on.device;
            // x = 7 · 2⁻¹⁴ and Wᵀ = 2⁻¹³, both normal in f16.
            let x = Tensor::<2>::full([1, 1], 7.0 * f32::powi(2.0, -14), d).cast(DType::F16);
            let weight_t = Tensor::<2>::full([1, 1], f32::powi(2.0, -13), d).cast(DType::F16);
            let reference = reference(&x, &weight_t, None).unwrap().unwrap();
            let rounded = reference.output.clone().cast(DType::F16);
            let subnormal = f32::powi(2.0, -24);
            assert_eq!(
                rounded
                    .clone()
                    .into_data()
                    .try_to_vec::<half::f16>()
                    .unwrap()[0]
                    .to_f32(),
                subnormal,
                "{}: the product rounds to f16's least subnormal (no flush to zero)",
                on.description
            );
            // Off by 2⁻²⁷ against an allowance of about 2⁻²⁵: a ratio of about 1/4.
            let ratio = reference.disagreement(&rounded).unwrap();
            assert!(ratio <= 0.3, "{}: ratio {ratio}", on.description);
            // Two subnormal steps up, 3 · 2⁻²⁴: off by 17 · 2⁻²⁷, about 4 times the allowance.
            let off = Tensor::<2>::full([1, 1], 3.0 * subnormal, d).cast(DType::F16);
            let ratio = reference.disagreement(&off).unwrap();
            assert!(ratio > 2.0, "{}: ratio {ratio}", on.description);
        }
    }

    /// A candidate whose output is off, or NaN, fails the check that leaves it out of the
    /// pick: the only guard against a miscompiled kernel on a hardware GPU.
    #[test]
    fn a_wrong_kernel_is_left_out_of_the_pick() {
        let cpu = device::cpu();
        let (x, weight_t, bias) = random(64, 96, 160, &cpu.device);
        let reference = reference(&x, &weight_t, Some(&bias)).unwrap().unwrap();
        let right = linear(x.clone(), &weight_t, Some(&bias), LinearKernel::Burn);
        assert_eq!(reference.check(&right), Ok(()));
        // One element off by 1e-3 of the output's scale, far beyond f32's rounding.
        let scale = read(right.clone().abs().max()).unwrap();
        let nudge = Tensor::<2>::zeros([64, 160], &cpu.device).slice_assign(
            [5..6, 7..8],
            Tensor::full([1, 1], 1e-3 * scale, &cpu.device),
        );
        for wrong in [right.clone() + nudge, right.clone() / 0.0 * 0.0] {
            let why = reference.check(&wrong).unwrap_err();
            assert!(why.contains("off by"), "{why}");
        }
    }

    #[test]
    fn a_choice_times_only_where_there_is_a_choice() {
        let cpu = device::cpu();
        let timed = LinearChoice::new(LinearKernel::Timed, &cpu, DType::F32);
        assert_eq!(timed, LinearChoice::Fixed(LinearKernel::Burn));
        assert_eq!(
            LinearChoice::new(LinearKernel::Auto, &cpu, DType::F32),
            LinearChoice::Fixed(LinearKernel::Burn)
        );
        if let Some(gpu) = device::gpu_for_tests() {
            for dtype in [DType::F32, DType::F16] {
                let candidates = LinearKernel::candidates(&gpu, dtype, false);
                assert_eq!(
                    LinearChoice::new(LinearKernel::Timed, &gpu, dtype),
                    LinearChoice::Timed(candidates)
                );
                assert_eq!(
                    LinearChoice::new(LinearKernel::Tiled, &gpu, dtype),
                    LinearChoice::Fixed(LinearKernel::Tiled)
                );
            }
        }
    }
}
