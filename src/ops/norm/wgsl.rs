//! Layer norm as one WGSL kernel on the wgpu backend: [`NormBackend::layer_norm_f32`] for
//! [`CubeBackend`].
//!
//! Composed ([`super::composed`]), a norm of the tower is a cast, two mean reductions and the
//! elementwise passes around them. `shaders/norm/layer_norm.wgsl` reads each row about once and
//! writes it once, in one launch per 65 535 rows.

use burn::backend::wgpu::{CubeBackend, CubeTensor};
use burn::tensor::DType;
use burn_cubecl::cubecl::ir::attributes::BufferIOAttr;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;

use super::NormBackend;
use crate::runtime::wgsl::{self, Elem, ElemShader};

/// `shaders/norm/layer_norm.wgsl`, in [`WORKGROUP`]s.
pub(crate) const SHADER: ElemShader = ElemShader {
    file_name: "layer_norm.wgsl",
    template: include_str!("../../../shaders/norm/layer_norm.wgsl"),
    workgroup: WORKGROUP,
};

/// Invocations per workgroup, all on one row: for the 2B tower's 1280 values, five `vec4`s
/// each.
pub const WORKGROUP: u32 = 64;

impl NormBackend for CubeBackend {
    /// `shaders/norm/layer_norm.wgsl` for f32 and f16 rows whose width is a multiple of 4, with f32
    /// weight and bias of that width; the composed form for anything else.
    fn layer_norm_f32(
        x: CubeTensor,
        weight: CubeTensor,
        bias: CubeTensor,
        epsilon: f64,
    ) -> CubeTensor {
        let shape = x.meta.shape().clone();
        let elem = match x.dtype {
            DType::F32 => Elem::F32,
            DType::F16 => Elem::F16,
            _ => return super::composed::<Self>(x, weight, bias, epsilon),
        };
        let [rows, width] = match shape.as_slice() {
            &[rows, width] => [rows, width],
            _ => return super::composed::<Self>(x, weight, bias, epsilon),
        };
        let affine_fits = [&weight, &bias]
            .iter()
            .all(|t| t.dtype == DType::F32 && t.meta.shape().as_slice() == [width]);
        if width == 0 || !width.is_multiple_of(4) || !affine_fits {
            return super::composed::<Self>(x, weight, bias, epsilon);
        }
        let (x, weight, bias) = (
            into_contiguous(x),
            into_contiguous(weight),
            into_contiguous(bias),
        );
        let y = empty_device_contiguous_dtype(
            x.client.clone(),
            x.device.clone(),
            [rows, width].into(),
            x.dtype,
        );
        let rows = u32::try_from(rows).expect("rows fit a u32");
        let read = BufferIOAttr::ReadOnly;
        // Rows beyond one dispatch's limit go in further launches.
        for (first_row, count) in wgsl::launches(rows) {
            wgsl::launch(
                SHADER.kernel(elem),
                WORKGROUP,
                (count, 1),
                &[
                    (&x, read),
                    (&weight, read),
                    (&bias, read),
                    (&y, BufferIOAttr::WriteOnly),
                ],
                &[wgsl::param(width), first_row, (epsilon as f32).to_bits()],
            );
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::VisionTower;
    use crate::models::qwen2_vl::Qwen2VlVision;
    use crate::models::qwen2_vl::VisionConfig;
    use crate::ops::kernels::Kernels;
    use crate::ops::lora::LoraBatch;
    use crate::ops::norm::NormKernel;
    use crate::ops::norm::tests::check;
    use crate::ops::testing::check_elem_shader;
    use crate::routing::meta::{KernelMeta, NO_SLOT};
    use crate::runtime::device;
    use burn::tensor::{Distribution, Tensor};

    /// Against float64 in f32 and, where the device has it, f16: the 2B tower's width, a
    /// width below one `vec4` per thread, one that leaves threads idle, and one the kernel does
    /// not take (composed).
    #[test]
    fn the_kernel_matches_float64() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let f16 = device::f16_for_tests(&gpu);
        for (rows, width) in [(37, 1280), (3, 8), (2, 300), (4, 6)] {
            check(&gpu, NormKernel::Fused, rows, width, DType::F32);
            if f16 {
                check(&gpu, NormKernel::Fused, rows, width, DType::F16);
            }
        }
    }

    /// The tiny tower on the GPU with each norm implementation: they agree to f32 rounding,
    /// and not bit for bit, so the model ran the kernel it was given.
    #[test]
    fn the_tower_runs_the_kernel_it_is_given() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let mut model = Qwen2VlVision::random(VisionConfig::tiny(), &gpu.device);
        let grids = [[1, 8, 8], [1, 4, 4]];
        let rows: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
        let x = Tensor::<2>::random([rows, 1176], Distribution::Default, &gpu.device);
        let none = |n| {
            LoraBatch::new(
                KernelMeta::from_token_slots(vec![NO_SLOT; n], 1).unwrap(),
                &gpu,
            )
        };
        let mut run = |kernel| {
            model.set_kernels(Kernels {
                norm: kernel,
                ..model.kernels()
            });
            let out = model
                .forward(x.clone(), &grids, &none(rows), &none(rows / 4))
                .unwrap();
            out.tower.into_data().try_to_vec::<f32>().unwrap()
        };
        let (fused, composed) = (run(NormKernel::Fused), run(NormKernel::Composed));
        assert_ne!(fused, composed, "the norm kernel never ran");
        // Tolerance: rel. Frobenius 1e-5, f32 sums in another order through the tiny tower.
        let squared = |v: &[f32]| v.iter().map(|&a| f64::from(a).powi(2)).sum::<f64>();
        let difference: Vec<f32> = fused.iter().zip(&composed).map(|(a, b)| a - b).collect();
        let rel = (squared(&difference) / squared(&composed)).sqrt();
        assert!(rel <= 1e-5, "rel. Frobenius {rel:e}");
    }

    /// More rows than one dispatch takes run in several launches, each from its own first row.
    #[test]
    fn rows_beyond_one_dispatch_run_in_several_launches() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        check(
            &gpu,
            NormKernel::Fused,
            wgsl::MAX_WORKGROUPS_PER_DIM as usize + 3,
            4,
            DType::F32,
        );
    }

    /// The shader in both element types is valid WGSL that naga translates for every backend
    /// wgpu has, and it is the only file in `shaders/norm/`.
    #[test]
    fn shader_validates_and_translates_to_every_backend() {
        check_elem_shader("norm", SHADER);
    }
}
