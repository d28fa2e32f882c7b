//! PyTorch 2.8 (the CUDA 12.8 build, with cuBLAS) runs on the simulated node: it finds the GPUs,
//! reports the device, copies real bytes, launches kernels, a GEMM and an FFT (cuFFT; timed,
//! results not computed), synchronises, allocates through its caching allocator (also with
//! `expandable_segments:True`, which maps memory with the driver's VMM calls) until its own
//! `torch.OutOfMemoryError`, and, under libtessera.so with a memory limit, sees the limit in
//! `torch.cuda.mem_get_info()` and fails at it. Mixed precision runs too, with and without
//! libtessera.so: fp16 and bf16 GEMMs (cuBLASLt's Hopper kernels, which place thread-block
//! clusters from the driver's GPC layout), `torch.autocast`, a bf16 training step and an fp16
//! `GradScaler` step.
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
# cuFFT (its plans take their kernels through the driver's tools' module table).
f = torch.fft.rfft2(torch.ones(64, 128, device="cuda"))
out["fft"] = [list(f.shape), str(f.dtype)]
del f
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

/// The Python of the PyTorch environment, where torch imports; else `None` (see [`venv_python`]).
fn torch_python() -> Option<PathBuf> {
    venv_python("TESSERA_TORCH_RUNTIME", "torch-runtime", "import torch", "PyTorch")
}

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
    assert_eq!(v["fft"], serde_json::json!([[64, 65], "torch.complex64"]), "a cuFFT plan ran: {v}");
    let segments = v["expandable"].as_array().expect("segments");
    assert!(!segments.is_empty() && segments.iter().all(|s| s == expandable), "segments: {v}");
    assert_eq!(v["oom"], "OutOfMemoryError", "PyTorch's own OOM error: {v}");
}

/// The program with `alloc_conf`, on the sim alone or under libtessera.so with a 1 GiB limit
/// (`shim_on`): it sees the board (or the limit) less its context, holds what fits until
/// PyTorch's own OOM, and what the allocator gave back is free on the device again.
fn runs_with(alloc_conf: &str, shim_on: bool) {
    let Some(python) = torch_python() else { return };
    let shim = shim_on.then(shim);
    let mut env = vec![("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)];
    if let Some(p) = &shim {
        env.extend([("LD_PRELOAD", p.to_str().expect("utf-8 path")), ("TESSERA_MEMORY_LIMIT", "1GiB")]);
    }
    let (chunk, total, free) = match shim_on {
        true => (100 * MIB, GIB, GIB - h100::CONTEXT_OVERHEAD),
        false => (4 * GIB, h100::MEMORY, h100::MEMORY - h100::RESERVED - h100::CONTEXT_OVERHEAD),
    };
    let v = run_torch(&python, chunk, &env);
    check_common(&v, !alloc_conf.is_empty());
    assert_eq!(u(&v, "total"), total, "mem_get_info shows the board, or the limit, as the device's memory");
    assert_eq!(u(&v, "free"), free, "the board less what the sim reserves, or the limit, less the context");
    let held = u(&v, "held");
    assert!(held <= free && held + chunk + LIBRARIES_KEEP > free, "held {held} of {free} free before the OOM");
    let (after, reserved) = (u(&v, "free_after"), u(&v, "reserved_after"));
    assert!(after + reserved <= free && after + reserved + LIBRARIES_KEEP > free, "{v}");
}

#[test]
fn pytorch_runs_on_the_simulated_node() {
    runs_with("", false);
}

#[test]
fn pytorch_with_expandable_segments_maps_memory_through_vmm() {
    runs_with("expandable_segments:True", false);
}

#[test]
fn pytorch_under_the_shim_sees_its_limit() {
    runs_with("", true);
}

#[test]
fn pytorch_with_expandable_segments_under_the_shim_sees_its_limit() {
    runs_with("expandable_segments:True", true);
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
    let Some(python) = torch_python() else { return };
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

/// Mixed precision, one case per run (`sys.argv[1]`): half-precision GEMMs, `torch.autocast`, a
/// bf16 training step, an fp16 autocast step with a `GradScaler`. Prints what it saw: shapes and
/// dtypes (the sim computes no values), and the device's memory as PyTorch sees it.
const MIXED_PROGRAM: &str = r#"
import json, sys
import torch

case = sys.argv[1]
dev = "cuda"
out = {"total": torch.cuda.mem_get_info()[1]}
seen = lambda *ts: [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in ts]
if case == "gemm":
    # cuBLAS and cuBLASLt: a matmul, a batched one, a linear layer with its bias (an epilogue).
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        a = torch.randn(256, 512, dtype=dt, device=dev)
        c = a @ torch.randn(512, 128, dtype=dt, device=dev)
        bm = torch.bmm(torch.randn(4, 64, 32, dtype=dt, device=dev), torch.randn(4, 32, 16, dtype=dt, device=dev))
        lin = torch.nn.functional.linear(a, torch.randn(64, 512, dtype=dt, device=dev), torch.randn(64, dtype=dt, device=dev))
        big = torch.randn(4096, 4096, dtype=dt, device=dev) @ torch.randn(4096, 1024, dtype=dt, device=dev)
        out[name] = seen(c, bm, lin, big)
elif case == "autocast":
    # fp32 tensors and layers; the products inside run in half precision.
    x = torch.randn(128, 256, device=dev)
    layer = torch.nn.Linear(256, 64).to(dev)
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        with torch.autocast("cuda", dtype=dt):
            y = layer(x)
            z = x @ x.t()
            s = y.float().sum()
        out[name] = seen(y, z, s)
elif case == "train_bf16":
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 10))
    model = model.to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    target = torch.randint(0, 10, (64,), device=dev)
    for _ in range(2):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
    out["loss"] = seen(loss)
    out["grads"] = seen(*[p.grad for p in model.parameters()])
    out["state"] = sorted(opt.state[model[0].weight].keys())
elif case == "amp_fp16":
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(64, 256, device=dev)
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, torch.randint(0, 10, (64,), device=dev))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    out["seen"] = seen(logits, loss, model[0].weight.grad)
torch.cuda.synchronize()
print(json.dumps(out))
"#;

/// Runs one mixed-precision case on a node of its own, under libtessera.so with a 4 GiB limit
/// when `shim`; what it saw, after checking that the shim (or the whole board) was there.
fn mixed_precision(case: &str, shim_on: bool) -> Option<Value> {
    let python = torch_python()?;
    let shim = shim_on.then(shim);
    let env = match &shim {
        Some(p) => vec![("LD_PRELOAD", p.to_str().expect("utf-8 path")), ("TESSERA_MEMORY_LIMIT", "4GiB")],
        None => vec![],
    };
    let what = format!("PyTorch mixed precision ({case}, shim: {shim_on})");
    let v = run_python_json(&SimNode::new(), &python, &what, &["-c", MIXED_PROGRAM, case], &env);
    assert_eq!(u(&v, "total"), if shim_on { 4 * GIB } else { h100::MEMORY }, "{what}: {v}");
    Some(v)
}

fn half_precision_gemms(shim_on: bool) {
    let Some(v) = mixed_precision("gemm", shim_on) else { return };
    for dt in ["fp16", "bf16"] {
        let name = if dt == "fp16" { "float16" } else { "bfloat16" };
        let expected =
            serde_json::json!([[[256, 128], name], [[4, 64, 16], name], [[256, 64], name], [[4096, 1024], name]]);
        assert_eq!(v[dt], expected, "{dt} GEMMs: {v}");
    }
}

fn autocast(shim_on: bool) {
    let Some(v) = mixed_precision("autocast", shim_on) else { return };
    for (dt, name) in [("fp16", "float16"), ("bf16", "bfloat16")] {
        let expected = serde_json::json!([[[128, 64], name], [[128, 128], name], [[], "float32"]]);
        assert_eq!(v[dt], expected, "autocast to {dt}: products in {name}, the fp32 sum in float32: {v}");
    }
}

fn bf16_training_step(shim_on: bool) {
    let Some(v) = mixed_precision("train_bf16", shim_on) else { return };
    assert_eq!(v["loss"], serde_json::json!([[[], "bfloat16"]]), "{v}");
    let grads =
        serde_json::json!([[[512, 256], "bfloat16"], [[512], "bfloat16"], [[10, 512], "bfloat16"], [[10], "bfloat16"]]);
    assert_eq!(v["grads"], grads, "every parameter has its bf16 gradient: {v}");
    assert_eq!(v["state"], serde_json::json!(["exp_avg", "exp_avg_sq", "step"]), "AdamW stepped: {v}");
}

fn fp16_grad_scaler_step(shim_on: bool) {
    let Some(v) = mixed_precision("amp_fp16", shim_on) else { return };
    let expected = serde_json::json!([[[64, 10], "float16"], [[], "float32"], [[512, 256], "float32"]]);
    assert_eq!(v["seen"], expected, "fp16 logits, an fp32 loss and fp32 master gradients: {v}");
}

/// Each mixed-precision case's two tests, in a module of its name: `on_the_sim`, and
/// `under_the_shim` (libtessera.so with a 4 GiB limit).
macro_rules! on_the_sim_and_under_the_shim {
    ($($case:ident: $check:ident;)+) => {$(
        mod $case {
            #[test]
            fn on_the_sim() {
                super::$check(false);
            }

            #[test]
            fn under_the_shim() {
                super::$check(true);
            }
        }
    )+};
}

on_the_sim_and_under_the_shim! {
    pytorch_fp16_and_bf16_gemms_run: half_precision_gemms;
    pytorch_autocast_runs: autocast;
    pytorch_bf16_training_step_runs: bf16_training_step;
    pytorch_fp16_autocast_training_with_a_grad_scaler_runs: fp16_grad_scaler_step;
}
