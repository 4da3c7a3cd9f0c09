//! Which kernel computes each linear's base product: one named kernel, or the fastest of the
//! device's candidates for each shape, timed on the device.
//!
//! [`LinearChoice::Timed`] (what `auto` takes on a hardware GPU, where no one kernel is the
//! fastest on every GPU) decides the first time a product of a shape runs, on that product's
//! own rows:
//! 1. Burn's matmul computes the product in f32, the reference.
//! 2. Each candidate runs once (its pipelines compiled, Burn's autotune run), and each but
//!    Burn's has its output checked against the reference within the rounding bound a correct
//!    kernel keeps to (`Reference`): a kernel that a device's shader compiler gets wrong is
//!    never picked.
//! 3. Each candidate that passed runs [`TIMED_RUNS`](crate::runtime::timing::TIMED_RUNS) more
//! times,
//!    between device syncs; the median time is its time, and the fastest is kept for the shape.
//!
//! The picks are kept for the process, per device, dtype and shape (rows rounded up to a power
//! of two), as Burn keeps its autotune's. A device failure while timing keeps nothing (until
//! the [`TIMING_TRIES`]th, which keeps Burn's matmul): that product runs with Burn's matmul,
//! and the failure surfaces where the step reads its results. Nor does a batch that cannot
//! decide: inputs that are not finite, or a product a correct kernel may overflow the output's
//! dtype on (until the [`UNDECIDED_TRIES`]th, which keeps Burn's matmul too).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Duration;

use burn::backend::{Device as _, DeviceId};
use burn::tensor::{DType, Tensor};

use super::{LinearKernel, linear};
use crate::runtime::device::RuntimeDevice;
use crate::runtime::timing::{median_time, read};

/// How a layer's base product picks its kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearChoice {
    /// Always this kernel (never `Auto` or `Timed`).
    Fixed(LinearKernel),
    /// The fastest of these for each shape (Burn's among them: the reference).
    Timed(&'static [LinearKernel]),
}

/// What timing one shape found for one candidate.
#[derive(Debug, Clone, PartialEq)]
struct Timing {
    /// The candidate.
    kernel: LinearKernel,
    /// Its median time, or why it was not timed (its output was off the reference, or its
    /// launch failed).
    outcome: Result<Duration, String>,
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

/// Failed timings of one shape after which its product keeps Burn's matmul: a device that
/// cannot hold the f32 reference beside a step fails each try, and would pay for one each call.
pub const TIMING_TRIES: usize = 2;

/// Batches of one shape that could not decide after which its product keeps Burn's matmul:
/// each builds the f32 reference (a cast, two more products, a blocking read) to find that out.
pub const UNDECIDED_TRIES: usize = 4;

/// Tries of one shape that kept nothing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Tries {
    /// The device failed while timing (below [`TIMING_TRIES`]).
    failed: usize,
    /// The batch could not decide (below [`UNDECIDED_TRIES`]).
    undecided: usize,
}

/// Why a try kept nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Miss {
    /// The device failed while timing.
    Failed,
    /// The inputs were not finite, or a correct output may overflow its dtype: no bound.
    Undecided,
}

/// What this process found of each shape so far.
#[derive(Debug, Default)]
struct Picks {
    /// The kernel kept for each shape.
    kept: HashMap<ShapeKey, LinearKernel>,
    /// The tries of each shape that kept nothing, while it keeps no kernel.
    tries: HashMap<ShapeKey, Tries>,
}

impl Picks {
    /// Counts one more try of `key` that kept nothing, for `miss`; at that count's limit the
    /// shape keeps Burn's matmul. Whether it now does.
    fn missed(&mut self, key: ShapeKey, miss: Miss) -> bool {
        let tries = self.tries.entry(key.clone()).or_default();
        let (count, limit) = match miss {
            Miss::Failed => (&mut tries.failed, TIMING_TRIES),
            Miss::Undecided => (&mut tries.undecided, UNDECIDED_TRIES),
        };
        *count += 1;
        let keeps_burn = *count >= limit;
        if keeps_burn {
            self.tries.remove(&key);
            self.kept.insert(key, LinearKernel::Burn);
        }
        keeps_burn
    }
}

static PICKS: LazyLock<Mutex<Picks>> = LazyLock::new(Mutex::default);

impl LinearChoice {
    /// What `kernel` means on `device` for tensors of `dtype`: `Timed` over the device's
    /// [`LinearKernel::candidates`] (`Fixed` where there is one), any other kernel `Fixed`.
    pub fn new(kernel: LinearKernel, device: &RuntimeDevice, dtype: DType) -> Self {
        match kernel.resolve(device) {
            LinearKernel::Timed => match LinearKernel::candidates(device, dtype) {
                [only] => LinearChoice::Fixed(*only),
                all => LinearChoice::Timed(all),
            },
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
) -> (LinearKernel, Option<Vec<Timing>>) {
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
    // Held while timing: two callers timing at once would slow each other's runs.
    let mut picks = PICKS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&kernel) = picks.kept.get(&key) {
        return (kernel, None);
    }
    let timings = match time_candidates(candidates, x, weight_t, bias) {
        Ok(Some(timings)) => timings,
        Ok(None) => {
            let keeps_burn = picks.missed(key.clone(), Miss::Undecided);
            tracing::debug!(
                ?key,
                keeps_burn,
                "inputs not finite or the output's dtype overflowed: Burn's matmul, nothing timed"
            );
            return (LinearKernel::Burn, None);
        }
        Err(error) => {
            let keeps_burn = picks.missed(key.clone(), Miss::Failed);
            tracing::warn!(?key, %error, keeps_burn, "the device failed while timing linear kernels");
            return (LinearKernel::Burn, None);
        }
    };
    let fastest = fastest(&timings);
    let times: Vec<String> = timings
        .iter()
        .map(|timing| match &timing.outcome {
            Ok(time) => format!(
                "{} {:.3} ms",
                timing.kernel.name(),
                time.as_secs_f64() * 1e3
            ),
            Err(why) => {
                tracing::warn!(rows, in_features, out_features, dtype = ?key.dtype,
                    kernel = timing.kernel.name(), why, "a linear kernel left out");
                format!("{} left out", timing.kernel.name())
            }
        })
        .collect();
    tracing::info!(rows, in_features, out_features, dtype = ?key.dtype,
        picked = fastest.name(), times = times.join(", "), "linear kernels timed");
    picks.tries.remove(&key);
    picks.kept.insert(key, fastest);
    (fastest, Some(timings))
}

/// The fastest of the candidates that passed their check; Burn's matmul where none did.
fn fastest(timings: &[Timing]) -> LinearKernel {
    timings
        .iter()
        .filter_map(|t| t.outcome.as_ref().ok().map(|time| (time, t.kernel)))
        .min_by_key(|&(time, _)| time)
        .map_or(LinearKernel::Burn, |(_, kernel)| kernel)
}

/// Checks and times every candidate on these inputs (steps 1–3 of the module's doc); `None`
/// where the batch cannot decide ([`Reference::new`]): nothing to check against.
fn time_candidates(
    candidates: &[LinearKernel],
    x: &Tensor<2>,
    weight_t: &Tensor<2>,
    bias: Option<&Tensor<1>>,
) -> Result<Option<Vec<Timing>>, String> {
    let device = x.device();
    let Some(reference) = Reference::new(x, weight_t, bias)? else {
        return Ok(None);
    };
    let mut timings = Vec::with_capacity(candidates.len());
    for &kernel in candidates {
        // The first run compiles the kernel's pipelines (and runs Burn's autotune).
        let output = linear(x.clone(), weight_t, bias, kernel);
        let checked = match kernel {
            // What runs where no other kernel is taken: nothing to check it against.
            LinearKernel::Burn => Ok(()),
            _ => reference.check(&output),
        };
        drop(output);
        let outcome = match checked {
            Ok(()) => Ok(median_time(&device, || {
                linear(x.clone(), weight_t, bias, kernel)
            })?),
            Err(why) => Err(why),
        };
        timings.push(Timing { kernel, outcome });
    }
    Ok(Some(timings))
}

/// What a candidate's output is checked against: the product in f32 by Burn's matmul (of the
/// inputs as they are, f16 values being exact in f32), and a bound on how far a correct
/// kernel's output may be from it.
struct Reference {
    /// `x · Wᵀ + b` in f32.
    product: Tensor<2>,
    /// Per element, twice the worst-case error of an f32 sum of its `in + 1` terms, `γ(in + 1)
    /// · (|x|·|Wᵀ| + |b|)` with `γ(n) = n·u / (1 − n·u)` (Higham, Accuracy and Stability of
    /// Numerical Algorithms, §3.1), at `u = 2⁻²³` rather than `2⁻²⁴` since tensor cores may
    /// truncate their sums: the reference's error plus the candidate's, in any order of
    /// summation.
    bound: Tensor<2>,
}

/// The smallest magnitude f16 rounds to infinity: its largest value, 65504, plus half its
/// ulp there (16).
const F16_OVERFLOW: f32 = 65520.0;

impl Reference {
    /// The reference for these inputs; `None` where the bound is not finite (an infinite or
    /// NaN input), or where in f16 a correct kernel's sum may reach [`F16_OVERFLOW`]: such a
    /// kernel may give an infinity there, whose distance from the product is NaN, and would be
    /// left out for a value it got right.
    fn new(
        x: &Tensor<2>,
        weight_t: &Tensor<2>,
        bias: Option<&Tensor<1>>,
    ) -> Result<Option<Self>, String> {
        let [_, in_features] = x.dims();
        let output_dtype = x.dtype();
        let x = x.clone().cast(DType::F32);
        let weight_t = weight_t.clone().cast(DType::F32);
        let bias = bias.map(|b| b.clone().cast(DType::F32));
        let product = linear(x.clone(), &weight_t, bias.as_ref(), LinearKernel::Burn);
        let magnitudes = x.abs().matmul(weight_t.abs());
        let magnitudes = match bias {
            Some(bias) => magnitudes + bias.abs().unsqueeze_dim(0),
            None => magnitudes,
        };
        if !read(magnitudes.clone().sum())?.is_finite() {
            return Ok(None);
        }
        let nu = (in_features + 1) as f64 * f64::from(f32::EPSILON);
        let gamma = nu / (1.0 - nu);
        let bound = magnitudes * (2.0 * gamma);
        // The bound is twice a correct sum's distance from the product: its reach bounds that
        // sum's magnitude.
        if output_dtype == DType::F16
            && read((product.clone().abs() + bound.clone()).max())? >= F16_OVERFLOW
        {
            return Ok(None);
        }
        Ok(Some(Self { product, bound }))
    }

    /// Whether a candidate's `output` may be timed: within the bound ([`Self::disagreement`]
    /// at most 1), else why not.
    fn check(&self, output: &Tensor<2>) -> Result<(), String> {
        match self.disagreement(output) {
            Ok(ratio) if ratio <= 1.0 => Ok(()),
            Ok(ratio) => Err(format!(
                "its output is off by {ratio:.3e} times the rounding bound"
            )),
            Err(error) => Err(format!("its launch failed: {error}")),
        }
    }

    /// The largest `|output − product| / allowed` over the elements, `allowed` the bound plus
    /// the rounding of `output` to its dtype (f16's `2⁻¹¹`, taken of `|output| + |product|`)
    /// plus that rounding's least (half the spacing of the dtype's subnormals: `2⁻²⁵` in f16;
    /// in f32 its smallest normal, `2⁻¹²⁶`, which holds a flushed subnormal too): at most 1 for
    /// a correct kernel. NaN (not `≤ 1`) where `output` has a NaN.
    fn disagreement(&self, output: &Tensor<2>) -> Result<f32, String> {
        let (unit_roundoff, least) = match output.dtype() {
            DType::F16 => (f32::powi(2.0, -11), f32::powi(2.0, -25)),
            _ => (f32::EPSILON / 2.0, f32::MIN_POSITIVE),
        };
        let output = output.clone().cast(DType::F32);
        let rounding = (output.clone().abs() + self.product.clone().abs()) * unit_roundoff;
        let allowed = self.bound.clone() + rounding + least;
        let ratio = (output - self.product.clone()).abs() / allowed;
        // Read apart from the largest, which a reduction may take skipping NaNs.
        let worst = read(ratio.clone().max())?;
        let nan = read(ratio.is_nan().any().float())? > 0.0;
        Ok(if nan { f32::NAN } else { worst })
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, s};

    use super::*;
    use crate::ops::linear::coop_for_tests;
    use crate::runtime::device;

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
            let reference = Reference::new(&x, &weight_t, Some(&bias)).unwrap().unwrap();
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
                Reference::new(&infinite, &weight_t, Some(&bias))
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
                let kernels: Vec<_> = timings.iter().map(|t| t.kernel).collect();
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
            let failed = Tries {
                failed: tries,
                undecided: 0,
            };
            let expected = if tries < TIMING_TRIES {
                (Some(failed), None)
            } else {
                (None, Some(LinearKernel::Burn))
            };
            assert_eq!(held(this), expected, "after {tries} tries");
        }
    }

    /// What the process holds of the one shape `this` picks out: its tries that kept nothing,
    /// its kept kernel.
    fn held(this: impl Fn(&ShapeKey) -> bool) -> (Option<Tries>, Option<LinearKernel>) {
        let picks = PICKS.lock().unwrap_or_else(PoisonError::into_inner);
        let tries = picks.tries.iter().find(|(k, _)| this(k)).map(|(_, &t)| t);
        let kept = picks.kept.iter().find(|(k, _)| this(k)).map(|(_, &k)| k);
        (tries, kept)
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
                        let undecided = Tries {
                            failed: 0,
                            undecided: tries,
                        };
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
            let reference = Reference::new(&x, &weight_t, None).unwrap().unwrap();
            let rounded = reference.product.clone().cast(DType::F16);
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

    /// A candidate whose output is off, or NaN, is left out, and the pick is the fastest of
    /// those left: the only guard against a miscompiled kernel on a hardware GPU.
    #[test]
    fn a_wrong_kernel_is_left_out_of_the_pick() {
        let cpu = device::cpu();
        let (x, weight_t, bias) = random(64, 96, 160, &cpu.device);
        let reference = Reference::new(&x, &weight_t, Some(&bias)).unwrap().unwrap();
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

        let timing = |kernel, outcome| Timing { kernel, outcome };
        let ms = Duration::from_millis;
        let timings = [
            timing(LinearKernel::Burn, Ok(ms(5))),
            timing(LinearKernel::Wgsl, Err("its output is off".to_owned())),
            timing(LinearKernel::Tiled, Ok(ms(3))),
        ];
        assert_eq!(fastest(&timings), LinearKernel::Tiled);
        assert_eq!(fastest(&timings[..2]), LinearKernel::Burn);
        assert_eq!(fastest(&timings[1..2]), LinearKernel::Burn);
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
                let candidates = LinearKernel::candidates(&gpu, dtype);
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
