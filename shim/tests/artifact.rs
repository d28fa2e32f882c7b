//! The shipped library: it loads where glibc is as old as 2.17, nothing of ours runs at load
//! time, and programs that never touch CUDA run under it as before.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::elf::Elf;
use common::shim;

/// The artifact built for old glibc (scripts/test.sh builds it with cargo-zigbuild).
fn glibc_217_artifact() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf();
    root.join("target/glibc-2.17/x86_64-unknown-linux-gnu/release/libtessera.so")
}

/// `GLIBC_2.14` → (2, 14).
fn glibc_version(v: &str) -> Option<(u32, u32)> {
    let rest = v.strip_prefix("GLIBC_")?;
    let mut parts = rest.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
}

#[test]
fn the_shipped_library_needs_nothing_newer_than_glibc_2_17() {
    let lib = glibc_217_artifact();
    assert!(
        lib.exists(),
        "{} is missing: build it with `cargo zigbuild -p tessera-shim --release --target \
         x86_64-unknown-linux-gnu.2.17 --target-dir target/glibc-2.17` (scripts/test.sh does)",
        lib.display()
    );
    let versions = Elf::read(&lib).needed_versions();
    let glibc: Vec<_> = versions.iter().filter_map(|v| glibc_version(v).map(|n| (n, v))).collect();
    assert!(!glibc.is_empty(), "no GLIBC_ versions found in {versions:?}");
    let (newest, name) = glibc.iter().max().unwrap();
    assert!(*newest <= (2, 17), "{} needs {name} (all: {versions:?})", lib.display());
}

#[test]
fn nothing_of_ours_runs_at_load_time() {
    let elf = Elf::read(&shim());
    assert!(elf.section_named(".preinit_array").is_none());
    assert!(elf.section_named(".ctors").is_none());
    let symbols = elf.symbols();
    assert!(!symbols.is_empty(), "the debug build keeps its symbol table");
    let targets = elf.init_array_targets();
    assert!(!targets.is_empty(), "the C runtime's frame_dummy at least");
    for target in targets {
        let names: Vec<&str> = symbols.iter().filter(|s| s.1 == target).map(|s| s.0.as_str()).collect();
        // The C runtime's frame_dummy and Rust std's capture of argc/argv: nothing of Tessera.
        assert!(
            names.iter().any(|n| *n == "frame_dummy" || n.contains("ARGV_INIT_ARRAY")),
            ".init_array calls {target:#x} ({names:?})"
        );
    }
}

#[test]
fn programs_without_cuda_run_under_the_preload_as_before() {
    for (program, args) in [("sh", vec!["-c", "true"]), ("sh", vec!["-c", "echo hello"]), ("ls", vec!["/"])] {
        let plain = Command::new(program).args(&args).output().unwrap();
        let preloaded = Command::new(program).args(&args).env("LD_PRELOAD", shim()).output().unwrap();
        assert!(preloaded.status.success(), "{program} {args:?}: {preloaded:?}");
        assert_eq!(preloaded.stdout, plain.stdout, "{program} {args:?}");
        assert!(preloaded.stderr.is_empty(), "{program} {args:?}: {}", String::from_utf8_lossy(&preloaded.stderr));
    }
    // Even with a broken config: nothing is read before the first CUDA call.
    let out = Command::new("sh")
        .args(["-c", "true"])
        .env("LD_PRELOAD", shim())
        .env("TESSERA_LIMITS", "/nonexistent/limits")
        .output()
        .unwrap();
    assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
}
