//! Timing kernels on the device while the runtime runs: how the ops' kernel choices that are
//! made by measurement (the linears' kernel, the LoRA shrink, whether the LoRA op runs fused
//! into the linear) time their candidates.

use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Tensor, s};

/// Timed runs per candidate, after the one that compiled it.
pub const TIMED_RUNS: usize = 3;

/// The median time of [`TIMED_RUNS`] runs of `run`, each between device syncs, or the
/// device's error.
pub fn median_time(device: &Device, run: impl Fn() -> Tensor<2>) -> Result<Duration, String> {
    median_time_per_call(device, 1, run)
}

/// The median time per call of [`TIMED_RUNS`] runs of `calls` calls of `run` each, back to back
/// between device syncs (as a forward pass runs its layers: where one call takes about what a
/// sync does, the sync's own time and its jitter weigh less), or the device's error.
pub fn median_time_per_call(
    device: &Device,
    calls: usize,
    run: impl Fn() -> Tensor<2>,
) -> Result<Duration, String> {
    let mut times = (0..TIMED_RUNS)
        .map(|_| time_per_call(device, calls, &run))
        .collect::<Result<Vec<_>, _>>()?;
    times.sort();
    Ok(times[TIMED_RUNS / 2])
}

/// The time per call of `calls` calls of `run` back to back, the device waited for before the
/// first and after the last, or the device's error. The outputs are held until that last sync,
/// so that the work behind them cannot be dropped unrun.
pub fn time_per_call(
    device: &Device,
    calls: usize,
    run: impl Fn() -> Tensor<2>,
) -> Result<Duration, String> {
    let sync = || device.sync().map_err(|e| e.to_string());
    sync()?;
    let calls = calls.max(1);
    let started = Instant::now();
    let outputs: Vec<Tensor<2>> = (0..calls).map(|_| run()).collect();
    sync()?;
    let elapsed = started.elapsed();
    drop(outputs);
    Ok(elapsed / calls as u32)
}

/// The one value of `tensor`, or the device's error reading it: where a candidate's failure
/// shows, since a sync alone does not report a refused launch.
pub fn read(tensor: Tensor<1>) -> Result<f32, String> {
    tensor.try_into_scalar::<f32>().map_err(|e| e.to_string())
}

/// Reads one value of `output`, the first run of a candidate (which compiled its pipelines): a
/// failure of the device, or of an allocation for the candidate's tensors, shows here, where a
/// sync alone would time the refused launches.
pub fn first_run(output: Tensor<2>) -> Result<(), String> {
    let value = output.slice(s![0..1, 0..1]).reshape([1]).cast(DType::F32);
    read(value).map(drop)
}
