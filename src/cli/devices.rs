//! `mmlora devices`: the adapters wgpu sees and the one mmlora would use.

use burn::tensor::wgpu::wgpu;
use mmlora::ops::linear::LinearKernel;
use mmlora::runtime::device::{self, DeviceChoice, Precision};

use super::CliError;

/// Lists every adapter wgpu enumerates on every graphics API, then what `--device gpu` (with
/// whether f16 and the `coop` linear kernel run there) and `--device auto` use, on the API
/// `WGPU_BACKEND` names (an unknown name is an error, as for every command).
pub fn run() -> Result<(), CliError> {
    let requested = device::requested_backend()?;
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    if adapters.is_empty() {
        println!("wgpu sees no adapter");
    }
    for adapter in &adapters {
        println!("adapter: {}", device::describe(&adapter.get_info()));
    }
    println!("WGPU_BACKEND: {requested:?}");
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
            // What wgpu reports of the adapter's cooperative matrices, for telling why `coop`
            // is unavailable where it is.
            let setup = gpu
                .wgpu
                .as_ref()
                .expect("a GPU device keeps its wgpu setup");
            let info = setup.adapter.get_info();
            for kernel in LinearKernel::COOP {
                println!(
                    "  kernel linear={}: {}",
                    kernel,
                    match kernel.coop_subgroup(&gpu) {
                        Some(subgroup) => format!("available, at subgroups of {subgroup}"),
                        None => "unavailable".to_owned(),
                    },
                );
            }
            println!(
                "  (subgroups of {}–{}; cooperative matrices: {:?})",
                info.subgroup_min_size,
                info.subgroup_max_size,
                setup.adapter.cooperative_matrix_properties()
            );
        }
        Err(error) => println!("--device gpu is unavailable: {error}"),
    }
    let auto = device::select(DeviceChoice::Auto)?;
    println!("--device auto (the default) uses: {}", auto.description);
    Ok(())
}
