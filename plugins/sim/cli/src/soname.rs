//! Rewrites the SONAME of a copy of the driver library, so that each name it is laid out under
//! carries the real library's (`libcuda.so.1`, `libnvidia-ml.so.1`): a program linked against it
//! with `-lcuda` records `libcuda.so.1`, as against NVIDIA's. The library is linked with a
//! placeholder SONAME as long as the longest real one, so the new name is written in its place
//! (64-bit little-endian ELF only, what the library is built as).

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const DT_NULL: u64 = 0;
const DT_STRTAB: u64 = 5;
const DT_SONAME: u64 = 14;

fn u16_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?).into())
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// A program header: (type, file offset, virtual address, size in the file).
fn segments(b: &[u8]) -> Option<Vec<(u32, u64, u64, u64)>> {
    let (phoff, phentsize, phnum) = (u64_at(b, 0x20)?, u16_at(b, 0x36)?, u16_at(b, 0x38)?);
    (0..phnum)
        .map(|i| {
            let at = usize::try_from(phoff + i * phentsize).ok()?;
            Some((u32_at(b, at)?, u64_at(b, at + 8)?, u64_at(b, at + 16)?, u64_at(b, at + 32)?))
        })
        .collect()
}

/// The file range of the SONAME string (without its NUL).
fn soname_range(b: &[u8]) -> Result<std::ops::Range<usize>, String> {
    if b.get(..6) != Some(b"\x7fELF\x02\x01") {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let segs = segments(b).ok_or("truncated program headers")?;
    let &(_, dyn_off, _, dyn_size) = segs.iter().find(|s| s.0 == PT_DYNAMIC).ok_or("no dynamic segment")?;
    let (mut strtab, mut soname) = (None, None);
    for at in (dyn_off..dyn_off + dyn_size).step_by(16) {
        let at = usize::try_from(at).map_err(|_| "bad dynamic offset")?;
        let (tag, val) = (u64_at(b, at).ok_or("truncated dynamic section")?, u64_at(b, at + 8).ok_or("truncated")?);
        match tag {
            DT_NULL => break,
            DT_STRTAB => strtab = Some(val),
            DT_SONAME => soname = Some(val),
            _ => {}
        }
    }
    let (strtab, soname) =
        (strtab.ok_or("no string table")?, soname.ok_or("no SONAME (was the library linked with one?)")?);
    let &(_, off, vaddr, _) = segs
        .iter()
        .find(|s| s.0 == PT_LOAD && (s.2..s.2 + s.3).contains(&strtab))
        .ok_or("string table outside the loaded segments")?;
    let start = usize::try_from(off + (strtab - vaddr) + soname).map_err(|_| "bad SONAME offset")?;
    let len = b.get(start..).and_then(|s| s.iter().position(|&c| c == 0)).ok_or("unterminated SONAME")?;
    Ok(start..start + len)
}

/// The library's SONAME.
#[cfg(test)]
pub fn read(elf: &[u8]) -> Result<String, String> {
    let r = soname_range(elf)?;
    Ok(String::from_utf8_lossy(&elf[r]).into_owned())
}

/// Writes `name` as the SONAME, in place of the current one (which must be at least as long).
pub fn set(elf: &mut [u8], name: &str) -> Result<(), String> {
    let r = soname_range(elf)?;
    if name.len() > r.len() || name.contains('\0') {
        return Err(format!("SONAME {name:?} does not fit in place of {:?}", String::from_utf8_lossy(&elf[r])));
    }
    let field = &mut elf[r.start..=r.end];
    field.fill(0);
    field[..name.len()].copy_from_slice(name.as_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn library() -> Vec<u8> {
        std::fs::read(tessera_sim_testkit::sim_library()).unwrap()
    }

    #[test]
    fn renames_the_built_library() {
        let mut elf = library();
        assert_eq!(read(&elf).unwrap(), "libtessera_sim.so");
        set(&mut elf, "libnvidia-ml.so.1").unwrap();
        assert_eq!(read(&elf).unwrap(), "libnvidia-ml.so.1");
        set(&mut elf, "libcuda.so.1").unwrap();
        assert_eq!(read(&elf).unwrap(), "libcuda.so.1");
        assert!(set(&mut elf, "libcuda.so.1.and.more").unwrap_err().contains("does not fit"));
    }

    #[test]
    fn damaged_files_are_errors_not_panics() {
        let elf = library();
        assert!(read(b"#!/bin/sh\n").unwrap_err().contains("not a 64-bit"));
        for cut in [7, 64, 4096] {
            assert!(read(&elf[..cut]).is_err(), "cut at {cut}");
        }
    }
}
