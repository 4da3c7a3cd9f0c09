//! Rotary as one WGSL kernel on the wgpu backend: [`RopeBackend::rotate_packed`] for
//! [`CubeBackend`].
//!
//! Composed ([`super::packed_composed`]), rotating `q` or `k` of the tower's packed `qkv` is a
//! copy of the part, a cast to f32, two slices, a negation, a concatenation, two products, a
//! sum and a cast back. `shaders/rotary/rotary.wgsl` reads the part where it lies in `qkv` and
//! writes the rotated values once, in one launch per 65 535 rows.

use burn::backend::wgpu::{CubeBackend, CubeTensor};
use burn::tensor::DType;
use burn_cubecl::cubecl::ir::attributes::BufferIOAttr;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;

use super::RopeBackend;
use crate::runtime::wgsl::{self, Elem, ElemShader};

/// `shaders/rotary/rotary.wgsl`, in [`WORKGROUP`]s.
pub(crate) const SHADER: ElemShader = ElemShader {
    file_name: "rotary.wgsl",
    template: include_str!("../../../shaders/rotary/rotary.wgsl"),
    workgroup: WORKGROUP,
};

/// Invocations per workgroup: one (head, pair of values) each.
pub const WORKGROUP: u32 = 64;

impl RopeBackend for CubeBackend {
    /// `shaders/rotary/rotary.wgsl` for f32 and f16 `qkv` with f32 angles of one row each
    /// (`[rows, 1, head_dim]`, which the kernel indexes unchecked); the composed form, which
    /// broadcasts, for anything else.
    fn rotate_packed(qkv: CubeTensor, cos: CubeTensor, sin: CubeTensor, part: usize) -> CubeTensor {
        let shape = qkv.meta.shape();
        let [rows, parts, heads, head_dim] = [shape[0], shape[1], shape[2], shape[3]];
        let elem = match qkv.dtype {
            DType::F32 => Elem::F32,
            DType::F16 => Elem::F16,
            _ => return super::packed_composed::<Self>(qkv, cos, sin, part),
        };
        let pairs = heads * (head_dim / 2);
        let pair_blocks = u32::try_from(pairs.div_ceil(WORKGROUP as usize)).unwrap_or(u32::MAX);
        let table = [rows, 1, head_dim];
        let tables_fit = [&cos, &sin]
            .iter()
            .all(|t| t.dtype == DType::F32 && t.meta.shape().as_slice() == table);
        if !tables_fit || pair_blocks > wgsl::MAX_WORKGROUPS_PER_DIM {
            return super::packed_composed::<Self>(qkv, cos, sin, part);
        }
        assert!(
            head_dim.is_multiple_of(2) && part < parts,
            "rotary takes an even head width and one of the packed parts"
        );
        let (qkv, cos, sin) = (
            into_contiguous(qkv),
            into_contiguous(cos),
            into_contiguous(sin),
        );
        let out = empty_device_contiguous_dtype(
            qkv.client.clone(),
            qkv.device.clone(),
            [rows, heads, head_dim].into(),
            qkv.dtype,
        );
        if pairs == 0 {
            return out;
        }
        let rows = u32::try_from(rows).expect("rows fit a u32");
        let read = BufferIOAttr::ReadOnly;
        // Rows beyond one dispatch's limit go in further launches.
        for (first_row, count) in wgsl::launches(rows) {
            wgsl::launch(
                SHADER.kernel(elem),
                WORKGROUP,
                (pair_blocks, count),
                &[
                    (&qkv, read),
                    (&cos, read),
                    (&sin, read),
                    (&out, BufferIOAttr::WriteOnly),
                ],
                &[
                    heads as u32,
                    head_dim as u32,
                    parts as u32,
                    part as u32,
                    first_row,
                ],
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::check_elem_shader;

    /// The shader in both element types is valid WGSL that naga translates for every backend
    /// wgpu has, and it is the only file in `shaders/rotary/`.
    #[test]
    fn shader_validates_and_translates_to_every_backend() {
        check_elem_shader("rotary", SHADER);
    }
}
