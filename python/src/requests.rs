//! Requests from Python: `(id, image, adapter)` tuples, the image a path, an image file's bytes,
//! or an `HxWx3` `uint8` numpy array (the package turns PIL images into arrays as transformers
//! does).

use std::path::PathBuf;

use image::RgbImage;
use numpy::{
    PyArray3, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray3, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use mmlora::engine::{ImageSource, Request};

use crate::errors::raise;

/// The engine's requests. The arrays' pixels are copied here, with the GIL held, so the engine
/// can run without it.
pub fn from_python(
    requests: Vec<(String, Bound<'_, PyAny>, Option<String>)>,
) -> PyResult<Vec<Request>> {
    requests
        .into_iter()
        .map(|(id, image, adapter)| {
            let image = image_source(&id, &image)?;
            Ok(Request { id, image, adapter })
        })
        .collect()
}

fn image_source(id: &str, image: &Bound<'_, PyAny>) -> PyResult<ImageSource> {
    if let Ok(array) = image.cast::<PyUntypedArray>() {
        if !array.dtype().is_equiv_to(&numpy::dtype::<u8>(image.py())) {
            return Err(PyTypeError::new_err(format!(
                "request `{id}`: the image array is {}; expected uint8 (HxWx3 RGB)",
                array.dtype()
            )));
        }
        let Ok(pixels) = array.cast::<PyArray3<u8>>() else {
            return Err(misshapen(id, array.shape()));
        };
        return rgb(id, pixels.readonly()).map(ImageSource::Decoded);
    }
    if let Ok(bytes) = image.cast::<PyBytes>() {
        return Ok(ImageSource::Encoded(bytes.as_bytes().to_vec()));
    }
    match image.extract::<PathBuf>() {
        Ok(path) => Ok(ImageSource::File(path)),
        Err(_) => Err(PyTypeError::new_err(format!(
            "request `{id}`: the image is a {}; expected a path, bytes, a PIL image or a numpy array",
            image.get_type().name()?
        ))),
    }
}

/// An `HxWx3` array as an RGB image, whatever its strides.
fn rgb(id: &str, pixels: PyReadonlyArray3<'_, u8>) -> PyResult<RgbImage> {
    let shape = pixels.shape();
    let (height, width) = (u32::try_from(shape[0]), u32::try_from(shape[1]));
    let (3, Ok(height), Ok(width)) = (shape[2], height, width) else {
        return Err(misshapen(id, shape));
    };
    let view = pixels.as_array();
    // Row-major memory as it is; any other layout (Fortran order, views) read in logical order.
    let values = match view.as_slice() {
        Some(row_major) => row_major.to_vec(),
        None => view.iter().copied().collect(),
    };
    Ok(RgbImage::from_raw(width, height, values).expect("height × width × 3 values"))
}

fn misshapen(id: &str, shape: &[usize]) -> PyErr {
    let shape: Vec<String> = shape.iter().map(usize::to_string).collect();
    raise(
        "ImageError",
        format!(
            "request `{id}`: the image array is {}; expected HxWx3 (RGB)",
            shape.join("×")
        ),
    )
    .into()
}
