//! The `/metrics` exporter scraped by a real Prometheus server (Debian's `prometheus` package,
//! installed by scripts/deps.sh): what a container does in its accounting region arrives in
//! Prometheus's query API with exact values and pod labels, and the text is what Prometheus
//! accepts (`up` is 1).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_daemon::state::{AllocDirs, AllocatedDevice, Allocation, ContainerIdentity, Source};
use tessera_daemon::telemetry::{self, GpuMetrics, MetricsSource, NodeMetrics};
use tessera_daemon::usage::UsageSampler;
use tessera_region::Region;

mod common;

use common::prometheus::Prometheus;

const MIB: u64 = 1024 * 1024;
const GPU: &str = "GPU-5d3c2f9e-1111-2222-3333-444455556666";

/// The daemon's side, faked around the real sampler: one allocation, one GPU.
struct Source1 {
    allocations: Vec<Allocation>,
    dirs: AllocDirs,
    sampler: Mutex<UsageSampler>,
}

impl MetricsSource for Source1 {
    fn metrics(&self) -> NodeMetrics {
        let usage = self.sampler.lock().unwrap().sample(&self.allocations, &self.dirs, tessera_region::monotonic_ns());
        let used: u64 = usage.containers.iter().flat_map(|c| &c.devices).map(|d| d.memory_used).sum();
        NodeMetrics {
            hostname: "node-7".into(),
            gpus: vec![GpuMetrics {
                index: 0,
                uuid: GPU.into(),
                model: "NVIDIA H100 80GB HBM3".into(),
                pci_bus_id: "00000000:17:00.0".into(),
                // The container's memory plus 512 MiB of contexts.
                memory_used: used + 512 * MIB,
                memory_total: 81559 * MIB,
                utilization_percent: Some(42),
                healthy: true,
                ..Default::default()
            }],
            usage,
            allocations: self.allocations.len(),
            events_total: 5,
            faults_total: 0,
            enforcement: Default::default(),
            kubelet_withdrawn: Default::default(),
            filesystems: Vec::new(),
            park: Default::default(),
        }
    }
}

fn label<'a>(l: &'a serde_json::Map<String, serde_json::Value>, k: &str) -> &'a str {
    l.get(k).and_then(|v| v.as_str()).unwrap_or_else(|| panic!("label {k} missing in {l:?}"))
}

#[test]
fn prometheus_scrapes_exact_container_usage() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    std::fs::create_dir(&run).unwrap();
    common::unmount_at_exit(&run);
    let dirs = AllocDirs::new(&run);
    let share = |n: u32| AllocatedDevice::new(format!("{GPU}::{n}"), GPU, Some(1 << 30), Some(15));
    let alloc = Allocation {
        id: "prom0001".into(),
        resource: "tessera.io/share".into(),
        container: ContainerIdentity {
            pod_namespace: Some("team-a".into()),
            pod_name: Some("trainer-0".into()),
            pod_uid: Some("0b5e-uid".into()),
            container_name: Some("main".into()),
            container_id: None,
        },
        source: Source::Kubelet,
        created_unix_ns: 1,
        devices: vec![share(0), share(1)],
        claim: None,
    };
    dirs.create(&alloc).unwrap();

    // The container's process, through the shim's own crate.
    let region = Region::open_or_create(&dirs.region_path(&alloc.id)).unwrap();
    let slot = region.join().unwrap();
    let dev = region.device(GPU).unwrap();
    region.try_reserve(slot, dev, 300 * MIB, Some(2 << 30)).unwrap();
    assert!(region.try_reserve(slot, dev, 4 << 30, Some(2 << 30)).is_err());
    for _ in 0..42 {
        region.record_launch(slot, dev);
    }
    region.record_gpu_time(slot, dev, 1_500_000_000);
    region.record_throttled(slot, dev, 250_000_000);

    // The exporter.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = telemetry::bind("127.0.0.1:0").unwrap();
    let target = listener.local_addr().unwrap();
    let source: Arc<dyn MetricsSource> = Arc::new(Source1 {
        allocations: vec![alloc.clone()],
        dirs: dirs.clone(),
        sampler: Mutex::new(UsageSampler::new()),
    });
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let server = {
        let _g = rt.enter();
        rt.spawn(telemetry::serve(tokio::net::TcpListener::from_std(listener).unwrap(), source, stopped))
    };

    let prom = Prometheus::start(tmp.path(), target);
    // Scraped and accepted.
    prom.wait_for("up{job=\"tesserad\"}", 1.0);

    let sel = format!("{{allocation=\"{}\"}}", alloc.id);
    let q = |name: &str| format!("{name}{sel}");
    let labels = prom.wait_for(&q("tessera_container_memory_used_bytes"), (300 * MIB) as f64);
    assert_eq!(label(&labels, "namespace"), "team-a");
    assert_eq!(label(&labels, "pod"), "trainer-0");
    assert_eq!(label(&labels, "container"), "main");
    assert_eq!(label(&labels, "resource"), "tessera.io/share");
    assert_eq!(label(&labels, "UUID"), GPU);
    assert_eq!(label(&labels, "device_id"), format!("{GPU}::0,{GPU}::1"));
    prom.wait_for(&q("tessera_container_memory_peak_bytes"), (300 * MIB) as f64);
    prom.wait_for(&q("tessera_container_memory_limit_bytes"), (2u64 << 30) as f64);
    prom.wait_for(&q("tessera_container_sm_limit_percent"), 30.0);
    prom.wait_for(&q("tessera_container_launches_total"), 42.0);
    prom.wait_for(&q("tessera_container_gpu_seconds_total"), 1.5);
    prom.wait_for(&q("tessera_container_throttled_seconds_total"), 0.25);
    prom.wait_for(&q("tessera_container_oom_denials_total"), 1.0);
    prom.wait_for(&q("tessera_container_processes"), 1.0);
    prom.wait_for("tessera_allocations", 1.0);
    prom.wait_for("tessera_events_total", 5.0);

    // dcgm-exporter's series, as its users query them.
    let gpu = prom.wait_for(&format!("DCGM_FI_DEV_FB_USED{{UUID=\"{GPU}\"}}"), 812.0);
    assert_eq!(label(&gpu, "gpu"), "0");
    assert_eq!(label(&gpu, "device"), "nvidia0");
    assert_eq!(label(&gpu, "modelName"), "NVIDIA H100 80GB HBM3");
    assert_eq!(label(&gpu, "Hostname"), "node-7");
    assert_eq!(label(&gpu, "pci_bus_id"), "00000000:17:00.0");
    prom.wait_for(&format!("DCGM_FI_DEV_FB_FREE{{UUID=\"{GPU}\"}}"), (81559 - 812) as f64);
    prom.wait_for("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"}", 42.0);
    prom.wait_for(&format!("tessera_gpu_healthy{{UUID=\"{GPU}\"}}"), 1.0);

    // Live: more work and then the process's exit; the counters keep what it did.
    for _ in 0..8 {
        region.record_launch(slot, dev);
    }
    prom.wait_for(&q("tessera_container_launches_total"), 50.0);
    drop(region);
    prom.wait_for(&q("tessera_container_processes"), 0.0);
    prom.wait_for(&q("tessera_container_memory_used_bytes"), 0.0);
    prom.wait_for(&q("tessera_container_launches_total"), 50.0);
    // The counter never went backwards in what Prometheus stored.
    prom.wait_for(&format!("resets(tessera_container_launches_total{sel}[5m])"), 0.0);

    stop.send(true).unwrap();
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), server).await }).unwrap().unwrap().unwrap();
}

/// `metrics_listen = "unix:PATH"`: tesserad serves `/metrics` on an owner-only socket (0600,
/// root's) that a plain HTTP client scrapes (`curl --unix-socket`), and an unprivileged user
/// (`nobody`, through `setpriv`) is refused even with the directory open to it. A TCP port,
/// loopback included, answers anyone on the host.
#[test]
fn the_metrics_socket_is_owner_only_and_scraped_over_http() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return common::skip("refusing another user needs root to be that user");
    }
    let node = tessera_sim_testkit::SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Every user may reach the directory: only the socket's own mode can refuse them.
    let open = dir.join("open");
    std::fs::create_dir(&open).unwrap();
    for d in [dir, open.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let socket = open.join("metrics.sock");
    let config =
        common::write_config(&node, dir, &format!("[telemetry]\nmetrics_listen = \"unix:{}\"\n", socket.display()));
    let (mut daemon, _) = common::spawn(&node, &config, &dir.join("no-notify"), &dir.join("tesserad.log"));
    let deadline = std::time::Instant::now() + common::WAIT;
    while !socket.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no socket: {}",
            std::fs::read_to_string(dir.join("tesserad.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "owner-only");
    assert_eq!((meta.uid(), meta.gid()), (0, 0), "root's");

    let curl = |prefix: &[&str]| {
        let mut all: Vec<&str> = prefix.to_vec();
        let s = socket.to_str().unwrap();
        all.extend(["curl", "-sS", "--fail", "--max-time", "10", "--unix-socket", s, "http://tesserad/metrics"]);
        std::process::Command::new(all[0]).args(&all[1..]).output().expect("curl (Debian's curl package)")
    };
    let out = curl(&[]);
    let body = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(body.lines().any(|l| l.starts_with("DCGM_FI_DEV_FB_FREE{")), "{body}");
    assert!(body.lines().any(|l| l == "tessera_allocations 0"), "{body}");

    let nobody = curl(&["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]);
    let err = String::from_utf8_lossy(&nobody.stderr);
    assert!(!nobody.status.success() && nobody.stdout.is_empty(), "nobody scraped the metrics: {nobody:?}");
    assert!(err.contains("Permission denied") || err.contains("Couldn't connect"), "{err}");

    // Stopped cleanly, the daemon takes its socket away.
    let pid = daemon.0.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    assert!(daemon.0.wait().expect("exit").success());
    assert!(!socket.exists(), "the socket outlived the daemon");
}
