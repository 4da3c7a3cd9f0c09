//! The Qwen2-VL tower and connector against transformers on the fixture model, called directly
//! with the fixture's pixel values (the mixed-adapter batches run through the engine in
//! `tests/engine.rs`).

mod common;

use burn::tensor::{Tensor, TensorData};
use common::{Expected, errors, fixture_dir, requests};
use mmlora::models::qwen2_vl::Qwen2VlVision;
use mmlora::models::{ModelError, VisionTower};
use mmlora::ops::lora::LoraBatch;
use mmlora::routing::meta::{KernelMeta, NO_SLOT};
use mmlora::runtime::device::{self, RuntimeDevice};

fn no_lora(rows: usize, device: &RuntimeDevice) -> LoraBatch {
    LoraBatch::new(
        KernelMeta::from_token_slots(vec![NO_SLOT; rows], 1).unwrap(),
        device,
    )
}

fn base_model_matches(on: &RuntimeDevice, rel_tol: f64) {
    let expected = Expected::load();
    let model = Qwen2VlVision::load(&fixture_dir(), &on.device).unwrap();
    for (i, request) in requests().iter().enumerate() {
        if request.adapter.is_some() {
            continue;
        }
        let file = request.image.trim_start_matches("images/");
        let (pixels, shape) = expected.f32(&format!("{file}.pixel_values"));
        let grid = expected.i64(&format!("{file}.image_grid_thw"));
        let grid = [grid[0] as usize, grid[1] as usize, grid[2] as usize];
        let x = Tensor::<2>::from_data(TensorData::new(pixels, [shape[0], shape[1]]), &on.device);
        let out = model
            .forward(
                x,
                &[grid],
                &no_lora(shape[0], on),
                &no_lora(shape[0] / 4, on),
            )
            .unwrap();
        for (name, actual) in [("tower", &out.tower), ("embeds", &out.embeds)] {
            let (want, _) = expected.f32(&format!("request{i}.{name}"));
            let actual = actual.clone().into_data().try_to_vec::<f32>().unwrap();
            let (rel, worst) = errors(&actual, &want);
            assert!(
                rel <= rel_tol && worst <= 1e-4,
                "request{i} {name} on {}: rel {rel:e}, max {worst:e}",
                on.description
            );
        }
    }
}

#[test]
fn base_model_matches_transformers_on_cpu() {
    // Tolerance: rel. Frobenius 1e-5, max abs 1e-4 (f32 through two blocks and the merger).
    base_model_matches(&device::cpu(), 1e-5);
}

#[test]
fn base_model_matches_transformers_on_wgpu() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    base_model_matches(&gpu, 1e-4);
}

#[test]
fn the_fixture_adapters_move_the_output() {
    // Guards the comparisons above against vacuous passes: the same image with and without
    // an adapter differs by far more than any tolerance.
    let expected = Expected::load();
    let (with, _) = expected.f32("request0.tower");
    let (without, _) = expected.f32("request5.tower");
    let moved: f64 = with
        .iter()
        .zip(&without)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let norm: f64 = without.iter().map(|b| f64::from(*b).powi(2)).sum();
    assert!((moved / norm).sqrt() > 0.1);
}

/// Inputs the model cannot run are errors, not panics: no image at all, a grid without patches
/// (whose other sides may be anything), pixel values of another shape.
#[test]
fn forward_refuses_inputs_without_patches() {
    let cpu = device::cpu();
    let model = Qwen2VlVision::load(&fixture_dir(), &cpu.device).unwrap();
    let patch_len = model.config().patch_len();
    let pixels = |rows: usize| Tensor::<2>::zeros([rows, patch_len], &cpu.device);
    for (grids, rows) in [
        (vec![], 0),
        (vec![[0, 1 << 33, 1 << 33]], 0),
        (vec![[1, 2, 2], [1, 0, 2]], 4),
        (vec![[1, 2, 2]], 5),
    ] {
        match model.forward(
            pixels(rows),
            &grids,
            &no_lora(rows, &cpu),
            &no_lora(rows / 4, &cpu),
        ) {
            Err(ModelError::Input(_)) => {}
            Err(other) => panic!("{grids:?} with {rows} rows: not an input error: {other}"),
            Ok(_) => panic!("{grids:?} with {rows} rows ran"),
        }
    }
}
