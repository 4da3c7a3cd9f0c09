//! Model shapes to build with random weights, for tests and benchmarks.

use super::{DEFAULT_ROPE_THETA, VisionConfig};

/// A model shape with random weights: for tests and benchmarks.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    strum::Display,
    strum::IntoStaticStr,
    strum::EnumString,
    strum::VariantArray,
    strum::VariantNames,
    strum::EnumMessage,
)]
#[strum(serialize_all = "kebab-case")]
pub enum Preset {
    /// The bundled test model's shape: 2 blocks, width 32.
    Tiny,
    /// Qwen2-VL-2B's vision tower and merger: 32 blocks, width 1280, 16 heads, MLP 5120,
    /// merger to 1536.
    #[strum(serialize = "qwen2-vl-2b")]
    Qwen2Vl2b,
}

impl Preset {
    /// Its vision config.
    pub fn config(self) -> VisionConfig {
        let (depth, embed_dim, num_heads, hidden_size) = match self {
            Self::Tiny => (2, 32, 2, 48),
            Self::Qwen2Vl2b => (32, 1280, 16, 1536),
        };
        VisionConfig {
            depth,
            embed_dim,
            hidden_size,
            mlp_ratio: 4,
            num_heads,
            in_channels: 3,
            patch_size: 14,
            spatial_merge_size: 2,
            temporal_patch_size: 2,
            hidden_act: "quick_gelu".to_owned(),
            rope_theta: DEFAULT_ROPE_THETA,
        }
    }
}
