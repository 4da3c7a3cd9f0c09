//! The linear kernels' WGSL, filled in: the templates' unrolled statements, the coop kernels'
//! layouts, and the LoRA epilogue pasted in (or left out).

use burn::backend::wgpu::{KernelSource, SourceTemplate};
use burn_cubecl::cubecl::prelude::KernelId;

use super::shader::{
    COLUMNS, COOP_COLUMNS, COOP_DEPTH, COOP_PAD, COOP_ROWS, CoopLayout, CoopTiling, LinearShader,
    MATRIX, ROWS, TILED_COLUMNS4, TILED_DEPTH, TILED_ROWS, TILED_WORKGROUP, WORKGROUP,
};
#[cfg(test)]
use super::tests;
use crate::ops::hardware;
use crate::runtime::wgsl::{self, Elem};

/// One of our linear shaders for one element type and subgroup size (read by `Coop` alone),
/// with or without the LoRA epilogue, made by [`LinearSource::new`] (which leaves it out) alone.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinearSource {
    pub(crate) shader: LinearShader,
    pub(crate) elem: Elem,
    pub(crate) subgroup: u32,
    /// Whether `shaders/linear/linear_lora.wgsl` is pasted in: each row's LoRA delta added as it is
    /// stored.
    pub(crate) lora: bool,
}

impl LinearSource {
    /// `shader` for `elem` at subgroups of `subgroup`, where it is written for them
    /// ([`LinearShader::render`]).
    pub(crate) fn new(shader: LinearShader, elem: Elem, subgroup: u32) -> Option<Self> {
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

/// `shaders/linear/linear.wgsl` (`wgsl`).
const REGISTERS: &str = include_str!("../../../shaders/linear/linear.wgsl");
/// `shaders/linear/linear_tiled.wgsl` (`tiled`).
const TILED: &str = include_str!("../../../shaders/linear/linear_tiled.wgsl");
/// `shaders/linear/linear_coop.wgsl` (`coop`, `coop-wide`).
const COOP: &str = include_str!("../../../shaders/linear/linear_coop.wgsl");
/// `shaders/linear/linear_coop_direct.wgsl` (`coop-direct`).
const COOP_DIRECT: &str = include_str!("../../../shaders/linear/linear_coop_direct.wgsl");
/// `shaders/linear/linear_coop_store.wgsl`, pasted into both coop templates.
const COOP_STORE: &str = include_str!("../../../shaders/linear/linear_coop_store.wgsl");
/// `shaders/linear/linear_lora.wgsl`, the LoRA epilogue.
const LORA_EPILOGUE: &str = include_str!("../../../shaders/linear/linear_lora.wgsl");

/// The files (path under `shaders/`, text) `shader`'s base product is made of, without the
/// LoRA epilogue.
pub(crate) fn files(shader: LinearShader) -> &'static [(&'static str, &'static str)] {
    match shader {
        LinearShader::Registers => &[("linear/linear.wgsl", REGISTERS)],
        LinearShader::Tiled => &[("linear/linear_tiled.wgsl", TILED)],
        LinearShader::Coop(CoopTiling::Narrow | CoopTiling::Wide) => &[
            ("linear/linear_coop.wgsl", COOP),
            ("linear/linear_coop_store.wgsl", COOP_STORE),
        ],
        LinearShader::Coop(CoopTiling::Direct) => &[
            ("linear/linear_coop_direct.wgsl", COOP_DIRECT),
            ("linear/linear_coop_store.wgsl", COOP_STORE),
        ],
        #[cfg(test)]
        LinearShader::CoopEmulated(tiling) => files(LinearShader::Coop(tiling)),
    }
}

/// What a shader is made of, in files: which of them passed on hardware, and (for the tests)
/// the source it renders to.
impl LinearShader {
    /// Whether every file this shader's base product is made of passed its tests on a
    /// hardware GPU as it is now (`ops/hardware.rs`): what `auto` may take there.
    pub fn hardware_checked(self) -> bool {
        files(self)
            .iter()
            .all(|(path, text)| hardware::checked(path, text))
    }

    /// The WGSL source for `elem` on a device whose subgroups have `subgroup` invocations
    /// (read by `Coop` alone), with the LoRA epilogue where `lora` says; `None` where the
    /// shader is not written for them (`Coop`: f16 alone, at the subgroup sizes its tiling lays
    /// out).
    #[cfg(test)]
    pub fn render(self, elem: Elem, subgroup: u32, lora: bool) -> Option<String> {
        LinearSource::new(self, elem, subgroup)
            .filter(|_| !lora || self.has_lora_epilogue())
            .map(|source| LinearSource { lora, ..source }.source().complete())
    }
}

impl KernelSource for LinearSource {
    fn source(&self) -> SourceTemplate {
        // The trailing uniform follows the buffers: four, and three more for the epilogue.
        let (lora, params_binding) = match self.lora {
            true => (LORA_EPILOGUE, 7),
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
                shared(SourceTemplate::new(REGISTERS))
                    .register("workgroup", WORKGROUP.to_string())
                    .register("rows", ROWS.to_string())
                    .register("columns", COLUMNS.to_string())
                    .register("setup", setup)
                    .register("load_weights", load_weights)
                    .register("accumulate", accumulate)
                    .register("store", store)
            }
            LinearShader::Tiled => shared(SourceTemplate::new(TILED))
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
pub(crate) const NO_LORA: &str = "const LORA_STORE_ROWS: u32 = 1u;

fn lora_deltas(row: u32, column4: u32, out4: u32) -> mat4x4<f32> {
    return mat4x4<f32>();
}";

/// The statements `shaders/linear/linear.wgsl` repeats for each of the [`ROWS`] rows and
/// [`COLUMNS`] columns, written out with a variable each: `{{ setup }}`, `{{ load_weights }}`,
/// `{{ accumulate }}` and `{{ store }}`.
pub(crate) fn unrolled() -> [String; 4] {
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

/// The coop kernel of `tiling` (`shaders/linear/linear_coop.wgsl`, or `linear_coop_direct.wgsl` in
/// `Direct`) with everything but its element type filled in, for subgroups of `subgroup`
/// invocations, a size [`CoopLayout`] lays out in it ([`LinearSource::new`] made sure).
pub(crate) fn coop_template(tiling: CoopTiling, subgroup: u32) -> SourceTemplate {
    let layout = CoopLayout::new(tiling, subgroup)
        .expect("LinearSource::new takes coop only at a subgroup size CoopLayout lays out");
    let [declare, multiply, store] = coop_unrolled(layout);
    let template = match tiling {
        CoopTiling::Narrow | CoopTiling::Wide => COOP,
        CoopTiling::Direct => COOP_DIRECT,
    };
    SourceTemplate::new(template)
        .register("store_staged", COOP_STORE)
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
pub(crate) fn coop_unrolled(layout: CoopLayout) -> [String; 3] {
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
