//! Support for the cross-part flows in `flows/`: the test kubelet and the daemon launcher the
//! daemon's own integration tests use (one copy, shared by path), and the built programs.

pub mod kube;
#[path = "../daemon/tests/common/mod.rs"]
pub mod kubelet;

use std::path::{Path, PathBuf};
use std::process::Output;

/// The built shim, `libtessera.so`, beside the test binaries.
pub fn shim() -> PathBuf {
    let p = tessera_sim_testkit::profile_dir().join("libtessera.so");
    assert!(p.exists(), "{} is missing: build it first (cargo build --workspace)", p.display());
    p
}

/// A flow's own tesserad on a simulated node: a temporary directory holding its configuration,
/// state, socket and log (`tesserad.log`); the daemon is killed on drop, before the directory
/// goes.
pub struct Tesserad {
    _daemon: kubelet::Daemon,
    tmp: tempfile::TempDir,
}

impl Tesserad {
    /// Starts tesserad on `node` with the default configuration and `config` added (more keys,
    /// tables); it, and a client of its node API once that answers.
    pub async fn start(
        node: &tessera_sim_testkit::SimNode,
        config: &str,
    ) -> (Tesserad, tessera_proto::tessera::v1::node_client::NodeClient<tonic::transport::Channel>) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        let config = kubelet::write_config(node, dir, config);
        let (daemon, _) = kubelet::spawn(node, &config, &dir.join("no-notify"), &dir.join("tesserad.log"));
        let api = kubelet::node_api(&dir.join("run/tessera.sock")).await;
        (Tesserad { _daemon: daemon, tmp }, api)
    }

    /// Its directory (what the CLI's `tessera(dir, …)` takes).
    pub fn dir(&self) -> &Path {
        self.tmp.path()
    }

    /// What it has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir().join("tesserad.log")).unwrap_or_default()
    }
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
pub fn mknod(path: &Path, major: u32, minor: u32) {
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
    let status = std::process::Command::new("mknod")
        .arg(path)
        .args(["c", &major.to_string(), &minor.to_string()])
        .status()
        .expect("mknod");
    assert!(status.success(), "mknod {}", path.display());
}

/// A busybox root file system (Debian's busybox-static), or `None` with a SKIP line.
pub fn busybox_rootfs(root: &Path) -> Option<PathBuf> {
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

/// Runs the `tessera` CLI against the daemon whose socket is `dir/run/tessera.sock`.
pub fn tessera(dir: &Path, args: &[&str]) -> Output {
    std::process::Command::new(tessera_sim_testkit::binary("tessera"))
        .arg("--socket")
        .arg(dir.join("run/tessera.sock"))
        .args(args)
        .output()
        .expect("run tessera")
}

/// The stdout of a command that must have succeeded (its output in the failure message).
pub fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A driver root at `dir/driver` whose libcuda.so.1 and libnvidia-ml.so.1 are the simulated
/// driver, and tesserad's `[injection]` for it: CDI specs in `cdi_spec_dir`, the device nodes in
/// `dir/dev`, the built shim and hook.
pub fn sim_driver_injection(dir: &Path, cdi_spec_dir: &Path) -> String {
    let lib = dir.join("driver/usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).expect("driver root");
    for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        std::fs::copy(tessera_sim_testkit::sim_library(), lib.join(name)).expect("the simulated driver");
    }
    format!(
        "[injection]\ncdi_spec_dir = {cdi_spec_dir:?}\ndriver_root = {:?}\ndev_root = {:?}\nshim_path = {:?}\nhook_path = {:?}\n",
        dir.join("driver"),
        dir.join("dev"),
        shim(),
        tessera_sim_testkit::binary("tessera-hook"),
    )
}

/// A host's GPU files under a test directory, as the daemon and the runtime see them: device
/// nodes in `dev`, the driver's library under `driver`, a stand-in `libtessera.so`.
pub struct FakeHost {
    pub dir: PathBuf,
    pub dev: PathBuf,
    pub driver: PathBuf,
    pub shim: PathBuf,
}

impl FakeHost {
    /// Makes the device `nodes` (name, major, minor; root only) and the driver's and shim's files.
    pub fn new(dir: &Path, nodes: &[(&str, u32, u32)]) -> FakeHost {
        let dev = dir.join("dev");
        for (name, major, minor) in nodes {
            mknod(&dev.join(name), *major, *minor);
        }
        let driver = dir.join("driver");
        std::fs::create_dir_all(driver.join("usr/lib/x86_64-linux-gnu")).expect("driver dir");
        std::fs::write(driver.join("usr/lib/x86_64-linux-gnu/libcuda.so.1"), "fake-libcuda").expect("lib");
        let shim = dir.join("libtessera.so");
        std::fs::write(&shim, "fake-shim").expect("shim");
        FakeHost { dir: dir.to_path_buf(), dev, driver, shim }
    }

    /// tesserad's `[injection]` section for this host (CDI specs in `dir/cdi`).
    pub fn injection_config(&self) -> String {
        format!(
            "[injection]\ncdi_spec_dir = {:?}\ndriver_root = {:?}\ndev_root = {:?}\nshim_path = {:?}\nhook_path = {:?}\n",
            self.dir.join("cdi"),
            self.driver,
            self.dev,
            self.shim,
            tessera_sim_testkit::binary("tessera-hook"),
        )
    }

    /// Writes the hook's and runtime wrapper's configuration (runc underneath) to
    /// `dir/hook.toml`; its path.
    pub fn write_hook_config(&self) -> PathBuf {
        let path = self.dir.join("hook.toml");
        std::fs::write(
            &path,
            format!(
                "cdi_spec_dirs = [{:?}]\nruntime_dir = {:?}\ndriver_root = {:?}\ndev_root = {:?}\nshim_path = {:?}\nruntime = \"runc\"\n",
                self.dir.join("cdi"),
                self.dir.join("run"),
                self.driver,
                self.dev,
                self.shim,
            ),
        )
        .expect("hook config");
        path
    }
}

/// Runs the OCI `bundle` as container `id` through `runtime` (runc, or a wrapper that takes
/// runc's arguments), its state under `root`, waiting at most `limit`: its exit status, and its
/// stdout followed by its stderr.
pub async fn run_bundle(
    mut runtime: tokio::process::Command,
    root: &Path,
    bundle: &Path,
    id: &str,
    limit: std::time::Duration,
) -> (std::process::ExitStatus, String) {
    let run = runtime.arg("--root").arg(root).args(["run", "--bundle"]).arg(bundle).arg(id);
    let out = tokio::time::timeout(limit, run.stdin(std::process::Stdio::null()).output())
        .await
        .expect("the container in time")
        .expect("the runtime runs");
    (out.status, format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// An OCI bundle at `bundle` (from `runc spec`) whose container runs `script` in `rootfs` with
/// `env` added and, unless null, these `annotations`.
pub fn runc_bundle(bundle: &Path, rootfs: &Path, script: &str, env: &[String], annotations: serde_json::Value) {
    std::fs::create_dir(bundle).expect("bundle");
    let out = std::process::Command::new("runc").arg("spec").current_dir(bundle).output().expect("runc spec");
    assert!(out.status.success());
    let mut oci: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).expect("read")).expect("json");
    oci["root"] = serde_json::json!({ "path": rootfs.display().to_string(), "readonly": false });
    oci["process"]["terminal"] = serde_json::json!(false);
    oci["process"]["args"] = serde_json::json!(["/bin/sh", "-c", script]);
    if !annotations.is_null() {
        oci["annotations"] = annotations;
    }
    for e in env {
        oci["process"]["env"].as_array_mut().expect("env").push(serde_json::json!(e));
    }
    std::fs::write(bundle.join("config.json"), serde_json::to_vec(&oci).expect("json")).expect("write");
}

/// The Python of the virtual environment named by `var` (else `target/<dir>`, where
/// scripts/deps.sh makes it) when `check` (Python code) runs in it; else `None` with a SKIP line,
/// an error when `TESSERA_REQUIRE_RUNTIMES` is set unless scripts/deps.sh recorded why it did not
/// install it on this machine (`<venv>.skipped`: too little disk). `what` names the environment.
pub fn venv_python(var: &str, dir: &str, check: &str, what: &str) -> Option<PathBuf> {
    let venv = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| tessera_sim_testkit::profile_dir().parent().expect("target dir").join(dir));
    let python = venv.join("bin/python");
    let why = if !python.exists() {
        format!("no {what} environment at {} (scripts/deps.sh makes it)", venv.display())
    } else {
        match std::process::Command::new(&python).args(["-c", check]).output() {
            Ok(o) if o.status.success() => return Some(python),
            Ok(o) => format!("{what} does not import in {}: {}", venv.display(), String::from_utf8_lossy(&o.stderr)),
            Err(e) => format!("{}: {e}", python.display()),
        }
    };
    let mut skipped = venv.into_os_string();
    skipped.push(".skipped");
    if let Ok(reason) = std::fs::read_to_string(&skipped) {
        println!("SKIP: {why}: {}", reason.trim());
        return None;
    }
    assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "TESSERA_REQUIRE_RUNTIMES is set, but {why}");
    println!("SKIP: {why}");
    None
}

/// Runs `python args…` on `node` (every GPU visible) with `extra` environment; the JSON its last
/// line prints. `what` names the program in a failure.
pub fn run_python_json(
    node: &tessera_sim_testkit::SimNode,
    python: impl AsRef<Path>,
    what: &str,
    args: &[&str],
    extra: &[(&str, &str)],
) -> serde_json::Value {
    let out = node
        .command(python)
        .args(args)
        .envs(extra.iter().copied())
        .env_remove("CUDA_VISIBLE_DEVICES")
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// `v[key]` as a number, or a panic naming it.
pub fn json_u64(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

/// The head of the driver-API Python programs (ctypes over libcuda.so.1): `cu`; the VMM
/// structures `Prop` and `Access` with their constants; `ok(rc, what)`, which exits naming the
/// call that failed; `start()` (cuInit, device 0, a context of its own); `free()` (free and total
/// bytes). A program is this head followed by its own code.
pub const CUDA_PY: &str = r#"
import ctypes, sys
from ctypes import byref, c_int, c_uint, c_size_t, c_void_p, c_ulonglong, c_ubyte

cu = ctypes.CDLL("libcuda.so.1")
class Prop(ctypes.Structure):
    _fields_ = [("type", c_uint), ("handleTypes", c_uint), ("locType", c_uint), ("locId", c_int),
                ("win32", c_void_p), ("flags", c_ubyte * 8)]
class Access(ctypes.Structure):
    _fields_ = [("locType", c_uint), ("locId", c_int), ("flags", c_uint)]
POSIX_FD, PINNED, DEVICE, READ_WRITE = 1, 1, 1, 3

def ok(rc, what):
    if rc != 0:
        sys.exit(f"{what}: CUresult {rc}")

def start():
    ok(cu.cuInit(0), "cuInit")
    dev, ctx = c_int(), c_void_p()
    ok(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
    ok(cu.cuCtxCreate_v2(byref(ctx), 0, dev), "cuCtxCreate")

def free():
    f, t = c_size_t(), c_size_t()
    ok(cu.cuMemGetInfo_v2(byref(f), byref(t)), "cuMemGetInfo")
    return f.value, t.value
"#;

/// What a runc flow starts from: a temporary directory, a busybox root file system in it, and a
/// fake host with its device nodes.
pub struct RuncTest {
    pub tmp: tempfile::TempDir,
    pub rootfs: PathBuf,
    pub host: FakeHost,
}

/// A runc flow's start with a fake host of `devices`; `None` (with a SKIP line) where runc or
/// busybox is not usable here.
pub fn runc_test(devices: &[(&str, u32, u32)]) -> Option<RuncTest> {
    if !runc_usable() {
        return None;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let rootfs = busybox_rootfs(&tmp.path().join("rootfs"))?;
    let host = FakeHost::new(tmp.path(), devices);
    Some(RuncTest { tmp, rootfs, host })
}

/// The one-H100 node most container flows run on.
pub const ONE_H100: &str = "[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n";

/// The device nodes of that node's fake host: GPU 0 and the control device.
pub const GPU0_DEVICES: &[(&str, u32, u32)] = &[("nvidia0", 195, 0), ("nvidiactl", 195, 255)];

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// The simulated node's default board (an H100 SXM5 80GB) as CUDA programs see it: its name, its
/// memory, what the sim reserves on it, and what it charges per context.
pub mod h100 {
    use super::MIB;
    pub const NAME: &str = "NVIDIA H100 80GB HBM3";
    pub const MEMORY: u64 = 81_559 * MIB;
    pub const RESERVED: u64 = 454 * MIB;
    pub const CONTEXT_OVERHEAD: u64 = 256 * MIB;
}
