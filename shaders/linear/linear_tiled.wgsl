// Linear, tiled for hardware GPUs: y[row, col] = sum_k x[row, k] * weight_t[k, col] + bias[col]
//     (+ the row's LoRA delta where linear_lora.wgsl is pasted in)
//
// One workgroup per block of TILE_ROWS rows and TILE_COLUMNS columns (TILE_COLUMNS4 vec4s). The
// k loop walks DEPTH columns of x (rows of weight_t) at a time: the workgroup copies that slice
// of both into workgroup memory, x transposed, each thread copying one vec4 of each; then every
// thread multiplies its own 8 × 8 cell of the block out of it. The loads for the next slice are
// issued before the products of this one, so their latency hides behind the arithmetic.
//
// The threads form a 16 × 16 grid (tx, ty). Thread (tx, ty) owns rows 4·ty .. 4·ty + 3 of each
// half of the block's rows and vec4 column tx of each half of its columns: four 4 × 4 cells,
// one mat4x4 of sums each (column r of the matrix is row r of the cell). Neighbouring threads
// read neighbouring vec4s of workgroup memory, and store neighbouring vec4s of y.
//
// Rows and columns past the last are clamped to it: read and summed, never stored. Columns of x
// past in_features read as zero. Every width is a multiple of 4. ELEM is the element type of x,
// weight_t, bias and y (f32, or f16 where the device has SHADER_F16); workgroup memory and sums
// are f32.
{{ enable }}

@group(0) @binding(0) var<storage, read_write> x: array<vec4<ELEM>>;        // [rows, in / 4]
@group(0) @binding(1) var<storage, read_write> weight_t: array<vec4<ELEM>>; // [in, out / 4]
@group(0) @binding(2) var<storage, read_write> bias: array<vec4<ELEM>>;     // [out / 4]
@group(0) @binding(3) var<storage, read_write> y: array<vec4<ELEM>>;        // [rows, out / 4]

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

alias ELEM = {{ elem }};

const WORKGROUP: u32 = {{ workgroup }}u; // 16 × 16 threads
const TILE_ROWS: u32 = {{ tile_rows }}u; // 2 halves of 16 × 4 rows
const TILE_COLUMNS4: u32 = {{ tile_columns4 }}u; // 2 halves of 16 vec4 columns
const DEPTH: u32 = {{ depth }}u; // columns of x per slice: TILE_ROWS · DEPTH / 4 = WORKGROUP

const HALF_ROWS4: u32 = TILE_ROWS / 8u; // vec4s of rows in half the block
const HALF_COLUMNS4: u32 = TILE_COLUMNS4 / 2u;

// The slice of x, transposed: x_tile[k * TILE_ROWS / 4 + m / 4][m % 4] = x[row m, column k].
var<workgroup> x_tile: array<vec4<f32>, DEPTH * TILE_ROWS / 4u>;
// The slice of weight_t: w_tile[k * TILE_COLUMNS4 + n] = weight_t[row k, vec4 column n].
var<workgroup> w_tile: array<vec4<f32>, DEPTH * TILE_COLUMNS4>;

// sums + the outer product of four rows' values `xs` and four columns' values `ws`.
fn outer_add(sums: mat4x4<f32>, xs: vec4<f32>, ws: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(
        fma(ws, vec4<f32>(xs.x), sums[0]),
        fma(ws, vec4<f32>(xs.y), sums[1]),
        fma(ws, vec4<f32>(xs.z), sums[2]),
        fma(ws, vec4<f32>(xs.w), sums[3]),
    );
}

// This thread's vec4 of x for the slice from column k0: row m = lid / 2 of the block, columns
// k0 + 4 · (lid % 2) ..; zero past in_features.
fn load_x(row0: u32, k0: u32, lid: u32, in4: u32) -> vec4<f32> {
    let row = min(row0 + lid / 2u, params.rows - 1u);
    let k4 = k0 / 4u + lid % 2u;
    return select(vec4<f32>(), vec4<f32>(x[row * in4 + min(k4, in4 - 1u)]), k4 < in4);
}

// This thread's vec4 of weight_t for the slice from row k0: row k0 + lid / TILE_COLUMNS4, vec4
// column lid % TILE_COLUMNS4 of the block; zero past in_features.
fn load_w(column0: u32, k0: u32, lid: u32, out4: u32) -> vec4<f32> {
    let k = k0 + lid / TILE_COLUMNS4;
    let column = min(column0 + lid % TILE_COLUMNS4, out4 - 1u);
    let at = min(k, params.in_features - 1u) * out4 + column;
    return select(vec4<f32>(), vec4<f32>(weight_t[at]), k < params.in_features);
}

// Stores row `row` of a cell, plus the bias, where the row and column exist.
fn store(row: u32, column: u32, out4: u32, sums: vec4<f32>) {
    if (row < params.rows && column < out4) {
        y[row * out4 + column] = vec4<ELEM>(sums + vec4<f32>(bias[column]));
    }
}

// Stores the 4 × 4 cell `sums` whose first row is `row` and whose vec4 column is `column`, with
// its rows' LoRA deltas.
fn store_cell(row: u32, column: u32, out4: u32, sums: mat4x4<f32>) {
    let with_deltas = sums + lora_deltas(row, column, out4);
    store(row, column, out4, with_deltas[0]);
    store(row + 1u, column, out4, with_deltas[1]);
    store(row + 2u, column, out4, with_deltas[2]);
    store(row + 3u, column, out4, with_deltas[3]);
}

@compute @workgroup_size(WORKGROUP)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let in4 = params.in_features / 4u;
    let out4 = params.out_features / 4u;
    let row0 = params.first_row + workgroup.y * TILE_ROWS;
    let column0 = workgroup.x * TILE_COLUMNS4;
    let tx = lid % HALF_COLUMNS4;
    let ty = lid / HALF_COLUMNS4;

    // Where this thread's copy of x goes, transposed: four columns of row m.
    let m = lid / 2u;
    let x_at = (lid % 2u) * 4u * (TILE_ROWS / 4u) + m / 4u;

    // Sums of the cells: rows in the first (a) or second (b) half, columns likewise.
    var sums_aa = mat4x4<f32>();
    var sums_ab = mat4x4<f32>();
    var sums_ba = mat4x4<f32>();
    var sums_bb = mat4x4<f32>();

    var x_next = load_x(row0, 0u, lid, in4);
    var w_next = load_w(column0, 0u, lid, out4);
    for (var k0 = 0u; k0 < params.in_features; k0 += DEPTH) {
        workgroupBarrier(); // every thread is done with the previous slice
        for (var j = 0u; j < 4u; j++) {
            x_tile[x_at + j * (TILE_ROWS / 4u)][m % 4u] = x_next[j];
        }
        w_tile[lid] = w_next;
        workgroupBarrier();

        if (k0 + DEPTH < params.in_features) {
            x_next = load_x(row0, k0 + DEPTH, lid, in4);
            w_next = load_w(column0, k0 + DEPTH, lid, out4);
        }
        for (var k = 0u; k < DEPTH; k++) {
            let xa = x_tile[k * (TILE_ROWS / 4u) + ty];
            let xb = x_tile[k * (TILE_ROWS / 4u) + HALF_ROWS4 + ty];
            let wa = w_tile[k * TILE_COLUMNS4 + tx];
            let wb = w_tile[k * TILE_COLUMNS4 + HALF_COLUMNS4 + tx];
            sums_aa = outer_add(sums_aa, xa, wa);
            sums_ab = outer_add(sums_ab, xa, wb);
            sums_ba = outer_add(sums_ba, xb, wa);
            sums_bb = outer_add(sums_bb, xb, wb);
        }
    }

    let row_a = row0 + 4u * ty;
    let row_b = row_a + 4u * HALF_ROWS4;
    let column_a = column0 + tx;
    let column_b = column_a + HALF_COLUMNS4;
    store_cell(row_a, column_a, out4, sums_aa);
    store_cell(row_a, column_b, out4, sums_ab);
    store_cell(row_b, column_a, out4, sums_ba);
    store_cell(row_b, column_b, out4, sums_bb);
}
