//! JAX (jaxlib with its CUDA 12 plugin, XLA compiling with ptxas from NVIDIA's wheel) runs on a
//! simulated H200: it lists the GPU, runs jitted matmuls in fp32 and bf16 (XLA's Triton GEMMs,
//! autotuned by launching them; timed by name, results not computed: shapes and dtypes checked),
//! a bf16 training step (which XLA runs as a CUDA graph, its kernels joined by programmatic
//! edges), an fp16 convolution (cuDNN), FFTs (cuFFT) and a triangular solve (cuBLAS), and
//! preallocates 75% of the device's memory, its default (`XLA_PYTHON_CLIENT_MEM_FRACTION`),
//! from what `cuMemGetInfo` says the total is. Under libtessera.so with a 4 GiB limit that is the
//! limit: 3 GiB, as a real H200 showed, in JAX's memory stats, in NVML through the shim and in
//! the simulated driver's own list of processes. Nothing XLA, cuBLAS or cuDNN calls may be a
//! function the sim does not model (`TESSERA_SIM_TRACE` names them): the Triton GEMMs' tensor
//! maps were, and the autotuner quietly dropped every candidate that used one.
//!
//! On the default node's eight H100s it places work on each GPU, maps a function over all of
//! them (`jax.pmap`, whose copies XLA makes with graph memcpy nodes) and moves arrays between them.
//!
//! JAX decides there is an NVIDIA GPU only when `/dev/nvidiactl` or `/dev/nvidia0` exists, as in
//! a container given a GPU, so it runs against the node's driver root
//! (`scripts/sim-driver-root-run.sh`: a private mount namespace, so root). JAX lives in a virtual
//! environment `scripts/deps.sh` makes (`target/jax-runtime`, or `TESSERA_JAX_RUNTIME`). Without
//! it, or without root, the tests print a SKIP line, and fail when `TESSERA_REQUIRE_RUNTIMES` is
//! set, as in CI.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tessera_sim_testkit::{SimNode, binary};
use tessera_tests::{GIB, MIB, json_u64 as u, shim, venv_python};

/// The node: one H200, the board a real JAX run was read on.
const ONE_H200: &str = "[[gpu]]\nmodel = \"H200-141GB\"\ncount = 1\n";
/// What CUDA says an H200 holds (`cuDeviceTotalMem`, `cuMemGetInfo`'s total: the card's reading).
const H200_CUDA_TOTAL: u64 = 150_109_880_320;
/// NVML's total for the board.
const H200_NVML_TOTAL: u64 = 150_754_820_096;
/// What the context and the libraries JAX loads (cuBLAS, cuDNN, its kernels) hold on the device
/// beside the preallocation, at most.
const BESIDE_THE_POOL: u64 = 512 * MIB;

/// What the JAX program does; it prints one JSON line of what it saw.
const PROGRAM: &str = r#"
import json, os, subprocess, sys

# NVML's view of device 0 through ctypes: the board's (or, under libtessera.so, the limit's)
# total and used memory, and what it lists process `pid` as holding.
NVML = r'''
import ctypes
from ctypes import byref, c_uint, c_ulonglong
class Mem(ctypes.Structure):
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]
class Proc(ctypes.Structure):
    _fields_ = [("pid", c_uint), ("used", c_ulonglong), ("gi", c_uint), ("ci", c_uint)]
def nvml(pid):
    nv = ctypes.CDLL("libnvidia-ml.so.1")
    def ok(rc, what):
        assert rc == 0, f"{what}: NVML return {rc}"
    ok(nv.nvmlInit_v2(), "nvmlInit")
    dev, mem = ctypes.c_void_p(), Mem()
    ok(nv.nvmlDeviceGetHandleByIndex_v2(0, byref(dev)), "nvmlDeviceGetHandleByIndex")
    ok(nv.nvmlDeviceGetMemoryInfo(dev, byref(mem)), "nvmlDeviceGetMemoryInfo")
    n, procs = c_uint(16), (Proc * 16)()
    ok(nv.nvmlDeviceGetComputeRunningProcesses_v3(dev, byref(n), procs), "nvmlDeviceGetComputeRunningProcesses")
    held = [p.used for p in procs[:n.value] if p.pid == pid]
    return {"total": mem.total, "used": mem.used, "process": held[0] if held else None}
'''
exec(NVML)

import jax, jax.numpy as jnp, jax.scipy.linalg

devs = jax.devices()
out = {"backend": jax.default_backend(), "devices": [[d.platform, d.device_kind] for d in devs]}
matmul = jax.jit(lambda a, b: a @ b)
for dt in (jnp.float32, jnp.bfloat16):
    k1, k2 = jax.random.split(jax.random.key(0))
    z = matmul(jax.random.normal(k1, (256, 512), dt), jax.random.normal(k2, (512, 128), dt)).block_until_ready()
    out[jnp.dtype(dt).name] = [list(z.shape), str(z.dtype), z.devices() == {devs[0]}]
# A training step (gradients, an update): XLA runs its fusions as a CUDA graph, kernels joined by
# programmatic edges; and a convolution (cuDNN).
def loss(p, x):
    return jnp.mean((jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]) ** 2)
p = {"w1": jax.random.normal(k1, (256, 512), jnp.bfloat16), "b1": jnp.zeros(512, jnp.bfloat16),
     "w2": jax.random.normal(k2, (512, 10), jnp.bfloat16)}
step = jax.jit(lambda p, x: jax.tree.map(lambda a, g: a - 1e-3 * g, p, jax.grad(loss)(p, x)))
p = jax.block_until_ready(step(p, jax.random.normal(k2, (64, 256), jnp.bfloat16)))
out["step"] = sorted([k, list(v.shape), str(v.dtype)] for k, v in p.items())
dims = ("NHWC", "HWIO", "NHWC")
conv = jax.jit(lambda a, b: jax.lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=dims))
c = conv(jnp.ones((8, 32, 32, 64), jnp.float16), jnp.ones((3, 3, 64, 128), jnp.float16)).block_until_ready()
out["conv"] = [list(c.shape), str(c.dtype)]
# FFTs (cuFFT, which takes its kernels through the driver's tools' module table).
f = jax.jit(jnp.fft.fft)(jnp.ones(1024, jnp.complex64)).block_until_ready()
r = jax.jit(jnp.fft.rfft2)(jnp.ones((64, 128), jnp.float32)).block_until_ready()
out["fft"] = [[list(f.shape), str(f.dtype)], [list(r.shape), str(r.dtype)]]
# A triangular solve (cuBLAS's trsm, which keys its workspaces by stream through the driver).
t = jax.jit(lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True))(jnp.eye(64) * 2, jnp.ones((64, 3)))
out["trsm"] = [list(t.block_until_ready().shape), str(t.dtype)]
stats = devs[0].memory_stats()
out["bytes_limit"], out["pool_bytes"] = stats["bytes_limit"], stats["pool_bytes"]
# NVML in this process (through libtessera.so where it is preloaded), and the simulated
# driver's own (a child without the preload).
out["nvml"] = nvml(os.getpid())
env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
child = NVML + "\nimport json, sys\nprint(json.dumps(nvml(int(sys.argv[1]))))"
sim = subprocess.run([sys.executable, "-c", child, str(os.getpid())], env=env, capture_output=True, text=True)
assert sim.returncode == 0, sim.stderr
out["sim"] = json.loads(sim.stdout)
print(json.dumps(out))
"#;

/// The Python of the JAX environment, where jax and its CUDA plugin import; else `None`.
fn jax_python() -> Option<PathBuf> {
    venv_python("TESSERA_JAX_RUNTIME", "jax-runtime", "import jax, jax_plugins.xla_cuda12, jax_cuda12_plugin", "JAX")
}

/// Whether this process may make the mount namespace the driver root needs; a SKIP line when
/// not (an error under `TESSERA_REQUIRE_RUNTIMES`).
fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let why = "not root: JAX looks for /dev/nvidiactl, which scripts/sim-driver-root-run.sh lays in a mount namespace";
    assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "TESSERA_REQUIRE_RUNTIMES is set, but {why}");
    println!("SKIP: {why}");
    false
}

/// Runs `program` with JAX on `node` through the node's driver root, with `extra` environment;
/// the JSON its last line prints. `None` (a SKIP line) without JAX or root.
fn run_program(node: &SimNode, program: &str, extra: &[(&str, &str)]) -> Option<Value> {
    let python = jax_python()?;
    if !root() {
        return None;
    }
    let driver_root = node.root.join("driver");
    let out = node.command(binary("tessera-sim")).arg("install").arg("--driver-root").arg(&driver_root).output();
    assert!(out.as_ref().is_ok_and(|o| o.status.success()), "tessera-sim install --driver-root: {out:?}");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/sim-driver-root-run.sh");
    let (root, python) = (driver_root.to_str().expect("utf-8 path"), python.to_str().expect("utf-8 path"));
    // JAX_PLATFORMS=cuda: a CUDA backend that does not start is an error, not a quiet CPU run.
    // TESSERA_SIM_TRACE: the sim names each call it does not model.
    let out = node
        .command(&script)
        .args([root, "--", python, "-c", program])
        .envs([("JAX_PLATFORMS", "cuda"), ("TESSERA_SIM_TRACE", "1")])
        .envs(extra.iter().copied())
        .env_remove("CUDA_VISIBLE_DEVICES")
        .output()
        .expect("run JAX");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "JAX on the sim failed ({}):\n{stdout}\n{stderr}", out.status);
    let unmodelled: Vec<&str> = stderr.lines().filter(|l| l.contains("not modelled (CUDA_ERROR")).collect();
    assert!(unmodelled.is_empty(), "XLA called what the sim does not model: {unmodelled:?}");
    Some(serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {stdout}")))
}

/// Runs [`PROGRAM`] on a one-H200 node of its own with `extra` environment; what it saw, after
/// the checks every run shares: one CUDA device named as the board, the matmuls', training
/// step's and convolution's shapes and dtypes, the pool as large as the preallocation.
fn run_jax(extra: &[(&str, &str)]) -> Option<Value> {
    let v = run_program(&SimNode::with_description(ONE_H200), PROGRAM, extra)?;
    assert_eq!(v["backend"], "gpu", "{v}");
    assert_eq!(v["devices"], json!([["gpu", "NVIDIA H200"]]), "one CUDA device, the board: {v}");
    assert_eq!(v["float32"], json!([[256, 128], "float32", true]), "fp32 matmul: {v}");
    assert_eq!(v["bfloat16"], json!([[256, 128], "bfloat16", true]), "bf16 matmul: {v}");
    let step = json!([["b1", [512], "bfloat16"], ["w1", [256, 512], "bfloat16"], ["w2", [512, 10], "bfloat16"]]);
    assert_eq!(v["step"], step, "a training step, run as a CUDA graph: {v}");
    assert_eq!(v["conv"], json!([[8, 32, 32, 128], "float16"]), "a cuDNN convolution: {v}");
    assert_eq!(v["fft"], json!([[[1024], "complex64"], [[64, 65], "complex64"]]), "cuFFT: {v}");
    assert_eq!(v["trsm"], json!([[64, 3], "float32"]), "a triangular solve: {v}");
    assert_eq!(u(&v, "pool_bytes"), u(&v, "bytes_limit"), "the whole pool is taken up front: {v}");
    Some(v)
}

/// What XLA preallocates out of `total`: 75%, rounded up to 2 MiB.
fn three_quarters(total: u64) -> u64 {
    (total * 3 / 4).div_ceil(2 * MIB) * 2 * MIB
}

#[test]
fn jax_runs_on_the_simulated_node_and_preallocates_three_quarters_of_the_board() {
    let Some(v) = run_jax(&[]) else { return };
    let pool = three_quarters(H200_CUDA_TOTAL);
    assert_eq!(u(&v, "bytes_limit"), pool, "75% of what cuMemGetInfo says: {v}");
    assert_eq!(v["nvml"], v["sim"], "without the shim NVML is the sim's: {v}");
    assert_eq!(u(&v["sim"], "total"), H200_NVML_TOTAL, "{v}");
    let held = u(&v["sim"], "process");
    assert!((pool..=pool + BESIDE_THE_POOL).contains(&held), "NVML lists the process holding the pool: {v}");
}

#[test]
fn jax_under_the_shim_preallocates_three_quarters_of_its_limit() {
    let shim = shim();
    let Some(v) = run_jax(&[("LD_PRELOAD", shim.to_str().expect("utf-8 path")), ("TESSERA_MEMORY_LIMIT", "4GiB")])
    else {
        return;
    };
    assert_eq!(u(&v, "bytes_limit"), 3 * GIB, "75% of the 4 GiB limit, which the shim shows as the total: {v}");
    assert_eq!(u(&v["nvml"], "total"), 4 * GIB, "NVML through the shim: the limit is the memory: {v}");
    for (view, key) in [("nvml", "used"), ("nvml", "process"), ("sim", "process")] {
        let held = u(&v[view], key);
        assert!((3 * GIB..4 * GIB).contains(&held), "{view} {key}: the pool and the context, within the limit: {v}");
    }
    assert_eq!(u(&v["sim"], "total"), H200_NVML_TOTAL, "the sim's own NVML shows the board: {v}");
}

/// On the default node's eight H100s: each GPU listed, a jitted matmul placed on each, a `pmap`
/// over all of them (XLA copies between its buffers with graph memcpy nodes), an array moved from
/// the first GPU to the last.
const EIGHT_GPUS: &str = r#"
import json, jax, jax.numpy as jnp
devs = jax.devices()
out = {"devices": [[d.id, d.device_kind] for d in devs]}
ys = [jax.jit(lambda a: a @ a)(jax.device_put(jnp.ones((256, 256)), d)).block_until_ready() for d in devs]
out["placed"] = [next(iter(y.devices())).id for y in ys]
out["pmap"] = list(jax.pmap(lambda a: a * 2)(jnp.ones((len(devs), 4))).block_until_ready().shape)
out["moved"] = next(iter(jax.device_put(ys[0], devs[-1]).block_until_ready().devices())).id
print(json.dumps(out))
"#;

#[test]
fn jax_spreads_work_over_eight_gpus() {
    let Some(v) = run_program(&SimNode::new(), EIGHT_GPUS, &[]) else { return };
    let devices: Vec<Value> = (0..8).map(|i| json!([i, "NVIDIA H100 80GB HBM3"])).collect();
    assert_eq!(v["devices"], json!(devices), "the eight GPUs: {v}");
    assert_eq!(v["placed"], json!([0, 1, 2, 3, 4, 5, 6, 7]), "a matmul on each: {v}");
    assert_eq!(v["pmap"], json!([8, 4]), "a pmap over them: {v}");
    assert_eq!(v["moved"], 7, "an array moved to the last: {v}");
}
