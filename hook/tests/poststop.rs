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

/// A fresh fake node, whose device nodes need root: `None` (a skip) when not root.
fn root_node() -> Option<Node> {
    if !is_root() {
        skip("the fake node's device nodes need root");
        return None;
    }
    Some(Node::new())
}

#[test]
fn poststop_records_the_deleted_container() {
    let Some(node) = root_node() else { return };
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

/// The wrapper adds its poststop entry only for an allocation leased to its container (the
/// daemon's `lease` marker in its directory): every other container's deletion runs no process of
/// ours.
#[test]
fn the_wrapper_adds_its_poststop_entry_only_for_a_leased_allocation() {
    let Some(node) = root_node() else { return };
    // The wrapper in front of /bin/true: its edit stays in config.json for us to read.
    let config = node.path().join("hook-true.toml");
    let text: String = std::fs::read_to_string(&node.config)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("runtime ="))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&config, text + "runtime = \"/bin/true\"\n").unwrap();
    let wrapped = |name: &str| -> serde_json::Value {
        let b = bundle(&node, name, &["TESSERA_VISIBLE_DEVICES=0", "TESSERA_ALLOCATION=a1"]);
        std::fs::create_dir_all(b.join("rootfs")).unwrap();
        let out = Command::new(WRAPPER)
            .env("TESSERA_HOOK_CONFIG", &config)
            .args(["create", "--bundle"])
            .arg(&b)
            .arg(name)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap()
    };

    let c = wrapped("not-leased");
    assert!(c["mounts"].as_array().is_some_and(|m| !m.is_empty()), "injected: {c}");
    assert!(c["hooks"]["poststop"].as_array().is_none_or(Vec::is_empty), "no poststop entry: {c}");

    std::fs::write(node.run.join("alloc/a1").join(tessera_region::owner::LEASE_FILE), "container\n").unwrap();
    let c = wrapped("leased");
    let post = c["hooks"]["poststop"].as_array().expect("a poststop entry");
    assert_eq!(post.len(), 1, "{c}");
    assert_eq!(post[0]["path"], HOOK, "tessera-hook beside the wrapper: {c}");
    let dir = node.run.join("alloc/a1").display().to_string();
    assert_eq!(post[0]["args"], serde_json::json!(["tessera-hook", "poststop", "--alloc-dir", dir]));
    // Its own environment: runc would otherwise hand it the runtime's, and the hook refuses an
    // inherited LD_LIBRARY_PATH.
    assert_eq!(post[0]["env"], serde_json::json!([tessera_region::cdi::HOOK_ENV]));
}
