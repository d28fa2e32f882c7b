//! A minimal reader of 64-bit little-endian ELF files, for the tests that look inside a built
//! library: its sections, symbols and version needs.

use std::path::Path;

const SHT_SYMTAB: u32 = 2;
const SHT_DYNSYM: u32 = 11;

/// An ELF file read whole.
pub struct Elf {
    data: Vec<u8>,
}

pub struct Section {
    pub kind: u32,
    pub addr: u64,
    pub offset: usize,
    pub size: usize,
    pub link: usize,
    pub entsize: usize,
}

impl Elf {
    pub fn read(path: &Path) -> Elf {
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

    pub fn sections(&self) -> Vec<Section> {
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

    pub fn section_named(&self, name: &str) -> Option<Section> {
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
    pub fn needed_versions(&self) -> Vec<String> {
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
    pub fn symbols(&self) -> Vec<(String, u64)> {
        self.symbols_of(SHT_SYMTAB)
    }

    /// (name, value) of every symbol the file exports to the loader.
    pub fn dynamic_symbols(&self) -> Vec<(String, u64)> {
        self.symbols_of(SHT_DYNSYM)
    }

    fn symbols_of(&self, kind: u32) -> Vec<(String, u64)> {
        let sections = self.sections();
        let Some(symtab) = sections.iter().find(|s| s.kind == kind) else { return Vec::new() };
        let strtab = sections[symtab.link].offset;
        (0..symtab.size / symtab.entsize)
            .map(|i| {
                let e = symtab.offset + i * symtab.entsize;
                (self.cstr(strtab + self.u32(e) as usize).to_string(), self.u64(e + 8))
            })
            .collect()
    }

    /// The functions `.init_array` calls: the addends of the relocations that fill it.
    pub fn init_array_targets(&self) -> Vec<u64> {
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
