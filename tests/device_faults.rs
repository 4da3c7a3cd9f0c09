//! Device faults: a step the device cannot run and a lost device are typed errors; the first
//! leaves the engine working, the second is rebuilt on a new device in the same process. Each
//! test opens a device of its own, so breaking it touches nothing else.

mod common;

use common::{errors, fixture_dir};
use mmlora::engine::{Engine, EngineError, EngineOptions, ImageSource, Request, SharedEngine};
use mmlora::ops::kernels::KernelPins;
use mmlora::ops::linear::LinearKernel;
use mmlora::ops::lora::ShrinkKernel;
use mmlora::preprocess::Patches;
use mmlora::runtime::device::{self, RuntimeDevice};

fn probe() -> Vec<Request> {
    ["square.png", "wide.jpg"]
        .iter()
        .enumerate()
        .map(|(i, image)| Request {
            id: format!("probe{i}"),
            image: ImageSource::File(fixture_dir().join("images").join(image)),
            adapter: Some("all-r4".to_owned()),
        })
        .collect()
}

fn engine(on: RuntimeDevice, options: EngineOptions) -> Engine {
    let mut engine = Engine::open(&fixture_dir(), on, options).unwrap();
    engine
        .load_adapter("all-r4", &fixture_dir().join("adapters/all-r4"))
        .unwrap();
    engine
}

fn embeds(engine: &mut Engine) -> Vec<Vec<f32>> {
    engine
        .encode(&probe(), false)
        .unwrap()
        .into_iter()
        .map(|r| r.embeds.values)
        .collect()
}

fn new_gpu() -> Option<RuntimeDevice> {
    device::gpu_for_tests()?;
    Some(device::gpu_new().expect("a second device on the same adapter"))
}

#[test]
fn a_lost_device_is_a_typed_error_and_the_engine_is_rebuilt_on_a_new_one() {
    let Some(gpu) = new_gpu() else {
        return;
    };
    let mut engine = engine(gpu.clone(), EngineOptions::default());
    let before = embeds(&mut engine);

    gpu.wgpu.as_ref().unwrap().device.destroy();
    let first = engine.encode(&probe(), false).unwrap_err();
    assert!(
        matches!(
            first,
            EngineError::DeviceLost(_) | EngineError::Execution(_)
        ),
        "{first}"
    );
    let later = once_reported(|| engine.encode(&probe(), false).unwrap_err());
    assert!(later.to_string().contains("rebuild"), "{later}");

    let mut rebuilt = engine.rebuild(device::gpu_new().unwrap()).unwrap();
    assert_eq!(rebuilt.adapter_names(), ["all-r4"]);
    for (after, before) in embeds(&mut rebuilt).iter().zip(&before) {
        // Tolerance: rel. Frobenius 1e-6 (the same kernels on the same kind of device).
        let (rel, _) = errors(after, before);
        assert!(rel <= 1e-6, "rel {rel:e}");
    }
}

/// Once wgpu has reported a loss, every call says so without touching the device: calls
/// `encode` until it gives [`EngineError::DeviceLost`] (or a second has passed) and returns
/// that error.
fn once_reported(mut encode: impl FnMut() -> EngineError) -> EngineError {
    let mut error = encode();
    for _ in 0..20 {
        if matches!(error, EngineError::DeviceLost(_)) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        error = encode();
    }
    assert!(matches!(error, EngineError::DeviceLost(_)), "{error}");
    error
}

#[test]
fn a_shared_engine_that_lost_its_device_is_rebuilt_in_place() {
    let Some(gpu) = new_gpu() else {
        return;
    };
    let shared = SharedEngine::new(engine(gpu.clone(), EngineOptions::default()));
    let before = shared.encode(&probe(), false).unwrap();

    gpu.wgpu.as_ref().unwrap().device.destroy();
    let lost = shared.clone();
    once_reported(|| lost.encode(&probe(), false).unwrap_err());

    shared.rebuild(device::gpu_new().unwrap()).unwrap();
    for (after, before) in lost.encode(&probe(), false).unwrap().iter().zip(&before) {
        // Tolerance: rel. Frobenius 1e-6 (the same kernels on the same kind of device).
        let (rel, _) = errors(&after.embeds.values, &before.embeds.values);
        assert!(rel <= 1e-6, "rel {rel:e}");
    }
}

/// With the default kernels, and with the linears and the LoRA shrink timed per shape: any
/// timing on the failed step's inputs must fail quietly and leave the failure to the step's
/// read.
#[test]
fn a_step_over_the_device_buffer_limit_fails_alone() {
    let pinned = KernelPins {
        linear: LinearKernel::Timed,
        shrink: ShrinkKernel::Timed,
        ..KernelPins::default()
    };
    for kernels in [KernelPins::default(), pinned] {
        let Some(gpu) = new_gpu() else {
            return;
        };
        let limit = gpu.buffer_limit.unwrap();
        // Hide the device's limit from the engine, so it plans a step the device cannot hold.
        let blind = RuntimeDevice {
            buffer_limit: None,
            ..gpu
        };
        let options = EngineOptions {
            max_step_rows: usize::MAX,
            kernels,
            ..EngineOptions::default()
        };
        let mut engine = engine(blind, options);
        engine
            .load_adapter("tower-r2", &fixture_dir().join("adapters/tower-r2"))
            .unwrap();
        let before = embeds(&mut engine);
        let slotted = engine.slotted();
        // Images of 2×128 patches, enough of them that the step's patches alone exceed the
        // limit.
        let (rows, patch_len) = (256, 1176);
        let images = (limit / (4 * (rows * patch_len) as u64)) as usize + 1;
        let requests: Vec<Request> = (0..images)
            .map(|i| Request {
                id: format!("strip{i}"),
                image: ImageSource::Patches(Patches {
                    pixel_values: vec![0.5; rows * patch_len],
                    grid_thw: [1, 2, 128],
                }),
                // With an adapter not in the slots yet, so the failed step's LoRA kernels are
                // refused too: the weights they were only to read (the model's, the adapters')
                // must stay usable, and the slots go back to what they held.
                adapter: Some("tower-r2".to_owned()),
            })
            .collect();
        let error = engine.encode(&requests, false).unwrap_err();
        assert!(
            matches!(error, EngineError::Execution(_)),
            "kernels {kernels}: {error}"
        );
        assert_eq!(engine.slotted(), slotted, "kernels {kernels}");
        assert_eq!(embeds(&mut engine), before, "kernels {kernels}");
    }
}
