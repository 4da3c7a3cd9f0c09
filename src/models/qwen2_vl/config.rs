//! The vision part of a Qwen2-VL `config.json`.

use std::path::Path;

use serde::Deserialize;

use crate::models::error::ConfigError;
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

/// transformers' rotary base when a config gives none.
pub const DEFAULT_ROPE_THETA: f32 = 10_000.0;

/// `vision_config` as written on the hub (`in_chans`, `spatial_patch_size`) or by transformers
/// (`in_channels`, `patch_size`); hub files carry both patch spellings.
#[derive(Deserialize)]
struct RawVision {
    depth: usize,
    embed_dim: usize,
    hidden_size: usize,
    mlp_ratio: Option<usize>,
    num_heads: usize,
    in_channels: Option<usize>,
    in_chans: Option<usize>,
    patch_size: Option<usize>,
    spatial_patch_size: Option<usize>,
    spatial_merge_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    hidden_act: Option<String>,
    /// The rotary embedding's parameters: transformers takes `rope_scaling` over
    /// `rope_parameters`, and `rope_theta` beside them where they lack it.
    rope_scaling: Option<serde_json::Map<String, serde_json::Value>>,
    rope_parameters: Option<serde_json::Map<String, serde_json::Value>>,
    rope_theta: Option<f32>,
}

impl RawVision {
    /// The rotary base, and where it was read (for errors), or why the rotary embedding is
    /// not the tower's axial one. transformers reads `rope_type` (else `type`) and takes
    /// `default` for `axial`, as old checkpoints write it.
    fn rope_theta(&self) -> Result<(f32, String), String> {
        let params = [
            ("rope_scaling", &self.rope_scaling),
            ("rope_parameters", &self.rope_parameters),
        ]
        .into_iter()
        .find_map(|(name, params)| Some((name, params.as_ref()?)));
        let from_top = || {
            (
                self.rope_theta.unwrap_or(DEFAULT_ROPE_THETA),
                "rope_theta".to_owned(),
            )
        };
        let Some((name, params)) = params else {
            return Ok(from_top());
        };
        let rope_type = params.get("rope_type").or_else(|| params.get("type"));
        match rope_type.and_then(|t| t.as_str()).unwrap_or("default") {
            "default" | "axial" => {}
            other => {
                return Err(format!(
                    "{name}.rope_type is {other}; the tower's rotary embedding is axial"
                ));
            }
        }
        let Some(theta) = params.get("rope_theta") else {
            return Ok(from_top());
        };
        match theta.as_f64() {
            Some(value) => Ok((value as f32, format!("{name}.rope_theta"))),
            None => Err(format!("{name}.rope_theta is {theta}, not a number")),
        }
    }
}

impl RawVision {
    /// The config these fields give, with the rotary base read by [`Self::rope_theta`].
    fn into_config(self, rope_theta: f32) -> VisionConfig {
        VisionConfig {
            depth: self.depth,
            embed_dim: self.embed_dim,
            hidden_size: self.hidden_size,
            mlp_ratio: self.mlp_ratio.unwrap_or(4),
            num_heads: self.num_heads,
            in_channels: self.in_channels.or(self.in_chans).unwrap_or(3),
            patch_size: self.patch_size.or(self.spatial_patch_size).unwrap_or(14),
            spatial_merge_size: self.spatial_merge_size.unwrap_or(2),
            temporal_patch_size: self.temporal_patch_size.unwrap_or(2),
            hidden_act: self.hidden_act.unwrap_or_else(|| "quick_gelu".to_owned()),
            rope_theta,
        }
    }
}

#[derive(Deserialize)]
struct ConfigFile {
    model_type: Option<String>,
    /// Read as [`RawVision`] once `model_type` says it is Qwen2-VL's.
    vision_config: Option<serde_json::Value>,
    /// A tower saved alone (`qwen2_vl_vision`) has its fields at the top.
    #[serde(flatten)]
    top: serde_json::Map<String, serde_json::Value>,
}

impl VisionConfig {
    /// Reads `dir/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io {
            path: path.clone(),
            source,
        })?;
        let invalid = |reason: String| ConfigError::Invalid {
            path: path.clone(),
            reason,
        };
        let file: ConfigFile = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        // The vision fields, and the path to them for errors to name keys by.
        let (raw, at) = match file.model_type.as_deref() {
            Some("qwen2_vl") => (
                file.vision_config
                    .ok_or_else(|| invalid("no vision_config".to_owned()))?,
                "vision_config.",
            ),
            // The tower saved alone (`Qwen2VisionTransformerPretrainedModel`): at the top.
            Some("qwen2_vl_vision") => (serde_json::Value::Object(file.top), ""),
            other => {
                return Err(invalid(format!(
                    "model_type is {}; mmlora runs qwen2_vl (or its tower alone, \
                     qwen2_vl_vision)",
                    other.unwrap_or("missing")
                )));
            }
        };
        let section = at
            .strip_suffix('.')
            .map(|s| format!("{s}: "))
            .unwrap_or_default();
        let raw = RawVision::deserialize(raw).map_err(|e| invalid(format!("{section}{e}")))?;
        let (rope_theta, theta_key) = raw.rope_theta().map_err(|e| invalid(format!("{at}{e}")))?;
        let config = raw.into_config(rope_theta);
        if !(config.rope_theta.is_finite() && config.rope_theta > 0.0) {
            return Err(invalid(format!(
                "{at}{theta_key} is {}, not a positive number",
                config.rope_theta
            )));
        }
        if let Some((field, value, max)) = config.out_of_range() {
            return Err(invalid(format!(
                "{at}{field} is {value}, outside 1..={max}"
            )));
        }
        if !config.embed_dim.is_multiple_of(config.num_heads)
            || !(config.embed_dim / config.num_heads).is_multiple_of(4)
        {
            return Err(invalid(format!(
                "embed_dim {} over {} heads does not give a head width divisible by 4",
                config.embed_dim, config.num_heads
            )));
        }
        if config.hidden_act != "quick_gelu" {
            return Err(invalid(format!(
                "hidden_act {} is not supported (quick_gelu is)",
                config.hidden_act
            )));
        }
        Ok(config)
    }

    /// The first size that is zero or beyond what any real tower uses (and what sizes computed
    /// from it could hold), with its bound.
    fn out_of_range(&self) -> Option<(&'static str, usize, usize)> {
        [
            ("depth", self.depth, 1024),
            ("embed_dim", self.embed_dim, 1 << 16),
            ("hidden_size", self.hidden_size, 1 << 17),
            ("mlp_ratio", self.mlp_ratio, 64),
            ("num_heads", self.num_heads, 1024),
            ("in_channels", self.in_channels, 16),
            ("patch_size", self.patch_size, 256),
            ("spatial_merge_size", self.spatial_merge_size, 16),
            ("temporal_patch_size", self.temporal_patch_size, 16),
        ]
        .into_iter()
        .find(|&(_, value, max)| value == 0 || value > max)
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
        let d = self.embed_dim;
        let mlp = d * self.mlp_ratio;
        let merged = d * self.spatial_merge_size * self.spatial_merge_size;
        let target = |path: String, in_features, out_features, connector| LoraTarget {
            path,
            in_features,
            out_features,
            connector,
        };
        let mut targets = Vec::with_capacity(4 * self.depth + 2);
        for i in 0..self.depth {
            targets.push(target(format!("blocks.{i}.attn.qkv"), d, 3 * d, false));
            targets.push(target(format!("blocks.{i}.attn.proj"), d, d, false));
            targets.push(target(format!("blocks.{i}.mlp.fc1"), d, mlp, false));
            targets.push(target(format!("blocks.{i}.mlp.fc2"), mlp, d, false));
        }
        targets.push(target("merger.mlp.0".to_owned(), merged, merged, true));
        targets.push(target(
            "merger.mlp.2".to_owned(),
            merged,
            self.hidden_size,
            true,
        ));
        targets
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
