//! The kubelet's way in: the device plugin's `Allocate` (a stored record of the same resource
//! with the same device set is reused, never duplicated; one that shares some but not all
//! devices is stale and goes with its directory) and `GetPreferredAllocation`, and the answer
//! the kubelet hands the runtime (CDI names, or without CDI the device nodes and the shim). The
//! device-plugin face calls it through [`Allocator`], defined here with its answer types.
//!
//! The kubelet's `Allocate` does not say which pod it is for, and the kubelet may ask again for
//! the same devices (after a daemon restart, or a retried call): a record that shares some but
//! not all devices with a new request is stale (the kubelet hands a device to one container at a
//! time, so its container is gone).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use tessera_region::{ComputeMode, Priority};
use tonic::Status;

use super::admission::admit_beside;
use super::{CONTAINER_ALLOC_DIR, DaemonAllocator, internal};
use crate::config::{Config, Placement};
use crate::resources::{CDI_VENDOR, Kind, Resource, Resources};
use crate::state::{AllocatedDevice, Allocation, ContainerIdentity, Source, Store, record::unix_ns};

/// The answer's variable naming the allocation (also how the kubelet's kept copy of an answer
/// is known as ours: `super::kubelet_grants`).
pub const ALLOCATION_ENV: &str = "TESSERA_ALLOCATION";

/// A host path mounted into the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMount {
    pub host_path: String,
    pub container_path: String,
    pub read_only: bool,
}

/// A device node made available to the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDevice {
    pub host_path: String,
    pub container_path: String,
    /// cgroup permissions: some of `r`, `w`, `m`.
    pub permissions: String,
}

/// What one container gets for the devices it was allocated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerAllocation {
    /// Fully qualified CDI device names (`vendor/class=name`).
    pub cdi_devices: Vec<String>,
    pub envs: HashMap<String, String>,
    pub mounts: Vec<HostMount>,
    pub device_specs: Vec<HostDevice>,
    pub annotations: HashMap<String, String>,
}

/// The daemon's decisions behind the plugin. Calls may block briefly (state on disk): `allocate`
/// runs on the handler's thread (`crate::blocking`), the plugin set's own.
pub trait Allocator: Send + Sync {
    /// Allocate `device_ids` (known and healthy, checked by the plugin) of `resource` to one
    /// container.
    fn allocate(&self, resource: &str, device_ids: &[String]) -> Result<ContainerAllocation, Status>;

    /// The devices to prefer for one container: `size` ids out of `available`, including every
    /// id in `must_include`.
    fn preferred(&self, resource: &str, available: &[String], must_include: &[String], size: usize) -> Vec<String>;
}

/// How long [`DaemonAllocator::handed_out`] remembers a hand-out.
const HANDED_OUT_KEPT: std::time::Duration = std::time::Duration::from_secs(3600);

/// What is offered, and where each device is in it: `Allocate` looks its devices up by id, and a
/// resource may list a thousand (a scan of string compares per device asked for).
#[derive(Debug, Default)]
pub(super) struct Offer {
    pub(super) resources: Arc<Resources>,
    /// Resource name → device id → index in that resource's `devices`.
    positions: HashMap<String, HashMap<String, usize>>,
}

impl Offer {
    pub(super) fn of(resources: Arc<Resources>) -> Offer {
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
    pub(super) fn device<'a>(&self, res: &'a Resource, id: &str) -> Option<&'a crate::resources::ResourceDevice> {
        let i = *self.positions.get(&res.name)?.get(id)?;
        res.devices.get(i).filter(|d| d.id == id)
    }
}

/// For runtimes without CDI (`injection.cdi_spec_dir` empty): the answer itself carries the
/// device nodes (with their cgroup rules) and mounts the shim and an `/etc/ld.so.preload` naming
/// it; the driver's libraries are then the runtime's (or `tessera-runtime`'s) business.
#[derive(Debug, Clone)]
pub(super) struct DirectInjection {
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
    pub(super) fn of(config: &Config) -> Option<DirectInjection> {
        let inj = &config.injection;
        if !inj.cdi_spec_dir.as_os_str().is_empty() {
            return None;
        }
        let control_nodes =
            tessera_region::driver::CONTROL_NODES.iter().map(|n| inj.dev_root.join(n)).filter(|p| p.exists()).collect();
        let shim = (!inj.shim_path.as_os_str().is_empty()).then(|| inj.shim_path.clone());
        let preload = config.runtime_dir.join("ld.so.preload");
        if shim.is_some() {
            let text = tessera_region::paths::preload_content();
            if let Err(e) = crate::state::durable::write_file(&preload, text.as_bytes(), 0o644) {
                tracing::error!(file = %preload.display(), error = %e, "cannot write the preload file");
            }
        }
        Some(DirectInjection { control_nodes, shim, preload, dev_root: inj.dev_root.clone() })
    }
}

impl DaemonAllocator {
    pub(super) fn devices(
        &self,
        offer: &Offer,
        resource: &Resource,
        ids: &[String],
    ) -> Result<Vec<AllocatedDevice>, Status> {
        let defaults = self.defaults();
        ids.iter()
            .map(|id| {
                let d = offer.device(resource, id).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "unknown device id {} for resource {}",
                        crate::client_input::quoted(id),
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
                    preemptible: false,
                })
            })
            .collect()
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
            (ALLOCATION_ENV.to_owned(), alloc.id.clone()),
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
                    container_path: tessera_region::paths::SHIM_CONTAINER_PATH.into(),
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

/// Resource `name` in `all`, or NotFound naming it.
fn resource_of<'a>(all: &'a Resources, name: &str) -> Result<&'a Resource, Status> {
    all.get(name).ok_or_else(|| Status::not_found(format!("unknown resource {name}")))
}

impl Allocator for DaemonAllocator {
    fn allocate(&self, resource: &str, device_ids: &[String]) -> Result<ContainerAllocation, Status> {
        // A reference into the offer, not a copy: a resource may list a thousand devices.
        let offer = self.offer();
        let res = resource_of(&offer.resources, resource)?;
        let devices = self.devices(&offer, res, device_ids)?;
        let wanted: BTreeSet<&str> = device_ids.iter().map(String::as_str).collect();
        // What the records hold is told to the controller (which publishes it to the faces) once
        // the lock is let go, below, before the answer.
        let mut store = Store::lock_telling_after(&self.store);

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
                } else {
                    self.restore_dir(&existing)?;
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
                // Written first: a crash after this finds the record (and recreates the
                // directory); a crash before it leaves nothing, and the kubelet retries. Its
                // flush follows the answer (a power cut before it: the kubelet's checkpoint).
                self.record_flushed_soon(&mut store, &alloc)?;
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
