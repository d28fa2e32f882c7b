//! The NVML half of the simulated driver: NVIDIA's `libnvidia-ml.so.1` ABI over the device model.
//!
//! Every export has the exact name, signature and struct layouts of `nvml.h` (API version 13, the
//! header go-nvml ships); the structs come from `nvml-wrapper-sys`, generated from that header. Where
//! the header renames a function to a versioned one (`#define nvmlInit nvmlInit_v2`, ...), both the
//! old and the new symbol are exported, the old one with the old struct layout where it had one.
//!
//! Conventions shared by all exports:
//! - the body runs inside [`crate::ffi::guard`], so a panic becomes `NVML_ERROR_UNKNOWN`;
//! - NVML must be initialized (`nvmlInit*`, reference-counted) or the call is `NVML_ERROR_UNINITIALIZED`;
//! - handles are addresses inside static tables ([`handles`]); anything else is `INVALID_ARGUMENT`;
//! - null or misaligned pointers are `INVALID_ARGUMENT`, checked before anything is written;
//! - a GPU that has fallen off the bus answers `NVML_ERROR_GPU_IS_LOST`;
//! - model errors map to NVML codes in one place ([`errors::code`]).

// NVML's own names (enum constants matched in patterns, `nvmlX` exports) are kept as the header spells them.
#![allow(non_upper_case_globals, non_snake_case)]

mod device;
mod errors;
mod events;
mod handles;
mod init;
mod memory;
mod mig;
mod not_modelled;
mod processes;
mod reset;
mod sensors;
mod topology;
mod units;

use std::ffi::c_char;

use nvml_wrapper_sys::bindings::*;
use tessera_abi::nvml_exports;
use tessera_sim_model::{Node, SimError};

pub(crate) use errors::code;

/// Result of an export's body: `Err` carries the NVML return code.
pub(crate) type R<T = ()> = Result<T, nvmlReturn_t>;

pub(crate) const SUCCESS: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
pub(crate) const UNINITIALIZED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
pub(crate) const INVALID_ARGUMENT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
pub(crate) const NOT_SUPPORTED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
pub(crate) const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
pub(crate) const INSUFFICIENT_SIZE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
pub(crate) const DRIVER_NOT_LOADED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
pub(crate) const TIMEOUT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
pub(crate) const GPU_IS_LOST: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
pub(crate) const RESET_REQUIRED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED;
pub(crate) const IN_USE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_IN_USE;
pub(crate) const MEMORY: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_MEMORY;
pub(crate) const INSUFFICIENT_RESOURCES: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
pub(crate) const VERSION_MISMATCH: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
pub(crate) const UNKNOWN: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNKNOWN;

/// `NVML_ERROR_UNKNOWN`, what [`crate::ffi::guard`] returns when a body panics.
pub(crate) const NVML_ERROR_UNKNOWN: nvmlReturn_t = UNKNOWN;

/// [`nvml_exports!`] for the common body: one that gives an [`R`]. Each body runs in
/// [`crate::ffi::guard`] (a panic is `NVML_ERROR_UNKNOWN`) and [`status`] makes its result the
/// return code, so the bodies need not repeat that wrapper.
macro_rules! nvml_guarded_exports {
    ($($(#[$m:meta])* fn $name:ident($($a:ident),* $(,)?) $(also $($also:ident),+)? $body:block)*) => {
        tessera_abi::nvml_exports! {
            $($(#[$m])* fn $name($($a),*) $(also $($also),+)? {
                crate::ffi::guard(crate::nvml::NVML_ERROR_UNKNOWN, || crate::nvml::status(|| $body))
            })*
        }
    };
}
pub(crate) use nvml_guarded_exports;

/// `NVML_STRUCT_VERSION(data, ver)`: the size of the versioned struct with the version in the top byte.
pub(crate) const fn struct_version<T>(ver: u32) -> u32 {
    std::mem::size_of::<T>() as u32 | (ver << 24)
}

/// Turns a body's result into the NVML return code.
pub(crate) fn status(body: impl FnOnce() -> R) -> nvmlReturn_t {
    match body() {
        Ok(()) => SUCCESS,
        Err(c) => c,
    }
}

/// Maps model results to NVML codes.
pub(crate) trait Nv<T> {
    fn nv(self) -> R<T>;
}

impl<T> Nv<T> for Result<T, SimError> {
    fn nv(self) -> R<T> {
        self.map_err(|e| code(&e))
    }
}

/// The node, once NVML is initialized.
pub(crate) fn node() -> R<&'static Node> {
    init::node()
}

/// Fails unless `p` is a non-null, aligned out-pointer.
pub(crate) fn need<T>(p: *const T) -> R {
    if p.is_null() || !p.is_aligned() { Err(INVALID_ARGUMENT) } else { Ok(()) }
}

/// Writes `value` through a caller's out-pointer (null or misaligned: `INVALID_ARGUMENT`).
///
/// # Safety
/// `p` must be null or valid for a write of `T` (the caller's contract in the C API).
pub(crate) unsafe fn put<T>(p: *mut T, value: T) -> R {
    need(p)?;
    // SAFETY: p is non-null and aligned (checked above) and valid for writes by the caller's contract.
    if unsafe { crate::ffi::write_out(p, value) } { Ok(()) } else { Err(INVALID_ARGUMENT) }
}

/// Reads a value the caller passed by pointer (null or misaligned: `INVALID_ARGUMENT`).
///
/// # Safety
/// `p` must be null or valid for a read of `T`.
pub(crate) unsafe fn get<T: Copy>(p: *const T) -> R<T> {
    need(p)?;
    // SAFETY: p is non-null and aligned (checked above) and valid for reads by the caller's contract.
    Ok(unsafe { p.read() })
}

/// Copies `s` into a caller's buffer of `length` bytes with its NUL: null buffer is
/// `INVALID_ARGUMENT`, a short one `INSUFFICIENT_SIZE`.
///
/// # Safety
/// `buf` must be null or valid for writes of `length` bytes.
pub(crate) unsafe fn put_str(buf: *mut c_char, length: u32, s: &str) -> R {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: buf is non-null and holds `length` bytes by the caller's contract.
    if unsafe { crate::ffi::write_cstr(buf, length as usize, s) } { Ok(()) } else { Err(INSUFFICIENT_SIZE) }
}

/// Copies `s` into a fixed-size C char array (structs' name fields), truncated to fit with its NUL.
pub(crate) fn fill_chars<const N: usize>(dst: &mut [c_char; N], s: &str) {
    let n = s.len().min(N.saturating_sub(1));
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = c_char::from_ne_bytes([*b]);
    }
    for d in dst.iter_mut().skip(n) {
        *d = 0;
    }
}

/// The count-and-fill protocol of NVML's list queries: `*count` is the caller's capacity on
/// entry. A short (or null) buffer gets `INSUFFICIENT_SIZE` with the needed count; otherwise the
/// items are written and `*count` set to how many.
///
/// # Safety
/// `count` must be null or valid for reads and writes of `u32`; `buf` must be null or valid for
/// writes of `*count` elements.
pub(crate) unsafe fn fill_list<T>(count: *mut u32, buf: *mut T, items: Vec<T>) -> R {
    // SAFETY: as this function's contract.
    let capacity = unsafe { get(count) }?;
    let n = items.len() as u32;
    if capacity < n {
        // SAFETY: count was checked non-null and aligned by `get`.
        unsafe { put(count, n) }?;
        return Err(INSUFFICIENT_SIZE);
    }
    if n > 0 {
        need(buf)?;
        for (i, item) in items.into_iter().enumerate() {
            // SAFETY: buf is non-null, aligned and holds at least `capacity >= n` elements.
            unsafe { buf.add(i).write(item) };
        }
    }
    // SAFETY: count was checked above.
    unsafe { put(count, n) }
}
