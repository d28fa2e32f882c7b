//! Device enumeration and identity: count, handles by index / UUID / serial / PCI bus id, name,
//! UUID, serial, index, minor number, PCI info, compute capability, architecture, brand, board id,
//! NUMA node, attributes, virtualization mode.

use std::ffi::{c_char, c_int, c_uint};

use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::{GpuIdentity, Node, VirtualizationMode};

use super::handles::{self, Dev, gpu_handle, mig_handle};
use super::*;
use crate::ffi::guard;
use crate::latency;

/// PCI class of a 3D controller (what data-center GPUs without display report).
const PCI_BASE_CLASS_DISPLAY: u32 = 0x03;
const PCI_SUB_CLASS_3D: u32 = 0x02;

/// `nvmlPciInfo_t` as `nvmlDeviceGetPciInfo` (v1) and `_v2` write it: the layout before NVML
/// widened the PCI domain (a 16-byte bus id, then four reserved words where v3 has `busId`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct PciInfoLegacy {
    pub bus_id: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pci_device_id: c_uint,
    pub pci_sub_system_id: c_uint,
    pub reserved: [c_uint; 4],
}

/// `nvmlDeviceAttributes_t` as `nvmlDeviceGetAttributes` (v1) writes it: the engine counts only.
#[repr(C)]
#[derive(Clone, Copy)]
struct DeviceAttributesV1 {
    multiprocessor_count: c_uint,
    shared_copy_engine_count: c_uint,
    shared_decoder_count: c_uint,
    shared_encoder_count: c_uint,
    shared_jpeg_count: c_uint,
    shared_ofa_count: c_uint,
}

/// NVML's busIdLegacy form, "%04X:%02X:%02X.0".
pub(crate) fn bus_id_legacy(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:04X}:{bus:02X}:{device:02X}.0")
}

/// NVML's busId form, "%08X:%02X:%02X.0".
pub(crate) fn bus_id(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:08X}:{bus:02X}:{device:02X}.0")
}

/// `nvmlPciInfo_t` (v3 layout) of a PCI function.
pub(crate) fn pci_info(domain: u32, bus: u32, dev: u32, device_id: u32, subsystem_id: u32) -> nvmlPciInfo_t {
    // SAFETY: nvmlPciInfo_t is plain C data (integers and char arrays); all zeroes is valid.
    let mut p: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
    fill_chars(&mut p.busIdLegacy, &bus_id_legacy(domain, bus, dev));
    fill_chars(&mut p.busId, &bus_id(domain, bus, dev));
    p.domain = domain;
    p.bus = bus;
    p.device = dev;
    p.pciDeviceId = device_id;
    p.pciSubSystemId = subsystem_id;
    p
}

/// The legacy (v1/v2) layout of the same.
pub(crate) fn pci_info_legacy(p: &nvmlPciInfo_t) -> PciInfoLegacy {
    PciInfoLegacy {
        bus_id: p.busIdLegacy,
        domain: p.domain,
        bus: p.bus,
        device: p.device,
        pci_device_id: p.pciDeviceId,
        pci_sub_system_id: p.pciSubSystemId,
        reserved: [0; 4],
    }
}

fn gpu_pci(id: &GpuIdentity) -> nvmlPciInfo_t {
    pci_info(id.pci_domain, id.pci_bus, id.pci_device, id.model.pci_device_id, id.model.pci_subsystem_id)
}

fn count() -> R<u32> {
    Ok(node()?.gpus().len() as u32)
}

nvml_exports! {
    /// `nvmlDeviceGetCount_v2`: every GPU of the node.
    ///
    /// `nvmlDeviceGetCount` (v1): the same (every simulated GPU is accessible).
    fn nvmlDeviceGetCount_v2(device_count) also nvmlDeviceGetCount {
        guard(NVML_ERROR_UNKNOWN, || {
            let _card = latency::floor("nvmlDeviceGetCount_v2");
            status(|| {
                let n = count()?;
                // SAFETY: device_count is null or valid for a write (caller's contract); put checks null.
                unsafe { put(device_count, n) }
            })
        })
    }
}

fn by_index(index: u32) -> R<nvmlDevice_t> {
    let node = node()?;
    if index as usize >= node.gpus().len() {
        return Err(INVALID_ARGUMENT);
    }
    node.check_gpu(index).nv()?;
    Ok(gpu_handle(index))
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetHandleByIndex_v2`.
    ///
    /// `nvmlDeviceGetHandleByIndex` (v1).
    fn nvmlDeviceGetHandleByIndex_v2(index, device) also nvmlDeviceGetHandleByIndex {
        node()?;
        need(device)?;
        let h = by_index(index)?;
        // SAFETY: device is checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(device, h) }
    }
}

/// The handle of a GPU or MIG device by UUID ("GPU-…" or "MIG-…").
fn by_uuid(node: &Node, uuid: &str) -> R<nvmlDevice_t> {
    if let Some(id) = node.gpus().iter().find(|g| g.uuid == uuid) {
        node.check_gpu(id.index).nv()?;
        return Ok(gpu_handle(id.index));
    }
    let mut lost = false;
    if uuid.starts_with("MIG-") {
        for id in node.gpus() {
            lost |= node.is_lost(id.index);
            let Ok((true, _)) = node.mig_mode(id.index) else {
                continue;
            };
            let Ok(cis) = node.compute_instances(id.index, None) else {
                continue;
            };
            if let Some(ci) = cis.iter().find(|ci| id.mig_uuid(ci.gi_id, ci.id, ci.serial) == uuid) {
                return mig_handle(id.index, ci.gi_id, ci.id);
            }
        }
    }
    // The MIG devices of a lost GPU cannot be searched: NVML says so rather than "not found".
    Err(if lost { GPU_IS_LOST } else { NOT_FOUND })
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetHandleByUUID`: a GPU's UUID, or a MIG device's (which gives its MIG device handle).
    fn nvmlDeviceGetHandleByUUID(uuid, device) {
        let node = node()?;
        need(device)?;
        // SAFETY: uuid is null or a NUL-terminated string by the caller's contract.
        let uuid = unsafe { crate::ffi::read_cstr(uuid) }.ok_or(INVALID_ARGUMENT)?;
        let h = by_uuid(node, uuid)?;
        // SAFETY: device is checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(device, h) }
    }

    /// `nvmlDeviceGetHandleBySerial` (deprecated in the header, still exported by the library).
    fn nvmlDeviceGetHandleBySerial(serial, device) {
        let node = node()?;
        need(device)?;
        // SAFETY: serial is null or a NUL-terminated string by the caller's contract.
        let serial = unsafe { crate::ffi::read_cstr(serial) }.ok_or(INVALID_ARGUMENT)?;
        let id = node.gpus().iter().find(|g| g.serial == serial).ok_or(NOT_FOUND)?;
        node.check_gpu(id.index).nv()?;
        // SAFETY: device is checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(device, gpu_handle(id.index)) }
    }
}

/// Parses a PCI bus id in the forms NVML accepts (hex): `domain:bus:device.function`,
/// `domain:bus:device`, `bus:device.function`. Returns (domain, bus, device, function).
pub(crate) fn parse_bus_id(s: &str) -> Option<(u32, u32, u32, u32)> {
    let hex = |t: &str| {
        if t.is_empty() || t.len() > 8 { None } else { u32::from_str_radix(t, 16).ok() }
    };
    let (head, function) = match s.trim().rsplit_once('.') {
        Some((h, f)) => (h, Some(hex(f)?)),
        None => (s.trim(), None),
    };
    let parts: Vec<&str> = head.split(':').collect();
    match (parts.as_slice(), function) {
        ([d, b, v], f) => Some((hex(d)?, hex(b)?, hex(v)?, f.unwrap_or(0))),
        ([b, v], Some(f)) => Some((0, hex(b)?, hex(v)?, f)),
        _ => None,
    }
}

fn by_pci_bus_id(p: *const c_char) -> R<nvmlDevice_t> {
    let node = node()?;
    // SAFETY: p is null or a NUL-terminated string by the caller's contract.
    let s = unsafe { crate::ffi::read_cstr(p) }.ok_or(INVALID_ARGUMENT)?;
    let (domain, bus, dev, function) = parse_bus_id(s).ok_or(INVALID_ARGUMENT)?;
    let id = node
        .gpus()
        .iter()
        .find(|g| g.pci_domain == domain && g.pci_bus == bus && g.pci_device == dev && function == 0)
        .ok_or(NOT_FOUND)?;
    node.check_gpu(id.index).nv()?;
    Ok(gpu_handle(id.index))
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetHandleByPciBusId_v2`.
    ///
    /// `nvmlDeviceGetHandleByPciBusId` (v1).
    fn nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id, device) also nvmlDeviceGetHandleByPciBusId {
        node()?;
        need(device)?;
        let h = by_pci_bus_id(pci_bus_id)?;
        // SAFETY: device is checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(device, h) }
    }
}

/// A device's name: the product name, and for a MIG device "<product> MIG <profile>".
fn name_of(node: &Node, dev: &Dev) -> R<String> {
    let id = node.gpu(dev.gpu()).nv()?;
    Ok(match dev {
        Dev::Gpu(_) => id.model.name.to_string(),
        Dev::Mig(m) => format!("{} MIG {}", id.model.name, m.ci.profile.name_in(m.gi.profile)),
    })
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetName`: e.g. "NVIDIA H100 80GB HBM3", or "NVIDIA H100 80GB HBM3 MIG 1g.10gb".
    fn nvmlDeviceGetName(device, name, length) {
        let node = node()?;
        let dev = handles::device(node, device)?;
        if name.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let s = name_of(node, &dev)?;
        // SAFETY: name holds `length` bytes by the caller's contract.
        unsafe { put_str(name, length, &s) }
    }

    /// `nvmlDeviceGetUUID`: "GPU-…" for a GPU, "MIG-…" for a MIG device.
    fn nvmlDeviceGetUUID(device, uuid, length) {
        let node = node()?;
        let dev = handles::device(node, device)?;
        if uuid.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let id = node.gpu(dev.gpu()).nv()?;
        let s = match &dev {
            Dev::Gpu(_) => id.uuid.clone(),
            Dev::Mig(m) => id.mig_uuid(m.gi.id, m.ci.id, m.ci.serial),
        };
        // SAFETY: uuid holds `length` bytes by the caller's contract.
        unsafe { put_str(uuid, length, &s) }
    }

    /// `nvmlDeviceGetSerial`: the board serial (a MIG device reports its board's).
    fn nvmlDeviceGetSerial(device, serial, length) {
        let node = node()?;
        let dev = handles::device(node, device)?;
        if serial.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let s = node.gpu(dev.gpu()).nv()?.serial.clone();
        // SAFETY: serial holds `length` bytes by the caller's contract.
        unsafe { put_str(serial, length, &s) }
    }
}

/// A value of the physical GPU behind a handle, written to `out`. MIG devices answer with
/// their parent's value when `mig_too`, else `NOT_SUPPORTED`.
///
/// # Safety
/// `out` must be null or valid for a write of `T`.
unsafe fn gpu_value<T>(
    device: nvmlDevice_t,
    out: *mut T,
    mig_too: bool,
    f: impl FnOnce(&Node, &GpuIdentity) -> R<T>,
) -> R {
    let node = node()?;
    let dev = handles::device(node, device)?;
    need(out)?;
    if matches!(dev, Dev::Mig(_)) && !mig_too {
        return Err(NOT_SUPPORTED);
    }
    let v = f(node, node.gpu(dev.gpu()).nv()?)?;
    // SAFETY: out is checked non-null and aligned; valid for a write by this function's contract.
    unsafe { put(out, v) }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetIndex`: the NVML index (MIG devices have none: `NOT_SUPPORTED`).
    fn nvmlDeviceGetIndex(device, index) {
        // SAFETY: index is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, index, false, |_, id| Ok(id.index)) }
    }

    /// `nvmlDeviceGetMinorNumber`: N of /dev/nvidiaN.
    fn nvmlDeviceGetMinorNumber(device, minor_number) {
        // SAFETY: minor_number is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, minor_number, false, |_, id| Ok(id.minor)) }
    }

    /// `nvmlDeviceGetPciInfo_v3`: busId "00000000:18:00.0", busIdLegacy "0000:18:00.0".
    fn nvmlDeviceGetPciInfo_v3(device, pci) {
        // SAFETY: pci is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, pci, true, |_, id| Ok(gpu_pci(id))) }
    }
}

nvml_exports! {
    /// `nvmlDeviceGetPciInfo_v2`: the legacy layout (16-byte bus id in the legacy form).
    ///
    /// `nvmlDeviceGetPciInfo` (v1): the legacy layout.
    fn nvmlDeviceGetPciInfo_v2(device, pci) also nvmlDeviceGetPciInfo {
        let pci = pci.cast::<PciInfoLegacy>();
        guard(NVML_ERROR_UNKNOWN, || {
            status(|| {
                // SAFETY: pci is null or valid for a write of the legacy struct (a prefix of nvmlPciInfo_t).
                unsafe { gpu_value(device, pci, true, |_, id| Ok(pci_info_legacy(&gpu_pci(id)))) }
            })
        })
    }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetPciInfoExt` (versioned `nvmlPciInfoExt_v1_t`, with the PCI class).
    fn nvmlDeviceGetPciInfoExt(device, pci) {
        node()?;
        // SAFETY: pci is null or valid for reads of the struct by the caller's contract.
        let version = unsafe { get(pci.cast_const().cast::<c_uint>()) }?;
        if version != struct_version::<nvmlPciInfoExt_v1_t>(1) {
            return Err(VERSION_MISMATCH);
        }
        let f = |_: &Node, id: &GpuIdentity| {
            let p = gpu_pci(id);
            Ok(nvmlPciInfoExt_v1_t {
                version,
                domain: p.domain,
                bus: p.bus,
                device: p.device,
                pciDeviceId: p.pciDeviceId,
                pciSubSystemId: p.pciSubSystemId,
                baseClass: PCI_BASE_CLASS_DISPLAY,
                subClass: PCI_SUB_CLASS_3D,
                busId: p.busId,
            })
        };
        // SAFETY: pci is valid for a write by the caller's contract (checked non-null above).
        unsafe { gpu_value(device, pci, true, f) }
    }

    /// `nvmlDeviceGetCudaComputeCapability`: 9.0 for Hopper, 8.0 for A100.
    fn nvmlDeviceGetCudaComputeCapability(device, major, minor) {
        let node = node()?;
        let dev = handles::device(node, device)?;
        need(major)?;
        need(minor)?;
        let m = node.gpu(dev.gpu()).nv()?.model;
        // SAFETY: both pointers are checked non-null and aligned; valid for writes by the caller's contract.
        unsafe {
            put(major, m.cc_major as c_int)?;
            put(minor, m.cc_minor as c_int)
        }
    }

    /// `nvmlDeviceGetArchitecture`: `NVML_DEVICE_ARCH_*`.
    fn nvmlDeviceGetArchitecture(device, arch) {
        // SAFETY: arch is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, arch, true, |_, id| Ok(id.model.architecture)) }
    }

    /// `nvmlDeviceGetBrand`: `NVML_BRAND_NVIDIA` for today's data-center boards.
    fn nvmlDeviceGetBrand(device, brand) {
        // SAFETY: brand is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, brand, true, |_, id| Ok(id.model.brand)) }
    }

    /// `nvmlDeviceGetBoardId`.
    fn nvmlDeviceGetBoardId(device, board_id) {
        // SAFETY: board_id is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, board_id, true, |_, id| Ok(id.board_id)) }
    }

    /// `nvmlDeviceGetNumaNodeId`: the NUMA node the GPU is attached to.
    fn nvmlDeviceGetNumaNodeId(device, numa_node) {
        // SAFETY: numa_node is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, numa_node, true, |_, id| Ok(id.numa_node)) }
    }

    /// `nvmlDeviceGetNumGpuCores`: the board's CUDA cores (a MIG device: `NOT_SUPPORTED`).
    fn nvmlDeviceGetNumGpuCores(device, num_cores) {
        // SAFETY: num_cores is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, num_cores, false, |_, id| Ok(id.model.cuda_cores())) }
    }

    /// `nvmlDeviceGetVbiosVersion`: the board's VBIOS ("96.00.A5.00.1A"); a MIG device its parent's.
    fn nvmlDeviceGetVbiosVersion(device, version, length) {
        let node = node()?;
        let dev = handles::device(node, device)?;
        if version.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let v = node.gpu(dev.gpu()).nv()?.model.vbios_version;
        // SAFETY: version holds `length` bytes by the caller's contract.
        unsafe { put_str(version, length, v) }
    }

    /// `nvmlDeviceGetMemoryBusWidth`, in bits.
    fn nvmlDeviceGetMemoryBusWidth(device, bus_width) {
        // SAFETY: bus_width is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, bus_width, true, |_, id| Ok(id.model.memory_bus_width_bits)) }
    }

    /// `nvmlDeviceGetMaxPcieLinkGeneration`.
    fn nvmlDeviceGetMaxPcieLinkGeneration(device, max_link_gen) {
        // SAFETY: max_link_gen is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, max_link_gen, false, |_, id| Ok(id.model.pcie_max_gen)) }
    }

    /// `nvmlDeviceGetMaxPcieLinkWidth`.
    fn nvmlDeviceGetMaxPcieLinkWidth(device, max_link_width) {
        // SAFETY: max_link_width is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, max_link_width, false, |_, id| Ok(id.model.pcie_max_width)) }
    }

    /// `nvmlDeviceGetCurrPcieLinkGeneration`: the simulated links train at their maximum.
    fn nvmlDeviceGetCurrPcieLinkGeneration(device, curr_link_gen) {
        // SAFETY: curr_link_gen is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, curr_link_gen, false, |_, id| Ok(id.model.pcie_max_gen)) }
    }

    /// `nvmlDeviceGetCurrPcieLinkWidth`.
    fn nvmlDeviceGetCurrPcieLinkWidth(device, curr_link_width) {
        // SAFETY: curr_link_width is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, curr_link_width, false, |_, id| Ok(id.model.pcie_max_width)) }
    }

    /// `nvmlDeviceGetPersistenceMode`: enabled, as on a data-center node running the persistence daemon.
    fn nvmlDeviceGetPersistenceMode(device, mode) {
        // SAFETY: mode is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, mode, false, |_, _| Ok(nvmlEnableState_enum_NVML_FEATURE_ENABLED)) }
    }

    /// `nvmlDeviceGetComputeMode`: `NVML_COMPUTEMODE_DEFAULT` (shared).
    fn nvmlDeviceGetComputeMode(device, mode) {
        // SAFETY: mode is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, mode, true, |_, _| Ok(nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT)) }
    }

    /// `nvmlDeviceGetVirtualizationMode`: the description's `virtualization_mode`:
    /// `NVML_GPU_VIRTUALIZATION_MODE_NONE` by default, as on a bare-metal GPU with no vGPU manager
    /// (NVIDIA's DRA driver asks before it manages MIG devices), or `PASSTHROUGH` for a GPU passed
    /// whole to a virtual machine (as the H200 that was read answered). A MIG device is
    /// `INVALID_ARGUMENT`, as a real driver answers for MIG handles.
    fn nvmlDeviceGetVirtualizationMode(device, mode) {
        let node = node()?;
        if matches!(handles::device(node, device)?, Dev::Mig(_)) {
            return Err(INVALID_ARGUMENT);
        }
        let v = match node.description().virtualization_mode {
            VirtualizationMode::None => nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_NONE,
            VirtualizationMode::Passthrough => nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH,
        };
        // SAFETY: mode is null or valid for a write by the caller's contract.
        unsafe { gpu_value(device, mode, false, |_, _| Ok(v)) }
    }
}

/// A device's attributes: a MIG device's from its instance profiles, a GPU's from the board.
fn attributes(node: &Node, dev: &Dev) -> R<nvmlDeviceAttributes_t> {
    let m = node.gpu(dev.gpu()).nv()?.model;
    Ok(match dev {
        Dev::Mig(d) => {
            let g = d.gi.profile;
            nvmlDeviceAttributes_t {
                multiprocessorCount: d.ci.sm_count,
                sharedCopyEngineCount: g.copy_engines,
                sharedDecoderCount: g.decoders,
                sharedEncoderCount: g.encoders,
                sharedJpegCount: g.jpegs,
                sharedOfaCount: g.ofas,
                gpuInstanceSliceCount: g.slice_count,
                computeInstanceSliceCount: d.ci.profile.slice_count,
                memorySizeMB: g.memory_mib,
            }
        }
        Dev::Gpu(_) => {
            // The whole board's engines are those of its full-size GPU instance.
            let full = m.mig.as_ref().and_then(|s| s.gi_profiles.iter().max_by_key(|p| p.slice_count));
            nvmlDeviceAttributes_t {
                multiprocessorCount: m.sm_count,
                sharedCopyEngineCount: full.map_or(m.async_engine_count, |p| p.copy_engines),
                sharedDecoderCount: full.map_or(0, |p| p.decoders),
                sharedEncoderCount: full.map_or(0, |p| p.encoders),
                sharedJpegCount: full.map_or(0, |p| p.jpegs),
                sharedOfaCount: full.map_or(0, |p| p.ofas),
                gpuInstanceSliceCount: 0,
                computeInstanceSliceCount: 0,
                memorySizeMB: m.memory_bytes >> 20,
            }
        }
    })
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetAttributes_v2`.
    fn nvmlDeviceGetAttributes_v2(device, attributes_out) {
        let node = node()?;
        let dev = handles::device(node, device)?;
        need(attributes_out)?;
        let a = attributes(node, &dev)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(attributes_out, a) }
    }

    /// `nvmlDeviceGetAttributes` (v1): the engine counts only.
    fn nvmlDeviceGetAttributes(device, attributes_out) {
        let node = node()?;
        let dev = handles::device(node, device)?;
        let out = attributes_out.cast::<DeviceAttributesV1>();
        need(out)?;
        let a = attributes(node, &dev)?;
        let v1 = DeviceAttributesV1 {
            multiprocessor_count: a.multiprocessorCount,
            shared_copy_engine_count: a.sharedCopyEngineCount,
            shared_decoder_count: a.sharedDecoderCount,
            shared_encoder_count: a.sharedEncoderCount,
            shared_jpeg_count: a.sharedJpegCount,
            shared_ofa_count: a.sharedOfaCount,
        };
        // SAFETY: checked non-null and aligned; the v1 struct is a prefix of the caller's.
        unsafe { put(out, v1) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_in_nvml_forms() {
        assert_eq!(bus_id(0, 0x18, 0), "00000000:18:00.0");
        assert_eq!(bus_id_legacy(0, 0xab, 0), "0000:AB:00.0");
        assert_eq!(parse_bus_id("00000000:18:00.0"), Some((0, 0x18, 0, 0)));
        assert_eq!(parse_bus_id("0000:18:00.0"), Some((0, 0x18, 0, 0)));
        assert_eq!(parse_bus_id("0:1a:0"), Some((0, 0x1a, 0, 0)));
        assert_eq!(parse_bus_id("18:00.0"), Some((0, 0x18, 0, 0)));
        assert_eq!(parse_bus_id("18:00"), None);
        assert_eq!(parse_bus_id("zz:00.0"), None);
        assert_eq!(parse_bus_id(""), None);
    }

    #[test]
    fn legacy_pci_layout_is_the_old_52_bytes() {
        assert_eq!(std::mem::size_of::<PciInfoLegacy>(), 52);
        assert_eq!(std::mem::size_of::<nvmlPciInfo_t>(), 68);
        let p = pci_info(0, 0x5d, 0, 0x2330_10de, 0x16c1_10de);
        let l = pci_info_legacy(&p);
        assert_eq!(l.bus, 0x5d);
        assert_eq!(l.bus_id[..13].iter().map(|&c| c as u8).collect::<Vec<_>>(), b"0000:5D:00.0\0");
    }
}
