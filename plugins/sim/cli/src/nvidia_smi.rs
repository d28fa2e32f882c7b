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

/// A `--query-gpu` answer: its text, and the unit nvidia-smi appends (and names in the header)
/// unless `nounits`.
struct Answer {
    text: String,
    unit: Option<&'static str>,
}

/// "[N/A]": what nvidia-smi prints for a field the board or driver does not report.
const NA: &str = "[N/A]";

/// The unit nvidia-smi gives a field (in the header as "name [unit]"), by its canonical name.
fn unit_of(field: &str) -> Option<&'static str> {
    Some(match field {
        "fan.speed" => "%",
        f if f.starts_with("clocks_event_reasons_counters.") => "us",
        f if f.starts_with("memory.") || f.starts_with("protected_memory.") => "MiB",
        f if f.starts_with("utilization.") => "%",
        f if f.starts_with("clocks.") => "MHz",
        "power.draw"
        | "power.draw.average"
        | "power.draw.instant"
        | "power.limit"
        | "enforced.power.limit"
        | "power.default_limit"
        | "power.min_limit"
        | "power.max_limit" => "W",
        f if f.starts_with("module.power.") || f == "module.enforced.power.limit" => "W",
        "power_smoothing.window_multiplier" => "ms",
        f if f.starts_with("power_smoothing.") && !f.ends_with("window_multiplier") && !f.ends_with("_supported") => {
            "W"
        }
        _ => return None,
    })
}

/// The canonical name of a field nvidia-smi also accepts under another name (`--help-query-gpu`
/// lists them as "name" or "gpu_name").
fn canonical(field: &str) -> &str {
    if let Some(rest) = field.strip_prefix("clocks_throttle_reasons.") {
        // Every clocks_event_reasons.X is also clocks_throttle_reasons.X; the caller keeps the
        // spelling it asked for in the header.
        return match rest {
            "supported" => "clocks_event_reasons.supported",
            "active" => "clocks_event_reasons.active",
            "gpu_idle" => "clocks_event_reasons.gpu_idle",
            "applications_clocks_setting" => "clocks_event_reasons.applications_clocks_setting",
            "sw_power_cap" => "clocks_event_reasons.sw_power_cap",
            "hw_slowdown" => "clocks_event_reasons.hw_slowdown",
            "hw_thermal_slowdown" => "clocks_event_reasons.hw_thermal_slowdown",
            "hw_power_brake_slowdown" => "clocks_event_reasons.hw_power_brake_slowdown",
            "sw_thermal_slowdown" => "clocks_event_reasons.sw_thermal_slowdown",
            "sync_boost" => "clocks_event_reasons.sync_boost",
            _ => field,
        };
    }
    match field {
        "gpu_name" => "name",
        "gpu_serial" => "serial",
        "gpu_uuid" => "uuid",
        "gpu_bus_id" => "pci.bus_id",
        "inforom.image" => "inforom.img",
        "inforom.power" => "inforom.pwr",
        "gpu_operation_mode.current" => "gom.current",
        "gpu_operation_mode.pending" => "gom.pending",
        "retired_pages.sbe" => "retired_pages.single_bit_ecc.count",
        "retired_pages.dbe" => "retired_pages.double_bit.count",
        "remapped_rows.sbe" => "remapped_rows.correctable",
        "remapped_rows.dbe" => "remapped_rows.uncorrectable",
        "gpu.power.draw.average" => "power.draw.average",
        "gpu.power.draw.instant" => "power.draw.instant",
        "gpu.power.requested_limit" => "power.limit",
        "gpu.power.current_limit" => "enforced.power.limit",
        "gpu.power.default_limit" => "power.default_limit",
        "gpu.power.min_limit" => "power.min_limit",
        "gpu.power.max_limit" => "power.max_limit",
        "module.power.requested_limit" => "module.power.limit",
        "module.power.current_limit" => "module.enforced.power.limit",
        "clocks.gr" => "clocks.current.graphics",
        "clocks.sm" => "clocks.current.sm",
        "clocks.mem" => "clocks.current.memory",
        "clocks.video" => "clocks.current.video",
        "clocks.applications.gr" => "clocks.applications.graphics",
        "clocks.applications.mem" => "clocks.applications.memory",
        "clocks.default_applications.gr" => "clocks.default_applications.graphics",
        "clocks.default_applications.mem" => "clocks.default_applications.memory",
        "clocks.max.gr" => "clocks.max.graphics",
        "clocks.max.mem" => "clocks.max.memory",
        other => other,
    }
}

/// "YYYY/MM/DD HH:MM:SS.mmm" in local time, as nvidia-smi stamps a query.
fn timestamp() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = now.as_secs() as libc::time_t;
    // SAFETY: zeroes are a valid `tm`; localtime_r writes it from a valid time_t and is thread-safe.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call.
    if unsafe { libc::localtime_r(&secs, &mut tm) }.is_null() {
        return NA.into();
    }
    format!(
        "{:04}/{:02}/{:02} {:02}:{:02}:{:02}.{:03}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        now.subsec_millis()
    )
}

/// What a GPU answers for one `--query-gpu` field (its canonical name), from the model; `None`
/// for a name `nvidia-smi --help-query-gpu` does not list. Fields the board does not report are
/// "[N/A]", as the real tool prints them for an H200 on driver 580 (`-q` and `--query-gpu` of
/// every field, idle).
fn answer(node: &Node, id: &GpuIdentity, field: &str) -> Option<Answer> {
    let m = id.model;
    let d = node.description();
    let hopper = m.architecture == tessera_sim_model::catalog::NVML_DEVICE_ARCH_HOPPER;
    let mem = node.memory_info(id.index, 0).ok();
    let mig = node.mig_mode(id.index).ok();
    let util = node.utilization(id.index, 0).ok();
    let health = node.health(id.index).ok();
    let load = util.as_ref().map_or(0, |u| u.gpu_percent.min(100));
    let busy = load > 0;
    let unit = unit_of(field);
    let na = || NA.to_string();
    let mib = |v: Option<u64>| v.map_or_else(na, |v| (v / MIB).to_string());
    let watts = |mw: u32| format!("{:.2}", f64::from(mw) / 1000.0);
    let on_off = |b: bool| on_off(b).to_string();
    let yes_no = |b: bool| if b { "Yes" } else { "No" }.to_string();
    let active = |b: bool| if b { "Active" } else { "Not Active" }.to_string();
    let (idle_sm, idle_video) = m.idle_clocks_mhz();
    let ecc = |corrected: bool, volatile: bool| {
        health.as_ref().map_or_else(na, |h| {
            match (corrected, volatile) {
                (true, true) => h.ecc_corrected_volatile,
                (true, false) => h.ecc_corrected_aggregate,
                (false, true) => h.ecc_uncorrected_volatile,
                (false, false) => h.ecc_uncorrected_aggregate,
            }
            .to_string()
        })
    };
    let text = match field {
        "timestamp" => timestamp(),
        "driver_version" => d.driver_version.clone(),
        "count" => node.gpus().len().to_string(),
        "name" => m.name.to_string(),
        "serial" => id.serial.clone(),
        "uuid" => id.uuid.clone(),
        "pci.bus_id" => id.bus_id.clone(),
        "pci.domain" => format!("0x{:04X}", id.pci_domain),
        "pci.bus" => format!("0x{:02X}", id.pci_bus),
        "pci.device" => format!("0x{:02X}", id.pci_device),
        // A 3D controller: base class 3, sub class 2.
        "pci.baseClass" => "0x3".into(),
        "pci.subClass" => "0x2".into(),
        "pci.device_id" => format!("0x{:08X}", m.pci_device_id),
        "pci.sub_device_id" => format!("0x{:08X}", m.pci_subsystem_id),
        "pcie.link.gen.current" | "pcie.link.gen.gpucurrent" | "pcie.link.gen.max" | "pcie.link.gen.gpumax" => {
            m.pcie_max_gen.to_string()
        }
        "pcie.link.width.current" | "pcie.link.width.max" => m.pcie_max_width.to_string(),
        "index" => id.index.to_string(),
        "display_mode" => "[Requested functionality has been deprecated]".into(),
        // What an H200 on 580.173.02 answers, with no display engine.
        "display_attached" => "Yes".into(),
        "display_active" => "Disabled".into(),
        "persistence_mode" => "Enabled".into(),
        "addressing_mode" => "None".into(),
        "accounting.mode" => "Disabled".into(),
        "accounting.buffer_size" => "4000".into(),
        "vbios_version" => m.vbios_version.into(),
        "inforom.img" => m.inforom_image.into(),
        // InfoROM object versions of the boards' captures (Hopper 2.1 / 7.16, A100 2.0 / 6.16).
        "inforom.oem" => if hopper { "2.1" } else { "2.0" }.into(),
        "inforom.ecc" => if hopper { "7.16" } else { "6.16" }.into(),
        "inforom.checksum_validation" => "valid".into(),
        "gpu_recovery_action" => match health.as_ref().map(|h| h.recovery_action) {
            Some(tessera_sim_model::faults::RECOVERY_GPU_RESET) => "Reset".into(),
            Some(tessera_sim_model::faults::RECOVERY_NODE_REBOOT) => "Reboot".into(),
            _ => "None".into(),
        },
        "pstate" => "P0".into(),
        // Bits 0-8 of nvmlClocksEventReasons; only "GPU idle" (bit 0) is ever active here.
        "clocks_event_reasons.supported" => "0x00000000000001FF".into(),
        "clocks_event_reasons.active" => format!("0x{:016X}", u64::from(!busy)),
        "clocks_event_reasons.gpu_idle" => active(!busy),
        "clocks_event_reasons.applications_clocks_setting"
        | "clocks_event_reasons.sw_power_cap"
        | "clocks_event_reasons.hw_slowdown"
        | "clocks_event_reasons.hw_thermal_slowdown"
        | "clocks_event_reasons.hw_power_brake_slowdown"
        | "clocks_event_reasons.sw_thermal_slowdown"
        | "clocks_event_reasons.sync_boost" => active(false),
        f if f.starts_with("clocks_event_reasons_counters.") => "0".into(),
        "memory.total" => mib(Some(m.memory_bytes)),
        "memory.reserved" => mib(mem.map(|m| m.reserved)),
        "memory.used" => mib(mem.map(|m| m.used)),
        "memory.free" => mib(mem.map(|m| m.free)),
        "compute_mode" => "Default".into(),
        "compute_cap" => format!("{}.{}", m.cc_major, m.cc_minor),
        "utilization.gpu" => util.as_ref().map_or_else(na, |u| u.gpu_percent.to_string()),
        // Memory-controller, media and optical-flow engines are not simulated: idle.
        "utilization.memory"
        | "utilization.encoder"
        | "utilization.decoder"
        | "utilization.jpeg"
        | "utilization.ofa" => util.as_ref().map_or_else(na, |_| "0".into()),
        "encoder.stats.sessionCount" | "encoder.stats.averageFps" | "encoder.stats.averageLatency" => "0".into(),
        "ecc.mode.current" | "ecc.mode.pending" => on_off(true),
        f if f.starts_with("ecc.errors.") => {
            let corrected = f.starts_with("ecc.errors.corrected.");
            let volatile = f.contains(".volatile.");
            match f.rsplit('.').next().unwrap_or_default() {
                // HBM boards count DRAM (device memory) and SRAM errors; the rest is not reported.
                "device_memory" | "dram" | "total" => ecc(corrected, volatile),
                "register_file" | "l1_cache" | "l2_cache" | "texture_memory" | "cbu" => na(),
                "thresholdExceeded" => yes_no(false),
                _ => "0".into(),
            }
        }
        // Hopper and the A100 remap rows instead of retiring pages.
        "retired_pages.single_bit_ecc.count" | "retired_pages.double_bit.count" | "retired_pages.pending" => na(),
        "remapped_rows.correctable" => health.as_ref().map_or_else(na, |h| h.remapped_correctable.to_string()),
        "remapped_rows.uncorrectable" => health.as_ref().map_or_else(na, |h| h.remapped_uncorrectable.to_string()),
        "remapped_rows.correctable_inactive" | "remapped_rows.uncorrectable_inactive" => "0".into(),
        "remapped_rows.pending" => health.as_ref().map_or_else(na, |h| yes_no(h.remap_pending)),
        "remapped_rows.failure" => health.as_ref().map_or_else(na, |h| yes_no(h.remap_failure)),
        // Derived: 512 banks per HBM stack of 1024 bits, all with full remap availability (an H200,
        // six stacks, shows 3072).
        "remapped_rows.histogram.max" => (m.memory_bus_width_bits.div_ceil(1024) * 512).to_string(),
        "remapped_rows.histogram.high"
        | "remapped_rows.histogram.partial"
        | "remapped_rows.histogram.low"
        | "remapped_rows.histogram.none" => "0".into(),
        "temperature.gpu" => m.temperature_c(load).to_string(),
        "temperature.gpu.tlimit" => m.max_operating_temp_c.saturating_sub(m.temperature_c(load)).to_string(),
        // Derived: HBM a degree above the die, as the H200 capture shows at idle.
        "temperature.memory" => (m.temperature_c(load) + 1).to_string(),
        "power.management" => "Enabled".into(),
        "power.draw" | "power.draw.average" | "power.draw.instant" => watts(m.power_draw_mw(load)),
        "power.limit" | "enforced.power.limit" | "power.default_limit" | "power.max_limit" => watts(m.power_limit_mw),
        "power.min_limit" => watts(m.min_power_limit_mw),
        "clocks.current.graphics" | "clocks.current.sm" => if busy { m.max_sm_clock_mhz } else { idle_sm }.to_string(),
        "clocks.current.memory"
        | "clocks.applications.memory"
        | "clocks.default_applications.memory"
        | "clocks.max.memory" => m.max_mem_clock_mhz.to_string(),
        "clocks.current.video" => if busy { m.max_video_clock_mhz } else { idle_video }.to_string(),
        "clocks.applications.graphics" | "clocks.default_applications.graphics" => {
            m.default_app_sm_clock_mhz.to_string()
        }
        "clocks.max.graphics" | "clocks.max.sm" => m.max_sm_clock_mhz.to_string(),
        "mig.mode.current" => mig.map_or_else(na, |(cur, _)| on_off(cur)),
        "mig.mode.pending" => mig.map_or_else(na, |(_, pend)| on_off(pend)),
        "gsp.mode.current" | "gsp.mode.default" => on_off(true),
        "c2c.mode" => on_off(false),
        "protected_memory.total" | "protected_memory.used" | "protected_memory.free" => "0".into(),
        // Hopper registers with the NVLink fabric (an H200 on 580: "Completed", "Success", no
        // health summary); the A100 has no fabric state to report.
        "fabric.state" if hopper => "Completed".into(),
        "fabric.status" if hopper => "Success".into(),
        "fabric.cliqueId" if hopper => "0".into(),
        "fabric.clusterUuid" if hopper => "00000000-0000-0000-0000-000000000000".into(),
        f if hopper && f.starts_with("fabric.health.") => "N/A".into(),
        "platform.chassis_serial_number" if hopper => String::new(),
        "platform.slot_number" | "platform.tray_index" if hopper => "0".into(),
        "platform.host_id" if hopper => "1".into(),
        "platform.peer_type" if hopper => "Direct Connected".into(),
        "platform.module_id" if hopper => (id.index + 1).to_string(),
        "platform.gpu_fabric_guid" if hopper => "0x0000000000000000".into(),
        // Listed, and not reported by these boards or this driver (vGPU, display, fan, GOM, DRAM
        // encryption, module power, power smoothing, hostname).
        "vgpu_driver_capability.heterogenous_multivGPU"
        | "vgpu_device_capability.fractional_multiVgpu"
        | "vgpu_device_capability.heterogeneous_timeSlice_profile"
        | "vgpu_device_capability.heterogeneous_timeSlice_sizes"
        | "vgpu_device_capability.homogeneous_placements"
        | "vgpu_device_capability.mig_timeSlicing"
        | "vgpu_device_capability.mig_timeSlicing_mode"
        | "pcie.link.gen.hostmax"
        | "driver_model.current"
        | "driver_model.pending"
        | "inforom.pwr"
        | "gom.current"
        | "gom.pending"
        | "fan.speed"
        | "dramEncryption.mode.current"
        | "dramEncryption.mode.pending"
        | "module.power.draw.average"
        | "module.power.draw.instant"
        | "module.power.limit"
        | "module.enforced.power.limit"
        | "module.power.default_limit"
        | "module.power.min_limit"
        | "module.power.max_limit"
        | "hostname" => na(),
        f if f.starts_with("power_smoothing.") && POWER_SMOOTHING.contains(&f) => na(),
        f if FABRIC_AND_PLATFORM.contains(&f) => na(),
        _ => return None,
    };
    Some(Answer { text, unit })
}

/// The `power_smoothing.*` fields `--help-query-gpu` lists.
const POWER_SMOOTHING: &[&str] = &[
    "power_smoothing.delayed_power_smoothing_supported",
    "power_smoothing.primary_power_floor",
    "power_smoothing.secondary_power_floor",
    "power_smoothing.min_primary_floor_activation_offset",
    "power_smoothing.min_primary_floor_activation_point",
    "power_smoothing.window_multiplier",
    "power_smoothing.curr_profile.secondary_power_floor",
    "power_smoothing.curr_profile.primary_floor_act_window_multiplier",
    "power_smoothing.curr_profile.primary_floor_tar_window_multiplier",
    "power_smoothing.curr_profile.primary_floor_act_offset",
    "power_smoothing.admin_override.secondary_power_floor",
    "power_smoothing.admin_override.primary_floor_act_window_multiplier",
    "power_smoothing.admin_override.primary_floor_tar_window_multiplier",
    "power_smoothing.admin_override.primary_floor_act_offset",
];

/// The `fabric.*` and `platform.*` fields `--help-query-gpu` lists ("[N/A]" on the A100).
const FABRIC_AND_PLATFORM: &[&str] = &[
    "fabric.state",
    "fabric.status",
    "fabric.cliqueId",
    "fabric.clusterUuid",
    "fabric.health.summary",
    "fabric.health.bandwidth",
    "fabric.health.route_recovery_in_progress",
    "fabric.health.route_unhealthy",
    "fabric.health.access_timeout_recovery",
    "fabric.health.incorrect_configuration",
    "fabric.health.partition_assigned",
    "platform.chassis_serial_number",
    "platform.slot_number",
    "platform.tray_index",
    "platform.host_id",
    "platform.peer_type",
    "platform.module_id",
    "platform.gpu_fabric_guid",
];

/// nvidia-smi's refusal of a field it does not list, on stdout with exit status 2.
fn not_a_field(field: &str) -> Failure {
    bad(format!("Field \"{field}\" is not a valid field to query.\n"))
}

fn query_gpu(node: &Node, gpus: &[&GpuIdentity], fields: &str, format: &str) -> Result<String, Failure> {
    let opts: Vec<&str> = format.split(',').map(str::trim).collect();
    if opts.first() != Some(&"csv") || opts[1..].iter().any(|o| !["noheader", "nounits"].contains(o)) {
        return Err(bad(format!("\"{format}\" is not a valid format; use csv, optionally with noheader and nounits.")));
    }
    let (header, units) = (!opts.contains(&"noheader"), !opts.contains(&"nounits"));
    let fields: Vec<&str> = fields.split(',').map(str::trim).collect();
    // Every field is checked before anything is printed, as the real tool refuses the query whole.
    let first = node.gpus().first();
    for f in &fields {
        let known = first.is_none_or(|id| answer(node, id, canonical(f)).is_some());
        if !known {
            return Err(not_a_field(f));
        }
    }
    let mut rows = Vec::new();
    for id in gpus {
        let mut row = Vec::new();
        for f in &fields {
            let a = answer(node, id, canonical(f)).ok_or_else(|| not_a_field(f))?;
            let bracketed = a.text.starts_with('[');
            row.push(match a.unit {
                Some(u) if units && !bracketed => format!("{} {u}", a.text),
                _ => a.text,
            });
        }
        rows.push(row.join(", "));
    }
    let mut s = String::new();
    if header {
        let names: Vec<String> = fields
            .iter()
            .map(|f| match unit_of(canonical(f)) {
                Some(u) if units => format!("{f} [{u}]"),
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
