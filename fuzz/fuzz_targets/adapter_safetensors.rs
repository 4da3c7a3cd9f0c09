//! `adapter_model.safetensors` bytes (header and data) under a real adapter's configuration: a
//! typed error or an adapter that fits the model, never a panic or an allocation the file's
//! size does not justify.

#![no_main]

use std::path::Path;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use mmlora::adapters::{AdapterConfig, PeftAdapter};
use mmlora::model::qwen2_vl::LoraTarget;

const MAX_RANK: usize = 16;

/// The bundled tiny model's targets and one of its adapters' configuration.
static FIXTURE: LazyLock<(Vec<LoraTarget>, AdapterConfig)> = LazyLock::new(|| {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny-qwen2-vl");
    let config = mmlora::model::qwen2_vl::VisionConfig::from_model_dir(&model).unwrap();
    let adapter = AdapterConfig::read("all-r4", &model.join("adapters/all-r4")).unwrap();
    (config.lora_targets(), adapter)
});

fuzz_target!(|data: &[u8]| {
    let (targets, config) = &*FIXTURE;
    let dir = Path::new("/fuzz/adapter");
    if let Ok(adapter) =
        PeftAdapter::from_safetensors("fuzz", dir, config.clone(), data, targets, MAX_RANK)
    {
        adapter.check(targets, MAX_RANK).expect("a loaded adapter passes its own check");
        let values: usize = adapter.modules.values().map(|m| m.a.len() + m.b.len()).sum();
        // Every value came from the file: at least two bytes each (f16/bf16).
        assert!(values * 2 <= data.len());
    }
});
