//! The CDI specs the daemon writes for container runtimes (containerd 1.7+, CRI-O, podman) and
//! for `tessera-hook` / `tessera-runtime`: one device per offered GPU, MIG device and share,
//! named as the kubelet allocates them (`tessera.io/share=GPU-…::3`), rewritten atomically
//! whenever what is offered changes. The spec format and the container edits are the contract
//! crate's (`tessera_region::cdi`); this module only says which devices exist and which host nodes
//! each needs: `/dev/nvidia<minor>` from NVML's minor number, and for a MIG device its parent's
//! node plus its `nvidia-caps` access nodes from the driver's `mig-minors` table
//! (`tessera_region::driver::MigMinors`, read when the offer is built).

use std::path::{Path, PathBuf};

use tessera_region::cdi::{self, NodeDevice, NodeDevices};
use tessera_region::driver::{self, DriverConfig, DriverFiles};
use tessera_region::driver_dir;
use tessera_region::hook_config::HookConfig;
use tessera_region::paths;

use crate::config::Injection;
use crate::discovery::Inventory;
use crate::resources::{Kind, Resources};

/// What the specs are written from, as plain data: the GPUs found, what is offered, and the
/// device root their nodes are under. The controller's published view gives one
/// (`impl From<&view::View>`, in `node`), so this module needs nothing above it.
#[derive(Debug, Clone, Copy)]
pub struct Offer<'a> {
    pub inventory: &'a Inventory,
    pub resources: &'a Resources,
    pub dev_root: &'a Path,
}

/// Writes the specs; remembers what it wrote last so an unchanged node costs nothing.
#[derive(Debug)]
pub struct CdiWriter {
    dir: PathBuf,
    base: NodeDevices,
    last: Option<Vec<NodeDevice>>,
}

impl CdiWriter {
    /// `None` when no spec directory is configured. Driver files are found once, now, under the
    /// driver root as the daemon sees it, and written into the specs as the host sees them (and
    /// gathered into a driver directory under `state_dir`, see [`base`]). The hook configuration
    /// the specs name (`<runtime_dir>/hook.toml`) is written now too, from the same settings, so
    /// that the specs' hook never falls back to its own defaults.
    pub fn new(cfg: &Injection, runtime_dir: &Path, state_dir: &Path) -> Result<Option<CdiWriter>, String> {
        if cfg.cdi_spec_dir.as_os_str().is_empty() {
            return Ok(None);
        }
        let hook_config = runtime_dir.join(paths::GENERATED_HOOK_CONFIG);
        let text = spec_hook_config(cfg, runtime_dir).render();
        crate::state::durable::write_file(&hook_config, text.as_bytes(), 0o644)
            .map_err(|e| format!("writing the specs' hook configuration {}: {e}", hook_config.display()))?;
        let base = base(cfg, runtime_dir, state_dir);
        warn_unseen(cfg, &base);
        Ok(Some(CdiWriter { dir: cfg.cdi_spec_dir.clone(), base, last: None }))
    }

    /// Writes the specs for `offer`, unless that is what was written last. Returns
    /// whether anything was written.
    pub fn write<'a>(&mut self, offer: impl Into<Offer<'a>>) -> Result<bool, String> {
        let devices = node_devices(offer.into());
        if self.last.as_ref() == Some(&devices) {
            return Ok(false);
        }
        // A device whose node is missing (a MIG instance whose capability node the host has not
        // made yet) is left out, said per device: it failed every spec, all devices' with it.
        let (present, missing) = split_missing(&devices);
        for d in &missing {
            let absent: Vec<String> = d.nodes.iter().filter(|n| !n.exists()).map(|n| n.display().to_string()).collect();
            tracing::error!(device = %d.name, nodes = %absent.join(", "), "left out of the CDI specs: its device node is missing");
        }
        let node = NodeDevices { devices: present, ..self.base.clone() };
        let specs = cdi::build_specs(&node).map_err(|e| format!("CDI specs: {e}"))?;
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        cdi::write_specs(&self.dir, &specs).map_err(|e| format!("writing CDI specs: {e}"))?;
        tracing::info!(dir = %self.dir.display(), devices = devices.len() - missing.len(), "CDI specs written");
        // With a device left out, the next refresh tries again (its node may be there by then).
        self.last = missing.is_empty().then_some(devices);
        Ok(true)
    }
}

/// Says at start, naming the key, what the specs will name that this daemon cannot see: every
/// container start would fail on it (the hook refuses a missing shim) or get no driver. A daemon
/// in a container may not see host paths it names, so these are warnings, not errors.
fn warn_unseen(cfg: &Injection, base: &NodeDevices) {
    let unseen = |key: &str, path: &Path| {
        if !path.as_os_str().is_empty() && !path.exists() {
            tracing::warn!(
                key,
                path = %path.display(),
                "the CDI specs name a file this daemon does not see: container starts fail unless the host has it"
            );
        }
    };
    unseen("injection.shim_path", &cfg.shim_path);
    unseen("injection.hook_path", &cfg.hook_path);
    if base.driver.libraries.is_empty() {
        tracing::warn!(
            key = "injection.driver_root",
            path = %cfg.driver_root.display(),
            "no driver libraries found under the driver root: containers get no libcuda or libnvidia-ml"
        );
    }
}

/// The devices whose nodes are all there, and those with a node missing.
fn split_missing(devices: &[NodeDevice]) -> (Vec<NodeDevice>, Vec<NodeDevice>) {
    devices.iter().cloned().partition(|d| d.nodes.iter().all(|n| n.exists()))
}

/// What every spec shares, without devices: the control nodes and driver files found now under
/// the driver root as the daemon sees it (written as the host sees them), the driver directory
/// ([`driver_dir`]), the shim, and the hook entry naming `<runtime_dir>/hook.toml` (which
/// [`CdiWriter::new`] writes). The per-claim specs of the DRA driver are built over the same.
pub fn base(cfg: &Injection, runtime_dir: &Path, state_dir: &Path) -> NodeDevices {
    let driver_cfg =
        DriverConfig { root: cfg.driver_root.clone(), dev_root: cfg.dev_root.clone(), ..DriverConfig::default() };
    let found = driver::discover(&driver_cfg);
    NodeDevices {
        devices: Vec::new(),
        control_nodes: driver::control_nodes(&driver_cfg),
        driver_dir: driver_dir(cfg, state_dir, &found),
        driver: as_host_sees(found, cfg.host_driver_root()),
        shim: (!cfg.shim_path.as_os_str().is_empty()).then(|| cfg.shim_path.clone()),
        hook_binary: cfg.hook_path.clone(),
        hook_config: runtime_dir.join(paths::GENERATED_HOOK_CONFIG),
        dev_root: cfg.dev_root.clone(),
        cdi_version: Some(cfg.cdi_version.clone()),
    }
}

/// The host device nodes of the GPU or MIG device `uuid` in `offer` (as its class spec lists
/// them); `None` when `offer` has no such device.
pub fn device_nodes<'a>(offer: impl Into<Offer<'a>>, uuid: &str) -> Option<Vec<PathBuf>> {
    node_devices(offer.into())
        .into_iter()
        .find(|d| (d.class == "gpu" || d.class == "mig") && d.uuid.eq_ignore_ascii_case(uuid))
        .map(|d| d.nodes)
}

/// The hook configuration the specs' hook entry names: the daemon's own paths, driver files as
/// the host sees them, an allocation always required (the daemon hands them out).
pub fn spec_hook_config(cfg: &Injection, runtime_dir: &Path) -> HookConfig {
    HookConfig {
        cdi_spec_dirs: vec![cfg.cdi_spec_dir.clone()],
        runtime_dir: runtime_dir.to_path_buf(),
        driver_root: cfg.host_driver_root().to_path_buf(),
        dev_root: cfg.dev_root.clone(),
        require_allocation: true,
        shim_path: (!cfg.shim_path.as_os_str().is_empty()).then(|| cfg.shim_path.clone()),
        ..HookConfig::default()
    }
}

/// The driver directory for `found` (the driver's files as the daemon sees them), prepared under
/// `<state_dir>/driver`; its path is the host's too, as the state directory has the same path on
/// the host and in the daemon (the daemonset mounts it so). `None`, and so one mount per driver
/// file, when `injection.driver_dir` is off, when there are no driver files, or when it cannot be
/// prepared (warned): a container start never depends on it.
pub fn driver_dir(cfg: &Injection, state_dir: &Path, found: &DriverFiles) -> Option<PathBuf> {
    if !cfg.driver_dir || (found.libraries.is_empty() && found.binaries.is_empty()) {
        return None;
    }
    match driver_dir::prepare(found, &state_dir.join(paths::DRIVER_DIRS)) {
        Ok(p) => {
            if let Some(m) = &p.moved_aside {
                tracing::warn!(
                    damaged = %m.from.display(), moved_to = %m.to.display(), reason = %m.reason,
                    "driver directory was damaged: moved aside and built again"
                );
            }
            for leftover in &p.removed_leftovers {
                tracing::info!(path = %leftover.display(), "removed an interrupted driver directory build");
            }
            tracing::info!(
                dir = %p.dir.display(), built = p.built, hard_links = p.counts.hard_links,
                copies = p.counts.copies, symlinks = p.counts.symlinks, "driver directory ready"
            );
            Some(p.dir)
        }
        Err(e) => {
            tracing::warn!(error = %e, "no driver directory: containers get one mount per driver file");
            None
        }
    }
}

/// Driver files found under the daemon's view of the driver root, renamed to the host's view.
fn as_host_sees(found: DriverFiles, host_root: &Path) -> DriverFiles {
    if found.root == host_root {
        return found;
    }
    let rebase = |p: PathBuf| p.strip_prefix(&found.root).map(|rel| host_root.join(rel)).unwrap_or(p);
    DriverFiles {
        root: host_root.to_path_buf(),
        libraries: found.libraries.iter().cloned().map(rebase).collect(),
        binaries: found.binaries.iter().cloned().map(rebase).collect(),
    }
}

/// Every offered device with the host nodes it needs.
fn node_devices(offer: Offer<'_>) -> Vec<NodeDevice> {
    let index_of = |uuid: &str| offer.inventory.gpus.iter().find(|g| g.uuid == uuid).map(|g| g.index);
    let mut out = Vec::new();
    for res in offer.resources.resources.values() {
        for d in &res.devices {
            let aliases = match (res.kind, index_of(&d.physical_uuid)) {
                (Kind::Gpu, Some(i)) => vec![i.to_string()],
                _ => Vec::new(),
            };
            out.push(NodeDevice {
                class: res.kind.cdi_class().to_owned(),
                name: cdi::cdi_device_name(&d.id),
                aliases,
                uuid: d.physical_uuid.clone(),
                nodes: d.nodes.clone(),
            });
        }
    }
    // Every GPU with MIG off is named in the `gpu` class even when it is offered as shares:
    // a share carved on demand (the node API's Allocate) is asked for as `tessera.io/gpu=<uuid>`,
    // and the hook admits it only with an allocation holding that GPU.
    let dev_root = offer.dev_root;
    for g in offer.inventory.gpus.iter().filter(|g| !g.mig.as_ref().is_some_and(|m| m.current)) {
        let name = cdi::cdi_device_name(&g.uuid);
        if out.iter().any(|d| d.class == "gpu" && d.name == name) {
            continue;
        }
        out.push(NodeDevice {
            class: Kind::Gpu.cdi_class().to_owned(),
            name,
            aliases: vec![g.index.to_string()],
            uuid: g.uuid.clone(),
            nodes: g.minor.map(|m| dev_root.join(format!("nvidia{m}"))).into_iter().collect(),
        });
    }
    out.sort_by(|a, b| (&a.class, &a.name).cmp(&(&b.class, &b.name)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testlog::logged;

    /// A MIG instance whose capability node the host has not made yet is left out; the other
    /// devices' specs are still written (the missing node failed them all).
    #[test]
    fn a_device_whose_node_is_missing_is_left_out_not_every_spec() {
        let dev = |name: &str, node: &str| NodeDevice {
            class: "mig".into(),
            name: name.into(),
            aliases: vec![],
            uuid: name.into(),
            nodes: vec![PathBuf::from("/dev/null"), PathBuf::from(node)],
        };
        let devices = [dev("MIG-a", "/dev/null"), dev("MIG-b", "/dev/nvidia-caps/nvidia-cap-none-here")];
        let (present, missing) = split_missing(&devices);
        assert_eq!((present.len(), missing[0].name.as_str()), (1, "MIG-b"));
        let base = NodeDevices { devices: devices.to_vec(), ..NodeDevices::default() };
        assert!(cdi::build_specs(&base).is_err(), "with it, no spec at all");
        let specs = cdi::build_specs(&NodeDevices { devices: present, ..NodeDevices::default() }).unwrap();
        assert_eq!(specs.iter().map(|s| s.devices.len()).sum::<usize>(), 1);
    }

    #[test]
    fn specs_name_a_hook_config_with_the_daemons_paths_and_the_hosts_driver_root() {
        let tmp = tempfile::tempdir().unwrap();
        let seen = tmp.path().join("driver-root");
        let lib = seen.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libcuda.so.1"), "fake").unwrap();
        let run = tmp.path().join("elsewhere/run");
        std::fs::create_dir_all(&run).unwrap();
        let cfg = host_root_at_run_nvidia(tmp.path(), &seen);
        let w = CdiWriter::new(&cfg, &run, &tmp.path().join("state")).unwrap().expect("a writer");
        assert_eq!(w.base.hook_config, run.join("hook.toml"));
        assert_eq!(w.base.driver.root, Path::new("/run/nvidia/driver"));
        assert_eq!(
            w.base.driver.libraries,
            [PathBuf::from("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1")]
        );
        let hook = HookConfig::load(&run.join("hook.toml")).unwrap();
        assert_eq!(hook.runtime_dir, run);
        assert_eq!(hook.cdi_spec_dirs, [tmp.path().join("cdi")]);
        assert_eq!(hook.driver_root, Path::new("/run/nvidia/driver"));
        assert_eq!(hook.shim_path.as_deref(), Some(Path::new(paths::SHIM)));
        assert!(hook.require_allocation);
        // The specs' hook entry carries it.
        let gpu = NodeDevice {
            class: "gpu".into(),
            name: "GPU-x".into(),
            aliases: vec![],
            uuid: "GPU-x".into(),
            nodes: vec![PathBuf::from("/dev/null")],
        };
        let specs = cdi::build_specs(&NodeDevices { devices: vec![gpu], ..w.base.clone() }).unwrap();
        let hook = &specs[0].container_edits.hooks[0];
        let config = run.join("hook.toml").display().to_string();
        // ...and the driver file's link into the driver directory the daemon made.
        assert_eq!(
            hook.args,
            [
                "tessera-hook",
                "--config",
                config.as_str(),
                "createRuntime",
                "--link",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
            ]
        );
        assert_eq!(hook.path, paths::HOOK);
        assert!(w.base.driver_dir.as_ref().is_some_and(|d| d.starts_with(tmp.path().join("state/driver"))));
    }

    /// A temporary directory with a driver root as the daemon sees it (`driver-root`, made by
    /// [`fake_driver_root`]): the directory, the driver root, and where the state directory goes.
    fn with_driver_root() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let seen = tmp.path().join("driver-root");
        fake_driver_root(&seen);
        let state = tmp.path().join("state");
        (tmp, seen, state)
    }

    /// Specs in `tmp/cdi` for a daemon that sees the driver root at `seen` while the host has it
    /// at /run/nvidia/driver (as under the GPU operator).
    fn host_root_at_run_nvidia(tmp: &Path, seen: &Path) -> Injection {
        Injection {
            cdi_spec_dir: tmp.join("cdi"),
            driver_root: seen.to_path_buf(),
            host_driver_root: PathBuf::from("/run/nvidia/driver"),
            ..Injection::default()
        }
    }

    /// A driver root as the daemon sees it: a library with its soname link, and a tool.
    fn fake_driver_root(root: &Path) {
        let lib = root.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::write(lib.join("libcuda.so.550.54.15"), "cuda").unwrap();
        std::os::unix::fs::symlink("libcuda.so.550.54.15", lib.join("libcuda.so.1")).unwrap();
        std::fs::write(root.join("usr/bin/nvidia-smi"), "smi").unwrap();
    }

    fn one_gpu() -> Inventory {
        Inventory {
            library: PathBuf::new(),
            driver_version: String::new(),
            cuda_driver_version: 0,
            gpus: vec![crate::discovery::Gpu {
                index: 0,
                uuid: "GPU-0".into(),
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_total: 80 << 30,
                pci_bus_id: "00000000:18:00.0".into(),
                numa_node: None,
                minor: None,
                mig: None,
                nvlink_peers: Vec::new(),
                processes: Vec::new(),
            }],
            topology: Vec::new(),
        }
    }

    #[test]
    fn the_driver_directory_is_prepared_under_the_state_dir_from_the_daemons_view() {
        let (tmp, seen, state) = with_driver_root();
        let cfg = host_root_at_run_nvidia(tmp.path(), &seen);
        let w = CdiWriter::new(&cfg, tmp.path(), &state).unwrap().expect("a writer");
        let parent = state.join("driver");
        let keys: Vec<_> = std::fs::read_dir(&parent).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(keys.len(), 1, "{keys:?}");
        let dir = parent.join(&keys[0]);
        assert_eq!(w.base.driver_dir.as_deref(), Some(dir.as_path()));
        // The files are the daemon's (found under driver_root), laid out as the host names them.
        let lib = dir.join("usr/lib/x86_64-linux-gnu");
        assert_eq!(std::fs::read_link(lib.join("libcuda.so.1")).unwrap(), Path::new("libcuda.so.550.54.15"));
        assert_eq!(std::fs::read(lib.join("libcuda.so.1")).unwrap(), b"cuda");
        assert_eq!(std::fs::read(dir.join("usr/bin/nvidia-smi")).unwrap(), b"smi");
        assert!(w.base.driver.libraries.iter().all(|l| l.starts_with("/run/nvidia/driver")), "{:?}", w.base.driver);
        // A second start (the DRA driver's base, a restart) gets the same directory.
        assert_eq!(base(&cfg, tmp.path(), &state).driver_dir, w.base.driver_dir);
        assert_eq!(std::fs::read_dir(&parent).unwrap().count(), 1);
    }

    #[test]
    fn a_damaged_driver_directory_is_warned_with_both_paths_and_rebuilt() {
        let (tmp, seen, state) = with_driver_root();
        let cfg = Injection { driver_root: seen, ..Injection::default() };
        let dir = base(&cfg, tmp.path(), &state).driver_dir.expect("a driver directory");
        std::fs::remove_file(dir.join("usr/bin/nvidia-smi")).unwrap();
        let (again, log) = logged(|| base(&cfg, tmp.path(), &state));
        assert_eq!(again.driver_dir.as_deref(), Some(dir.as_path()), "rebuilt under the same name");
        assert_eq!(std::fs::read(dir.join("usr/bin/nvidia-smi")).unwrap(), b"smi");
        let aside: Vec<_> = std::fs::read_dir(state.join("driver"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains(".damaged-"))
            .collect();
        assert_eq!(aside.len(), 1);
        let warning = log.lines().find(|l| l.contains("WARN")).unwrap_or_else(|| panic!("no warning: {log}"));
        assert!(warning.contains(&dir.display().to_string()), "{warning}");
        assert!(warning.contains(&aside[0].display().to_string()), "{warning}");
        assert!(warning.contains("usr/bin/nvidia-smi is missing"), "{warning}");
    }

    #[test]
    fn driver_dir_off_or_no_driver_files_keeps_one_mount_per_file() {
        let (tmp, seen, state) = with_driver_root();
        let off = Injection { driver_root: seen.clone(), driver_dir: false, ..Injection::default() };
        let b = base(&off, tmp.path(), &state);
        assert_eq!(b.driver_dir, None);
        assert_eq!(b.driver.libraries.len(), 2, "the files are still named, for a mount each");
        assert!(!state.exists(), "nothing built");
        let empty = Injection { driver_root: tmp.path().join("no-driver"), ..Injection::default() };
        assert_eq!(base(&empty, tmp.path(), &state).driver_dir, None);
        assert!(!state.exists(), "nothing built without driver files");
    }

    /// A shim, hook or driver the specs would name but the daemon cannot see is said at start,
    /// naming the key (every container start failed on it, and nothing said why until then).
    #[test]
    fn what_the_specs_name_and_this_daemon_cannot_see_is_said_naming_the_key() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = Injection {
            cdi_spec_dir: tmp.path().join("cdi"),
            driver_root: tmp.path().join("no-driver"),
            shim_path: tmp.path().join("no/libtessera.so"),
            hook_path: tmp.path().join("no/tessera-hook"),
            ..Injection::default()
        };
        let (w, log) = logged(|| CdiWriter::new(&cfg, tmp.path(), &tmp.path().join("state")));
        assert!(w.unwrap().is_some());
        for key in ["injection.shim_path", "injection.hook_path", "injection.driver_root"] {
            assert!(log.contains(key), "{key}: {log}");
        }
        let seen = tmp.path().join("driver-root");
        fake_driver_root(&seen);
        std::fs::create_dir_all(tmp.path().join("bin")).unwrap();
        std::fs::write(tmp.path().join("bin/libtessera.so"), "").unwrap();
        std::fs::write(tmp.path().join("bin/tessera-hook"), "").unwrap();
        let fine = Injection {
            driver_root: seen,
            shim_path: tmp.path().join("bin/libtessera.so"),
            hook_path: tmp.path().join("bin/tessera-hook"),
            ..cfg
        };
        let (_, log) = logged(|| CdiWriter::new(&fine, tmp.path(), &tmp.path().join("state")));
        assert!(!log.contains("injection."), "{log}");
    }

    #[test]
    fn a_state_dir_that_cannot_hold_it_gives_per_file_mounts_and_specs_are_still_written() {
        let (tmp, seen, state) = with_driver_root();
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(state.join("driver"), "a file where the directory goes").unwrap();
        let cfg = Injection { cdi_spec_dir: tmp.path().join("cdi"), driver_root: seen, ..Injection::default() };
        let (w, log) = logged(|| CdiWriter::new(&cfg, tmp.path(), &state));
        let mut w = w.unwrap().expect("a writer");
        assert_eq!(w.base.driver_dir, None);
        assert!(log.contains("WARN") && log.contains(&state.join("driver").display().to_string()), "{log}");
        assert_eq!(w.base.driver.libraries.len(), 2);
        let (inventory, resources) = (one_gpu(), Resources::default());
        assert!(w.write(Offer { inventory: &inventory, resources: &resources, dev_root: &cfg.dev_root }).unwrap());
        assert!(tmp.path().join("cdi/tessera.io-gpu.json").is_file());
        assert_eq!(std::fs::read_to_string(state.join("driver")).unwrap(), "a file where the directory goes");
    }

    #[test]
    fn an_unwritable_runtime_dir_is_an_error_naming_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = Injection { cdi_spec_dir: tmp.path().join("cdi"), ..Injection::default() };
        let e = CdiWriter::new(&cfg, &tmp.path().join("missing"), tmp.path()).unwrap_err();
        assert!(e.contains("missing/hook.toml"), "{e}");
    }
}
