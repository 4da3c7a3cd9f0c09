//! Raw WGSL kernels on Burn's wgpu device: the element types they are written for, the one
//! launch every kernel goes through, and the dispatch limit launches split at. Every op's WGSL
//! kernels launch through here.

use burn::backend::wgpu::{CubeTensor, KernelSource, SourceKernel, SourceTemplate};
use burn::tensor::DType;
use burn_cubecl::cubecl::ir::attributes::BufferIOAttr;
use burn_cubecl::cubecl::prelude::KernelId;
use burn_cubecl::cubecl::server::{KernelArguments, MetadataBindingInfo};
use burn_cubecl::cubecl::{CubeCount, CubeDim, ExecutionMode};

/// Most workgroups one dispatch dimension may have (WebGPU's default limit).
pub const MAX_WORKGROUPS_PER_DIM: u32 = 65_535;

/// `workgroups` along one dimension split into launches of at most [`MAX_WORKGROUPS_PER_DIM`]:
/// each launch's first workgroup and its count.
pub fn launches(workgroups: u32) -> impl Iterator<Item = (u32, u32)> {
    (0..workgroups)
        .step_by(MAX_WORKGROUPS_PER_DIM as usize)
        .map(move |first| (first, (workgroups - first).min(MAX_WORKGROUPS_PER_DIM)))
}

/// The element type of a kernel's tensors (its sums are `f32` in both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Elem {
    /// `f32`.
    F32,
    /// `f16`: needs the device's `SHADER_F16`.
    F16,
}

impl Elem {
    /// Both element types.
    #[cfg(test)]
    pub const ALL: [Elem; 2] = [Elem::F32, Elem::F16];

    /// The element type of a tensor of `dtype` (our kernels take no other).
    pub(crate) fn of(dtype: DType) -> Self {
        match dtype {
            DType::F16 => Elem::F16,
            _ => Elem::F32,
        }
    }

    /// The WGSL type name.
    pub(crate) fn wgsl(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
        }
    }

    /// The directive the type needs at the top of a module.
    pub(crate) fn enable(self) -> &'static str {
        match self {
            Elem::F32 => "",
            Elem::F16 => "enable f16;",
        }
    }
}

/// The pipeline id of a raw WGSL kernel of ours of type `K`: `info` is what tells its pipelines
/// apart (the values its template was rendered with).
///
/// Every one of our kernels runs in [`ExecutionMode::Unchecked`], as Burn's own matmul and
/// reductions do. Bounds checks are off in both modes on wgpu (cubecl turns them off for every
/// WGSL module); what the mode changes is naga's loop bounding, which `Checked` turns on: it
/// wraps each loop of the shader in a 64-bit iteration counter with a second exit, which costs a
/// compare and an add per iteration and can keep the driver from unrolling the loop (wgpu issue
/// 7698). It guards against loops that never end, and ours all end: every loop in `shaders/`
/// steps a `u32` counter by a positive constant (at most a workgroup) towards a bound that is a
/// width, a row count, a rank or a constant, each far below `u32::MAX` ([`param`]).
pub(crate) fn kernel_id<K: 'static>(
    info: impl 'static + Eq + std::hash::Hash + std::fmt::Debug + Send + Sync,
) -> KernelId {
    KernelId::new::<K>()
        .info(info)
        .mode(ExecutionMode::Unchecked)
}

/// `value` (a width, a row count, a rank) as a kernel's `u32` parameter. The loops of
/// `shaders/` count to such values in steps of up to a workgroup, which must not wrap past
/// `u32::MAX` ([`kernel_id`]); a kernel binds each tensor whole, and a binding holds under 2³²
/// bytes, so every width and row count fits with room to spare.
pub(crate) fn param(value: usize) -> u32 {
    u32::try_from(value).expect("a bound tensor's widths and row counts fit a u32")
}

/// A shader whose template takes its workgroup size (`{{ workgroup }}`) and element type
/// (`{{ elem }}`, `{{ enable }}`) alone: rotary's and layer norm's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ElemShader {
    /// The shader's file under `shaders/`: with the element type, what tells its pipelines
    /// apart.
    pub file_name: &'static str,
    /// The shader's source (`include_str!` of that file).
    pub template: &'static str,
    /// Invocations per workgroup.
    pub workgroup: u32,
}

impl ElemShader {
    /// The shader specialised for tensors of `elem`.
    pub(crate) fn kernel(self, elem: Elem) -> ElemKernel {
        ElemKernel { shader: self, elem }
    }
}

/// An [`ElemShader`] specialised for one element type: what a launch takes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ElemKernel {
    /// The shader.
    shader: ElemShader,
    /// The element type it is specialised for.
    elem: Elem,
}

impl KernelSource for ElemKernel {
    fn source(&self) -> SourceTemplate {
        SourceTemplate::new(self.shader.template)
            .register("workgroup", self.shader.workgroup.to_string())
            .register("elem", self.elem.wgsl())
            .register("enable", self.elem.enable())
    }

    fn id(&self) -> KernelId {
        kernel_id::<Self>((self.shader.file_name, self.shader.workgroup, self.elem))
    }

    fn lang(&self) -> &'static str {
        "wgsl"
    }
}

/// `lines` as a block of WGSL statements, each on its own line behind `indent`: what a template
/// placeholder of written-out statements (one variable each, as llvmpipe wants) takes.
pub(crate) fn statements(indent: &str, lines: &[String]) -> String {
    lines
        .iter()
        .map(|line| format!("{indent}{line}\n"))
        .collect()
}

/// Packs `u32` parameters into the `u64` words of the trailing uniform, padded to 16 bytes.
fn uniform_words(params: &[u32]) -> MetadataBindingInfo {
    let mut padded = params.to_vec();
    padded.resize(params.len().div_ceil(4) * 4, 0);
    let words = padded
        .chunks(2)
        .map(|pair| u64::from(pair[0]) | (u64::from(pair[1]) << 32))
        .collect();
    MetadataBindingInfo::custom(words)
}

/// Launches `kernel` with `workgroup_size` invocations per workgroup on `workgroups` (x, y),
/// binding `buffers` in order, each declared with what the kernel does with it, and `params` in
/// the trailing uniform. Every raw WGSL kernel of ours goes through here.
///
/// The declarations matter when a launch fails (a buffer the device cannot hold): cubecl then
/// marks every buffer the kernel may write as carrying the failure, and refuses later kernels
/// that read one. Left undeclared, a buffer counts as written, and weights that were only read
/// (the model's, the adapters') would refuse every later step.
pub(crate) fn launch<K: KernelSource + 'static>(
    kernel: K,
    workgroup_size: u32,
    workgroups: (u32, u32),
    buffers: &[(&CubeTensor, BufferIOAttr)],
    params: &[u32],
) {
    let arguments = buffers
        .iter()
        .fold(KernelArguments::new(), |args, (tensor, io)| {
            args.with_buffer_io(tensor.handle.clone().binding(), *io)
        })
        .with_info(uniform_words(params));
    buffers[0].0.client.launch(
        Box::new(SourceKernel::new(kernel, CubeDim::new_1d(workgroup_size))),
        CubeCount::Static(workgroups.0, workgroups.1, 1),
        arguments,
    );
}

/// Parses and validates `source` with naga and translates it to SPIR-V, MSL, HLSL and, unless it
/// computes in `f16`, GLSL ES 3.10 (the oldest GLSL with compute shaders; GLSL has no `f16`, and
/// wgpu's GL backend offers no `SHADER_F16`, so f16 kernels never reach it), panicking with
/// `what` and naga's message on the first failure.
#[cfg(test)]
pub(crate) fn validate_and_translate(source: &str, what: &str) {
    use naga::back::{glsl, hlsl, msl};

    let (module, info) = validate_and_translate_to_spirv(source, what);
    let mut msl_out = String::new();
    msl::Writer::new(&mut msl_out)
        .write(
            &module,
            &info,
            &msl::Options::default(),
            &msl::PipelineOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{what} to MSL: {e}"));
    let mut hlsl_out = String::new();
    hlsl::Writer::new(
        &mut hlsl_out,
        &hlsl::Options::default(),
        &hlsl::PipelineOptions::default(),
    )
    .write(&module, &info, None)
    .unwrap_or_else(|e| panic!("{what} to HLSL: {e}"));
    let f16 = naga::Scalar {
        kind: naga::ScalarKind::Float,
        width: 2,
    };
    let computes_in_f16 = module
        .types
        .iter()
        .any(|(_, ty)| ty.inner.scalar() == Some(f16));
    if computes_in_f16 {
        return;
    }
    for entry_point in &module.entry_points {
        let pipeline = glsl::PipelineOptions {
            shader_stage: entry_point.stage,
            entry_point: entry_point.name.clone(),
            multiview: None,
        };
        let mut glsl_out = String::new();
        glsl::Writer::new(
            &mut glsl_out,
            &module,
            &info,
            &glsl::Options::default(),
            &pipeline,
            naga::proc::BoundsCheckPolicies::default(),
        )
        .and_then(|mut writer| writer.write())
        .unwrap_or_else(|e| panic!("{what} to GLSL ES 3.10: {e}"));
    }
}

/// Parses and validates `source` with naga and translates it to SPIR-V, panicking with `what`
/// and naga's message on the first failure; the module and its validation info, for more.
#[cfg(test)]
pub(crate) fn validate_and_translate_to_spirv(
    source: &str,
    what: &str,
) -> (naga::Module, naga::valid::ModuleInfo) {
    use naga::back::spv;
    use naga::valid::{Capabilities, ValidationFlags, Validator};

    let module = naga::front::wgsl::parse_str(source)
        .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(source)));
    let info = Validator::new(ValidationFlags::all(), Capabilities::all())
        .validate(&module)
        .unwrap_or_else(|e| panic!("{what}: {e:?}"));
    spv::write_vec(&module, &info, &spv::Options::default(), None)
        .unwrap_or_else(|e| panic!("{what} to SPIR-V: {e}"));
    (module, info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_cover_every_workgroup_once() {
        let max = MAX_WORKGROUPS_PER_DIM;
        assert_eq!(launches(0).count(), 0);
        assert_eq!(launches(5).collect::<Vec<_>>(), vec![(0, 5)]);
        assert_eq!(launches(max).collect::<Vec<_>>(), vec![(0, max)]);
        assert_eq!(
            launches(2 * max + 3).collect::<Vec<_>>(),
            vec![(0, max), (max, max), (2 * max, 3)]
        );
    }
}
