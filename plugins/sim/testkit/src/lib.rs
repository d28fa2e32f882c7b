//! Test support for the simulated node.
//!
//! The driver library keeps one node connection per process (as a real driver keeps one
//! context table), so a test that needs a node of its own runs its body in a child process:
//! [`SimNode::run_isolated`].

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

/// Names under which the one simulated driver library is laid out, as a real driver installs.
pub const LIBRARY_NAMES: [&str; 4] = ["libnvidia-ml.so.1", "libnvidia-ml.so", "libcuda.so.1", "libcuda.so"];

/// The cargo profile directory holding this test's binaries and libraries (target/debug).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// The built simulated driver, `libtessera_sim.so`.
pub fn sim_library() -> PathBuf {
    let p = profile_dir().join("libtessera_sim.so");
    assert!(p.exists(), "{} is missing: build it first (cargo build --workspace)", p.display());
    p
}

/// A binary of the workspace built beside the tests (e.g. "tessera-sim", "tessera-workload").
pub fn binary(name: &str) -> PathBuf {
    let p = profile_dir().join(name);
    assert!(p.exists(), "{} is missing: build it first (cargo build --workspace)", p.display());
    p
}

/// What [`spawn_workload`] gives: the running workload, its pid, and the lines it prints next.
pub type Workload = (Child, u32, Lines<BufReader<ChildStdout>>);

/// Starts a `tessera-workload` from `cmd` with its stdout piped, and waits for its first line (a
/// JSON object with its `pid`, printed once its memory is held).
pub fn spawn_workload(cmd: &mut Command) -> Workload {
    let mut child = cmd.stdout(Stdio::piped()).spawn().expect("spawn the workload");
    let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let first = lines.next().expect("the workload's first line").expect("read the workload's output");
    let first: serde_json::Value = serde_json::from_str(&first).expect("the first line is JSON");
    let pid = first["pid"].as_u64().unwrap_or_else(|| panic!("no pid in {first}")) as u32;
    (child, pid, lines)
}

/// A node's description: `numa_nodes` NUMA nodes and a `[[gpu]]` table for each `(model, count,
/// more keys)`, the keys one a line (`"mig = true"`, `"nvlink = true"`) or none (`""`).
pub fn describe(numa_nodes: u32, gpus: &[(&str, u32, &str)]) -> String {
    let mut text = format!("numa_nodes = {numa_nodes}\n");
    for (model, count, more) in gpus {
        text += &format!("[[gpu]]\nmodel = \"{model}\"\ncount = {count}\n");
        if !more.is_empty() {
            text += &format!("{more}\n");
        }
    }
    text
}

/// The description of a node of two `model` GPUs on one NUMA node: GPU 0 in MIG mode, GPU 1
/// not. The MIG tests of the sim and of the daemon share it.
pub fn mig_and_whole(model: &str) -> String {
    describe(1, &[(model, 1, "mig = true"), (model, 1, "")])
}

/// A simulated node of a test's own: a state file, a description, and the driver laid out.
pub struct SimNode {
    /// Owns the files in the parent; `None` in an isolated child, which reuses the parent's.
    _dir: Option<tempfile::TempDir>,
    pub root: PathBuf,
    pub lib_dir: PathBuf,
    pub state: PathBuf,
    pub description: Option<PathBuf>,
}

impl SimNode {
    /// The built-in default node (8 x H100).
    pub fn new() -> SimNode {
        SimNode::make(None)
    }

    /// A node from a TOML description.
    pub fn with_description(toml: &str) -> SimNode {
        SimNode::make(Some(toml))
    }

    fn make(toml: Option<&str>) -> SimNode {
        if in_child()
            && let Some(root) = std::env::var_os(ROOT_MARK)
        {
            let root = PathBuf::from(root);
            let description = toml.map(|_| root.join("node.toml"));
            return SimNode {
                _dir: None,
                lib_dir: root.join("lib"),
                state: root.join("node.state"),
                description,
                root,
            };
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        let lib_dir = root.join("lib");
        std::fs::create_dir(&lib_dir).expect("lib dir");
        let lib = sim_library();
        for name in LIBRARY_NAMES {
            std::os::unix::fs::symlink(&lib, lib_dir.join(name)).expect("symlink");
        }
        let description = toml.map(|t| {
            let p = root.join("node.toml");
            std::fs::write(&p, t).expect("write description");
            p
        });
        let state = root.join("node.state");
        SimNode { _dir: Some(dir), root, lib_dir, state, description }
    }

    /// Path of the NVML library, for nvml-wrapper's `lib_path`.
    pub fn nvml_path(&self) -> PathBuf {
        self.lib_dir.join("libnvidia-ml.so.1")
    }

    /// Path of the CUDA driver library.
    pub fn cuda_path(&self) -> PathBuf {
        self.lib_dir.join("libcuda.so.1")
    }

    /// The environment that points a process at this node.
    pub fn env(&self) -> Vec<(String, OsString)> {
        let mut ld = OsString::from(&self.lib_dir);
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            ld.push(":");
            ld.push(old);
        }
        // A test node answers at the sim's own speed (no real driver's call latency) unless the
        // environment running the tests asks for it: the tests time nothing, and go faster.
        let latency = std::env::var_os(LATENCY).unwrap_or_else(|| "off".into());
        let mut env = vec![
            ("LD_LIBRARY_PATH".to_string(), ld),
            ("TESSERA_SIM_STATE".to_string(), self.state.clone().into_os_string()),
            (LATENCY.to_string(), latency),
        ];
        if let Some(d) = &self.description {
            env.push(("TESSERA_SIM_NODE".to_string(), d.clone().into_os_string()));
        }
        env
    }

    /// A command for a program, pointed at this node.
    pub fn command(&self, program: impl AsRef<Path>) -> Command {
        let mut c = Command::new(program.as_ref());
        c.envs(self.env());
        c
    }

    /// Runs `body` in a child process pointed at this node: the test binary is run again with
    /// only `test_name` selected. In the child `body` runs; in the parent this waits for the
    /// child and fails if the child failed. `test_name` is the test's path as libtest prints it.
    pub fn run_isolated(&self, test_name: &str, body: impl FnOnce()) {
        if std::env::var_os(CHILD_MARK).is_some_and(|v| v == test_name) {
            body();
            return;
        }
        let out = self
            .command(std::env::current_exe().expect("current_exe"))
            .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_MARK, test_name)
            .env(ROOT_MARK, &self.root)
            .output()
            .expect("spawn the test binary");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "isolated test {test_name} failed:\n{text}");
        assert!(text.contains("1 passed"), "isolated test {test_name} did not run (wrong name?):\n{text}");
    }
}

impl Default for SimNode {
    fn default() -> Self {
        SimNode::new()
    }
}

/// The sim's call latency (`on`, `off`, a factor; docs/sim.md).
pub const LATENCY: &str = "TESSERA_SIM_LATENCY";

/// For a benchmark's `main`, before it starts a thread: its nodes answer at a real driver's speed
/// (`TESSERA_SIM_LATENCY=on`) unless the environment says otherwise, where a test's are `off`.
pub fn real_driver_latency_unless_set() {
    if std::env::var_os(LATENCY).is_none() {
        // SAFETY: called first in a benchmark's main, before any other thread reads the environment.
        unsafe { std::env::set_var(LATENCY, "on") };
    }
}

const CHILD_MARK: &str = "TESSERA_TESTKIT_CHILD";
const ROOT_MARK: &str = "TESSERA_TESTKIT_ROOT";

/// Whether this process is an isolated child (to skip parent-only set-up).
pub fn in_child() -> bool {
    std::env::var_os(CHILD_MARK).is_some()
}
