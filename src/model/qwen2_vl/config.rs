//! The vision part of a Qwen2-VL `config.json`.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The vision tower's shape (`vision_config`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct VisionConfig {
    /// Transformer blocks.
    pub depth: usize,
    /// Width of the tower.
    pub embed_dim: usize,
    /// Width of the connector's output (the language model's hidden size).
    pub hidden_size: usize,
    /// MLP width as a multiple of `embed_dim`.
    #[serde(default = "default_mlp_ratio")]
    pub mlp_ratio: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Input channels (`in_chans` on the hub).
    #[serde(alias = "in_chans", default = "default_in_channels")]
    pub in_channels: usize,
    /// Patch side (`spatial_patch_size` on the hub).
    #[serde(alias = "spatial_patch_size", default = "default_patch_size")]
    pub patch_size: usize,
    /// Side of the merge block.
    #[serde(default = "default_merge")]
    pub spatial_merge_size: usize,
    /// Frames per patch.
    #[serde(default = "default_temporal")]
    pub temporal_patch_size: usize,
    /// Activation of the MLP.
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

fn default_mlp_ratio() -> usize {
    4
}
fn default_in_channels() -> usize {
    3
}
fn default_patch_size() -> usize {
    14
}
fn default_merge() -> usize {
    2
}
fn default_temporal() -> usize {
    2
}
fn default_act() -> String {
    "quick_gelu".to_owned()
}

#[derive(Deserialize)]
struct ConfigFile {
    model_type: Option<String>,
    vision_config: Option<VisionConfig>,
}

/// Errors reading `config.json`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not the config of a supported model.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
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
        match file.model_type.as_deref() {
            Some("qwen2_vl") => {}
            other => {
                return Err(invalid(format!(
                    "model_type is {other:?}; mmlora runs qwen2_vl"
                )));
            }
        }
        let config = file
            .vision_config
            .ok_or_else(|| invalid("no vision_config".to_owned()))?;
        if config.num_heads == 0
            || config.embed_dim % config.num_heads != 0
            || (config.embed_dim / config.num_heads) % 4 != 0
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

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.num_heads
    }

    /// Values per patch row.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}
