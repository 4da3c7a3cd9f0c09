//! The vision part of a Qwen3-VL `config.json` (also Qwen3-VL-MoE's, and Qwen3.5's, whose
//! tower is Qwen3-VL's without deepstack mergers).

use std::path::Path;

use serde::Deserialize;

use crate::models::error::ConfigError;
use crate::models::qwen_vision::config::{
    PatchFields, RopeFields, VisionSection, check_blocks, check_heads, check_sizes, lora_targets,
    patch_sizes,
};
use crate::models::tower::{LoraTarget, PatchLayout};

/// The model types whose tower this is, as `config.json` names them.
pub const MODEL_TYPES: [&str; 4] = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"];

/// The tower's shape (`vision_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3VlConfig {
    /// Transformer blocks.
    pub depth: usize,
    /// Width of the tower (`hidden_size`).
    pub embed_dim: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Width of the mergers' outputs (`out_hidden_size`: the language model's).
    pub out_hidden_size: usize,
    /// Input channels.
    pub in_channels: usize,
    /// Patch side.
    pub patch_size: usize,
    /// Side of the merge block.
    pub spatial_merge_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Rows of the learned position table, a square grid interpolated to each image's.
    pub num_position_embeddings: usize,
    /// The blocks after which a deepstack merger reads the hidden states, one merger each.
    pub deepstack_visual_indexes: Vec<usize>,
    /// Base of the rotary position embedding's frequencies.
    pub rope_theta: f32,
}

/// `vision_config` as the hub and transformers write it.
#[derive(Deserialize)]
struct RawVision {
    depth: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_heads: usize,
    out_hidden_size: usize,
    #[serde(flatten)]
    patch: PatchFields,
    num_position_embeddings: Option<usize>,
    deepstack_visual_indexes: Option<Vec<usize>>,
    hidden_act: Option<String>,
    #[serde(flatten)]
    rope: RopeFields,
}

/// transformers' `deepstack_visual_indexes` where a Qwen3-VL config gives none.
const DEFAULT_DEEPSTACK: [usize; 3] = [8, 16, 24];

impl Qwen3VlConfig {
    /// Reads `dir/config.json` (`model_type` one of [`MODEL_TYPES`], or that with `_vision`
    /// for the tower saved alone).
    pub fn from_model_dir(dir: &Path) -> Result<Self, ConfigError> {
        let section = VisionSection::read(dir, &MODEL_TYPES)?;
        let at = section.at;
        let raw: RawVision = section.parse()?;
        let rope_theta = section.rope_theta(&raw.rope)?;
        let act = raw.hidden_act.as_deref().unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(section.invalid(format!(
                "{at}hidden_act is {act}; Qwen3-VL's MLP runs gelu_pytorch_tanh"
            )));
        }
        // Qwen3.5's tower has no deepstack mergers (its config has no such field).
        let qwen3_5 = section.model_type.starts_with("qwen3_5");
        let deepstack_visual_indexes = match raw.deepstack_visual_indexes {
            Some(indexes) if qwen3_5 && !indexes.is_empty() => {
                return Err(section.invalid(format!(
                    "{at}deepstack_visual_indexes is {indexes:?}; {}'s tower has no deepstack \
                     mergers",
                    section.model_type
                )));
            }
            Some(indexes) => indexes,
            None if qwen3_5 => Vec::new(),
            None => DEFAULT_DEEPSTACK.to_vec(),
        };
        let layout = raw.patch.layout(16);
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
            num_position_embeddings: raw.num_position_embeddings.unwrap_or(2304),
            deepstack_visual_indexes,
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
            (
                "num_position_embeddings",
                self.num_position_embeddings,
                1 << 20,
            ),
        ])?;
        check_sizes(&patch_sizes(self.layout()))?;
        check_heads("hidden_size", self.embed_dim, self.num_heads)?;
        let side = self.position_side();
        if side * side != self.num_position_embeddings {
            return Err(format!(
                "num_position_embeddings {} is not a square grid of positions",
                self.num_position_embeddings
            ));
        }
        let deepstack = &self.deepstack_visual_indexes;
        check_blocks("deepstack_visual_indexes", deepstack, self.depth)?;
        for (at, &index) in deepstack.iter().enumerate() {
            if deepstack[..at].contains(&index) {
                return Err(format!(
                    "deepstack_visual_indexes names block {index} twice"
                ));
            }
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.num_heads
    }

    /// Side of the learned position table's grid (√`num_position_embeddings`, rounded down).
    pub fn position_side(&self) -> usize {
        self.num_position_embeddings.isqrt()
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

    /// Width of a merged row: a merge block's rows side by side.
    pub fn merged_width(&self) -> usize {
        self.embed_dim * self.spatial_merge_size * self.spatial_merge_size
    }

    /// Every LoRA target linear, in a fixed order: each block's `attn.qkv`, `attn.proj`,
    /// `mlp.linear_fc1`, `mlp.linear_fc2`; then the connector's: `merger.linear_fc1`,
    /// `merger.linear_fc2`, and each deepstack merger's (`deepstack_merger_list.{j}.…`).
    pub fn lora_targets(&self) -> Vec<LoraTarget> {
        let (d, mlp) = (self.embed_dim, self.intermediate_size);
        let block = [
            ("attn.qkv", d, 3 * d),
            ("attn.proj", d, d),
            ("mlp.linear_fc1", d, mlp),
            ("mlp.linear_fc2", mlp, d),
        ];
        let (merged, out) = (self.merged_width(), self.out_hidden_size);
        let mergers = self
            .merger_prefixes()
            .into_iter()
            .flat_map(|prefix| {
                [
                    (format!("{prefix}.linear_fc1"), merged, merged),
                    (format!("{prefix}.linear_fc2"), merged, out),
                ]
            })
            .collect();
        lora_targets(self.depth, &block, mergers)
    }

    /// The main merger's path, then each deepstack merger's.
    pub fn merger_prefixes(&self) -> Vec<String> {
        let deepstack =
            (0..self.deepstack_visual_indexes.len()).map(|j| format!("deepstack_merger_list.{j}"));
        std::iter::once("merger".to_owned())
            .chain(deepstack)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Qwen3VlConfig, ConfigError> {
        let dir = tempfile::TempDir::new().unwrap();
        std::fs::write(dir.path().join("config.json"), json).unwrap();
        Qwen3VlConfig::from_model_dir(dir.path())
    }

    /// Qwen3-VL-2B's released `config.json`, as the hub ships it (text fields cut).
    const HUB_2B: &str = r#"{"architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl", "text_config": {"hidden_size": 2048,
        "model_type": "qwen3_vl_text"}, "vision_config": {"deepstack_visual_indexes": [5, 11, 17],
        "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024, "in_channels": 3,
        "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}}"#;

    #[test]
    fn the_released_2b_config_parses() {
        let config = parse(HUB_2B).unwrap();
        assert_eq!(config.head_dim(), 64);
        assert_eq!(config.position_side(), 48);
        assert_eq!(config.deepstack_visual_indexes, [5, 11, 17]);
        assert_eq!(config.layout().patch_len(), 1536);
        let targets = config.lora_targets();
        assert_eq!(targets.len(), 4 * 24 + 2 * 4);
        assert_eq!(
            (targets[2].path.as_str(), targets[2].out_features),
            ("blocks.0.mlp.linear_fc1", 4096)
        );
        let last = targets.last().unwrap();
        assert_eq!(
            (last.path.as_str(), last.in_features, last.out_features),
            ("deepstack_merger_list.2.linear_fc2", 4096, 2048)
        );
        assert!(targets[4 * 24..].iter().all(|t| t.connector));
    }

    /// Qwen3.5's tower has no deepstack mergers; Qwen3-VL-MoE's reads as Qwen3-VL's.
    #[test]
    fn qwen3_5_has_no_deepstack_and_moe_reads_alike() {
        let qwen3_5 = HUB_2B
            .replace("\"deepstack_visual_indexes\": [5, 11, 17],", "")
            .replacen("\"qwen3_vl\"", "\"qwen3_5\"", 1);
        let config = parse(&qwen3_5).unwrap();
        assert!(config.deepstack_visual_indexes.is_empty());
        assert_eq!(config.lora_targets().len(), 4 * 24 + 2);
        let error = parse(&HUB_2B.replacen("\"qwen3_vl\"", "\"qwen3_5\"", 1)).unwrap_err();
        assert!(
            error.to_string().contains("no deepstack mergers"),
            "{error}"
        );
        let moe = parse(&HUB_2B.replacen("\"qwen3_vl\"", "\"qwen3_vl_moe\"", 1)).unwrap();
        assert_eq!(moe, parse(HUB_2B).unwrap());
    }

    /// What Qwen3-VL cannot run is refused naming the file and the key.
    #[test]
    fn bad_shapes_are_refused_by_key() {
        for (from, to, says) in [
            (
                "\"num_position_embeddings\": 2304",
                "\"num_position_embeddings\": 2300",
                "num_position_embeddings 2300 is not a square",
            ),
            (
                "[5, 11, 17]",
                "[5, 24]",
                "deepstack_visual_indexes names block 24, and there are 24",
            ),
            (
                "[5, 11, 17]",
                "[5, 11, 5]",
                "deepstack_visual_indexes names block 5 twice",
            ),
            (
                "\"hidden_act\": \"gelu_pytorch_tanh\"",
                "\"hidden_act\": \"silu\"",
                "hidden_act is silu",
            ),
            ("\"num_heads\": 16", "\"num_heads\": 0", "num_heads is 0"),
            (
                "\"model_type\": \"qwen3_vl\", \"text_config\"",
                "\"model_type\": \"qwen2_vl\", \"text_config\"",
                "model_type is qwen2_vl",
            ),
        ] {
            let json = HUB_2B.replace(from, to);
            assert_ne!(json, HUB_2B, "{from}");
            let error = parse(&json).unwrap_err().to_string();
            assert!(error.contains(says), "{to}: {error}");
            assert!(error.contains("config.json"), "{to}: {error}");
        }
    }
}
