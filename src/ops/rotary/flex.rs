//! The rotation on Flex (the CPU backend): one pass over the rows, split over the rayon
//! threads, with the composed form's products and sum in the same order, so it gives the same
//! bits.

use burn::backend::{Flex, tensor::FloatTensor};
use burn::tensor::{DType, Shape};
use rayon::prelude::*;

use super::{RopeBackend, composed};
use crate::runtime::flex::{dense, values, values_mut};

/// Rows per rayon task: tens of KiB of the 2B tower's `q`, enough to hide the task's overhead.
pub(super) const ROWS_PER_TASK: usize = 16;

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
