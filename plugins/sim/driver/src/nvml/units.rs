//! S-class units (`nvmlUnit*`): a node of PCIe or SXM boards has none, so `nvmlUnitGetCount` is
//! zero (what a real driver answers there) and every other unit call is not-modelled.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::nvmlReturn_t;

use super::*;
use crate::ffi::guard;

/// `nvmlUnitGetCount`: no units.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlUnitGetCount(unitCount: *mut c_uint) -> nvmlReturn_t {
    guard(NVML_ERROR_UNKNOWN, || {
        status(|| {
            node()?;
            // SAFETY: unitCount is null or valid for a write by the caller's contract.
            unsafe { put(unitCount, 0) }
        })
    })
}
