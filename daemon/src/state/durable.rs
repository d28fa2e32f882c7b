//! Crash-safe whole-file writes: a temporary file beside the target, fsynced, renamed over it,
//! then the directory fsynced. After a crash the file is either the old one or the new one. And
//! where a damaged file goes for a person to look at: beside it, never over an earlier one.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Replaces `path` with `bytes` (mode `mode`) durably.
pub fn write_file(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut tmp_name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Moves a damaged `path` aside to `<path>.corrupt`, or `.corrupt.N` where that is taken (an
/// earlier damage is kept, never overwritten); the new name.
pub fn move_aside(path: &Path) -> std::io::Result<std::path::PathBuf> {
    let base = format!("{}.corrupt", path.display());
    let mut target = std::path::PathBuf::from(&base);
    let mut n = 1;
    while target.symlink_metadata().is_ok() {
        target = std::path::PathBuf::from(format!("{base}.{n}"));
        n += 1;
    }
    std::fs::rename(path, &target)?;
    Ok(target)
}

#[cfg(test)]
mod tests {
    #[test]
    fn replaces_whole_file() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("f");
        super::write_file(&p, b"one", 0o600).unwrap();
        super::write_file(&p, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    }
}
