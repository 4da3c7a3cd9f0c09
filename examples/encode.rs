//! The engine as a library: load the bundled model and two adapters, encode three images that
//! each use a different adapter (or none) in one call, print what came back.
//!
//! `cargo run --release --example encode`

use std::path::PathBuf;

use mmlora::{DeviceChoice, Engine, EngineOptions, ImageSource, Request, device};

/// On the CPU backend a caching allocator matters: see the README's "Choices".
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-qwen2-vl");
    let mut engine = Engine::open(
        &model,
        device::select(DeviceChoice::Auto)?,
        EngineOptions::default(),
    )?;
    println!("device: {}", engine.device().description);
    for name in ["all-r4", "tower-r2"] {
        engine.load_adapter(name, &model.join("adapters").join(name))?;
    }

    let request = |id: &str, image: &str, adapter: Option<&str>| Request {
        id: id.to_owned(),
        image: ImageSource::File(model.join("images").join(image)),
        adapter: adapter.map(str::to_owned),
    };
    let results = engine.encode(
        &[
            request("cat", "square.png", Some("all-r4")),
            request("dog", "wide.jpg", Some("tower-r2")),
            request("base", "square.png", None),
        ],
        false,
    )?;
    for result in &results {
        println!(
            "{}: adapter {:?}, embeddings {:?}, first values {:?}",
            result.id,
            result.adapter,
            result.embeds.shape,
            &result.embeds.values[..3]
        );
    }
    Ok(())
}
