//! The LoRA-apply op: `y = base + (x · A[slot]ᵀ) · B[slot]ᵀ` for every row, each row with its own
//! adapter slot.
//!
//! One backend extension (`LoraBackend`) with two implementations that share the same
//! [`KernelMeta`]:
//! - `flex.rs`: the CPU backend (Flex): for each slot's rows, two `gemm` calls on the tensors'
//!   memory, the expand adding into the output in place. Checked against a float64 per-row loop.
//! - `wgsl.rs`: our shaders (`shaders/lora/lora_shrink*.wgsl`, `shaders/lora/lora_expand*.wgsl`) on
//!   Burn's wgpu buffers, walking the same segments in tiles of rows; the shrink shader is the
//!   batch's [`ShrinkKernel`], picked for the device (`choice.rs` times the candidates on a
//!   hardware GPU).
//!
//! Rows whose slot is [`NO_SLOT`](crate::routing::meta::NO_SLOT) keep `base` bit-for-bit. Callers
//! use [`lora_apply`], which checks shapes, ranks, slots and row counts and returns a typed
//! [`LoraOpError`] instead of a wrong answer.
//!
//! `linear_lora` is the op fused into the base product, for a layer whose product one of our
//! linear kernels computes on a wgpu device: the shrink runs first, and the kernel adds each
//! row's `shrunk · B[slot]ᵀ` to its sums as it stores the row (`shaders/linear/linear_lora.wgsl`),
//! which saves the expand's launch and its pass over the output.

mod choice;
mod composed;
mod flex;
mod fusion;
#[cfg(test)]
pub(crate) mod testing;
mod wgsl;

#[cfg(feature = "bench")]
pub(crate) use choice::CANDIDATES as SHRINK_CANDIDATES;
pub(crate) use fusion::fuses;
#[cfg(test)]
pub(crate) use fusion::keep_for_tests;

use std::borrow::Cow;
use std::num::NonZeroUsize;
use std::sync::Arc;

use burn::backend::{
    Dispatch, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::{DType, Device, Int, Shape, Tensor, TensorData};

use crate::named::named_choice;
use crate::ops::linear::{self, LinearBackend, LinearShader};
use crate::routing::meta::{KernelMeta, MetaError};
use crate::runtime::device::{DeviceClass, RuntimeDevice};

/// The largest adapter rank the op accepts (vLLM's largest `max_lora_rank`).
pub const MAX_RANK: usize = 512;

/// Rows per tile: the WGSL kernels give each workgroup up to this many rows of one slot.
pub(crate) const TILE_ROWS: usize = 16;

/// [`TILE_ROWS`] as [`KernelMeta::tiles`] takes it.
const TILE: NonZeroUsize = NonZeroUsize::new(TILE_ROWS).expect("tiles hold rows");

named_choice! {
    /// Which shader computes the shrink (`x · A[slot]ᵀ`) on a wgpu device; the CPU backend has one
    /// implementation and ignores it.
    #[derive(Default, Hash)]
    pub enum ShrinkKernel {
        /// `registers` on a software rasterizer (lavapipe), where it is measured faster; `timed`
        /// on a hardware GPU (the CPU backend has one shrink of its own).
        #[default]
        Auto,
        /// The faster of `split` and `wide` for each shape, timed on the device the first time the
        /// op runs on it (the `ops::lora::choice` module); for hardware GPUs.
        Timed,
        /// `shaders/lora/lora_shrink.wgsl`: 64 threads per tile, each four rows by the whole rank
        /// block over every 16th column, for hardware GPUs.
        Split,
        /// `split`'s shaders with 256 threads per tile: the shrink's threads each sum every 64th
        /// column, and the aligned (`vec4`) expand's each add to four rows rather than all sixteen
        /// (the scalar expand keeps 64). Four times the loads in flight, for hardware GPUs whose
        /// many cores `split` leaves idle at few rows.
        Wide,
        /// `shaders/lora/lora_shrink_registers.wgsl`: 8 threads per tile (one llvmpipe SIMD
        /// vector), each every row by the whole rank block over every 8th column, its sums in
        /// registers; for software rasterizers.
        Registers,
    }
}

impl ShrinkKernel {
    /// The kernel `self` picks on `device`: never `Auto`; `split` on the CPU backend, which
    /// has one shrink of its own. On a hardware GPU `auto` times `split` and `wide` once their
    /// shader has passed its tests on one, and until then takes `registers`, which has.
    pub fn resolve(self, device: &RuntimeDevice) -> Self {
        match (self, device.class()) {
            (ShrinkKernel::Auto | ShrinkKernel::Timed, DeviceClass::Cpu) => ShrinkKernel::Split,
            (ShrinkKernel::Auto, DeviceClass::SoftwareGpu) => ShrinkKernel::Registers,
            (ShrinkKernel::Auto, DeviceClass::HardwareGpu)
                if choice::CANDIDATES.iter().all(|k| k.hardware_checked()) =>
            {
                ShrinkKernel::Timed
            }
            (ShrinkKernel::Auto, DeviceClass::HardwareGpu) => ShrinkKernel::Registers,
            (chosen, _) => chosen,
        }
    }

    /// Whether this kernel's shrink shader passed its tests on a hardware GPU as it is now
    /// (`ops/hardware.rs`); `auto` and `timed` are choices, not shaders.
    pub(crate) fn hardware_checked(self) -> bool {
        match self {
            ShrinkKernel::Auto | ShrinkKernel::Timed => false,
            // Both vec4 and scalar forms are one file each.
            shrink => wgsl::LoraShader::shrink(shrink, 4).hardware_checked(),
        }
    }
}

/// The LoRA shaders a batch runs on its device: a shrink pin resolved there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraKernels {
    /// The shrink (never `Auto`; `Timed` picks one per shape).
    pub shrink: ShrinkKernel,
    /// Whether the expand may take its `vec4` shader where the widths allow: not under `auto`
    /// on a hardware GPU until that shader has passed its tests on one.
    pub expand_vec4: bool,
}

impl LoraKernels {
    /// What the shrink pin `shrink` runs on `device`. A pin other than `auto` opts into every
    /// shader, the `vec4` expand included.
    pub(crate) fn for_device(shrink: ShrinkKernel, device: &RuntimeDevice) -> Self {
        Self {
            shrink: shrink.resolve(device),
            expand_vec4: device.class() != DeviceClass::HardwareGpu
                || shrink != ShrinkKernel::Auto
                || wgsl::LoraShader::ExpandVec4.hardware_checked(),
        }
    }
}

/// Host-side kernel metadata carried into the backend implementations.
#[derive(Debug, Clone)]
pub(crate) struct LoraPlan {
    /// The rows' slots, sorted and tiled.
    pub meta: Arc<KernelMeta>,
    /// The shrink shader the WGSL implementation launches (resolved: never `Auto`, and by the
    /// time the backend sees it never `Timed`).
    pub shrink: ShrinkKernel,
    /// Whether the expand may take its `vec4` shader where the widths allow: not under `auto`
    /// on a hardware GPU until that shader has passed its tests on one.
    pub expand_vec4: bool,
}

/// The LoRA-apply op as a Burn backend extension.
#[backend_extension(Cube, Flex, Fusion)]
pub(crate) trait LoraBackend: burn::backend::Backend {
    /// Returns `base` with `x · A[slot]ᵀ · B[slot]ᵀ` added to columns
    /// `out_offset .. out_offset + B.dims[1]` of every row whose slot is not −1.
    ///
    /// `x`: `[rows, in]`; `base`: `[rows, out_total]`; `lora_a`: `[slots, rank, in]`;
    /// `lora_b`: `[slots, out, rank]`; `sorted_tokens`: rows sorted by slot; `tiles`:
    /// `[n_tiles · 4]` as (slot, start, len, 0). Shapes are checked by [`lora_apply`].
    #[allow(clippy::too_many_arguments)]
    #[fusion(dtype = base, shape = base)]
    fn lora_apply(
        x: FloatTensor<Self>,
        base: FloatTensor<Self>,
        lora_a: FloatTensor<Self>,
        lora_b: FloatTensor<Self>,
        sorted_tokens: IntTensor<Self>,
        tiles: IntTensor<Self>,
        plan: LoraPlan,
        out_offset: usize,
    ) -> FloatTensor<Self>;

    /// `x · weight_t + bias` (as [`LinearBackend::linear_wgsl`](linear::LinearBackend)) with
    /// `x · A[slot]ᵀ · B[slot]ᵀ` added to every row whose slot (`row_slots`, `[rows]`) is not
    /// −1: the shrink, then `shader` with its LoRA epilogue, where the device runs it; Burn's
    /// product and [`LoraBackend::lora_apply`] where not. `lora_b` covers every output column.
    /// Shapes and what the shader takes are checked by [`linear_lora`].
    #[allow(clippy::too_many_arguments)]
    #[fusion(dtype = x, shape = Shape::from([x[0], weight_t[1]]))]
    fn linear_lora(
        x: FloatTensor<Self>,
        weight_t: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        lora_a: FloatTensor<Self>,
        lora_b: FloatTensor<Self>,
        sorted_tokens: IntTensor<Self>,
        tiles: IntTensor<Self>,
        row_slots: IntTensor<Self>,
        plan: LoraPlan,
        shader: LinearShader,
    ) -> FloatTensor<Self>;
}

/// The kernel metadata of one forward call, uploaded once and shared by every LoRA layer the
/// call runs through.
#[derive(Debug, Clone)]
pub struct LoraBatch {
    plan: LoraPlan,
    sorted_tokens: Tensor<1, Int>,
    tiles: Tensor<1, Int>,
    /// Each row's slot, for the linear kernels' LoRA epilogue ([`linear_lora`]).
    row_slots: Tensor<1, Int>,
}

impl LoraBatch {
    /// Uploads `meta` to `device`, for the shrink kernel the device runs best
    /// ([`ShrinkKernel::Auto`]).
    pub fn new(meta: KernelMeta, device: &RuntimeDevice) -> Self {
        Self::with_shrink(meta, device, ShrinkKernel::Auto)
    }

    /// Uploads `meta` to `device`, for the shrink kernel `shrink` picks there.
    pub(crate) fn with_shrink(
        meta: KernelMeta,
        device: &RuntimeDevice,
        shrink: ShrinkKernel,
    ) -> Self {
        Self::with_kernels(meta, device, LoraKernels::for_device(shrink, device))
    }

    /// Uploads `meta` to `device`, for `kernels`.
    pub(crate) fn with_kernels(
        meta: KernelMeta,
        device: &RuntimeDevice,
        kernels: LoraKernels,
    ) -> Self {
        Self::upload(meta, &device.device, kernels)
    }

    /// The batch of these rows reordered ([`KernelMeta::permuted`]), on the same device with
    /// the same kernels: for a tower that permutes its rows.
    pub fn permuted(&self, order: &[usize]) -> Result<Self, MetaError> {
        let kernels = LoraKernels {
            shrink: self.plan.shrink,
            expand_vec4: self.plan.expand_vec4,
        };
        let meta = self.plan.meta.permuted(order)?;
        Ok(Self::upload(meta, &self.sorted_tokens.device(), kernels))
    }

    /// Uploads `meta` to `device`, for `kernels`.
    fn upload(meta: KernelMeta, device: &Device, kernels: LoraKernels) -> Self {
        let sorted: Vec<i32> = meta.sorted_tokens().iter().map(|&r| r as i32).collect();
        let tiles: Vec<i32> = meta
            .tiles(TILE)
            .flat_map(|t| [t.slot, t.start as i32, t.len as i32, 0])
            .collect();
        let upload = |v: Vec<i32>| {
            let n = v.len();
            Tensor::<1, Int>::from_data(TensorData::new(v, [n]), device)
        };
        Self {
            sorted_tokens: upload(sorted),
            tiles: upload(tiles),
            row_slots: upload(meta.token_slots().to_vec()),
            plan: LoraPlan {
                meta: Arc::new(meta),
                shrink: kernels.shrink,
                expand_vec4: kernels.expand_vec4,
            },
        }
    }

    /// The host-side metadata.
    pub fn meta(&self) -> &KernelMeta {
        &self.plan.meta
    }

    /// The shrink kernel the batch runs (never `Auto`; `Timed` picks one per shape).
    pub fn shrink(&self) -> ShrinkKernel {
        self.plan.shrink
    }

    /// The batch with its shrink kernel `shrink` (resolved).
    fn with_plan_shrink(&self, shrink: ShrinkKernel) -> Self {
        let mut batch = self.clone();
        batch.plan.shrink = shrink;
        batch
    }

    /// The batch with `Timed` resolved to the kernel `choice.rs` picks for this shape (timing
    /// the candidates if it is a new one): what the backend launches. `x`, an output of
    /// `out_total` columns and `slices` are the op's checked inputs, with an adapter row.
    fn resolved(&self, x: &Tensor<2>, out_total: usize, slices: &[LoraSlice]) -> Cow<'_, Self> {
        match self.shrink() {
            ShrinkKernel::Timed => {
                Cow::Owned(self.with_plan_shrink(choice::pick(x, out_total, slices, self).0))
            }
            _ => Cow::Borrowed(self),
        }
    }
}

/// One output slice's adapter weights, stacked over slots, with the scale folded into `b`.
#[derive(Debug, Clone)]
pub struct LoraSlice {
    /// `[slots, rank, in]`; ranks below `rank` are zero-padded.
    pub a: Tensor<3>,
    /// `[slots, out, rank]`.
    pub b: Tensor<3>,
    /// First output column of this slice in the layer's output.
    pub offset: usize,
}

/// Inputs the op cannot honour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraOpError {
    /// A tensor has the wrong shape.
    #[error("{tensor} has shape {actual:?}, expected {expected}")]
    Shape {
        /// Which tensor.
        tensor: &'static str,
        /// Its shape.
        actual: Vec<usize>,
        /// What was expected, in words.
        expected: String,
    },
    /// The mapping and the rows disagree.
    #[error("the LoRA mapping covers {mapping} rows but the input has {rows}")]
    TokenCountMismatch {
        /// Rows in the mapping.
        mapping: usize,
        /// Rows in the input.
        rows: usize,
    },
    /// The mapping addresses more slots than the weights hold.
    #[error("the mapping uses slots up to {slot}, but the weights hold {slots} slots")]
    SlotOutOfRange {
        /// The highest slot used.
        slot: i32,
        /// Slots in the weights.
        slots: usize,
    },
    /// The adapter rank is above [`MAX_RANK`] or zero.
    #[error("rank {rank} is outside 1..={max}")]
    Rank {
        /// The rank.
        rank: usize,
        /// The largest rank accepted.
        max: usize,
    },
    /// A tensor is neither `f32` nor `f16`, or not of `x`'s type.
    #[error("{tensor} is {dtype:?}; the LoRA op takes f32 or f16 tensors, all of x's type")]
    DType {
        /// Which tensor.
        tensor: &'static str,
        /// Its dtype.
        dtype: DType,
    },
    /// Tensors live on different devices.
    #[error("{tensor} is on another device than x")]
    Device {
        /// Which tensor.
        tensor: &'static str,
    },
}

/// Adds each row's LoRA delta to `base`, slice by slice.
///
/// `x` is the layer input `[rows, in]`, `base` the base layer's output `[rows, out_total]`.
/// Returns `base` unchanged when no row uses an adapter.
pub fn lora_apply(
    x: Tensor<2>,
    base: Tensor<2>,
    slices: &[LoraSlice],
    batch: &LoraBatch,
) -> Result<Tensor<2>, LoraOpError> {
    let output = Output::of(&base);
    for slice in slices {
        check(&x, &output, slice, batch)?;
    }
    if batch.meta().no_lora() {
        return Ok(base);
    }
    let batch = batch.resolved(&x, output.dims[1], slices);
    Ok(apply(x, base, slices, &batch))
}

/// `x · Wᵀ + b` (`weight_t` `[in, out]`) with each row's delta of `slice` added, computed by our
/// linear kernel `shader` with its LoRA epilogue after the shrink ([`LoraBackend::linear_lora`]),
/// where that fits: the shader has the epilogue ([`LinearShader::has_lora_epilogue`]) and takes
/// the product ([`linear::takes`]), `slice` covers every output column at a rank that is a
/// multiple of 4, and some row has an adapter. `None` where it does not fit: the caller computes
/// the product and [`lora_apply`] apart. Inputs the op cannot honour are its typed errors, as
/// [`lora_apply`]'s. The models reach it through [`fuse`] (the tests call it whole).
#[cfg(test)]
pub(crate) fn linear_lora(
    x: Tensor<2>,
    weight_t: &Tensor<2>,
    bias: &Tensor<1>,
    slice: &LoraSlice,
    batch: &LoraBatch,
    shader: LinearShader,
) -> Option<Result<Tensor<2>, LoraOpError>> {
    match fuse(&x, weight_t, bias, slice, batch, shader) {
        Ok(fused) => fused.map(|fused| Ok(fused.run(x))),
        Err(error) => Some(Err(error)),
    }
}

/// [`linear_lora`]'s checks and what it launches, apart from the launch: `Ok(None)` where the
/// op does not fit `shader`'s product, so that a caller can run the op fused or apart, both on
/// the same checked inputs (`fusion.rs` times the two).
pub(crate) fn fuse<'a>(
    x: &Tensor<2>,
    weight_t: &'a Tensor<2>,
    bias: &'a Tensor<1>,
    slice: &'a LoraSlice,
    batch: &'a LoraBatch,
    shader: LinearShader,
) -> Result<Option<FusedLinear<'a>>, LoraOpError> {
    let [rows, _] = x.dims();
    let [_, out_total] = weight_t.dims();
    let output = Output {
        name: "weight_t",
        dims: [rows, out_total],
        dtype: weight_t.dtype(),
        device: weight_t.device(),
    };
    check(x, &output, slice, batch)?;
    let [_, out_features, rank] = slice.b.dims();
    let fits = shader.has_lora_epilogue()
        && linear::takes(shader, x, weight_t, bias)
        && slice.offset == 0
        && out_features == out_total
        && rank.is_multiple_of(4)
        && !batch.meta().no_lora();
    Ok(fits.then(|| FusedLinear {
        weight_t,
        bias,
        slice,
        batch: batch.resolved(x, out_total, std::slice::from_ref(slice)),
        shader,
    }))
}

/// A layer's product and LoRA op on checked inputs that fit one of our linear kernels' LoRA
/// epilogues ([`fuse`]), to run fused or apart.
#[derive(Debug)]
pub(crate) struct FusedLinear<'a> {
    /// `[in, out]`.
    weight_t: &'a Tensor<2>,
    /// `[out]`.
    bias: &'a Tensor<1>,
    /// Covers every output column, at a rank that is a multiple of 4.
    slice: &'a LoraSlice,
    /// With its shrink kernel resolved (not `Timed`), and an adapter row.
    batch: Cow<'a, LoraBatch>,
    /// Has the epilogue and takes the product.
    shader: LinearShader,
}

impl FusedLinear<'_> {
    /// `x · Wᵀ + b` with each row's delta added by the shader's epilogue, after the shrink
    /// ([`LoraBackend::linear_lora`]); `x` is the input [`fuse`] checked.
    pub(crate) fn run(&self, x: Tensor<2>) -> Tensor<2> {
        let batch = &self.batch;
        Tensor::from_dispatch(<Dispatch as LoraBackend>::linear_lora(
            x.into_dispatch(),
            self.weight_t.clone().into_dispatch(),
            self.bias.clone().into_dispatch(),
            self.slice.a.clone().into_dispatch(),
            self.slice.b.clone().into_dispatch(),
            batch.sorted_tokens.clone().into_dispatch(),
            batch.tiles.clone().into_dispatch(),
            batch.row_slots.clone().into_dispatch(),
            batch.plan.clone(),
            self.shader,
        ))
    }

    /// The same sum with the op apart, as a layer runs it where it does not fuse: the
    /// shader's product without the epilogue, then the op ([`lora_apply`]'s shrink and expand)
    /// adding to it.
    pub(crate) fn apart(&self, x: Tensor<2>) -> Tensor<2> {
        let base = Tensor::from_dispatch(<Dispatch as LinearBackend>::linear_wgsl(
            x.clone().into_dispatch(),
            self.weight_t.clone().into_dispatch(),
            self.bias.clone().into_dispatch(),
            self.shader,
        ));
        apply(x, base, std::slice::from_ref(self.slice), &self.batch)
    }
}

/// [`lora_apply`] on checked inputs, with the batch's shrink kernel (resolved, not `Timed`).
fn apply(x: Tensor<2>, base: Tensor<2>, slices: &[LoraSlice], batch: &LoraBatch) -> Tensor<2> {
    let mut y = base;
    for slice in slices {
        let out = <Dispatch as LoraBackend>::lora_apply(
            x.clone().into_dispatch(),
            y.into_dispatch(),
            slice.a.clone().into_dispatch(),
            slice.b.clone().into_dispatch(),
            batch.sorted_tokens.clone().into_dispatch(),
            batch.tiles.clone().into_dispatch(),
            batch.plan.clone(),
            slice.offset,
        );
        y = Tensor::from_dispatch(out);
    }
    y
}

/// What [`check`] reads of the output the op adds to: the base output, or the product a fused
/// kernel writes.
#[derive(Debug, Clone)]
struct Output {
    /// The tensor errors name: `base`, or the fused product's `weight_t`.
    name: &'static str,
    /// `[rows, out_total]`.
    dims: [usize; 2],
    /// Its dtype, which must be `x`'s.
    dtype: DType,
    /// Its device, which must be `x`'s.
    device: Device,
}

impl Output {
    /// `base`'s.
    fn of(base: &Tensor<2>) -> Self {
        Output {
            name: "base",
            dims: base.dims(),
            dtype: base.dtype(),
            device: base.device(),
        }
    }
}

/// Validates one slice against the input, the output and the metadata.
fn check(
    x: &Tensor<2>,
    output: &Output,
    slice: &LoraSlice,
    batch: &LoraBatch,
) -> Result<(), LoraOpError> {
    let meta = batch.meta();
    let [rows, in_features] = x.dims();
    let [base_rows, out_total] = output.dims;
    let [slots, rank, a_in] = slice.a.dims();
    let [b_slots, out, b_rank] = slice.b.dims();
    let shape = |tensor, actual: &[usize], expected: String| LoraOpError::Shape {
        tensor,
        actual: actual.to_vec(),
        expected,
    };
    let dtype = x.dtype();
    if !matches!(dtype, DType::F32 | DType::F16) {
        return Err(LoraOpError::DType { tensor: "x", dtype });
    }
    for (tensor, t) in [
        (output.name, output.dtype),
        ("lora_a", slice.a.dtype()),
        ("lora_b", slice.b.dtype()),
    ] {
        if t != dtype {
            return Err(LoraOpError::DType { tensor, dtype: t });
        }
    }
    let device = x.device();
    for (tensor, other) in [
        (output.name, output.device.clone()),
        ("lora_a", slice.a.device()),
        ("lora_b", slice.b.device()),
        ("batch", batch.sorted_tokens.device()),
    ] {
        if other != device {
            return Err(LoraOpError::Device { tensor });
        }
    }
    if base_rows != rows {
        return Err(shape(output.name, &output.dims, format!("[{rows}, _]")));
    }
    if a_in != in_features {
        return Err(shape(
            "lora_a",
            &slice.a.dims(),
            format!("[slots, rank, {in_features}]"),
        ));
    }
    if rank == 0 || rank > MAX_RANK {
        return Err(LoraOpError::Rank {
            rank,
            max: MAX_RANK,
        });
    }
    if b_slots != slots || b_rank != rank {
        return Err(shape(
            "lora_b",
            &slice.b.dims(),
            format!("[{slots}, out, {rank}]"),
        ));
    }
    if slice.offset + out > out_total {
        return Err(shape(
            "lora_b",
            &slice.b.dims(),
            format!(
                "an output width of at most {} (slice offset {} in {out_total} columns)",
                out_total.saturating_sub(slice.offset),
                slice.offset
            ),
        ));
    }
    if meta.num_tokens() != rows {
        return Err(LoraOpError::TokenCountMismatch {
            mapping: meta.num_tokens(),
            rows,
        });
    }
    if let Some(&slot) = meta.active_slots().last()
        && slot >= slots as i32
    {
        return Err(LoraOpError::SlotOutOfRange { slot, slots });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::meta::NO_SLOT;
    use crate::runtime::device;
    use burn::tensor::Distribution;

    fn zeros<const D: usize>(shape: [usize; D]) -> Tensor<D> {
        Tensor::zeros(shape, &device::cpu().device)
    }

    fn slice(slots: usize, rank: usize, in_f: usize, out: usize, offset: usize) -> LoraSlice {
        LoraSlice {
            a: zeros([slots, rank, in_f]),
            b: zeros([slots, out, rank]),
            offset,
        }
    }

    fn batch(token_slots: Vec<i32>, slots: usize) -> LoraBatch {
        batch_on(token_slots, slots, &device::cpu())
    }

    fn batch_on(token_slots: Vec<i32>, slots: usize, on: &RuntimeDevice) -> LoraBatch {
        LoraBatch::new(
            KernelMeta::from_token_slots(token_slots, slots).unwrap(),
            on,
        )
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let x = zeros([3, 8]);
        let base = zeros([3, 12]);
        let meta = batch(vec![0, NO_SLOT, 1], 2);
        let run = |x: &Tensor<2>, base: &Tensor<2>, s: LoraSlice, b: &LoraBatch| {
            lora_apply(x.clone(), base.clone(), &[s], b).unwrap_err()
        };

        // x and A disagree on in_features.
        assert!(matches!(
            run(&x, &base, slice(2, 4, 9, 12, 0), &meta),
            LoraOpError::Shape {
                tensor: "lora_a",
                ..
            }
        ));
        // base has another row count.
        assert!(matches!(
            run(&x, &zeros([4, 12]), slice(2, 4, 8, 12, 0), &meta),
            LoraOpError::Shape { tensor: "base", .. }
        ));
        // B's rank differs from A's.
        let mut bad_b = slice(2, 4, 8, 12, 0);
        bad_b.b = zeros([2, 12, 5]);
        assert!(matches!(
            run(&x, &base, bad_b, &meta),
            LoraOpError::Shape {
                tensor: "lora_b",
                ..
            }
        ));
        // The slice runs past the output.
        assert!(matches!(
            run(&x, &base, slice(2, 4, 8, 8, 6), &meta),
            LoraOpError::Shape {
                tensor: "lora_b",
                ..
            }
        ));
        // Rank above the maximum.
        assert_eq!(
            run(&x, &base, slice(2, MAX_RANK + 1, 8, 12, 0), &meta),
            LoraOpError::Rank {
                rank: MAX_RANK + 1,
                max: MAX_RANK
            }
        );
        // The mapping uses slot 1 but the weights hold one slot.
        assert_eq!(
            run(&x, &base, slice(1, 4, 8, 12, 0), &meta),
            LoraOpError::SlotOutOfRange { slot: 1, slots: 1 }
        );
        // The mapping covers 2 rows, the input has 3.
        assert_eq!(
            run(&x, &base, slice(2, 4, 8, 12, 0), &batch(vec![0, 1], 2)),
            LoraOpError::TokenCountMismatch {
                mapping: 2,
                rows: 3
            }
        );
        // Not f32.
        let half = LoraSlice {
            a: zeros([2, 4, 8]).cast(DType::F16),
            ..slice(2, 4, 8, 12, 0)
        };
        assert!(matches!(
            run(&x, &base, half, &meta),
            LoraOpError::DType {
                tensor: "lora_a",
                ..
            }
        ));
        // The metadata uploaded to another device (a GPU, where there is one).
        if let Some(gpu) = device::gpu_for_tests() {
            assert_eq!(
                run(
                    &x,
                    &base,
                    slice(2, 4, 8, 12, 0),
                    &batch_on(vec![0, NO_SLOT, 1], 2, &gpu)
                ),
                LoraOpError::Device { tensor: "batch" }
            );
        }
    }

    #[test]
    fn auto_shrink_times_on_hardware_gpus_and_takes_the_register_kernel_on_software_ones() {
        let cpu = device::cpu();
        assert_eq!(ShrinkKernel::Auto.resolve(&cpu), ShrinkKernel::Split);
        assert_eq!(ShrinkKernel::Timed.resolve(&cpu), ShrinkKernel::Split);
        assert_eq!(
            ShrinkKernel::Registers.resolve(&cpu),
            ShrinkKernel::Registers
        );
        if let Some(gpu) = device::gpu_for_tests() {
            let split_and_wide_checked = choice::CANDIDATES.iter().all(|k| k.hardware_checked());
            let expected = match gpu.hardware_gpu && split_and_wide_checked {
                true => ShrinkKernel::Timed,
                false => ShrinkKernel::Registers,
            };
            assert_eq!(batch_on(vec![0, 1], 2, &gpu).shrink(), expected);
            for chosen in [ShrinkKernel::Split, ShrinkKernel::Timed] {
                let batch = LoraBatch::with_shrink(
                    KernelMeta::from_token_slots(vec![0], 1).unwrap(),
                    &gpu,
                    chosen,
                );
                assert_eq!(batch.shrink(), chosen);
            }
        }
    }

    /// On a hardware GPU `auto` takes only LoRA shaders checked on one: today the `registers`
    /// shrink and the scalar expand (`split`, `wide` and the `vec4` expand changed since the
    /// last hardware run); a shrink chosen by name opts in to the rest. Seen through a GPU
    /// marked as hardware, since CI has none.
    #[test]
    fn auto_on_a_hardware_gpu_takes_only_hardware_checked_shaders() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let hardware = RuntimeDevice {
            hardware_gpu: true,
            ..gpu.clone()
        };
        assert!(ShrinkKernel::Registers.hardware_checked());
        assert!(
            !ShrinkKernel::Split.hardware_checked(),
            "update this test with CHECKED"
        );
        assert!(!wgsl::LoraShader::ExpandVec4.hardware_checked());
        let meta = || KernelMeta::from_token_slots(vec![0, 1], 2).unwrap();
        let auto = LoraBatch::new(meta(), &hardware);
        assert_eq!(auto.shrink(), ShrinkKernel::Registers);
        assert!(!auto.plan.expand_vec4);
        let chosen = LoraBatch::with_shrink(meta(), &hardware, ShrinkKernel::Split);
        assert_eq!(chosen.shrink(), ShrinkKernel::Split);
        assert!(chosen.plan.expand_vec4);
        assert!(LoraBatch::new(meta(), &gpu).plan.expand_vec4 || gpu.hardware_gpu);
    }

    /// The op on rows permuted, with the batch permuted alike, is the op's output permuted:
    /// each row keeps its adapter. On the CPU and on wgpu.
    #[test]
    fn a_permuted_batch_keeps_each_rows_adapter() {
        let problem = testing::Problem {
            in_features: 64,
            slices: vec![(96, 4), (32, 8)],
            slots: 3,
            token_slots: (0..40).map(|r| [0, 2, NO_SLOT, 1][r % 4]).collect(),
        };
        let order: Vec<usize> = (0..40).map(|r| (r * 7 + 3) % 40).collect();
        let indices = |on: &RuntimeDevice| {
            let values: Vec<i32> = order.iter().map(|&r| r as i32).collect();
            Tensor::<1, Int>::from_data(TensorData::new(values, [40]), &on.device)
        };
        let devices = [Some(device::cpu()), device::gpu_for_tests()];
        for on in devices.into_iter().flatten() {
            let data = problem.data(&device::cpu()).to_device(&on);
            let batch = problem.batch(&on);
            let permuted = batch.permuted(&order).unwrap();
            let x = data.x.clone().select(0, indices(&on));
            let base = data.base.clone().select(0, indices(&on));
            let got = lora_apply(x, base, &data.slices, &permuted).unwrap();
            let want = lora_apply(data.x, data.base, &data.slices, &batch)
                .unwrap()
                .select(0, indices(&on));
            // Tolerance: none; each row's own sums, in the same order.
            got.into_data().assert_eq(&want.into_data(), true);
        }
    }

    #[test]
    fn rows_without_adapter_skip_the_op() {
        let cpu = device::cpu();
        let x = Tensor::<2>::random([5, 8], Distribution::Default, &cpu.device);
        let base = Tensor::<2>::random([5, 4], Distribution::Default, &cpu.device);
        let s = LoraSlice {
            a: Tensor::ones([1, 2, 8], &cpu.device),
            b: Tensor::ones([1, 4, 2], &cpu.device),
            offset: 0,
        };
        let y = lora_apply(x, base.clone(), &[s], &batch(vec![NO_SLOT; 5], 1)).unwrap();
        y.into_data().assert_eq(&base.into_data(), true);
    }
}
