//! Graph memory (`cuGraphAddMemAllocNode`, and allocations captured from `cuMemAllocAsync`): the
//! driver takes it from the device's graph pool when a launch (or `cuGraphUpload`) maps the
//! graph's allocations, keeps what is freed in that pool, and returns it to the device only at
//! `cuDeviceGraphMemTrim`. The process's charge on a device is therefore exactly what the driver
//! says the pool holds (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`), never the nodes' sizes again.
//!
//! - At instantiation the graph's memory nodes are read (each allocation's address, device and
//!   size; each free's address), those of the graphs its child graph nodes embed too (a child
//!   moved in with `CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE` may hold allocation nodes), and kept per
//!   executable graph; executables without any cost nothing later.
//! - Before a launch or upload of such an executable, each device it allocates on reserves the
//!   sum of its allocation nodes there, less what the pool has free (reserved − used), and, for
//!   an executable instantiated with `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`, less its
//!   own allocations still live (the relaunch frees them first): over the limit, the answer is
//!   `CUDA_ERROR_OUT_OF_MEMORY` and the driver is not called. After the call the charge is set
//!   to the pool's reserved size (the excess reservation is refunded).
//! - Which graph allocations are live is followed from what ends them: free nodes of launched
//!   graphs, `cuMemFree*` and `cuMemFreeAsync*`.
//! - `cuDeviceGraphMemTrim` and `cuGraphExecDestroy` set the charge to the pool's size again.
//! - A process killed with SIGKILL loses its region slot, and with it the charge (the reaping
//!   path of every other allocation).
//!
//! Launches, uploads and trims that move a pool are serialized (one lock); plain kernel
//! launches never come here, and graph launches of executables without allocation nodes cost
//! one relaxed load more.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, MutexGuard};

use super::alloc::{flavour, hook};
use crate::ffi::*;
use crate::real::RealCuda;
use crate::state::ShimState;
use tessera_abi::cuda_exports;
use tessera_region::TraceFunc;

/// CUDA ordinals whose graph pools are followed.
const ORDINALS: usize = 64;
/// `CU_GRAPH_NODE_TYPE_GRAPH`, `CU_GRAPH_NODE_TYPE_MEM_ALLOC`, `CU_GRAPH_NODE_TYPE_MEM_FREE`.
const NODE_GRAPH: c_int = 4;
const NODE_MEM_ALLOC: c_int = 10;
const NODE_MEM_FREE: c_int = 11;
/// `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`.
const INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH: u64 = 0x1;
/// `CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT`, `CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`.
const USED_MEM_CURRENT: c_int = 0;
const RESERVED_MEM_CURRENT: c_int = 2;
/// `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD`: the instantiation maps the graph's memory too.
const INSTANTIATE_FLAG_UPLOAD: u64 = 0x2;

/// Bytes per device: (CUDA ordinal, bytes), summed.
type Needs = Vec<(c_int, u64)>;

/// An executable graph's memory nodes.
#[derive(Default)]
struct ExecMem {
    /// What its allocation nodes take, per device.
    needs: Needs,
    /// Its allocations that outlive a launch (no free node in the graph): address, device, bytes.
    kept: Vec<(u64, c_int, u64)>,
    /// Addresses its free nodes end.
    frees: Vec<u64>,
    /// `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`: a relaunch frees its kept allocations.
    auto_free: bool,
}

fn add(needs: &mut Needs, dev: c_int, bytes: u64) {
    match needs.iter_mut().find(|(d, _)| *d == dev) {
        Some((_, b)) => *b = b.saturating_add(bytes),
        None => needs.push((dev, bytes)),
    }
}

/// Graph memory of this process.
pub(crate) struct GraphMem {
    /// Executable graphs with memory nodes.
    execs: Mutex<HashMap<u64, Arc<ExecMem>>>,
    /// Graph allocations live now (made by a launch, not yet ended): address → (device, bytes).
    live: Mutex<HashMap<u64, (c_int, u64)>>,
    /// Whether any executable graph has allocation nodes (the launch path's only cost otherwise).
    any: AtomicBool,
    /// What this process is charged for each ordinal's graph pool (its reserved size as last read).
    charged: [AtomicU64; ORDINALS],
    /// Serializes the calls that move a pool, so that each reads its own effect.
    moving: Mutex<()>,
}

impl GraphMem {
    pub(crate) fn new() -> GraphMem {
        GraphMem {
            execs: Mutex::new(HashMap::new()),
            live: Mutex::new(HashMap::new()),
            any: AtomicBool::new(false),
            charged: [const { AtomicU64::new(0) }; ORDINALS],
            moving: Mutex::new(()),
        }
    }

    fn execs(&self) -> MutexGuard<'_, HashMap<u64, Arc<ExecMem>>> {
        self.execs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn live(&self) -> MutexGuard<'_, HashMap<u64, (c_int, u64)>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn exec(&self, exec: u64) -> Option<Arc<ExecMem>> {
        if !self.any.load(Relaxed) {
            return None;
        }
        self.execs().get(&exec).cloned()
    }

    /// What this process is charged for a device's graph pool (for tests and reports).
    #[allow(dead_code)]
    pub(crate) fn charged(&self, ordinal: c_int) -> u64 {
        usize::try_from(ordinal).ok().and_then(|i| self.charged.get(i)).map_or(0, |c| c.load(Acquire))
    }
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS`, with the enums of its pool properties read as raw integers.
#[repr(C)]
struct MemAllocNodeParams {
    pool_props: MemAllocPropHead,
    /// The rest of `CUmemPoolProps`: security attributes, maximum size, usage, reserved bytes.
    _pool_rest: [u64; 9],
    access_descs: *const c_void,
    access_desc_count: usize,
    bytesize: usize,
    dptr: CUdeviceptr,
}
const _: () = assert!(
    std::mem::size_of::<MemAllocNodeParams>() == std::mem::size_of::<cudarc::driver::sys::CUDA_MEM_ALLOC_NODE_PARAMS>()
);
const _: () = assert!(
    std::mem::offset_of!(MemAllocNodeParams, bytesize)
        == std::mem::offset_of!(cudarc::driver::sys::CUDA_MEM_ALLOC_NODE_PARAMS, bytesize)
);

/// Child graphs nested deeper than this are not followed: such a graph is refused at
/// instantiation (`CUDA_ERROR_NOT_SUPPORTED`) rather than run with its memory uncounted.
const MAX_CHILD_DEPTH: usize = 64;

/// Why a graph's memory nodes could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unread {
    /// The driver cannot tell (a function missing or failing): charged after the launch.
    Unknown,
    /// Child graphs nested deeper than [`MAX_CHILD_DEPTH`].
    TooDeep,
}

/// The memory nodes of a graph and of the graphs it embeds.
fn memory_nodes(cu: &RealCuda, graph: CUgraph) -> Result<ExecMem, Unread> {
    let mut m = ExecMem::default();
    let mut allocs = Vec::new();
    collect_memory_nodes(cu, graph, 0, &mut m, &mut allocs)?;
    m.kept = allocs.into_iter().filter(|(dptr, ..)| !m.frees.contains(dptr)).collect();
    Ok(m)
}

/// Adds `graph`'s memory nodes (and its child graphs') to `m` and `allocs`.
fn collect_memory_nodes(
    cu: &RealCuda,
    graph: CUgraph,
    depth: usize,
    m: &mut ExecMem,
    allocs: &mut Vec<(u64, c_int, u64)>,
) -> Result<(), Unread> {
    use Unread::Unknown;
    if depth > MAX_CHILD_DEPTH {
        return Err(Unread::TooDeep);
    }
    let (Some(get_nodes), Some(node_type), Some(params), Some(free_params)) =
        (cu.cuGraphGetNodes, cu.cuGraphNodeGetType, cu.cuGraphMemAllocNodeGetParams, cu.cuGraphMemFreeNodeGetParams)
    else {
        return Err(Unknown);
    };
    let mut n = 0usize;
    // SAFETY: a null node array asks for the count only; n is a valid out-pointer.
    if unsafe { get_nodes(graph, std::ptr::null_mut(), &mut n) } != CUDA_SUCCESS {
        return Err(Unknown);
    }
    let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: nodes has room for n handles, as n says.
    if n > 0 && unsafe { get_nodes(graph, nodes.as_mut_ptr(), &mut n) } != CUDA_SUCCESS {
        return Err(Unknown);
    }
    for &node in nodes.iter().take(n) {
        let mut ty: c_int = -1;
        // SAFETY: node is one of the graph's nodes; ty a valid out-pointer.
        if unsafe { node_type(node, &mut ty) } != CUDA_SUCCESS {
            continue;
        }
        if ty == NODE_GRAPH {
            // A driver that cannot name the embedded graph cannot say what it allocates.
            let child_of = cu.cuGraphChildGraphNodeGetGraph.ok_or(Unknown)?;
            let mut child: CUgraph = std::ptr::null_mut();
            // SAFETY: node is a child graph node; child a valid out-pointer.
            if unsafe { child_of(node, &mut child) } != CUDA_SUCCESS {
                return Err(Unknown);
            }
            collect_memory_nodes(cu, child, depth + 1, m, allocs)?;
            continue;
        }
        if ty == NODE_MEM_FREE {
            let mut dptr: CUdeviceptr = 0;
            // SAFETY: node is a free node; dptr a valid out-pointer.
            if unsafe { free_params(node, &mut dptr) } != CUDA_SUCCESS {
                return Err(Unknown);
            }
            m.frees.push(dptr);
            continue;
        }
        if ty != NODE_MEM_ALLOC {
            continue;
        }
        let mut p = std::mem::MaybeUninit::<MemAllocNodeParams>::zeroed();
        // SAFETY: node is an allocation node; p has the layout of CUDA_MEM_ALLOC_NODE_PARAMS.
        if unsafe { params(node, p.as_mut_ptr().cast()) } != CUDA_SUCCESS {
            return Err(Unknown);
        }
        // SAFETY: zero-initialized, then written by the driver; every field is a plain integer
        // or pointer, valid for any bits.
        let p = unsafe { p.assume_init() };
        let (dev, bytes) = (p.pool_props.location_id, p.bytesize as u64);
        add(&mut m.needs, dev, bytes);
        allocs.push((p.dptr, dev, bytes));
    }
    Ok(())
}

/// The (used, reserved) size of a device's graph pool, as the driver says.
fn pool_of(cu: &RealCuda, ordinal: c_int) -> Option<(u64, u64)> {
    let attr = cu.cuDeviceGetGraphMemAttribute?;
    let (mut used, mut reserved) = (0u64, 0u64);
    // SAFETY: both attributes are cuuint64_t, written through valid out-pointers.
    let ok = unsafe {
        attr(ordinal, USED_MEM_CURRENT, (&raw mut used).cast()) == CUDA_SUCCESS
            && attr(ordinal, RESERVED_MEM_CURRENT, (&raw mut reserved).cast()) == CUDA_SUCCESS
    };
    ok.then_some((used, reserved))
}

/// Sets the charge of an ordinal's graph pool to what the driver now holds in it, given `pending`
/// bytes reserved beside the charge for the call that just ran (refunded or kept as needed).
fn settle(s: &ShimState, cu: &RealCuda, ordinal: c_int, dev: usize, pending: u64) {
    let Some(slot) = usize::try_from(ordinal).ok().and_then(|i| s.mem.graphs.charged.get(i)) else {
        s.refund(dev, pending);
        return;
    };
    let was = slot.load(Acquire);
    let Some((_, now)) = pool_of(cu, ordinal) else {
        // Unreadable: keep what was reserved (over-charging, never under).
        slot.store(was + pending, Release);
        return;
    };
    let held = was + pending;
    if now < held {
        s.refund(dev, held - now);
    } else if now > held {
        // The driver took more than reserved for (it may round or fragment): charged anyway, so
        // that the accounting stays true; the container's next allocations see it.
        s.charge_unchecked(dev, now - held);
    }
    slot.store(now, Release);
}

/// Runs a call that may map graph memory (a launch or upload of an executable, or an
/// instantiation that uploads): reserves each device's possible growth first
/// (`CUDA_ERROR_OUT_OF_MEMORY` when it does not fit, the driver not called), then settles every
/// charge on the pools' sizes. `freed_first`: bytes per device the call frees before it
/// allocates (an auto-free relaunch's own live allocations).
fn mapping(
    s: &ShimState,
    cu: &RealCuda,
    needs: &Needs,
    freed_first: &Needs,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let _moving = s.mem.graphs.moving.lock().unwrap_or_else(|e| e.into_inner());
    let mut reserved: Vec<(c_int, usize, u64)> = Vec::with_capacity(needs.len());
    for &(ordinal, bytes) in needs {
        let Some(dev) = s.device_of_ordinal(ordinal) else { continue };
        // A first context still waiting for its true-up is trued up now: once the pool holds a
        // charge, the true-up cannot tell the context's memory from the pool's and would wait
        // for good (the estimate's excess then refusing allocations under the limit).
        crate::memory::context::settle(s, dev);
        let own = freed_first.iter().find(|(d, _)| *d == ordinal).map_or(0, |(_, b)| *b);
        let growth = match pool_of(cu, ordinal) {
            // What the driver says is live bounds what this call can free.
            Some((used, pool)) => bytes.saturating_sub(pool.saturating_sub(used) + own.min(used)),
            None => bytes,
        };
        if !s.reserve(dev, growth) {
            for &(_, d, b) in &reserved {
                s.refund(d, b);
            }
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        reserved.push((ordinal, dev, growth));
    }
    let rc = call();
    for &(ordinal, dev, growth) in &reserved {
        settle(s, cu, ordinal, dev, growth);
    }
    rc
}

/// Settles every pool this process is charged for (after a trim or an executable's destruction).
fn settle_all(s: &ShimState, cu: &RealCuda) {
    for (i, c) in s.mem.graphs.charged.iter().enumerate() {
        if c.load(Acquire) > 0
            && let Some(dev) = s.device_of_ordinal(i as c_int)
        {
            settle(s, cu, i as c_int, dev, 0);
        }
    }
}

/// After a context went (a destroy or a primary context's reset): a driver that emptied a graph
/// pool with it no longer holds that memory.
pub(crate) fn settle_pools(s: &ShimState, cu: &RealCuda) {
    let _moving = s.mem.graphs.moving.lock().unwrap_or_else(|e| e.into_inner());
    settle_all(s, cu);
}

/// A graph launch of `exec` (the limiter's gate is the caller's); `upload`: a `cuGraphUpload`,
/// which maps memory but runs nothing (no allocation starts or ends).
fn ran(exec: CUgraphExec, upload: bool, call: impl FnOnce() -> CUresult) -> CUresult {
    let Some(s) = crate::state::get() else { return call() };
    let Some(m) = s.mem.graphs.exec(exec as u64) else { return call() };
    let Some(cu) = crate::real::cuda() else { return call() };
    let mut freed_first = Needs::new();
    if m.auto_free && !upload {
        let live = s.mem.graphs.live();
        for &(dptr, dev, bytes) in &m.kept {
            if live.contains_key(&dptr) {
                add(&mut freed_first, dev, bytes);
            }
        }
    }
    let rc = mapping(s, cu, &m.needs, &freed_first, call);
    if rc == CUDA_SUCCESS && !upload {
        let mut live = s.mem.graphs.live();
        for dptr in &m.frees {
            live.remove(dptr);
        }
        for &(dptr, dev, bytes) in &m.kept {
            live.insert(dptr, (dev, bytes));
        }
    }
    rc
}

/// Whether some executable of this process has memory nodes: graph launches then take the
/// launch hooks' full path, which reserves their memory ([`launched`]).
#[inline]
pub(crate) fn any_memory_nodes() -> bool {
    crate::state::get().is_some_and(|s| s.mem.graphs.any.load(Relaxed))
}

/// A graph launch of `exec`.
pub(crate) fn launched(exec: CUgraphExec, call: impl FnOnce() -> CUresult) -> CUresult {
    ran(exec, false, call)
}

/// A device pointer was freed (`cuMemFree*`, `cuMemFreeAsync*`): if it was a graph allocation,
/// it is live no more.
pub(crate) fn freed(s: &ShimState, dptr: u64) {
    if s.mem.graphs.any.load(Relaxed) {
        s.mem.graphs.live().remove(&dptr);
    }
}

/// An instantiation of `graph` with `flags`; on success the executable's memory nodes are
/// remembered.
fn instantiated(
    s: &ShimState,
    cu: &RealCuda,
    graph: CUgraph,
    flags: u64,
    exec_out: *mut CUgraphExec,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let mut m = match memory_nodes(cu, graph) {
        Ok(m) => m,
        Err(Unread::Unknown) => return call(),
        Err(Unread::TooDeep) => {
            use std::io::Write;
            // writeln!, not eprintln!: a closed stderr must not panic inside a hook.
            let _ = writeln!(
                std::io::stderr(),
                "tessera: a graph with child graphs nested over {MAX_CHILD_DEPTH} deep is refused: its memory could not be counted against the limit"
            );
            return CUDA_ERROR_NOT_SUPPORTED;
        }
    };
    if m.needs.is_empty() && m.frees.is_empty() {
        return call();
    }
    m.auto_free = flags & INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH != 0;
    let upload = flags & INSTANTIATE_FLAG_UPLOAD != 0;
    let rc = if upload { mapping(s, cu, &m.needs, &Needs::new(), call) } else { call() };
    if rc == CUDA_SUCCESS
        // SAFETY: the driver wrote the executable through the caller's out-pointer (it succeeded).
        && let Some(exec) = unsafe { get(exec_out) }
    {
        s.mem.graphs.execs().insert(exec as u64, Arc::new(m));
        s.mem.graphs.any.store(true, Relaxed);
    }
    rc
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's legacy `cuGraphInstantiate` (CUDA 10 parameters).
    fn cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize) {
        hook(TraceFunc::cuGraphInstantiate, |s, cu| {
            let Some(f) = cu.cuGraphInstantiate else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            instantiated(s, cu, hGraph, 0, phGraphExec, || unsafe {
                f(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize)
            })
        })
    }

    /// # Safety
    /// As cuda.h's `cuGraphInstantiate_v2`.
    fn cuGraphInstantiate_v2(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize) {
        hook(TraceFunc::cuGraphInstantiate_v2, |s, cu| {
            let Some(f) = cu.cuGraphInstantiate_v2 else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            instantiated(s, cu, hGraph, 0, phGraphExec, || unsafe {
                f(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize)
            })
        })
    }

    /// # Safety
    /// As cuda.h's `cuGraphInstantiateWithFlags` (also `cuGraphInstantiate` from CUDA 12.0).
    fn cuGraphInstantiateWithFlags(phGraphExec, hGraph, flags) {
        hook(TraceFunc::cuGraphInstantiateWithFlags, |s, cu| {
            let Some(f) = cu.cuGraphInstantiateWithFlags else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            instantiated(s, cu, hGraph, flags, phGraphExec, || unsafe { f(phGraphExec, hGraph, flags) })
        })
    }
}

/// The flags of a `CUDA_GRAPH_INSTANTIATE_PARAMS` (its first field).
///
/// # Safety
/// `params` must be null or point to a `CUDA_GRAPH_INSTANTIATE_PARAMS`.
unsafe fn instantiate_flags(params: *mut cudarc::driver::sys::CUDA_GRAPH_INSTANTIATE_PARAMS) -> u64 {
    // SAFETY: as this function's contract; `flags` is the struct's first field, a cuuint64_t.
    unsafe { get(params.cast::<u64>().cast_const()) }.unwrap_or(0)
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuGraphInstantiateWithParams`, and `cuGraphInstantiateWithParams_ptsz`.
    fn cuGraphInstantiateWithParams(phGraphExec, hGraph, instantiateParams) twin cuGraphInstantiateWithParams_ptsz(ptsz) {
        let trace = flavour(ptsz, TraceFunc::cuGraphInstantiateWithParams, TraceFunc::cuGraphInstantiateWithParams_ptsz);
        hook(trace, |s, cu| {
            let f = flavour(ptsz, cu.cuGraphInstantiateWithParams, cu.cuGraphInstantiateWithParams_ptsz);
            let Some(f) = f else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's parameters (cuda.h's contract).
            let flags = unsafe { instantiate_flags(instantiateParams) };
            // SAFETY: the caller's arguments, passed on unchanged.
            instantiated(s, cu, hGraph, flags, phGraphExec, || unsafe { f(phGraphExec, hGraph, instantiateParams) })
        })
    }

    /// # Safety
    /// As cuda.h's `cuGraphUpload`, and `cuGraphUpload_ptsz`.
    fn cuGraphUpload(hGraphExec, hStream) twin cuGraphUpload_ptsz(ptsz) {
        hook(flavour(ptsz, TraceFunc::cuGraphUpload, TraceFunc::cuGraphUpload_ptsz), |_, cu| {
            let Some(f) = flavour(ptsz, cu.cuGraphUpload, cu.cuGraphUpload_ptsz) else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's arguments, passed on unchanged.
            ran(hGraphExec, true, || unsafe { f(hGraphExec, hStream) })
        })
    }

    /// # Safety
    /// As cuda.h's `cuGraphExecDestroy`.
    fn cuGraphExecDestroy(hGraphExec) {
        hook(TraceFunc::cuGraphExecDestroy, |s, cu| {
            let Some(f) = cu.cuGraphExecDestroy else { return CUDA_ERROR_NOT_SUPPORTED };
            // SAFETY: the caller's argument, passed on unchanged.
            let rc = unsafe { f(hGraphExec) };
            if rc == CUDA_SUCCESS
                && s.mem.graphs.any.load(Relaxed)
                && s.mem.graphs.execs().remove(&(hGraphExec as u64)).is_some()
            {
                let _moving = s.mem.graphs.moving.lock().unwrap_or_else(|e| e.into_inner());
                settle_all(s, cu);
            }
            rc
        })
    }

    /// # Safety
    /// As cuda.h's `cuDeviceGraphMemTrim`.
    fn cuDeviceGraphMemTrim(device) {
        hook(TraceFunc::cuDeviceGraphMemTrim, |s, cu| {
            let Some(f) = cu.cuDeviceGraphMemTrim else { return CUDA_ERROR_NOT_SUPPORTED };
            let _moving = s.mem.graphs.moving.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the caller's argument, passed on unchanged.
            let rc = unsafe { f(device) };
            if rc == CUDA_SUCCESS {
                settle_all(s, cu);
            }
            rc
        })
    }
}
