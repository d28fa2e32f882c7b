//! Test support: a fake node (driver root, device nodes made with mknod, CDI specs, an allocation),
//! busybox root file systems (plain and hostile), OCI bundles, and runtime discovery with SKIP lines.
#![allow(dead_code)]

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};
use tessera_region::cdi::{self, NodeDevice, NodeDevices};

pub const HOOK: &str = env!("CARGO_BIN_EXE_tessera-hook");
pub const WRAPPER: &str = env!("CARGO_BIN_EXE_tessera-runtime");
pub const GPU0: &str = "GPU-11111111-2222-3333-4444-555555555555";
pub const GPU1: &str = "GPU-66666666-7777-8888-9999-000000000000";
pub const MIG: &str = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

/// The script every container runs: what it sees of its devices, libraries, preload and limits.
pub const PROBE: &str = r#"
for f in /dev/nvidia* /dev/nvidia-caps/*; do [ -c "$f" ] && echo "node $f $(stat -c '%t:%T' $f)"; done
echo "open0 $(cat /dev/nvidia0 2>&1 | head -c 60)"
echo "open1 $(cat /dev/nvidia1 2>&1 | head -c 60)"
for f in /usr/lib/x86_64-linux-gnu/* /usr/bin/nvidia-smi /usr/lib/tessera/*; do [ -f "$f" ] && echo "file $f $(cat $f)"; done
echo "preload $(cat /etc/ld.so.preload 2>&1)"
echo "ldconf $(cat /etc/ld.so.conf.d/000-tessera.conf 2>&1)"
echo "limits $(cat /run/tessera/alloc/limits 2>&1 | tr '\n' ' ')"
echo "region-writable $( (echo x >> /run/tessera/alloc/region) 2>/dev/null && echo yes || echo no)"
echo "limits-writable $( (echo x >> /run/tessera/alloc/limits) 2>/dev/null && echo yes || echo no)"
echo "markers $(env | grep -c '^TESSERA_CDI_DEVICE_')"
echo "env TESSERA_LIMITS=$TESSERA_LIMITS TESSERA_ALLOCATION=$TESSERA_ALLOCATION TESSERA_VISIBLE_DEVICES=$TESSERA_VISIBLE_DEVICES"
"#;

pub fn require_runtimes() -> bool {
    std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_some()
}

/// Prints a SKIP line and returns false, or panics when runtimes are required.
pub fn skip(why: &str) -> bool {
    if require_runtimes() {
        panic!("TESSERA_REQUIRE_RUNTIMES is set, but: {why}");
    }
    println!("SKIP: {why}");
    eprintln!("SKIP: {why}");
    false
}

pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

pub fn mknod(p: &Path, major: u32, minor: u32) {
    if p.exists() {
        return;
    }
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path during the call.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(major, minor)) };
    assert_eq!(rc, 0, "mknod {}: {}", p.display(), std::io::Error::last_os_error());
}

/// A fake node under a temporary directory.
pub struct Node {
    pub dir: tempfile::TempDir,
    pub driver_root: PathBuf,
    pub dev: PathBuf,
    pub cdi: PathBuf,
    pub run: PathBuf,
    pub shim: PathBuf,
    pub config: PathBuf,
    /// The driver directory the specs mount (`tessera_region::driver_dir`); `None`: a mount per file.
    pub driver_dir: Option<PathBuf>,
}

impl Node {
    pub fn new() -> Node {
        Node::with(true, None)
    }

    /// `cdi_version`: None for the default (0.6.0).
    pub fn with(require_allocation: bool, cdi_version: Option<&str>) -> Node {
        let dir = tempfile::Builder::new().prefix("tessera-hook-test").tempdir().unwrap();
        let root = dir.path();
        let driver_root = root.join("driver");
        let lib = driver_root.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(driver_root.join("usr/bin")).unwrap();
        std::fs::write(lib.join("libcuda.so.550.54.15"), "fake-libcuda").unwrap();
        symlink("libcuda.so.550.54.15", lib.join("libcuda.so.1")).unwrap();
        std::fs::write(lib.join("libnvidia-ml.so.1"), "fake-nvml").unwrap();
        std::fs::write(driver_root.join("usr/bin/nvidia-smi"), "fake-smi").unwrap();
        let dev = root.join("dev");
        mknod(&dev.join("nvidia0"), 195, 0);
        mknod(&dev.join("nvidia1"), 195, 1);
        mknod(&dev.join("nvidiactl"), 195, 255);
        mknod(&dev.join("nvidia-uvm"), 235, 0);
        mknod(&dev.join("nvidia-uvm-tools"), 235, 1);
        mknod(&dev.join("nvidia-caps/nvidia-cap21"), 236, 21);
        let shim = root.join("libtessera.so");
        std::fs::write(&shim, "fake-shim").unwrap();
        let cdi_dir = root.join("cdi");
        let run = root.join("run");
        let config = root.join("hook.toml");
        let node = Node { dir, driver_root, dev, cdi: cdi_dir, run, shim, config, driver_dir: None };
        node.write_config(require_allocation);
        node.write_specs(&node.cdi, cdi_version);
        node.allocation("a1", &[GPU0]);
        node.allocation("a-mig", &[MIG]);
        node
    }

    /// [`Node::new`] with its driver files gathered into a driver directory under `state/driver`,
    /// as tesserad does by default, and the specs written over it.
    pub fn with_driver_dir() -> Node {
        let mut node = Node::new();
        let files = node.node_devices(None).driver;
        let made = tessera_region::driver_dir::prepare(&files, &node.path().join("state/driver")).unwrap();
        node.driver_dir = Some(made.dir);
        node.write_specs(&node.cdi, None);
        node
    }

    pub fn write_config(&self, require_allocation: bool) {
        std::fs::write(
            &self.config,
            format!(
                "cdi_spec_dirs = [{:?}]\nruntime_dir = {:?}\ndriver_root = {:?}\ndev_root = {:?}\nshim_path = {:?}\nrequire_allocation = {require_allocation}\nruntime = {:?}\n",
                self.cdi.display().to_string(),
                self.run.display().to_string(),
                self.driver_root.display().to_string(),
                self.dev.display().to_string(),
                self.shim.display().to_string(),
                which("runc").map(|p| p.display().to_string()).unwrap_or_else(|| "runc".into()),
            ),
        )
        .unwrap();
    }

    pub fn node_devices(&self, cdi_version: Option<&str>) -> NodeDevices {
        let d = |n: &str| self.dev.join(n);
        let device = |class: &str, name: &str, aliases: &[&str], uuid: &str, nodes| NodeDevice {
            class: class.into(),
            name: name.into(),
            aliases: aliases.iter().map(|a| a.to_string()).collect(),
            uuid: uuid.into(),
            nodes,
        };
        let cfg = tessera_region::driver::DriverConfig {
            root: self.driver_root.clone(),
            dev_root: self.dev.clone(),
            ..Default::default()
        };
        NodeDevices {
            devices: vec![
                device("gpu", GPU0, &["0"], GPU0, vec![d("nvidia0")]),
                device("gpu", GPU1, &["1"], GPU1, vec![d("nvidia1")]),
                device("share", &format!("{GPU0}::3"), &[], GPU0, vec![d("nvidia0")]),
                device("mig", MIG, &["1:0"], MIG, vec![d("nvidia1"), d("nvidia-caps/nvidia-cap21")]),
            ],
            control_nodes: tessera_region::driver::control_nodes(&cfg),
            driver: tessera_region::driver::discover(&cfg),
            driver_dir: self.driver_dir.clone(),
            shim: Some(self.shim.clone()),
            hook_binary: PathBuf::from(HOOK),
            hook_config: self.config.clone(),
            dev_root: self.dev.clone(),
            cdi_version: cdi_version.map(String::from),
        }
    }

    pub fn write_specs(&self, dir: &Path, cdi_version: Option<&str>) {
        let specs = cdi::build_specs(&self.node_devices(cdi_version)).unwrap();
        cdi::write_specs(dir, &specs).unwrap();
    }

    pub fn allocation(&self, id: &str, uuids: &[&str]) {
        let dir = self.run.join("alloc").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        let mut limits = String::from("version = 1\n");
        for u in uuids {
            limits.push_str(&format!("[[devices]]\nuuid = \"{u}\"\nmemory_limit = 1073741824\n"));
        }
        std::fs::write(dir.join("limits"), limits).unwrap();
        std::fs::write(dir.join("region"), "").unwrap();
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// A busybox root file system (Debian's busybox-static), or None (SKIP printed) without one.
pub fn busybox_rootfs(root: &Path) -> Option<PathBuf> {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"].iter().map(PathBuf::from).find(|p| p.is_file());
    let Some(busybox) = busybox else {
        skip("busybox is not installed (Debian package busybox-static)");
        return None;
    };
    for d in ["bin", "dev", "proc", "sys", "etc", "tmp", "usr/lib", "run"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy(&busybox, root.join("bin/busybox")).unwrap();
    for applet in ["sh", "ls", "cat", "stat", "echo", "head", "tr", "sleep", "true", "grep", "wc", "test", "["] {
        symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/:/bin/sh\n").unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
    Some(root.to_path_buf())
}

/// A victim directory on the host, with one file, for hostile images to point at.
pub fn victim(base: &Path) -> PathBuf {
    let v = base.join("victim");
    std::fs::create_dir_all(&v).unwrap();
    std::fs::write(v.join("precious"), "host data").unwrap();
    v
}

/// The victim's listing (names and contents), to compare before and after.
pub fn snapshot(v: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![v.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let ft = e.file_type().unwrap();
            let content = if ft.is_symlink() {
                format!("-> {}", std::fs::read_link(&p).unwrap().display())
            } else if ft.is_dir() {
                stack.push(p.clone());
                "<dir>".into()
            } else {
                if ft.is_file() {
                    std::fs::read_to_string(&p).unwrap_or_else(|_| "<unreadable>".into())
                } else {
                    "<special>".into()
                }
            };
            out.push((p.display().to_string(), content));
        }
    }
    out.sort();
    out
}

/// An OCI bundle (`runc spec`, made non-interactive) running `script` in `rootfs`.
pub fn bundle(dir: &Path, rootfs: &Path, script: &str, env: &[&str], hook: Option<&Node>) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let out = Command::new("runc").arg("spec").current_dir(dir).output().expect("runc spec");
    assert!(out.status.success(), "runc spec: {}", String::from_utf8_lossy(&out.stderr));
    let path = dir.join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    c["root"] = json!({"path": rootfs.display().to_string(), "readonly": false});
    c["process"]["terminal"] = json!(false);
    c["process"]["args"] = json!(["/bin/sh", "-c", script]);
    let envs = c["process"]["env"].as_array_mut().unwrap();
    envs.extend(env.iter().map(|e| json!(e)));
    if let Some(node) = hook {
        c["hooks"] = json!({"createRuntime": [{
            "path": HOOK,
            "args": ["tessera-hook", "--config", node.config.display().to_string(), "createRuntime"],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
        }]});
    }
    std::fs::write(&path, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    dir.to_path_buf()
}

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Lines of the probe's output that start with `prefix`.
pub fn lines<'a>(out: &'a str, prefix: &str) -> Vec<&'a str> {
    out.lines().filter(|l| l.starts_with(prefix)).collect()
}

/// What a container given GPU0 under allocation a1 must see.
pub fn assert_gpu0(out: &str) {
    let nodes = lines(out, "node ");
    assert_eq!(
        nodes,
        [
            "node /dev/nvidia-uvm eb:0",
            "node /dev/nvidia-uvm-tools eb:1",
            "node /dev/nvidia0 c3:0",
            "node /dev/nvidiactl c3:ff",
        ],
        "{out}"
    );
    // The device cgroup admits nvidia0 (no driver: ENXIO) and refuses anything else.
    assert!(lines(out, "open0 ")[0].contains("No such device or address"), "{out}");
    assert!(lines(out, "open1 ")[0].contains("No such file"), "{out}");
    let files = lines(out, "file ");
    for want in [
        "file /usr/lib/x86_64-linux-gnu/libcuda.so.1 fake-libcuda",
        "file /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15 fake-libcuda",
        "file /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 fake-nvml",
        "file /usr/bin/nvidia-smi fake-smi",
        "file /usr/lib/tessera/libtessera.so fake-shim",
    ] {
        assert!(files.contains(&want), "missing {want:?} in {out}");
    }
    assert_eq!(lines(out, "preload "), ["preload /usr/lib/tessera/libtessera.so"], "{out}");
    assert_eq!(lines(out, "ldconf "), ["ldconf /usr/lib/x86_64-linux-gnu"], "{out}");
    assert!(lines(out, "limits ")[0].contains(&format!("uuid = \"{GPU0}\"")), "{out}");
    assert_eq!(lines(out, "region-writable "), ["region-writable yes"], "{out}");
    assert_eq!(lines(out, "limits-writable "), ["limits-writable no"], "{out}");
}
