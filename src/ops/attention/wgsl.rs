//! Attention within segments as one WGSL kernel on the wgpu backend: [`SdpaBackend::attend_fused`]
//! for [`CubeBackend`].
//!
//! Burn's composition ([`super::composed`]) writes every score out, `[segments, heads, queries,
//! len]` in f32, and reads it back through a softmax and two casts (BENCHMARKS.md has what that
//! costs on a hardware GPU).
//! `shaders/attention/attention.wgsl` keeps each query's scores, softmax and sums in registers
//! (FlashAttention's online softmax), so the kernel reads `q`, `k` and `v` and writes the output,
//! nothing else, in one launch per 65 535 (segment, head) pairs (a strided `v`, as the tower's
//! packed qkv gives, is copied first).

use burn::backend::wgpu::{CubeBackend, CubeTensor, KernelSource, SourceTemplate};
use burn::tensor::DType;
use burn_cubecl::cubecl::ir::attributes::BufferIOAttr;
use burn_cubecl::cubecl::prelude::KernelId;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros};

use super::SdpaBackend;
use crate::runtime::wgsl::{self, Elem};

/// Queries per workgroup, one per thread.
const WORKGROUP: u32 = 64;

/// Keys per tile of `k` and `v` in workgroup memory.
const KEYS: u32 = 16;

/// The widest head the kernel takes, in vec4s: each thread holds its query's row and sums in
/// `2 · MAX_HEAD4` vec4 registers, and the two tiles take `2 · KEYS · MAX_HEAD4` vec4s (16 KiB,
/// WebGPU's least workgroup memory).
const MAX_HEAD4: u32 = 32;

impl SdpaBackend for CubeBackend {
    /// `shaders/attention/attention.wgsl` for f32 and f16 heads of a multiple of 4 values up to
    /// `4 · MAX_HEAD4`; Burn's composition otherwise.
    fn attend_fused(q: CubeTensor, k: CubeTensor, v: CubeTensor, scale: f64) -> CubeTensor {
        let [segments, queries, heads, head_dim] = dims(&q);
        let len = k.meta.shape()[1];
        let kernel = AttentionSource::new(head_dim, [q.dtype, k.dtype, v.dtype]);
        let query_blocks = (queries as u64).div_ceil(u64::from(WORKGROUP));
        let (Some(kernel), true) = (
            kernel,
            query_blocks <= u64::from(wgsl::MAX_WORKGROUPS_PER_DIM),
        ) else {
            return super::composed::<Self>(q, k, v, scale);
        };
        if len == 0 {
            // With no keys every output is an empty sum: zero.
            return zeros(q.device.clone(), q.meta.shape().clone(), q.dtype);
        }
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        let out = empty_device_contiguous_dtype(
            q.client.clone(),
            q.device.clone(),
            q.meta.shape().clone(),
            q.dtype,
        );
        if queries == 0 || segments * heads == 0 {
            return out;
        }
        let groups = u32::try_from(segments * heads).expect("segments × heads fit a u32");
        // (Segment, head) pairs beyond one dispatch's limit go in further launches.
        for (first_group, count) in wgsl::launches(groups) {
            let read = BufferIOAttr::ReadOnly;
            wgsl::launch(
                kernel,
                WORKGROUP,
                (query_blocks as u32, count),
                &[
                    (&q, read),
                    (&k, read),
                    (&v, read),
                    (&out, BufferIOAttr::WriteOnly),
                ],
                &[
                    wgsl::param(queries),
                    wgsl::param(len),
                    wgsl::param(heads),
                    first_group,
                    (scale as f32).to_bits(),
                ],
            );
        }
        out
    }
}

/// Whether the fused kernel takes heads of `head_dim` values (in f32 and f16): elsewhere
/// [`SdpaBackend::attend_fused`] is Burn's composition, which writes the scores out.
pub(super) fn takes(head_dim: usize) -> bool {
    AttentionSource::new(head_dim, [DType::F32; 3]).is_some()
}

/// A tensor's four dimensions.
fn dims(t: &CubeTensor) -> [usize; 4] {
    let shape = t.meta.shape();
    [shape[0], shape[1], shape[2], shape[3]]
}

/// `shaders/attention/attention.wgsl` for one element type and head width, made by
/// [`AttentionSource::new`] alone.
#[derive(Debug, Clone, Copy)]
struct AttentionSource {
    elem: Elem,
    head4: u32,
}

impl AttentionSource {
    /// The kernel for heads of `head_dim` values and tensors of `dtypes` (q, k, v), where it
    /// takes them: one float type, f32 or f16, and `head_dim` a multiple of 4 up to
    /// `4 · MAX_HEAD4`.
    fn new(head_dim: usize, dtypes: [DType; 3]) -> Option<Self> {
        let elem = match dtypes {
            [DType::F32, DType::F32, DType::F32] => Elem::F32,
            [DType::F16, DType::F16, DType::F16] => Elem::F16,
            _ => return None,
        };
        let head4 = u32::try_from(head_dim / 4).ok()?;
        (head_dim.is_multiple_of(4) && (1..=MAX_HEAD4).contains(&head4))
            .then_some(Self { elem, head4 })
    }
}

/// `shaders/attention/attention.wgsl`, the template the kernel fills in.
pub(crate) const SHADER: &str = include_str!("../../../shaders/attention/attention.wgsl");

impl KernelSource for AttentionSource {
    fn source(&self) -> SourceTemplate {
        let [setup, scores, tile_max, accumulate, store] = unrolled(self.head4);
        SourceTemplate::new(SHADER)
            .register("workgroup", WORKGROUP.to_string())
            .register("keys", KEYS.to_string())
            .register("head4", self.head4.to_string())
            .register("setup", setup)
            .register("scores", scores)
            .register("tile_max", tile_max)
            .register("accumulate", accumulate)
            .register("store", store)
            .register("elem", self.elem.wgsl())
            .register("enable", self.elem.enable())
    }

    fn id(&self) -> KernelId {
        wgsl::kernel_id::<Self>((self.elem, self.head4))
    }

    fn lang(&self) -> &'static str {
        "wgsl"
    }
}

/// The statements `shaders/attention/attention.wgsl` repeats for each of a head's `head4` vec4s and
/// each of a tile's [`KEYS`] keys, written out with a variable each: `{{ setup }}`, `{{ scores }}`,
/// `{{ tile_max }}` (an expression), `{{ accumulate }}` and `{{ store }}`.
fn unrolled(head4: u32) -> [String; 5] {
    let dims = |line: &dyn Fn(u32) -> String| (0..head4).map(line).collect::<Vec<_>>();
    let keys = |line: &dyn Fn(u32) -> String| (0..KEYS).map(line).collect::<Vec<_>>();
    let setup = [
        dims(&|i| format!("let q_{i} = scale * vec4<f32>(q[q_at + {i}u]);")),
        dims(&|i| format!("var o_{i} = vec4<f32>();")),
    ]
    .concat();
    let scores = keys(&|j| {
        let dot: Vec<String> = (0..head4)
            .map(|i| format!("dot(q_{i}, k_tile[{}u])", j * head4 + i))
            .collect();
        format!(
            "let s_{j} = select(LOWEST, {}, key0 + {j}u < params.len);",
            dot.join(" + ")
        )
    });
    let tile_max = (1..KEYS).fold("s_0".to_owned(), |max, j| format!("max({max}, s_{j})"));
    let weights: Vec<String> = (0..KEYS).map(|j| format!("p_{j}")).collect();
    let accumulate = [
        keys(&|j| format!("let p_{j} = select(0.0, exp(s_{j} - m), key0 + {j}u < params.len);")),
        vec![format!("l = l * rescale + {};", weights.join(" + "))],
        dims(&|i| format!("o_{i} *= rescale;")),
        (0..KEYS)
            .flat_map(|j| {
                (0..head4).map(move |i| {
                    let at = j * head4 + i;
                    format!("o_{i} = fma(vec4<f32>(p_{j}), v_tile[{at}u], o_{i});")
                })
            })
            .collect(),
    ]
    .concat();
    let store = dims(&|i| format!("out[at + {i}u] = vec4<ELEM>(o_{i} / l);"));
    [
        wgsl::statements("    ", &setup),
        wgsl::statements("        ", &scores),
        tile_max,
        wgsl::statements("        ", &accumulate),
        wgsl::statements("        ", &store),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel for every head width it takes, in both element types, is valid WGSL that
    /// naga translates for every backend wgpu has; it is the only file in `shaders/attention/`.
    #[test]
    fn every_variant_validates() {
        assert_eq!(
            crate::ops::testing::shader_files("attention"),
            ["attention.wgsl"]
        );
        for elem in Elem::ALL {
            for head4 in 1..=MAX_HEAD4 {
                let source = AttentionSource { elem, head4 }.source().complete();
                wgsl::validate_and_translate(&source, &format!("attention {elem:?} ×{head4}"));
            }
        }
    }

    #[test]
    fn takes_heads_of_multiples_of_4_up_to_the_limit_in_one_float_type() {
        let f32s = [DType::F32; 3];
        assert!(AttentionSource::new(80, f32s).is_some());
        assert!(AttentionSource::new(4, [DType::F16; 3]).is_some());
        assert!(AttentionSource::new(4 * MAX_HEAD4 as usize, f32s).is_some());
        assert!(AttentionSource::new(4 * MAX_HEAD4 as usize + 4, f32s).is_none());
        assert!(AttentionSource::new(0, f32s).is_none());
        assert!(AttentionSource::new(82, f32s).is_none());
        assert!(AttentionSource::new(80, [DType::F32, DType::F16, DType::F32]).is_none());
        assert!(AttentionSource::new(80, [DType::BF16; 3]).is_none());
    }
}
