//! Which pod holds each allocation, from the kubelet's pod-resources API (v1 `List`).
//!
//! The kubelet's `Allocate` does not say which pod it is for; its pod-resources API lists every
//! pod's containers with the devices they were given. Every [`Settings::interval`] (and soon after
//! each `Allocate`) the task calls `List` and:
//!
//! - names allocations: a container listing exactly an allocation's devices (same resource, same
//!   set of device ids) is its container: namespace, pod and container name are written to the
//!   record (durably) and to its `limits` file, so the node API, usage, metrics and the shim all
//!   show it;
//! - releases allocations whose container is gone: a kubelet allocation none of whose devices any
//!   pod has listed for [`Settings::grace`] on end, that is at least that old and was not handed
//!   to the kubelet in that time, is removed with its directory.
//!
//! Fail soft: with no socket, or a `List` that fails, nothing is named and nothing is released
//! (no pod-resources means no attribution, never data loss). Allocations made through the node API
//! or the hook are never released here: the kubelet does not know them.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use tessera_proto::podresources::v1::{ListPodResourcesRequest, ListPodResourcesResponse};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::node::NodeController;
use crate::state::record::unix_ns;
use crate::state::{Allocation, ContainerIdentity, Source};

/// How often `List` is called.
pub const INTERVAL: Duration = Duration::from_secs(2);
/// How long an allocation's devices must go unlisted (and how old it must be) before it is
/// released: the kubelet lists a pod's devices only once its container is being created.
pub const GRACE: Duration = Duration::from_secs(60);
/// Overrides [`GRACE`], in seconds (for tests).
pub const GRACE_ENV: &str = "TESSERA_POD_RESOURCES_GRACE_SECONDS";
/// How long after an `Allocate` the next `List` is made (the container is created after it).
const AFTER_ALLOCATE: Duration = Duration::from_millis(300);
/// Connecting and each call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// A large node's `List` exceeds tonic's 4 MiB default.
const MAX_MESSAGE: usize = 64 << 20;

/// When the task looks and how long it waits before releasing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub interval: Duration,
    pub grace: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { interval: INTERVAL, grace: GRACE }
    }
}

impl Settings {
    /// The defaults, with the grace period from `$TESSERA_POD_RESOURCES_GRACE_SECONDS` if set.
    pub fn from_env() -> Settings {
        let mut s = Settings::default();
        if let Some(v) = std::env::var_os(GRACE_ENV) {
            match v.to_str().and_then(|v| v.trim().parse::<u64>().ok()) {
                Some(secs) => s.grace = Duration::from_secs(secs),
                None => tracing::warn!(value = %v.to_string_lossy(), "{GRACE_ENV} is not a number of seconds; ignored"),
            }
        }
        s
    }
}

/// One container's devices of one resource, as the kubelet lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub resource: String,
    pub device_ids: BTreeSet<String>,
}

/// Flattens a `List` answer: one entry per container and resource (entries of the same resource
/// are merged).
pub fn listed(resp: &ListPodResourcesResponse) -> Vec<Listed> {
    let mut out: Vec<Listed> = Vec::new();
    for pod in &resp.pod_resources {
        for c in &pod.containers {
            let first = out.len();
            for d in &c.devices {
                if let Some(e) = out[first..].iter_mut().find(|e| e.resource == d.resource_name) {
                    e.device_ids.extend(d.device_ids.iter().cloned());
                } else {
                    out.push(Listed {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: c.name.clone(),
                        resource: d.resource_name.clone(),
                        device_ids: d.device_ids.iter().cloned().collect(),
                    });
                }
            }
        }
    }
    out
}

/// What one `List` asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Allocations whose container is now known (or changed), with the identity to record.
    pub attribute: Vec<(String, ContainerIdentity)>,
    /// Allocations whose container is gone.
    pub release: Vec<String>,
}

/// Remembers, across `List` calls, since when each allocation's devices have been unlisted.
#[derive(Debug, Default)]
pub struct Tracker {
    missing_since: HashMap<String, Instant>,
}

impl Tracker {
    /// Decides from a successful `List`. `now_ns` is the wall clock (records carry their creation
    /// time in it); `handed_out` says when the kubelet was last given an allocation.
    pub fn plan(
        &mut self,
        allocations: &[Allocation],
        listed: &[Listed],
        grace: Duration,
        now: Instant,
        now_ns: u64,
        handed_out: impl Fn(&str) -> Option<Instant>,
    ) -> Plan {
        let mut plan = Plan::default();
        let seen: HashSet<(&str, &str)> =
            listed.iter().flat_map(|l| l.device_ids.iter().map(|d| (l.resource.as_str(), d.as_str()))).collect();
        let grace_ns = u64::try_from(grace.as_nanos()).unwrap_or(u64::MAX);
        for alloc in allocations.iter().filter(|a| a.source == Source::Kubelet) {
            let devices: BTreeSet<String> = alloc.devices.iter().map(|d| d.device_id.clone()).collect();
            if let Some(l) = listed.iter().find(|l| l.resource == alloc.resource && l.device_ids == devices) {
                self.missing_since.remove(&alloc.id);
                let identity = identity(&alloc.container, l);
                if identity != alloc.container {
                    plan.attribute.push((alloc.id.clone(), identity));
                }
                continue;
            }
            if devices.iter().any(|d| seen.contains(&(alloc.resource.as_str(), d.as_str()))) {
                // Some of its devices are listed: someone holds them, keep it.
                self.missing_since.remove(&alloc.id);
                continue;
            }
            let since = *self.missing_since.entry(alloc.id.clone()).or_insert(now);
            let unlisted_long = now.saturating_duration_since(since) >= grace;
            let old = now_ns.saturating_sub(alloc.created_unix_ns) >= grace_ns;
            let quiet = handed_out(&alloc.id).is_none_or(|at| now.saturating_duration_since(at) >= grace);
            if unlisted_long && old && quiet {
                plan.release.push(alloc.id.clone());
            }
        }
        let ids: HashSet<&str> = allocations.iter().map(|a| a.id.as_str()).collect();
        self.missing_since.retain(|id, _| ids.contains(id.as_str()) && !plan.release.contains(id));
        plan
    }
}

/// The identity `listed` gives a record that had `current`: the pod's uid and the container id
/// (the hook's) are kept while the pod and container stay the same.
fn identity(current: &ContainerIdentity, l: &Listed) -> ContainerIdentity {
    let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    let (namespace, pod, container) = (nonempty(&l.namespace), nonempty(&l.pod), nonempty(&l.container));
    let same = current.pod_name.is_none()
        || (current.pod_namespace == namespace && current.pod_name == pod && current.container_name == container);
    let mut next = if same { current.clone() } else { ContainerIdentity::default() };
    next.pod_namespace = namespace;
    next.pod_name = pod;
    next.container_name = container;
    next
}

/// Starts the task: until `shutdown` turns true, `List` from `socket` every 2 s and after each
/// `Allocate`, naming and releasing allocations (see the module docs). The grace period is
/// [`GRACE`] unless `$TESSERA_POD_RESOURCES_GRACE_SECONDS` says otherwise.
pub fn spawn(controller: Arc<NodeController>, socket: PathBuf, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    spawn_with(controller, socket, Settings::from_env(), shutdown)
}

/// [`spawn`] with explicit settings.
pub fn spawn_with(
    controller: Arc<NodeController>,
    socket: PathBuf,
    settings: Settings,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        tracing::info!(socket = %socket.display(), grace_s = settings.grace.as_secs(), "reading pod resources");
        let allocated = controller.allocator().allocated();
        let tracker = Arc::new(std::sync::Mutex::new(Tracker::default()));
        let mut failing = false;
        loop {
            if *shutdown.borrow() {
                break;
            }
            // What the hook or the runtime wrapper recorded (the runtime's container id, a CRI
            // runtime's pod annotations), with or without a kubelet.
            let c = Arc::clone(&controller);
            let _ = tokio::task::spawn_blocking(move || c.allocator().adopt_owner_records()).await;
            if !socket.exists() {
                tracing::debug!(socket = %socket.display(), "no pod-resources socket; allocations stay unnamed");
            } else {
                match list(&socket).await {
                    Ok(resp) => {
                        if failing {
                            tracing::info!(socket = %socket.display(), "pod resources readable again");
                            failing = false;
                        }
                        let (c, t) = (Arc::clone(&controller), Arc::clone(&tracker));
                        let grace = settings.grace;
                        if let Err(e) = tokio::task::spawn_blocking(move || apply(&c, &t, &resp, grace)).await {
                            tracing::error!(error = %e, "pod-resources pass failed");
                        }
                    }
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(socket = %socket.display(), error = %e, "cannot list pod resources; nothing is released meanwhile");
                    }
                    Err(e) => tracing::debug!(socket = %socket.display(), error = %e, "cannot list pod resources"),
                }
            }
            tokio::select! {
                () = tokio::time::sleep(settings.interval) => {}
                () = allocated.notified() => {
                    tokio::select! {
                        () = tokio::time::sleep(AFTER_ALLOCATE) => {}
                        r = shutdown.changed() => if r.is_err() { break },
                    }
                }
                r = shutdown.changed() => if r.is_err() { break },
            }
        }
        tracing::debug!("pod-resources task stopped");
    })
}

/// One `List` call on a fresh connection (the kubelet recreates its socket when it restarts).
async fn list(socket: &Path) -> Result<ListPodResourcesResponse, String> {
    let endpoint = crate::socket::unix_endpoint(socket, CALL_TIMEOUT)?;
    let channel = endpoint.connect().await.map_err(|e| format!("connecting: {e}"))?;
    let mut client = PodResourcesListerClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
    client.list(ListPodResourcesRequest {}).await.map(tonic::Response::into_inner).map_err(|s| s.to_string())
}

/// Applies one successful `List`: names, then releases.
fn apply(
    controller: &NodeController,
    tracker: &std::sync::Mutex<Tracker>,
    resp: &ListPodResourcesResponse,
    grace: Duration,
) {
    let allocator = controller.allocator();
    let allocations = allocator.allocations();
    let listed = listed(resp);
    let plan = tracker.lock().unwrap_or_else(std::sync::PoisonError::into_inner).plan(
        &allocations,
        &listed,
        grace,
        Instant::now(),
        unix_ns(),
        |id| allocator.handed_out(id),
    );
    for (id, identity) in plan.attribute {
        let name = identity.display_name().unwrap_or_default();
        match allocator.set_container(&id, identity) {
            Ok(true) => tracing::info!(%id, container = %name, "allocation attributed"),
            Ok(false) => {}
            Err(e) => tracing::warn!(%id, error = %e.message(), "cannot record the allocation's container"),
        }
    }
    for id in plan.release {
        let Some(alloc) = allocations.iter().find(|a| a.id == id) else { continue };
        match allocator.release_unclaimed(&id, grace) {
            Ok(true) => tracing::info!(
                %id,
                resource = %alloc.resource,
                container = %alloc.container.display_name().unwrap_or_default(),
                devices = ?alloc.devices.iter().map(|d| &d.device_id).collect::<Vec<_>>(),
                "allocation released: no pod lists its devices any more"
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!(%id, error = %e.message(), "cannot release the allocation"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::tests::dev;
    use tessera_proto::podresources::v1::{ContainerDevices, ContainerResources, PodResources};

    const SHARE: &str = "tessera.io/gpu-share";
    const SEC: u64 = 1_000_000_000;

    fn alloc(id: &str, devices: &[&str], created_s: u64, source: Source) -> Allocation {
        Allocation {
            id: id.into(),
            resource: SHARE.into(),
            container: ContainerIdentity::default(),
            source,
            created_unix_ns: created_s * SEC,
            devices: devices.iter().map(|d| dev(d, "GPU-a", None, None)).collect(),
            claim: None,
        }
    }

    fn pod(ns: &str, name: &str, container: &str, devices: &[&str]) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: ns.into(),
            containers: vec![ContainerResources {
                name: container.into(),
                devices: vec![
                    ContainerDevices {
                        resource_name: SHARE.into(),
                        device_ids: devices.iter().take(1).map(|d| (*d).into()).collect(),
                        topology: None,
                    },
                    ContainerDevices {
                        resource_name: SHARE.into(),
                        device_ids: devices.iter().skip(1).map(|d| (*d).into()).collect(),
                        topology: None,
                    },
                ],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn names_exact_matches_and_keeps_the_hooks_container_id() {
        let mut a = alloc("a", &["GPU-a::0", "GPU-a::1"], 0, Source::Kubelet);
        a.container.container_id = Some("c0ffee".into());
        let b = alloc("b", &["GPU-a::2"], 0, Source::Kubelet);
        let resp = ListPodResourcesResponse {
            pod_resources: vec![
                pod("ns", "p", "main", &["GPU-a::1", "GPU-a::0"]),
                pod("ns", "q", "c", &["GPU-a::2", "GPU-a::3"]),
            ],
        };
        let l = listed(&resp);
        assert_eq!(l.len(), 2, "one entry per container and resource: {l:?}");
        let now = Instant::now();
        let plan = Tracker::default().plan(&[a.clone(), b], &l, GRACE, now, 1000 * SEC, |_| None);
        assert_eq!(plan.attribute.len(), 1, "b is only part of q's devices: not named, not released");
        let (id, who) = &plan.attribute[0];
        assert_eq!(id, "a");
        assert_eq!(who.display_name().as_deref(), Some("ns/p/main"));
        assert_eq!(who.container_id.as_deref(), Some("c0ffee"));
        assert!(plan.release.is_empty());
        // Already named: nothing to write. Another pod took the record over: its ids go.
        a.container = who.clone();
        let plan = Tracker::default().plan(std::slice::from_ref(&a), &l, GRACE, now, 1000 * SEC, |_| None);
        assert!(plan.attribute.is_empty());
        let other = listed(&ListPodResourcesResponse {
            pod_resources: vec![pod("ns", "r", "main", &["GPU-a::0", "GPU-a::1"])],
        });
        let plan = Tracker::default().plan(&[a], &other, GRACE, now, 1000 * SEC, |_| None);
        assert_eq!(plan.attribute[0].1.display_name().as_deref(), Some("ns/r/main"));
        assert_eq!(plan.attribute[0].1.container_id, None);
    }

    #[test]
    fn config_key() {
        use crate::config::Config;
        let c = Config::parse("").unwrap();
        assert_eq!(c.pod_resources_socket, Path::new(tessera_proto::podresources::v1::POD_RESOURCES_SOCKET));
        assert!(Config::parse("pod_resources_socket = \"\"").unwrap().pod_resources_socket.as_os_str().is_empty());
        let e = Config::parse("pod_resources_socket = \"kubelet.sock\"").unwrap_err();
        assert_eq!(e.key, "pod_resources_socket", "{e}");
        let e = Config::parse(&format!("pod_resources_socket = \"/{}\"", "x".repeat(120))).unwrap_err();
        assert_eq!(e.key, "pod_resources_socket", "{e}");
    }

    #[test]
    fn releases_only_after_the_grace_period_unlisted() {
        let grace = Duration::from_secs(60);
        let t0 = Instant::now();
        let now_ns = 1000 * SEC;
        let allocs = [
            alloc("old", &["GPU-a::0"], 0, Source::Kubelet),
            alloc("young", &["GPU-a::1"], 1000 - 10, Source::Kubelet),
            alloc("api", &["GPU-a::2"], 0, Source::NodeApi),
            alloc("reused", &["GPU-a::3"], 0, Source::Kubelet),
        ];
        let handed = |id: &str| (id == "reused").then_some(t0 + Duration::from_secs(30));
        let mut t = Tracker::default();
        // First seen unlisted now: the clock starts, nothing goes.
        assert!(t.plan(&allocs, &[], grace, t0, now_ns, handed).release.is_empty());
        let t1 = t0 + grace;
        let plan = t.plan(&allocs, &[], grace, t1 - Duration::from_secs(1), now_ns, handed);
        assert!(plan.release.is_empty(), "{plan:?}");
        // Unlisted for the grace period: the old one goes; the young one, the node API's and the
        // one just handed out stay.
        let plan = t.plan(&allocs, &[], grace, t1, now_ns, handed);
        assert_eq!(plan.release, ["old"]);
        // Listed again in between: the clock restarts.
        let mut t = Tracker::default();
        t.plan(&allocs, &[], grace, t0, now_ns, handed);
        let back = listed(&ListPodResourcesResponse { pod_resources: vec![pod("ns", "p", "c", &["GPU-a::0"])] });
        t.plan(&allocs, &back, grace, t0 + Duration::from_secs(30), now_ns, handed);
        assert!(t.plan(&allocs, &[], grace, t1, now_ns, handed).release.is_empty());
    }
}
