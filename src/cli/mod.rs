//! The `mmlora` subcommands. Each parses its files, calls the library, and prints; the logic a
//! library user would need lives in the library.

pub mod bench;
mod choice;
pub mod devices;
pub mod encode;
pub mod inspect;
mod output;
pub mod plot;
pub mod preprocess;
pub mod progress;

use std::path::PathBuf;

use plot::PlotError;

use mmlora::adapters::AdapterError;
use mmlora::bundled;
use mmlora::engine::EngineError;
use mmlora::engine::batch::BatchError;
use mmlora::models::ConfigError;
use mmlora::ops::kernels::KernelError;
use mmlora::preprocess::PreprocessError;
use mmlora::runtime::device::DeviceError;

/// The model folder a command runs on: `given`, or the bundled model.
pub fn model_dir(given: Option<PathBuf>) -> Result<bundled::ModelDir, CliError> {
    bundled::ModelDir::given_or_bundled(given).map_err(CliError::Unpack)
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The benchmark plot could not be drawn or written.
    #[error(transparent)]
    Plot(#[from] PlotError),
    /// The batch file could not be used.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// The bundled model could not be unpacked into a temporary folder.
    #[error("cannot unpack the bundled model into a temporary folder: {0}")]
    Unpack(std::io::Error),
    /// The arguments do not make a job.
    #[error("{0}")]
    Usage(String),
    /// The output file could not be written.
    #[error("cannot write {path}: {reason}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The adapter does not fit the model (`adapters inspect`).
    #[error("adapter {dir} is not compatible with the model in {model}: {source}")]
    Incompatible {
        /// The adapter folder.
        dir: PathBuf,
        /// The model folder (or the bundled model's name).
        model: String,
        /// Which file or key, and why.
        source: Box<AdapterError>,
    },
    /// No device.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Kernel pins that cannot be read.
    #[error(transparent)]
    Kernels(#[from] KernelError),
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// An adapter could not be read.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// The model's config could not be read.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An image could not be read or processed.
    #[error(transparent)]
    Preprocess(#[from] PreprocessError),
}
