//! The work nodes `cuGraphAddNode` (and its `_v2`) adds from a `CUgraphNodeParams`: kernel,
//! memset and host nodes, the same nodes `cuGraphAddKernelNode`, `cuGraphAddMemsetNode` and
//! `cuGraphAddHostNode` add. XLA builds its command buffers (CUDA graphs of its fusions) this way:
//! refused, every jitted function that XLA ran as a graph failed ("Failed to add kernel node to a
//! CUDA graph: CUDA_ERROR_NOT_SUPPORTED").

use std::ffi::c_int;

use super::graph::Op;
use super::{INVALID_VALUE, R, sys};

/// `CU_GRAPH_NODE_TYPE_KERNEL`, `_MEMSET`, `_HOST`.
pub(crate) const KERNEL: c_int = 0;
pub(crate) const MEMSET: c_int = 2;
pub(crate) const HOST: c_int = 3;

/// Where the per-type parameters start in `CUgraphNodeParams` (after the type and three
/// reserved ints).
const UNION_OFFSET: usize = 16;
const _: () = assert!(std::mem::offset_of!(sys::CUgraphNodeParams, __bindgen_anon_1) == UNION_OFFSET);

/// A kernel node's work: the function (`func`, else the library kernel `kern`, as
/// `cuGraphAddKernelNode_v2` takes it).
pub(crate) fn kernel(func: sys::CUfunction, kern: sys::CUkernel) -> R<Op> {
    let f = if func.is_null() { kern as usize } else { func as usize };
    let f = super::handles::read().funcs.get(&f).cloned().ok_or(INVALID_VALUE)?;
    Ok(Op::Kernel { func: f })
}

/// A memset node's work, from the fields its parameter structs share (element size 1, 2 or 4;
/// a width and height of at least 1).
pub(crate) fn memset(dst: u64, pitch: usize, value: u32, elem: u32, width: usize, height: usize) -> R<Op> {
    if !matches!(elem, 1 | 2 | 4) || width == 0 || height == 0 {
        return Err(INVALID_VALUE);
    }
    Ok(Op::Memset(super::copy::Memset {
        dst,
        pitch: pitch as u64,
        value,
        elem,
        width: width as u64,
        height: height as u64,
    }))
}

/// A host node's work (a function is required).
pub(crate) fn host(f: sys::CUhostFn, data: *mut std::ffi::c_void) -> R<Op> {
    Ok(Op::Host { f: f.ok_or(INVALID_VALUE)?, data: data as usize })
}

/// The work of a node of type `t` (one of the three above) described by `params`.
///
/// # Safety
/// `params` must point at a whole, readable `CUgraphNodeParams`.
pub(crate) unsafe fn op(t: c_int, params: *const sys::CUgraphNodeParams) -> R<Op> {
    let at = params.cast::<u8>().wrapping_add(UNION_OFFSET);
    match t {
        KERNEL => {
            // SAFETY: the union holds a CUDA_KERNEL_NODE_PARAMS_v3 for this type (the caller's
            // contract); its fields are pointers and integers, valid for any bits.
            let p = unsafe { at.cast::<sys::CUDA_KERNEL_NODE_PARAMS_v3>().read() };
            kernel(p.func, p.kern)
        }
        MEMSET => {
            // SAFETY: as above, a CUDA_MEMSET_NODE_PARAMS_v2 of integers and a context pointer.
            let p = unsafe { at.cast::<sys::CUDA_MEMSET_NODE_PARAMS_v2>().read() };
            memset(p.dst, p.pitch, p.value, p.elementSize, p.width, p.height)
        }
        HOST => {
            // SAFETY: as above, a CUDA_HOST_NODE_PARAMS_v2: a nullable function pointer and data.
            let p = unsafe { at.cast::<sys::CUDA_HOST_NODE_PARAMS_v2>().read() };
            host(p.fn_, p.userData)
        }
        _ => Err(INVALID_VALUE),
    }
}

/// `CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER`: the edge fires once every block of the upstream
/// kernel has begun.
const PORT_LAUNCH_ORDER: u8 = 2;

/// `CUgraphEdgeData`: the upstream node's port, the downstream's, the dependency type, and five
/// bytes that must be zero.
#[repr(C)]
#[derive(Clone, Copy)]
struct EdgeData {
    from_port: u8,
    to_port: u8,
    type_: u8,
    reserved: [u8; 5],
}

/// Checks the edge data `cuGraphAddNode_v2` takes beside the dependencies of a node of type
/// `downstream` (null: every edge the default), as cuda.h describes it: no downstream port, a
/// dependency type of 0 (default) or 1 (programmatic), reserved bytes zero; a non-zero upstream
/// port (1 programmatic, 2 launch order) only from a kernel node; a programmatic edge only
/// between kernel nodes, from port 1 or 2. XLA joins the kernels of its command buffers with
/// programmatic edges (programmatic dependent launch). The sim runs a graph's nodes one after
/// another, so such a node starts when its upstream kernel ends, as it would on a GPU where the
/// upstream kernel never triggers its dependents early; the edges are not kept otherwise.
///
/// # Safety
/// `deps` and `data` must be null or hold `n` entries.
pub(crate) unsafe fn check_edges(
    deps: *const sys::CUgraphNode,
    data: *const std::ffi::c_void,
    n: usize,
    downstream: c_int,
) -> R {
    if data.is_null() || n == 0 {
        return Ok(());
    }
    if deps.is_null() || !deps.is_aligned() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: both arrays hold n entries by this function's contract; EdgeData is 8 bytes of
    // bytes (alignment 1), valid for any bits.
    let (deps, edges) =
        unsafe { (std::slice::from_raw_parts(deps, n), std::slice::from_raw_parts(data.cast::<EdgeData>(), n)) };
    let reg = super::handles::read();
    for (d, e) in deps.iter().zip(edges) {
        if e.reserved != [0; 5] || e.to_port != 0 || e.type_ > 1 || e.from_port > PORT_LAUNCH_ORDER {
            return Err(INVALID_VALUE);
        }
        if e.from_port == 0 && e.type_ == 0 {
            continue;
        }
        let upstream = reg.gnodes.get(&(*d as usize)).map(|g| g.op.node_type()).ok_or(INVALID_VALUE)?;
        let ok = upstream == KERNEL
            && match e.type_ {
                0 => e.from_port == PORT_LAUNCH_ORDER,
                _ => downstream == KERNEL && e.from_port != 0,
            };
        if !ok {
            return Err(INVALID_VALUE);
        }
    }
    Ok(())
}
