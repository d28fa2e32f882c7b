//! The CDI specs the daemon writes for container runtimes (containerd 1.7+, CRI-O, podman) and
//! for `tessera-hook` / `tessera-runtime`: one device per offered GPU, MIG device and share,
//! named as the kubelet allocates them (`tessera.io/share=GPU-…::3`), rewritten atomically
//! whenever what is offered changes. The spec format and the container edits are
//! `tessera_hook::cdi`'s; this module only says which devices exist and which host nodes each
//! needs: `/dev/nvidia<minor>` from NVML's minor number, and for a MIG device its parent's node
//! plus its `nvidia-caps` access nodes from the driver's `mig-minors` table.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tessera_hook::cdi::{self, NodeDevice, NodeDevices};
use tessera_hook::driver::{self, DriverConfig};

use crate::config::Injection;
use crate::node::View;
use crate::resources::Kind;

/// Where the driver lists the MIG capability minors, under the driver root.
const MIG_MINORS: &str = "proc/driver/nvidia-caps/mig-minors";

/// Writes the specs; remembers what it wrote last so an unchanged node costs nothing.
#[derive(Debug)]
pub struct CdiWriter {
    dir: PathBuf,
    base: NodeDevices,
    mig_minors: PathBuf,
    last: Option<Vec<NodeDevice>>,
}

impl CdiWriter {
    /// `None` when no spec directory is configured. Driver files are found once, now.
    pub fn new(cfg: &Injection) -> Option<CdiWriter> {
        if cfg.cdi_spec_dir.as_os_str().is_empty() {
            return None;
        }
        let driver_cfg =
            DriverConfig { root: cfg.driver_root.clone(), dev_root: cfg.dev_root.clone(), ..DriverConfig::default() };
        let base = NodeDevices {
            devices: Vec::new(),
            control_nodes: driver::control_nodes(&driver_cfg),
            driver: driver::discover(&driver_cfg),
            shim: (!cfg.shim_path.as_os_str().is_empty()).then(|| cfg.shim_path.clone()),
            hook_binary: cfg.hook_path.clone(),
            hook_config: None,
            dev_root: cfg.dev_root.clone(),
            cdi_version: Some(cfg.cdi_version.clone()),
        };
        Some(CdiWriter {
            dir: cfg.cdi_spec_dir.clone(),
            base,
            mig_minors: cfg.driver_root.join(MIG_MINORS),
            last: None,
        })
    }

    /// Writes the specs for what `view` offers, unless that is what was written last. Returns
    /// whether anything was written.
    pub fn write(&mut self, view: &View) -> Result<bool, String> {
        let minors = std::fs::read_to_string(&self.mig_minors).map(|t| parse_mig_minors(&t)).unwrap_or_default();
        let devices = node_devices(view, &self.base.dev_root, &minors);
        if self.last.as_ref() == Some(&devices) {
            return Ok(false);
        }
        let node = NodeDevices { devices: devices.clone(), ..self.base.clone() };
        let specs = cdi::build_specs(&node).map_err(|e| format!("CDI specs: {e}"))?;
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        cdi::write_specs(&self.dir, &specs).map_err(|e| format!("writing CDI specs: {e}"))?;
        tracing::info!(dir = %self.dir.display(), devices = devices.len(), "CDI specs written");
        self.last = Some(devices);
        Ok(true)
    }
}

/// (GPU minor, GI id, CI id or `None` for the GI's own entry) → capability minor.
type MigMinors = BTreeMap<(u32, u32, Option<u32>), u32>;

/// The driver's `mig-minors` table: lines such as `gpu0/gi1/access 12` and
/// `gpu0/gi1/ci0/access 13` (others, like `config 1`, are not per instance).
fn parse_mig_minors(text: &str) -> MigMinors {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some((path, minor)) = line.split_once(' ') else { continue };
        let Ok(minor) = minor.trim().parse() else { continue };
        let parts: Vec<&str> = path.split('/').collect();
        let num = |p: &str, prefix: &str| p.strip_prefix(prefix).and_then(|n| n.parse::<u32>().ok());
        match parts.as_slice() {
            [gpu, gi, "access"] => {
                if let (Some(g), Some(i)) = (num(gpu, "gpu"), num(gi, "gi")) {
                    out.insert((g, i, None), minor);
                }
            }
            [gpu, gi, ci, "access"] => {
                if let (Some(g), Some(i), Some(c)) = (num(gpu, "gpu"), num(gi, "gi"), num(ci, "ci")) {
                    out.insert((g, i, Some(c)), minor);
                }
            }
            _ => {}
        }
    }
    out
}

/// Every offered device with the host nodes it needs.
fn node_devices(view: &View, dev_root: &Path, minors: &MigMinors) -> Vec<NodeDevice> {
    let mut gpu_nodes: BTreeMap<&str, Vec<PathBuf>> = BTreeMap::new();
    for gpu in &view.inventory.gpus {
        let Some(minor) = gpu.minor else { continue };
        let parent = dev_root.join(format!("nvidia{minor}"));
        gpu_nodes.insert(&gpu.uuid, vec![parent.clone()]);
        for gi in gpu.mig.iter().flat_map(|m| &m.instances) {
            for d in &gi.devices {
                let mut nodes = vec![parent.clone()];
                for key in [(minor, d.gi_id, None), (minor, d.gi_id, Some(d.ci_id))] {
                    if let Some(cap) = minors.get(&key) {
                        nodes.push(dev_root.join(format!("nvidia-caps/nvidia-cap{cap}")));
                    }
                }
                gpu_nodes.insert(&d.uuid, nodes);
            }
        }
    }
    let index_of = |uuid: &str| view.inventory.gpus.iter().find(|g| g.uuid == uuid).map(|g| g.index);
    let mut out = Vec::new();
    for res in view.resources.resources.values() {
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
                nodes: gpu_nodes.get(d.physical_uuid.as_str()).cloned().unwrap_or_default(),
            });
        }
    }
    out.sort_by(|a, b| (&a.class, &a.name).cmp(&(&b.class, &b.name)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_minors_table() {
        let t = parse_mig_minors(
            "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu1/gi2/access 30\nbad line\n",
        );
        assert_eq!(t.get(&(0, 1, None)), Some(&12));
        assert_eq!(t.get(&(0, 1, Some(0))), Some(&13));
        assert_eq!(t.get(&(1, 2, None)), Some(&30));
        assert_eq!(t.len(), 3);
    }
}
