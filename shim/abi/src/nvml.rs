//! The NVML table: every `nvml.h` function Tessera defines (the simulated driver's exports, the
//! shim's hooks) or calls (the shim's table of the real library), with the header's types from
//! `nvml-wrapper-sys` (enums are integer types there). Rows are grouped by subject; every
//! function returns `nvmlReturn_t` unless its row says otherwise.

#![allow(non_snake_case)] // parameter and function names are nvml.h's

pub use std::ffi::{c_char, c_int, c_uint, c_ulonglong};

pub use nvml_wrapper_sys::bindings::*;

table! {
    nvmlReturn_t;

    // Devices: handles, identity, PCI, attributes.
    fn nvmlDeviceGetCount_v2(device_count: *mut c_uint);
    fn nvmlDeviceGetCount(device_count: *mut c_uint);
    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t);
    fn nvmlDeviceGetHandleByIndex(index: c_uint, device: *mut nvmlDevice_t);
    fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t);
    fn nvmlDeviceGetHandleBySerial(serial: *const c_char, device: *mut nvmlDevice_t);
    fn nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id: *const c_char, device: *mut nvmlDevice_t);
    fn nvmlDeviceGetHandleByPciBusId(pci_bus_id: *const c_char, device: *mut nvmlDevice_t);
    fn nvmlDeviceGetName(device: nvmlDevice_t, name: *mut c_char, length: c_uint);
    fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint);
    fn nvmlDeviceGetSerial(device: nvmlDevice_t, serial: *mut c_char, length: c_uint);
    fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint);
    fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minor_number: *mut c_uint);
    fn nvmlDeviceGetPciInfo_v3(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t);
    fn nvmlDeviceGetPciInfo_v2(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t);
    fn nvmlDeviceGetPciInfo(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t);
    fn nvmlDeviceGetPciInfoExt(device: nvmlDevice_t, pci: *mut nvmlPciInfoExt_t);
    fn nvmlDeviceGetCudaComputeCapability(device: nvmlDevice_t, major: *mut c_int, minor: *mut c_int);
    fn nvmlDeviceGetArchitecture(device: nvmlDevice_t, arch: *mut nvmlDeviceArchitecture_t);
    fn nvmlDeviceGetBrand(device: nvmlDevice_t, brand: *mut nvmlBrandType_t);
    fn nvmlDeviceGetBoardId(device: nvmlDevice_t, board_id: *mut c_uint);
    fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, numa_node: *mut c_uint);
    fn nvmlDeviceGetNumGpuCores(device: nvmlDevice_t, num_cores: *mut c_uint);
    fn nvmlDeviceGetVbiosVersion(device: nvmlDevice_t, version: *mut c_char, length: c_uint);
    fn nvmlDeviceGetMemoryBusWidth(device: nvmlDevice_t, bus_width: *mut c_uint);
    fn nvmlDeviceGetMaxPcieLinkGeneration(device: nvmlDevice_t, max_link_gen: *mut c_uint);
    fn nvmlDeviceGetMaxPcieLinkWidth(device: nvmlDevice_t, max_link_width: *mut c_uint);
    fn nvmlDeviceGetCurrPcieLinkGeneration(device: nvmlDevice_t, curr_link_gen: *mut c_uint);
    fn nvmlDeviceGetCurrPcieLinkWidth(device: nvmlDevice_t, curr_link_width: *mut c_uint);
    fn nvmlDeviceGetPersistenceMode(device: nvmlDevice_t, mode: *mut nvmlEnableState_t);
    fn nvmlDeviceGetComputeMode(device: nvmlDevice_t, mode: *mut nvmlComputeMode_t);
    fn nvmlDeviceGetVirtualizationMode(device: nvmlDevice_t, mode: *mut nvmlGpuVirtualizationMode_t);
    fn nvmlDeviceGetAttributes_v2(device: nvmlDevice_t, attributes_out: *mut nvmlDeviceAttributes_t);
    fn nvmlDeviceGetAttributes(device: nvmlDevice_t, attributes_out: *mut nvmlDeviceAttributes_t);

    // Errors.
    fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char;

    // Events.
    fn nvmlEventSetCreate(set: *mut nvmlEventSet_t);
    fn nvmlDeviceGetSupportedEventTypes(device: nvmlDevice_t, event_types: *mut u64);
    fn nvmlDeviceRegisterEvents(device: nvmlDevice_t, event_types: u64, set: nvmlEventSet_t);
    fn nvmlEventSetWait_v2(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeoutms: c_uint);
    fn nvmlEventSetWait(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeoutms: c_uint);
    fn nvmlEventSetFree(set: nvmlEventSet_t);

    // Initialization, versions, the system.
    fn nvmlInit_v2();
    fn nvmlInit();
    fn nvmlInitWithFlags(_flags: c_uint);
    fn nvmlShutdown();
    fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint);
    fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint);
    fn nvmlSystemGetCudaDriverVersion(cuda_driver_version: *mut c_int);
    fn nvmlSystemGetCudaDriverVersion_v2(cuda_driver_version: *mut c_int);
    fn nvmlSystemGetProcessName(pid: c_uint, name: *mut c_char, length: c_uint);

    // Memory.
    fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory_out: *mut nvmlMemory_t);
    fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory_out: *mut nvmlMemory_v2_t);
    fn nvmlDeviceGetBAR1MemoryInfo(device: nvmlDevice_t, bar1_memory: *mut nvmlBAR1Memory_t);

    // MIG: mode, GPU and compute instances.
    fn nvmlDeviceGetMigMode(device: nvmlDevice_t, current_mode: *mut c_uint, pending_mode: *mut c_uint);
    fn nvmlDeviceSetMigMode(device: nvmlDevice_t, mode: c_uint, activation_status: *mut nvmlReturn_t);
    fn nvmlDeviceGetGpuInstanceProfileInfo(device: nvmlDevice_t, profile: c_uint, info: *mut nvmlGpuInstanceProfileInfo_t);
    fn nvmlDeviceGetGpuInstanceProfileInfoV(device: nvmlDevice_t, profile: c_uint, info: *mut nvmlGpuInstanceProfileInfo_v2_t);
    fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(device: nvmlDevice_t, profile_id: c_uint, info: *mut nvmlGpuInstanceProfileInfo_v2_t);
    fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(device: nvmlDevice_t, profile_id: c_uint, placements: *mut nvmlGpuInstancePlacement_t, count: *mut c_uint);
    fn nvmlDeviceGetGpuInstancePossiblePlacements(device: nvmlDevice_t, profile_id: c_uint, placements: *mut nvmlGpuInstancePlacement_t, count: *mut c_uint);
    fn nvmlDeviceGetGpuInstanceRemainingCapacity(device: nvmlDevice_t, profile_id: c_uint, count: *mut c_uint);
    fn nvmlDeviceCreateGpuInstance(device: nvmlDevice_t, profile_id: c_uint, gpu_instance: *mut nvmlGpuInstance_t);
    fn nvmlDeviceCreateGpuInstanceWithPlacement(device: nvmlDevice_t, profile_id: c_uint, placement: *const nvmlGpuInstancePlacement_t, gpu_instance: *mut nvmlGpuInstance_t);
    fn nvmlGpuInstanceDestroy(gpu_instance: nvmlGpuInstance_t);
    fn nvmlDeviceGetGpuInstances(device: nvmlDevice_t, profile_id: c_uint, gpu_instances: *mut nvmlGpuInstance_t, count: *mut c_uint);
    fn nvmlDeviceGetGpuInstanceById(device: nvmlDevice_t, id: c_uint, gpu_instance: *mut nvmlGpuInstance_t);
    fn nvmlGpuInstanceGetInfo(gpu_instance: nvmlGpuInstance_t, info: *mut nvmlGpuInstanceInfo_t);
    fn nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance: nvmlGpuInstance_t, profile: c_uint, eng_profile: c_uint, info: *mut nvmlComputeInstanceProfileInfo_t);
    fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(gpu_instance: nvmlGpuInstance_t, profile: c_uint, eng_profile: c_uint, info: *mut nvmlComputeInstanceProfileInfo_v2_t);
    fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gpu_instance: nvmlGpuInstance_t, profile_id: c_uint, count: *mut c_uint);
    fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(gpu_instance: nvmlGpuInstance_t, profile_id: c_uint, placements: *mut nvmlComputeInstancePlacement_t, count: *mut c_uint);
    fn nvmlGpuInstanceCreateComputeInstance(gpu_instance: nvmlGpuInstance_t, profile_id: c_uint, compute_instance: *mut nvmlComputeInstance_t);
    fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(gpu_instance: nvmlGpuInstance_t, profile_id: c_uint, placement: *const nvmlComputeInstancePlacement_t, compute_instance: *mut nvmlComputeInstance_t);
    fn nvmlComputeInstanceDestroy(compute_instance: nvmlComputeInstance_t);
    fn nvmlGpuInstanceGetComputeInstances(gpu_instance: nvmlGpuInstance_t, profile_id: c_uint, compute_instances: *mut nvmlComputeInstance_t, count: *mut c_uint);
    fn nvmlGpuInstanceGetComputeInstanceById(gpu_instance: nvmlGpuInstance_t, id: c_uint, compute_instance: *mut nvmlComputeInstance_t);
    fn nvmlComputeInstanceGetInfo_v2(compute_instance: nvmlComputeInstance_t, info: *mut nvmlComputeInstanceInfo_t);
    fn nvmlComputeInstanceGetInfo(compute_instance: nvmlComputeInstance_t, info: *mut nvmlComputeInstanceInfo_t);
    fn nvmlDeviceIsMigDeviceHandle(device: nvmlDevice_t, is_mig_device: *mut c_uint);
    fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, id: *mut c_uint);
    fn nvmlDeviceGetComputeInstanceId(device: nvmlDevice_t, id: *mut c_uint);
    fn nvmlDeviceGetMaxMigDeviceCount(device: nvmlDevice_t, count: *mut c_uint);
    fn nvmlDeviceGetMigDeviceHandleByIndex(device: nvmlDevice_t, index: c_uint, mig_device_out: *mut nvmlDevice_t);
    fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig_device_in: nvmlDevice_t, device: *mut nvmlDevice_t);

    // Processes and their utilization.
    fn nvmlDeviceGetComputeRunningProcesses_v3(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut nvmlProcessInfo_t);
    fn nvmlDeviceGetComputeRunningProcesses_v2(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t);
    fn nvmlDeviceGetComputeRunningProcesses(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t);
    fn nvmlDeviceGetGraphicsRunningProcesses_v3(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut nvmlProcessInfo_t);
    fn nvmlDeviceGetGraphicsRunningProcesses_v2(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t);
    fn nvmlDeviceGetGraphicsRunningProcesses(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t);
    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut nvmlProcessInfo_t);
    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t);
    fn nvmlDeviceGetMPSComputeRunningProcesses(device: nvmlDevice_t, info_count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t);
    fn nvmlDeviceGetUtilizationRates(device: nvmlDevice_t, utilization: *mut nvmlUtilization_t);
    fn nvmlDeviceGetProcessUtilization(device: nvmlDevice_t, utilization: *mut nvmlProcessUtilizationSample_t, process_samples_count: *mut c_uint, last_seen_time_stamp: u64);

    // Reset.
    fn nvmlDeviceResetGpu(device: nvmlDevice_t);

    // Sensors: temperature, power, clocks, utilization, ECC.
    fn nvmlDeviceGetTemperature(device: nvmlDevice_t, sensor_type: nvmlTemperatureSensors_t, temp: *mut c_uint);
    fn nvmlDeviceGetTemperatureV(device: nvmlDevice_t, temperature: *mut nvmlTemperature_t);
    fn nvmlDeviceGetTemperatureThreshold(device: nvmlDevice_t, threshold_type: nvmlTemperatureThresholds_t, temp: *mut c_uint);
    fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint);
    fn nvmlDeviceGetPowerManagementLimit(device: nvmlDevice_t, limit: *mut c_uint);
    fn nvmlDeviceGetPowerManagementDefaultLimit(device: nvmlDevice_t, default_limit: *mut c_uint);
    fn nvmlDeviceGetEnforcedPowerLimit(device: nvmlDevice_t, limit: *mut c_uint);
    fn nvmlDeviceGetPowerManagementLimitConstraints(device: nvmlDevice_t, min_limit: *mut c_uint, max_limit: *mut c_uint);
    fn nvmlDeviceGetPowerManagementMode(device: nvmlDevice_t, mode: *mut nvmlEnableState_t);
    fn nvmlDeviceGetClockInfo(device: nvmlDevice_t, clock_type: nvmlClockType_t, clock: *mut c_uint);
    fn nvmlDeviceGetMaxClockInfo(device: nvmlDevice_t, clock_type: nvmlClockType_t, clock: *mut c_uint);
    fn nvmlDeviceGetMaxCustomerBoostClock(device: nvmlDevice_t, clock_type: nvmlClockType_t, clock_mhz: *mut c_uint);
    fn nvmlDeviceGetApplicationsClock(device: nvmlDevice_t, clock_type: nvmlClockType_t, clock_mhz: *mut c_uint);
    fn nvmlDeviceGetDefaultApplicationsClock(device: nvmlDevice_t, clock_type: nvmlClockType_t, clock_mhz: *mut c_uint);
    fn nvmlDeviceGetClock(device: nvmlDevice_t, clock_type: nvmlClockType_t, clock_id: nvmlClockId_t, clock_mhz: *mut c_uint);
    fn nvmlDeviceGetFanSpeed(device: nvmlDevice_t, speed: *mut c_uint);
    fn nvmlDeviceGetFanSpeed_v2(device: nvmlDevice_t, _fan: c_uint, speed: *mut c_uint);
    fn nvmlDeviceGetNumFans(device: nvmlDevice_t, num_fans: *mut c_uint);
    fn nvmlDeviceGetPerformanceState(device: nvmlDevice_t, p_state: *mut nvmlPstates_t);
    fn nvmlDeviceGetPowerState(device: nvmlDevice_t, p_state: *mut nvmlPstates_t);
    fn nvmlDeviceGetEccMode(device: nvmlDevice_t, current: *mut nvmlEnableState_t, pending: *mut nvmlEnableState_t);
    fn nvmlDeviceGetDefaultEccMode(device: nvmlDevice_t, default_mode: *mut nvmlEnableState_t);
    fn nvmlDeviceGetTotalEccErrors(device: nvmlDevice_t, error_type: nvmlMemoryErrorType_t, counter_type: nvmlEccCounterType_t, ecc_counts: *mut u64);
    fn nvmlDeviceGetMemoryErrorCounter(device: nvmlDevice_t, error_type: nvmlMemoryErrorType_t, counter_type: nvmlEccCounterType_t, location_type: nvmlMemoryLocation_t, count: *mut u64);
    fn nvmlDeviceGetRetiredPages(device: nvmlDevice_t, cause: nvmlPageRetirementCause_t, page_count: *mut c_uint, addresses: *mut u64);
    fn nvmlDeviceGetRetiredPages_v2(device: nvmlDevice_t, cause: nvmlPageRetirementCause_t, page_count: *mut c_uint, addresses: *mut u64, _timestamps: *mut u64);
    fn nvmlDeviceGetRetiredPagesPendingStatus(device: nvmlDevice_t, is_pending: *mut nvmlEnableState_t);
    fn nvmlDeviceGetRemappedRows(device: nvmlDevice_t, corr_rows: *mut c_uint, unc_rows: *mut c_uint, is_pending: *mut c_uint, failure_occurred: *mut c_uint);
    fn nvmlDeviceGetFieldValues(device: nvmlDevice_t, values_count: c_int, values: *mut nvmlFieldValue_t);

    // Topology: NVLink, P2P, CPU affinity.
    fn nvmlDeviceGetTopologyCommonAncestor(device1: nvmlDevice_t, device2: nvmlDevice_t, path_info: *mut nvmlGpuTopologyLevel_t);
    fn nvmlDeviceGetTopologyNearestGpus(device: nvmlDevice_t, level_in: nvmlGpuTopologyLevel_t, count: *mut c_uint, device_array: *mut nvmlDevice_t);
    fn nvmlSystemGetTopologyGpuSet(cpu_number: c_uint, count: *mut c_uint, device_array: *mut nvmlDevice_t);
    fn nvmlDeviceGetP2PStatus(device1: nvmlDevice_t, device2: nvmlDevice_t, p2p_index: nvmlGpuP2PCapsIndex_t, p2p_status: *mut nvmlGpuP2PStatus_t);
    fn nvmlDeviceGetNvLinkState(device: nvmlDevice_t, link_in: c_uint, is_active: *mut nvmlEnableState_t);
    fn nvmlDeviceGetNvLinkVersion(device: nvmlDevice_t, link_in: c_uint, version: *mut c_uint);
    fn nvmlDeviceGetNvLinkCapability(device: nvmlDevice_t, link_in: c_uint, capability: nvmlNvLinkCapability_t, cap_result: *mut c_uint);
    fn nvmlDeviceGetNvLinkRemotePciInfo_v2(device: nvmlDevice_t, link_in: c_uint, pci: *mut nvmlPciInfo_t);
    fn nvmlDeviceGetNvLinkRemotePciInfo(device: nvmlDevice_t, link_in: c_uint, pci: *mut nvmlPciInfo_t);

    // Units (S-class systems).
    fn nvmlUnitGetCount(unitCount: *mut c_uint);
}
