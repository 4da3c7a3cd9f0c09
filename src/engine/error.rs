//! Why the engine refused or failed: one error type for every engine call.

use std::path::PathBuf;

#[cfg(doc)]
use super::SharedEngine;
use crate::adapters::AdapterError;
use crate::models::ModelError;
use crate::ops::kernels::KernelError;
use crate::preprocess::PreprocessError;
use crate::routing::mapping::MappingError;
use crate::routing::meta::MetaError;
use crate::runtime::device::Precision;

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
