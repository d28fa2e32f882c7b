//! Linear memory is charged as the driver holds it (`src/memory/granularity.rs`), so the books the
//! shim keeps are the figure tesserad reads from NVML: small allocations by the 2 MiB chunk they
//! lie in, larger ones in whole 2 MiB pages. A program allocating up to its limit is refused
//! before the GPU holds more than the limit, however small or oddly sized its buffers, and the
//! shim's books and the GPU's agree at every step.

mod common;

use common::cuda::*;
use common::*;

/// Room for the context and 724 MiB.
const LIMIT: u64 = GIB;

/// Allocates `bytes` until refused; the pointers.
fn fill(s: &Session, bytes: u64) -> Vec<u64> {
    let mut ptrs = Vec::new();
    loop {
        match s.alloc(bytes) {
            Ok(p) => ptrs.push(p),
            Err(rc) => {
                assert_eq!(rc, OUT_OF_MEMORY);
                return ptrs;
            }
        }
    }
}

#[test]
fn many_small_or_odd_allocations_stop_at_the_limit_on_the_gpu() {
    let test = "many_small_or_odd_allocations_stop_at_the_limit_on_the_gpu";
    let Some(s) = limited_session(test, LIMIT) else { return };
    let (region, dev, base) = device0_base(&s);
    let books = || (region.used(dev), gpu_used(0));

    // 5,000-byte buffers: a chunk per few hundred, charged once each.
    let small = fill(&s, 5000);
    let (used, gpu) = books();
    assert_eq!(used, gpu, "the shim's books are the driver's");
    assert!(gpu <= LIMIT && LIMIT - gpu < 2 * MIB, "up to the limit, not past it: {gpu} of {LIMIT}");
    assert!((small.len() as u64) * 5000 < gpu - base, "asked less than held: {} buffers", small.len());
    // The limit reached, a chunk with room is not used: a small allocation reserves a whole
    // chunk, as the driver may put it in a new one (at most one chunk early, never late).
    // All but one allocation of each chunk freed: each chunk keeps its charge.
    let mut seen = std::collections::HashSet::new();
    let (kept, rest): (Vec<u64>, Vec<u64>) = small.iter().partition(|&&p| seen.insert(p & !(2 * MIB - 1)));
    for p in rest {
        s.free(p);
    }
    assert_eq!(books(), (used, gpu), "chunks still in use stay charged: {} of them", kept.len());
    for p in kept {
        s.free(p);
    }
    assert_eq!(books(), (base, base), "all freed: every chunk back");

    // 2 MiB + 1: two pages each.
    let odd = fill(&s, 2 * MIB + 1);
    assert_eq!(odd.len() as u64, (LIMIT - base) / (4 * MIB));
    let (used, gpu) = books();
    assert_eq!((used, gpu), (base + odd.len() as u64 * 4 * MIB, used));
    for p in odd {
        s.free(p);
    }

    // Pitched rows: 100 rows of 1000 bytes (1024 pitched), carved from a chunk like the rest.
    let (mut p, mut pitch) = (0u64, 0usize);
    // SAFETY: valid out-pointers; the session's context is current.
    ck("cuMemAllocPitch_v2", unsafe { (s.cu.cuMemAllocPitch_v2)(&mut p, &mut pitch, 1000, 100, 4) });
    assert_eq!(books(), (base + 2 * MIB, base + 2 * MIB));
    s.free(p);
    assert_eq!(books(), (base, base));
}

/// A context destroyed with small allocations in it gives their chunks back.
#[test]
fn a_context_destroyed_gives_its_chunks_back() {
    let Some(s) = limited_session("a_context_destroyed_gives_its_chunks_back", LIMIT) else { return };
    let (region, dev, base) = device0_base(&s);
    let mut ctx: H = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the new context becomes current.
    ck("cuCtxCreate_v2", unsafe { (s.cu.cuCtxCreate_v2)(&mut ctx, 0, 0) });
    let with_ctx = region.used(dev);
    for _ in 0..300 {
        s.alloc(4096).expect("a small allocation");
    }
    assert_eq!(region.used(dev), with_ctx + 2 * MIB, "300 x 4 KiB: one chunk");
    assert_eq!(gpu_used(0), region.used(dev));
    // SAFETY: the context just made.
    ck("cuCtxDestroy_v2", unsafe { (s.cu.cuCtxDestroy_v2)(ctx) });
    assert_eq!((region.used(dev), gpu_used(0)), (base, base));
}
