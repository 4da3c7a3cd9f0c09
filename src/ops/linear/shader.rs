//! Our linear kernels, their block shapes, and which of them a device runs: its workgroup and
//! subgroup limits, and for the coop kernels its cooperative matrices.

use burn::tensor::wgpu::WgpuSetup;

#[cfg(test)]
use super::tests;
use crate::runtime::device::RuntimeDevice;
use crate::runtime::wgsl::Elem;

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
#[cfg(test)]
pub const COOP_STORE_FILE_NAME: &str = "linear_coop_store.wgsl";

/// The side of one cooperative matrix of the coop kernels (16 × 16 × 16 products).
pub(crate) const MATRIX: u32 = 16;

/// The LoRA epilogue our linear kernels for hardware GPUs paste in (`{{ lora }}`) where they add
/// each row's adapter delta as they store it ([`LinearShader::has_lora_epilogue`]).
#[cfg(test)]
pub const LORA_FILE_NAME: &str = "linear_lora.wgsl";

/// Values each row of `linear_coop.wgsl`'s slices in workgroup memory is padded by: 16 bytes of
/// f16, which keeps a matrix's rows off one bank and every cooperative load 16-byte aligned.
pub(crate) const COOP_PAD: u32 = 8;

// `{{ loads }}` serves both slices, which are equally large, and every thread loads as many
// `vec4`s of each, in either tiling; the slices' padded rows are whole `vec4`s.
const _: () = assert!(
    COOP_PAD.is_multiple_of(4)
        && COOP_ROWS == COOP_COLUMNS
        && (COOP_ROWS * COOP_DEPTH / 4).is_multiple_of(COOP_WORKGROUP)
        && (COOP_ROWS * COOP_DEPTH / 4).is_multiple_of(COOP_WIDE_WORKGROUP)
);

/// Our WGSL kernels for the linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinearShader {
    /// `shaders/linear/linear.wgsl`.
    Registers,
    /// `shaders/linear/linear_tiled.wgsl`.
    Tiled,
    /// `shaders/linear/linear_coop.wgsl` (or `linear_coop_direct.wgsl` in [`CoopTiling::Direct`]),
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
    #[cfg(test)]
    pub const ALL: [CoopTiling; 3] = [CoopTiling::Narrow, CoopTiling::Wide, CoopTiling::Direct];

    /// Invocations per workgroup.
    pub(crate) fn workgroup(self) -> u32 {
        match self {
            CoopTiling::Narrow => COOP_WORKGROUP,
            CoopTiling::Wide | CoopTiling::Direct => COOP_WIDE_WORKGROUP,
        }
    }

    /// The tiling's shader file under `shaders/`.
    #[cfg(test)]
    pub(crate) fn file_name(self) -> &'static str {
        match self {
            CoopTiling::Narrow | CoopTiling::Wide => "linear_coop.wgsl",
            CoopTiling::Direct => "linear_coop_direct.wgsl",
        }
    }

    /// Whether a product of `rows × in_features → out_features` (widths multiples of 4) is one
    /// the tiling's kernel computes: `Direct` loads whole 16 × 16 matrices from the buffers, so
    /// it needs `in` a multiple of 16 and at least 16 rows and 16 output columns.
    pub(crate) fn takes_shape(self, rows: usize, in_features: usize, out_features: usize) -> bool {
        match self {
            CoopTiling::Narrow | CoopTiling::Wide => true,
            CoopTiling::Direct => {
                let side = MATRIX as usize;
                in_features.is_multiple_of(side) && rows >= side && out_features >= side
            }
        }
    }
}

/// What of a device decides which of our shaders it runs: its limits on one workgroup and its
/// subgroup sizes, read from wgpu ([`Capacity::of_wgpu`]) or from a tensor's cubecl client
/// (which reads them from wgpu too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Capacity {
    /// Invocations one workgroup may have.
    pub(crate) invocations: u32,
    /// Bytes of workgroup memory one workgroup may declare.
    pub(crate) workgroup_bytes: u32,
    /// The smallest and the largest subgroup size.
    pub(crate) subgroups: [u32; 2],
}

impl Capacity {
    /// The capacity of a wgpu device.
    pub(crate) fn of_wgpu(setup: &WgpuSetup) -> Self {
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
    #[cfg(test)]
    pub const ALL: [LinearShader; 5] = [
        LinearShader::Registers,
        LinearShader::Tiled,
        LinearShader::Coop(CoopTiling::Narrow),
        LinearShader::Coop(CoopTiling::Wide),
        LinearShader::Coop(CoopTiling::Direct),
    ];

    /// The shader's file name under `shaders/`.
    #[cfg(test)]
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
    pub(crate) fn workgroup(self) -> u32 {
        match self {
            LinearShader::Registers => WORKGROUP,
            LinearShader::Tiled => TILED_WORKGROUP,
            LinearShader::Coop(tiling) => tiling.workgroup(),
            #[cfg(test)]
            LinearShader::CoopEmulated(tiling) => tiling.workgroup(),
        }
    }

    /// The block one workgroup computes: rows, `vec4` columns.
    pub(crate) fn block(self) -> (u32, u32) {
        match self {
            LinearShader::Registers => (ROWS, WORKGROUP * COLUMNS),
            LinearShader::Tiled => (TILED_ROWS, TILED_COLUMNS4),
            LinearShader::Coop(_) => (COOP_ROWS, COOP_COLUMNS / 4),
            #[cfg(test)]
            LinearShader::CoopEmulated(_) => (COOP_ROWS, COOP_COLUMNS / 4),
        }
    }

    /// Whether the shader can add each row's LoRA delta as it stores its product
    /// (`shaders/linear/linear_lora.wgsl`; `ops::lora::linear_lora`): all but `linear.wgsl`. Its
    /// epilogue would load each row's `B` anew for every `vec4` it stores, and on llvmpipe,
    /// which it is built for, each load is a loop over the SIMD lanes: fused there, the op costs
    /// several times what it costs apart (BENCHMARKS.md).
    pub fn has_lora_epilogue(self) -> bool {
        !matches!(self, LinearShader::Registers)
    }

    /// The tiling of a cooperative-matrix shader (emulated or not); `None` for the others.
    pub(crate) fn coop_tiling(self) -> Option<CoopTiling> {
        match self {
            LinearShader::Coop(tiling) => Some(tiling),
            #[cfg(test)]
            LinearShader::CoopEmulated(tiling) => Some(tiling),
            LinearShader::Registers | LinearShader::Tiled => None,
        }
    }

    /// Whether the shader is written for tensors of `elem` (the cooperative-matrix ones: f16
    /// alone).
    pub(crate) fn takes(self, elem: Elem) -> bool {
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
    pub(crate) fn runs_on(self, capacity: Capacity) -> bool {
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
pub(crate) struct CoopLayout {
    /// The tiling laid out.
    pub(crate) tiling: CoopTiling,
    /// Invocations per workgroup.
    pub(crate) workgroup: u32,
    /// Subgroups per workgroup: one cell of the block each.
    pub(crate) subgroups: u32,
    /// Cells across the block (the rest go down it).
    pub(crate) subgroup_columns: u32,
}

impl CoopLayout {
    /// The layout of `tiling` for subgroups of `subgroup` invocations (`None` for sizes it does
    /// not lay out): in `Narrow`, 4, 8 or 16 subgroups of 64, 32 or 16, each cell at most 4 × 4
    /// matrices; in `Wide` and `Direct`, 4 subgroups of 32, each cell 4 × 4 matrices.
    pub(crate) fn new(tiling: CoopTiling, subgroup: u32) -> Option<Self> {
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
    pub(crate) fn matrices(self) -> (u32, u32) {
        let subgroup_rows = self.subgroups / self.subgroup_columns;
        (
            COOP_ROWS / subgroup_rows / MATRIX,
            COOP_COLUMNS / self.subgroup_columns / MATRIX,
        )
    }

    /// Bytes of workgroup memory the kernel declares: one 16 × 16 f32 staging matrix per
    /// subgroup and, but in `Direct`, the two padded f16 slices.
    pub(crate) fn workgroup_bytes(self) -> u32 {
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
