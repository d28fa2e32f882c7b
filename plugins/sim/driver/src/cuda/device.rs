//! Device queries: enumeration, names, UUIDs, PCI identity, peer access, and the attribute table
//! `deviceQuery` prints, answered from the catalog's figures of the board.

use std::ffi::{c_char, c_int, c_uint};

use tessera_abi::cuda_exports;
use tessera_sim_model::TopologyLevel;

use super::init::{Device, driver};
use super::{INVALID_DEVICE, INVALID_VALUE, R, cstr, need, put, put_str_truncated, run, sys};

cuda_exports! {
    fn cuDeviceGet(device, ordinal) {
        run(|| {
            need(device)?;
            let d = driver()?.device(ordinal)?;
            // SAFETY: device is the caller's out-pointer (checked above).
            unsafe { put(device, d.ordinal) }
        })
    }

    fn cuDeviceGetCount(count) {
        run(|| {
            need(count)?;
            let n = driver()?.devices.len() as c_int;
            // SAFETY: count is the caller's out-pointer (checked above).
            unsafe { put(count, n) }
        })
    }

    fn cuDeviceGetName(name, len, dev) {
        run(|| {
            let d = driver()?.device(dev)?;
            // SAFETY: name holds len bytes by the caller's contract.
            unsafe { put_str_truncated(name, len, &d.name) }
        })
    }
}

fn uuid_of(uuid: *mut sys::CUuuid, dev: c_int) -> R {
    need(uuid)?;
    let d = driver()?.device(dev)?;
    let u = sys::CUuuid { bytes: d.uuid.map(|b| b as c_char) };
    // SAFETY: uuid is the caller's out-pointer (checked above).
    unsafe { put(uuid, u) }
}

cuda_exports! {
    /// `cuDeviceGetUuid`: for a MIG device, the MIG UUID (both versions agree since CUDA 11.4).
    fn cuDeviceGetUuid(uuid, dev) also cuDeviceGetUuid_v2 {
        run(|| uuid_of(uuid, dev))
    }

    fn cuDeviceTotalMem_v2(bytes, dev) {
        run(|| {
            need(bytes)?;
            let d = driver()?.device(dev)?;
            // SAFETY: bytes is the caller's out-pointer (checked above).
            unsafe { put(bytes, d.total_mem as usize) }
        })
    }

    /// Legacy `cuDeviceTotalMem` (a 32-bit size, saturated).
    fn cuDeviceTotalMem(bytes, dev) {
        run(|| {
            need(bytes)?;
            let d = driver()?.device(dev)?;
            // SAFETY: bytes is the caller's out-pointer (checked above).
            unsafe { put(bytes, d.total_mem.min(u32::MAX as u64) as c_uint) }
        })
    }

    fn cuDeviceComputeCapability(major, minor, dev) {
        run(|| {
            need(major)?;
            need(minor)?;
            let d = driver()?.device(dev)?;
            // SAFETY: major and minor are the caller's out-pointers (checked above).
            unsafe {
                put(major, d.model.cc_major as c_int)?;
                put(minor, d.model.cc_minor as c_int)
            }
        })
    }

    fn cuDeviceGetProperties(prop, dev) {
        run(|| {
            need(prop)?;
            let d = driver()?.device(dev)?;
            let m = d.model;
            let p = sys::CUdevprop {
                maxThreadsPerBlock: m.limits.max_threads_per_block as c_int,
                maxThreadsDim: m.limits.max_block_dim.map(|v| v as c_int),
                maxGridSize: m.limits.max_grid_dim.map(|v| v.min(i32::MAX as u32) as c_int),
                sharedMemPerBlock: m.limits.max_shared_mem_per_block as c_int,
                totalConstantMemory: m.limits.total_const_mem as c_int,
                SIMDWidth: m.limits.warp_size as c_int,
                memPitch: i32::MAX,
                regsPerBlock: m.limits.regs_per_block as c_int,
                clockRate: (m.max_sm_clock_mhz * 1000) as c_int,
                textureAlign: 512,
            };
            // SAFETY: prop is the caller's out-pointer (checked above).
            unsafe { put(prop, p) }
        })
    }
}

/// The PCI bus id as CUDA writes it: "0000:18:00.0".
fn pci_bus_id(d: &Device) -> String {
    format!("{:04x}:{:02x}:{:02x}.0", d.ident.pci_domain, d.ident.pci_bus, d.ident.pci_device)
}

cuda_exports! {
    fn cuDeviceGetPCIBusId(pciBusId, len, dev) {
        run(|| {
            let d = driver()?.device(dev)?;
            // SAFETY: pciBusId holds len bytes by the caller's contract.
            unsafe { put_str_truncated(pciBusId, len, &pci_bus_id(d)) }
        })
    }
}

/// Parses "[domain:]bus:device[.function]" (hex), as `cuDeviceGetByPCIBusId` accepts.
fn parse_bus_id(s: &str) -> Option<(u32, u32, u32)> {
    let (head, _function) = s.trim().split_once('.').unwrap_or((s.trim(), "0"));
    let parts: Vec<&str> = head.split(':').collect();
    let hex = |p: &str| u32::from_str_radix(p, 16).ok();
    match parts.as_slice() {
        [dom, bus, dev] => Some((hex(dom)?, hex(bus)?, hex(dev)?)),
        [bus, dev] => Some((0, hex(bus)?, hex(dev)?)),
        _ => None,
    }
}

cuda_exports! {
    fn cuDeviceGetByPCIBusId(dev, pciBusId) {
        run(|| {
            need(dev)?;
            // SAFETY: pciBusId is the caller's NUL-terminated string.
            let s = unsafe { cstr(pciBusId) }?;
            let drv = driver()?;
            let (dom, bus, device) = parse_bus_id(s).ok_or(INVALID_VALUE)?;
            let d = drv
                .devices
                .iter()
                .find(|d| d.ident.pci_domain == dom && d.ident.pci_bus == bus && d.ident.pci_device == device)
                .ok_or(INVALID_DEVICE)?;
            // SAFETY: dev is the caller's out-pointer (checked above).
            unsafe { put(dev, d.ordinal) }
        })
    }
}

/// Whether one device can map another's memory: two whole GPUs joined by NVLink, or under one
/// CPU socket on PCIe. MIG devices have no peer access.
pub(crate) fn can_access_peer(a: &Device, b: &Device) -> bool {
    if a.mig.is_some() || b.mig.is_some() || a.gpu == b.gpu {
        return false;
    }
    a.ident.nvlink_to(b.ident) || a.ident.common_ancestor(b.ident) != TopologyLevel::System
}

cuda_exports! {
    fn cuDeviceCanAccessPeer(canAccessPeer, dev, peerDev) {
        run(|| {
            need(canAccessPeer)?;
            let drv = driver()?;
            let (a, b) = (drv.device(dev)?, drv.device(peerDev)?);
            // SAFETY: canAccessPeer is the caller's out-pointer (checked above).
            unsafe { put(canAccessPeer, c_int::from(can_access_peer(a, b))) }
        })
    }

    fn cuDeviceGetP2PAttribute(value, attrib, srcDevice, dstDevice) {
        run(|| {
            need(value)?;
            let drv = driver()?;
            let (a, b) = (drv.device(srcDevice)?, drv.device(dstDevice)?);
            if a.ordinal == b.ordinal {
                return Err(INVALID_DEVICE);
            }
            let access = can_access_peer(a, b);
            let nvlink = access && a.ident.nvlink_to(b.ident);
            let v = match attrib {
                1 => c_int::from(access && !nvlink), // PERFORMANCE_RANK: 0 is the best link
                2 => c_int::from(access),            // ACCESS_SUPPORTED
                3 => c_int::from(nvlink),            // NATIVE_ATOMIC_SUPPORTED
                4 => c_int::from(access),            // CUDA_ARRAY_ACCESS_SUPPORTED
                _ => return Err(INVALID_VALUE),
            };
            // SAFETY: value is the caller's out-pointer (checked above).
            unsafe { put(value, v) }
        })
    }

    fn cuDeviceGetExecAffinitySupport(pi, type_, dev) {
        run(|| {
            need(pi)?;
            driver()?.device(dev)?;
            if type_ != 0 {
                return Err(INVALID_VALUE);
            }
            // Execution affinity (SM count) needs MPS, which is not simulated.
            // SAFETY: pi is the caller's out-pointer (checked above).
            unsafe { put(pi, 0) }
        })
    }
}

/// `CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE`: the catalog's figure (the A100's 30 of
/// 40 MiB; five eighths of L2 on Hopper, as the H200 answered).
pub(crate) fn max_persisting_l2(d: &Device) -> u64 {
    u64::from(d.model.max_persisting_l2_bytes)
}

/// The CUDA driver version (`cuDriverGetVersion`) from which a driver knows an attribute, for
/// those added since 12.0 (cuda.h of each release); a driver older than that answers
/// `CUDA_ERROR_INVALID_VALUE`, as one older than 13.0 does for 144..147 and 13.0 for 148 on.
pub(crate) fn attribute_since(attrib: c_int) -> u32 {
    match attrib {
        ..=129 => 0,
        130..=132 => 12010,
        133 | 134 => 12020,
        135 => 12050,
        136 | 137 | 139 | 140 | 143 => 12080,
        138 | 141 | 142 => 12090,
        144..=147 => 13000,
        _ => u32::MAX,
    }
}

/// The value of a `CUdevice_attribute` for a device; `None` for a value cuda.h 13.0 does not have
/// (see [`attribute_since`] for the driver versions that know each).
pub(crate) fn attribute(d: &Device, attrib: c_int) -> Option<i64> {
    let m = d.model;
    let hopper = m.cc_major >= 9;
    let b = |x: bool| i64::from(x);
    Some(match attrib {
        1 => m.limits.max_threads_per_block as i64,
        2..=4 => m.limits.max_block_dim[(attrib - 2) as usize] as i64,
        5..=7 => m.limits.max_grid_dim[(attrib - 5) as usize].min(i32::MAX as u32) as i64,
        8 => m.limits.max_shared_mem_per_block as i64,
        9 => m.limits.total_const_mem as i64,
        10 => m.limits.warp_size as i64,
        11 => i32::MAX as i64, // MAX_PITCH
        12 => m.limits.regs_per_block as i64,
        13 => m.max_sm_clock_mhz as i64 * 1000,
        14 => 512, // TEXTURE_ALIGNMENT
        15 => 1,   // GPU_OVERLAP
        16 => d.sm_count as i64,
        17 => 0, // KERNEL_EXEC_TIMEOUT
        18 => 0, // INTEGRATED
        19 => 1, // CAN_MAP_HOST_MEMORY
        20 => 0, // COMPUTE_MODE: default
        21 => 131_072,
        22 => 131_072,
        23 => 65_536,
        24..=26 => 16_384,
        27 | 28 => 32_768,
        29 => 2048,
        30 => 512, // SURFACE_ALIGNMENT
        31 => 1,   // CONCURRENT_KERNELS
        32 => 1,   // ECC_ENABLED
        33 => d.ident.pci_bus as i64,
        34 => d.ident.pci_device as i64,
        35 => 0, // TCC_DRIVER
        36 => m.max_mem_clock_mhz as i64 * 1000,
        37 => m.memory_bus_width_bits as i64,
        38 => m.l2_cache_bytes as i64,
        39 => m.limits.max_threads_per_sm as i64,
        40 => m.async_engine_count as i64,
        41 => 1, // UNIFIED_ADDRESSING
        42 => 32_768,
        43 => 2048,
        44 => 1, // CAN_TEX2D_GATHER (deprecated; the H200 answered 1)
        45 | 46 => 32_768,
        47 | 48 => 8192,
        49 => 32_768,
        50 => d.ident.pci_domain as i64,
        51 => 32, // TEXTURE_PITCH_ALIGNMENT
        52 | 53 => 32_768,
        54 => 2046,
        55 => 32_768,
        56 => 131_072,
        57 => 65_536,
        58..=60 => 16_384,
        61 => 32_768,
        62 => 2048,
        63 | 64 => 32_768,
        65 => 2048,
        66 | 67 => 32_768,
        68 => 2046,
        69 => 268_435_456,
        70 => 131_072,
        71 => 65_000,
        72 => 2_097_120,
        73 | 74 => 32_768,
        75 => m.cc_major as i64,
        76 => m.cc_minor as i64,
        77 => 32_768,
        78 => 1, // STREAM_PRIORITIES_SUPPORTED
        79 | 80 => 1,
        81 => m.limits.max_shared_mem_per_sm as i64,
        82 => m.limits.regs_per_sm as i64,
        83 => 1, // MANAGED_MEMORY
        84 => 0, // MULTI_GPU_BOARD
        85 => d.ident.index as i64,
        86 => 0, // HOST_NATIVE_ATOMIC_SUPPORTED
        87 => 2, // SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO
        88 => 0, // PAGEABLE_MEMORY_ACCESS
        89 => 1, // CONCURRENT_MANAGED_ACCESS
        90 => 1, // COMPUTE_PREEMPTION_SUPPORTED
        91 => 1, // CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
        // The *_V1 stream memory operations, gone since CUDA 12 (the H200 answered 0).
        92..=94 => 0,
        95 => 1, // COOPERATIVE_LAUNCH
        96 => 1, // COOPERATIVE_MULTI_DEVICE_LAUNCH
        97 => m.limits.max_shared_mem_per_block_optin as i64,
        98 => 0, // CAN_FLUSH_REMOTE_WRITES
        99 => 1, // HOST_REGISTER_SUPPORTED
        100 => 0,
        101 => 0,
        102 => 1, // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        103 => 1, // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        104 | 105 => 0,
        106 => m.limits.max_blocks_per_sm as i64,
        107 => 1, // GENERIC_COMPRESSION_SUPPORTED
        108 => max_persisting_l2(d) as i64,
        // MAX_ACCESS_POLICY_WINDOW_SIZE: 128 MiB less 4 KiB on the A100; 128 MiB on Hopper (H200).
        109 => {
            if hopper {
                134_217_728
            } else {
                134_213_632
            }
        }
        110 => 1,
        111 => 1024, // RESERVED_SHARED_MEMORY_PER_BLOCK
        112 => 1,    // SPARSE_CUDA_ARRAY_SUPPORTED
        113 => 1,    // READ_ONLY_HOST_REGISTER_SUPPORTED
        114 => 1,    // TIMELINE_SEMAPHORE_INTEROP_SUPPORTED
        115 => 1,    // MEMORY_POOLS_SUPPORTED
        116 => 1,    // GPU_DIRECT_RDMA_SUPPORTED
        117 => 1,    // GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS: host
        118 => 100,  // GPU_DIRECT_RDMA_WRITES_ORDERING: owner
        // MEMPOOL_SUPPORTED_HANDLE_TYPES: POSIX file descriptor, and fabric on Hopper (the H200: 9).
        119 => 1 | if hopper { 8 } else { 0 },
        120 => b(hopper), // CLUSTER_LAUNCH
        121 => 1,         // DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED
        122 | 123 => 1,
        124 => 1, // DMA_BUF_SUPPORTED
        125 => 1, // IPC_EVENT_SUPPORTED
        126 => {
            if hopper {
                4
            } else {
                1
            }
        } // MEM_SYNC_DOMAIN_COUNT
        127 => b(hopper), // TENSOR_MAP_ACCESS_SUPPORTED
        // HANDLE_TYPE_FABRIC_SUPPORTED (the H200: 1).
        128 => b(hopper),
        129 => 1,                        // UNIFIED_FUNCTION_POINTERS
        130 => 0,                        // NUMA_CONFIG: none
        131 => -1,                       // NUMA_ID
        132 => 0,                        // MULTICAST_SUPPORTED
        133 => 0,                        // MPS_ENABLED
        134 => d.ident.numa_node as i64, // HOST_NUMA_ID
        135 => 0,                        // D3D12_CIG_SUPPORTED
        136 | 137 => 0,                  // memory decompression
        138 => 0,                        // VULKAN_CIG_SUPPORTED
        139 => m.pci_device_id as i64,
        140 => m.pci_subsystem_id as i64,
        // HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, HOST_NUMA_MEMORY_POOLS_SUPPORTED.
        141 | 142 => 1,
        143 => 0, // HOST_NUMA_MULTINODE_IPC_SUPPORTED
        // HOST_MEMORY_POOLS_SUPPORTED, HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED.
        144 | 145 => 1,
        146 => 0, // HOST_ALLOC_DMA_BUF_SUPPORTED
        147 => 0, // ONLY_PARTIAL_HOST_NATIVE_ATOMIC_SUPPORTED
        _ => return None,
    })
}

cuda_exports! {
    fn cuDeviceGetAttribute(pi, attrib, dev) {
        run(|| {
            need(pi)?;
            let drv = driver()?;
            let d = drv.device(dev)?;
            if drv.node.description().cuda_driver_version < attribute_since(attrib) {
                return Err(INVALID_VALUE);
            }
            let v = attribute(d, attrib).ok_or(INVALID_VALUE)?;
            // The PCI ids are unsigned 32-bit values carried in an int.
            // SAFETY: pi is the caller's out-pointer (checked above).
            unsafe { put(pi, v as u32 as c_int) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_parse_in_every_form() {
        assert_eq!(parse_bus_id("0000:18:00.0"), Some((0, 0x18, 0)));
        assert_eq!(parse_bus_id("00000000:DB:00.0"), Some((0, 0xdb, 0)));
        assert_eq!(parse_bus_id("18:00"), Some((0, 0x18, 0)));
        assert_eq!(parse_bus_id("zz"), None);
    }

    #[test]
    fn newer_attributes_need_a_newer_driver() {
        // cuda.h 12.8 ends at 143 without 138, 141, 142 (added by 12.9); 13.0 adds 144..147.
        assert_eq!(attribute_since(1), 0);
        assert_eq!(attribute_since(143), 12080);
        for a in [138, 141, 142] {
            assert_eq!(attribute_since(a), 12090, "{a}");
        }
        for a in 144..=147 {
            assert_eq!(attribute_since(a), 13000, "{a}");
        }
        assert_eq!(attribute_since(148), u32::MAX);
    }
}
