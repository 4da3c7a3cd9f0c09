//! Hugging Face safetensors checkpoints: one file or shards with `model.safetensors.index.json`
//! (the single file first, as transformers takes it).
//!
//! Files are memory-mapped and only the tensors asked for are converted, so the language
//! model's shards of a VLM checkpoint are never read. `f64`, `f32`, `f16` and `bf16` on disk
//! become `f32` tensors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::runtime::progress;
use crate::vfs::{self, Bytes};

/// Errors reading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file is not valid safetensors, or the index is malformed.
    #[error("{path} is not a valid checkpoint file: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The folder holds no `model.safetensors` nor an index.
    #[error("{dir} holds neither model.safetensors nor model.safetensors.index.json")]
    NoWeights {
        /// The folder.
        dir: PathBuf,
    },
    /// A tensor the model needs is missing.
    #[error("tensor `{key}` is missing from the checkpoint in {dir}")]
    Missing {
        /// The key (without the `visual.` / `model.visual.` choice).
        key: String,
        /// The folder.
        dir: PathBuf,
    },
    /// A tensor holds values the model cannot use.
    #[error("tensor `{key}` in {path}: {reason}")]
    Values {
        /// The key.
        key: String,
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A tensor has the wrong shape or dtype.
    #[error("tensor `{key}` in {path} is {found}, expected {expected}")]
    Mismatch {
        /// The key.
        key: String,
        /// The file.
        path: PathBuf,
        /// What it is.
        found: String,
        /// What the model needs.
        expected: String,
    },
}

#[derive(Deserialize)]
struct Index {
    weight_map: HashMap<String, String>,
}

/// An opened checkpoint folder.
pub struct Checkpoint {
    dir: PathBuf,
    /// Which file holds each key.
    locations: HashMap<String, PathBuf>,
    /// Files mapped so far.
    maps: HashMap<PathBuf, Bytes>,
    /// Tensors read so far, of how many are expected ([`Self::report_progress`]; 0: none).
    reads: (u64, u64),
}

impl Checkpoint {
    /// Opens `dir`: reads the single file's header or, where there is none, the index of the
    /// shards (transformers' order, for a folder holding both), and maps nothing else yet.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut checkpoint = Self {
            dir: dir.to_owned(),
            locations: HashMap::new(),
            maps: HashMap::new(),
            reads: (0, 0),
        };
        if vfs::exists(&single) {
            let keys: Vec<String> = checkpoint
                .map(&single)?
                .names()
                .into_iter()
                .map(str::to_owned)
                .collect();
            for key in keys {
                checkpoint.locations.insert(key, single.clone());
            }
        } else if vfs::exists(&index_path) {
            let text = vfs::read_to_string(&index_path).map_err(|source| CheckpointError::Io {
                path: index_path.clone(),
                source,
            })?;
            let index: Index =
                serde_json::from_str(&text).map_err(|e| CheckpointError::Format {
                    path: index_path.clone(),
                    reason: e.to_string(),
                })?;
            for (key, file) in index.weight_map {
                checkpoint.locations.insert(key, dir.join(file));
            }
        } else {
            return Err(CheckpointError::NoWeights {
                dir: dir.to_owned(),
            });
        }
        Ok(checkpoint)
    }

    /// Reports the progress of the next `tensors` reads ([`progress`]).
    pub fn report_progress(&mut self, tensors: u64) {
        self.reads = (0, tensors);
    }

    /// Whether any key of the checkpoint starts with `prefix`.
    pub fn has_prefix(&self, prefix: &str) -> bool {
        self.locations.keys().any(|key| key.starts_with(prefix))
    }

    fn map(&mut self, path: &Path) -> Result<SafeTensors<'_>, CheckpointError> {
        if !self.maps.contains_key(path) {
            let io_error = |source| CheckpointError::Io {
                path: path.to_owned(),
                source,
            };
            let map = vfs::map(path).map_err(io_error)?;
            self.maps.insert(path.to_owned(), map);
        }
        let bytes = &self.maps[path];
        SafeTensors::deserialize(bytes).map_err(|e| CheckpointError::Format {
            path: path.to_owned(),
            reason: safetensors_failure(bytes, e),
        })
    }

    /// Reads tensor `key` with shape `shape` as f32 on `device`.
    pub fn tensor<const D: usize>(
        &mut self,
        key: &str,
        shape: [usize; D],
        device: &Device,
    ) -> Result<Tensor<D>, CheckpointError> {
        let path = self
            .locations
            .get(key)
            .cloned()
            .ok_or_else(|| CheckpointError::Missing {
                key: key.to_owned(),
                dir: self.dir.clone(),
            })?;
        let file = self.map(&path)?;
        let view = file.tensor(key).map_err(|e| CheckpointError::Format {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let mismatch = |found: String| CheckpointError::Mismatch {
            key: key.to_owned(),
            path: path.clone(),
            found,
            expected: format!("f64/f32/f16/bf16 {shape:?}"),
        };
        if view.shape() != shape {
            return Err(mismatch(format!("{:?} {:?}", view.dtype(), view.shape())));
        }
        if !matches!(
            view.dtype(),
            Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16
        ) {
            return Err(mismatch(format!("{:?} {:?}", view.dtype(), view.shape())));
        }
        let values = float_values(&view).map_err(|reason| CheckpointError::Values {
            key: key.to_owned(),
            path: path.clone(),
            reason,
        })?;
        let (read, expected) = &mut self.reads;
        if *read < *expected {
            *read += 1;
            progress::report("loading tensors", *read, *expected);
        }
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }
}

/// Why `bytes` that failed to parse as safetensors did: a Git LFS pointer (a repository
/// cloned without fetching its large files) is named as one, anything else by `error`.
pub fn safetensors_failure(bytes: &[u8], error: impl std::fmt::Display) -> String {
    if bytes.starts_with(b"version https://git-lfs") {
        "a Git LFS pointer, not the weights: fetch them (`git lfs pull`)".to_owned()
    } else {
        error.to_string()
    }
}

/// A float tensor's values as f32 (f64 rounded, f32, f16 and bf16 widened); non-finite values
/// (an f64 beyond f32's range among them) and other dtypes are refused, with the reason.
pub fn float_values(view: &safetensors::tensor::TensorView<'_>) -> Result<Vec<f32>, String> {
    let bytes = view.data();
    let values: Vec<f32> = match view.dtype() {
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("chunks of 8")) as f32)
            .collect(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => return Err(format!("dtype {other:?} {:?}", view.shape())),
    };
    match values.iter().position(|v| !v.is_finite()) {
        Some(bad) => Err(format!("non-finite value at element {bad}")),
        None => Ok(values),
    }
}
