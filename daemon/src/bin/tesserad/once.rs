//! `tesserad --once`: discover, apply the declared layouts, print what was found and applied,
//! and exit (no servers).

use std::collections::BTreeSet;
use std::process::ExitCode;

use tessera_daemon::config::Config;
use tessera_daemon::discovery::{Gpu, Inventory, MigInfo, Session};
use tessera_daemon::partition::{self, Share};

/// Discovers the node, applies `cfg`'s layouts and prints a summary. Exit codes: 1 for what the
/// node refused, 2 for an invalid configuration.
pub fn once(session: &Session, cfg: &Config) -> ExitCode {
    let inv = match session.inventory() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("tesserad: discovery: {e}");
            return ExitCode::from(1);
        }
    };
    log_inventory(&inv);
    let layouts = match partition::resolve(cfg, &inv) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("tesserad: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let outcomes = partition::apply_layouts(session, &inv, &layouts, &BTreeSet::new());
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
    print_summary(session, &after, &outcomes, &shares);
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

fn gpu_owns(gpu: &Gpu, uuid: &str) -> bool {
    gpu.mig.iter().flat_map(|m| &m.instances).flat_map(|gi| &gi.devices).any(|d| d.uuid == uuid)
}

/// A GPU's MIG state in words: `off`, `on (2 instances)`, `off (on after reset)`, `none`.
fn describe_mig(mig: Option<&MigInfo>) -> String {
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
