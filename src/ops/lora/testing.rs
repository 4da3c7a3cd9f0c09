//! Random LoRA problems and their float64 reference, shared by the op's tests.

use burn::tensor::{DType, Distribution, Tensor};
use proptest::prelude::*;

use super::{LoraBatch, LoraSlice, ShrinkKernel, lora_apply};
use crate::ops::testing::to_f64;
use crate::routing::meta::{KernelMeta, NO_SLOT};
use crate::runtime::device::RuntimeDevice;

/// Layer widths taken from Qwen2-VL (1176 patch, 1280 dim, 3840 qkv, 5120 MLP) plus small ones,
/// one of them odd so that the WGSL op's kernels for widths that are not multiples of 4 run too.
pub const WIDTHS: [usize; 7] = [37, 64, 96, 1176, 1280, 3840, 5120];

/// Unit roundoff of f32.
pub const U: f64 = f32::EPSILON as f64 / 2.0;

/// Unit roundoff of f16 (11 significant bits).
pub const U16: f64 = 1.0 / 2048.0;

/// The shape of one LoRA problem.
#[derive(Debug, Clone)]
pub struct Problem {
    /// `in_features` of the layer.
    pub in_features: usize,
    /// `(out_features, rank)` of each output slice, laid out side by side.
    pub slices: Vec<(usize, usize)>,
    /// Slots in the stacked weights.
    pub slots: usize,
    /// Each row's slot.
    pub token_slots: Vec<i32>,
}

/// A problem's tensors, on one device.
#[derive(Debug, Clone)]
pub struct ProblemData {
    pub x: Tensor<2>,
    pub base: Tensor<2>,
    pub slices: Vec<LoraSlice>,
}

impl ProblemData {
    /// The same tensors on `device`.
    pub fn to_device(&self, device: &RuntimeDevice) -> Self {
        Self {
            x: self.x.clone().to_device(&device.device),
            base: self.base.clone().to_device(&device.device),
            slices: self
                .slices
                .iter()
                .map(|s| LoraSlice {
                    a: s.a.clone().to_device(&device.device),
                    b: s.b.clone().to_device(&device.device),
                    offset: s.offset,
                })
                .collect(),
        }
    }

    /// The same tensors cast to `dtype`.
    pub fn cast(&self, dtype: DType) -> Self {
        Self {
            x: self.x.clone().cast(dtype),
            base: self.base.clone().cast(dtype),
            slices: self
                .slices
                .iter()
                .map(|s| LoraSlice {
                    a: s.a.clone().cast(dtype),
                    b: s.b.clone().cast(dtype),
                    offset: s.offset,
                })
                .collect(),
        }
    }

    /// The op's result on `device` (the data moved there first), back on the CPU.
    pub fn apply(&self, problem: &Problem, device: &RuntimeDevice) -> Tensor<2> {
        self.apply_with(problem, device, ShrinkKernel::Auto)
    }

    /// The same with the shrink kernel `shrink` picks on `device`.
    pub fn apply_with(
        &self,
        problem: &Problem,
        device: &RuntimeDevice,
        shrink: ShrinkKernel,
    ) -> Tensor<2> {
        let on = self.to_device(device);
        let batch = LoraBatch::with_shrink(problem.meta(), device, shrink);
        lora_apply(on.x, on.base, &on.slices, &batch)
            .unwrap()
            .to_device(&crate::runtime::device::cpu().device)
    }
}

impl Problem {
    /// Rows in the problem.
    pub fn rows(&self) -> usize {
        self.token_slots.len()
    }

    /// Total output width.
    pub fn out_total(&self) -> usize {
        self.slices.iter().map(|&(out, _)| out).sum()
    }

    /// The problem's metadata.
    pub fn meta(&self) -> KernelMeta {
        KernelMeta::from_token_slots(self.token_slots.clone(), self.slots).unwrap()
    }

    /// The metadata uploaded to `device`.
    pub fn batch(&self, device: &RuntimeDevice) -> LoraBatch {
        LoraBatch::new(self.meta(), device)
    }

    /// Random tensors for the problem, on `device`.
    pub fn data(&self, device: &RuntimeDevice) -> ProblemData {
        let d = &device.device;
        let mut offset = 0;
        let slices = self
            .slices
            .iter()
            .map(|&(out, rank)| {
                let slice = LoraSlice {
                    a: Tensor::random(
                        [self.slots, rank, self.in_features],
                        Distribution::Uniform(-1.0, 1.0),
                        d,
                    ),
                    b: Tensor::random([self.slots, out, rank], Distribution::Uniform(-1.0, 1.0), d),
                    offset,
                };
                offset += out;
                slice
            })
            .collect();
        ProblemData {
            x: Tensor::random(
                [self.rows(), self.in_features],
                Distribution::Uniform(-1.0, 1.0),
                d,
            ),
            base: Tensor::random(
                [self.rows(), self.out_total()],
                Distribution::Uniform(-4.0, 4.0),
                d,
            ),
            slices,
        }
    }
}

/// The exact answer in float64 and, per element, the error bound of an f32 evaluation.
pub struct Reference {
    /// `base + Σ_r (x·A[slot]ᵀ)_r · B[slot]_r`, in f64.
    pub y: Vec<f64>,
    /// Per element `γ_n · Σ_r |x|·|A|ᵀ · |B|  +  u · |y|`, with `n = in + rank` (Higham's bound
    /// for two chained f32 dot products, plus the rounding of the final add); at rank 2, plus
    /// `γ_1 · (|base| + (1 + γ_n) · Σ_r |x|·|A|ᵀ · |B|)` for the CPU path's extra rounding of
    /// the output (see [`reference`]).
    pub bound: Vec<f64>,
}

/// Computes the float64 reference with a per-row loop.
pub fn reference(problem: &Problem, data: &ProblemData) -> Reference {
    let x = to_f64(&data.x);
    let mut y = to_f64(&data.base);
    let mut bound = vec![0.0; y.len()];
    let (in_f, out_total) = (problem.in_features, problem.out_total());
    for (slice, &(out, rank)) in data.slices.iter().zip(&problem.slices) {
        let (a, b) = (to_f64(&slice.a), to_f64(&slice.b));
        let n = (in_f + rank) as f64;
        let gamma = n * U / (1.0 - n * U);
        let gamma_1 = U / (1.0 - U);
        for (row, &slot) in problem.token_slots.iter().enumerate() {
            if slot == NO_SLOT {
                continue;
            }
            let s = slot as usize;
            let xr = &x[row * in_f..(row + 1) * in_f];
            let (mut t, mut t_abs) = (vec![0.0; rank], vec![0.0; rank]);
            for r in 0..rank {
                let ar = &a[(s * rank + r) * in_f..(s * rank + r + 1) * in_f];
                for k in 0..in_f {
                    t[r] += xr[k] * ar[k];
                    t_abs[r] += (xr[k] * ar[k]).abs();
                }
            }
            for o in 0..out {
                let br = &b[(s * out + o) * rank..(s * out + o + 1) * rank];
                let (mut d, mut d_abs) = (0.0, 0.0);
                for r in 0..rank {
                    d += t[r] * br[r];
                    d_abs += t_abs[r] * br[r].abs();
                }
                let idx = row * out_total + slice.offset + o;
                if rank == 2 {
                    // `gemm` adds a product of depth 2 into the output one term at a time (its
                    // `gevv` path: `fma(t, b, y)` twice), so `base + t₀b₀` is rounded once more:
                    // by `u·|base + t̂₀b₀|` at most, then scaled by the last rounding's `1 + u`.
                    bound[idx] += gamma_1 * (y[idx].abs() + (1.0 + gamma) * d_abs);
                }
                y[idx] += d;
                bound[idx] += gamma * d_abs;
            }
        }
    }
    for (b, y) in bound.iter_mut().zip(&y) {
        *b += U * y.abs();
    }
    Reference { y, bound }
}

/// The op on `device` with every tensor in f16, against float64 on the same (f16) values: the
/// kernels sum in f32 and round each output to f16 once, so the bound is the f32 one with f16's
/// unit roundoff for the final rounding.
pub fn check_f16(problem: &Problem, device: &RuntimeDevice, shrink: ShrinkKernel) {
    let cpu = crate::runtime::device::cpu();
    let data = problem.data(&cpu).cast(DType::F16).cast(DType::F32);
    let mut expected = reference(problem, &data);
    for (bound, y) in expected.bound.iter_mut().zip(&expected.y) {
        *bound += (U16 - U) * y.abs();
    }
    let y = data
        .cast(DType::F16)
        .apply_with(problem, device, shrink)
        .cast(DType::F32);
    assert_matches(problem, &data, &expected, &y, 1.0);
}

/// Asserts `actual` is within `factor × bound` of the reference everywhere, and equals `base`
/// bit-for-bit on rows without adapter.
pub fn assert_matches(
    problem: &Problem,
    data: &ProblemData,
    reference: &Reference,
    actual: &Tensor<2>,
    factor: f64,
) {
    let actual = actual.clone().into_data().try_to_vec::<f32>().unwrap();
    let base = data.base.clone().into_data().try_to_vec::<f32>().unwrap();
    let out_total = problem.out_total();
    for (row, &slot) in problem.token_slots.iter().enumerate() {
        let span = row * out_total..(row + 1) * out_total;
        if slot == NO_SLOT {
            let same = actual[span.clone()]
                .iter()
                .zip(&base[span])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "row {row} has no adapter but its output changed");
            continue;
        }
        for i in span {
            let err = (f64::from(actual[i]) - reference.y[i]).abs();
            assert!(
                err <= factor * reference.bound[i],
                "row {row} (slot {slot}), column {}: error {err:e} above the bound {:e} \
                 ({} rows, in {}, slices {:?}, {} slots)",
                i % out_total,
                factor * reference.bound[i],
                problem.rows(),
                problem.in_features,
                problem.slices,
                problem.slots,
            );
        }
    }
}

/// Cases a random test of the op runs: `n`, as many as CI's software GPU runs in a few minutes,
/// unless `PROPTEST_CASES` asks for another count (a long run: `PROPTEST_CASES=200 cargo nextest
/// run --release ops::lora`).
pub fn cases(n: u32) -> u32 {
    match std::env::var("PROPTEST_CASES") {
        Ok(count) => count.parse().expect("PROPTEST_CASES is a count of cases"),
        Err(_) => n,
    }
}

/// How rows are spread over slots.
#[derive(Debug, Clone, Copy)]
enum Mix {
    NoAdapter,
    OneAdapter,
    EveryRowDifferent,
    Random,
    /// Runs of up to 300 rows per slot, as images lay out their patches.
    Blocks,
}

/// Any shrink kernel a batch resolves to, for a random test to run on. Not `timed`, which runs
/// one of `split` and `wide`: what it adds, timing them on a shape and checking them against the
/// composed op (Burn's matmuls, autotuned anew for each random shape: most of a random case's
/// time on a software GPU), the edge cases and the choice's own tests check.
pub fn shrink_kernels() -> impl Strategy<Value = ShrinkKernel> {
    prop_oneof![
        Just(ShrinkKernel::Split),
        Just(ShrinkKernel::Wide),
        Just(ShrinkKernel::Registers)
    ]
}

/// Random problems: 1..2000 rows, widths from [`WIDTHS`], ranks 1..=64, 1..=16 slots, one to
/// three slices, and every kind of mix.
pub fn problems() -> impl Strategy<Value = Problem> {
    let mix = prop_oneof![
        Just(Mix::NoAdapter),
        Just(Mix::OneAdapter),
        Just(Mix::EveryRowDifferent),
        Just(Mix::Random),
        Just(Mix::Random),
        Just(Mix::Blocks),
    ];
    (
        1usize..2000,
        prop::sample::select(WIDTHS.to_vec()),
        prop::collection::vec((prop::sample::select(WIDTHS.to_vec()), 1usize..=64), 1..=3),
        1usize..=16,
        mix,
        any::<u64>(),
    )
        .prop_map(|(rows, in_features, mut slices, slots, mix, seed)| {
            // Keep every tensor under lavapipe's 128 MiB storage binding limit.
            while slices.len() > 1 && rows * slices.iter().map(|s| s.0).sum::<usize>() > 8 << 20 {
                slices.pop();
            }
            let rows = rows.min((8 << 20) / slices[0].0.max(in_features));
            let mut state = seed;
            let mut next = move || {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) as usize
            };
            let (mut block_slot, mut block_left) = (NO_SLOT, 0);
            let token_slots = (0..rows)
                .map(|row| match mix {
                    Mix::NoAdapter => NO_SLOT,
                    Mix::OneAdapter => (slots - 1) as i32,
                    Mix::EveryRowDifferent => (row % (slots + 1)) as i32 - 1,
                    Mix::Random => (next() % (slots + 1)) as i32 - 1,
                    Mix::Blocks => {
                        if block_left == 0 {
                            block_slot = (next() % (slots + 1)) as i32 - 1;
                            block_left = 1 + next() % 300;
                        }
                        block_left -= 1;
                        block_slot
                    }
                })
                .collect();
            Problem {
                in_features,
                slices,
                slots,
                token_slots,
            }
        })
}

/// A layer for [`linear_lora`](super::linear_lora): `x` `[rows, in]`, `Wᵀ` `[in, out]`, `b` and one
/// slice of `slots` adapters of `rank` covering every output column, uniform in ±1 and rounded to
/// `dtype`, on the CPU in f32.
pub fn fused_layer(
    [rows, in_features, out_features]: [usize; 3],
    (slots, rank): (usize, usize),
    dtype: DType,
) -> (Problem, ProblemData, Tensor<2>, Tensor<1>) {
    let cpu = crate::runtime::device::cpu();
    let uniform = Distribution::Uniform(-1.0, 1.0);
    // Rows without an adapter, runs of one slot and neighbours of different slots.
    let token_slots = (0..rows)
        .map(|r| match r % 7 {
            0 => NO_SLOT,
            _ => ((r / 5) % slots) as i32,
        })
        .collect();
    let problem = Problem {
        in_features,
        slices: vec![(out_features, rank)],
        slots,
        token_slots,
    };
    let round = |t: Tensor<2>| t.cast(dtype).cast(DType::F32);
    let mut data = problem.data(&cpu).cast(dtype).cast(DType::F32);
    data.base = Tensor::zeros([rows, out_features], &cpu.device);
    let weight_t = round(Tensor::random(
        [in_features, out_features],
        uniform,
        &cpu.device,
    ));
    let bias =
        round(Tensor::random([1, out_features], uniform, &cpu.device)).reshape([out_features]);
    (problem, data, weight_t, bias)
}
