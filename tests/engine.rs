//! The engine on the fixture model: mixed batches against transformers + PEFT, isolation,
//! steps split by `max_loras`, adapter re-loading and eviction, and refusals that leave the
//! engine as it was.

mod common;

use std::path::PathBuf;

use burn::tensor::wgpu::WgpuBackend;
use common::{
    Expected, assert_outputs_match, errors, fixture_dir, fixture_requests, pixel_values_key,
    requests_with_frames,
};
use mmlora::engine::{
    Encoded, Engine, EngineError, EngineOptions, ImageSource, Request, SharedEngine,
};
use mmlora::ops::kernels::{KernelError, KernelPins};
use mmlora::ops::linear::LinearKernel;
use mmlora::preprocess::{ImageBackend, Patches, PreprocessConfig};
use mmlora::runtime::device::{self, Precision, RuntimeDevice};

const ADAPTERS: [&str; 4] = ["all-r4", "patterns", "rslora-r8", "tower-r2"];

fn engine(on: &RuntimeDevice, options: EngineOptions) -> Engine {
    engine_on(&fixture_dir(), on, options)
}

/// The model in `model_dir` with the fixture's adapters loaded.
fn engine_on(model_dir: &std::path::Path, on: &RuntimeDevice, options: EngineOptions) -> Engine {
    let mut engine = Engine::open(model_dir, on.clone(), options).unwrap();
    for name in ADAPTERS {
        engine
            .load_adapter(name, &fixture_dir().join("adapters").join(name))
            .unwrap();
    }
    engine
}

/// One result for each request, in order, each against the fixture's transformers + PEFT
/// outputs for its id.
fn assert_matches_fixtures(requests: &[Request], results: &[Encoded], rel_tol: f64, on: &str) {
    let ids: Vec<&str> = results.iter().map(|r| r.id.as_str()).collect();
    assert!(
        ids.iter()
            .copied()
            .eq(requests.iter().map(|r| r.id.as_str())),
        "on {on}: results {ids:?}"
    );
    assert_outputs_match(results, &Expected::load(), rel_tol, on);
}

#[test]
fn two_frames_match_peft_beside_images_on_cpu_and_wgpu() {
    let requests = requests_with_frames(&fixture_dir());
    let mut devices = vec![device::cpu()];
    devices.extend(device::gpu_for_tests());
    for on in devices {
        let results = engine(&on, EngineOptions::default())
            .encode(&requests, true)
            .unwrap();
        // Tolerance: rel. Frobenius 1e-5 on the CPU, 1e-4 on wgpu (GPU summation order), max
        // abs 1e-4, as for the images.
        let rel_tol = if on.wgpu.is_some() { 1e-4 } else { 1e-5 };
        assert_matches_fixtures(&requests, &results, rel_tol, &on.description);
    }
}

#[test]
fn a_mixed_batch_from_image_files_matches_peft_on_cpu() {
    let cpu = device::cpu();
    let results = engine(&cpu, EngineOptions::default())
        .encode(&fixture_requests(), true)
        .unwrap();
    assert_eq!(results.len(), 7);
    assert!(results.iter().all(|r| r.step == 0), "one step fits all");
    // Tolerance: rel. Frobenius 1e-5, max abs 1e-4 (the model issue's bounds).
    assert_matches_fixtures(&fixture_requests(), &results, 1e-5, &cpu.description);
}

/// With the default linears, attention and LoRA kernels, with the linears timed per shape,
/// with each attention kernel, with the wide LoRA kernels, and with the tiled linears, which
/// take the LoRA op fused into their products where the stacked rank is a multiple of 4.
#[test]
fn a_mixed_batch_from_image_files_matches_peft_on_wgpu() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    for pins in [
        "",
        "linear=timed",
        "attention=fused",
        "attention=burn",
        "shrink=wide",
        "linear=tiled,shrink=split",
    ] {
        let options = EngineOptions {
            kernels: pins.parse().unwrap(),
            ..EngineOptions::default()
        };
        let results = engine(&gpu, options)
            .encode(&fixture_requests(), true)
            .unwrap();
        // Tolerance: rel. Frobenius 1e-4 (GPU summation order), max abs 1e-4.
        let on = format!("{}, kernels {}", gpu.description, options.kernels);
        assert_matches_fixtures(&fixture_requests(), &results, 1e-4, &on);
    }
}

/// The graphics APIs the next test must find an adapter on: `MMLORA_GRAPHICS_APIS`, a
/// comma-separated list (`.ci/run` sets `vulkan,gl`: lavapipe and llvmpipe through EGL).
fn required_graphics_apis() -> Vec<WgpuBackend> {
    std::env::var("MMLORA_GRAPHICS_APIS")
        .unwrap_or_default()
        .split(',')
        .filter(|name| !name.trim().is_empty())
        .map(|name| device::backend_named(name.trim()).unwrap())
        .collect()
}

/// The fixture batch on every graphics API wgpu finds besides the one the other GPU tests run
/// on (GL beside Vulkan on Linux, say): our shaders reach each API through its own translation
/// (naga's SPIR-V, GLSL, MSL, HLSL) and its own driver. Each API runs the default kernels (on a
/// software GPU the ones built for it) and the ones for hardware GPUs (tiled linears, the split
/// shrink).
#[test]
fn a_mixed_batch_matches_peft_on_every_other_graphics_api() {
    let found = device::graphics_apis();
    for api in required_graphics_apis() {
        assert!(
            found.contains(&api),
            "MMLORA_GRAPHICS_APIS asks for {api:?}, and wgpu finds adapters on {found:?} only"
        );
    }
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    let others: Vec<WgpuBackend> = found
        .iter()
        .copied()
        .filter(|api| Some(*api) != gpu.graphics_api())
        .collect();
    if others.is_empty() {
        eprintln!("wgpu finds adapters on {found:?} only: no other graphics API to run on");
    }
    for api in others {
        let other = device::gpu_on(api).unwrap_or_else(|e| panic!("{api:?}: {e}"));
        for pins in ["", "linear=tiled,shrink=split"] {
            let options = EngineOptions {
                kernels: pins.parse().unwrap(),
                ..EngineOptions::default()
            };
            let results = engine(&other, options)
                .encode(&fixture_requests(), true)
                .unwrap();
            let on = format!("{}, kernels {}", other.description, options.kernels);
            // Tolerance: rel. Frobenius 1e-4 (GPU summation order), max abs 1e-4, as on the
            // default API.
            assert_matches_fixtures(&fixture_requests(), &results, 1e-4, &on);
            eprintln!("matches PEFT on {on}");
        }
    }
}

/// The GPU for the f16 tests: one with `SHADER_F16` ([`device::f16_for_tests`]).
fn f16_gpu() -> Option<RuntimeDevice> {
    device::gpu_for_tests().filter(device::f16_for_tests)
}

/// f16 against PEFT in f32, with the default linears, the kernels timed per shape and, where
/// the device has cooperative matrices, with `coop`'s.
#[test]
fn f16_on_the_gpu_stays_close_to_peft_in_f32() {
    let Some(gpu) = f16_gpu() else {
        return;
    };
    let expected = Expected::load();
    let mut kernels = vec![LinearKernel::Auto, LinearKernel::Timed];
    for kernel in LinearKernel::COOP {
        if kernel.coop_subgroup(&gpu).is_some() {
            kernels.push(kernel);
        }
    }
    for linear_kernel in kernels {
        let options = EngineOptions {
            precision: Precision::F16,
            kernels: KernelPins {
                linear: linear_kernel,
                ..KernelPins::default()
            },
            ..EngineOptions::default()
        };
        let results = engine(&gpu, options)
            .encode(&fixture_requests(), true)
            .unwrap();
        let mut worst_rel: f64 = 0.0;
        for result in &results {
            let tower = result.tower.as_ref().expect("asked for the tower");
            for (name, actual) in [("tower", &tower.values), ("embeds", &result.embeds.values)] {
                let (want, _) = expected.f32(&format!("{}.{name}", result.id));
                let (rel, _) = errors(actual, &want);
                worst_rel = worst_rel.max(rel);
                // Tolerance: rel. Frobenius 4e-3 — f16 keeps 11 bits (unit roundoff 4.9e-4),
                // and weights, activations and each matmul's output are rounded to it through
                // two blocks and the merger; measured 1.44e-3 at worst on lavapipe.
                assert!(
                    rel <= 4e-3,
                    "{} ({:?}) {name} in f16, {linear_kernel} linears: rel {rel:e}",
                    result.id,
                    result.adapter,
                );
            }
        }
        eprintln!(
            "f16 ({linear_kernel} linears) against PEFT f32: worst rel. Frobenius error {worst_rel:e}"
        );
        // An f32 run is within 1e-5 (above): f16's rounding must show, or it did not run in f16.
        assert!(
            worst_rel > 1e-4,
            "f16 results as exact as f32 ({worst_rel:e}): the model did not compute in f16"
        );
    }
}

#[test]
fn an_adapter_beyond_f16_is_refused_in_f16_and_changes_nothing() {
    let Some(gpu) = f16_gpu() else {
        return;
    };
    let options = EngineOptions {
        precision: Precision::F16,
        ..EngineOptions::default()
    };
    let mut engine = engine(&gpu, options);
    let names = engine.adapter_names();
    let targets = engine.model().lora_targets();
    let mut adapter = mmlora::bench::random_adapter("loud", &targets, 4, 0);
    let path = targets[0].path.clone();
    // Cast to f16 it would be infinite, and so would every row on this adapter.
    adapter.modules.get_mut(&path).unwrap().b[3] = 7e4;
    let error = engine.insert_adapter(adapter.clone()).unwrap_err();
    assert!(
        error.to_string().contains(&path) && error.to_string().contains("f16"),
        "{error}"
    );
    assert_eq!(engine.adapter_names(), names);
    // The same adapter serves in f32.
    let mut f32_engine = Engine::open(&fixture_dir(), gpu, EngineOptions::default()).unwrap();
    f32_engine.insert_adapter(adapter).unwrap();
}

#[test]
fn an_adapter_holding_nan_is_refused_and_changes_nothing_alone_or_shared() {
    let cpu = device::cpu();
    let mut engine = engine(&cpu, EngineOptions::default());
    let names = engine.adapter_names();
    let targets = engine.model().lora_targets();
    let mut adapter = mmlora::bench::random_adapter("all-r4", &targets, 4, 0);
    let path = targets[1].path.clone();
    adapter.modules.get_mut(&path).unwrap().a[5] = f32::NAN;
    let error = engine.insert_adapter(adapter.clone()).unwrap_err();
    assert!(
        error.to_string().contains(&path) && error.to_string().contains("NaN"),
        "{error}"
    );
    // The same through a shared engine, which checks before taking its lock.
    let shared = SharedEngine::new(engine);
    let error = shared.insert_adapter(adapter).unwrap_err();
    assert!(error.to_string().contains("NaN"), "{error}");
    // all-r4 keeps its weights from the fixture.
    assert_eq!(shared.adapter_names().unwrap(), names);
    let results = shared.encode(&fixture_requests(), true).unwrap();
    assert_matches_fixtures(&fixture_requests(), &results, 1e-5, &cpu.description);
}

/// A copy of the fixture model under `dir` whose tensors are `edit`ed by name (the fixture
/// writes them in f32).
fn model_with(dir: &std::path::Path, edit: impl Fn(&str, &mut [f32])) -> PathBuf {
    let model = dir.join("model");
    common::copy_dir(&fixture_dir(), &model);
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        common::rewrite_safetensors(&model.join(shard), |name, dtype, shape, bytes| {
            let mut values: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            edit(name, &mut values);
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            common::keep(name, dtype, shape, &bytes)
        });
    }
    model
}

/// [`model_with`] `merger.mlp.2.weight` `edit`ed.
fn model_with_merger_weight(dir: &std::path::Path, edit: impl Fn(&mut [f32])) -> PathBuf {
    model_with(dir, |name, values| {
        if name == "model.visual.merger.mlp.2.weight" {
            edit(values);
        }
    })
}

#[test]
fn a_model_weight_beyond_f16_is_refused_in_f16_and_serves_in_f32() {
    let Some(gpu) = f16_gpu() else {
        return;
    };
    let tmp = tempfile::TempDir::new().unwrap();
    // Cast to f16 it would be infinite (f16's largest is 65504).
    let model = model_with_merger_weight(tmp.path(), |w| w[7] = -7e4);
    let options = EngineOptions {
        precision: Precision::F16,
        ..EngineOptions::default()
    };
    let error = Engine::open(&model, gpu.clone(), options).unwrap_err();
    assert!(
        matches!(&error, EngineError::WeightBeyondF16 { tensor, largest }
            if tensor == "merger.mlp.2.weight" && *largest == 7e4),
        "{error}"
    );
    engine_on(&model, &gpu, EngineOptions::default())
        .encode(&fixture_requests(), false)
        .unwrap();
}

/// Weights f16 holds can still overflow it on the way: the step fails, naming the request,
/// rather than handing back infinite embeddings; the same model in f32 serves.
#[test]
fn an_output_beyond_f16_fails_the_step_naming_the_request() {
    let Some(gpu) = f16_gpu() else {
        return;
    };
    let tmp = tempfile::TempDir::new().unwrap();
    // Every embedding is 6e4 × (the sum of a merged row's 128 GELU outputs) + bias: beyond
    // 65504 unless that sum is below 1.1.
    let model = model_with_merger_weight(tmp.path(), |w| w.fill(6e4));
    let options = EngineOptions {
        precision: Precision::F16,
        ..EngineOptions::default()
    };
    let mut engine = engine_on(&model, &gpu, options);
    let requests = fixture_requests();
    let error = engine.encode(&requests, false).unwrap_err();
    assert!(
        matches!(&error, EngineError::NotFinite { request, output: "embeddings", .. }
            if requests.iter().any(|r| &r.id == request)),
        "{error}"
    );
    assert!(error.to_string().contains("run it in f32"), "{error}");
    let results = engine_on(&model, &gpu, EngineOptions::default())
        .encode(&requests, false)
        .unwrap();
    assert!(
        results
            .iter()
            .all(|r| r.embeds.values.iter().all(|v| v.is_finite()))
    );
}

/// Attention scores whose unscaled products f16 cannot hold, scaled within it: in f16 the
/// rotated `q` carries the scale, so the step runs (an unscaled `q·kᵀ` was infinite, and the
/// step failed as not finite) and stays close to the same model in f32.
#[test]
fn f16_attention_scales_q_before_its_product_with_k() {
    let Some(gpu) = f16_gpu() else {
        return;
    };
    let tmp = tempfile::TempDir::new().unwrap();
    // Block 0's largest |q·k| over the fixture images is 11.5 to 17.8 (transformers, f32), so
    // q and k × 86 make it 85 000 to 132 000 (beyond f16's 65 504), and with the scale of
    // 1/√16 21 000 to 33 000.
    let model = model_with(tmp.path(), |name, values| {
        if name.starts_with("model.visual.blocks.0.attn.qkv.") {
            let q_and_k = values.len() / 3 * 2; // rows, or biases, of q then k then v
            values[..q_and_k].iter_mut().for_each(|v| *v *= 86.0);
        }
    });
    let options = EngineOptions {
        precision: Precision::F16,
        ..EngineOptions::default()
    };
    let results = engine_on(&model, &gpu, options)
        .encode(&fixture_requests(), true)
        .unwrap();
    // The same model in f32: scores this large make each softmax nearly one-hot, and f16's
    // rounding of them (16 at 30 000) rarely changes which key wins.
    let in_f32 = engine_on(&model, &gpu, EngineOptions::default())
        .encode(&fixture_requests(), true)
        .unwrap();
    for (result, want) in results.iter().zip(&in_f32) {
        let tower = result.tower.as_ref().unwrap();
        let tower_f32 = &want.tower.as_ref().unwrap().values;
        for (name, got, want) in [
            ("tower", &tower.values, tower_f32),
            ("embeds", &result.embeds.values, &want.embeds.values),
        ] {
            // Tolerance: rel. Frobenius 4e-3, the f16 bound against PEFT's f32 above (measured
            // here on lavapipe: 0.8e-3 to 1.2e-3 on the embeddings).
            let (rel, _) = errors(got, want);
            assert!(rel <= 4e-3, "{} {name}: rel {rel:e}", result.id);
        }
    }
}

#[test]
fn f16_is_refused_where_the_device_cannot_compute_it() {
    let options = EngineOptions {
        precision: Precision::F16,
        ..EngineOptions::default()
    };
    let error = Engine::open(&fixture_dir(), device::cpu(), options).unwrap_err();
    assert!(
        matches!(&error, EngineError::Options(m) if m.contains("SHADER_F16")),
        "{error}"
    );
}

/// `image_backend` picks whose pixels the engine computes: with `Pil`, an image file encodes
/// exactly as the PIL backend's pixel values from the fixture do, and differently from the
/// default (torchvision) where the image is resized.
#[test]
fn the_image_backend_option_picks_the_processor() {
    let expected = Expected::load();
    let file = "rgba.png";
    let (pil_pixels, _) = expected.f32(&pixel_values_key(file, ImageBackend::Pil));
    let grid = expected.i64(&format!("{file}.image_grid_thw"));
    let request = |image| Request {
        id: "r".to_owned(),
        image,
        adapter: Some("all-r4".to_owned()),
    };
    let from_file = request(ImageSource::File(fixture_dir().join("images").join(file)));
    let from_pixels = request(ImageSource::Patches(Patches {
        pixel_values: pil_pixels,
        grid_thw: [grid[0] as usize, grid[1] as usize, grid[2] as usize],
    }));
    let embeds = |backend, request: &Request| {
        let options = EngineOptions {
            image_backend: backend,
            ..EngineOptions::default()
        };
        let mut results = engine(&device::cpu(), options)
            .encode(std::slice::from_ref(request), false)
            .unwrap();
        results.remove(0).embeds.values
    };
    let pil = embeds(ImageBackend::Pil, &from_file);
    assert_eq!(pil, embeds(ImageBackend::Pil, &from_pixels));
    assert_ne!(pil, embeds(ImageBackend::Torchvision, &from_file));
}

#[test]
fn an_image_given_as_bytes_gives_what_its_file_gives() {
    let mut engine = engine(&device::cpu(), EngineOptions::default());
    let files = fixture_requests();
    let as_bytes: Vec<Request> = files
        .iter()
        .map(|request| {
            let ImageSource::File(path) = &request.image else {
                panic!("the fixture batch names files")
            };
            Request {
                image: ImageSource::Encoded(std::fs::read(path).unwrap()),
                ..request.clone()
            }
        })
        .collect();
    let from_files = engine.encode(&files, true).unwrap();
    let from_bytes = engine.encode(&as_bytes, true).unwrap();
    for (file, bytes) in from_files.iter().zip(&from_bytes) {
        // The same pixels through the same step: equal to the bit.
        assert_eq!(file.embeds, bytes.embeds, "{}", file.id);
        assert_eq!(file.tower, bytes.tower, "{}", file.id);
    }
}

#[test]
fn more_adapters_than_slots_run_in_several_steps_with_the_same_results() {
    let cpu = device::cpu();
    let options = EngineOptions {
        max_loras: 1,
        max_cpu_adapters: 1, // every adapter but the last is evicted and read back from disk
        ..EngineOptions::default()
    };
    let results = engine(&cpu, options)
        .encode(&fixture_requests(), true)
        .unwrap();
    let steps = results.iter().map(|r| r.step).max().unwrap() + 1;
    assert_eq!(steps, 4, "four distinct adapters, one slot");
    assert_matches_fixtures(&fixture_requests(), &results, 1e-5, &cpu.description);
}

#[test]
fn a_step_needing_a_slot_frees_the_one_used_least_recently() {
    let cpu = device::cpu();
    let options = EngineOptions {
        max_loras: 2,
        ..EngineOptions::default()
    };
    let mut engine = engine(&cpu, options);
    // Each time, the fixture request with that adapter, checked: a slot given to another
    // adapter must serve that adapter's weights.
    let mut on = |adapter: &str| {
        let request: Vec<Request> = fixture_requests()
            .into_iter()
            .filter(|r| r.adapter.as_deref() == Some(adapter))
            .take(1)
            .collect();
        let results = engine.encode(&request, true).unwrap();
        // Tolerance: rel. Frobenius 1e-5, max abs 1e-4 (the model issue's bounds).
        assert_matches_fixtures(&request, &results, 1e-5, &cpu.description);
        engine.slotted()
    };
    let slots = |names: [&str; 2]| names.map(|n| Some(n.to_owned())).to_vec();
    on("all-r4");
    assert_eq!(on("patterns"), slots(["all-r4", "patterns"]));
    on("all-r4");
    // patterns was used less recently than all-r4 (in slot 0, which slot order would free).
    assert_eq!(on("tower-r2"), slots(["all-r4", "tower-r2"]));
    assert_eq!(on("rslora-r8"), slots(["rslora-r8", "tower-r2"]));
}

/// A slot whose adapter's weights left memory keeps them on the device until a step needs its
/// room: freeing it at once would restack every slot for nothing.
#[test]
fn a_slot_whose_weights_left_memory_is_freed_only_for_room() {
    let cpu = device::cpu();
    let options = EngineOptions {
        max_loras: 2,
        max_cpu_adapters: 2,
        ..EngineOptions::default()
    };
    let mut engine = Engine::open(&fixture_dir(), cpu, options).unwrap();
    let load = |engine: &mut Engine, name: &str| {
        let dir = fixture_dir().join("adapters").join(name);
        engine.load_adapter(name, &dir).unwrap();
    };
    let on = |engine: &mut Engine, adapter: &str| {
        let request = Request {
            adapter: Some(adapter.to_owned()),
            ..fixture_requests().remove(0)
        };
        engine.encode(&[request], false).unwrap();
        engine.slotted()
    };
    let slots = |names: [&str; 2]| names.map(|n| Some(n.to_owned())).to_vec();
    load(&mut engine, "patterns");
    load(&mut engine, "all-r4");
    on(&mut engine, "patterns");
    assert_eq!(on(&mut engine, "all-r4"), slots(["patterns", "all-r4"]));
    // Two adapters' weights in memory at most: loading tower-r2 evicts patterns'.
    load(&mut engine, "tower-r2");
    assert_eq!(on(&mut engine, "all-r4"), slots(["patterns", "all-r4"]));
    // tower-r2 needs a slot: patterns', whose weights left memory, goes first.
    assert_eq!(on(&mut engine, "tower-r2"), slots(["tower-r2", "all-r4"]));
}

/// A rebuilt engine keeps the adapters held in memory as they were (one built in memory, whose
/// folder does not exist, included) and reads evicted ones back only when a request needs them.
#[test]
fn a_rebuilt_engine_keeps_the_weights_in_memory_and_reads_back_only_what_it_needs() {
    let tmp = tempfile::TempDir::new().unwrap();
    let gone = tmp.path().join("gone");
    common::copy_dir(&fixture_dir().join("adapters/all-r4"), &gone);
    let cpu = device::cpu();
    let options = EngineOptions {
        max_loras: 2,
        max_cpu_adapters: 2,
        ..EngineOptions::default()
    };
    let mut engine = Engine::open(&fixture_dir(), cpu.clone(), options).unwrap();
    engine.load_adapter("gone", &gone).unwrap();
    let targets = engine.model().lora_targets();
    let mut in_memory = mmlora::bench::random_adapter("in-memory", &targets, 4, 1);
    in_memory.dir = tmp.path().join("never-written");
    engine.insert_adapter(in_memory).unwrap();
    engine
        .load_adapter("tower-r2", &fixture_dir().join("adapters/tower-r2"))
        .unwrap(); // evicts gone's weights from memory
    std::fs::remove_dir_all(&gone).unwrap();
    let request = |adapter: &str| Request {
        adapter: Some(adapter.to_owned()),
        ..fixture_requests().remove(0)
    };
    let before = engine.encode(&[request("in-memory")], false).unwrap();

    let mut rebuilt = engine.rebuild(cpu).unwrap();
    assert_eq!(rebuilt.adapter_names(), ["gone", "in-memory", "tower-r2"]);
    let after = rebuilt.encode(&[request("in-memory")], false).unwrap();
    // Tolerance: none; the same weights through the same kernels.
    assert_eq!(after[0].embeds, before[0].embeds);
    let error = rebuilt.encode(&[request("gone")], false).unwrap_err();
    assert!(error.to_string().contains("gone"), "{error}");
}

/// Each request alone, and the batch in reverse order, against the batch in order.
fn a_request_alone_equals_its_row_of_any_batch(on: &RuntimeDevice, rel_tol: f64) {
    let mut engine = engine(on, EngineOptions::default());
    let all = fixture_requests();
    let together = engine.encode(&all, true).unwrap();
    let mut reversed = all.clone();
    reversed.reverse();
    let reversed = engine.encode(&reversed, true).unwrap();
    for (i, request) in all.iter().enumerate() {
        let alone = engine.encode(std::slice::from_ref(request), true).unwrap();
        let other = reversed.iter().find(|r| r.id == request.id).unwrap();
        for candidate in [&alone[0], other] {
            let (rel, _) = errors(&candidate.embeds.values, &together[i].embeds.values);
            assert!(rel <= rel_tol, "{}: embeds moved by {rel:e}", request.id);
            let (rel, _) = errors(
                &candidate.tower.as_ref().unwrap().values,
                &together[i].tower.as_ref().unwrap().values,
            );
            assert!(rel <= rel_tol, "{}: tower moved by {rel:e}", request.id);
        }
    }
}

#[test]
fn a_request_alone_equals_its_row_of_any_batch_on_cpu() {
    // Tolerance: 1e-6 relative; the same rows through the same kernels, only the other rows of
    // the matmuls differ.
    a_request_alone_equals_its_row_of_any_batch(&device::cpu(), 1e-6);
}

#[test]
fn a_request_alone_equals_its_row_of_any_batch_on_wgpu() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    // Tolerance: 1e-6 relative, as on the CPU (autotuning may pick other matmul kernels for
    // other row counts, which changes the summation order only).
    a_request_alone_equals_its_row_of_any_batch(&gpu, 1e-6);
}

#[test]
fn reloading_a_name_serves_the_new_content_and_a_failed_load_changes_nothing() {
    let cpu = device::cpu();
    let mut engine = Engine::open(&fixture_dir(), cpu.clone(), EngineOptions::default()).unwrap();
    let adapters = fixture_dir().join("adapters");
    let image = |adapter: &str| Request {
        id: "request0".to_owned(),
        image: ImageSource::File(fixture_dir().join("images/square.png")),
        adapter: Some(adapter.to_owned()),
    };
    engine
        .load_adapter("mine", &adapters.join("all-r4"))
        .unwrap();
    let first = engine.encode(&[image("mine")], true).unwrap();
    assert_matches_fixtures(&[image("mine")], &first, 1e-5, "cpu"); // request0 is square.png with all-r4

    // A failed load (a folder that is not an adapter) leaves "mine" as it was.
    let error = engine
        .load_adapter("mine", &fixture_dir().join("images"))
        .unwrap_err();
    assert!(matches!(error, EngineError::Adapter(_)), "{error}");
    assert_eq!(engine.adapter_names(), ["mine"]);
    let again = engine.encode(&[image("mine")], true).unwrap();
    assert_eq!(again[0].embeds, first[0].embeds);

    // The same name with other weights: the stacked slots must not serve the old ones.
    engine
        .load_adapter("mine", &adapters.join("tower-r2"))
        .unwrap();
    let reloaded = engine.encode(&[image("mine")], true).unwrap();
    let (moved, _) = errors(&reloaded[0].embeds.values, &first[0].embeds.values);
    assert!(moved > 1e-3, "re-loaded adapter served stale weights");
    engine
        .load_adapter("tower-r2", &adapters.join("tower-r2"))
        .unwrap();
    let direct = engine.encode(&[image("tower-r2")], true).unwrap();
    assert_eq!(reloaded[0].embeds, direct[0].embeds);

    engine.unload_adapter("mine").unwrap();
    assert!(matches!(
        engine.unload_adapter("mine"),
        Err(EngineError::NotLoaded(_))
    ));
}

#[test]
fn bad_requests_are_refused_before_anything_runs() {
    let cpu = device::cpu();
    let mut engine = engine(&cpu, EngineOptions::default());
    let good = fixture_requests();

    let mut duplicate = good.clone();
    duplicate[3].id = duplicate[0].id.clone();
    let error = engine.encode(&duplicate, false).unwrap_err();
    assert!(
        matches!(&error, EngineError::DuplicateRequest(id) if id == "request0"),
        "{error}"
    );

    let mut unknown = good.clone();
    unknown[2].adapter = Some("nope".to_owned());
    let error = engine.encode(&unknown, false).unwrap_err();
    assert!(error.to_string().contains("request2") && error.to_string().contains("nope"));

    let mut missing = good.clone();
    missing[1].image = ImageSource::File(fixture_dir().join("images/missing.png"));
    let error = engine.encode(&missing, false).unwrap_err();
    assert!(error.to_string().contains("missing.png"), "{error}");

    let mut not_an_image = good.clone();
    not_an_image[5].image = ImageSource::Encoded(b"GIF89a, not one we decode".to_vec());
    let error = engine.encode(&not_an_image, false).unwrap_err();
    assert!(
        matches!(&error, EngineError::Image { request, .. } if request == "request5"),
        "{error}"
    );
    assert!(error.to_string().contains("image bytes"), "{error}");

    let mut bad_patches = good.clone();
    bad_patches[4].image = ImageSource::Patches(mmlora::preprocess::Patches {
        pixel_values: vec![0.0; 10],
        grid_thw: [1, 2, 2],
    });
    let error = engine.encode(&bad_patches, false).unwrap_err();
    assert!(error.to_string().contains("request4"), "{error}");
    // Grids whose rows (2^64) or values (2^56 rows of 1176) overflow a usize: wrapped, the
    // first would count 0 rows and pass for an empty buffer.
    for grid_thw in [[1, 1 << 32, 1 << 32], [1, 1 << 28, 1 << 28]] {
        bad_patches[4].image = ImageSource::Patches(mmlora::preprocess::Patches {
            pixel_values: Vec::new(),
            grid_thw,
        });
        let error = engine.encode(&bad_patches, false).unwrap_err();
        assert!(
            matches!(&error, EngineError::Patches { request, .. } if request == "request4"),
            "{grid_thw:?}: {error}"
        );
    }

    // Still serving, with the same results.
    let results = engine.encode(&good, true).unwrap();
    assert_matches_fixtures(&fixture_requests(), &results, 1e-5, &cpu.description);
}

#[test]
fn options_that_cannot_work_are_refused() {
    let default = EngineOptions::default;
    for (options, says) in [
        (
            EngineOptions {
                max_loras: 0,
                ..default()
            },
            "max_loras must be in",
        ),
        (
            EngineOptions {
                max_loras: mmlora::engine::MAX_LORAS + 1,
                max_cpu_adapters: mmlora::engine::MAX_LORAS + 1,
                ..default()
            },
            "max_loras must be in",
        ),
        (
            EngineOptions {
                max_loras: 8,
                max_cpu_adapters: 4,
                ..default()
            },
            "max_cpu_adapters (4)",
        ),
        (
            EngineOptions {
                max_rank: 0,
                ..default()
            },
            "max_rank must be in",
        ),
        (
            EngineOptions {
                max_rank: mmlora::ops::lora::MAX_RANK + 1,
                ..default()
            },
            "max_rank must be in",
        ),
        (
            EngineOptions {
                max_step_rows: 0,
                ..default()
            },
            "max_step_rows",
        ),
    ] {
        let error = Engine::open(&fixture_dir(), device::cpu(), options).unwrap_err();
        assert!(
            matches!(&error, EngineError::Options(m) if m.contains(says)),
            "{says}: {error}"
        );
    }
    // Kernels pinned for a GPU, on the CPU backend.
    for (pins, says) in [
        ("linear=wgsl", "the wgsl linear kernel needs a GPU"),
        ("linear=tiled", "the tiled linear kernel needs a GPU"),
        (
            "shrink=registers",
            "the registers LoRA shrink kernel needs a GPU",
        ),
    ] {
        let options = EngineOptions {
            kernels: pins.parse().unwrap(),
            ..default()
        };
        let error = Engine::open(&fixture_dir(), device::cpu(), options).unwrap_err();
        assert!(
            matches!(
                &error,
                EngineError::Kernels(KernelError::Unsupported { .. })
            ) && error.to_string().contains(says),
            "{says}: {error}"
        );
    }
    // Slots and ranks whose stacked weights would not fit one buffer of the device: 64 slots
    // of rank 64 are 1.5 MiB at attn.qkv (96 outputs), 2 MiB at the MLP (128).
    let small = RuntimeDevice {
        buffer_limit: Some(1 << 20),
        ..device::cpu()
    };
    let options = EngineOptions {
        max_loras: 64,
        max_rank: 64,
        max_cpu_adapters: 64,
        ..EngineOptions::default()
    };
    match Engine::open(&fixture_dir(), small.clone(), options) {
        Err(EngineError::Options(reason)) => assert!(
            reason.contains("1.5 MiB of LoRA weights for `blocks.0.attn.qkv`"),
            "{reason}"
        ),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("stacks of 2 MiB were accepted under a 1 MiB limit"),
    }
    let options = EngineOptions {
        max_rank: 32,
        ..options
    };
    Engine::open(&fixture_dir(), small, options).unwrap();
    // An image processor built in memory with settings it cannot run (min_pixels 0 would let a
    // thin image round to no rows), around a model built in memory.
    let model = Engine::open(&fixture_dir(), device::cpu(), EngineOptions::default())
        .unwrap()
        .model()
        .boxed_clone();
    let processor = PreprocessConfig {
        min_pixels: 0,
        ..PreprocessConfig::default()
    };
    match Engine::with_model(model, processor, device::cpu(), EngineOptions::default()) {
        Err(EngineError::Options(reason)) => assert!(reason.contains("min_pixels"), "{reason}"),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("min_pixels 0 was accepted"),
    }
}

/// The cooperative-matrix linear kernels are refused in f32 everywhere, and in f16 on a device
/// without cooperative matrices (the CPU backend, lavapipe).
#[test]
fn coop_is_refused_where_it_cannot_run() {
    let gpu = device::gpu_for_tests();
    let devices = [Some(device::cpu()), gpu].into_iter().flatten();
    let kernels = LinearKernel::COOP;
    for (device, linear_kernel) in devices.flat_map(|device| kernels.map(|k| (device.clone(), k))) {
        let coop = linear_kernel.coop_subgroup(&device).is_some();
        for precision in [Precision::F32, Precision::F16] {
            let options = EngineOptions {
                kernels: KernelPins {
                    linear: linear_kernel,
                    ..KernelPins::default()
                },
                precision,
                ..EngineOptions::default()
            };
            let opened = Engine::open(&fixture_dir(), device.clone(), options);
            let runs = coop && precision == Precision::F16;
            match opened {
                Ok(_) => assert!(
                    runs,
                    "{linear_kernel} in {precision} opened on {}",
                    device.description
                ),
                // f16 on a device without it is refused before the kernel is looked at.
                Err(error @ (EngineError::Kernels(_) | EngineError::Options(_))) => {
                    assert!(!runs, "{error}")
                }
                Err(error) => panic!("{error}"),
            }
        }
    }
}
