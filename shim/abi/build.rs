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
    // The names, one after another in one string, and a row per name of plain numbers into it: a
    // table of `&str`s would be 1,300 pointers that the dynamic loader relocates, on pages it
    // must copy, in every process libtessera.so is preloaded into.
    let (mut names, mut rows) = (String::new(), String::from("[\n"));
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [symbol, base, version, flavour] = f[..] else { panic!("{}: bad line {line:?}", list.display()) };
        assert!(matches!(flavour, "No" | "Ptds" | "Ptsz"), "{}: bad flavour in {line:?}", list.display());
        let version: u32 = version.parse().unwrap_or_else(|_| panic!("{}: bad version in {line:?}", list.display()));
        assert!(symbol.starts_with(base), "{}: {symbol} does not start with its base {base}", list.display());
        let (start, len, base_len) = (names.len(), symbol.len(), base.len());
        assert!(len <= usize::from(u16::MAX), "{}: {symbol} is too long", list.display());
        names.push_str(symbol);
        writeln!(
            rows,
            "    Row {{ start: {start}, len: {len}, base_len: {base_len}, version: {version}, flavour: Flavour::{flavour} }},"
        )
        .unwrap();
    }
    rows.push_str("]\n");
    assert!(u32::try_from(names.len()).is_ok(), "the names fit u32 offsets");
    std::fs::write(out.join("cuda_export_names.rs"), format!("{names:?}\n")).expect("write cuda_export_names.rs");
    std::fs::write(out.join("cuda_export_rows.rs"), rows).expect("write cuda_export_rows.rs");
}
