//! Tessera's default host paths, in one place: the daemon's defaults, the hook's and the wrapper's,
//! the CDI specs, hooks.d, the installer (`tessera install`), the systemd unit and the Kubernetes
//! manifests all name these (tests check the files in deploy/ against them).
//!
//! Programs and the shim live under `/usr/local`: they are installed by `tessera install` (or by
//! hand), not by the distribution's package manager, which owns `/usr/bin` and `/usr/lib`; and on
//! hosts whose `/usr` is read-only (Fedora CoreOS, Bottlerocket-like images) `/usr/local` is the
//! writable place for them.

/// `libtessera.so` on the host (mounted into containers at [`crate::cdi::SHIM_CONTAINER_PATH`]).
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

#[cfg(test)]
mod tests {
    /// Every file in hooks.d, the entry and its examples alike, names the installed hook and the
    /// default configuration: the prestart example named `/usr/bin/tessera-hook`, where nothing
    /// installs it (issue 13's one set of paths).
    #[test]
    fn the_shipped_hooks_d_entries_name_these_paths() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("hooks.d");
        let mut seen = Vec::new();
        for file in std::fs::read_dir(&dir).unwrap() {
            let file = file.unwrap().path();
            let entry: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
            let stage = entry["stages"][0].as_str().unwrap().to_owned();
            assert_eq!(entry["hook"]["path"], super::HOOK, "{}", file.display());
            assert_eq!(
                entry["hook"]["args"],
                serde_json::json!(["tessera-hook", "--config", super::HOOK_CONFIG, stage]),
                "{}",
                file.display()
            );
            seen.push(file.file_name().unwrap().to_string_lossy().into_owned());
        }
        seen.sort();
        assert_eq!(seen, ["tessera-hook-prestart.json.example", super::HOOKS_D_FILE]);
    }
}
