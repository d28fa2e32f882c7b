//! Graph memory nodes under the limit: a graph's allocations are charged as the driver's graph
//! pool holds them (taken at launch, kept after a free until `cuDeviceGraphMemTrim`), a launch
//! that would pass the limit is refused before the driver sees it, nothing is counted twice, and
//! a killed process's graph memory is reaped.

mod common;

use std::ffi::c_int;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::cuda::*;
use common::*;
use tessera_region::Region;
use tessera_sim_model::Node;

const INVALID_VALUE: R = 1;
const NOT_SUPPORTED: R = 801;

/// Graph calls through whatever the dynamic linker hands the program (the shim's hooks).
struct G<'a>(&'a Session);

impl G<'_> {
    fn create(&self) -> H {
        let mut g: H = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        ck("cuGraphCreate", unsafe { (self.0.cu.cuGraphCreate)(&mut g, 0) });
        g
    }
    /// An allocation node of `bytes` on device `dev` after `deps`: (node, address).
    fn alloc(&self, g: H, deps: &[H], dev: c_int, bytes: u64) -> (H, u64) {
        let mut n: H = std::ptr::null_mut();
        let mut p = MemAllocNodeParams::device(dev, bytes);
        // SAFETY: valid out-pointers and parameters; deps holds deps.len() nodes of g.
        ck("cuGraphAddMemAllocNode", unsafe {
            (self.0.cu.cuGraphAddMemAllocNode)(&mut n, g, deps.as_ptr(), deps.len(), &mut p)
        });
        (n, p.dptr)
    }
    fn free(&self, g: H, deps: &[H], dptr: u64) -> H {
        let mut n: H = std::ptr::null_mut();
        // SAFETY: as above; dptr is a graph allocation's address.
        ck("cuGraphAddMemFreeNode", unsafe {
            (self.0.cu.cuGraphAddMemFreeNode)(&mut n, g, deps.as_ptr(), deps.len(), dptr)
        });
        n
    }
    /// A child graph node in `parent` that `child` is moved into (memory nodes and all).
    fn embed_moved(&self, parent: H, child: H) -> R {
        let mut n: H = std::ptr::null_mut();
        let mut p = ChildGraphNodeParams::moved(child);
        // SAFETY: valid out-pointer and parameters; no dependencies.
        unsafe { (self.0.cu.cuGraphAddNode)(&mut n, parent, std::ptr::null(), 0, &mut p) }
    }
    /// A child graph node in `parent` cloning `child`.
    fn embed_cloned(&self, parent: H, child: H) -> R {
        let mut n: H = std::ptr::null_mut();
        // SAFETY: as above.
        unsafe { (self.0.cu.cuGraphAddChildGraphNode)(&mut n, parent, std::ptr::null(), 0, child) }
    }
    fn instantiate(&self, g: H) -> Result<H, R> {
        self.instantiate_with(g, 0)
    }
    fn instantiate_with(&self, g: H, flags: u64) -> Result<H, R> {
        let mut e: H = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and graph.
        match unsafe { (self.0.cu.cuGraphInstantiateWithFlags)(&mut e, g, flags) } {
            SUCCESS => Ok(e),
            rc => Err(rc),
        }
    }
    /// A graph of one allocation of `bytes` on device 0, instantiated and launched: the
    /// allocation's address.
    fn launch_alloc(&self, bytes: u64) -> u64 {
        let graph = self.create();
        let (_, p) = self.alloc(graph, &[], 0, bytes);
        ck("launch", self.launch(self.instantiate(graph).unwrap()));
        p
    }
    fn launch(&self, e: H) -> R {
        // SAFETY: an executable graph, on the null stream.
        unsafe { (self.0.cu.cuGraphLaunch)(e, std::ptr::null_mut()) }
    }
    fn upload(&self, e: H) -> R {
        // SAFETY: as above.
        unsafe { (self.0.cu.cuGraphUpload)(e, std::ptr::null_mut()) }
    }
    fn exec_destroy(&self, e: H) {
        // SAFETY: an executable graph of this process.
        ck("cuGraphExecDestroy", unsafe { (self.0.cu.cuGraphExecDestroy)(e) });
    }
    fn trim(&self, dev: c_int) {
        // SAFETY: a device ordinal.
        ck("cuDeviceGraphMemTrim", unsafe { (self.0.cu.cuDeviceGraphMemTrim)(dev) });
    }
    /// `CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT` of a device.
    fn reserved(&self, dev: c_int) -> u64 {
        let mut v = 0u64;
        // SAFETY: a valid out-pointer for a cuuint64_t.
        ck("cuDeviceGetGraphMemAttribute", unsafe { (self.0.cu.cuDeviceGetGraphMemAttribute)(dev, 2, &mut v) });
        v
    }
}

#[test]
fn allocation_nodes_inside_child_graphs_are_counted_before_a_launch() {
    let Some(s) = limited_session("allocation_nodes_inside_child_graphs_are_counted_before_a_launch", GIB) else {
        return;
    };
    let g = G(&s);
    let (region, dev, base) = device0_base(&s);
    let used = || region.used(dev) - base;
    let gpu = || gpu_used(0) - base;

    // A child graph with memory nodes cannot be cloned into a node; it can be moved in.
    let child = g.create();
    g.alloc(child, &[], 0, 800 * MIB);
    let parent = g.create();
    assert_eq!(g.embed_cloned(parent, child), INVALID_VALUE, "a cloned child may hold no memory nodes");
    ck("cuGraphAddNode (child graph, moved)", g.embed_moved(parent, child));
    // Two levels down, another 300 MiB: 1.1 GiB in all, past the 1 GiB limit.
    let inner = g.create();
    g.alloc(inner, &[], 0, 300 * MIB);
    let middle = g.create();
    ck("cuGraphAddNode (inner)", g.embed_moved(middle, inner));
    ck("cuGraphAddNode (middle)", g.embed_moved(parent, middle));
    let e = g.instantiate(parent).expect("instantiate");
    // Refused before the driver sees it: the GPU took nothing, nothing is charged.
    assert_eq!(g.launch(e), OUT_OF_MEMORY);
    assert_eq!((used(), gpu(), g.reserved(0)), (0, 0, 0));
    g.exec_destroy(e);

    // The same nesting within the limit runs, charged exactly what the pool holds.
    let child = g.create();
    g.alloc(child, &[], 0, 200 * MIB);
    let middle = g.create();
    ck("cuGraphAddNode (child)", g.embed_moved(middle, child));
    let parent = g.create();
    ck("cuGraphAddNode (middle)", g.embed_moved(parent, middle));
    let e = g.instantiate(parent).expect("instantiate");
    ck("launch", g.launch(e));
    assert_eq!((used(), gpu(), g.reserved(0)), (200 * MIB, 200 * MIB, 200 * MIB));
    assert_eq!(s.alloc(900 * MIB), Err(OUT_OF_MEMORY), "200 + 900 MiB do not fit in 1 GiB");
    g.exec_destroy(e);

    // Nested past what the shim follows (64): refused at instantiation, never run uncounted.
    let mut top = g.create();
    g.alloc(top, &[], 0, 900 * MIB);
    for _ in 0..65 {
        let up = g.create();
        ck("cuGraphAddNode (nesting)", g.embed_moved(up, top));
        top = up;
    }
    assert_eq!(g.instantiate(top), Err(NOT_SUPPORTED));
    assert_eq!((used(), gpu()), (200 * MIB, 200 * MIB), "nothing more taken");
}

#[test]
fn graph_memory_is_charged_as_the_graph_pool_holds_it() {
    let Some(s) = limited_session("graph_memory_is_charged_as_the_graph_pool_holds_it", GIB) else { return };
    let g = G(&s);
    let (region, dev, base) = device0_base(&s);
    assert_eq!(base, OVERHEAD_MIB * MIB);
    let used = || region.used(dev) - base;
    let gpu = || gpu_used(0) - base;

    // Adding and instantiating take nothing; a second executable of the graph is refused.
    let a = g.create();
    let (_, pa) = g.alloc(a, &[], 0, 300 * MIB);
    let ea = g.instantiate(a).unwrap();
    assert_eq!(g.instantiate(a), Err(INVALID_VALUE));
    assert_eq!((used(), gpu()), (0, 0));
    // The launch takes it, and the shim charges exactly that.
    ck("launch", g.launch(ea));
    assert_eq!((used(), gpu()), (300 * MIB, 300 * MIB));
    assert_eq!(s.mem_info().0, GIB - base - 300 * MIB, "cuMemGetInfo counts it");
    assert_eq!(s.alloc(500 * MIB), Err(OUT_OF_MEMORY), "300 + 300 + 500 MiB do not fit in 1 GiB");
    // Relaunched while its allocation lives: the driver refuses, nothing more is charged.
    assert_eq!(g.launch(ea), INVALID_VALUE);
    assert_eq!((used(), gpu()), (300 * MIB, 300 * MIB));
    // Freed, the memory stays in the graph pool: still charged, still held on the GPU.
    s.free(pa);
    assert_eq!((used(), gpu()), (300 * MIB, 300 * MIB));
    assert_eq!(s.alloc(500 * MIB), Err(OUT_OF_MEMORY), "the pool still holds it");
    // Several relaunches reuse the pool: never counted twice.
    for _ in 0..5 {
        ck("relaunch", g.launch(ea));
        assert_eq!(used(), 300 * MIB);
        s.free(pa);
    }
    // An upload maps nothing more than the pool has.
    ck("upload", g.upload(ea));
    assert_eq!((used(), gpu()), (300 * MIB, 300 * MIB));
    // Destroying the executable returns nothing; trimming returns the pool.
    g.exec_destroy(ea);
    assert_eq!(used(), 300 * MIB);
    g.trim(0);
    assert_eq!((used(), gpu(), g.reserved(0)), (0, 0, 0));
    let p = s.alloc(500 * MIB).expect("trimmed: room again");
    s.free(p);

    // A graph whose allocation would pass the limit: OUT_OF_MEMORY at launch, the driver never
    // called (the GPU took nothing), and nothing charged.
    let big = g.create();
    g.alloc(big, &[], 0, 800 * MIB);
    let eb = g.instantiate(big).unwrap();
    assert_eq!(g.launch(eb), OUT_OF_MEMORY);
    assert_eq!((used(), gpu(), g.reserved(0)), (0, 0, 0));
    // Even when it is the second of two launches that each fit.
    let half = g.create();
    let (_, ph) = g.alloc(half, &[], 0, 400 * MIB);
    let eh = g.instantiate(half).unwrap();
    ck("launch", g.launch(eh));
    let other = g.create();
    let (_, po) = g.alloc(other, &[], 0, 400 * MIB);
    let eo = g.instantiate(other).unwrap();
    assert_eq!(g.launch(eo), OUT_OF_MEMORY, "300 + 400 + 400 MiB");
    assert_eq!((used(), gpu()), (400 * MIB, 400 * MIB));
    // Once the first is freed, the second takes its memory from the pool: it fits.
    s.free(ph);
    ck("launch from the pool", g.launch(eo));
    assert_eq!((used(), gpu()), (400 * MIB, 400 * MIB));

    // A graph that allocates and frees in itself (A, free A, B, free B), launched many times.
    let inner = g.create();
    let (na, da) = g.alloc(inner, &[], 0, 200 * MIB);
    let fa = g.free(inner, &[na], da);
    let (nb, db) = g.alloc(inner, &[fa], 0, 100 * MIB);
    g.free(inner, &[nb], db);
    let ei = g.instantiate(inner).unwrap();
    for _ in 0..10 {
        ck("launch", g.launch(ei));
    }
    assert_eq!(used(), g.reserved(0), "charged what the pool holds");
    assert_eq!(used(), gpu(), "the GPU agrees");
    assert_eq!(used(), 600 * MIB, "B reused A's memory, and the launches reused both");
    for e in [eb, eh, eo, ei] {
        g.exec_destroy(e);
    }
    g.trim(0);
    assert_eq!((used(), gpu()), (400 * MIB, 400 * MIB), "a live allocation outlives its executable");
    s.free(po);
    g.trim(0);
    assert_eq!((used(), gpu()), (0, 0));
    // The whole limit is there again.
    let p = s.alloc(GIB - base).expect("the whole limit");
    s.free(p);
}

#[test]
fn graph_memory_on_another_device_is_charged_there() {
    let Some(s) = limited_session("graph_memory_on_another_device_is_charged_there", GIB) else { return };
    let g = G(&s);
    let path = PathBuf::from(std::env::var_os("TESSERA_REGION").expect("TESSERA_REGION"));
    let region = Region::open_or_create(&path).expect("open region");
    let (d0, d1) = (region.device(&s.uuid(0)).unwrap(), region.device(&s.uuid(1)).unwrap());
    // Device 0's context is charged ahead, then trued up off the start-up path: the base is read
    // once that is done (read before it, a loaded machine's true-up lands after and "used" falls).
    let (b0, b1) = (settled(OVERHEAD_MIB * MIB, || region.used(d0)), region.used(d1));
    // A node on device 1, launched from device 0's stream: charged on device 1, under its limit.
    let graph = g.create();
    g.alloc(graph, &[], 1, 900 * MIB);
    let e = g.instantiate(graph).unwrap();
    ck("launch", g.launch(e));
    assert_eq!((region.used(d0) - b0, region.used(d1) - b1), (0, 900 * MIB));
    assert_eq!(gpu_used(1), 900 * MIB);
    let too_much = g.create();
    g.alloc(too_much, &[], 1, 200 * MIB);
    let e2 = g.instantiate(too_much).unwrap();
    assert_eq!(g.launch(e2), OUT_OF_MEMORY, "device 1's limit");
    assert_eq!(gpu_used(1), 900 * MIB);
}

/// `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`, as PyTorch instantiates its CUDA graphs.
const AUTO_FREE_ON_LAUNCH: u64 = 0x1;

#[test]
fn auto_free_relaunches_are_charged_once() {
    let Some(s) = limited_session("auto_free_relaunches_are_charged_once", GIB) else { return };
    let g = G(&s);
    let (region, dev, base) = device0_base(&s);
    let used = || region.used(dev) - base;
    let gpu = || gpu_used(0) - base;
    // A graph whose 500 MiB output outlives each replay: every relaunch frees the last one first,
    // so replays fit although twice the output would not (300 + 2 x 500 MiB > 1 GiB).
    let graph = g.create();
    let (_, out) = g.alloc(graph, &[], 0, 500 * MIB);
    let e = g.instantiate_with(graph, AUTO_FREE_ON_LAUNCH).unwrap();
    for replay in 0..5 {
        assert_eq!(g.launch(e), SUCCESS, "replay {replay}");
        assert_eq!((used(), gpu()), (500 * MIB, 500 * MIB), "replay {replay}");
    }
    // Another graph's live allocation beside it: a replay still reuses only its own.
    let other = g.create();
    let (_, po) = g.alloc(other, &[], 0, 200 * MIB);
    let eo = g.instantiate(other).unwrap();
    ck("launch", g.launch(eo));
    assert_eq!(used(), 700 * MIB);
    assert_eq!(g.launch(e), SUCCESS);
    assert_eq!((used(), gpu()), (700 * MIB, 700 * MIB));
    // The output freed by the program: the replay takes it from the pool.
    s.free(out);
    assert_eq!(g.launch(e), SUCCESS);
    assert_eq!(used(), 700 * MIB);
    // A plain (not auto-free) graph of 400 MiB does not fit beside both: 300 + 500 + 200 + 400.
    let plain = g.create();
    g.alloc(plain, &[], 0, 400 * MIB);
    let ep = g.instantiate(plain).unwrap();
    assert_eq!(g.launch(ep), OUT_OF_MEMORY);
    assert_eq!((used(), gpu()), (700 * MIB, 700 * MIB));
    // Freed through the graph's pool by cuMemFreeAsync, then trimmed: nothing is left.
    // SAFETY: graph allocations of this process, on the null stream.
    unsafe {
        ck("cuMemFreeAsync", (s.cu.cuMemFreeAsync)(out, std::ptr::null_mut()));
        ck("cuMemFreeAsync", (s.cu.cuMemFreeAsync)(po, std::ptr::null_mut()));
    }
    ck("launch", g.launch(ep));
    assert_eq!(used(), 700 * MIB, "400 MiB from the 700 MiB pool");
    for x in [e, eo, ep] {
        g.exec_destroy(x);
    }
    g.trim(0);
    assert_eq!((used(), gpu()), (400 * MIB, 400 * MIB), "the plain graph's allocation still lives");
}

#[test]
fn a_killed_process_holding_graph_memory_is_reaped() {
    let test = "a_killed_process_holding_graph_memory_is_reaped";
    let Some(node) = parent_node(graph_memory_holder) else { return };
    let c = Container::new(&memory_limits(GIB));
    let (child, _dir) = spawn_ready(test, container_env(&c, &node));
    // One graph allocation live and one in the pool: 512 MiB besides the context.
    assert_killed_holder_is_reaped(&c, &node, child, 512);
}

/// In a child: one graph allocation live and one freed into the pool, held until killed.
fn graph_memory_holder() {
    let s = Session::start(0);
    let g = G(&s);
    g.launch_alloc(256 * MIB);
    let pooled = g.launch_alloc(256 * MIB);
    s.free(pooled);
    ready_then_wait();
}

/// In a child: marks `name` in the test's directory `stage`, then waits until `count` processes
/// have marked it.
fn barrier(stage: &str, name: &str, count: usize) {
    let dir = test_dir().join(stage);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("{name}-{}", std::process::id())), "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_dir(&dir).unwrap().count() < count {
        assert!(Instant::now() < deadline, "the other processes never reached {stage}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Processes of one container launching graphs at once, each holding what it got until all have
/// tried: never more than the limit on the GPU, by the simulated node's own high-water mark.
#[test]
fn processes_launching_graphs_at_once_never_pass_the_limit_on_the_gpu() {
    let test = "processes_launching_graphs_at_once_never_pass_the_limit_on_the_gpu";
    const KIDS: usize = 6;
    if in_child() {
        let s = Session::start(0);
        let g = G(&s);
        let graph = g.create();
        g.alloc(graph, &[], 0, 500 * MIB);
        let e = g.instantiate(graph).unwrap();
        // Every context is made before anyone launches.
        barrier("contexts", "ctx", KIDS);
        let rc = g.launch(e);
        assert!(rc == SUCCESS || rc == OUT_OF_MEMORY, "launch: {rc}");
        // Hold it until every process has tried.
        barrier("launched", if rc == SUCCESS { "ok" } else { "oom" }, KIDS);
        return;
    }
    let node = node();
    let limit = 4 * GIB;
    let c = Container::new(&memory_limits(limit));
    let model = Node::open(node.description.as_deref(), Some(&node.state)).unwrap();
    model.reset_high_water(0, 0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut env = container_env(&c, &node);
    env.push(("TEST_DIR".into(), dir.path().into()));
    let kids: Vec<_> = (0..KIDS).map(|_| spawn_child(test, env.clone())).collect();
    for k in kids {
        wait_child(test, k);
    }
    let ok = std::fs::read_dir(dir.path().join("launched"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("ok-"))
        .count();
    let peak = model.memory_high_water(0, 0).unwrap();
    // 6 contexts of 300 MiB leave 2,296 MiB of 4 GiB: four graphs of 500 MiB fit, not five.
    assert_eq!(ok, 4, "launches that got their memory");
    assert!(peak <= limit, "the GPU held {} MiB under a limit of {} MiB", peak / MIB, limit / MIB);
}

/// A graph launched the instant the first context exists (its true-up possibly still waiting for
/// NVML) must not leave the context's estimate charged for good: the true-up cannot tell a
/// context from a graph pool that already holds a charge, so it has to come first. Each child
/// then takes the rest of the limit exactly, and one MiB more is refused; its region settles on
/// the exact figure. Repeated in 12 processes so that some hit the deferred path.
#[test]
fn a_graph_launched_right_after_the_first_context_leaves_the_whole_limit() {
    let test = "a_graph_launched_right_after_the_first_context_leaves_the_whole_limit";
    if in_child() {
        let s = Session::start(0);
        G(&s).launch_alloc(256 * MIB);
        let rest = GIB - (OVERHEAD_MIB + 256) * MIB;
        let p = s.alloc(rest);
        assert!(p.is_ok(), "the rest of the limit under it ({} MiB) was refused: {p:?}", rest / MIB);
        assert!(s.alloc(MIB).is_err(), "one MiB past the limit was given");
        let (region, dev) = region_and_dev(&s);
        assert_eq!(region.used(dev), GIB, "the region holds exactly the limit");
        assert_eq!(gpu_used(0), GIB, "and so does the GPU");
        return;
    }
    let node = node();
    for _ in 0..12 {
        let c = Container::new(&memory_limits(GIB));
        wait_child(test, spawn_child(test, container_env(&c, &node)));
    }
}
