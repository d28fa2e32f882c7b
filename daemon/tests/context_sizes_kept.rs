//! A GPU's context size, measured by tesserad's probe (issue 34, item 6), is kept in its state
//! for the driver that measured it: a restart publishes it again without probing (the probe's
//! context would take a moment of the GPU's memory beside the tenants' at every restart), and a
//! kept file that is damaged is moved aside, said, and measured again.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{WAIT, eventually, start_daemon};
use tessera_proto::tessera::v1 as api;
use tessera_region::context_sizes::{CONTEXT_SIZES_FILE, ContextSizes};
use tessera_sim_testkit::SimNode;

const OVERHEAD_MIB: u64 = 300;
/// One H100 whose contexts take `OVERHEAD_MIB`.
const NODE: &str = "context_overhead_mib = 300\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n";
const MIB: u64 = 1 << 20;
const BODY: &str = "[enforcement]\naction = \"report\"\ninterval_ms = 100\n";

/// A 1 GiB share through the node API; its directory.
async fn share_dir(dir: &Path) -> PathBuf {
    let mut api = common::node_api(&dir.join("run/tessera.sock")).await;
    let ask = api::AllocateRequest { memory_bytes: 1 << 30, sm_percent: 10, ..Default::default() };
    let answer = api.allocate(ask).await.expect("allocate").into_inner();
    PathBuf::from(&answer.env["TESSERA_LIMITS"]).parent().expect("the allocation's directory").to_path_buf()
}

/// The figure published into `alloc_dir` for `uuid`, once it is there.
async fn published(alloc_dir: &Path, uuid: &str, log: &Path) -> u64 {
    let file = alloc_dir.join(CONTEXT_SIZES_FILE);
    eventually(WAIT, log, || {
        ContextSizes::load(&file).and_then(|t| t.get(uuid)).ok_or_else(|| format!("{} not published", file.display()))
    })
    .await
}

/// The files of `state` whose names start with `prefix`.
fn files(state: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(state)
        .expect("state dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(prefix)))
        .collect();
    out.sort();
    out
}

fn count(log: &Path, text: &str) -> usize {
    std::fs::read_to_string(log).unwrap_or_default().matches(text).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_measured_context_size_is_kept_across_restarts_and_a_damaged_copy_is_set_aside() {
    let (node, tmp) = (SimNode::with_description(NODE), tempfile::tempdir().expect("tempdir"));
    let (dir, state) = (tmp.path(), tmp.path().join("state"));
    let model = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
    let uuid = model.gpu(0).expect("GPU 0").uuid.clone();
    const MEASURED: &str = "context size measured";
    const KEPT: &str = "context sizes kept from an earlier start";

    // First start: measured by the probe, published, and kept (owner-only) for this driver.
    let (daemon, log) = start_daemon(&node, dir, BODY);
    let first = share_dir(dir).await;
    assert_eq!(published(&first, &uuid, &log).await, OVERHEAD_MIB * MIB);
    let kept = eventually(WAIT, &log, || match files(&state, CONTEXT_SIZES_FILE).as_slice() {
        [one] => Ok(one.clone()),
        other => Err(format!("one kept file, not {other:?}")),
    })
    .await;
    let name = kept.file_name().and_then(|n| n.to_str()).expect("name").to_owned();
    assert!(name.starts_with("context-sizes-") && name.len() > "context-sizes-".len(), "keyed by the driver: {name}");
    assert_eq!(ContextSizes::load(&kept).and_then(|t| t.get(&uuid)), Some(OVERHEAD_MIB * MIB));
    assert_eq!(std::fs::metadata(&kept).expect("stat").permissions().mode() & 0o777, 0o600);
    assert_eq!(count(&log, MEASURED), 1);
    drop(daemon);

    // Restarted on the same driver: the kept figure is published to a new share, no probe.
    let (daemon, log) = start_daemon(&node, dir, BODY);
    let second = share_dir(dir).await;
    assert_eq!(published(&second, &uuid, &log).await, OVERHEAD_MIB * MIB);
    assert_eq!(count(&log, KEPT), 1, "{}", std::fs::read_to_string(&log).unwrap_or_default());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(count(&log, MEASURED), 1, "not measured again");
    drop(daemon);

    // Damaged while tesserad was down: moved aside (kept as it was), said, measured again.
    std::fs::write(&kept, "tessera-context-sizes 1\nGPU-garbage\n").expect("damage it");
    let (_daemon, log) = start_daemon(&node, dir, BODY);
    let third = share_dir(dir).await;
    assert_eq!(published(&third, &uuid, &log).await, OVERHEAD_MIB * MIB);
    eventually(WAIT, &log, || {
        (count(&log, MEASURED) == 2).then_some(()).ok_or_else(|| "not measured again".to_owned())
    })
    .await;
    let aside = files(&state, &format!("{name}.corrupt"));
    assert_eq!(aside.len(), 1, "moved aside: {aside:?}");
    assert_eq!(std::fs::read_to_string(&aside[0]).expect("read"), "tessera-context-sizes 1\nGPU-garbage\n");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(text.contains("kept context sizes are damaged: moved aside") && text.contains(&name), "{text}");
    eventually(WAIT, &log, || {
        ContextSizes::load(&kept).and_then(|t| t.get(&uuid)).map(|_| ()).ok_or_else(|| "not kept again".to_owned())
    })
    .await;
}
