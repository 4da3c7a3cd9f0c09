//! The GPU implementation: our WGSL shaders launched on Burn's wgpu buffers.
//!
//! Two launches per slice. Shrink writes `x · A[slot]ᵀ` for every adapter row into a
//! `[rows, rank]` scratch tensor; expand adds `scratch · B[slot]ᵀ` into the output's slice
//! columns. Both walk the [tiles](crate::routing::meta::KernelMeta::tiles) of the slot-sorted rows,
//! so a workgroup always serves one slot and the cost stays flat as adapters mix. Fused into the
//! base product ([`LoraBackend::linear_lora`]), the expand is the linear kernel's epilogue
//! instead (`shaders/linear/linear_lora.wgsl`, launched by `linear::launch_linear`).
//!
//! Shrink has two shaders, picked by the batch's [`ShrinkKernel`]: `lora_shrink.wgsl` (64
//! threads per tile, or 256 for `wide`; for hardware GPUs) and `lora_shrink_registers.wgsl` (8
//! threads per tile, every sum in a variable of its own; for llvmpipe, where it makes the op
//! faster at every rank measured: BENCHMARKS.md). `wide` also gives the aligned expand 256
//! threads per tile, four per column group, each adding to four of the tile's rows.
//!
//! Each kernel exists for `f32` and `f16` tensors ([`Elem`]); sums and the scratch stay `f32`.
//! Each also has a `vec4` form that reads and writes four elements per access, taken where the
//! widths it indexes are multiples of 4 (every Qwen2-VL layer, and ranks 4, 8, 16, …): shrink as
//! a specialisation of its one shader, expand as a shader of its own. On lavapipe that pays most,
//! as each load there is a loop over the SIMD lanes (BENCHMARKS.md).

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::wgpu::{CubeBackend, CubeTensor, KernelSource, SourceTemplate};
use burn::tensor::DType;
use burn_cubecl::cubecl::ir::attributes::BufferIOAttr;
use burn_cubecl::cubecl::prelude::KernelId;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;

use super::{LoraBackend, LoraPlan, ShrinkKernel, TILE, TILE_ROWS};
use crate::ops::hardware;
use crate::ops::linear::{self, LinearBackend, LinearShader, LoraEpilogue};
use crate::runtime::wgsl::{self, Elem};

/// Invocations per workgroup of `lora_shrink.wgsl` and the expand shaders (`{{ workgroup }}`);
/// threads across a workgroup's columns in `lora_expand_vec4.wgsl` (`{{ column_threads }}`).
pub const WORKGROUP: u32 = 64;

/// Invocations per workgroup of `lora_shrink.wgsl` and `lora_expand_vec4.wgsl` for
/// [`ShrinkKernel::Wide`]: 4 × [`WORKGROUP`], each workgroup's 16 KiB of workgroup memory
/// within WebGPU's least limit.
pub const WIDE_WORKGROUP: u32 = 256;

// `lora_shrink.wgsl`'s partial sums: four `vec4<f32>`s per invocation, within WebGPU's least
// workgroup memory (16 KiB) at the wide size.
const _: () = assert!(WIDE_WORKGROUP * 4 * 16 <= 16 * 1024);

/// Invocations per workgroup of `lora_shrink.wgsl` and `lora_expand_vec4.wgsl` for `kernel`
/// (resolved).
pub fn tile_threads(kernel: ShrinkKernel) -> u32 {
    match kernel {
        ShrinkKernel::Wide => WIDE_WORKGROUP,
        _ => WORKGROUP,
    }
}

/// The largest rank block one shrink workgroup sums (`{{ rank_tile }}` is at most this).
pub const MAX_RANK_TILE: u32 = 32;

/// The WGSL kernels of the op: a shader file, and for shrink how many columns one load reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoraShader {
    /// `shaders/lora/lora_shrink.wgsl`, one column per load: any width.
    Shrink,
    /// `shaders/lora/lora_shrink.wgsl`, four columns per load: `in_features` a multiple of 4.
    ShrinkVec4,
    /// `shaders/lora/lora_shrink_registers.wgsl` (sums in registers, for software rasterizers),
    /// one column per load: any width.
    ShrinkRegisters,
    /// `shaders/lora/lora_shrink_registers.wgsl`, four columns per load: `in_features` a multiple
    /// of 4.
    ShrinkRegistersVec4,
    /// `shaders/lora/lora_expand.wgsl`: any widths.
    Expand,
    /// `shaders/lora/lora_expand_vec4.wgsl`: rank and every output width and offset multiples of 4.
    ExpandVec4,
}

impl LoraShader {
    /// Every kernel, for tests that check them all.
    #[cfg(test)]
    pub const ALL: [LoraShader; 6] = [
        LoraShader::Shrink,
        LoraShader::ShrinkVec4,
        LoraShader::ShrinkRegisters,
        LoraShader::ShrinkRegistersVec4,
        LoraShader::Expand,
        LoraShader::ExpandVec4,
    ];

    /// The shrink shader of `kernel` (resolved) for an input of `in_features` columns.
    pub fn shrink(kernel: ShrinkKernel, in_features: usize) -> Self {
        let vec4 = in_features.is_multiple_of(4);
        match (kernel, vec4) {
            (ShrinkKernel::Registers, true) => LoraShader::ShrinkRegistersVec4,
            (ShrinkKernel::Registers, false) => LoraShader::ShrinkRegisters,
            (_, true) => LoraShader::ShrinkVec4,
            (_, false) => LoraShader::Shrink,
        }
    }

    /// The expand kernel for a slice of `out_features` columns at `out_offset` in an output of
    /// `out_total` columns, with adapters of `rank`.
    pub fn expand(rank: usize, out_features: usize, out_total: usize, out_offset: usize) -> Self {
        if [rank, out_features, out_total, out_offset]
            .iter()
            .all(|width| width.is_multiple_of(4))
        {
            LoraShader::ExpandVec4
        } else {
            LoraShader::Expand
        }
    }

    /// The shader's file name under `shaders/`.
    pub fn file_name(self) -> &'static str {
        match self {
            LoraShader::Shrink | LoraShader::ShrinkVec4 => "lora_shrink.wgsl",
            LoraShader::ShrinkRegisters | LoraShader::ShrinkRegistersVec4 => {
                "lora_shrink_registers.wgsl"
            }
            LoraShader::Expand => "lora_expand.wgsl",
            LoraShader::ExpandVec4 => "lora_expand_vec4.wgsl",
        }
    }

    /// Whether this shader passed its tests on a hardware GPU as it is now
    /// ([`crate::ops::hardware`]).
    pub fn hardware_checked(self) -> bool {
        hardware::checked(&format!("lora/{}", self.file_name()), self.template())
    }

    fn template(self) -> &'static str {
        match self {
            LoraShader::Shrink | LoraShader::ShrinkVec4 => {
                include_str!("../../../shaders/lora/lora_shrink.wgsl")
            }
            LoraShader::ShrinkRegisters | LoraShader::ShrinkRegistersVec4 => {
                include_str!("../../../shaders/lora/lora_shrink_registers.wgsl")
            }
            LoraShader::Expand => include_str!("../../../shaders/lora/lora_expand.wgsl"),
            LoraShader::ExpandVec4 => include_str!("../../../shaders/lora/lora_expand_vec4.wgsl"),
        }
    }

    /// Neighbouring columns of x and A that one shrink load reads (`{{ lanes }}`), the WGSL type
    /// of that load (`{{ load }}`) and the expression that widens it, `v`, to a zero-padded
    /// `vec4<f32>` (`{{ widen }}`). Expand: unused.
    fn shrink_load(self) -> (u32, &'static str, &'static str) {
        match self {
            LoraShader::ShrinkVec4 | LoraShader::ShrinkRegistersVec4 => {
                (4, "vec4<ELEM>", "vec4<f32>(v)")
            }
            _ => (1, "ELEM", "vec4<f32>(f32(v), 0.0, 0.0, 0.0)"),
        }
    }

    /// Adjacent output columns each expand thread adds to: `{{ columns }}` in
    /// `lora_expand_vec4.wgsl` (two `vec4`s); `lora_expand.wgsl` is written for 4.
    fn columns(self) -> u32 {
        match self {
            LoraShader::ExpandVec4 => 8,
            _ => 4,
        }
    }

    /// Whether the shader runs [`tile_threads`] invocations per workgroup (the others have
    /// one size each).
    fn takes_threads(self) -> bool {
        matches!(
            self,
            LoraShader::Shrink | LoraShader::ShrinkVec4 | LoraShader::ExpandVec4
        )
    }

    /// The WGSL source specialised for `rank_tile` (see [`rank_tile`]), `elem` and `threads`
    /// per workgroup ([`tile_threads`]; ignored by the shaders of one size).
    #[cfg(test)]
    pub fn render(self, rank_tile: u32, elem: Elem, threads: u32) -> String {
        LoraKernel::new(self, rank_tile, elem, threads)
            .source()
            .complete()
    }
}

/// The rank block for an adapter of rank `rank`: the power of two at or above `rank`, between 4
/// and [`MAX_RANK_TILE`]. Each value is its own specialised kernel.
pub fn rank_tile(rank: usize) -> u32 {
    (rank.next_power_of_two().clamp(4, MAX_RANK_TILE as usize)) as u32
}

/// Every rank block [`rank_tile`] can return.
#[cfg(test)]
pub fn rank_tiles() -> impl Iterator<Item = u32> {
    [4, 8, 16, 32].into_iter()
}

/// Threads per workgroup of `lora_shrink_registers.wgsl`: one SIMD vector of llvmpipe's.
pub const SHRINK_SPLIT: u32 = 8;

/// The statements `shaders/lora/lora_shrink_registers.wgsl` repeats for each row of the tile and
/// each block of four ranks, written out with a variable each: `{{ setup }}`, `{{ load_a }}`,
/// `{{ accumulate }}` and `{{ reduce }}`.
fn shrink_unrolled(rank_tile: u32) -> [String; 4] {
    let rows = 0..TILE_ROWS as u32;
    let blocks = 0..rank_tile / 4;
    let setup = [
        rows.clone()
            .map(|m| {
                format!("let x_{m} = u32(sorted_tokens[start + min({m}u, len - 1u)]) * width;")
            })
            .collect::<Vec<_>>(),
        (0..rank_tile)
            .map(|j| format!("let a_{j} = (slot * rank + min(rank0 + {j}u, rank - 1u)) * width;"))
            .collect(),
        rows.clone()
            .flat_map(|m| {
                blocks
                    .clone()
                    .map(move |q| format!("var sum_{m}_{q} = vec4<f32>();"))
            })
            .collect(),
    ]
    .concat();
    let load_a: Vec<String> = blocks
        .clone()
        .map(|q| {
            let columns: Vec<String> = (4 * q..4 * q + 4)
                .map(|j| format!("widen(lora_a[a_{j} + k])"))
                .collect();
            format!("let m_{q} = mat4x4<f32>({});", columns.join(", "))
        })
        .collect();
    let accumulate: Vec<String> = rows
        .clone()
        .map(|m| {
            let adds: String = blocks
                .clone()
                .map(|q| format!(" sum_{m}_{q} += v * m_{q};"))
                .collect();
            format!("{{ let v = widen(x[x_{m} + k]);{adds} }}")
        })
        .collect();
    let reduce: Vec<String> = blocks
        .clone()
        .flat_map(|q| {
            let mut block: Vec<String> = rows
                .clone()
                .map(|m| format!("partial[lid * TILE_ROWS + {m}u] = sum_{m}_{q};"))
                .collect();
            block.push("workgroupBarrier();".into());
            block.push(format!(
                "for (var m = lid; m < TILE_ROWS; m += SPLIT) {{ store(m, rank0 + {}u, start, len, rank); }}",
                4 * q
            ));
            block.push("workgroupBarrier();".into());
            block
        })
        .collect();
    [
        wgsl::statements("    ", &setup),
        wgsl::statements("        ", &load_a),
        wgsl::statements("        ", &accumulate),
        wgsl::statements("    ", &reduce),
    ]
}

/// A shader specialised for one rank block, element type and workgroup size.
#[derive(Debug, Clone, Copy)]
struct LoraKernel {
    shader: LoraShader,
    rank_tile: u32,
    elem: Elem,
    /// Invocations per workgroup.
    workgroup: u32,
}

impl LoraKernel {
    /// `shader` for `rank_tile` and `elem`, with `threads` per workgroup where it takes them.
    fn new(shader: LoraShader, rank_tile: u32, elem: Elem, threads: u32) -> Self {
        let workgroup = match shader {
            LoraShader::ShrinkRegisters | LoraShader::ShrinkRegistersVec4 => SHRINK_SPLIT,
            _ if shader.takes_threads() => threads,
            _ => WORKGROUP,
        };
        Self {
            shader,
            rank_tile,
            elem,
            workgroup,
        }
    }
}

impl KernelSource for LoraKernel {
    fn source(&self) -> SourceTemplate {
        let (lanes, load, widen) = self.shader.shrink_load();
        let template = SourceTemplate::new(self.shader.template());
        let template = match self.shader {
            LoraShader::ShrinkRegisters | LoraShader::ShrinkRegistersVec4 => {
                let [setup, load_a, accumulate, reduce] = shrink_unrolled(self.rank_tile);
                template
                    .register("setup", setup)
                    .register("load_a", load_a)
                    .register("accumulate", accumulate)
                    .register("reduce", reduce)
            }
            _ => template,
        };
        template
            .register("workgroup", self.workgroup.to_string())
            .register("column_threads", WORKGROUP.to_string())
            .register("tile_rows", TILE_ROWS.to_string())
            .register("rank_tile", self.rank_tile.to_string())
            .register("columns", self.shader.columns().to_string())
            .register("lanes", lanes.to_string())
            .register("load", load)
            .register("widen", widen)
            .register("elem", self.elem.wgsl())
            .register("enable", self.elem.enable())
    }

    fn id(&self) -> KernelId {
        // `lora_expand_vec4.wgsl` does not read the rank block, so one pipeline serves every
        // rank rather than one identical copy per block size.
        let rank_tile = (self.shader != LoraShader::ExpandVec4).then_some(self.rank_tile);
        wgsl::kernel_id::<Self>((self.shader, rank_tile, self.elem, self.workgroup))
    }

    fn lang(&self) -> &'static str {
        "wgsl"
    }
}

/// Launches an op kernel on `workgroups` (x, y) with `buffers` bound in order: four read, the
/// last written (`output_io`); `params` in the trailing uniform.
fn launch(
    kernel: LoraKernel,
    workgroups: (u32, u32),
    buffers: [&CubeTensor; 5],
    output_io: BufferIOAttr,
    params: &[u32],
) {
    let [a, b, c, d, output] = buffers;
    let read = BufferIOAttr::ReadOnly;
    let buffers = [
        (a, read),
        (b, read),
        (c, read),
        (d, read),
        (output, output_io),
    ];
    wgsl::launch(kernel, kernel.workgroup, workgroups, &buffers, params);
}

impl LoraBackend for CubeBackend {
    fn lora_apply(
        x: FloatTensor<Self>,
        base: FloatTensor<Self>,
        lora_a: FloatTensor<Self>,
        lora_b: FloatTensor<Self>,
        sorted_tokens: IntTensor<Self>,
        tiles: IntTensor<Self>,
        plan: LoraPlan,
        out_offset: usize,
    ) -> FloatTensor<Self> {
        let x = into_contiguous(x);
        let b = into_contiguous(lora_b);
        let sorted_tokens = into_contiguous(sorted_tokens);
        let tiles = into_contiguous(tiles);
        let output = into_contiguous(base);
        // Write in place when nothing else holds the base output; copy it otherwise.
        let output = if output.can_mut() {
            output
        } else {
            output.copy()
        };

        let out_total = output.meta.shape()[1];
        let [_, out_features, rank] = [b.meta.shape()[0], b.meta.shape()[1], b.meta.shape()[2]];
        let n_tiles = plan.meta.tiles(TILE).count();
        let elem = Elem::of(x.dtype);
        let expand = match plan.expand_vec4 {
            true => LoraShader::expand(rank, out_features, out_total, out_offset),
            false => LoraShader::Expand,
        };
        let shrunk = shrink(&x, lora_a, &sorted_tokens, &tiles, &plan);
        let kernel = LoraKernel::new(expand, rank_tile(rank), elem, tile_threads(plan.shrink));
        for (tile_base, tiles_here) in wgsl::launches(n_tiles as u32) {
            launch(
                kernel,
                (
                    tiles_here,
                    (out_features as u32).div_ceil(expand.columns() * WORKGROUP),
                ),
                [&shrunk, &b, &sorted_tokens, &tiles, &output],
                // Rows' deltas are added to what is there.
                BufferIOAttr::ReadWrite,
                &[
                    wgsl::param(out_features),
                    wgsl::param(rank),
                    wgsl::param(out_total),
                    wgsl::param(out_offset),
                    tile_base,
                ],
            );
        }
        output
    }

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
    ) -> FloatTensor<Self> {
        let Some(kernel) = linear::cube_source(shader, &x, &weight_t, &bias, true) else {
            let base = Self::linear_native(x.clone(), weight_t, bias);
            return Self::lora_apply(x, base, lora_a, lora_b, sorted_tokens, tiles, plan, 0);
        };
        let x = into_contiguous(x);
        let shrunk = shrink(
            &x,
            lora_a,
            &into_contiguous(sorted_tokens),
            &into_contiguous(tiles),
            &plan,
        );
        let lora_b = into_contiguous(lora_b);
        let epilogue = LoraEpilogue {
            shrunk: &shrunk,
            rank: lora_b.meta.shape()[2],
            lora_b: &lora_b,
            row_slots: &into_contiguous(row_slots),
        };
        linear::launch_linear(kernel, x, weight_t, bias, Some(epilogue))
    }
}

/// The shrink, `x · A[slot]ᵀ` for every adapter row, into a new `[rows, rank]` f32 tensor (rows
/// without an adapter left unwritten), with the batch's shrink kernel (resolved, not `Timed`).
fn shrink(
    x: &CubeTensor,
    lora_a: CubeTensor,
    sorted_tokens: &CubeTensor,
    tiles: &CubeTensor,
    plan: &LoraPlan,
) -> CubeTensor {
    debug_assert_ne!(
        plan.shrink,
        ShrinkKernel::Timed,
        "the op resolves `timed` first"
    );
    let a = into_contiguous(lora_a);
    let [rows, in_features] = [x.meta.shape()[0], x.meta.shape()[1]];
    let rank = a.meta.shape()[1];
    let shrunk = empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        [rows, rank].into(),
        DType::F32,
    );
    let rank_tile = rank_tile(rank);
    let kernel = LoraKernel::new(
        LoraShader::shrink(plan.shrink, in_features),
        rank_tile,
        Elem::of(x.dtype),
        tile_threads(plan.shrink),
    );
    let n_tiles = plan.meta.tiles(TILE).count();
    for (tile_base, tiles_here) in wgsl::launches(n_tiles as u32) {
        launch(
            kernel,
            (tiles_here, (rank as u32).div_ceil(rank_tile)),
            [x, &a, sorted_tokens, tiles, &shrunk],
            BufferIOAttr::WriteOnly,
            &[wgsl::param(in_features), wgsl::param(rank), tile_base],
        );
    }
    shrunk
}

#[cfg(test)]
mod tests {
    use super::super::testing::{
        Problem, Reference, U, U16, assert_matches, cases, check_f16, fused_layer, problems,
        reference, shrink_kernels,
    };
    use super::super::{LoraBatch, LoraOpError, fuse, linear_lora, lora_apply};
    use super::*;
    use crate::ops::linear::{self, CoopTiling, LinearShader};
    use crate::ops::testing::shader_files;
    use crate::ops::testing::to_f64;
    use crate::routing::meta::{KernelMeta, NO_SLOT};
    use crate::runtime::device;
    use crate::runtime::wgsl::validate_and_translate;
    use burn::backend::Dispatch;
    use burn::tensor::{Tensor, s};
    use proptest::prelude::*;

    /// WGSL with `shrink` against the native op and against float64 on the same random tensors.
    fn check(problem: &Problem, shrink: ShrinkKernel) {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let cpu = device::cpu();
        let data = problem.data(&cpu);
        let expected = reference(problem, &data);
        let native = data.apply(problem, &cpu);
        let wgsl = data.apply_with(problem, &gpu, shrink);
        // Tolerance: each path is within Higham's f32 bound of the exact answer (`Reference`),
        // so they are within twice that bound of each other; rows without adapter are checked
        // bit-for-bit against base by `assert_matches`.
        assert_matches(problem, &data, &expected, &wgsl, 1.0);
        let native = Reference {
            y: to_f64(&native),
            bound: expected.bound.clone(),
        };
        assert_matches(problem, &data, &native, &wgsl, 2.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(8), max_shrink_iters: 0, ..ProptestConfig::default() })]
        #[test]
        fn wgsl_matches_native_on_random_problems(problem in problems(), shrink in shrink_kernels()) {
            check(&problem, shrink);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(4), max_shrink_iters: 0, ..ProptestConfig::default() })]
        #[test]
        fn wgsl_f16_matches_float64(problem in problems(), shrink in shrink_kernels()) {
            if let Some(gpu) = device::gpu_for_tests().filter(device::f16_for_tests) {
                check_f16(&problem, &gpu, shrink);
            }
        }
    }

    /// Every shrink kernel the op launches.
    const SHRINKS: [ShrinkKernel; 3] = [
        ShrinkKernel::Split,
        ShrinkKernel::Wide,
        ShrinkKernel::Registers,
    ];

    /// The kernels `lora_apply` launches for `problem` with `shrink`.
    fn shaders_for(problem: &Problem, shrink: ShrinkKernel) -> Vec<LoraShader> {
        let out_total = problem.slices.iter().map(|&(width, _)| width).sum();
        let mut offset = 0;
        let mut shaders = vec![LoraShader::shrink(shrink, problem.in_features)];
        for &(width, rank) in &problem.slices {
            shaders.push(LoraShader::expand(rank, width, out_total, offset));
            offset += width;
        }
        shaders
    }

    /// Each kernel on the shapes where one goes wrong first, with every shrink kernel, in f32
    /// and f16. `timed` (time `split` and `wide`, check both against the composed op, run the
    /// pick) on the problems of a structure of their own; on the others, which differ from
    /// those only in rank or mix, it would run what `split` and `wide` are checked on, after
    /// autotuning Burn's matmuls for the composed op at each new shape (most of this test's
    /// time on a software GPU).
    #[test]
    fn wgsl_matches_native_on_edge_cases() {
        let qkv = |token_slots: Vec<i32>, slots, rank| Problem {
            in_features: 1280,
            slices: vec![(3840, rank)],
            slots,
            token_slots,
        };
        // (problem, whether `timed` runs on it too)
        let mut problems = Vec::new();
        // One row; every rank block size incl. ranks that are not multiples of 4; a rank above
        // one rank block (two expand passes, two shrink workgroups).
        for rank in [1, 3, 4, 7, 16, 33, 64] {
            problems.push((qkv(vec![0], 1, rank), rank == 33));
        }
        // All rows without adapter, one adapter, every row a different adapter.
        problems.push((qkv(vec![NO_SLOT; 300], 4, 16), false));
        problems.push((qkv(vec![2; 300], 4, 16), false));
        problems.push((qkv((0..300).map(|r| r % 17 - 1).collect(), 16, 16), true));
        // Three slices side by side (a q/k/v-style packed layer).
        let packed = Problem {
            in_features: 96,
            slices: vec![(64, 8), (96, 5), (64, 12)],
            slots: 3,
            token_slots: (0..77).map(|r| r % 4 - 1).collect(),
        };
        problems.push((packed, true));
        // An odd input width, and slices at an odd offset in an odd-width output.
        let odd_input = Problem {
            in_features: 1177,
            slices: vec![(3840, 16)],
            slots: 4,
            token_slots: (0..100).map(|r| r % 5 - 1).collect(),
        };
        problems.push((odd_input, true));
        let odd_offset = Problem {
            in_features: 96,
            slices: vec![(37, 8), (64, 16)],
            slots: 2,
            token_slots: (0..50).map(|r| r % 3 - 1).collect(),
        };
        problems.push((odd_offset, true));

        let launched: Vec<LoraShader> = problems
            .iter()
            .flat_map(|(p, _)| SHRINKS.iter().flat_map(|&s| shaders_for(p, s)))
            .collect();
        for shader in LoraShader::ALL {
            assert!(launched.contains(&shader), "no edge case runs {shader:?}");
        }
        // The same in f16 where the device has it: the f16 kernels are other shaders.
        let f16 = device::gpu_for_tests().filter(device::f16_for_tests);
        for (problem, timed) in &problems {
            let timed = timed.then_some(ShrinkKernel::Timed);
            for shrink in SHRINKS.into_iter().chain(timed) {
                check(problem, shrink);
                if let Some(gpu) = &f16 {
                    check_f16(problem, gpu, shrink);
                }
            }
        }
    }

    /// More tiles than one dispatch dimension takes run in several launches, each from its
    /// own first tile: the rows of the second launch get their deltas too.
    #[test]
    fn tiles_beyond_one_dispatch_run_in_several_launches() {
        let rows =
            crate::runtime::wgsl::MAX_WORKGROUPS_PER_DIM as usize * TILE_ROWS + 5 * TILE_ROWS + 3;
        // Two slots, so the second launch starts inside the second slot's segment.
        let token_slots: Vec<i32> = (0..rows).map(|r| i32::from(r >= rows / 3)).collect();
        let tiles = KernelMeta::from_token_slots(token_slots.clone(), 2)
            .unwrap()
            .tiles(TILE)
            .count();
        assert!(
            tiles > crate::runtime::wgsl::MAX_WORKGROUPS_PER_DIM as usize,
            "{tiles} tiles"
        );
        let problem = Problem {
            in_features: 4,
            slices: vec![(4, 1)],
            slots: 2,
            token_slots,
        };
        for shrink in SHRINKS {
            check(&problem, shrink);
        }
    }

    #[test]
    fn base_shared_elsewhere_is_not_modified() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let problem = Problem {
            in_features: 64,
            slices: vec![(64, 4)],
            slots: 1,
            token_slots: vec![0; 20],
        };
        let data = problem.data(&gpu);
        let before = data.base.clone().into_data();
        // `timed` runs the op on the base's clones while it times.
        for shrink in [ShrinkKernel::Auto, ShrinkKernel::Timed] {
            let batch = LoraBatch::with_shrink(problem.meta(), &gpu, shrink);
            let _ = lora_apply(data.x.clone(), data.base.clone(), &data.slices, &batch).unwrap();
            data.base.clone().into_data().assert_eq(&before, true);
        }
    }

    /// `linear_lora` with our linear `shader` against float64 (with `apart`, the same op run
    /// apart, `FusedLinear::apart`): the product's f32 sums within Higham's bound
    /// γ(in + 1) · (Σ|x·w| + |b|) (twice `u` for tensor cores, which may truncate), the LoRA
    /// delta within [`reference`]'s, and the one rounding of the output to `dtype` (apart, two:
    /// the product's and the sum's); rows without an adapter equal the product of the same
    /// kernel without the epilogue.
    fn check_fused(
        gpu: &device::RuntimeDevice,
        shader: LinearShader,
        shape: [usize; 3],
        lora: (usize, usize),
        dtype: DType,
        apart: bool,
    ) {
        let [rows, in_features, out_features] = shape;
        let (problem, data, weight_t, bias) = fused_layer(shape, lora, dtype);
        let delta = reference(&problem, &data);
        let (x, w, b) = (to_f64(&data.x), to_f64(&weight_t), to_f64(&bias));
        let truncating = matches!(shader, LinearShader::Coop(_));
        let u = if truncating { 2.0 * U } else { U };
        let gamma = (in_features + 1) as f64 * u / (1.0 - (in_features + 1) as f64 * u);
        let rounding = if dtype == DType::F16 { U16 } else { U };

        let on = data.to_device(gpu).cast(dtype);
        let (weight_t, bias) = (
            weight_t.to_device(&gpu.device).cast(dtype),
            bias.to_device(&gpu.device).cast(dtype),
        );
        let batch = LoraBatch::new(problem.meta(), gpu);
        let fused = fuse(&on.x, &weight_t, &bias, &on.slices[0], &batch, shader)
            .unwrap()
            .expect("the shader takes the product");
        let fused = match apart {
            true => fused.apart(on.x.clone()),
            false => fused.run(on.x.clone()),
        };
        let fused = to_f64(&fused.cast(DType::F32));
        let plain: Tensor<2> = Tensor::from_dispatch(<Dispatch as LinearBackend>::linear_wgsl(
            on.x.into_dispatch(),
            weight_t.into_dispatch(),
            bias.into_dispatch(),
            shader,
        ));
        let plain = to_f64(&plain.cast(DType::F32));
        for row in 0..rows {
            let xr = &x[row * in_features..(row + 1) * in_features];
            for o in 0..out_features {
                let i = row * out_features + o;
                let at = || {
                    format!(
                        "{shader:?}{} {rows}×{in_features}→{out_features}, rank {}, {dtype:?}: y[{row}, {o}]",
                        if apart { " apart" } else { "" },
                        lora.1
                    )
                };
                if problem.token_slots[row] == NO_SLOT {
                    assert_eq!(fused[i], plain[i], "{}: a row without an adapter", at());
                    continue;
                }
                let terms = xr
                    .iter()
                    .enumerate()
                    .map(|(k, x)| x * w[k * out_features + o]);
                let product = terms.clone().sum::<f64>() + b[o];
                let magnitude = terms.map(f64::abs).sum::<f64>() + b[o].abs();
                let expected = product + delta.y[i];
                // `reference` bounds the delta's sums and its own rounding; the output's is
                // rounding's, and apart the product's too.
                let roundings = match apart {
                    true => rounding * (expected.abs() + (product.abs() + gamma * magnitude)),
                    false => rounding * expected.abs(),
                };
                let bound = gamma * magnitude + delta.bound[i] + roundings;
                assert!(
                    (fused[i] - expected).abs() <= bound,
                    "{}: {} vs {expected} (bound {bound:e})",
                    at(),
                    fused[i]
                );
            }
        }
    }

    /// Each of our linear shaders with a LoRA epilogue, in f32 and f16 (the coop ones: f16
    /// alone; emulated on devices without cooperative matrices, as on lavapipe): rows past one
    /// block and columns past one block of each, ranks of one and several `vec4`s, and a shape
    /// of Qwen2-VL-2B's `attn.qkv`.
    #[test]
    fn fused_linear_lora_matches_float64() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let mut shaders = vec![LinearShader::Tiled];
        for tiling in CoopTiling::ALL {
            shaders.push(LinearShader::CoopEmulated(tiling));
            if linear::coop_for_tests(&gpu, tiling).is_some() {
                shaders.push(LinearShader::Coop(tiling));
            }
        }
        let f16 = device::f16_for_tests(&gpu);
        for shader in shaders {
            // A shader the device cannot run falls back to the unfused op: nothing checked.
            assert!(
                linear::runs_for_tests(shader, &gpu),
                "{} runs {shader:?}",
                gpu.description
            );
            let coop = shader != LinearShader::Tiled;
            let dtypes = match (coop, f16) {
                (false, true) => &[DType::F32, DType::F16][..],
                (false, false) => &[DType::F32][..],
                (true, true) => &[DType::F16][..],
                (true, false) => &[][..],
            };
            for &dtype in dtypes {
                for lora in [(3, 4), (5, 16)] {
                    check_fused(&gpu, shader, [133, 96, 272], lora, dtype, false);
                }
                check_fused(&gpu, shader, [20, 1280, 3840], (8, 16), dtype, false);
                // What the fusion is timed against (`fusion`), once per dtype.
                if shader == LinearShader::Tiled {
                    check_fused(&gpu, shader, [133, 96, 272], (5, 16), dtype, true);
                }
            }
        }
    }

    /// What `linear_lora` leaves to the caller: a rank that is not a multiple of 4, no row
    /// with an adapter, a shader without the epilogue; and what it refuses.
    #[test]
    fn fused_linear_lora_declines_what_it_does_not_fit() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let run = |shader, lora: (usize, usize), token_slots: Vec<i32>, out_features: usize| {
            let (mut problem, data, weight_t, bias) = fused_layer([20, 16, 32], lora, DType::F32);
            problem.token_slots = token_slots;
            let on = data.to_device(&gpu);
            let batch = LoraBatch::new(problem.meta(), &gpu);
            let columns = 0..out_features;
            let weight_t = weight_t
                .slice(s![.., columns.clone()])
                .to_device(&gpu.device);
            let bias = bias.slice(s![columns]).to_device(&gpu.device);
            linear_lora(on.x, &weight_t, &bias, &on.slices[0], &batch, shader)
        };
        let tiled = LinearShader::Tiled;
        let some_rows = || (0..20).map(|r| r % 3 - 1).collect::<Vec<i32>>();
        assert!(run(tiled, (2, 6), some_rows(), 32).is_none(), "rank 6");
        assert!(
            run(tiled, (2, 4), vec![NO_SLOT; 20], 32).is_none(),
            "no adapter row"
        );
        let registers = LinearShader::Registers;
        assert!(
            run(registers, (2, 4), some_rows(), 32).is_none(),
            "linear.wgsl"
        );
        assert!(
            matches!(
                run(tiled, (2, 4), some_rows(), 28),
                Some(Err(LoraOpError::Shape {
                    tensor: "lora_b",
                    ..
                }))
            ),
            "B wider than the product"
        );
        assert!(run(tiled, (2, 4), some_rows(), 32).is_some_and(|y| y.is_ok()));
    }

    /// Every shader parses and validates with naga, in every specialisation the runtime uses,
    /// and translates to SPIR-V, MSL and HLSL; no file under `shaders/lora/` goes unchecked.
    #[test]
    fn shaders_validate_and_translate_to_every_backend() {
        for file in shader_files("lora") {
            assert!(
                LoraShader::ALL.iter().any(|s| s.file_name() == file),
                "shaders/lora/{file} is not a kernel the runtime knows, so it is never checked"
            );
        }
        for shader in LoraShader::ALL {
            for (rank_tile, elem) in rank_tiles().flat_map(|t| Elem::ALL.map(|e| (t, e))) {
                for threads in [WORKGROUP, WIDE_WORKGROUP] {
                    let what = format!(
                        "{} (rank tile {rank_tile}, {elem:?}, {threads} threads)",
                        shader.file_name()
                    );
                    validate_and_translate(&shader.render(rank_tile, elem, threads), &what);
                }
            }
        }
    }
}
