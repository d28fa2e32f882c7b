//! Linear device memory (`cuMemAlloc*`, `cuMemAllocPitch*`) charged as the driver holds it, not
//! as asked: tesserad holds NVML's per-process figure against the limit, and that figure counts
//! the GPU's 2 MiB pages. Charging the bytes asked, an honest program of many small buffers near
//! its limit would be admitted past what the driver's figure allows, and killed.
//!
//! What NVIDIA's drivers hold (an H200, driver 580: 256 allocations of 1 KiB held 2 MiB, 64 of
//! 2 MiB + 1 held 256 MiB, 8 of 64 MiB exactly 512 MiB; since Pascal allocations over 1 MiB are
//! page-aligned and smaller ones packed into pages, pytorch/pytorch#17120; docs/sim.md):
//! - more than 1 MiB: whole pages of its own, its size rounded up to 2 MiB, charged as such;
//! - at most 1 MiB: carved from a 2 MiB chunk shared with other small allocations. The chunk is
//!   known by address (the 2 MiB-aligned page the allocation lies in: the driver's chunks are
//!   pages), charged once while any of this process's allocations lies in it, and refunded when
//!   the last one is freed. So the charge follows the driver's packing, whatever it is.
//!
//! Before the driver is called a small allocation reserves a whole chunk (it may need a new one)
//! and gives it back once it landed in a chunk already charged: near the limit a small allocation
//! is refused when a new chunk would not fit, even where the driver could have placed it in a
//! chunk's free room. At most one chunk early, never late: the driver's figure never passes what
//! the shim admitted.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::{Mutex, MutexGuard};

use tessera_region::MAX_DEVICES;

use super::KeyHasher;

/// The GPU's page.
pub(crate) const PAGE: u64 = 2 << 20;
/// The largest allocation the driver carves from a shared chunk.
pub(crate) const SMALL_MAX: u64 = 1 << 20;

/// Whether the driver carves an allocation of `bytes` from a shared chunk.
pub(crate) fn is_small(bytes: u64) -> bool {
    bytes <= SMALL_MAX
}

/// What the driver holds for an allocation of `bytes` with pages of its own.
pub(crate) fn whole_pages(bytes: u64) -> Option<u64> {
    bytes.checked_next_multiple_of(PAGE)
}

/// What to reserve before the driver is called for `bytes`: the most it can take.
pub(crate) fn before_call(bytes: u64) -> Option<u64> {
    if is_small(bytes) { Some(PAGE) } else { whole_pages(bytes) }
}

/// The 2 MiB pages `[ptr, ptr + bytes)` lies in.
fn pages(ptr: u64, bytes: u64) -> impl Iterator<Item = u64> {
    let first = ptr & !(PAGE - 1);
    let last = ptr.saturating_add(bytes.max(1) - 1) & !(PAGE - 1);
    (first..=last).step_by(PAGE as usize)
}

/// A small allocation of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Small {
    pub dev: usize,
    /// The context it was made in (it dies with it).
    pub ctx: usize,
    pub bytes: u64,
}

/// Maps keyed by address with the book's cheap hasher (SipHash was a third of a small pair's cost).
type ByAddress<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// A chunk's key: its page's address (2 MiB-aligned: the low bits are free) and its device.
fn chunk_key(dev: usize, page: u64) -> u64 {
    page | dev as u64
}

#[derive(Default)]
struct Books {
    /// Small allocations by address.
    live: ByAddress<Small>,
    /// Per chunk ([`chunk_key`]): how many small allocations lie in it.
    chunks: ByAddress<u32>,
    /// Per device: the chunks charged.
    charged: [u64; MAX_DEVICES],
}

impl Books {
    /// Counts `s` in its pages; the bytes of those it is the first in.
    fn enter(&mut self, ptr: u64, s: Small) -> u64 {
        let mut new = 0;
        for page in pages(ptr, s.bytes) {
            let n = self.chunks.entry(chunk_key(s.dev, page)).or_insert(0);
            if *n == 0 {
                new += PAGE;
            }
            *n += 1;
        }
        if let Some(c) = self.charged.get_mut(s.dev) {
            *c += new;
        }
        new
    }

    /// Uncounts `s` from its pages; the bytes of those it was the last in.
    fn leave(&mut self, ptr: u64, s: Small) -> u64 {
        let mut gone = 0;
        for page in pages(ptr, s.bytes) {
            if let Some(n) = self.chunks.get_mut(&chunk_key(s.dev, page)) {
                *n -= 1;
                if *n == 0 {
                    self.chunks.remove(&chunk_key(s.dev, page));
                    gone += PAGE;
                }
            }
        }
        if let Some(c) = self.charged.get_mut(s.dev) {
            *c = c.saturating_sub(gone);
        }
        gone
    }
}

/// This process's small allocations and the chunks they hold.
pub(crate) struct Chunks(Mutex<Books>);

impl Chunks {
    pub(crate) fn new() -> Chunks {
        Chunks(Mutex::new(Books::default()))
    }

    fn lock(&self) -> MutexGuard<'_, Books> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a small allocation the driver made at `ptr`; the bytes of the chunks it is the
    /// first in, which the caller charges.
    pub(crate) fn landed(&self, ptr: u64, s: Small) -> u64 {
        let mut b = self.lock();
        if let Some(old) = b.live.insert(ptr, s) {
            // A record we missed the free of: the driver no longer holds it.
            b.leave(ptr, old);
        }
        b.enter(ptr, s)
    }

    /// Takes a small allocation's record before its free is called, so that an allocation the
    /// driver makes at the same address meanwhile is recorded anew (`None`: not one of ours).
    /// Its chunks stay counted until [`Chunks::left`].
    pub(crate) fn take(&self, ptr: u64) -> Option<Small> {
        self.lock().live.remove(&ptr)
    }

    /// The driver refused the free: the record is back.
    pub(crate) fn put_back(&self, ptr: u64, s: Small) {
        self.lock().live.insert(ptr, s);
    }

    /// The driver freed a taken allocation: the bytes of the chunks no allocation lies in any
    /// more, which the caller refunds.
    pub(crate) fn left(&self, ptr: u64, s: Small) -> u64 {
        self.lock().leave(ptr, s)
    }

    /// A context is gone with its small allocations: per device, the chunk bytes to refund.
    pub(crate) fn context_gone(&self, ctx: usize) -> Vec<(usize, u64)> {
        let mut b = self.lock();
        let dead: Vec<(u64, Small)> = b.live.iter().filter(|(_, s)| s.ctx == ctx).map(|(&p, &s)| (p, s)).collect();
        let mut out: Vec<(usize, u64)> = Vec::new();
        for (p, s) in dead {
            b.live.remove(&p);
            let gone = b.leave(p, s);
            match out.iter_mut().find(|(d, _)| *d == s.dev) {
                Some((_, bytes)) => *bytes += gone,
                None => out.push((s.dev, gone)),
            }
        }
        out
    }

    /// The chunk bytes charged on a device.
    pub(crate) fn charged_on(&self, dev: usize) -> u64 {
        self.lock().charged.get(dev).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn small(dev: usize, ctx: usize, bytes: u64) -> Small {
        Small { dev, ctx, bytes }
    }

    #[test]
    fn a_chunk_is_charged_once_and_refunded_with_its_last_allocation() {
        let c = Chunks::new();
        let page = 7 * PAGE;
        assert_eq!(c.landed(page, small(0, 1, 1024)), PAGE, "the first in its page");
        for i in 1..256 {
            assert_eq!(c.landed(page + i * 1024, small(0, 1, 1024)), 0, "the same page");
        }
        assert_eq!(c.charged_on(0), PAGE);
        for i in 0..255 {
            let s = c.take(page + i * 1024).unwrap();
            assert_eq!(c.left(page + i * 1024, s), 0);
        }
        let s = c.take(page + 255 * 1024).unwrap();
        assert_eq!(c.left(page + 255 * 1024, s), PAGE, "the last one out");
        assert_eq!(c.charged_on(0), 0);
        assert_eq!(c.take(page), None, "not ours any more");
    }

    #[test]
    fn pages_are_per_device_and_an_allocation_across_two_holds_both() {
        let c = Chunks::new();
        assert_eq!(c.landed(PAGE, small(0, 1, 4096)), PAGE);
        assert_eq!(c.landed(PAGE + 4096, small(1, 1, 4096)), PAGE, "another device's page");
        assert_eq!(c.landed(2 * PAGE - 4096, small(0, 1, 8192)), PAGE, "into the next page too");
        assert_eq!((c.charged_on(0), c.charged_on(1)), (2 * PAGE, PAGE));
    }

    #[test]
    fn a_free_in_flight_keeps_the_chunk_for_an_allocation_landing_meanwhile() {
        let c = Chunks::new();
        assert_eq!(c.landed(PAGE, small(0, 1, MIB)), PAGE);
        // Freed by the driver, not yet uncounted; the driver hands the address out again.
        let s = c.take(PAGE).unwrap();
        assert_eq!(c.landed(PAGE, small(0, 1, 512)), 0, "the chunk is still counted");
        assert_eq!(c.left(PAGE, s), 0, "and stays, the new allocation in it");
        assert_eq!(c.charged_on(0), PAGE);
        // A refused free puts the record back.
        let s = c.take(PAGE).unwrap();
        c.put_back(PAGE, s);
        assert_eq!(c.take(PAGE), Some(s));
    }

    #[test]
    fn a_context_gone_refunds_its_chunks() {
        let c = Chunks::new();
        c.landed(PAGE, small(0, 1, 1024));
        c.landed(PAGE + 1024, small(0, 2, 1024));
        c.landed(3 * PAGE, small(0, 1, 1024));
        c.landed(5 * PAGE, small(2, 1, 1024));
        let mut gone = c.context_gone(1);
        gone.sort_unstable();
        assert_eq!(gone, [(0, PAGE), (2, PAGE)], "the shared page stays with context 2");
        assert_eq!(c.charged_on(0), PAGE);
    }

    #[test]
    fn the_rule() {
        assert_eq!(before_call(1), Some(PAGE));
        assert_eq!(before_call(MIB), Some(PAGE));
        assert_eq!(before_call(MIB + 1), Some(PAGE));
        assert_eq!(before_call(PAGE + 1), Some(2 * PAGE));
        assert_eq!(before_call(64 * MIB), Some(64 * MIB));
        assert_eq!(before_call(u64::MAX), None);
        assert!(is_small(MIB) && !is_small(MIB + 1));
    }
}
