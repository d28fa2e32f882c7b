//! The resources the daemon advertises to the kubelet, built from the inventory (taken after the
//! layouts were applied), the resolved layouts and the planned shares:
//!
//! - `<prefix>/gpu`: whole GPUs (device id: the GPU UUID);
//! - `<prefix>/mig-<profile>`: MIG devices (id: the MIG UUID), e.g. `tessera.io/mig-3g.40gb`;
//! - `<prefix>/gpu-share`: time-sliced shares of whole GPUs (id: `<GPU uuid>::<n>`);
//! - `<prefix>/mig-<profile>-share`: shares of MIG devices (`mig_shares`; id `<MIG uuid>::<n>`).
//!
//! A GPU no partition names is advertised as it is: whole with MIG off, its MIG devices with MIG
//! on. A GPU whose MIG mode change is pending a reset advertises what it is now only when that
//! matches its layout (whole-GPU layouts on a GPU still in MIG mode advertise nothing).

use std::collections::BTreeMap;

use crate::config::{Config, PartitionKind};
use crate::device_health::{Health, NodeHealth};
use crate::discovery::{Ancestor, Inventory};
use crate::partition::{GpuLayout, Share};

/// The CDI vendor of every device name (`tessera.io/<class>=<id>`).
pub const CDI_VENDOR: &str = "tessera.io";

/// What kind of device a resource hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A whole GPU.
    Gpu,
    /// A MIG device.
    Mig,
    /// A time-sliced share of a GPU or MIG device.
    Share,
}

impl Kind {
    /// The CDI class: `gpu`, `mig`, `share`.
    pub fn cdi_class(self) -> &'static str {
        match self {
            Kind::Gpu => "gpu",
            Kind::Mig => "mig",
            Kind::Share => "share",
        }
    }
}

/// One device of a resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceDevice {
    /// The id the kubelet allocates by.
    pub id: String,
    /// The GPU or MIG device the container sees (for a share: its parent).
    pub physical_uuid: String,
    /// The index of the GPU it lives on (for topology).
    pub gpu_index: u32,
    pub numa_node: Option<u32>,
    /// In service, or out with the health monitor's reason ([`Resources::mark_unhealthy`]).
    pub health: Health,
    /// Shares only: bytes of device memory.
    pub memory_limit: Option<u64>,
    /// Shares only: percent of SM time.
    pub sm_percent: Option<u32>,
    /// The host device nodes a container needs for it: `/dev/nvidia<minor>`, and for a MIG
    /// device its `nvidia-caps` access nodes (empty where NVML gives no minor number).
    pub nodes: Vec<std::path::PathBuf>,
}

/// One advertised resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    /// `<prefix>/gpu`, ….
    pub name: String,
    pub kind: Kind,
    pub devices: Vec<ResourceDevice>,
}

impl Resource {
    pub fn device(&self, id: &str) -> Option<&ResourceDevice> {
        self.devices.iter().find(|d| d.id == id)
    }
}

/// Every advertised resource (by name) and the GPU topology the preferences need.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    pub resources: BTreeMap<String, Resource>,
    /// GPU index → (NUMA node, NVLink peers).
    gpus: BTreeMap<u32, (Option<u32>, Vec<u32>)>,
    /// (a, b) with a < b → where their PCIe paths meet.
    pcie: BTreeMap<(u32, u32), Ancestor>,
}

impl Resources {
    /// Builds the resources; `shares` are what [`crate::partition::plan_all_shares`] planned on
    /// `inv`.
    pub fn build(config: &Config, inv: &Inventory, layouts: &[GpuLayout<'_>], shares: &[Share]) -> Resources {
        let prefix = config.resources.prefix.as_str();
        let dev_root = &config.injection.dev_root;
        let mig_minors = tessera_region::driver::MigMinors::read(&config.injection.driver_root);
        let mut out = Resources::default();
        for gpu in &inv.gpus {
            let parent_node = gpu.minor.map(|m| dev_root.join(format!("nvidia{m}")));
            let nodes_of = |physical: &str| -> Vec<std::path::PathBuf> {
                let Some(parent) = &parent_node else { return Vec::new() };
                let mut nodes = vec![parent.clone()];
                let mig = gpu.mig.iter().flat_map(|m| &m.instances).flat_map(|gi| &gi.devices);
                if let (Some(d), Some(minor)) = (mig.into_iter().find(|d| d.uuid == physical), gpu.minor) {
                    nodes.extend(mig_minors.nodes(dev_root, minor, d.gi_id, d.ci_id));
                }
                nodes
            };
            out.gpus.insert(gpu.index, (gpu.numa_node, gpu.nvlink_peers.clone()));
            let layout = layouts.iter().find(|l| l.index == gpu.index).map(|l| l.kind);
            let mig_on = gpu.mig.as_ref().is_some_and(|m| m.current);
            let device = |id: &str, physical: &str, share: Option<&Share>| ResourceDevice {
                id: id.to_string(),
                physical_uuid: physical.to_string(),
                gpu_index: gpu.index,
                numa_node: gpu.numa_node,
                health: Health::Healthy,
                memory_limit: share.map(|s| s.memory_limit),
                sm_percent: share.map(|s| s.sm_percent),
                nodes: nodes_of(physical),
            };
            match (layout, mig_on) {
                (Some(PartitionKind::Shares(_)), false) => {
                    for s in shares.iter().filter(|s| s.parent_uuid == gpu.uuid) {
                        out.add(format!("{prefix}/gpu-share"), Kind::Share, device(&s.id, &s.parent_uuid, Some(s)));
                    }
                }
                (Some(PartitionKind::Mig { .. }) | None, true) => {
                    for gi in gpu.mig.iter().flat_map(|m| &m.instances) {
                        for d in &gi.devices {
                            let mut split = shares.iter().filter(|s| s.parent_uuid == d.uuid).peekable();
                            if split.peek().is_none() {
                                out.add(
                                    format!("{prefix}/mig-{}", gi.profile),
                                    Kind::Mig,
                                    device(&d.uuid, &d.uuid, None),
                                );
                            }
                            for s in split {
                                out.add(
                                    format!("{prefix}/mig-{}-share", gi.profile),
                                    Kind::Share,
                                    device(&s.id, &d.uuid, Some(s)),
                                );
                            }
                        }
                    }
                }
                (Some(PartitionKind::Whole) | None, false) => {
                    out.add(format!("{prefix}/gpu"), Kind::Gpu, device(&gpu.uuid, &gpu.uuid, None));
                }
                (Some(kind), _) => {
                    tracing::warn!(
                        gpu = gpu.index,
                        layout = kind.name(),
                        mig_on,
                        "the GPU is not in its layout's MIG mode yet (a reset is pending): nothing advertised"
                    );
                }
            }
        }
        for t in &inv.topology {
            out.pcie.insert((t.a.min(t.b), t.a.max(t.b)), t.ancestor);
        }
        out
    }

    fn add(&mut self, name: String, kind: Kind, device: ResourceDevice) {
        self.resources
            .entry(name.clone())
            .or_insert_with(|| Resource { name, kind, devices: Vec::new() })
            .devices
            .push(device);
    }

    pub fn get(&self, name: &str) -> Option<&Resource> {
        self.resources.get(name)
    }

    /// Every offered device of GPU `index`, with its resource.
    pub fn devices_of_gpu(&self, index: u32) -> impl Iterator<Item = (&Resource, &ResourceDevice)> {
        self.resources
            .values()
            .flat_map(move |r| r.devices.iter().filter(move |d| d.gpu_index == index).map(move |d| (r, d)))
    }

    /// A device by id, with its resource.
    pub fn device(&self, id: &str) -> Option<(&Resource, &ResourceDevice)> {
        self.resources.values().find_map(|r| r.device(id).map(|d| (r, d)))
    }

    /// Marks every device as `health` says of it (its GPU's, or the device it is carved from).
    pub fn mark_unhealthy(&mut self, health: &NodeHealth) {
        for r in self.resources.values_mut() {
            for d in &mut r.devices {
                d.health = health.of(d.gpu_index, &d.physical_uuid);
            }
        }
    }

    /// How far apart two GPUs are, nearest first: (not on one NVLink, not on one NUMA node,
    /// where their PCIe paths meet). The same GPU is `(0, 0, 0)`.
    pub fn distance(&self, a: u32, b: u32) -> (u8, u8, u8) {
        if a == b {
            return (0, 0, 0);
        }
        let (numa_a, peers_a) = self.gpus.get(&a).map_or((None, &[][..]), |(n, p)| (*n, p.as_slice()));
        let numa_b = self.gpus.get(&b).and_then(|(n, _)| *n);
        let nvlink = u8::from(!peers_a.contains(&b));
        let numa = u8::from(numa_a.is_none() || numa_a != numa_b);
        let pcie = self.pcie.get(&(a.min(b), a.max(b))).map_or(u8::MAX, |&anc| anc as u8 + 1);
        (nvlink, numa, pcie)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res_with_gpus() -> Resources {
        let mut r = Resources::default();
        r.gpus.insert(0, (Some(0), vec![1]));
        r.gpus.insert(1, (Some(0), vec![0]));
        r.gpus.insert(2, (Some(1), vec![]));
        r.pcie.insert((0, 2), Ancestor::System);
        r
    }

    #[test]
    fn distance_orders_nvlink_then_numa_then_pcie() {
        let r = res_with_gpus();
        assert_eq!(r.distance(1, 1), (0, 0, 0));
        assert!(r.distance(0, 1) < r.distance(0, 2));
        assert_eq!(r.distance(0, 2), (1, 1, Ancestor::System as u8 + 1));
    }
}
