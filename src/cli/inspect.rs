//! `mmlora adapters inspect`: what a PEFT folder holds and whether a model can run it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use mmlora::adapters::{AdapterConfig, AdapterError, PeftAdapter, TargetModules};
use mmlora::engine::EngineOptions;
use mmlora::models::LoraTarget;

use super::{CliError, model_dir};

/// Arguments of `mmlora adapters inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// The PEFT adapter folder.
    dir: PathBuf,
    /// The model to check it against; default: the bundled model. Only its config is read.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The largest rank the engine would accept.
    #[arg(long, default_value_t = EngineOptions::default().max_rank)]
    max_rank: usize,
}

/// Runs `mmlora adapters inspect`: prints the adapter, then fails if the model cannot run it.
pub fn run(args: InspectArgs) -> Result<(), CliError> {
    let name = PeftAdapter::name_for(&args.dir);
    let config = AdapterConfig::read(&name, &args.dir)?;
    let default_scale = config.scale(config.r, config.lora_alpha);
    println!("adapter: {}", args.dir.display());
    println!(
        "rank {}, alpha {}, scale {default_scale} ({})",
        config.r,
        config.lora_alpha,
        if config.use_rslora {
            "rsLoRA: alpha/√r"
        } else {
            "alpha/r"
        }
    );
    match &config.target_modules {
        Some(TargetModules::List(names)) if names.is_empty() => println!("target_modules: (none)"),
        Some(TargetModules::List(names)) => println!("target_modules: {}", names.join(", ")),
        Some(TargetModules::Regex(regex)) => println!("target_modules: regex {regex}"),
        None => println!("target_modules: (not given)"),
    }
    if let Some(parameters) = config.target_parameters.as_ref().filter(|p| !p.is_empty()) {
        println!("target_parameters: {}", parameters.join(", "));
    }
    for (label, pattern) in [
        ("rank_pattern", format!("{:?}", config.rank_pattern)),
        ("alpha_pattern", format!("{:?}", config.alpha_pattern)),
    ] {
        if pattern != "{}" {
            println!("{label}: {pattern}");
        }
    }

    let model = model_dir(args.model)?;
    let targets = mmlora::models::lora_targets(model.path())?;
    match PeftAdapter::load(&name, &args.dir, &targets, args.max_rank) {
        Ok(adapter) => {
            // Per kind of layer (`attn.qkv`, `merger.mlp.0`, …): how many layers, ranks, scales.
            let mut kinds: BTreeMap<String, (usize, Vec<usize>, Vec<f64>)> = BTreeMap::new();
            for (path, module) in &adapter.modules {
                let entry = kinds.entry(LoraTarget::kind(path).to_owned()).or_default();
                entry.0 += 1;
                if !entry.1.contains(&module.rank) {
                    entry.1.push(module.rank);
                }
                if !entry.2.contains(&module.scale) {
                    entry.2.push(module.scale);
                }
            }
            println!(
                "layers with LoRA: {} of the model's {}",
                adapter.modules.len(),
                targets.len()
            );
            for (kind, (count, ranks, scales)) in kinds {
                println!("  {kind}: {count} layers, rank {ranks:?}, scale {scales:?}");
            }
            println!("compatible with {}: yes", model.label());
            Ok(())
        }
        Err(error @ (AdapterError::Incompatible { .. } | AdapterError::Unsupported { .. })) => {
            println!("compatible with {}: no — {error}", model.label());
            Err(CliError::Incompatible {
                dir: args.dir,
                model: model.label().to_owned(),
                source: Box::new(error),
            })
        }
        Err(error) => Err(error.into()),
    }
}
