// Attention within segments in one pass: out = softmax(scale · q · kᵀ) · v, per segment and
// head, the scores never written out (FlashAttention's online softmax).
//
// q, out: [segments, queries, heads, HEAD4 vec4s]; k, v: [segments, len, heads, HEAD4 vec4s].
// One workgroup per block of WORKGROUP queries of one (segment, head); one query per thread,
// its row of q (scaled) and its sums of out in registers, HEAD4 vec4s each. The workgroup walks
// the segment's keys KEYS at a time: it copies that tile of k and v into workgroup memory, then
// every thread scores its query against the tile's keys, takes the running maximum m, rescales
// its sums and their weight total l by exp(m_old − m), and adds exp(score − m) · v for each
// key. Every thread reads the same tile entry at once (a broadcast).
//
// Queries past the last are clamped to it: computed, never stored. Keys past the last are
// clamped on load and weigh zero. ELEM is the element type of q, k, v and out (f32, or f16
// where the device has SHADER_F16); the tiles, scores, softmax and sums are f32.
{{ enable }}

@group(0) @binding(0) var<storage, read_write> q: array<vec4<ELEM>>;
@group(0) @binding(1) var<storage, read_write> k: array<vec4<ELEM>>;
@group(0) @binding(2) var<storage, read_write> v: array<vec4<ELEM>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<ELEM>>;

struct Params {
    queries: u32, // per segment
    len: u32, // keys per segment, at least 1
    heads: u32,
    first_group: u32, // of this launch: (segment, head) pairs beyond 65535 go in further launches
    scale: u32, // the f32 scale's bits
}
@group(0) @binding(4) var<uniform> params: Params;

alias ELEM = {{ elem }};

const WORKGROUP: u32 = {{ workgroup }}u; // queries per workgroup, one per thread
const KEYS: u32 = {{ keys }}u; // keys per tile
const HEAD4: u32 = {{ head4 }}u; // vec4s per head

// A score below any real one, for keys past the last when taking the maximum.
const LOWEST: f32 = -3.0e38;

var<workgroup> k_tile: array<vec4<f32>, KEYS * HEAD4>;
var<workgroup> v_tile: array<vec4<f32>, KEYS * HEAD4>;

@compute @workgroup_size(WORKGROUP)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let group = params.first_group + workgroup.y;
    let segment = group / params.heads;
    let head = group % params.heads;
    let row4 = params.heads * HEAD4; // vec4s per row of q, k, v and out
    let query = workgroup.x * WORKGROUP + lid;
    let q_at = (segment * params.queries + min(query, params.queries - 1u)) * row4 + head * HEAD4;
    let kv_at = segment * params.len * row4 + head * HEAD4;
    let scale = bitcast<f32>(params.scale);

    // This query's row of q, scaled, and its sums: q_i and o_i for i < HEAD4.
{{ setup }}
    var m = LOWEST; // the largest score so far
    var l = 0.0; // the weights' total so far, at m

    for (var key0 = 0u; key0 < params.len; key0 += KEYS) {
        workgroupBarrier(); // every thread is done with the previous tile
        for (var i = lid; i < KEYS * HEAD4; i += WORKGROUP) {
            let key = min(key0 + i / HEAD4, params.len - 1u);
            let at = kv_at + key * row4 + i % HEAD4;
            k_tile[i] = vec4<f32>(k[at]);
            v_tile[i] = vec4<f32>(v[at]);
        }
        workgroupBarrier();

        // Scores s_j of the tile's keys, LOWEST past the last key; their maximum.
{{ scores }}
        let m_new = max(m, {{ tile_max }});
        let rescale = exp(m - m_new);
        m = m_new;
        // Weights p_j, zero past the last key, and the sums rescaled to m, plus p_j · v_j.
{{ accumulate }}
    }

    if (query < params.queries) {
        let at = (segment * params.queries + query) * row4 + head * HEAD4;
{{ store }}
    }
}
