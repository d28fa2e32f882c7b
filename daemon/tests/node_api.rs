//! The node API and the `tessera` CLI against the built `tesserad` on the simulated node, with
//! the test kubelet: the socket is owner-only; devices, partitions and allocations are reported
//! with their holders; a layout change touches only free devices (a held share refuses its GPU's
//! change and names the holder, a free MIG GPU is re-partitioned, the new resource registers with
//! the kubelet and the old one lists no devices); partition events stream and replay after a
//! restart; a reload applies live keys, reports restart-only ones and rejects a bad file without
//! changing anything; SIGHUP reloads too.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::Duration;

use tessera_proto::deviceplugin::v1beta1::{self as dp, Empty};
use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tessera_sim_testkit::SimNode;
use tonic::transport::Channel;

mod common;

use common::{TestKubelet, WAIT, next_list, spawn, tessera};

/// GPU 0 whole, GPU 1 in MIG mode.
fn node_description() -> String {
    tessera_sim_testkit::describe(1, &[("H100-SXM5-80GB", 1, ""), ("H100-SXM5-80GB", 1, "mig = true")])
}

const SHARE: &str = "tessera.io/gpu-share";
const MIG3: &str = "tessera.io/mig-3g.40gb";
const MIG1: &str = "tessera.io/mig-1g.10gb";

fn config_text(node: &SimNode, dir: &Path, extra: &str) -> String {
    common::config_text(
        node,
        dir,
        &format!(
            "{extra}\n[partitions.\"0\"]\nshares = {{ count = 2 }}\n[partitions.\"1\"]\nmig = {{ \"3g.40gb\" = 2 }}"
        ),
    )
}

async fn client(socket: &Path) -> NodeClient<Channel> {
    common::node_api(socket).await
}

fn mig_layout(profile: &str, count: u32) -> api::GpuLayout {
    api::GpuLayout {
        layout: Some(api::gpu_layout::Layout::Mig(api::MigLayout {
            profiles: vec![api::MigProfileCount { profile: profile.into(), count, shares: None }],
        })),
    }
}

fn shares_layout(count: u32) -> api::GpuLayout {
    api::GpuLayout { layout: Some(api::gpu_layout::Layout::Shares(api::SharesLayout { count, sizes: vec![] })) }
}

fn target(index: u32, layout: api::GpuLayout) -> api::LayoutTarget {
    api::LayoutTarget { gpus: Some(api::layout_target::Gpus::Index(index)), layout: Some(layout) }
}

/// A test's own daemon files: a temporary directory with the configuration (the default, `body`
/// added), and where the socket, the readiness notification and the log go.
struct Files {
    tmp: tempfile::TempDir,
    config: std::path::PathBuf,
    socket: std::path::PathBuf,
    notify: std::path::PathBuf,
    log: std::path::PathBuf,
}

fn files(node: &SimNode, body: &str) -> Files {
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = common::write_config(node, tmp.path(), body);
    let socket = tmp.path().join("run/tessera.sock");
    let (notify, log) = (tmp.path().join("notify"), tmp.path().join("tesserad.log"));
    Files { tmp, config, socket, notify, log }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_api_layout_changes_touch_only_free_devices() {
    let node = SimNode::with_description(&node_description());
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    std::fs::create_dir(dir.join("plugins")).expect("plugin dir");
    let config = dir.join("config.toml");
    std::fs::write(&config, config_text(&node, dir, "")).expect("config");
    let notify_path = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("notify socket");
    notify.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let log = dir.join("tesserad.log");
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();

    let mut kubelet = TestKubelet::start(&dir.join("plugins"));
    let (daemon, _) = spawn(&node, &config, &notify_path, &log);
    let mut regs = std::collections::HashMap::new();
    while regs.len() < 2 {
        let (req, _) = kubelet.next_registration().await;
        regs.insert(req.resource_name.clone(), req);
    }
    let socket = dir.join("run/tessera.sock");
    let mut api = client(&socket).await;
    let mode = std::fs::metadata(&socket).expect("socket").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the node API socket is owner-only");

    // Devices: 2 GPUs, 2 shares of GPU 0, 2 MIG devices of GPU 1.
    let devices = api.list_devices(api::ListDevicesRequest::default()).await.expect("list").into_inner().devices;
    let kinds = |k: api::DeviceKind| devices.iter().filter(|d| d.kind == k as i32).count();
    assert_eq!((kinds(api::DeviceKind::Gpu), kinds(api::DeviceKind::Share), kinds(api::DeviceKind::Mig)), (2, 2, 2));
    let gpu0 =
        devices.iter().find(|d| d.kind == api::DeviceKind::Gpu as i32 && d.index == 0).expect("GPU 0").uuid.clone();
    let gpu1 =
        devices.iter().find(|d| d.kind == api::DeviceKind::Gpu as i32 && d.index == 1).expect("GPU 1").uuid.clone();
    let share = devices.iter().find(|d| d.kind == api::DeviceKind::Share as i32 && d.index == 0).expect("share 0");
    assert_eq!(share.id, format!("{gpu0}::0"));
    assert_eq!(share.resource_name, SHARE);
    assert_eq!(share.cdi_name, format!("tessera.io/share={gpu0}::0"));
    assert_eq!(share.sm_percent, 50);
    let mig = devices.iter().find(|d| d.kind == api::DeviceKind::Mig as i32).expect("a MIG device");
    assert_eq!(mig.mig.as_ref().expect("mig info").profile, "3g.40gb");
    assert_eq!(mig.sm_percent, 42, "3 of 7 compute slices");
    // Unknown filters are errors that name the field.
    let err = api.list_devices(api::ListDevicesRequest { gpu: "7".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(err.message().starts_with("gpu:"), "{}", err.message());

    // The kubelet allocates share 0 of GPU 0.
    let mut plugin = kubelet.connect(&regs[SHARE]).await;
    let alloc_id = common::allocate(&mut plugin, &[&share.id]).await.envs["TESSERA_ALLOCATION"].clone();
    let allocations =
        api.list_allocations(api::ListAllocationsRequest::default()).await.expect("allocations").into_inner();
    assert_eq!(allocations.allocations.len(), 1);
    assert_eq!(allocations.allocations[0].id, alloc_id);
    assert_eq!(allocations.allocations[0].devices[0].kind, api::DeviceKind::Share as i32);
    let held = api
        .list_devices(api::ListDevicesRequest { gpu: "0".into(), ..Default::default() })
        .await
        .expect("list")
        .into_inner()
        .devices;
    let held = held.iter().find(|d| d.id == share.id).expect("share");
    assert_eq!(held.holders.iter().map(|h| h.allocation_id.as_str()).collect::<Vec<_>>(), [alloc_id.as_str()]);

    // Watch MIG-3g's list as the kubelet does: it must empty when GPU 1 is re-partitioned.
    let mut mig3 = kubelet.connect(&regs[MIG3]).await;
    let mut mig3_stream = mig3.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
    assert_eq!(next_list(&mut mig3_stream).await.devices.len(), 2);
    let mut events = api.watch_events(api::WatchEventsRequest::default()).await.expect("watch").into_inner();

    // A dry run changes nothing.
    let dry = api
        .apply_layout(api::ApplyLayoutRequest { targets: vec![target(1, mig_layout("1g.10gb", 7))], dry_run: true })
        .await
        .expect("dry run")
        .into_inner();
    assert!(dry.dry_run);
    assert_eq!(kinds_now(&mut api, api::DeviceKind::Mig).await, 2);

    // GPU 0's shares are held: refused, the holder named. GPU 1 is free: 2 x 3g → 7 x 1g.
    let resp = api
        .apply_layout(api::ApplyLayoutRequest {
            targets: vec![target(0, shares_layout(4)), target(1, mig_layout("1g.10gb", 7))],
            dry_run: false,
        })
        .await
        .expect("apply")
        .into_inner();
    let r0 = resp.results.iter().find(|r| r.gpu_index == 0).expect("GPU 0 result");
    assert_eq!(r0.outcome, api::LayoutOutcome::Refused as i32, "{r0:?}");
    assert_eq!(r0.issues[0].kind, api::LayoutIssueKind::InUse as i32);
    assert_eq!(r0.issues[0].device_id, share.id);
    assert_eq!(r0.issues[0].holders[0].allocation_id, alloc_id);
    let r1 = resp.results.iter().find(|r| r.gpu_index == 1).expect("GPU 1 result");
    assert_eq!(r1.outcome, api::LayoutOutcome::Applied as i32, "{r1:?}\n{}", show_log());
    assert_eq!((r1.created_device_ids.len(), r1.removed_device_ids.len()), (7, 2), "{r1:?}\n{}", show_log());

    // The kubelet hears of it: the new resource registers, the old one lists nothing.
    let (req, _) = kubelet.next_registration().await;
    assert_eq!(req.resource_name, MIG1);
    let mut mig1 = kubelet.connect(&req).await;
    let mut mig1_stream = mig1.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
    assert_eq!(next_list(&mut mig1_stream).await.devices.len(), 7);
    assert_eq!(next_list(&mut mig3_stream).await.devices.len(), 0);
    // The allocation and its share are untouched.
    assert_eq!(kinds_now(&mut api, api::DeviceKind::Share).await, 2);
    let event = tokio::time::timeout(WAIT, events.message()).await.expect("event in time").expect("ok").expect("open");
    assert_eq!(event.kind, api::EventKind::PartitionChanged as i32);
    assert_eq!(event.device_id, r1.gpu_uuid);
    let partitions = api.list_partitions(api::ListPartitionsRequest::default()).await.expect("parts").into_inner();
    let p0 = &partitions.partitions[0];
    assert_eq!(p0.state, api::PartitionState::Converged as i32, "GPU 0 kept its layout: {p0:?}");
    assert_eq!(partitions.partitions[1].device_ids.len(), 7);

    // Malformed requests name the field.
    let err = api
        .apply_layout(api::ApplyLayoutRequest { targets: vec![target(0, shares_layout(0))], dry_run: false })
        .await
        .unwrap_err();
    assert!(err.message().starts_with("targets[0].layout.shares.count"), "{}", err.message());
    let err = api
        .apply_layout(api::ApplyLayoutRequest {
            targets: vec![target(1, mig_layout("1g.10gb", 1)), target(1, mig_layout("3g.40gb", 1))],
            dry_run: false,
        })
        .await
        .unwrap_err();
    assert!(err.message().contains("already named by targets[0]"), "{}", err.message());
    // A UUID in lower case is the GPU (as Allocate matches it); a GPU that is not there is not
    // reported as GPU 0.
    let by_uuid = |u: String| api::LayoutTarget {
        gpus: Some(api::layout_target::Gpus::Uuid(u)),
        layout: Some(mig_layout("1g.10gb", 7)),
    };
    let r = api
        .apply_layout(api::ApplyLayoutRequest { targets: vec![by_uuid(gpu1.to_lowercase())], dry_run: true })
        .await
        .expect("layout")
        .into_inner();
    assert_eq!((r.results[0].gpu_index, r.results[0].gpu_uuid.as_str()), (1, gpu1.as_str()), "{r:?}");
    let r = api
        .apply_layout(api::ApplyLayoutRequest { targets: vec![target(9, mig_layout("1g.10gb", 1))], dry_run: true })
        .await
        .expect("layout")
        .into_inner();
    assert_eq!((r.results[0].gpu_index, r.results[0].gpu_uuid.as_str()), (u32::MAX, ""), "{r:?}");

    // The CLI: the table shows the holder; layout show; a dry run; events replay.
    let (code, text) = tessera(&socket, &["status"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains(&gpu0) && text.contains(&alloc_id) && text.contains("mig 1g.10gb x7"), "{text}");
    let (code, text) = tessera(&socket, &["layout", "apply", "--gpu", "0", "--shares", "4"]);
    assert_eq!(code, 3, "a refused change exits 3: {text}");
    assert!(text.contains("in_use") && text.contains(&alloc_id), "{text}");
    let (code, text) = tessera(&socket, &["events", "--replay", "10"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("partition_changed"), "{text}");

    // Reload: a live key and a restart-only key; then a bad file is rejected and changes nothing.
    std::fs::write(
        &config,
        config_text(&node, dir, "node_api_socket = \"/tmp/elsewhere.sock\"\n[resources]\nshare_placement = \"spread\""),
    )
    .expect("config");
    let r = api.reload(api::ReloadRequest { dry_run: false }).await.expect("reload").into_inner();
    assert_eq!(r.outcome, api::ReloadOutcome::Partial as i32, "{r:?}");
    assert_eq!(r.applied.iter().map(|c| c.key.as_str()).collect::<Vec<_>>(), ["resources.share_placement"]);
    assert_eq!(r.needs_restart.iter().map(|c| c.key.as_str()).collect::<Vec<_>>(), ["node_api_socket"]);
    // The file's layout for GPU 1 (2 x 3g) replaces the API's 7 x 1g: it is free, so it changes back.
    let back = r.layouts.iter().find(|l| l.gpu_index == 1).expect("GPU 1 reloaded");
    assert_eq!(back.outcome, api::LayoutOutcome::Applied as i32, "{back:?}");
    // Again, with the restart-only change still in the file: still only needed, never taken
    // (measured against the file last read, it was taken by the next reload), and the file put
    // back needs nothing.
    let elsewhere = "node_api_socket = \"/tmp/elsewhere.sock\"\n[resources]\nshare_placement = \"packed\"";
    std::fs::write(&config, config_text(&node, dir, elsewhere)).expect("config");
    let r = api.reload(api::ReloadRequest { dry_run: false }).await.expect("reload").into_inner();
    assert_eq!(r.applied.iter().map(|c| c.key.as_str()).collect::<Vec<_>>(), ["resources.share_placement"]);
    assert_eq!(r.needs_restart.iter().map(|c| c.key.as_str()).collect::<Vec<_>>(), ["node_api_socket"], "{r:?}");
    std::fs::write(&config, config_text(&node, dir, "[resources]\nshare_placement = \"packed\"")).expect("config");
    let r = api.reload(api::ReloadRequest { dry_run: false }).await.expect("reload").into_inner();
    assert!(r.needs_restart.is_empty(), "the running value is the file's again: {r:?}");
    std::fs::write(&config, "partitions = 3\n").expect("config");
    let r = api.reload(api::ReloadRequest { dry_run: false }).await.expect("reload").into_inner();
    assert_eq!(r.outcome, api::ReloadOutcome::Rejected as i32);
    assert_eq!(r.errors[0].key, "partitions", "{r:?}");
    assert_eq!(kinds_now(&mut api, api::DeviceKind::Mig).await, 2, "nothing changed");

    // SIGHUP reloads: the file asks GPU 1 for 1 x 7g.
    std::fs::write(&config, config_text(&node, dir, "").replace("\"3g.40gb\" = 2", "\"7g.80gb\" = 1")).expect("config");
    let pid = daemon.0.id().to_string();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status().expect("kill").success());
    let deadline = std::time::Instant::now() + WAIT;
    while kinds_now(&mut api, api::DeviceKind::Mig).await != 1 {
        assert!(std::time::Instant::now() < deadline, "SIGHUP did not reload:\n{}", show_log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = notify.recv(&mut [0u8; 64]);
    drop(daemon);

    // Restart: events replay from disk with their sequence numbers.
    let (mut daemon, _) = spawn(&node, &config, &notify_path, &log);
    let mut api = client(&socket).await;
    let mut replay = api
        .watch_events(api::WatchEventsRequest { replay: 100, ..Default::default() })
        .await
        .expect("watch")
        .into_inner();
    let first = tokio::time::timeout(WAIT, replay.message()).await.expect("in time").expect("ok").expect("open");
    assert_eq!(first.sequence, 1);
    assert_eq!(first.kind, api::EventKind::PartitionChanged as i32);

    // SIGTERM with the event stream still open: the daemon ends the stream and exits cleanly.
    let pid = daemon.0.id().to_string();
    let stopping = std::time::Instant::now();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    loop {
        if let Some(status) = daemon.0.try_wait().expect("wait") {
            assert!(status.success(), "{status:?}\n{}", show_log());
            break;
        }
        assert!(stopping.elapsed() < Duration::from_secs(4), "no exit within 4 s of SIGTERM:\n{}", show_log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("stopped {:?} after SIGTERM with a watcher attached", stopping.elapsed());
    drop(replay);
    let _ = dp::VERSION;
}

async fn kinds_now(api: &mut NodeClient<Channel>, kind: api::DeviceKind) -> usize {
    let list = api
        .list_devices(api::ListDevicesRequest { kinds: vec![kind as i32], ..Default::default() })
        .await
        .expect("list")
        .into_inner();
    list.devices.len()
}

/// Node API Allocates from four clients at once, the daemon killed with SIGKILL while they are in
/// flight: every acknowledged allocation is there after the restart, its directory whole (limits
/// and region), and no GPU was ever over-admitted, before the kill or after it (strict SM: three
/// 30% shares per GPU; the restarted daemon's admission counts the survivors).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_allocations_survive_kill_9_mid_burst_and_never_over_admit() {
    let node = SimNode::new();
    let Files { tmp, config, socket, notify, log } = files(&node, "");
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let ask = || api::AllocateRequest {
        memory_bytes: 1 << 30,
        sm_percent: 30,
        compute_mode: api::ComputeMode::Strict as i32,
        ..Default::default()
    };
    let (mut daemon, _) = spawn(&node, &config, &notify, &log);
    let mut c = client(&socket).await;
    // Warm up to a few, then four clients allocate until refused while the daemon is killed.
    let mut acked: Vec<String> = Vec::new();
    for _ in 0..4 {
        acked.push(c.allocate(ask()).await.expect("allocate").into_inner().allocation.expect("allocation").id);
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (tx, socket) = (tx.clone(), socket.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = client(&socket).await;
            while let Ok(r) = c.allocate(ask()).await {
                // Acknowledged: the answer reached the client.
                let _ = tx.send(r.into_inner().allocation.expect("allocation").id);
            }
        }));
    }
    drop(tx);
    // Kill once a few more were acknowledged, while the others are still asking.
    while acked.len() < 10 {
        match tokio::time::timeout(WAIT, rx.recv()).await {
            Ok(Some(id)) => acked.push(id),
            _ => break,
        }
    }
    daemon.0.kill().expect("SIGKILL");
    daemon.0.wait().expect("reaped");
    for t in tasks {
        t.await.expect("client task");
    }
    while let Ok(id) = rx.try_recv() {
        acked.push(id);
    }
    assert!(acked.len() >= 10, "too few acknowledged before the kill: {}\n{}", acked.len(), show_log());

    let (_daemon, _) = spawn(&node, &config, &notify, &log);
    let mut c = client(&socket).await;
    let list = |c: &mut NodeClient<Channel>| {
        let mut c = c.clone();
        async move {
            c.list_allocations(api::ListAllocationsRequest::default())
                .await
                .expect("allocations")
                .into_inner()
                .allocations
        }
    };
    let found = list(&mut c).await;
    for id in &acked {
        assert!(found.iter().any(|a| &a.id == id), "acknowledged allocation {id} lost in the kill\n{}", show_log());
        let dir = tmp.path().join("run/alloc").join(id);
        let limits = tessera_region::Limits::load(&dir.join("limits")).unwrap_or_else(|e| panic!("{id}: {e}"));
        assert_eq!((limits.devices[0].memory_limit, limits.devices[0].sm_percent), (Some(1 << 30), Some(30)));
        assert!(dir.join("region").exists(), "{id}: no region");
    }
    // Fill what is left: the survivors count, so no GPU ends up with more than three.
    while c.allocate(ask()).await.is_ok() {}
    let after = list(&mut c).await;
    let mut per_gpu = std::collections::BTreeMap::<String, u32>::new();
    for a in &after {
        *per_gpu.entry(a.devices[0].uuid.clone()).or_default() += a.devices[0].sm_percent;
    }
    assert_eq!(per_gpu.len(), 8, "every GPU used: {per_gpu:?}");
    assert!(per_gpu.values().all(|&sm| sm == 90), "strict SM per GPU: {per_gpu:?}");
    assert_eq!(after.len(), 24);
}

/// Shares carved by the node API on a GPU whose file layout is shares, then the journal lost
/// (emptied): the allocations come back from their directories and the GPU keeps its layout.
/// Recovered, they read as the whole GPU held: the layout diverged with an IN_USE issue each,
/// and the kubelet's shares of that GPU were gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn carved_shares_recovered_after_a_journal_loss_keep_their_gpus_layout() {
    let node = SimNode::with_description(&node_description());
    let Files { tmp, config, socket, notify, log } = files(&node, "[partitions.\"0\"]\nshares = { count = 4 }");
    let (daemon, _) = spawn(&node, &config, &notify, &log);
    let mut c = client(&socket).await;
    let ask = api::AllocateRequest { memory_bytes: 1 << 30, sm_percent: 5, gpu: "0".into(), ..Default::default() };
    for _ in 0..2 {
        c.allocate(ask.clone()).await.expect("carve");
    }
    drop(daemon);
    std::fs::OpenOptions::new()
        .write(true)
        .open(tmp.path().join("state/allocations.journal"))
        .expect("journal")
        .set_len(0)
        .expect("emptied");
    let (_daemon, _) = spawn(&node, &config, &notify, &log);
    let mut c = client(&socket).await;
    let allocations = c.list_allocations(api::ListAllocationsRequest::default()).await.expect("list").into_inner();
    assert_eq!(allocations.allocations.len(), 2, "recovered from their directories");
    let parts = c.list_partitions(api::ListPartitionsRequest::default()).await.expect("parts").into_inner();
    let p0 = parts.partitions.iter().find(|p| p.gpu_index == 0).expect("GPU 0");
    assert_eq!(p0.state, api::PartitionState::Converged as i32, "{p0:?}\n{}", std::fs::read_to_string(&log).unwrap());
    assert_eq!(p0.device_ids.len(), 4, "the kubelet's shares are there: {p0:?}");
}

/// `[limits] max_allocations` caps the node API's allocations: past it `Allocate` is refused with
/// RESOURCE_EXHAUSTED naming the key (there was no cap: 10,000 allocations cost 20,000 mounts and
/// two-thirds of a core), and a release makes room again. Calls at once never pass it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_past_max_allocations_is_refused_naming_the_key() {
    let node = SimNode::new();
    let Files { tmp: _tmp, config, socket, notify, log } = files(&node, "[limits]\nmax_allocations = 3");
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let (_daemon, _) = spawn(&node, &config, &notify, &log);
    let mut c = client(&socket).await;
    let ask = || api::AllocateRequest { memory_bytes: 1 << 30, sm_percent: 5, ..Default::default() };
    // Eight clients at once, three each: exactly three allocations are made.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let socket = socket.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = client(&socket).await;
            let mut out = Vec::new();
            for _ in 0..3 {
                out.push(c.allocate(ask()).await.map(|r| r.into_inner().allocation.expect("allocation").id));
            }
            out
        }));
    }
    let mut made = Vec::new();
    for t in tasks {
        for r in t.await.expect("client") {
            match r {
                Ok(id) => made.push(id),
                Err(e) => {
                    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}\n{}", show_log());
                    assert!(e.message().contains("limits.max_allocations"), "{}", e.message());
                }
            }
        }
    }
    assert_eq!(made.len(), 3, "{made:?}\n{}", show_log());
    let err = c.allocate(ask()).await.expect_err("a fourth is refused");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(err.message().starts_with("limits.max_allocations:"), "{}", err.message());
    // The CLI says the same.
    let (code, out) = tessera(&socket, &["alloc", "--memory", "1GiB", "--sm", "5"]);
    assert_ne!(code, 0);
    assert!(out.contains("limits.max_allocations"), "{out}");
    // A release makes room for one.
    let released =
        c.release(api::ReleaseRequest { allocation_id: made[0].clone() }).await.expect("release").into_inner().released;
    assert!(released);
    c.allocate(ask()).await.expect("room again after a release");
    assert_eq!(c.allocate(ask()).await.expect_err("full again").code(), tonic::Code::ResourceExhausted);
}
