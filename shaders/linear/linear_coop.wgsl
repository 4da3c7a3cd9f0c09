// Linear on cooperative matrices (tensor cores), f16 in and out, f32 sums:
//     y[row, col] = sum_k x[row, k] * weight_t[k, col] + bias[col]
//     (+ the row's LoRA delta where linear_lora.wgsl is pasted in)
//
// One workgroup per block of TILE_ROWS × TILE_COLUMNS outputs. The k loop walks DEPTH columns of
// x (rows of weight_t) at a time: the workgroup copies that slice of both into workgroup memory,
// each thread LOADS vec4s of each, and the loads for the next slice are issued before the
// products of this one. The block is cut into one cell of CELL_ROWS × CELL_COLUMNS per subgroup,
// SUBGROUP_COLUMNS cells across. A subgroup keeps its cell's sums as 16 × 16 matrices of f32 and
// multiplies 16 × 16 f16 matrices of the slice into them, 16 columns of k at a time; the runtime
// writes these steps out, one variable per matrix.
//
// At the end each subgroup stores one of its matrices at a time into its own 16 × 16 staging
// area, and the whole workgroup adds the bias and writes every subgroup's staged matrix to y
// (linear_coop_store.wgsl). Every barrier and every cooperative operation is reached by every
// thread: the control flow around them depends on uniform values alone.
//
// Both slices are held in workgroup memory as vec4s of f16, as they are read: a thread stores
// each vec4 it loaded in one access, and the cooperative loads read vec4s too, their strides
// counted in vec4s (SPIR-V's cooperative loads take a pointer to a vector and count the stride
// in its elements).
//
// Rows and columns past the last are clamped to it: read and summed, never stored. Columns of x
// past in_features, and rows of weight_t past it, read as zero. Every width is a multiple of 4.
// The rows of both slices in workgroup memory are padded by PAD values (16 bytes), which keeps
// a matrix's rows off one bank and every cooperative load 16-byte aligned.
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
const DEPTH: u32 = {{ depth }}u;
const LOADS: u32 = {{ loads }}u; // vec4s of each slice per thread: TILE_ROWS · DEPTH / 4 / WORKGROUP
const PAD: u32 = {{ pad }}u; // values after each row of a slice in workgroup memory

const CELL_ROWS: u32 = TILE_ROWS / (SUBGROUPS / SUBGROUP_COLUMNS);
const CELL_COLUMNS: u32 = TILE_COLUMNS / SUBGROUP_COLUMNS;
const X_STRIDE4: u32 = (DEPTH + PAD) / 4u; // vec4s per row of the slice of x
const W_STRIDE4: u32 = (TILE_COLUMNS + PAD) / 4u; // vec4s per row of the slice of weight_t

// The slice of x: x_tile[m * X_STRIDE4 + k / 4][k % 4] = x[row m of the block, column k of the
// slice].
var<workgroup> x_tile: array<vec4<f16>, TILE_ROWS * X_STRIDE4>;
// The slice of weight_t: w_tile[k * W_STRIDE4 + n / 4][n % 4] = weight_t[row k of the slice,
// column n].
var<workgroup> w_tile: array<vec4<f16>, DEPTH * W_STRIDE4>;

// The `i`-th vec4 of the slice of x from column k0 (row i / (DEPTH / 4) of the block); zero
// past in_features.
fn load_x(row0: u32, k0: u32, i: u32, in4: u32) -> vec4<f16> {
    let row = min(row0 + i / (DEPTH / 4u), params.rows - 1u);
    let k4 = k0 / 4u + i % (DEPTH / 4u);
    return select(vec4<f16>(), x[row * in4 + min(k4, in4 - 1u)], k4 < in4);
}

// The `i`-th vec4 of the slice of weight_t from row k0 (row i / (TILE_COLUMNS / 4) of the
// slice); zero past in_features.
fn load_w(column0_4: u32, k0: u32, i: u32, out4: u32) -> vec4<f16> {
    let k = k0 + i / (TILE_COLUMNS / 4u);
    let column = min(column0_4 + i % (TILE_COLUMNS / 4u), out4 - 1u);
    let at = min(k, params.in_features - 1u) * out4 + column;
    return select(vec4<f16>(), weight_t[at], k < params.in_features);
}

fn put_x(i: u32, v: vec4<f16>) {
    x_tile[(i / (DEPTH / 4u)) * X_STRIDE4 + i % (DEPTH / 4u)] = v;
}

fn put_w(i: u32, v: vec4<f16>) {
    w_tile[(i / (TILE_COLUMNS / 4u)) * W_STRIDE4 + i % (TILE_COLUMNS / 4u)] = v;
}

// A matrix of sums starts at the row and vec4 column the block's layout gives it.
fn matrix_row(row: u32) -> u32 {
    return row;
}

fn matrix_column4(column4: u32, out4: u32) -> u32 {
    return column4;
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
    let x_stride = X_STRIDE4;
    let w_stride = W_STRIDE4;
    let staged_stride = 16u;

{{ declare }}
    var x_next: array<vec4<f16>, LOADS>;
    var w_next: array<vec4<f16>, LOADS>;
    for (var j = 0u; j < LOADS; j++) {
        x_next[j] = load_x(row0, 0u, lid + j * WORKGROUP, in4);
        w_next[j] = load_w(column0_4, 0u, lid + j * WORKGROUP, out4);
    }
    for (var k0 = 0u; k0 < params.in_features; k0 += DEPTH) {
        workgroupBarrier(); // every subgroup is done with the previous slice
        for (var j = 0u; j < LOADS; j++) {
            put_x(lid + j * WORKGROUP, x_next[j]);
            put_w(lid + j * WORKGROUP, w_next[j]);
        }
        workgroupBarrier();

        if (k0 + DEPTH < params.in_features) {
            for (var j = 0u; j < LOADS; j++) {
                x_next[j] = load_x(row0, k0 + DEPTH, lid + j * WORKGROUP, in4);
                w_next[j] = load_w(column0_4, k0 + DEPTH, lid + j * WORKGROUP, out4);
            }
        }
        for (var k = 0u; k < DEPTH; k += 16u) {
{{ multiply }}
        }
    }

{{ store }}
}
