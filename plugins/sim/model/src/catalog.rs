//! Built-in GPU models: real figures, real MIG tables.
//!
//! The simulator answers NVML and CUDA queries from these tables, so a tool pointed at it sees
//! what it would see on the real board: the product name and memory `nvidia-smi` shows, the CUDA
//! device attributes `deviceQuery` prints, and the MIG profiles `nvidia-smi mig -lgip` lists with
//! their ids, sizes, engine counts and placements. Every figure was read off a real device's
//! output or NVIDIA's documentation; the few that could not be are marked "derived", with how.
//!
//! MIG memory sizes are what the driver reports per profile (`memorySizeMB`; the GiB column of
//! `-lgip` times 1024), not the number in the profile name. Placements are in memory slices (the
//! unit of `nvmlGpuInstancePlacement_t`); compute-instance placements are in the GPU instance's
//! compute slices (the unit of `nvmlComputeInstancePlacement_t`).

/// One mebibyte; NVML reports MIG and board memory in MiB.
const MIB: u64 = 1 << 20;

/// `NVML_DEVICE_ARCH_AMPERE` (nvml.h).
pub const NVML_DEVICE_ARCH_AMPERE: u32 = 7;
/// `NVML_DEVICE_ARCH_HOPPER` (nvml.h).
pub const NVML_DEVICE_ARCH_HOPPER: u32 = 9;
/// `NVML_BRAND_NVIDIA` (nvml.h); `nvidia-smi -q` shows "Product Brand : NVIDIA" on all three boards.
pub const NVML_BRAND_NVIDIA: u32 = 14;

/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE` (nvml.h): the plain 1g profile.
pub const NVML_GPU_INSTANCE_PROFILE_1_SLICE: u32 = 0x0;
/// `NVML_GPU_INSTANCE_PROFILE_2_SLICE` (nvml.h).
pub const NVML_GPU_INSTANCE_PROFILE_2_SLICE: u32 = 0x1;
/// `NVML_GPU_INSTANCE_PROFILE_3_SLICE` (nvml.h).
pub const NVML_GPU_INSTANCE_PROFILE_3_SLICE: u32 = 0x2;
/// `NVML_GPU_INSTANCE_PROFILE_4_SLICE` (nvml.h).
pub const NVML_GPU_INSTANCE_PROFILE_4_SLICE: u32 = 0x3;
/// `NVML_GPU_INSTANCE_PROFILE_7_SLICE` (nvml.h).
pub const NVML_GPU_INSTANCE_PROFILE_7_SLICE: u32 = 0x4;
/// `NVML_GPU_INSTANCE_PROFILE_8_SLICE` (nvml.h); no built-in model offers it.
pub const NVML_GPU_INSTANCE_PROFILE_8_SLICE: u32 = 0x5;
/// `NVML_GPU_INSTANCE_PROFILE_6_SLICE` (nvml.h); no built-in model offers it.
pub const NVML_GPU_INSTANCE_PROFILE_6_SLICE: u32 = 0x6;
/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1` (nvml.h): 1g with media extensions, the "+me" profile.
pub const NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: u32 = 0x7;
/// `NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1` (nvml.h); no built-in model offers it.
pub const NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: u32 = 0x8;
/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2` (nvml.h): 1g with twice the memory (1g.20gb on H100).
pub const NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: u32 = 0x9;
/// `NVML_GPU_INSTANCE_PROFILE_CAPS_P2P` (nvml.h): the v3 `capabilities` bit for peer-to-peer.
pub const NVML_GPU_INSTANCE_PROFILE_CAPS_P2P: u32 = 0x1;

/// `NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE` (nvml.h); also the id `nvidia-smi mig -lcip` prints.
pub const NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: u32 = 0x0;
/// `NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE` (nvml.h).
pub const NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: u32 = 0x1;
/// `NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE` (nvml.h).
pub const NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: u32 = 0x2;
/// `NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE` (nvml.h).
pub const NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE: u32 = 0x3;
/// `NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE` (nvml.h).
pub const NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: u32 = 0x4;

/// A GPU product: what NVML and CUDA report for the whole board, and its MIG tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuModel {
    /// Catalog key used in node descriptions, e.g. "H100-SXM5-80GB".
    pub key: &'static str,
    /// Product name exactly as `nvmlDeviceGetName` / nvidia-smi return it.
    pub name: &'static str,
    /// `nvmlMemory_t.total`: what nvidia-smi shows as "Total" FB memory.
    pub memory_bytes: u64,
    /// `nvmlMemory_v2_t.reserved`: FB the driver and firmware keep ("Reserved" in `nvidia-smi -q`),
    /// what `nvmlMemory_t.used` shows on an idle board.
    pub reserved_bytes: u64,
    /// `cuDeviceTotalMem`: the memory CUDA reports, less than NVML's total.
    pub cuda_total_mem_bytes: u64,
    /// Streaming multiprocessors (`CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`).
    pub sm_count: u32,
    /// CUDA cores per SM (`nvmlDeviceGetNumGpuCores` is `sm_count` times this).
    pub cores_per_sm: u32,
    /// `nvmlDeviceGetVbiosVersion`.
    pub vbios_version: &'static str,
    /// `nvmlDeviceGetInforomImageVersion` (nvidia-smi's `inforom.img`).
    pub inforom_image: &'static str,
    /// CUDA compute capability, major.
    pub cc_major: u32,
    /// CUDA compute capability, minor.
    pub cc_minor: u32,
    /// `NVML_DEVICE_ARCH_*` value.
    pub architecture: u32,
    /// `NVML_BRAND_*` value.
    pub brand: u32,
    /// `nvmlPciInfo_t.pciDeviceId`: `(device << 16) | 0x10de`.
    pub pci_device_id: u32,
    /// `nvmlPciInfo_t.pciSubSystemId`: `(subsystem << 16) | subsystem vendor`.
    pub pci_subsystem_id: u32,
    /// Highest PCIe generation the board links at.
    pub pcie_max_gen: u32,
    /// Widest PCIe link, in lanes.
    pub pcie_max_width: u32,
    /// Default (and maximum) power limit, in milliwatts.
    pub power_limit_mw: u32,
    /// Lowest power limit `nvidia-smi -pl` accepts, in milliwatts.
    pub min_power_limit_mw: u32,
    /// Power draw of an idle board in P0, in milliwatts (what a fresh simulated GPU reports).
    pub idle_power_mw: u32,
    /// Die temperature of an idle board, degrees C.
    pub idle_temp_c: u32,
    /// Maximum SM (and graphics) clock, MHz; also `CU_DEVICE_ATTRIBUTE_CLOCK_RATE` / 1000.
    pub max_sm_clock_mhz: u32,
    /// Maximum memory clock, MHz; also `CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE` / 1000.
    pub max_mem_clock_mhz: u32,
    /// Maximum video clock, MHz.
    pub max_video_clock_mhz: u32,
    /// Default applications clock for graphics/SM, MHz.
    pub default_app_sm_clock_mhz: u32,
    /// Memory bus width in bits (`CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH`).
    pub memory_bus_width_bits: u32,
    /// L2 cache in bytes (`CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE`).
    pub l2_cache_bytes: u32,
    /// L2 that may be set aside for persisting accesses (`CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE`).
    pub max_persisting_l2_bytes: u32,
    /// BAR1 aperture in bytes (`nvmlBAR1Memory_t.bar1Total`).
    pub bar1_bytes: u64,
    /// BAR1 the driver maps on an idle board (`nvmlBAR1Memory_t.bar1Used` with no process).
    pub idle_bar1_used_bytes: u64,
    /// NVLink links on the board.
    pub nvlink_count: u32,
    /// What CUDA allows on the board's compute capability.
    pub limits: CudaLimits,
    /// `CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT` (deviceQuery's "copy engine(s)").
    pub async_engine_count: u32,
    /// `NVML_TEMPERATURE_THRESHOLD_SLOWDOWN`, degrees C.
    pub slowdown_temp_c: u32,
    /// `NVML_TEMPERATURE_THRESHOLD_SHUTDOWN`, degrees C.
    pub shutdown_temp_c: u32,
    /// `NVML_TEMPERATURE_THRESHOLD_GPU_MAX`, degrees C.
    pub max_operating_temp_c: u32,
    /// `NVML_TEMPERATURE_THRESHOLD_MEM_MAX`, degrees C.
    pub mem_max_operating_temp_c: u32,
    /// MIG tables; `None` for a board without MIG.
    pub mig: Option<MigSpec>,
}

/// What CUDA allows per compute capability: the CUDA C++ Programming Guide's "Technical
/// Specifications per Compute Capability", as deviceQuery reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaLimits {
    /// `CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK`.
    pub max_threads_per_block: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR`.
    pub max_threads_per_sm: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR`.
    pub max_blocks_per_sm: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_{X,Y,Z}`.
    pub max_block_dim: [u32; 3],
    /// `CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_{X,Y,Z}`.
    pub max_grid_dim: [u32; 3],
    /// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK`, bytes (static limit).
    pub max_shared_mem_per_block: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`, bytes.
    pub max_shared_mem_per_block_optin: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR`, bytes.
    pub max_shared_mem_per_sm: u32,
    /// `CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY`, bytes.
    pub total_const_mem: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK` (32-bit registers).
    pub regs_per_block: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR`.
    pub regs_per_sm: u32,
    /// Registers one thread may use at most.
    pub max_regs_per_thread: u32,
    /// `CU_DEVICE_ATTRIBUTE_WARP_SIZE`.
    pub warp_size: u32,
}

/// How a MIG-capable board partitions: its slice counts and the profiles the driver offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigSpec {
    /// Compute slices (GPCs usable by MIG); a 7g instance takes them all.
    pub compute_slices: u32,
    /// Memory slices; GPU-instance placements index these.
    pub memory_slices: u32,
    /// GPU-instance profiles, in `nvidia-smi mig -lgip` order.
    pub gi_profiles: &'static [GiProfile],
    /// Compute-instance profiles and where each fits inside a GPU instance.
    pub ci_profiles: &'static [CiProfile],
}

/// One GPU-instance profile: a row of `nvidia-smi mig -lgip` plus its `-lgipp` placements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiProfile {
    /// `NVML_GPU_INSTANCE_PROFILE_*`, what `nvmlDeviceGetGpuInstanceProfileInfo` takes.
    pub nvml_profile: u32,
    /// Profile id as the driver reports it (`info.id`; what `-cgi` and `nvmlDeviceCreateGpuInstance` take).
    pub id: u32,
    /// Short name, e.g. "1g.10gb" (nvidia-smi prints it as "MIG 1g.10gb").
    pub name: &'static str,
    /// Compute slices (`sliceCount`).
    pub slice_count: u32,
    /// Instances of this profile an empty GPU can hold (`instanceCount`).
    pub instance_count: u32,
    /// SMs of one instance (`multiprocessorCount`).
    pub sm_count: u32,
    /// Memory of one instance in MiB (`memorySizeMB`).
    pub memory_mib: u64,
    /// Copy engines (`copyEngineCount`).
    pub copy_engines: u32,
    /// Video decoders (`decoderCount`).
    pub decoders: u32,
    /// Video encoders (`encoderCount`).
    pub encoders: u32,
    /// JPEG engines (`jpegCount`).
    pub jpegs: u32,
    /// Optical-flow accelerators (`ofaCount`).
    pub ofas: u32,
    /// `isP2pSupported` (and `NVML_GPU_INSTANCE_PROFILE_CAPS_P2P` in v3); `-lgip` prints "P2P No".
    pub p2p_supported: bool,
    /// The instance takes engines the GPU has only one of (the "+me" profile), so at most one exists.
    pub media_exclusive: bool,
    /// Memory slices one instance occupies (the placement "size").
    pub placement_size: u32,
    /// Memory slices an instance may start at (the placement "start"s).
    pub placements: &'static [u32],
}

/// One compute-instance profile ("1c", "2c", ...), valid in some GPU-instance sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CiProfile {
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*`; the driver reports the same number as the profile id.
    pub nvml_profile: u32,
    /// Short prefix, e.g. "2c" (the instance is named "2c.3g.40gb", or "3g.40gb" when it spans the GI).
    pub name: &'static str,
    /// Compute slices (`sliceCount`), and the placement size in the GI's compute slices.
    pub slice_count: u32,
    /// SMs per compute slice when the CI is smaller than its GI (see [`CiProfile::sm_count_in`]).
    pub sm_per_slice: u32,
    /// Where this profile fits: per GPU-instance size, the compute slices it may start at.
    pub placements: &'static [CiPlacement],
}

/// The starts (`nvidia-smi mig -lcipp`) of a compute-instance profile inside GIs of one size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CiPlacement {
    /// Compute slices of the GPU instance this row applies to.
    pub gi_slice_count: u32,
    /// Compute slices within that GPU instance a CI may start at.
    pub starts: &'static [u32],
}

impl GpuModel {
    /// `nvmlDeviceGetNumGpuCores`: CUDA cores of the whole board.
    pub fn cuda_cores(&self) -> u32 {
        self.sm_count * self.cores_per_sm
    }

    /// Die temperature under `load` percent: the idle temperature, rising linearly to 20 C under
    /// the max operating point (derived).
    pub fn temperature_c(&self, load: u32) -> u32 {
        let load = load.min(100);
        let hot = self.max_operating_temp_c.saturating_sub(20).max(self.idle_temp_c);
        self.idle_temp_c + (hot - self.idle_temp_c) * load / 100
    }

    /// Power draw under `load` percent, in milliwatts: the idle draw, rising linearly to 90% of
    /// the limit at full load (derived).
    pub fn power_draw_mw(&self, load: u32) -> u32 {
        let load = load.min(100);
        let full = self.power_limit_mw / 10 * 9;
        let idle = self.idle_power_mw.min(full);
        idle + (full - idle) * load / 100
    }

    /// (SM, video) clocks of a board with nothing running, MHz, from idle `nvidia-smi -q`
    /// captures: Hopper (H100 SXM5, H200 on 580.173.02) "SM 345 MHz, Video 765 MHz"; A100 SXM4
    /// "SM 210 MHz, Video 585 MHz" (derived for other architectures: a fifth of the maximum SM
    /// clock, half the maximum video clock).
    pub fn idle_clocks_mhz(&self) -> (u32, u32) {
        match self.architecture {
            NVML_DEVICE_ARCH_HOPPER => (345, 765),
            NVML_DEVICE_ARCH_AMPERE => (210, 585),
            _ => (self.max_sm_clock_mhz / 5, self.max_video_clock_mhz / 2),
        }
    }

    /// The GPU-instance profile for an `NVML_GPU_INSTANCE_PROFILE_*` value.
    pub fn gi_profile(&self, nvml_profile: u32) -> Option<&GiProfile> {
        self.mig.as_ref()?.gi_profiles.iter().find(|p| p.nvml_profile == nvml_profile)
    }

    /// The GPU-instance profile with a driver profile id (19, 20, 15, 14, 9, 5, 0).
    pub fn gi_profile_by_id(&self, id: u32) -> Option<&GiProfile> {
        self.mig.as_ref()?.gi_profiles.iter().find(|p| p.id == id)
    }

    /// The GPU-instance profile by name, case-insensitive, with or without "MIG ": "1g.10gb+me".
    pub fn gi_profile_by_name(&self, name: &str) -> Option<&GiProfile> {
        let name = name.trim();
        let short = match name.get(..4) {
            Some(prefix) if prefix.eq_ignore_ascii_case("mig ") => name[4..].trim_start(),
            _ => name,
        };
        self.mig.as_ref()?.gi_profiles.iter().find(|p| p.name.eq_ignore_ascii_case(short))
    }

    /// CI profiles valid inside a GI of `gi.slice_count` slices, each with how many fit in an empty
    /// GI and the compute slices one may start at (`-lcip` / `-lcipp`); SMs via [`CiProfile::sm_count_in`].
    pub fn ci_profiles_for(&self, gi: &GiProfile) -> Vec<(&CiProfile, u32, Vec<u32>)> {
        let Some(mig) = self.mig.as_ref() else { return Vec::new() };
        mig.ci_profiles
            .iter()
            .filter_map(|ci| {
                let starts = ci.starts_in(gi)?;
                Some((ci, max_disjoint(starts, ci.slice_count), starts.to_vec()))
            })
            .collect()
    }

    /// The CI profile for an `NVML_COMPUTE_INSTANCE_PROFILE_*` value, if it fits in `gi`.
    pub fn ci_profile_for(&self, gi: &GiProfile, nvml_profile: u32) -> Option<&CiProfile> {
        let mig = self.mig.as_ref()?;
        mig.ci_profiles.iter().find(|ci| ci.nvml_profile == nvml_profile && ci.starts_in(gi).is_some())
    }
}

impl GiProfile {
    /// Memory of one instance in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * MIB
    }

    /// The name as nvidia-smi prints it ("MIG 1g.10gb").
    pub fn smi_name(&self) -> String {
        format!("MIG {}", self.name)
    }
}

impl CiProfile {
    /// Compute slices this profile may start at inside `gi`; `None` if it does not fit there.
    pub fn starts_in(&self, gi: &GiProfile) -> Option<&'static [u32]> {
        self.placements.iter().find(|p| p.gi_slice_count == gi.slice_count).map(|p| p.starts)
    }

    /// SMs of one instance inside `gi`: a CI spanning the GI gets all the GI's SMs (which on
    /// Hopper exceed 16 per slice, e.g. 60 for 3g), a smaller one `sm_per_slice` per slice.
    pub fn sm_count_in(&self, gi: &GiProfile) -> u32 {
        if self.slice_count >= gi.slice_count { gi.sm_count } else { self.slice_count * self.sm_per_slice }
    }

    /// Whether this is the GI's default CI (the one spanning it; `-lcip` marks it with '*').
    pub fn is_default_in(&self, gi: &GiProfile) -> bool {
        self.slice_count == gi.slice_count
    }

    /// The instance's profile name inside `gi`: "1c.3g.40gb", or "3g.40gb" when it spans the GI.
    pub fn name_in(&self, gi: &GiProfile) -> String {
        if self.is_default_in(gi) { gi.name.to_string() } else { format!("{}.{}", self.name, gi.name) }
    }
}

/// All built-in models.
pub fn builtin_models() -> &'static [GpuModel] {
    &MODELS
}

/// The built-in model with this key (case-insensitive), e.g. "h100-sxm5-80gb".
pub fn model(key: &str) -> Option<&'static GpuModel> {
    let key = key.trim();
    MODELS.iter().find(|m| m.key.eq_ignore_ascii_case(key))
}

/// Most instances of `size` slices that fit at `starts` without overlapping (greedy by start,
/// exact for equal-sized intervals).
fn max_disjoint(starts: &[u32], size: u32) -> u32 {
    let mut sorted = starts.to_vec();
    sorted.sort_unstable();
    let mut count = 0;
    let mut free_from = 0;
    for s in sorted {
        if s >= free_from {
            count += 1;
            free_from = s + size;
        }
    }
    count
}

/// One `-lgip` row; engines are `[CE, DEC, ENC, JPEG, OFA]`, as the two `-lgip` lines give them.
#[allow(clippy::too_many_arguments)]
const fn gi(
    nvml_profile: u32,
    id: u32,
    name: &'static str,
    slice_count: u32,
    instance_count: u32,
    sm_count: u32,
    memory_mib: u64,
    [copy_engines, decoders, encoders, jpegs, ofas]: [u32; 5],
    placement_size: u32,
    placements: &'static [u32],
) -> GiProfile {
    GiProfile {
        nvml_profile,
        id,
        name,
        slice_count,
        instance_count,
        sm_count,
        memory_mib,
        copy_engines,
        decoders,
        encoders,
        jpegs,
        ofas,
        // Every A100/H100/H200 `-lgip` row reads "P2P No".
        p2p_supported: false,
        // "A single 1g profile can include media extensions" (MIG user guide, profile tables).
        media_exclusive: nvml_profile == NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
        placement_size,
        placements,
    }
}

// `nvidia-smi mig -lgipp`, identical on A100 (MIG user guide, "Getting Started"), H100 SXM5 and
// H100 NVL (NVIDIA blog, driver 550): {0..6}:1, {0,2,4,6}:2, {0,2,4}:2, {0,4}:4, {0}:4, {0}:8.
// H200: derived as the same (same GH100 8-memory-slice layout, same ids and instance counts,
// and a real H200 capture placed two 1g.18gb instances at 4:1 and 6:1).
/// Starts of the 1-memory-slice profiles (1g, 1g+me).
const GI_AT_0_TO_6: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
/// Starts of the 1g profile with two memory slices (REV2).
const GI_AT_0_2_4_6: &[u32] = &[0, 2, 4, 6];
/// Starts of 2g.
const GI_AT_0_2_4: &[u32] = &[0, 2, 4];
/// Starts of 3g (4 memory slices each).
const GI_AT_0_4: &[u32] = &[0, 4];
/// Starts of 4g and 7g.
const GI_AT_0: &[u32] = &[0];

// A100-SXM4-40GB, `nvidia-smi mig -lgip`, R470+ drivers (MIG user guide "Getting Started" and
// several DGX A100 captures): GiB 4.75 / 4.75 / 9.62 / 9.62 / 19.50 / 19.50 / 39.25.
// MiB = GiB x 1024 (all multiples of 128 MiB). R450-R460 drivers printed 9.75 / 19.62 / 39.50
// for the same profiles and had no 1g.10gb.
/// GPU-instance profiles of the A100-SXM4-40GB.
#[rustfmt::skip]
const A100_40GB_GI: &[GiProfile] = &[
    // NVML profile, id, name, compute slices, instances, SMs, MiB, [CE, DEC, ENC, JPEG, OFA], memory slices, starts
    gi(NVML_GPU_INSTANCE_PROFILE_1_SLICE,      19, "1g.5gb",     1, 7, 14,  4_864,   [1, 0, 0, 0, 0], 1, GI_AT_0_TO_6),
    gi(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, "1g.5gb+me",  1, 1, 14,  4_864,   [1, 1, 0, 1, 1], 1, GI_AT_0_TO_6),
    gi(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, "1g.10gb",    1, 4, 14,  9_856,   [1, 1, 0, 0, 0], 2, GI_AT_0_2_4_6),
    gi(NVML_GPU_INSTANCE_PROFILE_2_SLICE,      14, "2g.10gb",    2, 3, 28,  9_856,   [2, 1, 0, 0, 0], 2, GI_AT_0_2_4),
    gi(NVML_GPU_INSTANCE_PROFILE_3_SLICE,      9,  "3g.20gb",    3, 2, 42,  19_968,  [3, 2, 0, 0, 0], 4, GI_AT_0_4),
    gi(NVML_GPU_INSTANCE_PROFILE_4_SLICE,      5,  "4g.20gb",    4, 1, 56,  19_968,  [4, 2, 0, 0, 0], 4, GI_AT_0),
    gi(NVML_GPU_INSTANCE_PROFILE_7_SLICE,      0,  "7g.40gb",    7, 1, 98,  40_192,  [7, 5, 0, 1, 1], 8, GI_AT_0),
];

// H100 80GB HBM3 (SXM5, 10de:2330), `nvidia-smi mig -lgip`, drivers 535 through 580.173.02 all
// print GiB 9.75 / 9.75 / 19.62 / 19.62 / 39.50 / 39.50 / 79.25. The MiB values are confirmed by
// nvidia-smi's MIG device table on real instances (9984, 20096, 40448 MiB); 7g = 79.25 x 1024.
/// GPU-instance profiles of the H100 SXM5 80GB.
#[rustfmt::skip]
const H100_80GB_GI: &[GiProfile] = &[
    // NVML profile, id, name, compute slices, instances, SMs, MiB, [CE, DEC, ENC, JPEG, OFA], memory slices, starts
    gi(NVML_GPU_INSTANCE_PROFILE_1_SLICE,      19, "1g.10gb",    1, 7, 16,  9_984,   [1, 1, 0, 1, 0], 1, GI_AT_0_TO_6),
    gi(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, "1g.10gb+me", 1, 1, 16,  9_984,   [1, 1, 0, 1, 1], 1, GI_AT_0_TO_6),
    gi(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, "1g.20gb",    1, 4, 26,  20_096,  [1, 1, 0, 1, 0], 2, GI_AT_0_2_4_6),
    gi(NVML_GPU_INSTANCE_PROFILE_2_SLICE,      14, "2g.20gb",    2, 3, 32,  20_096,  [2, 2, 0, 2, 0], 2, GI_AT_0_2_4),
    gi(NVML_GPU_INSTANCE_PROFILE_3_SLICE,      9,  "3g.40gb",    3, 2, 60,  40_448,  [3, 3, 0, 3, 0], 4, GI_AT_0_4),
    gi(NVML_GPU_INSTANCE_PROFILE_4_SLICE,      5,  "4g.40gb",    4, 1, 64,  40_448,  [4, 4, 0, 4, 0], 4, GI_AT_0),
    gi(NVML_GPU_INSTANCE_PROFILE_7_SLICE,      0,  "7g.80gb",    7, 1, 132, 81_152,  [8, 7, 0, 7, 1], 8, GI_AT_0),
];

// NVIDIA H200 (SXM, 10de:2335), `nvidia-smi mig -lgip`, driver 580.173.02: GiB 16.00 / 16.00 /
// 32.50 / 32.50 / 69.75 / 69.75 / 140.00 (nvidia-smi shows a real 1g.18gb instance as 16384 MiB).
// Driver 550 printed slightly less (32.25 / 69.50 / 139.75; NVIDIA/mig-parted issue #120).
/// GPU-instance profiles of the H200 141GB.
#[rustfmt::skip]
const H200_141GB_GI: &[GiProfile] = &[
    // NVML profile, id, name, compute slices, instances, SMs, MiB, [CE, DEC, ENC, JPEG, OFA], memory slices, starts
    gi(NVML_GPU_INSTANCE_PROFILE_1_SLICE,      19, "1g.18gb",    1, 7, 16,  16_384,  [1, 1, 0, 1, 0], 1, GI_AT_0_TO_6),
    gi(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, "1g.18gb+me", 1, 1, 16,  16_384,  [1, 1, 0, 1, 1], 1, GI_AT_0_TO_6),
    gi(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, "1g.35gb",    1, 4, 26,  33_280,  [1, 1, 0, 1, 0], 2, GI_AT_0_2_4_6),
    gi(NVML_GPU_INSTANCE_PROFILE_2_SLICE,      14, "2g.35gb",    2, 3, 32,  33_280,  [2, 2, 0, 2, 0], 2, GI_AT_0_2_4),
    gi(NVML_GPU_INSTANCE_PROFILE_3_SLICE,      9,  "3g.71gb",    3, 2, 60,  71_424,  [3, 3, 0, 3, 0], 4, GI_AT_0_4),
    gi(NVML_GPU_INSTANCE_PROFILE_4_SLICE,      5,  "4g.71gb",    4, 1, 64,  71_424,  [4, 4, 0, 4, 0], 4, GI_AT_0),
    gi(NVML_GPU_INSTANCE_PROFILE_7_SLICE,      0,  "7g.141gb",   7, 1, 132, 143_360, [8, 7, 0, 7, 1], 8, GI_AT_0),
];

/// A `-lcipp` row: inside GIs of `gi_slice_count` slices, these starts.
const fn within(gi_slice_count: u32, starts: &'static [u32]) -> CiPlacement {
    CiPlacement { gi_slice_count, starts }
}

// Compute-instance geometry, the same on A100 and Hopper. Verified from real `-lcip` output:
// which profiles each GI size offers and their instance counts (2g: 1c x2, 2c x1; 3g: 1c x3,
// 2c x1, 3c x1; 4g: 1c x4, 2c x2, 4c x1 -- no 3c; 7g offers 1c, 2c, 3c, 4c and 7c), and a 1c CI
// created at 2:1 in a 3g GI. Derived: the other starts, mirroring the GI layout ({0,2,4} for 2c,
// {0,4} for 3c in 7g), which gives 7g the instance counts 7/3/2/1/1.
/// Where 1c fits.
const CI_PLACEMENTS_1C: &[CiPlacement] = &[
    within(1, &[0]),
    within(2, &[0, 1]),
    within(3, &[0, 1, 2]),
    within(4, &[0, 1, 2, 3]),
    within(7, &[0, 1, 2, 3, 4, 5, 6]),
];
/// Where 2c fits.
const CI_PLACEMENTS_2C: &[CiPlacement] = &[within(2, &[0]), within(3, &[0]), within(4, &[0, 2]), within(7, &[0, 2, 4])];
/// Where 3c fits.
const CI_PLACEMENTS_3C: &[CiPlacement] = &[within(3, &[0]), within(7, &[0, 4])];
/// Where 4c fits.
const CI_PLACEMENTS_4C: &[CiPlacement] = &[within(4, &[0]), within(7, &[0])];
/// Where 7c fits.
const CI_PLACEMENTS_7C: &[CiPlacement] = &[within(7, &[0])];

/// One compute-instance profile row.
const fn ci(
    nvml_profile: u32,
    name: &'static str,
    slice_count: u32,
    sm_per_slice: u32,
    placements: &'static [CiPlacement],
) -> CiProfile {
    CiProfile { nvml_profile, name, slice_count, sm_per_slice, placements }
}

/// Builds the five CI profiles for a given SM count per compute slice.
const fn ci_profiles(sm: u32) -> [CiProfile; 5] {
    [
        ci(NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, "1c", 1, sm, CI_PLACEMENTS_1C),
        ci(NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, "2c", 2, sm, CI_PLACEMENTS_2C),
        ci(NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, "3c", 3, sm, CI_PLACEMENTS_3C),
        ci(NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, "4c", 4, sm, CI_PLACEMENTS_4C),
        ci(NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, "7c", 7, sm, CI_PLACEMENTS_7C),
    ]
}

// A100: `-lcip` shows 14 SMs per slice everywhere (1c/2c/3c in 3g: 14/28/42; 1c/2c/4c in 4g:
// 14/28/56; "A100-SXM4-40GB MIG 4c.7g.40gb" has 56 SMs).
/// Compute-instance profiles of the A100.
const A100_CI: &[CiProfile] = &ci_profiles(14);
// Hopper: a 1c CI in an H100 3g.40gb GI has 16 SMs (nvidia-smi, driver 580.173.02), as does
// every 1g GI on H100 and H200. Derived: 16 per slice for 2c..4c inside a larger GI.
/// Compute-instance profiles of the H100 and H200.
const HOPPER_CI: &[CiProfile] = &ci_profiles(16);

/// Compute capability 8.0 (the A100), from GA100 deviceQuery.
const CC_8_0: CudaLimits = CudaLimits {
    max_threads_per_block: 1024,
    max_threads_per_sm: 2048,
    // CUDA C++ Programming Guide, compute capability 8.0: 32 resident blocks per SM.
    max_blocks_per_sm: 32,
    max_block_dim: [1024, 1024, 64],
    max_grid_dim: [2_147_483_647, 65_535, 65_535],
    max_shared_mem_per_block: 49_152,
    // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 166912 (163 KiB) on A100.
    max_shared_mem_per_block_optin: 166_912,
    max_shared_mem_per_sm: 167_936,
    total_const_mem: 65_536,
    regs_per_block: 65_536,
    // CUDA C++ Programming Guide: 64K 32-bit registers per SM, at most 255 per thread.
    regs_per_sm: 65_536,
    max_regs_per_thread: 255,
    warp_size: 32,
};

/// Compute capability 9.0 (the H100 and H200), from deviceQuery (CUDA 12.4-12.8) on an H100:
/// 8.0's limits (the CUDA C++ Programming Guide gives 9.0 the same 32 resident blocks and 64K
/// 32-bit registers per SM), with more shared memory.
const CC_9_0: CudaLimits = CudaLimits {
    // cudaDeviceProp.sharedMemPerBlockOptin = 232448 (227 KiB) on compute capability 9.0.
    max_shared_mem_per_block_optin: 232_448,
    max_shared_mem_per_sm: 233_472,
    ..CC_8_0
};

/// The built-in models; the first is the default node's GPU.
static MODELS: [GpuModel; 3] = [
    // H100 SXM5 80GB. Unless noted: `nvidia-smi -q`, driver 565.57.01 / 545.23.08, on HGX H100
    // boards (Device Id 0x233010DE, Sub System Id 0x16C110DE, part 692-2G520-0200-000).
    GpuModel {
        key: "H100-SXM5-80GB",
        name: "NVIDIA H100 80GB HBM3",
        // "Total : 81559 MiB" (every driver from 535 to 580).
        memory_bytes: 81_559 * MIB,
        // "Reserved : 454 MiB" (565.57.01; 328-551 MiB across drivers).
        reserved_bytes: 454 * MIB,
        // Not corrected: deviceQuery prints "81090 MBytes (85029158912 bytes)", less than NVML's
        // total as on the H200 (issue 35), but the driver it came from kept more than the 454 MiB
        // reserved above, and CUDA's total must hold what NVML leaves free; until one driver's
        // pair of figures is read, CUDA's total stays NVML's.
        cuda_total_mem_bytes: 81_559 * MIB,
        // deviceQuery: "(132) Multiprocessors".
        sm_count: 132,
        // nvmlDeviceGetNumGpuCores 16896 on the H200, the same GH100 configuration.
        cores_per_sm: 128,
        // "VBIOS Version : 96.00.74.00.0D" (HGX H100, part 692-2G520-0200-000).
        vbios_version: "96.00.74.00.0D",
        // "Image Version : G520.0200.00.05" on the same board.
        inforom_image: "G520.0200.00.05",
        cc_major: 9,
        cc_minor: 0,
        architecture: NVML_DEVICE_ARCH_HOPPER,
        brand: NVML_BRAND_NVIDIA,
        pci_device_id: 0x2330_10DE,
        pci_subsystem_id: 0x16C1_10DE,
        // "PCIe Generation Max : 5", "Link Width Max : 16x".
        pcie_max_gen: 5,
        pcie_max_width: 16,
        // "Default Power Limit : 700.00 W", "Min Power Limit : 200.00 W".
        power_limit_mw: 700_000,
        min_power_limit_mw: 200_000,
        // "Power Draw : 72.02 W" idle in P0 (545.23.08).
        idle_power_mw: 72_000,
        // Derived: idle H100 and A100 SXM boards read 29-35 C in `nvidia-smi -q`.
        idle_temp_c: 31,
        // "Max Clocks": SM 1980, Memory 2619, Video 1545; default applications clock 1980.
        max_sm_clock_mhz: 1980,
        max_mem_clock_mhz: 2619,
        max_video_clock_mhz: 1545,
        default_app_sm_clock_mhz: 1980,
        // deviceQuery: "Memory Bus Width: 5120-bit", "L2 Cache Size: 52428800 bytes".
        memory_bus_width_bits: 5120,
        l2_cache_bytes: 52_428_800,
        // Derived: five eighths of L2, as the H200 answered (37.5 of 60 MiB); it was three
        // quarters, the A100's ratio, which the H200 disproves for Hopper.
        max_persisting_l2_bytes: 52_428_800 / 8 * 5,
        // "BAR1 Memory Usage Total : 131072 MiB".
        bar1_bytes: 131_072 * MIB,
        // "BAR1 Memory Usage Used : 1 MiB" on an idle board.
        idle_bar1_used_bytes: MIB,
        // `nvidia-smi nvlink --status`: Link 0..17 at 26.562 GB/s.
        nvlink_count: 18,
        limits: CC_9_0,
        // deviceQuery: "Concurrent copy and kernel execution: Yes with 3 copy engine(s)".
        async_engine_count: 3,
        // R545+ print only T.Limit margins for Hopper; absolute values from an H800 SXM5 (same
        // GH100 SXM5 board family) on R525: Shutdown 92 C, Slowdown 89 C, Max Operating 87 C,
        // Memory Max Operating 95 C.
        slowdown_temp_c: 89,
        shutdown_temp_c: 92,
        max_operating_temp_c: 87,
        mem_max_operating_temp_c: 95,
        mig: Some(MigSpec { compute_slices: 7, memory_slices: 8, gi_profiles: H100_80GB_GI, ci_profiles: HOPPER_CI }),
    },
    // A100-SXM4-40GB. Unless noted: `nvidia-smi -q`, driver 535.129.03, on a DGX A100 board
    // (Device Id 0x20B010DE, Sub System Id 0x134F10DE, part 692-2G506-0200-002).
    GpuModel {
        key: "A100-SXM4-40GB",
        name: "NVIDIA A100-SXM4-40GB",
        // "Total : 40960 MiB" (R450 printed 40537 MiB: older drivers left the reserve out).
        memory_bytes: 40_960 * MIB,
        // "Reserved : 620 MiB".
        reserved_bytes: 620 * MIB,
        // Not corrected: deviceQuery on an A100 40GB prints 42505273344 bytes (40537 MiB, the
        // older drivers' NVML total), below NVML's total less the reserve; see the H100's note.
        cuda_total_mem_bytes: 40_960 * MIB,
        // NVIDIA A100 whitepaper and A100 deviceQuery: 108 SMs.
        sm_count: 108,
        // 6912 CUDA cores (A100 whitepaper): 64 FP32 cores per SM.
        cores_per_sm: 64,
        // "VBIOS Version : 92.00.36.00.04" (DGX A100, part 692-2G506-0200-002, 535.129.03).
        vbios_version: "92.00.36.00.04",
        // "Image Version : G506.0200.00.04" on the same board.
        inforom_image: "G506.0200.00.04",
        cc_major: 8,
        cc_minor: 0,
        architecture: NVML_DEVICE_ARCH_AMPERE,
        brand: NVML_BRAND_NVIDIA,
        pci_device_id: 0x20B0_10DE,
        pci_subsystem_id: 0x134F_10DE,
        // "PCIe Generation Max : 4", "Link Width Max : 16x".
        pcie_max_gen: 4,
        pcie_max_width: 16,
        // "Default Power Limit : 400.00 W", "Min Power Limit : 100.00 W".
        power_limit_mw: 400_000,
        min_power_limit_mw: 100_000,
        // "Power Draw : 52.12 W" idle in P0.
        idle_power_mw: 52_000,
        // Derived: idle H100 and A100 SXM boards read 29-35 C in `nvidia-smi -q`.
        idle_temp_c: 31,
        // "Max Clocks": SM 1410, Memory 1215, Video 1290; default applications clock 1095.
        max_sm_clock_mhz: 1410,
        max_mem_clock_mhz: 1215,
        max_video_clock_mhz: 1290,
        default_app_sm_clock_mhz: 1095,
        // GA100 deviceQuery (A100-SXM4-80GB, same die configuration): 5120-bit, 41943040 bytes L2.
        memory_bus_width_bits: 5120,
        l2_cache_bytes: 41_943_040,
        // CUDA C++ Programming Guide: "up to 30 MB" of the A100's 40 MB L2 for persisting accesses.
        max_persisting_l2_bytes: 30 * MIB as u32,
        // "BAR1 Memory Usage Total : 65536 MiB".
        bar1_bytes: 65_536 * MIB,
        // "BAR1 Memory Usage Used : 1 MiB" on an idle board.
        idle_bar1_used_bytes: MIB,
        // `nvidia-smi nvlink -s` on A100-SXM4-40GB: Link 0..11 at 25 GB/s.
        nvlink_count: 12,
        limits: CC_8_0,
        // GA100 deviceQuery: "Yes with 3 copy engine(s)".
        async_engine_count: 3,
        // "GPU Shutdown Temp : 92 C", "GPU Slowdown Temp : 89 C", "GPU Max Operating Temp : 85 C",
        // "Memory Max Operating Temp : 95 C".
        slowdown_temp_c: 89,
        shutdown_temp_c: 92,
        max_operating_temp_c: 85,
        mem_max_operating_temp_c: 95,
        mig: Some(MigSpec { compute_slices: 7, memory_slices: 8, gi_profiles: A100_40GB_GI, ci_profiles: A100_CI }),
    },
    // H200 (SXM, 141GB). Marked "read": what a real H200 SXM answered through CUDA and NVML,
    // driver 580.159.04, CUDA 13.0 (plugins/sim/driver/tests/data/h200-facts.json, which a test
    // compares with every answer). Otherwise: `nvidia-smi -q`, driver 550.90.12 (Device Id
    // 0x233510DE, part 695-2G520-0280-000).
    GpuModel {
        key: "H200-141GB",
        name: "NVIDIA H200",
        // "Total : 143771 MiB" (550.90.12 and 580.173.02).
        memory_bytes: 143_771 * MIB,
        // Read: NVML's used memory of the idle card, 618.3 MiB (550.90.12 printed "Reserved :
        // 700 MiB").
        reserved_bytes: 648_347_648,
        // Read: cuDeviceTotalMem.
        cuda_total_mem_bytes: 150_109_880_320,
        // torch.cuda.get_device_properties: multi_processor_count=132, L2_cache_size=60MB.
        sm_count: 132,
        // Read: nvmlDeviceGetNumGpuCores 16896.
        cores_per_sm: 128,
        // Read.
        vbios_version: "96.00.A5.00.1A",
        // "Image Version : G520.0280.02.02" (an H200 on 580.173.02, part 695-2G520-0280-001).
        inforom_image: "G520.0280.02.02",
        cc_major: 9,
        cc_minor: 0,
        architecture: NVML_DEVICE_ARCH_HOPPER,
        brand: NVML_BRAND_NVIDIA,
        pci_device_id: 0x2335_10DE,
        // Read (CU_DEVICE_ATTRIBUTE_GPU_PCI_SUBSYSTEM_ID); 550.90.12's board said 0x18BE10DE.
        pci_subsystem_id: 0x18BF_10DE,
        // "PCIe Generation Max : 5", "Link Width Max : 16x".
        pcie_max_gen: 5,
        pcie_max_width: 16,
        // "Default Power Limit : 700.00 W", "Min Power Limit : 200.00 W".
        power_limit_mw: 700_000,
        min_power_limit_mw: 200_000,
        // Read: 83.946 W idle ("Power Draw : 74.58 W" on 550.90.12).
        idle_power_mw: 83_946,
        // Read.
        idle_temp_c: 43,
        // "Max Clocks": SM 1980, Memory 3201, Video 1545; default applications clock 1980.
        max_sm_clock_mhz: 1980,
        max_mem_clock_mhz: 3201,
        max_video_clock_mhz: 1545,
        default_app_sm_clock_mhz: 1980,
        // Read: 6016 bits, from CUDA and NVML alike (it was derived as 6 x 1024 = 6144).
        memory_bus_width_bits: 6016,
        // L2_cache_size=60MB (PyTorch prints bytes / 2^20), 60 x 2^20 bytes.
        l2_cache_bytes: 62_914_560,
        // Read: 39321600, five eighths of L2 (it was derived as three quarters).
        max_persisting_l2_bytes: 39_321_600,
        // "BAR1 Memory Usage Total : 262144 MiB".
        bar1_bytes: 262_144 * MIB,
        // Read: 5177344 bytes used on the idle card.
        idle_bar1_used_bytes: 5_177_344,
        // `nvidia-smi nvlink --status` on H200: Link 0..17.
        nvlink_count: 18,
        limits: CC_9_0,
        // Derived: same GH100 copy-engine exposure as the H100.
        async_engine_count: 3,
        // Derived: the driver prints only T.Limit margins (-8 / -2 / 0 C, the same as H100), so
        // the absolute thresholds are taken to be the H100's.
        slowdown_temp_c: 89,
        shutdown_temp_c: 92,
        max_operating_temp_c: 87,
        mem_max_operating_temp_c: 95,
        mig: Some(MigSpec { compute_slices: 7, memory_slices: 8, gi_profiles: H200_141GB_GI, ci_profiles: HOPPER_CI }),
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every set of GI instances that fits an empty GPU by memory placement, as (profile, start).
    fn layouts(mig: &MigSpec) -> Vec<Vec<(&GiProfile, u32)>> {
        let options: Vec<(&GiProfile, u32)> =
            mig.gi_profiles.iter().flat_map(|p| p.placements.iter().map(move |&s| (p, s))).collect();
        let mut out = Vec::new();
        let mut current = Vec::new();
        fn walk<'a>(
            options: &[(&'a GiProfile, u32)],
            from: usize,
            used: u32,
            current: &mut Vec<(&'a GiProfile, u32)>,
            out: &mut Vec<Vec<(&'a GiProfile, u32)>>,
        ) {
            out.push(current.clone());
            for (i, &(p, start)) in options.iter().enumerate().skip(from) {
                let mask = ((1u32 << p.placement_size) - 1) << start;
                let same = current.iter().filter(|(q, _)| q.nvml_profile == p.nvml_profile).count() as u32;
                if used & mask != 0 || same >= p.instance_count {
                    continue;
                }
                current.push((p, start));
                walk(options, i + 1, used | mask, current, out);
                current.pop();
            }
        }
        walk(&options, 0, 0, &mut current, &mut out);
        out
    }

    /// The profile name go-nvlib (k8s-device-plugin, mig-parted) derives from NVML's figures:
    /// memory as eighths of the board (rounded up) times the board's GB (rounded up), rounded.
    fn derived_name(model: &GpuModel, p: &GiProfile) -> String {
        const GIB: u64 = 1 << 30;
        let eighths = (p.memory_bytes() * 8).div_ceil(model.memory_bytes);
        let board_gb = model.memory_bytes.div_ceil(GIB);
        let gb = (eighths * board_gb * 2 + 8) / 16;
        let suffix = if p.nvml_profile == NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 { "+me" } else { "" };
        format!("{}g.{}gb{}", p.slice_count, gb, suffix)
    }

    fn mig(model: &GpuModel) -> &MigSpec {
        model.mig.as_ref().expect("every built-in model has MIG")
    }

    #[test]
    fn lookup_by_key_is_case_insensitive() {
        assert_eq!(model("h100-sxm5-80gb").map(|m| m.name), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(model(" A100-sxm4-40GB ").map(|m| m.name), Some("NVIDIA A100-SXM4-40GB"));
        assert_eq!(model("H200-141GB").map(|m| m.name), Some("NVIDIA H200"));
        assert!(model("H100").is_none());
        assert_eq!(builtin_models()[0].key, "H100-SXM5-80GB");
    }

    #[test]
    fn keys_names_and_pci_ids_are_unique() {
        let models = builtin_models();
        for (i, a) in models.iter().enumerate() {
            for b in &models[i + 1..] {
                assert!(!a.key.eq_ignore_ascii_case(b.key));
                assert_ne!(a.name, b.name);
                assert_ne!(a.pci_device_id, b.pci_device_id);
            }
        }
    }

    #[test]
    fn whole_gpu_figures_are_coherent() {
        for m in builtin_models() {
            assert_eq!(m.pci_device_id & 0xffff, 0x10de, "{}", m.key);
            assert_eq!(m.pci_subsystem_id & 0xffff, 0x10de, "{}", m.key);
            assert_eq!(m.memory_bytes % MIB, 0, "{}", m.key);
            assert!(m.reserved_bytes < m.memory_bytes / 50, "{}", m.key);
            // CUDA's total is at most NVML's, and holds all that NVML leaves free on an idle board
            // (cuMemGetInfo's free never exceeds its total).
            assert!(m.cuda_total_mem_bytes <= m.memory_bytes, "{}", m.key);
            assert!(m.memory_bytes - m.reserved_bytes <= m.cuda_total_mem_bytes, "{}", m.key);
            assert!(m.max_persisting_l2_bytes < m.l2_cache_bytes, "{}", m.key);
            assert!(m.idle_bar1_used_bytes < m.bar1_bytes, "{}", m.key);
            assert!(m.idle_temp_c < m.max_operating_temp_c, "{}", m.key);
            assert_eq!(m.vbios_version.split('.').count(), 5, "{}", m.key);
            let arch = if m.cc_major == 8 { NVML_DEVICE_ARCH_AMPERE } else { NVML_DEVICE_ARCH_HOPPER };
            assert_eq!(m.architecture, arch, "{}", m.key);
            assert!(m.idle_power_mw < m.min_power_limit_mw && m.min_power_limit_mw <= m.power_limit_mw);
            assert!(m.max_operating_temp_c < m.slowdown_temp_c && m.slowdown_temp_c < m.shutdown_temp_c);
            assert!(m.default_app_sm_clock_mhz <= m.max_sm_clock_mhz);
            let l = m.limits;
            assert_eq!(l.max_threads_per_sm % l.warp_size, 0);
            assert!(l.max_threads_per_block <= l.max_threads_per_sm);
            assert_eq!(l.max_block_dim[0], l.max_threads_per_block);
            assert!(l.max_shared_mem_per_block <= l.max_shared_mem_per_block_optin);
            // The SM keeps 1 KiB of its shared memory for the system, so opt-in is per-SM minus 1 KiB.
            assert_eq!(l.max_shared_mem_per_block_optin + 1024, l.max_shared_mem_per_sm);
            assert!(l.regs_per_block <= l.regs_per_sm);
        }
    }

    #[test]
    fn slice_counts_match_the_mig_layout() {
        for m in builtin_models() {
            let mig = mig(m);
            assert_eq!((mig.compute_slices, mig.memory_slices), (7, 8), "{}", m.key);
            for p in mig.gi_profiles {
                assert!(p.slice_count >= 1 && p.slice_count <= mig.compute_slices, "{} {}", m.key, p.name);
                assert!(p.placement_size >= p.slice_count, "{} {}", m.key, p.name);
            }
        }
    }

    #[test]
    fn every_placement_fits_in_the_memory_slices() {
        for m in builtin_models() {
            let mig = mig(m);
            for p in mig.gi_profiles {
                assert!(!p.placements.is_empty(), "{} {}", m.key, p.name);
                for &start in p.placements {
                    assert!(start + p.placement_size <= mig.memory_slices, "{} {} at {start}", m.key, p.name);
                }
            }
        }
    }

    #[test]
    fn instance_count_is_what_the_placements_allow() {
        for m in builtin_models() {
            for p in mig(m).gi_profiles {
                let geometric = max_disjoint(p.placements, p.placement_size);
                if p.media_exclusive {
                    assert_eq!(p.instance_count, 1, "{} {}", m.key, p.name);
                    assert!(geometric >= 1);
                } else {
                    assert_eq!(p.instance_count, geometric, "{} {}", m.key, p.name);
                }
            }
        }
    }

    #[test]
    fn profile_figures_never_exceed_the_gpu() {
        for m in builtin_models() {
            let mig = mig(m);
            for p in mig.gi_profiles {
                assert!(p.sm_count <= m.sm_count, "{} {}", m.key, p.name);
                assert!(p.memory_bytes() <= m.memory_bytes, "{} {}", m.key, p.name);
                // An instance's memory fits in its share of the board's memory slices.
                let share = m.memory_bytes * u64::from(p.placement_size) / u64::from(mig.memory_slices);
                assert!(p.memory_bytes() <= share, "{} {}", m.key, p.name);
                assert!(p.sm_count >= p.slice_count * mig.ci_profiles[0].sm_per_slice, "{} {}", m.key, p.name);
            }
            let whole = m.gi_profile(NVML_GPU_INSTANCE_PROFILE_7_SLICE).expect("7g");
            assert!(mig.gi_profiles.iter().all(|p| p.sm_count <= whole.sm_count && p.memory_mib <= whole.memory_mib));
        }
    }

    #[test]
    fn every_layout_fits_the_gpu() {
        for m in builtin_models() {
            let mig = mig(m);
            let all = layouts(mig);
            assert!(all.len() > 100, "{}: only {} layouts", m.key, all.len());
            for layout in &all {
                let slices: u32 = layout.iter().map(|(p, _)| p.slice_count).sum();
                let sms: u32 = layout.iter().map(|(p, _)| p.sm_count).sum();
                let bytes: u64 = layout.iter().map(|(p, _)| p.memory_bytes()).sum();
                let names: Vec<_> = layout.iter().map(|(p, s)| format!("{}@{s}", p.name)).collect();
                assert!(slices <= mig.compute_slices, "{}: {names:?}", m.key);
                assert!(sms <= m.sm_count, "{}: {names:?}", m.key);
                assert!(bytes <= m.memory_bytes, "{}: {names:?}", m.key);
            }
            // The documented full layouts are reachable, e.g. 4-2-1 and 3-2-1-1 and 7 x 1g.
            let has = |want: &[(u32, u32)]| {
                all.iter().any(|l| {
                    l.len() == want.len() && want.iter().all(|&(id, s)| l.iter().any(|(p, t)| p.id == id && *t == s))
                })
            };
            assert!(has(&[(5, 0), (14, 4), (19, 6)]), "{}", m.key);
            assert!(has(&[(9, 4), (14, 0), (19, 2), (19, 3)]), "{}", m.key);
            assert!(has(&[(19, 0), (19, 1), (19, 2), (19, 3), (19, 4), (19, 5), (19, 6)]), "{}", m.key);
        }
    }

    #[test]
    fn names_follow_from_the_memory_figures() {
        for m in builtin_models() {
            for p in mig(m).gi_profiles {
                assert_eq!(p.name, derived_name(m, p), "{}", m.key);
            }
        }
    }

    #[test]
    fn nvml_profiles_and_ids_agree_across_models() {
        let expected = [
            (NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, 1),
            (NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, 1),
            (NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, 1),
            (NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, 2),
            (NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, 3),
            (NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, 4),
            (NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, 7),
        ];
        for m in builtin_models() {
            let gi = mig(m).gi_profiles;
            assert_eq!(gi.len(), expected.len(), "{}", m.key);
            for (p, &(nvml, id, slices)) in gi.iter().zip(&expected) {
                assert_eq!((p.nvml_profile, p.id, p.slice_count), (nvml, id, slices), "{} {}", m.key, p.name);
                assert_eq!(m.gi_profile(nvml), Some(p));
                assert_eq!(m.gi_profile_by_id(id), Some(p));
                assert_eq!(m.gi_profile_by_name(p.name), Some(p));
                assert_eq!(m.gi_profile_by_name(&p.smi_name().to_uppercase()), Some(p));
            }
            assert!(m.gi_profile(NVML_GPU_INSTANCE_PROFILE_8_SLICE).is_none());
            assert!(m.gi_profile_by_name("9g.1gb").is_none());
        }
    }

    #[test]
    fn h100_matches_nvidia_smi() {
        let h100 = model("H100-SXM5-80GB").unwrap();
        assert_eq!(h100.memory_bytes, 85_520_809_984);
        let me = h100.gi_profile_by_name("1g.10gb+me").unwrap();
        assert_eq!((me.id, me.instance_count, me.ofas, me.jpegs), (20, 1, 1, 1));
        let p = |name| h100.gi_profile_by_name(name).unwrap();
        assert_eq!((p("1g.20gb").sm_count, p("1g.20gb").placements), (26, &[0u32, 2, 4, 6][..]));
        assert_eq!(p("3g.40gb").placements, &[0, 4]);
        assert_eq!((p("7g.80gb").sm_count, p("7g.80gb").copy_engines, p("7g.80gb").memory_mib), (132, 8, 81_152));
    }

    #[test]
    fn ci_profiles_for_7g_include_1c_to_7c() {
        for m in builtin_models() {
            let whole = m.gi_profile(NVML_GPU_INSTANCE_PROFILE_7_SLICE).unwrap();
            let got: Vec<_> = m.ci_profiles_for(whole).into_iter().map(|(ci, n, s)| (ci.name, n, s)).collect();
            let want = vec![
                ("1c", 7, vec![0, 1, 2, 3, 4, 5, 6]),
                ("2c", 3, vec![0, 2, 4]),
                ("3c", 2, vec![0, 4]),
                ("4c", 1, vec![0]),
                ("7c", 1, vec![0]),
            ];
            assert_eq!(got, want, "{}", m.key);
        }
    }

    #[test]
    fn ci_profiles_for_smaller_gis_match_nvidia_smi() {
        for m in builtin_models() {
            let counts = |nvml| -> Vec<(&'static str, u32)> {
                let gi = m.gi_profile(nvml).unwrap();
                m.ci_profiles_for(gi).into_iter().map(|(ci, n, _)| (ci.name, n)).collect()
            };
            assert_eq!(counts(NVML_GPU_INSTANCE_PROFILE_4_SLICE), [("1c", 4), ("2c", 2), ("4c", 1)], "{}", m.key);
            assert_eq!(counts(NVML_GPU_INSTANCE_PROFILE_3_SLICE), [("1c", 3), ("2c", 1), ("3c", 1)], "{}", m.key);
            assert_eq!(counts(NVML_GPU_INSTANCE_PROFILE_2_SLICE), [("1c", 2), ("2c", 1)], "{}", m.key);
            for one in [
                NVML_GPU_INSTANCE_PROFILE_1_SLICE,
                NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
                NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2,
            ] {
                assert_eq!(counts(one), [("1c", 1)], "{}", m.key);
            }
        }
    }

    #[test]
    fn ci_figures_fit_their_gi() {
        for m in builtin_models() {
            for gi in mig(m).gi_profiles {
                let cis = m.ci_profiles_for(gi);
                assert_eq!(cis.iter().filter(|(ci, _, _)| ci.is_default_in(gi)).count(), 1, "{} {}", m.key, gi.name);
                for (ci, count, starts) in &cis {
                    assert!(starts.iter().all(|s| s + ci.slice_count <= gi.slice_count), "{} {}", m.key, gi.name);
                    assert_eq!(*count, max_disjoint(starts, ci.slice_count));
                    let sms = ci.sm_count_in(gi);
                    assert!(sms <= gi.sm_count && sms * count <= gi.sm_count, "{} {} {}", m.key, gi.name, ci.name);
                    assert_eq!(m.ci_profile_for(gi, ci.nvml_profile), Some(*ci));
                }
            }
        }
    }

    #[test]
    fn ci_names_and_sms() {
        let h100 = model("h100-sxm5-80gb").unwrap();
        let g3 = h100.gi_profile_by_name("3g.40gb").unwrap();
        let c1 = h100.ci_profile_for(g3, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE).unwrap();
        let c3 = h100.ci_profile_for(g3, NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE).unwrap();
        assert_eq!((c1.name_in(g3), c1.sm_count_in(g3)), ("1c.3g.40gb".to_string(), 16));
        assert_eq!((c3.name_in(g3), c3.sm_count_in(g3)), ("3g.40gb".to_string(), 60));
        assert!(h100.ci_profile_for(g3, NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE).is_none());
        let a100 = model("A100-SXM4-40GB").unwrap();
        let g7 = a100.gi_profile(NVML_GPU_INSTANCE_PROFILE_7_SLICE).unwrap();
        let c4 = a100.ci_profile_for(g7, NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE).unwrap();
        assert_eq!((c4.name_in(g7), c4.sm_count_in(g7)), ("4c.7g.40gb".to_string(), 56));
    }

    #[test]
    fn max_disjoint_counts_non_overlapping_starts() {
        assert_eq!(max_disjoint(&[0, 1, 2, 3, 4, 5, 6], 1), 7);
        assert_eq!(max_disjoint(&[0, 2, 4, 6], 2), 4);
        assert_eq!(max_disjoint(&[4, 0], 4), 2);
        assert_eq!(max_disjoint(&[0, 1, 2], 2), 2);
        assert_eq!(max_disjoint(&[], 1), 0);
    }
}
