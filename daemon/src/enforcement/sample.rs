//! The driver's own numbers: every process NVML lists on each GPU (the compute and the graphics
//! lists), with the memory it holds and the device (GPU or MIG device UUID) it holds it on; and,
//! for SM time, each process's utilization of a GPU since a moment.

use std::collections::HashMap;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;

use crate::discovery::Inventory;

/// One process's memory on one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    /// Host pid (NVML reports the host's pids whatever namespace the process runs in).
    pub pid: u32,
    /// Bytes it holds on the device (0 where NVML cannot tell).
    pub used: u64,
    /// The device: the GPU's UUID, or the MIG device's on a GPU in MIG mode.
    pub device_uuid: String,
    /// The GPU's NVML index.
    pub gpu_index: u32,
}

/// One poll of every GPU.
#[derive(Debug, Default)]
pub struct Sample {
    pub processes: Vec<GpuProcess>,
    /// GPUs NVML would not list (lost ones among them), with why.
    pub failed: Vec<(u32, String)>,
}

/// Lists the processes on every GPU of `inventory`. A GPU in MIG mode is asked once, through its
/// parent handle (the list then carries each process's GPU and compute instance), and each entry
/// is placed on its MIG device by those ids; an entry whose instance the inventory does not know
/// (a layout changing under the poll) is left out of this poll.
pub fn sample(nvml: &Nvml, inventory: &Inventory) -> Sample {
    let mut out = Sample::default();
    for gpu in &inventory.gpus {
        let listed = nvml.device_by_index(gpu.index).and_then(|d| {
            let mut all = d.running_compute_processes()?;
            match d.running_graphics_processes() {
                Ok(g) => all.extend(g),
                // Compute-only boards and drivers without the graphics list.
                Err(NvmlError::NotSupported | NvmlError::FunctionNotFound) => {}
                Err(e) => return Err(e),
            }
            Ok(all)
        });
        let listed = match listed {
            Ok(l) => l,
            Err(e) => {
                out.failed.push((gpu.index, e.to_string()));
                continue;
            }
        };
        let mig_on = gpu.mig.as_ref().is_some_and(|m| m.current);
        for p in listed {
            let device_uuid = if mig_on {
                let Some(uuid) = mig_uuid(gpu, &p) else { continue };
                uuid
            } else {
                gpu.uuid.clone()
            };
            let used = match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => b,
                UsedGpuMemory::Unavailable => 0,
            };
            merge(&mut out.processes, GpuProcess { pid: p.pid, used, device_uuid, gpu_index: gpu.index });
        }
    }
    out
}

/// Each process's SM utilization (percent) on GPU `index` since `since_us` (µs since the epoch,
/// NVML's clock), its samples averaged. Nothing ran since: empty.
pub fn utilization(nvml: &Nvml, index: u32, since_us: u64) -> Result<HashMap<u32, u32>, NvmlError> {
    let samples = match nvml.device_by_index(index)?.process_utilization_stats(since_us) {
        Ok(s) => s,
        Err(NvmlError::NotFound) => return Ok(HashMap::new()),
        Err(e) => return Err(e),
    };
    Ok(average(samples.iter().map(|s| (s.pid, s.sm_util))))
}

/// (pid, percent) samples to one average per pid. A real driver gives one sample per sampling
/// period in which the process ran, so a process idle for part of the time reads at its busy
/// rate: that errs against a bursty process that bypasses the shim, never for it. A process under
/// the limiter reads its share in every period it ran (its burst is 20 ms of wall time's tokens).
fn average(samples: impl Iterator<Item = (u32, u32)>) -> HashMap<u32, u32> {
    let mut sums: HashMap<u32, (u64, u64)> = HashMap::new();
    for (pid, pct) in samples {
        let e = sums.entry(pid).or_default();
        *e = (e.0 + u64::from(pct.min(100)), e.1 + 1);
    }
    sums.into_iter().map(|(pid, (sum, n))| (pid, (sum / n) as u32)).collect()
}

/// The MIG device a process entry of GPU `gpu` is on.
fn mig_uuid(gpu: &crate::discovery::Gpu, p: &ProcessInfo) -> Option<String> {
    gpu.mig_device(p.gpu_instance_id?, p.compute_instance_id?).map(|d| d.uuid.clone())
}

/// Adds `p`, keeping one entry per (pid, device): a process in both the compute and the
/// graphics list holds its memory once (the larger figure is kept).
fn merge(list: &mut Vec<GpuProcess>, p: GpuProcess) {
    match list.iter_mut().find(|o| o.pid == p.pid && o.device_uuid == p.device_uuid) {
        Some(o) => o.used = o.used.max(p.used),
        None => list.push(p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_per_process_and_device() {
        let p = |pid, used, dev: &str| GpuProcess { pid, used, device_uuid: dev.into(), gpu_index: 0 };
        let mut list = Vec::new();
        merge(&mut list, p(1, 100, "GPU-a"));
        merge(&mut list, p(1, 300, "GPU-a"));
        merge(&mut list, p(1, 50, "MIG-b"));
        merge(&mut list, p(2, 10, "GPU-a"));
        assert_eq!(list, [p(1, 300, "GPU-a"), p(1, 50, "MIG-b"), p(2, 10, "GPU-a")]);
    }

    #[test]
    fn a_processs_samples_are_averaged_and_capped_at_100() {
        let got = average([(1, 20), (2, 100), (1, 40), (2, 250)].into_iter());
        assert_eq!(got, HashMap::from([(1, 30), (2, 100)]));
    }
}
