//! What one `/metrics` scrape costs on a busy node: 8 GPUs, 100 containers (100 real accounting
//! regions, 4 live processes each, two shares per container on one GPU and one on another).
//!
//! - `cargo bench -p tessera-daemon --bench scrape` (in process): p50/p99 of sampling the
//!   regions, of rendering, and of a whole scrape over loopback, with CPU time per call (this
//!   process's, where the server runs). Baseline, interleaved with the busy node's scrapes on the
//!   same server code: a node with the same GPUs and no containers. `TESSERA_SCRAPE_ROUNDS` sets
//!   the rounds (300; fewer under callgrind).
//! - `cargo bench -p tessera-daemon --bench scrape -- daemon` (after a release build of the
//!   workspace): the built `tesserad` on the simulated node, the same 100 containers made through
//!   the kubelet's Allocate, 400 processes joined to their regions. The daemon's CPU time (from
//!   `/proc/<pid>/stat`) while the real `tessera top` CLI refreshes at 1 Hz, against the same
//!   time with no client before and after (`TESSERA_TOP_SECS` each, 30); then per `GetUsage` and
//!   per `/metrics` scrape.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_daemon::state::{AllocDirs, AllocatedDevice, Allocation, ContainerIdentity, Source};
use tessera_daemon::telemetry::{self, GpuMetrics, MetricsSource, NodeMetrics};
use tessera_daemon::usage::UsageSampler;
use tessera_region::Region;

const GPUS: u32 = 8;
const CONTAINERS: usize = 100;
const PROCS: usize = 4;
/// Rounds of the in-process bench, unless `TESSERA_SCRAPE_ROUNDS` says otherwise.
const ROUNDS: usize = 300;
/// Seconds of each phase of the daemon mode, unless `TESSERA_TOP_SECS` says otherwise.
const TOP_SECS: u64 = 30;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

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
            kubelet_withdrawn: Default::default(),
            filesystems: Vec::new(),
            park: Default::default(),
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
    // A real driver's call latency (docs/sim.md), unless TESSERA_SIM_LATENCY says otherwise.
    tessera_sim_testkit::real_driver_latency_unless_set();
    // `cargo bench` passes `--bench`; the mode is the first other argument.
    match std::env::args().skip(1).find(|a| !a.starts_with('-')).as_deref() {
        Some("daemon") => daemon_mode::run(),
        Some(other) => panic!("unknown mode {other:?}: none (in process) or \"daemon\""),
        None => in_process(env_or("TESSERA_SCRAPE_ROUNDS", ROUNDS)),
    }
}

fn in_process(rounds: usize) {
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
        let dev = |id: String, uuid: &str| AllocatedDevice::new(id, uuid, Some(4 << 30), Some(10));
        let a = Allocation {
            id: format!("alloc{c:04}"),
            resource: "tessera.io/share".into(),
            container: ContainerIdentity::of_pod("bench", format!("pod-{c}"), "main"),
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
    let (mut sample_cpu, mut render_cpu) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let (t, c) = (Instant::now(), process_cpu());
        let m = node.sample();
        sample_t.push(t.elapsed());
        sample_cpu += process_cpu() - c;
        let (t, c) = (Instant::now(), process_cpu());
        size = telemetry::render(&m).len();
        render_t.push(t.elapsed());
        render_cpu += process_cpu() - c;
    }

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (addr, stop, server) = serve(&rt, node.clone());
    let (empty_addr, empty_stop, empty_server) = serve(&rt, empty.clone());
    scrape(addr);
    scrape(empty_addr);
    // Interleaved: busy node, empty node, empty node, busy node, ...
    let (mut scrape_t, mut empty_t) = (Vec::new(), Vec::new());
    let (mut busy_cpu, mut empty_cpu) = (Duration::ZERO, Duration::ZERO);
    let mut wire = 0;
    for i in 0..rounds {
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
    let per = |d: Duration| format!("{:.3} ms", d.as_secs_f64() * 1e3 / rounds as f64);
    println!(
        "CPU per call (whole process): sample {}, render {}; scrape {} vs empty node {}",
        per(sample_cpu),
        per(render_cpu),
        per(busy_cpu),
        per(empty_cpu)
    );
    tessera_daemon::state::mount::detach_all_under(tmp.path());
}

#[path = "../tests/common/mod.rs"]
mod common;

/// The built daemon, measured from outside: its CPU time while `tessera top` runs at 1 Hz, per
/// `GetUsage`, per `/metrics` scrape.
mod daemon_mode {
    use std::collections::BTreeMap;
    use std::io::Read;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use tessera_daemon::state::AllocDirs;
    use tessera_proto::deviceplugin::v1beta1::{AllocateRequest, ContainerAllocateRequest, Empty};
    use tessera_proto::tessera::v1::{GetUsageRequest, ListDevicesRequest};
    use tessera_region::Region;
    use tessera_sim_testkit::SimNode;

    use super::{CONTAINERS, PROCS, TOP_SECS, common, env_or, percentiles};

    /// CPU time (user + system) of process `pid` so far, all its threads, from `/proc/<pid>/stat`
    /// (clock ticks: 10 ms here).
    fn cpu_of(pid: u32) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("proc stat");
        // Fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')').expect("comm") + 2..];
        let f: Vec<u64> = rest.split(' ').skip(11).take(2).map(|v| v.parse().expect("a number")).collect();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        Duration::from_nanos((f[0] + f[1]) * 1_000_000_000 / hz)
    }

    fn share(cpu: Duration, over: Duration) -> String {
        format!(
            "{:.3}% of a core ({:.0} ms CPU in {:.1} s)",
            cpu.as_secs_f64() / over.as_secs_f64() * 100.0,
            cpu.as_secs_f64() * 1e3,
            over.as_secs_f64()
        )
    }

    pub fn run() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(measure());
    }

    async fn measure() {
        let secs = Duration::from_secs(env_or("TESSERA_TOP_SECS", TOP_SECS));
        // 8 x H100, 40 shares each: room for 100 containers of three shares.
        let node = SimNode::new();
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        let metrics = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr");
        let config = common::write_config(
            &node,
            dir,
            &format!("[telemetry]\nmetrics_listen = \"{metrics}\"\n[partitions.default]\nshares = {{ count = 40 }}\n"),
        );
        let mut kubelet = common::TestKubelet::start(&dir.join("plugins"));
        let (daemon, _) = common::spawn(&node, &config, &dir.join("no-notify"), &dir.join("tesserad.log"));
        let pid = daemon.0.id();
        let reg = kubelet.next_registration().await.0;
        let mut client = kubelet.connect(&reg).await;
        let mut list = client.list_and_watch(Empty {}).await.expect("list").into_inner();
        let mut by_gpu: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for d in common::next_list(&mut list).await.devices {
            let (gpu, _) = d.id.split_once("::").expect("a share id is <GPU uuid>::<n>");
            by_gpu.entry(gpu.to_string()).or_default().push(d.id.clone());
        }
        let gpus: Vec<(String, Vec<String>)> = by_gpu.into_iter().collect();
        let mut taken = vec![0; gpus.len()];
        let mut take = |g: usize| {
            taken[g] += 1;
            gpus[g].1[taken[g] - 1].clone()
        };

        // 100 containers through Allocate, two shares of one GPU and one of the next; 4
        // processes in each (a handle of their own each: a process as the region sees it).
        let dirs = AllocDirs::new(&dir.join("run"));
        let mut processes = Vec::new();
        for c in 0..CONTAINERS {
            let (g, h) = (c % gpus.len(), (c + 1) % gpus.len());
            let devices_ids = vec![take(g), take(g), take(h)];
            let answer = client
                .allocate(AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids }] })
                .await
                .expect("allocate")
                .into_inner();
            let id = &answer.container_responses[0].envs["TESSERA_ALLOCATION"];
            for p in 0..PROCS {
                let r = Region::open_or_create(&dirs.region_path(id)).expect("region");
                let slot = r.join().expect("join");
                for uuid in [&gpus[g].0, &gpus[h].0] {
                    let d = r.device(uuid).expect("device");
                    r.try_reserve(slot, d, (p as u64 + 1) << 20, None).expect("reserve");
                    for _ in 0..10 {
                        r.record_launch(slot, d);
                    }
                    r.record_gpu_time(slot, d, 1_000_000);
                }
                processes.push(r);
            }
        }
        let socket = dir.join("run/tessera.sock");
        let mut api = common::node_api(&socket).await;
        let usage = api.get_usage(GetUsageRequest::default()).await.expect("GetUsage").into_inner();
        assert_eq!(usage.containers.len(), CONTAINERS);
        assert_eq!(usage.containers.iter().map(|c| c.processes as usize).sum::<usize>(), processes.len());
        assert!(scrape(metrics).1 > 100_000, "a scrape of 100 containers");
        tokio::time::sleep(Duration::from_secs(2)).await;

        // Idle, `tessera top` at 1 Hz, idle again.
        let idle = |secs: Duration| async move {
            let (c, t) = (cpu_of(pid), Instant::now());
            tokio::time::sleep(secs).await;
            (cpu_of(pid) - c, t.elapsed())
        };
        let idle_before = idle(secs).await;
        let mut top = Command::new(tessera_sim_testkit::binary("tessera"))
            .arg("--socket")
            .arg(&socket)
            .args(["top", "--interval-ms", "1000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run tessera top");
        let (c, t) = (cpu_of(pid), Instant::now());
        let top_pid = top.id();
        let mut out = top.stdout.take().expect("stdout");
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            text
        });
        tokio::time::sleep(secs).await;
        let (with_top, top_time) = (cpu_of(pid) - c, t.elapsed());
        let top_cpu = cpu_of(top_pid);
        top.kill().expect("kill tessera top");
        top.wait().expect("wait tessera top");
        let frames = reader.join().expect("reader").matches("tessera top ").count();
        assert!(frames as u64 + 2 >= secs.as_secs(), "tessera top drew {frames} frames in {secs:?}");
        let idle_after = idle(secs).await;

        // Per call, back to back.
        const CALLS: u32 = 100;
        let c = cpu_of(pid);
        for _ in 0..CALLS {
            api.get_usage(GetUsageRequest::default()).await.expect("GetUsage");
        }
        let per_usage = (cpu_of(pid) - c) / CALLS;
        let c = cpu_of(pid);
        for _ in 0..CALLS {
            api.list_devices(ListDevicesRequest::default()).await.expect("ListDevices");
        }
        let per_list = (cpu_of(pid) - c) / CALLS;
        let (c, mut walls) = (cpu_of(pid), Vec::new());
        for _ in 0..CALLS {
            walls.push(scrape(metrics).0);
        }
        let per_scrape = (cpu_of(pid) - c) / CALLS;
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();

        println!(
            "daemon: built tesserad, 8 GPUs, {CONTAINERS} containers, {} processes; load average {}",
            processes.len(),
            load.split(' ').take(3).collect::<Vec<_>>().join(" ")
        );
        println!("  idle before:               {}", share(idle_before.0, idle_before.1));
        println!("  tessera top at 1 Hz:       {}; {frames} frames", share(with_top, top_time));
        println!("  idle after:                {}", share(idle_after.0, idle_after.1));
        let baseline = (idle_before.0 + idle_after.0).as_secs_f64() / (idle_before.1 + idle_after.1).as_secs_f64();
        println!(
            "  top's cost to the daemon:  {:.3}% of a core (with top minus the idle average); the CLI itself {:.0} ms CPU",
            (with_top.as_secs_f64() / top_time.as_secs_f64() - baseline) * 100.0,
            top_cpu.as_secs_f64() * 1e3
        );
        println!("  daemon CPU per GetUsage:    {:.3} ms ({CALLS} back to back)", per_usage.as_secs_f64() * 1e3);
        println!("  daemon CPU per ListDevices: {:.3} ms ({CALLS} back to back)", per_list.as_secs_f64() * 1e3);
        println!("  daemon CPU per /metrics:    {:.3} ms ({CALLS} back to back)", per_scrape.as_secs_f64() * 1e3);
        percentiles("  /metrics over loopback", walls);
        drop(processes);
        drop(daemon);
    }

    /// One `GET /metrics`: its wall time and the bytes of the answer.
    fn scrape(addr: std::net::SocketAddr) -> (Duration, usize) {
        let t = Instant::now();
        let bytes = super::scrape(addr);
        (t.elapsed(), bytes)
    }
}
