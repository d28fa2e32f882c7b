//! Puts Tessera's GPUs into containers.
//!
//! - [`cdi`]: the CDI specs the daemon writes (`tessera.io/gpu`, `/mig`, `/share`) and the hook reads.
//! - [`driver`]: the host driver's user-space files, found by name under a driver root.
//! - [`bundle`]: the driver directory: those files gathered once, for one mount per container.
//! - [`config`]: the hook's and the wrapper's own configuration (`/etc/tessera/hook.toml`).
//! - [`paths`]: the default host paths every part and deploy/ use.
//! - [`owner`]: the record of which container holds an allocation, for the daemon's reports.
//! - [`plan`]: what a container asked for, checked against its allocation, as one [`plan::Plan`].
//! - [`oci`]: config.json, the hook's state, and the wrapper's edits.
//! - [`apply`]: the OCI hook's way of applying a plan inside the container's mount namespace.
//! - [`safe`]: paths resolved inside a container's root (openat2 `RESOLVE_IN_ROOT`, or a walk).
//! - [`wrapper`]: the runtime wrapper's argv handling.
//!
//! docs/hook.md describes the whole.

pub mod apply;
pub mod bundle;
pub mod cdi;
pub mod config;
pub mod driver;
pub mod oci;
pub mod owner;
pub mod paths;
pub mod plan;
pub mod safe;
mod sys;
pub mod wrapper;

/// Removes every environment variable but a fixed PATH. The hook runs as root in the host's
/// namespaces; nothing the container or its image says may steer it (CVE-2025-23266: an image's
/// LD_PRELOAD reached a hook). The dynamic loader has already run by then, which is why every hook
/// entry this crate writes also carries an explicit, minimal `env`.
pub fn sanitize_env() {
    let names: Vec<_> = std::env::vars_os().map(|(k, _)| k).collect();
    for k in names {
        // SAFETY: called at the start of main, before any other thread exists.
        unsafe { std::env::remove_var(k) };
    }
    // SAFETY: as above, single-threaded.
    unsafe { std::env::set_var("PATH", "/usr/sbin:/usr/bin:/sbin:/bin") };
}

/// FNV-1a, 64 bits: names of generated files that change when their content does (not a
/// security boundary: the files are root's).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}
