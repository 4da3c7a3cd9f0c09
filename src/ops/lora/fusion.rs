//! Whether a layer's LoRA op runs fused into its base product, on a GPU where the linears'
//! kernels are timed per shape (`auto` on a hardware GPU): the faster of the two, timed on the
//! device, as [`choice`](super::choice) times the shrinks.
//!
//! Fused ([`FusedLinear::run`]), the linear kernel's epilogue adds each row's delta as it
//! stores the row, which saves the expand's launch and its pass over the output; but it loads
//! `B[slot]` for every four rows it stores (every row, where they mix slots), where the expand
//! loads it once per tile of 16 rows. Which costs more hangs on the GPU and the shape: on
//! lavapipe an epilogue in `linear.wgsl` that loaded `B` for every row cost 12.8 % of the base
//! product where the op apart cost 2.1 %. So the first time a shape runs with adapter rows, the
//! op runs both ways on that call's own inputs, once each (its pipelines compiled, one value of
//! its output read back, so that a failure shows), then [`TIMED_RUNS`] times
//! [`BACK_TO_BACK_CALLS`] calls back to back between device syncs; the median time per call is
//! its time, and the faster way is kept for the shape. Back to back, since the two ways differ
//! by a few percent of a call, and on the H200 a sync alone takes about 0.37 ms, a third of a
//! 2048-row `attn.qkv` product in f32: one call at a time, the syncs' jitter could decide.
//!
//! The choices are kept for the process, per device, dtype, linear shader and shape: rows
//! rounded up to a power of two, the input and output widths and the rank. Both ways are
//! tested against float64 alike (`fused_linear_lora_matches_float64` and the op's own tests),
//! so their outputs are not checked again here; they round the delta into the output once
//! (fused) or twice (apart), so where the choice differs the output's last bits may too. Where
//! the device fails while timing, the call runs fused and nothing is kept (the next call on
//! the shape times again); the failure surfaces where the step reads its results.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Duration;

use burn::backend::{Device as _, DeviceId};
use burn::tensor::{DType, Tensor};

use super::FusedLinear;
use crate::ops::linear::LinearShader;
use crate::runtime::timing::{TIMED_RUNS, first_run, median_time_per_call};

/// A shape choices are kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ShapeKey {
    device: DeviceId,
    dtype: DType,
    shader: LinearShader,
    /// Rows rounded up to a power of two.
    rows: usize,
    in_features: usize,
    out_features: usize,
    rank: usize,
}

impl ShapeKey {
    /// The shape of `fused`'s op on `x`.
    fn new(x: &Tensor<2>, fused: &FusedLinear<'_>) -> Self {
        let [rows, in_features] = x.dims();
        let [_, out_features] = fused.weight_t.dims();
        ShapeKey {
            device: x.device().as_dispatch().to_id(),
            dtype: x.dtype(),
            shader: fused.shader,
            rows: rows.next_power_of_two(),
            in_features,
            out_features,
            rank: fused.slice.b.dims()[2],
        }
    }
}

/// Calls of each way per timed run, back to back between two device syncs.
pub const BACK_TO_BACK_CALLS: usize = 4;

/// Whether each shape runs fused, so far.
static KEPT: LazyLock<Mutex<HashMap<ShapeKey, bool>>> = LazyLock::new(Mutex::default);

/// The two ways' times when a call made them: fused, then apart.
pub type Times = [Result<Duration, String>; 2];

/// Whether `fused`'s op runs fused on `x` (the input [`fuse`](super::fuse) checked), with the
/// two ways' times when this call made them (`None`: the choice was kept from an earlier call).
pub fn fuses(x: &Tensor<2>, fused: &FusedLinear<'_>) -> (bool, Option<Times>) {
    let key = ShapeKey::new(x, fused);
    // Held while timing: two callers timing at once would slow each other's runs.
    let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&fuses) = kept.get(&key) {
        return (fuses, None);
    }
    let device = x.device();
    let time = |run: &dyn Fn() -> Tensor<2>| {
        first_run(run()).and_then(|()| median_time_per_call(&device, BACK_TO_BACK_CALLS, run))
    };
    let times = [
        time(&|| fused.run(x.clone())),
        time(&|| fused.apart(x.clone())),
    ];
    let [fused_time, apart_time] = &times;
    let report = |time: &Result<Duration, String>| match time {
        Ok(time) => format!("{:.3} ms", time.as_secs_f64() * 1e3),
        Err(error) => format!("failed: {error}"),
    };
    let (fused_report, apart_report) = (report(fused_time), report(apart_time));
    let (Ok(fused_time), Ok(apart_time)) = (fused_time, apart_time) else {
        // A failure may reach the sync of whichever way ran after it: no fair comparison.
        tracing::warn!(
            ?key,
            fused = fused_report,
            apart = apart_report,
            "the device failed while timing the LoRA op fused and apart: fused, nothing kept"
        );
        return (true, Some(times));
    };
    let fuses = fused_time <= apart_time;
    tracing::info!(
        rows = x.dims()[0],
        ?key,
        fuses,
        fused = fused_report,
        apart = apart_report,
        runs = TIMED_RUNS,
        calls = BACK_TO_BACK_CALLS,
        "LoRA op timed fused and apart"
    );
    kept.insert(key, fuses);
    (fuses, Some(times))
}

/// Keeps `fuses` for the shape of `fused`'s op on `x`, as if timing had found it.
#[cfg(test)]
pub(crate) fn keep_for_tests(x: &Tensor<2>, fused: &FusedLinear<'_>, fuses: bool) {
    let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
    kept.insert(ShapeKey::new(x, fused), fuses);
}

#[cfg(test)]
mod tests {
    use burn::tensor::DType;

    use super::super::testing::fused_layer;
    use super::super::{LoraBatch, fuse};
    use super::*;
    use crate::runtime::device;

    /// `fuses` on a fresh random layer of `rows` rows, in a shape no other test runs, whose op
    /// `tiled` takes fused.
    fn fuses_on(rows: usize, gpu: &device::RuntimeDevice) -> (bool, Option<Times>) {
        let (problem, data, weight_t, bias) = fused_layer([rows, 44, 52], (3, 4), DType::F32);
        let on = data.to_device(gpu);
        let (weight_t, bias) = (weight_t.to_device(&gpu.device), bias.to_device(&gpu.device));
        let batch = LoraBatch::new(problem.meta(), gpu);
        let shader = LinearShader::Tiled;
        let fused = fuse(&on.x, &weight_t, &bias, &on.slices[0], &batch, shader)
            .unwrap()
            .expect("tiled takes the op fused");
        fuses(&on.x, &fused)
    }

    #[test]
    fn a_shape_is_timed_once_and_its_choice_kept() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let (first, times) = fuses_on(40, &gpu);
        let times = times.expect("the shape's first call times both ways");
        assert!(times.iter().all(Result::is_ok), "{times:?}");
        // 40 rows round to 64, 100 to 128: another shape, timed anew.
        assert!(fuses_on(100, &gpu).1.is_some());
        // 64 rows round to 64: the choice is kept, nothing timed.
        assert_eq!(fuses_on(64, &gpu), (first, None));
    }
}
