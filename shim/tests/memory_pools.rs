//! Stream-ordered allocations are charged as their memory pools hold them: freed memory a pool
//! keeps in reserve (up to its release threshold, which CuPy and PyTorch's async backend set to
//! the maximum) is still the GPU's memory for the process, so it stays charged, counts against
//! the limit and shows in `cuMemGetInfo`, until the driver releases it (a trim, a threshold, the
//! pool's destruction).

mod common;

use std::ffi::{c_int, c_void};

use common::cuda::*;
use common::*;

/// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
const RELEASE_THRESHOLD: c_int = 4;

/// Keep everything freed, as CuPy's async pool and PyTorch's `cudaMallocAsync` backend do.
///
/// # Safety
/// `pool` is a live pool handle.
unsafe fn keep_all(cu: &Cuda, pool: H) {
    let mut max = u64::MAX;
    // SAFETY: the attribute is a cuuint64_t; pool is live (contract).
    ck("cuMemPoolSetAttribute", unsafe {
        (cu.cuMemPoolSetAttribute)(pool, RELEASE_THRESHOLD, (&raw mut max).cast::<c_void>())
    });
}

#[test]
fn what_a_pool_keeps_stays_charged_until_the_driver_releases_it() {
    let Some(s) = limited_session("what_a_pool_keeps_stays_charged_until_the_driver_releases_it", 2 * GIB) else {
        return;
    };
    let cu = &s.cu;
    let (region, dev, base) = device0_base(&s);
    let used = || region.used(dev) - base;
    let gpu = || gpu_used(0) - base;
    let free = || s.mem_info().0;
    // SAFETY: in all driver calls below, out-pointers are valid and handles are the driver's.
    unsafe {
        let mut stream: H = std::ptr::null_mut();
        ck("cuStreamCreate", (cu.cuStreamCreate)(&mut stream, 0));
        let alloc = |bytes: u64| {
            let mut p = 0u64;
            match (cu.cuMemAllocAsync)(&mut p, bytes as usize, stream) {
                SUCCESS => Ok(p),
                rc => Err(rc),
            }
        };
        let free_async = |p: u64| ck("cuMemFreeAsync", (cu.cuMemFreeAsync)(p, stream));
        let sync = || ck("cuStreamSynchronize", (cu.cuStreamSynchronize)(stream));

        // The default threshold (0): a free gives the memory back.
        let a = alloc(GIB).unwrap();
        assert_eq!((used(), gpu()), (GIB, GIB));
        free_async(a);
        sync();
        assert_eq!((used(), gpu()), (0, 0));

        let mut pool: H = std::ptr::null_mut();
        ck("cuDeviceGetDefaultMemPool", (cu.cuDeviceGetDefaultMemPool)(&mut pool, 0));
        keep_all(cu, pool);
        let a = alloc(GIB).unwrap();
        free_async(a);
        sync();
        assert_eq!((used(), gpu()), (GIB, GIB), "the pool keeps what was freed, and it stays charged");
        assert_eq!(free(), 2 * GIB - base - GIB, "cuMemGetInfo shows it used");
        assert_eq!(s.alloc(GIB), Err(OUT_OF_MEMORY), "a second GiB beside the pool's would pass the limit");
        assert_eq!(gpu(), GIB, "and the driver never saw it");

        // Taken from the reserve again: nothing more is charged; past it, only the growth.
        let b = alloc(600 * MIB).unwrap();
        assert_eq!((used(), gpu()), (GIB, GIB));
        let c = alloc(600 * MIB).unwrap();
        assert_eq!((used(), gpu()), (1200 * MIB, 1200 * MIB), "424 MiB came from the reserve, 176 MiB are new");
        free_async(b);
        free_async(c);
        sync();
        assert_eq!(used(), 1200 * MIB);

        // Trimmed: the driver releases it, and the next refusal or query finds it gone.
        ck("cuMemPoolTrimTo", (cu.cuMemPoolTrimTo)(pool, 0));
        assert_eq!(gpu(), 0);
        let d = s.alloc(GIB + 512 * MIB).expect("what the trim released is not held against the limit");
        assert_eq!(used(), GIB + 512 * MIB);
        s.free(d);
        assert_eq!(free(), 2 * GIB - base);

        // A pool of its own, destroyed: its memory goes with it, and so does its charge, also when
        // an allocation outlived the pool's destruction.
        let mut own: H = std::ptr::null_mut();
        ck("cuMemPoolCreate", (cu.cuMemPoolCreate)(&mut own, &MemPoolProps::device(0)));
        keep_all(cu, own);

        // The default pool refilled and trimmed again: an allocation from another pool finds
        // what the trim released too (the refusal reads the other pools).
        free_async(alloc(GIB).unwrap());
        sync();
        assert_eq!(used(), GIB);
        ck("cuMemPoolTrimTo", (cu.cuMemPoolTrimTo)(pool, 0));
        let mut big = 0u64;
        let size = (GIB + 512 * MIB) as usize;
        ck("cuMemAllocFromPoolAsync", (cu.cuMemAllocFromPoolAsync)(&mut big, size, own, stream));
        assert_eq!((used(), gpu()), (GIB + 512 * MIB, GIB + 512 * MIB));
        free_async(big);
        sync();
        ck("cuMemPoolTrimTo", (cu.cuMemPoolTrimTo)(own, 0));
        let mut e = 0u64;
        ck("cuMemAllocFromPoolAsync", (cu.cuMemAllocFromPoolAsync)(&mut e, (256 * MIB) as usize, own, stream));
        let mut f = 0u64;
        ck("cuMemAllocFromPoolAsync", (cu.cuMemAllocFromPoolAsync)(&mut f, (128 * MIB) as usize, own, stream));
        free_async(e);
        sync();
        assert_eq!((used(), gpu()), (384 * MIB, 384 * MIB));
        ck("cuMemPoolDestroy", (cu.cuMemPoolDestroy)(own));
        // cuda.h: a pool destroyed with allocations out releases its resources once they are
        // freed, so its charge stays as it was until then (the sim releases the reserve at once).
        assert_eq!((used(), gpu()), (384 * MIB, 128 * MIB));
        s.free(f);
        assert_eq!((used(), gpu()), (0, 0), "its last allocation freed, the pool is forgotten");

        // Captured into a graph, an allocation takes nothing yet: one the pool could not grow
        // for is recorded, not refused; the graph's launch is what is held to the limit.
        let limit_left = 2 * GIB - base;
        ck("cuStreamBeginCapture", (cu.cuStreamBeginCapture_v2)(stream, 2));
        let captured = alloc(limit_left + 64 * MIB).expect("a captured allocation is recorded, not refused");
        free_async(captured);
        let mut graph: H = std::ptr::null_mut();
        ck("cuStreamEndCapture", (cu.cuStreamEndCapture)(stream, &mut graph));
        assert_eq!((used(), gpu()), (0, 0), "capturing took nothing");
        let mut exec: H = std::ptr::null_mut();
        ck("cuGraphInstantiate", (cu.cuGraphInstantiateWithFlags)(&mut exec, graph, 0));
        assert_eq!((cu.cuGraphLaunch)(exec, stream), OUT_OF_MEMORY, "its launch would pass the limit");
        assert_eq!((used(), gpu()), (0, 0));
        ck("cuGraphExecDestroy", (cu.cuGraphExecDestroy)(exec));

        ck("cuStreamDestroy", (cu.cuStreamDestroy_v2)(stream));
        ck("cuDevicePrimaryCtxRelease", (cu.cuDevicePrimaryCtxRelease_v2)(0));
    }
    assert_eq!(region.used(dev), 0);
}

/// A stream of one device may allocate from a pool of another: the memory is the pool's device's,
/// and so is the charge. Charged to the stream's device, a pool on device 1 filled from device 0's
/// streams took device 1 to 3 GiB under its 1 GiB limit (and over-charged device 0).
#[test]
fn a_pool_is_charged_on_its_own_device_whatever_stream_allocates_from_it() {
    let Some(s) = limited_session("a_pool_is_charged_on_its_own_device_whatever_stream_allocates_from_it", GIB) else {
        return;
    };
    let cu = &s.cu;
    let (region, d0) = region_and_dev(&s);
    let d1 = region.device(&s.uuid(1)).expect("device 1's entry");
    let b0 = settled(OVERHEAD_MIB * MIB, || region.used(d0));
    // SAFETY: in all driver calls below, out-pointers are valid and handles are the driver's.
    unsafe {
        let mut one: H = std::ptr::null_mut();
        ck("cuDevicePrimaryCtxRetain", (cu.cuDevicePrimaryCtxRetain)(&mut one, 1));
        let mut pool: H = std::ptr::null_mut();
        ck("cuMemPoolCreate", (cu.cuMemPoolCreate)(&mut pool, &MemPoolProps::device(1)));
        let b1 = region.used(d1);
        let mut stream: H = std::ptr::null_mut();
        ck("cuStreamCreate", (cu.cuStreamCreate)(&mut stream, 0));
        let from_pool = |bytes: u64| {
            let mut p = 0u64;
            match (cu.cuMemAllocFromPoolAsync)(&mut p, bytes as usize, pool, stream) {
                SUCCESS => Ok(p),
                rc => Err(rc),
            }
        };
        let a = from_pool(600 * MIB).expect("600 MiB of device 1's pool from device 0's stream");
        assert_eq!((region.used(d0) - b0, region.used(d1) - b1), (0, 600 * MIB), "charged where the pool is");
        assert_eq!(gpu_used(1) - b1, 600 * MIB);
        assert_eq!(from_pool(600 * MIB), Err(OUT_OF_MEMORY), "device 1's limit, whatever stream asks");
        assert_eq!(gpu_used(1) - b1, 600 * MIB, "the driver never saw it");
        // Device 0's own limit is untouched by device 1's pool.
        let own = s.alloc(GIB - OVERHEAD_MIB * MIB).expect("device 0 still has its whole limit");
        s.free(own);
        // The default pool of device 1, named explicitly (never made through cuMemPoolCreate):
        // found among the devices' own pools, charged there too.
        let mut default1: H = std::ptr::null_mut();
        ck("cuDeviceGetDefaultMemPool", (cu.cuDeviceGetDefaultMemPool)(&mut default1, 1));
        let mut p = 0u64;
        let rc = (cu.cuMemAllocFromPoolAsync)(&mut p, (600 * MIB) as usize, default1, stream);
        assert_eq!(rc, OUT_OF_MEMORY, "device 1's default pool is device 1's: 600 + 600 MiB > 1 GiB");
        ck("cuMemFreeAsync", (cu.cuMemFreeAsync)(a, stream));
        ck("cuStreamSynchronize", (cu.cuStreamSynchronize)(stream));
        ck("cuMemPoolTrimTo", (cu.cuMemPoolTrimTo)(pool, 0));
        let b = (cu.cuMemAllocFromPoolAsync)(&mut p, (600 * MIB) as usize, default1, stream);
        assert_eq!(b, SUCCESS, "the trim gave device 1's memory back");
        assert_eq!((region.used(d0) - b0, region.used(d1) - b1), (0, 600 * MIB));
    }
}
