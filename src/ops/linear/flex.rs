//! The linears' product on Flex (the CPU backend): one `gemm` call that adds onto rows of the
//! bias, whichever kernel is asked for.

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, TensorData};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::{LinearBackend, composed};
use crate::runtime::flex::{dense, element, gemm_parallelism, strided, values};

impl LinearBackend for Flex {
    /// f32: the output starts as rows of `bias` and `gemm` adds `x · weight_t` to it as it
    /// stores its blocks, which saves the separate add's pass over the output (measured on the 2B
    /// tower's linears: BENCHMARKS.md); other dtypes composed.
    fn linear_native(
        x: FloatTensor<Self>,
        weight_t: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if [x.dtype(), weight_t.dtype(), bias.dtype()] != [DType::F32; 3] {
            return composed::<Self>(x, weight_t, bias);
        }
        let (x, weight_t, bias) = (strided(x), strided(weight_t), dense(bias));
        let [rows, inner] = x.layout().shape().dims::<2>();
        let [_, out] = weight_t.layout().shape().dims::<2>();
        assert_eq!(
            weight_t.layout().shape().dims::<2>(),
            [inner, out],
            "x and weight_t share their inner width"
        );
        let bias = values(&bias);
        assert_eq!(bias.len(), out, "one bias per output column");
        let mut y = Vec::with_capacity(rows * out);
        if rows * out > 0 {
            // Each row written once, with the bias: no zeroing pass first.
            let spare = &mut y.spare_capacity_mut()[..rows * out];
            spare
                .par_chunks_mut(out * BIAS_ROWS_PER_TASK)
                .for_each(|rows| {
                    for row in rows.chunks_exact_mut(out) {
                        row.write_copy_of_slice(bias);
                    }
                });
            // SAFETY: the loop above wrote every one of the `rows × out` values.
            unsafe { y.set_len(rows * out) };
        }
        if !y.is_empty() && inner > 0 {
            let [x_rows, x_cols] = strides(&x);
            let [w_rows, w_cols] = strides(&weight_t);
            // SAFETY: `y` is `rows × out`, row stride `out`; `strided` checked that `x`
            // (`rows × inner`) and `weight_t` (`inner × out`) address only their storage.
            unsafe {
                gemm::gemm(
                    rows,
                    out,
                    inner,
                    y.as_mut_ptr(),
                    1,
                    out as isize,
                    true,
                    element(&x, &[0, 0]),
                    x_cols,
                    x_rows,
                    element(&weight_t, &[0, 0]),
                    w_cols,
                    w_rows,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm_parallelism(rows, out, inner),
                );
            }
        }
        FlexTensor::from_data(TensorData::new(y, [rows, out]))
    }
}

/// Rows of bias each rayon task copies into a Flex linear's output.
const BIAS_ROWS_PER_TASK: usize = 16;

/// A 2-D Flex tensor's row and column strides.
fn strides(tensor: &FlexTensor) -> [isize; 2] {
    tensor.layout().strides().try_into().expect("a 2-D layout")
}
