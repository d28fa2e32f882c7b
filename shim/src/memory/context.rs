//! Contexts' own device memory: reserved BEFORE the driver creates the context (an estimate),
//! then trued up to what the creation measured (the driver's figures before and after, less what
//! this process allocated meanwhile): the excess is refunded; a shortfall is reserved, and if it
//! does not fit the context is destroyed and the answer is `CUDA_ERROR_OUT_OF_MEMORY`. So the
//! container's total never passes its limit while contexts are being made, however many
//! processes start at once. Refunded when the context is destroyed, or the primary context
//! released for the last time. Destroying a context also frees the allocations made in it: their
//! charges go too.
//!
//! The estimate is what the last context measured in this container took on the device (the
//! region's `context_hint`, published by whoever measured it), [`DEFAULT_ESTIMATE`] before any
//! was, and never less than [`FLOOR`] nor more than [`CEILING`]: the hint is writable by the
//! container's processes, so a hostile writer can only make its own container's reservations
//! somewhat bigger or smaller for the moment before the true-up.
//!
//! The best reading is this process's own usage in NVML's process list (other processes
//! allocating meanwhile do not disturb it); where NVML does not list us under our pid (a PID
//! namespace), the device's free memory: by `cuMemGetInfo` in a context this process already has
//! on the device, else by NVML (the first context on a device has no context to ask in). Both
//! readings of a pair come from the same source. Without NVML and without an earlier context,
//! nothing can be measured and the estimate stays charged.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering::*;

use super::alloc::hook;
use super::{Charge, Kind};
use crate::ffi::*;
use crate::real::{self, RealCuda};
use crate::state::ShimState;
use tessera_region::TraceFunc;

const MIB: u64 = 1 << 20;
/// The least a context is reserved before it is made: about the smallest a current driver's
/// context takes on a data-center GPU (and the simulated node's default).
pub(crate) const FLOOR: u64 = 256 * MIB;
/// Reserved for a context before any was measured in the container: above what current drivers'
/// contexts take (a few hundred MiB), so the first ones err on the side of the limit.
pub(crate) const DEFAULT_ESTIMATE: u64 = 512 * MIB;
/// No hint above this is believed.
pub(crate) const CEILING: u64 = 2 << 30;

/// What to reserve for a new context on a region device, from the container's hint.
pub(crate) fn estimate(hint: u64) -> u64 {
    if hint == 0 { DEFAULT_ESTIMATE } else { hint.clamp(FLOOR, CEILING) }
}

/// How a device's memory is read around a context's creation.
#[derive(Clone, Copy)]
struct Probe {
    /// A context of ours already on the device: `cuMemGetInfo` inside it (pushed and popped).
    ctx: Option<CUcontext>,
    /// The device in NVML: its free memory, and this process's own usage in the process list.
    nvml: Option<NvmlDevice>,
}

/// One reading: the device's free memory, and what NVML says this process uses on it (the
/// best measure: other processes allocating meanwhile do not disturb it; `None` where NVML
/// does not list this process under its own pid, as in a PID namespace).
struct Reading {
    free: Option<u64>,
    own: Option<u64>,
}

impl Probe {
    fn for_device(s: &ShimState, ordinal: c_int, dev: usize) -> Probe {
        let ctx = s.mem.contexts.find(|c| c.dev == dev).map(|(k, _)| k as CUcontext);
        Probe { ctx, nvml: nvml_device(ordinal) }
    }

    fn read(self, cu: &RealCuda) -> Reading {
        let free = match (self.ctx, self.nvml) {
            (Some(ctx), _) => ctx_free(cu, ctx),
            (None, Some(h)) => nvml_free(h),
            (None, None) => None,
        };
        Reading { free, own: self.nvml.and_then(own_usage) }
    }
}

/// The NVML handle of a CUDA device (NVML initialized for our own use).
fn nvml_device(ordinal: c_int) -> Option<NvmlDevice> {
    let nvml = real::nvml_initialized()?;
    let cu = real::cuda()?;
    let mut u = uuid_zero();
    // SAFETY: u is a valid out-pointer.
    if unsafe { (cu.cuDeviceGetUuid)(&mut u, ordinal) } != CUDA_SUCCESS {
        return None;
    }
    for prefix in ["GPU-", "MIG-"] {
        let text = std::ffi::CString::new(uuid_text(prefix, &uuid_bytes(&u))).ok()?;
        let mut h: NvmlDevice = std::ptr::null_mut();
        // SAFETY: a valid C string and out-pointer.
        if unsafe { (nvml.nvmlDeviceGetHandleByUUID)(text.as_ptr(), &mut h) } == NVML_SUCCESS {
            return Some(h);
        }
    }
    None
}

/// Free bytes by `cuMemGetInfo` in `ctx`.
fn ctx_free(cu: &RealCuda, ctx: CUcontext) -> Option<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: ctx is a live context of ours (creation and destruction are serialized by the
    // lifecycle lock our caller holds); push/pop restore the thread's context stack.
    let rc = unsafe {
        if (cu.cuCtxPushCurrent_v2)(ctx) != CUDA_SUCCESS {
            return None;
        }
        let rc = (cu.cuMemGetInfo_v2)(&mut free, &mut total);
        let mut popped: CUcontext = std::ptr::null_mut();
        (cu.cuCtxPopCurrent_v2)(&mut popped);
        rc
    };
    (rc == CUDA_SUCCESS).then_some(free as u64)
}

/// Free bytes by NVML.
fn nvml_free(h: NvmlDevice) -> Option<u64> {
    let nvml = real::nvml()?;
    let mut m = NvmlMemory::default();
    // SAFETY: h is a device handle from NVML; m a valid out-pointer.
    (unsafe { (nvml.nvmlDeviceGetMemoryInfo)(h, &mut m) } == NVML_SUCCESS).then_some(m.free)
}

/// This process's usage of the device in NVML's process list (0 when not listed: no context
/// yet), or `None` if the list cannot be read.
fn own_usage(h: NvmlDevice) -> Option<u64> {
    let nvml = real::nvml()?;
    let pid = std::process::id();
    let mut cap: c_uint = 64;
    for _ in 0..6 {
        let mut list = vec![NvmlProcessInfoV1::default(); cap as usize];
        let mut n = cap;
        // SAFETY: list has room for n entries; n a valid in/out count.
        match unsafe { (nvml.nvmlDeviceGetComputeRunningProcesses)(h, &mut n, list.as_mut_ptr()) } {
            NVML_SUCCESS => {
                let mine = list[..n as usize].iter().filter(|p| p.pid == pid);
                return Some(mine.map(|p| p.used_gpu_memory).sum());
            }
            NVML_ERROR_INSUFFICIENT_SIZE => cap = n.max(cap * 2),
            _ => return None,
        }
    }
    None
}

/// Reserves a context's estimated overhead, creates it with `create` (which returns the driver's
/// result and, on success, the context), measures its overhead and trues the charge up to it.
/// Over the limit (before, or after when it took more than estimated), the answer is
/// `CUDA_ERROR_OUT_OF_MEMORY`; `undo` destroys a context made meanwhile. The caller holds the
/// lifecycle lock.
fn charge_creation(
    s: &ShimState,
    cu: &RealCuda,
    ordinal: c_int,
    create: impl FnOnce() -> (CUresult, Option<CUcontext>),
    undo: impl FnOnce(CUcontext),
    primary: bool,
) -> CUresult {
    let Some(dev) = s.device_of_ordinal(ordinal) else { return create().0 };
    let reserved = estimate(s.region.context_hint(dev));
    if !s.reserve(dev, reserved) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let probe = Probe::for_device(s, ordinal, dev);
    let before = probe.read(cu);
    let own_before = s.held(dev);
    let (rc, ctx) = create();
    let Some(ctx) = ctx.filter(|_| rc == CUDA_SUCCESS) else {
        s.refund(dev, reserved);
        return rc;
    };
    s.remember_context(ctx, ordinal);
    if primary && let Some(p) = s.mem.primaries.get(ordinal as usize) {
        p.store(ctx as u64, Release);
    }
    let after = probe.read(cu);
    // What this process allocated meanwhile (other threads) is not the context's.
    let meanwhile = s.held(dev).saturating_sub(own_before);
    let measured = match (before, after) {
        (Reading { own: Some(b), .. }, Reading { own: Some(a), .. }) if a > 0 => Some(a.saturating_sub(b)),
        (Reading { free: Some(b), .. }, Reading { free: Some(a), .. }) => Some(b.saturating_sub(a)),
        _ => None,
    }
    .map(|m| m.saturating_sub(meanwhile));
    // Unmeasurable: the estimate stays charged.
    let overhead = measured.unwrap_or(reserved);
    if overhead > reserved && !s.reserve(dev, overhead - reserved) {
        undo(ctx);
        s.forget_context(ctx);
        s.refund(dev, reserved);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if overhead < reserved {
        s.refund(dev, reserved - overhead);
    }
    if let Some(m) = measured.filter(|&m| m > 0) {
        s.region.set_context_hint(dev, m);
    }
    s.mem.contexts.insert(ctx as u64, Charge { dev, bytes: overhead, ctx: ctx as usize, kind: Kind::Context });
    rc
}

/// A context is gone: refund its overhead and everything allocated in it that died with it.
fn context_gone(s: &ShimState, ctx: usize, overhead_too: bool) {
    // Its streams died with it; their handles may come back for streams on another device.
    s.forget_all_streams();
    if overhead_too {
        if let Some(c) = s.mem.contexts.remove(ctx as u64) {
            s.refund(c.dev, c.bytes);
        }
        s.forget_context(ctx as CUcontext);
    }
    let dead = |c: &Charge| c.ctx == ctx && c.kind.dies_with_context();
    for (_, c) in s.mem.ptrs.drain_where(dead).into_iter().chain(s.mem.arrays.drain_where(dead)) {
        s.refund(c.dev, c.bytes);
    }
}

/// Whether a device's primary context is active.
fn primary_active(cu: &RealCuda, ordinal: c_int) -> bool {
    let (mut flags, mut active): (c_uint, c_int) = (0, 0);
    // SAFETY: valid out-pointers.
    let rc = unsafe { (cu.cuDevicePrimaryCtxGetState)(ordinal, &mut flags, &mut active) };
    rc == CUDA_SUCCESS && active != 0
}

// ---- Regular contexts ------------------------------------------------------------------------

fn create_regular(
    s: &ShimState,
    cu: &'static RealCuda,
    pctx: *mut CUcontext,
    ordinal: c_int,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let _g = s.mem.lifecycle();
    charge_creation(
        s,
        cu,
        ordinal,
        || {
            let rc = call();
            // SAFETY: on success the driver wrote the context through the caller's pctx.
            (rc, unsafe { get(pctx) })
        },
        |ctx| {
            // SAFETY: ctx is the context just created, not yet handed to the caller.
            unsafe { (cu.cuCtxDestroy_v2)(ctx) };
        },
        false,
    )
}

/// # Safety
/// As cuda.h's `cuCtxCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    hook(TraceFunc::cuCtxCreate_v2, |s, cu| {
        // SAFETY: the caller's arguments, passed on unchanged.
        create_regular(s, cu, pctx, dev, || unsafe { (cu.cuCtxCreate_v2)(pctx, flags, dev) })
    })
}

/// # Safety
/// As cuda.h's legacy `cuCtxCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    hook(TraceFunc::cuCtxCreate, |s, cu| {
        // SAFETY: the caller's arguments, passed on unchanged.
        create_regular(s, cu, pctx, dev, || unsafe { (cu.cuCtxCreate)(pctx, flags, dev) })
    })
}

/// # Safety
/// As cuda.h's `cuCtxCreate_v3` (execution-affinity parameters).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    paramsArray: *mut c_void,
    numParams: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    hook(TraceFunc::cuCtxCreate_v3, |s, cu| {
        let Some(f) = cu.cuCtxCreate_v3 else { return CUDA_ERROR_NOT_SUPPORTED };
        // SAFETY: the caller's arguments, passed on unchanged.
        create_regular(s, cu, pctx, dev, || unsafe { f(pctx, paramsArray, numParams, flags, dev) })
    })
}

/// # Safety
/// As cuda.h's `cuCtxCreate_v4` (creation parameters).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    ctxCreateParams: *mut c_void,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    hook(TraceFunc::cuCtxCreate_v4, |s, cu| {
        let Some(f) = cu.cuCtxCreate_v4 else { return CUDA_ERROR_NOT_SUPPORTED };
        // SAFETY: the caller's arguments, passed on unchanged.
        create_regular(s, cu, pctx, dev, || unsafe { f(pctx, ctxCreateParams, flags, dev) })
    })
}

fn destroy(s: &ShimState, cu: &RealCuda, ctx: CUcontext, call: impl FnOnce() -> CUresult) -> CUresult {
    let _g = s.mem.lifecycle();
    let rc = call();
    if rc == CUDA_SUCCESS && !ctx.is_null() {
        context_gone(s, ctx as usize, true);
        super::graph::settle_pools(s, cu);
    }
    rc
}

/// # Safety
/// As cuda.h's `cuCtxDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    // SAFETY: the caller's argument, passed on unchanged.
    hook(TraceFunc::cuCtxDestroy_v2, |s, cu| destroy(s, cu, ctx, || unsafe { (cu.cuCtxDestroy_v2)(ctx) }))
}

/// # Safety
/// As cuda.h's legacy `cuCtxDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy(ctx: CUcontext) -> CUresult {
    // SAFETY: the caller's argument, passed on unchanged.
    hook(TraceFunc::cuCtxDestroy, |s, cu| destroy(s, cu, ctx, || unsafe { (cu.cuCtxDestroy)(ctx) }))
}

// ---- Primary contexts ------------------------------------------------------------------------

/// # Safety
/// As cuda.h's `cuDevicePrimaryCtxRetain`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    hook(TraceFunc::cuDevicePrimaryCtxRetain, |s, cu| {
        let _g = s.mem.lifecycle();
        // SAFETY: the caller's arguments, passed on unchanged; then the driver's result.
        let call = || unsafe {
            let rc = (cu.cuDevicePrimaryCtxRetain)(pctx, dev);
            (rc, get(pctx))
        };
        let known = s.mem.primaries.get(dev as usize).map_or(0, |p| p.load(Acquire));
        if primary_active(cu, dev) && known != 0 && s.mem.contexts.get(known).is_some() {
            // Already alive and charged: one more reference costs nothing.
            return call().0;
        }
        let undo = |_ctx: CUcontext| {
            // SAFETY: drops the reference just taken, as the caller never saw it.
            unsafe { (cu.cuDevicePrimaryCtxRelease_v2)(dev) };
        };
        charge_creation(s, cu, dev, call, undo, true)
    })
}

/// After a release or reset of a device's primary context: refund what went with it.
fn primary_after(s: &ShimState, cu: &RealCuda, dev: CUdevice, allocations_gone: bool) {
    let ctx = s.mem.primaries.get(dev as usize).map_or(0, |p| p.load(Acquire)) as usize;
    if ctx == 0 {
        return;
    }
    let inactive = !primary_active(cu, dev);
    if inactive || allocations_gone {
        context_gone(s, ctx, inactive);
    }
}

fn release(s: &ShimState, cu: &RealCuda, dev: CUdevice, call: impl FnOnce() -> CUresult) -> CUresult {
    let _g = s.mem.lifecycle();
    let rc = call();
    if rc == CUDA_SUCCESS {
        primary_after(s, cu, dev, false);
    }
    rc
}

/// # Safety
/// As cuda.h's `cuDevicePrimaryCtxRelease_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    hook(TraceFunc::cuDevicePrimaryCtxRelease_v2, |s, cu| {
        // SAFETY: the caller's argument, passed on unchanged.
        release(s, cu, dev, || unsafe { (cu.cuDevicePrimaryCtxRelease_v2)(dev) })
    })
}

/// # Safety
/// As cuda.h's legacy `cuDevicePrimaryCtxRelease`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    hook(TraceFunc::cuDevicePrimaryCtxRelease, |s, cu| {
        // SAFETY: the caller's argument, passed on unchanged.
        release(s, cu, dev, || unsafe { (cu.cuDevicePrimaryCtxRelease)(dev) })
    })
}

fn reset(s: &ShimState, cu: &RealCuda, dev: CUdevice, call: impl FnOnce() -> CUresult) -> CUresult {
    let _g = s.mem.lifecycle();
    let rc = call();
    if rc == CUDA_SUCCESS {
        primary_after(s, cu, dev, true);
        super::graph::settle_pools(s, cu);
    }
    rc
}

/// # Safety
/// As cuda.h's `cuDevicePrimaryCtxReset_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    hook(TraceFunc::cuDevicePrimaryCtxReset_v2, |s, cu| {
        // SAFETY: the caller's argument, passed on unchanged.
        reset(s, cu, dev, || unsafe { (cu.cuDevicePrimaryCtxReset_v2)(dev) })
    })
}

/// # Safety
/// As cuda.h's legacy `cuDevicePrimaryCtxReset`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    // SAFETY: the caller's argument, passed on unchanged.
    hook(TraceFunc::cuDevicePrimaryCtxReset, |s, cu| reset(s, cu, dev, || unsafe { (cu.cuDevicePrimaryCtxReset)(dev) }))
}
