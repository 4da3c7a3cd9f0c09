// The end of both cooperative-matrix linears, linear_coop.wgsl and linear_coop_direct.wgsl,
// pasted into each where it says `store_staged`: each subgroup stores one of its matrices of
// sums at a time into its own 16 × 16 staging area, and the whole workgroup adds the bias (and
// each row's LoRA delta) and writes every subgroup's staged matrix to y as f16. Each kernel
// defines `matrix_row` and `matrix_column4`: where the matrix it summed for a place of its block
// starts (the place itself, or moved back to end at the last row or column); the values it holds
// before that place are another matrix's.

// One 16 × 16 matrix of sums per subgroup, row by row, on its way to y.
var<workgroup> staged: array<f32, SUBGROUPS * 256u>;

// Writes every subgroup's staged matrix, plus the bias and each row's LoRA delta, to y where
// the row and column exist: the one at rows `tile_row` and columns `tile_column` of each
// subgroup's cell. Each thread stores LORA_STORE_ROWS rows of one vec4 column at a time: four
// where the LoRA epilogue is pasted in, so that lora_deltas shares each load of B between them
// (rows of an image have one slot); one where it is not.
fn store_staged(row0: u32, column0_4: u32, tile_row: u32, tile_column: u32, lid: u32, out4: u32) {
    let row_groups = 16u / LORA_STORE_ROWS;
    for (var e = lid; e < SUBGROUPS * row_groups * 4u; e += WORKGROUP) {
        let cell = e / (row_groups * 4u);
        let r0 = ((e / 4u) % row_groups) * LORA_STORE_ROWS;
        let c4 = e % 4u;
        let place_row = row0 + (cell / SUBGROUP_COLUMNS) * CELL_ROWS + tile_row;
        let place_column4 = column0_4 + ((cell % SUBGROUP_COLUMNS) * CELL_COLUMNS + tile_column) / 4u;
        let first_row = matrix_row(place_row) + r0;
        let column4 = matrix_column4(place_column4, out4) + c4;
        if (column4 >= place_column4 && column4 < out4) {
            var deltas = lora_deltas(first_row, column4, out4);
            for (var i = 0u; i < LORA_STORE_ROWS; i++) {
                let row = first_row + i;
                if (row >= place_row && row < params.rows) {
                    let at = cell * 256u + (r0 + i) * 16u + c4 * 4u;
                    let sums = vec4<f32>(staged[at], staged[at + 1u], staged[at + 2u], staged[at + 3u]);
                    y[row * out4 + column4] = vec4<f16>(sums + vec4<f32>(bias[column4]) + deltas[i]);
                }
            }
        }
    }
}
