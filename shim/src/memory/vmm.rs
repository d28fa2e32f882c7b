//! The virtual-memory API's physical allocations: charged from `cuMemCreate` until the driver
//! frees them, which is when every handle to them is released AND every mapping of them is gone
//! (the driver keeps a released allocation alive while it is mapped; CUDA's memMap samples
//! release right after mapping).
//!
//! Per physical handle this process created, [`Vmm`] counts the handle references (`cuMemCreate`
//! and each `cuMemRetainAllocationHandle`, less each `cuMemRelease`) and the mappings
//! (`cuMemMap`, less `cuMemUnmap` and `cuMemAddressFree` of the ranges they lie in); the charge is
//! refunded when both reach zero. A handle mapped into a sparse array (`cuMemMapArrayAsync`) stays
//! charged until the process ends: array tiles are not tracked one by one, so Tessera errs on the
//! side of charging.
//!
//! Memory shared between processes (`cuMemExportToShareableHandle` in one,
//! `cuMemImportFromShareableHandle` in another) lives while any process holds a handle to it or
//! maps it (cuda.h, `cuMemRelease`): the exporter's release frees nothing while an importer maps
//! it, and the exporter may exit. So every process is charged what it can touch: the exporter as
//! above, an importer for a handle it imported from the moment it maps it, the furthest byte of
//! the allocation it has mapped (the driver tells no allocation's size from its handle), reserved
//! before the driver is called (over the limit: `CUDA_ERROR_OUT_OF_MEMORY`, the driver never maps
//! it), until it has released and unmapped it as above. While both hold it, both are charged
//! (twice in one container): never nobody. Before, an importer was charged nothing, and memory
//! whose exporter had released it was charged to no one: 8 GiB held under a 2 GiB share.
//!
//! Bookkeeping and driver call happen under one lock, so a handle value the driver frees and
//! hands out again can never be confused with the old one (virtual-memory calls are rare).

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_uint, c_void};
use std::sync::{Mutex, MutexGuard};

use super::alloc::{flavour, hook};
use crate::ffi::*;
use crate::state::ShimState;
use tessera_abi::cuda_exports;
use tessera_region::TraceFunc;

/// One physical allocation this process created and was charged for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Physical {
    dev: usize,
    bytes: u64,
    /// Handle references not yet released.
    handles: u32,
    /// Live mappings of it in this process.
    mappings: u32,
    /// Mapped into a sparse array: kept charged until the process ends.
    in_array: bool,
    /// Imported from another process: charged what this process has mapped of it (`bytes`
    /// grows with its mappings).
    imported: bool,
}

impl Physical {
    fn freed(&self) -> bool {
        self.handles == 0 && self.mappings == 0 && !self.in_array
    }
}

/// A charge to give back: (region device, bytes).
pub(crate) type Refund = (usize, u64);

#[derive(Default)]
pub(crate) struct Books {
    physical: HashMap<u64, Physical>,
    /// Mappings of charged handles: start address → (size, handle).
    mappings: BTreeMap<u64, (u64, u64)>,
}

impl Books {
    fn created(&mut self, handle: u64, dev: usize, bytes: u64) {
        let p = Physical { dev, bytes, handles: 1, mappings: 0, in_array: false, imported: false };
        self.physical.insert(handle, p);
    }

    /// A handle imported from another process (`cuMemImportFromShareableHandle`): charged nothing
    /// until it is mapped. One the process holds already (the driver may hand it back) is one
    /// more reference.
    fn imported(&mut self, handle: u64, dev: usize) {
        match self.physical.get_mut(&handle) {
            Some(p) => p.handles += 1,
            None => {
                let p = Physical { dev, bytes: 0, handles: 1, mappings: 0, in_array: false, imported: true };
                self.physical.insert(handle, p);
            }
        }
    }

    /// What mapping an imported handle up to byte `end` of it adds to its charge: (device, bytes).
    fn import_growth(&self, handle: u64, end: u64) -> Option<(usize, u64)> {
        let p = self.physical.get(&handle).filter(|p| p.imported)?;
        (end > p.bytes).then(|| (p.dev, end - p.bytes))
    }

    /// An imported handle is mapped up to byte `end`: its charge grows to that; returns by how
    /// much (0: it covered it already, or the handle is gone).
    fn grow_import(&mut self, handle: u64, end: u64) -> u64 {
        match self.physical.get_mut(&handle) {
            Some(p) if p.imported && end > p.bytes => {
                let g = end - p.bytes;
                p.bytes = end;
                g
            }
            _ => 0,
        }
    }

    /// One more handle reference (`cuMemRetainAllocationHandle`), if the handle is ours.
    fn retained(&mut self, handle: u64) {
        if let Some(p) = self.physical.get_mut(&handle) {
            p.handles += 1;
        }
    }

    /// A handle reference released: the refund if that freed the allocation.
    fn released(&mut self, handle: u64) -> Option<Refund> {
        let p = self.physical.get_mut(&handle)?;
        p.handles = p.handles.saturating_sub(1);
        self.collect(handle)
    }

    fn mapped(&mut self, va: u64, size: u64, handle: u64) {
        if let Some(p) = self.physical.get_mut(&handle) {
            p.mappings += 1;
            self.mappings.insert(va, (size, handle));
        }
    }

    /// Every tracked mapping starting in `[va, va + size)` is gone: the refunds it frees.
    fn unmapped(&mut self, va: u64, size: u64) -> Vec<Refund> {
        let end = va.saturating_add(size);
        let gone: Vec<(u64, u64)> = self.mappings.range(va..end).map(|(&a, &(_, h))| (a, h)).collect();
        let mut out = Vec::new();
        for (a, h) in gone {
            self.mappings.remove(&a);
            if let Some(p) = self.physical.get_mut(&h) {
                p.mappings = p.mappings.saturating_sub(1);
            }
            out.extend(self.collect(h));
        }
        out
    }

    /// Whether any of `handles` was imported from another process.
    fn any_imported(&self, mut handles: impl Iterator<Item = u64>) -> bool {
        handles.any(|h| self.physical.get(&h).is_some_and(|p| p.imported))
    }

    fn mapped_into_array(&mut self, handle: u64) {
        if let Some(p) = self.physical.get_mut(&handle) {
            p.in_array = true;
        }
    }

    fn collect(&mut self, handle: u64) -> Option<Refund> {
        let p = *self.physical.get(&handle)?;
        if !p.freed() {
            return None;
        }
        self.physical.remove(&handle);
        Some((p.dev, p.bytes))
    }

    /// What is charged for physical allocations (for tests).
    #[cfg(test)]
    fn charged(&self) -> u64 {
        self.physical.values().map(|p| p.bytes).sum()
    }
}

/// This process's physical allocations and their mappings.
pub(crate) struct Vmm {
    books: Mutex<Books>,
}

impl Vmm {
    pub(crate) fn new() -> Vmm {
        Vmm { books: Mutex::new(Books::default()) }
    }

    fn books(&self) -> MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What this process's physical allocations on a device are charged. The driver holds at
    /// least this for them: the books change under the same lock as the driver's calls that
    /// make and free them.
    pub(crate) fn charged_on(&self, dev: usize) -> u64 {
        self.books().physical.values().filter(|p| p.dev == dev).map(|p| p.bytes).sum()
    }
}

fn refund_all(s: &ShimState, refunds: impl IntoIterator<Item = Refund>) {
    for (dev, bytes) in refunds {
        crate::trace::note(dev, bytes);
        s.refund(dev, bytes);
    }
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMemCreate`.
    fn cuMemCreate(handle, size, prop, flags) {
        hook(TraceFunc::cuMemCreate, |s, cu| {
            // SAFETY: the caller's arguments, passed on unchanged.
            let call = || unsafe { (cu.cuMemCreate)(handle, size, prop, flags) };
            // SAFETY: prop is null or the caller's CUmemAllocationProp, whose head this reads
            // (its enums as raw integers).
            let Some(p) = (unsafe { get(prop.cast::<MemAllocPropHead>()) }) else { return call() };
            // Only device memory counts (host-located physical memory is not the GPU's).
            if p.location_type != CU_MEM_LOCATION_TYPE_DEVICE || size == 0 {
                return call();
            }
            let Some(dev) = s.device_of_ordinal(p.location_id) else { return call() };
            let bytes = size as u64;
            crate::trace::note(dev, bytes);
            if !s.reserve(dev, bytes) {
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            let mut books = s.mem.vmm.books();
            let rc = call();
            // SAFETY: the driver wrote the handle (it succeeded).
            match (rc, unsafe { get(handle) }) {
                (CUDA_SUCCESS, Some(h)) => books.created(h, dev, bytes),
                _ => s.refund(dev, bytes),
            }
            rc
        })
    }

    /// # Safety
    /// As cuda.h's `cuMemRelease`. The charge goes back once the allocation is also unmapped.
    fn cuMemRelease(handle) {
        hook(TraceFunc::cuMemRelease, |s, cu| {
            let mut books = s.mem.vmm.books();
            // SAFETY: the caller's argument, passed on unchanged.
            let rc = unsafe { (cu.cuMemRelease)(handle) };
            let refund = if rc == CUDA_SUCCESS { books.released(handle) } else { None };
            drop(books);
            refund_all(s, refund);
            rc
        })
    }

    /// # Safety
    /// As cuda.h's `cuMemRetainAllocationHandle`: one more reference to release.
    fn cuMemRetainAllocationHandle(handle, addr) {
        hook(TraceFunc::cuMemRetainAllocationHandle, |s, cu| {
            let Some(f) = cu.cuMemRetainAllocationHandle else { return CUDA_ERROR_NOT_SUPPORTED };
            let mut books = s.mem.vmm.books();
            // SAFETY: the caller's arguments, passed on unchanged.
            let rc = unsafe { f(handle, addr) };
            if rc == CUDA_SUCCESS {
                // SAFETY: the driver wrote the handle (it succeeded).
                if let Some(h) = unsafe { get(handle) } {
                    books.retained(h);
                }
            }
            rc
        })
    }

    /// # Safety
    /// As cuda.h's `cuMemMap`.
    fn cuMemMap(ptr, size, offset, handle, flags) {
        hook(TraceFunc::cuMemMap, |s, cu| {
            let Some(f) = cu.cuMemMap else { return CUDA_ERROR_NOT_SUPPORTED };
            let end = (offset as u64).saturating_add(size as u64);
            // An imported handle: what the mapping adds is reserved first (outside the books' lock,
            // which a refused reservation's true-up takes).
            let growth = s.mem.vmm.books().import_growth(handle, end);
            if let Some((dev, bytes)) = growth {
                crate::trace::note(dev, bytes);
                if !s.reserve(dev, bytes) {
                    return CUDA_ERROR_OUT_OF_MEMORY;
                }
            }
            let mut books = s.mem.vmm.books();
            // SAFETY: the caller's arguments, passed on unchanged.
            let rc = unsafe { f(ptr, size, offset, handle, flags) };
            let mut excess = growth;
            if rc == CUDA_SUCCESS {
                books.mapped(ptr, size as u64, handle);
                // Another thread may have mapped more of it meanwhile: only the growth is kept.
                let grew = books.grow_import(handle, end);
                excess = growth.map(|(dev, bytes)| (dev, bytes - grew.min(bytes)));
            }
            drop(books);
            refund_all(s, excess.filter(|e| e.1 > 0));
            rc
        })
    }
}

/// `CUmemAllocationProp`, as `cuMemGetAllocationPropertiesFromHandle` writes it (32 bytes).
#[repr(C)]
struct AllocationProp {
    head: MemAllocPropHead,
    win32_metadata: *mut c_void,
    flags: [u8; 8],
}

const _: () = assert!(std::mem::size_of::<AllocationProp>() == 32);

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMemImportFromShareableHandle`. Charged nothing until mapped (see the module).
    fn cuMemImportFromShareableHandle(handle, osHandle, shHandleType) {
        hook(TraceFunc::cuMemImportFromShareableHandle, |s, cu| {
            let Some(f) = cu.cuMemImportFromShareableHandle else { return CUDA_ERROR_NOT_SUPPORTED };
            let mut books = s.mem.vmm.books();
            // SAFETY: the caller's arguments, passed on unchanged.
            let rc = unsafe { f(handle, osHandle, shHandleType) };
            // SAFETY: the driver wrote the handle (it succeeded).
            if let (CUDA_SUCCESS, Some(h)) = (rc, unsafe { get(handle) }) {
                let mut prop = AllocationProp {
                    head: MemAllocPropHead { alloc_type: 0, handle_types: 0, location_type: 0, location_id: 0 },
                    win32_metadata: std::ptr::null_mut(),
                    flags: [0; 8],
                };
                let props = cu.cuMemGetAllocationPropertiesFromHandle.map(|g| {
                    // SAFETY: prop is a CUmemAllocationProp-sized out-struct; h the handle just made.
                    unsafe { g((&raw mut prop).cast(), h) }
                });
                let on_device = props == Some(CUDA_SUCCESS) && prop.head.location_type == CU_MEM_LOCATION_TYPE_DEVICE;
                if let Some(dev) = on_device.then(|| s.device_of_ordinal(prop.head.location_id)).flatten() {
                    books.imported(h, dev);
                }
            }
            rc
        })
    }
}

/// Unmaps (or frees) a virtual range: its mappings are gone, and with them maybe allocations.
fn unmapping(s: &ShimState, ptr: CUdeviceptr, size: usize, call: impl FnOnce() -> CUresult) -> CUresult {
    let mut books = s.mem.vmm.books();
    let rc = call();
    let refunds = if rc == CUDA_SUCCESS { books.unmapped(ptr, size as u64) } else { Vec::new() };
    drop(books);
    refund_all(s, refunds);
    rc
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMemUnmap`.
    fn cuMemUnmap(ptr, size) {
        hook(TraceFunc::cuMemUnmap, |s, cu| {
            let Some(f) = cu.cuMemUnmap else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            unmapping(s, ptr, size, || unsafe { f(ptr, size) })
        })
    }

    /// # Safety
    /// As cuda.h's `cuMemAddressFree` (a driver may drop the range's mappings with it).
    fn cuMemAddressFree(ptr, size) {
        hook(TraceFunc::cuMemAddressFree, |s, cu| {
            let Some(f) = cu.cuMemAddressFree else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            unmapping(s, ptr, size, || unsafe { f(ptr, size) })
        })
    }
}

/// Marks every charged handle `list` maps into a sparse array, then calls the driver.
///
/// # Safety
/// `list` must be null or hold `count` `CUarrayMapInfo` entries (the caller's contract).
unsafe fn array_mapping(
    s: &ShimState,
    list: *mut ArrayMapInfo,
    count: c_uint,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let mut books = s.mem.vmm.books();
    let handles = || {
        (0..if list.is_null() { 0 } else { count as usize }).map_while(|i| {
            // SAFETY: the caller's array of `count` entries (contract); read, not kept.
            let e = unsafe { get(list.add(i).cast_const()) }?;
            let map =
                e.mem_operation_type == CU_MEM_OPERATION_TYPE_MAP && e.mem_handle_type == CU_MEM_HANDLE_TYPE_GENERIC;
            Some(map.then_some(e.mem_handle))
        })
    };
    // What an array tile of an imported handle holds is not known here (tiles are not tracked):
    // refused, rather than memory the process touches charged to no one.
    if books.any_imported(handles().flatten()) {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            eprintln!("tessera: a handle imported from another process mapped into a sparse array is not supported");
        }
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    let rc = call();
    if rc == CUDA_SUCCESS {
        for h in handles().flatten() {
            books.mapped_into_array(h);
        }
    }
    rc
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuMemMapArrayAsync`, and `cuMemMapArrayAsync_ptsz`.
    fn cuMemMapArrayAsync(mapInfoList, count, hStream) twin cuMemMapArrayAsync_ptsz(ptsz) {
        hook(flavour(ptsz, TraceFunc::cuMemMapArrayAsync, TraceFunc::cuMemMapArrayAsync_ptsz), |s, cu| {
            let f = flavour(ptsz, cu.cuMemMapArrayAsync, cu.cuMemMapArrayAsync_ptsz);
            let Some(f) = f else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged and read as the driver reads them.
            unsafe { array_mapping(s, mapInfoList.cast(), count, || f(mapInfoList, count, hStream)) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn released_but_mapped_stays_charged_until_unmapped() {
        let mut b = Books::default();
        b.created(7, 0, 512 * MIB);
        b.mapped(0x1000_0000, 512 * MIB, 7);
        assert_eq!(b.released(7), None, "still mapped");
        assert_eq!(b.charged(), 512 * MIB);
        assert_eq!(b.unmapped(0x1000_0000, 512 * MIB), vec![(0, 512 * MIB)]);
        assert_eq!(b.charged(), 0);
        assert_eq!(b.released(7), None, "a second release of a gone handle refunds nothing");
    }

    #[test]
    fn every_mapping_and_every_retained_reference_counts() {
        let mut b = Books::default();
        b.created(1, 2, 4 * MIB);
        b.mapped(0x10_0000, 2 * MIB, 1);
        b.mapped(0x90_0000, 2 * MIB, 1);
        b.retained(1);
        assert_eq!(b.released(1), None);
        assert_eq!(b.unmapped(0x10_0000, 2 * MIB), vec![], "one mapping left, one handle");
        assert_eq!(b.released(1), None, "one mapping left");
        assert_eq!(b.unmapped(0x90_0000, 2 * MIB), vec![(2, 4 * MIB)]);
    }

    #[test]
    fn one_unmap_may_cover_several_mappings_and_only_those() {
        let mut b = Books::default();
        for (h, va) in [(1u64, 0x100_0000u64), (2, 0x120_0000), (3, 0x140_0000)] {
            b.created(h, 0, 2 * MIB);
            b.mapped(va, 2 * MIB, h);
            assert_eq!(b.released(h), None);
        }
        let mut r = b.unmapped(0x100_0000, 4 * MIB);
        r.sort();
        assert_eq!(r, vec![(0, 2 * MIB), (0, 2 * MIB)]);
        assert_eq!(b.charged(), 2 * MIB, "the third, outside the range, stays");
    }

    #[test]
    fn an_imported_handle_is_charged_what_is_mapped_until_released_and_unmapped() {
        let mut b = Books::default();
        b.imported(9, 1);
        assert_eq!(b.charged(), 0, "importing charges nothing yet");
        assert_eq!(b.import_growth(9, 64 * MIB), Some((1, 64 * MIB)));
        b.mapped(0x200_0000, 64 * MIB, 9);
        assert_eq!(b.grow_import(9, 64 * MIB), 64 * MIB);
        assert_eq!(b.import_growth(9, 32 * MIB), None, "a mapping of less adds nothing");
        assert_eq!(b.import_growth(9, 96 * MIB), Some((1, 32 * MIB)), "of more, the difference");
        assert_eq!(b.import_growth(5, 96 * MIB), None, "not imported: charged at cuMemCreate");
        b.created(5, 1, 2 * MIB);
        assert!(b.any_imported([5, 9].into_iter()), "an imported handle into a sparse array: refused");
        assert!(!b.any_imported([5, 77].into_iter()), "created or unknown ones pass");
        assert_eq!(b.released(9), None, "still mapped");
        assert_eq!(b.unmapped(0x200_0000, 64 * MIB), vec![(1, 64 * MIB)]);
        assert_eq!(b.charged(), 2 * MIB, "the created one alone is left");
    }

    #[test]
    fn unknown_handles_pass_through_and_array_mappings_stay_charged() {
        let mut b = Books::default();
        b.mapped(0x100_0000, 2 * MIB, 99);
        b.retained(99);
        assert_eq!(b.released(99), None, "imported: not ours to refund");
        assert!(b.mappings.is_empty());
        b.created(5, 0, 2 * MIB);
        b.mapped_into_array(5);
        assert_eq!(b.released(5), None, "mapped into a sparse array: charged until exit");
        assert_eq!(b.charged(), 2 * MIB);
    }
}
