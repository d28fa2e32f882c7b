//! `cuGetProcAddress` and `cuGetProcAddress_v2`: from a base name ("cuMemAlloc"), the CUDA
//! version the caller was built for and the default-stream flavour it asks for, to the exported
//! function a real driver hands out.
//!
//! The table ([`super::proc_table`]) follows `cudaTypedefs.h` of CUDA 12.8: each
//! `PFN_cuX_vNNNNN[_ptds|_ptsz]` typedef is the function `cuGetProcAddress("cuX", version ≥ NNNNN)`
//! returns. For a base name the newest entry not newer than the requested version (nor than the
//! node's driver version) wins; with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`, its
//! `_ptds`/`_ptsz` flavour where one exists. A name not in the table is
//! `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`; a name whose first version is newer than the request
//! is `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT` (both with `CUDA_ERROR_NOT_FOUND`).
//! `cuGetProcAddress` works before `cuInit`, as runtimes look `cuInit` itself up through it.

use std::ffi::{c_char, c_int, c_void};

use tessera_abi::cuda_exports;

use super::not_modelled::ENTRIES as NOT_MODELLED;
use super::proc_table::{Entry, Pt, TABLE};
use super::{INVALID_VALUE, NOT_FOUND, R, cstr, need, put, put_opt, run};

/// `CU_GET_PROC_ADDRESS_DEFAULT`, `_LEGACY_STREAM`, `_PER_THREAD_DEFAULT_STREAM`.
const PROC_DEFAULT: u64 = 0;
const PROC_LEGACY_STREAM: u64 = 1;
const PROC_PER_THREAD: u64 = 2;

/// `CUdriverProcAddressQueryResult`.
const SUCCESS: c_int = 0;
const SYMBOL_NOT_FOUND: c_int = 1;
const VERSION_NOT_SUFFICIENT: c_int = 2;

/// Looks a base name up: the entry to hand out, or the query result explaining why none.
pub(crate) fn lookup(name: &str, version: u32, per_thread: bool) -> Result<&'static Entry, c_int> {
    let driver_version = crate::process::node().map_or(12080, |n| n.description().cuda_driver_version);
    let mut any = false;
    let mut best: Option<&Entry> = None;
    let mut best_pt: Option<&Entry> = None;
    for e in TABLE.iter().chain(NOT_MODELLED).filter(|e| e.name == name && e.version <= driver_version) {
        any = true;
        if e.version > version {
            continue;
        }
        let slot = if e.pt == Pt::No { &mut best } else { &mut best_pt };
        if slot.is_none_or(|b| b.version < e.version) {
            *slot = Some(e);
        }
    }
    let best = best.ok_or(if any { VERSION_NOT_SUFFICIENT } else { SYMBOL_NOT_FOUND })?;
    let chosen = match best_pt {
        Some(pt) if per_thread => pt,
        _ => best,
    };
    // A version this library does not export is not handed out as another one.
    if chosen.f.is_null() { Err(SYMBOL_NOT_FOUND) } else { Ok(chosen) }
}

/// The body of both versions.
///
/// # Safety
/// `symbol` must be null or a NUL-terminated string; `pfn` and `status` null or valid
/// out-pointers.
unsafe fn get_proc(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int) -> R {
    need(pfn)?;
    // SAFETY: symbol is the caller's NUL-terminated string (null checked by cstr).
    let name = unsafe { cstr(symbol) }?;
    let per_thread = match flags {
        PROC_DEFAULT | PROC_LEGACY_STREAM => false,
        PROC_PER_THREAD => true,
        _ => return Err(INVALID_VALUE),
    };
    let found = lookup(name, version.max(0) as u32, per_thread);
    if let Err(why) = found {
        super::trace::line(format_args!("cuGetProcAddress({name}, {version}, flags {flags}): not found ({why})"));
    }
    // SAFETY: pfn is checked above; status is optional.
    unsafe {
        put(pfn, found.map_or(std::ptr::null_mut(), |e| e.f.cast_mut().cast()))?;
        put_opt(status, found.err().unwrap_or(SUCCESS))?;
    }
    found.map(|_| ()).map_err(|_| NOT_FOUND)
}

cuda_exports! {
    fn cuGetProcAddress(symbol, pfn, cudaVersion, flags) {
        // SAFETY: the caller's string and out-pointer, per the API contract.
        run(|| unsafe { get_proc(symbol, pfn, cudaVersion, flags, std::ptr::null_mut()) })
    }

    /// The per-thread flavour `cuda.h` declares for `cuGetProcAddress_v2`: the same lookup.
    fn cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus) also cuGetProcAddress_v2_ptsz {
        // SAFETY: the caller's string and out-pointers, per the API contract.
        run(|| unsafe { get_proc(symbol, pfn, cudaVersion, flags, symbolStatus) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn symbol(name: &str, version: u32, pt: bool) -> &'static str {
        lookup(name, version, pt).map(|e| e.symbol).unwrap_or("-")
    }

    #[test]
    fn versions_pick_the_exported_function() {
        assert_eq!(symbol("cuMemAlloc", 3020, false), "cuMemAlloc_v2");
        assert_eq!(symbol("cuMemAlloc", 2000, false), "cuMemAlloc");
        assert_eq!(symbol("cuCtxCreate", 3020, false), "cuCtxCreate_v2");
        assert_eq!(symbol("cuCtxCreate", 11040, false), "cuCtxCreate_v3");
        assert_eq!(symbol("cuCtxCreate", 12050, false), "cuCtxCreate_v4");
        assert_eq!(symbol("cuLaunchKernel", 12000, true), "cuLaunchKernel_ptsz");
        assert_eq!(symbol("cuLaunchKernel", 12000, false), "cuLaunchKernel");
        assert_eq!(symbol("cuMemcpyHtoD", 12000, true), "cuMemcpyHtoD_v2_ptds");
        assert_eq!(symbol("cuStreamBeginCapture", 10000, true), "cuStreamBeginCapture_ptsz");
        assert_eq!(symbol("cuStreamBeginCapture", 12000, true), "cuStreamBeginCapture_v2_ptsz");
        assert_eq!(symbol("cuGraphInstantiate", 12000, false), "cuGraphInstantiateWithFlags");
        assert_eq!(symbol("cuGraphInstantiate", 11000, false), "cuGraphInstantiate_v2");
        assert_eq!(symbol("cuEventElapsedTime", 12080, false), "cuEventElapsedTime_v2");
        assert_eq!(symbol("cuGetProcAddress", 12000, false), "cuGetProcAddress_v2");
        assert_eq!(lookup("cuLaunchKernelEx", 11000, false).err(), Some(VERSION_NOT_SUFFICIENT));
        assert_eq!(lookup("cuNoSuchThing", 12080, false).err(), Some(SYMBOL_NOT_FOUND));
    }

    #[test]
    fn table_entries_are_consistent() {
        for e in TABLE.iter().chain(NOT_MODELLED) {
            assert!(e.symbol.starts_with(e.name) || e.name == "cuGraphInstantiate", "{} -> {}", e.name, e.symbol);
            match e.pt {
                Pt::Ptds => assert!(e.symbol.ends_with("_ptds")),
                Pt::Ptsz => assert!(e.symbol.ends_with("_ptsz")),
                Pt::No => assert!(!e.symbol.ends_with("_ptds") && !e.symbol.ends_with("_ptsz")),
            }
        }
    }
}
