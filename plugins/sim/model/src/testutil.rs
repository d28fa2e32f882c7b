//! Test helpers: a node of a test's own, and other processes to share it with.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::{Node, NodeDescription};

pub struct TestNode {
    pub _dir: tempfile::TempDir,
    pub state: PathBuf,
    pub node: Node,
}

pub fn node_from(toml: Option<&str>) -> TestNode {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("node.state");
    let desc = toml.map(|t| NodeDescription::parse(t).unwrap());
    let node = Node::open_state(&state, desc).unwrap();
    TestNode { _dir: dir, state, node }
}

pub fn default_node() -> TestNode {
    node_from(None)
}

/// A second handle on the same node, with its own process slot (as another process has).
pub fn reopen(state: &Path) -> Node {
    Node::open_state(state, None).unwrap()
}

/// Held while [`child`] spawns and while [`close`] drops a handle. A spawn forks this whole test
/// process: until the child execs, it holds a copy of every open descriptor (close-on-exec ones
/// too), and with it a handle's liveness lock, so a handle dropped meanwhile on another test's
/// thread would still look alive to the reaper. `spawn` returns once the child has exec'd.
static SPAWNING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Drops a handle as a process ending would: its slot is free for the next reap at once.
pub fn close(node: Node) {
    let _g = SPAWNING.lock().unwrap_or_else(|e| e.into_inner());
    drop(node);
}

const ROLE: &str = "TESSERA_MODEL_TEST_CHILD";

/// Starts this test binary again as another process that opens `state`, performs `role`, prints
/// "ready" and then waits to be killed.
pub fn child(role: &str, state: &Path) -> (Child, BufReader<std::process::ChildStdout>) {
    let spawning = SPAWNING.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["testutil::child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("TESSERA_MODEL_TEST_STATE", state)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    drop(spawning);
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child exited before it was ready");
        if line.trim_end().ends_with("ready") {
            break;
        }
    }
    (c, out)
}

/// Roles: "alloc <gpu> <bytes>", "launch <gpu> <ns>" (queues work and holds the stream busy).
#[test]
fn child_entry() {
    let Some(role) = std::env::var_os(ROLE) else { return };
    let role = role.into_string().unwrap();
    let state = PathBuf::from(std::env::var_os("TESSERA_MODEL_TEST_STATE").unwrap());
    let node = Node::open_state(&state, None).unwrap();
    let words: Vec<&str> = role.split_whitespace().collect();
    match words.as_slice() {
        ["alloc", gpu, bytes] => node.alloc(gpu.parse().unwrap(), 0, bytes.parse().unwrap()).unwrap(),
        ["launch", gpu, ns] => {
            let s = node.stream_create(gpu.parse().unwrap(), 0, 0).unwrap();
            node.launch(s, ns.parse().unwrap()).unwrap();
        }
        // A CUDA process whose checkpoint thread never answers.
        ["serve-silently"] => node.checkpoint_serve(1).unwrap(),
        other => panic!("unknown role {other:?}"),
    }
    println!("ready");
    std::thread::sleep(std::time::Duration::from_secs(600));
}
