//! On-demand tracing: a ring of trace entries in the region, written by every process of the
//! container while the daemon asks for a trace (`Header::trace_requested`), read by the daemon.
//!
//! # The ring
//! [`TRACE_CAPACITY`] entries of one cache line each (so concurrent writers never share a line),
//! after a write index on a line of its own. Lock-free and multi-producer:
//! 1. a writer takes a ticket with `fetch_add` on the write index: entry `ticket % capacity`;
//! 2. claims the entry with a CAS of its stamp from whatever published value it holds to `BUSY`
//!    (a writer finding the entry `BUSY` — another one lapped the ring onto it — drops its own
//!    entry and counts it in `dropped`);
//! 3. writes the fields, then publishes by storing the stamp `ticket + 1` (Release).
//!
//! A reader wants ticket `t`: it reads the stamp (Acquire), then the fields, then the stamp again
//! (after an Acquire fence). Both must be `t + 1`: any writer that touched the fields in between
//! first changed the stamp to `BUSY` and then to its own, larger ticket. Entries overwritten
//! before they were read are counted as lost by the reader ([`TraceBatch::lost`]).
//!
//! A writer killed between claim and publish leaves its entry `BUSY`: later laps drop their
//! entries there (counted), nothing else is harmed.
//!
//! Times are CLOCK_MONOTONIC ns ([`crate::monotonic_ns`]): one clock for every process on the node.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicU64, fence};

use crate::region::Region;

/// Entries in the ring (a power of two).
pub const TRACE_CAPACITY: usize = 16_384;
/// The stamp of an entry a writer is filling.
const BUSY: u64 = u64::MAX;
/// An unpublished entry this many tickets behind the write index is taken as abandoned (its
/// writer died or stalled) and skipped by readers, instead of holding them back.
const STALE_TICKETS: u64 = 1_024;

/// One entry as stored: eight words, one cache line.
#[repr(C, align(64))]
pub struct TraceSlot {
    /// `ticket + 1` once published; 0 never written; `BUSY` being written.
    pub stamp: AtomicU64,
    pub start_ns: AtomicU64,
    pub end_ns: AtomicU64,
    pub bytes: AtomicU64,
    /// kind (8 bits) | func << 8 (8) | device << 16 (8) | flags << 24 (8) | result << 32 (32).
    pub meta: AtomicU64,
    /// pid << 32 | tid.
    pub pid_tid: AtomicU64,
    /// Kernels: the `CUfunction` handle; API calls: 0.
    pub aux: AtomicU64,
    /// Kernels: the stream handle; API calls: 0.
    pub stream: AtomicU64,
}

/// The ring in the region (see the module docs).
#[repr(C)]
pub struct TraceRing {
    /// Tickets handed out so far.
    pub write: AtomicU64,
    /// Entries writers dropped (their entry was still being written by a writer a lap behind).
    pub dropped: AtomicU64,
    pub _reserved: [AtomicU64; 6],
    pub entries: [TraceSlot; TRACE_CAPACITY],
}

const _: () = {
    assert!(std::mem::size_of::<TraceSlot>() == 64);
    assert!(std::mem::size_of::<TraceRing>() == 64 + 64 * TRACE_CAPACITY);
    assert!(TRACE_CAPACITY.is_power_of_two());
};

/// What an entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TraceKind {
    /// An intercepted driver call: entry to return, on the calling thread.
    Api = 1,
    /// A kernel's execution on the GPU (see [`TraceEntry::flags`] for how it was timed).
    Kernel = 2,
}

/// [`TraceEntry::flags`]: the kernel's GPU duration comes from CUDA events around it; its start
/// is estimated as the later of its launch and the previous measured kernel's end on its stream.
pub const TRACE_FLAG_START_ESTIMATED: u8 = 1;

/// [`TraceEntry::device`] when no device is known.
pub const TRACE_NO_DEVICE: u8 = u8::MAX;

macro_rules! trace_funcs {
    ($($name:ident),* $(,)?) => {
        /// The intercepted driver functions, by id (stable: append only, never renumber — the
        /// shim and the daemon may be built apart).
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum TraceFunc {
            Unknown = 0,
            $($name),*
        }

        /// Names of [`TraceFunc`] ids, indexed by id.
        pub const TRACE_FUNC_NAMES: &[&str] = &["unknown", $(stringify!($name)),*];
    };
}

trace_funcs! {
    cuInit,
    cuMemAlloc_v2, cuMemAlloc, cuMemAllocManaged, cuMemFree_v2, cuMemFree,
    cuMemAllocPitch_v2, cuMemAllocPitch,
    cuMemAllocAsync, cuMemAllocAsync_ptsz, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz,
    cuMemFreeAsync, cuMemFreeAsync_ptsz,
    cuMemCreate, cuMemRelease,
    cuArrayCreate_v2, cuArrayCreate, cuArray3DCreate_v2, cuArray3DCreate, cuArrayDestroy,
    cuMemGetInfo_v2, cuMemGetInfo, cuDeviceTotalMem_v2, cuDeviceTotalMem,
    cuCtxCreate_v2, cuCtxCreate, cuCtxCreate_v3, cuCtxCreate_v4, cuCtxDestroy_v2, cuCtxDestroy,
    cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease,
    cuDevicePrimaryCtxReset_v2, cuDevicePrimaryCtxReset,
    cuLaunchKernel, cuLaunchKernel_ptsz, cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz,
    cuLaunchKernelEx, cuLaunchKernelEx_ptsz, cuGraphLaunch, cuGraphLaunch_ptsz,
}

impl TraceFunc {
    /// The name of function id `id` (`"unknown"` for ids this build does not know).
    pub fn name_of(id: u8) -> &'static str {
        TRACE_FUNC_NAMES.get(usize::from(id)).copied().unwrap_or("unknown")
    }

    pub fn name(self) -> &'static str {
        TraceFunc::name_of(self as u8)
    }
}

/// One trace entry, as written and as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEntry {
    pub kind: TraceKind,
    /// A [`TraceFunc`] id: the call, or for a kernel the call that launched it.
    pub func: u8,
    /// Region device index; [`TRACE_NO_DEVICE`]: none.
    pub device: u8,
    /// `TRACE_FLAG_*`.
    pub flags: u8,
    /// The call's `CUresult` (API calls).
    pub result: u32,
    /// Pid and thread id in the container's PID namespace.
    pub pid: u32,
    pub tid: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Bytes the call allocated or moved; 0: none or not known.
    pub bytes: u64,
    /// Kernels: the `CUfunction` handle.
    pub aux: u64,
    /// Kernels: the stream handle.
    pub stream: u64,
}

impl TraceEntry {
    /// An API span of `func` on the calling thread.
    pub fn api(func: TraceFunc, pid: u32, tid: u32, start_ns: u64, end_ns: u64) -> TraceEntry {
        TraceEntry {
            kind: TraceKind::Api,
            func: func as u8,
            device: TRACE_NO_DEVICE,
            flags: 0,
            result: 0,
            pid,
            tid,
            start_ns,
            end_ns,
            bytes: 0,
            aux: 0,
            stream: 0,
        }
    }

    pub fn func_name(&self) -> &'static str {
        TraceFunc::name_of(self.func)
    }
}

/// What [`Region::trace_read_since`] returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceBatch {
    /// Published entries from the cursor on, in ticket order.
    pub entries: Vec<TraceEntry>,
    /// Where the next read starts.
    pub cursor: u64,
    /// Tickets passed over: overwritten before this read, torn by a lapping writer, or abandoned.
    pub lost: u64,
}

impl Region {
    fn ring(&self) -> &TraceRing {
        &self.layout().trace
    }

    /// Whether the daemon asks for a trace: one relaxed load.
    #[inline(always)]
    pub fn trace_requested(&self) -> bool {
        self.layout().header.trace_requested.load(Relaxed) != 0
    }

    pub fn set_trace_requested(&self, on: bool) {
        self.layout().header.trace_requested.store(u32::from(on), Relaxed);
    }

    /// Appends `e` to the ring. Lock-free, no allocation, no syscall: a `fetch_add`, a CAS and
    /// nine stores. False when the entry was dropped (its ring entry was being written by a
    /// writer a whole lap behind).
    #[inline]
    pub fn trace_push(&self, e: &TraceEntry) -> bool {
        let r = self.ring();
        let ticket = r.write.fetch_add(1, Relaxed);
        let slot = &r.entries[(ticket as usize) & (TRACE_CAPACITY - 1)];
        let cur = slot.stamp.load(Relaxed);
        if cur == BUSY || slot.stamp.compare_exchange(cur, BUSY, Acquire, Relaxed).is_err() {
            r.dropped.fetch_add(1, Relaxed);
            return false;
        }
        // Readers check the stamp after the fields: the BUSY stamp must be visible before any
        // field changes.
        fence(Release);
        slot.start_ns.store(e.start_ns, Relaxed);
        slot.end_ns.store(e.end_ns, Relaxed);
        slot.bytes.store(e.bytes, Relaxed);
        let meta = u64::from(e.kind as u8)
            | u64::from(e.func) << 8
            | u64::from(e.device) << 16
            | u64::from(e.flags) << 24
            | u64::from(e.result) << 32;
        slot.meta.store(meta, Relaxed);
        slot.pid_tid.store(u64::from(e.pid) << 32 | u64::from(e.tid), Relaxed);
        slot.aux.store(e.aux, Relaxed);
        slot.stream.store(e.stream, Relaxed);
        slot.stamp.store(ticket + 1, Release);
        true
    }

    /// The write index now: a cursor from which [`Region::trace_read_since`] returns only entries
    /// written from now on.
    pub fn trace_cursor(&self) -> u64 {
        self.ring().write.load(Acquire)
    }

    /// Entries writers dropped since the region was made.
    pub fn trace_dropped(&self) -> u64 {
        self.ring().dropped.load(Relaxed)
    }

    /// Reads the published entries from ticket `cursor` on. Stops before the first entry still
    /// being written (it is returned by the next read), unless it is far behind the write index
    /// (then it is counted lost); with `last`, skips every unpublished entry (the final read of a
    /// trace).
    pub fn trace_read_since(&self, cursor: u64, last: bool) -> TraceBatch {
        let r = self.ring();
        let end = r.write.load(Acquire);
        let cap = TRACE_CAPACITY as u64;
        let mut out = TraceBatch { entries: Vec::new(), cursor, lost: 0 };
        if end <= cursor {
            // A cursor past the write index (a region made anew): start again from here.
            out.cursor = end;
            return out;
        }
        let first = cursor.max(end.saturating_sub(cap));
        out.lost = first - cursor;
        out.entries.reserve((end - first) as usize);
        let mut t = first;
        while t < end {
            let slot = &r.entries[(t as usize) & (TRACE_CAPACITY - 1)];
            let want = t + 1;
            let s1 = slot.stamp.load(Acquire);
            if s1 != want {
                if s1 > want && s1 != BUSY {
                    // Overwritten by a later lap already.
                    out.lost += 1;
                    t += 1;
                    continue;
                }
                // Not published yet (or being written by us, a lap later).
                if last || end - t > STALE_TICKETS {
                    out.lost += 1;
                    t += 1;
                    continue;
                }
                break;
            }
            let start_ns = slot.start_ns.load(Relaxed);
            let end_ns = slot.end_ns.load(Relaxed);
            let bytes = slot.bytes.load(Relaxed);
            let meta = slot.meta.load(Relaxed);
            let pid_tid = slot.pid_tid.load(Relaxed);
            let aux = slot.aux.load(Relaxed);
            let stream = slot.stream.load(Relaxed);
            fence(Acquire);
            if slot.stamp.load(Relaxed) != want {
                out.lost += 1; // torn: a writer a lap ahead took it while we read
                t += 1;
                continue;
            }
            let kind = match meta & 0xff {
                2 => TraceKind::Kernel,
                _ => TraceKind::Api,
            };
            out.entries.push(TraceEntry {
                kind,
                func: (meta >> 8) as u8,
                device: (meta >> 16) as u8,
                flags: (meta >> 24) as u8,
                result: (meta >> 32) as u32,
                pid: (pid_tid >> 32) as u32,
                tid: pid_tid as u32,
                start_ns,
                end_ns,
                bytes,
                aux,
                stream,
            });
            t += 1;
        }
        out.cursor = t;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn entry(i: u64, tid: u32) -> TraceEntry {
        TraceEntry {
            kind: if i.is_multiple_of(2) { TraceKind::Api } else { TraceKind::Kernel },
            func: TraceFunc::cuLaunchKernel as u8,
            device: (i % 3) as u8,
            flags: 0,
            result: 0,
            pid: 77,
            tid,
            start_ns: i * 10,
            // Every field derives from i: a torn entry would not satisfy these relations.
            end_ns: i * 10 + 5,
            bytes: i ^ 0xABCD,
            aux: i.wrapping_mul(31),
            stream: i + u64::from(tid),
        }
    }

    fn check(e: &TraceEntry) -> u64 {
        let i = e.start_ns / 10;
        assert_eq!(*e, entry(i, e.tid), "entry {i} is consistent");
        i
    }

    #[test]
    fn names_are_stable() {
        assert_eq!(TraceFunc::name_of(0), "unknown");
        assert_eq!(TraceFunc::cuInit.name(), "cuInit");
        assert_eq!(TraceFunc::cuLaunchKernel.name(), "cuLaunchKernel");
        assert_eq!(TraceFunc::cuGraphLaunch_ptsz.name(), "cuGraphLaunch_ptsz");
        assert_eq!(TraceFunc::name_of(250), "unknown");
    }

    #[test]
    fn flag_round_trips_and_empty_ring_reads_nothing() {
        let r = Region::anonymous().unwrap();
        assert!(!r.trace_requested());
        r.set_trace_requested(true);
        assert!(r.trace_requested());
        r.set_trace_requested(false);
        let b = r.trace_read_since(0, false);
        assert_eq!(b, TraceBatch { entries: vec![], cursor: 0, lost: 0 });
    }

    #[test]
    fn push_then_read_in_order_with_cursor() {
        let r = Region::anonymous().unwrap();
        for i in 0..10 {
            assert!(r.trace_push(&entry(i, 1)));
        }
        let b = r.trace_read_since(0, false);
        assert_eq!(b.cursor, 10);
        assert_eq!(b.lost, 0);
        assert_eq!(b.entries.iter().map(check).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
        let cur = r.trace_cursor();
        assert_eq!(cur, 10);
        r.trace_push(&entry(10, 1));
        let b = r.trace_read_since(cur, false);
        assert_eq!(b.entries.len(), 1);
        assert_eq!(check(&b.entries[0]), 10);
        assert_eq!(r.trace_read_since(b.cursor, false).entries.len(), 0);
    }

    #[test]
    fn overwritten_entries_are_counted_lost() {
        let r = Region::anonymous().unwrap();
        let n = TRACE_CAPACITY as u64 + 100;
        for i in 0..n {
            r.trace_push(&entry(i, 1));
        }
        let b = r.trace_read_since(0, false);
        assert_eq!(b.lost, 100);
        assert_eq!(b.entries.len(), TRACE_CAPACITY);
        assert_eq!(check(&b.entries[0]), 100);
        assert_eq!(b.cursor, n);
    }

    #[test]
    fn an_unpublished_entry_holds_the_reader_until_last() {
        let r = Region::anonymous().unwrap();
        r.trace_push(&entry(0, 1));
        // A writer that took ticket 1 and has not published yet.
        let ring = &r.layout().trace;
        ring.write.fetch_add(1, Relaxed);
        ring.entries[1].stamp.store(BUSY, Relaxed);
        r.trace_push(&entry(2, 1));
        let b = r.trace_read_since(0, false);
        assert_eq!((b.entries.len(), b.cursor, b.lost), (1, 1, 0));
        let b = r.trace_read_since(b.cursor, true);
        assert_eq!((b.entries.len(), b.cursor, b.lost), (1, 3, 1));
        assert_eq!(check(&b.entries[0]), 2);
    }

    /// Writers in several threads while a reader follows: every entry read is whole, none twice,
    /// and entries read + lost + dropped = entries written.
    #[test]
    fn concurrent_writers_and_a_reader() {
        let r = Arc::new(Region::anonymous().unwrap());
        const THREADS: u32 = 4;
        const PER: u64 = 50_000;
        let writers: Vec<_> = (0..THREADS)
            .map(|t| {
                let r = Arc::clone(&r);
                std::thread::spawn(move || {
                    for i in 0..PER {
                        r.trace_push(&entry(u64::from(t) * PER + i, t));
                    }
                })
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        let mut cursor = 0;
        let mut lost = 0;
        let read = |cursor: &mut u64, lost: &mut u64, seen: &mut std::collections::HashSet<u64>, last| {
            let b = r.trace_read_since(*cursor, last);
            for e in &b.entries {
                assert!(seen.insert(check(e)), "read twice");
            }
            *lost += b.lost;
            *cursor = b.cursor;
        };
        while writers.iter().any(|w| !w.is_finished()) {
            read(&mut cursor, &mut lost, &mut seen, false);
        }
        for w in writers {
            w.join().unwrap();
        }
        read(&mut cursor, &mut lost, &mut seen, true);
        let total = u64::from(THREADS) * PER;
        assert_eq!(cursor, total);
        assert_eq!(seen.len() as u64 + lost, total, "dropped {}", r.trace_dropped());
        assert!(seen.len() as u64 >= TRACE_CAPACITY as u64, "read {} of {total}", seen.len());
    }
}
