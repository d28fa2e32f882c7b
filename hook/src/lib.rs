//! Puts Tessera's GPUs into containers.
//!
//! What the hook shares with the daemon lives in the contract crate, `tessera_region`: the CDI
//! specs (`cdi`), the driver's files and directory (`driver`, `driver_dir`), this crate's
//! configuration file (`hook_config`), the owner record (`owner`) and the default paths (`paths`).
//! Here:
//!
//! - [`plan`]: what a container asked for, checked against its allocation, as one [`plan::Plan`].
//! - [`oci`]: config.json, the hook's state, and the wrapper's edits.
//! - [`apply`]: the OCI hook's way of applying a plan inside the container's mount namespace.
//! - [`safe`]: paths resolved inside a container's root (openat2 `RESOLVE_IN_ROOT`, or a walk).
//! - [`wrapper`]: the runtime wrapper's argv handling.
//!
//! docs/hook.md describes the whole.

pub mod apply;
pub mod oci;
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

#[cfg(test)]
mod tests {
    use tessera_region::paths;

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
            assert_eq!(entry["hook"]["path"], paths::HOOK, "{}", file.display());
            assert_eq!(
                entry["hook"]["args"],
                serde_json::json!(["tessera-hook", "--config", paths::HOOK_CONFIG, stage]),
                "{}",
                file.display()
            );
            seen.push(file.file_name().unwrap().to_string_lossy().into_owned());
        }
        seen.sort();
        assert_eq!(seen, ["tessera-hook-prestart.json.example", paths::HOOKS_D_FILE]);
    }
}
