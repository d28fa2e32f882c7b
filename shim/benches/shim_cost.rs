//! What the shim adds to each call it intercepts, measured against the same call made straight
//! into the (simulated) driver, in the same process and the same run, since these machines are
//! shared and noisy: only the difference between the two sides means anything.
//!
//! Both libraries are loaded here with `dlopen` (`RTLD_NOW | RTLD_LOCAL`), and each function is
//! taken from each: `libcuda.so.1` (the simulated driver) for the "driver" side, `libtessera.so`
//! for the "shim" side. Calling the shim's exports directly runs exactly what a preloaded shim
//! runs for a direct-linked program: its hooks find the real driver themselves, by
//! `dlopen("libcuda.so.1", RTLD_NOLOAD)` and glibc's `dlsym` on that handle (`src/real.rs`),
//! never through symbol interposition. That `dlopen` by name searches `LD_LIBRARY_PATH` as the
//! loader read it at start-up, so this binary runs itself again as a child with the simulated
//! node's environment (driver directory, node state, the container's limits file and region).
//!
//! Pairs (criterion group `shim_cost`):
//! - `launch`: `cuLaunchKernel` of a 1 ns kernel on device 0, which has no SM share (the
//!   unthrottled path);
//! - `launch_limited`: the same on device 1, `sm_percent = 99` (the throttled path: token
//!   bucket, CUDA events around the launches the sampler picks: one in 16 for such tiny
//!   kernels). The bucket may run dry: on an idle stream a measured kernel's span includes the
//!   gap between its two event records (~0.5 µs here), every launch is charged that mean, and
//!   launches come faster than that; the region's report after the run gives the time
//!   throttled. The instruction-count mode has it twice:
//!   `launch_sampled` (one in 16 measured, as a native run does) and `launch_throttled` (every
//!   launch measured and settled, as for kernels of 64 µs and more);
//! - `alloc_free_1MiB`: `cuMemAlloc_v2` + `cuMemFree_v2` of 1 MiB on device 0, whose 70 GiB
//!   limit is enforced;
//! - `alloc_free_async_1MiB`: `cuMemAllocAsync` + `cuMemFreeAsync` of 1 MiB on an explicit
//!   stream of device 0, from its default pool (charged as the pool holds it: two attribute
//!   reads of the pool around each call);
//! - `dlsym_miss`: `dlsym(RTLD_DEFAULT, "pthread_create")`, glibc's against the shim's export
//!   (a name it does not hook: what every process the shim is preloaded into pays per `dlsym`);
//! - `spawn_true`: spawn `/bin/true` and wait, without and with `LD_PRELOAD=libtessera.so`
//!   (what a process that never touches CUDA pays for the preload).
//!
//! And one baseline, not a pair: the driver's own `cuCtxGetCurrent`, against an empty call, in
//! the same run. A process that sees several devices asks it on every default-stream launch
//! (the stream's device is the current context's), so that row's added cost splits into the
//! driver call the shim makes and the shim's own work.
//!
//! With `TESSERA_SHIM_BENCH_TRACE=1` the shim side runs as while a trace is recorded
//! (`tessera trace`): the cost of tracing.
//!
//! After criterion, each pair is measured once more interleaved (blocks of calls alternating
//! driver, shim, shim, driver, ...), and the median of the per-round differences is printed:
//! noise that lasts longer than a block hits both sides alike.
//!
//! Run: `scripts/bench.sh shim_cost`, i.e. `cargo build --workspace --release && cargo bench -p
//! tessera-shim --bench shim_cost` (the release `libtessera.so` and `libtessera_sim.so` must be
//! built: the bench loads them).

use std::collections::BTreeMap;
use std::ffi::{CStr, OsString, c_char, c_int, c_uint, c_void};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use criterion::Criterion;
use libloading::Library;
use tessera_sim_testkit::{SimNode, profile_dir};

/// Set in the child that runs the benchmarks.
const CHILD: &str = "TESSERA_SHIM_BENCH_CHILD";
const GIB: u64 = 1 << 30;
const MIB: usize = 1 << 20;

/// The container's limits: device 0 a memory limit and no SM share (the unthrottled launch
/// path, allocations checked against a limit); device 1 a 99% SM share (the throttled path).
const LIMITS: &str = r#"version = 1
container = "shim-cost-bench"

[[devices]]
uuid = "index:0"
memory_limit = "70GiB"

[[devices]]
uuid = "index:1"
sm_percent = 99
"#;

/// The third run's container: both devices with a memory limit, neither with an SM share, so a
/// default stream's device comes from the thread's view of its current context.
const LIMITS_NO_SHARE: &str = r#"version = 1
container = "shim-cost-bench"

[[devices]]
uuid = "*"
memory_limit = "70GiB"
"#;

/// Set in the third run's child: the container has no SM share.
const NO_SHARE: &str = "TESSERA_SHIM_BENCH_NO_SHARE";

fn main() {
    // A real driver's call latency (docs/sim.md), unless TESSERA_SIM_LATENCY says otherwise.
    tessera_sim_testkit::real_driver_latency_unless_set();
    if std::env::var_os(FIRST_ALLOC).is_some() {
        first_alloc();
        return;
    }
    if std::env::var_os(CHILD).is_none() {
        std::process::exit(parent());
    }
    child();
}

/// Set in a process that measures its own start-up: `cuInit`, device 0's primary context made
/// current and the first `cuMemAlloc_v2` (1 MiB), through `dlopen("libcuda.so.1")` + `dlsym` as
/// a program does (under `LD_PRELOAD=libtessera.so` these find the shim's hooks); prints the
/// microseconds from before the `dlopen` to the allocation's return.
const FIRST_ALLOC: &str = "TESSERA_SHIM_BENCH_FIRST_ALLOC";

/// The start-up a process pays to its first allocation, in a function of its own for callgrind.
#[inline(never)]
fn instr_first_alloc() -> f64 {
    let t = Instant::now();
    let cuda = open(Path::new("libcuda.so.1"));
    // SAFETY: these names have these signatures in cuda.h (the driver's or the shim's hooks).
    let (init, retain, alloc): (CuInit, CuRetain, CuAlloc) =
        unsafe { (sym(&cuda, c"cuInit"), sym(&cuda, c"cuDevicePrimaryCtxRetain"), sym(&cuda, c"cuMemAlloc_v2")) };
    // SAFETY: as above; the shim does not hook cuCtxSetCurrent.
    let set_current: CuSetCurrent = unsafe { sym(&cuda, c"cuCtxSetCurrent") };
    let (mut ctx, mut p) = (std::ptr::null_mut(), 0u64);
    // SAFETY: valid out-pointers; the context comes from the driver.
    unsafe {
        check(init(0), "cuInit");
        check(retain(&mut ctx, 0), "cuDevicePrimaryCtxRetain");
        check(set_current(ctx), "cuCtxSetCurrent");
        check(alloc(&mut p, MIB), "cuMemAlloc_v2");
    }
    let us = t.elapsed().as_nanos() as f64 / 1000.0;
    std::mem::forget(cuda);
    us
}

fn first_alloc() {
    println!("{:.1}", instr_first_alloc());
}

/// Start-up to the first allocation, without and with the shim preloaded: `runs` interleaved
/// pairs of processes (medians of the in-process times), or with `instr` the instructions of
/// [`instr_first_alloc`] under callgrind, one process each.
fn first_alloc_pairs(node: &SimNode, limits: &Path, region: &Path, runs: usize, instr: bool) {
    let shim = profile_dir().join("libtessera.so");
    let exe = std::env::current_exe().expect("current_exe");
    let run = |preload: bool| -> f64 {
        let out = profile_dir().join(format!("shim_cost.first_alloc.{}.callgrind", u8::from(preload)));
        let mut c = if instr {
            let mut c = node.command("valgrind");
            c.args(["--tool=callgrind", "--collect-atstart=no", "--toggle-collect=*::instr_first_alloc"])
                .arg(format!("--callgrind-out-file={}", out.display()))
                .arg(&exe);
            c
        } else {
            node.command(&exe)
        };
        c.env(FIRST_ALLOC, "1").env("TESSERA_LIMITS", limits).env("TESSERA_REGION", region);
        match preload {
            true => c.env("LD_PRELOAD", &shim),
            false => c.env_remove("LD_PRELOAD"),
        };
        let o = c.output().expect("run the start-up child");
        assert!(o.status.success(), "start-up child: {}", String::from_utf8_lossy(&o.stderr));
        if instr {
            let text = std::fs::read_to_string(&out).expect("the callgrind profile");
            let total = text.lines().find_map(|l| l.strip_prefix("summary: ")).expect("a summary line");
            return total.trim().parse().expect("a count");
        }
        String::from_utf8_lossy(&o.stdout).trim().parse().expect("microseconds")
    };
    if instr {
        let (plain, shim) = (run(false), run(true));
        println!(
            "\nStart-up to the first cuMemAlloc_v2 (instructions, callgrind; in process: dlopen, cuInit, context, alloc):"
        );
        println!("  plain {plain:.0}, shim preloaded {shim:.0}, added {:.0} ({:.2}x)", shim - plain, shim / plain);
        return;
    }
    let (mut a, mut b, mut d) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        let (x, y) = if i % 2 == 0 {
            let x = run(false);
            (x, run(true))
        } else {
            let y = run(true);
            (run(false), y)
        };
        a.push(x);
        b.push(y);
        d.push(y - x);
    }
    println!("\nStart-up to the first cuMemAlloc_v2, in process ({runs} interleaved pairs of processes, medians):");
    println!("  plain {:.0} µs, shim preloaded {:.0} µs, added {:.0} µs", median(a), median(b), median(d));
}

/// Makes the node and the container's files, runs this binary again inside them, and passes on
/// its exit status. The node's files live as long as this process.
fn parent() -> i32 {
    let node = SimNode::new();
    let limits = node.root.join("limits.toml");
    std::fs::write(&limits, LIMITS).expect("write the limits file");
    let limits_no_share = node.root.join("limits-no-share.toml");
    std::fs::write(&limits_no_share, LIMITS_NO_SHARE).expect("write the limits file");
    let region = node.root.join("region");
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let instr = std::env::var(INSTR).ok().filter(|v| !v.is_empty());
    // The whole node, then a process that sees device 0 alone (CUDA_VISIBLE_DEVICES=0): the
    // default stream's device needs no lookup there; then the whole node with no SM share
    // (interleaved pairs only, not under callgrind).
    for (run, visible) in [(0, None), (1, Some("0")), (2, None)] {
        let no_share = run == 2;
        if no_share && instr.is_some() {
            continue;
        }
        let exe = std::env::current_exe().expect("current_exe");
        // Kept beside the build for a closer look (callgrind_annotate).
        let out = profile_dir().join(format!("shim_cost.{run}.callgrind"));
        if instr.is_some() {
            remove_profile(&out);
        }
        let mut c = match &instr {
            Some(_) => {
                let mut c = node.command("valgrind");
                // Instructions are counted only inside the marker functions, and a profile part
                // is dumped as each marker begins: each part holds the previous marker's count.
                c.args(["--tool=callgrind", "--collect-atstart=no", "--toggle-collect=*::instr_*"])
                    .arg("--dump-before=shim_cost::instr_*")
                    .arg(format!("--callgrind-out-file={}", out.display()))
                    .arg(exe);
                c
            }
            None => node.command(exe),
        };
        c.args(&args)
            .env(CHILD, "1")
            .env("TESSERA_LIMITS", if no_share { &limits_no_share } else { &limits })
            .env("TESSERA_REGION", &region)
            .env_remove("LD_PRELOAD");
        match visible {
            Some(v) => c.env("CUDA_VISIBLE_DEVICES", v),
            None => c.env_remove("CUDA_VISIBLE_DEVICES"),
        };
        if no_share {
            c.env(NO_SHARE, "1");
        } else {
            c.env_remove(NO_SHARE);
        }
        let status = c.status().expect("run the benchmark child");
        if !status.success() {
            return status.code().unwrap_or(1);
        }
        if let Some(n) = &instr {
            let n: u64 = n.parse().expect("TESSERA_SHIM_BENCH_INSTR: a number of calls per side");
            print_instructions(&out, n, visible.is_some());
        }
    }
    if instr.is_some() || args.iter().any(|a| a == "--bench") {
        first_alloc_pairs(&node, &limits, &region, 40, instr.is_some());
    }
    0
}

/// Calls per side in the instruction-count mode (`TESSERA_SHIM_BENCH_INSTR=N`): each pair's
/// sides run N times under callgrind, each in a function of its own (`instr_*`), and the table
/// gives the instructions per call of each side from those functions' inclusive costs.
const INSTR: &str = "TESSERA_SHIM_BENCH_INSTR";

/// Runs `f` `n` times in a function named for the pair and side, so that callgrind's inclusive
/// cost of that function is exactly that side's (the loop and closure are the same on both).
macro_rules! counted {
    ($($name:ident),* $(,)?) => {
        $(#[inline(never)]
        fn $name(n: u64, f: &mut dyn FnMut()) {
            // Unlike every other marker's body: identical functions would be merged into one.
            black_box(stringify!($name));
            for _ in 0..n {
                f();
            }
        })*
        /// The pairs the instruction-count mode measures, by marker function name prefix.
        const COUNTED: &[&str] = &[$(stringify!($name)),*];
    };
}

counted!(
    instr_launch_default_driver,
    instr_launch_default_shim,
    instr_launch_explicit_driver,
    instr_launch_explicit_shim,
    instr_launch_per_thread_driver,
    instr_launch_per_thread_shim,
    instr_launch_throttled_driver,
    instr_launch_throttled_shim,
    instr_launch_sampled_driver,
    instr_launch_sampled_shim,
    instr_alloc_free_1mib_driver,
    instr_alloc_free_1mib_shim,
    instr_baseline_empty,
    instr_baseline_ctx_get_current,
);

/// Runs what comes between two markers and calls the shim as a marker of its own, not printed.
/// Callgrind counts calls even where it collects nothing, but dumps (and so resets) only code it
/// collected in: run outside any marker, these calls would count in the next marker's part.
#[inline(never)]
fn instr_between(f: &mut dyn FnMut()) {
    black_box("instr_between");
    f();
}

/// Removes a callgrind profile and its parts from an earlier run.
fn remove_profile(profile: &Path) {
    let _ = std::fs::remove_file(profile);
    for k in 1.. {
        if std::fs::remove_file(format!("{}.{k}", profile.display())).is_err() {
            break;
        }
    }
}

/// Reads each marker's instructions from the callgrind profile parts (part `k`, dumped as marker
/// `k` began, holds marker `k - 1`'s count; the final dump, the last marker's) and prints
/// instructions per call: driver, shim, added.
fn print_instructions(profile: &Path, n: u64, one_device: bool) {
    let mut cost = std::collections::HashMap::new();
    let mut calls = std::collections::HashMap::new();
    let mut previous: Option<String> = None;
    let parts = (1..).map(|k| format!("{}.{k}", profile.display())).take_while(|p| Path::new(p).exists());
    let parts: Vec<String> = parts.chain([profile.display().to_string()]).collect();
    for path in parts {
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let total = text
            .lines()
            .find_map(|l| l.strip_prefix("summary: "))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
        if let (Some(m), Some(t)) = (previous.take(), total) {
            let from_shim = m.ends_with("_shim");
            calls.insert(m.clone(), driver_calls(&text, from_shim));
            cost.insert(m, t);
        }
        previous = text
            .lines()
            .find_map(|l| l.strip_prefix("desc: Trigger: --dump-before="))
            .and_then(|f| f.rsplit("::").next())
            .map(str::to_string);
    }
    let process = if one_device { "a process seeing device 0 alone" } else { "a process seeing both devices" };
    println!("\nInstructions per call (callgrind, {n} calls per side), {process}; and the calls into the driver");
    println!("per call (from the bench on the driver side, from the shim on the shim side):");
    println!(
        "{:<28} {:>10} {:>10} {:>10} {:>13} {:>11}",
        "pair", "driver", "shim", "added", "driver calls", "shim calls"
    );
    let per = |m: &str| calls.get(m).map_or(0.0, |c: &BTreeMap<String, u64>| c.values().sum::<u64>() as f64 / n as f64);
    for name in COUNTED.iter().filter_map(|m| m.strip_suffix("_driver")) {
        let (driver, shim) = (format!("{name}_driver"), format!("{name}_shim"));
        let (Some(d), Some(s)) = (cost.get(&driver), cost.get(&shim)) else {
            continue;
        };
        let (d, s) = (*d as f64 / n as f64, *s as f64 / n as f64);
        let pair = name.trim_start_matches("instr_");
        println!("{pair:<28} {d:>10.1} {s:>10.1} {:>10.1} {:>13.2} {:>11.2}", s - d, per(&driver), per(&shim));
        // Which driver functions the shim called, per call of the pair.
        if let Some(c) = calls.get(&shim) {
            let mut by: Vec<_> = c.iter().collect();
            by.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            let list: Vec<String> = by.iter().map(|(f, k)| format!("{f} {:.2}", **k as f64 / n as f64)).collect();
            println!("    the shim's driver calls: {}", list.join(", "));
        }
    }
    let per_call = |m: &str| cost.get(m).map(|&c| c as f64 / n as f64);
    if let (Some(empty), Some(get)) = (per_call("instr_baseline_empty"), per_call("instr_baseline_ctx_get_current")) {
        let call = get - empty;
        println!("driver's cuCtxGetCurrent alone: {call:.1} instructions per call");
        let default = per_call("instr_launch_default_shim").zip(per_call("instr_launch_default_driver"));
        if let (false, Some((s, d))) = (one_device, default) {
            println!(
                "  launch_default's +{:.1} added = {call:.1} that driver call + {:.1} the shim's own",
                s - d,
                s - d - call
            );
        }
    }
}

/// The calls a callgrind profile part records into the simulated driver's object, by the driver
/// function called: from the shim (`libtessera.so`) if `from_shim`, else from outside the
/// driver (the bench's own code). The format
/// (valgrind's "Callgrind Format Specification"): `ob=`/`fn=` name the caller of the call lines
/// that follow, `cob=`/`cfn=` the callee of the next `calls=` line (an absent `cob=` is the
/// caller's object), and a name given once as `(id) name` is `(id)` after.
fn driver_calls(text: &str, from_shim: bool) -> BTreeMap<String, u64> {
    let mut names: std::collections::HashMap<(char, String), String> = std::collections::HashMap::new();
    // `kind` is 'o' for objects, 'f' for functions (their ids are separate).
    let mut name = |kind: char, v: &str| -> String {
        let v = v.trim();
        match v.strip_prefix('(').and_then(|r| r.split_once(')')) {
            Some((id, rest)) if !rest.trim().is_empty() => {
                names.insert((kind, id.to_string()), rest.trim().to_string());
                rest.trim().to_string()
            }
            Some((id, _)) => names.get(&(kind, id.to_string())).cloned().unwrap_or_default(),
            None => v.to_string(),
        }
    };
    let is_driver = |ob: &str| {
        let file = ob.rsplit('/').next().unwrap_or(ob);
        file.starts_with("libcuda.so") || file.starts_with("libtessera_sim")
    };
    let (mut ob, mut cob, mut cfn) = (String::new(), None::<String>, String::new());
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("ob=") {
            ob = name('o', v);
        } else if let Some(v) = line.strip_prefix("cob=") {
            cob = Some(name('o', v));
        } else if let Some(v) = line.strip_prefix("cfn=") {
            cfn = name('f', v);
        } else if let Some(v) = line.strip_prefix("fn=") {
            name('f', v);
        } else if let Some(v) = line.strip_prefix("calls=") {
            let callee = cob.take().unwrap_or_else(|| ob.clone());
            let count = v.split_whitespace().next().and_then(|c| c.parse::<u64>().ok()).unwrap_or(0);
            let caller_counts =
                if from_shim { ob.rsplit('/').next() == Some("libtessera.so") } else { !is_driver(&ob) };
            if is_driver(&callee) && caller_counts {
                *out.entry(cfn.clone()).or_insert(0) += count;
            }
        }
    }
    out
}

type R = c_int;
type H = *mut c_void;
type CuInit = unsafe extern "C" fn(c_uint) -> R;
type CuRetain = unsafe extern "C" fn(*mut H, c_int) -> R;
type CuSetCurrent = unsafe extern "C" fn(H) -> R;
type CuGetCurrent = unsafe extern "C" fn(*mut H) -> R;
type CuSync = unsafe extern "C" fn() -> R;
type CuLoad = unsafe extern "C" fn(*mut H, *const c_void) -> R;
type CuGetFn = unsafe extern "C" fn(*mut H, H, *const c_char) -> R;
type CuLaunch = unsafe extern "C" fn(H, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, H, *mut H, *mut H) -> R;
type CuAlloc = unsafe extern "C" fn(*mut u64, usize) -> R;
type CuFree = unsafe extern "C" fn(u64) -> R;
type CuAllocAsync = unsafe extern "C" fn(*mut u64, usize, H) -> R;
type CuFreeAsync = unsafe extern "C" fn(u64, H) -> R;
type CuMemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> R;
type Dlsym = unsafe extern "C" fn(H, *const c_char) -> H;

/// The functions a side (driver or shim) is called through.
#[derive(Clone, Copy)]
struct Side {
    launch: CuLaunch,
    launch_ptsz: CuLaunch,
    alloc: CuAlloc,
    free: CuFree,
    alloc_async: CuAllocAsync,
    free_async: CuFreeAsync,
}

/// `dlopen(path, RTLD_NOW | RTLD_LOCAL)`.
fn open(path: &Path) -> Library {
    // SAFETY: loading the simulated driver or the shim: neither has initializers that do more
    // than std's own (the shim has no constructor; its state is made on the first CUDA call).
    let lib = unsafe { libloading::os::unix::Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    lib.unwrap_or_else(|e| panic!("dlopen {}: {e}", path.display())).into()
}

/// `dlsym(lib, name)` as a function of type `T`.
///
/// # Safety
/// The library's symbol `name` must be a function with the C signature `T`.
unsafe fn sym<T: Copy>(lib: &Library, name: &CStr) -> T {
    // SAFETY: the caller's contract.
    let s = unsafe { lib.get::<T>(name.to_bytes_with_nul()) };
    *s.unwrap_or_else(|e| panic!("{}: {e}", name.to_string_lossy()))
}

/// The address of a function pointer, for telling the two sides apart.
fn addr<T: Copy>(f: T) -> usize {
    assert_eq!(size_of::<T>(), size_of::<usize>());
    // SAFETY: T is a function pointer (same size as usize, checked above).
    unsafe { std::mem::transmute_copy::<T, usize>(&f) }
}

fn check(rc: R, what: &str) {
    assert_eq!(rc, 0, "{what} returned {rc}");
}

fn child() {
    let shim_path = profile_dir().join("libtessera.so");
    assert!(
        shim_path.exists(),
        "{} is missing: build it first (cargo build --workspace --release)",
        shim_path.display()
    );
    // The driver the way a program finds it: by name, through LD_LIBRARY_PATH (the node's).
    let cuda = open(Path::new("libcuda.so.1"));
    let shim = open(&shim_path);

    // SAFETY: these names have these signatures in cuda.h / dlfcn.h, in the simulated driver
    // and in the shim alike (for every `sym` below).
    let (driver, hooked) = unsafe {
        (
            Side {
                launch: sym(&cuda, c"cuLaunchKernel"),
                launch_ptsz: sym(&cuda, c"cuLaunchKernel_ptsz"),
                alloc: sym(&cuda, c"cuMemAlloc_v2"),
                free: sym(&cuda, c"cuMemFree_v2"),
                alloc_async: sym(&cuda, c"cuMemAllocAsync"),
                free_async: sym(&cuda, c"cuMemFreeAsync"),
            },
            Side {
                launch: sym(&shim, c"cuLaunchKernel"),
                launch_ptsz: sym(&shim, c"cuLaunchKernel_ptsz"),
                alloc: sym(&shim, c"cuMemAlloc_v2"),
                free: sym(&shim, c"cuMemFree_v2"),
                alloc_async: sym(&shim, c"cuMemAllocAsync"),
                free_async: sym(&shim, c"cuMemFreeAsync"),
            },
        )
    };
    assert_ne!(addr(driver.launch), addr(hooked.launch), "the shim's cuLaunchKernel is the driver's");
    // SAFETY: as above.
    let (cu_init, retain, shim_mem_info): (CuInit, CuRetain, CuMemInfo) =
        unsafe { (sym(&shim, c"cuInit"), sym(&shim, c"cuDevicePrimaryCtxRetain"), sym(&shim, c"cuMemGetInfo_v2")) };
    // The shim hooks cuCtxSetCurrent (it keeps each thread's view of its current context), as
    // a preloaded program's calls reach it; it does not hook the others (it does not export
    // them): the driver's, as under a preload.
    // SAFETY: as above.
    let (set_current, sync, load, get_fn): (CuSetCurrent, CuSync, CuLoad, CuGetFn) = unsafe {
        (
            sym(&shim, c"cuCtxSetCurrent"),
            sym(&cuda, c"cuCtxSynchronize"),
            sym(&cuda, c"cuModuleLoadData"),
            sym(&cuda, c"cuModuleGetFunction"),
        )
    };
    // The driver's, alone: what the shim calls on a multi-device process's default-stream launch.
    // SAFETY: as above.
    let get_current: CuGetCurrent = unsafe { sym(&cuda, c"cuCtxGetCurrent") };
    // SAFETY: as above.
    let shim_dlsym: Dlsym = unsafe { sym(&shim, c"dlsym") };
    let libc_dlsym: Dlsym = libc::dlsym;
    assert_ne!(addr(shim_dlsym), addr(libc_dlsym), "the shim's dlsym is glibc's");

    // Set-up through the shim, so that its state (limits, region slot, context overhead) is
    // made as in a program: cuInit, then each device's primary context.
    // A child run with CUDA_VISIBLE_DEVICES set sees device 0 alone.
    let one_device = std::env::var_os("CUDA_VISIBLE_DEVICES").is_some();
    let devices = if one_device { 1 } else { 2 };
    let mut ctx = [std::ptr::null_mut(); 2];
    let mut func = [std::ptr::null_mut(); 2];
    // Device 1's kernels that keep its default stream busy (the sampled pair, below).
    let (mut busy_1ms, mut busy_2s): (H, H) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out-pointers; handles come from the driver; C string literals.
    unsafe {
        check(cu_init(0), "cuInit (shim)");
        for dev in 0..devices {
            check(retain(&mut ctx[dev], dev as c_int), "cuDevicePrimaryCtxRetain (shim)");
            check(set_current(ctx[dev]), "cuCtxSetCurrent");
            let mut module = std::ptr::null_mut();
            check(load(&mut module, c"bench".as_ptr().cast()), "cuModuleLoadData");
            check(get_fn(&mut func[dev], module, c"bench_1ns".as_ptr()), "cuModuleGetFunction");
            if dev == 1 {
                check(get_fn(&mut busy_1ms, module, c"bench_busy_1ms".as_ptr()), "cuModuleGetFunction");
                check(get_fn(&mut busy_2s, module, c"bench_busy_2000ms".as_ptr()), "cuModuleGetFunction");
            }
        }
        check(set_current(ctx[0]), "cuCtxSetCurrent");
        let (mut free, mut total) = (0usize, 0usize);
        check(shim_mem_info(&mut free, &mut total), "cuMemGetInfo_v2 (shim)");
        assert_eq!(total as u64, 70 * GIB, "device 0's limit is not in force");
    }

    let null: H = std::ptr::null_mut();
    let launch = |s: Side, f: H| {
        // SAFETY: f is a live function of the current context; NULL stream, no parameters.
        move || black_box(unsafe { (s.launch)(f, 1, 1, 1, 32, 1, 1, 0, null, null.cast(), null.cast()) })
    };
    // An explicit (non-default) stream on device 0: the shim must tell its device (issue 15).
    type CuStreamCreate = unsafe extern "C" fn(*mut H, c_uint) -> c_int;
    // SAFETY: the driver's export of that name has this signature (cuda.h).
    let stream_create: CuStreamCreate = unsafe { sym(&cuda, c"cuStreamCreate") };
    let mut stream: H = std::ptr::null_mut();
    // SAFETY: device 0's primary context is current; a valid out-pointer; flags 1 (non-blocking).
    check(unsafe { stream_create(&mut stream, 1) }, "cuStreamCreate");
    let launch_on = |s: Side, f: H| {
        // SAFETY: f is a live function of the current context; stream lives for the bench.
        move || black_box(unsafe { (s.launch)(f, 1, 1, 1, 32, 1, 1, 0, stream, null.cast(), null.cast()) })
    };
    // The per-thread default stream: `_ptsz` with the NULL stream.
    let launch_pt = |s: Side, f: H| {
        // SAFETY: f is a live function of the current context; NULL stream, no parameters.
        move || black_box(unsafe { (s.launch_ptsz)(f, 1, 1, 1, 32, 1, 1, 0, null, null.cast(), null.cast()) })
    };
    let alloc_free = |s: Side| {
        move || {
            let mut p = 0u64;
            // SAFETY: p is a valid out-pointer.
            check(unsafe { (s.alloc)(&mut p, MIB) }, "cuMemAlloc_v2");
            // SAFETY: p was just allocated by the same side.
            black_box(unsafe { (s.free)(p) })
        }
    };
    // Stream-ordered, on the explicit stream, from the device's default pool (its memory kept
    // by the pool: the shim reads the pool's size around each call).
    let alloc_free_async = |s: Side| {
        move || {
            let mut p = 0u64;
            // SAFETY: p is a valid out-pointer; stream lives for the bench.
            check(unsafe { (s.alloc_async)(&mut p, MIB, stream) }, "cuMemAllocAsync");
            // SAFETY: p was just allocated by the same side, on the same stream.
            black_box(unsafe { (s.free_async)(p, stream) })
        }
    };
    let lookup = |d: Dlsym| {
        // SAFETY: RTLD_DEFAULT and a C string literal, as dlsym takes.
        move || black_box(unsafe { d(libc::RTLD_DEFAULT, c"pthread_create".as_ptr()) })
    };
    let spawn = |preload: Option<PathBuf>| {
        move || {
            let mut c = Command::new("/bin/true");
            match &preload {
                Some(p) => c.env("LD_PRELOAD", p),
                None => c.env_remove("LD_PRELOAD"),
            };
            assert!(c.status().expect("spawn /bin/true").success());
        }
    };
    assert_eq!(lookup(libc_dlsym)(), lookup(shim_dlsym)(), "the two dlsym answers differ");
    let ctx_get_current = || {
        let mut c: H = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        black_box(unsafe { get_current(&mut c) });
        black_box(c)
    };
    // The other side of the baseline: the same closure shape, no call.
    let empty = || {
        let c: H = std::ptr::null_mut();
        black_box(0);
        black_box(c)
    };
    // SAFETY: the primary contexts retained above are live.
    let set = |dev: usize| check(unsafe { set_current(ctx[dev]) }, "cuCtxSetCurrent");
    // SAFETY: the current context is live.
    let drain = || check(unsafe { sync() }, "cuCtxSynchronize");

    // `TESSERA_SHIM_BENCH_TRACE=1`: every shim call runs as while the daemon records a trace
    // (API spans, kernels measured with CUDA events, into the region's trace ring, which nobody
    // reads here: it wraps).
    if std::env::var_os("TESSERA_SHIM_BENCH_TRACE").is_some_and(|v| v == "1")
        && let Some(path) = std::env::var_os("TESSERA_REGION")
    {
        let region = tessera_region::Region::open_or_create(Path::new(&path)).expect("region");
        region.set_trace_requested(true);
        println!("tracing: on");
    }
    if let Some(n) = std::env::var(INSTR).ok().and_then(|v| v.parse::<u64>().ok()) {
        set(0);
        instr_launch_default_driver(n, &mut || {
            launch(driver, func[0])();
        });
        instr_launch_default_shim(n, &mut || {
            launch(hooked, func[0])();
        });
        drain();
        instr_launch_explicit_driver(n, &mut || {
            launch_on(driver, func[0])();
        });
        instr_launch_explicit_shim(n, &mut || {
            launch_on(hooked, func[0])();
        });
        drain();
        instr_launch_per_thread_driver(n, &mut || {
            launch_pt(driver, func[0])();
        });
        instr_launch_per_thread_shim(n, &mut || {
            launch_pt(hooked, func[0])();
        });
        drain();
        instr_baseline_empty(n, &mut || {
            empty();
        });
        instr_baseline_ctx_get_current(n, &mut || {
            ctx_get_current();
        });
        if !one_device {
            set(1);
            // Every launch measured and settled. Under callgrind the clock runs tens of times
            // slow, so a 1 ns kernel's events on an idle stream span tens of µs (the time
            // between the two records; the first launches, code valgrind translates, far
            // more), and the sampler measures every launch, as it does for kernels of 64 µs
            // and more.
            instr_launch_throttled_driver(n, &mut || {
                launch(driver, func[1])();
            });
            instr_launch_throttled_shim(n, &mut || {
                launch(hooked, func[1])();
            });
            drain();
            // The same as a native run goes for 1 ns kernels: one launch in 16 measured. First
            // the sampler learns them with the stream busy across each pair of records (a
            // driver-launched 1 ms kernel ahead, waited for) until the slow spans above have
            // left its running mean square; then each side runs behind a 2 s kernel: nothing
            // completes meanwhile, so the weight stays 16, and the shim side's figure leaves
            // out settling (a query and an elapsed time per measured launch once its kernel
            // has completed, in the pair above).
            instr_between(&mut || {
                for _ in 0..8000 {
                    launch(driver, busy_1ms)();
                    launch(hooked, func[1])();
                    drain();
                }
            });
            launch(driver, busy_2s)();
            instr_launch_sampled_driver(n, &mut || {
                launch(driver, func[1])();
            });
            drain();
            launch(driver, busy_2s)();
            instr_launch_sampled_shim(n, &mut || {
                launch(hooked, func[1])();
            });
            drain();
            set(0);
            instr_alloc_free_1mib_driver(n, &mut || {
                alloc_free(driver)();
            });
            instr_alloc_free_1mib_shim(n, &mut || {
                alloc_free(hooked)();
            });
        }
        return;
    }
    let full_run = std::env::args().any(|a| a == "--bench");
    if std::env::var_os(NO_SHARE).is_some() {
        if full_run {
            println!(
                "\nA process that sees both devices, neither with an SM share (the default streams' device from \
                 the thread's view of its current context), interleaved:"
            );
            println!("{:<28} {:>12} {:>12} {:>12} {:>7}", "pair", "driver", "shim", "added", "ratio");
            for dev in [0, 1] {
                set(dev);
                interleaved(1000, 1000, launch(driver, func[dev]), launch(hooked, func[dev]))
                    .print(&format!("launch, default stream, {dev}"));
                drain();
                interleaved(1000, 1000, launch_pt(driver, func[dev]), launch_pt(hooked, func[dev]))
                    .print(&format!("launch, per-thread, {dev}"));
                drain();
            }
            set(0);
            interleaved(1000, 1000, launch_on(driver, func[0]), launch_on(hooked, func[0]))
                .print("launch, explicit stream, 0");
            drain();
            report_region();
        }
        return;
    }
    if one_device {
        if full_run {
            println!("\nA process that sees device 0 alone (CUDA_VISIBLE_DEVICES=0), interleaved:");
            println!("{:<28} {:>12} {:>12} {:>12} {:>7}", "pair", "driver", "shim", "added", "ratio");
            set(0);
            interleaved(1000, 1000, launch(driver, func[0]), launch(hooked, func[0])).print("launch, default stream");
            drain();
            interleaved(1000, 1000, launch_on(driver, func[0]), launch_on(hooked, func[0]))
                .print("launch, explicit stream");
            drain();
            interleaved(1000, 1000, launch_pt(driver, func[0]), launch_pt(hooked, func[0]))
                .print("launch, per-thread stream");
            drain();
        }
        return;
    }
    let mut c = Criterion::default()
        .sample_size(50)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut g = c.benchmark_group("shim_cost");
    let pairs: [(&str, usize, Side, Side); 2] = [("launch", 0, driver, hooked), ("launch_limited", 1, driver, hooked)];
    for (name, dev, d, s) in pairs {
        let right = if dev == 0 { "shim_unlimited" } else { "shim_sm99" };
        g.bench_function(format!("{name}/driver"), |b| {
            set(dev);
            b.iter(launch(d, func[dev]));
            drain();
        });
        g.bench_function(format!("{name}/{right}"), |b| {
            set(dev);
            b.iter(launch(s, func[dev]));
            drain();
        });
    }
    set(0);
    g.bench_function("alloc_free_1MiB/driver", |b| b.iter(alloc_free(driver)));
    g.bench_function("alloc_free_1MiB/shim", |b| b.iter(alloc_free(hooked)));
    g.bench_function("alloc_free_async_1MiB/driver", |b| b.iter(alloc_free_async(driver)));
    g.bench_function("alloc_free_async_1MiB/shim", |b| b.iter(alloc_free_async(hooked)));
    g.bench_function("dlsym_miss/libc", |b| b.iter(lookup(libc_dlsym)));
    g.bench_function("dlsym_miss/shim", |b| b.iter(lookup(shim_dlsym)));
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    g.bench_function("spawn_true/plain", |b| b.iter(spawn(None)));
    g.bench_function("spawn_true/preloaded", |b| b.iter(spawn(Some(shim_path.clone()))));
    g.finish();

    if full_run {
        println!("\nInterleaved (median per call of each side; added = median of per-round differences):");
        println!("{:<28} {:>12} {:>12} {:>12} {:>7}", "pair", "driver", "shim", "added", "ratio");
        set(0);
        let r = interleaved(1000, 1000, launch(driver, func[0]), launch(hooked, func[0]));
        r.print("launch (unlimited)");
        drain();
        // The driver call the shim makes in that row, alone (empty call vs the call).
        let g = interleaved(1000, 1000, empty, ctx_get_current);
        g.print("(driver cuCtxGetCurrent)");
        println!(
            "{:<28} {:>12} {:>12} {:>12}",
            "  = that call + shim's own",
            "",
            show(g.added_ns),
            show(r.added_ns - g.added_ns)
        );
        let r = interleaved(1000, 1000, launch_on(driver, func[0]), launch_on(hooked, func[0]));
        r.print("launch, explicit stream");
        drain();
        let r = interleaved(1000, 1000, launch_pt(driver, func[0]), launch_pt(hooked, func[0]));
        r.print("launch, per-thread stream");
        drain();
        set(1);
        let r = interleaved(1000, 500, launch(driver, func[1]), launch(hooked, func[1]));
        r.print("launch_limited (sm 99%)");
        drain();
        set(0);
        interleaved(400, 200, alloc_free(driver), alloc_free(hooked)).print("alloc_free_1MiB");
        interleaved(400, 200, alloc_free_async(driver), alloc_free_async(hooked)).print("alloc_free_async_1MiB");
        interleaved(1000, 2000, lookup(libc_dlsym), lookup(shim_dlsym)).print("dlsym_miss");
        interleaved(200, 1, spawn(None), spawn(Some(shim_path.clone()))).print("spawn_true");
        report_region();
    }
    c.final_summary();
}

/// Interleaved measurement of a pair: per-call medians of each side and of the difference.
struct Interleaved {
    driver_ns: f64,
    shim_ns: f64,
    added_ns: f64,
}

impl Interleaved {
    fn print(&self, name: &str) {
        println!(
            "{:<28} {:>12} {:>12} {:>12} {:>7.2}",
            name,
            show(self.driver_ns),
            show(self.shim_ns),
            show(self.added_ns),
            self.shim_ns / self.driver_ns
        );
    }
}

fn show(ns: f64) -> String {
    if ns.abs() >= 10_000.0 { format!("{:.1} µs", ns / 1000.0) } else { format!("{ns:.1} ns") }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The mean time of one call of `f` over `block` calls.
fn per_call<T>(block: u32, f: &mut impl FnMut() -> T) -> f64 {
    let t = Instant::now();
    for _ in 0..block {
        black_box(f());
    }
    t.elapsed().as_nanos() as f64 / f64::from(block)
}

/// `rounds` rounds, each timing a block of `block` calls of each side, in the order
/// driver-shim, then shim-driver, and so on (so slow drift favours neither).
fn interleaved<A, B>(
    rounds: usize,
    block: u32,
    mut driver: impl FnMut() -> A,
    mut shim: impl FnMut() -> B,
) -> Interleaved {
    // Warm-up.
    per_call(block, &mut driver);
    per_call(block, &mut shim);
    let (mut d, mut s, mut diff) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let (a, b) = if r % 2 == 0 {
            let a = per_call(block, &mut driver);
            (a, per_call(block, &mut shim))
        } else {
            let b = per_call(block, &mut shim);
            (per_call(block, &mut driver), b)
        };
        d.push(a);
        s.push(b);
        diff.push(b - a);
    }
    Interleaved { driver_ns: median(d), shim_ns: median(s), added_ns: median(diff) }
}

/// What the container's region recorded: the shim really limited and counted (launches, GPU time
/// measured, time throttled: 0 means the bucket never ran dry).
fn report_region() {
    let Some(path) = std::env::var_os("TESSERA_REGION") else { return };
    let Ok(region) = tessera_region::Region::open_or_create(Path::new(&path)) else { return };
    let snap = region.snapshot();
    println!("\nRegion after the run:");
    for d in &snap.devices {
        println!("  device {} ({}): used {} MiB, peak {} MiB", d.index, d.uuid, d.used >> 20, d.peak >> 20);
    }
    for p in &snap.processes {
        for d in &p.devices {
            println!(
                "  pid {} device {}: {} launches, {} ns GPU time measured, {} ns throttled, {} OOM denials",
                p.pid, d.dev, d.launches, d.gpu_time_ns, d.throttled_ns, d.oom_denials
            );
        }
    }
}
