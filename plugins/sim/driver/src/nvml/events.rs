//! Events: event sets read the model's node-wide event ring from their own cursor and deliver
//! the events registered for each GPU (XID errors, ECC errors, MIG configuration changes).
//!
//! A GPU that falls off the bus raises XID 79 (delivered like any XID); a wait that then times
//! out with a registered GPU still lost answers `NVML_ERROR_GPU_IS_LOST`.

use std::sync::Mutex;
use std::time::Duration;

use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::{Event, EventCursor, EventKind, MAX_GPUS, Node};

use super::handles::{self, MAX_EVENT_SETS, event_set_handle, event_set_slot, gpu_handle};
use super::*;

/// Bits of `nvmlEventTypeAll` (every type the header defines).
const ALL_TYPES: u64 = nvmlEventTypeAll as u64;
/// Event type bits an event set tracks registration time for.
const TYPE_BITS: usize = 16;
/// `gpuInstanceId` / `computeInstanceId` of an event not attributable to a MIG instance.
const NO_INSTANCE: u32 = 0xFFFF_FFFF;

/// Types a simulated GPU supports: ECC, performance state, XID, clock changes, and MIG changes
/// on MIG-capable boards.
fn supported(node: &Node, gpu: u32) -> R<u64> {
    let base = u64::from(
        nvmlEventTypeSingleBitEccError
            | nvmlEventTypeDoubleBitEccError
            | nvmlEventTypePState
            | nvmlEventTypeXidCriticalError
            | nvmlEventTypeClock,
    );
    let mig = if node.gpu(gpu).nv()?.model.mig.is_some() { u64::from(nvmlEventMigConfigChange) } else { 0 };
    Ok(base | mig)
}

/// One event set: its cursor in the node's ring and, per GPU and type bit, the sequence number
/// from which events count (registration time; `u64::MAX`: not registered).
#[derive(Clone)]
struct EventSet {
    cursor: EventCursor,
    since: [[u64; TYPE_BITS]; MAX_GPUS],
}

impl EventSet {
    fn wants(&self, ev: &Event) -> bool {
        let bit = (ev.kind as u64).trailing_zeros() as usize;
        (ev.gpu as usize) < MAX_GPUS && bit < TYPE_BITS && self.since[ev.gpu as usize][bit] <= ev.seq
    }

    fn registered_gpus(&self) -> impl Iterator<Item = u32> + '_ {
        self.since.iter().enumerate().filter(|(_, s)| s.iter().any(|&v| v != u64::MAX)).map(|(g, _)| g as u32)
    }
}

static SETS: [Mutex<Option<EventSet>>; MAX_EVENT_SETS] = [const { Mutex::new(None) }; MAX_EVENT_SETS];

fn slot(k: usize) -> std::sync::MutexGuard<'static, Option<EventSet>> {
    SETS[k].lock().unwrap_or_else(|e| e.into_inner())
}

/// Closes every event set (the last `nvmlShutdown`).
pub(super) fn free_all() {
    for k in 0..MAX_EVENT_SETS {
        *slot(k) = None;
    }
}

/// The slot of a valid, open event set.
fn open_set(set: nvmlEventSet_t) -> R<usize> {
    let k = event_set_slot(set)?;
    if slot(k).is_none() {
        return Err(INVALID_ARGUMENT);
    }
    Ok(k)
}

nvml_guarded_exports! {
    /// `nvmlEventSetCreate`: an empty set; events published from now on can be delivered to it.
    fn nvmlEventSetCreate(set) {
        let node = node()?;
        need(set)?;
        for k in 0..MAX_EVENT_SETS {
            let mut s = slot(k);
            if s.is_none() {
                *s = Some(EventSet { cursor: node.event_cursor(), since: [[u64::MAX; TYPE_BITS]; MAX_GPUS] });
                // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
                return unsafe { put(set, event_set_handle(k)) };
            }
        }
        Err(MEMORY)
    }

    /// `nvmlDeviceGetSupportedEventTypes`.
    fn nvmlDeviceGetSupportedEventTypes(device, event_types) {
        let node = node()?;
        let gpu = handles::whole_gpu(node, device)?;
        need(event_types)?;
        let t = supported(node, gpu)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(event_types, t) }
    }

    /// `nvmlDeviceRegisterEvents`: records `eventTypes` of a GPU from now on. Unknown bits are
    /// `INVALID_ARGUMENT`; a type the GPU does not support makes the call `NOT_SUPPORTED` and
    /// registers nothing; MIG device handles are not supported (events come through the parent).
    fn nvmlDeviceRegisterEvents(device, event_types, set) {
        let node = node()?;
        let k = open_set(set)?;
        if event_types & !ALL_TYPES != 0 {
            return Err(INVALID_ARGUMENT);
        }
        let gpu = handles::whole_gpu(node, device)?;
        if event_types & !supported(node, gpu)? != 0 {
            return Err(NOT_SUPPORTED);
        }
        let now = node.event_cursor().0;
        let mut s = slot(k);
        let s = s.as_mut().ok_or(INVALID_ARGUMENT)?;
        for bit in 0..TYPE_BITS {
            let since = &mut s.since[gpu as usize][bit];
            if event_types & (1 << bit) != 0 && *since == u64::MAX {
                *since = now;
            }
        }
        Ok(())
    }
}

/// Waits for the next event of a set: `Ok(None)` on timeout.
fn wait(node: &Node, k: usize, timeout_ms: u32) -> R<Option<Event>> {
    let snapshot = slot(k).clone().ok_or(INVALID_ARGUMENT)?;
    let mut cursor = snapshot.cursor;
    let ev = node.next_event(&mut cursor, |e| snapshot.wants(e), Duration::from_millis(u64::from(timeout_ms))).nv()?;
    if let Some(s) = slot(k).as_mut() {
        s.cursor = EventCursor(s.cursor.0.max(cursor.0));
    }
    if ev.is_none() && snapshot.registered_gpus().any(|g| node.is_lost(g)) {
        return Err(GPU_IS_LOST);
    }
    Ok(ev)
}

/// An event as `nvmlEventData_t`: the XID in `eventData` for XID events (0 for others), MIG ids
/// for XIDs attributed to a MIG instance.
fn event_data(ev: &Event) -> nvmlEventData_t {
    let xid = ev.kind == EventKind::XidCritical;
    nvmlEventData_t {
        device: gpu_handle(ev.gpu),
        eventType: ev.kind as u64,
        eventData: if xid { ev.data } else { 0 },
        gpuInstanceId: if xid { ev.gi_id.unwrap_or(NO_INSTANCE) } else { NO_INSTANCE },
        computeInstanceId: if xid { ev.ci_id.unwrap_or(NO_INSTANCE) } else { NO_INSTANCE },
    }
}

nvml_guarded_exports! {
    /// `nvmlEventSetWait_v2`: the next registered event, waiting up to `timeoutms` milliseconds
    /// (`NVML_ERROR_TIMEOUT` when none comes).
    fn nvmlEventSetWait_v2(set, data, timeoutms) {
        let node = node()?;
        let k = open_set(set)?;
        need(data)?;
        let ev = wait(node, k, timeoutms)?.ok_or(TIMEOUT)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(data, event_data(&ev)) }
    }
}

/// `nvmlEventData_t` as `nvmlEventSetWait` (v1) writes it: without the MIG instance ids.
#[repr(C)]
#[derive(Clone, Copy)]
struct EventDataV1 {
    device: nvmlDevice_t,
    event_type: u64,
    event_data: u64,
}

nvml_guarded_exports! {
    /// `nvmlEventSetWait` (v1).
    fn nvmlEventSetWait(set, data, timeoutms) {
        let node = node()?;
        let k = open_set(set)?;
        let out = data.cast::<EventDataV1>();
        need(out)?;
        let ev = wait(node, k, timeoutms)?.ok_or(TIMEOUT)?;
        let d = event_data(&ev);
        // SAFETY: checked non-null and aligned; the v1 struct is a prefix of the caller's.
        unsafe { put(out, EventDataV1 { device: d.device, event_type: d.eventType, event_data: d.eventData }) }
    }

    /// `nvmlEventSetFree`.
    fn nvmlEventSetFree(set) {
        node()?;
        let k = open_set(set)?;
        *slot(k) = None;
        Ok(())
    }
}
