//! `cuGetProcAddress` and `cuGetProcAddress_v2`: the real driver picks the function for the
//! base name, the CUDA version the caller was built for and the default-stream flavour it asks
//! for; if that is one of our hooked symbols, the caller gets our hook for exactly that symbol
//! (so `cuMemAlloc` asked at 3020 or later is our `cuMemAlloc_v2` hook, at 2000 our legacy
//! `cuMemAlloc` hook; with the per-thread flag, `cuLaunchKernel` is our `_ptsz` hook).
//!
//! Which symbol the driver chose is found by address: the driver's function for each hooked
//! symbol of that base name is looked up on the driver's handle and compared. A driver that
//! hands out an address we cannot place (not one of its exports) is answered from
//! [`versions`], the hooked names' entries of the header list the simulated driver keeps
//! (`tessera_abi::cuda::EXPORTS`, from `cudaTypedefs.h`), for requests up to 12.8; beyond that the driver's function passes through (a newer, unknown variant may
//! have another signature) with one warning on stderr.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use tessera_abi::cuda::{EXPORTS, Flavour};

use tessera_abi::cuda_exports;

use super::{dl, hook_by_name};
use crate::ffi::*;
use crate::real;

/// (base name, CUDA version it appeared in, per-thread flavour, exported symbol) of every hooked
/// CUDA function: the header list's entries ([`tessera_abi::cuda::EXPORTS`]) whose symbol is
/// hooked, and [`RENAMES`], sorted by base name (a stable sort: one base's entries keep the
/// list's order). Made on first use.
pub(crate) fn versions() -> &'static [(&'static str, u32, bool, &'static str)] {
    &table().entries
}

type Entry = (&'static str, u32, bool, &'static str);

/// [`versions`], and a filter of its base names.
struct Table {
    entries: Vec<Entry>,
    bases: Filter,
}

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| {
        // Each hooked name's entry, found by a binary search of the header list (sorted by symbol,
        // each once: `the_header_list_is_sorted_by_symbol`), with its place in the list, so that
        // one base's entries keep the list's order after the sort by base.
        let hooked = super::HOOKS.iter().filter(|h| h.name.starts_with(b"cu")).filter_map(|h| {
            let i = EXPORTS.position(h.name)?;
            let e = EXPORTS.get(i)?;
            Some((i, (e.base, e.version, e.flavour != Flavour::No, e.symbol)))
        });
        let renames = RENAMES.iter().enumerate().map(|(k, r)| (EXPORTS.len() + k, *r));
        let mut placed: Vec<(usize, Entry)> = hooked.chain(renames).collect();
        placed.sort_by(|a, b| (a.1.0, a.0).cmp(&(b.1.0, b.0)));
        let entries: Vec<Entry> = placed.into_iter().map(|(_, e)| e).collect();
        let bases = Filter::of(entries.iter().map(|e| e.0.as_bytes()));
        Table { entries, bases }
    })
}

/// A 1,024-bit filter of names, keyed by a name's length and four of its bytes (a few
/// instructions): `may_hold` is false for most names not put in, never for one that was.
struct Filter([u64; 16]);

impl Filter {
    fn of<'a>(names: impl Iterator<Item = &'a [u8]>) -> Filter {
        let mut f = Filter([0; 16]);
        for n in names {
            let b = Self::bit(n);
            f.0[b / 64] |= 1 << (b % 64);
        }
        f
    }

    fn bit(n: &[u8]) -> usize {
        let l = n.len();
        let Some(&last) = n.last() else { return 0 };
        let key = l as u64
            | u64::from(last) << 8
            | u64::from(n[l / 2]) << 16
            | u64::from(n[l * 3 / 4]) << 24
            | u64::from(n[l / 4]) << 32;
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54) as usize
    }

    fn may_hold(&self, name: &[u8]) -> bool {
        let b = Self::bit(name);
        self.0[b / 64] & (1 << (b % 64)) != 0
    }
}

/// The entries of [`versions`] for one base name, and the index of the first (a runtime asks for
/// hundreds of names at start-up, most of them not hooked: the filter answers most of those).
fn entries_of(base: &[u8]) -> (usize, &'static [Entry]) {
    let t = table();
    if !t.bases.may_hold(base) {
        return (0, &[]);
    }
    let v = &t.entries[..];
    let start = v.partition_point(|e| e.0.as_bytes() < base);
    let end = start + v[start..].partition_point(|e| e.0.as_bytes() == base);
    (start, &v[start..end])
}

/// The driver's address of each entry of [`versions`] (0: it has none), read once from the
/// driver's own symbol table (`intercept::elf`), where each call used to look every variant of
/// its base name up with `dlsym`. `None` until the driver is loaded.
fn driver_addresses() -> Option<&'static [usize]> {
    static ADDRS: OnceLock<Vec<usize>> = OnceLock::new();
    if let Some(a) = ADDRS.get() {
        return Some(a);
    }
    let h = real::cuda_handle_if_loaded()?;
    let first = versions().first()?;
    let anchor = std::ffi::CString::new(first.3).ok()?;
    let object = super::elf::Object::containing(dl::real_dlsym(h, anchor.as_ptr()));
    let addrs = versions()
        .iter()
        .map(|e| {
            object.as_ref().and_then(|o| o.function(e.3.as_bytes())).unwrap_or_else(|| {
                std::ffi::CString::new(e.3).map_or(0, |sym| dl::real_dlsym(h, sym.as_ptr()) as usize)
            })
        })
        .collect();
    Some(ADDRS.get_or_init(|| addrs))
}

/// Base names `cuda.h` hands out as another hooked function from some version on, which the
/// header list (one line a symbol) does not carry: `#define cuGraphInstantiate
/// cuGraphInstantiateWithFlags` (`PFN_cuGraphInstantiate_v12000` of `cudaTypedefs.h`).
const RENAMES: &[(&str, u32, bool, &str)] = &[("cuGraphInstantiate", 12000, false, "cuGraphInstantiateWithFlags")];

/// The CUDA version [`versions`] is complete for.
const VERSIONS_COMPLETE_TO: u32 = 12080;

/// The hooked symbol the driver's answer `p` is, for a base name: by address, else by version.
fn chosen_symbol(base: &str, p: *mut c_void, version: u32, per_thread: bool) -> Option<&'static str> {
    if entries_of(base.as_bytes()).1.is_empty() {
        return None;
    }
    if let Some(sym) = by_address(base, p) {
        return Some(sym);
    }
    let v = match driver_version() {
        0 => version,
        d => version.min(d),
    };
    if v > VERSIONS_COMPLETE_TO {
        static WARNED: AtomicBool = AtomicBool::new(false);
        if !WARNED.swap(true, Relaxed) {
            eprintln!(
                "tessera: cuGetProcAddress({base}) for CUDA {v} returned a function Tessera cannot identify; it is not limited"
            );
        }
        return None;
    }
    by_version(base, v, per_thread)
}

/// The hooked symbol of `base` whose driver function is at `p`.
fn by_address(base: &str, p: *mut c_void) -> Option<&'static str> {
    let addrs = driver_addresses()?;
    let (start, entries) = entries_of(base.as_bytes());
    entries.iter().enumerate().find_map(|(k, e)| (addrs[start + k] == p as usize).then_some(e.3))
}

/// The symbol `cudaTypedefs.h` names for `base` at CUDA version `v`: the newest not newer than
/// `v`, in its per-thread flavour if asked and one exists.
fn by_version(base: &str, v: u32, per_thread: bool) -> Option<&'static str> {
    let newest = |pt: bool| entries_of(base.as_bytes()).1.iter().filter(|e| e.1 <= v && e.2 == pt).max_by_key(|e| e.1);
    let plain = newest(false)?;
    Some(match newest(true) {
        Some(pt) if per_thread => pt.3,
        _ => plain.3,
    })
}

/// The driver's CUDA version (cached).
fn driver_version() -> u32 {
    static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        let Some(cu) = real::cuda() else { return 0 };
        let mut v: c_int = 0;
        // SAFETY: a valid out-pointer.
        if unsafe { (cu.cuDriverGetVersion)(&mut v) } == CUDA_SUCCESS { v.max(0) as u32 } else { 0 }
    })
}

/// After the real lookup succeeded: swap the function for our hook where it is one we hook.
///
/// # Safety
/// `symbol` must be a NUL-terminated string and `pfn` a valid out-pointer the driver filled.
unsafe fn swap(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
    // SAFETY: the driver accepted the name, so it is a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    // Most names a runtime asks are not hooked: answered before any other work.
    if entries_of(name).1.is_empty() {
        return;
    }
    let Ok(base) = std::str::from_utf8(name) else { return };
    // SAFETY: the driver filled pfn (it succeeded).
    let Some(p) = (unsafe { get(pfn) }) else { return };
    if p.is_null() {
        return;
    }
    let per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    if let Some(sym) = chosen_symbol(base, p, version.max(0) as u32, per_thread)
        && let Some(hook) = hook_by_name(sym.as_bytes())
    {
        // SAFETY: the caller's out-pointer (valid: the driver just wrote it).
        unsafe { put(pfn, hook) };
    }
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuGetProcAddress` (CUDA 11.3).
    fn cuGetProcAddress(symbol, pfn, cudaVersion, flags) {
        guard(CUDA_ERROR_UNKNOWN, || {
            let Some(f) = real::cuda().and_then(|c| c.cuGetProcAddress) else { return CUDA_ERROR_NOT_FOUND };
            // SAFETY: the caller's arguments, passed on unchanged.
            let rc = unsafe { f(symbol, pfn, cudaVersion, flags) };
            if rc == CUDA_SUCCESS {
                // SAFETY: the driver accepted the name and filled pfn.
                unsafe { swap(symbol, pfn, cudaVersion, flags) };
            }
            rc
        })
    }
}

/// A driver's `cuGetProcAddress_v2` flavour.
type GetProcV2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

/// Asks the driver's lookup (`which` picks it), then hands out our hook for what it found.
///
/// # Safety
/// As cuda.h's `cuGetProcAddress_v2`.
unsafe fn lookup_v2(
    which: fn(&crate::real::RealCuda) -> Option<GetProcV2>,
    (symbol, pfn, version, flags, status): (*const c_char, *mut *mut c_void, c_int, u64, *mut c_int),
) -> CUresult {
    guard(CUDA_ERROR_UNKNOWN, || {
        let Some(f) = real::cuda().and_then(which) else { return CUDA_ERROR_NOT_FOUND };
        // SAFETY: the caller's arguments, passed on unchanged.
        let rc = unsafe { f(symbol, pfn, version, flags, status) };
        if rc == CUDA_SUCCESS {
            // SAFETY: the driver accepted the name and filled pfn.
            unsafe { swap(symbol, pfn, version, flags) };
        }
        rc
    })
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuGetProcAddress_v2` (CUDA 12.0).
    fn cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus) {
        // SAFETY: the caller's arguments, per the same contract.
        unsafe { lookup_v2(|c| c.cuGetProcAddress_v2, (symbol, pfn, cudaVersion, flags, symbolStatus)) }
    }

    /// # Safety
    /// As cuda.h's `cuGetProcAddress_v2_ptsz` (the name `cuGetProcAddress` has in a build with
    /// `--default-stream per-thread`). Unhooked, a driver's answers from it were its own functions,
    /// every hook of the shim gone.
    fn cuGetProcAddress_v2_ptsz(symbol, pfn, cudaVersion, flags, symbolStatus) {
        let which = |c: &crate::real::RealCuda| c.cuGetProcAddress_v2_ptsz.or(c.cuGetProcAddress_v2);
        // SAFETY: the caller's arguments, per the same contract (both flavours have this signature).
        unsafe { lookup_v2(which, (symbol, pfn, cudaVersion, flags, symbolStatus)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_pick_the_symbol_cuda_h_names() {
        assert_eq!(by_version("cuMemAlloc", 2000, false), Some("cuMemAlloc"));
        assert_eq!(by_version("cuMemAlloc", 3020, true), Some("cuMemAlloc_v2"), "no per-thread flavour");
        assert_eq!(by_version("cuCtxCreate", 11040, false), Some("cuCtxCreate_v3"));
        assert_eq!(by_version("cuCtxCreate", 12080, false), Some("cuCtxCreate_v4"));
        assert_eq!(by_version("cuLaunchKernel", 12080, true), Some("cuLaunchKernel_ptsz"));
        assert_eq!(by_version("cuLaunchKernel", 6050, true), Some("cuLaunchKernel"), "before _ptsz existed");
        assert_eq!(by_version("cuLaunchKernelEx", 11000, false), None, "newer than asked");
        assert_eq!(by_version("cuMemcpyHtoD", 12080, false), None, "not hooked");
    }

    #[test]
    fn every_base_name_finds_exactly_its_entries() {
        let mut bases: Vec<&str> = EXPORTS.iter().map(|e| e.base).chain(RENAMES.iter().map(|e| e.0)).collect();
        bases.sort_unstable();
        bases.dedup();
        for b in bases {
            let (start, entries) = entries_of(b.as_bytes());
            let by_scan: Vec<_> = versions().iter().enumerate().filter(|(_, e)| e.0 == b).collect();
            assert_eq!(entries.len(), by_scan.len(), "{b}");
            for (k, (i, e)) in by_scan.into_iter().enumerate() {
                assert_eq!((start + k, &entries[k]), (i, e), "{b}");
            }
        }
        assert!(entries_of(b"cuNoSuchFunction").1.is_empty());
        assert!(entries_of(b"").1.is_empty());
    }

    #[test]
    fn the_header_list_is_sorted_by_symbol() {
        // `table` finds each hook's entry by a binary search.
        let list: Vec<_> = EXPORTS.iter().collect();
        assert!(list.windows(2).all(|w| w[0].symbol < w[1].symbol), "sorted, each symbol once");
        for (i, e) in list.iter().enumerate() {
            assert_eq!(EXPORTS.position(e.symbol.as_bytes()), Some(i), "{}", e.symbol);
            assert!(e.symbol.starts_with(e.base) && !e.base.is_empty(), "{} of {}", e.symbol, e.base);
        }
        assert_eq!(EXPORTS.position(b"cuNoSuchFunction"), None);
        let alloc = EXPORTS.get(EXPORTS.position(b"cuMemAlloc_v2").unwrap()).unwrap();
        assert_eq!((alloc.base, alloc.version, alloc.flavour), ("cuMemAlloc", 3020, Flavour::No));
    }

    #[test]
    fn every_versioned_symbol_is_hooked_and_every_hook_has_a_version() {
        for e in versions() {
            assert!(hook_by_name(e.3.as_bytes()).is_some(), "{} is not hooked", e.3);
            assert!(e.3.starts_with(e.0), "{} -> {}", e.0, e.3);
            assert_eq!(e.2, e.3.ends_with("_ptsz"), "{}", e.3);
        }
        for h in super::super::HOOKS.iter().filter(|h| h.name.starts_with(b"cu")) {
            let name = std::str::from_utf8(h.name).unwrap();
            assert!(versions().iter().any(|e| e.3 == name), "{name} has no cuGetProcAddress entry");
        }
    }
}
