//! mmlora in a browser: the engine on WebGPU, for the page in `web/page/`.
//!
//! The page hands files over as bytes (picked, dropped or fetched); they are mounted
//! ([`mmlora::vfs`]) under `models/`, `adapters/` and `images/`, and the engine reads them by
//! path as it reads a downloaded model, so errors name the file as the page shows it. A run is
//! [`mmlora::analysis`]'s, as in the desktop demo: the rows, and each image once without
//! adapter as the heatmaps' base, in one engine call.
//!
//! Every call that changes something either succeeds or leaves the session as it was; a call
//! made while a run is awaiting the device is refused.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;

use js_sys::{Array, Float32Array, Promise, Uint8Array};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;
use web_time::Instant;

use mmlora::analysis::{self, BatchRow};
use mmlora::engine::{Encoded, Engine, EngineOptions, ImageSource, Request};
use mmlora::models::Preset;
use mmlora::preprocess::{Patches, decode_image};
use mmlora::runtime::device::{RuntimeDevice, WgpuBackend, open_gpu};
use mmlora::vfs::{self, Mount};

unsafe extern "C" {
    /// The module's static constructors, which wasm-ld gathers (cubecl registers its IR's
    /// dialects through `inventory`, whose items are such constructors).
    fn __wasm_call_ctors();
}

#[wasm_bindgen(start)]
fn start() {
    // Run the constructors once, here. Where a module never calls them itself, wasm-ld links
    // it "command-style" and runs them again at the start of every exported function: every
    // call from JavaScript, wgpu's callbacks included, which cost the tiny model's batch most
    // of its 1.1 s a call in Chromium.
    // SAFETY: called once, when the module starts, before any other code of it reads what
    // the constructors register.
    unsafe { __wasm_call_ctors() };
    console_error_panic_hook::set_once();
}

/// An error for the page, with the message the CLI would print.
fn error(e: impl std::fmt::Display) -> JsError {
    JsError::new(&e.to_string())
}

/// The files the page hands over: pairs of `[path inside the folder, Uint8Array]`.
fn files_of(files: &Array) -> Result<Vec<(String, Vec<u8>)>, JsError> {
    files
        .iter()
        .map(|pair| {
            let pair = Array::from(&pair);
            let path = pair
                .get(0)
                .as_string()
                .ok_or_else(|| error("a file's path is not a string"))?;
            let bytes = pair
                .get(1)
                .dyn_into::<Uint8Array>()
                .map_err(|_| error(format!("{path}: its bytes are not a Uint8Array")))?;
            Ok((path, bytes.to_vec()))
        })
        .collect()
}

/// Mounts `files` under `root/name`, or `root/name (2)`, … where that folder is taken.
fn mount_named(root: &str, name: &str, files: Vec<(String, Vec<u8>)>) -> Result<Mount, JsError> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(error(format!("`{name}` is not a folder name")));
    }
    mount_free(&format!("{root}/{name}"), files)
}

/// Mounts `files` under `folder`, or `folder (2)`, … where that folder is taken.
fn mount_free(folder: &str, files: Vec<(String, Vec<u8>)>) -> Result<Mount, JsError> {
    let free = (1..)
        .map(|copy| match copy {
            1 => folder.to_owned(),
            n => format!("{folder} ({n})"),
        })
        .find(|free| !vfs::exists(Path::new(free)))
        .expect("some copy number is free");
    Mount::new(free, files).map_err(|e| error(format!("{folder}: {e}")))
}

/// The browser's WebGPU device, opened once by the page and shared by its engines.
#[wasm_bindgen]
pub struct Gpu {
    device: RuntimeDevice,
}

#[wasm_bindgen]
impl Gpu {
    /// Asks the browser for its WebGPU adapter and device. `name` is the adapter's as the page
    /// read it from `GPUAdapter.info`, which wgpu does not pass on.
    pub async fn open(name: &str) -> Result<Gpu, JsError> {
        let mut device = open_gpu(WgpuBackend::WebGpu).await.map_err(error)?;
        let kind = match device.hardware_gpu {
            true => "WebGPU",
            false => "WebGPU, the browser's software fallback adapter",
        };
        device.description = format!("{name} ({kind})");
        Ok(Gpu { device })
    }

    /// The adapter's name and kind, as the page shows it.
    #[wasm_bindgen(getter)]
    pub fn name(&self) -> String {
        self.device.description.clone()
    }
}

/// Refuses `bytes` that do not decode as an image (PNG, JPEG, WebP) as the engine will decode
/// them, naming the file.
fn check_image(name: &str, bytes: &[u8]) -> Result<(), JsError> {
    decode_image(bytes, Path::new(name))
        .map(drop)
        .map_err(error)
}

/// An image file's bytes decoded to RGB as the engine decodes them (for the page's tests, which
/// compare the browser's decoders with the native ones).
#[wasm_bindgen(js_name = decodeImage)]
pub fn decode_image_rgb(name: &str, bytes: &[u8]) -> Result<Decoded, JsError> {
    let image = decode_image(bytes, Path::new(name)).map_err(error)?;
    Ok(Decoded {
        width: image.width(),
        height: image.height(),
        rgb: Uint8Array::from(image.as_raw().as_slice()),
    })
}

/// A decoded image: `height × width × 3` bytes, row-major.
#[wasm_bindgen(getter_with_clone)]
pub struct Decoded {
    /// Columns.
    pub width: u32,
    /// Rows.
    pub height: u32,
    /// The pixels.
    pub rgb: Uint8Array,
}

/// The heatmaps' colour for `t` in 0..=1, as the desktop demo draws it: `[r, g, b]`.
#[wasm_bindgen]
pub fn colormap(t: f32) -> Vec<u8> {
    analysis::colormap(t).to_vec()
}

/// The batch as the page sends it (JSON: `[{"image": path, "adapter": name or null}, …]`).
fn batch_rows(rows: &str) -> Result<Vec<BatchRow>, JsError> {
    serde_json::from_str(rows).map_err(|e| error(format!("the batch: {e}")))
}

/// A model open on the GPU with its adapters and the page's images.
#[wasm_bindgen]
pub struct Session {
    state: Rc<RefCell<State>>,
}

struct State {
    engine: Engine,
    /// Where the model came from: its folder (`models/<name>`), or its preset's name.
    folder: String,
    /// The model's files (with the bundled adapters and images), none for a preset.
    _model: Option<Mount>,
    /// Adapters from the page's own folders, by the name they are loaded under.
    adapters: BTreeMap<String, Mount>,
    /// The page's images (`images/<name>`).
    images: Mount,
    /// The last run's results: its rows, then a base per image.
    last: Vec<Encoded>,
}

#[wasm_bindgen]
impl Session {
    /// Opens the model in `files` (a model folder's files: `config.json`, the safetensors,
    /// sharded or not, `preprocessor_config.json`) on `gpu`, mounted as `models/<name>`.
    pub fn open(gpu: &Gpu, name: &str, files: &Array) -> Result<Session, JsError> {
        let model = mount_named("models", name, files_of(files)?)?;
        let engine = Engine::open(model.folder(), gpu.device.clone(), EngineOptions::default())
            .map_err(error)?;
        let folder = model.folder().display().to_string();
        Session::new(engine, folder, Some(model))
    }

    /// A tower of a released model's shape with random weights (`qwen2-vl-2b`, …: the names
    /// `mmlora bench --preset` takes), for timing ([`Session::time_random`]).
    #[wasm_bindgen(js_name = openPreset)]
    pub fn open_preset(gpu: &Gpu, preset: &str) -> Result<Session, JsError> {
        let preset: Preset = preset.parse().map_err(error)?;
        let model = preset.random(&gpu.device.device);
        let processor = model.layout().default_processor();
        let engine = Engine::with_model(
            model,
            processor,
            gpu.device.clone(),
            EngineOptions::default(),
        )
        .map_err(error)?;
        Session::new(engine, preset.to_string(), None)
    }

    /// Times the engine call on the batch `rows` (as [`Session::run`] takes them, without the
    /// base requests a run adds): one call first (shaders compile there), then `repeats`
    /// calls; resolves to their wall times in seconds, each ending with the outputs read back.
    #[wasm_bindgen(js_name = timeRows)]
    pub fn time_rows(&self, rows: &str, repeats: usize) -> Promise {
        let state = self.state.clone();
        let rows = batch_rows(rows);
        promise(async move {
            let rows = rows?;
            // A run's requests without the bases it adds after the rows.
            let mut requests = analysis::requests(&rows);
            requests.truncate(rows.len());
            time_calls(&state, &requests, repeats).await
        })
    }

    /// [`Session::time_rows`] on `images` requests of random patches of square images of
    /// `side` pixels, as `mmlora bench` times a preset.
    #[wasm_bindgen(js_name = timeRandom)]
    pub fn time_random(&self, images: usize, side: usize, repeats: usize) -> Promise {
        let state = self.state.clone();
        promise(async move {
            let layout = busy(&state)?.engine.model().layout();
            let grid_thw = [1, side / layout.patch_size, side / layout.patch_size];
            let values = grid_thw.iter().product::<usize>() * layout.patch_len();
            // Any values will do for timing: a fixed pseudo-random sequence in [-1, 1).
            let mut seed = 0x5eed_u32;
            let requests: Vec<Request> = (0..images)
                .map(|i| Request {
                    id: format!("image{i}"),
                    image: ImageSource::Patches(Patches {
                        pixel_values: (0..values)
                            .map(|_| {
                                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                                (seed >> 8) as f32 / (1 << 23) as f32 - 1.0
                            })
                            .collect(),
                        grid_thw,
                    }),
                    adapter: None,
                })
                .collect();
            time_calls(&state, &requests, repeats).await
        })
    }

    /// A session around `engine`, its model from `folder` (`model` its files, if mounted).
    fn new(engine: Engine, folder: String, model: Option<Mount>) -> Result<Session, JsError> {
        let state = State {
            engine,
            folder,
            _model: model,
            adapters: BTreeMap::new(),
            images: mount_free("images", Vec::new())?,
            last: Vec::new(),
        };
        Ok(Session {
            state: Rc::new(RefCell::new(state)),
        })
    }

    fn state(&self) -> Result<std::cell::RefMut<'_, State>, JsError> {
        busy(&self.state)
    }

    /// The folder the model was mounted as (`models/<name>`).
    #[wasm_bindgen(getter)]
    pub fn folder(&self) -> Result<String, JsError> {
        Ok(self.state()?.folder.clone())
    }

    /// Loads the adapter in the model's folder at `path` (the bundled models' `adapters/…`).
    #[wasm_bindgen(js_name = loadModelAdapter)]
    pub fn load_model_adapter(&self, name: &str, path: &str) -> Result<(), JsError> {
        let mut state = self.state()?;
        let dir = Path::new(&state.folder).join(path);
        state.engine.load_adapter(name, &dir).map_err(error)?;
        state.adapters.remove(name);
        Ok(())
    }

    /// Loads a PEFT folder's files (`adapter_config.json`, `adapter_model.safetensors`) under
    /// `name`, mounted as `adapters/<name>`; a name loaded already is replaced.
    #[wasm_bindgen(js_name = loadAdapter)]
    pub fn load_adapter(&self, name: &str, files: &Array) -> Result<(), JsError> {
        let mut state = self.state()?;
        let mount = mount_named("adapters", name, files_of(files)?)?;
        state
            .engine
            .load_adapter(name, mount.folder())
            .map_err(error)?;
        state.adapters.insert(name.to_owned(), mount);
        Ok(())
    }

    /// Unloads adapter `name`.
    #[wasm_bindgen(js_name = unloadAdapter)]
    pub fn unload_adapter(&self, name: &str) -> Result<(), JsError> {
        let mut state = self.state()?;
        state.engine.unload_adapter(name).map_err(error)?;
        state.adapters.remove(name);
        Ok(())
    }

    /// The loaded adapters' names.
    #[wasm_bindgen(js_name = adapterNames)]
    pub fn adapter_names(&self) -> Result<Vec<String>, JsError> {
        Ok(self.state()?.engine.adapter_names())
    }

    /// Adds an image file's bytes as `images/<name>` (`<name> (2)`, … where that is taken),
    /// checked to decode, and returns that path.
    #[wasm_bindgen(js_name = addImage)]
    pub fn add_image(&self, name: &str, bytes: Vec<u8>) -> Result<String, JsError> {
        let state = self.state()?;
        check_image(name, &bytes)?;
        let path = Path::new(name);
        let (stem, extension) = match (path.file_stem(), path.extension()) {
            (Some(stem), Some(extension)) => (
                stem.to_string_lossy(),
                format!(".{}", extension.to_string_lossy()),
            ),
            _ => (name.into(), String::new()),
        };
        let file = (1..)
            .map(|copy| match copy {
                1 => name.to_owned(),
                n => format!("{stem} ({n}){extension}"),
            })
            .find(|file| !vfs::exists(&state.images.folder().join(file)))
            .expect("some copy number is free");
        let path = state.images.add(&file, bytes).map_err(error)?;
        Ok(path.display().to_string())
    }

    /// Runs the batch `rows` (JSON: `[{"image": path, "adapter": name or null}, …]`) as one
    /// engine call and resolves to the run's summary as JSON ([`analysis::RunResult`]).
    pub fn run(&self, rows: &str) -> Promise {
        let state = self.state.clone();
        let rows = batch_rows(rows);
        promise(async move {
            let summary = run_locked(&state, rows?).await?;
            Ok(JsValue::from_str(&summary))
        })
    }

    /// The last run's output `what` (`embeds`, `tower` or `deepstack`) of request `index` (the
    /// rows in order, then one base per image).
    pub fn output(&self, index: usize, what: &str) -> Result<Output, JsError> {
        let state = self.state()?;
        let encoded = state
            .last
            .get(index)
            .ok_or_else(|| error(format!("the last run has no request {index}")))?;
        let tensor = match what {
            "embeds" => Some(&encoded.embeds),
            "tower" => encoded.tower.as_ref(),
            "deepstack" => encoded.deepstack.as_ref(),
            _ => None,
        }
        .ok_or_else(|| error(format!("request {index} has no output `{what}`")))?;
        Ok(Output {
            rows: tensor.shape[0],
            columns: tensor.shape[1],
            values: Float32Array::from(tensor.values.as_slice()),
        })
    }
}

/// A promise of `work`, rejected with its error.
fn promise(work: impl Future<Output = Result<JsValue, JsError>> + 'static) -> Promise {
    future_to_promise(async move { work.await.map_err(JsValue::from) })
}

/// The session's state, or the error a call made during a run gets.
fn busy(state: &RefCell<State>) -> Result<std::cell::RefMut<'_, State>, JsError> {
    state
        .try_borrow_mut()
        .map_err(|_| error("a run is in progress"))
}

/// [`State::run`], the state held over it: a call meanwhile is refused ([`busy`]), never a
/// panic.
#[expect(clippy::await_holding_refcell_ref)]
async fn run_locked(state: &RefCell<State>, rows: Vec<BatchRow>) -> Result<String, JsError> {
    let mut state = busy(state)?;
    state.run(rows).await
}

/// One call of `requests`, then `repeats` timed ones: their wall times in seconds. The state is
/// held over them, as in [`run_locked`].
#[expect(clippy::await_holding_refcell_ref)]
async fn time_calls(
    state: &RefCell<State>,
    requests: &[Request],
    repeats: usize,
) -> Result<JsValue, JsError> {
    let mut state = busy(state)?;
    let mut times = Vec::with_capacity(repeats);
    for call in 0..=repeats {
        let started = Instant::now();
        state
            .engine
            .encode_async(requests, false)
            .await
            .map_err(error)?;
        if call > 0 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    Ok(Array::from_iter(times.into_iter().map(JsValue::from)).into())
}

impl State {
    async fn run(&mut self, rows: Vec<BatchRow>) -> Result<String, JsError> {
        if rows.is_empty() {
            return Err(error("the batch is empty: add a row"));
        }
        let requests = analysis::requests(&rows);
        let started = Instant::now();
        let encoded = self
            .engine
            .encode_async(&requests, true)
            .await
            .map_err(error)?;
        let seconds = started.elapsed().as_secs_f64();
        let merge = self.engine.model().layout().spatial_merge_size;
        let device = self.engine.device().description.clone();
        let summary = analysis::summarise(&rows, &encoded, merge, seconds, device);
        self.last = encoded;
        serde_json::to_string(&summary).map_err(error)
    }
}

/// One output of a request: a row-major `rows × columns` matrix.
#[wasm_bindgen(getter_with_clone)]
pub struct Output {
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub columns: usize,
    /// The values.
    pub values: Float32Array,
}
