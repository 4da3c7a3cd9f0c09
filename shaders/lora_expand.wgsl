// LoRA expand: output[row, offset + c] += sum_r shrunk[row, r] * lora_b[slot, c, r]
//
// One workgroup per (tile, block of WORKGROUP output columns); one thread per column, summing
// the tile's TILE_ROWS rows. Rows with slot -1 are in no tile, so their output is never
// written and keeps the base value bit-for-bit. The shrunk rows and B are staged through
// workgroup memory RANK_TILE ranks at a time.

@group(0) @binding(0) var<storage, read_write> shrunk: array<f32>;        // [rows, rank]
@group(0) @binding(1) var<storage, read_write> lora_b: array<f32>;        // [slots, out, rank]
@group(0) @binding(2) var<storage, read_write> sorted_tokens: array<i32>; // [rows]
@group(0) @binding(3) var<storage, read_write> tiles: array<i32>;         // [n_tiles, 4]: slot, start, len, 0
@group(0) @binding(4) var<storage, read_write> output: array<f32>;        // [rows, out_total]

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

const WORKGROUP: u32 = {{ workgroup }}u;
const TILE_ROWS: u32 = {{ tile_rows }}u;
const RANK_TILE: u32 = {{ rank_tile }}u;

var<workgroup> t_tile: array<f32, TILE_ROWS * RANK_TILE>;
var<workgroup> b_tile: array<f32, WORKGROUP * RANK_TILE>;

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
    let col0 = workgroup.y * WORKGROUP;

    var acc: array<f32, TILE_ROWS>;

    for (var r0 = 0u; r0 < rank; r0 += RANK_TILE) {
        for (var i = lid; i < TILE_ROWS * RANK_TILE; i += WORKGROUP) {
            let m = i / RANK_TILE;
            let r = r0 + i % RANK_TILE;
            var value = 0.0;
            if (m < len && r < rank) {
                let token = u32(sorted_tokens[start + m]);
                value = shrunk[token * rank + r];
            }
            t_tile[i] = value;
        }
        for (var i = lid; i < WORKGROUP * RANK_TILE; i += WORKGROUP) {
            let c = col0 + i / RANK_TILE;
            let r = r0 + i % RANK_TILE;
            var value = 0.0;
            if (c < out_features && r < rank) {
                value = lora_b[(slot * out_features + c) * rank + r];
            }
            b_tile[i] = value;
        }
        workgroupBarrier();
        for (var rr = 0u; rr < RANK_TILE; rr++) {
            let bv = b_tile[lid * RANK_TILE + rr];
            for (var m = 0u; m < TILE_ROWS; m++) {
                acc[m] += t_tile[m * RANK_TILE + rr] * bv;
            }
        }
        workgroupBarrier();
    }

    let col = col0 + lid;
    if (col < out_features) {
        for (var m = 0u; m < len; m++) {
            let token = u32(sorted_tokens[start + m]);
            let index = token * params.out_total + params.out_offset + col;
            output[index] = output[index] + acc[m];
        }
    }
}
