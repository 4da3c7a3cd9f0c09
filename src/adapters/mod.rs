//! PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`, validated against
//! the model, with the scale folded into B, and stacked into the model's slots.
//!
//! Keys look like `base_model.model.visual.blocks.0.attn.qkv.lora_A.weight` (`[r, in]`) and
//! `….lora_B.weight` (`[out, r]`); newer transformers write `base_model.model.model.visual.…`,
//! and PEFT on the tower alone `base_model.model.blocks.…`. Keys outside the vision tower (a
//! language-model LoRA or `modules_to_save` in the same adapter) are not ours to run and are
//! skipped. Other PEFT methods, DoRA, LoRA variants whose forward differs, whole modules of the
//! tower (`modules_to_save`), bias training, initialisations that rewrite the base weights
//! (PiSSA and the like, unless converted), unknown modules, shapes that do not fit and ranks
//! above `max_rank` are refused with the adapter and key named.

mod config;
mod error;
mod install;
mod patterns;
pub(crate) mod registry;

pub use config::{AdapterConfig, TargetModules};
pub use error::AdapterError;
use error::{format_error, io_error};
pub use install::install;
use patterns::{Pattern, TargetFilter};

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

use crate::models::LoraTarget;
use crate::models::checkpoint::{float_values, safetensors_failure};

/// One module's LoRA with the scale folded into B.
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleLora {
    /// Rank.
    pub rank: usize,
    /// `[rank, in]`, row-major.
    pub a: Vec<f32>,
    /// `[out, rank]`, row-major, already multiplied by the scale.
    pub b: Vec<f32>,
    /// The scale that was folded in.
    pub scale: f64,
    /// The keys of `adapter_model.safetensors` that A and B were read from (`None` for a
    /// module built in memory), for errors to name.
    pub keys: Option<[String; 2]>,
}

/// A loaded, validated adapter.
#[derive(Debug, Clone)]
pub struct PeftAdapter {
    /// Its name.
    pub name: String,
    /// The folder it came from.
    pub dir: PathBuf,
    /// Its configuration.
    pub config: AdapterConfig,
    /// LoRA per target path (`blocks.0.attn.qkv`, `merger.mlp.0`, …).
    pub modules: BTreeMap<String, ModuleLora>,
}

impl PeftAdapter {
    /// Loads and validates the PEFT folder `dir` against `targets`, refusing ranks above
    /// `max_rank`.
    pub fn load(
        name: &str,
        dir: &Path,
        targets: &[LoraTarget],
        max_rank: usize,
    ) -> Result<Self, AdapterError> {
        let config = AdapterConfig::read(name, dir)?;
        let weights_path = dir.join("adapter_model.safetensors");
        let pickle = dir.join("adapter_model.bin");
        if !crate::vfs::exists(&weights_path) && crate::vfs::is_file(&pickle) {
            return Err(AdapterError::Unsupported {
                adapter: name.to_owned(),
                path: pickle,
                reason: "a pickled PyTorch file, which mmlora does not read: save the adapter \
                         as adapter_model.safetensors (PEFT's save_pretrained does by default)"
                    .to_owned(),
            });
        }
        let bytes = crate::vfs::read(&weights_path).map_err(io_error(name, &weights_path))?;
        Self::from_safetensors(name, dir, config, &bytes, targets, max_rank)
    }

    /// Builds and validates adapter `name` of folder `dir` from its parsed configuration and the
    /// bytes of its `adapter_model.safetensors`.
    pub fn from_safetensors(
        name: &str,
        dir: &Path,
        config: AdapterConfig,
        bytes: &[u8],
        targets: &[LoraTarget],
        max_rank: usize,
    ) -> Result<Self, AdapterError> {
        let weights_path = dir.join("adapter_model.safetensors");
        let config_path = dir.join("adapter_config.json");
        let unsupported = |path: &Path, reason: String| AdapterError::Unsupported {
            adapter: name.to_owned(),
            path: path.to_owned(),
            reason,
        };
        let rank_pattern = Pattern::compile(&config.rank_pattern)
            .map_err(|reason| unsupported(&config_path, reason))?;
        let alpha_pattern = Pattern::compile(&config.alpha_pattern)
            .map_err(|reason| unsupported(&config_path, reason))?;
        let covered = TargetFilter::compile(
            config.target_modules.as_ref(),
            config.target_parameters.as_deref().unwrap_or_default(),
        )
        .map_err(|reason| unsupported(&config_path, reason))?;
        let file = SafeTensors::deserialize(bytes)
            .map_err(|e| format_error(name, &weights_path, safetensors_failure(bytes, e)))?;
        let by_path: HashMap<&str, &LoraTarget> =
            targets.iter().map(|t| (t.path.as_str(), t)).collect();
        let incompatible = |key: &str, reason: String| AdapterError::Incompatible {
            adapter: name.to_owned(),
            path: weights_path.clone(),
            key: key.to_owned(),
            reason,
        };

        // Pair up lora_A and lora_B per module, keeping the module's name as the keys spell it
        // (`model.visual.…` from transformers 5, `visual.…` from 4, nothing before `blocks.…`
        // from the tower alone): PEFT matched the config's patterns against that name.
        let mut pairs: BTreeMap<String, KeyPair> = BTreeMap::new();
        // In name order, so that an error names the same key every time.
        let mut names = file.names();
        names.sort_unstable();
        for key in names {
            let inner = key.strip_prefix("base_model.model.").unwrap_or(key);
            let Some((prefix, module_key)) = split_vision_key(inner) else {
                continue; // outside the vision tower: not ours to run
            };
            let (path, side) = if let Some(path) = module_key.strip_suffix(".lora_A.weight") {
                (path, 0)
            } else if let Some(path) = module_key.strip_suffix(".lora_B.weight") {
                (path, 1)
            } else {
                let saved = config.modules_to_save.as_deref().unwrap_or_default();
                return Err(incompatible(key, unexpected_key(module_key, saved)));
            };
            if !by_path.contains_key(path) {
                return Err(incompatible(
                    key,
                    format!("`{path}` is not a LoRA target of this model"),
                ));
            }
            if !covered
                .covers(path)
                .map_err(|reason| unsupported(&config_path, reason))?
            {
                return Err(incompatible(
                    key,
                    format!(
                        "`{path}` is not among the config's target_modules or target_parameters"
                    ),
                ));
            }
            let pair = pairs.entry(path.to_owned()).or_insert_with(|| KeyPair {
                module: format!("{prefix}{path}"),
                keys: [None, None],
            });
            if let Some(first) = &pair.keys[side] {
                return Err(incompatible(
                    key,
                    format!("a second weight for `{path}` beside `{first}`"),
                ));
            }
            pair.keys[side] = Some(key.to_owned());
        }
        if pairs.is_empty() {
            return Err(unsupported(
                &weights_path,
                "holds no LoRA weight for the vision tower or connector".to_owned(),
            ));
        }

        let mut modules = BTreeMap::new();
        for (path, KeyPair { module, keys }) in pairs {
            let target = by_path[path.as_str()];
            let (a_key, b_key) = match keys {
                [Some(a_key), Some(b_key)] => (a_key, b_key),
                keys => {
                    let present = keys.into_iter().flatten().next().unwrap_or_default();
                    return Err(incompatible(
                        &present,
                        "its lora_A/lora_B partner is missing".to_owned(),
                    ));
                }
            };
            let rank = rank_pattern
                .lookup(&module)
                .map_err(|reason| unsupported(&config_path, reason))?
                .unwrap_or(config.r);
            let alpha = alpha_pattern
                .lookup(&module)
                .map_err(|reason| unsupported(&config_path, reason))?
                .unwrap_or(config.lora_alpha);
            if rank == 0 || rank > max_rank {
                return Err(incompatible(
                    &a_key,
                    format!("rank {rank} is outside 1..=max_rank {max_rank}"),
                ));
            }
            let a = read_f32(&file, &a_key, [rank, target.in_features])
                .map_err(|reason| incompatible(&a_key, reason))?;
            let mut b = read_f32(&file, &b_key, [target.out_features, rank])
                .map_err(|reason| incompatible(&b_key, reason))?;
            let scale = config.scale(rank, alpha);
            for value in &mut b {
                *value = (f64::from(*value) * scale) as f32;
            }
            if let Some(bad) = b.iter().position(|v| !v.is_finite()) {
                return Err(incompatible(
                    &b_key,
                    format!("element {bad} overflows f32 once scaled by {scale}"),
                ));
            }
            let keys = Some([a_key, b_key]);
            modules.insert(
                path,
                ModuleLora {
                    rank,
                    a,
                    b,
                    scale,
                    keys,
                },
            );
        }
        Ok(Self {
            name: name.to_owned(),
            dir: dir.to_owned(),
            config,
            modules,
        })
    }
}

impl PeftAdapter {
    /// The name an adapter gets when only its folder is given: the folder's name.
    pub fn name_for(dir: &Path) -> String {
        dir.file_name().map_or_else(
            || "adapter".to_owned(),
            |n| n.to_string_lossy().into_owned(),
        )
    }

    /// Checks an adapter built in memory against `targets`: known modules, ranks in
    /// `1..=max_rank`, A and B of the module's shapes and finite (as loading from a file
    /// requires: one NaN or infinity would reach every row on the adapter's slot).
    pub fn check(&self, targets: &[LoraTarget], max_rank: usize) -> Result<(), AdapterError> {
        for (path, module) in &self.modules {
            let incompatible = |reason: String| AdapterError::Incompatible {
                adapter: self.name.clone(),
                path: self.dir.clone(),
                key: path.clone(),
                reason,
            };
            let target = targets
                .iter()
                .find(|t| &t.path == path)
                .ok_or_else(|| incompatible("not a LoRA target of this model".to_owned()))?;
            if module.rank == 0 || module.rank > max_rank {
                return Err(incompatible(format!(
                    "rank {} is outside 1..={max_rank}",
                    module.rank
                )));
            }
            let (a, b) = (
                module.rank * target.in_features,
                target.out_features * module.rank,
            );
            if module.a.len() != a || module.b.len() != b {
                return Err(incompatible(format!(
                    "A has {} values and B {}, the model needs {a} and {b}",
                    module.a.len(),
                    module.b.len()
                )));
            }
            for (matrix, values) in [("A", &module.a), ("B", &module.b)] {
                if let Some(at) = values.iter().position(|v| !v.is_finite()) {
                    return Err(incompatible(format!(
                        "{matrix} holds {} at element {at}",
                        values[at]
                    )));
                }
            }
        }
        Ok(())
    }

    /// Refuses an adapter holding a value of A, or of B with its scale folded in, beyond f16's
    /// largest finite value (65 504), for a model that computes in f16: cast to f16 it would
    /// become infinite, and every row of the adapter's slot would turn to inf or NaN.
    pub fn check_fits_f16(&self) -> Result<(), AdapterError> {
        let largest = f32::from(half::f16::MAX);
        for (path, module) in &self.modules {
            for (side, (matrix, values)) in
                [("A", &module.a), ("B", &module.b)].into_iter().enumerate()
            {
                if let Some(at) = values.iter().position(|v| v.is_nan() || v.abs() > largest) {
                    let scaled = if matrix == "B" {
                        format!(" (scaled by {})", module.scale)
                    } else {
                        String::new()
                    };
                    // Name the file's key where the module came from one, else its path.
                    let (file, key) = match &module.keys {
                        Some(keys) => (
                            self.dir.join("adapter_model.safetensors"),
                            keys[side].clone(),
                        ),
                        None => (self.dir.clone(), path.clone()),
                    };
                    return Err(AdapterError::Incompatible {
                        adapter: self.name.clone(),
                        path: file,
                        key,
                        reason: format!(
                            "{matrix}{scaled} holds {} at element {at}, beyond f16's largest \
                             finite value {largest}; the model computes in f16",
                            values[at]
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

/// A module's `lora_A` and `lora_B` keys, and its name as they spell it.
struct KeyPair {
    module: String,
    keys: [Option<String>; 2],
}

/// The vision tower's part of `key` (after `base_model.model.`) and the prefix before it:
/// `model.visual.` (transformers 5), `visual.` (transformers 4), or none (PEFT on the tower
/// alone, whose names start at its own modules); `None` outside the tower.
fn split_vision_key(key: &str) -> Option<(&'static str, &str)> {
    ["model.visual.", "visual."]
        .into_iter()
        .find_map(|prefix| Some((prefix, key.strip_prefix(prefix)?)))
        .or_else(|| {
            let tower_module = ["blocks.", "merger.", "patch_embed."];
            tower_module
                .iter()
                .any(|module| key.starts_with(module))
                .then_some(("", key))
        })
}

/// Why a key under the vision tower is not a LoRA weight mmlora runs (`saved`: the config's
/// `modules_to_save`).
fn unexpected_key(module_key: &str, saved: &[String]) -> String {
    if !saved.is_empty() && !module_key.contains("lora_") {
        return format!(
            "a whole module trained for modules_to_save {saved:?}; per-row LoRA cannot serve \
             one in the vision tower"
        );
    }
    let what = if module_key.contains("lora_magnitude_vector") {
        "a DoRA magnitude vector"
    } else if module_key.ends_with(".lora_B.bias") {
        "a trained LoRA bias (lora_bias)"
    } else if module_key.contains("lora_embedding_") {
        "an embedding LoRA"
    } else if module_key.contains(".lora_A.") || module_key.contains(".lora_B.") {
        "a LoRA weight under an adapter name (`lora_A.<name>.weight`; PEFT's save_pretrained \
         writes `lora_A.weight`)"
    } else {
        "neither a lora_A nor a lora_B weight"
    };
    format!("{what}, which mmlora does not run")
}

/// A tensor's values as f32, checking its shape (f32, f16 and bf16 accepted).
fn read_f32<const D: usize>(
    file: &SafeTensors<'_>,
    key: &str,
    shape: [usize; D],
) -> Result<Vec<f32>, String> {
    let view = file.tensor(key).map_err(|e| e.to_string())?;
    if view.shape() != shape {
        return Err(format!(
            "shape {:?}, the model needs {shape:?}",
            view.shape()
        ));
    }
    float_values(&view)
}

#[cfg(test)]
mod tests {
    use safetensors::{Dtype, tensor::TensorView};

    use super::*;

    const RANK: usize = 2;
    const IN: usize = 4;
    const OUT: usize = 6;

    /// A block's qkv and the merger's first linear, both `IN → OUT`.
    fn targets() -> Vec<LoraTarget> {
        ["blocks.0.attn.qkv", "merger.mlp.0"]
            .map(|path| LoraTarget {
                path: path.to_owned(),
                in_features: IN,
                out_features: OUT,
                connector: path.starts_with("merger"),
            })
            .to_vec()
    }

    /// Loads an adapter of `config` whose file holds `keys`, each of the shape its side needs
    /// (lora_A `[RANK, IN]`, anything else `[OUT, RANK]`) and every value 1.
    fn load(config: &str, keys: &[&str]) -> Result<PeftAdapter, AdapterError> {
        let shapes: Vec<Vec<usize>> = keys
            .iter()
            .map(|key| match key.contains("lora_A") {
                true => vec![RANK, IN],
                false => vec![OUT, RANK],
            })
            .collect();
        let bytes: Vec<Vec<u8>> = shapes
            .iter()
            .map(|shape| bytemuck::cast_slice(&vec![1.0f32; shape.iter().product()]).to_vec())
            .collect();
        let views = keys
            .iter()
            .zip(&shapes)
            .zip(&bytes)
            .map(|((key, shape), bytes)| {
                (
                    *key,
                    TensorView::new(Dtype::F32, shape.clone(), bytes).unwrap(),
                )
            });
        let file = safetensors::serialize(views, None).unwrap();
        let dir = Path::new("/adapters/test");
        let config = AdapterConfig::parse("test", &dir.join("adapter_config.json"), config)?;
        PeftAdapter::from_safetensors("test", dir, config, &file, &targets(), 64)
    }

    /// Both keys of a module, under `prefix` (`model.visual.` or `visual.`).
    fn pair(prefix: &str, path: &str) -> [String; 2] {
        ["A", "B"].map(|side| format!("base_model.model.{prefix}{path}.lora_{side}.weight"))
    }

    fn scale_of(adapter: &PeftAdapter, path: &str) -> f64 {
        adapter.modules[path].scale
    }

    #[test]
    fn weights_beyond_f16_are_refused_for_f16() {
        let keys = pair("model.visual.", "blocks.0.attn.qkv");
        let keys = [keys[0].as_str(), keys[1].as_str()];
        // Every value 1, so B scaled is alpha / r: f16's largest finite value fits, the next
        // f32 above it does not (WGSL leaves an out-of-range conversion's value undefined).
        let at = |alpha: f32| {
            let config = format!(r#"{{"r": 2, "lora_alpha": {}}}"#, f64::from(alpha) * 2.0);
            load(&config, &keys).unwrap().check_fits_f16()
        };
        assert!(at(65_504.0).is_ok());
        let refused = at(65_504.0_f32.next_up()).unwrap_err().to_string();
        // Loaded from a file, the error names the file and the key of B.
        assert!(
            refused.contains("adapter_model.safetensors")
                && refused.contains(&format!("key `{}`", keys[1]))
                && refused.contains("B (scaled by 65504.00"),
            "{refused}"
        );
    }

    /// An adapter built in memory with a NaN or an infinity is refused, by the check every
    /// adapter passes and by the f16 one (which no comparison with NaN would trip).
    #[test]
    fn values_that_are_not_finite_are_refused_in_memory() {
        let keys = pair("model.visual.", "blocks.0.attn.qkv");
        let keys = [keys[0].as_str(), keys[1].as_str()];
        let adapter = load(r#"{"r": 2, "lora_alpha": 2}"#, &keys).unwrap();
        assert!(adapter.check(&targets(), RANK).is_ok());
        for (matrix, value) in [("A", f32::NAN), ("B", f32::INFINITY), ("B", f32::NAN)] {
            let mut bad = adapter.clone();
            let module = bad.modules.get_mut("blocks.0.attn.qkv").unwrap();
            match matrix {
                "A" => module.a[1] = value,
                _ => module.b[1] = value,
            }
            let refused = bad.check(&targets(), RANK).unwrap_err().to_string();
            assert!(
                refused.contains("blocks.0.attn.qkv")
                    && refused.contains(&format!("{matrix} holds")),
                "{refused}"
            );
            let refused = bad.check_fits_f16().unwrap_err().to_string();
            assert!(refused.contains("beyond f16's largest"), "{refused}");
        }
    }

    #[test]
    fn patterns_take_the_first_key_that_matches_in_the_files_order() {
        let keys = pair("model.visual.", "blocks.0.attn.qkv");
        let keys = [keys[0].as_str(), keys[1].as_str()];
        // PEFT's get_pattern_key: `qkv` comes first and matches, so it wins over the longer key.
        let first =
            r#"{"r": 2, "lora_alpha": 2, "alpha_pattern": {"qkv": 32, "blocks.0.attn.qkv": 8}}"#;
        assert_eq!(
            scale_of(&load(first, &keys).unwrap(), "blocks.0.attn.qkv"),
            16.0
        );
        let second =
            r#"{"r": 2, "lora_alpha": 2, "alpha_pattern": {"blocks.0.attn.qkv": 8, "qkv": 32}}"#;
        assert_eq!(
            scale_of(&load(second, &keys).unwrap(), "blocks.0.attn.qkv"),
            4.0
        );
    }

    #[test]
    fn patterns_match_the_module_name_as_the_keys_spell_it() {
        // An adapter trained under transformers 4: its modules are `visual.…`.
        let config = r#"{"r": 2, "lora_alpha": 2, "alpha_pattern": {"^visual\\.merger.*": 64}}"#;
        for (prefix, scale) in [("visual.", 32.0), ("model.visual.", 1.0)] {
            let keys = pair(prefix, "merger.mlp.0");
            let adapter = load(config, &[&keys[0], &keys[1]]).unwrap();
            assert_eq!(scale_of(&adapter, "merger.mlp.0"), scale, "{prefix}");
        }
    }

    #[test]
    fn target_modules_may_look_around_as_ms_swift_writes_them() {
        // ms-swift's form: tower linears but not the merger's, then the merger's by index.
        let config = r#"{"r": 2, "lora_alpha": 2, "target_modules":
            "^(model\\.visual(?=\\.)(?!\\.merger).*\\.(qkv|proj)|model\\.visual\\.merger(?=\\.).*\\.(0|2))$"}"#;
        let [qkv_a, qkv_b] = pair("model.visual.", "blocks.0.attn.qkv");
        let [mlp_a, mlp_b] = pair("model.visual.", "merger.mlp.0");
        let adapter = load(config, &[&qkv_a, &qkv_b, &mlp_a, &mlp_b]).unwrap();
        assert_eq!(adapter.modules.len(), 2);

        // A look-ahead that excludes the block: its keys are refused.
        let excluding = config.replace(r"(?!\\.merger)", r"(?!\\.blocks\\.0\\.)");
        let error = load(&excluding, &[&qkv_a, &qkv_b]).unwrap_err().to_string();
        assert!(
            error.contains("not among the config's target_modules"),
            "{error}"
        );
    }

    /// What PEFT saves from the tower alone, from `target_parameters`, and beside a language
    /// model's `modules_to_save` is served; the tower's own `modules_to_save` is not.
    #[test]
    fn other_ways_peft_saves_a_tower_lora_are_read() {
        let [bare_a, bare_b] = pair("", "blocks.0.attn.qkv");
        let list = r#"{"r": 2, "lora_alpha": 2, "target_modules": ["qkv"]}"#;
        let adapter = load(list, &[&bare_a, &bare_b]).unwrap();
        assert_eq!(
            adapter.modules.keys().collect::<Vec<_>>(),
            ["blocks.0.attn.qkv"]
        );

        let [a, b] = pair("model.visual.", "blocks.0.attn.qkv");
        let parameters = r#"{"r": 2, "lora_alpha": 2, "target_modules": [],
            "target_parameters": ["attn.qkv.weight"]}"#;
        assert!(load(parameters, &[&a, &b]).is_ok());
        let [merger_a, merger_b] = pair("model.visual.", "merger.mlp.0");
        let error = load(parameters, &[&a, &b, &merger_a, &merger_b])
            .unwrap_err()
            .to_string();
        assert!(error.contains("target_parameters"), "{error}");

        let lm_head = r#"{"r": 2, "lora_alpha": 2, "modules_to_save": ["lm_head"]}"#;
        assert!(load(lm_head, &[&a, &b, "base_model.model.lm_head.weight"]).is_ok());
        let ln_q = r#"{"r": 2, "lora_alpha": 2, "modules_to_save": ["merger.ln_q"]}"#;
        let error = load(
            ln_q,
            &[&a, &b, "base_model.model.model.visual.merger.ln_q.weight"],
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("modules_to_save"), "{error}");
    }

    /// LoRA variants whose forward differs are refused when set as Python's truth test takes
    /// it, and served as plain LoRA when not.
    #[test]
    fn lora_variants_are_refused_when_set() {
        let [a, b] = pair("model.visual.", "blocks.0.attn.qkv");
        for (field, value) in [
            ("arrow_config", r#"{"top_k": 2}"#),
            ("alora_invocation_tokens", "[5, 6]"),
            ("use_bdlora", r#"{"nblocks": 2}"#),
            ("kasa_config", "{\"x\": 1}"),
        ] {
            let config = format!(r#"{{"r": 2, "lora_alpha": 2, "{field}": {value}}}"#);
            let error = load(&config, &[&a, &b]).unwrap_err().to_string();
            assert!(error.contains(field), "{error}");
            for unset in ["null", "false", "[]", "{}"] {
                let config = format!(r#"{{"r": 2, "lora_alpha": 2, "{field}": {unset}}}"#);
                assert!(load(&config, &[&a, &b]).is_ok(), "{field}: {unset}");
            }
        }
    }

    /// Another PEFT method is named as such, though its config lacks LoRA's fields.
    #[test]
    fn another_peft_method_is_refused_by_its_type() {
        let error = load(r#"{"peft_type": "LOHA", "r": 4, "alpha": 8}"#, &[])
            .unwrap_err()
            .to_string();
        assert!(error.contains("peft_type LOHA is not LORA"), "{error}");
    }

    #[test]
    fn a_module_spelled_twice_is_refused() {
        let [t5_a, t5_b] = pair("model.visual.", "blocks.0.attn.qkv");
        let [t4_a, _] = pair("visual.", "blocks.0.attn.qkv");
        let error = load(r#"{"r": 2, "lora_alpha": 2}"#, &[&t5_a, &t5_b, &t4_a])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("a second weight for `blocks.0.attn.qkv`"),
            "{error}"
        );
    }

    #[test]
    fn unexpected_keys_are_refused_with_what_they_are() {
        let [a, b] = pair("model.visual.", "blocks.0.attn.qkv");
        for (key, what) in [
            (
                a.replace("lora_A.weight", "lora_A.default.weight"),
                "adapter name",
            ),
            (a.replace("lora_A.weight", "lora_magnitude_vector"), "DoRA"),
            (b.replace("lora_B.weight", "lora_B.bias"), "lora_bias"),
        ] {
            let error = load(r#"{"r": 2, "lora_alpha": 2}"#, &[&key, &b])
                .unwrap_err()
                .to_string();
            assert!(error.contains(what) && error.contains(&key), "{error}");
        }
    }
}
