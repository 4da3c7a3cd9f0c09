//! Faults on the device: device work guarded against panics, and a failed step told apart
//! from a lost device (which fails every later call until the engine is rebuilt).

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};

use futures_util::FutureExt;

use super::{Engine, EngineError};

impl Engine {
    /// A step's device work's result, with an [`EngineError::Execution`] classified by
    /// [`Engine::device_failure`].
    pub(super) fn classify<T>(&mut self, result: Result<T, EngineError>) -> Result<T, EngineError> {
        match result {
            Err(EngineError::Execution(reason)) => Err(self.device_failure(reason)),
            other => other,
        }
    }

    /// Classifies a failed step: a lost device fails this and every later call
    /// ([`EngineError::DeviceLost`]; [`Engine::rebuild`] on a new device); anything else
    /// fails this call only.
    fn device_failure(&mut self, reason: String) -> EngineError {
        let lost = self.device_is_lost();
        tracing::error!(lost, reason, "a step failed on the device");
        if lost {
            self.lost = Some(reason.clone());
            EngineError::DeviceLost(reason)
        } else {
            EngineError::Execution(reason)
        }
    }

    /// Whether the device is gone (waits for it).
    #[cfg(not(target_arch = "wasm32"))]
    fn device_is_lost(&self) -> bool {
        if let Some(setup) = &self.device.wgpu {
            // Lets wgpu run its device-lost callback if the device is gone.
            let _ = setup
                .device
                .poll(burn::tensor::wgpu::wgpu::PollType::wait_indefinitely());
        }
        matches!(self.device.device.sync(), Err(e) if e.is_device_poisoned())
    }

    /// A page cannot wait for the device to tell: a failed step fails its call only, and a
    /// page whose calls keep failing opens a new engine.
    #[cfg(target_arch = "wasm32")]
    fn device_is_lost(&self) -> bool {
        false
    }
}

/// Runs device work; a fault inside Burn or the driver may surface as a panic, and becomes an
/// [`EngineError::Execution`] too.
pub(super) fn guarded<T>(work: impl FnOnce() -> Result<T, EngineError>) -> Result<T, EngineError> {
    catch_unwind(AssertUnwindSafe(work))
        .unwrap_or_else(|panic| Err(EngineError::Execution(panic_message(&panic))))
}

/// [`guarded`] for device work that is awaited.
pub(super) async fn guarded_async<T>(
    work: impl Future<Output = Result<T, EngineError>>,
) -> Result<T, EngineError> {
    AssertUnwindSafe(work)
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| Err(EngineError::Execution(panic_message(&panic))))
}

/// The message a panic carried.
fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}
