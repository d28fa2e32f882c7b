//! `cuInit`: where a process's CUDA use starts, and where a bad config stops it (fail closed):
//! the state is made first; if the config cannot be read, the driver is never initialized and
//! the answer is `CUDA_ERROR_NOT_PERMITTED` (every later hooked call answers the same).

use std::ffi::c_uint;

use crate::ffi::*;
use crate::{real, state};

/// # Safety
/// As cuda.h's `cuInit`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(Flags: c_uint) -> CUresult {
    guard(CUDA_ERROR_UNKNOWN, || {
        if state::ensure().is_err() {
            return CUDA_ERROR_NOT_PERMITTED;
        }
        let Some(cu) = real::cuda() else { return CUDA_ERROR_NO_DEVICE };
        // SAFETY: the caller's argument, passed on unchanged.
        unsafe { (cu.cuInit)(Flags) }
    })
}
