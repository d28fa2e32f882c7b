//! The contracts between Tessera's parts: `tesserad` (the daemon), `tessera-hook` /
//! `tessera-runtime` (container injection) and `libtessera.so` (the in-container limiter). Every
//! file one part writes and another reads is defined here, once: the limits file, the accounting
//! region, the ledger, the owner record, the CDI specs and their container edits, the driver
//! directory, the hook's configuration, and the default paths. The daemon, the hook and the shim
//! depend on this crate; none of them on another.
//!
//! Every side reads the region through its one `#[repr(C)]` definition (see [`region`]); nothing
//! else defines the layout.
//!
//! What the shim uses (no feature):
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
//! - [`context_sizes`]: what a CUDA context takes on each GPU, measured by tesserad and written
//!   beside `limits` (read-only in the container), so a process charges its first context
//!   without loading NVML; refused whole unless well formed and sane.
//! - [`paths`]: the default host paths every part and deploy/ use, and the paths inside a
//!   container (the allocation directory, the shim, the preload file, the driver directory).
//! - [`owner`]: who a container is ([`owner::ContainerIdentity`], one type for the allocation
//!   record and the owner record); with `host`, the owner record the hook writes into the
//!   allocation directory, and the lease and deletion markers beside it.
//!
//! The host side's (feature `host`, JSON; the shim does not enable it):
//! - [`cdi`]: the CDI specs the daemon writes (`tessera.io/gpu`, `/mig`, `/share`, one per
//!   prepared DRA claim) and the hook reads: device names and the container edits.
//! - [`driver`]: the host driver's user-space files, found by name under a driver root; its
//!   control nodes; the MIG capability minors.
//! - [`driver_dir`]: the driver directory: those files gathered once, for one mount per container.
//! - [`hook_config`]: the hook's and the wrapper's configuration (`/etc/tessera/hook.toml`, and
//!   the one tesserad writes for its specs).

#[cfg(feature = "host")]
pub mod cdi;
pub mod context_sizes;
#[cfg(feature = "host")]
pub mod driver;
#[cfg(feature = "host")]
pub mod driver_dir;
pub mod guard;
#[cfg(feature = "host")]
pub mod hook_config;
pub mod ledger;
pub mod limits;
pub mod owner;
pub mod paths;
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

/// FNV-1a, 64 bits: names of generated files that change when their content does (not a
/// security boundary: the files are root's).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}
