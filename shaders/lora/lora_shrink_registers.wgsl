// LoRA shrink for software rasterizers: shrunk[row, r] = sum_k x[row, k] * lora_a[slot, r, k]
//
// One workgroup of SPLIT threads per (tile, block of RANK_TILE ranks). A tile is up to TILE_ROWS
// rows that share one adapter slot, taken in slot-sorted order; rows with slot -1 are in no tile
// and are never touched. Every thread sums every row of the tile against every rank of the block,
// over every SPLIT-th group of LANES columns (split-K); the SPLIT partial sums of each output are
// added up through workgroup memory at the end.
//
// This is built for llvmpipe (lavapipe), where every load from a storage buffer is a loop over
// the SIMD lanes and the loads, not the arithmetic, set the speed: here a load of x feeds
// RANK_TILE * 4 multiply-adds and a load of A TILE_ROWS * 4 (in `lora_shrink.wgsl`, RANK_TILE
// * 4 and 16). The statements per row and block of four ranks are written out by the runtime
// ({{ ... }} below), one variable each, as in `linear.wgsl`: llvmpipe keeps arrays indexed in
// loops in memory. A hardware GPU would rather have `lora_shrink.wgsl`'s smaller threads.
//
// LANES is 4 where in_features is a multiple of 4 (every load a vec4 of neighbouring columns),
// else 1. ELEM is the element type of x and lora_a (f32, or f16 where the device has
// SHADER_F16); sums are f32 and shrunk is always f32.
{{ enable }}

@group(0) @binding(0) var<storage, read_write> x: array<LOAD>;            // [rows, in / LANES]
@group(0) @binding(1) var<storage, read_write> lora_a: array<LOAD>;       // [slots, rank, in / LANES]
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
// One load of x or A: LANES neighbouring columns (vec4<ELEM> or ELEM).
alias LOAD = {{ load }};
const LANES: u32 = {{ lanes }}u;

// A load as a vec4<f32>, zero-padded past its LANES columns.
fn widen(v: LOAD) -> vec4<f32> {
    return {{ widen }};
}

const SPLIT: u32 = {{ workgroup }}u;
const TILE_ROWS: u32 = {{ tile_rows }}u;
const RANK_TILE: u32 = {{ rank_tile }}u; // a power of two, 4..=32

// Every thread's sums of one block of four ranks, for every row of the tile.
var<workgroup> partial: array<vec4<f32>, SPLIT * TILE_ROWS>;

// Adds up row `m`'s sums for ranks `r0 .. r0 + 4` over the SPLIT threads and stores those that
// exist (rows within the tile's `len`, ranks below `rank`).
fn store(m: u32, r0: u32, start: u32, len: u32, rank: u32) {
    var sum = vec4<f32>();
    for (var p = 0u; p < SPLIT; p++) {
        sum += partial[p * TILE_ROWS + m];
    }
    if (m < len) {
        let row = u32(sorted_tokens[start + m]) * rank;
        for (var j = 0u; j < 4u; j++) {
            if (r0 + j < rank) {
                shrunk[row + r0 + j] = sum[j];
            }
        }
    }
}

@compute @workgroup_size(SPLIT)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let tile = (params.tile_base + workgroup.x) * 4u;
    let slot = u32(tiles[tile]);
    let start = u32(tiles[tile + 1u]);
    let len = u32(tiles[tile + 2u]);
    let width = params.in_features / LANES;
    let rank = params.rank;
    let rank0 = workgroup.y * RANK_TILE;

    // Per row m of the tile: x_m, where it starts in x. Per rank j of the block: a_j, where its
    // row of A starts. Rows past the tile's end and ranks past the adapter's are clamped to valid
    // ones: read and summed, never stored. Per row m and block q of four ranks: sum_m_q.
{{ setup }}

    for (var k = lid; k < width; k += SPLIT) {
        // m_q: ranks 4q .. 4q + 3 of the block at these columns, one per matrix column.
{{ load_a }}
        // Row m's columns times each m_q (one dot product per rank) into sum_m_q.
{{ accumulate }}
    }

    // One block of four ranks at a time: every thread's sums meet in workgroup memory, and
    // thread t adds up and stores rows t, t + SPLIT, ….
{{ reduce }}
}
