//! The daemon's [`MetricsSource`]: GPUs from the controller's inventory with live memory and
//! utilization from NVML, health from the controller, per-container usage sampled from the
//! accounting regions (a sampler of its own, so rates cover the time between scrapes).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::struct_wrappers::device::MemoryInfo;

use super::prometheus::{FilesystemMetrics, PodLabels};
use super::{GpuMetrics, GpuSensors, MetricsSource, NodeMetrics};
use crate::node::NodeController;
use crate::state::Allocation;
use crate::usage::UsageSampler;

/// Metrics of the node the controller runs.
#[derive(Debug)]
pub struct NodeSource {
    controller: Arc<NodeController>,
    sampler: Mutex<UsageSampler>,
    hostname: String,
    enforcement: Option<Arc<crate::enforcement::Stats>>,
}

impl NodeSource {
    pub fn new(controller: Arc<NodeController>) -> NodeSource {
        let hostname =
            std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
        NodeSource { controller, sampler: Mutex::new(UsageSampler::new()), hostname, enforcement: None }
    }

    /// Shows enforcement's counters too.
    pub fn with_enforcement(mut self, stats: Arc<crate::enforcement::Stats>) -> NodeSource {
        self.enforcement = Some(stats);
        self
    }
}

impl MetricsSource for NodeSource {
    fn metrics(&self) -> NodeMetrics {
        let view = self.controller.view();
        let nvml = self.controller.session().nvml();
        let allocations = self.controller.allocations();
        let holders = sole_holders(&allocations);
        let last_xids = self.controller.events().last_xids();
        let mut gpus = Vec::new();
        for g in &view.inventory.gpus {
            // What the GPU and each of its MIG devices show alike: the GPU, the device's memory
            // (live; a device NVML cannot read, lost, keeps its total and shows 0 used), its
            // health and its holder.
            let metrics_of = |uuid: &str, memory: Option<MemoryInfo>, total: u64, healthy: bool| GpuMetrics {
                index: g.index,
                uuid: uuid.to_string(),
                model: g.name.clone(),
                pci_bus_id: g.pci_bus_id.clone(),
                memory_used: memory.as_ref().map_or(0, |m| m.used),
                memory_total: memory.as_ref().map_or(total, |m| m.total),
                healthy,
                holder: holders.get(&uuid.to_ascii_lowercase()).cloned(),
                ..Default::default()
            };
            let device = nvml.device_by_index(g.index).ok();
            let memory = device.as_ref().and_then(|d| d.memory_info().ok());
            let gpu_healthy = view.health.gpu(g.index).is_none();
            gpus.push(GpuMetrics {
                utilization_percent: device.as_ref().and_then(|d| d.utilization_rates().ok()).map(|u| u.gpu),
                sensors: device.as_ref().map(sensors).unwrap_or_default(),
                last_xid: Some(last_xids.get(&g.uuid).copied().unwrap_or(0)),
                layout_converged: view
                    .status
                    .get(&g.index)
                    .map(|s| s.state == tessera_proto::tessera::v1::PartitionState::Converged),
                ..metrics_of(&g.uuid, memory, g.memory_total, gpu_healthy)
            });
            // Each MIG device, as dcgm-exporter shows a GPU instance.
            let instances = g.mig.as_ref().filter(|m| m.current).map_or(&[][..], |m| &m.instances[..]);
            for gi in instances {
                for d in &gi.devices {
                    let memory = nvml.device_by_uuid(d.uuid.as_str()).ok().and_then(|h| h.memory_info().ok());
                    let healthy = view.health.of(g.index, &d.uuid).is_healthy();
                    gpus.push(GpuMetrics {
                        mig_profile: Some(gi.profile.clone()),
                        parent_uuid: Some(g.uuid.clone()),
                        gpu_instance_id: Some(d.gi_id),
                        ..metrics_of(&d.uuid, memory, d.memory_total, healthy)
                    });
                }
            }
        }
        let usage = self.sampler.lock().unwrap_or_else(std::sync::PoisonError::into_inner).sample(
            &allocations,
            self.controller.allocator().dirs(),
            tessera_region::monotonic_ns(),
        );
        let (events_total, faults_total) = self.controller.events().since_start();
        NodeMetrics {
            hostname: self.hostname.clone(),
            gpus,
            usage,
            allocations: allocations.len(),
            events_total,
            faults_total,
            enforcement: self.enforcement.as_ref().map(|s| s.metrics()).unwrap_or_default(),
            kubelet_withdrawn: self.controller.kubelet_offer().map(|o| withdrawn_counts(&o)).unwrap_or_default(),
            filesystems: [("state_dir", &view.config.state_dir), ("runtime_dir", &view.config.runtime_dir)]
                .into_iter()
                .filter_map(|(dir, path)| filesystem(dir, path))
                .collect(),
            park: self.controller.allocator().park_metrics(),
        }
    }
}

/// The free space of the filesystem holding `path`; `None` (left out) when it cannot be read.
// The block counts are 32-bit on some targets.
#[allow(clippy::useless_conversion)]
fn filesystem(dir: &str, path: &std::path::Path) -> Option<FilesystemMetrics> {
    let s = nix::sys::statvfs::statvfs(path).ok()?;
    let frag = u64::from(s.fragment_size());
    Some(FilesystemMetrics {
        dir: dir.to_string(),
        path: path.display().to_string(),
        avail_bytes: u64::from(s.blocks_available()).saturating_mul(frag),
        size_bytes: u64::from(s.blocks()).saturating_mul(frag),
    })
}

/// Each served resource's count of withdrawn devices, 0 included.
fn withdrawn_counts(offer: &crate::node::KubeletOffer) -> std::collections::BTreeMap<String, u64> {
    let mut out: std::collections::BTreeMap<String, u64> = offer.resources.iter().map(|r| (r.clone(), 0)).collect();
    for (resource, _) in &offer.withdrawn {
        *out.entry(resource.clone()).or_default() += 1;
    }
    out
}

/// What the GPU's sensors and counters say; a reading NVML refuses (not supported, or the GPU
/// lost) is left out rather than shown as 0.
fn sensors(d: &Device<'_>) -> GpuSensors {
    GpuSensors {
        temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
        power_mw: d.power_usage().ok(),
        sm_clock_mhz: d.clock_info(Clock::SM).ok(),
        mem_clock_mhz: d.clock_info(Clock::Memory).ok(),
        ecc_corrected_volatile: d.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile).ok(),
        ecc_uncorrected_volatile: d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).ok(),
    }
}

/// The pod labels of each device (by lowercase UUID) exactly one allocation holds, when its pod
/// is known: dcgm-exporter's kubelet mapping. A device shared by two containers gets none.
fn sole_holders(allocations: &[Allocation]) -> HashMap<String, PodLabels> {
    let mut by_device: HashMap<String, Option<&Allocation>> = HashMap::new();
    for a in allocations {
        for d in &a.devices {
            by_device
                .entry(d.physical_uuid.to_ascii_lowercase())
                .and_modify(|held| {
                    if held.is_some_and(|h| h.id != a.id) {
                        *held = None;
                    }
                })
                .or_insert(Some(a));
        }
    }
    by_device
        .into_iter()
        .filter_map(|(uuid, a)| {
            let id = &a?.container;
            let known = |s: &Option<String>| s.as_deref().map(str::trim).filter(|s| !s.is_empty()).map(str::to_string);
            let pod = known(&id.pod_name)?;
            let labels = PodLabels {
                namespace: known(&id.pod_namespace).unwrap_or_default(),
                pod,
                container: known(&id.container_name).unwrap_or_default(),
            };
            Some((uuid, labels))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::tests::dev;
    use crate::state::{ContainerIdentity, Source};

    fn alloc(id: &str, pod: Option<&str>, uuids: &[&str]) -> Allocation {
        Allocation {
            id: id.into(),
            resource: "tessera.io/share".into(),
            container: ContainerIdentity {
                pod_namespace: pod.map(|_| "team-a".into()),
                pod_name: pod.map(Into::into),
                container_name: pod.map(|_| "main".into()),
                ..Default::default()
            },
            source: Source::Kubelet,
            created_unix_ns: 1,
            devices: uuids.iter().enumerate().map(|(i, u)| dev(&format!("{u}::{i}"), u, None, None)).collect(),
            claim: None,
        }
    }

    #[test]
    fn a_filesystem_is_measured_and_a_missing_one_left_out() {
        let tmp = tempfile::tempdir().unwrap();
        let fs = filesystem("state_dir", tmp.path()).unwrap();
        assert_eq!((fs.dir.as_str(), fs.path.as_str()), ("state_dir", tmp.path().to_str().unwrap()));
        assert!(fs.size_bytes > 0 && fs.avail_bytes <= fs.size_bytes, "{fs:?}");
        assert!(filesystem("state_dir", &tmp.path().join("absent")).is_none());
    }

    #[test]
    fn only_a_device_one_known_container_holds_gets_pod_labels() {
        let h = sole_holders(&[
            // Two shares of GPU-A: still one container.
            alloc("a1", Some("train-0"), &["GPU-A", "GPU-A", "MIG-X"]),
            // GPU-B shared by two containers: no one's labels.
            alloc("a2", Some("infer-0"), &["GPU-B"]),
            alloc("a3", Some("infer-1"), &["GPU-B"]),
            // Held by a container whose pod is not known.
            alloc("a4", None, &["GPU-C"]),
        ]);
        let want = PodLabels { namespace: "team-a".into(), pod: "train-0".into(), container: "main".into() };
        assert_eq!(h.get("gpu-a"), Some(&want));
        assert_eq!(h.get("mig-x"), Some(&want));
        assert_eq!(h.get("gpu-b"), None);
        assert_eq!(h.get("gpu-c"), None);
        assert_eq!(h.len(), 2);
    }
}
