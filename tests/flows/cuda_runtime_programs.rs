//! Programs built on the CUDA runtime (libcudart 12.x) run on the simulated node: CuPy, with
//! NVIDIA's runtime and NVRTC from their Python wheels, initialises, reports the device,
//! JIT-compiles, links and launches kernels (timed by name, results not computed), copies real
//! bytes, allocates through its memory pools until its own out-of-memory error, and, under
//! libtessera.so with a memory limit, sees the limit and fails at it.
//!
//! The wheels live in a virtual environment `scripts/deps.sh` makes (`target/cuda-runtimes`, or
//! `TESSERA_CUDA_RUNTIMES`). Without it the tests print a SKIP line, and fail when
//! `TESSERA_REQUIRE_RUNTIMES` is set, as in CI.

use std::path::PathBuf;

use serde_json::Value;
use tessera_sim_testkit::SimNode;
use tessera_tests::{CUDA_PY, GIB, MIB, h100, json_u64 as u, run_python_json, shim, venv_python};

/// What the CuPy program does; it prints one JSON line of what it saw.
const PROGRAM: &str = r#"
import json, sys
import numpy
import cupy
from cupy.cuda import runtime, function, compiler
from cupy_backends.cuda.api import driver

out = {}
out["count"] = runtime.getDeviceCount()
props = runtime.getDeviceProperties(0)
out["name"] = props["name"].decode()
out["free"], out["total"] = runtime.memGetInfo()

# Real bytes go to the device and come back.
data = numpy.random.default_rng(7).integers(0, 255, 1 << 20, dtype=numpy.uint8)
on_device = cupy.asarray(data)
out["roundtrip"] = bool((cupy.asnumpy(on_device) == data).all())
copy = cupy.empty_like(on_device)
copy.data.copy_from_device(on_device.data, on_device.nbytes)
out["device_copy"] = bool((copy.get() == data).all())

# JIT-compiled kernels (NVRTC) launch; a kernel named for 20 ms takes 20 ms between events.
doubled = on_device * 2
spin = cupy.RawKernel(r'extern "C" __global__ void spin_20ms(unsigned char* a) { a[0] = 1; }', "spin_20ms")
start, stop = cupy.cuda.Event(), cupy.cuda.Event()
start.record()
spin((1,), (32,), (on_device,))
stop.record()
stop.synchronize()
out["spin_ms"] = cupy.cuda.get_elapsed_time(start, stop)
stream = cupy.cuda.Stream(non_blocking=True)
with stream:
    doubled = doubled + 1
stream.synchronize()
runtime.deviceSynchronize()

# JIT linking, as CuPy's relocatable-code path does, and occupancy.
image = compiler.compile_using_nvrtc('extern "C" __global__ void linked_1us(int* a) { a[0] = 1; }', arch="90")[0]
link = function.LinkState()
link.add_ptr_data(image, "linked.cubin")
module = function.Module()
module.load(link.complete())
linked = module.get_function("linked_1us")
linked((1,), (1,), (on_device,))
out["occupancy_256"] = driver.occupancyMaxActiveBlocksPerMultiprocessor(linked.ptr, 256, 0)

# Stream-ordered allocation (cudaMallocAsync pools). CuPy raises the pool's release threshold to
# the maximum, so freed memory stays reserved (used on the device) until the pool is trimmed.
pool = cupy.cuda.MemoryAsyncPool()
a = pool.malloc(64 << 20)
free_while_held = runtime.memGetInfo()[0]
del a
runtime.deviceSynchronize()
out["async_kept"] = runtime.memGetInfo()[0] == free_while_held
pool.free_all_blocks()

# Everything freed is free on the device again.
del on_device, copy, doubled
cupy.get_default_memory_pool().free_all_blocks()
out["free_before_oom"] = runtime.memGetInfo()[0]

# Allocate through CuPy's pool until its out-of-memory error.
chunk = int(sys.argv[1])
held = []
try:
    while len(held) < 10000:
        held.append(cupy.empty(chunk, dtype=cupy.uint8))
    out["oom"] = None
except cupy.cuda.memory.OutOfMemoryError:
    out["oom"] = "OutOfMemoryError"
out["held"] = len(held) * chunk
del held
cupy.get_default_memory_pool().free_all_blocks()
out["free_after"] = runtime.memGetInfo()[0]
try:
    cupy.empty(out["total"] + chunk, dtype=cupy.uint8)
    out["too_big"] = None
except cupy.cuda.memory.OutOfMemoryError:
    out["too_big"] = "OutOfMemoryError"
print(json.dumps(out))
"#;

/// Runs the program on a node of its own, with `extra` environment, allocating `chunk` bytes at a
/// time; what it saw.
fn run_cupy(python: &PathBuf, chunk: u64, extra: &[(&str, &str)]) -> Value {
    run_python_json(&SimNode::new(), python, "CuPy on the sim", &["-c", PROGRAM, &chunk.to_string()], extra)
}

/// The Python of the CUDA runtimes' environment, where CuPy imports; else `None` (see
/// [`venv_python`]).
fn cupy_python() -> Option<PathBuf> {
    venv_python("TESSERA_CUDA_RUNTIMES", "cuda-runtimes", "import cupy, cupy_backends", "CuPy")
}

/// The program's allocations, `chunk` bytes at a time with `free` bytes free, ended at CuPy's own
/// out-of-memory error with less than a chunk left; what it freed was free again, and one
/// allocation larger than the device was CuPy's out-of-memory error too.
fn assert_ran_out_at(v: &Value, free: u64, chunk: u64) {
    assert_eq!(v["oom"], "OutOfMemoryError", "CuPy's own OOM error when memory runs out");
    let held = u(v, "held");
    assert!(held <= free && held + chunk > free, "held {held} of {free} free before CuPy's OOM");
    assert_eq!(u(v, "free_before_oom"), free, "freed memory is free again");
    assert_eq!(u(v, "free_after"), free);
    assert_eq!(v["too_big"], "OutOfMemoryError");
}

#[test]
fn cupy_runs_on_the_simulated_node() {
    let Some(python) = cupy_python() else { return };
    let v = run_cupy(&python, 4 * GIB, &[]);
    assert_eq!(u(&v, "count"), 8);
    assert_eq!(v["name"], h100::NAME);
    assert_eq!(u(&v, "total"), h100::MEMORY);
    let free = h100::MEMORY - h100::RESERVED - h100::CONTEXT_OVERHEAD;
    assert_eq!(u(&v, "free"), free, "the board less what the sim reserves and the runtime's context");
    assert_eq!(v["roundtrip"], true, "bytes copied to the device and back are the same");
    assert_eq!(v["device_copy"], true, "a device-to-device copy moves the bytes");
    let spin = v["spin_ms"].as_f64().expect("spin_ms");
    assert!(spin >= 19.9, "a kernel named for 20 ms took {spin} ms between its events");
    assert_eq!(u(&v, "occupancy_256"), 8, "2048 threads per SM");
    assert_ran_out_at(&v, free, 4 * GIB);
    assert_eq!(v["async_kept"], true, "a pool keeps freed memory up to its release threshold");
}

#[test]
fn cupy_under_the_shim_sees_its_limit() {
    let Some(python) = cupy_python() else { return };
    let shim = shim();
    let shim = shim.to_str().expect("utf-8 path");
    let v = run_cupy(&python, 100 * MIB, &[("LD_PRELOAD", shim), ("TESSERA_MEMORY_LIMIT", "1GiB")]);
    assert_eq!(u(&v, "total"), GIB, "memGetInfo shows the limit as the device's memory");
    let free = u(&v, "free");
    assert!(free <= GIB - h100::CONTEXT_OVERHEAD, "the runtime's context counts against the limit: {free}");
    assert_eq!(v["roundtrip"], true);
    assert_ran_out_at(&v, free, 100 * MIB);
    assert_eq!(v["async_kept"], true, "what the async pool keeps stays used under the limit too");
}

/// A device `malloc` heap set through the runtime (`cudaDeviceSetLimit`, as libraries that size
/// their heap "as large as will fit" do): the driver sets the memory aside without an allocation
/// call, when a module is loaded into the context. `sys.argv[1]` is the first heap asked for;
/// then 256 MiB. Prints what each answered, the heap the runtime reports, and the device memory
/// the heap took from what was free: once set, and once a module (NVRTC-compiled, no
/// allocation) is loaded.
const HEAP_PROGRAM: &str = r#"
import json, sys
import cupy
from cupy.cuda import runtime

runtime.setDevice(0)
runtime.free(runtime.malloc(1))
free0 = runtime.memGetInfo()[0]
def heap(v):
    try:
        runtime.deviceSetLimit(runtime.cudaLimitMallocHeapSize, v)
        return "ok"
    except runtime.CUDARuntimeError as e:
        return str(e)
out = {"first": heap(int(sys.argv[1]))}
out["heap_after_first"] = runtime.deviceGetLimit(runtime.cudaLimitMallocHeapSize)
out["second"] = heap(256 << 20)
out["heap"] = runtime.deviceGetLimit(runtime.cudaLimitMallocHeapSize)
out["taken_at_set"] = free0 - runtime.memGetInfo()[0]
cupy.RawModule(code='extern "C" __global__ void k() {}').get_function("k")
out["taken"] = free0 - runtime.memGetInfo()[0]
print(json.dumps(out))
"#;

#[test]
fn cupy_device_malloc_heap_counts_against_the_limit() {
    let Some(python) = cupy_python() else { return };
    let first_heap = (2 * GIB).to_string();
    let run = |extra: &[(&str, &str)]| {
        run_python_json(&SimNode::new(), &python, "CuPy heap", &["-c", HEAP_PROGRAM, &first_heap], extra)
    };
    // On the sim alone a 2 GiB heap is accepted, then lowered to 256 MiB, which the first module
    // takes.
    let v = run(&[]);
    assert_eq!((v["first"].as_str(), u(&v, "heap_after_first")), (Some("ok"), 2 * GIB), "{v}");
    assert_eq!((v["second"].as_str(), u(&v, "heap")), (Some("ok"), 256 * MIB), "{v}");
    assert_eq!(u(&v, "taken_at_set"), 0, "nothing taken at the set, as on an H200: {v}");
    assert_eq!(u(&v, "taken"), 248 * MIB, "the heap past its 8 MiB default, taken with a module: {v}");
    // Under a 1 GiB limit the 2 GiB heap is the runtime's memory allocation error, nothing moves,
    // and the 256 MiB one fits and shows as used.
    let shim = shim();
    let shim = shim.to_str().expect("utf-8 path");
    let v = run(&[("LD_PRELOAD", shim), ("TESSERA_MEMORY_LIMIT", "1GiB")]);
    let first = v["first"].as_str().unwrap_or_default();
    assert!(first.contains("cudaErrorMemoryAllocation"), "{v}");
    assert_eq!(u(&v, "heap_after_first"), 8 * MIB, "{v}");
    assert_eq!((v["second"].as_str(), u(&v, "heap")), (Some("ok"), 256 * MIB), "{v}");
    assert_eq!(u(&v, "taken_at_set"), 248 * MIB, "the shim charges it from the set: {v}");
    assert_eq!(u(&v, "taken"), 248 * MIB, "memGetInfo shows the heap used: {v}");
}

/// Two CuPy processes share one allocation through CUDA IPC (`cudaIpcGetMemHandle` /
/// `cudaIpcOpenMemHandle`, as PyTorch's multiprocess tensors do): the importer reads what the
/// exporter wrote and the exporter reads the importer's answer; the allocation is counted once.
const IPC_PROGRAM: &str = r#"
import json, subprocess, sys
import numpy
import cupy
from cupy.cuda import runtime

SIZE = 256 << 20
def attempt(call, *args):
    try:
        call(*args)
        return "ok"
    except runtime.CUDARuntimeError as e:
        return str(e)

if sys.argv[1] == "export":
    runtime.setDevice(0)
    ptr = runtime.malloc(SIZE)
    host = numpy.arange(SIZE // 4, dtype=numpy.uint32)
    runtime.memcpy(ptr, host.ctypes.data, SIZE, runtime.memcpyHostToDevice)
    handle = bytes(runtime.ipcGetMemHandle(ptr))
    child = subprocess.run([sys.executable, "-c", sys.argv[2], "import", handle.hex()], capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit("importer failed: " + child.stdout + child.stderr)
    out = json.loads(child.stdout.strip().splitlines()[-1])
    back = numpy.zeros(4, dtype=numpy.uint32)
    runtime.memcpy(back.ctypes.data, ptr + SIZE - 16, 16, runtime.memcpyDeviceToHost)
    out["exporter_sees"] = back.tolist()
    out["exporter_free"] = runtime.memGetInfo()[0]
    out["own_handle"] = attempt(runtime.ipcOpenMemHandle, handle)
    runtime.free(ptr)
    out["exporter_free_after"] = runtime.memGetInfo()[0]
    print(json.dumps(out))
else:
    runtime.setDevice(0)
    free_before = runtime.memGetInfo()[0]
    ptr = runtime.ipcOpenMemHandle(bytes.fromhex(sys.argv[2]))
    got = numpy.zeros(4, dtype=numpy.uint32)
    runtime.memcpy(got.ctypes.data, ptr + 1024, 16, runtime.memcpyDeviceToHost)
    answer = numpy.array([7, 7, 7, 7], dtype=numpy.uint32)
    runtime.memcpy(ptr + SIZE - 16, answer.ctypes.data, 16, runtime.memcpyHostToDevice)
    out = {"importer_sees": got.tolist(), "importer_free_before": free_before, "importer_free": runtime.memGetInfo()[0]}
    out["free_imported"] = attempt(runtime.free, ptr)
    runtime.ipcCloseMemHandle(ptr)
    print(json.dumps(out))
"#;

#[test]
fn cupy_processes_share_memory_through_ipc_counted_once() {
    let Some(python) = cupy_python() else { return };
    let v = run_python_json(&SimNode::new(), &python, "CuPy IPC", &["-c", IPC_PROGRAM, "export", IPC_PROGRAM], &[]);
    assert_eq!(v["importer_sees"], serde_json::json!([256, 257, 258, 259]), "the exporter's bytes");
    assert_eq!(v["exporter_sees"], serde_json::json!([7, 7, 7, 7]), "the importer's bytes");
    let shared = 256 * MIB;
    let board = h100::MEMORY - h100::RESERVED;
    // Both processes hold a context; the shared allocation counts once, and opening it took nothing.
    assert_eq!(u(&v, "importer_free_before"), board - 2 * h100::CONTEXT_OVERHEAD - shared);
    assert_eq!(u(&v, "importer_free"), u(&v, "importer_free_before"), "importing charges nothing");
    assert_eq!(u(&v, "exporter_free"), board - h100::CONTEXT_OVERHEAD - shared, "the importer has exited");
    assert_eq!(u(&v, "exporter_free_after"), board - h100::CONTEXT_OVERHEAD);
    assert!(v["own_handle"].as_str().unwrap().contains("cudaError"), "a process's own handle is refused: {v}");
    assert!(v["free_imported"].as_str().unwrap().contains("cudaError"), "cudaFree of imported memory is refused: {v}");
}

/// A driver-API program (Python's ctypes over libcuda.so.1) whose CUDA graph allocates memory
/// with an allocation node (`cuGraphAddMemAllocNode`), as PyTorch's CUDA graphs and captured
/// `cudaMallocAsync` do; it prints the launch's result and the free memory around it.
/// Follows [`CUDA_PY`].
const GRAPH_MEMORY_PROGRAM: &str = r#"
import json
from ctypes import c_ushort
class Params(ctypes.Structure):
    _fields_ = [("allocType", c_uint), ("handleTypes", c_uint), ("locType", c_uint), ("locId", c_int),
                ("win32", c_void_p), ("maxSize", c_size_t), ("usage", c_ushort), ("reserved", c_ubyte * 54),
                ("accessDescs", c_void_p), ("accessDescCount", c_size_t), ("bytesize", c_size_t), ("dptr", c_ulonglong)]
start()
graph, node, exe = c_void_p(), c_void_p(), c_void_p()
ok(cu.cuGraphCreate(byref(graph), 0), "cuGraphCreate")
p = Params(allocType=1, locType=1, locId=0, bytesize=int(sys.argv[1]))
ok(cu.cuGraphAddMemAllocNode(byref(node), graph, None, c_size_t(0), byref(p)), "cuGraphAddMemAllocNode")
ok(cu.cuGraphInstantiateWithFlags(byref(exe), graph, c_ulonglong(0)), "cuGraphInstantiate")
before, total = free()
rc = cu.cuGraphLaunch(exe, None)
cu.cuCtxSynchronize()
after, _ = free()
print(json.dumps({"launch": rc, "free_before": before, "free_after": after, "total": total}))
"#;

fn run_graph_memory(node: &SimNode, bytes: u64, extra: &[(&str, &str)]) -> Value {
    run_python_json(
        node,
        "python3",
        "graph program",
        &["-c", &format!("{CUDA_PY}{GRAPH_MEMORY_PROGRAM}"), &bytes.to_string()],
        extra,
    )
}

#[test]
fn graph_memory_nodes_are_charged_at_launch_on_the_sim() {
    let node = SimNode::new();
    let v = run_graph_memory(&node, 2 * GIB, &[]);
    assert_eq!(u(&v, "launch"), 0);
    assert_eq!(u(&v, "free_before") - u(&v, "free_after"), 2 * GIB, "the allocation node's memory");
    let v = run_graph_memory(&node, 100 * GIB, &[]);
    assert_eq!(u(&v, "launch"), 2, "CUDA_ERROR_OUT_OF_MEMORY beyond the board");
    assert_eq!(u(&v, "free_after"), u(&v, "free_before"));
}

#[test]
fn graph_memory_nodes_under_the_shim_hold_its_limit() {
    let node = SimNode::new();
    let shim = shim();
    let env = [("LD_PRELOAD", shim.to_str().expect("utf-8 path")), ("TESSERA_MEMORY_LIMIT", "1GiB")];
    let v = run_graph_memory(&node, 2 * GIB, &env);
    assert_eq!(u(&v, "total"), GIB, "the limit shows as the device's memory");
    assert_eq!(u(&v, "launch"), 2, "a graph allocating 2 GiB under a 1 GiB limit: CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(u(&v, "free_after"), u(&v, "free_before"));
    // One that fits is charged what it allocated, no more.
    let v = run_graph_memory(&node, 512 * MIB, &env);
    assert_eq!(u(&v, "launch"), 0);
    assert_eq!(u(&v, "free_before") - u(&v, "free_after"), 512 * MIB);
}

/// A CuPy program that captures stream-ordered allocations into a CUDA graph (`cudaMallocAsync`
/// and `cudaFreeAsync` on a capturing stream become graph memory nodes, as in PyTorch's CUDA
/// graphs): the graph runs while `other` bytes are held elsewhere, then alone, then again, and
/// the device's graph pool is trimmed; it prints the free memory at each step.
const CAPTURED_GRAPH_PROGRAM: &str = r#"
import ctypes, json, sys
import cupy
from cupy.cuda import runtime
n = int(sys.argv[1])
other = int(sys.argv[2])
out = {}
runtime.setDevice(0)
cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
s = cupy.cuda.Stream(non_blocking=True)
with s:
    s.begin_capture()
    a = cupy.empty(n, dtype=cupy.uint8)
    a.fill(1)
    del a
    g = s.end_capture()
free = lambda: runtime.memGetInfo()[0]
out["total"] = runtime.memGetInfo()[1]
out["free_captured"] = free()
def launch():
    try:
        g.launch(s)
        s.synchronize()
        return "ok"
    except runtime.CUDARuntimeError as e:
        return str(e).split(":")[0]
held = runtime.malloc(other)
out["free_held"] = free()
out["launch_held"] = launch()
out["free_refused"] = free()
runtime.free(held)
out["launch"] = launch()
out["free_launched"] = free()
out["relaunch"] = launch()
out["free_relaunched"] = free()
ctypes.CDLL("libcuda.so.1").cuDeviceGraphMemTrim(0)
out["free_trimmed"] = free()
print(json.dumps(out))
"#;

#[test]
fn cupy_captured_graph_memory_under_the_shim_holds_its_limit() {
    let Some(python) = cupy_python() else { return };
    let node = SimNode::new();
    let (graph, other) = (600 * MIB, 300 * MIB);
    let args = ["-c", CAPTURED_GRAPH_PROGRAM, &graph.to_string(), &other.to_string()];
    let shim = shim();
    let env = [("LD_PRELOAD", shim.to_str().expect("utf-8 path")), ("TESSERA_MEMORY_LIMIT", "1GiB")];
    let v = run_python_json(&node, &python, "captured graph under the shim", &args, &env);
    let free = u(&v, "free_captured");
    assert_eq!(u(&v, "total"), GIB);
    assert_eq!(free, GIB - h100::CONTEXT_OVERHEAD, "capturing allocates nothing");
    assert_eq!(u(&v, "free_held"), free - other);
    assert_eq!(v["launch_held"], "cudaErrorMemoryAllocation", "600 MiB more do not fit beside 300 MiB: {v}");
    assert_eq!(u(&v, "free_refused"), free - other, "the refused launch took nothing");
    assert_eq!(v["launch"], "ok");
    assert_eq!(u(&v, "free_launched"), free - graph, "freed in the graph, kept in the graph pool");
    assert_eq!(v["relaunch"], "ok");
    assert_eq!(u(&v, "free_relaunched"), free - graph, "a relaunch reuses the pool");
    assert_eq!(u(&v, "free_trimmed"), free, "cuDeviceGraphMemTrim gives it back");
    // On the sim alone the same program runs every launch, with the same pool.
    let v = run_python_json(&node, &python, "captured graph on the sim", &args, &[]);
    assert_eq!(v["launch_held"], "ok");
    assert_eq!(u(&v, "free_captured") - u(&v, "free_trimmed"), 0);
    assert_eq!(u(&v, "free_captured") - u(&v, "free_relaunched"), graph);
}
