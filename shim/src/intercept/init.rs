//! `cuInit`: where a process's CUDA use starts, and where a bad config stops it (fail closed):
//! the state is made first; if the config cannot be read, the driver is never initialized and
//! the answer is `CUDA_ERROR_NOT_PERMITTED` (every later hooked call answers the same).

use tessera_abi::cuda_exports;

use crate::ffi::*;
use crate::{real, state};

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuInit`.
    fn cuInit(Flags) {
        guard(CUDA_ERROR_UNKNOWN, || {
            let Ok(s) = state::ensure() else { return CUDA_ERROR_NOT_PERMITTED };
            let Some(cu) = real::cuda() else { return CUDA_ERROR_NO_DEVICE };
            // NVML loads on a helper thread while the driver initializes (`memory::context`),
            // unless tesserad's context sizes spare the measurement (`memory::context_size`).
            if s.configured && !crate::memory::context_size::any(s) {
                crate::memory::context::warm_up(s);
            }
            // SAFETY: the caller's argument, passed on unchanged.
            let rc = unsafe { (cu.cuInit)(Flags) };
            if rc == CUDA_SUCCESS {
                // A process that sees one device launches on it from its default streams.
                s.learn_device_count(cu);
            }
            rc
        })
    }
}
