//! The vision part of a Qwen2.5-VL `config.json`.

use std::path::Path;

use serde::Deserialize;

use crate::models::error::ConfigError;
use crate::models::qwen_vision::config::{
    PatchFields, RopeFields, VisionSection, check_blocks, check_heads, check_sizes, lora_targets,
    merger_targets, patch_sizes,
};
use crate::models::tower::{LoraTarget, PatchLayout};

/// The vision tower's shape (`vision_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen25VlConfig {
    /// Transformer blocks.
    pub depth: usize,
    /// Width of the tower (`hidden_size`).
    pub embed_dim: usize,
    /// Width of the gated MLP.
    pub intermediate_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Width of the connector's output (`out_hidden_size`: the language model's).
    pub out_hidden_size: usize,
    /// Input channels.
    pub in_channels: usize,
    /// Patch side.
    pub patch_size: usize,
    /// Side of the merge block.
    pub spatial_merge_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Side of an attention window in pixels.
    pub window_size: usize,
    /// The blocks that attend over each whole frame; the others attend within windows.
    pub fullatt_block_indexes: Vec<usize>,
    /// Base of the rotary position embedding's frequencies.
    pub rope_theta: f32,
}

/// `vision_config` as the hub (`in_chans`, `spatial_patch_size`) or transformers writes it.
#[derive(Deserialize)]
struct RawVision {
    depth: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_heads: usize,
    out_hidden_size: usize,
    #[serde(flatten)]
    patch: PatchFields,
    window_size: Option<usize>,
    fullatt_block_indexes: Option<Vec<usize>>,
    hidden_act: Option<String>,
    #[serde(flatten)]
    rope: RopeFields,
}

impl Qwen25VlConfig {
    /// Reads `dir/config.json` (`model_type` `qwen2_5_vl`, or `qwen2_5_vl_vision` for the
    /// tower saved alone).
    pub fn from_model_dir(dir: &Path) -> Result<Self, ConfigError> {
        let section = VisionSection::read(dir, &["qwen2_5_vl"])?;
        let at = section.at;
        let raw: RawVision = section.parse()?;
        let rope_theta = section.rope_theta(&raw.rope)?;
        let act = raw.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            return Err(section.invalid(format!(
                "{at}hidden_act is {act}; Qwen2.5-VL's gated MLP runs silu"
            )));
        }
        let layout = raw.patch.layout(14);
        let config = Self {
            depth: raw.depth,
            embed_dim: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_heads: raw.num_heads,
            out_hidden_size: raw.out_hidden_size,
            in_channels: layout.in_channels,
            patch_size: layout.patch_size,
            spatial_merge_size: layout.spatial_merge_size,
            temporal_patch_size: layout.temporal_patch_size,
            window_size: raw.window_size.unwrap_or(112),
            fullatt_block_indexes: raw
                .fullatt_block_indexes
                .unwrap_or_else(|| vec![7, 15, 23, 31]),
            rope_theta,
        };
        config
            .check()
            .map_err(|reason| section.invalid(format!("{at}{reason}")))?;
        Ok(config)
    }

    /// Why this shape cannot run, naming the key.
    fn check(&self) -> Result<(), String> {
        check_sizes(&[
            ("depth", self.depth, 1024),
            ("hidden_size", self.embed_dim, 1 << 16),
            ("intermediate_size", self.intermediate_size, 1 << 18),
            ("num_heads", self.num_heads, 1024),
            ("out_hidden_size", self.out_hidden_size, 1 << 17),
        ])?;
        check_sizes(&patch_sizes(self.layout()))?;
        check_sizes(&[("window_size", self.window_size, 1 << 16)])?;
        check_heads("hidden_size", self.embed_dim, self.num_heads)?;
        let block = self.spatial_merge_size * self.patch_size;
        if !self.window_size.is_multiple_of(block) {
            return Err(format!(
                "window_size {} is not a whole number of merge blocks of {block} pixels",
                self.window_size
            ));
        }
        check_blocks(
            "fullatt_block_indexes",
            &self.fullatt_block_indexes,
            self.depth,
        )
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.num_heads
    }

    /// Merged tokens per side of an attention window.
    pub fn window_units(&self) -> usize {
        self.window_size / (self.spatial_merge_size * self.patch_size)
    }

    /// How the tower cuts and merges patches.
    pub fn layout(&self) -> PatchLayout {
        PatchLayout {
            in_channels: self.in_channels,
            patch_size: self.patch_size,
            temporal_patch_size: self.temporal_patch_size,
            spatial_merge_size: self.spatial_merge_size,
        }
    }

    /// Every LoRA target linear, in a fixed order: each block's `attn.qkv`, `attn.proj`,
    /// `mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj`, then `merger.mlp.0` and `merger.mlp.2`
    /// (the connector's).
    pub fn lora_targets(&self) -> Vec<LoraTarget> {
        let (d, mlp) = (self.embed_dim, self.intermediate_size);
        let block = [
            ("attn.qkv", d, 3 * d),
            ("attn.proj", d, d),
            ("mlp.gate_proj", d, mlp),
            ("mlp.up_proj", d, mlp),
            ("mlp.down_proj", mlp, d),
        ];
        let merged = d * self.spatial_merge_size * self.spatial_merge_size;
        lora_targets(
            self.depth,
            &block,
            merger_targets(merged, self.out_hidden_size),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Qwen25VlConfig, ConfigError> {
        let dir = tempfile::TempDir::new().unwrap();
        std::fs::write(dir.path().join("config.json"), json).unwrap();
        Qwen25VlConfig::from_model_dir(dir.path())
    }

    /// Qwen2.5-VL-3B's released `vision_config`, as the hub ships it.
    const HUB_3B: &str = r#"{"model_type": "qwen2_5_vl", "vision_config": {"depth": 32,
        "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
        "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2, "temporal_patch_size": 2}}"#;

    #[test]
    fn the_released_3b_config_parses() {
        let config = parse(HUB_3B).unwrap();
        assert_eq!(config.embed_dim, 1280);
        assert_eq!(config.head_dim(), 80);
        assert_eq!(config.window_units(), 4);
        assert_eq!(config.fullatt_block_indexes, [7, 15, 23, 31]);
        assert_eq!(config.layout().patch_len(), 1176);
        let targets = config.lora_targets();
        assert_eq!(targets.len(), 5 * 32 + 2);
        assert_eq!(
            (targets[2].path.as_str(), targets[2].out_features),
            ("blocks.0.mlp.gate_proj", 3420)
        );
        assert!(targets.last().unwrap().connector);
    }

    /// What Qwen2.5-VL cannot run is refused naming the file and the key.
    #[test]
    fn bad_shapes_are_refused_by_key() {
        for (from, to, says) in [
            (
                "\"window_size\": 112",
                "\"window_size\": 100",
                "window_size 100 is not a whole",
            ),
            (
                "[7, 15, 23, 31]",
                "[7, 32]",
                "fullatt_block_indexes names block 32",
            ),
            (
                "\"hidden_act\": \"silu\"",
                "\"hidden_act\": \"gelu\"",
                "hidden_act is gelu",
            ),
            ("\"num_heads\": 16", "\"num_heads\": 0", "num_heads is 0"),
            ("\"qwen2_5_vl\"", "\"qwen3_vl\"", "model_type is qwen3_vl"),
        ] {
            let error = parse(&HUB_3B.replace(from, to)).unwrap_err().to_string();
            assert!(error.contains(says), "{to}: {error}");
            assert!(error.contains("config.json"), "{to}: {error}");
        }
    }
}
