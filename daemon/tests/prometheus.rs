//! The `/metrics` exporter scraped by a real Prometheus server (Debian's `prometheus` package,
//! installed by scripts/deps.sh): what a container does in its accounting region arrives in
//! Prometheus's query API with exact values and pod labels, and the text is what Prometheus
//! accepts (`up` is 1).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_daemon::state::{AllocDirs, AllocatedDevice, Allocation, ContainerIdentity, Source};
use tessera_daemon::telemetry::{self, GpuMetrics, MetricsSource, NodeMetrics};
use tessera_daemon::usage::UsageSampler;
use tessera_region::{ComputeMode, Priority, Region};

const PROMETHEUS: &str = "/usr/bin/prometheus";
const WAIT: Duration = Duration::from_secs(30);
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
                mig_profile: None,
                parent_uuid: None,
            }],
            usage,
            allocations: self.allocations.len(),
            events_total: 5,
            faults_total: 0,
        }
    }
}

/// A Prometheus server, killed on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: std::path::PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `target` every second, on a free loopback port (tried again on
    /// another port if it exits at start, e.g. because the port was taken in between).
    fn start(dir: &Path, target: SocketAddr) -> Prometheus {
        assert!(
            Path::new(PROMETHEUS).exists(),
            "{PROMETHEUS} is missing: install Debian's `prometheus` package (scripts/deps.sh does)"
        );
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: tesserad\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let mut last_log = String::new();
        for attempt in 0..3 {
            let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
            let log = dir.join(format!("prometheus-{attempt}.log"));
            let child = Command::new(PROMETHEUS)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={}", dir.join(format!("data-{attempt}")).display()))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=info")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {PROMETHEUS}: {e}"));
            let mut p = Prometheus { child, addr, log };
            let deadline = Instant::now() + WAIT;
            while Instant::now() < deadline {
                if p.child.try_wait().unwrap().is_some() {
                    break;
                }
                if get(addr, "/-/ready").is_some_and(|(code, _)| code == 200) {
                    return p;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            last_log = std::fs::read_to_string(&p.log).unwrap_or_default();
            let _ = p.child.kill();
        }
        panic!("Prometheus did not become ready; its log:\n{last_log}");
    }

    /// An instant query: the result vector as (labels, value).
    fn query(&self, q: &str) -> Vec<(serde_json::Map<String, serde_json::Value>, f64)> {
        let (code, body) = get(self.addr, &format!("/api/v1/query?query={}", encode(q)))
            .unwrap_or_else(|| panic!("Prometheus query {q:?}: no answer"));
        assert_eq!(code, 200, "query {q:?}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{body}");
        v["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let labels = r["metric"].as_object().unwrap().clone();
                let value = r["value"][1].as_str().unwrap().parse::<f64>().unwrap();
                (labels, value)
            })
            .collect()
    }

    /// Polls `q` until it gives exactly one sample equal to `want` (what Prometheus scraped last
    /// may lag one interval behind); fails after 30 s with what it last saw and the log.
    fn wait_for(&self, q: &str, want: f64) -> serde_json::Map<String, serde_json::Value> {
        let deadline = Instant::now() + WAIT;
        loop {
            let r = self.query(q);
            if let [(labels, v)] = r.as_slice()
                && *v == want
            {
                return labels.clone();
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                panic!("{q}: wanted {want}, Prometheus has {r:?}\nits log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A minimal HTTP/1.0 GET: (status, body); `None` if nothing answers.
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    let code = head.split(' ').nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn label<'a>(l: &'a serde_json::Map<String, serde_json::Value>, k: &str) -> &'a str {
    l.get(k).and_then(|v| v.as_str()).unwrap_or_else(|| panic!("label {k} missing in {l:?}"))
}

#[test]
fn prometheus_scrapes_exact_container_usage() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    std::fs::create_dir(&run).unwrap();
    let dirs = AllocDirs::new(&run);
    let share = |n: u32| AllocatedDevice {
        device_id: format!("{GPU}::{n}"),
        physical_uuid: GPU.into(),
        memory_limit: Some(1 << 30),
        sm_percent: Some(15),
        priority: Priority::Normal,
        compute_mode: ComputeMode::Strict,
    };
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
    };
    dirs.create(&alloc).unwrap();

    // The container's process, through the shim's own crate.
    let region = Region::open_or_create(&dirs.region_path(&alloc.id)).unwrap();
    let slot = region.join().unwrap();
    let dev = region.device(GPU).unwrap();
    region.set_memory_limit(dev, Some(2 << 30));
    region.try_reserve(slot, dev, 300 * MIB).unwrap();
    assert!(region.try_reserve(slot, dev, 4 << 30).is_err());
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
