//! The linear layers' base product `x · Wᵀ + b` on the GPU wgpu finds: Burn's matmul and add
//! against our kernels (`shaders/linear/linear.wgsl`, `shaders/linear/linear_tiled.wgsl`, and in
//! f16 on a device with cooperative matrices `shaders/linear/linear_coop.wgsl` and
//! `linear_coop_direct.wgsl`), in f32 and, where the device has `SHADER_F16`, f16, at each linear
//! shape of Qwen2-VL-2B's tower and merger. Throughput is in floating-point operations (`2 · rows ·
//! in · out` per call): criterion's `elem/s` are FLOP/s. `cargo bench --bench linear` runs the
//! tower's at 512 rows (8 images of 112²); `MMLORA_BENCH_ROWS=8192` at 8 images of 448². The
//! merger's see a quarter of the rows. Criterion's `--warm-up-time` and `--measurement-time`
//! override `common::config`'s 2 s and 10 s.

mod common;

use burn::tensor::{Distribution, Tensor};
use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use mmlora::bench::op::timed;
use mmlora::ops::linear::{LinearKernel, linear, materialize};
use mmlora::runtime::device::Precision;

/// `(name, in, out)` of each linear of the 2B shape.
const LAYERS: [(&str, usize, usize); 6] = [
    ("attn.qkv", 1280, 3840),
    ("attn.proj", 1280, 1280),
    ("mlp.fc1", 1280, 5120),
    ("mlp.fc2", 5120, 1280),
    ("merger.mlp.0", 5120, 5120),
    ("merger.mlp.2", 5120, 1536),
];

/// The tower's rows unless `MMLORA_BENCH_ROWS` says otherwise.
const ROWS: usize = 512;

fn linears(c: &mut Criterion) {
    let tower_rows = common::count("MMLORA_BENCH_ROWS", ROWS);
    let Some(gpu) = common::gpu() else {
        return;
    };
    let d = &gpu.device;
    let kernels = [LinearKernel::Burn, LinearKernel::Wgsl, LinearKernel::Tiled];
    let mut runs = kernels.map(|k| (Precision::F32, k)).to_vec();
    if gpu.supports(Precision::F16) {
        runs.extend(kernels.map(|k| (Precision::F16, k)));
        for kernel in LinearKernel::COOP {
            if kernel.coop_subgroup(&gpu).is_some() {
                runs.push((Precision::F16, kernel));
            }
        }
    }
    for (name, in_features, out_features) in LAYERS {
        // The merger's linears see a quarter of the rows (2×2 patches merged).
        let rows = if name.starts_with("merger") {
            tower_rows / 4
        } else {
            tower_rows
        };
        let uniform = Distribution::Uniform(-1.0, 1.0);
        let x = Tensor::<2>::random([rows, in_features], uniform, d);
        let weight = Tensor::<2>::random([out_features, in_features], uniform, d);
        let weight_t = materialize(weight.transpose());
        let bias = Tensor::<1>::random([out_features], uniform, d);
        let mut group = c.benchmark_group(format!("{name}_{rows}x{in_features}x{out_features}"));
        let flops = 2 * rows * in_features * out_features;
        group
            .sampling_mode(SamplingMode::Flat)
            .sample_size(10)
            .throughput(Throughput::Elements(flops as u64));
        for &(precision, kernel) in &runs {
            let dtype = precision.dtype();
            let (x, weight_t, bias) = (
                x.clone().cast(dtype),
                weight_t.clone().cast(dtype),
                bias.clone().cast(dtype),
            );
            let id = format!("{kernel}_{precision}");
            group.bench_function(id, |bench| {
                bench.iter_custom(|n| {
                    timed(&gpu, n, || {
                        linear(x.clone(), &weight_t, Some(&bias), kernel)
                    })
                })
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = common::config();
    targets = linears
}
criterion_main!(benches);
