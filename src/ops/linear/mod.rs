//! The linear layers' base product, `x · Wᵀ + b`, as a backend extension.
//!
//! [`linear`] computes it with the backend's own products (`LinearBackend::linear_native`: on
//! the GPU Burn's matmul and add, `composed`, the reference), or with one of our WGSL kernels
//! (`LinearShader`), as [`LinearKernel`] says (which one a layer takes, fixed or timed per
//! shape, is `choice.rs`'s):
//! - `shaders/linear/linear.wgsl` is built for lavapipe (llvmpipe), where every load from a
//!   storage buffer is a loop over the SIMD lanes: each thread keeps `ROWS` rows × `COLUMNS`
//!   `vec4` columns of sums in registers, so a weight load feeds `ROWS · 4` multiply-adds.
//! - `shaders/linear/linear_tiled.wgsl` is built for hardware GPUs: 128 × 128 blocks staged
//!   through workgroup memory, 8 × 8 sums per thread, the next slice's loads in flight during
//!   this slice's products.
//! - `shaders/linear/linear_coop.wgsl` is built for GPUs with cooperative matrices (tensor cores:
//!   wgpu's experimental `EXPERIMENTAL_COOPERATIVE_MATRIX`, Vulkan's `VK_KHR_cooperative_matrix`),
//!   in f16: 128 × 128 blocks staged through workgroup memory, each subgroup multiplying 16 × 16
//!   f16 matrices into 16 × 16 matrices of f32 sums, in one of two `CoopTiling`s (`coop`:
//!   8 subgroups of 32 × 64 values; `coop-wide`: 4 subgroups of 64 × 64 values).
//! - `shaders/linear/linear_coop_direct.wgsl` (`coop-direct`) is `coop-wide` with its matrices
//!   loaded straight from the buffers: no workgroup memory and no barrier in its k loop.
//!
//! Only devices that offer cooperative matrices run the last two (`coop_subgroup`); lavapipe
//! does not, so CI runs their staging, indexing and stores with the cooperative operations
//! emulated.
//!
//! All but `linear.wgsl` also come with a LoRA epilogue (`shaders/linear/linear_lora.wgsl`,
//! pasted in where they say `lora`): they add each row's adapter delta to the row's sums as they
//! store it, the LoRA op fused into the product (the LoRA op's `linear_lora` launches them
//! through `launch_linear` after its shrink).
//!
//! On Flex (the CPU backend) the product with a bias is one `gemm` call that adds onto rows of
//! the bias, whichever kernel is asked for.
//!
//! The files: `shader` (which kernels exist and where they run), `source` (their WGSL, filled
//! in), `flex` and `wgsl` (the extension on each backend), `choice` (the per-shape timed
//! choice).

mod choice;
mod flex;
mod shader;
mod source;
#[cfg(test)]
mod tests;
mod wgsl;

pub use choice::LinearChoice;
pub(crate) use choice::reference as timed_reference;
pub(crate) use shader::*;
pub(crate) use wgsl::{LoraEpilogue, cube_source, launch_linear};

use burn::backend::TensorMetadata;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Shape, Tensor};
use std::sync::LazyLock;

use crate::named::named_choice;
use crate::runtime::device::{DeviceClass, RuntimeDevice};
use crate::runtime::wgsl::Elem;

named_choice! {
    /// Which kernel computes a linear layer's base product on a wgpu device.
    #[derive(Default, Hash)]
    pub enum LinearKernel {
        /// `wgsl` on a software rasterizer (lavapipe), where it is measured faster; `timed` on a
        /// hardware GPU; `burn` on the CPU.
        #[default]
        Auto,
        /// The fastest for each shape of the device's candidates (`burn` and `tiled` on a hardware
        /// GPU, and the `coop` kernels in f16 where they run; `wgsl` and `burn` on a software one),
        /// timed on the device the first time a product of that shape runs, each output checked
        /// against Burn's product in f32 first (`choice.rs`).
        Timed,
        /// Burn's matmul, then the bias added.
        Burn,
        /// `shaders/linear/linear.wgsl` (sums in registers, for software rasterizers), where every
        /// width is a multiple of 4 (else Burn's).
        Wgsl,
        /// `shaders/linear/linear_tiled.wgsl` (blocks in workgroup memory, for hardware GPUs),
        /// where every width is a multiple of 4 and the device's workgroups take its 256
        /// invocations (else Burn's).
        Tiled,
        /// `shaders/linear/linear_coop.wgsl` (cooperative matrices: tensor cores) for f16 tensors,
        /// where every width is a multiple of 4 and the device's subgroups and workgroups fit the
        /// kernel (else Burn's). Only for a device that offers cooperative matrices (`mmlora
        /// devices` says): the engine refuses it elsewhere.
        Coop,
        /// `shaders/linear/linear_coop.wgsl` as `Coop`, in `CoopTiling::Wide`: four subgroups of
        /// 32 per workgroup, each summing a 64 × 64 cell, so that it loads half a matrix from
        /// workgroup memory per product, against three quarters in `Coop`'s 32 × 64 cells at
        /// subgroups of 32. Only for a device with cooperative matrices and subgroups of 32 alone.
        CoopWide,
        /// `shaders/linear/linear_coop_direct.wgsl`, in `CoopTiling::Direct`: `CoopWide`'s cells,
        /// each matrix loaded straight from `x` and `Wᵀ` rather than staged through workgroup
        /// memory, where `in` is a multiple of 16 and there are at least 16 rows and 16 output
        /// columns (else Burn's). Only for a device with cooperative matrices and subgroups of 32
        /// alone.
        CoopDirect,
    }
}

/// Linear layers' products with a faster implementation than Burn's on some backend.
#[backend_extension(Cube, Flex, Fusion)]
pub(crate) trait LinearBackend: Backend {
    /// `x · weight_t + bias` for `x`: `[rows, in]`, `weight_t`: `[in, out]`, `bias`: `[out]`,
    /// all of one dtype, every width a multiple of 4 and `in` not 0: computed by `shader` on
    /// the wgpu backend, by [`LinearBackend::linear_native`] elsewhere.
    #[fusion(dtype = x, shape = Shape::from([x[0], weight_t[1]]))]
    fn linear_wgsl(
        x: FloatTensor<Self>,
        weight_t: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        _shader: LinearShader,
    ) -> FloatTensor<Self> {
        Self::linear_native(x, weight_t, bias)
    }

    /// `x · weight_t + bias` (shapes as in [`LinearBackend::linear_wgsl`], any widths) with the
    /// backend's own products: Burn's matmul and add, or on Flex one `gemm` call that adds the
    /// product onto rows of the bias.
    #[fusion(default)]
    fn linear_native(
        x: FloatTensor<Self>,
        weight_t: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        composed::<Self>(x, weight_t, bias)
    }

    /// `x` laid out row by row: a copy where it is a strided view, such as a transpose.
    #[fusion(dtype = x, shape = x)]
    fn materialize(x: FloatTensor<Self>) -> FloatTensor<Self> {
        x
    }
}

/// `x` laid out row by row on the wgpu backend (our kernel reads nothing else); unchanged on
/// Flex, whose matmul reads strides.
pub fn materialize(x: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as LinearBackend>::materialize(x.into_dispatch()))
}

/// `x · weight_t + bias` from Burn's matmul and add, on any backend.
pub(crate) fn composed<B: Backend>(
    x: FloatTensor<B>,
    weight_t: FloatTensor<B>,
    bias: FloatTensor<B>,
) -> FloatTensor<B> {
    let out = bias.shape()[0];
    let bias = B::float_reshape(bias, Shape::from([1, out]));
    B::float_add(B::float_matmul(x, weight_t), bias)
}

impl LinearKernel {
    /// The kernels worth comparing on `device` for tensors of `dtype`, the ones `timed` times
    /// (each list holds Burn's, the reference the others are checked against): on a software
    /// GPU ours for it and Burn's; on a hardware GPU Burn's and our tiled one, and in f16 each
    /// of our cooperative-matrix ones the device runs; on the CPU Burn's (Flex's matmul).
    /// With `hardware_checked`, what `auto` takes on a hardware GPU: of ours only those whose
    /// shaders passed their tests on one ([`LinearShader::hardware_checked`]).
    ///
    /// A hardware GPU whose workgroups take fewer invocations than the tiled kernel's
    /// [`TILED_WORKGROUP`] (OpenGL ES 3.1 promises 128) times none of ours: Burn's alone (such
    /// a device with cooperative matrices, which `coop-wide`'s 128 invocations would fit, is
    /// not known).
    pub(crate) fn candidates(
        device: &RuntimeDevice,
        dtype: DType,
        hardware_checked: bool,
    ) -> &'static [LinearKernel] {
        use LinearKernel::{Burn, Tiled, Wgsl};
        /// `[Burn, Tiled]` and the coop kernels of each set (bit `i`: [`LinearKernel::COOP`]`[i]`),
        /// all of them or only the hardware-checked ones.
        static WITH_COOP: LazyLock<[[Vec<LinearKernel>; 1 << LinearKernel::COOP.len()]; 2]> =
            LazyLock::new(|| {
                [false, true].map(|checked_only| {
                    std::array::from_fn(|set| {
                        let coop = (0..LinearKernel::COOP.len())
                            .filter(|i| set & (1 << i) != 0)
                            .map(|i| LinearKernel::COOP[i]);
                        [Burn, Tiled]
                            .into_iter()
                            .chain(coop)
                            .filter(|k| !checked_only || k.hardware_checked())
                            .collect()
                    })
                })
            });
        let tiled = || {
            let setup = device
                .wgpu
                .as_ref()
                .expect("a GPU device has its wgpu setup");
            LinearShader::Tiled.runs_on(Capacity::of_wgpu(setup))
        };
        match device.class() {
            DeviceClass::Cpu => &[Burn],
            DeviceClass::SoftwareGpu => &[Wgsl, Burn],
            DeviceClass::HardwareGpu if !tiled() => &[Burn],
            DeviceClass::HardwareGpu => {
                let runs = |kernel: LinearKernel| {
                    dtype == DType::F16 && kernel.coop_subgroup(device).is_some()
                };
                let set = (0..LinearKernel::COOP.len())
                    .filter(|&i| runs(LinearKernel::COOP[i]))
                    .fold(0, |set, i| set | 1 << i);
                &WITH_COOP[usize::from(hardware_checked)][set]
            }
        }
    }

    /// Whether `self` may run on a hardware GPU under `auto`: Burn's, or ours where its shader
    /// passed its tests on one ([`LinearShader::hardware_checked`]).
    pub(crate) fn hardware_checked(self) -> bool {
        self.shader().is_none_or(LinearShader::hardware_checked)
    }

    /// The kernel `self` picks on `device`: never `Auto` (`Timed` stays a choice to make per
    /// shape, [`LinearChoice`]).
    pub fn resolve(self, device: &RuntimeDevice) -> Self {
        match (self, device.class()) {
            (LinearKernel::Auto, DeviceClass::Cpu) => LinearKernel::Burn,
            (LinearKernel::Auto, DeviceClass::SoftwareGpu) => LinearKernel::Wgsl,
            (LinearKernel::Auto, DeviceClass::HardwareGpu) => LinearKernel::Timed,
            (chosen, _) => chosen,
        }
    }

    /// The cooperative-matrix kernels, one per tiling.
    pub const COOP: [LinearKernel; 3] = [
        LinearKernel::Coop,
        LinearKernel::CoopWide,
        LinearKernel::CoopDirect,
    ];

    /// The tiling of a cooperative-matrix kernel (`coop`, `coop-wide`, `coop-direct`); `None`
    /// for the others.
    pub(crate) fn coop_tiling(self) -> Option<CoopTiling> {
        self.shader().and_then(LinearShader::coop_tiling)
    }

    /// `coop_subgroup` of a cooperative-matrix kernel's tiling on `device`: the subgroup size
    /// it runs at there; `None` where it cannot run, and for the other kernels.
    pub fn coop_subgroup(self, device: &RuntimeDevice) -> Option<u32> {
        coop_subgroup(device, self.coop_tiling()?)
    }

    /// Our shader behind `self`, if it is one of ours.
    pub(crate) fn shader(self) -> Option<LinearShader> {
        match self {
            LinearKernel::Wgsl => Some(LinearShader::Registers),
            LinearKernel::Tiled => Some(LinearShader::Tiled),
            LinearKernel::Coop => Some(LinearShader::Coop(CoopTiling::Narrow)),
            LinearKernel::CoopWide => Some(LinearShader::Coop(CoopTiling::Wide)),
            LinearKernel::CoopDirect => Some(LinearShader::Coop(CoopTiling::Direct)),
            LinearKernel::Auto | LinearKernel::Timed | LinearKernel::Burn => None,
        }
    }
}

/// `x · weight_t (+ bias)`: with our kernel where `kernel` names one, there is a bias, the
/// kernel takes the tensors (`kernel_elem`: one dtype, f32 or f16, f16 for `Coop`; every
/// width a multiple of 4, `in` not 0) and `x` is on a wgpu device whose limits the kernel fits
/// (on Flex the extension is Burn's matmul and add); with Burn's matmul otherwise (`Auto` and
/// `Timed` included: [`LinearChoice`] picks for those).
///
/// `Coop` needs a device where `coop_subgroup` is `Some`: the limits Burn's client reports
/// show the subgroup size and workgroup memory but not the cooperative-matrix feature, so
/// elsewhere the shader fails to compile rather than falling back (the engine refuses `coop`
/// on such a device when it opens).
pub fn linear(
    x: Tensor<2>,
    weight_t: &Tensor<2>,
    bias: Option<&Tensor<1>>,
    kernel: LinearKernel,
) -> Tensor<2> {
    let ours = kernel
        .shader()
        .filter(|&shader| bias.is_some_and(|bias| takes(shader, &x, weight_t, bias)));
    match (bias, ours) {
        (Some(bias), Some(shader)) => {
            Tensor::from_dispatch(<Dispatch as LinearBackend>::linear_wgsl(
                x.into_dispatch(),
                weight_t.clone().into_dispatch(),
                bias.clone().into_dispatch(),
                shader,
            ))
        }
        (Some(bias), None) => Tensor::from_dispatch(<Dispatch as LinearBackend>::linear_native(
            x.into_dispatch(),
            weight_t.clone().into_dispatch(),
            bias.clone().into_dispatch(),
        )),
        (None, _) => x.matmul(weight_t.clone()),
    }
}

/// Whether `shader` takes the product `x · weight_t + bias`: one dtype, f32 or f16 (f16 alone
/// for the cooperative-matrix kernels), every width a multiple of 4, `in` not 0, and the shapes
/// its tiling takes.
pub(crate) fn takes(
    shader: LinearShader,
    x: &Tensor<2>,
    weight_t: &Tensor<2>,
    bias: &Tensor<1>,
) -> bool {
    kernel_elem(
        shader,
        (x.dtype(), x.dims()),
        (weight_t.dtype(), weight_t.dims()),
        (bias.dtype(), bias.dims()[0]),
    )
    .is_some()
}

/// The element type `shader` reads a product's tensors as, where it takes them: `x` (dtype,
/// `[rows, in]`), `weight_t` (`[in, out]`) and `bias` (`[out]`) of one dtype, f32 or f16 (f16
/// alone for the cooperative-matrix kernels), every width a multiple of 4 and `in` not 0 (and
/// the shapes [`CoopTiling::Direct`] takes, for it). `None` where it does not: the kernels bind
/// each buffer as that one type, unchecked.
fn kernel_elem(
    shader: LinearShader,
    x: (DType, [usize; 2]),
    weight_t: (DType, [usize; 2]),
    bias: (DType, usize),
) -> Option<Elem> {
    let (dtype, [rows, in_features]) = x;
    let (_, [weight_in, out_features]) = weight_t;
    let elem = match dtype {
        DType::F32 => Elem::F32,
        DType::F16 => Elem::F16,
        _ => return None,
    };
    let widths = in_features > 0
        && in_features.is_multiple_of(4)
        && out_features.is_multiple_of(4)
        && weight_in == in_features
        && bias.1 == out_features;
    let shape = shader
        .coop_tiling()
        .is_none_or(|tiling| tiling.takes_shape(rows, in_features, out_features));
    (widths && shape && weight_t.0 == dtype && bias.0 == dtype && shader.takes(elem))
        .then_some(elem)
}
