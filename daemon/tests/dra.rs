//! The DRA driver's parts against the kubelet's and the API server's real protocols: a test
//! kubelet (plugin watcher + DRAPlugin client from the published protos) and a test API server
//! (REST + watch, conflicts, restarts) that kube-rs talks to unchanged.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::Method;
use serde_json::json;
use tessera_daemon::dra::claims::{ClaimSource, KubeClaims, allocation};
use tessera_daemon::dra::devices::{DraDevice, DraKind, GpuCounters, MigPlacement};
use tessera_daemon::dra::slices::{Publisher, slice_name};
use tessera_daemon::dra::{self, ClaimDriver, ClaimRef, DraPlugin, PreparedDevice};
use tessera_proto::dra::{v1, v1beta1};
use tessera_proto::pluginregistration::v1 as reg;
use tokio::sync::watch;

mod common;

use common::apiserver::ApiServer;
use common::dra_kubelet::{claim, register, v1_client, v1beta1_client};

/// Prepares claims whose name starts with "ok", refuses the others; counts calls per UID.
#[derive(Default)]
struct FakeDriver {
    prepared: Mutex<HashMap<String, u32>>,
    unprepared: Mutex<HashMap<String, u32>>,
}

#[tonic::async_trait]
impl ClaimDriver for FakeDriver {
    async fn prepare(&self, c: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        *self.prepared.lock().unwrap().entry(c.uid.clone()).or_default() += 1;
        if !c.name.starts_with("ok") {
            return Err(format!("claim {} refused", c.name));
        }
        Ok(vec![PreparedDevice {
            requests: vec!["gpu".into()],
            pool: "node-a".into(),
            device: "gpu-0".into(),
            cdi_device_ids: vec!["tessera.io/gpu=GPU-0".into()],
        }])
    }

    async fn unprepare(&self, c: &ClaimRef) -> Result<(), String> {
        *self.unprepared.lock().unwrap().entry(c.uid.clone()).or_default() += 1;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_registers_the_driver_and_prepares_claims_per_claim_in_v1_and_v1beta1() {
    let dir = tempfile::tempdir().unwrap();
    let (plugins, registry) = (dir.path().join("plugins"), dir.path().join("plugins_registry"));
    std::fs::create_dir_all(&registry).unwrap();
    let driver = Arc::new(FakeDriver::default());
    let plugin = DraPlugin::new(&plugins, driver.clone());
    let mut status = plugin.registration_status();
    let (stop_tx, stop_rx) = watch::channel(false);
    let server = tokio::spawn(plugin.serve(registry.clone(), stop_rx));

    // The plugin watcher's view.
    let socket = registry.join(dra::REGISTRATION_SOCKET);
    let r = register(&socket).await;
    assert_eq!(r.info.r#type, reg::DRA_PLUGIN);
    assert_eq!(r.info.name, "gpu.tessera.io");
    assert_eq!(r.info.supported_versions, ["v1.DRAPlugin", "v1beta1.DRAPlugin"]);
    assert_eq!(r.endpoint, plugins.join("gpu.tessera.io/dra.sock"));
    tokio::time::timeout(common::WAIT, status.wait_for(|s| s.is_some())).await.unwrap().unwrap();
    assert_eq!(*status.borrow(), Some((true, String::new())));
    // Owner-only sockets: only root (the kubelet) may call.
    use std::os::unix::fs::PermissionsExt;
    for s in [&socket, &r.endpoint] {
        assert_eq!(std::fs::metadata(s).unwrap().permissions().mode() & 0o777, 0o600, "{}", s.display());
    }

    // v1: one good claim and one refused one; each gets its own entry, the call succeeds.
    let mut client = v1_client(&r.endpoint).await;
    let answer = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim("ml", "uid-ok", "ok-train"), claim("ml", "uid-bad", "bad")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims.len(), 2);
    let ok = &answer.claims["uid-ok"];
    assert_eq!(ok.error, "");
    assert_eq!(ok.devices.len(), 1);
    assert_eq!(ok.devices[0].cdi_device_ids, ["tessera.io/gpu=GPU-0"]);
    assert_eq!((ok.devices[0].pool_name.as_str(), ok.devices[0].device_name.as_str()), ("node-a", "gpu-0"));
    assert_eq!(answer.claims["uid-bad"].error, "claim bad refused");
    assert!(answer.claims["uid-bad"].devices.is_empty());
    // A claim without a name is refused by the plugin itself, naming what is missing.
    let answer = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![claim("ml", "uid-x", "")] })
        .await
        .unwrap()
        .into_inner();
    assert!(answer.claims["uid-x"].error.contains("namespace and name are required"));
    assert!(!driver.prepared.lock().unwrap().contains_key("uid-x"));

    // v1beta1 (older kubelets): the same answers through the other package.
    let mut beta = v1beta1_client(&r.endpoint).await;
    let ok = v1beta1::Claim { namespace: "ml".into(), uid: "uid-ok".into(), name: "ok-train".into() };
    let prepared = beta.node_prepare_resources(v1beta1::NodePrepareResourcesRequest { claims: vec![ok.clone()] });
    let answer = prepared.await.unwrap().into_inner();
    assert_eq!(answer.claims["uid-ok"].devices[0].cdi_device_ids, ["tessera.io/gpu=GPU-0"]);
    let unprepared = beta.node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest { claims: vec![ok] });
    let answer = unprepared.await.unwrap().into_inner();
    assert_eq!(answer.claims["uid-ok"].error, "");
    assert_eq!(driver.prepared.lock().unwrap()["uid-ok"], 2);
    assert_eq!(driver.unprepared.lock().unwrap()["uid-ok"], 1);

    // The kubelet removing the registration socket (its plugin watcher cleaning up): the plugin
    // binds it again and can be registered again.
    std::fs::remove_file(&socket).unwrap();
    let again = register(&socket).await;
    assert_eq!(again.info.name, "gpu.tessera.io");

    stop_tx.send(true).unwrap();
    tokio::time::timeout(common::WAIT, server).await.unwrap().unwrap().unwrap();
    assert!(!socket.exists() && !r.endpoint.exists(), "sockets removed at shutdown");
}

fn gpu(index: u32, kind: DraKind) -> DraDevice {
    let name = match &kind {
        DraKind::Gpu => format!("gpu-{index}"),
        DraKind::Shared => format!("gpu-{index}-shared"),
        DraKind::Mig { gi, ci, .. } => format!("gpu-{index}-mig-{gi}-{ci}"),
        DraKind::MigPlacement(p) => format!("gpu-{index}-mig-{}-{}", p.profile, p.start),
    };
    DraDevice {
        name,
        kind,
        uuid: format!("GPU-{index}"),
        gpu_index: index,
        gpu_uuid: format!("GPU-{index}"),
        product: "NVIDIA H100 80GB HBM3".into(),
        memory: 80 << 30,
        sm: 100,
        driver_version: "550.54.15".into(),
        cuda_driver_version: "12.4".into(),
        numa_node: Some(0),
        pci_bus_id: format!("00000000:{:02X}:00.0", index + 0x18),
        health: Default::default(),
    }
}

/// The test API server answering as Kubernetes `version` (major, minor, patch), and a client of it
/// through a kubeconfig in `dir`.
async fn api_server_at(dir: &Path, (major, minor, patch): (u32, u32, u32)) -> (ApiServer, kube::Client) {
    let api = ApiServer::start().await;
    api.set_version(major, minor, patch);
    let client = tessera_daemon::kube_client::connect(Some(&api.kubeconfig(dir))).await.unwrap();
    (api, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_read_through_kube_rs_from_the_api_server() {
    let dir = tempfile::tempdir().unwrap();
    let api = ApiServer::start().await;
    let client = tessera_daemon::kube_client::connect(Some(&api.kubeconfig(dir.path()))).await.unwrap();
    api.put_claim(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "ml", "uid": "uid-1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share.tessera.io"}}]}},
        "status": {"allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.io",
            "pool": "node-a", "device": "gpu-0-shared", "consumedCapacity": {"memory": "8Gi", "sm": "30"}}]}}}
    }));
    let claims = KubeClaims::new(client);
    let r = ClaimRef { namespace: "ml".into(), uid: "uid-1".into(), name: "train".into() };
    let rc = claims.read(&r).await.unwrap();
    let a = allocation(&rc, &r, "node-a").unwrap();
    assert_eq!(a.devices[0].consumed, BTreeMap::from([("memory".into(), 8 << 30), ("sm".into(), 30)]));
    assert!(api.requests().contains(&"GET /apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/train".into()));
    let missing = ClaimRef { name: "gone".into(), ..r.clone() };
    let e = claims.read(&missing).await.unwrap_err();
    assert_eq!(e, "ResourceClaim ml/gone does not exist (deleted?)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slice_is_created_updated_on_change_cleaned_and_retried_through_conflicts_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    // 1.35: one slice of every device (1.34's layout, shared devices alone, is tested below),
    // and unhealthy devices leave it (taints from 1.36).
    let (mut api, client) = api_server_at(dir.path(), (1, 35, 4)).await;
    let node = "node-a";
    // A slice left by an earlier layout of this node, and another node's: only ours goes.
    for (name, n) in [("node-a-old", node), ("node-b-gpu.tessera.io", "node-b")] {
        api.put_slice(json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name}, "spec": {"driver": "gpu.tessera.io", "nodeName": n,
            "pool": {"name": n, "generation": 0, "resourceSliceCount": 1}, "devices": []}}));
    }
    let devices = vec![gpu(0, DraKind::Gpu), gpu(0, DraKind::Shared), gpu(1, DraKind::Gpu), gpu(1, DraKind::Shared)];
    let publisher = Publisher::new(client.clone(), node);
    let s = publisher.sync(&devices).await.unwrap();
    assert!(s.created && !s.updated && s.deleted == 1, "{s:?}");
    let slices = api.slices();
    assert!(!slices.contains_key("node-a-old") && slices.contains_key("node-b-gpu.tessera.io"));
    let ours = &slices[&slice_name(node)];
    assert_eq!(ours["spec"]["pool"], json!({"name": "node-a", "generation": 0, "resourceSliceCount": 1}));
    let names: Vec<&str> =
        ours["spec"]["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["gpu-0", "gpu-0-shared", "gpu-1", "gpu-1-shared"]);
    let shared = &ours["spec"]["devices"][1];
    assert_eq!(shared["allowMultipleAllocations"], true);
    assert_eq!(shared["capacity"]["memory"]["value"], "80Gi");
    assert_eq!(shared["capacity"]["sm"]["value"], "100");
    assert_eq!(shared["capacity"]["sm"]["requestPolicy"]["validRange"], json!({"min": "1", "max": "100", "step": "1"}));
    assert_eq!(shared["attributes"]["architecture"], json!({"string": "Hopper"}));
    assert_eq!(shared["attributes"]["cudaComputeCapability"], json!({"version": "9.0.0"}));
    // Nothing changed: nothing written.
    let writes = |api: &ApiServer| api.requests().iter().filter(|r| !r.starts_with("GET")).count();
    let before = writes(&api);
    assert_eq!(publisher.sync(&devices).await.unwrap(), Default::default());
    assert_eq!(writes(&api), before);

    // The run loop: a health change removes GPU 1's devices; a conflict and an API server
    // restart on the way are retried until the slice says so.
    let (dev_tx, dev_rx) = watch::channel(devices.clone());
    let (stop_tx, stop_rx) = watch::channel(false);
    let (synced_tx, mut synced) = watch::channel(0u64);
    let task = tokio::spawn(Publisher::new(client, node).run(dev_rx, stop_rx, synced_tx));
    tokio::time::timeout(common::WAIT, synced.wait_for(|n| *n >= 1)).await.unwrap().unwrap();
    api.fail_next(Method::PUT, 409);
    api.fail_next(Method::GET, 500);
    let mut sick = devices.clone();
    for d in sick.iter_mut().filter(|d| d.gpu_index == 1) {
        d.health = tessera_daemon::device_health::Health::Unhealthy("XID 79".into());
    }
    dev_tx.send(sick.clone()).unwrap();
    let devices_now = |api: &ApiServer| -> Vec<String> {
        api.slices()[&slice_name(node)]["spec"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let deadline = std::time::Instant::now() + common::WAIT;
    while devices_now(&api) != ["gpu-0", "gpu-0-shared"] {
        assert!(std::time::Instant::now() < deadline, "unhealthy devices still published: {:?}", devices_now(&api));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(api.slices()[&slice_name(node)]["spec"]["pool"]["generation"], 1, "a change bumps the generation");
    // Recovery while the API server is down: published once it is back.
    api.stop().await;
    dev_tx.send(devices.clone()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    api.restart().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while devices_now(&api).len() != 4 {
        assert!(std::time::Instant::now() < deadline, "recovered devices not published after the restart");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(api.slices()[&slice_name(node)]["spec"]["pool"]["generation"], 2);
    stop_tx.send(true).unwrap();
    tokio::time::timeout(common::WAIT, task).await.unwrap().unwrap();
}

/// The publisher watches its slices between changes: a slice another writer deletes or edits is
/// put back at once (the watch sees it; a periodic check would take a minute), and a quiet slice
/// costs watches, not lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publisher_puts_back_a_slice_someone_deletes_or_edits_without_polling() {
    let dir = tempfile::tempdir().unwrap();
    let (api, client) = api_server_at(dir.path(), (1, 35, 4)).await;
    let node = "node-a";
    let devices = vec![gpu(0, DraKind::Gpu), gpu(0, DraKind::Shared)];
    let (_dev_tx, dev_rx) = watch::channel(devices.clone());
    let (stop_tx, stop_rx) = watch::channel(false);
    let (synced_tx, mut synced) = watch::channel(0u64);
    let task = tokio::spawn(Publisher::new(client, node).run(dev_rx, stop_rx, synced_tx));
    tokio::time::timeout(common::WAIT, synced.wait_for(|n| *n >= 1)).await.unwrap().unwrap();
    let name = slice_name(node);
    let names = |api: &ApiServer| -> Option<Vec<String>> {
        api.slices().get(&name).map(|s| {
            s["spec"]["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_owned()).collect()
        })
    };
    let ours = Some(vec!["gpu-0".to_string(), "gpu-0-shared".to_string()]);
    let until_ours = |what: &'static str| {
        let api = &api;
        let ours = ours.clone();
        async move {
            let deadline = std::time::Instant::now() + common::WAIT;
            while names(api) != ours {
                assert!(std::time::Instant::now() < deadline, "not put back after {what}: {:?}", names(api));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    until_ours("the start").await;

    // Deleted by someone else: back.
    assert!(api.delete_slice(&name));
    until_ours("a deletion").await;
    // Edited by someone else (a device gone, as a stale writer would leave it): back.
    let mut edited = api.slices()[&name].clone();
    edited["spec"]["devices"].as_array_mut().unwrap().truncate(1);
    api.put_slice(edited);
    assert_eq!(names(&api).map(|n| n.len()), Some(1));
    until_ours("an edit").await;

    // Quiet: watched, not listed again.
    let lists =
        |api: &ApiServer| api.requests().iter().filter(|r| *r == "GET /apis/resource.k8s.io/v1/resourceslices").count();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (before, watches_before) = (lists(&api), api.requests().iter().filter(|r| r.starts_with("WATCH")).count());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(lists(&api), before, "a quiet slice is not listed again");
    let watches = api.requests().iter().filter(|r| r.starts_with("WATCH")).count();
    assert!(watches > watches_before, "the publisher keeps watching ({watches_before} → {watches})");
    stop_tx.send(true).unwrap();
    tokio::time::timeout(common::WAIT, task).await.unwrap().unwrap();
}

/// GPU `index`'s placement of `profile` at `start` (dynamic MIG), as the node publishes it.
fn placement(index: u32, profile: &str, profile_id: u32, start: u32, size: u32, sms: u32) -> DraDevice {
    let counters = GpuCounters {
        name: format!("gpu-{index}-counter-set"),
        memory: 81_152 << 20,
        multiprocessors: 132,
        memory_slices: (0..8).collect(),
    };
    DraDevice {
        name: format!("gpu-{index}-mig-{}-{start}", profile.replace('.', "")),
        kind: DraKind::MigPlacement(MigPlacement {
            profile: profile.into(),
            profile_id,
            start,
            size,
            multiprocessors: sms,
            counters,
        }),
        memory: 40_448 << 20,
        ..gpu(index, DraKind::Gpu)
    }
}

/// The slice names of node-a's pool and, per slice, (devices, counter sets).
fn pool_of(api: &ApiServer) -> BTreeMap<String, (usize, usize)> {
    api.slices()
        .into_iter()
        .filter(|(_, s)| s["spec"]["nodeName"] == "node-a")
        .map(|(name, s)| {
            let n = |key: &str| s["spec"][key].as_array().map_or(0, Vec::len);
            (name, (n("devices"), n("sharedCounters")))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placements_are_laid_out_by_the_api_servers_version_and_follow_an_upgrade() {
    let dir = tempfile::tempdir().unwrap();
    let (mut api, client) = api_server_at(dir.path(), (1, 34, 2)).await;
    let devices = vec![
        gpu(0, DraKind::Gpu),
        gpu(0, DraKind::Shared),
        placement(1, "3g.40gb", 9, 0, 4, 60),
        placement(1, "3g.40gb", 9, 4, 4, 60),
        placement(2, "3g.40gb", 9, 0, 4, 60),
    ];
    let publisher = Publisher::new(client, "node-a");
    let s = publisher.sync(&devices).await.unwrap();
    assert!(s.created, "{s:?}");
    // 1.34: each GPU's counter set in the slice of the devices that consume it.
    // And the shared device alone in a slice (kube-scheduler 1.34 checks a request's capacity
    // against the device at the request's index in the slice, not the one it allocates).
    let combined = BTreeMap::from([
        (slice_name("node-a"), (1, 0)),
        (format!("{}-gpu-1", slice_name("node-a")), (2, 1)),
        (format!("{}-gpu-2", slice_name("node-a")), (1, 1)),
        (format!("{}-shared-0", slice_name("node-a")), (1, 0)),
    ]);
    assert_eq!(pool_of(&api), combined);
    let slices = api.slices();
    let gpu1 = &slices[&format!("{}-gpu-1", slice_name("node-a"))];
    assert_eq!(gpu1["spec"]["pool"], json!({"name": "node-a", "generation": 0, "resourceSliceCount": 4}));
    assert_eq!(gpu1["spec"]["sharedCounters"][0]["name"], "gpu-1-counter-set");
    assert_eq!(gpu1["spec"]["sharedCounters"][0]["counters"]["memory-slice-7"], json!({"value": "1"}));
    let d = &gpu1["spec"]["devices"][1];
    assert_eq!(d["name"], "gpu-1-mig-3g40gb-4");
    assert_eq!(d["consumesCounters"][0]["counterSet"], "gpu-1-counter-set");
    assert_eq!(d["consumesCounters"][0]["counters"]["memory-slice-4"], json!({"value": "1"}));
    assert_eq!(d["attributes"]["placementStart"], json!({"int": 4}));
    assert!(api.requests().contains(&"GET /version".to_string()), "the version was asked");
    assert_eq!(publisher.sync(&devices).await.unwrap(), Default::default(), "nothing changed");

    // The API server is upgraded to 1.36 (a restart): the next pass moves the counter sets to a
    // slice of their own, every slice at the next generation, nothing left of the old layout.
    api.set_version(1, 36, 0);
    api.restart().await;
    let s = publisher.sync(&devices).await.unwrap();
    assert!(s.created && s.updated, "{s:?}");
    let separate = BTreeMap::from([
        (slice_name("node-a"), (2, 0)),
        (format!("{}-gpu-1", slice_name("node-a")), (2, 0)),
        (format!("{}-gpu-2", slice_name("node-a")), (1, 0)),
        (format!("{}-counters-0", slice_name("node-a")), (0, 2)),
    ]);
    assert_eq!(pool_of(&api), separate);
    for s in api.slices().values() {
        assert_eq!(s["spec"]["pool"]["generation"], 1);
        assert_eq!(s["spec"]["pool"]["resourceSliceCount"], 4);
        let has = |k: &str| s["spec"].get(k).is_some_and(|v| !v.is_null());
        assert!(!(has("devices") && has("sharedCounters")), "never both in one slice: {s:#}");
    }
    // Back to 1.34 (a downgrade): the counters go back beside their devices, the counter slice goes.
    api.set_version(1, 34, 0);
    let s = publisher.sync(&devices).await.unwrap();
    assert_eq!(s.deleted, 1, "{s:?}");
    assert_eq!(pool_of(&api), combined);
}
