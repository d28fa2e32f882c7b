//! tesserad's own costs, against the built daemon on the simulated node and the test kubelet
//! (run with `scripts/bench.sh daemon`; figures in docs/benchmarks.md):
//!
//! - start to registered: spawn → every resource registered with the kubelet, 8 x H100;
//! - Allocate latency p50/p99 over 1,000 allocations, beside the same client's no-op RPC
//!   (GetDevicePluginOptions) on the same socket, interleaved, as the baseline (ratio in one run);
//! - resident memory (VmRSS) at idle and holding 1,000 allocations;
//! - enforcement's cost per poll (in process): 8 x H100, 100 allocations, a bypassing workload
//!   process on the GPU per allocation (in a cgroup named after its container id when the bench
//!   runs as root), daemon CPU per poll beside NVML's own listing of the same processes.
//!
//! - idle CPU against the number of node API allocations (`idle`): two daemons side by side, one
//!   holding 10 allocations and one 1,000 (16 x H100, strict 1% shares), their CPU (utime +
//!   stime from `/proc/<pid>/stat`) over the same windows, a few passes; the ratio is the figure
//!   (issue 31: at most 1.5).
//!
//! With `TESSERA_BENCH_NVIDIA_PLUGIN=<nvidia-device-plugin binary>` (root; built from NVIDIA's
//! k8s-device-plugin, which is not part of this repository), NVIDIA's plugin runs beside tesserad
//! on the same simulated node (its NVML is the simulator's), 100 time-slicing replicas per GPU
//! for the same 1,000 devices, registered with a second test kubelet at its fixed
//! `/var/lib/kubelet/device-plugins`, and each paced Allocate of tesserad's is followed by one of
//! NVIDIA's, through the same client code.
//!
//! `TESSERA_BENCH_STATE_DIR=<dir>` puts tesserad's state directory under `<dir>` (a tmpfs such
//! as `/dev/shm`: the journal's flush then costs nothing, which shows what is not the disk's).
//!
//! Not a test: nothing here asserts a time; the goals are printed beside the figures.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{TestKubelet, spawn};
use tessera_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use tessera_proto::deviceplugin::v1beta1::{AllocateRequest, ContainerAllocateRequest, Empty};
use tessera_sim_testkit::SimNode;
use tonic::transport::Channel;

const STARTS: usize = 10;
const ALLOCATIONS: usize = 1000;
/// Allocations made one every few ms; the rest come in one burst.
const PACED: usize = 800;
/// No-op calls timed warm (the second of two back to back), per server.
const WARM_CALLS: usize = 300;

/// The runtime dir on tmpfs, as `/run` is on a GPU host (the per-allocation `limits` and
/// `region` live there); the state dir stays on disk, where its fsyncs are real.
fn runtime_dir() -> RuntimeDir {
    let shm = Path::new("/dev/shm");
    RuntimeDir(if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }.expect("runtime tempdir"))
}

/// A runtime dir whose regions' mounts (a tmpfs each, as root) go with it.
struct RuntimeDir(tempfile::TempDir);

impl RuntimeDir {
    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for RuntimeDir {
    fn drop(&mut self) {
        tessera_daemon::state::mount::detach_all_under(self.0.path());
    }
}

fn config(node: &SimNode, dir: &Path, run: &Path, partitions: &str) -> std::path::PathBuf {
    let path = dir.join("config.toml");
    std::fs::write(
        &path,
        format!(
            "nvml_library = {:?}\ndevice_plugin_dir = {:?}\nstate_dir = {:?}\nruntime_dir = {:?}\n{partitions}\n",
            node.nvml_path(),
            dir.join("plugins"),
            // TESSERA_BENCH_STATE_DIR=<dir>: the state elsewhere, e.g. on a tmpfs, where the
            // journal's fdatasync costs nothing: tesserad's Allocate without the disk's share.
            std::env::var_os("TESSERA_BENCH_STATE_DIR")
                .map(|d| Path::new(&d).join(bench_state_name(dir)))
                .unwrap_or_else(|| dir.join("state")),
            run,
        ),
    )
    .expect("config");
    path
}

fn durable_write(dir: &Path, i: usize) {
    use std::io::Write;
    let tmp = dir.join(format!("{i}.json.tmp"));
    let mut f = std::fs::File::create(&tmp).expect("create");
    f.write_all(&[b'x'; 400]).expect("write");
    f.sync_all().expect("fsync");
    std::fs::rename(&tmp, dir.join(format!("{i}.json"))).expect("rename");
    std::fs::File::open(dir).and_then(|d| d.sync_all()).expect("fsync dir");
}

/// The journal's primitive: one ~600-byte frame written in place into a file already zero-filled
/// (written, fsynced), then fdatasync, as the allocation store appends a change.
fn journal_write(file: &std::fs::File, i: usize) {
    use std::os::unix::fs::FileExt;
    const FRAME: usize = 600;
    file.write_all_at(&[b'x'; FRAME], (i * FRAME) as u64).expect("pwrite");
    file.sync_data().expect("fdatasync");
}

/// One Allocate of device `id`, timed from the call to the answer.
async fn allocate(client: &mut DevicePluginClient<Channel>, id: &str) -> Duration {
    let t = Instant::now();
    client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: vec![id.to_string()] }],
        })
        .await
        .expect("allocate");
    t.elapsed()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// CPU time tesserad's threads other than the spare directory thread have used (user + system,
/// from each thread's `schedstat`).
fn request_cpu(pid: u32) -> Duration {
    let mut cpu = Duration::ZERO;
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return cpu };
    for task in tasks.flatten() {
        if std::fs::read_to_string(task.path().join("comm")).is_ok_and(|c| c.starts_with("tessera-spare")) {
            continue;
        }
        let ns = std::fs::read_to_string(task.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
            .unwrap_or(0);
        cpu += Duration::from_nanos(ns);
    }
    cpu
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("a number")
}

async fn registered(
    kubelet: &mut TestKubelet,
    resources: usize,
) -> Vec<tessera_proto::deviceplugin::v1beta1::RegisterRequest> {
    let mut seen = std::collections::BTreeMap::new();
    while seen.len() < resources {
        let (req, _) = kubelet.next_registration().await;
        seen.insert(req.resource_name.clone(), req);
    }
    seen.into_values().collect()
}

async fn start_to_registered() {
    // 8 x H100 (the simulator's default node): GPU 0 whole, the other 7 split into 4 shares each.
    let node = SimNode::new();
    let mut times = Vec::new();
    for _ in 0..STARTS {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(tmp.path().join("plugins")).expect("plugins");
        let run = runtime_dir();
        let cfg = config(
            &node,
            tmp.path(),
            run.path(),
            "[partitions.default]\nshares = { count = 4 }\n[partitions.\"0\"]\nwhole = true\n",
        );
        let mut kubelet = TestKubelet::start(&tmp.path().join("plugins"));
        let (daemon, started) = spawn(&node, &cfg, &tmp.path().join("no-notify"), &tmp.path().join("log"));
        let regs = registered(&mut kubelet, 2).await;
        let last = regs.len();
        times.push(started.elapsed());
        drop(daemon);
        kubelet.stop().await;
        assert_eq!(last, 2);
    }
    times.sort();
    println!(
        "start to registered (8 GPUs, 2 resources, {STARTS} starts): p50 {:.1} ms, max {:.1} ms (goal: 300 ms)",
        percentile(&times, 0.5).as_secs_f64() * 1e3,
        times.last().expect("runs").as_secs_f64() * 1e3
    );
}

async fn allocate_and_rss() {
    // 10 GPUs x 100 shares: 1,000 distinct share devices, one allocation each.
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 10\n");
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(tmp.path().join("plugins")).expect("plugins");
    let run = runtime_dir();
    let cfg = config(&node, tmp.path(), run.path(), "[partitions.default]\nshares = { count = 100 }\n");
    let mut kubelet = TestKubelet::start(&tmp.path().join("plugins"));
    let (daemon, _) = spawn(&node, &cfg, &tmp.path().join("no-notify"), &tmp.path().join("log"));
    let regs = registered(&mut kubelet, 1).await;
    let mut client = kubelet.connect(&regs[0]).await;
    let mut list = client.list_and_watch(Empty {}).await.expect("list").into_inner();
    let devices = common::next_list(&mut list).await.devices;
    assert_eq!(devices.len(), ALLOCATIONS);
    let mut nvidia = NvidiaPlugin::start(&node, tmp.path()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = daemon.0.id();
    let idle = rss_kib(pid);
    let (mut alloc, mut noop, mut floor) = (Vec::new(), Vec::new(), Vec::new());
    let (mut alloc_cpu, mut noop_cpu) = (Vec::new(), Vec::new());
    let floor_dir = tmp.path().join("floor");
    std::fs::create_dir(&floor_dir).expect("floor dir");
    let mut journal_floor = Vec::new();
    let journal_file = {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(floor_dir.join("journal"))
            .expect("journal file");
        f.write_all(&vec![0u8; ALLOCATIONS * 600]).expect("zero fill");
        f.sync_all().expect("fsync");
        f
    };
    // Paced first: one Allocate every few ms (a kubelet starts containers far slower), so the
    // daemon's spare allocation directories are refilled between calls. Then a burst, back to
    // back, that drains them: past the 8 spares each Allocate makes its own region.
    let mut burst = Vec::new();
    for (i, d) in devices[..PACED].iter().enumerate() {
        // The previous store's write on the state dir's disk, for comparison: one record file
        // (tmp, fsync, rename, fsync the directory).
        let t = Instant::now();
        durable_write(&floor_dir, i);
        floor.push(t.elapsed());
        let t = Instant::now();
        journal_write(&journal_file, i);
        journal_floor.push(t.elapsed());
        let (t, cpu) = (Instant::now(), request_cpu(pid));
        client.get_device_plugin_options(Empty {}).await.expect("options");
        noop.push(t.elapsed());
        let between = request_cpu(pid);
        noop_cpu.push(between.saturating_sub(cpu));
        alloc.push(allocate(&mut client, &d.id).await);
        alloc_cpu.push(request_cpu(pid).saturating_sub(between));
        if let Some(n) = nvidia.as_mut() {
            n.call(i).await;
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    // The gRPC stacks alone: the second of two no-op calls back to back (the server awake, the
    // connection warm), tesserad's and NVIDIA's interleaved, 3 ms apart as above.
    let (mut warm, mut nvidia_warm) = (Vec::new(), Vec::new());
    for _ in 0..WARM_CALLS {
        client.get_device_plugin_options(Empty {}).await.expect("options");
        let t = Instant::now();
        client.get_device_plugin_options(Empty {}).await.expect("options");
        warm.push(t.elapsed());
        if let Some(n) = nvidia.as_mut() {
            nvidia_warm.push(n.warm_noop().await);
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    warm.sort();
    nvidia_warm.sort();
    for d in &devices[PACED..] {
        burst.push(allocate(&mut client, &d.id).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held = rss_kib(pid);
    alloc.sort();
    alloc_cpu.sort();
    noop_cpu.sort();
    burst.sort();
    noop.sort();
    floor.sort();
    journal_floor.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (a50, a99, n50, n99) =
        (percentile(&alloc, 0.5), percentile(&alloc, 0.99), percentile(&noop, 0.5), percentile(&noop, 0.99));
    println!(
        "Allocate, paced ({PACED} allocations, a durable record + limits + a region each): p50 {:.3} ms, p99 {:.3} ms (goal p99 < 1 ms)",
        ms(a50),
        ms(a99)
    );
    println!(
        "  burst ({} allocations back to back): p50 {:.3} ms, p99 {:.3} ms",
        burst.len(),
        ms(percentile(&burst, 0.5)),
        ms(percentile(&burst, 0.99))
    );
    println!(
        "  baseline no-op RPC on the same socket: p50 {:.3} ms, p99 {:.3} ms; Allocate / no-op at p50 = {:.1}x",
        ms(n50),
        ms(n99),
        a50.as_secs_f64() / n50.as_secs_f64()
    );
    print!(
        "  warm no-op (the second of two back to back, {WARM_CALLS} times): tesserad p50 {:.3} ms, p99 {:.3} ms",
        ms(percentile(&warm, 0.5)),
        ms(percentile(&warm, 0.99))
    );
    if nvidia_warm.is_empty() {
        println!();
    } else {
        println!(
            "; NVIDIA's plugin p50 {:.3} ms, p99 {:.3} ms",
            ms(percentile(&nvidia_warm, 0.5)),
            ms(percentile(&nvidia_warm, 0.99))
        );
    }
    println!(
        "  tesserad CPU per paced call (threads other than the spare one, schedstat): Allocate p50 {:.0} us, \
         the no-op RPC p50 {:.0} us",
        percentile(&alloc_cpu, 0.5).as_secs_f64() * 1e6,
        percentile(&noop_cpu, 0.5).as_secs_f64() * 1e6
    );
    println!(
        "  previous store's write (one record file: write, fsync, rename, fsync dir) on the same disk: p50 {:.3} ms, p99 {:.3} ms",
        ms(percentile(&floor, 0.5)),
        ms(percentile(&floor, 0.99))
    );
    println!(
        "  journal floor: one ~600-byte frame (pwrite into a zero-filled file, fdatasync) on the same disk: p50 {:.3} ms, p99 {:.3} ms",
        ms(percentile(&journal_floor, 0.5)),
        ms(percentile(&journal_floor, 0.99))
    );
    println!(
        "resident memory: idle {:.1} MB, with {ALLOCATIONS} allocations {:.1} MB (goal < 30 MB)",
        idle as f64 / 1024.0,
        held as f64 / 1024.0
    );
    if let Some(n) = nvidia {
        n.report().await;
    }
    drop(daemon);
}

/// NVIDIA's device plugin beside tesserad, when `TESSERA_BENCH_NVIDIA_PLUGIN` names its binary.
struct NvidiaPlugin {
    child: std::process::Child,
    kubelet: TestKubelet,
    client: DevicePluginClient<Channel>,
    devices: Vec<String>,
    alloc: Vec<Duration>,
    noop: Vec<Duration>,
    made_dir: bool,
}

impl NvidiaPlugin {
    /// Its socket directory is fixed; one a real kubelet uses (a `kubelet.sock` there) is left alone.
    const DIR: &str = "/var/lib/kubelet/device-plugins";

    async fn start(node: &SimNode, tmp: &Path) -> Option<NvidiaPlugin> {
        let bin = std::env::var_os("TESSERA_BENCH_NVIDIA_PLUGIN")?;
        let dir = Path::new(Self::DIR);
        if dir.join("kubelet.sock").exists() {
            println!("SKIP: NVIDIA's plugin: {} already holds a kubelet.sock", dir.display());
            return None;
        }
        let made_dir = !dir.exists();
        std::fs::create_dir_all(dir).expect("plugin dir");
        let mut kubelet = TestKubelet::start(dir);
        let config = tmp.join("nvidia-plugin.yaml");
        std::fs::write(
            &config,
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 100\n",
        )
        .expect("plugin config");
        let child = node
            .command(&bin)
            .arg("--config-file")
            .arg(&config)
            .arg("--fail-on-init-error=true")
            .stdout(std::fs::File::create(tmp.join("nvidia-plugin.log")).expect("log"))
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start NVIDIA's plugin");
        let (req, _) = kubelet.next_registration().await;
        let mut client = kubelet.connect(&req).await;
        let mut list = client.list_and_watch(Empty {}).await.expect("list").into_inner();
        let devices: Vec<String> = common::next_list(&mut list).await.devices.into_iter().map(|d| d.id).collect();
        println!("NVIDIA's plugin: {} registered {} devices", req.resource_name, devices.len());
        Some(NvidiaPlugin { child, kubelet, client, devices, alloc: Vec::new(), noop: Vec::new(), made_dir })
    }

    /// The same calls as tesserad's i-th paced one: a no-op, then an Allocate of a new device.
    async fn call(&mut self, i: usize) {
        let t = Instant::now();
        self.client.get_device_plugin_options(Empty {}).await.expect("options");
        self.noop.push(t.elapsed());
        let id = self.devices[i % self.devices.len()].clone();
        self.alloc.push(allocate(&mut self.client, &id).await);
    }

    /// Two no-op calls back to back; the second's time.
    async fn warm_noop(&mut self) -> Duration {
        self.client.get_device_plugin_options(Empty {}).await.expect("options");
        let t = Instant::now();
        self.client.get_device_plugin_options(Empty {}).await.expect("options");
        t.elapsed()
    }

    async fn report(mut self) {
        self.alloc.sort();
        self.noop.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "  NVIDIA's plugin, same client, interleaved: Allocate p50 {:.3} ms, p99 {:.3} ms; no-op p50 {:.3} ms, p99 {:.3} ms",
            ms(percentile(&self.alloc, 0.5)),
            ms(percentile(&self.alloc, 0.99)),
            ms(percentile(&self.noop, 0.5)),
            ms(percentile(&self.noop, 0.99))
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.kubelet.stop().await;
        if self.made_dir {
            let _ = std::fs::remove_dir(Self::DIR);
        }
    }
}

/// Where Allocate's time goes, in this process: the durable record (the journal, in the state
/// dir on disk) and the allocation directory (limits + region, on the runtime dir's tmpfs), taken
/// from a spare (the pool refilled between calls) or made on the spot.
fn breakdown() {
    use tessera_daemon::state::{AllocDirs, AllocatedDevice, Allocation, ContainerIdentity, Source, Store};
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = runtime_dir();
    let mut store = Store::open(&tmp.path().join("state")).expect("store");
    std::fs::create_dir(run.path().join("made")).expect("made");
    let made = AllocDirs::new(&run.path().join("made"));
    let spared = AllocDirs::new(&run.path().join("spared"));
    spared.keep_spares(8).expect("spares");
    let (mut insert, mut create, mut from_spare) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..300u64 {
        let alloc = Allocation {
            id: format!("{i:016x}"),
            resource: "tessera.io/gpu-share".into(),
            container: ContainerIdentity::default(),
            source: Source::Kubelet,
            created_unix_ns: i,
            devices: vec![AllocatedDevice::new(format!("GPU-0::{i}"), "GPU-0", Some(1 << 30), Some(10))],
            claim: None,
        };
        let t = Instant::now();
        store.insert(&alloc).expect("insert");
        insert.push(t.elapsed());
        let t = Instant::now();
        made.create(&alloc).expect("create");
        create.push(t.elapsed());
        let waited = Instant::now();
        while spared.spares_ready() < 8 {
            assert!(waited.elapsed() < Duration::from_secs(10), "the spare pool does not refill");
            std::thread::sleep(Duration::from_micros(200));
        }
        let t = Instant::now();
        spared.create(&alloc).expect("create from a spare");
        from_spare.push(t.elapsed());
    }
    insert.sort();
    create.sort();
    from_spare.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "  in-process: record insert (journal) p50 {:.3} ms p99 {:.3} ms; allocation directory from a spare p50 {:.3} ms p99 {:.3} ms, made on the spot p50 {:.3} ms p99 {:.3} ms",
        ms(percentile(&insert, 0.5)),
        ms(percentile(&insert, 0.99)),
        ms(percentile(&from_spare, 0.5)),
        ms(percentile(&from_spare, 0.99)),
        ms(percentile(&create, 0.5)),
        ms(percentile(&create, 0.99))
    );
}

/// The name of a bench daemon's state directory under `TESSERA_BENCH_STATE_DIR`: this process's
/// and the daemon's own temporary directory's (one state per daemon, as in `dir`).
fn bench_state_name(dir: &Path) -> String {
    format!("tessera-bench-{}-{}", std::process::id(), dir.file_name().unwrap_or_default().to_string_lossy())
}

fn main() {
    // A real driver's call latency (docs/sim.md), unless TESSERA_SIM_LATENCY says otherwise.
    tessera_sim_testkit::real_driver_latency_unless_set();
    // `cargo bench` passes --bench; a filter argument picks one part.
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    // In process and first: it points this process at its node before any other thread runs.
    if filter.as_deref().is_none_or(|f| f.contains("enforce")) {
        enforcement_cost();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    runtime.block_on(async {
        if filter.as_deref().is_none_or(|f| "start".contains(f) || f.contains("start")) {
            start_to_registered().await;
        }
        if filter.as_deref().is_none_or(|f| f.contains("alloc") || f.contains("rss")) {
            allocate_and_rss().await;
            breakdown();
        }
        if filter.as_deref().is_none_or(|f| f.contains("idle")) {
            idle_cpu().await;
        }
    });
    // The state directories put under TESSERA_BENCH_STATE_DIR go with the run.
    if let Some(d) = std::env::var_os("TESSERA_BENCH_STATE_DIR") {
        let mine = format!("tessera-bench-{}-", std::process::id());
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(&mine) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Thread CPU time (user + system) of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid out pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Enforcement's cost per poll: 8 GPUs, 100 allocations (shares), one process holding memory on
/// its GPU per allocation, attributed by cgroup when this runs as root (else all unattributed:
/// the same /proc reads, no cgroup match). Baseline, same run: NVML's listing alone.
fn enforcement_cost() {
    use std::sync::Arc;
    use tessera_daemon::config::Config;
    use tessera_daemon::enforcement::{self, Enforcer, Settings, Stats};
    const ALLOCS: usize = 100;
    const POLLS: u32 = 200;

    let node = SimNode::new();
    for (k, v) in node.env() {
        // SAFETY: main has started no other thread yet (the runtime is built after this).
        unsafe { std::env::set_var(k, v) };
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = runtime_dir();
    let path = config(
        &node,
        tmp.path(),
        run.path(),
        "[partitions.default]\nshares = { count = 13 }\n[enforcement]\naction = \"report\"\n",
    );
    let cfg = Config::load(&path, true).expect("config");
    let session = tessera_daemon::discovery::Session::open(cfg.nvml_library.as_deref(), false).expect("session");
    std::fs::create_dir_all(&cfg.state_dir).expect("state dir");
    let store = tessera_daemon::state::Store::open(&cfg.state_dir).expect("store");
    let events = Arc::new(tessera_daemon::events::EventBus::new(10, None));
    let source = tessera_daemon::node::ConfigSource { path: path.clone(), explicit: true };
    let (controller, _) =
        tessera_daemon::node::NodeController::start(session, cfg.clone(), source, store, events).expect("controller");
    let controller = Arc::new(controller);
    let view = controller.view();
    let resource = "tessera.io/gpu-share";
    let shares: Vec<_> = view.shares.iter().take(ALLOCS).cloned().collect();
    assert_eq!(shares.len(), ALLOCS, "13 shares on each of 8 GPUs");

    let cgroups = std::path::Path::new("/sys/fs/cgroup/pids");
    let root = cgroups.join(format!("tessera-bench-{}", std::process::id()));
    let as_root = std::fs::create_dir(&root).is_ok();
    let mut workers = Vec::new();
    for (i, share) in shares.iter().enumerate() {
        use tessera_daemon::kubelet::Allocator as _;
        let answer = controller.allocator().allocate(resource, std::slice::from_ref(&share.id)).expect("allocate");
        let id = answer.envs["TESSERA_ALLOCATION"].clone();
        let cid = format!("{:064x}", (std::process::id() as u128) << 64 | i as u128);
        let container =
            tessera_region::owner::ContainerIdentity { container_id: Some(cid.clone()), ..Default::default() };
        let owner = tessera_region::owner::Owner { container, ..Default::default() };
        owner.write(&controller.allocator().dirs().dir(&id)).expect("owner record");
        let gpu = view.inventory.gpu_by_uuid(&share.parent_uuid).expect("the share's GPU").index;
        let exe = tessera_sim_testkit::binary("tessera-workload");
        let args = format!("--device {gpu} --alloc-mib 64 --hold 600");
        let script = if as_root {
            let cg = root.join(&cid);
            std::fs::create_dir(&cg).expect("cgroup");
            format!("echo $$ > {:?} && exec {exe:?} {args}", cg.join("cgroup.procs"))
        } else {
            format!("exec {exe:?} {args}")
        };
        let mut child = node
            .command("/bin/sh")
            .arg("-c")
            .arg(script)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("workload");
        let mut line = String::new();
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        std::io::BufRead::read_line(&mut out, &mut line).expect("read");
        assert!(line.contains("holding"), "{line}");
        workers.push((child, out));
    }

    let stats = Arc::new(Stats::default());
    let mut enforcer = Enforcer::new(Arc::clone(&controller), Arc::clone(&stats));
    // Every share here is strict at 7-8% SM: all 100 are judged for SM time too. The same poll
    // with SM time off (a second enforcer, its own windows) is the baseline for that part.
    let settings = Settings { action: enforcement::Action::Report, ..Settings::default() };
    let memory_only =
        Settings { sm_action: Some(tessera_daemon::config::enforcement::SmAction::Off), ..settings.clone() };
    let mut memory_enforcer = Enforcer::new(Arc::clone(&controller), stats);
    let first = enforcer.poll(&settings);
    memory_enforcer.poll(&memory_only);
    let (mut poll_cpu, mut list_cpu, mut poll_wall) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut memory_cpu = Duration::ZERO;
    let mut last = first.clone();
    for _ in 0..POLLS {
        // Interleaved: the listing alone, a poll without SM time, then a whole poll.
        let c = thread_cpu();
        let listed = enforcement::sample::sample(controller.session().nvml(), &controller.view().inventory);
        list_cpu += thread_cpu() - c;
        assert_eq!(listed.processes.len(), ALLOCS);
        let c = thread_cpu();
        memory_enforcer.poll(&memory_only);
        memory_cpu += thread_cpu() - c;
        let (c, w) = (thread_cpu(), Instant::now());
        last = enforcer.poll(&settings);
        poll_cpu += thread_cpu() - c;
        poll_wall += w.elapsed();
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(POLLS);
    let core_at = |us: f64, interval_ms: f64| us / (interval_ms * 1e3) * 100.0;
    println!(
        "enforcement, 8 GPUs, {ALLOCS} allocations, {} processes ({} attributed{}):",
        last.processes,
        last.attributed,
        if as_root { ", by cgroup" } else { "; not root: no cgroups, all unattributed" }
    );
    println!(
        "  per poll: CPU {:.0} µs (wall {:.0} µs) = {:.2}% of one core at 500 ms | baseline NVML listing alone: CPU {:.0} µs | ratio {:.1}",
        per(poll_cpu),
        per(poll_wall),
        core_at(per(poll_cpu), 500.0),
        per(list_cpu),
        per(poll_cpu) / per(list_cpu)
    );
    println!(
        "  SM time's part: poll without it CPU {:.0} µs, with it {:.0} µs: +{:.0} µs (ratio {:.2})",
        per(memory_cpu),
        per(poll_cpu),
        per(poll_cpu) - per(memory_cpu),
        per(poll_cpu) / per(memory_cpu)
    );
    assert!(last.killed.is_empty() && last.events == 0, "a steady node: nothing to do ({last:?})");
    for (mut child, _) in workers {
        let _ = child.kill();
        let _ = child.wait();
    }
    if as_root {
        for (i, _) in shares.iter().enumerate() {
            let _ = std::fs::remove_dir(root.join(format!("{:064x}", (std::process::id() as u128) << 64 | i as u128)));
        }
        let _ = std::fs::remove_dir(&root);
    }
}

/// utime + stime of process `pid` (every thread, the exited ones too), from `/proc/<pid>/stat`.
fn process_cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("proc stat");
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    // Fields after comm start with field 3 (state); utime and stime are fields 14 and 15.
    let f: Vec<u64> = rest.split_whitespace().skip(11).take(2).map(|v| v.parse().expect("ticks")).collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis((f[0] + f[1]) * 1000 / hz)
}

/// Idle CPU against the number of node API allocations: one daemon with 10, one with 1,000, idle
/// side by side, measured over the same windows (`TESSERA_BENCH_IDLE_SECONDS`, default 20; 3
/// passes). Nothing is asked of either while measured.
async fn idle_cpu() {
    use tessera_proto::tessera::v1 as api;
    const COUNTS: [usize; 2] = [10, 1000];
    let window = Duration::from_secs(
        std::env::var("TESSERA_BENCH_IDLE_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(20),
    );
    // 16 GPUs: 1,000 strict 1% shares fit (100 a GPU).
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 16\n");
    let mut daemons = Vec::new();
    for n in COUNTS {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(tmp.path().join("plugins")).expect("plugins");
        let run = runtime_dir();
        let cfg = config(&node, tmp.path(), run.path(), "");
        let (daemon, _) = spawn(&node, &cfg, &tmp.path().join("no-notify"), &tmp.path().join("log"));
        let mut api = common::node_api(&run.path().join("tessera.sock")).await;
        let ask = api::AllocateRequest {
            memory_bytes: 64 << 20,
            sm_percent: 1,
            compute_mode: api::ComputeMode::Strict as i32,
            ..Default::default()
        };
        for _ in 0..n {
            api.allocate(ask.clone()).await.expect("allocate");
        }
        daemons.push((n, daemon, tmp, run));
    }
    // Let the spare directories refill and the first passes open what they open.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut ratios = Vec::new();
    for pass in 0..3 {
        let before: Vec<Duration> = daemons.iter().map(|(_, d, _, _)| process_cpu(d.0.id())).collect();
        tokio::time::sleep(window).await;
        let used: Vec<Duration> =
            daemons.iter().zip(&before).map(|((_, d, _, _), b)| process_cpu(d.0.id()).saturating_sub(*b)).collect();
        let pct = |d: Duration| d.as_secs_f64() * 100.0 / window.as_secs_f64();
        let ratio = used[1].as_secs_f64() / used[0].as_secs_f64().max(1e-3);
        println!(
            "idle pass {pass}: {} allocations {:.0} ms CPU ({:.2}% of a core), {} allocations {:.0} ms ({:.2}%): ratio {ratio:.2}",
            COUNTS[0],
            used[0].as_secs_f64() * 1e3,
            pct(used[0]),
            COUNTS[1],
            used[1].as_secs_f64() * 1e3,
            pct(used[1]),
        );
        ratios.push(ratio);
    }
    println!("idle CPU ratio, 1,000 : 10 allocations, per pass: {ratios:.2?} (goal: at most 1.5)");
}
