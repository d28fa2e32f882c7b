//! What the stored records hold per physical device, summed: kept beside the store's index and
//! changed with it, so admission reads one entry per GPU instead of scanning every record
//! (1,000 records × 8 GPUs of case-insensitive UUID compares was the larger part of an
//! `Allocate`'s CPU time).
//!
//! The sums are exact (memory in `u128`, SM in `u64`: nothing saturates, so a removal takes
//! away exactly what its insert added); [`DeviceLoad::held`] saturates on the way out, which
//! gives the same figures as adding the records up one by one with saturating adds
//! (`crate::carve::held`). Devices are keyed by their physical UUID, ASCII case folded, as
//! admission compares them.

use std::collections::HashMap;

use super::record::{AllocatedDevice, Allocation};

/// The sums over every stored device part on one physical device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceLoad {
    /// The memory limits of the parts that have one.
    pub limited_memory: u128,
    /// Parts without a memory limit (each holds the device's whole memory).
    pub unlimited: u64,
    /// SM percents of the strict parts (a strict part without a percent counts 100).
    pub strict_sm: u64,
}

impl DeviceLoad {
    /// Memory and strict SM held on a device of `memory_total` bytes, saturated to `u64` / `u32`.
    pub fn held(&self, memory_total: u64) -> (u64, u32) {
        let memory = self.limited_memory.saturating_add(u128::from(self.unlimited) * u128::from(memory_total));
        (u64::try_from(memory).unwrap_or(u64::MAX), u32::try_from(self.strict_sm).unwrap_or(u32::MAX))
    }

    fn add(&mut self, d: &AllocatedDevice) {
        let (memory, sm) = d.holds();
        match memory {
            Some(m) => self.limited_memory += u128::from(m),
            None => self.unlimited += 1,
        }
        self.strict_sm += u64::from(sm);
    }

    fn sub(&mut self, d: &AllocatedDevice) {
        let (memory, sm) = d.holds();
        match memory {
            Some(m) => self.limited_memory -= u128::from(m),
            None => self.unlimited -= 1,
        }
        self.strict_sm -= u64::from(sm);
    }

    fn is_empty(&self) -> bool {
        *self == DeviceLoad::default()
    }
}

/// [`DeviceLoad`] per physical device of every record in a set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loads {
    by_device: HashMap<String, DeviceLoad>,
}

/// The key of a physical device: its UUID with ASCII letters upper-cased.
fn key(uuid: &str) -> String {
    uuid.to_ascii_uppercase()
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
        for d in &a.devices {
            self.by_device.entry(key(&d.physical_uuid)).or_default().add(d);
        }
    }

    /// Takes record `a` (as it was counted in) out again.
    pub fn remove(&mut self, a: &Allocation) {
        for d in &a.devices {
            let k = key(&d.physical_uuid);
            if let Some(load) = self.by_device.get_mut(&k) {
                load.sub(d);
                if load.is_empty() {
                    self.by_device.remove(&k);
                }
            }
        }
    }

    /// What the records hold on physical device `uuid` (any case).
    pub fn device(&self, uuid: &str) -> DeviceLoad {
        self.by_device.get(&key(uuid)).copied().unwrap_or_default()
    }

    /// What the records other than `except` (counted in, as it is stored) hold on `uuid`.
    pub fn device_except(&self, uuid: &str, except: &Allocation) -> DeviceLoad {
        let mut load = self.device(uuid);
        for d in except.devices.iter().filter(|d| d.physical_uuid.eq_ignore_ascii_case(uuid)) {
            load.sub(d);
        }
        load
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::tests::sample;
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
        let mut loads = Loads::of([&a, &b]);
        let ab = loads.device("gpu-ab");
        assert_eq!(
            ab,
            DeviceLoad { limited_memory: 10 + u128::from(u64::MAX), unlimited: 1, strict_sm: 30 + 100 + 20 }
        );
        // Saturated on the way out, as a saturating sum of the records would be.
        assert_eq!(ab.held(80), (u64::MAX, 150));
        assert_eq!(loads.device("GPU-CD"), DeviceLoad { limited_memory: 5, unlimited: 0, strict_sm: 0 });
        assert_eq!(loads.device("GPU-CD").held(80), (5, 0));
        loads.remove(&b);
        assert_eq!(loads.device("GPU-AB").held(80), (90, 130));
        loads.remove(&a);
        assert_eq!(loads, Loads::default(), "nothing is left once every record is out");
    }
}
