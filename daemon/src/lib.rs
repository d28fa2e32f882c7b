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
//! - [`device_health`]: health as one value with its reason, and the one rule that says what the
//!   health monitor's findings mean for each device.
//! - [`allocator`]: the allocation core: record, release and set limits over the state store,
//!   and its three ways in: the kubelet's `Allocate`, the node API's on-demand shares
//!   (`Allocate`, `Release`, `SetLimits`) and DRA claims.
//! - [`carve`]: admission and placement of shares carved on demand from a GPU's free room.
//! - [`lease`]: node API allocations leased to a container, released when it is deleted.
//! - [`dra`]: the Kubernetes DRA driver `gpu.tessera.io`: kubelet registration and DRA service,
//!   claims read and ResourceSlices published through the API server.
//! - [`kubernetes`]: faults and recoveries as Kubernetes Events, and GPU labels on the Node.
//!
//! - [`node`]: the live picture of the node (configuration, inventory, layouts, resources) and
//!   the one place that changes it: layout changes, reloads.
//! - [`events`]: the event stream (health, partition changes, faults), kept for replay.
//! - [`health`]: XID / ECC / lost-GPU detection, the XID policy, recovery after a reset.
//! - [`cdi`]: the CDI specs written for container runtimes, refreshed when offerings change.
//! - [`api`]: the node API (`tessera.v1`) on an owner-only Unix socket.
//! - [`usage`]: per-container usage read from the accounting regions.
//! - [`view`]: the node as the controller publishes it, the one value every face reads.
//! - [`holdings`]: what the records hold of each device, published in the view, and what is
//!   free for each face (the device plugin's withdrawn devices, what DRA takes out).
//! - [`podresources`]: which pod holds each allocation (the kubelet's pod-resources API), and
//!   releasing allocations whose container is gone.
//! - [`telemetry`]: Prometheus `/metrics` (off unless configured).
//! - [`socket`]: owner-only Unix sockets.
//! - [`blocking`]: short blocking work (a journal flush) run inside a request handler without a
//!   thread hop.
//! - [`install`]: `tessera install` / `uninstall`: the hook, wrapper and shim on a host, runtimes configured.
//! - [`trace`]: on-demand traces of a container's CUDA calls and kernels (Trace Event Format).

pub mod allocator;
pub mod api;
pub mod blocking;
pub mod carve;
pub mod cdi;
pub mod client_input;
pub mod config;
pub mod device_health;
pub mod discovery;
pub mod dra;
pub mod enforcement;
pub mod events;
pub mod health;
pub mod holdings;
pub mod install;
pub mod kube_client;
pub mod kubelet;
pub mod kubernetes;
pub mod lease;
pub mod ledger;
pub mod node;
pub mod park;
pub mod partition;
pub mod podresources;
pub mod procfs;
pub mod resources;
pub mod socket;
pub mod state;
pub mod telemetry;
#[cfg(test)]
pub(crate) mod testlog;
pub mod trace;
pub mod usage;
pub mod view;
