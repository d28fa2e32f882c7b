//! NodePrepareResources / NodeUnprepareResources: a claim's allocation result becomes one
//! allocation record whose owner is the claim UID and whose limits are the consumed capacity
//! (a whole GPU or MIG device: no limit); the answer is, per device, the CDI name of that device in
//! the claim's own spec (`tessera.io/claim=<uid>-<uuid>`, [`super::claim_specs`]), which gives the
//! container the device, the allocation's directory, the shim and its environment. The claim's
//! `status.devices` then says what was granted ([`super::status`], never failing the prepare).
//!
//! Idempotent and crash-safe by construction: the record is written (durably, by the store
//! behind [`ClaimAllocations`]) before the spec, and both before the kubelet is answered; a
//! prepare of a claim that owns a record returns that record (its spec written again, the same
//! bytes), and an unprepare of a claim that owns none succeeds. Unprepare removes the record,
//! then the spec; tesserad's start re-writes the specs of recorded claims and removes the others.

use std::sync::Arc;

use tessera_region::{ComputeMode, Priority};
use tokio::sync::watch;

use super::claim_specs::ClaimSpecs;
use super::claims::{ClaimSource, GrantedDevice, allocation};
use super::devices::{DraDevice, DraKind};
use super::dynamic_mig::DynamicMig;
use super::slices::{DEFAULT_MEMORY, DEFAULT_SM};
use super::status::{DeviceStatus, StatusWriter};
use super::{ClaimDriver, ClaimRef, PreparedDevice};
use crate::state::AllocatedDevice;

/// Who a claim's allocation belongs to, and the allocation core as DRA calls it.
pub use crate::allocator::{ClaimAllocations, ClaimOwner};

/// The limits one granted device gives, with the published device it names.
pub fn allocated_device(
    granted: &GrantedDevice,
    published: &[DraDevice],
    default_priority: Priority,
    default_compute_mode: ComputeMode,
) -> Result<(AllocatedDevice, DraDevice), String> {
    let d = published.iter().find(|d| d.name == granted.device).ok_or_else(|| {
        format!("device {} is not published by this node (any more); the claim must be allocated again", granted.device)
    })?;
    if let Some(why) = d.health.reason() {
        return Err(format!("device {} is unhealthy: {why}", d.name));
    }
    let (memory_limit, sm_percent, compute_mode) = match d.kind {
        DraKind::Gpu | DraKind::Mig { .. } | DraKind::MigPlacement(_) => (None, None, ComputeMode::Strict),
        DraKind::Shared => {
            let memory = granted.consumed.get("memory").copied().unwrap_or(DEFAULT_MEMORY);
            let sm = granted.consumed.get("sm").copied().unwrap_or(DEFAULT_SM);
            if memory == 0 || memory > d.memory {
                return Err(format!("device {}: memory {memory} is outside 1..={} bytes", d.name, d.memory));
            }
            let sm = u32::try_from(sm)
                .ok()
                .filter(|s| (1..=100).contains(s))
                .ok_or_else(|| format!("device {}: sm {sm} is not a percent of the GPU's SM time (1..=100)", d.name))?;
            (Some(memory), Some(sm), granted.compute_mode.unwrap_or(default_compute_mode))
        }
    };
    let allocated = AllocatedDevice {
        device_id: d.uuid.clone(),
        physical_uuid: d.uuid.clone(),
        memory_limit,
        sm_percent,
        priority: granted.priority.unwrap_or(default_priority),
        compute_mode,
        whole: false,
        preemptible: granted.preemptible,
    };
    Ok((allocated, d.clone()))
}

/// The daemon's [`ClaimDriver`].
pub struct DraDriver {
    pub claims: Arc<dyn ClaimSource>,
    pub allocations: Arc<dyn ClaimAllocations>,
    /// The claims' CDI specs.
    pub specs: Arc<ClaimSpecs>,
    /// The claims' `status.devices`.
    pub status: Arc<StatusWriter>,
    /// What this node publishes now.
    pub devices: watch::Receiver<Vec<DraDevice>>,
    /// This node's pool (its name).
    pub pool: String,
    pub default_priority: Priority,
    pub default_compute_mode: ComputeMode,
    /// Dynamic MIG (placement devices); `None`: none is published.
    pub dynamic_mig: Option<Arc<DynamicMig>>,
}

#[tonic::async_trait]
impl ClaimDriver for DraDriver {
    async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        let rc = self.claims.read(claim).await?;
        let granted = allocation(&rc, claim, &self.pool)?;
        let published = self.devices.borrow().clone();
        let made = async {
            let mut devices = Vec::new();
            let mut named = Vec::new();
            for g in &granted.devices {
                let (mut a, mut d) = allocated_device(g, &published, self.default_priority, self.default_compute_mode)?;
                if matches!(d.kind, DraKind::MigPlacement(_)) {
                    let made = self.make_placement(&claim.uid, d.clone()).await?;
                    (a.device_id, a.physical_uuid, d.uuid) = (made.uuid.clone(), made.uuid.clone(), made.uuid);
                }
                devices.push(a);
                named.push((g, d));
            }
            Ok::<_, String>((devices, named))
        };
        // A claim refused after some of its MIG instances were made leaves none behind.
        let (devices, named) = made.await.inspect_err(|_| self.forget_placements(&claim.uid))?;
        let owner = ClaimOwner { claim: claim.clone(), pods: granted.pods.clone() };
        let (allocations, specs) = (Arc::clone(&self.allocations), Arc::clone(&self.specs));
        // Refused: the claim's new MIG instances go. Allocated but the spec not written: they
        // stay with the record, and the kubelet's retry writes the spec again.
        let (alloc, ids) = tokio::task::spawn_blocking(move || {
            let alloc = allocations.allocate_claim(&owner, devices).map_err(|e| (true, e))?;
            let ids = specs.write(&alloc).map_err(|e| (false, e))?;
            Ok::<_, (bool, String)>((alloc, ids))
        })
        .await
        .map_err(|e| format!("allocation task failed: {e}"))?
        .map_err(|(refused, e)| {
            if refused {
                self.forget_placements(&claim.uid);
            }
            e
        })?;
        let mut answer = Vec::new();
        let mut status = Vec::new();
        for (g, d) in named {
            let id = ids.iter().find(|(uuid, _)| uuid.eq_ignore_ascii_case(&d.uuid)).map(|(_, id)| id.clone());
            let id = id.ok_or_else(|| {
                format!("claim {}: device {} is not in its allocation {}", claim.uid, d.name, alloc.id)
            })?;
            answer.push(PreparedDevice {
                requests: vec![g.request.clone()],
                pool: g.pool.clone(),
                device: g.device.clone(),
                cdi_device_ids: vec![id],
            });
            let held = alloc.devices.iter().find(|a| a.physical_uuid.eq_ignore_ascii_case(&d.uuid));
            status.push(DeviceStatus {
                pool: g.pool.clone(),
                device: g.device.clone(),
                share_id: g.share_id.clone(),
                uuid: d.uuid.clone(),
                memory: held.and_then(|a| a.memory_limit),
                sm_percent: held.and_then(|a| a.sm_percent),
                allocation: alloc.id.clone(),
            });
        }
        self.status.write(claim, status);
        tracing::info!(claim = %claim.uid, namespace = %claim.namespace, name = %claim.name, allocation = %alloc.id, "claim prepared");
        Ok(answer)
    }

    async fn unprepare(&self, claim: &ClaimRef) -> Result<(), String> {
        let (allocations, specs) = (Arc::clone(&self.allocations), Arc::clone(&self.specs));
        let uid = claim.uid.clone();
        let released = tokio::task::spawn_blocking(move || {
            let released = allocations.release_claim(&uid)?;
            specs.remove(&uid)?;
            Ok::<_, String>(released)
        })
        .await
        .map_err(|e| format!("release task failed: {e}"))??;
        self.status.write(claim, Vec::new());
        if released {
            tracing::info!(claim = %claim.uid, "claim unprepared");
        }
        if let Some(dm) = self.dynamic_mig.clone() {
            let uid = claim.uid.clone();
            tokio::task::spawn_blocking(move || dm.unprepare(&uid))
                .await
                .map_err(|e| format!("dynamic MIG task failed: {e}"))??;
        }
        Ok(())
    }
}

impl DraDriver {
    /// The MIG instance for a placement device (dynamic MIG), made or found.
    async fn make_placement(&self, claim_uid: &str, d: DraDevice) -> Result<crate::discovery::MigDevice, String> {
        let dm = self.dynamic_mig.clone().ok_or_else(|| format!("device {}: dynamic MIG is not enabled", d.name))?;
        let uid = claim_uid.to_owned();
        tokio::task::spawn_blocking(move || dm.prepare(&uid, &d))
            .await
            .map_err(|e| format!("dynamic MIG task failed: {e}"))?
    }

    /// A claim refused after its instances were made: they go (best effort; unprepare retries).
    fn forget_placements(&self, claim_uid: &str) {
        if let Some(dm) = &self.dynamic_mig
            && let Err(e) = dm.unprepare(claim_uid)
        {
            tracing::warn!(claim = claim_uid, error = %e, "destroying the dynamic MIG instances of a refused claim");
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::{BTreeMap, HashMap};
    use std::sync::Mutex;

    use k8s_openapi::api::resource::v1::ResourceClaim;

    use super::*;
    use crate::dra::status::{ClaimStatusApi, WriteError};
    use crate::state::{Allocation, Claim, ContainerIdentity, Lease, Source};

    /// The one claim every read gives.
    pub(crate) struct Claims(pub(crate) ResourceClaim);

    #[tonic::async_trait]
    impl ClaimSource for Claims {
        async fn read(&self, _: &ClaimRef) -> Result<ResourceClaim, String> {
            Ok(self.0.clone())
        }
    }

    /// Records by claim UID, as the store keeps them.
    #[derive(Default)]
    struct Records(Mutex<HashMap<String, Allocation>>);

    impl ClaimAllocations for Records {
        fn allocate_claim(&self, owner: &ClaimOwner, devices: Vec<AllocatedDevice>) -> Result<Allocation, String> {
            let mut r = self.0.lock().unwrap();
            let n = r.len();
            Ok(r.entry(owner.claim.uid.clone())
                .or_insert_with(|| Allocation {
                    id: format!("a{n}"),
                    resource: crate::allocator::DRA_RESOURCE.into(),
                    container: ContainerIdentity::default(),
                    source: Source::NodeApi,
                    created_unix_ns: 0,
                    devices,
                    claim: Some(Box::new(Claim { owner: Some(owner.claim.uid.clone()), lease: Lease::None })),
                })
                .clone())
        }

        fn release_claim(&self, uid: &str) -> Result<bool, String> {
            Ok(self.0.lock().unwrap().remove(uid).is_some())
        }

        fn claim_allocations(&self) -> Vec<Allocation> {
            self.0.lock().unwrap().values().cloned().collect()
        }
    }

    /// The status writes, recorded: (claim UID, entries).
    #[derive(Default)]
    pub(crate) struct Statuses(Mutex<Vec<(String, Vec<DeviceStatus>)>>);

    #[tonic::async_trait]
    impl ClaimStatusApi for Statuses {
        async fn apply(&self, claim: &ClaimRef, devices: &[DeviceStatus]) -> Result<(), WriteError> {
            self.0.lock().unwrap().push((claim.uid.clone(), devices.to_vec()));
            Ok(())
        }
    }

    fn published() -> Vec<DraDevice> {
        let base = DraDevice { uuid: "GPU-0".into(), gpu_uuid: "GPU-0".into(), ..DraDevice::test_gpu("gpu-0", None) };
        vec![
            base.clone(),
            DraDevice { name: "gpu-0-shared".into(), kind: DraKind::Shared, ..base.clone() },
            DraDevice {
                name: "gpu-1-mig-2-0".into(),
                kind: DraKind::Mig { profile: "3g.40gb".into(), gi: 2, ci: 0 },
                uuid: "MIG-1".into(),
                memory: 40 << 30,
                ..base
            },
        ]
    }

    fn granted(device: &str, consumed: &[(&str, u64)]) -> GrantedDevice {
        GrantedDevice {
            request: "gpu".into(),
            pool: "node-a".into(),
            device: device.into(),
            consumed: consumed.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect::<BTreeMap<_, _>>(),
            share_id: None,
            priority: None,
            compute_mode: None,
            preemptible: false,
        }
    }

    #[test]
    fn consumed_capacity_becomes_the_limits() {
        let p = published();
        let (a, d) = allocated_device(
            &granted("gpu-0-shared", &[("memory", 8 << 30), ("sm", 30)]),
            &p,
            Priority::Normal,
            ComputeMode::Strict,
        )
        .unwrap();
        assert_eq!((a.memory_limit, a.sm_percent, a.physical_uuid.as_str()), (Some(8 << 30), Some(30), "GPU-0"));
        assert_eq!(d.name, "gpu-0-shared");
        let (a, d) =
            allocated_device(&granted("gpu-1-mig-2-0", &[]), &p, Priority::Normal, ComputeMode::Strict).unwrap();
        assert_eq!((a.memory_limit, a.sm_percent), (None, None), "a MIG device is the container's whole");
        assert_eq!((a.physical_uuid.as_str(), d.uuid.as_str()), ("MIG-1", "MIG-1"));
        // Defaults from the request policy when the claim named none.
        let (a, _) =
            allocated_device(&granted("gpu-0-shared", &[]), &p, Priority::Low, ComputeMode::WorkConserving).unwrap();
        assert_eq!((a.memory_limit, a.sm_percent), (Some(DEFAULT_MEMORY), Some(10)));
        assert_eq!((a.priority, a.compute_mode), (Priority::Low, ComputeMode::WorkConserving));
        assert!(!a.preemptible);
        // The claim's `preemptible` goes into the record.
        let g = GrantedDevice { preemptible: true, ..granted("gpu-0-shared", &[]) };
        assert!(allocated_device(&g, &p, Priority::Low, ComputeMode::Strict).unwrap().0.preemptible);
        // What a scheduler bug or a hostile edit could hand us.
        let e = |g: GrantedDevice| allocated_device(&g, &p, Priority::Normal, ComputeMode::Strict).unwrap_err();
        assert!(e(granted("gpu-0-shared", &[("sm", 101)])).contains("sm 101 is not a percent"));
        assert!(e(granted("gpu-0-shared", &[("sm", 0)])).contains("sm 0"));
        assert!(e(granted("gpu-0-shared", &[("memory", 81 << 30)])).contains("outside"));
        assert!(e(granted("gpu-9", &[])).contains("not published by this node"));
        let mut sick = p.clone();
        sick[1].health = crate::device_health::Health::Unhealthy("XID 79".into());
        let err = allocated_device(&granted("gpu-0-shared", &[]), &sick, Priority::Normal, ComputeMode::Strict);
        assert!(err.unwrap_err().contains("unhealthy: XID 79"));
    }

    #[tokio::test]
    async fn prepare_is_idempotent_and_unprepare_releases_once() {
        let rc: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "train", "namespace": "ml", "uid": "uid-1"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.io",
                "pool": "node-a", "device": "gpu-0-shared", "consumedCapacity": {"memory": "8Gi", "sm": "30"}}]}},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}]}
        }))
        .unwrap();
        let records = Arc::new(Records::default());
        let tmp = tempfile::tempdir().unwrap();
        let nodes: super::super::claim_specs::NodesOf = Arc::new(|_: &str| Some(Vec::new()));
        let specs = Arc::new(ClaimSpecs::new(
            tmp.path().join("cdi"),
            tessera_region::cdi::NodeDevices::default(),
            tmp.path().join("run"),
            nodes,
        ));
        let statuses = Arc::new(Statuses::default());
        let driver = DraDriver {
            claims: Arc::new(Claims(rc)),
            allocations: records.clone(),
            specs,
            status: Arc::new(StatusWriter::new(statuses.clone())),
            devices: watch::channel(published()).1,
            pool: "node-a".into(),
            default_priority: Priority::Normal,
            default_compute_mode: ComputeMode::Strict,
            dynamic_mig: None,
        };
        let c = ClaimRef { namespace: "ml".into(), uid: "uid-1".into(), name: "train".into() };
        let spec = tmp.path().join("cdi/tessera.io-claim_uid-1.json");
        let first = driver.prepare(&c).await.unwrap();
        assert_eq!(first[0].cdi_device_ids, ["tessera.io/claim=uid-1-GPU-0"]);
        let written = std::fs::read(&spec).unwrap();
        assert_eq!(driver.prepare(&c).await.unwrap(), first);
        assert_eq!(std::fs::read(&spec).unwrap(), written, "prepared again: the same spec");
        assert_eq!(records.0.lock().unwrap().len(), 1, "prepared twice, allocated once");
        assert_eq!(records.0.lock().unwrap()["uid-1"].devices[0].memory_limit, Some(8 << 30));
        driver.unprepare(&c).await.unwrap();
        assert!(!spec.exists(), "unprepared: the spec is gone");
        driver.unprepare(&c).await.unwrap();
        assert!(records.0.lock().unwrap().is_empty());
        // status.devices: what was granted, then cleared (the writes run in the background).
        for _ in 0..100 {
            let seen = statuses.0.lock().unwrap().clone();
            if seen.iter().any(|(_, d)| !d.is_empty()) && seen.last().is_some_and(|(_, d)| d.is_empty()) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let seen = statuses.0.lock().unwrap().clone();
        let set = &seen.iter().find(|(_, d)| !d.is_empty()).expect("a status write").1[0];
        assert_eq!(
            (set.device.as_str(), set.uuid.as_str(), set.memory, set.sm_percent),
            ("gpu-0-shared", "GPU-0", Some(8 << 30), Some(30))
        );
        assert_eq!(set.allocation, "a0");
        assert!(seen.last().unwrap().1.is_empty(), "the last write clears: {seen:?}");
    }
}
