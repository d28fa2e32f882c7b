//! A process's first context is charged the estimate reserved before it was made, and trued up
//! to what it measured later (on a helper thread, or before a reservation that would otherwise
//! be refused): the excess must never refuse an allocation the limit allows, never leave the
//! limit passed, and never outlive a process killed before its true-up.

mod common;

use std::ffi::{OsString, c_int, c_uint, c_void};
use std::path::Path;
use std::process::Stdio;

use common::cuda::*;
use common::*;
use tessera_region::Region;
use tessera_sim_model::Node;
use tessera_sim_testkit::{SimNode, binary};

/// The shim's reservation for a context before any was measured (`memory::context`).
const ESTIMATE_MIB: u64 = 512;

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k}"))
}

// ---- Up to the limit, right after the context ------------------------------------------------

const LIMIT: u64 = GIB;

/// A fresh container limited to [`LIMIT`], and its accounting region.
fn limited_container() -> (Container, Region) {
    let c = Container::new(&memory_limits(LIMIT));
    let region = c.region();
    (c, region)
}

/// Right after its context is made, a process allocates everything the limit leaves (in one
/// piece, or in 4 MiB chunks until refused): it gets exactly that, whether the context's excess
/// reservation was still charged or not (then the refused reservation trued it up and retried).
/// Each run in a fresh container, so that each first context is reserved the default estimate.
#[test]
fn a_process_allocating_up_to_the_limit_right_after_its_context_gets_all_of_it() {
    let test = "a_process_allocating_up_to_the_limit_right_after_its_context_gets_all_of_it";
    let Some(node) = parent_node(fill_child) else { return };
    let mut deferred = 0;
    let runs = 12;
    for i in 0..runs {
        let c = Container::new(&memory_limits(LIMIT));
        let mut env = container_env(&c, &node);
        env.push(("FILL_CHUNKED".into(), OsString::from(if i % 2 == 0 { "0" } else { "1" })));
        let err = wait_child(test, spawn_child(test, env));
        deferred += usize::from(err.contains("excess still charged"));
        c.region().reap();
        assert_eq!(c.region().used(0), 0, "all of it came back");
    }
    println!("{deferred} of {runs} first allocations found the context's excess still charged");
}

fn fill_child() {
    let s = Session::start(0);
    let (region, dev) = region_and_dev(&s);
    let at_start = region.used(dev);
    if at_start == ESTIMATE_MIB * MIB {
        eprintln!("excess still charged at the first allocation");
    } else {
        assert_eq!(at_start, OVERHEAD_MIB * MIB, "the estimate, or the context as measured");
    }
    let room = LIMIT - OVERHEAD_MIB * MIB;
    let got = if var("FILL_CHUNKED") == "1" {
        let chunk = 4 * MIB;
        let mut got = 0;
        while s.alloc(chunk).is_ok() {
            got += chunk;
        }
        got
    } else {
        s.alloc(room).expect("everything the limit leaves, in one piece");
        room
    };
    assert_eq!(got, room, "exactly what the limit leaves beside the context");
    assert_eq!(s.alloc(MIB), Err(OUT_OF_MEMORY), "and not a byte more");
    assert_eq!(region.used(dev), LIMIT);
    assert_eq!(gpu_used(0), LIMIT, "the GPU holds the limit exactly");
    assert_eq!(s.mem_info(), (0, LIMIT));
}

// ---- Two processes at once, under a tight limit ----------------------------------------------

/// Room for two contexts and 212 MiB each: both reserve the 512 MiB estimate at once (filling
/// the limit), true up, and then each gets its 212 MiB; the GPU never holds more than the limit.
#[test]
fn two_processes_starting_at_once_under_a_tight_limit_each_get_their_share() {
    let test = "two_processes_starting_at_once_under_a_tight_limit_each_get_their_share";
    if in_child() {
        return pair_child();
    }
    let limit = 2 * ESTIMATE_MIB * MIB;
    for round in 0..3 {
        // A node of its own each time: nothing of the last round's processes is on its GPU.
        let node = node();
        let c = Container::new(&memory_limits(limit));
        let model = Node::open(node.description.as_deref(), Some(&node.state)).unwrap();
        model.reset_high_water(0, 0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kids: Vec<_> = (0..2)
            .map(|i| {
                let mut env = container_env(&c, &node);
                env.push(("TEST_DIR".into(), dir.path().into()));
                env.push(("PAIR_INDEX".into(), i.to_string().into()));
                spawn_child(test, env)
            })
            .collect();
        for k in kids {
            wait_child(test, k);
        }
        let (gpu, region) = (model.memory_high_water(0, 0).unwrap(), c.region().snapshot().devices[0].peak);
        assert!(gpu <= limit && region <= limit, "round {round}: the GPU held {gpu}, the region {region}, of {limit}");
    }
}

fn pair_child() {
    let dir = test_dir();
    let me = var("PAIR_INDEX");
    let other = if me == "0" { "1" } else { "0" };
    let s = Session::start(0);
    let (region, dev) = region_and_dev(&s);
    // cuMemGetInfo trues this process's context up before it answers.
    let (free, total) = s.mem_info();
    assert_eq!(total, 2 * ESTIMATE_MIB * MIB);
    assert!(free <= total - OVERHEAD_MIB * MIB, "this process's context is counted: {free}");
    std::fs::write(dir.join(format!("ready-{me}")), "").unwrap();
    wait_for(&dir.join(format!("ready-{other}")));
    let share = 2 * (ESTIMATE_MIB - OVERHEAD_MIB) * MIB / 2;
    let p = s.alloc(share).expect("this process's share: both contexts are trued up");
    std::fs::write(dir.join(format!("allocated-{me}")), "").unwrap();
    wait_for(&dir.join(format!("allocated-{other}")));
    assert_eq!(s.alloc(MIB), Err(OUT_OF_MEMORY), "the limit is full");
    assert_eq!(region.used(dev), 2 * ESTIMATE_MIB * MIB);
    assert_eq!(gpu_used(0), 2 * ESTIMATE_MIB * MIB);
    std::fs::write(dir.join(format!("checked-{me}")), "").unwrap();
    wait_for(&dir.join(format!("checked-{other}")));
    s.free(p);
}

// ---- Killed before the true-up ---------------------------------------------------------------

/// A driver directory with `libcuda.so.1` alone: NVML cannot be loaded, so a first context's
/// true-up never happens and its estimate stays charged (nothing can be measured).
fn without_nvml(node: &SimNode, dir: &Path) -> OsString {
    let lib = dir.join("lib");
    std::fs::create_dir(&lib).unwrap();
    std::os::unix::fs::symlink(std::fs::canonicalize(node.cuda_path()).unwrap(), lib.join("libcuda.so.1")).unwrap();
    lib.into_os_string()
}

/// `kill -9` of a process whose context's excess is still charged: the reap gives all of it
/// back, and the next process gets exactly what the limit leaves beside its own context. Then
/// processes that kill themselves the instant their context is made (the helper thread's
/// true-up racing the kill) leave nothing behind either; and one that makes its context and
/// then calls nothing more is seen trued up by the daemon soon after.
#[test]
fn a_process_killed_before_its_true_up_leaves_nothing_charged() {
    let test = "a_process_killed_before_its_true_up_leaves_nothing_charged";
    let Some(node) = parent_node(killed_child) else { return };
    let (c, region) = limited_container();
    let libs = tempfile::tempdir().unwrap();
    let mut env = container_env(&c, &node);
    env.retain(|(k, _)| k != "LD_LIBRARY_PATH");
    env.push(("LD_LIBRARY_PATH".into(), without_nvml(&node, libs.path())));
    env.push(("KILL_MODE".into(), "wait".into()));
    let (mut child, _dir) = spawn_ready(test, env);
    assert_eq!(region.used(0), ESTIMATE_MIB * MIB, "the excess is still charged (no NVML: no true-up)");
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(region.reap(), 1);
    assert_eq!(region.used(0), 0, "the reap gave the estimate back");
    let room = (LIMIT / MIB - OVERHEAD_MIB).to_string();
    let (code, r, _) = workload(&c, &node, &["--alloc-mib", &room]);
    assert_eq!(code, 0, "the next process gets all the limit leaves: {r}");

    for _ in 0..6 {
        let c = Container::new(&memory_limits(LIMIT));
        let mut env = container_env(&c, &node);
        env.push(("KILL_MODE".into(), "self".into()));
        let status = spawn_child(test, env).wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9));
        c.region().reap();
        assert_eq!(c.region().used(0), 0, "nothing of the killed process stays charged");
    }

    let c = Container::new(&memory_limits(LIMIT));
    let mut env = container_env(&c, &node);
    env.push(("KILL_MODE".into(), "wait".into()));
    let (mut child, _dir) = spawn_ready(test, env);
    let region = c.region();
    assert_eq!(settled(OVERHEAD_MIB * MIB, || region.used(0)), OVERHEAD_MIB * MIB, "trued up without another call");
    assert_eq!(region.context_hint(0), OVERHEAD_MIB * MIB, "and measured for the container's next contexts");
    child.kill().unwrap();
    child.wait().unwrap();
}

fn killed_child() {
    let _s = Session::start(0);
    if var("KILL_MODE") == "self" {
        // SAFETY: signals this process; nothing to clean up.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    ready_then_wait();
}

// ---- Many at once: the helper thread, the refusals and the exits racing ------------------------

/// Sixty processes of one container start at once under a limit that takes about a third of
/// them, each making its context and asking for 100 MiB right away: the GPU never holds more
/// than the limit, and once they are gone nothing stays charged.
#[test]
fn many_first_contexts_at_once_never_pass_the_limit_and_leave_nothing() {
    let node = node();
    let limit = 8 * GIB;
    let c = Container::new(&memory_limits(limit));
    let model = Node::open(node.description.as_deref(), Some(&node.state)).unwrap();
    model.reset_high_water(0, 0).unwrap();
    let kids: Vec<_> = (0..60)
        .map(|_| {
            c.command(&node, binary("tessera-workload"))
                .args(["--alloc-mib", "100"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn")
        })
        .collect();
    let ok = kids.into_iter().filter_map(|mut k| k.wait().unwrap().success().then_some(())).count();
    assert!(ok >= (limit / ((ESTIMATE_MIB + 100) * MIB)) as usize, "{ok} of 60 got their context and 100 MiB");
    assert!(model.memory_high_water(0, 0).unwrap() <= limit, "the GPU passed the limit");
    let region = c.region();
    region.reap();
    assert_eq!(region.used(0), 0);
}

/// A context made while another thread allocates and frees: a measurement that memory moving
/// meanwhile would skew is not taken (the estimate stays charged). Taken, a free between the two
/// readings made a context read as nothing: 33 of 300 contexts went uncharged, and the process
/// held 10 GiB under a 2 GiB limit.
#[test]
fn contexts_made_while_other_threads_allocate_and_free_are_never_undercharged() {
    let Some(s) =
        limited_session("contexts_made_while_other_threads_allocate_and_free_are_never_undercharged", 48 * GIB)
    else {
        return;
    };
    let cu = &s.cu;
    let (region, dev) = region_and_dev(&s);
    // The first context's true-up done (it is deferred at start-up): the base.
    settled(OVERHEAD_MIB * MIB, || region.used(dev));
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            // SAFETY: the session's context made current on this thread; valid out-pointers.
            unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(s.ctx)) };
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(p) = s.alloc(256 * MIB) {
                    s.free(p);
                }
            }
        });
        for _ in 0..100 {
            let mut ctx: H = std::ptr::null_mut();
            // SAFETY: a valid out-pointer; device 0.
            ck("cuCtxCreate_v2", unsafe { (cu.cuCtxCreate_v2)(&mut ctx, 0, 0) });
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    // Nothing but contexts is left: what the GPU holds for them is all charged (an estimate
    // kept where a reading could not count is more, never less).
    let (charged, gpu) = (region.used(dev), gpu_used(0));
    assert!(charged >= gpu, "charged {} MiB, the GPU holds {} MiB", charged / MIB, gpu / MIB);
}

// ---- Memory allocated around the shim is no context's size ------------------------------------

/// Allocated by the offender through the driver's own `cuMemAlloc_v2`, unseen by the shim.
const BYPASS_MIB: u64 = 900;

/// A process allocates 900 MiB through the driver's own `cuMemAlloc_v2` (found behind the shim's
/// back) right after its first context, and is killed. Its true-up reads NVML's figure for the
/// process, context and bypass together: charged to it (the GPU held it), that figure must not
/// become the container's context estimate. Before, it did, and every later process of the
/// 1 GiB container, honest ones included, got `CUDA_ERROR_OUT_OF_MEMORY` at its context (the
/// estimate, 1.2 GiB, never fit). A hint the container writes itself (2 GiB) locks it out no
/// more: an estimate above the default that does not fit is tried at the default, and the
/// true-up puts the true figure back.
#[test]
fn memory_allocated_around_the_shim_never_becomes_the_containers_context_estimate() {
    let test = "memory_allocated_around_the_shim_never_becomes_the_containers_context_estimate";
    let Some(node) = parent_node(bypass_child) else { return };
    let (c, region) = limited_container();
    let (mut child, _dir) = spawn_ready(test, container_env(&c, &node));
    child.kill().unwrap();
    child.wait().unwrap();
    region.reap();
    assert_eq!(region.used(0), 0, "the offender's charge is gone with it");
    assert!(
        region.context_hint(0) <= ESTIMATE_MIB * MIB,
        "the bypass was taken for a context: hint {} MiB",
        region.context_hint(0) / MIB
    );
    let honest = |what: &str| {
        let (code, r, stderr) = workload(&c, &node, &["--alloc-mib", "700"]);
        assert_eq!(code, 0, "{what}: an honest process gets its context and 700 MiB: {r} {stderr}");
        assert_eq!(region.context_hint(0), OVERHEAD_MIB * MIB, "{what}: the estimate is the true figure");
    };
    honest("after the offender");
    region.set_context_hint(0, 2 * GIB);
    honest("after a 2 GiB hint written by the container");
}

fn bypass_child() {
    type Init = unsafe extern "C" fn(c_uint) -> R;
    type Retain = unsafe extern "C" fn(*mut H, c_int) -> R;
    type SetCurrent = unsafe extern "C" fn(H) -> R;
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> R;
    // The driver's own functions, found behind the shim's back: device 0's primary context made
    // current and 900 MiB allocated there before the shim sees a context.
    let _loaded = Cuda::load();
    // SAFETY: the driver's own functions, of these signatures (cuda.h).
    let (init, retain, set, alloc): (Init, Retain, SetCurrent, Alloc) = unsafe {
        (
            std::mem::transmute::<*const c_void, Init>(behind_the_shim("cuInit")),
            std::mem::transmute::<*const c_void, Retain>(behind_the_shim("cuDevicePrimaryCtxRetain")),
            std::mem::transmute::<*const c_void, SetCurrent>(behind_the_shim("cuCtxSetCurrent")),
            std::mem::transmute::<*const c_void, Alloc>(behind_the_shim("cuMemAlloc_v2")),
        )
    };
    let (mut ctx, mut p): (H, u64) = (std::ptr::null_mut(), 0);
    // SAFETY: valid out-pointers; the context is the one just retained.
    unsafe {
        ck("cuInit (behind the shim)", init(0));
        ck("cuDevicePrimaryCtxRetain (behind the shim)", retain(&mut ctx, 0));
        ck("cuCtxSetCurrent (behind the shim)", set(ctx));
        ck("cuMemAlloc_v2 (behind the shim)", alloc(&mut p, (BYPASS_MIB * MIB) as usize));
    }
    // Then the program goes on through the shim: its first context there, trued up from NVML's
    // figure for the process.
    let s = Session::start(0);
    s.mem_info();
    let (region, dev) = region_and_dev(&s);
    settled((OVERHEAD_MIB + BYPASS_MIB) * MIB, || region.used(dev));
    ready_then_wait();
}
