//! The daemon's [`MetricsSource`]: GPUs from the controller's inventory with live memory and
//! utilization from NVML, health from the controller, per-container usage sampled from the
//! accounting regions (a sampler of its own, so rates cover the time between scrapes).

use std::sync::{Arc, Mutex};

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};

use super::{GpuMetrics, GpuSensors, MetricsSource, NodeMetrics};
use crate::node::NodeController;
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
        let gpus = view
            .inventory
            .gpus
            .iter()
            .map(|g| {
                // Live figures; a GPU NVML cannot read (lost) keeps its totals and shows 0 used.
                let device = nvml.device_by_index(g.index).ok();
                let memory = device.as_ref().and_then(|d| d.memory_info().ok());
                let utilization = device.as_ref().and_then(|d| d.utilization_rates().ok()).map(|u| u.gpu);
                GpuMetrics {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    model: g.name.clone(),
                    pci_bus_id: g.pci_bus_id.clone(),
                    memory_used: memory.as_ref().map_or(0, |m| m.used),
                    memory_total: memory.as_ref().map_or(g.memory_total, |m| m.total),
                    utilization_percent: utilization,
                    healthy: !view.unhealthy_gpus.contains_key(&g.index),
                    mig_profile: None,
                    parent_uuid: None,
                    sensors: device.as_ref().map(sensors).unwrap_or_default(),
                }
            })
            .collect();
        let allocations = self.controller.allocations();
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
        }
    }
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
