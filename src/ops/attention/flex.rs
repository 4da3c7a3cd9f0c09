//! Attention on Flex (the CPU backend): each segment's heads, in blocks of [`QUERY_BLOCK`]
//! queries, side by side on the rayon threads: one `gemm` call for the scaled scores straight
//! from `q` and `k` where they lie, the softmax in SIMD lanes ([`exp`]), one `gemm` call writing
//! the output into its place.

use burn::backend::Flex;
use burn::tensor::{DType, TensorData};
use burn_flex::FlexTensor;
use gemm::Parallelism;
use multiversion::multiversion;
use rayon::prelude::*;

use super::{SdpaBackend, composed};
use crate::runtime::exp::exp;
use crate::runtime::flex::{element, strided};

/// Queries per rayon task: a whole 256-patch image of the 2B tower (its scores 256 KiB of f32,
/// within a core's L2), so each head's keys are packed for `gemm` once (64 and 128 measured
/// slower: BENCHMARKS.md).
pub(super) const QUERY_BLOCK: usize = 256;

/// Partial sums of a softmax row: one AVX-512 register of f32.
const LANES: usize = 16;

impl SdpaBackend for Flex {
    /// f32 in one parallel pass over (segment, head, query block); other dtypes composed.
    fn attend(q: FlexTensor, k: FlexTensor, v: FlexTensor, scale: f64) -> FlexTensor {
        if [q.dtype(), k.dtype(), v.dtype()] != [DType::F32; 3] {
            return composed::<Self>(q, k, v, scale);
        }
        let (q, k, v) = (View::of(q), View::of(k), View::of(v));
        let [segments, queries, heads, head_dim] = q.dims;
        let [_, len, _, _] = k.dims;
        assert!(
            k.dims == [segments, len, heads, head_dim] && v.dims == k.dims,
            "q {:?}, k {:?} and v {:?} are one batch of segments and heads",
            q.dims,
            k.dims,
            v.dims
        );
        let size = segments * queries * heads * head_dim;
        if len == 0 || size == 0 {
            // With no keys every output is an empty sum: zero.
            return FlexTensor::zeros([segments, queries, heads, head_dim].into(), DType::F32);
        }
        let mut output: Vec<f32> = Vec::with_capacity(size);
        let out = OutputRows {
            start: output.as_mut_ptr(),
            row_stride: heads * head_dim,
        };
        let blocks = queries.div_ceil(QUERY_BLOCK);
        (0..segments * heads * blocks)
            .into_par_iter()
            .for_each_init(
                || vec![0.0f32; QUERY_BLOCK * len],
                |scores, task| {
                    let (segment, rest) = (task / (heads * blocks), task % (heads * blocks));
                    let (head, block) = (rest / blocks, rest % blocks);
                    let first = block * QUERY_BLOCK;
                    let rows = QUERY_BLOCK.min(queries - first);
                    let task = Task {
                        segment,
                        head,
                        first,
                        out_row: segment * queries + first,
                        rows,
                        len,
                        head_dim,
                    };
                    // SAFETY: tasks differ in (segment, head, block), so each writes its own
                    // rows × head_dim block of `output`, which outlives the parallel loop.
                    unsafe { task.run(&q, &k, &v, scale as f32, &mut scores[..rows * len], out) };
                },
            );
        // SAFETY: the tasks cover every (segment, head, query block), and each one's second
        // `gemm` call wrote all of its block's values.
        unsafe { output.set_len(size) };
        FlexTensor::from_data(TensorData::new(
            output,
            [segments, queries, heads, head_dim],
        ))
    }
}

/// A 4-D f32 tensor read through its strides ([`strided`]).
struct View {
    tensor: FlexTensor,
    dims: [usize; 4],
    strides: [isize; 4],
}

impl View {
    fn of(tensor: FlexTensor) -> Self {
        let tensor = strided(tensor);
        let dims = tensor.layout().shape().dims::<4>();
        let strides = tensor.layout().strides().try_into().expect("a 4-D layout");
        Self {
            tensor,
            dims,
            strides,
        }
    }

    /// Where element `[segment, row, head, 0]` lies.
    fn at(&self, segment: usize, row: usize, head: usize) -> *const f32 {
        element(&self.tensor, &[segment, row, head, 0])
    }
}

/// The output's first value and its row stride, shared by the tasks that write it.
#[derive(Clone, Copy)]
struct OutputRows {
    start: *mut f32,
    row_stride: usize,
}

// SAFETY: the tasks that share it write disjoint blocks (see `Task::run`).
unsafe impl Send for OutputRows {}
unsafe impl Sync for OutputRows {}

/// One segment's one head for the queries `first .. first + rows`.
struct Task {
    segment: usize,
    head: usize,
    /// The first query, within the segment.
    first: usize,
    /// The output row of the first query.
    out_row: usize,
    rows: usize,
    len: usize,
    head_dim: usize,
}

impl Task {
    /// Scores into `scores` (`rows × len`), softmax in place, then the weighted values into the
    /// task's block of `out`.
    ///
    /// # Safety
    /// `out` is a dense `[segments · queries, heads · head_dim]` buffer holding this task's
    /// block, and no other thread reads or writes that block during the call.
    unsafe fn run(
        &self,
        q: &View,
        k: &View,
        v: &View,
        scale: f32,
        scores: &mut [f32],
        out: OutputRows,
    ) {
        let Self {
            segment,
            head,
            first,
            out_row,
            rows,
            len,
            head_dim,
        } = *self;
        let (q_rows, q_cols) = (q.strides[1], q.strides[3]);
        let (k_rows, k_cols) = (k.strides[1], k.strides[3]);
        let (v_rows, v_cols) = (v.strides[1], v.strides[3]);
        // SAFETY: `strided` checked that every element of q, k and v lies in its storage, and
        // these read rows `first .. first + rows` of q and all `len` rows of k and v of one
        // segment and head; `scores` is `rows × len`, row stride `len`.
        unsafe {
            gemm::gemm(
                rows,
                len,
                head_dim,
                scores.as_mut_ptr(),
                1,
                len as isize,
                false,
                q.at(segment, first, head),
                q_cols,
                q_rows,
                k.at(segment, 0, head),
                k_rows,
                k_cols,
                0.0,
                scale,
                false,
                false,
                false,
                Parallelism::None,
            );
        }
        for row in scores.chunks_exact_mut(len) {
            softmax_in_place(row);
        }
        // SAFETY: the caller's block of `out`: rows `out_row .. out_row + rows`, columns
        // `head · head_dim ..` of `head_dim` values, row stride `out.row_stride`; `scores` is
        // `rows × len` and v's rows are read as above.
        unsafe {
            gemm::gemm(
                rows,
                head_dim,
                len,
                out.start.add(out_row * out.row_stride + head * head_dim),
                1,
                out.row_stride as isize,
                false,
                scores.as_ptr(),
                1,
                len as isize,
                v.at(segment, 0, head),
                v_cols,
                v_rows,
                0.0,
                1.0,
                false,
                false,
                false,
                Parallelism::None,
            );
        }
    }
}

/// `row` replaced by its softmax: `exp(x − max)`, then scaled by the inverse of their sum,
/// summed in [`LANES`] interleaved partial sums so that the loop vectorises.
#[multiversion(targets = "simd")]
fn softmax_in_place(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sums = [0.0f32; LANES];
    let (lanes, rest) = row.as_chunks_mut::<LANES>();
    for lane in lanes {
        for (x, sum) in lane.iter_mut().zip(&mut sums) {
            *x = exp(*x - max);
            *sum += *x;
        }
    }
    for (x, sum) in rest.iter_mut().zip(&mut sums) {
        *x = exp(*x - max);
        *sum += *x;
    }
    let inverse = 1.0 / sums.iter().sum::<f32>();
    for x in row {
        *x *= inverse;
    }
}
