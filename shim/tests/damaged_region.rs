//! A region overwritten under its container's running processes (the region is the container's
//! to write): they must fail closed, a CUDA error and one line on stderr, never hang. Before,
//! garbage over a region left its processes asleep for good (a 5 s workload still waiting after
//! 25 s): the compute limiter slept for as long as the bucket's balance said.
//!
//! Each case runs a workload of kernels under an SM share, damages its region once the workload
//! is launching, and waits for it to end (a hang is caught by a harness limit of 60 s, far past
//! the workload's own 5 s; nothing asserts how long it took).

mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use tessera_region::{DeviceLimits, Limits, Region};
use tessera_sim_testkit::binary;

/// Far past the workload's own length: reached only by a process that hangs.
const HANG: Duration = Duration::from_secs(60);

fn share_limits() -> Limits {
    Limits {
        devices: vec![DeviceLimits { uuid: "*".into(), memory_limit: Some(4 * GIB), sm_percent: Some(30) }],
        ..Limits::default()
    }
}

/// Starts a 5 s workload of 1 ms kernels in `c` and waits until it launches.
fn launching(c: &Container, node: &tessera_sim_testkit::SimNode) -> (Child, Region) {
    let child = c
        .command(node, binary("tessera-workload"))
        .args(["--alloc-mib", "64", "--kernel-us", "1000", "--seconds", "5", "--depth", "4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the workload");
    wait_for(&c.region);
    let region = c.region();
    let deadline = Instant::now() + HANG;
    while region.bucket(0).refill_ns.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        assert!(Instant::now() < deadline, "the workload never launched");
        std::thread::sleep(Duration::from_millis(5));
    }
    (child, region)
}

/// Waits for the workload, failing if it is still running after [`HANG`]: (exit code, its
/// report, stderr).
fn ended(mut child: Child, what: &str) -> (i32, Value, String) {
    let deadline = Instant::now() + HANG;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            child.kill().ok();
            let out = child.wait_with_output().unwrap();
            panic!("{what}: the workload hung; stderr: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let v: Value = serde_json::from_str(stdout.lines().last().unwrap_or("null")).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), v, stderr)
}

/// What every case must show: a CUDA error ended the run, and stderr says why in one line.
fn failed_closed(what: &str, (code, report, stderr): (i32, Value, String)) {
    assert_ne!(code, 0, "{what}: the workload ran on over a damaged region: {report}\n{stderr}");
    assert!(!report["error"].is_null(), "{what}: a CUDA call failed: {report}\n{stderr}");
    let said: Vec<&str> = stderr.lines().filter(|l| l.starts_with("tessera:") && l.contains("region")).collect();
    assert_eq!(said.len(), 1, "{what}: one line on stderr names the region: {stderr}");
}

/// Random bytes over the file from `from` on, its size kept.
fn scribble(path: &std::path::Path, from: usize, mut seed: u64) {
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut old = Vec::new();
    f.read_to_end(&mut old).unwrap();
    let mut bytes = vec![0u8; old.len() - from];
    for b in bytes.iter_mut() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        *b = seed as u8;
    }
    f.seek(SeekFrom::Start(from as u64)).unwrap();
    f.write_all(&bytes).unwrap();
}

/// Random bytes over the whole region, three times over (three seeds, a fresh container each),
/// while a neighbour container's workload runs beside on the same GPU: the damaged container's
/// processes fail closed, the neighbour runs to its end.
#[test]
fn random_bytes_over_a_live_region_fail_its_processes_closed() {
    let node = node();
    let neighbour = Container::new(&share_limits());
    let beside = neighbour
        .command(&node, binary("tessera-workload"))
        .args(["--alloc-mib", "64", "--kernel-us", "1000", "--seconds", "5", "--depth", "4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the neighbour");
    for seed in [0x9e37_79b9_7f4a_7c15u64, 0x2545_f491_4f6c_dd1d, 0x1234_5678_9abc_def1] {
        let c = Container::new(&share_limits());
        let (child, _region) = launching(&c, &node);
        scribble(&c.region, 0, seed);
        failed_closed(&format!("random bytes ({seed:#x})"), ended(child, "random bytes"));
    }
    let (code, report, stderr) = ended(beside, "the neighbour");
    assert_eq!(code, 0, "the neighbour is unaffected: {report}\n{stderr}");
    assert!(!stderr.contains("damaged"), "{stderr}");
}

/// Random bytes over everything but the header (its magic, layout and generation intact, so
/// nothing says the region was rewritten): whatever the values, the workload ends, never hangs.
#[test]
fn random_bytes_behind_an_intact_header_never_hang_a_process() {
    let node = node();
    for seed in [0x9e37_79b9_7f4a_7c15u64, 0x2545_f491_4f6c_dd1d, 0x1234_5678_9abc_def1] {
        let c = Container::new(&share_limits());
        let (child, _region) = launching(&c, &node);
        scribble(&c.region, 64, seed);
        let (code, report, stderr) = ended(child, "random bytes behind the header");
        if code != 0 {
            failed_closed("random bytes behind the header", (code, report, stderr));
        }
    }
}

/// The header intact, the compute bucket's balance set to a debt no launch could run up (a
/// sleep of centuries at the share): refused as damage, not slept on.
#[test]
fn a_crafted_compute_debt_fails_closed_instead_of_sleeping() {
    let node = node();
    let c = Container::new(&share_limits());
    let (child, region) = launching(&c, &node);
    let b = region.bucket(0);
    let deadline = Instant::now() + Duration::from_secs(2);
    // Written again and again: the processes' own refills and corrections race with the writer.
    while Instant::now() < deadline {
        b.tokens_ns.store(i64::MIN / 2, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(1));
    }
    failed_closed("a crafted debt", ended(child, "a crafted debt"));
}
