//! PyTorch 2.8 (the CUDA 12.8 build, with cuBLAS) runs on the simulated node: it finds the GPUs,
//! reports the device, copies real bytes, launches kernels and a GEMM (timed, results not
//! computed), synchronises, allocates through its caching allocator (also with
//! `expandable_segments:True`, which maps memory with the driver's VMM calls) until its own
//! `torch.OutOfMemoryError`, and, under libtessera.so with a memory limit, sees the limit in
//! `torch.cuda.mem_get_info()` and fails at it.
//!
//! PyTorch lives in a virtual environment `scripts/deps.sh` makes (`target/torch-runtime`, or
//! `TESSERA_TORCH_RUNTIME`). Without it the tests print a SKIP line, and fail when
//! `TESSERA_REQUIRE_RUNTIMES` is set, as in CI.

use std::path::PathBuf;

use serde_json::Value;
use tessera_sim_testkit::SimNode;
use tessera_tests::{GIB, MIB, h100, json_u64 as u, run_python_json, shim, venv_python};

/// What cuBLAS and the loaded kernels keep on the device outside PyTorch's allocator, at most.
const LIBRARIES_KEEP: u64 = 128 * MIB;

/// What the PyTorch program does; it prints one JSON line of what it saw.
const PROGRAM: &str = r#"
import json, sys
import torch

chunk = int(sys.argv[1])
out = {"available": torch.cuda.is_available()}
out["count"] = torch.cuda.device_count()
out["name"] = torch.cuda.get_device_name(0)
out["free"], out["total"] = torch.cuda.mem_get_info()

# Real bytes to the device and back; kernels and a GEMM (cuBLAS) launch and the device
# synchronises (the sim runs no kernel code, so their results are not checked).
host = torch.arange(1 << 20, dtype=torch.int32)
dev = host.to("cuda")
out["roundtrip"] = bool(torch.equal(dev.cpu(), host))
y = dev + 1
z = torch.randn(512, 512, device="cuda") @ torch.randn(512, 512, device="cuda")
torch.cuda.synchronize()
out["shapes"] = [list(y.shape), list(z.shape)]
out["expandable"] = [s.get("is_expandable", False) for s in torch.cuda.memory._snapshot()["segments"]]
del host, dev, y, z

# Allocate through the caching allocator until its out-of-memory error.
held = []
try:
    while len(held) < 10000:
        held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    out["oom"] = None
except torch.OutOfMemoryError:
    out["oom"] = "OutOfMemoryError"
out["held"] = len(held) * chunk
del held
torch.cuda.empty_cache()
out["reserved_after"] = torch.cuda.memory_reserved()
out["free_after"] = torch.cuda.mem_get_info()[0]
print(json.dumps(out))
"#;

/// Runs the program on a node of its own with `extra` environment, allocating `chunk` bytes at a
/// time; what it saw.
fn run_torch(python: &PathBuf, chunk: u64, extra: &[(&str, &str)]) -> Value {
    run_python_json(&SimNode::new(), python, "PyTorch on the sim", &["-c", PROGRAM, &chunk.to_string()], extra)
}

/// What every run shows, whatever its allocator settings: the program ran to the end.
fn check_common(v: &Value, expandable: bool) {
    assert_eq!(v["available"], true, "torch.cuda.is_available(): {v}");
    assert_eq!(u(v, "count"), 8);
    assert_eq!(v["name"], h100::NAME);
    assert_eq!(v["roundtrip"], true, "bytes copied to the device and back are the same");
    assert_eq!(v["shapes"], serde_json::json!([[1 << 20], [512, 512]]), "the kernels and the GEMM ran");
    let segments = v["expandable"].as_array().expect("segments");
    assert!(!segments.is_empty() && segments.iter().all(|s| s == expandable), "segments: {v}");
    assert_eq!(v["oom"], "OutOfMemoryError", "PyTorch's own OOM error: {v}");
}

fn runs_on_the_sim(alloc_conf: &str) {
    let Some(python) = venv_python("TESSERA_TORCH_RUNTIME", "torch-runtime", "import torch", "PyTorch") else { return };
    let v = run_torch(&python, 4 * GIB, &[("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)]);
    check_common(&v, !alloc_conf.is_empty());
    assert_eq!(u(&v, "total"), h100::MEMORY);
    let free = h100::MEMORY - h100::RESERVED - h100::CONTEXT_OVERHEAD;
    assert_eq!(u(&v, "free"), free, "the board less what the sim reserves and the context");
    let held = u(&v, "held");
    assert!(held <= free && held + 4 * GIB + LIBRARIES_KEEP > free, "held {held} of {free} free before the OOM");
    // What the allocator gave back is free on the device again.
    let (after, reserved) = (u(&v, "free_after"), u(&v, "reserved_after"));
    assert!(after + reserved <= free && after + reserved + LIBRARIES_KEEP > free, "{v}");
}

#[test]
fn pytorch_runs_on_the_simulated_node() {
    runs_on_the_sim("");
}

#[test]
fn pytorch_with_expandable_segments_maps_memory_through_vmm() {
    runs_on_the_sim("expandable_segments:True");
}

fn sees_the_shims_limit(alloc_conf: &str) {
    let Some(python) = venv_python("TESSERA_TORCH_RUNTIME", "torch-runtime", "import torch", "PyTorch") else { return };
    let shim = shim();
    let shim = shim.to_str().expect("utf-8 path");
    let env = [("LD_PRELOAD", shim), ("TESSERA_MEMORY_LIMIT", "1GiB"), ("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)];
    let v = run_torch(&python, 100 * MIB, &env);
    check_common(&v, !alloc_conf.is_empty());
    assert_eq!(u(&v, "total"), GIB, "mem_get_info shows the limit as the device's memory");
    assert_eq!(u(&v, "free"), GIB - h100::CONTEXT_OVERHEAD, "the context counts against the limit");
    let held = u(&v, "held");
    let free = GIB - h100::CONTEXT_OVERHEAD;
    assert!(held <= free && held + 100 * MIB + LIBRARIES_KEEP > free, "held {held} of {free} under a 1 GiB limit");
    let (after, reserved) = (u(&v, "free_after"), u(&v, "reserved_after"));
    assert!(after + reserved <= free && after + reserved + LIBRARIES_KEEP > free, "{v}");
}

#[test]
fn pytorch_under_the_shim_sees_its_limit() {
    sees_the_shims_limit("");
}

#[test]
fn pytorch_with_expandable_segments_under_the_shim_sees_its_limit() {
    sees_the_shims_limit("expandable_segments:True");
}

/// PyTorch's `cudaMallocAsync` backend: every tensor is a stream-ordered allocation from the
/// device's default pool, whose release threshold PyTorch sets to the maximum, so what a freed
/// tensor held stays in the pool (the GPU's memory for the process) until `empty_cache` trims
/// it. Prints what it saw.
const ASYNC_PROGRAM: &str = r#"
import json, torch
out = {"backend": torch.cuda.memory.get_allocator_backend()}
out["free0"] = torch.cuda.mem_get_info()[0]
x = torch.empty(600 << 20, dtype=torch.uint8, device="cuda")
del x
torch.cuda.synchronize()
out["free_after_del"] = torch.cuda.mem_get_info()[0]
y = torch.empty(600 << 20, dtype=torch.uint8, device="cuda")
del y
torch.cuda.synchronize()
try:
    held = [torch.empty(100 << 20, dtype=torch.uint8, device="cuda") for _ in range(20)]
    out["oom"] = None
except torch.OutOfMemoryError:
    out["oom"] = "OutOfMemoryError"
held = None
torch.cuda.empty_cache()
out["free_after_empty_cache"] = torch.cuda.mem_get_info()[0]
print(json.dumps(out))
"#;

#[test]
fn pytorch_cuda_malloc_async_pool_counts_against_the_limit() {
    let Some(python) = venv_python("TESSERA_TORCH_RUNTIME", "torch-runtime", "import torch", "PyTorch") else { return };
    let run = |extra: &[(&str, &str)]| {
        let mut env = vec![("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")];
        env.extend_from_slice(extra);
        run_python_json(&SimNode::new(), &python, "PyTorch cudaMallocAsync", &["-c", ASYNC_PROGRAM], &env)
    };
    // On the sim alone: the pool keeps the freed 600 MiB until empty_cache; 2 GiB more fit.
    let v = run(&[]);
    assert_eq!(v["backend"], "cudaMallocAsync", "{v}");
    let free0 = u(&v, "free0");
    assert_eq!(u(&v, "free_after_del"), free0 - 600 * MIB, "the pool keeps what the tensor held: {v}");
    assert_eq!(v["oom"], serde_json::Value::Null, "{v}");
    assert_eq!(u(&v, "free_after_empty_cache"), free0, "{v}");
    // Under a 1 GiB limit: the same 600 MiB stays used (the shim charges the pool, not the
    // tensors), a second 600 MiB tensor comes from the pool, and 2 GiB do not fit.
    let shim = shim();
    let shim = shim.to_str().expect("utf-8 path");
    let v = run(&[("LD_PRELOAD", shim), ("TESSERA_MEMORY_LIMIT", "1GiB")]);
    let free0 = u(&v, "free0");
    assert_eq!(free0, GIB - h100::CONTEXT_OVERHEAD, "{v}");
    assert_eq!(u(&v, "free_after_del"), free0 - 600 * MIB, "what the pool keeps is used under the limit: {v}");
    assert_eq!(v["oom"], "OutOfMemoryError", "{v}");
    assert_eq!(u(&v, "free_after_empty_cache"), free0, "trimmed, it is free again: {v}");
}
