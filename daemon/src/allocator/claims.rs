//! DRA's way in: NodePrepareResources makes (or finds again) the one record a claim UID owns,
//! limits = the consumed capacity, admitted as carved shares are; NodeUnprepareResources
//! releases it. [`ClaimAllocations`] is how the DRA driver sees this (its tests fake it).

use std::sync::Arc;

use tonic::Status;

use super::admission::admit_claim;
use super::{DRA_RESOURCE, DaemonAllocator};
use crate::state::{AllocatedDevice, Allocation, Claim, ContainerIdentity, Lease, Source, record::unix_ns};

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimRef {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

/// Who an allocation made for a claim belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimOwner {
    pub claim: ClaimRef,
    /// The pods the claim is reserved for (name, UID), for reports and metrics.
    pub pods: Vec<(String, String)>,
}

/// The allocation store as DRA uses it.
pub trait ClaimAllocations: Send + Sync + 'static {
    /// The allocation owned by `owner.claim.uid`; made from `devices` (admitted against every
    /// other allocation on their GPUs) when there is none.
    fn allocate_claim(&self, owner: &ClaimOwner, devices: Vec<AllocatedDevice>) -> Result<Allocation, String>;
    /// Releases what claim `uid` owns; `Ok(false)` when it owned nothing.
    fn release_claim(&self, uid: &str) -> Result<bool, String>;
    /// Every allocation made for a claim (after a start: whose specs must exist).
    fn claim_allocations(&self) -> Vec<Allocation>;
}

impl DaemonAllocator {
    /// NodePrepareResources: the allocation claim `owner.claim.uid` owns, made from `devices`
    /// (limits = the consumed capacity) when it owns none. Admitted as carved shares are, against
    /// every other record on the same GPUs, under the store lock; recorded durably before the
    /// kubelet is answered, so a prepare repeated after a crash finds it (nothing doubled).
    pub fn allocate_claim(&self, owner: &ClaimOwner, devices: Vec<AllocatedDevice>) -> Result<Allocation, Status> {
        let uid = owner.claim.uid.as_str();
        if uid.is_empty() {
            return Err(Status::invalid_argument("claim uid: required (the allocation's owner)"));
        }
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(existing) = store.list().find(|a| claim_owned_by(a, uid)).cloned() {
            // A repeated prepare (the kubelet retried, or either of us restarted): the same record.
            self.restore_dir(&existing)?;
            tracing::info!(id = %existing.id, claim = uid, "claim allocation reused");
            return Ok(existing);
        }
        if devices.is_empty() {
            return Err(Status::invalid_argument(format!("claim {uid}: no device of this node to prepare")));
        }
        let (pod_name, pod_uid) = match owner.pods.as_slice() {
            [(name, uid)] => (Some(name.clone()), Some(uid.clone())),
            _ => (None, None),
        };
        let alloc = Allocation {
            id: Allocation::new_id(),
            resource: DRA_RESOURCE.to_owned(),
            container: ContainerIdentity {
                pod_namespace: Some(owner.claim.namespace.clone()),
                pod_name,
                pod_uid,
                ..ContainerIdentity::default()
            },
            source: Source::NodeApi,
            created_unix_ns: unix_ns(),
            devices,
            claim: Some(Box::new(Claim { owner: Some(uid.to_owned()), lease: Lease::None })),
        };
        let rooms = Arc::clone(&self.rooms.read().unwrap_or_else(std::sync::PoisonError::into_inner));
        admit_claim(&rooms, &store, uid, &alloc)?;
        // Durable first: a crash after this finds the record (and recreates the directory).
        self.record(&mut store, &alloc)?;
        tracing::info!(id = %alloc.id, claim = uid, namespace = %owner.claim.namespace, name = %owner.claim.name, "claim allocated");
        Ok(alloc)
    }

    /// NodeUnprepareResources: releases what claim `uid` owns (record, directory, region);
    /// `Ok(false)` when it owns nothing (already released).
    pub fn release_claim(&self, uid: &str) -> Result<bool, Status> {
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let ids: Vec<String> = store.list().filter(|a| claim_owned_by(a, uid)).map(|a| a.id.clone()).collect();
        for id in &ids {
            self.discard(&mut store, id)?;
            tracing::info!(%id, claim = uid, "claim released");
        }
        Ok(!ids.is_empty())
    }
}

/// Whether `a` is the allocation DRA made for claim `uid`.
fn claim_owned_by(a: &Allocation, uid: &str) -> bool {
    a.resource == DRA_RESOURCE && a.claim.as_ref().and_then(|c| c.owner.as_deref()) == Some(uid)
}

/// The store as the DRA driver uses it.
impl ClaimAllocations for DaemonAllocator {
    fn allocate_claim(&self, owner: &ClaimOwner, devices: Vec<AllocatedDevice>) -> Result<Allocation, String> {
        DaemonAllocator::allocate_claim(self, owner, devices).map_err(|s| s.message().to_owned())
    }

    fn release_claim(&self, uid: &str) -> Result<bool, String> {
        DaemonAllocator::release_claim(self, uid).map_err(|s| s.message().to_owned())
    }

    fn claim_allocations(&self) -> Vec<Allocation> {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        store.list().filter(|a| a.resource == DRA_RESOURCE).cloned().collect()
    }
}
