//! OTLP export against the built `tesserad` on the simulated node, with a collector of the
//! test's own (opentelemetry-proto's MetricsService and LogsService servers over tonic, on a
//! loopback port) that records every request:
//!
//! - metrics arrive with the OpenTelemetry names and units, the GPUs' memory totals equal what
//!   ListDevices reports, no allocations are held, every GPU starts healthy, and the resource
//!   names the service;
//! - an XID injected with `tessera-sim inject xid` becomes a `Fault` event that arrives as a log
//!   record (severity ERROR, `xid`, `event.kind`, `device.uuid`), and the next metrics show the
//!   GPU unhealthy and the fault counted;
//! - SIGTERM stops the daemon promptly with the exporter on;
//! - with no collector listening, the daemon warns and keeps serving.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{LogsService, LogsServiceServer};
use opentelemetry_proto::tonic::collector::logs::v1::{ExportLogsServiceRequest, ExportLogsServiceResponse};
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::logs::v1::LogRecord;
use opentelemetry_proto::tonic::metrics::v1::{Metric, metric, number_data_point};
use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tessera_sim_testkit::{SimNode, binary};
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

mod common;

use common::Daemon;

/// How long anything may take to arrive (a loaded CI machine; exports are every 300 ms).
const DEADLINE: Duration = Duration::from_secs(30);
const INTERVAL_MS: &str = "300";

const NODE: &str = "numa_nodes = 1
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 2
";

/// What the collector received, in order.
#[derive(Default)]
struct Received {
    metrics: Vec<ExportMetricsServiceRequest>,
    logs: Vec<ExportLogsServiceRequest>,
}

#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Received>>);

#[tonic::async_trait]
impl MetricsService for Collector {
    async fn export(
        &self,
        request: Request<ExportMetricsServiceRequest>,
    ) -> Result<Response<ExportMetricsServiceResponse>, Status> {
        self.0.lock().unwrap().metrics.push(request.into_inner());
        Ok(Response::new(ExportMetricsServiceResponse { partial_success: None }))
    }
}

#[tonic::async_trait]
impl LogsService for Collector {
    async fn export(
        &self,
        request: Request<ExportLogsServiceRequest>,
    ) -> Result<Response<ExportLogsServiceResponse>, Status> {
        self.0.lock().unwrap().logs.push(request.into_inner());
        Ok(Response::new(ExportLogsServiceResponse { partial_success: None }))
    }
}

impl Collector {
    async fn start() -> (Collector, SocketAddr) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the collector");
        let addr = listener.local_addr().unwrap();
        let c = Collector::default();
        let server = Server::builder()
            .add_service(MetricsServiceServer::new(c.clone()))
            .add_service(LogsServiceServer::new(c.clone()));
        tokio::spawn(async move {
            server
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .expect("the collector serves");
        });
        (c, addr)
    }

    /// The metrics of the latest export that has all of `names`, by name.
    fn latest(&self, names: &[&str]) -> Option<BTreeMap<String, Metric>> {
        let r = self.0.lock().unwrap();
        r.metrics.iter().rev().find_map(|req| {
            let all: BTreeMap<String, Metric> = req
                .resource_metrics
                .iter()
                .flat_map(|rm| &rm.scope_metrics)
                .flat_map(|sm| &sm.metrics)
                .map(|m| (m.name.clone(), m.clone()))
                .collect();
            names.iter().all(|n| all.contains_key(*n)).then_some(all)
        })
    }

    fn log_records(&self) -> Vec<LogRecord> {
        let r = self.0.lock().unwrap();
        r.logs
            .iter()
            .flat_map(|req| &req.resource_logs)
            .flat_map(|rl| &rl.scope_logs)
            .flat_map(|sl| sl.log_records.clone())
            .collect()
    }

    fn resource_attributes(&self) -> Vec<KeyValue> {
        let r = self.0.lock().unwrap();
        r.metrics
            .first()
            .and_then(|req| req.resource_metrics.first())
            .and_then(|rm| rm.resource.clone())
            .map(|res| res.attributes)
            .unwrap_or_default()
    }
}

/// Polls `f` until it gives something; fails naming `what` (and showing the daemon's log) after
/// the deadline.
async fn until<T>(what: &str, log: &Path, mut f: impl FnMut() -> Option<T>) -> T {
    common::eventually(DEADLINE, log, || f().ok_or_else(|| format!("{what}: not within {DEADLINE:?}"))).await
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attrs.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()).and_then(|v| v.value.as_ref())
}

fn string(v: Option<&any_value::Value>) -> Option<&str> {
    match v {
        Some(any_value::Value::StringValue(s)) => Some(s),
        _ => None,
    }
}

fn int(v: Option<&any_value::Value>) -> Option<i64> {
    match v {
        Some(any_value::Value::IntValue(i)) => Some(*i),
        _ => None,
    }
}

/// A metric's points as (attributes, value); gauges and sums alike, ints as f64.
fn points(m: &Metric) -> Vec<(Vec<KeyValue>, f64)> {
    let dps = match &m.data {
        Some(metric::Data::Gauge(g)) => &g.data_points,
        Some(metric::Data::Sum(s)) => &s.data_points,
        other => panic!("{}: unexpected data {other:?}", m.name),
    };
    dps.iter()
        .map(|p| {
            let v = match p.value {
                Some(number_data_point::Value::AsInt(i)) => i as f64,
                Some(number_data_point::Value::AsDouble(d)) => d,
                None => panic!("{}: a point without a value", m.name),
            };
            (p.attributes.clone(), v)
        })
        .collect()
}

/// Per GPU UUID, the value of `m`.
fn per_gpu(m: &Metric) -> BTreeMap<String, f64> {
    points(m).into_iter().map(|(a, v)| (string(attr(&a, "gpu.uuid")).expect("gpu.uuid").to_string(), v)).collect()
}

/// The node's only point of `m`.
fn single(m: &Metric) -> f64 {
    let p = points(m);
    assert_eq!(p.len(), 1, "{}: {p:?}", m.name);
    p[0].1
}

fn config(node: &SimNode, dir: &Path, endpoint: &str) -> PathBuf {
    let path = dir.join("config.toml");
    let text = format!(
        "nvml_library = {:?}\ndevice_plugin_dir = {:?}\nstate_dir = {:?}\nruntime_dir = {:?}\n\
         [health]\ninterval_seconds = 1\n[telemetry]\notlp_endpoint = {endpoint:?}\n",
        node.nvml_path(),
        dir.join("plugins"),
        dir.join("state"),
        dir.join("run"),
    );
    std::fs::create_dir_all(dir.join("plugins")).expect("plugin dir");
    std::fs::write(&path, text).expect("config");
    path
}

fn spawn(node: &SimNode, config: &Path, log: &Path) -> Daemon {
    if let Some(dir) = config.parent() {
        common::unmount_at_exit(dir);
    }
    let log = std::fs::File::create(log).expect("log file");
    let child = node
        .command(binary("tesserad"))
        .arg("--config")
        .arg(config)
        .env("TESSERA_OTLP_INTERVAL_MS", INTERVAL_MS)
        .env("RUST_LOG", "info")
        .env_remove("NOTIFY_SOCKET")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn tesserad");
    Daemon(child)
}

async fn client(socket: &Path, log: &Path) -> NodeClient<Channel> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("unix://{}", socket.display())).expect("uri");
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Ok(c) = endpoint.connect().await {
            return NodeClient::new(c);
        }
        assert!(
            Instant::now() < deadline,
            "node API not reachable at {}; log:\n{}",
            socket.display(),
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn inject_xid(node: &SimNode, gpu: u32, xid: u32) {
    let out = node
        .command(binary("tessera-sim"))
        .args(["inject", "xid", "--gpu", &gpu.to_string(), "--xid", &xid.to_string()])
        .output()
        .expect("run tessera-sim");
    assert!(out.status.success(), "tessera-sim inject xid: {}", String::from_utf8_lossy(&out.stderr));
}

fn sigterm(daemon: &Daemon) {
    let pid = daemon.0.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_fault_events_reach_the_collector() {
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let (collector, addr) = Collector::start().await;
    let config = config(&node, dir, &format!("http://{addr}"));
    let log = dir.join("tesserad.log");
    let mut daemon = spawn(&node, &config, &log);

    let mut api = client(&dir.join("run/tessera.sock"), &log).await;
    let devices = api
        .list_devices(api::ListDevicesRequest { kinds: vec![api::DeviceKind::Gpu as i32], ..Default::default() })
        .await
        .expect("ListDevices")
        .into_inner()
        .devices;
    assert_eq!(devices.len(), 2, "{devices:?}");
    let memory: BTreeMap<String, f64> = devices.iter().map(|d| (d.uuid.clone(), d.memory_bytes as f64)).collect();
    assert!(memory.values().all(|&m| m > 0.0), "{memory:?}");
    let gpu1 = devices.iter().find(|d| d.index == 1).expect("GPU 1").uuid.clone();

    // Metrics: names, units, values.
    let names = [
        "tessera.gpu.memory.used",
        "tessera.gpu.memory.total",
        "tessera.gpu.utilization",
        "tessera.gpu.healthy",
        "tessera.allocations",
        "tessera.events",
        "tessera.faults",
    ];
    let m = until("metrics with every GPU instrument", &log, || collector.latest(&names)).await;
    assert_eq!(per_gpu(&m["tessera.gpu.memory.total"]), memory, "memory totals as ListDevices reports them");
    assert_eq!(m["tessera.gpu.memory.total"].unit, "By");
    assert_eq!(m["tessera.gpu.memory.used"].unit, "By");
    assert_eq!(m["tessera.gpu.utilization"].unit, "%");
    for (uuid, used) in per_gpu(&m["tessera.gpu.memory.used"]) {
        assert!(used <= memory[&uuid], "{uuid}: {used} used of {}", memory[&uuid]);
    }
    assert!(per_gpu(&m["tessera.gpu.healthy"]).values().all(|&h| h == 1.0), "{:?}", m["tessera.gpu.healthy"]);
    assert_eq!(single(&m["tessera.allocations"]), 0.0);
    assert!(matches!(m["tessera.faults"].data, Some(metric::Data::Sum(ref s)) if s.is_monotonic), "a counter");
    let gauge_point = &points(&m["tessera.gpu.memory.total"])[0].0;
    assert!(int(attr(gauge_point, "gpu.index")).is_some() && string(attr(gauge_point, "gpu.model")).is_some());
    let resource = collector.resource_attributes();
    assert_eq!(string(attr(&resource, "service.name")), Some("tesserad"), "{resource:?}");

    // A fatal XID on GPU 1: a Fault event, exported as a log record. Injected again while none
    // has arrived, in case the health monitor was still starting when the first one came.
    let fault = |r: &LogRecord| int(attr(&r.attributes, "xid")) == Some(48);
    let deadline = Instant::now() + DEADLINE;
    let record = loop {
        inject_xid(&node, 1, 48);
        let retry = Instant::now() + Duration::from_secs(5);
        let found = loop {
            if let Some(r) = collector.log_records().into_iter().find(fault) {
                break Some(r);
            }
            if Instant::now() > retry {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if let Some(r) = found {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "no log record for XID 48; records {:?}; log:\n{}",
            collector.log_records(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    };
    assert_eq!(string(attr(&record.attributes, "event.kind")), Some("FAULT"), "{record:?}");
    assert_eq!(string(attr(&record.attributes, "device.uuid")), Some(gpu1.as_str()), "{record:?}");
    assert_eq!(string(attr(&record.attributes, "fault.kind")), Some("XID"), "{record:?}");
    assert!(int(attr(&record.attributes, "event.sequence")).is_some_and(|s| s > 0), "{record:?}");
    // SEVERITY_NUMBER_ERROR.
    assert_eq!((record.severity_number, record.severity_text.as_str()), (17, "CRITICAL"), "{record:?}");
    assert_eq!(record.event_name, "tessera.event");
    let body = match record.body.as_ref().and_then(|b: &AnyValue| b.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        other => panic!("body {other:?}"),
    };
    assert!(body.contains("48"), "{body}");
    assert!(record.time_unix_nano > 0);

    // The next metrics: GPU 1 out of service, the fault counted.
    until("GPU 1 unhealthy in the metrics", &log, || {
        let m = collector.latest(&names)?;
        let healthy = per_gpu(&m["tessera.gpu.healthy"]);
        (healthy.get(&gpu1) == Some(&0.0) && single(&m["tessera.faults"]) >= 1.0).then_some(())
    })
    .await;

    // SIGTERM: the exporter does not hold the stop up.
    sigterm(&daemon);
    let stopping = Instant::now();
    let status = loop {
        if let Some(s) = daemon.0.try_wait().expect("wait") {
            break s;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(5),
            "no exit within 5 s of SIGTERM; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}; log:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    println!("stopped {:?} after SIGTERM", stopping.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_is_only_a_warning() {
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = config(&node, dir, &format!("http://127.0.0.1:{port}"));
    let log = dir.join("tesserad.log");
    let mut daemon = spawn(&node, &config, &log);
    let mut api = client(&dir.join("run/tessera.sock"), &log).await;

    until("a warning about the failed export", &log, || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines().any(|l| l.contains("WARN") && l.contains("OTLP metrics export failed")).then_some(())
    })
    .await;
    // Still serving, and the warning is not repeated every interval.
    let devices = api.list_devices(api::ListDevicesRequest::default()).await.expect("ListDevices").into_inner().devices;
    assert!(!devices.is_empty());
    assert!(daemon.0.try_wait().expect("wait").is_none(), "the daemon is still running");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(text.matches("OTLP metrics export failed").count(), 1, "{text}");
    let lower = text.to_lowercase();
    assert!(
        !lower.lines().any(|l| l.contains("error") && l.contains("otlp") && !l.contains("warn")),
        "failed exports are warnings, not errors: {text}"
    );
    assert!(!lower.contains("opentelemetry"), "the SDK's own error logs are not used: {text}");

    sigterm(&daemon);
    let stopping = Instant::now();
    while daemon.0.try_wait().expect("wait").is_none() {
        assert!(stopping.elapsed() < Duration::from_secs(5), "no exit within 5 s of SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
