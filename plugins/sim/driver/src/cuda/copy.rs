//! Copies and memsets. Device memory is host memory here, so a copy is a `memmove` under the
//! registry's read lock (no allocation can be freed under it); every device-side range is checked
//! against what the process holds first (`INVALID_VALUE` outside it), so a bad device pointer is
//! an error code, never a stray write.
//!
//! Synchronous variants first wait for what they are ordered after: the legacy default stream
//! and the context's blocking streams (the `_ptds` variants: the per-thread default stream).
//! Asynchronous variants move the bytes at once (kernels change no memory here, so the result
//! is what stream order would give), or are recorded when their stream is capturing.

use std::ffi::{c_uint, c_void};
use std::sync::Arc;

use tessera_sim_model::Node;

use super::context::{self, Ctx};
use super::errors::poll_faults;
use super::graph::{Op, submit};
use super::handles::{self, Registry};
use super::init::driver;
use super::stream::{resolve, wait_stream};
use super::{CUresult, INVALID_CONTEXT, INVALID_VALUE, R, get, run, sys};

/// Which side of a copy an address is on, as the call names it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Must be memory the process allocated (device, managed, pinned, registered, VMM).
    Device,
    /// Host memory: the caller's to vouch for.
    Host,
    /// Unified addressing: known memory is checked, anything else is taken as host memory.
    Any,
}

/// Checks `[addr, addr + len)` for its side of a copy.
fn check_range(reg: &Registry, addr: u64, len: u64, side: Side, write: bool) -> R {
    if addr == 0 {
        return Err(INVALID_VALUE);
    }
    let end = addr.checked_add(len).ok_or(INVALID_VALUE)?;
    if let Some(a) = reg.alloc_at(addr) {
        return if end <= a.base + a.size { Ok(()) } else { Err(INVALID_VALUE) };
    }
    if reg.reservation_at(addr).is_some() {
        return if super::vmm::accessible(reg, addr, len, write) { Ok(()) } else { Err(INVALID_VALUE) };
    }
    match side {
        Side::Device => Err(INVALID_VALUE),
        Side::Host | Side::Any => Ok(()),
    }
}

/// Copies `n` bytes after checking both sides.
///
/// # Safety
/// Host-side addresses must be valid for the copy (the caller's contract in the C API).
unsafe fn copy(dst: u64, src: u64, n: u64, dst_side: Side, src_side: Side) -> R {
    if n == 0 {
        return Ok(());
    }
    let reg = handles::read();
    check_range(&reg, dst, n, dst_side, true)?;
    check_range(&reg, src, n, src_side, false)?;
    // SAFETY: device-side ranges lie in memory the process holds and cannot be freed while the
    // registry is read-locked; host-side ranges are valid by this function's contract. The ranges
    // may overlap (a device-to-device copy within one allocation), hence `copy`, not
    // `copy_nonoverlapping`.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n as usize) };
    Ok(())
}

/// A copy with unified addressing on both sides (graph memcpy nodes).
///
/// # Safety
/// As [`copy`].
pub(crate) unsafe fn copy_now(dst: u64, src: u64, n: u64) -> R {
    // SAFETY: as this function's contract.
    unsafe { copy(dst, src, n, Side::Any, Side::Any) }
}

/// A memset: `height` rows of `width` elements of `elem` bytes, `pitch` bytes apart, each set to
/// `value`; as a call makes it, or a graph node holds it.
#[derive(Clone, Copy)]
pub(crate) struct Memset {
    pub dst: u64,
    pub pitch: u64,
    pub value: u32,
    pub elem: u32,
    pub width: u64,
    pub height: u64,
}

impl Memset {
    /// `n` elements from `dst`, one row (`cuMemsetD8` and its kin).
    fn row(dst: u64, value: u32, elem: u32, n: u64) -> Memset {
        Memset { dst, pitch: 0, value, elem, width: n, height: 1 }
    }

    /// `height` rows of `width` elements, `pitch` bytes apart (`cuMemsetD2D8` and its kin).
    fn rect(dst: u64, pitch: u64, value: u32, elem: u32, width: u64, height: u64) -> Memset {
        Memset { dst, pitch, value, elem, width, height }
    }
}

/// Carries out a memset now.
pub(crate) fn memset_now(m: Memset) -> R {
    let Memset { dst, pitch, value, elem, width, height } = m;
    let elem = u64::from(elem);
    let row = width.checked_mul(elem).ok_or(INVALID_VALUE)?;
    if !dst.is_multiple_of(elem) || (height > 1 && (!pitch.is_multiple_of(elem) || pitch < row)) {
        return Err(INVALID_VALUE);
    }
    if row == 0 || height == 0 {
        return Ok(());
    }
    let span = pitch.checked_mul(height - 1).and_then(|s| s.checked_add(row)).ok_or(INVALID_VALUE)?;
    let reg = handles::read();
    check_range(&reg, dst, span, Side::Device, true)?;
    for r in 0..height {
        let p = (dst + r * pitch) as *mut u8;
        // SAFETY: each row lies in the range checked above, in memory the process holds that
        // cannot be freed while the registry is read-locked; `dst` and `pitch` are multiples of
        // the element size (checked above), so the element writes are aligned.
        unsafe {
            match elem {
                1 => std::ptr::write_bytes(p, value as u8, row as usize),
                2 => (0..width as usize).for_each(|i| p.cast::<u16>().add(i).write(value as u16)),
                _ => (0..width as usize).for_each(|i| p.cast::<u32>().add(i).write(value)),
            }
        }
    }
    Ok(())
}

/// Waits for what a synchronous call is ordered after, and returns the current context: the
/// per-thread default stream (`_ptds`), or the legacy one with the context's blocking streams.
fn sync_point(pt: bool) -> R<(&'static Node, Arc<Ctx>)> {
    let node = driver()?.node;
    poll_faults(node)?;
    let (ctx, sids) = {
        let reg = handles::read();
        let ctx = context::current_in(&reg)?.clone();
        ctx.check(node)?;
        let sids = if pt {
            vec![ctx.per_thread_stream(node)?]
        } else {
            super::stream::legacy_group(&reg, &ctx, ctx.legacy_stream(node)?)?
        };
        (ctx, sids)
    };
    for sid in sids {
        wait_stream(node, sid)?;
    }
    ctx.check(node)?;
    Ok((node, ctx))
}

/// A synchronous copy.
///
/// # Safety
/// As [`copy`].
unsafe fn copy_sync(dst: u64, src: u64, n: u64, d: Side, s: Side, pt: bool) -> R {
    sync_point(pt)?;
    // SAFETY: as this function's contract.
    unsafe { copy(dst, src, n, d, s) }
}

/// An asynchronous copy on a stream (recorded if it is capturing).
///
/// # Safety
/// As [`copy`].
unsafe fn copy_async(dst: u64, src: u64, n: u64, d: Side, s: Side, stream: sys::CUstream, pt: bool) -> R {
    let node = driver()?.node;
    poll_faults(node)?;
    let t = resolve(&handles::read(), node, stream, pt)?;
    t.ctx.check(node)?;
    if let Some(c) = t.capture() {
        return c.add(Op::Memcpy { dst, src, n });
    }
    // SAFETY: as this function's contract.
    unsafe { copy(dst, src, n, d, s) }
}

fn memset_sync(m: Memset, pt: bool) -> R {
    sync_point(pt)?;
    memset_now(m)
}

fn memset_async(m: Memset, stream: sys::CUstream, pt: bool) -> R {
    let node = driver()?.node;
    poll_faults(node)?;
    let t = resolve(&handles::read(), node, stream, pt)?;
    t.ctx.check(node)?;
    submit(node, &t, Op::Memset(m))
}

/// An array's storage, and the byte range `[offset, offset + n)` of it.
fn array_range(h: sys::CUarray, offset: u64, n: u64) -> R<u64> {
    let a = handles::read().arrays.get(&(h as usize)).cloned().ok_or(super::INVALID_HANDLE)?;
    let end = offset.checked_add(n).ok_or(INVALID_VALUE)?;
    if end > a.bytes {
        return Err(INVALID_VALUE);
    }
    Ok(a.base + offset)
}

use Side::{Any, Device as Dev, Host};
use tessera_abi::cuda::Memcpy2dV1;
use tessera_abi::cuda_exports;

// cuMemcpy: unified addressing.
cuda_exports! {
    fn cuMemcpy(dst, src, ByteCount) twin cuMemcpy_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dst, src, ByteCount as u64, Any, Any, per_thread) })
    }
    fn cuMemcpyAsync(dst, src, ByteCount, hStream) twin cuMemcpyAsync_ptsz(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(dst, src, ByteCount as u64, Any, Any, hStream, per_thread) })
    }

    // Host to device.
    fn cuMemcpyHtoD_v2(dstDevice, srcHost, ByteCount) twin cuMemcpyHtoD_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstDevice, srcHost as u64, ByteCount as u64, Dev, Host, per_thread) })
    }
    fn cuMemcpyHtoD(dstDevice, srcHost, ByteCount) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstDevice as u64, srcHost as u64, ByteCount as u64, Dev, Host, false) })
    }
    fn cuMemcpyHtoDAsync_v2(dstDevice, srcHost, ByteCount, hStream) twin cuMemcpyHtoDAsync_v2_ptsz(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(dstDevice, srcHost as u64, ByteCount as u64, Dev, Host, hStream, per_thread) })
    }
    fn cuMemcpyHtoDAsync(dstDevice, srcHost, ByteCount, hStream) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(dstDevice as u64, srcHost as u64, ByteCount as u64, Dev, Host, hStream, false) })
    }

    // Device to host.
    fn cuMemcpyDtoH_v2(dstHost, srcDevice, ByteCount) twin cuMemcpyDtoH_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstHost as u64, srcDevice, ByteCount as u64, Host, Dev, per_thread) })
    }
    fn cuMemcpyDtoH(dstHost, srcDevice, ByteCount) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstHost as u64, srcDevice as u64, ByteCount as u64, Host, Dev, false) })
    }
    fn cuMemcpyDtoHAsync_v2(dstHost, srcDevice, ByteCount, hStream) twin cuMemcpyDtoHAsync_v2_ptsz(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(dstHost as u64, srcDevice, ByteCount as u64, Host, Dev, hStream, per_thread) })
    }
    fn cuMemcpyDtoHAsync(dstHost, srcDevice, ByteCount, hStream) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(dstHost as u64, srcDevice as u64, ByteCount as u64, Host, Dev, hStream, false) })
    }

    // Device to device.
    fn cuMemcpyDtoD_v2(dstDevice, srcDevice, ByteCount) twin cuMemcpyDtoD_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstDevice, srcDevice, ByteCount as u64, Dev, Dev, per_thread) })
    }
    fn cuMemcpyDtoD(dstDevice, srcDevice, ByteCount) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstDevice as u64, srcDevice as u64, ByteCount as u64, Dev, Dev, false) })
    }
    fn cuMemcpyDtoDAsync_v2(dstDevice, srcDevice, ByteCount, hStream) twin cuMemcpyDtoDAsync_v2_ptsz(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(dstDevice, srcDevice, ByteCount as u64, Dev, Dev, hStream, per_thread) })
    }
    fn cuMemcpyDtoDAsync(dstDevice, srcDevice, ByteCount, hStream) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(dstDevice as u64, srcDevice as u64, ByteCount as u64, Dev, Dev, hStream, false) })
    }

    // Arrays (their storage is linear: offsets are bytes into it).
    fn cuMemcpyHtoA_v2(dstArray, dstOffset, srcHost, ByteCount) twin cuMemcpyHtoA_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(array_range(dstArray, dstOffset as u64, ByteCount as u64)?, srcHost as u64, ByteCount as u64, Dev, Host, per_thread) })
    }
    fn cuMemcpyAtoH_v2(dstHost, srcArray, srcOffset, ByteCount) twin cuMemcpyAtoH_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstHost as u64, array_range(srcArray, srcOffset as u64, ByteCount as u64)?, ByteCount as u64, Host, Dev, per_thread) })
    }
    fn cuMemcpyDtoA_v2(dstArray, dstOffset, srcDevice, ByteCount) twin cuMemcpyDtoA_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(array_range(dstArray, dstOffset as u64, ByteCount as u64)?, srcDevice, ByteCount as u64, Dev, Dev, per_thread) })
    }
    fn cuMemcpyAtoD_v2(dstDevice, srcArray, srcOffset, ByteCount) twin cuMemcpyAtoD_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstDevice, array_range(srcArray, srcOffset as u64, ByteCount as u64)?, ByteCount as u64, Dev, Dev, per_thread) })
    }
    fn cuMemcpyAtoA_v2(dstArray, dstOffset, srcArray, srcOffset, ByteCount) twin cuMemcpyAtoA_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(array_range(dstArray, dstOffset as u64, ByteCount as u64)?, array_range(srcArray, srcOffset as u64, ByteCount as u64)?, ByteCount as u64, Dev, Dev, per_thread) })
    }
    fn cuMemcpyHtoAAsync_v2(dstArray, dstOffset, srcHost, ByteCount, hStream) twin cuMemcpyHtoAAsync_v2_ptsz(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(array_range(dstArray, dstOffset as u64, ByteCount as u64)?, srcHost as u64, ByteCount as u64, Dev, Host, hStream, per_thread) })
    }
    fn cuMemcpyAtoHAsync_v2(dstHost, srcArray, srcOffset, ByteCount, hStream) twin cuMemcpyAtoHAsync_v2_ptsz(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(dstHost as u64, array_range(srcArray, srcOffset as u64, ByteCount as u64)?, ByteCount as u64, Host, Dev, hStream, per_thread) })
    }

    // Legacy array copies (32-bit offsets and sizes).
    fn cuMemcpyHtoA(dstArray, dstOffset, srcHost, ByteCount) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(array_range(dstArray, dstOffset as u64, ByteCount as u64)?, srcHost as u64, ByteCount as u64, Dev, Host, false) })
    }
    fn cuMemcpyAtoH(dstHost, srcArray, srcOffset, ByteCount) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstHost as u64, array_range(srcArray, srcOffset as u64, ByteCount as u64)?, ByteCount as u64, Host, Dev, false) })
    }
    fn cuMemcpyDtoA(dstArray, dstOffset, srcDevice, ByteCount) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(array_range(dstArray, dstOffset as u64, ByteCount as u64)?, srcDevice as u64, ByteCount as u64, Dev, Dev, false) })
    }
    fn cuMemcpyAtoD(dstDevice, srcArray, srcOffset, ByteCount) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(dstDevice as u64, array_range(srcArray, srcOffset as u64, ByteCount as u64)?, ByteCount as u64, Dev, Dev, false) })
    }
    fn cuMemcpyAtoA(dstArray, dstOffset, srcArray, srcOffset, ByteCount) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_sync(array_range(dstArray, dstOffset as u64, ByteCount as u64)?, array_range(srcArray, srcOffset as u64, ByteCount as u64)?, ByteCount as u64, Dev, Dev, false) })
    }
    fn cuMemcpyHtoAAsync(dstArray, dstOffset, srcHost, ByteCount, hStream) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(array_range(dstArray, dstOffset as u64, ByteCount as u64)?, srcHost as u64, ByteCount as u64, Dev, Host, hStream, false) })
    }
    fn cuMemcpyAtoHAsync(dstHost, srcArray, srcOffset, ByteCount, hStream) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { copy_async(dstHost as u64, array_range(srcArray, srcOffset as u64, ByteCount as u64)?, ByteCount as u64, Host, Dev, hStream, false) })
    }
}

/// A copy between two contexts' memory (unified addressing makes it a plain copy).
///
/// # Safety
/// As [`copy`].
unsafe fn peer(
    dst: u64,
    dst_ctx: sys::CUcontext,
    src: u64,
    src_ctx: sys::CUcontext,
    n: u64,
    stream: Option<sys::CUstream>,
    pt: bool,
) -> R {
    driver()?;
    {
        let reg = handles::read();
        if !reg.ctxs.contains_key(&(dst_ctx as usize)) || !reg.ctxs.contains_key(&(src_ctx as usize)) {
            return Err(INVALID_CONTEXT);
        }
    }
    // SAFETY: both sides are device memory, checked against what the process holds.
    unsafe {
        match stream {
            Some(s) => copy_async(dst, src, n, Dev, Dev, s, pt),
            None => copy_sync(dst, src, n, Dev, Dev, pt),
        }
    }
}
cuda_exports! {
    fn cuMemcpyPeer(dstDevice, dstContext, srcDevice, srcContext, ByteCount) twin cuMemcpyPeer_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount as u64, None, per_thread) })
    }
    fn cuMemcpyPeerAsync(dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream) twin cuMemcpyPeerAsync_ptsz(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount as u64, Some(hStream), per_thread) })
    }
}

// ---- 2D copies -------------------------------------------------------------------------------

/// One side of a `CUDA_MEMCPY2D`, the source or the destination, as C lays it out: where its
/// region starts (`x` bytes into row `y`), its memory type read as a raw integer, and where that
/// memory is.
#[repr(C)]
#[derive(Clone, Copy)]
struct Side2d {
    x: usize,
    y: usize,
    ty: u32,
    host: *const c_void,
    device: u64,
    array: sys::CUarray,
    pitch: usize,
}

impl Side2d {
    /// From the legacy struct's 32-bit fields.
    fn v1(
        x: c_uint,
        y: c_uint,
        ty: u32,
        host: *const c_void,
        device: c_uint,
        array: sys::CUarray,
        pitch: c_uint,
    ) -> Side2d {
        Side2d { x: x as usize, y: y as usize, ty, host, device: u64::from(device), array, pitch: pitch as usize }
    }

    /// Its first byte, its pitch, and which side of memory it is on.
    fn start(&self) -> R<(u64, u64, Side)> {
        let (base, pitch, side) = match self.ty {
            1 => (self.host as u64, self.pitch as u64, Host),
            2 => (self.device, self.pitch as u64, Dev),
            3 => {
                let a = handles::read().arrays.get(&(self.array as usize)).cloned().ok_or(super::INVALID_HANDLE)?;
                (a.base, a.row_bytes(), Dev)
            }
            4 => (self.device, self.pitch as u64, Any),
            _ => return Err(INVALID_VALUE),
        };
        let start = (self.y as u64)
            .checked_mul(pitch)
            .and_then(|o| o.checked_add(self.x as u64))
            .and_then(|o| base.checked_add(o));
        Ok((start.ok_or(INVALID_VALUE)?, pitch, side))
    }
}

/// `CUDA_MEMCPY2D` with its memory types read as raw integers.
#[repr(C)]
#[derive(Clone, Copy)]
struct Memcpy2d {
    src: Side2d,
    dst: Side2d,
    width: usize,
    height: usize,
}
const _: () = assert!(std::mem::size_of::<Memcpy2d>() == std::mem::size_of::<sys::CUDA_MEMCPY2D>());
const _: () = assert!(std::mem::offset_of!(Memcpy2d, src.pitch) == std::mem::offset_of!(sys::CUDA_MEMCPY2D, srcPitch));
const _: () =
    assert!(std::mem::offset_of!(Memcpy2d, dst.ty) == std::mem::offset_of!(sys::CUDA_MEMCPY2D, dstMemoryType));
const _: () = assert!(std::mem::offset_of!(Memcpy2d, dst.pitch) == std::mem::offset_of!(sys::CUDA_MEMCPY2D, dstPitch));
const _: () = assert!(std::mem::offset_of!(Memcpy2d, height) == std::mem::offset_of!(sys::CUDA_MEMCPY2D, Height));

impl From<Memcpy2dV1> for Memcpy2d {
    fn from(v: Memcpy2dV1) -> Memcpy2d {
        Memcpy2d {
            src: Side2d::v1(v.src_x, v.src_y, v.src_type, v.src_host, v.src_device, v.src_array, v.src_pitch),
            dst: Side2d::v1(
                v.dst_x,
                v.dst_y,
                v.dst_type,
                v.dst_host.cast_const(),
                v.dst_device,
                v.dst_array,
                v.dst_pitch,
            ),
            width: v.width as usize,
            height: v.height as usize,
        }
    }
}

/// Copies a 2D region row by row.
///
/// # Safety
/// Host-side rows must be valid for the copy (the caller's contract).
unsafe fn copy_2d(p: &Memcpy2d) -> R {
    let (src, sp, ss) = p.src.start()?;
    let (dst, dp, ds) = p.dst.start()?;
    let w = p.width as u64;
    if p.height > 1 && (sp < w || dp < w) {
        return Err(INVALID_VALUE);
    }
    for r in 0..p.height as u64 {
        // SAFETY: as this function's contract; device rows are checked by `copy`.
        unsafe { copy(dst + r * dp, src + r * sp, w, ds, ss) }?;
    }
    Ok(())
}

/// # Safety
/// `p` must be null or point to a `CUDA_MEMCPY2D` whose host rows are valid.
unsafe fn memcpy_2d(p: *const sys::CUDA_MEMCPY2D, stream: Option<sys::CUstream>, pt: bool) -> R {
    // SAFETY: Memcpy2d has the layout of CUDA_MEMCPY2D (asserted above) with the enums read as
    // raw integers; null/misaligned is checked by get.
    let p = unsafe { get(p.cast::<Memcpy2d>()) }?;
    match stream {
        None => {
            sync_point(pt)?;
            // SAFETY: as this function's contract.
            unsafe { copy_2d(&p) }
        }
        Some(s) => {
            let node = driver()?.node;
            poll_faults(node)?;
            let t = resolve(&handles::read(), node, s, pt)?;
            t.ctx.check(node)?;
            if t.capture().is_some() {
                return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            // SAFETY: as this function's contract.
            unsafe { copy_2d(&p) }
        }
    }
}

cuda_exports! {
    fn cuMemcpy2D_v2(pCopy) twin cuMemcpy2D_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { memcpy_2d(pCopy, None, per_thread) })
    }
    fn cuMemcpy2DUnaligned_v2(pCopy) twin cuMemcpy2DUnaligned_v2_ptds(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { memcpy_2d(pCopy, None, per_thread) })
    }
    fn cuMemcpy2DAsync_v2(pCopy, hStream) twin cuMemcpy2DAsync_v2_ptsz(per_thread) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { memcpy_2d(pCopy, Some(hStream), per_thread) })
    }
}

/// # Safety
/// `p` must be null or point to a `CUDA_MEMCPY2D_v1` whose host rows are valid.
unsafe fn memcpy_2d_v1(p: *const Memcpy2dV1, stream: Option<sys::CUstream>) -> R {
    // SAFETY: null/misaligned checked by get; every field is an integer or a pointer.
    let v = unsafe { get(p) }?;
    let p2: Memcpy2d = v.into();
    // SAFETY: the converted struct lives on our stack; its host rows are the caller's.
    unsafe { memcpy_2d((&p2 as *const Memcpy2d).cast(), stream, false) }
}
cuda_exports! {
    fn cuMemcpy2D(pCopy) also cuMemcpy2DUnaligned {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { memcpy_2d_v1(pCopy, None) })
    }
    fn cuMemcpy2DAsync(pCopy, hStream) {
        // SAFETY: every pointer comes from the C caller and is valid per the CUDA API contract.
        run(|| unsafe { memcpy_2d_v1(pCopy, Some(hStream)) })
    }

    // ---- Memsets ---------------------------------------------------------------------------------

    fn cuMemsetD8_v2(dstDevice, uc, N) twin cuMemsetD8_v2_ptds(per_thread) {
        run(|| memset_sync(Memset::row(dstDevice, uc as u32, 1, N as u64), per_thread))
    }
    fn cuMemsetD8(dstDevice, uc, N) {
        run(|| memset_sync(Memset::row(dstDevice as u64, uc as u32, 1, N as u64), false))
    }
    fn cuMemsetD16_v2(dstDevice, us, N) twin cuMemsetD16_v2_ptds(per_thread) {
        run(|| memset_sync(Memset::row(dstDevice, us as u32, 2, N as u64), per_thread))
    }
    fn cuMemsetD16(dstDevice, us, N) {
        run(|| memset_sync(Memset::row(dstDevice as u64, us as u32, 2, N as u64), false))
    }
    fn cuMemsetD32_v2(dstDevice, ui, N) twin cuMemsetD32_v2_ptds(per_thread) {
        run(|| memset_sync(Memset::row(dstDevice, ui, 4, N as u64), per_thread))
    }
    fn cuMemsetD32(dstDevice, ui, N) {
        run(|| memset_sync(Memset::row(dstDevice as u64, ui, 4, N as u64), false))
    }
    fn cuMemsetD2D8_v2(dstDevice, dstPitch, uc, Width, Height) twin cuMemsetD2D8_v2_ptds(per_thread) {
        let m = Memset::rect(dstDevice, dstPitch as u64, uc as u32, 1, Width as u64, Height as u64);
        run(|| memset_sync(m, per_thread))
    }
    fn cuMemsetD2D16_v2(dstDevice, dstPitch, us, Width, Height) twin cuMemsetD2D16_v2_ptds(per_thread) {
        let m = Memset::rect(dstDevice, dstPitch as u64, us as u32, 2, Width as u64, Height as u64);
        run(|| memset_sync(m, per_thread))
    }
    fn cuMemsetD2D32_v2(dstDevice, dstPitch, ui, Width, Height) twin cuMemsetD2D32_v2_ptds(per_thread) {
        let m = Memset::rect(dstDevice, dstPitch as u64, ui, 4, Width as u64, Height as u64);
        run(|| memset_sync(m, per_thread))
    }
    fn cuMemsetD2D8(dstDevice, dstPitch, uc, Width, Height) {
        let m = Memset::rect(dstDevice as u64, dstPitch as u64, uc as u32, 1, Width as u64, Height as u64);
        run(|| memset_sync(m, false))
    }
    fn cuMemsetD2D16(dstDevice, dstPitch, us, Width, Height) {
        let m = Memset::rect(dstDevice as u64, dstPitch as u64, us as u32, 2, Width as u64, Height as u64);
        run(|| memset_sync(m, false))
    }
    fn cuMemsetD2D32(dstDevice, dstPitch, ui, Width, Height) {
        let m = Memset::rect(dstDevice as u64, dstPitch as u64, ui, 4, Width as u64, Height as u64);
        run(|| memset_sync(m, false))
    }
    fn cuMemsetD8Async(dstDevice, uc, N, hStream) twin cuMemsetD8Async_ptsz(per_thread) {
        run(|| memset_async(Memset::row(dstDevice, uc as u32, 1, N as u64), hStream, per_thread))
    }
    fn cuMemsetD16Async(dstDevice, us, N, hStream) twin cuMemsetD16Async_ptsz(per_thread) {
        run(|| memset_async(Memset::row(dstDevice, us as u32, 2, N as u64), hStream, per_thread))
    }
    fn cuMemsetD32Async(dstDevice, ui, N, hStream) twin cuMemsetD32Async_ptsz(per_thread) {
        run(|| memset_async(Memset::row(dstDevice, ui, 4, N as u64), hStream, per_thread))
    }
    fn cuMemsetD2D8Async(dstDevice, dstPitch, uc, Width, Height, hStream) twin cuMemsetD2D8Async_ptsz(per_thread) {
        let m = Memset::rect(dstDevice, dstPitch as u64, uc as u32, 1, Width as u64, Height as u64);
        run(|| memset_async(m, hStream, per_thread))
    }
    fn cuMemsetD2D16Async(dstDevice, dstPitch, us, Width, Height, hStream) twin cuMemsetD2D16Async_ptsz(per_thread) {
        let m = Memset::rect(dstDevice, dstPitch as u64, us as u32, 2, Width as u64, Height as u64);
        run(|| memset_async(m, hStream, per_thread))
    }
    fn cuMemsetD2D32Async(dstDevice, dstPitch, ui, Width, Height, hStream) twin cuMemsetD2D32Async_ptsz(per_thread) {
        let m = Memset::rect(dstDevice, dstPitch as u64, ui, 4, Width as u64, Height as u64);
        run(|| memset_async(m, hStream, per_thread))
    }
}
