//! The activations on Flex (the CPU backend): one in-place pass split over the rayon threads, in
//! SIMD lanes ([`exp`]), where Burn's composition makes several passes, each on one core with a
//! scalar `exp`.

use burn::backend::{Flex, tensor::FloatTensor};
use burn::tensor::DType;
use multiversion::multiversion;
use rayon::prelude::*;

use super::{
    ActivationBackend, GELU_TANH_CUBIC, GELU_TANH_SLOPE, QUICK_GELU_SLOPE, SILU_SLOPE, composed,
    composed_gelu_tanh,
};
use crate::runtime::exp::exp;
use crate::runtime::flex::{dense, values_mut};

/// Values per rayon task: a few hundred KiB, enough to hide the task's overhead.
pub(super) const CHUNK: usize = 1 << 16;

impl ActivationBackend for Flex {
    fn quick_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        in_place_on_flex(
            x,
            |x| composed::<Flex>(x, QUICK_GELU_SLOPE),
            |values| gated_in_place(values, QUICK_GELU_SLOPE),
        )
    }

    fn silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        in_place_on_flex(
            x,
            |x| composed::<Flex>(x, SILU_SLOPE),
            |values| gated_in_place(values, SILU_SLOPE),
        )
    }

    fn gelu_tanh(x: FloatTensor<Self>) -> FloatTensor<Self> {
        in_place_on_flex(x, composed_gelu_tanh::<Flex>, gelu_tanh_in_place)
    }
}

/// An activation on Flex: f32 in one parallel pass of `pass` over chunks, in place when `x` is
/// not shared; other dtypes by `composed`.
fn in_place_on_flex(
    x: FloatTensor<Flex>,
    composed: impl FnOnce(FloatTensor<Flex>) -> FloatTensor<Flex>,
    pass: impl Fn(&mut [f32]) + Sync + Send,
) -> FloatTensor<Flex> {
    if x.dtype() != DType::F32 {
        return composed(x);
    }
    let mut y = dense(x);
    values_mut(&mut y).par_chunks_mut(CHUNK).for_each(pass);
    y
}

/// `x · sigmoid(slope · x)` over `values` as `x / (1 + exp(−slope · x))`, in SIMD lanes
/// ([`exp`]): the quotient keeps the limits exact (`exp` overflowing to ∞ gives −0 for large
/// negative `x`; `x` itself for large positive), and NaN stays NaN.
#[multiversion(targets = "simd")]
fn gated_in_place(values: &mut [f32], slope: f32) {
    for x in values {
        *x /= 1.0 + exp(-slope * *x);
    }
}

/// GELU-tanh over `values` as `x / (1 + exp(−2k · (x + 0.044715 x³)))`, in SIMD lanes, with
/// the limits of [`gated_in_place`] (a cube overflowing to ±∞ gives `x` or −0).
#[multiversion(targets = "simd")]
fn gelu_tanh_in_place(values: &mut [f32]) {
    for x in values {
        let inner = *x + GELU_TANH_CUBIC * (*x * *x * *x);
        *x /= 1.0 + exp(-GELU_TANH_SLOPE * inner);
    }
}
