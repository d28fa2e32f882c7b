//! The CUDA driver functions the workload calls, declared once as cuda.h declares them, and
//! resolved one of the three ways real programs reach the driver.

use std::ffi::{CString, c_char, c_int, c_void};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type Handle = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;

/// `CUlaunchConfig` (cuda.h, CUDA 12), with no attributes.
#[repr(C)]
pub struct LaunchConfig {
    pub grid: [std::ffi::c_uint; 3],
    pub block: [std::ffi::c_uint; 3],
    pub shared_mem_bytes: std::ffi::c_uint,
    pub stream: Handle,
    pub attrs: *mut c_void,
    pub num_attrs: std::ffi::c_uint,
}

/// `CUDA_KERNEL_NODE_PARAMS_v2` (cuda.h, CUDA 12): a function, or a `CUkernel` in `kern`.
#[repr(C)]
pub struct KernelNodeParams {
    pub func: Handle,
    pub grid: [std::ffi::c_uint; 3],
    pub block: [std::ffi::c_uint; 3],
    pub shared_mem_bytes: std::ffi::c_uint,
    pub kernel_params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
    pub kern: Handle,
    pub ctx: Handle,
}

/// `CUipcMemHandle` (cuda.h): 64 opaque bytes another process opens.
#[repr(C)]
pub struct IpcMemHandle {
    pub reserved: [u8; 64],
}

/// Calls `$m!` with every function: field, name to ask cuGetProcAddress for, exported symbol,
/// parameter types. One list serves the dlsym table, the cuGetProcAddress table and the direct
/// link in `tessera-workload-linked`.
#[macro_export]
macro_rules! for_each_driver_fn {
    ($m:ident) => {
        $m! {
            init: "cuInit" => cuInit(::std::ffi::c_uint);
            driver_get_version: "cuDriverGetVersion" => cuDriverGetVersion(*mut ::std::ffi::c_int);
            device_get_count: "cuDeviceGetCount" => cuDeviceGetCount(*mut ::std::ffi::c_int);
            device_get: "cuDeviceGet" => cuDeviceGet(*mut ::std::ffi::c_int, ::std::ffi::c_int);
            device_get_name: "cuDeviceGetName" => cuDeviceGetName(*mut ::std::ffi::c_char, ::std::ffi::c_int, ::std::ffi::c_int);
            device_total_mem: "cuDeviceTotalMem" => cuDeviceTotalMem_v2(*mut usize, ::std::ffi::c_int);
            primary_ctx_retain: "cuDevicePrimaryCtxRetain" => cuDevicePrimaryCtxRetain(*mut *mut ::std::ffi::c_void, ::std::ffi::c_int);
            primary_ctx_release: "cuDevicePrimaryCtxRelease" => cuDevicePrimaryCtxRelease_v2(::std::ffi::c_int);
            ctx_set_current: "cuCtxSetCurrent" => cuCtxSetCurrent(*mut ::std::ffi::c_void);
            ctx_synchronize: "cuCtxSynchronize" => cuCtxSynchronize();
            mem_get_info: "cuMemGetInfo" => cuMemGetInfo_v2(*mut usize, *mut usize);
            mem_alloc: "cuMemAlloc" => cuMemAlloc_v2(*mut u64, usize);
            mem_free: "cuMemFree" => cuMemFree_v2(u64);
            memcpy_htod: "cuMemcpyHtoD" => cuMemcpyHtoD_v2(u64, *const ::std::ffi::c_void, usize);
            memcpy_dtoh: "cuMemcpyDtoH" => cuMemcpyDtoH_v2(*mut ::std::ffi::c_void, u64, usize);
            memset_d8: "cuMemsetD8" => cuMemsetD8_v2(u64, u8, usize);
            ipc_get_mem_handle: "cuIpcGetMemHandle" => cuIpcGetMemHandle(*mut $crate::api::IpcMemHandle, u64);
            module_load_data: "cuModuleLoadData" => cuModuleLoadData(*mut *mut ::std::ffi::c_void, *const ::std::ffi::c_void);
            module_get_function: "cuModuleGetFunction" => cuModuleGetFunction(*mut *mut ::std::ffi::c_void, *mut ::std::ffi::c_void, *const ::std::ffi::c_char);
            module_unload: "cuModuleUnload" => cuModuleUnload(*mut ::std::ffi::c_void);
            launch_kernel: "cuLaunchKernel" => cuLaunchKernel(
                *mut ::std::ffi::c_void, ::std::ffi::c_uint, ::std::ffi::c_uint, ::std::ffi::c_uint,
                ::std::ffi::c_uint, ::std::ffi::c_uint, ::std::ffi::c_uint, ::std::ffi::c_uint,
                *mut ::std::ffi::c_void, *mut *mut ::std::ffi::c_void, *mut *mut ::std::ffi::c_void);
            launch_cooperative_kernel: "cuLaunchCooperativeKernel" => cuLaunchCooperativeKernel(
                *mut ::std::ffi::c_void, ::std::ffi::c_uint, ::std::ffi::c_uint, ::std::ffi::c_uint,
                ::std::ffi::c_uint, ::std::ffi::c_uint, ::std::ffi::c_uint, ::std::ffi::c_uint,
                *mut ::std::ffi::c_void, *mut *mut ::std::ffi::c_void);
            launch_kernel_ex: "cuLaunchKernelEx" => cuLaunchKernelEx(
                *const $crate::api::LaunchConfig, *mut ::std::ffi::c_void, *mut *mut ::std::ffi::c_void,
                *mut *mut ::std::ffi::c_void);
            stream_begin_capture: "cuStreamBeginCapture" => cuStreamBeginCapture_v2(*mut ::std::ffi::c_void, ::std::ffi::c_uint);
            stream_end_capture: "cuStreamEndCapture" => cuStreamEndCapture(*mut ::std::ffi::c_void, *mut *mut ::std::ffi::c_void);
            graph_create: "cuGraphCreate" => cuGraphCreate(*mut *mut ::std::ffi::c_void, ::std::ffi::c_uint);
            graph_add_kernel_node: "cuGraphAddKernelNode" => cuGraphAddKernelNode_v2(
                *mut *mut ::std::ffi::c_void, *mut ::std::ffi::c_void, *const *mut ::std::ffi::c_void, usize,
                *const $crate::api::KernelNodeParams);
            graph_instantiate: "cuGraphInstantiateWithFlags" => cuGraphInstantiateWithFlags(
                *mut *mut ::std::ffi::c_void, *mut ::std::ffi::c_void, u64);
            graph_launch: "cuGraphLaunch" => cuGraphLaunch(*mut ::std::ffi::c_void, *mut ::std::ffi::c_void);
            graph_exec_destroy: "cuGraphExecDestroy" => cuGraphExecDestroy(*mut ::std::ffi::c_void);
            graph_destroy: "cuGraphDestroy" => cuGraphDestroy(*mut ::std::ffi::c_void);
            stream_create: "cuStreamCreate" => cuStreamCreate(*mut *mut ::std::ffi::c_void, ::std::ffi::c_uint);
            stream_destroy: "cuStreamDestroy" => cuStreamDestroy_v2(*mut ::std::ffi::c_void);
            stream_synchronize: "cuStreamSynchronize" => cuStreamSynchronize(*mut ::std::ffi::c_void);
            event_create: "cuEventCreate" => cuEventCreate(*mut *mut ::std::ffi::c_void, ::std::ffi::c_uint);
            event_record: "cuEventRecord" => cuEventRecord(*mut ::std::ffi::c_void, *mut ::std::ffi::c_void);
            event_synchronize: "cuEventSynchronize" => cuEventSynchronize(*mut ::std::ffi::c_void);
            event_elapsed_time: "cuEventElapsedTime" => cuEventElapsedTime(*mut f32, *mut ::std::ffi::c_void, *mut ::std::ffi::c_void);
            event_destroy: "cuEventDestroy" => cuEventDestroy_v2(*mut ::std::ffi::c_void);
            get_error_name: "cuGetErrorName" => cuGetErrorName(::std::ffi::c_int, *mut *const ::std::ffi::c_char);
        }
    };
}

macro_rules! define_driver {
    ($($field:ident : $base:literal => $sym:ident ( $($arg:ty),* $(,)? );)*) => {
        /// The driver functions, however they were found.
        pub struct Driver {
            $(pub $field: unsafe extern "C" fn($($arg),*) -> CUresult,)*
        }

        /// (name for cuGetProcAddress, exported symbol) of every function.
        pub const FUNCTIONS: &[(&str, &str)] = &[$(($base, stringify!($sym))),*];

        impl Driver {
            /// Builds the table from a resolver given (base name, symbol) that returns an address.
            ///
            /// # Safety
            /// Every address returned must be the driver function of that name, whose C signature
            /// is the one listed in `for_each_driver_fn!`.
            pub unsafe fn resolve(mut find: impl FnMut(&str, &str) -> Result<*mut c_void, String>) -> Result<Driver, String> {
                Ok(Driver {
                    $($field: {
                        let p = find($base, stringify!($sym))?;
                        if p.is_null() {
                            return Err(format!("{} resolved to NULL", $base));
                        }
                        // SAFETY: p is the driver's function of this name (the caller's contract),
                        // and function pointers and data pointers have one size on our targets.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CUresult>(p) }
                    },)*
                })
            }
        }
    };
}

for_each_driver_fn!(define_driver);

/// How the driver was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Lookup {
    /// Linked against libcuda.so.1 (tessera-workload-linked).
    Linked,
    /// dlopen("libcuda.so.1") then dlsym for each function.
    Dlsym,
    /// dlopen, dlsym("cuGetProcAddress_v2") only, then cuGetProcAddress_v2 for every function, as
    /// CUDA runtimes since 11.3 and cuda-python do.
    Getprocaddress,
}

/// CUDA version the getprocaddress path asks for (12.8), as a runtime built against it would.
pub const REQUESTED_CUDA_VERSION: c_int = 12080;

fn dlopen_cuda() -> Result<*mut c_void, String> {
    let name = CString::new("libcuda.so.1").expect("no NUL");
    // SAFETY: name is a valid C string; RTLD_NOW|RTLD_GLOBAL as CUDA runtimes open the driver.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a valid C string (or NULL) describing the last dl error.
        let msg = unsafe { libc::dlerror() };
        let msg = if msg.is_null() {
            "unknown".into()
        } else {
            // SAFETY: non-null, so a NUL-terminated message owned by the dynamic loader.
            unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy().into_owned()
        };
        return Err(format!("dlopen libcuda.so.1: {msg}"));
    }
    Ok(h)
}

fn dlsym(h: *mut c_void, sym: &str) -> Result<*mut c_void, String> {
    let c = CString::new(sym).map_err(|_| "symbol has a NUL".to_string())?;
    // SAFETY: h is a live handle from dlopen and c a valid C string.
    let p = unsafe { libc::dlsym(h, c.as_ptr()) };
    if p.is_null() { Err(format!("dlsym {sym}: not found")) } else { Ok(p) }
}

type GetProcAddressV2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

/// Resolves the table by dlopen + dlsym, or dlopen + cuGetProcAddress_v2.
pub fn load(lookup: Lookup) -> Result<Driver, String> {
    let h = dlopen_cuda()?;
    match lookup {
        Lookup::Linked => Err("the linked lookup is tessera-workload-linked's".into()),
        // SAFETY: dlsym on libcuda returns the driver's functions under their exported names.
        Lookup::Dlsym => unsafe { Driver::resolve(|_, sym| dlsym(h, sym)) },
        Lookup::Getprocaddress => {
            let gpa = dlsym(h, "cuGetProcAddress_v2")?;
            // SAFETY: cuGetProcAddress_v2 has this signature in cuda.h (12.x).
            let gpa: GetProcAddressV2 = unsafe { std::mem::transmute::<*mut c_void, GetProcAddressV2>(gpa) };
            let find = |base: &str, _sym: &str| {
                let c = CString::new(base).map_err(|_| "name has a NUL".to_string())?;
                let mut p: *mut c_void = std::ptr::null_mut();
                let mut status: c_int = -1;
                // SAFETY: c is a valid C string; p and status are valid out-pointers.
                let rc = unsafe { gpa(c.as_ptr(), &mut p, REQUESTED_CUDA_VERSION, 0, &mut status) };
                if rc != CUDA_SUCCESS || status != 0 {
                    return Err(format!("cuGetProcAddress_v2({base}) = {rc}, status {status}"));
                }
                Ok(p)
            };
            // SAFETY: cuGetProcAddress_v2 returns the driver's function for each base name at
            // the requested version, whose signature matches cuda.h's for that version.
            unsafe { Driver::resolve(find) }
        }
    }
}

impl Driver {
    /// The CUresult's name (CUDA_ERROR_OUT_OF_MEMORY), from the driver itself.
    pub fn error_name(&self, rc: CUresult) -> String {
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: s is a valid out-pointer; the driver stores a static string or leaves it null.
        let ok = unsafe { (self.get_error_name)(rc, &mut s) } == CUDA_SUCCESS && !s.is_null();
        if ok {
            // SAFETY: the driver returned a static NUL-terminated string.
            unsafe { std::ffi::CStr::from_ptr(s) }.to_string_lossy().into_owned()
        } else {
            format!("CUresult {rc}")
        }
    }

    /// Turns a return code into Ok or a named error.
    pub fn check(&self, what: &str, rc: CUresult) -> Result<(), CudaError> {
        if rc == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(CudaError { call: what.to_string(), code: rc, name: self.error_name(rc) })
        }
    }
}

/// A failed driver call.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CudaError {
    pub call: String,
    pub code: CUresult,
    pub name: String,
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {} ({})", self.call, self.name, self.code)
    }
}
