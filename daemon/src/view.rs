//! The node's published view: the one value the controller publishes after every change
//! (layouts, devices, health with its reason, what the allocation records hold) and every face
//! reads, the device plugin and the DRA driver alike. Plain data on the core floor: a face reads it without importing the
//! controller's workings, and calls the controller only to change something.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tessera_proto::tessera::v1 as api;

use tessera_region::ComputeMode;

use crate::config::Config;
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

/// The node as the controller last published it (`NodeController::watch_offer`), and a
/// consistent copy of its live picture (`NodeController::view`).
#[derive(Debug, Clone)]
pub struct View {
    /// In effect: the file's configuration with the node API's layout changes on top.
    pub config: Arc<Config>,
    pub inventory: Inventory,
    pub shares: Vec<Share>,
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
            && self.shares == before.shares
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
