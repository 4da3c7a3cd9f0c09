//! Qwen2.5-VL's vision tower and its PatchMerger connector, with a LoRA slot on every target
//! linear (`blocks.*.attn.qkv`, `attn.proj`, `mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj`,
//! `merger.mlp.0`, `merger.mlp.2`). Numbers follow transformers'
//! `Qwen2_5_VisionTransformerPretrainedModel`: Qwen2-VL's tower with RMSNorm, a SwiGLU MLP and
//! attention within windows (`window.rs`) in every block but `fullatt_block_indexes`.

pub mod config;
mod window;

use std::path::Path;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::models::error::ModelError;
use crate::models::qwen_vision::weights::{CheckpointWeights, RandomWeights, WeightSource, linear};
use crate::models::qwen_vision::{
    DEFAULT_BUFFER_LIMIT, Pass, attention_pieces, cast_magnitudes, check_inputs, frames, max_rows,
    merger_named, named, rotary,
};
use crate::models::tower::{LoraTarget, PatchLayout, VisionOutput, VisionTower};
use crate::nn::LoraLinear;
use crate::ops::activation::{gelu_in_f32, swiglu};
use crate::ops::kernels::Kernels;
use crate::ops::lora::LoraBatch;
use crate::ops::norm::rms_norm;
use crate::runtime::stages::{Stage, StageClock};
pub use config::Qwen25VlConfig;
use window::{Windows, inverse};

/// RMSNorm epsilon of every norm in the tower and merger.
const RMS_NORM_EPS: f64 = 1e-6;

/// One transformer block.
#[derive(Debug, Clone)]
struct Block {
    /// RMSNorm weights, kept in f32.
    norm1: Tensor<1>,
    norm2: Tensor<1>,
    qkv: LoraLinear,
    proj: LoraLinear,
    gate: LoraLinear,
    up: LoraLinear,
    down: LoraLinear,
}

/// The paths of a block's linears within it, in [`Block::linears`]'s order.
const BLOCK_LINEARS: [&str; 5] = [
    "attn.qkv",
    "attn.proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

impl Block {
    fn linears(&self) -> [&LoraLinear; 5] {
        [&self.qkv, &self.proj, &self.gate, &self.up, &self.down]
    }

    fn linears_mut(&mut self) -> [&mut LoraLinear; 5] {
        [
            &mut self.qkv,
            &mut self.proj,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
        ]
    }

    fn cast(self, dtype: DType) -> Self {
        Self {
            qkv: self.qkv.cast(dtype),
            proj: self.proj.cast(dtype),
            gate: self.gate.cast(dtype),
            up: self.up.cast(dtype),
            down: self.down.cast(dtype),
            ..self
        }
    }
}

/// The PatchMerger: RMSNorm, 2×2 rows into one, MLP.
#[derive(Debug, Clone)]
struct Merger {
    ln_q: Tensor<1>,
    mlp0: LoraLinear,
    mlp2: LoraLinear,
}

/// Qwen2.5-VL's vision tower and connector.
#[derive(Debug, Clone)]
pub struct Qwen25VlVision {
    config: Qwen25VlConfig,
    /// `[patch_len, embed_dim]`: the Conv3d (no bias) as a linear.
    patch_embed_t: Tensor<2>,
    blocks: Vec<Block>,
    merger: Merger,
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

impl Qwen25VlVision {
    /// Loads the vision weights of the checkpoint in `dir` (`model.visual.*`, `visual.*`, or
    /// the tower's own names where it was saved alone).
    pub fn load(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let config = Qwen25VlConfig::from_model_dir(dir)?;
        // Per block: 2 norms, 5 linears (weight + bias each); merger: 1 norm, 2 linears; the
        // patch embedding.
        let tensors = config.depth * 12 + 6;
        Self::build(
            config,
            device,
            &mut CheckpointWeights::open(dir, device, tensors)?,
        )
    }

    /// A model of shape `config` with random weights, for benchmarks and tests.
    pub fn random(config: Qwen25VlConfig, device: &Device) -> Self {
        Self::build(config, device, &mut RandomWeights { device })
            .expect("random weights always have the right shapes")
    }

    /// Assembles the model from `weights`, asking for each tensor by its checkpoint name.
    fn build(
        config: Qwen25VlConfig,
        device: &Device,
        weights: &mut impl WeightSource,
    ) -> Result<Self, ModelError> {
        let (d, mlp) = (config.embed_dim, config.intermediate_size);
        let merged = d * config.spatial_merge_size * config.spatial_merge_size;
        let mut blocks = Vec::with_capacity(config.depth);
        for i in 0..config.depth {
            let b = format!("blocks.{i}");
            blocks.push(Block {
                norm1: weights.tensor(&format!("{b}.norm1.weight"), [d])?,
                norm2: weights.tensor(&format!("{b}.norm2.weight"), [d])?,
                qkv: linear(weights, &format!("{b}.attn.qkv"), 3 * d, d)?,
                proj: linear(weights, &format!("{b}.attn.proj"), d, d)?,
                gate: linear(weights, &format!("{b}.mlp.gate_proj"), mlp, d)?,
                up: linear(weights, &format!("{b}.mlp.up_proj"), mlp, d)?,
                down: linear(weights, &format!("{b}.mlp.down_proj"), d, mlp)?,
            });
        }
        let merger = Merger {
            ln_q: weights.tensor("merger.ln_q.weight", [d])?,
            mlp0: linear(weights, "merger.mlp.0", merged, merged)?,
            mlp2: linear(weights, "merger.mlp.2", config.out_hidden_size, merged)?,
        };
        // A Conv3d's weight, `[d, C, T, P, P]`, flattened to the linear it is over patches.
        let (p, t) = (config.patch_size, config.temporal_patch_size);
        let patch_embed: Tensor<2> = weights
            .tensor("patch_embed.proj.weight", [d, config.in_channels, t, p, p])?
            .reshape([d, config.layout().patch_len()]);
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

    /// The model's shape.
    pub fn config(&self) -> &Qwen25VlConfig {
        &self.config
    }

    /// Every linear with its path, in [`VisionTower::lora_targets`]' order.
    fn linears(&self) -> impl Iterator<Item = (String, &LoraLinear)> {
        let merger = [&self.merger.mlp0, &self.merger.mlp2];
        named(
            self.blocks.iter().map(Block::linears),
            BLOCK_LINEARS,
            merger_named(merger),
        )
    }

    /// The same, to change.
    fn linears_mut(&mut self) -> impl Iterator<Item = (String, &mut LoraLinear)> {
        let merger = [&mut self.merger.mlp0, &mut self.merger.mlp2];
        named(
            self.blocks.iter_mut().map(Block::linears_mut),
            BLOCK_LINEARS,
            merger_named(merger),
        )
    }

    /// RMSNorm with `weight` on `x`, marked as [`Stage::Norm`].
    fn norm(&self, weight: &Tensor<1>, x: Tensor<2>) -> Tensor<2> {
        let normed = rms_norm(x, weight, RMS_NORM_EPS);
        self.stages.mark(Stage::Norm);
        normed
    }

    /// Uploads row indices.
    fn indices(&self, rows: &[usize]) -> Tensor<1, Int> {
        let values: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        Tensor::from_data(TensorData::new(values, [rows.len()]), &self.device)
    }
}

impl VisionTower for Qwen25VlVision {
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

    /// The most tower rows one forward call can take with every row-wise buffer (patches, qkv,
    /// the MLP, the merger) within the buffer limit.
    fn max_rows(&self) -> usize {
        let c = &self.config;
        let m2 = c.spatial_merge_size * c.spatial_merge_size;
        let widths = [
            c.layout().patch_len(),
            3 * c.embed_dim,
            c.intermediate_size,
            c.out_hidden_size.div_ceil(m2),
        ];
        max_rows(self.buffer_limit, c.spatial_merge_size, &widths)
    }

    fn buffer_limit(&self) -> u64 {
        self.buffer_limit
    }

    fn set_buffer_limit(&mut self, bytes: u64) {
        self.buffer_limit = bytes.max(1);
    }

    fn cast_magnitudes(&self) -> (Vec<String>, Tensor<1>) {
        cast_magnitudes(&self.patch_embed_t, self.linears())
    }

    /// The linears' weights and the patch embedding cast to `dtype`; the norms' weights stay
    /// f32 and are cast where they apply, as RMSNorm multiplies in the input's dtype.
    fn cast(self: Box<Self>, dtype: DType) -> Box<dyn VisionTower> {
        let model = *self;
        Box::new(Self {
            patch_embed_t: model.patch_embed_t.cast(dtype),
            blocks: model.blocks.into_iter().map(|b| b.cast(dtype)).collect(),
            merger: Merger {
                mlp0: model.merger.mlp0.cast(dtype),
                mlp2: model.merger.mlp2.cast(dtype),
                ..model.merger
            },
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

    /// Runs the tower and the connector over every image of the batch at once, in window
    /// order inside: the rows, their rotary tables and their adapter slots are permuted into
    /// windows after the patch embedding, and the outputs permuted back.
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
        let windows = Windows::of(grids, m, self.config.window_units());
        let tower_order = windows.tower_rows();
        let permuted = "windows order every row once";
        let tower = tower.permuted(&tower_order).expect(permuted);
        let connector = connector.permuted(&windows.units).expect(permuted);
        let into_windows = self.indices(&tower_order);
        let rotary = rotary::tables(grids, m, hd, self.config.rope_theta, &self.device)
            .select(&into_windows);
        let pieces = |segments: &[usize]| {
            attention_pieces(
                segments,
                heads,
                hd,
                self.kernels.attention,
                self.buffer_limit,
            )
        };
        let (full, windowed) = (pieces(&frames(grids)), pieces(&windows.rows));
        let pass = Pass {
            kernels: self.kernels,
            stages: &self.stages,
        };

        self.stages.begin();
        let mut x = pixel_values
            .cast(self.dtype)
            .matmul(self.patch_embed_t.clone())
            .select(0, into_windows);
        pass.mark(Stage::PatchEmbed);
        for (i, block) in self.blocks.iter().enumerate() {
            let pieces = match self.config.fullatt_block_indexes.contains(&i) {
                true => &full,
                false => &windowed,
            };
            let normed = self.norm(&block.norm1, x.clone());
            let attended = pass.attention(
                &block.qkv,
                &block.proj,
                normed,
                heads,
                &rotary,
                pieces,
                &tower,
            )?;
            x = pass.residual(x, attended);
            let normed = self.norm(&block.norm2, x.clone());
            // The gated MLP's two input products are marked as the MLP's first product.
            let gate = pass.linear(&block.gate, normed.clone(), &tower, Stage::Fc1)?;
            let up = pass.linear(&block.up, normed, &tower, Stage::Fc1)?;
            let activated = swiglu(gate, up);
            pass.mark(Stage::Activation);
            let mlp = pass.linear(&block.down, activated, &tower, Stage::Fc2)?;
            x = pass.residual(x, mlp);
        }
        let merged = self
            .norm(&self.merger.ln_q, x.clone())
            .reshape([rows / (m * m), self.config.embed_dim * m * m]);
        let hidden = pass.linear(&self.merger.mlp0, merged, &connector, Stage::MergerMlp0)?;
        let activated = gelu_in_f32(hidden);
        pass.mark(Stage::Activation);
        let embeds = pass.linear(&self.merger.mlp2, activated, &connector, Stage::MergerMlp2)?;
        let output = VisionOutput {
            tower: x
                .select(0, self.indices(&inverse(&tower_order)))
                .cast(DType::F32),
            embeds: embeds
                .select(0, self.indices(&inverse(&windows.units)))
                .cast(DType::F32),
            deepstack: None,
        };
        pass.mark(Stage::Output);
        Ok(output)
    }

    /// Each frame in the `fullatt_block_indexes` blocks, each window in the others.
    fn attention_segments(&self, grids: &[[usize; 3]]) -> Vec<Vec<usize>> {
        let c = &self.config;
        let windows = Windows::of(grids, c.spatial_merge_size, c.window_units()).rows;
        (0..c.depth)
            .map(|i| match c.fullatt_block_indexes.contains(&i) {
                true => frames(grids),
                false => windows.clone(),
            })
            .collect()
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
        let config = Qwen25VlConfig {
            depth: 3,
            embed_dim: 32,
            intermediate_size: 48,
            num_heads: 2,
            out_hidden_size: 40,
            in_channels: 3,
            patch_size: 14,
            spatial_merge_size: 2,
            temporal_patch_size: 2,
            window_size: 56,
            fullatt_block_indexes: vec![1],
            rope_theta: 10_000.0,
        };
        let mut model = Qwen25VlVision::random(config, &device::cpu().device);
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
        assert!(model.target_mut("blocks.0.mlp.fc1").is_none());
    }
}
