//! The node's ResourceSlice: one pool named after the node, one slice holding every published
//! device ([`build`], pure), kept current through the API server ([`Publisher`]): created when
//! missing, replaced (with its resourceVersion, the pool generation bumped) when the devices
//! change, stale slices of this driver on this node deleted. Failures (conflicts, an API server
//! restarting) are retried with backoff from 100 ms doubling to 30 s; never a hot loop.
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
use kube::api::{DeleteParams, ListParams, PostParams};
use tokio::sync::watch;

use super::DRIVER;
use super::devices::{DraDevice, DraKind, format_bytes};

/// The first retry after a failed sync, and the longest wait between retries.
pub const FIRST_RETRY: Duration = Duration::from_millis(100);
pub const MAX_RETRY: Duration = Duration::from_secs(30);
/// How often a synced slice is checked again (someone may have deleted or edited it).
pub const RESYNC: Duration = Duration::from_secs(60);

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
        let fields = format!("spec.nodeName={},spec.driver={DRIVER}", self.node);
        let list = self.api.list(&ListParams::default().fields(&fields)).await?;
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
        Ok(out)
    }

    /// Syncs whenever `devices` changes (and every [`RESYNC`]), retrying failures with backoff,
    /// until `shutdown` turns true. `synced` counts successful passes (for tests and readiness).
    pub async fn run(
        self,
        mut devices: watch::Receiver<Vec<DraDevice>>,
        mut shutdown: watch::Receiver<bool>,
        synced: watch::Sender<u64>,
    ) {
        let mut retry = FIRST_RETRY;
        loop {
            let wanted = devices.borrow_and_update().clone();
            let wait = match self.sync(&wanted).await {
                Ok(s) => {
                    if s != Synced::default() {
                        tracing::info!(node = %self.node, created = s.created, updated = s.updated, deleted = s.deleted, devices = wanted.len(), "ResourceSlice published");
                    }
                    retry = FIRST_RETRY;
                    synced.send_modify(|n| *n += 1);
                    RESYNC
                }
                Err(e) => {
                    tracing::warn!(node = %self.node, error = %e, retry_ms = retry.as_millis() as u64, "publishing the ResourceSlice failed; retrying");
                    let now = retry;
                    retry = (retry * 2).min(MAX_RETRY);
                    now
                }
            };
            tokio::select! {
                changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return },
                changed = devices.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}
