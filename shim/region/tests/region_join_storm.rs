//! 1,000 processes join one region at once: each gets a slot of its own, and all are reaped once
//! dead. The join's own time is printed (a figure for docs/benchmarks.md, never asserted: a
//! loaded CI machine measures its scheduler, not the join).
//!
//! The children are this test binary started again. Each opens the region, says it is ready and
//! blocks on a pipe; when all are ready the pipe is closed and all of them join at once. Each
//! measures only its `join` call (after yielding once, so that it starts on a fresh time slice:
//! on a 2-core machine 1,000 runnable processes otherwise measure the scheduler, not the join).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_region::{ENV_REGION, MAX_PROCS, Region};

const ROLE: &str = "TESSERA_REGION_STORM_CHILD";
const CHILDREN: usize = 1000;

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[test]
fn storm_child() {
    if std::env::var_os(ROLE).is_none() {
        return;
    }
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag on this process.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let path = std::env::var_os(ENV_REGION).unwrap();
    let region = Region::open_or_create(Path::new(&path)).unwrap();
    let mut out = std::io::stdout();
    writeln!(out, "\nready").unwrap();
    out.flush().unwrap();
    // Blocks until the parent closes the pipe: everyone starts together.
    let mut buf = [0u8; 1];
    let _ = std::io::stdin().read(&mut buf);
    std::thread::yield_now();
    let cpu = thread_cpu_ns();
    let t = Instant::now();
    let slot = region.join();
    let wall = t.elapsed().as_nanos();
    let cpu = thread_cpu_ns() - cpu;
    let slot = slot.unwrap();
    // One write (O_APPEND): lines of different children never interleave.
    out.write_all(format!("\njoined slot={} wall_ns={wall} cpu_ns={cpu}\n", slot.index).as_bytes()).unwrap();
    out.flush().unwrap();
    // Leave at once: no test harness report, no destructors (the kernel drops the lock).
    std::process::exit(0);
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

#[test]
fn a_thousand_processes_join_at_once() {
    // tmpfs, as /run is on a real host (a disk file system adds write faults on shared pages).
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }.unwrap();
    let path = dir.path().join("region");
    let daemon = Region::open_or_create(&path).unwrap();
    let out_path = dir.path().join("out");
    let out = std::fs::OpenOptions::new().create(true).append(true).open(&out_path).unwrap();
    let (go_rx, go_tx) = std::io::pipe().unwrap();
    let exe = std::env::current_exe().unwrap();
    let spawned = Instant::now();
    let mut children = Vec::with_capacity(CHILDREN);
    for _ in 0..CHILDREN {
        let c = Command::new(&exe)
            .args(["storm_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, "1")
            .env(ENV_REGION, &path)
            .stdin(Stdio::from(go_rx.try_clone().unwrap()))
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out.try_clone().unwrap()))
            .spawn()
            .unwrap();
        children.push(c);
    }
    drop(go_rx);
    let count =
        |word: &str| std::fs::read_to_string(&out_path).unwrap().lines().filter(|l| l.starts_with(word)).count();
    let deadline = Instant::now() + Duration::from_secs(300);
    while count("ready") < CHILDREN {
        assert!(Instant::now() < deadline, "only {} of {CHILDREN} children got ready", count("ready"));
        std::thread::sleep(Duration::from_millis(20));
    }
    let ready_after = spawned.elapsed();
    drop(go_tx); // EOF: all join now
    // Wait by polling, not in wait(): each child's exit would wake us, and we would preempt joiners.
    while count("joined") < CHILDREN && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let text = std::fs::read_to_string(&out_path).unwrap();
    let mut slots = Vec::new();
    let mut wall = Vec::new();
    let mut cpu = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("joined ")) {
        let field = |name: &str| -> u64 {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
                .unwrap()
                .parse()
                .unwrap()
        };
        slots.push(field("slot") as usize);
        wall.push(field("wall_ns") / 1000);
        cpu.push(field("cpu_ns") / 1000);
    }
    assert_eq!(wall.len(), CHILDREN, "{text}");
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), CHILDREN, "every process got its own slot");
    assert!(slots.iter().all(|&s| s < MAX_PROCS));
    wall.sort_unstable();
    cpu.sort_unstable();
    let (p50, p99, max) = (percentile(&wall, 0.50), percentile(&wall, 0.99), wall[CHILDREN - 1]);
    println!(
        "{CHILDREN} processes ready in {:.1} s; join wall µs p50 {p50} p99 {p99} max {max}; \
         cpu µs p50 {} p99 {} max {}",
        ready_after.as_secs_f64(),
        percentile(&cpu, 0.50),
        percentile(&cpu, 0.99),
        cpu[CHILDREN - 1]
    );
    // All dead now: their locks are gone, so all are reaped.
    assert_eq!(daemon.reap(), CHILDREN);
    assert!(daemon.pids().is_empty());
}
