//! `adapter_config.json` parsing, then validation of a real adapter's weights under that
//! configuration: a typed error or an adapter whose every module has a rank in range, finite
//! values and the shapes of the model.

#![no_main]

use std::path::Path;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use mmlora::adapters::{AdapterConfig, PeftAdapter};
use mmlora::model::qwen2_vl::LoraTarget;

const MAX_RANK: usize = 16;

/// The bundled tiny model's targets and one of its adapters' weights.
static FIXTURE: LazyLock<(Vec<LoraTarget>, Vec<u8>)> = LazyLock::new(|| {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny-qwen2-vl");
    let config = mmlora::model::qwen2_vl::VisionConfig::from_model_dir(&model).unwrap();
    let weights = std::fs::read(model.join("adapters/patterns/adapter_model.safetensors")).unwrap();
    (config.lora_targets(), weights)
});

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let dir = Path::new("/fuzz/adapter");
    let Ok(config) = AdapterConfig::parse("fuzz", &dir.join("adapter_config.json"), text) else {
        return;
    };
    assert!(config.r > 0 && config.lora_alpha.is_finite() && config.lora_alpha != 0.0);
    let (targets, weights) = &*FIXTURE;
    let Ok(adapter) = PeftAdapter::from_safetensors("fuzz", dir, config, weights, targets, MAX_RANK)
    else {
        return;
    };
    adapter.check(targets, MAX_RANK).expect("a loaded adapter passes its own check");
    for module in adapter.modules.values() {
        assert!(module.scale.is_finite());
        assert!(module.a.iter().chain(&module.b).all(|v| v.is_finite()));
    }
});
