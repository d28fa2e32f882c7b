//! Builds a link stub `libcuda.so` (soname libcuda.so.1) for `tessera-workload-linked`, the way
//! CUDA toolkits ship `lib64/stubs/libcuda.so`: it lets the program link directly against the
//! driver API; at run time the real driver (or the simulated node) is loaded instead.

use std::path::PathBuf;

// The functions tessera-workload-linked calls directly (src/bin/linked.rs).
const LINKED: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD8_v2",
    "cuIpcGetMemHandle",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuLaunchCooperativeKernel",
    "cuLaunchKernelEx",
    "cuGraphCreate",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphAddKernelNode_v2",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventElapsedTime",
    "cuEventDestroy_v2",
    "cuGetErrorName",
];

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let src = out.join("cuda_stub.c");
    let body: String = LINKED.iter().map(|f| format!("int {f}(void) {{ return 999; }}\n")).collect();
    std::fs::write(&src, body).expect("write stub source");
    let compiler = cc::Build::new().get_compiler();
    let lib = out.join("libcuda.so");
    let status = compiler
        .to_command()
        .args(["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .expect("run the C compiler");
    assert!(status.success(), "building the libcuda link stub failed");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rerun-if-changed=build.rs");
}
