//! `mmlora devices`: the adapters wgpu sees and the one mmlora would use.

use burn::tensor::wgpu::wgpu;
use mmlora::device::{self, DeviceChoice, Precision};

use super::CliError;

/// Lists every adapter wgpu enumerates, then what `--device gpu` and `--device auto` use.
pub fn run() -> Result<(), CliError> {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    if adapters.is_empty() {
        println!("wgpu sees no adapter");
    }
    for adapter in &adapters {
        println!("adapter: {}", device::describe(&adapter.get_info()));
    }
    match device::gpu() {
        Ok(gpu) => {
            println!("--device gpu uses: {}", gpu.description);
            println!(
                "  --precision f16: {}",
                if gpu.supports(Precision::F16) {
                    "available"
                } else {
                    "unavailable (no SHADER_F16)"
                }
            );
        }
        Err(error) => println!("--device gpu is unavailable: {error}"),
    }
    let auto = device::select(DeviceChoice::Auto)?;
    println!("--device auto (the default) uses: {}", auto.description);
    Ok(())
}
