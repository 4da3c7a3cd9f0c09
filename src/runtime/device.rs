//! The runtime device: Burn's CPU backend (Flex) or its wgpu backend on the adapter wgpu picks.

use crate::named::named_choice;
/// The graphics APIs a wgpu device opens on ([`open_gpu`]).
pub use burn::tensor::wgpu::WgpuBackend;
use burn::tensor::wgpu::{WgpuInitError, WgpuSetup, wgpu};
use burn::tensor::{DType, Device};

named_choice! {
    /// Which backend to run on; named in kebab case (`auto`, `cpu`, `gpu`).
    pub enum DeviceChoice {
        /// A hardware GPU when wgpu has one, else the CPU backend (a software rasterizer such as
        /// lavapipe is slower than the CPU backend).
        Auto,
        /// Burn's CPU backend (Flex): the reference path.
        Cpu,
        /// Burn's wgpu backend with our WGSL kernels.
        Gpu,
    }
}

named_choice! {
    /// The float type the model computes in; named `f32` or `f16`.
    #[derive(Default)]
    pub enum Precision {
        /// 32-bit floats everywhere: the reference.
        #[default]
        F32,
        /// 16-bit weights, activations and matmuls on a GPU with `SHADER_F16` (norms and softmax
        /// in f32; bf16 checkpoints compute this way too, as wgpu has no bf16).
        F16,
    }
}

impl Precision {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
        }
    }
}

/// A device ready for tensors, with a description of what it is.
#[derive(Debug, Clone)]
pub struct RuntimeDevice {
    /// The Burn device.
    pub device: Device,
    /// What backs it, in words (adapter name, graphics API, type, driver).
    pub description: String,
    /// Whether it is a GPU in hardware (not the CPU backend, not a software rasterizer).
    pub hardware_gpu: bool,
    /// The largest buffer one kernel may bind, in bytes: the smaller of the device's
    /// storage-binding and buffer-size limits (`None` on the CPU backend).
    pub buffer_limit: Option<u64>,
    /// The wgpu instance, adapter, device and queue behind a GPU device, to share with other
    /// wgpu code (a renderer) instead of opening a second device.
    pub wgpu: Option<WgpuSetup>,
}

/// What a device is, as far as choosing kernels goes: the one fact about it that every `auto`
/// choice reads ([`crate::ops::kernels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceClass {
    /// Burn's CPU backend (Flex).
    Cpu,
    /// wgpu on a software rasterizer (lavapipe, llvmpipe, SwiftShader): our kernels written for
    /// it, measured on it.
    SoftwareGpu,
    /// wgpu on a GPU in hardware: only kernels whose shaders passed their tests on one.
    HardwareGpu,
}

impl RuntimeDevice {
    /// What the device is, for kernel choice.
    pub fn class(&self) -> DeviceClass {
        match (&self.wgpu, self.hardware_gpu) {
            (None, _) => DeviceClass::Cpu,
            (Some(_), false) => DeviceClass::SoftwareGpu,
            (Some(_), true) => DeviceClass::HardwareGpu,
        }
    }

    /// `gpu` for a wgpu device, `cpu` for the CPU backend.
    pub fn kind(&self) -> &'static str {
        if self.wgpu.is_some() { "gpu" } else { "cpu" }
    }

    /// The graphics API a wgpu device runs on (none on the CPU backend).
    pub fn graphics_api(&self) -> Option<WgpuBackend> {
        self.wgpu.as_ref().and_then(|setup| api_of(setup.backend))
    }

    /// Whether the model can compute in `precision` here: f16 needs a GPU whose adapter has
    /// `SHADER_F16` (the CPU backend's f16 would be emulated, slower than f32).
    pub fn supports(&self, precision: Precision) -> bool {
        match precision {
            Precision::F32 => true,
            Precision::F16 => {
                self.wgpu.as_ref().is_some_and(|setup| {
                    setup.device.features().contains(wgpu::Features::SHADER_F16)
                }) && self.device.supports_dtype(DType::F16)
            }
        }
    }
}

/// Why no GPU device could be had.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DeviceError {
    /// `WGPU_BACKEND` names no graphics API wgpu knows.
    #[error("WGPU_BACKEND={0:?} is not one of vulkan, metal, dx12, gl, webgpu")]
    UnknownBackend(String),
    /// wgpu found no adapter or could not open it.
    #[error(
        "no GPU adapter could be initialised through wgpu ({0}); on Linux install a Vulkan driver \
         (Mesa's lavapipe: `apt-get install mesa-vulkan-drivers`) or use --device cpu"
    )]
    NoAdapter(String),
}

/// The graphics API named by the `WGPU_BACKEND` environment variable (unset: wgpu decides).
pub fn requested_backend() -> Result<WgpuBackend, DeviceError> {
    match std::env::var("WGPU_BACKEND") {
        Err(_) => Ok(WgpuBackend::Auto),
        Ok(name) => backend_named(&name),
    }
}

/// The graphics API `name` spells (`vulkan`, `metal`, `dx12`, `gl`, `webgpu`; `auto` or empty:
/// wgpu decides), in any case.
pub fn backend_named(name: &str) -> Result<WgpuBackend, DeviceError> {
    match name.to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(WgpuBackend::Auto),
        "vulkan" => Ok(WgpuBackend::Vulkan),
        "metal" => Ok(WgpuBackend::Metal),
        "dx12" => Ok(WgpuBackend::Dx12),
        "gl" => Ok(WgpuBackend::Gl),
        "webgpu" => Ok(WgpuBackend::WebGpu),
        _ => Err(DeviceError::UnknownBackend(name.to_owned())),
    }
}

/// The graphics APIs on which wgpu finds at least one adapter, whatever `WGPU_BACKEND` says,
/// each once, in the order wgpu lists their adapters.
#[cfg(not(target_arch = "wasm32"))]
pub fn graphics_apis() -> Vec<WgpuBackend> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    let mut apis = Vec::new();
    for api in adapters.iter().filter_map(|a| api_of(a.get_info().backend)) {
        if !apis.contains(&api) {
            apis.push(api);
        }
    }
    apis
}

/// The graphics API a wgpu backend is (none for wgpu's no-op backend).
fn api_of(backend: wgpu::Backend) -> Option<WgpuBackend> {
    match backend {
        wgpu::Backend::Vulkan => Some(WgpuBackend::Vulkan),
        wgpu::Backend::Metal => Some(WgpuBackend::Metal),
        wgpu::Backend::Dx12 => Some(WgpuBackend::Dx12),
        wgpu::Backend::Gl => Some(WgpuBackend::Gl),
        wgpu::Backend::BrowserWebGpu => Some(WgpuBackend::WebGpu),
        wgpu::Backend::Noop => None,
    }
}

/// The CPU device.
pub fn cpu() -> RuntimeDevice {
    RuntimeDevice {
        device: Device::flex(),
        description: "cpu (Burn Flex backend)".to_owned(),
        hardware_gpu: false,
        buffer_limit: None,
        wgpu: None,
    }
}

/// The wgpu device on the graphics API `WGPU_BACKEND` names (unset: the one wgpu picks), on the
/// adapter wgpu selects there; initialised once per process.
#[cfg(not(target_arch = "wasm32"))]
pub fn gpu() -> Result<RuntimeDevice, DeviceError> {
    gpu_on(requested_backend()?)
}

/// The wgpu device on graphics API `api` ([`WgpuBackend::Auto`]: the one wgpu picks), on the
/// adapter wgpu selects there; initialised once per process and API, so devices on several
/// APIs can live side by side (the tests run the engine on each).
#[cfg(not(target_arch = "wasm32"))]
pub fn gpu_on(api: WgpuBackend) -> Result<RuntimeDevice, DeviceError> {
    use std::sync::{Mutex, PoisonError};
    type Opened = Vec<(WgpuBackend, Result<RuntimeDevice, DeviceError>)>;
    static OPENED: Mutex<Opened> = Mutex::new(Vec::new());
    // Held while a device opens, so that two threads never open one API twice.
    let mut opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, gpu)) = opened.iter().find(|(on, _)| *on == api) {
        return gpu.clone();
    }
    let gpu = pollster::block_on(open_gpu(api));
    opened.push((api, gpu.clone()));
    gpu
}

/// Opens the wgpu device on graphics API `api` on the adapter wgpu selects there. Asynchronous
/// because a browser answers wgpu's adapter and device requests later and cannot be waited
/// for; each call opens a device, so a page opens one and keeps it (native code goes through
/// [`gpu_on`], which opens each API once per process).
pub async fn open_gpu(api: WgpuBackend) -> Result<RuntimeDevice, DeviceError> {
    Device::wgpu_options()
        .graphics_api(api)
        .init_with_setup_async()
        .await
        .map(|(device, setup)| wgpu_device(device, setup))
        .map_err(|e: WgpuInitError| DeviceError::NoAdapter(e.to_string()))
}

/// A new wgpu device on the adapter [`gpu`] uses, independent of it and of every other device:
/// what an engine is rebuilt on after its device was lost.
#[cfg(not(target_arch = "wasm32"))]
pub fn gpu_new() -> Result<RuntimeDevice, DeviceError> {
    let first = gpu()?;
    let setup = first.wgpu.expect("a GPU device keeps its wgpu setup");
    let adapter = setup.adapter.clone();
    let (device, queue) = pollster::block_on(
        adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("mmlora"),
            // As Burn asks for its own device: everything the adapter offers, the experimental
            // features included (cooperative matrices, which `linear_coop.wgsl` uses, are one).
            // wgpu refuses a request for those unless they are enabled, and hardware drivers
            // (NVIDIA's) offer some, so the rebuilt device must enable them as Burn's does.
            required_features: adapter
                .features()
                .difference(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS),
            required_limits: adapter.limits(),
            memory_hints: wgpu::MemoryHints::MemoryUsage,
            trace: wgpu::Trace::Off,
            // SAFETY: the opt-in Burn's own device request makes (cubecl-wgpu's
            // `try_request_device`), so the rebuilt device runs what the first one ran.
            experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
        }),
    )
    .map_err(|e| DeviceError::NoAdapter(e.to_string()))?;
    let setup = WgpuSetup {
        instance: setup.instance.clone(),
        adapter,
        device,
        queue,
        backend: setup.backend,
    };
    let device = Device::wgpu_options()
        .setup(setup.clone())
        .init()
        .map_err(|e: WgpuInitError| DeviceError::NoAdapter(e.to_string()))?;
    Ok(wgpu_device(device, setup))
}

/// A Burn device with what describes it.
fn wgpu_device(device: Device, setup: WgpuSetup) -> RuntimeDevice {
    let info = setup.adapter.get_info();
    let limits = setup.device.limits();
    RuntimeDevice {
        device,
        description: describe(&info),
        hardware_gpu: info.device_type != wgpu::DeviceType::Cpu,
        buffer_limit: Some(
            limits
                .max_storage_buffer_binding_size
                .min(limits.max_buffer_size),
        ),
        wgpu: Some(setup),
    }
}

/// The device for `choice`; a `WGPU_BACKEND` that names no graphics API is an error under
/// `auto` too, rather than a quiet fall back to the CPU.
#[cfg(not(target_arch = "wasm32"))]
pub fn select(choice: DeviceChoice) -> Result<RuntimeDevice, DeviceError> {
    match choice {
        DeviceChoice::Auto => {
            requested_backend()?;
            Ok(gpu().ok().filter(|g| g.hardware_gpu).unwrap_or_else(cpu))
        }
        DeviceChoice::Cpu => Ok(cpu()),
        DeviceChoice::Gpu => gpu(),
    }
}

/// One line about an adapter: name, graphics API, type and driver.
pub fn describe(info: &wgpu::AdapterInfo) -> String {
    format!(
        "{} ({:?}, {:?}, driver {} {})",
        info.name, info.backend, info.device_type, info.driver, info.driver_info
    )
}

/// The GPU for tests: `None` (the test returns early, saying so) when wgpu finds no adapter,
/// except under `CI=true`, where a missing adapter fails the test.
#[cfg(any(test, feature = "testkit"))]
pub fn gpu_for_tests() -> Option<RuntimeDevice> {
    match gpu() {
        Ok(gpu) => Some(gpu),
        Err(error) if under_ci() => {
            panic!("CI=true requires a GPU adapter (lavapipe in CI): {error}")
        }
        Err(error) => {
            eprintln!("no GPU adapter, GPU test not run: {error}");
            None
        }
    }
}

/// Whether the f16 tests run on `gpu`: where its adapter has `SHADER_F16`. Without it they
/// are skipped, saying so, except under `CI=true`, where it fails the test (CI's lavapipe has
/// `SHADER_F16`, so losing it must not silently drop every f16 check).
#[cfg(any(test, feature = "testkit"))]
pub fn f16_for_tests(gpu: &RuntimeDevice) -> bool {
    if gpu.supports(Precision::F16) {
        return true;
    }
    assert!(
        !under_ci(),
        "CI=true requires SHADER_F16 on the test GPU (lavapipe has it); {} lacks it",
        gpu.description
    );
    eprintln!("{}: no SHADER_F16, f16 test not run", gpu.description);
    false
}

#[cfg(any(test, feature = "testkit"))]
fn under_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}
