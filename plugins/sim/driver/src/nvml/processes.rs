//! Processes and utilization: running compute processes (v1/v2/v3; graphics and MPS lists are
//! empty on a compute-only node), GPU utilization rates and per-process utilization samples.

use std::ffi::c_uint;
use std::time::Duration;

use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::{Node, monotonic_ns, realtime_us_from_monotonic};

use super::handles::{self, Dev};
use super::*;
use crate::ffi::guard;
use crate::latency;

/// `gpuInstanceId` / `computeInstanceId` of a process not on a MIG device.
const NO_INSTANCE: u32 = 0xFFFF_FFFF;

/// One entry of the running-process lists.
struct Proc {
    pid: u32,
    used: u64,
    gi: u32,
    ci: u32,
}

/// Processes on a GPU (all of them, MIG instances included) or on one MIG device, one entry per
/// process and instance.
fn compute_processes(node: &Node, device: nvmlDevice_t) -> R<Vec<Proc>> {
    let list = match handles::device(node, device)? {
        Dev::Gpu(g) => node.processes(g, None).nv()?,
        Dev::Mig(m) => node.processes(m.gpu, Some(m.ci.unit())).nv()?,
    };
    let mut out: Vec<Proc> = Vec::new();
    for p in list {
        let (gi, ci) = (p.gi_id.unwrap_or(NO_INSTANCE), p.ci_id.unwrap_or(NO_INSTANCE));
        match out.iter_mut().find(|o| o.pid == p.pid && o.gi == gi && o.ci == ci) {
            Some(o) => o.used += p.used_bytes,
            None => out.push(Proc { pid: p.pid, used: p.used_bytes, gi, ci }),
        }
    }
    Ok(out)
}

fn v2(p: &Proc) -> nvmlProcessInfo_v2_t {
    nvmlProcessInfo_v2_t { pid: p.pid, usedGpuMemory: p.used, gpuInstanceId: p.gi, computeInstanceId: p.ci }
}

fn v1(p: &Proc) -> nvmlProcessInfo_v1_t {
    nvmlProcessInfo_v1_t { pid: p.pid, usedGpuMemory: p.used }
}

/// The list protocol for one of the process queries.
///
/// # Safety
/// `count` null or valid for reads and writes; `infos` null or valid for `*count` writes.
unsafe fn list<T>(device: nvmlDevice_t, count: *mut c_uint, infos: *mut T, compute: bool, conv: fn(&Proc) -> T) -> R {
    let node = node()?;
    handles::decode_device(node, device)?;
    need(count)?;
    let procs =
        if compute { compute_processes(node, device)? } else { handles::device(node, device).map(|_| Vec::new())? };
    // SAFETY: as this function's contract.
    unsafe { fill_list(count, infos, procs.iter().map(conv).collect()) }
}

nvml_exports! {
    /// `nvmlDeviceGetComputeRunningProcesses_v3`: processes with a context or memory on the device.
    ///
    /// `nvmlDeviceGetComputeRunningProcesses_v2`: the same layout as v3.
    fn nvmlDeviceGetComputeRunningProcesses_v3(device, info_count, infos) also nvmlDeviceGetComputeRunningProcesses_v2 {
        guard(NVML_ERROR_UNKNOWN, || {
            let _card = latency::floor("nvmlDeviceGetComputeRunningProcesses_v3");
            status(|| {
                // SAFETY: the pointers follow the caller's contract for this function.
                unsafe { list(device, info_count, infos, true, v2) }
            })
        })
    }

    /// `nvmlDeviceGetComputeRunningProcesses` (v1): pid and memory only.
    fn nvmlDeviceGetComputeRunningProcesses(device, info_count, infos) {
        guard(NVML_ERROR_UNKNOWN, || {
            let _card = latency::floor("nvmlDeviceGetComputeRunningProcesses_v3");
            status(|| {
                // SAFETY: the pointers follow the caller's contract for this function.
                unsafe { list(device, info_count, infos, true, v1) }
            })
        })
    }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetGraphicsRunningProcesses_v3`: none (no graphics contexts on a compute node).
    ///
    /// `nvmlDeviceGetGraphicsRunningProcesses_v2`.
    /// `nvmlDeviceGetMPSComputeRunningProcesses_v3`: none (no MPS server on the simulated node).
    /// `nvmlDeviceGetMPSComputeRunningProcesses_v2`.
    fn nvmlDeviceGetGraphicsRunningProcesses_v3(device, info_count, infos) also nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlDeviceGetMPSComputeRunningProcesses_v2 {
        // SAFETY: the pointers follow the caller's contract for this function.
        unsafe { list(device, info_count, infos, false, v2) }
    }

    /// `nvmlDeviceGetGraphicsRunningProcesses` (v1).
    ///
    /// `nvmlDeviceGetMPSComputeRunningProcesses` (v1).
    fn nvmlDeviceGetGraphicsRunningProcesses(device, info_count, infos) also nvmlDeviceGetMPSComputeRunningProcesses {
        // SAFETY: the pointers follow the caller's contract for this function.
        unsafe { list(device, info_count, infos, false, v1) }
    }
}

/// Memory-controller utilization, derived: half the SM busy time (the model has no bandwidth).
pub(crate) fn memory_util(gpu_percent: u32) -> u32 {
    gpu_percent / 2
}

/// Percent of about the last second the GPU was executing kernels. A GPU in MIG mode has no
/// whole-GPU figure (NVML answers `NOT_SUPPORTED` there too).
pub(crate) fn gpu_utilization(node: &Node, gpu: u32) -> R<u32> {
    if node.mig_mode(gpu).is_ok_and(|(current, _)| current) {
        return Err(NOT_SUPPORTED);
    }
    Ok(node.utilization(gpu, 0).nv()?.gpu_percent)
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetUtilizationRates`: GPU busy percent over about the last second.
    fn nvmlDeviceGetUtilizationRates(device, utilization) {
        let node = node()?;
        let gpu = handles::whole_gpu(node, device)?;
        need(utilization)?;
        let busy = gpu_utilization(node, gpu)?;
        let u = nvmlUtilization_t { gpu: busy, memory: memory_util(busy) };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(utilization, u) }
    }
}

nvml_exports! {
    /// `nvmlDeviceGetProcessUtilization`: one sample per process whose kernels ran since
    /// `lastSeenTimeStamp` (µs since the epoch; 0: the driver's whole history, about a second).
    /// `NOT_FOUND` when there is none; a null or short buffer gets `INSUFFICIENT_SIZE` and the count.
    fn nvmlDeviceGetProcessUtilization(device, utilization, process_samples_count, last_seen_time_stamp) {
        guard(NVML_ERROR_UNKNOWN, || {
            let _card = latency::floor("nvmlDeviceGetProcessUtilization");
            status(|| {
                let node = node()?;
                let gpu = handles::whole_gpu(node, device)?;
                need(process_samples_count)?;
                if node.mig_mode(gpu).is_ok_and(|(current, _)| current) {
                    return Err(NOT_SUPPORTED);
                }
                let now_mono = monotonic_ns();
                let now_us = realtime_us_from_monotonic(now_mono);
                if last_seen_time_stamp >= now_us {
                    return Err(NOT_FOUND);
                }
                let since = if last_seen_time_stamp == 0 {
                    0
                } else {
                    let ago = Duration::from_micros(now_us - last_seen_time_stamp).as_nanos() as u64;
                    now_mono.saturating_sub(ago).max(1)
                };
                let window = node.utilization(gpu, since).nv()?;
                let ts = realtime_us_from_monotonic(window.to_ns);
                let samples: Vec<nvmlProcessUtilizationSample_t> = window
                    .processes
                    .iter()
                    .filter(|(_, pct)| *pct > 0)
                    .map(|&(pid, pct)| nvmlProcessUtilizationSample_t {
                        pid,
                        timeStamp: ts,
                        smUtil: pct,
                        memUtil: memory_util(pct),
                        encUtil: 0,
                        decUtil: 0,
                    })
                    .collect();
                if samples.is_empty() {
                    return Err(NOT_FOUND);
                }
                // SAFETY: count is checked; utilization is null or holds `*count` samples (caller's contract).
                unsafe { fill_list(process_samples_count, utilization, samples) }
            })
        })
    }
}
