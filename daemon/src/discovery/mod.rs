//! GPU discovery through nvml-wrapper: one NVML session ([`Session`]) for the daemon's life,
//! and [`Inventory`] snapshots of the node: GPUs, MIG state and instances, NUMA, NVLink, PCIe
//! topology. No code here knows whether the library is a driver or the simulated node.

mod inventory;
mod library;
pub(crate) mod mig_calls;
mod reset;

use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;

pub use inventory::*;
pub use library::{SIM_LIB_ENV, SIM_LIB_NAME, Source, sim_library};
pub use reset::ResetError;

/// Why discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("cannot load NVML from {}: {source}", path.display())]
    Load { path: PathBuf, source: NvmlError },
    #[error(
        "no NVIDIA driver: cannot load {} ({reason}); the dynamic loader looked in {searched}. Install the \
         NVIDIA driver, set nvml_library to its libnvidia-ml.so.1, or run the simulated node with --sim \
         (or sim = true)",
        library.display()
    )]
    NoDriver { library: PathBuf, searched: String, reason: String },
    #[error("no simulated driver library: {why}")]
    NoSimLibrary { why: String },
    #[error("GPU {index}: {what}: {source}")]
    Query { index: u32, what: &'static str, source: NvmlError },
    #[error("{what}: {source}")]
    System { what: &'static str, source: NvmlError },
}

/// The daemon's NVML session: the loaded library and where it came from.
pub struct Session {
    nvml: Nvml,
    library: PathBuf,
    source: Source,
}

impl Session {
    /// Loads NVML: `configured` (`nvml_library`), the simulated node when `sim`, else the
    /// driver's (never the simulator unasked). Logs the choice first.
    pub fn open(configured: Option<&Path>, sim: bool) -> Result<Session, DiscoveryError> {
        Session::open_in(configured, sim, Path::new("/"))
    }

    /// [`Session::open`], with the driver's library looked for under `driver_root`
    /// (`injection.driver_root`: a daemon in a container sees the host's driver mounted there).
    pub fn open_in(configured: Option<&Path>, sim: bool, driver_root: &Path) -> Result<Session, DiscoveryError> {
        let (nvml, library, source) = library::load(configured, sim, driver_root)?;
        Ok(Session { nvml, library, source })
    }

    /// The NVML handle, for the other modules' calls.
    pub fn nvml(&self) -> &Nvml {
        &self.nvml
    }

    /// The library loaded.
    pub fn library(&self) -> &Path {
        &self.library
    }

    /// Why this library.
    pub fn source(&self) -> Source {
        self.source
    }

    /// A snapshot of the node.
    pub fn inventory(&self) -> Result<Inventory, DiscoveryError> {
        let nvml = &self.nvml;
        let sys = |what| move |source| DiscoveryError::System { what, source };
        let count = nvml.device_count().map_err(sys("device count"))?;
        let mut gpus = Vec::new();
        for index in 0..count {
            gpus.push(self.gpu(index)?);
        }
        // NVLink peers: map each active link's remote PCI bus id to a GPU.
        let by_bus: Vec<(String, u32)> = gpus.iter().map(|g| (g.pci_bus_id.to_ascii_lowercase(), g.index)).collect();
        for g in &mut gpus {
            let dev = nvml.device_by_index(g.index).map_err(|source| DiscoveryError::Query {
                index: g.index,
                what: "handle",
                source,
            })?;
            let mut peers = Vec::new();
            // NVML_NVLINK_MAX_LINKS: 18 on Hopper.
            for link in 0..18 {
                let l = dev.link_wrapper_for(link);
                if !l.is_active().unwrap_or(false) {
                    continue;
                }
                if let Ok(remote) = l.remote_pci_info() {
                    let bus = remote.bus_id.to_ascii_lowercase();
                    if let Some(&(_, peer)) = by_bus.iter().find(|(b, _)| *b == bus)
                        && peer != g.index
                        && !peers.contains(&peer)
                    {
                        peers.push(peer);
                    }
                }
            }
            // Through an NVSwitch fabric a link's far end is the switch: ask NVML whether
            // peer traffic goes over NVLink, as `nvidia-smi topo -p2p n` does.
            for other in 0..count {
                if other == g.index || peers.contains(&other) {
                    continue;
                }
                let Ok(od) = nvml.device_by_index(other) else { continue };
                if matches!(dev.p2p_status(&od, P2pCapabilitiesIndex::NvLink), Ok(P2pStatus::Ok)) {
                    peers.push(other);
                }
            }
            peers.sort_unstable();
            g.nvlink_peers = peers;
        }
        let mut topology = Vec::new();
        for a in 0..count {
            for b in a + 1..count {
                let (da, db) = match (nvml.device_by_index(a), nvml.device_by_index(b)) {
                    (Ok(x), Ok(y)) => (x, y),
                    _ => continue,
                };
                if let Ok(level) = da.topology_common_ancestor(db) {
                    topology.push(PairTopology { a, b, ancestor: ancestor(level) });
                }
            }
        }
        Ok(Inventory {
            library: self.library.clone(),
            driver_version: nvml.sys_driver_version().map_err(sys("driver version"))?,
            cuda_driver_version: nvml.sys_cuda_driver_version().unwrap_or(0),
            gpus,
            topology,
        })
    }

    fn gpu(&self, index: u32) -> Result<Gpu, DiscoveryError> {
        let nvml = &self.nvml;
        let q = |what: &'static str| move |source| DiscoveryError::Query { index, what, source };
        let dev = nvml.device_by_index(index).map_err(q("handle"))?;
        let pci_bus_id = dev.pci_info().map_err(q("PCI info"))?.bus_id;
        let numa_node = dev.numa_node_id().ok().or_else(|| sysfs_numa_node(&pci_bus_id));
        let memory_total = dev.memory_info().map_err(q("memory info"))?.total;
        let mig = match dev.mig_mode() {
            Ok(mode) => Some(self.mig_info(&dev, index, mode.current != 0, mode.pending != 0, memory_total)?),
            Err(NvmlError::NotSupported) => None,
            Err(e) => return Err(q("MIG mode")(e)),
        };
        let processes = dev.running_compute_processes().map_err(q("processes"))?.iter().map(|p| p.pid).collect();
        Ok(Gpu {
            index,
            uuid: dev.uuid().map_err(q("UUID"))?,
            name: dev.name().map_err(q("name"))?,
            memory_total,
            pci_bus_id,
            numa_node,
            // /dev/nvidia<minor>; a platform without device files (or a driver refusing) has none.
            minor: dev.minor_number().ok(),
            mig,
            nvlink_peers: Vec::new(),
            processes,
        })
    }

    fn mig_info(
        &self,
        dev: &nvml_wrapper::Device<'_>,
        index: u32,
        current: bool,
        pending: bool,
        memory_total: u64,
    ) -> Result<MigInfo, DiscoveryError> {
        let nvml = &self.nvml;
        let q = |what: &'static str| move |source| DiscoveryError::Query { index, what, source };
        let mut profiles = Vec::new();
        for raw in mig_calls::profiles(nvml, dev).map_err(q("MIG profiles"))? {
            let i = raw.info;
            let placements = mig_calls::possible_placements(nvml, dev, i.id).map_err(q("MIG placements"))?;
            let media = raw.nvml_profile == nvml_wrapper_sys::bindings::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1;
            profiles.push(GiProfile {
                name: raw.name.unwrap_or_else(|| profile_name(i.sliceCount, i.memorySizeMB, memory_total, media)),
                id: i.id,
                nvml_profile: raw.nvml_profile,
                slice_count: i.sliceCount,
                instance_count: i.instanceCount,
                memory_mib: i.memorySizeMB,
                multiprocessors: i.multiprocessorCount,
                placement_size: placements.first().map_or(0, |p| p.1),
                placements: placements.iter().map(|p| p.0).collect(),
            });
        }
        let compute_slices = profiles.iter().map(|p| p.slice_count).max().unwrap_or(0);
        let capability = MigCapability { profiles, compute_slices };
        let mut instances = Vec::new();
        if current {
            for p in &capability.profiles {
                for gi in mig_calls::gpu_instances(nvml, dev, p.id, p.instance_count).map_err(q("GPU instances"))? {
                    instances.push(MigInstance {
                        gi_id: gi.id,
                        profile: p.name.clone(),
                        profile_id: gi.profile_id,
                        start: gi.start,
                        size: gi.size,
                        devices: Vec::new(),
                    });
                }
            }
            instances.sort_by_key(|g| g.gi_id);
            let max = dev.mig_device_count().map_err(q("MIG device count"))?;
            for i in 0..max {
                let mig = match dev.mig_device_by_index(i) {
                    Ok(m) => m,
                    Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
                    Err(e) => return Err(q("MIG device")(e)),
                };
                let (gi_id, ci_id) = mig_calls::mig_ids(nvml, &mig).map_err(q("MIG device ids"))?;
                let device = MigDevice {
                    uuid: mig.uuid().map_err(q("MIG device UUID"))?,
                    gi_id,
                    ci_id,
                    memory_total: mig.memory_info().map_err(q("MIG device memory"))?.total,
                    processes: mig
                        .running_compute_processes()
                        .map_err(q("MIG device processes"))?
                        .iter()
                        .map(|p| p.pid)
                        .collect(),
                };
                if let Some(gi) = instances.iter_mut().find(|g| g.gi_id == gi_id) {
                    gi.devices.push(device);
                }
            }
        }
        let switches_in_place = matches!(
            dev.architecture(),
            Ok(DeviceArchitecture::Hopper | DeviceArchitecture::Blackwell | DeviceArchitecture::Unknown)
        );
        Ok(MigInfo { current, pending, switches_in_place, capability, instances })
    }
}

fn ancestor(level: TopologyLevel) -> Ancestor {
    match level {
        TopologyLevel::Internal => Ancestor::Internal,
        TopologyLevel::Single => Ancestor::Single,
        TopologyLevel::Multiple => Ancestor::Multiple,
        TopologyLevel::HostBridge => Ancestor::HostBridge,
        TopologyLevel::Node => Ancestor::Node,
        TopologyLevel::System => Ancestor::System,
    }
}

/// `/sys/bus/pci/devices/<domain:bus:dev.fn>/numa_node` (NVML's bus id has an 8-digit domain;
/// sysfs a 4-digit one). `-1` means none.
fn sysfs_numa_node(bus_id: &str) -> Option<u32> {
    let id = bus_id.to_ascii_lowercase();
    let short = match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => format!("{}:{rest}", &domain[domain.len() - 4..]),
        _ => id,
    };
    let text = std::fs::read_to_string(format!("/sys/bus/pci/devices/{short}/numa_node")).ok()?;
    text.trim().parse::<i64>().ok().and_then(|n| u32::try_from(n).ok())
}
