//! Device memory the driver sets aside for a context's limits (`cuCtxSetLimit`): the stack of
//! every thread the device can hold at once, the printf FIFO and the device-side `malloc` heap.
//! A program takes gigabytes this way without a single allocation call (a heap "as large as will
//! fit", a deep-recursion stack: 64 KiB of stack is 16.5 GiB on an H100), so raising one of them
//! is charged like an allocation: reserved before the driver is called (past the limit the answer
//! is `CUDA_ERROR_OUT_OF_MEMORY` and the driver never sees the call), trued up to the value the
//! driver settled on (it may round or clamp: `cuCtxGetLimit` says), refunded when lowered again or
//! when the context goes.
//!
//! What is charged is the growth past the value the limit had when the context first set it (its
//! default, which the context's own measured overhead already covers):
//! - stack: bytes per thread × SMs × threads per SM (local memory for every resident thread);
//! - printf FIFO and malloc heap: their bytes.
//!
//! A driver may take the heap and the FIFO only later: the heap when a module is loaded into the
//! context (NVIDIA's programming guide; an H200 took nothing when it was raised to 1 GiB,
//! docs/sim.md), the FIFO at the first launch of a kernel that uses it. Charging them when set
//! errs on the limit's side; the context's true-up does not count the heap as the driver's
//! ([`CtxLimits::heap_on`]). Not charged here: stack the driver grows by
//! itself at the launch of a kernel that needs more than is set (tesserad's reading of the
//! driver's per-process memory covers that, as it covers any memory taken around the shim).

use std::ffi::c_int;
use std::sync::{Mutex, MutexGuard};

use super::alloc::hook;
use crate::ffi::*;
use crate::real::RealCuda;
use tessera_abi::cuda_exports;
use tessera_region::TraceFunc;

/// `CUlimit` values whose memory is charged.
const STACK_SIZE: c_int = 0;
const PRINTF_FIFO_SIZE: c_int = 1;
const MALLOC_HEAP_SIZE: c_int = 2;
/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`, `CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR`.
const ATTR_SM_COUNT: c_int = 16;
const ATTR_THREADS_PER_SM: c_int = 39;

/// One context's charge for one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    ctx: usize,
    limit: c_int,
    /// Region device index.
    dev: usize,
    /// The limit's value before the context first changed it (what its overhead covers).
    baseline: u64,
    bytes: u64,
}

/// The live charges of contexts' limits (a few at most: a lock and a list are fine, and the
/// calls that change them are rare).
pub(crate) struct CtxLimits {
    held: Mutex<Vec<Held>>,
}

impl CtxLimits {
    pub(crate) fn new() -> CtxLimits {
        CtxLimits { held: Mutex::new(Vec::new()) }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, ctx: usize, limit: c_int) -> Option<Held> {
        self.lock().iter().find(|h| h.ctx == ctx && h.limit == limit).copied()
    }

    /// Records a charge, replacing the context's earlier one for the limit (kept at 0 bytes too:
    /// its baseline stays the context's first value, whatever it was set to since).
    fn set(&self, h: Held) {
        let mut held = self.lock();
        match held.iter_mut().find(|o| o.ctx == h.ctx && o.limit == h.limit) {
            Some(o) => *o = h,
            None => held.push(h),
        }
    }

    /// What contexts' limits hold on a region device.
    pub(crate) fn charged_on(&self, dev: usize) -> u64 {
        self.lock().iter().filter(|h| h.dev == dev).map(|h| h.bytes).sum()
    }

    /// What raised malloc heaps hold on a region device: charged, but perhaps not yet taken by
    /// the driver.
    pub(crate) fn heap_on(&self, dev: usize) -> u64 {
        self.lock().iter().filter(|h| h.dev == dev && h.limit == MALLOC_HEAP_SIZE).map(|h| h.bytes).sum()
    }

    /// A context is gone (destroyed, released for the last time, reset): its limits' charges,
    /// `(device, bytes)`, taken out for the caller to refund.
    pub(crate) fn take_context(&self, ctx: usize) -> Vec<(usize, u64)> {
        let mut out = Vec::new();
        self.lock().retain(|h| {
            if h.ctx == ctx {
                out.push((h.dev, h.bytes));
                false
            } else {
                true
            }
        });
        out
    }
}

/// The current context's value of `limit`.
fn get_limit(cu: &RealCuda, limit: c_int) -> Option<u64> {
    let mut v = 0usize;
    // SAFETY: a valid out-pointer.
    (unsafe { (cu.cuCtxGetLimit)(&mut v, limit) } == CUDA_SUCCESS).then_some(v as u64)
}

/// Device bytes one unit of `limit` holds: every resident thread's for the stack, one else.
fn bytes_per_unit(cu: &RealCuda, limit: c_int, ordinal: c_int) -> Option<u64> {
    if limit != STACK_SIZE {
        return Some(1);
    }
    let attr = |a: c_int| {
        let mut v: c_int = 0;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (cu.cuDeviceGetAttribute)(&mut v, a, ordinal) };
        (rc == CUDA_SUCCESS && v > 0).then_some(v as u64)
    };
    Some(attr(ATTR_SM_COUNT)? * attr(ATTR_THREADS_PER_SM)?)
}

/// Bytes charged for `value` of a limit whose context started from `baseline`.
fn cost(value: u64, baseline: u64, per_unit: u64) -> u64 {
    value.saturating_sub(baseline).saturating_mul(per_unit)
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuCtxSetLimit`.
    fn cuCtxSetLimit(limit, value) {
        hook(TraceFunc::cuCtxSetLimit, |s, cu| {
            // SAFETY: the caller's arguments, passed on unchanged.
            let call = |v: usize| unsafe { (cu.cuCtxSetLimit)(limit, v) };
            if !matches!(limit, STACK_SIZE | PRINTF_FIFO_SIZE | MALLOC_HEAP_SIZE) {
                return call(value);
            }
            let Some((ctx, ordinal)) = s.current_context() else { return call(value) };
            let Some(dev) = s.device_of_ordinal(ordinal) else { return call(value) };
            // Serialized with contexts' creation and destruction: a measurement under way must not
            // see this memory move, and a context destroyed meanwhile must not keep a charge.
            let _g = s.mem.lifecycle();
            // A context still waiting for its true-up is measured first: what is set aside here is
            // not its own overhead.
            super::context::settle(s, dev);
            let (Some(before), Some(per_unit)) = (get_limit(cu, limit), bytes_per_unit(cu, limit, ordinal)) else {
                return call(value);
            };
            let ctx = ctx as usize;
            let (baseline, held) = s.mem.limits.get(ctx, limit).map_or((before, 0), |h| (h.baseline, h.bytes));
            let extra = cost(value as u64, baseline, per_unit).saturating_sub(held);
            crate::trace::note(dev, extra);
            if !s.reserve(dev, extra) {
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            let rc = call(value);
            if rc != CUDA_SUCCESS {
                s.refund(dev, extra);
                return rc;
            }
            // The value the driver settled on (rounded or clamped) is what holds memory.
            let settled = cost(get_limit(cu, limit).unwrap_or(value as u64), baseline, per_unit);
            let charged = held + extra;
            if settled > charged && !s.reserve(dev, settled - charged) {
                // The driver rounded past what fits: back to where it was.
                call(before as usize);
                s.refund(dev, extra);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            s.refund(dev, charged.saturating_sub(settled));
            s.mem.limits.set(Held { ctx, limit, dev, baseline, bytes: settled });
            rc
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_past_the_baseline_is_charged_per_unit() {
        // An H100's 132 SMs x 2048 threads: 8 KiB of stack from the 1 KiB default.
        assert_eq!(cost(8 << 10, 1 << 10, 132 * 2048), 7 * 1024 * 132 * 2048);
        assert_eq!(cost(512, 1 << 10, 132 * 2048), 0, "below the baseline holds nothing more");
        assert_eq!(cost(u64::MAX, 0, 1 << 20), u64::MAX, "saturates, never wraps");
    }

    #[test]
    fn charges_are_kept_per_context_and_limit_and_taken_with_the_context() {
        let l = CtxLimits::new();
        let h = |ctx, limit, dev, bytes| Held { ctx, limit, dev, baseline: 1, bytes };
        l.set(h(1, STACK_SIZE, 0, 100));
        l.set(h(1, MALLOC_HEAP_SIZE, 0, 50));
        l.set(h(2, MALLOC_HEAP_SIZE, 1, 7));
        l.set(h(1, STACK_SIZE, 0, 30));
        assert_eq!((l.charged_on(0), l.charged_on(1)), (80, 7), "a new figure replaces the old");
        l.set(Held { baseline: 9, ..h(2, MALLOC_HEAP_SIZE, 1, 0) });
        assert_eq!(l.charged_on(1), 0);
        assert_eq!(l.get(2, MALLOC_HEAP_SIZE).map(|h| h.baseline), Some(9), "kept at 0 bytes");
        let mut gone = l.take_context(1);
        gone.sort_unstable();
        assert_eq!(gone, [(0, 30), (0, 50)]);
        assert_eq!(l.charged_on(0), 0);
    }
}
