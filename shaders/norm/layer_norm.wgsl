// Layer norm of each row, in f32 whatever ELEM:
//     y[row, c] = (x[row, c] − mean) / sqrt(var + epsilon) · weight[c] + bias[c]
// with mean and var (biased) over the row's width: Burn's composed layer_norm's operations in
// its order. x: [rows, width]; weight, bias: [width] in f32; y: [rows, width].
//
// One workgroup per row: workgroup.x picks it (rows beyond 65535 go in further launches). Each
// of the WORKGROUP threads takes every WORKGROUP-th vec4 of the row, neighbouring threads
// neighbouring vec4s, in three passes: the sum, the sum of squared deviations (each added up
// across the workgroup through workgroup memory), then the output. The first pass brings the
// row into cache for the other two, so the row is read from memory about once and written once.
// ELEM is the element type of x and y (f32, or f16 where the device has SHADER_F16): each value
// is widened to f32 and each output rounded to ELEM once, as PyTorch's autocast runs layer_norm.
// The width is a multiple of 4.
{{ enable }}

@group(0) @binding(0) var<storage, read_write> x: array<vec4<ELEM>>;     // [rows, width / 4]
@group(0) @binding(1) var<storage, read_write> weight: array<vec4<f32>>; // [width / 4]
@group(0) @binding(2) var<storage, read_write> bias: array<vec4<f32>>;   // [width / 4]
@group(0) @binding(3) var<storage, read_write> y: array<vec4<ELEM>>;     // [rows, width / 4]

struct Params {
    width: u32,
    first_row: u32, // of this launch
    epsilon: u32,   // the bits of an f32
}
@group(0) @binding(4) var<uniform> params: Params;

alias ELEM = {{ elem }};

const WORKGROUP: u32 = {{ workgroup }}u; // a power of two

var<workgroup> sums: array<f32, WORKGROUP>;

// The sum of every thread's `value`, for every thread: a tree through workgroup memory.
fn workgroup_sum(value: f32, lid: u32) -> f32 {
    sums[lid] = value;
    workgroupBarrier();
    for (var stride = WORKGROUP / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            sums[lid] += sums[lid + stride];
        }
        workgroupBarrier();
    }
    let total = sums[0];
    workgroupBarrier(); // every thread has the total before `sums` is written again
    return total;
}

@compute @workgroup_size(WORKGROUP)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let width4 = params.width / 4u;
    let row = (params.first_row + workgroup.x) * width4;
    let width = f32(params.width);

    var sum = vec4<f32>();
    for (var k = lid; k < width4; k += WORKGROUP) {
        sum += vec4<f32>(x[row + k]);
    }
    let mean = workgroup_sum(sum.x + sum.y + sum.z + sum.w, lid) / width;

    var squares = vec4<f32>();
    for (var k = lid; k < width4; k += WORKGROUP) {
        let centered = vec4<f32>(x[row + k]) - mean;
        squares += centered * centered;
    }
    let variance = workgroup_sum(squares.x + squares.y + squares.z + squares.w, lid) / width;
    let denominator = sqrt(variance + bitcast<f32>(params.epsilon));

    for (var k = lid; k < width4; k += WORKGROUP) {
        let normalized = (vec4<f32>(x[row + k]) - mean) / denominator;
        y[row + k] = vec4<ELEM>(normalized * weight[k] + bias[k]);
    }
}
