//! Test support: a container (its limits file and accounting region), the shim preloaded into
//! the workload or into this test binary run again as a child, and a small raw binding of the
//! driver API for the child to call through whatever the dynamic linker hands it.

#![allow(dead_code)] // each test binary uses a part

pub mod cuda;
pub mod elf;

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;
use tessera_region::{DeviceLimits, Limits, Region};
use tessera_sim_testkit::{SimNode, binary, profile_dir};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Context overhead of the test node, in MiB (what each CUDA context costs).
pub const OVERHEAD_MIB: u64 = 300;

/// The node most tests use: two H100s, each context costing 300 MiB.
pub fn node() -> SimNode {
    SimNode::with_description(&format!(
        "context_overhead_mib = {OVERHEAD_MIB}\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 2\n"
    ))
}

/// Reads `read` until it gives `want` (for at most 10 s) and returns the last reading, for the
/// caller to assert on. For what the daemon sees of a process's first context: the shim trues
/// that context's charge up on a helper thread soon after the context is made (until then the
/// reservation made before it is charged), not before the call that made it returns.
pub fn settled(want: u64, read: impl Fn() -> u64) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let got = read();
        if got == want || std::time::Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// The built shim (`target/debug/libtessera.so`).
pub fn shim() -> PathBuf {
    let p = profile_dir().join("libtessera.so");
    assert!(p.exists(), "{} is missing: build it first (cargo build -p tessera-shim)", p.display());
    p
}

/// Limits with one memory limit for every device.
pub fn memory_limits(bytes: u64) -> Limits {
    Limits {
        devices: vec![DeviceLimits { uuid: "*".into(), memory_limit: Some(bytes), sm_percent: None }],
        ..Limits::default()
    }
}

/// One container: a directory with its limits file and its region, as the daemon lays them out.
pub struct Container {
    _dir: tempfile::TempDir,
    pub limits: PathBuf,
    pub region: PathBuf,
}

impl Container {
    pub fn new(limits: &Limits) -> Container {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = Container { limits: dir.path().join("limits"), region: dir.path().join("region"), _dir: dir };
        limits.write_atomic(&c.limits).expect("write limits");
        c
    }

    /// A container whose limits file holds `text` as it is (for malformed configs).
    pub fn with_limits_text(text: &str) -> Container {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = Container { limits: dir.path().join("limits"), region: dir.path().join("region"), _dir: dir };
        std::fs::write(&c.limits, text).expect("write limits");
        c
    }

    /// What every process of the container has in its environment.
    pub fn env(&self) -> Vec<(String, OsString)> {
        vec![
            ("LD_PRELOAD".into(), shim().into_os_string()),
            ("TESSERA_LIMITS".into(), self.limits.clone().into_os_string()),
            ("TESSERA_REGION".into(), self.region.clone().into_os_string()),
        ]
    }

    /// A command run inside the container on the node.
    pub fn command(&self, node: &SimNode, program: impl AsRef<Path>) -> Command {
        let mut c = node.command(program);
        c.envs(self.env());
        c
    }

    /// The container's region, as the daemon sees it.
    pub fn region(&self) -> Region {
        Region::open_or_create(&self.region).expect("open region")
    }

    /// Changes the limits live, as the daemon does: rewrite the file, then bump the generation.
    pub fn set_limits(&self, limits: &Limits) {
        limits.write_atomic(&self.limits).expect("rewrite limits");
        self.region().bump_config_generation();
    }
}

/// Runs tessera-workload in the container: (exit code, its JSON report, stderr).
pub fn workload(c: &Container, node: &SimNode, args: &[&str]) -> (i32, Value, String) {
    let out = c.command(node, binary("tessera-workload")).args(args).output().expect("run the workload");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let last = stdout.lines().last().unwrap_or_else(|| panic!("no report; stderr: {stderr}"));
    let v: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {stdout}\nstderr: {stderr}"));
    (out.status.code().unwrap_or(-1), v, stderr)
}

/// Starts a workload that allocates and holds; returns it and its "holding" line once it holds.
pub fn holding(mut cmd: Command, args: &[&str]) -> (Child, Value) {
    let mut c = cmd.args(args).stdout(Stdio::piped()).spawn().expect("spawn the workload");
    let mut lines = BufReader::new(c.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("a line").expect("read");
    let v: Value = serde_json::from_str(&first).unwrap_or_else(|e| panic!("{e}: {first}"));
    assert!(v.get("holding").is_some(), "{first}");
    // Keep reading in the background so the workload never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (c, v)
}

const CHILD_MARK: &str = "TESSERA_SHIM_TEST_CHILD";

/// Whether this process is a child started by [`run_in_child`].
pub fn in_child() -> bool {
    std::env::var_os(CHILD_MARK).is_some()
}

/// The start of a test whose body runs in children it starts itself: in such a child, runs
/// `child` and gives `None`; in the parent, gives the fresh node to start them on.
pub fn parent_node(child: impl FnOnce()) -> Option<SimNode> {
    if in_child() {
        child();
        return None;
    }
    Some(node())
}

/// Starts this test binary again with `env`, running only `test_name` (in the child, `body`
/// of the [`run_in_child`] call there runs). Returns the running child.
pub fn spawn_child(test_name: &str, env: Vec<(String, OsString)>) -> Child {
    Command::new(std::env::current_exe().expect("current_exe"))
        .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .envs(env)
        .env(CHILD_MARK, test_name)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the test binary")
}

/// Waits for a child from [`spawn_child`] and fails if it failed; returns its stderr.
pub fn wait_child(test_name: &str, child: Child) -> String {
    let out = child.wait_with_output().expect("wait for the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "child {test_name} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "child {test_name} did not run (wrong name?):\n{stdout}\n{stderr}");
    stderr
}

/// Runs `body` in this test binary started again with `env` (the shim preloaded, the node and
/// the container's variables): only `test_name` runs there. In the parent this waits for the
/// child and fails if it failed; returns the child's stderr.
pub fn run_in_child(test_name: &str, env: Vec<(String, OsString)>, body: impl FnOnce()) -> String {
    if std::env::var_os(CHILD_MARK).is_some_and(|v| v == test_name) {
        body();
        return String::new();
    }
    wait_child(test_name, spawn_child(test_name, env))
}

/// The environment of a process in `c` on `node`.
pub fn container_env(c: &Container, node: &SimNode) -> Vec<(String, OsString)> {
    let mut env = node.env();
    env.extend(c.env());
    env
}

/// In a child: the container's region, opened as the daemon would, and device 0's index in it.
pub fn region_and_dev(s: &cuda::Session) -> (Region, usize) {
    let path = PathBuf::from(std::env::var_os("TESSERA_REGION").expect("TESSERA_REGION"));
    let r = Region::open_or_create(&path).expect("open region");
    let dev = r.device(&s.uuid(0)).expect("device entry");
    (r, dev)
}

/// In a child: what GPU `gpu` really holds, by the simulated node's own accounting.
pub fn gpu_used(gpu: u32) -> u64 {
    let state = PathBuf::from(std::env::var_os("TESSERA_SIM_STATE").expect("TESSERA_SIM_STATE"));
    tessera_sim_model::Node::open_state(&state, None).expect("open the node").memory_info(gpu, 0).unwrap().used
}

/// Waits (up to a minute) for a child to make `path`.
pub fn wait_for(path: &Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !path.exists() {
        assert!(std::time::Instant::now() < deadline, "{} never appeared", path.display());
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// In a child: the directory its parent shares with it (`TEST_DIR`).
pub fn test_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("TEST_DIR").expect("TEST_DIR"))
}

/// In a child: tells the parent it is ready (`TEST_DIR/ready`), then waits to be killed.
pub fn ready_then_wait() {
    std::fs::write(test_dir().join("ready"), "").unwrap();
    std::thread::sleep(std::time::Duration::from_secs(600));
}

/// Starts `test_name` as a child with `env` and a directory shared through `TEST_DIR`, and
/// waits until the child says it is ready.
pub fn spawn_ready(test_name: &str, mut env: Vec<(String, OsString)>) -> (Child, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    env.push(("TEST_DIR".into(), dir.path().into()));
    let child = spawn_child(test_name, env);
    wait_for(&dir.path().join("ready"));
    (child, dir)
}

/// A child of `c` holding `held_mib` on GPU 0 beside its context, killed with SIGKILL: the reap
/// returns all of it, the GPU frees it, and the next process gets the container's whole limit.
pub fn assert_killed_holder_is_reaped(c: &Container, node: &SimNode, mut child: Child, held_mib: u64) {
    let region = c.region();
    let gpu = || tessera_sim_model::Node::open_state(&node.state, None).unwrap().memory_info(0, 0).unwrap().used;
    let held = (OVERHEAD_MIB + held_mib) * MIB;
    assert_eq!(settled(held, || region.used(0)), held);
    assert_eq!(gpu(), held);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(region.reap(), 1);
    assert_eq!(region.used(0), 0, "the dead process's charge is returned");
    assert_eq!(gpu(), 0, "and the GPU freed its memory");
    let (code, r, _) = workload(c, node, &["--alloc-mib", "700"]);
    assert_eq!(code, 0, "the container has its whole limit again: {r}");
}

/// A test's start under `limit` bytes on every device: in the parent, runs the test again in a
/// fresh container with that limit ([`run_in_container`]) and gives `None`; in that child, the
/// session on device 0.
pub fn limited_session(test_name: &str, limit: u64) -> Option<cuda::Session> {
    if !in_child() {
        run_in_container(test_name, &memory_limits(limit));
        return None;
    }
    Some(cuda::Session::start(0))
}

/// Device 0's entry in the region, and what it is charged once the first context's deferred
/// true-up is done (its overhead): the base a test counts its own charges from.
pub fn device0_base(s: &cuda::Session) -> (Region, usize, u64) {
    let (region, dev) = region_and_dev(s);
    let base = settled(OVERHEAD_MIB * MIB, || region.used(dev));
    (region, dev, base)
}

/// Runs `test_name` again as a child in a fresh container with `limits`, on a fresh node, and
/// fails if the child failed (the parent's half of a test whose body runs in the child).
pub fn run_in_container(test_name: &str, limits: &Limits) {
    let node = node();
    let c = Container::new(limits);
    wait_child(test_name, spawn_child(test_name, container_env(&c, &node)));
}
