//! What the monitor tells: each fault, recovery and change of health as an event on the bus (or
//! through the monitor's publisher thread), naming the device and the allocations that hold it.

use std::collections::BTreeSet;

use tessera_proto::tessera::v1 as api;

use super::{Monitor, Target, health_name};
use crate::node;

impl Monitor {
    /// The allocations holding `target` (for a GPU: the GPU, its shares, its MIG devices).
    pub(super) fn holders(&self, target: &Target) -> Vec<api::Holder> {
        let mut uuids = BTreeSet::new();
        match target {
            Target::Gpu(i) => {
                let view = self.controller.view();
                if let Some(g) = view.inventory.gpu(*i) {
                    uuids.insert(g.uuid.clone());
                    uuids.extend(
                        g.mig
                            .iter()
                            .flat_map(|m| &m.instances)
                            .flat_map(|gi| gi.devices.iter().map(|d| d.uuid.clone())),
                    );
                }
                if let Some(w) = self.gpus.get(i) {
                    uuids.insert(w.uuid.clone());
                }
            }
            Target::Mig { uuid, .. } => {
                uuids.insert(uuid.clone());
            }
        }
        self.controller
            .allocations()
            .iter()
            .filter(|a| a.devices.iter().any(|d| uuids.contains(&d.physical_uuid)))
            .map(node::holder)
            .collect()
    }

    pub(super) fn name(&self, target: &Target) -> String {
        match target {
            Target::Gpu(i) => format!("GPU {i} ({})", self.gpus.get(i).map_or("?", |w| w.uuid.as_str())),
            Target::Mig { gpu, uuid } => format!("MIG device {uuid} of GPU {gpu}"),
        }
    }

    pub(super) fn health_changed(&self, target: &Target, previous: api::Health, current: api::Health, reason: String) {
        let severity = match current {
            api::Health::Healthy => api::Severity::Info,
            api::Health::Recovering => api::Severity::Info,
            _ => api::Severity::Critical,
        };
        let message =
            format!("{}: {} -> {} ({reason})", self.name(target), health_name(previous), health_name(current));
        let affected = self.holders(target);
        let detail = api::HealthChange { previous: previous as i32, current: current as i32, reason };
        self.publish(
            api::EventKind::HealthChanged,
            severity,
            target,
            affected,
            message,
            api::event::Detail::HealthChange(detail),
        );
    }

    pub(super) fn publish(
        &self,
        kind: api::EventKind,
        severity: api::Severity,
        target: &Target,
        affected: Vec<api::Holder>,
        message: String,
        detail: api::event::Detail,
    ) {
        let (id, kind_of) = match target {
            Target::Gpu(i) => (self.gpus.get(i).map(|w| w.uuid.clone()).unwrap_or_default(), api::DeviceKind::Gpu),
            Target::Mig { uuid, .. } => (uuid.clone(), api::DeviceKind::Mig),
        };
        let event = api::Event {
            kind: kind as i32,
            severity: severity as i32,
            // Stamped when seen, not when the event thread gets to it.
            time_unix_nano: crate::state::record::unix_ns(),
            device_id: id.clone(),
            device_uuid: id,
            device_kind: kind_of as i32,
            affected,
            message,
            detail: Some(detail),
            ..Default::default()
        };
        match &self.publisher {
            Some(tx) => {
                if let Err(e) = tx.send(event) {
                    self.controller.events().publish(e.0);
                }
            }
            None => {
                self.controller.events().publish(event);
            }
        }
    }
}
