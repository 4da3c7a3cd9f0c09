//! The rotary embedding's rotation, `x·cos + rotate_half(x)·sin`, as a backend extension.
//!
//! Composed from Burn's ops it is two slices, a negation, a concatenation, two broadcast
//! products and a sum: five passes over `q` (and five over `k`) per block, each on one core on
//! Flex (the CPU backend), 5.5 ms per tensor at 2048 rows of Qwen2-VL-2B. Flex here makes one
//! pass over the rows, split over the rayon threads, with the same products and sum in the same
//! order, so it gives the same bits. The GPU backends keep the composed form ([`composed`]),
//! which Burn's fusion compiles with its neighbours.

use std::ops::Range;

use burn::backend::{
    Backend, Dispatch, Flex, TensorMetadata, backend_extension, tensor::FloatTensor,
    wgpu::CubeBackend,
};
use burn::tensor::{DType, Shape, Tensor};
use rayon::prelude::*;

use crate::lora::ops::native::{dense, values, values_mut};

/// Rows per rayon task: tens of KiB of the 2B tower's `q`, enough to hide the task's overhead.
const ROWS_PER_TASK: usize = 16;

/// Rotations with a faster implementation than their composition on some backend.
#[backend_extension(Cube, Flex, Fusion)]
pub trait RopeBackend: Backend {
    /// `x·cos + rotate_half(x)·sin` for `x`: `[rows, heads, head_dim]` (`head_dim` even) and
    /// `cos`, `sin`: `[rows, 1, head_dim]`, where `rotate_half` maps each head's halves
    /// `(a, b)` to `(−b, a)`.
    #[fusion(default)]
    fn rotate(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        composed::<Self>(x, cos, sin)
    }
}

/// The rotation from Burn's ops, on any backend.
pub fn composed<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    let [rows, heads, head_dim] = x.shape().dims::<3>();
    let half = |columns: Range<usize>| {
        B::float_slice(
            x.clone(),
            &[(0..rows).into(), (0..heads).into(), columns.into()],
        )
    };
    let first = half(0..head_dim / 2);
    let second = half(head_dim / 2..head_dim);
    let rotated = B::float_cat(vec![B::float_neg(second), first], 2);
    B::float_add(B::float_mul(x, cos), B::float_mul(rotated, sin))
}

/// `x·cos + rotate_half(x)·sin` on the backend of `x`'s device (shapes as in
/// [`RopeBackend::rotate`]).
pub fn rotate(x: Tensor<3>, cos: &Tensor<3>, sin: &Tensor<3>) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as RopeBackend>::rotate(
        x.into_dispatch(),
        cos.clone().into_dispatch(),
        sin.clone().into_dispatch(),
    ))
}

/// [`rotate`] computed in f32 whatever `x`'s dtype, the result in `x`'s dtype: under f16,
/// transformers' Qwen2-VL rotates `q` and `k` in f32 with f32 angles and casts back
/// (`apply_rotary_pos_emb_vision`), one rounding to f16 per value. `cos` and `sin` are f32.
pub fn rotate_in_f32(x: Tensor<3>, cos: &Tensor<3>, sin: &Tensor<3>) -> Tensor<3> {
    let dtype = x.dtype();
    rotate(x.cast(DType::F32), cos, sin).cast(dtype)
}

impl RopeBackend for CubeBackend {}

impl RopeBackend for Flex {
    /// f32 in one parallel pass over the rows, in place when `x` is dense and not shared; other
    /// dtypes composed.
    fn rotate(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if [x.dtype(), cos.dtype(), sin.dtype()] != [DType::F32; 3] {
            return composed::<Self>(x, cos, sin);
        }
        let [rows, heads, head_dim] = x.layout().shape().dims::<3>();
        assert_eq!(
            [cos.layout().shape(), sin.layout().shape()],
            [&Shape::from([rows, 1, head_dim]); 2],
            "cos and sin hold one head's angles per row"
        );
        let (cos, sin) = (dense(cos), dense(sin));
        let (cos, sin) = (values(&cos), values(&sin));
        let mut y = dense(x);
        let row = heads * head_dim;
        values_mut(&mut y)
            .par_chunks_mut(ROWS_PER_TASK * row)
            .zip(cos.par_chunks(ROWS_PER_TASK * head_dim))
            .zip(sin.par_chunks(ROWS_PER_TASK * head_dim))
            .for_each(|((y, cos), sin)| {
                let angles = cos.chunks_exact(head_dim).zip(sin.chunks_exact(head_dim));
                for (y, (cos, sin)) in y.chunks_exact_mut(row).zip(angles) {
                    for head in y.chunks_exact_mut(head_dim) {
                        rotate_head(head, cos, sin);
                    }
                }
            });
        y
    }
}

/// One head's vector rotated in place: for each `j` below half, `a = x[j]`, `b = x[j + half]`
/// become `a·cos[j] + (−b)·sin[j]` and `b·cos[j + half] + a·sin[j + half]`, the composed form's
/// products and sum exactly.
fn rotate_head(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (first, second) = head.split_at_mut(half);
    let (cos_first, cos_second) = cos.split_at(half);
    let (sin_first, sin_second) = sin.split_at(half);
    for j in 0..half {
        let (a, b) = (first[j], second[j]);
        first[j] = a * cos_first[j] + -b * sin_first[j];
        second[j] = b * cos_second[j] + a * sin_second[j];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device;
    use burn::tensor::Distribution;

    /// Flex's pass gives the composed form's bits: at the 2B shape (rows spanning several
    /// tasks and a short last one), on a strided `x` (a slice of a packed qkv, as the tower
    /// passes it), and leaving the `x` a caller still holds as it was.
    #[test]
    fn flex_gives_the_composed_bits() {
        let cpu = device::cpu();
        let (rows, heads, head_dim) = (3 * ROWS_PER_TASK + 5, 16, 80);
        let qkv = Tensor::<4>::random(
            [rows, 3, heads, head_dim],
            Distribution::Uniform(-4.0, 4.0),
            &cpu.device,
        );
        let angles = |seed: f64| {
            Tensor::<3>::random(
                [rows, 1, head_dim],
                Distribution::Uniform(-seed, seed),
                &cpu.device,
            )
        };
        let (cos, sin) = (angles(1.0), angles(1.0));
        let dense_x =
            Tensor::<3>::random([rows, heads, head_dim], Distribution::Default, &cpu.device);
        let strided_x = qkv.slice([0..rows, 1..2]).reshape([rows, heads, head_dim]);
        for x in [dense_x, strided_x] {
            let before = x.clone().into_data();
            let expected = Tensor::<3>::from_primitive::<Flex>(composed::<Flex>(
                x.clone().try_into_primitive::<Flex>().unwrap(),
                cos.clone().try_into_primitive::<Flex>().unwrap(),
                sin.clone().try_into_primitive::<Flex>().unwrap(),
            ));
            // Tolerance: none; the same f32 products and sums in the same order.
            rotate(x.clone(), &cos, &sin)
                .into_data()
                .assert_eq(&expected.into_data(), true);
            x.into_data().assert_eq(&before, true);
        }
    }

    /// In f16 (on a GPU with `SHADER_F16`), each value is the float64 rotation of the f16 inputs
    /// rounded to f16 once, as transformers computes it: rotating in f16 rounds each product
    /// and the sum too, and misses this bound.
    #[test]
    fn f16_rotates_in_f32_and_rounds_once() {
        let Some(gpu) = device::gpu_for_tests().filter(device::f16_for_tests) else {
            return;
        };
        // The 2B tower's heads; values up to 8 and angles of every sign, so sums cancel.
        let (rows, heads, head_dim) = (64, 16, 80);
        let x = Tensor::<3>::random(
            [rows, heads, head_dim],
            Distribution::Uniform(-8.0, 8.0),
            &gpu.device,
        )
        .cast(DType::F16);
        let angle = || {
            Tensor::<3>::random(
                [rows, 1, head_dim],
                Distribution::Uniform(-1.0, 1.0),
                &gpu.device,
            )
        };
        let (cos, sin) = (angle(), angle());
        let got = rotate_in_f32(x.clone(), &cos, &sin);
        assert_eq!(got.dtype(), DType::F16);
        let floats = |t: Tensor<3>| -> Vec<f64> {
            let values = t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
            values.into_iter().map(f64::from).collect()
        };
        let (x, cos, sin, got) = (floats(x), floats(cos), floats(sin), floats(got));
        let half = head_dim / 2;
        for (i, &y) in got.iter().enumerate() {
            let (row, j) = (i / (heads * head_dim), i % head_dim);
            let head = i - j;
            let angle = row * head_dim + j;
            let (own, partner) = if j < half {
                (x[i], -x[head + j + half])
            } else {
                (x[i], x[head + j - half])
            };
            let (a, b) = (own * cos[angle], partner * sin[angle]);
            let exact = a + b;
            // Tolerance: half an f16 ulp of the result (its one rounding; 2^-24 below f16's
            // normal range) plus f32's two products and sum, 2^-23 · (|a| + |b|).
            let ulp = if exact.abs() < 2f64.powi(-14) {
                2f64.powi(-24)
            } else {
                2f64.powi(exact.abs().log2().floor() as i32 - 10)
            };
            let bound = ulp / 2.0 + 2f64.powi(-23) * (a.abs() + b.abs());
            assert!(
                (y - exact).abs() <= bound,
                "value {i}: {y} against {exact}, bound {bound:e}"
            );
        }
    }

    /// The rotation itself, on one head against float64: `(a, b) → (a·c − b·s, b·c + a·s)`.
    #[test]
    fn rotates_each_half_pair() {
        let cpu = device::cpu();
        let x = Tensor::<3>::from_floats([[[1.0, 2.0, 3.0, 4.0]]], &cpu.device);
        let cos = Tensor::<3>::from_floats([[[0.5, 0.25, 2.0, 4.0]]], &cpu.device);
        let sin = Tensor::<3>::from_floats([[[1.0, -1.0, 0.5, 0.125]]], &cpu.device);
        let y = rotate(x, &cos, &sin)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        // Exact in f32: every product and sum is a small dyadic rational. Halves (1, 2) and
        // (3, 4): 1·0.5 − 3·1, 2·0.25 − 4·(−1), 3·2 + 1·0.5, 4·4 + 2·0.125.
        assert_eq!(y, [-2.5, 4.5, 6.5, 16.25]);
    }
}
