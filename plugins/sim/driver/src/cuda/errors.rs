//! CUDA error codes: the model's errors mapped in one place, device faults turned into the sticky
//! errors a real driver reports, and `cuGetErrorName` / `cuGetErrorString` for every `CUresult`
//! of CUDA 12.8.

use std::ffi::CStr;
use std::sync::atomic::{AtomicU32, Ordering::*};

use tessera_sim_model::faults::{STICKY_RESET, XID_FALLEN_OFF_BUS};
use tessera_sim_model::{Node, SimError};

use super::{CUresult, R, run};

use CUresult::*;
use tessera_abi::cuda_exports;

/// What a call was doing when the model refused it: a lost GPU refuses new work as unavailable,
/// and fails waits on work already queued as a launch failure (what a real driver reports when
/// the GPU falls off the bus under running kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum During {
    Work,
    Sync,
}

/// The one mapping from model errors to CUDA codes.
pub(crate) fn sim(e: &SimError, during: During) -> CUresult {
    match e {
        SimError::OutOfMemory => CUDA_ERROR_OUT_OF_MEMORY,
        SimError::GpuLost(_) => match during {
            During::Work => CUDA_ERROR_DEVICE_UNAVAILABLE,
            During::Sync => CUDA_ERROR_LAUNCH_FAILED,
        },
        SimError::InvalidArgument(_) => CUDA_ERROR_INVALID_VALUE,
        // A MIG instance that went away under the process.
        SimError::NotFound(_) => CUDA_ERROR_DEVICE_UNAVAILABLE,
        SimError::InUse(_) => CUDA_ERROR_DEVICE_UNAVAILABLE,
        SimError::InsufficientResources(_) => CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
        SimError::NotSupported(_) => CUDA_ERROR_NOT_SUPPORTED,
        // Out of stream slots or process slots: a real driver reports running out of resources
        // for streams and contexts as out of memory.
        SimError::TooMany(_) => CUDA_ERROR_OUT_OF_MEMORY,
        SimError::Timeout => CUDA_ERROR_TIMEOUT,
        SimError::State(_) | SimError::Description(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Maps a model result to a CUDA one.
pub(crate) trait Cu<T> {
    /// New work (allocations, launches, copies).
    fn work(self) -> R<T>;
}

impl<T> Cu<T> for Result<T, SimError> {
    fn work(self) -> R<T> {
        self.map_err(|e| sim(&e, During::Work))
    }
}

/// The sticky error a process's contexts report after an XID aimed at it (the same mapping real
/// drivers show: MMU faults as illegal addresses, ECC as uncorrectable, ...).
pub(crate) fn from_xid(xid: u32) -> CUresult {
    match xid {
        13 | 31 | 32 => CUDA_ERROR_ILLEGAL_ADDRESS,
        8 | 109 => CUDA_ERROR_LAUNCH_TIMEOUT,
        43 | 45 => CUDA_ERROR_LAUNCH_FAILED,
        48 | 63 | 64 | 92 | 95 => CUDA_ERROR_ECC_UNCORRECTABLE,
        94 => CUDA_ERROR_CONTAINED,
        74 => CUDA_ERROR_NVLINK_UNCORRECTABLE,
        XID_FALLEN_OFF_BUS => CUDA_ERROR_LAUNCH_FAILED,
        STICKY_RESET => CUDA_ERROR_CONTEXT_IS_DESTROYED,
        _ => CUDA_ERROR_ILLEGAL_ADDRESS,
    }
}

/// The sticky error of the whole process after an XID aimed at it (0: none). Every later call
/// that needs a context fails with it, as a real driver's do until the process restarts.
static PROCESS_STICKY: AtomicU32 = AtomicU32::new(0);

/// Checks for device faults on entry to a call that uses a context: takes the model's fault mark
/// (once), turns a reset into destroyed contexts on that GPU, and an XID into the process's
/// sticky error, which it returns.
pub(crate) fn poll_faults(node: &Node) -> R {
    if node.sticky_xid().is_some()
        && let Some(xid) = node.take_sticky_xid()
    {
        if xid == STICKY_RESET || xid == XID_FALLEN_OFF_BUS {
            super::context::on_reset(node, from_xid(xid));
        } else {
            let _ = PROCESS_STICKY.compare_exchange(0, from_xid(xid) as u32, AcqRel, Acquire);
        }
    }
    match PROCESS_STICKY.load(Acquire) {
        0 => Ok(()),
        c => Err(from_code(c).unwrap_or(CUDA_ERROR_UNKNOWN)),
    }
}

/// Every `CUresult` of CUDA 12.8: value, name, and the description `cuGetErrorString` gives.
static ERRORS: &[(CUresult, &CStr, &CStr)] = &[
    (CUDA_SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (CUDA_ERROR_INVALID_VALUE, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (CUDA_ERROR_OUT_OF_MEMORY, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (CUDA_ERROR_NOT_INITIALIZED, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (CUDA_ERROR_DEINITIALIZED, c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
    (CUDA_ERROR_PROFILER_DISABLED, c"CUDA_ERROR_PROFILER_DISABLED", c"profiler disabled while using external profiling tool"),
    (CUDA_ERROR_PROFILER_NOT_INITIALIZED, c"CUDA_ERROR_PROFILER_NOT_INITIALIZED", c"profiler not initialized: call cudaProfilerInitialize()"),
    (CUDA_ERROR_PROFILER_ALREADY_STARTED, c"CUDA_ERROR_PROFILER_ALREADY_STARTED", c"profiler already started"),
    (CUDA_ERROR_PROFILER_ALREADY_STOPPED, c"CUDA_ERROR_PROFILER_ALREADY_STOPPED", c"profiler already stopped"),
    (CUDA_ERROR_STUB_LIBRARY, c"CUDA_ERROR_STUB_LIBRARY", c"CUDA driver is a stub library"),
    (CUDA_ERROR_DEVICE_UNAVAILABLE, c"CUDA_ERROR_DEVICE_UNAVAILABLE", c"CUDA-capable device(s) is/are busy or unavailable"),
    (CUDA_ERROR_NO_DEVICE, c"CUDA_ERROR_NO_DEVICE", c"no CUDA-capable device is detected"),
    (CUDA_ERROR_INVALID_DEVICE, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (CUDA_ERROR_DEVICE_NOT_LICENSED, c"CUDA_ERROR_DEVICE_NOT_LICENSED", c"device doesn't have valid Grid license"),
    (CUDA_ERROR_INVALID_IMAGE, c"CUDA_ERROR_INVALID_IMAGE", c"device kernel image is invalid"),
    (CUDA_ERROR_INVALID_CONTEXT, c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
    (CUDA_ERROR_CONTEXT_ALREADY_CURRENT, c"CUDA_ERROR_CONTEXT_ALREADY_CURRENT", c"context already current"),
    (CUDA_ERROR_MAP_FAILED, c"CUDA_ERROR_MAP_FAILED", c"mapping of buffer object failed"),
    (CUDA_ERROR_UNMAP_FAILED, c"CUDA_ERROR_UNMAP_FAILED", c"unmapping of buffer object failed"),
    (CUDA_ERROR_ARRAY_IS_MAPPED, c"CUDA_ERROR_ARRAY_IS_MAPPED", c"array is mapped"),
    (CUDA_ERROR_ALREADY_MAPPED, c"CUDA_ERROR_ALREADY_MAPPED", c"resource already mapped"),
    (CUDA_ERROR_NO_BINARY_FOR_GPU, c"CUDA_ERROR_NO_BINARY_FOR_GPU", c"no kernel image is available for execution on the device"),
    (CUDA_ERROR_ALREADY_ACQUIRED, c"CUDA_ERROR_ALREADY_ACQUIRED", c"resource already acquired"),
    (CUDA_ERROR_NOT_MAPPED, c"CUDA_ERROR_NOT_MAPPED", c"resource not mapped"),
    (CUDA_ERROR_NOT_MAPPED_AS_ARRAY, c"CUDA_ERROR_NOT_MAPPED_AS_ARRAY", c"resource not mapped as array"),
    (CUDA_ERROR_NOT_MAPPED_AS_POINTER, c"CUDA_ERROR_NOT_MAPPED_AS_POINTER", c"resource not mapped as pointer"),
    (CUDA_ERROR_ECC_UNCORRECTABLE, c"CUDA_ERROR_ECC_UNCORRECTABLE", c"uncorrectable ECC error encountered"),
    (CUDA_ERROR_UNSUPPORTED_LIMIT, c"CUDA_ERROR_UNSUPPORTED_LIMIT", c"limit is not supported on this architecture"),
    (CUDA_ERROR_CONTEXT_ALREADY_IN_USE, c"CUDA_ERROR_CONTEXT_ALREADY_IN_USE", c"exclusive-thread device already in use by a different thread"),
    (CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, c"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", c"peer access is not supported between these two devices"),
    (CUDA_ERROR_INVALID_PTX, c"CUDA_ERROR_INVALID_PTX", c"a PTX JIT compilation failed"),
    (CUDA_ERROR_INVALID_GRAPHICS_CONTEXT, c"CUDA_ERROR_INVALID_GRAPHICS_CONTEXT", c"invalid OpenGL or DirectX context"),
    (CUDA_ERROR_NVLINK_UNCORRECTABLE, c"CUDA_ERROR_NVLINK_UNCORRECTABLE", c"uncorrectable NVLink error detected during the execution"),
    (CUDA_ERROR_JIT_COMPILER_NOT_FOUND, c"CUDA_ERROR_JIT_COMPILER_NOT_FOUND", c"PTX JIT compiler library not found"),
    (CUDA_ERROR_UNSUPPORTED_PTX_VERSION, c"CUDA_ERROR_UNSUPPORTED_PTX_VERSION", c"the provided PTX was compiled with an unsupported toolchain."),
    (CUDA_ERROR_JIT_COMPILATION_DISABLED, c"CUDA_ERROR_JIT_COMPILATION_DISABLED", c"PTX JIT compilation was disabled"),
    (CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY, c"CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY", c"the provided execution affinity is not supported"),
    (CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC, c"CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC", c"the provided PTX contains unsupported call to cudaDeviceSynchronize"),
    (CUDA_ERROR_CONTAINED, c"CUDA_ERROR_CONTAINED", c"an exception occurred on the device that is now contained by the GPU's error containment capability"),
    (CUDA_ERROR_INVALID_SOURCE, c"CUDA_ERROR_INVALID_SOURCE", c"device kernel image is invalid"),
    (CUDA_ERROR_FILE_NOT_FOUND, c"CUDA_ERROR_FILE_NOT_FOUND", c"file not found"),
    (CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND, c"CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND", c"shared object symbol not found"),
    (CUDA_ERROR_SHARED_OBJECT_INIT_FAILED, c"CUDA_ERROR_SHARED_OBJECT_INIT_FAILED", c"shared object initialization failed"),
    (CUDA_ERROR_OPERATING_SYSTEM, c"CUDA_ERROR_OPERATING_SYSTEM", c"OS call failed or operation not supported on this OS"),
    (CUDA_ERROR_INVALID_HANDLE, c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
    (CUDA_ERROR_ILLEGAL_STATE, c"CUDA_ERROR_ILLEGAL_STATE", c"the operation cannot be performed in the present state"),
    (CUDA_ERROR_LOSSY_QUERY, c"CUDA_ERROR_LOSSY_QUERY", c"attempted introspection would be semantically lossy"),
    (CUDA_ERROR_NOT_FOUND, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (CUDA_ERROR_NOT_READY, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (CUDA_ERROR_ILLEGAL_ADDRESS, c"CUDA_ERROR_ILLEGAL_ADDRESS", c"an illegal memory access was encountered"),
    (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", c"too many resources requested for launch"),
    (CUDA_ERROR_LAUNCH_TIMEOUT, c"CUDA_ERROR_LAUNCH_TIMEOUT", c"the launch timed out and was terminated"),
    (CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING, c"CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING", c"launch uses incompatible texturing mode"),
    (CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, c"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", c"peer access is already enabled"),
    (CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, c"CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", c"peer access has not been enabled"),
    (CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, c"CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", c"cannot set while device is active in this process"),
    (CUDA_ERROR_CONTEXT_IS_DESTROYED, c"CUDA_ERROR_CONTEXT_IS_DESTROYED", c"context is destroyed"),
    (CUDA_ERROR_ASSERT, c"CUDA_ERROR_ASSERT", c"device-side assert triggered"),
    (CUDA_ERROR_TOO_MANY_PEERS, c"CUDA_ERROR_TOO_MANY_PEERS", c"peer mapping resources exhausted"),
    (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", c"part or all of the requested memory range is already mapped"),
    (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", c"pointer does not correspond to a registered memory region"),
    (CUDA_ERROR_HARDWARE_STACK_ERROR, c"CUDA_ERROR_HARDWARE_STACK_ERROR", c"hardware stack error"),
    (CUDA_ERROR_ILLEGAL_INSTRUCTION, c"CUDA_ERROR_ILLEGAL_INSTRUCTION", c"an illegal instruction was encountered"),
    (CUDA_ERROR_MISALIGNED_ADDRESS, c"CUDA_ERROR_MISALIGNED_ADDRESS", c"misaligned address"),
    (CUDA_ERROR_INVALID_ADDRESS_SPACE, c"CUDA_ERROR_INVALID_ADDRESS_SPACE", c"operation not supported on global/shared address space"),
    (CUDA_ERROR_INVALID_PC, c"CUDA_ERROR_INVALID_PC", c"invalid program counter"),
    (CUDA_ERROR_LAUNCH_FAILED, c"CUDA_ERROR_LAUNCH_FAILED", c"unspecified launch failure"),
    (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, c"CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", c"too many blocks in cooperative launch"),
    (CUDA_ERROR_TENSOR_MEMORY_LEAK, c"CUDA_ERROR_TENSOR_MEMORY_LEAK", c"tensor memory not completely freed"),
    (CUDA_ERROR_NOT_PERMITTED, c"CUDA_ERROR_NOT_PERMITTED", c"operation not permitted"),
    (CUDA_ERROR_NOT_SUPPORTED, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (CUDA_ERROR_SYSTEM_NOT_READY, c"CUDA_ERROR_SYSTEM_NOT_READY", c"system not yet initialized"),
    (CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, c"CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", c"system has unsupported display driver / cuda driver combination"),
    (CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, c"CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", c"forward compatibility was attempted on non supported HW"),
    (CUDA_ERROR_MPS_CONNECTION_FAILED, c"CUDA_ERROR_MPS_CONNECTION_FAILED", c"MPS client failed to connect to the MPS control daemon or the MPS server"),
    (CUDA_ERROR_MPS_RPC_FAILURE, c"CUDA_ERROR_MPS_RPC_FAILURE", c"the remote procedural call between the MPS server and the MPS client failed"),
    (CUDA_ERROR_MPS_SERVER_NOT_READY, c"CUDA_ERROR_MPS_SERVER_NOT_READY", c"MPS server is not ready to accept new MPS client requests"),
    (CUDA_ERROR_MPS_MAX_CLIENTS_REACHED, c"CUDA_ERROR_MPS_MAX_CLIENTS_REACHED", c"the hardware resources required to create MPS client have been exhausted"),
    (CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED, c"CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED", c"the hardware resources required to support device connections have been exhausted"),
    (CUDA_ERROR_MPS_CLIENT_TERMINATED, c"CUDA_ERROR_MPS_CLIENT_TERMINATED", c"the MPS client has been terminated by the server"),
    (CUDA_ERROR_CDP_NOT_SUPPORTED, c"CUDA_ERROR_CDP_NOT_SUPPORTED", c"is using CUDA Dynamic Parallelism, but the current configuration, like MPS, does not support it"),
    (CUDA_ERROR_CDP_VERSION_MISMATCH, c"CUDA_ERROR_CDP_VERSION_MISMATCH", c"unsupported interaction between different versions of CUDA Dynamic Parallelism"),
    (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", c"operation not permitted when stream is capturing"),
    (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", c"operation failed due to a previous error during capture"),
    (CUDA_ERROR_STREAM_CAPTURE_MERGE, c"CUDA_ERROR_STREAM_CAPTURE_MERGE", c"operation would result in a merge of separate capture sequences"),
    (CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, c"CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", c"capture was not ended in the same stream as it began"),
    (CUDA_ERROR_STREAM_CAPTURE_UNJOINED, c"CUDA_ERROR_STREAM_CAPTURE_UNJOINED", c"capturing stream has unjoined work"),
    (CUDA_ERROR_STREAM_CAPTURE_ISOLATION, c"CUDA_ERROR_STREAM_CAPTURE_ISOLATION", c"dependency created on uncaptured work in another stream"),
    (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", c"operation would make the legacy stream depend on a capturing blocking stream"),
    (CUDA_ERROR_CAPTURED_EVENT, c"CUDA_ERROR_CAPTURED_EVENT", c"operation not permitted on an event last recorded in a capturing stream"),
    (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, c"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", c"attempt to terminate a thread-local capture sequence from another thread"),
    (CUDA_ERROR_TIMEOUT, c"CUDA_ERROR_TIMEOUT", c"wait operation timed out"),
    (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, c"CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", c"the graph update was not performed because it included changes which violated constraints specific to instantiated graph update"),
    (CUDA_ERROR_EXTERNAL_DEVICE, c"CUDA_ERROR_EXTERNAL_DEVICE", c"an async error has occured in external entity outside of CUDA"),
    (CUDA_ERROR_INVALID_CLUSTER_SIZE, c"CUDA_ERROR_INVALID_CLUSTER_SIZE", c"a kernel launch error has occurred due to cluster misconfiguration"),
    (CUDA_ERROR_FUNCTION_NOT_LOADED, c"CUDA_ERROR_FUNCTION_NOT_LOADED", c"the function handle is not loaded when calling an API that requires a loaded function"),
    (CUDA_ERROR_INVALID_RESOURCE_TYPE, c"CUDA_ERROR_INVALID_RESOURCE_TYPE", c"one or more resources passed in are not valid resource types for the operation"),
    (CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, c"CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION", c"one or more resources are insufficient or non-applicable for the operation"),
    (CUDA_ERROR_KEY_ROTATION, c"CUDA_ERROR_KEY_ROTATION", c"an error occurred during key rotation"),
    (CUDA_ERROR_UNKNOWN, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// The `CUresult` with this value, if CUDA 12.8 has one.
pub(crate) fn from_code(code: u32) -> Option<CUresult> {
    ERRORS.iter().find(|e| e.0 as u32 == code).map(|e| e.0)
}

cuda_exports! {
    /// `cuGetErrorName`: the enumerant's name; an unknown value is `INVALID_VALUE` with `*pStr = NULL`.
    fn cuGetErrorName(error, pStr) {
        run(|| {
            let entry = ERRORS.iter().find(|e| e.0 as u32 == error);
            // SAFETY: pStr is the caller's out-pointer.
            unsafe { super::put(pStr, entry.map_or(std::ptr::null(), |e| e.1.as_ptr())) }?;
            entry.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
        })
    }

    /// `cuGetErrorString`: the description; an unknown value is `INVALID_VALUE` with `*pStr = NULL`.
    fn cuGetErrorString(error, pStr) {
        run(|| {
            let entry = ERRORS.iter().find(|e| e.0 as u32 == error);
            // SAFETY: pStr is the caller's out-pointer.
            unsafe { super::put(pStr, entry.map_or(std::ptr::null(), |e| e.2.as_ptr())) }?;
            entry.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_is_listed_once() {
        assert_eq!(ERRORS.len(), 100, "cuda.h 12.8 has 100 CUresult values");
        let mut codes: Vec<u32> = ERRORS.iter().map(|e| e.0 as u32).collect();
        let n = codes.len();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), n);
        for (code, name, _) in ERRORS {
            assert_eq!(format!("{code:?}"), name.to_str().unwrap());
        }
    }
}
