//! The contract between `libtessera.so` (the in-container limiter) and `tesserad`: the limits file
//! format and the per-container accounting region.
//!
//! Both sides depend on this crate and read the region through its one `#[repr(C)]` definition
//! (see [`region`]); nothing else defines the layout.
//!
//! - [`limits`]: what a container may use (memory per device, SM share, priority, compute mode),
//!   read from a TOML file the daemon rewrites atomically, or from `TESSERA_*` environment variables
//!   when the shim runs standalone. Every error names the key (or variable) and the reason.
//! - [`region`]: a fixed-layout mapped file made only of atomics: per device the container's total
//!   (never its limits: the region is the container's to write), per process a slot with its
//!   usage and counters. Reserving memory is one CAS on the device total; a process's liveness is
//!   an open-file-description lock the kernel drops at death, so a SIGKILLed process's memory is
//!   returned by whoever reaps, and no process-shared lock exists that a dead process could leave
//!   held.
//! - [`guard`]: a SIGBUS guard, so that a region file shrunk under its mappings (any process of
//!   the container can `ftruncate` it) turns the region to zeros in the mappers instead of
//!   killing them, the daemon among them.
//! - [`ledger`]: per allocation, tesserad's view of the other containers on its GPUs (a
//!   high-priority neighbour busy, what the others use), published into a file the container
//!   reads only: priorities and lending without a file that tenants share and could forge.
//! - [`trace`]: on-demand tracing: a lock-free multi-producer ring of API and kernel spans (and
//!   kernel names) in the region, written only while the daemon sets the header's
//!   `trace_requested`.

pub mod guard;
pub mod ledger;
pub mod limits;
pub mod region;
mod sys;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod trace;

pub use limits::*;
pub use region::*;
/// The clock of heartbeats and joins (CLOCK_MONOTONIC, ns): the same in every process and container.
pub use sys::monotonic_ns;
pub use trace::*;
