//! Helpers the ops' tests share.

use burn::backend::wgpu::KernelSource;
use burn::tensor::Tensor;

use crate::runtime::wgsl::{Elem, ElemShader, validate_and_translate};

/// A tensor's values, widened to f64.
pub fn to_f64<const D: usize>(t: &Tensor<D>) -> Vec<f64> {
    t.clone()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// The shader files in `shaders/<op>/`, by name: an op's test checks that each is one it knows
/// (and so validates), so that no file there goes unchecked.
pub fn shader_files(op: &str) -> Vec<String> {
    let folder = format!("{}/shaders/{op}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_dir(&folder)
        .unwrap_or_else(|e| panic!("{folder}: {e}"))
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// `shader`, the one file in `shaders/<op>/`, is valid WGSL in both element types that naga
/// translates for every backend wgpu has.
pub fn check_elem_shader(op: &str, shader: ElemShader) {
    assert_eq!(shader_files(op), [shader.file_name]);
    for elem in Elem::ALL {
        let source = shader.kernel(elem).source().complete();
        validate_and_translate(&source, &format!("{} {elem:?}", shader.file_name));
    }
}
