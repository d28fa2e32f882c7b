//! The devices this node publishes for DRA, from the inventory: a whole GPU (MIG off), one
//! shareable device per such GPU (many claims at once, each consuming `memory` bytes and `sm`
//! percent), and every MIG device that exists. Names are DNS labels the scheduler and the kubelet
//! hand back; [`DraDevice::name`] is how a claim's result is mapped to a physical UUID.
//!
//! Also Kubernetes quantities (`8Gi`, `30`, `1500M`): parsed to integers, written canonically.

use crate::device_health::{Health, NodeHealth};
use crate::discovery::{Gpu, Inventory, architecture};
use crate::holdings::Holdings;

/// What kind of device a published one is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DraKind {
    /// A whole GPU, exclusively.
    Gpu,
    /// A part of a whole GPU: `memory` and `sm` consumed per claim.
    Shared,
    /// An existing MIG device (GPU instance `gi`, compute instance `ci`).
    Mig { profile: String, gi: u32, ci: u32 },
    /// A MIG placement NodePrepareResources creates on demand (dynamic MIG, `dynamic_mig`):
    /// it consumes its GPU's shared counters, so the scheduler places no two overlapping ones.
    MigPlacement(MigPlacement),
}

/// A GPU-instance profile at one placement, and the counters it takes from its GPU's set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigPlacement {
    /// `3g.40gb`.
    pub profile: String,
    /// NVML's GPU-instance profile id.
    pub profile_id: u32,
    /// First memory slice, and memory slices spanned.
    pub start: u32,
    pub size: u32,
    /// Streaming multiprocessors of the instance.
    pub multiprocessors: u32,
    /// The GPU's counter set (the same for every placement of one GPU).
    pub counters: GpuCounters,
}

/// One GPU's shared counters: what its placements consume, so that the scheduler never picks
/// two that do not fit together (KEP-4815, as NVIDIA's driver models MIG): memory bytes,
/// multiprocessors, and one counter of 1 per free memory slice (which encodes placement).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuCounters {
    /// `gpu-<index>-counter-set`.
    pub name: String,
    pub memory: u64,
    pub multiprocessors: u32,
    /// The memory slices no MIG instance outside dynamic MIG holds.
    pub memory_slices: Vec<u32>,
}

/// A shared counter's name for memory slice `i`.
pub fn memory_slice_counter(i: u32) -> String {
    format!("memory-slice-{i}")
}

/// One published device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraDevice {
    /// The device name in the slice: `gpu-<index>`, `gpu-<index>-shared`, `gpu-<index>-mig-<gi>-<ci>`.
    pub name: String,
    pub kind: DraKind,
    /// The UUID the container sees: the GPU's, or the MIG device's.
    pub uuid: String,
    /// The parent GPU.
    pub gpu_index: u32,
    pub gpu_uuid: String,
    pub product: String,
    /// Device memory in bytes (the MIG device's for MIG; for a shared device, what the node
    /// API's own allocations leave of its GPU: [`without_node_api`]).
    pub memory: u64,
    /// SM percent a shared device offers its claims (100 less the node API's strict shares);
    /// 100 for the others.
    pub sm: u32,
    pub driver_version: String,
    /// `12.4` from NVML's CUDA driver version.
    pub cuda_driver_version: String,
    pub numa_node: Option<u32>,
    pub pci_bus_id: String,
    /// In service, or out with the health monitor's reason.
    pub health: Health,
}

impl DraDevice {
    /// `Hopper`, `Ampere`, … from the product name; `None` when not known.
    pub fn architecture(&self) -> Option<&'static str> {
        architecture(&self.product).map(|(a, _)| a)
    }

    /// The CUDA compute capability (`9.0`) from the product name; `None` when not known.
    pub fn compute_capability(&self) -> Option<&'static str> {
        architecture(&self.product).map(|(_, cc)| cc)
    }
}

/// The devices of `inv`'s GPUs that `include` accepts (mode `both` keeps the device plugin's
/// GPUs out), each marked as `health` says of it.
pub fn from_inventory(inv: &Inventory, include: impl Fn(&Gpu) -> bool, health: &NodeHealth) -> Vec<DraDevice> {
    let mut out = Vec::new();
    for g in inv.gpus.iter().filter(|g| include(g)) {
        let base = DraDevice { health: health.of(g.index, &g.uuid), ..gpu_device(inv, g) };
        match &g.mig {
            Some(mig) if mig.current => {
                for inst in &mig.instances {
                    for d in &inst.devices {
                        out.push(DraDevice {
                            name: format!("gpu-{}-mig-{}-{}", g.index, d.gi_id, d.ci_id),
                            kind: DraKind::Mig { profile: inst.profile.clone(), gi: d.gi_id, ci: d.ci_id },
                            uuid: d.uuid.clone(),
                            memory: d.memory_total,
                            health: health.of(g.index, &d.uuid),
                            ..base.clone()
                        });
                    }
                }
            }
            _ => {
                out.push(DraDevice { name: format!("gpu-{}-shared", g.index), kind: DraKind::Shared, ..base.clone() });
                out.push(base);
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Takes what the node API's own allocations hold ([`Holdings::node_api`]; not claims: the
/// scheduler counts those itself) out of what is published, so the scheduler
/// allocates no claim that prepare would refuse for want of room: a GPU or MIG device it holds
/// any of is left out (a claim would get it whole), a shared device offers what is left of its
/// GPU (left out when that is under one request's step, `min_memory`: no claim can hold a part
/// of it then, so none prepared loses its device).
pub fn without_node_api(devices: Vec<DraDevice>, held: &Holdings, min_memory: u64) -> Vec<DraDevice> {
    devices
        .into_iter()
        .filter_map(|mut d| {
            let on = |uuid: &str| held.node_api(uuid);
            match d.kind {
                DraKind::Gpu | DraKind::Mig { .. } => on(&d.uuid).is_none().then_some(d),
                DraKind::Shared => match on(&d.gpu_uuid) {
                    None => Some(d),
                    Some(h) => {
                        let memory = d.memory.saturating_sub(h.memory);
                        // SM never takes it out: work-conserving claims are not summed, and one
                        // prepared must stay published for the kubelet's retries (the slice
                        // offers at least 1%; a strict claim over what is left is refused).
                        let sm = 100u32.saturating_sub(h.sm).max(1);
                        (!h.whole && memory >= min_memory).then(|| {
                            (d.memory, d.sm) = (memory, sm);
                            d
                        })
                    }
                },
                DraKind::MigPlacement(_) => Some(d),
            }
        })
        .collect()
}

/// GPU `g` as a whole-GPU device (`gpu-<index>`, healthy): what every device of it starts from.
pub fn gpu_device(inv: &Inventory, g: &Gpu) -> DraDevice {
    let cuda = format!("{}.{}", inv.cuda_driver_version / 1000, (inv.cuda_driver_version % 1000) / 10);
    DraDevice {
        name: format!("gpu-{}", g.index),
        kind: DraKind::Gpu,
        uuid: g.uuid.clone(),
        gpu_index: g.index,
        gpu_uuid: g.uuid.clone(),
        product: g.name.clone(),
        memory: g.memory_total,
        sm: 100,
        driver_version: inv.driver_version.clone(),
        cuda_driver_version: cuda,
        numa_node: g.numa_node,
        pci_bus_id: g.pci_bus_id.clone(),
        health: Health::Healthy,
    }
}

/// A Kubernetes quantity as an integer: `8Gi`, `1500M`, `30`, `0.5Gi`, `1e3`. `None` for
/// anything else, a fraction of one unit left over (`1500m`), or overflow.
pub fn parse_quantity(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, suffix) = t.split_at(split);
    let (mul, div): (u128, u128) = match suffix {
        "" => (1, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        "m" => (1, 1000),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000, 1),
        s if s.starts_with(['e', 'E']) => (10u128.checked_pow(s[1..].parse().ok()?)?, 1),
        _ => return None,
    };
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && frac.is_empty() {
        return None;
    }
    let digits = format!("{whole}{frac}");
    let scale = 10u128.checked_pow(u32::try_from(frac.len()).ok()?)?;
    let n: u128 = digits.parse().ok()?;
    let value = n.checked_mul(mul)?;
    let den = scale.checked_mul(div)?;
    if value % den != 0 {
        return None;
    }
    u64::try_from(value / den).ok()
}

/// An integer as a quantity: binary suffixes when exact (`80Gi`), else plain digits.
pub fn format_bytes(n: u64) -> String {
    for (shift, suffix) in [(40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")] {
        if n != 0 && n.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", n >> shift);
        }
    }
    n.to_string()
}

#[cfg(test)]
impl DraDevice {
    /// A whole, healthy-unless-said H100 named `name` (UUID `GPU-<name>`), for the DRA tests.
    pub(crate) fn test_gpu(name: &str, unhealthy: Option<&str>) -> DraDevice {
        DraDevice {
            name: name.into(),
            kind: DraKind::Gpu,
            uuid: format!("GPU-{name}"),
            gpu_index: 0,
            gpu_uuid: format!("GPU-{name}"),
            product: "NVIDIA H100".into(),
            memory: 80 << 30,
            sm: 100,
            driver_version: "550.54.15".into(),
            cuda_driver_version: "12.4".into(),
            numa_node: None,
            pci_bus_id: String::new(),
            health: unhealthy.map_or(Health::Healthy, |why| Health::Unhealthy(why.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::holdings::{Holder, device_key};

    #[test]
    fn what_the_node_api_holds_is_taken_out_of_what_is_published() {
        let gpu = |i: u32| DraDevice {
            name: format!("gpu-{i}"),
            uuid: format!("GPU-{i}"),
            gpu_uuid: format!("GPU-{i}"),
            gpu_index: i,
            ..DraDevice::test_gpu("x", None)
        };
        let shared = |i: u32| DraDevice { name: format!("gpu-{i}-shared"), kind: DraKind::Shared, ..gpu(i) };
        let mig = DraDevice {
            name: "gpu-2-mig-1-0".into(),
            kind: DraKind::Mig { profile: "3g.40gb".into(), gi: 1, ci: 0 },
            uuid: "MIG-a".into(),
            memory: 40 << 30,
            ..gpu(2)
        };
        let all = vec![gpu(0), shared(0), gpu(1), shared(1), mig.clone(), gpu(3), shared(3), gpu(4), shared(4)];
        let mut held = Holdings::default();
        let mut node_api = |uuid: &str, part: (Option<u64>, u32)| {
            held.devices.entry(device_key(uuid)).or_default().of_mut(Holder::NodeApi).add(part);
        };
        // A carved share of GPU 0: gpu-0 goes, gpu-0-shared offers the rest.
        node_api("GPU-0", (Some(30 << 30), 40));
        // GPU 1 given whole: both go.
        node_api("GPU-1", (None, 100));
        // The MIG device given whole (named in another case).
        node_api("mig-a", (None, 100));
        // GPU 3 all but 100 MiB carved: less than one request's step is left.
        node_api("GPU-3", (Some((80 << 30) - (100 << 20)), 10));
        // The kubelet's and the claims' records are the scheduler's to count, not taken out.
        held.devices.entry(device_key("GPU-0")).or_default().of_mut(Holder::Claim).add((Some(40 << 30), 50));
        held.devices.entry(device_key("GPU-4")).or_default().of_mut(Holder::Kubelet).add((None, 100));
        let out = without_node_api(all.clone(), &held, 256 << 20);
        let names: Vec<&str> = out.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-0-shared", "gpu-4", "gpu-4-shared"]);
        assert_eq!((out[0].memory, out[0].sm), (50 << 30, 60));
        // Nothing held: published as it is.
        assert_eq!(without_node_api(all.clone(), &Holdings::default(), 256 << 20), all);
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("8Gi"), Some(8 << 30));
        assert_eq!(parse_quantity("30"), Some(30));
        assert_eq!(parse_quantity("1500M"), Some(1_500_000_000));
        assert_eq!(parse_quantity("0.5Gi"), Some(1 << 29));
        assert_eq!(parse_quantity("1e3"), Some(1000));
        assert_eq!(parse_quantity("2000m"), Some(2));
        assert_eq!(parse_quantity("1500m"), None, "a fraction of one is not a count");
        assert_eq!(parse_quantity("8GB"), None);
        assert_eq!(parse_quantity("-1"), None);
        assert_eq!(parse_quantity(""), None);
        assert_eq!(parse_quantity("."), None);
        assert_eq!(parse_quantity("99999999999Ei"), None, "overflow");
        assert_eq!(format_bytes(80 << 30), "80Gi");
        assert_eq!(format_bytes(256 << 20), "256Mi");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_bytes(0), "0");
        for n in [0, 1, 1 << 30, 81_559_289_856, 12_345] {
            assert_eq!(parse_quantity(&format_bytes(n)), Some(n));
        }
    }
}
