//! mmlora: the vision tower and connector of a vision-language model with many LoRA adapters in
//! one batch, on any GPU wgpu reaches and on the CPU.
//!
//! The modules are layers, each importing only from the ones below it (`tests/layers.rs` checks
//! this, and that no modules form a cycle); ARCHITECTURE.md walks one batch through them:
//! - `named`: the one way the user's named choices are declared (a macro), beneath everything;
//!   [`vfs`]: the files loaders read, on disk or mounted from memory (a browser's files).
//! - [`runtime`]: the device, the one WGSL launch path, Flex memory helpers, timing.
//! - [`routing`]: which adapter each row belongs to ([`routing::mapping`], vLLM's
//!   `set_active_mm_loras`) and the rows grouped by adapter slot ([`routing::meta`]).
//! - [`preprocess`]: images to patches, as the model's image processor makes them.
//! - [`ops`]: one folder per op (linear, LoRA, attention, norm, rotary, activation), each with
//!   its backend extension, its fast paths and the composed reference beside them.
//! - `nn`: the layers models are written in (`nn::LoraLinear`).
//! - [`models`]: checkpoints and the vision towers built from those layers.
//! - [`adapters`]: PEFT adapters, checked against a model and installed in its slots.
//! - [`engine`]: requests in, embeddings out, one step at a time.
//! - `bench` (feature `bench`, on with the default `cli`): the measurements of `mmlora bench`
//!   and `benches/`; `bundled` (feature `bundled`, on with `cli`): the tiny Qwen2-VL model
//!   compiled in, the default of every front end; `fuzzing` (feature `testkit`): the fuzz
//!   targets' entry points, which the tests replay.

#![warn(missing_docs)]

pub mod adapters;
pub mod analysis;
#[cfg(feature = "bench")]
pub mod bench;
#[cfg(feature = "bundled")]
pub mod bundled;
pub mod engine;
pub mod files;
#[cfg(feature = "testkit")]
pub mod fuzzing;
pub mod models;
mod named;
pub(crate) mod nn;
pub mod ops;
pub mod preprocess;
pub mod routing;
pub mod runtime;
pub mod vfs;

// What a user of the library reaches for first: the engine, what it takes and gives, the
// choices it is opened with, and why each step can fail. The modules hold the rest.
pub use adapters::{AdapterError, PeftAdapter};
#[cfg(not(target_arch = "wasm32"))]
pub use engine::SharedEngine;
pub use engine::batch::{Batch, BatchError};
pub use engine::{
    Encoded, Engine, EngineError, EngineOptions, HostTensor, ImageSource, MAX_LORAS, Request,
};
pub use models::{ConfigError, ModelError, Preset};
pub use ops::kernels::{KernelError, KernelPins};
pub use preprocess::{ImageBackend, Patches, PreprocessConfig, PreprocessError};
pub use routing::mapping::{LoraMapping, LoraMappingKind};
pub use runtime::device::{self, DeviceChoice, DeviceError, Precision, RuntimeDevice};
