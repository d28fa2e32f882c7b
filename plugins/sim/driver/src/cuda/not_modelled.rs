//! Functions a real driver exports that the sim does not model: each answers
//! `CUDA_ERROR_NOT_SUPPORTED` (and says so under `TESSERA_SIM_TRACE`), so that a program, or the
//! CUDA runtime, which looks every function up at start, gets a function, never a null lookup,
//! and a clear code if it calls one.
//!
//! The list is generated at build time (`build.rs`): every line of `exports/cuda.names` (the
//! names NVIDIA's headers declare, with the base name, version and flavour `cuGetProcAddress`
//! hands each out under; `exports/derive-names.py` derives it) whose symbol
//! [`super::proc_table`] does not list. Modelling a function means adding its row to
//! `tessera_abi::cuda`'s table (if it has none), defining it in its family's module with
//! `cuda_exports!` and adding its line to [`super::proc_table`]; its stub then disappears.
//!
//! The exports take no parameters: under the C calling convention a caller may pass any arguments
//! to such a function, and the answer does not depend on them.

use super::proc_table::{Entry, Pt};
use super::{CUresult, NOT_SUPPORTED};

fn not_modelled(symbol: &str) -> CUresult {
    super::trace::line(format_args!("{symbol} called: not modelled (CUDA_ERROR_NOT_SUPPORTED)"));
    NOT_SUPPORTED
}

macro_rules! not_modelled {
    ($($symbol:ident = $base:literal $version:literal $pt:ident;)*) => {
        $(
            #[unsafe(no_mangle)]
            pub extern "C" fn $symbol() -> CUresult {
                crate::ffi::guard(CUresult::CUDA_ERROR_UNKNOWN, || not_modelled(stringify!($symbol)))
            }
        )*

        /// The `cuGetProcAddress` entries of these functions.
        pub(crate) static ENTRIES: &[Entry] = &[
            $(Entry { name: $base, version: $version, pt: Pt::$pt, symbol: stringify!($symbol), f: $symbol as *const () },)*
        ];
    };
}

// One line per not-modelled export: `symbol = "base name" version flavour;`.
include!(concat!(env!("OUT_DIR"), "/cuda_not_modelled.rs"));
