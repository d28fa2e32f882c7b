//! On-demand traces of a container (`Node.Trace`, `tessera trace`): set the allocation region's
//! `trace_requested`, follow the region's trace ring for the asked seconds, clear the flag, and
//! render what the container's processes recorded (CUDA API spans, kernel spans) as a Trace Event
//! Format JSON document that Perfetto and chrome://tracing open.
//!
//! One trace per allocation at a time (a second is refused: both would clear the flag the other
//! set). The flag is cleared however the collection ends (done, client gone, daemon stopping).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{Value, json};
use tessera_region::{
    ProcessSnapshot, Region, TRACE_FLAG_START_ESTIMATED, TRACE_NO_DEVICE, TraceEntry, TraceKind, TraceNames,
    monotonic_ns,
};

/// The longest trace asked for at once.
pub const MAX_SECONDS: u32 = 60;
/// How often the ring is read while tracing (the ring holds 16,384 entries: ~330,000 events/s).
pub const POLL: Duration = Duration::from_millis(50);
/// After the flag is cleared: time for calls in progress to publish their entries.
const SETTLE: Duration = Duration::from_millis(100);
/// Synthetic thread ids of kernel tracks (one per process, device and stream) start here: above
/// any Linux thread id (pid_max ≤ 2^22), within 31 bits (what trace viewers parse).
const KERNEL_TID_BASE: u64 = 2_000_000_000;

/// Why a trace could not be made; the API maps these to status codes.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("seconds: {0} is out of range (1..={MAX_SECONDS})")]
    Seconds(u32),
    #[error("allocation_id: allocation {0:?} is already being traced")]
    Busy(String),
    #[error("allocation_id: {0}")]
    Region(#[from] tessera_region::RegionError),
}

/// What one trace collected.
#[derive(Debug, Default)]
pub struct Collected {
    /// API and kernel spans.
    pub entries: Vec<TraceEntry>,
    /// Kernel names by (pid, `CUfunction`), from the name entries of the whole trace.
    pub names: TraceNames,
    /// Entries the reader missed (overwritten before read, torn, abandoned) plus those writers
    /// dropped, during the trace.
    pub dropped: u64,
    /// The container's processes (pid → name), seen during the trace.
    pub processes: BTreeMap<u32, String>,
    /// Region device index → UUID.
    pub devices: BTreeMap<u8, String>,
    pub start_ns: u64,
    pub end_ns: u64,
}

static ACTIVE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Holds the allocation's trace slot and the flag; both released on drop.
struct Tracing<'a> {
    id: String,
    region: &'a Region,
}

impl Drop for Tracing<'_> {
    fn drop(&mut self) {
        self.region.set_trace_requested(false);
        ACTIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&self.id);
    }
}

/// Checks the asked duration.
pub fn check_seconds(seconds: u32) -> Result<Duration, TraceError> {
    if seconds == 0 || seconds > MAX_SECONDS {
        return Err(TraceError::Seconds(seconds));
    }
    Ok(Duration::from_secs(u64::from(seconds)))
}

/// Traces allocation `id`, whose region is at `region_path`, for `duration`.
pub async fn collect(id: &str, region_path: &Path, duration: Duration) -> Result<Collected, TraceError> {
    let region = Region::open_or_create(region_path)?;
    if !ACTIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(id.to_string()) {
        return Err(TraceError::Busy(id.to_string()));
    }
    let mut out = Collected::default();
    let dropped_before = region.trace_dropped();
    out.start_ns = monotonic_ns();
    let guard = Tracing { id: id.to_string(), region: &region };
    let mut cursor = region.start_trace();
    let deadline = tokio::time::Instant::now() + duration;
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            break;
        }
        tokio::time::sleep(POLL.min(deadline - now)).await;
        cursor = read(&region, cursor, false, &mut out);
        note_processes(&region, &mut out.processes);
    }
    region.set_trace_requested(false);
    out.end_ns = monotonic_ns();
    tokio::time::sleep(SETTLE).await;
    read(&region, cursor, true, &mut out);
    note_processes(&region, &mut out.processes);
    drop(guard);
    out.dropped += region.trace_dropped().saturating_sub(dropped_before);
    for i in 0..tessera_region::MAX_DEVICES {
        if let Some(u) = region.device_uuid(i) {
            out.devices.insert(i as u8, u);
        }
    }
    // Spans of calls and kernels from before the trace began (harvested late) are left out
    // (names are kept apart: they are no spans).
    let (t0, t1) = (out.start_ns, out.end_ns);
    out.entries.retain(|e| e.end_ns >= t0 && e.start_ns <= t1 && e.end_ns >= e.start_ns);
    Ok(out)
}

fn read(region: &Region, cursor: u64, last: bool, out: &mut Collected) -> u64 {
    let b = region.trace_read_since(cursor, last);
    out.dropped += b.lost;
    for e in b.entries {
        if !out.names.push(&e) {
            out.entries.push(e);
        }
    }
    b.cursor
}

fn note_processes(region: &Region, names: &mut BTreeMap<u32, String>) {
    for ProcessSnapshot { pid, comm, .. } in region.snapshot().processes {
        names.entry(pid).or_insert(comm);
    }
}

/// The Trace Event Format document: `traceEvents` (complete events `ph: "X"`, times in µs from
/// the trace's start; process and thread names as metadata events `ph: "M"`),
/// `displayTimeUnit: "ns"`, and `otherData` about the trace. A kernel span is named after its
/// function when the trace holds the function's name (announced anywhere in the trace, before
/// or after the span), else "kernel".
pub fn render(c: &Collected, allocation_id: &str, container: &str) -> Value {
    let us = |ns: u64| ns.saturating_sub(c.start_ns) as f64 / 1_000.0;
    let dur = |e: &TraceEntry| e.end_ns.saturating_sub(e.start_ns) as f64 / 1_000.0;
    let device = |d: u8| -> Value {
        if d == TRACE_NO_DEVICE {
            return Value::Null;
        }
        c.devices.get(&d).map_or_else(|| json!(d), |u| json!(u))
    };
    let mut entries: Vec<&TraceEntry> = c.entries.iter().collect();
    entries.sort_by_key(|e| (e.start_ns, e.end_ns));
    let mut events = Vec::with_capacity(entries.len() + 16);
    let mut pids = BTreeSet::new();
    let mut threads = BTreeSet::new();
    let mut kernel_tracks: HashMap<(u32, u8, u64), u64> = HashMap::new();
    for e in entries {
        pids.insert(e.pid);
        match e.kind {
            TraceKind::Api => {
                threads.insert((e.pid, e.tid));
                let mut args = serde_json::Map::new();
                args.insert("result".into(), json!(e.result));
                if e.device != TRACE_NO_DEVICE {
                    args.insert("device".into(), device(e.device));
                }
                if e.bytes != 0 {
                    args.insert("bytes".into(), json!(e.bytes));
                }
                events.push(json!({
                    "name": e.func_name(), "cat": "cuda_api", "ph": "X",
                    "ts": us(e.start_ns), "dur": dur(e), "pid": e.pid, "tid": e.tid, "args": args,
                }));
            }
            TraceKind::Kernel => {
                let next = KERNEL_TID_BASE + kernel_tracks.len() as u64;
                let tid = *kernel_tracks.entry((e.pid, e.device, e.stream)).or_insert(next);
                let timing = if e.flags & TRACE_FLAG_START_ESTIMATED != 0 {
                    "duration: GPU time between CUDA events around the kernel; start: estimated \
                     (the later of its launch and the previous kernel's end on its stream)"
                } else {
                    "GPU start and end"
                };
                let mut args = serde_json::Map::new();
                args.insert("launched_by".into(), json!(e.func_name()));
                if e.aux != 0 {
                    args.insert("function".into(), json!(format!("{:#x}", e.aux)));
                }
                args.insert("launch_tid".into(), json!(e.tid));
                args.insert("device".into(), device(e.device));
                args.insert("stream".into(), json!(format!("{:#x}", e.stream)));
                args.insert("timing".into(), json!(timing));
                let name = c.names.get(e.pid, e.aux).filter(|_| e.aux != 0).unwrap_or("kernel");
                events.push(json!({
                    "name": name, "cat": "kernel", "ph": "X",
                    "ts": us(e.start_ns), "dur": dur(e), "pid": e.pid, "tid": tid, "args": args,
                }));
            }
            TraceKind::Name => {} // kept in `names`, never among the spans
        }
    }
    let mut meta = Vec::new();
    for pid in &pids {
        let name = c.processes.get(pid).map_or_else(|| format!("pid {pid}"), |n| format!("{n} (pid {pid})"));
        meta.push(json!({"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0, "args": {"name": name}}));
    }
    for (pid, tid) in &threads {
        meta.push(json!({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid,
            "args": {"name": format!("thread {tid}")}}));
    }
    let mut tracks: Vec<_> = kernel_tracks.into_iter().collect();
    tracks.sort_by_key(|&(_, tid)| tid);
    for ((pid, dev, stream), tid) in tracks {
        let name =
            format!("GPU {} stream {stream:#x}", if dev == TRACE_NO_DEVICE { "?".into() } else { dev.to_string() });
        meta.push(json!({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}}));
        meta.push(json!({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": tid,
            "args": {"sort_index": tid}}));
    }
    meta.extend(events);
    json!({
        "traceEvents": meta,
        "displayTimeUnit": "ns",
        "otherData": {
            "allocation_id": allocation_id,
            "container": container,
            "duration_us": us(c.end_ns),
            "events": c.entries.len(),
            "dropped": c.dropped,
            "clock": "CLOCK_MONOTONIC, µs from the trace's start",
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_region::TraceFunc;

    #[test]
    fn seconds_are_checked() {
        assert!(check_seconds(0).unwrap_err().to_string().starts_with("seconds:"));
        assert!(check_seconds(61).unwrap_err().to_string().starts_with("seconds:"));
        assert_eq!(check_seconds(60).unwrap(), Duration::from_secs(60));
    }

    #[test]
    fn renders_api_and_kernel_spans_with_metadata() {
        let mut c = Collected { start_ns: 1_000_000, end_ns: 2_000_000, ..Default::default() };
        c.processes.insert(7, "train".into());
        c.devices.insert(0, "GPU-x".into());
        let mut api = TraceEntry::api(TraceFunc::cuMemAlloc_v2, 7, 8, 1_100_000, 1_102_000);
        api.bytes = 4096;
        api.device = 0;
        let mut k = TraceEntry::api(TraceFunc::cuLaunchKernel, 7, 8, 1_200_000, 1_450_000);
        k.kind = TraceKind::Kernel;
        k.device = 0;
        k.stream = 0x10;
        k.flags = TRACE_FLAG_START_ESTIMATED;
        c.entries = vec![k, api];
        let v = render(&c, "a1", "ns/pod/ctr");
        assert_eq!(v["displayTimeUnit"], "ns");
        let ev = v["traceEvents"].as_array().unwrap();
        let x: Vec<_> = ev.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), 2);
        assert_eq!(x[0]["name"], "cuMemAlloc_v2");
        assert_eq!(x[0]["ts"], 100.0);
        assert_eq!(x[0]["dur"], 2.0);
        assert_eq!(x[0]["args"]["bytes"], 4096);
        assert_eq!(x[0]["args"]["device"], "GPU-x");
        assert_eq!(x[1]["cat"], "kernel");
        assert_eq!(x[1]["dur"], 250.0);
        assert_eq!(x[1]["tid"], KERNEL_TID_BASE);
        assert_eq!(x[1]["args"]["launched_by"], "cuLaunchKernel");
        let names: Vec<_> = ev.iter().filter(|e| e["ph"] == "M").map(|e| e["args"]["name"].clone()).collect();
        assert!(names.contains(&json!("train (pid 7)")), "{names:?}");
        assert!(names.contains(&json!("GPU 0 stream 0x10")), "{names:?}");
        assert_eq!(v["otherData"]["events"], 2);
    }

    /// Kernel spans carry their function's name, also when the name entries came after the
    /// kernel's in the ring; a kernel whose name is unknown (or lost) stays "kernel".
    #[test]
    fn kernels_are_named_after_their_function() {
        let region = Region::anonymous().unwrap();
        let kernel = |f: u64, at: u64| {
            let mut k = TraceEntry::api(TraceFunc::cuLaunchKernel, 7, 8, at, at + 1_000);
            k.kind = TraceKind::Kernel;
            k.device = 0;
            k.stream = 0x10;
            k.aux = f;
            k
        };
        let named = b"_Z11vector_addPKfS0_Pfi";
        let mut c = Collected { start_ns: 1_000_000, end_ns: 2_000_000, ..Default::default() };
        // The kernel is read in one batch, its name in the next.
        region.trace_push(&kernel(0xa0, 1_100_000));
        let cursor = read(&region, 0, false, &mut c);
        for e in TraceEntry::name_chunks(7, 8, 0xa0, named) {
            region.trace_push(&e);
        }
        region.trace_push(&kernel(0xb0, 1_200_000));
        region.trace_push(&TraceEntry::api(TraceFunc::cuInit, 7, 8, 1_300_000, 1_300_100));
        assert_eq!(read(&region, cursor, true, &mut c), 1 + 1 + 1 + 1);
        assert_eq!(c.entries.len(), 3, "name entries are not spans");
        assert_eq!(c.names.get(7, 0xa0), Some("_Z11vector_addPKfS0_Pfi"));
        let v = render(&c, "a1", "ns/pod/ctr");
        let k: Vec<_> = v["traceEvents"].as_array().unwrap().iter().filter(|e| e["cat"] == "kernel").cloned().collect();
        assert_eq!(k.len(), 2);
        assert_eq!(k[0]["name"], "_Z11vector_addPKfS0_Pfi");
        assert_eq!(k[0]["args"]["function"], "0xa0");
        assert_eq!(k[0]["args"]["launched_by"], "cuLaunchKernel");
        assert_eq!(k[1]["name"], "kernel");
        assert_eq!(k[1]["args"]["function"], "0xb0");
        assert_eq!(k[0]["tid"], k[1]["tid"], "one stream track");
        assert_eq!(v["otherData"]["events"], 3);
    }
}
