//! The `mmlora` command.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use clap::{Parser, Subcommand};
use mmlora::device::{self, DeviceChoice, RuntimeDevice};
use mmlora::lora::meta::{KernelMeta, SlotTable};
use mmlora::lora::ops::{LoraBatch, LoraSlice, lora_apply};
use mmlora::mapping::{
    AdapterRequest, EncoderCache, LoraState, MmFeature, Modality, PlaceholderRange,
    SpatialMergeCounts, set_active_mm_loras,
};

#[derive(Parser)]
#[command(
    name = "mmlora",
    version,
    about = "Vision towers with many LoRA adapters in one batch"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the GPU adapters wgpu sees and the one mmlora would use.
    Devices,
    /// Run one mixed-adapter batch through the mapping builder, the kernel metadata and the
    /// LoRA op at Qwen2-VL's `attn.qkv` shape, and check it against the CPU reference.
    Demo(DemoArgs),
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Where to run the op.
    #[arg(long, value_enum, default_value = "gpu")]
    device: DeviceChoice,
    /// Images in the batch (each a request).
    #[arg(long, default_value_t = 8)]
    images: usize,
    /// Distinct adapters mixed over the images (image i uses adapter i mod (adapters + 1); 0 is none).
    #[arg(long, default_value_t = 4)]
    adapters: usize,
    /// Adapter rank.
    #[arg(long, default_value_t = 16)]
    rank: usize,
    /// Language-model embeddings per image (tower rows are 4× this).
    #[arg(long, default_value_t = 16)]
    embeds: usize,
    /// Input width of the layer.
    #[arg(long, default_value_t = 1280)]
    in_features: usize,
    /// Output width of the layer.
    #[arg(long, default_value_t = 3840)]
    out_features: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Devices => devices(),
        Command::Demo(args) => demo(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

type CliResult = Result<(), Box<dyn std::error::Error>>;

fn devices() -> CliResult {
    use burn::tensor::wgpu::wgpu;
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    if adapters.is_empty() {
        println!("wgpu sees no adapter");
    }
    for adapter in &adapters {
        println!("{}", device::describe(&adapter.get_info()));
    }
    match device::gpu() {
        Ok(gpu) => println!("mmlora uses: {}", gpu.description),
        Err(error) => println!("mmlora cannot use a GPU: {error}"),
    }
    Ok(())
}

fn demo(args: DemoArgs) -> CliResult {
    let target = device::select(args.device)?;
    let cpu = device::cpu();

    // Requests: one image each; image i uses adapter i mod (adapters + 1), 0 meaning none.
    let adapter_of = |i: usize| (i % (args.adapters + 1)) as u32;
    let mut cache = EncoderCache::default();
    let mut state = LoraState::new(args.images);
    let mut index = HashMap::new();
    let mut scheduled = Vec::new();
    for i in 0..args.images {
        let req = format!("image-{i}");
        cache.mm_features.insert(
            req.clone(),
            vec![MmFeature {
                identifier: format!("pixels-{i}"),
                modality: Modality::Image,
                position: PlaceholderRange::new(0, args.embeds),
                has_data: true,
            }],
        );
        let adapter = (adapter_of(i) != 0).then(|| AdapterRequest {
            name: format!("adapter-{}", adapter_of(i)),
            id: adapter_of(i),
            path: PathBuf::new(),
        });
        state.add_request(&req, i, adapter)?;
        index.insert(req.clone(), i);
        scheduled.push((req, vec![0]));
    }
    let activation = set_active_mm_loras(
        &SpatialMergeCounts { merge: 2 },
        &cache,
        &index,
        &state,
        &scheduled,
    )?
    .ok_or("nothing was scheduled")?;
    let table = SlotTable::for_adapters(
        activation.adapters.iter().map(|a| a.id),
        args.adapters.max(1),
    )?;
    let meta = KernelMeta::from_mapping(&activation.tower, &table)?;
    let rows = meta.num_tokens();

    // Random layer and adapters, generated on the CPU so both devices see the same numbers.
    let slots = table.num_slots();
    let x = Tensor::<2>::random(
        [rows, args.in_features],
        Distribution::Uniform(-1.0, 1.0),
        &cpu.device,
    );
    let weight = Tensor::<2>::random(
        [args.out_features, args.in_features],
        Distribution::Uniform(-0.03, 0.03),
        &cpu.device,
    );
    let a = Tensor::<3>::random(
        [slots, args.rank, args.in_features],
        Distribution::Uniform(-0.03, 0.03),
        &cpu.device,
    );
    let b = Tensor::<3>::random(
        [slots, args.out_features, args.rank],
        Distribution::Uniform(-0.1, 0.1),
        &cpu.device,
    );

    let run =
        |on: &RuntimeDevice| -> Result<(Tensor<2>, Tensor<2>, f64), Box<dyn std::error::Error>> {
            let x = x.clone().to_device(&on.device);
            let base = x
                .clone()
                .matmul(weight.clone().to_device(&on.device).transpose());
            let batch = LoraBatch::new(meta.clone(), &on.device);
            let slice = LoraSlice {
                a: a.clone().to_device(&on.device),
                b: b.clone().to_device(&on.device),
                offset: 0,
            };
            on.device.sync()?;
            let start = Instant::now();
            let y = lora_apply(x, base.clone(), &[slice], &batch)?;
            on.device.sync()?;
            Ok((base, y, start.elapsed().as_secs_f64() * 1e3))
        };
    // The first run compiles the kernels; time the second.
    run(&target)?;
    let (base, y, ms) = run(&target)?;
    let (_, reference, _) = run(&cpu)?;

    println!("device: {}", target.description);
    println!(
        "{} images × {} tower rows, {}→{} linear, rank {}, {} adapters mixed: LoRA op {:.2} ms",
        args.images,
        args.embeds * 4,
        args.in_features,
        args.out_features,
        args.rank,
        activation.adapters.len(),
        ms
    );
    let delta = (y.clone() - base).into_data().try_to_vec::<f32>()?;
    let error = (y.to_device(&cpu.device) - reference.clone())
        .into_data()
        .try_to_vec::<f32>()?;
    let scale: f32 = reference.abs().max().into_scalar();
    let rows_per_image = args.embeds * 4;
    for i in 0..args.images {
        let span =
            i * rows_per_image * args.out_features..(i + 1) * rows_per_image * args.out_features;
        let moved = delta[span.clone()]
            .iter()
            .map(|v| v.abs())
            .fold(0.0, f32::max);
        let err = error[span].iter().map(|v| v.abs()).fold(0.0, f32::max);
        let adapter = match adapter_of(i) {
            0 => "none".to_owned(),
            id => format!("adapter-{id}"),
        };
        println!(
            "image-{i}: {rows_per_image} rows, {adapter:<10} max |LoRA delta| {moved:.4}, max |error vs cpu| {err:.2e}"
        );
    }
    println!("reference scale (max |y|): {scale:.3}");
    Ok(())
}
