//! Writing results as safetensors, all or nothing: the file appears only once it is complete;
//! and checking that an output can be created before the work that fills it.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use super::CliError;

/// One tensor to write: name, dtype, shape and little-endian bytes.
pub struct OutputTensor {
    /// Its name in the file.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its bytes, little-endian.
    pub bytes: Vec<u8>,
}

impl OutputTensor {
    /// An f32 tensor.
    pub fn f32(name: String, shape: Vec<usize>, values: &[f32]) -> Self {
        Self {
            name,
            dtype: Dtype::F32,
            shape,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// An i64 tensor.
    pub fn i64(name: String, shape: Vec<usize>, values: &[i64]) -> Self {
        Self {
            name,
            dtype: Dtype::I64,
            shape,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// Writes `tensors` (and `metadata`) to `path`, all or nothing ([`mmlora::files`]).
pub fn write_safetensors(
    path: &Path,
    tensors: &[OutputTensor],
    metadata: HashMap<String, String>,
) -> Result<(), CliError> {
    let failed = |reason: String| CliError::Write {
        path: path.to_owned(),
        reason,
    };
    let views = tensors
        .iter()
        .map(|t| {
            TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|view| (t.name.clone(), view))
                .map_err(|e| failed(format!("tensor {}: {e}", t.name)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(|e| failed(e.to_string()))?;
    mmlora::files::write_whole(path, |file| file.write_all(&bytes))
        .map_err(|e| failed(e.to_string()))
}

/// Fails early, before the work that fills it, when the output cannot be created (a folder, a
/// missing or read-only folder).
pub fn check_writable(out: &Path) -> Result<(), CliError> {
    mmlora::files::check_writable(out).map_err(|e| CliError::Write {
        path: out.to_owned(),
        reason: e.to_string(),
    })
}

/// Refuses an output that is one of `inputs`, by any path (writing the results would replace
/// it). Only an existing regular file can be: a device or a pipe is written in place, and
/// comparing one would open it, which for a named pipe waits for a writer.
pub fn check_not_an_input(out: &Path, inputs: &[PathBuf]) -> Result<(), CliError> {
    if !std::fs::metadata(out).is_ok_and(|meta| meta.is_file()) {
        return Ok(());
    }
    match inputs
        .iter()
        .find(|input| same_file::is_same_file(out, input).unwrap_or(false))
    {
        Some(input) => Err(CliError::Usage(format!(
            "--out {} would replace {}, an input of this run (an image, the batch file, or a \
             file in the model's or an adapter's folder)",
            out.display(),
            input.display()
        ))),
        None => Ok(()),
    }
}

/// Where the run's report lines go: stdout, or stderr where `out` is stdout itself
/// (`--out /dev/stdout`), which must then hold the file's bytes alone.
pub fn report_to(out: Option<&Path>) -> impl Fn(&str) {
    let on_stderr = out.is_some_and(is_stdout);
    move |line| match on_stderr {
        true => eprintln!("{line}"),
        false => println!("{line}"),
    }
}

/// Whether `path` is the file this process's standard output writes to.
#[cfg(unix)]
fn is_stdout(path: &Path) -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let ours = std::io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .and_then(|fd| std::fs::File::from(fd).metadata());
    match (std::fs::metadata(path), ours) {
        (Ok(out), Ok(ours)) => (out.dev(), out.ino()) == (ours.dev(), ours.ino()),
        _ => false,
    }
}

#[cfg(not(unix))]
fn is_stdout(_: &Path) -> bool {
    false
}

/// The files directly in `folder` (none where it cannot be read: loading it says why).
pub fn files_in(folder: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(folder)
        .into_iter()
        .flatten()
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| path.is_file())
        .collect()
}
