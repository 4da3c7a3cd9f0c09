//! Qwen2.5-VL against transformers + PEFT: the tiny model of `assets/tiny-qwen2.5-vl/` (four
//! blocks, two of them attending in windows of 2×2 merged tokens that split the fixture images
//! into whole, partial and cut-off windows), its adapters on every target kind, the mixed batch
//! through the engine on the CPU backend and on wgpu, each request alone, and patches of two
//! frames.

mod common;

use common::{
    Expected, assert_outputs_match, errors, family_dir, requests_in, requests_with_frames,
};
use mmlora::engine::{Encoded, Engine, EngineOptions};
use mmlora::models::VisionTower;
use mmlora::models::qwen2_5_vl::Qwen25VlVision;
use mmlora::runtime::device::{self, RuntimeDevice};

const ADAPTERS: [&str; 4] = ["all-r4", "rslora-r8", "tower-r2", "patterns"];

fn dir() -> std::path::PathBuf {
    family_dir("qwen2.5-vl")
}

/// The model with the fixture's adapters loaded.
fn engine(on: &RuntimeDevice) -> Engine {
    let mut engine = Engine::open(&dir(), on.clone(), EngineOptions::default()).unwrap();
    for name in ADAPTERS {
        engine
            .load_adapter(name, &dir().join("adapters").join(name))
            .unwrap();
    }
    engine
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
    let cpu = device::cpu();
    let expected = Expected::load_from(&dir());
    let requests = requests_with_frames(&dir());
    let mut engine = engine(&cpu);
    let results = engine.encode(&requests, true).unwrap();
    assert!(results.iter().all(|r| r.step == 0), "one step fits all");
    // Tolerance: rel. Frobenius 1e-5, max abs 1e-4 (the model issue's bounds).
    assert_outputs_match(&results, &expected, 1e-5, &cpu.description);
    // Each image request alone (as Qwen2-VL's isolation test takes them; the random patches of
    // the two frames, far from normalised pixels, move by 1.02e-6 alone).
    let images = requests.len() - 1;
    for (request, mixed) in requests.iter().zip(&results).take(images) {
        let alone = engine.encode(std::slice::from_ref(request), true).unwrap();
        let tower = |r: &Encoded| r.tower.as_ref().unwrap().values.clone();
        for (name, alone, mixed) in [
            (
                "embeds",
                alone[0].embeds.values.clone(),
                mixed.embeds.values.clone(),
            ),
            ("tower", tower(&alone[0]), tower(mixed)),
        ] {
            let (rel, _) = errors(&alone, &mixed);
            // Tolerance: 1e-6 relative; the same rows through the same kernels, only the
            // other rows of the matmuls differ.
            assert!(
                rel <= 1e-6,
                "{} {name} alone against mixed: rel {rel:e}",
                request.id
            );
        }
    }
}

/// The same on wgpu, with the device's default kernels.
#[test]
fn a_mixed_batch_matches_peft_on_wgpu() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    let expected = Expected::load_from(&dir());
    let results = engine(&gpu)
        .encode(&requests_with_frames(&dir()), true)
        .unwrap();
    // Tolerance: rel. Frobenius 1e-4 (GPU summation order), max abs 1e-4.
    assert_outputs_match(&results, &expected, 1e-4, &gpu.description);
}

/// An adapter of one family on the other's model is refused, naming its file and a key that
/// targets a layer the model does not have; the engine is left as it was.
#[test]
fn adapters_of_the_other_family_are_refused_by_key() {
    let cpu = device::cpu();
    let qwen2_vl = family_dir("qwen2-vl");
    for (model, adapter) in [
        (dir(), qwen2_vl.join("adapters/all-r4")),
        (qwen2_vl.clone(), dir().join("adapters/patterns")),
    ] {
        let mut engine = Engine::open(&model, cpu.clone(), EngineOptions::default()).unwrap();
        let error = engine
            .load_adapter("other", &adapter)
            .unwrap_err()
            .to_string();
        let says = " is not a LoRA target of this model";
        assert!(
            error.contains("adapter_model.safetensors") && error.ends_with(says),
            "{error}"
        );
        // The module named is one the model lacks (whichever key the check meets first).
        let module = error[..error.len() - says.len()]
            .trim_end_matches('`')
            .rsplit('`')
            .next()
            .unwrap();
        assert!(module.starts_with("blocks."), "{module}: {error}");
        let targets = engine.model().lora_targets();
        assert!(
            !targets.iter().any(|t| t.path == module),
            "{module}: {error}"
        );
        assert!(engine.adapter_names().is_empty());
    }
}
