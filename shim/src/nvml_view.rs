//! NVML inside the container shows the container's GPU: memory info (v1 and v2) reports the
//! limit as the total and the container's usage as used, and the running-process lists show
//! only the container's processes, so `nvidia-smi` and NVML clients agree with the limit.
//!
//! Without any configured limits (standalone, nothing set) NVML passes through untouched; with a
//! bad config, these queries answer `NVML_ERROR_NO_PERMISSION` (they would show the whole GPU).

use std::ffi::{CStr, c_char, c_uint};

use tessera_abi::nvml::{nvmlMemory_t, nvmlMemory_v2_t};
use tessera_abi::nvml_exports;

use crate::ffi::*;
use crate::real::{self, RealNvml};
use crate::state::{self, ShimState};

/// Runs an NVML hook's body with the state and the real NVML.
fn nvml_hook(body: impl FnOnce(&'static ShimState, &'static RealNvml) -> NvmlReturn) -> NvmlReturn {
    guard(NVML_ERROR_UNKNOWN, || {
        let Some(n) = real::nvml() else { return NVML_ERROR_LIBRARY_NOT_FOUND };
        match state::ensure() {
            Ok(s) => {
                s.refresh();
                body(s, n)
            }
            Err(_) => NVML_ERROR_NO_PERMISSION,
        }
    })
}

/// The region device index and memory limit of an NVML device, when it has a limit.
fn limited(s: &ShimState, n: &RealNvml, device: NvmlDevice) -> Option<(usize, u64)> {
    if !s.configured {
        return None;
    }
    let mut buf = [0 as c_char; 96];
    // SAFETY: buf holds 96 bytes (NVML_DEVICE_UUID_V2_BUFFER_SIZE).
    if unsafe { (n.nvmlDeviceGetUUID)(device, buf.as_mut_ptr(), buf.len() as c_uint) } != NVML_SUCCESS {
        return None;
    }
    // SAFETY: NVML wrote a NUL-terminated string into buf.
    let uuid = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().ok()?;
    let mut index: c_uint = 0;
    // SAFETY: a valid out-pointer; failure leaves 0.
    unsafe { (n.nvmlDeviceGetIndex)(device, &mut index) };
    let dev = s.device_of_uuid(uuid, index)?;
    Some((dev, s.memory_limit(dev)?))
}

/// (total, used, free) of the container's view.
fn view(s: &ShimState, dev: usize, limit: u64, real_total: u64, real_free: u64) -> (u64, u64, u64) {
    s.reap_for_query();
    let total = limit.min(real_total);
    // The region's total, never below what this process itself holds (the region is writable);
    // none while tesserad has the container's memory parked in host memory, as the driver shows.
    let parked = s.region.park_state() == tessera_region::region::ParkState::Parked;
    let used = if parked { 0 } else { s.region.used(dev).max(s.held(dev)) };
    let free = total.saturating_sub(used).min(real_free);
    (total, used, free)
}

nvml_exports! {
    /// # Safety
    /// As nvml.h's `nvmlDeviceGetMemoryInfo`.
    fn nvmlDeviceGetMemoryInfo(device, memory_out) {
        nvml_hook(|s, n| {
            // SAFETY: the caller's arguments, passed on unchanged.
            let rc = unsafe { (n.nvmlDeviceGetMemoryInfo)(device, memory_out) };
            if rc != NVML_SUCCESS {
                return rc;
            }
            // SAFETY: NVML filled the caller's struct (it succeeded).
            let Some(m) = (unsafe { get(memory_out) }) else { return rc };
            if let Some((dev, limit)) = limited(s, n, device) {
                let (total, used, free) = view(s, dev, limit, m.total, m.free);
                // SAFETY: the caller's struct, just written by NVML.
                unsafe { put(memory_out, nvmlMemory_t { total, free, used }) };
            }
            rc
        })
    }

    /// # Safety
    /// As nvml.h's `nvmlDeviceGetMemoryInfo_v2`.
    fn nvmlDeviceGetMemoryInfo_v2(device, memory_out) {
        nvml_hook(|s, n| {
            let Some(f) = n.nvmlDeviceGetMemoryInfo_v2 else { return 13 }; // FUNCTION_NOT_FOUND
            // SAFETY: the caller's arguments, passed on unchanged.
            let rc = unsafe { f(device, memory_out) };
            if rc != NVML_SUCCESS {
                return rc;
            }
            // SAFETY: NVML filled the caller's struct (it succeeded).
            let Some(m) = (unsafe { get(memory_out) }) else { return rc };
            if let Some((dev, limit)) = limited(s, n, device) {
                let (total, used, free) = view(s, dev, limit, m.total, m.free);
                let v = nvmlMemory_v2_t { version: m.version, total, reserved: 0, free, used };
                // SAFETY: the caller's struct, just written by NVML.
                unsafe { put(memory_out, v) };
            }
            rc
        })
    }
}

/// The running-process list, filtered to the container's processes, with NVML's protocol: on
/// entry `*count` is the room in `infos`; on exit the number of entries; more than the room is
/// `NVML_ERROR_INSUFFICIENT_SIZE` (with `*count` set to what is needed).
///
/// # Safety
/// `count` null or valid for reads and writes; `infos` null or valid for `*count` entries.
unsafe fn filtered<T: Copy + Default>(
    s: &ShimState,
    count: *mut c_uint,
    infos: *mut T,
    pid: fn(&T) -> c_uint,
    real: impl Fn(*mut c_uint, *mut T) -> NvmlReturn,
) -> NvmlReturn {
    if !s.configured {
        return real(count, infos);
    }
    // SAFETY: as this function's contract.
    let Some(room) = (unsafe { get(count) }) else { return NVML_ERROR_INVALID_ARGUMENT };
    let mut cap: c_uint = 64;
    let mut all = Vec::new();
    for _ in 0..8 {
        all = vec![T::default(); cap as usize];
        let mut n = cap;
        match real(&mut n, all.as_mut_ptr()) {
            NVML_SUCCESS => {
                all.truncate(n as usize);
                break;
            }
            NVML_ERROR_INSUFFICIENT_SIZE => cap = n.max(cap.saturating_mul(2)).saturating_add(8),
            rc => return rc,
        }
    }
    s.reap_for_query();
    let ours = s.region.pids();
    let mine = |p: c_uint| ours.iter().any(|&(pid, host)| if host != 0 { host == p } else { pid == p });
    let list: Vec<T> = all.into_iter().filter(|e| mine(pid(e))).collect();
    let n = list.len() as c_uint;
    // SAFETY: count is valid (read above).
    unsafe { put(count, n) };
    if n > room || (n > 0 && infos.is_null()) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if n > 0 {
        // SAFETY: infos has room for `room` >= n entries (the caller's contract); the list is ours.
        unsafe { std::ptr::copy_nonoverlapping(list.as_ptr(), infos, list.len()) };
    }
    NVML_SUCCESS
}

nvml_exports! {
    /// # Safety
    /// As nvml.h's `nvmlDeviceGetComputeRunningProcesses` (v1 entries).
    fn nvmlDeviceGetComputeRunningProcesses(device, info_count, infos) {
        nvml_hook(|s, n| {
            let real = n.nvmlDeviceGetComputeRunningProcesses;
            // SAFETY: the caller's pointers (nvml.h's contract); the real call fills our buffer
            // (our mirror of the header's entry, the same layout).
            unsafe { filtered(s, info_count, infos.cast::<NvmlProcessInfoV1>(), |p| p.pid, |c, i| real(device, c, i.cast())) }
        })
    }

    /// # Safety
    /// As nvml.h's `nvmlDeviceGetComputeRunningProcesses_v2`.
    fn nvmlDeviceGetComputeRunningProcesses_v2(device, info_count, infos) {
        nvml_hook(|s, n| {
            let Some(f) = n.nvmlDeviceGetComputeRunningProcesses_v2 else { return 13 };
            // SAFETY: as in the v1 function.
            unsafe { filtered(s, info_count, infos.cast::<NvmlProcessInfoV2>(), |p| p.pid, |c, i| f(device, c, i.cast())) }
        })
    }

    /// # Safety
    /// As nvml.h's `nvmlDeviceGetComputeRunningProcesses_v3`.
    fn nvmlDeviceGetComputeRunningProcesses_v3(device, info_count, infos) {
        nvml_hook(|s, n| {
            let Some(f) = n.nvmlDeviceGetComputeRunningProcesses_v3 else { return 13 };
            // SAFETY: as in the v1 function.
            unsafe { filtered(s, info_count, infos.cast::<NvmlProcessInfoV2>(), |p| p.pid, |c, i| f(device, c, i.cast())) }
        })
    }
}
