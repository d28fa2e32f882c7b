//! Topology: PCIe common ancestors, nearest GPUs, CPU affinity sets, peer-to-peer status, NVLink.
//!
//! The node description places GPUs on PCIe switches and NUMA nodes (`GpuIdentity`); an NVLink
//! group is an NVSwitch fabric: every link of a GPU goes to one of the fabric's switches
//! (HGX H100: four third-generation NVSwitches, four or five links each; HGX A100: six, two links
//! each), and any two GPUs of the group are peers over NVLink.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::{GpuIdentity, Node, TopologyLevel};

use super::device::{PciInfoLegacy, pci_info, pci_info_legacy};
use super::handles::{self, gpu_handle};
use super::*;

/// `nvmlPciInfo_t.pciDeviceId` of NVSwitch chips: third generation (Hopper boards), second (Ampere).
const NVSWITCH_GEN3_DEVICE_ID: u32 = 0x22A3_10DE;
const NVSWITCH_GEN2_DEVICE_ID: u32 = 0x1AF1_10DE;
/// First PCI bus of a fabric's NVSwitches; each fabric takes six buses.
const NVSWITCH_FIRST_BUS: u32 = 0x05;

fn level(l: TopologyLevel) -> nvmlGpuTopologyLevel_t {
    l as nvmlGpuTopologyLevel_t
}

fn valid_level(l: nvmlGpuTopologyLevel_t) -> bool {
    matches!(l, 0 | 10 | 20 | 30 | 40 | 50)
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetTopologyCommonAncestor`: where the PCIe paths of two GPUs meet.
    fn nvmlDeviceGetTopologyCommonAncestor(device1, device2, path_info) {
        let node = node()?;
        let a = handles::whole_gpu(node, device1)?;
        let b = handles::whole_gpu(node, device2)?;
        need(path_info)?;
        let l = node.gpu(a).nv()?.common_ancestor(node.gpu(b).nv()?);
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(path_info, level(l)) }
    }

    /// `nvmlDeviceGetTopologyNearestGpus`: the other GPUs at `level` or closer. `*count == 0` asks
    /// for the count; otherwise up to `*count` handles are written and `*count` set to how many.
    fn nvmlDeviceGetTopologyNearestGpus(device, level_in, count, device_array) {
        let node = node()?;
        let gpu = handles::whole_gpu(node, device)?;
        if !valid_level(level_in) {
            return Err(INVALID_ARGUMENT);
        }
        let me = node.gpu(gpu).nv()?;
        let near: Vec<u32> = node
            .gpus()
            .iter()
            .filter(|g| g.index != gpu && level(me.common_ancestor(g)) <= level_in)
            .map(|g| g.index)
            .collect();
        // SAFETY: the pointers follow the caller's contract for this function.
        unsafe { fill_upto(count, device_array, &near) }
    }
}

/// NVML's "zero asks for the count, non-zero fills that many" protocol.
///
/// # Safety
/// `count` null or valid for reads and writes; `out` null or valid for `*count` writes.
unsafe fn fill_upto(count: *mut c_uint, out: *mut nvmlDevice_t, gpus: &[u32]) -> R {
    // SAFETY: as this function's contract.
    let cap = unsafe { get(count) }?;
    if cap == 0 {
        // SAFETY: count checked by `get`.
        return unsafe { put(count, gpus.len() as u32) };
    }
    need(out)?;
    let n = gpus.len().min(cap as usize);
    for (i, &g) in gpus[..n].iter().enumerate() {
        // SAFETY: out is non-null, aligned and holds `cap >= n` handles (caller's contract).
        unsafe { out.add(i).write(gpu_handle(g)) };
    }
    // SAFETY: count checked by `get`.
    unsafe { put(count, n as u32) }
}

/// The host's CPUs split evenly over the node's NUMA nodes: the NUMA node of a CPU.
fn numa_of_cpu(node: &Node, cpu: u32) -> R<u32> {
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }.max(1) as u32;
    if cpu >= cpus {
        return Err(INVALID_ARGUMENT);
    }
    let numa = node.description().numa_nodes.max(1);
    Ok((u64::from(cpu) * u64::from(numa) / u64::from(cpus)) as u32)
}

nvml_guarded_exports! {
    /// `nvmlSystemGetTopologyGpuSet`: the GPUs on the NUMA node of a CPU.
    fn nvmlSystemGetTopologyGpuSet(cpu_number, count, device_array) {
        let node = node()?;
        need(count)?;
        let numa = numa_of_cpu(node, cpu_number)?;
        let set: Vec<u32> = node.gpus().iter().filter(|g| g.numa_node == numa).map(|g| g.index).collect();
        // SAFETY: the pointers follow the caller's contract for this function.
        unsafe { fill_upto(count, device_array, &set) }
    }
}

/// Peer-to-peer status between two GPUs for one capability.
fn p2p(a: &GpuIdentity, b: &GpuIdentity, index: nvmlGpuP2PCapsIndex_t) -> R<nvmlGpuP2PStatus_t> {
    const OK: nvmlGpuP2PStatus_t = nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK;
    const NOT_SUPPORTED_P2P: nvmlGpuP2PStatus_t = nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED;
    if a.index == b.index {
        return Ok(OK);
    }
    let nvlink = a.nvlink_to(b);
    // PCIe peer traffic crosses switches and root ports of one socket, not the inter-socket link.
    let pcie = a.common_ancestor(b) != TopologyLevel::System;
    Ok(match index {
        nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_READ | nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_WRITE => {
            if nvlink || pcie {
                OK
            } else {
                nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED
            }
        }
        nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK => {
            if nvlink {
                OK
            } else {
                NOT_SUPPORTED_P2P
            }
        }
        nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_ATOMICS => {
            if nvlink {
                OK
            } else {
                NOT_SUPPORTED_P2P
            }
        }
        nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_PCI => {
            if pcie {
                OK
            } else {
                nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED
            }
        }
        _ => return Err(INVALID_ARGUMENT),
    })
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetP2PStatus`.
    fn nvmlDeviceGetP2PStatus(device1, device2, p2p_index, p2p_status) {
        let node = node()?;
        let a = handles::whole_gpu(node, device1)?;
        let b = handles::whole_gpu(node, device2)?;
        need(p2p_status)?;
        let s = p2p(node.gpu(a).nv()?, node.gpu(b).nv()?, p2p_index)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(p2p_status, s) }
    }
}

/// A GPU with NVLink and a valid link number: (identity, whether the link is up).
fn link(node: &Node, device: nvmlDevice_t, link: c_uint) -> R<(&GpuIdentity, bool)> {
    let gpu = handles::whole_gpu(node, device)?;
    let id = node.gpu(gpu).nv()?;
    if id.model.nvlink_count == 0 {
        return Err(NOT_SUPPORTED);
    }
    if link >= id.model.nvlink_count {
        return Err(INVALID_ARGUMENT);
    }
    Ok((id, id.nvlink_fabric.is_some()))
}

/// The NVSwitches of a fabric and which one a link goes to.
fn nvswitch_of(id: &GpuIdentity, link: u32) -> (u32, u32) {
    let switches = if id.model.architecture >= NVML_DEVICE_ARCH_HOPPER { 4 } else { 6 };
    let fabric = id.nvlink_fabric.unwrap_or(0);
    // Spread links over the switches evenly (H100: four or five of its 18 links on each).
    let sw = (link * switches + switches / 2) / id.model.nvlink_count.max(1);
    (fabric, sw.min(switches - 1))
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetNvLinkState`: links of a GPU in an NVLink group are up, others down.
    fn nvmlDeviceGetNvLinkState(device, link_in, is_active) {
        let node = node()?;
        handles::decode_device(node, device)?;
        need(is_active)?;
        let (_, up) = link(node, device, link_in)?;
        let s =
            if up { nvmlEnableState_enum_NVML_FEATURE_ENABLED } else { nvmlEnableState_enum_NVML_FEATURE_DISABLED };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(is_active, s) }
    }

    /// `nvmlDeviceGetNvLinkVersion`: an `nvmlNvlinkVersion_t` (4.0 on Hopper, 3.0 on Ampere).
    fn nvmlDeviceGetNvLinkVersion(device, link_in, version) {
        let node = node()?;
        handles::decode_device(node, device)?;
        need(version)?;
        let (id, _) = link(node, device, link_in)?;
        let v = match id.model.architecture {
            a if a >= NVML_DEVICE_ARCH_HOPPER => nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_4_0,
            NVML_DEVICE_ARCH_AMPERE => nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_3_0,
            _ => nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_2_0,
        };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(version, v) }
    }

    /// `nvmlDeviceGetNvLinkCapability`: peer traffic and peer atomics over an NVSwitch fabric; no
    /// system-memory access (that needs an NVLink-attached CPU) and no SLI.
    fn nvmlDeviceGetNvLinkCapability(device, link_in, capability, cap_result) {
        let node = node()?;
        handles::decode_device(node, device)?;
        need(cap_result)?;
        let (_, up) = link(node, device, link_in)?;
        let v = match capability {
            nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_P2P_SUPPORTED
            | nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_P2P_ATOMICS => up,
            nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_SYSMEM_ACCESS
            | nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_SYSMEM_ATOMICS
            | nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_SLI_BRIDGE => false,
            nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_VALID => true,
            _ => return Err(INVALID_ARGUMENT),
        };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(cap_result, u32::from(v)) }
    }
}

/// PCI info of the NVSwitch at the far end of a link (`pciSubSystemId` left 0, as the header says).
fn remote_pci(node: &Node, device: nvmlDevice_t, link_in: c_uint) -> R<nvmlPciInfo_t> {
    let (id, up) = link(node, device, link_in)?;
    if !up {
        return Err(NOT_SUPPORTED);
    }
    let (fabric, sw) = nvswitch_of(id, link_in);
    let device_id = if id.model.architecture >= NVML_DEVICE_ARCH_HOPPER {
        NVSWITCH_GEN3_DEVICE_ID
    } else {
        NVSWITCH_GEN2_DEVICE_ID
    };
    Ok(pci_info(0, NVSWITCH_FIRST_BUS + fabric * 6 + sw, 0, device_id, 0))
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetNvLinkRemotePciInfo_v2`.
    fn nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link_in, pci) {
        let node = node()?;
        handles::decode_device(node, device)?;
        need(pci)?;
        let p = remote_pci(node, device, link_in)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(pci, p) }
    }

    /// `nvmlDeviceGetNvLinkRemotePciInfo` (v1): the legacy `nvmlPciInfo_t` layout.
    fn nvmlDeviceGetNvLinkRemotePciInfo(device, link_in, pci) {
        let node = node()?;
        handles::decode_device(node, device)?;
        let out = pci.cast::<PciInfoLegacy>();
        need(out)?;
        let p = remote_pci(node, device, link_in)?;
        // SAFETY: checked non-null and aligned; the legacy struct is a prefix of the caller's.
        unsafe { put(out, pci_info_legacy(&p)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_sim_model::NodeDescription;

    #[test]
    fn h100_links_spread_over_four_switches() {
        let ids = NodeDescription::default_node().identities();
        let per: Vec<u32> =
            (0..4).map(|s| (0..18).filter(|&l| nvswitch_of(&ids[0], l).1 == s).count() as u32).collect();
        assert_eq!(per.iter().sum::<u32>(), 18);
        assert!(per.iter().all(|&n| (4..=5).contains(&n)), "{per:?}");
    }

    #[test]
    fn p2p_over_nvlink_and_pcie() {
        let ids = NodeDescription::default_node().identities();
        assert_eq!(p2p(&ids[0], &ids[7], nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK), Ok(0));
        assert_eq!(p2p(&ids[0], &ids[7], nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_READ), Ok(0));
        assert_eq!(
            p2p(&ids[0], &ids[7], nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_PCI),
            Ok(nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED)
        );
        assert_eq!(p2p(&ids[0], &ids[1], nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_PCI), Ok(0));
        assert_eq!(p2p(&ids[0], &ids[1], 99), Err(INVALID_ARGUMENT));
    }
}
