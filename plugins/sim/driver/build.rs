//! Build steps of the simulated driver library:
//! - its SONAME: `libtessera_sim.so`, a placeholder exactly as long as the longest name it is laid
//!   out under (`libnvidia-ml.so.1`), which `tessera-sim install` rewrites in each per-name copy
//!   (`libcuda.so.1`, `libnvidia-ml.so.1`), as the real driver's two libraries carry;
//! - the not-modelled exports: every name NVIDIA's headers declare (`exports/*.names`, derived by
//!   `exports/derive-names.py`) that no module implements gets a function answering the
//!   not-supported code (see `src/cuda/not_modelled.rs`, `src/nvml/not_modelled.rs`).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Same length as "libnvidia-ml.so.1", so that either real SONAME fits in its place.
const PLACEHOLDER_SONAME: &str = "libtessera_sim.so";

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{PLACEHOLDER_SONAME}");
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    generate_cuda(&root, &out);
    generate_nvml(&root, &out);
    println!("cargo:rerun-if-changed=build.rs");
}

fn read(path: &Path) -> String {
    println!("cargo:rerun-if-changed={}", path.display());
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// CUDA: names not in the cuGetProcAddress table of modelled functions (`proc_table.rs`).
fn generate_cuda(root: &Path, out: &Path) {
    let table = read(&root.join("src/cuda/proc_table.rs"));
    let modelled: BTreeSet<&str> = table.split("symbol: \"").skip(1).filter_map(|s| s.split('"').next()).collect();
    let mut body = String::from("not_modelled! {\n");
    for line in read(&root.join("exports/cuda.names")).lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [symbol, base, version, flavour] = f[..] else { panic!("exports/cuda.names: bad line {line:?}") };
        if !modelled.contains(symbol) {
            writeln!(body, "    {symbol} = \"{base}\" {version} {flavour};").unwrap();
        }
    }
    body.push_str("}\n");
    std::fs::write(out.join("cuda_not_modelled.rs"), body).expect("write cuda_not_modelled.rs");
}

/// NVML: names no function under `src/nvml/` defines (its exports are `fn nvmlX(...)` items of
/// `nvml_exports!`, with any names after their `also`).
fn generate_nvml(root: &Path, out: &Path) {
    let mut modelled = BTreeSet::new();
    let dir = root.join("src/nvml");
    println!("cargo:rerun-if-changed={}", dir.display());
    for entry in std::fs::read_dir(&dir).expect("read src/nvml") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_some_and(|e| e == "rs") {
            let text = read(&path);
            for rest in text.split("fn nvml").skip(1) {
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                modelled.insert(format!("nvml{name}"));
                let header = rest.split('{').next().unwrap_or_default();
                if let Some((_, also)) = header.split_once(") also ") {
                    modelled.extend(also.split(',').map(|n| n.trim().to_string()));
                }
            }
        }
    }
    let mut body = String::from("not_modelled! {\n");
    for name in read(&root.join("exports/nvml.names")).lines().map(str::trim).filter(|l| !l.is_empty()) {
        if !modelled.contains(name) {
            writeln!(body, "    {name};").unwrap();
        }
    }
    body.push_str("}\n");
    std::fs::write(out.join("nvml_not_modelled.rs"), body).expect("write nvml_not_modelled.rs");
}
