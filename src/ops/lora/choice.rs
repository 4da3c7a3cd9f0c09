//! Which shrink kernel the op runs on a hardware GPU: the faster of `split` and `wide` for each
//! shape, timed on the device ([`ShrinkKernel::Timed`], what `auto` takes there).
//!
//! No one of the two is the faster on every GPU and at every size: `wide` keeps four times the
//! loads in flight, which pays where `split` leaves cores idle (few rows on many cores) and
//! costs where it does not. So the first time the op runs on a shape, each candidate runs once
//! on that call's own inputs (its pipelines compiled, one value of its output read back, so that
//! a failure shows), then [`TIMED_RUNS`] more times between device syncs; the median time is
//! its time, and the fastest is kept for the shape.
//!
//! The picks are kept for the process, per device, dtype and shape: the tiles of adapter rows
//! (what both kernels launch a workgroup for) rounded up to a power of two, the input width,
//! the output width and each slice's width, offset and rank. Both candidates are the same two
//! shaders at two workgroup sizes, tested against the native op and float64 alike, so unlike
//! the linears' candidates their outputs are not checked again here. They add up a row's
//! products in different orders, so where the pick differs (another process, another tile
//! count) the op's last bits may too, within the same rounding bound. Where the device fails
//! while timing, the call runs `split`, the first candidate, and nothing is kept (the next call
//! on the shape times again); the failure surfaces where the step reads its results.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Duration;

use burn::backend::{Device as _, DeviceId};
use burn::tensor::{DType, Tensor};

use super::{LoraBatch, LoraSlice, ShrinkKernel, TILE, apply};
use crate::runtime::timing::{TIMED_RUNS, first_run, median_time};

/// What [`ShrinkKernel::Timed`] chooses from; the first runs where timing fails.
pub const CANDIDATES: [ShrinkKernel; 2] = [ShrinkKernel::Split, ShrinkKernel::Wide];

/// A shape picks are kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ShapeKey {
    device: DeviceId,
    dtype: DType,
    /// Tiles of adapter rows ([`TILE_ROWS`](super::TILE_ROWS) rows of one slot each), rounded
    /// up to a power of two.
    tiles: usize,
    in_features: usize,
    out_total: usize,
    /// `(out_features, offset, rank)` of each slice.
    slices: Vec<(usize, usize, usize)>,
}

/// The kernel kept for each shape so far.
static PICKS: LazyLock<Mutex<HashMap<ShapeKey, ShrinkKernel>>> = LazyLock::new(Mutex::default);

/// The shrink kernel for this call's shape among [`CANDIDATES`], with the candidates' times
/// when this call made them (`None`: the pick was kept from an earlier call). `x`, an output of
/// `out_total` columns, `slices` and `batch` are the op's checked inputs, with at least one
/// adapter row. The candidates are timed as the unfused op, adding to an output of zeros (their
/// time does not hang on its values), and the pick serves the fused op
/// ([`linear_lora`](super::linear_lora)) too, whose shrink is the same launch.
pub(super) fn pick(
    x: &Tensor<2>,
    out_total: usize,
    slices: &[LoraSlice],
    batch: &LoraBatch,
) -> (ShrinkKernel, Option<Vec<Result<Duration, String>>>) {
    let [rows, in_features] = x.dims();
    let tiles = batch.meta().tiles(TILE).count();
    let key = ShapeKey {
        device: x.device().as_dispatch().to_id(),
        dtype: x.dtype(),
        tiles: tiles.next_power_of_two(),
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
    let base = Tensor::<2>::zeros([rows, out_total], &device).cast(x.dtype());
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
            first_run(run()).and_then(|()| median_time(&device, run))
        })
        .collect();
    let report: Vec<String> = CANDIDATES
        .iter()
        .zip(&times)
        .map(|(kernel, time)| match time {
            Ok(time) => format!("{} {:.3} ms", kernel.name(), time.as_secs_f64() * 1e3),
            Err(error) => format!("{} failed: {error}", kernel.name()),
        })
        .collect();
    let report = report.join(", ");
    // A failure may reach the sync of whichever candidate ran after it: no fair comparison.
    if times.iter().any(Result::is_err) {
        tracing::warn!(
            tiles,
            in_features,
            out_total,
            times = report,
            "the device failed while timing LoRA shrink kernels: split, nothing kept"
        );
        return (CANDIDATES[0], Some(times));
    }
    let fastest = CANDIDATES
        .into_iter()
        .zip(times.iter().flatten())
        .min_by_key(|&(_, time)| *time)
        .map_or(CANDIDATES[0], |(kernel, _)| kernel);
    tracing::info!(tiles, in_features, out_total, slices = ?key.slices, dtype = ?key.dtype,
        picked = fastest.name(), times = report, runs = TIMED_RUNS,
        "LoRA shrink kernels timed");
    picks.insert(key, fastest);
    (fastest, Some(times))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::lora::testing::Problem;
    use crate::routing::meta::KernelMeta;
    use crate::runtime::device;

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
        pick(&data.x, problem.out_total(), &data.slices, &batch)
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
        // 40 rows are 3 tiles, one per slot; 100 rows are 6, which rounds to 8, not 4: another
        // shape, timed anew.
        assert!(pick_on(100, &gpu).1.is_some());
        // 64 rows are 3 tiles too (16 rows per slot): the pick is kept, nothing timed.
        assert_eq!(pick_on(64, &gpu), (first, None));
    }

    /// An output past the device's buffer limit: its allocation fails, so does every
    /// candidate's first run, and the call runs `split` and keeps nothing, so that the next
    /// call of the shape times again.
    #[test]
    fn a_call_whose_timing_fails_runs_split_and_keeps_nothing() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let d = &gpu.device;
        let rows = 16;
        let limit = usize::try_from(gpu.buffer_limit.unwrap()).unwrap();
        let out_total = (limit / (4 * rows) + 1).next_multiple_of(4);
        let x = Tensor::<2>::ones([rows, 4], d);
        let slices = [LoraSlice {
            a: Tensor::ones([1, 1, 4], d),
            b: Tensor::ones([1, 4, 1], d),
            offset: 0,
        }];
        let meta = KernelMeta::from_token_slots(vec![0; rows], 1).unwrap();
        let batch = LoraBatch::with_shrink(meta, &gpu, ShrinkKernel::Timed);
        for call in 0..2 {
            let (kernel, times) = pick(&x, out_total, &slices, &batch);
            assert_eq!(kernel, CANDIDATES[0], "call {call}");
            let times = times.expect("nothing kept, so each call times");
            assert!(times.iter().all(Result::is_err), "call {call}: {times:?}");
        }
    }
}
