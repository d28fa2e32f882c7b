//! Park and resume (issue 33, item 8), on the simulated node: time per GiB, as a ratio to the
//! host link's one-way bandwidth (PCIe 5 x16, about 50 GB/s = 46.6 GiB/s), at two layers:
//!
//! - the driver: `park::Checkpointer` on a `tessera-workload` outside any allocation, each step
//!   timed (lock, checkpoint; restore, unlock), as a checkpoint tool calls them;
//! - tesserad: the node API's `Park` and `Resume` of an allocation whose process runs under
//!   libtessera.so, timed at the client (the RPC whole: journal, region, driver, event) beside the
//!   driver's part tesserad reports (`duration_nanos`).
//!
//! Each round parks and resumes one process of each kind for every size, the two kinds' order
//! alternating by round, so both see the machine alike. The workloads write every byte they hold
//! (`--verify`), so the pages moved are real. Sizes in MiB from `TESSERA_BENCH_PARK_MIB` (default
//! `256,1024`), rounds from `TESSERA_BENCH_PARK_ROUNDS` (default 15). Run as root (the
//! allocation's host paths are root's): `cargo bench -p tessera-daemon --bench park`, after
//! `cargo build --release -p tessera-daemon --bins -p tessera-sim-driver -p tessera-shim
//! -p tessera-workload`. Not a test: nothing here asserts a time.

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use tessera_daemon::park::Checkpointer;
use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tessera_sim_testkit::{SimNode, binary, profile_dir, spawn_workload};
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
/// PCIe 5 x16 one way, about 50 GB/s: in GiB/s.
const LINK_GIB_S: f64 = 50e9 / GIB;

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn sizes_mib() -> Vec<u64> {
    let text = std::env::var("TESSERA_BENCH_PARK_MIB").unwrap_or_else(|_| "256,1024".into());
    text.split(',').filter_map(|s| s.trim().parse().ok()).filter(|&m| m > 0).collect()
}

/// A workload, killed and waited for when dropped (a failed run leaves none behind).
struct Held(Child);

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A workload holding `mib` MiB, every byte written, until dropped.
fn holder(node: &SimNode, mib: u64, env: &[(String, String)], shim: bool) -> (Held, u32) {
    let mut cmd = node.command(binary("tessera-workload"));
    cmd.args(["--alloc-mib", &mib.to_string(), "--chunk-mib", "256", "--verify", "--hold", "3600"]);
    if shim {
        cmd.env("LD_PRELOAD", profile_dir().join("libtessera.so"));
    }
    cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let (child, pid, _lines) = spawn_workload(&mut cmd);
    (Held(child), pid)
}

/// Times of one kind of step over the rounds.
#[derive(Default)]
struct Samples(Vec<Duration>);

impl Samples {
    fn push(&mut self, d: Duration) {
        self.0.push(d);
    }
    fn quantile(&self, q: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        v[((v.len() as f64 - 1.0) * q).round() as usize]
    }
}

/// What one size's rounds measured.
#[derive(Default)]
struct Size {
    /// Bytes one park moves (tesserad's answer: the region's books of its process).
    bytes: u64,
    lock: Samples,
    checkpoint: Samples,
    restore: Samples,
    unlock: Samples,
    api_park: Samples,
    api_park_driver: Samples,
    api_resume: Samples,
    api_resume_driver: Samples,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One row: p50 (p90) ms, ms per GiB and the ratio to the link at p50.
fn row(what: &str, s: &Samples, bytes: u64) {
    let (p50, p90) = (s.quantile(0.5), s.quantile(0.9));
    let gib = bytes as f64 / GIB;
    let per_gib = ms(p50) / gib;
    let gib_s = gib / p50.as_secs_f64().max(1e-9);
    println!(
        "  {what:<34} p50 {:>8.3} ms  p90 {:>8.3} ms  {per_gib:>8.3} ms/GiB  {gib_s:>8.1} GiB/s  ratio to the link {:.2}",
        ms(p50),
        ms(p90),
        gib_s / LINK_GIB_S
    );
}

fn time<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let v = f();
    (v, t.elapsed())
}

/// The driver's four steps on `pid`, each timed.
fn driver_round(ck: &Checkpointer, pid: u32, s: &mut Size) {
    let ((), d) = time(|| ck.lock(pid, Some(Duration::from_secs(10))).expect("lock"));
    s.lock.push(d);
    let ((), d) = time(|| ck.checkpoint(pid).expect("checkpoint"));
    s.checkpoint.push(d);
    let ((), d) = time(|| ck.restore(pid).expect("restore"));
    s.restore.push(d);
    let ((), d) = time(|| ck.unlock(pid).expect("unlock"));
    s.unlock.push(d);
}

/// tesserad's Park and Resume of allocation `id`, timed at the client.
async fn api_round(c: &mut NodeClient<Channel>, id: &str, s: &mut Size) {
    let t = Instant::now();
    let parked = c.park(api::ParkRequest { allocation_id: id.into(), ..Default::default() }).await.expect("park");
    s.api_park.push(t.elapsed());
    let parked = parked.into_inner();
    s.bytes = parked.bytes;
    s.api_park_driver.push(Duration::from_nanos(parked.duration_nanos));
    let t = Instant::now();
    let resumed = c.resume(api::ResumeRequest { allocation_id: id.into() }).await.expect("resume");
    s.api_resume.push(t.elapsed());
    s.api_resume_driver.push(Duration::from_nanos(resumed.into_inner().duration_nanos));
}

fn main() {
    // A real driver's call latency (docs/sim.md) unless TESSERA_SIM_LATENCY says otherwise; the
    // checkpoint calls themselves have no modelled latency: what they cost is the pages moved.
    tessera_sim_testkit::real_driver_latency_unless_set();
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    // This process calls the checkpoint API as tesserad does: pointed at the node (no cuInit).
    for (k, v) in node.env() {
        // SAFETY: no other thread runs yet.
        unsafe { std::env::set_var(k, v) };
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    runtime.block_on(measure(&node));
}

async fn measure(node: &SimNode) {
    let sizes = sizes_mib();
    let rounds: usize = env_or("TESSERA_BENCH_PARK_ROUNDS", 15).max(1);
    let dir = tempfile::tempdir().expect("a directory");
    let config = common::write_config(node, dir.path(), "");
    let _daemon = common::spawn(node, &config, &dir.path().join("notify"), &dir.path().join("tesserad.log")).0;
    let mut c = common::node_api(&dir.path().join("run/tessera.sock")).await;
    let ck = Checkpointer::load(&node.cuda_path()).expect("the checkpoint API");

    // Per size: a plain process for the driver, and one in an allocation for tesserad.
    let mut held: Vec<(u32, String, Held, Held)> = Vec::new();
    for &mib in &sizes {
        let (plain, plain_pid) = holder(node, mib, &[], false);
        let share = api::AllocateRequest { memory_bytes: (mib + 512) * MIB, sm_percent: 10, ..Default::default() };
        let a = c.allocate(share).await.expect("allocate").into_inner();
        let id = a.allocation.expect("the allocation").id;
        let (inside, _) = holder(node, mib, &a.env.into_iter().collect::<Vec<_>>(), true);
        held.push((plain_pid, id, plain, inside));
    }

    let mut results: Vec<Size> = sizes.iter().map(|_| Size::default()).collect();
    for round in 0..rounds {
        for ((pid, id, _, _), s) in held.iter().zip(results.iter_mut()) {
            if round % 2 == 0 {
                driver_round(&ck, *pid, s);
                api_round(&mut c, id, s).await;
            } else {
                api_round(&mut c, id, s).await;
                driver_round(&ck, *pid, s);
            }
        }
    }

    println!(
        "park and resume on the simulated node, {rounds} rounds; the link: PCIe 5 x16 one way, {LINK_GIB_S:.1} GiB/s ({:.1} ms/GiB)",
        1e3 / LINK_GIB_S
    );
    for (&mib, s) in sizes.iter().zip(&results) {
        println!(
            "{mib} MiB written by the process, {:.1} MiB moved by each park (tesserad's answer):",
            s.bytes as f64 / MIB as f64
        );
        let bytes = s.bytes.max(1);
        row("driver: lock", &s.lock, bytes);
        row("driver: checkpoint", &s.checkpoint, bytes);
        row("driver: restore", &s.restore, bytes);
        row("driver: unlock", &s.unlock, bytes);
        let mut park = Samples::default();
        let mut resume = Samples::default();
        for i in 0..rounds {
            park.push(s.lock.0[i] + s.checkpoint.0[i]);
            resume.push(s.restore.0[i] + s.unlock.0[i]);
        }
        row("driver: park (lock + checkpoint)", &park, bytes);
        row("driver: resume (restore + unlock)", &resume, bytes);
        row("tesserad: Park RPC", &s.api_park, bytes);
        row("tesserad: of which the driver", &s.api_park_driver, bytes);
        row("tesserad: Resume RPC", &s.api_resume, bytes);
        row("tesserad: of which the driver", &s.api_resume_driver, bytes);
    }
    drop(held);
}
