//! The Qwen2-VL tower and connector against transformers (+ PEFT) on the fixture model.

mod common;

use burn::tensor::{Tensor, TensorData};
use common::{Expected, fixture_dir, requests};
use mmlora::device::{self, RuntimeDevice};
use mmlora::lora::meta::{KernelMeta, NO_SLOT};
use mmlora::lora::ops::LoraBatch;
use mmlora::model::qwen2_vl::Qwen2VlVision;

/// Relative Frobenius error and max abs error of `actual` against `expected`.
fn errors(actual: &Tensor<2>, expected: &[f32]) -> (f64, f64) {
    let actual = actual.clone().into_data().try_to_vec::<f32>().unwrap();
    assert_eq!(actual.len(), expected.len());
    let (mut diff, mut norm, mut worst) = (0.0f64, 0.0f64, 0.0f64);
    for (a, e) in actual.iter().zip(expected) {
        let d = f64::from(a - e);
        diff += d * d;
        norm += f64::from(*e) * f64::from(*e);
        worst = worst.max(d.abs());
    }
    ((diff / norm).sqrt(), worst)
}

fn no_lora(rows: usize, device: &RuntimeDevice) -> LoraBatch {
    LoraBatch::new(
        KernelMeta::from_token_slots(vec![NO_SLOT; rows], 1).unwrap(),
        &device.device,
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
            let (rel, worst) = errors(actual, &want);
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

/// Every request of the fixture's mixed batch, in ONE forward with all adapters slotted, and
/// each request alone; both against transformers + PEFT.
fn mixed_batch_matches(on: &RuntimeDevice, rel_tol: f64) {
    use mmlora::adapters::{PeftAdapter, install};
    use mmlora::lora::meta::SlotTable;
    use mmlora::mapping::{
        AdapterRequest, EncoderCache, LoraState, MmFeature, Modality, PlaceholderRange,
        SpatialMergeCounts, set_active_mm_loras,
    };
    use std::collections::HashMap;

    let expected = Expected::load();
    let requests = requests();
    let mut model = Qwen2VlVision::load(&fixture_dir(), &on.device).unwrap();
    let targets = model.lora_targets();
    let mut names: Vec<String> = requests.iter().filter_map(|r| r.adapter.clone()).collect();
    names.sort();
    names.dedup();
    let adapters: Vec<PeftAdapter> = names
        .iter()
        .map(|n| {
            PeftAdapter::load(n, &fixture_dir().join("adapters").join(n), &targets, 64).unwrap()
        })
        .collect();
    // Adapter ids 1.. in name order; slot i holds adapter id i + 1.
    let id_of = |name: &str| names.iter().position(|n| n == name).unwrap() as u32 + 1;
    let slotted: Vec<Option<&PeftAdapter>> = adapters.iter().map(Some).collect();
    install(&mut model, &slotted, &on.device);
    let table = SlotTable::for_adapters(1..=names.len() as u32, names.len()).unwrap();

    // The inputs, and the mapping builder over the requests (one image each).
    let inputs: Vec<(Vec<f32>, [usize; 3])> = requests
        .iter()
        .map(|r| {
            let file = r.image.trim_start_matches("images/");
            let (pixels, _) = expected.f32(&format!("{file}.pixel_values"));
            let g = expected.i64(&format!("{file}.image_grid_thw"));
            (pixels, [g[0] as usize, g[1] as usize, g[2] as usize])
        })
        .collect();
    let run = |which: &[usize]| -> Vec<(Tensor<2>, Tensor<2>)> {
        let mut cache = EncoderCache::default();
        let mut state = LoraState::new(which.len());
        let mut index = HashMap::new();
        let mut schedule = Vec::new();
        for (b, &i) in which.iter().enumerate() {
            let req = format!("request{i}");
            let grid = inputs[i].1;
            cache.mm_features.insert(
                req.clone(),
                vec![MmFeature {
                    identifier: req.clone(),
                    modality: Modality::Image,
                    position: PlaceholderRange::new(0, grid.iter().product::<usize>() / 4),
                    has_data: true,
                }],
            );
            let adapter = requests[i].adapter.as_deref().map(|n| AdapterRequest {
                name: n.to_owned(),
                id: id_of(n),
                path: fixture_dir().join("adapters").join(n),
            });
            state.add_request(&req, b, adapter).unwrap();
            index.insert(req.clone(), b);
            schedule.push((req, vec![0]));
        }
        let activation = set_active_mm_loras(
            &SpatialMergeCounts { merge: 2 },
            &cache,
            &index,
            &state,
            &schedule,
        )
        .unwrap()
        .unwrap();
        let tower = LoraBatch::new(
            KernelMeta::from_mapping(&activation.tower, &table).unwrap(),
            &on.device,
        );
        let connector = LoraBatch::new(
            KernelMeta::from_mapping(activation.connector.as_ref().unwrap(), &table).unwrap(),
            &on.device,
        );
        let pixels: Vec<f32> = which.iter().flat_map(|&i| inputs[i].0.clone()).collect();
        let grids: Vec<[usize; 3]> = which.iter().map(|&i| inputs[i].1).collect();
        let rows: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
        let x = Tensor::<2>::from_data(TensorData::new(pixels, [rows, 1176]), &on.device);
        let out = model.forward(x, &grids, &tower, &connector).unwrap();
        let mut start = 0;
        grids
            .iter()
            .map(|g| {
                let n = g.iter().product::<usize>();
                let piece = (
                    out.tower.clone().slice(start..start + n),
                    out.embeds.clone().slice(start / 4..(start + n) / 4),
                );
                start += n;
                piece
            })
            .collect()
    };

    let all: Vec<usize> = (0..requests.len()).collect();
    let mixed = run(&all);
    for (i, (tower, embeds)) in mixed.iter().enumerate() {
        for (name, actual) in [("tower", tower), ("embeds", embeds)] {
            let (want, _) = expected.f32(&format!("request{i}.{name}"));
            let (rel, worst) = errors(actual, &want);
            assert!(
                rel <= rel_tol && worst <= 1e-4,
                "request{i} ({:?}) {name} on {}: rel {rel:e}, max {worst:e}",
                requests[i].adapter,
                on.description
            );
        }
        // Isolation: the same request alone gives the same output.
        let alone = run(&[i]).remove(0);
        for (name, together, single) in [("tower", tower, &alone.0), ("embeds", embeds, &alone.1)] {
            let single = single.clone().into_data().try_to_vec::<f32>().unwrap();
            let (rel, _) = errors(together, &single);
            assert!(
                rel <= rel_tol,
                "request{i} {name}: alone vs mixed rel {rel:e}"
            );
        }
    }
}

#[test]
fn mixed_adapter_batch_matches_peft_on_cpu() {
    // Tolerance: rel. Frobenius 1e-5, max abs 1e-4.
    mixed_batch_matches(&device::cpu(), 1e-5);
}

#[test]
fn mixed_adapter_batch_matches_peft_on_wgpu() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    // Tolerance: rel. Frobenius 1e-4 (GPU summation order), max abs 1e-4.
    mixed_batch_matches(&gpu, 1e-4);
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
