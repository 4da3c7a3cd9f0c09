//! Reading and writing Flex (CPU backend) tensors' memory, for the CPU ops that call `gemm` or
//! loop over values themselves instead of going through Burn's tensor ops.

use burn_flex::FlexTensor;
use gemm::Parallelism;

/// Multiply-adds from which a `gemm` call is split over threads (Flex's own threshold).
const PARALLEL_MACS: usize = 192 * 192 * 192;

/// How a `gemm` call of `m × n × k` that may use every thread should be split: over the rayon
/// threads from `PARALLEL_MACS` multiply-adds, not at all below.
pub fn gemm_parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_MACS {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// `tensor` laid out densely, row-major from its first element, as the `gemm` calls read it (a
/// copy only when it is a strided view or starts past its storage's first value).
pub fn dense(tensor: FlexTensor) -> FlexTensor {
    if tensor.layout().contiguous_offsets().map(|(start, _)| start) == Some(0) {
        tensor
    } else {
        tensor.to_contiguous()
    }
}

/// An f32 `tensor` as it lies where its strides are all ≥ 0 (a dense copy otherwise), checked to
/// address only its storage: what `gemm` calls reading it through its strides rely on.
pub fn strided(tensor: FlexTensor) -> FlexTensor {
    let tensor = if tensor.layout().has_positive_strides() {
        tensor
    } else {
        tensor.to_contiguous()
    };
    let layout = tensor.layout();
    let last: usize = layout
        .shape()
        .iter()
        .zip(layout.strides())
        .map(|(&dim, &stride)| dim.saturating_sub(1) * stride as usize)
        .sum();
    assert!(
        layout.num_elements() == 0 || layout.start_offset() + last < tensor.storage::<f32>().len(),
        "a Flex layout addresses only its storage"
    );
    tensor
}

/// Where element `index` of a [`strided`] tensor lies.
pub fn element(tensor: &FlexTensor, index: &[usize]) -> *const f32 {
    let layout = tensor.layout();
    let offset = layout.start_offset()
        + index
            .iter()
            .zip(layout.strides())
            .map(|(&i, &stride)| i * stride as usize)
            .sum::<usize>();
    tensor.storage::<f32>()[offset..].as_ptr()
}

/// The values of a dense f32 tensor (as [`dense`] makes it; the callers check the dtype).
pub fn values(tensor: &FlexTensor) -> &[f32] {
    tensor.as_slice().expect("a dense f32 tensor")
}

/// The values of a dense f32 tensor, to write in place.
pub fn values_mut(tensor: &mut FlexTensor) -> &mut [f32] {
    let len = tensor.layout().num_elements();
    &mut tensor.storage_mut::<f32>()[..len]
}
