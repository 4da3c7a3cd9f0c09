//! Which shrink kernel the op runs on a hardware GPU: the faster of `split` and `wide` for each
//! shape, timed on the device ([`ShrinkKernel::Timed`], what `auto` takes there).
//!
//! No one of the two is the faster on every GPU and at every size: `wide` keeps four times the
//! loads in flight, which pays where `split` leaves cores idle (few rows on many cores) and
//! costs where it does not. So the first time the op runs on a shape, each candidate runs once
//! on that call's own inputs (its pipelines compiled), then [`TIMED_RUNS`] more times between
//! device syncs; the median time is its time, and the fastest is kept for the shape.
//!
//! The picks are kept for the process, per device, dtype and shape (rows rounded up to a power
//! of two, the input width, the output width and each slice's width, offset and rank). Both
//! candidates are the same two shaders at two workgroup sizes, tested against the native op and
//! float64 alike, so unlike the linears' candidates their outputs are not checked again here. A
//! device failure while timing keeps `split`, the first candidate, for the shape; the failure
//! surfaces where the step reads its results.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Duration;

use burn::backend::{Device as _, DeviceId};
use burn::tensor::{DType, Tensor};

use super::{LoraBatch, LoraSlice, ShrinkKernel, apply};
use crate::timing::{TIMED_RUNS, median_time};

/// What [`ShrinkKernel::Timed`] chooses from; the first is kept where timing fails.
pub const CANDIDATES: [ShrinkKernel; 2] = [ShrinkKernel::Split, ShrinkKernel::Wide];

/// A shape picks are kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ShapeKey {
    device: DeviceId,
    dtype: DType,
    /// Rows rounded up to a power of two.
    rows: usize,
    in_features: usize,
    out_total: usize,
    /// `(out_features, offset, rank)` of each slice.
    slices: Vec<(usize, usize, usize)>,
}

/// The kernel kept for each shape so far.
static PICKS: LazyLock<Mutex<HashMap<ShapeKey, ShrinkKernel>>> = LazyLock::new(Mutex::default);

/// The shrink kernel for this call's shape among [`CANDIDATES`], with the candidates' times
/// when this call made them (`None`: the pick was kept from an earlier call). `x`, `base`,
/// `slices` and `batch` are the op's checked inputs, with at least one adapter row.
pub(super) fn pick(
    x: &Tensor<2>,
    base: &Tensor<2>,
    slices: &[LoraSlice],
    batch: &LoraBatch,
) -> (ShrinkKernel, Option<Vec<Result<Duration, String>>>) {
    let [rows, in_features] = x.dims();
    let [_, out_total] = base.dims();
    let key = ShapeKey {
        device: x.device().as_dispatch().to_id(),
        dtype: x.dtype(),
        rows: rows.next_power_of_two(),
        in_features,
        out_total,
        slices: slices
            .iter()
            .map(|s| {
                let [_, out_features, rank] = s.b.dims();
                (out_features, s.offset, rank)
            })
            .collect(),
    };
    // Held while timing: two callers timing at once would slow each other's runs.
    let mut picks = PICKS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&kernel) = picks.get(&key) {
        return (kernel, None);
    }
    let device = x.device();
    let times: Vec<Result<Duration, String>> = CANDIDATES
        .iter()
        .map(|&shrink| {
            let run = || {
                apply(
                    x.clone(),
                    base.clone(),
                    slices,
                    &batch.with_plan_shrink(shrink),
                )
            };
            // The first run compiles the kernel's pipelines.
            drop(run());
            median_time(&device, run)
        })
        .collect();
    let fastest = CANDIDATES
        .iter()
        .zip(&times)
        .filter_map(|(&kernel, time)| time.as_ref().ok().map(|&time| (time, kernel)))
        .min_by_key(|&(time, _)| time)
        .map_or(CANDIDATES[0], |(_, kernel)| kernel);
    let report: Vec<String> = CANDIDATES
        .iter()
        .zip(&times)
        .map(|(kernel, time)| match time {
            Ok(time) => format!("{} {:.3} ms", kernel.name(), time.as_secs_f64() * 1e3),
            Err(error) => format!("{} failed: {error}", kernel.name()),
        })
        .collect();
    tracing::info!(rows, in_features, out_total, slices = ?key.slices, dtype = ?key.dtype,
        picked = fastest.name(), times = report.join(", "), runs = TIMED_RUNS,
        "LoRA shrink kernels timed");
    picks.insert(key, fastest);
    (fastest, Some(times))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device;
    use crate::lora::ops::testing::Problem;

    /// A problem of `rows` rows in a shape no other test runs, so that this test's first call
    /// is the one that times it: two slices, three slots, a quarter of the rows without one.
    fn problem(rows: usize) -> Problem {
        Problem {
            in_features: 44,
            slices: vec![(20, 4), (8, 2)],
            slots: 3,
            token_slots: (0..rows).map(|r| (r % 4) as i32 - 1).collect(),
        }
    }

    /// `pick` on a fresh random problem of `rows` rows.
    fn pick_on(
        rows: usize,
        gpu: &device::RuntimeDevice,
    ) -> (ShrinkKernel, Option<Vec<Result<Duration, String>>>) {
        let problem = problem(rows);
        let data = problem.data(gpu);
        let batch = LoraBatch::with_shrink(problem.meta(), gpu, ShrinkKernel::Timed);
        pick(&data.x, &data.base, &data.slices, &batch)
    }

    #[test]
    fn a_shape_is_timed_once_and_its_pick_kept() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let (first, times) = pick_on(40, &gpu);
        let times = times.expect("the shape's first call times the candidates");
        assert_eq!(times.len(), CANDIDATES.len());
        assert!(times.iter().all(Result::is_ok), "{times:?}");
        assert!(CANDIDATES.contains(&first));
        // 64 rows round to the same power of two as 40: the pick is kept, nothing timed.
        assert_eq!(pick_on(64, &gpu), (first, None));
        // 65 rows do not: another shape, timed anew.
        assert!(pick_on(65, &gpu).1.is_some());
    }
}
