//! The node's published view: the one value the controller publishes after every change
//! (layouts, devices, health with its reason, what the allocation records hold) and every face
//! reads, the device plugin and the DRA driver alike. Plain data on the core floor: a face reads it without importing the
//! controller's workings, and calls the controller only to change something.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tessera_proto::tessera::v1 as api;

use tessera_region::ComputeMode;

use crate::config::Config;
use crate::config::kubernetes::Mode;
use crate::device_health::NodeHealth;
use crate::discovery::Inventory;
use crate::holdings::Holdings;
use crate::partition::Share;
use crate::resources::Resources;

/// One GPU's layout status.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuStatus {
    pub state: api::PartitionState,
    /// Why the desired layout is not (yet) in place.
    pub issues: Vec<api::LayoutIssue>,
}

/// Which face offers a GPU's devices to Kubernetes ([`View::face_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Face {
    /// The kubelet's device plugins (`kubelet::served`).
    DevicePlugin,
    /// The DRA driver's ResourceSlices (`dra::driver`).
    Dra,
}

/// The node as the controller last published it (`NodeController::watch_offer`), and a
/// consistent copy of its live picture (`NodeController::view`).
#[derive(Debug, Clone)]
pub struct View {
    /// In effect: the file's configuration with the node API's layout changes on top.
    pub config: Arc<Config>,
    pub inventory: Inventory,
    /// The planned shares (shared: a publish of the holdings alone copies none).
    pub shares: Arc<Vec<Share>>,
    pub resources: Arc<Resources>,
    /// Managed GPUs only (by index).
    pub status: BTreeMap<u32, GpuStatus>,
    /// What is out of service, with the reasons (the health monitor's findings).
    pub health: NodeHealth,
    /// What the allocation records hold of each device, as of this publish: the controller
    /// publishes again whenever that changes (`NodeController::follow_records`).
    pub holdings: Arc<Holdings>,
}

impl View {
    /// Whether a `[partitions]` entry manages GPU `index` (the controller keeps its layout status).
    pub fn partitioned(&self, index: u32) -> bool {
        self.status.contains_key(&index)
    }

    /// The face that offers GPU `index`'s devices in `mode` (`kubernetes.mode`): every GPU the
    /// device plugin's in `device-plugin`, DRA's in `dra`; in `both` a GPU a `[partitions]` entry
    /// manages stays with the device plugin and the others go to DRA, so that no GPU is offered
    /// twice. The one rule both faces read.
    pub fn face_of(&self, mode: Mode, index: u32) -> Face {
        match mode {
            Mode::DevicePlugin => Face::DevicePlugin,
            Mode::Dra => Face::Dra,
            Mode::Both if self.partitioned(index) => Face::DevicePlugin,
            Mode::Both => Face::Dra,
        }
    }

    /// The memory of GPU or MIG device `uuid` (any case; a MIG device only while its GPU's MIG
    /// mode is on), as Allocate's rooms know it; `None` for a device the node does not have.
    pub fn device_memory(&self, uuid: &str) -> Option<u64> {
        self.inventory.gpus.iter().find_map(|g| {
            if g.uuid.eq_ignore_ascii_case(uuid) {
                return Some(g.memory_total);
            }
            let mut mig = g.mig.iter().filter(|m| m.current).flat_map(|m| &m.instances).flat_map(|gi| &gi.devices);
            mig.find(|d| d.uuid.eq_ignore_ascii_case(uuid)).map(|d| d.memory_total)
        })
    }

    /// Whether `self` differs from `before` in what the records hold alone (the controller
    /// publishes those on every allocation): the node, its offer and its health as they were.
    pub fn only_holdings_differ(&self, before: &View) -> bool {
        Arc::ptr_eq(&self.config, &before.config)
            && Arc::ptr_eq(&self.resources, &before.resources)
            && self.inventory == before.inventory
            && Arc::ptr_eq(&self.shares, &before.shares)
            && self.status == before.status
            && self.health == before.health
    }

    /// The kubelet's free devices that no longer fit beside what the records hold, told to it as
    /// unhealthy: [`Holdings::withdrawn_from_kubelet`] of everything offered, the kubelet's
    /// shares in the configured compute mode (`limits.compute_mode`).
    pub fn withdrawn_from_kubelet(&self) -> BTreeSet<(String, String)> {
        let share_mode = ComputeMode::from_name(&self.config.limits.compute_mode).unwrap_or_default();
        self.holdings.withdrawn_from_kubelet(&self.resources, |uuid| self.device_memory(uuid), share_mode)
    }
}

#[cfg(test)]
impl View {
    /// A view of nothing but `resources`, with a `[partitions]` entry on the GPUs `partitioned`
    /// names (their layout status kept), for the faces' tests.
    pub(crate) fn for_test(resources: crate::resources::Resources, partitioned: &[u32]) -> View {
        let status = GpuStatus { state: api::PartitionState::Converged, issues: Vec::new() };
        View {
            config: Arc::new(Config::default()),
            inventory: Inventory {
                library: Default::default(),
                driver_version: String::new(),
                cuda_driver_version: 0,
                gpus: Vec::new(),
                topology: Vec::new(),
            },
            shares: Arc::default(),
            resources: Arc::new(resources),
            status: partitioned.iter().map(|&i| (i, status.clone())).collect(),
            health: NodeHealth::default(),
            holdings: Arc::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_gpu_has_one_face_per_mode() {
        let view = View::for_test(Resources::default(), &[1]);
        for gpu in [0, 1] {
            assert_eq!(view.face_of(Mode::DevicePlugin, gpu), Face::DevicePlugin);
            assert_eq!(view.face_of(Mode::Dra, gpu), Face::Dra);
        }
        assert_eq!(view.face_of(Mode::Both, 1), Face::DevicePlugin, "partitioned: the device plugin's");
        assert_eq!(view.face_of(Mode::Both, 0), Face::Dra, "no [partitions] entry: DRA's");
    }
}
