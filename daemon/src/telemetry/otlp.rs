//! OTLP export (off unless `telemetry.otlp_endpoint` is set): the node's metrics and its events
//! pushed to an OpenTelemetry collector over OTLP/gRPC (opentelemetry-otlp's tonic exporter).
//!
//! Metrics: an `opentelemetry_sdk` meter provider whose periodic reader collects every
//! [`OtlpOptions::interval`] (10 s; `TESSERA_OTLP_INTERVAL_MS` overrides it) on a thread of its
//! own. Every instrument is observable; one collection asks the [`MetricsSource`] once (the
//! first instrument's callback takes the sample, the others read it), so all the points of one
//! export describe the same moment. Names follow the OpenTelemetry conventions (dots, UCUM
//! units):
//!
//! - per GPU (attributes `gpu.index`, `gpu.uuid`, `gpu.model`, and `gpu.mig.profile` for a MIG
//!   device): `tessera.gpu.memory.used`, `tessera.gpu.memory.total` (By),
//!   `tessera.gpu.utilization` (%, when known), `tessera.gpu.healthy` (1 or 0), and where NVML
//!   tells them `tessera.gpu.temperature` (Cel), `tessera.gpu.power` (mW),
//!   `tessera.gpu.clock.sm` and `tessera.gpu.clock.memory` (MHz), `tessera.gpu.ecc.corrected` and
//!   `tessera.gpu.ecc.uncorrected` (errors since the last reset);
//! - per container and physical device (attributes `tessera.allocation.id`, `tessera.resource`,
//!   `gpu.uuid`, `tessera.device.id`, and `k8s.namespace.name`, `k8s.pod.name`,
//!   `k8s.container.name` when known): gauges `tessera.container.memory.used`,
//!   `tessera.container.memory.peak`, `tessera.container.memory.limit` (By, only with a limit),
//!   `tessera.container.sm.achieved`, `tessera.container.sm.limit` (%, only with a limit), and
//!   cumulative counters `tessera.container.launches`, `tessera.container.gpu.time`,
//!   `tessera.container.throttled.time` (s), `tessera.container.oom.denials`;
//! - per container: `tessera.container.processes`;
//! - per node: `tessera.allocations` (gauge), `tessera.events`, `tessera.faults` (counters since
//!   the daemon started);
//! - per resource the device plugin serves (attribute `tessera.resource`), while it runs:
//!   `tessera.kubelet.devices.withdrawn` (gauge; `tessera_kubelet_devices_withdrawn`);
//! - enforcement: `tessera.container.limit.breaches` (counter per allocation and device: the
//!   container attributes above, `gpu.uuid`, `tessera.device.id`, `tessera.enforcement.action`,
//!   `tessera.breach.limit` (`memory`/`sm`); Prometheus names it `tessera_container_limit_breaches_total`),
//!   `tessera.container.sm.time` (counter, seconds of SM time by NVML's per-process utilization;
//!   `tessera_container_sm_seconds_total`) and `tessera.unattributed.gpu.processes` (gauge).
//!
//! Logs: every event published on the [`EventBus`] after the exporter starts becomes one log
//! record (event name `tessera.event`): severity from the event's (critical is ERROR), body the
//! message, timestamp the event's, attributes `event.kind` (`FAULT`, `RECOVERY`,
//! `HEALTH_CHANGED`, `PARTITION_CHANGED`, `LIMIT_BREACH`, `UNATTRIBUTED_PROCESS`),
//! `event.sequence`, `device.id`, `device.uuid` and `device.kind` (when the event names a
//! device), `fault.kind` and `xid` (faults and recoveries, when known), `allocation.ids` (the
//! affected holders, when any); a limit breach adds `tessera.enforcement.action`
//! (`KILLED`/`REPORTED`), `tessera.breach.phase`, `process.pids`, `tessera.killed.pids`,
//! `tessera.breach.limit`, then for memory `tessera.memory.used` and `tessera.memory.limit`
//! (bytes), for SM time `tessera.sm.used_percent`, `tessera.sm.limit_percent` and
//! `tessera.sm.window_ms`; an unattributed process adds
//! `process.pid`, `process.command` and `tessera.memory.used`. Records are batched (1 s).
//!
//! Failures never reach the daemon: an export that fails (collector down, refused) is logged at
//! warn once, then at debug until an export succeeds again (logged at info). Exports run on the
//! SDK's own threads and never block the daemon's runtime.
//!
//! Resource: `service.name = "tesserad"`, `service.version`, `host.name`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _, LoggerProvider as _, Severity as LogSeverity};
use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry::{Key, KeyValue};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::logs::{BatchConfigBuilder, BatchLogProcessor, LogBatch, LogExporter, SdkLoggerProvider};
use opentelemetry_sdk::metrics::data::ResourceMetrics;
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider, Temporality};
use tessera_proto::tessera::v1::{
    BreachAction, BreachLimit, BreachPhase, DeviceKind, Event, EventKind, FaultKind, Severity, event,
};
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

use super::TelemetryError;
use super::prometheus::NodeMetrics;
use super::server::MetricsSource;
use crate::events::EventBus;

/// The configuration key errors name.
const KEY: &str = "telemetry.otlp_endpoint";
/// Overrides the collection interval (milliseconds), for tests and for the impatient.
pub const INTERVAL_ENV: &str = "TESSERA_OTLP_INTERVAL_MS";
/// The collection interval unless told otherwise.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// How long one export may take before it is given up.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often batched log records are sent.
const LOG_DELAY: Duration = Duration::from_secs(1);

/// How the exporter runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OtlpOptions {
    /// Between metric collections.
    pub interval: Duration,
    /// The most one export may take.
    pub export_timeout: Duration,
}

impl Default for OtlpOptions {
    fn default() -> Self {
        OtlpOptions { interval: DEFAULT_INTERVAL, export_timeout: EXPORT_TIMEOUT }
    }
}

impl OtlpOptions {
    /// The defaults, with the interval from `TESSERA_OTLP_INTERVAL_MS` when it is a positive
    /// number of milliseconds (anything else is logged and ignored).
    pub fn from_env() -> Self {
        let mut o = OtlpOptions::default();
        if let Some(v) = std::env::var_os(INTERVAL_ENV) {
            match v.to_str().and_then(|s| s.trim().parse::<u64>().ok()).filter(|&ms| ms > 0) {
                Some(ms) => o.interval = Duration::from_millis(ms),
                None => {
                    tracing::warn!(value = %v.to_string_lossy(), "{INTERVAL_ENV} is not a positive number of milliseconds; ignored")
                }
            }
        }
        o
    }
}

/// The running exporter: stop it with [`OtlpExporter::shutdown`] (dropping it stops the
/// providers too, without waiting for a last export).
pub struct OtlpExporter {
    meters: SdkMeterProvider,
    logs: SdkLoggerProvider,
    events_task: JoinHandle<()>,
    endpoint: String,
}

impl std::fmt::Debug for OtlpExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpExporter").field("endpoint", &self.endpoint).finish()
    }
}

/// Starts exporting to `endpoint` (`http://host:port`; the gRPC OTLP port is usually 4317):
/// metrics from `source` every `options.interval`, and every event `events` publishes from now
/// on, until `shutdown` becomes true (then call [`OtlpExporter::shutdown`] to send what is left).
///
/// Must be called inside a Tokio runtime (the gRPC channel lives on it). Nothing is sent now: the
/// channel connects on the first export, so a collector that is down at start is not an error.
/// Errors (an endpoint the exporter cannot use) name `telemetry.otlp_endpoint`.
pub fn start(
    endpoint: &str,
    source: Arc<dyn MetricsSource>,
    events: &EventBus,
    shutdown: watch::Receiver<bool>,
    options: OtlpOptions,
) -> Result<OtlpExporter, TelemetryError> {
    let err = |reason: String| TelemetryError::Listen { key: KEY, addr: endpoint.to_string(), reason };
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(err("the OTLP exporter must be started inside a Tokio runtime".into()));
    }
    if endpoint.starts_with("https://") {
        tracing::warn!(
            endpoint,
            "this build of tesserad has no TLS for OTLP; exports to an https:// endpoint will fail"
        );
    }
    let resource = resource();

    let metric_exporter = opentelemetry_otlp::MetricExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(options.export_timeout)
        .with_temporality(Temporality::Cumulative)
        .build()
        .map_err(|e| err(format!("cannot build the metric exporter: {e}")))?;
    let reader = PeriodicReader::builder(Quiet::new(metric_exporter, "metrics", endpoint))
        .with_interval(options.interval)
        .build();
    let meters = SdkMeterProvider::builder().with_resource(resource.clone()).with_reader(reader).build();
    register(&meters.meter("tessera"), Arc::new(Sample::new(source)));

    let log_exporter = opentelemetry_otlp::LogExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(options.export_timeout)
        .build()
        .map_err(|e| err(format!("cannot build the log exporter: {e}")))?;
    let processor = BatchLogProcessor::builder(Quiet::new(log_exporter, "logs", endpoint))
        .with_batch_config(BatchConfigBuilder::default().with_scheduled_delay(LOG_DELAY).build())
        .build();
    let logs = SdkLoggerProvider::builder().with_resource(resource).with_log_processor(processor).build();

    // Only what happens from now on: what the bus kept from before was sent by the daemon that
    // published it (or, with the exporter off then, was never meant to be).
    let (_, rx) = events.subscribe(0);
    let events_task = tokio::spawn(forward(rx, logs.logger("tessera"), shutdown));
    tracing::info!(endpoint, interval_ms = options.interval.as_millis() as u64, "OTLP export on");
    Ok(OtlpExporter { meters, logs, events_task, endpoint: endpoint.to_string() })
}

impl OtlpExporter {
    /// Stops forwarding events, then sends what is pending (a last metric collection and the
    /// batched records) and stops the providers, waiting at most `grace` in all. The SDK's
    /// shutdown blocks, so it runs on a thread of its own: a collector that does not answer
    /// costs the caller `grace`, never more.
    pub async fn shutdown(self, grace: Duration) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + grace;
        let OtlpExporter { meters, logs, mut events_task, endpoint } = self;
        // The task ends when the shutdown signal it watches is sent; cut it off if not.
        if tokio::time::timeout_at(deadline, &mut events_task).await.is_err() {
            events_task.abort();
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        std::thread::Builder::new()
            .name("otlp-shutdown".into())
            .spawn(move || {
                let l = logs.shutdown_with_timeout(left);
                let m = meters.shutdown_with_timeout(left);
                let _ = tx.send((m, l));
            })
            .map_err(|e| format!("OTLP shutdown thread: {e}"))?;
        match tokio::time::timeout_at(deadline + Duration::from_millis(100), rx).await {
            Ok(Ok((m, l))) => {
                let errors: Vec<String> = [("metrics", m), ("logs", l)]
                    .into_iter()
                    .filter_map(|(w, r)| r.err().map(|e| format!("{w}: {e}")))
                    .collect();
                if errors.is_empty() {
                    Ok(())
                } else {
                    Err(format!("OTLP export to {endpoint}: {}", errors.join("; ")))
                }
            }
            Ok(Err(_)) => Err("OTLP shutdown thread ended without an answer".into()),
            Err(_) => Err(format!("OTLP export to {endpoint} did not stop within {grace:?}; left behind")),
        }
    }
}

fn resource() -> Resource {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
    let mut b = Resource::builder()
        .with_service_name("tesserad")
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    if !host.is_empty() {
        b = b.with_attribute(KeyValue::new("host.name", host));
    }
    b.build()
}

/// One collection's sample of the source, shared by all the instruments of that collection.
struct Sample {
    source: Arc<dyn MetricsSource>,
    last: Mutex<Arc<NodeMetrics>>,
}

impl Sample {
    fn new(source: Arc<dyn MetricsSource>) -> Sample {
        Sample { source, last: Mutex::new(Arc::new(NodeMetrics::default())) }
    }

    /// Asks the source: called by the first instrument's callback of each collection.
    fn refresh(&self) -> Arc<NodeMetrics> {
        let m = Arc::new(self.source.metrics());
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::clone(&m);
        m
    }

    /// What [`Sample::refresh`] took last.
    fn current(&self) -> Arc<NodeMetrics> {
        Arc::clone(&self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

fn gpu_attributes(g: &super::GpuMetrics) -> Vec<KeyValue> {
    let mut a = vec![
        KeyValue::new("gpu.index", i64::from(g.index)),
        KeyValue::new("gpu.uuid", g.uuid.clone()),
        KeyValue::new("gpu.model", g.model.clone()),
    ];
    if let Some(p) = &g.mig_profile {
        a.push(KeyValue::new("gpu.mig.profile", p.clone()));
    }
    if let Some(id) = g.gpu_instance_id {
        a.push(KeyValue::new("gpu.mig.instance.id", i64::from(id)));
    }
    // The one container holding the device (dcgm-exporter's kubelet mapping).
    if let Some(h) = &g.holder {
        for (k, v) in
            [("k8s.namespace.name", &h.namespace), ("k8s.pod.name", &h.pod), ("k8s.container.name", &h.container)]
        {
            if !v.is_empty() {
                a.push(KeyValue::new(k, v.clone()));
            }
        }
    }
    a
}

fn container_attributes(c: &crate::usage::ContainerUsage) -> Vec<KeyValue> {
    let mut a = vec![
        KeyValue::new("tessera.allocation.id", c.allocation_id.clone()),
        KeyValue::new("tessera.resource", c.resource.clone()),
    ];
    let id = &c.container;
    for (k, v) in [
        ("k8s.namespace.name", &id.pod_namespace),
        ("k8s.pod.name", &id.pod_name),
        ("k8s.container.name", &id.container_name),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_empty()) {
            a.push(KeyValue::new(k, v.clone()));
        }
    }
    a
}

fn device_attributes(container: &[KeyValue], d: &crate::usage::DeviceUsage) -> Vec<KeyValue> {
    let mut a = container.to_vec();
    a.push(KeyValue::new("gpu.uuid", d.uuid.clone()));
    a.push(KeyValue::new("tessera.device.id", d.device_id.clone()));
    a
}

/// A value of one container on one device; `None`: no point (no limit).
type DeviceValue<T> = fn(&crate::usage::DeviceUsage) -> Option<T>;

/// Registers every instrument on `meter`. The first one registered (`tessera.allocations`) takes
/// the collection's sample: the SDK runs the callbacks in registration order.
fn register(meter: &Meter, sample: Arc<Sample>) {
    // Per node; the first takes the sample.
    let s = Arc::clone(&sample);
    meter
        .u64_observable_gauge("tessera.allocations")
        .with_description("Allocations held on the node.")
        .with_unit("{allocation}")
        .with_callback(move |o| o.observe(s.refresh().allocations as u64, &[]))
        .build();
    let s = Arc::clone(&sample);
    meter
        .f64_observable_counter("tessera.container.sm.time")
        .with_description(
            "SM time the container's processes got on the GPU, by the driver's per-process utilization (NVML).",
        )
        .with_unit("s")
        .with_callback(move |o| {
            for t in &s.current().enforcement.sm_time {
                o.observe(t.ns as f64 / 1e9, &on_device_attributes(&t.on));
            }
        })
        .build();
    let s = Arc::clone(&sample);
    meter
        .u64_observable_counter("tessera.events")
        .with_description("Events published since the daemon started.")
        .with_unit("{event}")
        .with_callback(move |o| o.observe(s.current().events_total, &[]))
        .build();
    let s = Arc::clone(&sample);
    meter
        .u64_observable_counter("tessera.faults")
        .with_description("Fault events published since the daemon started.")
        .with_unit("{fault}")
        .with_callback(move |o| o.observe(s.current().faults_total, &[]))
        .build();

    // Per GPU.
    type GpuValue = fn(&super::GpuMetrics) -> Option<u64>;
    let gpu: [(&'static str, &'static str, &'static str, GpuValue); 11] = [
        ("tessera.gpu.memory.used", "Device memory in use.", "By", |g| Some(g.memory_used)),
        ("tessera.gpu.memory.total", "Device memory in all.", "By", |g| Some(g.memory_total)),
        ("tessera.gpu.utilization", "Time a kernel ran over the last sample period.", "%", |g| {
            g.utilization_percent.map(u64::from)
        }),
        ("tessera.gpu.healthy", "Whether the device is healthy (1) or not (0).", "1", |g| Some(u64::from(g.healthy))),
        ("tessera.gpu.temperature", "GPU temperature.", "Cel", |g| g.sensors.temperature_c.map(u64::from)),
        ("tessera.gpu.power", "Power draw.", "mW", |g| g.sensors.power_mw.map(u64::from)),
        ("tessera.gpu.clock.sm", "SM clock frequency.", "MHz", |g| g.sensors.sm_clock_mhz.map(u64::from)),
        ("tessera.gpu.clock.memory", "Memory clock frequency.", "MHz", |g| g.sensors.mem_clock_mhz.map(u64::from)),
        ("tessera.gpu.ecc.corrected", "Corrected ECC errors since the last reset.", "{error}", |g| {
            g.sensors.ecc_corrected_volatile
        }),
        ("tessera.gpu.ecc.uncorrected", "Uncorrected ECC errors since the last reset.", "{error}", |g| {
            g.sensors.ecc_uncorrected_volatile
        }),
        ("tessera.gpu.xid.last", "The last XID seen on the GPU (0: none).", "1", |g| g.last_xid.map(u64::from)),
    ];
    for (name, description, unit, get) in gpu {
        let s = Arc::clone(&sample);
        meter
            .u64_observable_gauge(name)
            .with_description(description)
            .with_unit(unit)
            .with_callback(move |o| {
                for g in &s.current().gpus {
                    if let Some(v) = get(g) {
                        o.observe(v, &gpu_attributes(g));
                    }
                }
            })
            .build();
    }

    // Per container and device.
    let gauges: [(&'static str, &'static str, &'static str, DeviceValue<u64>); 4] = [
        ("tessera.container.memory.used", "Device memory the container holds.", "By", |d| Some(d.memory_used)),
        ("tessera.container.memory.peak", "The most device memory the container has held.", "By", |d| {
            Some(d.memory_peak)
        }),
        ("tessera.container.memory.limit", "The container's device memory limit.", "By", |d| d.memory_limit),
        ("tessera.container.sm.limit", "The container's share of the device's SM time.", "%", |d| {
            d.sm_limit_percent.map(u64::from)
        }),
    ];
    for (name, description, unit, get) in gauges {
        let s = Arc::clone(&sample);
        meter
            .u64_observable_gauge(name)
            .with_description(description)
            .with_unit(unit)
            .with_callback(move |o| per_device(&s.current(), get, |v, a| o.observe(v, a)))
            .build();
    }
    let s = Arc::clone(&sample);
    meter
        .f64_observable_gauge("tessera.container.sm.achieved")
        .with_description("GPU time over wall time since the previous sample.")
        .with_unit("%")
        .with_callback(move |o| per_device(&s.current(), |d| Some(d.sm_achieved_percent), |v, a| o.observe(v, a)))
        .build();
    let counters: [(&'static str, &'static str, &'static str, DeviceValue<u64>); 2] = [
        ("tessera.container.launches", "Kernel launches.", "{launch}", |d| Some(d.launches)),
        ("tessera.container.oom.denials", "Allocations refused for passing the memory limit.", "{denial}", |d| {
            Some(d.oom_denials)
        }),
    ];
    for (name, description, unit, get) in counters {
        let s = Arc::clone(&sample);
        meter
            .u64_observable_counter(name)
            .with_description(description)
            .with_unit(unit)
            .with_callback(move |o| per_device(&s.current(), get, |v, a| o.observe(v, a)))
            .build();
    }
    let seconds: [(&'static str, &'static str, DeviceValue<f64>); 2] = [
        ("tessera.container.gpu.time", "GPU (kernel) time used.", |d| Some(d.gpu_time_ns as f64 / 1e9)),
        ("tessera.container.throttled.time", "Time launches were held back by the SM limit.", |d| {
            Some(d.throttled_ns as f64 / 1e9)
        }),
    ];
    for (name, description, get) in seconds {
        let s = Arc::clone(&sample);
        meter
            .f64_observable_counter(name)
            .with_description(description)
            .with_unit("s")
            .with_callback(move |o| per_device(&s.current(), get, |v, a| o.observe(v, a)))
            .build();
    }

    // Enforcement.
    let s = Arc::clone(&sample);
    meter
        .u64_observable_counter("tessera.container.limit.breaches")
        .with_description("Times the container's processes held more device memory than its limit, or took more SM time than its strict share, by NVML.")
        .with_unit("{breach}")
        .with_callback(move |o| {
            for b in &s.current().enforcement.breaches {
                let mut a = on_device_attributes(&b.on);
                a.push(KeyValue::new("tessera.enforcement.action", b.action));
                a.push(KeyValue::new("tessera.breach.limit", b.limit));
                o.observe(b.count, &a);
            }
        })
        .build();
    let s = Arc::clone(&sample);
    meter
        .u64_observable_gauge("tessera.unattributed.gpu.processes")
        .with_description("Processes holding GPU memory that belong to no allocation.")
        .with_unit("{process}")
        .with_callback(move |o| o.observe(s.current().enforcement.unattributed_gpu_processes, &[]))
        .build();
    let s = Arc::clone(&sample);
    meter
        .u64_observable_gauge("tessera.kubelet.devices.withdrawn")
        .with_description(
            "Free devices of the resource told unhealthy to the kubelet: the node API's allocations leave them no room.",
        )
        .with_unit("{device}")
        .with_callback(move |o| {
            for (resource, n) in &s.current().kubelet_withdrawn {
                o.observe(*n, &[KeyValue::new("tessera.resource", resource.clone())]);
            }
        })
        .build();

    // Per container.
    let s = sample;
    meter
        .u64_observable_gauge("tessera.container.processes")
        .with_description("Live processes of the container using the GPU shim.")
        .with_unit("{process}")
        .with_callback(move |o| {
            for c in &s.current().usage.containers {
                o.observe(u64::from(c.processes), &container_attributes(c));
            }
        })
        .build();
}

/// Calls `observe` with `get`'s value and the attributes of every container and device that has one.
fn per_device<T>(m: &NodeMetrics, get: DeviceValue<T>, mut observe: impl FnMut(T, &[KeyValue])) {
    for c in &m.usage.containers {
        let container = container_attributes(c);
        for d in &c.devices {
            if let Some(v) = get(d) {
                observe(v, &device_attributes(&container, d));
            }
        }
    }
}

/// Sends every event `rx` receives to `logger` until `shutdown` is true or the bus is gone.
async fn forward(
    mut rx: broadcast::Receiver<Event>,
    logger: opentelemetry_sdk::logs::SdkLogger,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let received = tokio::select! {
            _ = shutdown.wait_for(|&stop| stop) => break,
            r = rx.recv() => r,
        };
        match received {
            Ok(e) => emit(&logger, &e),
            Err(broadcast::error::RecvError::Lagged(n)) => {
                tracing::warn!(missed = n, "OTLP: events came faster than they could be exported; some were not sent")
            }
            Err(broadcast::error::RecvError::Closed) => break,
        }
    }
}

/// The event as one log record.
fn emit(logger: &opentelemetry_sdk::logs::SdkLogger, e: &Event) {
    let mut r = logger.create_log_record();
    r.set_event_name("tessera.event");
    let (number, text) = match Severity::try_from(e.severity).unwrap_or(Severity::Unspecified) {
        Severity::Critical => (LogSeverity::Error, "CRITICAL"),
        Severity::Warning => (LogSeverity::Warn, "WARNING"),
        Severity::Info | Severity::Unspecified => (LogSeverity::Info, "INFO"),
    };
    r.set_severity_number(number);
    r.set_severity_text(text);
    r.set_body(AnyValue::from(e.message.clone()));
    if e.time_unix_nano > 0 {
        r.set_timestamp(UNIX_EPOCH + Duration::from_nanos(e.time_unix_nano));
    }
    r.set_observed_timestamp(SystemTime::now());
    for (k, v) in attributes(e) {
        r.add_attribute(k, v);
    }
    logger.emit(r);
}

/// The log record's attributes for `e` (see the module documentation).
fn attributes(e: &Event) -> Vec<(Key, AnyValue)> {
    let name = |full: &str, prefix: &str| full.strip_prefix(prefix).unwrap_or(full).to_string();
    let kind =
        EventKind::try_from(e.kind).map_or_else(|_| e.kind.to_string(), |k| name(k.as_str_name(), "EVENT_KIND_"));
    let mut a: Vec<(Key, AnyValue)> =
        vec![(Key::new("event.kind"), kind.into()), (Key::new("event.sequence"), AnyValue::Int(e.sequence as i64))];
    if !e.device_id.is_empty() {
        a.push((Key::new("device.id"), e.device_id.clone().into()));
    }
    if !e.device_uuid.is_empty() {
        a.push((Key::new("device.uuid"), e.device_uuid.clone().into()));
    }
    if let Ok(k) = DeviceKind::try_from(e.device_kind)
        && k != DeviceKind::Unspecified
    {
        a.push((Key::new("device.kind"), name(k.as_str_name(), "DEVICE_KIND_").into()));
    }
    let fault =
        |k: i32| FaultKind::try_from(k).map_or_else(|_| k.to_string(), |k| name(k.as_str_name(), "FAULT_KIND_"));
    let (fault_kind, xid) = match &e.detail {
        Some(event::Detail::Fault(f)) => (Some(fault(f.kind)), f.xid),
        Some(event::Detail::Recovery(r)) => (Some(fault(r.from)), r.xid),
        _ => (None, None),
    };
    if let Some(k) = fault_kind {
        a.push((Key::new("fault.kind"), k.into()));
    }
    if let Some(x) = xid {
        a.push((Key::new("xid"), AnyValue::Int(i64::from(x))));
    }
    if !e.affected.is_empty() {
        let ids = e.affected.iter().map(|h| AnyValue::from(h.allocation_id.clone())).collect();
        a.push((Key::new("allocation.ids"), AnyValue::ListAny(Box::new(ids))));
    }
    let pids = |p: &[u32]| AnyValue::ListAny(Box::new(p.iter().map(|&p| AnyValue::Int(i64::from(p))).collect()));
    let bytes = |b: u64| AnyValue::Int(i64::try_from(b).unwrap_or(i64::MAX));
    match &e.detail {
        Some(event::Detail::LimitBreach(b)) => {
            let action = BreachAction::try_from(b.action)
                .map_or_else(|_| b.action.to_string(), |k| name(k.as_str_name(), "BREACH_ACTION_"));
            let phase = BreachPhase::try_from(b.phase)
                .map_or_else(|_| b.phase.to_string(), |k| name(k.as_str_name(), "BREACH_PHASE_"));
            a.push((Key::new("tessera.enforcement.action"), action.into()));
            a.push((Key::new("tessera.breach.phase"), phase.into()));
            a.push((Key::new("process.pids"), pids(&b.pids)));
            a.push((Key::new("tessera.killed.pids"), pids(&b.killed_pids)));
            if b.limit == BreachLimit::Sm as i32 {
                a.push((Key::new("tessera.breach.limit"), "sm".into()));
                a.push((Key::new("tessera.sm.used_percent"), AnyValue::Int(i64::from(b.sm_percent_used))));
                a.push((Key::new("tessera.sm.limit_percent"), AnyValue::Int(i64::from(b.sm_percent_limit))));
                a.push((Key::new("tessera.sm.window_ms"), AnyValue::Int(i64::from(b.window_ms))));
            } else {
                a.push((Key::new("tessera.breach.limit"), "memory".into()));
                a.push((Key::new("tessera.memory.used"), bytes(b.used_bytes)));
                a.push((Key::new("tessera.memory.limit"), bytes(b.limit_bytes)));
            }
        }
        Some(event::Detail::UnattributedProcess(p)) => {
            a.push((Key::new("process.pid"), AnyValue::Int(i64::from(p.pid))));
            a.push((Key::new("process.command"), p.command.clone().into()));
            a.push((Key::new("tessera.memory.used"), bytes(p.used_bytes)));
        }
        _ => {}
    }
    a
}

/// An exporter that logs its failures itself (warn once per outage, info on recovery) and never
/// hands them to the SDK, which would log every one of them at error level.
struct Quiet<E> {
    inner: E,
    what: &'static str,
    endpoint: String,
    failing: AtomicBool,
}

impl<E> Quiet<E> {
    fn new(inner: E, what: &'static str, endpoint: &str) -> Self {
        Quiet { inner, what, endpoint: endpoint.to_string(), failing: AtomicBool::new(false) }
    }

    fn note(&self, r: OTelSdkResult) -> OTelSdkResult {
        match r {
            Ok(()) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(endpoint = %self.endpoint, "OTLP {} export works again", self.what);
                }
            }
            Err(e) => {
                if self.failing.swap(true, Ordering::Relaxed) {
                    tracing::debug!(endpoint = %self.endpoint, error = %e, "OTLP {} export failed again", self.what);
                } else {
                    tracing::warn!(endpoint = %self.endpoint, error = %e, "OTLP {} export failed; retrying at the next interval", self.what);
                }
            }
        }
        Ok(())
    }
}

impl<E> std::fmt::Debug for Quiet<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quiet").field("what", &self.what).field("endpoint", &self.endpoint).finish()
    }
}

impl<E: PushMetricExporter> PushMetricExporter for Quiet<E> {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let r = self.inner.export(metrics).await;
        self.note(r)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}

impl<E: LogExporter> LogExporter for Quiet<E> {
    async fn export(&self, batch: LogBatch<'_>) -> OTelSdkResult {
        let r = self.inner.export(batch).await;
        self.note(r)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// An allocation on a device, as enforcement's metrics name it (the pod's names when known).
fn on_device_attributes(o: &crate::enforcement::OnDevice) -> Vec<KeyValue> {
    let mut a = vec![
        KeyValue::new("tessera.allocation.id", o.allocation.clone()),
        KeyValue::new("gpu.uuid", o.uuid.clone()),
        KeyValue::new("tessera.device.id", o.device_id.clone()),
    ];
    for (k, v) in [("k8s.namespace.name", &o.namespace), ("k8s.pod.name", &o.pod), ("k8s.container.name", &o.container)]
    {
        if !v.is_empty() {
            a.push(KeyValue::new(k, v.clone()));
        }
    }
    a
}

#[cfg(test)]
#[path = "otlp_tests.rs"]
mod tests;
