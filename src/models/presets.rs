//! Released models' tower shapes, built with random weights: what `mmlora bench --preset` and
//! the benchmarks time, a tower of the real shape and layers without a download.

use burn::tensor::Device;

use crate::models::qwen_vision::config::DEFAULT_ROPE_THETA;
use crate::models::qwen2_5_vl::{Qwen25VlConfig, Qwen25VlVision};
use crate::models::qwen2_vl::{Qwen2VlVision, VisionConfig};
use crate::models::qwen3_vl::{Qwen3VlConfig, Qwen3VlVision};
use crate::models::tower::{PatchLayout, VisionTower};
use crate::named::named_choice;

named_choice! {
    /// A model shape with random weights: for tests and benchmarks.
    pub enum Preset {
        /// The bundled test model's shape (Qwen2-VL's): 2 blocks, width 32.
        Tiny,
        /// Qwen2-VL-2B's vision tower and merger: 32 blocks, width 1280, 16 heads, MLP 5120,
        /// merger to 1536.
        #[strum(serialize = "qwen2-vl-2b")]
        Qwen2Vl2b,
        /// Qwen2.5-VL-3B's: 32 blocks (4 of full attention, the others in windows of 112 px),
        /// width 1280, 16 heads, SwiGLU MLP 3420, merger to 2048.
        #[strum(serialize = "qwen2.5-vl-3b")]
        Qwen25Vl3b,
        /// Qwen2.5-VL-7B's: Qwen2.5-VL-3B's tower, merger to 3584.
        #[strum(serialize = "qwen2.5-vl-7b")]
        Qwen25Vl7b,
        /// Qwen3-VL-2B's: 24 blocks, width 1024, 16 heads, MLP 4096, patches of 16, mergers to
        /// 2048 (deepstack after blocks 5, 11, 17).
        #[strum(serialize = "qwen3-vl-2b")]
        Qwen3Vl2b,
        /// Qwen3-VL-8B's: 27 blocks, width 1152, 16 heads, MLP 4304, patches of 16, mergers to
        /// 4096 (deepstack after blocks 8, 16, 24).
        #[strum(serialize = "qwen3-vl-8b")]
        Qwen3Vl8b,
    }
}

/// A preset's config, of its family.
#[derive(Debug, Clone, PartialEq)]
pub enum PresetConfig {
    /// A Qwen2-VL tower's.
    Qwen2Vl(VisionConfig),
    /// A Qwen2.5-VL tower's.
    Qwen25Vl(Qwen25VlConfig),
    /// A Qwen3-VL tower's.
    Qwen3Vl(Qwen3VlConfig),
}

impl Preset {
    /// Its config.
    pub fn config(self) -> PresetConfig {
        match self {
            Self::Tiny => PresetConfig::Qwen2Vl(VisionConfig::tiny()),
            Self::Qwen2Vl2b => PresetConfig::Qwen2Vl(qwen2_vl_2b()),
            Self::Qwen25Vl3b => PresetConfig::Qwen25Vl(qwen2_5_vl(2048)),
            Self::Qwen25Vl7b => PresetConfig::Qwen25Vl(qwen2_5_vl(3584)),
            Self::Qwen3Vl2b => {
                PresetConfig::Qwen3Vl(qwen3_vl((24, 1024, 4096, 2048), vec![5, 11, 17]))
            }
            Self::Qwen3Vl8b => {
                PresetConfig::Qwen3Vl(qwen3_vl((27, 1152, 4304, 4096), vec![8, 16, 24]))
            }
        }
    }

    /// A tower of this shape with random weights on `device`.
    pub fn random(self, device: &Device) -> Box<dyn VisionTower> {
        match self.config() {
            PresetConfig::Qwen2Vl(config) => Box::new(Qwen2VlVision::random(config, device)),
            PresetConfig::Qwen25Vl(config) => Box::new(Qwen25VlVision::random(config, device)),
            PresetConfig::Qwen3Vl(config) => Box::new(Qwen3VlVision::random(config, device)),
        }
    }

    /// How its tower cuts and merges patches.
    pub fn layout(self) -> PatchLayout {
        match self.config() {
            PresetConfig::Qwen2Vl(config) => config.layout(),
            PresetConfig::Qwen25Vl(config) => config.layout(),
            PresetConfig::Qwen3Vl(config) => config.layout(),
        }
    }

    /// Width of its tower.
    pub fn embed_dim(self) -> usize {
        match self.config() {
            PresetConfig::Qwen2Vl(config) => config.embed_dim,
            PresetConfig::Qwen25Vl(config) => config.embed_dim,
            PresetConfig::Qwen3Vl(config) => config.embed_dim,
        }
    }
}

/// Qwen2-VL-2B's vision config.
pub fn qwen2_vl_2b() -> VisionConfig {
    VisionConfig {
        depth: 32,
        embed_dim: 1280,
        hidden_size: 1536,
        num_heads: 16,
        ..VisionConfig::tiny()
    }
}

/// Qwen2.5-VL's released vision config, its merger to `out_hidden_size`.
fn qwen2_5_vl(out_hidden_size: usize) -> Qwen25VlConfig {
    Qwen25VlConfig {
        depth: 32,
        embed_dim: 1280,
        intermediate_size: 3420,
        num_heads: 16,
        out_hidden_size,
        in_channels: 3,
        patch_size: 14,
        spatial_merge_size: 2,
        temporal_patch_size: 2,
        window_size: 112,
        fullatt_block_indexes: vec![7, 15, 23, 31],
        rope_theta: DEFAULT_ROPE_THETA,
    }
}

/// A released Qwen3-VL vision config: `(depth, hidden_size, intermediate_size,
/// out_hidden_size)`, its deepstack blocks.
fn qwen3_vl(
    (depth, embed_dim, intermediate_size, out_hidden_size): (usize, usize, usize, usize),
    deepstack_visual_indexes: Vec<usize>,
) -> Qwen3VlConfig {
    Qwen3VlConfig {
        depth,
        embed_dim,
        intermediate_size,
        num_heads: 16,
        out_hidden_size,
        in_channels: 3,
        patch_size: 16,
        spatial_merge_size: 2,
        temporal_patch_size: 2,
        num_position_embeddings: 2304,
        deepstack_visual_indexes,
        rope_theta: DEFAULT_ROPE_THETA,
    }
}
