//! The bundled model (random weights in Qwen2-VL's layout, its four PEFT adapters, its example
//! images and batch), compiled into the binary, so every front end's default (the `mmlora`
//! command's, the Python package's `Engine()`) works from any copy of the binary, wherever the
//! checkout it was built in has gone.
//!
//! A front end that runs on it unpacks it into a private temporary folder, deleted when the
//! front end is done with it, and loads it from there as it loads any downloaded model: one
//! loading path.

use std::io;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

/// What the bundled model is called where a model folder's path would be shown or recorded.
pub const NAME: &str = "bundled tiny-qwen2-vl";

/// One file of the bundled model: its path inside `assets/tiny-qwen2-vl/` and its bytes.
macro_rules! bundled_file {
    ($path:literal) => {
        (
            $path,
            include_bytes!(concat!("../assets/tiny-qwen2-vl/", $path)) as &[u8],
        )
    };
}

/// Every file of `assets/tiny-qwen2-vl/` but `expected.safetensors` (the tests' expected
/// outputs, which no command reads).
pub const FILES: &[(&str, &[u8])] = &[
    bundled_file!("adapters/all-r4/adapter_config.json"),
    bundled_file!("adapters/all-r4/adapter_model.safetensors"),
    bundled_file!("adapters/patterns/adapter_config.json"),
    bundled_file!("adapters/patterns/adapter_model.safetensors"),
    bundled_file!("adapters/rslora-r8/adapter_config.json"),
    bundled_file!("adapters/rslora-r8/adapter_model.safetensors"),
    bundled_file!("adapters/tower-r2/adapter_config.json"),
    bundled_file!("adapters/tower-r2/adapter_model.safetensors"),
    bundled_file!("batch.json"),
    bundled_file!("config.json"),
    bundled_file!("images/gray.png"),
    bundled_file!("images/lossless.webp"),
    bundled_file!("images/progressive.jpg"),
    bundled_file!("images/rgba.png"),
    bundled_file!("images/square.png"),
    bundled_file!("images/wide.jpg"),
    bundled_file!("model-00001-of-00002.safetensors"),
    bundled_file!("model-00002-of-00002.safetensors"),
    bundled_file!("model.safetensors.index.json"),
    bundled_file!("preprocessor_config.json"),
];

/// A model folder a front end runs on: the one it was given, or the bundled model unpacked.
pub struct ModelDir {
    path: PathBuf,
    label: String,
    /// The unpacked bundle, deleted when this is dropped.
    _unpacked: Option<TempDir>,
}

impl ModelDir {
    /// `given`, or the bundled model unpacked into a fresh temporary folder.
    pub fn given_or_bundled(given: Option<PathBuf>) -> io::Result<Self> {
        match given {
            Some(path) => Ok(Self {
                label: path.display().to_string(),
                path,
                _unpacked: None,
            }),
            None => {
                let unpacked = unpack()?;
                Ok(Self {
                    path: unpacked.path().to_owned(),
                    label: NAME.to_owned(),
                    _unpacked: Some(unpacked),
                })
            }
        }
    }

    /// The folder to read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The folder as shown to the user and recorded in outputs: its path, or [`NAME`].
    pub fn label(&self) -> &str {
        &self.label
    }
}

/// Writes [`FILES`] into a new temporary folder.
fn unpack() -> io::Result<TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("mmlora-bundled-")
        .tempdir()?;
    for (path, bytes) in FILES {
        let file = dir.path().join(path);
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&file, bytes)?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bundle holds every file of the checkout's bundled model (but the tests' expected
    /// outputs), byte for byte, and unpacks to the same tree.
    #[test]
    fn bundle_is_the_assets_folder() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-qwen2-vl");
        let mut on_disk: Vec<String> = walkdir::WalkDir::new(&root)
            .into_iter()
            .map(Result::unwrap)
            .filter(|entry| entry.file_type().is_file())
            .map(|entry| {
                entry
                    .path()
                    .strip_prefix(&root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|rel| rel != "expected.safetensors")
            .collect();
        on_disk.sort();
        let bundled: Vec<&str> = FILES.iter().map(|(path, _)| *path).collect();
        assert_eq!(on_disk, bundled);
        let unpacked = ModelDir::given_or_bundled(None).unwrap();
        assert_eq!(unpacked.label(), NAME);
        for (path, bytes) in FILES {
            assert_eq!(std::fs::read(root.join(path)).unwrap(), *bytes, "{path}");
            assert_eq!(
                std::fs::read(unpacked.path().join(path)).unwrap(),
                *bytes,
                "{path}"
            );
        }
        let folder = unpacked.path().to_owned();
        drop(unpacked);
        assert!(
            !folder.exists(),
            "the unpacked bundle is deleted with its ModelDir"
        );
    }
}
