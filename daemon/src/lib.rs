//! `tessera-daemon`: the per-node daemon's library, one module per concern.
//!
//! - [`config`]: the TOML configuration, validated up front; reload diffs.
//! - [`discovery`]: the one NVML session and inventory snapshots of the node.
//! - [`partition`]: MIG layouts (pure planning, NVML apply) and time-sliced shares.
//!
//! Still to come (issue 4): allocation state, the kubelet device-plugin servers, health,
//! the node API, telemetry.

pub mod config;
pub mod discovery;
pub mod partition;
