//! SM shares, work-conserving lending and priorities, measured the way a user would: workloads
//! in several "containers" (each its own limits file and accounting region) on one simulated GPU,
//! each reporting the share of the GPU it achieved (kernel time / wall time).
//!
//! Accuracy goal (issue 3): within ±5 percentage points of the limit, 1 to 4 containers, steady
//! kernels of 0.1 to 10 ms; and the same for kernels of a few microseconds, of which the limiter
//! measures only a sample (issue 15), alone or mixed with long ones of the same function.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tessera_region::ledger::{Ledger, Member, Publisher};
use tessera_region::{MAX_DEVICES, Priority, Region};

use serde_json::Value;
use tessera_sim_testkit::{SimNode, binary, profile_dir};

/// These tests measure time shares on a 2-core machine: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A container's directory, as tesserad makes one: `limits`, `region` and the daemon's `ledger`
/// view of the others (found beside the limits file).
struct Container {
    limits: PathBuf,
    region: PathBuf,
    ledger: PathBuf,
    priority: Priority,
}

fn container(node: &SimNode, name: &str, sm: Option<u32>, priority: &str, mode: &str) -> Container {
    let dir = node.root.join(name);
    std::fs::create_dir(&dir).unwrap();
    let limits = dir.join("limits");
    let sm_line = sm.map(|s| format!("sm_percent = {s}\n")).unwrap_or_default();
    std::fs::write(
        &limits,
        format!(
            "version = 1\ncontainer = \"{name}\"\npriority = \"{priority}\"\ncompute_mode = \"{mode}\"\n\n[[devices]]\nuuid = \"*\"\n{sm_line}"
        ),
    )
    .unwrap();
    let ledger = dir.join(tessera_region::ledger::LEDGER_FILE);
    Ledger::create(&ledger).unwrap();
    let priority = tessera_region::Limits::load(&limits).unwrap().priority;
    Container { limits, region: dir.join("region"), ledger, priority }
}

/// What tesserad does for these containers: every 10 ms, each one's view of the others published
/// from their regions, with the priority each one's limits grant (a record's, in the daemon).
struct Daemon {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

fn publish_for(cs: &[&Container]) -> Daemon {
    let cs: Vec<(PathBuf, PathBuf, Priority)> =
        cs.iter().map(|c| (c.region.clone(), c.ledger.clone(), c.priority)).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let quit = Arc::clone(&stop);
    let thread = std::thread::spawn(move || {
        let opened: Vec<(Region, Ledger, Priority)> =
            cs.iter().map(|(r, l, p)| (Region::open_or_create(r).unwrap(), Ledger::open_rw(l).unwrap(), *p)).collect();
        let ids: Vec<String> = (0..opened.len()).map(|i| i.to_string()).collect();
        let mut publisher = Publisher::new();
        while !quit.load(Ordering::Relaxed) {
            // The devices each container has named in its region (a record lists them in the daemon).
            let devices: Vec<Vec<(String, Priority)>> = opened
                .iter()
                .map(|(r, _, p)| (0..MAX_DEVICES).filter_map(|d| r.device_uuid(d)).map(|u| (u, *p)).collect())
                .collect();
            let members: Vec<Member> = opened
                .iter()
                .zip(&devices)
                .zip(&ids)
                .map(|(((region, ledger, _), devices), id)| Member { id, region, ledger, devices })
                .collect();
            publisher.publish(tessera_region::monotonic_ns(), &members);
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    });
    Daemon { stop, thread: Some(thread) }
}

fn start(node: &SimNode, c: &Container, args: &[&str]) -> Child {
    node.command(binary("tessera-workload"))
        .env("LD_PRELOAD", profile_dir().join("libtessera.so"))
        .env("TESSERA_LIMITS", &c.limits)
        .env("TESSERA_REGION", &c.region)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn report(c: Child) -> Value {
    let out = c.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {text} {}", String::from_utf8_lossy(&out.stderr)))
}

fn share(r: &Value) -> f64 {
    assert!(r["error"].is_null(), "{r}");
    r["achieved_share"].as_f64().unwrap()
}

/// Keep about 8 ms of kernels queued per process whatever their length, so a process the host
/// scheduler leaves off the CPU for a moment (a shared CI machine) still has work on the GPU:
/// what is measured is the limiter, not the host's scheduling.
fn depth_for(kernel_us: u64) -> u64 {
    (8000 / kernel_us).clamp(4, 64)
}

/// Runs one workload per (container, share) at once on GPU 0 and checks each achieved share.
fn shares(limits: &[u32], kernel_us: u64, seconds: f64) {
    let depth = depth_for(kernel_us);
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let node = SimNode::new();
    let args = [
        "--kernel-us".to_string(),
        kernel_us.to_string(),
        "--seconds".into(),
        seconds.to_string(),
        "--depth".into(),
        depth.to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cs: Vec<_> = limits
        .iter()
        .enumerate()
        .map(|(i, &l)| container(&node, &format!("c{i}"), Some(l), "normal", "strict"))
        .collect();
    let kids: Vec<_> = cs.iter().map(|c| start(&node, c, &args)).collect();
    let got: Vec<f64> = kids.into_iter().map(|k| share(&report(k))).collect();
    eprintln!("limits {limits:?}, {kernel_us} µs kernels: achieved {got:.3?}");
    for (want, got) in limits.iter().zip(&got) {
        let want = f64::from(*want) / 100.0;
        assert!((got - want).abs() <= 0.05, "limits {limits:?} with {kernel_us} µs kernels: achieved {got:?}");
    }
}

#[test]
fn one_container_gets_its_share() {
    shares(&[30], 2000, 2.0);
}

#[test]
fn ten_and_ninety() {
    shares(&[10, 90], 1000, 3.0);
}

#[test]
fn four_containers_of_a_quarter_with_short_kernels() {
    shares(&[25, 25, 25, 25], 100, 3.0);
}

#[test]
fn three_containers_with_long_kernels() {
    shares(&[20, 30, 40], 10_000, 4.0);
}

#[test]
fn work_conserving_borrows_idle_time_and_strict_does_not() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let node = SimNode::new();
    let args = ["--kernel-us", "1000", "--seconds", "2", "--depth", "4"];
    let lender = container(&node, "wc", Some(30), "normal", "work-conserving");
    let alone = share(&report(start(&node, &lender, &args)));
    assert!(alone >= 0.85, "alone on the GPU, a work-conserving 30% container took {alone}");
    let strict = container(&node, "strict", Some(30), "normal", "strict");
    let _daemon = publish_for(&[&lender, &strict]);
    let strict_alone = share(&report(start(&node, &strict, &args)));
    assert!((strict_alone - 0.30).abs() <= 0.05, "a strict 30% container alone took {strict_alone}");
    // Side by side: the strict one keeps its 30%, the work-conserving one takes most of the rest.
    let (a, b) = (start(&node, &strict, &args), start(&node, &lender, &args));
    let (s, w) = (share(&report(a)), share(&report(b)));
    eprintln!(
        "alone: work-conserving 30% {alone:.3}, strict 30% {strict_alone:.3}; side by side: strict {s:.3}, work-conserving {w:.3}"
    );
    assert!((s - 0.30).abs() <= 0.05, "strict {s} beside work-conserving {w}");
    assert!((0.55..=0.72).contains(&w), "work-conserving {w} beside strict {s}");
}

#[test]
fn low_priority_yields_to_high_and_resumes() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let node = SimNode::new();
    let high = container(&node, "online", None, "high", "strict");
    let low = container(&node, "offline", None, "low", "strict");
    let _daemon = publish_for(&[&high, &low]);
    let l = start(&node, &low, &["--kernel-us", "2000", "--seconds", "3", "--depth", "2"]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    // A deeper queue for the high-priority side: its measure is what it gets, not how promptly a
    // loaded host schedules it.
    let h = start(&node, &high, &["--kernel-us", "2000", "--seconds", "1.5", "--depth", "4"]);
    let (h, l) = (share(&report(h)), share(&report(l)));
    eprintln!("priority: high {h:.3}, low {l:.3}");
    assert!(h >= 0.9, "the high-priority container ran at {h}");
    // Low ran alone for ~1.5 s of its 3 s: about half, not the third that sharing would give.
    assert!((0.35..0.6).contains(&l), "the low-priority container got {l}");
}

/// A share of `from`% raised to `to`% after 1 s of a 3 s run, as the daemon does it (the limits
/// file rewritten, the region's generation bumped); checks the achieved share.
fn live_change(from: u32, to: u32, kernel_us: u64, depth: u64) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let node = SimNode::new();
    let c = container(&node, "live", Some(from), "normal", "strict");
    let (kernel, depth) = (kernel_us.to_string(), depth.to_string());
    let k = start(&node, &c, &["--kernel-us", &kernel, "--seconds", "3", "--depth", &depth]);
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let mut limits = tessera_region::Limits::load(&c.limits).unwrap();
    limits.devices[0].sm_percent = Some(to);
    limits.write_atomic(&c.limits).unwrap();
    tessera_region::Region::open_or_create(&c.region).unwrap().bump_config_generation();
    let got = share(&report(k));
    eprintln!("live change {from}% -> {to}% after 1 s of 3 s, {kernel_us} µs kernels: achieved {got:.3}");
    // ~1 s at the first share, then ~2 s at the second.
    let want = (f64::from(from) + 2.0 * f64::from(to)) / 300.0;
    assert!((got - want).abs() <= 0.06, "achieved {got}, expected about {want}");
}

#[test]
fn a_live_share_change_applies() {
    live_change(20, 60, 1000, 4);
}

// ---- Sampled measurement (issue 15): tiny kernels, one launch in up to 16 measured ----------

/// One workload in a container of `limit`% with `args`; its achieved share.
fn alone(limit: u32, args: &[&str]) -> f64 {
    alone_and_throttled(limit, args).0
}

/// [`alone`], and the part of the run the limiter held its launches back (the region's throttled
/// time over the workload's wall time).
fn alone_and_throttled(limit: u32, args: &[&str]) -> (f64, f64) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let node = SimNode::new();
    let c = container(&node, "sampled", Some(limit), "normal", "strict");
    let r = report(start(&node, &c, args));
    let got = share(&r);
    let snap = tessera_region::Region::open_or_create(&c.region).unwrap().snapshot();
    let throttled_ns: u64 = snap.devices.iter().map(|d| d.exited_throttled_ns).sum::<u64>()
        + snap.processes.iter().flat_map(|p| &p.devices).map(|d| d.throttled_ns).sum::<u64>();
    (got, throttled_ns as f64 / 1e6 / r["wall_ms"].as_f64().unwrap())
}

// A test process (debug build, simulated driver, a shared 2-core machine) launches a few tens
// of thousands of kernels a second at most, so the shares here are small enough for tiny
// kernels to reach them, and well under what the process takes unthrottled (15-30%).

/// 8 µs kernels: one launch in 8 is measured, each measured one charged for 8. At a 5% share
/// the ±5 points of the other tests would pass a limiter that held nothing, so within 2 points.
/// Never over the share. Under it only where the limiter did not hold the process back: a
/// loaded machine can leave a process launching 8 µs kernels short of even 5% by itself (seen
/// beside two busy loops and a disk writer: 2.3%); where it held it back for most of the run,
/// the share is what it got.
#[test]
fn tiny_kernels_measured_by_sample_keep_the_share() {
    let (got, throttled) = alone_and_throttled(5, &["--kernel-us", "8", "--seconds", "3", "--depth", "64"]);
    eprintln!("5% with 8 µs kernels: achieved {got:.3}, throttled {throttled:.2} of the run");
    assert!(got <= 0.07, "achieved {got}");
    if throttled >= 0.5 {
        assert!(got >= 0.03, "achieved {got}, throttled {throttled:.2} of the run");
    }
}

/// A tenant alternating tiny and long kernels of one function (its duration is its parameter,
/// so nothing before the launch tells them apart): every other launch, and one in 16, a 1 ms
/// kernel among 4 µs ones. Measured by sample or not, it is held to its share.
#[test]
fn tiny_and_long_kernels_of_one_function_keep_the_share() {
    for every in ["2", "16"] {
        let args = ["--kernel-us", "4", "--long-every", every, "--long-us", "1000", "--seconds", "3", "--depth", "16"];
        let got = alone(30, &args);
        eprintln!("30%, a 1 ms kernel every {every} launches among 4 µs ones: achieved {got:.3}");
        assert!((got - 0.30).abs() <= 0.05, "long every {every}: achieved {got}");
    }
}

/// A live change still applies while launches are measured by sample (16 µs kernels: one in 4).
#[test]
fn a_live_share_change_applies_to_sampled_kernels() {
    live_change(5, 15, 16, 64);
}

// ---- Long kernels (issue 34): 100 ms to 1 s under a strict share ---------------------------

/// A strict 30% share alone with kernels of `kernel_us`, two in flight, for `seconds`: the rate
/// its kernels were let through at (`launch_share`: the GPU time of all but the last over the
/// time from the first launch to the last; with kernels this long, a run's edges weigh a kernel
/// each in `achieved_share`).
fn long_kernels(kernel_us: u64, seconds: f64) -> f64 {
    paced(kernel_us, seconds, &[])
}

/// [`long_kernels`] with more of the workload's arguments (`--launch`, `--graph-kernels`).
fn paced(kernel_us: u64, seconds: f64, more: &[&str]) -> f64 {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let node = SimNode::new();
    let c = container(&node, "paced", Some(30), "normal", "strict");
    let (kernel, seconds) = (kernel_us.to_string(), seconds.to_string());
    let mut args = vec!["--kernel-us", &kernel, "--seconds", &seconds, "--depth", "2"];
    args.extend(more);
    let r = report(start(&node, &c, &args));
    share(&r);
    let got = r["launch_share"].as_f64().unwrap();
    eprintln!(
        "30% with {kernel_us} µs kernels {more:?}: let through at {got:.3} (achieved {:.3} over the run)",
        share(&r)
    );
    got
}

/// How far from its 30% a paced run may land here: ±5 points, as this file's other shares. The
/// goal is ±2 points, measured on a quiet machine (docs/benchmarks.md, run 12: 0.297-0.318);
/// beside other tests on a shared 2-core machine a run of a dozen 100 ms kernels landed at 0.345,
/// about a kernel's worth. ±5 points still fails every figure from before the fixes (0.38-0.75).
const PACED_TOLERANCE: f64 = 0.05;

/// Before: 0.42 with 100 ms kernels, 0.50-0.75 with 500 ms ones (spans harvested in one
/// window judged against NVML's reading of another read as time-sliced, and the charges shrank).
#[test]
fn long_kernels_keep_the_share() {
    for (kernel_us, seconds) in [(100_000, 4.0), (500_000, 9.0), (1_000_000, 12.0)] {
        let got = long_kernels(kernel_us, seconds);
        assert!((got - 0.30).abs() <= PACED_TOLERANCE, "{} ms kernels: let through at {got}", kernel_us / 1000);
    }
}

/// Every launch form is held to the share: cooperative launches and `cuLaunchKernelEx` of 1 ms
/// kernels, and a CUDA graph of 100 kernels of 1 ms (one `cuGraphLaunch`, charged by its kernels:
/// 100 ms of GPU time; before, 0.38-0.48 on review), also made by capturing 100 launches on a
/// stream, which charges the captured launches nothing (they run nothing) and records no event
/// of the limiter's into the graph.
#[test]
fn every_launch_form_keeps_the_share() {
    for (kernel_us, seconds, more) in [
        (1000, 3.0, &["--launch", "cooperative"][..]),
        (1000, 3.0, &["--launch", "ex"][..]),
        (1000, 5.0, &["--launch", "graph", "--graph-kernels", "100"][..]),
        (1000, 5.0, &["--launch", "capture", "--graph-kernels", "100"][..]),
    ] {
        let got = paced(kernel_us, seconds, more);
        if more.contains(&"--graph-kernels") {
            // A graph is 100 ms of GPU time at once, and the shim's correction from NVML's
            // readings lands a little under 1 for it (issue 34, left): 0.300-0.318 on a quiet
            // machine, up to 0.354 in a full CI run. Held below every figure from before the fix
            // (0.38-0.48), never starved.
            assert!((0.25..0.38).contains(&got), "{more:?}: let through at {got}");
        } else {
            assert!((got - 0.30).abs() <= PACED_TOLERANCE, "{more:?}: let through at {got}");
        }
    }
}

/// On every kind of stream: the NULL stream, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`
/// (a created one is every other test's), 1 ms kernels at a strict 30%.
#[test]
fn every_kind_of_stream_keeps_the_share() {
    for kind in ["null", "legacy", "per-thread"] {
        let got = paced(1000, 3.0, &["--stream", kind]);
        assert!((got - 0.30).abs() <= PACED_TOLERANCE, "{kind} stream: let through at {got}");
    }
}
