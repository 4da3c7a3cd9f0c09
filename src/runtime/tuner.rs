//! The one per-shape tuner: every kernel choice made by measurement (the linears' kernel, the
//! LoRA shrink, whether the LoRA op runs fused into the linear) goes through [`Tuner::pick`].
//!
//! The first time a shape runs with a choice to make, on that call's own inputs:
//! 1. The op computes its reference: its composed form in f32, and per element the bound a
//!    correct kernel's output keeps to ([`Reference`]).
//! 2. Each candidate runs once (its pipelines compiled), and its output is checked against the
//!    reference: a candidate off the bound, or whose launch failed, is left out, so a kernel
//!    a device's shader compiler gets wrong is never picked.
//! 3. Each candidate that passed runs [`TIMED_RUNS`] more times, each a few calls back to back
//!    between device syncs; the median time per call is its time, and the fastest is kept for
//!    the shape, for the rest of the process (as Burn keeps its autotune's).
//!
//! In a browser (wasm32) nothing is timed: a page cannot wait for the device, so every choice
//! keeps its fallback there.
//!
//! A device failure while timing keeps nothing (until the [`TIMING_TRIES`]th, which keeps the
//! op's fallback): that call runs the fallback and the failure surfaces where the step reads
//! its results. Nor does a batch that cannot decide, one whose inputs are not finite or whose
//! correct output may overflow its dtype (until the [`UNDECIDED_TRIES`]th). Where no candidate
//! passes, the fallback is kept.
//!
//! Why not cubecl's autotune, which Burn runs for its own kernels: its candidates are kernels
//! on one compute client, while ours include Burn's whole tensor ops (its matmul, itself
//! autotuned) and a two-launch op against its fused form; and its output check is a build
//! feature that panics on a mismatch, where ours leaves a wrong kernel out, within a bound
//! derived for each op, on the user's device.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Duration;

use burn::tensor::{DType, Device, Tensor};

use super::timing::{TIMED_RUNS, median_time_per_call, read};

/// Failed timings of one shape after which it keeps the fallback: a device that cannot hold
/// the reference beside a step fails each try, and would pay for one each call.
pub const TIMING_TRIES: usize = 2;

/// Batches of one shape that could not decide after which it keeps the fallback: each builds
/// the reference (casts, products, a blocking read) to find that out.
pub const UNDECIDED_TRIES: usize = 4;

/// A candidate of a choice, named in the logs by its `&'static str` (strum's `IntoStaticStr`).
pub trait Candidate: Copy + Eq + Debug + Send + Into<&'static str> + 'static {}

impl<C: Copy + Eq + Debug + Send + Into<&'static str> + 'static> Candidate for C {}

/// `candidate`'s name in the logs.
fn name<C: Candidate>(candidate: C) -> &'static str {
    candidate.into()
}

/// What one candidate's trial found: its time per call, or why it was left out (its output
/// was off the reference, or its launch failed).
#[derive(Debug, Clone, PartialEq)]
pub struct Timing<C> {
    /// The candidate.
    pub candidate: C,
    /// Its median time per call, or why it was not timed.
    pub outcome: Result<Duration, String>,
}

/// What a choice is made among, on one call's inputs.
pub struct Trial<'a, C> {
    /// The candidates, in the order they are tried.
    pub candidates: &'a [C],
    /// What runs where nothing is kept (timing failed, nothing passed, no decision).
    pub fallback: C,
    /// Calls of a candidate per timed run, back to back between two syncs: more where the
    /// candidates differ by less than a sync's jitter.
    pub calls: usize,
    /// Runs a candidate on the call's inputs.
    pub run: &'a dyn Fn(C) -> Tensor<2>,
}

/// What a candidate's output is checked against: the op's composed form in f32, and per
/// element twice the worst-case error of a correct kernel's f32 sums (the reference's error
/// plus the candidate's, in any order of summation).
pub struct Reference {
    /// The op's output in f32.
    pub output: Tensor<2>,
    /// Per element, how far from it a correct kernel's f32 output may be.
    pub bound: Tensor<2>,
}

/// The smallest magnitude f16 rounds to infinity: its largest value, 65504, plus half its ulp
/// there (16).
const F16_OVERFLOW: f32 = 65520.0;

/// `γ(n) = n·u / (1 − n·u)`, the relative error bound of an f32 sum of `n` terms in any order
/// (Higham, Accuracy and Stability of Numerical Algorithms, §3.1), at `u = 2⁻²³` rather than
/// `2⁻²⁴` since tensor cores may truncate their sums.
pub fn gamma(n: usize) -> f32 {
    let nu = n as f64 * f64::from(f32::EPSILON);
    (nu / (1.0 - nu)) as f32
}

/// The unit roundoff of `dtype`: how far rounding a value to it may move it, relatively (f16's
/// `2⁻¹¹`; f32's `2⁻²⁴` for the rest, which the tuned ops compute in).
pub fn unit_roundoff(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => f32::powi(2.0, -11),
        _ => f32::EPSILON / 2.0,
    }
}

impl Reference {
    /// The reference `output` with `bound`, for an op whose output is in `dtype`; `None` where
    /// the bound is not finite (an infinite or NaN input), or where in f16 a correct kernel's
    /// sum may reach f16's overflow: such a kernel may give an infinity there, whose distance
    /// from the reference is NaN, and would be left out for a value it got right.
    pub fn new(output: Tensor<2>, bound: Tensor<2>, dtype: DType) -> Result<Option<Self>, String> {
        if !read(bound.clone().sum())?.is_finite() {
            return Ok(None);
        }
        // The bound is twice a correct sum's distance from the reference: its reach bounds
        // that sum's magnitude.
        if dtype == DType::F16
            && read((output.clone().abs() + bound.clone()).max())? >= F16_OVERFLOW
        {
            return Ok(None);
        }
        Ok(Some(Self { output, bound }))
    }

    /// Whether a candidate's `output` passes: within the bound ([`Self::disagreement`] at most
    /// 1), else why not.
    pub fn check(&self, output: &Tensor<2>) -> Result<(), String> {
        match self.disagreement(output) {
            Ok(ratio) if ratio <= 1.0 => Ok(()),
            Ok(ratio) => Err(format!(
                "its output is off by {ratio:.3e} times the rounding bound"
            )),
            Err(error) => Err(format!("its launch failed: {error}")),
        }
    }

    /// The largest `|output − reference| / allowed` over the elements, `allowed` the bound plus
    /// the rounding of `output` to its dtype (f16's `2⁻¹¹`, taken of `|output| + |reference|`)
    /// plus that rounding's least (half the spacing of the dtype's subnormals: `2⁻²⁵` in f16;
    /// in f32 its smallest normal, `2⁻¹²⁶`, which holds a flushed subnormal too): at most 1 for
    /// a correct kernel. NaN (not `≤ 1`) where `output` has a NaN.
    pub fn disagreement(&self, output: &Tensor<2>) -> Result<f32, String> {
        let least = match output.dtype() {
            DType::F16 => f32::powi(2.0, -25),
            _ => f32::MIN_POSITIVE,
        };
        let roundoff = unit_roundoff(output.dtype());
        let output = output.clone().cast(DType::F32);
        let rounding = (output.clone().abs() + self.output.clone().abs()) * roundoff;
        let allowed = self.bound.clone() + rounding + least;
        let ratio = (output - self.output.clone()).abs() / allowed;
        // Read apart from the largest, which a reduction may take skipping NaNs.
        let worst = read(ratio.clone().max())?;
        let nan = read(ratio.is_nan().any().float())? > 0.0;
        Ok(if nan { f32::NAN } else { worst })
    }
}

/// Tries of one shape that kept nothing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Tries {
    /// The device failed while timing (below [`TIMING_TRIES`]).
    failed: usize,
    /// The batch could not decide (below [`UNDECIDED_TRIES`]).
    undecided: usize,
}

/// What one tuner found of each shape so far.
struct State<K, C> {
    kept: HashMap<K, C>,
    tries: HashMap<K, Tries>,
}

impl<K, C> Default for State<K, C> {
    fn default() -> Self {
        Self {
            kept: HashMap::new(),
            tries: HashMap::new(),
        }
    }
}

/// One choice made by measurement, per shape key `K`, among candidates `C`.
pub struct Tuner<K, C> {
    /// What is chosen, for the logs.
    what: &'static str,
    state: LazyLock<Mutex<State<K, C>>>,
}

impl<K: Hash + Eq + Clone + Debug, C: Candidate> Tuner<K, C> {
    /// A tuner for `what`, with nothing kept yet.
    pub const fn new(what: &'static str) -> Self {
        Self {
            what,
            state: LazyLock::new(|| Mutex::new(State::default())),
        }
    }

    /// The candidate for `key`: the one kept, or the fastest of `trial`'s candidates whose
    /// output passes the check against `reference` (built only when the shape is new), with
    /// the timings when this call made them.
    pub fn pick(
        &self,
        key: K,
        device: &Device,
        trial: &Trial<'_, C>,
        reference: impl FnOnce() -> Result<Option<Reference>, String>,
    ) -> (C, Option<Vec<Timing<C>>>) {
        // A page cannot wait for the device, which timing does: the fallback runs there.
        if cfg!(target_arch = "wasm32") {
            return (trial.fallback, None);
        }
        // Held while timing: two callers timing at once would slow each other's runs.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(&kept) = state.kept.get(&key) {
            return (kept, None);
        }
        let timings = match reference().and_then(|r| match r {
            Some(reference) => time(device, trial, &reference).map(Some),
            None => Ok(None),
        }) {
            Ok(Some(timings)) => timings,
            Ok(None) => {
                let keeps = Self::missed(&mut state, key.clone(), trial.fallback, false);
                tracing::debug!(
                    what = self.what,
                    ?key,
                    keeps_fallback = keeps,
                    "inputs not finite or the output's dtype overflowed: nothing timed"
                );
                return (trial.fallback, None);
            }
            Err(error) => {
                let keeps = Self::missed(&mut state, key.clone(), trial.fallback, true);
                tracing::warn!(what = self.what, ?key, %error, keeps_fallback = keeps,
                    "the device failed while timing");
                return (trial.fallback, None);
            }
        };
        let fastest = timings
            .iter()
            .filter_map(|t| t.outcome.as_ref().ok().map(|time| (time, t.candidate)))
            .min_by_key(|&(time, _)| time)
            .map_or(trial.fallback, |(_, candidate)| candidate);
        let times: Vec<String> = timings
            .iter()
            .map(|timing| match &timing.outcome {
                Ok(time) => format!(
                    "{} {:.3} ms",
                    name(timing.candidate),
                    time.as_secs_f64() * 1e3
                ),
                Err(why) => {
                    tracing::warn!(
                        what = self.what,
                        ?key,
                        candidate = name(timing.candidate),
                        why,
                        "a candidate left out"
                    );
                    format!("{} left out", name(timing.candidate))
                }
            })
            .collect();
        tracing::info!(
            what = self.what,
            ?key,
            picked = name(fastest),
            times = times.join(", "),
            runs = TIMED_RUNS,
            calls = trial.calls,
            "timed"
        );
        state.tries.remove(&key);
        state.kept.insert(key, fastest);
        (fastest, Some(timings))
    }

    /// Keeps `candidate` for `key`, as if timing had found it.
    #[cfg(test)]
    pub fn keep(&self, key: K, candidate: C) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.kept.insert(key, candidate);
    }

    /// What this tuner holds of the one key `this` picks out: its tries that kept nothing
    /// (failed, undecided), its kept candidate.
    #[cfg(test)]
    pub fn held(&self, this: impl Fn(&K) -> bool) -> (Option<(usize, usize)>, Option<C>) {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let tries = state.tries.iter().find(|(k, _)| this(k));
        let kept = state.kept.iter().find(|(k, _)| this(k)).map(|(_, &c)| c);
        (tries.map(|(_, t)| (t.failed, t.undecided)), kept)
    }

    /// Counts one more try of `key` that kept nothing (`failed`: the device failed; else the
    /// batch could not decide); at that count's limit the shape keeps `fallback`. Whether it
    /// now does.
    fn missed(state: &mut State<K, C>, key: K, fallback: C, failed: bool) -> bool {
        let tries = state.tries.entry(key.clone()).or_default();
        let (count, limit) = match failed {
            true => (&mut tries.failed, TIMING_TRIES),
            false => (&mut tries.undecided, UNDECIDED_TRIES),
        };
        *count += 1;
        let keeps = *count >= limit;
        if keeps {
            state.tries.remove(&key);
            state.kept.insert(key, fallback);
        }
        keeps
    }
}

/// Checks and times every candidate of `trial` (steps 2 and 3 of the module's doc).
fn time<C: Candidate>(
    device: &Device,
    trial: &Trial<'_, C>,
    reference: &Reference,
) -> Result<Vec<Timing<C>>, String> {
    let mut timings = Vec::with_capacity(trial.candidates.len());
    for &candidate in trial.candidates {
        // The first run compiles the candidate's pipelines (and runs Burn's autotune).
        let output = (trial.run)(candidate);
        let checked = reference.check(&output);
        drop(output);
        let outcome = match checked {
            Ok(()) => Ok(median_time_per_call(device, trial.calls, || {
                (trial.run)(candidate)
            })?),
            Err(why) => Err(why),
        };
        timings.push(Timing { candidate, outcome });
    }
    Ok(timings)
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;
    use crate::runtime::device;

    /// Three ways to compute `x + x`: two right (one in another order), one wrong.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
    enum Way {
        Doubled,
        Added,
        Wrong,
    }

    /// The wrong way is left out, one of the right ones is kept, and the next call of the key
    /// takes it without a trial; a reference that cannot decide keeps nothing until its
    /// limit, then the fallback.
    #[test]
    fn a_pick_leaves_out_a_wrong_candidate_and_keeps_one_right_one() {
        static TUNER: Tuner<usize, Way> = Tuner::new("test ways");
        let cpu = device::cpu();
        let x = Tensor::<2>::random([16, 8], Distribution::Uniform(-1.0, 1.0), &cpu.device);
        let run = |way| match way {
            Way::Doubled => x.clone() * 2.0,
            Way::Added => x.clone() + x.clone(),
            Way::Wrong => x.clone() * 2.0 + 1e-3,
        };
        let trial = Trial {
            candidates: &[Way::Wrong, Way::Doubled, Way::Added],
            fallback: Way::Doubled,
            calls: 2,
            run: &run,
        };
        let reference = || {
            let output = x.clone() * 2.0;
            let bound = x.clone().abs() * (2.0 * gamma(2));
            Reference::new(output, bound, DType::F32)
        };
        let (picked, timings) = TUNER.pick(1, &cpu.device, &trial, reference);
        let timings = timings.expect("a new key is timed");
        assert!(timings[0].outcome.as_ref().unwrap_err().contains("off by"));
        assert!(
            timings[1..].iter().all(|t| t.outcome.is_ok()),
            "{timings:?}"
        );
        assert!(matches!(picked, Way::Doubled | Way::Added));
        assert_eq!(
            TUNER.pick(1, &cpu.device, &trial, reference),
            (picked, None)
        );

        for tries in 1..=UNDECIDED_TRIES {
            assert_eq!(
                TUNER.pick(2, &cpu.device, &trial, || Ok(None)),
                (Way::Doubled, None)
            );
            let expected = match tries < UNDECIDED_TRIES {
                true => (Some((0, tries)), None),
                false => (None, Some(Way::Doubled)),
            };
            assert_eq!(TUNER.held(|&k| k == 2), expected);
        }
        for tries in 1..=TIMING_TRIES {
            let failed = || Err("the device is lost".to_owned());
            assert_eq!(
                TUNER.pick(3, &cpu.device, &trial, failed),
                (Way::Doubled, None)
            );
            let expected = match tries < TIMING_TRIES {
                true => (Some((tries, 0)), None),
                false => (None, Some(Way::Doubled)),
            };
            assert_eq!(TUNER.held(|&k| k == 3), expected);
        }
    }

    /// Where every candidate is wrong, the fallback is kept.
    #[test]
    fn nothing_right_keeps_the_fallback() {
        static TUNER: Tuner<usize, Way> = Tuner::new("test ways");
        let cpu = device::cpu();
        let x = Tensor::<2>::ones([4, 4], &cpu.device);
        let run = |_| x.clone() * 3.0;
        let trial = Trial {
            candidates: &[Way::Wrong, Way::Added],
            fallback: Way::Doubled,
            calls: 1,
            run: &run,
        };
        let reference = || Reference::new(x.clone() * 2.0, x.zeros_like(), DType::F32);
        let (picked, timings) = TUNER.pick(1, &cpu.device, &trial, reference);
        assert_eq!(picked, Way::Doubled);
        assert!(timings.unwrap().iter().all(|t| t.outcome.is_err()));
        assert_eq!(TUNER.held(|&k| k == 1), (None, Some(Way::Doubled)));
    }
}
