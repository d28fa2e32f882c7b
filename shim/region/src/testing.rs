//! Test support shared by the crates that use these contracts (feature `testing`): a small tmpfs
//! of a test's own, for out-of-space and size-cap tests; with `host`, a fake node's devices and a
//! claim's spec for CDI tests. Mounting needs root: elsewhere a test prints
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

#[cfg(feature = "host")]
pub use cdi_node::*;

#[cfg(feature = "host")]
mod cdi_node {
    use std::path::{Path, PathBuf};

    use crate::cdi::{ClaimDevices, NodeDevice, NodeDevices, Spec, build_claim_spec};
    use crate::driver::DriverFiles;

    /// A fake node for CDI tests (feature `host`): device nodes made with mknod under `root/dev`
    /// (root only), one GPU with a share, one MIG.
    pub fn fake_node(root: &Path) -> NodeDevices {
        let dev = root.join("dev");
        std::fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
        let mk = |p: &Path, major: u32, minor: u32| {
            if p.exists() {
                return;
            }
            let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
            let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(major, minor)) };
            assert_eq!(rc, 0, "mknod {}: {}", p.display(), std::io::Error::last_os_error());
        };
        mk(&dev.join("nvidia0"), 195, 0);
        mk(&dev.join("nvidia1"), 195, 1);
        mk(&dev.join("nvidiactl"), 195, 255);
        mk(&dev.join("nvidia-uvm"), 510, 0);
        mk(&dev.join("nvidia-caps/nvidia-cap21"), 511, 21);
        NodeDevices {
            devices: vec![
                NodeDevice {
                    class: "gpu".into(),
                    name: "GPU-aaaa".into(),
                    aliases: vec!["0".into()],
                    uuid: "GPU-aaaa".into(),
                    nodes: vec![dev.join("nvidia0")],
                },
                NodeDevice {
                    class: "share".into(),
                    name: "GPU-aaaa::3".into(),
                    aliases: vec![],
                    uuid: "GPU-aaaa".into(),
                    nodes: vec![dev.join("nvidia0")],
                },
                NodeDevice {
                    class: "mig".into(),
                    name: "MIG-bbbb".into(),
                    aliases: vec!["1:0".into()],
                    uuid: "MIG-bbbb".into(),
                    nodes: vec![dev.join("nvidia1"), dev.join("nvidia-caps/nvidia-cap21")],
                },
            ],
            control_nodes: vec![dev.join("nvidiactl"), dev.join("nvidia-uvm"), dev.join("nvidia-modeset")],
            driver: DriverFiles::default(),
            driver_dir: None,
            shim: None,
            hook_binary: PathBuf::from(crate::paths::HOOK),
            hook_config: PathBuf::from("/run/tessera/hook.toml"),
            dev_root: dev,
            cdi_version: None,
        }
    }

    pub const CLAIM_UID: &str = "7c1b3c8e-5d2a-4b7e-9f00-0123456789ab";

    /// The spec of a claim prepared into allocation `a1` holding GPU-aaaa of [`fake_node`].
    pub fn claim_spec(node: &NodeDevices, run: &Path, shim: &Path) -> Spec {
        let claim = ClaimDevices {
            claim_uid: CLAIM_UID.into(),
            allocation: "a1".into(),
            alloc_dir: run.join("alloc/a1"),
            preload: run.join("hook/ld.so.preload"),
            devices: vec![node.devices[0].clone(), node.devices[1].clone()],
        };
        let node = NodeDevices { shim: Some(shim.to_path_buf()), ..node.clone() };
        build_claim_spec(&node, &claim).unwrap()
    }
}
