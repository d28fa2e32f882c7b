//! The built `tesserad` against the simulated node and the test kubelet: it registers every
//! resource (whole GPUs, shares, MIG devices), lists them, allocates a share (record, directory,
//! answer), is killed with SIGKILL and restarted (re-registers, keeps the allocation, answers the
//! same Allocate with the same id), tells systemd it is ready, and stops on SIGTERM.

use std::collections::HashMap;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::{Duration, Instant};

use tessera_proto::deviceplugin::v1beta1::{
    self as dp, AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreferredAllocationRequest, RegisterRequest,
};
use tessera_region::Limits;
use tessera_sim_testkit::{SimNode, binary};

mod common;

use common::{TestKubelet, next_list, spawn};

const NODE: &str = "numa_nodes = 2
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 1
nvlink = true
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 1
mig = true
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 2
nvlink = true
";

const GPU: &str = "tessera.io/gpu";
const SHARE: &str = "tessera.io/gpu-share";
const MIG: &str = "tessera.io/mig-3g.40gb";

fn sim_status(node: &SimNode) -> serde_json::Value {
    let out = node.command(binary("tessera-sim")).args(["status", "--json"]).output().expect("tessera-sim");
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).expect("status json")
}

/// The registrations of all three resources; the time from spawn to the last one.
async fn registrations(kubelet: &mut TestKubelet, started: Instant) -> (HashMap<String, RegisterRequest>, Duration) {
    let mut seen = HashMap::new();
    let mut last = started;
    while seen.len() < 3 {
        let (req, at) = kubelet.next_registration().await;
        last = last.max(at);
        seen.insert(req.resource_name.clone(), req);
    }
    (seen, last.duration_since(started))
}

async fn list(kubelet: &TestKubelet, req: &RegisterRequest) -> Vec<dp::Device> {
    let mut client = kubelet.connect(req).await;
    let mut stream = client.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
    next_list(&mut stream).await.devices
}

async fn allocate(kubelet: &TestKubelet, req: &RegisterRequest, ids: &[&str]) -> dp::ContainerAllocateResponse {
    common::allocate(&mut kubelet.connect(req).await, ids).await
}

/// The ids of the allocation records on disk (the store's journal, read beside the daemon).
fn records(state: &Path) -> Vec<String> {
    tessera_daemon::state::store::read_records(state).expect("state dir").into_iter().map(|a| a.id).collect()
}

fn notified(sock: &UnixDatagram) -> String {
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf).expect("READY=1 within the timeout");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_allocate_kill9_restart_keeps_the_allocation() {
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let plugins = tmp.path().join("device-plugins");
    let state = tmp.path().join("state");
    let runtime = tmp.path().join("run");
    std::fs::create_dir(&plugins).expect("plugin dir");
    let config = tmp.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "nvml_library = {:?}\ndevice_plugin_dir = {:?}\nstate_dir = {:?}\nruntime_dir = {:?}\n\
             [partitions.default]\nwhole = true\n[partitions.\"0\"]\nshares = {{ count = 4 }}\n\
             [partitions.\"1\"]\nmig = {{ \"3g.40gb\" = 2 }}\n",
            node.nvml_path(),
            plugins,
            state,
            runtime
        ),
    )
    .expect("config");
    let notify_path = tmp.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("notify socket");
    notify.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let log = tmp.path().join("tesserad.log");
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();

    let mut kubelet = TestKubelet::start(&plugins);
    let (mut child, started) = spawn(&node, &config, &notify_path, &log);
    let (seen, took) = registrations(&mut kubelet, started).await;
    println!("first start: all 3 resources registered {took:?} after spawn");
    assert_eq!(notified(&notify), "READY=1", "{}", show_log());
    let mut names: Vec<&str> = seen.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(names, [GPU, SHARE, MIG], "{}", show_log());

    // What the node has.
    let status = sim_status(&node);
    let uuid = |i: usize| status["gpus"][i]["uuid"].as_str().expect("uuid").to_string();
    let memory0 = status["gpus"][0]["memory_total"].as_u64().expect("memory");

    let mut gpus: Vec<String> = list(&kubelet, &seen[GPU]).await.into_iter().map(|d| d.id).collect();
    gpus.sort();
    let mut want = vec![uuid(2), uuid(3)];
    want.sort();
    assert_eq!(gpus, want);
    let shares = list(&kubelet, &seen[SHARE]).await;
    assert_eq!(
        shares.iter().map(|d| d.id.clone()).collect::<Vec<_>>(),
        (0..4).map(|n| format!("{}::{n}", uuid(0))).collect::<Vec<_>>()
    );
    assert!(shares.iter().all(|d| d.health == dp::HEALTHY && d.topology.is_some()));
    let migs = list(&kubelet, &seen[MIG]).await;
    assert_eq!(migs.len(), 2);
    assert!(migs.iter().all(|d| d.id.starts_with("MIG-")), "{migs:?}");

    // Preferred: GPUs 2 and 3 share a NUMA node and NVLink; a request for 2 gets both.
    let mut client = kubelet.connect(&seen[GPU]).await;
    let preferred = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: gpus.clone(),
                must_include_device_i_ds: vec![uuid(3)],
                allocation_size: 2,
            }],
        })
        .await
        .expect("preferred")
        .into_inner();
    assert_eq!(preferred.container_responses[0].device_i_ds, [uuid(3), uuid(2)]);

    // Allocate one share.
    let share = format!("{}::1", uuid(0));
    let a = allocate(&kubelet, &seen[SHARE], &[&share]).await;
    let id = a.envs["TESSERA_ALLOCATION"].clone();
    assert_eq!(a.envs["TESSERA_VISIBLE_DEVICES"], share);
    assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], uuid(0));
    assert_eq!(a.envs["TESSERA_LIMITS"], "/run/tessera/alloc/limits");
    assert_eq!(a.envs["TESSERA_REGION"], "/run/tessera/alloc/region");
    assert_eq!(
        a.cdi_devices.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        [format!("tessera.io/share={share}")]
    );
    // The allocation's directory read-only, its region read-write on top of it.
    assert_eq!(a.mounts.len(), 2);
    assert_eq!((a.mounts[0].container_path.as_str(), a.mounts[0].read_only), ("/run/tessera/alloc", true));
    assert_eq!((a.mounts[1].container_path.as_str(), a.mounts[1].read_only), ("/run/tessera/alloc/region", false));
    let host = Path::new(&a.mounts[0].host_path);
    assert_eq!(host, runtime.join("alloc").join(&id));
    assert_eq!(Path::new(&a.mounts[1].host_path), host.join("region"));
    let limits = Limits::load(&host.join("limits")).expect("limits file");
    assert_eq!(limits.devices.len(), 1);
    assert_eq!(limits.devices[0].uuid, uuid(0));
    assert_eq!(limits.devices[0].memory_limit, Some(((memory0 / 4) >> 20) << 20));
    assert_eq!(limits.devices[0].sm_percent, Some(25));
    assert!(host.join("region").exists());
    assert_eq!(records(&state), [id.as_str()]);
    // Asked again (a retried call): the same allocation.
    let again = allocate(&kubelet, &seen[SHARE], &[&share]).await;
    assert_eq!(again.envs["TESSERA_ALLOCATION"], id);

    // kill -9, restart: re-registers, the record is kept, the same Allocate gets the same id.
    child.0.kill().expect("SIGKILL");
    child.0.wait().expect("reaped");
    let (mut child, started) = spawn(&node, &config, &notify_path, &log);
    let (seen, took) = registrations(&mut kubelet, started).await;
    println!("after kill -9: all 3 resources re-registered {took:?} after spawn (goal: 300 ms)");
    assert_eq!(notified(&notify), "READY=1");
    assert_eq!(records(&state), [id.as_str()], "{}", show_log());
    let after = allocate(&kubelet, &seen[SHARE], &[&share]).await;
    assert_eq!(after.envs["TESSERA_ALLOCATION"], id, "{}", show_log());
    assert_eq!(records(&state), [id.as_str()], "no duplicate");
    // Another share is a new allocation; packing puts it on the same GPU (the only one here).
    let other = allocate(&kubelet, &seen[SHARE], &[&format!("{}::2", uuid(0))]).await;
    assert_ne!(other.envs["TESSERA_ALLOCATION"], id);
    assert_eq!(records(&state).len(), 2);

    // SIGTERM: stops, removes its sockets, exits 0.
    let pid = child.0.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let exit = child.0.wait().expect("exit");
    assert!(exit.success(), "{exit:?}\n{}", show_log());
    for name in [GPU, SHARE, MIG] {
        let sock = plugins.join(tessera_daemon::kubelet::socket_name(name));
        assert!(!sock.exists(), "{} left behind", sock.display());
    }
    let text = show_log();
    assert!(text.contains("registered"), "{text}");
}

/// A kubelet.sock left by a kubelet that is gone (bound, then closed: connecting is refused) must
/// not hold readiness up: READY=1 comes once the node API serves, the wait is logged with its
/// reason, and registration happens in the background once a kubelet listens there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_kubelet_socket_does_not_stall_readiness() {
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = common::write_config(&node, tmp.path(), "[partitions.default]\nwhole = true\n");
    let plugins = tmp.path().join("plugins");
    let kubelet_sock = plugins.join(dp::KUBELET_SOCKET_NAME);
    drop(std::os::unix::net::UnixListener::bind(&kubelet_sock).expect("bind a kubelet.sock"));
    assert!(kubelet_sock.exists(), "the stale socket file stays");
    let notify_path = tmp.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("notify socket");
    notify.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let log = tmp.path().join("tesserad.log");
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();

    let (child, _) = spawn(&node, &config, &notify_path, &log);
    assert_eq!(notified(&notify), "READY=1", "{}", show_log());
    // Serving: the node API answers at once.
    let api = tmp.path().join("run/tessera.sock");
    let status = std::process::Command::new(binary("tessera")).arg("--socket").arg(&api).arg("status").output();
    let status = status.expect("tessera status");
    assert!(status.status.success(), "{}{}", String::from_utf8_lossy(&status.stderr), show_log());
    // Why registration waits, once, with the cause.
    let want = format!("kubelet socket {}: ", kubelet_sock.display());
    let deadline = Instant::now() + Duration::from_secs(20);
    while !show_log().lines().any(|l| l.contains(&want) && l.contains("retrying every 100 ms")) {
        assert!(Instant::now() < deadline, "no line saying why registration waits:\n{}", show_log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = show_log();
    let line = text.lines().find(|l| l.contains(&want)).expect("the line");
    assert!(line.contains("Connection refused") || line.contains("connection refused"), "{line}");
    let gpu_lines = text.lines().filter(|l| l.contains(&want) && l.contains("tessera.io/gpu")).count();
    assert_eq!(gpu_lines, 1, "logged once per reason, not per retry:\n{text}");

    // A kubelet comes up on that path: the plugins register in the background.
    std::fs::remove_file(&kubelet_sock).expect("remove the stale socket");
    let mut kubelet = TestKubelet::start(&plugins);
    let (req, _) = kubelet.next_registration().await;
    assert!(req.resource_name.starts_with("tessera.io/"), "{req:?}");
    drop(child);
}

/// The ids of a list's unhealthy devices.
fn unhealthy(list: &dp::ListAndWatchResponse) -> Vec<String> {
    list.devices.iter().filter(|d| d.health == dp::UNHEALTHY).map(|d| d.id.clone()).collect()
}

/// Lists from `stream` until `done` holds for one (each change of the offer sends one).
async fn list_until(
    stream: &mut tonic::Streaming<dp::ListAndWatchResponse>,
    done: impl Fn(&dp::ListAndWatchResponse) -> bool,
) -> dp::ListAndWatchResponse {
    loop {
        let list = next_list(stream).await;
        if done(&list) {
            return list;
        }
    }
}

/// The node API carves from GPUs and takes MIG devices the kubelet is offered too: the kubelet's
/// free devices left without room are told unhealthy (so the scheduler places no pod that
/// Allocate would refuse), only those and never a pod's own, and healthy again once released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_the_node_api_leaves_no_room_for_are_withdrawn_from_the_kubelet_until_released() {
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let (metrics, config) = common::write_config_with_metrics(
        &node,
        tmp.path(),
        "[partitions.default]\nwhole = true\n\
         [partitions.\"0\"]\nshares = { count = 4 }\n[partitions.\"1\"]\nmig = { \"3g.40gb\" = 2 }\n",
    );
    let mut kubelet = TestKubelet::start(&tmp.path().join("plugins"));
    let notify_path = tmp.path().join("notify.sock");
    let _notify = UnixDatagram::bind(&notify_path).expect("notify socket");
    let log = tmp.path().join("tesserad.log");
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let (child, started) = spawn(&node, &config, &notify_path, &log);
    let (seen, _) = registrations(&mut kubelet, started).await;
    let api = tmp.path().join("run/tessera.sock");
    let mut streams = HashMap::new();
    for name in [SHARE, MIG, GPU] {
        let mut client = kubelet.connect(&seen[name]).await;
        let mut stream = client.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
        let first = next_list(&mut stream).await;
        assert!(unhealthy(&first).is_empty(), "{name}: {first:?}");
        streams.insert(name, (first, stream));
    }
    let status = sim_status(&node);
    let uuid = |i: usize| status["gpus"][i]["uuid"].as_str().expect("uuid").to_string();

    // A pod holds one of GPU 0's four shares (25% each).
    let share0 = streams[SHARE].0.devices[0].id.clone();
    allocate(&kubelet, &seen[SHARE], &[&share0]).await;
    // The node API carves 2 GiB and 10% from GPU 0: one free share no longer fits.
    let (code, out) = common::tessera(&api, &["alloc", "--gpu", "0", "--memory", "2GiB", "--sm", "10", "--json"]);
    assert_eq!(code, 0, "{out}");
    let carved: serde_json::Value = serde_json::from_str(&out).expect("json");
    let (_, stream) = streams.get_mut(SHARE).expect("share stream");
    let list = list_until(stream, |l| !unhealthy(l).is_empty()).await;
    let out_of_room = unhealthy(&list);
    assert_eq!(out_of_room.len(), 1, "{list:?}");
    assert_ne!(out_of_room[0], share0, "a pod's own device is never withdrawn");
    assert!(show_log().contains("withdrawn from the kubelet"), "{}", show_log());
    // The kubelet's other free shares are allocated; the withdrawn one would be refused.
    let kept: Vec<String> =
        list.devices.iter().map(|d| d.id.clone()).filter(|id| *id != share0 && *id != out_of_room[0]).collect();
    for id in &kept {
        allocate(&kubelet, &seen[SHARE], &[id]).await;
    }
    let mut client = kubelet.connect(&seen[SHARE]).await;
    let refused = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: vec![out_of_room[0].clone()] }],
        })
        .await;
    assert!(refused.is_err(), "{refused:?}");

    // A MIG device and a share of a whole GPU (GPU 2) taken by the node API: each withdrawn.
    let (code, out) = common::tessera(&api, &["alloc", "--mig", "3g.40gb", "--json"]);
    assert_eq!(code, 0, "{out}");
    let mig: serde_json::Value = serde_json::from_str(&out).expect("json");
    let (_, stream) = streams.get_mut(MIG).expect("mig stream");
    let list = list_until(stream, |l| !unhealthy(l).is_empty()).await;
    assert_eq!(unhealthy(&list), [mig["devices"][0]["uuid"].as_str().expect("device").to_string()], "{list:?}");
    let (code, out) = common::tessera(&api, &["alloc", "--gpu", "2", "--memory", "1GiB", "--sm", "5", "--json"]);
    assert_eq!(code, 0, "{out}");
    let on_gpu2: serde_json::Value = serde_json::from_str(&out).expect("json");
    let (_, stream) = streams.get_mut(GPU).expect("gpu stream");
    let list = list_until(stream, |l| !unhealthy(l).is_empty()).await;
    assert_eq!(unhealthy(&list), [uuid(2)], "{list:?}");
    // The operator sees the same three: in `tessera status`, its JSON and the metrics.
    let mig_uuid = mig["devices"][0]["uuid"].as_str().expect("device").to_string();
    let mut want = vec![out_of_room[0].clone(), mig_uuid.clone(), uuid(2)];
    want.sort();
    assert_eq!(withdrawn_in_status(&api), want);
    let (code, text) = common::tessera(&api, &["status"]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(text.matches("(withdrawn*)").count(), 3, "{text}");
    assert!(text.contains("3 free device(s) told unhealthy to the kubelet"), "{text}");
    let scraped = common::prometheus::get(metrics, "/metrics").expect("metrics").1;
    for (resource, n) in [(SHARE, 1), (MIG, 1), (GPU, 1)] {
        let line = format!("tessera_kubelet_devices_withdrawn{{resource=\"{resource}\"}} {n}\n");
        assert!(scraped.contains(&line), "{line}{scraped}");
    }

    // kill -9 and a restart: the first lists already leave out what has no room.
    drop(child);
    let (_child, started) = spawn(&node, &config, &notify_path, &log);
    // All three resources again: the carved share on GPU 0 does not cost it its shares layout.
    let (seen, _) = registrations(&mut kubelet, started).await;
    assert!(!show_log().contains("so the GPU keeps its layout"), "{}", show_log());
    for (name, want) in [(SHARE, vec![out_of_room[0].clone()]), (GPU, vec![uuid(2)])] {
        let mut client = kubelet.connect(&seen[name]).await;
        let mut stream = client.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
        let first = next_list(&mut stream).await;
        assert_eq!(unhealthy(&first), want, "{name} after a restart: {first:?}\n{}", show_log());
        streams.insert(name, (first, stream));
    }
    let mut client = kubelet.connect(&seen[MIG]).await;
    let mut stream = client.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
    let first = next_list(&mut stream).await;
    assert_eq!(unhealthy(&first).len(), 1, "{first:?}");
    streams.insert(MIG, (first, stream));
    // A carved share is no layout's: GPU 2 can go to shares and back to whole under it.
    for layout in [&["--shares", "2"][..], &["--whole"][..]] {
        let mut args = vec!["layout", "apply", "--gpu", "2"];
        args.extend_from_slice(layout);
        let (code, out) = common::tessera(&api, &args);
        assert_eq!(code, 0, "{out}\n{}", show_log());
        assert!(out.contains(": applied -> "), "{out}");
    }

    // Released: everything is offered again.
    for a in [&carved, &mig, &on_gpu2] {
        let (code, out) = common::tessera(&api, &["release", a["id"].as_str().expect("id")]);
        assert_eq!(code, 0, "{out}");
    }
    for name in [SHARE, MIG, GPU] {
        let (_, stream) = streams.get_mut(name).expect("stream");
        list_until(stream, |l| unhealthy(l).is_empty()).await;
    }
    assert!(show_log().contains("offered to the kubelet again"), "{}", show_log());
    assert_eq!(withdrawn_in_status(&api), Vec::<String>::new());
    let (_, text) = common::tessera(&api, &["status"]);
    assert!(!text.contains("withdrawn"), "{text}");
    let scraped = common::prometheus::get(metrics, "/metrics").expect("metrics").1;
    assert!(scraped.contains(&format!("tessera_kubelet_devices_withdrawn{{resource=\"{SHARE}\"}} 0\n")), "{scraped}");
}

/// The devices `tessera status --json` marks withdrawn from the kubelet, sorted.
fn withdrawn_in_status(api: &Path) -> Vec<String> {
    let (code, out) = common::tessera(api, &["status", "--json"]);
    assert_eq!(code, 0, "{out}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("json");
    let mut ids: Vec<String> = status["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .filter(|d| d["kubelet_withdrawn"] == true)
        .map(|d| d["id"].as_str().expect("id").to_string())
        .collect();
    ids.sort();
    ids
}

/// A state or runtime directory another user owns (made ahead in a world-writable place) is
/// refused, naming the key: that user could replace the journal, the regions, or the hook's
/// configuration root reads. A path that is a file is named as such. Group- or world-writable
/// directories of the daemon's own are made private.
#[test]
fn directories_another_user_could_change_are_refused() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return common::skip("directories_another_user_could_change_are_refused needs root to chown");
    }
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let config = common::write_config(&node, dir, "");
    let start = || {
        let out = node.command(binary("tesserad")).arg("--config").arg(&config).output().expect("run");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    std::fs::create_dir_all(dir.join("run")).unwrap();
    std::fs::set_permissions(dir.join("run"), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(dir.join("run"), Some(65534), Some(65534)).unwrap();
    let (code, err) = start();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("runtime_dir") && err.contains("owned by uid 65534"), "{err}");
    std::fs::remove_dir(dir.join("run")).unwrap();
    std::fs::write(dir.join("state"), "").unwrap();
    let (code, err) = start();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("state_dir") && err.contains("is not a directory"), "{err}");
    // Its own, but writable by others: made private (then the daemon runs; stopped here).
    std::fs::remove_file(dir.join("state")).unwrap();
    std::fs::create_dir_all(dir.join("run")).unwrap();
    std::fs::set_permissions(dir.join("run"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let _daemon = spawn(&node, &config, &dir.join("no-notify"), &dir.join("tesserad.log"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !dir.join("run/tessera.sock").exists() {
        assert!(Instant::now() < deadline, "tesserad did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(std::fs::metadata(dir.join("run")).unwrap().mode() & 0o777, 0o755);
}

/// Out of file descriptors (a client holding idle connections past the daemon's limit), the node
/// API pauses accepting and says why instead of spinning: the accept loop retried at once and
/// took a whole core. Once the connections go, it serves again.
#[test]
fn out_of_file_descriptors_the_node_api_waits_instead_of_spinning() {
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let config = common::write_config(&node, dir, "");
    common::unmount_at_exit(dir);
    let log = dir.join("tesserad.log");
    // A low descriptor limit, set before exec (as a service manager's LimitNOFILE would be).
    // Killed when the test ends, failed or not.
    let daemon = common::Daemon(
        node.command("prlimit")
            .args(["--nofile=256:256", "--"])
            .arg(binary("tesserad"))
            .arg("--config")
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn tesserad under prlimit"),
    );
    let socket = dir.join("run/tessera.sock");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "tesserad did not start:\n{}", std::fs::read_to_string(&log).unwrap());
        std::thread::sleep(Duration::from_millis(20));
    }
    let held: Vec<_> = (0..400).filter_map(|_| std::os::unix::net::UnixStream::connect(&socket).ok()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let cpu = || {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", daemon.0.id())).expect("stat");
        let fields: Vec<&str> = stat.rsplit_once(')').expect("comm").1.split_whitespace().collect();
        fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
    };
    let before = cpu();
    std::thread::sleep(Duration::from_secs(1));
    let ticks = cpu() - before;
    // Spinning took a whole core (about 100 ticks a second); waiting, a few.
    assert!(ticks < 50, "{ticks} clock ticks of CPU in a second with accepts failing");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("cannot accept connections"), "{text}");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, out) = common::tessera(&socket, &["status"]);
        if code == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the node API did not come back: {out}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Mount points at or below `dir`, as paths relative to it, sorted.
fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = dir.canonicalize().expect("canonical dir");
    let table = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let mut points: Vec<String> = table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter_map(|p| Path::new(p).strip_prefix(&dir).ok().map(|r| r.display().to_string()))
        .collect();
    points.sort();
    points
}

/// A tesserad on `NODE`, as root, with the default configuration in a fresh directory. Fields
/// drop in order: the daemon is killed before its directory goes.
struct RootDaemon {
    daemon: common::Daemon,
    /// Its stderr, `tesserad.log` in the directory.
    log: std::path::PathBuf,
    config: std::path::PathBuf,
    tmp: tempfile::TempDir,
    node: SimNode,
}

/// Starts a [`RootDaemon`]; `None`, with a SKIP line saying `why`, when this is not root.
fn start_as_root(why: &str) -> Option<RootDaemon> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        common::skip(why);
        return None;
    }
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = common::write_config(&node, tmp.path(), "");
    let log = tmp.path().join("tesserad.log");
    let (daemon, _) = spawn(&node, &config, &tmp.path().join("no-notify"), &log);
    Some(RootDaemon { daemon, log, config, tmp, node })
}

/// Stops `daemon` as systemd does (SIGTERM) and waits for its exit.
fn terminate(daemon: &mut common::Daemon) -> std::process::ExitStatus {
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    assert_eq!(unsafe { libc::kill(daemon.0.id() as i32, libc::SIGTERM) }, 0);
    daemon.0.wait().expect("wait")
}

/// A clean stop (SIGTERM) unmounts what no allocation holds: the spare allocation directories'
/// regions (a tmpfs each, and its bind mount) went with the daemon's end, not with the machine's;
/// 16 were left under `runtime_dir` at every stop. An allocation's own region stays mounted, for
/// its container and the next start.
#[test]
fn a_clean_stop_leaves_only_the_allocations_own_mounts() {
    let Some(mut started) =
        start_as_root("a_clean_stop_leaves_only_the_allocations_own_mounts: regions are mounts only as root")
    else {
        return;
    };
    let dir = started.tmp.path();
    let show_log = || std::fs::read_to_string(&started.log).unwrap_or_default();
    let socket = dir.join("run/tessera.sock");
    let deadline = Instant::now() + Duration::from_secs(30);
    let id = loop {
        let (code, out) = common::tessera(&socket, &["alloc", "--memory", "1GiB", "--sm", "10", "--json"]);
        if code == 0 {
            let v: serde_json::Value = serde_json::from_str(&out).expect("json");
            break v["id"].as_str().expect("id").to_owned();
        }
        assert!(Instant::now() < deadline, "no allocation: {out}\n{}", show_log());
        std::thread::sleep(Duration::from_millis(50));
    };
    let own = [format!("run/alloc/{id}/.region"), format!("run/alloc/{id}/region")];
    // The spares are made in the background: wait until some are mounted.
    while !mounts_under(dir).iter().any(|m| m.starts_with("run/spare/")) {
        assert!(Instant::now() < deadline, "no spare mounted: {:?}\n{}", mounts_under(dir), show_log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = terminate(&mut started.daemon);
    assert!(status.success(), "{status:?}\n{}", show_log());
    assert_eq!(mounts_under(dir), own, "{}", show_log());
    assert!(!dir.join("run/spare").exists(), "the spare directories are gone");
}

/// A second tesserad started on the same `runtime_dir` (another `state_dir`) exits saying a
/// running process serves the node API, before it touches anything there: it removed the first
/// one's spare allocation directories (their region mounts with them) on its way to that refusal.
#[test]
fn a_second_daemon_on_the_same_runtime_dir_touches_nothing_of_the_first() {
    let Some(mut first) = start_as_root(
        "a_second_daemon_on_the_same_runtime_dir_touches_nothing_of_the_first: spares are mounts only as root",
    ) else {
        return;
    };
    let dir = first.tmp.path();
    let show_log = || std::fs::read_to_string(&first.log).unwrap_or_default();
    let socket = dir.join("run/tessera.sock");
    // Every spare made (8, a region and its tmpfs each) and the node API answering.
    let deadline = Instant::now() + Duration::from_secs(30);
    let spares = |m: &Vec<String>| m.iter().filter(|m| m.starts_with("run/spare/")).count();
    while spares(&mounts_under(dir)) < 16 || common::tessera(&socket, &["status"]).0 != 0 {
        assert!(Instant::now() < deadline, "spares: {:?}\n{}", mounts_under(dir), show_log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = mounts_under(dir);

    // The second: the same configuration but its own state_dir.
    let text = std::fs::read_to_string(&first.config).expect("config");
    let state = dir.join("state").display().to_string();
    assert!(text.contains(&state), "{text}");
    let second_config = dir.join("second.toml");
    std::fs::write(&second_config, text.replace(&state, &dir.join("state-2").display().to_string())).unwrap();
    let second_log = dir.join("second.log");
    let (mut second, _) = spawn(&first.node, &second_config, &dir.join("no-notify-2"), &second_log);
    let status = second.0.wait().expect("wait");
    let said = std::fs::read_to_string(&second_log).unwrap_or_default();
    assert!(!status.success() && said.contains("a running process serves it"), "{status:?}\n{said}");
    assert_eq!(mounts_under(dir), before, "the first daemon's spares are untouched\n{said}");
    assert_eq!(common::tessera(&socket, &["status"]).0, 0, "the first still serves\n{}", show_log());

    assert!(terminate(&mut first.daemon).success(), "{}", show_log());
}
