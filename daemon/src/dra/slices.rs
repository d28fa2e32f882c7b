//! The node's ResourceSlice: one pool named after the node, one slice holding every published
//! device ([`build`], pure), kept current through the API server ([`Publisher`]): created when
//! missing, replaced (with its resourceVersion, the pool generation bumped) when the devices
//! change, stale slices of this driver on this node deleted. Failures (conflicts, an API server
//! restarting) are retried with backoff from 100 ms doubling to 30 s; never a hot loop.
//!
//! Between changes of its devices the publisher watches this driver's slices on this node from
//! the resourceVersion of its last list: any change it sees (another writer's edit, a deletion,
//! its own write coming back) makes it sync again, so a slice someone deletes or edits is put
//! back at once instead of at the next periodic check; a watch that ends (the API server's
//! timeout) is made again from where it was, without a list; one that fails (410 Gone, an error)
//! means a sync after the backoff.
//!
//! Unhealthy devices leave the slice and come back on recovery. The layout is the 1.34 one
//! (devices only, no shared counters): every field written exists in the 1.34 and 1.37 schemas.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use tokio::sync::watch;
use tokio_stream::StreamExt;

use super::DRIVER;
use super::devices::{DraDevice, DraKind, format_bytes};

/// The first retry after a failed sync, and the longest wait between retries.
pub const FIRST_RETRY: Duration = Duration::from_millis(100);
pub const MAX_RETRY: Duration = Duration::from_secs(30);
/// How long one watch request asks to last; it is then made again from the last version seen.
pub const WATCH_TIMEOUT_S: u32 = 290;

/// Granularity of a memory request on a shareable GPU: requests round up to it.
pub const MEMORY_STEP: u64 = 256 << 20;
/// What a claim that names no memory gets.
pub const DEFAULT_MEMORY: u64 = 1 << 30;
/// What a claim that names no SM percent gets.
pub const DEFAULT_SM: u64 = 10;

/// The slice's name for `node`.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER}")
}

fn q(s: impl Into<String>) -> Quantity {
    Quantity(s.into())
}

fn string(s: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute { string: Some(s.into()), ..Default::default() }
}

fn int(n: i64) -> DeviceAttribute {
    DeviceAttribute { int: Some(n), ..Default::default() }
}

/// A semantic version attribute when `v` can be one (`9.0` → `9.0.0`), else a string.
fn version(v: &str) -> DeviceAttribute {
    let parts: Vec<&str> = v.split('.').collect();
    let numeric =
        |p: &&str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && (p.len() == 1 || !p.starts_with('0'));
    if (1..=3).contains(&parts.len()) && parts.iter().all(numeric) {
        let mut full = parts.clone();
        full.resize(3, "0");
        DeviceAttribute { version: Some(full.join(".")), ..Default::default() }
    } else {
        string(v)
    }
}

/// One device as the slice lists it.
pub fn device(d: &DraDevice) -> Device {
    let mut attributes = BTreeMap::from([
        ("uuid".to_string(), string(&d.uuid)),
        ("index".to_string(), int(i64::from(d.gpu_index))),
        ("productName".to_string(), string(&d.product)),
        ("driverVersion".to_string(), version(&d.driver_version)),
        ("cudaDriverVersion".to_string(), version(&d.cuda_driver_version)),
        ("pciBusID".to_string(), string(&d.pci_bus_id)),
    ]);
    if let Some(a) = d.architecture() {
        attributes.insert("architecture".into(), string(a));
    }
    if let Some(cc) = d.compute_capability() {
        attributes.insert("cudaComputeCapability".into(), version(cc));
    }
    if let Some(n) = d.numa_node {
        attributes.insert("numaNode".into(), int(i64::from(n)));
    }
    let memory = format_bytes(d.memory);
    let mut capacity = BTreeMap::new();
    let mut allow_multiple = None;
    match &d.kind {
        DraKind::Gpu => {
            attributes.insert("type".into(), string("gpu"));
            capacity.insert("memory".into(), DeviceCapacity { value: q(memory), request_policy: None });
        }
        DraKind::Mig { profile, .. } => {
            attributes.insert("type".into(), string("mig"));
            attributes.insert("migProfile".into(), string(profile));
            attributes.insert("parentUUID".into(), string(&d.gpu_uuid));
            capacity.insert("memory".into(), DeviceCapacity { value: q(memory), request_policy: None });
        }
        DraKind::Shared => {
            attributes.insert("type".into(), string("shared"));
            allow_multiple = Some(true);
            let max_memory = d.memory - d.memory % MEMORY_STEP;
            capacity.insert(
                "memory".into(),
                DeviceCapacity {
                    value: q(memory),
                    request_policy: Some(CapacityRequestPolicy {
                        default: Some(q(format_bytes(DEFAULT_MEMORY.min(max_memory)))),
                        valid_range: Some(CapacityRequestPolicyRange {
                            min: q(format_bytes(MEMORY_STEP)),
                            max: Some(q(format_bytes(max_memory))),
                            step: Some(q(format_bytes(MEMORY_STEP))),
                        }),
                        valid_values: None,
                    }),
                },
            );
            capacity.insert(
                "sm".into(),
                DeviceCapacity {
                    value: q("100"),
                    request_policy: Some(CapacityRequestPolicy {
                        default: Some(q(DEFAULT_SM.to_string())),
                        valid_range: Some(CapacityRequestPolicyRange {
                            min: q("1"),
                            max: Some(q("100")),
                            step: Some(q("1")),
                        }),
                        valid_values: None,
                    }),
                },
            );
        }
    }
    Device {
        name: d.name.clone(),
        attributes: Some(attributes),
        capacity: Some(capacity),
        allow_multiple_allocations: allow_multiple,
        ..Default::default()
    }
}

/// The slice for `node` with the healthy `devices`, at pool `generation`.
pub fn build(node: &str, devices: &[DraDevice], generation: i64) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta { name: Some(slice_name(node)), ..Default::default() },
        spec: ResourceSliceSpec {
            driver: DRIVER.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool { name: node.to_owned(), generation, resource_slice_count: 1 },
            devices: Some(devices.iter().filter(|d| d.unhealthy.is_none()).map(device).collect()),
            ..Default::default()
        },
    }
}

/// Keeps the node's slice in the API server equal to the devices it is given.
pub struct Publisher {
    api: kube::Api<ResourceSlice>,
    node: String,
}

/// What one sync did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Synced {
    pub created: bool,
    pub updated: bool,
    pub deleted: usize,
}

impl Publisher {
    pub fn new(client: kube::Client, node: impl Into<String>) -> Publisher {
        Publisher { api: kube::Api::all(client), node: node.into() }
    }

    /// One pass: list this driver's slices on this node, create, replace or delete so that exactly
    /// the wanted slice remains. A conflict (someone else changed it) is an error: the caller
    /// retries with a fresh list.
    pub async fn sync(&self, devices: &[DraDevice]) -> Result<Synced, kube::Error> {
        self.sync_at(devices).await.map(|(s, _)| s)
    }

    /// The field selector of this driver's slices on this node.
    fn fields(&self) -> String {
        format!("spec.nodeName={},spec.driver={DRIVER}", self.node)
    }

    /// [`Publisher::sync`], and the resourceVersion of its list: a watch from there sees every
    /// later change, its own writes included.
    async fn sync_at(&self, devices: &[DraDevice]) -> Result<(Synced, String), kube::Error> {
        let list = self.api.list(&ListParams::default().fields(&self.fields())).await?;
        let version = list.metadata.resource_version.clone().unwrap_or_default();
        let name = slice_name(&self.node);
        let mut out = Synced::default();
        let mut current = None;
        for s in list.items {
            // The server may ignore the field selector: check ourselves.
            if s.spec.driver != DRIVER || s.spec.node_name.as_deref() != Some(self.node.as_str()) {
                continue;
            }
            let sname = s.metadata.name.clone().unwrap_or_default();
            if sname == name {
                current = Some(s);
            } else {
                self.api.delete(&sname, &DeleteParams::default()).await?;
                out.deleted += 1;
            }
        }
        match current {
            None => {
                self.api.create(&PostParams::default(), &build(&self.node, devices, 0)).await?;
                out.created = true;
            }
            Some(cur) => {
                let generation = cur.spec.pool.generation;
                let same = build(&self.node, devices, generation);
                if cur.spec != same.spec {
                    let mut next = build(&self.node, devices, generation + 1);
                    next.metadata.resource_version = cur.metadata.resource_version.clone();
                    self.api.replace(&name, &PostParams::default(), &next).await?;
                    out.updated = true;
                }
            }
        }
        Ok((out, version))
    }

    /// Returns once this driver's slices on this node change after `version` (`Ok`), or the
    /// watch cannot go on (`Err`: 410 Gone, an error); either way the caller syncs again. A watch
    /// the API server ends quietly is made again from the last version seen.
    async fn changed_after(&self, mut version: String) -> Result<(), kube::Error> {
        let fields = self.fields();
        loop {
            let params = WatchParams::default().fields(&fields).timeout(WATCH_TIMEOUT_S);
            let mut events = Box::pin(self.api.watch(&params, &version).await?);
            while let Some(event) = events.next().await {
                match event? {
                    WatchEvent::Bookmark(b) => version = b.metadata.resource_version,
                    WatchEvent::Error(status) => return Err(kube::Error::Api(status)),
                    WatchEvent::Added(_) | WatchEvent::Modified(_) | WatchEvent::Deleted(_) => return Ok(()),
                }
            }
            // Ended without a change: watch again (after a pause, so that a server ending every
            // watch at once cannot make this spin).
            tokio::time::sleep(FIRST_RETRY).await;
        }
    }

    /// Syncs whenever `devices` changes or the watch sees the slices change, retrying failures
    /// with backoff, until `shutdown` turns true. `synced` counts successful passes (for tests
    /// and readiness).
    pub async fn run(
        self,
        mut devices: watch::Receiver<Vec<DraDevice>>,
        mut shutdown: watch::Receiver<bool>,
        synced: watch::Sender<u64>,
    ) {
        let mut retry = FIRST_RETRY;
        loop {
            let wanted = devices.borrow_and_update().clone();
            let synced_at = match self.sync_at(&wanted).await {
                Ok((s, version)) => {
                    if s != Synced::default() {
                        tracing::info!(node = %self.node, created = s.created, updated = s.updated, deleted = s.deleted, devices = wanted.len(), "ResourceSlice published");
                    }
                    synced.send_modify(|n| *n += 1);
                    Some(version)
                }
                Err(e) => {
                    tracing::warn!(node = %self.node, error = %e, retry_ms = retry.as_millis() as u64, "publishing the ResourceSlice failed; retrying");
                    None
                }
            };
            // Until the devices change, or the slices do (watched), or the backoff has passed.
            let wait = async {
                match synced_at {
                    Some(version) => match self.changed_after(version).await {
                        // Seen changed: sync now (at most every FIRST_RETRY: two writers
                        // fighting over the slice cannot make this spin).
                        Ok(()) => {
                            retry = FIRST_RETRY;
                            tokio::time::sleep(FIRST_RETRY).await;
                        }
                        Err(e) => {
                            tracing::debug!(node = %self.node, error = %e, "the ResourceSlice watch ended; syncing again");
                            tokio::time::sleep(retry).await;
                            retry = (retry * 2).min(MAX_RETRY);
                        }
                    },
                    None => {
                        tokio::time::sleep(retry).await;
                        retry = (retry * 2).min(MAX_RETRY);
                    }
                }
            };
            tokio::select! {
                changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return },
                changed = devices.changed() => if changed.is_err() { return },
                () = wait => {}
            }
        }
    }
}
