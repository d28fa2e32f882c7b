//! What enforcement counts, shared with the node API (`GetUsage`) and telemetry: breaches per
//! allocation, device, action and limit, SM time by the driver per allocation and GPU, and the
//! processes no allocation holds.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use super::device_ids;
use crate::state::Allocation;

/// An allocation on one device, as the metrics label it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OnDevice {
    pub allocation: String,
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// The device (GPU or MIG UUID).
    pub uuid: String,
    /// The allocation's device ids there, comma-joined.
    pub device_id: String,
}

impl OnDevice {
    fn of(a: &Allocation, uuid: &str, device_id: String) -> OnDevice {
        let s = |o: &Option<String>| o.as_deref().unwrap_or("").to_string();
        OnDevice {
            allocation: a.id.clone(),
            namespace: s(&a.container.pod_namespace),
            pod: s(&a.container.pod_name),
            container: s(&a.container.container_name),
            uuid: uuid.to_string(),
            device_id,
        }
    }

    /// Takes the pod's names from `a`, which may have become known since (copied only when
    /// they changed).
    fn refresh(&mut self, a: &Allocation) {
        let c = &a.container;
        let s = |o: &Option<String>| o.as_deref().unwrap_or("").to_string();
        if self.pod != c.pod_name.as_deref().unwrap_or("")
            || self.namespace != c.pod_namespace.as_deref().unwrap_or("")
            || self.container != c.container_name.as_deref().unwrap_or("")
        {
            (self.namespace, self.pod, self.container) = (s(&c.pod_namespace), s(&c.pod_name), s(&c.container_name));
        }
    }
}

/// One allocation's breaches on one device, for the metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreachCount {
    pub on: OnDevice,
    /// `kill` or `report`.
    pub action: &'static str,
    /// The limit breached: `memory` or `sm`.
    pub limit: &'static str,
    pub count: u64,
}

/// SM time an allocation's processes got on one device, by NVML's per-process utilization (the
/// driver's figure, not the container's own counters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmTime {
    pub on: OnDevice,
    /// Nanoseconds of SM time since the daemon started (or since the allocation was made).
    pub ns: u64,
    /// When the last reading counted ended (unix ns): rates are over these, not over when
    /// someone asked.
    pub as_of_ns: u64,
}

/// What enforcement shows in the metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metrics {
    /// Breaches since the daemon started (a kill, or a reported breach that started).
    pub breaches: Vec<BreachCount>,
    /// SM time by the driver, per live allocation and GPU (not inside MIG instances).
    pub sm_time: Vec<SmTime>,
    /// Processes on a GPU that belong to no allocation, at the last poll.
    pub unattributed_gpu_processes: u64,
}

/// The counters, shared with telemetry.
#[derive(Debug, Default)]
pub struct Stats {
    inner: Mutex<Metrics>,
}

impl Stats {
    pub fn metrics(&self) -> Metrics {
        self.lock().clone()
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Metrics> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts a breach of `a` on `uuid`.
    pub(super) fn breach(
        &self,
        a: &Allocation,
        uuid: &str,
        device_id: &str,
        action: &'static str,
        limit: &'static str,
    ) {
        let mut m = self.lock();
        let same = |o: &BreachCount| {
            (o.on.allocation.as_str(), o.on.uuid.as_str(), o.action, o.limit) == (&a.id, uuid, action, limit)
        };
        match m.breaches.iter_mut().find(|o| same(o)) {
            Some(o) => {
                o.count += 1;
                o.on.refresh(a);
                if o.on.device_id != device_id {
                    o.on.device_id = device_id.to_string();
                }
            }
            None => m.breaches.push(BreachCount {
                on: OnDevice::of(a, uuid, device_id.to_string()),
                action,
                limit,
                count: 1,
            }),
        }
    }

    /// Adds a poll's SM time, (allocation, GPU UUID, ns) each, and forgets the allocations no
    /// longer held (`live`). One lock a poll; labels are copied only when they change.
    pub(super) fn add_sm_time(&self, added: &[(&Allocation, &str, u64)], live: &HashSet<String>, as_of_ns: u64) {
        let mut m = self.lock();
        m.sm_time.retain(|t| live.contains(t.on.allocation.as_str()));
        let mut at: HashMap<(String, String), usize> =
            m.sm_time.iter().enumerate().map(|(i, t)| ((t.on.allocation.clone(), t.on.uuid.clone()), i)).collect();
        for &(a, uuid, ns) in added {
            match at.entry((a.id.clone(), uuid.to_string())) {
                std::collections::hash_map::Entry::Occupied(e) => {
                    let t = &mut m.sm_time[*e.get()];
                    t.ns = t.ns.saturating_add(ns);
                    t.as_of_ns = as_of_ns;
                    t.on.refresh(a);
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(m.sm_time.len());
                    m.sm_time.push(SmTime { on: OnDevice::of(a, uuid, device_ids(&[a], uuid)), ns, as_of_ns });
                }
            }
        }
    }
}
