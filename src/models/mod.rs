//! Vision towers and connectors, and the checkpoints they load from: one folder per family
//! (`qwen2_vl`), each implementing [`VisionTower`], which is all the engine calls.

pub mod checkpoint;
pub mod error;
pub mod qwen2_vl;
pub mod tower;

use std::path::Path;

use burn::tensor::Device;

pub use error::{ConfigError, ModelError};
pub use tower::{LoraTarget, PatchLayout, VisionOutput, VisionTower};

/// The vision tower and connector of the model folder `dir` on `device`. The family is the one
/// `config.json`'s `model_type` names: today Qwen2-VL (`qwen2_vl`, or `qwen2_vl_vision` for the
/// tower saved alone); another is refused, naming the file.
pub fn load(dir: &Path, device: &Device) -> Result<Box<dyn VisionTower>, ModelError> {
    Ok(Box::new(qwen2_vl::Qwen2VlVision::load(dir, device)?))
}
