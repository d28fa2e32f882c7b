//! Board sensors and health: temperature, power, clocks, fans, performance state, ECC counters,
//! retired pages and remapped rows.
//!
//! Temperature, power and clocks follow the load (the GPU's utilization over about the last
//! second): an idle board sits at its idle draw and idle clocks, a busy one near its limit at
//! its maximum clocks. ECC and row-remapping counters are the model's health counters, which
//! fault injection (`tessera-sim`) moves.

use std::ffi::{c_int, c_uint};

use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::{GpuModel, Node};

use super::handles;
use super::*;
use crate::ffi::guard;

/// Clocks of a board with nothing running, MHz (the catalog's, which nvidia-smi shows too).
struct IdleClocks {
    sm_mhz: u32,
    video_mhz: u32,
}

fn idle_clocks(m: &GpuModel) -> IdleClocks {
    let (sm_mhz, video_mhz) = m.idle_clocks_mhz();
    IdleClocks { sm_mhz, video_mhz }
}

/// Load of a GPU, 0..=100 (whole-GPU kernel time over about the last second).
fn load(node: &Node, gpu: u32) -> R<u32> {
    Ok(node.utilization(gpu, 0).nv()?.gpu_percent.min(100))
}

/// Die temperature: the board's idle temperature, rising linearly to 20 C under the max
/// operating point (the catalog's model, which nvidia-smi shows too).
pub(crate) fn temperature_c(m: &GpuModel, load: u32) -> u32 {
    m.temperature_c(load)
}

/// Power draw: idle draw, rising linearly to 90% of the limit at full load.
pub(crate) fn power_mw(m: &GpuModel, load: u32) -> u32 {
    m.power_draw_mw(load)
}

/// A value of a whole GPU written to `out` (MIG devices: `NOT_SUPPORTED`).
///
/// # Safety
/// `out` must be null or valid for a write of `T`.
unsafe fn gpu_value<T>(device: nvmlDevice_t, out: *mut T, f: impl FnOnce(&Node, u32, &'static GpuModel) -> R<T>) -> R {
    let node = node()?;
    let gpu = handles::whole_gpu(node, device)?;
    need(out)?;
    let v = f(node, gpu, node.gpu(gpu).nv()?.model)?;
    // SAFETY: out is checked non-null and aligned; valid for a write by this function's contract.
    unsafe { put(out, v) }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetTemperature` (deprecated in the header, still exported): the GPU die sensor.
    fn nvmlDeviceGetTemperature(device, sensor_type, temp) {
        node()?;
        if sensor_type != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: temp is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, temp, |n, g, m| Ok(temperature_c(m, load(n, g)?))) }
    }

    /// `nvmlDeviceGetTemperatureV` (`nvmlTemperature_v1_t`, versioned).
    fn nvmlDeviceGetTemperatureV(device, temperature) {
        node()?;
        // SAFETY: temperature is null or valid for reads of the struct by the caller's contract.
        let t = unsafe { get(temperature.cast_const()) }?;
        if t.version != struct_version::<nvmlTemperature_v1_t>(1) {
            return Err(VERSION_MISMATCH);
        }
        if t.sensorType != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return Err(INVALID_ARGUMENT);
        }
        let f = |n: &Node, g: u32, m: &'static GpuModel| {
            Ok(nvmlTemperature_v1_t { temperature: temperature_c(m, load(n, g)?) as c_int, ..t })
        };
        // SAFETY: temperature is valid for a write by the caller's contract (checked above).
        unsafe { gpu_value(device, temperature, f) }
    }

    /// `nvmlDeviceGetTemperatureThreshold`: the board's shutdown, slowdown and max operating points.
    fn nvmlDeviceGetTemperatureThreshold(device, threshold_type, temp) {
        node()?;
        if threshold_type >= nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_COUNT {
            return Err(INVALID_ARGUMENT);
        }
        let f = |_: &Node, _: u32, m: &'static GpuModel| match threshold_type {
            nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_SHUTDOWN => Ok(m.shutdown_temp_c),
            nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_SLOWDOWN => Ok(m.slowdown_temp_c),
            nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_MEM_MAX => Ok(m.mem_max_operating_temp_c),
            nvmlTemperatureThresholds_enum_NVML_TEMPERATURE_THRESHOLD_GPU_MAX => Ok(m.max_operating_temp_c),
            // Acoustic and GPS thresholds are for boards with fans.
            _ => Err(NOT_SUPPORTED),
        };
        // SAFETY: temp is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, temp, f) }
    }

    /// `nvmlDeviceGetPowerUsage`, milliwatts.
    fn nvmlDeviceGetPowerUsage(device, power) {
        // SAFETY: power is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, power, |n, g, m| Ok(power_mw(m, load(n, g)?))) }
    }

    /// `nvmlDeviceGetPowerManagementLimit`, milliwatts (the default limit: nothing changes it here).
    ///
    /// `nvmlDeviceGetEnforcedPowerLimit`, milliwatts.
    fn nvmlDeviceGetPowerManagementLimit(device, limit) also nvmlDeviceGetEnforcedPowerLimit {
        // SAFETY: limit is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, limit, |_, _, m| Ok(m.power_limit_mw)) }
    }

    /// `nvmlDeviceGetPowerManagementDefaultLimit`, milliwatts.
    fn nvmlDeviceGetPowerManagementDefaultLimit(device, default_limit) {
        // SAFETY: default_limit is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, default_limit, |_, _, m| Ok(m.power_limit_mw)) }
    }

    /// `nvmlDeviceGetPowerManagementLimitConstraints`: the range `nvidia-smi -pl` accepts, milliwatts.
    fn nvmlDeviceGetPowerManagementLimitConstraints(device, min_limit, max_limit) {
        need(min_limit)?;
        // SAFETY: both pointers are null or valid for writes by the caller's contract.
        unsafe {
            gpu_value(device, max_limit, |_, _, m| Ok(m.power_limit_mw))?;
            gpu_value(device, min_limit, |_, _, m| Ok(m.min_power_limit_mw))
        }
    }

    /// `nvmlDeviceGetPowerManagementMode` (deprecated, exported): power management is always on.
    fn nvmlDeviceGetPowerManagementMode(device, mode) {
        // SAFETY: mode is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, mode, |_, _, _| Ok(nvmlEnableState_enum_NVML_FEATURE_ENABLED)) }
    }
}

/// Current clock of a domain: maximum while kernels run, the idle clock otherwise.
fn current_clock(m: &GpuModel, clock: nvmlClockType_t, busy: bool) -> R<u32> {
    let idle = idle_clocks(m);
    Ok(match clock {
        nvmlClockType_enum_NVML_CLOCK_GRAPHICS | nvmlClockType_enum_NVML_CLOCK_SM => {
            if busy {
                m.max_sm_clock_mhz
            } else {
                idle.sm_mhz
            }
        }
        nvmlClockType_enum_NVML_CLOCK_MEM => m.max_mem_clock_mhz,
        nvmlClockType_enum_NVML_CLOCK_VIDEO => {
            if busy {
                m.max_video_clock_mhz
            } else {
                idle.video_mhz
            }
        }
        _ => return Err(INVALID_ARGUMENT),
    })
}

fn max_clock(m: &GpuModel, clock: nvmlClockType_t) -> R<u32> {
    Ok(match clock {
        nvmlClockType_enum_NVML_CLOCK_GRAPHICS | nvmlClockType_enum_NVML_CLOCK_SM => m.max_sm_clock_mhz,
        nvmlClockType_enum_NVML_CLOCK_MEM => m.max_mem_clock_mhz,
        nvmlClockType_enum_NVML_CLOCK_VIDEO => m.max_video_clock_mhz,
        _ => return Err(INVALID_ARGUMENT),
    })
}

fn app_clock(m: &GpuModel, clock: nvmlClockType_t) -> R<u32> {
    Ok(match clock {
        nvmlClockType_enum_NVML_CLOCK_GRAPHICS | nvmlClockType_enum_NVML_CLOCK_SM => m.default_app_sm_clock_mhz,
        other => max_clock(m, other)?,
    })
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetClockInfo`: current clock, MHz.
    fn nvmlDeviceGetClockInfo(device, clock_type, clock) {
        // SAFETY: clock is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, clock, |n, g, m| current_clock(m, clock_type, load(n, g)? > 0)) }
    }

    /// `nvmlDeviceGetMaxClockInfo`, MHz.
    fn nvmlDeviceGetMaxClockInfo(device, clock_type, clock) {
        // SAFETY: clock is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, clock, |_, _, m| max_clock(m, clock_type)) }
    }

    /// `nvmlDeviceGetMaxCustomerBoostClock`, MHz.
    fn nvmlDeviceGetMaxCustomerBoostClock(device, clock_type, clock_mhz) {
        // SAFETY: clock_mhz is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, clock_mhz, |_, _, m| max_clock(m, clock_type)) }
    }

    /// `nvmlDeviceGetApplicationsClock` (deprecated, exported), MHz.
    ///
    /// `nvmlDeviceGetDefaultApplicationsClock` (deprecated, exported), MHz.
    fn nvmlDeviceGetApplicationsClock(device, clock_type, clock_mhz) also nvmlDeviceGetDefaultApplicationsClock {
        // SAFETY: clock_mhz is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, clock_mhz, |_, _, m| app_clock(m, clock_type)) }
    }
}

nvml_exports! {
    /// `nvmlDeviceGetClock`: a clock domain by id (current, application target/default, boost max).
    fn nvmlDeviceGetClock(device, clock_type, clock_id, clock_mhz) {
        let f = |n: &Node, g: u32, m: &'static GpuModel| match clock_id {
            nvmlClockId_enum_NVML_CLOCK_ID_CURRENT => current_clock(m, clock_type, load(n, g)? > 0),
            nvmlClockId_enum_NVML_CLOCK_ID_APP_CLOCK_TARGET | nvmlClockId_enum_NVML_CLOCK_ID_APP_CLOCK_DEFAULT => {
                app_clock(m, clock_type)
            }
            nvmlClockId_enum_NVML_CLOCK_ID_CUSTOMER_BOOST_MAX => max_clock(m, clock_type),
            _ => Err(INVALID_ARGUMENT),
        };
        guard(NVML_ERROR_UNKNOWN, || {
            status(|| {
                // SAFETY: clock_mhz is null or valid for a write by the caller's contract.
                unsafe { gpu_value(device, clock_mhz, f) }
            })
        })
    }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetFanSpeed`: the simulated boards are passively cooled (SXM): `NOT_SUPPORTED`.
    fn nvmlDeviceGetFanSpeed(device, speed) {
        // SAFETY: speed is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, speed, |_, _, _| Err(NOT_SUPPORTED)) }
    }

    /// `nvmlDeviceGetFanSpeed_v2`: no fans (`NOT_SUPPORTED`).
    fn nvmlDeviceGetFanSpeed_v2(device, _fan, speed) {
        // SAFETY: speed is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, speed, |_, _, _| Err(NOT_SUPPORTED)) }
    }

    /// `nvmlDeviceGetNumFans`: 0.
    fn nvmlDeviceGetNumFans(device, num_fans) {
        // SAFETY: num_fans is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, num_fans, |_, _, _| Ok(0)) }
    }

    /// `nvmlDeviceGetPerformanceState`: P0 (data-center boards stay in P0 with persistence mode on).
    ///
    /// `nvmlDeviceGetPowerState` (deprecated alias of the performance state, exported).
    fn nvmlDeviceGetPerformanceState(device, p_state) also nvmlDeviceGetPowerState {
        // SAFETY: p_state is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, p_state, |_, _, _| Ok(nvmlPStates_enum_NVML_PSTATE_0)) }
    }

    /// `nvmlDeviceGetEccMode`: enabled, and enabled after the next reboot.
    fn nvmlDeviceGetEccMode(device, current, pending) {
        need(pending)?;
        // SAFETY: both pointers are null or valid for writes by the caller's contract.
        unsafe {
            gpu_value(device, current, |_, _, _| Ok(nvmlEnableState_enum_NVML_FEATURE_ENABLED))?;
            put(pending, nvmlEnableState_enum_NVML_FEATURE_ENABLED)
        }
    }

    /// `nvmlDeviceGetDefaultEccMode`: enabled.
    fn nvmlDeviceGetDefaultEccMode(device, default_mode) {
        // SAFETY: default_mode is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, default_mode, |_, _, _| Ok(nvmlEnableState_enum_NVML_FEATURE_ENABLED)) }
    }
}

/// The model's ECC counter for an error type and counter type.
fn ecc_count(node: &Node, gpu: u32, error_type: nvmlMemoryErrorType_t, counter_type: nvmlEccCounterType_t) -> R<u64> {
    let h = node.health(gpu).nv()?;
    Ok(match (error_type, counter_type) {
        (nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED, nvmlEccCounterType_enum_NVML_VOLATILE_ECC) => {
            h.ecc_corrected_volatile
        }
        (nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED, nvmlEccCounterType_enum_NVML_AGGREGATE_ECC) => {
            h.ecc_corrected_aggregate
        }
        (nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvmlEccCounterType_enum_NVML_VOLATILE_ECC) => {
            h.ecc_uncorrected_volatile
        }
        (nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvmlEccCounterType_enum_NVML_AGGREGATE_ECC) => {
            h.ecc_uncorrected_aggregate
        }
        _ => return Err(INVALID_ARGUMENT),
    })
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetTotalEccErrors`: device-memory ECC errors (the only ones the model counts).
    fn nvmlDeviceGetTotalEccErrors(device, error_type, counter_type, ecc_counts) {
        // SAFETY: ecc_counts is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, ecc_counts, |n, g, _| ecc_count(n, g, error_type, counter_type)) }
    }
}

nvml_exports! {
    /// `nvmlDeviceGetMemoryErrorCounter`: DRAM carries the model's counts, SRAM none; Ampere and
    /// later report no L1/L2/register-file/texture locations of their own (`NOT_SUPPORTED`).
    fn nvmlDeviceGetMemoryErrorCounter(device, error_type, counter_type, location_type, count) {
        let f = |n: &Node, g: u32, _: &'static GpuModel| {
            let total = ecc_count(n, g, error_type, counter_type)?;
            match location_type {
                nvmlMemoryLocation_enum_NVML_MEMORY_LOCATION_DRAM => Ok(total),
                nvmlMemoryLocation_enum_NVML_MEMORY_LOCATION_SRAM => Ok(0),
                l if l < nvmlMemoryLocation_enum_NVML_MEMORY_LOCATION_COUNT => Err(NOT_SUPPORTED),
                _ => Err(INVALID_ARGUMENT),
            }
        };
        guard(NVML_ERROR_UNKNOWN, || {
            status(|| {
                // SAFETY: count is null or valid for a write by the caller's contract.
                unsafe { gpu_value(device, count, f) }
            })
        })
    }
}

/// Ampere and later boards remap rows instead of retiring pages.
fn retires_pages(m: &GpuModel) -> bool {
    m.architecture < NVML_DEVICE_ARCH_AMPERE
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetRetiredPages`: `NOT_SUPPORTED` on Ampere and later (row remapping instead).
    fn nvmlDeviceGetRetiredPages(device, cause, page_count, addresses) {
        // SAFETY: the pointers follow the caller's contract.
        unsafe { retired_pages(device, cause, page_count, addresses) }
    }

    /// `nvmlDeviceGetRetiredPages_v2`: as v1, with timestamps.
    fn nvmlDeviceGetRetiredPages_v2(device, cause, page_count, addresses, _timestamps) {
        // SAFETY: the pointers follow the caller's contract; no page is ever retired, so no timestamp is written.
        unsafe { retired_pages(device, cause, page_count, addresses) }
    }
}

/// # Safety
/// `page_count` null or valid for reads and writes; `addresses` null or valid for `*page_count` writes.
unsafe fn retired_pages(
    device: nvmlDevice_t,
    cause: nvmlPageRetirementCause_t,
    page_count: *mut c_uint,
    addresses: *mut u64,
) -> R {
    let node = node()?;
    let gpu = handles::whole_gpu(node, device)?;
    need(page_count)?;
    if cause >= nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_COUNT {
        return Err(INVALID_ARGUMENT);
    }
    if !retires_pages(node.gpu(gpu).nv()?.model) {
        return Err(NOT_SUPPORTED);
    }
    // SAFETY: as this function's contract.
    unsafe { fill_list(page_count, addresses, Vec::new()) }
}

nvml_exports! {
    /// `nvmlDeviceGetRetiredPagesPendingStatus`: `NOT_SUPPORTED` on Ampere and later.
    fn nvmlDeviceGetRetiredPagesPendingStatus(device, is_pending) {
        let f = |_: &Node, _: u32, m: &'static GpuModel| {
            if retires_pages(m) { Ok(nvmlEnableState_enum_NVML_FEATURE_DISABLED) } else { Err(NOT_SUPPORTED) }
        };
        guard(NVML_ERROR_UNKNOWN, || {
            status(|| {
                // SAFETY: is_pending is null or valid for a write by the caller's contract.
                unsafe { gpu_value(device, is_pending, f) }
            })
        })
    }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetRemappedRows`: rows remapped for correctable / uncorrectable errors, whether a
    /// remap waits for a reset, whether one ever failed. Not answered while MIG instances exist.
    fn nvmlDeviceGetRemappedRows(device, corr_rows, unc_rows, is_pending, failure_occurred) {
        let node = node()?;
        let gpu = handles::whole_gpu(node, device)?;
        need(corr_rows)?;
        need(unc_rows)?;
        need(is_pending)?;
        need(failure_occurred)?;
        if node.mig_mode(gpu).is_ok_and(|(current, _)| current)
            && node.gpu_instances(gpu).is_ok_and(|g| !g.is_empty())
        {
            return Err(NOT_SUPPORTED);
        }
        let h = node.health(gpu).nv()?;
        let clamp = |v: u64| v.min(u64::from(u32::MAX)) as u32;
        // SAFETY: all four pointers are checked non-null and aligned; valid for writes by the caller's contract.
        unsafe {
            put(corr_rows, clamp(h.remapped_correctable))?;
            put(unc_rows, clamp(h.remapped_uncorrectable))?;
            put(is_pending, u32::from(h.remap_pending))?;
            put(failure_occurred, u32::from(h.remap_failure))
        }
    }

    /// `nvmlDeviceGetFieldValues`: each value is answered on its own (its `nvmlReturn`); the call
    /// fails only for a bad handle or array. Of the many field ids, the simulated board knows
    /// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` (what the driver says the GPU needs after a fault, cleared
    /// by a reset); every other field is `NOT_SUPPORTED`.
    ///
    /// # Safety
    /// `values` must point to `values_count` writable `nvmlFieldValue_t` with `fieldId` set.
    fn nvmlDeviceGetFieldValues(device, values_count, values) {
        let node = node()?;
        let gpu = handles::whole_gpu(node, device)?;
        let count = usize::try_from(values_count).map_err(|_| INVALID_ARGUMENT)?;
        need(values)?;
        let h = node.health(gpu).nv()?;
        let now = tessera_sim_model::realtime_us_from_monotonic(tessera_sim_model::monotonic_ns());
        for i in 0..count {
            // SAFETY: `values` is non-null and the caller's contract makes `values_count`
            // entries writable; `i < count`.
            let v = unsafe { &mut *values.add(i) };
            v.timestamp = now as i64;
            v.latencyUsec = 0;
            if v.fieldId == field_id::NVML_FI_DEV_GET_GPU_RECOVERY_ACTION {
                v.valueType = nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT;
                v.value = nvmlValue_t { uiVal: h.recovery_action };
                v.nvmlReturn = nvmlReturn_enum_NVML_SUCCESS;
            } else {
                v.nvmlReturn = NOT_SUPPORTED;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_sensors_follow_load() {
        let m = tessera_sim_model::catalog::model("H100-SXM5-80GB").unwrap();
        assert_eq!(power_mw(m, 0), m.idle_power_mw);
        assert_eq!(power_mw(m, 100), 630_000);
        assert!(power_mw(m, 50) > power_mw(m, 10));
        assert_eq!(temperature_c(m, 0), m.idle_temp_c);
        assert!(temperature_c(m, 100) < m.slowdown_temp_c);
        assert!(temperature_c(m, 100) > temperature_c(m, 0));
    }
}
