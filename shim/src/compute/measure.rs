//! What a measured kernel really took: a CUDA event before and after it on its stream. The
//! span between the two is the kernel's time on the GPU, waiting for nothing else of its stream
//! (the "before" event completes when the stream's earlier work does). Spans are harvested when
//! complete, at a later measured launch or before a throttled wait, never waited for on the
//! launch path. Which throttled launches are measured, and what a span corrects the bucket's
//! charge by, is `sample`'s.
//!
//! While a trace is recorded, every launch is measured this way (unthrottled ones too, charged
//! nothing) and each completed span becomes a kernel entry in the region's trace ring: its GPU
//! duration is the events' span; its start, which events do not give on the CPU's clock, is
//! estimated as the later of the launch and the end of the previous measured kernel on the stream.
//!
//! The first time a trace session launches a kernel's `CUfunction`, its name (the real driver's
//! `cuFuncGetName`, asked once) goes into the ring as name entries, before the kernel's entry.
//! The handles announced are kept per process with the session they were announced in (the value
//! of `trace_requested`, a new one per trace: `Region::start_trace`); a new session starts the set
//! afresh, since the daemon reads only the entries written during its own trace.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::{CStr, c_char, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use cudarc::driver::sys::{CUcontext, CUevent, CUfunction, CUkernel, CUresult, CUstream};
use tessera_region::{
    MAX_DEVICES, TRACE_FLAG_START_ESTIMATED, TRACE_NAME_MAX, TRACE_NO_DEVICE, TraceEntry, TraceKind, monotonic_ns,
};

use super::sample::{Plan, Sampler};
use super::{bucket, service};
use crate::real;
use crate::state::ShimState;
use crate::trace::Launch;

/// Kernels measured at once per process; beyond, the oldest is waited for.
const MAX_IN_FLIGHT: usize = 256;

/// A launch being measured.
pub struct Pending {
    dev: usize,
    ctx: usize,
    stream: usize,
    start: usize,
    /// What the bucket was charged and at what weight; None: not metered (for a trace only).
    plan: Option<Plan>,
    /// Traced: the launch, when it was made (monotonic ns) and the launching thread.
    trace: Option<(Launch, u64, u32)>,
}

struct InFlight {
    dev: usize,
    ctx: usize,
    stream: usize,
    start: usize,
    end: usize,
    plan: Option<Plan>,
    trace: Option<(Launch, u64, u32)>,
}

#[derive(Default)]
struct Local {
    in_flight: VecDeque<InFlight>,
    /// Idle events by context (events belong to the context they were made in): a process has
    /// a context or two, so a short list (no hashing on the launch path).
    pool: Vec<(usize, Vec<usize>)>,
    /// Traced kernels: the estimated end of the last one on each stream (monotonic ns).
    stream_end: HashMap<usize, u64>,
    /// The trace session `announced` belongs to (0: none yet).
    names_session: u32,
    /// `CUfunction`s whose names this process announced in `names_session` (or failed to read).
    announced: HashSet<usize>,
}

static LOCAL: Mutex<Option<Local>> = Mutex::new(None);
/// `LOCAL`'s `in_flight.len()`, so that a launch with nothing to harvest takes no lock.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Per device: what this process's measured kernels took lately, for charging and sampling.
static SAMPLERS: [Sampler; MAX_DEVICES] = [const { Sampler::new() }; MAX_DEVICES];

/// Whether `stream` is being captured into a graph (`CU_STREAM_CAPTURE_STATUS_ACTIVE`): a launch
/// there runs nothing now, and events recorded there become nodes of the graph, recorded again
/// at every replay (a pooled event reused by a later measurement would then be stamped by the
/// graph's replays too).
pub fn capturing(stream: *mut c_void) -> bool {
    let Some(is_capturing) = real::cuda().and_then(|cu| cu.cuStreamIsCapturing) else { return false };
    let mut status: std::ffi::c_uint = 0;
    // SAFETY: the caller's stream handle, about to be launched on; a valid out-pointer.
    unsafe { is_capturing(stream as CUstream, &mut status) == CUresult::CUDA_SUCCESS && status == 1 }
}

/// Measured launches of this process not yet harvested.
pub fn in_flight() -> usize {
    IN_FLIGHT.load(Relaxed)
}

/// Device `dev`'s sampler (region device indices are below `MAX_DEVICES`).
pub fn sampler(dev: usize) -> &'static Sampler {
    &SAMPLERS[dev.min(MAX_DEVICES - 1)]
}

fn with_local<R>(f: impl FnOnce(&mut Local) -> R) -> R {
    let mut g = LOCAL.lock().unwrap_or_else(|p| p.into_inner());
    f(g.get_or_insert_with(Local::default))
}

fn ok(rc: CUresult) -> bool {
    rc == CUresult::CUDA_SUCCESS
}

/// An event of `ctx` from the pool, or a new one (`ctx` must be current).
fn take_event(l: &mut Local, ctx: usize) -> Option<usize> {
    if let Some(e) = l.pool.iter_mut().find(|(c, _)| *c == ctx).and_then(|(_, idle)| idle.pop()) {
        return Some(e);
    }
    let cu = real::cuda()?;
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: e is a valid out-pointer; flags 0 (timing enabled) are valid.
    ok(unsafe { (cu.cuEventCreate)(&mut e, 0) }).then_some(e as usize)
}

fn give_back(l: &mut Local, ctx: usize, e: usize) {
    match l.pool.iter_mut().find(|(c, _)| *c == ctx) {
        Some((_, idle)) => idle.push(e),
        None => l.pool.push((ctx, vec![e])),
    }
}

/// Records the "before" event on the launch's stream. None when it cannot be measured (then
/// the launch keeps its estimated charge). `plan`: None when only the trace wants the span.
pub fn start(
    _st: &ShimState,
    dev: usize,
    stream: *mut c_void,
    plan: Option<Plan>,
    trace: Option<Launch>,
) -> Option<Pending> {
    let trace = trace.map(|f| (f, monotonic_ns(), crate::trace::ids().1));
    let cu = real::cuda()?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    let mut current: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointers.
    if !ok(unsafe { (cu.cuCtxGetCurrent)(&mut current) }) {
        return None;
    }
    // The default streams (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) are the current
    // context's: no need to ask.
    let same = if stream as usize <= 2 {
        ctx = current;
        true
    } else {
        // SAFETY: a valid out-pointer; the stream is the caller's, about to be launched on.
        ok(unsafe { (cu.cuStreamGetCtx)(stream as CUstream, &mut ctx) })
    };
    if !same || ctx.is_null() || ctx != current {
        return None; // events are made in the current context; a foreign stream goes unmeasured
    }
    let ctx = ctx as usize;
    with_local(|l| {
        let start = take_event(l, ctx)?;
        // SAFETY: start is a live event of the stream's (current) context.
        if ok(unsafe { (cu.cuEventRecord)(start as CUevent, stream as CUstream) }) {
            Some(Pending { dev, ctx, stream: stream as usize, start, plan, trace })
        } else {
            give_back(l, ctx, start);
            None
        }
    })
}

/// Records the "after" event once the driver accepted the launch (a refused one is refunded by
/// the caller; its event goes back to the pool).
pub fn finish(st: &ShimState, p: Pending, accepted: bool) {
    let stream = p.stream as *mut c_void;
    let Some(cu) = real::cuda() else { return };
    with_local(|l| {
        if !accepted {
            give_back(l, p.ctx, p.start);
            return;
        }
        let Some(end) = take_event(l, p.ctx) else { return give_back(l, p.ctx, p.start) };
        // SAFETY: end is a live event of the stream's context, current during the launch hook.
        if !ok(unsafe { (cu.cuEventRecord)(end as CUevent, stream as CUstream) }) {
            give_back(l, p.ctx, p.start);
            give_back(l, p.ctx, end);
            return;
        }
        if l.in_flight.len() >= MAX_IN_FLIGHT
            && let Some(oldest) = l.in_flight.front()
        {
            // SAFETY: a live event recorded by us.
            unsafe { (cu.cuEventSynchronize)(oldest.end as CUevent) };
        }
        if let Some((Launch { function, .. }, _, tid)) = p.trace
            && function != 0
        {
            announce(st, l, function, crate::trace::ids().0, tid);
        }
        l.in_flight.push_back(InFlight {
            dev: p.dev,
            ctx: p.ctx,
            stream: p.stream,
            start: p.start,
            end,
            plan: p.plan,
            trace: p.trace,
        });
        IN_FLIGHT.store(l.in_flight.len(), Relaxed);
    });
    // Settled at a later launch (`harvest`), never here: at most once per launch.
}

/// Settles every measured launch that has completed: corrects its charge by what its real GPU
/// time says (`Sampler::settle`).
pub fn harvest(st: &ShimState) {
    if IN_FLIGHT.load(Relaxed) == 0 {
        return;
    }
    let Some(cu) = real::cuda() else { return };
    with_local(|l| {
        while let Some(f) = l.in_flight.front() {
            // SAFETY: a live event recorded by us.
            let rc = unsafe { (cu.cuEventQuery)(f.end as CUevent) };
            if rc == CUresult::CUDA_ERROR_NOT_READY {
                break;
            }
            let f = l.in_flight.pop_front().expect("front exists");
            IN_FLIGHT.store(l.in_flight.len(), Relaxed);
            let mut ms = 0f32;
            // SAFETY: both events were recorded by us on one stream and the later one completed.
            let timed = ok(rc) && ok(unsafe { (cu.cuEventElapsedTime)(&mut ms, f.start as CUevent, f.end as CUevent) });
            if timed {
                let span = (f64::from(ms) * 1e6) as i64;
                if let Some(plan) = f.plan {
                    let own = service::own_time(st, f.dev, span, plan.weight);
                    let delta = sampler(f.dev).settle(plan, own);
                    bucket::correct(st.region.bucket(f.dev), delta);
                    // Its estimate of the GPU time of the launches it stands for.
                    let estimate = own.max(0).saturating_mul(plan.weight);
                    st.region.record_gpu_time(st.slot, f.dev, estimate as u64);
                }
                if let Some(launch) = f.trace {
                    record_kernel(st, l, &f, launch, span.max(0) as u64);
                }
            } else if f.trace.is_some() {
                l.stream_end.remove(&f.stream);
            }
            give_back(l, f.ctx, f.start);
            give_back(l, f.ctx, f.end);
        }
    });
}

/// A completed traced kernel as a kernel span: `span` ns of GPU time, started at the later of its
/// launch and the previous traced kernel's end on its stream, never ending after now.
fn record_kernel(st: &ShimState, l: &mut Local, f: &InFlight, launch: (Launch, u64, u32), span: u64) {
    let (Launch { func, function }, launched, tid) = launch;
    let now = monotonic_ns();
    let prev = l.stream_end.get(&f.stream).copied().unwrap_or(0);
    let mut start = launched.max(prev);
    if start.saturating_add(span) > now {
        start = now.saturating_sub(span).max(launched);
    }
    let end = start.saturating_add(span);
    l.stream_end.insert(f.stream, end);
    let e = TraceEntry {
        kind: TraceKind::Kernel,
        func: func as u8,
        device: u8::try_from(f.dev).unwrap_or(TRACE_NO_DEVICE),
        flags: TRACE_FLAG_START_ESTIMATED,
        result: 0,
        pid: crate::trace::ids().0,
        tid,
        start_ns: start,
        end_ns: end,
        bytes: 0,
        aux: function as u64,
        stream: f.stream as u64,
    };
    st.region.trace_push(&e);
}

/// Announces `function`'s name in the ring unless this trace session has already (or no trace
/// runs). Called once the driver accepted a traced launch of it: the handle is live now (it may
/// not be by the time the kernel is harvested), and the kernel's entry comes later.
fn announce(st: &ShimState, l: &mut Local, function: usize, pid: u32, tid: u32) {
    let session = st.region.trace_session();
    if session == 0 {
        return;
    }
    if session != l.names_session {
        l.names_session = session;
        l.announced.clear();
    }
    if !l.announced.insert(function) {
        return;
    }
    if let Some(name) = function_name(function) {
        for e in TraceEntry::name_chunks(pid, tid, function as u64, &name) {
            st.region.trace_push(&e);
        }
    }
}

/// The name of a `CUfunction` (or of a `CUkernel`, which launches also take) from the real
/// driver, up to one byte past what the ring carries (so that a cut is seen); None when the
/// driver cannot tell (before CUDA 12.3, or an unknown handle).
fn function_name(function: usize) -> Option<Vec<u8>> {
    let cu = real::cuda()?;
    let ask = |get: &dyn Fn(*mut *const c_char) -> CUresult| {
        let mut p: *const c_char = std::ptr::null();
        let rc = get(&mut p);
        (ok(rc) && !p.is_null()).then_some(p)
    };
    // The handle is one the driver has just accepted for a launch: a CUfunction, or a CUkernel
    // cast to one; asked of the other getter, it is an error.
    let p = cu
        .cuFuncGetName
        // SAFETY: a valid out-pointer and a handle the driver accepted.
        .and_then(|get| ask(&|p| unsafe { get(p, function as CUfunction) }))
        // SAFETY: as above.
        .or_else(|| cu.cuKernelGetName.and_then(|get| ask(&|p| unsafe { get(p, function as CUkernel) })))?;
    // SAFETY: the driver returned a NUL-terminated string that lives as long as the function.
    let name = unsafe { CStr::from_ptr(p) }.to_bytes();
    (!name.is_empty()).then(|| name[..name.len().min(TRACE_NAME_MAX + 1)].to_vec())
}
