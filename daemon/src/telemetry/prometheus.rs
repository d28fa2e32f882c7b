//! The Prometheus text exposition format (version 0.0.4) of the node's metrics.
//!
//! Per GPU, the names dcgm-exporter users already query, with dcgm-exporter's labels (`gpu`,
//! `UUID`, `device="nvidia<index>"`, `modelName`, `Hostname`, `pci_bus_id`, and `GPU_I_PROFILE`
//! and `GPU_I_ID` for MIG devices, whose `UUID` is the MIG device's own so that it joins with the
//! containers'):
//!
//! - `DCGM_FI_DEV_FB_USED`, `DCGM_FI_DEV_FB_FREE` (gauges, MiB, as dcgm), `DCGM_FI_DEV_GPU_UTIL`
//!   (gauge, %, when known);
//! - when NVML tells them: `DCGM_FI_DEV_GPU_TEMP` (°C), `DCGM_FI_DEV_POWER_USAGE` (W),
//!   `DCGM_FI_DEV_SM_CLOCK` and `DCGM_FI_DEV_MEM_CLOCK` (MHz), and the volatile ECC counters
//!   `DCGM_FI_DEV_ECC_SBE_VOL_TOTAL` and `DCGM_FI_DEV_ECC_DBE_VOL_TOTAL` (counters, as dcgm; a
//!   GPU reset clears them, which Prometheus's `rate` reads as a counter reset);
//! - `DCGM_FI_DEV_XID_ERRORS` (gauge, whole GPUs): the last XID seen, 0 when none; a reset
//!   keeps it, as dcgm does.
//!
//! MIG devices also have `GPU_I_ID` (the GPU instance id); a device exactly one container holds
//! also has that container's `container`, `namespace` and `pod` (dcgm-exporter's kubelet mapping).
//!
//! Tessera's own, with conventional names and units:
//!
//! - `tessera_gpu_healthy` (0/1, the GPU labels above);
//! - per container and physical device (labels `allocation`, `resource`, `UUID`, `device_id`,
//!   `namespace`, `pod`, `container`: dcgm-exporter's names for pod attribution; empty when not
//!   known): `tessera_container_memory_{used,peak,limit}_bytes`,
//!   `tessera_container_sm_{achieved,limit}_percent`, and the counters
//!   `tessera_container_{launches,gpu_seconds,throttled_seconds,oom_denials}_total`. A limit is
//!   left out when there is none;
//! - per container: `tessera_container_processes`;
//! - per node: `tessera_allocations`, `tessera_events_total`, `tessera_faults_total`;
//! - per resource the device plugin serves (label `resource`), while it runs:
//!   `tessera_kubelet_devices_withdrawn` (gauge), its free devices told unhealthy to the kubelet
//!   because the node API's allocations leave them no room;
//! - enforcement ([`crate::enforcement`]): `tessera_container_limit_breaches_total` (counter, per
//!   allocation and device: `allocation`, `UUID`, `device_id`, `namespace`, `pod`, `container`,
//!   `action` = `kill` or `report`, `limit` = `memory` or `sm`) and
//!   `tessera_unattributed_gpu_processes` (gauge); `tessera_container_sm_seconds_total` (counter,
//!   the same labels as the breaches without `action` and `limit`: SM time by NVML's per-process
//!   utilization, read at the enforcement polls).

use std::fmt::Write as _;

use crate::usage::UsageReport;

/// The content type of what [`render`] returns.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const MIB: u64 = 1024 * 1024;

/// One GPU or MIG device of the node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuMetrics {
    /// The GPU's NVML index (for a MIG device, its parent's).
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub pci_bus_id: String,
    /// Bytes.
    pub memory_used: u64,
    /// Bytes.
    pub memory_total: u64,
    pub utilization_percent: Option<u32>,
    pub healthy: bool,
    /// The GPU instance profile (e.g. `1g.10gb`) of a MIG device; `None` for a whole GPU.
    pub mig_profile: Option<String>,
    /// The GPU a MIG device is part of.
    pub parent_uuid: Option<String>,
    /// The GPU instance id of a MIG device; `None` for a whole GPU.
    pub gpu_instance_id: Option<u32>,
    /// What NVML's sensors and counters say (whole GPUs only).
    pub sensors: GpuSensors,
    /// The last XID the health monitor saw on the GPU since the daemon started, 0 when none
    /// (kept across GPU resets, as dcgm does); `None` for a MIG device (XIDs are per GPU).
    pub last_xid: Option<u32>,
    /// The one container holding the device, when exactly one does and its pod is known.
    pub holder: Option<PodLabels>,
    /// Whole GPUs the configuration lays out: whether the layout in place is the one wanted
    /// (`false` while it is diverged or waits for a reset); `None` for a GPU left as it is and
    /// for a MIG device.
    pub layout_converged: Option<bool>,
}

/// The free space of a filesystem holding one of the daemon's directories.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FilesystemMetrics {
    /// Which directory: the configuration key (`state_dir`, which holds the allocation journal,
    /// or `runtime_dir`).
    pub dir: String,
    pub path: String,
    /// Bytes an unprivileged writer may still use.
    pub avail_bytes: u64,
    /// Bytes in all.
    pub size_bytes: u64,
}

/// dcgm-exporter's pod attribution labels of a device held by one container.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodLabels {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

/// A GPU's sensors and error counters, each `None` where NVML does not tell it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuSensors {
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    /// Corrected (single-bit) ECC errors since the last reset.
    pub ecc_corrected_volatile: Option<u64>,
    /// Uncorrected (double-bit) ECC errors since the last reset.
    pub ecc_uncorrected_volatile: Option<u64>,
}

/// Everything one scrape shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeMetrics {
    pub hostname: String,
    pub gpus: Vec<GpuMetrics>,
    pub usage: UsageReport,
    /// Allocations held on the node.
    pub allocations: usize,
    /// Events published since the daemon started.
    pub events_total: u64,
    /// Fault events published since the daemon started.
    pub faults_total: u64,
    /// Enforcement's breaches and unattributed processes.
    pub enforcement: crate::enforcement::Metrics,
    /// Per resource the device plugin serves: its free devices told unhealthy to the kubelet for
    /// want of room beside the node API's allocations (empty while no device plugin runs).
    pub kubelet_withdrawn: std::collections::BTreeMap<String, u64>,
    /// The filesystems of the state and runtime directories (empty when not known).
    pub filesystems: Vec<FilesystemMetrics>,
}

#[derive(Clone, Copy)]
enum Kind {
    Gauge,
    Counter,
}

/// A sample's value: integers are written exactly.
#[derive(Clone, Copy)]
enum Value {
    U(u64),
    F(f64),
}

/// Writes one metric family: HELP and TYPE, then its samples.
struct Family<'a> {
    out: &'a mut String,
}

impl<'a> Family<'a> {
    fn new(out: &'a mut String, name: &str, kind: Kind, help: &str) -> Family<'a> {
        let kind = match kind {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        };
        let _ = writeln!(out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(out, "# TYPE {name} {kind}");
        Family { out }
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: Value) {
        self.sample_with(name, &label_set(labels), value);
    }

    /// A sample whose labels are already written out ([`label_set`]): series that appear in
    /// several families (a container's device in nine) have them written once per render.
    fn sample_with(&mut self, name: &str, label_set: &str, value: Value) {
        self.out.push_str(name);
        self.out.push_str(label_set);
        self.out.push(' ');
        match value {
            Value::U(n) => push_u64(self.out, n),
            Value::F(f) => write_float(self.out, f),
        }
        self.out.push('\n');
    }
}

/// `{k="v",...}` with the values escaped; empty for no labels.
fn label_set(labels: &[(&str, &str)]) -> String {
    let mut out = String::new();
    if !labels.is_empty() {
        out.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push_str("=\"");
            escape_label_into(&mut out, v);
            out.push('"');
        }
        out.push('}');
    }
    out
}

/// `n` in decimal, without the formatting machinery (thousands of samples per scrape).
fn push_u64(out: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // Only ASCII digits were written.
    out.push_str(std::str::from_utf8(&digits[i..]).unwrap_or_default());
}

fn write_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "+Inf" } else { "-Inf" });
    } else {
        let _ = write!(out, "{f}");
    }
}

/// Label values: backslash, double quote and line feed escaped.
fn escape_label_into(out: &mut String, v: &str) {
    if !v.bytes().any(|b| matches!(b, b'\\' | b'"' | b'\n')) {
        out.push_str(v);
        return;
    }
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// HELP text: backslash and line feed escaped.
fn escape_help(h: &str) -> String {
    h.replace('\\', "\\\\").replace('\n', "\\n")
}

/// The node's metrics in the Prometheus text format 0.0.4.
pub fn render(m: &NodeMetrics) -> String {
    let mut out = String::with_capacity(4096 + m.gpus.len() * 1024 + m.usage.containers.len() * 4096);

    // Per GPU, dcgm-exporter's names and labels, written out once for all the families.
    let gpu_labels: Vec<String> = m
        .gpus
        .iter()
        .map(|g| {
            let (index, device) = (g.index.to_string(), format!("nvidia{}", g.index));
            let mut l = vec![
                ("gpu", index.as_str()),
                ("UUID", g.uuid.as_str()),
                ("device", device.as_str()),
                ("modelName", g.model.as_str()),
                ("Hostname", m.hostname.as_str()),
                ("pci_bus_id", g.pci_bus_id.as_str()),
            ];
            if let Some(p) = &g.mig_profile {
                l.push(("GPU_I_PROFILE", p));
            }
            let gi_id = g.gpu_instance_id.map(|id| id.to_string());
            if let Some(id) = &gi_id {
                l.push(("GPU_I_ID", id));
            }
            if let Some(h) = &g.holder {
                l.push(("container", &h.container));
                l.push(("namespace", &h.namespace));
                l.push(("pod", &h.pod));
            }
            label_set(&l)
        })
        .collect();
    let per_gpu =
        |out: &mut String, name: &str, kind: Kind, help: &str, value: &dyn Fn(&GpuMetrics) -> Option<Value>| {
            let mut f = Family::new(out, name, kind, help);
            for (g, labels) in m.gpus.iter().zip(&gpu_labels) {
                if let Some(v) = value(g) {
                    f.sample_with(name, labels, v);
                }
            }
        };
    per_gpu(&mut out, "DCGM_FI_DEV_FB_USED", Kind::Gauge, "Framebuffer memory used (in MiB).", &|g| {
        Some(Value::U(g.memory_used / MIB))
    });
    per_gpu(&mut out, "DCGM_FI_DEV_FB_FREE", Kind::Gauge, "Framebuffer memory free (in MiB).", &|g| {
        Some(Value::U(g.memory_total.saturating_sub(g.memory_used) / MIB))
    });
    per_gpu(&mut out, "DCGM_FI_DEV_GPU_UTIL", Kind::Gauge, "GPU utilization (in %).", &|g| {
        g.utilization_percent.map(|u| Value::U(u64::from(u)))
    });
    per_gpu(&mut out, "DCGM_FI_DEV_GPU_TEMP", Kind::Gauge, "GPU temperature (in C).", &|g| {
        g.sensors.temperature_c.map(|t| Value::U(u64::from(t)))
    });
    per_gpu(&mut out, "DCGM_FI_DEV_POWER_USAGE", Kind::Gauge, "Power draw (in W).", &|g| {
        g.sensors.power_mw.map(|p| Value::F(f64::from(p) / 1000.0))
    });
    per_gpu(&mut out, "DCGM_FI_DEV_SM_CLOCK", Kind::Gauge, "SM clock frequency (in MHz).", &|g| {
        g.sensors.sm_clock_mhz.map(|c| Value::U(u64::from(c)))
    });
    per_gpu(&mut out, "DCGM_FI_DEV_MEM_CLOCK", Kind::Gauge, "Memory clock frequency (in MHz).", &|g| {
        g.sensors.mem_clock_mhz.map(|c| Value::U(u64::from(c)))
    });
    per_gpu(
        &mut out,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        Kind::Counter,
        "Total number of single-bit volatile ECC errors.",
        &|g| g.sensors.ecc_corrected_volatile.map(Value::U),
    );
    per_gpu(
        &mut out,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        Kind::Counter,
        "Total number of double-bit volatile ECC errors.",
        &|g| g.sensors.ecc_uncorrected_volatile.map(Value::U),
    );
    per_gpu(&mut out, "DCGM_FI_DEV_XID_ERRORS", Kind::Gauge, "Value of the last XID error encountered.", &|g| {
        g.last_xid.map(|x| Value::U(u64::from(x)))
    });
    per_gpu(&mut out, "tessera_gpu_healthy", Kind::Gauge, "Whether the device is healthy (1) or not (0).", &|g| {
        Some(Value::U(u64::from(g.healthy)))
    });
    per_gpu(
        &mut out,
        "tessera_gpu_layout_converged",
        Kind::Gauge,
        "Whether the GPU's configured layout (MIG devices, shares) is in place (1) or not: diverged, or waiting for a reset (0).",
        &|g| g.layout_converged.map(|c| Value::U(u64::from(c))),
    );

    // Per container and device.
    type Get = fn(&crate::usage::DeviceUsage) -> Option<Value>;
    let families: [(&str, Kind, &str, Get); 9] = [
        ("tessera_container_memory_used_bytes", Kind::Gauge, "Device memory the container holds.", |d| {
            Some(Value::U(d.memory_used))
        }),
        ("tessera_container_memory_peak_bytes", Kind::Gauge, "The most device memory the container has held.", |d| {
            Some(Value::U(d.memory_peak))
        }),
        (
            "tessera_container_memory_limit_bytes",
            Kind::Gauge,
            "The container's device memory limit (absent: no limit).",
            |d| d.memory_limit.map(Value::U),
        ),
        (
            "tessera_container_sm_achieved_percent",
            Kind::Gauge,
            "GPU time over wall time since the previous sample, percent.",
            |d| Some(Value::F(d.sm_achieved_percent)),
        ),
        (
            "tessera_container_sm_limit_percent",
            Kind::Gauge,
            "The container's share of the device's SM time, percent (absent: no limit).",
            |d| d.sm_limit_percent.map(|p| Value::U(u64::from(p))),
        ),
        ("tessera_container_launches_total", Kind::Counter, "Kernel launches.", |d| Some(Value::U(d.launches))),
        ("tessera_container_gpu_seconds_total", Kind::Counter, "GPU (kernel) time used, seconds.", |d| {
            Some(Value::F(d.gpu_time_ns as f64 / 1e9))
        }),
        (
            "tessera_container_throttled_seconds_total",
            Kind::Counter,
            "Time launches were held back by the SM limit, seconds.",
            |d| Some(Value::F(d.throttled_ns as f64 / 1e9)),
        ),
        (
            "tessera_container_oom_denials_total",
            Kind::Counter,
            "Allocations refused for passing the memory limit.",
            |d| Some(Value::U(d.oom_denials)),
        ),
    ];
    // Each container's labels and each of its devices', written out once for all the families.
    let ident = |c: &crate::usage::ContainerUsage| {
        let s = |o: &Option<String>| o.clone().unwrap_or_default();
        (s(&c.container.pod_namespace), s(&c.container.pod_name), s(&c.container.container_name))
    };
    let container_labels: Vec<(String, Vec<String>)> = m
        .usage
        .containers
        .iter()
        .map(|c| {
            let (ns, pod, container) = ident(c);
            let own = label_set(&[
                ("allocation", c.allocation_id.as_str()),
                ("resource", c.resource.as_str()),
                ("namespace", ns.as_str()),
                ("pod", pod.as_str()),
                ("container", container.as_str()),
            ]);
            let devices = c
                .devices
                .iter()
                .map(|d| {
                    label_set(&[
                        ("allocation", c.allocation_id.as_str()),
                        ("resource", c.resource.as_str()),
                        ("UUID", d.uuid.as_str()),
                        ("device_id", d.device_id.as_str()),
                        ("namespace", ns.as_str()),
                        ("pod", pod.as_str()),
                        ("container", container.as_str()),
                    ])
                })
                .collect();
            (own, devices)
        })
        .collect();
    for (name, kind, help, get) in families {
        let mut f = Family::new(&mut out, name, kind, help);
        for (c, (_, device_labels)) in m.usage.containers.iter().zip(&container_labels) {
            for (d, labels) in c.devices.iter().zip(device_labels) {
                if let Some(v) = get(d) {
                    f.sample_with(name, labels, v);
                }
            }
        }
    }
    {
        let name = "tessera_container_processes";
        let mut f = Family::new(&mut out, name, Kind::Gauge, "Live processes of the container using the GPU shim.");
        for (c, (labels, _)) in m.usage.containers.iter().zip(&container_labels) {
            f.sample_with(name, labels, Value::U(u64::from(c.processes)));
        }
    }

    // Per node.
    let node: [(&str, Kind, &str, u64); 3] = [
        ("tessera_allocations", Kind::Gauge, "Allocations held on the node.", m.allocations as u64),
        ("tessera_events_total", Kind::Counter, "Events published since the daemon started.", m.events_total),
        ("tessera_faults_total", Kind::Counter, "Fault events published since the daemon started.", m.faults_total),
    ];
    for (name, kind, help, v) in node {
        Family::new(&mut out, name, kind, help).sample(name, &[], Value::U(v));
    }
    if !m.kubelet_withdrawn.is_empty() {
        let name = "tessera_kubelet_devices_withdrawn";
        let help = "Free devices of the resource told unhealthy to the kubelet: the node API's allocations leave them no room.";
        let mut f = Family::new(&mut out, name, Kind::Gauge, help);
        for (resource, n) in &m.kubelet_withdrawn {
            f.sample(name, &[("resource", resource)], Value::U(*n));
        }
    }

    if !m.filesystems.is_empty() {
        let name = "tessera_state_filesystem_avail_bytes";
        let help = "Free bytes on the filesystem of the daemon's directory (state_dir: the allocation journal).";
        let mut f = Family::new(&mut out, name, Kind::Gauge, help);
        for fs in &m.filesystems {
            f.sample(name, &[("dir", &fs.dir), ("path", &fs.path)], Value::U(fs.avail_bytes));
        }
        let name = "tessera_state_filesystem_size_bytes";
        let mut f = Family::new(&mut out, name, Kind::Gauge, "Size of the filesystem of the daemon's directory.");
        for fs in &m.filesystems {
            f.sample(name, &[("dir", &fs.dir), ("path", &fs.path)], Value::U(fs.size_bytes));
        }
    }

    // Enforcement.
    {
        let name = "tessera_container_limit_breaches_total";
        let help = "Times the container's processes held more device memory than its limit, or took more SM time than its strict share, by NVML (kills, or reported breaches that started).";
        let mut f = Family::new(&mut out, name, Kind::Counter, help);
        for b in &m.enforcement.breaches {
            let [a, u, d, n, p, c] = on_device_labels(&b.on);
            f.sample(name, &[a, u, d, n, p, c, ("action", b.action), ("limit", b.limit)], Value::U(b.count));
        }
        let name = "tessera_container_sm_seconds_total";
        let help = "SM time the container's processes got on the GPU, by the driver's per-process utilization (NVML), not the container's own counters (whole GPUs and shares; not inside MIG instances).";
        let mut f = Family::new(&mut out, name, Kind::Counter, help);
        for t in &m.enforcement.sm_time {
            f.sample(name, &on_device_labels(&t.on), Value::F(t.ns as f64 / 1e9));
        }
        let name = "tessera_unattributed_gpu_processes";
        let help = "Processes holding GPU memory that belong to no allocation (at the last enforcement poll).";
        Family::new(&mut out, name, Kind::Gauge, help).sample(
            name,
            &[],
            Value::U(m.enforcement.unattributed_gpu_processes),
        );
    }
    out
}

#[cfg(test)]
pub(crate) mod check {
    //! A small checker of the text format, for tests: what Prometheus would refuse, it refuses.

    use std::collections::{BTreeMap, HashMap, HashSet};

    /// One sample: name, labels, value.
    pub type Sample = (String, BTreeMap<String, String>, f64);

    /// Parses `text`; panics naming the line that breaks the format: every sample line
    /// `name{labels} value` with valid names and escapes, a finite value, HELP and TYPE exactly once
    /// per name and before its samples, no series twice.
    pub fn parse(text: &str) -> Vec<Sample> {
        let mut help = HashSet::new();
        let mut types: HashMap<String, String> = HashMap::new();
        let mut series = HashSet::new();
        let mut samples = Vec::new();
        assert!(text.ends_with('\n'), "the text ends with a line feed");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, _) = rest.split_once(' ').unwrap_or((rest, ""));
                assert!(valid_name(name), "bad name in {line:?}");
                assert!(help.insert(name.to_string()), "HELP twice for {name}");
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("bad TYPE {line:?}"));
                assert!(["gauge", "counter"].contains(&kind), "bad type in {line:?}");
                assert!(types.insert(name.to_string(), kind.to_string()).is_none(), "TYPE twice for {name}");
                continue;
            }
            assert!(!line.starts_with('#') && !line.is_empty(), "unexpected line {line:?}");
            let (name, labels, rest) = match line.find('{') {
                Some(i) => {
                    let (labels, rest) = parse_labels(&line[i + 1..]).unwrap_or_else(|e| panic!("{e}: {line:?}"));
                    (&line[..i], labels, rest)
                }
                None => {
                    let (name, rest) = line.split_once(' ').unwrap_or_else(|| panic!("no value: {line:?}"));
                    (name, BTreeMap::new(), rest)
                }
            };
            assert!(valid_name(name), "bad name in {line:?}");
            assert!(help.contains(name) && types.contains_key(name), "sample before HELP/TYPE: {line:?}");
            if types[name] == "counter" {
                // dcgm-exporter's counters end in _TOTAL.
                assert!(name.to_ascii_lowercase().ends_with("_total"), "counter without _total: {name}");
            }
            let value: f64 = rest.trim_start_matches(' ').parse().unwrap_or_else(|_| panic!("bad value: {line:?}"));
            assert!(value.is_finite(), "value not finite: {line:?}");
            assert!(series.insert((name.to_string(), labels.clone())), "series twice: {line:?}");
            samples.push((name.to_string(), labels, value));
        }
        for name in &help {
            assert!(types.contains_key(name), "HELP without TYPE: {name}");
        }
        samples
    }

    fn valid_name(n: &str) -> bool {
        let mut chars = n.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    /// Parses `k="v",...}` and returns the labels and what follows the `}`.
    fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
        let mut labels = BTreeMap::new();
        let mut rest = s;
        loop {
            if let Some(r) = rest.strip_prefix('}') {
                return Ok((labels, r));
            }
            let eq = rest.find('=').ok_or("label without =")?;
            let key = &rest[..eq];
            if !valid_name(key) || key.contains(':') {
                return Err(format!("bad label name {key:?}"));
            }
            let mut chars = rest[eq + 1..].strip_prefix('"').ok_or("label value not quoted")?.char_indices();
            let mut value = String::new();
            let end = loop {
                match chars.next().ok_or("unterminated label value")? {
                    (_, '\\') => match chars.next().ok_or("dangling escape")?.1 {
                        '\\' => value.push('\\'),
                        '"' => value.push('"'),
                        'n' => value.push('\n'),
                        c => return Err(format!("bad escape \\{c}")),
                    },
                    (_, '\n') => return Err("raw line feed in label value".into()),
                    (i, '"') => break i,
                    (_, c) => value.push(c),
                }
            };
            if labels.insert(key.to_string(), value).is_some() {
                return Err(format!("label {key} twice"));
            }
            rest = &rest[eq + 1 + 1 + end + 1..];
            rest = rest.strip_prefix(',').unwrap_or(rest);
        }
    }
}

/// An allocation on a device, as enforcement's series label it.
fn on_device_labels(o: &crate::enforcement::OnDevice) -> [(&'static str, &str); 6] {
    [
        ("allocation", o.allocation.as_str()),
        ("UUID", o.uuid.as_str()),
        ("device_id", o.device_id.as_str()),
        ("namespace", o.namespace.as_str()),
        ("pod", o.pod.as_str()),
        ("container", o.container.as_str()),
    ]
}

#[cfg(test)]
mod tests {
    use super::check::{Sample, parse};
    use super::*;
    use crate::state::ContainerIdentity;
    use crate::usage::{ContainerUsage, DeviceUsage};

    fn find<'a>(samples: &'a [Sample], name: &str, label: (&str, &str)) -> Vec<&'a Sample> {
        samples.iter().filter(|(n, l, _)| n == name && l.get(label.0).map(String::as_str) == Some(label.1)).collect()
    }

    fn device(uuid: &str, id: &str) -> DeviceUsage {
        DeviceUsage {
            device_id: id.to_string(),
            uuid: uuid.to_string(),
            memory_used: 3 << 30,
            memory_peak: 4 << 30,
            memory_limit: Some(8 << 30),
            sm_limit_percent: Some(25),
            sm_achieved_percent: 12.5,
            launches_per_second: 3.0,
            launches: 12345,
            gpu_time_ns: 1_500_000_000,
            throttled_ns: 250_000_000,
            oom_denials: 2,
            window_ns: 1_000_000_000,
        }
    }

    fn metrics() -> NodeMetrics {
        let mut unlimited = device("MIG-1", "MIG-1");
        unlimited.memory_limit = None;
        unlimited.sm_limit_percent = None;
        let on = crate::enforcement::OnDevice {
            allocation: "a1".into(),
            namespace: "team-a".into(),
            pod: "train-0".into(),
            container: "main".into(),
            uuid: "GPU-0".into(),
            device_id: "GPU-0::0,GPU-0::1".into(),
        };
        NodeMetrics {
            hostname: "node-1".into(),
            gpus: vec![
                GpuMetrics {
                    index: 0,
                    uuid: "GPU-0".into(),
                    model: "NVIDIA H100 80GB HBM3".into(),
                    pci_bus_id: "00000000:17:00.0".into(),
                    memory_used: 1536 * MIB + 5,
                    memory_total: 81559 * MIB,
                    utilization_percent: Some(37),
                    healthy: true,
                    mig_profile: None,
                    parent_uuid: None,
                    gpu_instance_id: None,
                    last_xid: Some(0),
                    holder: None,
                    layout_converged: Some(false),
                    sensors: GpuSensors {
                        temperature_c: Some(41),
                        power_mw: Some(123_456),
                        sm_clock_mhz: Some(1980),
                        mem_clock_mhz: Some(2619),
                        ecc_corrected_volatile: Some(3),
                        ecc_uncorrected_volatile: Some(0),
                    },
                },
                GpuMetrics {
                    index: 1,
                    uuid: "MIG-1".into(),
                    model: "NVIDIA A100 \"SXM\"\nrev\\2".into(),
                    pci_bus_id: "00000000:18:00.0".into(),
                    memory_used: 0,
                    memory_total: 10 * 1024 * MIB,
                    utilization_percent: None,
                    healthy: false,
                    mig_profile: Some("1g.10gb".into()),
                    parent_uuid: Some("GPU-1".into()),
                    gpu_instance_id: Some(13),
                    last_xid: None,
                    holder: None,
                    layout_converged: None,
                    sensors: GpuSensors::default(),
                },
            ],
            usage: UsageReport {
                time_unix_ns: 1,
                containers: vec![
                    ContainerUsage {
                        allocation_id: "a1".into(),
                        resource: "tessera.io/share".into(),
                        container: ContainerIdentity {
                            pod_namespace: Some("team-a".into()),
                            pod_name: Some("train-0".into()),
                            container_name: Some("main".into()),
                            ..Default::default()
                        },
                        processes: 3,
                        devices: vec![device("GPU-0", "GPU-0::0,GPU-0::1"), unlimited],
                    },
                    ContainerUsage {
                        allocation_id: "a2".into(),
                        resource: "tessera.io/gpu".into(),
                        container: ContainerIdentity::default(),
                        processes: 0,
                        devices: vec![device("GPU-0", "GPU-0")],
                    },
                ],
            },
            allocations: 2,
            events_total: 17,
            faults_total: 1,
            enforcement: crate::enforcement::Metrics {
                breaches: vec![crate::enforcement::BreachCount {
                    on: on.clone(),
                    action: "kill",
                    limit: "sm",
                    count: 4,
                }],
                sm_time: vec![crate::enforcement::SmTime { on: on.clone(), ns: 2_500_000_000, as_of_ns: 1 }],
                unattributed_gpu_processes: 2,
            },
            kubelet_withdrawn: [("tessera.io/gpu".into(), 0), ("tessera.io/gpu-share".into(), 3)].into(),
            filesystems: vec![
                FilesystemMetrics {
                    dir: "state_dir".into(),
                    path: "/var/lib/tessera".into(),
                    avail_bytes: 123 << 20,
                    size_bytes: 10 << 30,
                },
                FilesystemMetrics {
                    dir: "runtime_dir".into(),
                    path: "/run/tessera".into(),
                    avail_bytes: 1 << 30,
                    size_bytes: 2 << 30,
                },
            ],
        }
    }

    #[test]
    fn renders_valid_text_with_exact_values() {
        let text = render(&metrics());
        let samples = parse(&text);

        let fb = find(&samples, "DCGM_FI_DEV_FB_USED", ("UUID", "GPU-0"));
        assert_eq!(fb.len(), 1);
        assert_eq!(fb[0].2, 1536.0, "MiB, rounded down");
        let l = &fb[0].1;
        assert_eq!(l["gpu"], "0");
        assert_eq!(l["device"], "nvidia0");
        assert_eq!(l["modelName"], "NVIDIA H100 80GB HBM3");
        assert_eq!(l["Hostname"], "node-1");
        assert_eq!(l["pci_bus_id"], "00000000:17:00.0");
        assert!(!l.contains_key("GPU_I_PROFILE"));
        assert_eq!(find(&samples, "DCGM_FI_DEV_FB_FREE", ("UUID", "GPU-0"))[0].2, (81559 - 1536 - 1) as f64);
        assert_eq!(find(&samples, "DCGM_FI_DEV_GPU_UTIL", ("UUID", "GPU-0"))[0].2, 37.0);
        assert!(find(&samples, "DCGM_FI_DEV_GPU_UTIL", ("UUID", "MIG-1")).is_empty(), "unknown: left out");
        for (name, want) in [
            ("DCGM_FI_DEV_GPU_TEMP", 41.0),
            ("DCGM_FI_DEV_POWER_USAGE", 123.456),
            ("DCGM_FI_DEV_SM_CLOCK", 1980.0),
            ("DCGM_FI_DEV_MEM_CLOCK", 2619.0),
            ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 3.0),
            ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0.0),
        ] {
            assert_eq!(find(&samples, name, ("UUID", "GPU-0"))[0].2, want, "{name}");
            assert!(find(&samples, name, ("UUID", "MIG-1")).is_empty(), "{name}: not known for the MIG device");
        }
        assert!(text.contains("# TYPE DCGM_FI_DEV_ECC_SBE_VOL_TOTAL counter\n"));
        let mig = find(&samples, "DCGM_FI_DEV_FB_FREE", ("UUID", "MIG-1"));
        assert_eq!(mig[0].2, 10240.0);
        assert_eq!(mig[0].1["GPU_I_PROFILE"], "1g.10gb");
        assert_eq!(mig[0].1["modelName"], "NVIDIA A100 \"SXM\"\nrev\\2", "escaped and parsed back");
        assert_eq!(find(&samples, "tessera_gpu_healthy", ("UUID", "GPU-0"))[0].2, 1.0);
        assert_eq!(find(&samples, "tessera_gpu_healthy", ("UUID", "MIG-1"))[0].2, 0.0);

        let a1 = |name: &str| {
            let s = find(&samples, name, ("allocation", "a1"));
            s.into_iter().find(|s| s.1["UUID"] == "GPU-0").map(|s| s.2)
        };
        assert_eq!(a1("tessera_container_memory_used_bytes"), Some((3u64 << 30) as f64));
        assert_eq!(a1("tessera_container_memory_peak_bytes"), Some((4u64 << 30) as f64));
        assert_eq!(a1("tessera_container_memory_limit_bytes"), Some((8u64 << 30) as f64));
        assert_eq!(a1("tessera_container_sm_achieved_percent"), Some(12.5));
        assert_eq!(a1("tessera_container_sm_limit_percent"), Some(25.0));
        assert_eq!(a1("tessera_container_launches_total"), Some(12345.0));
        assert_eq!(a1("tessera_container_gpu_seconds_total"), Some(1.5));
        assert_eq!(a1("tessera_container_throttled_seconds_total"), Some(0.25));
        assert_eq!(a1("tessera_container_oom_denials_total"), Some(2.0));
        let used = find(&samples, "tessera_container_memory_used_bytes", ("allocation", "a1"));
        assert_eq!(used.len(), 2);
        let l = &used[0].1;
        assert_eq!(
            (l["namespace"].as_str(), l["pod"].as_str(), l["container"].as_str()),
            ("team-a", "train-0", "main")
        );
        assert_eq!((l["resource"].as_str(), l["device_id"].as_str()), ("tessera.io/share", "GPU-0::0,GPU-0::1"));
        // No limit: no sample.
        assert_eq!(find(&samples, "tessera_container_memory_limit_bytes", ("UUID", "MIG-1")).len(), 0);
        assert_eq!(find(&samples, "tessera_container_sm_limit_percent", ("UUID", "MIG-1")).len(), 0);
        // Unknown pod: empty labels (Prometheus drops them).
        let a2 = find(&samples, "tessera_container_memory_used_bytes", ("allocation", "a2"));
        assert_eq!(a2[0].1["pod"], "");
        assert_eq!(find(&samples, "tessera_container_processes", ("allocation", "a1"))[0].2, 3.0);

        let node = |name: &str| samples.iter().find(|s| s.0 == name && s.1.is_empty()).map(|s| s.2);
        assert_eq!(node("tessera_allocations"), Some(2.0));
        assert_eq!(node("tessera_events_total"), Some(17.0));
        assert_eq!(node("tessera_faults_total"), Some(1.0));
        assert_eq!(node("tessera_unattributed_gpu_processes"), Some(2.0));
        // Every served resource, 0 included.
        let withdrawn = |r: &str| find(&samples, "tessera_kubelet_devices_withdrawn", ("resource", r))[0].2;
        assert_eq!((withdrawn("tessera.io/gpu"), withdrawn("tessera.io/gpu-share")), (0.0, 3.0));
        assert!(text.contains("# TYPE tessera_kubelet_devices_withdrawn gauge\n"));
        let breach = find(&samples, "tessera_container_limit_breaches_total", ("allocation", "a1"));
        assert_eq!(breach.len(), 1);
        assert_eq!(
            (breach[0].1["action"].as_str(), breach[0].1["limit"].as_str(), breach[0].1["pod"].as_str(), breach[0].2),
            ("kill", "sm", "train-0", 4.0)
        );
        assert!(text.contains("# TYPE tessera_container_limit_breaches_total counter\n"));
        let sm = find(&samples, "tessera_container_sm_seconds_total", ("allocation", "a1"));
        assert_eq!((sm.len(), sm[0].1["pod"].as_str(), sm[0].2), (1, "train-0", 2.5));
        assert!(text.contains("# TYPE tessera_container_sm_seconds_total counter\n"));
        assert!(text.contains("# TYPE tessera_container_launches_total counter\n"));
        assert!(text.contains("# TYPE DCGM_FI_DEV_FB_USED gauge\n"));
    }

    /// The bytes themselves, as scrapers read them: label order, escapes, number formats.
    #[test]
    fn exact_lines() {
        let text = render(&metrics());
        let gpu0 = r#"{gpu="0",UUID="GPU-0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",pci_bus_id="00000000:17:00.0"}"#;
        let a1 = r#"{allocation="a1",resource="tessera.io/share",UUID="GPU-0",device_id="GPU-0::0,GPU-0::1",namespace="team-a",pod="train-0",container="main"}"#;
        for line in [
            format!("DCGM_FI_DEV_FB_USED{gpu0} 1536\n"),
            format!("DCGM_FI_DEV_POWER_USAGE{gpu0} 123.456\n"),
            r#"tessera_gpu_healthy{gpu="1",UUID="MIG-1",device="nvidia1",modelName="NVIDIA A100 \"SXM\"\nrev\\2",Hostname="node-1",pci_bus_id="00000000:18:00.0",GPU_I_PROFILE="1g.10gb",GPU_I_ID="13"} 0"#.to_string() + "\n",
            format!("tessera_container_launches_total{a1} 12345\n"),
            format!("tessera_container_gpu_seconds_total{a1} 1.5\n"),
            format!("tessera_container_sm_achieved_percent{a1} 12.5\n"),
            r#"tessera_container_processes{allocation="a2",resource="tessera.io/gpu",namespace="",pod="",container=""} 0"#.to_string() + "\n",
            "# HELP tessera_allocations Allocations held on the node.\n# TYPE tessera_allocations gauge\ntessera_allocations 2\n".to_string(),
        ] {
            assert!(text.contains(&line), "missing {line:?} in:\n{text}");
        }
    }

    #[test]
    fn last_xid_is_a_gauge_on_whole_gpus_only() {
        let mut m = metrics();
        let text = render(&m);
        assert!(text.contains("# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"));
        assert!(text.contains("# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.\n"));
        let samples = parse(&text);
        assert_eq!(find(&samples, "DCGM_FI_DEV_XID_ERRORS", ("UUID", "GPU-0"))[0].2, 0.0, "none seen: 0");
        assert!(find(&samples, "DCGM_FI_DEV_XID_ERRORS", ("UUID", "MIG-1")).is_empty(), "per GPU, not per MIG");
        m.gpus[0].last_xid = Some(79);
        let samples = parse(&render(&m));
        let x = find(&samples, "DCGM_FI_DEV_XID_ERRORS", ("UUID", "GPU-0"));
        assert_eq!((x.len(), x[0].2), (1, 79.0));
        assert_eq!((x[0].1["gpu"].as_str(), x[0].1["Hostname"].as_str()), ("0", "node-1"));
    }

    /// What the alert rules (deploy/monitoring) need beyond usage: a managed GPU's layout, and
    /// the free space where the journal and the allocation directories live.
    #[test]
    fn layout_and_state_filesystem_series() {
        let mut m = metrics();
        let text = render(&m);
        assert!(text.contains("# TYPE tessera_gpu_layout_converged gauge\n"));
        assert!(text.contains("# TYPE tessera_state_filesystem_avail_bytes gauge\n"));
        let samples = parse(&text);
        let conv = find(&samples, "tessera_gpu_layout_converged", ("UUID", "GPU-0"));
        assert_eq!((conv.len(), conv[0].2, conv[0].1["gpu"].as_str()), (1, 0.0, "0"), "diverged: 0");
        assert!(find(&samples, "tessera_gpu_layout_converged", ("UUID", "MIG-1")).is_empty(), "not managed: none");
        let fs = |name: &str, dir: &str| find(&samples, name, ("dir", dir)).iter().map(|s| s.2).collect::<Vec<_>>();
        assert_eq!(fs("tessera_state_filesystem_avail_bytes", "state_dir"), [(123u64 << 20) as f64]);
        assert_eq!(fs("tessera_state_filesystem_size_bytes", "state_dir"), [(10u64 << 30) as f64]);
        assert_eq!(fs("tessera_state_filesystem_avail_bytes", "runtime_dir"), [(1u64 << 30) as f64]);
        let l = &find(&samples, "tessera_state_filesystem_avail_bytes", ("dir", "state_dir"))[0].1;
        assert_eq!(l["path"], "/var/lib/tessera");
        assert_eq!(l.len(), 2, "dir and path only: {l:?}");

        m.gpus[0].layout_converged = Some(true);
        m.filesystems.clear();
        let text = render(&m);
        let samples = parse(&text);
        assert_eq!(find(&samples, "tessera_gpu_layout_converged", ("UUID", "GPU-0"))[0].2, 1.0);
        assert!(!text.contains("tessera_state_filesystem"), "not known: no family");
    }

    #[test]
    fn mig_series_carry_the_gpu_instance_id() {
        let samples = parse(&render(&metrics()));
        for name in ["DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "tessera_gpu_healthy"] {
            let mig = find(&samples, name, ("UUID", "MIG-1"));
            assert_eq!((mig[0].1["GPU_I_ID"].as_str(), mig[0].1["GPU_I_PROFILE"].as_str()), ("13", "1g.10gb"));
            let whole = find(&samples, name, ("UUID", "GPU-0"));
            assert!(!whole[0].1.contains_key("GPU_I_ID"), "{name}: a whole GPU has no instance id");
        }
    }

    #[test]
    fn a_device_one_container_holds_carries_its_pod() {
        let mut m = metrics();
        m.gpus[1].holder =
            Some(PodLabels { namespace: "team-b".into(), pod: "infer-\"0\"".into(), container: "server".into() });
        let samples = parse(&render(&m));
        for name in ["DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "tessera_gpu_healthy"] {
            let l = &find(&samples, name, ("UUID", "MIG-1"))[0].1;
            assert_eq!(
                (l["namespace"].as_str(), l["pod"].as_str(), l["container"].as_str()),
                ("team-b", "infer-\"0\"", "server"),
                "{name}"
            );
            let whole = &find(&samples, name, ("UUID", "GPU-0"))[0].1;
            assert!(!whole.contains_key("pod") && !whole.contains_key("namespace"), "{name}: no holder, no labels");
        }
    }

    #[test]
    fn empty_node_is_valid() {
        let m = NodeMetrics { hostname: "h".into(), ..Default::default() };
        let samples = parse(&render(&m));
        assert_eq!(samples.len(), 4, "only the node's own: {samples:?}");
    }

    #[test]
    fn odd_values_stay_parseable() {
        let mut m = metrics();
        m.hostname = "we\\ird\"host\nname".into();
        m.usage.containers[0].devices[0].sm_achieved_percent = 1e-9;
        m.usage.containers[0].devices[0].launches = u64::MAX;
        let samples = parse(&render(&m));
        let h = find(&samples, "tessera_gpu_healthy", ("UUID", "GPU-0"));
        assert_eq!(h[0].1["Hostname"], "we\\ird\"host\nname");
        let sm = find(&samples, "tessera_container_sm_achieved_percent", ("allocation", "a1"));
        assert_eq!(sm.iter().find(|s| s.1["UUID"] == "GPU-0").unwrap().2, 1e-9);
    }

    #[test]
    fn checker_refuses_broken_text() {
        for bad in [
            "x 1\n",                                    // no HELP/TYPE
            "# HELP x h\n# TYPE x gauge\nx NaN\n",      // not finite
            "# HELP x h\n# TYPE x gauge\nx{a=\"1} 1\n", // unterminated
            "# HELP x h\n# TYPE x gauge\n# HELP x h\nx 1\n",
            "# HELP x h\n# TYPE x gauge\nx{a=\"\\q\"} 1\n",
            "# HELP x h\n# TYPE x gauge\nx 1\nx 2\n",
        ] {
            assert!(std::panic::catch_unwind(|| parse(bad)).is_err(), "accepted {bad:?}");
        }
    }
}
