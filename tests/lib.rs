//! Support for the cross-part flows in `flows/`: the test kubelet and the daemon launcher the
//! daemon's own integration tests use (one copy, shared by path), and the built programs.

#[path = "../daemon/tests/common/mod.rs"]
pub mod kubelet;

use std::path::PathBuf;

/// The built shim, `libtessera.so`, beside the test binaries.
pub fn shim() -> PathBuf {
    let p = tessera_sim_testkit::profile_dir().join("libtessera.so");
    assert!(p.exists(), "{} is missing: build it first (cargo build --workspace)", p.display());
    p
}

/// Whether runc can run containers here; prints a SKIP line when not (an error instead when
/// `TESSERA_REQUIRE_RUNTIMES` is set, as in the hook's own tests).
pub fn runc_usable() -> bool {
    let why = if nix_is_root() {
        match std::process::Command::new("runc").arg("--version").output() {
            Ok(o) if o.status.success() => return true,
            _ => "runc is not installed (Debian package runc; scripts/deps.sh installs it)",
        }
    } else {
        "runc tests need root"
    };
    assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "TESSERA_REQUIRE_RUNTIMES is set, but {why}");
    println!("SKIP: {why}");
    false
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(2) == Some("0")))
        .unwrap_or(false)
}

/// A character device node (root only), for a fake `/dev`.
pub fn mknod(path: &std::path::Path, major: u32, minor: u32) {
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
    let status = std::process::Command::new("mknod")
        .arg(path)
        .args(["c", &major.to_string(), &minor.to_string()])
        .status()
        .expect("mknod");
    assert!(status.success(), "mknod {}", path.display());
}

/// A busybox root file system (Debian's busybox-static), or `None` with a SKIP line.
pub fn busybox_rootfs(root: &std::path::Path) -> Option<PathBuf> {
    let Some(busybox) = ["/bin/busybox", "/usr/bin/busybox"].iter().map(PathBuf::from).find(|p| p.is_file()) else {
        println!("SKIP: busybox is not installed (Debian package busybox-static)");
        return None;
    };
    for d in ["bin", "dev", "proc", "sys", "etc", "tmp", "usr/lib", "run"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    std::fs::copy(&busybox, root.join("bin/busybox")).expect("copy busybox");
    for applet in ["sh", "cat", "stat", "echo", "ls"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).expect("symlink");
    }
    Some(root.to_path_buf())
}
