//! The checks that refuse what cannot run before anything runs: options, the model folder's
//! consistency, stacks that would not fit the device, weights beyond f16, request ids and
//! each request's image or patches.

use std::collections::HashSet;
use std::path::Path;

use image::RgbImage;

use super::{EngineError, EngineOptions, ImageSource, MAX_LORAS, Request};
use crate::models::{PatchLayout, VisionTower};
use crate::ops::lora::MAX_RANK;
use crate::preprocess::{
    ImageBackend, Patches, PreprocessConfig, PreprocessError, decode_image, load_image, preprocess,
};
use crate::runtime::device::RuntimeDevice;

/// What errors call an image given as bytes ([`ImageSource::Encoded`]).
const ENCODED_IMAGE: &str = "(the request's image bytes)";

/// Refuses a batch in which two requests share an id.
pub(super) fn check_ids(requests: &[Request]) -> Result<(), EngineError> {
    let mut ids = HashSet::new();
    match requests.iter().find(|r| !ids.insert(r.id.as_str())) {
        Some(request) => Err(EngineError::DuplicateRequest(request.id.clone())),
        None => Ok(()),
    }
}

/// The request's patches (decoded and preprocessed, or as given), checked against the model.
pub(super) fn request_patches(
    request: &Request,
    preprocess_config: &PreprocessConfig,
    backend: ImageBackend,
    layout: PatchLayout,
) -> Result<Patches, EngineError> {
    let image_error = |source| EngineError::Image {
        request: request.id.clone(),
        source,
    };
    // A file's image, or its bytes', with what errors call it.
    let file = |decoded: Result<RgbImage, PreprocessError>, name: &Path| {
        preprocess(&decoded.map_err(image_error)?, preprocess_config, backend)
            .map_err(|e| image_error(e.in_file(name)))
    };
    let patches = match &request.image {
        ImageSource::File(path) => file(load_image(path), path)?,
        ImageSource::Encoded(bytes) => {
            let name = Path::new(ENCODED_IMAGE);
            file(decode_image(bytes, name), name)?
        }
        ImageSource::Decoded(image) => {
            preprocess(image, preprocess_config, backend).map_err(image_error)?
        }
        ImageSource::Patches(patches) => patches.clone(),
    };
    let [t, h, w] = patches.grid_thw;
    let m = layout.spatial_merge_size;
    let reason = if t == 0 || h == 0 || w == 0 || h % m != 0 || w % m != 0 {
        Some(format!(
            "grid {:?} is empty or not a multiple of the merge size {m}",
            patches.grid_thw
        ))
    } else if patches.pixel_values.len() != patches.rows().saturating_mul(layout.patch_len()) {
        Some(format!(
            "{} pixel values do not make {} rows of {}",
            patches.pixel_values.len(),
            patches.rows(),
            layout.patch_len()
        ))
    } else {
        None
    };
    match reason {
        Some(reason) => Err(EngineError::Patches {
            request: request.id.clone(),
            reason,
        }),
        None => Ok(patches),
    }
}

/// Refuses a model with a weight f16 cannot hold (one read-back of every weight's largest
/// magnitude).
#[cfg(not(target_arch = "wasm32"))]
pub(super) fn check_fits_f16(model: &dyn VisionTower) -> Result<(), EngineError> {
    let (names, largest) = model.cast_magnitudes();
    let largest = largest
        .try_into_vec_as::<f32>()
        .map_err(|e| EngineError::Execution(e.to_string()))?;
    let limit = f32::from(half::f16::MAX);
    match largest.iter().position(|&v| v > limit) {
        Some(at) => Err(EngineError::WeightBeyondF16 {
            tensor: names[at].clone(),
            largest: largest[at],
        }),
        None => Ok(()),
    }
}

/// A page cannot wait for the read-back that checks the weights fit f16, and the engine is
/// opened synchronously: f16 is refused there.
#[cfg(target_arch = "wasm32")]
pub(super) fn check_fits_f16(_: &dyn VisionTower) -> Result<(), EngineError> {
    Err(EngineError::Options(
        "f16 is not offered in a browser: the check that every weight fits f16 reads them back, \
         which a page cannot wait for"
            .to_owned(),
    ))
}

/// Refuses `max_loras` and `max_rank` whose stacked LoRA weights for some layer (A or B of every
/// slot at the largest rank, `[max_loras, max_rank, in]` or `[max_loras, out, max_rank]`) would
/// not fit one buffer of the device: whatever adapters then fill the slots, their stacks bind.
/// vLLM likewise allocates `max_loras × max_lora_rank` at start.
pub(super) fn check_stacks_fit(
    model: &dyn VisionTower,
    options: &EngineOptions,
    device: &RuntimeDevice,
) -> Result<(), EngineError> {
    let Some(limit) = device.buffer_limit else {
        return Ok(());
    };
    let value_bytes = options.precision.dtype().size() as u64;
    let stack = |width: usize| {
        (options.max_loras as u64) * (options.max_rank as u64) * (width as u64) * value_bytes
    };
    match model
        .lora_targets()
        .into_iter()
        .map(|t| (stack(t.in_features.max(t.out_features)), t.path))
        .find(|&(bytes, _)| bytes > limit)
    {
        Some((bytes, path)) => Err(EngineError::Options(format!(
            "max_loras {} × max_rank {} stack {:.1} MiB of LoRA weights for `{path}`, above the \
             {:.1} MiB {} binds in one buffer; lower max_loras or max_rank",
            options.max_loras,
            options.max_rank,
            bytes as f64 / f64::from(1 << 20),
            limit as f64 / f64::from(1 << 20),
            device.description
        ))),
        None => Ok(()),
    }
}

/// Whether the image processor's settings can run and cut patches the way the model reads
/// them.
pub(super) fn check_consistent(
    preprocess: &PreprocessConfig,
    backend: ImageBackend,
    layout: PatchLayout,
) -> Result<(), String> {
    if let Some((key, reason)) = preprocess.unusable_on(backend) {
        return Err(format!("`{key}` {reason}"));
    }
    let fields = [
        ("patch_size", preprocess.patch_size, layout.patch_size),
        (
            "temporal_patch_size",
            preprocess.temporal_patch_size,
            layout.temporal_patch_size,
        ),
        (
            "merge_size",
            preprocess.merge_size,
            layout.spatial_merge_size,
        ),
    ];
    match fields
        .into_iter()
        .find(|(_, processor, model)| processor != model)
    {
        Some((field, processor, model)) => Err(format!(
            "{field} is {processor} but the model's config.json has {model}"
        )),
        None => Ok(()),
    }
}

/// Refuses options that cannot work, or not on `device` (f16 where the GPU lacks it).
pub(super) fn check_options(
    options: &EngineOptions,
    device: &RuntimeDevice,
) -> Result<(), EngineError> {
    let problem = if !(1..=MAX_LORAS).contains(&options.max_loras) {
        Some(format!("max_loras must be in 1..={MAX_LORAS}"))
    } else if !(1..=MAX_RANK).contains(&options.max_rank) {
        Some(format!("max_rank must be in 1..={MAX_RANK}"))
    } else if options.max_cpu_adapters < options.max_loras {
        Some(format!(
            "max_cpu_adapters ({}) must be at least max_loras ({})",
            options.max_cpu_adapters, options.max_loras
        ))
    } else if options.max_step_rows == 0 {
        Some("max_step_rows must be at least 1".to_owned())
    } else if !device.supports(options.precision) {
        Some(format!(
            "{} needs a GPU whose adapter has SHADER_F16; {} does not offer it",
            options.precision, device.description
        ))
    } else {
        None
    };
    match problem {
        Some(problem) => Err(EngineError::Options(problem)),
        None => Ok(()),
    }
}
