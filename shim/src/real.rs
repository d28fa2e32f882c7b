//! The real driver's functions: `libcuda.so.1` and `libnvidia-ml.so.1`, resolved lazily (on the
//! first call that needs them, never at load time) from the real library itself, so that they
//! are the driver's definitions and never our hooks: its first function through the real `dlsym`
//! on its own handle, then every name in that object's own symbol tables (`intercept::elf`; one
//! hash probe each), the real `dlsym` again for any name they do not hold as a plain function.
//!
//! The library is found with `dlopen(RTLD_NOLOAD)` first (the program already loaded it, by
//! link or dlopen), else loaded with `RTLD_NOW | RTLD_GLOBAL` as CUDA runtimes do.
//!
//! Fields are named exactly as the exported symbols. Functions every supported driver (CUDA 11.0
//! and later) exports are plain function pointers; newer ones are `Option`s.

use std::ffi::{CStr, c_void};
use std::sync::OnceLock;
use std::sync::atomic::AtomicU8;
use std::sync::atomic::Ordering::{AcqRel, Acquire};

use crate::ffi::*;
use crate::intercept::{dl, elf};

macro_rules! table {
    // Functions named only: their types are the family's table's (`tessera_abi::<family>::pfn`).
    (
        $(#[$meta:meta])* $vis:vis struct $name:ident: $family:ident {
            required { $($req:ident),* $(,)? }
            optional { $($opt:ident),* $(,)? }
        }
    ) => {
        $(#[$meta])*
        #[allow(non_snake_case, dead_code)] // the whole driver API the hooks and the limiter may use
        $vis struct $name {
            /// The library's handle (from `dlopen`, never closed).
            pub handle: usize,
            $(pub $req: tessera_abi::$family::pfn::$req,)*
            $(pub $opt: Option<tessera_abi::$family::pfn::$opt>,)*
        }

        impl $name {
            /// Resolves every function from the library's handle; `Err` names the first required
            /// function missing.
            ///
            /// # Safety
            /// `handle` must be a live handle of the real library, whose functions have the
            /// signatures of the family's table (cuda.h / nvml.h).
            unsafe fn resolve(handle: *mut c_void) -> Result<$name, &'static str> {
                // The library's own tables, found from its first function's address: each name
                // is then a hash probe there (`dlsym` for what they do not hold as a plain
                // function).
                let first = [$(concat!(stringify!($req), "\0")),*][0];
                let object = elf::Object::containing(dl::real_dlsym(handle, first.as_ptr().cast()));
                let sym = |name: &str| -> *mut c_void {
                    match object.as_ref().and_then(|o| o.function(name[..name.len() - 1].as_bytes())) {
                        Some(p) => p as *mut c_void,
                        None => dl::real_dlsym(handle, name.as_ptr().cast()),
                    }
                };
                Ok($name {
                    handle: handle as usize,
                    $($req: {
                        let name = concat!(stringify!($req), "\0");
                        let p = sym(name);
                        if p.is_null() {
                            return Err(stringify!($req));
                        }
                        // SAFETY: the library's function of this name, with the table's
                        // signature (this function's contract); fn and data pointers have one
                        // size on our targets.
                        unsafe { std::mem::transmute::<*mut c_void, tessera_abi::$family::pfn::$req>(p) }
                    },)*
                    $($opt: {
                        let name = concat!(stringify!($opt), "\0");
                        let p = sym(name);
                        // SAFETY: as above; null stays None.
                        (!p.is_null()).then(|| unsafe {
                            std::mem::transmute::<*mut c_void, tessera_abi::$family::pfn::$opt>(p)
                        })
                    },)*
                })
            }
        }
    };
}

table! {
    /// The real CUDA driver.
    pub(crate) struct RealCuda: cuda {
        required {
            cuInit,
            cuDriverGetVersion,
            cuDeviceGet,
            cuDeviceGetCount,
            cuDeviceGetUuid,
            cuDeviceGetAttribute,
            cuDeviceTotalMem,
            cuDeviceTotalMem_v2,
            cuCtxCreate,
            cuCtxCreate_v2,
            cuCtxDestroy,
            cuCtxDestroy_v2,
            cuCtxGetCurrent,
            cuCtxSetCurrent,
            cuCtxGetDevice,
            cuCtxPushCurrent_v2,
            cuCtxPopCurrent_v2,
            cuCtxSynchronize,
            cuCtxGetLimit,
            cuCtxSetLimit,
            cuDevicePrimaryCtxRetain,
            cuDevicePrimaryCtxRelease,
            cuDevicePrimaryCtxRelease_v2,
            cuDevicePrimaryCtxReset,
            cuDevicePrimaryCtxReset_v2,
            cuDevicePrimaryCtxGetState,
            cuMemGetInfo,
            cuMemGetInfo_v2,
            cuMemAlloc,
            cuMemAlloc_v2,
            cuMemAllocPitch,
            cuMemAllocPitch_v2,
            cuMemAllocManaged,
            cuMemFree,
            cuMemFree_v2,
            cuMemCreate,
            cuMemRelease,
            cuArrayCreate,
            cuArrayCreate_v2,
            cuArray3DCreate,
            cuArray3DCreate_v2,
            cuArrayDestroy,
            cuStreamGetCtx,
            cuStreamDestroy,
            cuStreamDestroy_v2,
            cuStreamQuery,
            cuStreamSynchronize,
            cuEventCreate,
            cuEventRecord,
            cuEventQuery,
            cuEventSynchronize,
            cuEventElapsedTime,
            cuEventDestroy_v2,
            cuLaunchKernel,
            cuLaunchKernel_ptsz,
            cuLaunchCooperativeKernel,
            cuLaunchCooperativeKernel_ptsz,
            cuGraphLaunch,
            cuGraphLaunch_ptsz,
        }
        optional {
            cuCtxPushCurrent,
            cuCtxPopCurrent,
            cuCtxDetach,
            cuGetProcAddress,
            cuGetProcAddress_v2,
            cuGetProcAddress_v2_ptsz,
            cuCtxCreate_v3,
            cuCtxCreate_v4,
            cuMemAllocAsync,
            cuMemAllocAsync_ptsz,
            cuMemAllocFromPoolAsync,
            cuMemAllocFromPoolAsync_ptsz,
            cuMemFreeAsync,
            cuDeviceGetMemPool,
            cuDeviceGetDefaultMemPool,
            cuMemPoolCreate,
            cuMemPoolGetAttribute,
            cuStreamIsCapturing,
            cuMemFreeAsync_ptsz,
            cuMemMap,
            cuMemUnmap,
            cuMemAddressFree,
            cuMemRetainAllocationHandle,
            cuMemImportFromShareableHandle,
            cuMemGetAllocationPropertiesFromHandle,
            cuMemMapArrayAsync,
            cuMemMapArrayAsync_ptsz,
            cuLaunchKernelEx,
            cuLaunchKernelEx_ptsz,
            cuStreamGetCtx_ptsz,
            cuFuncGetName,
            // Launches accept a CUkernel cast to CUfunction; the name of either is asked of this.
            cuKernelGetName,
            cuMipmappedArrayCreate,
            cuMipmappedArrayDestroy,
            cuMipmappedArrayGetMemoryRequirements,
            // Graph memory (CUDA 11.4 and later).
            cuGraphGetNodes,
            cuGraphNodeGetType,
            cuGraphChildGraphNodeGetGraph,
            cuGraphMemAllocNodeGetParams,
            cuGraphMemFreeNodeGetParams,
            cuDeviceGetGraphMemAttribute,
            cuDeviceGraphMemTrim,
            cuGraphInstantiate,
            cuGraphInstantiate_v2,
            cuGraphInstantiateWithFlags,
            cuGraphInstantiateWithParams,
            cuGraphInstantiateWithParams_ptsz,
            cuGraphExecDestroy,
            cuGraphUpload,
            cuGraphUpload_ptsz,
        }
    }
}

table! {
    /// The real NVML.
    pub(crate) struct RealNvml: nvml {
        required {
            nvmlInit_v2,
            nvmlDeviceGetHandleByUUID,
            nvmlDeviceGetUUID,
            nvmlDeviceGetIndex,
            nvmlDeviceGetMemoryInfo,
            nvmlDeviceGetComputeRunningProcesses,
            nvmlDeviceGetProcessUtilization,
        }
        optional {
            nvmlDeviceGetMemoryInfo_v2,
            nvmlDeviceGetComputeRunningProcesses_v2,
            nvmlDeviceGetComputeRunningProcesses_v3,
        }
    }
}

// SAFETY: the tables hold function pointers and a handle value, immutable once built.
unsafe impl Sync for RealCuda {}
// SAFETY: as above.
unsafe impl Send for RealCuda {}
// SAFETY: as above.
unsafe impl Sync for RealNvml {}
// SAFETY: as above.
unsafe impl Send for RealNvml {}

static CUDA: OnceLock<Option<RealCuda>> = OnceLock::new();
static NVML: OnceLock<Option<RealNvml>> = OnceLock::new();

/// The driver library names, tried in order.
const CUDA_NAMES: &[&CStr] = &[c"libcuda.so.1", c"libcuda.so"];
const NVML_NAMES: &[&CStr] = &[c"libnvidia-ml.so.1", c"libnvidia-ml.so"];

/// The real library's handle: already loaded (`RTLD_NOLOAD`), else loaded now.
pub(crate) fn open(names: &[&CStr], load: bool) -> Option<*mut c_void> {
    for n in names {
        // SAFETY: a valid C string; RTLD_NOLOAD only looks up an already loaded object.
        let h = unsafe { libc::dlopen(n.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if !h.is_null() {
            return Some(h);
        }
    }
    if !load {
        return None;
    }
    for n in names {
        // SAFETY: a valid C string; loading the driver runs only its own initializers.
        let h = unsafe { libc::dlopen(n.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !h.is_null() {
            return Some(h);
        }
    }
    None
}

/// The handle of the real `libcuda.so.1` if the program has loaded it (never loads it).
pub(crate) fn cuda_handle_if_loaded() -> Option<*mut c_void> {
    if let Some(Some(c)) = CUDA.get() {
        return Some(c.handle as *mut c_void);
    }
    open(CUDA_NAMES, false)
}

/// The handle of the real `libnvidia-ml.so.1` if loaded (never loads it).
pub(crate) fn nvml_handle_if_loaded() -> Option<*mut c_void> {
    if let Some(Some(n)) = NVML.get() {
        return Some(n.handle as *mut c_void);
    }
    open(NVML_NAMES, false)
}

/// The real CUDA driver, loaded on first use; `None` if it cannot be loaded or lacks a function
/// every supported driver has.
pub(crate) fn cuda() -> Option<&'static RealCuda> {
    CUDA.get_or_init(|| {
        let h = open(CUDA_NAMES, true)?;
        // SAFETY: h is the real libcuda's handle; the table lists cuda.h's signatures.
        match unsafe { RealCuda::resolve(h) } {
            Ok(t) => Some(t),
            Err(missing) => {
                eprintln!("tessera: libcuda.so.1 lacks {missing}; CUDA calls pass through unlimited");
                None
            }
        }
    })
    .as_ref()
}

/// The real CUDA driver if it has been loaded already (never loads it): for fast paths.
#[inline(always)]
pub(crate) fn cuda_ready() -> Option<&'static RealCuda> {
    CUDA.get()?.as_ref()
}

/// The real NVML, loaded on first use. Loaded outside the once-cell, so no thread ever waits
/// for another's load: the context true-up's helper thread may be loading it while this thread
/// holds the loader lock (a library's constructor that starts CUDA); `dlopen` of a loaded object
/// is reference-counted, so two racing loads end in one library and one table.
pub(crate) fn nvml() -> Option<&'static RealNvml> {
    if let Some(n) = NVML.get() {
        return n.as_ref();
    }
    let loaded = open(NVML_NAMES, true).and_then(|h| {
        // SAFETY: h is the real libnvidia-ml's handle; the table lists nvml.h's signatures.
        unsafe { RealNvml::resolve(h) }.ok()
    });
    let _ = NVML.set(loaded);
    NVML.get()?.as_ref()
}

/// NVML initialized for our own queries: 0 not yet, 1 yes, 2 it failed.
static NVML_INIT: AtomicU8 = AtomicU8::new(0);

/// The real NVML, initialized for our own queries (`nvmlInit_v2` is reference-counted, so this
/// never disturbs the program's own init/shutdown pairs, and two threads racing here both
/// succeed; as with the load, nobody waits for another thread).
pub(crate) fn nvml_initialized() -> Option<&'static RealNvml> {
    let n = nvml()?;
    match NVML_INIT.load(Acquire) {
        1 => return Some(n),
        2 => return None,
        _ => {}
    }
    // SAFETY: nvmlInit_v2 takes no arguments.
    let ok = unsafe { (n.nvmlInit_v2)() } == NVML_SUCCESS;
    let _ = NVML_INIT.compare_exchange(0, if ok { 1 } else { 2 }, AcqRel, Acquire);
    ok.then_some(n)
}

/// NVML if it is loaded and initialized for our own queries already (never loads it).
pub(crate) fn nvml_ready() -> Option<&'static RealNvml> {
    if NVML_INIT.load(Acquire) == 1 { NVML.get()?.as_ref() } else { None }
}
