//! What the allocation records hold of each device, and so what is free: plain data on the core
//! floor, computed by the allocation core from the store's per-device sums
//! (`DaemonAllocator::holdings`) and published with the controller's [`View`](crate::view::View),
//! so the device-plugin and DRA faces read one offer. Each face's answer is a pure function of
//! it, written here once:
//!
//! - the device plugin's withdrawn devices ([`Holdings::withdrawn_from_kubelet`]): the kubelet's
//!   free devices that no longer fit beside what every record holds (the kubelet's, the node
//!   API's, the claims'), told to the kubelet as unhealthy;
//! - what DRA takes out of its slice ([`Holdings::node_api`]): what the node API's own
//!   allocations hold (not claims: the scheduler counts those itself).
//!
//! Sums are exact (memory in `u128`, SM in `u64`); [`DeviceLoad::held`] saturates on the way out,
//! as adding the records up one by one with saturating adds would. Devices are keyed by their
//! physical UUID with ASCII letters upper-cased ([`device_key`]), as admission compares them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use tessera_region::ComputeMode;

use crate::resources::{Kind, Resources};

/// Whose record holds a device part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// The kubelet's `Allocate`.
    Kubelet,
    /// The node API's own allocations: carved shares, whole GPUs, MIG devices given whole.
    NodeApi,
    /// DRA claims (NodePrepareResources).
    Claim,
    /// The OCI hook's, and records recovered from their directories.
    Other,
}

/// The sums over the device parts one kind of holder has on one physical device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceLoad {
    /// Device parts counted in (a part of any size: what says a device is held at all).
    pub parts: u64,
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

    /// Counts one part in: what it holds as admission counts it (`AllocatedDevice::holds`: its
    /// memory limit, `None` for all of it, and its strict SM percent).
    pub fn add(&mut self, (memory, sm): (Option<u64>, u32)) {
        self.parts += 1;
        match memory {
            Some(m) => self.limited_memory += u128::from(m),
            None => self.unlimited += 1,
        }
        self.strict_sm += u64::from(sm);
    }

    /// Takes one part (as it was counted in) out again.
    pub fn sub(&mut self, (memory, sm): (Option<u64>, u32)) {
        self.parts -= 1;
        match memory {
            Some(m) => self.limited_memory -= u128::from(m),
            None => self.unlimited -= 1,
        }
        self.strict_sm -= u64::from(sm);
    }

    pub fn is_empty(&self) -> bool {
        *self == DeviceLoad::default()
    }

    fn plus(self, other: DeviceLoad) -> DeviceLoad {
        DeviceLoad {
            parts: self.parts + other.parts,
            limited_memory: self.limited_memory + other.limited_memory,
            unlimited: self.unlimited + other.unlimited,
            strict_sm: self.strict_sm + other.strict_sm,
        }
    }
}

/// What each kind of holder holds of one physical device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceHoldings {
    pub kubelet: DeviceLoad,
    pub node_api: DeviceLoad,
    pub claims: DeviceLoad,
    pub other: DeviceLoad,
}

impl DeviceHoldings {
    /// `holder`'s sums.
    pub fn of_mut(&mut self, holder: Holder) -> &mut DeviceLoad {
        match holder {
            Holder::Kubelet => &mut self.kubelet,
            Holder::NodeApi => &mut self.node_api,
            Holder::Claim => &mut self.claims,
            Holder::Other => &mut self.other,
        }
    }

    /// What every record holds (what admission counts against a new one).
    pub fn total(&self) -> DeviceLoad {
        self.kubelet.plus(self.node_api).plus(self.claims).plus(self.other)
    }

    pub fn is_empty(&self) -> bool {
        *self == DeviceHoldings::default()
    }
}

/// The key of a physical device: its UUID with ASCII letters upper-cased.
pub fn device_key(uuid: &str) -> String {
    uuid.to_ascii_uppercase()
}

/// What the node API's own allocations hold of one GPU or MIG device, as DRA takes it out of
/// its slice: memory (a part held whole counts as all of it: `u64::MAX`), strict SM percent,
/// and whether a part holds the device whole.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeApiHeld {
    pub memory: u64,
    pub sm: u32,
    pub whole: bool,
}

/// What the records hold, per physical device and per kubelet device id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    /// By [`device_key`]; a device no record holds has no entry.
    pub devices: BTreeMap<String, DeviceHoldings>,
    /// The devices the kubelet's records hold: device ids by resource (looked up without a
    /// copy of either; shared with the store's index, so a publish copies no id).
    pub kubelet_devices: BTreeMap<String, BTreeSet<Arc<str>>>,
}

impl Holdings {
    /// What the records hold of physical device `uuid` (any case).
    pub fn device(&self, uuid: &str) -> DeviceHoldings {
        self.devices.get(&device_key(uuid)).copied().unwrap_or_default()
    }

    /// Whether a kubelet record of `resource` holds device `id`.
    pub fn kubelet_holds(&self, resource: &str, id: &str) -> bool {
        self.kubelet_devices.get(resource).is_some_and(|ids| ids.contains(id))
    }

    /// What the node API's own allocations hold of `uuid`; `None` when they hold none of it.
    pub fn node_api(&self, uuid: &str) -> Option<NodeApiHeld> {
        let load = self.device(uuid).node_api;
        (load.parts > 0).then(|| NodeApiHeld {
            memory: if load.unlimited > 0 { u64::MAX } else { u64::try_from(load.limited_memory).unwrap_or(u64::MAX) },
            sm: u32::try_from(load.strict_sm).unwrap_or(u32::MAX),
            whole: load.unlimited > 0,
        })
    }

    /// The kubelet's free devices that no longer fit beside what the records hold (a carved
    /// share, a whole GPU or a MIG device the node API gave out, a claim): `(resource, device
    /// id)`. Told to the kubelet as unhealthy, so the scheduler places no pod its `Allocate`
    /// would refuse; they come back when the room does. Only devices no kubelet record holds are
    /// withdrawn (a pod's own device never turns unhealthy under it), and as few as can be: each
    /// GPU's or MIG device's free devices are kept in order while they fit together beside what
    /// is held. The kubelet's `Allocate` admits by the same rule (`admit_beside`: every record on
    /// the device, a whole device counting as all of it, SM summed for strict parts), so what is
    /// withdrawn is what it would refuse.
    ///
    /// `memory_of`: a GPU's or MIG device's memory by UUID (`None`: not a device the node knows,
    /// nothing withdrawn); `share_mode`: the compute mode the kubelet's shares get
    /// (`limits.compute_mode`).
    pub fn withdrawn_from_kubelet(
        &self,
        resources: &Resources,
        memory_of: impl Fn(&str) -> Option<u64>,
        share_mode: ComputeMode,
    ) -> BTreeSet<(String, String)> {
        let mut out = BTreeSet::new();
        // Per device: its memory, and what is held plus the free devices kept so far (`None`:
        // not a device the node knows). Each device's memory and holdings looked up once.
        let mut kept: HashMap<&str, Option<(u64, u64, u32)>> = HashMap::new();
        for res in resources.resources.values() {
            let held_ids = self.kubelet_devices.get(&res.name);
            for d in res.devices.iter().filter(|d| d.health.is_healthy()) {
                // A pod's (the node API's MIG records name the same id: those do not count).
                if held_ids.is_some_and(|ids| ids.contains(d.id.as_str())) {
                    continue;
                }
                let entry = kept.entry(d.physical_uuid.as_str()).or_insert_with(|| {
                    let total = memory_of(&d.physical_uuid)?;
                    let (memory, sm) = self.device(&d.physical_uuid).total().held(total);
                    Some((total, memory, sm))
                });
                let Some((total, memory, sm)) = entry else { continue };
                let total = *total;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_health::Health;
    use crate::resources::{Resource, ResourceDevice};

    const GIB: u64 = 1 << 30;

    fn device(id: &str, physical: &str, memory: Option<u64>, sm: Option<u32>) -> ResourceDevice {
        ResourceDevice {
            id: id.into(),
            physical_uuid: physical.into(),
            gpu_index: 0,
            numa_node: None,
            health: Health::Healthy,
            memory_limit: memory,
            sm_percent: sm,
            nodes: Vec::new(),
        }
    }

    fn resources(list: Vec<(&str, Kind, Vec<ResourceDevice>)>) -> Resources {
        let mut out = Resources::default();
        for (name, kind, devices) in list {
            out.resources.insert(name.into(), Resource { name: name.into(), kind, devices });
        }
        out
    }

    fn holdings(parts: &[(&str, Holder, Option<u64>, u32)], kubelet: &[(&str, &str)]) -> Holdings {
        let mut h = Holdings::default();
        for &(uuid, holder, memory, sm) in parts {
            h.devices.entry(device_key(uuid)).or_default().of_mut(holder).add((memory, sm));
        }
        for (r, id) in kubelet {
            h.kubelet_devices.entry(r.to_string()).or_default().insert(Arc::from(*id));
        }
        h
    }

    /// Two GPUs (A of 9 GiB, B of 8 GiB), each offered to the kubelet as two 4 GiB / 50% shares,
    /// and a MIG device of 4 GiB offered whole.
    fn offer() -> Resources {
        let share = |id: &str, gpu: &str| device(id, gpu, Some(4 * GIB), Some(50));
        resources(vec![
            (
                "tessera.io/gpu-share",
                Kind::Share,
                vec![
                    share("GPU-A::0", "GPU-A"),
                    share("GPU-A::1", "GPU-A"),
                    share("GPU-B::0", "GPU-B"),
                    share("GPU-B::1", "GPU-B"),
                ],
            ),
            ("tessera.io/mig-1g.5gb", Kind::Mig, vec![device("MIG-m", "MIG-m", None, None)]),
        ])
    }

    fn memory_of(uuid: &str) -> Option<u64> {
        match uuid.to_ascii_uppercase().as_str() {
            "GPU-A" => Some(9 * GIB),
            "GPU-B" => Some(8 * GIB),
            "MIG-M" => Some(4 * GIB),
            _ => None,
        }
    }

    fn pairs(list: &[(&str, &str)]) -> BTreeSet<(String, String)> {
        list.iter().map(|(r, id)| (r.to_string(), id.to_string())).collect()
    }

    /// One holdings value, both faces' answers: the device plugin counts every record (the
    /// kubelet's own, the node API's, the claims') against the kubelet's free devices, DRA takes
    /// out only what the node API holds. Fails if either rule drifts from the other's inputs.
    #[test]
    fn what_is_free_for_each_face_from_one_holdings_value() {
        let share = "tessera.io/gpu-share";
        let h = holdings(
            &[
                // The kubelet holds GPU-A::0 (4 GiB, 50%).
                ("GPU-A", Holder::Kubelet, Some(4 * GIB), 50),
                // A claim holds 1 GiB and 10% of GPU-A: GPU-A::1 no longer fits beside it (SM).
                ("gpu-a", Holder::Claim, Some(GIB), 10),
                // The node API carved 3 GiB, 1% of GPU-B: one of its shares still fits.
                ("GPU-B", Holder::NodeApi, Some(3 * GIB), 1),
                // A hook's record holds the MIG device whole.
                ("MIG-m", Holder::Other, None, 100),
            ],
            &[(share, "GPU-A::0")],
        );
        let withdrawn = h.withdrawn_from_kubelet(&offer(), memory_of, ComputeMode::Strict);
        assert_eq!(
            withdrawn,
            pairs(&[(share, "GPU-A::1"), (share, "GPU-B::1"), ("tessera.io/mig-1g.5gb", "MIG-m")]),
            "every holder counts for the kubelet; its own device is never withdrawn"
        );
        // DRA: only the node API's own allocations, in any case.
        assert_eq!(h.node_api("gpu-b"), Some(NodeApiHeld { memory: 3 * GIB, sm: 1, whole: false }));
        assert_eq!(h.node_api("GPU-A"), None, "the kubelet's and the claims' are not the node API's");
        assert_eq!(h.node_api("MIG-m"), None, "nor the hook's");

        // Work-conserving shares: SM is not summed for the kubelet's shares, only memory (1 + 4
        // + 4 GiB of GPU-A's 9 fit).
        let h = holdings(&[("GPU-A", Holder::NodeApi, Some(GIB), 40)], &[]);
        let strict = h.withdrawn_from_kubelet(&offer(), memory_of, ComputeMode::Strict);
        assert_eq!(strict, pairs(&[(share, "GPU-A::1")]), "60% left: one 50% share fits");
        assert!(h.withdrawn_from_kubelet(&offer(), memory_of, ComputeMode::WorkConserving).is_empty());

        // A device held whole (its limits lowered since) counts as all of it, for both faces.
        let h = holdings(&[("GPU-B", Holder::NodeApi, None, 100)], &[]);
        assert_eq!(
            h.withdrawn_from_kubelet(&offer(), memory_of, ComputeMode::Strict),
            pairs(&[(share, "GPU-B::0"), (share, "GPU-B::1")])
        );
        assert_eq!(h.node_api("GPU-B"), Some(NodeApiHeld { memory: u64::MAX, sm: 100, whole: true }));

        // Nothing held: nothing withdrawn, nothing taken out; an unhealthy device is the health
        // rule's, not this one's; an unknown device is left alone.
        let none = Holdings::default();
        assert!(none.withdrawn_from_kubelet(&offer(), memory_of, ComputeMode::Strict).is_empty());
        assert_eq!(none.node_api("GPU-A"), None);
        let mut sick = offer();
        sick.resources.get_mut("tessera.io/mig-1g.5gb").unwrap().devices[0].health = Health::Unhealthy("XID 79".into());
        let h = holdings(&[("MIG-m", Holder::NodeApi, None, 100)], &[]);
        assert!(h.withdrawn_from_kubelet(&sick, memory_of, ComputeMode::Strict).is_empty());
        assert!(h.withdrawn_from_kubelet(&offer(), |_| None, ComputeMode::Strict).is_empty());
    }

    #[test]
    fn sums_per_holder_and_their_total_saturate_on_the_way_out() {
        let mut d = DeviceHoldings::default();
        d.of_mut(Holder::Kubelet).add((Some(10), 30));
        d.of_mut(Holder::NodeApi).add((None, 100));
        d.of_mut(Holder::Claim).add((Some(u64::MAX), 20));
        let total = d.total();
        assert_eq!(total.parts, 3);
        assert_eq!(total.held(80), (u64::MAX, 150));
        d.of_mut(Holder::NodeApi).sub((None, 100));
        d.of_mut(Holder::Claim).sub((Some(u64::MAX), 20));
        assert_eq!(d.total().held(80), (10, 30));
        d.of_mut(Holder::Kubelet).sub((Some(10), 30));
        assert!(d.is_empty());
    }
}
