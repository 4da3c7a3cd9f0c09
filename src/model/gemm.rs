//! The linear layers' base product, `x · Wᵀ + b`, as a backend extension.
//!
//! [`linear`] computes it with the backend's own products ([`LinearBackend::linear_native`]: on
//! the GPU Burn's matmul and add, [`composed`]), or with one of our four WGSL kernels
//! ([`LinearShader`]), as [`LinearKernel`] says (which one a layer takes, fixed or timed per
//! shape, is [`crate::model::linear_choice`]'s):
//! - `shaders/linear.wgsl` is built for lavapipe (llvmpipe), where every load from a storage
//!   buffer is a loop over the SIMD lanes and Burn's matmul reaches about 6 GMAC/s. Each thread
//!   keeps [`ROWS`] rows × [`COLUMNS`] `vec4` columns of sums in registers, so a weight load
//!   feeds `ROWS · 4` multiply-adds; it runs the 2B tower's linears 1.5–1.8× faster there
//!   (BENCHMARKS.md).
//! - `shaders/linear_tiled.wgsl` is built for hardware GPUs: 128 × 128 blocks staged through
//!   workgroup memory, 8 × 8 sums per thread, the next slice's loads in flight during this
//!   slice's products. On the H200 it is 1.24–1.43× as fast as Burn's matmul per shape in f32
//!   (BENCHMARKS.md).
//! - `shaders/linear_coop.wgsl` is built for GPUs with cooperative matrices (tensor cores:
//!   wgpu's experimental `EXPERIMENTAL_COOPERATIVE_MATRIX`, Vulkan's `VK_KHR_cooperative_matrix`),
//!   in f16: 128 × 128 blocks staged through workgroup memory, each subgroup multiplying 16 × 16
//!   f16 matrices into 16 × 16 matrices of f32 sums, in one of two [`CoopTiling`]s (`coop`:
//!   8 subgroups of 32 × 64 values on the H200, where it is 1.39–7.8× as fast as Burn's f16
//!   matmul per shape; `coop-wide`: 4 subgroups of 64 × 64 values, not yet timed on a device).
//! - `shaders/linear_coop_direct.wgsl` (`coop-direct`) is `coop-wide` with its matrices loaded
//!   straight from the buffers: no workgroup memory and no barrier in its k loop; not yet timed
//!   on a device.
//!
//! Only devices that offer cooperative matrices run the last two ([`coop_subgroup`]); lavapipe
//! does not, so CI runs their staging, indexing and stores with the cooperative operations
//! emulated.
//!
//! All but `linear.wgsl` also come with a LoRA epilogue (`shaders/linear_lora.wgsl`, pasted in
//! where they say `lora`): they add each row's adapter delta to the row's sums as they store it,
//! the LoRA op fused into the product ([`crate::lora::ops::linear_lora`], which launches them
//! through `launch_linear` after the shrink).
//!
//! On Flex (the CPU backend) the product with a bias is one `gemm` call that adds onto rows of
//! the bias, whichever kernel is asked for.

use burn::backend::TensorMetadata;
use burn::backend::tensor::FloatTensor;
use burn::backend::wgpu::{CubeBackend, CubeTensor, KernelSource, SourceTemplate};
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::wgpu::WgpuSetup;
use burn::tensor::{DType, Shape, Tensor, TensorData};
use burn_cubecl::cubecl::ir::attributes::BufferIOAttr;
use burn_cubecl::cubecl::prelude::KernelId;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_flex::FlexTensor;
use rayon::prelude::*;
use std::sync::LazyLock;

use crate::device::RuntimeDevice;
use crate::lora::ops::native::{dense, element, gemm_parallelism, strided, values};
use crate::wgsl::{self, Elem};

/// Invocations per workgroup of `linear.wgsl` (`{{ workgroup }}`). 32 makes a workgroup's
/// block 256 columns, which divides every width of Qwen2-VL-2B's linears, and was faster than
/// 16 or 64 on lavapipe.
pub const WORKGROUP: u32 = 32;

/// Rows each workgroup of `linear.wgsl` computes (`{{ rows }}`): the multiply-adds per weight
/// load, over 4.
pub const ROWS: u32 = 64;

/// `vec4` columns each thread of `linear.wgsl` computes (`{{ columns }}`).
pub const COLUMNS: u32 = 2;

/// Invocations per workgroup of `linear_tiled.wgsl`: a 16 × 16 grid.
pub const TILED_WORKGROUP: u32 = 256;

/// Rows of a `linear_tiled.wgsl` block: 16 threads × 4 rows, twice.
pub const TILED_ROWS: u32 = 128;

/// `vec4` columns of a `linear_tiled.wgsl` block: 16 threads × 1, twice.
pub const TILED_COLUMNS4: u32 = 32;

/// Columns of `x` (rows of `Wᵀ`) a `linear_tiled.wgsl` block stages at a time; one `vec4` of
/// each per thread, so `TILED_ROWS · TILED_DEPTH / 4 = TILED_DEPTH · TILED_COLUMNS4 =
/// TILED_WORKGROUP`.
pub const TILED_DEPTH: u32 = 8;

/// Invocations per workgroup of `linear_coop.wgsl` in [`CoopTiling::Narrow`]: as many subgroups
/// as the device's subgroup size divides it into, one cell of the block each.
pub const COOP_WORKGROUP: u32 = 256;

/// Invocations per workgroup of the cooperative-matrix kernels in [`CoopTiling::Wide`] and
/// [`CoopTiling::Direct`]: four subgroups of 32, one 64 × 64 cell of the block each.
pub const COOP_WIDE_WORKGROUP: u32 = 128;

/// Rows of a cooperative-matrix kernel's block.
pub const COOP_ROWS: u32 = 128;

/// Columns of a cooperative-matrix kernel's block.
pub const COOP_COLUMNS: u32 = 128;

/// Columns of `x` (rows of `Wᵀ`) a `linear_coop.wgsl` block stages at a time: two steps of one
/// 16-wide matrix.
pub const COOP_DEPTH: u32 = 32;

/// The file under `shaders/` that both coop kernels' sources paste in where they say
/// `store_staged` (`coop_template`): their end, checked as part of each.
pub const COOP_STORE_FILE_NAME: &str = "linear_coop_store.wgsl";

/// The side of one cooperative matrix of the coop kernels (16 × 16 × 16 products).
const MATRIX: u32 = 16;

/// The LoRA epilogue our linear kernels for hardware GPUs paste in (`{{ lora }}`) where they add
/// each row's adapter delta as they store it ([`LinearShader::has_lora_epilogue`]).
pub const LORA_FILE_NAME: &str = "linear_lora.wgsl";

/// Values each row of `linear_coop.wgsl`'s slices in workgroup memory is padded by: 16 bytes of
/// f16, which keeps a matrix's rows off one bank and every cooperative load 16-byte aligned.
const COOP_PAD: u32 = 8;

// `{{ loads }}` serves both slices, which are equally large, and every thread loads as many
// `vec4`s of each, in either tiling; the slices' padded rows are whole `vec4`s.
const _: () = assert!(
    COOP_PAD.is_multiple_of(4)
        && COOP_ROWS == COOP_COLUMNS
        && (COOP_ROWS * COOP_DEPTH / 4).is_multiple_of(COOP_WORKGROUP)
        && (COOP_ROWS * COOP_DEPTH / 4).is_multiple_of(COOP_WIDE_WORKGROUP)
);

/// Which kernel computes a linear layer's base product on a wgpu device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum LinearKernel {
    /// `wgsl` on a software rasterizer (lavapipe), where it is measured faster; `timed` on a
    /// hardware GPU; `burn` on the CPU.
    #[default]
    Auto,
    /// The fastest for each shape of the device's candidates (`burn` and `tiled` on a hardware
    /// GPU, and the `coop` kernels in f16 where they run; `wgsl` and `burn` on a software one),
    /// timed on the device the first time a product of that shape runs, each output checked
    /// against Burn's product in f32 first (the `linear_choice` module).
    Timed,
    /// Burn's matmul, then the bias added.
    Burn,
    /// `shaders/linear.wgsl` (sums in registers, for software rasterizers), where every width
    /// is a multiple of 4 (else Burn's).
    Wgsl,
    /// `shaders/linear_tiled.wgsl` (blocks in workgroup memory, for hardware GPUs), where every
    /// width is a multiple of 4 and the device's workgroups take its 256 invocations (else
    /// Burn's).
    Tiled,
    /// `shaders/linear_coop.wgsl` (cooperative matrices: tensor cores) for f16 tensors, where
    /// every width is a multiple of 4 and the device's subgroups and workgroups fit the kernel
    /// (else Burn's). Only for a device that offers cooperative matrices (`mmlora devices`
    /// says): the engine refuses it elsewhere.
    Coop,
    /// `shaders/linear_coop.wgsl` as `Coop`, in [`CoopTiling::Wide`]: four subgroups of 32 per
    /// workgroup, each summing a 64 × 64 cell, so that it loads half a matrix from workgroup
    /// memory per product, against three quarters in `Coop`'s 32 × 64 cells at subgroups of 32.
    /// Only for a device with cooperative matrices and subgroups of 32 alone.
    CoopWide,
    /// `shaders/linear_coop_direct.wgsl`, in [`CoopTiling::Direct`]: `CoopWide`'s cells, each
    /// matrix loaded straight from `x` and `Wᵀ` rather than staged through workgroup memory,
    /// where `in` is a multiple of 16 and there are at least 16 rows and 16 output columns
    /// (else Burn's). Only for a device with cooperative matrices and subgroups of 32 alone.
    CoopDirect,
}

/// Our WGSL kernels for the linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinearShader {
    /// `shaders/linear.wgsl`.
    Registers,
    /// `shaders/linear_tiled.wgsl`.
    Tiled,
    /// `shaders/linear_coop.wgsl` (or `linear_coop_direct.wgsl` in [`CoopTiling::Direct`]),
    /// its block cut among subgroups as the tiling says.
    Coop(CoopTiling),
    /// [`LinearShader::Coop`] at subgroups of 32, each cooperative operation replaced by its
    /// definition in plain WGSL: the kernel's staging, indexing and stores, checked on devices
    /// without cooperative matrices.
    #[cfg(test)]
    CoopEmulated(CoopTiling),
}

/// How a cooperative-matrix kernel cuts its 128 × 128 block among the subgroups of a workgroup,
/// and where it loads its matrices from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CoopTiling {
    /// [`COOP_WORKGROUP`] invocations: 16, 8 or 4 subgroups of 16, 32 or 64, each a cell of at
    /// most 4 × 4 matrices (8 of 32: 32 × 64 values).
    Narrow,
    /// [`COOP_WIDE_WORKGROUP`] invocations: 4 subgroups of 32, each a cell of 4 × 4 matrices
    /// (64 × 64 values).
    Wide,
    /// `Wide`'s cells, the matrices loaded from the buffers (`linear_coop_direct.wgsl`) rather
    /// than from slices staged in workgroup memory.
    Direct,
}

impl CoopTiling {
    /// Every tiling.
    pub const ALL: [CoopTiling; 3] = [CoopTiling::Narrow, CoopTiling::Wide, CoopTiling::Direct];

    /// Invocations per workgroup.
    fn workgroup(self) -> u32 {
        match self {
            CoopTiling::Narrow => COOP_WORKGROUP,
            CoopTiling::Wide | CoopTiling::Direct => COOP_WIDE_WORKGROUP,
        }
    }

    /// The tiling's shader file under `shaders/`.
    fn file_name(self) -> &'static str {
        match self {
            CoopTiling::Narrow | CoopTiling::Wide => "linear_coop.wgsl",
            CoopTiling::Direct => "linear_coop_direct.wgsl",
        }
    }

    /// Whether a product of `rows × in_features → out_features` (widths multiples of 4) is one
    /// the tiling's kernel computes: `Direct` loads whole 16 × 16 matrices from the buffers, so
    /// it needs `in` a multiple of 16 and at least 16 rows and 16 output columns.
    fn takes_shape(self, rows: usize, in_features: usize, out_features: usize) -> bool {
        match self {
            CoopTiling::Narrow | CoopTiling::Wide => true,
            CoopTiling::Direct => {
                let side = MATRIX as usize;
                in_features.is_multiple_of(side) && rows >= side && out_features >= side
            }
        }
    }
}

/// Linear layers' products with a faster implementation than Burn's on some backend.
#[backend_extension(Cube, Flex, Fusion)]
pub trait LinearBackend: Backend {
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
pub fn composed<B: Backend>(
    x: FloatTensor<B>,
    weight_t: FloatTensor<B>,
    bias: FloatTensor<B>,
) -> FloatTensor<B> {
    let out = bias.shape()[0];
    let bias = B::float_reshape(bias, Shape::from([1, out]));
    B::float_add(B::float_matmul(x, weight_t), bias)
}

impl LinearKernel {
    /// The name the command line and the bench records use.
    pub fn name(self) -> &'static str {
        match self {
            LinearKernel::Auto => "auto",
            LinearKernel::Timed => "timed",
            LinearKernel::Burn => "burn",
            LinearKernel::Wgsl => "wgsl",
            LinearKernel::Tiled => "tiled",
            LinearKernel::Coop => "coop",
            LinearKernel::CoopWide => "coop-wide",
            LinearKernel::CoopDirect => "coop-direct",
        }
    }

    /// The kernels worth comparing on `device` for tensors of `dtype`, the ones `timed` times
    /// (each list holds Burn's, the reference the others are checked against): on a software
    /// GPU ours for it and Burn's; on a hardware GPU Burn's and our tiled one, and in f16 each
    /// of our cooperative-matrix ones the device runs; on the CPU Burn's (Flex's matmul).
    ///
    /// A hardware GPU whose workgroups take fewer invocations than the tiled kernel's
    /// [`TILED_WORKGROUP`] (OpenGL ES 3.1 promises 128) times none of ours: Burn's alone (such
    /// a device with cooperative matrices, which `coop-wide`'s 128 invocations would fit, is
    /// not known).
    pub fn candidates(device: &RuntimeDevice, dtype: DType) -> &'static [LinearKernel] {
        use LinearKernel::{Burn, Tiled, Wgsl};
        /// `[Burn, Tiled]` and the coop kernels of each set (bit `i`: [`LinearKernel::COOP`]`[i]`).
        static WITH_COOP: LazyLock<[Vec<LinearKernel>; 1 << LinearKernel::COOP.len()]> =
            LazyLock::new(|| {
                std::array::from_fn(|set| {
                    let coop = (0..LinearKernel::COOP.len())
                        .filter(|i| set & (1 << i) != 0)
                        .map(|i| LinearKernel::COOP[i]);
                    [Burn, Tiled].into_iter().chain(coop).collect()
                })
            });
        let Some(setup) = device.wgpu.as_ref() else {
            return &[Burn];
        };
        let tiled = LinearShader::Tiled.runs_on(Capacity::of_wgpu(setup));
        match (device.hardware_gpu, tiled) {
            (false, _) => &[Wgsl, Burn],
            (true, false) => &[Burn],
            (true, true) => {
                let runs = |kernel: LinearKernel| {
                    dtype == DType::F16 && kernel.coop_subgroup(device).is_some()
                };
                let set = (0..LinearKernel::COOP.len())
                    .filter(|&i| runs(LinearKernel::COOP[i]))
                    .fold(0, |set, i| set | 1 << i);
                &WITH_COOP[set]
            }
        }
    }

    /// The kernel `self` picks on `device`: never `Auto` (`Timed` stays a choice to make per
    /// shape, [`crate::model::linear_choice::LinearChoice`]).
    pub fn resolve(self, device: &RuntimeDevice) -> Self {
        match (self, device.wgpu.is_some(), device.hardware_gpu) {
            (LinearKernel::Auto, false, _) => LinearKernel::Burn,
            (LinearKernel::Auto, true, false) => LinearKernel::Wgsl,
            (LinearKernel::Auto, true, true) => LinearKernel::Timed,
            (chosen, _, _) => chosen,
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
    pub fn coop_tiling(self) -> Option<CoopTiling> {
        self.shader().and_then(LinearShader::coop_tiling)
    }

    /// [`coop_subgroup`] of a cooperative-matrix kernel's tiling on `device`: the subgroup size
    /// it runs at there; `None` where it cannot run, and for the other kernels.
    pub fn coop_subgroup(self, device: &RuntimeDevice) -> Option<u32> {
        coop_subgroup(device, self.coop_tiling()?)
    }

    /// Our shader behind `self`, if it is one of ours.
    pub fn shader(self) -> Option<LinearShader> {
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
/// `Timed` included: [`crate::model::linear_choice::LinearChoice`] picks for those).
///
/// `Coop` needs a device where [`coop_subgroup`] is `Some`: the limits Burn's client reports
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
pub fn takes(shader: LinearShader, x: &Tensor<2>, weight_t: &Tensor<2>, bias: &Tensor<1>) -> bool {
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

/// What of a device decides which of our shaders it runs: its limits on one workgroup and its
/// subgroup sizes, read from wgpu ([`Capacity::of_wgpu`]) or from a tensor's cubecl client
/// (which reads them from wgpu too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Capacity {
    /// Invocations one workgroup may have.
    invocations: u32,
    /// Bytes of workgroup memory one workgroup may declare.
    workgroup_bytes: u32,
    /// The smallest and the largest subgroup size.
    subgroups: [u32; 2],
}

impl Capacity {
    /// The capacity of a wgpu device.
    fn of_wgpu(setup: &WgpuSetup) -> Self {
        let limits = setup.device.limits();
        let info = setup.adapter.get_info();
        Capacity {
            invocations: limits.max_compute_invocations_per_workgroup,
            workgroup_bytes: limits.max_compute_workgroup_storage_size,
            subgroups: [info.subgroup_min_size, info.subgroup_max_size],
        }
    }
}

impl LinearShader {
    /// Every kernel, for tests that check them all.
    pub const ALL: [LinearShader; 5] = [
        LinearShader::Registers,
        LinearShader::Tiled,
        LinearShader::Coop(CoopTiling::Narrow),
        LinearShader::Coop(CoopTiling::Wide),
        LinearShader::Coop(CoopTiling::Direct),
    ];

    /// The shader's file name under `shaders/`.
    pub fn file_name(self) -> &'static str {
        match self {
            LinearShader::Registers => "linear.wgsl",
            LinearShader::Tiled => "linear_tiled.wgsl",
            LinearShader::Coop(tiling) => tiling.file_name(),
            #[cfg(test)]
            LinearShader::CoopEmulated(tiling) => tiling.file_name(),
        }
    }

    /// Invocations per workgroup.
    fn workgroup(self) -> u32 {
        match self {
            LinearShader::Registers => WORKGROUP,
            LinearShader::Tiled => TILED_WORKGROUP,
            LinearShader::Coop(tiling) => tiling.workgroup(),
            #[cfg(test)]
            LinearShader::CoopEmulated(tiling) => tiling.workgroup(),
        }
    }

    /// The block one workgroup computes: rows, `vec4` columns.
    fn block(self) -> (u32, u32) {
        match self {
            LinearShader::Registers => (ROWS, WORKGROUP * COLUMNS),
            LinearShader::Tiled => (TILED_ROWS, TILED_COLUMNS4),
            LinearShader::Coop(_) => (COOP_ROWS, COOP_COLUMNS / 4),
            #[cfg(test)]
            LinearShader::CoopEmulated(_) => (COOP_ROWS, COOP_COLUMNS / 4),
        }
    }

    /// The WGSL source for `elem` on a device whose subgroups have `subgroup` invocations
    /// (read by `Coop` alone), with the LoRA epilogue where `lora` says; `None` where the
    /// shader is not written for them (`Coop`: f16 alone, at the subgroup sizes its tiling lays
    /// out).
    pub fn render(self, elem: Elem, subgroup: u32, lora: bool) -> Option<String> {
        LinearSource::new(self, elem, subgroup)
            .filter(|_| !lora || self.has_lora_epilogue())
            .map(|source| LinearSource { lora, ..source }.source().complete())
    }

    /// Whether the shader can add each row's LoRA delta as it stores its product
    /// (`shaders/linear_lora.wgsl`; `lora::ops::linear_lora`): all but `linear.wgsl`. Its
    /// epilogue would load each row's `B` anew for every `vec4` it stores, and on llvmpipe,
    /// which it is built for, each load is a loop over the SIMD lanes: fused there, the op
    /// added 12.8 % to the 2B `attn.qkv` at 256 rows, against 2.1 % apart (BENCHMARKS.md).
    pub fn has_lora_epilogue(self) -> bool {
        !matches!(self, LinearShader::Registers)
    }

    /// The tiling of a cooperative-matrix shader (emulated or not); `None` for the others.
    fn coop_tiling(self) -> Option<CoopTiling> {
        match self {
            LinearShader::Coop(tiling) => Some(tiling),
            #[cfg(test)]
            LinearShader::CoopEmulated(tiling) => Some(tiling),
            LinearShader::Registers | LinearShader::Tiled => None,
        }
    }

    /// Whether the shader is written for tensors of `elem` (the cooperative-matrix ones: f16
    /// alone).
    fn takes(self, elem: Elem) -> bool {
        match self {
            LinearShader::Registers | LinearShader::Tiled => true,
            LinearShader::Coop(_) => elem == Elem::F16,
            #[cfg(test)]
            LinearShader::CoopEmulated(_) => elem == Elem::F16,
        }
    }

    /// Whether a device of `capacity` runs the shader: its workgroups take the shader's
    /// invocations and, for `Coop`, the device has one subgroup size that [`CoopLayout`] lays
    /// out in the kernel's tiling and workgroup memory for that layout.
    fn runs_on(self, capacity: Capacity) -> bool {
        let layout_fits = |tiling, subgroup| {
            CoopLayout::new(tiling, subgroup)
                .is_some_and(|layout| layout.workgroup_bytes() <= capacity.workgroup_bytes)
        };
        let [subgroup_min, subgroup_max] = capacity.subgroups;
        self.workgroup() <= capacity.invocations
            && match self {
                LinearShader::Registers | LinearShader::Tiled => true,
                LinearShader::Coop(tiling) => {
                    subgroup_min == subgroup_max && layout_fits(tiling, subgroup_max)
                }
                #[cfg(test)]
                LinearShader::CoopEmulated(tiling) => layout_fits(tiling, tests::EMULATED_SUBGROUP),
            }
    }
}

/// How a coop kernel cuts its block among the subgroups of a workgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CoopLayout {
    /// The tiling laid out.
    tiling: CoopTiling,
    /// Invocations per workgroup.
    workgroup: u32,
    /// Subgroups per workgroup: one cell of the block each.
    subgroups: u32,
    /// Cells across the block (the rest go down it).
    subgroup_columns: u32,
}

impl CoopLayout {
    /// The layout of `tiling` for subgroups of `subgroup` invocations (`None` for sizes it does
    /// not lay out): in `Narrow`, 4, 8 or 16 subgroups of 64, 32 or 16, each cell at most 4 × 4
    /// matrices; in `Wide` and `Direct`, 4 subgroups of 32, each cell 4 × 4 matrices.
    fn new(tiling: CoopTiling, subgroup: u32) -> Option<Self> {
        let workgroup = tiling.workgroup();
        let subgroups = match (tiling, subgroup) {
            (CoopTiling::Narrow, 16 | 32 | 64) | (CoopTiling::Wide | CoopTiling::Direct, 32) => {
                workgroup / subgroup
            }
            _ => return None,
        };
        let subgroup_columns = if subgroups == 16 { 4 } else { 2 };
        Some(CoopLayout {
            tiling,
            workgroup,
            subgroups,
            subgroup_columns,
        })
    }

    /// A cell's matrices down and across.
    fn matrices(self) -> (u32, u32) {
        let subgroup_rows = self.subgroups / self.subgroup_columns;
        (
            COOP_ROWS / subgroup_rows / MATRIX,
            COOP_COLUMNS / self.subgroup_columns / MATRIX,
        )
    }

    /// Bytes of workgroup memory the kernel declares: one 16 × 16 f32 staging matrix per
    /// subgroup and, but in `Direct`, the two padded f16 slices.
    fn workgroup_bytes(self) -> u32 {
        let staged = self.subgroups * MATRIX * MATRIX * 4;
        let x_tile = COOP_ROWS * (COOP_DEPTH + COOP_PAD) * 2;
        let w_tile = COOP_DEPTH * (COOP_COLUMNS + COOP_PAD) * 2;
        match self.tiling {
            CoopTiling::Narrow | CoopTiling::Wide => x_tile + w_tile + staged,
            CoopTiling::Direct => staged,
        }
    }
}

/// The subgroup size the coop kernel runs at in `tiling` on `device`, where it can run there:
/// a wgpu device with cooperative matrices, subgroups and f16, whose adapter offers 16 × 16 × 16
/// products of f16 matrices summed in f32 without saturating (naga never asks for it), and
/// whose workgroups and subgroups the kernel fits (`LinearShader::runs_on`).
pub fn coop_subgroup(device: &RuntimeDevice, tiling: CoopTiling) -> Option<u32> {
    let setup = device.wgpu.as_ref()?;
    let needed = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        | wgpu::Features::SUBGROUP
        | wgpu::Features::SHADER_F16;
    let f16_in_f32 = setup
        .adapter
        .cooperative_matrix_properties()
        .iter()
        .any(|p| {
            [p.m_size, p.n_size, p.k_size] == [MATRIX; 3]
                && p.ab_type == wgpu::CooperativeScalarType::F16
                && p.cr_type == wgpu::CooperativeScalarType::F32
                && !p.saturating_accumulation
        });
    let capacity = Capacity::of_wgpu(setup);
    let runs = LinearShader::Coop(tiling).runs_on(capacity);
    (setup.device.features().contains(needed) && f16_in_f32 && runs)
        .then_some(capacity.subgroups[1])
}

/// Whether `gpu` runs `shader` (its workgroups, subgroups and workgroup memory, as wgpu reports
/// them), for a test that must not pass on Burn's product in its place.
#[cfg(test)]
pub(crate) fn runs_for_tests(shader: LinearShader, gpu: &RuntimeDevice) -> bool {
    let capacity = gpu.wgpu.as_ref().map(Capacity::of_wgpu);
    capacity.is_some_and(|capacity| shader.runs_on(capacity))
}

/// [`coop_subgroup`] for a test on `gpu`: where it is `None`, says so on stderr (the caller
/// skips its coop checks), or, under `MMLORA_EXPECT_COOP=1` (the H200 check), fails the test.
#[cfg(test)]
pub(crate) fn coop_for_tests(gpu: &RuntimeDevice, tiling: CoopTiling) -> Option<u32> {
    let subgroup = coop_subgroup(gpu, tiling);
    if subgroup.is_none() {
        assert!(
            std::env::var("MMLORA_EXPECT_COOP").as_deref() != Ok("1"),
            "MMLORA_EXPECT_COOP=1, but {} cannot run the coop kernel in {tiling:?} (`mmlora \
             devices` says why)",
            gpu.description
        );
        eprintln!(
            "{}: no cooperative matrices in {tiling:?}, coop checks not run",
            gpu.description
        );
    }
    subgroup
}

impl LinearBackend for Flex {
    /// f32: the output starts as rows of `bias` and `gemm` adds `x · weight_t` to it as it
    /// stores its blocks, which saves the separate add's pass over the output (the 2B tower's
    /// linears 1.01–1.07× faster: BENCHMARKS.md); other dtypes composed.
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
/// `lora` says (`shaders/linear_lora.wgsl`): `None` where the shader does not take them
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

/// What the LoRA epilogue of a linear kernel reads (`shaders/linear_lora.wgsl`): the shrink's
/// f32 output `[rows, rank]`, the adapters' `B` `[slots, out, rank]` in the product's dtype and
/// each row's slot `[rows]` (−1: none); `rank` a multiple of 4.
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

/// One of our linear shaders for one element type and subgroup size (read by `Coop` alone),
/// with or without the LoRA epilogue, made by [`LinearSource::new`] (which leaves it out) alone.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinearSource {
    shader: LinearShader,
    elem: Elem,
    subgroup: u32,
    /// Whether `shaders/linear_lora.wgsl` is pasted in: each row's LoRA delta added as it is
    /// stored.
    lora: bool,
}

impl LinearSource {
    /// `shader` for `elem` at subgroups of `subgroup`, where it is written for them
    /// ([`LinearShader::render`]).
    fn new(shader: LinearShader, elem: Elem, subgroup: u32) -> Option<Self> {
        let laid_out = match shader {
            LinearShader::Coop(tiling) => CoopLayout::new(tiling, subgroup).is_some(),
            _ => true,
        };
        (laid_out && shader.takes(elem)).then_some(LinearSource {
            shader,
            elem,
            subgroup,
            lora: false,
        })
    }
}

impl KernelSource for LinearSource {
    fn source(&self) -> SourceTemplate {
        // The trailing uniform follows the buffers: four, and three more for the epilogue.
        let (lora, params_binding) = match self.lora {
            true => (include_str!("../../shaders/linear_lora.wgsl"), 7),
            false => (NO_LORA, 4),
        };
        let shared = |template: SourceTemplate| {
            template
                .register("lora", lora)
                .register("params_binding", params_binding.to_string())
                .register("elem", self.elem.wgsl())
                .register("enable", self.elem.enable())
        };
        match self.shader {
            LinearShader::Registers => {
                let [setup, load_weights, accumulate, store] = unrolled();
                shared(SourceTemplate::new(include_str!(
                    "../../shaders/linear.wgsl"
                )))
                .register("workgroup", WORKGROUP.to_string())
                .register("rows", ROWS.to_string())
                .register("columns", COLUMNS.to_string())
                .register("setup", setup)
                .register("load_weights", load_weights)
                .register("accumulate", accumulate)
                .register("store", store)
            }
            LinearShader::Tiled => shared(SourceTemplate::new(include_str!(
                "../../shaders/linear_tiled.wgsl"
            )))
            .register("workgroup", TILED_WORKGROUP.to_string())
            .register("tile_rows", TILED_ROWS.to_string())
            .register("tile_columns4", TILED_COLUMNS4.to_string())
            .register("depth", TILED_DEPTH.to_string()),
            LinearShader::Coop(tiling) => shared(coop_template(tiling, self.subgroup)),
            // Emulated in the complete source: every placeholder filled first.
            #[cfg(test)]
            LinearShader::CoopEmulated(tiling) => SourceTemplate::new(tests::emulated_coop(
                shared(coop_template(tiling, tests::EMULATED_SUBGROUP)).complete(),
                tiling,
            )),
        }
    }

    fn id(&self) -> KernelId {
        wgsl::kernel_id::<Self>((self.shader, self.elem, self.subgroup, self.lora))
    }

    fn lang(&self) -> &'static str {
        "wgsl"
    }
}

/// What a linear kernel without the LoRA epilogue has where it says `lora`: deltas of zero, and
/// the coop store storing one row per thread.
const NO_LORA: &str = "const LORA_STORE_ROWS: u32 = 1u;

fn lora_deltas(row: u32, column4: u32, out4: u32) -> mat4x4<f32> {
    return mat4x4<f32>();
}";

/// The statements `shaders/linear.wgsl` repeats for each of the [`ROWS`] rows and [`COLUMNS`]
/// columns, written out with a variable each: `{{ setup }}`, `{{ load_weights }}`,
/// `{{ accumulate }}` and `{{ store }}`.
fn unrolled() -> [String; 4] {
    let columns = |line: &dyn Fn(u32) -> String| (0..COLUMNS).map(line).collect::<Vec<_>>();
    let rows = |line: &dyn Fn(u32) -> String| (0..ROWS).map(line).collect::<Vec<_>>();
    let cells = |line: &dyn Fn(u32, u32) -> String| {
        (0..ROWS)
            .flat_map(|r| (0..COLUMNS).map(move |c| line(r, c)))
            .collect::<Vec<_>>()
    };
    let block = |indent: &str, parts: &[Vec<String>]| wgsl::statements(indent, &parts.concat());
    [
        block(
            "    ",
            &[
                columns(&|c| {
                    format!("let col_{c} = min(column(workgroup.x, lid, {c}u), out4 - 1u);")
                }),
                rows(&|r| format!("let x_{r} = min(row0 + {r}u, params.rows - 1u) * in4;")),
                cells(&|r, c| format!("var sum_{r}_{c} = vec4<f32>();")),
            ],
        ),
        block(
            "        ",
            &[columns(&|c| {
                format!("let w_{c} = weights(4u * k4 * out4 + col_{c}, out4);")
            })],
        ),
        block(
            "        ",
            &[rows(&|r| {
                let adds: String = (0..COLUMNS)
                    .map(|c| format!(" sum_{r}_{c} += w_{c} * v;"))
                    .collect();
                format!("{{ let v = vec4<f32>(x[x_{r} + k4]);{adds} }}")
            })],
        ),
        block(
            "    ",
            &[
                columns(&|c| format!("let b_{c} = vec4<f32>(bias[col_{c}]);")),
                cells(&|r, c| {
                    format!(
                        "if (row0 + {r}u < params.rows && column(workgroup.x, lid, {c}u) < out4) \
                         {{ y[(row0 + {r}u) * out4 + col_{c}] = vec4<ELEM>(sum_{r}_{c} + b_{c}); }}"
                    )
                }),
            ],
        ),
    ]
}

/// The coop kernel of `tiling` (`shaders/linear_coop.wgsl`, or `linear_coop_direct.wgsl` in
/// `Direct`) with everything but its element type filled in, for subgroups of `subgroup`
/// invocations, a size [`CoopLayout`] lays out in it ([`LinearSource::new`] made sure).
fn coop_template(tiling: CoopTiling, subgroup: u32) -> SourceTemplate {
    let layout = CoopLayout::new(tiling, subgroup)
        .expect("LinearSource::new takes coop only at a subgroup size CoopLayout lays out");
    let [declare, multiply, store] = coop_unrolled(layout);
    let template = match tiling {
        CoopTiling::Narrow | CoopTiling::Wide => include_str!("../../shaders/linear_coop.wgsl"),
        CoopTiling::Direct => include_str!("../../shaders/linear_coop_direct.wgsl"),
    };
    SourceTemplate::new(template)
        .register(
            "store_staged",
            include_str!("../../shaders/linear_coop_store.wgsl"),
        )
        .register("workgroup", layout.workgroup.to_string())
        .register("subgroups", layout.subgroups.to_string())
        .register("subgroup_columns", layout.subgroup_columns.to_string())
        .register("tile_rows", COOP_ROWS.to_string())
        .register("tile_columns", COOP_COLUMNS.to_string())
        .register("depth", COOP_DEPTH.to_string())
        .register("pad", COOP_PAD.to_string())
        .register(
            "loads",
            (COOP_ROWS * COOP_DEPTH / 4 / layout.workgroup).to_string(),
        )
        .register("declare", declare)
        .register("multiply", multiply)
        .register("store", store)
}

/// The statements a coop kernel repeats for each matrix of a subgroup's cell, written out with a
/// variable each: `{{ declare }}` (the sums, and in `Direct` where each row and column of
/// matrices starts), `{{ multiply }}` (one 16-wide step of k: at column `k` of the staged slice,
/// or at `vec4` column `k4` of `x` and row `4 · k4` of `Wᵀ` in `Direct`) and `{{ store }}`
/// (staged, then written with the bias). Every index and stride is a `let` of its own.
fn coop_unrolled(layout: CoopLayout) -> [String; 3] {
    let (down, across) = layout.matrices();
    let direct = layout.tiling == CoopTiling::Direct;
    let cells: Vec<(u32, u32)> = (0..down)
        .flat_map(|i| (0..across).map(move |j| (i, j)))
        .collect();
    let sums = cells
        .iter()
        .map(|(i, j)| format!("var sums_{i}_{j} = coop_mat16x16<f32, C>();"));
    let origins = (0..down)
        .map(|i| {
            format!(
                "let a_row_{i} = matrix_row(row0 + cell_row + {}u);",
                MATRIX * i
            )
        })
        .chain((0..across).map(|j| {
            format!(
                "let b_column4_{j} = matrix_column4(column0_4 + (cell_column + {}u) / 4u, out4);",
                MATRIX * j
            )
        }));
    let declare: Vec<String> = if direct {
        origins.chain(sums).collect()
    } else {
        sums.collect()
    };
    // Where matrix `i` down (`j` across) of this step lies: its index, then the array and stride.
    let a_at = |i: u32| {
        if direct {
            (format!("a_row_{i} * in4 + k4"), "x", "in4")
        } else {
            let at = format!("(cell_row + {}u) * X_STRIDE4 + k / 4u", MATRIX * i);
            (at, "x_tile", "x_stride")
        }
    };
    let b_at = |j: u32| {
        if direct {
            (
                format!("4u * k4 * out4 + b_column4_{j}"),
                "weight_t",
                "out4",
            )
        } else {
            let at = format!("k * W_STRIDE4 + (cell_column + {}u) / 4u", MATRIX * j);
            (at, "w_tile", "w_stride")
        }
    };
    let multiply = [
        (0..down)
            .flat_map(|i| {
                let (at, array, stride) = a_at(i);
                [
                    format!("let a_at_{i} = {at};"),
                    format!(
                        "let a_{i} = coopLoadT<coop_mat16x16<f16, A>>(&{array}[a_at_{i}], {stride});"
                    ),
                ]
            })
            .collect::<Vec<_>>(),
        (0..across)
            .flat_map(|j| {
                let (at, array, stride) = b_at(j);
                [
                    format!("let b_at_{j} = {at};"),
                    format!(
                        "let b_{j} = coopLoadT<coop_mat16x16<f16, B>>(&{array}[b_at_{j}], {stride});"
                    ),
                ]
            })
            .collect(),
        cells
            .iter()
            .map(|(i, j)| format!("sums_{i}_{j} = coopMultiplyAdd(a_{i}, b_{j}, sums_{i}_{j});"))
            .collect(),
    ]
    .concat();
    let store = cells
        .iter()
        .flat_map(|(i, j)| {
            [
                format!("coopStoreT(sums_{i}_{j}, &staged[staged_at], staged_stride);"),
                "workgroupBarrier();".to_owned(),
                format!(
                    "store_staged(row0, column0_4, {}u, {}u, lid, out4);",
                    MATRIX * i,
                    MATRIX * j
                ),
                "workgroupBarrier();".to_owned(),
            ]
        })
        .collect::<Vec<_>>();
    let multiply_indent = if direct { "        " } else { "            " };
    [
        wgsl::statements("    ", &declare),
        wgsl::statements(multiply_indent, &multiply),
        wgsl::statements("    ", &store),
    ]
}

#[cfg(test)]
mod tests {
    use burn::tensor::{DType, Distribution, TensorData};

    use super::*;
    use crate::device;
    use crate::lora::ops::testing::to_f64;
    use crate::wgsl::MAX_WORKGROUPS_PER_DIM;
    use crate::wgsl::{validate_and_translate, validate_and_translate_to_spirv};

    /// `(in, out)` of Qwen2-VL-2B's linears: `qkv`, `attn.proj`, `fc1`, `fc2`, the merger's
    /// second layer.
    const QWEN2_VL_2B_LINEARS: [(usize, usize); 5] = [
        (1280, 3840),
        (1280, 1280),
        (1280, 5120),
        (5120, 1280),
        (5120, 1536),
    ];

    /// Unit roundoff of f32 and of f16.
    const U: f64 = f32::EPSILON as f64 / 2.0;
    const U16: f64 = 1.0 / 2048.0;

    /// A random linear on the CPU in `dtype`: `x` `[rows, in]`, `weight` `[out, in]`, `bias`.
    fn random(
        rows: usize,
        in_features: usize,
        out_features: usize,
        dtype: DType,
    ) -> (Tensor<2>, Tensor<2>, Tensor<1>) {
        let cpu = device::cpu().device;
        let uniform = Distribution::Uniform(-1.0, 1.0);
        (
            Tensor::<2>::random([rows, in_features], uniform, &cpu).cast(dtype),
            Tensor::<2>::random([out_features, in_features], uniform, &cpu).cast(dtype),
            Tensor::<1>::random([out_features], uniform, &cpu).cast(dtype),
        )
    }

    /// `x · weightᵀ + bias` in float64, and for each value Higham's bound on the error of an
    /// f32 sum of its `in + 1` terms, each addition off by at most `u`: γ(in + 1) · (Σ |x·w| +
    /// |b|).
    fn reference(
        x: &[f64],
        weight: &[f64],
        bias: &[f64],
        in_features: usize,
        u: f64,
    ) -> [Vec<f64>; 2] {
        let gamma = |n: usize| n as f64 * u / (1.0 - n as f64 * u);
        let mut y = Vec::new();
        let mut bound = Vec::new();
        for row in x.chunks(in_features) {
            for (w, b) in weight.chunks(in_features).zip(bias) {
                let terms = row.iter().zip(w).map(|(x, w)| x * w);
                y.push(terms.clone().sum::<f64>() + b);
                let magnitude = terms.map(f64::abs).sum::<f64>() + b.abs();
                bound.push(gamma(in_features + 1) * magnitude);
            }
        }
        [y, bound]
    }

    /// Our `kernel` on `gpu` in `dtype` against float64 (of the inputs rounded to `dtype`),
    /// within the bound of f32 sums (rounded to f16 once, in f16); in f32 Burn's is within that
    /// bound too, so the two are within twice it of each other. In f16 Burn's linear rounds
    /// twice (its matmul sums in f32 and writes f16, then the bias is added in f16), so it is
    /// checked against float64 within that wider bound.
    fn check(
        gpu: &device::RuntimeDevice,
        kernel: LinearKernel,
        rows: usize,
        in_features: usize,
        out_features: usize,
        dtype: DType,
    ) {
        check_repeated(gpu, kernel, [rows, in_features, out_features], dtype, 1);
    }

    /// [`check`] on `rows × in_features → out_features`, with our kernel run `repeats` times
    /// on the same inputs, each output checked.
    fn check_repeated(
        gpu: &device::RuntimeDevice,
        kernel: LinearKernel,
        shape: [usize; 3],
        dtype: DType,
        repeats: usize,
    ) {
        let ours = Ours {
            name: kernel.name(),
            // Tensor cores may truncate their f32 sums rather than round them.
            truncating_sums: kernel.coop_tiling().is_some(),
            run: &|x, weight_t, bias| linear(x, weight_t, Some(bias), kernel),
        };
        check_ours(gpu, &ours, shape, dtype, repeats);
    }

    /// A product of ours under test: its name, whether its f32 sums may truncate instead of
    /// round (twice the error per addition), and how it computes `x · weight_t + bias`.
    struct Ours<'a> {
        name: &'a str,
        truncating_sums: bool,
        run: &'a dyn Fn(Tensor<2>, &Tensor<2>, &Tensor<1>) -> Tensor<2>,
    }

    /// [`check`] for any product of ours, on `rows × in_features → out_features`, run
    /// `repeats` times on the same inputs (a race in the kernel shows as one run off).
    fn check_ours(
        gpu: &device::RuntimeDevice,
        ours: &Ours,
        shape: [usize; 3],
        dtype: DType,
        repeats: usize,
    ) {
        let [rows, in_features, out_features] = shape;
        let (x, weight, bias) = random(rows, in_features, out_features, dtype);
        // Products of f16 values are exact in f32 (22 bits of its 24), whatever sums them.
        let u = if ours.truncating_sums { 2.0 * U } else { U };
        let [expected, mut bound] = reference(
            &to_f64(&x.clone().cast(DType::F32)),
            &to_f64(&weight.clone().cast(DType::F32)),
            &to_f64(&bias.clone().cast(DType::F32)),
            in_features,
            u,
        );
        let sum_bound = bound.clone();
        if dtype == DType::F16 {
            // The f32 sum is rounded to f16 once at the end.
            for (bound, y) in bound.iter_mut().zip(&expected) {
                *bound = *bound * (1.0 + U16) + U16 * y.abs();
            }
        }
        let bias_values = to_f64(&bias.clone().cast(DType::F32));
        let d = &gpu.device;
        let (x, weight, bias) = (x.to_device(d), weight.to_device(d), bias.to_device(d));
        let weight_t = materialize(weight.clone().transpose());
        let burns = linear(
            x.clone(),
            &weight.transpose(),
            Some(&bias),
            LinearKernel::Burn,
        );
        let burns = to_f64(&burns.cast(DType::F32));
        for run in 1..=repeats {
            let y = (ours.run)(x.clone(), &weight_t, &bias);
            let y = to_f64(&y.cast(DType::F32));
            let at = |i: usize| {
                format!(
                    "{} {rows}×{in_features}→{out_features} {dtype:?}, run {run} of {repeats}, \
                     y[{}, {}]",
                    ours.name,
                    i / out_features,
                    i % out_features
                )
            };
            for (i, (((y, burns), expected), bound)) in
                y.iter().zip(&burns).zip(&expected).zip(&bound).enumerate()
            {
                assert!(
                    (y - expected).abs() <= *bound,
                    "{}: ours {y} vs {expected} (bound {bound:e})",
                    at(i)
                );
                if dtype == DType::F32 {
                    // Burn's f32 sum is within `bound` of float64 too.
                    assert!(
                        (y - burns).abs() <= 2.0 * bound,
                        "{}: ours {y} vs Burn's {burns} (bound {bound:e})",
                        at(i)
                    );
                } else if run == 1 {
                    // Burn's: the product `p` summed in f32 (off by `sum` at most), rounded to
                    // f16 (off by `u · (|p| + sum)`), plus the bias rounded to f16 again (off
                    // by `u` of that sum); `u` takes f32's too, for an f16 rounding done
                    // through f32.
                    let (sum, u) = (sum_bound[i], U16 + U);
                    let product = (expected - bias_values[i % out_features]).abs() + sum;
                    let burns_bound = sum + u * product * (1.0 + u) + u * (expected.abs() + sum);
                    assert!(
                        (burns - expected).abs() <= burns_bound,
                        "{}: Burn's {burns} vs {expected} (bound {burns_bound:e})",
                        at(i)
                    );
                }
            }
        }
    }

    /// Each of our kernels: row counts around its row block; widths below, at and past one
    /// workgroup's columns, and depths below, at and past one staged slice; the shapes of
    /// Qwen2-VL-2B's linears.
    #[test]
    fn ours_match_float64_and_burn() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        for kernel in [LinearKernel::Wgsl, LinearKernel::Tiled] {
            let (block_rows, block_columns4) = kernel.shader().unwrap().block();
            let (block, block_columns) = (block_rows as usize, 4 * block_columns4 as usize);
            let depth = TILED_DEPTH as usize;
            for rows in [1, block - 1, block, block + 1, 3 * block + 5] {
                for (in_features, out_features) in [
                    (4, 4),
                    (depth + 4, block_columns + 4),
                    (4 * depth + 4, 2 * block_columns),
                ] {
                    check(&gpu, kernel, rows, in_features, out_features, DType::F32);
                }
            }
            for (in_features, out_features) in QWEN2_VL_2B_LINEARS {
                check(
                    &gpu,
                    kernel,
                    block + 3,
                    in_features,
                    out_features,
                    DType::F32,
                );
            }
            if device::f16_for_tests(&gpu) {
                for (rows, in_features, out_features) in [(block + 3, 1280, 3840), (5, 36, 516)] {
                    check(&gpu, kernel, rows, in_features, out_features, DType::F16);
                }
            }
        }
    }

    /// The subgroup size [`LinearShader::CoopEmulated`] is laid out for: the lanes of one
    /// emulated subgroup are consecutive invocations.
    pub(super) const EMULATED_SUBGROUP: u32 = 32;

    /// Plain WGSL for each cooperative operation of a rendered coop kernel in `tiling`. A
    /// subgroup is [`EMULATED_SUBGROUP`] consecutive invocations; each holds 8 values of a matrix
    /// of sums (half a row: lane `l` has row `l / 2`, columns `8 · (l % 2)` on). A loaded matrix
    /// is where it lies, in workgroup memory (or in `Direct` in `x` and `weight_t`), which holds
    /// still while it is used; the product reads its rows and columns there. What is left is the
    /// kernel's own staging, indexing and stores.
    pub(super) fn emulated_coop(source: String, tiling: CoopTiling) -> String {
        let replacements: [(&str, &str); 7] = [
            (r"enable wgpu_cooperative_matrix;\n", ""),
            (r"coop_mat16x16<f32, C>\(\)", "array<f32, 8>()"),
            (
                r"coopLoadT<coop_mat16x16<f16, [AB]>>\(&\w+\[(\w+)\], (\w+)\)",
                "Stored($1, $2)",
            ),
            (
                r"coopMultiplyAdd\((\w+), (\w+), (\w+)\)",
                "emulated_multiply_add($1, $2, $3, lid)",
            ),
            (
                r"coopStoreT\((\w+), &staged\[staged_at\], staged_stride\)",
                "emulated_store($1, lid, staged_at, staged_stride)",
            ),
            (r"    @builtin\(subgroup_id\) subgroup: u32,\n", ""),
            (
                r"    let in4 = params.in_features / 4u;\n",
                "    let subgroup = lid / EMULATED_SUBGROUP;\n$0",
            ),
        ];
        let mut source = source;
        for (pattern, replacement) in replacements {
            let pattern = regex::Regex::new(pattern).unwrap();
            assert!(
                pattern.is_match(&source),
                "{pattern} is in {}",
                tiling.file_name()
            );
            source = pattern.replace_all(&source, replacement).into_owned();
        }
        let left = regex::Regex::new(r"coop(Load|Store|MultiplyAdd|_mat)").unwrap();
        assert!(
            !left.is_match(&source),
            "every cooperative operation is emulated"
        );
        let (a, b) = match tiling {
            CoopTiling::Narrow | CoopTiling::Wide => ("x_tile", "w_tile"),
            CoopTiling::Direct => ("x", "weight_t"),
        };
        let emulated = EMULATED.replace("A_ARRAY", a).replace("B_ARRAY", b);
        source + &format!("const EMULATED_SUBGROUP: u32 = {EMULATED_SUBGROUP}u;\n") + &emulated
    }

    /// The cooperative operations [`emulated_coop`] calls: `Stored` is an A matrix in `A_ARRAY`
    /// or a B matrix in `B_ARRAY` (named for the tiling there), from `vec4` `at` on, rows
    /// `stride` `vec4`s apart.
    const EMULATED: &str = r"
struct Stored {
    at: u32,
    stride: u32,
}

fn emulated_multiply_add(a: Stored, b: Stored, c: array<f32, 8>, lid: u32) -> array<f32, 8> {
    let lane = lid % EMULATED_SUBGROUP;
    let row = lane / 2u;
    let column0 = 8u * (lane % 2u);
    var d = c;
    for (var i = 0u; i < 8u; i++) {
        for (var k = 0u; k < 16u; k++) {
            let x = f32(A_ARRAY[a.at + row * a.stride + k / 4u][k % 4u]);
            let column = column0 + i;
            d[i] += x * f32(B_ARRAY[b.at + k * b.stride + column / 4u][column % 4u]);
        }
    }
    return d;
}

fn emulated_store(m: array<f32, 8>, lid: u32, at: u32, stride: u32) {
    let lane = lid % EMULATED_SUBGROUP;
    var values = m;
    for (var i = 0u; i < 8u; i++) {
        staged[at + (lane / 2u) * stride + 8u * (lane % 2u) + i] = values[i];
    }
}
";

    /// Each coop kernel with its cooperative operations emulated ([`emulated_coop`]), in f16
    /// on any GPU with it (lavapipe too): row counts past one row block, widths below and past
    /// one block's columns, depths below and past one staged slice ([`coop_shapes`]), and
    /// `attn.qkv` of the 2B shape. The cooperative operations
    /// themselves are checked where the device has them ([`coop_matches_float64`]).
    #[test]
    fn coop_emulated_matches_float64() {
        let Some(gpu) = device::gpu_for_tests().filter(device::f16_for_tests) else {
            return;
        };
        for tiling in CoopTiling::ALL {
            let name = format!("coop {tiling:?} (emulated)");
            let ours = Ours {
                name: &name,
                truncating_sums: false,
                run: &|x, weight_t, bias| {
                    Tensor::from_dispatch(<Dispatch as LinearBackend>::linear_wgsl(
                        x.into_dispatch(),
                        weight_t.clone().into_dispatch(),
                        bias.clone().into_dispatch(),
                        LinearShader::CoopEmulated(tiling),
                    ))
                },
            };
            for shape in coop_shapes(tiling, &[1, COOP_ROWS as usize + 1]) {
                check_ours(&gpu, &ours, shape, DType::F16, 1);
            }
            // `attn.qkv` of the 2B shape: 40 slices deep, 30 blocks across.
            check_ours(
                &gpu,
                &ours,
                [COOP_ROWS as usize + 3, 1280, 3840],
                DType::F16,
                1,
            );
        }
    }

    /// The cooperative-matrix kernel, in f16 where the device offers it (not lavapipe): row
    /// counts around its row block; widths below, at and past one block's columns, and depths
    /// below, at and past one staged slice; the shapes of Qwen2-VL-2B's linears. Each product
    /// runs `MMLORA_COOP_REPEATS` times (1 unless set) on its inputs, every output checked: a
    /// slice read from workgroup memory before its stores reach it (a race the Vulkan memory
    /// model allows the kernel as naga writes it, wgpu issue #8805) would show as a run off.
    #[test]
    fn coop_matches_float64() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        for kernel in LinearKernel::COOP {
            let tiling = kernel.coop_tiling().unwrap();
            if coop_for_tests(&gpu, tiling).is_some() {
                coop_kernel_matches_float64(&gpu, kernel);
            }
        }
    }

    /// Shapes `[rows, in, out]` for the coop kernel of `tiling`, at each of `rows` (and 16 in
    /// its stead where `Direct` takes no fewer): widths below, at and past one block's columns,
    /// and depths below, at and past one staged slice; in `Direct` the depths are multiples of
    /// 16, and each width but the smallest is 4 past one, so that its last matrix moves back.
    fn coop_shapes(tiling: CoopTiling, rows: &[usize]) -> Vec<[usize; 3]> {
        let (columns, depth) = (COOP_COLUMNS as usize, COOP_DEPTH as usize);
        let widths = match tiling {
            CoopTiling::Narrow | CoopTiling::Wide => [
                (4, 4),
                (depth - 4, columns - 4),
                (depth + 4, columns + 4),
                (4 * depth + 4, 2 * columns),
            ],
            CoopTiling::Direct => [
                (16, 16),
                (depth - 16, columns - 12),
                (depth + 16, columns + 4),
                (4 * depth + 16, 2 * columns + 4),
            ],
        };
        let side = MATRIX as usize;
        rows.iter()
            .map(|&rows| match tiling {
                CoopTiling::Direct => rows.max(side),
                _ => rows,
            })
            .flat_map(|rows| {
                widths.map(|(in_features, out_features)| [rows, in_features, out_features])
            })
            .collect()
    }

    /// [`coop_matches_float64`] for one of the coop kernels.
    fn coop_kernel_matches_float64(gpu: &RuntimeDevice, kernel: LinearKernel) {
        let repeats = std::env::var("MMLORA_COOP_REPEATS").map_or(1, |repeats| {
            repeats
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .expect("MMLORA_COOP_REPEATS is a count of runs, at least 1")
        });
        let block = COOP_ROWS as usize;
        let coop = |shape: [usize; 3]| {
            check_repeated(gpu, kernel, shape, DType::F16, repeats);
        };
        let tiling = kernel.coop_tiling().unwrap();
        let rows = [1, 17, block - 1, block, block + 1, 3 * block + 5];
        for shape in coop_shapes(tiling, &rows) {
            coop(shape);
        }
        for (in_features, out_features) in QWEN2_VL_2B_LINEARS {
            coop([2 * block + 3, in_features, out_features]);
        }
    }

    /// A product the coop kernel cannot compute where it is asked for is Burn's, not a panic:
    /// `x` in f32, and (on a device without cooperative matrices, such as lavapipe with its
    /// subgroups of 8) `x` in f16.
    #[test]
    fn coop_where_it_cannot_run_is_burns() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let mut dtypes = vec![DType::F32];
        let coop = CoopTiling::ALL.map(|tiling| coop_subgroup(&gpu, tiling).is_some());
        if coop == [false; 3] && device::f16_for_tests(&gpu) {
            dtypes.push(DType::F16);
        }
        let d = &gpu.device;
        let integers = |n: usize, modulus: usize| -> Vec<f32> {
            (0..n).map(|i| (i % modulus) as f32 - 3.0).collect()
        };
        for dtype in dtypes {
            let x = Tensor::<2>::from_data(TensorData::new(integers(40, 7), [5, 8]), d);
            let weight_t = Tensor::<2>::from_data(TensorData::new(integers(96, 5), [8, 12]), d);
            let bias = Tensor::<1>::from_data(TensorData::new(integers(12, 4), [12]), d);
            let (x, weight_t, bias) = (x.cast(dtype), weight_t.cast(dtype), bias.cast(dtype));
            let burns = linear(x.clone(), &weight_t, Some(&bias), LinearKernel::Burn).into_data();
            for kernel in LinearKernel::COOP {
                let coop = linear(x.clone(), &weight_t, Some(&bias), kernel);
                // Small integers: every sum is exact (in f16 too), whatever kernel Burn's
                // autotune takes.
                coop.into_data().assert_eq(&burns, true);
            }
        }
    }

    /// Our kernels take one dtype for all three tensors, f32 or f16 (the coop kernel f16
    /// alone), and widths that are multiples of 4 with `in` not 0; anything else is Burn's.
    #[test]
    fn kernels_take_one_dtype_of_theirs_and_widths_of_4() {
        let (f32s, f16s) = (DType::F32, DType::F16);
        let take =
            |shader, [x, w, b]: [DType; 3], [rows, in_features, out_features]: [usize; 3]| {
                kernel_elem(
                    shader,
                    (x, [rows, in_features]),
                    (w, [in_features, out_features]),
                    (b, out_features),
                )
            };
        let shape = [3, 8, 12];
        for shader in [LinearShader::Registers, LinearShader::Tiled] {
            assert_eq!(take(shader, [f32s; 3], shape), Some(Elem::F32));
            assert_eq!(take(shader, [f16s; 3], shape), Some(Elem::F16));
            for mixed in [[f32s, f16s, f16s], [f16s, f32s, f16s], [f16s, f16s, f32s]] {
                assert_eq!(take(shader, mixed, shape), None, "{mixed:?}");
            }
            for other in [DType::F64, DType::BF16] {
                assert_eq!(take(shader, [other; 3], shape), None, "{other:?}");
            }
            for widths in [[3, 0, 12], [3, 6, 12], [3, 8, 10]] {
                assert_eq!(take(shader, [f32s; 3], widths), None, "{widths:?}");
            }
        }
        for tiling in CoopTiling::ALL {
            let coop = LinearShader::Coop(tiling);
            let direct = tiling == CoopTiling::Direct;
            let shape = [16, 32, 16];
            assert_eq!(take(coop, [f16s; 3], shape), Some(Elem::F16));
            assert_eq!(take(coop, [f32s; 3], shape), None);
            // `Direct` loads whole matrices: 16 rows and 16 output columns at least, and a
            // depth of whole matrices.
            for small in [[15, 32, 16], [16, 36, 16], [16, 32, 12]] {
                let taken = take(coop, [f16s; 3], small);
                assert_eq!(
                    taken,
                    (!direct).then_some(Elem::F16),
                    "{tiling:?} {small:?}"
                );
            }
        }
        // A weight or bias whose shape is not the product's.
        let f32_at = |shape| (f32s, shape);
        assert_eq!(
            kernel_elem(
                LinearShader::Tiled,
                f32_at([3, 8]),
                f32_at([4, 12]),
                (f32s, 12)
            ),
            None
        );
        assert_eq!(
            kernel_elem(
                LinearShader::Tiled,
                f32_at([3, 8]),
                f32_at([8, 12]),
                (f32s, 8)
            ),
            None
        );
    }

    /// Which shaders a device's limits let run: OpenGL ES 3.1's least (128 invocations,
    /// 16 KiB of workgroup memory) runs the registers kernel alone; the coop kernel wants one
    /// subgroup size it lays out and the workgroup memory of that layout.
    #[test]
    fn shaders_run_within_the_devices_limits() {
        let capacity = |invocations, workgroup_bytes, subgroups| Capacity {
            invocations,
            workgroup_bytes,
            subgroups,
        };
        let (narrow, wide) = (
            LinearShader::Coop(CoopTiling::Narrow),
            LinearShader::Coop(CoopTiling::Wide),
        );
        let gles = capacity(128, 16 << 10, [32, 32]);
        assert!(LinearShader::Registers.runs_on(gles));
        assert!(!LinearShader::Tiled.runs_on(gles));
        assert!(!narrow.runs_on(gles));
        assert!(!wide.runs_on(gles), "its slices alone take 18 KiB");
        let big = capacity(1024, 48 << 10, [32, 32]);
        assert!(LinearShader::Tiled.runs_on(big));
        assert!(narrow.runs_on(big));
        assert!(wide.runs_on(big));
        for subgroups in [[8, 8], [16, 32], [128, 128]] {
            for coop in [narrow, wide] {
                assert!(
                    !coop.runs_on(capacity(1024, 48 << 10, subgroups)),
                    "{coop:?} {subgroups:?}"
                );
            }
        }
        for subgroup in [16, 64] {
            let at = capacity(1024, 48 << 10, [subgroup, subgroup]);
            assert!(narrow.runs_on(at) && !wide.runs_on(at), "{subgroup}");
        }
        let bytes = CoopLayout::new(CoopTiling::Narrow, 16)
            .unwrap()
            .workgroup_bytes();
        assert!(narrow.runs_on(capacity(256, bytes, [16, 16])));
        assert!(!narrow.runs_on(capacity(256, bytes - 1, [16, 16])));
        let bytes = CoopLayout::new(CoopTiling::Wide, 32)
            .unwrap()
            .workgroup_bytes();
        assert!(wide.runs_on(capacity(128, bytes, [32, 32])));
        assert!(!wide.runs_on(capacity(128, bytes - 1, [32, 32])));
        assert!(!wide.runs_on(capacity(64, bytes, [32, 32])));
    }

    /// Flex's linear (a `gemm` call onto rows of the bias) against float64: widths that are
    /// not multiples of anything, calls on either side of the threading threshold, the shapes
    /// of Qwen2-VL-2B's linears, and `Wᵀ` as the transposed view the layers keep.
    #[test]
    fn flex_matches_float64() {
        let cpu = device::cpu();
        for (rows, in_features, out_features) in [
            (1, 1, 1),
            (3, 7, 13),
            (37, 129, 67),
            (300, 200, 200),
            (37, 1280, 3840),
            (37, 5120, 1280),
        ] {
            check(
                &cpu,
                LinearKernel::Burn,
                rows,
                in_features,
                out_features,
                DType::F32,
            );
        }
    }

    /// Flex's linear on a strided `x` (a transpose), with no rows, and with no inner width
    /// (the bias alone).
    #[test]
    fn flex_strided_and_empty() {
        let d = device::cpu().device;
        let tensor = |values: Vec<f32>, shape: [usize; 2]| {
            Tensor::<2>::from_data(TensorData::new(values, shape), &d)
        };
        let x_t = tensor(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]);
        let weight_t = tensor(vec![1.0, 0.5, -1.0, 2.0], [2, 2]);
        let bias = Tensor::<1>::from_data([0.25f32, -0.25], &d);
        let y = linear(x_t.transpose(), &weight_t, Some(&bias), LinearKernel::Burn);
        // x = [[1, 4], [2, 5], [3, 6]]; exact: small integers, halves and quarters.
        let expected = [
            1.0 - 4.0 + 0.25,
            0.5 + 8.0 - 0.25,
            2.0 - 5.0 + 0.25,
            1.0 + 10.0 - 0.25,
            3.0 - 6.0 + 0.25,
            1.5 + 12.0 - 0.25,
        ];
        assert_eq!(y.into_data().try_to_vec::<f32>().unwrap(), expected);
        let no_rows = linear(
            tensor(vec![], [0, 2]),
            &weight_t,
            Some(&bias),
            LinearKernel::Burn,
        );
        assert_eq!(no_rows.dims(), [0, 2]);
        let no_inner = linear(
            tensor(vec![], [3, 0]),
            &tensor(vec![], [0, 2]),
            Some(&bias),
            LinearKernel::Burn,
        );
        assert_eq!(
            no_inner.into_data().try_to_vec::<f32>().unwrap(),
            [0.25, -0.25, 0.25, -0.25, 0.25, -0.25]
        );
    }

    /// More row blocks than one dispatch may have: the rows past the first launch come out of
    /// the second one, right, for each of our kernels.
    #[test]
    fn rows_beyond_one_dispatch() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let d = &gpu.device;
        let weight_t = Tensor::<2>::from_data(
            TensorData::new((0..16).map(|i| i as f32).collect::<Vec<f32>>(), [4, 4]),
            d,
        );
        let bias = Tensor::<1>::from_data([0.5f32, -0.5, 1.0, 2.0], d);
        let coop = CoopTiling::ALL.map(|tiling| coop_for_tests(&gpu, tiling).is_some());
        for (kernel, dtype, runs) in [
            (LinearKernel::Wgsl, DType::F32, true),
            (LinearKernel::Tiled, DType::F32, true),
            (LinearKernel::Coop, DType::F16, coop[0]),
            (LinearKernel::CoopWide, DType::F16, coop[1]),
        ] {
            if !runs {
                continue;
            }
            let (block_rows, _) = kernel.shader().unwrap().block();
            let rows = MAX_WORKGROUPS_PER_DIM as usize * block_rows as usize + 5;
            let x: Vec<f32> = (0..rows * 4).map(|i| (i % 7) as f32 - 3.0).collect();
            let x = Tensor::<2>::from_data(TensorData::new(x, [rows, 4]), d).cast(dtype);
            let (weight_t, bias) = (weight_t.clone().cast(dtype), bias.clone().cast(dtype));
            let ours = linear(x.clone(), &weight_t, Some(&bias), kernel);
            let burns = linear(x, &weight_t, Some(&bias), LinearKernel::Burn);
            // Small integers and halves, below 2048: both sums are exact, in f16 too.
            ours.into_data().assert_eq(&burns.into_data(), true);
        }
    }

    #[test]
    fn auto_and_the_candidates_follow_the_device() {
        use LinearKernel::{Auto, Burn, Tiled, Timed, Wgsl};
        let cpu = device::cpu();
        for dtype in [DType::F32, DType::F16] {
            assert_eq!(LinearKernel::candidates(&cpu, dtype), &[Burn]);
        }
        assert_eq!(Auto.resolve(&cpu), Burn);
        assert_eq!(Wgsl.resolve(&cpu), Wgsl);
        if let Some(gpu) = device::gpu_for_tests() {
            let tiled = LinearShader::Tiled.runs_on(Capacity::of_wgpu(gpu.wgpu.as_ref().unwrap()));
            // The coop kernels the device runs, in `LinearKernel::COOP`'s order.
            let coop: Vec<LinearKernel> = LinearKernel::COOP
                .into_iter()
                .filter(|kernel| {
                    let tiling = kernel.coop_tiling().unwrap();
                    gpu.hardware_gpu && coop_for_tests(&gpu, tiling).is_some()
                })
                .collect();
            let (auto, f32s, f16s) = match (gpu.hardware_gpu, tiled) {
                (false, _) => (Wgsl, vec![Wgsl, Burn], vec![Wgsl, Burn]),
                (true, false) => (Timed, vec![Burn], vec![Burn]),
                (true, true) => (Timed, vec![Burn, Tiled], [vec![Burn, Tiled], coop].concat()),
            };
            assert_eq!(LinearKernel::candidates(&gpu, DType::F32), f32s);
            assert_eq!(LinearKernel::candidates(&gpu, DType::F16), f16s);
            assert_eq!(Auto.resolve(&gpu), auto);
            assert_eq!(Tiled.resolve(&gpu), Tiled);
            assert_eq!(Timed.resolve(&gpu), Timed);
        }
    }

    #[test]
    fn shaders_validate_and_translate_to_every_backend() {
        for shader in [LinearShader::Registers, LinearShader::Tiled] {
            for (elem, lora) in Elem::ALL.into_iter().flat_map(|e| [(e, false), (e, true)]) {
                let what = format!("{} ({elem:?}, LoRA epilogue {lora})", shader.file_name());
                match shader.render(elem, 0, lora) {
                    Some(source) => validate_and_translate(&source, &what),
                    None => assert!(lora && !shader.has_lora_epilogue(), "{what} renders"),
                }
            }
        }
    }

    /// The cooperative-matrix kernel at every subgroup size it takes, to SPIR-V (naga writes
    /// cooperative matrices for Vulkan and, 8 × 8 alone, for Metal; 16 × 16 is Vulkan's); none
    /// at another size or in f32.
    #[test]
    fn coop_shader_validates_and_translates_to_spirv() {
        for (tiling, subgroups) in [
            (CoopTiling::Narrow, &[16, 32, 64][..]),
            (CoopTiling::Wide, &[32][..]),
            (CoopTiling::Direct, &[32][..]),
        ] {
            let coop = LinearShader::Coop(tiling);
            for &subgroup in subgroups {
                let layout = CoopLayout::new(tiling, subgroup).unwrap();
                let (down, across) = layout.matrices();
                assert_eq!(
                    layout.subgroups * down * across,
                    64,
                    "the cells cover the block"
                );
                assert_eq!(layout.subgroups * subgroup, layout.workgroup);
                assert!(down * across <= 16, "at most 16 matrices of sums");
                for lora in [false, true] {
                    let what = format!(
                        "{} ({tiling:?}, subgroup {subgroup}, LoRA epilogue {lora})",
                        tiling.file_name()
                    );
                    let source = coop.render(Elem::F16, subgroup, lora).unwrap();
                    validate_and_translate_to_spirv(&source, &what);
                }
                assert_eq!(coop.render(Elem::F32, subgroup, false), None);
            }
            for subgroup in [8, 16, 32, 64, 128] {
                if !subgroups.contains(&subgroup) {
                    assert_eq!(CoopLayout::new(tiling, subgroup), None);
                    assert_eq!(coop.render(Elem::F16, subgroup, false), None);
                }
            }
        }
    }
}
