//! Stream capture and graphs. A capturing stream records what is queued on it (kernels, copies,
//! memsets, host functions) as nodes of a graph instead of running it; an instantiated graph
//! replays its nodes on a stream, in the order they were added (an order that respects every
//! dependency, since a node can only depend on nodes added before it).
//!
//! Child graph nodes embed a graph: `cuGraphAddChildGraphNode` (and `cuGraphAddNode` with
//! `CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE`) clone it, and refuse one with memory nodes;
//! `cuGraphAddNode` with `CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE` moves it in, memory nodes and all,
//! after which it cannot be instantiated, destroyed or embedded on its own. An embedded graph
//! takes no new memory nodes. Instantiation replays an embedded graph's nodes in its node's place.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex};

use tessera_abi::cuda_exports;
use tessera_sim_model::Node;

use super::errors::{Cu, poll_faults};
use super::graph_nodes;
use super::handles::{self, graph};
use super::init::driver;
use super::module::Func;
use super::stream::{HostCall, Target, enqueue_host, resolve, resolve_with};
use super::{CUresult, ILLEGAL_STATE, INVALID_VALUE, R, get, need, put, put_opt, run, sys};

/// One unit of queued work, as run on a stream or recorded in a graph.
#[derive(Clone)]
pub(crate) enum Op {
    Kernel {
        func: Arc<Func>,
    },
    Memcpy {
        dst: u64,
        src: u64,
        n: u64,
    },
    Memset(super::copy::Memset),
    Host {
        f: unsafe extern "C" fn(*mut c_void),
        data: usize,
    },
    Empty,
    /// A graph allocation at its reserved address, on device `dev` ([`super::graph_mem`]).
    MemAlloc {
        base: u64,
        bytes: u64,
        dev: c_int,
    },
    MemFree {
        base: u64,
    },
    /// A child graph node: the embedded graph's handle (owned by the node's graph).
    Child {
        graph: usize,
    },
}

impl Op {
    /// `CUgraphNodeType`.
    pub(crate) fn node_type(&self) -> c_int {
        match self {
            Op::Kernel { .. } => 0,
            Op::Memcpy { .. } => 1,
            Op::Memset(_) => 2,
            Op::Host { .. } => 3,
            Op::Empty => 5,
            Op::Child { .. } => 4,
            Op::MemAlloc { .. } => 10,
            Op::MemFree { .. } => 11,
        }
    }
}

/// Runs one unit of work on a stream that is not capturing.
pub(crate) fn run_op(node: &'static Node, t: &Target, op: &Op) -> R {
    match op {
        Op::Kernel { func } => node.launch(t.sid, func.duration_ns).work().map(|_| ()),
        // SAFETY: the addresses were given by the caller when the copy was captured, and are
        // valid when the graph is launched by the CUDA API contract.
        Op::Memcpy { dst, src, n } => unsafe { super::copy::copy_now(*dst, *src, *n) },
        Op::Memset(m) => super::copy::memset_now(*m),
        Op::Host { f, data } => enqueue_host(node, t.sid, HostCall::Func(*f, *data)),
        Op::Empty => Ok(()),
        Op::MemAlloc { base, bytes, dev } => super::graph_mem::allocate(node, *dev, *base, *bytes),
        Op::MemFree { base } => super::graph_mem::free(*base),
        // Instantiation replaces a child graph node with its graph's nodes.
        Op::Child { .. } => Err(ILLEGAL_STATE),
    }
}

/// Queues work on a stream: recorded if the stream is capturing, run otherwise.
pub(crate) fn submit(node: &'static Node, t: &Target, op: Op) -> R {
    match t.capture() {
        Some(c) => c.add(op),
        None => run_op(node, t, &op),
    }
}

pub(crate) struct GNode {
    pub handle: usize,
    pub graph: usize,
    pub op: Op,
}

pub(crate) struct Graph {
    pub handle: usize,
    pub nodes: Mutex<Vec<Arc<GNode>>>,
    /// The graph whose child graph node embeds this one (0: none).
    owner: AtomicUsize,
    /// Moved in by its owner (`CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE`), not cloned.
    moved: AtomicBool,
}

/// Child graphs nested deeper than this are refused (the driver's own limit is not documented;
/// this one is well past what libtessera.so follows, so that its own refusal can be seen).
const MAX_DEPTH: usize = 128;

impl Graph {
    fn new() -> Arc<Graph> {
        let g = Arc::new(Graph {
            handle: handles::new_handle(),
            nodes: Mutex::new(Vec::new()),
            owner: AtomicUsize::new(0),
            moved: AtomicBool::new(false),
        });
        handles::write().graphs.insert(g.handle, g.clone());
        g
    }

    fn embedded(&self) -> bool {
        self.owner.load(Acquire) != 0
    }

    fn nodes(&self) -> std::sync::MutexGuard<'_, Vec<Arc<GNode>>> {
        self.nodes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a node depending on `deps` (which must be nodes of this graph).
    fn add(&self, op: Op, deps: Vec<usize>) -> R<usize> {
        if matches!(op, Op::MemAlloc { .. } | Op::MemFree { .. }) && self.embedded() {
            // An embedded graph takes no new memory nodes.
            return Err(INVALID_VALUE);
        }
        let mut reg = handles::write();
        if deps.iter().any(|d| reg.gnodes.get(d).is_none_or(|n| n.graph != self.handle)) {
            return Err(INVALID_VALUE);
        }
        let n = Arc::new(GNode { handle: handles::new_handle(), graph: self.handle, op });
        reg.gnodes.insert(n.handle, n.clone());
        let h = n.handle;
        self.nodes().push(n);
        Ok(h)
    }
}

/// An instantiated graph: its work, in order.
pub(crate) struct Exec {
    pub handle: usize,
    /// The graph it was instantiated from.
    pub graph: usize,
    /// `CUDA_GRAPH_INSTANTIATE_FLAG_*`.
    pub flags: u64,
    pub ops: Vec<Op>,
}

impl Exec {
    /// Whether it has memory nodes (then its graph has at most one executable graph at a time).
    fn has_memory_nodes(&self) -> bool {
        self.ops.iter().any(|op| matches!(op, Op::MemAlloc { .. } | Op::MemFree { .. }))
    }
}

static NEXT_CAPTURE: AtomicU64 = AtomicU64::new(1);

/// A capture sequence: the graph being built and the streams taking part.
pub(crate) struct Capture {
    pub id: u64,
    pub graph: Arc<Graph>,
    /// The stream the capture began on (only it may end it).
    pub origin: usize,
    invalidated: AtomicBool,
    joined: Mutex<Vec<usize>>,
    /// The last node added: what the next one depends on (its address is handed to C as the
    /// capture's dependency array).
    last: Box<AtomicUsize>,
}

impl Capture {
    /// Ends the capture in error (a forbidden call was made on a capturing stream).
    pub(crate) fn invalidate(&self) {
        self.invalidated.store(true, Release);
    }

    /// Another stream joins the capture (it waited on an event recorded in it).
    pub(crate) fn join(&self, stream: usize) {
        self.joined.lock().unwrap_or_else(|e| e.into_inner()).push(stream);
    }

    /// Records a unit of work as the capture's next node.
    pub(crate) fn add(&self, op: Op) -> R {
        if self.invalidated.load(Acquire) {
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        let deps = match self.last.load(Acquire) {
            0 => Vec::new(),
            h => vec![h],
        };
        let h = self.graph.add(op, deps)?;
        self.last.store(h, Release);
        Ok(())
    }
}

thread_local! {
    /// `cuThreadExchangeStreamCaptureMode`'s per-thread mode.
    static CAPTURE_MODE: Cell<c_uint> = const { Cell::new(0) };
}

// ---- Capture exports ------------------------------------------------------------------------

fn begin_capture(h: sys::CUstream, mode: c_uint, pt: bool) -> R {
    if mode > 2 {
        return Err(INVALID_VALUE);
    }
    let node = driver()?.node;
    poll_faults(node)?;
    let t = resolve(&handles::read(), node, h, pt)?;
    t.ctx.check(node)?;
    // The default streams cannot be captured here (the legacy one cannot be captured at all).
    let s = t.stream.ok_or(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)?;
    if s.capture().is_some() {
        return Err(ILLEGAL_STATE);
    }
    let c = Arc::new(Capture {
        id: NEXT_CAPTURE.fetch_add(1, Relaxed),
        graph: Graph::new(),
        origin: s.handle,
        invalidated: AtomicBool::new(false),
        joined: Mutex::new(Vec::new()),
        last: Box::new(AtomicUsize::new(0)),
    });
    s.set_capture(Some(c));
    Ok(())
}

cuda_exports! {
    fn cuStreamBeginCapture(hStream) twin cuStreamBeginCapture_ptsz(per_thread) {
        run(|| begin_capture(hStream, 0, per_thread))
    }

    fn cuStreamBeginCapture_v2(hStream, mode) twin cuStreamBeginCapture_v2_ptsz(per_thread) {
        run(|| begin_capture(hStream, mode, per_thread))
    }
}

fn end_capture(h: sys::CUstream, ph: *mut sys::CUgraph, pt: bool) -> R {
    need(ph)?;
    let node = driver()?.node;
    let t = resolve(&handles::read(), node, h, pt)?;
    let s = t.stream.ok_or(ILLEGAL_STATE)?;
    let c = s.capture().ok_or(ILLEGAL_STATE)?;
    if c.origin != s.handle {
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    }
    s.set_capture(None);
    let joined = std::mem::take(&mut *c.joined.lock().unwrap_or_else(|e| e.into_inner()));
    {
        let reg = handles::read();
        for j in joined {
            if let Some(js) = reg.streams.get(&j)
                && js.capture().is_some_and(|jc| Arc::ptr_eq(&jc, &c))
            {
                js.set_capture(None);
            }
        }
    }
    if c.invalidated.load(Acquire) {
        destroy_graph(c.graph.handle);
        // SAFETY: ph is the caller's out-pointer (checked above).
        unsafe { put(ph, std::ptr::null_mut()) }?;
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    // SAFETY: ph is the caller's out-pointer (checked above).
    unsafe { put(ph, handles::as_ptr(c.graph.handle)) }
}

cuda_exports! {
    fn cuStreamEndCapture(hStream, phGraph) twin cuStreamEndCapture_ptsz(per_thread) {
        run(|| end_capture(hStream, phGraph, per_thread))
    }
}

/// `CUstreamCaptureStatus` of a stream, and its capture.
fn capture_status(h: sys::CUstream, pt: bool) -> R<(c_uint, Option<Arc<Capture>>)> {
    let node = driver()?.node;
    let t = resolve(&handles::read(), node, h, pt)?;
    Ok(match t.capture() {
        None => (0, None),
        Some(c) if c.invalidated.load(Acquire) => (2, Some(c)),
        Some(c) => (1, Some(c)),
    })
}

fn is_capturing(h: sys::CUstream, status: *mut c_uint, pt: bool) -> R {
    need(status)?;
    let (st, _) = capture_status(h, pt)?;
    // SAFETY: status is the caller's out-pointer (checked above).
    unsafe { put(status, st) }
}

cuda_exports! {
    fn cuStreamIsCapturing(hStream, captureStatus) twin cuStreamIsCapturing_ptsz(per_thread) {
        run(|| is_capturing(hStream, captureStatus, per_thread))
    }
}

/// The capture info queries: status, and (while capturing) id, graph and dependencies.
#[allow(clippy::too_many_arguments)]
fn capture_info(
    h: sys::CUstream,
    status: *mut c_uint,
    id: *mut c_ulonglong,
    graph: *mut sys::CUgraph,
    deps: *mut *const sys::CUgraphNode,
    edges: *mut *const c_void,
    num: *mut usize,
    pt: bool,
) -> R {
    need(status)?;
    let (st, c) = capture_status(h, pt)?;
    // SAFETY: status is checked above; the others are the caller's optional out-pointers.
    unsafe {
        put(status, st)?;
        if let Some(c) = c.filter(|_| st == 1) {
            let last = c.last.load(Acquire);
            put_opt(id, c.id)?;
            put_opt(graph, handles::as_ptr(c.graph.handle))?;
            put_opt(deps, if last == 0 { std::ptr::null() } else { (&*c.last as *const AtomicUsize).cast() })?;
            put_opt(edges, std::ptr::null())?;
            put_opt(num, usize::from(last != 0))?;
        }
    }
    Ok(())
}

cuda_exports! {
    fn cuStreamGetCaptureInfo(hStream, captureStatus_out, id_out) twin cuStreamGetCaptureInfo_ptsz(per_thread) {
        let n = std::ptr::null_mut();
        run(|| capture_info(hStream, captureStatus_out, id_out, n, n.cast(), n.cast(), n.cast(), per_thread))
    }

    fn cuStreamGetCaptureInfo_v2(hStream, captureStatus_out, id_out, graph_out, dependencies_out, numDependencies_out) twin cuStreamGetCaptureInfo_v2_ptsz(per_thread) {
        let n = std::ptr::null_mut();
        run(|| capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out, n, numDependencies_out, per_thread))
    }

    fn cuStreamGetCaptureInfo_v3(hStream, captureStatus_out, id_out, graph_out, dependencies_out, edgeData_out, numDependencies_out) twin cuStreamGetCaptureInfo_v3_ptsz(per_thread) {
        run(|| {
            capture_info(
                hStream,
                captureStatus_out,
                id_out,
                graph_out,
                dependencies_out,
                edgeData_out.cast(),
                numDependencies_out,
                per_thread,
            )
        })
    }

    fn cuThreadExchangeStreamCaptureMode(mode) {
        run(|| {
            driver()?;
            // SAFETY: mode is the caller's in/out pointer.
            let m = unsafe { get(mode.cast_const()) }?;
            if m > 2 {
                return Err(INVALID_VALUE);
            }
            let old = CAPTURE_MODE.with(|c| c.replace(m));
            // SAFETY: as above.
            unsafe { put(mode, old) }
        })
    }
}

// ---- Graph exports --------------------------------------------------------------------------

cuda_exports! {
    fn cuGraphCreate(phGraph, flags) {
        run(|| {
            need(phGraph)?;
            driver()?;
            if flags != 0 {
                return Err(INVALID_VALUE);
            }
            let g = Graph::new();
            // SAFETY: phGraph is the caller's out-pointer (checked above).
            unsafe { put(phGraph, handles::as_ptr(g.handle)) }
        })
    }
}

/// Destroys a graph and the graphs its child graph nodes embed.
fn destroy_graph(h: usize) {
    let mut reg = handles::write();
    let mut doomed = vec![h];
    while let Some(h) = doomed.pop() {
        if let Some(g) = reg.graphs.remove(&h) {
            doomed.extend(g.nodes().iter().filter_map(|n| match n.op {
                Op::Child { graph } => Some(graph),
                _ => None,
            }));
            reg.gnodes.retain(|_, n| n.graph != h);
        }
    }
}

cuda_exports! {
    fn cuGraphDestroy(hGraph) {
        run(|| {
            // An embedded graph belongs to its node: it goes with the graph that holds it.
            if graph(hGraph)?.embedded() {
                return Err(INVALID_VALUE);
            }
            destroy_graph(hGraph as usize);
            Ok(())
        })
    }
}

/// A graph a child graph node embeds.
fn embedded_graph(h: usize) -> R<Arc<Graph>> {
    handles::read().graphs.get(&h).cloned().ok_or(INVALID_VALUE)
}

/// Whether `g` or a graph it embeds has memory nodes.
fn has_memory_nodes(g: &Graph, depth: usize) -> R<bool> {
    if depth > MAX_DEPTH {
        return Err(INVALID_VALUE);
    }
    // A snapshot, so that no graph's node lock is held while the registry is read.
    let ops: Vec<Op> = g.nodes().iter().map(|n| n.op.clone()).collect();
    for op in ops {
        match op {
            Op::MemAlloc { .. } | Op::MemFree { .. } => return Ok(true),
            Op::Child { graph: c } if has_memory_nodes(&*embedded_graph(c)?, depth + 1)? => return Ok(true),
            _ => {}
        }
    }
    Ok(false)
}

/// A copy of `g` (and of the graphs it embeds) embedded in `owner`.
fn clone_graph(g: &Graph, owner: usize, depth: usize) -> R<Arc<Graph>> {
    if depth > MAX_DEPTH {
        return Err(INVALID_VALUE);
    }
    let copy = Graph::new();
    copy.owner.store(owner, Release);
    let ops: Vec<Op> = g.nodes().iter().map(|n| n.op.clone()).collect();
    let filled = ops.into_iter().try_for_each(|op| {
        let op = match op {
            Op::Child { graph: c } => {
                Op::Child { graph: clone_graph(&*embedded_graph(c)?, copy.handle, depth + 1)?.handle }
            }
            op => op,
        };
        // Without edges: the copy keeps its nodes' order, which is what replay follows. (A clone
        // holds no memory nodes, which an embedded graph would refuse.)
        copy.add(op, Vec::new()).map(|_| ())
    });
    if let Err(e) = filled {
        // Nothing half-made stays behind: the copy and what it embeds so far go.
        destroy_graph(copy.handle);
        return Err(e);
    }
    Ok(copy)
}

/// The work of `g`, child graph nodes replaced by their graphs' work.
fn flatten(g: &Graph, depth: usize, out: &mut Vec<Op>) -> R {
    if depth > MAX_DEPTH {
        return Err(INVALID_VALUE);
    }
    let ops: Vec<Op> = g.nodes().iter().map(|n| n.op.clone()).collect();
    for op in ops {
        match op {
            Op::Child { graph: c } => flatten(&*embedded_graph(c)?, depth + 1, out)?,
            op => out.push(op),
        }
    }
    Ok(())
}

/// Adds a child graph node embedding `child` into `parent`: cloned, or moved in.
///
/// # Safety
/// As [`add_node`].
unsafe fn add_child(
    ph: *mut sys::CUgraphNode,
    parent: sys::CUgraph,
    deps: *const sys::CUgraphNode,
    n: usize,
    child: sys::CUgraph,
    moved: bool,
) -> R {
    let (p, c) = (graph(parent)?, graph(child)?);
    if c.embedded() {
        return Err(INVALID_VALUE);
    }
    let embedded = if moved {
        // Not into itself, nor into a graph it already embeds.
        let mut up = p.handle;
        while up != 0 {
            if up == c.handle {
                return Err(INVALID_VALUE);
            }
            up = handles::read().graphs.get(&up).map_or(0, |g| g.owner.load(Acquire));
        }
        c.owner.store(p.handle, Release);
        c.moved.store(true, Release);
        c
    } else {
        // A cloned child may not hold memory nodes.
        if has_memory_nodes(&c, 1)? {
            return Err(INVALID_VALUE);
        }
        clone_graph(&c, p.handle, 1)?
    };
    let h = embedded.handle;
    // SAFETY: as this function's contract.
    let r = unsafe { add_node(ph, parent, deps, n, Op::Child { graph: h }) };
    if r.is_err() {
        if moved {
            embedded.owner.store(0, Release);
            embedded.moved.store(false, Release);
        } else {
            destroy_graph(h);
        }
    }
    r
}

cuda_exports! {
    fn cuGraphAddChildGraphNode(phGraphNode, hGraph, dependencies, numDependencies, childGraph) {
        // SAFETY: the caller's out-pointer and dependency array.
        run(|| unsafe { add_child(phGraphNode, hGraph, dependencies, numDependencies, childGraph, false) })
    }
}

/// `CUgraphNodeParams`: the node type, then (at byte 16) the union of per-type parameters. Of
/// the types only these are modelled here: an empty node, and a child graph node
/// (`CUDA_CHILD_GRAPH_NODE_PARAMS`: the graph, then its ownership, the latter from CUDA 12.9's
/// header; the 12.8 bindings stop at the graph).
#[repr(C)]
struct NodeParamsHead {
    type_: c_int,
    _reserved0: [c_int; 3],
    child_graph: sys::CUgraph,
    child_ownership: c_uint,
}
const _: () = assert!(std::mem::offset_of!(NodeParamsHead, child_graph) == 16);
const _: () = assert!(std::mem::size_of::<NodeParamsHead>() <= std::mem::size_of::<sys::CUgraphNodeParams>());

/// `cuGraphAddNode`: kernel, memcpy, memset and host nodes ([`super::graph_nodes`]), empty and
/// child graph nodes; other types answer `CUDA_ERROR_NOT_SUPPORTED`.
///
/// # Safety
/// As [`add_node`]; `params` null or a `CUgraphNodeParams`.
unsafe fn add_generic(
    ph: *mut sys::CUgraphNode,
    g: sys::CUgraph,
    deps: *const sys::CUgraphNode,
    n: usize,
    params: *const sys::CUgraphNodeParams,
) -> R {
    need(params)?;
    driver()?;
    // SAFETY: params points at a whole CUgraphNodeParams (checked non-null and aligned), whose
    // first bytes NodeParamsHead lays out; every field is valid for any bits.
    let head = unsafe { std::ptr::read(params.cast::<NodeParamsHead>()) };
    match head.type_ {
        // SAFETY: as this function's contract.
        5 => unsafe { add_node(ph, g, deps, n, Op::Empty) },
        t @ (graph_nodes::KERNEL | graph_nodes::MEMCPY | graph_nodes::MEMSET | graph_nodes::HOST) => {
            // SAFETY: params is a whole CUgraphNodeParams (checked non-null and aligned).
            let op = unsafe { graph_nodes::op(t, params) }?;
            // SAFETY: as this function's contract.
            unsafe { add_node(ph, g, deps, n, op) }
        }
        4 => match head.child_ownership {
            // SAFETY: as this function's contract.
            0 => unsafe { add_child(ph, g, deps, n, head.child_graph, false) },
            // SAFETY: as above.
            1 => unsafe { add_child(ph, g, deps, n, head.child_graph, true) },
            _ => Err(INVALID_VALUE),
        },
        t if (0..=13).contains(&t) => Err(CUresult::CUDA_ERROR_NOT_SUPPORTED),
        _ => Err(INVALID_VALUE),
    }
}

cuda_exports! {
    fn cuGraphAddNode(phGraphNode, hGraph, dependencies, numDependencies, nodeParams) {
        // SAFETY: the caller's pointers, per the API contract.
        run(|| unsafe { add_generic(phGraphNode, hGraph, dependencies, numDependencies, nodeParams) })
    }

    /// `cuGraphAddNode_v2` (CUDA 12.3): edge data beside the dependencies, checked
    /// ([`graph_nodes::check_edges`]).
    fn cuGraphAddNode_v2(phGraphNode, hGraph, dependencies, dependencyData, numDependencies, nodeParams) {
        run(|| {
            need(nodeParams)?;
            driver()?;
            // SAFETY: nodeParams is a CUgraphNodeParams (checked non-null and aligned), whose first
            // field is its type, read as the raw integer.
            let downstream = unsafe { nodeParams.cast::<c_int>().read() };
            // SAFETY: the caller's pointers, per the API contract.
            unsafe {
                graph_nodes::check_edges(dependencies, dependencyData, numDependencies, downstream)?;
                add_generic(phGraphNode, hGraph, dependencies, numDependencies, nodeParams)
            }
        })
    }

    fn cuGraphChildGraphNodeGetGraph(hNode, phGraph) {
        run(|| {
            need(phGraph)?;
            driver()?;
            let op = handles::read().gnodes.get(&(hNode as usize)).map(|n| n.op.clone()).ok_or(INVALID_VALUE)?;
            let Op::Child { graph } = op else { return Err(INVALID_VALUE) };
            // SAFETY: phGraph is the caller's out-pointer (checked above).
            unsafe { put(phGraph, handles::as_ptr(graph)) }
        })
    }
}

/// Reads a node's dependency list.
///
/// # Safety
/// `deps` must be null or hold `n` node handles.
unsafe fn read_deps(deps: *const sys::CUgraphNode, n: usize) -> R<Vec<usize>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    need(deps)?;
    // SAFETY: deps holds n handles by this function's contract (checked non-null and aligned).
    Ok(unsafe { std::slice::from_raw_parts(deps, n) }.iter().map(|&d| d as usize).collect())
}

/// Adds a node to a graph and writes its handle.
///
/// # Safety
/// `ph` must be null or a valid out-pointer; `deps` as in [`read_deps`].
pub(crate) unsafe fn add_node(
    ph: *mut sys::CUgraphNode,
    g: sys::CUgraph,
    deps: *const sys::CUgraphNode,
    n: usize,
    op: Op,
) -> R {
    need(ph)?;
    let g = graph(g)?;
    // SAFETY: as this function's contract.
    let deps = unsafe { read_deps(deps, n) }?;
    let h = g.add(op, deps)?;
    // SAFETY: ph is the caller's out-pointer (checked above).
    unsafe { put(ph, handles::as_ptr(h)) }
}

cuda_exports! {
    /// `cuGraphAddKernelNode` (CUDA 10.0 parameters, without `kern` and `ctx`).
    fn cuGraphAddKernelNode(phGraphNode, hGraph, dependencies, numDependencies, nodeParams) {
        run(|| {
            // SAFETY: nodeParams is the caller's struct (null/misaligned checked by get).
            let p = unsafe { get(nodeParams) }?;
            let op = graph_nodes::kernel(p.func, std::ptr::null_mut())?;
            // SAFETY: the caller's out-pointer and dependency array.
            unsafe { add_node(phGraphNode, hGraph, dependencies, numDependencies, op) }
        })
    }

    fn cuGraphAddKernelNode_v2(phGraphNode, hGraph, dependencies, numDependencies, nodeParams) {
        run(|| {
            // SAFETY: nodeParams is the caller's struct (null/misaligned checked by get).
            let p = unsafe { get(nodeParams) }?;
            let op = graph_nodes::kernel(p.func, p.kern)?;
            // SAFETY: the caller's out-pointer and dependency array.
            unsafe { add_node(phGraphNode, hGraph, dependencies, numDependencies, op) }
        })
    }

    fn cuGraphAddEmptyNode(phGraphNode, hGraph, dependencies, numDependencies) {
        // SAFETY: the caller's out-pointer and dependency array.
        run(|| unsafe { add_node(phGraphNode, hGraph, dependencies, numDependencies, Op::Empty) })
    }

    fn cuGraphAddHostNode(phGraphNode, hGraph, dependencies, numDependencies, nodeParams) {
        run(|| {
            // SAFETY: nodeParams is the caller's struct (null/misaligned checked by get).
            let p = unsafe { get(nodeParams) }?;
            let op = graph_nodes::host(p.fn_, p.userData)?;
            // SAFETY: the caller's out-pointer and dependency array.
            unsafe { add_node(phGraphNode, hGraph, dependencies, numDependencies, op) }
        })
    }

    fn cuGraphAddMemcpyNode(phGraphNode, hGraph, dependencies, numDependencies, copyParams, _ctx) {
        run(|| {
            need(copyParams)?;
            // SAFETY: copyParams is the caller's CUDA_MEMCPY3D (checked non-null and aligned),
            // which Memcpy3d mirrors with raw integers for its enums.
            let p = unsafe { copyParams.cast::<graph_nodes::Memcpy3d>().read() };
            let op = graph_nodes::memcpy(&p)?;
            // SAFETY: the caller's out-pointer and dependency array.
            unsafe { add_node(phGraphNode, hGraph, dependencies, numDependencies, op) }
        })
    }

    fn cuGraphAddMemsetNode(phGraphNode, hGraph, dependencies, numDependencies, memsetParams, _ctx) {
        run(|| {
            // SAFETY: memsetParams is the caller's struct (null/misaligned checked by get).
            let p = unsafe { get(memsetParams) }?;
            let op = graph_nodes::memset(p.dst, p.pitch, p.value, p.elementSize, p.width, p.height)?;
            // SAFETY: the caller's out-pointer and dependency array.
            unsafe { add_node(phGraphNode, hGraph, dependencies, numDependencies, op) }
        })
    }

    fn cuGraphGetNodes(hGraph, nodes, numNodes) {
        run(|| {
            need(numNodes)?;
            let g = graph(hGraph)?;
            let list: Vec<usize> = g.nodes().iter().map(|n| n.handle).collect();
            if nodes.is_null() {
                // SAFETY: numNodes is the caller's out-pointer (checked above).
                return unsafe { put(numNodes, list.len()) };
            }
            // SAFETY: numNodes is the caller's in/out pointer (checked above).
            let cap = unsafe { get(numNodes.cast_const()) }?;
            for i in 0..cap {
                let v = list.get(i).copied().unwrap_or(0);
                // SAFETY: nodes holds *numNodes entries by the caller's contract.
                unsafe { put(nodes.add(i), handles::as_ptr(v)) }?;
            }
            // SAFETY: as above.
            unsafe { put(numNodes, list.len().min(cap)) }
        })
    }

    fn cuGraphNodeGetType(hNode, type_) {
        run(|| {
            need(type_)?;
            driver()?;
            let t = handles::read().gnodes.get(&(hNode as usize)).map(|n| n.op.node_type()).ok_or(INVALID_VALUE)?;
            // SAFETY: type_ is the caller's out-pointer (checked above).
            unsafe { put(type_, t) }
        })
    }
}

/// `CUDA_GRAPH_INSTANTIATE_FLAG_*`: AUTO_FREE_ON_LAUNCH, UPLOAD, DEVICE_LAUNCH, USE_NODE_PRIORITY.
const AUTO_FREE_ON_LAUNCH: u64 = 0x1;
const DEVICE_LAUNCH: u64 = 0x4;
const INSTANTIATE_FLAGS: u64 = AUTO_FREE_ON_LAUNCH | 0x2 | DEVICE_LAUNCH | 0x8;

fn instantiate(ph: *mut sys::CUgraphExec, g: sys::CUgraph, flags: u64) -> R {
    need(ph)?;
    if flags & !INSTANTIATE_FLAGS != 0
        || flags & (AUTO_FREE_ON_LAUNCH | DEVICE_LAUNCH) == AUTO_FREE_ON_LAUNCH | DEVICE_LAUNCH
    {
        return Err(INVALID_VALUE);
    }
    let g = graph(g)?;
    // A graph moved into another is instantiated with it, not by itself.
    if g.moved.load(Acquire) {
        return Err(INVALID_VALUE);
    }
    let mut ops = Vec::new();
    flatten(&g, 0, &mut ops)?;
    let e = Arc::new(Exec { handle: handles::new_handle(), graph: g.handle, flags, ops });
    let h = e.handle;
    {
        let mut reg = handles::write();
        // A graph with memory nodes has at most one executable graph at a time.
        if e.has_memory_nodes() && reg.execs.values().any(|x| x.graph == g.handle && x.has_memory_nodes()) {
            return Err(INVALID_VALUE);
        }
        reg.execs.insert(h, e);
    }
    // SAFETY: ph is the caller's out-pointer (checked above).
    unsafe { put(ph, handles::as_ptr(h)) }
}

cuda_exports! {
    fn cuGraphInstantiateWithFlags(phGraphExec, hGraph, flags) {
        run(|| instantiate(phGraphExec, hGraph, flags))
    }
}

/// `cuGraphInstantiate` of CUDA 10/11: an error node and a log buffer, both left empty.
fn instantiate_with_log(
    ph: *mut sys::CUgraphExec,
    g: sys::CUgraph,
    err_node: *mut sys::CUgraphNode,
    log: *mut c_char,
    size: usize,
) -> R {
    // SAFETY: err_node is the caller's optional out-pointer.
    unsafe { put_opt(err_node, std::ptr::null_mut()) }?;
    if !log.is_null() && size > 0 {
        // SAFETY: log holds `size` bytes by the caller's contract.
        unsafe { *log = 0 };
    }
    instantiate(ph, g, 0)
}

cuda_exports! {
    fn cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize) also cuGraphInstantiate_v2 {
        run(|| instantiate_with_log(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize))
    }
}

fn instantiate_with_params(
    ph: *mut sys::CUgraphExec,
    g: sys::CUgraph,
    params: *mut sys::CUDA_GRAPH_INSTANTIATE_PARAMS,
) -> R {
    need(params)?;
    // SAFETY: params is the caller's struct (checked above); `flags` is a plain integer.
    let flags = unsafe { std::ptr::addr_of!((*params).flags).read() };
    let r = instantiate(ph, g, flags);
    // SAFETY: as above; result_out and hErrNode_out are written with valid values.
    unsafe {
        std::ptr::addr_of_mut!((*params).hErrNode_out).write(std::ptr::null_mut());
        std::ptr::addr_of_mut!((*params).result_out).cast::<u32>().write(if r.is_ok() { 0 } else { 1 });
    }
    r
}

cuda_exports! {
    fn cuGraphInstantiateWithParams(phGraphExec, hGraph, instantiateParams) also cuGraphInstantiateWithParams_ptsz {
        run(|| instantiate_with_params(phGraphExec, hGraph, instantiateParams))
    }

    fn cuGraphExecDestroy(hGraphExec) {
        run(|| {
            driver()?;
            handles::write().execs.remove(&(hGraphExec as usize)).map(|_| ()).ok_or(INVALID_VALUE)
        })
    }
}

/// `cuGraphLaunch`: every node's work is queued on the stream, in order (recorded, if the stream
/// is itself capturing).
fn launch(exec: sys::CUgraphExec, h: sys::CUstream, pt: bool) -> R {
    let (node, e, t) = resolve_with(h, pt, |reg| reg.execs.get(&(exec as usize)).cloned().ok_or(INVALID_VALUE))?;
    if t.capture().is_some() {
        for op in &e.ops {
            submit(node, &t, op.clone())?;
        }
        return Ok(());
    }
    if e.flags & AUTO_FREE_ON_LAUNCH != 0 {
        // The previous launch's allocations still live are freed first.
        for op in &e.ops {
            if let Op::MemAlloc { base, .. } = op
                && super::graph_mem::is_live(*base)
            {
                super::graph_mem::free(*base)?;
            }
        }
    }
    for (i, op) in e.ops.iter().enumerate() {
        if let Err(err) = run_op(node, &t, op) {
            // A launch that fails allocates nothing: what it allocated goes back to the pool.
            for done in &e.ops[..i] {
                if let Op::MemAlloc { base, .. } = done {
                    let _ = super::graph_mem::free(*base);
                }
            }
            return Err(err);
        }
    }
    Ok(())
}

cuda_exports! {
    fn cuGraphLaunch(hGraphExec, hStream) twin cuGraphLaunch_ptsz(per_thread) {
        run(|| launch(hGraphExec, hStream, per_thread))
    }
}

fn upload(exec: sys::CUgraphExec, h: sys::CUstream, pt: bool) -> R {
    let node = driver()?.node;
    let reg = handles::read();
    reg.execs.get(&(exec as usize)).ok_or(INVALID_VALUE)?;
    resolve(&reg, node, h, pt).map(|_| ())
}

cuda_exports! {
    fn cuGraphUpload(hGraphExec, hStream) twin cuGraphUpload_ptsz(per_thread) {
        run(|| upload(hGraphExec, hStream, per_thread))
    }
}
