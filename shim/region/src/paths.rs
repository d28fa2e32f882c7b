//! Tessera's default host paths, in one place: the daemon's defaults, the hook's and the wrapper's,
//! the CDI specs, hooks.d, the installer (`tessera install`), the systemd unit and the Kubernetes
//! manifests all name these (tests check the files in deploy/ and hook/hooks.d against them);
//! and the paths inside a container that the daemon, the hook and the shim agree on.
//!
//! Programs and the shim live under `/usr/local`: they are installed by `tessera install` (or by
//! hand), not by the distribution's package manager, which owns `/usr/bin` and `/usr/lib`; and on
//! hosts whose `/usr` is read-only (Fedora CoreOS, Bottlerocket-like images) `/usr/local` is the
//! writable place for them.

/// `libtessera.so` on the host (mounted into containers at [`SHIM_CONTAINER_PATH`]).
pub const SHIM: &str = "/usr/local/lib/tessera/libtessera.so";
/// The OCI hook (CDI `createRuntime` entry, hooks.d).
pub const HOOK: &str = "/usr/local/bin/tessera-hook";
/// The runtime wrapper (containerd 1.6's `tessera` runtime handler, plain runc).
pub const RUNTIME_WRAPPER: &str = "/usr/local/bin/tessera-runtime";
/// The daemon.
pub const DAEMON: &str = "/usr/local/bin/tesserad";
/// The command line.
pub const CLI: &str = "/usr/local/bin/tessera";
/// The daemon's configuration.
pub const DAEMON_CONFIG: &str = "/etc/tessera/config.toml";
/// The hook's and the wrapper's configuration when nothing names another.
pub const HOOK_CONFIG: &str = "/etc/tessera/hook.toml";
/// The daemon's runtime directory: allocations, the node API socket, the hook configuration it writes.
pub const RUNTIME_DIR: &str = "/run/tessera";
/// The daemon's crash-safe state.
pub const STATE_DIR: &str = "/var/lib/tessera";
/// Where the daemon writes its CDI specs.
pub const CDI_SPEC_DIR: &str = "/var/run/cdi";
/// Where runtimes look for CDI specs (static, then dynamic: later wins).
pub const CDI_SPEC_DIRS: &[&str] = &["/etc/cdi", "/var/run/cdi"];
/// The hook configuration the daemon writes for its CDI specs, relative to its runtime directory:
/// the specs' hook entry passes it with `--config`, so it always matches the daemon's own paths.
pub const GENERATED_HOOK_CONFIG: &str = "hook.toml";
/// The OCI hooks directory for administrators' hooks (podman, CRI-O).
pub const HOOKS_D: &str = "/etc/containers/oci/hooks.d";
/// The hooks.d entry's file name.
pub const HOOKS_D_FILE: &str = "tessera-hook.json";
/// The driver directories' parent, under the daemon's state directory (`<state_dir>/driver/<key>`, the
/// `driver_dir` module).
pub const DRIVER_DIRS: &str = "driver";

/// An allocation's directory under the daemon's runtime directory: `<runtime_dir>/alloc/<id>/`.
pub const ALLOC_SUBDIR: &str = "alloc";
/// The limits file's name in an allocation directory (`crate::limits`).
pub const LIMITS_FILE: &str = "limits";
/// The region's name in an allocation directory (`crate::region`).
pub const REGION_FILE: &str = "region";

// Inside a container.

pub use crate::limits::CONTAINER_ALLOC_DIR;
/// Where the shim goes in a container.
pub const SHIM_CONTAINER_PATH: &str = "/usr/lib/tessera/libtessera.so";
/// The preload file naming the shim, mounted over the container's own.
pub const PRELOAD_PATH: &str = "/etc/ld.so.preload";

/// The content of the preload file ([`PRELOAD_PATH`]): the shim's container path. The hook, the
/// daemon's kubelet answer and the claims' specs mount a host file of exactly these bytes.
pub fn preload_content() -> String {
    format!("{SHIM_CONTAINER_PATH}\n")
}

/// Where the driver directory appears in a container; each driver file's usual path is a link
/// into it (`/usr/lib/x86_64-linux-gnu/libcuda.so.1` -> `<this>/usr/lib/x86_64-linux-gnu/libcuda.so.1`).
pub const DRIVER_CONTAINER_DIR: &str = "/usr/lib/tessera/driver";
/// The environment variable naming a container's allocation (the hook reads it; the daemon's
/// container edits set it).
pub const ENV_ALLOCATION: &str = "TESSERA_ALLOCATION";
