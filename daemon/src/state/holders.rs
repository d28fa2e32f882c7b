//! Which records hold each device id, kept beside the store's index and changed with it: a
//! kubelet `Allocate` asks which records hold the devices it names, and scanning every record
//! for that (1,000 records, each a string compare or more) was the largest part of the handler's
//! own CPU time.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::record::{Allocation, Source};

/// Record ids by the device ids (`AllocatedDevice::device_id`, exact) they hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holders {
    by_device: HashMap<String, BTreeSet<String>>,
    /// How many of the kubelet's records hold each (device id, resource).
    kubelet: HashMap<(String, String), usize>,
    /// Its keys, by resource, kept as they change: whether the kubelet holds a device is one
    /// lookup without a copy, however many node API shares are carved on its GPU, and the
    /// published holdings take a clone (no sort per publish; 1,000 held ids: 132 µs built, a
    /// fraction of that cloned: shared ids, no string copied).
    kubelet_ids: BTreeMap<String, BTreeSet<Arc<str>>>,
}

impl Holders {
    /// The holders in `records`.
    pub fn of<'a>(records: impl IntoIterator<Item = &'a Allocation>) -> Holders {
        let mut h = Holders::default();
        for a in records {
            h.add(a);
        }
        h
    }

    /// Counts record `a` in.
    pub fn add(&mut self, a: &Allocation) {
        for d in &a.devices {
            self.by_device.entry(d.device_id.clone()).or_default().insert(a.id.clone());
            if a.source == Source::Kubelet {
                let n = self.kubelet.entry((d.device_id.clone(), a.resource.clone())).or_default();
                *n += 1;
                if *n == 1 {
                    match self.kubelet_ids.get_mut(&a.resource) {
                        Some(ids) => {
                            ids.insert(Arc::from(d.device_id.as_str()));
                        }
                        None => {
                            self.kubelet_ids
                                .insert(a.resource.clone(), BTreeSet::from([Arc::from(d.device_id.as_str())]));
                        }
                    }
                }
            }
        }
    }

    /// Takes record `a` (as it was counted in) out again.
    pub fn remove(&mut self, a: &Allocation) {
        for d in &a.devices {
            if let Some(ids) = self.by_device.get_mut(&d.device_id) {
                ids.remove(&a.id);
                if ids.is_empty() {
                    self.by_device.remove(&d.device_id);
                }
            }
            if a.source == Source::Kubelet {
                let key = (d.device_id.clone(), a.resource.clone());
                if let Some(n) = self.kubelet.get_mut(&key) {
                    *n -= 1;
                    if *n == 0 {
                        self.kubelet.remove(&key);
                        if let Some(ids) = self.kubelet_ids.get_mut(&a.resource) {
                            ids.remove(d.device_id.as_str());
                            if ids.is_empty() {
                                self.kubelet_ids.remove(&a.resource);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Whether a kubelet record of `resource` holds device `device_id`.
    pub fn kubelet_holds(&self, device_id: &str, resource: &str) -> bool {
        self.kubelet_ids.get(resource).is_some_and(|ids| ids.contains(device_id))
    }

    /// Every device id a kubelet record holds, by resource (a copy).
    pub fn kubelet_devices(&self) -> BTreeMap<String, BTreeSet<Arc<str>>> {
        self.kubelet_ids.clone()
    }

    /// The ids of the records holding any of `device_ids`, each once, in id order.
    pub fn holding<'a>(&'a self, device_ids: impl IntoIterator<Item = &'a str>) -> BTreeSet<&'a str> {
        device_ids
            .into_iter()
            .filter_map(|d| self.by_device.get(d))
            .flat_map(|ids| ids.iter().map(String::as_str))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::tests::sample;

    fn holding(a: &str, devices: &[&str]) -> Allocation {
        let mut r = sample(a);
        let part = r.devices[0].clone();
        r.devices = devices
            .iter()
            .map(|d| crate::state::AllocatedDevice { device_id: d.to_string(), ..part.clone() })
            .collect();
        r
    }

    /// The index answers what a scan of every record answers, through random inserts, updates
    /// and removals (a record holding a device twice, records sharing devices).
    #[test]
    fn holders_equal_a_scan_of_every_record() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let devices: Vec<String> = (0..12).map(|i| format!("GPU-{}::{}", i / 4, i % 4)).collect();
        let mut records: std::collections::BTreeMap<String, Allocation> = Default::default();
        let mut h = Holders::default();
        for step in 0..2000 {
            let id = format!("a{}", next(40));
            let picked: Vec<&str> = (0..1 + next(3)).map(|_| devices[next(12) as usize].as_str()).collect();
            match next(3) {
                0 | 1 => {
                    let mut r = holding(&id, &picked);
                    r.source = if next(2) == 0 { Source::Kubelet } else { Source::NodeApi };
                    r.resource = ["tessera.io/gpu", "tessera.io/gpu-share"][next(2) as usize].to_owned();
                    if let Some(old) = records.insert(id.clone(), r.clone()) {
                        h.remove(&old);
                    }
                    h.add(&r);
                }
                _ => {
                    if let Some(old) = records.remove(&id) {
                        h.remove(&old);
                    }
                }
            }
            let ask: Vec<&str> = (0..1 + next(3)).map(|_| devices[next(12) as usize].as_str()).collect();
            let scanned: BTreeSet<&str> = records
                .values()
                .filter(|r| r.devices.iter().any(|d| ask.contains(&d.device_id.as_str())))
                .map(|r| r.id.as_str())
                .collect();
            assert_eq!(h.holding(ask.iter().copied()), scanned, "step {step}");
            for d in &devices {
                for res in ["tessera.io/gpu", "tessera.io/gpu-share"] {
                    let scanned = records.values().any(|r| {
                        r.source == Source::Kubelet && r.resource == res && r.devices.iter().any(|x| x.device_id == *d)
                    });
                    assert_eq!(h.kubelet_holds(d, res), scanned, "step {step}: {d} {res}");
                }
            }
            let mut scanned: BTreeMap<String, BTreeSet<Arc<str>>> = BTreeMap::new();
            for r in records.values().filter(|r| r.source == Source::Kubelet) {
                for d in &r.devices {
                    scanned.entry(r.resource.clone()).or_default().insert(Arc::from(d.device_id.as_str()));
                }
            }
            assert_eq!(h.kubelet_devices(), scanned, "step {step}: the kubelet's devices");
        }
        assert_eq!(h, Holders::of(records.values()), "nothing left over for removed records");
    }
}
