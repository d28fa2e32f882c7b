//! `tesserad`: load and validate the configuration, discover the GPUs, apply the declared
//! partitions, then serve every advertised resource to the kubelet (one device-plugin socket per
//! resource) with allocations kept in the crash-safe state store, until SIGTERM or SIGINT.
//! Readiness (every resource registered) goes to systemd as `READY=1` when `$NOTIFY_SOCKET` is
//! set. `--once` prints what was found and applied and exits instead.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use tessera_daemon::allocator::DaemonAllocator;
use tessera_daemon::config::{self, Config};
use tessera_daemon::discovery::{Inventory, Session};
use tessera_daemon::kubelet::{Allocator, DevicePlugin, PluginSet};
use tessera_daemon::partition::{self, Share};
use tessera_daemon::resources::Resources;
use tessera_daemon::state::{AllocDirs, Store};

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
}

fn main() -> ExitCode {
    let started = Instant::now();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let explicit = args.config.as_os_str() != config::DEFAULT_PATH;
    let cfg = match Config::load(&args.config, explicit) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tesserad: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let session = match Session::open(cfg.nvml_library.as_deref(), args.sim || cfg.sim) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tesserad: {e}");
            return ExitCode::from(1);
        }
    };
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
    if !args.once {
        let resources = Arc::new(Resources::build(&cfg, &after, &layouts, &shares));
        // The NVML session lives as long as the daemon.
        let code = serve(&cfg, resources, started);
        drop(session);
        return code;
    }
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

/// Runs the kubelet servers until SIGTERM or SIGINT.
fn serve(cfg: &Config, resources: Arc<Resources>, started: Instant) -> ExitCode {
    if let Err(e) = std::fs::create_dir_all(&cfg.runtime_dir) {
        eprintln!("tesserad: runtime directory {}: {e}", cfg.runtime_dir.display());
        return ExitCode::from(1);
    }
    let store = match Store::open(&cfg.state_dir) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tesserad: state: {e}");
            return ExitCode::from(1);
        }
    };
    let allocator =
        Arc::new(DaemonAllocator::new(cfg, Arc::clone(&resources), store, AllocDirs::new(&cfg.runtime_dir)));
    let kept = allocator.reconcile();
    tracing::info!(allocations = kept, state = %cfg.state_dir.display(), "state loaded");
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tesserad: tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        if let Err(e) = std::fs::create_dir_all(&cfg.device_plugin_dir) {
            eprintln!("tesserad: {}: {e}", cfg.device_plugin_dir.display());
            return ExitCode::from(1);
        }
        // The senders stay here for the daemon's life (health updates will come through them).
        let mut senders = Vec::new();
        let mut plugins = Vec::new();
        for res in resources.resources.values() {
            let (tx, rx) = tokio::sync::watch::channel(res.plugin_devices());
            senders.push(tx);
            plugins.push(DevicePlugin::new(&res.name, rx, Arc::clone(&allocator) as Arc<dyn Allocator>));
            tracing::info!(resource = %res.name, devices = res.devices.len(), "serving");
        }
        let set = match PluginSet::start(&cfg.device_plugin_dir, plugins) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("tesserad: {e}");
                return ExitCode::from(1);
            }
        };
        let (mut term, mut int) = match (
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()),
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()),
        ) {
            (Ok(t), Ok(i)) => (t, i),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("tesserad: signal handlers: {e}");
                return ExitCode::from(1);
            }
        };
        let mut registered = false;
        loop {
            tokio::select! {
                () = set.wait_registered(), if !registered => {
                    registered = true;
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    tracing::info!(resources = set.resources().count(), ms_since_start = ms, "registered");
                    if let Err(e) = sd_notify("READY=1") {
                        tracing::warn!(error = %e, "cannot notify systemd");
                    }
                }
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
        }
        tracing::info!("stopping");
        let _ = sd_notify("STOPPING=1");
        let result = set.stop().await;
        drop(senders);
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tesserad: stopping: {e}");
                ExitCode::from(1)
            }
        }
    })
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

fn log_inventory(inv: &Inventory) {
    tracing::info!(driver = %inv.driver_version, cuda = inv.cuda_driver_version, gpus = inv.gpus.len(), "discovered");
    for g in &inv.gpus {
        tracing::info!(
            index = g.index,
            uuid = %g.uuid,
            name = %g.name,
            memory_mib = g.memory_total >> 20,
            bus = %g.pci_bus_id,
            numa = ?g.numa_node,
            mig = ?g.mig.as_ref().map(|m| (m.current, m.pending, m.instances.len())),
            nvlink = ?g.nvlink_peers,
            "GPU"
        );
    }
}
