//! `tessera-hook poststop` (the CDI specs' and the wrapper's entry after a container is deleted):
//! it leaves the container's id in the allocation's `deleted` file, whichever way it learns the
//! allocation, and does nothing (successfully) for a container that names none or whose
//! allocation is gone.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::*;

fn poststop(args: &[&str], state: &str) -> std::process::Output {
    let mut child = Command::new(HOOK)
        .env_clear()
        .args(args)
        .arg("poststop")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(state.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn bundle(node: &Node, name: &str, env: &[&str]) -> std::path::PathBuf {
    let b = node.path().join(name);
    std::fs::create_dir_all(&b).unwrap();
    let config = serde_json::json!({ "process": { "env": env }, "root": { "path": "rootfs" } });
    std::fs::write(b.join("config.json"), config.to_string()).unwrap();
    b
}

#[test]
fn poststop_records_the_deleted_container() {
    if !is_root() {
        skip("the fake node's device nodes need root");
        return;
    }
    let node = Node::new();
    let deleted = node.run.join("alloc/a1/deleted");
    let config = node.config.to_str().unwrap().to_owned();

    // From a CDI spec: the allocation the bundle names.
    let b = bundle(&node, "b1", &["TESSERA_ALLOCATION=a1"]);
    let state = serde_json::json!({ "id": "c-9", "status": "stopped", "bundle": b }).to_string();
    let out = poststop(&["--config", &config], &state);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(&deleted).unwrap(), "c-9");

    // From the wrapper: the directory named.
    let dir = node.run.join("alloc/a1");
    let state = serde_json::json!({ "id": "c-10", "bundle": "/nonexistent" }).to_string();
    let out = poststop(&["--alloc-dir", dir.to_str().unwrap()], &state);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(&deleted).unwrap(), "c-10");

    // No allocation named, a bundle already gone, an allocation released: nothing, no failure.
    let plain = bundle(&node, "b2", &["PATH=/bin"]);
    for b in [plain.to_str().unwrap(), "/nonexistent"] {
        let state = serde_json::json!({ "id": "c-11", "bundle": b }).to_string();
        let out = poststop(&["--config", &config], &state);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let gone = node.run.join("alloc/released");
    let out = poststop(&["--alloc-dir", gone.to_str().unwrap()], r#"{"id":"c-12"}"#);
    assert!(out.status.success() && !gone.exists());
    assert_eq!(std::fs::read_to_string(&deleted).unwrap(), "c-10");

    // A state without an id is an error naming it.
    let out = poststop(&["--config", &config], r#"{"bundle":"/x"}"#);
    assert!(String::from_utf8_lossy(&out.stderr).contains("state: id"), "{out:?}");
}
