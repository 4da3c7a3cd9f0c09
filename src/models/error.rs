//! Why a model could not be read or run, whatever its family.

use std::path::PathBuf;

use crate::models::checkpoint::CheckpointError;
use crate::ops::lora::LoraOpError;

/// Errors reading `config.json`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not the config of a supported model.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Errors loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `config.json` is unreadable or unsupported.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The weights are unreadable, missing or mis-shaped.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The LoRA op refused its inputs.
    #[error(transparent)]
    Lora(#[from] LoraOpError),
    /// The pixel values do not match the grids.
    #[error("{0}")]
    Input(String),
}
