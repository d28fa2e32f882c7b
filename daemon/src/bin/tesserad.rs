//! `tesserad`: load and validate the configuration, discover the GPUs, apply the declared
//! partitions, then serve every advertised resource to the kubelet (one device-plugin socket per
//! resource) with allocations kept in the crash-safe state store, until SIGTERM or SIGINT.
//! Readiness (the node API serving; kubelet registration goes on in the background) goes to
//! systemd as `READY=1` when `$NOTIFY_SOCKET` is set. `--once` prints what was found and applied and exits instead.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use std::collections::BTreeMap;

use clap::Parser;
use tessera_daemon::allocator::DaemonAllocator;
use tessera_daemon::cdi::CdiWriter;
use tessera_daemon::config::{self, Config};
use tessera_daemon::discovery::{Inventory, Session};
use tessera_daemon::events::EventBus;
use tessera_daemon::kubelet::{Allocator, DevicePlugin, PluginDevice, PluginSet};
use tessera_daemon::node::{ConfigSource, KubeletOffer, NodeController, StartError};
use tessera_daemon::partition::{self, Share};
use tessera_daemon::resources::{Resource, Resources};
use tessera_daemon::state::{AllocDirs, Store};
use tessera_daemon::{api, telemetry};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser, Debug)]
#[command(name = "tesserad", version, about = "Tessera node daemon: GPU discovery and partitioning")]
struct Args {
    /// Configuration file.
    #[arg(long, value_name = "FILE", default_value = config::DEFAULT_PATH)]
    config: PathBuf,
    /// Use the simulated node (libtessera_sim.so) instead of the NVIDIA driver.
    #[arg(long)]
    sim: bool,
    /// Discover, apply the layout, print a summary and exit (no kubelet servers).
    #[arg(long)]
    once: bool,
    /// Log lines as `text` or `json` (one object per line). Default: the configuration's
    /// `log_format`, else text.
    #[arg(long, value_enum, value_name = "FORMAT")]
    log_format: Option<config::LogFormat>,
}

fn main() -> ExitCode {
    let started = Instant::now();
    let args = Args::parse();
    let explicit = args.config.as_os_str() != config::DEFAULT_PATH;
    let cfg = match Config::load(&args.config, explicit) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tesserad: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    init_logging(args.log_format.unwrap_or(cfg.log_format));
    let session = match Session::open_in(cfg.nvml_library.as_deref(), args.sim || cfg.sim, &cfg.injection.driver_root) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tesserad: {e}");
            return ExitCode::from(1);
        }
    };
    if !args.once {
        let source = ConfigSource { path: args.config.clone(), explicit };
        return serve(session, cfg, source, started);
    }
    let inv = match session.inventory() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("tesserad: discovery: {e}");
            return ExitCode::from(1);
        }
    };
    log_inventory(&inv);
    let layouts = match partition::resolve(&cfg, &inv) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("tesserad: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let outcomes = partition::apply_layouts(&session, &inv, &layouts, &BTreeSet::new());
    let after = match session.inventory() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("tesserad: discovery after partitioning: {e}");
            return ExitCode::from(1);
        }
    };
    let shares = match partition::plan_all_shares(&after, &layouts) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tesserad: shares: {e}");
            return ExitCode::from(1);
        }
    };
    print_summary(&session, &after, &outcomes, &shares);
    ExitCode::SUCCESS
}

fn print_summary(session: &Session, after: &Inventory, outcomes: &[partition::GpuOutcome], shares: &[Share]) {
    println!("library: {} ({})", session.library().display(), session.source());
    for gpu in &after.gpus {
        let mig = match &gpu.mig {
            Some(m) if m.current => format!("MIG on{}", if m.pending { "" } else { " (off after reset)" }),
            Some(m) if m.pending => "MIG off (on after reset)".to_string(),
            Some(_) => "MIG off".to_string(),
            None => "no MIG".to_string(),
        };
        println!("GPU {} {} {} {} MiB {}", gpu.index, gpu.uuid, gpu.name, gpu.memory_total >> 20, mig);
        for gi in gpu.mig.iter().flat_map(|m| &m.instances) {
            for d in &gi.devices {
                println!("  {} {} (GI {} CI {}) {} MiB", d.uuid, gi.profile, d.gi_id, d.ci_id, d.memory_total >> 20);
            }
        }
        if let Some(o) = outcomes.iter().find(|o| o.index == gpu.index) {
            match &o.result {
                Ok(a) if a.pending_reset => println!("  layout: pending a GPU reset"),
                Ok(a) if a.done.is_empty() => println!("  layout: as declared"),
                Ok(a) => println!("  layout: applied {} change(s)", a.done.len()),
                Err(e) => println!("  layout: not applied: {e}"),
            }
        }
        for s in shares.iter().filter(|s| s.parent_uuid == gpu.uuid || gpu_owns(gpu, &s.parent_uuid)) {
            println!("  share {} {} MiB {}% SM", s.id, s.memory_limit >> 20, s.sm_percent);
        }
    }
}

/// Makes `dir` if need be and checks that only this daemon's user can change what is in it: its
/// owner, and not writable by group or others (such bits are taken off, said once). A directory
/// another user owns is refused: that user could replace the journal, the regions or the hook's
/// configuration that root reads.
fn own_directory(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if let Ok(m) = std::fs::metadata(dir)
        && !m.is_dir()
    {
        return Err("exists and is not a directory".into());
    }
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let m = std::fs::metadata(dir).map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me {
        return Err(format!(
            "owned by uid {}, not by this daemon's uid {me}: that user could change what tesserad keeps there; \
             chown it to uid {me} or configure another directory",
            m.uid()
        ));
    }
    if m.mode() & 0o022 != 0 {
        let mode = m.mode() & 0o7777 & !0o022;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(|e| e.to_string())?;
        tracing::warn!(dir = %dir.display(), mode = format!("{mode:o}"), "the directory was writable by other users; no longer");
    }
    Ok(())
}

/// How many events are kept on disk for replay.
const KEPT_EVENTS: usize = 1000;

/// Runs the kubelet servers and the node API until SIGTERM or SIGINT; SIGHUP reloads.
fn serve(session: Session, cfg: Config, source: ConfigSource, started: Instant) -> ExitCode {
    for (key, dir) in [
        ("runtime_dir", &cfg.runtime_dir),
        ("state_dir", &cfg.state_dir),
        ("device_plugin_dir", &cfg.device_plugin_dir),
    ] {
        if let Err(e) = own_directory(dir) {
            eprintln!("tesserad: {key}: {}: {e}", dir.display());
            return ExitCode::from(1);
        }
    }
    // Another daemon on this runtime_dir: nothing of its is touched (its spares, its regions).
    if let Err(e) = api::refuse_if_served(&cfg.node_api_socket()) {
        eprintln!("tesserad: node API: {e}");
        return ExitCode::from(1);
    }
    // Allocations a damaged journal lost are read back from their directories.
    let store = match Store::open_with_dirs(&cfg.state_dir, &AllocDirs::new(&cfg.runtime_dir)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tesserad: state: {e}");
            return ExitCode::from(1);
        }
    };
    let events =
        Arc::new(EventBus::new(KEPT_EVENTS, Some(cfg.state_dir.join(tessera_daemon::state::store::EVENTS_FILE))));
    let (controller, results) = match NodeController::start(session, cfg.clone(), source, store, events) {
        Ok(c) => c,
        Err(e @ StartError::Config(_)) => {
            eprintln!("tesserad: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("tesserad: {e}");
            return ExitCode::from(1);
        }
    };
    for r in &results {
        for i in &r.issues {
            tracing::warn!(gpu = r.gpu_index, issue = %i.message, "layout");
        }
    }
    let controller = Arc::new(controller);
    // However this ends (a clean stop, or a server that could not start), the spare allocation
    // directories' mounts go with it; the allocations' own stay, for their containers and the
    // next start.
    let _spares = StopSpares(Arc::clone(&controller));
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tesserad: tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
        let mut resources_rx = controller.watch_resources();
        let mut plugins = Plugins::default();
        resources_rx.borrow_and_update();
        // The node API's allocations and claims change which of the kubelet's devices still fit.
        let mut foreign_rx = controller.allocator().foreign_changes();
        foreign_rx.borrow_and_update();
        // CDI specs for the runtimes, now and whenever what is offered changes.
        let mut cdi = match CdiWriter::new(&cfg.injection, &cfg.runtime_dir, &cfg.state_dir) {
            Ok(w) => w,
            Err(e) => {
                eprintln!("tesserad: {e}");
                return ExitCode::from(1);
            }
        };
        write_cdi(&mut cdi, &controller);
        // What the DRA driver publishes (modes `dra`, `both`) is not served by the device plugin.
        let mode = cfg.kubernetes.mode;
        let served = tessera_daemon::dra::node::device_plugin_view(mode, &controller.view());
        let set = match plugins.start(&cfg, &served, &controller) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("tesserad: {e}");
                return ExitCode::from(1);
            }
        };
        let dra_task = if cfg.kubernetes.mode.dra() {
            match tessera_daemon::dra::node::start(Arc::clone(&controller), &cfg, shutdown_rx.clone()).await {
                Ok(task) => Some(task),
                Err(e) => {
                    eprintln!("tesserad: DRA driver: {e}");
                    return ExitCode::from(2);
                }
            }
        } else {
            None
        };
        let kubernetes_task =
            match tessera_daemon::kubernetes::start(Arc::clone(&controller), &cfg, shutdown_rx.clone()).await {
                Ok(task) => task,
                Err(e) => {
                    eprintln!("tesserad: kubernetes: {e}");
                    return ExitCode::from(2);
                }
            };
        let api_socket = cfg.node_api_socket();
        let api_listener = match api::bind(&api_socket) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("tesserad: node API socket {}: {e}", api_socket.display());
                return ExitCode::from(1);
            }
        };
        // The enforcement loop's counters, shared with the node API (GetUsage) and telemetry.
        let enforcement = Arc::new(tessera_daemon::enforcement::Stats::default());
        let api_task = tokio::spawn(api::serve_on(
            api_listener,
            api_socket,
            Arc::clone(&controller),
            Some(Arc::clone(&enforcement)),
            shutdown_rx.clone(),
        ));
        // Ready once the node API serves. Registration with the kubelet goes on in the background
        // (each plugin retries and logs why it waits): a stale kubelet.sock must not hold it up.
        if let Err(e) = sd_notify("READY=1") {
            tracing::warn!(error = %e, "cannot notify systemd");
        }
        let health_task = tessera_daemon::health::HealthMonitor::spawn(
            Arc::clone(&controller),
            cfg.health.clone(),
            shutdown_rx.clone(),
        );
        // MIG mode changes finish themselves once NVML shows the reset (or tesserad resets a free
        // GPU whose policy is `reset = "when-free"`).
        let reset_task =
            tokio::spawn(tessera_daemon::node::mig::watch_pending_resets(Arc::clone(&controller), shutdown_rx.clone()));
        // Memory limits from NVML's per-process figures: the second line behind the shim.
        let enforce_task = tessera_daemon::enforcement::Enforcer::spawn(
            Arc::clone(&controller),
            Arc::clone(&enforcement),
            shutdown_rx.clone(),
        );
        // Leased node API allocations: released when their container is deleted.
        let lease_task = tessera_daemon::lease::spawn(Arc::clone(controller.allocator()), shutdown_rx.clone());
        // Priorities and lending between containers: each told of its neighbours by the daemon.
        let ledger_task = tessera_daemon::ledger::spawn(Arc::clone(controller.allocator()), shutdown_rx.clone());
        // Which pod holds each allocation, from the kubelet's pod-resources API (off when empty).
        let podres_task = (!cfg.pod_resources_socket.as_os_str().is_empty()).then(|| {
            tessera_daemon::podresources::spawn(
                Arc::clone(&controller),
                cfg.pod_resources_socket.clone(),
                shutdown_rx.clone(),
            )
        });
        // Prometheus /metrics only when an address is configured.
        let metrics_task = match &cfg.telemetry.metrics_listen {
            None => None,
            // `listen` leaves the listener non-blocking, as tokio needs.
            Some(addr) => match telemetry::listen(addr) {
                Ok(listener) => {
                    tracing::info!(address = %addr, "metrics listening");
                    let source = Arc::new(
                        telemetry::NodeSource::new(Arc::clone(&controller)).with_enforcement(Arc::clone(&enforcement)),
                    );
                    Some(tokio::spawn(telemetry::serve_on(listener, source, shutdown_rx.clone())))
                }
                Err(e) => {
                    eprintln!("tesserad: {e}");
                    return ExitCode::from(2);
                }
            },
        };
        // OTLP export (metrics and events) only when a collector is configured.
        let otlp = match &cfg.telemetry.otlp_endpoint {
            None => None,
            Some(endpoint) => {
                let source = Arc::new(
                    telemetry::NodeSource::new(Arc::clone(&controller)).with_enforcement(Arc::clone(&enforcement)),
                );
                let options = telemetry::OtlpOptions::from_env();
                match telemetry::otlp::start(endpoint, source, controller.events(), shutdown_rx.clone(), options) {
                    Ok(exporter) => Some(exporter),
                    Err(e) => {
                        eprintln!("tesserad: {e}");
                        return ExitCode::from(2);
                    }
                }
            }
        };
        let (mut term, mut int, mut hup) =
            match (signal(SignalKind::terminate()), signal(SignalKind::interrupt()), signal(SignalKind::hangup())) {
                (Ok(t), Ok(i), Ok(h)) => (t, i, h),
                (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                    eprintln!("tesserad: signal handlers: {e}");
                    return ExitCode::from(1);
                }
            };
        let mut set = set;
        let mut registered = false;
        loop {
            tokio::select! {
                () = set.wait_registered(), if !registered => {
                    registered = true;
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    tracing::info!(resources = set.resources().count(), ms_since_start = ms, "registered");
                }
                changed = resources_rx.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    resources_rx.borrow_and_update();
                    let now = tessera_daemon::dra::node::device_plugin_view(mode, &controller.view());
                    plugins.update(&mut set, &now, &controller);
                    write_cdi(&mut cdi, &controller);
                }
                changed = foreign_rx.changed() => {
                    if changed.is_ok() {
                        foreign_rx.borrow_and_update();
                        let now = tessera_daemon::dra::node::device_plugin_view(mode, &controller.view());
                        plugins.update(&mut set, &now, &controller);
                    }
                }
                // While devices are withdrawn, the kubelet's own changes can move which ones fit
                // (never how many): looked at again every second.
                () = tokio::time::sleep(WITHDRAWN_RECHECK), if !plugins.withdrawn.is_empty() => {
                    let now = tessera_daemon::dra::node::device_plugin_view(mode, &controller.view());
                    plugins.update(&mut set, &now, &controller);
                }
                _ = hup.recv() => {
                    tracing::info!("SIGHUP: reloading the configuration");
                    let c = Arc::clone(&controller);
                    let _ = tokio::task::spawn_blocking(move || c.reload(false)).await;
                }
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
        }
        tracing::info!("stopping");
        let _ = sd_notify("STOPPING=1");
        let _ = shutdown_tx.send(true);
        let result = set.stop().await;
        // Each server winds down on its own; none may hold the stop up for long (a client that
        // keeps a connection open is cut off after STOP_GRACE).
        if let Some(task) = metrics_task {
            finish("metrics endpoint", task).await;
        }
        // A last export of what is pending; a collector that does not answer costs STOP_GRACE.
        if let Some(exporter) = otlp
            && let Err(e) = exporter.shutdown(STOP_GRACE).await
        {
            tracing::warn!(error = %e, "OTLP export");
        }
        if tokio::time::timeout(STOP_GRACE, health_task).await.is_err() {
            tracing::warn!("the health monitor did not stop in time");
        }
        if tokio::time::timeout(STOP_GRACE, reset_task).await.is_err() {
            tracing::warn!("the pending-reset watch did not stop in time");
        }
        if tokio::time::timeout(STOP_GRACE, enforce_task).await.is_err() {
            tracing::warn!("the enforcement loop did not stop in time");
        }
        if tokio::time::timeout(STOP_GRACE, lease_task).await.is_err() {
            tracing::warn!("the lease task did not stop in time");
        }
        if tokio::time::timeout(STOP_GRACE, ledger_task).await.is_err() {
            tracing::warn!("the ledger task did not stop in time");
        }
        if let Some(task) = podres_task
            && tokio::time::timeout(STOP_GRACE, task).await.is_err()
        {
            tracing::warn!("the pod-resources task did not stop in time");
        }
        if let Some(task) = dra_task
            && tokio::time::timeout(STOP_GRACE, task).await.is_err()
        {
            tracing::warn!("the DRA driver did not stop in time");
        }
        if let Some(task) = kubernetes_task
            && tokio::time::timeout(STOP_GRACE, task).await.is_err()
        {
            tracing::warn!("the Kubernetes Events and labels did not stop in time");
        }
        finish("node API", api_task).await;
        drop(plugins);
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tesserad: stopping: {e}");
                ExitCode::from(1)
            }
        }
    })
}

/// Unmounts and removes the spare allocation directories when dropped (`AllocDirs::stop_spares`).
struct StopSpares(Arc<NodeController>);

impl Drop for StopSpares {
    fn drop(&mut self) {
        self.0.allocator().dirs().stop_spares();
    }
}

/// How long a stopping server may take before it is cut off.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits for a server task to end, up to [`STOP_GRACE`]; then aborts it.
async fn finish<E: std::fmt::Display>(what: &str, mut task: tokio::task::JoinHandle<Result<(), E>>) {
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

/// Refreshes the CDI specs; a failure is logged (containers asking by CDI name fail to start
/// until the next refresh succeeds, which is what a runtime reports to the user).
fn write_cdi(cdi: &mut Option<CdiWriter>, controller: &NodeController) {
    if let Some(writer) = cdi
        && let Err(e) = writer.write(&controller.view())
    {
        tracing::error!(error = %e, "cannot write the CDI specs");
    }
}

/// How often the withdrawn devices are looked at again while there are any.
const WITHDRAWN_RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// One device list per served resource; a resource that appears after start (a layout change)
/// gets a plugin of its own, one that disappears is served with no devices.
#[derive(Default)]
struct Plugins {
    senders: BTreeMap<String, tokio::sync::watch::Sender<Vec<PluginDevice>>>,
    /// The kubelet's free devices told unhealthy because they no longer fit beside the node
    /// API's allocations (`DaemonAllocator::withdrawn`).
    withdrawn: BTreeSet<(String, String)>,
}

impl Plugins {
    /// `res`'s devices as the kubelet is told them: the withdrawn ones unhealthy.
    fn devices(&self, res: &Resource) -> Vec<PluginDevice> {
        let mut devices = res.plugin_devices();
        for d in &mut devices {
            if self.withdrawn.contains(&(res.name.clone(), d.id.clone())) {
                d.healthy = false;
            }
        }
        devices
    }

    fn plugin(&mut self, res: &Resource, allocator: &Arc<DaemonAllocator>) -> DevicePlugin {
        let (tx, rx) = tokio::sync::watch::channel(self.devices(res));
        self.senders.insert(res.name.clone(), tx);
        tracing::info!(resource = %res.name, devices = res.devices.len(), "serving");
        DevicePlugin::new(&res.name, rx, Arc::clone(allocator) as Arc<dyn Allocator>)
    }

    fn start(
        &mut self,
        cfg: &Config,
        resources: &Resources,
        controller: &NodeController,
    ) -> Result<PluginSet, tessera_daemon::kubelet::KubeletError> {
        self.follow_withdrawn(controller, resources);
        let plugins = resources.resources.values().map(|r| self.plugin(r, controller.allocator())).collect();
        PluginSet::start(&cfg.device_plugin_dir, plugins)
    }

    /// Takes the allocator's withdrawn devices, saying what changed, and tells the controller
    /// what the kubelet is now offered (for `tessera status` and the metrics).
    fn follow_withdrawn(&mut self, controller: &NodeController, resources: &Resources) {
        let now = controller.allocator().withdrawn();
        let show = |set: &mut dyn Iterator<Item = &(String, String)>| {
            set.map(|(r, id)| format!("{r} {id}")).collect::<Vec<_>>().join(", ")
        };
        let out = show(&mut now.difference(&self.withdrawn));
        if !out.is_empty() {
            tracing::info!(devices = %out, "withdrawn from the kubelet (told unhealthy): no room beside the node API's allocations");
        }
        let back = show(&mut self.withdrawn.difference(&now));
        if !back.is_empty() {
            tracing::info!(devices = %back, "offered to the kubelet again: the room is back");
        }
        self.withdrawn = now;
        controller.set_kubelet_offer(KubeletOffer {
            resources: resources.resources.keys().cloned().collect(),
            withdrawn: self.withdrawn.clone(),
        });
    }

    fn update(&mut self, set: &mut PluginSet, resources: &Resources, controller: &NodeController) {
        self.follow_withdrawn(controller, resources);
        let allocator = controller.allocator();
        for res in resources.resources.values() {
            match self.senders.get(&res.name) {
                Some(tx) => {
                    let devices = self.devices(res);
                    tx.send_if_modified(|d| {
                        let changed = *d != devices;
                        *d = devices;
                        changed
                    });
                }
                None => {
                    let plugin = self.plugin(res, allocator);
                    if let Err(e) = set.add(plugin) {
                        tracing::error!(resource = %res.name, error = %e, "cannot serve a new resource");
                    }
                }
            }
        }
        for (name, tx) in &self.senders {
            if !resources.resources.contains_key(name) {
                tx.send_if_modified(|d| {
                    let changed = !d.is_empty();
                    d.clear();
                    changed
                });
            }
        }
    }
}

/// sd_notify by hand: one datagram to `$NOTIFY_SOCKET` (a path, or an abstract name when it
/// starts with '@'); nothing when it is unset.
fn sd_notify(state: &str) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return Ok(()) };
    let socket = UnixDatagram::unbound()?;
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(&path)?,
    };
    socket.send_to_addr(state.as_bytes(), &addr)?;
    Ok(())
}

fn gpu_owns(gpu: &tessera_daemon::discovery::Gpu, uuid: &str) -> bool {
    gpu.mig.iter().flat_map(|m| &m.instances).flat_map(|gi| &gi.devices).any(|d| d.uuid == uuid)
}

/// Log lines to stderr, for journald and `kubectl logs`: colours only when stderr is a terminal;
/// `json`: one object per line (level, target, fields, message) for log pipelines.
fn init_logging(format: config::LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        config::LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        config::LogFormat::Json => builder.json().flatten_event(true).with_ansi(false).init(),
    }
}

/// A GPU's MIG state in words: `off`, `on (2 instances)`, `off (on after reset)`, `none`.
fn describe_mig(mig: Option<&tessera_daemon::discovery::MigInfo>) -> String {
    match mig {
        None => "none".into(),
        Some(m) => {
            let now = if m.current { format!("on ({} instances)", m.instances.len()) } else { "off".into() };
            match (m.current, m.pending) {
                (true, false) => format!("{now}, off after reset"),
                (false, true) => format!("{now}, on after reset"),
                _ => now,
            }
        }
    }
}

fn log_inventory(inv: &Inventory) {
    tracing::info!(driver = %inv.driver_version, cuda = inv.cuda_driver_version, gpus = inv.gpus.len(), "discovered");
    for g in &inv.gpus {
        tracing::info!(
            index = g.index,
            uuid = %g.uuid,
            name = %g.name,
            memory_mib = g.memory_total >> 20,
            bus = %g.pci_bus_id,
            numa = %g.numa_node.map_or_else(|| "none".to_string(), |n| n.to_string()),
            mig = %describe_mig(g.mig.as_ref()),
            nvlink = %g.nvlink_peers.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
            "GPU"
        );
    }
}
