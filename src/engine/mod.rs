//! The engine: requests (an image and an optional adapter each) in, per-request embeddings out.
//!
//! One [`Engine::encode`] call: preprocess every image → plan scheduler steps that fit the
//! `max_loras` GPU slots → per step: lay the requests out as scheduled encoder inputs, build the
//! TOWER and CONNECTOR mappings with [`crate::routing::mapping`], activate the step's adapters in
//! the slot table (restacking the model's LoRA weights only when the slots changed), turn the
//! mappings into kernel metadata, run tower and connector once over the step, split per request.
//!
//! This file holds the engine and its lifecycle (open, rebuild, what it runs on); each other job
//! has a file of its own: `types` (what it takes and gives), `error` (why it fails), `adapters`
//! (the adapters it holds), `slots` (the GPU slots), `step` (the steps of a call), `faults`
//! (device faults), `checks` (what is refused before anything runs), `plan` (the step planner),
//! `batch` (batch files) and `shared` (one engine for many threads).

mod adapters;
pub mod batch;
mod checks;
mod error;
mod faults;
pub(crate) mod plan;
// Threads share an engine natively; a page has one thread, which awaits the device.
#[cfg(not(target_arch = "wasm32"))]
mod shared;
mod slots;
mod step;
mod types;

pub use error::EngineError;
#[cfg(not(target_arch = "wasm32"))]
pub use shared::SharedEngine;
pub use types::{Encoded, EngineOptions, HostTensor, ImageSource, MAX_LORAS, Request};

use std::path::{Path, PathBuf};

// `std::time::Instant` panics on wasm32 (no clock there); this one reads the page's.
use web_time::Instant;

use crate::adapters::registry::{AdapterKey, AdapterRegistry};
use crate::models::{self, VisionTower};
use crate::ops::kernels::{KernelPins, Kernels};
use crate::preprocess::PreprocessConfig;
use crate::routing::meta::SlotTable;
use crate::runtime::device::{Precision, RuntimeDevice};
use checks::{check_consistent, check_fits_f16, check_options, check_stacks_fit};

/// A model on a device, the adapters loaded for it, and the adapters stacked in its slots.
#[derive(Debug)]
pub struct Engine {
    model: Box<dyn VisionTower>,
    preprocess: PreprocessConfig,
    device: RuntimeDevice,
    options: EngineOptions,
    registry: AdapterRegistry,
    slots: SlotTable,
    /// For each slot, the step that last used it: a step needing room frees the slots used
    /// least recently.
    slot_used: Vec<u64>,
    /// Steps that activated adapters so far.
    activations: u64,
    /// The adapter whose weights are stacked in each slot of the model's layers; `None` while
    /// that is unknown (a restack that failed part way), so the next step restacks.
    stacked: Option<Vec<Option<AdapterKey>>>,
    /// The folder the model was read from (none for a model built in memory).
    model_dir: Option<PathBuf>,
    /// Why the device was lost, once it was.
    lost: Option<String>,
}

impl Engine {
    /// Loads the Qwen2-VL checkpoint in `model_dir` onto `device`.
    pub fn open(
        model_dir: &Path,
        device: RuntimeDevice,
        options: EngineOptions,
    ) -> Result<Self, EngineError> {
        check_options(&options, &device)?;
        let started = Instant::now();
        let preprocess =
            PreprocessConfig::from_model_dir(model_dir).map_err(EngineError::Preprocess)?;
        let model = models::load(model_dir, &device.device)?;
        if let Err(reason) = check_consistent(&preprocess, options.image_backend, model.layout()) {
            return Err(EngineError::Inconsistent {
                // Where the processor's settings came from; the folder where they are defaults.
                path: PreprocessConfig::file_in(model_dir).unwrap_or_else(|| model_dir.to_owned()),
                reason,
            });
        }
        tracing::info!(
            model = %model_dir.display(),
            device = %device.description,
            seconds = started.elapsed().as_secs_f64(),
            "model loaded"
        );
        let mut engine = Self::with_model(model, preprocess, device, options)?;
        engine.model_dir = Some(model_dir.to_owned());
        Ok(engine)
    }

    /// A new engine like this one on `device` (after this one's device was lost, say): the
    /// model read again from its folder, and every adapter registered as it was here. The
    /// weights in memory stay there, in the same least-recently-used order, checked against
    /// the model as read again; evicted ones are read back from their folders when a request
    /// needs them, as here. This engine is left as it was.
    pub fn rebuild(&self, device: RuntimeDevice) -> Result<Engine, EngineError> {
        let Some(model_dir) = &self.model_dir else {
            return Err(EngineError::Options(
                "an engine around a model built in memory cannot be rebuilt".to_owned(),
            ));
        };
        let mut engine = Engine::open(model_dir, device, self.options)?;
        let targets = engine.model.lora_targets();
        for adapter in self.registry.in_memory() {
            // In the same precision as here, so they fit it.
            adapter.check(&targets, self.options.max_rank)?;
        }
        engine.registry = self.registry.clone();
        Ok(engine)
    }

    /// An engine around a model already on `device` (e.g.
    /// [`Qwen2VlVision::random`](crate::models::qwen2_vl::Qwen2VlVision::random)).
    pub fn with_model(
        mut model: Box<dyn VisionTower>,
        preprocess: PreprocessConfig,
        device: RuntimeDevice,
        options: EngineOptions,
    ) -> Result<Self, EngineError> {
        check_options(&options, &device)?;
        check_consistent(&preprocess, options.image_backend, model.layout())
            .map_err(|reason| EngineError::Options(format!("the image processor: {reason}")))?;
        check_stacks_fit(model.as_ref(), &options, &device)?;
        if let Some(limit) = device.buffer_limit {
            model.set_buffer_limit(limit.min(model.buffer_limit()));
        }
        if options.precision == Precision::F16 {
            check_fits_f16(model.as_ref())?;
        }
        let pins = options.kernels.or(KernelPins::from_env()?);
        let kernels = Kernels::choose(pins, &device, options.precision)?;
        let mut model = model.cast(options.precision.dtype());
        model.set_kernels(kernels);
        Ok(Self {
            model,
            preprocess,
            device,
            registry: AdapterRegistry::new(options.max_cpu_adapters),
            slots: SlotTable::new(options.max_loras),
            slot_used: vec![0; options.max_loras],
            activations: 0,
            stacked: Some(vec![None; options.max_loras]),
            options,
            model_dir: None,
            lost: None,
        })
    }

    /// The device the model runs on.
    pub fn device(&self) -> &RuntimeDevice {
        &self.device
    }

    /// The model.
    pub fn model(&self) -> &dyn VisionTower {
        self.model.as_ref()
    }

    /// The image processor's settings (from the model folder).
    pub fn preprocess_config(&self) -> &PreprocessConfig {
        &self.preprocess
    }

    /// The engine's limits.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// The most tower rows one step runs: `max_step_rows`, or fewer where the device's buffer
    /// limit allows fewer.
    pub fn step_rows(&self) -> usize {
        self.options.max_step_rows.min(self.model.max_rows())
    }
}

/// Dropping an engine waits for the work it submitted. The device outlives the engine (Burn
/// keeps one per process), and a process that exits while a driver thread still runs that
/// work may crash inside the driver: lavapipe's queue thread was seen to fault in LLVM, whose
/// globals the exit had already torn down, after a step's uploads with nothing read back.
/// A page never exits this way, and cannot block on the device.
#[cfg(not(target_arch = "wasm32"))]
impl Drop for Engine {
    fn drop(&mut self) {
        if self.lost.is_none() {
            // A driver fault here has nobody left to report to.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.device.device.sync()
            }));
        }
    }
}
