//! The linear kernels against float64 and Burn's matmul, on the CPU and the GPU.

use burn::tensor::{DType, Distribution, TensorData};

use super::*;
use crate::ops::testing::{shader_files, to_f64};
use crate::runtime::device;
use crate::runtime::wgsl::MAX_WORKGROUPS_PER_DIM;
use crate::runtime::wgsl::{validate_and_translate, validate_and_translate_to_spirv};

/// `(in, out)` of Qwen2-VL-2B's linears: `qkv`, `attn.proj`, `fc1`, `fc2`, the merger's
/// second layer.
const QWEN2_VL_2B_LINEARS: [(usize, usize); 5] = [
    (1280, 3840),
    (1280, 1280),
    (1280, 5120),
    (5120, 1280),
    (5120, 1536),
];

/// Unit roundoff of f32 and of f16.
const U: f64 = f32::EPSILON as f64 / 2.0;
const U16: f64 = 1.0 / 2048.0;

/// A random linear on the CPU in `dtype`: `x` `[rows, in]`, `weight` `[out, in]`, `bias`.
fn random(
    rows: usize,
    in_features: usize,
    out_features: usize,
    dtype: DType,
) -> (Tensor<2>, Tensor<2>, Tensor<1>) {
    let cpu = device::cpu().device;
    let uniform = Distribution::Uniform(-1.0, 1.0);
    (
        Tensor::<2>::random([rows, in_features], uniform, &cpu).cast(dtype),
        Tensor::<2>::random([out_features, in_features], uniform, &cpu).cast(dtype),
        Tensor::<1>::random([out_features], uniform, &cpu).cast(dtype),
    )
}

/// `x · weightᵀ + bias` in float64, and for each value Higham's bound on the error of an
/// f32 sum of its `in + 1` terms, each addition off by at most `u`: γ(in + 1) · (Σ |x·w| +
/// |b|).
fn reference(x: &[f64], weight: &[f64], bias: &[f64], in_features: usize, u: f64) -> [Vec<f64>; 2] {
    let gamma = |n: usize| n as f64 * u / (1.0 - n as f64 * u);
    let mut y = Vec::new();
    let mut bound = Vec::new();
    for row in x.chunks(in_features) {
        for (w, b) in weight.chunks(in_features).zip(bias) {
            let terms = row.iter().zip(w).map(|(x, w)| x * w);
            y.push(terms.clone().sum::<f64>() + b);
            let magnitude = terms.map(f64::abs).sum::<f64>() + b.abs();
            bound.push(gamma(in_features + 1) * magnitude);
        }
    }
    [y, bound]
}

/// What a product of ours is checked against.
#[derive(Clone, Copy, PartialEq)]
enum Against {
    /// Float64 alone: for the large shapes, where Burn's autotune (every candidate matmul run
    /// several times at each new shape) would cost minutes on a software GPU to check Burn's
    /// product rather than ours.
    Float64,
    /// Float64 and Burn's linear ([`check_ours`] says how).
    Float64AndBurn,
}

/// Our `kernel` on `gpu` in `dtype` against float64 (of the inputs rounded to `dtype`),
/// within the bound of f32 sums (rounded to f16 once, in f16), and against Burn's linear.
fn check(
    gpu: &device::RuntimeDevice,
    kernel: LinearKernel,
    rows: usize,
    in_features: usize,
    out_features: usize,
    dtype: DType,
) {
    let shape = [rows, in_features, out_features];
    check_kernel(gpu, kernel, shape, dtype, 1, Against::Float64AndBurn);
}

/// [`check_ours`] for our `kernel`.
fn check_kernel(
    gpu: &device::RuntimeDevice,
    kernel: LinearKernel,
    shape: [usize; 3],
    dtype: DType,
    repeats: usize,
    against: Against,
) {
    let ours = Ours {
        name: kernel.into(),
        // Tensor cores may truncate their f32 sums rather than round them.
        truncating_sums: kernel.coop_tiling().is_some(),
        run: &|x, weight_t, bias| linear(x, weight_t, Some(bias), kernel),
    };
    check_ours(gpu, &ours, shape, dtype, repeats, against);
}

/// A product of ours under test: its name, whether its f32 sums may truncate instead of
/// round (twice the error per addition), and how it computes `x · weight_t + bias`.
struct Ours<'a> {
    name: &'a str,
    truncating_sums: bool,
    run: &'a dyn Fn(Tensor<2>, &Tensor<2>, &Tensor<1>) -> Tensor<2>,
}

/// [`check`] for any product of ours, on `rows × in_features → out_features`, run
/// `repeats` times on the same inputs (a race in the kernel shows as one run off), against
/// float64 and, where `against` says so, Burn's linear: in f32 Burn's is within the bound of
/// f32 sums of float64 too, so the two are within twice it of each other; in f16 Burn's rounds
/// twice (its matmul sums in f32 and writes f16, then the bias is added in f16), so it is
/// checked against float64 within that wider bound.
fn check_ours(
    gpu: &device::RuntimeDevice,
    ours: &Ours,
    shape: [usize; 3],
    dtype: DType,
    repeats: usize,
    against: Against,
) {
    let [rows, in_features, out_features] = shape;
    let (x, weight, bias) = random(rows, in_features, out_features, dtype);
    // Products of f16 values are exact in f32 (22 bits of its 24), whatever sums them.
    let u = if ours.truncating_sums { 2.0 * U } else { U };
    let [expected, mut bound] = reference(
        &to_f64(&x.clone().cast(DType::F32)),
        &to_f64(&weight.clone().cast(DType::F32)),
        &to_f64(&bias.clone().cast(DType::F32)),
        in_features,
        u,
    );
    let sum_bound = bound.clone();
    if dtype == DType::F16 {
        // The f32 sum is rounded to f16 once at the end.
        for (bound, y) in bound.iter_mut().zip(&expected) {
            *bound = *bound * (1.0 + U16) + U16 * y.abs();
        }
    }
    let bias_values = to_f64(&bias.clone().cast(DType::F32));
    let d = &gpu.device;
    let (x, weight, bias) = (x.to_device(d), weight.to_device(d), bias.to_device(d));
    let weight_t = materialize(weight.clone().transpose());
    let burns = (against == Against::Float64AndBurn).then(|| {
        let burns = linear(
            x.clone(),
            &weight.transpose(),
            Some(&bias),
            LinearKernel::Burn,
        );
        to_f64(&burns.cast(DType::F32))
    });
    for run in 1..=repeats {
        let y = (ours.run)(x.clone(), &weight_t, &bias);
        let y = to_f64(&y.cast(DType::F32));
        let at = |i: usize| {
            format!(
                "{} {rows}×{in_features}→{out_features} {dtype:?}, run {run} of {repeats}, \
                 y[{}, {}]",
                ours.name,
                i / out_features,
                i % out_features
            )
        };
        for (i, ((y, expected), bound)) in y.iter().zip(&expected).zip(&bound).enumerate() {
            assert!(
                (y - expected).abs() <= *bound,
                "{}: ours {y} vs {expected} (bound {bound:e})",
                at(i)
            );
            let Some(burns) = burns.as_ref().map(|burns| burns[i]) else {
                continue;
            };
            if dtype == DType::F32 {
                // Burn's f32 sum is within `bound` of float64 too.
                assert!(
                    (y - burns).abs() <= 2.0 * bound,
                    "{}: ours {y} vs Burn's {burns} (bound {bound:e})",
                    at(i)
                );
            } else if run == 1 {
                // Burn's: the product `p` summed in f32 (off by `sum` at most), rounded to
                // f16 (off by `u · (|p| + sum)`), plus the bias rounded to f16 again (off
                // by `u` of that sum); `u` takes f32's too, for an f16 rounding done
                // through f32.
                let (sum, u) = (sum_bound[i], U16 + U);
                let product = (expected - bias_values[i % out_features]).abs() + sum;
                let burns_bound = sum + u * product * (1.0 + u) + u * (expected.abs() + sum);
                assert!(
                    (burns - expected).abs() <= burns_bound,
                    "{}: Burn's {burns} vs {expected} (bound {burns_bound:e})",
                    at(i)
                );
            }
        }
    }
}

/// Each of our kernels: row counts around its row block; widths below, at and past one
/// workgroup's columns, and depths below, at and past one staged slice; the shapes of
/// Qwen2-VL-2B's linears (against float64 alone: Burn's linear is checked on the others).
#[test]
fn ours_match_float64_and_burn() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    for kernel in [LinearKernel::Wgsl, LinearKernel::Tiled] {
        let (block_rows, block_columns4) = kernel.shader().unwrap().block();
        let (block, block_columns) = (block_rows as usize, 4 * block_columns4 as usize);
        let depth = TILED_DEPTH as usize;
        for rows in [1, block - 1, block, block + 1, 3 * block + 5] {
            for (in_features, out_features) in [
                (4, 4),
                (depth + 4, block_columns + 4),
                (4 * depth + 4, 2 * block_columns),
            ] {
                check(&gpu, kernel, rows, in_features, out_features, DType::F32);
            }
        }
        for (in_features, out_features) in QWEN2_VL_2B_LINEARS {
            let shape = [block + 3, in_features, out_features];
            check_kernel(&gpu, kernel, shape, DType::F32, 1, Against::Float64);
        }
        if device::f16_for_tests(&gpu) {
            let shape = [block + 3, 1280, 3840];
            check_kernel(&gpu, kernel, shape, DType::F16, 1, Against::Float64);
            check(&gpu, kernel, 5, 36, 516, DType::F16);
        }
    }
}

/// The subgroup size [`LinearShader::CoopEmulated`] is laid out for: the lanes of one
/// emulated subgroup are consecutive invocations.
pub(super) const EMULATED_SUBGROUP: u32 = 32;

/// Plain WGSL for each cooperative operation of a rendered coop kernel in `tiling`. A
/// subgroup is [`EMULATED_SUBGROUP`] consecutive invocations; each holds 8 values of a matrix
/// of sums (half a row: lane `l` has row `l / 2`, columns `8 · (l % 2)` on). A loaded matrix
/// is where it lies, in workgroup memory (or in `Direct` in `x` and `weight_t`), which holds
/// still while it is used; the product reads its rows and columns there. What is left is the
/// kernel's own staging, indexing and stores.
pub(super) fn emulated_coop(source: String, tiling: CoopTiling) -> String {
    let replacements: [(&str, &str); 7] = [
        (r"enable wgpu_cooperative_matrix;\n", ""),
        (r"coop_mat16x16<f32, C>\(\)", "array<f32, 8>()"),
        (
            r"coopLoadT<coop_mat16x16<f16, [AB]>>\(&\w+\[(\w+)\], (\w+)\)",
            "Stored($1, $2)",
        ),
        (
            r"coopMultiplyAdd\((\w+), (\w+), (\w+)\)",
            "emulated_multiply_add($1, $2, $3, lid)",
        ),
        (
            r"coopStoreT\((\w+), &staged\[staged_at\], staged_stride\)",
            "emulated_store($1, lid, staged_at, staged_stride)",
        ),
        (r"    @builtin\(subgroup_id\) subgroup: u32,\n", ""),
        (
            r"    let in4 = params.in_features / 4u;\n",
            "    let subgroup = lid / EMULATED_SUBGROUP;\n$0",
        ),
    ];
    let mut source = source;
    for (pattern, replacement) in replacements {
        let pattern = regex::Regex::new(pattern).unwrap();
        assert!(
            pattern.is_match(&source),
            "{pattern} is in {}",
            tiling.file_name()
        );
        source = pattern.replace_all(&source, replacement).into_owned();
    }
    let left = regex::Regex::new(r"coop(Load|Store|MultiplyAdd|_mat)").unwrap();
    assert!(
        !left.is_match(&source),
        "every cooperative operation is emulated"
    );
    let (a, b) = match tiling {
        CoopTiling::Narrow | CoopTiling::Wide => ("x_tile", "w_tile"),
        CoopTiling::Direct => ("x", "weight_t"),
    };
    let emulated = EMULATED.replace("A_ARRAY", a).replace("B_ARRAY", b);
    source + &format!("const EMULATED_SUBGROUP: u32 = {EMULATED_SUBGROUP}u;\n") + &emulated
}

/// The cooperative operations [`emulated_coop`] calls: `Stored` is an A matrix in `A_ARRAY`
/// or a B matrix in `B_ARRAY` (named for the tiling there), from `vec4` `at` on, rows
/// `stride` `vec4`s apart.
const EMULATED: &str = r"
struct Stored {
at: u32,
stride: u32,
}

fn emulated_multiply_add(a: Stored, b: Stored, c: array<f32, 8>, lid: u32) -> array<f32, 8> {
let lane = lid % EMULATED_SUBGROUP;
let row = lane / 2u;
let column0 = 8u * (lane % 2u);
// 16, as a count the shader compiler cannot know: unrolled, this loop is most of the kernel's
// code, and compiling that took lavapipe's LLVM minutes per kernel (the kernel never runs with
// no input columns).
let depth = select(16u, 0u, params.in_features == 0u);
var d = c;
for (var k = 0u; k < depth; k++) {
    let x = f32(A_ARRAY[a.at + row * a.stride + k / 4u][k % 4u]);
    for (var i = 0u; i < 8u; i++) {
        let column = column0 + i;
        d[i] += x * f32(B_ARRAY[b.at + k * b.stride + column / 4u][column % 4u]);
    }
}
return d;
}

fn emulated_store(m: array<f32, 8>, lid: u32, at: u32, stride: u32) {
let lane = lid % EMULATED_SUBGROUP;
var values = m;
for (var i = 0u; i < 8u; i++) {
    staged[at + (lane / 2u) * stride + 8u * (lane % 2u) + i] = values[i];
}
}
";

/// Each coop kernel with its cooperative operations emulated ([`emulated_coop`]), in f16
/// on any GPU with it (lavapipe too): row counts past one row block, widths below and past
/// one block's columns, depths below and past one staged slice ([`coop_shapes`]), and
/// `attn.qkv` of the 2B shape. The cooperative operations
/// themselves are checked where the device has them ([`coop_matches_float64`]).
#[test]
fn coop_emulated_matches_float64() {
    let Some(gpu) = device::gpu_for_tests().filter(device::f16_for_tests) else {
        return;
    };
    for tiling in CoopTiling::ALL {
        let name = format!("coop {tiling:?} (emulated)");
        let ours = Ours {
            name: &name,
            truncating_sums: false,
            run: &|x, weight_t, bias| {
                Tensor::from_dispatch(<Dispatch as LinearBackend>::linear_wgsl(
                    x.into_dispatch(),
                    weight_t.clone().into_dispatch(),
                    bias.clone().into_dispatch(),
                    LinearShader::CoopEmulated(tiling),
                ))
            },
        };
        for shape in coop_shapes(tiling, &[1, COOP_ROWS as usize + 1]) {
            check_ours(&gpu, &ours, shape, DType::F16, 1, Against::Float64AndBurn);
        }
        // `attn.qkv` of the 2B shape: 40 slices deep, 30 blocks across.
        let shape = [COOP_ROWS as usize + 3, 1280, 3840];
        check_ours(&gpu, &ours, shape, DType::F16, 1, Against::Float64AndBurn);
    }
}

/// The cooperative-matrix kernel, in f16 where the device offers it (not lavapipe): row
/// counts around its row block; widths below, at and past one block's columns, and depths
/// below, at and past one staged slice; the shapes of Qwen2-VL-2B's linears. Each product
/// runs `MMLORA_COOP_REPEATS` times (1 unless set) on its inputs, every output checked: a
/// slice read from workgroup memory before its stores reach it (a race the Vulkan memory
/// model allows the kernel as naga writes it, wgpu issue #8805) would show as a run off.
#[test]
fn coop_matches_float64() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    for kernel in LinearKernel::COOP {
        let tiling = kernel.coop_tiling().unwrap();
        if coop_for_tests(&gpu, tiling).is_some() {
            coop_kernel_matches_float64(&gpu, kernel);
        }
    }
}

/// Shapes `[rows, in, out]` for the coop kernel of `tiling`, at each of `rows` (and 16 in
/// its stead where `Direct` takes no fewer): widths below, at and past one block's columns,
/// and depths below, at and past one staged slice; in `Direct` the depths are multiples of
/// 16, and each width but the smallest is 4 past one, so that its last matrix moves back.
fn coop_shapes(tiling: CoopTiling, rows: &[usize]) -> Vec<[usize; 3]> {
    let (columns, depth) = (COOP_COLUMNS as usize, COOP_DEPTH as usize);
    let widths = match tiling {
        CoopTiling::Narrow | CoopTiling::Wide => [
            (4, 4),
            (depth - 4, columns - 4),
            (depth + 4, columns + 4),
            (4 * depth + 4, 2 * columns),
        ],
        CoopTiling::Direct => [
            (16, 16),
            (depth - 16, columns - 12),
            (depth + 16, columns + 4),
            (4 * depth + 16, 2 * columns + 4),
        ],
    };
    let side = MATRIX as usize;
    rows.iter()
        .map(|&rows| match tiling {
            CoopTiling::Direct => rows.max(side),
            _ => rows,
        })
        .flat_map(|rows| {
            widths.map(|(in_features, out_features)| [rows, in_features, out_features])
        })
        .collect()
}

/// [`coop_matches_float64`] for one of the coop kernels.
fn coop_kernel_matches_float64(gpu: &RuntimeDevice, kernel: LinearKernel) {
    let repeats = std::env::var("MMLORA_COOP_REPEATS").map_or(1, |repeats| {
        repeats
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .expect("MMLORA_COOP_REPEATS is a count of runs, at least 1")
    });
    let block = COOP_ROWS as usize;
    let coop = |shape: [usize; 3]| {
        check_kernel(
            gpu,
            kernel,
            shape,
            DType::F16,
            repeats,
            Against::Float64AndBurn,
        );
    };
    let tiling = kernel.coop_tiling().unwrap();
    let rows = [1, 17, block - 1, block, block + 1, 3 * block + 5];
    for shape in coop_shapes(tiling, &rows) {
        coop(shape);
    }
    for (in_features, out_features) in QWEN2_VL_2B_LINEARS {
        coop([2 * block + 3, in_features, out_features]);
    }
}

/// A product the coop kernel cannot compute where it is asked for is Burn's, not a panic:
/// `x` in f32, and (on a device without cooperative matrices, such as lavapipe with its
/// subgroups of 8) `x` in f16.
#[test]
fn coop_where_it_cannot_run_is_burns() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    let mut dtypes = vec![DType::F32];
    let coop = CoopTiling::ALL.map(|tiling| coop_subgroup(&gpu, tiling).is_some());
    if coop == [false; 3] && device::f16_for_tests(&gpu) {
        dtypes.push(DType::F16);
    }
    let d = &gpu.device;
    let integers = |n: usize, modulus: usize| -> Vec<f32> {
        (0..n).map(|i| (i % modulus) as f32 - 3.0).collect()
    };
    for dtype in dtypes {
        let x = Tensor::<2>::from_data(TensorData::new(integers(40, 7), [5, 8]), d);
        let weight_t = Tensor::<2>::from_data(TensorData::new(integers(96, 5), [8, 12]), d);
        let bias = Tensor::<1>::from_data(TensorData::new(integers(12, 4), [12]), d);
        let (x, weight_t, bias) = (x.cast(dtype), weight_t.cast(dtype), bias.cast(dtype));
        let burns = linear(x.clone(), &weight_t, Some(&bias), LinearKernel::Burn).into_data();
        for kernel in LinearKernel::COOP {
            let coop = linear(x.clone(), &weight_t, Some(&bias), kernel);
            // Small integers: every sum is exact (in f16 too), whatever kernel Burn's
            // autotune takes.
            coop.into_data().assert_eq(&burns, true);
        }
    }
}

/// Our kernels take one dtype for all three tensors, f32 or f16 (the coop kernel f16
/// alone), and widths that are multiples of 4 with `in` not 0; anything else is Burn's.
#[test]
fn kernels_take_one_dtype_of_theirs_and_widths_of_4() {
    let (f32s, f16s) = (DType::F32, DType::F16);
    let take = |shader, [x, w, b]: [DType; 3], [rows, in_features, out_features]: [usize; 3]| {
        kernel_elem(
            shader,
            (x, [rows, in_features]),
            (w, [in_features, out_features]),
            (b, out_features),
        )
    };
    let shape = [3, 8, 12];
    for shader in [LinearShader::Registers, LinearShader::Tiled] {
        assert_eq!(take(shader, [f32s; 3], shape), Some(Elem::F32));
        assert_eq!(take(shader, [f16s; 3], shape), Some(Elem::F16));
        for mixed in [[f32s, f16s, f16s], [f16s, f32s, f16s], [f16s, f16s, f32s]] {
            assert_eq!(take(shader, mixed, shape), None, "{mixed:?}");
        }
        for other in [DType::F64, DType::BF16] {
            assert_eq!(take(shader, [other; 3], shape), None, "{other:?}");
        }
        for widths in [[3, 0, 12], [3, 6, 12], [3, 8, 10]] {
            assert_eq!(take(shader, [f32s; 3], widths), None, "{widths:?}");
        }
    }
    for tiling in CoopTiling::ALL {
        let coop = LinearShader::Coop(tiling);
        let direct = tiling == CoopTiling::Direct;
        let shape = [16, 32, 16];
        assert_eq!(take(coop, [f16s; 3], shape), Some(Elem::F16));
        assert_eq!(take(coop, [f32s; 3], shape), None);
        // `Direct` loads whole matrices: 16 rows and 16 output columns at least, and a
        // depth of whole matrices.
        for small in [[15, 32, 16], [16, 36, 16], [16, 32, 12]] {
            let taken = take(coop, [f16s; 3], small);
            assert_eq!(
                taken,
                (!direct).then_some(Elem::F16),
                "{tiling:?} {small:?}"
            );
        }
    }
    // A weight or bias whose shape is not the product's.
    let f32_at = |shape| (f32s, shape);
    assert_eq!(
        kernel_elem(
            LinearShader::Tiled,
            f32_at([3, 8]),
            f32_at([4, 12]),
            (f32s, 12)
        ),
        None
    );
    assert_eq!(
        kernel_elem(
            LinearShader::Tiled,
            f32_at([3, 8]),
            f32_at([8, 12]),
            (f32s, 8)
        ),
        None
    );
}

/// Which shaders a device's limits let run: OpenGL ES 3.1's least (128 invocations,
/// 16 KiB of workgroup memory) runs the registers kernel alone; the coop kernel wants one
/// subgroup size it lays out and the workgroup memory of that layout.
#[test]
fn shaders_run_within_the_devices_limits() {
    let capacity = |invocations, workgroup_bytes, subgroups| Capacity {
        invocations,
        workgroup_bytes,
        subgroups,
    };
    let (narrow, wide) = (
        LinearShader::Coop(CoopTiling::Narrow),
        LinearShader::Coop(CoopTiling::Wide),
    );
    let gles = capacity(128, 16 << 10, [32, 32]);
    assert!(LinearShader::Registers.runs_on(gles));
    assert!(!LinearShader::Tiled.runs_on(gles));
    assert!(!narrow.runs_on(gles));
    assert!(!wide.runs_on(gles), "its slices alone take 18 KiB");
    let big = capacity(1024, 48 << 10, [32, 32]);
    assert!(LinearShader::Tiled.runs_on(big));
    assert!(narrow.runs_on(big));
    assert!(wide.runs_on(big));
    for subgroups in [[8, 8], [16, 32], [128, 128]] {
        for coop in [narrow, wide] {
            assert!(
                !coop.runs_on(capacity(1024, 48 << 10, subgroups)),
                "{coop:?} {subgroups:?}"
            );
        }
    }
    for subgroup in [16, 64] {
        let at = capacity(1024, 48 << 10, [subgroup, subgroup]);
        assert!(narrow.runs_on(at) && !wide.runs_on(at), "{subgroup}");
    }
    let bytes = CoopLayout::new(CoopTiling::Narrow, 16)
        .unwrap()
        .workgroup_bytes();
    assert!(narrow.runs_on(capacity(256, bytes, [16, 16])));
    assert!(!narrow.runs_on(capacity(256, bytes - 1, [16, 16])));
    let bytes = CoopLayout::new(CoopTiling::Wide, 32)
        .unwrap()
        .workgroup_bytes();
    assert!(wide.runs_on(capacity(128, bytes, [32, 32])));
    assert!(!wide.runs_on(capacity(128, bytes - 1, [32, 32])));
    assert!(!wide.runs_on(capacity(64, bytes, [32, 32])));
}

/// Flex's linear (a `gemm` call onto rows of the bias) against float64: widths that are
/// not multiples of anything, calls on either side of the threading threshold, the shapes
/// of Qwen2-VL-2B's linears, and `Wᵀ` as the transposed view the layers keep.
#[test]
fn flex_matches_float64() {
    let cpu = device::cpu();
    for (rows, in_features, out_features) in [
        (1, 1, 1),
        (3, 7, 13),
        (37, 129, 67),
        (300, 200, 200),
        (37, 1280, 3840),
        (37, 5120, 1280),
    ] {
        check(
            &cpu,
            LinearKernel::Burn,
            rows,
            in_features,
            out_features,
            DType::F32,
        );
    }
}

/// Flex's linear on a strided `x` (a transpose), with no rows, and with no inner width
/// (the bias alone).
#[test]
fn flex_strided_and_empty() {
    let d = device::cpu().device;
    let tensor = |values: Vec<f32>, shape: [usize; 2]| {
        Tensor::<2>::from_data(TensorData::new(values, shape), &d)
    };
    let x_t = tensor(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]);
    let weight_t = tensor(vec![1.0, 0.5, -1.0, 2.0], [2, 2]);
    let bias = Tensor::<1>::from_data([0.25f32, -0.25], &d);
    let y = linear(x_t.transpose(), &weight_t, Some(&bias), LinearKernel::Burn);
    // x = [[1, 4], [2, 5], [3, 6]]; exact: small integers, halves and quarters.
    let expected = [
        1.0 - 4.0 + 0.25,
        0.5 + 8.0 - 0.25,
        2.0 - 5.0 + 0.25,
        1.0 + 10.0 - 0.25,
        3.0 - 6.0 + 0.25,
        1.5 + 12.0 - 0.25,
    ];
    assert_eq!(y.into_data().try_to_vec::<f32>().unwrap(), expected);
    let no_rows = linear(
        tensor(vec![], [0, 2]),
        &weight_t,
        Some(&bias),
        LinearKernel::Burn,
    );
    assert_eq!(no_rows.dims(), [0, 2]);
    let no_inner = linear(
        tensor(vec![], [3, 0]),
        &tensor(vec![], [0, 2]),
        Some(&bias),
        LinearKernel::Burn,
    );
    assert_eq!(
        no_inner.into_data().try_to_vec::<f32>().unwrap(),
        [0.25, -0.25, 0.25, -0.25, 0.25, -0.25]
    );
}

/// More row blocks than one dispatch may have: the rows past the first launch come out of
/// the second one, right, for each of our kernels. The expected values are exact (small
/// integers and halves: every sum is exact in f32 and f16), computed here rather than by Burn's
/// matmul, which autotunes on a new shape: at millions of rows, minutes on lavapipe.
#[test]
fn rows_beyond_one_dispatch() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    let d = &gpu.device;
    let weights: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let biases = [0.5f32, -0.5, 1.0, 2.0];
    let weight_t = Tensor::<2>::from_data(TensorData::new(weights.clone(), [4, 4]), d);
    let bias = Tensor::<1>::from_data(biases, d);
    let coop = CoopTiling::ALL.map(|tiling| coop_for_tests(&gpu, tiling).is_some());
    for (kernel, dtype, runs) in [
        (LinearKernel::Wgsl, DType::F32, true),
        (LinearKernel::Tiled, DType::F32, true),
        (LinearKernel::Coop, DType::F16, coop[0]),
        (LinearKernel::CoopWide, DType::F16, coop[1]),
    ] {
        if !runs {
            continue;
        }
        let (block_rows, _) = kernel.shader().unwrap().block();
        let rows = MAX_WORKGROUPS_PER_DIM as usize * block_rows as usize + 5;
        let x: Vec<f32> = (0..rows * 4).map(|i| (i % 7) as f32 - 3.0).collect();
        // y = x · Wᵀ + b with `weight_t` = Wᵀ laid out [in, out]: below 2048 in magnitude.
        let weights = &weights;
        let expected: Vec<f32> = x
            .chunks(4)
            .flat_map(|row| {
                (0..4).map(move |o| {
                    biases[o] + (0..4).map(|k| row[k] * weights[k * 4 + o]).sum::<f32>()
                })
            })
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [rows, 4]), d).cast(dtype);
        let (weight_t, bias) = (weight_t.clone().cast(dtype), bias.clone().cast(dtype));
        let ours = linear(x, &weight_t, Some(&bias), kernel).cast(DType::F32);
        let ours = ours.into_data().try_to_vec::<f32>().unwrap();
        if let Some(row) = (0..rows).find(|&r| ours[4 * r..4 * r + 4] != expected[4 * r..4 * r + 4])
        {
            panic!(
                "{kernel:?} {dtype:?}, {rows} rows: row {row} is {:?}, not {:?}",
                &ours[4 * row..4 * row + 4],
                &expected[4 * row..4 * row + 4]
            );
        }
    }
}

#[test]
fn auto_and_the_candidates_follow_the_device() {
    use LinearKernel::{Auto, Burn, Tiled, Timed, Wgsl};
    let cpu = device::cpu();
    for (dtype, checked) in [DType::F32, DType::F16].into_iter().zip([false, true]) {
        assert_eq!(LinearKernel::candidates(&cpu, dtype, checked), &[Burn]);
    }
    assert_eq!(Auto.resolve(&cpu), Burn);
    assert_eq!(Wgsl.resolve(&cpu), Wgsl);
    if let Some(gpu) = device::gpu_for_tests() {
        let tiled = LinearShader::Tiled.runs_on(Capacity::of_wgpu(gpu.wgpu.as_ref().unwrap()));
        // The coop kernels the device runs, in `LinearKernel::COOP`'s order.
        let coop: Vec<LinearKernel> = LinearKernel::COOP
            .into_iter()
            .filter(|kernel| {
                let tiling = kernel.coop_tiling().unwrap();
                gpu.hardware_gpu && coop_for_tests(&gpu, tiling).is_some()
            })
            .collect();
        let (auto, f32s, f16s) = match (gpu.hardware_gpu, tiled) {
            (false, _) => (Wgsl, vec![Wgsl, Burn], vec![Wgsl, Burn]),
            (true, false) => (Timed, vec![Burn], vec![Burn]),
            (true, true) => (Timed, vec![Burn, Tiled], [vec![Burn, Tiled], coop].concat()),
        };
        assert_eq!(LinearKernel::candidates(&gpu, DType::F32, false), f32s);
        assert_eq!(LinearKernel::candidates(&gpu, DType::F16, false), f16s);
        // `auto` leaves out what has not passed on hardware: on a software GPU nothing.
        let checked = |all: Vec<LinearKernel>| -> Vec<LinearKernel> {
            let keep = |k: &LinearKernel| !gpu.hardware_gpu || k.hardware_checked();
            all.into_iter().filter(keep).collect()
        };
        assert_eq!(
            LinearKernel::candidates(&gpu, DType::F32, true),
            checked(f32s)
        );
        assert_eq!(
            LinearKernel::candidates(&gpu, DType::F16, true),
            checked(f16s)
        );
        assert_eq!(Auto.resolve(&gpu), auto);
        assert_eq!(Tiled.resolve(&gpu), Tiled);
        assert_eq!(Timed.resolve(&gpu), Timed);
    }
}

/// On a hardware GPU `auto` times only kernels checked on one (today Burn's alone: `tiled` and
/// the coop kernels changed since the last hardware run); `timed` by name times them all. Seen
/// through a GPU marked as hardware, since CI has none.
#[test]
fn auto_on_a_hardware_gpu_takes_only_hardware_checked_kernels() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    let hardware = RuntimeDevice {
        hardware_gpu: true,
        ..gpu
    };
    for dtype in [DType::F32, DType::F16] {
        let all = LinearKernel::candidates(&hardware, dtype, false);
        let checked: Vec<LinearKernel> = all
            .iter()
            .copied()
            .filter(|k| k.hardware_checked())
            .collect();
        let expected = match checked[..] {
            [only] => choice::LinearChoice::Fixed(only),
            _ => choice::LinearChoice::Timed(LinearKernel::candidates(&hardware, dtype, true)),
        };
        assert_eq!(
            choice::LinearChoice::new(LinearKernel::Auto, &hardware, dtype),
            expected
        );
        assert!(
            !LinearKernel::Tiled.hardware_checked(),
            "update this test with CHECKED"
        );
        assert_eq!(checked, [LinearKernel::Burn]);
        if all.len() > 1 {
            assert_eq!(
                choice::LinearChoice::new(LinearKernel::Timed, &hardware, dtype),
                choice::LinearChoice::Timed(all)
            );
        }
    }
}

/// The register and tiled kernels, with and without the LoRA epilogue, validate and
/// translate for every backend; every file in `shaders/linear/` is one of the linear
/// kernels' (the coop files checked in the next test).
#[test]
fn shaders_validate_and_translate_to_every_backend() {
    for file in shader_files("linear") {
        assert!(
            LinearShader::ALL.iter().any(|s| s.file_name() == file)
                || file == COOP_STORE_FILE_NAME
                || file == LORA_FILE_NAME,
            "shaders/linear/{file} is not a kernel the runtime knows, so it is never checked"
        );
    }
    for shader in [LinearShader::Registers, LinearShader::Tiled] {
        for (elem, lora) in Elem::ALL.into_iter().flat_map(|e| [(e, false), (e, true)]) {
            let what = format!("{} ({elem:?}, LoRA epilogue {lora})", shader.file_name());
            match shader.render(elem, 0, lora) {
                Some(source) => validate_and_translate(&source, &what),
                None => assert!(lora && !shader.has_lora_epilogue(), "{what} renders"),
            }
        }
    }
}

/// The cooperative-matrix kernel at every subgroup size it takes, to SPIR-V (naga writes
/// cooperative matrices for Vulkan and, 8 × 8 alone, for Metal; 16 × 16 is Vulkan's); none
/// at another size or in f32.
#[test]
fn coop_shader_validates_and_translates_to_spirv() {
    for (tiling, subgroups) in [
        (CoopTiling::Narrow, &[16, 32, 64][..]),
        (CoopTiling::Wide, &[32][..]),
        (CoopTiling::Direct, &[32][..]),
    ] {
        let coop = LinearShader::Coop(tiling);
        for &subgroup in subgroups {
            let layout = CoopLayout::new(tiling, subgroup).unwrap();
            let (down, across) = layout.matrices();
            assert_eq!(
                layout.subgroups * down * across,
                64,
                "the cells cover the block"
            );
            assert_eq!(layout.subgroups * subgroup, layout.workgroup);
            assert!(down * across <= 16, "at most 16 matrices of sums");
            for lora in [false, true] {
                let what = format!(
                    "{} ({tiling:?}, subgroup {subgroup}, LoRA epilogue {lora})",
                    tiling.file_name()
                );
                let source = coop.render(Elem::F16, subgroup, lora).unwrap();
                validate_and_translate_to_spirv(&source, &what);
            }
            assert_eq!(coop.render(Elem::F32, subgroup, false), None);
        }
        for subgroup in [8, 16, 32, 64, 128] {
            if !subgroups.contains(&subgroup) {
                assert_eq!(CoopLayout::new(tiling, subgroup), None);
                assert_eq!(coop.render(Elem::F16, subgroup, false), None);
            }
        }
    }
}
