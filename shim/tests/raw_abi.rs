//! Raw driver calls in a process started with the shim preloaded (this test binary run again):
//! every allocation family is charged and refunded, cuGetProcAddress hands out the hook of the
//! version asked for, launches pass through, a live limit change applies, threads and processes
//! racing never pass the limit, and NVML shows the container's GPU.

mod common;

use std::ffi::{CString, c_int, c_uint, c_void};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::cuda::*;
use common::*;
use tessera_region::{DeviceLimits, Limits, Region};
use tessera_sim_model::Node;
use tessera_sim_testkit::binary;

/// In a child: the model of the node, to see what the GPU really holds.
fn model() -> Node {
    let state = PathBuf::from(std::env::var_os("TESSERA_SIM_STATE").expect("TESSERA_SIM_STATE"));
    Node::open_state(&state, None).expect("open the node")
}

// ---- Allocation families ---------------------------------------------------------------------

#[test]
fn every_allocation_family_is_charged_and_refunded() {
    let Some(s) = limited_session("every_allocation_family_is_charged_and_refunded", 8 * GIB) else { return };
    let cu = &s.cu;
    let (region, dev, base) = device0_base(&s);
    assert_eq!(base, OVERHEAD_MIB * MIB, "the primary context's overhead is charged");
    let used = || region.used(dev) - base;
    let gpu = || model().memory_info(0, 0).unwrap().used;
    let mut stream: H = std::ptr::null_mut();
    // SAFETY: in all driver calls below, out-pointers are valid and handles are the driver's.
    unsafe {
        ck("cuStreamCreate", (cu.cuStreamCreate)(&mut stream, 0));

        let p = s.alloc(64 * MIB).unwrap();
        assert_eq!(used(), 64 * MIB, "cuMemAlloc_v2");
        s.free(p);
        assert_eq!(used(), 0);

        let mut p32: c_uint = 0;
        ck("cuMemAlloc", (cu.cuMemAlloc)(&mut p32, (16 * MIB) as c_uint));
        assert_eq!(used(), 16 * MIB, "legacy cuMemAlloc");
        ck("cuMemFree", (cu.cuMemFree)(p32));
        assert_eq!(used(), 0);

        let (mut p, mut pitch) = (0u64, 0usize);
        ck("cuMemAllocPitch_v2", (cu.cuMemAllocPitch_v2)(&mut p, &mut pitch, 1000, 100, 4));
        assert!(pitch >= 1000);
        assert_eq!(used(), 2 * MIB, "cuMemAllocPitch_v2: pitch x height (100 KiB), carved from a 2 MiB chunk");
        s.free(p);
        assert_eq!(used(), 0);

        ck("cuMemAllocManaged", (cu.cuMemAllocManaged)(&mut p, (32 * MIB) as usize, 1));
        assert_eq!(used(), 32 * MIB, "cuMemAllocManaged");
        s.free(p);
        assert_eq!(used(), 0);

        let prop = MemAllocProp::device(0);
        let mut h = 0u64;
        ck("cuMemCreate", (cu.cuMemCreate)(&mut h, (16 * MIB) as usize, &prop, 0));
        assert_eq!(used(), 16 * MIB, "cuMemCreate");
        ck("cuMemRelease", (cu.cuMemRelease)(h));
        assert_eq!(used(), 0);

        ck("cuMemAllocAsync", (cu.cuMemAllocAsync)(&mut p, (8 * MIB) as usize, stream));
        assert_eq!(used(), 8 * MIB, "cuMemAllocAsync");
        ck("cuMemFreeAsync", (cu.cuMemFreeAsync)(p, stream));
        assert_eq!(used(), 0);

        let mut pool: H = std::ptr::null_mut();
        ck("cuDeviceGetDefaultMemPool", (cu.cuDeviceGetDefaultMemPool)(&mut pool, 0));
        ck("cuMemAllocFromPoolAsync", (cu.cuMemAllocFromPoolAsync)(&mut p, (8 * MIB) as usize, pool, stream));
        assert_eq!(used(), 8 * MIB, "cuMemAllocFromPoolAsync");
        s.free(p);
        assert_eq!(used(), 0, "a stream-ordered allocation freed with cuMemFree");

        let mut arr: H = std::ptr::null_mut();
        let d = ArrayDesc { width: 1024, height: 1024, format: 0x20, channels: 1 };
        ck("cuArrayCreate_v2", (cu.cuArrayCreate_v2)(&mut arr, &d));
        assert_eq!(used(), 4 * MIB, "cuArrayCreate_v2: 1024 x 1024 floats");
        ck("cuArrayDestroy", (cu.cuArrayDestroy)(arr));
        assert_eq!(used(), 0);
        let d = Array3dDesc { width: 64, height: 64, depth: 64, format: 0x01, channels: 4, flags: 0 };
        ck("cuArray3DCreate_v2", (cu.cuArray3DCreate_v2)(&mut arr, &d));
        assert_eq!(used(), MIB, "cuArray3DCreate_v2: 64^3 uchar4");
        ck("cuArrayDestroy", (cu.cuArrayDestroy)(arr));
        assert_eq!(used(), 0);

        // A context of its own: its overhead, and what is allocated in it, go with it.
        let mut ctx: H = std::ptr::null_mut();
        ck("cuCtxCreate_v2", (cu.cuCtxCreate_v2)(&mut ctx, 0, 0));
        assert_eq!(used(), OVERHEAD_MIB * MIB, "cuCtxCreate_v2 charges the context");
        let _in_ctx = s.alloc(64 * MIB).unwrap();
        assert_eq!(used(), (OVERHEAD_MIB + 64) * MIB);
        ck("cuCtxDestroy_v2", (cu.cuCtxDestroy_v2)(ctx));
        assert_eq!(used(), 0, "destroying the context refunds it and its allocations");
        assert_eq!(gpu(), base, "the GPU agrees");
        ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(s.ctx));

        // Over the limit: CUDA_ERROR_OUT_OF_MEMORY, and the driver is never asked.
        let big = 9 * GIB as usize;
        let before = gpu();
        assert_eq!(s.alloc(big as u64), Err(OUT_OF_MEMORY), "cuMemAlloc_v2");
        assert_eq!((cu.cuMemAllocManaged)(&mut p, big, 1), OUT_OF_MEMORY, "cuMemAllocManaged");
        assert_eq!((cu.cuMemAllocPitch_v2)(&mut p, &mut pitch, 1 << 20, 9 << 10, 4), OUT_OF_MEMORY, "pitched");
        assert_eq!((cu.cuMemCreate)(&mut h, big, &prop, 0), OUT_OF_MEMORY, "cuMemCreate");
        assert_eq!((cu.cuMemAllocAsync)(&mut p, big, stream), OUT_OF_MEMORY, "cuMemAllocAsync");
        assert_eq!((cu.cuMemAllocFromPoolAsync)(&mut p, big, pool, stream), OUT_OF_MEMORY, "from a pool");
        let d = Array3dDesc { width: 2048, height: 2048, depth: 1024, format: 0x20, channels: 1, flags: 0 };
        assert_eq!((cu.cuArray3DCreate_v2)(&mut arr, &d), OUT_OF_MEMORY, "cuArray3DCreate_v2");
        assert_eq!(used(), 0, "nothing stays charged after a refusal");
        assert_eq!(gpu(), before, "the driver allocated nothing");
        ck("cuStreamDestroy", (cu.cuStreamDestroy_v2)(stream));
        ck("cuDevicePrimaryCtxRelease", (cu.cuDevicePrimaryCtxRelease_v2)(0));
    }
    assert_eq!(region.used(dev), 0, "releasing the primary context refunds its overhead");
}

// ---- Lookup paths ----------------------------------------------------------------------------

/// `cuGetProcAddress_v2(name, version, flags)`.
fn proc_address(cu: &Cuda, name: &str, version: c_int, flags: u64) -> *mut c_void {
    let n = CString::new(name).unwrap();
    let (mut p, mut status) = (std::ptr::null_mut(), -1);
    // SAFETY: a C string and valid out-pointers.
    ck(name, unsafe { (cu.cuGetProcAddress_v2)(n.as_ptr(), &mut p, version, flags, &mut status) });
    assert_eq!(status, 0, "{name}");
    p
}

#[test]
fn lookups_hand_out_the_hook_of_the_version_asked_for() {
    let Some(s) = limited_session("lookups_hand_out_the_hook_of_the_version_asked_for", GIB) else { return };
    let cu = &s.cu;
    let ours = |sym: &std::ffi::CStr| {
        let p = global(sym);
        assert_eq!(object_of(p), "libtessera.so", "{sym:?} is the shim's");
        p
    };
    // dlsym on the driver's handle: hooked names are ours, the rest the driver's.
    assert_eq!(cu.cuMemAlloc_v2 as *mut c_void, ours(c"cuMemAlloc_v2"));
    assert_eq!(cu.cuLaunchKernel as *mut c_void, ours(c"cuLaunchKernel"));
    let drivers = |p: *const c_void| ["libcuda.so.1", "libtessera_sim.so"].contains(&object_of(p).as_str());
    assert!(drivers(cu.cuStreamCreate as *const c_void), "not hooked: the driver's");
    // cuGetProcAddress: by version and default-stream flavour.
    assert_eq!(proc_address(cu, "cuMemAlloc", 12080, 0), ours(c"cuMemAlloc_v2"));
    assert_eq!(proc_address(cu, "cuMemAlloc", 3020, 0), ours(c"cuMemAlloc_v2"));
    assert_eq!(proc_address(cu, "cuMemAlloc", 2000, 0), ours(c"cuMemAlloc"), "the legacy 32-bit one");
    assert_eq!(proc_address(cu, "cuCtxCreate", 11040, 0), ours(c"cuCtxCreate_v3"));
    assert_eq!(proc_address(cu, "cuCtxCreate", 12080, 0), ours(c"cuCtxCreate_v4"));
    assert_eq!(proc_address(cu, "cuLaunchKernel", 12080, 0), ours(c"cuLaunchKernel"));
    assert_eq!(proc_address(cu, "cuLaunchKernel", 12080, 2), ours(c"cuLaunchKernel_ptsz"), "per-thread stream");
    assert_eq!(proc_address(cu, "cuMemAllocAsync", 12080, 2), ours(c"cuMemAllocAsync_ptsz"));
    assert_eq!(proc_address(cu, "cuGraphLaunch", 12080, 2), ours(c"cuGraphLaunch_ptsz"));
    assert_eq!(proc_address(cu, "cuGetProcAddress", 12080, 0), ours(c"cuGetProcAddress_v2"));
    // The per-thread flavour cuda.h links a --default-stream per-thread build to: ours too, and
    // what it hands out is ours (the driver's own handed out the driver's functions, every hook
    // gone).
    assert_eq!(proc_address(cu, "cuGetProcAddress", 12080, 2), ours(c"cuGetProcAddress_v2_ptsz"));
    type GetProc = unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> R;
    // SAFETY: the symbol has cuGetProcAddress_v2's signature (cuda.h).
    let ptsz: GetProc = unsafe { std::mem::transmute(global(c"cuGetProcAddress_v2_ptsz")) };
    let (mut p, mut status) = (std::ptr::null_mut(), -1);
    // SAFETY: a C string and valid out-pointers.
    ck("ptsz lookup", unsafe { ptsz(c"cuMemAlloc".as_ptr(), &mut p, 12080, 0, &mut status) });
    assert_eq!(p, ours(c"cuMemAlloc_v2"), "through the per-thread cuGetProcAddress: the hook");
    assert_eq!(proc_address(cu, "cuMemGetInfo", 12080, 0), ours(c"cuMemGetInfo_v2"));
    assert_eq!(proc_address(cu, "cuCtxSetLimit", 12080, 0), ours(c"cuCtxSetLimit"));
    let copy = proc_address(cu, "cuMemcpyHtoD", 12080, 0);
    assert!(drivers(copy), "what Tessera does not limit passes through");
    // A name the driver does not know is still not found.
    let n = CString::new("cuNoSuchFunction").unwrap();
    let (mut p, mut status) = (std::ptr::null_mut(), -1);
    // SAFETY: a C string and valid out-pointers.
    let rc = unsafe { (cu.cuGetProcAddress_v2)(n.as_ptr(), &mut p, 12080, 0, &mut status) };
    assert_ne!(rc, SUCCESS);
    assert!(p.is_null());
    // RTLD_NEXT still means "after the caller": from this executable, the next dlsym is the
    // shim's (it is preloaded after the executable), not libc's.
    // SAFETY: a C string; RTLD_NEXT is relative to this executable.
    let next = unsafe { libc::dlsym(libc::RTLD_NEXT, c"dlsym".as_ptr()) };
    assert_eq!(object_of(next), "libtessera.so", "RTLD_NEXT from the executable");
    // SAFETY: as above.
    let getpid = unsafe { libc::dlsym(libc::RTLD_NEXT, c"getpid".as_ptr()) };
    assert_eq!(object_of(getpid), "libc.so.6");
}

#[test]
fn every_launch_entry_point_reaches_the_driver() {
    let Some(s) = limited_session("every_launch_entry_point_reaches_the_driver", GIB) else { return };
    let cu = &s.cu;
    let f = kernel(cu, "tessera_test_spin_50us");
    // SAFETY: valid out-pointers; handles from the driver; no kernel parameters.
    unsafe {
        let mut stream: H = std::ptr::null_mut();
        ck("cuStreamCreate", (cu.cuStreamCreate)(&mut stream, 0));
        let none: *mut *mut c_void = std::ptr::null_mut();
        let null: H = std::ptr::null_mut();
        ck("cuLaunchKernel", (cu.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, stream, none, none));
        ck("cuLaunchKernel (null stream)", (cu.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, null, none, none));
        let config = LaunchConfig { grid: [1, 1, 1], block: [32, 1, 1], shared: 0, stream, attrs: null, num_attrs: 0 };
        ck("cuLaunchKernelEx", (cu.cuLaunchKernelEx)(&config, f, none, none));
        ck("cuLaunchCooperativeKernel", (cu.cuLaunchCooperativeKernel)(f, 1, 1, 1, 32, 1, 1, 0, stream, none));
        ck("cuStreamBeginCapture", (cu.cuStreamBeginCapture_v2)(stream, 0));
        ck("captured launch", (cu.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, stream, none, none));
        let mut graph: H = std::ptr::null_mut();
        ck("cuStreamEndCapture", (cu.cuStreamEndCapture)(stream, &mut graph));
        let mut exec: H = std::ptr::null_mut();
        ck("cuGraphInstantiate", (cu.cuGraphInstantiateWithFlags)(&mut exec, graph, 0));
        ck("cuGraphLaunch", (cu.cuGraphLaunch)(exec, stream));
        ck("cuStreamSynchronize", (cu.cuStreamSynchronize)(stream));
        // A bad launch is the driver's error, unchanged.
        assert_ne!((cu.cuLaunchKernel)(null, 1, 1, 1, 32, 1, 1, 0, stream, none, none), SUCCESS);
    }
}

/// Launches `f` on `stream` `n` times; each must succeed.
fn launch_n(cu: &Cuda, f: H, stream: H, n: usize) {
    let none: *mut *mut c_void = std::ptr::null_mut();
    for _ in 0..n {
        // SAFETY: f is a live function of the current context, stream one of its streams (or a
        // default stream); no parameters.
        ck("cuLaunchKernel", unsafe { (cu.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, stream, none, none) });
    }
}

/// This process's launches and measured GPU time on the region's entry for `uuid`.
fn my_launches(uuid: &str) -> (u64, u64) {
    let path = PathBuf::from(std::env::var_os("TESSERA_REGION").expect("TESSERA_REGION"));
    let r = Region::open_or_create(&path).expect("open region");
    let dev = r.device(uuid).expect("device entry");
    let snap = r.snapshot();
    let me = snap.processes.iter().find(|p| p.pid == std::process::id()).expect("this process's slot");
    me.devices.iter().find(|d| d.dev == dev).map_or((0, 0), |d| (d.launches, d.gpu_time_ns))
}

/// `CU_STREAM_PER_THREAD`: the per-thread default stream of the current context.
const PER_THREAD: usize = 2;
/// `CU_STREAM_LEGACY`.
const LEGACY: usize = 1;

/// Launches are counted on the device their stream runs on, whatever the stream kind and however
/// often the thread changes its current context: the default streams follow the current context
/// (a stale device for them would count, and limit, on the wrong GPU), explicit streams are
/// remembered per stream. Each kind is launched on more than once, so later launches take the
/// fast path (the stream's device cached).
#[test]
fn launches_count_on_the_device_their_stream_runs_on() {
    let Some(s) = limited_session("launches_count_on_the_device_their_stream_runs_on", 8 * GIB) else { return };
    let cu = &s.cu;
    let null: H = std::ptr::null_mut();
    let per_thread = PER_THREAD as H;
    let (mut ctx1, mut stream0, mut stream1): (H, H, H) = (null, null, null);
    let f0 = kernel(cu, "tessera_test_spin_1us");
    // SAFETY: valid out-pointers; contexts from the driver.
    unsafe {
        ck("cuStreamCreate", (cu.cuStreamCreate)(&mut stream0, 0));
        ck("cuDevicePrimaryCtxRetain", (cu.cuDevicePrimaryCtxRetain)(&mut ctx1, 1));
        ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx1));
    }
    let f1 = kernel(cu, "tessera_test_spin_1us");
    // SAFETY: as above.
    unsafe { ck("cuStreamCreate", (cu.cuStreamCreate)(&mut stream1, 0)) };
    launch_n(cu, f1, null, 3);
    launch_n(cu, f1, per_thread, 2);
    launch_n(cu, f1, stream1, 4);
    // SAFETY: a live context.
    unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(s.ctx)) };
    launch_n(cu, f0, null, 6);
    launch_n(cu, f0, per_thread, 2);
    launch_n(cu, f0, stream0, 7);
    // SAFETY: a live context.
    unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx1)) };
    launch_n(cu, f1, null, 1);
    launch_n(cu, f1, stream1, 1);
    assert_eq!(my_launches(&s.uuid(0)).0, 6 + 2 + 7, "device 0: its default streams and its stream");
    assert_eq!(my_launches(&s.uuid(1)).0, 3 + 2 + 4 + 2, "device 1: its default streams and its stream");
}

/// The shim keeps each thread's view of its current context (so a default-stream launch in a
/// process that sees two devices need not ask the driver) and forgets it on every call that can
/// change it: set, push, pop, a context created (it becomes current) and one destroyed. Counts stay
/// exact across all of them, on several threads at once; and once a device gets an SM share
/// live, its default-stream launches are measured again (the view is not used while any device
/// has one).
#[test]
fn default_stream_launches_follow_every_kind_of_context_switch() {
    let Some(s) = limited_session("default_stream_launches_follow_every_kind_of_context_switch", 8 * GIB) else {
        return;
    };
    let cu = &s.cu;
    let null: H = std::ptr::null_mut();
    let per_thread = PER_THREAD as H;
    let ctx0 = s.ctx;
    let mut ctx1: H = null;
    // SAFETY: valid out-pointer; a context from the driver.
    unsafe {
        ck("cuDevicePrimaryCtxRetain", (cu.cuDevicePrimaryCtxRetain)(&mut ctx1, 1));
        ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx1));
    }
    let f1 = kernel(cu, "tessera_test_spin_1us");
    // SAFETY: a live context.
    unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx0)) };
    let f0 = kernel(cu, "tessera_test_spin_1us");
    let (mut on0, mut on1) = (0u64, 0u64);
    // Past a check of the view (every 64 uses) on each side of every switch.
    let n = 70;
    for round in 0..3 {
        // SAFETY: contexts from the driver, live until destroyed; valid out-pointers.
        unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx1)) };
        launch_n(cu, f1, null, n);
        on1 += n as u64;
        // SAFETY: contexts from the driver, live until destroyed; valid out-pointers.
        unsafe { ck("cuCtxPushCurrent_v2", (cu.cuCtxPushCurrent_v2)(ctx0)) };
        launch_n(cu, f0, per_thread, n);
        on0 += n as u64;
        let mut popped = null;
        // SAFETY: contexts from the driver, live until destroyed; valid out-pointers.
        unsafe { ck("cuCtxPopCurrent_v2", (cu.cuCtxPopCurrent_v2)(&mut popped)) };
        assert_eq!(popped, ctx0);
        launch_n(cu, f1, null, n + round);
        on1 += (n + round) as u64;
        // A context of its own on device 0: current once made, gone when destroyed (the
        // previous one, ctx1, is current again).
        let mut own = null;
        // SAFETY: contexts from the driver, live until destroyed; valid out-pointers.
        unsafe { ck("cuCtxCreate_v2", (cu.cuCtxCreate_v2)(&mut own, 0, 0)) };
        let f_own = kernel(cu, "tessera_test_spin_1us");
        launch_n(cu, f_own, null, 5);
        on0 += 5;
        // SAFETY: contexts from the driver, live until destroyed; valid out-pointers.
        unsafe { ck("cuCtxDestroy_v2", (cu.cuCtxDestroy_v2)(own)) };
        launch_n(cu, f1, per_thread, 3);
        on1 += 3;
    }
    assert_eq!(my_launches(&s.uuid(0)).0, on0, "device 0");
    assert_eq!(my_launches(&s.uuid(1)).0, on1, "device 1");

    // Two threads, each on its own device, switching back and forth at once.
    let (cu_ptr, ctxs, fs) = (cu as *const Cuda as usize, [ctx0 as usize, ctx1 as usize], [f0 as usize, f1 as usize]);
    let threads: Vec<_> = (0..2usize)
        .map(|t| {
            std::thread::spawn(move || {
                // SAFETY: the Cuda table outlives the threads (joined below); contexts and
                // functions are live; each thread sets its own current context.
                let cu = unsafe { &*(cu_ptr as *const Cuda) };
                let (null, per_thread): (H, H) = (std::ptr::null_mut(), PER_THREAD as H);
                let mut counts = [0u64; 2];
                for i in 0..40 {
                    let d = (t + i) % 2;
                    // SAFETY: contexts from the driver, live until destroyed; valid out-pointers.
                    unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctxs[d] as H)) };
                    launch_n(cu, fs[d] as H, if i % 3 == 0 { per_thread } else { null }, 7 + i % 5);
                    counts[d] += (7 + i % 5) as u64;
                }
                counts
            })
        })
        .collect();
    for t in threads {
        let c = t.join().expect("launching thread");
        on0 += c[0];
        on1 += c[1];
    }
    assert_eq!(my_launches(&s.uuid(0)).0, on0, "device 0, after two threads");
    assert_eq!(my_launches(&s.uuid(1)).0, on1, "device 1, after two threads");

    // Device 1 gets an SM share live: its default-stream launches are measured from then on.
    let limits = Limits {
        devices: vec![
            DeviceLimits { uuid: s.uuid(0), memory_limit: Some(8 * GIB), sm_percent: None },
            DeviceLimits { uuid: s.uuid(1), memory_limit: Some(8 * GIB), sm_percent: Some(99) },
        ],
        ..Limits::default()
    };
    limits.write_atomic(&PathBuf::from(std::env::var_os("TESSERA_LIMITS").unwrap())).unwrap();
    let region = PathBuf::from(std::env::var_os("TESSERA_REGION").unwrap());
    Region::open_or_create(&region).unwrap().bump_config_generation();
    let f1_long = {
        // SAFETY: a live context.
        unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx1)) };
        kernel(cu, "tessera_test_spin_50us")
    };
    let (_, gpu_before) = my_launches(&s.uuid(1));
    launch_n(cu, f1_long, null, 20);
    // SAFETY: the current context.
    unsafe { ck("cuCtxSynchronize", (cu.cuCtxSynchronize)()) };
    launch_n(cu, f1_long, null, 1); // harvests the completed spans
    let (launches, gpu) = my_launches(&s.uuid(1));
    assert_eq!(launches, on1 + 21);
    // The share's limiter took them: their GPU time is in the region. Steady kernels are sampled
    // (issue 34: one measured launch stands for `w`, its time times `w`), so the figure is an
    // unbiased estimate, not the sum of 21 spans; the first launch on a device is always measured.
    assert!(gpu > gpu_before, "the share's launches are measured: {} ns", gpu - gpu_before);
}

type SetCurrent = unsafe extern "C" fn(H) -> R;

/// Device 1's primary context retained and kernel `f1` loaded in it, 10 launches on device 0's
/// default stream, then device 1's context made current by the driver's own `cuCtxSetCurrent`,
/// which the shim does not see. Returns device 1's kernel.
fn ten_launches_then_a_switch_behind_the_shim(s: &Session, f1: &str) -> H {
    let cu = &s.cu;
    let null: H = std::ptr::null_mut();
    // SAFETY: the driver's export of that name has this signature (cuda.h).
    let raw_set: SetCurrent = unsafe { std::mem::transmute(behind_the_shim("cuCtxSetCurrent")) };
    let mut ctx1: H = null;
    // SAFETY: valid out-pointer; contexts from the driver.
    unsafe {
        ck("cuDevicePrimaryCtxRetain", (cu.cuDevicePrimaryCtxRetain)(&mut ctx1, 1));
        ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx1));
    }
    let f1 = kernel(cu, f1);
    // SAFETY: a live context.
    unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(s.ctx)) };
    let f0 = kernel(cu, "tessera_test_spin_1us");
    launch_n(cu, f0, null, 10);
    // SAFETY: a live context, set by the driver itself: the shim does not see it.
    ck("cuCtxSetCurrent (behind the shim)", unsafe { raw_set(ctx1) });
    f1
}

/// Limits with an SM share (99%) on device 1 only; device 0 has a memory limit and no share.
fn share_on_device_1_only() -> Limits {
    Limits {
        devices: vec![
            DeviceLimits { uuid: "index:0".into(), memory_limit: Some(8 * GIB), sm_percent: None },
            DeviceLimits { uuid: "index:1".into(), memory_limit: Some(8 * GIB), sm_percent: Some(99) },
        ],
        ..Limits::default()
    }
}

/// A tenant that switches its current context behind the shim's back (the driver's own
/// `cuCtxSetCurrent`, found by reading the driver's file) while a device has an SM share: the
/// shim keeps no view of the current context then, so the launches land on the device they run
/// on and the share's limiter measures them; nothing is counted on the device it left.
#[test]
fn a_switch_behind_the_shims_back_never_skips_a_share() {
    const TEST: &str = "a_switch_behind_the_shims_back_never_skips_a_share";
    if !in_child() {
        return run_in_container(TEST, &share_on_device_1_only());
    }
    let s = Session::start(0);
    let cu = &s.cu;
    let null: H = std::ptr::null_mut();
    let f1 = ten_launches_then_a_switch_behind_the_shim(&s, "tessera_test_spin_50us");
    let (before, gpu_before) = my_launches(&s.uuid(1));
    launch_n(cu, f1, null, 20);
    // SAFETY: the current context.
    unsafe { ck("cuCtxSynchronize", (cu.cuCtxSynchronize)()) };
    launch_n(cu, f1, null, 1); // harvests the completed spans
    let (launches, gpu) = my_launches(&s.uuid(1));
    assert_eq!(launches - before, 21, "every launch counted on the device it ran on");
    // The share's limiter took them: their GPU time is in the region. Steady kernels are sampled
    // (issue 34: one measured launch stands for `w`, its time times `w`), so the figure is an
    // unbiased estimate, not the sum of 21 spans; the first launch on a device is always measured.
    assert!(gpu > gpu_before, "the share's launches are measured: {} ns", gpu - gpu_before);
    assert_eq!(my_launches(&s.uuid(0)).0, 10, "nothing counted on the device left behind");
}

/// The device a limited launch on a default stream is charged to is the one its current context
/// is on, as the context moves between a device with no share and one with a share through the
/// shim's hooks: the fast path finds the device (one `cuCtxGetCurrent`) and, where the device has
/// a share, hands it to the limiter rather than asking the driver again; that hand-over must
/// never carry the other device's.
#[test]
fn default_stream_launches_are_limited_on_the_current_device_as_it_moves() {
    const TEST: &str = "default_stream_launches_are_limited_on_the_current_device_as_it_moves";
    if !in_child() {
        return run_in_container(TEST, &share_on_device_1_only());
    }
    let s = Session::start(0);
    let cu = &s.cu;
    let null: H = std::ptr::null_mut();
    let mut ctx1: H = null;
    // SAFETY: valid out-pointer; contexts from the driver.
    unsafe {
        ck("cuDevicePrimaryCtxRetain", (cu.cuDevicePrimaryCtxRetain)(&mut ctx1, 1));
        ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx1));
    }
    let f1 = kernel(cu, "tessera_test_spin_50us");
    // SAFETY: a live context.
    unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(s.ctx)) };
    let f0 = kernel(cu, "tessera_test_spin_1us");
    let set = |ctx: H| {
        // SAFETY: a live context.
        unsafe { ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx)) };
    };
    let sync = || {
        // SAFETY: the current context.
        unsafe { ck("cuCtxSynchronize", (cu.cuCtxSynchronize)()) };
    };
    // The counts tell the device each launch was limited on (a launch is counted where the
    // limiter takes it): exact in every round. Whether a given launch is measured is the
    // sampler's random draw (one in up to 16 for these kernels; a span is settled at a later
    // measured launch), so device 1's GPU time is asserted over all 603 of its launches.
    for round in 1..=3u64 {
        set(s.ctx);
        launch_n(cu, f0, null, 7);
        launch_n(cu, f0, PER_THREAD as H, 3);
        set(ctx1);
        launch_n(cu, f1, null, 100);
        launch_n(cu, f1, LEGACY as H, 100);
        sync();
        launch_n(cu, f1, null, 1);
        let (on1, _) = my_launches(&s.uuid(1));
        assert_eq!(on1, 201 * round, "round {round}: every launch on device 1 counted there");
        let (on0, gpu0) = my_launches(&s.uuid(0));
        assert_eq!(on0, 10 * round, "round {round}: device 0's launches counted there, no others");
        assert_eq!(gpu0, 0, "round {round}: device 0 has no share: its launches are not measured");
    }
    assert!(my_launches(&s.uuid(1)).1 > 0, "device 1's share measured its launches");
}

/// The same switch behind the shim's back with no share anywhere, where the shim keeps each
/// thread's view of its current context: the stale view is caught at its next check (every 64
/// uses), so at most that many launches are counted on the device left behind; then views are
/// off for the process (said once on stderr) and every launch after is counted where it ran.
/// No launch is lost or counted twice.
#[test]
fn a_switch_behind_the_shims_back_is_caught_within_64_launches() {
    const TEST: &str = "a_switch_behind_the_shims_back_is_caught_within_64_launches";
    if !in_child() {
        let node = node();
        let c = Container::new(&memory_limits(8 * GIB));
        let stderr = wait_child(TEST, spawn_child(TEST, container_env(&c, &node)));
        let said = "changed its current CUDA context by a path libtessera.so does not see";
        assert_eq!(stderr.matches(said).count(), 1, "said once: {stderr}");
        return;
    }
    let s = Session::start(0);
    let cu = &s.cu;
    let null: H = std::ptr::null_mut();
    let f1 = ten_launches_then_a_switch_behind_the_shim(&s, "tessera_test_spin_1us");
    launch_n(cu, f1, null, 200);
    let (on0, on1) = (my_launches(&s.uuid(0)).0, my_launches(&s.uuid(1)).0);
    assert_eq!(on0 + on1, 210, "every launch counted once");
    assert!(on0 - 10 <= 64, "at most one view's uses on the device left behind: {on0}");
    launch_n(cu, f1, null, 100);
    assert_eq!(my_launches(&s.uuid(1)).0, on1 + 100, "views off: each launch asks the driver");
    assert_eq!(my_launches(&s.uuid(0)).0, on0);
}

/// A process that sees one device (`CUDA_VISIBLE_DEVICES`) takes its default streams' device
/// without asking the driver; that shortcut must neither move the count to another device nor
/// skip the device's SM share: with a share, launches are measured (GPU time), and once the
/// share is lifted live, they are only counted.
#[test]
fn a_one_device_process_keeps_its_share_on_the_default_streams() {
    const TEST: &str = "a_one_device_process_keeps_its_share_on_the_default_streams";
    if !in_child() {
        let node = node();
        let limits = Limits {
            devices: vec![DeviceLimits { uuid: "*".into(), memory_limit: None, sm_percent: Some(99) }],
            ..Limits::default()
        };
        let c = Container::new(&limits);
        let mut env = container_env(&c, &node);
        env.push(("CUDA_VISIBLE_DEVICES".into(), "1".into()));
        return drop(wait_child(TEST, spawn_child(TEST, env)));
    }
    let s = Session::start(0);
    let cu = &s.cu;
    let uuid = s.uuid(0);
    let path = PathBuf::from(std::env::var_os("TESSERA_REGION").expect("TESSERA_REGION"));
    let other = Region::open_or_create(&path).unwrap().device_uuid(0);
    assert_eq!(other.as_deref(), Some(uuid.as_str()), "ordinal 0 is the one visible GPU, the region's first");
    let f = kernel(cu, "tessera_test_spin_50us");
    let null: H = std::ptr::null_mut();
    launch_n(cu, f, null, 10);
    launch_n(cu, f, PER_THREAD as H, 10);
    // SAFETY: the current context.
    unsafe { ck("cuCtxSynchronize", (cu.cuCtxSynchronize)()) };
    launch_n(cu, f, null, 1); // harvests the completed spans
    let (launches, gpu) = my_launches(&uuid);
    assert_eq!(launches, 21);
    // Measured, as an unbiased estimate: steady kernels are sampled (issue 34), one measured
    // launch standing for `w`; the first launch on a device is always measured.
    assert!(gpu > 0, "the share's launches are measured: {gpu} ns of GPU time");
    // The share lifted live, as the daemon does: the next launches are counted, not measured.
    let lifted = memory_limits(8 * GIB);
    lifted.write_atomic(&PathBuf::from(std::env::var_os("TESSERA_LIMITS").unwrap())).unwrap();
    Region::open_or_create(&path).unwrap().bump_config_generation();
    // SAFETY: the current context.
    unsafe { ck("cuCtxSynchronize", (cu.cuCtxSynchronize)()) };
    launch_n(cu, f, null, 1); // the last measured span settles
    let (_, settled) = my_launches(&uuid);
    launch_n(cu, f, null, 5);
    launch_n(cu, f, PER_THREAD as H, 5);
    // SAFETY: the current context.
    unsafe { ck("cuCtxSynchronize", (cu.cuCtxSynchronize)()) };
    launch_n(cu, f, null, 1);
    assert_eq!(my_launches(&uuid), (33, settled), "counted, no longer measured");
}

// ---- Live limit changes ----------------------------------------------------------------------

#[test]
fn a_live_limit_change_applies_to_the_next_allocation() {
    if !in_child() {
        return run_in_container("a_live_limit_change_applies_to_the_next_allocation", &memory_limits(GIB));
    }
    let limits = PathBuf::from(std::env::var_os("TESSERA_LIMITS").unwrap());
    let change = |bytes: u64| {
        memory_limits(bytes).write_atomic(&limits).unwrap();
        let path = PathBuf::from(std::env::var_os("TESSERA_REGION").unwrap());
        Region::open_or_create(&path).unwrap().bump_config_generation();
    };
    let s = Session::start(0);
    let half = 512 * MIB;
    let _a = s.alloc(half).expect("300 + 512 MiB fit in 1 GiB");
    assert_eq!(s.alloc(half), Err(OUT_OF_MEMORY), "300 + 1024 MiB do not");
    assert_eq!(s.mem_info().1, GIB);

    change(2 * GIB);
    let _b = s.alloc(half).expect("the new limit applies at once");
    assert_eq!(s.mem_info(), (2 * GIB - (300 + 1024) * MIB, 2 * GIB));

    // Lowered below what is held: nothing is taken away, nothing more is given, and the
    // numbers stay sane.
    change(GIB);
    assert_eq!(s.alloc(MIB), Err(OUT_OF_MEMORY));
    assert_eq!(s.mem_info(), (0, GIB), "free is 0, not a wrapped-around number");
}

// ---- Racing threads and processes ------------------------------------------------------------

const RACERS: usize = 4;
const THREADS: usize = 4;
const STEP: u64 = 8 * MIB;

#[test]
fn threads_and_processes_racing_never_pass_the_limit() {
    let test = "threads_and_processes_racing_never_pass_the_limit";
    let Some(node) = parent_node(racer) else { return };
    let limit = 2 * GIB;
    let c = Container::new(&memory_limits(limit));
    let region = c.region();
    let dir = tempfile::tempdir().unwrap();
    let start_at = SystemTime::now().duration_since(UNIX_EPOCH).unwrap() + Duration::from_millis(1500);
    let mut env = container_env(&c, &node);
    env.push(("RACE_DIR".into(), dir.path().into()));
    env.push(("RACE_START_NS".into(), start_at.as_nanos().to_string().into()));
    let kids: Vec<_> = (0..RACERS).map(|_| spawn_child(test, env.clone())).collect();
    // Wait until every racer has allocated all it could.
    let deadline = Instant::now() + Duration::from_secs(30);
    let done = || {
        std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("done-"))
            .count()
    };
    while done() < RACERS {
        assert!(Instant::now() < deadline, "racers did not finish");
        std::thread::sleep(Duration::from_millis(20));
    }
    let held: u64 = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("done-"))
        .map(|p| std::fs::read_to_string(p).unwrap().trim().parse::<u64>().unwrap())
        .sum();
    let total = held + RACERS as u64 * OVERHEAD_MIB * MIB;
    assert!(total <= limit, "{total} of {limit}");
    assert!(total > limit - STEP, "they filled it: {total} of {limit}");
    assert_eq!(region.used(0), total);
    let model = Node::open_state(&node.state, None).unwrap();
    assert_eq!(model.memory_info(0, 0).unwrap().used, total, "the GPU holds what the region says");
    std::fs::write(dir.path().join("release"), "").unwrap();
    for k in kids {
        wait_child(test, k);
    }
    region.reap();
    assert_eq!(region.used(0), 0);
}

/// A racing process: a context, then at the agreed instant THREADS threads allocate STEP at a
/// time until refused; reports what it got and holds it until released.
fn racer() {
    let dir = PathBuf::from(std::env::var_os("RACE_DIR").unwrap());
    let start: u128 = std::env::var("RACE_START_NS").unwrap().parse().unwrap();
    let s = Session::start(0);
    let ctx = s.ctx as usize;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    std::thread::sleep(Duration::from_nanos(start.saturating_sub(now) as u64));
    let got: Vec<Vec<u64>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..THREADS)
            .map(|_| {
                sc.spawn(|| {
                    // SAFETY: the primary context is made current on this thread too.
                    ck("cuCtxSetCurrent", unsafe { (s.cu.cuCtxSetCurrent)(ctx as H) });
                    let mut mine = Vec::new();
                    loop {
                        match s.alloc(STEP) {
                            Ok(p) => mine.push(p),
                            Err(rc) => {
                                assert_eq!(rc, OUT_OF_MEMORY);
                                break mine;
                            }
                        }
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let n: usize = got.iter().map(Vec::len).sum();
    let pid = std::process::id();
    // Written aside and renamed: the parent counts `done-` files and reads each at once, and a
    // file it finds created but not yet written would read as empty.
    let tmp = dir.join(format!("writing-{pid}"));
    std::fs::write(&tmp, (n as u64 * STEP).to_string()).unwrap();
    std::fs::rename(&tmp, dir.join(format!("done-{pid}"))).unwrap();
    while !dir.join("release").exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
    for p in got.into_iter().flatten() {
        s.free(p);
    }
}

// ---- NVML ------------------------------------------------------------------------------------

#[test]
fn nvml_shows_the_containers_gpu() {
    let test = "nvml_shows_the_containers_gpu";
    let Some(node) = parent_node(nvml_child) else { return };
    // An outsider (another container, no limits) holds 2 GiB on GPU 0.
    let (mut outsider, _) = holding(node.command(binary("tessera-workload")), &["--alloc-mib", "2048", "--hold", "60"]);
    let uuid = Node::open_state(&node.state, None).unwrap().gpus()[0].uuid.clone();
    let limits = Limits {
        devices: vec![DeviceLimits { uuid: uuid.clone(), memory_limit: Some(4 * GIB), sm_percent: None }],
        ..Limits::default()
    };
    let c = Container::new(&limits);
    // One of the container's processes holds 1 GiB on GPU 0.
    let (mut inside, _) =
        holding(c.command(&node, binary("tessera-workload")), &["--alloc-mib", "1024", "--hold", "60"]);
    let mut env = container_env(&c, &node);
    env.push(("NVML_LIB".into(), node.nvml_path().into()));
    env.push(("INSIDE_PID".into(), inside.id().to_string().into()));
    wait_child(test, spawn_child(test, env));
    for k in [&mut outsider, &mut inside] {
        k.kill().unwrap();
        k.wait().unwrap();
    }
}

fn nvml_child() {
    use nvml_wrapper::Nvml;
    let lib = std::env::var_os("NVML_LIB").unwrap();
    let inside: u32 = std::env::var("INSIDE_PID").unwrap().parse().unwrap();
    let nvml = Nvml::builder().lib_path(&lib).init().expect("nvml init");
    let gpu0 = nvml.device_by_index(0).unwrap();
    let used = GIB + OVERHEAD_MIB * MIB;
    settled(used, || gpu0.memory_info().unwrap().used);
    let m = gpu0.memory_info().unwrap();
    assert_eq!(m.total, 4 * GIB, "v2: the limit");
    assert_eq!(m.used, used, "v2: the container's usage only (the outsider's 2 GiB is not ours)");
    assert_eq!(m.free, 4 * GIB - used);
    assert_eq!(m.reserved, 0);
    let procs = gpu0.running_compute_processes().unwrap();
    assert_eq!(procs.iter().map(|p| p.pid).collect::<Vec<_>>(), vec![inside], "only the container's processes");
    // GPU 1 has no limit: as the driver says.
    let gpu1 = nvml.device_by_index(1).unwrap();
    assert!(gpu1.memory_info().unwrap().total > 79 * GIB);

    // The v1 calls, raw: memory, and the list protocol (too small a buffer: the size needed).
    // SAFETY: loading the NVML library nvml-wrapper already loaded.
    let raw = unsafe { libloading::Library::new(&lib) }.unwrap();
    type MemV1 = unsafe extern "C" fn(*mut c_void, *mut [u64; 3]) -> c_uint;
    type ProcsV1 = unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut [u64; 2]) -> c_uint;
    // SAFETY: nvml.h's signatures; found through dlsym, so through the shim.
    let (mem_v1, procs_v1) = unsafe {
        (
            *raw.get::<MemV1>(b"nvmlDeviceGetMemoryInfo\0").unwrap(),
            *raw.get::<ProcsV1>(b"nvmlDeviceGetComputeRunningProcesses\0").unwrap(),
        )
    };
    // SAFETY: gpu0's handle; valid out-pointers.
    unsafe {
        let h = gpu0.handle().cast::<c_void>();
        let mut m = [0u64; 3];
        assert_eq!(mem_v1(h, &mut m), 0);
        assert_eq!(m, [4 * GIB, 4 * GIB - used, used], "v1: total, free, used");
        let mut n: c_uint = 0;
        assert_eq!(procs_v1(h, &mut n, std::ptr::null_mut()), 7, "INSUFFICIENT_SIZE");
        assert_eq!(n, 1);
        let mut list = [[0u64; 2]; 4];
        n = 4;
        assert_eq!(procs_v1(h, &mut n, list.as_mut_ptr()), 0);
        assert_eq!((n, list[0][0] as u32), (1, inside));
    }
}

// ---- fork --------------------------------------------------------------------------------

#[test]
fn a_forked_child_starts_over_and_leaves_the_parents_charges_alone() {
    if !in_child() {
        return run_in_container(
            "a_forked_child_starts_over_and_leaves_the_parents_charges_alone",
            &memory_limits(GIB),
        );
    }
    let s = Session::start(0);
    let (region, dev) = region_and_dev(&s);
    settled(OVERHEAD_MIB * MIB, || region.used(dev));
    let p = s.alloc(256 * MIB).unwrap();
    let before = region.used(dev);
    // SAFETY: fork in a process whose other threads hold no locks we need (the test harness
    // waits); the child only calls the driver through the shim and exits with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // As with a real driver, CUDA does not survive a fork: the call fails, cleanly.
        let code = match s.alloc(64 * MIB) {
            Err(rc) if rc != SUCCESS => 0,
            _ => 1,
        };
        // SAFETY: ends the forked child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: pid is our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
    region.reap();
    assert_eq!(region.used(dev), before, "the parent's charges are as they were");
    s.free(p);
    assert_eq!(region.used(dev), before - 256 * MIB);
}
