//! What each throttled kernel really took: a CUDA event before and after it on its stream. The
//! span between the two is the kernel's time on the GPU, waiting for nothing else of its stream
//! (the "before" event completes when the stream's earlier work does). Spans are harvested when
//! complete, at the next launch, never waited for on the launch path.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use cudarc::driver::sys::{CUcontext, CUevent, CUresult, CUstream};
use tessera_region::MAX_DEVICES;

use super::{bucket, service};
use crate::real;
use crate::state::ShimState;

/// Kernels measured at once per process; beyond, the oldest is waited for.
const MAX_IN_FLIGHT: usize = 256;
/// Until a device has a measurement, a launch is charged this much.
const FIRST_GUESS_NS: i64 = 100_000;

/// A launch being measured.
pub struct Pending {
    dev: usize,
    ctx: usize,
    stream: usize,
    start: usize,
    charged: i64,
}

struct InFlight {
    dev: usize,
    ctx: usize,
    start: usize,
    end: usize,
    charged: i64,
}

#[derive(Default)]
struct Local {
    in_flight: VecDeque<InFlight>,
    /// Idle events by context (events belong to the context they were made in).
    pool: HashMap<usize, Vec<usize>>,
}

static LOCAL: Mutex<Option<Local>> = Mutex::new(None);
/// Per device: a running average of a kernel's own GPU time (ns), what a launch is charged.
static EXPECTED: [AtomicI64; MAX_DEVICES] = [const { AtomicI64::new(0) }; MAX_DEVICES];

pub fn expected_cost(dev: usize) -> i64 {
    match EXPECTED.get(dev).map(|e| e.load(Relaxed)) {
        Some(e) if e > 0 => e,
        _ => FIRST_GUESS_NS,
    }
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
    if let Some(e) = l.pool.get_mut(&ctx).and_then(Vec::pop) {
        return Some(e);
    }
    let cu = real::cuda()?;
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: e is a valid out-pointer; flags 0 (timing enabled) are valid.
    ok(unsafe { (cu.cuEventCreate)(&mut e, 0) }).then_some(e as usize)
}

fn give_back(l: &mut Local, ctx: usize, e: usize) {
    l.pool.entry(ctx).or_default().push(e);
}

/// Records the "before" event on the launch's stream. None when it cannot be measured (then
/// the launch keeps its estimated charge).
pub fn start(_st: &ShimState, dev: usize, stream: *mut c_void, charged: i64) -> Option<Pending> {
    let cu = real::cuda()?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    let mut current: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the stream is the caller's, about to be launched on.
    let same =
        unsafe { ok((cu.cuStreamGetCtx)(stream as CUstream, &mut ctx)) && ok((cu.cuCtxGetCurrent)(&mut current)) };
    if !same || ctx.is_null() || ctx != current {
        return None; // events are made in the current context; a foreign stream goes unmeasured
    }
    let ctx = ctx as usize;
    with_local(|l| {
        let start = take_event(l, ctx)?;
        // SAFETY: start is a live event of the stream's (current) context.
        if ok(unsafe { (cu.cuEventRecord)(start as CUevent, stream as CUstream) }) {
            Some(Pending { dev, ctx, stream: stream as usize, start, charged })
        } else {
            give_back(l, ctx, start);
            None
        }
    })
}

/// Records the "after" event once the driver accepted the launch; a refused launch is refunded.
pub fn finish(st: &ShimState, p: Pending, accepted: bool) {
    let stream = p.stream as *mut c_void;
    let Some(cu) = real::cuda() else { return };
    with_local(|l| {
        if !accepted {
            bucket::correct(st.region.bucket(p.dev), -p.charged);
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
        l.in_flight.push_back(InFlight { dev: p.dev, ctx: p.ctx, start: p.start, end, charged: p.charged });
    });
    // Settled at the next launch (before_launch harvests first), never here: once per launch.
}

/// Settles every measured launch that has completed: corrects its charge to its real GPU time.
pub fn harvest(st: &ShimState) {
    let Some(cu) = real::cuda() else { return };
    with_local(|l| {
        while let Some(f) = l.in_flight.front() {
            // SAFETY: a live event recorded by us.
            let rc = unsafe { (cu.cuEventQuery)(f.end as CUevent) };
            if rc == CUresult::CUDA_ERROR_NOT_READY {
                break;
            }
            let f = l.in_flight.pop_front().expect("front exists");
            let mut ms = 0f32;
            // SAFETY: both events were recorded by us on one stream and the later one completed.
            let timed = ok(rc) && ok(unsafe { (cu.cuEventElapsedTime)(&mut ms, f.start as CUevent, f.end as CUevent) });
            if timed {
                let span = (f64::from(ms) * 1e6) as i64;
                let own = service::own_time(st, f.dev, span);
                bucket::correct(st.region.bucket(f.dev), own - f.charged);
                st.region.record_gpu_time(st.slot, f.dev, own as u64);
                let e = &EXPECTED[f.dev];
                let old = e.load(Relaxed);
                e.store(if old <= 0 { own } else { old - old / 8 + own / 8 }, Relaxed);
            }
            give_back(l, f.ctx, f.start);
            give_back(l, f.ctx, f.end);
        }
    });
}
