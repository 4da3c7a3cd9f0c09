// LoRA shrink: shrunk[row, r] = sum_k x[row, k] * lora_a[slot, r, k]
//
// One workgroup per (tile, rank block). A tile is up to TILE_ROWS rows that share one adapter
// slot, taken in slot-sorted order; rows with slot -1 are in no tile and are never touched.
// Threads: TILE_ROWS rows x 4 lanes; each thread sums RANK_TILE / 4 ranks of one row. x and A
// are staged through workgroup memory K_TILE columns at a time.

@group(0) @binding(0) var<storage, read_write> x: array<f32>;             // [rows, in]
@group(0) @binding(1) var<storage, read_write> lora_a: array<f32>;        // [slots, rank, in]
@group(0) @binding(2) var<storage, read_write> sorted_tokens: array<i32>; // [rows]
@group(0) @binding(3) var<storage, read_write> tiles: array<i32>;         // [n_tiles, 4]: slot, start, len, 0
@group(0) @binding(4) var<storage, read_write> shrunk: array<f32>;        // [rows, rank]

struct Params {
    in_features: u32,
    rank: u32,
    tile_base: u32,
    _pad: u32,
}
@group(0) @binding(5) var<uniform> params: Params;

const WORKGROUP: u32 = {{ workgroup }}u;
const TILE_ROWS: u32 = {{ tile_rows }}u;
const RANK_TILE: u32 = {{ rank_tile }}u;
const LANES: u32 = WORKGROUP / TILE_ROWS;
const RANKS_PER_THREAD: u32 = RANK_TILE / LANES;
const K_TILE: u32 = 32u;

var<workgroup> x_tile: array<f32, TILE_ROWS * K_TILE>;
var<workgroup> a_tile: array<f32, RANK_TILE * K_TILE>;

@compute @workgroup_size(WORKGROUP)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let tile = (params.tile_base + workgroup.x) * 4u;
    let slot = u32(tiles[tile]);
    let start = u32(tiles[tile + 1u]);
    let len = u32(tiles[tile + 2u]);
    let in_features = params.in_features;
    let rank = params.rank;
    let rank0 = workgroup.y * RANK_TILE;

    let row = lid / LANES;
    let lane = lid % LANES;
    var acc: array<f32, RANKS_PER_THREAD>;

    for (var k0 = 0u; k0 < in_features; k0 += K_TILE) {
        for (var i = lid; i < TILE_ROWS * K_TILE; i += WORKGROUP) {
            let r = i / K_TILE;
            let k = k0 + i % K_TILE;
            var value = 0.0;
            if (r < len && k < in_features) {
                let token = u32(sorted_tokens[start + r]);
                value = x[token * in_features + k];
            }
            x_tile[i] = value;
        }
        for (var i = lid; i < RANK_TILE * K_TILE; i += WORKGROUP) {
            let r = rank0 + i / K_TILE;
            let k = k0 + i % K_TILE;
            var value = 0.0;
            if (r < rank && k < in_features) {
                value = lora_a[(slot * rank + r) * in_features + k];
            }
            a_tile[i] = value;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < K_TILE; kk++) {
            let xv = x_tile[row * K_TILE + kk];
            for (var j = 0u; j < RANKS_PER_THREAD; j++) {
                acc[j] += xv * a_tile[(lane + LANES * j) * K_TILE + kk];
            }
        }
        workgroupBarrier();
    }

    if (row < len) {
        let token = u32(sorted_tokens[start + row]);
        for (var j = 0u; j < RANKS_PER_THREAD; j++) {
            let r = rank0 + lane + LANES * j;
            if (r < rank) {
                shrunk[token * rank + r] = acc[j];
            }
        }
    }
}
