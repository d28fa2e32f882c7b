//! NVML functions a real `libnvidia-ml.so.1` exports that the sim does not model: each answers
//! `NVML_ERROR_UNINITIALIZED` before `nvmlInit`, then `NVML_ERROR_NOT_SUPPORTED` (and says so
//! under `TESSERA_SIM_TRACE`), so that a program resolving every function (HAMi-core, NVIDIA's
//! tools) gets a function, never a null lookup, and a clear code if it calls one.
//!
//! For most of them that is also what a real driver answers on the bare-metal data-centre GPUs the
//! sim models: the vGPU host and guest calls, units (S-class systems only), FBC/encoder sessions,
//! GPU-direct and display queries. The list is generated at build time (`build.rs`): every name
//! of `exports/nvml.names` (the names `nvml.h` declares; `exports/derive-names.py` derives it)
//! that no `nvml_exports!` item under `src/nvml/` defines. Modelling a function means adding its
//! row to `tessera_abi::nvml`'s table and defining it in its family's module with
//! `nvml_exports!`; its stub then disappears.
//!
//! The exports take no parameters: under the C calling convention a caller may pass any arguments
//! to such a function, and the answer does not depend on them.

use nvml_wrapper_sys::bindings::nvmlReturn_t;

use super::{NOT_SUPPORTED, NVML_ERROR_UNKNOWN};

fn not_modelled(symbol: &str) -> nvmlReturn_t {
    if let Err(uninitialized) = super::node() {
        return uninitialized;
    }
    crate::cuda::trace::line(format_args!("{symbol} called: not modelled (NVML_ERROR_NOT_SUPPORTED)"));
    NOT_SUPPORTED
}

macro_rules! not_modelled {
    ($($symbol:ident;)*) => {
        $(
            #[unsafe(no_mangle)]
            pub extern "C" fn $symbol() -> nvmlReturn_t {
                crate::ffi::guard(NVML_ERROR_UNKNOWN, || not_modelled(stringify!($symbol)))
            }
        )*

        /// The names of these functions (for tests).
        #[cfg(test)]
        pub(crate) static NAMES: &[&str] = &[$(stringify!($symbol),)*];
    };
}

// One line per not-modelled export.
include!(concat!(env!("OUT_DIR"), "/nvml_not_modelled.rs"));

#[cfg(test)]
mod tests {
    #[test]
    fn the_functions_the_issue_names_are_modelled_or_answer() {
        // nvmlDeviceGetVirtualizationMode is modelled (NVIDIA's DRA driver needs it).
        assert!(!super::NAMES.contains(&"nvmlDeviceGetVirtualizationMode"));
        assert!(!super::NAMES.contains(&"nvmlUnitGetCount"));
        assert!(super::NAMES.contains(&"nvmlVgpuInstanceGetLicenseInfo_v2"));
    }
}
