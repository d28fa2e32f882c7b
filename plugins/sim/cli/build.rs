//! Builds the stub library `tessera-sim install --driver-root` lays out under the names of the
//! NVIDIA libraries the container toolkit injects (libnvidia-ptxjitcompiler, libnvidia-cfg, ...):
//! a loadable shared object that defines nothing, with a placeholder SONAME long enough for any
//! of their names, which the installer rewrites per copy.

use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let src = out.join("stub.c");
    std::fs::write(
        &src,
        "/* A stand-in for an NVIDIA library the simulated node does not provide. */\nint tessera_sim_stub_library;\n",
    )
    .expect("write stub source");
    let lib = out.join("libstub.so");
    let soname = format!("-Wl,-soname,{}", "x".repeat(48));
    let status = cc::Build::new()
        .get_compiler()
        .to_command()
        .args(["-shared", "-fPIC", "-nostartfiles", &soname, "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .expect("run the C compiler");
    assert!(status.success(), "building the stub library failed");
    println!("cargo:rerun-if-changed=build.rs");
}
