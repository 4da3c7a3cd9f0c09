//! Reading a Qwen vision tower's section of `config.json`: where it sits for each `model_type`,
//! errors that name the file and key, and the rotary base.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::models::error::ConfigError;
use crate::models::tower::{LoraTarget, PatchLayout};

/// transformers' rotary base when a config gives none.
pub const DEFAULT_ROPE_THETA: f32 = 10_000.0;

/// The model types mmlora runs, whole models and towers saved alone, as errors list them.
pub(crate) const MODEL_TYPES: &str = "qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, \
     qwen3_5_moe (or their towers alone: the same with _vision)";

#[derive(Deserialize)]
struct ConfigFile {
    model_type: Option<String>,
    /// The tower's fields in a whole model's config.
    vision_config: Option<serde_json::Value>,
    /// A tower saved alone has its fields at the top.
    #[serde(flatten)]
    top: serde_json::Map<String, serde_json::Value>,
}

/// The `model_type` of `dir/config.json` (`None` where it has none).
pub(crate) fn model_type(dir: &Path) -> Result<Option<String>, ConfigError> {
    Ok(read(dir)?.1.model_type)
}

fn read(dir: &Path) -> Result<(PathBuf, ConfigFile), ConfigError> {
    let path = dir.join("config.json");
    let text = crate::vfs::read_to_string(&path).map_err(|source| ConfigError::Io {
        path: path.clone(),
        source,
    })?;
    let file = serde_json::from_str(&text).map_err(|e| ConfigError::Invalid {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    Ok((path, file))
}

/// A tower's fields in `config.json`, with the file and the path to them for errors.
pub(crate) struct VisionSection {
    path: PathBuf,
    value: serde_json::Value,
    /// `vision_config.` in a whole model's config, empty for a tower saved alone.
    pub at: &'static str,
    /// The one of the `model_types` read that the file has (without `_vision`).
    pub model_type: &'static str,
}

impl VisionSection {
    /// The tower's fields of `dir/config.json`, whose `model_type` must be one of
    /// `model_types` (the whole model, fields under `vision_config`) or that with `_vision`
    /// (the tower alone, at the top).
    pub(crate) fn read(dir: &Path, model_types: &[&'static str]) -> Result<Self, ConfigError> {
        let (path, file) = read(dir)?;
        let invalid = |reason: String| ConfigError::Invalid {
            path: path.clone(),
            reason,
        };
        let found = file.model_type.as_deref().and_then(|t| {
            let alone = t.strip_suffix("_vision");
            let known = model_types.iter().find(|&&m| m == alone.unwrap_or(t))?;
            Some((*known, alone.is_some()))
        });
        let (value, at, model_type) = match found {
            Some((model_type, false)) => (
                file.vision_config
                    .ok_or_else(|| invalid("no vision_config".to_owned()))?,
                "vision_config.",
                model_type,
            ),
            Some((model_type, true)) => (serde_json::Value::Object(file.top), "", model_type),
            None => {
                return Err(invalid(format!(
                    "model_type is {}; mmlora runs {MODEL_TYPES}",
                    file.model_type.as_deref().unwrap_or("missing")
                )));
            }
        };
        Ok(Self {
            path,
            value,
            at,
            model_type,
        })
    }

    /// An error about this file.
    pub(crate) fn invalid(&self, reason: String) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.clone(),
            reason,
        }
    }

    /// The fields as `T`; an error names the section.
    pub(crate) fn parse<T: DeserializeOwned>(&self) -> Result<T, ConfigError> {
        let section = self
            .at
            .strip_suffix('.')
            .map(|s| format!("{s}: "))
            .unwrap_or_default();
        T::deserialize(&self.value).map_err(|e| self.invalid(format!("{section}{e}")))
    }

    /// The rotary base `rope` gives, positive and finite.
    pub(crate) fn rope_theta(&self, rope: &RopeFields) -> Result<f32, ConfigError> {
        let at = self.at;
        let (theta, key) = rope.theta().map_err(|e| self.invalid(format!("{at}{e}")))?;
        if !(theta.is_finite() && theta > 0.0) {
            return Err(self.invalid(format!("{at}{key} is {theta}, not a positive number")));
        }
        Ok(theta)
    }
}

/// The LoRA targets of a Qwen tower of `depth` blocks, each with the linears `block` (name,
/// in, out), and the connector's linears `mergers` (path, in, out): blocks first, in order,
/// then the mergers'.
pub(crate) fn lora_targets(
    depth: usize,
    block: &[(&str, usize, usize)],
    mergers: Vec<(String, usize, usize)>,
) -> Vec<LoraTarget> {
    let target = |path: String, in_features, out_features, connector| LoraTarget {
        path,
        in_features,
        out_features,
        connector,
    };
    let blocks = (0..depth).flat_map(|i| {
        block
            .iter()
            .map(move |&(name, inp, out)| target(format!("blocks.{i}.{name}"), inp, out, false))
    });
    let mergers = mergers
        .into_iter()
        .map(|(path, inp, out)| target(path, inp, out, true));
    blocks.chain(mergers).collect()
}

/// The linears of Qwen2-VL's and Qwen2.5-VL's merger (`MERGER_LINEARS`), from `merged` to
/// `out_hidden`, for [`lora_targets`].
pub(crate) fn merger_targets(merged: usize, out_hidden: usize) -> Vec<(String, usize, usize)> {
    let [mlp0, mlp2] = crate::models::qwen_vision::MERGER_LINEARS;
    vec![
        (mlp0.to_owned(), merged, merged),
        (mlp2.to_owned(), merged, out_hidden),
    ]
}

/// The first of `sizes` (key, value, largest) that is zero or above its largest, said by key.
pub(crate) fn check_sizes(sizes: &[(&str, usize, usize)]) -> Result<(), String> {
    match sizes
        .iter()
        .find(|&&(_, value, max)| value == 0 || value > max)
    {
        Some((key, value, max)) => Err(format!("{key} is {value}, outside 1..={max}")),
        None => Ok(()),
    }
}

/// Refuses block indexes (`key`) past a tower of `depth` blocks.
pub(crate) fn check_blocks(key: &str, indexes: &[usize], depth: usize) -> Result<(), String> {
    match indexes.iter().find(|&&i| i >= depth) {
        Some(index) => Err(format!("{key} names block {index}, and there are {depth}")),
        None => Ok(()),
    }
}

/// Refuses a width (`key`) whose heads are not a whole multiple of 4 values each, as the
/// attention kernels read them.
pub(crate) fn check_heads(key: &str, width: usize, heads: usize) -> Result<(), String> {
    if width.is_multiple_of(heads) && (width / heads).is_multiple_of(4) {
        Ok(())
    } else {
        Err(format!(
            "{key} {width} over {heads} heads does not give a head width divisible by 4"
        ))
    }
}

/// How a `vision_config` gives its patches: as the hub (`in_chans`, `spatial_patch_size`) or
/// transformers (`in_channels`, `patch_size`) spells them (hub files carry both patch
/// spellings), transformers' defaults where absent.
#[derive(Deserialize)]
pub(crate) struct PatchFields {
    in_channels: Option<usize>,
    in_chans: Option<usize>,
    patch_size: Option<usize>,
    spatial_patch_size: Option<usize>,
    spatial_merge_size: Option<usize>,
    temporal_patch_size: Option<usize>,
}

impl PatchFields {
    /// The layout these fields give, with patches of `default_patch` pixels where they give
    /// no size (the family's default in transformers).
    pub(crate) fn layout(&self, default_patch: usize) -> PatchLayout {
        PatchLayout {
            in_channels: self.in_channels.or(self.in_chans).unwrap_or(3),
            patch_size: self
                .patch_size
                .or(self.spatial_patch_size)
                .unwrap_or(default_patch),
            spatial_merge_size: self.spatial_merge_size.unwrap_or(2),
            temporal_patch_size: self.temporal_patch_size.unwrap_or(2),
        }
    }
}

/// `layout`'s sizes with the largest each may be, for [`check_sizes`].
pub(crate) fn patch_sizes(layout: PatchLayout) -> [(&'static str, usize, usize); 4] {
    [
        ("in_channels", layout.in_channels, 16),
        ("patch_size", layout.patch_size, 256),
        ("spatial_merge_size", layout.spatial_merge_size, 16),
        ("temporal_patch_size", layout.temporal_patch_size, 16),
    ]
}

/// The rotary embedding's fields of a `vision_config`: transformers takes `rope_scaling` over
/// `rope_parameters`, and `rope_theta` beside them where they lack it.
#[derive(Deserialize)]
pub(crate) struct RopeFields {
    rope_scaling: Option<serde_json::Map<String, serde_json::Value>>,
    rope_parameters: Option<serde_json::Map<String, serde_json::Value>>,
    rope_theta: Option<f32>,
}

impl RopeFields {
    /// The rotary base, and where it was read (for errors), or why the rotary embedding is
    /// not the tower's axial one. transformers reads `rope_type` (else `type`) and takes
    /// `default` for `axial`, as old checkpoints write it.
    fn theta(&self) -> Result<(f32, String), String> {
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
