//! S-class units (`nvmlUnit*`): a node of PCIe or SXM boards has none, so `nvmlUnitGetCount` is
//! zero (what a real driver answers there) and every other unit call is not-modelled.

use super::*;

nvml_guarded_exports! {
    /// `nvmlUnitGetCount`: no units.
    fn nvmlUnitGetCount(unitCount) {
        node()?;
        // SAFETY: unitCount is null or valid for a write by the caller's contract.
        unsafe { put(unitCount, 0) }
    }
}
