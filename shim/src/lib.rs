//! `libtessera.so`: the in-container limiter. Loaded into every process of a container (an
//! `/etc/ld.so.preload` the hook mounts, or `LD_PRELOAD`), it enforces the container's share of
//! each GPU: a hard device-memory limit across all the container's processes, SM shares and
//! priorities (the compute limiter, [`compute`]), and an NVML view that shows the container's
//! GPU rather than the whole board.
//!
//! - [`intercept`]: how calls reach the hooks on all three driver lookup paths (direct links,
//!   `dlsym`, `cuGetProcAddress`), and the one list of hooked symbols;
//! - [`real`]: the real driver's functions, resolved lazily from the real libraries;
//! - [`state`]: limits, the accounting region and this process's slot; fail closed; live reload;
//! - [`memory`]: every allocation family, contexts' overhead, the virtual GPU's memory info;
//! - [`launch`]: the launch hooks, through the compute limiter;
//! - [`nvml_view`]: NVML's memory info and process lists as the container sees them.
//! - [`trace`]: on-demand tracing: API and kernel spans into the region while the daemon asks.
//!
//! Rules: nothing runs at load time (no constructor: everything is made on the first CUDA or NVML
//! call); a process that never touches CUDA pays one comparison per `dlsym` call; no panic
//! crosses `extern "C"` (every export runs its body in [`ffi::guard`]).

#![allow(non_snake_case)] // hooks and their parameters carry cuda.h's and nvml.h's names

mod compute;
mod current;
mod ffi;
mod intercept;
mod launch;
mod memory;
mod nvml_view;
pub(crate) mod real;
pub(crate) mod state;
mod trace;
