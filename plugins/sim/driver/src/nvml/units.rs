//! S-class units (`nvmlUnit*`): a node of PCIe or SXM boards has none, so `nvmlUnitGetCount` is
//! zero (what a real driver answers there) and every other unit call is not-modelled.

use super::*;
use crate::ffi::guard;

nvml_exports! {
    /// `nvmlUnitGetCount`: no units.
    fn nvmlUnitGetCount(unitCount) {
        guard(NVML_ERROR_UNKNOWN, || {
            status(|| {
                node()?;
                // SAFETY: unitCount is null or valid for a write by the caller's contract.
                unsafe { put(unitCount, 0) }
            })
        })
    }
}
