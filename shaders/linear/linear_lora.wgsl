// The LoRA epilogue of the linear kernels for hardware GPUs (linear_tiled.wgsl,
// linear_coop.wgsl, linear_coop_direct.wgsl), pasted into each where it says `lora` when the
// kernel adds each row's adapter delta as it stores the row:
//     y[row, col] += sum_r shrunk[row, r] * lora_b[slot of row, col, r]
//
// The shrink ran before, in a launch of its own (lora_shrink*.wgsl: shrunk[row] = x[row] ·
// A[slot]ᵀ, in f32). Adding the expand here, to sums still in registers, saves the expand's own
// launch and its pass over y (a read and a write of every output of an adapter row). Rows whose
// slot is -1 add nothing: their row of shrunk is never written, and is never read here. The
// delta is summed in f32 and added to the product's f32 sums along with the bias, so the output
// is rounded to ELEM once.
//
// Every width is a multiple of 4, the rank included. Params carries lora_rank. The kernels store
// four rows of a column at a time (linear_tiled.wgsl always, the coop store where this file is
// pasted in: LORA_STORE_ROWS) and take lora_deltas, which shares the loads of B between them.

@group(0) @binding(4) var<storage, read_write> shrunk: array<vec4<f32>>;  // [rows, rank / 4]
@group(0) @binding(5) var<storage, read_write> lora_b: array<vec4<ELEM>>; // [slots, out, rank / 4]
@group(0) @binding(6) var<storage, read_write> row_slots: array<i32>;     // [rows]

// Rows of one vec4 column that linear_coop_store.wgsl stores per thread: four, for lora_deltas.
const LORA_STORE_ROWS: u32 = 4u;

// Row `row`'s delta at vec4 column `column4` of y's `out4`: 4 · rank / 4 loads of B, rank / 4 of
// shrunk.
fn lora_delta(row: u32, column4: u32, out4: u32) -> vec4<f32> {
    let slot = row_slots[row];
    var delta = vec4<f32>();
    if (slot >= 0) {
        let rank4 = params.lora_rank / 4u;
        let t_at = row * rank4;
        // Where B's row of each of the four columns starts; B's rows are `rank4` vec4s long.
        let b_at = (u32(slot) * out4 + column4) * 4u * rank4;
        for (var r = 0u; r < rank4; r++) {
            let t = shrunk[t_at + r];
            delta += vec4<f32>(
                dot(t, vec4<f32>(lora_b[b_at + r])),
                dot(t, vec4<f32>(lora_b[b_at + rank4 + r])),
                dot(t, vec4<f32>(lora_b[b_at + 2u * rank4 + r])),
                dot(t, vec4<f32>(lora_b[b_at + 3u * rank4 + r])),
            );
        }
    }
    return delta;
}

// The deltas of rows `row` .. `row` + 3 (row `row` + i in column i of the matrix) at vec4 column
// `column4`: where the four rows have one adapter (rows of an image do), each load of B serves
// all four, which quarters them; else row by row. Rows past the last are clamped to it: summed,
// never stored.
fn lora_deltas(row: u32, column4: u32, out4: u32) -> mat4x4<f32> {
    var rows: array<u32, 4>;
    for (var i = 0u; i < 4u; i++) {
        rows[i] = min(row + i, params.rows - 1u);
    }
    let slot = row_slots[rows[0]];
    let one_slot = slot >= 0 && row_slots[rows[1]] == slot && row_slots[rows[2]] == slot
        && row_slots[rows[3]] == slot;
    if (!one_slot) {
        return mat4x4<f32>(
            lora_delta(rows[0], column4, out4),
            lora_delta(rows[1], column4, out4),
            lora_delta(rows[2], column4, out4),
            lora_delta(rows[3], column4, out4),
        );
    }
    let rank4 = params.lora_rank / 4u;
    let b_at = (u32(slot) * out4 + column4) * 4u * rank4;
    var deltas = mat4x4<f32>();
    for (var r = 0u; r < rank4; r++) {
        let b = mat4x4<f32>(
            vec4<f32>(lora_b[b_at + r]),
            vec4<f32>(lora_b[b_at + rank4 + r]),
            vec4<f32>(lora_b[b_at + 2u * rank4 + r]),
            vec4<f32>(lora_b[b_at + 3u * rank4 + r]),
        );
        // Row i's four sums: its vec4 of shrunk against the four columns' vec4s of B.
        for (var i = 0u; i < 4u; i++) {
            deltas[i] += shrunk[rows[i] * rank4 + r] * b;
        }
    }
    return deltas;
}
