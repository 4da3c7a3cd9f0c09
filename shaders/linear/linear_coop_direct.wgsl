// Linear on cooperative matrices (tensor cores) loaded straight from x and weight_t, f16 in and
// out, f32 sums:
//     y[row, col] = sum_k x[row, k] * weight_t[k, col] + bias[col]
//     (+ the row's LoRA delta where linear_lora.wgsl is pasted in)
//
// linear_coop.wgsl without workgroup memory in its k loop, and so without barriers there: one
// workgroup per block of TILE_ROWS × TILE_COLUMNS outputs, one cell of CELL_ROWS × CELL_COLUMNS
// per subgroup, SUBGROUP_COLUMNS cells across. A subgroup keeps its cell's sums as 16 × 16
// matrices of f32 and, 16 columns of k at a time, loads each 16 × 16 f16 matrix of x and of
// weight_t it needs from the buffers themselves (as vec4s, strides counted in vec4s) and
// multiplies them into its sums; the runtime writes these steps out, one variable per matrix.
// What the subgroups of a workgroup read in common comes from the caches.
//
// So that no load reaches past a buffer, a matrix that would run past the last row (or column)
// is moved back to end there: it sums rows (columns) that another matrix also sums, and stores
// only its own (linear_coop_store.wgsl, which also writes y). Hence the shapes it takes:
// in_features a multiple of 16 (no part of a step past it), and at least 16 rows and 16
// output columns. Every other width is a multiple of 4.
enable f16;
enable wgpu_cooperative_matrix;

@group(0) @binding(0) var<storage, read_write> x: array<vec4<f16>>;        // [rows, in / 4]
@group(0) @binding(1) var<storage, read_write> weight_t: array<vec4<f16>>; // [in, out / 4]
@group(0) @binding(2) var<storage, read_write> bias: array<vec4<f16>>;     // [out / 4]
@group(0) @binding(3) var<storage, read_write> y: array<vec4<f16>>;        // [rows, out / 4]

struct Params {
    rows: u32,
    in_features: u32,
    out_features: u32,
    first_row: u32, // of this launch: one launch has at most 65535 blocks of rows
    lora_rank: u32, // read by the LoRA epilogue alone
}
@group(0) @binding({{ params_binding }}) var<uniform> params: Params;

// Each row's LoRA delta (linear_lora.wgsl), or none.
{{ lora }}

alias ELEM = {{ elem }}; // f16

const WORKGROUP: u32 = {{ workgroup }}u;
const SUBGROUPS: u32 = {{ subgroups }}u; // WORKGROUP / the device's one subgroup size
const SUBGROUP_COLUMNS: u32 = {{ subgroup_columns }}u; // cells across the block
const TILE_ROWS: u32 = {{ tile_rows }}u;
const TILE_COLUMNS: u32 = {{ tile_columns }}u;

const CELL_ROWS: u32 = TILE_ROWS / (SUBGROUPS / SUBGROUP_COLUMNS);
const CELL_COLUMNS: u32 = TILE_COLUMNS / SUBGROUP_COLUMNS;

// The first row of the matrix at `row` of the block: moved back to end at the last row.
fn matrix_row(row: u32) -> u32 {
    return min(row, params.rows - 16u);
}

// The first vec4 column of the matrix at vec4 column `column4`: moved back to end at the last.
fn matrix_column4(column4: u32, out4: u32) -> u32 {
    return min(column4, out4 - 4u);
}

{{ store_staged }}

@compute @workgroup_size(WORKGROUP)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) subgroup: u32,
) {
    let in4 = params.in_features / 4u;
    let out4 = params.out_features / 4u;
    let row0 = params.first_row + workgroup.y * TILE_ROWS;
    let column0_4 = workgroup.x * (TILE_COLUMNS / 4u);
    // This subgroup's cell of the block, and its staging area.
    let cell_row = (subgroup / SUBGROUP_COLUMNS) * CELL_ROWS;
    let cell_column = (subgroup % SUBGROUP_COLUMNS) * CELL_COLUMNS;
    let staged_at = subgroup * 256u;
    let staged_stride = 16u;

{{ declare }}
    for (var k4 = 0u; k4 < in4; k4 += 4u) {
{{ multiply }}
    }

{{ store }}
}
