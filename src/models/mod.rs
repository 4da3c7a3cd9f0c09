//! Vision towers and connectors, and the checkpoints they load from: one folder per family
//! (`qwen2_vl`, `qwen2_5_vl`; what they share in `qwen_vision`), each implementing
//! [`VisionTower`], which is all the engine calls.

pub mod checkpoint;
pub mod error;
pub mod qwen2_5_vl;
pub mod qwen2_vl;
pub(crate) mod qwen_vision;
pub mod tower;

use std::path::Path;

use burn::tensor::Device;

pub use error::{ConfigError, ModelError};
pub use tower::{LoraTarget, PatchLayout, VisionOutput, VisionTower};

/// The LoRA targets of the model in `dir`, from its `config.json` alone (no weights read).
pub fn lora_targets(dir: &Path) -> Result<Vec<LoraTarget>, ConfigError> {
    match qwen_vision::config::model_type(dir)?.as_deref() {
        Some("qwen2_5_vl" | "qwen2_5_vl_vision") => {
            Ok(qwen2_5_vl::Qwen25VlConfig::from_model_dir(dir)?.lora_targets())
        }
        _ => Ok(qwen2_vl::VisionConfig::from_model_dir(dir)?.lora_targets()),
    }
}

/// The vision tower and connector of the model folder `dir` on `device`, of the family
/// `config.json`'s `model_type` names: Qwen2-VL (`qwen2_vl`) or Qwen2.5-VL (`qwen2_5_vl`), or
/// either tower saved alone (`qwen2_vl_vision`, `qwen2_5_vl_vision`); another is refused,
/// naming the file.
pub fn load(dir: &Path, device: &Device) -> Result<Box<dyn VisionTower>, ModelError> {
    match qwen_vision::config::model_type(dir)?.as_deref() {
        Some("qwen2_5_vl" | "qwen2_5_vl_vision") => {
            Ok(Box::new(qwen2_5_vl::Qwen25VlVision::load(dir, device)?))
        }
        // Qwen2-VL's, or the error naming what the file holds.
        _ => Ok(Box::new(qwen2_vl::Qwen2VlVision::load(dir, device)?)),
    }
}
