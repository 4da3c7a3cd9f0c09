//! Output files written all or nothing: the bytes go to a temporary file beside the target,
//! created with the permissions `File::create` would give (0o666 less the umask, where
//! tempfile's own default is 0o600), and renamed over the target only once complete.

use std::fs::File;
use std::io;
use std::path::Path;

/// Writes the file at `path` with `write`; when anything fails, no file and no partial
/// temporary file is left.
pub fn write_whole(path: &Path, write: impl FnOnce(&mut File) -> io::Result<()>) -> io::Result<()> {
    let mut file = temp_file_beside(path)?;
    write(file.as_file_mut())?;
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// Fails when no file can be created in `path`'s folder (missing, not writable), before the
/// work that would fill it; the probe file is removed again.
pub fn check_writable(path: &Path) -> io::Result<()> {
    if path.is_dir() {
        return Err(io::Error::other("it is a folder"));
    }
    let folder = folder_of(path);
    if !folder.is_dir() {
        return Err(io::Error::other(format!(
            "the folder {} does not exist",
            folder.display()
        )));
    }
    temp_file_beside(path).map(drop)
}

/// The folder `path` is in (`.` for a bare file name).
fn folder_of(path: &Path) -> &Path {
    match path.parent() {
        Some(folder) if !folder.as_os_str().is_empty() => folder,
        _ => Path::new("."),
    }
}

fn temp_file_beside(path: &Path) -> io::Result<tempfile::NamedTempFile> {
    let folder = folder_of(path);
    let mut builder = tempfile::Builder::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    builder.tempfile_in(folder)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names in `folder`.
    fn names(folder: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(folder)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_written_file_has_the_permissions_of_a_created_one() {
        let folder = tempfile::tempdir().unwrap();
        let (written, created) = (folder.path().join("written"), folder.path().join("created"));
        write_whole(&written, |f| io::Write::write_all(f, b"bytes")).unwrap();
        File::create(&created).unwrap();
        assert_eq!(std::fs::read(&written).unwrap(), b"bytes");
        assert_eq!(
            written.metadata().unwrap().permissions(),
            created.metadata().unwrap().permissions()
        );
        assert_eq!(names(folder.path()), ["created", "written"]);
    }

    #[test]
    fn a_failed_write_leaves_nothing() {
        let folder = tempfile::tempdir().unwrap();
        let target = folder.path().join("out");
        let error = write_whole(&target, |f| {
            io::Write::write_all(f, b"half")?;
            Err(io::Error::other("stopped"))
        })
        .unwrap_err();
        assert_eq!(error.to_string(), "stopped");
        assert!(names(folder.path()).is_empty());
    }

    #[test]
    fn folders_and_missing_folders_are_not_writable() {
        let folder = tempfile::tempdir().unwrap();
        assert!(check_writable(folder.path()).is_err());
        assert!(check_writable(&folder.path().join("missing/out")).is_err());
        check_writable(&folder.path().join("out")).unwrap();
        assert!(names(folder.path()).is_empty());
    }
}
