//! The op composed of Burn's own tensor ops, in f32: the reference the tuner checks every
//! tuned LoRA kernel against on the user's device, with the bound a correct kernel keeps to.
//!
//! For each active slot, every row's `x · A[slot]ᵀ · B[slot]ᵀ` is computed and masked to the
//! slot's rows: a product per slot over all rows, dearer than the kernels' walk of the slot's
//! own rows, but built once per shape, when the tuner first meets it.

use burn::tensor::{DType, Tensor, TensorData, s};

use super::LoraSlice;
use crate::routing::meta::KernelMeta;
use crate::runtime::tuner::{self, Reference};

/// `base` with each row's delta of `slices` added (`meta`'s slots), in f32, and per element the
/// magnitudes a correct kernel's error scales with: `(|base|, (|x|·|A[slot]ᵀ|)·|B[slot]ᵀ|)`.
fn composed(
    x: &Tensor<2>,
    base: &Tensor<2>,
    slices: &[LoraSlice],
    meta: &KernelMeta,
) -> (Tensor<2>, Tensor<2>, Tensor<2>) {
    let device = x.device();
    let [rows, _] = x.dims();
    let x = x.clone().cast(DType::F32);
    let x_magnitudes = x.clone().abs();
    let base = base.clone().cast(DType::F32);
    let mut output = base.clone();
    let mut magnitudes = base.zeros_like();
    // The active slots, less `NO_SLOT`, which vLLM's metadata lists where rows have none.
    for &slot in meta.active_slots().iter().filter(|&&s| s >= 0) {
        let mask: Vec<f32> = meta
            .token_slots()
            .iter()
            .map(|&s| f32::from(u8::from(s == slot)))
            .collect();
        let mask = Tensor::<2>::from_data(TensorData::new(mask, [rows, 1]), &device);
        let slot = slot as usize;
        for slice in slices {
            let [_, rank, in_features] = slice.a.dims();
            let [_, out_features, _] = slice.b.dims();
            let a_t = slice
                .a
                .clone()
                .slice(s![slot..slot + 1])
                .reshape([rank, in_features]);
            let a_t = a_t.cast(DType::F32).transpose();
            let b_t = slice
                .b
                .clone()
                .slice(s![slot..slot + 1])
                .reshape([out_features, rank]);
            let b_t = b_t.cast(DType::F32).transpose();
            let columns = slice.offset..slice.offset + out_features;
            let delta = x.clone().matmul(a_t.clone()).matmul(b_t.clone()) * mask.clone();
            let reach = x_magnitudes.clone().matmul(a_t.abs()).matmul(b_t.abs()) * mask.clone();
            let at = [0..rows, columns];
            output = output
                .clone()
                .slice_assign(at.clone(), output.slice(at.clone()) + delta);
            magnitudes = magnitudes
                .clone()
                .slice_assign(at.clone(), magnitudes.slice(at) + reach);
        }
    }
    (output, base.abs(), magnitudes)
}

/// The op's reference on these inputs, for a kernel whose output is in `x`'s dtype: the
/// composed op in f32 (`composed`), and per element twice a correct kernel's worst error,
/// `γ(r + 1)·|base| + (γ(r + 1)·(1 + γ(in)) + γ(in))·(|x|·|Aᵀ|)·|Bᵀ|`: the shrink's `in`-term
/// sums in f32 off by at most `γ(in)` of their magnitudes, then the expand's sum of `r` terms
/// and the base ([`tuner::gamma`]). `None` where the batch cannot decide
/// ([`Reference::new`]).
pub fn reference(
    x: &Tensor<2>,
    base: &Tensor<2>,
    slices: &[LoraSlice],
    meta: &KernelMeta,
) -> Result<Option<Reference>, String> {
    let [_, in_features] = x.dims();
    let rank = slices.iter().map(|s| s.b.dims()[2]).max().unwrap_or(0);
    let (output, base_magnitudes, magnitudes) = composed(x, base, slices, meta);
    let (shrink, expand) = (tuner::gamma(in_features), tuner::gamma(rank + 1));
    let bound = (base_magnitudes * expand + magnitudes * (expand * (1.0 + shrink) + shrink)) * 2.0;
    Reference::new(output, bound, x.dtype())
}

#[cfg(test)]
mod tests {
    use super::super::testing::Problem;
    use super::super::{ShrinkKernel, lora_apply};
    use super::*;
    use crate::ops::lora::LoraBatch;
    use crate::runtime::device;

    /// Every shrink on every device passes the check against the composed op, in f32 and in
    /// f16 where the GPU has it, rows without adapter among them; an output off by one
    /// adapter's delta does not.
    #[test]
    fn every_kernel_passes_and_a_wrong_output_fails() {
        let problem = Problem {
            in_features: 96,
            slices: vec![(40, 8), (24, 4)],
            slots: 3,
            token_slots: (0..50).map(|r| r % 4 - 1).collect(),
        };
        let mut runs = vec![(device::cpu(), DType::F32, ShrinkKernel::Auto)];
        if let Some(gpu) = device::gpu_for_tests() {
            for shrink in [
                ShrinkKernel::Split,
                ShrinkKernel::Wide,
                ShrinkKernel::Registers,
            ] {
                runs.push((gpu.clone(), DType::F32, shrink));
                if device::f16_for_tests(&gpu) {
                    runs.push((gpu.clone(), DType::F16, shrink));
                }
            }
        }
        for (on, dtype, shrink) in runs {
            let what = format!("{} {dtype:?} {shrink:?}", on.description);
            let data = problem.data(&on).cast(dtype);
            let batch = LoraBatch::with_shrink(problem.meta(), &on, shrink);
            let reference = reference(&data.x, &data.base, &data.slices, batch.meta())
                .unwrap()
                .unwrap();
            let output = lora_apply(data.x.clone(), data.base.clone(), &data.slices, &batch);
            let output = output.unwrap();
            assert_eq!(reference.check(&output), Ok(()), "{what}");
            // Row 1 (slot 0) with its delta added twice.
            let twice = lora_apply(data.x.clone(), output.clone(), &data.slices, &batch).unwrap();
            let wrong = output.slice_assign(s![1..2, ..], twice.slice(s![1..2, ..]));
            let why = reference.check(&wrong).unwrap_err();
            assert!(why.contains("off by"), "{what}: {why}");
        }
    }
}
