//! `mmlora bench`: throughput with K distinct adapters mixed in one batch against the base.

use mmlora::bench::{self, BenchSpec, Preset};
use mmlora::device::{self, DeviceChoice};

use super::CliError;

/// Arguments of `mmlora bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The model shape (random weights in the real layout).
    #[arg(long, value_enum, default_value = "qwen2-vl-2b")]
    preset: Preset,
    /// Images per batch.
    #[arg(long, default_value_t = BenchSpec::default().images)]
    images: usize,
    /// Side of each square image in pixels.
    #[arg(long, default_value_t = BenchSpec::default().side)]
    side: usize,
    /// Distinct adapters mixed per configuration, comma-separated (1: all images share one).
    #[arg(long, value_delimiter = ',', default_values_t = BenchSpec::default().adapters)]
    adapters: Vec<usize>,
    /// Adapter ranks, comma-separated, crossed with --adapters.
    #[arg(long, value_delimiter = ',', default_values_t = BenchSpec::default().ranks)]
    ranks: Vec<usize>,
    /// Timed runs per configuration (after one warm-up run); the median is reported.
    #[arg(long, default_value_t = BenchSpec::default().repeats)]
    repeats: usize,
    /// Where to run.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceChoice,
    /// One JSON object per configuration instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs `mmlora bench`.
pub fn run(args: BenchArgs) -> Result<(), CliError> {
    if args.images == 0 || args.adapters.contains(&0) || args.ranks.contains(&0) {
        return Err(CliError::Usage(
            "--images, --adapters and --ranks must be at least 1".to_owned(),
        ));
    }
    let spec = BenchSpec {
        preset: args.preset,
        images: args.images,
        side: args.side,
        adapters: args.adapters,
        ranks: args.ranks,
        repeats: args.repeats,
    };
    let runtime = device::select(args.device)?;
    let kind = if runtime.wgpu.is_some() { "gpu" } else { "cpu" };
    eprintln!("device: {}", runtime.description);
    let records = bench::run(&spec, &runtime, kind, |configuration| {
        eprintln!("{configuration}…");
    })?;
    if args.json {
        for record in &records {
            println!(
                "{}",
                serde_json::to_string(record).expect("records serialise")
            );
        }
    } else {
        println!(
            "{:>8} {:>5} {:>12} {:>10} {:>14}",
            "adapters", "rank", "median ms", "img/s", "vs base"
        );
        for r in &records {
            println!(
                "{:>8} {:>5} {:>12.1} {:>10.2} {:>13.3}×",
                r.adapters, r.rank, r.median_ms, r.img_per_s, r.ratio_vs_base
            );
        }
    }
    Ok(())
}
