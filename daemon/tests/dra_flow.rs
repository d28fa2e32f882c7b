//! The DRA driver end to end in the built `tesserad` (`kubernetes.mode = "dra"`) on the simulated
//! node, against the test API server and the test kubelet: the node's ResourceSlice appears; a
//! claim allocated 8Gi + 30% of GPU 0 is prepared into one allocation with exactly those limits
//! (node API `ListAllocations`) and a CDI name in the claim's own spec
//! (`tessera.io-claim_<uid>.json`: the GPU's node, the allocation's directory and region, the
//! shim's preload and env), and its `status.devices` says what was granted (written through an
//! injected API server failure); a claim that does not fit beside it is refused and leaves
//! nothing; after kill -9 (and the spec lost, as if the kill came between the record and the
//! spec) a restart writes the same spec again and removes a stray one, and the same claim
//! prepares to the same allocation and spec (nothing doubled); NodeUnprepareResources releases
//! it (record, directory, region mount, spec, status entry), twice without error.
//! A GPU fault takes the GPU's devices out of the slice (and out of prepare) and a reset brings
//! them back, and the kubelet's resource-health stream says UNHEALTHY (with the reason) and
//! HEALTHY again. In mode `both` the partitioned GPU stays with the device plugin and the other is
//! DRA's: no GPU is offered twice.

use std::path::Path;
use std::time::{Duration, Instant};

use hyper::Method;

use serde_json::{Value, json};
use tessera_proto::dra::v1;
use tessera_proto::dra_health::v1::HealthStatus;
use tessera_proto::tessera::v1 as api;
use tessera_sim_testkit::SimNode;

mod common;

use common::apiserver::ApiServer;
use common::dra_kubelet::{claim, health_until, register, v1_client, watch_health};
use common::{TestKubelet, WAIT, next_list, spawn};

const NODE: &str = "numa_nodes = 1
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 1
";

/// Device name → (health, message), as the kubelet's health stream says.
type HealthMap = std::collections::BTreeMap<String, (HealthStatus, String)>;

/// `tesserad`'s configuration for mode `dra` against `apiserver`, kubelet directories under `dir`.
fn dra_config(node: &SimNode, dir: &Path, apiserver: &ApiServer, extra: &str) -> std::path::PathBuf {
    mode_config(node, dir, apiserver, "dra", extra)
}

fn mode_config(node: &SimNode, dir: &Path, apiserver: &ApiServer, mode: &str, extra: &str) -> std::path::PathBuf {
    apiserver.tesserad_config(node, dir, mode, extra, "")
}

/// Waits for the health monitor's first look: a fault injected before it is its baseline, not a
/// fault.
async fn monitor_started(log: &Path) {
    common::eventually(WAIT, log, || {
        let started = std::fs::read_to_string(log).unwrap_or_default().contains("health monitor started");
        if started { Ok(()) } else { Err("no health monitor".into()) }
    })
    .await
}

/// The names of the devices in node-a's pool (its slices) once `done` accepts them (up to [`WAIT`]).
async fn slice_devices(apiserver: &ApiServer, done: impl Fn(&[String]) -> bool, log: &Path) -> Vec<String> {
    common::eventually(WAIT, log, || {
        let names: Option<Vec<String>> = apiserver
            .pool_devices("node-a")
            .map(|devices| devices.iter().map(|d| d["name"].as_str().unwrap().into()).collect());
        match names {
            Some(n) if done(&n) => Ok(n),
            n => Err(format!("slice devices {n:?}")),
        }
    })
    .await
}

fn claim_object(uid: &str, name: &str, memory: &str, sm: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ml", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share.tessera.io"}}]}},
        "status": {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.io",
                "pool": "node-a", "device": "gpu-0-shared", "consumedCapacity": {"memory": memory, "sm": sm}}]}},
            "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"), "uid": format!("{uid}-pod")}]
        }
    })
}

async fn prepare(endpoint: &Path, uid: &str, name: &str) -> v1::NodePrepareResourceResponse {
    let mut kubelet = v1_client(endpoint).await;
    let req = v1::NodePrepareResourcesRequest { claims: vec![claim("ml", uid, name)] };
    let mut answer = kubelet.node_prepare_resources(req).await.expect("NodePrepareResources").into_inner();
    answer.claims.remove(uid).expect("an answer for the claim")
}

async fn unprepare(endpoint: &Path, uid: &str, name: &str) -> String {
    let mut kubelet = v1_client(endpoint).await;
    let req = v1::NodeUnprepareResourcesRequest { claims: vec![claim("ml", uid, name)] };
    let mut answer = kubelet.node_unprepare_resources(req).await.expect("NodeUnprepareResources").into_inner();
    answer.claims.remove(uid).expect("an answer for the claim").error
}

/// The claim's `status.devices` once `done` accepts it (up to [`WAIT`]).
async fn status_devices(apiserver: &ApiServer, name: &str, done: impl Fn(&Value) -> bool, log: &Path) -> Value {
    common::eventually(WAIT, log, || {
        let devices = apiserver.claim("ml", name).expect("the claim")["status"]["devices"].clone();
        if done(&devices) { Ok(devices) } else { Err(format!("status.devices {devices}")) }
    })
    .await
}

/// The claim specs in `dir/cdi`, by file name.
fn claim_specs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("cdi"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.retain(|n| n.starts_with("tessera.io-claim_"));
    names.sort();
    names
}

/// The mount points under `dir` in this process's mount table.
fn mounts_under(dir: &Path) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let dir = dir.display().to_string();
    table.lines().filter_map(|l| l.split(' ').nth(4)).filter(|p| p.starts_with(&dir)).map(String::from).collect()
}

async fn allocations(socket: &Path) -> Vec<api::Allocation> {
    let mut node = common::node_api(socket).await;
    node.list_allocations(api::ListAllocationsRequest::default())
        .await
        .expect("ListAllocations")
        .into_inner()
        .allocations
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_prepared_into_one_allocation_with_its_capacity_across_a_kill_9() {
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let apiserver = ApiServer::start().await;
    let config = dra_config(&node, dir, &apiserver, "");
    let (plugins, registry) = (dir.join("kubelet/plugins"), dir.join("kubelet/plugins_registry"));
    let (notify, log) = (dir.join("notify.sock"), dir.join("tesserad.log"));
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let socket = dir.join("run/tessera.sock");

    let (mut daemon, _) = spawn(&node, &config, &notify, &log);
    // The node's slice: GPU 0 whole and shareable, nothing else.
    let slice = common::eventually(WAIT, &log, || {
        apiserver.slices().get("node-a-gpu.tessera.io").cloned().ok_or_else(|| "no ResourceSlice published".into())
    })
    .await;
    assert_eq!(slice["spec"]["driver"], "gpu.tessera.io");
    assert_eq!(slice["spec"]["nodeName"], "node-a");
    // The pool once complete: its slices are published one at a time.
    let names = slice_devices(&apiserver, |_| true, &log).await;
    assert_eq!(names, ["gpu-0", "gpu-0-shared"]);
    let mut node_api = common::node_api(&socket).await;
    let devices = node_api.list_devices(api::ListDevicesRequest::default()).await.expect("devices").into_inner();
    let gpu0 = devices.devices.iter().find(|d| d.kind == api::DeviceKind::Gpu as i32).expect("GPU 0").uuid.clone();

    // The kubelet finds the driver and prepares the claim; the API server fails the first
    // status write (the prepare does not mind: it is retried).
    let reg = register(&registry.join("gpu.tessera.io-reg.sock")).await;
    assert_eq!(reg.endpoint, plugins.join("gpu.tessera.io/dra.sock"));
    apiserver.put_claim(claim_object("uid-1", "train", "8Gi", "30"));
    apiserver.fail_next(Method::PATCH, 500);
    let first = prepare(&reg.endpoint, "uid-1", "train").await;
    assert_eq!(first.error, "", "log:\n{}", show_log());
    assert_eq!(first.devices.len(), 1);
    let cdi_name = format!("uid-1-{gpu0}");
    assert_eq!(first.devices[0].cdi_device_ids, [format!("tessera.io/claim={cdi_name}")]);
    assert_eq!(
        (first.devices[0].pool_name.as_str(), first.devices[0].device_name.as_str()),
        ("node-a", "gpu-0-shared")
    );
    let held = allocations(&socket).await;
    assert_eq!(held.len(), 1);
    let alloc = &held[0];
    assert_eq!(alloc.owner, "uid-1", "the claim UID owns the allocation");
    assert_eq!((alloc.devices[0].uuid.as_str(), alloc.devices[0].memory_limit_bytes), (gpu0.as_str(), 8 << 30));
    assert_eq!(alloc.devices[0].sm_percent, 30);
    let pod = alloc.container.as_ref().expect("container");
    assert_eq!((pod.pod_namespace.as_str(), pod.pod_name.as_str()), ("ml", "train-pod"));
    let alloc_dir = dir.join("run/alloc").join(&alloc.id);
    assert!(alloc_dir.join("limits").exists());

    // The claim's spec: the CDI name the kubelet got, with the GPU's node, the allocation's
    // directory read-only and its region read-write, the preload, and the shim's env.
    assert_eq!(claim_specs(dir), ["tessera.io-claim_uid-1.json"]);
    let spec_path = dir.join("cdi/tessera.io-claim_uid-1.json");
    let spec_bytes = std::fs::read(&spec_path).expect("the claim's spec");
    let spec: Value = serde_json::from_slice(&spec_bytes).expect("json");
    assert_eq!(spec["kind"], "tessera.io/claim");
    let device = &spec["devices"][0];
    assert_eq!(device["name"], cdi_name.as_str());
    assert_eq!(device["annotations"]["tessera.io/uuid"], gpu0.as_str());
    let edits = &device["containerEdits"];
    let env: Vec<&str> = edits["env"].as_array().expect("env").iter().map(|e| e.as_str().unwrap()).collect();
    for want in [
        format!("TESSERA_ALLOCATION={}", alloc.id),
        "TESSERA_LIMITS=/run/tessera/alloc/limits".into(),
        "TESSERA_REGION=/run/tessera/alloc/region".into(),
    ] {
        assert!(env.contains(&want.as_str()), "{want} in {env:?}");
    }
    assert_eq!(edits["deviceNodes"][0]["path"], "/dev/nvidia0");
    let mounts: Vec<(String, String, String)> = edits["mounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .map(|m| {
            let opts: Vec<&str> = m["options"].as_array().unwrap().iter().map(|o| o.as_str().unwrap()).collect();
            (m["hostPath"].as_str().unwrap().into(), m["containerPath"].as_str().unwrap().into(), opts[0].into())
        })
        .collect();
    let host = |p: &Path| p.display().to_string();
    assert_eq!(
        mounts,
        [
            (host(&alloc_dir), "/run/tessera/alloc".into(), "ro".into()),
            (host(&alloc_dir.join("region")), "/run/tessera/alloc/region".into(), "rw".into()),
            (host(&dir.join("run/hook/ld.so.preload")), "/etc/ld.so.preload".into(), "ro".into()),
        ]
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("run/hook/ld.so.preload")).unwrap(),
        "/usr/lib/tessera/libtessera.so\n"
    );
    let shim = spec["containerEdits"]["mounts"].as_array().expect("spec mounts");
    assert!(shim.iter().any(|m| m["hostPath"] == host(&dir.join("libtessera.so")).as_str()), "{shim:?}");
    // status.devices: what was granted, despite the failed first write.
    let status = status_devices(&apiserver, "train", |d| d.is_array(), &log).await;
    assert_eq!(
        status,
        json!([{"driver": "gpu.tessera.io", "pool": "node-a", "device": "gpu-0-shared",
            "data": {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuStatus", "uuid": gpu0,
                "allocationID": alloc.id, "memory": "8Gi", "sm": 30}}])
    );
    assert!(show_log().contains("cannot write the claim's status.devices; retrying"), "{}", show_log());
    validate_claim_status(&apiserver.claim("ml", "train").expect("claim"));

    // A claim the scheduler should never have placed here (73Gi beside 8Gi of about 80Gi): refused,
    // named, and nothing recorded.
    apiserver.put_claim(claim_object("uid-2", "greedy", "73Gi", "10"));
    let refused = prepare(&reg.endpoint, "uid-2", "greedy").await;
    // 81559 MiB on the simulated H100, 8 GiB of it held.
    assert!(refused.error.contains("has 73367 MiB of 81559 MiB and 70% strict SM left"), "{}", refused.error);
    assert!(refused.error.contains("the claim asks 73 GiB and 10%"), "{}", refused.error);
    assert!(refused.devices.is_empty());
    assert_eq!(allocations(&socket).await.len(), 1);
    assert_eq!(claim_specs(dir), ["tessera.io-claim_uid-1.json"], "no spec for a refused claim");

    // kill -9 between prepare and unprepare, with the spec lost as if the kill came between the
    // record and the spec, and a stray spec of a claim never recorded: the restart writes the
    // same spec again and removes the stray one; the same claim prepares to the same allocation.
    daemon.0.kill().expect("kill -9");
    daemon.0.wait().expect("reap");
    std::fs::remove_file(&spec_path).expect("lose the spec");
    std::fs::write(dir.join("cdi/tessera.io-claim_uid-zombie.json"), &spec_bytes).expect("a stray spec");
    let (daemon2, _) = spawn(&node, &config, &notify, &log);
    let reg = register(&registry.join("gpu.tessera.io-reg.sock")).await;
    assert_eq!(claim_specs(dir), ["tessera.io-claim_uid-1.json"], "log:\n{}", show_log());
    assert_eq!(std::fs::read(&spec_path).expect("written again"), spec_bytes);
    let again = prepare(&reg.endpoint, "uid-1", "train").await;
    assert_eq!(again, first, "log:\n{}", show_log());
    let after = allocations(&socket).await;
    assert_eq!(after.len(), 1, "nothing doubled: {after:?}");
    assert_eq!(after[0].id, alloc.id);
    assert_eq!(after[0].devices[0].memory_limit_bytes, 8 << 30);
    assert_eq!(std::fs::read(&spec_path).expect("the spec"), spec_bytes, "the same spec");
    assert_eq!(claim_specs(dir), ["tessera.io-claim_uid-1.json"]);

    // Unprepare releases it (record, directory, region mount, spec, status entry); a repeat
    // succeeds too.
    assert_eq!(unprepare(&reg.endpoint, "uid-1", "train").await, "");
    assert!(allocations(&socket).await.is_empty());
    assert!(!alloc_dir.exists());
    assert!(mounts_under(&alloc_dir).is_empty(), "{:?}", mounts_under(&alloc_dir));
    assert!(claim_specs(dir).is_empty());
    status_devices(&apiserver, "train", Value::is_null, &log).await;
    assert_eq!(unprepare(&reg.endpoint, "uid-1", "train").await, "");
    // The room is back: the greedy claim fits now.
    assert_eq!(prepare(&reg.endpoint, "uid-2", "greedy").await.error, "");
    drop(daemon2);
}

/// The claim with its `status.devices` validates against the 1.37 schema (kubernetes-validate
/// in target/k8s-validate, as daemon/tests/deploy.rs uses it; SKIP without it).
fn validate_claim_status(claim: &Value) {
    let validator = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/k8s-validate/bin/kubernetes-validate");
    if !validator.is_file() {
        common::skip("kubernetes-validate is not installed (scripts/deps.sh puts it in target/k8s-validate)");
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let check = |obj: &Value| {
        let file = tmp.path().join("claim.json");
        std::fs::write(&file, serde_json::to_vec(obj).expect("json")).expect("write");
        let out = std::process::Command::new(&validator)
            .args(["--strict", "--quiet", "-k", "1.37.0"])
            .arg(&file)
            .output()
            .expect("kubernetes-validate");
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success() && said.trim().is_empty(), said)
    };
    let (ok, said) = check(claim);
    assert!(ok, "{said}\n{claim:#}");
    // The check can fail: a field the schema lacks is refused.
    let mut bad = claim.clone();
    bad["status"]["devices"][0]["bogus"] = json!(1);
    assert!(!check(&bad).0, "a field the schema lacks was accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_fault_takes_its_devices_out_of_the_slice_and_a_reset_brings_them_back() {
    let node = SimNode::with_description(&NODE.replace("count = 1", "count = 2"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let apiserver = ApiServer::start().await;
    let config = dra_config(&node, dir, &apiserver, "[health]\ninterval_seconds = 1\nrecovery_check_ms = 300");
    let (notify, log) = (dir.join("notify.sock"), dir.join("tesserad.log"));
    let (daemon, _) = spawn(&node, &config, &notify, &log);
    let all = ["gpu-0", "gpu-0-shared", "gpu-1", "gpu-1-shared"];
    slice_devices(&apiserver, |n| n == all, &log).await;
    let reg = register(&dir.join("kubelet/plugins_registry/gpu.tessera.io-reg.sock")).await;
    // The resource-health service is named in the registration and streams every device.
    for v in ["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"] {
        assert!(reg.info.supported_versions.iter().any(|s| s == v), "{:?}", reg.info.supported_versions);
    }
    let mut health = watch_health(&reg.endpoint).await;
    let healthy = |m: &HealthMap| m.len() == 4 && m.values().all(|(h, _)| *h == HealthStatus::Healthy);
    health_until(&mut health, healthy).await;

    monitor_started(&log).await;
    let sim = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
    let injected = Instant::now();
    sim.inject_ecc(1, 0, 1).expect("inject a double-bit ECC error on GPU 1");
    let sick = health_until(&mut health, |m| m["gpu-1"].0 == HealthStatus::Unhealthy).await;
    println!("fault to UNHEALTHY on the kubelet's health stream: {} ms", injected.elapsed().as_millis());
    assert_eq!(sick["gpu-1-shared"].0, HealthStatus::Unhealthy, "{sick:?}");
    assert!(sick["gpu-1"].1.contains("ECC"), "the reason is the message: {sick:?}");
    assert_eq!((sick["gpu-0"].0, sick["gpu-0-shared"].0), (HealthStatus::Healthy, HealthStatus::Healthy));
    slice_devices(&apiserver, |n| n == ["gpu-0", "gpu-0-shared"], &log).await;
    // A claim the scheduler placed on it before the fault is refused, saying why.
    let mut stale = claim_object("uid-9", "late", "1Gi", "10");
    stale["status"]["allocation"]["devices"]["results"][0]["device"] = json!("gpu-1-shared");
    apiserver.put_claim(stale);
    let refused = prepare(&reg.endpoint, "uid-9", "late").await;
    assert!(refused.error.contains("gpu-1-shared is unhealthy"), "{}", refused.error);
    assert!(allocations(&dir.join("run/tessera.sock")).await.is_empty());

    sim.reset(1).expect("reset GPU 1");
    health_until(&mut health, healthy).await;
    slice_devices(&apiserver, |n| n == all, &log).await;
    assert_eq!(prepare(&reg.endpoint, "uid-9", "late").await.error, "");
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_mode_both_the_partitioned_gpu_is_the_device_plugins_and_the_other_is_dras() {
    let node = SimNode::with_description(&NODE.replace("count = 1", "count = 2"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let apiserver = ApiServer::start().await;
    let config = mode_config(&node, dir, &apiserver, "both", "[partitions.\"0\"]\nshares = { count = 2 }");
    let (notify, log) = (dir.join("notify.sock"), dir.join("tesserad.log"));
    let mut kubelet = TestKubelet::start(&dir.join("plugins"));
    let (daemon, _) = spawn(&node, &config, &notify, &log);
    slice_devices(&apiserver, |n| n == ["gpu-1", "gpu-1-shared"], &log).await;
    let (share, _) = kubelet.next_registration().await;
    assert_eq!(share.resource_name, "tessera.io/gpu-share");
    let mut plugin = kubelet.connect(&share).await;
    let mut law = plugin.list_and_watch(tessera_proto::deviceplugin::v1beta1::Empty {}).await.expect("ListAndWatch");
    let list = next_list(law.get_mut()).await;
    let mut node_api = common::node_api(&dir.join("run/tessera.sock")).await;
    let devices = node_api.list_devices(api::ListDevicesRequest::default()).await.expect("devices").into_inner();
    let gpu0 = devices.devices.iter().find(|d| d.kind == api::DeviceKind::Gpu as i32 && d.index == 0).expect("GPU 0");
    let ids: Vec<&str> = list.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, [format!("{}::0", gpu0.uuid), format!("{}::1", gpu0.uuid)]);
    // Every plugin binds its socket at start: only the share resource is served (GPU 1 whole,
    // `tessera.io/gpu`, is DRA's).
    let sockets: Vec<String> = std::fs::read_dir(dir.join("plugins"))
        .expect("plugin dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".sock") && n != "kubelet.sock")
        .collect();
    assert_eq!(sockets.len(), 1, "{sockets:?}");
    // A claim naming the device plugin's GPU is refused: this node does not publish it for DRA.
    let reg = register(&dir.join("kubelet/plugins_registry/gpu.tessera.io-reg.sock")).await;
    apiserver.put_claim(claim_object("uid-3", "wrong", "1Gi", "10"));
    let refused = prepare(&reg.endpoint, "uid-3", "wrong").await;
    assert!(refused.error.contains("gpu-0-shared is not published by this node"), "{}", refused.error);
    drop(daemon);
}

/// Device name → the effect of its `gpu.tessera.io/unhealthy` taint (`""`: none), from node-a's
/// slice once `done` accepts it (up to [`WAIT`]).
async fn slice_taints(
    apiserver: &ApiServer,
    done: impl Fn(&std::collections::BTreeMap<String, String>) -> bool,
    log: &Path,
) -> std::collections::BTreeMap<String, String> {
    let deadline = Instant::now() + WAIT;
    loop {
        let taints = apiserver.slices().get("node-a-gpu.tessera.io").map(|s| {
            s["spec"]["devices"]
                .as_array()
                .expect("devices")
                .iter()
                .map(|d| {
                    let effect = d["taints"].as_array().and_then(|t| t.first()).map(|t| {
                        assert_eq!(t["key"], "gpu.tessera.io/unhealthy");
                        assert!(t["timeAdded"].is_string(), "{t}");
                        t["effect"].as_str().unwrap().to_owned()
                    });
                    (d["name"].as_str().unwrap().to_owned(), effect.unwrap_or_default())
                })
                .collect()
        });
        match taints {
            Some(t) if done(&t) => return t,
            t => assert!(
                Instant::now() < deadline,
                "slice taints {t:?}; log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            ),
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Against a 1.37 API server an unhealthy GPU's devices stay in the slice with a NoExecute taint
/// (fallen off the bus), NoSchedule while recovering after the reset, and none once healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_1_36_an_unhealthy_gpu_stays_in_the_slice_with_a_taint() {
    let node = SimNode::with_description(&NODE.replace("count = 1", "count = 2"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let apiserver = ApiServer::start().await;
    apiserver.set_version(1, 37, 0);
    let config = dra_config(&node, dir, &apiserver, "[health]\ninterval_seconds = 1\nrecovery_check_ms = 1500");
    let (notify, log) = (dir.join("notify.sock"), dir.join("tesserad.log"));
    let (daemon, _) = spawn(&node, &config, &notify, &log);
    let clean = |t: &std::collections::BTreeMap<String, String>| t.len() == 4 && t.values().all(String::is_empty);
    slice_taints(&apiserver, clean, &log).await;

    monitor_started(&log).await;
    let sim = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
    sim.inject_xid(1, 79, None, None).expect("GPU 1 falls off the bus");
    let t = slice_taints(&apiserver, |t| t.get("gpu-1").is_some_and(|e| e == "NoExecute"), &log).await;
    assert_eq!(t["gpu-1-shared"], "NoExecute", "{t:?}");
    assert_eq!((t["gpu-0"].as_str(), t["gpu-0-shared"].as_str()), ("", ""), "GPU 0 is untouched: {t:?}");

    sim.reset(1).expect("reset GPU 1");
    let t = slice_taints(&apiserver, |t| t.get("gpu-1").is_some_and(|e| e == "NoSchedule"), &log).await;
    assert_eq!(t["gpu-1-shared"], "NoSchedule", "recovering: {t:?}");
    slice_taints(&apiserver, clean, &log).await;
    drop(daemon);
}

/// A 1.37 API server with the device-taint feature off drops the field: tesserad notices and
/// takes the unhealthy devices out of the slice instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_drops_taints_gets_the_devices_removed() {
    let node = SimNode::with_description(&NODE.replace("count = 1", "count = 2"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let apiserver = ApiServer::start().await;
    apiserver.set_version(1, 37, 0);
    apiserver.drop_taints();
    let config = dra_config(&node, dir, &apiserver, "[health]\ninterval_seconds = 1\nrecovery_check_ms = 300");
    let (notify, log) = (dir.join("notify.sock"), dir.join("tesserad.log"));
    let (daemon, _) = spawn(&node, &config, &notify, &log);
    let all = ["gpu-0", "gpu-0-shared", "gpu-1", "gpu-1-shared"];
    slice_devices(&apiserver, |n| n == all, &log).await;
    monitor_started(&log).await;
    let sim = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
    sim.inject_xid(1, 79, None, None).expect("GPU 1 falls off the bus");
    slice_devices(&apiserver, |n| n == ["gpu-0", "gpu-0-shared"], &log).await;
    sim.reset(1).expect("reset GPU 1");
    slice_devices(&apiserver, |n| n == all, &log).await;
    drop(daemon);
}

/// A claim allocated the dynamic MIG placement `device`.
fn mig_claim(uid: &str, name: &str, device: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ml", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {"deviceClassName": "mig-dynamic.tessera.io"}}]}},
        "status": {
            "allocation": {"devices": {"results": [{"request": "mig", "driver": "gpu.tessera.io",
                "pool": "node-a", "device": device}]}},
            "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"), "uid": format!("{uid}-pod")}]
        }
    })
}

/// GPU 0's GPU instances as the simulator holds them: (profile, start).
fn instances(sim: &tessera_sim_model::Node) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> =
        sim.gpu_instances(0).expect("GPU instances").iter().map(|gi| (gi.profile.name.to_string(), gi.start)).collect();
    out.sort();
    out
}

/// Dynamic MIG end to end: on an H100 with MIG on (an operator's 1g.10gb at slice 0), the pool
/// lists the operator's instance and every placement it does not overlap, against GPU 0's shared
/// counters in a slice of their own (1.37); a claim allocated `gpu-0-mig-3g40gb-4` makes that
/// instance and gets its MIG device's CDI name; kill -9 and a restart: the same answer, still one
/// instance; an overlapping placement is refused naming the instance in the way; unprepare
/// destroys the instance and the operator's stays. Then the state a kill -9 inside prepare leaves
/// (journal entry and instance, no allocation): after a restart the claim gets that instance and
/// no other is made; another claim handed the same placement is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dynamic_mig_placement_is_made_by_prepare_once_across_a_kill_9_and_destroyed_by_unprepare() {
    let node = SimNode::with_description(NODE);
    let sim = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
    sim.set_mig_mode(0, true).expect("MIG on");
    sim.reset(0).expect("reset GPU 0");
    let gi = sim.create_gpu_instance(0, 0, Some(0)).expect("the operator's 1g.10gb");
    sim.create_compute_instance(0, gi.id, 0, None).expect("its compute instance");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let apiserver = ApiServer::start().await;
    apiserver.set_version(1, 37, 0);
    let config = dra_config(&node, dir, &apiserver, "");
    let registry = dir.join("kubelet/plugins_registry");
    let (notify, log) = (dir.join("notify.sock"), dir.join("tesserad.log"));
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let socket = dir.join("run/tessera.sock");
    let (mut daemon, _) = spawn(&node, &config, &notify, &log);

    let pool = |apiserver: &ApiServer| -> Vec<(String, Vec<String>, Vec<String>)> {
        apiserver
            .slices()
            .into_iter()
            .map(|(name, s)| {
                let names = |key: &str| -> Vec<String> {
                    s["spec"][key]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|d| d["name"].as_str().unwrap().into())
                        .collect()
                };
                (name, names("devices"), names("sharedCounters"))
            })
            .collect()
    };
    let deadline = Instant::now() + WAIT;
    while pool(&apiserver).len() < 3 {
        assert!(Instant::now() < deadline, "no pool of 3 slices: {:?}; log:\n{}", pool(&apiserver), show_log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let before = pool(&apiserver);
    let operator = format!("gpu-0-mig-{}-0", gi.id);
    assert_eq!(before[0], ("node-a-gpu.tessera.io".into(), vec![operator.clone()], vec![]), "{before:?}");
    assert_eq!(before[1].0, "node-a-gpu.tessera.io-counters-0");
    assert_eq!(before[1].2, ["gpu-0-counter-set"]);
    let placements = &before[2].1;
    assert_eq!(before[2].0, "node-a-gpu.tessera.io-gpu-0");
    for wanted in ["gpu-0-mig-3g40gb-4", "gpu-0-mig-1g10gb-1", "gpu-0-mig-4g40gb-0"] {
        let present = placements.iter().any(|p| p == wanted);
        assert_eq!(present, wanted != "gpu-0-mig-4g40gb-0", "{wanted} in {placements:?} (slice 0 is the operator's)");
    }
    assert!(!placements.iter().any(|p| p.ends_with("-0")), "nothing overlapping slice 0: {placements:?}");
    let slices = apiserver.slices();
    let set = &slices["node-a-gpu.tessera.io-counters-0"]["spec"]["sharedCounters"][0]["counters"];
    assert!(set.get("memory-slice-0").is_none() && set["memory-slice-1"]["value"] == "1", "{set}");

    let reg = register(&registry.join("gpu.tessera.io-reg.sock")).await;
    apiserver.put_claim(mig_claim("uid-m", "infer", "gpu-0-mig-3g40gb-4"));
    let first = prepare(&reg.endpoint, "uid-m", "infer").await;
    assert_eq!(first.error, "", "log:\n{}", show_log());
    assert_eq!(instances(&sim), [("1g.10gb".to_string(), 0), ("3g.40gb".to_string(), 4)]);
    let held = allocations(&socket).await;
    assert_eq!(held.len(), 1);
    let mig_uuid = held[0].devices[0].uuid.clone();
    assert!(mig_uuid.starts_with("MIG-"), "{mig_uuid}");
    assert_eq!(first.devices[0].cdi_device_ids, [format!("tessera.io/claim=uid-m-{mig_uuid}")]);
    // The claim's spec names the made MIG device, written before the answer.
    let spec = std::fs::read_to_string(dir.join("cdi/tessera.io-claim_uid-m.json")).expect("the claim's spec");
    assert!(spec.contains(&mig_uuid), "{spec}");
    assert_eq!(first.devices[0].device_name, "gpu-0-mig-3g40gb-4");
    // The made instance is its placement device, not also an existing MIG device.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = pool(&apiserver);
    assert_eq!(after[0].1, std::slice::from_ref(&operator), "{after:?}");
    assert!(after[2].1.iter().any(|p| p == "gpu-0-mig-3g40gb-4"));

    // kill -9 after the instance exists; restart; the kubelet asks again: the same instance.
    daemon.0.kill().expect("kill -9");
    daemon.0.wait().expect("reap");
    let (mut daemon2, _) = spawn(&node, &config, &notify, &log);
    let reg = register(&registry.join("gpu.tessera.io-reg.sock")).await;
    let again = prepare(&reg.endpoint, "uid-m", "infer").await;
    assert_eq!(again, first, "log:\n{}", show_log());
    assert_eq!(instances(&sim).len(), 2, "never two");
    assert_eq!(allocations(&socket).await.len(), 1);
    let journal = std::fs::read_to_string(dir.join("state/dra-dynamic-mig.state")).expect("the journal");
    assert!(journal.contains("\"claimUid\": \"uid-m\"") && journal.contains("\"start\": 4"), "{journal}");

    // A placement the GPU cannot host now (it overlaps the instance just made): refused, named.
    apiserver.put_claim(mig_claim("uid-o", "overlap", "gpu-0-mig-1g10gb-5"));
    let refused = prepare(&reg.endpoint, "uid-o", "overlap").await;
    assert!(refused.error.contains("overlaps GPU instance") && refused.error.contains("3g.40gb"), "{}", refused.error);
    assert_eq!(instances(&sim).len(), 2);
    assert_eq!(unprepare(&reg.endpoint, "uid-o", "overlap").await, "");

    // Unprepare: the allocation and the instance go; the operator's stays; twice is fine.
    assert_eq!(unprepare(&reg.endpoint, "uid-m", "infer").await, "", "log:\n{}", show_log());
    assert!(allocations(&socket).await.is_empty());
    assert_eq!(instances(&sim), [("1g.10gb".to_string(), 0)]);
    assert_eq!(unprepare(&reg.endpoint, "uid-m", "infer").await, "");

    // The window a kill -9 can hit inside prepare: the journal entry written and the instance
    // made, no allocation recorded, the kubelet never answered. The kubelet asks again after the
    // restart: that instance is the claim's, none is made beside it.
    daemon2.0.kill().expect("kill -9");
    daemon2.0.wait().expect("reap");
    let gi = sim.create_gpu_instance(0, 2, Some(4)).expect("3g.40gb at slice 4");
    let ci = sim.create_compute_instance(0, gi.id, 2, None).expect("its compute instance");
    let made = sim.gpu(0).expect("GPU 0").mig_uuid(ci.gi_id, ci.id, ci.serial);
    std::fs::write(dir.join("state/dra-dynamic-mig.state"), journal.replace("uid-m", "uid-z")).expect("journal");
    let (daemon3, _) = spawn(&node, &config, &notify, &log);
    let reg = register(&registry.join("gpu.tessera.io-reg.sock")).await;
    apiserver.put_claim(mig_claim("uid-z", "crashed", "gpu-0-mig-3g40gb-4"));
    let answer = prepare(&reg.endpoint, "uid-z", "crashed").await;
    assert_eq!(answer.error, "", "log:\n{}", show_log());
    assert_eq!(answer.devices[0].cdi_device_ids, [format!("tessera.io/claim=uid-z-{made}")]);
    assert_eq!(instances(&sim).len(), 2, "never two");
    assert_eq!(allocations(&socket).await[0].devices[0].uuid, made);
    // Another claim handed the same placement (a stale allocation) is refused, not given it.
    apiserver.put_claim(mig_claim("uid-y", "other", "gpu-0-mig-3g40gb-4"));
    let refused = prepare(&reg.endpoint, "uid-y", "other").await;
    assert!(refused.error.contains("held by claim uid-z"), "{}", refused.error);
    drop(daemon3);
}

/// `(memory, sm)` capacity of `device` in node-a's slice, once it is published.
fn shared_capacity(apiserver: &ApiServer, device: &str) -> Option<(String, String)> {
    let d = apiserver.pool_devices("node-a")?.into_iter().find(|d| d["name"] == device)?;
    let value = |c: &str| d["capacity"][c]["value"].as_str().map(str::to_owned);
    Some((value("memory")?, value("sm")?))
}

/// The node API's own allocations (serverless shares, a GPU given whole) are taken out of the
/// slice: the scheduler sees a GPU it carves from as a shared device with what is left, not as
/// a whole GPU, and one given whole not at all; released, the slice is whole again. A claim on
/// what is left is still prepared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_apis_allocations_are_taken_out_of_the_slice_until_released() {
    let node = SimNode::with_description(&NODE.replace("count = 1", "count = 2"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let apiserver = ApiServer::start().await;
    let config = dra_config(&node, dir, &apiserver, "");
    let (notify, log) = (dir.join("notify.sock"), dir.join("tesserad.log"));
    let socket = dir.join("run/tessera.sock");
    let (daemon, _) = spawn(&node, &config, &notify, &log);
    let all = ["gpu-0", "gpu-0-shared", "gpu-1", "gpu-1-shared"];
    slice_devices(&apiserver, |n| n == all, &log).await;
    let (memory0, sm0) = shared_capacity(&apiserver, "gpu-0-shared").expect("capacity");
    assert_eq!(sm0, "100");
    let total: u64 = memory0.strip_suffix("Mi").expect("MiB").parse().expect("number");
    let _ = common::node_api(&socket).await;

    // 30 GiB and 40% carved from GPU 0: gpu-0 leaves, gpu-0-shared offers the rest.
    let (code, out) = common::tessera(&socket, &["alloc", "--gpu", "0", "--memory", "30GiB", "--sm", "40", "--json"]);
    assert_eq!(code, 0, "{out}");
    let carved: Value = serde_json::from_str(&out).expect("json");
    slice_devices(&apiserver, |n| n == ["gpu-0-shared", "gpu-1", "gpu-1-shared"], &log).await;
    assert_eq!(
        shared_capacity(&apiserver, "gpu-0-shared"),
        Some((format!("{}Mi", total - 30 * 1024), "60".to_string()))
    );
    // GPU 1 given whole: both of its devices leave.
    let (code, out) = common::tessera(&socket, &["alloc", "--whole", "1", "--json"]);
    assert_eq!(code, 0, "{out}");
    let whole: Value = serde_json::from_str(&out).expect("json");
    slice_devices(&apiserver, |n| n == ["gpu-0-shared"], &log).await;

    // A claim on what is left is prepared beside the carved share.
    let reg = register(&dir.join("kubelet/plugins_registry/gpu.tessera.io-reg.sock")).await;
    apiserver.put_claim(claim_object("uid-1", "left", "8Gi", "20"));
    let answer = prepare(&reg.endpoint, "uid-1", "left").await;
    assert_eq!(answer.error, "", "{answer:?}");
    // Its capacity is the scheduler's to count: the slice does not move for it.
    assert_eq!(
        shared_capacity(&apiserver, "gpu-0-shared"),
        Some((format!("{}Mi", total - 30 * 1024), "60".to_string()))
    );

    // Released: the slice is whole again.
    for a in [&carved, &whole] {
        let (code, out) = common::tessera(&socket, &["release", a["id"].as_str().expect("id")]);
        assert_eq!(code, 0, "{out}");
    }
    slice_devices(&apiserver, |n| n == all, &log).await;
    assert_eq!(shared_capacity(&apiserver, "gpu-0-shared"), Some((memory0, "100".to_string())));
    drop(daemon);
}

/// Bad input: a cluster that cannot run DRA. Against an API server older than 1.34, one at 1.37
/// that does not serve resource.k8s.io/v1 (`--runtime-config` turned it off), and one whose Node
/// says its kubelet is 1.31 (no DRA plugin API this driver speaks), tesserad in mode `dra` says
/// which in one log line, publishes no slice and serves no DRA socket, registers the device plugin
/// with the kubelet for every GPU instead (`tessera.io/gpu`), and keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_without_dra_gets_the_device_plugin_and_one_line_saying_why() {
    // (the case, how the cluster is set up, what tesserad's line says)
    type Case = (&'static str, fn(&ApiServer), &'static str);
    let cases: [Case; 3] = [
        ("1.33", |a| a.set_version(1, 33, 2), "the API server is v1.33.2, older than Kubernetes 1.34"),
        (
            "v1 off",
            |a| {
                a.set_version(1, 37, 2);
                a.without_resource_v1();
            },
            "the API server (v1.37.2) does not serve resource.k8s.io/v1",
        ),
        (
            "kubelet 1.31",
            |a| {
                a.set_version(1, 37, 2);
                a.put_node(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
                    "status": {"nodeInfo": {"kubeletVersion": "v1.31.4", "architecture": "amd64", "bootID": "",
                        "containerRuntimeVersion": "containerd://1.7.0", "kernelVersion": "6.1.0",
                        "kubeProxyVersion": "", "machineID": "", "operatingSystem": "linux",
                        "osImage": "Debian", "systemUUID": ""}}}));
            },
            "the kubelet on node node-a is v1.31.4",
        ),
    ];
    for (case, setup, says) in cases {
        let node = SimNode::with_description(NODE);
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        let apiserver = ApiServer::start().await;
        setup(&apiserver);
        let config = dra_config(&node, dir, &apiserver, "");
        let (notify, log) = (dir.join("notify.sock"), dir.join("tesserad.log"));
        let mut kubelet = TestKubelet::start(&dir.join("plugins"));
        let (mut daemon, _) = spawn(&node, &config, &notify, &log);
        let (registered, _) = kubelet.next_registration().await;
        assert_eq!(registered.resource_name, "tessera.io/gpu", "{case}: the device plugin serves the GPU");
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("DRA driver gpu.tessera.io off")).collect();
        assert_eq!(lines.len(), 1, "{case}: one line saying why:\n{text}");
        assert!(
            lines[0].contains(says) && lines[0].contains("the device plugin serves every GPU"),
            "{case}: {}",
            lines[0]
        );
        assert!(daemon.0.try_wait().expect("tesserad").is_none(), "{case}: tesserad keeps running:\n{text}");
        assert!(apiserver.slices().is_empty(), "{case}: no slice published");
        assert!(!dir.join("kubelet/plugins_registry/gpu.tessera.io-reg.sock").exists(), "{case}: no DRA registration");
        drop(daemon);
    }
}
