//! Health checking against the built `tesserad` on the simulated node, with the test kubelet and
//! the node API: faults are injected into the node (the sim model, as `tessera-sim inject` does)
//! and must reach the kubelet's ListAndWatch and the event stream:
//!
//! - an application XID is attributed to the container holding the GPU, which stays healthy;
//! - a fatal XID, a double-bit ECC error and a lost GPU make the GPU unhealthy at once
//!   (latencies printed), with `Fault` and `HealthChanged` events;
//! - after `reset`, the ECC and lost GPUs are `RECOVERING`, then healthy again (a `Recovery`
//!   event with the downtime); the fatal XID that left no reset evidence stays out of service;
//! - under MIG, an XID naming an instance affects only that MIG device, a GPU-wide one all;
//! - the liveness probe finds a lost GPU without any event;
//! - SIGTERM stops the daemon (and its health thread) promptly.

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::{Duration, Instant};

use tessera_proto::deviceplugin::v1beta1::{self as dp, AllocateRequest, ContainerAllocateRequest, Empty};
use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tessera_sim_testkit::SimNode;
use tonic::transport::Channel;

mod common;

use common::{TestKubelet, WAIT, next_list, spawn};

/// What the test allows a fault to take to reach ListAndWatch (the goal is 100 ms; the margin
/// is for a loaded CI machine). Measured values are printed.
const LATENCY_LIMIT: Duration = Duration::from_secs(1);
const RECOVERY_CHECK_MS: u64 = 300;

fn config_text(node: &SimNode, dir: &Path, partitions: &str) -> String {
    common::config_text(
        node,
        dir,
        &format!("[health]\ninterval_seconds = 1\nrecovery_check_ms = {RECOVERY_CHECK_MS}\n{partitions}"),
    )
}

fn sim_model(node: &SimNode) -> tessera_sim_model::Node {
    tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("open the sim node")
}

async fn client(socket: &Path) -> NodeClient<Channel> {
    common::node_api(socket).await
}

/// Reads ListAndWatch until device `id` has `health`; returns when that list arrived.
async fn until_health(
    stream: &mut tonic::Streaming<dp::ListAndWatchResponse>,
    id: &str,
    health: &str,
) -> (dp::ListAndWatchResponse, Instant) {
    loop {
        let list = next_list(stream).await;
        let at = Instant::now();
        if list.devices.iter().any(|d| d.id == id && d.health == health) {
            return (list, at);
        }
    }
}

fn health_of(list: &dp::ListAndWatchResponse, id: &str) -> String {
    list.devices.iter().find(|d| d.id == id).map(|d| d.health.clone()).unwrap_or_default()
}

/// Reads events until one matches.
async fn expect_event(
    events: &mut tonic::Streaming<api::Event>,
    what: &str,
    want: impl Fn(&api::Event) -> bool,
) -> api::Event {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let e = tokio::time::timeout(left, events.message())
            .await
            .unwrap_or_else(|_| panic!("no event {what} in time"))
            .expect("event stream ok")
            .expect("event stream open");
        if want(&e) {
            return e;
        }
    }
}

/// Waits for `device`'s health change event, and checks that it went from `from` to `to`.
async fn expect_change(events: &mut tonic::Streaming<api::Event>, device: &str, from: api::Health, to: api::Health) {
    let e = expect_event(events, &format!("{device} {to:?}"), |e| e.device_id == device && change(e).is_some()).await;
    assert_eq!(change(&e), Some((from, to)), "{device}");
}

/// Waits for `device`'s recovery event: its recovery.
async fn expect_recovery(events: &mut tonic::Streaming<api::Event>, device: &str) -> api::Recovery {
    let e =
        expect_event(events, &format!("{device} recovery"), |e| e.device_id == device && recovery(e).is_some()).await;
    recovery(&e).cloned().unwrap()
}

fn fault(e: &api::Event) -> Option<&api::Fault> {
    match &e.detail {
        Some(api::event::Detail::Fault(f)) => Some(f),
        _ => None,
    }
}

fn change(e: &api::Event) -> Option<(api::Health, api::Health)> {
    match &e.detail {
        Some(api::event::Detail::HealthChange(h)) => Some((h.previous(), h.current())),
        _ => None,
    }
}

fn recovery(e: &api::Event) -> Option<&api::Recovery> {
    match &e.detail {
        Some(api::event::Detail::Recovery(r)) => Some(r),
        _ => None,
    }
}

async fn watch_health_events(api: &mut NodeClient<Channel>) -> tonic::Streaming<api::Event> {
    let kinds = [api::EventKind::Fault, api::EventKind::Recovery, api::EventKind::HealthChanged];
    api.watch_events(api::WatchEventsRequest {
        replay: 0,
        kinds: kinds.map(|k| k as i32).to_vec(),
        device_id: String::new(),
    })
    .await
    .expect("watch events")
    .into_inner()
}

async fn allocate(
    plugin: &mut dp::device_plugin_client::DevicePluginClient<Channel>,
    api: &mut NodeClient<Channel>,
    id: &str,
) -> String {
    plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: vec![id.into()] }],
        })
        .await
        .expect("allocate");
    let allocs = api
        .list_allocations(api::ListAllocationsRequest { device_id: id.into(), ..Default::default() })
        .await
        .expect("list allocations")
        .into_inner()
        .allocations;
    assert_eq!(allocs.len(), 1, "one allocation holds {id}");
    allocs[0].id.clone()
}

async fn device_health(api: &mut NodeClient<Channel>, id: &str) -> (api::Health, String) {
    let devices =
        api.list_devices(api::ListDevicesRequest::default()).await.expect("list devices").into_inner().devices;
    let d = devices.iter().find(|d| d.id == id).unwrap_or_else(|| panic!("device {id} listed"));
    (d.health(), d.health_reason.clone())
}

/// The devices of `kind` the node API lists, by index.
async fn listed(api: &mut NodeClient<Channel>, kind: api::DeviceKind) -> Vec<api::Device> {
    let req = api::ListDevicesRequest { kinds: vec![kind as i32], ..Default::default() };
    let mut devices = api.list_devices(req).await.expect("list").into_inner().devices;
    devices.sort_by_key(|d| d.index);
    devices
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct Started {
    _tmp: tempfile::TempDir,
    daemon: common::Daemon,
    log: std::path::PathBuf,
    kubelet: TestKubelet,
    regs: std::collections::HashMap<String, dp::RegisterRequest>,
    api: NodeClient<Channel>,
}

/// A node of `description`, tesserad started over it with `partitions` (one resource, see
/// [`start`]), and the node's model; the node outlives the daemon (dropped last).
async fn start_on(description: &str, partitions: &str) -> (SimNode, Started, tessera_sim_model::Node) {
    let node = SimNode::with_description(description);
    let s = start(&node, partitions, 1).await;
    let sim = sim_model(&node);
    (node, s, sim)
}

async fn start(node: &SimNode, partitions: &str, resources: usize) -> Started {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    std::fs::create_dir(dir.join("plugins")).expect("plugin dir");
    let config = dir.join("config.toml");
    std::fs::write(&config, config_text(node, dir, partitions)).expect("config");
    let notify_path = dir.join("notify.sock");
    let _notify = UnixDatagram::bind(&notify_path).expect("notify socket");
    let log = dir.join("tesserad.log");
    let mut kubelet = TestKubelet::start(&dir.join("plugins"));
    let (daemon, _) = spawn(node, &config, &notify_path, &log);
    let mut regs = std::collections::HashMap::new();
    while regs.len() < resources {
        let (req, _) = kubelet.next_registration().await;
        regs.insert(req.resource_name.clone(), req);
    }
    let api = client(&dir.join("run/tessera.sock")).await;
    Started { _tmp: tmp, daemon, log, kubelet, regs, api }
}

const WHOLE4: &str = "numa_nodes = 1
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 4
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_reach_the_kubelet_and_gpus_recover_after_reset() {
    let (_node, mut s, sim) = start_on(WHOLE4, "[partitions.default]\nwhole = true\n").await;
    let show_log = |s: &Started| std::fs::read_to_string(&s.log).unwrap_or_default();

    let gpus: Vec<(u32, String)> =
        listed(&mut s.api, api::DeviceKind::Gpu).await.into_iter().map(|d| (d.index, d.uuid)).collect();
    assert_eq!(gpus.len(), 4);
    let uuid = |i: usize| gpus[i].1.clone();
    let mut plugin = s.kubelet.connect(&s.regs["tessera.io/gpu"]).await;
    let mut law = plugin.list_and_watch(Empty {}).await.expect("ListAndWatch").into_inner();
    let first = next_list(&mut law).await;
    assert_eq!(first.devices.len(), 4);
    assert!(first.devices.iter().all(|d| d.health == dp::HEALTHY), "{first:?}");
    let mut events = watch_health_events(&mut s.api).await;
    let alloc0 = allocate(&mut plugin, &mut s.api, &uuid(0)).await;
    // Let the monitor's start-up look finish (it runs while the kubelet registers).
    tokio::time::sleep(Duration::from_millis(200)).await;

    // 1. Application XID 13 on GPU 0: attributed to its holder, the GPU stays in service.
    sim.inject_xid(0, 13, None, None).expect("inject XID 13");
    let e = expect_event(&mut events, "XID 13", |e| fault(e).is_some_and(|f| f.xid == Some(13))).await;
    let f = fault(&e).unwrap();
    assert_eq!(
        (e.device_id.as_str(), e.device_kind(), e.severity()),
        (uuid(0).as_str(), api::DeviceKind::Gpu, api::Severity::Warning)
    );
    assert_eq!((f.kind(), f.marks_unhealthy, f.health()), (api::FaultKind::Xid, false, api::Health::Healthy));
    assert_eq!(
        e.affected.iter().map(|h| h.allocation_id.as_str()).collect::<Vec<_>>(),
        [alloc0.as_str()],
        "attributed"
    );
    assert!(e.message.contains(&alloc0), "{}", e.message);
    assert_eq!(device_health(&mut s.api, &uuid(0)).await.0, api::Health::Healthy);

    // 2. Fatal XID 48 on GPU 1: unhealthy in ListAndWatch at once.
    let t0 = Instant::now();
    sim.inject_xid(1, 48, None, None).expect("inject XID 48");
    let (list, at) = until_health(&mut law, &uuid(1), dp::UNHEALTHY).await;
    let xid_latency = at - t0;
    assert_eq!(health_of(&list, &uuid(0)), dp::HEALTHY, "the application XID left GPU 0 in service");
    let e = expect_event(&mut events, "XID 48 fault", |e| fault(e).is_some_and(|f| f.xid == Some(48))).await;
    let f = fault(&e).unwrap();
    assert_eq!((e.device_id.as_str(), e.severity()), (uuid(1).as_str(), api::Severity::Critical));
    assert_eq!((f.kind(), f.marks_unhealthy, f.health()), (api::FaultKind::Xid, true, api::Health::Unhealthy));
    expect_change(&mut events, &uuid(1), api::Health::Healthy, api::Health::Unhealthy).await;
    let (h, reason) = device_health(&mut s.api, &uuid(1)).await;
    assert_eq!(h, api::Health::Unhealthy);
    assert!(reason.contains("XID 48"), "{reason}");

    // 3. Double-bit ECC error on GPU 2, then a reset: recovering, then healthy again.
    let t0 = Instant::now();
    sim.inject_ecc(2, 0, 1).expect("inject ECC");
    let (_, at) = until_health(&mut law, &uuid(2), dp::UNHEALTHY).await;
    let ecc_latency = at - t0;
    let e = expect_event(&mut events, "ECC fault", |e| e.device_id == uuid(2) && fault(e).is_some()).await;
    let f = fault(&e).unwrap();
    assert_eq!((f.kind(), f.xid, f.marks_unhealthy), (api::FaultKind::EccDoubleBit, None, true));
    expect_change(&mut events, &uuid(2), api::Health::Healthy, api::Health::Unhealthy).await;
    let t_reset = Instant::now();
    sim.reset(2).expect("reset GPU 2");
    expect_change(&mut events, &uuid(2), api::Health::Unhealthy, api::Health::Recovering).await;
    let (_, at) = until_health(&mut law, &uuid(2), dp::HEALTHY).await;
    let ecc_recovery = at - t_reset;
    assert!(ecc_recovery >= Duration::from_millis(RECOVERY_CHECK_MS), "healthy only after the check");
    let r = expect_recovery(&mut events, &uuid(2)).await;
    assert_eq!((r.from(), r.xid), (api::FaultKind::EccDoubleBit, None));
    assert!(r.how.contains("reset"), "{}", r.how);
    assert!(r.downtime_nanos >= RECOVERY_CHECK_MS * 1_000_000, "downtime {} ns", r.downtime_nanos);
    expect_change(&mut events, &uuid(2), api::Health::Recovering, api::Health::Healthy).await;
    assert_eq!(device_health(&mut s.api, &uuid(2)).await.0, api::Health::Healthy);

    // 4. GPU 3 falls off the bus: lost (XID 79); back after a reset.
    let t0 = Instant::now();
    sim.fall_off_bus(3).expect("lose GPU 3");
    let (_, at) = until_health(&mut law, &uuid(3), dp::UNHEALTHY).await;
    let lost_latency = at - t0;
    let e = expect_event(&mut events, "lost fault", |e| e.device_id == uuid(3) && fault(e).is_some()).await;
    let f = fault(&e).unwrap();
    // XID 79 names it, unless a probe (woken by the event wait's GPU_IS_LOST) got there first.
    assert_eq!((f.kind(), f.health()), (api::FaultKind::GpuLost, api::Health::Lost));
    assert!(matches!(f.xid, None | Some(79)), "{f:?}");
    expect_change(&mut events, &uuid(3), api::Health::Healthy, api::Health::Lost).await;
    let (_, reason) = device_health(&mut s.api, &uuid(3)).await;
    assert!(reason.starts_with("lost:"), "{reason}");
    // Stays lost (the probes keep failing) until the reset.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(device_health(&mut s.api, &uuid(3)).await.0, api::Health::Unhealthy);
    let t_reset = Instant::now();
    sim.reset(3).expect("reset GPU 3");
    expect_change(&mut events, &uuid(3), api::Health::Lost, api::Health::Recovering).await;
    let (list, at) = until_health(&mut law, &uuid(3), dp::HEALTHY).await;
    let lost_recovery = at - t_reset;
    let r = expect_recovery(&mut events, &uuid(3)).await;
    assert_eq!((r.from(), r.xid), (api::FaultKind::GpuLost, Some(79)));
    assert!(r.how.starts_with("reattached"), "{}", r.how);
    assert!(r.downtime_nanos >= 1_200_000_000, "downtime {} ns", r.downtime_nanos);

    // 5. XID 48: the driver asks for a GPU reset (its recovery action); GPU 1 stays out of service
    //    without one, and comes back after one, once the check passes.
    assert_eq!(health_of(&list, &uuid(1)), dp::UNHEALTHY);
    tokio::time::sleep(Duration::from_millis(RECOVERY_CHECK_MS + 300)).await;
    assert_eq!(device_health(&mut s.api, &uuid(1)).await.0, api::Health::Unhealthy, "no reset, no recovery");
    sim.reset(1).expect("reset GPU 1");
    until_health(&mut law, &uuid(1), dp::HEALTHY).await;
    let r = expect_recovery(&mut events, &uuid(1)).await;
    assert_eq!(r.xid, Some(48));
    assert!(r.how.contains("recovery action"), "{}", r.how);

    println!(
        "fault -> ListAndWatch: XID 48 {:.1} ms, ECC DBE {:.1} ms, lost GPU {:.1} ms; \
         reset -> ListAndWatch healthy: ECC {:.1} ms, lost {:.1} ms (check {RECOVERY_CHECK_MS} ms included)",
        ms(xid_latency),
        ms(ecc_latency),
        ms(lost_latency),
        ms(ecc_recovery),
        ms(lost_recovery),
    );
    for (what, d) in [("XID", xid_latency), ("ECC", ecc_latency), ("lost", lost_latency)] {
        assert!(d < LATENCY_LIMIT, "{what} took {:.1} ms\n{}", ms(d), show_log(&s));
    }
    for (what, d) in [("ECC", ecc_recovery), ("lost", lost_recovery)] {
        let over = d.saturating_sub(Duration::from_millis(RECOVERY_CHECK_MS));
        assert!(over < LATENCY_LIMIT, "{what} recovery took {:.1} ms over the check", ms(over));
    }

    // The log has every fault and recovery.
    let log = show_log(&s);
    for needle in ["XID 13", "XID 48", "double-bit ECC", "XID 79", "recovered from"] {
        assert!(log.contains(needle), "log lacks {needle:?}:\n{log}");
    }

    // SIGTERM: the daemon (health thread included) stops promptly.
    drop((events, law, plugin));
    let pid = s.daemon.0.id().to_string();
    let stop = Instant::now();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    loop {
        if let Some(status) = s.daemon.0.try_wait().expect("wait") {
            assert!(status.success(), "tesserad exit {status}\n{}", show_log(&s));
            break;
        }
        assert!(stop.elapsed() < Duration::from_secs(3), "tesserad did not stop\n{}", show_log(&s));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(show_log(&s).contains("health monitor stopped"));
}

const MIG1: &str = "numa_nodes = 1
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 1
mig = true
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_instance_is_judged_on_its_own() {
    let (_node, mut s, sim) = start_on(MIG1, "[partitions.\"0\"]\nmig = { \"3g.40gb\" = 2 }\n").await;
    let migs = listed(&mut s.api, api::DeviceKind::Mig).await;
    assert_eq!(migs.len(), 2);
    let ids = |d: &api::Device| {
        let m = d.mig.as_ref().expect("mig info");
        (m.gpu_instance_id, m.compute_instance_id)
    };
    let (a, b) = (&migs[0], &migs[1]);
    let mut plugin = s.kubelet.connect(&s.regs["tessera.io/mig-3g.40gb"]).await;
    let mut law = plugin.list_and_watch(Empty {}).await.expect("ListAndWatch").into_inner();
    let first = next_list(&mut law).await;
    assert!(first.devices.iter().all(|d| d.health == dp::HEALTHY));
    let mut events = watch_health_events(&mut s.api).await;
    let alloc_a = allocate(&mut plugin, &mut s.api, &a.id).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    // An application XID in instance A: attributed to A's holder; nothing leaves service.
    sim.inject_xid(0, 13, Some(ids(a)), None).expect("XID 13");
    let e = expect_event(&mut events, "XID 13", |e| fault(e).is_some_and(|f| f.xid == Some(13))).await;
    assert_eq!((e.device_id.as_str(), e.device_kind()), (a.id.as_str(), api::DeviceKind::Mig));
    assert_eq!(e.affected.iter().map(|h| h.allocation_id.as_str()).collect::<Vec<_>>(), [alloc_a.as_str()]);
    assert!(!fault(&e).unwrap().marks_unhealthy);

    // A contained ECC error (XID 94) in instance B: only B leaves service.
    let t0 = Instant::now();
    sim.inject_xid(0, 94, Some(ids(b)), None).expect("XID 94");
    let (list, at) = until_health(&mut law, &b.id, dp::UNHEALTHY).await;
    let latency = at - t0;
    assert_eq!(health_of(&list, &a.id), dp::HEALTHY, "the other instance stays in service");
    let e = expect_event(&mut events, "XID 94", |e| fault(e).is_some_and(|f| f.xid == Some(94))).await;
    assert_eq!((e.device_id.as_str(), e.device_kind()), (b.id.as_str(), api::DeviceKind::Mig));
    assert!(e.affected.is_empty(), "nobody holds B");
    assert_eq!(fault(&e).unwrap().health(), api::Health::Unhealthy);
    assert_eq!(device_health(&mut s.api, &b.id).await.0, api::Health::Unhealthy);
    assert_eq!(device_health(&mut s.api, &a.id).await.0, api::Health::Healthy);

    // An uncontained ECC error (XID 95) is GPU-wide even when it names instance A.
    sim.inject_xid(0, 95, Some(ids(a)), None).expect("XID 95");
    let (list, _) = until_health(&mut law, &a.id, dp::UNHEALTHY).await;
    assert_eq!(health_of(&list, &b.id), dp::UNHEALTHY);
    let e = expect_event(&mut events, "XID 95", |e| fault(e).is_some_and(|f| f.xid == Some(95))).await;
    assert_eq!(e.device_kind(), api::DeviceKind::Gpu);
    assert_eq!(e.affected.iter().map(|h| h.allocation_id.as_str()).collect::<Vec<_>>(), [alloc_a.as_str()]);
    println!("MIG instance fault -> ListAndWatch: {:.1} ms", ms(latency));
    assert!(latency < LATENCY_LIMIT, "took {:.1} ms", ms(latency));
}

/// The liveness probe alone (no event registered for that GPU) finds a lost GPU.
#[test]
fn the_probe_finds_a_lost_gpu_without_events() {
    let node = SimNode::with_description(WHOLE4);
    node.run_isolated("the_probe_finds_a_lost_gpu_without_events", || {
        use tessera_daemon::health::{self, Probe, RawEvent};
        let session =
            tessera_daemon::discovery::Session::open(Some(node.nvml_path().as_path()), false).expect("session");
        let sim = sim_model(&node);
        assert!(matches!(health::probe(&session, 2), Probe::Alive(_)));
        let set = health::EventSet::new(session.nvml()).expect("event set");
        assert!(set.register(1).expect("register GPU 1"));
        sim.fall_off_bus(2).expect("lose GPU 2");
        assert_eq!(set.wait(100).expect("wait"), None, "GPU 2's XID 79 is not registered here");
        assert_eq!(health::probe(&session, 2), Probe::Lost);
        assert!(matches!(health::probe(&session, 1), Probe::Alive(_)), "other GPUs answer");
        sim.inject_xid(1, 48, None, None).expect("XID 48 on GPU 1");
        assert_eq!(set.wait(1000).expect("wait"), Some(RawEvent::Xid { gpu: 1, xid: 48, mig: None }));
        sim.inject_ecc(1, 0, 2).expect("ECC on GPU 1");
        assert_eq!(set.wait(1000).expect("wait"), Some(RawEvent::DoubleBitEcc { gpu: 1 }));
        let Probe::Alive(c) = health::probe(&session, 1) else { panic!("GPU 1 answers") };
        assert_eq!(c.ecc_uncorrected, Some(2));
        sim.reset(1).expect("reset GPU 1");
        let Probe::Alive(c) = health::probe(&session, 1) else { panic!("GPU 1 answers") };
        assert_eq!(c.ecc_uncorrected, Some(0), "a reset clears the volatile count");
        sim.reset(2).expect("reset GPU 2");
        assert!(matches!(health::probe(&session, 2), Probe::Alive(_)));
    });
}

/// Every event of `events` that arrives before it stays quiet for `quiet`.
async fn drain(events: &mut tonic::Streaming<api::Event>, quiet: Duration) -> Vec<api::Event> {
    let mut seen = Vec::new();
    while let Ok(e) = tokio::time::timeout(quiet, events.message()).await {
        seen.push(e.expect("event stream ok").expect("event stream open"));
    }
    seen
}

/// A GPU out of service whose uncorrected ECC count keeps rising (every probe and every NVML
/// event sees a new error) is reported once, not every 50 ms; after a reset and recovery, a new
/// error is a new fault, reported again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rising_ecc_count_on_an_out_of_service_gpu_is_reported_once() {
    let (_node, mut s, sim) = start_on(WHOLE4, "[partitions.default]\nwhole = true\n").await;
    let gpus = listed(&mut s.api, api::DeviceKind::Gpu).await;
    let uuid = gpus[1].uuid.clone();
    let mut events = watch_health_events(&mut s.api).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    sim.inject_ecc(1, 0, 1).expect("inject ECC");
    let e = expect_event(&mut events, "ECC fault", |e| e.device_id == uuid && fault(e).is_some()).await;
    assert_eq!(fault(&e).unwrap().kind(), api::FaultKind::EccDoubleBit);
    // 60 more errors over about 1.5 s: 30 probe periods, 60 NVML events.
    for _ in 0..60 {
        sim.inject_ecc(1, 0, 1).expect("inject ECC");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let later = drain(&mut events, Duration::from_millis(800)).await;
    let faults: Vec<&api::Event> = later.iter().filter(|e| e.device_id == uuid && fault(e).is_some()).collect();
    assert!(faults.is_empty(), "{} more fault events: {:?}", faults.len(), faults.first().map(|e| &e.message));
    // Only the first fault's own transition (it follows the fault event): no more changes.
    let changes: Vec<_> = later.iter().filter(|e| e.device_id == uuid).filter_map(change).collect();
    assert_eq!(changes, [(api::Health::Healthy, api::Health::Unhealthy)], "{later:?}");
    let (health, reason) = device_health(&mut s.api, &uuid).await;
    assert_eq!(health, api::Health::Unhealthy);
    assert!(reason.starts_with("unhealthy: double-bit ECC error"), "{reason}");

    // Reset, back in service; a new error is a new outage, reported at once.
    sim.reset(1).expect("reset GPU 1");
    expect_event(&mut events, "GPU 1 recovery", |e| e.device_id == uuid && recovery(e).is_some()).await;
    sim.inject_ecc(1, 0, 1).expect("inject ECC");
    expect_event(&mut events, "a new ECC fault", |e| e.device_id == uuid && fault(e).is_some()).await;
    let log = std::fs::read_to_string(&s.log).unwrap_or_default();
    let taken = log.lines().filter(|l| l.contains("double-bit ECC") && l.contains("taken out of service")).count();
    assert!(taken <= 2, "{log}");
}
