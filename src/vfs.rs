//! The files the loaders read (model folders, adapter folders, images by path): the
//! filesystem's, or files held in memory under a mounted folder.
//!
//! A browser has no filesystem for wasm32 to read: the files a user picks or the page fetches
//! arrive as bytes. Mounting them under a folder name lets every loader read them by path, as
//! it reads a downloaded model, so there is one loading path and errors name the file as the
//! user knows it (`models/<name>/config.json` in the web page). A path under a mounted folder
//! is never looked up on disk; every other path is.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::Deref;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, LazyLock, PoisonError, RwLock};

use memmap2::Mmap;

/// One mounted folder's files, by their path inside it.
type Files = HashMap<PathBuf, Arc<Vec<u8>>>;

/// Every mounted folder, by its path.
static MOUNTS: LazyLock<RwLock<BTreeMap<PathBuf, Arc<Files>>>> = LazyLock::new(Default::default);

/// A folder of files in memory, readable by path while this lives; dropping it unmounts them.
#[derive(Debug)]
pub struct Mount {
    folder: PathBuf,
}

impl Mount {
    /// Mounts `files` (each a path inside the folder, `/`-separated, and its bytes) under
    /// `folder`. A folder already mounted, or inside or around one, is refused, as is a file
    /// path that leaves the folder.
    pub fn new(
        folder: impl Into<PathBuf>,
        files: impl IntoIterator<Item = (String, Vec<u8>)>,
    ) -> io::Result<Self> {
        let folder = folder.into();
        let mut held = Files::new();
        for (name, bytes) in files {
            // Held as given: a model's files may be most of a page's memory.
            held.insert(inside(&name)?, Arc::new(bytes));
        }
        let mut mounts = MOUNTS.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(other) = mounts
            .keys()
            .find(|other| other.starts_with(&folder) || folder.starts_with(other))
        {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} is mounted already", other.display()),
            ));
        }
        mounts.insert(folder.clone(), Arc::new(held));
        Ok(Self { folder })
    }

    /// The folder the files are under.
    pub fn folder(&self) -> &Path {
        &self.folder
    }

    /// Adds a file to the folder and returns its path; a name taken already is refused.
    pub fn add(&self, name: &str, bytes: Vec<u8>) -> io::Result<PathBuf> {
        let inside = inside(name)?;
        let mut mounts = MOUNTS.write().unwrap_or_else(PoisonError::into_inner);
        let files = Arc::make_mut(
            mounts
                .get_mut(&self.folder)
                .expect("mounted while it lives"),
        );
        if files.contains_key(&inside) || holds_folder(files, &inside) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{name} is in {} already", self.folder.display()),
            ));
        }
        files.insert(inside.clone(), Arc::new(bytes));
        Ok(self.folder.join(inside))
    }
}

/// `name` as a path inside a folder: relative, without `..`, not empty.
fn inside(name: &str) -> io::Result<PathBuf> {
    let path = Path::new(name);
    if name.is_empty() || !path.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name}: not a path inside the folder"),
        ));
    }
    Ok(path.to_owned())
}

impl Drop for Mount {
    fn drop(&mut self) {
        MOUNTS
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.folder);
    }
}

/// Where a path leads: into a mounted folder (its files and the path inside it) or to disk.
enum Place {
    Mounted(Arc<Files>, PathBuf),
    Disk,
}

fn place(path: &Path) -> Place {
    let mounts = MOUNTS.read().unwrap_or_else(PoisonError::into_inner);
    mounts
        .iter()
        .find_map(|(folder, files)| {
            let inside = path.strip_prefix(folder).ok()?;
            Some(Place::Mounted(files.clone(), inside.to_owned()))
        })
        .unwrap_or(Place::Disk)
}

fn not_found() -> io::Error {
    io::ErrorKind::NotFound.into()
}

/// A whole file's bytes: memory-mapped from disk, or held in memory.
#[derive(Debug)]
pub enum Bytes {
    /// A file on disk, mapped.
    Mapped(Mmap),
    /// A mounted file.
    Held(Arc<Vec<u8>>),
}

impl Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(map) => map,
            Bytes::Held(bytes) => bytes,
        }
    }
}

/// The file at `path`, memory-mapped where it is on disk (a folder is an error, as reading it
/// would be).
pub fn map(path: &Path) -> io::Result<Bytes> {
    match place(path) {
        Place::Mounted(files, inside) => files
            .get(&inside)
            .map(|bytes| Bytes::Held(bytes.clone()))
            .ok_or_else(not_found),
        Place::Disk => {
            let file = std::fs::File::open(path)?;
            // A folder opens, and mapping it would fail as "no such device".
            if file.metadata()?.is_dir() {
                return Err(io::Error::new(
                    io::ErrorKind::IsADirectory,
                    "it is a folder",
                ));
            }
            // Safety: the file is only read; a file changing under a running process is
            // outside what any loader can defend against.
            Ok(Bytes::Mapped(unsafe { Mmap::map(&file) }?))
        }
    }
}

/// The file at `path`.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    match place(path) {
        Place::Mounted(files, inside) => files
            .get(&inside)
            .map(|bytes| bytes.to_vec())
            .ok_or_else(not_found),
        Place::Disk => std::fs::read(path),
    }
}

/// The file at `path` as UTF-8 text.
pub fn read_to_string(path: &Path) -> io::Result<String> {
    String::from_utf8(read(path)?).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Whether a file or folder is at `path`.
pub fn exists(path: &Path) -> bool {
    match place(path) {
        Place::Mounted(files, inside) => {
            files.contains_key(&inside) || holds_folder(&files, &inside)
        }
        Place::Disk => path.exists(),
    }
}

/// Whether a file is at `path`.
pub fn is_file(path: &Path) -> bool {
    match place(path) {
        Place::Mounted(files, inside) => files.contains_key(&inside),
        Place::Disk => path.is_file(),
    }
}

/// Whether a folder is at `path` (a mounted folder, or a folder inside one that holds files).
pub fn is_dir(path: &Path) -> bool {
    match place(path) {
        Place::Mounted(files, inside) => holds_folder(&files, &inside),
        Place::Disk => path.is_dir(),
    }
}

fn holds_folder(files: &Files, inside: &Path) -> bool {
    files
        .keys()
        .any(|file| file.starts_with(inside) && file != inside)
        || inside.as_os_str().is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(names: &[&str]) -> Vec<(String, Vec<u8>)> {
        names
            .iter()
            .map(|name| (name.to_string(), name.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn mounted_files_read_by_path_and_go_with_the_mount() {
        let mount = Mount::new("/mounted-test/a", files(&["config.json", "sub/x.bin"])).unwrap();
        let folder = mount.folder().to_owned();
        assert_eq!(read(&folder.join("config.json")).unwrap(), b"config.json");
        assert_eq!(
            read_to_string(&folder.join("sub/x.bin")).unwrap(),
            "sub/x.bin"
        );
        assert_eq!(&*map(&folder.join("sub/x.bin")).unwrap(), b"sub/x.bin");
        assert!(is_dir(&folder) && is_dir(&folder.join("sub")));
        assert!(is_file(&folder.join("config.json")) && !is_dir(&folder.join("config.json")));
        assert!(!exists(&folder.join("su")) && !exists(&folder.join("missing")));
        assert_eq!(
            read(&folder.join("missing")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        assert_eq!(
            mount.add("added.png", b"png".to_vec()).unwrap(),
            folder.join("added.png")
        );
        assert_eq!(read(&folder.join("added.png")).unwrap(), b"png");
        for taken in ["added.png", "sub"] {
            let error = mount.add(taken, Vec::new()).unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::AlreadyExists, "{taken}");
        }
        drop(mount);
        assert!(!exists(&folder.join("config.json")));
        assert_eq!(
            read(&folder.join("config.json")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn overlapping_mounts_and_paths_leaving_the_folder_are_refused() {
        let _mount = Mount::new("/mounted-test/b", files(&["f"])).unwrap();
        for folder in ["/mounted-test/b", "/mounted-test/b/inner", "/mounted-test"] {
            let error = Mount::new(folder, files(&["g"])).unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::AlreadyExists, "{folder}");
        }
        for name in ["../f", "/etc/passwd", "a/../../f", ""] {
            let error = Mount::new("/mounted-test/c", files(&[name])).unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::InvalidInput, "{name}");
        }
    }

    #[test]
    fn paths_outside_mounts_are_read_from_disk() {
        let folder = tempfile::tempdir().unwrap();
        std::fs::write(folder.path().join("f"), b"disk").unwrap();
        assert_eq!(read(&folder.path().join("f")).unwrap(), b"disk");
        assert_eq!(&*map(&folder.path().join("f")).unwrap(), b"disk");
        assert_eq!(
            map(folder.path()).unwrap_err().kind(),
            io::ErrorKind::IsADirectory
        );
    }
}
