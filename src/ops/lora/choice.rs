//! Which shrink kernel the op runs on a hardware GPU: the faster of `split` and `wide` for each
//! shape ([`ShrinkKernel::Timed`]), chosen by the runtime's one tuner
//! ([`crate::runtime::tuner`]).
//!
//! No one of the two is the faster on every GPU and at every size: `wide` keeps four times the
//! loads in flight, which pays where `split` leaves cores idle (few rows on many cores) and
//! costs where it does not. The picks are kept per device, dtype and shape: the tiles of
//! adapter rows (what both kernels launch a workgroup for) rounded up to a power of two, the
//! input width, the output width and each slice's width, offset and rank. The two add up a
//! row's products in different orders, so where the pick differs (another process, another
//! tile count) the op's last bits may too, within the same rounding bound.

use burn::backend::{Device as _, DeviceId};
use burn::tensor::{DType, Tensor};

use super::{LoraBatch, LoraSlice, ShrinkKernel, TILE, apply, composed};
use crate::runtime::tuner::{Timing, Trial, Tuner};

/// What [`ShrinkKernel::Timed`] chooses from; the first runs where nothing is kept.
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

static TUNER: Tuner<ShapeKey, ShrinkKernel> = Tuner::new("LoRA shrink");

/// The shrink kernel for this call's shape among [`CANDIDATES`], with the candidates' timings
/// when this call made them (`None`: the pick was kept from an earlier call, or nothing was
/// timed). `x`, an output of `out_total` columns, `slices` and `batch` are the op's checked
/// inputs, with at least one adapter row. The candidates run as the unfused op, adding to an
/// output of zeros (their time does not hang on its values), each checked against the
/// composed op ([`composed::reference`]), and the pick serves the fused op
/// ([`linear_lora`](super::linear_lora)) too, whose shrink is the same launch.
pub(super) fn pick(
    x: &Tensor<2>,
    out_total: usize,
    slices: &[LoraSlice],
    batch: &LoraBatch,
) -> (ShrinkKernel, Option<Vec<Timing<ShrinkKernel>>>) {
    let [rows, in_features] = x.dims();
    let key = ShapeKey {
        device: x.device().as_dispatch().to_id(),
        dtype: x.dtype(),
        tiles: batch.meta().tiles(TILE).count().next_power_of_two(),
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
    let device = x.device();
    let base = Tensor::<2>::zeros([rows, out_total], &device).cast(x.dtype());
    let run = |shrink| {
        apply(
            x.clone(),
            base.clone(),
            slices,
            &batch.with_plan_shrink(shrink),
        )
    };
    let trial = Trial {
        candidates: &CANDIDATES,
        fallback: CANDIDATES[0],
        calls: 1,
        run: &run,
    };
    TUNER.pick(key, &device, &trial, || {
        composed::reference(x, &base, slices, batch.meta())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::lora::testing::Problem;
    use crate::routing::meta::KernelMeta;
    use crate::runtime::device;
    use crate::runtime::tuner::TIMING_TRIES;

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
    ) -> (ShrinkKernel, Option<Vec<Timing<ShrinkKernel>>>) {
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
        assert!(times.iter().all(|t| t.outcome.is_ok()), "{times:?}");
        assert!(CANDIDATES.contains(&first));
        // 40 rows are 3 tiles, one per slot; 100 rows are 6, which rounds to 8, not 4: another
        // shape, timed anew.
        assert!(pick_on(100, &gpu).1.is_some());
        // 64 rows are 3 tiles too (16 rows per slot): the pick is kept, nothing timed.
        assert_eq!(pick_on(64, &gpu), (first, None));
    }

    /// An output past the device's buffer limit: building the reference fails, so the call
    /// runs `split` and keeps nothing, until the tuner's last try keeps `split`.
    #[test]
    fn a_shape_whose_timing_keeps_failing_keeps_split() {
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
        let this = |key: &ShapeKey| key.out_total == out_total;
        for tries in 1..=TIMING_TRIES {
            assert_eq!(
                pick(&x, out_total, &slices, &batch),
                (CANDIDATES[0], None),
                "try {tries}"
            );
            let expected = match tries < TIMING_TRIES {
                true => (Some((tries, 0)), None),
                false => (None, Some(CANDIDATES[0])),
            };
            assert_eq!(TUNER.held(this), expected, "try {tries}");
        }
    }
}
