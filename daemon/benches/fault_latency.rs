//! Fault-to-ListAndWatch and reset-to-ListAndWatch latency of the built `tesserad` on an 8-GPU
//! simulated node, with a test kubelet: faults are injected into the node (the sim model, as
//! `tessera-sim inject` does) and the time until the kubelet's ListAndWatch stream shows the GPU
//! unhealthy is measured; then the GPU is reset and the time until it is healthy again (less the
//! configured recovery check) is measured. Prints p50 / p99 / max per fault kind.
//!
//! The simulated driver and `tesserad` must be built in the same profile first, e.g.
//! `cargo build --release --workspace --exclude tessera-hook && cargo bench -p tessera-daemon --bench fault_latency`
//! (or `--profile dev` for both).

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use tessera_proto::deviceplugin::v1beta1::{self as dp, Empty};
use tessera_sim_testkit::SimNode;

#[path = "../tests/common/mod.rs"]
mod common;

const ROUNDS: usize = 20;
const GPUS: u32 = 8;
const RECOVERY_CHECK_MS: u64 = 100;

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// Fatal XID 48; brought back by losing and resetting the GPU (an XID alone leaves no reset
    /// evidence on the simulated node).
    Xid48,
    EccDoubleBit,
    Lost,
}

fn percentiles(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{name:<34} n={:<3} p50 {:>8.2} ms   p99 {:>8.2} ms   max {:>8.2} ms",
        v.len(),
        p(0.5).as_secs_f64() * 1e3,
        p(0.99).as_secs_f64() * 1e3,
        v[v.len() - 1].as_secs_f64() * 1e3
    );
}

async fn until(stream: &mut tonic::Streaming<dp::ListAndWatchResponse>, id: &str, health: &str) -> Instant {
    loop {
        let list = common::next_list(stream).await;
        if list.devices.iter().any(|d| d.id == id && d.health == health) {
            return Instant::now();
        }
    }
}

async fn run() {
    let node =
        SimNode::with_description(&format!("numa_nodes = 1\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = {GPUS}\n"));
    let sim = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    std::fs::create_dir(dir.join("plugins")).expect("plugin dir");
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        format!(
            "nvml_library = {:?}\ndevice_plugin_dir = {:?}\nstate_dir = {:?}\nruntime_dir = {:?}\n\
             [health]\ninterval_seconds = 1\nrecovery_check_ms = {RECOVERY_CHECK_MS}\n\
             [partitions.default]\nwhole = true\n",
            node.nvml_path(),
            dir.join("plugins"),
            dir.join("state"),
            dir.join("run"),
        ),
    )
    .expect("config");
    let notify = dir.join("notify.sock");
    let _notify = UnixDatagram::bind(&notify).expect("notify socket");
    let mut kubelet = common::TestKubelet::start(&dir.join("plugins"));
    let (_daemon, _) = common::spawn(&node, &config, &notify, &dir.join("tesserad.log"));
    let (req, _) = kubelet.next_registration().await;
    let mut plugin = kubelet.connect(&req).await;
    let mut law = plugin.list_and_watch(Empty {}).await.expect("ListAndWatch").into_inner();
    let first = common::next_list(&mut law).await;
    let mut ids: Vec<String> = first.devices.iter().map(|d| d.id.clone()).collect();
    ids.sort();
    // GPU index -> device id (the UUID), through NVML order = sim order.
    let uuids: Vec<String> = (0..GPUS).map(|i| sim.gpus()[i as usize].uuid.clone()).collect();
    assert!(uuids.iter().all(|u| ids.contains(u)), "the kubelet sees every GPU");
    // Let the monitor finish its first look.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut fault: Vec<(Kind, Duration)> = Vec::new();
    let mut recovery: Vec<Duration> = Vec::new();
    for round in 0..ROUNDS * 3 {
        let kind = [Kind::Xid48, Kind::EccDoubleBit, Kind::Lost][round % 3];
        let gpu = (round as u32) % GPUS;
        let id = &uuids[gpu as usize];
        let t0 = Instant::now();
        match kind {
            Kind::Xid48 => sim.inject_xid(gpu, 48, None, None),
            Kind::EccDoubleBit => sim.inject_ecc(gpu, 0, 1),
            Kind::Lost => sim.fall_off_bus(gpu),
        }
        .expect("inject");
        fault.push((kind, until(&mut law, id, dp::UNHEALTHY).await - t0));
        if matches!(kind, Kind::Xid48) {
            sim.fall_off_bus(gpu).expect("lose");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let t1 = Instant::now();
        sim.reset(gpu).expect("reset");
        let back = until(&mut law, id, dp::HEALTHY).await - t1;
        recovery.push(back.saturating_sub(Duration::from_millis(RECOVERY_CHECK_MS)));
    }
    println!("fault_latency: {GPUS} GPUs, {ROUNDS} injections per kind, recovery check {RECOVERY_CHECK_MS} ms");
    for (name, k) in
        [("fault->ListAndWatch XID 48", 0), ("fault->ListAndWatch ECC DBE", 1), ("fault->ListAndWatch lost GPU", 2)]
    {
        let v = fault.iter().filter(|(kind, _)| *kind as usize == k).map(|(_, d)| *d).collect();
        percentiles(name, v);
    }
    percentiles("fault->ListAndWatch all", fault.iter().map(|(_, d)| *d).collect());
    percentiles("reset->healthy beyond the check", recovery);
}

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` passes nothing to run.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(run());
}
