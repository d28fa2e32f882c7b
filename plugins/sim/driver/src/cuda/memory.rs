//! Device and host memory: allocation families, their charge to the model, pointer queries, and
//! arrays.
//!
//! Every device allocation is charged to the model (`Node::alloc` on its device's memory domain)
//! before it succeeds and refunded when freed, so what the model counts is exactly what the
//! process holds; linear memory as the card holds it, in 2 MiB pages and shared chunks
//! (`suballoc`). The memory itself is an anonymous `MAP_NORESERVE` mapping: untouched pages
//! cost nothing, and copies really move bytes. Host allocations (pinned, registered) are host
//! memory and are not charged.
//!
//! A GPU reset frees, in the model, everything the process held on that GPU. Each charge records
//! the GPU's *epoch*, bumped when this process sees such a reset, and a refund is made only in
//! the epoch of its charge, so nothing is refunded twice.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::*};

use tessera_abi::cuda::MemLocation;
use tessera_abi::cuda::raw::{Array3dDesc, ArrayDesc};
use tessera_abi::cuda_exports;
use tessera_sim_model::{MAX_GPUS, MAX_MIG, Node};

use super::context::{self, Ctx};
use super::errors::Cu;
use super::handles::{self, Registry, array};
use super::init::{Device, driver};
use super::{CUresult, INVALID_VALUE, OUT_OF_MEMORY, R, get, need, put, put_opt, run, sys};
use crate::latency;

const DOMAINS: usize = 1 + MAX_MIG;

static EPOCH: [AtomicU64; MAX_GPUS] = [const { AtomicU64::new(0) }; MAX_GPUS];
static CHARGED: [[AtomicU64; DOMAINS]; MAX_GPUS] = [const { [const { AtomicU64::new(0) }; DOMAINS] }; MAX_GPUS];
static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// Charges `bytes` of a GPU's memory domain to this process; returns the epoch to refund in.
pub(crate) fn charge(node: &Node, gpu: u32, domain: usize, bytes: u64) -> R<u64> {
    if bytes > 0 {
        node.alloc(gpu, domain, bytes).work()?;
        CHARGED[gpu as usize][domain].fetch_add(bytes, Relaxed);
    }
    Ok(EPOCH[gpu as usize].load(Acquire))
}

/// Refunds a charge, unless a reset freed it already (the epoch moved on).
pub(crate) fn refund(node: &Node, gpu: u32, domain: usize, bytes: u64, epoch: u64) {
    if bytes > 0 && EPOCH[gpu as usize].load(Acquire) == epoch {
        node.free(gpu, domain, bytes);
        let _ = CHARGED[gpu as usize][domain].fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(bytes)));
    }
}

/// The GPU's current epoch.
pub(crate) fn current_epoch(gpu: u32) -> u64 {
    EPOCH[gpu as usize].load(Acquire)
}

/// What this process believes it holds on a GPU.
pub(crate) fn charged_on(gpu: u32) -> u64 {
    CHARGED[gpu as usize].iter().map(|c| c.load(Relaxed)).sum()
}

/// A reset freed everything this process held on the GPU: start a new epoch.
pub(crate) fn forget_gpu(gpu: u32) {
    EPOCH[gpu as usize].fetch_add(1, AcqRel);
    for c in &CHARGED[gpu as usize] {
        c.store(0, Relaxed);
    }
}

pub(crate) fn next_buffer_id() -> u64 {
    NEXT_BUFFER_ID.fetch_add(1, Relaxed)
}

/// What an allocation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemKind {
    /// `cuMemAlloc`, `cuMemAllocPitch`.
    Device,
    /// `cuMemAllocManaged`.
    Managed,
    /// A stream-ordered allocation from the pool with this handle.
    Pool(usize),
    /// Page-locked host memory from `cuMemAllocHost` / `cuMemHostAlloc` (with its flags).
    Host(u32),
    /// Caller memory registered with `cuMemHostRegister` (with its flags): not ours to unmap.
    Registered(u32),
    /// A module global.
    Global,
    /// The storage of a CUDA array.
    Array,
    /// Another process's allocation, opened with `cuIpcOpenMemHandle` (charged to the exporter).
    Imported,
    /// A graph allocation, made when its graph ran an allocation node.
    Graph,
}

/// One allocation the process holds.
#[derive(Debug, Clone)]
pub(crate) struct Alloc {
    pub base: u64,
    pub size: u64,
    /// Length of our mapping (0: the memory is the caller's).
    pub map_len: usize,
    pub kind: MemKind,
    /// Context handle it belongs to (0: none, e.g. a pool allocation).
    pub ctx: usize,
    pub dev: c_int,
    pub gpu: u32,
    pub domain: usize,
    /// Bytes charged to the model, and the epoch of the charge.
    pub charge: u64,
    pub epoch: u64,
    pub id: u64,
    pub sync_memops: bool,
    /// Carved from a 2 MiB chunk shared with other small allocations (`suballoc`): the chunk
    /// holds the charge and the mapping.
    pub in_chunk: bool,
}

impl Alloc {
    /// A new buffer (a fresh id) of `size` bytes at `base` on `dev`, in the context `ctx` (0:
    /// none), mapped by us over its whole size and charging nothing: callers override the rest.
    pub(crate) fn new(base: u64, size: u64, kind: MemKind, ctx: usize, dev: &Device) -> Alloc {
        Alloc {
            base,
            size,
            map_len: size as usize,
            kind,
            ctx,
            dev: dev.ordinal,
            gpu: dev.gpu,
            domain: dev.domain,
            charge: 0,
            epoch: 0,
            id: next_buffer_id(),
            sync_memops: false,
            in_chunk: false,
        }
    }

    /// Whether this is device memory (as opposed to host memory the device can reach).
    pub(crate) fn on_device(&self) -> bool {
        !matches!(self.kind, MemKind::Host(_) | MemKind::Registered(_))
    }
}

/// Maps `len` bytes of anonymous read-write memory; with `low`, below 4 GiB (for the legacy
/// 32-bit API).
pub(crate) fn map_anon(len: u64, low: bool) -> Option<u64> {
    let len = usize::try_from(len.max(1)).ok()?;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    if !low {
        // SAFETY: a fresh anonymous mapping touches no existing memory.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
        return (p != libc::MAP_FAILED).then_some(p as u64);
    }
    let mut hint = 0x1000_0000u64;
    while hint + len as u64 <= 1 << 32 {
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; it fails instead.
        let p = unsafe { libc::mmap(hint as *mut c_void, len, prot, flags | libc::MAP_FIXED_NOREPLACE, -1, 0) };
        if p != libc::MAP_FAILED {
            if p as u64 == hint {
                return Some(hint);
            }
            // An old kernel ignored the flag and placed it elsewhere.
            // SAFETY: p is the mapping just made, of len bytes.
            unsafe { libc::munmap(p, len) };
            return None;
        }
        hint += 0x1000_0000;
    }
    None
}

/// Unmaps a mapping made by [`map_anon`].
pub(crate) fn unmap(base: u64, len: usize) {
    if len > 0 {
        // SAFETY: (base, len) is a mapping this module made and nothing references it any more
        // (it was removed from the registry under the write lock).
        unsafe { libc::munmap(base as *mut c_void, len) };
    }
}

/// Frees an allocation removed from the registry: its mapping and its charge.
pub(crate) fn release(node: &Node, a: &Alloc) {
    release_keeping(node, a, 0);
}

/// As [`release`], but `kept` bytes of the charge stay charged (a pool's reserve holds them).
pub(crate) fn release_keeping(node: &Node, a: &Alloc, kept: u64) {
    super::ipc::forget(a.base);
    if a.in_chunk {
        return super::suballoc::release(node, a);
    }
    unmap(a.base, a.map_len);
    refund(node, a.gpu, a.domain, a.charge.saturating_sub(kept), a.epoch);
}

/// Allocates `bytes` of device memory in a context's domain and registers it.
pub(crate) fn alloc_in(node: &Node, ctx: &Ctx, bytes: u64, kind: MemKind, low: bool) -> R<u64> {
    alloc_charging(node, ctx, bytes, |_| Ok(bytes), kind, low)
}

/// As [`alloc_in`], charging what `charge_of` says, given the domain's free memory.
pub(crate) fn alloc_charging(
    node: &Node,
    ctx: &Ctx,
    bytes: u64,
    charge_of: impl FnOnce(u64) -> R<u64>,
    kind: MemKind,
    low: bool,
) -> R<u64> {
    if bytes == 0 {
        return Err(INVALID_VALUE);
    }
    ctx.check(node)?;
    let d = ctx.dev;
    let charged = charge_of(node.memory_info(d.gpu, d.domain).work()?.free)?;
    let epoch = charge(node, d.gpu, d.domain, charged)?;
    let Some(base) = map_anon(bytes, low) else {
        refund(node, d.gpu, d.domain, charged, epoch);
        return Err(OUT_OF_MEMORY);
    };
    let a = Alloc { charge: charged, epoch, ..Alloc::new(base, bytes, kind, ctx.handle, d) };
    handles::write().mem.insert(base, a);
    Ok(base)
}

/// The current context, for a call that works in it.
pub(crate) fn ctx_for_work() -> R<(&'static Node, Arc<Ctx>)> {
    let node = driver()?.node;
    super::errors::poll_faults(node)?;
    let ctx = context::current()?;
    ctx.check(node)?;
    Ok((node, ctx))
}

/// Frees a device allocation by its base (`cuMemFree`); a stream-ordered allocation may be
/// freed this way too. Freeing 0 does nothing, as `free(NULL)` (and the real driver).
fn free_device(dptr: u64) -> R {
    let node = driver()?.node;
    if dptr == 0 {
        return Ok(());
    }
    // A sticky process error does not stop freeing: the memory is returned either way.
    let _ = super::errors::poll_faults(node);
    let (a, pool) = {
        let mut reg = handles::write();
        match reg.mem.get(&dptr) {
            Some(a) if matches!(a.kind, MemKind::Device | MemKind::Managed | MemKind::Pool(_) | MemKind::Graph) => {}
            _ => return Err(INVALID_VALUE),
        }
        let a = reg.mem.remove(&dptr).expect("checked above");
        if a.kind == MemKind::Graph {
            super::graph_mem::on_released(&a);
        }
        let pool = match a.kind {
            MemKind::Pool(p) => reg.pools.get(&p).cloned(),
            _ => None,
        };
        (a, pool)
    };
    match pool {
        Some(p) => p.free(node, &a),
        None => release_keeping(node, &a, 0),
    }
    Ok(())
}

/// `cuMemGetInfo`: free and total memory of the current context's device (a MIG device's are
/// its GPU instance's), written through the caller's out-pointers as `size` makes them fit.
fn mem_info<T>(free: *mut T, total: *mut T, size: fn(u64) -> T) -> R {
    let _card = latency::floor("cuMemGetInfo_v2");
    need(free)?;
    need(total)?;
    let (node, ctx) = ctx_for_work()?;
    let mi = node.memory_info(ctx.dev.gpu, ctx.dev.domain).work()?;
    // SAFETY: free and total are the caller's out-pointers (checked above).
    unsafe {
        put(free, size(mi.free))?;
        put(total, size(ctx.dev.total_mem))
    }
}

cuda_exports! {
    fn cuMemGetInfo_v2(free, total) {
        run(|| mem_info(free, total, |b| b as usize))
    }

    /// Legacy `cuMemGetInfo` (32-bit sizes, saturated).
    fn cuMemGetInfo(free, total) {
        run(|| mem_info(free, total, |b| b.min(u32::MAX as u64) as c_uint))
    }

    fn cuMemAlloc_v2(dptr, bytesize) {
        run(|| {
            need(dptr)?;
            let (node, ctx) = ctx_for_work()?;
            let p = super::suballoc::alloc_linear(node, &ctx, bytesize as u64, false)?;
            // SAFETY: dptr is the caller's out-pointer (checked above).
            unsafe { put(dptr, p) }
        })
    }

    /// Legacy `cuMemAlloc`: a 32-bit device pointer, so the memory is mapped below 4 GiB.
    fn cuMemAlloc(dptr, bytesize) {
        run(|| {
            need(dptr)?;
            let (node, ctx) = ctx_for_work()?;
            let p = super::suballoc::alloc_linear(node, &ctx, bytesize as u64, true)?;
            // SAFETY: dptr is the caller's out-pointer (checked above).
            unsafe { put(dptr, p as c_uint) }
        })
    }
}

/// The pitch `cuMemAllocPitch` picks: rows aligned to 512 bytes (the texture alignment).
fn pitch_for(width: u64, elem: u32) -> R<u64> {
    if !matches!(elem, 4 | 8 | 16) || width == 0 {
        return Err(INVALID_VALUE);
    }
    Ok(width.div_ceil(512) * 512)
}

cuda_exports! {
    fn cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) {
        run(|| {
            need(dptr)?;
            need(pPitch)?;
            let pitch = pitch_for(WidthInBytes as u64, ElementSizeBytes)?;
            let bytes = pitch.checked_mul(Height as u64).ok_or(INVALID_VALUE)?;
            let (node, ctx) = ctx_for_work()?;
            let p = super::suballoc::alloc_linear(node, &ctx, bytes, false)?;
            // SAFETY: dptr and pPitch are the caller's out-pointers (checked above).
            unsafe {
                put(dptr, p)?;
                put(pPitch, pitch as usize)
            }
        })
    }

    fn cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) {
        run(|| {
            need(dptr)?;
            need(pPitch)?;
            let pitch = pitch_for(WidthInBytes as u64, ElementSizeBytes)?;
            let bytes = pitch * Height as u64;
            let (node, ctx) = ctx_for_work()?;
            let p = super::suballoc::alloc_linear(node, &ctx, bytes, true)?;
            // SAFETY: dptr and pPitch are the caller's out-pointers (checked above).
            unsafe {
                put(dptr, p as c_uint)?;
                put(pPitch, pitch as c_uint)
            }
        })
    }
}

/// `CU_MEM_ATTACH_GLOBAL` / `CU_MEM_ATTACH_HOST`.
const MEM_ATTACH_GLOBAL: c_uint = 0x1;
const MEM_ATTACH_HOST: c_uint = 0x2;

cuda_exports! {
    /// `cuMemAllocManaged`: as on a real driver, managed memory may exceed the device's (it pages
    /// between host and device). The sim charges the device what is free at allocation (the pages a
    /// program that touches its memory on the GPU keeps resident) and keeps the rest on the host; it
    /// does not evict managed pages for later allocations.
    fn cuMemAllocManaged(dptr, bytesize, flags) {
        run(|| {
            need(dptr)?;
            if flags != MEM_ATTACH_GLOBAL && flags != MEM_ATTACH_HOST {
                return Err(INVALID_VALUE);
            }
            let (node, ctx) = ctx_for_work()?;
            let bytes = bytesize as u64;
            let p = alloc_charging(node, &ctx, bytes, |free| Ok(bytes.min(free)), MemKind::Managed, false)?;
            // SAFETY: dptr is the caller's out-pointer (checked above).
            unsafe { put(dptr, p) }
        })
    }

    fn cuMemFree_v2(dptr) {
        run(|| free_device(dptr))
    }

    fn cuMemFree(dptr) {
        run(|| free_device(dptr as u64))
    }
}

/// The allocation (device memory) containing an address.
fn range_of(dptr: u64) -> R<(u64, u64)> {
    driver()?;
    let reg = handles::read();
    if let Some(a) = reg.alloc_at(dptr).filter(|a| a.on_device()) {
        return Ok((a.base, a.size));
    }
    if let Some((base, size)) = super::vmm::mapping_at(&reg, dptr) {
        return Ok((base, size));
    }
    Err(super::NOT_FOUND)
}

cuda_exports! {
    fn cuMemGetAddressRange_v2(pbase, psize, dptr) {
        run(|| {
            let (b, s) = range_of(dptr)?;
            // SAFETY: pbase and psize are the caller's out-pointers; either may be null.
            unsafe {
                put_opt(pbase, b)?;
                put_opt(psize, s as usize)
            }
        })
    }

    fn cuMemGetAddressRange(pbase, psize, dptr) {
        run(|| {
            let (b, s) = range_of(dptr as u64)?;
            // SAFETY: pbase and psize are the caller's out-pointers; either may be null.
            unsafe {
                put_opt(pbase, b as c_uint)?;
                put_opt(psize, s as c_uint)
            }
        })
    }
}

// ---- Host memory -----------------------------------------------------------------------------

const HOSTALLOC_FLAGS: c_uint = 0x1 | 0x2 | 0x4; // PORTABLE | DEVICEMAP | WRITECOMBINED
const HOSTREGISTER_FLAGS: c_uint = 0x1 | 0x2 | 0x4 | 0x8; // PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY

fn host_alloc(bytes: u64, flags: c_uint) -> R<u64> {
    if bytes == 0 || flags & !HOSTALLOC_FLAGS != 0 {
        return Err(INVALID_VALUE);
    }
    let (_, ctx) = ctx_for_work()?;
    let base = map_anon(bytes, false).ok_or(OUT_OF_MEMORY)?;
    let a = Alloc::new(base, bytes, MemKind::Host(flags), ctx.handle, ctx.dev);
    handles::write().mem.insert(base, a);
    Ok(base)
}

cuda_exports! {
    fn cuMemAllocHost_v2(pp, bytesize) also cuMemAllocHost {
        run(|| {
            need(pp)?;
            let p = host_alloc(bytesize as u64, 0)?;
            // SAFETY: pp is the caller's out-pointer (checked above).
            unsafe { put(pp, p as *mut c_void) }
        })
    }

    fn cuMemHostAlloc(pp, bytesize, Flags) {
        run(|| {
            need(pp)?;
            let p = host_alloc(bytesize as u64, Flags)?;
            // SAFETY: pp is the caller's out-pointer (checked above).
            unsafe { put(pp, p as *mut c_void) }
        })
    }

    fn cuMemFreeHost(p) {
        run(|| {
            let node = driver()?.node;
            if p.is_null() {
                return Ok(()); // `free(NULL)` semantics, as the real driver
            }
            let a = {
                let mut reg = handles::write();
                match reg.mem.get(&(p as u64)) {
                    Some(a) if matches!(a.kind, MemKind::Host(_)) => reg.mem.remove(&(p as u64)).expect("checked above"),
                    _ => return Err(INVALID_VALUE),
                }
            };
            release(node, &a);
            Ok(())
        })
    }
}

/// The host allocation or registration containing `p`.
fn host_range(reg: &Registry, p: u64) -> Option<&Alloc> {
    reg.alloc_at(p).filter(|a| !a.on_device() || a.kind == MemKind::Managed)
}

fn host_device_pointer(p: u64, flags: c_uint) -> R<u64> {
    if flags != 0 {
        return Err(INVALID_VALUE);
    }
    ctx_for_work()?;
    let reg = handles::read();
    // Unified addressing: the device sees host memory at the host's address.
    host_range(&reg, p).map(|_| p).ok_or(INVALID_VALUE)
}

cuda_exports! {
    fn cuMemHostGetDevicePointer_v2(pdptr, p, Flags) {
        run(|| {
            need(pdptr)?;
            let d = host_device_pointer(p as u64, Flags)?;
            // SAFETY: pdptr is the caller's out-pointer (checked above).
            unsafe { put(pdptr, d) }
        })
    }

    fn cuMemHostGetDevicePointer(pdptr, p, Flags) {
        run(|| {
            need(pdptr)?;
            let d = host_device_pointer(p as u64, Flags)?;
            let d = c_uint::try_from(d).map_err(|_| INVALID_VALUE)?;
            // SAFETY: pdptr is the caller's out-pointer (checked above).
            unsafe { put(pdptr, d) }
        })
    }

    fn cuMemHostGetFlags(pFlags, p) {
        run(|| {
            need(pFlags)?;
            ctx_for_work()?;
            let flags = match handles::read().alloc_at(p as u64).map(|a| a.kind) {
                Some(MemKind::Host(f) | MemKind::Registered(f)) => f,
                _ => return Err(INVALID_VALUE),
            };
            // SAFETY: pFlags is the caller's out-pointer (checked above).
            unsafe { put(pFlags, flags) }
        })
    }
}

fn host_register(p: u64, bytes: u64, flags: c_uint) -> R {
    if p == 0 || bytes == 0 || flags & !HOSTREGISTER_FLAGS != 0 {
        return Err(INVALID_VALUE);
    }
    let (_, ctx) = ctx_for_work()?;
    let mut reg = handles::write();
    let end = p.checked_add(bytes).ok_or(INVALID_VALUE)?;
    let overlaps = reg.mem.range(..end).next_back().is_some_and(|(_, a)| a.base + a.size > p);
    if overlaps {
        return Err(CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    }
    // The memory is the caller's: nothing of ours to unmap.
    reg.mem.insert(p, Alloc { map_len: 0, ..Alloc::new(p, bytes, MemKind::Registered(flags), ctx.handle, ctx.dev) });
    Ok(())
}

cuda_exports! {
    fn cuMemHostRegister_v2(p, bytesize, Flags) also cuMemHostRegister {
        run(|| host_register(p as u64, bytesize as u64, Flags))
    }

    fn cuMemHostUnregister(p) {
        run(|| {
            driver()?;
            let mut reg = handles::write();
            match reg.mem.get(&(p as u64)) {
                Some(a) if matches!(a.kind, MemKind::Registered(_)) => {
                    reg.mem.remove(&(p as u64));
                    Ok(())
                }
                _ => Err(CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
            }
        })
    }
}

// ---- Pointer attributes -----------------------------------------------------------------------

/// What the driver knows about an address.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PtrInfo {
    pub base: u64,
    pub size: u64,
    /// `CUmemorytype`: host (1) or device (2).
    pub memory_type: u32,
    pub host: bool,
    pub managed: bool,
    pub ctx: usize,
    pub dev: c_int,
    pub id: u64,
    pub pool: usize,
    pub legacy_ipc: bool,
    pub sync_memops: bool,
    /// `CUmemAccess_flags` of the current device.
    pub access: u32,
    pub handle_types: u64,
}

pub(crate) fn ptr_info(reg: &Registry, p: u64) -> Option<PtrInfo> {
    if let Some(a) = reg.alloc_at(p) {
        let host = !a.on_device() || a.kind == MemKind::Managed;
        return Some(PtrInfo {
            base: a.base,
            size: a.size,
            memory_type: if a.on_device() { 2 } else { 1 },
            host,
            managed: a.kind == MemKind::Managed,
            ctx: if matches!(a.kind, MemKind::Pool(_)) { 0 } else { a.ctx },
            dev: a.dev,
            id: a.id,
            pool: if let MemKind::Pool(h) = a.kind { h } else { 0 },
            legacy_ipc: a.kind == MemKind::Device,
            sync_memops: a.sync_memops,
            access: 3,
            handle_types: 0,
        });
    }
    super::vmm::ptr_info(reg, p)
}

const ATTR_CONTEXT: c_int = 1;
const ATTR_MEMORY_TYPE: c_int = 2;
const ATTR_DEVICE_POINTER: c_int = 3;
const ATTR_HOST_POINTER: c_int = 4;
const ATTR_P2P_TOKENS: c_int = 5;
const ATTR_SYNC_MEMOPS: c_int = 6;
const ATTR_BUFFER_ID: c_int = 7;
const ATTR_IS_MANAGED: c_int = 8;
const ATTR_DEVICE_ORDINAL: c_int = 9;
const ATTR_IS_LEGACY_CUDA_IPC_CAPABLE: c_int = 10;
const ATTR_RANGE_START_ADDR: c_int = 11;
const ATTR_RANGE_SIZE: c_int = 12;
const ATTR_MAPPED: c_int = 13;
const ATTR_ALLOWED_HANDLE_TYPES: c_int = 14;
const ATTR_IS_GPU_DIRECT_RDMA_CAPABLE: c_int = 15;
const ATTR_ACCESS_FLAGS: c_int = 16;
const ATTR_MEMPOOL_HANDLE: c_int = 17;
const ATTR_MAPPING_SIZE: c_int = 18;
const ATTR_MAPPING_BASE_ADDR: c_int = 19;
const ATTR_MEMORY_BLOCK_ID: c_int = 20;

/// Writes one attribute's value (its C type decides the width); `None` info writes the
/// attribute's null value (as `cuPointerGetAttributes` does for unknown pointers).
///
/// # Safety
/// `data` must be valid for a write of the attribute's C type.
unsafe fn write_attr(data: *mut c_void, attribute: c_int, p: u64, info: Option<&PtrInfo>) -> R {
    fn w<T>(data: *mut c_void, v: T) -> R {
        // SAFETY: the caller of write_attr guarantees room for the attribute's type, which is T.
        unsafe { put(data.cast::<T>(), v) }
    }
    let on_device = info.is_some_and(|i| !i.host || i.managed);
    match attribute {
        ATTR_CONTEXT => w(data, handles::as_ptr::<c_void>(info.map_or(0, |i| i.ctx))),
        ATTR_MEMORY_TYPE => w(data, info.map_or(0u32, |i| i.memory_type)),
        ATTR_DEVICE_POINTER => w(data, info.map_or(0u64, |_| p)),
        ATTR_HOST_POINTER => {
            if info.is_some_and(|i| !i.host) {
                return Err(INVALID_VALUE);
            }
            w(data, info.map_or(0, |_| p) as *mut c_void)
        }
        ATTR_SYNC_MEMOPS => w(data, info.is_some_and(|i| i.sync_memops)),
        ATTR_BUFFER_ID => w(data, info.map_or(0u64, |i| i.id)),
        ATTR_IS_MANAGED => w(data, info.is_some_and(|i| i.managed)),
        ATTR_DEVICE_ORDINAL => w(data, info.map_or(-2 as c_int, |i| i.dev)),
        ATTR_IS_LEGACY_CUDA_IPC_CAPABLE => w(data, info.is_some_and(|i| i.legacy_ipc)),
        ATTR_RANGE_START_ADDR => w(data, info.map_or(0, |i| i.base) as *mut c_void),
        ATTR_RANGE_SIZE => w(data, info.map_or(0, |i| i.size) as usize),
        ATTR_MAPPED => w(data, info.is_some()),
        ATTR_ALLOWED_HANDLE_TYPES => w(data, info.map_or(0u64, |i| i.handle_types)),
        ATTR_IS_GPU_DIRECT_RDMA_CAPABLE => w(data, on_device && !info.is_some_and(|i| i.managed)),
        ATTR_ACCESS_FLAGS => w(data, info.map_or(0u32, |i| i.access)),
        ATTR_MEMPOOL_HANDLE => w(data, handles::as_ptr::<c_void>(info.map_or(0, |i| i.pool))),
        ATTR_MAPPING_SIZE => w(data, info.map_or(0, |i| i.size) as usize),
        ATTR_MAPPING_BASE_ADDR => w(data, info.map_or(0, |i| i.base) as *mut c_void),
        ATTR_MEMORY_BLOCK_ID => w(data, info.map_or(0u64, |i| i.id)),
        ATTR_P2P_TOKENS => Err(super::NOT_SUPPORTED),
        _ => Err(INVALID_VALUE),
    }
}

cuda_exports! {
    fn cuPointerGetAttribute(data, attribute, ptr) {
        run(|| {
            if data.is_null() {
                return Err(INVALID_VALUE);
            }
            driver()?;
            let reg = handles::read();
            let info = ptr_info(&reg, ptr).ok_or(INVALID_VALUE)?;
            // SAFETY: data has room for the attribute's type by the caller's contract.
            unsafe { write_attr(data, attribute, ptr, Some(&info)) }
        })
    }

    fn cuPointerGetAttributes(numAttributes, attributes, data, ptr) {
        run(|| {
            if numAttributes == 0 || attributes.is_null() || data.is_null() {
                return Err(INVALID_VALUE);
            }
            driver()?;
            let reg = handles::read();
            let info = ptr_info(&reg, ptr);
            for i in 0..numAttributes as usize {
                // SAFETY: attributes and data hold numAttributes entries by the caller's contract.
                let (attr, slot) = unsafe { (get(attributes.add(i))?, get(data.add(i))?) };
                if slot.is_null() {
                    continue;
                }
                // SAFETY: each data entry has room for its attribute's type by the caller's contract.
                match unsafe { write_attr(slot, attr, ptr, info.as_ref()) } {
                    // Unlike the single query, no error for what a pointer does not have.
                    Ok(()) | Err(CUresult::CUDA_ERROR_INVALID_VALUE) if attr > 0 && attr <= ATTR_MEMORY_BLOCK_ID => {}
                    Ok(()) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
    }

    fn cuPointerSetAttribute(value, attribute, ptr) {
        run(|| {
            if attribute != ATTR_SYNC_MEMOPS {
                return Err(INVALID_VALUE);
            }
            // SAFETY: for SYNC_MEMOPS, value points to an unsigned int by the API contract.
            let v = unsafe { get(value.cast::<c_uint>()) }?;
            driver()?;
            let mut reg = handles::write();
            let base = reg.alloc_at(ptr).filter(|a| a.on_device()).map(|a| a.base).ok_or(INVALID_VALUE)?;
            if let Some(a) = reg.mem.get_mut(&base) {
                a.sync_memops = v != 0;
            }
            Ok(())
        })
    }
}

/// Validates a managed-memory hint's range; the simulated GPU keeps no page placement.
fn managed_range(dev_ptr: u64, count: usize) -> R {
    let reg = handles::read();
    match reg.alloc_at(dev_ptr) {
        Some(a) if a.kind == MemKind::Managed && dev_ptr + count as u64 <= a.base + a.size => Ok(()),
        _ => Err(INVALID_VALUE),
    }
}

fn prefetch(dev_ptr: u64, count: usize, dst: c_int, stream: sys::CUstream, pt: bool) -> R {
    let d = driver()?;
    if dst != -1 {
        d.device(dst)?;
    }
    managed_range(dev_ptr, count)?;
    super::stream::resolve_and_check(stream, pt).map(|_| ())
}

cuda_exports! {
    fn cuMemPrefetchAsync(devPtr, count, dstDevice, hStream) twin cuMemPrefetchAsync_ptsz(per_thread) {
        run(|| prefetch(devPtr, count, dstDevice, hStream, per_thread))
    }

    fn cuMemAdvise(devPtr, count, advice, device) {
        run(|| {
            let d = driver()?;
            if !(1..=6).contains(&advice) {
                return Err(INVALID_VALUE);
            }
            if device != -1 {
                d.device(device)?;
            }
            managed_range(devPtr, count)
        })
    }
}

/// A location a managed-memory hint may name: a device, or the host (types 2-4).
fn check_location(loc: MemLocation) -> R {
    match loc.type_ {
        1 => driver()?.device(loc.id).map(|_| ()).map_err(|_| INVALID_VALUE),
        2..=4 => Ok(()),
        _ => Err(INVALID_VALUE),
    }
}

fn prefetch_v2(dev_ptr: u64, count: usize, loc: MemLocation, flags: c_uint, stream: sys::CUstream, pt: bool) -> R {
    driver()?;
    if flags != 0 {
        return Err(INVALID_VALUE);
    }
    check_location(loc)?;
    managed_range(dev_ptr, count)?;
    super::stream::resolve_and_check(stream, pt).map(|_| ())
}

cuda_exports! {
    fn cuMemPrefetchAsync_v2(devPtr, count, location, flags, hStream) twin cuMemPrefetchAsync_v2_ptsz(per_thread) {
        run(|| prefetch_v2(devPtr, count, location, flags, hStream, per_thread))
    }

    fn cuMemAdvise_v2(devPtr, count, advice, location) {
        run(|| {
            driver()?;
            if !(1..=6).contains(&advice) {
                return Err(INVALID_VALUE);
            }
            check_location(location)?;
            managed_range(devPtr, count)
        })
    }
}

// ---- Arrays ----------------------------------------------------------------------------------

/// A CUDA array: its shape and its storage (registered as an allocation of kind `Array`).
pub(crate) struct Array {
    pub ctx: usize,
    pub width: u64,
    pub height: u64,
    pub depth: u64,
    pub format: u32,
    pub channels: u32,
    pub flags: u32,
    /// Bytes per element, channels included.
    pub elem: u64,
    pub base: u64,
    pub bytes: u64,
    /// The mipmapped array it is a level of (0: an array of its own, whose storage it owns).
    pub mipmap: usize,
}

impl Array {
    /// Bytes in one row.
    pub(crate) fn row_bytes(&self) -> u64 {
        self.width * self.elem
    }
}

/// Bytes per channel of a `CUarray_format`: the plain integer and float formats. The video,
/// block-compressed and normalized formats are not modeled (`NOT_SUPPORTED`); other values are
/// not formats at all (`INVALID_VALUE`).
pub(crate) fn format_bytes(format: u32) -> R<u64> {
    Ok(match format {
        0x01 | 0x08 => 1,        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        0x50 | 0x91..=0x9f | 0xa1..=0xa9 | 0xb0..=0xb5 | 0xc0..=0xcb => return Err(super::NOT_SUPPORTED),
        _ => return Err(INVALID_VALUE),
    })
}

fn array_create(width: u64, height: u64, depth: u64, format: u32, channels: u32, flags: u32) -> R<usize> {
    let fb = format_bytes(format)?;
    if width == 0 || !matches!(channels, 1 | 2 | 4) || (height == 0 && depth > 0) {
        return Err(INVALID_VALUE);
    }
    let elem = fb * channels as u64;
    let bytes = width
        .checked_mul(height.max(1))
        .and_then(|b| b.checked_mul(depth.max(1)))
        .and_then(|b| b.checked_mul(elem))
        .ok_or(INVALID_VALUE)?;
    let (node, ctx) = ctx_for_work()?;
    let base = alloc_in(node, &ctx, bytes, MemKind::Array, false)?;
    let handle = handles::new_handle();
    let arr = Array { ctx: ctx.handle, width, height, depth, format, channels, flags, elem, base, bytes, mipmap: 0 };
    handles::write().arrays.insert(handle, Arc::new(arr));
    Ok(handle)
}

cuda_exports! {
    fn cuArrayCreate_v2(pHandle, pAllocateArray) {
        run(|| {
            need(pHandle)?;
            need(pAllocateArray)?;
            // SAFETY: checked non-null and aligned; the descriptor is the caller's; ArrayDesc has its
            // layout with the enum read as a raw integer.
            let d = unsafe { pAllocateArray.cast::<ArrayDesc>().read() };
            let h = array_create(d.width as u64, d.height as u64, 0, d.format, d.channels, 0)?;
            // SAFETY: pHandle is the caller's out-pointer (checked above).
            unsafe { put(pHandle, handles::as_ptr(h)) }
        })
    }

    fn cuArrayCreate(pHandle, pAllocateArray) {
        run(|| {
            need(pHandle)?;
            // SAFETY: the descriptor is the caller's (null/misaligned checked by get).
            let d = unsafe { get(pAllocateArray.cast::<[u32; 4]>()) }?;
            let h = array_create(d[0] as u64, d[1] as u64, 0, d[2], d[3], 0)?;
            // SAFETY: pHandle is the caller's out-pointer (checked above).
            unsafe { put(pHandle, handles::as_ptr(h)) }
        })
    }

    fn cuArray3DCreate_v2(pHandle, pAllocateArray) {
        run(|| {
            need(pHandle)?;
            need(pAllocateArray)?;
            // SAFETY: checked non-null and aligned; Array3dDesc has the descriptor's layout with the
            // enum read as a raw integer.
            let d = unsafe { pAllocateArray.cast::<Array3dDesc>().read() };
            let h = array_create(d.width as u64, d.height as u64, d.depth as u64, d.format, d.channels, d.flags)?;
            // SAFETY: pHandle is the caller's out-pointer (checked above).
            unsafe { put(pHandle, handles::as_ptr(h)) }
        })
    }

    fn cuArray3DCreate(pHandle, pAllocateArray) {
        run(|| {
            need(pHandle)?;
            // SAFETY: the descriptor is the caller's (null/misaligned checked by get).
            let d = unsafe { get(pAllocateArray.cast::<[u32; 6]>()) }?;
            let h = array_create(d[0] as u64, d[1] as u64, d[2] as u64, d[3], d[4], d[5])?;
            // SAFETY: pHandle is the caller's out-pointer (checked above).
            unsafe { put(pHandle, handles::as_ptr(h)) }
        })
    }
}

/// An array's descriptor, as `describe` makes it, through the caller's out-pointer (checked
/// before the array is looked up).
fn put_descriptor<T>(out: *mut T, h: sys::CUarray, describe: impl FnOnce(&Array) -> T) -> R {
    need(out)?;
    let a = array(h)?;
    // SAFETY: out is the caller's out-pointer (checked above).
    unsafe { put(out, describe(&a)) }
}

/// The `CUarray_format` enum value for a raw format read from the caller (always one of ours).
fn format_enum(f: u32) -> sys::CUarray_format {
    use sys::CUarray_format::*;
    match f {
        0x01 => CU_AD_FORMAT_UNSIGNED_INT8,
        0x02 => CU_AD_FORMAT_UNSIGNED_INT16,
        0x03 => CU_AD_FORMAT_UNSIGNED_INT32,
        0x08 => CU_AD_FORMAT_SIGNED_INT8,
        0x09 => CU_AD_FORMAT_SIGNED_INT16,
        0x0a => CU_AD_FORMAT_SIGNED_INT32,
        0x10 => CU_AD_FORMAT_HALF,
        _ => CU_AD_FORMAT_FLOAT,
    }
}

cuda_exports! {
    fn cuArrayGetDescriptor_v2(pArrayDescriptor, hArray) {
        run(|| {
            put_descriptor(pArrayDescriptor, hArray, |a| sys::CUDA_ARRAY_DESCRIPTOR {
                Width: a.width as usize,
                Height: a.height as usize,
                Format: format_enum(a.format),
                NumChannels: a.channels,
            })
        })
    }

    fn cuArrayGetDescriptor(pArrayDescriptor, hArray) {
        run(|| {
            let a = array(hArray)?;
            let d = [a.width as u32, a.height as u32, a.format, a.channels];
            // SAFETY: pArrayDescriptor is the caller's out-pointer, of the v1 layout (four 32-bit fields).
            unsafe { put(pArrayDescriptor.cast::<[u32; 4]>(), d) }
        })
    }

    fn cuArray3DGetDescriptor_v2(pArrayDescriptor, hArray) {
        run(|| {
            put_descriptor(pArrayDescriptor, hArray, |a| sys::CUDA_ARRAY3D_DESCRIPTOR {
                Width: a.width as usize,
                Height: a.height as usize,
                Depth: a.depth as usize,
                Format: format_enum(a.format),
                NumChannels: a.channels,
                Flags: a.flags,
            })
        })
    }

    fn cuArray3DGetDescriptor(pArrayDescriptor, hArray) {
        run(|| {
            let a = array(hArray)?;
            let d = [a.width as u32, a.height as u32, a.depth as u32, a.format, a.channels, a.flags];
            // SAFETY: pArrayDescriptor is the caller's out-pointer, of the v1 layout (six 32-bit fields).
            unsafe { put(pArrayDescriptor.cast::<[u32; 6]>(), d) }
        })
    }

    fn cuArrayDestroy(hArray) {
        run(|| {
            let node = driver()?.node;
            let (arr, alloc) = {
                let mut reg = handles::write();
                match reg.arrays.get(&(hArray as usize)) {
                    None => return Err(super::INVALID_HANDLE),
                    // A level goes with its mipmapped array (cuMipmappedArrayDestroy).
                    Some(a) if a.mipmap != 0 => return Err(INVALID_VALUE),
                    Some(_) => {}
                }
                let arr = reg.arrays.remove(&(hArray as usize)).expect("checked above");
                let alloc = reg.mem.remove(&arr.base);
                (arr, alloc)
            };
            if let Some(a) = alloc {
                release(node, &a);
            }
            drop(arr);
            Ok(())
        })
    }
}
