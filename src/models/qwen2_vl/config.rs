//! The vision part of a Qwen2-VL `config.json`.

use std::path::Path;

use serde::Deserialize;

use crate::models::error::ConfigError;
use crate::models::qwen_vision::config::{
    PatchFields, RopeFields, VisionSection, check_heads, check_sizes, lora_targets, merger_targets,
    patch_sizes,
};
use crate::models::tower::{LoraTarget, PatchLayout};

/// The vision tower's shape (`vision_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Transformer blocks.
    pub depth: usize,
    /// Width of the tower.
    pub embed_dim: usize,
    /// Width of the connector's output (the language model's hidden size).
    pub hidden_size: usize,
    /// MLP width as a multiple of `embed_dim`.
    pub mlp_ratio: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Input channels.
    pub in_channels: usize,
    /// Patch side.
    pub patch_size: usize,
    /// Side of the merge block.
    pub spatial_merge_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Activation of the MLP.
    pub hidden_act: String,
    /// Base of the rotary position embedding's frequencies (`rope_parameters.rope_theta`).
    pub rope_theta: f32,
}

pub use crate::models::qwen_vision::config::DEFAULT_ROPE_THETA;

/// `vision_config` as written on the hub (`in_chans`, `spatial_patch_size`) or by transformers
/// (`in_channels`, `patch_size`); hub files carry both patch spellings.
#[derive(Deserialize)]
struct RawVision {
    depth: usize,
    embed_dim: usize,
    hidden_size: usize,
    mlp_ratio: Option<usize>,
    num_heads: usize,
    #[serde(flatten)]
    patch: PatchFields,
    hidden_act: Option<String>,
    #[serde(flatten)]
    rope: RopeFields,
}

impl RawVision {
    /// The config these fields give, with the rotary base read by [`Self::rope_theta`].
    fn into_config(self, rope_theta: f32) -> VisionConfig {
        let layout = self.patch.layout(14);
        VisionConfig {
            depth: self.depth,
            embed_dim: self.embed_dim,
            hidden_size: self.hidden_size,
            mlp_ratio: self.mlp_ratio.unwrap_or(4),
            num_heads: self.num_heads,
            in_channels: layout.in_channels,
            patch_size: layout.patch_size,
            spatial_merge_size: layout.spatial_merge_size,
            temporal_patch_size: layout.temporal_patch_size,
            hidden_act: self.hidden_act.unwrap_or_else(|| "quick_gelu".to_owned()),
            rope_theta,
        }
    }
}

impl VisionConfig {
    /// The bundled test model's shape: 2 blocks, width 32, 2 heads, merger to 48.
    pub fn tiny() -> Self {
        Self {
            depth: 2,
            embed_dim: 32,
            hidden_size: 48,
            mlp_ratio: 4,
            num_heads: 2,
            in_channels: 3,
            patch_size: 14,
            spatial_merge_size: 2,
            temporal_patch_size: 2,
            hidden_act: "quick_gelu".to_owned(),
            rope_theta: DEFAULT_ROPE_THETA,
        }
    }

    /// Reads `dir/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, ConfigError> {
        let section = VisionSection::read(dir, &["qwen2_vl"])?;
        let (at, invalid) = (section.at, |reason: String| section.invalid(reason));
        let raw: RawVision = section.parse()?;
        let rope_theta = section.rope_theta(&raw.rope)?;
        let config = raw.into_config(rope_theta);
        config
            .check()
            .map_err(|reason| invalid(format!("{at}{reason}")))?;
        if config.hidden_act != "quick_gelu" {
            return Err(invalid(format!(
                "hidden_act {} is not supported (quick_gelu is)",
                config.hidden_act
            )));
        }
        Ok(config)
    }

    /// Why this shape cannot run, naming the key: a size that is zero or beyond what any
    /// real tower uses (and what sizes computed from it could hold), or heads the attention
    /// kernels cannot read.
    fn check(&self) -> Result<(), String> {
        check_sizes(&[
            ("depth", self.depth, 1024),
            ("embed_dim", self.embed_dim, 1 << 16),
            ("hidden_size", self.hidden_size, 1 << 17),
            ("mlp_ratio", self.mlp_ratio, 64),
            ("num_heads", self.num_heads, 1024),
        ])?;
        check_sizes(&patch_sizes(self.layout()))?;
        check_heads("embed_dim", self.embed_dim, self.num_heads)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.num_heads
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

    /// Values per patch row.
    pub fn patch_len(&self) -> usize {
        self.layout().patch_len()
    }

    /// Every LoRA target linear of a model of this shape, in a fixed order: each block's
    /// `attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2`, then `merger.mlp.0` and `merger.mlp.2`.
    pub fn lora_targets(&self) -> Vec<LoraTarget> {
        let (d, mlp) = (self.embed_dim, self.embed_dim * self.mlp_ratio);
        let block = [
            ("attn.qkv", d, 3 * d),
            ("attn.proj", d, d),
            ("mlp.fc1", d, mlp),
            ("mlp.fc2", mlp, d),
        ];
        let merged = d * self.spatial_merge_size * self.spatial_merge_size;
        lora_targets(self.depth, &block, merger_targets(merged, self.hidden_size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<VisionConfig, ConfigError> {
        let dir = tempfile::TempDir::new().unwrap();
        std::fs::write(dir.path().join("config.json"), json).unwrap();
        VisionConfig::from_model_dir(dir.path())
    }

    #[test]
    fn target_kinds_drop_the_block_index() {
        assert_eq!(LoraTarget::kind("blocks.31.mlp.fc2"), "mlp.fc2");
        assert_eq!(LoraTarget::kind("merger.mlp.0"), "merger.mlp.0");
    }

    #[test]
    fn hub_and_transformers_spellings_both_parse() {
        // The hub's Qwen2-VL-2B file carries `patch_size` and `spatial_patch_size` together.
        let hub = parse(
            r#"{"model_type": "qwen2_vl", "vision_config": {"depth": 32, "embed_dim": 1280,
            "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 1536,
            "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
            "temporal_patch_size": 2}}"#,
        )
        .unwrap();
        let transformers = parse(
            r#"{"model_type": "qwen2_vl", "vision_config": {"depth": 32, "embed_dim": 1280,
            "num_heads": 16, "in_channels": 3, "hidden_size": 1536, "hidden_act": "quick_gelu"}}"#,
        )
        .unwrap();
        assert_eq!(hub, transformers);
        assert_eq!((hub.head_dim(), hub.patch_len()), (80, 1176));
    }

    #[test]
    fn the_rotary_base_is_read_in_both_spellings() {
        let with = |vision_extra: &str| {
            parse(&format!(
                r#"{{"model_type": "qwen2_vl", "vision_config": {{"depth": 2, "embed_dim": 32,
                "num_heads": 2, "hidden_size": 48{vision_extra}}}}}"#
            ))
        };
        assert_eq!(with("").unwrap().rope_theta, DEFAULT_ROPE_THETA);
        let theta = |extra| with(extra).unwrap().rope_theta;
        assert_eq!(theta(r#", "rope_theta": 100.0"#), 100.0);
        assert_eq!(
            theta(r#", "rope_parameters": {"rope_theta": 50.0, "rope_type": "axial"}"#),
            50.0
        );
        // As transformers 5.23 saves a config given `type`: both keys; `default` is axial for
        // old checkpoints; `rope_scaling` wins over `rope_parameters`.
        let both =
            r#", "rope_parameters": {"rope_theta": 20.0, "rope_type": "axial", "type": "axial"}"#;
        assert_eq!(theta(both), 20.0);
        assert_eq!(
            theta(r#", "rope_parameters": {"type": "default"}, "rope_theta": 30.0"#),
            30.0
        );
        assert_eq!(
            theta(
                r#", "rope_scaling": {"rope_theta": 40.0}, "rope_parameters": {"rope_theta": 5.0}"#
            ),
            40.0
        );
        for (extra, says) in [
            (
                r#", "rope_parameters": {"rope_type": "yarn"}"#,
                "vision_config.rope_parameters.rope_type is yarn",
            ),
            (
                r#", "rope_parameters": {"rope_theta": -1.0}"#,
                "vision_config.rope_parameters.rope_theta is -1",
            ),
            (r#", "rope_theta": -1.0"#, "vision_config.rope_theta is -1"),
        ] {
            let error = with(extra).unwrap_err().to_string();
            assert!(error.contains(says), "{extra}: {error}");
        }
    }

    /// A tower saved alone has its fields at the top, and errors name them there.
    #[test]
    fn a_tower_alone_is_read_from_the_top() {
        let tower = r#"{"model_type": "qwen2_vl_vision", "depth": 2, "embed_dim": 32,
            "num_heads": 2, "hidden_size": 48, "rope_parameters": {"rope_theta": 10000.0}}"#;
        assert_eq!(parse(tower).unwrap().depth, 2);
        let error = parse(&tower.replace(r#""depth": 2"#, r#""depth": 0"#)).unwrap_err();
        assert!(error.to_string().contains(": depth is 0"), "{error}");
    }

    #[test]
    fn other_models_and_odd_shapes_are_refused() {
        let error = parse(r#"{"model_type": "llava"}"#).unwrap_err();
        assert!(error.to_string().contains("llava"), "{error}");
        // Qwen2.5-VL's vision_config has no embed_dim: the model type is what is wrong.
        let error = parse(
            r#"{"model_type": "qwen2_5_vl", "vision_config": {"depth": 32, "hidden_size": 1280,
            "out_hidden_size": 3584}}"#,
        )
        .unwrap_err();
        assert!(
            error.to_string().contains("model_type is qwen2_5_vl"),
            "{error}"
        );
        let error = parse(
            r#"{"model_type": "qwen2_vl", "vision_config": {"depth": 1, "embed_dim": 30,
            "num_heads": 3, "hidden_size": 8}}"#,
        )
        .unwrap_err();
        assert!(error.to_string().contains("divisible by 4"), "{error}");
        assert!(parse("{").is_err());
    }
}
