// Rotary embedding of one part (q or k) of a packed qkv, in f32, out of place: for j < half,
//     out[row, head, j]        = a · cos[row, j]        + (−b) · sin[row, j]
//     out[row, head, j + half] = b · cos[row, j + half] + a · sin[row, j + half]
// with a = x[row, part, head, j] and b = x[row, part, head, j + half]: rotate_half maps each
// head's halves (a, b) to (−b, a), and these are the composed form's products and sums.
//
// x: [rows, parts, heads, head_dim]; cos, sin: [rows, head_dim] in f32; out: [rows, heads,
// head_dim]. One thread per (row, head, j): workgroup.y picks the row, the workgroup's threads
// and workgroup.x cover a row's heads · half pairs, neighbouring threads neighbouring values.
// ELEM is the element type of x and out (f32, or f16 where the device has SHADER_F16): each
// value is widened to f32 and the result rounded to ELEM once, as transformers rotates f16
// q and k in f32.
{{ enable }}

@group(0) @binding(0) var<storage, read_write> x: array<ELEM>;
@group(0) @binding(1) var<storage, read_write> cos: array<f32>;
@group(0) @binding(2) var<storage, read_write> sin: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<ELEM>;

struct Params {
    heads: u32,
    head_dim: u32, // even
    parts: u32,
    part: u32,
    first_row: u32, // of this launch: rows beyond 65535 go in further launches
}
@group(0) @binding(4) var<uniform> params: Params;

alias ELEM = {{ elem }};

const WORKGROUP: u32 = {{ workgroup }}u;

@compute @workgroup_size(WORKGROUP)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let half = params.head_dim / 2u;
    let pair = workgroup.x * WORKGROUP + lid; // head · half + j
    if (pair >= params.heads * half) {
        return;
    }
    let row = params.first_row + workgroup.y;
    let head = pair / half;
    let j = pair % half;
    let x_at = ((row * params.parts + params.part) * params.heads + head) * params.head_dim + j;
    let out_at = (row * params.heads + head) * params.head_dim + j;
    let angle = row * params.head_dim + j;
    let a = f32(x[x_at]);
    let b = f32(x[x_at + half]);
    out[out_at] = ELEM(a * cos[angle] + -b * sin[angle]);
    out[out_at + half] = ELEM(b * cos[angle + half] + a * sin[angle + half]);
}
