//! Memory pools and stream-ordered allocation (`cuMemAllocAsync`, `cuMemFreeAsync`).
//!
//! As a real pool, a pool keeps freed memory in reserve up to its release threshold
//! (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`, 0 by default): that memory stays charged to the device
//! (NVML and `cuMemGetInfo` count it as used) and serves the pool's next allocations without a new
//! charge, until `cuMemPoolTrimTo` releases it or the pool is destroyed. What a free leaves above
//! the threshold is released at once (a real driver releases it at the next synchronization).

use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, MutexGuard};

use tessera_abi::cuda_exports;

use super::errors::poll_faults;
use super::graph::Op;
use super::handles::{self, pool};
use super::init::{Device, driver};
use super::memory::{Alloc, MemKind, charge, map_anon, refund, release_keeping};
use super::stream::resolve_and_check;
use super::{INVALID_VALUE, OUT_OF_MEMORY, R, get, need, put, run, sys};

/// `CU_MEM_ALLOCATION_TYPE_PINNED`, `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(crate) const ALLOCATION_TYPE_PINNED: u32 = 1;
pub(crate) const LOCATION_TYPE_DEVICE: u32 = 1;

struct PoolState {
    reuse_follow_event_dependencies: i32,
    reuse_allow_opportunistic: i32,
    reuse_allow_internal_dependencies: i32,
    release_threshold: u64,
    used: u64,
    used_high: u64,
    reserved_high: u64,
    /// Freed memory kept in reserve (charged to the model in `kept_epoch`).
    kept: u64,
    kept_epoch: u64,
    /// Devices granted access besides the pool's own: (ordinal, `CUmemAccess_flags`).
    access: Vec<(c_int, u32)>,
}

pub(crate) struct Pool {
    pub handle: usize,
    pub dev: &'static Device,
    pub default: bool,
    /// `maxSize` (0: the device's memory).
    max_size: u64,
    state: Mutex<PoolState>,
}

impl Pool {
    fn new(dev: &'static Device, default: bool, max_size: u64) -> Pool {
        Pool {
            handle: handles::new_handle(),
            dev,
            default,
            max_size,
            state: Mutex::new(PoolState {
                reuse_follow_event_dependencies: 1,
                reuse_allow_opportunistic: 1,
                reuse_allow_internal_dependencies: 1,
                release_threshold: 0,
                used: 0,
                used_high: 0,
                reserved_high: 0,
                kept: 0,
                kept_epoch: 0,
                access: Vec::new(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts an allocation from the pool (fails beyond its maximum size). Returns how many of
    /// its bytes the reserve covers (already charged in `epoch`, the GPU's current one).
    fn on_alloc(&self, bytes: u64, epoch: u64) -> R<u64> {
        let mut s = self.state();
        if self.max_size > 0 && s.used + bytes > self.max_size {
            return Err(OUT_OF_MEMORY);
        }
        if s.kept_epoch != epoch {
            // A reset freed the reserve in the model.
            s.kept = 0;
        }
        let from_reserve = bytes.min(s.kept);
        s.kept -= from_reserve;
        s.used += bytes;
        s.used_high = s.used_high.max(s.used);
        s.reserved_high = s.reserved_high.max(s.used + s.kept);
        Ok(from_reserve)
    }

    /// Undoes [`Pool::on_alloc`] for an allocation that failed after it.
    fn undo_alloc(&self, bytes: u64, from_reserve: u64) {
        let mut s = self.state();
        s.used = s.used.saturating_sub(bytes);
        s.kept += from_reserve;
    }

    /// Frees one of the pool's allocations (taken out of the registry): the pool keeps up to its
    /// release threshold in reserve and the rest goes back to the device, under the pool's lock,
    /// so that its size as `cuMemPoolGetAttribute` tells it never shrinks before the device's
    /// memory does (a reader would count memory as gone that the device still holds).
    pub(crate) fn free(&self, node: &tessera_sim_model::Node, a: &Alloc) {
        let mut s = self.state();
        let kept = self.on_free(&mut s, a.size, a.epoch);
        release_keeping(node, a, kept);
    }

    /// Counts a free back to the pool: returns how many of the bytes (charged in `epoch`) the pool
    /// keeps in reserve, up to its release threshold; the caller refunds the rest.
    fn on_free(&self, s: &mut PoolState, bytes: u64, epoch: u64) -> u64 {
        s.used = s.used.saturating_sub(bytes);
        let now = super::memory::current_epoch(self.dev.gpu);
        if epoch != now {
            // Charged before a reset, which freed it in the model: nothing to keep.
            return 0;
        }
        if s.kept_epoch != now {
            // The reserve was charged before a reset (freed since): start anew.
            s.kept = 0;
            s.kept_epoch = now;
        }
        let room = s.release_threshold.saturating_sub(s.used + s.kept);
        let keep = bytes.min(room);
        s.kept += keep;
        keep
    }

    /// Releases the reserve down to `keep` bytes: returns (bytes to refund, their epoch).
    fn trim_to(&self, keep: u64) -> (u64, u64) {
        let mut s = self.state();
        let released = s.kept.saturating_sub(keep);
        s.kept -= released;
        (released, s.kept_epoch)
    }
}

/// The device's default pool, made on first use.
fn default_pool(dev: &'static Device) -> usize {
    let mut d = dev.default_pool.lock().unwrap_or_else(|e| e.into_inner());
    if *d == 0 {
        let p = Pool::new(dev, true, 0);
        *d = p.handle;
        handles::write().pools.insert(p.handle, Arc::new(p));
    }
    *d
}

/// The device's current pool.
fn current_pool(dev: &'static Device) -> usize {
    match dev.mem_pool.load(std::sync::atomic::Ordering::Acquire) {
        0 => default_pool(dev),
        p => p,
    }
}

cuda_exports! {
    fn cuDeviceGetDefaultMemPool(pool_out, dev) {
        run(|| {
            need(pool_out)?;
            let d = driver()?.device(dev)?;
            // SAFETY: pool_out is the caller's out-pointer (checked above).
            unsafe { put(pool_out, handles::as_ptr(default_pool(d))) }
        })
    }

    fn cuDeviceGetMemPool(pool, dev) {
        run(|| {
            need(pool)?;
            let d = driver()?.device(dev)?;
            // SAFETY: pool is the caller's out-pointer (checked above).
            unsafe { put(pool, handles::as_ptr(current_pool(d))) }
        })
    }

    fn cuDeviceSetMemPool(dev, pool) {
        run(|| {
            let d = driver()?.device(dev)?;
            let p = self::pool(pool)?;
            if p.dev.ordinal != d.ordinal {
                return Err(INVALID_VALUE);
            }
            d.mem_pool.store(if p.default { 0 } else { p.handle }, std::sync::atomic::Ordering::Release);
            Ok(())
        })
    }
}

/// `CUmemPoolProps` with its enums read as raw integers.
#[repr(C)]
#[derive(Clone, Copy)]
struct PoolProps {
    alloc_type: u32,
    handle_types: u32,
    location_type: u32,
    location_id: c_int,
    win32_security_attributes: *mut c_void,
    max_size: usize,
    usage: u16,
    reserved: [u8; 54],
}
const _: () = assert!(std::mem::size_of::<PoolProps>() == std::mem::size_of::<sys::CUmemPoolProps>());
const _: () = assert!(std::mem::offset_of!(PoolProps, max_size) == std::mem::offset_of!(sys::CUmemPoolProps, maxSize));

cuda_exports! {
    fn cuMemPoolCreate(pool, poolProps) {
        run(|| {
            need(pool)?;
            // SAFETY: PoolProps has the layout of CUmemPoolProps (asserted above) with the enums read
            // as raw integers; null/misaligned is checked by get.
            let p = unsafe { get(poolProps.cast::<PoolProps>()) }?;
            let drv = driver()?;
            if p.alloc_type != ALLOCATION_TYPE_PINNED
                || p.location_type != LOCATION_TYPE_DEVICE
                || p.handle_types & !0xF != 0
            {
                return Err(INVALID_VALUE);
            }
            let d = drv.device(p.location_id).map_err(|_| INVALID_VALUE)?;
            let created = Pool::new(d, false, p.max_size as u64);
            let h = created.handle;
            handles::write().pools.insert(h, Arc::new(created));
            // SAFETY: pool is the caller's out-pointer (checked above).
            unsafe { put(pool, handles::as_ptr(h)) }
        })
    }

    /// `cuMemPoolDestroy`: the default pool cannot be destroyed; allocations still out stay valid
    /// until freed (as the real driver releases the pool's resources once they are).
    fn cuMemPoolDestroy(pool) {
        run(|| {
            let p = self::pool(pool)?;
            if p.default {
                return Err(INVALID_VALUE);
            }
            trim(&p, 0)?;
            let _ = p.dev.mem_pool.compare_exchange(
                p.handle,
                0,
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Acquire,
            );
            handles::write().pools.remove(&p.handle);
            Ok(())
        })
    }
}

/// Returns the pool's reserve above `keep` bytes to the device.
fn trim(p: &Pool, keep: u64) -> R {
    let node = driver()?.node;
    let (released, epoch) = p.trim_to(keep);
    refund(node, p.dev.gpu, p.dev.domain, released, epoch);
    Ok(())
}

cuda_exports! {
    /// `cuMemPoolTrimTo`: releases the reserve down to `minBytesToKeep`.
    fn cuMemPoolTrimTo(pool, minBytesToKeep) {
        run(|| trim(&*self::pool(pool)?, minBytesToKeep as u64))
    }

    fn cuMemPoolSetAttribute(pool, attr, value) {
        run(|| {
            let p = self::pool(pool)?;
            need(value.cast::<u32>())?;
            let mut s = p.state();
            // SAFETY: value points to an int (attributes 1-3) or a cuuint64_t (4-8), per the API.
            unsafe {
                match attr {
                    1 => s.reuse_follow_event_dependencies = get(value.cast::<i32>())?,
                    2 => s.reuse_allow_opportunistic = get(value.cast::<i32>())?,
                    3 => s.reuse_allow_internal_dependencies = get(value.cast::<i32>())?,
                    4 => s.release_threshold = get(value.cast::<u64>())?,
                    // The high-water marks can only be reset (to the current value), with 0.
                    6 if get(value.cast::<u64>())? == 0 => s.reserved_high = s.used + s.kept,
                    8 if get(value.cast::<u64>())? == 0 => s.used_high = s.used,
                    _ => return Err(INVALID_VALUE),
                }
            }
            Ok(())
        })
    }

    fn cuMemPoolGetAttribute(pool, attr, value) {
        run(|| {
            let p = self::pool(pool)?;
            let s = p.state();
            // SAFETY: value points to an int (attributes 1-3) or a cuuint64_t (4-8), per the API.
            unsafe {
                match attr {
                    1 => put(value.cast::<i32>(), s.reuse_follow_event_dependencies),
                    2 => put(value.cast::<i32>(), s.reuse_allow_opportunistic),
                    3 => put(value.cast::<i32>(), s.reuse_allow_internal_dependencies),
                    4 => put(value.cast::<u64>(), s.release_threshold),
                    5 => put(value.cast::<u64>(), s.used + s.kept),
                    7 => put(value.cast::<u64>(), s.used),
                    6 => put(value.cast::<u64>(), s.reserved_high),
                    8 => put(value.cast::<u64>(), s.used_high),
                    _ => Err(INVALID_VALUE),
                }
            }
        })
    }
}

/// `CUmemAccessDesc` with its enums read as raw integers.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct AccessDesc {
    pub location_type: u32,
    pub location_id: c_int,
    pub flags: u32,
}
const _: () = assert!(std::mem::size_of::<AccessDesc>() == std::mem::size_of::<sys::CUmemAccessDesc>());

cuda_exports! {
    fn cuMemPoolSetAccess(pool, map, count) {
        run(|| {
            let p = self::pool(pool)?;
            let drv = driver()?;
            let mut s = p.state();
            for i in 0..count {
                // SAFETY: map holds `count` descriptors by the caller's contract; AccessDesc has their
                // layout with the enums read as raw integers.
                let a = unsafe { get(map.cast::<AccessDesc>().add(i)) }?;
                if a.location_type != LOCATION_TYPE_DEVICE || !matches!(a.flags, 0 | 1 | 3) {
                    return Err(INVALID_VALUE);
                }
                drv.device(a.location_id).map_err(|_| INVALID_VALUE)?;
                if a.location_id == p.dev.ordinal {
                    continue; // the owning device always has read-write access
                }
                s.access.retain(|e| e.0 != a.location_id);
                s.access.push((a.location_id, a.flags));
            }
            Ok(())
        })
    }

    fn cuMemPoolGetAccess(flags, memPool, location) {
        run(|| {
            need(flags)?;
            let p = pool(memPool)?;
            // SAFETY: location is the caller's struct (null/misaligned checked by get); read as the
            // raw (type, id) pair of CUmemLocation.
            let loc = unsafe { get(location.cast_const().cast::<[i32; 2]>()) }?;
            if loc[0] as u32 != LOCATION_TYPE_DEVICE {
                return Err(INVALID_VALUE);
            }
            let f = if loc[1] == p.dev.ordinal {
                3
            } else {
                p.state().access.iter().find(|e| e.0 == loc[1]).map_or(0, |e| e.1)
            };
            // SAFETY: flags is the caller's out-pointer (checked above).
            unsafe { put(flags, f) }
        })
    }
}

/// A stream-ordered allocation from a pool, charged to the pool's device at once.
fn alloc_async(
    dptr: *mut sys::CUdeviceptr,
    bytes: usize,
    pool: Option<sys::CUmemoryPool>,
    stream: sys::CUstream,
    pt: bool,
) -> R {
    need(dptr)?;
    if bytes == 0 {
        return Err(INVALID_VALUE);
    }
    let node = driver()?.node;
    poll_faults(node)?;
    let t = resolve_and_check(stream, pt)?;
    let p = match pool {
        Some(h) => self::pool(h)?,
        None => self::pool(handles::as_ptr(current_pool(t.ctx.dev)))?,
    };
    let d = p.dev;
    let bytes = bytes as u64;
    if let Some(c) = t.capture() {
        // Captured: the allocation becomes a graph allocation node (its address is known now,
        // its memory is taken when the graph runs), as a real driver records it.
        let base = super::graph_mem::reserve_address(bytes)?;
        c.add(Op::MemAlloc { base, bytes, dev: d.ordinal })?;
        // SAFETY: dptr is the caller's out-pointer (checked above).
        return unsafe { put(dptr, base) };
    }
    let now = super::memory::current_epoch(d.gpu);
    let from_reserve = p.on_alloc(bytes, now)?;
    let epoch = match charge(node, d.gpu, d.domain, bytes - from_reserve) {
        Ok(e) => e,
        Err(e) => {
            p.undo_alloc(bytes, from_reserve);
            return Err(e);
        }
    };
    let Some(base) = map_anon(bytes, false) else {
        refund(node, d.gpu, d.domain, bytes - from_reserve, epoch);
        p.undo_alloc(bytes, from_reserve);
        return Err(OUT_OF_MEMORY);
    };
    let a = Alloc { charge: bytes, epoch, ..Alloc::new(base, bytes, MemKind::Pool(p.handle), t.ctx.handle, d) };
    handles::write().mem.insert(base, a);
    // SAFETY: dptr is the caller's out-pointer (checked above).
    unsafe { put(dptr, base) }
}

cuda_exports! {
    fn cuMemAllocAsync(dptr, bytesize, hStream) twin cuMemAllocAsync_ptsz(per_thread) {
        run(|| alloc_async(dptr, bytesize, None, hStream, per_thread))
    }

    fn cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream) twin cuMemAllocFromPoolAsync_ptsz(per_thread) {
        run(|| alloc_async(dptr, bytesize, Some(pool), hStream, per_thread))
    }
}

/// `cuMemFreeAsync`: the memory goes back at once (nothing reads it after the free in stream
/// order, since kernels change no memory here). On a capturing stream, freeing a graph
/// allocation records a free node; outside, it ends a graph allocation as a free node would.
fn free_async(dptr: sys::CUdeviceptr, stream: sys::CUstream, pt: bool) -> R {
    let node = driver()?.node;
    let t = resolve_and_check(stream, pt)?;
    if dptr == 0 {
        return Ok(());
    }
    if let Some(c) = t.capture() {
        super::graph_mem::alloc_node_of(dptr).ok_or(INVALID_VALUE)?;
        return c.add(Op::MemFree { base: dptr });
    }
    if super::graph_mem::is_live(dptr) {
        return super::graph_mem::free(dptr);
    }
    let (a, pool) = {
        let mut reg = handles::write();
        let pool = match reg.mem.get(&dptr).map(|a| a.kind) {
            Some(MemKind::Pool(p)) => p,
            _ => return Err(INVALID_VALUE),
        };
        let a = reg.mem.remove(&dptr).expect("checked above");
        (a, reg.pools.get(&pool).cloned())
    };
    match pool {
        Some(p) => p.free(node, &a),
        // Its pool was destroyed: nothing is kept.
        None => release_keeping(node, &a, 0),
    }
    Ok(())
}

cuda_exports! {
    fn cuMemFreeAsync(dptr, hStream) twin cuMemFreeAsync_ptsz(per_thread) {
        run(|| free_async(dptr, hStream, per_thread))
    }
}
