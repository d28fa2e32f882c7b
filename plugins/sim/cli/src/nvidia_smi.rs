//! `nvidia-smi` over the simulated node: what `tessera-sim` does when run under that name (the
//! copy `install --driver-root` lays out as `usr/bin/nvidia-smi`). It answers the queries tools
//! and scripts make: `-L`, the basics of `-q`, and `--query-gpu=FIELD,...` with
//! `--format=csv[,noheader][,nounits]`, optionally for `-i INDEX[,INDEX]`. The node is the one the
//! environment names, else the one recorded beside the program at install (`.tessera-sim-node`).

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;

use tessera_sim_model::{GpuIdentity, Node};

const MIB: u64 = 1 << 20;
/// Beside the installed copy: the environment that points it at its node.
pub const NODE_FILE: &str = ".tessera-sim-node";

/// Whether this program was started as nvidia-smi.
pub fn invoked_as_nvidia_smi() -> bool {
    std::env::args_os().next().is_some_and(|a| Path::new(&a).file_name().is_some_and(|n| n == "nvidia-smi"))
}

fn open_node() -> Result<Node, String> {
    if std::env::var_os(tessera_sim_model::ENV_STATE).is_none()
        && let Some(file) = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join(NODE_FILE)))
        && let Ok(text) = std::fs::read_to_string(&file)
    {
        for (k, v) in text.lines().filter_map(|l| l.split_once('=')) {
            if std::env::var_os(k).is_none() {
                // SAFETY: single-threaded at this point (nothing else has started), as set_var requires.
                unsafe { std::env::set_var(k, v) };
            }
        }
    }
    Node::open_from_env().map_err(|e| format!("Failed to initialize NVML: {e}"))
}

pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err((code, msg)) => {
            println!("{msg}");
            ExitCode::from(code)
        }
    }
}

type Failure = (u8, String);

fn bad(msg: impl Into<String>) -> Failure {
    (2, msg.into())
}

/// What nvidia-smi would print for `args`.
pub fn run(args: &[String]) -> Result<String, Failure> {
    let (mut list, mut query, mut fields, mut format, mut ids) = (false, false, None, None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> Result<String, Failure> {
            match a.split_once('=') {
                Some((_, v)) => Ok(v.to_string()),
                None => it.next().cloned().ok_or_else(|| bad(format!("Option {name} requires a value."))),
            }
        };
        match a.split('=').next().unwrap_or_default() {
            "-L" | "--list-gpus" => list = true,
            "-q" | "--query" => query = true,
            "--query-gpu" => fields = Some(value("--query-gpu")?),
            "--format" => format = Some(value("--format")?),
            "-i" | "--id" => ids = Some(value("-i")?),
            other => {
                return Err(bad(format!(
                    "Invalid combination of input arguments: {other}. Please run 'nvidia-smi -h' for help."
                )));
            }
        }
    }
    let node = open_node().map_err(|m| (9, m))?;
    let gpus: Vec<&GpuIdentity> = match &ids {
        None => node.gpus().iter().collect(),
        Some(list) => list
            .split(',')
            .map(|i| {
                let i = i.trim();
                node.gpus()
                    .iter()
                    .find(|g| g.index.to_string() == i || g.uuid == i || g.bus_id.eq_ignore_ascii_case(i))
                    .ok_or_else(|| (6, format!("No devices were found matching the ID \"{i}\"")))
            })
            .collect::<Result<_, _>>()?,
    };
    if let Some(fields) = fields {
        let format = format.ok_or_else(|| bad("--format must be given with --query-gpu (e.g. --format=csv)."))?;
        return query_gpu(&node, &gpus, &fields, &format);
    }
    if list {
        return Ok(list_gpus(&node, &gpus));
    }
    if query {
        return Ok(query_all(&node, &gpus));
    }
    Ok(list_gpus(&node, &gpus))
}

fn list_gpus(node: &Node, gpus: &[&GpuIdentity]) -> String {
    let mut s = String::new();
    for id in gpus {
        writeln!(s, "GPU {}: {} (UUID: {})", id.index, id.model.name, id.uuid).unwrap();
        let gis = node.gpu_instances(id.index).unwrap_or_default();
        let cis = node.compute_instances(id.index, None).unwrap_or_default();
        for (n, ci) in cis.iter().enumerate() {
            if let Some(gi) = gis.iter().find(|g| g.id == ci.gi_id) {
                let name = ci.profile.name_in(gi.profile);
                let uuid = id.mig_uuid(gi.id, ci.id, ci.serial);
                writeln!(s, "  MIG {name:<12} Device {n:>2}: (UUID: {uuid})").unwrap();
            }
        }
    }
    s
}

fn on_off(b: bool) -> &'static str {
    if b { "Enabled" } else { "Disabled" }
}

fn query_all(node: &Node, gpus: &[&GpuIdentity]) -> String {
    let d = node.description();
    let mut s = String::from("\n==============NVSMI LOG==============\n\n");
    let cuda = format!("{}.{}", d.cuda_driver_version / 1000, d.cuda_driver_version % 1000 / 10);
    writeln!(s, "{:<42}: {}\n{:<42}: {cuda}\n", "Driver Version", d.driver_version, "CUDA Version").unwrap();
    writeln!(s, "{:<42}: {}", "Attached GPUs", node.gpus().len()).unwrap();
    for id in gpus {
        let m = node.memory_info(id.index, 0).ok();
        let (cur, pend) = node.mig_mode(id.index).unwrap_or_default();
        let mig = node.mig_mode(id.index).is_ok();
        let mb = |v: Option<u64>| v.map_or("[N/A]".to_string(), |v| format!("{} MiB", v / MIB));
        writeln!(s, "GPU {}", id.bus_id).unwrap();
        let mut row = |k: &str, v: &str| writeln!(s, "    {k:<38}: {v}").unwrap();
        row("Product Name", id.model.name);
        row("Serial Number", &id.serial);
        row("GPU UUID", &id.uuid);
        row("Minor Number", &id.minor.to_string());
        row("Bus Id", &id.bus_id);
        if node.is_lost(id.index) {
            row("GPU Status", "Unknown Error (fallen off the bus)");
        }
        writeln!(s, "    MIG Mode").unwrap();
        let mode = |b: bool| if mig { on_off(b) } else { "N/A" };
        writeln!(s, "        {:<34}: {}\n        {:<34}: {}", "Current", mode(cur), "Pending", mode(pend)).unwrap();
        writeln!(s, "    FB Memory Usage").unwrap();
        for (k, v) in [
            ("Total", Some(id.model.memory_bytes)),
            ("Reserved", m.map(|m| m.reserved)),
            ("Used", m.map(|m| m.used)),
            ("Free", m.map(|m| m.free)),
        ] {
            writeln!(s, "        {k:<34}: {}", mb(v)).unwrap();
        }
        let util = node.utilization(id.index, 0).ok().map_or("[N/A]".into(), |u| format!("{} %", u.gpu_percent));
        writeln!(s, "    Utilization\n        {:<34}: {util}", "Gpu").unwrap();
        let procs = node.processes(id.index, None).unwrap_or_default();
        writeln!(s, "    Processes{}", if procs.is_empty() { "                             : None" } else { "" })
            .unwrap();
        for p in procs {
            writeln!(
                s,
                "        {:<34}: {}\n            {:<30}: C\n            {:<30}: {}\n            {:<30}: {} MiB",
                "Process ID",
                p.pid,
                "Type",
                "Name",
                p.name,
                "Used GPU Memory",
                p.used_bytes / MIB
            )
            .unwrap();
        }
        s.push('\n');
    }
    s
}

fn query_gpu(node: &Node, gpus: &[&GpuIdentity], fields: &str, format: &str) -> Result<String, Failure> {
    let opts: Vec<&str> = format.split(',').map(str::trim).collect();
    if opts.first() != Some(&"csv") || opts[1..].iter().any(|o| !["noheader", "nounits"].contains(o)) {
        return Err(bad(format!("\"{format}\" is not a valid format; use csv, optionally with noheader and nounits.")));
    }
    let (header, units) = (!opts.contains(&"noheader"), !opts.contains(&"nounits"));
    let fields: Vec<&str> = fields.split(',').map(str::trim).collect();
    let d = node.description();
    let mut rows = Vec::new();
    for id in gpus {
        let m = node.memory_info(id.index, 0).ok();
        let mode = node.mig_mode(id.index).ok();
        let mut row = Vec::new();
        for f in &fields {
            let mib = |v: Option<u64>| {
                v.map_or("[N/A]".into(), |v| if units { format!("{} MiB", v / MIB) } else { (v / MIB).to_string() })
            };
            let v = match *f {
                "index" => id.index.to_string(),
                "count" => node.gpus().len().to_string(),
                "name" | "gpu_name" => id.model.name.to_string(),
                "uuid" | "gpu_uuid" => id.uuid.clone(),
                "serial" => id.serial.clone(),
                "pci.bus_id" | "gpu_bus_id" => id.bus_id.clone(),
                "driver_version" => d.driver_version.clone(),
                "memory.total" => mib(Some(id.model.memory_bytes)),
                "memory.reserved" => mib(m.map(|m| m.reserved)),
                "memory.used" => mib(m.map(|m| m.used)),
                "memory.free" => mib(m.map(|m| m.free)),
                "utilization.gpu" => node.utilization(id.index, 0).ok().map_or("[N/A]".into(), |u| {
                    if units { format!("{} %", u.gpu_percent) } else { u.gpu_percent.to_string() }
                }),
                "mig.mode.current" => mode.map_or("[N/A]".into(), |m| on_off(m.0).into()),
                "mig.mode.pending" => mode.map_or("[N/A]".into(), |m| on_off(m.1).into()),
                "compute_cap" => format!("{}.{}", id.model.cc_major, id.model.cc_minor),
                other => return Err(bad(format!("Field \"{other}\" is not a valid field to query."))),
            };
            row.push(v);
        }
        rows.push(row.join(", "));
    }
    let mut s = String::new();
    if header {
        let names: Vec<String> = fields
            .iter()
            .map(|f| match (*f, units) {
                ("memory.total" | "memory.reserved" | "memory.used" | "memory.free", true) => format!("{f} [MiB]"),
                ("utilization.gpu", true) => format!("{f} [%]"),
                _ => f.to_string(),
            })
            .collect();
        writeln!(s, "{}", names.join(", ")).unwrap();
    }
    for r in rows {
        writeln!(s, "{r}").unwrap();
    }
    Ok(s)
}
