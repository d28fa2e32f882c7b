//! Limits a container cannot lift: a hostile process that scribbles over the container's region
//! lifts nothing; virtual-memory allocations stay charged while mapped; contexts are reserved
//! before they are made, so a storm of processes starting at once never passes the limit on the
//! GPU itself (the simulated node's own accounting, not only the shim's).

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use common::cuda::*;
use common::*;
use tessera_region::{DeviceLimits, Limits, MAX_DEVICES, Region};
use tessera_sim_model::Node;
use tessera_sim_testkit::binary;

// ---- A hostile writer of the region ----------------------------------------------------------

/// Everything in the container's region a tenant might hope the shim trusts: every device entry's
/// former limit mirror (layout 2's `memory_limit` = 0 meant "no limit"), the context hint, and
/// the compute bucket (a full balance, a refill stamp from the future). Then the generation is
/// bumped, so every process re-reads its limits.
fn scribble(region: &Region) {
    let l = region.layout();
    for d in l.devices.iter().take(MAX_DEVICES) {
        d.exited_oom_denials.store(0, SeqCst);
        d.context_hint.store(0, SeqCst);
        d.bucket.tokens_ns.store(i64::MAX, SeqCst);
        d.bucket.refill_ns.store(u64::MAX, SeqCst);
    }
    region.bump_config_generation();
}

#[test]
fn a_hostile_writer_of_the_region_lifts_no_limit() {
    let test = "a_hostile_writer_of_the_region_lifts_no_limit";
    let Some(node) = parent_node(hostile_victim) else { return };
    let limits = Limits {
        devices: vec![DeviceLimits { uuid: "*".into(), memory_limit: Some(GIB), sm_percent: Some(10) }],
        ..Limits::default()
    };
    let c = Container::new(&limits);
    let (child, dir) = spawn_ready(test, container_env(&c, &node));
    // The hostile process: this one, mapping the container's region as any of its processes can.
    scribble(&c.region());
    std::fs::write(dir.path().join("go"), "").unwrap();
    wait_child(test, child);
}

/// A container whose region's device table was filled with names of no device before its
/// process started: the device cannot be counted, so no context is made on it (fail closed).
/// Unmapped, it was passed through: 10 GiB allocated under a 2 GiB limit.
#[test]
fn a_device_table_filled_by_the_container_makes_no_context_uncounted() {
    let test = "a_device_table_filled_by_the_container_makes_no_context_uncounted";
    if in_child() {
        let cu = Cuda::load();
        // SAFETY: valid out-pointers throughout.
        unsafe {
            ck("cuInit", (cu.cuInit)(0));
            let mut ctx: H = std::ptr::null_mut();
            assert_eq!((cu.cuDevicePrimaryCtxRetain)(&mut ctx, 0), NOT_PERMITTED, "no context to allocate in");
            assert_eq!((cu.cuCtxCreate_v2)(&mut ctx, 0, 0), NOT_PERMITTED);
        }
        assert_eq!(gpu_used(0), 0, "nothing reached the GPU");
        return;
    }
    let node = node();
    let c = Container::new(&memory_limits(2 * GIB));
    let region = c.region();
    for i in 0..MAX_DEVICES {
        region.device(&format!("GPU-00000000-0000-0000-0000-{i:012}")).expect("a junk entry");
    }
    let err = wait_child(test, spawn_child(test, container_env(&c, &node)));
    assert!(err.contains("no context is made on it"), "said why on stderr: {err}");
}

fn hostile_victim() {
    let dir = test_dir();
    let s = Session::start(0);
    let (region, dev) = region_and_dev(&s);
    let _a = s.alloc(512 * MIB).expect("300 + 512 MiB fit in 1 GiB");
    std::fs::write(dir.join("ready"), "").unwrap();
    wait_for(&dir.join("go"));
    assert_eq!(region.layout().devices[dev].exited_oom_denials.load(SeqCst), 0, "the region was scribbled on");

    // Memory: the limit holds, and the virtual GPU is still the limit's size.
    assert_eq!(s.alloc(512 * MIB), Err(OUT_OF_MEMORY), "300 + 1024 MiB do not fit in 1 GiB");
    for _ in 0..3 {
        assert_eq!(s.alloc(768 * MIB), Err(OUT_OF_MEMORY));
    }
    assert_eq!(s.mem_info(), (GIB - 812 * MIB, GIB));
    let mut total = 0usize;
    // SAFETY: a valid out-pointer.
    ck("cuDeviceTotalMem", unsafe { (s.cu.cuDeviceTotalMem_v2)(&mut total, 0) });
    assert_eq!(total as u64, GIB);
    assert_eq!(gpu_used(0), 812 * MIB, "the GPU holds no more than the limit allows");

    // Compute: the 10% share still throttles (a full balance counts as the burst cap only).
    let cu = &s.cu;
    let f = kernel(cu, "tessera_test_spin_1ms");
    // SAFETY: valid out-pointers; handles from the driver; no kernel parameters.
    unsafe {
        let mut stream: H = std::ptr::null_mut();
        ck("cuStreamCreate", (cu.cuStreamCreate)(&mut stream, 0));
        let none: *mut *mut std::ffi::c_void = std::ptr::null_mut();
        // One at a time, so each kernel's measured time is charged before the next launch.
        for _ in 0..20 {
            ck("cuLaunchKernel", (cu.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, stream, none, none));
            ck("cuStreamSynchronize", (cu.cuStreamSynchronize)(stream));
        }
    }
    let pid = std::process::id();
    let snap = region.snapshot();
    let me = snap.processes.iter().find(|p| p.pid == pid).expect("our slot");
    assert!(me.devices[dev].throttled_ns > 0, "20 kernels of 1 ms at 10% were throttled");

    // The daemon's way still works: rewrite the read-only file, bump the generation.
    let limits = PathBuf::from(std::env::var_os("TESSERA_LIMITS").unwrap());
    memory_limits(2 * GIB).write_atomic(&limits).unwrap();
    region.bump_config_generation();
    let _b = s.alloc(512 * MIB).expect("the new limit applies at once");
    assert_eq!(s.mem_info().1, 2 * GIB);

    // A tenant holding the generation back delays a change by about a second, no more: the file
    // itself is looked at.
    memory_limits(3 * GIB).write_atomic(&limits).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let got = loop {
        match s.alloc(GIB) {
            Ok(p) => break p,
            Err(rc) => assert_eq!(rc, OUT_OF_MEMORY),
        }
        assert!(Instant::now() < deadline, "a replaced limits file was never read without a generation bump");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(s.mem_info().1, 3 * GIB);
    s.free(got);
}

// ---- Virtual memory --------------------------------------------------------------------------

/// `cuMemCreate` of `bytes` on device 0.
fn create(s: &Session, bytes: u64) -> Result<u64, R> {
    let prop = MemAllocProp::device(0);
    let mut h = 0u64;
    // SAFETY: a valid out-pointer and property struct.
    match unsafe { (s.cu.cuMemCreate)(&mut h, bytes as usize, &prop, 0) } {
        SUCCESS => Ok(h),
        rc => Err(rc),
    }
}

fn map(s: &Session, va: u64, bytes: u64, h: u64) {
    // SAFETY: va lies in a range this process reserved; h is a live handle.
    ck("cuMemMap", unsafe { (s.cu.cuMemMap)(va, bytes as usize, 0, h, 0) });
}

fn unmap(s: &Session, va: u64, bytes: u64) {
    // SAFETY: the range was mapped by this process.
    ck("cuMemUnmap", unsafe { (s.cu.cuMemUnmap)(va, bytes as usize) });
}

fn release(s: &Session, h: u64) {
    // SAFETY: h is a handle reference this process holds.
    ck("cuMemRelease", unsafe { (s.cu.cuMemRelease)(h) });
}

fn reserve_va(s: &Session, bytes: u64) -> u64 {
    let mut va = 0u64;
    // SAFETY: a valid out-pointer.
    ck("cuMemAddressReserve", unsafe { (s.cu.cuMemAddressReserve)(&mut va, bytes as usize, 0, 0, 0) });
    va
}

#[test]
fn mapped_virtual_memory_stays_charged_until_released_and_unmapped() {
    let Some(s) = limited_session("mapped_virtual_memory_stays_charged_until_released_and_unmapped", GIB) else {
        return;
    };
    let (region, dev, base) = device0_base(&s);
    assert_eq!(base, OVERHEAD_MIB * MIB);
    let used = || region.used(dev) - base;
    let va = reserve_va(&s, 4 * GIB);

    // CUDA's memMap samples: create, map, release at once. The memory stays (mapped): so does the
    // charge, and the next chunk does not fit.
    let chunk = 512 * MIB;
    let h = create(&s, chunk).unwrap();
    map(&s, va, chunk, h);
    release(&s, h);
    assert_eq!(used(), chunk, "released but mapped: still charged");
    assert_eq!(gpu_used(0), base + chunk, "the GPU agrees");
    assert_eq!(create(&s, chunk), Err(OUT_OF_MEMORY), "300 + 2 x 512 MiB do not fit in 1 GiB");
    assert_eq!(s.alloc(chunk), Err(OUT_OF_MEMORY), "nor as linear memory");
    unmap(&s, va, chunk);
    assert_eq!(used(), 0, "unmapped and released: refunded");
    assert_eq!(gpu_used(0), base, "the GPU freed it");

    // One handle mapped twice: charged until the last mapping goes.
    let small = 128 * MIB;
    let h = create(&s, small).unwrap();
    map(&s, va, small, h);
    map(&s, va + GIB, small, h);
    release(&s, h);
    unmap(&s, va, small);
    assert_eq!(used(), small, "one mapping left");
    unmap(&s, va + GIB, small);
    assert_eq!(used(), 0);

    // cuMemRetainAllocationHandle hands out the same allocation again: one more release owed.
    let h = create(&s, small).unwrap();
    map(&s, va, small, h);
    let mut again = 0u64;
    // SAFETY: va is mapped; a valid out-pointer.
    ck("cuMemRetainAllocationHandle", unsafe { (s.cu.cuMemRetainAllocationHandle)(&mut again, va as *mut _) });
    assert_eq!(again, h);
    release(&s, h);
    unmap(&s, va, small);
    assert_eq!(used(), small, "the retained reference keeps it");
    release(&s, again);
    assert_eq!(used(), 0);

    // One unmap over several mappings, and freeing the range with a mapping still in it.
    let hs: Vec<u64> = (0..3).map(|_| create(&s, small).unwrap()).collect();
    for (i, &h) in hs.iter().enumerate() {
        map(&s, va + i as u64 * small, small, h);
        release(&s, h);
    }
    assert_eq!(used(), 3 * small);
    unmap(&s, va, 2 * small);
    assert_eq!(used(), small);
    // SAFETY: the whole range this process reserved.
    ck("cuMemAddressFree", unsafe { (s.cu.cuMemAddressFree)(va, (4 * GIB) as usize) });
    assert_eq!(used(), 0, "freeing the range dropped its last mapping");
    assert_eq!(gpu_used(0), base);
}

#[test]
fn a_killed_process_holding_mapped_virtual_memory_is_reaped() {
    let test = "a_killed_process_holding_mapped_virtual_memory_is_reaped";
    if in_child() {
        let s = Session::start(0);
        let va = reserve_va(&s, GIB);
        let h = create(&s, 512 * MIB).unwrap();
        map(&s, va, 512 * MIB, h);
        release(&s, h);
        return ready_then_wait();
    }
    let node = node();
    let c = Container::new(&memory_limits(GIB));
    let (child, _dir) = spawn_ready(test, container_env(&c, &node));
    assert_killed_holder_is_reaped(&c, &node, child, 512);
}

// ---- Contexts: a storm of processes starting at once -----------------------------------------

/// `n` workload processes of one container start at once, each making a context and holding it
/// for a while, under a limit that takes about 54 of them: the GPU (the simulated node's own
/// accounting, whose high-water mark every allocation updates under the node's lock) never held
/// more than the limit, not even for an instant.
fn storm(n: usize) {
    let node = node();
    let limit = 16 * GIB;
    let c = Container::new(&memory_limits(limit));
    let region = c.region();
    let model = Node::open(node.description.as_deref(), Some(&node.state)).unwrap();
    model.reset_high_water(0, 0).unwrap();
    let kids: Vec<_> = (0..n)
        .map(|_| {
            c.command(&node, binary("tessera-workload"))
                .args(["--alloc-mib", "0", "--hold", "3"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn")
        })
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for mut k in kids {
        if k.wait().unwrap().success() { ok += 1 } else { refused += 1 }
    }
    let peak = model.memory_high_water(0, 0).unwrap();
    let shim_peak = region.snapshot().devices[0].peak;
    println!(
        "{n} processes: {ok} got a context, {refused} refused; GPU high-water mark {} MiB, region peak {} MiB, limit {} MiB",
        peak / MIB,
        shim_peak / MIB,
        limit / MIB
    );
    assert!(peak <= limit, "the GPU held {} MiB under a limit of {} MiB", peak / MIB, limit / MIB);
    assert!(shim_peak <= limit);
    assert!(
        refused > 0 && ok >= limit / (DEFAULT_ESTIMATE_MIB * MIB),
        "the limit was reached: {ok} ok, {refused} refused"
    );
    region.reap();
    assert_eq!(region.used(0), 0);
}

/// The shim's reservation for a context before any was measured (`memory::context`).
const DEFAULT_ESTIMATE_MIB: u64 = 512;

#[test]
fn two_hundred_processes_starting_at_once_never_pass_the_limit_on_the_gpu() {
    storm(200);
}

#[test]
#[ignore = "1,000 processes: minutes on a 2-core machine; run with --ignored"]
fn a_thousand_processes_starting_at_once_never_pass_the_limit_on_the_gpu() {
    storm(1000);
}
