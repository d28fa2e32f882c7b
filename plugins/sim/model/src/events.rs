//! NVML-visible events (XID errors, ECC errors, MIG changes): a ring in the state file that any
//! process can read from its own cursor, with a futex to sleep on until the next one.

use std::sync::atomic::Ordering::*;
use std::time::Duration;

use crate::clock::{monotonic_ns, realtime_us_from_monotonic};
use crate::layout::*;
use crate::region::Guard;
use crate::{Node, Result};

/// Event kinds, with NVML's nvmlEventType bit values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum EventKind {
    SingleBitEcc = 0x1,
    DoubleBitEcc = 0x2,
    XidCritical = 0x8,
    MigConfigChange = 0x100,
}

impl EventKind {
    fn from_bits(v: u32) -> Option<EventKind> {
        Some(match v {
            0x1 => EventKind::SingleBitEcc,
            0x2 => EventKind::DoubleBitEcc,
            0x8 => EventKind::XidCritical,
            0x100 => EventKind::MigConfigChange,
            _ => return None,
        })
    }
}

/// One event: which GPU (and MIG instance), what, when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub seq: u64,
    pub gpu: u32,
    pub kind: EventKind,
    /// The XID for XID events; the error count for ECC events.
    pub data: u64,
    pub gi_id: Option<u32>,
    pub ci_id: Option<u32>,
    /// Microseconds since the Unix epoch.
    pub timestamp_us: u64,
}

/// A reader's position in the event ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventCursor(pub u64);

const NONE: u32 = u32::MAX;

pub(crate) fn publish(g: &Guard, gpu: u32, kind: EventKind, data: u64, mig: Option<(u32, u32)>) {
    let h = &g.shared().header;
    let seq = h.event_seq.load(Relaxed);
    let rec = &g.shared().events[(seq % EVENT_RING as u64) as usize];
    rec.seq_plus_one.store(0, Release);
    rec.gpu.store(gpu, Relaxed);
    rec.kind.store(kind as u32, Relaxed);
    rec.data.store(data, Relaxed);
    rec.gi_id.store(mig.map_or(NONE, |m| m.0), Relaxed);
    rec.ci_id.store(mig.map_or(NONE, |m| m.1), Relaxed);
    rec.ts_us.store(realtime_us_from_monotonic(monotonic_ns()), Relaxed);
    rec.seq_plus_one.store(seq + 1, Release);
    h.event_seq.store(seq + 1, Release);
    h.event_futex.fetch_add(1, Release);
    // SAFETY: futex wake on a u32 inside our shared mapping; waking never blocks or faults.
    unsafe { libc::syscall(libc::SYS_futex, h.event_futex.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0, 0, 0) };
}

impl Node {
    /// A cursor after every event published so far.
    pub fn event_cursor(&self) -> EventCursor {
        EventCursor(self.region.shared().header.event_seq.load(Acquire))
    }

    /// The next event after `cursor` that `filter` accepts, waiting up to `timeout`.
    /// Events overwritten before they were read are skipped.
    pub fn next_event(
        &self,
        cursor: &mut EventCursor,
        filter: impl Fn(&Event) -> bool,
        timeout: Duration,
    ) -> Result<Option<Event>> {
        let h = &self.region.shared().header;
        let deadline = monotonic_ns().saturating_add(timeout.as_nanos().min(u64::MAX as u128) as u64);
        loop {
            let futex = h.event_futex.load(Acquire);
            let head = h.event_seq.load(Acquire);
            if cursor.0 + (EVENT_RING as u64) < head {
                cursor.0 = head - EVENT_RING as u64;
            }
            while cursor.0 < head {
                let seq = cursor.0;
                cursor.0 += 1;
                if let Some(ev) = self.read_event(seq)
                    && filter(&ev)
                {
                    return Ok(Some(ev));
                }
            }
            let now = monotonic_ns();
            if now >= deadline {
                return Ok(None);
            }
            let left = deadline - now;
            let ts = libc::timespec { tv_sec: (left / 1_000_000_000) as i64, tv_nsec: (left % 1_000_000_000) as i64 };
            // SAFETY: futex wait on a u32 in our shared mapping with a valid relative timeout;
            // it returns at once if the word no longer equals `futex`.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    h.event_futex.as_ptr(),
                    libc::FUTEX_WAIT,
                    futex,
                    &ts as *const libc::timespec,
                    0,
                    0,
                )
            };
        }
    }

    fn read_event(&self, seq: u64) -> Option<Event> {
        let rec = &self.region.shared().events[(seq % EVENT_RING as u64) as usize];
        if rec.seq_plus_one.load(Acquire) != seq + 1 {
            return None;
        }
        let opt = |v: u32| (v != NONE).then_some(v);
        let ev = Event {
            seq,
            gpu: rec.gpu.load(Relaxed),
            kind: EventKind::from_bits(rec.kind.load(Relaxed))?,
            data: rec.data.load(Relaxed),
            gi_id: opt(rec.gi_id.load(Relaxed)),
            ci_id: opt(rec.ci_id.load(Relaxed)),
            timestamp_us: rec.ts_us.load(Relaxed),
        };
        // A writer may have reused the record while we read it.
        (rec.seq_plus_one.load(Acquire) == seq + 1).then_some(ev)
    }
}
