//! The linears' product on the wgpu backend: Burn's matmul and add, or one of our kernels
//! launched through the runtime's one WGSL path, with or without the LoRA epilogue.

use burn::backend::tensor::FloatTensor;
use burn::backend::wgpu::{CubeBackend, CubeTensor};
use burn_cubecl::cubecl::ir::attributes::BufferIOAttr;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;

use super::shader::{Capacity, LinearShader};
use super::source::LinearSource;
use super::{LinearBackend, kernel_elem};
use crate::runtime::wgsl;

impl LinearBackend for CubeBackend {
    fn materialize(x: FloatTensor<Self>) -> FloatTensor<Self> {
        into_contiguous(x)
    }

    fn linear_wgsl(
        x: FloatTensor<Self>,
        weight_t: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        shader: LinearShader,
    ) -> FloatTensor<Self> {
        // What the shader cannot take or the device cannot run is Burn's product: nothing
        // here panics or binds a buffer as another type.
        match cube_source(shader, &x, &weight_t, &bias, false) {
            Some(kernel) => launch_linear(kernel, x, weight_t, bias, None),
            None => Self::linear_native(x, weight_t, bias),
        }
    }
}

/// `shader` for the tensors of a product on the wgpu backend, with the LoRA epilogue where
/// `lora` says (`shaders/linear/linear_lora.wgsl`): `None` where the shader does not take them
/// ([`kernel_elem`]) or the device (as the tensors' cubecl client reports it) cannot run it.
pub(crate) fn cube_source(
    shader: LinearShader,
    x: &CubeTensor,
    weight_t: &CubeTensor,
    bias: &CubeTensor,
    lora: bool,
) -> Option<LinearSource> {
    let elem = kernel_elem(
        shader,
        (x.dtype, [x.meta.shape()[0], x.meta.shape()[1]]),
        (
            weight_t.dtype,
            [weight_t.meta.shape()[0], weight_t.meta.shape()[1]],
        ),
        (bias.dtype, bias.meta.shape()[0]),
    )?;
    let hardware = &x.client.properties().hardware;
    let capacity = Capacity {
        invocations: hardware.max_units_per_cube,
        workgroup_bytes: u32::try_from(hardware.max_shared_memory_size).unwrap_or(u32::MAX),
        subgroups: [hardware.plane_size_min, hardware.plane_size_max],
    };
    let source = LinearSource::new(shader, elem, capacity.subgroups[1])?;
    (shader.runs_on(capacity) && (!lora || shader.has_lora_epilogue()))
        .then_some(LinearSource { lora, ..source })
}

/// What the LoRA epilogue of a linear kernel reads (`shaders/linear/linear_lora.wgsl`): the
/// shrink's f32 output `[rows, rank]`, the adapters' `B` `[slots, out, rank]` in the product's
/// dtype and each row's slot `[rows]` (−1: none); `rank` a multiple of 4.
pub(crate) struct LoraEpilogue<'a> {
    /// `x · A[slot]ᵀ` of each adapter row.
    pub shrunk: &'a CubeTensor,
    /// The stacked `B`, the scale folded in.
    pub lora_b: &'a CubeTensor,
    /// Each row's slot.
    pub row_slots: &'a CubeTensor,
    /// The adapters' rank (the stack's, zero-padded).
    pub rank: usize,
}

/// Runs `kernel` ([`cube_source`]) on `x · weight_t + bias`, adding each row's LoRA delta as it
/// stores the row where `lora` is given (and `kernel` was made for it).
pub(crate) fn launch_linear(
    kernel: LinearSource,
    x: CubeTensor,
    weight_t: CubeTensor,
    bias: CubeTensor,
    lora: Option<LoraEpilogue>,
) -> CubeTensor {
    assert_eq!(
        kernel.lora,
        lora.is_some(),
        "the epilogue the kernel was made for"
    );
    let [rows, in_features] = [x.meta.shape()[0], x.meta.shape()[1]];
    let out_features = weight_t.meta.shape()[1];
    let x = into_contiguous(x);
    let weight_t = into_contiguous(weight_t);
    let bias = into_contiguous(bias);
    let y = empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        [rows, out_features].into(),
        x.dtype,
    );
    if rows == 0 || out_features == 0 {
        return y;
    }
    let shader = kernel.shader;
    let (block_rows, block_columns4) = shader.block();
    let column_blocks = (wgsl::param(out_features) / 4).div_ceil(block_columns4);
    let row_blocks = wgsl::param(rows).div_ceil(block_rows);
    let read = BufferIOAttr::ReadOnly;
    let mut buffers = vec![
        (&x, read),
        (&weight_t, read),
        (&bias, read),
        (&y, BufferIOAttr::WriteOnly),
    ];
    let rank = match &lora {
        Some(lora) => {
            buffers.extend([
                (lora.shrunk, read),
                (lora.lora_b, read),
                (lora.row_slots, read),
            ]);
            wgsl::param(lora.rank)
        }
        None => 0,
    };
    // Row blocks beyond one dispatch's limit go in further launches, each on its own rows.
    for (first_block, blocks) in wgsl::launches(row_blocks) {
        wgsl::launch(
            kernel,
            shader.workgroup(),
            (column_blocks, blocks),
            &buffers,
            &[
                wgsl::param(rows),
                wgsl::param(in_features),
                wgsl::param(out_features),
                first_block * block_rows,
                rank,
            ],
        );
    }
    y
}
