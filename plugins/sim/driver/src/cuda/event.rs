//! Events: recorded at a stream's tail and stamped by the model with the instant the stream
//! reached them, so elapsed times are what the GPU would measure, time-slicing included.
//!
//! `cuStreamWaitEvent` across streams holds the calling thread until the event completes (the
//! model has no dependencies between streams): work queued after it starts after the event, as on
//! a real GPU, but the call itself is synchronous.

use std::ffi::c_uint;
use std::sync::{Arc, Mutex, MutexGuard};

use tessera_abi::cuda_exports;
use tessera_sim_model::{EventMark, Node, SimError, monotonic_ns};

use super::context::{self, Ctx};
use super::errors::{Cu, During, poll_faults, sim};
use super::graph::Capture;
use super::handles;
use super::init::driver;
use super::stream::{Target, resolve_with};
use super::{CUresult, INVALID_HANDLE, INVALID_VALUE, NOT_READY, R, need, put, run, sys};

/// `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS`.
const EVENT_FLAGS: c_uint = 0x7;
const EVENT_DISABLE_TIMING: c_uint = 0x2;
const EVENT_INTERPROCESS: c_uint = 0x4;
/// `CU_EVENT_RECORD_EXTERNAL`, `CU_EVENT_WAIT_EXTERNAL`.
const EVENT_RECORD_EXTERNAL: c_uint = 0x1;
const EVENT_WAIT_EXTERNAL: c_uint = 0x1;

pub(crate) enum EvState {
    /// Never recorded: complete, with no time.
    Never,
    Pending(EventMark),
    /// Complete at this monotonic instant.
    Done(u64),
    /// Last recorded in a capturing stream.
    Captured(Arc<Capture>),
}

pub(crate) struct Event {
    pub ctx: Arc<Ctx>,
    pub flags: c_uint,
    pub state: Mutex<EvState>,
}

impl Event {
    fn state(&self) -> MutexGuard<'_, EvState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Releases the model's pending entry of a recorded event.
    pub(crate) fn forget(&self, node: &Node) {
        if let EvState::Pending(m) = &*self.state() {
            node.event_forget(m);
        }
    }

    /// Polls a recorded event: whether it is complete (its state then `Done`).
    fn poll(&self, node: &Node) -> R<bool> {
        let mut st = self.state();
        match &mut *st {
            EvState::Never | EvState::Done(_) => Ok(true),
            EvState::Captured(_) => Err(CUresult::CUDA_ERROR_CAPTURED_EVENT),
            EvState::Pending(m) => {
                let done = match node.event_poll(m) {
                    Ok(true) => m.done_at().unwrap_or_else(monotonic_ns),
                    Ok(false) => return Ok(false),
                    // The stream was destroyed: its work completed or was dropped.
                    Err(SimError::InvalidArgument(_)) => monotonic_ns(),
                    Err(e) => return Err(sim(&e, During::Sync)),
                };
                *st = EvState::Done(done);
                Ok(true)
            }
        }
    }

    /// Waits for a recorded event to complete.
    fn wait(&self, node: &Node) -> R {
        loop {
            let mut mark = match &*self.state() {
                EvState::Pending(m) => *m,
                EvState::Captured(_) => return Err(CUresult::CUDA_ERROR_CAPTURED_EVENT),
                _ => return Ok(()),
            };
            let done = match node.event_wait(&mut mark) {
                Ok(t) => t,
                Err(SimError::InvalidArgument(_)) => monotonic_ns(),
                Err(e) => return Err(sim(&e, During::Sync)),
            };
            let mut st = self.state();
            if let EvState::Pending(m) = &*st {
                if m.stream != mark.stream || m.ticket != mark.ticket {
                    continue; // re-recorded meanwhile: wait for the new record
                }
                *st = EvState::Done(done);
            }
            return Ok(());
        }
    }
}

fn event(h: sys::CUevent) -> R<Arc<Event>> {
    handles::read().events.get(&(h as usize)).cloned().ok_or(INVALID_HANDLE)
}

cuda_exports! {
    fn cuEventCreate(phEvent, Flags) {
        run(|| {
            need(phEvent)?;
            if Flags & !EVENT_FLAGS != 0 || (Flags & EVENT_INTERPROCESS != 0 && Flags & EVENT_DISABLE_TIMING == 0) {
                return Err(INVALID_VALUE);
            }
            let node = driver()?.node;
            poll_faults(node)?;
            let ctx = context::current()?;
            ctx.check(node)?;
            let handle = handles::new_handle();
            let ev = Event { ctx, flags: Flags, state: Mutex::new(EvState::Never) };
            handles::write().events.insert(handle, Arc::new(ev));
            // SAFETY: phEvent is the caller's out-pointer (checked above).
            unsafe { put(phEvent, handles::as_ptr(handle)) }
        })
    }
}

/// The event `h`, on a node with no fault pending, its context able to synchronize.
fn event_to_sync(h: sys::CUevent) -> R<(&'static Node, Arc<Event>)> {
    let node = driver()?.node;
    poll_faults(node)?;
    let ev = event(h)?;
    ev.ctx.check_sync(node)?;
    Ok((node, ev))
}

/// The event `h` and what `stream` resolves to (its context able to take work), read under one
/// lock of the registry, on a node with no fault pending.
fn event_and_stream(h: sys::CUevent, stream: sys::CUstream, pt: bool) -> R<(&'static Node, Arc<Event>, Target)> {
    resolve_with(stream, pt, |reg| reg.events.get(&(h as usize)).cloned().ok_or(INVALID_HANDLE))
}

fn record(h: sys::CUevent, stream: sys::CUstream, flags: c_uint, pt: bool) -> R {
    if flags & !EVENT_RECORD_EXTERNAL != 0 {
        return Err(INVALID_VALUE);
    }
    let (node, ev, target) = event_and_stream(h, stream, pt)?;
    if ev.ctx.handle != target.ctx.handle {
        return Err(INVALID_HANDLE);
    }
    if let Some(c) = target.capture() {
        // Inside a capture an event marks a point of the graph other streams may join at.
        *ev.state() = EvState::Captured(c);
        return Ok(());
    }
    let mark = node.event_record(target.sid).work()?;
    let mut st = ev.state();
    if let EvState::Pending(old) = &*st {
        node.event_forget(old);
    }
    *st = match mark.done_at() {
        Some(t) => EvState::Done(t),
        None => EvState::Pending(mark),
    };
    Ok(())
}

cuda_exports! {
    fn cuEventRecord(hEvent, hStream) twin cuEventRecord_ptsz(per_thread) {
        run(|| record(hEvent, hStream, 0, per_thread))
    }

    fn cuEventRecordWithFlags(hEvent, hStream, flags) twin cuEventRecordWithFlags_ptsz(per_thread) {
        run(|| record(hEvent, hStream, flags, per_thread))
    }

    fn cuEventQuery(hEvent) {
        run(|| {
            let (node, ev) = event_to_sync(hEvent)?;
            if ev.poll(node)? { Ok(()) } else { Err(NOT_READY) }
        })
    }

    fn cuEventSynchronize(hEvent) {
        run(|| {
            let (node, ev) = event_to_sync(hEvent)?;
            ev.wait(node)?;
            ev.ctx.check_sync(node)
        })
    }
}

fn elapsed(ms: *mut f32, start: sys::CUevent, end: sys::CUevent) -> R {
    need(ms)?;
    let node = driver()?.node;
    poll_faults(node)?;
    let (a, b) = (event(start)?, event(end)?);
    if (a.flags | b.flags) & EVENT_DISABLE_TIMING != 0 {
        return Err(INVALID_HANDLE);
    }
    a.ctx.check_sync(node)?;
    let stamp = |e: &Event| -> R<Option<u64>> {
        if matches!(&*e.state(), EvState::Never) {
            return Err(INVALID_HANDLE);
        }
        if !e.poll(node)? {
            return Ok(None);
        }
        Ok(match &*e.state() {
            EvState::Done(t) => Some(*t),
            _ => None,
        })
    };
    let (ta, tb) = (stamp(&a)?, stamp(&b)?);
    let (Some(ta), Some(tb)) = (ta, tb) else { return Err(NOT_READY) };
    let v = (tb as i128 - ta as i128) as f64 / 1e6;
    // SAFETY: ms is the caller's out-pointer (checked above).
    unsafe { put(ms, v as f32) }
}

cuda_exports! {
    fn cuEventElapsedTime(pMilliseconds, hStart, hEnd) also cuEventElapsedTime_v2 {
        run(|| elapsed(pMilliseconds, hStart, hEnd))
    }
}

fn destroy(h: sys::CUevent) -> R {
    let node = driver()?.node;
    let ev = handles::write().events.remove(&(h as usize)).ok_or(INVALID_HANDLE)?;
    ev.forget(node);
    Ok(())
}

cuda_exports! {
    fn cuEventDestroy_v2(hEvent) also cuEventDestroy {
        run(|| destroy(hEvent))
    }
}

fn wait_event(stream: sys::CUstream, h: sys::CUevent, flags: c_uint, pt: bool) -> R {
    if flags & !EVENT_WAIT_EXTERNAL != 0 {
        return Err(INVALID_VALUE);
    }
    let (node, ev, target) = event_and_stream(h, stream, pt)?;
    let capturing = target.capture();
    let mark = match &*ev.state() {
        EvState::Never | EvState::Done(_) => return Ok(()),
        EvState::Captured(c) => {
            return match (&capturing, &target.stream) {
                (Some(mine), _) if Arc::ptr_eq(mine, c) => Ok(()),
                (Some(_), _) => Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE),
                // The stream joins the capture the event was recorded in.
                (None, Some(s)) => {
                    s.set_capture(Some(c.clone()));
                    c.join(s.handle);
                    Ok(())
                }
                (None, None) => Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT),
            };
        }
        EvState::Pending(m) => *m,
    };
    if capturing.is_some() {
        // A captured stream cannot depend on work outside the capture.
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    }
    if mark.stream == target.sid {
        return Ok(()); // stream order already puts it after the event
    }
    ev.wait(node)
}

cuda_exports! {
    fn cuStreamWaitEvent(hStream, hEvent, Flags) twin cuStreamWaitEvent_ptsz(per_thread) {
        run(|| wait_event(hStream, hEvent, Flags, per_thread))
    }
}
