//! What the engine takes and gives: its options, requests and their images, outputs.

use std::path::PathBuf;
use std::time::Duration;

use image::RgbImage;

use crate::ops::kernels::KernelPins;
use crate::preprocess::{ImageBackend, Patches};
use crate::runtime::device::Precision;

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

impl HostTensor {
    /// Rows `start..start + count`.
    pub(super) fn rows(&self, start: usize, count: usize) -> HostTensor {
        let width = self.shape[1];
        HostTensor {
            shape: [count, width],
            values: self.values[start * width..(start + count) * width].to_vec(),
        }
    }

    /// The first value that is not finite, with its row.
    pub(super) fn first_not_finite(&self) -> Option<(usize, f32)> {
        let at = self.values.iter().position(|v| !v.is_finite())?;
        Some((at / self.shape[1], self.values[at]))
    }
}
