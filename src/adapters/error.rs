//! Why an adapter cannot be used: each error names the adapter and the file or key.

use std::path::{Path, PathBuf};

/// Why an adapter cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// A file could not be read.
    #[error("adapter `{adapter}`: cannot read {path}: {source}")]
    Io {
        /// The adapter.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file is malformed.
    #[error("adapter `{adapter}`: {path} is malformed: {reason}")]
    Format {
        /// The adapter.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The adapter asks for something mmlora does not run.
    #[error("adapter `{adapter}`: {path}: {reason}")]
    Unsupported {
        /// The adapter.
        adapter: String,
        /// The file that asks for it.
        path: PathBuf,
        /// What and where.
        reason: String,
    },
    /// A key does not fit the model.
    #[error("adapter `{adapter}`: {path}, key `{key}`: {reason}")]
    Incompatible {
        /// The adapter.
        adapter: String,
        /// The file holding the key.
        path: PathBuf,
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },
}

/// The error for an unreadable file of adapter `name`.
pub(super) fn io_error<'a>(
    name: &'a str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> AdapterError + 'a {
    move |source| AdapterError::Io {
        adapter: name.to_owned(),
        path: path.to_owned(),
        source,
    }
}

/// The error for a malformed file of adapter `name`.
pub(super) fn format_error(name: &str, path: &Path, reason: String) -> AdapterError {
    AdapterError::Format {
        adapter: name.to_owned(),
        path: path.to_owned(),
        reason,
    }
}
