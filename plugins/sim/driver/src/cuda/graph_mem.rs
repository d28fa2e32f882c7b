//! Graph memory nodes (`cuGraphAddMemAllocNode`, `cuGraphAddMemFreeNode`) and the device's graph
//! memory attributes. As on a real driver, adding an allocation node reserves its address (the
//! node's `dptr` is known before launch), and the memory is allocated, and charged to the model
//! on the launching stream's device, when the graph runs the node; a free node (or `cuMemFree`
//! outside the graph) returns it. A graph whose allocation is still live cannot run again
//! (`CUDA_ERROR_INVALID_VALUE`).
//!
//! Where the sim differs: a real driver keeps freed graph memory in the device's graph pool
//! (reserved until `cuDeviceGraphMemTrim`); the sim returns it at once, so reserved equals used.
//! The reserved addresses stay reserved for the life of the process.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering::*};

use tessera_sim_model::Node;

use super::graph::Op;
use super::handles;
use super::init::driver;
use super::memory::{Alloc, MemKind, charge, map_anon};
use super::stream::Target;
use super::{CUresult, INVALID_DEVICE, INVALID_VALUE, OUT_OF_MEMORY, R, need, put, raw_u32, run, sys};

/// Devices tracked for the attributes (ordinals).
const DEVICES: usize = 64;
static USED: [AtomicU64; DEVICES] = [const { AtomicU64::new(0) }; DEVICES];
static USED_HIGH: [AtomicU64; DEVICES] = [const { AtomicU64::new(0) }; DEVICES];

/// `CUgraphMem_attribute`.
const USED_MEM_CURRENT: c_int = 0;
const USED_MEM_HIGH: c_int = 1;
const RESERVED_MEM_CURRENT: c_int = 2;
const RESERVED_MEM_HIGH: c_int = 3;

fn slot(ordinal: c_int) -> R<usize> {
    usize::try_from(ordinal).ok().filter(|&i| i < DEVICES).ok_or(INVALID_DEVICE)
}

/// The counters' slot of a device a caller names (checked against the driver's devices).
fn device_slot(device: sys::CUdevice) -> R<usize> {
    driver()?.device(device)?;
    slot(device)
}

/// Runs an allocation node: charges the memory at its reserved address.
pub(crate) fn allocate(node: &Node, t: &Target, base: u64, bytes: u64) -> R {
    let d = t.ctx.dev;
    let mut reg = handles::write();
    if reg.mem.contains_key(&base) {
        // The graph's previous allocation was never freed.
        return Err(INVALID_VALUE);
    }
    let epoch = charge(node, d.gpu, d.domain, bytes)?;
    let a = Alloc {
        // The address belongs to the graph node: freeing returns the memory, not the address.
        map_len: 0,
        charge: bytes,
        epoch,
        ..Alloc::new(base, bytes, MemKind::Graph, 0, d)
    };
    reg.mem.insert(base, a);
    let i = slot(d.ordinal)?;
    let now = USED[i].fetch_add(bytes, Relaxed) + bytes;
    USED_HIGH[i].fetch_max(now, Relaxed);
    Ok(())
}

/// Runs a free node (or `cuMemFree` of a graph allocation): returns the memory.
pub(crate) fn free(node: &Node, base: u64) -> R {
    let a = {
        let mut reg = handles::write();
        if !reg.mem.get(&base).is_some_and(|a| a.kind == MemKind::Graph) {
            return Err(INVALID_VALUE);
        }
        reg.mem.remove(&base).expect("checked above")
    };
    on_released(&a);
    super::memory::release(node, &a);
    Ok(())
}

/// Bookkeeping when a graph allocation goes (by a free node or `cuMemFree`).
pub(crate) fn on_released(a: &Alloc) {
    if let Ok(i) = slot(a.dev) {
        let _ = USED[i].fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(a.size)));
    }
}

/// The allocation node of a reserved address, if any graph has one.
fn alloc_node_of(dptr: u64) -> Option<u64> {
    let reg = handles::read();
    reg.gnodes.values().find_map(|n| match n.op {
        Op::MemAlloc { base, bytes } if base == dptr => Some(bytes),
        _ => None,
    })
}

unsafe fn add_alloc_node(
    ph: *mut sys::CUgraphNode,
    g: sys::CUgraph,
    deps: *const sys::CUgraphNode,
    n: usize,
    params: *mut sys::CUDA_MEM_ALLOC_NODE_PARAMS,
) -> R {
    driver()?;
    need(params)?;
    // SAFETY: params is the caller's struct (checked non-null and aligned); only its plain fields
    // are read, the enum ones as raw integers.
    let (bytes, alloc_type, location_type) = unsafe {
        (
            std::ptr::addr_of!((*params).bytesize).read(),
            raw_u32(std::ptr::addr_of!((*params).poolProps.allocType)),
            raw_u32(std::ptr::addr_of!((*params).poolProps.location.type_)),
        )
    };
    // CU_MEM_ALLOCATION_TYPE_PINNED on CU_MEM_LOCATION_TYPE_DEVICE is what graphs allocate.
    if bytes == 0 || alloc_type != 1 || location_type != 1 {
        return Err(INVALID_VALUE);
    }
    let base = map_anon(bytes as u64, false).ok_or(OUT_OF_MEMORY)?;
    // SAFETY: as this function's contract.
    unsafe { super::graph::add_node(ph, g, deps, n, Op::MemAlloc { base, bytes: bytes as u64 }) }?;
    // SAFETY: params was checked above; dptr is a plain integer field.
    unsafe { std::ptr::addr_of_mut!((*params).dptr).write(base) };
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddMemAllocNode(
    phGraphNode: *mut sys::CUgraphNode,
    hGraph: sys::CUgraph,
    dependencies: *const sys::CUgraphNode,
    numDependencies: usize,
    nodeParams: *mut sys::CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    // SAFETY: the caller's pointers, per the API contract.
    run(|| unsafe { add_alloc_node(phGraphNode, hGraph, dependencies, numDependencies, nodeParams) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddMemFreeNode(
    phGraphNode: *mut sys::CUgraphNode,
    hGraph: sys::CUgraph,
    dependencies: *const sys::CUgraphNode,
    numDependencies: usize,
    dptr: sys::CUdeviceptr,
) -> CUresult {
    run(|| {
        driver()?;
        alloc_node_of(dptr).ok_or(INVALID_VALUE)?;
        // SAFETY: the caller's pointers, per the API contract.
        unsafe {
            super::graph::add_node(phGraphNode, hGraph, dependencies, numDependencies, Op::MemFree { base: dptr })
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphMemAllocNodeGetParams(
    hNode: sys::CUgraphNode,
    params_out: *mut sys::CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    run(|| {
        driver()?;
        need(params_out)?;
        let op = handles::read().gnodes.get(&(hNode as usize)).map(|n| n.op.clone()).ok_or(INVALID_VALUE)?;
        let Op::MemAlloc { base, bytes } = op else { return Err(INVALID_VALUE) };
        // SAFETY: params_out is the caller's struct (checked); an all-zero value is valid for it
        // (null pointers, zero integers and enums whose zero is a listed value), then the plain
        // and enum fields are written as the node was made.
        unsafe {
            std::ptr::write_bytes(params_out, 0, 1);
            std::ptr::addr_of_mut!((*params_out).bytesize).write(bytes as usize);
            std::ptr::addr_of_mut!((*params_out).dptr).write(base);
            std::ptr::addr_of_mut!((*params_out).poolProps.allocType).cast::<u32>().write(1);
            std::ptr::addr_of_mut!((*params_out).poolProps.location.type_).cast::<u32>().write(1);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphMemFreeNodeGetParams(
    hNode: sys::CUgraphNode,
    dptr_out: *mut sys::CUdeviceptr,
) -> CUresult {
    run(|| {
        driver()?;
        let op = handles::read().gnodes.get(&(hNode as usize)).map(|n| n.op.clone()).ok_or(INVALID_VALUE)?;
        let Op::MemFree { base } = op else { return Err(INVALID_VALUE) };
        // SAFETY: dptr_out is the caller's out-pointer (checked by put).
        unsafe { put(dptr_out, base) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetGraphMemAttribute(
    device: sys::CUdevice,
    attr: c_int,
    value: *mut c_void,
) -> CUresult {
    run(|| {
        let i = device_slot(device)?;
        let v = match attr {
            USED_MEM_CURRENT | RESERVED_MEM_CURRENT => USED[i].load(Relaxed),
            USED_MEM_HIGH | RESERVED_MEM_HIGH => USED_HIGH[i].load(Relaxed),
            _ => return Err(INVALID_VALUE),
        };
        // SAFETY: value is the caller's cuuint64_t out-pointer (checked by put).
        unsafe { put(value.cast::<u64>(), v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceSetGraphMemAttribute(
    device: sys::CUdevice,
    attr: c_int,
    value: *mut c_void,
) -> CUresult {
    run(|| {
        let i = device_slot(device)?;
        // SAFETY: value is the caller's cuuint64_t (checked by get).
        let v = unsafe { super::get(value.cast::<u64>().cast_const()) }?;
        // Only the high watermarks can be set, and only to zero (which resets them to current).
        match attr {
            USED_MEM_HIGH | RESERVED_MEM_HIGH if v == 0 => USED_HIGH[i].store(USED[i].load(Relaxed), Relaxed),
            _ => return Err(INVALID_VALUE),
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGraphMemTrim(device: sys::CUdevice) -> CUresult {
    // Nothing is kept in reserve: there is nothing to trim.
    run(|| driver()?.device(device).map(|_| ()))
}
