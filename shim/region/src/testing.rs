//! Test support shared by the crates that keep regions (feature `testing`): a small tmpfs of a
//! test's own, for out-of-space and size-cap tests. Mounting needs root: elsewhere a test prints
//! a SKIP line, and fails instead when `TESSERA_REQUIRE_RUNTIMES` is set (as in CI, which runs as
//! root), so such a test never passes silently without running.

use std::path::{Path, PathBuf};

/// A tmpfs mounted for one test; unmounted (lazily) when dropped.
#[derive(Debug)]
pub struct TestTmpfs {
    dir: tempfile::TempDir,
}

impl TestTmpfs {
    /// A tmpfs of `size` bytes, or `None` (after a SKIP line) where this process may not mount.
    pub fn mount(size: u64) -> Option<TestTmpfs> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let target = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).expect("a path without NUL");
        let opts = std::ffi::CString::new(format!("size={size},mode=0755")).expect("options");
        // SAFETY: all strings are valid and NUL-terminated; mounting changes no memory of ours.
        let rc = unsafe { libc::mount(c"tmpfs".as_ptr(), target.as_ptr(), c"tmpfs".as_ptr(), 0, opts.as_ptr().cast()) };
        if rc != 0 {
            let why = format!("cannot mount a test tmpfs ({}); this test needs root", std::io::Error::last_os_error());
            assert!(
                std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(),
                "TESSERA_REQUIRE_RUNTIMES is set, but {why}"
            );
            println!("SKIP: {why}");
            return None;
        }
        Some(TestTmpfs { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.dir.path().join(p)
    }

    /// Fills the file system: a file `filler` takes every free block.
    pub fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.join("filler")).expect("create the filler");
        let block = [0xa5u8; 4096];
        while f.write_all(&block).is_ok() {}
    }
}

impl Drop for TestTmpfs {
    fn drop(&mut self) {
        // Mounts a test made inside it go with it (MNT_DETACH takes the whole tree).
        let target = std::ffi::CString::new(self.dir.path().as_os_str().as_encoded_bytes()).expect("a path");
        // SAFETY: a valid path; detaching our own mount.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}
