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
//!
//! A process's first context on a device, made while NVML is not yet loaded (loading and
//! initializing it is most of a process's start-up cost through the shim), is trued up later
//! instead: see [`Deferred`].

use std::ffi::{c_int, c_uint};
use std::sync::Mutex;
use std::sync::atomic::Ordering::*;
use std::sync::atomic::{AtomicBool, AtomicU64};

use super::alloc::hook;
use super::{Charge, Kind};
use crate::ffi::*;
use crate::real::{self, RealCuda};
use crate::state::ShimState;
use tessera_abi::cuda_exports;
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

/// Reserves the estimate for a new context on `dev` (see [`estimate`]); returns what was
/// reserved, or `None` when not even that fits.
///
/// A hint above [`DEFAULT_ESTIMATE`] that does not fit is tried again at the default: the hint is
/// the container's to write and a measurement can be wrong (memory a process allocated around
/// the shim, read as its context's), so an inflated hint never makes every later context of the
/// container unobtainable; the true-up that follows charges the context what it measures and
/// publishes the true figure again.
fn reserve_estimate(s: &ShimState, dev: usize) -> Option<u64> {
    let first = estimate(s.region.context_hint(dev));
    if first <= DEFAULT_ESTIMATE {
        return s.reserve(dev, first).then_some(first);
    }
    // The first try's refusal is not counted as an OOM denial: the second may fit.
    if s.reserve_uncounted(dev, first) {
        return Some(first);
    }
    s.reserve(dev, DEFAULT_ESTIMATE).then_some(DEFAULT_ESTIMATE)
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
    fn for_device(ctx: Option<CUcontext>, ordinal: c_int) -> Probe {
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
    let mut m = tessera_abi::nvml::nvmlMemory_t { total: 0, free: 0, used: 0 };
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
        // SAFETY: list has room for n entries (our mirror of the header's v1 entry); n a valid in/out
        // count.
        match unsafe { (nvml.nvmlDeviceGetComputeRunningProcesses)(h, &mut n, list.as_mut_ptr().cast()) } {
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
/// result and, on success, the context), measures its overhead and trues the charge up to it
/// (for a process's first context on the device while NVML is not loaded yet: later, see
/// [`Deferred`]).
/// Over the limit (before, or after when it took more than estimated), the answer is
/// `CUDA_ERROR_OUT_OF_MEMORY`; `undo` destroys a context made meanwhile. The caller holds the
/// lifecycle lock.
fn charge_creation(
    s: &'static ShimState,
    cu: &RealCuda,
    ordinal: c_int,
    create: impl FnOnce() -> (CUresult, Option<CUcontext>),
    undo: impl FnOnce(CUcontext),
    primary: bool,
) -> CUresult {
    let Some(dev) = s.device_of_ordinal(ordinal) else {
        // A device the region has no entry for (filled or garbled by the container): with limits
        // to hold, no context on it, so nothing is allocated there uncounted (fail closed).
        if s.configured && s.unmappable(ordinal) {
            return CUDA_ERROR_NOT_PERMITTED;
        }
        return create().0;
    };
    // One still waiting for its true-up goes first: the readings below would count it too.
    settle(s, dev);
    let idle = s.held(dev) == 0;
    let ours = s.mem.contexts.find(|c| c.dev == dev).map(|(k, _)| k as CUcontext);
    if idle
        && ours.is_none()
        && primary
        && let Some(size) = super::context_size::for_primary(s, cu, dev, ordinal)
    {
        return super::context_size::create(s, dev, ordinal, size, create);
    }
    let Some(reserved) = reserve_estimate(s, dev) else { return CUDA_ERROR_OUT_OF_MEMORY };
    if idle && ours.is_none() && real::nvml_ready().is_none() {
        return create_deferred(s, Pending { ctx: 0, dev, ordinal, reserved }, create, primary);
    }
    let probe = Probe::for_device(ours, ordinal);
    // Each reading counts only while the books are still (nothing of ours being made or freed,
    // and, for a free-memory reading, the container's total unmoved) before and after it: an
    // allocation landing, or a free returning memory, between the two readings would otherwise
    // be taken for the context (a free made a context read as nothing: uncharged).
    let still = || Still::now(s, dev, reserved);
    let (quiet, before) = (still(), probe.read(cu));
    let quiet = quiet.filter(|q| still().is_some_and(|n| n.same_books(q)));
    let (rc, ctx) = create();
    let Some(ctx) = ctx.filter(|_| rc == CUDA_SUCCESS) else {
        s.refund(dev, reserved);
        return rc;
    };
    made(s, ctx, ordinal, primary);
    let (quiet_after, after) = (still(), probe.read(cu));
    let same = |n: Option<Still>| n.zip(quiet).is_some_and(|(n, q)| n.same_books(&q));
    let unmoved = same(quiet_after) && same(still());
    let measured = match (before, after) {
        (Reading { own: Some(b), .. }, Reading { own: Some(a), .. }) if a > 0 && unmoved => Some(a.saturating_sub(b)),
        (Reading { free: Some(b), .. }, Reading { free: Some(a), .. })
            if unmoved && quiet.is_some_and(|q| q.container_unmoved(s, dev)) =>
        {
            Some(b.saturating_sub(a))
        }
        _ => None,
    };
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

/// This process's books on a device at a still moment: everything it holds there is made
/// (landed allocations and contexts' charges, plus `pending`, the reservation of the context
/// being made), so nothing of ours is reserved but not yet made or being freed; and the
/// container's total there then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Still {
    held: u64,
    landed: u64,
    container: u64,
}

impl Still {
    fn now(s: &ShimState, dev: usize, pending: u64) -> Option<Still> {
        let held = s.held(dev);
        let landed = landed(s, dev);
        let contexts = s.mem.contexts.total_where(|c| c.dev == dev);
        (held == landed + contexts + pending).then(|| Still { held, landed, container: s.region.used(dev) })
    }

    /// Nothing of this process's moved between the two moments.
    fn same_books(&self, other: &Still) -> bool {
        (self.held, self.landed) == (other.held, other.landed)
    }

    /// The container's total is what it was (its other processes neither took nor gave back
    /// memory on the device): a free-memory reading may count for the context.
    fn container_unmoved(self, s: &ShimState, dev: usize) -> bool {
        s.region.used(dev) == self.container
    }
}

/// A context the driver just made: its device remembered, and a primary context's handle.
pub(super) fn made(s: &ShimState, ctx: CUcontext, ordinal: c_int, primary: bool) {
    s.remember_context(ctx, ordinal);
    if !primary {
        // cuCtxCreate makes the new context current on this thread.
        crate::current::forget_this_thread();
    }
    if primary && let Some(p) = s.mem.primaries.get(ordinal as usize) {
        p.store(ctx as u64, Release);
    }
}

// ---- The true-up, deferred -------------------------------------------------------------------
//
// Why this design. Measuring a process's first context needs NVML (its process list: the
// context is the first thing of ours on the device), and loading and initializing NVML is most
// of what the shim adds to a process's start-up. The reservation made before the context was
// created already keeps the limit exact: the estimate is meant to be at least what a context
// takes (the container's last measurement, or more than any current driver's), so while it
// stands the container is charged more than the GPU holds, not less. (Where a context took
// more, the deferred true-up charges the rest, which the driver holds already: unlike the
// on-the-spot one it can no longer refuse the context, and later reservations are refused until
// the container is under its limit again.) Giving the excess back can wait; until it is given
// back the only harm is that the excess looks used. So the first context is
// created at once and its true-up deferred to whichever comes first:
// - a helper thread, started at `cuInit` to load NVML while the driver initializes (where NVML
//   is ready by the time the context is made, the true-up is done at once as above), and again
//   when a context starts waiting: the daemon's view is right soon after;
// - a reservation that would otherwise be refused on the device (`ShimState::reserve` trues up,
//   then tries once more): the excess never causes a false `CUDA_ERROR_OUT_OF_MEMORY`;
// - `cuMemGetInfo`, whose answer the excess would change; and another context on the device.
// Never a deadlock: nobody waits for the helper (NVML is loaded outside any once-cell, so a
// thread holding the loader lock, say in a constructor that starts CUDA, loads it itself), NVML
// is never loaded under the waiting list's lock, the true-up takes no other lock of ours but a
// charge map's shard and the physical allocations' books (never the lifecycle lock; no holder of
// those waits for the list), and it adds a shortfall unchecked, never through `reserve` again.
// A `fork`ed child starts over with a state of its own, helper flag included. A process killed
// before its true-up holds its estimate in its region slot until the slot is reaped, like any
// other charge of a dead process.
//
// The measurement: the context was this process's first on the device and nothing was held
// there before it, so NVML's figure for this process less what its allocations made since hold
// is the context's; see [`true_up`] for why it can only err upwards. Anything the driver took for
// the program meanwhile without an allocation of ours (modules' code, say) lands in the
// context's charge: the GPU holds it. Where NVML does not list this process (a PID
// namespace), nothing is measured and the estimate stays, as it would have on the spot had the
// free-memory reading been unavailable; the `cuInit` warm-up makes that case rare with a real
// driver, whose `cuInit` takes far longer than NVML's load.

/// A context whose true-up waits for NVML.
#[derive(Clone, Copy)]
struct Pending {
    ctx: u64,
    dev: usize,
    ordinal: c_int,
    /// What was reserved for it.
    reserved: u64,
}

/// The contexts whose true-up waits (at most one per device: a later context on the device
/// trues up the waiting one first), and the helper thread that trues them up.
pub(crate) struct Deferred {
    waiting: Mutex<Vec<Pending>>,
    /// Whether `waiting` may hold any (the one load a reservation's refusal path pays).
    any: AtomicBool,
    /// A helper thread is running; it looks at `arrivals` again before it ends.
    helper: AtomicBool,
    /// How many contexts have begun waiting, ever.
    arrivals: AtomicU64,
}

impl Deferred {
    pub(crate) fn new() -> Deferred {
        Deferred {
            waiting: Mutex::new(Vec::new()),
            any: AtomicBool::new(false),
            helper: AtomicBool::new(false),
            arrivals: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Pending>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops a destroyed context's wait (its charge went with it).
    fn forget(&self, ctx: usize) {
        if self.any.load(SeqCst) {
            let mut w = self.lock();
            w.retain(|p| p.ctx != ctx as u64);
            self.any.store(!w.is_empty(), SeqCst);
        }
    }
}

/// Creates a process's first context on a device with its estimate reserved, and leaves the
/// true-up to the helper thread (or to whatever needs it first).
fn create_deferred(
    s: &'static ShimState,
    mut p: Pending,
    create: impl FnOnce() -> (CUresult, Option<CUcontext>),
    primary: bool,
) -> CUresult {
    let (rc, ctx) = create();
    let Some(ctx) = ctx.filter(|_| rc == CUDA_SUCCESS) else {
        s.refund(p.dev, p.reserved);
        return rc;
    };
    made(s, ctx, p.ordinal, primary);
    p.ctx = ctx as u64;
    s.mem.contexts.insert(p.ctx, Charge { dev: p.dev, bytes: p.reserved, ctx: ctx as usize, kind: Kind::Context });
    {
        let mut w = s.mem.deferred.lock();
        w.push(p);
        s.mem.deferred.any.store(true, SeqCst);
        s.mem.deferred.arrivals.fetch_add(1, SeqCst);
    }
    start_helper(s);
    rc
}

/// At `cuInit` in a process with limits: NVML starts loading on the helper thread, so that it is
/// ready (and the first context measured on the spot) by the time the program makes a context.
pub(crate) fn warm_up(s: &'static ShimState) {
    start_helper(s);
}

/// Starts the helper thread unless one is running. If no thread can be started (a pids limit),
/// the true-ups wait for the other occasions.
fn start_helper(s: &'static ShimState) {
    let d = &s.mem.deferred;
    if d.helper.swap(true, SeqCst) {
        return;
    }
    let spawned = std::thread::Builder::new().name("tessera-true-up".into()).spawn(move || helper(s));
    if spawned.is_err() {
        d.helper.store(false, SeqCst);
    }
}

/// Loads NVML, trues up every waiting context (one whose device stays busy is tried again after
/// 1, 4, 16, 64 and 256 ms, then left to the other occasions), and ends, unless one began waiting
/// meanwhile. (At the program's own priority: it takes the loader lock and the waiting list's
/// lock, which the program's threads may need.)
fn helper(s: &'static ShimState) {
    let d = &s.mem.deferred;
    loop {
        let seen = d.arrivals.load(SeqCst);
        if real::cuda_ready().is_some() {
            let _ = real::nvml_initialized();
        }
        settle_all(s);
        for ms in [1, 4, 16, 64, 256] {
            if !d.any.load(SeqCst) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(ms));
            settle_all(s);
        }
        d.helper.store(false, SeqCst);
        // A context that began waiting after the look above found the flag still set.
        if d.arrivals.load(SeqCst) == seen || d.helper.swap(true, SeqCst) {
            return;
        }
    }
}

/// Trues up the context waiting on `dev`, if any (NVML loaded now if need be). True if any
/// context was waiting when called: the device's charges may have changed since the caller
/// looked (here, or on another thread that held the list meanwhile), so a refused reservation is
/// worth trying again. A concurrent caller for the same device waits for the first one's
/// true-up to be done.
pub(crate) fn settle(s: &ShimState, dev: usize) -> bool {
    let d = &s.mem.deferred;
    if !d.any.load(SeqCst) {
        return false;
    }
    // Loaded before the lock is taken, never under it: a thread waiting for the lock may hold
    // the loader lock (a constructor that allocates).
    let _ = real::nvml_initialized();
    let mut w = d.lock();
    if let Some(p) = w.iter().find(|p| p.dev == dev).copied()
        && true_up(s, p)
    {
        w.retain(|q| q.ctx != p.ctx);
        d.any.store(!w.is_empty(), SeqCst);
    }
    true
}

/// Trues up every waiting context it can (those whose device stays busy wait for a later
/// occasion).
fn settle_all(s: &ShimState) {
    let d = &s.mem.deferred;
    if !d.any.load(SeqCst) {
        return;
    }
    let mut w = d.lock();
    w.retain(|&p| !true_up(s, p));
    d.any.store(!w.is_empty(), SeqCst);
}

/// What this process's allocations that the driver has made hold on a device (linear ones as
/// the driver holds them, [`super::granularity`]): charges recorded
/// after the driver's call returned and removed before the free is called (physical
/// allocations: under the lock of the driver's calls), so the driver holds at least this much
/// for them at any instant. (Linear, managed, memory pools, arrays, physical and contexts'
/// raised limits ([`super::ctx_limits`]); a graph pool's
/// charge makes [`true_up`] wait, never guess, which is why a graph launch that maps memory
/// settles the waiting context first: `graph::mapping`.)
fn landed(s: &ShimState, dev: usize) -> u64 {
    let on = |c: &Charge| c.dev == dev;
    s.mem.ptrs.total_where(on)
        + s.mem.chunks.charged_on(dev)
        + s.mem.arrays.total_where(on)
        + s.mem.vmm.charged_on(dev)
        + s.mem.limits.charged_on(dev)
        + s.mem.pools.charged_on(dev)
}

/// Sets a waiting context's charge to what it measures now (see the design note above); false
/// when it could not measure yet because the device's charges kept moving or include some not
/// yet made by the driver (then it stays waiting, its estimate charged).
///
/// The reading is NVML's figure for this process on the device, less what its allocations
/// there have landed: NVML counts at least that for them, so the remainder is at least the
/// context's, never less (never an under-charge). It counts only when this process's own tally
/// on the device is exactly the context's charge plus the landed allocations before and after
/// it (nothing reserved but not yet made, nothing being freed, nothing of another kind) and
/// neither moved meanwhile.
fn true_up(s: &ShimState, p: Pending) -> bool {
    let Some(h) = real::nvml_initialized().and_then(|_| nvml_device(p.ordinal)) else { return true };
    for _ in 0..16 {
        let Some(c) = s.mem.contexts.get(p.ctx).filter(|c| c.dev == p.dev && c.kind == Kind::Context) else {
            return true;
        };
        let (held, landed_before, heap) = (s.held(p.dev), landed(s, p.dev), s.mem.limits.heap_on(p.dev));
        if held != c.bytes + landed_before {
            std::thread::yield_now();
            continue;
        }
        let Some(own) = own_usage(h) else { return true };
        if s.held(p.dev) != held || landed(s, p.dev) != landed_before || s.mem.limits.heap_on(p.dev) != heap {
            std::thread::yield_now();
            continue;
        }
        // Not listed under our pid (a PID namespace): unmeasurable, the estimate stays.
        if own == 0 {
            return true;
        }
        // A raised heap is charged from its set, but the driver takes it at a module load: not
        // counted as the driver's, so a context measured before the load is not charged less by
        // it (measured after, more: on the limit's side).
        apply(s, p, c.bytes, own.saturating_sub(landed_before.saturating_sub(heap)));
        return true;
    }
    false
}

/// Changes a waiting context's charge from `charged` to `overhead`.
fn apply(s: &ShimState, p: Pending, charged: u64, overhead: u64) {
    // More than reserved: the driver holds it already, so the charge must say so (and later
    // reservations are refused until it fits again). Charged before the figure changes, so a
    // concurrent destruction refunds no more than was charged.
    if overhead > charged {
        s.charge_unchecked(p.dev, overhead - charged);
    }
    match s.mem.contexts.set_bytes(p.ctx, overhead) {
        Some(old) if overhead < old.bytes => s.refund(p.dev, old.bytes - overhead),
        Some(_) => {}
        // Destroyed meanwhile: its refund was the old figure.
        None if overhead > charged => return s.refund(p.dev, overhead - charged),
        None => return,
    }
    // Published only when not above what was reserved for it: this figure is NVML's for the
    // whole process, so memory it allocated around the shim (a raw `cuMemAlloc` of the driver's)
    // reads as its context's. Charged to the process (the GPU holds it), it must not become the
    // estimate of every later context of the container (a killed offender's 1 GiB left every
    // honest process of a 1 GiB share with `CUDA_ERROR_OUT_OF_MEMORY` at its context). A context
    // that really takes more is published by an on-the-spot measurement, which brackets the
    // creation alone.
    if overhead > 0 && overhead <= p.reserved {
        s.region.set_context_hint(p.dev, overhead);
    }
}

/// A context is gone: refund its overhead and everything allocated in it that died with it.
fn context_gone(s: &ShimState, ctx: usize, overhead_too: bool) {
    // Its streams died with it; their handles may come back for streams on another device.
    s.forget_all_streams();
    // Any thread that had it current has a stale view of its current context.
    crate::current::forget_every_thread();
    if overhead_too {
        if let Some(c) = s.mem.contexts.remove(ctx as u64) {
            s.refund(c.dev, c.bytes);
        }
        s.mem.deferred.forget(ctx);
        s.forget_context(ctx as CUcontext);
    }
    let dead = |c: &Charge| c.ctx == ctx && c.kind.dies_with_context();
    for (_, c) in s.mem.ptrs.drain_where(dead).into_iter().chain(s.mem.arrays.drain_where(dead)) {
        s.refund(c.dev, c.bytes);
    }
    for (dev, bytes) in s.mem.chunks.context_gone(ctx) {
        s.refund(dev, bytes);
    }
    // Its limits are back at their defaults (a reset) or gone with it.
    for (dev, bytes) in s.mem.limits.take_context(ctx) {
        s.refund(dev, bytes);
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
    s: &'static ShimState,
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

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuCtxCreate_v2`.
    fn cuCtxCreate_v2(pctx, flags, dev) {
        hook(TraceFunc::cuCtxCreate_v2, |s, cu| {
            // SAFETY: the caller's arguments, passed on unchanged.
            create_regular(s, cu, pctx, dev, || unsafe { (cu.cuCtxCreate_v2)(pctx, flags, dev) })
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuCtxCreate`.
    fn cuCtxCreate(pctx, flags, dev) {
        hook(TraceFunc::cuCtxCreate, |s, cu| {
            // SAFETY: the caller's arguments, passed on unchanged.
            create_regular(s, cu, pctx, dev, || unsafe { (cu.cuCtxCreate)(pctx, flags, dev) })
        })
    }

    /// # Safety
    /// As cuda.h's `cuCtxCreate_v3` (execution-affinity parameters).
    fn cuCtxCreate_v3(pctx, paramsArray, numParams, flags, dev) {
        hook(TraceFunc::cuCtxCreate_v3, |s, cu| {
            let Some(f) = cu.cuCtxCreate_v3 else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            create_regular(s, cu, pctx, dev, || unsafe { f(pctx, paramsArray, numParams, flags, dev) })
        })
    }

    /// # Safety
    /// As cuda.h's `cuCtxCreate_v4` (creation parameters).
    fn cuCtxCreate_v4(pctx, ctxCreateParams, flags, dev) {
        hook(TraceFunc::cuCtxCreate_v4, |s, cu| {
            let Some(f) = cu.cuCtxCreate_v4 else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            create_regular(s, cu, pctx, dev, || unsafe { f(pctx, ctxCreateParams, flags, dev) })
        })
    }
}

fn destroy(s: &ShimState, cu: &RealCuda, ctx: CUcontext, call: impl FnOnce() -> CUresult) -> CUresult {
    let _g = s.mem.lifecycle();
    let rc = call();
    if rc == CUDA_SUCCESS && !ctx.is_null() {
        context_gone(s, ctx as usize, true);
        super::graph::settle_pools(s, cu);
        super::pools::settle_all(s);
    }
    rc
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuCtxDestroy_v2`.
    fn cuCtxDestroy_v2(ctx) {
        // SAFETY: the caller's argument, passed on unchanged.
        hook(TraceFunc::cuCtxDestroy_v2, |s, cu| destroy(s, cu, ctx, || unsafe { (cu.cuCtxDestroy_v2)(ctx) }))
    }

    /// # Safety
    /// As cuda.h's legacy `cuCtxDestroy`.
    fn cuCtxDestroy(ctx) {
        // SAFETY: the caller's argument, passed on unchanged.
        hook(TraceFunc::cuCtxDestroy, |s, cu| destroy(s, cu, ctx, || unsafe { (cu.cuCtxDestroy)(ctx) }))
    }

    // ---- Primary contexts ------------------------------------------------------------------------

    /// # Safety
    /// As cuda.h's `cuDevicePrimaryCtxRetain`.
    fn cuDevicePrimaryCtxRetain(pctx, dev) {
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
        super::pools::settle_all(s);
    }
    rc
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuDevicePrimaryCtxRelease_v2`.
    fn cuDevicePrimaryCtxRelease_v2(dev) {
        hook(TraceFunc::cuDevicePrimaryCtxRelease_v2, |s, cu| {
            // SAFETY: the caller's argument, passed on unchanged.
            release(s, cu, dev, || unsafe { (cu.cuDevicePrimaryCtxRelease_v2)(dev) })
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuDevicePrimaryCtxRelease`.
    fn cuDevicePrimaryCtxRelease(dev) {
        hook(TraceFunc::cuDevicePrimaryCtxRelease, |s, cu| {
            // SAFETY: the caller's argument, passed on unchanged.
            release(s, cu, dev, || unsafe { (cu.cuDevicePrimaryCtxRelease)(dev) })
        })
    }
}

fn reset(s: &ShimState, cu: &RealCuda, dev: CUdevice, call: impl FnOnce() -> CUresult) -> CUresult {
    let _g = s.mem.lifecycle();
    let rc = call();
    if rc == CUDA_SUCCESS {
        primary_after(s, cu, dev, true);
        super::graph::settle_pools(s, cu);
        super::pools::settle_all(s);
    }
    rc
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuDevicePrimaryCtxReset_v2`.
    fn cuDevicePrimaryCtxReset_v2(dev) {
        hook(TraceFunc::cuDevicePrimaryCtxReset_v2, |s, cu| {
            // SAFETY: the caller's argument, passed on unchanged.
            reset(s, cu, dev, || unsafe { (cu.cuDevicePrimaryCtxReset_v2)(dev) })
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuDevicePrimaryCtxReset`.
    fn cuDevicePrimaryCtxReset(dev) {
        // SAFETY: the caller's argument, passed on unchanged.
        hook(TraceFunc::cuDevicePrimaryCtxReset, |s, cu| reset(s, cu, dev, || unsafe { (cu.cuDevicePrimaryCtxReset)(dev) }))
    }
}
