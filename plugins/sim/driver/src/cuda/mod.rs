//! The CUDA half of the simulated driver: NVIDIA's `libcuda.so.1` ABI over the device model.
//!
//! Every export has the exact name and signature of CUDA 12.8's `cuda.h`, including the legacy
//! (pre-`_v2`) entry points and the per-thread-default-stream variants (`_ptds` for synchronous
//! calls, `_ptsz` for stream-taking ones) that runtimes built with `--default-stream per-thread`
//! link against. The signatures are written once, in `tessera_abi::cuda`'s table (which the shim
//! uses too): an export is a `cuda_exports!` item naming its parameters, and a per-thread variant
//! whose body differs only by the default stream it means is its function's `twin`. Structs and
//! enums come from `cudarc::driver::sys` (the 12.8 bindings); enum-typed *parameters* are taken as
//! raw integers, and enum fields of caller structs are read as raw integers too, so that an
//! unknown value from C is an error code, never undefined behaviour.
//!
//! Conventions shared by all exports:
//! - the body runs inside [`crate::ffi::guard`] (through [`run`]), so a panic is `CUDA_ERROR_UNKNOWN`;
//! - before `cuInit` (or in a child forked after it) every call but the version and error-string
//!   queries is `CUDA_ERROR_NOT_INITIALIZED`;
//! - null or misaligned out-pointers are `CUDA_ERROR_INVALID_VALUE`, checked before any work;
//! - handles are keys into one registry ([`handles`]), never dereferenced: a stale or made-up
//!   handle is `CUDA_ERROR_INVALID_HANDLE` (or `INVALID_CONTEXT` for contexts);
//! - model errors map to CUDA codes in one place ([`errors::sim`]); device faults (a lost GPU, an
//!   XID aimed at the process, a reset that destroyed its contexts) are checked on entry
//!   ([`errors::poll_faults`]).
//!
//! Device memory is real host memory (anonymous `MAP_NORESERVE` mappings, or memfd-backed ones for
//! the virtual memory management API), and a device pointer is its address: copies and memsets move
//! real bytes, and unified addressing holds. Every allocation is charged to the model before it
//! succeeds and refunded when freed, so the model's accounting is exact.
//!
//! Where the simulation knowingly differs from a real driver:
//! - kernels run no code and change no memory; a kernel takes the time its name says
//!   ([`module::kernel_duration_ns`]); copies and memsets take no GPU time;
//! - the model has no dependencies between streams: `cuStreamWaitEvent` across streams holds the
//!   calling thread until the event completes, and work queued on the legacy stream does not wait
//!   for the blocking streams (synchronizing the legacy stream, and synchronous copies, do);
//! - memory pools release what a free leaves above their release threshold at once (a real
//!   driver waits for the next synchronization);
//! - every compute instance of a MIG GPU is a CUDA device (real drivers document enumerating one
//!   MIG device per process);
//! - only created streams can be captured (not the default streams).

#![allow(non_snake_case)] // parameter names are cuda.h's

mod checkpoint;
mod context;
mod copy;
mod device;
mod errors;
mod event;
mod export_tables;
mod graph;
mod graph_mem;
mod graph_nodes;
mod handles;
mod init;
mod integrity;
mod ipc;
mod launch;
mod limits;
mod link;
mod memory;
mod mipmap;
mod module;
mod not_modelled;
mod occupancy;
mod pools;
mod proc_address;
mod proc_table;
mod stream;
mod suballoc;
mod tensor_map;
pub(crate) mod trace;
mod vmm;

use std::ffi::c_char;

pub(crate) use cudarc::driver::sys;
pub(crate) use sys::CUresult;

/// Result of an export's body: `Err` carries the CUDA error code.
pub(crate) type R<T = ()> = Result<T, CUresult>;

pub(crate) const INVALID_VALUE: CUresult = CUresult::CUDA_ERROR_INVALID_VALUE;
pub(crate) const INVALID_HANDLE: CUresult = CUresult::CUDA_ERROR_INVALID_HANDLE;
pub(crate) const INVALID_CONTEXT: CUresult = CUresult::CUDA_ERROR_INVALID_CONTEXT;
pub(crate) const INVALID_DEVICE: CUresult = CUresult::CUDA_ERROR_INVALID_DEVICE;
pub(crate) const NOT_SUPPORTED: CUresult = CUresult::CUDA_ERROR_NOT_SUPPORTED;
pub(crate) const NOT_FOUND: CUresult = CUresult::CUDA_ERROR_NOT_FOUND;
pub(crate) const NOT_READY: CUresult = CUresult::CUDA_ERROR_NOT_READY;
pub(crate) const OUT_OF_MEMORY: CUresult = CUresult::CUDA_ERROR_OUT_OF_MEMORY;
pub(crate) const ILLEGAL_STATE: CUresult = CUresult::CUDA_ERROR_ILLEGAL_STATE;

/// Runs an export's body: a panic is `CUDA_ERROR_UNKNOWN`, `Ok` is `CUDA_SUCCESS`.
pub(crate) fn run(body: impl FnOnce() -> R) -> CUresult {
    crate::ffi::guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        // Waits while another process holds this one locked (checkpoint.rs).
        let _pass = checkpoint::enter();
        match body() {
            Ok(()) => CUresult::CUDA_SUCCESS,
            Err(e) => e,
        }
    })
}

/// Fails unless `p` is a non-null, aligned pointer.
pub(crate) fn need<T>(p: *const T) -> R {
    if p.is_null() || !p.is_aligned() { Err(INVALID_VALUE) } else { Ok(()) }
}

/// Writes `value` through a caller's out-pointer (null or misaligned: `INVALID_VALUE`).
///
/// # Safety
/// `p` must be null or valid for a write of `T` (the caller's contract in the C API).
pub(crate) unsafe fn put<T>(p: *mut T, value: T) -> R {
    need(p)?;
    // SAFETY: p is non-null and aligned (checked above) and valid for writes by the caller's contract.
    if unsafe { crate::ffi::write_out(p, value) } { Ok(()) } else { Err(INVALID_VALUE) }
}

/// Writes `value` through an out-pointer the C API allows to be null (then nothing is written).
///
/// # Safety
/// As [`put`].
pub(crate) unsafe fn put_opt<T>(p: *mut T, value: T) -> R {
    // SAFETY: as this function's contract.
    if p.is_null() { Ok(()) } else { unsafe { put(p, value) } }
}

/// Reads a value the caller passed by pointer (null or misaligned: `INVALID_VALUE`).
///
/// # Safety
/// `p` must be null or valid for a read of `T`, holding a valid `T`.
pub(crate) unsafe fn get<T: Copy>(p: *const T) -> R<T> {
    need(p)?;
    // SAFETY: p is non-null and aligned (checked above) and valid for reads by the caller's contract.
    Ok(unsafe { p.read() })
}

/// Reads a 32-bit field of a caller's struct that Rust types as an enum, as the raw integer C
/// stored there (a value outside the enum must not become an invalid Rust enum).
///
/// # Safety
/// `field` must point into a readable caller struct, at a 4-byte field.
pub(crate) unsafe fn raw_u32<F>(field: *const F) -> u32 {
    debug_assert_eq!(std::mem::size_of::<F>(), 4);
    // SAFETY: by this function's contract the field is 4 readable bytes.
    unsafe { field.cast::<u32>().read_unaligned() }
}

/// Reads a caller's NUL-terminated string (null or not UTF-8: `INVALID_VALUE`).
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string that outlives `'a`.
pub(crate) unsafe fn cstr<'a>(p: *const c_char) -> R<&'a str> {
    // SAFETY: as this function's contract.
    unsafe { crate::ffi::read_cstr(p) }.ok_or(INVALID_VALUE)
}

/// Copies `s` into a caller's buffer of `len` bytes, truncated to fit with its NUL, as the
/// driver's name queries do (a non-positive length is `INVALID_VALUE`).
///
/// # Safety
/// `buf` must be null or valid for writes of `len` bytes.
pub(crate) unsafe fn put_str_truncated(buf: *mut c_char, len: i32, s: &str) -> R {
    if buf.is_null() || len <= 0 {
        return Err(INVALID_VALUE);
    }
    let n = s.len().min(len as usize - 1);
    // SAFETY: buf holds `len` bytes by the caller's contract and n + 1 <= len; `s` is Rust memory,
    // so the regions cannot overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
    Ok(())
}
