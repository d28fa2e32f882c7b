//! The simulated `nvidia-smi --query-gpu`: every field the real tool lists (`nvidia-smi
//! --help-query-gpu`, driver 580), each answered from the model as the real tool answers it for
//! that board, and the real tool's refusal of a field it does not list.
//!
//! The expected H200 answers are those of a real idle H200 on driver 580.173.02 (`--query-gpu` of
//! every field), except the board's own identity and what the reading of our own H200 (580.159.04;
//! `plugins/sim/driver/tests/data/h200-facts.json`) gave differently: VBIOS, subsystem id,
//! reserved memory, idle temperature and power.

use std::process::Output;

use tessera_sim_testkit::{SimNode, binary};

/// The fields `nvidia-smi --help-query-gpu` lists (driver 580), in its order, and what the
/// simulated idle H200 answers to each (`None`: the node's own identity, checked separately).
const H200_IDLE: &[(&str, Option<&str>)] = &[
    ("timestamp", None),
    ("driver_version", Some("580.173.02")),
    ("vgpu_driver_capability.heterogenous_multivGPU", Some("[N/A]")),
    ("count", Some("1")),
    ("name", Some("NVIDIA H200")),
    ("serial", None),
    ("uuid", None),
    ("pci.bus_id", Some("00000000:18:00.0")),
    ("pci.domain", Some("0x0000")),
    ("pci.bus", Some("0x18")),
    ("pci.device", Some("0x00")),
    ("pci.baseClass", Some("0x3")),
    ("pci.subClass", Some("0x2")),
    ("pci.device_id", Some("0x233510DE")),
    ("pci.sub_device_id", Some("0x18BF10DE")),
    ("vgpu_device_capability.fractional_multiVgpu", Some("[N/A]")),
    ("vgpu_device_capability.heterogeneous_timeSlice_profile", Some("[N/A]")),
    ("vgpu_device_capability.heterogeneous_timeSlice_sizes", Some("[N/A]")),
    ("vgpu_device_capability.homogeneous_placements", Some("[N/A]")),
    ("vgpu_device_capability.mig_timeSlicing", Some("[N/A]")),
    ("vgpu_device_capability.mig_timeSlicing_mode", Some("[N/A]")),
    ("pcie.link.gen.current", Some("5")),
    ("pcie.link.gen.gpucurrent", Some("5")),
    ("pcie.link.gen.max", Some("5")),
    ("pcie.link.gen.gpumax", Some("5")),
    ("pcie.link.gen.hostmax", Some("[N/A]")),
    ("pcie.link.width.current", Some("16")),
    ("pcie.link.width.max", Some("16")),
    ("index", Some("0")),
    ("display_mode", Some("[Requested functionality has been deprecated]")),
    ("display_attached", Some("Yes")),
    ("display_active", Some("Disabled")),
    ("persistence_mode", Some("Enabled")),
    ("addressing_mode", Some("None")),
    ("accounting.mode", Some("Disabled")),
    ("accounting.buffer_size", Some("4000")),
    ("driver_model.current", Some("[N/A]")),
    ("driver_model.pending", Some("[N/A]")),
    ("vbios_version", Some("96.00.A5.00.1A")),
    ("inforom.img", Some("G520.0280.02.02")),
    ("inforom.oem", Some("2.1")),
    ("inforom.ecc", Some("7.16")),
    ("inforom.pwr", Some("[N/A]")),
    ("inforom.checksum_validation", Some("valid")),
    ("gpu_recovery_action", Some("None")),
    ("gom.current", Some("[N/A]")),
    ("gom.pending", Some("[N/A]")),
    ("fan.speed", Some("[N/A]")),
    ("pstate", Some("P0")),
    ("clocks_event_reasons.supported", Some("0x00000000000001FF")),
    ("clocks_event_reasons.active", Some("0x0000000000000001")),
    ("clocks_event_reasons.gpu_idle", Some("Active")),
    ("clocks_event_reasons.applications_clocks_setting", Some("Not Active")),
    ("clocks_event_reasons.sw_power_cap", Some("Not Active")),
    ("clocks_event_reasons.hw_slowdown", Some("Not Active")),
    ("clocks_event_reasons.hw_thermal_slowdown", Some("Not Active")),
    ("clocks_event_reasons.hw_power_brake_slowdown", Some("Not Active")),
    ("clocks_event_reasons.sw_thermal_slowdown", Some("Not Active")),
    ("clocks_event_reasons.sync_boost", Some("Not Active")),
    ("clocks_event_reasons_counters.sw_power_cap", Some("0 us")),
    ("clocks_event_reasons_counters.sync_boost", Some("0 us")),
    ("clocks_event_reasons_counters.sw_thermal_slowdown", Some("0 us")),
    ("clocks_event_reasons_counters.hw_thermal_slowdown", Some("0 us")),
    ("clocks_event_reasons_counters.hw_power_brake_slowdown", Some("0 us")),
    ("memory.total", Some("143771 MiB")),
    ("memory.reserved", Some("618 MiB")),
    ("memory.used", Some("0 MiB")),
    ("memory.free", Some("143152 MiB")),
    ("compute_mode", Some("Default")),
    ("compute_cap", Some("9.0")),
    ("utilization.gpu", Some("0 %")),
    ("utilization.memory", Some("0 %")),
    ("utilization.encoder", Some("0 %")),
    ("utilization.decoder", Some("0 %")),
    ("utilization.jpeg", Some("0 %")),
    ("utilization.ofa", Some("0 %")),
    ("encoder.stats.sessionCount", Some("0")),
    ("encoder.stats.averageFps", Some("0")),
    ("encoder.stats.averageLatency", Some("0")),
    ("dramEncryption.mode.current", Some("[N/A]")),
    ("dramEncryption.mode.pending", Some("[N/A]")),
    ("ecc.mode.current", Some("Enabled")),
    ("ecc.mode.pending", Some("Enabled")),
    ("ecc.errors.corrected.volatile.device_memory", Some("0")),
    ("ecc.errors.corrected.volatile.dram", Some("0")),
    ("ecc.errors.corrected.volatile.register_file", Some("[N/A]")),
    ("ecc.errors.corrected.volatile.l1_cache", Some("[N/A]")),
    ("ecc.errors.corrected.volatile.l2_cache", Some("[N/A]")),
    ("ecc.errors.corrected.volatile.texture_memory", Some("[N/A]")),
    ("ecc.errors.corrected.volatile.cbu", Some("[N/A]")),
    ("ecc.errors.corrected.volatile.sram", Some("0")),
    ("ecc.errors.corrected.volatile.total", Some("0")),
    ("ecc.errors.corrected.aggregate.device_memory", Some("0")),
    ("ecc.errors.corrected.aggregate.dram", Some("0")),
    ("ecc.errors.corrected.aggregate.register_file", Some("[N/A]")),
    ("ecc.errors.corrected.aggregate.l1_cache", Some("[N/A]")),
    ("ecc.errors.corrected.aggregate.l2_cache", Some("[N/A]")),
    ("ecc.errors.corrected.aggregate.texture_memory", Some("[N/A]")),
    ("ecc.errors.corrected.aggregate.cbu", Some("[N/A]")),
    ("ecc.errors.corrected.aggregate.sram", Some("0")),
    ("ecc.errors.corrected.aggregate.total", Some("0")),
    ("ecc.errors.uncorrected.volatile.device_memory", Some("0")),
    ("ecc.errors.uncorrected.volatile.dram", Some("0")),
    ("ecc.errors.uncorrected.volatile.register_file", Some("[N/A]")),
    ("ecc.errors.uncorrected.volatile.l1_cache", Some("[N/A]")),
    ("ecc.errors.uncorrected.volatile.l2_cache", Some("[N/A]")),
    ("ecc.errors.uncorrected.volatile.texture_memory", Some("[N/A]")),
    ("ecc.errors.uncorrected.volatile.cbu", Some("[N/A]")),
    ("ecc.errors.uncorrected.volatile.sram", Some("0")),
    ("ecc.errors.uncorrected.volatile.total", Some("0")),
    ("ecc.errors.uncorrected.aggregate.device_memory", Some("0")),
    ("ecc.errors.uncorrected.aggregate.dram", Some("0")),
    ("ecc.errors.uncorrected.aggregate.register_file", Some("[N/A]")),
    ("ecc.errors.uncorrected.aggregate.l1_cache", Some("[N/A]")),
    ("ecc.errors.uncorrected.aggregate.l2_cache", Some("[N/A]")),
    ("ecc.errors.uncorrected.aggregate.texture_memory", Some("[N/A]")),
    ("ecc.errors.uncorrected.aggregate.cbu", Some("[N/A]")),
    ("ecc.errors.uncorrected.aggregate.sram", Some("0")),
    ("ecc.errors.uncorrected.aggregate.total", Some("0")),
    ("ecc.errors.uncorrected.volatile.sram.parity", Some("0")),
    ("ecc.errors.uncorrected.volatile.sram.secded", Some("0")),
    ("ecc.errors.uncorrected.aggregate.sram.parity", Some("0")),
    ("ecc.errors.uncorrected.aggregate.sram.secded", Some("0")),
    ("ecc.errors.uncorrected.aggregate.sram.thresholdExceeded", Some("No")),
    ("ecc.errors.uncorrected.aggregate.sram.l2", Some("0")),
    ("ecc.errors.uncorrected.aggregate.sram.sm", Some("0")),
    ("ecc.errors.uncorrected.aggregate.sram.mcu", Some("0")),
    ("ecc.errors.uncorrected.aggregate.sram.pcie", Some("0")),
    ("ecc.errors.uncorrected.aggregate.sram.other", Some("0")),
    ("retired_pages.single_bit_ecc.count", Some("[N/A]")),
    ("retired_pages.double_bit.count", Some("[N/A]")),
    ("retired_pages.pending", Some("[N/A]")),
    ("remapped_rows.correctable", Some("0")),
    ("remapped_rows.correctable_inactive", Some("0")),
    ("remapped_rows.uncorrectable", Some("0")),
    ("remapped_rows.uncorrectable_inactive", Some("0")),
    ("remapped_rows.pending", Some("No")),
    ("remapped_rows.failure", Some("No")),
    ("remapped_rows.histogram.max", Some("3072")),
    ("remapped_rows.histogram.high", Some("0")),
    ("remapped_rows.histogram.partial", Some("0")),
    ("remapped_rows.histogram.low", Some("0")),
    ("remapped_rows.histogram.none", Some("0")),
    ("temperature.gpu", Some("43")),
    ("temperature.gpu.tlimit", Some("44")),
    ("temperature.memory", Some("44")),
    ("power.management", Some("Enabled")),
    ("power.draw", Some("83.95 W")),
    ("power.draw.average", Some("83.95 W")),
    ("power.draw.instant", Some("83.95 W")),
    ("power.limit", Some("700.00 W")),
    ("enforced.power.limit", Some("700.00 W")),
    ("power.default_limit", Some("700.00 W")),
    ("power.min_limit", Some("200.00 W")),
    ("power.max_limit", Some("700.00 W")),
    ("module.power.draw.average", Some("[N/A]")),
    ("module.power.draw.instant", Some("[N/A]")),
    ("module.power.limit", Some("[N/A]")),
    ("module.enforced.power.limit", Some("[N/A]")),
    ("module.power.default_limit", Some("[N/A]")),
    ("module.power.min_limit", Some("[N/A]")),
    ("module.power.max_limit", Some("[N/A]")),
    ("power_smoothing.delayed_power_smoothing_supported", Some("[N/A]")),
    ("power_smoothing.primary_power_floor", Some("[N/A]")),
    ("power_smoothing.secondary_power_floor", Some("[N/A]")),
    ("power_smoothing.min_primary_floor_activation_offset", Some("[N/A]")),
    ("power_smoothing.min_primary_floor_activation_point", Some("[N/A]")),
    ("power_smoothing.window_multiplier", Some("[N/A]")),
    ("power_smoothing.curr_profile.secondary_power_floor", Some("[N/A]")),
    ("power_smoothing.curr_profile.primary_floor_act_window_multiplier", Some("[N/A]")),
    ("power_smoothing.curr_profile.primary_floor_tar_window_multiplier", Some("[N/A]")),
    ("power_smoothing.curr_profile.primary_floor_act_offset", Some("[N/A]")),
    ("power_smoothing.admin_override.secondary_power_floor", Some("[N/A]")),
    ("power_smoothing.admin_override.primary_floor_act_window_multiplier", Some("[N/A]")),
    ("power_smoothing.admin_override.primary_floor_tar_window_multiplier", Some("[N/A]")),
    ("power_smoothing.admin_override.primary_floor_act_offset", Some("[N/A]")),
    ("clocks.current.graphics", Some("345 MHz")),
    ("clocks.current.sm", Some("345 MHz")),
    ("clocks.current.memory", Some("3201 MHz")),
    ("clocks.current.video", Some("765 MHz")),
    ("clocks.applications.graphics", Some("1980 MHz")),
    ("clocks.applications.memory", Some("3201 MHz")),
    ("clocks.default_applications.graphics", Some("1980 MHz")),
    ("clocks.default_applications.memory", Some("3201 MHz")),
    ("clocks.max.graphics", Some("1980 MHz")),
    ("clocks.max.sm", Some("1980 MHz")),
    ("clocks.max.memory", Some("3201 MHz")),
    ("mig.mode.current", Some("Disabled")),
    ("mig.mode.pending", Some("Disabled")),
    ("gsp.mode.current", Some("Enabled")),
    ("gsp.mode.default", Some("Enabled")),
    ("c2c.mode", Some("Disabled")),
    ("protected_memory.total", Some("0 MiB")),
    ("protected_memory.used", Some("0 MiB")),
    ("protected_memory.free", Some("0 MiB")),
    ("fabric.state", Some("Completed")),
    ("fabric.status", Some("Success")),
    ("fabric.cliqueId", Some("0")),
    ("fabric.clusterUuid", Some("00000000-0000-0000-0000-000000000000")),
    ("fabric.health.summary", Some("N/A")),
    ("fabric.health.bandwidth", Some("N/A")),
    ("fabric.health.route_recovery_in_progress", Some("N/A")),
    ("fabric.health.route_unhealthy", Some("N/A")),
    ("fabric.health.access_timeout_recovery", Some("N/A")),
    ("fabric.health.incorrect_configuration", Some("N/A")),
    ("fabric.health.partition_assigned", Some("N/A")),
    ("platform.chassis_serial_number", Some("")),
    ("platform.slot_number", Some("0")),
    ("platform.tray_index", Some("0")),
    ("platform.host_id", Some("1")),
    ("platform.peer_type", Some("Direct Connected")),
    ("platform.module_id", Some("1")),
    ("platform.gpu_fabric_guid", Some("0x0000000000000000")),
    ("hostname", Some("[N/A]")),
];

const H200_NODE: &str =
    "driver_version = \"580.173.02\"\ncuda_driver_version = 13000\n[[gpu]]\nmodel = \"H200-141GB\"\n";

/// Runs the sim as `nvidia-smi` (the name it answers to) against `node`.
/// The fields the real tool lists, in its order.
fn fields() -> Vec<&'static str> {
    H200_IDLE.iter().map(|&(field, _)| field).collect()
}

fn smi(node: &SimNode, args: &[&str]) -> Output {
    let dir = node.root.join("bin");
    let link = dir.join("nvidia-smi");
    if !link.exists() {
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(binary("tessera-sim"), &link).unwrap();
    }
    node.command(&link).args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// One CSV row as nvidia-smi separates it (", ").
fn cells(line: &str) -> Vec<&str> {
    line.split(", ").collect()
}

#[test]
fn every_listed_field_is_answered_as_the_real_tool_answers_an_h200() {
    let node = SimNode::with_description(H200_NODE);
    let fields = fields();
    let o = smi(&node, &[&format!("--query-gpu={}", fields.join(",")), "--format=csv"]);
    assert!(o.status.success(), "{}", stdout(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    let (header, row) = (cells(lines[0]), cells(lines[1]));
    assert_eq!((header.len(), row.len()), (fields.len(), fields.len()), "{out}");
    let mut wrong = Vec::new();
    for (i, &(field, want)) in H200_IDLE.iter().enumerate() {
        if let Some(want) = want
            && row[i] != want
        {
            wrong.push(format!("{field}: {:?}, expected {want:?}", row[i]));
        }
    }
    assert!(wrong.is_empty(), "{} fields differ:\n  {}", wrong.len(), wrong.join("\n  "));
    // The node's own identity, and a timestamp as nvidia-smi writes it ("2026/09/01 20:41:56.941").
    let gpu0 = tessera_sim_model::NodeDescription::parse(H200_NODE).unwrap().identities().remove(0);
    let at = |f: &str| row[fields.iter().position(|x| *x == f).unwrap()];
    assert_eq!((at("serial"), at("uuid")), (gpu0.serial.as_str(), gpu0.uuid.as_str()));
    let t = at("timestamp");
    let shape: String = t.chars().map(|c| if c.is_ascii_digit() { '9' } else { c }).collect();
    assert_eq!(shape, "9999/99/99 99:99:99.999", "{t}");
    // Units name themselves in the header and go with nounits; "[N/A]" never carries one.
    for (f, u) in [("memory.total", "MiB"), ("power.draw", "W"), ("clocks.max.sm", "MHz"), ("fan.speed", "%")] {
        assert_eq!(header[fields.iter().position(|x| *x == f).unwrap()], format!("{f} [{u}]"));
    }
    let o =
        smi(&node, &["--query-gpu=memory.total,power.draw,fan.speed,compute_mode", "--format=csv,noheader,nounits"]);
    assert_eq!(stdout(&o), "143771, 83.95, [N/A], Default\n");
}

#[test]
fn compute_mode_and_the_other_names_of_a_field() {
    let node = SimNode::new();
    let o = smi(&node, &["--query-gpu=compute_mode", "--format=csv", "-i", "0"]);
    assert!(o.status.success(), "{}", stdout(&o));
    assert_eq!(stdout(&o), "compute_mode\nDefault\n");
    // --help-query-gpu gives some fields two names: both answer the same, each under its own.
    let pairs = [
        ("gpu_name", "name"),
        ("gpu_bus_id", "pci.bus_id"),
        ("clocks_throttle_reasons.active", "clocks_event_reasons.active"),
        ("gpu.power.default_limit", "power.default_limit"),
        ("clocks.max.gr", "clocks.max.graphics"),
        ("retired_pages.dbe", "retired_pages.double_bit.count"),
        ("remapped_rows.sbe", "remapped_rows.correctable"),
        ("inforom.image", "inforom.img"),
        ("gpu_operation_mode.current", "gom.current"),
    ];
    for (alias, name) in pairs {
        let o = smi(&node, &[&format!("--query-gpu={alias},{name}"), "--format=csv", "-i", "0"]);
        let out = stdout(&o);
        let lines: Vec<&str> = out.lines().collect();
        assert!(o.status.success() && lines.len() == 2, "{alias}: {out}");
        assert!(cells(lines[0])[0].starts_with(alias), "{out}");
        let values = cells(lines[1]);
        assert_eq!(values[0], values[1], "{alias} and {name}: {out}");
    }
    // An H100 reports its own board; the A100 has no fabric or platform information.
    let o = smi(
        &node,
        &["--query-gpu=vbios_version,pci.sub_device_id,pcie.link.gen.max", "--format=csv,noheader", "-i", "0"],
    );
    assert_eq!(stdout(&o), "96.00.74.00.0D, 0x16C110DE, 5\n");
    let a100 = SimNode::with_description("[[gpu]]\nmodel = \"A100-SXM4-40GB\"\n");
    let o = smi(&a100, &["--query-gpu=fabric.state,platform.module_id,pcie.link.gen.max", "--format=csv,noheader"]);
    assert_eq!(stdout(&o), "[N/A], [N/A], 4\n");
}

#[test]
fn a_field_the_real_tool_does_not_list_is_refused_in_its_words() {
    let node = SimNode::new();
    for query in ["xyz", "index,xyz", "cuda_version", "clocks.applications.sm"] {
        let o = smi(&node, &[&format!("--query-gpu={query}"), "--format=csv"]);
        let bad = query.split(',').find(|f| !fields().contains(f)).unwrap();
        assert_eq!(o.status.code(), Some(2), "{query}");
        // Nothing else: the query is refused whole, on stdout, with a blank line after.
        assert_eq!(stdout(&o), format!("Field \"{bad}\" is not a valid field to query.\n\n"), "{query}");
    }
}
