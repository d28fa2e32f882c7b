//! `tesserad`, first stage: load and validate the configuration, discover the GPUs, apply the
//! declared partitions, print a summary and exit. The long-running daemon (kubelet servers,
//! state, node API) grows from here.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tessera_daemon::config::{self, Config};
use tessera_daemon::discovery::{Inventory, Session};
use tessera_daemon::partition;

#[derive(Parser, Debug)]
#[command(name = "tesserad", version, about = "Tessera node daemon: GPU discovery and partitioning")]
struct Args {
    /// Configuration file.
    #[arg(long, value_name = "FILE", default_value = config::DEFAULT_PATH)]
    config: PathBuf,
    /// Use the simulated node (libtessera_sim.so) instead of the NVIDIA driver.
    #[arg(long)]
    sim: bool,
}

fn main() -> ExitCode {
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
    ExitCode::SUCCESS
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
