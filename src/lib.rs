//! mmlora: the vision tower and connector of a vision-language model with many LoRA adapters in
//! one batch, on any GPU wgpu reaches and on the CPU.
//!
//! Open an [`Engine`] on a model folder (a Hugging Face checkpoint) and a device, load PEFT
//! adapter folders by name, and encode [`Request`]s: each names its image and the adapter it
//! runs with (or none), and requests with different adapters share one forward pass.
//!
//! ```
//! use std::path::Path;
//! use mmlora::{Engine, EngineOptions, ImageSource, Request, device};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-qwen2-vl");
//! let mut engine = Engine::open(&model, device::cpu(), EngineOptions::default())?;
//! engine.load_adapter("all-r4", &model.join("adapters/all-r4"))?;
//! let request = |id: &str, adapter: Option<&str>| Request {
//!     id: id.into(),
//!     image: ImageSource::File(model.join("images/square.png")),
//!     adapter: adapter.map(Into::into),
//! };
//! let results = engine.encode(&[request("tuned", Some("all-r4")), request("base", None)], false)?;
//! // One row of embeddings per merged patch, as wide as the language model's input.
//! assert_eq!(results[0].embeds.shape, results[1].embeds.shape);
//! assert_ne!(results[0].embeds.values, results[1].embeds.values);
//! # Ok(())
//! # }
//! ```
//!
//! The types a program needs are here at the root; the modules hold the rest: the mapping
//! builder ([`routing`]), the models and the LoRA op for those who embed them ([`models`],
//! [`ops`]), the image processor ([`preprocess`]). `bench` (feature `bench`, on with the default
//! `cli`) holds the measurements of `mmlora bench`; `bundled` (feature `bundled`) the tiny
//! Qwen2-VL model compiled in; `fuzzing` (feature `testkit`) the fuzz targets' entry points.
//! ARCHITECTURE.md in the repository is the map of the modules and their layers.

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
