//! The Kubernetes DRA driver `gpu.tessera.io` (resource.k8s.io/v1), beside the device plugin:
//!
//! - [`service`]: what the kubelet calls: plugin registration (a `Registration` service on a socket in
//!   the kubelet's `plugins_registry` directory) and the `DRAPlugin` service, v1 and v1beta1, on
//!   `<plugins_dir>/gpu.tessera.io/dra.sock`; each claim goes to a [`ClaimDriver`].
//! - [`claims`]: a ResourceClaim's allocation result (devices, consumed capacity, opaque config
//!   of this driver) read from the API server through kube-rs.
//! - [`devices`]: the devices this node publishes (whole GPUs, MIG devices, one shareable device
//!   per GPU with consumable `memory` and `sm`), and Kubernetes quantities.
//! - [`dynamic_mig`]: MIG placements published as partitionable devices (shared counters per
//!   GPU) and created / destroyed on demand by prepare / unprepare.
//! - [`slices`]: those devices as the node's ResourceSlices (the layout follows the API server's
//!   version), kept current through the API server.
//! - [`prepare`]: NodePrepareResources / NodeUnprepareResources over the allocation store: the
//!   claim UID owns the allocation, the consumed capacity is its limits.
//! - [`claim_specs`]: one CDI spec per prepared claim (kind `tessera.io/claim`), the names the
//!   kubelet passes to the runtime: the devices, the allocation's directory, the shim, its env.
//! - [`status`]: the claim's `status.devices` (what was granted), by server-side apply.
//! - [`health_service`]: the kubelet's resource-health service (`DRAResourceHealth`, v1 and
//!   v1alpha1) on the DRA socket: every published device's health, streamed on each change.
//! - [`driver`]: all of it started in tesserad, following the controller's published offer.
//! - [`preflight`]: whether the cluster can run DRA at all (API server 1.34+ serving
//!   resource.k8s.io/v1, a kubelet with DRA); where not, tesserad says which and serves the
//!   device plugin instead.

pub mod claim_specs;
pub mod claims;
pub mod devices;
pub mod driver;
pub mod dynamic_mig;
pub mod health_service;
pub mod preflight;
pub mod prepare;
pub mod service;
pub mod slices;
pub mod status;

pub use service::{ClaimDriver, ClaimRef, DraPlugin, PreparedDevice};

/// The DRA driver name (`ResourceSlice.spec.driver`, DeviceClass selectors, opaque config).
pub const DRIVER: &str = "gpu.tessera.io";
/// The registration socket's file name in the kubelet's `plugins_registry` directory.
pub const REGISTRATION_SOCKET: &str = "gpu.tessera.io-reg.sock";
/// The DRA service's socket file name in `<plugins_dir>/gpu.tessera.io/`.
pub const SERVICE_SOCKET: &str = "dra.sock";
