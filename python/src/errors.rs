//! The engine's errors as the exceptions of `mmlora.errors`, chosen by what went wrong so that
//! Python callers catch them as they expect (`FileNotFoundError`, `ValueError`, `KeyError`…),
//! each with the engine's message, which names the file, key or request.

use std::io;

use pyo3::prelude::*;
use pyo3::types::PyType;

use mmlora::PreprocessError;
use mmlora::engine::EngineError;

/// An exception to raise: the name of its class in `mmlora.errors` and its message. Made
/// without the GIL (inside a call that let go of it); raised once the call holds it again.
#[derive(Debug)]
pub struct Failure {
    class: &'static str,
    message: String,
}

/// A failure of class `class` (a name in `mmlora.errors`).
pub fn raise(class: &'static str, message: String) -> Failure {
    Failure { class, message }
}

/// The exception for `error`: a missing file whatever was being read, else by what failed.
pub fn engine_error(error: EngineError) -> Failure {
    let class = if missing_file(&error) {
        "MissingFileError"
    } else {
        match &error {
            EngineError::Options(_) | EngineError::Kernels(_) => "OptionsError",
            EngineError::Inconsistent { .. }
            | EngineError::Model(_)
            | EngineError::Preprocess(_) => "ModelError",
            EngineError::Adapter(_) => "AdapterError",
            EngineError::Image {
                source: PreprocessError::TooLarge { .. },
                ..
            }
            | EngineError::TooLarge { .. } => "ImageTooLargeError",
            EngineError::Image { .. } => "ImageError",
            EngineError::Patches { .. } | EngineError::DuplicateRequest(_) => "RequestError",
            EngineError::UnknownAdapter { .. } | EngineError::NotLoaded(_) => "UnknownAdapterError",
            EngineError::NotFinite { .. } | EngineError::WeightBeyondF16 { .. } => "NumericError",
            EngineError::Poisoned | EngineError::Execution(_) | EngineError::DeviceLost(_) => {
                "DeviceError"
            }
            EngineError::Mapping(_) | EngineError::Meta(_) => "Error",
        }
    };
    raise(class, error.to_string())
}

/// Whether a file or folder that `error` was reading does not exist.
fn missing_file(error: &EngineError) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = cause {
        if current
            .downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::NotFound)
        {
            return true;
        }
        cause = current.source();
    }
    false
}

impl From<Failure> for PyErr {
    fn from(failure: Failure) -> Self {
        Python::attach(|py| {
            match py
                .import("mmlora.errors")
                .and_then(|errors| errors.getattr(failure.class))
                .and_then(|class| Ok(class.cast_into::<PyType>()?))
            {
                Ok(class) => PyErr::from_type(class, failure.message),
                Err(err) => err,
            }
        })
    }
}
