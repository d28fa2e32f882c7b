//! Containers without a kubelet: `tessera alloc --lease container` carves a share; a runc
//! container started through `tessera-runtime` naming it (env TESSERA_ALLOCATION, the GPU by
//! its UUID) gets its GPU's node and its limits, read-only; `tessera limits set` shows in the
//! container's file; when the container is deleted (its poststop hook) the allocation is
//! released; a second leased allocation whose container was killed and whose runtime state
//! vanished without the hook is released by the daemon's reconcile.

use std::path::Path;
use std::time::{Duration, Instant};

use tessera_sim_testkit::{SimNode, binary};
use tessera_tests::kubelet::{node_api, start_daemon};
use tessera_tests::{GPU0_DEVICES, ONE_H100, RuncTest, ok, runc_bundle, runc_test, tessera};

fn alloc(dir: &Path, sm: &str) -> serde_json::Value {
    let out = ok(&tessera(dir, &["alloc", "--memory", "4GiB", "--sm", sm, "--lease", "container", "--json"]));
    serde_json::from_str(out.trim()).expect("json")
}

fn allocation_ids(dir: &Path) -> Vec<String> {
    let list: serde_json::Value = serde_json::from_str(&ok(&tessera(dir, &["allocations", "--json"]))).expect("json");
    list.as_array().expect("array").iter().map(|a| a["id"].as_str().expect("id").to_owned()).collect()
}

/// Waits (bounded) until `id` is no longer listed.
async fn wait_released(dir: &Path, id: &str, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while allocation_ids(dir).iter().any(|a| a == id) {
        assert!(
            Instant::now() < deadline,
            "{id} was not released:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A bundle `dir/name` running `script` with `env`.
fn bundle(dir: &Path, name: &str, rootfs: &Path, script: &str, env: &[String]) -> std::path::PathBuf {
    let bundle = dir.join(name);
    runc_bundle(&bundle, rootfs, script, env, serde_json::Value::Null);
    bundle
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_share_follows_its_runc_container() {
    let Some(RuncTest { tmp, rootfs, host }) = runc_test(GPU0_DEVICES) else { return };
    let dir = tmp.path();

    let node = SimNode::with_description(ONE_H100);
    // No kubelet: the GPU stays whole in the kubelet's terms; shares are carved on demand.
    let (_daemon, log) = start_daemon(&node, dir, &host.injection_config());
    let _ = node_api(&dir.join("run/tessera.sock")).await;
    let hook_config = host.write_hook_config();
    let runc = |args: &[&str]| {
        let mut c = tokio::process::Command::new(binary("tessera-runtime"));
        c.env("TESSERA_HOOK_CONFIG", &hook_config).arg("--root").arg(dir.join("runc-state")).args(args);
        c.stdin(std::process::Stdio::null());
        c
    };

    // 1. A container that reads its limits, waits for them to change, and exits; `runc run`
    //    deletes it at the end, and its poststop hook releases the leased allocation.
    let first = alloc(dir, "30");
    let id = first["id"].as_str().expect("id").to_owned();
    let uuid = first["devices"][0]["uuid"].as_str().expect("uuid").to_owned();
    //    It names its allocation and asks for nothing else: naming it is the request (issue 31,
    //    item 6; such a container ran without a GPU).
    //    tesserad's context sizes appear beside the limits, and the container cannot change them.
    let script = "echo visible=$TESSERA_VISIBLE_DEVICES preload=$(cat /etc/ld.so.preload); cat /run/tessera/alloc/limits; \
                  f=/run/tessera/alloc/context-sizes; for i in $(seq 1 600); do [ -f $f ] && break; sleep 0.05; done; \
                  cat $f; (echo forged > $f) 2>/dev/null && echo TAMPERED-write; rm -f $f 2>/dev/null; \
                  [ -f $f ] || echo TAMPERED-rm; (echo x > /run/tessera/alloc/.f && mv -f /run/tessera/alloc/.f $f) \
                  2>/dev/null && echo TAMPERED-mv; \
                  for i in $(seq 1 600); do grep -q 'sm_percent = 45' /run/tessera/alloc/limits && break; sleep 0.05; done; \
                  echo changed; cat /run/tessera/alloc/limits; ls /dev";
    let env = [format!("TESSERA_ALLOCATION={id}")];
    let b1 = bundle(dir, "b1", &rootfs, script, &env);
    let mut child = runc(&["run", "--bundle", b1.to_str().unwrap(), "fn-a"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("tessera-runtime run");
    // Bound to the container once the daemon reads the wrapper's owner record.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let list: serde_json::Value =
            serde_json::from_str(&ok(&tessera(dir, &["allocations", "--json"]))).expect("json");
        let a = list.as_array().expect("array").iter().find(|a| a["id"] == id.as_str()).cloned();
        if a.as_ref().is_some_and(|a| a["container"]["container_id"] == "fn-a") {
            assert_eq!(a.as_ref().unwrap()["lease"], "container");
            break;
        }
        assert!(Instant::now() < deadline, "not bound to fn-a: {a:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ok(&tessera(dir, &["limits", "set", &id, "--sm", "45"]));
    let out = tokio::time::timeout(Duration::from_secs(60), async {
        let mut stdout = child.stdout.take().expect("stdout");
        let mut text = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stdout, &mut text).await.expect("read");
        let status = child.wait().await.expect("wait");
        (status, text)
    })
    .await
    .expect("the container in time");
    assert!(out.0.success(), "{}\n{}", out.1, std::fs::read_to_string(&log).unwrap_or_default());
    let (before, after) = out.1.split_once("changed").expect("the container saw the change");
    assert!(before.contains("sm_percent = 30") && before.contains(&uuid), "{before}");
    assert!(before.contains(&format!("visible={uuid} ")), "exactly the allocation's GPU: {before}");
    assert!(before.contains("libtessera.so"), "the shim preloaded: {before}");
    assert!(before.contains(&format!("tessera-context-sizes 1\n{uuid} ")), "context sizes published: {before}");
    assert!(!before.contains("TAMPERED"), "read-only in the container: {before}");
    assert!(after.contains("sm_percent = 45"), "the running container sees the new limit: {after}");
    assert!(after.contains("nvidia0") && after.contains("nvidiactl"), "{after}");
    wait_released(dir, &id, &log).await;
    assert!(!dir.join("run/alloc").join(&id).exists());
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains("container fn-a was deleted"),
        "released by the poststop entry the wrapper adds for a lease, not by the fallback:\n{text}"
    );

    // 2. A container killed with SIGKILL whose runtime state then vanishes without its poststop
    //    hook (a crashed host path): the reconcile releases it once the grace has passed.
    let second = alloc(dir, "30");
    let id2 = second["id"].as_str().expect("id").to_owned();
    let env = [format!("TESSERA_ALLOCATION={id2}"), format!("TESSERA_VISIBLE_DEVICES={uuid}")];
    let b2 = bundle(dir, "b2", &rootfs, "sleep 600", &env);
    // Detached: the container must not hold the test's pipes.
    let status = runc(&["run", "--detach", "--bundle", b2.to_str().unwrap(), "fn-b"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .await
        .expect("run");
    assert!(status.success());
    let out = tokio::process::Command::new("runc")
        .arg("--root")
        .arg(dir.join("runc-state"))
        .args(["kill", "fn-b", "KILL"])
        .output()
        .await
        .expect("kill");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Still leased while its container exists (stopped, not deleted).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(allocation_ids(dir).contains(&id2), "released before its container was deleted");
    // The runtime's state disappears without `runc delete` (no poststop hook runs): moved aside.
    let state = dir.join("runc-state/fn-b");
    let aside = dir.join("fn-b-state");
    std::fs::rename(&state, &aside).expect("move the runtime state aside");
    wait_released(dir, &id2, &log).await;
    let daemon_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(daemon_log.contains("does not exist"), "{daemon_log}");
    // Clean up the container's cgroup: its state back, deleted (its poststop finds no allocation).
    std::fs::rename(&aside, &state).expect("state back");
    let out = runc(&["delete", "--force", "fn-b"]).output().await.expect("delete");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
