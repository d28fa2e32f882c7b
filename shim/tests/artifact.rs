//! The shipped library: it loads where glibc is as old as 2.17, nothing of ours runs at load
//! time, and programs that never touch CUDA run under it as before.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::shim;

/// The artifact built for old glibc (scripts/test.sh builds it with cargo-zigbuild).
fn glibc_217_artifact() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf();
    root.join("target/glibc-2.17/x86_64-unknown-linux-gnu/release/libtessera.so")
}

/// A minimal reader of 64-bit little-endian ELF files: sections, symbols, version needs.
struct Elf {
    data: Vec<u8>,
}

struct Section {
    kind: u32,
    addr: u64,
    offset: usize,
    size: usize,
    link: usize,
    entsize: usize,
}

impl Elf {
    fn read(path: &Path) -> Elf {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(&data[..4], b"\x7fELF", "{} is not ELF", path.display());
        assert_eq!(data[4], 2, "64-bit");
        assert_eq!(data[5], 1, "little-endian");
        Elf { data }
    }

    fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes(self.data[at..at + 2].try_into().unwrap())
    }
    fn u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.data[at..at + 4].try_into().unwrap())
    }
    fn u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.data[at..at + 8].try_into().unwrap())
    }

    fn sections(&self) -> Vec<Section> {
        let shoff = self.u64(0x28) as usize;
        let (shentsize, shnum) = (self.u16(0x3a) as usize, self.u16(0x3c) as usize);
        (0..shnum)
            .map(|i| {
                let h = shoff + i * shentsize;
                Section {
                    kind: self.u32(h + 4),
                    addr: self.u64(h + 0x10),
                    offset: self.u64(h + 0x18) as usize,
                    size: self.u64(h + 0x20) as usize,
                    link: self.u32(h + 0x28) as usize,
                    entsize: self.u64(h + 0x38) as usize,
                }
            })
            .collect()
    }

    fn section_named(&self, name: &str) -> Option<Section> {
        let shstrndx = self.u16(0x3e) as usize;
        let sections = self.sections();
        let names = sections[shstrndx].offset;
        let shoff = self.u64(0x28) as usize;
        let shentsize = self.u16(0x3a) as usize;
        sections.into_iter().enumerate().find_map(|(i, s)| {
            let n = self.u32(shoff + i * shentsize) as usize;
            (self.cstr(names + n) == name).then_some(s)
        })
    }

    fn cstr(&self, at: usize) -> &str {
        let end = self.data[at..].iter().position(|&b| b == 0).unwrap() + at;
        std::str::from_utf8(&self.data[at..end]).unwrap()
    }

    /// The versions named in the version-needs section (`GLIBC_2.14`, ...).
    fn needed_versions(&self) -> Vec<String> {
        let sections = self.sections();
        let mut out = Vec::new();
        for s in sections.iter().filter(|s| s.kind == 0x6fff_fffe) {
            let strtab = sections[s.link].offset;
            let mut at = s.offset;
            loop {
                let (cnt, aux, next) = (self.u16(at + 2), self.u32(at + 8) as usize, self.u32(at + 12) as usize);
                let mut a = at + aux;
                for _ in 0..cnt {
                    out.push(self.cstr(strtab + self.u32(a + 8) as usize).to_string());
                    a += self.u32(a + 12) as usize;
                }
                if next == 0 {
                    break;
                }
                at += next;
            }
        }
        out
    }

    /// (name, value) of every symbol of the full symbol table.
    fn symbols(&self) -> Vec<(String, u64)> {
        let sections = self.sections();
        let Some(symtab) = sections.iter().find(|s| s.kind == 2) else { return Vec::new() };
        let strtab = sections[symtab.link].offset;
        (0..symtab.size / symtab.entsize)
            .map(|i| {
                let e = symtab.offset + i * symtab.entsize;
                (self.cstr(strtab + self.u32(e) as usize).to_string(), self.u64(e + 8))
            })
            .collect()
    }

    /// The functions `.init_array` calls: the addends of the relocations that fill it.
    fn init_array_targets(&self) -> Vec<u64> {
        let Some(init) = self.section_named(".init_array") else { return Vec::new() };
        let range = init.addr..init.addr + init.size as u64;
        let mut out = Vec::new();
        for s in self.sections().iter().filter(|s| s.kind == 4) {
            for i in 0..s.size / s.entsize {
                let e = s.offset + i * s.entsize;
                let (offset, addend) = (self.u64(e), self.u64(e + 16));
                if range.contains(&offset) {
                    out.push(addend);
                }
            }
        }
        // Entries filled in the file itself (no relocation).
        for i in 0..init.size / 8 {
            let v = self.u64(init.offset + i * 8);
            if v != 0 && v != u64::MAX {
                out.push(v);
            }
        }
        out
    }
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
