//! tesserad's run once its configuration is loaded: the controller built over the state store,
//! then every face started (each starts its own tasks), SIGHUP reloads, SIGTERM or SIGINT stops
//! them in order, each within [`faces::STOP_GRACE`]. Readiness (the node API serving; kubelet
//! registration goes on in the background) goes to systemd as `READY=1` when `$NOTIFY_SOCKET`
//! is set.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use tokio::signal::unix::{SignalKind, signal};

use crate::{faces, host};
use tessera_daemon::api;
use tessera_daemon::cdi::CdiWriter;
use tessera_daemon::config::Config;
use tessera_daemon::discovery::Session;
use tessera_daemon::events::EventBus;
use tessera_daemon::node::{ConfigSource, NodeController, StartError};
use tessera_daemon::state::{AllocDirs, Store};
use tessera_daemon::view::View;

/// How many events are kept on disk for replay.
const KEPT_EVENTS: usize = 1000;

/// Runs the faces (kubelet device plugins, DRA, node API, metrics, ...) until SIGTERM or SIGINT;
/// SIGHUP reloads. `started`: when the process started (registration is logged with the time
/// since). Exit codes: 1 for what the node refused, 2 for an invalid configuration.
pub fn serve(session: Session, cfg: Config, source: ConfigSource, started: Instant) -> ExitCode {
    let controller = match start_controller(session, &cfg, source) {
        Ok(c) => c,
        Err(code) => return code,
    };
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
    runtime.block_on(run(controller, cfg, started))
}

/// The controller over the state store, once the directories are tesserad's own and no other
/// daemon serves this runtime_dir.
fn start_controller(session: Session, cfg: &Config, source: ConfigSource) -> Result<Arc<NodeController>, ExitCode> {
    for (key, dir) in [
        ("runtime_dir", &cfg.runtime_dir),
        ("state_dir", &cfg.state_dir),
        ("device_plugin_dir", &cfg.device_plugin_dir),
    ] {
        if let Err(e) = host::own_directory(dir) {
            eprintln!("tesserad: {key}: {}: {e}", dir.display());
            return Err(ExitCode::from(1));
        }
    }
    // Another daemon on this runtime_dir: nothing of its is touched (its spares, its regions).
    if let Err(e) = api::refuse_if_served(&cfg.node_api_socket()) {
        eprintln!("tesserad: node API: {e}");
        return Err(ExitCode::from(1));
    }
    // Allocations a damaged journal lost are read back from their directories.
    let store = match Store::open_with_dirs(&cfg.state_dir, &AllocDirs::new(&cfg.runtime_dir)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tesserad: state: {e}");
            return Err(ExitCode::from(1));
        }
    };
    let events =
        Arc::new(EventBus::new(KEPT_EVENTS, Some(cfg.state_dir.join(tessera_daemon::state::store::EVENTS_FILE))));
    let (controller, results) = match NodeController::start(session, cfg.clone(), source, store, events) {
        Ok(c) => c,
        Err(e @ StartError::Config(_)) => {
            eprintln!("tesserad: {e}");
            return Err(ExitCode::from(2));
        }
        Err(e) => {
            eprintln!("tesserad: {e}");
            return Err(ExitCode::from(1));
        }
    };
    for r in &results {
        for i in &r.issues {
            tracing::warn!(gpu = r.gpu_index, issue = %i.message, "layout");
        }
    }
    Ok(Arc::new(controller))
}

/// Starts the faces, then waits for a signal: SIGHUP reloads, SIGTERM or SIGINT stops.
async fn run(controller: Arc<NodeController>, cfg: Config, started: Instant) -> ExitCode {
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let mut offer_rx = controller.watch_offer();
    let offer = offer_rx.borrow_and_update().clone();
    // CDI specs for the runtimes, now and whenever what is offered changes.
    let mut cdi = match CdiWriter::new(&cfg.injection, &cfg.runtime_dir, &cfg.state_dir) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("tesserad: {e}");
            return ExitCode::from(1);
        }
    };
    write_cdi(&mut cdi, &offer);
    let mut written = offer;
    let faces = match faces::Faces::start(&controller, &cfg, started, &shutdown_rx).await {
        Ok(f) => f,
        Err(code) => return code,
    };
    let (mut term, mut int, mut hup) =
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt()), signal(SignalKind::hangup())) {
            (Ok(t), Ok(i), Ok(h)) => (t, i, h),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                eprintln!("tesserad: signal handlers: {e}");
                return ExitCode::from(1);
            }
        };
    loop {
        tokio::select! {
            changed = offer_rx.changed() => {
                if changed.is_err() {
                    break;
                }
                let offer = offer_rx.borrow_and_update().clone();
                // What the records hold is published on every allocation; the specs follow the
                // devices only.
                if !offer.only_holdings_differ(&written) {
                    write_cdi(&mut cdi, &offer);
                    written = offer;
                }
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
    let _ = host::sd_notify("STOPPING=1");
    let _ = shutdown_tx.send(true);
    match faces.stop().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tesserad: stopping: {e}");
            ExitCode::from(1)
        }
    }
}

/// Unmounts and removes the spare allocation directories when dropped (`AllocDirs::stop_spares`).
struct StopSpares(Arc<NodeController>);

impl Drop for StopSpares {
    fn drop(&mut self) {
        self.0.allocator().dirs().stop_spares();
    }
}

/// Refreshes the CDI specs; a failure is logged (containers asking by CDI name fail to start
/// until the next refresh succeeds, which is what a runtime reports to the user).
fn write_cdi(cdi: &mut Option<CdiWriter>, offer: &View) {
    if let Some(writer) = cdi
        && let Err(e) = writer.write(offer)
    {
        tracing::error!(error = %e, "cannot write the CDI specs");
    }
}
