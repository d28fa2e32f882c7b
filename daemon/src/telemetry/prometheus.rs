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
//!   `tessera_allocations_parked` and, per `op` (`park`, `resume`), `tessera_park_operations_total`,
//!   `tessera_park_seconds_total`, `tessera_park_bytes_total`; `tessera_preemptions_total`;
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
    /// Allocations parked now, and the parks and resumes done (issue 33).
    pub park: crate::allocator::park::ParkMetrics,
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
    {
        let p = &m.park;
        let name = "tessera_allocations_parked";
        let help = "Allocations parked now: their processes' device memory in host memory.";
        Family::new(&mut out, name, Kind::Gauge, help).sample(name, &[], Value::U(p.parked));
        let counters: [(&str, &str, Value, Value); 3] = [
            (
                "tessera_park_operations_total",
                "Parks and resumes done since the daemon started.",
                Value::U(p.parks),
                Value::U(p.resumes),
            ),
            (
                "tessera_park_seconds_total",
                "Time parks and resumes took since the daemon started.",
                Value::F(p.park_seconds),
                Value::F(p.resume_seconds),
            ),
            (
                "tessera_park_bytes_total",
                "Device memory parks and resumes moved since the daemon started.",
                Value::U(p.park_bytes),
                Value::U(p.resume_bytes),
            ),
        ];
        for (name, help, park, resume) in counters {
            let mut f = Family::new(&mut out, name, Kind::Counter, help);
            f.sample(name, &[("op", "park")], park);
            f.sample(name, &[("op", "resume")], resume);
        }
        let name = "tessera_preemptions_total";
        let help = "Allocations parked by preemption (for an allocation of higher priority) since the daemon started.";
        Family::new(&mut out, name, Kind::Counter, help).sample(name, &[], Value::U(p.preemptions));
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
#[path = "prometheus_check.rs"]
pub(crate) mod check;

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
#[path = "prometheus_tests.rs"]
mod tests;
