//! The `extern "C"` boundary: the raw CUDA/NVML types the hooks use, the result codes, and the
//! panic guard every export runs its body in.
//!
//! CUDA types are cudarc's bindings of cuda.h 12.8 (shared with the compute limiter and the
//! simulated driver); caller structs whose enum fields we read are declared here with those
//! fields as raw integers, so an unknown value from C is never an invalid Rust enum. NVML types
//! are nvml-wrapper-sys's.

use std::ffi::{c_int, c_uint};
use std::panic::{AssertUnwindSafe, catch_unwind};

pub(crate) use cudarc::driver::sys::{
    CUarray, CUcontext, CUdevice, CUdeviceptr, CUfunction, CUgraph, CUgraphExec, CUgraphNode, CUmemoryPool,
    CUmipmappedArray, CUresult, CUstream, CUuuid,
};

/// The array descriptors (v2) with their format read as a raw integer.
pub(crate) use tessera_abi::cuda::raw::{Array3dDesc, ArrayDesc};

pub(crate) const CUDA_SUCCESS: CUresult = CUresult::CUDA_SUCCESS;
pub(crate) const CUDA_ERROR_INVALID_VALUE: CUresult = CUresult::CUDA_ERROR_INVALID_VALUE;
pub(crate) const CUDA_ERROR_OUT_OF_MEMORY: CUresult = CUresult::CUDA_ERROR_OUT_OF_MEMORY;
pub(crate) const CUDA_ERROR_NOT_INITIALIZED: CUresult = CUresult::CUDA_ERROR_NOT_INITIALIZED;
pub(crate) const CUDA_ERROR_NO_DEVICE: CUresult = CUresult::CUDA_ERROR_NO_DEVICE;
pub(crate) const CUDA_ERROR_NOT_FOUND: CUresult = CUresult::CUDA_ERROR_NOT_FOUND;
pub(crate) const CUDA_ERROR_NOT_PERMITTED: CUresult = CUresult::CUDA_ERROR_NOT_PERMITTED;
pub(crate) const CUDA_ERROR_NOT_SUPPORTED: CUresult = CUresult::CUDA_ERROR_NOT_SUPPORTED;
pub(crate) const CUDA_ERROR_UNKNOWN: CUresult = CUresult::CUDA_ERROR_UNKNOWN;

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`: special handles meaning the current context's
/// default streams.
pub(crate) const CU_STREAM_LEGACY: usize = 0x1;
pub(crate) const CU_STREAM_PER_THREAD: usize = 0x2;

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
pub(crate) const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 0x2;

/// The leading fields of `CUlaunchConfig` (cuda.h 11.8+) up to the stream, the only one read.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct CUlaunchConfigHead {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub h_stream: CUstream,
}

/// The leading fields of `CUmemAllocationProp`: allocation type, handle types, and the location
/// (`CUmemLocation`: type, id).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct MemAllocPropHead {
    pub alloc_type: c_uint,
    pub handle_types: c_uint,
    pub location_type: c_uint,
    pub location_id: c_int,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(crate) const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 1;

/// `CUDA_ARRAY_MEMORY_REQUIREMENTS`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ArrayMemoryRequirements {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [c_uint; 4],
}

/// The fields of `CUarrayMapInfo` that say which physical allocation a sparse-array operation
/// maps: operation (`CU_MEM_OPERATION_TYPE_MAP` = 1, `UNMAP` = 2), handle type (`GENERIC` = 0)
/// and the handle; the rest as opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ArrayMapInfo {
    pub _resource: [u64; 7],
    pub mem_operation_type: c_uint,
    pub mem_handle_type: c_uint,
    pub mem_handle: u64,
    pub _rest: [u64; 3],
}

pub(crate) const CU_MEM_OPERATION_TYPE_MAP: c_uint = 1;
pub(crate) const CU_MEM_HANDLE_TYPE_GENERIC: c_uint = 0;

// NVML.
pub(crate) use nvml_wrapper_sys::bindings::{nvmlDevice_t as NvmlDevice, nvmlReturn_t as NvmlReturn};
pub(crate) const NVML_SUCCESS: NvmlReturn = 0;
pub(crate) const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub(crate) const NVML_ERROR_NO_PERMISSION: NvmlReturn = 4;
pub(crate) const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub(crate) const NVML_ERROR_LIBRARY_NOT_FOUND: NvmlReturn = 12;
pub(crate) const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// `nvmlProcessInfo_v1_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct NvmlProcessInfoV1 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_v2_t` (also `nvmlProcessInfo_t`, what v3 fills).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct NvmlProcessInfoV2 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// Runs an export's body; a panic becomes `on_panic` instead of unwinding into C.
#[inline]
pub(crate) fn guard<R: Copy>(on_panic: R, body: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(on_panic)
}

/// Writes `value` through a caller's out-pointer if it is non-null and aligned.
///
/// # Safety
/// `p` must be null or valid for a write of `T`.
#[inline]
pub(crate) unsafe fn put<T>(p: *mut T, value: T) -> bool {
    if p.is_null() || !p.is_aligned() {
        return false;
    }
    // SAFETY: non-null, aligned, and valid for writes by this function's contract.
    unsafe { p.write(value) };
    true
}

/// Reads a caller's value if the pointer is non-null and aligned.
///
/// # Safety
/// `p` must be null or valid for a read of `T`, holding a valid `T`.
#[inline]
pub(crate) unsafe fn get<T: Copy>(p: *const T) -> Option<T> {
    if p.is_null() || !p.is_aligned() {
        return None;
    }
    // SAFETY: non-null, aligned, and valid for reads by this function's contract.
    Some(unsafe { p.read() })
}

/// The bytes of a `CUuuid`.
pub(crate) fn uuid_bytes(u: &CUuuid) -> [u8; 16] {
    u.bytes.map(|b| b as u8)
}

/// A zeroed `CUuuid`.
pub(crate) fn uuid_zero() -> CUuuid {
    CUuuid { bytes: [0; 16] }
}

/// The canonical text of a UUID: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with `prefix`.
pub(crate) fn uuid_text(prefix: &str, b: &[u8; 16]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(40);
    s.push_str(prefix);
    for (i, x) in b.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        let _ = write!(s, "{x:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_text_is_canonical() {
        let b: [u8; 16] = std::array::from_fn(|i| i as u8 * 17);
        assert_eq!(uuid_text("GPU-", &b), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }

    #[test]
    fn layouts_match_the_headers() {
        use std::mem::{offset_of, size_of};
        assert_eq!(offset_of!(CUlaunchConfigHead, h_stream), 32);
        assert_eq!(size_of::<ArrayDesc>(), 24);
        assert_eq!(size_of::<Array3dDesc>(), 40);
        assert_eq!(size_of::<NvmlProcessInfoV2>(), 24);
        assert_eq!(size_of::<NvmlProcessInfoV1>(), 16);
        type Info = cudarc::driver::sys::CUarrayMapInfo;
        assert_eq!(size_of::<ArrayMapInfo>(), size_of::<Info>());
        assert_eq!(offset_of!(ArrayMapInfo, mem_operation_type), offset_of!(Info, memOperationType));
        assert_eq!(offset_of!(ArrayMapInfo, mem_handle_type), offset_of!(Info, memHandleType));
        assert_eq!(offset_of!(ArrayMapInfo, mem_handle), offset_of!(Info, memHandle));
    }
}
