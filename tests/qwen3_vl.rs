//! Qwen3-VL against transformers + PEFT: the tiny model of `assets/tiny-qwen3-vl/` (four
//! blocks, deepstack mergers after blocks 1 and 2, a 5×5 position table that every fixture
//! grid needs interpolated, larger or smaller), its adapters on every target kind (one on the
//! deepstack mergers alone), the mixed batch through the engine on the CPU backend and on wgpu
//! (embeddings, tower and deepstack outputs), each request alone, and patches of two frames.

mod common;

use common::{
    assert_refused_by_module, family_dir, mixed_batch_matches_peft_on_the_cpu,
    mixed_batch_matches_peft_on_wgpu, requests_in,
};
use mmlora::models::VisionTower;
use mmlora::models::qwen3_vl::Qwen3VlVision;
use mmlora::runtime::device;

fn dir() -> std::path::PathBuf {
    family_dir("qwen3-vl")
}

/// The fixture folder is a Qwen3-VL model, read as one, with its deepstack mergers' linears
/// among the connector's targets.
#[test]
fn the_folder_loads_as_qwen3_vl() {
    let cpu = device::cpu();
    let model = Qwen3VlVision::load(&dir(), &cpu.device).unwrap();
    assert_eq!(model.config().deepstack_visual_indexes, [1, 2]);
    assert_eq!(model.config().position_side(), 5);
    let targets = mmlora::models::load(&dir(), &cpu.device)
        .unwrap()
        .lora_targets();
    assert_eq!(targets, model.lora_targets());
    let connector: Vec<&str> = targets
        .iter()
        .filter(|t| t.connector)
        .map(|t| t.path.as_str())
        .collect();
    assert_eq!(
        connector,
        [
            "merger.linear_fc1",
            "merger.linear_fc2",
            "deepstack_merger_list.0.linear_fc1",
            "deepstack_merger_list.0.linear_fc2",
            "deepstack_merger_list.1.linear_fc1",
            "deepstack_merger_list.1.linear_fc2",
        ]
    );
    assert_eq!(requests_in(&dir()).len(), 8);
}

/// The mixed batch in one call, on the CPU backend: every request matches transformers + PEFT
/// run request by request (deepstack outputs included), and equals itself run alone.
#[test]
fn a_mixed_batch_matches_peft_on_the_cpu() {
    mixed_batch_matches_peft_on_the_cpu(&dir());
}

/// The same on wgpu, with the device's default kernels.
#[test]
fn a_mixed_batch_matches_peft_on_wgpu() {
    mixed_batch_matches_peft_on_wgpu(&dir());
}

/// Adapters of the other families on Qwen3-VL, and Qwen3-VL's deepstack adapter on a model
/// without deepstack mergers, are refused naming the adapter file and a module the model
/// lacks; the engine is left as it was.
#[test]
fn adapters_for_other_layers_are_refused_by_module() {
    for (model, adapter) in [
        (dir(), family_dir("qwen2.5-vl").join("adapters/all-r4")),
        (dir(), family_dir("qwen2-vl").join("adapters/patterns")),
        (
            family_dir("qwen2.5-vl"),
            dir().join("adapters/deepstack-r4"),
        ),
        (family_dir("qwen2.5-vl"), dir().join("adapters/all-r4")),
    ] {
        assert_refused_by_module(&model, &adapter);
    }
}
