//! The process's handle registry: every context, stream, event, module, function, graph, pool and
//! allocation the process holds, keyed by the handle value given to C.
//!
//! Handles are never dereferenced: a handle is a key, looked up under one reader-writer lock, so a
//! made-up, stale or wrong-kind handle is an error code, never undefined behaviour. Handle values
//! come from one counter and are never reused, so a stale handle cannot alias a newer object (and
//! none can equal `CU_STREAM_LEGACY` or `CU_STREAM_PER_THREAD`). The hot paths (launch, record,
//! query) take the read lock once and allocate nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::sync::{Arc, LazyLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::context::Ctx;
use super::event::Event;
use super::graph::{Exec, GNode, Graph};
use super::init::driver;
use super::memory::{Alloc, Array};
use super::mipmap::Mipmap;
use super::module::{Func, Library, Module};
use super::pools::Pool;
use super::stream::Stream;
use super::vmm::{Phys, Reservation};
use super::{CUresult, INVALID_HANDLE, INVALID_VALUE, R, sys};

/// Everything the process holds, by handle (memory by base address).
#[derive(Default)]
pub(crate) struct Registry {
    pub ctxs: HashMap<usize, Arc<Ctx>>,
    pub streams: HashMap<usize, Arc<Stream>>,
    pub events: HashMap<usize, Arc<Event>>,
    pub modules: HashMap<usize, Arc<Module>>,
    /// `CUfunction`s, and `CUkernel`s (which C may pass where a function is expected).
    pub funcs: HashMap<usize, Arc<Func>>,
    pub libraries: HashMap<usize, Arc<Library>>,
    pub graphs: HashMap<usize, Arc<Graph>>,
    pub gnodes: HashMap<usize, Arc<GNode>>,
    pub execs: HashMap<usize, Arc<Exec>>,
    pub pools: HashMap<usize, Arc<Pool>>,
    pub arrays: HashMap<usize, Arc<Array>>,
    pub mipmaps: HashMap<usize, Arc<Mipmap>>,
    /// Allocations (device, managed, pinned host, registered host, module globals), by base.
    pub mem: BTreeMap<u64, Alloc>,
    /// Virtual address reservations (`cuMemAddressReserve`), by base.
    pub vas: BTreeMap<u64, Reservation>,
    /// Physical allocations (`cuMemCreate`), by generic allocation handle.
    pub phys: HashMap<u64, Phys>,
}

static REGISTRY: LazyLock<RwLock<Registry>> = LazyLock::new(|| RwLock::new(Registry::default()));

/// The registry, for lookups.
pub(crate) fn read() -> RwLockReadGuard<'static, Registry> {
    REGISTRY.read().unwrap_or_else(|e| e.into_inner())
}

/// The registry, for creating and destroying objects.
pub(crate) fn write() -> RwLockWriteGuard<'static, Registry> {
    REGISTRY.write().unwrap_or_else(|e| e.into_inner())
}

/// First handle value: far from the special stream handles 0x1 and 0x2, and from small integers
/// a confused caller might pass.
const FIRST_HANDLE: usize = 0x7e55_0000_1000;
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(FIRST_HANDLE);

/// A fresh handle value, never handed out before in this process.
pub(crate) fn new_handle() -> usize {
    NEXT_HANDLE.fetch_add(0x10, Relaxed)
}

/// A small number for a handle (1 for the first), for ids C sees as integers.
pub(crate) fn ordinal_of(handle: usize) -> u64 {
    ((handle - FIRST_HANDLE) / 0x10 + 1) as u64
}

/// A handle as the pointer type C sees.
pub(crate) fn as_ptr<T>(handle: usize) -> *mut T {
    std::ptr::without_provenance_mut(handle)
}

/// The object `h` names in one of the registry's tables, once the driver is initialized;
/// `missing` when it names none there (another kind's, stale, or made up).
fn lookup<T>(h: usize, table: fn(&Registry) -> &HashMap<usize, Arc<T>>, missing: CUresult) -> R<Arc<T>> {
    driver()?;
    table(&read()).get(&h).cloned().ok_or(missing)
}

/// A module (`CUmodule`).
pub(crate) fn module(h: sys::CUmodule) -> R<Arc<Module>> {
    lookup(h as usize, |r| &r.modules, INVALID_HANDLE)
}

/// A library (`CUlibrary`).
pub(crate) fn library(h: sys::CUlibrary) -> R<Arc<Library>> {
    lookup(h as usize, |r| &r.libraries, INVALID_HANDLE)
}

/// An array (`CUarray`).
pub(crate) fn array(h: sys::CUarray) -> R<Arc<Array>> {
    lookup(h as usize, |r| &r.arrays, INVALID_HANDLE)
}

/// A mipmapped array (`CUmipmappedArray`).
pub(crate) fn mipmap(h: sys::CUmipmappedArray) -> R<Arc<Mipmap>> {
    lookup(h as usize, |r| &r.mipmaps, INVALID_HANDLE)
}

/// A graph (`CUgraph`); a wrong one is `INVALID_VALUE`, as the driver answers.
pub(crate) fn graph(h: sys::CUgraph) -> R<Arc<Graph>> {
    lookup(h as usize, |r| &r.graphs, INVALID_VALUE)
}

/// A memory pool (`CUmemoryPool`); a wrong one is `INVALID_VALUE`, as the driver answers.
pub(crate) fn pool(h: sys::CUmemoryPool) -> R<Arc<Pool>> {
    lookup(h as usize, |r| &r.pools, INVALID_VALUE)
}

impl Registry {
    /// The allocation containing `addr`, if any.
    pub(crate) fn alloc_at(&self, addr: u64) -> Option<&Alloc> {
        let (_, a) = self.mem.range(..=addr).next_back()?;
        (addr < a.base + a.size.max(1)).then_some(a)
    }

    /// The reservation containing `addr`, if any.
    pub(crate) fn reservation_at(&self, addr: u64) -> Option<&Reservation> {
        let (_, r) = self.vas.range(..=addr).next_back()?;
        (addr < r.base + r.size).then_some(r)
    }
}
