// Linear: y[row, col] = sum_k x[row, k] * weight_t[k, col] + bias[col]
//
// One workgroup per block of ROWS rows and WORKGROUP * COLUMNS vec4 columns. Each thread owns
// every row of the block and COLUMNS vec4 columns, WORKGROUP apart (neighbouring threads read
// neighbouring vec4s of weight_t). Each step of the k loop reads four rows of weight_t at each
// of the thread's columns and one vec4 of x per row, and adds 16 products per row and column.
//
// This is built for llvmpipe (lavapipe), where every load from a storage buffer is a loop over
// the SIMD lanes, and the loads, not the arithmetic, set the speed: a weight load feeds
// ROWS * 4 multiply-adds and an x load COLUMNS * 16. ROWS = 64, COLUMNS = 2 and WORKGROUP = 32
// were the fastest of the shapes measured (BENCHMARKS.md). The statements per row and column
// are written out by the runtime ({{ ... }} below), one variable each: llvmpipe keeps arrays
// indexed in loops in memory, which costs more than the loads they save.
//
// Rows and columns past the last are clamped to it: read and summed, never stored. Every width
// is a multiple of 4. ELEM is the element type of x, weight_t, bias and y (f32, or f16 where the
// device has SHADER_F16); sums are f32.
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
}
@group(0) @binding(4) var<uniform> params: Params;

alias ELEM = {{ elem }};

const WORKGROUP: u32 = {{ workgroup }}u;
const ROWS: u32 = {{ rows }}u;
const COLUMNS: u32 = {{ columns }}u;

// Four rows of weight_t from `at` on, one per column of the matrix.
fn weights(at: u32, out4: u32) -> mat4x4<f32> {
    return mat4x4<f32>(
        vec4<f32>(weight_t[at]),
        vec4<f32>(weight_t[at + out4]),
        vec4<f32>(weight_t[at + 2u * out4]),
        vec4<f32>(weight_t[at + 3u * out4]),
    );
}

// Column c of the thread: its index in vec4s (may be past the last).
fn column(workgroup: u32, lid: u32, c: u32) -> u32 {
    return (workgroup * COLUMNS + c) * WORKGROUP + lid;
}

@compute @workgroup_size(WORKGROUP)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let in4 = params.in_features / 4u;
    let out4 = params.out_features / 4u;
    let row0 = params.first_row + workgroup.y * ROWS;

    // Per column c: col_c, clamped. Per row r: x_r, where the row starts in x, clamped.
    // Per row and column: sum_r_c.
{{ setup }}

    for (var k4 = 0u; k4 < in4; k4++) {
        // w_c: rows 4·k4 .. 4·k4 + 3 of weight_t at column c.
{{ load_weights }}
        // Row r's four values of x, times w_c, into sum_r_c.
{{ accumulate }}
    }

    // Each sum plus the bias, where its row and column exist.
{{ store }}
}
