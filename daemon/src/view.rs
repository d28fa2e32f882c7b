//! The node's published view: the one value the controller publishes after every change
//! (layouts, devices, health with its reason) and every face reads, the device plugin and the
//! DRA driver alike. Plain data on the core floor: a face reads it without importing the
//! controller's workings, and calls the controller only to change something.

use std::collections::BTreeMap;
use std::sync::Arc;

use tessera_proto::tessera::v1 as api;

use crate::config::Config;
use crate::device_health::NodeHealth;
use crate::discovery::Inventory;
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
}
