//! How calls reach the hooks, on each of the three ways programs find the driver:
//!
//! 1. **Direct links** (`-lcuda`, `-lnvidia-ml`): the library exports every hooked symbol; as a
//!    preload it comes before the driver in the global scope, so the program's references bind
//!    to our hooks.
//! 2. **`dlopen` + `dlsym`**: [`dl`] interposes `dlsym`/`dlvsym`; a lookup of a hooked name
//!    that would find the driver's definition (on the driver's handle, `RTLD_DEFAULT`,
//!    `RTLD_NEXT`, or any handle whose scope holds the driver) returns our hook instead.
//! 3. **`cuGetProcAddress`/`_v2`** ([`procaddr`]): the real one answers, then the function it
//!    chose (by the requested CUDA version and default-stream flavour) is swapped for our hook
//!    of that exact symbol.
//!
//! [`HOOKS`] is the one list of hooked symbols. Anything not in it passes through untouched.

pub(crate) mod dl;
pub(crate) mod elf;
pub(crate) mod init;
pub(crate) mod procaddr;

use std::ffi::{CStr, c_char, c_void};

use crate::{current, launch, memory, nvml_view};

/// A hooked symbol and our function for it.
pub(crate) struct Hook {
    pub name: &'static [u8],
    pub f: *const (),
}

// SAFETY: immutable names and function addresses.
unsafe impl Sync for Hook {}

macro_rules! hooks {
    ($($module:ident :: $name:ident),* $(,)?) => {
        /// Every hooked symbol, sorted by name (checked at compile time).
        pub(crate) static HOOKS: &[Hook] = &[$(Hook { name: stringify!($name).as_bytes(), f: $module::$name as *const () }),*];
        const NAMES: &[&[u8]] = &[$(stringify!($name).as_bytes()),*];
    };
}

use memory::alloc;
use memory::context;
use memory::ctx_limits;
use memory::graph;
use memory::info;
use memory::pools;
use memory::vmm;

hooks! {

    alloc::cuArray3DCreate,
    alloc::cuArray3DCreate_v2,
    alloc::cuArrayCreate,
    alloc::cuArrayCreate_v2,
    alloc::cuArrayDestroy,
    context::cuCtxCreate,
    context::cuCtxCreate_v2,
    context::cuCtxCreate_v3,
    context::cuCtxCreate_v4,
    context::cuCtxDestroy,
    context::cuCtxDestroy_v2,
    current::cuCtxDetach,
    current::cuCtxPopCurrent,
    current::cuCtxPopCurrent_v2,
    current::cuCtxPushCurrent,
    current::cuCtxPushCurrent_v2,
    current::cuCtxSetCurrent,
    ctx_limits::cuCtxSetLimit,
    graph::cuDeviceGraphMemTrim,
    context::cuDevicePrimaryCtxRelease,
    context::cuDevicePrimaryCtxRelease_v2,
    context::cuDevicePrimaryCtxReset,
    context::cuDevicePrimaryCtxReset_v2,
    context::cuDevicePrimaryCtxRetain,
    info::cuDeviceTotalMem,
    info::cuDeviceTotalMem_v2,
    procaddr::cuGetProcAddress,
    procaddr::cuGetProcAddress_v2,
    procaddr::cuGetProcAddress_v2_ptsz,
    graph::cuGraphExecDestroy,
    graph::cuGraphInstantiate,
    graph::cuGraphInstantiateWithFlags,
    graph::cuGraphInstantiateWithParams,
    graph::cuGraphInstantiateWithParams_ptsz,
    graph::cuGraphInstantiate_v2,
    launch::cuGraphLaunch,
    launch::cuGraphLaunch_ptsz,
    graph::cuGraphUpload,
    graph::cuGraphUpload_ptsz,
    init::cuInit,
    launch::cuLaunchCooperativeKernel,
    launch::cuLaunchCooperativeKernel_ptsz,
    launch::cuLaunchKernel,
    launch::cuLaunchKernelEx,
    launch::cuLaunchKernelEx_ptsz,
    launch::cuLaunchKernel_ptsz,
    vmm::cuMemAddressFree,
    alloc::cuMemAlloc,
    alloc::cuMemAllocAsync,
    alloc::cuMemAllocAsync_ptsz,
    alloc::cuMemAllocFromPoolAsync,
    alloc::cuMemAllocFromPoolAsync_ptsz,
    alloc::cuMemAllocManaged,
    alloc::cuMemAllocPitch,
    alloc::cuMemAllocPitch_v2,
    alloc::cuMemAlloc_v2,
    vmm::cuMemCreate,
    alloc::cuMemFree,
    alloc::cuMemFreeAsync,
    alloc::cuMemFreeAsync_ptsz,
    alloc::cuMemFree_v2,
    info::cuMemGetInfo,
    info::cuMemGetInfo_v2,
    vmm::cuMemImportFromShareableHandle,
    vmm::cuMemMap,
    vmm::cuMemMapArrayAsync,
    vmm::cuMemMapArrayAsync_ptsz,
    pools::cuMemPoolCreate,
    vmm::cuMemRelease,
    vmm::cuMemRetainAllocationHandle,
    vmm::cuMemUnmap,
    alloc::cuMipmappedArrayCreate,
    alloc::cuMipmappedArrayDestroy,
    launch::cuStreamDestroy,
    launch::cuStreamDestroy_v2,
    nvml_view::nvmlDeviceGetComputeRunningProcesses,
    nvml_view::nvmlDeviceGetComputeRunningProcesses_v2,
    nvml_view::nvmlDeviceGetComputeRunningProcesses_v3,
    nvml_view::nvmlDeviceGetMemoryInfo,
    nvml_view::nvmlDeviceGetMemoryInfo_v2,
}

const fn less(a: &[u8], b: &[u8]) -> bool {
    let mut i = 0;
    while i < a.len() && i < b.len() {
        if a[i] != b[i] {
            return a[i] < b[i];
        }
        i += 1;
    }
    a.len() < b.len()
}

const fn sorted(names: &[&[u8]]) -> bool {
    let mut i = 1;
    while i < names.len() {
        if !less(names[i - 1], names[i]) {
            return false;
        }
        i += 1;
    }
    true
}

const _: () = assert!(sorted(NAMES), "HOOKS must be sorted by name (byte order) for the binary search");

/// Our hook for a symbol name, if it is hooked. Names that cannot be driver functions are
/// rejected on their first byte, without reading the rest; the others by a binary search over
/// the sorted list. Nothing is allocated.
///
/// # Safety
/// `name` must point to a NUL-terminated string.
#[inline]
pub(crate) unsafe fn hook_for(name: *const c_char) -> Option<*mut c_void> {
    // SAFETY: at least the NUL byte is readable.
    let first = unsafe { *name } as u8;
    if first != b'c' && first != b'n' {
        return None;
    }
    // SAFETY: NUL-terminated (contract).
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    hook_by_name(bytes)
}

/// Our hook for a symbol name given as bytes.
pub(crate) fn hook_by_name(bytes: &[u8]) -> Option<*mut c_void> {
    if !bytes.starts_with(b"cu") && !bytes.starts_with(b"nvml") {
        return None;
    }
    HOOKS.binary_search_by(|h| h.name.cmp(bytes)).ok().map(|i| HOOKS[i].f.cast_mut().cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooked_names_are_found_and_others_are_not() {
        assert_eq!(hook_by_name(b"cuMemAlloc_v2"), Some(alloc::cuMemAlloc_v2 as *mut c_void));
        assert_eq!(hook_by_name(b"cuLaunchKernel_ptsz"), Some(launch::cuLaunchKernel_ptsz as *mut c_void));
        assert_eq!(
            hook_by_name(b"nvmlDeviceGetMemoryInfo_v2"),
            Some(nvml_view::nvmlDeviceGetMemoryInfo_v2 as *mut c_void)
        );
        for other in ["cuMemcpyHtoD_v2", "cuModuleLoadData", "malloc", "cuMemAlloc_v3", "nvmlInit_v2", ""] {
            assert!(hook_by_name(other.as_bytes()).is_none(), "{other}");
        }
        // SAFETY: C string literals.
        unsafe {
            assert!(hook_for(c"pthread_create".as_ptr()).is_none());
            assert!(hook_for(c"cuInit".as_ptr()).is_some());
        }
    }
}
