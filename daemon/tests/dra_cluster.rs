//! What the built `tesserad` tells the cluster about its node besides the ResourceSlice, against
//! the test API server on the simulated node:
//! - every fault and recovery is an events.k8s.io Event on the Node and on the Pod whose claim
//!   holds the device; a flapping GPU makes one Event per series with a count, not a flood;
//! - GPU labels under `tessera.io/` on the Node, patched beside foreign labels it never touches,
//!   kept current across a layout change (MIG instances, a reload) made while the API server
//!   is down;
//!   none with `kubernetes.labels = false`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use tessera_proto::dra::v1;
use tessera_proto::tessera::v1 as api;
use tessera_sim_testkit::SimNode;

mod common;

use common::apiserver::ApiServer;
use common::dra_kubelet::{claim, register, v1_client};
use common::spawn;

/// Longer than [`common::WAIT`]: a series count is written up to 2 s after its occurrence.
const WAIT: Duration = Duration::from_secs(10);

/// A test's tesserad in mode `dra` against `apiserver` ([`ApiServer::tesserad_config`] with
/// `extra` and `kubernetes`): its directory, the daemon, its configuration file and its log.
struct Started {
    tmp: tempfile::TempDir,
    daemon: common::Daemon,
    config: std::path::PathBuf,
    log: std::path::PathBuf,
}

fn start(node: &SimNode, apiserver: &ApiServer, extra: &str, kubernetes: &str) -> Started {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let config = apiserver.tesserad_config(node, dir, "dra", extra, kubernetes);
    let (notify, log) = (dir.join("notify.sock"), dir.join("tesserad.log"));
    let (daemon, _) = spawn(node, &config, &notify, &log);
    Started { tmp, daemon, config, log }
}

/// Polls `what` until `done` accepts it (up to [`WAIT`]); the last value.
async fn until<T: std::fmt::Debug>(what: impl Fn() -> T, done: impl Fn(&T) -> bool, log: &Path) -> T {
    common::eventually(WAIT, log, || {
        let v = what();
        if done(&v) { Ok(v) } else { Err(format!("gave up waiting; last {v:?}")) }
    })
    .await
}

/// (kind, name, reason) → (series count, or 1 without a series), of every Event.
fn series(apiserver: &ApiServer) -> BTreeMap<(String, String, String), i64> {
    apiserver
        .events()
        .values()
        .map(|e| {
            let key = (
                e["regarding"]["kind"].as_str().unwrap_or_default().to_owned(),
                e["regarding"]["name"].as_str().unwrap_or_default().to_owned(),
                e["reason"].as_str().unwrap_or_default().to_owned(),
            );
            (key, e["series"]["count"].as_i64().unwrap_or(1))
        })
        .collect()
}

/// The devices of node-a's pool, across its slices (1.34 puts a shared device in a slice of its
/// own), sorted.
fn slice_names(apiserver: &ApiServer) -> Vec<String> {
    let mut names: Vec<String> = apiserver
        .slices()
        .values()
        .filter(|s| s["spec"]["pool"]["name"] == "node-a")
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .map(|d| d["name"].as_str().unwrap().into())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_and_recoveries_are_events_on_the_node_and_the_pod_a_flapping_gpu_one_series() {
    let node = SimNode::with_description("numa_nodes = 1\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let apiserver = ApiServer::start().await;
    let health = "[health]\ninterval_seconds = 1\nrecovery_check_ms = 100";
    let Started { tmp, daemon, config: _, log } = start(&node, &apiserver, health, "");
    let dir = tmp.path();
    until(|| slice_names(&apiserver), |n| n.len() == 2, &log).await;

    // A pod's claim holds part of GPU 0.
    let reg = register(&dir.join("kubelet/plugins_registry/gpu.tessera.io-reg.sock")).await;
    apiserver.put_claim(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "ml", "uid": "uid-1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share.tessera.io"}}]}},
        "status": {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.io",
                "pool": "node-a", "device": "gpu-0-shared", "consumedCapacity": {"memory": "8Gi", "sm": "30"}}]}},
            "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "pod-uid-0"}]
        }
    }));
    let mut kubelet = v1_client(&reg.endpoint).await;
    let prepared = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![claim("ml", "uid-1", "train")] })
        .await
        .expect("NodePrepareResources")
        .into_inner();
    assert_eq!(prepared.claims["uid-1"].error, "");
    assert!(apiserver.events().is_empty(), "no fault, no Event");
    // Faults count from the health monitor's first look.
    until(|| std::fs::read_to_string(&log).unwrap_or_default(), |t| t.contains("health monitor started"), &log).await;

    // The GPU flaps: faults and recoveries, one after the other.
    const FLAPS: i64 = 4;
    let sim = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
    for _ in 0..FLAPS {
        sim.inject_ecc(0, 0, 1).expect("a double-bit ECC error on GPU 0");
        until(|| slice_names(&apiserver), Vec::is_empty, &log).await;
        sim.reset(0).expect("reset GPU 0");
        until(|| slice_names(&apiserver), |n| n.len() == 2, &log).await;
    }
    let key = |kind: &str, name: &str, reason: &str| (kind.to_owned(), name.to_owned(), reason.to_owned());
    let want = BTreeMap::from([
        (key("Node", "node-a", "GPUFault"), FLAPS),
        (key("Node", "node-a", "GPURecovered"), FLAPS),
        (key("Pod", "trainer-0", "GPUFault"), FLAPS),
        (key("Pod", "trainer-0", "GPURecovered"), FLAPS),
    ]);
    let got = until(|| series(&apiserver), |s| *s == want, &log).await;
    assert_eq!(got, want, "one Event per series, counting every occurrence");
    let creates = apiserver.requests().iter().filter(|r| r.starts_with("POST /apis/events.k8s.io/")).count();
    assert_eq!(creates, 4, "each series created once");

    let events = apiserver.events();
    let pod_fault = events.values().find(|e| e["regarding"]["kind"] == "Pod" && e["reason"] == "GPUFault").unwrap();
    assert_eq!(pod_fault["metadata"]["namespace"], "ml", "a Pod's Events live in its namespace");
    assert_eq!(pod_fault["regarding"]["uid"], "pod-uid-0");
    assert_eq!(pod_fault["type"], "Warning");
    assert!(pod_fault["note"].as_str().unwrap().contains("ECC"), "{pod_fault}");
    assert_eq!(pod_fault["reportingController"], "tessera.io/tesserad");
    assert_eq!(pod_fault["reportingInstance"], "tesserad-node-a");
    let node_recovery =
        events.values().find(|e| e["regarding"]["kind"] == "Node" && e["reason"] == "GPURecovered").unwrap();
    assert_eq!(
        (node_recovery["metadata"]["namespace"].as_str(), node_recovery["type"].as_str()),
        (Some("default"), Some("Normal"))
    );
    drop(daemon);
}

fn labels(apiserver: &ApiServer) -> BTreeMap<String, String> {
    apiserver
        .node("node-a")
        .and_then(|n| serde_json::from_value(n["metadata"]["labels"].clone()).ok())
        .unwrap_or_default()
}

const FOREIGN: [(&str, &str); 3] =
    [("kubernetes.io/hostname", "node-a"), ("nvidia.com/gpu.product", "something-else"), ("tessera.io/pool", "blue")];

fn node_object() -> Value {
    let mut labels: serde_json::Map<String, Value> = FOREIGN.iter().map(|(k, v)| ((*k).into(), json!(v))).collect();
    // Stale: ours, from an earlier layout.
    labels.insert("tessera.io/gpu.count".into(), json!("8"));
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "uid": "node-uid", "labels": labels}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_labels_are_ours_only_and_follow_the_layout_across_an_api_server_restart() {
    let node =
        SimNode::with_description("numa_nodes = 1\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\nmig = true\n");
    let mut apiserver = ApiServer::start().await;
    apiserver.put_node(node_object());
    let layout = |mig: &str| format!("[partitions.\"0\"]\nmig = {{ {mig} }}");
    let Started { tmp, daemon, config, log } = start(&node, &apiserver, &layout("\"3g.40gb\" = 2"), "");
    let dir = tmp.path();
    let l =
        until(|| labels(&apiserver), |l| l.get("tessera.io/mig.strategy").is_some_and(|s| s == "single"), &log).await;
    let mine = |l: &BTreeMap<String, String>, k: &str| l.get(k).cloned().unwrap_or_default();
    assert_eq!(mine(&l, "tessera.io/gpu.count"), "1", "the stale count is corrected");
    assert_eq!(mine(&l, "tessera.io/gpu.product"), "NVIDIA-H100-80GB-HBM3");
    assert_eq!(mine(&l, "tessera.io/gpu.family"), "hopper");
    assert_eq!(
        (mine(&l, "tessera.io/gpu.compute.major"), mine(&l, "tessera.io/gpu.compute.minor")),
        ("9".into(), "0".into())
    );
    assert_eq!(mine(&l, "tessera.io/mig.capable"), "true");
    for k in [
        "tessera.io/gpu.memory",
        "tessera.io/gpu.driver.major",
        "tessera.io/gpu.driver.minor",
        "tessera.io/cuda.driver.major",
        "tessera.io/cuda.runtime.minor",
    ] {
        assert!(mine(&l, k).bytes().all(|b| b.is_ascii_digit()) && !mine(&l, k).is_empty(), "{k}: {l:?}");
    }
    for (k, v) in FOREIGN {
        assert_eq!(mine(&l, k), v, "a label not ours is untouched");
    }
    let patches: Vec<String> =
        apiserver.requests().into_iter().filter(|r| r.starts_with("PATCH /api/v1/nodes/")).collect();
    assert_eq!(patches, ["PATCH /api/v1/nodes/node-a"], "one patch for the whole set");

    // The API server goes down; the layout changes (two MIG profiles); it comes back.
    apiserver.stop().await;
    std::fs::write(
        &config,
        std::fs::read_to_string(&config)
            .unwrap()
            .replace(&layout("\"3g.40gb\" = 2"), &layout("\"3g.40gb\" = 1, \"2g.20gb\" = 1")),
    )
    .unwrap();
    let mut api = common::node_api(&dir.join("run/tessera.sock")).await;
    let r = api.reload(api::ReloadRequest { dry_run: false }).await.expect("reload").into_inner();
    assert_eq!(r.outcome, api::ReloadOutcome::Applied as i32, "{r:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    apiserver.restart().await;
    let l =
        until(|| labels(&apiserver), |l| l.get("tessera.io/mig.strategy").is_some_and(|s| s == "mixed"), &log).await;
    for (k, v) in FOREIGN {
        assert_eq!(mine(&l, k), v);
    }
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_off_means_no_node_patch() {
    let node = SimNode::with_description("numa_nodes = 1\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let apiserver = ApiServer::start().await;
    apiserver.put_node(node_object());
    let Started { tmp: _tmp, daemon, config: _, log } = start(&node, &apiserver, "", "labels = false");
    until(|| slice_names(&apiserver), |n| n.len() == 2, &log).await;
    // The slice is published after startup finished; a labeller would have patched by now, and
    // the log says labels are off.
    until(|| std::fs::read_to_string(&log).unwrap_or_default(), |t| t.contains("labels=false"), &log).await;
    // (The Node is read at start: whether its kubelet can run DRA at all.)
    let patches = |r: &String| r.starts_with("PATCH") && r.contains("/api/v1/nodes");
    assert!(!apiserver.requests().iter().any(patches), "{:?}", apiserver.requests());
    assert_eq!(labels(&apiserver)["tessera.io/gpu.count"], "8", "the Node is untouched");
    drop(daemon);
}
