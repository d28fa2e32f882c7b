//! The node description (TOML) and everything derived from it: GPU identities and topology.
//!
//! Identities (UUIDs, serials, PCI bus ids, minor numbers, NUMA nodes) are pure functions of the
//! description, so every process, every restart and every test sees the same values.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::catalog::{self, GpuModel};
use crate::layout::MAX_GPUS;
use crate::{Result, SimError};

/// A node: which GPUs, how they are wired, which driver it pretends to be.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeDescription {
    /// Seed for UUIDs and serials: two nodes with different seeds never share a UUID.
    #[serde(default = "default_seed")]
    pub seed: String,
    /// Driver version string, as nvidia-smi shows it.
    #[serde(default = "default_driver_version")]
    pub driver_version: String,
    /// CUDA driver API version (cuDriverGetVersion), e.g. 12080 for 12.8.
    #[serde(default = "default_cuda_version")]
    pub cuda_driver_version: u32,
    /// Device memory a CUDA context takes for itself when created.
    #[serde(default = "default_context_overhead_mib")]
    pub context_overhead_mib: u64,
    /// NUMA nodes the GPUs are spread over, in order (GPUs 0..n/2 on node 0, and so on).
    #[serde(default = "default_numa_nodes")]
    pub numa_nodes: u32,
    /// GPUs sharing one PCIe switch.
    #[serde(default = "default_gpus_per_pcie_switch")]
    pub gpus_per_pcie_switch: u32,
    /// How the node's GPUs are presented (`nvmlDeviceGetVirtualizationMode`): "none" (bare
    /// metal), or "passthrough" (each GPU passed whole to the virtual machine the node is).
    #[serde(default, skip_serializing_if = "VirtualizationMode::is_none")]
    pub virtualization_mode: VirtualizationMode,
    /// The GPUs, in groups of one model.
    #[serde(rename = "gpu")]
    pub gpus: Vec<GpuGroup>,
}

/// `count` GPUs of one model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuGroup {
    /// A catalog key, e.g. "H100-SXM5-80GB".
    pub model: String,
    #[serde(default = "one")]
    pub count: u32,
    /// Whether the group's GPUs are joined all-to-all by NVLink (an NVSwitch fabric).
    #[serde(default = "yes")]
    pub nvlink: bool,
    /// MIG mode at first boot of the simulated node.
    #[serde(default)]
    pub mig: bool,
}

/// The node's GPU virtualization, as NVML's `nvmlGpuVirtualizationMode_t` names it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VirtualizationMode {
    /// Bare metal: `NVML_GPU_VIRTUALIZATION_MODE_NONE`.
    #[default]
    None,
    /// A GPU passed through to a virtual machine: `NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH`.
    Passthrough,
}

impl VirtualizationMode {
    fn is_none(&self) -> bool {
        *self == VirtualizationMode::None
    }
}

fn default_seed() -> String {
    "tessera-sim".into()
}
fn default_driver_version() -> String {
    "570.133.20".into()
}
fn default_cuda_version() -> u32 {
    12080
}
fn default_context_overhead_mib() -> u64 {
    256
}
fn default_numa_nodes() -> u32 {
    2
}
fn default_gpus_per_pcie_switch() -> u32 {
    2
}
fn one() -> u32 {
    1
}
fn yes() -> bool {
    true
}

/// The built-in default node, also the README's: 8 x H100 SXM5 on NVLink.
pub const DEFAULT_NODE_TOML: &str = r#"# 8 x H100 SXM5 80GB joined by NVSwitch, two NUMA nodes (an HGX H100 board)
[[gpu]]
model = "H100-SXM5-80GB"
count = 8
nvlink = true
"#;

/// Where two GPUs meet, as NVML's nvmlGpuTopologyLevel_t names it (the values are NVML's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum TopologyLevel {
    Internal = 0,
    Single = 10,
    Multiple = 20,
    HostBridge = 30,
    Node = 40,
    System = 50,
}

/// One GPU's static identity.
#[derive(Debug, Clone)]
pub struct GpuIdentity {
    pub index: u32,
    pub model: &'static GpuModel,
    pub uuid: String,
    pub serial: String,
    pub pci_domain: u32,
    pub pci_bus: u32,
    pub pci_device: u32,
    /// "00000000:18:00.0", NVML's busId form.
    pub bus_id: String,
    /// /dev/nvidiaN
    pub minor: u32,
    pub numa_node: u32,
    pub pcie_switch: u32,
    /// GPUs with the same fabric id are joined all-to-all by NVLink.
    pub nvlink_fabric: Option<u32>,
    pub board_id: u32,
    pub initial_mig: bool,
}

impl GpuIdentity {
    /// The UUID of a MIG device (compute instance `ci` of GPU instance `gi`, created with
    /// `serial`), "MIG-…". Like the driver's, it is new each time an instance is created.
    pub fn mig_uuid(&self, gi: u32, ci: u32, serial: u32) -> String {
        let name = format!("{}/{gi}/{ci}/{serial}", self.uuid);
        format!("MIG-{}", uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, name.as_bytes()))
    }

    /// How close two GPUs are on PCIe.
    pub fn common_ancestor(&self, other: &GpuIdentity) -> TopologyLevel {
        if self.index == other.index {
            TopologyLevel::Internal
        } else if self.pcie_switch == other.pcie_switch {
            TopologyLevel::Single
        } else if self.numa_node == other.numa_node {
            TopologyLevel::Node
        } else {
            TopologyLevel::System
        }
    }

    /// Whether NVLink joins the two GPUs.
    pub fn nvlink_to(&self, other: &GpuIdentity) -> bool {
        self.index != other.index && self.nvlink_fabric.is_some() && self.nvlink_fabric == other.nvlink_fabric
    }
}

// HGX-style PCI bus numbers for the first eight GPUs; further GPUs continue the pattern.
const PCI_BUSES: [u32; 8] = [0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb];

impl NodeDescription {
    /// The built-in default node (8 x H100 SXM5 80GB, NVLink).
    pub fn default_node() -> NodeDescription {
        NodeDescription::parse(DEFAULT_NODE_TOML).expect("built-in node description is valid")
    }

    /// Reads and validates a description file.
    pub fn load(path: &Path) -> Result<NodeDescription> {
        let text =
            std::fs::read_to_string(path).map_err(|e| SimError::Description(format!("{}: {e}", path.display())))?;
        NodeDescription::parse(&text).map_err(|e| match e {
            SimError::Description(m) => SimError::Description(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Parses and validates a description.
    pub fn parse(text: &str) -> Result<NodeDescription> {
        let d: NodeDescription = toml::from_str(text).map_err(|e| SimError::Description(e.to_string()))?;
        d.validate()?;
        Ok(d)
    }

    fn validate(&self) -> Result<()> {
        let bad = |key: &str, why: String| Err(SimError::Description(format!("{key}: {why}")));
        if self.gpus.is_empty() {
            return bad("gpu", "at least one [[gpu]] group is needed".into());
        }
        for (i, g) in self.gpus.iter().enumerate() {
            if catalog::model(&g.model).is_none() {
                let known: Vec<_> = catalog::builtin_models().iter().map(|m| m.key).collect();
                return bad(
                    &format!("gpu[{i}].model"),
                    format!("unknown model {:?}; known: {}", g.model, known.join(", ")),
                );
            }
            if g.count == 0 {
                return bad(&format!("gpu[{i}].count"), "must be at least 1".into());
            }
            if g.mig && catalog::model(&g.model).is_some_and(|m| m.mig.is_none()) {
                return bad(&format!("gpu[{i}].mig"), format!("{} does not support MIG", g.model));
            }
        }
        let total: u64 = self.gpus.iter().map(|g| u64::from(g.count)).sum();
        if total > MAX_GPUS as u64 {
            return bad("gpu", format!("{total} GPUs; the simulated node holds at most {MAX_GPUS}"));
        }
        if self.numa_nodes == 0 {
            return bad("numa_nodes", "must be at least 1".into());
        }
        if self.gpus_per_pcie_switch == 0 {
            return bad("gpus_per_pcie_switch", "must be at least 1".into());
        }
        let parts: Vec<_> = self.driver_version.split('.').collect();
        if parts.len() < 2 || parts.iter().any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit())) {
            return bad("driver_version", format!("{:?} is not of the form 570.133.20", self.driver_version));
        }
        if !(1000..100_000).contains(&self.cuda_driver_version) {
            return bad(
                "cuda_driver_version",
                format!("{} is not a CUDA version such as 12080", self.cuda_driver_version),
            );
        }
        if self.context_overhead_mib > 64 * 1024 {
            return bad("context_overhead_mib", "more than 64 GiB per context is not a real driver".into());
        }
        Ok(())
    }

    /// The description in one canonical form: two descriptions that mean the same node agree.
    pub fn canonical_text(&self) -> String {
        toml::to_string(self).expect("description serializes")
    }

    /// A short stable hash of the canonical text (FNV-1a), for default state file names.
    pub fn fingerprint(&self) -> u64 {
        fnv1a(self.canonical_text().as_bytes())
    }

    /// Total GPU count.
    pub fn gpu_count(&self) -> u32 {
        self.gpus.iter().map(|g| g.count).sum()
    }

    /// Derives every GPU's identity.
    pub fn identities(&self) -> Vec<GpuIdentity> {
        let total = self.gpu_count();
        let per_numa = total.div_ceil(self.numa_nodes).max(1);
        let mut out = Vec::with_capacity(total as usize);
        let mut index = 0u32;
        for (group, g) in self.gpus.iter().enumerate() {
            let model = catalog::model(&g.model).expect("validated");
            for _ in 0..g.count {
                let name = format!("{}/{}/{}", self.seed, index, model.key);
                let uuid = format!("GPU-{}", uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, name.as_bytes()));
                let serial = format!("{:013}", 1_650_000_000_000u64 + fnv1a(name.as_bytes()) % 1_000_000_000);
                let pci_bus = PCI_BUSES.get(index as usize).copied().unwrap_or(0xdc + index);
                out.push(GpuIdentity {
                    index,
                    model,
                    uuid,
                    serial,
                    pci_domain: 0,
                    pci_bus,
                    pci_device: 0,
                    bus_id: format!("00000000:{pci_bus:02X}:00.0"),
                    minor: index,
                    numa_node: (index / per_numa).min(self.numa_nodes - 1),
                    pcie_switch: index / self.gpus_per_pcie_switch,
                    nvlink_fabric: (g.nvlink && model.nvlink_count > 0).then_some(group as u32),
                    // As the driver derives it from the PCI location: 0x1800 at 18:00.0 (HGX
                    // captures), 6 at 00:06.0 (the H200 that was read).
                    board_id: pci_bus << 8,
                    initial_mig: g.mig,
                });
                index += 1;
            }
        }
        out
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// The default state file of a description: under $XDG_RUNTIME_DIR, else /run as root, else /tmp.
pub fn default_state_path(d: &NodeDescription) -> PathBuf {
    let dir = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("tessera-sim"),
        // SAFETY: geteuid has no preconditions and cannot fail.
        _ if unsafe { libc::geteuid() } == 0 => PathBuf::from("/run/tessera-sim"),
        // SAFETY: as above.
        _ => PathBuf::from(format!("/tmp/tessera-sim-{}", unsafe { libc::geteuid() })),
    };
    // The layout version is in the name: a newer simulator never trips over an older one's file.
    dir.join(format!("node-{:016x}-v{}.state", d.fingerprint(), crate::layout::VERSION))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_node_is_eight_h100_on_nvlink() {
        let d = NodeDescription::default_node();
        let ids = d.identities();
        assert_eq!(ids.len(), 8);
        assert!(ids.iter().all(|g| g.model.key == "H100-SXM5-80GB"));
        assert!(ids[0].nvlink_to(&ids[7]));
        assert_eq!(ids[0].bus_id, "00000000:18:00.0");
        // The board id follows the PCI location, as nvidia-smi shows "Board ID : 0x1800" there.
        assert_eq!((ids[0].board_id, ids[1].board_id), (0x1800, 0x2a00));
        assert_eq!(ids[0].numa_node, 0);
        assert_eq!(ids[7].numa_node, 1);
        assert_eq!(ids[0].common_ancestor(&ids[1]), TopologyLevel::Single);
        assert_eq!(ids[0].common_ancestor(&ids[2]), TopologyLevel::Node);
        assert_eq!(ids[0].common_ancestor(&ids[4]), TopologyLevel::System);
    }

    #[test]
    fn identities_are_stable_and_distinct() {
        let a = NodeDescription::default_node().identities();
        let b = NodeDescription::default_node().identities();
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.uuid, y.uuid);
            assert_eq!(x.serial, y.serial);
        }
        let mut uuids: Vec<_> = a.iter().map(|g| g.uuid.clone()).collect();
        uuids.sort();
        uuids.dedup();
        assert_eq!(uuids.len(), 8);
        assert!(a[0].uuid.starts_with("GPU-") && a[0].uuid.len() == 40);
        assert!(a[0].mig_uuid(1, 0, 0).starts_with("MIG-"));
        assert_ne!(a[0].mig_uuid(1, 0, 0), a[0].mig_uuid(2, 0, 0));
        assert_ne!(a[0].mig_uuid(1, 0, 0), a[0].mig_uuid(1, 0, 1), "recreated instances get new UUIDs");
        let other = NodeDescription::parse("seed = \"x\"\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\n").unwrap();
        assert_ne!(other.identities()[0].uuid, a[0].uuid);
    }

    #[test]
    fn bad_descriptions_name_the_key() {
        let cases = [
            ("[[gpu]]\nmodel = \"V100\"\n", "gpu[0].model"),
            ("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 0\n", "gpu[0].count"),
            ("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 17\n", "at most 16"),
            ("driver_version = \"abc\"\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\n", "driver_version"),
            ("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncolour = 1\n", "colour"),
            ("numa_nodes = 0\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\n", "numa_nodes"),
            ("virtualization_mode = \"vgpu\"\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\n", "virtualization_mode"),
            ("", "gpu"),
        ];
        for (text, needle) in cases {
            let err = NodeDescription::parse(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{text:?} gave {err:?}, wanted {needle:?}");
        }
    }

    #[test]
    fn canonical_text_ignores_spelling() {
        let a = NodeDescription::parse("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 8\n").unwrap();
        let b = NodeDescription::default_node();
        assert_eq!(a.canonical_text(), b.canonical_text());
        assert_eq!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn virtualization_mode_is_none_unless_described() {
        let bare = NodeDescription::default_node();
        assert_eq!(bare.virtualization_mode, VirtualizationMode::None);
        // Left out of the canonical text when "none", so older nodes keep their state file names.
        assert!(!bare.canonical_text().contains("virtualization_mode"));
        let vm = "virtualization_mode = \"passthrough\"\n[[gpu]]\nmodel = \"H200-141GB\"\n";
        let vm = NodeDescription::parse(vm).unwrap();
        assert_eq!(vm.virtualization_mode, VirtualizationMode::Passthrough);
        assert!(vm.canonical_text().contains("virtualization_mode = \"passthrough\""));
    }
}
