//! Attention within images on the GPU wgpu finds: Burn's composition (two batched matmuls around
//! a softmax, every score written out) against the fused kernel
//! (`shaders/attention/attention.wgsl`), in f32 and, where the device has `SHADER_F16`, f16, at
//! Qwen2-VL-2B's heads (16 of 80 values) over images of 448² (1024 patches each). Throughput is in
//! floating-point operations of the two products (`4 · images · heads · 1024² · 80` per call):
//! criterion's `elem/s` are FLOP/s. `cargo bench --bench attention` runs one image;
//! `MMLORA_BENCH_IMAGES=8` the H200's eight. Criterion's `--warm-up-time` and `--measurement-time`
//! override `common::config`'s 2 s and 10 s.

mod common;

use burn::tensor::{Distribution, Tensor};
use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use mmlora::bench::op::timed;
use mmlora::ops::attention::{AttentionKernel, attend};
use mmlora::runtime::device::Precision;

/// Patches of one 448² image.
const LEN: usize = 1024;
/// Qwen2-VL-2B's heads and their width.
const HEADS: usize = 16;
const HEAD_DIM: usize = 80;

fn attention(c: &mut Criterion) {
    let images = common::count("MMLORA_BENCH_IMAGES", 1);
    let Some(gpu) = common::gpu() else {
        return;
    };
    let mut precisions = vec![Precision::F32];
    if gpu.supports(Precision::F16) {
        precisions.push(Precision::F16);
    }
    let shape = [images, LEN, HEADS, HEAD_DIM];
    // q carries the scale, as the tower's does.
    let scale = (HEAD_DIM as f64).powf(-0.5);
    let random =
        |range: f64| Tensor::<4>::random(shape, Distribution::Uniform(-range, range), &gpu.device);
    let (q, k, v) = (random(scale), random(1.0), random(1.0));
    let mut group = c.benchmark_group(format!("attention_{images}x{LEN}x{HEADS}x{HEAD_DIM}"));
    let flops = 4 * images * HEADS * LEN * LEN * HEAD_DIM;
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .throughput(Throughput::Elements(flops as u64));
    for precision in precisions {
        let dtype = precision.dtype();
        let (q, k, v) = (
            q.clone().cast(dtype),
            k.clone().cast(dtype),
            v.clone().cast(dtype),
        );
        for kernel in AttentionKernel::BOTH {
            let id = format!("{kernel}_{precision}");
            group.bench_function(id, |bench| {
                bench.iter_custom(|n| {
                    timed(&gpu, n, || {
                        attend(q.clone(), k.clone(), v.clone(), 1.0, kernel)
                            .reshape([images * LEN, HEADS * HEAD_DIM])
                    })
                })
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::config();
    targets = attention
}
criterion_main!(benches);
