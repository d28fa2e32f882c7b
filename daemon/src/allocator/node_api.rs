//! The node API's way in: `Allocate` of a share carved from a GPU's free room, of whole GPUs,
//! or of a free MIG device; admitted under the store lock against every record (the kubelet's
//! and claims' too). `Release` and `SetLimits` are the core's ([`super::DaemonAllocator::release`],
//! [`super::DaemonAllocator::set_limits`]).

use tessera_region::{ComputeMode, Priority};
use tonic::Status;

use super::{DaemonAllocator, MIG_RESOURCE, ON_DEMAND_RESOURCE, WHOLE_RESOURCE};
use crate::carve::{self, GpuRoom};
use crate::state::{AllocatedDevice, Allocation, Claim, ContainerIdentity, Lease, Source, record::unix_ns};

/// What kind of device the node API's `Allocate` asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DeviceAsk {
    /// A share carved from a GPU's free memory and SM time.
    #[default]
    Share,
    /// A MIG device of this profile (e.g. `3g.40gb`), whole.
    Mig(String),
    /// This many whole GPUs, exclusive.
    Whole(u32),
}

/// What the node API's `Allocate` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareRequest {
    pub device: DeviceAsk,
    /// Shares only (0 for MIG and whole GPUs).
    pub memory: u64,
    /// Shares only (0 for MIG and whole GPUs).
    pub sm_percent: u32,
    /// `None`: the configuration's `limits.priority`.
    pub priority: Option<Priority>,
    /// `None`: the configuration's `limits.compute_mode`.
    pub compute_mode: Option<ComputeMode>,
    /// A GPU index, UUID or model name; empty: any.
    pub gpu: String,
    pub owner: Option<String>,
    pub lease: Lease,
    /// May be parked for an allocation of higher priority (`--preemptible`; issue 33).
    pub preemptible: bool,
}

impl DaemonAllocator {
    /// The node API's `Allocate`: a share of `memory` bytes and `sm_percent` carved from one of
    /// `gpus` (placed as `share_placement` says), recorded durably, its directory made. Admission
    /// counts every record on the GPU (the kubelet's too), under the store lock.
    pub fn allocate_share(&self, req: &ShareRequest, gpus: &[GpuRoom]) -> Result<Allocation, Status> {
        match &req.device {
            DeviceAsk::Share => self.carve_share(req, gpus, Allocation::new_id()),
            DeviceAsk::Mig(_) | DeviceAsk::Whole(_) => self.allocate_device(req, gpus),
        }
    }

    /// A share carved as [`Self::allocate_share`] says, under id `id` (preemption names it
    /// before the share is made: the allocations it parks are parked for it).
    pub(super) fn carve_share(&self, req: &ShareRequest, gpus: &[GpuRoom], id: String) -> Result<Allocation, Status> {
        if req.memory == 0 {
            return Err(Status::invalid_argument("memory_bytes: required (the share's device memory, bytes)"));
        }
        if !(1..=100).contains(&req.sm_percent) {
            return Err(Status::invalid_argument(format!(
                "sm_percent: {} is not a percent of the GPU's SM time (1..=100)",
                req.sm_percent
            )));
        }
        let defaults = self.defaults();
        let compute_mode = req.compute_mode.unwrap_or(defaults.compute_mode);
        let ask = carve::Ask { memory: req.memory, sm_percent: req.sm_percent, compute_mode };
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // The store's per-GPU sums, not a scan of every record: admission is on every Allocate's
        // path.
        let loads = store.loads();
        // A parked allocation's memory is free (issue 33): its resume is admitted again.
        let gpu = carve::place(
            gpus,
            |g| self.beside_parked(&store, g, carve::held_in(g, loads, None)),
            &req.gpu,
            ask,
            defaults.placement,
        )
        .map_err(|why| {
            if why.starts_with("gpu:") { Status::not_found(why) } else { Status::resource_exhausted(why) }
        })?;
        let alloc = Allocation {
            id,
            resource: ON_DEMAND_RESOURCE.to_owned(),
            container: ContainerIdentity::default(),
            source: Source::NodeApi,
            created_unix_ns: unix_ns(),
            devices: vec![AllocatedDevice {
                device_id: gpu.uuid.clone(),
                physical_uuid: gpu.uuid.clone(),
                memory_limit: Some(req.memory),
                sm_percent: Some(req.sm_percent),
                priority: req.priority.unwrap_or(defaults.priority),
                compute_mode,
                whole: false,
                preemptible: req.preemptible,
            }],
            claim: Some(Box::new(Claim { owner: req.owner.clone(), lease: req.lease })),
        };
        // Durable first, as the kubelet's: a crash after this finds the record and recreates the
        // directory at start.
        self.record(&mut store, &alloc)?;
        tracing::info!(id = %alloc.id, gpu = gpu.index, memory = req.memory, sm = req.sm_percent, "share carved");
        Ok(alloc)
    }

    /// The node API's `Allocate` of whole devices: `count` whole GPUs with nothing on them, or a
    /// free MIG device of a profile; no limits (the device is the limit). Admitted under the
    /// store lock against every record, as shares are: while held, a whole GPU counts as all of
    /// its memory and 100% strict SM, so no share is carved from it.
    fn allocate_device(&self, req: &ShareRequest, gpus: &[GpuRoom]) -> Result<Allocation, Status> {
        if req.memory != 0 || req.sm_percent != 0 {
            return Err(Status::invalid_argument(
                "memory_bytes, sm_percent: a whole GPU or MIG device has no share limits; leave them 0",
            ));
        }
        if req.compute_mode.is_some() {
            return Err(Status::invalid_argument("compute_mode: only for shares (a whole device is not time-sliced)"));
        }
        if req.preemptible {
            // Parking frees memory, never a device: a whole GPU or MIG device parked would still
            // be held whole, so preemption could make no room with it.
            return Err(Status::invalid_argument("preemptible: only for shares (parking frees memory, not a device)"));
        }
        let refused = |why: String| {
            if why.starts_with("gpu:") { Status::not_found(why) } else { Status::resource_exhausted(why) }
        };
        let defaults = self.defaults();
        let priority = req.priority.unwrap_or(defaults.priority);
        let whole = |uuid: &str| AllocatedDevice {
            device_id: uuid.to_owned(),
            physical_uuid: uuid.to_owned(),
            memory_limit: None,
            sm_percent: None,
            priority,
            compute_mode: ComputeMode::Strict,
            whole: false,
            preemptible: false,
        };
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let records: Vec<&Allocation> = store.list().collect();
        let (resource, devices) = match &req.device {
            DeviceAsk::Share => unreachable!("shares are carved by allocate_share"),
            DeviceAsk::Whole(count) => {
                if *count == 0 {
                    return Err(Status::invalid_argument("whole_gpus: at least 1"));
                }
                let picked = carve::place_whole(gpus, &records, &req.gpu, *count).map_err(refused)?;
                (WHOLE_RESOURCE, picked.iter().map(|g| whole(&g.uuid)).collect::<Vec<_>>())
            }
            DeviceAsk::Mig(profile) => {
                if profile.trim().is_empty() || profile.len() > 64 {
                    return Err(Status::invalid_argument("mig_profile: a GPU instance profile name, e.g. 3g.40gb"));
                }
                let (_, slot) = carve::place_mig(gpus, &records, &req.gpu, profile.trim()).map_err(refused)?;
                (MIG_RESOURCE, vec![whole(&slot.uuid)])
            }
        };
        drop(records);
        let alloc = Allocation {
            id: Allocation::new_id(),
            resource: resource.to_owned(),
            container: ContainerIdentity::default(),
            source: Source::NodeApi,
            created_unix_ns: unix_ns(),
            devices,
            claim: Some(Box::new(Claim { owner: req.owner.clone(), lease: req.lease })),
        };
        // Durable first, as shares are.
        self.record(&mut store, &alloc)?;
        let uuids: Vec<&str> = alloc.devices.iter().map(|d| d.physical_uuid.as_str()).collect();
        tracing::info!(id = %alloc.id, resource, devices = %uuids.join(","), "devices allocated whole");
        Ok(alloc)
    }
}
