//! `cuMemGetInfo` and `cuDeviceTotalMem` describe the virtual GPU: total = the limit (this
//! process's own copy of it, never the region's), free = the limit less what the whole container
//! holds (never more than the GPU really has free). Devices without a limit answer as the driver
//! does.

use std::ffi::c_uint;

use super::alloc::hook;
use crate::ffi::*;
use crate::state::ShimState;
use tessera_abi::cuda_exports;
use tessera_region::TraceFunc;

/// (free, total) as the container sees a device, from the driver's figures.
pub(crate) fn virtual_view(s: &ShimState, dev: usize, real_free: u64, real_total: u64) -> (u64, u64) {
    let Some(limit) = s.memory_limit(dev) else { return (real_free, real_total) };
    // A context's excess reservation, still waiting for its true-up, would count as used.
    super::context::settle(s, dev);
    // So would what a pool released at a synchronization since it was last read.
    super::pools::settle_all(s);
    // Dead processes' memory is reclaimed before it is reported.
    s.reap_for_query();
    let total = limit.min(real_total);
    // The region's total, never below what this process itself holds (the region is writable).
    let used = s.region.used(dev).max(s.held(dev));
    let free = total.saturating_sub(used).min(real_free);
    (free, total)
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMemGetInfo_v2`.
    fn cuMemGetInfo_v2(free, total) {
        hook(TraceFunc::cuMemGetInfo_v2, |s, cu| {
            // SAFETY: the caller's out-pointers, passed on unchanged.
            let rc = unsafe { (cu.cuMemGetInfo_v2)(free, total) };
            if rc != CUDA_SUCCESS {
                return rc;
            }
            // SAFETY: the driver filled both (it succeeded).
            let (Some(f), Some(t)) = (unsafe { get(free) }, unsafe { get(total) }) else { return rc };
            if let Some(dev) = s.current_device() {
                let (f, t) = virtual_view(s, dev, f as u64, t as u64);
                // SAFETY: the caller's out-pointers, valid (the driver just wrote them).
                unsafe {
                    put(free, f as usize);
                    put(total, t as usize);
                }
            }
            rc
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuMemGetInfo` (32-bit sizes).
    fn cuMemGetInfo(free, total) {
        hook(TraceFunc::cuMemGetInfo, |s, cu| {
            let (mut f, mut t) = (0usize, 0usize);
            // SAFETY: our own out-pointers; the 64-bit query, narrowed below as the legacy one does.
            let rc = unsafe { (cu.cuMemGetInfo_v2)(&mut f, &mut t) };
            if rc != CUDA_SUCCESS {
                // SAFETY: the caller's out-pointers, for the driver's own answer to the legacy call.
                return unsafe { (cu.cuMemGetInfo)(free, total) };
            }
            let (f, t) = match s.current_device() {
                Some(dev) => virtual_view(s, dev, f as u64, t as u64),
                None => (f as u64, t as u64),
            };
            if free.is_null() || total.is_null() {
                return CUDA_ERROR_INVALID_VALUE;
            }
            // SAFETY: the caller's out-pointers (checked non-null).
            unsafe {
                put(free, f.min(u64::from(u32::MAX)) as c_uint);
                put(total, t.min(u64::from(u32::MAX)) as c_uint);
            }
            rc
        })
    }
}

/// The limit-capped total of a device (by CUDA ordinal).
fn capped_total(s: &ShimState, ordinal: CUdevice, real_total: u64) -> u64 {
    match s.device_of_ordinal(ordinal).and_then(|d| s.memory_limit(d)) {
        Some(limit) => limit.min(real_total),
        None => real_total,
    }
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuDeviceTotalMem_v2`.
    fn cuDeviceTotalMem_v2(bytes, dev) {
        hook(TraceFunc::cuDeviceTotalMem_v2, |s, cu| {
            // SAFETY: the caller's arguments, passed on unchanged.
            let rc = unsafe { (cu.cuDeviceTotalMem_v2)(bytes, dev) };
            if rc == CUDA_SUCCESS
                // SAFETY: the driver filled it (it succeeded).
                && let Some(t) = unsafe { get(bytes) }
            {
                // SAFETY: the caller's out-pointer, just written by the driver.
                unsafe { put(bytes, capped_total(s, dev, t as u64) as usize) };
            }
            rc
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuDeviceTotalMem` (a 32-bit size).
    fn cuDeviceTotalMem(bytes, dev) {
        hook(TraceFunc::cuDeviceTotalMem, |s, cu| {
            let mut t = 0usize;
            // SAFETY: our own out-pointer.
            let rc = unsafe { (cu.cuDeviceTotalMem_v2)(&mut t, dev) };
            if rc != CUDA_SUCCESS {
                // SAFETY: the caller's arguments, for the driver's own answer.
                return unsafe { (cu.cuDeviceTotalMem)(bytes, dev) };
            }
            if bytes.is_null() {
                return CUDA_ERROR_INVALID_VALUE;
            }
            let t = capped_total(s, dev, t as u64);
            // SAFETY: the caller's out-pointer (checked non-null).
            unsafe { put(bytes, t.min(u64::from(u32::MAX)) as c_uint) };
            rc
        })
    }
}
