//! Occupancy queries (`cuOccupancy*`), answered from the device's limits as the occupancy
//! calculator does: blocks per SM are bounded by the SM's block slots, its threads (in whole
//! warps) and its shared memory (each block also takes the 1 KiB the driver reserves per block
//! since compute capability 8.0). Functions use 32 registers and no static shared memory on the
//! sim (`cuFuncGetAttribute`), so registers never bind before threads.

use std::ffi::{c_int, c_uint};

use tessera_abi::cuda_exports;

use super::init::{Device, driver};
use super::module::check_function;
use super::{CUresult, INVALID_VALUE, NOT_SUPPORTED, R, get, need, put, run, sys};

/// `CU_OCCUPANCY_DEFAULT`, `CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE`.
const FLAGS_MASK: c_uint = 1;
/// Shared memory the driver keeps per block (compute capability 8.0 and later).
const RESERVED_SMEM_PER_BLOCK: u64 = 1024;

/// The device limits occupancy depends on.
struct Limits {
    max_threads_per_block: u64,
    max_threads_per_sm: u64,
    max_blocks_per_sm: u64,
    smem_per_sm: u64,
    smem_per_block_max: u64,
    reserved_per_block: u64,
    sm_count: u64,
    cc_major: u32,
}

fn limits(d: &Device) -> Limits {
    let a = |attr| super::device::attribute(d, attr).unwrap_or(0).max(0) as u64;
    Limits {
        max_threads_per_block: a(1),
        max_threads_per_sm: a(39),
        max_blocks_per_sm: a(106),
        smem_per_sm: a(81),
        smem_per_block_max: a(97),
        reserved_per_block: if d.model.cc_major >= 8 { RESERVED_SMEM_PER_BLOCK } else { 0 },
        sm_count: d.sm_count as u64,
        cc_major: d.model.cc_major,
    }
}

/// Blocks of `block` threads using `smem` bytes of dynamic shared memory that fit on one SM.
fn blocks_per_sm(l: &Limits, block: u64, smem: u64) -> u64 {
    if block == 0 || block > l.max_threads_per_block || smem > l.smem_per_block_max {
        return 0;
    }
    let by_threads = l.max_threads_per_sm / block.div_ceil(32) / 32;
    let by_smem = l.smem_per_sm / (smem + l.reserved_per_block).max(1);
    l.max_blocks_per_sm.min(by_threads).min(by_smem)
}

/// The device a function's queries are answered for: the current context's.
fn device_of(f: sys::CUfunction) -> R<&'static Device> {
    check_function(f as usize)?;
    let ctx = super::context::current()?;
    Ok(ctx.dev)
}

fn check_flags(flags: c_uint) -> R {
    if flags & !FLAGS_MASK != 0 { Err(INVALID_VALUE) } else { Ok(()) }
}

fn max_active_blocks(num: *mut c_int, f: sys::CUfunction, block: c_int, smem: usize, flags: c_uint) -> R {
    need(num)?;
    driver()?;
    check_flags(flags)?;
    let d = device_of(f)?;
    let n = blocks_per_sm(&limits(d), block.max(0) as u64, smem as u64);
    // SAFETY: num is the caller's out-pointer (checked above).
    unsafe { put(num, n as c_int) }
}

cuda_exports! {
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(numBlocks, func, blockSize, dynamicSMemSize) {
        // SAFETY: the same contract, with no flags.
        unsafe { cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(numBlocks, func, blockSize, dynamicSMemSize, 0) }
    }

    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(numBlocks, func, blockSize, dynamicSMemSize, flags) {
        run(|| max_active_blocks(numBlocks, func, blockSize, dynamicSMemSize, flags))
    }
}

/// The caller's dynamic-shared-memory function of the block size (`CUoccupancyB2DSize`).
type B2DSize = Option<unsafe extern "C" fn(c_int) -> usize>;

fn potential_block_size(
    min_grid: *mut c_int,
    block_out: *mut c_int,
    f: sys::CUfunction,
    b2d: B2DSize,
    smem: usize,
    limit: c_int,
    flags: c_uint,
) -> R {
    need(min_grid)?;
    need(block_out)?;
    driver()?;
    check_flags(flags)?;
    let l = limits(device_of(f)?);
    let max = match limit {
        0 => l.max_threads_per_block,
        n if n > 0 => (n as u64).min(l.max_threads_per_block),
        _ => return Err(INVALID_VALUE),
    };
    // The largest block that keeps the most threads resident (ties go to the larger block).
    let mut best = (0u64, 0u64, 0u64);
    let mut block = max.next_multiple_of(32).min(l.max_threads_per_block);
    while block > 0 {
        let size = block.min(max);
        let dynamic = match b2d {
            // SAFETY: the caller's callback, called with a block size as its contract says.
            Some(cb) => (unsafe { cb(size as c_int) }) as u64,
            None => smem as u64,
        };
        let blocks = blocks_per_sm(&l, size, dynamic);
        if blocks * size > best.0 * best.1 {
            best = (blocks, size, dynamic);
        }
        block = block.saturating_sub(32);
    }
    // SAFETY: both are the caller's out-pointers (checked above).
    unsafe {
        put(min_grid, (best.0 * l.sm_count) as c_int)?;
        put(block_out, best.1 as c_int)
    }
}

cuda_exports! {
    fn cuOccupancyMaxPotentialBlockSize(minGridSize, blockSize, func, blockSizeToDynamicSMemSize, dynamicSMemSize, blockSizeLimit) {
        // SAFETY: the same contract, with no flags.
        unsafe {
            cuOccupancyMaxPotentialBlockSizeWithFlags(
                minGridSize,
                blockSize,
                func,
                blockSizeToDynamicSMemSize,
                dynamicSMemSize,
                blockSizeLimit,
                0,
            )
        }
    }

    fn cuOccupancyMaxPotentialBlockSizeWithFlags(minGridSize, blockSize, func, blockSizeToDynamicSMemSize, dynamicSMemSize, blockSizeLimit, flags) {
        run(|| {
            potential_block_size(
                minGridSize,
                blockSize,
                func,
                blockSizeToDynamicSMemSize,
                dynamicSMemSize,
                blockSizeLimit,
                flags,
            )
        })
    }

    /// `cuOccupancyAvailableDynamicSMemPerBlock`: the dynamic shared memory each of `numBlocks`
    /// blocks can have with all of them resident on one SM.
    fn cuOccupancyAvailableDynamicSMemPerBlock(dynamicSmemSize, func, numBlocks, blockSize) {
        run(|| {
            need(dynamicSmemSize)?;
            driver()?;
            let l = limits(device_of(func)?);
            if numBlocks <= 0 || blockSize <= 0 {
                return Err(INVALID_VALUE);
            }
            let fits = blocks_per_sm(&l, blockSize as u64, 0) >= numBlocks as u64;
            let each = if fits {
                (l.smem_per_sm / numBlocks as u64).saturating_sub(l.reserved_per_block).min(l.smem_per_block_max)
            } else {
                0
            };
            // SAFETY: the caller's out-pointer (checked above).
            unsafe { put(dynamicSmemSize, each as usize) }
        })
    }
}

/// `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`.
const LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: u32 = 4;
/// The largest cluster every cluster-capable GPU runs (`cudaOccupancyMaxPotentialClusterSize`'s
/// portable limit), and the largest a Hopper GPC runs with a non-portable size allowed.
const PORTABLE_CLUSTER: u64 = 8;
const NON_PORTABLE_CLUSTER: u64 = 16;
/// TPCs (texture processing clusters, two SMs each) one GPC holds at most: 9 on Hopper
/// (GH100), 8 on Ampere (GA100).
fn tpcs_per_gpc(cc_major: u32) -> u32 {
    if cc_major >= 9 { 9 } else { 8 }
}

/// The GPC (graphics processing cluster) of each TPC of a device with `sm_count` SMs: as many
/// GPCs as its TPCs fill (8 on an H100 or H200, 7 on an A100, fewer in a small MIG compute
/// instance), the TPCs numbered across them in turn, so GPCs differ by one TPC at most. A
/// thread-block cluster runs inside one GPC; the driver hands this map out in a private table
/// ([`super::export_tables`]) and answers the cluster occupancy queries from it.
pub(crate) fn tpc_gpcs(sm_count: u32, cc_major: u32) -> Vec<u8> {
    let tpcs = sm_count.div_ceil(2);
    let gpcs = tpcs.div_ceil(tpcs_per_gpc(cc_major)).clamp(1, u32::from(u8::MAX));
    (0..tpcs).map(|t| (t % gpcs) as u8).collect()
}

/// The SMs of each GPC (a device with an odd SM count has one TPC of one SM, its last).
fn gpc_sms(l: &Limits) -> Vec<u64> {
    let map = tpc_gpcs(l.sm_count.min(u64::from(u32::MAX)) as u32, l.cc_major);
    let mut sms = vec![0; map.iter().map(|&g| usize::from(g) + 1).max().unwrap_or(0)];
    for (t, &g) in map.iter().enumerate() {
        sms[usize::from(g)] += (l.sm_count - 2 * t as u64).min(2);
    }
    sms
}

/// What a cluster query is about: the cluster's blocks, and the blocks one SM holds.
struct ClusterQuery {
    limits: Limits,
    /// Blocks per cluster (`None`: neither the configuration nor the function sets it).
    size: Option<u64>,
    non_portable: bool,
    blocks_per_sm: u64,
}

/// Reads a cluster query's launch configuration and function.
///
/// # Safety
/// `config` must be null or point to a `CUlaunchConfig` whose `attrs` hold `numAttrs` entries.
unsafe fn cluster_query(f: sys::CUfunction, config: *const sys::CUlaunchConfig) -> R<ClusterQuery> {
    driver()?;
    let d = device_of(f)?;
    if d.model.cc_major < 9 {
        // No thread-block clusters before Hopper (CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH is 0).
        return Err(NOT_SUPPORTED);
    }
    // SAFETY: as this function's contract (null/misaligned checked by get).
    let c = unsafe { get(config) }?;
    let mut dims = None;
    let visit = |id, value: *const u8| {
        if id == LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION {
            // SAFETY: the cluster dimension is three unsigned ints at the start of the union.
            dims = Some(unsafe { value.cast::<[u32; 3]>().read_unaligned() });
        }
    };
    // SAFETY: the caller's configuration (cuda.h's contract).
    unsafe { super::launch::for_each_attribute(&c, visit) }?;
    let (required, non_portable) = super::module::cluster_attributes(f as usize)?;
    let product = |d: [u32; 3]| d.iter().map(|&x| u64::from(x.max(1))).product::<u64>();
    let size = match (dims, required.iter().any(|&x| x > 0)) {
        // A required size and a configured one must agree.
        (Some(d), true) if d != required => return Err(CUresult::CUDA_ERROR_INVALID_CLUSTER_SIZE),
        (Some(d), _) => Some(product(d)),
        (None, true) => Some(product(required)),
        (None, false) => None,
    };
    let limits = limits(d);
    let block = u64::from(c.blockDimX) * u64::from(c.blockDimY) * u64::from(c.blockDimZ);
    let blocks_per_sm = blocks_per_sm(&limits, block, u64::from(c.sharedMemBytes));
    Ok(ClusterQuery { limits, size, non_portable, blocks_per_sm })
}

/// The SMs of the smallest GPC.
fn smallest_gpc(l: &Limits) -> u64 {
    gpc_sms(l).into_iter().min().unwrap_or(0)
}

/// Clusters of `size` blocks resident at once on the device: each GPC holds whole clusters.
fn active_clusters(l: &Limits, blocks_per_sm: u64, size: u64) -> u64 {
    gpc_sms(l).into_iter().map(|sms| blocks_per_sm * sms / size.max(1)).sum()
}

cuda_exports! {
    /// `cuOccupancyMaxActiveClusters`: how many clusters of the configured (or the function's
    /// required) size can be resident at once; 0 when a cluster does not fit in a GPC.
    fn cuOccupancyMaxActiveClusters(numClusters, func, config) {
        run(|| {
            need(numClusters)?;
            // SAFETY: the caller's configuration, per the API contract.
            let q = unsafe { cluster_query(func, config) }?;
            let size = q.size.ok_or(CUresult::CUDA_ERROR_INVALID_CLUSTER_SIZE)?;
            let max = if q.non_portable { NON_PORTABLE_CLUSTER } else { PORTABLE_CLUSTER };
            if size > max {
                return Err(CUresult::CUDA_ERROR_INVALID_CLUSTER_SIZE);
            }
            let n = active_clusters(&q.limits, q.blocks_per_sm, size);
            // SAFETY: the caller's out-pointer (checked above).
            unsafe { put(numClusters, n.min(c_int::MAX as u64) as c_int) }
        })
    }

    /// `cuOccupancyMaxPotentialClusterSize`: the largest cluster that fits in a GPC with the
    /// configuration's blocks (8 portable, 16 with a non-portable size allowed).
    fn cuOccupancyMaxPotentialClusterSize(clusterSize, func, config) {
        run(|| {
            need(clusterSize)?;
            // SAFETY: the caller's configuration, per the API contract.
            let q = unsafe { cluster_query(func, config) }?;
            let max = if q.non_portable { NON_PORTABLE_CLUSTER } else { PORTABLE_CLUSTER };
            let n = (q.blocks_per_sm * smallest_gpc(&q.limits)).min(max);
            // SAFETY: the caller's out-pointer (checked above).
            unsafe { put(clusterSize, n as c_int) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H100 SXM5's limits.
    fn h100() -> Limits {
        Limits {
            max_threads_per_block: 1024,
            max_threads_per_sm: 2048,
            max_blocks_per_sm: 32,
            smem_per_sm: 233_472,
            smem_per_block_max: 232_448,
            reserved_per_block: 1024,
            sm_count: 132,
            cc_major: 9,
        }
    }

    #[test]
    fn blocks_are_bounded_by_slots_threads_and_shared_memory() {
        let l = h100();
        assert_eq!(blocks_per_sm(&l, 32, 0), 32, "block slots");
        assert_eq!(blocks_per_sm(&l, 256, 0), 8, "threads");
        assert_eq!(blocks_per_sm(&l, 1024, 0), 2);
        assert_eq!(blocks_per_sm(&l, 100, 0), 16, "whole warps");
        assert_eq!(blocks_per_sm(&l, 128, 48 * 1024), 4, "shared memory with the reserved KiB");
        assert_eq!(blocks_per_sm(&l, 1025, 0), 0, "too large a block");
        assert_eq!(blocks_per_sm(&l, 128, 300_000), 0, "too much shared memory");
        assert_eq!(blocks_per_sm(&l, 0, 0), 0);
    }

    #[test]
    fn clusters_fill_whole_gpcs() {
        let l = h100();
        // 66 TPCs (132 SMs) over 8 GPCs: two of 9 TPCs (18 SMs) and six of 8 (16 SMs).
        assert_eq!(gpc_sms(&l), [18, 18, 16, 16, 16, 16, 16, 16]);
        assert_eq!(active_clusters(&l, 1, 1), 132, "one block per SM, clusters of one");
        assert_eq!(active_clusters(&l, 1, 2), 66, "a pair per TPC");
        assert_eq!(active_clusters(&l, 1, 4), 2 * 4 + 6 * 4, "18 SMs hold 4 clusters of 4, as 16 do");
        assert_eq!(active_clusters(&l, 2, 8), 8 * 4);
        assert_eq!(active_clusters(&l, 1, 16), 8, "one cluster of 16 per GPC");
        assert_eq!(active_clusters(&l, 0, 8), 0, "blocks that do not fit anywhere");
        assert_eq!(smallest_gpc(&l), 16);
    }

    #[test]
    fn tpcs_spread_over_the_gpcs_a_board_has() {
        let gh100 = tpc_gpcs(132, 9);
        assert_eq!(gh100.len(), 66, "a TPC is two SMs");
        assert_eq!(gh100[..10], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1], "numbered across the GPCs in turn");
        assert_eq!(*gh100.iter().max().unwrap(), 7, "GH100: 8 GPCs");
        let a100 = tpc_gpcs(108, 8);
        assert_eq!((a100.len(), *a100.iter().max().unwrap()), (54, 6), "GA100: 7 GPCs of at most 8 TPCs");
        assert_eq!(tpc_gpcs(16, 9), [0; 8], "a 1g MIG instance's 16 SMs fill one GPC");
        assert_eq!(tpc_gpcs(1, 9), [0], "one SM is one (partial) TPC");
        assert!(tpc_gpcs(0, 9).is_empty());
        let odd = Limits { sm_count: 15, cc_major: 8, ..h100() };
        assert_eq!(gpc_sms(&odd), [15], "an odd SM count: the last TPC has one SM");
    }
}
