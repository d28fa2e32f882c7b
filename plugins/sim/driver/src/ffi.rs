//! Helpers for the `extern "C"` boundary.

use std::ffi::c_char;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs an export's body; a panic becomes `on_panic` instead of unwinding into C.
pub fn guard<R: Copy>(on_panic: R, body: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(on_panic)
}

/// Writes `value` through an out-pointer supplied by C; false if it is null.
///
/// # Safety
/// `ptr` must be null or valid for a write of `T` (the caller's contract in the C API).
pub unsafe fn write_out<T>(ptr: *mut T, value: T) -> bool {
    if ptr.is_null() {
        return false;
    }
    // SAFETY: non-null and, by the caller's contract, valid for writes of T.
    unsafe { ptr.write(value) };
    true
}

/// Copies `s` into a C buffer of `len` bytes, NUL-terminated; false if it does not fit.
///
/// # Safety
/// `buf` must be null or valid for writes of `len` bytes.
pub unsafe fn write_cstr(buf: *mut c_char, len: usize, s: &str) -> bool {
    if buf.is_null() || s.len() + 1 > len {
        return false;
    }
    // SAFETY: buf holds at least s.len() + 1 bytes (checked above); the regions cannot overlap
    // since s is Rust-owned memory.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    true
}

/// Reads a C string supplied by the caller.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string.
pub unsafe fn read_cstr<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_str().ok()
}
