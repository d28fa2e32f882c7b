//! The event stream: health changes, partition changes, faults and recoveries, as `tessera.v1`
//! events. Each event gets the next sequence number (kept across restarts), is logged, sent to
//! every subscriber, and kept in a ring of the last N; the ring is written to disk (crash-safe
//! whole-file replace) so a restarted daemon replays what came before.
//!
//! A subscriber that falls behind by more than the channel holds sees a gap in the sequence
//! numbers (the proto's contract), never a blocked publisher.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Mutex;

use prost::Message;
use tessera_proto::tessera::v1::{Event, EventKind, Severity};
use tokio::sync::broadcast;

/// How many events a slow subscriber may lag before it misses some.
const CHANNEL_CAPACITY: usize = 1024;

/// Publishes and keeps events.
#[derive(Debug)]
pub struct EventBus {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Event>,
}

#[derive(Debug)]
struct Inner {
    next_sequence: u64,
    kept: VecDeque<Event>,
    capacity: usize,
    file: Option<PathBuf>,
    /// Published since this bus was made (the daemon started): all, and faults.
    published: u64,
    faults: u64,
    /// The last XID seen per GPU (by UUID) since this bus was made, for `DCGM_FI_DEV_XID_ERRORS`.
    last_xid: BTreeMap<String, u32>,
}

impl EventBus {
    /// A bus keeping the last `capacity` events, in `file` when given (loaded now: sequence
    /// numbers continue after the last kept one). An unreadable file is logged and set aside,
    /// never fatal: events are reporting, not isolation.
    pub fn new(capacity: usize, file: Option<PathBuf>) -> EventBus {
        let kept = file.as_deref().map(load).unwrap_or_default();
        let next_sequence = kept.back().map_or(1, |e: &Event| e.sequence + 1);
        let (tx, _) = broadcast::channel(CHANNEL_CAPACITY);
        EventBus {
            inner: Mutex::new(Inner {
                next_sequence,
                kept,
                capacity: capacity.max(1),
                file,
                published: 0,
                faults: 0,
                last_xid: BTreeMap::new(),
            }),
            tx,
        }
    }

    /// Stamps (sequence, time), logs, keeps and sends `event`; returns its sequence number.
    pub fn publish(&self, mut event: Event) -> u64 {
        let mut inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        event.sequence = inner.next_sequence;
        inner.next_sequence += 1;
        inner.published += 1;
        if event.kind == EventKind::Fault as i32 {
            inner.faults += 1;
        }
        if event.time_unix_nano == 0 {
            event.time_unix_nano = crate::state::record::unix_ns();
        }
        log(&event);
        inner.kept.push_back(event.clone());
        while inner.kept.len() > inner.capacity {
            inner.kept.pop_front();
        }
        if let Some(file) = &inner.file {
            let mut bytes = Vec::new();
            for e in &inner.kept {
                // Length-delimited protobuf: the same encoding as on the wire.
                e.encode_length_delimited(&mut bytes).expect("a Vec grows");
            }
            if let Err(e) = crate::state::durable::write_file(file, &bytes, 0o600) {
                tracing::warn!(file = %file.display(), error = %e, "cannot keep events on disk");
            }
        }
        let sequence = event.sequence;
        // No subscriber is not an error.
        let _ = self.tx.send(event);
        sequence
    }

    /// Up to `replay` kept events (oldest first) and a receiver of every later one, taken
    /// together so nothing falls between them.
    pub fn subscribe(&self, replay: usize) -> (Vec<Event>, broadcast::Receiver<Event>) {
        let inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let skip = inner.kept.len().saturating_sub(replay);
        let past = inner.kept.iter().skip(skip).cloned().collect();
        (past, self.tx.subscribe())
    }

    /// How many events have been published over the bus's whole history (restarts included).
    pub fn published(&self) -> u64 {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner).next_sequence - 1
    }

    /// Notes an XID the health monitor saw on the GPU `gpu_uuid` (whatever the policy made of it).
    pub fn note_xid(&self, gpu_uuid: &str, xid: u32) {
        let mut inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        inner.last_xid.insert(gpu_uuid.to_string(), xid);
    }

    /// The last XID noted on each GPU (by UUID) since the daemon started; a reset keeps it, as
    /// dcgm keeps `DCGM_FI_DEV_XID_ERRORS`.
    pub fn last_xids(&self) -> BTreeMap<String, u32> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner).last_xid.clone()
    }

    /// Events and fault events published since this bus was made (the daemon started).
    pub fn since_start(&self) -> (u64, u64) {
        let inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (inner.published, inner.faults)
    }
}

fn load(file: &std::path::Path) -> VecDeque<Event> {
    let bytes = match std::fs::read(file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return VecDeque::new(),
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "cannot read kept events; starting without them");
            return VecDeque::new();
        }
    };
    let mut out = VecDeque::new();
    let mut buf = bytes.as_slice();
    while !buf.is_empty() {
        match Event::decode_length_delimited(&mut buf) {
            Ok(e) => out.push_back(e),
            Err(e) => {
                // A torn file cannot come from our writes (whole-file replace); keep what decoded
                // and set the file aside for a person to look at.
                // Beside any earlier damaged copy, never over it.
                match crate::state::durable::move_aside(file) {
                    Ok(aside) => {
                        tracing::warn!(file = %file.display(), error = %e, aside = %aside.display(), "kept events are damaged; set aside")
                    }
                    Err(why) => {
                        tracing::warn!(file = %file.display(), error = %e, move_error = %why, "kept events are damaged and cannot be set aside")
                    }
                }
                break;
            }
        }
    }
    out
}

fn log(e: &Event) {
    let kind = EventKind::try_from(e.kind).map(|k| k.as_str_name()).unwrap_or("?");
    match Severity::try_from(e.severity).unwrap_or(Severity::Unspecified) {
        Severity::Critical => {
            tracing::error!(sequence = e.sequence, kind, device = %e.device_id, message = %e.message, "event")
        }
        Severity::Warning => {
            tracing::warn!(sequence = e.sequence, kind, device = %e.device_id, message = %e.message, "event")
        }
        _ => tracing::info!(sequence = e.sequence, kind, device = %e.device_id, message = %e.message, "event"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(message: &str) -> Event {
        Event { kind: EventKind::PartitionChanged as i32, message: message.into(), ..Default::default() }
    }

    #[test]
    fn sequence_replay_and_persistence() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("events");
        let bus = EventBus::new(3, Some(file.clone()));
        let (past, mut rx) = bus.subscribe(10);
        assert!(past.is_empty());
        for m in ["a", "b", "c", "d"] {
            bus.publish(event(m));
        }
        assert_eq!(rx.try_recv().unwrap().message, "a");
        let (past, _) = bus.subscribe(2);
        assert_eq!(past.iter().map(|e| e.message.as_str()).collect::<Vec<_>>(), ["c", "d"]);
        drop(bus);
        // A restart: the last three are back, and numbering goes on.
        let bus = EventBus::new(3, Some(file.clone()));
        let (past, _) = bus.subscribe(10);
        assert_eq!(
            past.iter().map(|e| (e.sequence, e.message.as_str())).collect::<Vec<_>>(),
            [(2, "b"), (3, "c"), (4, "d")]
        );
        assert_eq!(bus.publish(event("e")), 5);
        assert_eq!(bus.published(), 5);
        // A damaged file is set aside, not fatal; a second damage is set aside beside the first.
        std::fs::write(&file, b"\xff\xff\xff").unwrap();
        let bus = EventBus::new(3, Some(file.clone()));
        assert_eq!(bus.publish(event("f")), 1);
        let aside = |n: &str| std::path::PathBuf::from(format!("{}.corrupt{n}", file.display()));
        assert_eq!(std::fs::read(aside("")).unwrap(), b"\xff\xff\xff");
        drop(bus);
        std::fs::write(&file, b"\xfe\xfe").unwrap();
        let _bus = EventBus::new(3, Some(file.clone()));
        assert_eq!(std::fs::read(aside("")).unwrap(), b"\xff\xff\xff", "the first kept");
        assert_eq!(std::fs::read(aside(".1")).unwrap(), b"\xfe\xfe");
    }

    #[test]
    fn last_xid_per_gpu_is_the_latest_noted() {
        let bus = EventBus::new(3, None);
        assert!(bus.last_xids().is_empty());
        bus.note_xid("GPU-a", 79);
        bus.note_xid("GPU-b", 13);
        bus.note_xid("GPU-a", 43);
        let last = bus.last_xids();
        assert_eq!((last["GPU-a"], last["GPU-b"], last.len()), (43, 13, 2));
    }
}
