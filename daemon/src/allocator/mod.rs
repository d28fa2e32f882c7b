//! The allocation core: the one place that changes allocation records, with three ways in.
//!
//! Every allocation is recorded in the crash-safe [`Store`] before anyone is answered (the
//! kubelet's new records are written then and flushed a moment after: [`kubelet_grants`] says
//! why nothing is lost), each with
//! its directory (`limits` + `region`) from [`AllocDirs`]. The operations that change a record
//! live here (record, release, set limits, name the container); the ways in call them:
//!
//! - [`kubelet`]: the device plugin's `Allocate` and preferences (reuse, stale records, the
//!   answer the kubelet hands the runtime); [`kubelet_grants`]: the kubelet's own checkpoint
//!   read at start, and the kubelet records a power cut took made again from it;
//! - [`node_api`]: the node API's on-demand shares, whole GPUs and MIG devices;
//! - [`claims`]: DRA claims (NodePrepare/UnprepareResources), one record per claim UID;
//!
//! and beside them `park` (an allocation's processes parked and resumed through the driver's
//! checkpoint API), `preempt` (a share of higher priority made by parking preemptible ones,
//! resumed once they fit again), `admission` (what fits beside every other record on a device), `reconcile`
//! (records and directories brought back together at start; owner records the hook left). What
//! the records hold of each device ([`DaemonAllocator::holdings`]) is published with the
//! controller's view; each face works out from it what is free for it (`crate::holdings`).

mod admission;
pub mod claims;
pub mod kubelet;
pub mod kubelet_grants;
pub mod node_api;
pub mod park;
pub mod preempt;
mod reconcile;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use tessera_region::{ComputeMode, Priority};
use tonic::Status;

use crate::carve::GpuRoom;
use crate::config::{Config, Placement};
use crate::resources::Resources;
use crate::state::{AllocDirs, Allocation, ContainerIdentity, Store};

pub use claims::{ClaimAllocations, ClaimOwner, ClaimRef};
use kubelet::{DirectInjection, Offer};
pub use node_api::{DeviceAsk, ShareRequest};
use reconcile::OwnerWatch;

/// Where the allocation directory is mounted in the container (the shim reads its limits there).
pub use tessera_region::CONTAINER_ALLOC_DIR;

/// The resource name of shares carved on demand through the node API (no kubelet resource
/// is ever named so: the kubelet's reuse and stale-record rules never see them).
pub const ON_DEMAND_RESOURCE: &str = "node-api/gpu-share";

/// The resource name of allocations made for DRA claims (NodePrepareResources); the record's
/// owner is the claim UID (the store's, which counts what claims hold apart).
pub use crate::state::record::DRA_RESOURCE;

/// The resource name of whole GPUs given through the node API.
pub const WHOLE_RESOURCE: &str = "node-api/gpu";

/// The resource name of MIG devices given whole through the node API.
pub const MIG_RESOURCE: &str = "node-api/mig";

/// What the node API's `SetLimits` changes; `None` keeps the value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitChange {
    pub memory: Option<u64>,
    pub sm_percent: Option<u32>,
    pub priority: Option<Priority>,
}

/// The daemon's allocation decisions over the store.
#[derive(Debug)]
pub struct DaemonAllocator {
    /// Replaced whole when a layout change or a health change alters what is offered.
    offer: RwLock<Arc<Offer>>,
    /// The GPUs as the controller last published them: the kubelet's new allocations are
    /// admitted against what carved shares already hold.
    rooms: RwLock<Arc<Vec<GpuRoom>>>,
    store: Mutex<Store>,
    dirs: AllocDirs,
    defaults: RwLock<Defaults>,
    /// How a container gets its devices when the runtime does not read CDI specs.
    direct: Option<DirectInjection>,
    /// When each record was last handed to the kubelet (made or reused), in this process; the
    /// pod-resources task never releases a record handed out recently.
    handed_out: Mutex<HashMap<String, Instant>>,
    /// Poked after every `Allocate`: the pod-resources task looks again soon.
    allocated: Arc<tokio::sync::Notify>,
    /// The directories of the allocations that do not know their container yet, watched for
    /// the owner record (`adopt_owner_records` reads only those written into).
    owner_watch: Mutex<OwnerWatch>,
    /// The allocations parked, or being parked or resumed ([`park`]).
    parking: park::Parking,
    /// Held by a preemption from its plan to its share made (or undone), and by a pass that
    /// resumes preempted allocations ([`preempt`]): such a pass never takes back the room a
    /// preemption in flight parked for its share, and two preemptions never pick one victim.
    preempting: Mutex<()>,
    /// Poked when an operator's park frees memory (no record changes): preempted allocations
    /// may fit again (`NodeController::follow_preempted`).
    parks_changed: Arc<tokio::sync::Notify>,
}

/// What reloads may change: share placement, and the limits new share allocations get.
#[derive(Debug, Clone, Copy)]
struct Defaults {
    placement: Placement,
    priority: Priority,
    compute_mode: ComputeMode,
}

impl Defaults {
    fn of(config: &Config) -> Defaults {
        Defaults {
            placement: config.resources.share_placement,
            priority: Priority::from_name(&config.limits.priority).unwrap_or_default(),
            compute_mode: ComputeMode::from_name(&config.limits.compute_mode).unwrap_or_default(),
        }
    }
}

impl DaemonAllocator {
    /// Over `store` and `dirs`, with the share defaults of `config`.
    pub fn new(config: &Config, resources: Arc<Resources>, store: Store, dirs: AllocDirs) -> DaemonAllocator {
        DaemonAllocator {
            offer: RwLock::new(Arc::new(Offer::of(resources))),
            rooms: RwLock::new(Arc::new(Vec::new())),
            store: Mutex::new(store),
            dirs,
            defaults: RwLock::new(Defaults::of(config)),
            direct: DirectInjection::of(config),
            handed_out: Mutex::new(HashMap::new()),
            allocated: Arc::new(tokio::sync::Notify::new()),
            owner_watch: Mutex::new(OwnerWatch::default()),
            parking: park::Parking::default(),
            preempting: Mutex::new(()),
            parks_changed: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// The store's change count and, when it differs from `since`, what `select` makes of the
    /// records (under the store's lock: it should copy only what it needs). A loop that follows
    /// the records every few ms looks at them only when they changed.
    pub fn allocations_changed_since<T>(
        &self,
        since: Option<u64>,
        select: impl FnOnce(&[&Allocation]) -> T,
    ) -> (u64, Option<T>) {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let changes = store.changes();
        if since == Some(changes) {
            return (changes, None);
        }
        let records: Vec<&Allocation> = store.list().collect();
        (changes, Some(select(&records)))
    }

    /// A copy of every record (for reports and tests).
    pub fn allocations(&self) -> Vec<Allocation> {
        self.allocations_where(|_| true)
    }

    /// A copy of the records `keep` selects: the lease pass runs every second beside Allocate,
    /// and copies only what it looks at.
    pub fn allocations_where(&self, keep: impl Fn(&Allocation) -> bool) -> Vec<Allocation> {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        store.list().filter(|a| keep(a)).cloned().collect()
    }

    /// What is offered now.
    pub fn resources(&self) -> Arc<Resources> {
        Arc::clone(&self.offer().resources)
    }

    fn offer(&self) -> Arc<Offer> {
        Arc::clone(&self.offer.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Offers `resources` from now on (allocations already made are kept).
    pub fn set_resources(&self, resources: Arc<Resources>) {
        let offer = Arc::new(Offer::of(resources));
        *self.offer.write().unwrap_or_else(std::sync::PoisonError::into_inner) = offer;
    }

    /// The GPUs from now on (the controller, when it publishes).
    pub fn set_rooms(&self, rooms: Vec<GpuRoom>) {
        *self.rooms.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(rooms);
    }

    /// The GPUs as the controller last published them (no copy of its picture per call).
    pub fn rooms(&self) -> Arc<Vec<GpuRoom>> {
        Arc::clone(&self.rooms.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// The share defaults of `config` for allocations from now on (a reload; records made
    /// before keep theirs).
    pub fn set_defaults(&self, config: &Config) {
        *self.defaults.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Defaults::of(config);
    }

    fn defaults(&self) -> Defaults {
        *self.defaults.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The per-allocation directories.
    pub fn dirs(&self) -> &AllocDirs {
        &self.dirs
    }

    /// Sets the container of allocation `id` (the pod-resources API named it), durably, and
    /// rewrites its limits file so the shim reports the right name. Writes only when the identity
    /// changed; returns whether it did. An unknown id is `NotFound`.
    pub fn set_container(&self, id: &str, container: ContainerIdentity) -> Result<bool, Status> {
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(current) = store.get(id) else {
            return Err(Status::not_found(format!("no allocation {id}")));
        };
        if current.container == container {
            return Ok(false);
        }
        let mut alloc = current.clone();
        alloc.container = container;
        store.update(&alloc).map_err(|e| internal("updating the allocation")(e.to_string()))?;
        if let Err(e) = self.dirs.update_limits(&alloc) {
            tracing::warn!(%id, error = %e, "cannot rewrite the limits file with the container's name");
        }
        Ok(true)
    }

    /// Records `alloc` durably, then makes its directory; a directory that cannot be made takes
    /// the record back. Durable first: a crash after this finds the record (and recreates the
    /// directory at start); a crash before it leaves nothing, and the caller's client retries.
    fn record(&self, store: &mut Store, alloc: &Allocation) -> Result<(), Status> {
        store.insert(alloc).map_err(|e| internal("recording the allocation")(e.to_string()))?;
        self.make_dir(store, alloc)
    }

    /// [`Self::record`] for the kubelet's `Allocate`: the record's flush is left to the store's
    /// group flush (the kubelet keeps the answer durably itself, and a record a power cut took
    /// is rebuilt from its checkpoint: `Self::recover_kubelet_grants`).
    fn record_flushed_soon(&self, store: &mut Store, alloc: &Allocation) -> Result<(), Status> {
        store.insert_flushed_soon(alloc).map_err(|e| internal("recording the allocation")(e.to_string()))?;
        self.make_dir(store, alloc)
    }

    /// The directory of a record just made; without it, the record goes again.
    fn make_dir(&self, store: &mut Store, alloc: &Allocation) -> Result<(), Status> {
        if let Err(e) = self.dirs.create(alloc) {
            let _ = store.remove(&alloc.id);
            return Err(internal("creating the allocation directory")(e.to_string()));
        }
        Ok(())
    }

    /// An existing record handed out again: its directory made where it is missing (a reboot
    /// cleared the runtime dir).
    fn restore_dir(&self, alloc: &Allocation) -> Result<(), Status> {
        if !self.dirs.limits_path(&alloc.id).exists() {
            self.dirs.create(alloc).map_err(|e| internal("creating the allocation directory")(e.to_string()))?;
        }
        Ok(())
    }

    /// Removes record `id` and its directory (with its region); whether there was a record.
    fn discard(&self, store: &mut Store, id: &str) -> Result<bool, Status> {
        let existed = store.remove(id).map_err(|e| internal("removing the allocation")(e.to_string()))?.is_some();
        self.dirs.remove(id).map_err(|e| internal("removing the allocation directory")(e.to_string()))?;
        Ok(existed)
    }

    /// Removes allocation `id` and its directory (its container is gone), unless the kubelet was
    /// handed it less than `quiet` ago (it was just reused for a new container). Returns whether
    /// it was released.
    pub fn release_unclaimed(&self, id: &str, quiet: std::time::Duration) -> Result<bool, Status> {
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.handed_out(id).is_some_and(|at| at.elapsed() < quiet) {
            return Ok(false);
        }
        let existed = store.remove(id).map_err(|e| internal("removing the allocation")(e.to_string()))?.is_some();
        if let Err(e) = self.dirs.remove(id) {
            tracing::warn!(%id, error = %e, "cannot remove an allocation directory");
        }
        Ok(existed)
    }

    /// The node API's `Release`: the record, the directory and its region go; `Ok(false)` when
    /// there was no record (already released). A directory left without a record goes too.
    pub fn release(&self, id: &str) -> Result<bool, Status> {
        crate::state::record::valid_id(id).map_err(|why| Status::invalid_argument(format!("allocation_id: {why}")))?;
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A parked allocation's live processes would stay locked for good (issue 33).
        self.check_release_parked(&store, id)?;
        let existed = self.discard(&mut store, id)?;
        if existed {
            tracing::info!(%id, "released");
        }
        Ok(existed)
    }

    /// The node API's `SetLimits`: every device of allocation `id` gets the new memory limit,
    /// SM percent and priority; admitted as `Allocate` is (the allocation's own share does not
    /// count against it). The record changes durably first (enforcement reads it), then the
    /// limits file is rewritten and the region's generation bumped (the shim's one live path).
    pub fn set_limits(&self, id: &str, change: LimitChange, gpus: &[GpuRoom]) -> Result<Allocation, Status> {
        if change.memory == Some(0) {
            return Err(Status::invalid_argument("memory_bytes: must be above 0"));
        }
        if let Some(sm) = change.sm_percent.filter(|sm| !(1..=100).contains(sm)) {
            return Err(Status::invalid_argument(format!("sm_percent: {sm} is not a percent (1..=100)")));
        }
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(current) = store.get(id).cloned() else {
            return Err(Status::not_found(format!("allocation_id: no allocation {}", crate::client_input::quoted(id))));
        };
        let mut alloc = current.clone();
        for d in &mut alloc.devices {
            // A device held whole stays held whole: lower limits bind its container, not what
            // is carved or given beside it (nothing).
            d.whole = d.is_whole();
            d.memory_limit = change.memory.or(d.memory_limit);
            d.sm_percent = change.sm_percent.or(d.sm_percent);
            d.priority = change.priority.unwrap_or(d.priority);
        }
        admission::admit_change(gpus, &store, id, &current, &alloc, change.memory)?;
        if alloc == current {
            return Ok(alloc);
        }
        store.update(&alloc).map_err(|e| internal("updating the allocation")(e.to_string()))?;
        if let Err(e) = self.dirs.update_limits(&alloc) {
            // The record goes back to what the container's limits file still says: the daemon
            // must not enforce terms the shim never got.
            if let Err(undo) = store.update(&current) {
                tracing::error!(%id, error = %undo, "cannot put the record back after the limits file failed");
            }
            return Err(internal("rewriting the limits")(e.to_string()));
        }
        tracing::info!(%id, memory = ?change.memory, sm = ?change.sm_percent, priority = ?change.priority, "limits changed");
        Ok(alloc)
    }

    /// When allocation `id` was last handed to the kubelet by this process (made or reused);
    /// `None` if not since the daemon started.
    pub fn handed_out(&self, id: &str) -> Option<Instant> {
        self.handed_out.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(id).copied()
    }

    /// Notified after every `Allocate` that succeeded (a permit is kept if nobody waits).
    pub fn allocated(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.allocated)
    }

    /// What the records hold now, per device and holder, with the kubelet's held devices: the
    /// controller publishes it in its view (O(devices held) under the store's lock).
    pub fn holdings(&self) -> crate::holdings::Holdings {
        self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).holdings()
    }

    /// Told of every change to [`Self::holdings`] (whoever made it).
    pub fn holdings_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).holdings_changes()
    }

    /// Every device id and physical UUID some allocation holds.
    pub fn held(&self) -> BTreeSet<String> {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        store.list().flat_map(|a| &a.devices).flat_map(|d| [d.device_id.clone(), d.physical_uuid.clone()]).collect()
    }
}

fn internal(what: &str) -> impl FnOnce(String) -> Status + '_ {
    move |e| Status::internal(format!("{what}: {e}"))
}
