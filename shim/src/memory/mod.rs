//! Device-memory limits: every allocation family is reserved in the region before the driver is
//! called and rolled back if the driver fails; frees refund exactly what was charged.
//!
//! - [`alloc`]: linear memory (`cuMemAlloc*`, pitched, managed), stream-ordered allocations,
//!   arrays;
//! - [`granularity`]: linear device memory charged as the driver holds it (2 MiB pages; small
//!   allocations by the shared chunk they lie in), as NVML's per-process figure counts it;
//! - [`vmm`]: the virtual-memory API's physical allocations, charged until released and unmapped;
//! - [`context`]: each context's own overhead (reserved before it is created, trued up to what
//!   it measured: at once, or, for a process's first context on a device while NVML is not yet
//!   loaded, on a helper thread or before an answer the over-reservation would change);
//! - [`context_size`]: a process's first primary context on a GPU charged the size tesserad
//!   measured there (its allocation's `context-sizes` file), with no NVML loaded;
//! - [`graph`]: graph memory nodes, charged as the driver's graph pool holds them;
//! - [`pools`]: stream-ordered allocations, charged as their memory pools hold them (freed memory
//!   a pool keeps in reserve stays charged);
//! - [`ctx_limits`]: what raising a context's stack, printf FIFO or malloc heap limit sets aside;
//! - [`info`]: `cuMemGetInfo` and `cuDeviceTotalMem` describe the virtual GPU.
//!
//! The [`Tracker`] remembers each live charge (device pointer, array, physical allocation or
//! context → device and bytes) in maps split into shards by key, so concurrent threads rarely
//! meet on a lock, and a free refunds what its allocation charged. Frees of what we never
//! charged pass through.

pub(crate) mod alloc;
pub(crate) mod context;
pub(crate) mod context_size;
pub(crate) mod ctx_limits;
pub(crate) mod granularity;
pub(crate) mod graph;
pub(crate) mod info;
pub(crate) mod pools;
pub(crate) mod vmm;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};

/// What a charge is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `cuMemAlloc*`, `cuMemAllocPitch*`: freed with its context.
    Device,
    /// `cuMemAllocManaged`: freed with its context.
    Managed,
    /// Stream-ordered (`cuMemAllocAsync`, pools): outlives its context.
    Async,
    /// A CUDA array: freed with its context.
    Array,
    /// A context's own overhead.
    Context,
}

impl Kind {
    /// Whether destroying the context the charge was made in frees it.
    pub(crate) fn dies_with_context(self) -> bool {
        matches!(self, Kind::Device | Kind::Managed | Kind::Array)
    }
}

/// One live charge.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Charge {
    /// Region device index.
    pub dev: usize,
    pub bytes: u64,
    /// The context it was made in (0: none).
    pub ctx: usize,
    pub kind: Kind,
}

/// A cheap multiplicative hasher for pointer-like keys.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Map = HashMap<u64, Charge, BuildHasherDefault<KeyHasher>>;

const SHARDS: usize = 64;

/// A map from key to charge, split into shards by key.
pub(crate) struct Sharded {
    shards: Box<[Mutex<Map>]>,
}

impl Sharded {
    fn new() -> Sharded {
        Sharded { shards: (0..SHARDS).map(|_| Mutex::new(Map::default())).collect() }
    }

    fn shard(&self, key: u64) -> MutexGuard<'_, Map> {
        let i = ((key ^ (key >> 12) ^ (key >> 21)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize % SHARDS;
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn insert(&self, key: u64, c: Charge) {
        self.shard(key).insert(key, c);
    }

    pub(crate) fn remove(&self, key: u64) -> Option<Charge> {
        self.shard(key).remove(&key)
    }

    pub(crate) fn get(&self, key: u64) -> Option<Charge> {
        self.shard(key).get(&key).copied()
    }

    /// Changes a live charge's bytes in place (under its shard's lock, so a concurrent
    /// [`Sharded::remove`] refunds either the old figure or the new one, never a mix); the
    /// charge as it was, or `None` if it is gone.
    pub(crate) fn set_bytes(&self, key: u64, bytes: u64) -> Option<Charge> {
        let mut m = self.shard(key);
        let c = m.get_mut(&key)?;
        let old = *c;
        c.bytes = bytes;
        Some(old)
    }

    /// Removes and returns every charge `take` selects.
    pub(crate) fn drain_where(&self, mut take: impl FnMut(&Charge) -> bool) -> Vec<(u64, Charge)> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            let mut m = s.lock().unwrap_or_else(|e| e.into_inner());
            m.retain(|&k, c| {
                if take(c) {
                    out.push((k, *c));
                    false
                } else {
                    true
                }
            });
        }
        out
    }

    /// The first charge `pick` selects.
    pub(crate) fn find(&self, pick: impl Fn(&Charge) -> bool) -> Option<(u64, Charge)> {
        self.shards.iter().find_map(|s| {
            let m = s.lock().unwrap_or_else(|e| e.into_inner());
            m.iter().find(|(_, c)| pick(c)).map(|(&k, &c)| (k, c))
        })
    }

    /// Total bytes of the charges `pick` selects.
    pub(crate) fn total_where(&self, pick: impl Fn(&Charge) -> bool) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                s.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|c| pick(c)).map(|c| c.bytes).sum::<u64>()
            })
            .sum()
    }
}

/// Every live charge of this process.
pub(crate) struct Tracker {
    /// Device pointers (linear, managed, stream-ordered), but for small linear allocations.
    pub ptrs: Sharded,
    /// Small linear allocations and the 2 MiB chunks they hold.
    pub chunks: granularity::Chunks,
    /// CUDA array handles.
    pub arrays: Sharded,
    /// Physical allocations and their mappings.
    pub vmm: vmm::Vmm,
    /// Graph memory: executable graphs' allocation nodes and each device's graph pool.
    pub graphs: graph::GraphMem,
    /// Memory pools of stream-ordered allocation.
    pub pools: pools::Pools,
    /// Contexts' own overhead, by context handle.
    pub contexts: Sharded,
    /// What contexts' raised limits set aside.
    pub limits: ctx_limits::CtxLimits,
    /// Contexts whose true-up waits for NVML.
    pub deferred: context::Deferred,
    /// The primary context handle of each CUDA ordinal (0: not seen).
    pub primaries: [std::sync::atomic::AtomicU64; 64],
    /// Serializes context creation and destruction, so that overhead measurements do not
    /// overlap (rare calls: a lock is fine here).
    pub lifecycle: Mutex<()>,
}

impl Tracker {
    pub(crate) fn new() -> Tracker {
        Tracker {
            ptrs: Sharded::new(),
            chunks: granularity::Chunks::new(),
            arrays: Sharded::new(),
            vmm: vmm::Vmm::new(),
            graphs: graph::GraphMem::new(),
            pools: pools::Pools::new(),
            contexts: Sharded::new(),
            limits: ctx_limits::CtxLimits::new(),
            deferred: context::Deferred::new(),
            primaries: [const { std::sync::atomic::AtomicU64::new(0) }; 64],
            lifecycle: Mutex::new(()),
        }
    }

    pub(crate) fn lifecycle(&self) -> MutexGuard<'_, ()> {
        self.lifecycle.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharded_map_inserts_removes_and_drains() {
        let m = Sharded::new();
        for k in 0..1000u64 {
            m.insert(k * 4096, Charge { dev: (k % 3) as usize, bytes: k, ctx: (k % 2) as usize, kind: Kind::Device });
        }
        assert_eq!(m.get(4096).map(|c| c.bytes), Some(1));
        assert_eq!(m.set_bytes(4096, 7).map(|c| c.bytes), Some(1), "the charge as it was");
        assert_eq!(m.get(4096).map(|c| c.bytes), Some(7));
        assert!(m.set_bytes(3, 7).is_none(), "no such charge");
        m.set_bytes(4096, 1);
        assert_eq!(m.remove(8192).map(|c| c.bytes), Some(2));
        assert!(m.remove(8192).is_none());
        let odd = m.drain_where(|c| c.ctx == 1);
        assert_eq!(odd.len(), 500);
        assert_eq!(m.total_where(|c| c.ctx == 1), 0);
        assert_eq!(m.total_where(|_| true), (0..1000u64).filter(|k| k % 2 == 0 && *k != 2).sum::<u64>());
    }
}
