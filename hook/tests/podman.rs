//! podman 4.3 (Debian 12): CDI (`--device tessera.io/gpu=…`, specs in /var/run/cdi: podman 4.3 has
//! no spec-dir flag and reads CDI up to 0.5.0) and hooks.d (`--hooks-dir`, env asks for devices).
//! Each container checks from inside what it sees.

mod common;

use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Output};

use common::*;

const CDI_DIR: &str = "/var/run/cdi";

/// podman's CDI directory is global: one test at a time, across test binaries too.
struct Lock(#[allow(dead_code)] std::fs::File);

fn lock() -> Lock {
    let f = std::fs::File::create("/tmp/tessera-hook-podman.lock").unwrap();
    // SAFETY: flock on an open fd; blocks until the lock is ours.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0);
    Lock(f)
}

fn podman(args: &[&str], rootfs: &Path, script: &str) -> Output {
    let mut c = Command::new("podman");
    c.args(["run", "--rm", "--runtime", "runc", "--network", "none"]);
    // podman 4.3 here cannot raise rlimits itself: explicit values.
    c.args(["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]);
    c.args(args).arg("--rootfs").arg(rootfs).args(["/bin/sh", "-c", script]);
    c.stdin(std::process::Stdio::null());
    c.output().expect("run podman")
}

/// A podman test's start: the lock the podman tests take in turn, and a fresh node; `None` (a skip)
/// where podman cannot run containers here ([`podman_works`]).
fn podman_test() -> Option<(Lock, Node)> {
    let lock = lock();
    let node = Node::new();
    podman_works(node.path()).then_some((lock, node))
}

fn podman_works(base: &Path) -> bool {
    if !is_root() {
        return skip("podman tests need root");
    }
    if which("podman").is_none() || which("runc").is_none() {
        return skip("podman or runc is not installed (Debian packages podman, runc)");
    }
    let Some(rootfs) = busybox_rootfs(&base.join("probe-rootfs")) else { return false };
    let out = podman(&[], &rootfs, "echo ok");
    if !(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok")) {
        return skip(&format!("podman cannot run containers here: {}", text(&out)));
    }
    true
}

/// Our spec files in podman's directory for the test's duration.
struct Specs;

impl Specs {
    fn install(node: &Node) -> Specs {
        // podman 4.3's CDI library stops at 0.5.0.
        node.write_specs(Path::new(CDI_DIR), Some(tessera_region::cdi::CDI_VERSION_COMPAT));
        // The hook reads the same directory.
        let cfg = std::fs::read_to_string(&node.config).unwrap();
        let cfg = cfg.replace(&format!("{:?}", node.cdi.display().to_string()), &format!("{CDI_DIR:?}"));
        std::fs::write(&node.config, cfg).unwrap();
        Specs
    }
}

impl Drop for Specs {
    fn drop(&mut self) {
        for c in tessera_region::cdi::CLASSES {
            let _ = std::fs::remove_file(Path::new(CDI_DIR).join(tessera_region::cdi::spec_file_name(c)));
        }
    }
}

#[test]
fn podman_cdi_device_gets_exactly_its_gpu() {
    let Some((_l, node)) = podman_test() else { return };
    let _specs = Specs::install(&node);
    let rootfs = busybox_rootfs(&node.path().join("rootfs")).unwrap();
    let out = podman(&["--device", &format!("tessera.io/gpu={GPU0}"), "-e", "TESSERA_ALLOCATION=a1"], &rootfs, PROBE);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert_gpu0(&all);
    // The CDI edits' environment reaches the process.
    assert_eq!(lines(&all, "markers "), ["markers 1"], "{all}");

    // By alias, as a share: the same GPU.
    let rootfs = busybox_rootfs(&node.path().join("rootfs2")).unwrap();
    let out =
        podman(&["--device", &format!("tessera.io/share={GPU0}::3"), "-e", "TESSERA_ALLOCATION=a1"], &rootfs, PROBE);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert_gpu0(&all);

    // A device of another allocation: the hook refuses the start.
    let rootfs = busybox_rootfs(&node.path().join("rootfs3")).unwrap();
    let out = podman(&["--device", "tessera.io/gpu=1", "-e", "TESSERA_ALLOCATION=a1"], &rootfs, "echo STARTED");
    let all = text(&out);
    assert!(!out.status.success() && !all.contains("STARTED"), "{all}");
    assert!(all.contains("is not allocated to this container"), "{all}");

    // With a driver directory: podman makes its one mount, and the spec's hook entry (its
    // `--link` arguments) links each driver file into it.
    let node = Node::with_driver_dir();
    let _specs = Specs::install(&node);
    let rootfs = busybox_rootfs(&node.path().join("rootfs")).unwrap();
    let script = format!("{PROBE}\necho \"link $(/bin/busybox readlink /usr/bin/nvidia-smi)\"\n");
    let out = podman(&["--device", &format!("tessera.io/gpu={GPU0}"), "-e", "TESSERA_ALLOCATION=a1"], &rootfs, &script);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert_gpu0(&all);
    assert_eq!(lines(&all, "link "), ["link /usr/lib/tessera/driver/usr/bin/nvidia-smi"], "{all}");
}

#[test]
fn podman_hooks_dir_injects_on_env_request() {
    let Some((_l, node)) = podman_test() else { return };
    let hooks = node.path().join("hooks.d");
    std::fs::create_dir_all(&hooks).unwrap();
    let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/hooks.d/tessera-hook.json")).unwrap();
    let hook = example
        .replace("/usr/local/bin/tessera-hook", HOOK)
        .replace("/etc/tessera/hook.toml", &node.config.display().to_string());
    std::fs::write(hooks.join("tessera-hook.json"), hook).unwrap();
    let hooks_arg = format!("--hooks-dir={}", hooks.display());

    let rootfs = busybox_rootfs(&node.path().join("rootfs")).unwrap();
    let out = podman(&[&hooks_arg, "-e", "TESSERA_VISIBLE_DEVICES=0", "-e", "TESSERA_ALLOCATION=a1"], &rootfs, PROBE);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert_gpu0(&all);

    // The annotation way, and a refusal.
    let rootfs = busybox_rootfs(&node.path().join("rootfs2")).unwrap();
    let out = podman(
        &[
            &hooks_arg,
            "--annotation",
            &format!("tessera.io/devices={GPU1}"),
            "--annotation",
            "tessera.io/allocation=a1",
        ],
        &rootfs,
        "echo STARTED",
    );
    let all = text(&out);
    assert!(!out.status.success() && !all.contains("STARTED") && all.contains("is not allocated"), "{all}");

    // A container asking for nothing is untouched.
    let rootfs = busybox_rootfs(&node.path().join("rootfs3")).unwrap();
    let out = podman(&[&hooks_arg], &rootfs, PROBE);
    let all = text(&out);
    assert!(out.status.success() && lines(&all, "file ").is_empty(), "{all}");
}
