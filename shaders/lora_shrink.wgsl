// LoRA shrink: shrunk[row, r] = sum_k x[row, k] * lora_a[slot, r, k]
//
// One workgroup per (tile, block of RANK_TILE ranks). A tile is up to TILE_ROWS rows that share
// one adapter slot, taken in slot-sorted order; rows with slot -1 are in no tile and are never
// touched. The tile's TILE_ROWS x RANK_TILE outputs are cut into 4x4 blocks; SPLIT threads share
// a block, each summing every SPLIT-th column of the staged K_TILE columns, and the partial sums
// are added up through workgroup memory at the end.
//
// ELEM is the element type of x and lora_a (f32, or f16 where the device has SHADER_F16); sums
// are f32 and shrunk is always f32.
{{ enable }}

@group(0) @binding(0) var<storage, read_write> x: array<ELEM>;            // [rows, in]
@group(0) @binding(1) var<storage, read_write> lora_a: array<ELEM>;       // [slots, rank, in]
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

alias ELEM = {{ elem }};

const WORKGROUP: u32 = {{ workgroup }}u;
const TILE_ROWS: u32 = {{ tile_rows }}u;
const RANK_TILE: u32 = {{ rank_tile }}u; // a power of two, 4..=32
const K_TILE: u32 = 32u;
const ROW_BLOCKS: u32 = TILE_ROWS / 4u;
const RANK_BLOCKS: u32 = RANK_TILE / 4u;
const BLOCKS: u32 = ROW_BLOCKS * RANK_BLOCKS;
const SPLIT: u32 = WORKGROUP / BLOCKS;

// Staged transposed, column by column, so four rows (or ranks) are one vec4.
var<workgroup> x_tile: array<vec4<f32>, K_TILE * ROW_BLOCKS>;
var<workgroup> a_tile: array<vec4<f32>, K_TILE * RANK_BLOCKS>;
var<workgroup> partial: array<vec4<f32>, WORKGROUP * 4u>;

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

    let block = lid % BLOCKS;
    let part = lid / BLOCKS;
    let row_block = block / RANK_BLOCKS;
    let rank_block = block % RANK_BLOCKS;
    // acc[i] holds row 4*row_block + i, ranks 4*rank_block .. +4.
    var acc: array<vec4<f32>, 4>;

    for (var k0 = 0u; k0 < in_features; k0 += K_TILE) {
        for (var i = lid; i < TILE_ROWS * K_TILE; i += WORKGROUP) {
            let r = i / K_TILE;
            let k = i % K_TILE;
            var value = 0.0;
            if (r < len && k0 + k < in_features) {
                let token = u32(sorted_tokens[start + r]);
                value = f32(x[token * in_features + k0 + k]);
            }
            x_tile[k * ROW_BLOCKS + r / 4u][r % 4u] = value;
        }
        for (var i = lid; i < RANK_TILE * K_TILE; i += WORKGROUP) {
            let r = i / K_TILE;
            let k = i % K_TILE;
            var value = 0.0;
            if (rank0 + r < rank && k0 + k < in_features) {
                value = f32(lora_a[(slot * rank + rank0 + r) * in_features + k0 + k]);
            }
            a_tile[k * RANK_BLOCKS + r / 4u][r % 4u] = value;
        }
        workgroupBarrier();
        for (var k = part; k < K_TILE; k += SPLIT) {
            let xv = x_tile[k * ROW_BLOCKS + row_block];
            let av = a_tile[k * RANK_BLOCKS + rank_block];
            acc[0] += xv.x * av;
            acc[1] += xv.y * av;
            acc[2] += xv.z * av;
            acc[3] += xv.w * av;
        }
        workgroupBarrier();
    }

    for (var i = 0u; i < 4u; i++) {
        partial[(part * BLOCKS + block) * 4u + i] = acc[i];
    }
    workgroupBarrier();
    for (var o = lid; o < TILE_ROWS * RANK_TILE; o += WORKGROUP) {
        let row = o / RANK_TILE;
        let r = o % RANK_TILE;
        let owner = (row / 4u) * RANK_BLOCKS + r / 4u;
        var sum = 0.0;
        for (var p = 0u; p < SPLIT; p++) {
            sum += partial[(p * BLOCKS + owner) * 4u + row % 4u][r % 4u];
        }
        if (row < len && rank0 + r < rank) {
            let token = u32(sorted_tokens[start + row]);
            shrunk[token * rank + rank0 + r] = sum;
        }
    }
}
