//! Build step of the ABI tables: [`cuda::EXPORTS`], every name a real `libcuda.so.1` exports with
//! the base name, CUDA version and default-stream flavour `cuGetProcAddress` hands it out under,
//! generated from the header list the simulated driver keeps (`plugins/sim/driver/exports/cuda.names`,
//! which its `derive-names.py` derives from NVIDIA's headers).

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let list = root.join("../../plugins/sim/driver/exports/cuda.names");
    println!("cargo:rerun-if-changed={}", list.display());
    println!("cargo:rerun-if-changed=build.rs");
    let text = std::fs::read_to_string(&list).unwrap_or_else(|e| panic!("read {}: {e}", list.display()));
    let mut body = String::from("&[\n");
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [symbol, base, version, flavour] = f[..] else { panic!("{}: bad line {line:?}", list.display()) };
        assert!(matches!(flavour, "No" | "Ptds" | "Ptsz"), "{}: bad flavour in {line:?}", list.display());
        let version: u32 = version.parse().unwrap_or_else(|_| panic!("{}: bad version in {line:?}", list.display()));
        writeln!(
            body,
            "    Export {{ symbol: {symbol:?}, base: {base:?}, version: {version}, flavour: Flavour::{flavour} }},"
        )
        .unwrap();
    }
    body.push_str("]\n");
    std::fs::write(out.join("cuda_exports.rs"), body).expect("write cuda_exports.rs");
}
