//! The LoRA op against the base linear it rides on, the native op, and a naive
//! gather-and-batched-matmul, on the CPU backend and on the GPU wgpu finds.
//!
//! Shape: Qwen2-VL `attn.qkv` (1280 → 3840), 1024 rows, rank 16, 8 adapters mixed (the rows
//! cycle through 8 slots, so every adapter holds 128 rows). `cargo bench --bench lora_op`.

use std::time::{Duration, Instant};

use burn::tensor::{Distribution, Int, Tensor, TensorData};
use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use mmlora::device::{self, RuntimeDevice};
use mmlora::lora::meta::KernelMeta;
use mmlora::lora::ops::{LoraBatch, LoraSlice, lora_apply};

const ROWS: usize = 1024;
const IN: usize = 1280;
const OUT: usize = 3840;
const RANK: usize = 16;
const ADAPTERS: usize = 8;
/// Rows per chunk in the naive path, so its gathered weights stay under lavapipe's 128 MiB
/// storage-binding limit.
const NAIVE_CHUNK: usize = 256;

struct Inputs {
    x: Tensor<2>,
    weight_t: Tensor<2>,
    slice: LoraSlice,
    batch: LoraBatch,
    slots: Tensor<1, Int>,
}

fn inputs(on: &RuntimeDevice) -> Inputs {
    let d = &on.device;
    let token_slots: Vec<i32> = (0..ROWS).map(|r| (r % ADAPTERS) as i32).collect();
    let meta = KernelMeta::from_token_slots(token_slots.clone(), ADAPTERS).unwrap();
    Inputs {
        x: Tensor::random([ROWS, IN], Distribution::Uniform(-1.0, 1.0), d),
        weight_t: Tensor::random([IN, OUT], Distribution::Uniform(-0.03, 0.03), d),
        slice: LoraSlice {
            a: Tensor::random([ADAPTERS, RANK, IN], Distribution::Uniform(-0.03, 0.03), d),
            b: Tensor::random([ADAPTERS, OUT, RANK], Distribution::Uniform(-0.1, 0.1), d),
            offset: 0,
        },
        batch: LoraBatch::new(meta, d),
        slots: Tensor::from_data(TensorData::new(token_slots, [ROWS]), d),
    }
}

/// `y = base + x·A[slot]ᵀ·B[slot]ᵀ` by gathering each row's A and B and two batched matmuls.
fn naive(i: &Inputs, base: Tensor<2>) -> Tensor<2> {
    let mut out = Vec::new();
    for start in (0..ROWS).step_by(NAIVE_CHUNK) {
        let rows = start..(start + NAIVE_CHUNK).min(ROWS);
        let n = rows.len();
        let slots = i.slots.clone().slice(rows.clone());
        let a = i.slice.a.clone().select(0, slots.clone()); // [n, rank, in]
        let b = i.slice.b.clone().select(0, slots); // [n, out, rank]
        let x = i.x.clone().slice(rows.clone()).reshape([n, 1, IN]);
        let shrunk = x.matmul(a.swap_dims(1, 2)); // [n, 1, rank]
        let delta = shrunk.matmul(b.swap_dims(1, 2)).reshape([n, OUT]);
        out.push(base.clone().slice(rows) + delta);
    }
    Tensor::cat(out, 0)
}

/// Times `iters` runs of `f`, synchronising the device before starting and after finishing.
fn timed(on: &RuntimeDevice, iters: u64, mut f: impl FnMut() -> Tensor<2>) -> Duration {
    on.device.sync().unwrap();
    let start = Instant::now();
    for _ in 0..iters {
        let y = f();
        on.device.sync().unwrap();
        drop(y);
    }
    start.elapsed()
}

fn bench_device(c: &mut Criterion, on: &RuntimeDevice, label: &str) {
    let i = inputs(on);
    let base = || i.x.clone().matmul(i.weight_t.clone());
    let mut group = c.benchmark_group(format!(
        "qkv_{ROWS}x{IN}x{OUT}_r{RANK}_{ADAPTERS}mixed/{label}"
    ));
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(10));
    group.bench_function("base_linear", |bench| {
        bench.iter_custom(|n| timed(on, n, base))
    });
    group.bench_function("base_linear+lora_op", |bench| {
        bench.iter_custom(|n| {
            timed(on, n, || {
                lora_apply(
                    i.x.clone(),
                    base(),
                    std::slice::from_ref(&i.slice),
                    &i.batch,
                )
                .unwrap()
            })
        })
    });
    let fixed_base = base();
    group.bench_function("lora_op", |bench| {
        bench.iter_custom(|n| {
            timed(on, n, || {
                lora_apply(
                    i.x.clone(),
                    fixed_base.clone(),
                    std::slice::from_ref(&i.slice),
                    &i.batch,
                )
                .unwrap()
            })
        })
    });
    group.bench_function("naive_gather_bmm", |bench| {
        bench.iter_custom(|n| timed(on, n, || naive(&i, fixed_base.clone())))
    });
    group.finish();
}

fn lora_op(c: &mut Criterion) {
    match device::gpu() {
        Ok(gpu) => {
            eprintln!("gpu: {}", gpu.description);
            bench_device(c, &gpu, "gpu");
        }
        Err(error) => eprintln!("no GPU benchmark: {error}"),
    }
    bench_device(c, &device::cpu(), "cpu");
}

criterion_group!(benches, lora_op);
criterion_main!(benches);
