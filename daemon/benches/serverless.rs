//! Serverless costs (issue 11), against the built tesserad on the simulated node (run with
//! `scripts/bench.sh serverless` as root; figures in docs/benchmarks.md):
//!
//! - node API `Allocate` latency p50/p99 with 1,000 live allocations, beside a no-op RPC on the
//!   same socket and client (`Trace` with no allocation id: refused before any work), interleaved,
//!   as the baseline (ratio in one run);
//! - cold start: from `Allocate` to a container's first successful CUDA call (`cuInit`, a context,
//!   `cuMemAlloc` under libtessera.so, on the simulated GPU), minus the same container without a
//!   GPU (from the same instant to its `main`), with runc (through `tessera-runtime`) and with
//!   containerd (`ctr run --runc-binary tessera-runtime`); p50 and p90 of each, in paired rounds
//!   (one with a GPU, one without, the order alternating), and the GPU's cost as the median of the
//!   per-round differences: robust to the runtime's own drift, which p50 minus p50 is not.
//!
//! Not a test: nothing here asserts a time; the goals are printed beside the figures. Needs root,
//! runc, containerd, ctr and a C compiler; the cold start part says why it is skipped otherwise.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::containerd::Containerd;
use common::spawn;
use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tessera_sim_testkit::{SimNode, binary, profile_dir};
use tonic::transport::Channel;

const LIVE: usize = 1000;
const SAMPLES: usize = 300;
/// Cold-start rounds per runtime (`TESSERA_BENCH_COLD_RUNS` overrides): containerd's own start
/// varies by more than the GPU's cost, so the estimate needs many paired rounds.
const COLD_RUNS: usize = 40;

fn cold_runs() -> usize {
    std::env::var("TESSERA_BENCH_COLD_RUNS").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(COLD_RUNS)
}

/// The container's program: with an argument `gpu` it loads the CUDA driver, makes a context and
/// allocates 1 MiB; it prints CLOCK_MONOTONIC (ns) when that succeeded, or at the start of `main`
/// without the argument.
const PROGRAM: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
typedef int (*fn_i)(unsigned);
typedef int (*fn_get)(int *, int);
typedef int (*fn_ctx)(void **, unsigned, int);
typedef int (*fn_alloc)(unsigned long long *, size_t);
static unsigned long long now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + t.tv_nsec;
}
int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "gpu") != 0) { printf("%llu\n", now()); return 0; }
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    fn_i init = (fn_i)dlsym(h, "cuInit");
    fn_get get = (fn_get)dlsym(h, "cuDeviceGet");
    fn_ctx ctx = (fn_ctx)dlsym(h, "cuCtxCreate_v2");
    fn_alloc alloc = (fn_alloc)dlsym(h, "cuMemAlloc_v2");
    int dev = 0; void *c = 0; unsigned long long p = 0; int r;
    if ((r = init(0)) || (r = get(&dev, 0)) || (r = ctx(&c, 0, dev)) || (r = alloc(&p, 1 << 20))) {
        fprintf(stderr, "CUDA error %d\n", r); return 3;
    }
    printf("%llu\n", now());
    return 0;
}
"#;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The runtime dir on tmpfs, as `/run` is on a GPU host; the state dir on disk (real fsyncs).
struct Run {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    run: tempfile::TempDir,
}

impl Drop for Run {
    fn drop(&mut self) {
        tessera_daemon::state::mount::detach_all_under(self.run.path());
    }
}

impl Run {
    fn new() -> Run {
        let tmp = tempfile::tempdir().expect("tempdir");
        let shm = Path::new("/dev/shm");
        let run = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }.expect("runtime dir");
        Run { dir: tmp.path().to_path_buf(), _tmp: tmp, run }
    }

    fn config(&self, node: &SimNode, extra: &str) -> PathBuf {
        std::fs::create_dir_all(self.dir.join("plugins")).expect("plugins");
        let path = self.dir.join("config.toml");
        std::fs::write(
            &path,
            format!(
                "nvml_library = {:?}\ndevice_plugin_dir = {:?}\nstate_dir = {:?}\nruntime_dir = {:?}\n{extra}\n",
                node.nvml_path(),
                self.dir.join("plugins"),
                self.dir.join("state"),
                self.run.path(),
            ),
        )
        .expect("config");
        path
    }
}

async fn client(socket: &Path) -> NodeClient<Channel> {
    common::node_api(socket).await
}

fn share(memory: u64) -> api::AllocateRequest {
    api::AllocateRequest {
        memory_bytes: memory,
        sm_percent: 1,
        // Work-conserving percents are not summed: 1,000 allocations fit on 8 GPUs.
        compute_mode: api::ComputeMode::WorkConserving as i32,
        ..Default::default()
    }
}

/// The CPU time tesserad's threads have used (user + system, from each thread's `schedstat`):
/// the request path's threads, and the spare directory thread (it refills in the background).
#[derive(Debug, Clone, Copy, Default)]
struct DaemonCpu {
    request: Duration,
    spares: Duration,
}

fn daemon_cpu(pid: u32) -> DaemonCpu {
    let mut cpu = DaemonCpu::default();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return cpu };
    for task in tasks.flatten() {
        let path = task.path();
        let ns = std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
            .unwrap_or(0);
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.starts_with("tessera-spare") {
            cpu.spares += Duration::from_nanos(ns);
        } else {
            cpu.request += Duration::from_nanos(ns);
        }
    }
    cpu
}

/// `tesserad` as spawned, or under the command in `TESSERA_BENCH_DAEMON_WRAPPER` (e.g.
/// `valgrind --tool=callgrind --collect-atstart=no`), for profiles of the same workload.
fn spawn_daemon(node: &SimNode, config: &Path, dir: &Path) -> common::Daemon {
    let Some(wrapper) = std::env::var("TESSERA_BENCH_DAEMON_WRAPPER").ok().filter(|w| !w.trim().is_empty()) else {
        return spawn(node, config, &dir.join("notify"), &dir.join("tesserad.log")).0;
    };
    common::unmount_at_exit(dir);
    let log = std::fs::File::create(dir.join("tesserad.log")).expect("log file");
    let mut words = wrapper.split_whitespace();
    let child = node
        .command(words.next().expect("a wrapper command"))
        .args(words)
        .arg(tessera_sim_testkit::binary("tesserad"))
        .arg("--config")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn the wrapped tesserad");
    common::Daemon(child)
}

async fn allocate_latency() {
    let node = SimNode::new();
    let run = Run::new();
    let config = run.config(&node, "");
    let daemon = spawn_daemon(&node, &config, &run.dir);
    let pid = daemon.0.id();
    let socket = run.run.path().join("tessera.sock");
    // A daemon under a profiler starts many times slower than the client's usual wait.
    let started = Instant::now();
    while !socket.exists() && started.elapsed() < Duration::from_secs(300) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut c = client(&socket).await;
    let mut fill = Vec::with_capacity(LIVE);
    for _ in 0..LIVE {
        let t = Instant::now();
        c.allocate(share(256 << 20)).await.expect("allocate");
        fill.push(t.elapsed());
    }
    if let Ok(pause) = std::env::var("TESSERA_BENCH_PAUSE_AFTER_FILL") {
        // Time to switch a profiler's collection on (callgrind_control -i on).
        println!("filled: {LIVE} allocations; pausing {pause} s");
        tokio::time::sleep(Duration::from_secs(pause.parse().unwrap_or(5))).await;
    }
    let (mut alloc, mut noop) = (Vec::with_capacity(SAMPLES), Vec::with_capacity(SAMPLES));
    let (mut alloc_cpu, mut release_cpu, mut noop_cpu) = (Vec::new(), Vec::new(), Vec::new());
    let loop_start = daemon_cpu(pid);
    for _ in 0..SAMPLES {
        let before = daemon_cpu(pid);
        let t = Instant::now();
        let _ = c.trace(api::TraceRequest::default()).await.expect_err("a Trace without an id is refused");
        noop.push(t.elapsed());
        let between = daemon_cpu(pid);
        let t = Instant::now();
        let id = c.allocate(share(256 << 20)).await.expect("allocate").into_inner().allocation.expect("allocation").id;
        alloc.push(t.elapsed());
        let after = daemon_cpu(pid);
        c.release(api::ReleaseRequest { allocation_id: id }).await.expect("release");
        let released = daemon_cpu(pid);
        noop_cpu.push(between.request.saturating_sub(before.request));
        alloc_cpu.push(after.request.saturating_sub(between.request));
        release_cpu.push(released.request.saturating_sub(after.request));
    }
    let loop_end = daemon_cpu(pid);
    if std::env::var_os("TESSERA_BENCH_DAEMON_WRAPPER").is_some() {
        // A profiler writes its output when the daemon exits: stop it, rather than kill it.
        // SAFETY: kill(2) on our own child's pid; it touches no memory of ours.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        let mut daemon = daemon;
        let _ = daemon.0.wait();
    }
    for v in [&mut fill, &mut alloc, &mut noop, &mut alloc_cpu, &mut release_cpu, &mut noop_cpu] {
        v.sort();
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "tesserad CPU per call (request threads, thread schedstat; {SAMPLES} samples): Allocate p50 {:.0} us, \
         mean {:.0} us; Release p50 {:.0} us; no-op RPC p50 {:.0} us; spare directory thread per Allocate \
         {:.0} us",
        us(percentile(&alloc_cpu, 0.5)),
        us(alloc_cpu.iter().sum::<Duration>() / SAMPLES as u32),
        us(percentile(&release_cpu, 0.5)),
        us(percentile(&noop_cpu, 0.5)),
        us(loop_end.spares.saturating_sub(loop_start.spares) / SAMPLES as u32),
    );
    let (a50, a99, n50, n99) =
        (percentile(&alloc, 0.5), percentile(&alloc, 0.99), percentile(&noop, 0.5), percentile(&noop, 0.99));
    println!(
        "Allocate with {LIVE} live allocations ({SAMPLES} samples): p50 {:.3} ms, p99 {:.3} ms; no-op RPC p50 {:.3} ms, \
         p99 {:.3} ms; ratio p50 {:.1}, p99 {:.1} (goal: p50 < 1 ms, p99 < 3 ms)",
        ms(a50),
        ms(a99),
        ms(n50),
        ms(n99),
        a50.as_secs_f64() / n50.as_secs_f64(),
        a99.as_secs_f64() / n99.as_secs_f64()
    );
    println!(
        "Allocate while filling to {LIVE}: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms (the spare pool of 8 runs dry in a burst)",
        ms(percentile(&fill, 0.5)),
        ms(percentile(&fill, 0.99)),
        ms(*fill.last().expect("samples"))
    );
}

/// Why the cold start part cannot run here, if it cannot.
fn cold_start_missing() -> Option<String> {
    let root = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")));
    if !root {
        return Some("containers need root".into());
    }
    for tool in ["runc", "containerd", "ctr", "cc", "ldd"] {
        if Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().map_or(true, |o| !o.status.success())
        {
            return Some(format!("{tool} is not installed"));
        }
    }
    None
}

/// A root file system holding the compiled program and every library it, the shim and the
/// simulated driver load (copied from the host at their paths).
fn rootfs(dir: &Path) -> PathBuf {
    let root = dir.join("rootfs");
    for d in ["bin", "dev", "proc", "sys", "etc", "tmp", "run", "usr/lib/x86_64-linux-gnu"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    let src = dir.join("coldstart.c");
    std::fs::write(&src, PROGRAM).expect("program");
    let out = Command::new("cc").args(["-O2", "-o"]).arg(root.join("bin/coldstart")).arg(&src).arg("-ldl").output();
    let out = out.expect("cc");
    assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
    let objects =
        [root.join("bin/coldstart"), profile_dir().join("libtessera.so"), profile_dir().join("libtessera_sim.so")];
    for o in &objects {
        let ldd = Command::new("ldd").arg(o).output().expect("ldd");
        for line in String::from_utf8_lossy(&ldd.stdout).lines() {
            let path = line.split_whitespace().find(|w| w.starts_with('/')).map(PathBuf::from);
            if let Some(p) = path.filter(|p| p.is_file()) {
                let to = root.join(p.strip_prefix("/").expect("absolute"));
                std::fs::create_dir_all(to.parent().expect("parent")).expect("mkdir");
                std::fs::copy(std::fs::canonicalize(&p).expect("resolve"), &to).expect("copy a library");
            }
        }
    }
    root
}

/// The host as runtimes see it: device nodes, a driver root whose `libcuda.so.1` is the
/// simulated driver, the hook's configuration.
struct Host {
    dev: PathBuf,
    driver: PathBuf,
    hook_config: PathBuf,
}

fn host(dir: &Path, run: &Path) -> Host {
    let dev = dir.join("dev");
    std::fs::create_dir_all(&dev).expect("dev");
    for (name, minor) in [("nvidia0", 0), ("nvidiactl", 255)] {
        let st = Command::new("mknod").arg(dev.join(name)).args(["c", "195", &minor.to_string()]).status();
        assert!(st.expect("mknod").success());
    }
    let driver = dir.join("driver");
    let lib = driver.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).expect("driver");
    for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        std::fs::copy(profile_dir().join("libtessera_sim.so"), lib.join(name)).expect("the simulated driver");
    }
    let hook_config = dir.join("hook.toml");
    std::fs::write(
        &hook_config,
        format!(
            "cdi_spec_dirs = [{:?}]\nruntime_dir = {:?}\ndriver_root = {:?}\ndev_root = {:?}\nshim_path = {:?}\nruntime = \"runc\"\n",
            dir.join("cdi"),
            run,
            driver,
            dev,
            profile_dir().join("libtessera.so"),
        ),
    )
    .expect("hook config");
    Host { dev, driver, hook_config }
}

/// An OCI bundle running the program (`gpu` or not) with `env`, the simulated node's files
/// mounted where its env points.
fn bundle(dir: &Path, name: &str, rootfs: &Path, node: &SimNode, gpu: bool, env: &[String]) -> PathBuf {
    let b = dir.join(name);
    std::fs::create_dir_all(&b).expect("bundle");
    let out = Command::new("runc").arg("spec").current_dir(&b).output().expect("runc spec");
    assert!(out.status.success());
    let mut oci: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).expect("read")).expect("json");
    oci["root"] = serde_json::json!({ "path": rootfs.display().to_string(), "readonly": false });
    oci["process"]["terminal"] = serde_json::json!(false);
    let args = if gpu { vec!["/bin/coldstart", "gpu"] } else { vec!["/bin/coldstart"] };
    oci["process"]["args"] = serde_json::json!(args);
    let process_env = oci["process"]["env"].as_array_mut().expect("env");
    for (k, v) in node.env() {
        if k != "LD_LIBRARY_PATH" {
            process_env.push(serde_json::json!(format!("{k}={}", v.to_string_lossy())));
        }
    }
    for e in env {
        process_env.push(serde_json::json!(e));
    }
    for (_, v) in node.env().into_iter().filter(|(k, _)| k.starts_with("TESSERA_SIM")) {
        let host = PathBuf::from(v);
        let parent = host.parent().expect("a directory").display().to_string();
        oci["mounts"].as_array_mut().expect("mounts").push(serde_json::json!({
            "destination": parent, "type": "bind", "source": parent, "options": ["rbind", "rw"],
        }));
    }
    std::fs::write(b.join("config.json"), oci.to_string()).expect("write");
    b
}

/// The monotonic time the program printed.
fn printed(out: &std::process::Output, what: &str) -> u64 {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .lines()
        .last()
        .unwrap_or("")
        .parse()
        .unwrap_or_else(|_| panic!("{what}: no time printed: {text}{}", String::from_utf8_lossy(&out.stderr)))
}

fn mono_ns() -> u64 {
    tessera_sim_model::monotonic_ns()
}

fn containerd(dir: &Path, hook_config: &Path) -> Containerd {
    let base = dir.join("containerd");
    std::fs::create_dir_all(&base).expect("containerd dir");
    let config = base.join("config.toml");
    std::fs::write(&config, "version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n").expect("config");
    let log = std::fs::File::create(base.join("containerd.log")).expect("log");
    let d = Containerd::start(&base, &config, hook_config, log.try_clone().expect("log"), log);
    assert!(d.answers(), "containerd did not answer");
    d
}

async fn cold_start() {
    if let Some(why) = cold_start_missing() {
        println!("cold start: skipped ({why})");
        return;
    }
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let run = Run::new();
    let dir = run.dir.clone();
    let h = host(&dir, run.run.path());
    let extra = format!(
        "[injection]\ncdi_spec_dir = {:?}\ndriver_root = {:?}\ndev_root = {:?}\nshim_path = {:?}\nhook_path = {:?}\n",
        dir.join("cdi"),
        h.driver,
        h.dev,
        profile_dir().join("libtessera.so"),
        binary("tessera-hook"),
    );
    let config = run.config(&node, &extra);
    let log = dir.join("tesserad.log");
    let (_daemon, _) = spawn(&node, &config, &dir.join("notify"), &log);
    let mut c = client(&run.run.path().join("tessera.sock")).await;
    let rootfs = rootfs(&dir);
    let ctrd = containerd(&dir, &h.hook_config);
    let wrapper = binary("tessera-runtime");
    let state = dir.join("runc-state");

    let runs = cold_runs();
    let mut results: Vec<(&str, Vec<Duration>, Vec<Duration>)> =
        vec![("runc", vec![], vec![]), ("ctr", vec![], vec![])];
    for i in 0..runs {
        for (runtime, gpu_times, plain_times) in results.iter_mut() {
            // Alternate which of the pair goes first, so neither side always follows the other.
            let order = if i % 2 == 0 { [true, false] } else { [false, true] };
            for gpu in order {
                let name = format!("{runtime}-{i}-{}", if gpu { "gpu" } else { "plain" });
                let t0 = mono_ns();
                let mut env = Vec::new();
                let mut id = None;
                if gpu {
                    let a = c.allocate(share(1 << 30)).await.expect("allocate").into_inner();
                    id = a.allocation.map(|a| a.id);
                    env = a.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
                }
                let out = if *runtime == "runc" {
                    let b = bundle(&dir, &name, &rootfs, &node, gpu, &env);
                    Command::new(&wrapper)
                        .env("TESSERA_HOOK_CONFIG", &h.hook_config)
                        .arg("--root")
                        .arg(&state)
                        .args(["run", "--bundle", b.to_str().expect("utf-8"), &name])
                        .stdin(Stdio::null())
                        .output()
                        .expect("tessera-runtime run")
                } else {
                    let mut cmd = Command::new("ctr");
                    cmd.arg("--address").arg(&ctrd.sock).args(["--namespace", "bench", "run", "--rm"]);
                    cmd.arg("--runc-binary").arg(&wrapper);
                    for (k, v) in node.env() {
                        if k != "LD_LIBRARY_PATH" {
                            cmd.args(["--env", &format!("{k}={}", v.to_string_lossy())]);
                        }
                        if k.starts_with("TESSERA_SIM") {
                            let p = PathBuf::from(&v).parent().expect("dir").display().to_string();
                            cmd.args(["--mount", &format!("type=bind,src={p},dst={p},options=rbind:rw")]);
                        }
                    }
                    for e in &env {
                        cmd.args(["--env", e]);
                    }
                    cmd.arg("--rootfs").arg(&rootfs).arg(&name).arg("/bin/coldstart");
                    if gpu {
                        cmd.arg("gpu");
                    }
                    cmd.stdin(Stdio::null()).output().expect("ctr run")
                };
                let done = printed(&out, &name);
                let took = Duration::from_nanos(done.saturating_sub(t0));
                if gpu {
                    gpu_times.push(took)
                } else {
                    plain_times.push(took)
                }
                if let Some(id) = id {
                    c.release(api::ReleaseRequest { allocation_id: id }).await.expect("release");
                }
            }
        }
    }
    for (runtime, mut gpu, mut plain) in results {
        // Round i's GPU run minus round i's plain run, before sorting breaks the pairs.
        let mut diffs: Vec<f64> = gpu.iter().zip(&plain).map(|(g, p)| ms(*g) - ms(*p)).collect();
        diffs.sort_by(f64::total_cmp);
        let d = |q: f64| diffs[((diffs.len() as f64 - 1.0) * q).round() as usize];
        gpu.sort();
        plain.sort();
        let (g50, p50) = (percentile(&gpu, 0.5), percentile(&plain, 0.5));
        let (g90, p90) = (percentile(&gpu, 0.9), percentile(&plain, 0.9));
        println!(
            "cold start, {runtime} ({runs} paired rounds): Allocate → first CUDA success p50 {:.1} ms, p90 {:.1} ms; \
             the same container without a GPU → main p50 {:.1} ms, p90 {:.1} ms; ratio of p50s {:.2}; \
             GPU cost, median of the rounds' differences {:.1} ms (quartiles {:.1} / {:.1} ms; p50 minus p50 {:.1} ms) \
             (goal: cost < 10 ms at p50)",
            ms(g50),
            ms(g90),
            ms(p50),
            ms(p90),
            g50.as_secs_f64() / p50.as_secs_f64(),
            d(0.5),
            d(0.25),
            d(0.75),
            ms(g50) - ms(p50),
        );
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    if only.as_deref().is_none_or(|o| "allocate".contains(o) || o == "serverless") {
        allocate_latency().await;
    }
    if only.as_deref().is_none_or(|o| "cold".contains(o) || o == "serverless") {
        cold_start().await;
    }
}
