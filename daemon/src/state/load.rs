//! What the stored records hold per physical device, summed: kept beside the store's index and
//! changed with it, so admission reads one entry per GPU instead of scanning every record
//! (1,000 records × 8 GPUs of case-insensitive UUID compares was the larger part of an
//! `Allocate`'s CPU time).
//!
//! The sums are exact (memory in `u128`, SM in `u64`: nothing saturates, so a removal takes
//! away exactly what its insert added); [`DeviceLoad::held`] saturates on the way out, which
//! gives the same figures as adding the records up one by one with saturating adds
//! (`crate::carve::held`). Devices are keyed by their physical UUID, ASCII case folded, as
//! admission compares them. The sums are kept per kind of holder (the kubelet's, the node API's,
//! the claims', others'): admission reads their total, the published holdings each part.

use std::collections::{BTreeMap, HashMap};

use super::record::Allocation;
use crate::holdings::{DeviceHoldings, device_key as key};

/// The sums on one device (the core's type: published with the view too).
pub use crate::holdings::DeviceLoad;

/// What every record in a set holds per physical device, per kind of holder
/// ([`crate::holdings::Holder`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loads {
    by_device: HashMap<String, DeviceHoldings>,
}

impl Loads {
    /// The loads of `records`.
    pub fn of<'a>(records: impl IntoIterator<Item = &'a Allocation>) -> Loads {
        let mut loads = Loads::default();
        for a in records {
            loads.add(a);
        }
        loads
    }

    /// Counts record `a` in.
    pub fn add(&mut self, a: &Allocation) {
        let holder = a.holder();
        for d in &a.devices {
            self.by_device.entry(key(&d.physical_uuid)).or_default().of_mut(holder).add(d.holds());
        }
    }

    /// Takes record `a` (as it was counted in) out again.
    pub fn remove(&mut self, a: &Allocation) {
        let holder = a.holder();
        for d in &a.devices {
            let k = key(&d.physical_uuid);
            if let Some(load) = self.by_device.get_mut(&k) {
                load.of_mut(holder).sub(d.holds());
                if load.is_empty() {
                    self.by_device.remove(&k);
                }
            }
        }
    }

    /// What the records hold on physical device `uuid` (any case), every holder together.
    pub fn device(&self, uuid: &str) -> DeviceLoad {
        self.by_device.get(&key(uuid)).map(DeviceHoldings::total).unwrap_or_default()
    }

    /// What the records other than `except` (counted in, as it is stored) hold on `uuid`.
    pub fn device_except(&self, uuid: &str, except: &Allocation) -> DeviceLoad {
        let mut load = self.device(uuid);
        for d in except.devices.iter().filter(|d| d.physical_uuid.eq_ignore_ascii_case(uuid)) {
            load.sub(d.holds());
        }
        load
    }

    /// Per device, what each kind of holder holds (a copy, for the published holdings).
    pub fn per_holder(&self) -> BTreeMap<String, DeviceHoldings> {
        self.by_device.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::holdings::Holder;
    use crate::state::record::tests::sample;
    use crate::state::{AllocatedDevice, Source};
    use tessera_region::ComputeMode;

    fn part(uuid: &str, memory: Option<u64>, sm: Option<u32>, mode: ComputeMode) -> AllocatedDevice {
        AllocatedDevice {
            device_id: format!("{uuid}::1"),
            physical_uuid: uuid.to_string(),
            memory_limit: memory,
            sm_percent: sm,
            priority: Default::default(),
            compute_mode: mode,
            whole: false,
            preemptible: false,
        }
    }

    #[test]
    fn sums_per_device_in_any_case_and_removal_undoes_exactly() {
        let mut a = sample("a");
        a.devices = vec![
            part("GPU-ab", Some(10), Some(30), ComputeMode::Strict),
            part("gpu-AB", None, None, ComputeMode::Strict),
            part("GPU-cd", Some(5), Some(70), ComputeMode::WorkConserving),
        ];
        let mut b = sample("b");
        b.devices = vec![part("GPU-AB", Some(u64::MAX), Some(20), ComputeMode::Strict)];
        b.source = Source::NodeApi;
        let mut loads = Loads::of([&a, &b]);
        // Each holder's part apart: the kubelet's `a`, the node API's `b`.
        let ab_parts = loads.per_holder()["GPU-AB"];
        assert_eq!((ab_parts.kubelet.parts, ab_parts.node_api.parts, ab_parts.claims.parts), (2, 1, 0));
        assert_eq!(ab_parts.node_api.held(80), (u64::MAX, 20));
        assert_eq!(a.holder(), Holder::Kubelet);
        let ab = loads.device("gpu-ab");
        assert_eq!(
            ab,
            DeviceLoad { parts: 3, limited_memory: 10 + u128::from(u64::MAX), unlimited: 1, strict_sm: 30 + 100 + 20 }
        );
        // Saturated on the way out, as a saturating sum of the records would be.
        assert_eq!(ab.held(80), (u64::MAX, 150));
        assert_eq!(loads.device("GPU-CD"), DeviceLoad { parts: 1, limited_memory: 5, unlimited: 0, strict_sm: 0 });
        assert_eq!(loads.device("GPU-CD").held(80), (5, 0));
        loads.remove(&b);
        assert_eq!(loads.device("GPU-AB").held(80), (90, 130));
        loads.remove(&a);
        assert_eq!(loads, Loads::default(), "nothing is left once every record is out");
    }
}
