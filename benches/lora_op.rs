//! The LoRA op against the base linear it rides on and a naive gather-and-batched-matmul, on
//! the CPU backend and on the GPU wgpu finds (`mmlora bench` prints the same comparison).
//!
//! Shape: Qwen2-VL-2B `attn.qkv` (1280 → 3840), 1024 rows, rank 16, 8 adapters mixed (the rows
//! cycle through 8 slots, so every adapter holds 128 rows). `cargo bench --bench lora_op`.

use std::time::Duration;

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use mmlora::bench::op::{OpInputs, OpShape, timed};
use mmlora::models::Preset;
use mmlora::runtime::device::{self, RuntimeDevice};

fn bench_device(c: &mut Criterion, on: &RuntimeDevice) {
    let shape = OpShape::qkv(Preset::Qwen2Vl2b.embed_dim(), 1024, 16, 8);
    let i = OpInputs::new(shape, on);
    let mut group = c.benchmark_group(format!(
        "qkv_{}x{}x{}_r{}_{}mixed/{}",
        shape.rows,
        shape.in_features,
        shape.out_features,
        shape.rank,
        shape.adapters,
        on.kind()
    ));
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(10));
    group.bench_function("base_linear", |bench| {
        bench.iter_custom(|n| timed(on, n, || i.base()))
    });
    group.bench_function("base_linear+lora_op", |bench| {
        bench.iter_custom(|n| timed(on, n, || i.lora(i.base())))
    });
    let fixed_base = i.base();
    group.bench_function("lora_op", |bench| {
        bench.iter_custom(|n| timed(on, n, || i.lora(fixed_base.clone())))
    });
    group.bench_function("naive_gather_bmm", |bench| {
        bench.iter_custom(|n| timed(on, n, || i.naive(fixed_base.clone())))
    });
    group.finish();
}

fn lora_op(c: &mut Criterion) {
    match device::gpu() {
        Ok(gpu) => {
            eprintln!("gpu: {}", gpu.description);
            bench_device(c, &gpu);
        }
        Err(error) => eprintln!("no GPU benchmark: {error}"),
    }
    bench_device(c, &device::cpu());
}

criterion_group!(benches, lora_op);
criterion_main!(benches);
