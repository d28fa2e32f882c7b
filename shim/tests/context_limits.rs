//! Raising a context's stack, printf FIFO or malloc heap limit makes the driver set device memory
//! aside without a single allocation call (64 KiB of stack is 16.5 GiB on an H100). Under the shim
//! it is charged like an allocation: refused past the limit before the driver sees it, charged
//! exactly what the GPU sets aside, shown by `cuMemGetInfo`, and given back when lowered or with
//! its context.

mod common;

use std::ffi::c_int;

use common::cuda::*;
use common::*;

const STACK: c_int = 0;
const PRINTF_FIFO: c_int = 1;
const MALLOC_HEAP: c_int = 2;
const L2_FETCH_GRANULARITY: c_int = 5;
/// The test node's H100: 132 SMs of 2048 threads, each given the stack.
const RESIDENT: u64 = 132 * 2048;

fn set(s: &Session, limit: c_int, value: u64) -> R {
    // SAFETY: plain values; a context is current.
    unsafe { (s.cu.cuCtxSetLimit)(limit, value as usize) }
}

fn get(s: &Session, limit: c_int) -> u64 {
    let mut v = 0usize;
    // SAFETY: a valid out-pointer.
    ck("cuCtxGetLimit", unsafe { (s.cu.cuCtxGetLimit)(&mut v, limit) });
    v as u64
}

#[test]
fn raised_context_limits_hold_the_memory_limit() {
    let Some(s) = limited_session("raised_context_limits_hold_the_memory_limit", 8 * GIB) else { return };
    let (region, dev, base) = device0_base(&s);
    let used = || region.used(dev) - base;
    let gpu = || gpu_used(0) - base;

    // Past the limit: refused before the driver sees it.
    assert_eq!(set(&s, MALLOC_HEAP, 16 * GIB), OUT_OF_MEMORY, "a 16 GiB heap in an 8 GiB share");
    assert_eq!(set(&s, STACK, 64 << 10), OUT_OF_MEMORY, "64 KiB of stack: 16.5 GiB");
    assert_eq!((used(), gpu(), get(&s, MALLOC_HEAP), get(&s, STACK)), (0, 0, 8 * MIB, 1024));

    // What fits is charged exactly what the GPU sets aside: the heap from its set, which the
    // driver takes with the context's first module (as an H200 took nothing at the set).
    assert_eq!(set(&s, MALLOC_HEAP, 2 * GIB), SUCCESS);
    let heap = 2 * GIB - 8 * MIB;
    assert_eq!((used(), gpu()), (heap, 0));
    kernel(&s.cu, "tessera_test_spin_1us");
    assert_eq!((used(), gpu()), (heap, heap));
    assert_eq!(set(&s, STACK, 8 << 10), SUCCESS);
    let stack = 7 * 1024 * RESIDENT;
    assert_eq!((used(), gpu()), (heap + stack, heap + stack));
    // The virtual GPU shows it used, and allocations get exactly what is left.
    let (free, total) = s.mem_info();
    assert_eq!((free, total), (8 * GIB - base - heap - stack, 8 * GIB));
    // In whole 2 MiB pages, as the driver holds linear memory: less than a page is left, and
    // even 1 MiB would need a chunk of its own.
    let rest = s.alloc(free / (2 * MIB) * (2 * MIB)).expect("what is left");
    assert_eq!(s.alloc(MIB), Err(OUT_OF_MEMORY));
    assert_eq!(set(&s, PRINTF_FIFO, 2 * MIB), OUT_OF_MEMORY, "a bigger FIFO no longer fits either");
    s.free(rest);

    // Lowered: given back; raised again, charged from the context's first value, not the last.
    assert_eq!(set(&s, STACK, 512), SUCCESS);
    assert_eq!((used(), gpu()), (heap, heap));
    assert_eq!(set(&s, STACK, 2048), SUCCESS);
    assert_eq!((used(), gpu()), (heap + 1024 * RESIDENT, heap + 1024 * RESIDENT));
    assert_eq!(set(&s, PRINTF_FIFO, 33 * MIB), SUCCESS);
    let charged = heap + 1024 * RESIDENT + 32 * MIB;
    assert_eq!((used(), gpu()), (charged, charged));
    // A limit that holds no memory passes through untouched.
    assert_eq!(set(&s, L2_FETCH_GRANULARITY, 32), SUCCESS);
    assert_eq!((used(), get(&s, L2_FETCH_GRANULARITY)), (charged, 32));

    // Found as the CUDA runtime finds it (cuGetProcAddress), the same hook.
    let (mut p, mut status) = (std::ptr::null_mut(), -1);
    // SAFETY: a C string and valid out-pointers.
    ck("cuGetProcAddress", unsafe {
        (s.cu.cuGetProcAddress_v2)(c"cuCtxSetLimit".as_ptr(), &mut p, 12080, 0, &mut status)
    });
    // SAFETY: cuCtxSetLimit's signature (cuda.h).
    let by_lookup: unsafe extern "C" fn(c_int, usize) -> R = unsafe { std::mem::transmute(p) };
    // SAFETY: plain values; a context is current.
    assert_eq!(unsafe { by_lookup(MALLOC_HEAP, 16 << 30) }, OUT_OF_MEMORY);
    assert_eq!(used(), charged);

    // A context of its own: its limits go with it.
    let mut ctx: H = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the new context becomes current.
    ck("cuCtxCreate", unsafe { (s.cu.cuCtxCreate_v2)(&mut ctx, 0, 0) });
    let with_ctx = used();
    assert_eq!(set(&s, MALLOC_HEAP, GIB), SUCCESS);
    assert_eq!(used(), with_ctx + GIB - 8 * MIB);
    // SAFETY: the context just made.
    ck("cuCtxDestroy", unsafe { (s.cu.cuCtxDestroy_v2)(ctx) });
    assert_eq!((used(), gpu()), (charged, charged));

    // The primary context released for the last time: everything is back.
    // SAFETY: the reference Session::start took.
    ck("cuDevicePrimaryCtxRelease", unsafe { (s.cu.cuDevicePrimaryCtxRelease_v2)(0) });
    assert_eq!((region.used(dev), gpu_used(0)), (0, 0));
}

/// Threads of one process racing each other: half raise and lower the heap and the stack, half
/// allocate and free (plainly and stream-ordered) near the limit. The GPU's own high-water mark
/// never passes the limit, and once they are done the charge is exactly what the limits they left
/// set aside: nothing leaked, nothing lost.
#[test]
fn threads_raising_limits_while_others_allocate_never_pass_the_limit_on_the_gpu() {
    let test = "threads_raising_limits_while_others_allocate_never_pass_the_limit_on_the_gpu";
    let limit = 4 * GIB;
    let Some(s) = limited_session(test, limit) else { return };
    let (region, dev, base) = device0_base(&s);
    let state = std::env::var_os("TESSERA_SIM_STATE").expect("TESSERA_SIM_STATE");
    let model = tessera_sim_model::Node::open_state(std::path::Path::new(&state), None).expect("the node");
    model.reset_high_water(0, 0).expect("reset");
    let (refused, granted) = (std::sync::atomic::AtomicU64::new(0), std::sync::atomic::AtomicU64::new(0));
    // Rounds until the race has run near the limit (a refusal and a grant seen): on a loaded
    // machine one round's threads may run one after another and never meet the limit.
    for _round in 0..5 {
        std::thread::scope(|scope| {
            for t in 0..6u64 {
                let (s, refused, granted) = (&s, &refused, &granted);
                scope.spawn(move || {
                    // SAFETY: the primary context Session::start retained.
                    ck("cuCtxSetCurrent", unsafe { (s.cu.cuCtxSetCurrent)(s.ctx) });
                    let count = |rc: R| {
                        let n = if rc == SUCCESS { granted } else { refused };
                        n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    };
                    for i in 0..150u64 {
                        if t % 2 == 0 {
                            // A heap of 8 MiB to 2 GiB, a stack of 1 to 5 KiB (up to 1.03 GiB more).
                            count(set(s, MALLOC_HEAP, ((i * 7 + t) % 9).max(1) * 256 * MIB - 248 * MIB));
                            count(set(s, STACK, 1024 * (1 + (i + t) % 5)));
                        } else {
                            let bytes = ((i + t) % 7 + 1) * 128 * MIB;
                            match s.alloc(bytes) {
                                Ok(p) => {
                                    count(SUCCESS);
                                    s.free(p);
                                }
                                Err(rc) => count(rc),
                            }
                            let mut p = 0u64;
                            // SAFETY: a valid out-pointer; the legacy default stream.
                            let rc = unsafe { (s.cu.cuMemAllocAsync)(&mut p, bytes as usize, std::ptr::null_mut()) };
                            count(rc);
                            if rc == SUCCESS {
                                // SAFETY: the pointer just allocated, on the same stream.
                                ck("cuMemFreeAsync", unsafe { (s.cu.cuMemFreeAsync)(p, std::ptr::null_mut()) });
                            }
                        }
                    }
                });
            }
        });
        if refused.load(std::sync::atomic::Ordering::Relaxed) > 0
            && granted.load(std::sync::atomic::Ordering::Relaxed) > 0
        {
            break;
        }
    }
    let peak = model.memory_high_water(0, 0).expect("high water");
    let (refused, granted) = (refused.into_inner(), granted.into_inner());
    assert!(peak <= limit, "the GPU held {peak} under a {limit} limit");
    assert!(refused > 0 && granted > 0, "the race ran near the limit: {granted} granted, {refused} refused");
    // SAFETY: the stream-ordered frees above, on the legacy stream.
    ck("cuCtxSynchronize", unsafe { (s.cu.cuCtxSynchronize)() });
    // The driver takes the heap with the context's first module.
    kernel(&s.cu, "tessera_test_spin_1us");
    let left = (get(&s, MALLOC_HEAP) - 8 * MIB) + (get(&s, STACK) - 1024) * RESIDENT;
    let used = settled(base + left, || region.used(dev));
    assert_eq!((used, gpu_used(0)), (base + left, base + left), "what the limits left set aside, exactly");
}
