//! Return codes: the one mapping from model errors to NVML codes, and `nvmlErrorString`.

use std::ffi::CStr;

use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::SimError;

use super::*;

/// The NVML code for a model error.
pub(crate) fn code(e: &SimError) -> nvmlReturn_t {
    match e {
        SimError::InvalidArgument(_) => INVALID_ARGUMENT,
        SimError::NotFound(_) => NOT_FOUND,
        SimError::OutOfMemory => MEMORY,
        SimError::GpuLost(_) => GPU_IS_LOST,
        SimError::InUse(_) => IN_USE,
        SimError::InsufficientResources(_) => INSUFFICIENT_RESOURCES,
        SimError::NotSupported(_) => NOT_SUPPORTED,
        SimError::TooMany(_) => INSUFFICIENT_RESOURCES,
        SimError::Timeout => TIMEOUT,
        SimError::State(_) | SimError::Description(_) => UNKNOWN,
    }
}

/// The text libnvidia-ml gives each code.
fn text(result: nvmlReturn_t) -> &'static CStr {
    match result {
        nvmlReturn_enum_NVML_SUCCESS => c"Success",
        nvmlReturn_enum_NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => c"Insufficient Permissions",
        nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED => c"Already Initialized",
        nvmlReturn_enum_NVML_ERROR_NOT_FOUND => c"Not Found",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_POWER => c"Insufficient External Power",
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        nvmlReturn_enum_NVML_ERROR_TIMEOUT => c"Timeout",
        nvmlReturn_enum_NVML_ERROR_IRQ_ISSUE => c"Interrupt Request Issue",
        nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND => c"NVML Shared Library Not Found",
        nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM => c"Corrupted infoROM",
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => c"GPU is lost",
        nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED => c"GPU requires reset",
        nvmlReturn_enum_NVML_ERROR_OPERATING_SYSTEM => c"GPU access blocked by the operating system",
        nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH => c"Driver/library version mismatch",
        nvmlReturn_enum_NVML_ERROR_IN_USE => c"In use by another client",
        nvmlReturn_enum_NVML_ERROR_MEMORY => c"Insufficient Memory",
        nvmlReturn_enum_NVML_ERROR_NO_DATA => c"No data",
        nvmlReturn_enum_NVML_ERROR_VGPU_ECC_NOT_SUPPORTED => c"vGPU ECC not supported",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => c"Insufficient Resources",
        nvmlReturn_enum_NVML_ERROR_FREQ_NOT_SUPPORTED => c"Frequency not supported",
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        nvmlReturn_enum_NVML_ERROR_DEPRECATED => c"Deprecated",
        nvmlReturn_enum_NVML_ERROR_NOT_READY => c"Not Ready",
        nvmlReturn_enum_NVML_ERROR_GPU_NOT_FOUND => c"GPU not found",
        nvmlReturn_enum_NVML_ERROR_INVALID_STATE => c"Invalid state",
        nvmlReturn_enum_NVML_ERROR_RESET_TYPE_NOT_SUPPORTED => c"Reset type not supported",
        _ => c"Unknown Error",
    }
}

nvml_exports! {
    /// `nvmlErrorString`: a static, NUL-terminated description of a return code (any code, no init needed).
    fn nvmlErrorString(result) {
        crate::ffi::guard(c"Unknown Error".as_ptr(), || text(result).as_ptr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_a_text() {
        for c in (0..=30).chain([999, 12345]) {
            assert!(!text(c).to_bytes().is_empty());
        }
        assert_eq!(text(GPU_IS_LOST).to_str().unwrap(), "GPU is lost");
        assert_eq!(text(999).to_str().unwrap(), "Unknown Error");
    }
}
