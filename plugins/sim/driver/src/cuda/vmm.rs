//! Virtual memory management: physical allocations (`cuMemCreate`, charged to the model when
//! created), address reservations, and mappings between them, with access set per range.
//!
//! A physical allocation is a memfd of its size; mapping it maps the memfd at the reserved
//! address (shared), so two mappings of one allocation see the same bytes, and access flags are
//! page protections: memory mapped without access cannot be reached by a copy (the range check
//! refuses it before any byte moves).
//!
//! Sharing between processes (`cuMemExportToShareableHandle` /
//! `cuMemImportFromShareableHandle` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, as PyTorch's
//! expandable segments share memory): the shareable handle is a duplicate of the allocation's
//! memfd, which a program passes to another process of the node over a unix socket like any file
//! descriptor. The memfd is named for the GPU and memory domain it lives on and sealed against
//! resizing, so an importer can tell a handle of this driver, and map it without fearing a
//! truncation. As on a real driver (cuda.h, `cuMemRelease`: the allocation is freed once every
//! mapping is unmapped and every reference, shareable ones included, is released), the memory
//! lives while any process holds a handle to it or maps it, the exporter's release
//! notwithstanding; and it is counted to every process that holds it: the exporter from
//! `cuMemCreate` until it releases and unmaps it, an importer from `cuMemImportFromShareableHandle`
//! until it does, so NVML's process list shows each holder with it. Where the sim differs: the
//! device's used memory counts such an allocation once per process holding it (a real GPU holds
//! it once), so an import can be refused `CUDA_ERROR_OUT_OF_MEMORY` on a nearly full device.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering::*};

use tessera_abi::cuda_exports;
use tessera_sim_model::Node;

use super::errors::poll_faults;
use super::handles::{self, Registry};
use super::init::{Device, driver};
use super::memory::{PtrInfo, charge, refund};
use super::pools::{ALLOCATION_TYPE_PINNED, AccessDesc, LOCATION_TYPE_DEVICE};
use super::{CUresult, INVALID_DEVICE, INVALID_VALUE, NOT_SUPPORTED, OUT_OF_MEMORY, R, get, need, put, run, sys};

/// `cuMemGetAllocationGranularity`: 2 MiB, minimum and recommended alike.
pub(crate) const GRANULARITY: u64 = 2 << 20;

static NEXT_PHYS: AtomicU64 = AtomicU64::new(1);

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const HANDLE_TYPE_POSIX_FD: u32 = 1;
/// What every allocation's memfd is named after: `tessera-vmm:<gpu>:<memory domain>`.
const MEMFD_PREFIX: &str = "tessera-vmm:";
/// The seals an allocation's memfd carries: its size is fixed for good.
const SEALS: c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A physical allocation.
pub(crate) struct Phys {
    fd: c_int,
    pub size: u64,
    pub dev: &'static Device,
    charge: u64,
    epoch: u64,
    handle_types: u32,
    /// References by handle (`cuMemCreate`, `cuMemRetainAllocationHandle`) and by mapping.
    refs: u32,
    mappings: u32,
}

impl Phys {
    /// The memfd holding the allocation's bytes (for a checkpoint to move them).
    pub(crate) fn memfd(&self) -> c_int {
        self.fd
    }

    /// Whether another process may hold the allocation too (exportable or imported).
    pub(crate) fn shareable(&self) -> bool {
        self.handle_types != 0
    }
}

/// A mapping inside a reservation.
#[derive(Clone, Copy)]
pub(crate) struct Mapping {
    pub size: u64,
    pub phys: u64,
    /// `CUmemAccess_flags`: 0 none, 1 read, 3 read-write.
    pub prot: u32,
}

/// A reserved virtual address range and the mappings in it, by offset.
pub(crate) struct Reservation {
    pub base: u64,
    pub size: u64,
    pub maps: BTreeMap<u64, Mapping>,
}

impl Reservation {
    /// The mapping containing `addr`: (its start address, the mapping).
    fn mapping_at(&self, addr: u64) -> Option<(u64, &Mapping)> {
        let off = addr.checked_sub(self.base)?;
        let (&o, m) = self.maps.range(..=off).next_back()?;
        (off < o + m.size).then_some((self.base + o, m))
    }

    /// Mappings exactly tiling `[addr, addr + len)`, or `None` if a byte is unmapped.
    fn tiling(&self, addr: u64, len: u64) -> Option<Vec<(u64, Mapping)>> {
        let mut out = Vec::new();
        let end = addr.checked_add(len)?;
        let mut at = addr;
        while at < end {
            let (start, m) = self.mapping_at(at)?;
            out.push((start - self.base, *m));
            at = start + m.size;
        }
        Some(out)
    }
}

/// The start and size of the mapping containing `addr`.
pub(crate) fn mapping_at(reg: &Registry, addr: u64) -> Option<(u64, u64)> {
    let (start, m) = reg.reservation_at(addr)?.mapping_at(addr)?;
    Some((start, m.size))
}

/// Whether every byte of `[addr, addr + len)` is mapped with the access a copy needs.
pub(crate) fn accessible(reg: &Registry, addr: u64, len: u64, write: bool) -> bool {
    let Some(r) = reg.reservation_at(addr) else { return false };
    let need_prot = if write { 3 } else { 1 };
    r.tiling(addr, len.max(1)).is_some_and(|t| t.iter().all(|(_, m)| m.prot & need_prot == need_prot))
}

pub(crate) fn ptr_info(reg: &Registry, addr: u64) -> Option<PtrInfo> {
    let (start, m) = reg.reservation_at(addr)?.mapping_at(addr)?;
    let p = reg.phys.get(&m.phys)?;
    Some(PtrInfo {
        base: start,
        size: m.size,
        memory_type: 2,
        host: false,
        managed: false,
        ctx: 0,
        dev: p.dev.ordinal,
        id: m.phys,
        pool: 0,
        legacy_ipc: false,
        sync_memops: false,
        access: m.prot,
        handle_types: u64::from(p.handle_types),
    })
}

/// `CUmemAllocationProp` with its enums read as raw integers.
#[repr(C)]
#[derive(Clone, Copy)]
struct AllocProp {
    type_: u32,
    handle_types: u32,
    location_type: u32,
    location_id: c_int,
    win32_handle_meta_data: *mut c_void,
    alloc_flags: [u8; 8],
}
const _: () = assert!(std::mem::size_of::<AllocProp>() == std::mem::size_of::<sys::CUmemAllocationProp>());
const _: () =
    assert!(std::mem::offset_of!(AllocProp, alloc_flags) == std::mem::offset_of!(sys::CUmemAllocationProp, allocFlags));

/// Reads and checks allocation properties: pinned memory on a device; returns the device.
///
/// # Safety
/// `prop` must be null or point to a `CUmemAllocationProp`.
unsafe fn read_prop(prop: *const sys::CUmemAllocationProp) -> R<(AllocProp, &'static Device)> {
    // SAFETY: AllocProp has the layout of CUmemAllocationProp (asserted above) with the enums
    // read as raw integers; null/misaligned is checked by get.
    let p = unsafe { get(prop.cast::<AllocProp>()) }?;
    if p.type_ != ALLOCATION_TYPE_PINNED || p.location_type != LOCATION_TYPE_DEVICE || p.handle_types & !0xF != 0 {
        return Err(INVALID_VALUE);
    }
    let d = driver()?.device(p.location_id).map_err(|_| INVALID_VALUE)?;
    Ok((p, d))
}

cuda_exports! {
    fn cuMemGetAllocationGranularity(granularity, prop, option) {
        run(|| {
            need(granularity)?;
            // SAFETY: prop is the caller's struct.
            unsafe { read_prop(prop) }?;
            if !matches!(option, 0 | 1) {
                return Err(INVALID_VALUE);
            }
            // SAFETY: granularity is the caller's out-pointer (checked above).
            unsafe { put(granularity, GRANULARITY as usize) }
        })
    }
}

/// Frees a physical allocation whose last reference went away.
fn finalize(node: &Node, p: &Phys) {
    // SAFETY: fd is the memfd this module opened for the allocation; nothing maps it any more.
    unsafe { libc::close(p.fd) };
    refund(node, p.dev.gpu, p.dev.domain, p.charge, p.epoch);
}

cuda_exports! {
    fn cuMemCreate(handle, size, prop, flags) {
        run(|| {
            need(handle)?;
            // SAFETY: prop is the caller's struct.
            let (p, d) = unsafe { read_prop(prop) }?;
            let size = size as u64;
            if flags != 0 || size == 0 || !size.is_multiple_of(GRANULARITY) {
                return Err(INVALID_VALUE);
            }
            let node = driver()?.node;
            poll_faults(node)?;
            node.check_gpu(d.gpu).map_err(|_| CUresult::CUDA_ERROR_DEVICE_UNAVAILABLE)?;
            let name = format!("{MEMFD_PREFIX}{}:{}\0", d.gpu, d.domain);
            let epoch = charge(node, d.gpu, d.domain, size)?;
            // SAFETY: the name is NUL-terminated; memfd_create makes a new anonymous file.
            let fd = unsafe { libc::memfd_create(name.as_ptr().cast(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
            let sized = |fd| {
                // SAFETY: fd is the file just made: it grows sparse, then its size is sealed.
                unsafe { libc::ftruncate(fd, size as libc::off_t) == 0 && libc::fcntl(fd, libc::F_ADD_SEALS, SEALS) == 0 }
            };
            if fd < 0 || !sized(fd) {
                if fd >= 0 {
                    // SAFETY: fd is ours.
                    unsafe { libc::close(fd) };
                }
                refund(node, d.gpu, d.domain, size, epoch);
                return Err(OUT_OF_MEMORY);
            }
            let h = NEXT_PHYS.fetch_add(1, Relaxed);
            let phys = Phys { fd, size, dev: d, charge: size, epoch, handle_types: p.handle_types, refs: 1, mappings: 0 };
            handles::write().phys.insert(h, phys);
            // SAFETY: handle is the caller's out-pointer (checked above).
            unsafe { put(handle, h) }
        })
    }
}

/// Drops one reference of a physical allocation, freeing it with the last.
fn unref(node: &Node, reg: &mut Registry, h: u64, mapping: bool) {
    let Some(p) = reg.phys.get_mut(&h) else { return };
    if mapping {
        p.mappings = p.mappings.saturating_sub(1);
    } else {
        p.refs = p.refs.saturating_sub(1);
    }
    if p.refs == 0 && p.mappings == 0 {
        let p = reg.phys.remove(&h).expect("present");
        finalize(node, &p);
    }
}

cuda_exports! {
    fn cuMemRelease(handle) {
        run(|| {
            let node = driver()?.node;
            let mut reg = handles::write();
            if reg.phys.get(&handle).is_none_or(|p| p.refs == 0) {
                return Err(INVALID_VALUE);
            }
            unref(node, &mut reg, handle, false);
            Ok(())
        })
    }

    fn cuMemAddressReserve(ptr, size, alignment, addr, flags) {
        run(|| {
            need(ptr)?;
            driver()?;
            let (size, align) = (size as u64, if alignment == 0 { GRANULARITY } else { alignment as u64 });
            if flags != 0 || size == 0 || !size.is_multiple_of(GRANULARITY) || !align.is_power_of_two() {
                return Err(INVALID_VALUE);
            }
            let align = align.max(GRANULARITY);
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
            let mut base = None;
            if addr != 0 && addr.is_multiple_of(align) {
                // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping.
                let p = unsafe {
                    libc::mmap(
                        addr as *mut c_void,
                        size as usize,
                        libc::PROT_NONE,
                        flags | libc::MAP_FIXED_NOREPLACE,
                        -1,
                        0,
                    )
                };
                if p != libc::MAP_FAILED {
                    if p as u64 == addr {
                        base = Some(addr);
                    } else {
                        // SAFETY: p is the mapping just made.
                        unsafe { libc::munmap(p, size as usize) };
                    }
                }
            }
            let base = match base {
                Some(b) => b,
                None => {
                    let len = (size + align) as usize;
                    // SAFETY: a fresh anonymous mapping touches no existing memory.
                    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, flags, -1, 0) };
                    if p == libc::MAP_FAILED {
                        return Err(OUT_OF_MEMORY);
                    }
                    let (p, aligned) = (p as u64, (p as u64).next_multiple_of(align));
                    // SAFETY: both pieces lie in the mapping just made, outside the aligned range kept.
                    unsafe {
                        if aligned > p {
                            libc::munmap(p as *mut c_void, (aligned - p) as usize);
                        }
                        let tail = aligned + size;
                        if p + len as u64 > tail {
                            libc::munmap(tail as *mut c_void, (p + len as u64 - tail) as usize);
                        }
                    }
                    aligned
                }
            };
            let r = Reservation { base, size, maps: BTreeMap::new() };
            handles::write().vas.insert(base, r);
            // SAFETY: ptr is the caller's out-pointer (checked above).
            unsafe { put(ptr, base) }
        })
    }
}

/// Replaces a mapped range with an inaccessible reservation again.
fn remap_none(addr: u64, len: u64) {
    // SAFETY: (addr, len) lies inside one of our reservations (checked by the callers); MAP_FIXED
    // replaces only our own mapping there.
    unsafe {
        libc::mmap(
            addr as *mut c_void,
            len as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
}

cuda_exports! {
    fn cuMemAddressFree(ptr, size) {
        run(|| {
            let node = driver()?.node;
            let mut reg = handles::write();
            if reg.vas.get(&ptr).is_none_or(|r| r.size != size as u64) {
                return Err(INVALID_VALUE);
            }
            let r = reg.vas.remove(&ptr).expect("checked above");
            for m in r.maps.values() {
                unref(node, &mut reg, m.phys, true);
            }
            // SAFETY: the range was reserved by cuMemAddressReserve and nothing is registered in it now.
            unsafe { libc::munmap(r.base as *mut c_void, r.size as usize) };
            Ok(())
        })
    }

    fn cuMemMap(ptr, size, offset, handle, flags) {
        run(|| {
            driver()?;
            let (size, offset) = (size as u64, offset as u64);
            if flags != 0
                || size == 0
                || !size.is_multiple_of(GRANULARITY)
                || !offset.is_multiple_of(GRANULARITY)
                || !ptr.is_multiple_of(GRANULARITY)
            {
                return Err(INVALID_VALUE);
            }
            let mut reg = handles::write();
            let fd = match reg.phys.get(&handle) {
                Some(p) if offset.checked_add(size).is_some_and(|e| e <= p.size) => p.fd,
                _ => return Err(INVALID_VALUE),
            };
            let r = reg.vas.range_mut(..=ptr).next_back().map(|(_, r)| r).ok_or(INVALID_VALUE)?;
            if ptr + size > r.base + r.size {
                return Err(INVALID_VALUE);
            }
            let off = ptr - r.base;
            let overlaps = r.maps.range(..off + size).next_back().is_some_and(|(&o, m)| o + m.size > off);
            if overlaps {
                return Err(CUresult::CUDA_ERROR_ALREADY_MAPPED);
            }
            // SAFETY: [ptr, ptr + size) lies inside our reservation with nothing mapped there
            // (checked above); MAP_FIXED replaces only our reserved pages with the memfd's.
            let p = unsafe {
                libc::mmap(
                    ptr as *mut c_void,
                    size as usize,
                    libc::PROT_NONE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd,
                    offset as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(OUT_OF_MEMORY);
            }
            r.maps.insert(off, Mapping { size, phys: handle, prot: 0 });
            if let Some(p) = reg.phys.get_mut(&handle) {
                p.mappings += 1;
            }
            Ok(())
        })
    }

    fn cuMemUnmap(ptr, size) {
        run(|| {
            let node = driver()?.node;
            let mut reg = handles::write();
            let r = reg.vas.range_mut(..=ptr).next_back().map(|(_, r)| r).ok_or(INVALID_VALUE)?;
            let tiles = r.tiling(ptr, size as u64).ok_or(INVALID_VALUE)?;
            // The range must start and end at mapping boundaries.
            if tiles.first().is_none_or(|t| r.base + t.0 != ptr) {
                return Err(INVALID_VALUE);
            }
            let base = r.base;
            let last = tiles.last().expect("non-empty");
            if base + last.0 + last.1.size != ptr + size as u64 {
                return Err(INVALID_VALUE);
            }
            for (off, _) in &tiles {
                r.maps.remove(off);
            }
            remap_none(ptr, size as u64);
            for (_, m) in tiles {
                unref(node, &mut reg, m.phys, true);
            }
            Ok(())
        })
    }

    fn cuMemSetAccess(ptr, size, desc, count) {
        run(|| {
            let drv = driver()?;
            if count == 0 {
                return Err(INVALID_VALUE);
            }
            let mut prot = 0;
            for i in 0..count {
                // SAFETY: desc holds `count` descriptors by the caller's contract; AccessDesc has their
                // layout with the enums read as raw integers.
                let a = unsafe { get(desc.cast::<AccessDesc>().add(i)) }?;
                if a.location_type != LOCATION_TYPE_DEVICE || !matches!(a.flags, 0 | 1 | 3) {
                    return Err(INVALID_VALUE);
                }
                drv.device(a.location_id).map_err(|_| INVALID_VALUE)?;
                prot |= a.flags;
            }
            let mut reg = handles::write();
            let r = reg.vas.range_mut(..=ptr).next_back().map(|(_, r)| r).ok_or(INVALID_VALUE)?;
            let tiles = r.tiling(ptr, size as u64).ok_or(INVALID_VALUE)?;
            let host_prot = match prot {
                0 => libc::PROT_NONE,
                1 => libc::PROT_READ,
                _ => libc::PROT_READ | libc::PROT_WRITE,
            };
            for (off, m) in &tiles {
                // SAFETY: the mapping lies inside our reservation; only its protection changes.
                unsafe { libc::mprotect((r.base + off) as *mut c_void, m.size as usize, host_prot) };
                if let Some(e) = r.maps.get_mut(off) {
                    e.prot = prot;
                }
            }
            Ok(())
        })
    }

    fn cuMemGetAccess(flags, location, ptr) {
        run(|| {
            need(flags)?;
            let drv = driver()?;
            // SAFETY: location is the caller's struct, read as its raw (type, id) pair.
            let loc = unsafe { get(location.cast::<[i32; 2]>()) }?;
            if loc[0] as u32 != LOCATION_TYPE_DEVICE {
                return Err(INVALID_VALUE);
            }
            drv.device(loc[1]).map_err(|_| INVALID_VALUE)?;
            let reg = handles::read();
            let (_, m) = reg.reservation_at(ptr).and_then(|r| r.mapping_at(ptr)).ok_or(INVALID_VALUE)?;
            // SAFETY: flags is the caller's out-pointer (checked above).
            unsafe { put(flags, u64::from(m.prot)) }
        })
    }

    fn cuMemRetainAllocationHandle(handle, addr) {
        run(|| {
            need(handle)?;
            driver()?;
            let mut reg = handles::write();
            let h = reg
                .reservation_at(addr as u64)
                .and_then(|r| r.mapping_at(addr as u64))
                .map(|(_, m)| m.phys)
                .ok_or(INVALID_VALUE)?;
            if let Some(p) = reg.phys.get_mut(&h) {
                p.refs += 1;
            }
            // SAFETY: handle is the caller's out-pointer (checked above).
            unsafe { put(handle, h) }
        })
    }

    fn cuMemGetAllocationPropertiesFromHandle(prop, handle) {
        run(|| {
            need(prop)?;
            driver()?;
            let reg = handles::read();
            let p = reg.phys.get(&handle).ok_or(INVALID_VALUE)?;
            let out = AllocProp {
                type_: ALLOCATION_TYPE_PINNED,
                handle_types: p.handle_types,
                location_type: LOCATION_TYPE_DEVICE,
                location_id: p.dev.ordinal,
                win32_handle_meta_data: std::ptr::null_mut(),
                alloc_flags: [0; 8],
            };
            // SAFETY: prop is the caller's out-pointer (checked above), of AllocProp's layout.
            unsafe { put(prop.cast::<AllocProp>(), out) }
        })
    }

    fn cuMemExportToShareableHandle(shareableHandle, handle, handleType, flags) {
        run(|| {
            need(shareableHandle.cast::<c_int>())?;
            driver()?;
            let kind = handleType as u32;
            if flags != 0 || !kind.is_power_of_two() {
                return Err(INVALID_VALUE);
            }
            let reg = handles::read();
            let p = reg.phys.get(&handle).filter(|p| p.refs > 0).ok_or(INVALID_VALUE)?;
            // Only a kind the allocation was made exportable as (`requestedHandleTypes`).
            if p.handle_types & kind == 0 {
                return Err(INVALID_VALUE);
            }
            if kind != HANDLE_TYPE_POSIX_FD {
                // Windows handles and fabric handles (which need an NVSwitch fabric manager).
                return Err(NOT_SUPPORTED);
            }
            // SAFETY: p.fd is the allocation's memfd, open while it is registered.
            let fd = unsafe { libc::fcntl(p.fd, libc::F_DUPFD_CLOEXEC, 0) };
            if fd < 0 {
                return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
            }
            // SAFETY: the caller's out-pointer (checked above): an int for a file descriptor.
            unsafe { put(shareableHandle.cast::<c_int>(), fd) }
        })
    }
}

/// What a shareable handle names: the GPU, memory domain and size of an allocation of this
/// driver, read from its memfd.
fn shared_allocation(fd: c_int) -> R<(u32, usize, u64)> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(|_| INVALID_VALUE)?;
    let link = link.to_string_lossy();
    let rest = link.strip_prefix("/memfd:").and_then(|l| l.strip_prefix(MEMFD_PREFIX)).ok_or(INVALID_VALUE)?;
    let rest = rest.strip_suffix(" (deleted)").unwrap_or(rest);
    let (gpu, domain) = rest.split_once(':').ok_or(INVALID_VALUE)?;
    let (gpu, domain) = (gpu.parse().map_err(|_| INVALID_VALUE)?, domain.parse().map_err(|_| INVALID_VALUE)?);
    // SAFETY: fcntl on a descriptor the caller gave; it fails for one that is not open.
    if unsafe { libc::fcntl(fd, libc::F_GET_SEALS) } & SEALS != SEALS {
        return Err(INVALID_VALUE);
    }
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a stat into st on success.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Err(INVALID_VALUE);
    }
    // SAFETY: fstat succeeded, so st is initialized.
    let size = unsafe { st.assume_init() }.st_size as u64;
    if size == 0 || !size.is_multiple_of(GRANULARITY) {
        return Err(INVALID_VALUE);
    }
    Ok((gpu, domain, size))
}

cuda_exports! {
    fn cuMemImportFromShareableHandle(handle, osHandle, shHandleType) {
        run(|| {
            need(handle)?;
            let drv = driver()?;
            match shHandleType as u32 {
                HANDLE_TYPE_POSIX_FD => {}
                2 | 4 | 8 => return Err(NOT_SUPPORTED),
                _ => return Err(INVALID_VALUE),
            }
            // The file descriptor travels in the pointer's value.
            let fd = c_int::try_from(osHandle as usize).map_err(|_| INVALID_VALUE)?;
            let (gpu, domain, size) = shared_allocation(fd)?;
            let dev = drv.devices.iter().find(|d| d.gpu == gpu && d.domain == domain).ok_or(INVALID_DEVICE)?;
            poll_faults(drv.node)?;
            drv.node.check_gpu(gpu).map_err(|_| CUresult::CUDA_ERROR_DEVICE_UNAVAILABLE)?;
            // Our own reference: the caller keeps (and closes) the descriptor it passed.
            // SAFETY: fd was checked open above.
            let own = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
            if own < 0 {
                return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
            }
            // The importer holds the memory from now on (see the module's note), whoever else does.
            let epoch = match charge(drv.node, gpu, domain, size) {
                Ok(e) => e,
                Err(e) => {
                    // SAFETY: own is the duplicate just made, not handed out.
                    unsafe { libc::close(own) };
                    return Err(e);
                }
            };
            let h = NEXT_PHYS.fetch_add(1, Relaxed);
            let phys =
                Phys { fd: own, size, dev, charge: size, epoch, handle_types: HANDLE_TYPE_POSIX_FD, refs: 1, mappings: 0 };
            handles::write().phys.insert(h, phys);
            // SAFETY: handle is the caller's out-pointer (checked above).
            unsafe { put(handle, h) }
        })
    }
}
