//! Graph nodes added through `cuGraphAddNode` and `cuGraphAddNode_v2` from a `CUgraphNodeParams`
//! (kernel, memcpy, memset and host nodes) and through `cuGraphAddMemcpyNode`, with the edge data
//! `_v2` takes beside the dependencies, as XLA builds its command buffers: kernels joined by
//! programmatic edges, copies between buffers. The graph runs (the memset writes its bytes, the
//! copies move them, the host function is called) and every edge cuda.h rules out is refused
//! with `CUDA_ERROR_INVALID_VALUE`; copies the sim does not model (strided, CUDA arrays) with
//! `CUDA_ERROR_NOT_SUPPORTED`.
//!
//! Build the library first: `cargo build -p tessera-sim-driver && cargo test -p tessera-sim-driver --test graph_nodes`.

use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicU32, Ordering};

use cudarc::driver::sys;
use tessera_sim_testkit::SimNode;

mod common;
use common::{Handle, INVALID_VALUE, NOT_SUPPORTED, SUCCESS, function};

/// Calls an export by name with the C signature given.
macro_rules! call {
    ($lib:expr, $name:ident($($arg:expr),* $(,)?) as fn($($t:ty),* $(,)?)) => {{
        let f: libloading::Symbol<unsafe extern "C" fn($($t),*) -> u32> =
            // SAFETY: the symbol has this C signature (cuda.h 12.9).
            unsafe { $lib.get(stringify!($name).as_bytes()) }.expect(stringify!($name));
        // SAFETY: the arguments are valid for that signature.
        unsafe { f($($arg),*) }
    }};
    ($lib:expr, $name:ident($($arg:expr),* $(,)?) as $t:ty) => {{
        let f: libloading::Symbol<$t> =
            // SAFETY: the symbol has this C signature (cuda.h 12.9).
            unsafe { $lib.get(stringify!($name).as_bytes()) }.expect(stringify!($name));
        // SAFETY: the arguments are valid for that signature.
        unsafe { f($($arg),*) }
    }};
}

const PTX: &std::ffi::CStr =
    c".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry step_2us(\n)\n{\n ret;\n}\n";

/// `CUgraphEdgeData`: upstream port, downstream port, type, five reserved bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct Edge([u8; 8]);

const DEFAULT: Edge = Edge([0; 8]);
/// From `CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC`, `CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC`.
const PROGRAMMATIC: Edge = Edge([1, 0, 1, 0, 0, 0, 0, 0]);
/// From `CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER`, an ordinary dependency.
const LAUNCH_ORDER: Edge = Edge([2, 0, 0, 0, 0, 0, 0, 0]);

static HOST_CALLS: AtomicU32 = AtomicU32::new(0);

extern "C" fn host_fn(data: *mut c_void) {
    HOST_CALLS.fetch_add(data as u32, Ordering::SeqCst);
}

fn params() -> sys::CUgraphNodeParams {
    // SAFETY: all-zero is a valid CUgraphNodeParams (type 0, a union of plain data).
    unsafe { std::mem::zeroed() }
}

fn kernel(f: Handle) -> sys::CUgraphNodeParams {
    let mut p = params();
    p.type_ = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL;
    // SAFETY: writing a union field of plain data.
    let k = unsafe { &mut p.__bindgen_anon_1.kernel };
    k.func = f.cast();
    (k.gridDimX, k.gridDimY, k.gridDimZ, k.blockDimX, k.blockDimY, k.blockDimZ) = (4, 1, 1, 128, 1, 1);
    p
}

fn memset(dst: u64, bytes: usize, elem: c_uint) -> sys::CUgraphNodeParams {
    let mut p = params();
    p.type_ = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET;
    // SAFETY: as above.
    let m = unsafe { &mut p.__bindgen_anon_1.memset };
    (m.dst, m.pitch, m.value, m.elementSize, m.width, m.height) = (dst, 0, 0xab, elem, bytes, 1);
    p
}

/// One side of a `CUDA_MEMCPY3D`, its memory type a raw integer (so that a test can pass one no
/// enum variant has).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Side {
    x: usize,
    y: usize,
    z: usize,
    lod: usize,
    ty: u32,
    host: usize,
    device: u64,
    array: usize,
    reserved: usize,
    pitch: usize,
    height: usize,
}

/// `CUDA_MEMCPY3D`, as C lays it out.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Copy3d {
    src: Side,
    dst: Side,
    width: usize,
    height: usize,
    depth: usize,
}
const _: () = assert!(std::mem::size_of::<Copy3d>() == std::mem::size_of::<sys::CUDA_MEMCPY3D>());

/// `CU_MEMORYTYPE_HOST`, `_DEVICE`, `_ARRAY`.
const HOST: u32 = 1;
const DEVICE: u32 = 2;
const ARRAY: u32 = 3;

/// A linear copy of `width` bytes per row, `height` rows: device to device, or from the host
/// where `host` is given.
fn copy3d(src: u64, host: Option<&[u8]>, dst: u64, width: usize, height: usize) -> Copy3d {
    let src = match host {
        Some(h) => Side { ty: HOST, host: h.as_ptr() as usize, ..Side::default() },
        None => Side { ty: DEVICE, device: src, ..Side::default() },
    };
    Copy3d { src, dst: Side { ty: DEVICE, device: dst, ..Side::default() }, width, height, depth: 1 }
}

/// A memcpy node's parameters (`CUDA_MEMCPY_NODE_PARAMS`: flags, reserved, context, the copy).
fn memcpy(m: Copy3d) -> sys::CUgraphNodeParams {
    let mut p = params();
    p.type_ = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY;
    let at = std::mem::offset_of!(sys::CUgraphNodeParams, __bindgen_anon_1) + 16;
    // SAFETY: the copy lies inside the union (CUDA_MEMCPY_NODE_PARAMS's copyParams, after its
    // flags, reserved int and context); the struct is only passed to C.
    unsafe { (&mut p as *mut sys::CUgraphNodeParams).cast::<u8>().add(at).cast::<Copy3d>().write_unaligned(m) };
    p
}

fn host(f: sys::CUhostFn) -> sys::CUgraphNodeParams {
    let mut p = params();
    p.type_ = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_HOST;
    // SAFETY: as above.
    let h = unsafe { &mut p.__bindgen_anon_1.host };
    (h.fn_, h.userData) = (f, 5 as *mut c_void);
    p
}

#[test]
fn nodes_from_node_params_run_and_edges_are_checked() {
    let node = SimNode::new();
    node.run_isolated("nodes_from_node_params_run_and_edges_are_checked", || {
        // SAFETY: loading the simulated driver runs no initializers.
        let cu = unsafe { libloading::Library::new(node.cuda_path()) }.expect("load libcuda.so.1");
        let (mut ctx, mut g, mut dev, mut dev2, mut dev3) = (std::ptr::null_mut(), std::ptr::null_mut(), 0u64, 0, 0);
        assert_eq!(call!(cu, cuInit(0) as fn(c_uint)), SUCCESS);
        assert_eq!(call!(cu, cuCtxCreate_v2(&mut ctx, 0, 0) as fn(*mut Handle, c_uint, i32)), SUCCESS);
        for d in [&mut dev, &mut dev2, &mut dev3] {
            assert_eq!(call!(cu, cuMemAlloc_v2(d, 4096) as fn(*mut u64, usize)), SUCCESS);
        }
        let pattern: Vec<u8> = (0..1024u32).map(|i| (i % 251) as u8).collect();
        let f = function(&cu, PTX, "step_2us");
        assert_eq!(call!(cu, cuGraphCreate(&mut g, 0) as fn(*mut Handle, c_uint)), SUCCESS);

        type AddV2 = unsafe extern "C" fn(
            *mut Handle,
            Handle,
            *const Handle,
            *const Edge,
            usize,
            *const sys::CUgraphNodeParams,
        ) -> u32;
        let add = |deps: &[Handle], edges: Option<&[Edge]>, p: &sys::CUgraphNodeParams| -> Result<Handle, u32> {
            let mut h = std::ptr::null_mut();
            let e = edges.map_or(std::ptr::null(), |e| e.as_ptr());
            match call!(cu, cuGraphAddNode_v2(&mut h, g, deps.as_ptr(), e, deps.len(), p) as AddV2) {
                SUCCESS => Ok(h),
                rc => Err(rc),
            }
        };
        // Kernels joined by a programmatic edge and a launch-order edge, then a memset and a
        // host function after them (a zeroed edge is the default one).
        type Add =
            unsafe extern "C" fn(*mut Handle, Handle, *const Handle, usize, *const sys::CUgraphNodeParams) -> u32;
        let mut first = std::ptr::null_mut();
        assert_eq!(call!(cu, cuGraphAddNode(&mut first, g, std::ptr::null(), 0, &kernel(f)) as Add), SUCCESS);
        let second = add(&[first], Some(&[PROGRAMMATIC]), &kernel(f)).expect("a programmatic edge between kernels");
        let third = add(&[second], Some(&[LAUNCH_ORDER]), &kernel(f)).expect("a launch-order edge from a kernel");
        let set = add(&[third], Some(&[DEFAULT]), &memset(dev, 4096, 1)).expect("a memset node");
        let call_back = add(&[set], None, &host(Some(host_fn))).expect("a host node");
        // Copies: the memset's bytes to a second buffer (cuGraphAddNode), host bytes to a third
        // (cuGraphAddMemcpyNode).
        let copy = add(&[set], Some(&[DEFAULT]), &memcpy(copy3d(dev, None, dev2, 4096, 1))).expect("a d2d memcpy node");
        type AddCopy = unsafe extern "C" fn(*mut Handle, Handle, *const Handle, usize, *const Copy3d, Handle) -> u32;
        let (mut upload, up) = (std::ptr::null_mut(), copy3d(0, Some(&pattern), dev3, 256, 4));
        assert_eq!(call!(cu, cuGraphAddMemcpyNode(&mut upload, g, &copy, 1, &up, ctx) as AddCopy), SUCCESS);
        let mut t = -1;
        assert_eq!(call!(cu, cuGraphNodeGetType(upload, &mut t) as fn(Handle, *mut i32)), SUCCESS);
        assert_eq!(t, 1, "a memcpy node");
        assert_eq!(call!(cu, cuGraphNodeGetType(second, &mut t) as fn(Handle, *mut i32)), SUCCESS);
        assert_eq!(t, 0, "a kernel node");
        assert_eq!(call!(cu, cuGraphNodeGetType(set, &mut t) as fn(Handle, *mut i32)), SUCCESS);
        assert_eq!(t, 2, "a memset node");
        assert_eq!(call!(cu, cuGraphNodeGetType(call_back, &mut t) as fn(Handle, *mut i32)), SUCCESS);
        assert_eq!(t, 3, "a host node");

        // What cuda.h rules out: INVALID_VALUE, nothing added.
        let refused: [(&str, Handle, Edge, sys::CUgraphNodeParams); 8] = [
            ("a programmatic edge from a memset node", set, PROGRAMMATIC, kernel(f)),
            ("a programmatic edge to a memset node", third, PROGRAMMATIC, memset(dev, 64, 1)),
            ("a downstream port", third, Edge([0, 1, 0, 0, 0, 0, 0, 0]), kernel(f)),
            ("a reserved byte set", third, Edge([0, 0, 0, 0, 0, 0, 0, 1]), kernel(f)),
            ("the programmatic port on an ordinary edge", third, Edge([1, 0, 0, 0, 0, 0, 0, 0]), kernel(f)),
            ("a programmatic edge from the default port", third, Edge([0, 0, 1, 0, 0, 0, 0, 0]), kernel(f)),
            ("an upstream port past the three", third, Edge([3, 0, 1, 0, 0, 0, 0, 0]), kernel(f)),
            ("a dependency type past the two", third, Edge([1, 0, 2, 0, 0, 0, 0, 0]), kernel(f)),
        ];
        for (what, dep, edge, p) in &refused {
            assert_eq!(add(&[*dep], Some(&[*edge]), p), Err(INVALID_VALUE), "{what}");
        }
        assert_eq!(
            add(&[], None, &kernel(std::ptr::null_mut())),
            Err(INVALID_VALUE),
            "a kernel node without a function"
        );
        assert_eq!(add(&[], None, &memset(dev, 4096, 3)), Err(INVALID_VALUE), "a 3-byte element");
        assert_eq!(add(&[], None, &host(None)), Err(INVALID_VALUE), "a host node without a function");
        let mut strided = copy3d(dev, None, dev2, 1024, 2);
        strided.dst.pitch = 8192;
        assert_eq!(add(&[], None, &memcpy(strided)), Err(NOT_SUPPORTED), "a strided copy");
        let mut array = copy3d(dev, None, dev2, 64, 1);
        array.src.ty = ARRAY;
        assert_eq!(add(&[], None, &memcpy(array)), Err(NOT_SUPPORTED), "a copy from a CUDA array");
        let mut bad = copy3d(dev, None, dev2, 64, 1);
        bad.src.ty = 5;
        assert_eq!(add(&[], None, &memcpy(bad)), Err(INVALID_VALUE), "a memory type past the enum");
        assert_eq!(add(&[], None, &memcpy(copy3d(dev, None, dev2, 0, 1))), Err(INVALID_VALUE), "nothing to copy");
        let mut n = 0usize;
        assert_eq!(
            call!(cu, cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) as fn(Handle, *mut Handle, *mut usize)),
            SUCCESS
        );
        assert_eq!(n, 7, "only the seven good nodes were added");

        // The graph runs: the memset writes its bytes, the host function is called.
        let mut exec = std::ptr::null_mut();
        assert_eq!(call!(cu, cuGraphInstantiateWithFlags(&mut exec, g, 0) as fn(*mut Handle, Handle, u64)), SUCCESS);
        assert_eq!(call!(cu, cuGraphLaunch(exec, std::ptr::null_mut()) as fn(Handle, Handle)), SUCCESS);
        assert_eq!(call!(cu, cuCtxSynchronize() as fn()), SUCCESS);
        assert_eq!(HOST_CALLS.load(Ordering::SeqCst), 5, "the host node ran with its data");
        let mut back = vec![0u8; 4096];
        let rc = call!(cu, cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), dev, 4096) as fn(*mut c_void, u64, usize));
        assert_eq!(rc, SUCCESS);
        assert!(back.iter().all(|&b| b == 0xab), "the memset node wrote its bytes");
        let rc = call!(cu, cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), dev2, 4096) as fn(*mut c_void, u64, usize));
        assert_eq!(rc, SUCCESS);
        assert!(back.iter().all(|&b| b == 0xab), "the d2d memcpy node copied them");
        let rc = call!(cu, cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), dev3, 1024) as fn(*mut c_void, u64, usize));
        assert_eq!(rc, SUCCESS);
        assert_eq!(back[..1024], pattern[..], "the host-to-device memcpy node copied four packed rows");
    });
}
