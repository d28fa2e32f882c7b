//! What one `/metrics` scrape costs on a busy node: 8 GPUs, 100 containers (100 real accounting
//! regions, 4 live processes each, two shares per container on one GPU and one on another).
//! Prints p50/p99 of sampling the regions, of rendering, and of a whole scrape over loopback
//! (`cargo bench -p tessera-daemon --bench scrape`), with CPU time per call (this process's,
//! where the server runs). Baseline, interleaved with the busy node's scrapes on the same server
//! code: a node with the same GPUs and no containers.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_daemon::state::{AllocDirs, AllocatedDevice, Allocation, ContainerIdentity, Source};
use tessera_daemon::telemetry::{self, GpuMetrics, MetricsSource, NodeMetrics};
use tessera_daemon::usage::UsageSampler;
use tessera_region::{ComputeMode, Priority, Region};

const GPUS: u32 = 8;
const CONTAINERS: usize = 100;
const PROCS: usize = 4;
const ROUNDS: usize = 300;

struct Node {
    gpus: Vec<GpuMetrics>,
    allocations: Vec<Allocation>,
    dirs: AllocDirs,
    sampler: Mutex<UsageSampler>,
}

impl Node {
    fn sample(&self) -> NodeMetrics {
        let usage = self.sampler.lock().unwrap().sample(&self.allocations, &self.dirs, tessera_region::monotonic_ns());
        NodeMetrics {
            hostname: "bench-node".into(),
            gpus: self.gpus.clone(),
            usage,
            allocations: self.allocations.len(),
            events_total: 1234,
            faults_total: 2,
            enforcement: Default::default(),
        }
    }
}

impl MetricsSource for Node {
    fn metrics(&self) -> NodeMetrics {
        self.sample()
    }
}

fn gpu_uuid(i: u32) -> String {
    format!("GPU-00000000-0000-0000-0000-{i:012}")
}

fn percentiles(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{name:<28} n={:<4} p50 {:>9.3} ms   p99 {:>9.3} ms   max {:>9.3} ms",
        v.len(),
        p(0.5).as_secs_f64() * 1e3,
        p(0.99).as_secs_f64() * 1e3,
        v[v.len() - 1].as_secs_f64() * 1e3
    );
}

fn scrape(addr: SocketAddr) -> usize {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    assert!(out.starts_with(b"HTTP/1.1 200 "));
    out.len()
}

/// CPU time of this whole process (user + system): the server's threads and the client's.
fn process_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Serves `source`'s metrics on loopback; returns the address and what stops the server.
fn serve(
    rt: &tokio::runtime::Runtime,
    source: Arc<dyn MetricsSource>,
) -> (SocketAddr, tokio::sync::watch::Sender<bool>, tokio::task::JoinHandle<std::io::Result<()>>) {
    let listener = telemetry::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let _g = rt.enter();
    let server = rt.spawn(telemetry::serve(tokio::net::TcpListener::from_std(listener).unwrap(), source, stopped));
    (addr, stop, server)
}

fn main() {
    let tmp = tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).unwrap();
    let dirs = AllocDirs::new(tmp.path());
    let gpus: Vec<GpuMetrics> = (0..GPUS)
        .map(|i| GpuMetrics {
            index: i,
            uuid: gpu_uuid(i),
            model: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x17 + i),
            memory_used: 20 << 30,
            memory_total: 80 << 30,
            utilization_percent: Some(50),
            healthy: true,
            ..Default::default()
        })
        .collect();
    let mut allocations = Vec::new();
    let mut handles = Vec::new();
    for c in 0..CONTAINERS {
        let g = gpu_uuid(c as u32 % GPUS);
        let h = gpu_uuid((c as u32 + 1) % GPUS);
        let dev = |id: String, uuid: &str| AllocatedDevice {
            device_id: id,
            physical_uuid: uuid.to_string(),
            memory_limit: Some(4 << 30),
            sm_percent: Some(10),
            priority: Priority::Normal,
            compute_mode: ComputeMode::Strict,
        };
        let a = Allocation {
            id: format!("alloc{c:04}"),
            resource: "tessera.io/share".into(),
            container: ContainerIdentity {
                pod_namespace: Some("bench".into()),
                pod_name: Some(format!("pod-{c}")),
                container_name: Some("main".into()),
                ..Default::default()
            },
            source: Source::Kubelet,
            created_unix_ns: 1,
            devices: vec![dev(format!("{g}::0"), &g), dev(format!("{g}::1"), &g), dev(h.clone(), &h)],
            claim: None,
        };
        dirs.create(&a).unwrap();
        for p in 0..PROCS {
            let r = Region::open_or_create(&dirs.region_path(&a.id)).unwrap();
            let slot = r.join().unwrap();
            for uuid in [&g, &h] {
                let d = r.device(uuid).unwrap();
                r.try_reserve(slot, d, (p as u64 + 1) << 20, None).unwrap();
                for _ in 0..10 {
                    r.record_launch(slot, d);
                }
                r.record_gpu_time(slot, d, 1_000_000);
            }
            handles.push(r);
        }
        allocations.push(a);
    }
    let empty = Arc::new(Node {
        gpus: gpus.clone(),
        allocations: Vec::new(),
        dirs: AllocDirs::new(tmp.path()),
        sampler: Mutex::new(UsageSampler::new()),
    });
    let node = Arc::new(Node { gpus, allocations, dirs, sampler: Mutex::new(UsageSampler::new()) });

    // Warm up: open every region once.
    let _ = node.sample();
    let mut sample_t = Vec::new();
    let mut render_t = Vec::new();
    let mut size = 0;
    let cpu0 = process_cpu();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        let m = node.sample();
        sample_t.push(t.elapsed());
        let t = Instant::now();
        size = telemetry::render(&m).len();
        render_t.push(t.elapsed());
    }
    let sample_render_cpu = (process_cpu() - cpu0) / ROUNDS as u32;

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (addr, stop, server) = serve(&rt, node.clone());
    let (empty_addr, empty_stop, empty_server) = serve(&rt, empty.clone());
    scrape(addr);
    scrape(empty_addr);
    // Interleaved: busy node, empty node, empty node, busy node, ...
    let (mut scrape_t, mut empty_t) = (Vec::new(), Vec::new());
    let (mut busy_cpu, mut empty_cpu) = (Duration::ZERO, Duration::ZERO);
    let mut wire = 0;
    for i in 0..ROUNDS {
        for busy in if i % 2 == 0 { [true, false] } else { [false, true] } {
            let (t, c) = (Instant::now(), process_cpu());
            if busy {
                wire = scrape(addr);
                scrape_t.push(t.elapsed());
                busy_cpu += process_cpu() - c;
            } else {
                scrape(empty_addr);
                empty_t.push(t.elapsed());
                empty_cpu += process_cpu() - c;
            }
        }
    }
    for (stop, server) in [(stop, server), (empty_stop, empty_server)] {
        stop.send(true).unwrap();
        rt.block_on(server).unwrap().unwrap();
    }

    println!(
        "scrape: {GPUS} GPUs, {CONTAINERS} containers ({} regions, {} processes), {size} bytes of text ({wire} on the wire)",
        CONTAINERS,
        handles.len()
    );
    percentiles("sample (100 regions)", sample_t);
    percentiles("render", render_t);
    percentiles("scrape over loopback", scrape_t);
    percentiles("baseline: empty node scrape", empty_t);
    let per = |d: Duration| format!("{:.3} ms", d.as_secs_f64() * 1e3 / ROUNDS as f64);
    println!(
        "CPU per call (whole process): sample + render {:.3} ms; scrape {} vs empty node {}",
        sample_render_cpu.as_secs_f64() * 1e3,
        per(busy_cpu),
        per(empty_cpu)
    );
    tessera_daemon::state::mount::detach_all_under(tmp.path());
}
