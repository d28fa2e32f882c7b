//! Real processes: a child (this test binary started again) joins the region, reserves, and is
//! SIGKILLed; the memory it held comes back through `reap`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use tessera_region::{ENV_REGION, Region};

const ROLE: &str = "TESSERA_REGION_TEST_CHILD";
const DEVICE: &str = "GPU-11111111-2222-3333-4444-555555555555";

/// A child process, SIGKILLed and waited for when dropped (a failing test leaves none behind).
struct Kid {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts this test binary again as a child playing `role` on the region at `path`; returns once
/// it printed "ready …" (that line's words after "ready").
fn child(role: &str, path: &Path) -> (Kid, Vec<String>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(ENV_REGION, path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut kid = Kid { child, out: BufReader::new(out) };
    let mut line = String::new();
    loop {
        line.clear();
        assert!(kid.out.read_line(&mut line).unwrap() > 0, "child {role:?} exited before it was ready");
        // libtest may have printed "test child_entry ... " first on the same line.
        if let Some((_, rest)) = line.trim_end().split_once("ready") {
            return (kid, rest.split_whitespace().map(String::from).collect());
        }
    }
}

/// SIGKILL: no destructor, no atexit handler, nothing of the child's runs.
fn kill(kid: Kid) {
    drop(kid);
}

/// Roles: "reserve <bytes>" (then sleeps), "churn <threads> <max bytes>" (reserves and releases
/// in a loop on every thread until killed).
#[test]
fn child_entry() {
    let Some(role) = std::env::var_os(ROLE) else { return };
    let role = role.into_string().unwrap();
    // Die with the test that started us, even when it fails before killing us.
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag on this process.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let path = std::env::var_os(ENV_REGION).unwrap();
    let r: &'static Region = Box::leak(Box::new(Region::open_or_create(Path::new(&path)).unwrap()));
    let dev = r.device(DEVICE).unwrap();
    let slot = r.join().unwrap();
    let words: Vec<&str> = role.split_whitespace().collect();
    match words.as_slice() {
        // The limits are the callers' (the shim's private copy of the limits file).
        ["reserve", bytes] => match r.try_reserve(slot, dev, bytes.parse().unwrap(), Some(1 << 30)) {
            Ok(()) => println!("ready ok {}", slot.index),
            Err(d) => println!("ready denied {} {}", d.used, d.limit),
        },
        ["churn", threads, max] => {
            let max: u64 = max.parse().unwrap();
            for t in 0..threads.parse::<u64>().unwrap() {
                std::thread::spawn(move || {
                    let mut x = t + 1;
                    loop {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        let b = 1 + (x >> 33) % max;
                        if r.try_reserve(slot, dev, b, Some(4 * max)).is_ok() {
                            r.release(slot, dev, b);
                        }
                    }
                });
            }
            println!("ready churning {}", slot.index);
        }
        other => panic!("unknown role {other:?}"),
    }
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_killed_process_is_reaped_and_its_memory_returned() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region");
    let daemon = Region::open_or_create(&path).unwrap();
    let dev = daemon.device(DEVICE).unwrap();

    let (a, words) = child("reserve 700000000", &path);
    assert_eq!(words[0], "ok");
    assert_eq!(daemon.used(dev), 700_000_000);
    let pid = a.child.id();
    assert!(daemon.pids().iter().any(|&(p, _)| p == pid), "{:?}", daemon.pids());

    // Another process is held to the container's limit.
    let (b, words) = child("reserve 400000000", &path);
    assert_eq!(words, ["denied", "700000000", "1073741824"]);
    assert_eq!(daemon.reap(), 0, "both children are alive");

    kill(a);
    assert_eq!(daemon.used(dev), 700_000_000, "still counted until reaped");
    assert_eq!(daemon.reap(), 1);
    assert_eq!(daemon.used(dev), 0);
    assert!(!daemon.pids().iter().any(|&(p, _)| p == pid));

    let (c, words) = child("reserve 400000000", &path);
    assert_eq!(words[0], "ok");
    kill(b);
    kill(c);
    assert_eq!(daemon.reap(), 2);
    assert_eq!(daemon.used(dev), 0);
    assert!(daemon.pids().is_empty());
}

/// A process killed at a random point of its reserve/release loop may leave the total above the
/// sum of the slots (killed between the two steps of a reserve or a release), never below it; the
/// reap, which reconciles, brings it back to exactly 0.
#[test]
fn a_process_killed_mid_operation_is_reconciled_exactly() {
    const THREADS: u64 = 2;
    const MAX: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region");
    let daemon = Region::open_or_create(&path).unwrap();
    let dev = daemon.device(DEVICE).unwrap();
    let mut in_doubt = 0;
    for round in 0..6 {
        let (c, _) = child(&format!("churn {THREADS} {MAX}"), &path);
        std::thread::sleep(Duration::from_millis(20 + 15 * round));
        kill(c);
        let left = daemon.used(dev);
        assert!(left <= 4 * MAX, "round {round}: {left} bytes after the kill");
        let slot_held: u64 = daemon.snapshot().processes.iter().map(|p| p.devices[dev].used).sum();
        in_doubt += left - slot_held;
        assert_eq!(daemon.reap(), 1);
        assert_eq!(daemon.used(dev), 0, "round {round}");
    }
    println!("bytes left in doubt by 6 kills mid-loop, all returned: {in_doubt}");
}
