//! Where a batch's time goes (`mmlora bench --stages`): each stage of the forward pass timed
//! with a `StageClock`, at the base and with adapters mixed, and the multiply-add rate of
//! each stage that is a product (linears, attention, the LoRA op) in TFLOP/s.
//!
//! The clock waits for the device at the end of every stage, which serialises what the device
//! would overlap and breaks Burn's fusion across stages. So each configuration's clocked
//! passes take turns with plain passes of the same engine, and both totals are reported: how
//! far the clocked total is above the plain one says how far to trust the split.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use super::{
    BenchSpec, RunSetup, engine_with_adapters, in_turns, median, mixed_batch, random_images,
};
use crate::engine::{EngineError, ImageSource, Request};
use crate::models::{LoraTarget, VisionTower};
use crate::runtime::device::RuntimeDevice;
use crate::runtime::stages::{Stage, StageClock, StageTime};

/// One stage's share of a configuration's clocked pass.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageLine {
    /// The stage (`Stage::name`).
    pub stage: &'static str,
    /// Its marks in one pass (32 `qkv`s in the 2B tower).
    pub marks: usize,
    /// Its time in one pass, the median over the clocked passes.
    pub median_ms: f64,
    /// `median_ms` over the sum of every stage's.
    pub share: f64,
    /// Floating-point operations in one pass (a multiply-add is two), for the products.
    pub gflop: Option<f64>,
    /// `gflop` over `median_ms`, in TFLOP/s.
    pub tflop_per_s: Option<f64>,
}

/// One configuration's profile (a line of `mmlora bench --stages --json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageProfile {
    /// `stages`: tells these lines from the throughput lines.
    pub kind: &'static str,
    /// What ran.
    #[serde(flatten)]
    pub setup: RunSetup,
    /// A plain pass (no clock), median ms.
    pub plain_ms: f64,
    /// A clocked pass, the sum of its stages' medians, ms.
    pub clocked_ms: f64,
    /// Each stage, in the order of `Stage`.
    pub stages: Vec<StageLine>,
}

/// Profiles the base and the most of `spec.adapters` mixed at the first of `spec.ranks`:
/// `spec.repeats` clocked and plain passes each, after a warm-up pass of each kind, telling
/// `progress` what it is doing.
pub fn run(
    spec: &BenchSpec,
    device: &RuntimeDevice,
    mut progress: impl FnMut(&str),
) -> Result<Vec<StageProfile>, EngineError> {
    let spec = &spec.as_run()?;
    let clock = StageClock::new(&device.device);
    let mut model = spec.preset.random(&device.device);
    model.set_stage_clock(clock.clone());
    let requests = random_images(spec.images, spec.side, model.layout());
    let compute = (spec.precision, spec.kernels);
    let rank = spec.ranks.first().copied().unwrap_or(1);
    let mixed = spec.adapters.iter().copied().max().unwrap_or(1);
    let configurations = [(0, 0), (mixed, rank)];

    let mut runs = Vec::with_capacity(configurations.len());
    for &(adapters, rank) in &configurations {
        progress(&format!("preparing {adapters} adapters of rank {rank}"));
        let mut engine = engine_with_adapters(&*model, device, compute, adapters, adapters, rank)?;
        let batch = mixed_batch(&requests, adapters, rank);
        // Warm-up, plain and clocked: the waits end Burn's fused kernels elsewhere, so a
        // clocked pass compiles (and autotunes) kernels of its own the first time.
        engine.encode(&batch, false)?;
        clock.start();
        let warm = engine.encode(&batch, false);
        clock.finish();
        warm?;
        runs.push((engine, batch));
    }
    // Turn 2i is configuration i's plain pass, 2i + 1 its clocked one.
    let mut clocked: Vec<Vec<BTreeMap<Stage, StageTime>>> = vec![Vec::new(); runs.len()];
    let plain = in_turns(2 * runs.len(), spec.repeats, |turn, round| {
        if turn == round % (2 * runs.len()) {
            progress(&format!("round {} of {}", round + 1, spec.repeats.max(1)));
        }
        let (engine, batch) = &mut runs[turn / 2];
        if turn % 2 == 1 {
            clock.start();
        }
        let started = Instant::now();
        let outcome = engine.encode(batch, false);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let times = clock.finish();
        outcome?;
        if turn % 2 == 1 {
            clocked[turn / 2].push(times);
        }
        Ok::<_, EngineError>(ms)
    })?;

    let grids = grids(&requests);
    Ok(configurations
        .iter()
        .enumerate()
        .map(|(i, &(adapters, rank))| {
            let stages = lines(&clocked[i], &flop(&*model, &grids, rank));
            StageProfile {
                kind: "stages",
                setup: spec.setup(device, compute, adapters, rank),
                plain_ms: median(&plain[2 * i]),
                clocked_ms: stages.iter().map(|line| line.median_ms).sum(),
                stages,
            }
        })
        .collect())
}

/// Each stage's line from the clocked passes' times, with `flop` (per stage, one pass) turned
/// into rates.
fn lines(passes: &[BTreeMap<Stage, StageTime>], flop: &BTreeMap<Stage, f64>) -> Vec<StageLine> {
    let mut stages: Vec<Stage> = passes
        .iter()
        .flat_map(|pass| pass.keys().copied())
        .collect();
    stages.sort();
    stages.dedup();
    let mut lines: Vec<StageLine> = stages
        .into_iter()
        .map(|stage| {
            let times: Vec<f64> = passes
                .iter()
                .map(|pass| {
                    pass.get(&stage)
                        .map_or(0.0, |t| t.total.as_secs_f64() * 1e3)
                })
                .collect();
            let median_ms = median(&times);
            let gflop = flop.get(&stage).map(|f| f / 1e9);
            StageLine {
                stage: stage.name(),
                marks: passes[0].get(&stage).map_or(0, |t| t.marks),
                median_ms,
                share: 0.0,
                gflop,
                tflop_per_s: gflop.map(|g| g / median_ms),
            }
        })
        .collect();
    let total: f64 = lines.iter().map(|line| line.median_ms).sum();
    for line in &mut lines {
        line.share = line.median_ms / total;
    }
    lines
}

/// Each request's `(t, h, w)`.
fn grids(requests: &[Request]) -> Vec<[usize; 3]> {
    requests
        .iter()
        .filter_map(|request| match &request.image {
            ImageSource::Patches(patches) => Some(patches.grid_thw),
            _ => None,
        })
        .collect()
}

/// Floating-point operations of one pass of `model` over images of `grids`, per product stage
/// (a multiply-add is two), with adapters of `rank` on every target (0: none).
fn flop(model: &dyn VisionTower, grids: &[[usize; 3]], rank: usize) -> BTreeMap<Stage, f64> {
    let layout = model.layout();
    let targets = model.lora_targets();
    let rows: f64 = grids
        .iter()
        .map(|g| g.iter().product::<usize>() as f64)
        .sum();
    let merged_rows = rows / (layout.spatial_merge_size * layout.spatial_merge_size) as f64;
    // The first block's qkv reads the tower's width.
    let width = targets.first().map_or(0.0, |t| t.in_features as f64);
    // Scores and weighted sum: 2 · len² · width multiply-adds per segment, over the heads.
    let attention: f64 = model
        .attention_segments(grids)
        .iter()
        .flatten()
        .map(|&len| 4.0 * (len as f64).powi(2) * width)
        .sum();
    let product = |rows: f64, inp: f64, out: f64| 2.0 * rows * inp * out;
    let mut flop = BTreeMap::from([
        (
            Stage::PatchEmbed,
            product(rows, layout.patch_len() as f64, width),
        ),
        (Stage::Attention, attention),
    ]);
    // Each linear over the tower rows, or the merged rows where the connector's; with
    // adapters, each row shrunk to the rank and expanded back through its own adapter. A
    // layer whose kernel runs the op fused into its product marks it as its own stage, not
    // `lora_op`: where some did (fewer `lora_op` marks than linears), that rate overstates the
    // op's.
    let mut lora = 0.0;
    for target in &targets {
        let rows = if target.connector { merged_rows } else { rows };
        let (inp, out) = (target.in_features as f64, target.out_features as f64);
        *flop.entry(stage_of(target)).or_default() += product(rows, inp, out);
        lora += product(rows, rank as f64, inp + out);
    }
    if rank > 0 {
        flop.insert(Stage::LoraOp, lora);
    }
    flop
}

/// The stage a target linear's product is marked as: a block's attention linears, its MLP's
/// first products (`fc1`, `gate_proj`, `up_proj`, `linear_fc1`) and last (`fc2`, `down_proj`,
/// `linear_fc2`), a merger's first (`mlp.0`, `linear_fc1`) and last (`mlp.2`, `linear_fc2`).
fn stage_of(target: &LoraTarget) -> Stage {
    let kind = LoraTarget::kind(&target.path);
    let last = ["fc2", "down_proj", "mlp.2"]
        .iter()
        .any(|end| kind.ends_with(end));
    match (kind, target.connector, last) {
        ("attn.qkv", ..) => Stage::Qkv,
        ("attn.proj", ..) => Stage::Proj,
        (_, true, false) => Stage::MergerMlp0,
        (_, true, true) => Stage::MergerMlp2,
        (_, false, false) => Stage::Fc1,
        (_, false, true) => Stage::Fc2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::Preset;

    #[test]
    fn products_count_their_multiply_adds_twice() {
        // The tiny preset: width 32, MLP 128, 2 blocks, 2×2 merge to 48; one image of 4 × 6
        // patches and one of two frames of 2 × 2.
        let model = Preset::Tiny.random(&crate::runtime::device::cpu().device);
        let flop = flop(&*model, &[[1, 4, 6], [2, 2, 2]], 2);
        let rows = 24.0 + 8.0;
        assert_eq!(flop[&Stage::Qkv], 2.0 * 2.0 * rows * 32.0 * 96.0);
        assert_eq!(flop[&Stage::Fc2], 2.0 * 2.0 * rows * 128.0 * 32.0);
        assert_eq!(flop[&Stage::PatchEmbed], 2.0 * rows * 1176.0 * 32.0);
        // Per block: 2 · 32 · (24² + 2 · 4²) multiply-adds in the scores, as many in the sum.
        assert_eq!(
            flop[&Stage::Attention],
            2.0 * 4.0 * 32.0 * (576.0 + 2.0 * 16.0)
        );
        assert_eq!(flop[&Stage::MergerMlp2], 2.0 * 8.0 * 128.0 * 48.0);
        let tower = 2.0 * 2.0 * rows * 2.0 * (128.0 + 64.0 + 160.0 + 160.0);
        let merger = 2.0 * 8.0 * 2.0 * (256.0 + 176.0);
        assert_eq!(flop[&Stage::LoraOp], tower + merger);
        assert!(!self::flop(&*model, &[[1, 4, 6]], 0).contains_key(&Stage::LoraOp));
    }

    /// Each family's linears are counted in the stage its forward pass marks them as.
    #[test]
    fn every_familys_linears_count_in_their_stage() {
        for (path, connector, stage) in [
            ("blocks.1.attn.qkv", false, Stage::Qkv),
            ("blocks.1.attn.proj", false, Stage::Proj),
            ("blocks.0.mlp.fc1", false, Stage::Fc1),
            ("blocks.0.mlp.fc2", false, Stage::Fc2),
            ("blocks.3.mlp.gate_proj", false, Stage::Fc1),
            ("blocks.3.mlp.up_proj", false, Stage::Fc1),
            ("blocks.3.mlp.down_proj", false, Stage::Fc2),
            ("blocks.2.mlp.linear_fc1", false, Stage::Fc1),
            ("blocks.2.mlp.linear_fc2", false, Stage::Fc2),
            ("merger.mlp.0", true, Stage::MergerMlp0),
            ("merger.mlp.2", true, Stage::MergerMlp2),
            ("merger.linear_fc1", true, Stage::MergerMlp0),
            (
                "deepstack_merger_list.1.linear_fc2",
                true,
                Stage::MergerMlp2,
            ),
        ] {
            let target = LoraTarget {
                path: path.to_owned(),
                in_features: 1,
                out_features: 1,
                connector,
            };
            assert_eq!(stage_of(&target), stage, "{path}");
        }
    }

    #[test]
    fn every_stage_of_the_tiny_preset_is_clocked() {
        let spec = BenchSpec {
            preset: Preset::Tiny,
            images: 3,
            side: 56,
            adapters: vec![1, 3],
            ranks: vec![4],
            repeats: 2,
            ..BenchSpec::default()
        };
        let devices = [
            Some(crate::runtime::device::cpu()),
            crate::runtime::device::gpu_for_tests(),
        ];
        for device in devices.iter().flatten() {
            check_profiles(&run(&spec, device, |_| {}).unwrap());
        }
    }

    fn check_profiles(profiles: &[StageProfile]) {
        let configurations: Vec<_> = profiles
            .iter()
            .map(|p| (p.setup.adapters, p.setup.rank))
            .collect();
        assert_eq!(configurations, [(0, 0), (3, 4)]);
        for profile in profiles {
            let marks: BTreeMap<&str, usize> =
                profile.stages.iter().map(|s| (s.stage, s.marks)).collect();
            // 2 blocks: two norms, an activation and two residuals each, and the merger's
            // norm and activation; with adapters, 10 LoRA ops (4 per block, 2 in the merger).
            let mut expected = BTreeMap::from([
                ("patch_embed", 1),
                ("norm", 5),
                ("qkv", 2),
                ("rotary", 2),
                ("attention", 2),
                ("proj", 2),
                ("fc1", 2),
                ("activation", 3),
                ("fc2", 2),
                ("residual", 4),
                ("merger_mlp0", 1),
                ("merger_mlp2", 1),
                ("output", 1),
            ]);
            if profile.setup.adapters > 0 {
                expected.insert("lora_op", 10);
            }
            assert_eq!(marks, expected, "{profile:?}");
            let shares: f64 = profile.stages.iter().map(|s| s.share).sum();
            assert!((shares - 1.0).abs() < 1e-12, "shares sum to {shares}");
            assert!(profile.plain_ms > 0.0 && profile.clocked_ms > 0.0);
            for line in &profile.stages {
                let product = !matches!(
                    line.stage,
                    "norm" | "rotary" | "activation" | "residual" | "output"
                );
                assert_eq!(line.gflop.is_some(), product, "{line:?}");
                assert_eq!(
                    line.tflop_per_s.is_some_and(|r| r > 0.0),
                    product,
                    "{line:?}"
                );
            }
        }
    }
}
