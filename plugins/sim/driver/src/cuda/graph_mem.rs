//! Graph memory nodes (`cuGraphAddMemAllocNode`, `cuGraphAddMemFreeNode`, and allocations captured
//! from `cuMemAllocAsync`) and the device's graph memory pool, as the real driver keeps them:
//!
//! - adding an allocation node reserves its address (the node's `dptr` is known before launch);
//!   the memory is taken, on the node's device (`poolProps.location.id`), when a launch reaches
//!   the node; a free node, `cuMemFree` or `cuMemFreeAsync` ends the allocation;
//! - physical memory comes from the device's graph pool (one per device, per process, apart from
//!   the stream-ordered pools): an allocation takes what the pool has free, and only the shortfall
//!   is charged to the device; freed graph memory stays in the pool, charged (NVML and
//!   `cuMemGetInfo` count it as used), until `cuDeviceGraphMemTrim` returns it. Destroying a graph
//!   or its executable graph does not return it either;
//! - `cuDeviceGetGraphMemAttribute`: `USED_MEM_CURRENT` is the memory of live graph allocations,
//!   `RESERVED_MEM_CURRENT` what the pool holds (used + free), with their high watermarks;
//! - a graph whose allocation is still live cannot run again (`CUDA_ERROR_INVALID_VALUE`) unless it
//!   was instantiated with `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`, which frees it first;
//!   a graph with memory nodes has at most one executable graph at a time.
//!
//! Where the sim differs: a real driver maps physical memory at launch or `cuGraphUpload` and may
//! keep it mapped to an executable graph between launches; the sim takes it when a launch runs
//! the node and `cuGraphUpload` takes nothing. The reserved addresses stay reserved for the life
//! of the process.

use std::ffi::c_int;
use std::sync::{Mutex, MutexGuard};

use tessera_abi::cuda_exports;
use tessera_sim_model::Node;

use super::graph::Op;
use super::handles;
use super::init::{Device, driver};
use super::memory::{Alloc, MemKind, charge, current_epoch, map_anon, refund};
use super::{INVALID_DEVICE, INVALID_VALUE, OUT_OF_MEMORY, R, need, put, raw_u32, run, sys};

/// Devices with a graph pool (ordinals).
const DEVICES: usize = 64;

/// One device's graph memory pool in this process.
#[derive(Default)]
struct GraphPool {
    /// Physical memory the pool holds (charged to the device in `epoch`).
    reserved: u64,
    /// Of it, the memory of live graph allocations.
    used: u64,
    used_high: u64,
    reserved_high: u64,
    epoch: u64,
}

static POOLS: [Mutex<GraphPool>; DEVICES] =
    [const { Mutex::new(GraphPool { reserved: 0, used: 0, used_high: 0, reserved_high: 0, epoch: 0 }) }; DEVICES];

/// `CUgraphMem_attribute`.
const USED_MEM_CURRENT: c_int = 0;
const USED_MEM_HIGH: c_int = 1;
const RESERVED_MEM_CURRENT: c_int = 2;
const RESERVED_MEM_HIGH: c_int = 3;

/// A device's graph pool, with what a GPU reset freed forgotten.
fn pool(d: &Device) -> R<MutexGuard<'static, GraphPool>> {
    let i = usize::try_from(d.ordinal).ok().filter(|&i| i < DEVICES).ok_or(INVALID_DEVICE)?;
    let mut p = POOLS[i].lock().unwrap_or_else(|e| e.into_inner());
    let now = current_epoch(d.gpu);
    if p.epoch != now {
        // A reset freed the pool's memory in the model (and every allocation in it).
        *p = GraphPool { epoch: now, ..GraphPool::default() };
    }
    Ok(p)
}

/// The graph pool of a device a caller names.
fn device_pool(device: sys::CUdevice) -> R<MutexGuard<'static, GraphPool>> {
    pool(driver()?.device(device)?)
}

/// Runs an allocation node: takes `bytes` on device `dev` from its graph pool (charging the
/// device what the pool lacks) at the node's reserved address.
pub(crate) fn allocate(node: &Node, dev: c_int, base: u64, bytes: u64) -> R {
    let d = driver()?.device(dev)?;
    let mut reg = handles::write();
    if reg.mem.contains_key(&base) {
        // The graph's previous allocation was never freed.
        return Err(INVALID_VALUE);
    }
    let mut p = pool(d)?;
    let shortfall = bytes.saturating_sub(p.reserved - p.used);
    charge(node, d.gpu, d.domain, shortfall)?;
    p.reserved += shortfall;
    p.used += bytes;
    p.used_high = p.used_high.max(p.used);
    p.reserved_high = p.reserved_high.max(p.reserved);
    let a = Alloc {
        // The address belongs to the graph node, and the charge to the pool: ending the
        // allocation returns neither.
        map_len: 0,
        charge: 0,
        ..Alloc::new(base, bytes, MemKind::Graph, 0, d)
    };
    reg.mem.insert(base, a);
    Ok(())
}

/// Ends a graph allocation (a free node, `cuMemFree`, `cuMemFreeAsync`, or an auto-free
/// relaunch): its memory goes back to its device's graph pool.
pub(crate) fn free(base: u64) -> R {
    let a = {
        let mut reg = handles::write();
        if !reg.mem.get(&base).is_some_and(|a| a.kind == MemKind::Graph) {
            return Err(INVALID_VALUE);
        }
        reg.mem.remove(&base).expect("checked above")
    };
    on_released(&a);
    super::ipc::forget(a.base);
    Ok(())
}

/// Bookkeeping when a graph allocation ends: the pool keeps its memory.
pub(crate) fn on_released(a: &Alloc) {
    if let Ok(d) = driver().and_then(|drv| drv.device(a.dev))
        && let Ok(mut p) = pool(d)
    {
        p.used = p.used.saturating_sub(a.size);
    }
}

/// Whether a graph allocation is live at `base`.
pub(crate) fn is_live(base: u64) -> bool {
    handles::read().mem.get(&base).is_some_and(|a| a.kind == MemKind::Graph)
}

/// The allocation node of a reserved address, if any graph has one.
pub(crate) fn alloc_node_of(dptr: u64) -> Option<u64> {
    let reg = handles::read();
    reg.gnodes.values().find_map(|n| match n.op {
        Op::MemAlloc { base, bytes, .. } if base == dptr => Some(bytes),
        _ => None,
    })
}

/// Reserves the address of a new graph allocation of `bytes` (the node is added by the caller).
pub(crate) fn reserve_address(bytes: u64) -> R<u64> {
    map_anon(bytes, false).ok_or(OUT_OF_MEMORY)
}

unsafe fn add_alloc_node(
    ph: *mut sys::CUgraphNode,
    g: sys::CUgraph,
    deps: *const sys::CUgraphNode,
    n: usize,
    params: *mut sys::CUDA_MEM_ALLOC_NODE_PARAMS,
) -> R {
    let drv = driver()?;
    need(params)?;
    // SAFETY: params is the caller's struct (checked non-null and aligned); only its plain fields
    // are read, the enum ones as raw integers.
    let (bytes, alloc_type, location_type, dev) = unsafe {
        (
            std::ptr::addr_of!((*params).bytesize).read(),
            raw_u32(std::ptr::addr_of!((*params).poolProps.allocType)),
            raw_u32(std::ptr::addr_of!((*params).poolProps.location.type_)),
            std::ptr::addr_of!((*params).poolProps.location.id).read(),
        )
    };
    // CU_MEM_ALLOCATION_TYPE_PINNED on CU_MEM_LOCATION_TYPE_DEVICE is what graphs allocate.
    if bytes == 0 || alloc_type != 1 || location_type != 1 {
        return Err(INVALID_VALUE);
    }
    drv.device(dev).map_err(|_| INVALID_VALUE)?;
    let base = reserve_address(bytes as u64)?;
    let op = Op::MemAlloc { base, bytes: bytes as u64, dev };
    // SAFETY: as this function's contract.
    unsafe { super::graph::add_node(ph, g, deps, n, op) }?;
    // SAFETY: params was checked above; dptr is a plain integer field.
    unsafe { std::ptr::addr_of_mut!((*params).dptr).write(base) };
    Ok(())
}

cuda_exports! {
    fn cuGraphAddMemAllocNode(phGraphNode, hGraph, dependencies, numDependencies, nodeParams) {
        // SAFETY: the caller's pointers, per the API contract.
        run(|| unsafe { add_alloc_node(phGraphNode, hGraph, dependencies, numDependencies, nodeParams) })
    }

    fn cuGraphAddMemFreeNode(phGraphNode, hGraph, dependencies, numDependencies, dptr) {
        run(|| {
            driver()?;
            alloc_node_of(dptr).ok_or(INVALID_VALUE)?;
            // SAFETY: the caller's pointers, per the API contract.
            unsafe {
                super::graph::add_node(phGraphNode, hGraph, dependencies, numDependencies, Op::MemFree { base: dptr })
            }
        })
    }

    fn cuGraphMemAllocNodeGetParams(hNode, params_out) {
        run(|| {
            driver()?;
            need(params_out)?;
            let op = handles::read().gnodes.get(&(hNode as usize)).map(|n| n.op.clone()).ok_or(INVALID_VALUE)?;
            let Op::MemAlloc { base, bytes, dev } = op else { return Err(INVALID_VALUE) };
            // SAFETY: params_out is the caller's struct (checked); an all-zero value is valid for it
            // (null pointers, zero integers and enums whose zero is a listed value), then the plain
            // and enum fields are written as the node was made.
            unsafe {
                std::ptr::write_bytes(params_out, 0, 1);
                std::ptr::addr_of_mut!((*params_out).bytesize).write(bytes as usize);
                std::ptr::addr_of_mut!((*params_out).dptr).write(base);
                std::ptr::addr_of_mut!((*params_out).poolProps.allocType).cast::<u32>().write(1);
                std::ptr::addr_of_mut!((*params_out).poolProps.location.type_).cast::<u32>().write(1);
                std::ptr::addr_of_mut!((*params_out).poolProps.location.id).write(dev);
            }
            Ok(())
        })
    }

    fn cuGraphMemFreeNodeGetParams(hNode, dptr_out) {
        run(|| {
            driver()?;
            let op = handles::read().gnodes.get(&(hNode as usize)).map(|n| n.op.clone()).ok_or(INVALID_VALUE)?;
            let Op::MemFree { base } = op else { return Err(INVALID_VALUE) };
            // SAFETY: dptr_out is the caller's out-pointer (checked by put).
            unsafe { put(dptr_out, base) }
        })
    }

    fn cuDeviceGetGraphMemAttribute(device, attr, value) {
        run(|| {
            let p = device_pool(device)?;
            let v = match attr {
                USED_MEM_CURRENT => p.used,
                USED_MEM_HIGH => p.used_high,
                RESERVED_MEM_CURRENT => p.reserved,
                RESERVED_MEM_HIGH => p.reserved_high,
                _ => return Err(INVALID_VALUE),
            };
            // SAFETY: value is the caller's cuuint64_t out-pointer (checked by put).
            unsafe { put(value.cast::<u64>(), v) }
        })
    }

    fn cuDeviceSetGraphMemAttribute(device, attr, value) {
        run(|| {
            let mut p = device_pool(device)?;
            // SAFETY: value is the caller's cuuint64_t (checked by get).
            let v = unsafe { super::get(value.cast::<u64>().cast_const()) }?;
            // Only the high watermarks can be set, and only to zero (which resets them to current).
            match attr {
                USED_MEM_HIGH if v == 0 => p.used_high = p.used,
                RESERVED_MEM_HIGH if v == 0 => p.reserved_high = p.reserved,
                _ => return Err(INVALID_VALUE),
            }
            Ok(())
        })
    }

    /// `cuDeviceGraphMemTrim`: the pool's memory that no live allocation uses goes back to the
    /// device (nothing is executing or scheduled here: a launch runs its nodes before it returns).
    fn cuDeviceGraphMemTrim(device) {
        run(|| {
            let drv = driver()?;
            let d = drv.device(device)?;
            let mut p = pool(d)?;
            let unused = p.reserved - p.used;
            refund(drv.node, d.gpu, d.domain, unused, p.epoch);
            p.reserved = p.used;
            Ok(())
        })
    }
}
