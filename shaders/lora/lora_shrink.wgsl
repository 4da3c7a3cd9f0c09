// LoRA shrink: shrunk[row, r] = sum_k x[row, k] * lora_a[slot, r, k]
//
// One workgroup per (tile, block of RANK_TILE ranks). A tile is up to TILE_ROWS rows that share
// one adapter slot, taken in slot-sorted order; rows with slot -1 are in no tile and are never
// touched. Each thread owns four rows of the tile and all RANK_TILE ranks, and sums every
// SPLIT-th group of LANES columns of x (split-K: neighbouring threads read neighbouring groups);
// the SPLIT partial sums of each output are added up through workgroup memory at the end, by
// PARTS threads per output and then one.
//
// WORKGROUP is 64 (the `split` kernels: SPLIT = 16) or 256 (`wide`: SPLIT = 64, a quarter of
// the columns per thread, four times the loads in flight per tile).
//
// LANES is 4 where in_features is a multiple of 4 (every load a vec4 of neighbouring columns),
// else 1. Four columns per load is four times the multiply-adds per load: loads, not
// arithmetic, bound the kernel on llvmpipe, where each one is a loop over the SIMD lanes.
//
// ELEM is the element type of x and lora_a (f32, or f16 where the device has SHADER_F16); sums
// are f32 and shrunk is always f32.
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

const WORKGROUP: u32 = {{ workgroup }}u; // a multiple of OUTPUTS
const TILE_ROWS: u32 = {{ tile_rows }}u;
const RANK_TILE: u32 = {{ rank_tile }}u; // a power of two, 4..=32
const ROW_GROUPS: u32 = TILE_ROWS / 4u;
const SPLIT: u32 = WORKGROUP / ROW_GROUPS;
const RANK_BLOCKS: u32 = RANK_TILE / 4u;
const OUTPUTS: u32 = TILE_ROWS * 4u; // sums per block of four ranks
const PARTS: u32 = WORKGROUP / OUTPUTS; // threads that add up one output's partial sums
const SHARE: u32 = SPLIT / PARTS; // partial sums each of them adds

// Every thread's sums for one block of four ranks: four rows, one vec4 each; then each thread's
// share of one output's sums, in the first WORKGROUP (16 KiB at most: WebGPU's least limit).
var<workgroup> partial: array<vec4<f32>, WORKGROUP * 4u>;

// Row `v` of x against four rows of A: one sum per rank.
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
    let width = params.in_features / LANES;
    let rank = params.rank;
    let rank0 = workgroup.y * RANK_TILE;

    let group = lid / SPLIT;
    let part = lid % SPLIT;
    // Rows past the tile's end and ranks past the adapter's are clamped to valid ones: they are
    // read and summed, never stored.
    var x_row: array<u32, 4>;
    for (var i = 0u; i < 4u; i++) {
        x_row[i] = u32(sorted_tokens[start + min(4u * group + i, len - 1u)]) * width;
    }
    var a_row: array<u32, RANK_TILE>;
    for (var r = 0u; r < RANK_TILE; r++) {
        a_row[r] = (slot * rank + min(rank0 + r, rank - 1u)) * width;
    }
    // acc[i * RANK_BLOCKS + q] holds row 4 * group + i, ranks 4 * q .. +4.
    var acc: array<vec4<f32>, 4u * RANK_BLOCKS>;

    for (var k = part; k < width; k += SPLIT) {
        let x0 = widen(x[x_row[0] + k]);
        let x1 = widen(x[x_row[1] + k]);
        let x2 = widen(x[x_row[2] + k]);
        let x3 = widen(x[x_row[3] + k]);
        for (var q = 0u; q < RANK_BLOCKS; q++) {
            let a0 = widen(lora_a[a_row[4u * q] + k]);
            let a1 = widen(lora_a[a_row[4u * q + 1u] + k]);
            let a2 = widen(lora_a[a_row[4u * q + 2u] + k]);
            let a3 = widen(lora_a[a_row[4u * q + 3u] + k]);
            acc[q] += dots(x0, a0, a1, a2, a3);
            acc[RANK_BLOCKS + q] += dots(x1, a0, a1, a2, a3);
            acc[2u * RANK_BLOCKS + q] += dots(x2, a0, a1, a2, a3);
            acc[3u * RANK_BLOCKS + q] += dots(x3, a0, a1, a2, a3);
        }
    }

    // One block of four ranks at a time, threads (m, j, h) add up share h of row m, rank
    // 4 * q + j over the SPLIT threads of m's group; then thread (m, j) adds the PARTS shares.
    // Constant trip counts keep `acc` in registers.
    let m = (lid % OUTPUTS) / 4u;
    let j = lid % 4u;
    let h = lid / OUTPUTS;
    for (var q = 0u; q < RANK_BLOCKS; q++) {
        for (var i = 0u; i < 4u; i++) {
            partial[lid * 4u + i] = acc[i * RANK_BLOCKS + q];
        }
        workgroupBarrier();
        var share = 0.0;
        for (var p = h * SHARE; p < (h + 1u) * SHARE; p++) {
            share += partial[((m / 4u) * SPLIT + p) * 4u + m % 4u][j];
        }
        if (PARTS > 1u) {
            workgroupBarrier(); // every partial sum is read before the shares take their place
            partial[lid].x = share;
            workgroupBarrier();
        }
        let r = rank0 + 4u * q + j;
        if (lid < OUTPUTS && m < len && r < rank) {
            var sum = share; // thread (m, j)'s own share is part 0
            for (var part = 1u; part < PARTS; part++) {
                sum += partial[part * OUTPUTS + lid].x;
            }
            shrunk[u32(sorted_tokens[start + m]) * rank + r] = sum;
        }
        workgroupBarrier();
    }
}
