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
//! Unhealthy devices either leave the slice and come back on recovery, or, where the API server
//! honours device taints (resource.k8s.io/v1 `devices[].taints`: beta and on by default from
//! 1.36, alpha behind a gate before), stay in it with a [`TAINT_KEY`] taint ([`Unhealthy`]):
//! `NoExecute` while the device is failed or lost (the scheduler places nothing there and pods
//! using it are evicted), `NoSchedule` while it is recovering after a reset (nothing new, running
//! pods stay). The choice follows the server's `/version`, and falls back to removal when a
//! written slice comes back without its taints (the gate off). The layout is the 1.34 one
//! (devices only, no shared counters): every field written exists in the 1.34 and 1.37 schemas.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity, DeviceTaint,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
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

/// The key of the taint an unhealthy device carries (value: `lost`, `unhealthy` or `recovering`).
pub const TAINT_KEY: &str = "gpu.tessera.io/unhealthy";
/// The first Kubernetes minor version whose API servers honour device taints by default.
pub const TAINTS_FROM_MINOR: u32 = 36;

/// What becomes of an unhealthy device in the slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unhealthy {
    /// It leaves the slice.
    Remove,
    /// It stays, with a [`TAINT_KEY`] taint.
    Taint,
}

/// What the API server reporting `major.minor` does with taints: `Taint` from 1.36 on. The
/// minor may carry a suffix (`36+` on some managed clusters).
pub fn unhealthy_layout(major: &str, minor: &str) -> Unhealthy {
    let number = |s: &str| s.trim_end_matches(|c: char| !c.is_ascii_digit()).parse::<u32>().ok();
    match (number(major), number(minor)) {
        (Some(1), Some(m)) if m >= TAINTS_FROM_MINOR => Unhealthy::Taint,
        (Some(major), _) if major > 1 => Unhealthy::Taint,
        _ => Unhealthy::Remove,
    }
}

/// The taint for an unhealthy device whose reason is `reason` (the health monitor's
/// `<state>: <why>`): `NoSchedule` while recovering, `NoExecute` when failed or lost.
pub fn taint(reason: &str, time_added: Time) -> DeviceTaint {
    let state = reason.split(':').next().unwrap_or_default().trim();
    let (value, effect) = match state {
        "recovering" => ("recovering", "NoSchedule"),
        "lost" => ("lost", "NoExecute"),
        _ => ("unhealthy", "NoExecute"),
    };
    DeviceTaint {
        key: TAINT_KEY.to_owned(),
        value: Some(value.to_owned()),
        effect: effect.to_owned(),
        time_added: Some(time_added),
    }
}

/// Now, to the second (what the API server keeps of a time).
fn now_seconds() -> Time {
    let now = k8s_openapi::jiff::Timestamp::now();
    Time(k8s_openapi::jiff::Timestamp::from_second(now.as_second()).unwrap_or(now))
}

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
    build_with(node, devices, generation, Unhealthy::Remove, None)
}

/// The slice for `node` with `devices`, at pool `generation`; unhealthy ones left out or tainted
/// as `layout` says. A taint already in `previous` (the slice as the server has it) for the same
/// device, key and effect keeps its `timeAdded`, so an unchanged fault changes nothing.
pub fn build_with(
    node: &str,
    devices: &[DraDevice],
    generation: i64,
    layout: Unhealthy,
    previous: Option<&ResourceSliceSpec>,
) -> ResourceSlice {
    let added = |name: &str, t: &DeviceTaint| {
        previous
            .and_then(|p| p.devices.as_ref())
            .and_then(|ds| ds.iter().find(|d| d.name == name))
            .and_then(|d| d.taints.as_ref())
            .and_then(|ts| ts.iter().find(|p| p.key == t.key && p.effect == t.effect))
            .and_then(|p| p.time_added.clone())
    };
    let listed = devices.iter().filter_map(|d| match (&d.unhealthy, layout) {
        (None, _) => Some(device(d)),
        (Some(_), Unhealthy::Remove) => None,
        (Some(why), Unhealthy::Taint) => {
            let mut t = taint(why, now_seconds());
            if let Some(then) = added(&d.name, &t) {
                t.time_added = Some(then);
            }
            Some(Device { taints: Some(vec![t]), ..device(d) })
        }
    });
    ResourceSlice {
        metadata: ObjectMeta { name: Some(slice_name(node)), ..Default::default() },
        spec: ResourceSliceSpec {
            driver: DRIVER.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool { name: node.to_owned(), generation, resource_slice_count: 1 },
            devices: Some(listed.collect()),
            ..Default::default()
        },
    }
}

/// Whether every taint written in `sent` came back in `got` (an API server with the device-taint
/// gate off drops the field silently).
fn taints_kept(sent: &ResourceSlice, got: &ResourceSlice) -> bool {
    let tainted = |s: &ResourceSlice| -> Vec<String> {
        s.spec
            .devices
            .iter()
            .flatten()
            .filter(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
            .map(|d| d.name.clone())
            .collect()
    };
    tainted(sent) == tainted(got)
}

/// Keeps the node's slice in the API server equal to the devices it is given.
pub struct Publisher {
    client: kube::Client,
    api: kube::Api<ResourceSlice>,
    node: String,
    /// Decided on the first sync (the server's version), or set by [`Publisher::with_layout`].
    layout: std::sync::Mutex<Option<Unhealthy>>,
}

/// What one sync did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Synced {
    pub created: bool,
    pub updated: bool,
    pub deleted: usize,
    /// The server dropped the taints written: sync again (removing unhealthy devices).
    pub taints_dropped: bool,
}

impl Publisher {
    pub fn new(client: kube::Client, node: impl Into<String>) -> Publisher {
        Publisher { api: kube::Api::all(client.clone()), client, node: node.into(), layout: Default::default() }
    }

    /// Unhealthy devices are handled as `layout` says, whatever the server's version.
    pub fn with_layout(self, layout: Unhealthy) -> Publisher {
        *self.layout.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(layout);
        self
    }

    /// What becomes of unhealthy devices: decided once from the server's `/version`.
    async fn layout(&self) -> Result<Unhealthy, kube::Error> {
        if let Some(l) = *self.layout.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            return Ok(l);
        }
        let info = self.client.apiserver_version().await?;
        let l = unhealthy_layout(&info.major, &info.minor);
        tracing::info!(version = %info.git_version, layout = ?l, "unhealthy DRA devices: tainted from 1.36, removed before");
        *self.layout.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(l);
        Ok(l)
    }

    /// A written slice came back without its taints: remove unhealthy devices from now on.
    fn check_taints(&self, sent: &ResourceSlice, got: &ResourceSlice) -> bool {
        if taints_kept(sent, got) {
            return true;
        }
        tracing::warn!(node = %self.node, "the API server dropped the device taints (the DRADeviceTaints feature is off): unhealthy devices leave the slice instead");
        *self.layout.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Unhealthy::Remove);
        false
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
        let layout = self.layout().await?;
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
                let new = build_with(&self.node, devices, 0, layout, None);
                let got = self.api.create(&PostParams::default(), &new).await?;
                out.created = true;
                out.taints_dropped = !self.check_taints(&new, &got);
            }
            Some(cur) => {
                let generation = cur.spec.pool.generation;
                let same = build_with(&self.node, devices, generation, layout, Some(&cur.spec));
                if cur.spec != same.spec {
                    let mut next = build_with(&self.node, devices, generation + 1, layout, Some(&cur.spec));
                    next.metadata.resource_version = cur.metadata.resource_version.clone();
                    let got = self.api.replace(&name, &PostParams::default(), &next).await?;
                    out.updated = true;
                    out.taints_dropped = !self.check_taints(&next, &got);
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
            // A server that dropped the taints just written: write again at once, by removal.
            let mut again_now = false;
            let synced_at = match self.sync_at(&wanted).await {
                Ok((s, version)) => {
                    if s != Synced::default() {
                        tracing::info!(node = %self.node, created = s.created, updated = s.updated, deleted = s.deleted, devices = wanted.len(), "ResourceSlice published");
                    }
                    synced.send_modify(|n| *n += 1);
                    again_now = s.taints_dropped;
                    Some(version)
                }
                Err(e) => {
                    tracing::warn!(node = %self.node, error = %e, retry_ms = retry.as_millis() as u64, "publishing the ResourceSlice failed; retrying");
                    None
                }
            };
            // Until the devices change, or the slices do (watched), or the backoff has passed.
            let wait = async {
                if again_now {
                    return;
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::devices::DraKind;

    fn device(name: &str, unhealthy: Option<&str>) -> DraDevice {
        DraDevice {
            name: name.into(),
            kind: DraKind::Gpu,
            uuid: format!("GPU-{name}"),
            gpu_index: 0,
            gpu_uuid: format!("GPU-{name}"),
            product: "NVIDIA H100".into(),
            memory: 80 << 30,
            driver_version: "550.54.15".into(),
            cuda_driver_version: "12.4".into(),
            numa_node: None,
            pci_bus_id: String::new(),
            unhealthy: unhealthy.map(str::to_owned),
        }
    }

    #[test]
    fn taints_from_1_36() {
        assert_eq!(unhealthy_layout("1", "34"), Unhealthy::Remove);
        assert_eq!(unhealthy_layout("1", "35+"), Unhealthy::Remove);
        assert_eq!(unhealthy_layout("1", "36"), Unhealthy::Taint);
        assert_eq!(unhealthy_layout("1", "37+"), Unhealthy::Taint);
        assert_eq!(unhealthy_layout("2", "0"), Unhealthy::Taint);
        assert_eq!(unhealthy_layout("", ""), Unhealthy::Remove, "unknown: the safe layout");
    }

    #[test]
    fn unhealthy_devices_leave_or_carry_a_taint_by_state() {
        let devices = [
            device("gpu-0", None),
            device("gpu-1", Some("unhealthy: XID 79 (GPU has fallen off the bus)")),
            device("gpu-2", Some("lost: not answering")),
            device("gpu-3", Some("recovering: reset (volatile ECC counters cleared)")),
        ];
        let names =
            |s: &ResourceSlice| -> Vec<String> { s.spec.devices.iter().flatten().map(|d| d.name.clone()).collect() };
        assert_eq!(names(&build("n", &devices, 0)), ["gpu-0"]);
        let tainted = build_with("n", &devices, 0, Unhealthy::Taint, None);
        assert_eq!(names(&tainted), ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
        let taints: Vec<(Option<String>, String)> = tainted
            .spec
            .devices
            .iter()
            .flatten()
            .map(|d| d.taints.clone().unwrap_or_default())
            .filter_map(|t| t.first().cloned())
            .map(|t| {
                assert_eq!(t.key, TAINT_KEY);
                assert!(t.time_added.is_some());
                (t.value, t.effect)
            })
            .collect();
        assert_eq!(
            taints,
            [
                (Some("unhealthy".into()), "NoExecute".into()),
                (Some("lost".into()), "NoExecute".into()),
                (Some("recovering".into()), "NoSchedule".into())
            ]
        );
        assert!(tainted.spec.devices.as_ref().unwrap()[0].taints.is_none(), "a healthy device carries none");
        // An unchanged fault keeps its time (no rewrite); a new effect gets a new one.
        let mut previous = tainted.spec.clone();
        let then = Time(k8s_openapi::jiff::Timestamp::from_second(1_000_000).unwrap());
        for d in previous.devices.iter_mut().flatten() {
            for t in d.taints.iter_mut().flatten() {
                t.time_added = Some(then.clone());
            }
        }
        let again = build_with("n", &devices, 0, Unhealthy::Taint, Some(&previous));
        assert_eq!(again.spec, previous);
        let mut changed = devices.clone();
        changed[3].unhealthy = Some("unhealthy: XID 48".into());
        let next = build_with("n", &changed, 0, Unhealthy::Taint, Some(&previous));
        let t = &next.spec.devices.as_ref().unwrap()[3].taints.as_ref().unwrap()[0];
        assert_eq!(t.effect, "NoExecute");
        assert_ne!(t.time_added, Some(then), "a new effect is a new taint");
        // A server that dropped the taints is noticed.
        assert!(taints_kept(&tainted, &tainted));
        assert!(!taints_kept(&tainted, &build("n", &devices, 0)));
    }
}
