//! The control path beside NVIDIA's device plugin, in one run (issue 34, item 5;
//! `scripts/bench.sh control_path`, which builds NVIDIA's k8s-device-plugin from its Go module
//! and names its binary in `TESSERA_BENCH_NVIDIA_DEVICE_PLUGIN`; figures in docs/benchmarks.md).
//!
//! tesserad and NVIDIA's `nvidia-device-plugin` serve the same simulated node (8 x H100, each
//! GPU offered as 32 devices: tesserad's `shares = { count = 32 }`, NVIDIA's plugin with
//! time-slicing at 32 replicas, over a driver root from `tessera-sim install --driver-root`) to
//! the same test kubelet (`tests/common`), through the same client code. Each round, in
//! alternating order:
//!
//! - start → registered with the kubelet, and start → the first ListAndWatch answer listing all
//!   256 devices healthy: each plugin started alone, with a fresh kubelet;
//! - then both started beside each other on one kubelet, and the kubelet's calls for a container
//!   made to each in turn, call by call, 3 ms apart: GetPreferredAllocation (2 of the 256), then
//!   Allocate of one device never asked for before in the round: for tesserad a new record each
//!   time (a journal frame flushed to its state directory on the disk, an allocation directory
//!   with limits and a region), for NVIDIA's plugin an answer from memory.
//!
//! The ratios (tesserad / NVIDIA) are printed beside the goals: Allocate p50 at most
//! 1.5x, p99 at most 2x.
//!
//! NVIDIA's plugin puts its socket in the kubelet's fixed directory
//! (`/var/lib/kubelet/device-plugins`, a constant of its build); it runs in a mount namespace of
//! its own where the test kubelet's directory is bind-mounted there, so a real kubelet on this
//! machine is never touched. Root only. `TESSERA_BENCH_ROUNDS` (default 5) and
//! `TESSERA_BENCH_CALLS` (per plugin per round, default 100) size the run;
//! `TESSERA_BENCH_STATE_DIR=<dir>` puts tesserad's state directories there instead of on the
//! disk (a tmpfs such as `/dev/shm`: tesserad without the disk's flush). Beside each of
//! tesserad's Allocates the floor of a durable record on the same file system is timed: a
//! 600-byte frame written in place, then fdatasync.
//!
//! Not a test: nothing here asserts a time.

#[path = "../tests/common/mod.rs"]
mod common;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Daemon, TestKubelet};
use tessera_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use tessera_proto::deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty, PreferredAllocationRequest,
    RegisterRequest,
};
use tessera_sim_testkit::{SimNode, binary};
use tonic::transport::Channel;

/// The kubelet's device-plugin directory, fixed in NVIDIA's plugin.
const KUBELET_DIR: &str = "/var/lib/kubelet/device-plugins";
const GPUS: usize = 8;
/// Devices offered per GPU by each plugin (shares, time-slicing replicas).
const PER_GPU: usize = 32;
const DEVICES: usize = GPUS * PER_GPU;

#[derive(Clone, Copy, PartialEq)]
enum Plugin {
    Tesserad,
    Nvidia,
}

impl Plugin {
    fn name(self) -> &'static str {
        match self {
            Plugin::Tesserad => "tesserad",
            Plugin::Nvidia => "NVIDIA's plugin",
        }
    }

    /// Both, the first one alternating with `round`.
    fn in_turn(round: usize) -> [Plugin; 2] {
        if round.is_multiple_of(2) { [Plugin::Tesserad, Plugin::Nvidia] } else { [Plugin::Nvidia, Plugin::Tesserad] }
    }
}

/// The node both serve, and what each is started with.
struct Bench {
    node: SimNode,
    nvidia: PathBuf,
    /// `tessera-sim install --driver-root` of `node`, for NVIDIA's plugin.
    driver: PathBuf,
    /// tesserad's runtime directory (allocation directories, regions) on a tmpfs, as `/run` is.
    run: tempfile::TempDir,
    tmp: tempfile::TempDir,
    starts: usize,
    /// Where tesserad's state directories go: on the disk, as `/var/lib/tessera` is; under
    /// `TESSERA_BENCH_STATE_DIR` when set (a tmpfs such as `/dev/shm`: tesserad without the
    /// disk's flush).
    state: tempfile::TempDir,
    /// A zero-filled file beside tesserad's state directories: the journal's floor.
    floor: std::fs::File,
}

impl Bench {
    /// Starts `plugin` registering with the kubelet in `dir` (killed when dropped); the moment
    /// just before the spawn.
    fn start(&mut self, plugin: Plugin, dir: &Path) -> (Daemon, Instant) {
        self.starts += 1;
        let log = self.tmp.path().join(format!("{}-{}.log", self.starts, plugin.name().replace(['\'', ' '], "")));
        match plugin {
            Plugin::Tesserad => {
                let cfg = self.tmp.path().join(format!("tesserad-{}", self.starts));
                std::fs::create_dir(&cfg).expect("config dir");
                let path = cfg.join("config.toml");
                std::fs::write(
                    &path,
                    format!(
                        "nvml_library = {:?}\ndevice_plugin_dir = {dir:?}\nstate_dir = {:?}\nruntime_dir = {:?}\n\
                         [partitions.default]\nshares = {{ count = {PER_GPU} }}\n",
                        self.node.nvml_path(),
                        self.state.path().join(self.starts.to_string()),
                        self.run.path().join(self.starts.to_string()),
                    ),
                )
                .expect("tesserad config");
                common::spawn(&self.node, &path, &cfg.join("no-notify"), &log)
            }
            Plugin::Nvidia => {
                let source = CString::new(dir.as_os_str().as_bytes()).expect("no NUL in the path");
                let target = CString::new(KUBELET_DIR).expect("no NUL");
                let config = self.tmp.path().join("nvidia-plugin.yaml");
                std::fs::write(
                    &config,
                    format!(
                        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {PER_GPU}\n"
                    ),
                )
                .expect("NVIDIA's plugin's config");
                let mut cmd = self.node.command(&self.nvidia);
                cmd.arg("--config-file")
                    .arg(&config)
                    .arg("--nvidia-driver-root")
                    .arg(&self.driver)
                    .args(["--kubelet-socket", &format!("{KUBELET_DIR}/kubelet.sock"), "--fail-on-init-error=true"])
                    .env("LD_LIBRARY_PATH", self.driver.join("usr/lib/x86_64-linux-gnu"))
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&log).expect("log"));
                // SAFETY: between fork and exec the closure makes only raw system calls (no
                // allocation: both paths were made above), as `pre_exec` requires.
                unsafe {
                    cmd.pre_exec(move || bind_kubelet_dir(&source, &target));
                }
                let started = Instant::now();
                (Daemon(cmd.spawn().expect("start NVIDIA's device plugin")), started)
            }
        }
    }
}

/// The floor of a durable record on the state directory's file system: one journal-sized frame
/// (600 bytes) written in place into a zero-filled file, then fdatasync, as tesserad's journal.
fn journal_floor(file: &std::fs::File, i: usize) -> Duration {
    use std::os::unix::fs::FileExt;
    let t = Instant::now();
    file.write_all_at(&[i as u8 | 1; 600], (i % 1000) as u64 * 600).expect("floor write");
    file.sync_data().expect("floor fdatasync");
    t.elapsed()
}

/// In the child: a mount namespace of its own, where `source` is mounted over `target` (no
/// change is seen outside it).
fn bind_kubelet_dir(source: &CString, target: &CString) -> std::io::Result<()> {
    let check = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
    // SAFETY: plain system calls on NUL-terminated strings that outlive them.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        check(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ))?;
        check(libc::mount(source.as_ptr(), target.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()))
    }
}

/// The next registration of `plugin`'s resource (tesserad's `tessera.io/…`, NVIDIA's
/// `nvidia.com/gpu`) and when it came.
async fn registration(kubelet: &mut TestKubelet, plugin: Plugin) -> (RegisterRequest, Instant) {
    loop {
        let (req, at) = kubelet.next_registration().await;
        if req.resource_name.starts_with("nvidia.com/") == (plugin == Plugin::Nvidia) {
            return (req, at);
        }
    }
}

/// Connects as the kubelet and waits for a ListAndWatch answer listing all devices healthy: the
/// client and the device ids.
async fn all_listed(kubelet: &TestKubelet, req: &RegisterRequest) -> (DevicePluginClient<Channel>, Vec<String>) {
    let mut client = kubelet.connect(req).await;
    let mut list = client.list_and_watch(Empty {}).await.expect("ListAndWatch").into_inner();
    loop {
        let devices = common::next_list(&mut list).await.devices;
        if devices.len() == DEVICES && devices.iter().all(|d| d.health == "Healthy") {
            return (client, devices.into_iter().map(|d| d.id).collect());
        }
    }
}

/// What was timed for one plugin.
#[derive(Default)]
struct Times {
    registered: Vec<Duration>,
    listed: Vec<Duration>,
    preferred: Vec<Duration>,
    allocate: Vec<Duration>,
    /// The journal's floor (tesserad's slot only), timed just before each of its Allocates.
    floor: Vec<Duration>,
    /// Each round's Allocate p50.
    round_allocate_p50: Vec<Duration>,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn sorted(v: &[Duration]) -> Vec<Duration> {
    let mut v = v.to_vec();
    v.sort();
    v
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn measure(bench: &mut Bench, rounds: usize, calls: usize) -> [Times; 2] {
    let mut times = [Times::default(), Times::default()];
    let slot = |p: Plugin| if p == Plugin::Tesserad { 0 } else { 1 };
    for round in 0..rounds {
        // Start-up: each alone, with a kubelet of its own that listens before it starts.
        for plugin in Plugin::in_turn(round) {
            let dir = tempfile::tempdir().expect("kubelet dir");
            let mut kubelet = TestKubelet::start(dir.path());
            let (running, started) = bench.start(plugin, dir.path());
            let (req, at) = registration(&mut kubelet, plugin).await;
            let t = &mut times[slot(plugin)];
            t.registered.push(at - started);
            let _ = all_listed(&kubelet, &req).await;
            t.listed.push(started.elapsed());
            drop(running);
            kubelet.stop().await;
        }
        // The kubelet's calls for a container, to both on one kubelet, in turn.
        let dir = tempfile::tempdir().expect("kubelet dir");
        let mut kubelet = TestKubelet::start(dir.path());
        let mut served = Vec::new();
        for plugin in Plugin::in_turn(round) {
            let (running, _) = bench.start(plugin, dir.path());
            let (req, _) = registration(&mut kubelet, plugin).await;
            let (client, ids) = all_listed(&kubelet, &req).await;
            served.push((plugin, running, client, ids));
        }
        let mut round_allocate = [Vec::new(), Vec::new()];
        for i in 0..calls {
            // Who goes first alternates call by call.
            for k in 0..2 {
                let (plugin, _, client, ids) = &mut served[(i + k) % 2];
                tokio::time::sleep(Duration::from_millis(3)).await;
                let t = Instant::now();
                let answer = client
                    .get_preferred_allocation(PreferredAllocationRequest {
                        container_requests: vec![ContainerPreferredAllocationRequest {
                            available_device_i_ds: ids.clone(),
                            must_include_device_i_ds: Vec::new(),
                            allocation_size: 2,
                        }],
                    })
                    .await
                    .expect("GetPreferredAllocation");
                let preferred = t.elapsed();
                assert_eq!(answer.into_inner().container_responses[0].device_i_ds.len(), 2, "{}", plugin.name());
                let t = Instant::now();
                client
                    .allocate(AllocateRequest {
                        container_requests: vec![ContainerAllocateRequest { devices_ids: vec![ids[i].clone()] }],
                    })
                    .await
                    .expect("Allocate");
                let allocate = t.elapsed();
                let s = slot(*plugin);
                if *plugin == Plugin::Tesserad {
                    times[s].floor.push(journal_floor(&bench.floor, i));
                }
                times[s].preferred.push(preferred);
                times[s].allocate.push(allocate);
                round_allocate[s].push(allocate);
            }
        }
        for (s, v) in round_allocate.iter().enumerate() {
            times[s].round_allocate_p50.push(percentile(&sorted(v), 0.5));
        }
        drop(served);
        kubelet.stop().await;
        let [a, b] = &times;
        println!(
            "round {}: Allocate p50 tesserad {:.3} ms, NVIDIA's plugin {:.3} ms",
            round + 1,
            ms(*a.round_allocate_p50.last().expect("a round")),
            ms(*b.round_allocate_p50.last().expect("a round"))
        );
    }
    times
}

fn report(times: &[Times; 2], rounds: usize, calls: usize) {
    let [ours, theirs] = times;
    let line = |what: &str, a: &[Duration], b: &[Duration], p: f64, goal: &str| {
        let (a, b) = (percentile(&sorted(a), p), percentile(&sorted(b), p));
        println!(
            "  {what}: tesserad {:.3} ms, NVIDIA's plugin {:.3} ms, ratio {:.2}{goal}",
            ms(a),
            ms(b),
            a.as_secs_f64() / b.as_secs_f64()
        );
    };
    println!(
        "control path beside NVIDIA's device plugin (8 x H100, {PER_GPU} devices each, {rounds} rounds, interleaved):"
    );
    line("start → registered, p50", &ours.registered, &theirs.registered, 0.5, "");
    line("start → registered, max", &ours.registered, &theirs.registered, 1.0, "");
    line("start → first ListAndWatch with all devices, p50", &ours.listed, &theirs.listed, 0.5, "");
    line("start → first ListAndWatch with all devices, max", &ours.listed, &theirs.listed, 1.0, "");
    let n = rounds * calls;
    line(&format!("Allocate, a new record ({n} each), p50"), &ours.allocate, &theirs.allocate, 0.5, " (goal ≤ 1.5)");
    line(&format!("Allocate, a new record ({n} each), p99"), &ours.allocate, &theirs.allocate, 0.99, " (goal ≤ 2)");
    line(
        &format!("GetPreferredAllocation, 2 of {DEVICES} ({n} each), p50"),
        &ours.preferred,
        &theirs.preferred,
        0.5,
        "",
    );
    line(
        &format!("GetPreferredAllocation, 2 of {DEVICES} ({n} each), p99"),
        &ours.preferred,
        &theirs.preferred,
        0.99,
        "",
    );
    let floor = sorted(&ours.floor);
    let (floor50, theirs50) = (percentile(&floor, 0.5), percentile(&sorted(&theirs.allocate), 0.5));
    println!(
        "  journal floor on tesserad's state file system (600-byte frame, fdatasync), interleaved: p50 {:.3} ms, p99 {:.3} ms",
        ms(floor50),
        ms(percentile(&floor, 0.99))
    );
    println!(
        "  the floor's p50 against NVIDIA's whole Allocate p50: {:.2}; tesserad's Allocate p50 less the floor's: {:.3} ms, ratio {:.2}",
        floor50.as_secs_f64() / theirs50.as_secs_f64(),
        ms(percentile(&sorted(&ours.allocate), 0.5).saturating_sub(floor50)),
        percentile(&sorted(&ours.allocate), 0.5).saturating_sub(floor50).as_secs_f64() / theirs50.as_secs_f64()
    );
    let mut ratios: Vec<f64> = ours
        .round_allocate_p50
        .iter()
        .zip(&theirs.round_allocate_p50)
        .map(|(a, b)| a.as_secs_f64() / b.as_secs_f64())
        .collect();
    ratios.sort_by(f64::total_cmp);
    println!(
        "  Allocate p50 ratio per round: min {:.2}, median {:.2}, max {:.2}",
        ratios[0],
        ratios[ratios.len() / 2],
        ratios[ratios.len() - 1]
    );
}

fn main() {
    // A real driver's call latency (docs/sim.md) for both, unless TESSERA_SIM_LATENCY says otherwise.
    tessera_sim_testkit::real_driver_latency_unless_set();
    let Some(nvidia) = std::env::var_os("TESSERA_BENCH_NVIDIA_DEVICE_PLUGIN") else {
        println!(
            "SKIP: TESSERA_BENCH_NVIDIA_DEVICE_PLUGIN is not set (scripts/bench.sh control_path builds NVIDIA's plugin and sets it)"
        );
        return;
    };
    if !nix::unistd::geteuid().is_root() {
        println!("SKIP: NVIDIA's plugin is run in a mount namespace of its own, which needs root");
        return;
    }
    let var = |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    // Each call of a round asks for a device not asked for before in it.
    let (rounds, calls) = (var("TESSERA_BENCH_ROUNDS", 5).max(1), var("TESSERA_BENCH_CALLS", 100).clamp(1, DEVICES));
    // Where NVIDIA's plugin's view of the kubelet's directory is mounted; made empty where no
    // kubelet ever ran (the host's own is never written to).
    std::fs::create_dir_all(KUBELET_DIR).expect("the kubelet's device-plugin directory");
    let node = SimNode::new();
    let tmp = tempfile::tempdir().expect("tempdir");
    let driver = tmp.path().join("driver");
    let out = node.command(binary("tessera-sim")).arg("install").arg("--driver-root").arg(&driver).output();
    let out = out.expect("tessera-sim install");
    assert!(out.status.success(), "tessera-sim install --driver-root: {}", String::from_utf8_lossy(&out.stderr));
    let run = tempfile::tempdir_in("/dev/shm").expect("runtime dir on /dev/shm");
    let state = match std::env::var_os("TESSERA_BENCH_STATE_DIR") {
        Some(dir) => tempfile::tempdir_in(dir),
        None => tempfile::tempdir_in(tmp.path()),
    }
    .expect("state dir");
    let floor = {
        let f = tempfile::tempfile_in(state.path()).expect("floor file");
        std::os::unix::fs::FileExt::write_all_at(&f, &vec![0u8; 1000 * 600], 0).expect("zero fill");
        f.sync_all().expect("fsync");
        f
    };
    let mut bench = Bench { node, nvidia: PathBuf::from(nvidia), driver, run, tmp, starts: 0, state, floor };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let times = runtime.block_on(measure(&mut bench, rounds, calls));
    report(&times, rounds, calls);
    // The regions' mounts (a tmpfs each, as root) go with the runtime directory.
    tessera_daemon::state::mount::detach_all_under(bench.run.path());
}
