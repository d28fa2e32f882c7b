//! The node's ResourceSlices: one pool named after the node ([`build_pool`], pure), kept current
//! through the API server ([`Publisher`]): created when missing, replaced (with their
//! resourceVersion, the pool generation bumped) when the devices change, stale slices of this
//! driver on this node deleted. Failures (conflicts, an API server restarting) are retried with
//! backoff from 100 ms doubling to 30 s; never a hot loop.
//!
//! Between changes of its devices the publisher watches this driver's slices on this node from
//! the resourceVersion of its last list: any change it sees (another writer's edit, a deletion,
//! its own write coming back) makes it sync again, so a slice someone deletes or edits is put
//! back at once instead of at the next periodic check; a watch that ends (the API server's
//! timeout) is made again from where it was, without a list; one that fails (410 Gone, an error)
//! means a sync after the backoff.
//!
//! Unhealthy devices either leave the pool and come back on recovery, or, where the API server
//! honours device taints (resource.k8s.io/v1 `devices[].taints`: beta and on by default from
//! 1.36, alpha behind a gate before), stay in it with a [`TAINT_KEY`] taint ([`Unhealthy`]):
//! `NoExecute` while the device is failed or lost (the scheduler places nothing there and pods
//! using it are evicted), `NoSchedule` while it is recovering after a reset (nothing new, running
//! pods stay). The choice follows the server's `/version`, and falls back to removal when a
//! written slice comes back without its taints (the gate off).
//!
//! A feature gate off on the API server drops its fields from a written slice silently: a
//! shared device without `allowMultipleAllocations` (DRAConsumableCapacity off) would be given to
//! one claim whole, and placements without `consumesCounters` (DRAPartitionableDevices off) could
//! be given to two claims that overlap. So a written slice that comes back without them takes
//! those devices out of the pool from then on ([`Publisher`], one log line naming the gate).
//!
//! Devices that consume shared
//! counters (dynamic MIG placements) are laid out by the API server's version ([`SliceLayout`],
//! as NVIDIA's DRA driver does): up to 1.34 a device may consume only counters of its own slice,
//! so each GPU's counter set and its placements share a slice; from 1.35 a slice holds devices or
//! shared counters, never both.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity,
    DeviceCounterConsumption, DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use tokio::sync::watch;
use tokio_stream::StreamExt;

use super::DRIVER;
use super::devices::{DraDevice, DraKind, GpuCounters, format_bytes, memory_slice_counter};

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
        ("index".to_string(), int(i64::from(d.gpu_index))),
        ("productName".to_string(), string(&d.product)),
        ("driverVersion".to_string(), version(&d.driver_version)),
        ("cudaDriverVersion".to_string(), version(&d.cuda_driver_version)),
        ("pciBusID".to_string(), string(&d.pci_bus_id)),
    ]);
    if !matches!(d.kind, DraKind::MigPlacement(_)) {
        // A placement has no UUID of its own until it is made.
        attributes.insert("uuid".into(), string(&d.uuid));
    }
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
    let mut consumes = None;
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
        DraKind::MigPlacement(p) => {
            attributes.insert("type".into(), string("mig-placement"));
            attributes.insert("migProfile".into(), string(&p.profile));
            attributes.insert("parentUUID".into(), string(&d.gpu_uuid));
            attributes.insert("placementStart".into(), int(i64::from(p.start)));
            attributes.insert("placementSize".into(), int(i64::from(p.size)));
            capacity.insert("memory".into(), DeviceCapacity { value: q(memory), request_policy: None });
            capacity.insert(
                "multiprocessors".into(),
                DeviceCapacity { value: q(p.multiprocessors.to_string()), request_policy: None },
            );
            let mut counters = BTreeMap::from([
                ("memory".to_string(), Counter { value: q(format_bytes(d.memory)) }),
                ("multiprocessors".to_string(), Counter { value: q(p.multiprocessors.to_string()) }),
            ]);
            for i in p.start..p.start + p.size {
                counters.insert(memory_slice_counter(i), Counter { value: q("1") });
            }
            consumes = Some(vec![DeviceCounterConsumption {
                counter_set: p.counters.name.clone(),
                counters,
                compatibility_groups: None,
            }]);
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
            // What the node API's own shares leave (100 where it holds none).
            let sm = d.sm.clamp(1, 100).to_string();
            capacity.insert(
                "sm".into(),
                DeviceCapacity {
                    value: q(sm.clone()),
                    request_policy: Some(CapacityRequestPolicy {
                        default: Some(q(DEFAULT_SM.min(u64::from(d.sm.clamp(1, 100))).to_string())),
                        valid_range: Some(CapacityRequestPolicyRange {
                            min: q("1"),
                            max: Some(q(sm)),
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
        consumes_counters: consumes,
        ..Default::default()
    }
}

/// A GPU's counter set as the slice lists it.
pub fn counter_set(c: &GpuCounters) -> CounterSet {
    let mut counters = BTreeMap::from([
        ("memory".to_string(), Counter { value: q(format_bytes(c.memory)) }),
        ("multiprocessors".to_string(), Counter { value: q(c.multiprocessors.to_string()) }),
    ]);
    for &i in &c.memory_slices {
        counters.insert(memory_slice_counter(i), Counter { value: q("1") });
    }
    CounterSet { name: c.name.clone(), counters }
}

/// How the pool's slices are laid out, by the API server's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SliceLayout {
    /// Up to 1.34: a device may consume only counters of its own slice. One slice of the devices
    /// that consume none, per GPU with placements one slice with its counter set and them, and
    /// each shared device alone in a slice of its own: kube-scheduler 1.34 checks a request's
    /// capacity against the device at the request's device index within the slice, not against
    /// the device it allocates (fixed in 1.35), so a shared device must be the first of its slice
    /// or no claim naming `memory` and `sm` is ever allocated there.
    Combined,
    /// From 1.35: a slice holds devices or shared counters, never both. One slice of the devices
    /// that consume none, per GPU one of its placements, and the counter sets (at most
    /// [`MAX_COUNTER_SETS`] a slice) in slices of their own.
    Separate,
}

/// The most counter sets one slice may hold (1.35+).
pub const MAX_COUNTER_SETS: usize = 8;

impl SliceLayout {
    /// The layout for API server version `major.minor` (`1`, `35`; a `+` suffix is ignored).
    pub fn for_version(major: &str, minor: &str) -> Option<SliceLayout> {
        let number = |s: &str| s.trim_end_matches('+').parse::<u32>().ok();
        let (major, minor) = (number(major)?, number(minor)?);
        Some(if (major, minor) <= (1, 34) { SliceLayout::Combined } else { SliceLayout::Separate })
    }

    /// From `/version`: major and minor, else `gitVersion` (`v1.35.2-gke.100`).
    pub fn for_info(info: &k8s_openapi::apimachinery::pkg::version::Info) -> Option<SliceLayout> {
        SliceLayout::for_version(&info.major, &info.minor).or_else(|| {
            let v = info.git_version.trim_start_matches('v');
            let mut parts = v.split(['.', '-', '+']);
            SliceLayout::for_version(parts.next()?, parts.next()?)
        })
    }
}

/// The pool's slices for `node` with the healthy `devices`, at pool `generation`, in `layout`
/// (unhealthy devices left out).
pub fn build_pool(node: &str, devices: &[DraDevice], generation: i64, layout: SliceLayout) -> Vec<ResourceSlice> {
    build_pool_with(node, devices, generation, layout, Unhealthy::Remove, &[])
}

/// The pool's slices for `node` with `devices`, at pool `generation`, in `layout`; unhealthy ones
/// left out or tainted as `unhealthy` says. The first is always `<node>-gpu.tessera.io` (the
/// devices that consume no counters, maybe none); then per GPU with placements
/// `<node>-gpu.tessera.io-gpu-<index>`; in the combined layout per shared device
/// `<node>-gpu.tessera.io-shared-<index>`, in the separate layout
/// `<node>-gpu.tessera.io-counters-<n>`. A taint already in `previous` (the slices as the server
/// has them) for the same device, key and effect keeps its `timeAdded`, so an unchanged fault
/// changes nothing.
pub fn build_pool_with(
    node: &str,
    devices: &[DraDevice],
    generation: i64,
    layout: SliceLayout,
    unhealthy: Unhealthy,
    previous: &[ResourceSliceSpec],
) -> Vec<ResourceSlice> {
    let added = |name: &str, t: &DeviceTaint| {
        previous
            .iter()
            .flat_map(|p| p.devices.iter().flatten())
            .find(|d| d.name == name)
            .and_then(|d| d.taints.as_ref())
            .and_then(|ts| ts.iter().find(|p| p.key == t.key && p.effect == t.effect))
            .and_then(|p| p.time_added.clone())
    };
    let listed: Vec<(&DraDevice, Device)> = devices
        .iter()
        .filter_map(|d| match (d.health.reason(), unhealthy) {
            (None, _) => Some((d, device(d))),
            (Some(_), Unhealthy::Remove) => None,
            (Some(why), Unhealthy::Taint) => {
                let mut t = taint(why, now_seconds());
                if let Some(then) = added(&d.name, &t) {
                    t.time_added = Some(then);
                }
                Some((d, Device { taints: Some(vec![t]), ..device(d) }))
            }
        })
        .collect();
    // Up to 1.34 each shared device is alone in a slice of its own ([`SliceLayout::Combined`]).
    let alone = |d: &DraDevice| layout == SliceLayout::Combined && d.kind == DraKind::Shared;
    let plain: Vec<Device> = listed
        .iter()
        .filter(|(d, _)| !matches!(d.kind, DraKind::MigPlacement(_)) && !alone(d))
        .map(|(_, dev)| dev.clone())
        .collect();
    // Per GPU: its counter set and placements.
    let mut per_gpu: BTreeMap<u32, (CounterSet, Vec<Device>)> = BTreeMap::new();
    for (d, dev) in &listed {
        if let DraKind::MigPlacement(p) = &d.kind {
            per_gpu.entry(d.gpu_index).or_insert_with(|| (counter_set(&p.counters), Vec::new())).1.push(dev.clone());
        }
    }
    let mut specs = vec![(slice_name(node), Some(plain), None)];
    let mut sets = Vec::new();
    for (index, (set, placements)) in per_gpu {
        let name = format!("{}-gpu-{index}", slice_name(node));
        match layout {
            SliceLayout::Combined => specs.push((name, Some(placements), Some(vec![set]))),
            SliceLayout::Separate => {
                specs.push((name, Some(placements), None));
                sets.push(set);
            }
        }
    }
    for (d, dev) in listed.iter().filter(|(d, _)| alone(d)) {
        specs.push((format!("{}-shared-{}", slice_name(node), d.gpu_index), Some(vec![dev.clone()]), None));
    }
    for (n, chunk) in sets.chunks(MAX_COUNTER_SETS).enumerate() {
        specs.push((format!("{}-counters-{n}", slice_name(node)), None, Some(chunk.to_vec())));
    }
    let count = i64::try_from(specs.len()).unwrap_or(i64::MAX);
    specs
        .into_iter()
        .map(|(name, devices, shared_counters)| ResourceSlice {
            metadata: ObjectMeta { name: Some(name), ..Default::default() },
            spec: ResourceSliceSpec {
                driver: DRIVER.to_owned(),
                node_name: Some(node.to_owned()),
                pool: ResourcePool { name: node.to_owned(), generation, resource_slice_count: count },
                devices,
                shared_counters,
                ..Default::default()
            },
        })
        .collect()
}

/// The one slice of a pool without placements (`<node>-gpu.tessera.io`), at `generation`.
pub fn build(node: &str, devices: &[DraDevice], generation: i64) -> ResourceSlice {
    build_with(node, devices, generation, Unhealthy::Remove, None)
}

/// [`build`], unhealthy devices left out or tainted as `unhealthy` says (see [`build_pool_with`]).
pub fn build_with(
    node: &str,
    devices: &[DraDevice],
    generation: i64,
    unhealthy: Unhealthy,
    previous: Option<&ResourceSliceSpec>,
) -> ResourceSlice {
    let previous: Vec<ResourceSliceSpec> = previous.into_iter().cloned().collect();
    build_pool_with(node, devices, generation, SliceLayout::Separate, unhealthy, &previous).swap_remove(0)
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

/// The names of the devices of `s` that `has` says carry a field.
fn devices_with(s: &ResourceSlice, has: impl Fn(&Device) -> bool) -> Vec<String> {
    s.spec.devices.iter().flatten().filter(|d| has(d)).map(|d| d.name.clone()).collect()
}

/// A DRA feature whose fields an API server with its gate off drops from written slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatedFeature {
    /// `allowMultipleAllocations` (and the capacities' request policies): the shared devices.
    ConsumableCapacity,
    /// `consumesCounters` / `sharedCounters`: the dynamic MIG placements.
    PartitionableDevices,
}

impl GatedFeature {
    /// The feature gate, as a user sets it.
    pub fn gate(self) -> &'static str {
        match self {
            GatedFeature::ConsumableCapacity => "DRAConsumableCapacity",
            GatedFeature::PartitionableDevices => "DRAPartitionableDevices",
        }
    }

    /// Whether device `d` needs the feature.
    fn needed_by(self, d: &DraDevice) -> bool {
        match self {
            GatedFeature::ConsumableCapacity => d.kind == DraKind::Shared,
            GatedFeature::PartitionableDevices => matches!(d.kind, DraKind::MigPlacement(_)),
        }
    }

    /// Whether `got` (the server's answer) kept this feature's fields of `sent`.
    fn kept(self, sent: &ResourceSlice, got: &ResourceSlice) -> bool {
        let has = |d: &Device| match self {
            GatedFeature::ConsumableCapacity => d.allow_multiple_allocations == Some(true),
            GatedFeature::PartitionableDevices => d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()),
        };
        devices_with(sent, has) == devices_with(got, has)
    }
}

/// Keeps the node's slices in the API server equal to the devices it is given.
pub struct Publisher {
    api: kube::Api<ResourceSlice>,
    client: kube::Client,
    node: String,
    /// The slice layout last chosen (logged when it changes).
    layout: std::sync::Mutex<Option<SliceLayout>>,
    /// What becomes of unhealthy devices whatever the server's version: set by
    /// [`Publisher::with_layout`], or to removal once the server dropped the taints written.
    unhealthy: std::sync::Mutex<Option<Unhealthy>>,
    /// Features whose fields the server dropped: the devices needing them are not published.
    dropped: std::sync::Mutex<Vec<GatedFeature>>,
}

/// What one sync did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Synced {
    pub created: bool,
    pub updated: bool,
    pub deleted: usize,
    /// The server dropped the taints written: sync again (removing unhealthy devices).
    pub taints_dropped: bool,
    /// The server dropped a feature's fields: sync again (without the devices needing it).
    pub feature_dropped: bool,
}

fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Publisher {
    pub fn new(client: kube::Client, node: impl Into<String>) -> Publisher {
        Publisher {
            api: kube::Api::all(client.clone()),
            client,
            node: node.into(),
            layout: Default::default(),
            unhealthy: Default::default(),
            dropped: Default::default(),
        }
    }

    /// The features whose fields the API server dropped (their gates off), so far.
    pub fn dropped_features(&self) -> Vec<GatedFeature> {
        locked(&self.dropped).clone()
    }

    /// A written slice came back without a feature's fields: the devices needing it leave the pool.
    fn check_features(&self, sent: &ResourceSlice, got: &ResourceSlice) -> bool {
        let mut all_kept = true;
        for f in [GatedFeature::ConsumableCapacity, GatedFeature::PartitionableDevices] {
            if f.kept(sent, got) || locked(&self.dropped).contains(&f) {
                continue;
            }
            all_kept = false;
            locked(&self.dropped).push(f);
            let (what, devices) = match f {
                GatedFeature::ConsumableCapacity => ("allowMultipleAllocations", "the shared devices (gpu-N-shared)"),
                GatedFeature::PartitionableDevices => ("consumesCounters", "the dynamic MIG placements"),
            };
            tracing::error!(
                node = %self.node,
                "the API server dropped {what} from the ResourceSlice: its {gate} feature gate is off; {devices} \
                 leave the slice (set {gate}=true on kube-apiserver, kube-scheduler, kube-controller-manager and \
                 the kubelet, then restart tesserad)",
                gate = f.gate()
            );
        }
        all_kept
    }

    /// Unhealthy devices are handled as `layout` says, whatever the server's version.
    pub fn with_layout(self, layout: Unhealthy) -> Publisher {
        *locked(&self.unhealthy) = Some(layout);
        self
    }

    /// The slice layout and what becomes of unhealthy devices, for the API server's version
    /// (`GET /version`), asked on every pass: a server upgraded to 1.35 or 1.36 gets the new
    /// layout at the next sync.
    pub async fn layout(&self) -> Result<(SliceLayout, Unhealthy), kube::Error> {
        let info = self.client.apiserver_version().await?;
        let layout = SliceLayout::for_info(&info).unwrap_or_else(|| {
            tracing::warn!(major = %info.major, minor = %info.minor, git_version = %info.git_version,
                "cannot read the API server's version; using the 1.35+ slice layout");
            SliceLayout::Separate
        });
        let mut last = locked(&self.layout);
        if *last != Some(layout) {
            tracing::info!(version = %info.git_version, ?layout, "ResourceSlice layout chosen by the API server's version");
            *last = Some(layout);
        }
        let unhealthy = locked(&self.unhealthy).unwrap_or_else(|| unhealthy_layout(&info.major, &info.minor));
        Ok((layout, unhealthy))
    }

    /// A written slice came back without its taints: remove unhealthy devices from now on.
    fn check_taints(&self, sent: &ResourceSlice, got: &ResourceSlice) -> bool {
        if taints_kept(sent, got) {
            return true;
        }
        tracing::warn!(node = %self.node, "the API server dropped the device taints (the DRADeviceTaints feature is off): unhealthy devices leave the slice instead");
        *locked(&self.unhealthy) = Some(Unhealthy::Remove);
        false
    }

    /// One pass: list this driver's slices on this node, create, replace or delete so that exactly
    /// the wanted slices remain. A conflict (someone else changed one) is an error: the caller
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
        let (layout, unhealthy) = self.layout().await?;
        let dropped = self.dropped_features();
        let kept: Vec<DraDevice>;
        let devices = if dropped.is_empty() {
            devices
        } else {
            kept = devices.iter().filter(|d| !dropped.iter().any(|f| f.needed_by(d))).cloned().collect();
            &kept
        };
        let list = self.api.list(&ListParams::default().fields(&self.fields())).await?;
        let version = list.metadata.resource_version.clone().unwrap_or_default();
        let mut out = Synced::default();
        // The server may ignore the field selector: check ourselves.
        let mut current: BTreeMap<String, ResourceSlice> = list
            .items
            .into_iter()
            .filter(|s| s.spec.driver == DRIVER && s.spec.node_name.as_deref() == Some(self.node.as_str()))
            .map(|s| (s.metadata.name.clone().unwrap_or_default(), s))
            .collect();
        let previous: Vec<ResourceSliceSpec> = current.values().map(|s| s.spec.clone()).collect();
        let generation = current.values().map(|s| s.spec.pool.generation).max().unwrap_or(0);
        let same = build_pool_with(&self.node, devices, generation, layout, unhealthy, &previous);
        let existing = |w: &ResourceSlice| current.get(w.metadata.name.as_deref().unwrap_or_default());
        let unchanged = same.iter().all(|w| existing(w).is_some_and(|c| c.spec == w.spec));
        if !unchanged {
            // A new pool starts at 0; a changed one moves every slice to the next generation.
            let next = if same.iter().any(|w| existing(w).is_some()) { generation + 1 } else { 0 };
            for mut want in build_pool_with(&self.node, devices, next, layout, unhealthy, &previous) {
                let name = want.metadata.name.clone().unwrap_or_default();
                let got = match current.remove(&name) {
                    None => {
                        let got = self.api.create(&PostParams::default(), &want).await?;
                        out.created = true;
                        got
                    }
                    Some(cur) => {
                        want.metadata.resource_version = cur.metadata.resource_version.clone();
                        let got = self.api.replace(&name, &PostParams::default(), &want).await?;
                        out.updated = true;
                        got
                    }
                };
                if !self.check_taints(&want, &got) {
                    out.taints_dropped = true;
                }
                if !self.check_features(&want, &got) {
                    out.feature_dropped = true;
                }
            }
        }
        // What is left is stale (an earlier layout, another version's names).
        for w in &same {
            current.remove(w.metadata.name.as_deref().unwrap_or_default());
        }
        for name in current.keys() {
            self.api.delete(name, &DeleteParams::default()).await?;
            out.deleted += 1;
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
                    again_now = s.taints_dropped || s.feature_dropped;
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
#[path = "slices_tests.rs"]
mod tests;
