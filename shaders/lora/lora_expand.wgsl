// LoRA expand: output[row, offset + c] += sum_r shrunk[row, r] * lora_b[slot, c, r]
//
// One workgroup per (tile, block of 4 * WORKGROUP output columns); each thread adds to four
// adjacent columns of all the tile's TILE_ROWS rows. Rows with slot -1 are in no tile, so their
// output is never written and keeps the base value bit-for-bit. The tile's shrunk rows are staged
// through workgroup memory RANK_TILE ranks at a time; B is read straight from storage.
//
// This is the kernel for any widths; `lora_expand_vec4.wgsl` reads and writes four elements per
// access where the rank and the output's widths and offset are multiples of 4.
//
// ELEM is the element type of lora_b and output (f32, or f16 where the device has SHADER_F16);
// shrunk and the sums are f32, and each output is rounded to ELEM once, after its add.
{{ enable }}

@group(0) @binding(0) var<storage, read_write> shrunk: array<f32>;        // [rows, rank]
@group(0) @binding(1) var<storage, read_write> lora_b: array<ELEM>;       // [slots, out, rank]
@group(0) @binding(2) var<storage, read_write> sorted_tokens: array<i32>; // [rows]
@group(0) @binding(3) var<storage, read_write> tiles: array<i32>;         // [n_tiles, 4]: slot, start, len, 0
@group(0) @binding(4) var<storage, read_write> output: array<ELEM>;       // [rows, out_total]

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
const RANK_TILE: u32 = {{ rank_tile }}u;
const ROW_BLOCKS: u32 = TILE_ROWS / 4u;

// Staged transposed, rank by rank, so four rows are one vec4.
var<workgroup> t_tile: array<vec4<f32>, RANK_TILE * ROW_BLOCKS>;

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
    let rank = params.rank;
    let col = (workgroup.y * WORKGROUP + lid) * 4u;

    // The B rows of this thread's columns (clamped: columns past the end are computed, not stored).
    var b_row: array<u32, 4>;
    for (var c = 0u; c < 4u; c++) {
        b_row[c] = (slot * out_features + min(col + c, out_features - 1u)) * rank;
    }
    // acc[m] holds row m, columns col .. col + 4.
    var acc: array<vec4<f32>, TILE_ROWS>;

    for (var r0 = 0u; r0 < rank; r0 += RANK_TILE) {
        for (var i = lid; i < TILE_ROWS * RANK_TILE; i += WORKGROUP) {
            let m = i / RANK_TILE;
            let r = i % RANK_TILE;
            var value = 0.0;
            if (m < len && r0 + r < rank) {
                let token = u32(sorted_tokens[start + m]);
                value = shrunk[token * rank + r0 + r];
            }
            t_tile[r * ROW_BLOCKS + m / 4u][m % 4u] = value;
        }
        workgroupBarrier();
        for (var r = 0u; r < RANK_TILE; r++) {
            var bv = vec4<f32>(0.0);
            if (r0 + r < rank) {
                bv = vec4<f32>(
                    f32(lora_b[b_row[0] + r0 + r]),
                    f32(lora_b[b_row[1] + r0 + r]),
                    f32(lora_b[b_row[2] + r0 + r]),
                    f32(lora_b[b_row[3] + r0 + r]),
                );
            }
            for (var q = 0u; q < ROW_BLOCKS; q++) {
                let t = t_tile[r * ROW_BLOCKS + q];
                acc[4u * q] += t.x * bv;
                acc[4u * q + 1u] += t.y * bv;
                acc[4u * q + 2u] += t.z * bv;
                acc[4u * q + 3u] += t.w * bv;
            }
        }
        workgroupBarrier();
    }

    // Constant trip counts keep `acc` in registers (a dynamic index would spill it).
    for (var m = 0u; m < TILE_ROWS; m++) {
        if (m < len) {
            let token = u32(sorted_tokens[start + m]);
            let base = token * params.out_total + params.out_offset;
            for (var c = 0u; c < 4u; c++) {
                if (col + c < out_features) {
                    output[base + col + c] = ELEM(f32(output[base + col + c]) + acc[m][c]);
                }
            }
        }
    }
}
