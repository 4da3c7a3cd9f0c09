//! What the engine needs of a vision tower and its connector, whatever the family: the
//! [`VisionTower`] trait a family implements in its own folder, and the types it speaks in.

use std::fmt::Debug;

use burn::tensor::{DType, Tensor};

use crate::models::error::ModelError;
use crate::nn::LoraLinear;
use crate::ops::kernels::Kernels;
use crate::ops::lora::LoraBatch;
use crate::preprocess::PreprocessConfig;
use crate::runtime::stages::StageClock;

/// How a tower cuts images into patches and merges them into the connector's rows: what
/// preprocessing must match and what the engine plans steps with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatchLayout {
    /// Input channels.
    pub in_channels: usize,
    /// Patch side in pixels.
    pub patch_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Side of the block of patches the connector merges into one row.
    pub spatial_merge_size: usize,
}

impl PatchLayout {
    /// Values per patch row: channels × frames × side².
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Qwen2-VL's image processor settings, cutting these patches: for a tower without a
    /// folder (random weights of a [`crate::models::Preset`]'s shape).
    pub fn default_processor(self) -> PreprocessConfig {
        PreprocessConfig {
            patch_size: self.patch_size,
            temporal_patch_size: self.temporal_patch_size,
            merge_size: self.spatial_merge_size,
            ..PreprocessConfig::default()
        }
    }
}

/// A LoRA target linear: its module path (as in PEFT keys after the tower's prefix) and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraTarget {
    /// e.g. `blocks.3.attn.qkv` or `merger.mlp.0`.
    pub path: String,
    /// Input width.
    pub in_features: usize,
    /// Output width.
    pub out_features: usize,
    /// Whether the CONNECTOR mapping feeds it (else the TOWER mapping).
    pub connector: bool,
}

impl LoraTarget {
    /// The kind of layer at `path`, without the block index: `blocks.3.attn.qkv` → `attn.qkv`;
    /// merger paths stay whole (`merger.mlp.0`).
    pub fn kind(path: &str) -> &str {
        path.strip_prefix("blocks.")
            .and_then(|rest| rest.split_once('.'))
            .map_or(path, |(_, kind)| kind)
    }
}

/// The tower's and the connector's outputs for a batch.
#[derive(Debug, Clone)]
pub struct VisionOutput {
    /// `[tower rows, embed_dim]`: the last block's output.
    pub tower: Tensor<2>,
    /// `[tower rows / merge², hidden_size]`: the connector's output.
    pub embeds: Tensor<2>,
    /// `[tower rows / merge², k · hidden_size]`: the outputs of a tower's `k` deepstack
    /// mergers side by side, in their order (Qwen3-VL's; `None` where the tower has none).
    pub deepstack: Option<Tensor<2>>,
}

/// A vision tower and its connector, with a LoRA slot table on every target linear: what the
/// engine runs, whatever the family. Implemented by each family's model (`qwen2_vl`), which
/// reads as its architecture and calls ops by name.
pub trait VisionTower: Debug + Send + Sync {
    /// How it cuts and merges patches.
    fn layout(&self) -> PatchLayout;

    /// Every linear an adapter may target, in the order the weights are stacked.
    fn lora_targets(&self) -> Vec<LoraTarget>;

    /// The target linear at `path` (as [`Self::lora_targets`] lists it).
    fn target_mut(&mut self, path: &str) -> Option<&mut LoraLinear>;

    /// The most tower rows one forward call can hold within [`Self::buffer_limit`].
    fn max_rows(&self) -> usize;

    /// The largest buffer one operation may make, in bytes.
    fn buffer_limit(&self) -> u64;

    /// Makes no buffer over `bytes` (at least 1).
    fn set_buffer_limit(&mut self, bytes: u64);

    /// The checkpoint name of every tensor [`Self::cast`] casts and, beside them on the device,
    /// their largest magnitudes (one read-back checks them all).
    fn cast_magnitudes(&self) -> (Vec<String>, Tensor<1>);

    /// The model computing in `dtype` (`F32` or `F16`).
    fn cast(self: Box<Self>, dtype: DType) -> Box<dyn VisionTower>;

    /// The kernel each op runs with.
    fn kernels(&self) -> Kernels;

    /// Runs each op with the kernel `kernels` holds for it.
    fn set_kernels(&mut self, kernels: Kernels);

    /// Marks the end of each stage of the forward pass on `clock`.
    fn set_stage_clock(&mut self, clock: StageClock);

    /// Runs the tower and the connector over every image of the batch at once: `pixel_values`
    /// `[rows, patch_len]`, the images' patches one after the other; `grids` each image's
    /// `(t, h, w)`; `tower` and `connector` the LoRA metadata of the tower rows and of the
    /// merged rows.
    fn forward(
        &self,
        pixel_values: Tensor<2>,
        grids: &[[usize; 3]],
        tower: &LoraBatch,
        connector: &LoraBatch,
    ) -> Result<VisionOutput, ModelError>;

    /// For each block, the lengths of the segments of rows that attend among themselves for
    /// `grids` (what attention's cost follows).
    fn attention_segments(&self, grids: &[[usize; 3]]) -> Vec<Vec<usize>>;

    /// A copy (tensors are shared until written).
    fn boxed_clone(&self) -> Box<dyn VisionTower>;
}

impl Clone for Box<dyn VisionTower> {
    fn clone(&self) -> Self {
        self.boxed_clone()
    }
}
