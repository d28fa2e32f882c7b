//! Finds a function in a loaded library by reading its ELF dynamic symbol table, without calling
//! `dlsym`.
//!
//! This is how the interposed `dlsym`/`dlvsym` find glibc's own: every by-name lookup of
//! `dlvsym` from this library would resolve to our own export (a preloaded definition interposes
//! even versioned references), and a lookup must not allocate or recurse (a malloc interposer may
//! call `dlsym` from inside malloc). `dl_iterate_phdr` takes the loader's (recursive) lock and
//! allocates nothing; the hash tables are read in place.

use std::ffi::{CStr, c_int, c_void};

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const DT_NULL: i64 = 0;
const DT_HASH: i64 = 4;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_GNU_HASH: i64 = 0x6fff_fef5;
const DT_VERSYM: i64 = 0x6fff_fff0;
const DT_VERDEF: i64 = 0x6fff_fffc;
const STT_FUNC: u8 = 2;

#[repr(C)]
struct Dyn {
    tag: i64,
    val: u64,
}

#[repr(C)]
struct Sym {
    name: u32,
    info: u8,
    other: u8,
    shndx: u16,
    value: u64,
    size: u64,
}

#[repr(C)]
struct Verdef {
    version: u16,
    flags: u16,
    ndx: u16,
    cnt: u16,
    hash: u32,
    aux: u32,
    next: u32,
}

#[repr(C)]
struct Verdaux {
    name: u32,
    next: u32,
}

struct Query<'a> {
    /// File names (last path component) of the libraries to search, in order of preference.
    libs: &'a [&'a [u8]],
    symbol: &'a [u8],
    /// Symbol version wanted; `None`: the default (non-hidden) one.
    version: Option<&'a [u8]>,
    /// (index in `libs`, address) of the best match so far.
    found: Option<(usize, usize)>,
}

/// The address of `symbol` (of `version`, or the default version) in the first of `libs` (file
/// names such as `b"libc.so.6"`) that is loaded and defines it.
pub(crate) fn lookup(libs: &[&[u8]], symbol: &[u8], version: Option<&[u8]>) -> Option<usize> {
    let mut q = Query { libs, symbol, version, found: None };
    // SAFETY: the callback only reads the loader's program headers and the mapped tables they
    // point to, for the duration of the call; `q` outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut q).cast()) };
    q.found.map(|(_, a)| a)
}

/// One loaded object's symbol tables, read once for many look-ups (the driver's ~110 functions
/// at start-up: a hash probe each, where `dlsym` costs several hundred instructions a call).
pub(crate) struct Object {
    tables: Tables,
}

impl Object {
    /// The loaded object whose mapped segments hold `addr` (an address `dlsym` gave for one of
    /// its symbols). Such an object is never unloaded here (the driver's libraries are opened and
    /// never closed), so its tables stay mapped for the process's life.
    pub(crate) fn containing(addr: *mut c_void) -> Option<Object> {
        if addr.is_null() {
            return None;
        }
        let mut q = Containing { addr: addr as usize, found: None };
        // SAFETY: the callback only reads the loader's program headers and the mapped tables they
        // point to, for the duration of the call; `q` outlives the call.
        unsafe { libc::dl_iterate_phdr(Some(visit_containing), (&raw mut q).cast()) };
        q.found.map(|tables| Object { tables })
    }

    /// The default version of the function `symbol` (no NUL) defined in this object, or `None`
    /// (not defined here, or not a plain function: the caller asks `dlsym`).
    pub(crate) fn function(&self, symbol: &[u8]) -> Option<usize> {
        self.tables.find(symbol, None)
    }
}

struct Containing {
    addr: usize,
    found: Option<Tables>,
}

unsafe extern "C" fn visit_containing(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
    // SAFETY: data is the Containing passed to dl_iterate_phdr; info is the loader's record of
    // one loaded object, valid during the callback.
    let (q, info) = unsafe { (&mut *data.cast::<Containing>(), &*info) };
    let base = info.dlpi_addr as usize;
    // SAFETY: dlpi_phdr holds dlpi_phnum program headers of the loaded object.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
    let holds = phdrs.iter().any(|p| {
        let start = base.wrapping_add(p.p_vaddr as usize);
        p.p_type == PT_LOAD && q.addr >= start && q.addr - start < p.p_memsz as usize
    });
    if !holds {
        return 0;
    }
    // SAFETY: info describes a loaded object whose headers and dynamic section are mapped.
    q.found = unsafe { tables_of(info) };
    1
}

unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
    // SAFETY: data is the Query passed to dl_iterate_phdr; info is the loader's record of one
    // loaded object, valid during the callback.
    let (q, info) = unsafe { (&mut *data.cast::<Query>(), &*info) };
    if info.dlpi_name.is_null() {
        return 0;
    }
    // SAFETY: dlpi_name is a NUL-terminated path owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes();
    let file = name.rsplit(|&b| b == b'/').next().unwrap_or(name);
    let Some(rank) = q.libs.iter().position(|l| *l == file) else { return 0 };
    if q.found.is_some_and(|(r, _)| r <= rank) {
        return 0;
    }
    // SAFETY: info describes a loaded object whose headers and dynamic section are mapped.
    if let Some(addr) = unsafe { find_in(info, q.symbol, q.version) } {
        q.found = Some((rank, addr));
    }
    0
}

/// Tables of one object.
struct Tables {
    base: usize,
    strtab: *const u8,
    symtab: *const Sym,
    versym: *const u16,
    verdef: *const Verdef,
    gnu_hash: *const u32,
    hash: *const u32,
}

/// Looks the symbol up in one object.
///
/// # Safety
/// `info` must describe a loaded object (from `dl_iterate_phdr`).
unsafe fn find_in(info: &libc::dl_phdr_info, symbol: &[u8], version: Option<&[u8]>) -> Option<usize> {
    // SAFETY: the caller's promise.
    unsafe { tables_of(info) }?.find(symbol, version)
}

/// One object's tables, from its dynamic section.
///
/// # Safety
/// `info` must describe a loaded object (from `dl_iterate_phdr`).
unsafe fn tables_of(info: &libc::dl_phdr_info) -> Option<Tables> {
    let base = info.dlpi_addr as usize;
    // SAFETY: dlpi_phdr holds dlpi_phnum program headers of the loaded object.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
    let dynamic = phdrs.iter().find(|p| p.p_type == PT_DYNAMIC)?;
    let mut dynp = (base + dynamic.p_vaddr as usize) as *const Dyn;
    let mut t = Tables {
        base,
        strtab: std::ptr::null(),
        symtab: std::ptr::null(),
        versym: std::ptr::null(),
        verdef: std::ptr::null(),
        gnu_hash: std::ptr::null(),
        hash: std::ptr::null(),
    };
    // The loader relocates the dynamic section's addresses in place on most targets; where it
    // does not they are still relative to the load base.
    let fix = |v: u64| -> usize {
        let v = v as usize;
        if v < base { base + v } else { v }
    };
    loop {
        // SAFETY: the dynamic section is an array of Dyn ending with DT_NULL.
        let d = unsafe { &*dynp };
        match d.tag {
            DT_NULL => break,
            DT_STRTAB => t.strtab = fix(d.val) as *const u8,
            DT_SYMTAB => t.symtab = fix(d.val) as *const Sym,
            DT_VERSYM => t.versym = fix(d.val) as *const u16,
            DT_VERDEF => t.verdef = fix(d.val) as *const Verdef,
            DT_GNU_HASH => t.gnu_hash = fix(d.val) as *const u32,
            DT_HASH => t.hash = fix(d.val) as *const u32,
            _ => {}
        }
        // SAFETY: still inside the array (DT_NULL not yet seen).
        dynp = unsafe { dynp.add(1) };
    }
    if t.strtab.is_null() || t.symtab.is_null() {
        return None;
    }
    Some(t)
}

impl Tables {
    /// The address of `symbol` (of `version`, or the default version) in this object.
    fn find(&self, symbol: &[u8], version: Option<&[u8]>) -> Option<usize> {
        let mut best: Option<usize> = None;
        let mut consider = |idx: u32| {
            // SAFETY: idx comes from the object's own hash table, so it indexes its symbol table.
            if let Some(a) = unsafe { self.matches(idx, symbol, version) } {
                best = Some(a);
            }
        };
        if !self.gnu_hash.is_null() {
            // SAFETY: the GNU hash table of a loaded object, laid out as the ELF gABI extension
            // says (`tables_of` took it from the object's dynamic section).
            unsafe { self.walk_gnu(symbol, &mut consider) };
        } else if !self.hash.is_null() {
            // SAFETY: the SysV hash table of a loaded object.
            unsafe { self.walk_sysv(symbol, &mut consider) };
        }
        best
    }

    /// Whether symbol `idx` is a defined function named `symbol` of the wanted version.
    ///
    /// # Safety
    /// `idx` must index the symbol table.
    unsafe fn matches(&self, idx: u32, symbol: &[u8], version: Option<&[u8]>) -> Option<usize> {
        // SAFETY: idx indexes the symbol table (contract).
        let s = unsafe { &*self.symtab.add(idx as usize) };
        if s.shndx == 0 || s.value == 0 || s.info & 0xf != STT_FUNC {
            return None;
        }
        // SAFETY: st_name is an offset into the string table, NUL-terminated there.
        let name = unsafe { CStr::from_ptr(self.strtab.add(s.name as usize).cast()) }.to_bytes();
        if name != symbol {
            return None;
        }
        if !self.versym.is_null() {
            // SAFETY: the version table has one entry per symbol.
            let v = unsafe { *self.versym.add(idx as usize) };
            match version {
                // The default version is the one not marked hidden.
                None if v & 0x8000 != 0 => return None,
                None => {}
                // SAFETY: v's index refers to the object's version definitions.
                Some(want) if unsafe { self.version_name(v & 0x7fff) } != Some(want) => return None,
                Some(_) => {}
            }
        } else if version.is_some() {
            return None;
        }
        Some(self.base + s.value as usize)
    }

    /// The name of version definition `ndx`.
    ///
    /// # Safety
    /// The object's version definitions must be mapped (they are, for a loaded object).
    unsafe fn version_name(&self, ndx: u16) -> Option<&[u8]> {
        let mut d = self.verdef;
        while !d.is_null() {
            // SAFETY: a chain of Verdef records linked by vd_next offsets, ending with 0.
            let v = unsafe { &*d };
            if v.ndx == ndx {
                // SAFETY: vd_aux is the offset of the first Verdaux, whose name is the version's.
                let aux = unsafe { &*d.cast::<u8>().add(v.aux as usize).cast::<Verdaux>() };
                // SAFETY: an offset into the string table.
                return Some(unsafe { CStr::from_ptr(self.strtab.add(aux.name as usize).cast()) }.to_bytes());
            }
            if v.next == 0 {
                break;
            }
            // SAFETY: the next record, by its offset.
            d = unsafe { d.cast::<u8>().add(v.next as usize).cast() };
        }
        None
    }

    /// Calls `f` with every symbol index in `symbol`'s GNU hash chain.
    ///
    /// # Safety
    /// `gnu_hash` must point to a valid GNU hash table (64-bit class).
    unsafe fn walk_gnu(&self, symbol: &[u8], f: &mut impl FnMut(u32)) {
        let h = symbol.iter().fold(5381u32, |h, &c| h.wrapping_mul(33).wrapping_add(u32::from(c)));
        let t = self.gnu_hash;
        // SAFETY: the header, bloom filter, buckets and chains follow each other as the format says.
        unsafe {
            let (nbuckets, symoffset, bloom_size) = (*t, *t.add(1), *t.add(2));
            if nbuckets == 0 {
                return;
            }
            let buckets = t.add(4).cast::<u64>().add(bloom_size as usize).cast::<u32>();
            let chains = buckets.add(nbuckets as usize);
            let mut idx = *buckets.add((h % nbuckets) as usize);
            if idx < symoffset {
                return;
            }
            loop {
                let ch = *chains.add((idx - symoffset) as usize);
                if (ch | 1) == (h | 1) {
                    f(idx);
                }
                if ch & 1 != 0 {
                    break;
                }
                idx += 1;
            }
        }
    }

    /// Calls `f` with every symbol index in `symbol`'s SysV hash chain.
    ///
    /// # Safety
    /// `hash` must point to a valid SysV hash table.
    unsafe fn walk_sysv(&self, symbol: &[u8], f: &mut impl FnMut(u32)) {
        let mut h: u32 = 0;
        for &c in symbol {
            h = (h << 4).wrapping_add(u32::from(c));
            let g = h & 0xf000_0000;
            if g != 0 {
                h ^= g >> 24;
            }
            h &= !g;
        }
        let t = self.hash;
        // SAFETY: nbucket, nchain, buckets[nbucket], chains[nchain], as the format says.
        unsafe {
            let (nbucket, nchain) = (*t, *t.add(1));
            if nbucket == 0 {
                return;
            }
            let buckets = t.add(2);
            let chains = buckets.add(nbucket as usize);
            let mut idx = *buckets.add((h % nbucket) as usize);
            let mut steps = 0;
            while idx != 0 && idx < nchain && steps < nchain {
                f(idx);
                idx = *chains.add(idx as usize);
                steps += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_glibc_functions_as_the_loader_does() {
        let libs: &[&[u8]] = &[b"libc.so.6"];
        let ours = lookup(libs, b"getpid", None).expect("getpid in libc");
        assert_eq!(ours, libc::getpid as *const () as usize, "the default version is the one we link");
        let versioned = lookup(libs, b"getpid", Some(b"GLIBC_2.2.5")).expect("getpid@GLIBC_2.2.5");
        assert_eq!(versioned, ours);
        assert!(lookup(libs, b"no_such_function_here", None).is_none());
        assert!(lookup(&[b"libnot-loaded.so.9"], b"getpid", None).is_none());
    }

    #[test]
    fn an_object_found_by_an_address_in_it_answers_as_dlsym_does() {
        let getpid = libc::getpid as *const () as *mut c_void;
        let libc_so = Object::containing(getpid).expect("the object holding getpid");
        // Plain functions (an IFUNC such as strlen is left to dlsym: `function` says `None`).
        for name in [c"getpid", c"open", c"malloc", c"dl_iterate_phdr", c"fcntl"] {
            // SAFETY: a valid C string; RTLD_DEFAULT searches the global scope.
            let by_dlsym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
            assert_eq!(libc_so.function(name.to_bytes()), Some(by_dlsym), "{name:?}");
        }
        assert_eq!(libc_so.function(b"no_such_function_here"), None);
        assert!(Object::containing(std::ptr::null_mut()).is_none());
    }
}
