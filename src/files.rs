//! Output files written all or nothing: the bytes go to a temporary file beside the target,
//! created with the permissions `File::create` would give (0o666 less the umask, where
//! tempfile's own default is 0o600), and renamed over the target only once complete.
//!
//! The target is the file a symbolic link at the path points to, and an existing file keeps its
//! permissions (and, where the process may set them, its owner). A target that is not a regular
//! file (`/dev/null`, a named pipe) is written in place, once all the bytes are ready, instead of
//! being replaced by a regular file.

use std::fs::{File, Metadata};
use std::io::{self, Seek};
use std::path::{Path, PathBuf};

/// Symbolic links followed before giving up (Linux's own limit).
const MAX_LINKS: usize = 40;

/// Writes the file at `path` with `write`; when anything fails, no file and no partial
/// temporary file is left.
pub fn write_whole(path: &Path, write: impl FnOnce(&mut File) -> io::Result<()>) -> io::Result<()> {
    let (target, existing) = resolve(path)?;
    match existing {
        Some(meta) if !meta.is_file() => {
            // A device or a pipe: the bytes whole in a temporary file first, then copied in.
            let mut file = tempfile::tempfile()?;
            write(&mut file)?;
            file.rewind()?;
            io::copy(&mut file, &mut File::options().write(true).open(&target)?)?;
        }
        existing => {
            let mut file = temp_file_beside(&target)?;
            write(file.as_file_mut())?;
            if let Some(meta) = existing {
                keep_mode_and_owner(file.as_file(), &meta)?;
            }
            file.persist(&target).map_err(|e| e.error)?;
        }
    }
    Ok(())
}

/// Fails when the output at `path` cannot be written (a folder, a missing or read-only folder),
/// before the work that would fill it; the probe file is removed again.
pub fn check_writable(path: &Path) -> io::Result<()> {
    match resolve(path)? {
        (_, Some(meta)) if !meta.is_file() => Ok(()),
        (target, _) => temp_file_beside(&target).map(drop),
    }
}

/// The file that writing to `path` writes (symbolic links followed) and its metadata if it
/// exists; a folder, or a path that names one (`out/`), is an error.
fn resolve(path: &Path) -> io::Result<(PathBuf, Option<Metadata>)> {
    if path.to_string_lossy().ends_with(std::path::is_separator) {
        return Err(io::Error::other(
            "it names a folder (it ends with a separator)",
        ));
    }
    // A device or pipe at the end of the links is opened through them: a link may name it
    // in a way no path can (`/dev/stdout` → `/proc/self/fd/1` → `pipe:[…]`).
    if let Ok(meta) = std::fs::metadata(path)
        && !(meta.is_file() || meta.is_dir())
    {
        return Ok((path.to_owned(), Some(meta)));
    }
    let mut target = path.to_owned();
    for _ in 0..MAX_LINKS {
        let link = match std::fs::symlink_metadata(&target) {
            Ok(meta) if meta.file_type().is_symlink() => std::fs::read_link(&target)?,
            Ok(meta) if meta.is_dir() => return Err(io::Error::other("it is a folder")),
            Ok(meta) => return Ok((target, Some(meta))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let folder = folder_of(&target);
                if !folder.is_dir() {
                    return Err(io::Error::other(format!(
                        "the folder {} does not exist",
                        folder.display()
                    )));
                }
                return Ok((target, None));
            }
            Err(e) => return Err(e),
        };
        target = folder_of(&target).join(link); // an absolute link replaces the folder
    }
    Err(io::Error::other(format!(
        "more than {MAX_LINKS} symbolic links lead from it"
    )))
}

/// Gives the replacement `file` the permissions of the file it replaces and, where the process
/// may (as that file's owner or root), its owner and group.
fn keep_mode_and_owner(file: &File, existing: &Metadata) -> io::Result<()> {
    file.set_permissions(existing.permissions())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let ours = file.metadata()?;
        if (ours.uid(), ours.gid()) != (existing.uid(), existing.gid()) {
            // Not permitted for another user's file unless root: the file is then the writer's,
            // as any editor's replacement would be.
            let _ = std::os::unix::fs::fchown(file, Some(existing.uid()), Some(existing.gid()));
        }
    }
    Ok(())
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
    #[cfg_attr(not(unix), allow(unused_mut))]
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
        // A missing folder named with a trailing separator is one too, not a file in `.`.
        let error = check_writable(&folder.path().join("out/")).unwrap_err();
        assert!(error.to_string().contains("names a folder"), "{error}");
        check_writable(&folder.path().join("out")).unwrap();
        assert!(names(folder.path()).is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn a_replaced_file_keeps_its_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let folder = tempfile::tempdir().unwrap();
        let target = folder.path().join("private");
        std::fs::write(&target, b"old").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_whole(&target, |f| io::Write::write_all(f, b"new")).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        let mode = target.metadata().unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }

    #[cfg(unix)]
    #[test]
    fn a_symbolic_link_is_written_through() {
        let folder = tempfile::tempdir().unwrap();
        let (file, link, dangling) = (
            folder.path().join("file"),
            folder.path().join("link"),
            folder.path().join("dangling"),
        );
        std::fs::write(&file, b"old").unwrap();
        std::os::unix::fs::symlink("file", &link).unwrap();
        write_whole(&link, |f| io::Write::write_all(f, b"new")).unwrap();
        assert!(link.symlink_metadata().unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        // A link to a file not there yet creates the file it names.
        std::os::unix::fs::symlink("later", &dangling).unwrap();
        write_whole(&dangling, |f| io::Write::write_all(f, b"made")).unwrap();
        assert!(
            dangling
                .symlink_metadata()
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::read(folder.path().join("later")).unwrap(), b"made");
        assert_eq!(names(folder.path()), ["dangling", "file", "later", "link"]);
    }

    #[cfg(unix)]
    #[test]
    fn a_device_is_written_in_place_not_replaced() {
        let null = Path::new("/dev/null");
        check_writable(null).unwrap();
        write_whole(null, |f| io::Write::write_all(f, b"gone")).unwrap();
        let meta = null.symlink_metadata().unwrap();
        assert!(
            !meta.is_file() && !meta.file_type().is_symlink(),
            "{meta:?}"
        );
    }
}
