//! On-demand tracing: a ring of trace entries in the region, written by every process of the
//! container while the daemon asks for a trace (`Header::trace_requested`), read by the daemon.
//!
//! # The ring
//! [`TRACE_CAPACITY`] entries of one cache line each (so concurrent writers never share a line),
//! after a write index on a line of its own. Lock-free and multi-producer:
//! 1. a writer takes a ticket with `fetch_add` on the write index: entry `ticket % capacity`;
//! 2. claims the entry with a CAS of its stamp from whatever earlier lap's value it holds to
//!    `BUSY` (a writer finding the entry `BUSY` — another one lapped the ring onto it — or holding
//!    a later lap's stamp — it was itself held up for a lap after taking its ticket — drops its
//!    own entry and counts it in `dropped`, so an older entry never replaces a newer one);
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
//! # Entries
//! API spans, kernel spans and kernel names ([`TraceKind`]). A kernel's name is announced once
//! per trace session and process, before its first kernel entry, as name entries of up to 32
//! bytes each ([`TraceEntry::name_chunks`]); readers put names back together with
//! [`TraceNames`]. Readers skip kinds they do not know. While a trace runs, `trace_requested`
//! holds its session number ([`Region::start_trace`]).
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
    /// Kernels and names: the `CUfunction` handle (0: none, a graph launch); API calls: 0.
    pub aux: AtomicU64,
    /// Kernels: the stream handle; API calls: 0.
    pub stream: AtomicU64,
}

/// The ring in the region (see the module docs).
#[repr(C)]
pub struct TraceRing {
    /// Tickets handed out so far.
    pub write: AtomicU64,
    /// Entries writers dropped (their entry was still being written by a writer a lap behind, or
    /// already held a later lap's: the writer itself was a lap late).
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
    /// A chunk of a kernel function's name, for the kernel entries with the same `pid` and `aux`
    /// (see [`TraceEntry::name_chunks`]).
    Name = 3,
}

impl TraceKind {
    /// The kind stored as `k`; None for kinds this build does not know (readers skip them).
    pub fn from_u8(k: u8) -> Option<TraceKind> {
        match k {
            1 => Some(TraceKind::Api),
            2 => Some(TraceKind::Kernel),
            3 => Some(TraceKind::Name),
            _ => None,
        }
    }
}

/// [`TraceEntry::flags`]: the kernel's GPU duration comes from CUDA events around it; its start
/// is estimated as the later of its launch and the previous measured kernel's end on its stream.
pub const TRACE_FLAG_START_ESTIMATED: u8 = 1;

/// [`TraceEntry::device`] when no device is known.
pub const TRACE_NO_DEVICE: u8 = u8::MAX;

/// Name entries ([`TraceKind::Name`]): the longest name carried, in bytes; longer ones are cut
/// there and flagged [`TRACE_FLAG_NAME_TRUNCATED`].
pub const TRACE_NAME_MAX: usize = 256;
/// Name bytes per name entry: `start_ns`, `end_ns`, `bytes`, `stream`, each 8 bytes little-endian.
pub const TRACE_NAME_CHUNK: usize = 32;
/// [`TraceEntry::flags`] of a name entry: the name was longer than [`TRACE_NAME_MAX`] and is cut.
pub const TRACE_FLAG_NAME_TRUNCATED: u8 = 2;

const NAME_CHUNKS: usize = TRACE_NAME_MAX / TRACE_NAME_CHUNK;
const _: () = assert!(TRACE_NAME_MAX.is_multiple_of(TRACE_NAME_CHUNK) && NAME_CHUNKS <= 8);

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
    // Appended, so earlier ids keep their meaning.
    cuMemMap, cuMemUnmap, cuMemAddressFree, cuMemRetainAllocationHandle, cuMemMapArrayAsync,
    cuMemMapArrayAsync_ptsz,
    cuGraphInstantiate, cuGraphInstantiate_v2, cuGraphInstantiateWithFlags, cuGraphInstantiateWithParams,
    cuGraphInstantiateWithParams_ptsz, cuGraphUpload, cuGraphUpload_ptsz, cuGraphExecDestroy, cuDeviceGraphMemTrim,
    cuMipmappedArrayCreate, cuMipmappedArrayDestroy,
    cuCtxSetLimit,
    cuMemPoolCreate,
    cuMemImportFromShareableHandle,
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
    /// Kernels and names: the `CUfunction` handle (0: none, as for a graph launch).
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

    /// The name entries announcing that `function` (a `CUfunction` handle) of process `pid` is
    /// called `name`: one per [`TRACE_NAME_CHUNK`] bytes of the name cut to [`TRACE_NAME_MAX`]
    /// (none for an empty name), to be pushed in order. A name entry holds:
    /// - `kind` [`TraceKind::Name`]; `aux` the handle; `pid`, `tid` as other entries;
    /// - `result`: the (cut) name's length in bytes (bits 0–8), the chunk's index (bits 9–11) and
    ///   a 16-bit hash of the whole (cut) name (bits 16–31, [`name_check`]; bits 12–15 are 0);
    /// - `flags`: [`TRACE_FLAG_NAME_TRUNCATED`] when the name was cut; `func` 0, `device` none;
    /// - the chunk's bytes `32·i ..` in `start_ns`, `end_ns`, `bytes`, `stream` (8 bytes each,
    ///   little-endian, zero-padded after the name's end).
    ///
    /// A reader that does not know kind 3 drops these: [`Region::trace_read_since`] skips unknown
    /// kinds, and earlier daemons, which read them as API spans, keep only spans inside the
    /// trace's time window with `end_ns >= start_ns`, which no name entry is (its `start_ns`
    /// holds 8 name bytes, each non-zero, so it is ≥ 2^56 ns, or only 1–7 and `end_ns` is 0).
    pub fn name_chunks(pid: u32, tid: u32, function: u64, name: &[u8]) -> impl Iterator<Item = TraceEntry> + '_ {
        let truncated = name.len() > TRACE_NAME_MAX;
        let name = &name[..name.len().min(TRACE_NAME_MAX)];
        let len = name.len() as u32; // ≤ 256
        let check = u32::from(name_check(name));
        name.chunks(TRACE_NAME_CHUNK).enumerate().map(move |(i, chunk)| {
            let mut buf = [0u8; TRACE_NAME_CHUNK];
            buf[..chunk.len()].copy_from_slice(chunk);
            let word = |w: usize| u64::from_le_bytes(buf[w * 8..w * 8 + 8].try_into().expect("8 bytes"));
            TraceEntry {
                kind: TraceKind::Name,
                func: 0,
                device: TRACE_NO_DEVICE,
                flags: if truncated { TRACE_FLAG_NAME_TRUNCATED } else { 0 },
                result: len | (i as u32) << 9 | check << 16,
                pid,
                tid,
                start_ns: word(0),
                end_ns: word(1),
                bytes: word(2),
                aux: function,
                stream: word(3),
            }
        })
    }

    /// A name entry's parts (see [`NameChunk`]). None for other kinds and for name entries that
    /// do not hold together (index past the length, reserved bits set).
    pub fn name_chunk(&self) -> Option<NameChunk> {
        if self.kind != TraceKind::Name {
            return None;
        }
        let len = (self.result & 0x1ff) as usize;
        let index = ((self.result >> 9) & 0x7) as usize;
        if len == 0 || len > TRACE_NAME_MAX || index * TRACE_NAME_CHUNK >= len || self.result & 0xf000 != 0 {
            return None;
        }
        let mut bytes = [0u8; TRACE_NAME_CHUNK];
        for (w, v) in [self.start_ns, self.end_ns, self.bytes, self.stream].into_iter().enumerate() {
            bytes[w * 8..w * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        Some(NameChunk {
            index: index as u8,
            len: len as u16,
            truncated: self.flags & TRACE_FLAG_NAME_TRUNCATED != 0,
            check: (self.result >> 16) as u16,
            bytes,
        })
    }
}

/// One decoded name entry (see [`TraceEntry::name_chunks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameChunk {
    pub index: u8,
    /// The whole (cut) name's length in bytes.
    pub len: u16,
    pub truncated: bool,
    /// [`name_check`] of the whole (cut) name.
    pub check: u16,
    /// Bytes `32·index ..` of the name; those past its length are 0.
    pub bytes: [u8; TRACE_NAME_CHUNK],
}

/// The 16-bit hash name entries carry of the whole (cut) name (FNV-1a, folded): a reassembled
/// name that does not match it is not taken.
pub fn name_check(name: &[u8]) -> u16 {
    let h = name.iter().fold(0x811c_9dc5u32, |h, &b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    (h >> 16) as u16 ^ h as u16
}

/// Reassembles kernel names from name entries, per `(pid, function handle)`.
///
/// One announcement is its chunks `0..n` in order (one thread pushes them one after another, and
/// readers return entries in ticket order). A name is taken only when every chunk arrived, in
/// order, agreeing on length, cut and hash, and the bytes match the hash: a chunk out of sequence
/// (one before it was lost, overwritten or dropped) discards the announcement, so a lost chunk
/// gives no name, never a spliced one. A complete later announcement replaces an earlier one.
#[derive(Debug, Default, Clone)]
pub struct TraceNames {
    partial: std::collections::HashMap<(u32, u64), Partial>,
    done: std::collections::HashMap<(u32, u64), String>,
}

#[derive(Debug, Clone)]
struct Partial {
    len: u16,
    truncated: bool,
    check: u16,
    /// The next chunk index expected.
    next: u8,
    buf: Vec<u8>,
}

impl TraceNames {
    /// Takes in `e` if it is a name entry; false for other entries.
    pub fn push(&mut self, e: &TraceEntry) -> bool {
        if e.kind != TraceKind::Name {
            return false;
        }
        let key = (e.pid, e.aux);
        let Some(c) = e.name_chunk() else {
            self.partial.remove(&key); // a malformed chunk breaks the announcement it is in
            return true;
        };
        if c.index == 0 {
            self.partial.insert(
                key,
                Partial {
                    len: c.len,
                    truncated: c.truncated,
                    check: c.check,
                    next: 0,
                    buf: Vec::with_capacity(usize::from(c.len)),
                },
            );
        }
        let Some(p) = self.partial.get_mut(&key) else { return true };
        if p.next != c.index || p.len != c.len || p.truncated != c.truncated || p.check != c.check {
            self.partial.remove(&key);
            return true;
        }
        let take = (usize::from(c.len) - p.buf.len()).min(TRACE_NAME_CHUNK);
        p.buf.extend_from_slice(&c.bytes[..take]);
        p.next += 1;
        if p.buf.len() == usize::from(p.len) {
            let p = self.partial.remove(&key).expect("present");
            if name_check(&p.buf) != p.check {
                return true;
            }
            let mut name = String::from_utf8_lossy(&p.buf).into_owned();
            if p.truncated {
                name.push('…');
            }
            self.done.insert(key, name);
        }
        true
    }

    /// The name of `function` in process `pid`, if a whole announcement of it was read; a name
    /// cut at [`TRACE_NAME_MAX`] bytes ends with `…`.
    pub fn get(&self, pid: u32, function: u64) -> Option<&str> {
        self.done.get(&(pid, function)).map(String::as_str)
    }

    /// Names known.
    pub fn len(&self) -> usize {
        self.done.len()
    }

    pub fn is_empty(&self) -> bool {
        self.done.is_empty()
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

    /// Sets (session 1) or clears the flag; [`Region::start_trace`] starts a trace proper.
    pub fn set_trace_requested(&self, on: bool) {
        self.layout().header.trace_requested.store(u32::from(on), Release);
    }

    /// Starts a trace: sets `trace_requested` to the trace's session number and returns the
    /// cursor its entries are read from (the write index now).
    ///
    /// The session is that write index + 1, in 32 bits, never 0. Writers use it to tell traces
    /// apart (the shim announces kernel names once per session): a writer that recorded anything
    /// under session `s` advanced the write index past `s`'s start, so every later trace has
    /// another session (until 2^32 entries wrap it); a later trace starting at the same index
    /// (nothing was written since) reads everything written under `s`.
    pub fn start_trace(&self) -> u64 {
        let cursor = self.trace_cursor();
        let session = (cursor as u32).wrapping_add(1).max(1);
        // Release: a writer that reads this session (Acquire) takes tickets from `cursor` on.
        self.layout().header.trace_requested.store(session, Release);
        cursor
    }

    /// The trace session now (0: no trace), read with Acquire (see [`Region::start_trace`]).
    pub fn trace_session(&self) -> u32 {
        self.layout().header.trace_requested.load(Acquire)
    }

    /// Appends `e` to the ring. Lock-free, no allocation, no syscall: a `fetch_add`, a CAS and
    /// nine stores. False when the entry was dropped: its ring entry was being written by a
    /// writer a whole lap behind, or already holds a later lap's entry (this writer was held up
    /// for a lap between its ticket and its write, and must not put an older entry over a newer).
    #[inline]
    pub fn trace_push(&self, e: &TraceEntry) -> bool {
        let ticket = self.ring().write.fetch_add(1, Relaxed);
        self.trace_write(ticket, e)
    }

    /// Writes `e` as ticket `ticket`'s entry (see [`Region::trace_push`]).
    #[inline]
    fn trace_write(&self, ticket: u64, e: &TraceEntry) -> bool {
        let r = self.ring();
        let slot = &r.entries[(ticket as usize) & (TRACE_CAPACITY - 1)];
        let cur = slot.stamp.load(Relaxed);
        // A stamp is its entry's ticket + 1: an earlier lap's is at most this ticket, a later
        // lap's (or BUSY) above it.
        if cur > ticket || slot.stamp.compare_exchange(cur, BUSY, Acquire, Relaxed).is_err() {
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
            t += 1;
            // Kinds this build does not know (written by a newer shim) are skipped, not lost.
            let Some(kind) = TraceKind::from_u8(meta as u8) else { continue };
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

    fn names_of(entries: &[TraceEntry]) -> TraceNames {
        let mut n = TraceNames::default();
        for e in entries {
            n.push(e);
        }
        n
    }

    #[test]
    fn names_round_trip_through_the_ring() {
        let r = Region::anonymous().unwrap();
        let short = b"tessera_spin_500us";
        let exact: Vec<u8> = (0..TRACE_NAME_CHUNK * 2).map(|i| b'a' + (i % 26) as u8).collect();
        let mangled = b"_ZN7cutlass6KernelINS_4gemm6kernel4GemmINS1_11threadblock12MmaPipelinedEEEEvNT_6ParamsE";
        r.trace_push(&entry(1, 5));
        for (h, name) in [(0x10u64, &short[..]), (0x20, &exact[..]), (0x30, &mangled[..])] {
            let chunks: Vec<_> = TraceEntry::name_chunks(7, 8, h, name).collect();
            assert_eq!(chunks.len(), name.len().div_ceil(TRACE_NAME_CHUNK));
            for c in &chunks {
                assert!(r.trace_push(c));
            }
        }
        r.trace_push(&entry(3, 5));
        let b = r.trace_read_since(0, false);
        assert_eq!(b.lost, 0);
        assert_eq!(b.entries.iter().filter(|e| e.kind == TraceKind::Name).count(), 1 + 2 + 3);
        let n = names_of(&b.entries);
        assert_eq!(n.len(), 3);
        assert_eq!(n.get(7, 0x10), Some("tessera_spin_500us"));
        assert_eq!(n.get(7, 0x20).map(str::as_bytes), Some(&exact[..]));
        assert_eq!(n.get(7, 0x30).map(str::as_bytes), Some(&mangled[..]));
        assert_eq!(n.get(8, 0x10), None, "names are per process");
        assert_eq!(n.get(7, 0x40), None);
    }

    #[test]
    fn long_names_are_cut_and_marked() {
        let long: Vec<u8> = (0..1000).map(|i| b'A' + (i % 26) as u8).collect();
        let chunks: Vec<_> = TraceEntry::name_chunks(1, 1, 9, &long).collect();
        assert_eq!(chunks.len(), TRACE_NAME_MAX / TRACE_NAME_CHUNK);
        assert!(chunks.iter().all(|c| c.flags & TRACE_FLAG_NAME_TRUNCATED != 0));
        let n = names_of(&chunks);
        let got = n.get(1, 9).unwrap();
        assert_eq!(got.strip_suffix('…').map(str::as_bytes), Some(&long[..TRACE_NAME_MAX]));
        // Exactly the maximum is whole, unmarked.
        let n = names_of(&TraceEntry::name_chunks(1, 1, 9, &long[..TRACE_NAME_MAX]).collect::<Vec<_>>());
        assert_eq!(n.get(1, 9).map(str::as_bytes), Some(&long[..TRACE_NAME_MAX]));
        assert_eq!(TraceEntry::name_chunks(1, 1, 9, b"").count(), 0);
    }

    #[test]
    fn a_lost_chunk_gives_no_name_never_a_spliced_one() {
        let a: Vec<u8> = (0..100).map(|_| b'a').collect();
        let b: Vec<u8> = (0..100).map(|_| b'b').collect();
        let ca: Vec<_> = TraceEntry::name_chunks(1, 1, 5, &a).collect();
        let cb: Vec<_> = TraceEntry::name_chunks(1, 1, 5, &b).collect();
        for lost in 0..ca.len() {
            let mut v = ca.clone();
            v.remove(lost);
            assert_eq!(names_of(&v).get(1, 5), None, "chunk {lost} lost");
            // Another announcement of the same length after the broken one: only it is taken.
            let mut w = v.clone();
            w.extend(cb.iter().copied());
            assert_eq!(names_of(&w).get(1, 5).map(str::as_bytes), Some(&b[..]));
            // A's start, then B's rest (B's first chunk lost): nothing.
            let mut x = ca[..lost.max(1)].to_vec();
            x.extend(cb[lost.max(1)..].iter().copied());
            assert_eq!(names_of(&x).get(1, 5), None, "spliced at {lost}");
        }
        // Chunks of other processes between them do not matter.
        let mut v = vec![ca[0]];
        v.extend(TraceEntry::name_chunks(2, 2, 5, b"other"));
        v.extend(ca[1..].iter().copied());
        let n = names_of(&v);
        assert_eq!(n.get(1, 5).map(str::as_bytes), Some(&a[..]));
        assert_eq!(n.get(2, 5), Some("other"));
        // Malformed: an index past the length.
        let mut bad = ca[0];
        bad.result = 10 | 3 << 9;
        assert_eq!(bad.name_chunk(), None);
        assert_eq!(names_of(&[bad]).len(), 0);
        // Bytes that do not match the hash.
        let mut v = ca.clone();
        v[2].bytes ^= 1;
        assert_eq!(names_of(&v).get(1, 5), None);
        // Other kinds are not names.
        let mut n = TraceNames::default();
        assert!(!n.push(&entry(1, 1)));
        assert!(n.is_empty());
    }

    /// Daemons built before name entries read them as API spans and keep only spans in the
    /// trace's window: name entries never are.
    #[test]
    fn earlier_readers_drop_name_entries() {
        let (t0, t1) = (1_000_000_000u64, 365 * 86_400 * 1_000_000_000u64);
        let names: [&[u8]; 5] = [b"k", b"kernel7", b"kernel78", b"tessera_spin_500us", &[1u8; 300]];
        for name in names {
            for e in TraceEntry::name_chunks(1, 1, 0x99, name) {
                assert!(
                    !(e.end_ns >= t0 && e.start_ns <= t1 && e.end_ns >= e.start_ns),
                    "{:?} would show",
                    String::from_utf8_lossy(name)
                );
            }
        }
    }

    #[test]
    fn unknown_kinds_are_skipped_not_lost() {
        let r = Region::anonymous().unwrap();
        r.trace_push(&entry(0, 1));
        r.trace_push(&entry(1, 1));
        r.trace_push(&entry(2, 1));
        let slot = &r.layout().trace.entries[1];
        slot.meta.store((slot.meta.load(Relaxed) & !0xff) | 9, Relaxed);
        let b = r.trace_read_since(0, false);
        assert_eq!((b.cursor, b.lost), (3, 0));
        assert_eq!(b.entries.iter().map(check).collect::<Vec<_>>(), vec![0, 2]);
    }

    #[test]
    fn each_trace_has_a_session() {
        let r = Region::anonymous().unwrap();
        assert_eq!(r.trace_session(), 0);
        assert_eq!(r.start_trace(), 0);
        let s1 = r.trace_session();
        assert_ne!(s1, 0);
        assert!(r.trace_requested());
        r.set_trace_requested(false);
        assert_eq!(r.trace_session(), 0);
        // Nothing written since: the same session, whose entries the new trace reads anyway.
        assert_eq!(r.start_trace(), 0);
        assert_eq!(r.trace_session(), s1);
        r.trace_push(&entry(0, 1));
        r.set_trace_requested(false);
        assert_eq!(r.start_trace(), 1);
        assert_ne!(r.trace_session(), s1);
        // The write index at u32::MAX: the session wraps to 1, never 0.
        r.layout().trace.write.store(u64::from(u32::MAX), Relaxed);
        r.start_trace();
        assert_eq!(r.trace_session(), 1);
    }

    /// A writer held up for a whole lap between taking its ticket and writing its entry finds a
    /// later lap's entry there: it drops its own (counted), and the newer entry stays readable.
    #[test]
    fn a_writer_a_lap_late_drops_its_entry_and_leaves_the_newer_one() {
        let r = Region::anonymous().unwrap();
        let cap = TRACE_CAPACITY as u64;
        // Tickets 0..=cap+5 taken; cap+5 written (slot 5), then ticket 5's writer comes back.
        r.ring().write.store(cap + 6, Relaxed);
        assert!(r.trace_write(cap + 5, &entry(cap + 5, 1)));
        assert!(!r.trace_write(5, &entry(5, 0)), "an older entry never goes over a newer one");
        assert_eq!(r.trace_dropped(), 1);
        let b = r.trace_read_since(cap + 5, true);
        assert_eq!(b.entries.len(), 1);
        assert_eq!(check(&b.entries[0]), cap + 5);
        // Its own slot's earlier lap is no obstacle: a writer on time writes over it.
        assert!(r.trace_write(2 * cap + 5, &entry(2 * cap + 5, 1)));
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
        // The final read covers the last ring's worth of tickets, each read unless its writer
        // dropped it (a writer preempted mid-entry for a whole lap: on a loaded machine).
        let dropped = r.trace_dropped();
        assert!(
            seen.len() as u64 + dropped >= TRACE_CAPACITY as u64,
            "read {} of {total}, {dropped} dropped",
            seen.len()
        );
    }
}
