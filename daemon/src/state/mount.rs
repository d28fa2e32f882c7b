//! The few mounts the allocation directories need: a size-capped tmpfs per region, a file bind
//! mount, and detaching what is below a directory before it is removed.

use std::io;
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags};

/// Mounts at `dir` a tmpfs of `bytes` (rounded up to pages) and 3 inodes (its root, one file,
/// and the hard link the region crate makes it under): nothing else fits, and nothing runs.
pub fn capped_tmpfs(dir: &Path, bytes: u64) -> io::Result<()> {
    let size = bytes.div_ceil(4096) * 4096;
    let opts = format!("size={size},nr_inodes=3,mode=0700");
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    nix::mount::mount(Some("tessera-region"), dir, Some("tmpfs"), flags, Some(opts.as_str())).map_err(io::Error::from)
}

/// Bind-mounts file `src` onto the existing file `dst`.
pub fn bind(src: &Path, dst: &Path) -> io::Result<()> {
    nix::mount::mount(Some(src), dst, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(io::Error::from)
}

/// Detaches the mount at `point` (lazily: a process still using it keeps it until it lets go).
pub fn detach(point: &Path) -> io::Result<()> {
    nix::mount::umount2(point, MntFlags::MNT_DETACH).map_err(io::Error::from)
}

/// This process's mount points at or below `dir`, deepest first (none if `dir` does not exist).
pub fn points_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(dir) = dir.canonicalize() else { return Vec::new() };
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else { return Vec::new() };
    let mut points: Vec<PathBuf> = table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape(p)))
        .filter(|p| p.starts_with(&dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    points
}

/// Detaches every mount at or below `dir`, deepest first; for test harnesses whose temporary
/// runtime dirs held allocations (their regions are mounts, which a plain remove cannot take).
pub fn detach_all_under(dir: &Path) {
    for point in points_under(dir) {
        let _ = detach(&point);
    }
}

/// A temporary directory whose mounts go with it (the daemon's unit tests).
#[cfg(test)]
pub(crate) struct TestDir(tempfile::TempDir);

#[cfg(test)]
impl TestDir {
    pub(crate) fn new() -> TestDir {
        TestDir(tempfile::tempdir().expect("a temporary directory"))
    }

    pub(crate) fn path(&self) -> &Path {
        self.0.path()
    }
}

#[cfg(test)]
impl Drop for TestDir {
    fn drop(&mut self) {
        detach_all_under(self.0.path());
    }
}

/// mountinfo writes space, tab, newline and backslash as `\ooo` octal escapes.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && let Ok(v) = u8::from_str_radix(&field[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape(r"/run/a\040b"), "/run/a b");
        assert_eq!(unescape(r"/x\134y"), r"/x\y");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape(r"/end\04"), r"/end\04");
    }
}
