// LoRA expand: output[row, offset + c] += sum_r shrunk[row, r] * lora_b[slot, c, r]
//
// This is `lora_expand.wgsl` for aligned shapes (rank, out_features, out_total and out_offset
// all multiples of 4): every load and store is a vec4, four ranks of shrunk or B, or four columns
// of output, so a thread does four times the multiply-adds per load (loads, not arithmetic,
// bound both kernels on llvmpipe, where each one is a loop over the SIMD lanes).
//
// One workgroup per (tile, block of COLUMNS * COLUMN_THREADS output columns); each thread adds
// to COLUMNS = 8 adjacent columns of TILE_ROWS / ROW_GROUPS of the tile's rows, reading shrunk
// and B straight from storage. ROW_GROUPS is 1 (64 threads, every row: the `split` and
// `registers` kernels) or 4 (256 threads, four rows each: `wide`, for more threads in flight and
// fewer sums held by each). Rows with slot -1 are in no tile, so their output is never written
// and keeps the base value bit-for-bit.
//
// ELEM is the element type of lora_b and output (f32, or f16 where the device has SHADER_F16);
// shrunk and the sums are f32, and each output is rounded to ELEM once, after its add.
{{ enable }}

@group(0) @binding(0) var<storage, read_write> shrunk: array<vec4<f32>>;  // [rows, rank / 4]
@group(0) @binding(1) var<storage, read_write> lora_b: array<vec4<ELEM>>; // [slots, out, rank / 4]
@group(0) @binding(2) var<storage, read_write> sorted_tokens: array<i32>; // [rows]
@group(0) @binding(3) var<storage, read_write> tiles: array<i32>;         // [n_tiles, 4]: slot, start, len, 0
@group(0) @binding(4) var<storage, read_write> output: array<vec4<ELEM>>; // [rows, out_total / 4]

struct Params {
    out_features: u32,
    rank: u32,
    out_total: u32,
    out_offset: u32,
    tile_base: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}
@group(0) @binding(5) var<uniform> params: Params;

alias ELEM = {{ elem }};

const WORKGROUP: u32 = {{ workgroup }}u;
const TILE_ROWS: u32 = {{ tile_rows }}u;
const COLUMNS: u32 = {{ columns }}u; // 8: two vec4s
const COLUMN_THREADS: u32 = {{ column_threads }}u; // threads across a workgroup's columns
const ROW_GROUPS: u32 = WORKGROUP / COLUMN_THREADS;
const ROWS: u32 = TILE_ROWS / ROW_GROUPS; // rows of the tile per thread

// Row `v` of shrunk against four rows of B: one sum per column.
fn dots(v: vec4<f32>, m0: vec4<f32>, m1: vec4<f32>, m2: vec4<f32>, m3: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(v, m0), dot(v, m1), dot(v, m2), dot(v, m3));
}

@compute @workgroup_size(WORKGROUP)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let tile = (params.tile_base + workgroup.x) * 4u;
    let slot = u32(tiles[tile]);
    let start = u32(tiles[tile + 1u]);
    let len = u32(tiles[tile + 2u]);
    let out_features = params.out_features;
    let rank4 = params.rank / 4u;
    let col = (workgroup.y * COLUMN_THREADS + lid % COLUMN_THREADS) * COLUMNS;
    let row0 = (lid / COLUMN_THREADS) * ROWS; // this thread's first row of the tile

    // Rows past the tile's end and columns past the slice's are clamped to valid ones: they are
    // read and summed, never stored.
    var token: array<u32, ROWS>;
    for (var m = 0u; m < ROWS; m++) {
        token[m] = u32(sorted_tokens[start + min(row0 + m, len - 1u)]);
    }
    var b_row: array<u32, COLUMNS>;
    for (var c = 0u; c < COLUMNS; c++) {
        b_row[c] = (slot * out_features + min(col + c, out_features - 1u)) * rank4;
    }
    // lo[m] and hi[m] hold row row0 + m, columns col .. +4 and col + 4 .. +4.
    var lo: array<vec4<f32>, ROWS>;
    var hi: array<vec4<f32>, ROWS>;
    for (var r = 0u; r < rank4; r++) {
        let b0 = vec4<f32>(lora_b[b_row[0] + r]);
        let b1 = vec4<f32>(lora_b[b_row[1] + r]);
        let b2 = vec4<f32>(lora_b[b_row[2] + r]);
        let b3 = vec4<f32>(lora_b[b_row[3] + r]);
        let b4 = vec4<f32>(lora_b[b_row[4] + r]);
        let b5 = vec4<f32>(lora_b[b_row[5] + r]);
        let b6 = vec4<f32>(lora_b[b_row[6] + r]);
        let b7 = vec4<f32>(lora_b[b_row[7] + r]);
        // Constant trip counts keep `lo` and `hi` in registers.
        for (var m = 0u; m < ROWS; m++) {
            let t = shrunk[token[m] * rank4 + r];
            lo[m] += dots(t, b0, b1, b2, b3);
            hi[m] += dots(t, b4, b5, b6, b7);
        }
    }

    for (var m = 0u; m < ROWS; m++) {
        if (row0 + m < len) {
            let o = (token[m] * params.out_total + params.out_offset + col) / 4u;
            if (col < out_features) {
                output[o] = vec4<ELEM>(vec4<f32>(output[o]) + lo[m]);
            }
            if (col + 4u < out_features) {
                output[o + 1u] = vec4<ELEM>(vec4<f32>(output[o + 1u]) + hi[m]);
            }
        }
    }
}
