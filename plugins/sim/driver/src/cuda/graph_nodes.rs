//! The work nodes `cuGraphAddNode` (and its `_v2`) adds from a `CUgraphNodeParams`: kernel,
//! memcpy, memset and host nodes, the same nodes `cuGraphAddKernelNode`, `cuGraphAddMemcpyNode`,
//! `cuGraphAddMemsetNode` and `cuGraphAddHostNode` add. XLA builds its command buffers (CUDA
//! graphs of its fusions) this way: refused, every jitted function that XLA ran as a graph failed
//! ("Failed to add kernel node to a CUDA graph: CUDA_ERROR_NOT_SUPPORTED"), and its copies
//! between buffers ("Failed to add memcpy d2d node", as `jax.pmap` makes).
//!
//! A memcpy node copies one contiguous run of bytes: a `CUDA_MEMCPY3D` of one row, or of rows
//! (and slices) packed back to back on both sides, between host, device and unified memory.
//! Strided regions and CUDA arrays are `CUDA_ERROR_NOT_SUPPORTED` (3D copies are not modelled).

use std::ffi::c_int;

use super::graph::Op;
use super::{INVALID_VALUE, NOT_SUPPORTED, R, sys};

/// `CU_GRAPH_NODE_TYPE_KERNEL`, `_MEMCPY`, `_MEMSET`, `_HOST`.
pub(crate) const KERNEL: c_int = 0;
pub(crate) const MEMCPY: c_int = 1;
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

/// One side of a `CUDA_MEMCPY3D` as C lays it out, its memory type read as a raw integer.
#[repr(C)]
#[derive(Clone, Copy)]
struct Side3d {
    x: usize,
    y: usize,
    z: usize,
    lod: usize,
    ty: u32,
    host: *const std::ffi::c_void,
    device: u64,
    array: sys::CUarray,
    reserved: *mut std::ffi::c_void,
    pitch: usize,
    height: usize,
}

/// `CUDA_MEMCPY3D` with its memory types read as raw integers.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Memcpy3d {
    src: Side3d,
    dst: Side3d,
    width: usize,
    height: usize,
    depth: usize,
}
const _: () = assert!(std::mem::size_of::<Memcpy3d>() == std::mem::size_of::<sys::CUDA_MEMCPY3D>());
const _: () =
    assert!(std::mem::offset_of!(Memcpy3d, src.ty) == std::mem::offset_of!(sys::CUDA_MEMCPY3D, srcMemoryType));
const _: () =
    assert!(std::mem::offset_of!(Memcpy3d, src.height) == std::mem::offset_of!(sys::CUDA_MEMCPY3D, srcHeight));
const _: () =
    assert!(std::mem::offset_of!(Memcpy3d, dst.ty) == std::mem::offset_of!(sys::CUDA_MEMCPY3D, dstMemoryType));
const _: () = assert!(std::mem::offset_of!(Memcpy3d, dst.pitch) == std::mem::offset_of!(sys::CUDA_MEMCPY3D, dstPitch));
const _: () = assert!(std::mem::offset_of!(Memcpy3d, depth) == std::mem::offset_of!(sys::CUDA_MEMCPY3D, Depth));

impl Side3d {
    /// Where the side's region starts, for rows of `width` bytes and slices of `rows` rows:
    /// host (1), device (2) or unified (4) memory; a CUDA array (3) is not modelled here.
    fn start(&self, width: usize, rows: usize, slices: usize) -> R<u64> {
        let base = match self.ty {
            1 => self.host as u64,
            2 | 4 => self.device,
            3 => return Err(NOT_SUPPORTED),
            _ => return Err(INVALID_VALUE),
        };
        if self.lod != 0 {
            return Err(INVALID_VALUE);
        }
        // A pitch of 0 means packed rows, as for a single row; else it holds the row.
        let pitch = if self.pitch == 0 { width } else { self.pitch };
        let height = if self.height == 0 { rows } else { self.height };
        if pitch < width || (slices > 1 && height < rows) {
            return Err(INVALID_VALUE);
        }
        // Only a run of bytes back to back: one row, or rows (and slices) packed.
        let packed = (rows == 1 || pitch == width) && (slices == 1 || height == rows);
        if !packed {
            return Err(NOT_SUPPORTED);
        }
        let offset = (self.z as u64)
            .checked_mul(height as u64)
            .and_then(|r| r.checked_add(self.y as u64))
            .and_then(|r| r.checked_mul(pitch as u64))
            .and_then(|o| o.checked_add(self.x as u64))
            .and_then(|o| base.checked_add(o));
        offset.ok_or(INVALID_VALUE)
    }
}

/// A memcpy node's work: the copy `p` describes, as one run of bytes.
pub(crate) fn memcpy(p: &Memcpy3d) -> R<Op> {
    if p.width == 0 || p.height == 0 || p.depth == 0 {
        return Err(INVALID_VALUE);
    }
    let src = p.src.start(p.width, p.height, p.depth)?;
    let dst = p.dst.start(p.width, p.height, p.depth)?;
    let n = (p.width as u64).checked_mul(p.height as u64).and_then(|b| b.checked_mul(p.depth as u64));
    Ok(Op::Memcpy { dst, src, n: n.ok_or(INVALID_VALUE)? })
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
        MEMCPY => {
            // SAFETY: as above, a CUDA_MEMCPY_NODE_PARAMS: flags, a reserved int and a context,
            // then the CUDA_MEMCPY3D, which Memcpy3d mirrors with raw integers for its enums.
            let p = unsafe { at.wrapping_add(16).cast::<Memcpy3d>().read() };
            memcpy(&p)
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
