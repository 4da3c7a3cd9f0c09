//! Limits: Burn's attention one image at a time or in query blocks equals attention of all
//! images of one size together, and so does the fused kernel; steps capped by the device's
//! buffer limit split a batch without changing any result, and an image too large for one step
//! is refused by name.

mod common;

use burn::tensor::{Distribution, Tensor};
use common::{errors, fixture_dir, fixture_requests};
use mmlora::engine::{Encoded, Engine, EngineError, EngineOptions, ImageSource, Request};
use mmlora::models::VisionTower;
use mmlora::models::presets::qwen2_vl_2b;
use mmlora::models::qwen2_vl::Qwen2VlVision;
use mmlora::models::qwen2_vl::VisionConfig;
use mmlora::ops::attention::AttentionKernel;
use mmlora::ops::kernels::Kernels;
use mmlora::ops::lora::LoraBatch;
use mmlora::routing::meta::{KernelMeta, NO_SLOT};
use mmlora::runtime::device::{self, RuntimeDevice};

/// The tiny model's widest row: one patch of 3 × 2 × 14 × 14 values, 4 bytes each.
const TINY_ROW_BYTES: u64 = 1176 * 4;

/// Options whose stacked LoRA weights fit the small limits below: the fixture adapters' ranks
/// are at most 8.
fn options() -> EngineOptions {
    EngineOptions {
        max_rank: 8,
        ..EngineOptions::default()
    }
}

fn encode(on: &RuntimeDevice) -> (Engine, Vec<Encoded>) {
    let mut engine = Engine::open(&fixture_dir(), on.clone(), options()).unwrap();
    for name in ["all-r4", "patterns", "rslora-r8", "tower-r2"] {
        engine
            .load_adapter(name, &fixture_dir().join("adapters").join(name))
            .unwrap();
    }
    let results = engine.encode(&fixture_requests(), true).unwrap();
    (engine, results)
}

/// Four images (three of 8 × 8 patches, one of 4 × 4 third) through a random tiny model, with
/// Burn's attention (whose scores the limit bounds) taken whole (the three of one size in one
/// batched launch sequence and the other on its own), one image at a time, and in blocks of 5
/// queries; and with the fused kernel, which the limit does not split.
fn attention_in_blocks(on: &RuntimeDevice, rel_tol: f64) {
    let mut model = Qwen2VlVision::random(VisionConfig::tiny(), &on.device);
    model.set_kernels(Kernels {
        attention: AttentionKernel::Burn,
        ..model.kernels()
    });
    let heads = 2;
    let grids = [[1, 8, 8], [1, 8, 8], [1, 4, 4], [1, 8, 8]];
    let rows: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
    let x = Tensor::<2>::random([rows, 1176], Distribution::Default, &on.device);
    let none = |n| {
        LoraBatch::new(
            KernelMeta::from_token_slots(vec![NO_SLOT; n], 1).unwrap(),
            on,
        )
    };
    let run = |model: &Qwen2VlVision| -> Vec<f32> {
        model
            .forward(x.clone(), &grids, &none(rows), &none(rows / 4))
            .unwrap()
            .tower
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    };
    let whole = run(&model);
    // The scores of one 64-row image, every head, fit; two do not.
    model.set_buffer_limit((4 * heads * 64 * 64) as u64);
    let apart = run(&model);
    // Scores of 5 queries over all 64 keys fit; 6 do not.
    model.set_buffer_limit((4 * heads * 64 * 5) as u64);
    let blocks = run(&model);
    model.set_kernels(Kernels {
        attention: AttentionKernel::Fused,
        ..model.kernels()
    });
    let fused = run(&model);
    for (how, got) in [
        ("one image at a time", apart),
        ("in query blocks", blocks),
        ("fused", fused),
    ] {
        let (rel, _) = errors(&got, &whole);
        assert!(rel <= rel_tol, "{how} on {}: rel {rel:e}", on.description);
    }
}

#[test]
fn attention_apart_or_in_query_blocks_equals_attention_together_on_cpu() {
    // Tolerance: rel. Frobenius 1e-6 (each query's softmax is its own; only the matmul shapes
    // differ).
    attention_in_blocks(&device::cpu(), 1e-6);
}

#[test]
fn attention_apart_or_in_query_blocks_equals_attention_together_on_wgpu() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    // Tolerance: rel. Frobenius 1e-5 (GPU matmul tiling differs between the shapes, and the
    // fused kernel sums in another order).
    attention_in_blocks(&gpu, 1e-5);
}

#[test]
fn a_small_buffer_limit_splits_steps_without_changing_results() {
    let cpu = device::cpu();
    let (_, whole) = encode(&cpu);
    assert!(whole.iter().all(|r| r.step == 0));
    // 40 rows per step: the fixture batch (7 images of 16–36 patches) needs several.
    let limited = RuntimeDevice {
        buffer_limit: Some(40 * TINY_ROW_BYTES),
        ..cpu
    };
    let (engine, split) = encode(&limited);
    assert_eq!(engine.step_rows(), 40);
    assert!(split.iter().any(|r| r.step > 1), "expected several steps");
    for (a, b) in whole.iter().zip(&split) {
        assert_eq!(a.id, b.id);
        // Tolerance: rel. Frobenius 1e-6 (the same rows in other steps).
        let (rel, _) = errors(&b.embeds.values, &a.embeds.values);
        assert!(rel <= 1e-6, "{}: rel {rel:e}", a.id);
    }
}

#[test]
fn an_image_larger_than_a_step_is_refused_by_name_and_the_engine_keeps_serving() {
    let limited = RuntimeDevice {
        buffer_limit: Some(20 * TINY_ROW_BYTES),
        ..device::cpu()
    };
    let mut engine = Engine::open(&fixture_dir(), limited, options()).unwrap();
    let large = Request {
        id: "large".to_owned(),
        image: ImageSource::File(fixture_dir().join("images/wide.jpg")),
        adapter: None,
    };
    match engine.encode(&[large], false) {
        Err(EngineError::TooLarge {
            request,
            rows,
            limit,
        }) => {
            assert_eq!(request, "large");
            assert!(rows > limit && limit == 20, "{rows} rows, limit {limit}");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let small = Request {
        id: "small".to_owned(),
        image: ImageSource::Decoded(image::RgbImage::new(56, 56)),
        adapter: None,
    };
    assert_eq!(
        engine.encode(&[small], false).unwrap()[0].embeds.shape[0],
        4
    );
}

#[test]
fn the_gpu_step_limit_follows_its_binding_limit() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    let limit = gpu.buffer_limit.expect("a GPU reports its binding limit");
    let engine = Engine::open(&fixture_dir(), gpu.clone(), EngineOptions::default()).unwrap();
    let model_rows =
        (limit.min(mmlora::models::qwen2_vl::DEFAULT_BUFFER_LIMIT) / TINY_ROW_BYTES) as usize / 4
            * 4;
    assert_eq!(
        engine.step_rows(),
        model_rows.min(EngineOptions::default().max_step_rows)
    );
    let mut model = Qwen2VlVision::random(qwen2_vl_2b(), &device::cpu().device);
    model.set_buffer_limit(limit);
    let rows_2b = model.max_rows();
    println!(
        "{}: binding limit {} MiB; the 2B tower there would take {rows_2b} rows per step",
        gpu.description,
        limit >> 20,
    );
    // The 2B tower's widest row is its MLP's hidden row, 1280 · 4 f32 values; a step takes whole
    // merge blocks of 2 × 2 rows.
    const QWEN2_VL_2B_ROW_BYTES: u64 = 1280 * 4 * 4;
    assert_eq!(rows_2b as u64, limit / QWEN2_VL_2B_ROW_BYTES / 4 * 4);
    assert!(rows_2b >= 4, "a step holds at least one merge block");
}
