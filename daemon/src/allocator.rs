//! The daemon's [`Allocator`]: allocations recorded in the crash-safe [`Store`] before the kubelet
//! is answered, each with its directory (`limits` + `region`) from [`AllocDirs`].
//!
//! The kubelet's `Allocate` does not say which pod it is for, and the kubelet may ask again for
//! the same devices (after a daemon restart, or a retried call): a stored record of the same
//! resource with the same device set is reused, never duplicated. A record that shares some but
//! not all devices with a new request is stale (the kubelet hands a device to one container at a
//! time, so its container is gone): it is removed with its directory.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use tessera_region::{ComputeMode, Priority};
use tonic::Status;

use crate::carve::{self, GpuRoom};
use crate::config::{Config, Placement};
use crate::dra::prepare::{ClaimAllocations, ClaimOwner};
use crate::kubelet::{Allocator, ContainerAllocation, HostDevice, HostMount};
use crate::resources::{CDI_VENDOR, Kind, Resource, Resources};
use crate::state::{
    AllocDirs, AllocatedDevice, Allocation, Claim, ContainerIdentity, Lease, Source, Store, record::unix_ns,
};

/// Where the allocation directory is mounted in the container (the shim reads its limits there).
pub use tessera_region::CONTAINER_ALLOC_DIR;

/// The resource name of shares carved on demand through the node API (no kubelet resource
/// is ever named so: the kubelet's reuse and stale-record rules never see them).
pub const ON_DEMAND_RESOURCE: &str = "node-api/gpu-share";

/// The resource name of allocations made for DRA claims (NodePrepareResources); the record's
/// owner is the claim UID.
pub const DRA_RESOURCE: &str = "dra/gpu.tessera.io";

/// The resource name of whole GPUs given through the node API.
pub const WHOLE_RESOURCE: &str = "node-api/gpu";

/// The resource name of MIG devices given whole through the node API.
pub const MIG_RESOURCE: &str = "node-api/mig";

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
}

/// What the node API's `SetLimits` changes; `None` keeps the value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitChange {
    pub memory: Option<u64>,
    pub sm_percent: Option<u32>,
    pub priority: Option<Priority>,
}

/// How long [`DaemonAllocator::handed_out`] remembers a hand-out.
const HANDED_OUT_KEPT: std::time::Duration = std::time::Duration::from_secs(3600);

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
}

/// What `adopt_owner_records` follows: the unnamed allocations' directories, as of the store's
/// change count `changes`.
#[derive(Debug, Default)]
struct OwnerWatch {
    events: crate::state::dir_events::DirEvents,
    changes: Option<u64>,
}

/// What is offered, and where each device is in it: `Allocate` looks its devices up by id, and a
/// resource may list a thousand (a scan of string compares per device asked for).
#[derive(Debug, Default)]
struct Offer {
    resources: Arc<Resources>,
    /// Resource name → device id → index in that resource's `devices`.
    positions: HashMap<String, HashMap<String, usize>>,
}

impl Offer {
    fn of(resources: Arc<Resources>) -> Offer {
        let mut positions: HashMap<String, HashMap<String, usize>> = HashMap::new();
        for (name, r) in &resources.resources {
            let of = positions.entry(name.clone()).or_default();
            for (i, d) in r.devices.iter().enumerate() {
                of.entry(d.id.clone()).or_insert(i);
            }
        }
        Offer { resources, positions }
    }

    /// Device `id` of resource `res` (the first of that id, as `Resource::device`).
    fn device<'a>(&self, res: &'a Resource, id: &str) -> Option<&'a crate::resources::ResourceDevice> {
        let i = *self.positions.get(&res.name)?.get(id)?;
        res.devices.get(i).filter(|d| d.id == id)
    }
}

/// For runtimes without CDI (`injection.cdi_spec_dir` empty): the answer itself carries the
/// device nodes (with their cgroup rules) and mounts the shim and an `/etc/ld.so.preload` naming
/// it; the driver's libraries are then the runtime's (or `tessera-runtime`'s) business.
#[derive(Debug, Clone)]
struct DirectInjection {
    /// `nvidiactl`, `nvidia-uvm`, … as present on the host.
    control_nodes: Vec<std::path::PathBuf>,
    shim: Option<std::path::PathBuf>,
    /// `<runtime_dir>/ld.so.preload`, naming the shim at its container path.
    preload: std::path::PathBuf,
    /// The host's device root: `<dev_root>/x` is `/dev/x` in the container.
    dev_root: std::path::PathBuf,
}

impl DirectInjection {
    fn container_path(&self, host: &std::path::Path) -> String {
        match host.strip_prefix(&self.dev_root) {
            Ok(rest) => std::path::Path::new("/dev").join(rest).display().to_string(),
            Err(_) => host.display().to_string(),
        }
    }
}

impl DirectInjection {
    fn of(config: &Config) -> Option<DirectInjection> {
        let inj = &config.injection;
        if !inj.cdi_spec_dir.as_os_str().is_empty() {
            return None;
        }
        let control_nodes =
            tessera_hook::driver::CONTROL_NODES.iter().map(|n| inj.dev_root.join(n)).filter(|p| p.exists()).collect();
        let shim = (!inj.shim_path.as_os_str().is_empty()).then(|| inj.shim_path.clone());
        let preload = config.runtime_dir.join("ld.so.preload");
        if shim.is_some() {
            let text = format!("{}\n", tessera_hook::cdi::SHIM_CONTAINER_PATH);
            if let Err(e) = crate::state::durable::write_file(&preload, text.as_bytes(), 0o644) {
                tracing::error!(file = %preload.display(), error = %e, "cannot write the preload file");
            }
        }
        Some(DirectInjection { control_nodes, shim, preload, dev_root: inj.dev_root.clone() })
    }
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
        }
    }

    /// Brings every stored allocation's directory back where it is missing (after a reboot
    /// cleared the runtime dir); directories present are left alone (their containers run),
    /// but a trace left running in their region is stopped.
    /// Returns how many records there are.
    pub fn reconcile(&self) -> usize {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // After a journal loss, a record whose directory is gone while others' survived may be
        // one released before the damage (its removal was in what was lost): it is kept (a
        // held allocation must not be dropped on a guess) and said, so an operator can release it.
        let runtime_survived = store.loss().is_some() && store.list().any(|a| self.dirs.limits_path(&a.id).exists());
        for alloc in store.list() {
            if !self.dirs.limits_path(&alloc.id).exists() {
                if runtime_survived {
                    tracing::error!(
                        id = %alloc.id,
                        "after the journal's damage, allocation {} is in its records but its directory was gone \
                         while others' remain: it may have been released before; kept (`tessera release {}` if \
                         nothing holds it)",
                        alloc.id,
                        alloc.id
                    );
                }
                if let Err(e) = self.dirs.create(alloc) {
                    tracing::error!(id = %alloc.id, error = %e, "cannot recreate the allocation directory");
                }
            }
            // A directory an older tesserad made has no ledger view: made now, before more of its
            // container's processes start (a process looks for it once).
            let ledger = self.dirs.ledger_path(&alloc.id);
            if self.dirs.dir(&alloc.id).is_dir()
                && ledger.symlink_metadata().is_err()
                && let Err(e) = tessera_region::ledger::Ledger::create(&ledger)
            {
                tracing::warn!(id = %alloc.id, error = %e, "cannot make the allocation's ledger view");
            }
            // A trace that a previous daemon did not finish (it died mid-trace) stops here: no
            // one is reading the ring, and recording costs every launch.
            if let Ok(region) = tessera_region::Region::open_or_create(&self.dirs.region_path(&alloc.id))
                && region.trace_requested()
            {
                region.set_trace_requested(false);
                tracing::info!(id = %alloc.id, "stopped a trace left running by an earlier daemon");
            }
        }
        store.len()
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

    /// Fills what allocations do not know of their container from the records the hook or the
    /// runtime wrapper left in their directories (`owner`: the runtime's container id, and the
    /// pod from a CRI runtime's annotations); what is known already (from the kubelet's
    /// pod-resources API) is kept. Returns how many allocations changed.
    ///
    /// Only the directories written into since the last pass are read (inotify; each once when
    /// first followed): the lease and pod-resources passes call this every second or two, and a
    /// thousand unused allocations were a thousand failed opens each time.
    pub fn adopt_owner_records(&self) -> usize {
        let mut watch = self.owner_watch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let OwnerWatch { events, changes } = &mut *watch;
        // Known values are kept, and a record always names its container: an allocation that
        // knows its container id has nothing to learn from it (not followed).
        let (now, unnamed) = self.allocations_changed_since(*changes, |records| {
            records.iter().filter(|a| a.container.container_id.is_none()).map(|a| a.id.clone()).collect::<Vec<_>>()
        });
        let mut to_read: HashSet<String> = HashSet::new();
        if let Some(ids) = unnamed {
            *changes = Some(now);
            to_read.extend(events.follow(&self.dirs, ids.iter().map(String::as_str)));
        }
        to_read.extend(events.changed());
        let mut changed = 0;
        for id in to_read {
            let alloc = {
                let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                store.get(&id).filter(|a| a.container.container_id.is_none()).cloned()
            };
            let Some(alloc) = alloc else { continue };
            let Some(owner) = tessera_hook::owner::Owner::read(&self.dirs.dir(&alloc.id)) else { continue };
            let mut c = alloc.container.clone();
            let fill = |field: &mut Option<String>, value: Option<String>| {
                if field.is_none() {
                    *field = value;
                }
            };
            fill(&mut c.container_id, owner.container_id);
            fill(&mut c.pod_namespace, owner.pod_namespace);
            fill(&mut c.pod_name, owner.pod_name);
            fill(&mut c.pod_uid, owner.pod_uid);
            fill(&mut c.container_name, owner.container_name);
            match self.set_container(&alloc.id, c) {
                Ok(true) => changed += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(id = %alloc.id, error = %e, "cannot name the allocation from its owner record")
                }
            }
        }
        changed
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

    /// The node API's `Allocate`: a share of `memory` bytes and `sm_percent` carved from one of
    /// `gpus` (placed as `share_placement` says), recorded durably, its directory made. Admission
    /// counts every record on the GPU (the kubelet's too), under the store lock.
    pub fn allocate_share(&self, req: &ShareRequest, gpus: &[GpuRoom]) -> Result<Allocation, Status> {
        match &req.device {
            DeviceAsk::Share => {}
            DeviceAsk::Mig(_) | DeviceAsk::Whole(_) => return self.allocate_device(req, gpus),
        }
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
        let gpu = carve::place(gpus, |g| carve::held_in(g, loads, None), &req.gpu, ask, defaults.placement).map_err(
            |why| {
                if why.starts_with("gpu:") { Status::not_found(why) } else { Status::resource_exhausted(why) }
            },
        )?;
        let alloc = Allocation {
            id: Allocation::new_id(),
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
            }],
            claim: Some(Box::new(Claim { owner: req.owner.clone(), lease: req.lease })),
        };
        // Durable first, as the kubelet's: a crash after this finds the record and recreates the
        // directory at start.
        store.insert(&alloc).map_err(|e| internal("recording the allocation")(e.to_string()))?;
        if let Err(e) = self.dirs.create(&alloc) {
            let _ = store.remove(&alloc.id);
            return Err(internal("creating the allocation directory")(e.to_string()));
        }
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
        store.insert(&alloc).map_err(|e| internal("recording the allocation")(e.to_string()))?;
        if let Err(e) = self.dirs.create(&alloc) {
            let _ = store.remove(&alloc.id);
            return Err(internal("creating the allocation directory")(e.to_string()));
        }
        let uuids: Vec<&str> = alloc.devices.iter().map(|d| d.physical_uuid.as_str()).collect();
        tracing::info!(id = %alloc.id, resource, devices = %uuids.join(","), "devices allocated whole");
        Ok(alloc)
    }

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
            if !self.dirs.limits_path(&existing.id).exists() {
                self.dirs
                    .create(&existing)
                    .map_err(|e| internal("creating the allocation directory")(e.to_string()))?;
            }
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
        for gpu in rooms.iter().filter(|g| alloc.devices.iter().any(|d| d.physical_uuid.eq_ignore_ascii_case(&g.uuid)))
        {
            let others = carve::held_in(gpu, store.loads(), None);
            let mine = carve::held(gpu, [&alloc], None);
            if others.memory.saturating_add(mine.memory) > gpu.memory_total
                || others.strict_sm.saturating_add(mine.strict_sm) > 100
            {
                return Err(Status::resource_exhausted(format!(
                    "claim {uid}: GPU {} ({}) has {} of {} and {}% strict SM left beside its other allocations; \
                     the claim asks {} and {}%",
                    gpu.index,
                    gpu.uuid,
                    carve::size(gpu.memory_total.saturating_sub(others.memory)),
                    carve::size(gpu.memory_total),
                    100u32.saturating_sub(others.strict_sm),
                    carve::size(mine.memory),
                    mine.strict_sm
                )));
            }
        }
        // Durable first: a crash after this finds the record (and recreates the directory).
        store.insert(&alloc).map_err(|e| internal("recording the allocation")(e.to_string()))?;
        if let Err(e) = self.dirs.create(&alloc) {
            let _ = store.remove(&alloc.id);
            return Err(internal("creating the allocation directory")(e.to_string()));
        }
        tracing::info!(id = %alloc.id, claim = uid, namespace = %owner.claim.namespace, name = %owner.claim.name, "claim allocated");
        Ok(alloc)
    }

    /// NodeUnprepareResources: releases what claim `uid` owns (record, directory, region);
    /// `Ok(false)` when it owns nothing (already released).
    pub fn release_claim(&self, uid: &str) -> Result<bool, Status> {
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let ids: Vec<String> = store.list().filter(|a| claim_owned_by(a, uid)).map(|a| a.id.clone()).collect();
        for id in &ids {
            store.remove(id).map_err(|e| internal("removing the allocation")(e.to_string()))?;
            self.dirs.remove(id).map_err(|e| internal("removing the allocation directory")(e.to_string()))?;
            tracing::info!(%id, claim = uid, "claim released");
        }
        Ok(!ids.is_empty())
    }

    /// The node API's `Release`: the record, the directory and its region go; `Ok(false)` when
    /// there was no record (already released). A directory left without a record goes too.
    pub fn release(&self, id: &str) -> Result<bool, Status> {
        crate::state::record::valid_id(id).map_err(|why| Status::invalid_argument(format!("allocation_id: {why}")))?;
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let existed = store.remove(id).map_err(|e| internal("removing the allocation")(e.to_string()))?.is_some();
        self.dirs.remove(id).map_err(|e| internal("removing the allocation directory")(e.to_string()))?;
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
            return Err(Status::not_found(format!("allocation_id: no allocation {}", crate::echo::quoted(id))));
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
        let mut checked: Vec<&str> = Vec::new();
        for d in &alloc.devices {
            if checked.contains(&d.physical_uuid.as_str()) {
                continue;
            }
            checked.push(&d.physical_uuid);
            // A device held whole: no limit above its own memory (a MIG device is found among its
            // GPU's). A share's room is checked beside the others below.
            let size = || {
                gpus.iter().find_map(|g| {
                    if g.uuid.eq_ignore_ascii_case(&d.physical_uuid) {
                        return Some(g.memory_total);
                    }
                    g.mig.iter().find(|m| m.uuid.eq_ignore_ascii_case(&d.physical_uuid)).map(|m| m.memory_total)
                })
            };
            let size = if d.whole { size() } else { None };
            if let (Some(size), Some(memory)) = (size, change.memory)
                && memory > size
            {
                return Err(Status::invalid_argument(format!(
                    "memory_bytes: {} is more than device {}'s {}",
                    carve::size(memory),
                    d.physical_uuid,
                    carve::size(size)
                )));
            }
            match gpus.iter().find(|g| g.uuid.eq_ignore_ascii_case(&d.physical_uuid)) {
                Some(gpu) => {
                    let mine = carve::held(gpu, [&alloc], None);
                    let others = carve::held_in(gpu, store.loads(), Some(&current));
                    let total = carve::Held {
                        memory: others.memory.saturating_add(mine.memory),
                        strict_sm: others.strict_sm.saturating_add(mine.strict_sm),
                    };
                    if total.memory > gpu.memory_total || total.strict_sm > 100 {
                        return Err(Status::resource_exhausted(format!(
                            "GPU {} ({}) has {} of {} and {}% strict SM left beside the other allocations; \
                             allocation {id} would hold {} and {}%",
                            gpu.index,
                            gpu.uuid,
                            carve::size(gpu.memory_total.saturating_sub(others.memory)),
                            carve::size(gpu.memory_total),
                            100u32.saturating_sub(others.strict_sm),
                            carve::size(mine.memory),
                            mine.strict_sm
                        )));
                    }
                }
                None => {
                    // A MIG device (no room known here): limits may shrink, never grow.
                    let grows = alloc.devices.iter().zip(&current.devices).any(|(new, old)| {
                        new.physical_uuid == d.physical_uuid
                            && (new.memory_limit.unwrap_or(u64::MAX) > old.memory_limit.unwrap_or(u64::MAX)
                                || new.sm_percent.unwrap_or(100) > old.sm_percent.unwrap_or(100))
                    });
                    if grows {
                        return Err(Status::failed_precondition(format!(
                            "device {}: limits on it can be lowered, not raised",
                            d.physical_uuid
                        )));
                    }
                }
            }
        }
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

    /// Every device id and physical UUID some allocation holds.
    pub fn held(&self) -> BTreeSet<String> {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        store.list().flat_map(|a| &a.devices).flat_map(|d| [d.device_id.clone(), d.physical_uuid.clone()]).collect()
    }

    fn devices(&self, offer: &Offer, resource: &Resource, ids: &[String]) -> Result<Vec<AllocatedDevice>, Status> {
        let defaults = self.defaults();
        ids.iter()
            .map(|id| {
                let d = offer.device(resource, id).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "unknown device id {} for resource {}",
                        crate::echo::quoted(id),
                        resource.name
                    ))
                })?;
                let share = resource.kind == Kind::Share;
                Ok(AllocatedDevice {
                    device_id: d.id.clone(),
                    physical_uuid: d.physical_uuid.clone(),
                    memory_limit: d.memory_limit,
                    sm_percent: d.sm_percent,
                    priority: if share { defaults.priority } else { Priority::Normal },
                    compute_mode: if share { defaults.compute_mode } else { ComputeMode::Strict },
                    whole: false,
                })
            })
            .collect()
    }

    /// The kubelet's free devices that no longer fit beside what other allocations hold (a carved
    /// share, a whole GPU or a MIG device the node API gave out, a claim): `(resource, device id)`.
    /// Told to the kubelet as unhealthy, so the scheduler places no pod its `Allocate` would
    /// refuse; they come back when the room does. Only devices no record holds are withdrawn (a
    /// pod's own device never turns unhealthy under it), and as few as can be: each GPU's or MIG
    /// device's free devices are kept in order while they fit together beside what is held.
    pub fn withdrawn(&self) -> BTreeSet<(String, String)> {
        let offer = self.offer();
        let rooms = Arc::clone(&self.rooms.read().unwrap_or_else(std::sync::PoisonError::into_inner));
        // As `devices` makes the kubelet's records: a share in the default compute mode.
        let share_mode = self.defaults().compute_mode;
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // The same rule as the kubelet's Allocate (`admit_beside`), so what is withdrawn is what
        // it would refuse. Its own devices fit together by plan: only others' records withdraw
        // any. O(the offer), no scan of the records (a serverless node changes them often).
        let mut out = BTreeSet::new();
        // Per device: what is held, plus the free devices kept so far.
        let mut kept: HashMap<&str, (u64, u32)> = HashMap::new();
        for res in offer.resources.resources.values() {
            for d in res.devices.iter().filter(|d| d.healthy) {
                // A pod's (the node API's MIG records name the same id: those do not count).
                if store.kubelet_holds(&d.id, &res.name) {
                    continue;
                }
                let Some((_, _, total)) = room_of(&rooms, &d.physical_uuid) else { continue };
                let (memory, sm) = kept
                    .entry(d.physical_uuid.as_str())
                    .or_insert_with(|| store.loads().device(&d.physical_uuid).held(total));
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

    /// Told of every change to a record the kubelet did not make (what [`Self::withdrawn`]
    /// follows).
    pub fn foreign_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).foreign_changes()
    }

    /// Shares of each parent device held by stored allocations.
    fn share_load(&self, resource: &Resource) -> HashMap<String, usize> {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut load = HashMap::new();
        for alloc in store.list().filter(|a| a.resource == resource.name) {
            for d in &alloc.devices {
                *load.entry(d.physical_uuid.clone()).or_insert(0) += 1;
            }
        }
        load
    }

    fn answer(&self, resource: &Resource, alloc: &Allocation) -> ContainerAllocation {
        let mut visible: Vec<&str> = Vec::new();
        for d in &alloc.devices {
            if !visible.contains(&d.physical_uuid.as_str()) {
                visible.push(&d.physical_uuid);
            }
        }
        let visible = visible.join(",");
        // What the hook and the runtime wrapper ask the CDI specs for: the allocated devices by
        // their CDI names (a share id, a MIG or GPU UUID); NVIDIA's variable carries the UUIDs
        // CUDA sees, for tools that read it.
        let devices: Vec<&str> = alloc.devices.iter().map(|d| d.device_id.as_str()).collect();
        let envs = HashMap::from([
            ("TESSERA_VISIBLE_DEVICES".to_owned(), devices.join(",")),
            ("NVIDIA_VISIBLE_DEVICES".to_owned(), visible),
            ("TESSERA_ALLOCATION".to_owned(), alloc.id.clone()),
            ("TESSERA_LIMITS".to_owned(), format!("{CONTAINER_ALLOC_DIR}/{}", crate::state::alloc_dir::LIMITS_FILE)),
            ("TESSERA_REGION".to_owned(), format!("{CONTAINER_ALLOC_DIR}/{}", crate::state::alloc_dir::REGION_FILE)),
        ]);
        let mut answer = ContainerAllocation {
            cdi_devices: alloc
                .devices
                .iter()
                .map(|d| format!("{CDI_VENDOR}/{}={}", resource.kind.cdi_class(), d.device_id))
                .collect(),
            envs,
            // The directory read-only (the container cannot replace its limits or add files);
            // the region inside it read-write, mounted on top, as the hook and CDI do.
            mounts: vec![
                HostMount {
                    host_path: self.dirs.dir(&alloc.id).display().to_string(),
                    container_path: CONTAINER_ALLOC_DIR.to_owned(),
                    read_only: true,
                },
                HostMount {
                    host_path: self.dirs.region_path(&alloc.id).display().to_string(),
                    container_path: format!("{CONTAINER_ALLOC_DIR}/{}", crate::state::alloc_dir::REGION_FILE),
                    read_only: false,
                },
            ],
            device_specs: Vec::new(),
            annotations: HashMap::new(),
        };
        if let Some(direct) = &self.direct {
            // No CDI: the device nodes and the shim come in the answer itself.
            answer.cdi_devices.clear();
            let mut nodes: Vec<&std::path::PathBuf> = direct.control_nodes.iter().collect();
            for d in &alloc.devices {
                if let Some(rd) = resource.device(&d.device_id) {
                    nodes.extend(rd.nodes.iter().filter(|n| !nodes.contains(n)).collect::<Vec<_>>());
                }
            }
            answer.device_specs = nodes
                .into_iter()
                .map(|n| HostDevice {
                    host_path: n.display().to_string(),
                    container_path: direct.container_path(n),
                    permissions: "rw".into(),
                })
                .collect();
            if let Some(shim) = &direct.shim {
                answer.mounts.push(HostMount {
                    host_path: shim.display().to_string(),
                    container_path: tessera_hook::cdi::SHIM_CONTAINER_PATH.into(),
                    read_only: true,
                });
                answer.mounts.push(HostMount {
                    host_path: direct.preload.display().to_string(),
                    container_path: "/etc/ld.so.preload".into(),
                    read_only: true,
                });
            }
        }
        answer
    }
}

/// Where device `uuid` is: its GPU, whether it is a MIG device of it, and its memory.
fn room_of<'r>(rooms: &'r [GpuRoom], uuid: &str) -> Option<(&'r GpuRoom, bool, u64)> {
    rooms.iter().find_map(|g| {
        if g.uuid.eq_ignore_ascii_case(uuid) {
            return Some((g, false, g.memory_total));
        }
        g.mig.iter().find(|m| m.uuid.eq_ignore_ascii_case(uuid)).map(|m| (g, true, m.memory_total))
    })
}

/// Whether the kubelet's new allocation of `devices` fits beside every record on each GPU or MIG
/// device it names (a whole device counts as all of it): a MIG device the node API or a claim
/// holds would otherwise be handed out twice, as no GPU's sums cover it.
fn admit_beside(rooms: &[GpuRoom], store: &Store, devices: &[AllocatedDevice]) -> Result<(), Status> {
    let mut uuids: Vec<&str> = devices.iter().map(|d| d.physical_uuid.as_str()).collect();
    uuids.sort_unstable();
    uuids.dedup();
    for uuid in uuids {
        let Some((gpu, mig, total)) = room_of(rooms, uuid) else { continue };
        let (others_memory, others_sm) = store.loads().device(uuid).held(total);
        let (mut memory, mut sm) = (0u64, 0u32);
        for d in devices.iter().filter(|d| d.physical_uuid.eq_ignore_ascii_case(uuid)) {
            memory = memory.saturating_add(d.memory_limit.unwrap_or(total));
            if d.compute_mode == ComputeMode::Strict {
                sm = sm.saturating_add(d.sm_percent.unwrap_or(100));
            }
        }
        if others_memory.saturating_add(memory) > total || others_sm.saturating_add(sm) > 100 {
            let held_by: Vec<&str> = store
                .list()
                .filter(|a| a.source != Source::Kubelet)
                .filter(|a| a.devices.iter().any(|d| d.physical_uuid.eq_ignore_ascii_case(uuid)))
                .map(|a| a.id.as_str())
                .collect();
            let on = if mig {
                format!("MIG device {uuid} (GPU {})", gpu.index)
            } else {
                format!("GPU {} ({uuid})", gpu.index)
            };
            return Err(Status::resource_exhausted(format!(
                "{on}: {} and {}% strict SM are held (node API allocations {}); {} and {}% more do not fit",
                carve::size(others_memory),
                others_sm,
                if held_by.is_empty() { "none".to_string() } else { held_by.join(", ") },
                carve::size(memory),
                sm
            )));
        }
    }
    Ok(())
}

/// Resource `name` in `all`, or NotFound naming it.
fn resource_of<'a>(all: &'a Resources, name: &str) -> Result<&'a Resource, Status> {
    all.get(name).ok_or_else(|| Status::not_found(format!("unknown resource {name}")))
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

fn internal(what: &str) -> impl FnOnce(String) -> Status + '_ {
    move |e| Status::internal(format!("{what}: {e}"))
}

impl Allocator for DaemonAllocator {
    fn allocate(&self, resource: &str, device_ids: &[String]) -> Result<ContainerAllocation, Status> {
        // A reference into the offer, not a copy: a resource may list a thousand devices.
        let offer = self.offer();
        let res = resource_of(&offer.resources, resource)?;
        let devices = self.devices(&offer, res, device_ids)?;
        let wanted: BTreeSet<&str> = device_ids.iter().map(String::as_str).collect();
        let mut store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);

        // Only the records holding an asked-for device (the store's index, not a scan of all).
        let mut same = None;
        let mut stale = Vec::new();
        for a in store
            .holding(device_ids.iter().map(String::as_str))
            .filter(|a| a.resource == resource && a.source == Source::Kubelet)
        {
            let held: BTreeSet<&str> = a.devices.iter().map(|d| d.device_id.as_str()).collect();
            if held == wanted {
                same = Some(a.clone());
            } else {
                stale.push(a.id.clone());
            }
        }
        for id in stale {
            tracing::info!(%id, resource, "removing a stale allocation: its devices were allocated again");
            store.remove(&id).map_err(|e| internal("removing a stale allocation")(e.to_string()))?;
            if let Err(e) = self.dirs.remove(&id) {
                tracing::warn!(%id, error = %e, "cannot remove a stale allocation directory");
            }
        }

        let alloc = match same {
            Some(mut existing) => {
                // Same devices asked for again (a retry, or after a restart): the same record.
                if existing.devices != devices {
                    existing.devices = devices;
                    store.update(&existing).map_err(|e| internal("updating the allocation")(e.to_string()))?;
                    self.dirs
                        .update_limits(&existing)
                        .or_else(|_| self.dirs.create(&existing).map(|_| ()))
                        .map_err(|e| internal("writing the allocation directory")(e.to_string()))?;
                } else if !self.dirs.limits_path(&existing.id).exists() {
                    self.dirs
                        .create(&existing)
                        .map_err(|e| internal("creating the allocation directory")(e.to_string()))?;
                }
                tracing::info!(id = %existing.id, resource, "allocation reused");
                existing
            }
            None => {
                // A GPU or MIG device another allocation holds part of (a carved share, a MIG
                // device or a whole GPU the node API gave out): the kubelet's allocation must fit
                // beside it (one store, one admission rule), or it is refused saying what is held.
                let rooms = Arc::clone(&self.rooms.read().unwrap_or_else(std::sync::PoisonError::into_inner));
                admit_beside(&rooms, &store, &devices)?;
                let alloc = Allocation {
                    id: Allocation::new_id(),
                    resource: resource.to_owned(),
                    container: ContainerIdentity::default(),
                    source: Source::Kubelet,
                    created_unix_ns: unix_ns(),
                    devices,
                    claim: None,
                };
                // Durable first: a crash after this finds the record (and recreates the
                // directory); a crash before it leaves nothing, and the kubelet retries.
                store.insert(&alloc).map_err(|e| internal("recording the allocation")(e.to_string()))?;
                if let Err(e) = self.dirs.create(&alloc) {
                    let _ = store.remove(&alloc.id);
                    return Err(internal("creating the allocation directory")(e.to_string()));
                }
                tracing::info!(id = %alloc.id, resource, devices = %device_ids.join(","), "allocated");
                alloc
            }
        };
        // Under the store lock: `release_unclaimed` sees this hand-out or releases before it.
        let mut handed_out = self.handed_out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        handed_out.retain(|_, at| now.duration_since(*at) < HANDED_OUT_KEPT);
        handed_out.insert(alloc.id.clone(), now);
        drop(handed_out);
        drop(store);
        self.allocated.notify_one();
        Ok(self.answer(res, &alloc))
    }

    fn preferred(&self, resource: &str, available: &[String], must_include: &[String], size: usize) -> Vec<String> {
        let all = self.resources();
        let Some(res) = all.get(resource) else {
            return must_include.iter().chain(available).take(size.max(must_include.len())).cloned().collect();
        };
        // Each id once (a client may repeat one; the kubelet never does).
        let mut chosen: Vec<String> = Vec::with_capacity(must_include.len());
        for id in must_include {
            if !chosen.contains(id) {
                chosen.push(id.clone());
            }
        }
        let mut rest: Vec<&String> = available.iter().filter(|id| !chosen.contains(id)).collect();
        rest.sort();
        match res.kind {
            Kind::Share => {
                let mut load = self.share_load(res);
                let parent = |id: &str| res.device(id).map(|d| d.physical_uuid.clone()).unwrap_or_default();
                for id in &chosen {
                    *load.entry(parent(id)).or_insert(0) += 1;
                }
                while chosen.len() < size && !rest.is_empty() {
                    let score = |id: &str| load.get(&parent(id)).copied().unwrap_or(0);
                    let pick = match self.defaults().placement {
                        // Most loaded first; ties by id (min_by_key keeps the first).
                        Placement::Packed => (0..rest.len()).max_by_key(|&i| (score(rest[i]), usize::MAX - i)),
                        Placement::Spread => (0..rest.len()).min_by_key(|&i| (score(rest[i]), i)),
                    }
                    .expect("rest is not empty");
                    let id = rest.remove(pick);
                    *load.entry(parent(id)).or_insert(0) += 1;
                    chosen.push(id.clone());
                }
            }
            Kind::Gpu | Kind::Mig => {
                let gpu = |id: &str| res.device(id).map(|d| d.gpu_index);
                if chosen.is_empty() && size > 0 && !rest.is_empty() {
                    // Seed: the device with the most close candidates around it.
                    let closeness = |a: &str| {
                        rest.iter()
                            .filter(|b| match (gpu(a), gpu(b)) {
                                (Some(x), Some(y)) => all.distance(x, y).0 + all.distance(x, y).1 == 0,
                                _ => false,
                            })
                            .count()
                    };
                    let seed =
                        (0..rest.len()).max_by_key(|&i| (closeness(rest[i]), usize::MAX - i)).expect("non-empty");
                    chosen.push(rest.remove(seed).clone());
                }
                while chosen.len() < size && !rest.is_empty() {
                    let cost = |id: &str| {
                        chosen.iter().fold((0u32, 0u32, 0u32), |acc, c| match (gpu(id), gpu(c)) {
                            (Some(x), Some(y)) => {
                                let (n, u, p) = all.distance(x, y);
                                (acc.0 + u32::from(n), acc.1 + u32::from(u), acc.2 + u32::from(p))
                            }
                            _ => (acc.0 + 1, acc.1 + 1, acc.2 + 255),
                        })
                    };
                    let pick = (0..rest.len()).min_by_key(|&i| (cost(rest[i]), i)).expect("non-empty");
                    chosen.push(rest.remove(pick).clone());
                }
            }
        }
        chosen
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::resources::ResourceDevice;

    const SHARE: &str = "tessera.io/gpu-share";

    pub(crate) fn resources() -> Arc<Resources> {
        let mut r = Resources::default();
        let devices = ["GPU-a", "GPU-b"]
            .iter()
            .enumerate()
            .flat_map(|(g, uuid)| {
                (0..2).map(move |n| ResourceDevice {
                    id: format!("{uuid}::{n}"),
                    physical_uuid: (*uuid).to_string(),
                    gpu_index: g as u32,
                    numa_node: Some(0),
                    healthy: true,
                    memory_limit: Some(1 << 30),
                    sm_percent: Some(50),
                    nodes: vec![std::path::PathBuf::from(format!("/dev/nvidia{g}"))],
                })
            })
            .collect();
        r.resources.insert(SHARE.into(), Resource { name: SHARE.into(), kind: Kind::Share, devices });
        Arc::new(r)
    }

    pub(crate) fn allocator(dir: &std::path::Path, placement: Placement) -> DaemonAllocator {
        let mut config = Config::default();
        config.resources.share_placement = placement;
        std::fs::create_dir_all(dir.join("run")).unwrap();
        let store = Store::open(&dir.join("state")).unwrap();
        DaemonAllocator::new(&config, resources(), store, AllocDirs::new(&dir.join("run")))
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// After a journal loss, a record whose directory is gone while others' remain is kept and
    /// said (its release may have been in what was lost); its directory is made again.
    #[test]
    fn a_record_back_without_its_directory_after_a_loss_is_kept_and_said() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let x = a.allocate_share(&share(1, 10, "0"), &rooms()).unwrap();
        let y = a.allocate_share(&share(1, 10, "0"), &rooms()).unwrap();
        drop(a);
        let dirs = AllocDirs::new(&tmp.path().join("run"));
        dirs.remove(&y.id).unwrap();
        // The journal's end cut off: a loss (nothing of x or y is lost: both were put before).
        let journal = tmp.path().join("state/allocations.journal");
        let len = std::fs::metadata(&journal).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&journal).unwrap().set_len(len - 1).unwrap();
        let store = Store::open_with_dirs(&tmp.path().join("state"), &dirs).unwrap();
        assert!(store.loss().is_some());
        let a = DaemonAllocator::new(&Config::default(), resources(), store, dirs.clone());
        let (kept, log) = crate::testlog::logged(|| a.reconcile());
        assert_eq!(kept, 2);
        assert!(log.contains(&format!("allocation {} is in its records but its directory was gone", y.id)), "{log}");
        assert!(!log.contains(&format!("allocation {} is", x.id)), "{log}");
        assert!(dirs.limits_path(&y.id).exists(), "kept, its directory made again");
    }

    /// The offer's index finds each device as a scan of the resource does (the first of an id),
    /// nothing for an unknown id or one of another resource, and follows a new offer.
    #[test]
    fn the_offer_finds_devices_as_a_scan_does_and_follows_a_new_offer() {
        let mut r = (*resources()).clone();
        let res = r.resources.get_mut(SHARE).unwrap();
        let mut twin = res.devices[1].clone();
        twin.sm_percent = Some(7);
        res.devices.push(twin);
        let offer = Offer::of(Arc::new(r));
        let res = &offer.resources.resources[SHARE];
        for d in &res.devices {
            assert_eq!(offer.device(res, &d.id), res.device(&d.id), "{}", d.id);
        }
        assert_eq!(offer.device(res, "GPU-a::1").unwrap().sm_percent, Some(50), "the first of an id");
        assert!(offer.device(res, "GPU-c::0").is_none());
        let other = Resource { name: "other".into(), kind: Kind::Share, devices: Vec::new() };
        assert!(offer.device(&other, "GPU-a::0").is_none());

        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let e = a.allocate(SHARE, &ids(&["GPU-c::0"])).unwrap_err();
        assert!(e.message().contains("unknown device id \"GPU-c::0\""), "{e:?}");
        let mut more = (*resources()).clone();
        let mut c = more.resources[SHARE].devices[0].clone();
        c.id = "GPU-c::0".into();
        more.resources.get_mut(SHARE).unwrap().devices.push(c);
        a.set_resources(Arc::new(more));
        a.allocate(SHARE, &ids(&["GPU-c::0"])).unwrap();
    }

    /// A device allocated again to another container replaces the record that held it (found
    /// through the store's index of holders), and the same devices again reuse the record.
    #[test]
    fn a_device_allocated_again_replaces_its_stale_record_and_the_same_ask_reuses() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let first = a.allocate(SHARE, &ids(&["GPU-a::0", "GPU-b::0"])).unwrap();
        let again = a.allocate(SHARE, &ids(&["GPU-b::0", "GPU-a::0"])).unwrap();
        let id = |c: &ContainerAllocation| c.envs["TESSERA_ALLOCATION"].clone();
        assert_eq!(id(&first), id(&again), "the same record");
        let other = a.allocate(SHARE, &ids(&["GPU-b::1"])).unwrap();
        let store = a.store.lock().unwrap();
        assert_eq!(store.list().count(), 2);
        drop(store);
        // GPU-a::0 to a new container: the record holding it (with GPU-b::0) goes.
        let replaced = a.allocate(SHARE, &ids(&["GPU-a::0"])).unwrap();
        let store = a.store.lock().unwrap();
        let held: Vec<Vec<&str>> =
            store.list().map(|r| r.devices.iter().map(|d| d.device_id.as_str()).collect()).collect();
        assert_eq!(held.len(), 2, "{held:?}");
        assert!(held.contains(&vec!["GPU-a::0"]) && held.contains(&vec!["GPU-b::1"]), "{held:?}");
        assert_ne!(id(&replaced), id(&first));
        assert_eq!(store.holding(["GPU-b::0"]).count(), 0);
        drop(store);
        drop(other);
    }

    #[test]
    fn shares_are_packed_or_spread() {
        let tmp = crate::state::mount::TestDir::new();
        let all = ids(&["GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-b::1"]);
        let packed = allocator(tmp.path(), Placement::Packed);
        packed.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap();
        let free = ids(&["GPU-a::0", "GPU-a::1", "GPU-b::1"]);
        assert_eq!(packed.preferred(SHARE, &free, &[], 1), ["GPU-b::1"]);
        drop(packed);
        let tmp = crate::state::mount::TestDir::new();
        let spread = allocator(tmp.path(), Placement::Spread);
        assert_eq!(spread.preferred(SHARE, &all, &ids(&["GPU-a::0"]), 2), ["GPU-a::0", "GPU-b::0"]);
        // A must-include id repeated is named once.
        assert_eq!(spread.preferred(SHARE, &all, &ids(&["GPU-a::0", "GPU-a::0"]), 2), ["GPU-a::0", "GPU-b::0"]);
    }

    #[test]
    fn without_cdi_the_answer_carries_nodes_and_the_shim() {
        let tmp = crate::state::mount::TestDir::new();
        let dev = tmp.path().join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("nvidiactl"), "").unwrap();
        let mut config = Config::default();
        config.injection.cdi_spec_dir = std::path::PathBuf::new();
        config.injection.dev_root = dev.clone();
        config.injection.shim_path = "/opt/tessera/libtessera.so".into();
        config.runtime_dir = tmp.path().join("run");
        std::fs::create_dir_all(&config.runtime_dir).unwrap();
        let mut res = (*resources()).clone();
        for d in res.resources.values_mut().flat_map(|r| &mut r.devices) {
            d.nodes = vec![dev.join(format!("nvidia{}", d.gpu_index))];
        }
        let store = Store::open(&tmp.path().join("state")).unwrap();
        let a = DaemonAllocator::new(&config, Arc::new(res), store, AllocDirs::new(&config.runtime_dir));
        let answer = a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap();
        assert!(answer.cdi_devices.is_empty(), "no CDI names for a runtime without CDI");
        let specs: Vec<(String, &str, &str)> = answer
            .device_specs
            .iter()
            .map(|d| (d.host_path.clone(), d.container_path.as_str(), d.permissions.as_str()))
            .collect();
        let host = |n: &str| dev.join(n).display().to_string();
        assert_eq!(specs, [(host("nvidiactl"), "/dev/nvidiactl", "rw"), (host("nvidia1"), "/dev/nvidia1", "rw")]);
        let mounts: Vec<(&str, &str, bool)> =
            answer.mounts.iter().map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only)).collect();
        let preload = config.runtime_dir.join("ld.so.preload");
        // The allocation directory read-only, its region read-write on top.
        let dir = a.dirs.dir(&answer.envs["TESSERA_ALLOCATION"]);
        assert_eq!(
            mounts[..2],
            [
                (dir.to_str().unwrap(), "/run/tessera/alloc", true),
                (dir.join("region").to_str().unwrap(), "/run/tessera/alloc/region", false),
            ]
        );
        assert_eq!(
            mounts[2..],
            [
                ("/opt/tessera/libtessera.so", "/usr/lib/tessera/libtessera.so", true),
                (preload.to_str().unwrap(), "/etc/ld.so.preload", true),
            ]
        );
        assert_eq!(std::fs::read_to_string(&preload).unwrap(), "/usr/lib/tessera/libtessera.so\n");
        // With CDI (the default), the names alone.
        let b = allocator(&tmp.path().join("cdi"), Placement::Packed);
        let answer = b.allocate(SHARE, &ids(&["GPU-a::0"])).unwrap();
        assert_eq!(answer.cdi_devices, ["tessera.io/share=GPU-a::0"]);
        assert!(answer.device_specs.is_empty());
    }

    #[test]
    fn allocate_records_reuses_and_drops_stale() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let first = a.allocate(SHARE, &ids(&["GPU-a::0", "GPU-a::1"])).unwrap();
        let id = first.envs["TESSERA_ALLOCATION"].clone();
        let limits = tessera_region::Limits::load(&tmp.path().join("run/alloc").join(&id).join("limits")).unwrap();
        assert_eq!(limits.devices[0].memory_limit, Some(2 << 30), "two shares of one GPU add up");
        assert_eq!(limits.devices[0].sm_percent, Some(100));
        assert_eq!(first.envs["TESSERA_VISIBLE_DEVICES"], "GPU-a::0,GPU-a::1");
        assert_eq!(first.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
        // Same set, any order: the same record.
        let again = a.allocate(SHARE, &ids(&["GPU-a::1", "GPU-a::0"])).unwrap();
        assert_eq!(again.envs["TESSERA_ALLOCATION"], id);
        assert_eq!(a.allocations().len(), 1);
        // A request overlapping it: the old record is stale and goes with its directory.
        let other = a.allocate(SHARE, &ids(&["GPU-a::1"])).unwrap();
        assert_ne!(other.envs["TESSERA_ALLOCATION"], id);
        assert_eq!(a.allocations().len(), 1);
        assert!(!tmp.path().join("run/alloc").join(&id).exists());
        assert!(a.allocate(SHARE, &ids(&["GPU-z::0"])).is_err());
    }

    pub(crate) fn rooms() -> Vec<GpuRoom> {
        ["GPU-a", "GPU-b"]
            .iter()
            .enumerate()
            .map(|(i, uuid)| GpuRoom {
                index: i as u32,
                uuid: (*uuid).into(),
                model: "NVIDIA H100".into(),
                memory_total: 4 << 30,
                unavailable: None,
                mig_mode: false,
                mig: Vec::new(),
                mig_profiles: Vec::new(),
                nodes: Vec::new(),
            })
            .collect()
    }

    pub(crate) fn share(gib: u64, sm: u32, gpu: &str) -> ShareRequest {
        ShareRequest {
            device: DeviceAsk::Share,
            memory: gib << 30,
            sm_percent: sm,
            priority: None,
            compute_mode: Some(ComputeMode::Strict),
            gpu: gpu.into(),
            owner: Some("fn-a".into()),
            lease: Lease::None,
        }
    }

    /// The kubelet's fixed shares and the node API's carved ones come out of the same room.
    #[test]
    fn carved_shares_count_the_kubelets_and_never_overcommit() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        // The kubelet holds two 1 GiB, 50% shares of GPU-a: 2 GiB and 100% SM.
        a.allocate(SHARE, &ids(&["GPU-a::0", "GPU-a::1"])).unwrap();
        let err = a.allocate_share(&share(1, 10, "0"), &rooms()).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("GPU 0 (GPU-a): 2 GiB of 4 GiB free, 0% SM free"), "{}", err.message());
        // Packed: GPU-b is the only one with SM left; filled to its memory, then refused.
        let first = a.allocate_share(&share(3, 60, ""), &rooms()).unwrap();
        assert_eq!(first.devices[0].physical_uuid, "GPU-b");
        assert_eq!(first.source, Source::NodeApi);
        assert_eq!(first.claim.as_ref().unwrap().owner.as_deref(), Some("fn-a"));
        let err = a.allocate_share(&share(2, 10, ""), &rooms()).unwrap_err();
        assert!(err.message().contains("GPU 1 (GPU-b): 1 GiB of 4 GiB free, 40% SM free"), "{}", err.message());
        let second = a.allocate_share(&share(1, 40, ""), &rooms()).unwrap();
        assert_eq!(second.devices[0].physical_uuid, "GPU-b");
        // The record is durable and its limits file says what was asked.
        let limits = tessera_region::Limits::load(&a.dirs.limits_path(&second.id)).unwrap();
        assert_eq!((limits.devices[0].memory_limit, limits.devices[0].sm_percent), (Some(1 << 30), Some(40)));
        // Bad requests name the field.
        assert!(a.allocate_share(&share(0, 10, ""), &rooms()).unwrap_err().message().starts_with("memory_bytes"));
        assert!(a.allocate_share(&share(1, 101, ""), &rooms()).unwrap_err().message().starts_with("sm_percent"));
        let err = a.allocate_share(&share(1, 1, "GPU-zz"), &rooms()).unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound);
        // The other way round: the kubelet's share of GPU-b does not fit beside the carved ones
        // (4 GiB of 4 GiB held), and is refused naming them.
        a.set_rooms(rooms());
        let err = a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains(&first.id) && err.message().contains("4 GiB"), "{}", err.message());
        // Once the larger one is released it fits (1 GiB + 40% held, 1 GiB + 50% asked), and the
        // kubelet's stale-record rule leaves the carved share beside it alone.
        a.release(&first.id).unwrap();
        a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap();
        assert!(a.allocations().iter().any(|r| r.id == second.id));
    }

    /// GPU 2, an A100 in MIG mode with a 3g.20gb device of each UUID in `slots`.
    fn mig_room(slots: &[&str]) -> GpuRoom {
        let slot = |uuid: &&str| carve::MigSlot {
            uuid: (*uuid).into(),
            profile: "3g.20gb".into(),
            memory_total: 20 << 30,
            unavailable: None,
        };
        GpuRoom {
            index: 2,
            uuid: "GPU-m".into(),
            model: "NVIDIA A100".into(),
            memory_total: 40 << 30,
            unavailable: None,
            mig_mode: true,
            mig: slots.iter().map(slot).collect(),
            mig_profiles: vec!["3g.20gb".into(), "7g.40gb".into()],
            nodes: Vec::new(),
        }
    }

    /// Whole GPUs are exclusive both ways; a MIG device goes to one allocation at a time.
    #[test]
    fn whole_gpus_and_mig_devices_through_allocate() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let mut gpus = rooms();
        gpus.push(mig_room(&["MIG-m0"]));
        let ask = |device: DeviceAsk| ShareRequest {
            device,
            memory: 0,
            sm_percent: 0,
            compute_mode: None,
            ..share(0, 0, "")
        };
        let share_a = a.allocate_share(&share(1, 10, "0"), &gpus).unwrap();
        // GPU-a has a share: the one whole GPU is GPU-b; a second is refused naming the share.
        let whole = a.allocate_share(&ask(DeviceAsk::Whole(1)), &gpus).unwrap();
        assert_eq!((whole.resource.as_str(), whole.devices[0].physical_uuid.as_str()), (WHOLE_RESOURCE, "GPU-b"));
        assert_eq!((whole.devices[0].memory_limit, whole.devices[0].sm_percent), (None, None));
        let err = a.allocate_share(&ask(DeviceAsk::Whole(1)), &gpus).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains(&format!("GPU 0 (GPU-a): held by {}", share_a.id)), "{}", err.message());
        assert!(err.message().contains("GPU 2 (GPU-m): MIG mode is on"), "{}", err.message());
        // Nothing is carved from the GPU held whole.
        let err = a.allocate_share(&share(1, 1, "1"), &gpus).unwrap_err();
        assert!(err.message().contains("0 MiB of 4 GiB free, 0% SM free"), "{}", err.message());
        // Its limits lowered, it is still held whole: they bind its container, and nothing is
        // carved beside it (it was: the record read as a 1 GiB / 10% share). Never above the GPU.
        let lower = LimitChange { memory: Some(1 << 30), sm_percent: Some(10), ..Default::default() };
        let lowered = a.set_limits(&whole.id, lower, &gpus).unwrap();
        assert!(lowered.devices[0].whole && lowered.devices[0].is_whole());
        let err = a.allocate_share(&share(1, 1, "1"), &gpus).unwrap_err();
        assert!(err.message().contains("0 MiB of 4 GiB free, 0% SM free"), "{}", err.message());
        let err = a.set_limits(&whole.id, LimitChange { memory: Some(5 << 30), ..Default::default() }, &gpus);
        assert_eq!(err.unwrap_err().code(), tonic::Code::InvalidArgument);
        // The MIG device, once; its limits file names it.
        let mig = a.allocate_share(&ask(DeviceAsk::Mig("3g.20gb".into())), &gpus).unwrap();
        assert_eq!((mig.resource.as_str(), mig.devices[0].device_id.as_str()), (MIG_RESOURCE, "MIG-m0"));
        let limits = tessera_region::Limits::load(&a.dirs.limits_path(&mig.id)).unwrap();
        assert_eq!(limits.devices[0].uuid, "MIG-m0");
        let err = a.allocate_share(&ask(DeviceAsk::Mig("3g.20gb".into())), &gpus).unwrap_err();
        assert!(err.message().contains(&format!("MIG-m0 held by {}", mig.id)), "{}", err.message());
        // A MIG device's limit: lowered, never above the device (10 TiB on 20 GiB was taken).
        let err = a.set_limits(&mig.id, LimitChange { memory: Some(10 << 40), ..Default::default() }, &gpus);
        let err = err.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("more than device MIG-m0's 20 GiB"), "{}", err.message());
        let lowered = a.set_limits(&mig.id, LimitChange { memory: Some(8 << 30), ..Default::default() }, &gpus);
        assert!(lowered.unwrap().devices[0].whole);
        let err = a.allocate_share(&ask(DeviceAsk::Mig("7g.80gb".into())), &gpus).unwrap_err();
        assert!(err.message().contains("GPU 2 (GPU-m): no 7g.80gb instance"), "{}", err.message());
        // Bad requests name the field.
        let err = a.allocate_share(&ShareRequest { memory: 1 << 30, ..ask(DeviceAsk::Whole(1)) }, &gpus).unwrap_err();
        assert!(err.message().starts_with("memory_bytes, sm_percent"), "{}", err.message());
        assert!(a.allocate_share(&ask(DeviceAsk::Whole(0)), &gpus).unwrap_err().message().starts_with("whole_gpus"));
        // Released, the GPU can be carved again and given whole to the next.
        a.release(&whole.id).unwrap();
        a.release(&mig.id).unwrap();
        assert_eq!(
            a.allocate_share(&ask(DeviceAsk::Mig("3g.20gb".into())), &gpus).unwrap().devices[0].device_id,
            "MIG-m0"
        );
        assert_eq!(a.allocate_share(&share(4, 100, "1"), &gpus).unwrap().devices[0].physical_uuid, "GPU-b");
    }

    /// The kubelet's free devices that would be refused beside the node API's carved shares are
    /// withdrawn, exactly those and as few as can be; a pod's own device never is; released, they
    /// come back. Only the node API's changes are told.
    #[test]
    fn free_kubelet_devices_that_no_longer_fit_are_withdrawn_until_the_room_is_back() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        a.set_rooms(rooms());
        let mut told = a.foreign_changes();
        let pair = |id: &str| (SHARE.to_string(), id.to_string());
        assert!(a.withdrawn().is_empty());
        // The kubelet's own allocations fit together by plan: nothing withdrawn, nobody told.
        a.allocate(SHARE, &ids(&["GPU-a::0"])).unwrap();
        assert!(a.withdrawn().is_empty());
        assert!(!told.has_changed().unwrap());

        // 1 GiB and 10% carved from GPU-a: beside the pod's share (50%) the other (50%) no longer
        // fits; the pod's own stays.
        let carved = a.allocate_share(&share(1, 10, "0"), &rooms()).unwrap();
        assert!(told.has_changed().unwrap());
        told.mark_unchanged();
        assert_eq!(a.withdrawn(), BTreeSet::from([pair("GPU-a::1")]));
        // 3 GiB and 1% from GPU-b: one of its two 1 GiB shares still fits, the second does not.
        let big = a.allocate_share(&share(3, 1, "1"), &rooms()).unwrap();
        assert_eq!(a.withdrawn(), BTreeSet::from([pair("GPU-a::1"), pair("GPU-b::1")]));
        // The kept ones can all be allocated; then the withdrawn one would be refused.
        a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap();
        assert_eq!(a.withdrawn(), BTreeSet::from([pair("GPU-a::1"), pair("GPU-b::1")]));
        assert_eq!(a.allocate(SHARE, &ids(&["GPU-b::1"])).unwrap_err().code(), tonic::Code::ResourceExhausted);
        assert_eq!(a.allocate(SHARE, &ids(&["GPU-a::1"])).unwrap_err().code(), tonic::Code::ResourceExhausted);

        // Released, the room is back.
        a.release(&carved.id).unwrap();
        assert!(told.has_changed().unwrap());
        assert_eq!(a.withdrawn(), BTreeSet::from([pair("GPU-b::1")]));
        a.release(&big.id).unwrap();
        assert!(a.withdrawn().is_empty());
    }

    /// A MIG device the node API holds is not handed to the kubelet too, nor a share of it, and
    /// the other way round; released, it goes to whoever asks next.
    #[test]
    fn a_mig_device_goes_to_the_node_api_or_the_kubelet_never_both() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let mut gpus = rooms();
        gpus.push(mig_room(&["MIG-m0", "MIG-m1"]));
        a.set_rooms(gpus.clone());
        // The kubelet is offered MIG-m0 whole, and MIG-m1 as two shares.
        let device = |id: &str, uuid: &str, memory: Option<u64>, sm: Option<u32>| ResourceDevice {
            id: id.into(),
            physical_uuid: uuid.into(),
            gpu_index: 2,
            numa_node: None,
            healthy: true,
            memory_limit: memory,
            sm_percent: sm,
            nodes: Vec::new(),
        };
        let (mig, mig_share) = ("tessera.io/mig-3g.20gb", "tessera.io/mig-3g.20gb-share");
        let mut offer = (*resources()).clone();
        offer.resources.insert(
            mig.into(),
            Resource { name: mig.into(), kind: Kind::Mig, devices: vec![device("MIG-m0", "MIG-m0", None, None)] },
        );
        let halves = ["MIG-m1::0", "MIG-m1::1"].map(|id| device(id, "MIG-m1", Some(10 << 30), Some(50)));
        offer
            .resources
            .insert(mig_share.into(), Resource { name: mig_share.into(), kind: Kind::Share, devices: halves.to_vec() });
        a.set_resources(Arc::new(offer));
        let ask = ShareRequest {
            device: DeviceAsk::Mig("3g.20gb".into()),
            memory: 0,
            sm_percent: 0,
            compute_mode: None,
            ..share(0, 0, "")
        };

        // The node API takes MIG-m0 first: the kubelet's Allocate of it is refused, naming it.
        let carved = a.allocate_share(&ask, &gpus).unwrap();
        assert_eq!(carved.devices[0].physical_uuid, "MIG-m0");
        let err = a.allocate(mig, &ids(&["MIG-m0"])).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(
            err.message().starts_with("MIG device MIG-m0 (GPU 2): 20 GiB and 100% strict SM are held"),
            "{}",
            err.message()
        );
        assert!(err.message().contains(&carved.id), "{}", err.message());
        // The kubelet holds a share of MIG-m1: the node API's next MIG device is not MIG-m1.
        a.allocate(mig_share, &ids(&["MIG-m1::0"])).unwrap();
        let err = a.allocate_share(&ask, &gpus).unwrap_err();
        assert!(err.message().contains("MIG-m1 held by"), "{}", err.message());
        // The other share of MIG-m1 fits beside the first.
        a.allocate(mig_share, &ids(&["MIG-m1::1"])).unwrap();
        // Released by the node API, MIG-m0 goes to the kubelet; then not back to the node API.
        a.release(&carved.id).unwrap();
        a.allocate(mig, &ids(&["MIG-m0"])).unwrap();
        let err = a.allocate_share(&ask, &gpus).unwrap_err();
        assert!(err.message().contains("MIG-m0 held by"), "{}", err.message());
        assert_eq!(a.allocations().len(), 3);
    }

    /// Eight threads carve, change and release shares of two GPUs at once, until both are full:
    /// no GPU is ever over-admitted (memory or strict SM), the store's per-GPU sums stay what its
    /// records add up to, and after a restart admission still sees every record.
    #[test]
    fn concurrent_allocates_never_over_admit_a_gpu() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Spread);
        let gpus = rooms();
        let check = |a: &DaemonAllocator| {
            let store = a.store.lock().unwrap();
            assert_eq!(
                store.loads(),
                &crate::state::load::Loads::of(store.list()),
                "sums out of step with the records"
            );
            for g in &gpus {
                let h = carve::held(g, store.list(), None);
                assert!(h.memory <= g.memory_total && h.strict_sm <= 100, "{} over-admitted: {h:?}", g.uuid);
            }
        };
        std::thread::scope(|scope| {
            for t in 0..8u64 {
                let (a, gpus) = (&a, &gpus);
                scope.spawn(move || {
                    let mut mine = Vec::new();
                    let mut refused = 0;
                    for i in 0..60u64 {
                        let req = ShareRequest {
                            memory: [256 << 20, 512 << 20, 1 << 30][((t + i) % 3) as usize],
                            sm_percent: [10, 15, 30][((t * 7 + i) % 3) as usize],
                            compute_mode: Some(if i % 4 == 0 {
                                ComputeMode::WorkConserving
                            } else {
                                ComputeMode::Strict
                            }),
                            ..share(1, 10, "")
                        };
                        match a.allocate_share(&req, gpus) {
                            Ok(alloc) => mine.push(alloc.id),
                            Err(e) => {
                                assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{}", e.message());
                                refused += 1;
                            }
                        }
                        if i % 5 == 4 && !mine.is_empty() {
                            assert!(a.release(&mine.remove(0)).unwrap());
                        }
                        if i % 7 == 6
                            && let Some(id) = mine.last()
                        {
                            let grow = LimitChange { memory: Some(768 << 20), sm_percent: Some(20), priority: None };
                            if let Err(e) = a.set_limits(id, grow, gpus) {
                                assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{}", e.message());
                            }
                        }
                    }
                    assert!(refused > 0, "thread {t}: the GPUs never filled up, so nothing was tested");
                });
            }
        });
        check(&a);
        let held: Vec<carve::Held> = {
            let store = a.store.lock().unwrap();
            gpus.iter().map(|g| carve::held(g, store.list(), None)).collect()
        };
        // After a restart the sums come from the journal's records alone.
        drop(a);
        let a = allocator(tmp.path(), Placement::Spread);
        check(&a);
        let store = a.store.lock().unwrap();
        for (g, before) in gpus.iter().zip(&held) {
            assert_eq!(carve::held_in(g, store.loads(), None), *before, "{} after a restart", g.uuid);
        }
        drop(store);
        // Full GPUs stay full: a share bigger than what is left anywhere is refused.
        let free = gpus.iter().zip(&held).map(|(g, h)| g.memory_total - h.memory).max().unwrap();
        let too_big = ShareRequest { memory: free + 1, sm_percent: 1, ..share(1, 1, "") };
        assert_eq!(a.allocate_share(&too_big, &gpus).unwrap_err().code(), tonic::Code::ResourceExhausted);
    }

    #[test]
    fn release_is_idempotent_and_takes_the_directory() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let x = a.allocate_share(&share(1, 10, ""), &rooms()).unwrap();
        assert!(a.dirs.dir(&x.id).is_dir());
        assert!(a.release(&x.id).unwrap());
        assert!(!a.dirs.dir(&x.id).exists());
        assert!(a.allocations().is_empty());
        assert!(!a.release(&x.id).unwrap(), "a second release succeeds, saying it was gone");
        assert_eq!(a.release("../etc").unwrap_err().code(), tonic::Code::InvalidArgument);
        // The room is back.
        a.allocate_share(&share(4, 100, "0"), &rooms()).unwrap();
    }

    #[test]
    fn set_limits_rewrites_the_record_and_the_file_within_the_room() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let x = a.allocate_share(&share(1, 30, "0"), &rooms()).unwrap();
        let y = a.allocate_share(&share(2, 50, "0"), &rooms()).unwrap();
        let region = tessera_region::Region::open_or_create(&a.dirs.region_path(&x.id)).unwrap();
        let g0 = region.config_generation();
        let change = LimitChange { memory: Some(2 << 30), sm_percent: Some(50), priority: Some(Priority::High) };
        let got = a.set_limits(&x.id, change, &rooms()).unwrap();
        assert_eq!(got.devices[0].memory_limit, Some(2 << 30));
        assert_eq!(a.allocations().iter().find(|r| r.id == x.id).unwrap(), &got, "the record changed");
        let limits = tessera_region::Limits::load(&a.dirs.limits_path(&x.id)).unwrap();
        assert_eq!((limits.devices[0].memory_limit, limits.devices[0].sm_percent), (Some(2 << 30), Some(50)));
        assert_eq!(limits.priority, Priority::High);
        assert_eq!(region.config_generation(), g0 + 1, "running shims are told");
        // Past the room (y holds 2 GiB and 50%): refused, nothing changed.
        let err = a.set_limits(&x.id, LimitChange { memory: Some(3 << 30), ..Default::default() }, &rooms());
        let err = err.unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("has 2 GiB of 4 GiB and 50% strict SM left"), "{}", err.message());
        let err = a.set_limits(&y.id, LimitChange { sm_percent: Some(51), ..Default::default() }, &rooms());
        assert_eq!(err.unwrap_err().code(), tonic::Code::ResourceExhausted);
        assert_eq!(region.config_generation(), g0 + 1);
        assert_eq!(a.set_limits("nope", change, &rooms()).unwrap_err().code(), tonic::Code::NotFound);
        // Lowering below what is in use is allowed (the shim refuses new allocations past it).
        a.set_limits(&x.id, LimitChange { memory: Some(1 << 20), ..Default::default() }, &rooms()).unwrap();
        // The limits file cannot be written (a directory in its place): refused, and the record
        // stays as the file says (it kept the new terms, which the daemon then enforced alone).
        let before = a.allocations().into_iter().find(|r| r.id == x.id).unwrap();
        let limits = a.dirs.limits_path(&x.id);
        std::fs::remove_file(&limits).unwrap();
        std::fs::create_dir_all(limits.join("x")).unwrap();
        let err = a.set_limits(&x.id, LimitChange { memory: Some(2 << 20), ..Default::default() }, &rooms());
        assert_eq!(err.unwrap_err().code(), tonic::Code::Internal);
        assert_eq!(a.allocations().into_iter().find(|r| r.id == x.id).unwrap(), before);
    }

    fn claim(uid: &str, pods: &[(&str, &str)]) -> ClaimOwner {
        ClaimOwner {
            claim: crate::dra::ClaimRef { namespace: "ml".into(), uid: uid.into(), name: format!("claim-{uid}") },
            pods: pods.iter().map(|(n, u)| ((*n).to_owned(), (*u).to_owned())).collect(),
        }
    }

    fn on(gpu: &str, memory: Option<u64>, sm: Option<u32>) -> AllocatedDevice {
        AllocatedDevice {
            device_id: gpu.into(),
            physical_uuid: gpu.into(),
            memory_limit: memory,
            sm_percent: sm,
            priority: Priority::Normal,
            compute_mode: ComputeMode::Strict,
            whole: false,
        }
    }

    #[test]
    fn a_claim_owns_one_record_with_its_consumed_capacity() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        a.set_rooms(rooms());
        let first = a.allocate_claim(&claim("uid-1", &[("p", "pod-1")]), vec![on("GPU-a", Some(1 << 30), Some(30))]);
        let first = first.unwrap();
        assert_eq!((first.resource.as_str(), first.source), (DRA_RESOURCE, Source::NodeApi));
        assert_eq!(first.claim.as_ref().unwrap().owner.as_deref(), Some("uid-1"));
        assert_eq!(first.container.pod_namespace.as_deref(), Some("ml"));
        assert_eq!(
            (first.container.pod_name.as_deref(), first.container.pod_uid.as_deref()),
            (Some("p"), Some("pod-1"))
        );
        let limits = tessera_region::Limits::load(&a.dirs.limits_path(&first.id)).unwrap();
        assert_eq!((limits.devices[0].memory_limit, limits.devices[0].sm_percent), (Some(1 << 30), Some(30)));
        // Prepared again (other devices even: a hostile retry): the same record, nothing added.
        let again = a.allocate_claim(&claim("uid-1", &[]), vec![on("GPU-a", Some(3 << 30), Some(70))]).unwrap();
        assert_eq!(again, first);
        assert_eq!(a.allocations().len(), 1);
        // A directory lost (a reboot cleared the runtime dir) comes back on the next prepare.
        a.dirs.remove(&first.id).unwrap();
        a.allocate_claim(&claim("uid-1", &[]), Vec::new()).unwrap();
        assert!(a.dirs.limits_path(&first.id).exists());
        assert!(a.release_claim("uid-1").unwrap());
        assert!(!a.dirs.dir(&first.id).exists());
        assert!(!a.release_claim("uid-1").unwrap(), "a second unprepare succeeds, saying it was gone");
        assert!(a.allocations().is_empty());
    }

    #[test]
    fn claims_are_admitted_beside_every_other_record_and_survive_a_restart() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        a.set_rooms(rooms());
        // A carved share holds 2 GiB and 50% of GPU-a (4 GiB).
        a.allocate_share(&share(2, 50, "0"), &rooms()).unwrap();
        let err = a.allocate_claim(&claim("big", &[]), vec![on("GPU-a", Some(3 << 30), Some(10))]).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("GPU 0 (GPU-a) has 2 GiB of 4 GiB and 50% strict SM left"), "{}", err.message());
        let err = a.allocate_claim(&claim("busy", &[]), vec![on("GPU-a", Some(1 << 30), Some(51))]).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        // A whole GPU asks all of it: refused where anything is held, granted where nothing is.
        assert!(a.allocate_claim(&claim("whole-a", &[]), vec![on("GPU-a", None, None)]).is_err());
        let whole = a.allocate_claim(&claim("whole-b", &[]), vec![on("GPU-b", None, None)]).unwrap();
        // The kubelet's share of GPU-b no longer fits either: one store, one rule.
        assert_eq!(a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap_err().code(), tonic::Code::ResourceExhausted);
        let fits = a.allocate_claim(&claim("fits", &[]), vec![on("GPU-a", Some(2 << 30), Some(50))]).unwrap();
        // Refused claims left nothing behind.
        assert_eq!(a.allocations().len(), 3);
        assert!(a.allocate_claim(&claim("", &[]), vec![on("GPU-a", None, None)]).is_err());
        // A new process over the same state: the claims' records are found, not made again.
        drop(a);
        let b = allocator(tmp.path(), Placement::Packed);
        b.set_rooms(rooms());
        assert_eq!(b.allocate_claim(&claim("fits", &[]), Vec::new()).unwrap(), fits);
        assert_eq!(b.allocate_claim(&claim("whole-b", &[]), Vec::new()).unwrap(), whole);
        assert_eq!(b.allocations().len(), 3);
        // Through the trait the DRA driver uses.
        let dra: &dyn ClaimAllocations = &b;
        assert!(dra.release_claim("fits").unwrap());
        assert!(!dra.release_claim("fits").unwrap());
        assert!(
            dra.allocate_claim(&claim("x", &[]), vec![on("GPU-a", Some(3 << 30), Some(40))])
                .unwrap_err()
                .contains("left")
        );
    }
}
