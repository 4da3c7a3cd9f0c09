//! Qwen2.5-VL against transformers + PEFT: the tiny model of `assets/tiny-qwen2.5-vl/` (four
//! blocks, two of them attending in windows of 2×2 merged tokens that split the fixture images
//! into whole, partial and cut-off windows), its adapters on every target kind, the mixed batch
//! through the engine on the CPU backend and on wgpu, each request alone, and patches of two
//! frames.

mod common;

use common::{
    assert_refused_by_module, family_dir, mixed_batch_matches_peft_on_the_cpu,
    mixed_batch_matches_peft_on_wgpu, requests_in,
};
use mmlora::models::VisionTower;
use mmlora::models::qwen2_5_vl::Qwen25VlVision;
use mmlora::runtime::device;

fn dir() -> std::path::PathBuf {
    family_dir("qwen2.5-vl")
}

/// The fixture folder is a Qwen2.5-VL model, read as one.
#[test]
fn the_folder_loads_as_qwen2_5_vl() {
    let cpu = device::cpu();
    let model = Qwen25VlVision::load(&dir(), &cpu.device).unwrap();
    assert_eq!(model.config().window_units(), 2);
    assert_eq!(model.config().fullatt_block_indexes, [1, 3]);
    let targets = mmlora::models::load(&dir(), &cpu.device)
        .unwrap()
        .lora_targets();
    assert_eq!(targets, model.lora_targets());
    assert_eq!(requests_in(&dir()).len(), 7);
}

/// The mixed batch in one call, on the CPU backend: every request matches transformers + PEFT
/// run request by request, and equals itself run alone.
#[test]
fn a_mixed_batch_matches_peft_on_the_cpu() {
    mixed_batch_matches_peft_on_the_cpu(&dir());
}

/// The same on wgpu, with the device's default kernels.
#[test]
fn a_mixed_batch_matches_peft_on_wgpu() {
    mixed_batch_matches_peft_on_wgpu(&dir());
}

/// An adapter of one family on the other's model is refused, naming its file and a key that
/// targets a layer the model does not have; the engine is left as it was.
#[test]
fn adapters_of_the_other_family_are_refused_by_key() {
    let qwen2_vl = family_dir("qwen2-vl");
    for (model, adapter) in [
        (dir(), qwen2_vl.join("adapters/all-r4")),
        (qwen2_vl.clone(), dir().join("adapters/patterns")),
    ] {
        let module = assert_refused_by_module(&model, &adapter);
        assert!(module.starts_with("blocks."), "{module}");
    }
}
