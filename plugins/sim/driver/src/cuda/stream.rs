//! Streams: created streams, the legacy default stream (`NULL` / `CU_STREAM_LEGACY`) and the
//! per-thread default stream (`CU_STREAM_PER_THREAD`, and `NULL` in the `_ptsz`/`_ptds` variants),
//! each backed by a model stream on the context's execution unit; host functions and callbacks
//! run on a driver thread in stream order.

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::*};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use tessera_abi::cuda_exports;
use tessera_sim_model::{MAX_STREAMS, Node, StreamId};

use super::context::{self, Ctx};
use super::errors::{Cu, poll_faults};
use super::graph::Capture;
use super::handles::{self, Registry};
use super::init::driver;
use super::{CUresult, INVALID_HANDLE, INVALID_VALUE, R, need, put, run, sys};

/// `cuCtxGetStreamPriorityRange`: 0 is the lowest priority, -5 the highest (Ampere and Hopper).
pub(crate) const LEAST_PRIORITY: c_int = 0;
pub(crate) const GREATEST_PRIORITY: c_int = -5;

/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: c_uint = 0x1;
/// `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`.
const STREAM_LEGACY: usize = 0x1;
const STREAM_PER_THREAD: usize = 0x2;

/// A stream made with `cuStreamCreate*`.
pub(crate) struct Stream {
    pub handle: usize,
    pub ctx: Arc<Ctx>,
    pub sid: StreamId,
    pub flags: c_uint,
    pub priority: c_int,
    /// Set while the stream takes part in a capture (read on every launch without a lock).
    pub capturing: AtomicBool,
    pub capture: Mutex<Option<Arc<Capture>>>,
    closed: AtomicBool,
}

impl Stream {
    /// Closes the model stream, once.
    pub(crate) fn close(&self, node: &Node) {
        if !self.closed.swap(true, AcqRel) {
            node.stream_destroy(self.sid);
        }
    }

    /// The capture this stream takes part in, if any.
    pub(crate) fn capture(&self) -> Option<Arc<Capture>> {
        if !self.capturing.load(Acquire) {
            return None;
        }
        self.capture.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Joins or leaves a capture.
    pub(crate) fn set_capture(&self, c: Option<Arc<Capture>>) {
        let mut g = self.capture.lock().unwrap_or_else(|e| e.into_inner());
        self.capturing.store(c.is_some(), Release);
        *g = c;
    }
}

/// Where a stream-ordered call goes: the context, the model stream, and the created stream
/// behind it (none for a default stream).
pub(crate) struct Target {
    pub ctx: Arc<Ctx>,
    pub sid: StreamId,
    pub stream: Option<Arc<Stream>>,
    /// The legacy default stream (which waits for, and is waited for by, the blocking streams).
    pub legacy: bool,
}

impl Target {
    pub(crate) fn capture(&self) -> Option<Arc<Capture>> {
        self.stream.as_ref().and_then(|s| s.capture())
    }
}

/// Resolves a stream handle in a locked registry. `per_thread` is the calling variant's meaning
/// of `NULL`: the per-thread default stream (`_ptsz`/`_ptds`) or the legacy one.
pub(crate) fn resolve(reg: &Registry, node: &Node, h: sys::CUstream, per_thread: bool) -> R<Target> {
    let default_stream = |pt: bool| -> R<Target> {
        let ctx = context::current_in(reg)?.clone();
        ctx.check_state()?;
        let sid = if pt { ctx.per_thread_stream(node)? } else { ctx.legacy_stream(node)? };
        Ok(Target { ctx, sid, stream: None, legacy: !pt })
    };
    match h as usize {
        0 => default_stream(per_thread),
        STREAM_LEGACY => default_stream(false),
        STREAM_PER_THREAD => default_stream(true),
        x => {
            let s = reg.streams.get(&x).ok_or(INVALID_HANDLE)?;
            Ok(Target { ctx: s.ctx.clone(), sid: s.sid, stream: Some(s.clone()), legacy: false })
        }
    }
}

/// What waiting on the legacy default stream of a context waits for: it, and every blocking
/// stream of the context (their work is ordered before the legacy stream's).
pub(crate) fn legacy_group(reg: &Registry, ctx: &Ctx, legacy: StreamId) -> R<Vec<StreamId>> {
    let mut sids = vec![legacy];
    for s in reg.streams.values().filter(|s| s.ctx.handle == ctx.handle && s.flags & STREAM_NON_BLOCKING == 0) {
        if s.capture().is_some() {
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
        }
        sids.push(s.sid);
    }
    Ok(sids)
}

/// Resolves a stream for new work and checks its context can take it.
pub(crate) fn resolve_and_check(h: sys::CUstream, per_thread: bool) -> R<Target> {
    resolve_with(h, per_thread, |_| Ok(())).map(|(_, (), t)| t)
}

/// What `find` reads in the registry and what stream `h` resolves to, under one lock of the
/// registry, on a node with no fault pending; the stream's context checked able to take work.
pub(crate) fn resolve_with<T>(
    h: sys::CUstream,
    per_thread: bool,
    find: impl FnOnce(&Registry) -> R<T>,
) -> R<(&'static Node, T, Target)> {
    let node = driver()?.node;
    poll_faults(node)?;
    let (found, t) = {
        let reg = handles::read();
        let found = find(&reg)?;
        (found, resolve(&reg, node, h, per_thread)?)
    };
    t.ctx.check(node)?;
    Ok((node, found, t))
}

// ---- Host functions --------------------------------------------------------------------------

/// Host functions queued on each model stream and not yet run.
static HOST_PENDING: [AtomicU32; MAX_STREAMS] = [const { AtomicU32::new(0) }; MAX_STREAMS];

pub(crate) enum HostCall {
    /// `cuLaunchHostFunc`.
    Func(unsafe extern "C" fn(*mut c_void), usize),
    /// `cuStreamAddCallback`: the function, the stream handle, the user data.
    Callback(unsafe extern "C" fn(sys::CUstream, CUresult, *mut c_void), usize, usize),
    /// Close a destroyed stream's model stream once its work is done.
    Close,
}

struct Job {
    sid: StreamId,
    ticket: u64,
    call: HostCall,
}

static WORKER: Mutex<Option<mpsc::Sender<Job>>> = Mutex::new(None);

fn worker(node: &'static Node, rx: mpsc::Receiver<Job>) {
    for job in rx {
        let status = match node.stream_wait(job.sid, job.ticket, None) {
            Err(tessera_sim_model::SimError::GpuLost(_)) => CUresult::CUDA_ERROR_LAUNCH_FAILED,
            _ => CUresult::CUDA_SUCCESS,
        };
        match job.call {
            // SAFETY: the caller handed us this function and its data to be called once, from a
            // driver thread, after the stream's prior work (the CUDA API contract).
            HostCall::Func(f, data) => unsafe { f(data as *mut c_void) },
            // SAFETY: as above, for a stream callback.
            HostCall::Callback(f, stream, data) => unsafe { f(handles::as_ptr(stream), status, data as *mut c_void) },
            HostCall::Close => {
                node.stream_destroy(job.sid);
                continue;
            }
        }
        HOST_PENDING[job.sid.0 as usize % MAX_STREAMS].fetch_sub(1, AcqRel);
    }
}

/// Queues a host call behind everything queued so far on a model stream.
pub(crate) fn enqueue_host(node: &'static Node, sid: StreamId, call: HostCall) -> R {
    let ticket = node.launch(sid, 0).work()?;
    let counted = !matches!(call, HostCall::Close);
    let mut w = WORKER.lock().unwrap_or_else(|e| e.into_inner());
    if w.is_none() {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("tessera-cuda-host".into())
            .spawn(move || worker(node, rx))
            .map_err(|_| CUresult::CUDA_ERROR_OPERATING_SYSTEM)?;
        *w = Some(tx);
    }
    if counted {
        HOST_PENDING[sid.0 as usize % MAX_STREAMS].fetch_add(1, AcqRel);
    }
    let sent = w.as_ref().is_some_and(|tx| tx.send(Job { sid, ticket, call }).is_ok());
    if !sent {
        if counted {
            HOST_PENDING[sid.0 as usize % MAX_STREAMS].fetch_sub(1, AcqRel);
        }
        return Err(CUresult::CUDA_ERROR_OPERATING_SYSTEM);
    }
    Ok(())
}

fn host_pending(sid: StreamId) -> bool {
    HOST_PENDING[sid.0 as usize % MAX_STREAMS].load(Acquire) > 0
}

/// Waits until a model stream has run everything queued on it, host functions included.
/// A stream closed meanwhile has nothing left to wait for.
pub(crate) fn wait_stream(node: &Node, sid: StreamId) -> R {
    let Ok(tail) = node.stream_tail(sid) else { return Ok(()) };
    match node.stream_wait(sid, tail, None) {
        Ok(()) | Err(tessera_sim_model::SimError::InvalidArgument(_)) => {}
        Err(e) => return Err(super::errors::sim(&e, super::errors::During::Sync)),
    }
    while host_pending(sid) {
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(())
}

/// Whether a model stream has run everything queued on it.
pub(crate) fn stream_done(node: &Node, sid: StreamId) -> R<bool> {
    let Ok(tail) = node.stream_tail(sid) else { return Ok(true) };
    match node.stream_reached(sid, tail) {
        Ok(done) => Ok(done && !host_pending(sid)),
        Err(tessera_sim_model::SimError::InvalidArgument(_)) => Ok(true),
        Err(e) => Err(super::errors::sim(&e, super::errors::During::Sync)),
    }
}

// ---- Exports ---------------------------------------------------------------------------------

fn create(ph: *mut sys::CUstream, flags: c_uint, priority: c_int) -> R {
    need(ph)?;
    if flags & !STREAM_NON_BLOCKING != 0 {
        return Err(INVALID_VALUE);
    }
    let node = driver()?.node;
    poll_faults(node)?;
    let ctx = context::current()?;
    ctx.check(node)?;
    let priority = priority.clamp(GREATEST_PRIORITY, LEAST_PRIORITY);
    let sid = node.stream_create(ctx.dev.gpu, ctx.dev.unit, priority).work()?;
    let handle = handles::new_handle();
    let s = Stream {
        handle,
        ctx,
        sid,
        flags,
        priority,
        capturing: AtomicBool::new(false),
        capture: Mutex::new(None),
        closed: AtomicBool::new(false),
    };
    handles::write().streams.insert(handle, Arc::new(s));
    // SAFETY: ph is the caller's out-pointer (checked above).
    unsafe { put(ph, handles::as_ptr(handle)) }
}

cuda_exports! {
    fn cuStreamCreate(phStream, Flags) {
        run(|| create(phStream, Flags, 0))
    }

    fn cuStreamCreateWithPriority(phStream, flags, priority) {
        run(|| create(phStream, flags, priority))
    }
}

/// `cuStreamDestroy`: returns at once; the stream's queued work still runs, and its model stream
/// is closed when it has.
fn destroy(h: sys::CUstream) -> R {
    let node = driver()?.node;
    let s = handles::write().streams.remove(&(h as usize)).ok_or(INVALID_HANDLE)?;
    if !s.closed.swap(true, AcqRel) && enqueue_host(node, s.sid, HostCall::Close).is_err() {
        node.stream_destroy(s.sid);
    }
    Ok(())
}

cuda_exports! {
    fn cuStreamDestroy_v2(hStream) also cuStreamDestroy {
        run(|| destroy(hStream))
    }
}

/// Resolves a stream for a query or a wait.
fn for_sync(h: sys::CUstream, pt: bool) -> R<(&'static Node, Target)> {
    let node = driver()?.node;
    poll_faults(node)?;
    let t = resolve(&handles::read(), node, h, pt)?;
    t.ctx.check_sync(node)?;
    if let Some(c) = t.capture() {
        // Waiting on a capturing stream is not allowed, and ends the capture in error.
        c.invalidate();
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok((node, t))
}

/// The model streams a wait on `t` waits for.
fn wait_set(t: &Target) -> R<Vec<StreamId>> {
    if t.legacy { legacy_group(&handles::read(), &t.ctx, t.sid) } else { Ok(vec![t.sid]) }
}

fn synchronize(h: sys::CUstream, pt: bool) -> R {
    let (node, t) = for_sync(h, pt)?;
    for sid in wait_set(&t)? {
        wait_stream(node, sid)?;
    }
    t.ctx.check_sync(node)
}

cuda_exports! {
    fn cuStreamSynchronize(hStream) twin cuStreamSynchronize_ptsz(per_thread) {
        run(|| synchronize(hStream, per_thread))
    }
}

fn query(h: sys::CUstream, pt: bool) -> R {
    let (node, t) = for_sync(h, pt)?;
    for sid in wait_set(&t)? {
        if !stream_done(node, sid)? {
            return Err(super::NOT_READY);
        }
    }
    Ok(())
}

cuda_exports! {
    fn cuStreamQuery(hStream) twin cuStreamQuery_ptsz(per_thread) {
        run(|| query(hStream, per_thread))
    }
}

/// Resolves a stream for a property query (no fault checks: the properties outlive faults).
fn for_query(h: sys::CUstream, pt: bool) -> R<Target> {
    let node = driver()?.node;
    resolve(&handles::read(), node, h, pt)
}

/// One of a stream's properties through the caller's out-pointer (the default streams': 0).
fn get_property<T: Default>(h: sys::CUstream, out: *mut T, pt: bool, property: fn(&Stream) -> T) -> R {
    need(out)?;
    let t = for_query(h, pt)?;
    // SAFETY: out is the caller's out-pointer (checked above).
    unsafe { put(out, t.stream.as_deref().map_or_else(T::default, property)) }
}

cuda_exports! {
    fn cuStreamGetPriority(hStream, priority) twin cuStreamGetPriority_ptsz(per_thread) {
        run(|| get_property(hStream, priority, per_thread, |s| s.priority))
    }

    fn cuStreamGetFlags(hStream, flags) twin cuStreamGetFlags_ptsz(per_thread) {
        run(|| get_property(hStream, flags, per_thread, |s| s.flags))
    }
}

fn get_ctx(h: sys::CUstream, pctx: *mut sys::CUcontext, green: *mut sys::CUgreenCtx, pt: bool) -> R {
    need(pctx)?;
    let t = for_query(h, pt)?;
    // SAFETY: pctx is the caller's out-pointer (checked above); green is an optional one.
    unsafe {
        put(pctx, handles::as_ptr(t.ctx.handle))?;
        super::put_opt(green, std::ptr::null_mut())
    }
}

cuda_exports! {
    fn cuStreamGetCtx(hStream, pctx) twin cuStreamGetCtx_ptsz(per_thread) {
        run(|| get_ctx(hStream, pctx, std::ptr::null_mut(), per_thread))
    }

    fn cuStreamGetCtx_v2(hStream, pCtx, pGreenCtx) twin cuStreamGetCtx_v2_ptsz(per_thread) {
        run(|| get_ctx(hStream, pCtx, pGreenCtx, per_thread))
    }
}

fn get_id(h: sys::CUstream, id: *mut c_ulonglong, pt: bool) -> R {
    need(id)?;
    let t = for_query(h, pt)?;
    // The default streams have their own ids; created streams follow.
    let v = match &t.stream {
        Some(s) => 0x100 + handles::ordinal_of(s.handle),
        None if h as usize == STREAM_PER_THREAD || (h.is_null() && pt) => 2,
        None => 1,
    };
    // SAFETY: id is the caller's out-pointer (checked above).
    unsafe { put(id, v) }
}

cuda_exports! {
    fn cuStreamGetId(hStream, streamId) twin cuStreamGetId_ptsz(per_thread) {
        run(|| get_id(hStream, streamId, per_thread))
    }
}

fn get_device(h: sys::CUstream, device: *mut c_int, pt: bool) -> R {
    need(device)?;
    let t = for_query(h, pt)?;
    // SAFETY: device is the caller's out-pointer (checked above).
    unsafe { put(device, t.ctx.dev.ordinal) }
}

cuda_exports! {
    fn cuStreamGetDevice(hStream, device) twin cuStreamGetDevice_ptsz(per_thread) {
        run(|| get_device(hStream, device, per_thread))
    }
}

fn add_callback(h: sys::CUstream, cb: sys::CUstreamCallback, data: *mut c_void, flags: c_uint, pt: bool) -> R {
    let f = cb.ok_or(INVALID_VALUE)?;
    if flags != 0 {
        return Err(INVALID_VALUE);
    }
    let node = driver()?.node;
    let t = resolve_and_check(h, pt)?;
    if t.capture().is_some() {
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    enqueue_host(node, t.sid, HostCall::Callback(f, h as usize, data as usize))
}

cuda_exports! {
    fn cuStreamAddCallback(hStream, callback, userData, flags) twin cuStreamAddCallback_ptsz(per_thread) {
        run(|| add_callback(hStream, callback, userData, flags, per_thread))
    }
}

fn attach_mem(h: sys::CUstream, dptr: u64, length: usize, flags: c_uint, pt: bool) -> R {
    // CU_MEM_ATTACH_GLOBAL, _HOST, _SINGLE.
    if !matches!(flags, 1 | 2 | 4) {
        return Err(INVALID_VALUE);
    }
    resolve_and_check(h, pt)?;
    let reg = handles::read();
    match reg.alloc_at(dptr) {
        Some(a)
            if a.kind == super::memory::MemKind::Managed
                && (length == 0 || dptr + length as u64 <= a.base + a.size) =>
        {
            Ok(())
        }
        _ => Err(INVALID_VALUE),
    }
}

cuda_exports! {
    fn cuStreamAttachMemAsync(hStream, dptr, length, flags) twin cuStreamAttachMemAsync_ptsz(per_thread) {
        run(|| attach_mem(hStream, dptr, length, flags, per_thread))
    }
}
