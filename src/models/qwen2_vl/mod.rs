//! Qwen2-VL's vision tower and its PatchMerger connector, with a LoRA slot on every target
//! linear (`blocks.*.attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2`, `merger.mlp.0`,
//! `merger.mlp.2`). Numbers follow transformers' `Qwen2VisionTransformerPretrainedModel`.

pub mod config;

use std::path::Path;

use burn::tensor::{DType, Device, Tensor};

use crate::models::error::ModelError;
use crate::models::qwen_vision::weights::{
    CheckpointWeights, RandomWeights, WeightSource, layer_norm, linear,
};
use crate::models::qwen_vision::{
    LayerNorm, Pass, attention_pieces, cast_magnitudes, check_inputs, frames, max_rows,
    merger_named, named, rotary,
};
use crate::models::tower::{LoraTarget, PatchLayout, VisionOutput, VisionTower};
use crate::nn::LoraLinear;
use crate::ops::activation::{gelu_in_f32, quick_gelu};
use crate::ops::kernels::Kernels;
use crate::ops::lora::LoraBatch;
use crate::runtime::stages::{Stage, StageClock};
pub use config::{DEFAULT_ROPE_THETA, VisionConfig};

pub use crate::models::qwen_vision::DEFAULT_BUFFER_LIMIT;

/// One transformer block.
#[derive(Debug, Clone)]
struct Block {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: LoraLinear,
    proj: LoraLinear,
    fc1: LoraLinear,
    fc2: LoraLinear,
}

/// The paths of a block's linears within it, in [`Block::linears`]'s order.
const BLOCK_LINEARS: [&str; 4] = ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"];

impl Block {
    /// The block's linears, in [`BLOCK_LINEARS`]'s order.
    fn linears(&self) -> [&LoraLinear; 4] {
        [&self.qkv, &self.proj, &self.fc1, &self.fc2]
    }

    /// The same, to change.
    fn linears_mut(&mut self) -> [&mut LoraLinear; 4] {
        [&mut self.qkv, &mut self.proj, &mut self.fc1, &mut self.fc2]
    }
}

/// The PatchMerger: LayerNorm, 2×2 rows into one, MLP.
#[derive(Debug, Clone)]
struct Merger {
    ln_q: LayerNorm,
    mlp0: LoraLinear,
    mlp2: LoraLinear,
}

impl Merger {
    /// The merger's linears, `mlp.0` then `mlp.2`.
    fn linears(&self) -> [&LoraLinear; 2] {
        [&self.mlp0, &self.mlp2]
    }

    /// The same, to change.
    fn linears_mut(&mut self) -> [&mut LoraLinear; 2] {
        [&mut self.mlp0, &mut self.mlp2]
    }
}

/// Qwen2-VL's vision tower and connector.
#[derive(Debug, Clone)]
pub struct Qwen2VlVision {
    config: VisionConfig,
    /// `[patch_len, embed_dim]`: the Conv3d as a linear.
    patch_embed_t: Tensor<2>,
    blocks: Vec<Block>,
    merger: Merger,
    device: Device,
    /// The largest buffer one operation may make, in bytes.
    buffer_limit: u64,
    /// The kernel each op runs with (the linears hold theirs too).
    kernels: Kernels,
    /// The dtype the weights and activations are in (f32, or f16 on a GPU that has it).
    dtype: DType,
    /// Where the forward pass marks its stages (detached unless a benchmark attaches one).
    stages: StageClock,
}

impl Qwen2VlVision {
    /// Loads the vision weights of the checkpoint in `dir` (`model.visual.*`, `visual.*`, or
    /// the tower's own names where it was saved alone).
    pub fn load(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let config = VisionConfig::from_model_dir(dir)?;
        // Per block: 2 norms and 4 linears (weight + bias each); merger: 1 norm, 2 linears.
        let tensors = config.depth * 12 + 7;
        Self::build(
            config,
            device,
            &mut CheckpointWeights::open(dir, device, tensors)?,
        )
    }

    /// A model of shape `config` with random weights (uniform, scaled by each linear's fan-in;
    /// norms near identity), for benchmarks: the same layers, shapes and kernels as a loaded one.
    pub fn random(config: VisionConfig, device: &Device) -> Self {
        Self::build(config, device, &mut RandomWeights { device })
            .expect("random weights always have the right shapes")
    }

    /// Assembles the model from `weights`, asking for each tensor by its checkpoint name.
    fn build(
        config: VisionConfig,
        device: &Device,
        weights: &mut impl WeightSource,
    ) -> Result<Self, ModelError> {
        let (d, hidden) = (config.embed_dim, config.hidden_size);
        let mlp = d * config.mlp_ratio;
        let merged = d * config.spatial_merge_size * config.spatial_merge_size;
        let mut blocks = Vec::with_capacity(config.depth);
        for i in 0..config.depth {
            let b = format!("blocks.{i}");
            blocks.push(Block {
                norm1: layer_norm(weights, &format!("{b}.norm1"), d)?,
                norm2: layer_norm(weights, &format!("{b}.norm2"), d)?,
                qkv: linear(weights, &format!("{b}.attn.qkv"), 3 * d, d)?,
                proj: linear(weights, &format!("{b}.attn.proj"), d, d)?,
                fc1: linear(weights, &format!("{b}.mlp.fc1"), mlp, d)?,
                fc2: linear(weights, &format!("{b}.mlp.fc2"), d, mlp)?,
            });
        }
        let merger = Merger {
            ln_q: layer_norm(weights, "merger.ln_q", d)?,
            mlp0: linear(weights, "merger.mlp.0", merged, merged)?,
            mlp2: linear(weights, "merger.mlp.2", hidden, merged)?,
        };
        // A Conv3d's weight, `[d, C, T, P, P]`, read in that layout and flattened to the linear
        // it is over flattened patches.
        let (p, t) = (config.patch_size, config.temporal_patch_size);
        let patch_embed: Tensor<2> = weights
            .tensor("patch_embed.proj.weight", [d, config.in_channels, t, p, p])?
            .reshape([d, config.patch_len()]);
        Ok(Self {
            patch_embed_t: patch_embed.transpose(),
            config,
            blocks,
            merger,
            device: device.clone(),
            buffer_limit: DEFAULT_BUFFER_LIMIT,
            kernels: Kernels::default(),
            dtype: DType::F32,
            stages: StageClock::default(),
        })
    }

    /// The model computing in `dtype` (`F32` or `F16`): the linears' weights cast once; norms
    /// (their parameters stay f32) and softmax still run in f32, and the outputs come back as f32.
    pub fn cast(self, dtype: DType) -> Self {
        let blocks = self
            .blocks
            .into_iter()
            .map(|b| Block {
                qkv: b.qkv.cast(dtype),
                proj: b.proj.cast(dtype),
                fc1: b.fc1.cast(dtype),
                fc2: b.fc2.cast(dtype),
                ..b
            })
            .collect();
        let merger = Merger {
            mlp0: self.merger.mlp0.cast(dtype),
            mlp2: self.merger.mlp2.cast(dtype),
            ..self.merger
        };
        Self {
            patch_embed_t: self.patch_embed_t.cast(dtype),
            blocks,
            merger,
            dtype,
            ..self
        }
    }

    /// The model's shape.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Every linear with its path, in [`Self::lora_targets`]'s order (each is a target).
    fn linears(&self) -> impl Iterator<Item = (String, &LoraLinear)> {
        let blocks = self.blocks.iter().map(Block::linears);
        named(blocks, BLOCK_LINEARS, merger_named(self.merger.linears()))
    }

    /// The same, to change.
    fn linears_mut(&mut self) -> impl Iterator<Item = (String, &mut LoraLinear)> {
        let blocks = self.blocks.iter_mut().map(Block::linears_mut);
        named(
            blocks,
            BLOCK_LINEARS,
            merger_named(self.merger.linears_mut()),
        )
    }

    /// `norm` on `x`, marked as [`Stage::Norm`].
    fn norm(&self, norm: &LayerNorm, x: Tensor<2>) -> Tensor<2> {
        let normed = norm.forward(x, self.kernels.norm);
        self.stages.mark(Stage::Norm);
        normed
    }
}

impl VisionTower for Qwen2VlVision {
    fn layout(&self) -> PatchLayout {
        self.config.layout()
    }

    /// Every LoRA target linear, in a fixed order.
    fn lora_targets(&self) -> Vec<LoraTarget> {
        self.config.lora_targets()
    }

    /// The target linear at `path` (as listed by [`Self::lora_targets`]).
    fn target_mut(&mut self, path: &str) -> Option<&mut LoraLinear> {
        self.linears_mut()
            .find_map(|(target, layer)| (target == path).then_some(layer))
    }

    /// The most tower rows one [`Self::forward`] can take with every row-wise buffer (patches,
    /// qkv, MLP, merger) within the buffer limit.
    fn max_rows(&self) -> usize {
        let c = &self.config;
        let m2 = c.spatial_merge_size * c.spatial_merge_size;
        let widths = [
            c.patch_len(),
            3 * c.embed_dim,
            c.embed_dim * c.mlp_ratio,
            c.hidden_size.div_ceil(m2),
        ];
        max_rows(self.buffer_limit, c.spatial_merge_size, &widths)
    }

    /// The largest buffer one operation may make, in bytes.
    fn buffer_limit(&self) -> u64 {
        self.buffer_limit
    }

    /// Sets the largest buffer one operation may make (a device's binding limit): attention
    /// runs in blocks of queries that fit, and [`Self::max_rows`] follows.
    fn set_buffer_limit(&mut self, bytes: u64) {
        self.buffer_limit = bytes.max(1);
    }

    /// The checkpoint name of every tensor [`Self::cast`] casts (the linears' weights and
    /// biases, the patch embedding), and beside them on the device their largest magnitudes
    /// (so a check of them all reads back once).
    fn cast_magnitudes(&self) -> (Vec<String>, Tensor<1>) {
        cast_magnitudes(&self.patch_embed_t, self.linears())
    }

    fn cast(self: Box<Self>, dtype: DType) -> Box<dyn VisionTower> {
        Box::new(Qwen2VlVision::cast(*self, dtype))
    }

    /// The kernels each op runs with.
    fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Runs each op with the kernel `kernels` holds for it ([`Kernels::choose`]).
    fn set_kernels(&mut self, kernels: Kernels) {
        for (_, layer) in self.linears_mut() {
            layer.set_kernel(kernels.linear);
        }
        self.kernels = kernels;
    }

    /// Marks the end of each stage of [`Self::forward`] on `clock` (clones of the model share
    /// it).
    fn set_stage_clock(&mut self, clock: StageClock) {
        self.stages = clock;
    }

    /// Runs the tower and the connector over every image of the batch at once.
    ///
    /// `pixel_values`: `[rows, patch_len]`, the images' patches one after the other;
    /// `grids`: each image's `(t, h, w)`; `tower` and `connector`: the LoRA metadata of the
    /// tower rows and of the merged rows (row for row, as the mapping builder lays them out).
    fn forward(
        &self,
        pixel_values: Tensor<2>,
        grids: &[[usize; 3]],
        tower: &LoraBatch,
        connector: &LoraBatch,
    ) -> Result<VisionOutput, ModelError> {
        let [rows, _] = pixel_values.dims();
        check_inputs(pixel_values.dims(), grids, self.config.layout())?;
        let (m, heads, hd) = (
            self.config.spatial_merge_size,
            self.config.num_heads,
            self.config.head_dim(),
        );
        // f32 angles in every precision: rotary runs in f32 (`ops::rotary::rotate_packed`).
        let rotary = rotary::tables(grids, m, hd, self.config.rope_theta, &self.device);
        // Each frame of each image attends only to itself; the same pieces in every block.
        let pieces = attention_pieces(
            &frames(grids),
            heads,
            hd,
            self.kernels.attention,
            self.buffer_limit,
        );
        let pass = Pass {
            kernels: self.kernels,
            stages: &self.stages,
        };

        self.stages.begin();
        let mut x = pixel_values
            .cast(self.dtype)
            .matmul(self.patch_embed_t.clone());
        pass.mark(Stage::PatchEmbed);
        for block in &self.blocks {
            let normed = self.norm(&block.norm1, x.clone());
            let attended = pass.attention(
                &block.qkv,
                &block.proj,
                normed,
                heads,
                &rotary,
                &pieces,
                tower,
            )?;
            x = pass.residual(x, attended);
            let normed = self.norm(&block.norm2, x.clone());
            let hidden = pass.linear(&block.fc1, normed, tower, Stage::Fc1)?;
            let activated = quick_gelu(hidden);
            pass.mark(Stage::Activation);
            let mlp = pass.linear(&block.fc2, activated, tower, Stage::Fc2)?;
            x = pass.residual(x, mlp);
        }
        let merged = self
            .norm(&self.merger.ln_q, x.clone())
            .reshape([rows / (m * m), self.config.embed_dim * m * m]);
        let hidden = pass.linear(&self.merger.mlp0, merged, connector, Stage::MergerMlp0)?;
        let activated = gelu_in_f32(hidden);
        pass.mark(Stage::Activation);
        let embeds = pass.linear(&self.merger.mlp2, activated, connector, Stage::MergerMlp2)?;
        let output = VisionOutput {
            tower: x.cast(DType::F32),
            embeds: embeds.cast(DType::F32),
            deepstack: None,
        };
        self.stages.mark(Stage::Output);
        Ok(output)
    }

    /// Each frame of each image, in every block.
    fn attention_segments(&self, grids: &[[usize; 3]]) -> Vec<Vec<usize>> {
        vec![frames(grids); self.config.depth]
    }

    fn boxed_clone(&self) -> Box<dyn VisionTower> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::device;

    /// Every LoRA target the config lists is a linear of the model, of the target's widths, at
    /// the target's path, in the config's order; no other path is.
    #[test]
    fn each_target_path_names_its_linear() {
        let mut model = Qwen2VlVision::random(VisionConfig::tiny(), &device::cpu().device);
        let targets = model.lora_targets();
        let paths: Vec<String> = model.linears().map(|(path, _)| path).collect();
        let target_paths: Vec<&String> = targets.iter().map(|t| &t.path).collect();
        assert_eq!(paths.iter().collect::<Vec<_>>(), target_paths);
        for target in &targets {
            let layer = model.target_mut(&target.path).unwrap();
            assert_eq!(
                layer.dims(),
                (target.in_features, target.out_features),
                "{}",
                target.path
            );
        }
        for path in [
            "blocks.0.attn",
            "blocks.99.mlp.fc1",
            "merger.mlp.1",
            "blocks.x.mlp.fc1",
        ] {
            assert!(model.target_mut(path).is_none(), "{path}");
        }
    }
}
