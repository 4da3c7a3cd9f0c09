//! `mmlora bench`: throughput with K distinct adapters mixed in one batch against the base,
//! (`--scale`) how time and memory grow with images and adapters, or (`--stages`) where a
//! batch's time goes.

use std::path::PathBuf;

use mmlora::bench::op::{OpMix, OpShape};
use mmlora::bench::scale::{self, ScaleSpec};
use mmlora::bench::stages;
use mmlora::bench::{self, BenchSpec};
use mmlora::engine::MAX_LORAS;
use mmlora::models::Preset;
use mmlora::ops::kernels::KernelPins;
use mmlora::ops::lora::{MAX_RANK, ShrinkKernel};
use mmlora::preprocess::MAX_DECODED_PIXELS;
use mmlora::runtime::device::{self, DeviceChoice, DeviceClass, Precision, RuntimeDevice};

use super::output::check_writable;
use super::{CliError, choice};

/// Arguments of `mmlora bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The model shape (random weights in the real layout).
    #[arg(long, value_parser = choice::of::<Preset>(), default_value = "qwen2-vl-2b")]
    preset: Preset,
    /// Images per batch.
    #[arg(long, default_value_t = BenchSpec::default().images)]
    images: usize,
    /// Side of each square image in pixels [default: 224; 112 on a software GPU such as
    /// lavapipe, to keep the default set within 20 minutes on 2 cores].
    #[arg(long)]
    side: Option<usize>,
    /// Distinct adapters mixed per configuration, comma-separated (1: all images share one).
    #[arg(long, value_delimiter = ',', default_values_t = BenchSpec::default().adapters)]
    adapters: Vec<usize>,
    /// Adapter ranks, comma-separated, crossed with --adapters.
    #[arg(long, value_delimiter = ',', default_values_t = BenchSpec::default().ranks)]
    ranks: Vec<usize>,
    /// Timed runs per configuration (after one warm-up run), in rounds that take turns; the
    /// median time is reported, and the median of the rounds' ratios to the base.
    #[arg(long, default_value_t = BenchSpec::default().repeats)]
    repeats: usize,
    /// Where to run.
    #[arg(long, value_parser = choice::of::<DeviceChoice>(), default_value = "auto")]
    device: DeviceChoice,
    /// The float type to compute in.
    #[arg(long, value_parser = choice::of::<Precision>(), default_value = "f32")]
    precision: Precision,
    /// Kernels to pin, as OP=KERNEL,… (ops: linear, shrink, attention; docs/cli.md lists their
    /// kernels); MMLORA_KERNELS pins the ops left out. Where the linears are left to the
    /// device, the base also runs with each candidate kernel pinned, and where attention is
    /// left to a GPU, with the other implementation: to compare them in one run.
    #[arg(long, value_name = "OP=KERNEL,…", value_parser = |text: &str| text.parse::<KernelPins>())]
    kernels: Option<KernelPins>,
    /// One JSON object per configuration instead of a table.
    #[arg(long)]
    json: bool,
    /// Rows for the LoRA op alone (at the preset's attn.qkv, with the most --adapters mixed),
    /// against the base linear, a naive gather-and-batched-matmul and the op onto the first 4
    /// columns alone (its shrink, next to no expand), comma-separated [default: 256,4096;
    /// 256,1024 on a software GPU].
    #[arg(long, value_delimiter = ',')]
    op_rows: Option<Vec<usize>>,
    /// How the LoRA op's rows take the adapters, comma-separated (rows: row by row, so no two
    /// neighbouring rows share one; runs: one run of rows per adapter, as a batch's images
    /// hold their tokens).
    #[arg(long, value_parser = choice::of::<OpMix>(), value_delimiter = ',', default_value = "rows")]
    op_mix: Vec<OpMix>,
    /// Skip the LoRA op comparison.
    #[arg(long)]
    no_op: bool,
    /// Also draw throughput against the number of mixed adapters into this PNG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Instead of the throughput set, sweep images per batch (at the base and with the most
    /// --adapters mixed) and then adapters loaded past the GPU slots; time and peak memory of
    /// each, at the first of --ranks [side default: 112].
    #[arg(long, conflicts_with_all = ["plot", "op_rows", "op_mix", "no_op", "images"])]
    scale: bool,
    /// Images per batch in the --scale image sweep, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = ScaleSpec::default().images)]
    scale_images: Vec<usize>,
    /// Adapters in the --scale adapter sweep, comma-separated (each batch has the most
    /// --scale-images images, cycling through the adapters).
    #[arg(long, value_delimiter = ',', default_values_t = ScaleSpec::default().adapters)]
    scale_adapters: Vec<usize>,
    /// GPU slots in the --scale adapter sweep.
    #[arg(long, default_value_t = ScaleSpec::default().slots)]
    slots: usize,
    /// Instead of the throughput set, time each stage of the forward pass (norms, each linear,
    /// attention, the LoRA op…) at the base and with the most --adapters mixed at the first of
    /// --ranks, with the products' TFLOP/s; the device is waited for after every stage, so
    /// plain passes run beside them for comparison.
    #[arg(long, conflicts_with_all = ["plot", "op_rows", "op_mix", "no_op", "scale"])]
    stages: bool,
}

/// The most images a batch, or the --scale image sweep, may hold.
const MAX_IMAGES: usize = 1024;
/// The most rows the LoRA op alone is timed at.
const MAX_OP_ROWS: usize = 1 << 16;
/// The most adapters the --scale adapter sweep loads (each holds random weights in memory).
const MAX_SCALE_ADAPTERS: usize = 256;
/// The most timed runs per configuration.
const MAX_REPEATS: usize = 1000;
/// The largest image side: the most pixels a decoded image may have, as a square.
const MAX_SIDE: usize = MAX_DECODED_PIXELS.isqrt() as usize;

/// Refuses counts the bench cannot use, naming the flag, before anything is allocated for them.
fn check_ranges(args: &BenchArgs) -> Result<(), CliError> {
    let flags: [(&str, &[usize], usize, usize); 9] = [
        ("--images", &[args.images], 1, MAX_IMAGES),
        ("--side", args.side.as_slice(), 1, MAX_SIDE),
        ("--adapters", &args.adapters, 1, MAX_LORAS),
        ("--ranks", &args.ranks, 1, MAX_RANK),
        ("--repeats", &[args.repeats], 1, MAX_REPEATS),
        (
            "--op-rows",
            args.op_rows.as_deref().unwrap_or_default(),
            1,
            MAX_OP_ROWS,
        ),
        ("--scale-images", &args.scale_images, 1, MAX_IMAGES),
        (
            "--scale-adapters",
            &args.scale_adapters,
            1,
            MAX_SCALE_ADAPTERS,
        ),
        ("--slots", &[args.slots], 1, MAX_LORAS),
    ];
    for (flag, values, low, high) in flags {
        if let Some(value) = values.iter().find(|v| !(low..=high).contains(*v)) {
            return Err(CliError::Usage(format!(
                "{flag} {value} is outside {low}..={high}"
            )));
        }
    }
    Ok(())
}

/// Runs `mmlora bench`.
pub fn run(args: BenchArgs) -> Result<(), CliError> {
    check_ranges(&args)?;
    if let Some(plot) = &args.plot {
        let png = plot
            .extension()
            .is_some_and(|extension| extension.eq_ignore_ascii_case("png"));
        if !png {
            return Err(CliError::Usage(format!(
                "--plot {}: the plot is a PNG; name the file *.png",
                plot.display()
            )));
        }
        check_writable(plot)?;
    }
    let runtime = device::select(args.device)?;
    eprintln!("device: {}", runtime.description);
    let kernels = args.kernels.unwrap_or_default().or(KernelPins::from_env()?);
    if kernels != KernelPins::default() {
        eprintln!("kernels: {kernels}");
    }
    kernels.check(&runtime, args.precision)?;
    if args.scale {
        return run_scale(args, kernels, &runtime);
    }
    let software_gpu = runtime.class() == DeviceClass::SoftwareGpu;
    let side = args.side.unwrap_or(if software_gpu {
        bench::SOFTWARE_GPU_SIDE
    } else {
        BenchSpec::default().side
    });
    let spec = BenchSpec {
        preset: args.preset,
        images: args.images,
        side,
        adapters: args.adapters,
        ranks: args.ranks,
        repeats: args.repeats,
        precision: args.precision,
        kernels,
    }
    .as_run()?;
    if spec.side != side {
        eprintln!(
            "images of {side}² run as {}² (the image processor's resize)",
            spec.side
        );
    }
    if args.stages {
        return run_stages(&spec, &runtime, args.json);
    }
    let records = bench::run(&spec, &runtime, |configuration| {
        eprintln!("{configuration}…");
    })?;
    // The plot and the lines first, then the op runs' lines one by one: a run stopped midway
    // keeps what it printed; a reader that stops reading early (`| head`) ends the process on
    // its next line.
    if let Some(path) = &args.plot {
        super::plot::throughput_png(&records, path)?;
        eprintln!("plot: {}", path.display());
    }
    if args.json {
        for record in &records {
            println!("{}", json_line(record));
        }
    } else {
        println!(
            "{:>8} {:>5} {:>7} {:>9} {:>9} {:>12} {:>10} {:>14}",
            "adapters", "rank", "linear", "shrink", "attention", "median ms", "img/s", "vs base"
        );
        for r in &records {
            println!(
                "{:>8} {:>5} {:>7} {:>9} {:>9} {:>12.1} {:>10.2} {:>13.3}×",
                r.setup.adapters,
                r.setup.rank,
                r.setup.linear_kernel,
                r.setup.lora_shrink.as_deref().unwrap_or("native"),
                r.setup.attention_kernel,
                r.median_ms,
                r.img_per_s,
                r.ratio_vs_base
            );
        }
    }
    let mixed = spec.adapters.iter().copied().max().unwrap_or(1);
    let op_rows = match (args.no_op, args.op_rows) {
        (true, _) => vec![],
        (false, Some(rows)) => rows,
        (false, None) if software_gpu => bench::SOFTWARE_GPU_OP_ROWS.to_vec(),
        (false, None) => bench::OP_ROWS.to_vec(),
    };
    if !args.json && !op_rows.is_empty() {
        println!(
            "\nLoRA op alone at attn.qkv ({mixed} adapters mixed): median ms, and what it adds to the base linear"
        );
        println!(
            "(then back to back, {} calls between syncs: the base's ms per call and what the op adds, \
             and the op fused into the base linear where its kernel is one of ours)",
            bench::op::BACK_TO_BACK_CALLS
        );
        println!(
            "{:>6} {:>4} {:>5} {:>9} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9}",
            "rows",
            "mix",
            "rank",
            "shrink",
            "base",
            "+op",
            "+naive",
            "+op[:4]",
            "op",
            "naive",
            "op[:4]",
            "b2b base",
            "b2b op",
            "b2b [:4]",
            "b2b fused"
        );
    }
    let shrink_kernels = bench::op::shrink_kernels(spec.kernels.shrink, &runtime);
    let op_variants: Vec<(OpMix, ShrinkKernel)> = args
        .op_mix
        .iter()
        .flat_map(|&mix| shrink_kernels.iter().map(move |&kernel| (mix, kernel)))
        .collect();
    for &rank in &spec.ranks {
        for &rows in &op_rows {
            for &(mix, lora_shrink) in &op_variants {
                eprintln!(
                    "the LoRA op alone: {rows} rows, rank {rank}, {mixed} adapters mixed by {}, \
                     {} shrink…",
                    mix, lora_shrink
                );
                let shape = OpShape {
                    mix,
                    precision: spec.precision,
                    linear_kernel: spec.kernels.linear,
                    lora_shrink,
                    ..OpShape::qkv(spec.preset.embed_dim(), rows, rank, mixed)
                };
                let op = bench::op::run(shape, &runtime, spec.repeats);
                if args.json {
                    println!("{}", json_line(&op));
                } else {
                    println!(
                        "{:>6} {:>4} {:>5} {:>9} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>+8.1}% {:>+8.1}% {:>+8.1}% {:>10.3} {:>+8.1}% {:>+8.1}% {:>+8.1}%",
                        op.rows,
                        op.op_mix,
                        op.rank,
                        op.lora_shrink.as_deref().unwrap_or("native"),
                        op.base_ms,
                        op.lora_ms,
                        op.naive_ms,
                        op.narrow_lora_ms,
                        op.lora_overhead * 100.0,
                        op.naive_overhead * 100.0,
                        op.narrow_lora_overhead * 100.0,
                        op.base_back_to_back_ms,
                        op.lora_back_to_back_overhead * 100.0,
                        op.narrow_lora_back_to_back_overhead * 100.0,
                        op.fused_back_to_back_overhead * 100.0
                    );
                }
            }
        }
    }
    Ok(())
}

/// One record as a line of JSON.
fn json_line(record: &impl serde::Serialize) -> String {
    serde_json::to_string(record).expect("records serialise")
}

/// Runs `mmlora bench --stages`.
fn run_stages(spec: &BenchSpec, runtime: &RuntimeDevice, json: bool) -> Result<(), CliError> {
    let profiles = stages::run(spec, runtime, |step| eprintln!("{step}…"))?;
    for profile in &profiles {
        if json {
            println!("{}", json_line(profile));
            continue;
        }
        println!(
            "\n{} adapters of rank {}, {} linears, {} attention: plain pass {:.1} ms, clocked \
             {:.1} ms",
            profile.setup.adapters,
            profile.setup.rank,
            profile.setup.linear_kernel,
            profile.setup.attention_kernel,
            profile.plain_ms,
            profile.clocked_ms
        );
        println!(
            "{:>12} {:>6} {:>10} {:>7} {:>9} {:>9}",
            "stage", "marks", "median ms", "share", "GFLOP", "TFLOP/s"
        );
        let or_dash = |value: Option<f64>, digits: usize| {
            value.map_or("-".to_owned(), |v| format!("{v:.digits$}"))
        };
        for line in &profile.stages {
            println!(
                "{:>12} {:>6} {:>10.2} {:>6.1}% {:>9} {:>9}",
                line.stage,
                line.marks,
                line.median_ms,
                line.share * 100.0,
                or_dash(line.gflop, 1),
                or_dash(line.tflop_per_s, 3)
            );
        }
    }
    Ok(())
}

/// Runs `mmlora bench --scale`.
fn run_scale(
    args: BenchArgs,
    kernels: KernelPins,
    runtime: &RuntimeDevice,
) -> Result<(), CliError> {
    let spec = ScaleSpec {
        preset: args.preset,
        side: args.side.unwrap_or(scale::SCALE_SIDE),
        rank: args.ranks[0],
        repeats: args.repeats,
        adapter_images: args.scale_images.iter().copied().max().unwrap_or(1),
        images: args.scale_images,
        mixed: args.adapters.iter().copied().max().unwrap_or(1),
        adapters: args.scale_adapters,
        slots: args.slots,
        precision: args.precision,
        kernels,
    };
    // JSON lines as each configuration is timed; the table once all are.
    let records = scale::run(
        &spec,
        runtime,
        |configuration| eprintln!("{configuration}…"),
        |record| {
            if args.json {
                println!("{}", json_line(record));
            }
        },
    )?;
    if args.json {
        return Ok(());
    }
    let mib = |value: Option<f64>| value.map_or("-".to_owned(), |v| format!("{v:.0}"));
    println!(
        "{:>8} {:>6} {:>6} {:>8} {:>5} {:>5} {:>11} {:>9} {:>8} {:>10} {:>9} {:>10}",
        "sweep",
        "images",
        "loaded",
        "adapters",
        "slots",
        "steps",
        "median ms",
        "ms/image",
        "img/s",
        "RSS before",
        "peak RSS",
        "device MiB"
    );
    for r in &records {
        println!(
            "{:>8} {:>6} {:>6} {:>8} {:>5} {:>5} {:>11.1} {:>9.1} {:>8.2} {:>10} {:>9} {:>10}",
            r.sweep,
            r.setup.images,
            r.loaded,
            r.setup.adapters,
            r.slots,
            r.steps,
            r.median_ms,
            r.ms_per_image,
            r.img_per_s,
            mib(r.start_rss_mib),
            mib(r.peak_rss_mib),
            mib(r.device_reserved_mib)
        );
    }
    Ok(())
}
