//! Start-up to the first successful allocation when many processes of one container start
//! together, without and with the shim preloaded.
//!
//! Each process `dlopen`s `libcuda.so.1`, calls `cuInit`, makes device 0's primary context
//! current and allocates 1 MiB, and reports the microseconds from before the `dlopen` to the
//! allocation's return (in process: what the program waits for). A batch is N processes (default
//! 1,000, `TESSERA_STARTUP_N`) spawned and held at a FIFO until all are ready, then released at
//! once. Batches alternate plain, shim, shim, plain, ... (`TESSERA_STARTUP_ROUNDS` pairs, default
//! 2), so load that lasts longer than a batch hits both sides alike; on a shared machine only the
//! difference against the same run's plain batches means anything. All processes of a batch
//! share one container (its limits file and region, fresh for each batch), whose limit the
//! report checks: the regions' peak and the GPU's own high-water mark. Before each batch one
//! process of the container starts alone and asks `cuMemGetInfo`, so that the container's
//! context size is measured (its hint): the batch is a container's next thousand processes, not
//! its very first (those reserve the 512 MiB default estimate each, and a limit that fits a
//! thousand of those fits no GPU).
//!
//! The driver directory is laid out as a real driver's (`TESSERA_STARTUP_LAYOUT=two`, the
//! default: `libnvidia-ml.so.1` and `libcuda.so.1` two separate copies of the simulated driver,
//! as `tessera-sim install` lays them out), or as the testkit's (`one`: both names one object).
//!
//! `TESSERA_STARTUP_BASELINE_SHIM=path/to/libtessera.so` (an earlier build) adds a third side,
//! interleaved with the other two: a before/after comparison in the same run. Rounds take the
//! sides' permutations in turn ([`round_order`]). Drop the page cache before such a run (`sync;
//! echo 3 > /proc/sys/vm/drop_caches`): a library the linker has just written sits in small
//! page-cache folios and takes more page faults than a copy (docs/benchmarks.md, run 16).
//!
//! `TESSERA_STARTUP_CONTEXT_SIZES=1` gives each container the context sizes file tesserad
//! publishes (the GPU's context size, beside the limits): the shim charges its first context
//! that size and loads no NVML.
//!
//! `TESSERA_STARTUP_DEBUG=1` shows the start-up processes' stderr and each refusal.
//!
//! With `TESSERA_SHIM_BENCH_INSTR` set, one such process per side and layout runs under
//! callgrind instead: every instruction of every thread from the first one the dynamic loader
//! runs at `exec` to the process's exit, each thread on its own (`--separate-threads=yes`), with
//! the simulated driver's latency off (its spins would count as instructions). After its first
//! allocation such a process waits, outside the count, until the shim's helper thread (NVML's
//! load and the context's true-up) is gone, so that it is counted whole: this is the CPU that a
//! thousand processes starting at once pay. Also printed: the start-up thread's part from before
//! the `dlopen` to the allocation's return (what the program waits for), the inclusive count of
//! [`instr_first_alloc`] in the same profile; and the same process after a CUDA runtime's
//! look-ups (`cuGetProcAddress_v2` of every driver function, as libcudart does first).
//!
//! `TESSERA_STARTUP_CPU=R` runs, instead of the batches, R interleaved rounds of one process per
//! side started alone (the same whole process, waiting for its helper thread before it exits),
//! and reports each process's CPU time (user + system, from `wait4`) with the simulated driver's
//! latency on: a real driver's call costs CPU too.
//!
//! Run: `cargo build --release -p tessera-shim -p tessera-sim-driver && cargo bench -p
//! tessera-shim --bench startup`. Not a test: nothing here asserts a time.

use std::ffi::{CStr, c_int, c_uint, c_void};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use libloading::Library;
use tessera_region::context_sizes::{CONTEXT_SIZES_FILE, ContextSizes};
use tessera_sim_testkit::{SimNode, profile_dir};

const MIB: usize = 1 << 20;

/// Set in a start-up process: the FIFO it waits at.
const CHILD: &str = "TESSERA_STARTUP_CHILD";
const INSTR: &str = "TESSERA_SHIM_BENCH_INSTR";

/// Contexts of 32 MiB, and a limit above the GPU's memory that a thousand processes' 256 MiB
/// reservations (the least a context is reserved before it is made) fit in at once: no process
/// is refused, so every one has a first successful allocation to time. (Exactness under a tight
/// limit is the isolation tests' storm.)
const NODE: &str = "context_overhead_mib = 32\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n";
const LIMITS: &str =
    "version = 1\ncontainer = \"startup-bench\"\n\n[[devices]]\nuuid = \"index:0\"\nmemory_limit = \"300GiB\"\n";
const LIMIT: u64 = 300 << 30;

type R = c_int;
type CuInit = unsafe extern "C" fn(c_uint) -> R;
type CuRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> R;
type CuSetCurrent = unsafe extern "C" fn(*mut c_void) -> R;
type CuAlloc = unsafe extern "C" fn(*mut u64, usize) -> R;
type CuMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> R;

fn main() {
    // A real driver's call latency (docs/sim.md), unless TESSERA_SIM_LATENCY says otherwise.
    tessera_sim_testkit::real_driver_latency_unless_set();
    if let Some(fifo) = std::env::var_os(CHILD) {
        std::process::exit(child(Path::new(&fifo)));
    }
    let n: usize = env_number("TESSERA_STARTUP_N", 1000);
    let rounds: usize = env_number("TESSERA_STARTUP_ROUNDS", 2);
    let layouts: Vec<Layout> = match std::env::var("TESSERA_STARTUP_LAYOUT").as_deref() {
        Ok("one") => vec![Layout::One],
        Ok("both") => vec![Layout::Two, Layout::One],
        _ => vec![Layout::Two],
    };
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("start-up bench: load average before: {}", load().trim());
    let cpu_rounds: usize = env_number("TESSERA_STARTUP_CPU", 0);
    for layout in layouts {
        if std::env::var_os(INSTR).is_some_and(|v| !v.is_empty()) {
            whole_instructions(layout);
        } else if cpu_rounds > 0 {
            cpu(layout, cpu_rounds);
        } else {
            storm(layout, n, rounds);
        }
    }
    println!("load average after: {}", load().trim());
}

/// `TESSERA_STARTUP_CONTEXT_SIZES=1`: each container gets the context sizes file tesserad
/// publishes (`context-sizes` beside `limits`), so a shim that reads it charges its context
/// without loading NVML; a baseline shim from before it ignores it.
fn publish_context_size() -> bool {
    std::env::var("TESSERA_STARTUP_CONTEXT_SIZES").is_ok_and(|v| v == "1")
}

fn env_number(key: &str, default: usize) -> usize {
    std::env::var(key).ok().map_or(default, |v| v.trim().parse().unwrap_or_else(|_| panic!("{key}: a number")))
}

#[derive(Clone, Copy, Debug)]
enum Layout {
    /// The testkit's: both library names one object.
    One,
    /// A real driver's: two objects (two copies of the simulated driver).
    Two,
}

/// A node, its container, and the driver directory of `layout`.
struct Setup {
    node: SimNode,
    lib_dir: PathBuf,
    limits: PathBuf,
    region: PathBuf,
}

impl Setup {
    fn new(layout: Layout) -> Setup {
        let node = SimNode::with_description(NODE);
        let lib_dir = match layout {
            Layout::One => node.lib_dir.clone(),
            Layout::Two => {
                let d = node.root.join("lib-two");
                std::fs::create_dir_all(&d).expect("lib dir");
                let sim = profile_dir().join("libtessera_sim.so");
                for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
                    std::fs::copy(&sim, d.join(name)).expect("copy the simulated driver");
                }
                d
            }
        };
        let mut setup = Setup { node, lib_dir, limits: PathBuf::new(), region: PathBuf::new() };
        setup.fresh_container(0);
        setup
    }

    /// A new container (limits file and region) for the next batch.
    fn fresh_container(&mut self, k: usize) {
        let dir = self.node.root.join(format!("container-{k}"));
        std::fs::create_dir_all(&dir).expect("container dir");
        self.limits = dir.join("limits.toml");
        std::fs::write(&self.limits, LIMITS).expect("limits");
        self.region = dir.join("region");
        if publish_context_size() {
            // What tesserad publishes beside the limits: the GPU's context size (the node's 32 MiB).
            let model = tessera_sim_model::Node::open(self.node.description.as_deref(), Some(&self.node.state))
                .expect("open the node");
            let mut t = ContextSizes::new();
            assert!(t.set(&model.gpu(0).expect("GPU 0").uuid, 32 << 20));
            t.write_atomic(&dir.join(CONTEXT_SIZES_FILE)).expect("context sizes");
        }
    }

    fn command(&self, program: &Path, preload: Option<&Path>) -> Command {
        let mut c = self.node.command(program);
        c.env("LD_LIBRARY_PATH", &self.lib_dir)
            .env("TESSERA_LIMITS", &self.limits)
            .env("TESSERA_REGION", &self.region)
            .env_remove("CUDA_VISIBLE_DEVICES");
        match preload {
            Some(shim) => c.env("LD_PRELOAD", shim),
            None => c.env_remove("LD_PRELOAD"),
        };
        c
    }
}

/// One batch: `n` processes held at a FIFO, released together; their in-process start-up times
/// (µs) and how many were refused.
fn batch(setup: &Setup, n: usize, preload: Option<&Path>) -> (Vec<f64>, usize) {
    let exe = std::env::current_exe().expect("current_exe");
    let shim = profile_dir().join("libtessera.so");
    let warm = setup.command(&exe, Some(&shim)).env(CHILD, "warm").output().expect("the warm-up process");
    assert!(warm.status.success(), "warm-up: {}", String::from_utf8_lossy(&warm.stderr));
    let fifo = setup.node.root.join("go");
    let _ = std::fs::remove_file(&fifo);
    let path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0, "mkfifo");
    // One pipe for every child's lines (each shorter than PIPE_BUF: written whole).
    let mut fds = [0; 2];
    // SAFETY: a valid array of two.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");
    // SAFETY: pipe(2) just returned these two descriptors, owned by nobody else.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let mut kids: Vec<std::process::Child> = Vec::with_capacity(n);
    for _ in 0..n {
        let out = wr.try_clone().expect("dup");
        let k = setup
            .command(&exe, preload)
            .env(CHILD, &fifo)
            .stdout(Stdio::from(out))
            .stderr(if std::env::var_os("TESSERA_STARTUP_DEBUG").is_some() { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .expect("spawn a start-up process");
        kids.push(k);
    }
    drop(wr);
    let mut lines = BufReader::new(std::fs::File::from(rd)).lines();
    let mut ready = 0;
    while ready < n {
        let l = lines.next().expect("a line").expect("read");
        if l == "ready" {
            ready += 1;
        }
    }
    // Every process waits at the FIFO's open: opening it for writing releases them all.
    let go = std::fs::OpenOptions::new().write(true).open(&fifo).expect("open the FIFO");
    let (mut times, mut refused) = (Vec::with_capacity(n), 0);
    for l in lines.by_ref() {
        let l = l.expect("read");
        match l.strip_prefix("us ") {
            Some(v) => times.push(v.parse::<f64>().expect("microseconds")),
            None if l.starts_with("refused") => {
                refused += 1;
                if std::env::var_os("TESSERA_STARTUP_DEBUG").is_some() {
                    eprintln!("{l}");
                }
            }
            None => {}
        }
        if times.len() + refused == n {
            break;
        }
    }
    drop(go);
    let failed = kids.into_iter().map(|mut k| k.wait().is_ok_and(|st| st.success())).filter(|ok| !ok).count();
    assert_eq!(failed, 0, "{failed} start-up processes did not exit cleanly");
    (times, refused)
}

fn storm(layout: Layout, n: usize, rounds: usize) {
    let mut setup = Setup::new(layout);
    let model = tessera_sim_model::Node::open(setup.node.description.as_deref(), Some(&setup.node.state)).unwrap();
    model.reset_high_water(0, 0).unwrap();
    let (mut batches, mut peak) = (0, 0);
    let shim_lib = profile_dir().join("libtessera.so");
    let baseline = std::env::var_os("TESSERA_STARTUP_BASELINE_SHIM").map(PathBuf::from);
    let mut sides: Vec<(String, Option<&Path>)> = vec![("plain".into(), None), ("shim".into(), Some(&shim_lib))];
    if let Some(b) = &baseline {
        sides.push((format!("baseline shim ({})", b.display()), Some(b)));
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
    let mut refused = vec![0; sides.len()];
    for r in 0..rounds {
        let order = round_order(sides.len(), r);
        for i in order {
            batches += 1;
            setup.fresh_container(batches);
            let (t, x) = batch(&setup, n, sides[i].1);
            let region = tessera_region::Region::open_or_create(&setup.region).expect("region");
            peak = peak.max(region.snapshot().devices.first().map_or(0, |d| d.peak));
            refused[i] += x;
            samples[i].extend(t);
        }
    }
    let gpu_peak = model.memory_high_water(0, 0).unwrap();
    println!(
        "\nStart-up to the first cuMemAlloc_v2 with {n} processes started together ({layout:?}-object driver \
         layout; {rounds} interleaved rounds of batches; in process):"
    );
    let p = percentiles(&mut samples[0]);
    for (i, (name, _)) in sides.iter().enumerate() {
        let q = percentiles(&mut samples[i]);
        print!(
            "  {name}: p50 {:.0} µs, p99 {:.0} µs ({} processes, {} refused)",
            q.0,
            q.1,
            samples[i].len(),
            refused[i]
        );
        if i > 0 {
            print!("; added p50 {:.0} µs ({:.2}x), p99 {:.0} µs ({:.2}x)", q.0 - p.0, q.0 / p.0, q.1 - p.1, q.1 / p.1);
        }
        println!();
    }
    println!(
        "  the limit: {} MiB; the regions' peak {} MiB, the GPU's high-water mark {} MiB",
        LIMIT >> 20,
        peak >> 20,
        gpu_peak >> 20
    );
    let _ = std::io::stdout().flush();
}

/// (p50, p99) of the samples.
fn percentiles(v: &mut [f64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.50), at(0.99))
}

/// The sides of a comparison: plain, the shim, and the baseline shim if one is named.
fn sides() -> Vec<(String, Option<PathBuf>)> {
    let mut sides = vec![("plain".to_string(), None), ("shim".to_string(), Some(profile_dir().join("libtessera.so")))];
    if let Some(b) = std::env::var_os("TESSERA_STARTUP_BASELINE_SHIM").map(PathBuf::from) {
        sides.push((format!("baseline shim ({})", b.display()), Some(b)));
    }
    sides
}

/// One whole process per side under callgrind, every thread counted from `exec` to exit (the
/// wait for the helper thread aside); each side's threads, and the breakdown of what the shim
/// adds.
fn whole_instructions(layout: Layout) {
    let setup = Setup::new(layout);
    // The container's first process measures the context (its hint), as in a batch.
    let exe = std::env::current_exe().expect("current_exe");
    let shim = profile_dir().join("libtessera.so");
    let warm = setup.command(&exe, Some(&shim)).env(CHILD, "warm").output().expect("the warm-up process");
    assert!(warm.status.success(), "warm-up: {}", String::from_utf8_lossy(&warm.stderr));
    let sides = sides();
    println!(
        "\nWhole process, every thread, from exec to exit ({layout:?}-object layout; instructions, callgrind, \
         simulated latency off; the container's hint measured):"
    );
    for mode in ["whole", "whole-rt"] {
        if mode == "whole-rt" {
            println!(
                "  the same, after a CUDA runtime's look-ups (cuGetProcAddress_v2 for each of cudaTypedefs.h's \
                 base names, as libcudart does first):"
            );
        }
        whole_instructions_of(&setup, &sides, layout, mode);
    }
}

fn whole_instructions_of(setup: &Setup, sides: &[(String, Option<PathBuf>)], layout: Layout, mode: &str) {
    let exe = std::env::current_exe().expect("current_exe");
    let mut plain_total = 0u64;
    for (i, (name, preload)) in sides.iter().enumerate() {
        let out = profile_dir().join(format!("startup.{mode}.{layout:?}.{i}.callgrind"));
        for old in thread_profiles(&out) {
            let _ = std::fs::remove_file(old);
        }
        let mut c = setup.command(Path::new("valgrind"), preload.as_deref());
        // (A toggle turns collection at start off: `--collect-atstart=yes` must come after it.)
        c.args([
            "--tool=callgrind",
            "--separate-threads=yes",
            "--toggle-collect=*::wait_alone",
            "--collect-atstart=yes",
        ])
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(&exe)
        .env(CHILD, mode)
        .env("TESSERA_SIM_LATENCY", "off");
        let o = c.output().expect("run valgrind");
        assert!(o.status.success(), "start-up process: {}", String::from_utf8_lossy(&o.stderr));
        let threads: Vec<u64> = thread_profiles(&out).iter().map(|f| profile_total(f)).collect();
        let total: u64 = threads.iter().sum();
        if i == 0 {
            plain_total = total;
        }
        let waited = thread_profiles(&out).first().and_then(|f| inclusive_of(f, "startup::instr_first_alloc ["));
        print!(
            "  {name}: {total} ({} threads: {threads:?}; start-up thread, dlopen to the first allocation: {})",
            threads.len(),
            waited.map_or("?".into(), |n| n.to_string())
        );
        if i > 0 {
            print!("; added {} ({:.2}x)", total as i64 - plain_total as i64, total as f64 / plain_total as f64);
        }
        println!();
        if i > 0 {
            breakdown(&thread_profiles(&out));
        }
    }
}

/// Callgrind's per-thread profiles of one run (`out-01`, `out-02`, ...), in thread order.
fn thread_profiles(out: &Path) -> Vec<PathBuf> {
    let (dir, stem) = (out.parent().unwrap(), out.file_name().unwrap().to_string_lossy().into_owned());
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|p: &PathBuf| {
            p.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix(&stem)).is_some_and(|t| {
                t.strip_prefix('-').is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
            })
        })
        .collect();
    v.sort();
    v
}

/// A callgrind profile's instruction total.
fn profile_total(f: &Path) -> u64 {
    let text = std::fs::read_to_string(f).expect("a callgrind profile");
    let line = text.lines().find_map(|l| l.strip_prefix("summary: ").or_else(|| l.strip_prefix("totals: ")));
    line.and_then(|t| t.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// A function's inclusive count in a callgrind profile (the first line naming it).
fn inclusive_of(profile: &Path, function: &str) -> Option<u64> {
    let o =
        Command::new("callgrind_annotate").args(["--inclusive=yes", "--threshold=100"]).arg(profile).output().ok()?;
    let text = String::from_utf8_lossy(&o.stdout);
    text.lines()
        .filter(|l| l.contains(function))
        .find_map(|l| l.split_whitespace().next()?.replace(',', "").parse().ok())
}

/// Where the shim's instructions go in one whole process: inclusive counts of the functions that
/// make up its start-up, per thread, from `callgrind_annotate --inclusive=yes` (absent: 0).
fn breakdown(profiles: &[PathBuf]) {
    // (what, function name as callgrind_annotate prints it, or a part of it)
    const PARTS: &[(&str, &str)] = &[
        ("exec: the dynamic loader", "rtld.c:_dl_start "),
        ("state (limits, region, join)", "tessera::state::ensure_slow "),
        ("resolving the driver's functions", "tessera::real::RealCuda::resolve "),
        ("the context hook", "tessera::memory::context::charge_creation "),
        ("the context sizes file", "tessera::memory::context_size::any "),
        ("dlsym through the shim", "tessera::intercept::dl::dlsym_decide "),
        ("the helper thread", "tessera::memory::context::helper "),
        ("NVML's load", "tessera::real::nvml "),
        ("the true-up", "tessera::memory::context::true_up "),
    ];
    for (k, f) in profiles.iter().enumerate() {
        let o = Command::new("callgrind_annotate").args(["--inclusive=yes", "--threshold=100"]).arg(f).output();
        let Ok(o) = o else { return println!("    (callgrind_annotate not found: no breakdown)") };
        let text = String::from_utf8_lossy(&o.stdout);
        let inclusive = |pattern: &str| -> Option<u64> {
            text.lines()
                .filter(|l| l.contains(pattern))
                .find_map(|l| l.split_whitespace().next()?.replace(',', "").parse().ok())
        };
        let found: Vec<String> =
            PARTS.iter().filter_map(|(what, pat)| inclusive(pat).map(|n| format!("{what} {n}"))).collect();
        println!("    thread {}: {}", k + 1, found.join("; "));
    }
}

/// The order of the sides in round `r`: every permutation in turn (a fixed shuffle past six), so
/// that each side follows each other side, and itself, as often as any other does. Alternating
/// one order with its reverse did not: with three sides the middle one never ran right after
/// itself, and the end ones did at every round's boundary, which is cheaper (warm caches): an
/// A/A run (the same library as two sides) showed the middle one 100 to 230 µs dearer.
fn round_order(n: usize, r: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if n <= 3 {
        // The r-th permutation in lexicographic order (Lehmer code).
        let mut k = r % (1..=n).product::<usize>();
        let mut pool = order.clone();
        order.clear();
        for i in (0..n).rev() {
            let f: usize = (1..=i).product();
            order.push(pool.remove(k / f));
            k %= f;
        }
        return order;
    }
    // Fisher-Yates from a fixed xorshift stream seeded by the round.
    let mut x = (r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

/// `rounds` interleaved rounds of one process per side started alone; each process's CPU time
/// (user + system) from `wait4`.
fn cpu(layout: Layout, rounds: usize) {
    let mut setup = Setup::new(layout);
    setup.fresh_container(1);
    let exe = std::env::current_exe().expect("current_exe");
    let shim = profile_dir().join("libtessera.so");
    let warm = setup.command(&exe, Some(&shim)).env(CHILD, "warm").output().expect("the warm-up process");
    assert!(warm.status.success(), "warm-up: {}", String::from_utf8_lossy(&warm.stderr));
    let sides = sides();
    // User + system per process, µs (their sum is exact; the kernel splits it by tick samples).
    let mut us: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
    // Page faults (minor + major) per process, from the same rusage: the kernel's part of a start.
    let mut faults: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
    for r in 0..rounds {
        let order = round_order(sides.len(), r);
        for i in order {
            let mut c = setup.command(&exe, sides[i].1.as_deref());
            c.env(CHILD, "whole").stdout(Stdio::null()).stderr(Stdio::null());
            // Reaped by wait4 below, which also gives its rusage (std's wait gives none).
            #[allow(clippy::zombie_processes)]
            let child = c.spawn().expect("spawn a start-up process");
            let mut status = 0;
            // SAFETY: an all-zero rusage is valid; wait4 fills it for our own child.
            let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
            // SAFETY: the pid of our child, valid out-pointers.
            let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut ru) };
            assert_eq!(pid, child.id() as libc::pid_t, "wait4");
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "a start-up process failed");
            let t = |v: libc::timeval| v.tv_sec as f64 * 1e6 + v.tv_usec as f64;
            us[i].push(t(ru.ru_utime) + t(ru.ru_stime));
            faults[i].push((ru.ru_minflt + ru.ru_majflt) as f64);
        }
    }
    println!(
        "\nCPU (user + system) of a whole process that starts, makes its first allocation and waits for its \
         threads ({layout:?}-object layout; {rounds} interleaved rounds, one process at a time):"
    );
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    for (i, (name, _)) in sides.iter().enumerate() {
        print!("  {name}: median {:.0} µs, mean {:.0} µs", median(&us[i]), us[i].iter().sum::<f64>() / rounds as f64);
        if i > 0 {
            let d: Vec<f64> = us[i].iter().zip(&us[0]).map(|(s, p)| s - p).collect();
            print!(
                "; added: median of the rounds' differences {:.0} µs, mean {:.0} µs (ratio of medians {:.2})",
                median(&d),
                d.iter().sum::<f64>() / rounds as f64,
                median(&us[i]) / median(&us[0])
            );
        }
        print!("; page faults: median {:.0}", median(&faults[i]));
        println!();
    }
}

/// Waits until the shim's helper thread (`tessera-true-up`) is gone, up to 30 s: in a function
/// of its own, so that callgrind leaves it out (`--toggle-collect`). A fixed first sleep (no CPU),
/// then a look every 10 ms, so both sides pay the same one look where the helper is quick.
#[inline(never)]
fn wait_alone() {
    let helper = || {
        std::fs::read_dir("/proc/self/task")
            .into_iter()
            .flatten()
            .flatten()
            .any(|t| std::fs::read(t.path().join("comm")).is_ok_and(|c| c.starts_with(b"tessera-true-up")))
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    for _ in 0..3000 {
        if !helper() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A start-up process: says it is ready, waits at the FIFO (`-`: no wait), then measures; or
/// (`warm`) the container's first process, which asks `cuMemGetInfo` after its allocation; or
/// (`whole`) a process that makes its first allocation and waits for its other threads to end.
fn child(fifo: &Path) -> i32 {
    if fifo == Path::new("whole") || fifo == Path::new("whole-rt") {
        if fifo == Path::new("whole-rt") {
            runtime_lookups();
        }
        let r = instr_first_alloc();
        wait_alone();
        return i32::from(r.is_err());
    }
    if fifo == Path::new("warm") {
        let r = instr_first_alloc();
        // SAFETY: the loaded driver's (or the shim's) cuMemGetInfo_v2, cuda.h's signature.
        let rc = unsafe {
            let cuda = Library::new("libcuda.so.1").expect("load libcuda.so.1");
            let info: CuMemGetInfo = sym(&cuda, c"cuMemGetInfo_v2");
            let (mut free, mut total) = (0usize, 0usize);
            info(&mut free, &mut total)
        };
        return i32::from(r.is_err() || rc != 0);
    }
    if fifo != Path::new("-") {
        println!("ready");
        let _ = std::io::stdout().flush();
        // Blocks until the parent opens it for writing.
        let _go = std::fs::File::open(fifo).expect("open the FIFO");
    }
    match instr_first_alloc() {
        Ok(us) => println!("us {us:.1}"),
        Err((step, rc)) => println!("refused {rc} at {step}"),
    }
    0
}

/// What a CUDA runtime (12 and later) does first: every driver function it uses is asked of
/// `cuGetProcAddress_v2`. Here every base name of `cudaTypedefs.h`, at CUDA 12.8.
fn runtime_lookups() {
    type GetProc = unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> R;
    // SAFETY: loading the (simulated) driver runs only its own initializers.
    let cuda = unsafe { Library::new("libcuda.so.1") }.expect("load libcuda.so.1");
    // SAFETY: cuda.h's signatures (the driver's, or the shim's hooks).
    let (init, get): (CuInit, GetProc) = unsafe { (sym(&cuda, c"cuInit"), sym(&cuda, c"cuGetProcAddress_v2")) };
    // SAFETY: a plain flag.
    assert_eq!(unsafe { init(0) }, 0, "cuInit");
    let mut bases: Vec<&str> = tessera_abi::cuda::EXPORTS.iter().map(|e| e.base).collect();
    bases.sort_unstable();
    bases.dedup();
    let mut found = 0;
    for b in bases {
        let name = std::ffi::CString::new(b).expect("a name");
        let (mut p, mut status) = (std::ptr::null_mut(), 0);
        // SAFETY: a valid C string and out-pointers.
        if unsafe { get(name.as_ptr(), &mut p, 12080, 0, &mut status) } == 0 && !p.is_null() {
            found += 1;
        }
    }
    assert!(found > 100, "cuGetProcAddress_v2 found {found} functions");
    std::mem::forget(cuda);
}

/// The start-up a process pays to its first allocation, in a function of its own for callgrind.
#[inline(never)]
fn instr_first_alloc() -> Result<f64, (&'static str, R)> {
    let t = Instant::now();
    // SAFETY: loading the (simulated) driver runs only its own initializers.
    let cuda = unsafe { Library::new("libcuda.so.1") }.expect("load libcuda.so.1");
    // SAFETY: these names have these signatures in cuda.h (the driver's, or the shim's hooks).
    let (init, retain, set_current, alloc): (CuInit, CuRetain, CuSetCurrent, CuAlloc) = unsafe {
        (
            sym(&cuda, c"cuInit"),
            sym(&cuda, c"cuDevicePrimaryCtxRetain"),
            sym(&cuda, c"cuCtxSetCurrent"),
            sym(&cuda, c"cuMemAlloc_v2"),
        )
    };
    let (mut ctx, mut p) = (std::ptr::null_mut(), 0u64);
    let ok = |rc: R, step| if rc == 0 { Ok(()) } else { Err((step, rc)) };
    // SAFETY: valid out-pointers; the context comes from the driver.
    unsafe {
        ok(init(0), "cuInit")?;
        ok(retain(&mut ctx, 0), "cuDevicePrimaryCtxRetain")?;
        ok(set_current(ctx), "cuCtxSetCurrent")?;
        ok(alloc(&mut p, MIB), "cuMemAlloc_v2")?;
    }
    let us = t.elapsed().as_nanos() as f64 / 1000.0;
    std::mem::forget(cuda);
    Ok(us)
}

/// # Safety
/// `T` must be the symbol's function type.
unsafe fn sym<T: Copy>(lib: &Library, name: &CStr) -> T {
    // SAFETY: the caller's promise.
    *unsafe { lib.get::<T>(name.to_bytes_with_nul()) }.unwrap_or_else(|e| panic!("{name:?}: {e}"))
}
