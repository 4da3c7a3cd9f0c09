//! What the GPU benches share: the device, a count from the environment, criterion's settings.

use std::time::Duration;

use criterion::Criterion;
use mmlora::runtime::device::{self, RuntimeDevice};

/// The GPU wgpu finds, named on standard error, or `None` (saying why) where it finds none.
pub fn gpu() -> Option<RuntimeDevice> {
    match device::gpu() {
        Ok(gpu) => {
            eprintln!("gpu: {}", gpu.description);
            Some(gpu)
        }
        Err(error) => {
            eprintln!("no GPU benchmark: {error}");
            None
        }
    }
}

/// The number in the environment variable `name`, or `default` where it is unset.
pub fn count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name} is a count, not {value:?}")),
        Err(_) => default,
    }
}

/// Criterion warming up for 2 s and measuring for 10 s (its `--warm-up-time` and
/// `--measurement-time` override them).
pub fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(10))
}
