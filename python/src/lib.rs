//! `mmlora._native`: the engine for Python, wrapped by the typed pure-Python package
//! (`python/mmlora/`), which turns the caller's requests (dicts, `mmlora.Request`s, PIL images)
//! into the plain tuples this module takes and its tuples into `mmlora.Encoded`s.
//!
//! Every call that reads files or runs the device lets go of the GIL, so one engine serves many
//! Python threads at once through [`SharedEngine`]: their images are decoded in parallel and
//! their device work takes turns.

mod errors;
mod requests;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use numpy::PyArray2;
use numpy::ndarray::Array2;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use mmlora::bundled::ModelDir;
use mmlora::engine::{Encoded, Engine as RustEngine, EngineOptions, HostTensor, SharedEngine};
use mmlora::preprocess::ImageBackend;
use mmlora::runtime::device::{self, DeviceChoice, RuntimeDevice};

use errors::{Failure, engine_error, raise};

/// The allocator of every Rust allocation in this module (numpy frees the outputs through it).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// One request's result as the package receives it: `(id, adapter, (t, h, w), embeds, tower,
/// deepstack, step, step_seconds)`, the arrays `float32` numpy arrays owning the engine's
/// buffers.
type EncodedTuple<'py> = (
    String,
    Option<String>,
    (usize, usize, usize),
    Bound<'py, PyArray2<f32>>,
    Option<Bound<'py, PyArray2<f32>>>,
    Option<Bound<'py, PyArray2<f32>>>,
    usize,
    f64,
);

/// A model on a device with its adapters; shared by every thread that holds it.
#[pyclass(module = "mmlora._native", name = "Engine", frozen)]
struct Engine {
    shared: SharedEngine,
    device: RuntimeDevice,
    /// The model folder given, or the bundled model unpacked (deleted with the engine).
    folder: ModelDir,
    /// Whether `folder` is the bundled model.
    bundled: bool,
}

#[pymethods]
impl Engine {
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_dir: Option<PathBuf>,
        device: &str,
        precision: &str,
        max_loras: usize,
        max_rank: usize,
        max_cpu_adapters: Option<usize>,
        image_backend: &str,
    ) -> PyResult<Self> {
        let choice: DeviceChoice = named("device", device)?;
        let options = EngineOptions {
            max_loras,
            max_rank,
            max_cpu_adapters: max_cpu_adapters
                .unwrap_or_else(|| EngineOptions::default().max_cpu_adapters.max(max_loras)),
            precision: named("precision", precision)?,
            image_backend: named::<ImageBackend>("image_backend", image_backend)?,
            ..EngineOptions::default()
        };
        let bundled = model_dir.is_none();
        py.detach(|| {
            let folder = ModelDir::given_or_bundled(model_dir).map_err(|e| {
                raise(
                    "Error",
                    format!("cannot unpack the bundled model into a temporary folder: {e}"),
                )
            })?;
            let runtime = device::select(choice)
                .map_err(|e| raise("DeviceError", format!("device `{device}`: {e}")))?;
            let engine =
                RustEngine::open(folder.path(), runtime.clone(), options).map_err(engine_error)?;
            Ok::<_, Failure>(Self {
                shared: SharedEngine::new(engine),
                device: runtime,
                folder,
                bundled,
            })
        })
        .map_err(PyErr::from)
    }

    fn load_adapter(&self, py: Python<'_>, name: &str, path: PathBuf) -> PyResult<()> {
        py.detach(|| self.shared.load_adapter(name, &path))
            .map(drop)
            .map_err(|e| engine_error(e).into())
    }

    fn unload_adapter(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        py.detach(|| self.shared.unload_adapter(name))
            .map_err(|e| engine_error(e).into())
    }

    fn adapter_names(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        py.detach(|| self.shared.adapter_names())
            .map_err(|e| engine_error(e).into())
    }

    #[getter]
    fn model_dir(&self) -> Option<PathBuf> {
        (!self.bundled).then(|| self.folder.path().to_owned())
    }

    #[getter]
    fn bundled_dir(&self) -> Option<PathBuf> {
        self.bundled.then(|| self.folder.path().to_owned())
    }

    #[getter]
    fn device_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = PyDict::new(py);
        info.set_item("description", &self.device.description)?;
        info.set_item("kind", self.device.kind())?;
        info.set_item("hardware_gpu", self.device.hardware_gpu)?;
        info.set_item(
            "graphics_api",
            self.device
                .graphics_api()
                .map(|api| format!("{api:?}").to_lowercase()),
        )?;
        Ok(info)
    }

    /// `requests`: `(id, image, adapter)` tuples, `image` a path, an image file's bytes or an
    /// `HxWx3` `uint8` array.
    fn encode<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<(String, Bound<'py, PyAny>, Option<String>)>,
        with_tower: bool,
    ) -> PyResult<Vec<EncodedTuple<'py>>> {
        let requests = requests::from_python(requests)?;
        let encoded = py
            .detach(|| self.shared.encode(&requests, with_tower))
            .map_err(engine_error)?;
        Ok(encoded
            .into_iter()
            .map(|result| to_python(py, result))
            .collect())
    }

    /// The seconds each of `repeats` calls of the Rust engine's `encode` takes on `requests`,
    /// timed in Rust: the baseline of the Python API's overhead (python/benches/overhead.py).
    fn _time_encode<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<(String, Bound<'py, PyAny>, Option<String>)>,
        with_tower: bool,
        repeats: usize,
    ) -> PyResult<Vec<f64>> {
        let requests = requests::from_python(requests)?;
        py.detach(|| {
            (0..repeats)
                .map(|_| {
                    let started = Instant::now();
                    self.shared
                        .encode(&requests, with_tower)
                        .map(|_| started.elapsed().as_secs_f64())
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .map_err(|e| engine_error(e).into())
    }
}

/// `value` as the named choice `T`, or a `ValueError` listing the names it may take.
fn named<T: FromStr + strum::VariantNames>(what: &str, value: &str) -> PyResult<T> {
    value.parse().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} `{value}`: expected one of {}",
            T::VARIANTS.join(", ")
        ))
    })
}

fn to_python(py: Python<'_>, result: Encoded) -> EncodedTuple<'_> {
    let [t, h, w] = result.grid_thw;
    (
        result.id,
        result.adapter,
        (t, h, w),
        array(py, result.embeds),
        result.tower.map(|tower| array(py, tower)),
        result.deepstack.map(|deepstack| array(py, deepstack)),
        result.step,
        result.step_time.as_secs_f64(),
    )
}

/// The matrix as a numpy array that takes over its buffer.
fn array(py: Python<'_>, tensor: HostTensor) -> Bound<'_, PyArray2<f32>> {
    let matrix = Array2::from_shape_vec(tensor.shape, tensor.values)
        .expect("the engine's outputs hold rows × columns values");
    PyArray2::from_owned_array(py, matrix)
}

#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<Engine>()?;
    Ok(())
}
