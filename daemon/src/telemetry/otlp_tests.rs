use std::collections::BTreeMap;
use std::sync::atomic::AtomicUsize;

use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use tessera_proto::tessera::v1::{Fault, Holder};

use super::*;
use crate::state::ContainerIdentity;
use crate::usage::{ContainerUsage, DeviceUsage, UsageReport};

/// A source whose `allocations` counts the calls, with `base`'s GPUs and containers.
struct Counting {
    calls: AtomicUsize,
    base: NodeMetrics,
}

impl MetricsSource for Counting {
    fn metrics(&self) -> NodeMetrics {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        NodeMetrics { allocations: n, ..self.base.clone() }
    }
}

/// A point: its attributes (as text) and value.
type Point = (BTreeMap<String, String>, f64);
/// One export: points (and unit) by metric name.
type Export = BTreeMap<String, (String, Vec<Point>)>;

#[derive(Default, Clone)]
struct Capture(Arc<Mutex<Vec<Export>>>);

fn flatten<T: Copy>(data: &MetricData<T>, f: fn(T) -> f64) -> Vec<Point> {
    let attrs =
        |a: &mut dyn Iterator<Item = &KeyValue>| a.map(|kv| (kv.key.to_string(), kv.value.to_string())).collect();
    match data {
        MetricData::Gauge(g) => g.data_points().map(|p| (attrs(&mut p.attributes()), f(p.value()))).collect(),
        MetricData::Sum(s) => s.data_points().map(|p| (attrs(&mut p.attributes()), f(p.value()))).collect(),
        _ => panic!("only gauges and sums"),
    }
}

impl PushMetricExporter for Capture {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let mut export = Export::new();
        for m in metrics.scope_metrics().flat_map(|s| s.metrics()) {
            let points = match m.data() {
                AggregatedMetrics::U64(d) => flatten(d, |v| v as f64),
                AggregatedMetrics::F64(d) => flatten(d, |v| v),
                AggregatedMetrics::I64(_) => panic!("no i64 instruments"),
            };
            export.insert(m.name().to_string(), (m.unit().to_string(), points));
        }
        self.0.lock().unwrap().push(export);
        Ok(())
    }
    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
    fn temporality(&self) -> Temporality {
        Temporality::Cumulative
    }
}

/// Collects `base` twice through the instruments; returns the source's call count and the exports.
fn collect_twice(base: NodeMetrics) -> (usize, Vec<Export>) {
    let capture = Capture::default();
    let reader = PeriodicReader::builder(capture.clone()).with_interval(Duration::from_secs(3600)).build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    let source = Arc::new(Counting { calls: AtomicUsize::new(0), base });
    register(&provider.meter("t"), Arc::new(Sample::new(Arc::clone(&source) as Arc<dyn MetricsSource>)));
    provider.force_flush().unwrap();
    provider.force_flush().unwrap();
    let calls = source.calls.load(Ordering::SeqCst);
    let exports = capture.0.lock().unwrap().clone();
    (calls, exports)
}

fn value(e: &Export, name: &str) -> f64 {
    let (_, points) = e.get(name).unwrap_or_else(|| panic!("no {name} in {e:?}"));
    assert_eq!(points.len(), 1, "{name}: {points:?}");
    points[0].1
}

#[test]
fn one_sample_per_collection() {
    let (calls, exports) = collect_twice(NodeMetrics::default());
    assert_eq!(calls, 2, "one sample per collection");
    assert_eq!(exports.iter().map(|e| value(e, "tessera.allocations")).collect::<Vec<_>>(), [1.0, 2.0]);
    // Without GPUs or containers only the node's instruments have points.
    assert_eq!(
        exports[0].keys().collect::<Vec<_>>(),
        ["tessera.allocations", "tessera.events", "tessera.faults", "tessera.unattributed.gpu.processes"]
    );
}

#[test]
fn gpus_and_containers() {
    let device = DeviceUsage {
        device_id: "GPU-a::0".into(),
        uuid: "GPU-a".into(),
        memory_used: 3 << 30,
        memory_peak: 4 << 30,
        memory_limit: Some(8 << 30),
        sm_limit_percent: None,
        sm_achieved_percent: 37.5,
        launches_per_second: 0.0,
        launches: 1200,
        gpu_time_ns: 2_500_000_000,
        throttled_ns: 500_000_000,
        oom_denials: 2,
        window_ns: 1,
    };
    let on = crate::enforcement::OnDevice {
        allocation: "alloc-1".into(),
        namespace: "ns".into(),
        pod: "pod".into(),
        container: "c".into(),
        uuid: "GPU-a".into(),
        device_id: "GPU-a::0".into(),
    };
    let base = NodeMetrics {
        hostname: "h".into(),
        gpus: vec![super::super::GpuMetrics {
            index: 0,
            uuid: "GPU-a".into(),
            model: "H100".into(),
            memory_used: 5 << 30,
            memory_total: 80 << 30,
            utilization_percent: None,
            healthy: false,
            last_xid: Some(48),
            ..Default::default()
        }],
        usage: UsageReport {
            time_unix_ns: 1,
            containers: vec![ContainerUsage {
                allocation_id: "alloc-1".into(),
                resource: "tessera.io/gpu-share".into(),
                container: ContainerIdentity::of_pod("ns", "pod", "c"),
                processes: 3,
                devices: vec![device],
            }],
        },
        allocations: 0,
        events_total: 4,
        faults_total: 1,
        enforcement: crate::enforcement::Metrics {
            breaches: vec![crate::enforcement::BreachCount {
                on: on.clone(),
                action: "report",
                limit: "memory",
                count: 3,
            }],
            sm_time: vec![crate::enforcement::SmTime { on: on.clone(), ns: 1_250_000_000, as_of_ns: 1 }],
            unattributed_gpu_processes: 5,
        },
        kubelet_withdrawn: [("tessera.io/gpu-share".into(), 2)].into(),
        filesystems: Vec::new(),
        park: Default::default(),
    };
    let (calls, exports) = collect_twice(base);
    assert_eq!(calls, 2);
    let e = &exports[1];
    for (name, unit, want) in [
        ("tessera.gpu.memory.used", "By", (5u64 << 30) as f64),
        ("tessera.gpu.memory.total", "By", (80u64 << 30) as f64),
        ("tessera.gpu.healthy", "1", 0.0),
        ("tessera.gpu.xid.last", "1", 48.0),
        ("tessera.container.memory.used", "By", (3u64 << 30) as f64),
        ("tessera.container.memory.peak", "By", (4u64 << 30) as f64),
        ("tessera.container.memory.limit", "By", (8u64 << 30) as f64),
        ("tessera.container.sm.achieved", "%", 37.5),
        ("tessera.container.launches", "{launch}", 1200.0),
        ("tessera.container.gpu.time", "s", 2.5),
        ("tessera.container.throttled.time", "s", 0.5),
        ("tessera.container.oom.denials", "{denial}", 2.0),
        ("tessera.container.processes", "{process}", 3.0),
        ("tessera.events", "{event}", 4.0),
        ("tessera.faults", "{fault}", 1.0),
        ("tessera.container.limit.breaches", "{breach}", 3.0),
        ("tessera.container.sm.time", "s", 1.25),
        ("tessera.unattributed.gpu.processes", "{process}", 5.0),
        ("tessera.kubelet.devices.withdrawn", "{device}", 2.0),
    ] {
        assert_eq!((e[name].0.as_str(), value(e, name)), (unit, want), "{name}");
    }
    // No utilization known, no SM limit: no points.
    assert!(!e.contains_key("tessera.gpu.utilization") && !e.contains_key("tessera.container.sm.limit"), "{e:?}");
    let gpu = &e["tessera.gpu.memory.total"].1[0].0;
    let want: BTreeMap<String, String> =
        [("gpu.index", "0"), ("gpu.uuid", "GPU-a"), ("gpu.model", "H100")].map(|(k, v)| (k.into(), v.into())).into();
    assert_eq!(gpu, &want);
    let container = &e["tessera.container.launches"].1[0].0;
    let want: BTreeMap<String, String> = [
        ("tessera.allocation.id", "alloc-1"),
        ("tessera.resource", "tessera.io/gpu-share"),
        ("gpu.uuid", "GPU-a"),
        ("tessera.device.id", "GPU-a::0"),
        ("k8s.namespace.name", "ns"),
        ("k8s.pod.name", "pod"),
        ("k8s.container.name", "c"),
    ]
    .map(|(k, v)| (k.into(), v.into()))
    .into();
    assert_eq!(container, &want);
    let breach = &e["tessera.container.limit.breaches"].1[0].0;
    assert_eq!(breach.get("tessera.enforcement.action").map(String::as_str), Some("report"), "{breach:?}");
    assert_eq!(breach.get("k8s.pod.name").map(String::as_str), Some("pod"), "{breach:?}");
    let withdrawn = &e["tessera.kubelet.devices.withdrawn"].1[0].0;
    assert_eq!(withdrawn.get("tessera.resource").map(String::as_str), Some("tessera.io/gpu-share"));
}

#[test]
fn mig_instance_and_sole_holder_attributes() {
    let gpu = |uuid: &str| super::super::GpuMetrics { uuid: uuid.into(), model: "A100".into(), ..Default::default() };
    let base = NodeMetrics {
        gpus: vec![
            super::super::GpuMetrics { last_xid: Some(0), ..gpu("GPU-a") },
            super::super::GpuMetrics {
                mig_profile: Some("3g.40gb".into()),
                gpu_instance_id: Some(2),
                holder: Some(super::super::prometheus::PodLabels {
                    namespace: "ns".into(),
                    pod: "pod".into(),
                    container: "c".into(),
                }),
                ..gpu("MIG-b")
            },
        ],
        ..Default::default()
    };
    let (_, exports) = collect_twice(base);
    let points = &exports[1]["tessera.gpu.memory.total"].1;
    let of = |uuid: &str| &points.iter().find(|p| p.0["gpu.uuid"] == uuid).expect(uuid).0;
    let mig = of("MIG-b");
    for (k, v) in [
        ("gpu.mig.profile", "3g.40gb"),
        ("gpu.mig.instance.id", "2"),
        ("k8s.namespace.name", "ns"),
        ("k8s.pod.name", "pod"),
        ("k8s.container.name", "c"),
    ] {
        assert_eq!(mig.get(k).map(String::as_str), Some(v), "{k}: {mig:?}");
    }
    let whole = of("GPU-a");
    assert!(!whole.contains_key("gpu.mig.instance.id") && !whole.contains_key("k8s.pod.name"), "{whole:?}");
    // The last XID: the whole GPU only, 0 when none.
    let xid = &exports[1]["tessera.gpu.xid.last"].1;
    assert_eq!((xid.len(), xid[0].0["gpu.uuid"].as_str(), xid[0].1), (1, "GPU-a", 0.0));
}

/// Event number `sequence` of `kind` on `device_id` (a device of GPU-1), held by allocation a1.
fn held_by_a1(
    sequence: u64,
    kind: EventKind,
    severity: Severity,
    device_id: &str,
    device_kind: DeviceKind,
    message: &str,
    detail: event::Detail,
) -> Event {
    Event {
        sequence,
        kind: kind as i32,
        severity: severity as i32,
        device_id: device_id.into(),
        device_uuid: "GPU-1".into(),
        device_kind: device_kind as i32,
        affected: vec![Holder { allocation_id: "a1".into(), container: None }],
        message: message.into(),
        detail: Some(detail),
        ..Default::default()
    }
}

/// An event's log attributes by key.
fn attribute_map(e: &Event) -> std::collections::HashMap<String, AnyValue> {
    attributes(e).into_iter().map(|(k, v)| (k.as_str().to_string(), v)).collect()
}

#[test]
fn limit_breach_attributes() {
    let breach = event::Detail::LimitBreach(tessera_proto::tessera::v1::LimitBreach {
        allocation_id: "a1".into(),
        pids: vec![10, 11],
        used_bytes: 3 << 30,
        limit_bytes: 1 << 30,
        action: BreachAction::Killed as i32,
        killed_pids: vec![11],
        phase: BreachPhase::Started as i32,
        gpu_index: 1,
        limit: BreachLimit::Memory as i32,
        ..Default::default()
    });
    let e = held_by_a1(9, EventKind::LimitBreach, Severity::Warning, "GPU-1::0", DeviceKind::Share, "over", breach);
    let a = attribute_map(&e);
    assert_eq!(a["event.kind"], AnyValue::from("LIMIT_BREACH".to_string()));
    assert_eq!(a["tessera.breach.limit"], AnyValue::from("memory".to_string()));
    assert_eq!(a["tessera.enforcement.action"], AnyValue::from("KILLED".to_string()));
    assert_eq!(a["tessera.breach.phase"], AnyValue::from("STARTED".to_string()));
    assert_eq!(a["tessera.killed.pids"], AnyValue::ListAny(Box::new(vec![AnyValue::Int(11)])));
    assert_eq!(a["process.pids"], AnyValue::ListAny(Box::new(vec![AnyValue::Int(10), AnyValue::Int(11)])));
    assert_eq!(a["tessera.memory.used"], AnyValue::Int(3 << 30));
    assert_eq!(a["tessera.memory.limit"], AnyValue::Int(1 << 30));
    assert_eq!(a["allocation.ids"], AnyValue::ListAny(Box::new(vec![AnyValue::from("a1".to_string())])));

    // SM time: its percents and window, no memory figures.
    let sm = Event {
        detail: Some(event::Detail::LimitBreach(tessera_proto::tessera::v1::LimitBreach {
            limit: BreachLimit::Sm as i32,
            sm_percent_used: 97,
            sm_percent_limit: 25,
            window_ms: 5000,
            ..Default::default()
        })),
        ..e
    };
    let a = attribute_map(&sm);
    assert_eq!(a["tessera.breach.limit"], AnyValue::from("sm".to_string()));
    assert_eq!(
        (&a["tessera.sm.used_percent"], &a["tessera.sm.limit_percent"], &a["tessera.sm.window_ms"]),
        (&AnyValue::Int(97), &AnyValue::Int(25), &AnyValue::Int(5000))
    );
    assert!(!a.contains_key("tessera.memory.used"), "{a:?}");
}

#[test]
fn fault_attributes() {
    let xid = event::Detail::Fault(Fault { kind: FaultKind::Xid as i32, xid: Some(48), ..Default::default() });
    let e = held_by_a1(7, EventKind::Fault, Severity::Critical, "GPU-1", DeviceKind::Gpu, "XID 48", xid);
    let a = attribute_map(&e);
    assert_eq!(a["event.kind"], AnyValue::from("FAULT".to_string()));
    assert_eq!(a["event.sequence"], AnyValue::Int(7));
    assert_eq!(a["device.kind"], AnyValue::from("GPU".to_string()));
    assert_eq!(a["fault.kind"], AnyValue::from("XID".to_string()));
    assert_eq!(a["xid"], AnyValue::Int(48));
    assert_eq!(a["allocation.ids"], AnyValue::ListAny(Box::new(vec![AnyValue::from("a1".to_string())])));
}
