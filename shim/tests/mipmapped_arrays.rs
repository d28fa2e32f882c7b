//! Mipmapped arrays under the limit: charged the sum of their levels as the driver reports it,
//! refused past the limit before the driver allocates, refunded once when destroyed (not when a
//! level is), and with the context they were made in.

mod common;

use std::ffi::c_uint;

use common::cuda::*;
use common::*;

const INVALID_VALUE: R = 1;
const INVALID_HANDLE: R = 400;

fn create(s: &Session, d: &Array3dDesc, levels: c_uint) -> Result<H, R> {
    let mut h: H = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and descriptor.
    match unsafe { (s.cu.cuMipmappedArrayCreate)(&mut h, d, levels) } {
        SUCCESS => Ok(h),
        rc => Err(rc),
    }
}

fn destroy(s: &Session, h: H) -> R {
    // SAFETY: a handle (possibly stale: the driver says so).
    unsafe { (s.cu.cuMipmappedArrayDestroy)(h) }
}

/// 4096 x 4096 RGBA float, 13 levels: every level's bytes rounded up to 512, summed.
fn full_chain() -> (Array3dDesc, u64) {
    let d = Array3dDesc { width: 4096, height: 4096, depth: 0, format: 0x20, channels: 4, flags: 0 };
    (d, (0..13).map(|i| ((4096u64 >> i) * (4096 >> i) * 16).next_multiple_of(512)).sum())
}

#[test]
fn mipmapped_arrays_hold_the_limit() {
    let Some(s) = limited_session("mipmapped_arrays_hold_the_limit", GIB) else { return };
    let (region, dev, base) = device0_base(&s);
    let used = || region.used(dev) - base;
    let gpu = || gpu_used(0) - base;
    let (desc, bytes) = full_chain();
    assert!(bytes > 341 * MIB && bytes < 342 * MIB);

    let a = create(&s, &desc, 13).unwrap();
    assert_eq!((used(), gpu()), (bytes, bytes), "charged what the GPU took");
    let b = create(&s, &desc, 13).unwrap();
    assert_eq!(used(), 2 * bytes);
    assert_eq!(create(&s, &desc, 13), Err(OUT_OF_MEMORY), "300 MiB + 3 x 341 MiB do not fit in 1 GiB");
    assert_eq!((used(), gpu()), (2 * bytes, 2 * bytes), "the driver was not called");
    // Destroying a level is refused and refunds nothing.
    let mut level: H = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; a live mipmapped array.
    ck("cuMipmappedArrayGetLevel", unsafe { (s.cu.cuMipmappedArrayGetLevel)(&mut level, a, 0) });
    // SAFETY: a level array handle.
    assert_eq!(unsafe { (s.cu.cuArrayDestroy)(level) }, INVALID_VALUE);
    assert_eq!(used(), 2 * bytes);
    // A refused request charges nothing.
    assert_eq!(create(&s, &desc, 14), Err(INVALID_VALUE));
    assert_eq!(used(), 2 * bytes);
    // Destroyed once, refunded once.
    assert_eq!(destroy(&s, a), SUCCESS);
    assert_eq!(destroy(&s, a), INVALID_HANDLE);
    assert_eq!((used(), gpu()), (bytes, bytes));
    assert_eq!(destroy(&s, b), SUCCESS);
    assert_eq!((used(), gpu()), (0, 0));

    // Made in a context of its own, it goes with that context.
    let mut ctx: H = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    ck("cuCtxCreate", unsafe { (s.cu.cuCtxCreate_v2)(&mut ctx, 0, 0) });
    let with_ctx = used();
    create(&s, &desc, 13).unwrap();
    assert_eq!(used(), with_ctx + bytes);
    // SAFETY: the context just made.
    ck("cuCtxDestroy", unsafe { (s.cu.cuCtxDestroy_v2)(ctx) });
    assert_eq!((used(), gpu()), (0, 0));
    // SAFETY: back to the primary context.
    ck("cuCtxSetCurrent", unsafe { (s.cu.cuCtxSetCurrent)(s.ctx) });
    let p = s.alloc(GIB - base).expect("the whole limit is there again");
    s.free(p);
}
