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
// subgroup's cell.
fn store_staged(row0: u32, column0_4: u32, tile_row: u32, tile_column: u32, lid: u32, out4: u32) {
    for (var e = lid; e < SUBGROUPS * 64u; e += WORKGROUP) {
        let cell = e / 64u;
        let r = (e % 64u) / 4u;
        let c4 = e % 4u;
        let place_row = row0 + (cell / SUBGROUP_COLUMNS) * CELL_ROWS + tile_row;
        let place_column4 = column0_4 + ((cell % SUBGROUP_COLUMNS) * CELL_COLUMNS + tile_column) / 4u;
        let row = matrix_row(place_row) + r;
        let column4 = matrix_column4(place_column4, out4) + c4;
        let ours = row >= place_row && column4 >= place_column4;
        if (ours && row < params.rows && column4 < out4) {
            let at = cell * 256u + r * 16u + c4 * 4u;
            let sums = vec4<f32>(staged[at], staged[at + 1u], staged[at + 2u], staged[at + 3u]);
            let delta = lora_delta(row, column4, out4);
            y[row * out4 + column4] = vec4<f16>(sums + vec4<f32>(bias[column4]) + delta);
        }
    }
}
