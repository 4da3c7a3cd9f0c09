//! Timing work on the device: the clocks the tuner ([`super::tuner`]) and the benches read,
//! each waiting for the device before and after what it times.

use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor};

/// Timed runs per candidate, after the one that compiled it.
pub const TIMED_RUNS: usize = 3;

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
