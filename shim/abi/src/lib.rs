//! The function signatures of NVIDIA's two driver libraries, written once: one table per family,
//! [`cuda`] (`libcuda.so.1`, `cuda.h`) and [`nvml`] (`libnvidia-ml.so.1`, `nvml.h`). Each row is
//! one exported function with its parameters (names and types); a row may name the function's
//! per-thread-default-stream twin (`_ptsz`/`_ptds`), which has the same signature.
//!
//! Both sides of the ABI are generated from these tables:
//! - the simulated driver (`plugins/sim/driver`) defines its exports with [`cuda_exports!`] and
//!   [`nvml_exports!`], writing only the parameter names and a body;
//! - the shim (`libtessera.so`) defines its hooks the same way, and types its tables of the real
//!   driver's functions by name ([`cuda::pfn`], [`nvml::pfn`]).
//!
//! A definition whose parameters are not the row's (a name, the count) does not compile. Enum
//! parameters are raw integers, and caller structs whose enum fields are read have raw-integer
//! mirrors here ([`cuda::raw`]), so a value C passes is never an invalid Rust enum.
//!
//! Which names a real driver exports (and under which base name, CUDA version and flavour
//! `cuGetProcAddress` hands each out) is a separate fact, derived from NVIDIA's headers into the
//! lists the simulated driver keeps, `plugins/sim/driver/exports/*.names`; `build.rs` makes the
//! CUDA list [`cuda::EXPORTS`], from which the shim takes the versions of the functions it hooks.
//! The tables hold the functions Tessera defines or calls. Adding a function: add its row to the
//! family's table (keeping its section), then define it with the family's exports macro.

#[macro_use]
mod table;
mod exports;

pub mod cuda;
pub mod nvml;
