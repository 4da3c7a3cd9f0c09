//! Throughput of the whole tower + connector with many adapters mixed in one batch, against the
//! same model with no adapter, on random weights in the real layout (`mmlora bench`).
//!
//! Each configuration gets its own engine around the same model and one warm-up call (kernel
//! compilation and autotuning happen there); then the configurations take turns, `repeats`
//! rounds, each round starting with the next configuration, so slow drifts of the machine hit
//! them alike. Each call ends by reading the outputs back, which waits for the device. Each
//! configuration's median time is reported, and its ratio to the base as the median of the
//! rounds' ratios (the base's call and its call in the same round).

pub mod op;
pub mod scale;
pub mod stages;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

use crate::adapters::{ModuleLora, PeftAdapter};
use crate::engine::{Encoded, Engine, EngineError, EngineOptions, ImageSource, Request};
use crate::models::{LoraTarget, PatchLayout, Preset, VisionTower};
use crate::ops::attention::AttentionKernel;
use crate::ops::kernels::KernelPins;
use crate::ops::linear::LinearKernel;
use crate::ops::lora::ShrinkKernel;
use crate::preprocess::{Patches, smart_resize};
use crate::runtime::device::{DeviceClass, Precision, RuntimeDevice};

/// What to measure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchSpec {
    /// The model shape.
    pub preset: Preset,
    /// Images per batch.
    pub images: usize,
    /// Side of each (square) image in pixels before resizing to patches.
    pub side: usize,
    /// Distinct adapters mixed in the batch, one configuration each (1 = all images share one).
    pub adapters: Vec<usize>,
    /// Adapter ranks, crossed with `adapters`.
    pub ranks: Vec<usize>,
    /// Timed calls per configuration, after one warm-up call.
    pub repeats: usize,
    /// The float type the model computes in.
    pub precision: Precision,
    /// Kernels pinned by name. With the linears left to the device or timed, the base also
    /// runs with each of the device's `LinearKernel::candidates` pinned, and with attention
    /// left to a GPU, with the implementation it does not pick: to compare them in one run.
    pub kernels: KernelPins,
}

/// The default image side on a software GPU (lavapipe): it runs the 2B tower several times
/// slower than the CPU backend (BENCHMARKS.md), so the default set runs at a quarter of the
/// patches.
pub const SOFTWARE_GPU_SIDE: usize = 112;

/// Rows at which `mmlora bench` times the LoRA op alone by default.
pub const OP_ROWS: [usize; 2] = [256, 4096];

/// The same on a software GPU, where 4096 rows take minutes.
pub const SOFTWARE_GPU_OP_ROWS: [usize; 2] = [256, 1024];

impl Default for BenchSpec {
    /// 8 images of 224², base, one rank-16 adapter, and 8 distinct rank-16 adapters mixed.
    fn default() -> Self {
        Self {
            preset: Preset::Qwen2Vl2b,
            images: 8,
            side: 224,
            adapters: vec![1, 8],
            ranks: vec![16],
            repeats: 3,
            precision: Precision::F32,
            kernels: KernelPins::default(),
        }
    }
}

impl BenchSpec {
    /// This spec as it runs: the side rounded as the image processor resizes it (to whole merge
    /// blocks, within its pixel bounds; a square stays square), adapter counts and ranks in
    /// ascending order once each. Refuses mixing more adapters than the batch has images (each
    /// image carries one adapter).
    pub fn as_run(&self) -> Result<Self, EngineError> {
        let ascending = |values: &[usize]| {
            let mut values = values.to_vec();
            values.sort_unstable();
            values.dedup();
            values
        };
        let adapters = ascending(&self.adapters);
        if let Some(&most) = adapters.last().filter(|&&most| most > self.images) {
            return Err(EngineError::Options(format!(
                "{most} distinct adapters cannot be mixed over {} images: each image carries one \
                 adapter",
                self.images
            )));
        }
        Ok(Self {
            side: resized_side(self.side, self.images, self.preset.layout())?,
            adapters,
            ranks: ascending(&self.ranks),
            ..self.clone()
        })
    }

    /// What this spec's configuration of `adapters` adapters of `rank` runs on `device`, as
    /// `compute` says.
    fn setup(
        &self,
        device: &RuntimeDevice,
        compute: Compute,
        adapters: usize,
        rank: usize,
    ) -> RunSetup {
        RunSetup::new(
            device,
            self.preset,
            compute,
            self.images,
            self.side,
            adapters,
            rank,
        )
    }
}

/// How a configuration computes: its float type and its kernel pins.
type Compute = (Precision, KernelPins);

/// What a line of `mmlora bench` ran: the device, the model shape, the batch and the kernels
/// (fields of the line itself in its JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSetup {
    /// `cpu` or `gpu`.
    pub device: String,
    /// What the device is (adapter name, graphics API, type, driver).
    pub adapter_name: String,
    /// The model shape.
    pub preset: String,
    /// Images per batch.
    pub images: usize,
    /// Image side in pixels, as the images ran (after the image processor's resize).
    pub side: usize,
    /// Distinct adapters mixed (0: the base model).
    pub adapters: usize,
    /// Adapter rank (0: the base model).
    pub rank: usize,
    /// `f32` or `f16`.
    pub precision: String,
    /// The linear layers' kernel: `timed` (the fastest checked one per shape), `burn`, `wgsl`,
    /// `tiled`, `coop`, `coop-wide` or `coop-direct`.
    pub linear_kernel: String,
    /// The LoRA shrink shader: `timed` (`split` or `wide` per shape), `split`, `wide` or
    /// `registers` (`None` on the CPU backend, which runs its own op).
    pub lora_shrink: Option<String>,
    /// Attention's implementation: `burn` or `fused` (on the CPU backend both are its own
    /// pass).
    pub attention_kernel: String,
}

impl RunSetup {
    /// `adapters` distinct adapters of `rank` mixed over `images` images of `side` pixels, in a
    /// model of `preset`'s shape on `device`, computed as `compute` says.
    fn new(
        device: &RuntimeDevice,
        preset: Preset,
        (precision, pins): Compute,
        images: usize,
        side: usize,
        adapters: usize,
        rank: usize,
    ) -> Self {
        Self {
            device: device.kind().to_owned(),
            adapter_name: device.description.clone(),
            preset: preset.to_string(),
            images,
            side,
            adapters,
            rank,
            precision: precision.to_string(),
            linear_kernel: pins.linear.resolve(device).to_string(),
            lora_shrink: shrink_name(pins.shrink, device),
            attention_kernel: pins.attention.resolve(device).to_string(),
        }
    }
}

/// One configuration's result (a line of `mmlora bench --json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchRecord {
    /// `throughput`: tells these lines from the op's (`op`).
    pub kind: &'static str,
    /// What ran.
    #[serde(flatten)]
    pub setup: RunSetup,
    /// Scheduler steps one call takes (1 unless the batch is over the engine's row limit).
    pub steps: usize,
    /// Median time of one batch.
    pub median_ms: f64,
    /// Images per second at the median.
    pub img_per_s: f64,
    /// Base time / this time, the median over rounds of that ratio within each round (1 for the
    /// base itself; above 0.95 is the target).
    pub ratio_vs_base: f64,
    /// Each round's time of one batch, in order: the spread behind the medians.
    pub round_ms: Vec<f64>,
}

/// Runs `spec` on `device`, telling `progress` what it is doing.
pub fn run(
    spec: &BenchSpec,
    device: &RuntimeDevice,
    mut progress: impl FnMut(&str),
) -> Result<Vec<BenchRecord>, EngineError> {
    let spec = &spec.as_run()?;
    let model = spec.preset.random(&device.device);
    let requests = random_images(spec.images, spec.side, model.layout());

    // (adapters, rank, how it computes); the base with the chosen kernels first.
    let pins = spec.kernels;
    let compute = (spec.precision, pins);
    let mut configurations = vec![(0, 0, compute)];
    for &rank in &spec.ranks {
        configurations.extend(spec.adapters.iter().map(|&k| (k, rank, compute)));
    }
    let pinned = |pins: KernelPins| (0, 0, (spec.precision, pins));
    if matches!(pins.linear, LinearKernel::Auto | LinearKernel::Timed) {
        let kernel = pins.linear.resolve(device);
        let others = LinearKernel::candidates(device, spec.precision.dtype(), false);
        let others = others.iter().filter(|&&other| other != kernel);
        configurations.extend(others.map(|&linear| pinned(KernelPins { linear, ..pins })));
    }
    if pins.attention == AttentionKernel::Auto && device.class() != DeviceClass::Cpu {
        let attention = pins.attention.resolve(device);
        let others = AttentionKernel::BOTH
            .into_iter()
            .filter(|&other| other != attention);
        configurations.extend(others.map(|attention| pinned(KernelPins { attention, ..pins })));
    }
    let mut runs = Vec::with_capacity(configurations.len());
    for &(adapters, rank, compute) in &configurations {
        let (_, pins) = compute;
        progress(&format!(
            "preparing {adapters} adapters of rank {rank}, {} linears, {} attention",
            pins.linear.resolve(device),
            pins.attention.resolve(device)
        ));
        let mut engine = engine_with_adapters(&*model, device, compute, adapters, adapters, rank)?;
        let batch = mixed_batch(&requests, adapters, rank);
        let warm_up = engine.encode(&batch, false)?;
        runs.push((engine, batch, steps(&warm_up)));
    }
    let count = runs.len();
    let times = in_turns(count, spec.repeats, |i, round| {
        if i == round % count {
            progress(&format!("round {} of {}", round + 1, spec.repeats.max(1)));
        }
        let (engine, batch, _) = &mut runs[i];
        let started = Instant::now();
        engine.encode(batch, false)?;
        Ok::<_, EngineError>(started.elapsed().as_secs_f64() * 1e3)
    })?;
    Ok(configurations
        .iter()
        .zip(&times)
        .zip(&runs)
        .map(|((&(adapters, rank, compute), own), &(_, _, steps))| {
            let median_ms = median(own);
            BenchRecord {
                kind: "throughput",
                setup: spec.setup(device, compute, adapters, rank),
                steps,
                median_ms,
                img_per_s: spec.images as f64 / (median_ms / 1e3),
                ratio_vs_base: paired_ratio(&times[0], own),
                round_ms: own.clone(),
            }
        })
        .collect())
}

/// The most tower rows a benchmark batch may hold: 256 images of 448² (the H200 scale sweep
/// runs 64). The patches alone are 1.2 GB; beyond, a batch would exhaust the host's memory
/// before it ran.
pub const MAX_BATCH_ROWS: usize = 1 << 18;

/// The side the image processor resizes a square image of `side` pixels to for a tower that
/// cuts patches as `layout` says, where a batch of `images` of them fits [`MAX_BATCH_ROWS`].
fn resized_side(side: usize, images: usize, layout: PatchLayout) -> Result<usize, EngineError> {
    let preprocess = layout.default_processor();
    let factor = preprocess.patch_size * preprocess.merge_size;
    let (height, _) = smart_resize(
        side,
        side,
        factor,
        preprocess.min_pixels,
        preprocess.max_pixels,
    )
    .map_err(|e| EngineError::Options(format!("image side {side}: {e}")))?;
    let rows = images.saturating_mul((height / preprocess.patch_size).pow(2));
    if rows > MAX_BATCH_ROWS {
        return Err(EngineError::Options(format!(
            "{images} images of {side}² (resized to {height}²) are {rows} tower rows, above the \
             {MAX_BATCH_ROWS} a benchmark batch may hold"
        )));
    }
    Ok(height)
}

/// Scheduler steps an encode call took, from its outputs.
fn steps(encoded: &[Encoded]) -> usize {
    encoded.iter().map(|e| e.step + 1).max().unwrap_or(0)
}

/// `count` requests of random patches for square images of `side` pixels, a side the image
/// processor keeps ([`resized_side`]).
fn random_images(count: usize, side: usize, layout: PatchLayout) -> Vec<Request> {
    let grid_thw = [1, side / layout.patch_size, side / layout.patch_size];
    let rows = grid_thw.iter().product::<usize>();
    let mut random = XorShift(0x5eed);
    (0..count)
        .map(|i| Request {
            id: format!("image{i}"),
            image: ImageSource::Patches(Patches {
                pixel_values: (0..rows * layout.patch_len())
                    .map(|_| random.uniform(2.0))
                    .collect(),
                grid_thw,
            }),
            adapter: None,
        })
        .collect()
}

/// The shrink shader `kernel` runs on `device`, for a record (`None` on the CPU backend).
fn shrink_name(kernel: ShrinkKernel, device: &RuntimeDevice) -> Option<String> {
    device
        .wgpu
        .as_ref()
        .map(|_| kernel.resolve(device).to_string())
}

/// An engine around `model` computing in `precision` with the kernels `pins` pins, with `slots`
/// GPU slots and `loaded` random adapters of `rank` registered (named `r{rank}-{k}`), all held
/// in host memory.
fn engine_with_adapters(
    model: &dyn VisionTower,
    device: &RuntimeDevice,
    (precision, pins): Compute,
    slots: usize,
    loaded: usize,
    rank: usize,
) -> Result<Engine, EngineError> {
    let options = EngineOptions {
        max_loras: slots.max(1),
        max_rank: rank.max(1),
        max_cpu_adapters: loaded.max(slots).max(1),
        max_step_rows: usize::MAX,
        precision,
        kernels: pins,
        ..EngineOptions::default()
    };
    let mut engine = Engine::with_model(
        model.boxed_clone(),
        model.layout().default_processor(),
        device.clone(),
        options,
    )?;
    let targets = model.lora_targets();
    for k in 0..loaded {
        engine.insert_adapter(random_adapter(&format!("r{rank}-{k}"), &targets, rank, k))?;
    }
    Ok(engine)
}

/// `requests` with request `i` on adapter `r{rank}-{i % adapters}` (no adapter when 0).
fn mixed_batch(requests: &[Request], adapters: usize, rank: usize) -> Vec<Request> {
    requests
        .iter()
        .enumerate()
        .map(|(i, r)| Request {
            adapter: (adapters > 0).then(|| format!("r{rank}-{}", i % adapters)),
            ..r.clone()
        })
        .collect()
}

/// An adapter on every target of rank `rank` (scale 1), A and B uniform and small, the same
/// for the same `seed`: for benchmarks and tests.
pub fn random_adapter(name: &str, targets: &[LoraTarget], rank: usize, seed: usize) -> PeftAdapter {
    let mut random = XorShift(0x1234_5678 + seed as u64);
    let modules: BTreeMap<String, ModuleLora> = targets
        .iter()
        .map(|t| {
            let a_range = 1.0 / (t.in_features as f32).sqrt();
            let module = ModuleLora {
                rank,
                a: (0..rank * t.in_features)
                    .map(|_| random.uniform(a_range))
                    .collect(),
                b: (0..t.out_features * rank)
                    .map(|_| random.uniform(0.01))
                    .collect(),
                scale: 1.0,
                keys: None,
            };
            (t.path.clone(), module)
        })
        .collect();
    PeftAdapter {
        name: name.to_owned(),
        dir: PathBuf::new(),
        config: serde_json::from_value(serde_json::json!({"r": rank, "lora_alpha": rank}))
            .expect("a minimal adapter config parses"),
        modules,
    }
}

/// Runs `count` configurations' timed calls in turns for `repeats` rounds (at least one):
/// `call(i, round)` times configuration `i` once, in ms. Each round starts one configuration
/// later than the last, so none always runs first or right after the same other, and a drift
/// of the machine's speed hits them alike. Returns each configuration's times, by round.
fn in_turns<E>(
    count: usize,
    repeats: usize,
    mut call: impl FnMut(usize, usize) -> Result<f64, E>,
) -> Result<Vec<Vec<f64>>, E> {
    let rounds = repeats.max(1);
    let mut times = vec![Vec::with_capacity(rounds); count];
    for round in 0..rounds {
        for turn in 0..count {
            let i = (round + turn) % count;
            times[i].push(call(i, round)?);
        }
    }
    Ok(times)
}

/// `base / times`, round by round, and the median of those ratios: each ratio compares two
/// calls of one round, so the speed the machine had in that round cancels out of it.
fn paired_ratio(base: &[f64], times: &[f64]) -> f64 {
    let ratios: Vec<f64> = base.iter().zip(times).map(|(b, t)| b / t).collect();
    median(&ratios)
}

fn median(values: &[f64]) -> f64 {
    let mut values = values.to_vec();
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// A small fixed-seed generator: benchmark inputs need to be the same each run, not good.
struct XorShift(u64);

impl XorShift {
    /// Uniform in ±`range`.
    fn uniform(&mut self, range: f32) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * range
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tiny_preset_runs_every_configuration() {
        let spec = BenchSpec {
            preset: Preset::Tiny,
            images: 3,
            side: 56,
            adapters: vec![1, 3],
            ranks: vec![2, 4],
            repeats: 1,
            ..BenchSpec::default()
        };
        let mut seen = Vec::new();
        let records = run(&spec, &crate::runtime::device::cpu(), |c| {
            seen.push(c.to_owned())
        })
        .unwrap();
        let configurations: Vec<(usize, usize)> = records
            .iter()
            .map(|r| (r.setup.adapters, r.setup.rank))
            .collect();
        assert_eq!(configurations, [(0, 0), (1, 2), (3, 2), (1, 4), (3, 4)]);
        assert_eq!(seen.len(), 5 + 1, "five configurations prepared, one round");
        assert_eq!(records[0].ratio_vs_base, 1.0);
        for record in &records {
            assert!(
                record.median_ms > 0.0 && record.img_per_s > 0.0,
                "{record:?}"
            );
            let setup = &record.setup;
            assert_eq!(
                (setup.device.as_str(), setup.preset.as_str()),
                ("cpu", "tiny")
            );
            assert_eq!((setup.images, setup.side, record.steps), (3, 56, 1));
        }
    }

    #[test]
    fn a_spec_runs_as_the_image_processor_and_the_batch_allow() {
        let spec = BenchSpec {
            images: 4,
            side: 100,
            adapters: vec![4, 1, 2, 2],
            ranks: vec![16, 8, 16],
            ..BenchSpec::default()
        };
        let run = spec.as_run().unwrap();
        // 100 px rounds to 4 merge blocks of 28 px; 20 px is below the processor's least
        // pixels (56²) and grows to 56.
        assert_eq!(
            (run.side, run.adapters, run.ranks),
            (112, vec![1, 2, 4], vec![8, 16])
        );
        let small = BenchSpec {
            side: 20,
            ..spec.clone()
        };
        assert_eq!(small.as_run().unwrap().side, 56);
        let too_many = BenchSpec {
            adapters: vec![1, 5],
            ..spec
        };
        let refused = too_many.as_run().unwrap_err().to_string();
        assert!(
            refused.contains("5 distinct adapters") && refused.contains("4 images"),
            "{refused}"
        );
    }

    #[test]
    fn turns_rotate_so_each_configuration_leads_a_round() {
        let mut order = Vec::new();
        let times = in_turns(3, 3, |i, round| {
            order.push(i);
            Ok::<_, ()>((10 * round + i) as f64)
        })
        .unwrap();
        assert_eq!(order, [0, 1, 2, 1, 2, 0, 2, 0, 1]);
        assert_eq!(times[1], [1.0, 11.0, 21.0]);
        assert_eq!(
            in_turns(2, 5, |i, _| if i == 1 { Err("failed") } else { Ok(1.0) }),
            Err("failed")
        );
    }

    #[test]
    fn paired_ratios_hold_through_the_machines_drift() {
        // The machine doubles its times from round to round, and in round 1 the second
        // configuration also meets a hiccup. In each other round it takes 10 % longer than the
        // base. The ratio of the medians (20 / 30) would take the hiccup for the configuration's
        // cost; the median of the rounds' ratios does not.
        let base = [10.0, 20.0, 40.0];
        let other = [11.0, 30.0, 44.0];
        assert!((paired_ratio(&base, &other) - 1.0 / 1.1).abs() < 1e-12);
        assert_eq!(paired_ratio(&base, &base), 1.0);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
