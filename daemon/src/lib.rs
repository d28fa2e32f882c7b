//! `tessera-daemon`: the per-node daemon's library, one module per concern.
//!
//! - [`config`]: the TOML configuration, validated up front; reload diffs.
//! - [`discovery`]: the one NVML session and inventory snapshots of the node.
//! - [`partition`]: MIG layouts (pure planning, NVML apply) and time-sliced shares.
//! - [`state`]: allocation records, crash-safe on disk, and the per-allocation directories
//!   (`limits` + `region`) the shim reads.
//! - [`kubelet`]: the device-plugin servers (one socket per resource), registration and
//!   re-registration when the kubelet restarts.
//! - [`resources`]: what is advertised (whole GPUs, MIG devices, shares) from the inventory.
//! - [`allocator`]: the kubelet's `Allocate` and preferences over the state store.
//!
//! Still to come (issue 4): the node API and CLI; then health and telemetry (issue 6).

pub mod allocator;
pub mod config;
pub mod discovery;
pub mod kubelet;
pub mod partition;
pub mod resources;
pub mod state;
