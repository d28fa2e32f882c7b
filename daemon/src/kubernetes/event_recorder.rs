//! Faults and recoveries as Kubernetes Events (events.k8s.io/v1, what the kubelet's own
//! recorder writes), on the Node and on the Pod holding the device where the allocation names
//! one. Occurrences of the same reason and action about the same object and device are one Event
//! whose `series` counts them (the events.k8s.io way), not a flood: a new series is created at
//! once, repeats are written at most every [`FLUSH`], and a series ends [`SERIES_WINDOW`] after
//! its last occurrence (the next one starts another Event).
//!
//! [`Coalescer`] is the pure part (what to write when); [`Recorder::run`] follows the event bus and
//! writes through kube-rs, a failed write retried at the next flush (never a hot loop).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use tessera_proto::tessera::v1 as api;
use tokio::sync::{broadcast, watch};

use crate::client_input::cut_to;

/// `reportingController` of every Event tesserad writes.
pub const REPORTING_CONTROLLER: &str = "tessera.io/tesserad";
/// Repeats of a series are written at most this often.
pub const FLUSH: Duration = Duration::from_secs(2);
/// A series ends this long after its last occurrence (client-go's isomorphic-event window).
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
/// The namespace of Events about the Node (a cluster-scoped object), as the kubelet writes them.
pub const NODE_EVENT_NAMESPACE: &str = "default";
/// The longest `note` the API server accepts.
const MAX_NOTE: usize = 1024;

/// `reason` of a fault's Event.
pub const REASON_FAULT: &str = "GPUFault";
/// `reason` of a recovery's Event.
pub const REASON_RECOVERED: &str = "GPURecovered";

/// The object an Event is about.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Regarding {
    /// `Node` or `Pod`.
    pub kind: &'static str,
    /// The Pod's; `None` for the Node.
    pub namespace: Option<String>,
    pub name: String,
    pub uid: Option<String>,
}

impl Regarding {
    fn reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some(self.kind.into()),
            namespace: self.namespace.clone(),
            name: Some(self.name.clone()),
            uid: self.uid.clone(),
            ..Default::default()
        }
    }

    /// Where its Events live.
    fn event_namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or(NODE_EVENT_NAMESPACE)
    }
}

/// One thing to tell the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Occurrence {
    pub regarding: Regarding,
    pub reason: &'static str,
    pub action: &'static str,
    /// `Warning` (a fault) or `Normal` (a recovery).
    pub warning: bool,
    /// The device (GPU or MIG UUID) concerned.
    pub device: String,
    pub note: String,
}

/// What a tessera event becomes: for a fault or a recovery, one occurrence on the Node `node` and
/// one on each Pod among the holders it names; nothing for other kinds.
pub fn occurrences(node: &str, e: &api::Event) -> Vec<Occurrence> {
    let (reason, action, warning) = match (api::EventKind::try_from(e.kind), &e.detail) {
        (Ok(api::EventKind::Fault), Some(api::event::Detail::Fault(f))) => {
            (REASON_FAULT, if f.marks_unhealthy { "MarkedUnhealthy" } else { "AttributedToContainer" }, true)
        }
        (Ok(api::EventKind::Fault), _) => (REASON_FAULT, "MarkedUnhealthy", true),
        (Ok(api::EventKind::Recovery), _) => (REASON_RECOVERED, "MarkedHealthy", false),
        _ => return Vec::new(),
    };
    let device = if e.device_uuid.is_empty() { e.device_id.clone() } else { e.device_uuid.clone() };
    let note = cut_to(format!("{}: {}", device, e.message), MAX_NOTE);
    let mut out = vec![Occurrence {
        regarding: Regarding { kind: "Node", namespace: None, name: node.to_owned(), uid: None },
        reason,
        action,
        warning,
        device: device.clone(),
        note: note.clone(),
    }];
    let mut pods: Vec<Regarding> = e
        .affected
        .iter()
        .filter_map(|h| h.container.as_ref())
        .filter(|c| !c.pod_name.is_empty() && !c.pod_namespace.is_empty())
        .map(|c| Regarding {
            kind: "Pod",
            namespace: Some(c.pod_namespace.clone()),
            name: c.pod_name.clone(),
            uid: Some(c.pod_uid.clone()).filter(|u| !u.is_empty()),
        })
        .collect();
    pods.sort();
    pods.dedup();
    out.extend(pods.into_iter().map(|regarding| Occurrence {
        regarding,
        reason,
        action,
        warning,
        device: device.clone(),
        note: note.clone(),
    }));
    out
}

/// A series' identity: the same reason and action about the same object and device.
type Key = (Regarding, &'static str, &'static str, String);

#[derive(Debug, Clone)]
struct Series {
    occurrence: Occurrence,
    /// The Event's name; a new one when the Event must be created again.
    name: String,
    created: bool,
    /// Occurrences so far, and how many the API server has.
    count: u32,
    written: u32,
    first_time: Timestamp,
    last_time: Timestamp,
    last_seen: Instant,
    last_write: Option<Instant>,
}

/// One write to make.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// Create this Event (in its namespace).
    Create(Box<Event>),
    /// Merge-patch the Event's series.
    Series { namespace: String, name: String, series: EventSeries },
}

/// How a write went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// The Event is gone (expired): create it again.
    Gone,
    Failed,
}

/// Occurrences coalesced into series, and what to write when.
#[derive(Debug)]
pub struct Coalescer {
    instance: String,
    series: BTreeMap<Key, Series>,
    made: u64,
}

impl Coalescer {
    /// Events reported by `reportingInstance` `instance` (e.g. `tesserad-<node>`).
    pub fn new(instance: impl Into<String>) -> Coalescer {
        Coalescer { instance: instance.into(), series: BTreeMap::new(), made: 0 }
    }

    fn name(&mut self, regarding: &Regarding, at: Timestamp) -> String {
        self.made += 1;
        // As client-go names them: the object's name and a unique hex suffix.
        format!("{}.{:x}", regarding.name, at.as_nanosecond() as u64 + self.made)
    }

    /// Notes `o`, seen at `now` (`wall`: the same instant in Unix time).
    pub fn observe(&mut self, o: Occurrence, now: Instant, wall: Timestamp) {
        let key: Key = (o.regarding.clone(), o.reason, o.action, o.device.clone());
        match self.series.get_mut(&key) {
            Some(s) if now.duration_since(s.last_seen) < SERIES_WINDOW => {
                s.count += 1;
                s.last_time = wall;
                s.last_seen = now;
                s.occurrence.note = o.note;
            }
            _ => {
                let name = self.name(&o.regarding, wall);
                let s = Series {
                    occurrence: o,
                    name,
                    created: false,
                    count: 1,
                    written: 0,
                    first_time: wall,
                    last_time: wall,
                    last_seen: now,
                    last_write: None,
                };
                self.series.insert(key, s);
            }
        }
    }

    /// What to write at `now`: a series never written at once, repeats once [`FLUSH`] has passed
    /// since that series' last write. Series ended and fully written are forgotten.
    pub fn due(&mut self, now: Instant) -> Vec<(Write, WriteRef)> {
        self.series.retain(|_, s| s.written < s.count || now.duration_since(s.last_seen) < SERIES_WINDOW);
        let mut out = Vec::new();
        for (key, s) in &self.series {
            let waited = s.last_write.is_none_or(|t| now.duration_since(t) >= FLUSH);
            if s.written >= s.count || !waited {
                continue;
            }
            let series = (s.count >= 2)
                .then_some(EventSeries { count: s.count as i32, last_observed_time: MicroTime(s.last_time) });
            let write = if s.created {
                Write::Series {
                    namespace: s.occurrence.regarding.event_namespace().to_owned(),
                    name: s.name.clone(),
                    series: series.expect("a written series that grew counts at least 2"),
                }
            } else {
                Write::Create(Box::new(self.event(s, series)))
            };
            out.push((write, WriteRef { key: key.clone(), count: s.count }));
        }
        out
    }

    /// Records how a write from [`Coalescer::due`] went.
    pub fn done(&mut self, what: &WriteRef, outcome: Outcome, now: Instant, wall: Timestamp) {
        let made = match self.series.get(&what.key) {
            Some(s) if outcome == Outcome::Gone => Some(s.occurrence.regarding.clone()),
            _ => None,
        };
        let fresh = made.map(|r| self.name(&r, wall));
        let Some(s) = self.series.get_mut(&what.key) else { return };
        s.last_write = Some(now);
        match outcome {
            Outcome::Done => {
                s.created = true;
                s.written = s.written.max(what.count);
            }
            Outcome::Gone => {
                s.created = false;
                s.written = 0;
                s.name = fresh.unwrap_or_default();
                // Write it again at once.
                s.last_write = None;
            }
            Outcome::Failed => {}
        }
    }

    fn event(&self, s: &Series, series: Option<EventSeries>) -> Event {
        let o = &s.occurrence;
        Event {
            metadata: ObjectMeta {
                name: Some(s.name.clone()),
                namespace: Some(o.regarding.event_namespace().to_owned()),
                ..Default::default()
            },
            event_time: Some(MicroTime(s.first_time)),
            series,
            reporting_controller: Some(REPORTING_CONTROLLER.into()),
            reporting_instance: Some(self.instance.clone()),
            action: Some(o.action.into()),
            reason: Some(o.reason.into()),
            regarding: Some(o.regarding.reference()),
            note: Some(o.note.clone()),
            type_: Some(if o.warning { "Warning" } else { "Normal" }.into()),
            ..Default::default()
        }
    }
}

/// Which series a write belongs to, and the count it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteRef {
    key: Key,
    count: u32,
}

/// Writes Events through the API server.
pub struct Recorder {
    client: kube::Client,
    node: String,
}

impl Recorder {
    pub fn new(client: kube::Client, node: impl Into<String>) -> Recorder {
        Recorder { client, node: node.into() }
    }

    async fn write(&self, w: &Write) -> Outcome {
        let result = match w {
            Write::Create(e) => {
                let ns = e.metadata.namespace.clone().unwrap_or_default();
                kube::Api::<Event>::namespaced(self.client.clone(), &ns)
                    .create(&PostParams::default(), e)
                    .await
                    .map(|_| ())
            }
            Write::Series { namespace, name, series } => {
                let patch = serde_json::json!({ "series": series });
                kube::Api::<Event>::namespaced(self.client.clone(), namespace)
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|_| ())
            }
        };
        match result {
            Ok(()) => Outcome::Done,
            Err(kube::Error::Api(s)) if s.code == 404 && matches!(w, Write::Series { .. }) => Outcome::Gone,
            Err(e) => {
                tracing::warn!(error = %e, "writing a Kubernetes Event failed; retrying");
                Outcome::Failed
            }
        }
    }

    /// Follows `bus` (faults and recoveries) until `shutdown` turns true.
    pub async fn run(self, mut bus: broadcast::Receiver<api::Event>, mut shutdown: watch::Receiver<bool>) {
        let mut c = Coalescer::new(format!("tesserad-{}", self.node));
        let mut tick = tokio::time::interval(FLUSH / 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                e = bus.recv() => match e {
                    Ok(e) => for o in occurrences(&self.node, &e) {
                        c.observe(o, Instant::now(), Timestamp::now());
                    },
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "Kubernetes Events fell behind the event bus");
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick() => {}
                changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return },
            }
            for (w, what) in c.due(Instant::now()) {
                let outcome = self.write(&w).await;
                c.done(&what, outcome, Instant::now(), Timestamp::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(pods: &[(&str, &str)]) -> api::Event {
        api::Event {
            kind: api::EventKind::Fault as i32,
            device_id: "GPU-1".into(),
            device_uuid: "GPU-1".into(),
            message: "double-bit ECC error".into(),
            affected: pods
                .iter()
                .map(|(ns, name)| api::Holder {
                    allocation_id: "a1".into(),
                    container: Some(api::ContainerIdentity {
                        pod_namespace: (*ns).into(),
                        pod_name: (*name).into(),
                        pod_uid: format!("{name}-uid"),
                        ..Default::default()
                    }),
                })
                .collect(),
            detail: Some(api::event::Detail::Fault(api::Fault { marks_unhealthy: true, ..Default::default() })),
            ..Default::default()
        }
    }

    #[test]
    fn a_fault_is_told_to_the_node_and_each_pod_holding_the_device() {
        let o = occurrences("node-a", &fault(&[("ml", "train-0"), ("ml", "train-0"), ("", "no-namespace")]));
        let regarding: Vec<(&str, Option<&str>, &str)> =
            o.iter().map(|o| (o.regarding.kind, o.regarding.namespace.as_deref(), o.regarding.name.as_str())).collect();
        assert_eq!(
            regarding,
            [("Node", None, "node-a"), ("Pod", Some("ml"), "train-0")],
            "once per pod, named pods only"
        );
        assert!(o.iter().all(|o| o.warning && o.reason == REASON_FAULT && o.action == "MarkedUnhealthy"));
        assert_eq!(o[0].note, "GPU-1: double-bit ECC error");
        let recovery = api::Event { kind: api::EventKind::Recovery as i32, detail: None, ..fault(&[]) };
        let o = occurrences("node-a", &recovery);
        assert_eq!((o.len(), o[0].reason, o[0].warning), (1, REASON_RECOVERED, false));
        let other = api::Event { kind: api::EventKind::PartitionChanged as i32, ..fault(&[]) };
        assert!(occurrences("node-a", &other).is_empty());
    }

    fn ns(e: &Write) -> &str {
        match e {
            Write::Create(e) => e.metadata.namespace.as_deref().unwrap(),
            Write::Series { namespace, .. } => namespace,
        }
    }

    #[test]
    fn a_flapping_device_is_one_event_with_a_series_count_not_a_flood() {
        let mut c = Coalescer::new("tesserad-node-a");
        let t0 = Instant::now();
        let wall = Timestamp::from_second(1_800_000_000).unwrap();
        let flap = occurrences("node-a", &fault(&[]));
        c.observe(flap[0].clone(), t0, wall);
        let first = c.due(t0);
        assert_eq!(first.len(), 1);
        let Write::Create(e) = &first[0].0 else { panic!("a new series is created at once") };
        assert_eq!(ns(&first[0].0), NODE_EVENT_NAMESPACE);
        assert_eq!(e.series, None);
        assert_eq!(e.reporting_controller.as_deref(), Some(REPORTING_CONTROLLER));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        c.done(&first[0].1, Outcome::Done, t0, wall);
        // 99 more within one flush: nothing written until FLUSH has passed, then one patch.
        for i in 1..100 {
            c.observe(flap[0].clone(), t0 + Duration::from_millis(i * 10), wall);
            assert!(c.due(t0 + Duration::from_millis(i * 10)).is_empty(), "no write per occurrence");
        }
        let later = t0 + FLUSH;
        let writes = c.due(later);
        assert_eq!(writes.len(), 1);
        let Write::Series { series, .. } = &writes[0].0 else { panic!("a repeat patches the series") };
        assert_eq!(series.count, 100);
        c.done(&writes[0].1, Outcome::Done, later, wall);
        assert!(c.due(later + FLUSH).is_empty(), "nothing new, nothing written");
        // The Event expired on the server: created again, with its series.
        c.observe(flap[0].clone(), later + Duration::from_secs(3), wall);
        let w = c.due(later + Duration::from_secs(4));
        c.done(&w[0].1, Outcome::Gone, later + Duration::from_secs(4), wall);
        let w = c.due(later + Duration::from_secs(4));
        let Write::Create(e) = &w[0].0 else { panic!("recreated") };
        assert_eq!(e.series.as_ref().map(|s| s.count), Some(101));
        c.done(&w[0].1, Outcome::Done, later + Duration::from_secs(4), wall);
        // A failed write is retried after FLUSH, not at once.
        c.observe(flap[0].clone(), later + Duration::from_secs(10), wall);
        let w = c.due(later + Duration::from_secs(10));
        c.done(&w[0].1, Outcome::Failed, later + Duration::from_secs(10), wall);
        assert!(c.due(later + Duration::from_secs(11)).is_empty());
        assert_eq!(c.due(later + Duration::from_secs(12)).len(), 1);
        // After the window, the next occurrence starts another Event.
        let w = c.due(later + Duration::from_secs(12));
        c.done(&w[0].1, Outcome::Done, later + Duration::from_secs(12), wall);
        let end = later + Duration::from_secs(12) + SERIES_WINDOW;
        assert!(c.due(end).is_empty());
        c.observe(flap[0].clone(), end, wall);
        let w = c.due(end);
        assert!(matches!(&w[0].0, Write::Create(e) if e.series.is_none()));
    }

    #[test]
    fn different_reasons_objects_and_devices_are_different_series() {
        let mut c = Coalescer::new("i");
        let t0 = Instant::now();
        let wall = Timestamp::from_second(1_800_000_000).unwrap();
        for o in occurrences("node-a", &fault(&[("ml", "p")])) {
            c.observe(o, t0, wall);
        }
        let recovery = api::Event { kind: api::EventKind::Recovery as i32, detail: None, ..fault(&[]) };
        for o in occurrences("node-a", &recovery) {
            c.observe(o, t0, wall);
        }
        let other_gpu = api::Event { device_uuid: "GPU-2".into(), ..fault(&[]) };
        for o in occurrences("node-a", &other_gpu) {
            c.observe(o, t0, wall);
        }
        let writes = c.due(t0);
        assert_eq!(writes.len(), 4, "node fault GPU-1, pod fault, node recovery, node fault GPU-2");
        assert_eq!(writes.iter().filter(|(w, _)| ns(w) == "ml").count(), 1);
        let names: std::collections::BTreeSet<String> = writes
            .iter()
            .map(|(w, _)| match w {
                Write::Create(e) => e.metadata.name.clone().unwrap(),
                Write::Series { name, .. } => name.clone(),
            })
            .collect();
        assert_eq!(names.len(), 4, "unique names");
    }
}
