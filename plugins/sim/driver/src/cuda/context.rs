//! Contexts: regular (`cuCtxCreate*`) and primary (`cuDevicePrimaryCtx*`), the per-thread stack
//! of current contexts, limits and flags, and what a device fault does to them.
//!
//! A context charges `Node::context_overhead_bytes()` to its device's memory domain when created
//! and marks `Node::context_opened` for its execution unit; raising its stack, printf FIFO or
//! malloc heap limit charges what the driver would reserve for them (`limits.rs`);
//! destroying it frees everything it holds (streams, events, modules, allocations) and refunds
//! the charge.
//!
//! A primary context keeps one handle for the device's life in the process: released to zero or
//! reset, it is torn down and comes back fresh on the next retain (a retained handle stays valid
//! across a reset, as the real driver keeps it).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, MutexGuard};

use tessera_abi::cuda_exports;
use tessera_sim_model::{MAX_GPUS, Node, StreamId};

use super::errors::{Cu, poll_faults};
use super::handles::{self, Registry};
use super::init::{Device, driver};
use super::{CUresult, INVALID_CONTEXT, INVALID_HANDLE, INVALID_VALUE, R, need, put, put_opt, run, sys};

/// Flags `cuCtxCreate` accepts (`CU_CTX_FLAGS_MASK`), and the scheduling ones among them.
const CTX_FLAGS_MASK: c_uint = 0xFF;
const CTX_SCHED_MASK: c_uint = 0x07;
/// `CU_CTX_MAP_HOST`: always on since CUDA 3.2; reported as set.
const CTX_MAP_HOST: c_uint = 0x08;

pub(crate) struct Ctx {
    pub handle: usize,
    pub dev: &'static Device,
    pub primary: bool,
    pub flags: AtomicU32,
    /// Torn down (a destroyed context, or a primary context not retained).
    pub active: AtomicBool,
    /// Bumped each time a primary context comes back, so per-thread streams of an earlier life
    /// are not reused.
    pub generation: AtomicU64,
    /// A sticky error (a `CUresult` value; 0: none), set when a reset destroyed the context.
    pub poison: AtomicU32,
    /// Overhead charged, and the epoch of the charge.
    pub charged: AtomicU64,
    pub epoch: AtomicU64,
    /// Model stream of the legacy default stream + 1 (0: not opened yet).
    pub legacy: AtomicU32,
    /// Per-thread default streams: (thread id, model stream).
    pub ptds: Mutex<Vec<(u64, StreamId)>>,
    pub limits: Mutex<super::limits::Limits>,
    pub cache_config: AtomicI32,
    pub peers: Mutex<Vec<usize>>,
    /// Context-local storage (the runtime's per-context state), see [`storage_put`].
    pub storage: Mutex<Vec<Stored>>,
}

/// A destructor the runtime registers with a stored value: called with the context, the key and
/// the value when the context is torn down.
pub(crate) type StorageDtor = extern "C" fn(sys::CUcontext, *mut c_void, *mut c_void);

/// One value of context-local storage.
pub(crate) struct Stored {
    key: usize,
    value: usize,
    dtor: Option<StorageDtor>,
}

/// Primary-context bookkeeping of a device.
#[derive(Default)]
pub(crate) struct Primary {
    pub ctx: Option<Arc<Ctx>>,
    pub refs: u32,
    pub flags: c_uint,
}

impl Ctx {
    fn new(dev: &'static Device, primary: bool, flags: c_uint) -> Ctx {
        Ctx {
            handle: handles::new_handle(),
            dev,
            primary,
            flags: AtomicU32::new(flags),
            active: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            poison: AtomicU32::new(0),
            charged: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            legacy: AtomicU32::new(0),
            ptds: Mutex::new(Vec::new()),
            limits: Mutex::new(super::limits::Limits::defaults()),
            cache_config: AtomicI32::new(0),
            peers: Mutex::new(Vec::new()),
            storage: Mutex::new(Vec::new()),
        }
    }

    /// Fails unless the context can take new work: alive, not destroyed by a fault, its GPU on
    /// the bus (`DEVICE_UNAVAILABLE` when it is not).
    pub(crate) fn check(&self, node: &Node) -> R {
        self.check_state()?;
        if node.is_lost(self.dev.gpu) { Err(CUresult::CUDA_ERROR_DEVICE_UNAVAILABLE) } else { Ok(()) }
    }

    /// As [`Ctx::check`], for waiting on work already queued (`LAUNCH_FAILED` on a lost GPU).
    pub(crate) fn check_sync(&self, node: &Node) -> R {
        self.check_state()?;
        if node.is_lost(self.dev.gpu) { Err(CUresult::CUDA_ERROR_LAUNCH_FAILED) } else { Ok(()) }
    }

    /// Fails unless the context is alive and not destroyed by a fault (its GPU may be lost).
    pub(crate) fn check_state(&self) -> R {
        if !self.active.load(Acquire) {
            return Err(CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED);
        }
        match self.poison.load(Acquire) {
            0 => Ok(()),
            c => Err(super::errors::from_code(c).unwrap_or(CUresult::CUDA_ERROR_UNKNOWN)),
        }
    }

    /// The model stream of the context's legacy default stream, opened on first use.
    pub(crate) fn legacy_stream(&self, node: &Node) -> R<StreamId> {
        match self.legacy.load(Acquire) {
            0 => {}
            s => return Ok(StreamId(s - 1)),
        }
        let _g = self.ptds.lock().unwrap_or_else(|e| e.into_inner());
        if let s @ 1.. = self.legacy.load(Acquire) {
            return Ok(StreamId(s - 1));
        }
        let sid = node.stream_create(self.dev.gpu, self.dev.unit, 0).work()?;
        self.legacy.store(sid.0 + 1, Release);
        Ok(sid)
    }

    /// The model stream of this thread's per-thread default stream, opened on first use.
    pub(crate) fn per_thread_stream(&self, node: &Node) -> R<StreamId> {
        let generation = self.generation.load(Acquire);
        let found =
            PTDS.try_with(|c| c.borrow().entries.iter().find(|e| e.0 == self.handle && e.1 == generation).map(|e| e.2));
        // Past the thread's end (exit handlers) nothing is cached: the stream is the context's.
        let found = found.ok().flatten();
        if let Some(sid) = found {
            return Ok(sid);
        }
        let sid = node.stream_create(self.dev.gpu, self.dev.unit, 0).work()?;
        let tid = thread_id();
        self.ptds.lock().unwrap_or_else(|e| e.into_inner()).push((tid, sid));
        let _ = PTDS.try_with(|c| {
            let mut c = c.borrow_mut();
            c.tid = tid;
            c.entries.retain(|e| e.0 != self.handle);
            c.entries.push((self.handle, generation, sid));
        });
        Ok(sid)
    }

    /// Model streams of the context's default streams opened so far.
    pub(crate) fn default_streams(&self) -> Vec<StreamId> {
        let mut out: Vec<StreamId> = self.ptds.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|p| p.1).collect();
        if let s @ 1.. = self.legacy.load(Acquire) {
            out.push(StreamId(s - 1));
        }
        out
    }
}

// ---- Per-thread state ------------------------------------------------------------------------

static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

/// This thread's per-thread default streams; they are closed when the thread exits.
#[derive(Default)]
struct PtdsCache {
    tid: u64,
    /// (context handle, context generation, model stream).
    entries: Vec<(usize, u64, StreamId)>,
}

impl Drop for PtdsCache {
    fn drop(&mut self) {
        let Ok(d) = driver() else { return };
        for &(ctx, _, sid) in &self.entries {
            let owned = {
                let reg = handles::read();
                reg.ctxs.get(&ctx).is_some_and(|c| {
                    let mut list = c.ptds.lock().unwrap_or_else(|e| e.into_inner());
                    let pos = list.iter().position(|p| p.0 == self.tid && p.1 == sid);
                    pos.map(|i| list.remove(i)).is_some()
                })
            };
            // Whoever takes the entry out of the context's list closes the stream, exactly once.
            if owned {
                d.node.stream_destroy(sid);
            }
        }
    }
}

thread_local! {
    /// The thread's stack of current contexts (handles), top last.
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    static PTDS: RefCell<PtdsCache> = RefCell::new(PtdsCache::default());
    static TID: u64 = NEXT_THREAD.fetch_add(1, Relaxed);
}

fn thread_id() -> u64 {
    TID.with(|t| *t)
}

/// Runs `f` on this thread's stack of current contexts; `None` once the thread's locals are gone
/// (in exit handlers, where runtimes release their contexts).
fn with_stack<T>(f: impl FnOnce(&mut Vec<usize>) -> T) -> Option<T> {
    STACK.try_with(|s| f(&mut s.borrow_mut())).ok()
}

/// The handle of this thread's current context, if any.
pub(crate) fn current_handle() -> Option<usize> {
    with_stack(|s| s.last().copied()).flatten()
}

/// This thread's current context, looked up in a registry already locked.
pub(crate) fn current_in(reg: &Registry) -> R<&Arc<Ctx>> {
    let h = current_handle().ok_or(INVALID_CONTEXT)?;
    reg.ctxs.get(&h).ok_or(INVALID_CONTEXT)
}

/// This thread's current context.
pub(crate) fn current() -> R<Arc<Ctx>> {
    current_in(&handles::read()).cloned()
}

/// A context by handle (a null handle: the current one).
pub(crate) fn by_handle(h: sys::CUcontext) -> R<Arc<Ctx>> {
    if h.is_null() {
        return current();
    }
    handles::read().ctxs.get(&(h as usize)).cloned().ok_or(INVALID_CONTEXT)
}

// ---- Faults ----------------------------------------------------------------------------------

/// Live contexts per (GPU, execution unit): the model's context mark is cleared with the last.
static UNIT_CONTEXTS: Mutex<Option<HashMap<(u32, usize), u32>>> = Mutex::new(None);

fn unit_contexts() -> MutexGuard<'static, Option<HashMap<(u32, usize), u32>>> {
    UNIT_CONTEXTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A reset destroyed this process's contexts on some GPU (the model cleared their marks and
/// freed their memory): find which GPUs, start a new memory epoch there, and mark their
/// contexts destroyed with `err`.
pub(crate) fn on_reset(node: &Node, err: CUresult) {
    let reg = handles::read();
    let mut reset = [false; MAX_GPUS];
    for ctx in reg.ctxs.values() {
        let d = ctx.dev;
        if ctx.active.load(Acquire)
            && ctx.poison.load(Acquire) == 0
            && node.own_context_units(d.gpu) & (1 << d.unit) == 0
        {
            reset[d.gpu as usize] = true;
        }
    }
    for (gpu, r) in reset.iter_mut().enumerate() {
        let gpu32 = gpu as u32;
        if super::memory::charged_on(gpu32) > 0
            && (0..=tessera_sim_model::MAX_MIG).all(|d| node.own_usage(gpu32, d) == 0)
        {
            *r = true;
        }
    }
    for (gpu, _) in reset.iter().enumerate().filter(|r| *r.1) {
        super::memory::forget_gpu(gpu as u32);
        if let Some(m) = unit_contexts().as_mut() {
            m.retain(|k, _| k.0 != gpu as u32);
        }
    }
    for ctx in reg.ctxs.values() {
        if reset[ctx.dev.gpu as usize] && ctx.active.load(Acquire) {
            ctx.poison.store(err as u32, Release);
        }
    }
}

// ---- Life cycle ------------------------------------------------------------------------------

/// Brings a context to life: charges its overhead and marks it in the model.
fn activate(node: &Node, ctx: &Ctx) -> R {
    let d = ctx.dev;
    node.check_gpu(d.gpu).work()?;
    let overhead = node.context_overhead_bytes();
    let epoch = super::memory::charge(node, d.gpu, d.domain, overhead)?;
    if let Err(e) = node.context_opened(d.gpu, d.unit).work() {
        super::memory::refund(node, d.gpu, d.domain, overhead, epoch);
        return Err(e);
    }
    *unit_contexts().get_or_insert_with(HashMap::new).entry((d.gpu, d.unit)).or_insert(0) += 1;
    ctx.charged.store(overhead, Release);
    ctx.epoch.store(epoch, Release);
    ctx.poison.store(0, Release);
    ctx.legacy.store(0, Release);
    ctx.generation.fetch_add(1, AcqRel);
    *ctx.limits.lock().unwrap_or_else(|e| e.into_inner()) = super::limits::Limits::defaults();
    ctx.peers.lock().unwrap_or_else(|e| e.into_inner()).clear();
    ctx.active.store(true, Release);
    Ok(())
}

/// Tears a context down: everything it holds is freed, its streams closed, its charge refunded.
/// With `unregister`, its handle goes too (a regular context; a primary one keeps its handle).
fn teardown(node: &Node, ctx: &Arc<Ctx>, unregister: bool) {
    let h = ctx.handle;
    run_storage_dtors(ctx);
    let (streams, events, allocs, arrays) = {
        let mut reg = handles::write();
        if unregister {
            reg.ctxs.remove(&h);
        }
        let was_active = ctx.active.swap(false, AcqRel);
        if !was_active && !unregister {
            return;
        }
        let streams: Vec<_> = reg.streams.extract_if(|_, s| s.ctx.handle == h).map(|(_, s)| s).collect();
        let events: Vec<_> = reg.events.extract_if(|_, e| e.ctx.handle == h).map(|(_, e)| e).collect();
        reg.modules.retain(|_, m| m.ctx != h);
        reg.funcs.retain(|_, f| f.ctx != h);
        let arrays: Vec<_> = reg.arrays.extract_if(|_, a| a.ctx == h).map(|(_, a)| a).collect();
        reg.mipmaps.retain(|_, m| m.ctx != h);
        let allocs: Vec<_> = reg
            .mem
            .extract_if(.., |_, a| a.ctx == h && !matches!(a.kind, super::memory::MemKind::Pool(_)))
            .map(|(_, a)| a)
            .collect();
        (streams, events, allocs, arrays)
    };
    for s in &streams {
        s.close(node);
    }
    for e in &events {
        e.forget(node);
    }
    for sid in ctx.default_streams() {
        node.stream_destroy(sid);
    }
    ctx.ptds.lock().unwrap_or_else(|e| e.into_inner()).clear();
    ctx.legacy.store(0, Release);
    for a in &allocs {
        super::memory::release(node, a);
    }
    drop(arrays);
    let d = ctx.dev;
    let epoch = ctx.epoch.load(Acquire);
    super::memory::refund(node, d.gpu, d.domain, ctx.charged.swap(0, AcqRel), epoch);
    // A context a reset destroyed is no longer counted in the model (nor here).
    if super::memory::current_epoch(d.gpu) == epoch {
        let mut m = unit_contexts();
        if let Some(n) = m.as_mut().and_then(|m| m.get_mut(&(d.gpu, d.unit)))
            && *n > 0
        {
            *n -= 1;
            if *n == 0 {
                node.context_closed(d.gpu, d.unit);
            }
        }
    }
    // The context is no longer current anywhere on this thread.
    with_stack(|s| s.retain(|&c| c != h || !unregister));
}

/// Creates a regular context on a device and makes it current.
pub(crate) fn create(flags: c_uint, dev: c_int) -> R<usize> {
    let d = driver()?;
    poll_faults(d.node)?;
    let device = d.device(dev)?;
    check_flags(flags)?;
    let ctx = Arc::new(Ctx::new(device, false, flags));
    activate(d.node, &ctx)?;
    let h = ctx.handle;
    handles::write().ctxs.insert(h, ctx);
    with_stack(|s| s.push(h));
    Ok(h)
}

fn check_flags(flags: c_uint) -> R {
    if flags & !CTX_FLAGS_MASK != 0 || !matches!(flags & CTX_SCHED_MASK, 0 | 1 | 2 | 4) {
        return Err(INVALID_VALUE);
    }
    Ok(())
}

cuda_exports! {
    fn cuCtxCreate_v2(pctx, flags, dev) {
        run(|| {
            need(pctx)?;
            let h = create(flags, dev)?;
            // SAFETY: pctx is the caller's out-pointer (checked above).
            unsafe { put(pctx, handles::as_ptr(h)) }
        })
    }

    fn cuCtxCreate(pctx, flags, dev) {
        // SAFETY: same contract as cuCtxCreate_v2, which has the same signature.
        unsafe { cuCtxCreate_v2(pctx, flags, dev) }
    }

    /// `cuCtxCreate_v3`: with execution-affinity parameters, which need MPS (not simulated).
    fn cuCtxCreate_v3(pctx, paramsArray, numParams, flags, dev) {
        run(|| {
            need(pctx)?;
            if numParams < 0 || (numParams > 0 && paramsArray.is_null()) {
                return Err(INVALID_VALUE);
            }
            if numParams > 0 {
                driver()?.device(dev)?;
                return Err(CUresult::CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY);
            }
            let h = create(flags, dev)?;
            // SAFETY: pctx is the caller's out-pointer (checked above).
            unsafe { put(pctx, handles::as_ptr(h)) }
        })
    }

    /// `cuCtxCreate_v4`: with optional creation parameters (execution affinity and CIG, neither
    /// simulated).
    fn cuCtxCreate_v4(pctx, ctxCreateParams, flags, dev) {
        run(|| {
            need(pctx)?;
            if !ctxCreateParams.is_null() {
                // SAFETY: non-null; the struct is the caller's (its fields are pointers and an int).
                let p = unsafe { super::get(ctxCreateParams.cast_const()) }?;
                if p.numExecAffinityParams > 0 || !p.execAffinityParams.is_null() {
                    driver()?.device(dev)?;
                    return Err(CUresult::CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY);
                }
                if !p.cigParams.is_null() {
                    return Err(super::NOT_SUPPORTED);
                }
            }
            let h = create(flags, dev)?;
            // SAFETY: pctx is the caller's out-pointer (checked above).
            unsafe { put(pctx, handles::as_ptr(h)) }
        })
    }
}

fn destroy(h: sys::CUcontext) -> R {
    let d = driver()?;
    let _ = poll_faults(d.node);
    let ctx = handles::read().ctxs.get(&(h as usize)).cloned().ok_or(INVALID_CONTEXT)?;
    if ctx.primary {
        return Err(INVALID_CONTEXT);
    }
    teardown(d.node, &ctx, true);
    Ok(())
}

cuda_exports! {
    fn cuCtxDestroy_v2(ctx) also cuCtxDestroy {
        run(|| destroy(ctx))
    }
}

fn push(h: sys::CUcontext) -> R {
    driver()?;
    if h.is_null() || !handles::read().ctxs.contains_key(&(h as usize)) {
        return Err(INVALID_CONTEXT);
    }
    with_stack(|s| s.push(h as usize)).ok_or(INVALID_CONTEXT)?;
    Ok(())
}

cuda_exports! {
    fn cuCtxPushCurrent_v2(ctx) also cuCtxPushCurrent {
        run(|| push(ctx))
    }
}

fn pop(pctx: *mut sys::CUcontext) -> R {
    driver()?;
    let h = with_stack(|s| s.pop()).flatten().ok_or(INVALID_CONTEXT)?;
    // SAFETY: pctx is the caller's out-pointer; it may be null.
    unsafe { put_opt(pctx, handles::as_ptr(h)) }
}

cuda_exports! {
    fn cuCtxPopCurrent_v2(pctx) also cuCtxPopCurrent {
        run(|| pop(pctx))
    }

    /// `cuCtxSetCurrent`: replaces the top of the stack (a null context unbinds it).
    fn cuCtxSetCurrent(ctx) {
        run(|| {
            driver()?;
            if ctx.is_null() {
                with_stack(|s| s.pop());
                return Ok(());
            }
            if !handles::read().ctxs.contains_key(&(ctx as usize)) {
                return Err(INVALID_CONTEXT);
            }
            with_stack(|s| {
                s.pop();
                s.push(ctx as usize);
            });
            Ok(())
        })
    }

    fn cuCtxGetCurrent(pctx) {
        run(|| {
            need(pctx)?;
            driver()?;
            // As the real driver: the thread's current context as it stands, even one another thread
            // destroyed meanwhile (using it then fails with CONTEXT_IS_DESTROYED). A TLS read, no lock.
            let h = current_handle().unwrap_or(0);
            // SAFETY: pctx is the caller's out-pointer (checked above).
            unsafe { put(pctx, handles::as_ptr(h)) }
        })
    }

    fn cuCtxGetDevice(device) {
        run(|| {
            need(device)?;
            driver()?;
            let ctx = current()?;
            ctx.check_state()?;
            // SAFETY: device is the caller's out-pointer (checked above).
            unsafe { put(device, ctx.dev.ordinal) }
        })
    }
}

/// Waits for everything queued in a context: its default streams, its streams, and host
/// functions queued on them.
pub(crate) fn synchronize(node: &'static Node, ctx: &Ctx) -> R {
    ctx.check_sync(node)?;
    let mut sids = ctx.default_streams();
    sids.extend(handles::read().streams.values().filter(|s| s.ctx.handle == ctx.handle).map(|s| s.sid));
    for sid in sids {
        super::stream::wait_stream(node, sid)?;
    }
    ctx.check_sync(node)
}

cuda_exports! {
    fn cuCtxSynchronize() {
        run(|| {
            let node = driver()?.node;
            poll_faults(node)?;
            let ctx = current()?;
            synchronize(node, &ctx)
        })
    }

    fn cuCtxGetApiVersion(ctx, version) {
        run(|| {
            need(version)?;
            driver()?;
            by_handle(ctx)?;
            // Contexts made through the `_v2` API report 3020, as the real driver's do.
            // SAFETY: version is the caller's out-pointer (checked above).
            unsafe { put(version, 3020) }
        })
    }

    fn cuCtxGetId(ctx, ctxId) {
        run(|| {
            need(ctxId)?;
            driver()?;
            let c = by_handle(ctx)?;
            // SAFETY: ctxId is the caller's out-pointer (checked above).
            unsafe { put(ctxId, handles::ordinal_of(c.handle)) }
        })
    }
}

cuda_exports! {
    fn cuCtxGetFlags(flags) {
        run(|| {
            need(flags)?;
            driver()?;
            let ctx = current()?;
            // SAFETY: flags is the caller's out-pointer (checked above).
            unsafe { put(flags, ctx.flags.load(Relaxed) | CTX_MAP_HOST) }
        })
    }

    fn cuCtxSetFlags(flags) {
        run(|| {
            driver()?;
            check_flags(flags)?;
            current()?.flags.store(flags, Relaxed);
            Ok(())
        })
    }

    fn cuCtxGetStreamPriorityRange(leastPriority, greatestPriority) {
        run(|| {
            driver()?;
            // SAFETY: both are the caller's out-pointers; either may be null.
            unsafe {
                put_opt(leastPriority, super::stream::LEAST_PRIORITY)?;
                put_opt(greatestPriority, super::stream::GREATEST_PRIORITY)
            }
        })
    }

    fn cuCtxGetCacheConfig(pconfig) {
        run(|| {
            need(pconfig)?;
            driver()?;
            let ctx = current()?;
            // SAFETY: pconfig is the caller's out-pointer (checked above).
            unsafe { put(pconfig, ctx.cache_config.load(Relaxed)) }
        })
    }

    fn cuCtxSetCacheConfig(config) {
        run(|| {
            driver()?;
            if !(0..=3).contains(&config) {
                return Err(INVALID_VALUE);
            }
            current()?.cache_config.store(config, Relaxed);
            Ok(())
        })
    }

    fn cuCtxResetPersistingL2Cache() {
        run(|| {
            driver()?;
            current().map(|_| ())
        })
    }

    fn cuCtxEnablePeerAccess(peerContext, Flags) {
        run(|| {
            driver()?;
            if Flags != 0 {
                return Err(INVALID_VALUE);
            }
            let ctx = current()?;
            let peer = handles::read().ctxs.get(&(peerContext as usize)).cloned().ok_or(INVALID_CONTEXT)?;
            if peer.dev.ordinal == ctx.dev.ordinal {
                return Err(super::INVALID_DEVICE);
            }
            if !super::device::can_access_peer(ctx.dev, peer.dev) {
                return Err(CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
            }
            let mut peers = ctx.peers.lock().unwrap_or_else(|e| e.into_inner());
            if peers.contains(&peer.handle) {
                return Err(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
            }
            peers.push(peer.handle);
            Ok(())
        })
    }

    fn cuCtxDisablePeerAccess(peerContext) {
        run(|| {
            driver()?;
            let ctx = current()?;
            let mut peers = ctx.peers.lock().unwrap_or_else(|e| e.into_inner());
            let i = peers
                .iter()
                .position(|&p| p == peerContext as usize)
                .ok_or(CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED)?;
            peers.remove(i);
            Ok(())
        })
    }
}

// ---- Context-local storage -------------------------------------------------------------------
//
// The driver keeps, per context, values keyed by an address, for the CUDA runtime (its state for
// the context); a value may come with a destructor, called when the context is torn down
// (destroyed, or a primary context released or reset), as the runtime frees its state there.

/// Stores `value` under `key` in a context (null: the current one), replacing what was there.
pub(crate) fn storage_put(h: sys::CUcontext, key: usize, value: usize, dtor: Option<StorageDtor>) -> R {
    driver()?;
    let ctx = by_handle(h)?;
    let mut storage = ctx.storage.lock().unwrap_or_else(|e| e.into_inner());
    match storage.iter_mut().find(|s| s.key == key) {
        Some(s) => {
            s.value = value;
            s.dtor = dtor;
        }
        None => storage.push(Stored { key, value, dtor }),
    }
    Ok(())
}

/// Forgets `key` in a context (null: the current one), without calling its destructor.
pub(crate) fn storage_delete(h: sys::CUcontext, key: usize) -> R {
    driver()?;
    let ctx = by_handle(h)?;
    ctx.storage.lock().unwrap_or_else(|e| e.into_inner()).retain(|s| s.key != key);
    Ok(())
}

/// The value under `key` in a context (null: the current one); none is `INVALID_HANDLE`, which
/// tells the runtime to set the context up.
pub(crate) fn storage_get(h: sys::CUcontext, key: usize) -> R<usize> {
    driver()?;
    let ctx = by_handle(h)?;
    let storage = ctx.storage.lock().unwrap_or_else(|e| e.into_inner());
    storage.iter().find(|s| s.key == key).map(|s| s.value).ok_or(INVALID_HANDLE)
}

/// Empties a context's storage, calling the destructors (outside the lock: they may call back
/// into the driver).
fn run_storage_dtors(ctx: &Ctx) {
    let stored = std::mem::take(&mut *ctx.storage.lock().unwrap_or_else(|e| e.into_inner()));
    for s in stored {
        if let Some(dtor) = s.dtor {
            dtor(handles::as_ptr(ctx.handle), handles::as_ptr(s.key), handles::as_ptr(s.value));
        }
    }
}

// ---- Primary contexts ------------------------------------------------------------------------

fn primary_of(dev: c_int) -> R<(&'static Node, &'static Device)> {
    let d = driver()?;
    Ok((d.node, d.device(dev)?))
}

fn lock_primary(device: &Device) -> MutexGuard<'_, Primary> {
    device.primary.lock().unwrap_or_else(|e| e.into_inner())
}

/// A device's primary context handle, made (not retained, not active) if it does not exist yet:
/// what the runtime asks for before it retains the context.
pub(crate) fn primary_handle(dev: c_int) -> R<usize> {
    let (_, device) = primary_of(dev)?;
    let mut p = lock_primary(device);
    if let Some(c) = &p.ctx {
        return Ok(c.handle);
    }
    let c = Arc::new(Ctx::new(device, true, p.flags));
    handles::write().ctxs.insert(c.handle, c.clone());
    p.ctx = Some(c.clone());
    Ok(c.handle)
}

cuda_exports! {
    fn cuDevicePrimaryCtxRetain(pctx, dev) {
        run(|| {
            need(pctx)?;
            let (node, device) = primary_of(dev)?;
            poll_faults(node)?;
            let mut p = lock_primary(device);
            let ctx = match &p.ctx {
                Some(c) => c.clone(),
                None => {
                    let c = Arc::new(Ctx::new(device, true, p.flags));
                    handles::write().ctxs.insert(c.handle, c.clone());
                    p.ctx = Some(c.clone());
                    c
                }
            };
            if !ctx.active.load(Acquire) {
                ctx.flags.store(p.flags, Relaxed);
                activate(node, &ctx)?;
            }
            p.refs += 1;
            // SAFETY: pctx is the caller's out-pointer (checked above).
            unsafe { put(pctx, handles::as_ptr(ctx.handle)) }
        })
    }
}

fn primary_release(dev: c_int) -> R {
    let (node, device) = primary_of(dev)?;
    let _ = poll_faults(node);
    let mut p = lock_primary(device);
    if p.refs == 0 {
        return Err(INVALID_CONTEXT);
    }
    p.refs -= 1;
    if p.refs == 0
        && let Some(ctx) = p.ctx.clone()
    {
        teardown(node, &ctx, false);
    }
    Ok(())
}

cuda_exports! {
    fn cuDevicePrimaryCtxRelease_v2(dev) also cuDevicePrimaryCtxRelease {
        run(|| primary_release(dev))
    }
}

/// Destroys everything the primary context holds; a context still retained comes back fresh
/// under the same handle.
fn primary_reset(dev: c_int) -> R {
    let (node, device) = primary_of(dev)?;
    let _ = poll_faults(node);
    let p = lock_primary(device);
    if let Some(ctx) = p.ctx.clone() {
        teardown(node, &ctx, false);
        if p.refs > 0 {
            activate(node, &ctx)?;
        }
    }
    Ok(())
}

cuda_exports! {
    fn cuDevicePrimaryCtxReset_v2(dev) also cuDevicePrimaryCtxReset {
        run(|| primary_reset(dev))
    }

    fn cuDevicePrimaryCtxGetState(dev, flags, active) {
        run(|| {
            need(flags)?;
            need(active)?;
            let (_, device) = primary_of(dev)?;
            let p = lock_primary(device);
            let on = p.ctx.as_ref().is_some_and(|c| c.active.load(Acquire));
            // SAFETY: flags and active are the caller's out-pointers (checked above).
            unsafe {
                put(flags, p.flags)?;
                put(active, c_int::from(on))
            }
        })
    }
}

fn primary_set_flags(dev: c_int, flags: c_uint) -> R {
    let (_, device) = primary_of(dev)?;
    check_flags(flags)?;
    let mut p = lock_primary(device);
    p.flags = flags;
    if let Some(c) = &p.ctx {
        c.flags.store(flags, Relaxed);
    }
    Ok(())
}

cuda_exports! {
    fn cuDevicePrimaryCtxSetFlags_v2(dev, flags) {
        run(|| primary_set_flags(dev, flags))
    }

    /// Legacy `cuDevicePrimaryCtxSetFlags`: refused while the primary context is active.
    fn cuDevicePrimaryCtxSetFlags(dev, flags) {
        run(|| {
            let (_, device) = primary_of(dev)?;
            if lock_primary(device).ctx.as_ref().is_some_and(|c| c.active.load(Acquire)) {
                return Err(CUresult::CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE);
            }
            primary_set_flags(dev, flags)
        })
    }
}
