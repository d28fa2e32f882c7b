//! The kubelet's free devices that no longer fit beside what the node API's allocations and
//! claims hold, told to the kubelet as unhealthy until the room is back.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use tessera_region::ComputeMode;

use super::DaemonAllocator;
use super::admission::room_of;
use crate::resources::Kind;

impl DaemonAllocator {
    /// The kubelet's free devices that no longer fit beside what other allocations hold (a carved
    /// share, a whole GPU or a MIG device the node API gave out, a claim): `(resource, device id)`.
    /// Told to the kubelet as unhealthy, so the scheduler places no pod its `Allocate` would
    /// refuse; they come back when the room does. Only devices no record holds are withdrawn (a
    /// pod's own device never turns unhealthy under it), and as few as can be: each GPU's or MIG
    /// device's free devices are kept in order while they fit together beside what is held.
    pub fn withdrawn(&self) -> BTreeSet<(String, String)> {
        let offer = self.offer();
        let rooms = Arc::clone(&self.rooms.read().unwrap_or_else(std::sync::PoisonError::into_inner));
        // As `devices` makes the kubelet's records: a share in the default compute mode.
        let share_mode = self.defaults().compute_mode;
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // The same rule as the kubelet's Allocate (`admit_beside`), so what is withdrawn is what
        // it would refuse. Its own devices fit together by plan: only others' records withdraw
        // any. O(the offer), no scan of the records (a serverless node changes them often).
        let mut out = BTreeSet::new();
        // Per device: what is held, plus the free devices kept so far.
        let mut kept: HashMap<&str, (u64, u32)> = HashMap::new();
        for res in offer.resources.resources.values() {
            for d in res.devices.iter().filter(|d| d.health.is_healthy()) {
                // A pod's (the node API's MIG records name the same id: those do not count).
                if store.kubelet_holds(&d.id, &res.name) {
                    continue;
                }
                let Some((_, _, total)) = room_of(&rooms, &d.physical_uuid) else { continue };
                let (memory, sm) = kept
                    .entry(d.physical_uuid.as_str())
                    .or_insert_with(|| store.loads().device(&d.physical_uuid).held(total));
                let strict = res.kind != Kind::Share || share_mode == ComputeMode::Strict;
                let (m, p) = (d.memory_limit.unwrap_or(total), if strict { d.sm_percent.unwrap_or(100) } else { 0 });
                if memory.saturating_add(m) <= total && sm.saturating_add(p) <= 100 {
                    (*memory, *sm) = (*memory + m, *sm + p);
                } else {
                    out.insert((res.name.clone(), d.id.clone()));
                }
            }
        }
        out
    }

    /// Told of every change to a record the kubelet did not make (what [`Self::withdrawn`]
    /// follows).
    pub fn foreign_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).foreign_changes()
    }
}
