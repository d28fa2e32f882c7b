//! The allocation families: reserve in the region, call the driver, roll back if it fails,
//! remember the charge; frees refund it.

use std::ffi::c_uint;

use super::{Charge, Kind};
use crate::ffi::*;
use crate::real::RealCuda;
use crate::state::{ShimState, enter};
use tessera_abi::cuda_exports;
use tessera_region::TraceFunc;

/// Runs a CUDA hook's body with the state and the real driver (or returns the prologue's error).
/// While the daemon asks for a trace the call is recorded as an API span of `func`; otherwise the
/// cost of tracing is one relaxed load.
#[inline]
pub(crate) fn hook(func: TraceFunc, body: impl FnOnce(&'static ShimState, &'static RealCuda) -> CUresult) -> CUresult {
    guard(CUDA_ERROR_UNKNOWN, || match enter() {
        Ok((s, cu)) if s.region.trace_requested() => crate::trace::api(s, func, None, || body(s, cu)),
        Ok((s, cu)) => body(s, cu),
        Err(rc) => rc,
    })
}

/// What a function and its per-thread-default-stream twin (`_ptsz`) differ by, for the one called
/// (`ptsz`: the twin): its trace name, the driver's function, the stream its NULL stream means.
#[inline(always)]
pub(crate) fn flavour<T>(ptsz: bool, legacy: T, twin: T) -> T {
    if ptsz { twin } else { legacy }
}

/// A reservation on one device, in one context (0: none), for one allocation.
struct Reserved<'a> {
    s: &'a ShimState,
    dev: usize,
    ctx: usize,
}

/// Where a new allocation is charged: the current context's device.
fn in_current_context(s: &ShimState) -> Option<Reserved<'_>> {
    let (ctx, ordinal) = s.current_context()?;
    Some(Reserved { s, dev: s.device_of_ordinal(ordinal)?, ctx: ctx as usize })
}

/// Reserves `bytes`, calls the driver, and on success records the charge under the key `made`
/// reads back; on failure refunds. Over the limit: `CUDA_ERROR_OUT_OF_MEMORY`, driver not called.
fn charged(
    r: Reserved<'_>,
    bytes: u64,
    kind: Kind,
    map: &super::Sharded,
    call: impl FnOnce() -> CUresult,
    made: impl FnOnce() -> Option<u64>,
) -> CUresult {
    if bytes == 0 {
        return call();
    }
    crate::trace::note(r.dev, bytes);
    if !r.s.reserve(r.dev, bytes) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let rc = call();
    if rc != CUDA_SUCCESS {
        r.s.refund(r.dev, bytes);
        return rc;
    }
    match made() {
        Some(key) if key != 0 => map.insert(key, Charge { dev: r.dev, bytes, ctx: r.ctx, kind }),
        _ => r.s.refund(r.dev, bytes),
    }
    rc
}

/// Frees what `key` charged: the record goes before the driver call (so a concurrent
/// allocation that gets the same address cannot be forgotten by us), and comes back if the
/// driver refuses the free. Unknown keys pass through.
fn refunded(s: &ShimState, map: &super::Sharded, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let c = if key == 0 { None } else { map.remove(key) };
    refunded_taken(s, map, key, c, call)
}

/// [`refunded`] of a record `c` already taken from `map` (`None`: not ours, passed through).
fn refunded_taken(
    s: &ShimState,
    map: &super::Sharded,
    key: u64,
    c: Option<Charge>,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    if let Some(c) = &c {
        crate::trace::note(c.dev, c.bytes);
    }
    let rc = call();
    if let Some(c) = c {
        if rc == CUDA_SUCCESS {
            s.refund(c.dev, c.bytes);
        } else {
            map.insert(key, c);
        }
    }
    rc
}

/// Frees a device pointer (`cuMemFree*`, `cuMemFreeAsync*`): refunds what it charged; a graph
/// allocation it ends is no longer live (its memory stays in the graph pool, charged there); a
/// pool's allocation has its pool read again (what the pool keeps stays charged).
fn pointer_freed(s: &ShimState, dptr: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    // A pointer is in one book or the other: the sharded one first, so that freeing a large
    // allocation never takes the chunks' one lock.
    let large = if dptr == 0 { None } else { s.mem.ptrs.remove(dptr) };
    let small = if dptr == 0 || large.is_some() { None } else { s.mem.chunks.take(dptr) };
    let rc = match small {
        // Its chunk is refunded once the driver has freed it, and only if it was the last in it.
        Some(sm) => {
            crate::trace::note(sm.dev, sm.bytes);
            let rc = call();
            if rc == CUDA_SUCCESS {
                s.refund(sm.dev, s.mem.chunks.left(dptr, sm));
            } else {
                s.mem.chunks.put_back(dptr, sm);
            }
            rc
        }
        None => refunded_taken(s, &s.mem.ptrs, dptr, large, call),
    };
    if rc == CUDA_SUCCESS {
        super::graph::freed(s, dptr);
        super::pools::freed(s, dptr);
    }
    rc
}

// ---- Linear memory ---------------------------------------------------------------------------

/// Linear device memory (`cuMemAlloc*`, `cuMemAllocPitch*`), charged as the driver holds it
/// ([`super::granularity`]): what the driver may take for `estimate` bytes is reserved before it
/// is called; once `made` gives the pointer and the bytes it has, their charge is settled (more:
/// reserved then, or the allocation freed with `free` and refused; less: refunded).
fn device_linear(
    s: &ShimState,
    estimate: u64,
    call: impl FnOnce() -> CUresult,
    made: impl FnOnce() -> Option<(u64, u64)>,
    free: impl FnOnce(u64) -> CUresult,
) -> CUresult {
    use super::granularity::{Small, before_call, is_small, whole_pages};
    let Some(r) = in_current_context(s) else { return call() };
    if estimate == 0 {
        return call();
    }
    let Some(reserved) = before_call(estimate) else { return CUDA_ERROR_OUT_OF_MEMORY };
    crate::trace::note(r.dev, estimate);
    if !s.reserve(r.dev, reserved) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let rc = call();
    if rc != CUDA_SUCCESS {
        s.refund(r.dev, reserved);
        return rc;
    }
    let Some((ptr, bytes)) = made().filter(|&(p, _)| p != 0) else {
        s.refund(r.dev, reserved);
        return rc;
    };
    let small = Small { dev: r.dev, ctx: r.ctx, bytes };
    let cost = if is_small(bytes) { s.mem.chunks.landed(ptr, small) } else { whole_pages(bytes).unwrap_or(u64::MAX) };
    if cost > reserved && !s.reserve(r.dev, cost - reserved) {
        // Past the limit after all (a wider pitch; an allocation across two chunks): undone.
        let kept = if is_small(bytes) {
            let taken = s.mem.chunks.take(ptr);
            free(ptr);
            // What stays charged: chunks another allocation landed in meanwhile.
            taken.map_or(0, |t| cost - s.mem.chunks.left(ptr, t))
        } else {
            free(ptr);
            0
        };
        if kept > reserved {
            s.charge_unchecked(r.dev, kept - reserved);
        } else {
            s.refund(r.dev, reserved - kept);
        }
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if cost < reserved {
        s.refund(r.dev, reserved - cost);
    }
    if !is_small(bytes) {
        s.mem.ptrs.insert(ptr, Charge { dev: r.dev, bytes: cost, ctx: r.ctx, kind: Kind::Device });
    }
    rc
}

fn linear(
    s: &ShimState,
    bytes: u64,
    kind: Kind,
    call: impl FnOnce() -> CUresult,
    made: impl FnOnce() -> Option<u64>,
) -> CUresult {
    match in_current_context(s) {
        Some(r) => charged(r, bytes, kind, &s.mem.ptrs, call, made),
        None => call(),
    }
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMemAlloc_v2`.
    fn cuMemAlloc_v2(dptr, bytesize) {
        hook(TraceFunc::cuMemAlloc_v2, |s, cu| {
            device_linear(
                s,
                bytesize as u64,
                // SAFETY: the caller's arguments, passed on unchanged.
                || unsafe { (cu.cuMemAlloc_v2)(dptr, bytesize) },
                // SAFETY: the driver wrote the pointer through dptr (it succeeded).
                || unsafe { get(dptr) }.map(|p| (p, bytesize as u64)),
                // SAFETY: freeing the allocation just made.
                |p| unsafe { (cu.cuMemFree_v2)(p) },
            )
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuMemAlloc` (32-bit pointer and size).
    fn cuMemAlloc(dptr, bytesize) {
        hook(TraceFunc::cuMemAlloc, |s, cu| {
            device_linear(
                s,
                u64::from(bytesize),
                // SAFETY: the caller's arguments, passed on unchanged.
                || unsafe { (cu.cuMemAlloc)(dptr, bytesize) },
                // SAFETY: the driver wrote the pointer through dptr.
                || unsafe { get(dptr) }.map(|p| (u64::from(p), u64::from(bytesize))),
                // SAFETY: freeing the allocation just made (a 32-bit pointer).
                |p| unsafe { (cu.cuMemFree)(p as c_uint) },
            )
        })
    }

    /// # Safety
    /// As cuda.h's `cuMemAllocManaged`.
    fn cuMemAllocManaged(dptr, bytesize, flags) {
        hook(TraceFunc::cuMemAllocManaged, |s, cu| {
            linear(
                s,
                bytesize as u64,
                Kind::Managed,
                // SAFETY: the caller's arguments, passed on unchanged.
                || unsafe { (cu.cuMemAllocManaged)(dptr, bytesize, flags) },
                // SAFETY: the driver wrote the pointer through dptr.
                || unsafe { get(dptr) },
            )
        })
    }

    /// # Safety
    /// As cuda.h's `cuMemFree_v2`.
    fn cuMemFree_v2(dptr) {
        // SAFETY: the caller's argument, passed on unchanged.
        hook(TraceFunc::cuMemFree_v2, |s, cu| pointer_freed(s, dptr, || unsafe { (cu.cuMemFree_v2)(dptr) }))
    }

    /// # Safety
    /// As cuda.h's legacy `cuMemFree`.
    fn cuMemFree(dptr) {
        // SAFETY: the caller's argument, passed on unchanged.
        hook(TraceFunc::cuMemFree, |s, cu| pointer_freed(s, u64::from(dptr), || unsafe { (cu.cuMemFree)(dptr) }))
    }
}

// ---- Pitched memory --------------------------------------------------------------------------

/// The row alignment reserved for before the call: the texture alignment of every GPU since
/// Fermi. The driver's actual pitch is charged after the call ([`device_linear`]).
const PITCH_ALIGN: u64 = 512;

fn pitched(
    s: &ShimState,
    width: u64,
    height: u64,
    call: impl FnOnce() -> CUresult,
    made: impl FnOnce() -> Option<(u64, u64)>,
    free: impl FnOnce(u64) -> CUresult,
) -> CUresult {
    if width == 0 || height == 0 || in_current_context(s).is_none() {
        return call();
    }
    let Some(estimate) = width.checked_next_multiple_of(PITCH_ALIGN).and_then(|w| w.checked_mul(height)) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let made = || made().map(|(ptr, pitch)| (ptr, pitch.saturating_mul(height)));
    device_linear(s, estimate, call, made, free)
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMemAllocPitch_v2`.
    fn cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) {
        hook(TraceFunc::cuMemAllocPitch_v2, |s, cu| {
            pitched(
                s,
                WidthInBytes as u64,
                Height as u64,
                // SAFETY: the caller's arguments, passed on unchanged.
                || unsafe { (cu.cuMemAllocPitch_v2)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) },
                // SAFETY: the driver wrote both through the caller's out-pointers.
                || unsafe { Some((get(dptr)?, get(pPitch)? as u64)) },
                // SAFETY: freeing the allocation just made.
                |p| unsafe { (cu.cuMemFree_v2)(p) },
            )
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuMemAllocPitch`.
    fn cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) {
        hook(TraceFunc::cuMemAllocPitch, |s, cu| {
            pitched(
                s,
                u64::from(WidthInBytes),
                u64::from(Height),
                // SAFETY: the caller's arguments, passed on unchanged.
                || unsafe { (cu.cuMemAllocPitch)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) },
                // SAFETY: the driver wrote both through the caller's out-pointers.
                || unsafe { Some((u64::from(get(dptr)?), u64::from(get(pPitch)?))) },
                // SAFETY: freeing the allocation just made (a 32-bit pointer).
                |p| unsafe { (cu.cuMemFree)(p as c_uint) },
            )
        })
    }
}

// ---- Stream-ordered allocation ---------------------------------------------------------------

/// A stream-ordered allocation on `stream` (as the call means it: [`per_thread`]) is charged to
/// its pool's device (a stream of any device may allocate from a pool; the current pool of the
/// stream's device is that device's) as the pool grows ([`super::pools`]); where the pool's size
/// cannot be read, by itself, until its free. A pool of host memory is not charged. It is not
/// freed with a context.
fn stream_ordered(
    s: &ShimState,
    cu: &RealCuda,
    (stream, pool): (CUstream, Option<CUmemoryPool>),
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    made: impl FnOnce() -> Option<u64> + Copy,
) -> CUresult {
    let dev = match pool.and_then(|p| super::pools::home(cu, &s.mem.pools, p as u64)) {
        Some(super::pools::Home::Host) => return call(),
        Some(super::pools::Home::Device(ordinal)) => s.device_of_ordinal(ordinal),
        None => s.device_of_stream(stream.cast()),
    };
    let Some(dev) = dev else { return call() };
    let mut call = Some(call);
    let mut once = || call.take().map_or(CUDA_ERROR_UNKNOWN, |c| c());
    if let Some(rc) = super::pools::allocate(s, cu, (dev, stream, pool), bytes, &mut once, made) {
        return rc;
    }
    charged(Reserved { s, dev, ctx: 0 }, bytes, Kind::Async, &s.mem.ptrs, once, made)
}

/// The driver predates the function.
const NOT_SUPPORTED: CUresult = CUDA_ERROR_NOT_SUPPORTED;

type AllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;

/// The stream a `_ptsz` function's NULL stream means: this thread's per-thread default stream.
fn per_thread(stream: CUstream) -> CUstream {
    if stream.is_null() { CU_STREAM_PER_THREAD as CUstream } else { stream }
}

/// `cuMemAllocAsync` and its `_ptsz` twin (`f`, the driver's; `meant`, the stream as the call
/// means it): from the current pool of the stream's device.
fn from_current_pool(
    s: &ShimState,
    cu: &RealCuda,
    f: Option<AllocAsync>,
    (dptr, bytesize, stream, meant): (*mut CUdeviceptr, usize, CUstream, CUstream),
) -> CUresult {
    let Some(f) = f else { return NOT_SUPPORTED };
    // SAFETY: the caller's arguments, passed on unchanged; then the driver's result.
    stream_ordered(
        s,
        cu,
        (meant, None),
        bytesize as u64,
        || unsafe { f(dptr, bytesize, stream) },
        || unsafe { get(dptr) },
    )
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMemAllocAsync`, and `cuMemAllocAsync_ptsz` (NULL: the per-thread stream).
    fn cuMemAllocAsync(dptr, bytesize, hStream) twin cuMemAllocAsync_ptsz(ptsz) {
        hook(flavour(ptsz, TraceFunc::cuMemAllocAsync, TraceFunc::cuMemAllocAsync_ptsz), |s, cu| {
            let f = flavour(ptsz, cu.cuMemAllocAsync, cu.cuMemAllocAsync_ptsz);
            from_current_pool(s, cu, f, (dptr, bytesize, hStream, flavour(ptsz, hStream, per_thread(hStream))))
        })
    }

    /// # Safety
    /// As cuda.h's `cuMemAllocFromPoolAsync`, and `cuMemAllocFromPoolAsync_ptsz` (NULL: the
    /// per-thread stream).
    fn cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream) twin cuMemAllocFromPoolAsync_ptsz(ptsz) {
        hook(flavour(ptsz, TraceFunc::cuMemAllocFromPoolAsync, TraceFunc::cuMemAllocFromPoolAsync_ptsz), |s, cu| {
            let f = flavour(ptsz, cu.cuMemAllocFromPoolAsync, cu.cuMemAllocFromPoolAsync_ptsz);
            let Some(f) = f else { return NOT_SUPPORTED };
            stream_ordered(
                s,
                cu,
                (flavour(ptsz, hStream, per_thread(hStream)), Some(pool)),
                bytesize as u64,
                // SAFETY: the caller's arguments, passed on unchanged.
                || unsafe { f(dptr, bytesize, pool, hStream) },
                // SAFETY: the driver wrote the pointer through dptr.
                || unsafe { get(dptr) },
            )
        })
    }

    /// # Safety
    /// As cuda.h's `cuMemFreeAsync`, and `cuMemFreeAsync_ptsz`.
    fn cuMemFreeAsync(dptr, hStream) twin cuMemFreeAsync_ptsz(ptsz) {
        hook(flavour(ptsz, TraceFunc::cuMemFreeAsync, TraceFunc::cuMemFreeAsync_ptsz), |s, cu| {
            let Some(f) = flavour(ptsz, cu.cuMemFreeAsync, cu.cuMemFreeAsync_ptsz) else { return NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            pointer_freed(s, dptr, || unsafe { f(dptr, hStream) })
        })
    }
}

// ---- Arrays ----------------------------------------------------------------------------------

/// Bytes per channel of a `CUarray_format`; formats not listed are charged 4 per channel (no
/// real format needs more per channel).
fn format_bytes(format: c_uint) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        _ => 4,
    }
}

/// Bytes of an array: width × height × depth (each at least 1) × channel bytes × channels.
fn array_bytes(width: u64, height: u64, depth: u64, format: c_uint, channels: c_uint) -> Option<u64> {
    width
        .checked_mul(height.max(1))?
        .checked_mul(depth.max(1))?
        .checked_mul(format_bytes(format))?
        .checked_mul(u64::from(channels.max(1)))
}

fn array(s: &ShimState, bytes: Option<u64>, handle: *mut CUarray, call: impl FnOnce() -> CUresult) -> CUresult {
    let Some(r) = in_current_context(s) else { return call() };
    let Some(bytes) = bytes else { return call() };
    // SAFETY: the driver wrote the handle through the caller's out-pointer (it succeeded).
    let made = || unsafe { get(handle) }.map(|h| h as u64);
    charged(r, bytes, Kind::Array, &s.mem.arrays, call, made)
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuArrayCreate_v2`.
    fn cuArrayCreate_v2(pHandle, pAllocateArray) {
        hook(TraceFunc::cuArrayCreate_v2, |s, cu| {
            // SAFETY: null or the caller's descriptor, read through our mirror of its layout
            // (its format a raw integer).
            let bytes = unsafe { get(pAllocateArray.cast::<ArrayDesc>()) }
                .and_then(|d| array_bytes(d.width as u64, d.height as u64, 0, d.format, d.channels));
            // SAFETY: the caller's arguments, passed on unchanged.
            array(s, bytes, pHandle, || unsafe { (cu.cuArrayCreate_v2)(pHandle, pAllocateArray) })
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuArrayCreate`.
    fn cuArrayCreate(pHandle, pAllocateArray) {
        hook(TraceFunc::cuArrayCreate, |s, cu| {
            // SAFETY: null or the caller's descriptor.
            let bytes = unsafe { get(pAllocateArray) }
                .and_then(|d| array_bytes(d.width.into(), d.height.into(), 0, d.format, d.channels));
            // SAFETY: the caller's arguments, passed on unchanged.
            array(s, bytes, pHandle, || unsafe { (cu.cuArrayCreate)(pHandle, pAllocateArray) })
        })
    }

    /// # Safety
    /// As cuda.h's `cuArray3DCreate_v2`.
    fn cuArray3DCreate_v2(pHandle, pAllocateArray) {
        hook(TraceFunc::cuArray3DCreate_v2, |s, cu| {
            // SAFETY: null or the caller's descriptor, read through our mirror of its layout.
            let bytes = unsafe { get(pAllocateArray.cast::<Array3dDesc>()) }
                .and_then(|d| array_bytes(d.width as u64, d.height as u64, d.depth as u64, d.format, d.channels));
            // SAFETY: the caller's arguments, passed on unchanged.
            array(s, bytes, pHandle, || unsafe { (cu.cuArray3DCreate_v2)(pHandle, pAllocateArray) })
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuArray3DCreate`.
    fn cuArray3DCreate(pHandle, pAllocateArray) {
        hook(TraceFunc::cuArray3DCreate, |s, cu| {
            // SAFETY: null or the caller's descriptor.
            let bytes = unsafe { get(pAllocateArray) }
                .and_then(|d| array_bytes(d.width.into(), d.height.into(), d.depth.into(), d.format, d.channels));
            // SAFETY: the caller's arguments, passed on unchanged.
            array(s, bytes, pHandle, || unsafe { (cu.cuArray3DCreate)(pHandle, pAllocateArray) })
        })
    }

    /// # Safety
    /// As cuda.h's `cuArrayDestroy`.
    fn cuArrayDestroy(hArray) {
        hook(TraceFunc::cuArrayDestroy, |s, cu| {
            // SAFETY: the caller's argument, passed on unchanged.
            refunded(s, &s.mem.arrays, hArray as u64, || unsafe { (cu.cuArrayDestroy)(hArray) })
        })
    }
}

// ---- Mipmapped arrays ------------------------------------------------------------------------

/// The texture alignment (`CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT` of every GPU since Fermi): each
/// level of a mipmapped array starts on it.
const LEVEL_ALIGN: u64 = 512;
/// `CUDA_ARRAY3D_LAYERED`, `CUDA_ARRAY3D_CUBEMAP`: the depth is a layer or face count, kept at
/// every level.
const ARRAY3D_LAYERED: c_uint = 0x01;
const ARRAY3D_CUBEMAP: c_uint = 0x04;

/// The most levels a mipmapped array of this shape has: one per halving of its largest extent
/// that shrinks, plus one.
fn most_levels(d: &Array3dDesc) -> c_uint {
    let keep_depth = d.flags & (ARRAY3D_LAYERED | ARRAY3D_CUBEMAP) != 0;
    let largest = if keep_depth { d.width.max(d.height) } else { d.width.max(d.height).max(d.depth) };
    usize::BITS - largest.leading_zeros()
}

/// Bytes of a mipmapped array before the driver says: level `i` is the descriptor's extents
/// halved `i` times (at least 1; 0 stays 0; a layered or cubemap depth stays), its bytes rounded
/// up to the texture alignment, summed over the levels (at most [`most_levels`]). `None`: not a
/// size (the driver refuses).
fn mipmap_bytes(d: &Array3dDesc, levels: c_uint) -> Option<u64> {
    let elem = format_bytes(d.format).checked_mul(u64::from(d.channels.max(1)))?;
    let keep_depth = d.flags & (ARRAY3D_LAYERED | ARRAY3D_CUBEMAP) != 0;
    (0..levels.min(most_levels(d))).try_fold(0u64, |total, i| {
        let shrink = |v: usize| if v == 0 { 0 } else { (v as u64 >> i).max(1) };
        let depth = if keep_depth { d.depth as u64 } else { shrink(d.depth) };
        let level = shrink(d.width)
            .checked_mul(shrink(d.height).max(1))?
            .checked_mul(depth.max(1))?
            .checked_mul(elem)?
            .checked_next_multiple_of(LEVEL_ALIGN)?;
        total.checked_add(level)
    })
}

/// Reserves `estimate`, creates, then trues the charge up to what the driver reports the array
/// takes (`cuMipmappedArrayGetMemoryRequirements`; `fallback` where it does not answer): more is
/// reserved too (if it does not fit, the array is destroyed and the answer is
/// `CUDA_ERROR_OUT_OF_MEMORY`), less is refunded. A request the estimate finds invalid reserves
/// nothing first (the driver refuses it) but is charged all the same if the driver makes it.
fn mipmapped(
    s: &ShimState,
    cu: &RealCuda,
    (estimate, fallback): (u64, u64),
    handle: *mut CUmipmappedArray,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some((ctx, ordinal)) = s.current_context() else { return call() };
    let Some(dev) = s.device_of_ordinal(ordinal) else { return call() };
    crate::trace::note(dev, estimate);
    if !s.reserve(dev, estimate) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let rc = call();
    // SAFETY: the driver wrote the handle through the caller's out-pointer (it succeeded).
    let made = if rc == CUDA_SUCCESS { unsafe { get(handle) } } else { None };
    let Some(h) = made.filter(|h| !h.is_null()) else {
        s.refund(dev, estimate);
        return rc;
    };
    let mut req = ArrayMemoryRequirements::default();
    let actual = match cu.cuMipmappedArrayGetMemoryRequirements {
        // SAFETY: a valid out-struct; h is the array just made, ordinal its device.
        // (our mirror of `CUDA_ARRAY_MEMORY_REQUIREMENTS`, the same layout).
        Some(f) if unsafe { f((&raw mut req).cast(), h, ordinal) } == CUDA_SUCCESS && req.size > 0 => req.size as u64,
        _ => fallback,
    };
    if actual > estimate && !s.reserve(dev, actual - estimate) {
        if let Some(destroy) = cu.cuMipmappedArrayDestroy {
            // SAFETY: destroying the array just made, which the caller never saw.
            unsafe { destroy(h) };
        }
        s.refund(dev, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if actual < estimate {
        s.refund(dev, estimate - actual);
    }
    s.mem.arrays.insert(h as u64, Charge { dev, bytes: actual, ctx: ctx as usize, kind: Kind::Array });
    rc
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMipmappedArrayCreate`.
    fn cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels) {
        hook(TraceFunc::cuMipmappedArrayCreate, |s, cu| {
            let Some(f) = cu.cuMipmappedArrayCreate else { return NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            let call = || unsafe { f(pHandle, pMipmappedArrayDesc, numMipmapLevels) };
            // SAFETY: null or the caller's descriptor, read through our mirror of its layout.
            let Some(d) = (unsafe { get(pMipmappedArrayDesc.cast::<Array3dDesc>()) }) else { return call() };
            // Levels past what the shape has: the driver refuses (reserve nothing before).
            let Some(bytes) = mipmap_bytes(&d, numMipmapLevels) else { return call() };
            let estimate = if numMipmapLevels <= most_levels(&d) { bytes } else { 0 };
            mipmapped(s, cu, (estimate, bytes), pHandle, call)
        })
    }

    /// # Safety
    /// As cuda.h's `cuMipmappedArrayDestroy`.
    fn cuMipmappedArrayDestroy(hMipmappedArray) {
        hook(TraceFunc::cuMipmappedArrayDestroy, |s, cu| {
            let Some(f) = cu.cuMipmappedArrayDestroy else { return NOT_SUPPORTED };
            // SAFETY: the caller's argument, passed on unchanged.
            refunded(s, &s.mem.arrays, hMipmappedArray as u64, || unsafe { f(hMipmappedArray) })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mipmap_sizes_sum_aligned_levels() {
        let d = |w: usize, h: usize, depth: usize, flags: c_uint| Array3dDesc {
            width: w,
            height: h,
            depth,
            format: 0x20,
            channels: 4,
            flags,
        };
        let full: u64 = (0..13).map(|i| ((4096u64 >> i) * (4096 >> i) * 16).next_multiple_of(512)).sum();
        assert_eq!(mipmap_bytes(&d(4096, 4096, 0, 0), 13), Some(full));
        assert_eq!(mipmap_bytes(&d(64, 64, 8, 0), 2), Some(64 * 64 * 8 * 16 + 32 * 32 * 4 * 16), "3D halves its depth");
        assert_eq!(mipmap_bytes(&d(64, 64, 8, ARRAY3D_LAYERED), 2), Some((64 * 64 + 32 * 32) * 8 * 16), "layers stay");
        assert_eq!(mipmap_bytes(&d(1, 0, 0, 0), 1), Some(512), "one texel takes the alignment");
        assert_eq!(mipmap_bytes(&d(usize::MAX, 2, 0, 0), 1), None);
        assert_eq!(mipmap_bytes(&d(8, 8, 0, 0), 1000), mipmap_bytes(&d(8, 8, 0, 0), 4), "8 x 8 has 4 levels");
        assert_eq!((most_levels(&d(8, 8, 0, 0)), most_levels(&d(8, 8, 64, ARRAY3D_LAYERED))), (4, 4));
        assert_eq!(most_levels(&d(8, 8, 64, 0)), 7, "a 3D array's depth shrinks too");
    }

    #[test]
    fn array_sizes_follow_the_descriptor() {
        assert_eq!(array_bytes(1024, 0, 0, 0x20, 1), Some(4096), "1D float");
        assert_eq!(array_bytes(64, 32, 0, 0x01, 4), Some(64 * 32 * 4), "2D uchar4");
        assert_eq!(array_bytes(16, 16, 16, 0x10, 2), Some(16 * 16 * 16 * 4), "3D half2");
        assert_eq!(array_bytes(u64::MAX, 2, 0, 0x20, 1), None);
    }
}
