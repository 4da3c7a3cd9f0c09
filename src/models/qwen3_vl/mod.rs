//! Qwen3-VL's vision tower, its merger and its deepstack mergers, with a LoRA slot on every
//! target linear (`blocks.*.attn.qkv`, `attn.proj`, `mlp.linear_fc1`, `mlp.linear_fc2`,
//! `merger.linear_fc1`, `merger.linear_fc2`, `deepstack_merger_list.*.linear_fc1/2`). Numbers
//! follow transformers' `Qwen3VLVisionModel`: Qwen2-VL's tower with a biased patch embedding,
//! learned positions interpolated to each grid (`position.rs`), a GELU-tanh MLP, and mergers
//! after the blocks `deepstack_visual_indexes` names, whose outputs the language model adds to
//! its early layers. Also Qwen3-VL-MoE's tower, and Qwen3.5's (no deepstack mergers).

pub mod config;
mod position;

use std::path::Path;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::models::error::ModelError;
use crate::models::qwen_vision::weights::{
    CheckpointWeights, RandomWeights, WeightSource, layer_norm, linear,
};
use crate::models::qwen_vision::{
    DEFAULT_BUFFER_LIMIT, LayerNorm, Pass, attention_pieces, cast_magnitudes, check_inputs, frames,
    max_rows, named, rotary,
};
use crate::models::tower::{LoraTarget, PatchLayout, VisionOutput, VisionTower};
use crate::nn::LoraLinear;
use crate::ops::activation::{gelu_in_f32, gelu_tanh};
use crate::ops::kernels::Kernels;
use crate::ops::lora::LoraBatch;
use crate::runtime::stages::{Stage, StageClock};
pub use config::Qwen3VlConfig;

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
const BLOCK_LINEARS: [&str; 4] = ["attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"];

impl Block {
    fn linears(&self) -> [&LoraLinear; 4] {
        [&self.qkv, &self.proj, &self.fc1, &self.fc2]
    }

    fn linears_mut(&mut self) -> [&mut LoraLinear; 4] {
        [&mut self.qkv, &mut self.proj, &mut self.fc1, &mut self.fc2]
    }

    fn cast(self, dtype: DType) -> Self {
        Self {
            qkv: self.qkv.cast(dtype),
            proj: self.proj.cast(dtype),
            fc1: self.fc1.cast(dtype),
            fc2: self.fc2.cast(dtype),
            ..self
        }
    }
}

/// A patch merger: LayerNorm, a merge block's rows into one, `linear_fc1`, GELU, `linear_fc2`.
/// The main merger normalises each row before the merge; a deepstack merger normalises the
/// merged rows ("post-shuffle").
#[derive(Debug, Clone)]
struct Merger {
    norm: LayerNorm,
    fc1: LoraLinear,
    fc2: LoraLinear,
}

impl Merger {
    fn cast(self, dtype: DType) -> Self {
        Self {
            fc1: self.fc1.cast(dtype),
            fc2: self.fc2.cast(dtype),
            ..self
        }
    }
}

/// Qwen3-VL's vision tower and connector.
#[derive(Debug, Clone)]
pub struct Qwen3VlVision {
    config: Qwen3VlConfig,
    /// `[patch_len, embed_dim]`: the Conv3d as a linear, and its bias.
    patch_embed_t: Tensor<2>,
    patch_bias: Tensor<1>,
    /// `[num_position_embeddings, embed_dim]`, kept in f32: transformers sums its
    /// interpolation in f32 and casts the sum.
    pos_embed: Tensor<2>,
    blocks: Vec<Block>,
    merger: Merger,
    /// One per `deepstack_visual_indexes` entry, in its order.
    deepstack: Vec<Merger>,
    device: Device,
    /// The largest buffer one operation may make, in bytes.
    buffer_limit: u64,
    /// The kernel each op runs with (the linears hold theirs too).
    kernels: Kernels,
    /// The dtype the weights and activations are in.
    dtype: DType,
    /// Where the forward pass marks its stages.
    stages: StageClock,
}

impl Qwen3VlVision {
    /// Loads the vision weights of the checkpoint in `dir` (`model.visual.*`, `visual.*`, or
    /// the tower's own names where it was saved alone).
    pub fn load(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let config = Qwen3VlConfig::from_model_dir(dir)?;
        // Per block: 2 norms and 4 linears (weight + bias each); per merger: a norm and 2
        // linears; the patch embedding (weight, bias) and the position table.
        let mergers = 1 + config.deepstack_visual_indexes.len();
        let tensors = config.depth * 12 + mergers * 6 + 3;
        Self::build(
            config,
            device,
            &mut CheckpointWeights::open(dir, device, tensors)?,
        )
    }

    /// A model of shape `config` with random weights, for benchmarks and tests.
    pub fn random(config: Qwen3VlConfig, device: &Device) -> Self {
        Self::build(config, device, &mut RandomWeights { device })
            .expect("random weights always have the right shapes")
    }

    /// Assembles the model from `weights`, asking for each tensor by its checkpoint name.
    fn build(
        config: Qwen3VlConfig,
        device: &Device,
        weights: &mut impl WeightSource,
    ) -> Result<Self, ModelError> {
        let (d, mlp) = (config.embed_dim, config.intermediate_size);
        let (merged, out) = (config.merged_width(), config.out_hidden_size);
        let mut blocks = Vec::with_capacity(config.depth);
        for i in 0..config.depth {
            let b = format!("blocks.{i}");
            blocks.push(Block {
                norm1: layer_norm(weights, &format!("{b}.norm1"), d)?,
                norm2: layer_norm(weights, &format!("{b}.norm2"), d)?,
                qkv: linear(weights, &format!("{b}.attn.qkv"), 3 * d, d)?,
                proj: linear(weights, &format!("{b}.attn.proj"), d, d)?,
                fc1: linear(weights, &format!("{b}.mlp.linear_fc1"), mlp, d)?,
                fc2: linear(weights, &format!("{b}.mlp.linear_fc2"), d, mlp)?,
            });
        }
        let mut mergers = Vec::with_capacity(1 + config.deepstack_visual_indexes.len());
        for (j, prefix) in config.merger_prefixes().into_iter().enumerate() {
            // The main merger normalises rows of the tower's width, the deepstack mergers
            // merged rows.
            let normed = if j == 0 { d } else { merged };
            mergers.push(Merger {
                norm: layer_norm(weights, &format!("{prefix}.norm"), normed)?,
                fc1: linear(weights, &format!("{prefix}.linear_fc1"), merged, merged)?,
                fc2: linear(weights, &format!("{prefix}.linear_fc2"), out, merged)?,
            });
        }
        let merger = mergers.remove(0);
        // A Conv3d's weight, `[d, C, T, P, P]`, flattened to the linear it is over patches.
        let (p, t) = (config.patch_size, config.temporal_patch_size);
        let patch_embed: Tensor<2> = weights
            .tensor("patch_embed.proj.weight", [d, config.in_channels, t, p, p])?
            .reshape([d, config.layout().patch_len()]);
        let patch_bias = weights.tensor("patch_embed.proj.bias", [d])?;
        let pos_embed = weights.tensor("pos_embed.weight", [config.num_position_embeddings, d])?;
        Ok(Self {
            patch_embed_t: patch_embed.transpose(),
            patch_bias,
            pos_embed,
            config,
            blocks,
            merger,
            deepstack: mergers,
            device: device.clone(),
            buffer_limit: DEFAULT_BUFFER_LIMIT,
            kernels: Kernels::default(),
            dtype: DType::F32,
            stages: StageClock::default(),
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &Qwen3VlConfig {
        &self.config
    }

    /// Every linear with its path, in [`VisionTower::lora_targets`]' order.
    fn linears(&self) -> impl Iterator<Item = (String, &LoraLinear)> {
        let mergers = std::iter::once(&self.merger).chain(&self.deepstack);
        let mergers = self
            .config
            .merger_prefixes()
            .into_iter()
            .zip(mergers)
            .flat_map(|(prefix, merger)| {
                [
                    (format!("{prefix}.linear_fc1"), &merger.fc1),
                    (format!("{prefix}.linear_fc2"), &merger.fc2),
                ]
            });
        named(
            self.blocks.iter().map(Block::linears),
            BLOCK_LINEARS,
            mergers,
        )
    }

    /// The same, to change.
    fn linears_mut(&mut self) -> impl Iterator<Item = (String, &mut LoraLinear)> {
        let mergers = std::iter::once(&mut self.merger).chain(&mut self.deepstack);
        let mergers = self
            .config
            .merger_prefixes()
            .into_iter()
            .zip(mergers)
            .flat_map(|(prefix, merger)| {
                [
                    (format!("{prefix}.linear_fc1"), &mut merger.fc1),
                    (format!("{prefix}.linear_fc2"), &mut merger.fc2),
                ]
            });
        named(
            self.blocks.iter_mut().map(Block::linears_mut),
            BLOCK_LINEARS,
            mergers,
        )
    }

    /// `norm` on `x`, marked as [`Stage::Norm`].
    fn norm(&self, norm: &LayerNorm, x: Tensor<2>) -> Tensor<2> {
        let normed = norm.forward(x, self.kernels.norm);
        self.stages.mark(Stage::Norm);
        normed
    }

    /// Each tower row's learned position for `grids`, `[rows, embed_dim]` in f32: four rows of
    /// the table, weighted.
    fn positions(&self, grids: &[[usize; 3]], rows: usize) -> Tensor<2> {
        let taps = position::interpolation(
            grids,
            self.config.position_side(),
            self.config.spatial_merge_size,
        );
        let indices: Tensor<1, Int> =
            Tensor::from_data(TensorData::new(taps.indices, [rows * 4]), &self.device);
        let weights: Tensor<3> =
            Tensor::from_data(TensorData::new(taps.weights, [rows, 4, 1]), &self.device);
        let d = self.config.embed_dim;
        let read = self
            .pos_embed
            .clone()
            .select(0, indices)
            .reshape([rows, 4, d]);
        (read * weights).sum_dim(1).reshape([rows, d])
    }

    /// `merger` on the tower's rows `x`, merge blocks into rows; `post_shuffle` normalises the
    /// merged rows (the deepstack mergers) rather than the tower's.
    fn merge(
        &self,
        pass: &Pass,
        merger: &Merger,
        x: Tensor<2>,
        post_shuffle: bool,
        connector: &LoraBatch,
    ) -> Result<Tensor<2>, ModelError> {
        let [rows, _] = x.dims();
        let shape = [
            rows / self.config.spatial_merge_size.pow(2),
            self.config.merged_width(),
        ];
        let merged = match post_shuffle {
            true => self.norm(&merger.norm, x.reshape(shape)),
            false => self.norm(&merger.norm, x).reshape(shape),
        };
        let hidden = pass.linear(&merger.fc1, merged, connector, Stage::MergerMlp0)?;
        let activated = gelu_in_f32(hidden);
        pass.mark(Stage::Activation);
        pass.linear(&merger.fc2, activated, connector, Stage::MergerMlp2)
    }
}

impl VisionTower for Qwen3VlVision {
    fn layout(&self) -> PatchLayout {
        self.config.layout()
    }

    fn lora_targets(&self) -> Vec<LoraTarget> {
        self.config.lora_targets()
    }

    fn target_mut(&mut self, path: &str) -> Option<&mut LoraLinear> {
        self.linears_mut()
            .find_map(|(target, layer)| (target == path).then_some(layer))
    }

    /// The most tower rows one forward call can take with every row-wise buffer (patches, the
    /// position taps, qkv, the MLP, the mergers' outputs) within the buffer limit.
    fn max_rows(&self) -> usize {
        let c = &self.config;
        let m2 = c.spatial_merge_size * c.spatial_merge_size;
        let mergers = 1 + c.deepstack_visual_indexes.len();
        let widths = [
            c.layout().patch_len(),
            4 * c.embed_dim,
            3 * c.embed_dim,
            c.intermediate_size,
            (mergers * c.out_hidden_size).div_ceil(m2),
        ];
        max_rows(self.buffer_limit, c.spatial_merge_size, &widths)
    }

    fn buffer_limit(&self) -> u64 {
        self.buffer_limit
    }

    fn set_buffer_limit(&mut self, bytes: u64) {
        self.buffer_limit = bytes.max(1);
    }

    /// The shared tensors' magnitudes and the patch embedding's bias'.
    fn cast_magnitudes(&self) -> (Vec<String>, Tensor<1>) {
        let (mut names, largest) = cast_magnitudes(&self.patch_embed_t, self.linears());
        names.push("patch_embed.proj.bias".to_owned());
        let bias = self.patch_bias.clone().abs().max();
        (names, Tensor::cat(vec![largest, bias], 0))
    }

    /// The linears' weights and the patch embedding cast to `dtype`; the norms and the
    /// position table stay f32 (both apply in f32).
    fn cast(self: Box<Self>, dtype: DType) -> Box<dyn VisionTower> {
        let model = *self;
        Box::new(Self {
            patch_embed_t: model.patch_embed_t.cast(dtype),
            patch_bias: model.patch_bias.cast(dtype),
            blocks: model.blocks.into_iter().map(|b| b.cast(dtype)).collect(),
            merger: model.merger.cast(dtype),
            deepstack: model.deepstack.into_iter().map(|m| m.cast(dtype)).collect(),
            dtype,
            ..model
        })
    }

    fn kernels(&self) -> Kernels {
        self.kernels
    }

    fn set_kernels(&mut self, kernels: Kernels) {
        for (_, layer) in self.linears_mut() {
            layer.set_kernel(kernels.linear);
        }
        self.kernels = kernels;
    }

    fn set_stage_clock(&mut self, clock: StageClock) {
        self.stages = clock;
    }

    /// Runs the tower, the merger and the deepstack mergers over every image of the batch at
    /// once; each image's frames attend within themselves in every block.
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
        let rotary = rotary::tables(grids, m, hd, self.config.rope_theta, &self.device);
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
        let embedded = pixel_values
            .cast(self.dtype)
            .matmul(self.patch_embed_t.clone())
            + self.patch_bias.clone().unsqueeze_dim(0);
        let mut x = embedded + self.positions(grids, rows).cast(self.dtype);
        pass.mark(Stage::PatchEmbed);
        let mut deepstack = Vec::with_capacity(self.deepstack.len());
        for (i, block) in self.blocks.iter().enumerate() {
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
            let activated = gelu_tanh(hidden);
            pass.mark(Stage::Activation);
            let mlp = pass.linear(&block.fc2, activated, tower, Stage::Fc2)?;
            x = pass.residual(x, mlp);
            let indexes = &self.config.deepstack_visual_indexes;
            if let Some(j) = indexes.iter().position(|&index| index == i) {
                let merger = &self.deepstack[j];
                deepstack.push(self.merge(&pass, merger, x.clone(), true, connector)?);
            }
        }
        let embeds = self.merge(&pass, &self.merger, x.clone(), false, connector)?;
        let output = VisionOutput {
            tower: x.cast(DType::F32),
            embeds: embeds.cast(DType::F32),
            deepstack: (!deepstack.is_empty()).then(|| Tensor::cat(deepstack, 1).cast(DType::F32)),
        };
        pass.mark(Stage::Output);
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
    /// the target's path, in the config's order.
    #[test]
    fn each_target_path_names_its_linear() {
        let config = Qwen3VlConfig {
            depth: 3,
            embed_dim: 32,
            intermediate_size: 48,
            num_heads: 2,
            out_hidden_size: 40,
            in_channels: 3,
            patch_size: 16,
            spatial_merge_size: 2,
            temporal_patch_size: 2,
            num_position_embeddings: 16,
            deepstack_visual_indexes: vec![2, 0],
            rope_theta: 10_000.0,
        };
        let mut model = Qwen3VlVision::random(config, &device::cpu().device);
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
        assert!(
            model
                .target_mut("deepstack_merger_list.2.linear_fc1")
                .is_none()
        );
        assert!(model.target_mut("blocks.0.mlp.fc1").is_none());
    }
}
