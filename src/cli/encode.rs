//! `mmlora encode`: images (each with an adapter or none) → per-request embeddings.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use mmlora::adapters::PeftAdapter;
use mmlora::engine::batch::Batch;
use mmlora::engine::{Encoded, Engine, EngineOptions, ImageSource, Request};
use mmlora::ops::kernels::{self, KernelPins};
use mmlora::preprocess::ImageBackend;
use mmlora::runtime::device::{self, DeviceChoice, DeviceClass, Precision};

use super::output::{
    OutputTensor, check_not_an_input, check_writable, files_in, report_to, write_safetensors,
};
use super::{CliError, choice, model_dir};

/// Arguments of `mmlora encode`.
#[derive(Debug, clap::Args)]
pub struct EncodeArgs {
    /// Images to encode, all with `--adapter` (or none). With neither images nor `--batch`, the
    /// bundled example batch runs on the bundled model.
    images: Vec<PathBuf>,
    /// A batch file: `{"adapters": {"NAME": "DIR"}, "requests": [{"id", "image", "adapter"}]}`,
    /// paths relative to the file.
    #[arg(long, conflicts_with_all = ["images", "adapter"])]
    batch: Option<PathBuf>,
    /// A PEFT adapter folder applied to every image given on the command line.
    #[arg(long, requires = "images")]
    adapter: Option<PathBuf>,
    /// A model folder (config.json + safetensors: Qwen2-VL, Qwen2.5-VL or Qwen3-VL); default:
    /// the bundled model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Write the results here as safetensors: `ID.embeds` (and `ID.tower`) per request.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Where to run.
    #[arg(long, value_parser = choice::of::<DeviceChoice>(), default_value = "auto")]
    device: DeviceChoice,
    /// Also write each request's tower output.
    #[arg(long)]
    with_tower: bool,
    /// GPU slots: distinct adapters mixed in one step (more run in more steps).
    #[arg(long, default_value_t = EngineOptions::default().max_loras)]
    max_loras: usize,
    /// The largest adapter rank accepted.
    #[arg(long, default_value_t = EngineOptions::default().max_rank)]
    max_rank: usize,
    /// The float type to compute in (the outputs stay f32).
    #[arg(long, value_parser = choice::of::<Precision>(), default_value = "f32")]
    precision: Precision,
    /// Whose image processor to reproduce: transformers 5's two backends.
    #[arg(long, value_parser = choice::of::<ImageBackend>(), default_value = "torchvision")]
    image_backend: ImageBackend,
}

/// Runs `mmlora encode`.
pub fn run(args: EncodeArgs) -> Result<(), CliError> {
    let model = model_dir(args.model.clone())?;
    let model_dir = model.path();
    let (job, batch_file) = batch(&args, model_dir)?;
    if let Some(out) = &args.out {
        check_writable(out)?;
        check_not_an_input(out, &inputs(&job, batch_file, model_dir))?;
    }
    let device = device::select(args.device)?;
    // Progress on stderr, results on stdout: a reader that stops early (`| head`) ends the
    // command only after its output file is written.
    eprintln!("device: {}", device.description);
    if args.device == DeviceChoice::Auto && device.class() == DeviceClass::Cpu {
        eprintln!("  (auto: wgpu found no hardware GPU; --device gpu forces wgpu anyway)");
    }
    let pins = KernelPins::from_env()?;
    if pins != KernelPins::default() {
        eprintln!("kernels: {pins} ({})", kernels::ENV);
    }
    let options = EngineOptions {
        max_loras: args.max_loras,
        max_rank: args.max_rank,
        max_cpu_adapters: EngineOptions::default()
            .max_cpu_adapters
            .max(args.max_loras),
        precision: args.precision,
        image_backend: args.image_backend,
        ..EngineOptions::default()
    };
    let started = Instant::now();
    let mut engine = Engine::open(model_dir, device, options)?;
    for (name, dir) in &job.adapters {
        engine.load_adapter(name, dir)?;
    }
    eprintln!(
        "model: {} loaded in {:.2} s",
        model.label(),
        started.elapsed().as_secs_f64()
    );
    let encoded = engine.encode(&job.requests, args.with_tower)?;
    if let Some(out) = &args.out {
        write_results(out, &encoded, model.label(), &engine)?;
    }
    let steps = encoded.iter().map(|e| e.step + 1).max().unwrap_or(0);
    let report = report_to(args.out.as_deref());
    for result in &encoded {
        report(&summary_line(result, steps));
    }
    if let Some(out) = &args.out {
        let requests = match encoded.len() {
            1 => "1 request".to_owned(),
            n => format!("{n} requests"),
        };
        report(&format!("wrote {} ({requests})", out.display()));
    }
    Ok(())
}

/// One line per request: tokens, adapter, step and its time.
fn summary_line(result: &Encoded, steps: usize) -> String {
    let tower_rows: usize = result.grid_thw.iter().product();
    let [embeds, hidden] = result.embeds.shape;
    let deepstack = match &result.deepstack {
        Some(d) => format!(", deepstack {} × {}", d.shape[0], d.shape[1]),
        None => String::new(),
    };
    format!(
        "{}: {tower_rows} tower tokens → {embeds} embeddings × {hidden}{deepstack}, adapter {}, step {}/{steps} {:.1} ms",
        result.id,
        result.adapter.as_deref().unwrap_or("none"),
        result.step + 1,
        result.step_time.as_secs_f64() * 1e3
    )
}

/// The job the arguments describe, and the batch file it was read from (if any).
fn batch(args: &EncodeArgs, model_dir: &Path) -> Result<(Batch, Option<PathBuf>), CliError> {
    let file = match (&args.batch, args.images.is_empty()) {
        (Some(file), _) => file.clone(),
        (None, false) => return Ok((images_job(&args.images, args.adapter.as_deref()), None)),
        (None, true) => model_dir.join("batch.json"),
    };
    if args.batch.is_none() && args.model.is_some() {
        return Err(CliError::Usage(
            "nothing to encode: give IMAGE... or --batch FILE (the bundled example batch runs \
             only on the bundled model)"
                .to_owned(),
        ));
    }
    Ok((Batch::read(&file)?, Some(file)))
}

/// Every file the job reads: its images, its batch file, and the files of the model's and the
/// adapters' folders.
fn inputs(job: &Batch, batch_file: Option<PathBuf>, model_dir: &Path) -> Vec<PathBuf> {
    let images = job.requests.iter().filter_map(|r| match &r.image {
        ImageSource::File(path) => Some(path.clone()),
        _ => None,
    });
    let folders =
        std::iter::once(model_dir).chain(job.adapters.iter().map(|(_, dir)| dir.as_path()));
    images
        .chain(batch_file)
        .chain(folders.flat_map(files_in))
        .collect()
}

/// Images from the command line, all with one adapter (named after its folder) or none. Each
/// request's id is the image's file name, with `#2`, `#3`… for a name already taken.
fn images_job(images: &[PathBuf], adapter: Option<&Path>) -> Batch {
    let name = adapter.map(PeftAdapter::name_for);
    let mut ids: HashSet<String> = HashSet::new();
    let requests = images
        .iter()
        .map(|image| {
            let file = image.file_name().map_or_else(
                || image.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            let mut id = file.clone();
            for repeat in 2.. {
                if ids.insert(id.clone()) {
                    break;
                }
                id = format!("{file}#{repeat}");
            }
            Request {
                id,
                image: ImageSource::File(image.clone()),
                adapter: name.clone(),
            }
        })
        .collect();
    Batch {
        adapters: name
            .zip(adapter)
            .map(|(name, dir)| (name, dir.to_owned()))
            .into_iter()
            .collect(),
        requests,
    }
}

fn write_results(
    out: &Path,
    encoded: &[Encoded],
    model: &str,
    engine: &Engine,
) -> Result<(), CliError> {
    let mut tensors = Vec::new();
    let mut metadata = HashMap::from([
        ("model".to_owned(), model.to_owned()),
        ("device".to_owned(), engine.device().description.clone()),
    ]);
    for result in encoded {
        let embeds = &result.embeds;
        tensors.push(OutputTensor::f32(
            format!("{}.embeds", result.id),
            embeds.shape.to_vec(),
            &embeds.values,
        ));
        for (name, output) in [("tower", &result.tower), ("deepstack", &result.deepstack)] {
            if let Some(output) = output {
                tensors.push(OutputTensor::f32(
                    format!("{}.{name}", result.id),
                    output.shape.to_vec(),
                    &output.values,
                ));
            }
        }
        metadata.insert(
            format!("{}.adapter", result.id),
            result.adapter.clone().unwrap_or_default(),
        );
    }
    write_safetensors(out, &tensors, metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_ids_stay_unique_when_a_file_is_named_like_a_repeat() {
        let images = ["a/x.png#2", "a/x.png", "b/x.png", "x.png"].map(PathBuf::from);
        let ids: Vec<String> = images_job(&images, None)
            .requests
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(ids, ["x.png#2", "x.png", "x.png#3", "x.png#4"]);
    }
}
