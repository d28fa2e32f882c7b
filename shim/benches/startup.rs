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
//! interleaved with the other two: a before/after comparison in the same run.
//!
//! `TESSERA_STARTUP_DEBUG=1` shows the start-up processes' stderr and each refusal.
//!
//! With `TESSERA_SHIM_BENCH_INSTR` set, one process per side and layout runs under callgrind
//! instead, and the instructions of its start-up thread from before the `dlopen` to the
//! allocation's return are printed (a helper thread's work is not counted: it is off the path
//! the program waits on).
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
    for layout in layouts {
        if std::env::var_os(INSTR).is_some_and(|v| !v.is_empty()) {
            instructions(layout);
        } else {
            storm(layout, n, rounds);
        }
    }
    println!("load average after: {}", load().trim());
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
        let mut order: Vec<usize> = (0..sides.len()).collect();
        if r % 2 == 1 {
            order.reverse();
        }
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

/// One process per side under callgrind, counting only [`instr_first_alloc`].
fn instructions(layout: Layout) {
    let setup = Setup::new(layout);
    let exe = std::env::current_exe().expect("current_exe");
    let count = |preload: bool| -> u64 {
        let out = profile_dir().join(format!("startup.first_alloc.{layout:?}.{}.callgrind", u8::from(preload)));
        let shim = profile_dir().join("libtessera.so");
        let mut c = setup.command(Path::new("valgrind"), preload.then_some(shim.as_path()));
        c.args(["--tool=callgrind", "--collect-atstart=no", "--toggle-collect=*::instr_first_alloc"])
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&exe)
            .env(CHILD, "-");
        let o = c.output().expect("run valgrind");
        assert!(o.status.success(), "start-up process: {}", String::from_utf8_lossy(&o.stderr));
        let text = std::fs::read_to_string(&out).expect("the callgrind profile");
        let total = text.lines().find_map(|l| l.strip_prefix("summary: ")).expect("a summary line");
        total.trim().parse().expect("a count")
    };
    let (plain, shim) = (count(false), count(true));
    println!(
        "\nStart-up to the first cuMemAlloc_v2 ({layout:?}-object layout; instructions, callgrind, start-up thread): \
         plain {plain}, shim {shim}, added {} ({:.2}x)",
        shim as i64 - plain as i64,
        shim as f64 / plain as f64
    );
}

/// A start-up process: says it is ready, waits at the FIFO (`-`: no wait), then measures; or
/// (`warm`) the container's first process, which asks `cuMemGetInfo` after its allocation.
fn child(fifo: &Path) -> i32 {
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
