//! Building the node API's reports from the controller's [`View`]: devices (GPUs, MIG devices,
//! shares), partitions, allocations and usage.

use std::collections::{BTreeMap, BTreeSet};

use tessera_proto::tessera::v1 as api;
use tonic::Status;

use crate::device_health::Health;
use crate::node::{holder, identity, layout};
use crate::resources::{CDI_VENDOR, Kind, Resources};
use crate::state::{Allocation, Lease, Source};
use crate::usage::UsageReport;
use crate::view::View;

/// Which GPUs a `gpu` filter (UUID or index; empty: all) selects; an unknown one is an error.
fn gpu_filter(view: &View, gpu: &str) -> Result<Option<u32>, Status> {
    if gpu.is_empty() {
        return Ok(None);
    }
    let found = match gpu.parse::<u32>() {
        Ok(i) => view.inventory.gpu(i),
        Err(_) => view.inventory.gpu_by_uuid(gpu),
    };
    found.map(|g| Some(g.index)).ok_or_else(|| {
        Status::not_found(format!("gpu: no GPU {gpu:?} on this node ({} GPUs)", view.inventory.gpus.len()))
    })
}

fn health(view: &View, gpu: u32, uuid: &str) -> (api::Health, String) {
    match view.health.of(gpu, uuid) {
        Health::Healthy => (api::Health::Healthy, String::new()),
        Health::Unhealthy(why) => (api::Health::Unhealthy, why),
    }
}

/// `ListDevices`; `withdrawn` are the kubelet's devices told unhealthy for want of room,
/// `(resource, device id)` (`crate::node::KubeletOffer`).
pub fn list_devices(
    view: &View,
    allocations: &[Allocation],
    withdrawn: &BTreeSet<(String, String)>,
    req: &api::ListDevicesRequest,
) -> Result<Vec<api::Device>, Status> {
    for (i, k) in req.kinds.iter().enumerate() {
        if api::DeviceKind::try_from(*k).is_err() {
            return Err(Status::invalid_argument(format!("kinds[{i}]: {k} is not a DeviceKind")));
        }
    }
    let only = gpu_filter(view, &req.gpu)?;
    let mut holders: BTreeMap<&str, Vec<api::Holder>> = BTreeMap::new();
    for a in allocations {
        for d in &a.devices {
            holders.entry(d.device_id.as_str()).or_default().push(holder(a));
        }
    }
    let offered = |id: &str| view.resources.device(id).map(|(r, _)| (r.name.clone(), r.kind));
    let mut out = Vec::new();
    for gpu in view.inventory.gpus.iter().filter(|g| only.is_none_or(|i| i == g.index)) {
        let (h, reason) = health(view, gpu.index, &gpu.uuid);
        let base = api::Device {
            model: gpu.name.clone(),
            health: h as i32,
            health_reason: reason,
            numa_node: gpu.numa_node.map(i64::from),
            pci_bus_id: gpu.pci_bus_id.clone(),
            ..Default::default()
        };
        let named = |id: &str, kind: api::DeviceKind| {
            let (resource_name, cdi_name) = match offered(id) {
                Some((name, k)) => (name, format!("{CDI_VENDOR}/{}={id}", k.cdi_class())),
                None => (String::new(), String::new()),
            };
            api::Device {
                id: id.to_owned(),
                kind: kind as i32,
                kubelet_withdrawn: withdrawn.contains(&(resource_name.clone(), id.to_owned())),
                resource_name,
                cdi_name,
                holders: holders.get(id).cloned().unwrap_or_default(),
                ..base.clone()
            }
        };
        out.push(api::Device {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            memory_bytes: gpu.memory_total,
            sm_percent: 100,
            ..named(&gpu.uuid, api::DeviceKind::Gpu)
        });
        let mut parents = vec![(gpu.uuid.clone(), gpu.uuid.clone())];
        if let Some(mig) = gpu.mig.as_ref().filter(|m| m.current) {
            for gi in &mig.instances {
                let slices = mig.capability.profile(&gi.profile).map_or(0, |p| p.slice_count);
                let sm = (slices * 100).checked_div(mig.capability.compute_slices).unwrap_or(0);
                for d in &gi.devices {
                    let (h, reason) = health(view, gpu.index, &d.uuid);
                    out.push(api::Device {
                        uuid: d.uuid.clone(),
                        parent_id: gpu.uuid.clone(),
                        index: gi.gi_id,
                        memory_bytes: d.memory_total,
                        sm_percent: sm,
                        health: h as i32,
                        health_reason: reason,
                        mig: Some(api::MigInstance {
                            profile: gi.profile.clone(),
                            gpu_instance_id: d.gi_id,
                            compute_instance_id: d.ci_id,
                            placement_start: gi.start,
                            placement_size: gi.size,
                        }),
                        ..named(&d.uuid, api::DeviceKind::Mig)
                    });
                    parents.push((d.uuid.clone(), d.uuid.clone()));
                }
            }
        }
        for (parent, uuid) in parents {
            for s in view.shares.iter().filter(|s| s.parent_uuid == parent) {
                let (h, reason) = health(view, gpu.index, &uuid);
                out.push(api::Device {
                    uuid: uuid.clone(),
                    parent_id: parent.clone(),
                    index: s.index,
                    memory_bytes: s.memory_limit,
                    sm_percent: s.sm_percent,
                    health: h as i32,
                    health_reason: reason,
                    ..named(&s.id, api::DeviceKind::Share)
                });
            }
        }
    }
    out.retain(|d| req.kinds.is_empty() || req.kinds.contains(&d.kind));
    Ok(out)
}

/// `ListPartitions`.
pub fn list_partitions(view: &View, gpu: &str) -> Result<Vec<api::Partition>, Status> {
    let only = gpu_filter(view, gpu)?;
    let mode = |on: bool| if on { api::MigMode::Enabled } else { api::MigMode::Disabled };
    Ok(view
        .inventory
        .gpus
        .iter()
        .filter(|g| only.is_none_or(|i| i == g.index))
        .map(|g| {
            let status = view.status.get(&g.index);
            let (mig_mode, pending) = match &g.mig {
                None => (api::MigMode::Unsupported, api::MigMode::Unspecified),
                Some(m) if m.pending != m.current => (mode(m.current), mode(m.pending)),
                Some(m) => (mode(m.current), api::MigMode::Unspecified),
            };
            api::Partition {
                gpu_id: g.uuid.clone(),
                gpu_uuid: g.uuid.clone(),
                gpu_index: g.index,
                current: Some(layout::api_from_spec(&layout::current_spec(g, &view.shares))),
                desired: view.config.partition_for(g.index, &g.uuid).map(|(_, s)| layout::api_from_spec(s)),
                state: status.map_or(api::PartitionState::Converged, |s| s.state) as i32,
                mig_mode: mig_mode as i32,
                pending_mig_mode: pending as i32,
                device_ids: view.resources.devices_of_gpu(g.index).map(|(_, d)| d.id.clone()).collect(),
                issues: status.map(|s| s.issues.clone()).unwrap_or_default(),
            }
        })
        .collect())
}

/// One allocation record as the API reports it.
pub fn allocation(a: &Allocation, resources: &Resources) -> api::Allocation {
    let kind = resources.get(&a.resource).map(|r| r.kind);
    api::Allocation {
        id: a.id.clone(),
        resource_name: a.resource.clone(),
        container: Some(identity(&a.container)),
        devices: a
            .devices
            .iter()
            .map(|d| api::AllocatedDevice {
                device_id: d.device_id.clone(),
                uuid: d.physical_uuid.clone(),
                kind: match kind {
                    // Carved on demand (or a DRA claim's part of a GPU): a share of the GPU named
                    // by its UUID. A DRA claim's whole GPU or MIG device has no limit and falls
                    // through to the UUID's kind below.
                    _ if a.source == Source::NodeApi && !d.is_whole() => api::DeviceKind::Share,
                    Some(Kind::Gpu) => api::DeviceKind::Gpu,
                    Some(Kind::Mig) => api::DeviceKind::Mig,
                    Some(Kind::Share) => api::DeviceKind::Share,
                    None if d.device_id != d.physical_uuid => api::DeviceKind::Share,
                    None if d.physical_uuid.starts_with("MIG-") => api::DeviceKind::Mig,
                    None => api::DeviceKind::Gpu,
                } as i32,
                memory_limit_bytes: d.memory_limit.unwrap_or(0),
                sm_percent: d.sm_percent.unwrap_or(0),
                priority: match d.priority {
                    tessera_region::Priority::Low => -1,
                    tessera_region::Priority::Normal => 0,
                    tessera_region::Priority::High => 1,
                },
            })
            .collect(),
        owner: a.claim.as_ref().and_then(|c| c.owner.clone()).unwrap_or_default(),
        lease: api_lease(a) as i32,
        source: match a.source {
            Source::Kubelet => api::AllocationSource::Kubelet,
            Source::NodeApi => api::AllocationSource::NodeApi,
            Source::Hook => api::AllocationSource::Hook,
            // Not one of the API's sources: the record was rebuilt, its origin is unknown.
            Source::Recovered => api::AllocationSource::Unspecified,
        } as i32,
        created_unix_nano: a.created_unix_ns,
        // Running unless the park state says otherwise (the caller's to set: the record does
        // not hold it).
        state: api::AllocationState::Running as i32,
        preemptible: a.preemptible(),
        // As the state: the park's, not the record's.
        preempted_by: String::new(),
    }
}

/// The API's lease of a record.
fn api_lease(a: &Allocation) -> api::Lease {
    match a.claim.as_ref().map(|c| c.lease) {
        Some(Lease::Container) => api::Lease::Container,
        Some(Lease::None) => api::Lease::None,
        None => api::Lease::Unspecified,
    }
}

/// `GetUsage` from a sampled report.
pub fn usage_response(
    report: &UsageReport,
    allocations: &[Allocation],
    req: &api::GetUsageRequest,
) -> api::GetUsageResponse {
    let mut window = 0;
    let containers = report
        .containers
        .iter()
        .filter(|c| req.allocation_id.is_empty() || c.allocation_id == req.allocation_id)
        .filter_map(|c| {
            let devices: Vec<api::DeviceUsage> = c
                .devices
                .iter()
                .filter(|d| {
                    req.device_id.is_empty()
                        || d.uuid == req.device_id
                        || d.device_id.split(',').any(|id| id == req.device_id)
                })
                .map(|d| {
                    window = window.max(d.window_ns);
                    api::DeviceUsage {
                        device_id: d.device_id.clone(),
                        uuid: d.uuid.clone(),
                        memory_used_bytes: d.memory_used,
                        memory_peak_bytes: d.memory_peak,
                        memory_limit_bytes: d.memory_limit.unwrap_or(0),
                        sm_achieved_percent: d.sm_achieved_percent,
                        sm_limit_percent: d.sm_limit_percent.unwrap_or(0),
                        launches_per_second: d.launches_per_second,
                        throttled_nanos: d.throttled_ns,
                        oom_denials: d.oom_denials,
                        launches: d.launches,
                        gpu_time_nanos: d.gpu_time_ns,
                        // The driver's figures come from the enforcement loop (the caller's).
                        sm_driver_percent: 0.0,
                        sm_driver_nanos: 0,
                    }
                })
                .collect();
            if devices.is_empty() && !req.device_id.is_empty() {
                return None;
            }
            let container = allocations
                .iter()
                .find(|a| a.id == c.allocation_id)
                .map(|a| identity(&a.container))
                .unwrap_or_else(|| identity(&c.container));
            Some(api::ContainerUsage {
                allocation_id: c.allocation_id.clone(),
                container: Some(container),
                processes: c.processes,
                devices,
            })
        })
        .collect();
    api::GetUsageResponse { time_unix_nano: report.time_unix_ns, window_nanos: window, containers }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::tests::dev;
    use crate::state::{Claim, ContainerIdentity, Lease};

    #[test]
    fn dra_claims_show_a_share_a_whole_gpu_or_a_mig_device() {
        let record = |devices| Allocation {
            id: "a".into(),
            resource: crate::allocator::DRA_RESOURCE.into(),
            container: ContainerIdentity::default(),
            source: Source::NodeApi,
            created_unix_ns: 0,
            devices,
            claim: Some(Box::new(Claim { owner: Some("uid-1".into()), lease: Lease::None })),
        };
        let kinds = |a: &Allocation| -> Vec<i32> {
            allocation(a, &Resources::default()).devices.iter().map(|d| d.kind).collect()
        };
        let a = record(vec![
            dev("GPU-0", "GPU-0", Some(8 << 30), Some(30)),
            dev("GPU-1", "GPU-1", None, None),
            dev("MIG-2", "MIG-2", None, None),
        ]);
        assert_eq!(
            kinds(&a),
            [api::DeviceKind::Share as i32, api::DeviceKind::Gpu as i32, api::DeviceKind::Mig as i32]
        );
        assert_eq!(allocation(&a, &Resources::default()).owner, "uid-1");
    }
}
