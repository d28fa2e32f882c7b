//! What discovery found: plain values, no NVML handles, so everything downstream (planning,
//! logging, the node API later) works on a snapshot and is testable without a GPU.

use std::fmt;

/// The node's GPUs and how they connect.
#[derive(Debug, Clone, PartialEq)]
pub struct Inventory {
    /// The NVML library the session loaded.
    pub library: std::path::PathBuf,
    /// `nvmlSystemGetDriverVersion`.
    pub driver_version: String,
    /// `nvmlSystemGetCudaDriverVersion` (e.g. 12080).
    pub cuda_driver_version: i32,
    /// By NVML index.
    pub gpus: Vec<Gpu>,
    /// Where the PCIe paths of each pair of GPUs meet (`a < b`).
    pub topology: Vec<PairTopology>,
}

impl Inventory {
    /// A GPU by NVML index.
    pub fn gpu(&self, index: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.index == index)
    }

    /// A GPU by UUID.
    /// A GPU by UUID, in any case (as Allocate and the configuration match them).
    pub fn gpu_by_uuid(&self, uuid: &str) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.uuid.eq_ignore_ascii_case(uuid))
    }

    /// The common PCIe ancestor of two GPUs.
    pub fn common_ancestor(&self, a: u32, b: u32) -> Option<Ancestor> {
        let (a, b) = if a < b { (a, b) } else { (b, a) };
        self.topology.iter().find(|t| t.a == a && t.b == b).map(|t| t.ancestor)
    }
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    pub index: u32,
    /// `GPU-…`.
    pub uuid: String,
    /// Product name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Total device memory in bytes.
    pub memory_total: u64,
    /// PCI bus id as NVML writes it (`00000000:18:00.0`).
    pub pci_bus_id: String,
    /// NUMA node: NVML's answer, else sysfs'; `None` when neither knows.
    pub numa_node: Option<u32>,
    /// The device file's minor number (`/dev/nvidia<minor>`), when NVML says.
    pub minor: Option<u32>,
    /// MIG: `None` when the GPU cannot do MIG.
    pub mig: Option<MigInfo>,
    /// Indices of the GPUs with an active NVLink to this one.
    pub nvlink_peers: Vec<u32>,
    /// Compute processes on the GPU (all its MIG instances included), by pid.
    pub processes: Vec<u32>,
}

impl Gpu {
    /// Its MIG device of GPU instance `gi` and compute instance `ci`, when it has one.
    pub fn mig_device(&self, gi: u32, ci: u32) -> Option<&MigDevice> {
        self.mig.iter().flat_map(|m| &m.instances).flat_map(|i| &i.devices).find(|d| d.gi_id == gi && d.ci_id == ci)
    }
}

/// MIG state and capability of a GPU that supports it.
#[derive(Debug, Clone, PartialEq)]
pub struct MigInfo {
    /// MIG mode now.
    pub current: bool,
    /// MIG mode after the next reset.
    pub pending: bool,
    /// A mode change takes effect when it is set (Hopper and later), not at the next GPU reset
    /// (Ampere), by the board's architecture (docs/sim.md, "MIG mode changes").
    pub switches_in_place: bool,
    /// The model's GPU-instance profiles.
    pub capability: MigCapability,
    /// The GPU instances (empty with MIG off), by GPU-instance id.
    pub instances: Vec<MigInstance>,
}

/// A GPU model's MIG table, as NVML describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct MigCapability {
    /// GPU-instance profiles the board offers.
    pub profiles: Vec<GiProfile>,
    /// Compute slices of the whole GPU (the largest profile's slice count: 7 on A100/H100).
    pub compute_slices: u32,
}

impl MigCapability {
    /// A profile by name (`"3g.40gb"`).
    pub fn profile(&self, name: &str) -> Option<&GiProfile> {
        self.profiles.iter().find(|p| p.name == name)
    }

    /// A profile by its id (`nvmlGpuInstanceProfileInfo_t.id`).
    pub fn profile_by_id(&self, id: u32) -> Option<&GiProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    /// The profiles' names.
    pub fn names(&self) -> Vec<String> {
        self.profiles.iter().map(|p| p.name.clone()).collect()
    }
}

/// A GPU-instance profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiProfile {
    /// As nvidia-smi and mig-parted name it: `1g.10gb`, `1g.10gb+me`.
    pub name: String,
    /// The profile id other NVML calls take (19 for 1g.10gb on H100).
    pub id: u32,
    /// The `NVML_GPU_INSTANCE_PROFILE_*` value it was queried with.
    pub nvml_profile: u32,
    /// Compute slices.
    pub slice_count: u32,
    /// How many instances of it fit on an empty GPU.
    pub instance_count: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors of one instance (`multiprocessorCount`).
    pub multiprocessors: u32,
    /// Memory slices one placement spans.
    pub placement_size: u32,
    /// First memory slices it may start at.
    pub placements: Vec<u32>,
}

/// A GPU instance and its compute instances.
#[derive(Debug, Clone, PartialEq)]
pub struct MigInstance {
    /// GPU-instance id.
    pub gi_id: u32,
    /// Profile name (`3g.40gb`).
    pub profile: String,
    /// Profile id.
    pub profile_id: u32,
    /// First memory slice.
    pub start: u32,
    /// Memory slices spanned.
    pub size: u32,
    /// Its compute instances: the MIG devices (normally one, spanning the GPU instance).
    pub devices: Vec<MigDevice>,
}

impl MigInstance {
    /// Whether processes run on any of its MIG devices.
    pub fn has_processes(&self) -> bool {
        self.devices.iter().any(|d| !d.processes.is_empty())
    }
}

/// A MIG device: one compute instance, what a container gets.
#[derive(Debug, Clone, PartialEq)]
pub struct MigDevice {
    /// `MIG-…`.
    pub uuid: String,
    /// GPU-instance id.
    pub gi_id: u32,
    /// Compute-instance id.
    pub ci_id: u32,
    /// Memory in bytes.
    pub memory_total: u64,
    /// Compute processes on it, by pid.
    pub processes: Vec<u32>,
}

/// How two GPUs connect over PCIe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairTopology {
    pub a: u32,
    pub b: u32,
    pub ancestor: Ancestor,
}

/// `nvmlGpuTopologyLevel_t`: where two PCIe paths meet, nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ancestor {
    /// Same board.
    Internal,
    /// One PCIe switch.
    Single,
    /// Several switches, no host bridge.
    Multiple,
    /// The same host bridge.
    HostBridge,
    /// The same NUMA node.
    Node,
    /// Across the CPU interconnect.
    System,
}

impl fmt::Display for Ancestor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // nvidia-smi topo -m's legend.
        f.write_str(match self {
            Ancestor::Internal => "internal",
            Ancestor::Single => "PIX",
            Ancestor::Multiple => "PXB",
            Ancestor::HostBridge => "PHB",
            Ancestor::Node => "NODE",
            Ancestor::System => "SYS",
        })
    }
}

/// A MIG profile's name from its size, as NVIDIA's tools derive it: the memory fraction of the
/// board rounded up to eighths, times the board's GB; `+me` for the media-extensions profile.
pub fn profile_name(slice_count: u32, memory_mib: u64, board_bytes: u64, media: bool) -> String {
    let fraction = (memory_mib as f64 * (1u64 << 20) as f64) / board_bytes as f64;
    let fraction = (fraction * 8.0).ceil() / 8.0;
    let board_gb = board_bytes.div_ceil(1 << 30) as f64;
    let gb = (fraction * board_gb).round() as u64;
    format!("{slice_count}g.{gb}gb{}", if media { "+me" } else { "" })
}

/// (architecture, compute capability) of NVIDIA's data-centre products by name.
pub fn architecture(product: &str) -> Option<(&'static str, &'static str)> {
    let p = product.to_ascii_uppercase();
    let has = |m: &str| p.split(|c: char| !c.is_ascii_alphanumeric()).any(|w| w.starts_with(m));
    [
        ("B200", "Blackwell", "10.0"),
        ("GB200", "Blackwell", "10.0"),
        ("H100", "Hopper", "9.0"),
        ("H200", "Hopper", "9.0"),
        ("H800", "Hopper", "9.0"),
        ("GH200", "Hopper", "9.0"),
        ("L40", "Ada Lovelace", "8.9"),
        ("L4", "Ada Lovelace", "8.9"),
        ("A100", "Ampere", "8.0"),
        ("A30", "Ampere", "8.0"),
        ("A10", "Ampere", "8.6"),
        ("V100", "Volta", "7.0"),
        ("T4", "Turing", "7.5"),
    ]
    .iter()
    .find(|(m, _, _)| has(m))
    .map(|(_, a, cc)| (*a, *cc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_by_product() {
        assert_eq!(architecture("NVIDIA H100 80GB HBM3"), Some(("Hopper", "9.0")));
        assert_eq!(architecture("NVIDIA A100-SXM4-40GB"), Some(("Ampere", "8.0")));
        assert_eq!(architecture("NVIDIA H200"), Some(("Hopper", "9.0")));
        assert_eq!(architecture("NVIDIA L4"), Some(("Ada Lovelace", "8.9")));
        assert_eq!(architecture("Quadro P5000"), None);
    }

    #[test]
    fn profile_names_as_nvidia_derives_them() {
        // H100 80GB: 85520809984 bytes.
        let h100 = 85_520_809_984;
        assert_eq!(profile_name(1, 9_984, h100, false), "1g.10gb");
        assert_eq!(profile_name(1, 9_984, h100, true), "1g.10gb+me");
        assert_eq!(profile_name(1, 20_096, h100, false), "1g.20gb");
        assert_eq!(profile_name(3, 40_448, h100, false), "3g.40gb");
        assert_eq!(profile_name(7, 81_152, h100, false), "7g.80gb");
    }
}
