//! Memory pools of stream-ordered allocation (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`). A
//! pool keeps freed memory in reserve up to its release threshold (CuPy's async pool and
//! PyTorch's `cudaMallocAsync` backend set it to the maximum), and the GPU holds that memory for
//! the process until the driver releases it: at a synchronization above the threshold,
//! `cuMemPoolTrimTo`, or with the pool. Charging each allocation and refunding it at its free
//! would let the process hold its limit in a pool's reserve and its limit again elsewhere, and
//! tesserad, reading the driver's own figures, would kill an honest program for it. So a pool is
//! charged what the driver says it holds (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), as graph
//! pools are (`graph.rs`):
//!
//! - before an allocation from a pool, the charge catches up with the pool's size (the driver may
//!   have released memory since), then the growth the allocation can cause is reserved: its size
//!   less what the pool has free (reserved − used); over the limit, `CUDA_ERROR_OUT_OF_MEMORY`
//!   and the driver is not called. After the call the charge is the pool's size again (more than
//!   reserved, from a fragmented pool: charged anyway, and the next reservations see it);
//! - a free (`cuMemFreeAsync*`, `cuMemFree*`) reads its pool again;
//! - so do `cuMemGetInfo` (and NVML's memory view), a reservation about to be refused (what the
//!   driver released at a synchronization is given back first, never a false
//!   `CUDA_ERROR_OUT_OF_MEMORY`), and a context's destruction or reset. Between those the charge
//!   may be above what the pool holds, never below it.
//!
//! A pool that can no longer be read (destroyed, or gone with its context) with none of our
//! allocations left in it is forgotten and its charge refunded. Where the driver cannot say a
//! pool's size (a driver without `cuMemPoolGetAttribute`), allocations are charged one by one as
//! before. Allocations captured into a graph take nothing from the pool (graph memory is charged
//! at launch, `graph.rs`): the read after the call finds the pool unchanged, and one that would be
//! refused is let through when the stream is capturing.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Mutex, MutexGuard};

use crate::ffi::*;
use crate::real::RealCuda;
use crate::state::ShimState;
use tessera_abi::cuda_exports;
use tessera_region::TraceFunc;

/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`, `CU_MEMPOOL_ATTR_USED_MEM_CURRENT` (cuuint64_t).
const RESERVED_MEM_CURRENT: c_int = 5;
const USED_MEM_CURRENT: c_int = 7;
/// Region devices whose pool charges are summed (`tessera_region`'s device count).
const DEVICES: usize = tessera_region::MAX_DEVICES;

/// What a pool is charged.
#[derive(Debug, Clone, Copy)]
struct Pool {
    /// Region device index.
    dev: usize,
    /// Its reserved size as last read.
    bytes: u64,
    /// Our allocations from it not yet freed.
    live: u64,
}

/// Where a pool's memory lives (`CUmemPoolProps.location`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Home {
    /// A device, by CUDA ordinal.
    Device(c_int),
    /// Host memory (`CU_MEM_LOCATION_TYPE_HOST*`): not the GPU's, not charged.
    Host,
}

#[derive(Default)]
struct Books {
    pools: HashMap<u64, Pool>,
    /// Live allocations from a pool → the pool.
    ptrs: HashMap<u64, u64>,
    /// Each pool's home, from its creation (`cuMemPoolCreate`) or found among the devices' own
    /// pools. A handle the driver reuses is a new pool's, recorded again at its creation.
    homes: HashMap<u64, Home>,
}

thread_local! {
    /// This thread holds the books (a refused reservation inside an allocation must not take
    /// them again).
    static HOLDING: Cell<bool> = const { Cell::new(false) };
}

/// The books, held; marks the thread as holding them.
struct Held<'a>(MutexGuard<'a, Books>);

impl std::ops::Deref for Held<'_> {
    type Target = Books;
    fn deref(&self) -> &Books {
        &self.0
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut Books {
        &mut self.0
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        HOLDING.set(false);
    }
}

pub(crate) struct Pools {
    books: Mutex<Books>,
    /// Whether any pool is charged (the free path's only cost otherwise).
    any: AtomicBool,
    /// Per region device, the pools' charges summed (read without the books by the context
    /// true-up, which counts them as memory the driver holds).
    on_device: [AtomicU64; DEVICES],
}

impl Pools {
    pub(crate) fn new() -> Pools {
        Pools {
            books: Mutex::new(Books::default()),
            any: AtomicBool::new(false),
            on_device: [const { AtomicU64::new(0) }; DEVICES],
        }
    }

    fn lock(&self) -> Held<'_> {
        let g = self.books.lock().unwrap_or_else(|e| e.into_inner());
        HOLDING.set(true);
        Held(g)
    }

    /// What pools are charged on a region device.
    pub(crate) fn charged_on(&self, dev: usize) -> u64 {
        self.on_device.get(dev).map_or(0, |c| c.load(Acquire))
    }

    fn add(&self, dev: usize, bytes: u64) {
        if let Some(c) = self.on_device.get(dev) {
            c.fetch_add(bytes, AcqRel);
        }
    }

    fn sub(&self, dev: usize, bytes: u64) {
        if let Some(c) = self.on_device.get(dev) {
            let _ = c.fetch_update(AcqRel, Acquire, |v| Some(v.saturating_sub(bytes)));
        }
    }
}

/// One cuuint64_t attribute of a pool, as the driver says.
fn attribute(cu: &RealCuda, pool: u64, attr: c_int) -> Option<u64> {
    let get = cu.cuMemPoolGetAttribute?;
    let mut v = 0u64;
    // SAFETY: the attributes asked for are cuuint64_t, written through a valid out-pointer; the
    // handle is one the driver gave (a stale one is refused, not dereferenced by us).
    (unsafe { get(pool as CUmemoryPool, attr, (&raw mut v).cast()) } == CUDA_SUCCESS).then_some(v)
}

/// (used, reserved) of a pool.
fn size_of(cu: &RealCuda, pool: u64) -> Option<(u64, u64)> {
    Some((attribute(cu, pool, USED_MEM_CURRENT)?, reserved_of(cu, pool)?))
}

/// The reserved size of a pool alone (what its charge follows).
fn reserved_of(cu: &RealCuda, pool: u64) -> Option<u64> {
    attribute(cu, pool, RESERVED_MEM_CURRENT)
}

/// Sets a pool's charge to `now` (its reserved size just read; `None`: unreadable), given
/// `pending` bytes reserved beside the charge for the call that just ran. True if anything was
/// refunded.
fn settle(s: &ShimState, b: &mut Books, pool: u64, dev: usize, now: Option<u64>, pending: u64) -> bool {
    let m = &s.mem.pools;
    let p = b.pools.entry(pool).or_insert(Pool { dev, bytes: 0, live: 0 });
    let held = p.bytes + pending;
    let now = match now {
        Some(now) => now,
        // Gone (destroyed, or with its context) and nothing of ours left in it: forgotten.
        None if p.live == 0 => {
            let dev = p.dev;
            b.pools.remove(&pool);
            s.refund(dev, held);
            m.sub(dev, held - pending);
            return held > 0;
        }
        // Unreadable for now: what was reserved stays charged (over, never under).
        None => held,
    };
    if now < held {
        s.refund(p.dev, held - now);
    } else if now > held {
        // The driver took more than reserved for (a fragmented pool grows by more than the
        // allocation): charged anyway, so that the books stay true.
        s.charge_unchecked(p.dev, now - held);
    }
    m.sub(p.dev, p.bytes);
    m.add(p.dev, now);
    p.bytes = now;
    now < held
}

/// The home of `pool`: recorded at its creation, else one of the devices' default or current
/// pools (looked for once). `None`: unknown (the caller charges the stream's device).
pub(crate) fn home(cu: &RealCuda, m: &Pools, pool: u64) -> Option<Home> {
    if let Some(&h) = m.lock().homes.get(&pool) {
        return Some(h);
    }
    let mut count: c_int = 0;
    // SAFETY: a valid out-pointer.
    if unsafe { (cu.cuDeviceGetCount)(&mut count) } != CUDA_SUCCESS {
        return None;
    }
    let of = |f: Option<unsafe extern "C" fn(*mut CUmemoryPool, CUdevice) -> CUresult>, d: c_int| {
        let mut p: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; d is an ordinal below the driver's count.
        f.is_some_and(|f| unsafe { f(&mut p, d) } == CUDA_SUCCESS && p as u64 == pool)
    };
    let d = (0..count).find(|&d| of(cu.cuDeviceGetDefaultMemPool, d) || of(cu.cuDeviceGetMemPool, d))?;
    m.lock().homes.insert(pool, Home::Device(d));
    Some(Home::Device(d))
}

/// The home `cuMemPoolCreate`'s properties give (their head is `CUmemAllocationProp`'s).
fn home_of(props: MemAllocPropHead) -> Home {
    if props.location_type == CU_MEM_LOCATION_TYPE_DEVICE { Home::Device(props.location_id) } else { Home::Host }
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMemPoolCreate`. The pool's home is recorded: its allocations are charged
    /// there whatever stream they are made on (a stream of another device may allocate from it).
    fn cuMemPoolCreate(pool, poolProps) {
        super::alloc::hook(TraceFunc::cuMemPoolCreate, |s, cu| {
            let Some(create) = cu.cuMemPoolCreate else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            let rc = unsafe { create(pool, poolProps) };
            if rc != CUDA_SUCCESS {
                return rc;
            }
            // SAFETY: after a success the driver wrote the handle; poolProps is the caller's
            // CUmemPoolProps (it was read by the driver), whose head this reads.
            if let (Some(p), Some(h)) = unsafe { (get(pool.cast_const()), get(poolProps.cast::<MemAllocPropHead>())) } {
                s.mem.pools.lock().homes.insert(p as u64, home_of(h));
            }
            rc
        })
    }
}

/// Whether `stream` is being captured into a graph (`CU_STREAM_CAPTURE_STATUS_ACTIVE`). Asked
/// only of an allocation that would be refused.
fn capturing(cu: &RealCuda, stream: CUstream) -> bool {
    let Some(is_capturing) = cu.cuStreamIsCapturing else { return false };
    let mut status: std::ffi::c_uint = 0;
    // SAFETY: the caller's stream handle (CU_STREAM_PER_THREAD as the `_ptsz` calls mean their
    // NULL stream); a valid out-pointer.
    unsafe { is_capturing(stream, &mut status) == CUDA_SUCCESS && status == 1 }
}

/// The pool `cuMemAllocAsync` takes from on a stream: its device's current pool.
fn current_pool(s: &ShimState, cu: &RealCuda, stream: CUstream) -> Option<u64> {
    let get_pool = cu.cuDeviceGetMemPool?;
    let ctx = match stream as usize {
        0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD => s.current_context()?.0,
        _ => {
            let mut ctx: CUcontext = std::ptr::null_mut();
            // SAFETY: the caller's stream handle; ctx a valid out-pointer.
            if unsafe { (cu.cuStreamGetCtx)(stream, &mut ctx) } != CUDA_SUCCESS || ctx.is_null() {
                return None;
            }
            ctx
        }
    };
    let ordinal = s.ordinal_of_context(cu, ctx)?;
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    (unsafe { get_pool(&mut pool, ordinal) } == CUDA_SUCCESS && !pool.is_null()).then_some(pool as u64)
}

/// An allocation on `stream` from `pool` (`None`: the stream's device's current pool), on region
/// device `dev`, charged as the pool grows. `None`: the pool's size cannot be read, and the
/// caller charges the allocation by itself.
pub(crate) fn allocate(
    s: &ShimState,
    cu: &RealCuda,
    (dev, stream, pool): (usize, CUstream, Option<CUmemoryPool>),
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    made: impl FnOnce() -> Option<u64>,
) -> Option<CUresult> {
    let pool = match pool {
        Some(p) => p as u64,
        None => current_pool(s, cu, stream)?,
    };
    // A first context still waiting for its true-up is trued up now, while it can still tell its
    // own memory from the pool's.
    super::context::settle(s, dev);
    let m = &s.mem.pools;
    let mut b = m.lock();
    let (used, reserved) = size_of(cu, pool)?;
    m.any.store(true, Release);
    // The driver may have released memory since the last look.
    settle(s, &mut b, pool, dev, Some(reserved), 0);
    let growth = bytes.saturating_sub(reserved.saturating_sub(used));
    crate::trace::note(dev, growth);
    // Refused: the other pools may have released memory since they were read (this thread holds
    // the books, so the refusal path of `reserve` cannot read them): read, then try once more.
    let fits =
        s.reserve_uncounted(dev, growth) || (settle_others(s, cu, &mut b, pool) && s.reserve_uncounted(dev, growth));
    if !fits {
        // Captured into a graph, it takes nothing from the pool now (graph memory is charged when
        // the graph is launched): let the capture record it.
        if capturing(cu, stream) {
            let rc = call();
            settle(s, &mut b, pool, dev, reserved_of(cu, pool), 0);
            return Some(rc);
        }
        s.region.count_oom_denial(s.slot, dev);
        return Some(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let rc = call();
    settle(s, &mut b, pool, dev, reserved_of(cu, pool), growth);
    if rc == CUDA_SUCCESS
        && let Some(p) = made().filter(|&p| p != 0)
    {
        b.ptrs.insert(p, pool);
        if let Some(e) = b.pools.get_mut(&pool) {
            e.live += 1;
        }
    }
    Some(rc)
}

/// After a successful free of `dptr`: if it came from a pool, the pool is read again.
pub(crate) fn freed(s: &ShimState, dptr: u64) {
    let m = &s.mem.pools;
    if !m.any.load(Acquire) {
        return;
    }
    let Some(cu) = crate::real::cuda() else { return };
    let mut b = m.lock();
    let Some(pool) = b.ptrs.remove(&dptr) else { return };
    let Some(p) = b.pools.get_mut(&pool) else { return };
    p.live = p.live.saturating_sub(1);
    let dev = p.dev;
    settle(s, &mut b, pool, dev, reserved_of(cu, pool), 0);
}

/// Reads every charged pool but `except` again, with the books held; true if anything was
/// refunded.
fn settle_others(s: &ShimState, cu: &RealCuda, b: &mut Books, except: u64) -> bool {
    let pools: Vec<(u64, usize)> = b.pools.iter().filter(|(k, _)| **k != except).map(|(&k, p)| (k, p.dev)).collect();
    let mut refunded = false;
    for (pool, dev) in pools {
        refunded |= settle(s, b, pool, dev, reserved_of(cu, pool), 0);
    }
    refunded
}

/// Reads every charged pool again; true if anything was refunded. Skipped (false) on a thread
/// that holds the books: an allocation from a pool has just read its own.
pub(crate) fn settle_all(s: &ShimState) -> bool {
    let m = &s.mem.pools;
    if !m.any.load(Acquire) || HOLDING.get() {
        return false;
    }
    let Some(cu) = crate::real::cuda() else { return false };
    let mut b = m.lock();
    // No pool handle is 0.
    settle_others(s, cu, &mut b, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holding_the_books_is_per_thread_and_ends_with_the_guard() {
        let m = Pools::new();
        {
            let _b = m.lock();
            assert!(HOLDING.get());
            std::thread::spawn(|| assert!(!HOLDING.get())).join().unwrap();
        }
        assert!(!HOLDING.get());
        m.add(1, 10);
        m.sub(1, 4);
        m.sub(1, 100);
        assert_eq!(m.charged_on(1), 0, "never below zero");
        assert_eq!(m.charged_on(DEVICES + 3), 0, "a device past the table counts nothing");
    }
}
