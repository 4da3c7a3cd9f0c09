//! The LoRA op alone, on one device: the base linear it rides on (with its bias, and the kernel
//! the engine would use), the base plus the op, and the base plus a naive
//! gather-and-batched-matmul (each row's A and B gathered, two batched matmuls), at a preset's
//! `attn.qkv` shape with the adapters mixed among the rows one of two ways ([`OpMix`]): row by
//! row, or in runs of rows as a batch's images hold them. Beside them, the base plus the
//! op onto its first [`NARROW_COLUMNS`] output columns alone: the whole shrink with next to no
//! expand, which tells the op's two launches apart; and the op fused into the base linear
//! (`LoraLinear::fused_where_it_fits`: the shrink, then the linear kernel adding each row's
//! delta as it stores it) wherever the base linear's kernel is one of ours with the epilogue,
//! so that the two ways the engine chooses between (`src/ops/lora/fusion.rs`) are timed side by side.
//!
//! Each is timed as one call between device syncs, and all but the naive path also back to back
//! (`time_per_call`): [`BACK_TO_BACK_CALLS`] calls between two syncs, as a forward pass runs
//! its layers. On a hardware GPU a sync can cost more than a small linear (BENCHMARKS.md, the
//! H200's runs), so only the back-to-back times say what the op adds to a linear at few rows.

use std::cell::Cell;
use std::time::{Duration, Instant};

use burn::tensor::{Distribution, Int, Tensor, TensorData};
use serde::Serialize;

use crate::models::qwen2_vl::DEFAULT_BUFFER_LIMIT;
use crate::named::named_choice;
use crate::nn::LoraLinear;
use crate::ops::linear::LinearChoice;
use crate::ops::linear::LinearKernel;
use crate::ops::lora::{LoraBatch, LoraSlice, SHRINK_CANDIDATES, ShrinkKernel, lora_apply};
use crate::routing::meta::KernelMeta;
use crate::runtime::device::{Precision, RuntimeDevice};
use crate::runtime::timing::time_per_call;

/// Output columns of the narrow op: its expand adds a vector of four values to each row.
pub const NARROW_COLUMNS: usize = 4;

/// Calls between two device syncs in the back-to-back timings.
pub const BACK_TO_BACK_CALLS: u32 = 10;

named_choice! {
    /// How the op's rows take the adapters.
    #[derive(Default)]
    pub enum OpMix {
        /// Row `r` takes adapter `r % adapters`: no two neighbouring rows share one, the worst case
        /// for a kernel that shares an adapter's loads among neighbouring rows (the fused store).
        #[default]
        Rows,
        /// The rows split into `adapters` runs of (nearly) equal length, one adapter each, as an
        /// engine batch holds its images' tokens.
        Runs,
    }
}

impl OpMix {
    /// Each of `rows` rows' adapter slot, with `adapters` adapters mixed.
    pub fn token_slots(self, rows: usize, adapters: usize) -> Vec<i32> {
        let slot = |r: usize| match self {
            OpMix::Rows => r % adapters,
            OpMix::Runs => r * adapters / rows,
        };
        (0..rows).map(|r| slot(r) as i32).collect()
    }
}

/// One op problem: `rows × in_features → out_features`, `adapters` adapters of `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpShape {
    /// Rows (tokens).
    pub rows: usize,
    /// Input width.
    pub in_features: usize,
    /// Output width.
    pub out_features: usize,
    /// Adapter rank.
    pub rank: usize,
    /// Distinct adapters.
    pub adapters: usize,
    /// How the rows take the adapters.
    pub mix: OpMix,
    /// The float type of every tensor.
    pub precision: Precision,
    /// The base linear's kernel (resolved for the device when the inputs are made).
    pub linear_kernel: LinearKernel,
    /// The op's shrink shader on a GPU.
    pub lora_shrink: ShrinkKernel,
}

impl OpShape {
    /// The `attn.qkv` linear of a tower `embed_dim` wide, in f32.
    pub fn qkv(embed_dim: usize, rows: usize, rank: usize, adapters: usize) -> Self {
        Self {
            rows,
            in_features: embed_dim,
            out_features: 3 * embed_dim,
            rank,
            adapters,
            mix: OpMix::Rows,
            precision: Precision::F32,
            linear_kernel: LinearKernel::Auto,
            lora_shrink: ShrinkKernel::Auto,
        }
    }
}

/// Random inputs of one shape on one device.
pub struct OpInputs {
    shape: OpShape,
    /// The base linear, with the kernel the engine would pick and `slice` installed: the
    /// engine's layer.
    layer: LoraLinear,
    x: Tensor<2>,
    slice: LoraSlice,
    /// The adapters' A with a B of [`NARROW_COLUMNS`] columns, at the output's first columns.
    narrow_slice: LoraSlice,
    batch: LoraBatch,
    slots: Tensor<1, Int>,
    /// Rows per chunk of the naive path, so its gathered weights fit one buffer.
    naive_chunk: usize,
}

impl OpInputs {
    /// Uniform random inputs of `shape` on `on`.
    pub fn new(shape: OpShape, on: &RuntimeDevice) -> Self {
        let d = &on.device;
        let OpShape {
            rows,
            in_features,
            out_features,
            rank,
            adapters,
            mix,
            precision,
            linear_kernel,
            lora_shrink,
        } = shape;
        let dtype = precision.dtype();
        let token_slots = mix.token_slots(rows, adapters);
        let meta = KernelMeta::from_token_slots(token_slots.clone(), adapters)
            .expect("slots below the adapter count");
        let limit = on.buffer_limit.unwrap_or(DEFAULT_BUFFER_LIMIT);
        let gathered_row = (rank * (in_features + out_features) * 4) as u64;
        let lora_b = |columns: usize| {
            Tensor::<3>::random(
                [adapters, columns, rank],
                Distribution::Uniform(-0.1, 0.1),
                d,
            )
            .cast(dtype)
        };
        let lora_a = Tensor::<3>::random(
            [adapters, rank, in_features],
            Distribution::Uniform(-0.03, 0.03),
            d,
        )
        .cast(dtype);
        let slice = LoraSlice {
            a: lora_a.clone(),
            b: lora_b(out_features),
            offset: 0,
        };
        let mut layer = LoraLinear::new(
            Tensor::<2>::random(
                [out_features, in_features],
                Distribution::Uniform(-0.03, 0.03),
                d,
            )
            .cast(dtype),
            Some(
                Tensor::<1>::random([out_features], Distribution::Uniform(-1.0, 1.0), d)
                    .cast(dtype),
            ),
        );
        layer.set_kernel(LinearChoice::new(linear_kernel, on, dtype));
        layer.set_lora(Some(slice.clone()));
        Self {
            shape: OpShape {
                linear_kernel: linear_kernel.resolve(on),
                ..shape
            },
            layer,
            x: Tensor::<2>::random([rows, in_features], Distribution::Uniform(-1.0, 1.0), d)
                .cast(dtype),
            slice,
            narrow_slice: LoraSlice {
                a: lora_a,
                b: lora_b(NARROW_COLUMNS.min(out_features)),
                offset: 0,
            },
            batch: LoraBatch::with_shrink(meta, on, lora_shrink),
            slots: Tensor::from_data(TensorData::new(token_slots, [rows]), d),
            naive_chunk: usize::try_from(limit / gathered_row)
                .unwrap_or(rows)
                .clamp(1, rows),
        }
    }

    /// The base linear `x · Wᵀ + b`.
    pub fn base(&self) -> Tensor<2> {
        self.layer.base(self.x.clone())
    }

    /// `base` plus each row's LoRA delta through the op.
    pub fn lora(&self, base: Tensor<2>) -> Tensor<2> {
        self.layer
            .add_lora(self.x.clone(), base, &self.batch)
            .expect("inputs built for the op")
    }

    /// `base` plus each row's LoRA delta onto its first [`NARROW_COLUMNS`] columns alone,
    /// through the op: the whole shrink, next to no expand.
    pub fn narrow_lora(&self, base: Tensor<2>) -> Tensor<2> {
        let slices = std::slice::from_ref(&self.narrow_slice);
        lora_apply(self.x.clone(), base, slices, &self.batch).expect("inputs built for the op")
    }

    /// The base linear with each row's LoRA delta fused into the base linear's kernel where
    /// that is one of ours with the epilogue (`LoraLinear::fused_where_it_fits`, whether or
    /// not the engine's timing would fuse it), else the base then the op. Whether it was fused.
    pub fn fused(&self) -> (Tensor<2>, bool) {
        match self.layer.fused_where_it_fits(self.x.clone(), &self.batch) {
            Some(y) => (y.expect("inputs built for the op"), true),
            None => (self.lora(self.base()), false),
        }
    }

    /// `base` plus each row's LoRA delta by gathering its A and B and two batched matmuls.
    pub fn naive(&self, base: Tensor<2>) -> Tensor<2> {
        let OpShape {
            rows,
            in_features,
            out_features,
            ..
        } = self.shape;
        let mut out = Vec::new();
        for start in (0..rows).step_by(self.naive_chunk) {
            let span = start..(start + self.naive_chunk).min(rows);
            let n = span.len();
            let slots = self.slots.clone().slice(span.clone());
            let a = self.slice.a.clone().select(0, slots.clone()); // [n, rank, in]
            let b = self.slice.b.clone().select(0, slots); // [n, out, rank]
            let x = self
                .x
                .clone()
                .slice(span.clone())
                .reshape([n, 1, in_features]);
            let shrunk = x.matmul(a.swap_dims(1, 2)); // [n, 1, rank]
            let delta = shrunk.matmul(b.swap_dims(1, 2)).reshape([n, out_features]);
            out.push(base.clone().slice(span) + delta);
        }
        Tensor::cat(out, 0)
    }
}

/// The shrink kernels the op is timed with for the choice `chosen` on `on`: `auto` on a
/// hardware GPU compares the candidates it picks from per shape (`split` and `wide`) side by
/// side; anything else is the one kernel it resolves to.
pub fn shrink_kernels(chosen: ShrinkKernel, on: &RuntimeDevice) -> Vec<ShrinkKernel> {
    let hardware_gpu = on.wgpu.is_some() && on.hardware_gpu;
    if chosen == ShrinkKernel::Auto && hardware_gpu {
        SHRINK_CANDIDATES.to_vec()
    } else {
        vec![chosen.resolve(on)]
    }
}

/// Runs `f` `iters` times, waiting for the device before starting and after each run.
pub fn timed(on: &RuntimeDevice, iters: u64, mut f: impl FnMut() -> Tensor<2>) -> Duration {
    on.device.sync().expect("the device runs");
    let start = Instant::now();
    for _ in 0..iters {
        let y = f();
        on.device.sync().expect("the device runs");
        drop(y);
    }
    start.elapsed()
}

/// The op's timings at one shape.
#[derive(Debug, Clone, Serialize)]
pub struct OpRecord {
    /// `op`: tells these lines from the throughput lines.
    pub kind: &'static str,
    /// `cpu` or `gpu`.
    pub device: String,
    /// What runs it.
    pub adapter_name: String,
    /// Rows.
    pub rows: usize,
    /// Input width.
    pub in_features: usize,
    /// Output width.
    pub out_features: usize,
    /// Adapter rank.
    pub rank: usize,
    /// Distinct adapters mixed.
    pub adapters: usize,
    /// How the rows take the adapters: `rows` (row by row) or `runs` ([`OpMix`]).
    pub op_mix: &'static str,
    /// `f32` or `f16`.
    pub precision: String,
    /// The base linear's kernel: `burn`, `wgsl` or `tiled`.
    pub linear_kernel: String,
    /// The op's shrink shader: `split`, `wide` or `registers` (`None` on the CPU backend).
    pub lora_shrink: Option<String>,
    /// The base linear alone, median ms.
    pub base_ms: f64,
    /// The base linear plus the op, median ms.
    pub lora_ms: f64,
    /// The base linear plus the naive path, median ms.
    pub naive_ms: f64,
    /// The base linear plus the op onto its first [`NARROW_COLUMNS`] columns alone (the whole
    /// shrink, next to no expand), median ms.
    pub narrow_lora_ms: f64,
    /// What the op adds to the base linear: the median over rounds of `lora / base − 1` within
    /// each round.
    pub lora_overhead: f64,
    /// What the naive path adds to the base linear, the same way.
    pub naive_overhead: f64,
    /// What the narrow op adds to the base linear, the same way: about the shrink's share of
    /// [`OpRecord::lora_overhead`].
    pub narrow_lora_overhead: f64,
    /// Whether the base linear's kernel took the op fused
    /// (`LoraLinear::fused_where_it_fits`); where not, the fused timings are the base and the
    /// op again.
    pub fused: bool,
    /// The base linear with the op fused into it, median ms.
    pub fused_ms: f64,
    /// What the fused op adds to the base linear, as [`OpRecord::lora_overhead`].
    pub fused_overhead: f64,
    /// Calls between two syncs in the back-to-back timings ([`BACK_TO_BACK_CALLS`]).
    pub back_to_back_calls: u32,
    /// The base linear, back to back: median ms per call.
    pub base_back_to_back_ms: f64,
    /// The base linear plus the op, back to back: median ms per call.
    pub lora_back_to_back_ms: f64,
    /// The base linear plus the narrow op, back to back: median ms per call.
    pub narrow_lora_back_to_back_ms: f64,
    /// What the op adds to the base linear back to back, as [`OpRecord::lora_overhead`].
    pub lora_back_to_back_overhead: f64,
    /// What the narrow op adds to the base linear back to back.
    pub narrow_lora_back_to_back_overhead: f64,
    /// The base linear with the op fused into it, back to back: median ms per call.
    pub fused_back_to_back_ms: f64,
    /// What the fused op adds to the base linear back to back.
    pub fused_back_to_back_overhead: f64,
}

/// Times the base linear, base + op, base + naive, base + narrow op and the fused op at `shape`,
/// one call between syncs, and all but the naive back to back: one warm-up run each, then
/// `repeats` rounds in turns; medians, and the overheads from each round's pair.
pub fn run(shape: OpShape, on: &RuntimeDevice, repeats: usize) -> OpRecord {
    let inputs = OpInputs::new(shape, on);
    let base = || inputs.base();
    let lora = || inputs.lora(inputs.base());
    let naive = || inputs.naive(inputs.base());
    let narrow = || inputs.narrow_lora(inputs.base());
    // Whether the fused variant fused, as its runs find.
    let fused_here = Cell::new(false);
    let fused = || {
        let (y, fused) = inputs.fused();
        fused_here.set(fused);
        y
    };
    // Each variant and the calls it makes between two syncs.
    let variants: [(&dyn Fn() -> Tensor<2>, u32); 9] = [
        (&base, 1),
        (&lora, 1),
        (&naive, 1),
        (&narrow, 1),
        (&fused, 1),
        (&base, BACK_TO_BACK_CALLS),
        (&lora, BACK_TO_BACK_CALLS),
        (&narrow, BACK_TO_BACK_CALLS),
        (&fused, BACK_TO_BACK_CALLS),
    ];
    for (variant, _) in variants {
        timed(on, 1, variant);
    }
    let times = super::in_turns(variants.len(), repeats, |i, _| {
        let (variant, calls) = variants[i];
        time_per_call(&on.device, calls as usize, variant).map(|time| time.as_secs_f64() * 1e3)
    })
    .expect("the device runs");
    let [base, lora, naive, narrow, fused] = [0, 1, 2, 3, 4].map(|i| &times[i]);
    let [base_b2b, lora_b2b, narrow_b2b, fused_b2b] = [5, 6, 7, 8].map(|i| &times[i]);
    OpRecord {
        kind: "op",
        device: on.kind().to_owned(),
        adapter_name: on.description.clone(),
        rows: shape.rows,
        in_features: shape.in_features,
        out_features: shape.out_features,
        rank: shape.rank,
        adapters: shape.adapters,
        op_mix: shape.mix.into(),
        precision: shape.precision.to_string(),
        linear_kernel: inputs.shape.linear_kernel.to_string(),
        lora_shrink: super::shrink_name(shape.lora_shrink, on),
        base_ms: super::median(base),
        lora_ms: super::median(lora),
        naive_ms: super::median(naive),
        narrow_lora_ms: super::median(narrow),
        lora_overhead: super::paired_ratio(lora, base) - 1.0,
        naive_overhead: super::paired_ratio(naive, base) - 1.0,
        narrow_lora_overhead: super::paired_ratio(narrow, base) - 1.0,
        fused: fused_here.get(),
        fused_ms: super::median(fused),
        fused_overhead: super::paired_ratio(fused, base) - 1.0,
        back_to_back_calls: BACK_TO_BACK_CALLS,
        base_back_to_back_ms: super::median(base_b2b),
        lora_back_to_back_ms: super::median(lora_b2b),
        narrow_lora_back_to_back_ms: super::median(narrow_b2b),
        lora_back_to_back_overhead: super::paired_ratio(lora_b2b, base_b2b) - 1.0,
        narrow_lora_back_to_back_overhead: super::paired_ratio(narrow_b2b, base_b2b) - 1.0,
        fused_back_to_back_ms: super::median(fused_b2b),
        fused_back_to_back_overhead: super::paired_ratio(fused_b2b, base_b2b) - 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::device;

    #[test]
    fn rows_take_the_adapters_in_turn_or_in_runs() {
        assert_eq!(OpMix::Rows.token_slots(7, 3), [0, 1, 2, 0, 1, 2, 0]);
        assert_eq!(OpMix::Runs.token_slots(7, 3), [0, 0, 0, 1, 1, 2, 2]);
        let runs_of_32: Vec<i32> = (0..8).flat_map(|slot| [slot; 32]).collect();
        assert_eq!(OpMix::Runs.token_slots(256, 8), runs_of_32);
        // Every adapter holds a row wherever there are as many rows as adapters.
        for mix in [OpMix::Rows, OpMix::Runs] {
            let slots = mix.token_slots(16, 16);
            assert_eq!(slots, (0..16).collect::<Vec<i32>>(), "{mix:?}");
        }
    }

    #[test]
    fn auto_compares_both_hardware_kernels_on_a_hardware_gpu_alone() {
        let cpu = device::cpu();
        assert_eq!(shrink_kernels(ShrinkKernel::Auto, &cpu).len(), 1);
        if let Some(gpu) = device::gpu_for_tests() {
            let want = if gpu.hardware_gpu {
                vec![ShrinkKernel::Split, ShrinkKernel::Wide]
            } else {
                vec![ShrinkKernel::Registers]
            };
            assert_eq!(shrink_kernels(ShrinkKernel::Auto, &gpu), want);
            assert_eq!(
                shrink_kernels(ShrinkKernel::Wide, &gpu),
                [ShrinkKernel::Wide]
            );
        }
    }
}
