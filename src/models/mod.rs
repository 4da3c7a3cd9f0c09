//! Vision towers and connectors, and the checkpoints they load from: one folder per family
//! (`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`; what they share in `qwen_vision`), each implementing
//! [`VisionTower`], which is all the engine calls.

pub(crate) mod checkpoint;
mod error;
pub mod presets;
pub mod qwen2_5_vl;
pub mod qwen2_vl;
pub mod qwen3_vl;
pub(crate) mod qwen_vision;
mod tower;

use std::path::Path;

use burn::tensor::Device;

pub use error::{ConfigError, ModelError};
pub use presets::Preset;
pub use tower::{LoraTarget, PatchLayout, VisionOutput, VisionTower};

/// The families mmlora runs: Qwen2-VL, Qwen2.5-VL, Qwen3-VL.
enum Family {
    Qwen2,
    Qwen25,
    Qwen3,
}

/// The family `dir/config.json`'s `model_type` names, its tower saved alone (`…_vision`)
/// included; Qwen2-VL's for any other, whose config reading names what the file holds.
fn family(dir: &Path) -> Result<Family, ConfigError> {
    let model_type = qwen_vision::config::model_type(dir)?;
    let model_type = model_type.as_deref().unwrap_or_default();
    let model_type = model_type.strip_suffix("_vision").unwrap_or(model_type);
    Ok(match model_type {
        "qwen2_5_vl" => Family::Qwen25,
        t if qwen3_vl::config::MODEL_TYPES.contains(&t) => Family::Qwen3,
        _ => Family::Qwen2,
    })
}

/// The LoRA targets of the model in `dir`, from its `config.json` alone (no weights read).
pub fn lora_targets(dir: &Path) -> Result<Vec<LoraTarget>, ConfigError> {
    Ok(match family(dir)? {
        Family::Qwen2 => qwen2_vl::VisionConfig::from_model_dir(dir)?.lora_targets(),
        Family::Qwen25 => qwen2_5_vl::Qwen25VlConfig::from_model_dir(dir)?.lora_targets(),
        Family::Qwen3 => qwen3_vl::Qwen3VlConfig::from_model_dir(dir)?.lora_targets(),
    })
}

/// The vision tower and connector of the model folder `dir` on `device`, of the family
/// `config.json`'s `model_type` names: Qwen2-VL (`qwen2_vl`), Qwen2.5-VL (`qwen2_5_vl`) or
/// Qwen3-VL (`qwen3_vl`, `qwen3_vl_moe`, and Qwen3.5's `qwen3_5`, `qwen3_5_moe`), or any of
/// their towers saved alone (`…_vision`); another is refused, naming the file.
pub fn load(dir: &Path, device: &Device) -> Result<Box<dyn VisionTower>, ModelError> {
    Ok(match family(dir)? {
        Family::Qwen2 => Box::new(qwen2_vl::Qwen2VlVision::load(dir, device)?),
        Family::Qwen25 => Box::new(qwen2_5_vl::Qwen25VlVision::load(dir, device)?),
        Family::Qwen3 => Box::new(qwen3_vl::Qwen3VlVision::load(dir, device)?),
    })
}
