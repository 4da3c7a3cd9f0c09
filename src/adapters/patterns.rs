//! PEFT's module matching, as PEFT does it with Python's `re`: `target_modules` (a list of
//! suffixes or one regex) and `target_parameters` for the modules an adapter covers, and
//! `rank_pattern` / `alpha_pattern` for per-module ranks and alphas (look-around and
//! backreferences included, which ms-swift writes).

use fancy_regex::Regex;
use indexmap::IndexMap;

use super::TargetModules;

/// PEFT's `rank_pattern` / `alpha_pattern`, compiled once: key `k` matches a module name when
/// Python's `re.match(r"(.*\.)?(k)$", name)` does, and the first matching key in the file's
/// order gives the value.
pub(super) struct Pattern<T> {
    /// Each key, compiled, and its value.
    rules: Vec<(String, Regex, T)>,
}

impl<T: Copy> Pattern<T> {
    pub(super) fn compile(patterns: &IndexMap<String, T>) -> Result<Self, String> {
        let rules = patterns
            .iter()
            .map(|(key, &value)| {
                Regex::new(&format!(r"^(.*\.)?(?:{key})$"))
                    .map(|re| (key.clone(), re, value))
                    .map_err(|e| format!("pattern key `{key}` is not a valid regex: {e}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { rules })
    }

    /// The value of the first key that matches `module`, if any.
    pub(super) fn lookup(&self, module: &str) -> Result<Option<T>, String> {
        for (key, re, value) in &self.rules {
            if re.is_match(module).map_err(|e| {
                format!("pattern key `{key}` cannot be matched against `{module}`: {e}")
            })? {
                return Ok(Some(*value));
            }
        }
        Ok(None)
    }
}

/// `target_modules` and `target_parameters` as PEFT matches them against module names: a
/// list entry matches the name or its last dotted parts, a string is a regex over the whole
/// name (`all-linear`: everything); a parameter entry matches `name.weight` the way a list
/// entry matches a name. Names are tried as transformers 5 (`model.visual.…`) and 4
/// (`visual.…`) spell them, and as PEFT on the tower alone does (`blocks.…`).
pub(super) struct TargetFilter {
    modules: ModuleFilter,
    /// `target_parameters`.
    parameters: Vec<String>,
}

enum ModuleFilter {
    All,
    Suffixes(Vec<String>),
    Regex(Regex),
}

impl TargetFilter {
    pub(super) fn compile(
        modules: Option<&TargetModules>,
        parameters: &[String],
    ) -> Result<Self, String> {
        let modules = match modules {
            // Parameters alone target only themselves.
            None if !parameters.is_empty() => ModuleFilter::Suffixes(Vec::new()),
            None => ModuleFilter::All,
            Some(TargetModules::Regex(pattern)) if pattern == "all-linear" => ModuleFilter::All,
            Some(TargetModules::Regex(pattern)) => ModuleFilter::Regex(
                Regex::new(&format!("^(?:{pattern})$"))
                    .map_err(|e| format!("target_modules `{pattern}` is not a valid regex: {e}"))?,
            ),
            Some(TargetModules::List(suffixes)) => ModuleFilter::Suffixes(suffixes.clone()),
        };
        Ok(Self {
            modules,
            parameters: parameters.to_vec(),
        })
    }

    /// Whether the target at `path` (`blocks.0.attn.qkv`) is covered; a regex that cannot be
    /// run to the end (fancy-regex's backtracking limit) is an error.
    pub(super) fn covers(&self, path: &str) -> Result<bool, String> {
        let names = [
            format!("model.visual.{path}"),
            format!("visual.{path}"),
            path.to_owned(),
        ];
        let ends_with = |name: &str, suffix: &str| {
            name.strip_suffix(suffix)
                .is_some_and(|head| head.is_empty() || head.ends_with('.'))
        };
        let weight = format!("{}.weight", names[0]);
        if self.parameters.iter().any(|p| ends_with(&weight, p)) {
            return Ok(true);
        }
        Ok(match &self.modules {
            ModuleFilter::All => true,
            ModuleFilter::Regex(re) => {
                for name in &names {
                    if re.is_match(name).map_err(|e| {
                        format!("target_modules cannot be matched against `{name}`: {e}")
                    })? {
                        return Ok(true);
                    }
                }
                false
            }
            ModuleFilter::Suffixes(suffixes) => {
                suffixes.iter().any(|suffix| ends_with(&names[0], suffix))
            }
        })
    }
}
