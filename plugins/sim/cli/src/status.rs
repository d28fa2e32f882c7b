//! What `tessera-sim status` and `tessera-sim events` print.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;
use tessera_sim_model::{Node, SimError};

#[derive(Serialize)]
struct GpuReport {
    index: u32,
    model: &'static str,
    name: &'static str,
    uuid: String,
    bus_id: String,
    numa_node: u32,
    lost: bool,
    memory_total: u64,
    memory_used: Option<u64>,
    utilization_percent: Option<u32>,
    mig_current: Option<bool>,
    mig_pending: Option<bool>,
    ecc_corrected: u64,
    ecc_uncorrected: u64,
    last_xid: u32,
    mig_instances: Vec<MigReport>,
    processes: Vec<ProcessReport>,
}

#[derive(Serialize)]
struct MigReport {
    gi: u32,
    ci: Option<u32>,
    profile: String,
    placement: u32,
    uuid: Option<String>,
    memory_total: u64,
    memory_used: u64,
}

#[derive(Serialize)]
struct ProcessReport {
    pid: u32,
    name: String,
    used_bytes: u64,
    gi: Option<u32>,
    ci: Option<u32>,
}

#[derive(Serialize)]
struct NodeReport {
    state: String,
    driver_version: String,
    cuda_driver_version: u32,
    gpus: Vec<GpuReport>,
}

fn report(node: &Node) -> NodeReport {
    let gpus = node
        .gpus()
        .iter()
        .map(|id| {
            let g = id.index;
            let health = node.health(g).unwrap_or_default();
            let mem = node.memory_info(g, 0).ok();
            let mode = node.mig_mode(g).ok();
            let mut mig_instances = Vec::new();
            if let Ok(gis) = node.gpu_instances(g) {
                let cis = node.compute_instances(g, None).unwrap_or_default();
                for gi in gis {
                    let m = node.memory_info(g, 1 + gi.slot).ok();
                    let mine: Vec<_> = cis.iter().filter(|c| c.gi_id == gi.id).collect();
                    if mine.is_empty() {
                        mig_instances.push(MigReport {
                            gi: gi.id,
                            ci: None,
                            profile: gi.profile.name.to_string(),
                            placement: gi.start,
                            uuid: None,
                            memory_total: m.map_or(0, |m| m.total),
                            memory_used: m.map_or(0, |m| m.used),
                        });
                    }
                    for c in mine {
                        mig_instances.push(MigReport {
                            gi: gi.id,
                            ci: Some(c.id),
                            profile: c.profile.name_in(gi.profile),
                            placement: gi.start,
                            uuid: Some(id.mig_uuid(gi.id, c.id, c.serial)),
                            memory_total: m.map_or(0, |m| m.total),
                            memory_used: m.map_or(0, |m| m.used),
                        });
                    }
                }
            }
            let processes = node
                .processes(g, None)
                .unwrap_or_default()
                .into_iter()
                .map(|p| ProcessReport { pid: p.pid, name: p.name, used_bytes: p.used_bytes, gi: p.gi_id, ci: p.ci_id })
                .collect();
            GpuReport {
                index: g,
                model: id.model.key,
                name: id.model.name,
                uuid: id.uuid.clone(),
                bus_id: id.bus_id.clone(),
                numa_node: id.numa_node,
                lost: health.lost,
                memory_total: id.model.memory_bytes,
                memory_used: mem.map(|m| m.used),
                utilization_percent: node.utilization(g, 0).ok().map(|u| u.gpu_percent),
                mig_current: mode.map(|m| m.0),
                mig_pending: mode.map(|m| m.1),
                ecc_corrected: health.ecc_corrected_volatile,
                ecc_uncorrected: health.ecc_uncorrected_volatile,
                last_xid: health.last_xid,
                mig_instances,
                processes,
            }
        })
        .collect();
    let d = node.description();
    NodeReport {
        state: node.state_path().display().to_string(),
        driver_version: d.driver_version.clone(),
        cuda_driver_version: d.cuda_driver_version,
        gpus,
    }
}

const MIB: u64 = 1 << 20;

pub fn print(node: &Node, json: bool) -> Result<(), String> {
    let r = report(node);
    if json {
        println!("{}", serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?);
        return Ok(());
    }
    let mut out = String::new();
    let cuda = r.cuda_driver_version;
    let _ = writeln!(
        out,
        "simulated node: {} GPUs, driver {}, CUDA {}.{}, state {}",
        r.gpus.len(),
        r.driver_version,
        cuda / 1000,
        cuda % 1000 / 10,
        r.state
    );
    let _ = writeln!(
        out,
        "{:<4}{:<24}{:<42}{:<18}{:>20}{:>6}  {:<8}HEALTH",
        "GPU", "NAME", "UUID", "BUS", "MEMORY (MiB)", "UTIL", "MIG"
    );
    for g in &r.gpus {
        let mem = match g.memory_used {
            Some(u) => format!("{} / {}", u / MIB, g.memory_total / MIB),
            None => format!("- / {}", g.memory_total / MIB),
        };
        let util = g.utilization_percent.map_or("-".into(), |u| format!("{u}%"));
        let mig = match (g.mig_current, g.mig_pending) {
            (Some(c), Some(p)) if c != p => format!("{}->{}", on(c), on(p)),
            (Some(c), _) => on(c).to_string(),
            _ => "n/a".into(),
        };
        let health = if g.lost {
            "LOST (off the bus)".to_string()
        } else if g.ecc_uncorrected > 0 || g.last_xid != 0 {
            format!("xid {} ecc {}/{}", g.last_xid, g.ecc_corrected, g.ecc_uncorrected)
        } else {
            "ok".into()
        };
        let _ = writeln!(
            out,
            "{:<4}{:<24}{:<42}{:<18}{:>20}{:>6}  {:<8}{}",
            g.index, g.name, g.uuid, g.bus_id, mem, util, mig, health
        );
        for m in &g.mig_instances {
            let ci = m.ci.map_or("-".into(), |c| c.to_string());
            let _ = writeln!(
                out,
                "      mig gi {} ci {} {:<12} at {}  {} / {} MiB  {}",
                m.gi,
                ci,
                m.profile,
                m.placement,
                m.memory_used / MIB,
                m.memory_total / MIB,
                m.uuid.as_deref().unwrap_or("(no compute instance)")
            );
        }
        for p in &g.processes {
            let mig = p.gi.map(|gi| format!(" gi {gi} ci {}", p.ci.unwrap_or(0))).unwrap_or_default();
            let _ = writeln!(out, "      pid {:<8}{:<16}{} MiB{}", p.pid, p.name, p.used_bytes / MIB, mig);
        }
    }
    print!("{out}");
    Ok(())
}

fn on(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

pub fn follow_events(node: &Node, seconds: Option<u64>) -> Result<(), String> {
    let mut cursor = node.event_cursor();
    let deadline = seconds.map(|s| std::time::Instant::now() + Duration::from_secs(s));
    loop {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(std::time::Instant::now()),
            None => Duration::from_secs(3600),
        };
        if wait.is_zero() {
            return Ok(());
        }
        match node.next_event(&mut cursor, |_| true, wait) {
            Ok(Some(e)) => {
                let mig = e
                    .gi_id
                    .map(|g| format!(" gi {g} ci {}", e.ci_id.map_or("-".into(), |c| c.to_string())))
                    .unwrap_or_default();
                println!("{} gpu {}{} {:?} {}", e.timestamp_us, e.gpu, mig, e.kind, e.data);
            }
            Ok(None) => {}
            Err(SimError::Timeout) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
}
