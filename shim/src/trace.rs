//! On-demand tracing (docs/shim.md, "Tracing"): while the daemon sets the region's
//! `trace_requested`, every intercepted CUDA call is recorded as an API span (entry to return, on
//! the calling thread) and every launched kernel, once its completion is measured
//! (`compute::measure`), as a kernel span, into the region's trace ring. A kernel's function name
//! is announced once per trace session (`measure::announce`), before its first kernel span.
//!
//! Not tracing costs one relaxed load per intercepted call (the flag, read by the hook prologue);
//! allocation hooks also note their size in a thread-local (`note`), read only by a traced call.
//! Tracing costs two clock reads (vDSO), a few thread-local accesses and one ring push (a
//! `fetch_add`, a CAS and nine stores) per call, plus two CUDA events per kernel.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use tessera_region::{TRACE_NO_DEVICE, TraceEntry, TraceFunc, monotonic_ns};

use crate::ffi::CUresult;
use crate::state::ShimState;

/// A traced launch: the hook it came through and the kernel's `CUfunction` (0: none, as for a
/// graph launch).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Launch {
    pub func: TraceFunc,
    pub function: usize,
}

/// This process's pid (0: not read yet). A child forked without exec keeps its parent's, as it
/// keeps its parent's region slot.
static PID: AtomicU32 = AtomicU32::new(0);

thread_local! {
    /// This thread's id (0: not read yet).
    static TID: Cell<u32> = const { Cell::new(0) };
    /// What the current call's hook noted: region device index + 1 (0: none) and bytes.
    static NOTE: Cell<(u32, u64)> = const { Cell::new((0, 0)) };
}

/// `(pid, tid)` of the calling thread, as the container's PID namespace numbers them.
pub(crate) fn ids() -> (u32, u32) {
    let mut pid = PID.load(Relaxed);
    if pid == 0 {
        pid = std::process::id();
        PID.store(pid, Relaxed);
    }
    let tid = TID.with(|t| {
        if t.get() == 0 {
            // SAFETY: gettid takes no arguments and cannot fail (a raw syscall: the library is
            // built against glibc 2.17, which has no gettid wrapper).
            let id = unsafe { libc::syscall(libc::SYS_gettid) };
            t.set(u32::try_from(id).unwrap_or(0));
        }
        t.get()
    });
    (pid, tid)
}

/// An allocation hook notes the device and size it charges, for the API span of its call.
#[inline]
pub(crate) fn note(dev: usize, bytes: u64) {
    NOTE.set((u32::try_from(dev).map_or(0, |d| d.saturating_add(1)), bytes));
}

/// Runs `body` (an intercepted call) and records it as an API span of `func`; `dev`: the region
/// device it is on, when known up front.
#[cold]
#[inline(never)]
pub(crate) fn api(st: &ShimState, func: TraceFunc, dev: Option<usize>, body: impl FnOnce() -> CUresult) -> CUresult {
    NOTE.set((0, 0));
    let start = monotonic_ns();
    let rc = body();
    let end = monotonic_ns();
    let (noted_dev, bytes) = NOTE.replace((0, 0));
    let device = match dev {
        Some(d) => u8::try_from(d).unwrap_or(TRACE_NO_DEVICE),
        None if noted_dev != 0 => u8::try_from(noted_dev - 1).unwrap_or(TRACE_NO_DEVICE),
        None => TRACE_NO_DEVICE,
    };
    let (pid, tid) = ids();
    let mut e = TraceEntry::api(func, pid, tid, start, end);
    e.device = device;
    e.bytes = bytes;
    e.result = rc as u32;
    st.region.trace_push(&e);
    rc
}
