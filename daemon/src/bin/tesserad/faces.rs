//! The faces tesserad runs, each started by its own module with its own tasks, and stopped in
//! order: the controller's records follower (what the records hold, published with the offer),
//! the kubelet's device plugins, the DRA driver, Kubernetes Events and Node labels, the
//! node API, the health monitor, the pending-reset watch, the enforcement loop, leases, the
//! ledger, pod-resources, metrics and OTLP.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::host::sd_notify;
use tessera_daemon::config::Config;
use tessera_daemon::kubelet::KubeletError;
use tessera_daemon::kubelet::served;
use tessera_daemon::node::NodeController;
use tessera_daemon::telemetry::{self, OtlpExporter};
use tessera_daemon::{api, dra, enforcement, health, kubernetes, lease, ledger, podresources};

/// How long a stopping server may take before it is cut off.
pub const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// A task waited for at the stop, with what it is called in the warning when it does not stop
/// in time.
type Named = (&'static str, Pin<Box<dyn Future<Output = ()> + Send>>);

fn named<T: Send + 'static>(what: &'static str, task: JoinHandle<T>) -> Named {
    (
        what,
        Box::pin(async move {
            let _ = task.await;
        }),
    )
}

/// Every face's tasks, as started.
pub struct Faces {
    device_plugins: JoinHandle<Result<(), KubeletError>>,
    metrics: Option<JoinHandle<std::io::Result<()>>>,
    otlp: Option<OtlpExporter>,
    /// Stopped in this order, each within [`STOP_GRACE`].
    tasks: Vec<Named>,
    api: JoinHandle<std::io::Result<()>>,
}

impl Faces {
    /// Starts every face `cfg` asks for; `Err` is tesserad's exit code, the reason said on stderr.
    pub async fn start(
        controller: &Arc<NodeController>,
        cfg: &Config,
        started: Instant,
        shutdown: &watch::Receiver<bool>,
    ) -> Result<Faces, std::process::ExitCode> {
        let fail = |what: String, code: u8| {
            eprintln!("tesserad: {what}");
            std::process::ExitCode::from(code)
        };
        // What the DRA driver publishes (modes `dra`, `both`) is not served by the device plugin;
        // on a cluster without DRA (an API server before 1.34, ...) the device plugin serves all.
        let mode = dra::driver::effective_mode(cfg).await;
        // What the allocation records hold is published with the offer, so the device plugin
        // and the DRA driver follow one channel.
        let mut tasks = vec![named("the records follower", controller.follow_records(shutdown.clone()))];
        // Allocations parked by preemption resume once their room is back, whichever way it came.
        tasks.push(named("the preempted allocations' resume", controller.follow_preempted(shutdown.clone())));
        let device_plugins = served::start(Arc::clone(controller), cfg, mode, started, shutdown.clone())
            .map_err(|e| fail(e.to_string(), 1))?;
        let dra_task = if mode.dra() {
            let task = dra::driver::start(Arc::clone(controller), cfg, shutdown.clone())
                .await
                .map_err(|e| fail(format!("DRA driver: {e}"), 2))?;
            Some(named("the DRA driver", task))
        } else {
            None
        };
        let kubernetes_task = kubernetes::start(Arc::clone(controller), cfg, shutdown.clone())
            .await
            .map_err(|e| fail(format!("kubernetes: {e}"), 2))?
            .map(|task| named("the Kubernetes Events and labels", task));
        let api_socket = cfg.node_api_socket();
        let api_listener =
            api::bind(&api_socket).map_err(|e| fail(format!("node API socket {}: {e}", api_socket.display()), 1))?;
        // The enforcement loop's counters, shared with the node API (GetUsage) and telemetry.
        let stats = Arc::new(enforcement::Stats::default());
        let api = tokio::spawn(api::serve_on(
            api_listener,
            api_socket,
            Arc::clone(controller),
            Some(Arc::clone(&stats)),
            shutdown.clone(),
        ));
        // Ready once the node API serves. Registration with the kubelet goes on in the background
        // (each plugin retries and logs why it waits): a stale kubelet.sock must not hold it up.
        if let Err(e) = sd_notify("READY=1") {
            tracing::warn!(error = %e, "cannot notify systemd");
        }
        let health = health::HealthMonitor::spawn(Arc::clone(controller), cfg.health.clone(), shutdown.clone());
        tasks.push(named("the health monitor", health));
        // MIG mode changes finish themselves once NVML shows the reset (or tesserad resets a free
        // GPU whose policy is `reset = "when-free"`).
        let resets =
            tokio::spawn(tessera_daemon::node::mig::watch_pending_resets(Arc::clone(controller), shutdown.clone()));
        tasks.push(named("the pending-reset watch", resets));
        // Memory limits from NVML's per-process figures: the second line behind the shim.
        let enforce = enforcement::Enforcer::spawn(Arc::clone(controller), Arc::clone(&stats), shutdown.clone());
        tasks.push(named("the enforcement loop", enforce));
        // Leased node API allocations: released when their container is deleted.
        tasks.push(named("the lease task", lease::spawn(Arc::clone(controller.allocator()), shutdown.clone())));
        // Priorities and lending between containers: each told of its neighbours by the daemon.
        tasks.push(named("the ledger task", ledger::spawn(Arc::clone(controller.allocator()), shutdown.clone())));
        // Which pod holds each allocation, from the kubelet's pod-resources API (off when empty).
        if !cfg.pod_resources_socket.as_os_str().is_empty() {
            let task = podresources::spawn(Arc::clone(controller), cfg.pod_resources_socket.clone(), shutdown.clone());
            tasks.push(named("the pod-resources task", task));
        }
        tasks.extend(dra_task);
        tasks.extend(kubernetes_task);
        let source =
            || Arc::new(telemetry::NodeSource::new(Arc::clone(controller)).with_enforcement(Arc::clone(&stats)));
        // Prometheus /metrics only when an address is configured.
        let metrics = match &cfg.telemetry.metrics_listen {
            None => None,
            // `listen` leaves the listener non-blocking, as tokio needs.
            Some(addr) => {
                let listener = telemetry::listen(addr).map_err(|e| fail(e.to_string(), 2))?;
                tracing::info!(address = %addr, "metrics listening");
                Some(tokio::spawn(telemetry::serve_on(listener, source(), shutdown.clone())))
            }
        };
        // OTLP export (metrics and events) only when a collector is configured.
        let otlp = match &cfg.telemetry.otlp_endpoint {
            None => None,
            Some(endpoint) => {
                let options = telemetry::OtlpOptions::from_env();
                let events = controller.events();
                let exporter = telemetry::otlp::start(endpoint, source(), events, shutdown.clone(), options)
                    .map_err(|e| fail(e.to_string(), 2))?;
                Some(exporter)
            }
        };
        Ok(Faces { device_plugins, metrics, otlp, tasks, api })
    }

    /// Stops every face (`shutdown` has turned true): the device plugins first, the node API
    /// last. Each winds down on its own; none may hold the stop up for long (a client that
    /// keeps a connection open is cut off after [`STOP_GRACE`]). `Err`: the device plugins did
    /// not stop cleanly.
    pub async fn stop(self) -> Result<(), String> {
        let result = match self.device_plugins.await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Some(task) = self.metrics {
            finish("metrics endpoint", task).await;
        }
        // A last export of what is pending; a collector that does not answer costs STOP_GRACE.
        if let Some(exporter) = self.otlp
            && let Err(e) = exporter.shutdown(STOP_GRACE).await
        {
            tracing::warn!(error = %e, "OTLP export");
        }
        for (what, task) in self.tasks {
            if tokio::time::timeout(STOP_GRACE, task).await.is_err() {
                tracing::warn!("{what} did not stop in time");
            }
        }
        finish("node API", self.api).await;
        result
    }
}

/// Waits for a server task to end, up to [`STOP_GRACE`]; then aborts it.
async fn finish<E: std::fmt::Display>(what: &str, mut task: JoinHandle<Result<(), E>>) {
    match tokio::time::timeout(STOP_GRACE, &mut task).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "{what}"),
        Ok(Err(e)) => tracing::warn!(error = %e, "{what} task"),
        Err(_) => {
            tracing::warn!("{what} did not stop in time; cut off");
            task.abort();
        }
    }
}
