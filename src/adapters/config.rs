//! `adapter_config.json`: the fields mmlora reads, and what they say about the adapter (its
//! scales, targets and ranks), checked before any weight is read.

use std::path::Path;

use indexmap::IndexMap;
use serde::Deserialize;

use super::error::{AdapterError, format_error, io_error};

/// `target_modules`: a list of module-name suffixes or one regex.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// Suffixes such as `qkv` or `mlp.0`.
    List(Vec<String>),
    /// A regex (Python's syntax, look-around included) matched against whole module names.
    Regex(String),
}

/// The fields of `adapter_config.json` mmlora reads.
#[derive(Debug, Clone, Deserialize)]
pub struct AdapterConfig {
    /// Default rank.
    pub r: usize,
    /// Default alpha.
    pub lora_alpha: f64,
    /// Scale by `alpha/√r` instead of `alpha/r`.
    #[serde(default)]
    pub use_rslora: bool,
    /// Which modules the adapter targets.
    pub target_modules: Option<TargetModules>,
    /// Per-module rank overrides (keys are regex suffixes of module names), in the file's
    /// order: as in PEFT, the first key that matches a module wins.
    #[serde(default)]
    pub rank_pattern: IndexMap<String, usize>,
    /// Per-module alpha overrides, in the file's order like `rank_pattern`.
    #[serde(default)]
    pub alpha_pattern: IndexMap<String, f64>,
    /// DoRA (refused).
    #[serde(default)]
    pub use_dora: bool,
    /// Which weight parameters the adapter targets (PEFT's `target_parameters`): on a linear
    /// layer's `weight`, the same LoRA as targeting the layer.
    #[serde(default)]
    pub target_parameters: Option<Vec<String>>,
    /// Fully trained modules: served where they are outside the vision tower (saved whole, the
    /// tower's are refused by key).
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
    /// Bias training (`none` only).
    #[serde(default)]
    pub bias: Option<String>,
    /// How PEFT initialises the adapter: `true`, `false` or a method's name (those that
    /// rewrite the base weights are refused).
    #[serde(default)]
    pub init_lora_weights: Option<serde_json::Value>,
    /// Variants whose forward is not `x·Aᵀ·Bᵀ·scale` on every row (refused): activated LoRA
    /// (`alora_invocation_tokens`), block-diagonal LoRA (`use_bdlora`), KaSA (`kasa_config`),
    /// Arrow (`arrow_config`).
    #[serde(default)]
    pub alora_invocation_tokens: Option<serde_json::Value>,
    /// See `alora_invocation_tokens`.
    #[serde(default)]
    pub use_bdlora: Option<serde_json::Value>,
    /// See `alora_invocation_tokens`.
    #[serde(default)]
    pub kasa_config: Option<serde_json::Value>,
    /// Arrow's routing of each row over several adapters (refused, as the variants above).
    #[serde(default)]
    pub arrow_config: Option<serde_json::Value>,
}

impl AdapterConfig {
    /// The factor folded into B for a module of `rank` and `alpha`: `alpha/r`, or `alpha/√r`
    /// with rsLoRA.
    pub fn scale(&self, rank: usize, alpha: f64) -> f64 {
        if self.use_rslora {
            alpha / (rank as f64).sqrt()
        } else {
            alpha / rank as f64
        }
    }

    /// Reads `dir/adapter_config.json` and refuses what per-row LoRA cannot serve.
    pub fn read(name: &str, dir: &Path) -> Result<Self, AdapterError> {
        let path = dir.join("adapter_config.json");
        let text = crate::vfs::read_to_string(&path).map_err(io_error(name, &path))?;
        Self::parse(name, &path, &text)
    }

    /// Parses the text of adapter `name`'s `adapter_config.json` (read from `path`) and refuses
    /// what per-row LoRA cannot serve.
    pub fn parse(name: &str, path: &Path, text: &str) -> Result<Self, AdapterError> {
        let unsupported = |reason| AdapterError::Unsupported {
            adapter: name.to_owned(),
            path: path.to_owned(),
            reason,
        };
        // The type first: another PEFT method's config lacks LoRA's fields.
        #[derive(Deserialize)]
        struct Kind {
            peft_type: Option<String>,
        }
        if let Ok(Kind {
            peft_type: Some(kind),
        }) = serde_json::from_str(text)
            && kind != "LORA"
        {
            return Err(unsupported(format!(
                "peft_type {kind} is not LORA, the only PEFT method mmlora runs"
            )));
        }
        let config: Self =
            serde_json::from_str(text).map_err(|e| format_error(name, path, e.to_string()))?;
        match config.problem() {
            Some(reason) => Err(unsupported(reason)),
            None => Ok(config),
        }
    }

    /// What in this configuration mmlora refuses, if anything.
    fn problem(&self) -> Option<String> {
        if self.use_dora {
            return Some("DoRA (use_dora) is not supported".to_owned());
        }
        // Set as Python's truth test takes it: not None, False, 0, "", [] or {}.
        let set = |value: &Option<serde_json::Value>| match value {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(on)) => *on,
            Some(serde_json::Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(serde_json::Value::String(s)) => !s.is_empty(),
            Some(serde_json::Value::Array(a)) => !a.is_empty(),
            Some(serde_json::Value::Object(o)) => !o.is_empty(),
        };
        let variants = [
            (
                "alora_invocation_tokens",
                &self.alora_invocation_tokens,
                "activated LoRA acts only after its invocation tokens in the text, which the \
                 vision tower never sees",
            ),
            (
                "use_bdlora",
                &self.use_bdlora,
                "block-diagonal LoRA (BD-LoRA) is not supported",
            ),
            (
                "kasa_config",
                &self.kasa_config,
                "KaSA truncates the base weights, which adapters sharing one base cannot do",
            ),
            (
                "arrow_config",
                &self.arrow_config,
                "Arrow routes each row over several adapters, which one slot per row cannot do",
            ),
        ];
        if let Some((key, _, why)) = variants.iter().find(|(_, value, _)| set(value)) {
            return Some(format!("{key}: {why}"));
        }
        if let Some(bias) = self.bias.as_deref().filter(|b| *b != "none") {
            return Some(format!("bias = {bias} (trained biases) is not supported"));
        }
        if let Some(init) = self
            .init_lora_weights
            .as_ref()
            .and_then(|init| init.as_str())
            .filter(|init| rewrites_base_weights(init))
        {
            return Some(format!(
                "init_lora_weights = {init}: PEFT rewrites the base weights when it loads such an \
                 adapter, which adapters sharing one base cannot do; convert it to a plain LoRA \
                 (PEFT's save_pretrained with path_initial_model_for_weight_conversion)"
            ));
        }
        if self.r == 0 {
            return Some("r is 0".to_owned());
        }
        if let Some(key) = self
            .rank_pattern
            .iter()
            .find_map(|(k, &r)| (r == 0).then_some(k))
        {
            return Some(format!("rank_pattern gives `{key}` rank 0"));
        }
        let alphas = std::iter::once(("lora_alpha", &self.lora_alpha))
            .chain(self.alpha_pattern.iter().map(|(k, a)| (k.as_str(), a)));
        for (key, &alpha) in alphas {
            if !alpha.is_finite() || alpha == 0.0 {
                return Some(format!(
                    "alpha {alpha} for `{key}` would make the adapter do nothing or overflow"
                ));
            }
        }
        None
    }
}

/// Whether PEFT, loading an adapter initialised by `init`, rewrites the base layer's weights
/// (PiSSA, CorDA, OLoRA and LoRA-GA subtract the initial product; LoftQ quantises).
fn rewrites_base_weights(init: &str) -> bool {
    let init = init.to_ascii_lowercase();
    ["pissa", "corda"].iter().any(|m| init.starts_with(m))
        || ["olora", "loftq", "lora_ga"].contains(&init.as_str())
}
