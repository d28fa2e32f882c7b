//! containerd 1.6 (Debian 12) with ctr and the runtime wrapper as the runc binary of the
//! io.containerd.runc.v2 shim. A private containerd (own root, state and socket) is started for
//! the test and stopped after.

mod common;
/// The daemon's tests' private containerd (this crate's tests cannot depend on the daemon's).
#[path = "../../daemon/tests/common/containerd.rs"]
mod private_containerd;

use std::path::Path;
use std::process::{Command, Output};

use common::*;
use private_containerd::Containerd;

/// A private containerd for `node` (no CRI), answering; else why not (a skip).
fn start(node: &Node) -> Result<Containerd, String> {
    let base = node.path().join("containerd");
    std::fs::create_dir_all(&base).unwrap();
    let config = base.join("config.toml");
    std::fs::write(&config, "version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n").unwrap();
    let log = std::fs::File::create(base.join("containerd.log")).unwrap();
    let d = Containerd::start(&base, &config, &node.config, log.try_clone().unwrap(), log);
    if d.answers() {
        return Ok(d);
    }
    Err(format!(
        "containerd did not answer: {}",
        std::fs::read_to_string(base.join("containerd.log")).unwrap_or_default()
    ))
}

fn ctr_run(d: &Containerd, rootfs: &Path, id: &str, env: &[&str], script: &str) -> Output {
    let mut c = Command::new("ctr");
    c.arg("--address").arg(&d.sock).args(["--namespace", "tessera-test", "run", "--rm", "--runc-binary", WRAPPER]);
    for e in env {
        c.args(["--env", e]);
    }
    c.arg("--rootfs").arg(rootfs).arg(format!("{id}-{}", std::process::id())).args(["/bin/sh", "-c", script]);
    c.stdin(std::process::Stdio::null());
    c.output().expect("run ctr")
}

#[test]
fn ctr_with_wrapper_gets_exactly_its_gpu() {
    let node = Node::new();
    if !is_root() {
        skip("containerd tests need root");
        return;
    }
    if which("containerd").is_none() || which("ctr").is_none() || which("runc").is_none() {
        skip("containerd, ctr or runc is not installed (Debian packages containerd, runc)");
        return;
    }
    let d = match start(&node) {
        Ok(d) => d,
        Err(e) => {
            skip(&e);
            return;
        }
    };
    let probe = busybox_rootfs(&node.path().join("probe-rootfs")).unwrap();
    let out = ctr_run(&d, &probe, "probe", &[], "echo ok");
    if !(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok")) {
        skip(&format!("containerd cannot run containers here: {}", text(&out)));
        return;
    }
    let rootfs = busybox_rootfs(&node.path().join("rootfs")).unwrap();
    let out = ctr_run(&d, &rootfs, "gpu0", &["TESSERA_VISIBLE_DEVICES=0", "TESSERA_ALLOCATION=a1"], PROBE);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert_gpu0(&all);
    assert!(all.contains(&format!("TESSERA_VISIBLE_DEVICES={GPU0}")), "{all}");

    // Refused: the container does not start, the error reaches ctr.
    let rootfs = busybox_rootfs(&node.path().join("rootfs2")).unwrap();
    let out = ctr_run(&d, &rootfs, "refused", &["TESSERA_VISIBLE_DEVICES=1", "TESSERA_ALLOCATION=a1"], "echo STARTED");
    let all = text(&out);
    assert!(!out.status.success() && !all.contains("STARTED"), "{all}");
    assert!(all.contains("is not allocated to this container"), "{all}");
}
