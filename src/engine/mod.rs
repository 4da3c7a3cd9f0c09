//! The engine: requests (an image and an optional adapter each) in, per-request embeddings out.
//!
//! One [`Engine::encode`] call: preprocess every image → plan scheduler steps that fit the
//! `max_loras` GPU slots → per step: lay the requests out as scheduled encoder inputs, build the
//! TOWER and CONNECTOR mappings with [`crate::routing::mapping`], activate the step's adapters in
//! the slot table (restacking the model's LoRA weights only when the slots changed), turn the
//! mappings into kernel metadata, run tower and connector once over the step, split per request.

pub mod batch;
pub mod plan;
// Threads share an engine natively; a page has one thread, which awaits the device.
#[cfg(not(target_arch = "wasm32"))]
mod shared;

#[cfg(not(target_arch = "wasm32"))]
pub use shared::SharedEngine;

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::num::NonZeroUsize;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{Tensor, TensorData};
use futures_util::FutureExt;
use image::RgbImage;
// `std::time::Instant` panics on wasm32 (no clock there); this one reads the page's.
use web_time::Instant;

use crate::adapters::registry::{AdapterKey, AdapterRegistry};
use crate::adapters::{AdapterError, PeftAdapter, install};
use crate::models::{self, ModelError, PatchLayout, VisionOutput, VisionTower};
use crate::ops::kernels::{KernelError, KernelPins, Kernels};
use crate::ops::lora::{LoraBatch, MAX_RANK};
use crate::preprocess::{
    ImageBackend, Patches, PreprocessConfig, PreprocessError, decode_image, load_image, preprocess,
};
use crate::routing::mapping::{
    AdapterRequest, EncoderCache, LoraState, MappingError, MmFeature, MmLoraActivation, Modality,
    PlaceholderRange, SpatialMergeCounts, set_active_mm_loras,
};
use crate::routing::meta::{KernelMeta, MetaError, SlotTable};
use crate::runtime::device::{Precision, RuntimeDevice};
use crate::runtime::progress;
use plan::{PlanItem, plan_steps};

/// What errors call an image given as bytes ([`ImageSource::Encoded`]).
const ENCODED_IMAGE: &str = "(the request's image bytes)";

/// The most GPU slots an engine takes (`max_loras`).
pub const MAX_LORAS: usize = 1024;

/// The engine's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// GPU slots: the most distinct adapters one step mixes (at most [`MAX_LORAS`]). Calls with
    /// more run in more steps.
    pub max_loras: usize,
    /// The largest adapter rank accepted.
    pub max_rank: usize,
    /// How many adapters' weights stay in host memory (at least `max_loras`); others are read
    /// again from their folders when a request needs them.
    pub max_cpu_adapters: usize,
    /// The most tower rows (patches) one step runs; larger calls run in more steps.
    pub max_step_rows: usize,
    /// The float type the model computes in (f16 only on a GPU that has it).
    pub precision: Precision,
    /// Kernels pinned by name, for benchmarks and bug reports; none by default, each op's
    /// kernel then chosen for the device ([`crate::ops::kernels`]). The environment variable
    /// [`crate::ops::kernels::ENV`] pins the ops these leave unnamed.
    pub kernels: KernelPins,
    /// Whose resize and arithmetic the image processor reproduces: transformers 5's default
    /// (torchvision) unless a model was trained or is served with the PIL one.
    pub image_backend: ImageBackend,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_loras: 8,
            max_rank: 64,
            max_cpu_adapters: 32,
            max_step_rows: 16_384,
            precision: Precision::F32,
            kernels: KernelPins::default(),
            image_backend: ImageBackend::default(),
        }
    }
}

/// Where a request's image comes from.
#[derive(Debug, Clone)]
pub enum ImageSource {
    /// An image file (PNG, JPEG, WebP).
    File(PathBuf),
    /// An image file's bytes (an upload, say), decoded as the file would be.
    Encoded(Vec<u8>),
    /// A decoded RGB image.
    Decoded(RgbImage),
    /// Patches already preprocessed (as `mmlora preprocess` writes them).
    Patches(Patches),
}

/// One image to encode, with its adapter.
#[derive(Debug, Clone)]
pub struct Request {
    /// Unique within one `encode` call.
    pub id: String,
    /// The image.
    pub image: ImageSource,
    /// The name of a loaded adapter, or none for the base model.
    pub adapter: Option<String>,
}

/// A row-major f32 matrix in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// `[rows, columns]`.
    pub shape: [usize; 2],
    /// The values.
    pub values: Vec<f32>,
}

/// One request's result.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// The request's id.
    pub id: String,
    /// Its adapter.
    pub adapter: Option<String>,
    /// Its patch grid `(t, h, w)`.
    pub grid_thw: [usize; 3],
    /// The connector's output `[tower rows / merge², hidden_size]`: what the language model gets.
    pub embeds: HostTensor,
    /// The tower's output `[tower rows, embed_dim]`, when asked for.
    pub tower: Option<HostTensor>,
    /// The deepstack mergers' outputs side by side, `[tower rows / merge², k · hidden_size]`,
    /// where the model has them (Qwen3-VL).
    pub deepstack: Option<HostTensor>,
    /// The scheduler step (0-based) the request ran in.
    pub step: usize,
    /// How long that step took: its adapters restacked into the GPU slots where they changed,
    /// upload, tower, connector, read-back.
    pub step_time: Duration,
}

/// Why the engine refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The options cannot work.
    #[error("invalid engine options: {0}")]
    Options(String),
    /// A pinned kernel cannot be read or does not run on the device.
    #[error(transparent)]
    Kernels(#[from] KernelError),
    /// The model folder's files disagree.
    #[error("{path}: {reason}")]
    Inconsistent {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The model could not be loaded or run.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The processor settings could not be read.
    #[error(transparent)]
    Preprocess(PreprocessError),
    /// An adapter could not be loaded.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// A request's image could not be read or processed.
    #[error("request `{request}`: {source}")]
    Image {
        /// The request id.
        request: String,
        /// Why.
        source: PreprocessError,
    },
    /// A request's ready-made patches do not fit the model.
    #[error("request `{request}`: {reason}")]
    Patches {
        /// The request id.
        request: String,
        /// Why.
        reason: String,
    },
    /// A request names an adapter that is not loaded.
    #[error(
        "request `{request}` names adapter `{adapter}`, which is not loaded (loaded: {loaded})"
    )]
    UnknownAdapter {
        /// The request id.
        request: String,
        /// The adapter name.
        adapter: String,
        /// The loaded names.
        loaded: String,
    },
    /// One image has more patches than a step can hold on this device.
    #[error(
        "request `{request}`: the image has {rows} patches, more than the {limit} one step can hold within this device's buffer limit; use a smaller image or max_pixels"
    )]
    TooLarge {
        /// The request id.
        request: String,
        /// Its patches.
        rows: usize,
        /// The most rows per step.
        limit: usize,
    },
    /// A model weight is beyond f16's range: cast, it would be infinite, and so would every
    /// output.
    #[error(
        "model tensor `{tensor}` holds magnitudes up to {largest:e}, beyond f16's largest ({}); run this model in f32",
        half::f16::MAX
    )]
    WeightBeyondF16 {
        /// The checkpoint name (without the `visual.` / `model.visual.` choice).
        tensor: String,
        /// Its largest magnitude.
        largest: f32,
    },
    /// A request's output is not finite: the model overflowed the precision it computes in.
    #[error(
        "request `{request}`: its {output} hold {value} (row {row}): the model overflowed {}{}",
        precision,
        if *precision == Precision::F16 { "; run it in f32" } else { "" }
    )]
    NotFinite {
        /// The request id.
        request: String,
        /// `tower outputs` or `embeddings`.
        output: &'static str,
        /// The first value that is not finite.
        value: f32,
        /// Its row in the request's output.
        row: usize,
        /// What the model computed in.
        precision: Precision,
    },
    /// Two requests share an id.
    #[error("request id `{0}` appears more than once")]
    DuplicateRequest(String),
    /// `unload_adapter` named an adapter that is not loaded.
    #[error("no adapter named `{0}` is loaded")]
    NotLoaded(String),
    /// The mapping builder refused the step (a bug if it happens).
    #[error(transparent)]
    Mapping(#[from] MappingError),
    /// The slot table refused the step (a bug if it happens).
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// A thread panicked while holding a [`SharedEngine`]'s lock: its state is unknown.
    #[error("a panic in another thread poisoned the engine; rebuild it (SharedEngine::rebuild)")]
    Poisoned,
    /// The device could not run a step (e.g. a buffer over its limits); the engine still works.
    #[error("the device could not run the step: {0}")]
    Execution(String),
    /// The device was lost: this engine cannot run again; rebuild it on a new device.
    #[error("the device was lost ({0}); rebuild the engine on a new device (Engine::rebuild)")]
    DeviceLost(String),
}

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

    /// Loads the PEFT folder `dir` as `name`, replacing any adapter of that name. The adapter is
    /// fully validated first: on error the engine is unchanged.
    pub fn load_adapter(
        &mut self,
        name: &str,
        dir: &Path,
    ) -> Result<Arc<PeftAdapter>, EngineError> {
        let key = self.read_adapter(name, dir)?;
        Ok(self.loaded(key))
    }

    /// Registers an adapter built in memory under its name, after checking it against the model.
    /// Should its weights be evicted from memory, they are read again from `adapter.dir`.
    pub fn insert_adapter(
        &mut self,
        adapter: PeftAdapter,
    ) -> Result<Arc<PeftAdapter>, EngineError> {
        adapter.check(&self.model.lora_targets(), self.options.max_rank)?;
        self.register(adapter)
    }

    /// Registers an adapter already validated against this model's targets, once its weights
    /// fit the engine's precision; returns its key.
    fn admit(&mut self, adapter: PeftAdapter) -> Result<AdapterKey, EngineError> {
        if self.options.precision == Precision::F16 {
            adapter.check_fits_f16()?;
        }
        Ok(self.registry.insert(adapter))
    }

    /// [`Self::admit`], returning the weights (marked most recently used).
    fn register(&mut self, adapter: PeftAdapter) -> Result<Arc<PeftAdapter>, EngineError> {
        let key = self.admit(adapter)?;
        Ok(self.loaded(key))
    }

    /// The weights of an adapter just registered (so in memory), marked most recently used.
    fn loaded(&mut self, key: AdapterKey) -> Arc<PeftAdapter> {
        self.registry
            .touch(key)
            .expect("an adapter just registered is in memory")
    }

    /// Reads, validates and registers an adapter; returns the key of its content.
    fn read_adapter(&mut self, name: &str, dir: &Path) -> Result<AdapterKey, EngineError> {
        let targets = self.model.lora_targets();
        let adapter = PeftAdapter::load(name, dir, &targets, self.options.max_rank)?;
        let key = self.admit(adapter)?;
        tracing::info!(adapter = name, dir = %dir.display(), "adapter loaded");
        Ok(key)
    }

    /// Forgets the adapter `name`.
    pub fn unload_adapter(&mut self, name: &str) -> Result<(), EngineError> {
        if self.registry.remove(name) {
            Ok(())
        } else {
            Err(EngineError::NotLoaded(name.to_owned()))
        }
    }

    /// The adapter in each GPU slot (by name; `None` for an empty slot or one whose adapter
    /// was unloaded or loaded again since), as the last step left them: a step that needs room
    /// frees the slots whose weights left memory first, then those used least recently.
    pub fn slotted(&self) -> Vec<Option<String>> {
        (0..self.slots.num_slots())
            .map(|slot| {
                let key = self.slots.adapter_in(slot)?;
                self.registry
                    .names()
                    .find(|&name| {
                        self.registry
                            .registration(name)
                            .is_some_and(|r| r.key == key)
                    })
                    .map(str::to_owned)
            })
            .collect()
    }

    /// The names of the loaded adapters, sorted.
    pub fn adapter_names(&self) -> Vec<String> {
        self.registry.names().map(str::to_owned).collect()
    }

    /// Encodes `requests`, each with its own adapter, in as few steps as the limits allow, and
    /// returns one result per request in the same order. Everything is checked (ids, adapter
    /// names, images) before anything runs; with `with_tower` the tower's output comes back too.
    /// An adapter whose weights were evicted from memory (`max_cpu_adapters`) is read back from
    /// its folder at the step that needs it, and a folder that fails then fails the call, as
    /// does an output that is not finite ([`EngineError::NotFinite`]).
    ///
    /// Waits for the device: [`Engine::encode_async`] is the same call for code that must not
    /// block (a browser's).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn encode(
        &mut self,
        requests: &[Request],
        with_tower: bool,
    ) -> Result<Vec<Encoded>, EngineError> {
        pollster::block_on(self.encode_async(requests, with_tower))
    }

    /// [`Engine::encode`], awaiting the device's results instead of waiting for them.
    pub async fn encode_async(
        &mut self,
        requests: &[Request],
        with_tower: bool,
    ) -> Result<Vec<Encoded>, EngineError> {
        check_ids(requests)?;
        self.check_adapters(requests)?;
        let patches = requests
            .iter()
            .map(|request| {
                request_patches(
                    request,
                    &self.preprocess,
                    self.options.image_backend,
                    self.model.layout(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.encode_patches(requests, &patches, with_tower).await
    }

    /// The most tower rows one step runs: `max_step_rows`, or fewer where the device's buffer
    /// limit allows fewer.
    pub fn step_rows(&self) -> usize {
        self.options.max_step_rows.min(self.model.max_rows())
    }

    /// Refuses requests that name adapters which are not loaded.
    fn check_adapters(&self, requests: &[Request]) -> Result<(), EngineError> {
        for request in requests {
            if let Some(adapter) = &request.adapter
                && self.registry.registration(adapter).is_none()
            {
                return Err(EngineError::UnknownAdapter {
                    request: request.id.clone(),
                    adapter: adapter.clone(),
                    loaded: self.adapter_names().join(", "),
                });
            }
        }
        Ok(())
    }

    /// Plans and runs the steps of requests whose patches are ready and checked.
    async fn encode_patches(
        &mut self,
        requests: &[Request],
        patches: &[Patches],
        with_tower: bool,
    ) -> Result<Vec<Encoded>, EngineError> {
        if let Some(reason) = &self.lost {
            return Err(EngineError::DeviceLost(reason.clone()));
        }
        let step_rows = self.step_rows();
        if let Some((request, patches)) = requests
            .iter()
            .zip(patches)
            .find(|(_, p)| p.rows() > step_rows)
        {
            return Err(EngineError::TooLarge {
                request: request.id.clone(),
                rows: patches.rows(),
                limit: step_rows,
            });
        }
        let mut tags: Vec<&str> = Vec::new();
        let items: Vec<PlanItem> = requests
            .iter()
            .zip(patches)
            .map(|(request, patches)| PlanItem {
                adapter: request.adapter.as_deref().map(|name| {
                    tags.iter().position(|&t| t == name).unwrap_or_else(|| {
                        tags.push(name);
                        tags.len() - 1
                    })
                }),
                rows: patches.rows(),
            })
            .collect();
        let steps = plan_steps(&items, self.options.max_loras, step_rows);

        let mut results: Vec<Option<Encoded>> = vec![None; requests.len()];
        for (step, members) in steps.iter().enumerate() {
            let outputs = self
                .run_step(step, members, requests, patches, with_tower)
                .await?;
            for (&i, output) in members.iter().zip(outputs) {
                results[i] = Some(output);
            }
            if steps.len() > 1 {
                progress::report("encoding steps", step as u64 + 1, steps.len() as u64);
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every request is planned in exactly one step"))
            .collect())
    }

    /// One scheduler step over `requests[members]`: the step's mappings, the forward pass on its
    /// adapters' slots, the outputs split per request.
    async fn run_step(
        &mut self,
        step: usize,
        members: &[usize],
        requests: &[Request],
        patches: &[Patches],
        with_tower: bool,
    ) -> Result<Vec<Encoded>, EngineError> {
        let activation = self.schedule(members, requests, patches)?;
        let started = Instant::now();
        let grids: Vec<[usize; 3]> = members.iter().map(|&i| patches[i].grid_thw).collect();
        let pixels: Vec<f32> = members
            .iter()
            .flat_map(|&i| patches[i].pixel_values.iter().copied())
            .collect();
        let rows = pixels.len() / self.model.layout().patch_len();
        let outputs = self
            .run_keeping_slots(&activation, pixels, &grids, with_tower)
            .await?;
        let step_time = started.elapsed();
        tracing::debug!(
            step,
            requests = members.len(),
            adapters = activation.adapters.len(),
            rows,
            ms = step_time.as_secs_f64() * 1e3,
            "step encoded"
        );
        let outputs = StepOutputs {
            step,
            step_time,
            outputs,
        };
        self.split(outputs, members, requests, patches)
    }

    /// The step as vLLM's scheduler hands it to the model runner (one image item per request),
    /// through the mapping builder: the step's adapters and each row's adapter id.
    fn schedule(
        &mut self,
        members: &[usize],
        requests: &[Request],
        patches: &[Patches],
    ) -> Result<MmLoraActivation, EngineError> {
        let keys = self.step_adapters(
            members
                .iter()
                .filter_map(|&i| requests[i].adapter.as_deref()),
        )?;
        let merge = self.model.layout().spatial_merge_size;
        let mut cache = EncoderCache::default();
        let mut state = LoraState::new(members.len());
        let mut batch_index = HashMap::new();
        let mut scheduled = Vec::with_capacity(members.len());
        for (index, &i) in members.iter().enumerate() {
            let request = &requests[i];
            cache.mm_features.insert(
                request.id.clone(),
                vec![MmFeature {
                    identifier: request.id.clone(),
                    modality: Modality::Image,
                    position: PlaceholderRange::new(0, patches[i].rows() / (merge * merge)),
                    has_data: true,
                }],
            );
            let adapter = request.adapter.as_ref().map(|name| AdapterRequest {
                name: name.clone(),
                id: keys[name],
                path: self
                    .registry
                    .registration(name)
                    .map(|r| r.dir.clone())
                    .unwrap_or_default(),
            });
            state.add_request(&request.id, index, adapter)?;
            batch_index.insert(request.id.clone(), index);
            scheduled.push((request.id.clone(), vec![0]));
        }
        let activation = set_active_mm_loras(
            &SpatialMergeCounts {
                merge: NonZeroUsize::new(merge).expect("the config refuses a merge size of 0"),
            },
            &cache,
            &batch_index,
            &state,
            &scheduled,
        )?;
        Ok(activation.expect("a step schedules at least one image"))
    }

    /// [`Self::run_on_slots`], except that a step that fails gives its slots back as they were,
    /// so that the next call does not stack this step's adapters again (and fail the same way).
    async fn run_keeping_slots(
        &mut self,
        activation: &MmLoraActivation,
        pixels: Vec<f32>,
        grids: &[[usize; 3]],
        with_tower: bool,
    ) -> Result<HostOutputs, EngineError> {
        let before = (
            self.slots.clone(),
            self.slot_used.clone(),
            self.stacked.clone(),
        );
        let ran = self
            .run_on_slots(activation, pixels, grids, with_tower)
            .await;
        if ran.is_err() {
            let (slots, slot_used, stacked) = before;
            if self.stacked != stacked {
                self.stacked = None; // the model holds this step's stacks, or half of them
            }
            (self.slots, self.slot_used) = (slots, slot_used);
        }
        ran
    }

    /// The step's rows split per request; an output that is not finite fails the step, naming
    /// the request.
    fn split(
        &self,
        outputs: StepOutputs,
        members: &[usize],
        requests: &[Request],
        patches: &[Patches],
    ) -> Result<Vec<Encoded>, EngineError> {
        let merge = self.model.layout().spatial_merge_size;
        let StepOutputs {
            step,
            step_time,
            outputs:
                HostOutputs {
                    embeds,
                    tower,
                    deepstack,
                },
        } = outputs;
        let mut start = 0;
        members
            .iter()
            .map(|&i| {
                let rows = patches[i].rows();
                let tower = tower.as_ref().map(|t| t.rows(start, rows));
                let merged = (start / (merge * merge), rows / (merge * merge));
                let embeds = embeds.rows(merged.0, merged.1);
                let deepstack = deepstack.as_ref().map(|d| d.rows(merged.0, merged.1));
                start += rows;
                let request = &requests[i].id;
                for (output, values) in [
                    ("embeddings", Some(&embeds)),
                    ("tower outputs", tower.as_ref()),
                    ("deepstack outputs", deepstack.as_ref()),
                ] {
                    if let Some((row, value)) = values.and_then(HostTensor::first_not_finite) {
                        return Err(EngineError::NotFinite {
                            request: request.clone(),
                            output,
                            value,
                            row,
                            precision: self.options.precision,
                        });
                    }
                }
                Ok(Encoded {
                    id: request.clone(),
                    adapter: requests[i].adapter.clone(),
                    grid_thw: patches[i].grid_thw,
                    embeds,
                    tower,
                    deepstack,
                    step,
                    step_time,
                })
            })
            .collect()
    }

    /// Puts the step's adapters in GPU slots, runs it ([`Self::launch_step`]) and reads its
    /// outputs back.
    async fn run_on_slots(
        &mut self,
        activation: &MmLoraActivation,
        pixels: Vec<f32>,
        grids: &[[usize; 3]],
        with_tower: bool,
    ) -> Result<HostOutputs, EngineError> {
        let activated =
            self.activate(&activation.adapters.iter().map(|a| a.id).collect::<Vec<_>>());
        self.classify(activated)?;
        let tower_meta = KernelMeta::from_mapping(&activation.tower, &self.slots)?;
        let connector_meta = KernelMeta::from_mapping(
            activation
                .connector
                .as_ref()
                .expect("the spatial merger is a connector"),
            &self.slots,
        )?;
        let launched = guarded(|| self.launch_step(pixels, grids, tower_meta, connector_meta));
        let outcome = match launched {
            Ok(output) => guarded_async(read_outputs(output, with_tower)).await,
            Err(error) => Err(error),
        };
        self.classify(outcome)
    }

    /// Uploads a step's patches and runs tower and connector; the outputs stay on the device.
    fn launch_step(
        &self,
        pixels: Vec<f32>,
        grids: &[[usize; 3]],
        tower_meta: KernelMeta,
        connector_meta: KernelMeta,
    ) -> Result<VisionOutput, EngineError> {
        let on = &self.device.device;
        let rows = pixels.len() / self.model.layout().patch_len();
        let pixels = Tensor::<2>::from_data(
            TensorData::new(pixels, [rows, self.model.layout().patch_len()]),
            on,
        );
        Ok(self.model.forward(
            pixels,
            grids,
            &LoraBatch::with_kernels(tower_meta, &self.device, self.model.kernels().lora),
            &LoraBatch::with_kernels(connector_meta, &self.device, self.model.kernels().lora),
        )?)
    }

    /// A step's device work's result, with an [`EngineError::Execution`] classified by
    /// [`Engine::device_failure`].
    fn classify<T>(&mut self, result: Result<T, EngineError>) -> Result<T, EngineError> {
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

    /// Makes sure the named adapters' weights are in memory (reading evicted ones again from
    /// their folders) and returns each one's key.
    fn step_adapters<'a>(
        &mut self,
        names: impl Iterator<Item = &'a str>,
    ) -> Result<HashMap<String, AdapterKey>, EngineError> {
        let mut keys = HashMap::new();
        let mut evicted = Vec::new();
        // Touch the adapters in memory first, so reading the others back evicts none of them.
        for name in names {
            if keys.contains_key(name) || evicted.contains(&name) {
                continue;
            }
            let key = self
                .registry
                .registration(name)
                .expect("encode checked every adapter name")
                .key;
            match self.registry.touch(key) {
                Some(_) => {
                    keys.insert(name.to_owned(), key);
                }
                None => evicted.push(name),
            }
        }
        for name in evicted {
            let dir = self
                .registry
                .registration(name)
                .expect("encode checked every adapter name")
                .dir
                .clone();
            tracing::info!(
                adapter = name,
                "reading back an adapter evicted from memory"
            );
            let key = self.read_adapter(name, &dir)?;
            keys.insert(name.to_owned(), key);
        }
        Ok(keys)
    }

    /// The adapter key in each GPU slot.
    fn slot_contents(&self) -> Vec<Option<AdapterKey>> {
        (0..self.slots.num_slots())
            .map(|s| self.slots.adapter_in(s))
            .collect()
    }

    /// Puts `wanted` in GPU slots, freeing slots of adapters this step does not use only as
    /// needed, and restacks the model's LoRA weights when the slots changed. A fault while
    /// uploading them is an [`EngineError::Execution`], after which the next step restacks.
    ///
    /// A slot whose weights left memory (unloaded, reloaded or evicted) holds a key no request
    /// asks for again (reading weights back gives a new one), so it is freed first when room
    /// is needed, and when the slots are restacked anyway (its weights cannot be), but not
    /// before: freeing it alone would restack every slot for nothing.
    fn activate(&mut self, wanted: &[AdapterKey]) -> Result<(), EngineError> {
        let n = self.slots.num_slots();
        let missing = wanted
            .iter()
            .filter(|&&id| self.slots.slot_of(id).is_none())
            .count();
        let free = (0..n)
            .filter(|&s| self.slots.adapter_in(s).is_none())
            .count();
        // The slots this step does not use: those whose weights left memory first, then the
        // least recently used.
        let mut idle: Vec<(bool, u64, AdapterKey)> = (0..n)
            .filter_map(|s| self.slots.adapter_in(s).map(|id| (s, id)))
            .filter(|(_, id)| !wanted.contains(id))
            .map(|(s, id)| (self.registry.get(id).is_some(), self.slot_used[s], id))
            .collect();
        idle.sort_by_key(|&(in_memory, used, _)| (in_memory, used));
        for (_, _, id) in idle.into_iter().take(missing.saturating_sub(free)) {
            self.slots.deactivate(id);
        }
        self.activations += 1;
        for &id in wanted {
            let slot = self.slots.activate(id)?;
            self.slot_used[slot] = self.activations;
        }
        let current = self.slot_contents();
        if self.stacked.as_ref() != Some(&current) {
            for &id in current.iter().flatten() {
                if self.registry.get(id).is_none() {
                    self.slots.deactivate(id);
                }
            }
            let current = self.slot_contents();
            let adapters: Vec<Option<Arc<PeftAdapter>>> = current
                .iter()
                .map(|id| id.and_then(|id| self.registry.get(id).cloned()))
                .collect();
            // Stacks as deep as the last slot taken: slots fill from the first, so a few
            // adapters in many slots stack a few (the op checks each row's slot against it).
            let taken = adapters
                .iter()
                .rposition(Option::is_some)
                .map_or(0, |s| s + 1);
            let slotted: Vec<Option<&PeftAdapter>> =
                adapters[..taken].iter().map(|a| a.as_deref()).collect();
            self.stacked = None;
            guarded(|| {
                install(self.model.as_mut(), &slotted, &self.device.device);
                Ok(())
            })?;
            tracing::debug!(slots = ?current, "adapters restacked");
            self.stacked = Some(current);
        }
        Ok(())
    }
}

impl HostTensor {
    /// Rows `start..start + count`.
    fn rows(&self, start: usize, count: usize) -> HostTensor {
        let width = self.shape[1];
        HostTensor {
            shape: [count, width],
            values: self.values[start * width..(start + count) * width].to_vec(),
        }
    }

    /// The first value that is not finite, with its row.
    fn first_not_finite(&self) -> Option<(usize, f32)> {
        let at = self.values.iter().position(|v| !v.is_finite())?;
        Some((at / self.shape[1], self.values[at]))
    }
}

/// Refuses a batch in which two requests share an id.
fn check_ids(requests: &[Request]) -> Result<(), EngineError> {
    let mut ids = HashSet::new();
    match requests.iter().find(|r| !ids.insert(r.id.as_str())) {
        Some(request) => Err(EngineError::DuplicateRequest(request.id.clone())),
        None => Ok(()),
    }
}

/// The request's patches (decoded and preprocessed, or as given), checked against the model.
fn request_patches(
    request: &Request,
    preprocess_config: &PreprocessConfig,
    backend: ImageBackend,
    layout: PatchLayout,
) -> Result<Patches, EngineError> {
    let image_error = |source| EngineError::Image {
        request: request.id.clone(),
        source,
    };
    // A file's image, or its bytes', with what errors call it.
    let file = |decoded: Result<RgbImage, PreprocessError>, name: &Path| {
        preprocess(&decoded.map_err(image_error)?, preprocess_config, backend)
            .map_err(|e| image_error(e.in_file(name)))
    };
    let patches = match &request.image {
        ImageSource::File(path) => file(load_image(path), path)?,
        ImageSource::Encoded(bytes) => {
            let name = Path::new(ENCODED_IMAGE);
            file(decode_image(bytes, name), name)?
        }
        ImageSource::Decoded(image) => {
            preprocess(image, preprocess_config, backend).map_err(image_error)?
        }
        ImageSource::Patches(patches) => patches.clone(),
    };
    let [t, h, w] = patches.grid_thw;
    let m = layout.spatial_merge_size;
    let reason = if t == 0 || h == 0 || w == 0 || h % m != 0 || w % m != 0 {
        Some(format!(
            "grid {:?} is empty or not a multiple of the merge size {m}",
            patches.grid_thw
        ))
    } else if patches.pixel_values.len() != patches.rows().saturating_mul(layout.patch_len()) {
        Some(format!(
            "{} pixel values do not make {} rows of {}",
            patches.pixel_values.len(),
            patches.rows(),
            layout.patch_len()
        ))
    } else {
        None
    };
    match reason {
        Some(reason) => Err(EngineError::Patches {
            request: request.id.clone(),
            reason,
        }),
        None => Ok(patches),
    }
}

/// Refuses a model with a weight f16 cannot hold (one read-back of every weight's largest
/// magnitude).
#[cfg(not(target_arch = "wasm32"))]
fn check_fits_f16(model: &dyn VisionTower) -> Result<(), EngineError> {
    let (names, largest) = model.cast_magnitudes();
    let largest = largest
        .try_into_vec_as::<f32>()
        .map_err(|e| EngineError::Execution(e.to_string()))?;
    let limit = f32::from(half::f16::MAX);
    match largest.iter().position(|&v| v > limit) {
        Some(at) => Err(EngineError::WeightBeyondF16 {
            tensor: names[at].clone(),
            largest: largest[at],
        }),
        None => Ok(()),
    }
}

/// A page cannot wait for the read-back that checks the weights fit f16, and the engine is
/// opened synchronously: f16 is refused there.
#[cfg(target_arch = "wasm32")]
fn check_fits_f16(_: &dyn VisionTower) -> Result<(), EngineError> {
    Err(EngineError::Options(
        "f16 is not offered in a browser: the check that every weight fits f16 reads them back, \
         which a page cannot wait for"
            .to_owned(),
    ))
}

/// Reads a step's outputs into host memory (the tower's only `with_tower`).
async fn read_outputs(output: VisionOutput, with_tower: bool) -> Result<HostOutputs, EngineError> {
    Ok(HostOutputs {
        embeds: read_back(output.embeds).await?,
        tower: match with_tower {
            true => Some(read_back(output.tower).await?),
            false => None,
        },
        deepstack: match output.deepstack {
            Some(deepstack) => Some(read_back(deepstack).await?),
            None => None,
        },
    })
}

/// Reads a device tensor into host memory once the device has computed it.
async fn read_back(tensor: Tensor<2>) -> Result<HostTensor, EngineError> {
    let shape = tensor.dims();
    let execution = |e: &dyn std::fmt::Display| EngineError::Execution(e.to_string());
    let values = tensor
        .into_data_async()
        .await
        .map_err(|e| execution(&e))?
        .try_into_vec_as::<f32>()
        .map_err(|e| execution(&e))?;
    Ok(HostTensor { shape, values })
}

/// A forward pass's outputs in host memory.
struct HostOutputs {
    embeds: HostTensor,
    tower: Option<HostTensor>,
    deepstack: Option<HostTensor>,
}

/// What one step's forward pass gave, before it is split per request.
struct StepOutputs {
    step: usize,
    step_time: Duration,
    outputs: HostOutputs,
}

/// Runs device work; a fault inside Burn or the driver may surface as a panic, and becomes an
/// [`EngineError::Execution`] too.
fn guarded<T>(work: impl FnOnce() -> Result<T, EngineError>) -> Result<T, EngineError> {
    catch_unwind(AssertUnwindSafe(work))
        .unwrap_or_else(|panic| Err(EngineError::Execution(panic_message(&panic))))
}

/// [`guarded`] for device work that is awaited.
async fn guarded_async<T>(
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

/// Refuses `max_loras` and `max_rank` whose stacked LoRA weights for some layer (A or B of every
/// slot at the largest rank, `[max_loras, max_rank, in]` or `[max_loras, out, max_rank]`) would
/// not fit one buffer of the device: whatever adapters then fill the slots, their stacks bind.
/// vLLM likewise allocates `max_loras × max_lora_rank` at start.
fn check_stacks_fit(
    model: &dyn VisionTower,
    options: &EngineOptions,
    device: &RuntimeDevice,
) -> Result<(), EngineError> {
    let Some(limit) = device.buffer_limit else {
        return Ok(());
    };
    let value_bytes = options.precision.dtype().size() as u64;
    let stack = |width: usize| {
        (options.max_loras as u64) * (options.max_rank as u64) * (width as u64) * value_bytes
    };
    match model
        .lora_targets()
        .into_iter()
        .map(|t| (stack(t.in_features.max(t.out_features)), t.path))
        .find(|&(bytes, _)| bytes > limit)
    {
        Some((bytes, path)) => Err(EngineError::Options(format!(
            "max_loras {} × max_rank {} stack {:.1} MiB of LoRA weights for `{path}`, above the \
             {:.1} MiB {} binds in one buffer; lower max_loras or max_rank",
            options.max_loras,
            options.max_rank,
            bytes as f64 / f64::from(1 << 20),
            limit as f64 / f64::from(1 << 20),
            device.description
        ))),
        None => Ok(()),
    }
}

/// Whether the image processor's settings can run and cut patches the way the model reads
/// them.
fn check_consistent(
    preprocess: &PreprocessConfig,
    backend: ImageBackend,
    layout: PatchLayout,
) -> Result<(), String> {
    if let Some((key, reason)) = preprocess.unusable_on(backend) {
        return Err(format!("`{key}` {reason}"));
    }
    let fields = [
        ("patch_size", preprocess.patch_size, layout.patch_size),
        (
            "temporal_patch_size",
            preprocess.temporal_patch_size,
            layout.temporal_patch_size,
        ),
        (
            "merge_size",
            preprocess.merge_size,
            layout.spatial_merge_size,
        ),
    ];
    match fields
        .into_iter()
        .find(|(_, processor, model)| processor != model)
    {
        Some((field, processor, model)) => Err(format!(
            "{field} is {processor} but the model's config.json has {model}"
        )),
        None => Ok(()),
    }
}

fn check_options(options: &EngineOptions, device: &RuntimeDevice) -> Result<(), EngineError> {
    let problem = if !(1..=MAX_LORAS).contains(&options.max_loras) {
        Some(format!("max_loras must be in 1..={MAX_LORAS}"))
    } else if !(1..=MAX_RANK).contains(&options.max_rank) {
        Some(format!("max_rank must be in 1..={MAX_RANK}"))
    } else if options.max_cpu_adapters < options.max_loras {
        Some(format!(
            "max_cpu_adapters ({}) must be at least max_loras ({})",
            options.max_cpu_adapters, options.max_loras
        ))
    } else if options.max_step_rows == 0 {
        Some("max_step_rows must be at least 1".to_owned())
    } else if !device.supports(options.precision) {
        Some(format!(
            "{} needs a GPU whose adapter has SHADER_F16; {} does not offer it",
            options.precision, device.description
        ))
    } else {
        None
    };
    match problem {
        Some(problem) => Err(EngineError::Options(problem)),
        None => Ok(()),
    }
}
