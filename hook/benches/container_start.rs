//! Container start with and without injection on the same runc, as a ratio in one run; and the
//! hook's and the wrapper's own time on a realistic spec (8 GPUs, 56 shares, 56 MIG instances,
//! a 550 driver's 24 libraries and 5 tools).
//!
//! `cargo bench -p tessera-hook --bench container_start` (root, runc and busybox installed; else
//! only the in-process part runs). `TESSERA_BENCH_RUNS` sets the runs per variant (default 30);
//! `TESSERA_BENCH_STRACE=<file>` runs the hook once more under strace (`-c -f`, or
//! `TESSERA_BENCH_STRACE_ARGS`); `TESSERA_BENCH_RUNC_STRACE=<prefix>` runs each `runc run`
//! variant once more under `strace -f -tt -T` (`<prefix>.<k>`, k in the order the table prints:
//! 0 plain … 11 NVIDIA's runtime);
//! `TESSERA_BENCH_NVIDIA_RUNTIME=<nvidia-container-runtime>` adds NVIDIA's runtime wrapper (CDI
//! mode) making the same edit as ours, the baseline for the wrapper;
//! `TESSERA_BENCH_BIN_DIR=<dir>` takes `tessera-hook` and `tessera-runtime` from there (e.g. the
//! static build of `scripts/build-static-hook.sh`).

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use tessera_region::cdi::{self, NodeDevice};
use tessera_region::hook_config::HookConfig;

/// The hook and the wrapper measured: this build's, or those in `TESSERA_BENCH_BIN_DIR`.
fn bins() -> (PathBuf, PathBuf) {
    match std::env::var_os("TESSERA_BENCH_BIN_DIR") {
        Some(d) => {
            // Relative to the workspace's root, as the docs write it (cargo runs a bench in its
            // package's directory).
            let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(d);
            (d.join("tessera-hook"), d.join("tessera-runtime"))
        }
        None => (HOOK.into(), WRAPPER.into()),
    }
}

/// Changes `bundle`'s config.json with `f`.
fn edit_config(bundle: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = bundle.join("config.json");
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    f(&mut c);
    std::fs::write(&path, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
}

/// `bundle`'s config.json with its hook entry running `hook`.
fn with_hook_binary(bundle: &Path, hook: &Path) {
    edit_config(bundle, |c| c["hooks"]["createRuntime"][0]["path"] = serde_json::json!(hook.display().to_string()));
}

/// The floor of any hook: the same createRuntime entry running `program args` (`/bin/true`, or
/// our hook printing its version: its process start without its work).
fn with_noop_hook(bundle: &Path, program: &Path, args: &[&str]) {
    let program = program.display().to_string();
    let mut argv = vec![program.clone()];
    argv.extend(args.iter().map(|a| a.to_string()));
    // The entry's env (PATH alone) is kept, as for our hook.
    edit_config(bundle, |c| {
        c["hooks"]["createRuntime"][0]["path"] = serde_json::json!(program);
        c["hooks"]["createRuntime"][0]["args"] = serde_json::json!(argv);
    });
}

/// A new root for each container start, as a snapshotter gives one: an overlay of the busybox
/// root with an empty upper layer, so the mount targets the hook makes, the wrapper's links and
/// runc's own targets are made anew each time, for every variant alike. The upper layers are on a
/// tmpfs of the bench's own: on this VM's ext4 (mounted `discard`), creating files right after
/// others were deleted costs 40–170 µs each and drifts over a run, which drowned the difference
/// measured. Each root is unmounted and removed once its start is over. Where no overlay can be
/// mounted (not root), the lower root itself, shared.
struct FreshRoots {
    lower: PathBuf,
    tmpfs: Option<PathBuf>,
    n: usize,
    last: Option<PathBuf>,
}

impl FreshRoots {
    fn new(lower: &Path) -> FreshRoots {
        let tmpfs = lower.with_file_name("fresh-roots");
        std::fs::create_dir_all(&tmpfs).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=256m", "tessera-bench"])
            .arg(&tmpfs)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        let mut r = FreshRoots { lower: lower.to_path_buf(), tmpfs: ok.then_some(tmpfs), n: 0, last: None };
        if r.tmpfs.is_some() && r.next() == r.lower {
            r.tmpfs = None;
        }
        r
    }

    fn overlay(&self) -> bool {
        self.tmpfs.is_some()
    }

    /// A new root; the last one is unmounted and removed (its start is over): mounts left in
    /// place would slow every later namespace copy and mount.
    fn next(&mut self) -> PathBuf {
        self.unmount_last();
        let Some(tmpfs) = self.tmpfs.clone() else { return self.lower.clone() };
        self.n += 1;
        let base = tmpfs.join(self.n.to_string());
        let (upper, work, root) = (base.join("upper"), base.join("work"), base.join("root"));
        for d in [&upper, &work, &root] {
            std::fs::create_dir_all(d).unwrap();
        }
        let opts = format!("lowerdir={},upperdir={},workdir={}", self.lower.display(), upper.display(), work.display());
        let ok = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &opts])
            .arg(&root)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return self.lower.clone();
        }
        self.last = Some(root.clone());
        root
    }

    fn unmount_last(&mut self) {
        if let Some(root) = self.last.take() {
            let c = std::ffi::CString::new(root.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: `c` is a NUL-terminated path that outlives the call.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            let _ = std::fs::remove_dir_all(root.parent().unwrap());
        }
    }
}

impl Drop for FreshRoots {
    fn drop(&mut self) {
        self.unmount_last();
        if let Some(t) = &self.tmpfs {
            let c = std::ffi::CString::new(t.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: as above.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// `bundle`'s config.json with its root at `root`.
fn set_root(bundle: &Path, root: &Path) {
    edit_config(bundle, |c| c["root"]["path"] = serde_json::json!(root.display().to_string()));
}

/// A CDI spec (for NVIDIA's runtime) whose device `nvidia.com/gpu=0` makes the edit `edited`
/// has over `pristine`: its added mounts, device nodes and environment.
fn nvidia_cdi_spec(edited: &serde_json::Value, pristine: &serde_json::Value) -> String {
    let added = |pointer: &str| -> Vec<serde_json::Value> {
        let before = pristine.pointer(pointer).and_then(|v| v.as_array()).cloned().unwrap_or_default();
        let after = edited.pointer(pointer).and_then(|v| v.as_array()).cloned().unwrap_or_default();
        after.into_iter().filter(|v| !before.contains(v)).collect()
    };
    let mounts: Vec<_> = added("/mounts")
        .into_iter()
        .map(|m| serde_json::json!({"hostPath": m["source"], "containerPath": m["destination"], "options": m["options"]}))
        .collect();
    let nodes: Vec<_> = added("/linux/devices")
        .into_iter()
        .map(|d| {
            serde_json::json!({"path": d["path"], "type": d["type"], "major": d["major"], "minor": d["minor"],
                "fileMode": d["fileMode"], "uid": d["uid"], "gid": d["gid"]})
        })
        .collect();
    let env = added("/process/env");
    assert!(!mounts.is_empty() && !nodes.is_empty(), "the wrapper's edit adds mounts and device nodes");
    serde_json::json!({
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"env": env, "deviceNodes": nodes, "mounts": mounts}}],
    })
    .to_string()
}

/// The `runc run` variants timed in each round.
const VARIANTS: usize = 12;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

/// A node with 8 GPUs, 7 shares and 7 MIG instances each, and 40 driver files; `driver_dir`: its
/// specs mount a driver directory (tesserad's default) instead of each file.
fn realistic(node: &Node, driver_dir: bool) {
    // What a 550 driver installs: each library with its version and its soname link; the tools.
    let lib = node.driver_root.join("usr/lib/x86_64-linux-gnu");
    for prefix in tessera_region::driver::LIBRARY_PREFIXES {
        let real = lib.join(format!("{prefix}.550.54.15"));
        let link = lib.join(format!("{prefix}.1"));
        if !real.exists() {
            std::fs::write(&real, "x").unwrap();
        }
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(real.file_name().unwrap(), link).unwrap();
        }
    }
    for tool in tessera_region::driver::BINARIES {
        std::fs::write(node.driver_root.join("usr/bin").join(tool), "x").unwrap();
    }
    let mut nd = node.node_devices(None);
    nd.devices.clear();
    for g in 0..8u32 {
        let dev = node.dev.join(format!("nvidia{g}"));
        mknod(&dev, 195, g);
        let uuid = format!("GPU-{g:08x}-2222-3333-4444-555555555555");
        nd.devices.push(NodeDevice {
            class: "gpu".into(),
            name: uuid.clone(),
            aliases: vec![g.to_string()],
            uuid: uuid.clone(),
            nodes: vec![dev.clone()],
        });
        for s in 0..7u32 {
            nd.devices.push(NodeDevice {
                class: "share".into(),
                name: format!("{uuid}::{s}"),
                aliases: vec![],
                uuid: uuid.clone(),
                nodes: vec![dev.clone()],
            });
            let cap = node.dev.join(format!("nvidia-caps/nvidia-cap{}", 100 + g * 7 + s));
            mknod(&cap, 236, 100 + g * 7 + s);
            let mig = format!("MIG-{g:04x}{s:04x}-bbbb-cccc-dddd-eeeeeeeeeeee");
            nd.devices.push(NodeDevice {
                class: "mig".into(),
                name: mig.clone(),
                aliases: vec![format!("{g}:{s}")],
                uuid: mig,
                nodes: vec![dev.clone(), cap],
            });
        }
    }
    nd.control_nodes = tessera_region::driver::control_nodes(&tessera_region::driver::DriverConfig {
        root: node.driver_root.clone(),
        dev_root: node.dev.clone(),
        ..Default::default()
    });
    nd.driver = tessera_region::driver::discover(&tessera_region::driver::DriverConfig {
        root: node.driver_root.clone(),
        dev_root: node.dev.clone(),
        ..Default::default()
    });
    if driver_dir {
        let made = tessera_region::driver_dir::prepare(&nd.driver, &node.path().join("state/driver")).unwrap();
        nd.driver_dir = Some(made.dir);
    }
    let specs = cdi::build_specs(&nd).unwrap();
    cdi::write_specs(&node.cdi, &specs).unwrap();
    node.allocation("a1", &["GPU-00000000-2222-3333-4444-555555555555"]);
}

/// CPU time (user + system) of all reaped children so far.
fn children_cpu() -> Duration {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is writable for the duration of the call.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// [`time_proc`] with `setup` run before each run of `f`, untimed (its children's CPU too).
fn time_proc_after<S: FnMut(), F: FnMut()>(runs: usize, mut setup: S, mut f: F) -> (Duration, Duration) {
    setup();
    f();
    let (mut walls, mut cpu) = (Vec::new(), Duration::ZERO);
    for _ in 0..runs {
        setup();
        let (t, cpu0) = (Instant::now(), children_cpu());
        f();
        walls.push(t.elapsed());
        cpu += children_cpu() - cpu0;
    }
    (median(walls), cpu / runs as u32)
}

/// Median wall time and mean child CPU time of `f`, which runs one child process.
fn time_proc<F: FnMut()>(runs: usize, mut f: F) -> (Duration, Duration) {
    f();
    let cpu0 = children_cpu();
    let wall = time(runs - 1, &mut f);
    ((wall), (children_cpu() - cpu0) / runs as u32)
}

fn time<F: FnMut()>(runs: usize, mut f: F) -> Duration {
    f(); // warm-up
    median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .collect(),
    )
}

fn main() {
    // `cargo bench` passes --bench; nothing else is taken.
    let runs: usize = std::env::var("TESSERA_BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(30);
    let node = Node::new();
    realistic(&node, false);
    // The same node with a driver directory, and its own root file system (links made in a
    // shared one would turn the other variant's mounts into links, and back).
    let node_dir = Node::new();
    realistic(&node_dir, true);
    let rootfs_dir = node_dir.path().join("rootfs");
    if busybox_rootfs(&rootfs_dir).is_none() {
        std::fs::create_dir_all(&rootfs_dir).unwrap();
    }
    let cfg = HookConfig::load(&node.config).unwrap();

    // The wrapper's work in-process: read config.json, load the specs, plan, write config.json.
    let rootfs = node.path().join("rootfs");
    if busybox_rootfs(&rootfs).is_none() {
        std::fs::create_dir_all(&rootfs).unwrap();
    }
    let ask = ["TESSERA_VISIBLE_DEVICES=0", "TESSERA_ALLOCATION=a1"];
    let have_runc = which("runc").is_some();
    // A bundle over `root`, with `hook`'s entry when given (no runc: a config.json of our own).
    let fresh_bundle = |dir: &Path, root: &Path, hook: Option<&Node>| -> PathBuf {
        if have_runc {
            bundle(dir, root, "true", &ask, hook)
        } else {
            std::fs::create_dir_all(dir).unwrap();
            let c = serde_json::json!({"root": {"path": root}, "process": {"env": ask}});
            std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
            dir.to_path_buf()
        }
    };
    let b = fresh_bundle(&node.path().join("edit"), &rootfs, None);
    // Restored in place, as the wrapper writes (a rewrite through truncation costs an ext4 flush).
    let pristine: serde_json::Value = serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    // Each run starts a new container: the bundle as the runtime made it, and no owner record yet
    // in the allocation directory (replacing one on ext4 would cost a flush a real start never
    // pays: the record is new, and /run is tmpfs).
    let restore = |n: &Node, b: &Path, v: &serde_json::Value| {
        tessera_hook::oci::write_config(b, v).unwrap();
        let _ = std::fs::remove_file(n.run.join("alloc/a1").join(tessera_region::owner::OWNER_FILE));
    };
    let edit = time(runs * 10, || {
        restore(&node, &b, &pristine);
        assert!(tessera_hook::wrapper::edit_bundle(&cfg, &b, None).unwrap());
    });
    let cfg_dir = HookConfig::load(&node_dir.config).unwrap();
    let b_dir = fresh_bundle(&node_dir.path().join("edit"), &rootfs_dir, None);
    let pristine_dir: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b_dir.join("config.json")).unwrap()).unwrap();
    let edit_dir = time(runs * 10, || {
        restore(&node_dir, &b_dir, &pristine_dir);
        assert!(tessera_hook::wrapper::edit_bundle(&cfg_dir, &b_dir, None).unwrap());
    });
    let specs = cdi::load_spec_dirs(&cfg.cdi_spec_dirs).unwrap();
    let devices: usize = specs.iter().map(|s| s.devices.len()).sum();
    let cfg_json = tessera_hook::oci::read_config(&b).unwrap();
    let plan_only = time(runs * 10, || {
        let specs = cdi::load_spec_dirs(&cfg.cdi_spec_dirs).unwrap();
        let info = tessera_hook::oci::container_info(&cfg_json, &Default::default()).unwrap();
        tessera_hook::plan::plan(&cfg, &specs, &info).unwrap().unwrap();
    });
    let guided = time(runs * 10, || {
        let info = tessera_hook::oci::container_info(&cfg_json, &Default::default()).unwrap();
        tessera_hook::plan::plan_from_spec_dirs(&cfg, &info).unwrap().unwrap();
    });
    let plan = {
        let info = tessera_hook::oci::container_info(&cfg_json, &Default::default()).unwrap();
        tessera_hook::plan::plan(&cfg, &specs, &info).unwrap().unwrap()
    };
    let read = time(runs * 10, || {
        tessera_hook::oci::read_config(&b).unwrap();
    });
    let check = time(runs * 10, || tessera_hook::wrapper::check_targets(&rootfs, &plan).unwrap());
    let apply = time(runs * 10, || {
        let mut c = cfg_json.clone();
        tessera_hook::oci::apply_to_config(&mut c, &plan).unwrap();
    });
    let write = time(runs * 10, || tessera_hook::oci::write_config(&b, &cfg_json).unwrap());
    println!(
        "in-process: read config.json {}, check rootfs targets {}, edit {}, write config.json {}",
        us(read),
        us(check),
        us(apply),
        us(write)
    );
    println!("spec: {} CDI devices (names and aliases) in {} specs", devices, specs.len());
    println!("in-process: load every spec + plan           {}", us(plan_only));
    println!("in-process: load the specs asked for + plan   {} (what the hook and wrapper do)", us(guided));
    println!("in-process: wrapper edit of config.json       {}", us(edit));
    println!("in-process: the same, driver directory        {} (links made in the root file system)", us(edit_dir));
    let plan_dir = {
        let specs = cdi::load_spec_dirs(&cfg_dir.cdi_spec_dirs).unwrap();
        let c = tessera_hook::oci::read_config(&b_dir).unwrap();
        let info = tessera_hook::oci::container_info(&c, &Default::default()).unwrap();
        tessera_hook::plan::plan(&cfg_dir, &specs, &info).unwrap().unwrap()
    };
    let check_dir = time(runs * 10, || tessera_hook::wrapper::check_targets(&rootfs_dir, &plan_dir).unwrap());
    let links_dir = time(runs * 10, || {
        let mut p = plan_dir.clone();
        tessera_hook::wrapper::make_links(&rootfs_dir, &mut p).unwrap();
    });
    println!(
        "in-process, driver directory: check rootfs targets {}, make {} links (already there) {}",
        us(check_dir),
        plan_dir.links.len(),
        us(links_dir)
    );

    // From here on each start gets a new root, as from a snapshotter.
    let mut roots = FreshRoots::new(&rootfs);
    println!("roots: {}", if roots.overlay() { "a new overlay each start" } else { "shared (no overlay mount here)" });
    // The wrapper as a process, its real runtime /bin/true: minus /bin/true alone.
    let (true_proc, true_cpu) = time_proc(runs, || {
        restore(&node, &b, &pristine);
        assert!(Command::new("/bin/true").status().unwrap().success());
    });
    // Process start alone: the hook exiting at once (`--version`), against `/bin/true`, many times
    // (a static build's gain is the loader's work, under a millisecond). An empty environment, as a
    // runtime gives a hook (the hook refuses to run with cargo's `LD_LIBRARY_PATH`).
    let bare = |program: &Path, args: &[&str]| {
        let st = Command::new(program).args(args).env_clear().stdout(std::process::Stdio::null()).status();
        assert!(st.unwrap().success(), "{}", program.display());
    };
    let (start_proc, start_cpu) = time_proc(runs * 10, || bare(&bins().0, &["--version"]));
    let (true_start, true_start_cpu) = time_proc(runs * 10, || bare(Path::new("/bin/true"), &[]));
    println!(
        "process start: tessera-hook --version {} wall, {} CPU; /bin/true {} wall, {} CPU",
        ms(start_proc),
        ms(start_cpu),
        ms(true_start),
        ms(true_start_cpu)
    );
    for (label, n, b, pristine) in
        [("a mount per file", &node, &b, &pristine), ("driver directory", &node_dir, &b_dir, &pristine_dir)]
    {
        let wcfg = n.path().join("hook-true.toml");
        let text = std::fs::read_to_string(&n.config).unwrap();
        let text: String =
            text.lines().filter(|l| !l.starts_with("runtime =")).map(|l| format!("{l}\n")).collect::<String>()
                + "runtime = \"/bin/true\"\n";
        std::fs::write(&wcfg, text).unwrap();
        let (wrapper_proc, wrapper_cpu) = time_proc_after(
            runs,
            || {
                let mut fresh = pristine.clone();
                fresh["root"]["path"] = serde_json::json!(roots.next());
                restore(n, b, &fresh);
            },
            || {
                let st = Command::new(bins().1)
                    .env("TESSERA_HOOK_CONFIG", &wcfg)
                    .args(["create", "--bundle"])
                    .arg(b)
                    .arg("x")
                    .status()
                    .unwrap();
                assert!(st.success());
            },
        );
        println!(
            "process: tessera-runtime create (exec /bin/true), {label}: {} vs /bin/true {}: wrapper adds {} wall, {} CPU",
            ms(wrapper_proc),
            ms(true_proc),
            ms(wrapper_proc.saturating_sub(true_proc)),
            ms(wrapper_cpu.saturating_sub(true_cpu))
        );
    }

    if !is_root() || !have_runc {
        println!("SKIP: container start comparison needs root and runc");
        return;
    }
    hook_process(&node, &rootfs, runs, true_proc, true_cpu, &mut roots);
    hook_process(&node_dir, &rootfs_dir, runs, true_proc, true_cpu, &mut roots);
    let plain = fresh_bundle(&node.path().join("plain"), &rootfs, None);
    let with_hook = fresh_bundle(&node.path().join("hook"), &rootfs, Some(&node));
    let wrapped = fresh_bundle(&node.path().join("wrapped"), &rootfs, None);
    let wrapped_pristine: serde_json::Value =
        serde_json::from_slice(&std::fs::read(wrapped.join("config.json")).unwrap()).unwrap();
    let with_hook_dir = fresh_bundle(&node_dir.path().join("hook"), &rootfs_dir, Some(&node_dir));
    let (hook, wrapper) = bins();
    println!("binaries: {} and {}", hook.display(), wrapper.display());
    with_hook_binary(&with_hook, &hook);
    with_hook_binary(&with_hook_dir, &hook);
    let noop_hook = fresh_bundle(&node.path().join("noop-hook"), &rootfs, Some(&node));
    with_noop_hook(&noop_hook, Path::new("/bin/true"), &[]);
    let version_hook = fresh_bundle(&node.path().join("version-hook"), &rootfs, Some(&node));
    with_noop_hook(&version_hook, &hook, &["--version"]);
    // A poststop entry that does nothing, as the wrapper adds one for a lease: `runc run` runs it
    // at the container's deletion, off a start's path but inside this measure.
    let noop_poststop = fresh_bundle(&node.path().join("noop-poststop"), &rootfs, None);
    edit_config(&noop_poststop, |c| {
        c["hooks"] = serde_json::json!({"poststop": [{
            "path": "/bin/true",
            "args": ["true"],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
        }]});
    });
    let wrapper = wrapper.display().to_string();
    let wrapped_dir = fresh_bundle(&node_dir.path().join("wrapped"), &rootfs_dir, None);
    let wrapped_dir_pristine: serde_json::Value =
        serde_json::from_slice(&std::fs::read(wrapped_dir.join("config.json")).unwrap()).unwrap();
    // The wrapper's path taken apart: its edit (driver directory) made once by the wrapper itself
    // (its real runtime /bin/true), then that config.json run by runc directly, with and without
    // the poststop entry the wrapper adds for a leased allocation. Each start's new root lacks the
    // wrapper's links (made by the wrapper, not runc); runc makes the mount targets itself.
    let pre_edited = fresh_bundle(&node_dir.path().join("pre-edited"), &rootfs_dir, None);
    let lease_marker = node_dir.run.join("alloc/a1").join(tessera_region::owner::LEASE_FILE);
    std::fs::write(&lease_marker, "container\n").unwrap();
    let st = Command::new(bins().1)
        .env("TESSERA_HOOK_CONFIG", node_dir.path().join("hook-true.toml"))
        .args(["create", "--bundle"])
        .arg(&pre_edited)
        .arg("pre-edited")
        .status()
        .unwrap();
    assert!(st.success(), "the wrapper's edit for the pre-edited bundle");
    std::fs::remove_file(&lease_marker).unwrap();
    let pre_edited_config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(pre_edited.join("config.json")).unwrap()).unwrap();
    assert!(pre_edited_config["hooks"]["poststop"].is_array(), "the wrapper adds its poststop entry for a lease");
    let no_poststop = fresh_bundle(&node_dir.path().join("pre-edited-no-poststop"), &rootfs_dir, None);
    tessera_hook::oci::write_config(&no_poststop, &pre_edited_config).unwrap();
    edit_config(&no_poststop, |c| {
        c["hooks"].as_object_mut().unwrap().remove("poststop");
    });
    // TESSERA_BENCH_NVIDIA_RUNTIME=<nvidia-container-runtime>: NVIDIA's runtime wrapper in CDI
    // mode, its real runtime runc, given one CDI device carrying what our wrapper's edit adds
    // (the same mounts, device nodes and environment; not the links, which NVIDIA makes with a
    // hook of its own). The same work through another wrapper: the baseline for ours.
    let nvidia = std::env::var_os("TESSERA_BENCH_NVIDIA_RUNTIME").map(PathBuf::from);
    let xdg = node_dir.path().join("xdg");
    let nvidia_bundle = fresh_bundle(&node_dir.path().join("nvidia"), &rootfs_dir, None);
    edit_config(&nvidia_bundle, |c| c["annotations"] = serde_json::json!({"cdi.k8s.io/bench": "nvidia.com/gpu=0"}));
    let nvidia_pristine: serde_json::Value =
        serde_json::from_slice(&std::fs::read(nvidia_bundle.join("config.json")).unwrap()).unwrap();
    if let Some(bin) = &nvidia {
        let spec_dir = node_dir.path().join("nvidia-cdi");
        std::fs::create_dir_all(&spec_dir).unwrap();
        std::fs::write(spec_dir.join("bench.json"), nvidia_cdi_spec(&pre_edited_config, &wrapped_dir_pristine))
            .unwrap();
        std::fs::create_dir_all(xdg.join("nvidia-container-runtime")).unwrap();
        std::fs::write(
            xdg.join("nvidia-container-runtime/config.toml"),
            format!(
                "[nvidia-container-runtime]\nmode = \"cdi\"\nruntimes = [\"runc\"]\nlog-level = \"info\"\n\
                 [nvidia-container-runtime.modes.cdi]\nspec-dirs = [\"{}\"]\ndefault-kind = \"nvidia.com/gpu\"\n\
                 annotation-prefixes = [\"cdi.k8s.io/\"]\n",
                spec_dir.display()
            ),
        )
        .unwrap();
        println!("NVIDIA's runtime: {}", bin.display());
    }
    // A container that asks for no GPU, through the wrapper (a node whose every container runs
    // through it): the wrapper's floor, its process and the runtime's exec.
    let asks_nothing = if have_runc {
        bundle(&node_dir.path().join("asks-nothing"), &rootfs_dir, "true", &[], None)
    } else {
        fresh_bundle(&node_dir.path().join("asks-nothing"), &rootfs_dir, None)
    };
    let nvidia_runner = nvidia.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
    let state = node.path().join("runc-state");
    let mut n = 0;
    // TESSERA_BENCH_RUNC_STRACE=<prefix>: the last round's starts under `strace -f -tt -T`, one
    // file per variant (`<prefix>.<variant>`; not timed): where runc's own time goes.
    let runc_strace = std::env::var_os("TESSERA_BENCH_RUNC_STRACE");
    let mut start = |runner: &str, b: &Path, config: &Path, variant: Option<usize>| {
        n += 1;
        let mut cmd = match (&runc_strace, variant) {
            (Some(prefix), Some(k)) => {
                let mut c = Command::new("strace");
                c.args(["-f", "-tt", "-T", "-o"]).arg(format!("{}.{k}", prefix.to_string_lossy())).arg(runner);
                c
            }
            _ => Command::new(runner),
        };
        let out = cmd
            .env("TESSERA_HOOK_CONFIG", config)
            .env("XDG_CONFIG_HOME", &xdg)
            .arg("--root")
            .arg(&state)
            .args(["run", "--bundle"])
            .arg(b)
            .arg(format!("bench-{n}"))
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text_of(&out));
    };
    // Interleaved, so drift hits all variants alike.
    let mut times: [Vec<Duration>; VARIANTS] = Default::default();
    let mut cpus: [Vec<Duration>; VARIANTS] = Default::default();
    for i in 0..=runs {
        let mut timed = |k: usize, runner: &str, b: &Path, config: &Path| {
            set_root(b, &roots.next());
            // A new container's allocation has no owner record or deleted file yet: replacing one
            // on this ext4 (a real host's /run is tmpfs) costs a flush a real start never pays.
            for n in [&node, &node_dir] {
                for f in [tessera_region::owner::OWNER_FILE, tessera_region::owner::DELETED_FILE] {
                    let _ = std::fs::remove_file(n.run.join("alloc/a1").join(f));
                }
            }
            let (t, cpu0) = (Instant::now(), children_cpu());
            start(runner, b, config, None);
            if i > 0 {
                times[k].push(t.elapsed());
                // runc run reaps the whole tree (it is the subreaper): runc, its init, the hooks,
                // the container's process.
                cpus[k].push(children_cpu() - cpu0);
            }
        };
        // Each round starts at another variant, so that each follows every other equally often:
        // a start leaves deferred work behind (its mounts' teardown, its root's removal), which
        // lands on whichever start comes next.
        for j in 0..VARIANTS {
            match (i + j) % VARIANTS {
                0 => timed(0, "runc", &plain, &node.config),
                1 => timed(1, "runc", &with_hook, &node.config),
                2 => timed(2, "runc", &with_hook_dir, &node_dir.config),
                3 => {
                    tessera_hook::oci::write_config(&wrapped, &wrapped_pristine).unwrap();
                    timed(3, &wrapper, &wrapped, &node.config);
                }
                4 => {
                    tessera_hook::oci::write_config(&wrapped_dir, &wrapped_dir_pristine).unwrap();
                    timed(4, &wrapper, &wrapped_dir, &node_dir.config);
                }
                5 => timed(5, "runc", &noop_hook, &node.config),
                6 => timed(6, "runc", &version_hook, &node.config),
                7 => timed(7, "runc", &noop_poststop, &node.config),
                8 => timed(8, "runc", &pre_edited, &node_dir.config),
                9 => timed(9, "runc", &no_poststop, &node_dir.config),
                10 => timed(10, &wrapper, &asks_nothing, &node_dir.config),
                _ if nvidia.is_some() => {
                    tessera_hook::oci::write_config(&nvidia_bundle, &nvidia_pristine).unwrap();
                    timed(11, &nvidia_runner, &nvidia_bundle, &node_dir.config);
                }
                _ => {}
            }
        }
    }
    if runc_strace.is_some() {
        let variants: [(&str, &Path, &Path); VARIANTS] = [
            ("runc", &plain, &node.config),
            ("runc", &with_hook, &node.config),
            ("runc", &with_hook_dir, &node_dir.config),
            (&wrapper, &wrapped, &node.config),
            (&wrapper, &wrapped_dir, &node_dir.config),
            ("runc", &noop_hook, &node.config),
            ("runc", &version_hook, &node.config),
            ("runc", &noop_poststop, &node.config),
            ("runc", &pre_edited, &node_dir.config),
            ("runc", &no_poststop, &node_dir.config),
            (&wrapper, &asks_nothing, &node_dir.config),
            (&nvidia_runner, &nvidia_bundle, &node_dir.config),
        ];
        tessera_hook::oci::write_config(&wrapped, &wrapped_pristine).unwrap();
        tessera_hook::oci::write_config(&wrapped_dir, &wrapped_dir_pristine).unwrap();
        tessera_hook::oci::write_config(&nvidia_bundle, &nvidia_pristine).unwrap();
        for (k, (runner, b, config)) in
            variants.into_iter().enumerate().filter(|(k, _)| *k < VARIANTS - 1 || nvidia.is_some())
        {
            set_root(b, &roots.next());
            start(runner, b, config, Some(k));
        }
    }
    // The median of each round's difference to that round's plain start: drift between rounds
    // (this VM's speed moves by tens of percent within a minute) cancels out.
    let paired_of = |all: &[Vec<Duration>; VARIANTS]| -> Vec<f64> {
        all[1..]
            .iter()
            .filter(|t| !t.is_empty())
            .map(|t| {
                let mut d: Vec<f64> = t.iter().zip(&all[0]).map(|(a, b)| a.as_secs_f64() - b.as_secs_f64()).collect();
                d.sort_by(f64::total_cmp);
                d[d.len() / 2] * 1e3
            })
            .collect()
    };
    let (paired, paired_cpu) = (paired_of(&times), paired_of(&cpus));
    let plain_cpu = median(cpus[0].clone());
    let [p, rest @ ..] = times.map(|t| if t.is_empty() { Duration::ZERO } else { median(t) });
    println!("runc run (busybox true), median of {runs}, interleaved, each round in another order:");
    println!("  plain                                        {} (CPU {})", ms(p), ms(plain_cpu));
    let labels = [
        "with tessera-hook, a mount per file",
        "with tessera-hook, driver directory",
        "via tessera-runtime, a mount per file",
        "via tessera-runtime, driver directory",
        "with a hook that does nothing (/bin/true)",
        "with tessera-hook --version as the hook",
        "with a poststop entry that does nothing",
        "runc on the wrapper's edit, leased (poststop)",
        "  the same without its poststop entry",
        "via tessera-runtime, a container asking nothing",
        "via NVIDIA's runtime (CDI mode), the same edit",
    ];
    for (((label, t), d), c) in labels.iter().zip(rest).filter(|(_, t)| !t.is_zero()).zip(paired).zip(paired_cpu) {
        println!(
            "  {label:<44} {}  ratio {:.3}  (+{}; paired: {d:+.2} ms, CPU {c:+.2} ms)",
            ms(t),
            t.as_secs_f64() / p.as_secs_f64(),
            ms(t.saturating_sub(p))
        );
    }
}

/// The hook as a process, doing its whole work: a target process in a private mount namespace
/// (unshare) and its own device cgroup stand in for a container being created.
/// Each run gets a new root from `roots` (untimed).
fn hook_process(
    node: &Node,
    rootfs: &Path,
    runs: usize,
    true_proc: Duration,
    true_cpu: Duration,
    roots: &mut FreshRoots,
) {
    let cg = PathBuf::from(format!("/sys/fs/cgroup/devices/tessera-bench-{}", std::process::id()));
    if std::fs::create_dir(&cg).is_err() {
        println!("SKIP: hook process timing needs a cgroup v1 devices hierarchy");
        return;
    }
    let b = bundle(
        &node.path().join("hook-alone"),
        rootfs,
        "true",
        &["TESSERA_VISIBLE_DEVICES=0", "TESSERA_ALLOCATION=a1"],
        None,
    );
    let our_ns = std::fs::read_link("/proc/self/ns/mnt").unwrap();
    let mut times = Vec::new();
    let mut cpu = Duration::ZERO;
    for i in 0..=runs {
        // Before the namespace is made, so the new root is mounted in it too.
        set_root(&b, &roots.next());
        let mut child =
            Command::new("unshare").args(["-m", "--propagation", "private", "sleep", "30"]).spawn().unwrap();
        let pid = child.id();
        std::fs::write(cg.join("cgroup.procs"), pid.to_string()).unwrap();
        while std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok().is_none_or(|ns| ns == our_ns) {
            std::thread::sleep(Duration::from_micros(200));
        }
        let state =
            serde_json::json!({"ociVersion": "1.0.2", "id": "bench", "status": "creating", "pid": pid, "bundle": b});
        let t = Instant::now();
        let cpu0 = children_cpu();
        // TESSERA_BENCH_STRACE=<file>: the last run under `strace -c -f -o <file>` (not timed).
        let strace = std::env::var_os("TESSERA_BENCH_STRACE").filter(|_| i == runs);
        let mut cmd = match &strace {
            Some(out) => {
                let mut c = Command::new("strace");
                // TESSERA_BENCH_STRACE_ARGS: other strace options (e.g. `-f -r -T`) than `-c -f`.
                let opts = std::env::var("TESSERA_BENCH_STRACE_ARGS").unwrap_or_else(|_| "-c -f".into());
                c.args(opts.split_whitespace()).arg("-o").arg(out).arg(bins().0);
                c
            }
            None => Command::new(bins().0),
        };
        let mut hook = cmd
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .arg("--config")
            .arg(&node.config)
            .arg("createRuntime")
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        hook.stdin.take().unwrap().write_all(state.to_string().as_bytes()).unwrap();
        let st = hook.wait().unwrap();
        let d = t.elapsed();
        if i > 0 {
            cpu += children_cpu() - cpu0;
        }
        assert!(st.success());
        let _ = child.kill();
        let _ = child.wait();
        if i > 0 {
            times.push(d);
        }
    }
    let _ = std::fs::remove_dir(&cg);
    let h = median(times);
    let plan = {
        let cfg = HookConfig::load(&node.config).unwrap();
        let specs = cdi::load_spec_dirs(&cfg.cdi_spec_dirs).unwrap();
        let c = tessera_hook::oci::read_config(&b).unwrap();
        let info = tessera_hook::oci::container_info(&c, &Default::default()).unwrap();
        tessera_hook::plan::plan(&cfg, &specs, &info).unwrap().unwrap()
    };
    println!(
        "process: tessera-hook, full injection ({} mounts, {} links, {} nodes) {} vs /bin/true {}: hook adds {} wall, {} CPU",
        plan.mounts.len(),
        plan.links.len(),
        plan.device_nodes.len(),
        ms(h),
        ms(true_proc),
        ms(h.saturating_sub(true_proc)),
        ms((cpu / runs as u32).saturating_sub(true_cpu))
    );
}

fn text_of(o: &std::process::Output) -> String {
    text(o)
}
