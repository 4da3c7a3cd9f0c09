//! The `mmlora` command.

mod cli;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use mmlora::runtime::progress;
use tracing::Level;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::prelude::*;

use cli::bench::BenchArgs;
use cli::encode::EncodeArgs;
use cli::inspect::InspectArgs;
use cli::preprocess::PreprocessArgs;

/// The CPU backend allocates each op's output afresh; mimalloc hands freed buffers back out
/// instead of returning them to the system after every op (see BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Encode images, each with its own adapter or none, into per-request embeddings.
    Encode(EncodeArgs),
    /// Write an image's patches and grid exactly as the engine feeds them.
    Preprocess(PreprocessArgs),
    /// List the GPU adapters wgpu sees and the one mmlora would use.
    Devices,
    /// Time the tower + connector with many adapters mixed against the base model.
    Bench(BenchArgs),
    /// Work with PEFT adapter folders.
    #[command(subcommand)]
    Adapters(AdaptersCommand),
}

#[derive(Subcommand)]
enum AdaptersCommand {
    /// Print an adapter's rank, alpha, scale and targets, and whether a model can run it.
    Inspect(InspectArgs),
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so printing into a closed pipe (`mmlora … | head`) would panic;
    // restore the default: the process ends quietly, as command-line tools do.
    // SAFETY: no other thread exists yet; SIG_DFL is a valid handler.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // Mesa's Vulkan drivers print an error on every instance when this is unset (headless
        // machines); give them the temporary folder.
        // SAFETY: no other thread exists yet.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    let log_filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("warn"))
        // Progress shows as bars, not log lines.
        .add_directive(
            format!("{}=off", progress::TARGET)
                .parse()
                .expect("a valid directive"),
        );
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Plain text where the log goes to a file or a pipe.
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(log_filter);
    let bars = cli::progress::Bars::stderr()
        .with_filter(Targets::new().with_target(progress::TARGET, Level::INFO));
    tracing_subscriber::registry().with(log).with(bars).init();
    let result = match cli.command {
        Command::Encode(args) => cli::encode::run(args),
        Command::Preprocess(args) => cli::preprocess::run(args),
        Command::Devices => cli::devices::run(),
        Command::Bench(args) => cli::bench::run(args),
        Command::Adapters(AdaptersCommand::Inspect(args)) => cli::inspect::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
