//! The CPU implementation on Flex: each slot's rows go through two `gemm` calls straight on the
//! tensors' memory, and the expand accumulates into the output in place.
//!
//! Rows of one slot that sit next to each other (an image's patches) form a run: shrink reads the
//! run from `x` where it lies and expand adds into the run's rows of the output, so the op costs
//! its arithmetic and one pass over the output columns it touches. The runs of a call, cut into
//! pieces of an even share of the rows, go to the rayon threads side by side, a piece per core, as
//! the thin rank-`r` products gain less from `gemm`'s own splitting (measured on 2 cores:
//! BENCHMARKS.md). Rows in runs shorter than [`MIN_RUN`] (rows of many requests
//! interleaved) are gathered per slot first, so a scattered mix costs a few larger calls instead
//! of one tiny call per row.
//!
//! `f16` tensors are widened to `f32` for the op and the result rounded back once.

use burn::backend::{
    Flex,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::{DType, Tensor};
use burn_flex::FlexTensor;
use gemm::Parallelism;
use rayon::prelude::*;
use std::ops::Range;

use super::{LoraBackend, LoraPlan};
use crate::ops::linear::{LinearBackend, LinearShader};
use crate::runtime::flex::{dense, gemm_parallelism, values, values_mut};

/// Runs shorter than this are gathered with the slot's other short runs.
pub const MIN_RUN: usize = 16;

impl LoraBackend for Flex {
    /// Reads the rows of each slot from the host-side metadata in `plan`, so the uploaded
    /// `sorted_tokens` and `tiles` go unused here.
    fn lora_apply(
        x: FloatTensor<Self>,
        base: FloatTensor<Self>,
        lora_a: FloatTensor<Self>,
        lora_b: FloatTensor<Self>,
        _sorted_tokens: IntTensor<Self>,
        _tiles: IntTensor<Self>,
        plan: LoraPlan,
        out_offset: usize,
    ) -> FloatTensor<Self> {
        if x.dtype() != DType::F16 {
            return apply_f32(x, base, lora_a, lora_b, &plan, out_offset);
        }
        let y = apply_f32(
            cast::<2>(x, DType::F32),
            cast::<2>(base, DType::F32),
            cast::<3>(lora_a, DType::F32),
            cast::<3>(lora_b, DType::F32),
            &plan,
            out_offset,
        );
        cast::<2>(y, DType::F16)
    }

    /// Flex's product ([`LinearBackend::linear_native`]), then [`LoraBackend::lora_apply`]:
    /// its expand adds into the product in place, so there is no pass over the output to save.
    fn linear_lora(
        x: FloatTensor<Self>,
        weight_t: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        lora_a: FloatTensor<Self>,
        lora_b: FloatTensor<Self>,
        sorted_tokens: IntTensor<Self>,
        tiles: IntTensor<Self>,
        _row_slots: IntTensor<Self>,
        plan: LoraPlan,
        _shader: LinearShader,
    ) -> FloatTensor<Self> {
        let base = Self::linear_native(x.clone(), weight_t, bias);
        Self::lora_apply(x, base, lora_a, lora_b, sorted_tokens, tiles, plan, 0)
    }
}

/// The op on f32 tensors.
fn apply_f32(
    x: FlexTensor,
    base: FlexTensor,
    lora_a: FlexTensor,
    lora_b: FlexTensor,
    plan: &LoraPlan,
    out_offset: usize,
) -> FlexTensor {
    let (x, a, b) = (dense(x), dense(lora_a), dense(lora_b));
    let mut y = dense(base);
    let [slots, rank, in_features] = dims::<3>(&a);
    let out = dims::<3>(&b)[1];
    let out_total = dims::<2>(&y)[1];
    let layer = Layer {
        x: values(&x),
        a: values(&a),
        b: values(&b),
        in_features,
        rank,
        out,
        out_total,
        out_offset,
    };
    debug_assert_eq!(layer.a.len(), slots * rank * in_features);
    let y_values = values_mut(&mut y);
    let meta = &plan.meta;
    let mut long_runs = Vec::new();
    for segment in meta.lora_segments() {
        let slot = segment.slot as usize;
        let rows = &meta.sorted_tokens()[segment.start..segment.start + segment.len];
        let mut scattered = Vec::new();
        for run in runs(rows) {
            if run.len() >= MIN_RUN {
                long_runs.push((slot, run));
            } else {
                scattered.extend(run);
            }
        }
        if !scattered.is_empty() {
            layer.apply_gathered(slot, &scattered, y_values);
        }
    }
    layer.apply_runs(long_runs, y_values);
    y
}

/// One slice of one layer, as flat row-major `f32` values.
struct Layer<'a> {
    /// `[rows, in]`.
    x: &'a [f32],
    /// `[slots, rank, in]`.
    a: &'a [f32],
    /// `[slots, out, rank]`.
    b: &'a [f32],
    in_features: usize,
    rank: usize,
    out: usize,
    out_total: usize,
    out_offset: usize,
}

impl Layer<'_> {
    /// Each `(slot, rows)` run's delta added to its rows of `y` (`[rows, out_total]`) in place,
    /// side by side on the threads, one core per piece: a run's `gemm` calls are too thin for
    /// `gemm` to split well (a rank-16 shrink is a 16-column product), so the runs are cut into
    /// pieces of at most an even share of all their rows (a share of at least [`MIN_RUN`]).
    fn apply_runs(&self, mut runs: Vec<(usize, Range<usize>)>, y: &mut [f32]) {
        runs.sort_unstable_by_key(|(_, rows)| rows.start);
        let total: usize = runs.iter().map(|(_, rows)| rows.len()).sum();
        let piece = total.div_ceil(rayon::current_num_threads()).max(MIN_RUN);
        let mut jobs = Vec::new();
        let (mut rest, mut rest_start) = (y, 0);
        for (slot, run) in runs {
            for start in run.clone().step_by(piece) {
                let rows = start..(start + piece).min(run.end);
                let tail = std::mem::take(&mut rest);
                let (_, tail) = tail.split_at_mut((rows.start - rest_start) * self.out_total);
                let (y_rows, tail) = tail.split_at_mut(rows.len() * self.out_total);
                (rest, rest_start) = (tail, rows.end);
                jobs.push((slot, rows, y_rows));
            }
        }
        jobs.into_par_iter()
            .for_each(|(slot, rows, y_rows)| self.apply_run(slot, rows, y_rows));
    }

    /// `rows` (consecutive) on one core, in place in `y_rows`, their rows of `y`.
    fn apply_run(&self, slot: usize, rows: Range<usize>, y_rows: &mut [f32]) {
        let x = &self.x[rows.start * self.in_features..rows.end * self.in_features];
        let shrunk = self.shrink(slot, x, rows.len(), Threads::One);
        self.expand(
            slot,
            &shrunk,
            rows.len(),
            &mut y_rows[self.out_offset..],
            self.out_total,
            Threads::One,
        );
    }

    /// Scattered `rows`: gathered into one block, and the delta added back row by row.
    fn apply_gathered(&self, slot: usize, rows: &[usize], y: &mut [f32]) {
        let n = self.in_features;
        let x: Vec<f32> = rows
            .iter()
            .flat_map(|&row| &self.x[row * n..(row + 1) * n])
            .copied()
            .collect();
        let shrunk = self.shrink(slot, &x, rows.len(), Threads::Gemm);
        let mut delta = vec![0.0; rows.len() * self.out];
        self.expand(
            slot,
            &shrunk,
            rows.len(),
            &mut delta,
            self.out,
            Threads::Gemm,
        );
        for (&row, delta) in rows.iter().zip(delta.chunks_exact(self.out)) {
            let start = row * self.out_total + self.out_offset;
            for (y, d) in y[start..start + self.out].iter_mut().zip(delta) {
                *y += d;
            }
        }
    }

    /// `x · A[slot]ᵀ` for `m` contiguous rows of `x`: `[m, rank]`.
    fn shrink(&self, slot: usize, x: &[f32], m: usize, threads: Threads) -> Vec<f32> {
        let (k, r) = (self.in_features, self.rank);
        let a = &self.a[slot * r * k..(slot + 1) * r * k];
        let mut shrunk = vec![0.0; m * r];
        // SAFETY: `shrunk` is `m × r` with row stride `r`; `x` holds `m × k` values with row
        // stride `k`; `a` is `A[slot]` (`r × k`) read as its transpose (`k × r`: row stride 1,
        // column stride `k`). Every index the call reads or writes lies in those slices.
        unsafe {
            gemm::gemm(
                m,
                r,
                k,
                shrunk.as_mut_ptr(),
                1,
                r as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                a.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                threads.parallelism(m, r, k),
            );
        }
        shrunk
    }

    /// `dst += shrunk · B[slot]ᵀ` for `m` rows; `dst` starts at the first row's first column
    /// and its rows lie `row_stride` apart.
    fn expand(
        &self,
        slot: usize,
        shrunk: &[f32],
        m: usize,
        dst: &mut [f32],
        row_stride: usize,
        threads: Threads,
    ) {
        let (r, out) = (self.rank, self.out);
        let b = &self.b[slot * out * r..(slot + 1) * out * r];
        assert!(
            shrunk.len() == m * r && dst.len() >= (m - 1) * row_stride + out,
            "the expand's operands cover its {m} × {out} output"
        );
        // SAFETY: `dst` holds `m` rows of `out` values `row_stride` apart (checked above);
        // `shrunk` is `m × r` with row stride `r`; `b` is `B[slot]` (`out × r`) read as its
        // transpose (`r × out`: row stride 1, column stride `r`).
        unsafe {
            gemm::gemm(
                m,
                out,
                r,
                dst.as_mut_ptr(),
                1,
                row_stride as isize,
                true,
                shrunk.as_ptr(),
                1,
                r as isize,
                b.as_ptr(),
                r as isize,
                1,
                1.0,
                1.0,
                false,
                false,
                false,
                threads.parallelism(m, out, r),
            );
        }
    }
}

/// Maximal runs of consecutive row numbers in `rows`, in order.
fn runs(rows: &[u32]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut rest = rows;
    std::iter::from_fn(move || {
        let (&first, _) = rest.split_first()?;
        let len = 1 + rest
            .windows(2)
            .take_while(|pair| pair[1] == pair[0] + 1)
            .count();
        rest = &rest[len..];
        Some(first as usize..first as usize + len)
    })
}

/// Who splits a `gemm` call over threads.
#[derive(Debug, Clone, Copy)]
enum Threads {
    /// Nobody: the caller runs calls side by side.
    One,
    /// `gemm`, when the call is large enough to gain from it.
    Gemm,
}

impl Threads {
    /// The `gemm` parallelism of an `m × n × k` call.
    fn parallelism(self, m: usize, n: usize, k: usize) -> Parallelism {
        match self {
            Threads::Gemm => gemm_parallelism(m, n, k),
            Threads::One => Parallelism::None,
        }
    }
}

fn cast<const D: usize>(tensor: FlexTensor, dtype: DType) -> FlexTensor {
    Tensor::<D>::from_primitive::<Flex>(tensor)
        .cast(dtype)
        .try_into_primitive::<Flex>()
        .expect("a Flex tensor stays on Flex")
}

fn dims<const D: usize>(tensor: &FlexTensor) -> [usize; D] {
    tensor.layout().shape().dims::<D>()
}

#[cfg(test)]
mod tests {
    use super::super::LoraSlice;
    use super::super::testing::{
        Problem, ProblemData, assert_matches, cases, check_f16, problems, reference,
    };
    use super::super::{ShrinkKernel, lora_apply};
    use super::{MIN_RUN, runs};
    use crate::runtime::device;
    use burn::tensor::{Tensor, TensorData};
    use proptest::prelude::*;

    /// The native op against a float64 per-row loop, within the f32 error bound.
    fn check(problem: &Problem) {
        let cpu = device::cpu();
        let data = problem.data(&cpu);
        let expected = reference(problem, &data);
        let y = data.apply(problem, &cpu);
        // Tolerance: Higham's bound for the two chained f32 dot products (see `Reference`).
        assert_matches(problem, &data, &expected, &y, 1.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(32), max_shrink_iters: 0, ..ProptestConfig::default() })]
        #[test]
        fn native_matches_float64(problem in problems()) {
            check(&problem);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(8), max_shrink_iters: 0, ..ProptestConfig::default() })]
        #[test]
        fn native_f16_matches_float64(problem in problems()) {
            check_f16(&problem, &device::cpu(), ShrinkKernel::Auto);
        }
    }

    /// At rank 2 `gemm` adds each of the two products into the output in turn where the output
    /// is larger than 16 × 16 (its `gevv` path), so the output is rounded twice: `1 + ¾·2⁻²³`
    /// rounds up to `1 + 2⁻²³`, and adding `⅝·2⁻²³` rounds up again to `1 + 2⁻²²`, 1.25 units
    /// of roundoff from the exact `1 + 1⅜·2⁻²³` where one rounding gives 0.75. The reference's bound allows that second rounding (CI once saw a
    /// random rank-2 problem exceed the bound without it) and still holds the result.
    #[test]
    fn rank_two_rounds_the_output_twice_within_the_bound() {
        let cpu = device::cpu();
        let rows = MIN_RUN; // one run, which the expand adds straight into the output
        let out = 32; // 16 × 32 values: past gemm's path for small outputs
        let problem = Problem {
            in_features: 1,
            slices: vec![(out, 2)],
            slots: 1,
            token_slots: vec![0; rows],
        };
        let ulp = 2f32.powi(-23);
        let tensor = |values: Vec<f32>, dims: [usize; 2]| {
            Tensor::<2>::from_data(TensorData::new(values, dims), &cpu.device)
        };
        let data = ProblemData {
            x: tensor(vec![1.0; rows], [rows, 1]),
            base: tensor(vec![1.0; rows * out], [rows, out]),
            slices: vec![LoraSlice {
                a: Tensor::<3>::from_data(
                    TensorData::new(vec![0.75 * ulp, 0.625 * ulp], [1, 2, 1]),
                    &cpu.device,
                ),
                b: Tensor::<3>::from_data(
                    TensorData::new(vec![1.0f32; out * 2], [1, out, 2]),
                    &cpu.device,
                ),
                offset: 0,
            }],
        };
        let expected = reference(&problem, &data);
        let y = data.apply(&problem, &cpu);
        let got = y.clone().into_data().try_to_vec::<f32>().unwrap();
        // Whether gemm rounds once (1 + 2⁻²³) or twice (1 + 2⁻²²), the bound holds it.
        assert!(
            got.iter().all(|&v| v == 1.0 + ulp || v == 1.0 + 2.0 * ulp),
            "{got:?}"
        );
        assert_matches(&problem, &data, &expected, &y, 1.0);
    }

    /// A strided `x` is read right, and a `base` the caller still holds is left as it was.
    #[test]
    fn strided_input_and_shared_base() {
        let cpu = device::cpu();
        let problem = Problem {
            in_features: 64,
            slices: vec![(48, 4), (16, 2)],
            slots: 2,
            token_slots: (0..4 * MIN_RUN)
                .map(|row| (row / (2 * MIN_RUN)) as i32)
                .collect(),
        };
        let data = problem.data(&cpu);
        let expected = reference(&problem, &data);
        let x_t = Tensor::<2>::from_data(data.x.clone().transpose().into_data(), &cpu.device);
        let before = data.base.clone().into_data();
        let y = lora_apply(
            x_t.transpose(),
            data.base.clone(),
            &data.slices,
            &problem.batch(&cpu),
        )
        .unwrap();
        // Tolerance: the same f32 bound as for any other problem.
        assert_matches(&problem, &data, &expected, &y, 1.0);
        data.base.into_data().assert_eq(&before, true);
    }

    #[test]
    fn runs_split_at_gaps() {
        let found: Vec<_> = runs(&[3, 4, 5, 9, 0, 1, 7]).collect();
        assert_eq!(found, [3..6, 9..10, 0..2, 7..8]);
        assert_eq!(runs(&[]).count(), 0);
    }
}
