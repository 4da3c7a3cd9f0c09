//! mmlora's desktop demo: see what each adapter does to an image, live, on the GPU you have.
//!
//! `cargo run --release --example demo` opens the window; `-- --screenshot FILE.png --frames N`
//! runs the preset batch, renders N frames after it finished, saves a screenshot and exits
//! (exit code 1 if anything failed), so the demo can be checked without a person. With another
//! `--model`, only the bundled adapters, images and preset rows that its folder has are loaded
//! (none for a checkpoint from the hub, which starts with an empty batch and runs nothing).
//!
//! The window and the engine share one wgpu device: Burn opens it, egui renders on it.

mod app;
mod worker;

use std::path::PathBuf;

use clap::Parser;
use eframe::egui_wgpu::{WgpuConfiguration, WgpuSetup, WgpuSetupExisting};
use mmlora::runtime::device;

/// The window can switch the compute to the CPU backend, where a caching allocator matters.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(about = "mmlora desktop demo")]
struct Args {
    /// Save a screenshot here after the preset batch has run, then exit.
    #[arg(long)]
    screenshot: Option<PathBuf>,
    /// Frames to render after the preset batch finished, before the screenshot.
    #[arg(long, default_value_t = 10)]
    frames: u32,
    /// The model folder (default: the bundled model).
    #[arg(long)]
    model: Option<PathBuf>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let model_dir = args
        .model
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-qwen2-vl"));
    // One device for compute and rendering; without a GPU egui picks its own and the engine
    // runs on the CPU backend.
    let gpu = device::gpu().ok();
    let mut wgpu_options = WgpuConfiguration::default();
    if let Some(shared) = gpu.as_ref().and_then(|g| g.wgpu.clone()) {
        wgpu_options.wgpu_setup = WgpuSetup::Existing(WgpuSetupExisting {
            instance: shared.instance,
            adapter: shared.adapter,
            device: shared.device,
            queue: shared.queue,
        });
    }
    let options = eframe::NativeOptions {
        viewport: eframe::egui::ViewportBuilder::default()
            .with_title("mmlora — many LoRA adapters, one batch")
            .with_inner_size([1360.0, 900.0]),
        renderer: eframe::Renderer::Wgpu,
        wgpu_options,
        ..eframe::NativeOptions::default()
    };
    let screenshot = args
        .screenshot
        .map(|file| app::ScreenshotPlan::new(file, args.frames));
    eframe::run_native(
        "mmlora demo",
        options,
        Box::new(move |cc| Ok(Box::new(app::DemoApp::new(cc, model_dir, gpu, screenshot)))),
    )?;
    if app::SCREENSHOT_RUN_FAILED.load(std::sync::atomic::Ordering::SeqCst) {
        std::process::exit(1);
    }
    Ok(())
}
