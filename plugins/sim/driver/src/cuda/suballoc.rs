//! Linear device memory (`cuMemAlloc`, `cuMemAllocPitch`) as the card holds it: what NVML's
//! per-process figure, NVML's used memory and `cuMemGetInfo` move by.
//!
//! The rule, from an H200 (driver 580.159.04; `measured_granularity` in the card's reading) and
//! from what NVIDIA's drivers are known to do since Pascal (2 MiB GPU pages; allocations larger
//! than 1 MiB page-aligned, smaller ones packed into pages: pytorch/pytorch#17120, whose caching
//! allocator was changed to match, and the CUDA programming guide's note that IPC on a
//! `cudaMalloc` allocation shares the whole block it was sub-allocated from):
//! - an allocation of more than 1 MiB takes whole 2 MiB pages of its own: its size rounded up to
//!   2 MiB (64 of 2 MiB + 1 held 256 MiB; 8 of 64 MiB held exactly 512 MiB);
//! - one of at most 1 MiB is carved from a 2 MiB chunk the context shares between such
//!   allocations: the chunk is charged once, when made, and returned when its last allocation is
//!   freed (256 of 1 KiB held 2 MiB). The card measured 1 KiB and 2 MiB + 1; between them the 1
//!   MiB boundary is the drivers' documented one.
//!
//! In the sim a chunk is a 2 MiB-aligned mapping and an allocation in it takes whole host pages
//! (4 KiB; so a chunk holds at most 512, where the card packs at 512 bytes), each allocation its
//! own pages: copies, IPC exports and checkpoints work on it as on any other. A chunk's address
//! is 2 MiB-aligned as the card's pages are, so a caller can tell which chunk an allocation is in
//! (the shim's books do). The legacy 32-bit `cuMemAlloc` takes whole pages whatever its size.

use std::sync::{Mutex, MutexGuard};

use tessera_sim_model::Node;

use super::context::Ctx;
use super::handles;
use super::memory::{self, Alloc, MemKind, charge, current_epoch, map_anon, refund, unmap};
use super::{INVALID_VALUE, OUT_OF_MEMORY, R};

/// The GPU's page: what the driver maps device memory in.
pub(crate) const PAGE: u64 = 2 << 20;
/// The largest allocation carved from a shared chunk.
pub(crate) const SMALL_MAX: u64 = 1 << 20;
/// What an allocation in a chunk takes of it, in the sim (a host page).
const SLOT: u64 = 4096;
const SLOTS: usize = (PAGE / SLOT) as usize;

/// A 2 MiB chunk of one context's small allocations.
struct Chunk {
    base: u64,
    ctx: usize,
    gpu: u32,
    domain: usize,
    /// The GPU's epoch when it was charged: a reset freed it, and it takes no more.
    epoch: u64,
    /// Which slots are taken, and how many.
    taken: [u64; SLOTS / 64],
    slots: usize,
    /// Allocations in it.
    live: usize,
}

impl Chunk {
    fn is_taken(&self, i: usize) -> bool {
        self.taken[i / 64] & (1 << (i % 64)) != 0
    }

    fn mark(&mut self, first: usize, n: usize, on: bool) {
        self.slots = if on { self.slots + n } else { self.slots - n };
        for i in first..first + n {
            if on {
                self.taken[i / 64] |= 1 << (i % 64);
            } else {
                self.taken[i / 64] &= !(1 << (i % 64));
            }
        }
    }

    /// The first run of `n` free slots, taken.
    fn take(&mut self, n: usize) -> Option<usize> {
        if SLOTS - self.slots < n {
            return None;
        }
        let mut run = 0;
        for i in 0..SLOTS {
            run = if self.is_taken(i) { 0 } else { run + 1 };
            if run == n {
                let first = i + 1 - n;
                self.mark(first, n, true);
                self.live += 1;
                return Some(first);
            }
        }
        None
    }
}

static CHUNKS: Mutex<Vec<Chunk>> = Mutex::new(Vec::new());

fn chunks() -> MutexGuard<'static, Vec<Chunk>> {
    CHUNKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// What an allocation of `bytes` with pages of its own holds: whole 2 MiB pages.
pub(crate) fn whole_pages(bytes: u64) -> R<u64> {
    bytes.checked_next_multiple_of(PAGE).ok_or(OUT_OF_MEMORY)
}

/// Allocates `bytes` of linear device memory in a context (`low`: below 4 GiB, for the legacy
/// 32-bit API), charged as the card holds it (above), and registers it.
pub(crate) fn alloc_linear(node: &Node, ctx: &Ctx, bytes: u64, low: bool) -> R<u64> {
    if bytes == 0 {
        return Err(INVALID_VALUE);
    }
    if low || bytes > SMALL_MAX {
        let held = whole_pages(bytes)?;
        return memory::alloc_charging(node, ctx, bytes, |_| Ok(held), MemKind::Device, low);
    }
    ctx.check(node)?;
    let d = ctx.dev;
    let n = bytes.div_ceil(SLOT) as usize;
    let at = {
        let mut all = chunks();
        let epoch = current_epoch(d.gpu);
        let mine = |c: &Chunk| c.ctx == ctx.handle && c.epoch == epoch && c.gpu == d.gpu && c.domain == d.domain;
        match all.iter_mut().filter(|c| mine(c)).find_map(|c| c.take(n).map(|i| c.base + i as u64 * SLOT)) {
            Some(at) => at,
            None => {
                let epoch = charge(node, d.gpu, d.domain, PAGE)?;
                let Some(base) = map_chunk() else {
                    refund(node, d.gpu, d.domain, PAGE, epoch);
                    return Err(OUT_OF_MEMORY);
                };
                let mut c = Chunk {
                    base,
                    ctx: ctx.handle,
                    gpu: d.gpu,
                    domain: d.domain,
                    epoch,
                    taken: [0; SLOTS / 64],
                    slots: 0,
                    live: 0,
                };
                let first = c.take(n).expect("an empty chunk holds an allocation of at most 1 MiB");
                all.push(c);
                base + first as u64 * SLOT
            }
        }
    };
    let a =
        Alloc { map_len: n * SLOT as usize, in_chunk: true, ..Alloc::new(at, bytes, MemKind::Device, ctx.handle, d) };
    handles::write().mem.insert(at, a);
    Ok(at)
}

/// A fresh 2 MiB-aligned mapping of 2 MiB.
fn map_chunk() -> Option<u64> {
    let p = map_anon(2 * PAGE, false)?;
    let base = p.next_multiple_of(PAGE);
    if base > p {
        unmap(p, (base - p) as usize);
    }
    let (end, tail) = (p + 2 * PAGE, base + PAGE);
    if end > tail {
        unmap(tail, (end - tail) as usize);
    }
    Some(base)
}

/// Frees an allocation carved from a chunk (removed from the registry): its pages are fresh
/// again, and the chunk, once it holds nothing, is unmapped and its charge refunded.
pub(crate) fn release(node: &Node, a: &Alloc) {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED;
    // SAFETY: (a.base, a.map_len) lies in a chunk this module mapped and still holds (the chunk
    // is unmapped only once its last allocation is gone, below); MAP_FIXED replaces just those
    // pages (their bytes, or an IPC export's memfd) with zeroed anonymous ones.
    unsafe { libc::mmap(a.base as *mut libc::c_void, a.map_len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
    let mut all = chunks();
    let Some(i) = all.iter().position(|c| c.base <= a.base && a.base < c.base + PAGE) else { return };
    let c = &mut all[i];
    c.mark(((a.base - c.base) / SLOT) as usize, a.map_len / SLOT as usize, false);
    c.live -= 1;
    if c.live == 0 {
        let c = all.swap_remove(i);
        drop(all);
        unmap(c.base, PAGE as usize);
        refund(node, c.gpu, c.domain, PAGE, c.epoch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_hands_out_runs_of_slots_and_takes_them_back() {
        let mut c = Chunk { base: 0, ctx: 1, gpu: 0, domain: 0, epoch: 0, taken: [0; SLOTS / 64], slots: 0, live: 0 };
        assert_eq!(c.take(1), Some(0));
        assert_eq!(c.take(256), Some(1), "1 MiB fits beside");
        assert_eq!(c.take(256), None, "another 1 MiB does not");
        assert_eq!(c.take(255), Some(257));
        c.mark(0, 1, false);
        c.live -= 1;
        assert_eq!(c.take(1), Some(0), "a freed slot is taken again");
        assert_eq!(c.live, 3);
    }

    #[test]
    fn whole_pages_round_up_to_2_mib() {
        assert_eq!(whole_pages(PAGE + 1), Ok(2 * PAGE));
        assert_eq!(whole_pages(64 << 20), Ok(64 << 20));
        assert_eq!(whole_pages(SMALL_MAX + 1), Ok(PAGE));
        assert_eq!(whole_pages(u64::MAX), Err(OUT_OF_MEMORY));
    }
}
