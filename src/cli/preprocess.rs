//! `mmlora preprocess`: an image's patches and grid exactly as the engine feeds them.

use std::collections::HashMap;
use std::path::PathBuf;

use mmlora::preprocess::{ImageBackend, PreprocessConfig, load_image, preprocess};

use super::output::{OutputTensor, check_not_an_input, files_in, report_to, write_safetensors};
use super::{CliError, choice, model_dir};

/// Arguments of `mmlora preprocess`.
#[derive(Debug, clap::Args)]
pub struct PreprocessArgs {
    /// The image.
    image: PathBuf,
    /// The model folder whose image processor settings apply (`processor_config.json`'s, else
    /// `preprocessor_config.json`'s); default: the bundled model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where to write `pixel_values` (f32) and `image_grid_thw` (i64).
    #[arg(long)]
    out: PathBuf,
    /// Whose image processor to reproduce: transformers 5's two backends.
    #[arg(long, value_parser = choice::of::<ImageBackend>(), default_value = "torchvision")]
    image_backend: ImageBackend,
}

/// Runs `mmlora preprocess`.
pub fn run(args: PreprocessArgs) -> Result<(), CliError> {
    let model = model_dir(args.model)?;
    let mut inputs = files_in(model.path());
    inputs.push(args.image.clone());
    check_not_an_input(&args.out, &inputs)?;
    let config = PreprocessConfig::from_model_dir(model.path())?;
    let patches = preprocess(&load_image(&args.image)?, &config, args.image_backend)
        .map_err(|e| e.in_file(&args.image))?;
    let grid = patches.grid_thw.map(|g| g as i64);
    write_safetensors(
        &args.out,
        &[
            OutputTensor::f32(
                "pixel_values".to_owned(),
                vec![patches.rows(), config.patch_len()],
                &patches.pixel_values,
            ),
            OutputTensor::i64("image_grid_thw".to_owned(), vec![1, 3], &grid),
        ],
        HashMap::from([("image".to_owned(), args.image.display().to_string())]),
    )?;
    report_to(Some(&args.out))(&format!(
        "{}: grid {:?} → {} patches of {} values; wrote {}",
        args.image.display(),
        patches.grid_thw,
        patches.rows(),
        config.patch_len(),
        args.out.display()
    ));
    Ok(())
}
