//! Resetting a GPU through the loaded NVML library's `nvmlDeviceResetGpu`, for drivers that
//! export it (nvml-wrapper does not bind it). A driver without it gets a clear answer: the
//! operator resets the GPU (`nvidia-smi -r -i N`).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;

use nvml_wrapper::error::{NvmlError, nvml_try};
use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlReturn_t};

use super::Session;

/// Why a GPU was not reset.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    #[error("this NVML library ({0}) offers no GPU reset; reset it with `nvidia-smi -r -i <index>`")]
    Unsupported(String),
    #[error("NVML refused the reset: {0}")]
    Refused(#[from] NvmlError),
}

type ResetFn = unsafe extern "C" fn(nvmlDevice_t) -> nvmlReturn_t;

impl Session {
    /// Resets GPU `index` (`nvmlDeviceResetGpu`): contexts on it are destroyed and a pending
    /// MIG mode takes effect. The caller checks that nothing uses the GPU.
    pub fn reset_gpu(&self, index: u32) -> Result<(), ResetError> {
        let unsupported = || ResetError::Unsupported(self.library().display().to_string());
        let path = CString::new(self.library().as_os_str().as_bytes()).map_err(|_| unsupported())?;
        // SAFETY: RTLD_NOLOAD only looks up the library the session already loaded (it runs no
        // initializers); the path is NUL-terminated.
        let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if lib.is_null() {
            return Err(unsupported());
        }
        // SAFETY: lib is a live handle from dlopen; the name is NUL-terminated.
        let sym = unsafe { libc::dlsym(lib, c"nvmlDeviceResetGpu".as_ptr()) };
        let result = if sym.is_null() {
            Err(unsupported())
        } else {
            // SAFETY: NVML's nvmlDeviceResetGpu has this C signature.
            let reset: ResetFn = unsafe { std::mem::transmute::<*mut libc::c_void, ResetFn>(sym) };
            self.nvml().device_by_index(index).map_err(ResetError::from).and_then(|dev| {
                // SAFETY: the handle is live for the session.
                nvml_try(unsafe { reset(dev.handle()) }).map_err(ResetError::from)
            })
        };
        // SAFETY: drops the reference this dlopen took; the session keeps its own.
        unsafe { libc::dlclose(lib) };
        result
    }
}
