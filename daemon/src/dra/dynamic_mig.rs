//! Dynamic MIG (partitionable devices, KEP-4815): on a GPU whose MIG mode is on and that no
//! `[partitions]` entry manages, every placement of every GPU-instance profile (NVML's possible
//! placements) is published as a device that consumes its GPU's shared counters (memory,
//! multiprocessors, one counter per memory slice), so kube-scheduler may pick a MIG profile that
//! does not exist yet and never two that overlap. NodePrepareResources creates the instance at
//! that placement ([`DynamicMig::prepare`]); NodeUnprepareResources destroys it.
//!
//! Which instances tesserad made, and for which claim, is kept in a small journal
//! (`<state_dir>/dra-dynamic-mig.state`, JSON, written durably before NVML is asked to create anything):
//!
//! - an instance it made stays published as its placement device (allocated in the scheduler's
//!   view), never also as an existing MIG device another claim could get;
//! - a prepare repeated after a crash (kill -9 after the instance was made, before the kubelet was
//!   answered) finds its journal entry and reuses the instance: never two;
//! - any other instance (made by an operator or a `[partitions]` layout) is published as today,
//!   and the placements it overlaps are not; its memory, multiprocessors and memory slices leave
//!   the counter set.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::devices::{DraDevice, DraKind, GpuCounters, MigPlacement, gpu_device};
use crate::device_health::NodeHealth;
use crate::discovery::{Gpu, Inventory, MigDevice};
use crate::node::NodeController;
use crate::node::mig::Placement;
use crate::state::store::DYNAMIC_MIG_FILE;

/// One instance dynamic MIG made (or is about to make) for a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Made {
    pub claim_uid: String,
    pub gpu_uuid: String,
    pub profile: String,
    pub profile_id: u32,
    pub start: u32,
}

impl Made {
    pub fn placement(&self) -> Placement {
        Placement {
            gpu_uuid: self.gpu_uuid.clone(),
            profile: self.profile.clone(),
            profile_id: self.profile_id,
            start: self.start,
        }
    }

    fn is_at(&self, p: &Placement) -> bool {
        self.gpu_uuid == p.gpu_uuid && self.profile_id == p.profile_id && self.start == p.start
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct JournalFile {
    version: u32,
    instances: Vec<Made>,
}

/// The journal of instances dynamic MIG made, on disk and in memory.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    entries: Mutex<Vec<Made>>,
}

impl Journal {
    /// Loads `<state_dir>/dra-dynamic-mig.state` (none: empty). A damaged file is copied aside
    /// (`dra-dynamic-mig.state.damaged-<unix seconds>`) with an error logged, and the journal starts
    /// empty: the instances it named are then published as existing MIG devices.
    pub fn open(state_dir: &Path) -> Journal {
        let path = state_dir.join(DYNAMIC_MIG_FILE);
        let entries = match std::fs::read(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, "cannot read the dynamic MIG journal; starting empty");
                Vec::new()
            }
            Ok(bytes) => match parse(&bytes) {
                Ok(entries) => entries,
                Err(why) => {
                    let secs =
                        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
                    let aside = path.with_file_name(format!("{DYNAMIC_MIG_FILE}.damaged-{secs}"));
                    let copied = std::fs::copy(&path, &aside).map(|_| aside.display().to_string());
                    tracing::error!(
                        file = %path.display(),
                        reason = %why,
                        copied_to = %copied.as_deref().unwrap_or("(copy failed)"),
                        "damaged dynamic MIG journal: set aside; the instances it named count as made by someone else"
                    );
                    Vec::new()
                }
            },
        };
        Journal { path, entries: Mutex::new(entries) }
    }

    /// Every entry.
    pub fn entries(&self) -> Vec<Made> {
        self.lock().clone()
    }

    /// The placements of every entry (what [`with_placements`] treats as made by dynamic MIG).
    pub fn placements(&self) -> BTreeSet<Placement> {
        self.lock().iter().map(Made::placement).collect()
    }

    /// Drops the entries whose instance `inv` does not show (a crash before NVML made it, a GPU
    /// reset since): they protect nothing, and a stale one would make an instance someone else
    /// creates there later look like dynamic MIG's. For start-up, before any prepare; entries of
    /// GPUs `inv` lacks are kept (the GPU may come back). Returns how many went.
    pub fn forget_missing(&self, inv: &Inventory) -> Result<usize, String> {
        let entries = self.entries();
        let kept: Vec<Made> = entries
            .iter()
            .filter(|m| match inv.gpu_by_uuid(&m.gpu_uuid) {
                None => true,
                Some(g) => g
                    .mig
                    .iter()
                    .flat_map(|mig| &mig.instances)
                    .any(|gi| gi.profile_id == m.profile_id && gi.start == m.start),
            })
            .cloned()
            .collect();
        let gone = entries.len() - kept.len();
        if gone > 0 {
            self.store(kept)?;
        }
        Ok(gone)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Made>> {
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Replaces the entries, durably (the old file or the new one after a crash).
    fn store(&self, entries: Vec<Made>) -> Result<(), String> {
        let file = JournalFile { version: 1, instances: entries.clone() };
        let bytes = serde_json::to_vec_pretty(&file).map_err(|e| format!("dynamic MIG journal: {e}"))?;
        crate::state::durable::write_file(&self.path, &bytes, 0o600)
            .map_err(|e| format!("writing the dynamic MIG journal {}: {e}", self.path.display()))?;
        *self.lock() = entries;
        Ok(())
    }
}

/// The journal's text as entries, checked: version 1, non-empty ids, no placement twice.
fn parse(bytes: &[u8]) -> Result<Vec<Made>, String> {
    let file: JournalFile = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if file.version != 1 {
        return Err(format!("version {} (this tesserad writes 1)", file.version));
    }
    let mut seen = BTreeSet::new();
    for m in &file.instances {
        if m.claim_uid.is_empty() || m.gpu_uuid.is_empty() || m.profile.is_empty() {
            return Err(format!("an entry without claim UID, GPU UUID or profile: {m:?}"));
        }
        if !seen.insert(m.placement()) {
            return Err(format!("{} is listed twice", m.placement()));
        }
    }
    Ok(file.instances)
}

/// What dynamic MIG needs of the node: make and destroy one instance at a placement. The daemon's
/// [`NodeController`]; a table in tests.
pub trait MigControl: Send + Sync + 'static {
    /// See [`NodeController::ensure_mig_placement`].
    fn ensure(&self, p: &Placement, adopt: bool) -> Result<MigDevice, String>;
    /// See [`NodeController::remove_mig_placement`].
    fn remove(&self, p: &Placement) -> Result<bool, String>;
    /// The MIG device of the instance at `p`'s placement, if there is one.
    fn instance_at(&self, p: &Placement) -> Result<Option<MigDevice>, String>;
}

impl MigControl for NodeController {
    fn ensure(&self, p: &Placement, adopt: bool) -> Result<MigDevice, String> {
        self.ensure_mig_placement(p, adopt)
    }

    fn remove(&self, p: &Placement) -> Result<bool, String> {
        self.remove_mig_placement(p)
    }

    fn instance_at(&self, p: &Placement) -> Result<Option<MigDevice>, String> {
        let inv = self.session().inventory().map_err(|e| format!("discovery: {e}"))?;
        Ok(inv
            .gpu_by_uuid(&p.gpu_uuid)
            .and_then(|g| g.mig.as_ref())
            .and_then(|m| m.instances.iter().find(|gi| gi.profile_id == p.profile_id && gi.start == p.start))
            .and_then(|gi| gi.devices.first().cloned()))
    }
}

/// Prepare and unprepare of placement devices: the journal and the node's MIG calls, one at a
/// time.
pub struct DynamicMig {
    pub journal: Arc<Journal>,
    pub mig: Arc<dyn MigControl>,
    serial: Mutex<()>,
}

impl DynamicMig {
    pub fn new(journal: Arc<Journal>, mig: Arc<dyn MigControl>) -> DynamicMig {
        DynamicMig { journal, mig, serial: Mutex::new(()) }
    }

    /// The MIG device for claim `claim_uid`'s placement device `device`: made now, or the one an
    /// earlier prepare of the same claim made (after a crash too). Refused when another claim's
    /// instance is there, when the placement is taken by an instance dynamic MIG did not make,
    /// or when the GPU cannot host it now (MIG mode off, an overlapping instance).
    pub fn prepare(&self, claim_uid: &str, device: &DraDevice) -> Result<MigDevice, String> {
        let DraKind::MigPlacement(mp) = &device.kind else {
            return Err(format!("device {} is not a dynamic MIG placement", device.name));
        };
        let _one = self.serial.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let p = Placement {
            gpu_uuid: device.gpu_uuid.clone(),
            profile: mp.profile.clone(),
            profile_id: mp.profile_id,
            start: mp.start,
        };
        let mut entries = self.journal.entries();
        let adopt = match entries.iter().position(|m| m.is_at(&p)) {
            Some(i) if entries[i].claim_uid == claim_uid => true,
            Some(i) => {
                // Another claim's entry: in force while its instance exists; stale otherwise.
                let other = entries[i].claim_uid.clone();
                if self.mig.instance_at(&p).map_err(|e| format!("device {}: {e}", device.name))?.is_some() {
                    return Err(format!(
                        "device {}: {p} is held by claim {other}'s MIG instance; the claim must be allocated again",
                        device.name
                    ));
                }
                tracing::info!(claim = claim_uid, device = %device.name, "a stale dynamic MIG entry of claim {other} (no instance) is replaced");
                entries[i].claim_uid = claim_uid.to_owned();
                self.journal.store(entries)?;
                false
            }
            None => {
                entries.push(Made {
                    claim_uid: claim_uid.to_owned(),
                    gpu_uuid: p.gpu_uuid.clone(),
                    profile: p.profile.clone(),
                    profile_id: p.profile_id,
                    start: p.start,
                });
                // Written before NVML is asked: a crash after the instance exists finds it ours.
                self.journal.store(entries)?;
                false
            }
        };
        match self.mig.ensure(&p, adopt) {
            Ok(made) => {
                tracing::info!(claim = claim_uid, device = %device.name, mig = %made.uuid, reused = adopt, "dynamic MIG instance ready");
                Ok(made)
            }
            Err(e) => {
                if !adopt {
                    // Nothing was made: the entry goes.
                    let mut entries = self.journal.entries();
                    entries.retain(|m| !(m.is_at(&p) && m.claim_uid == claim_uid));
                    self.journal.store(entries)?;
                }
                Err(format!("device {}: {e}", device.name))
            }
        }
    }

    /// Destroys the instances claim `claim_uid` had made (after its allocation is released) and
    /// forgets them. Nothing to do is not an error; an instance still in use is (the kubelet
    /// retries).
    pub fn unprepare(&self, claim_uid: &str) -> Result<usize, String> {
        let _one = self.serial.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mine: Vec<Made> = self.journal.entries().into_iter().filter(|m| m.claim_uid == claim_uid).collect();
        let mut destroyed = 0;
        for m in &mine {
            let p = m.placement();
            if self.mig.remove(&p)? {
                destroyed += 1;
                tracing::info!(claim = claim_uid, placement = %p, "dynamic MIG instance destroyed");
            }
            let mut entries = self.journal.entries();
            entries.retain(|e| e != m);
            self.journal.store(entries)?;
        }
        Ok(destroyed)
    }
}

/// Whether tesserad may create MIG instances on `gpu`: MIG mode on now and after the next reset.
pub fn allows_dynamic(gpu: &Gpu) -> bool {
    gpu.mig.as_ref().is_some_and(|m| m.current && m.pending && !m.capability.profiles.is_empty())
}

/// A profile name as a DNS label part: `3g.40gb` → `3g40gb`, `1g.10gb+me` → `1g10gbme`.
fn label(profile: &str) -> String {
    profile.chars().filter(char::is_ascii_alphanumeric).map(|c| c.to_ascii_lowercase()).collect()
}

/// `devices` (from [`super::devices::from_inventory`]) with dynamic MIG applied on the GPUs
/// `eligible` accepts that [`allow it`](allows_dynamic): the MIG devices of instances dynamic MIG
/// made (`made`) leave, and one device per placement that no other instance overlaps comes in,
/// `gpu-<index>-mig-<profile>-<start>`, consuming the GPU's counter set. Health marks as for the
/// other devices (the GPU's, or the made instance's MIG device's).
pub fn with_placements(
    mut devices: Vec<DraDevice>,
    inv: &Inventory,
    eligible: impl Fn(&Gpu) -> bool,
    made: &BTreeSet<Placement>,
    health: &NodeHealth,
) -> Vec<DraDevice> {
    for g in inv.gpus.iter().filter(|g| eligible(g) && allows_dynamic(g)) {
        let mig = g.mig.as_ref().expect("allows_dynamic");
        let is_made = |profile_id: u32, start: u32| {
            made.iter().any(|p| p.gpu_uuid == g.uuid && p.profile_id == profile_id && p.start == start)
        };
        let (ours, foreign): (Vec<_>, Vec<_>) = mig.instances.iter().partition(|gi| is_made(gi.profile_id, gi.start));
        let our_uuids: BTreeSet<&str> = ours.iter().flat_map(|gi| &gi.devices).map(|d| d.uuid.as_str()).collect();
        devices.retain(|d| !our_uuids.contains(d.uuid.as_str()));

        let profiles = &mig.capability.profiles;
        let all_slices = profiles.iter().flat_map(|p| p.placements.iter().map(move |s| s + p.placement_size)).max();
        let max_memory = profiles.iter().map(|p| p.memory_mib << 20).max().unwrap_or(0);
        let max_sms = profiles.iter().map(|p| p.multiprocessors).max().unwrap_or(0);
        let foreign_profile = |id: u32| profiles.iter().find(|p| p.id == id);
        let taken: BTreeSet<u32> = foreign.iter().flat_map(|gi| gi.start..gi.start + gi.size).collect();
        let counters = GpuCounters {
            name: format!("gpu-{}-counter-set", g.index),
            memory: max_memory.saturating_sub(
                foreign.iter().filter_map(|gi| foreign_profile(gi.profile_id)).map(|p| p.memory_mib << 20).sum(),
            ),
            multiprocessors: max_sms.saturating_sub(
                foreign.iter().filter_map(|gi| foreign_profile(gi.profile_id)).map(|p| p.multiprocessors).sum(),
            ),
            memory_slices: (0..all_slices.unwrap_or(0)).filter(|s| !taken.contains(s)).collect(),
        };
        let mut names = BTreeSet::new();
        for p in profiles {
            for &start in &p.placements {
                if (start..start + p.placement_size).any(|s| taken.contains(&s)) {
                    continue;
                }
                let name = format!("gpu-{}-mig-{}-{start}", g.index, label(&p.name));
                if !names.insert(name.clone()) {
                    tracing::warn!(gpu = g.index, profile = %p.name, "two MIG profiles share a device name; the second is not published");
                    continue;
                }
                // Its GPU's health, or that of the instance dynamic MIG made there.
                let instance = ours.iter().find(|gi| gi.profile_id == p.id && gi.start == start);
                let uuids = instance.into_iter().flat_map(|gi| &gi.devices).map(|d| d.uuid.as_str());
                let placement_health = health.of_any(g.index, std::iter::once(g.uuid.as_str()).chain(uuids));
                devices.push(DraDevice {
                    name,
                    kind: DraKind::MigPlacement(MigPlacement {
                        profile: p.name.clone(),
                        profile_id: p.id,
                        start,
                        size: p.placement_size,
                        multiprocessors: p.multiprocessors,
                        counters: counters.clone(),
                    }),
                    memory: p.memory_mib << 20,
                    health: placement_health,
                    ..gpu_device(inv, g)
                });
            }
        }
    }
    devices.sort_by(|a, b| a.name.cmp(&b.name));
    devices
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::discovery::{GiProfile, MigCapability, MigInfo, MigInstance};

    /// One H100 SXM5 with MIG on (`nvidia-smi mig -lgip` / `-lgipp`), SMs as the sim reports them.
    pub(crate) fn h100(instances: Vec<MigInstance>) -> Inventory {
        let p = |name: &str, id, slices, mib, sms, size, starts: &[u32]| GiProfile {
            name: name.into(),
            id,
            nvml_profile: 0,
            slice_count: slices,
            instance_count: 8 / size,
            memory_mib: mib,
            multiprocessors: sms,
            placement_size: size,
            placements: starts.to_vec(),
        };
        let profiles = vec![
            p("1g.10gb", 19, 1, 9_984, 16, 1, &[0, 1, 2, 3, 4, 5, 6]),
            p("1g.20gb", 15, 1, 20_096, 26, 2, &[0, 2, 4, 6]),
            p("2g.20gb", 14, 2, 20_096, 32, 2, &[0, 2, 4]),
            p("3g.40gb", 9, 3, 40_448, 60, 4, &[0, 4]),
            p("4g.40gb", 5, 4, 40_448, 64, 4, &[0]),
            p("7g.80gb", 0, 7, 81_152, 132, 8, &[0]),
        ];
        Inventory {
            library: PathBuf::new(),
            driver_version: "550.54.15".into(),
            cuda_driver_version: 12040,
            gpus: vec![Gpu {
                index: 0,
                uuid: "GPU-0".into(),
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_total: 80 << 30,
                pci_bus_id: String::new(),
                numa_node: Some(0),
                minor: Some(0),
                mig: Some(MigInfo {
                    current: true,
                    pending: true,
                    capability: MigCapability { profiles, compute_slices: 7 },
                    instances,
                    switches_in_place: true,
                }),
                nvlink_peers: Vec::new(),
                processes: Vec::new(),
            }],
            topology: Vec::new(),
        }
    }

    fn instance(gi_id: u32, profile: &str, profile_id: u32, start: u32, size: u32) -> MigInstance {
        MigInstance {
            gi_id,
            profile: profile.into(),
            profile_id,
            start,
            size,
            devices: vec![MigDevice {
                uuid: format!("MIG-{gi_id}"),
                gi_id,
                ci_id: 0,
                memory_total: 1 << 30,
                processes: Vec::new(),
            }],
        }
    }

    fn placements(devices: &[DraDevice]) -> Vec<&str> {
        devices.iter().filter(|d| matches!(d.kind, DraKind::MigPlacement(_))).map(|d| d.name.as_str()).collect()
    }

    pub(crate) fn publish(inv: &Inventory, made: &BTreeSet<Placement>) -> Vec<DraDevice> {
        let base = super::super::devices::from_inventory(inv, |_| true, &NodeHealth::default());
        with_placements(base, inv, |_| true, made, &NodeHealth::default())
    }

    #[test]
    fn an_empty_gpu_offers_every_placement_of_every_profile_against_one_counter_set() {
        let inv = h100(Vec::new());
        let d = publish(&inv, &BTreeSet::new());
        assert_eq!(placements(&d).len(), 7 + 4 + 3 + 2 + 1 + 1);
        assert!(placements(&d).contains(&"gpu-0-mig-3g40gb-4"));
        assert!(placements(&d).contains(&"gpu-0-mig-1g20gb-6"));
        let three = d.iter().find(|d| d.name == "gpu-0-mig-3g40gb-4").unwrap();
        let DraKind::MigPlacement(p) = &three.kind else { panic!() };
        assert_eq!((p.profile.as_str(), p.profile_id, p.start, p.size, p.multiprocessors), ("3g.40gb", 9, 4, 4, 60));
        assert_eq!(three.memory, 40_448 << 20);
        assert_eq!(three.gpu_uuid, "GPU-0");
        assert_eq!(p.counters.name, "gpu-0-counter-set");
        assert_eq!((p.counters.memory, p.counters.multiprocessors), (81_152 << 20, 132));
        assert_eq!(p.counters.memory_slices, (0..8).collect::<Vec<_>>());
        // Names are DNS labels.
        for n in placements(&d) {
            assert!(
                n.len() <= 63 && n.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{n}"
            );
        }
    }

    #[test]
    fn a_foreign_instance_stays_published_and_hides_what_it_overlaps_a_made_one_is_its_placement() {
        // An operator's 4g.40gb at 0..4 and dynamic MIG's 1g.10gb at 5.
        let inv = h100(vec![instance(1, "4g.40gb", 5, 0, 4), instance(2, "1g.10gb", 19, 5, 1)]);
        let made = BTreeSet::from([Placement {
            gpu_uuid: "GPU-0".into(),
            profile: "1g.10gb".into(),
            profile_id: 19,
            start: 5,
        }]);
        let d = publish(&inv, &made);
        let names: Vec<&str> = d.iter().map(|d| d.name.as_str()).collect();
        assert!(names.contains(&"gpu-0-mig-1-0"), "the foreign instance is an existing MIG device: {names:?}");
        assert!(!names.contains(&"gpu-0-mig-2-0"), "the made one is not published twice: {names:?}");
        assert_eq!(
            placements(&d),
            [
                "gpu-0-mig-1g10gb-4",
                "gpu-0-mig-1g10gb-5",
                "gpu-0-mig-1g10gb-6",
                "gpu-0-mig-1g20gb-4",
                "gpu-0-mig-1g20gb-6",
                "gpu-0-mig-2g20gb-4",
                "gpu-0-mig-3g40gb-4",
            ],
            "placements over slices 0..4 are gone; the made one's stays (the scheduler counts it)"
        );
        let DraKind::MigPlacement(p) = &d.iter().find(|d| d.name == "gpu-0-mig-3g40gb-4").unwrap().kind else {
            panic!()
        };
        assert_eq!(p.counters.memory_slices, [4, 5, 6, 7]);
        assert_eq!((p.counters.memory, p.counters.multiprocessors), ((81_152 - 40_448) << 20, 132 - 64));
    }

    #[test]
    fn mig_off_pending_off_or_ineligible_gpus_offer_no_placements() {
        let mut inv = h100(Vec::new());
        inv.gpus[0].mig.as_mut().unwrap().pending = false;
        assert!(placements(&publish(&inv, &BTreeSet::new())).is_empty(), "MIG turning off at the next reset");
        let mut inv = h100(Vec::new());
        inv.gpus[0].mig.as_mut().unwrap().current = false;
        assert!(placements(&publish(&inv, &BTreeSet::new())).is_empty(), "MIG on only after a reset");
        let inv = h100(Vec::new());
        let base = super::super::devices::from_inventory(&inv, |_| true, &NodeHealth::default());
        let d = with_placements(base, &inv, |_| false, &BTreeSet::new(), &NodeHealth::default());
        assert!(placements(&d).is_empty(), "a GPU a [partitions] entry manages");
        // An unhealthy GPU's placements are marked (and so leave the slice).
        let sick = NodeHealth::new(BTreeMap::from([(0, "XID 79".to_string())]), BTreeMap::new());
        let base = super::super::devices::from_inventory(&inv, |_| true, &sick);
        let d = with_placements(base, &inv, |_| true, &BTreeSet::new(), &sick);
        assert!(d.iter().all(|d| d.health.reason() == Some("XID 79")));
    }

    /// A node whose instances are a table: what NVML would do, and what it was asked.
    #[derive(Default)]
    struct FakeMig {
        instances: Mutex<BTreeMap<(u32, u32), String>>,
        created: Mutex<u32>,
        /// Set: every ensure is refused with this reason (the GPU cannot host anything now).
        refuse: Mutex<Option<String>>,
    }

    impl MigControl for FakeMig {
        fn ensure(&self, p: &Placement, adopt: bool) -> Result<MigDevice, String> {
            if let Some(why) = self.refuse.lock().unwrap().clone() {
                return Err(why);
            }
            let mut i = self.instances.lock().unwrap();
            let device = |uuid: &str| MigDevice {
                uuid: uuid.into(),
                gi_id: 1,
                ci_id: 0,
                memory_total: 1,
                processes: Vec::new(),
            };
            if let Some(uuid) = i.get(&(p.profile_id, p.start)) {
                return if adopt { Ok(device(uuid)) } else { Err(format!("{p} is taken by GPU instance 1")) };
            }
            let mut n = self.created.lock().unwrap();
            *n += 1;
            let uuid = format!("MIG-made-{n}");
            i.insert((p.profile_id, p.start), uuid.clone());
            Ok(device(&uuid))
        }

        fn remove(&self, p: &Placement) -> Result<bool, String> {
            Ok(self.instances.lock().unwrap().remove(&(p.profile_id, p.start)).is_some())
        }

        fn instance_at(&self, p: &Placement) -> Result<Option<MigDevice>, String> {
            let i = self.instances.lock().unwrap();
            Ok(i.get(&(p.profile_id, p.start)).map(|uuid| MigDevice {
                uuid: uuid.clone(),
                gi_id: 1,
                ci_id: 0,
                memory_total: 1,
                processes: Vec::new(),
            }))
        }
    }

    fn placement_device(start: u32) -> DraDevice {
        let inv = h100(Vec::new());
        publish(&inv, &BTreeSet::new()).into_iter().find(|d| d.name == format!("gpu-0-mig-3g40gb-{start}")).unwrap()
    }

    #[test]
    fn prepare_creates_once_survives_a_restart_and_unprepare_destroys() {
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeMig::default());
        let dm = DynamicMig::new(Arc::new(Journal::open(dir.path())), fake.clone());
        let dev = placement_device(4);
        let first = dm.prepare("uid-a", &dev).unwrap();
        assert_eq!(dm.prepare("uid-a", &dev).unwrap().uuid, first.uuid, "prepared twice, created once");
        assert_eq!(*fake.created.lock().unwrap(), 1);
        // A new process (kill -9 and restart) over the same journal and node: the same instance.
        let again = DynamicMig::new(Arc::new(Journal::open(dir.path())), fake.clone());
        assert_eq!(again.journal.entries().len(), 1);
        assert_eq!(again.prepare("uid-a", &dev).unwrap().uuid, first.uuid);
        assert_eq!(*fake.created.lock().unwrap(), 1, "never two");
        // Another claim handed the same placement (a scheduler bug, a stale allocation): refused.
        let e = again.prepare("uid-b", &dev).unwrap_err();
        assert!(e.contains("held by claim uid-a"), "{e}");
        // A stale entry (its instance gone, say after a GPU reset) does not block another claim.
        fake.instances.lock().unwrap().clear();
        let b = again.prepare("uid-b", &dev).unwrap();
        assert_ne!(b.uuid, first.uuid);
        assert_eq!(again.journal.entries()[0].claim_uid, "uid-b");
        assert_eq!(again.unprepare("uid-b").unwrap(), 1);
        again.prepare("uid-a", &dev).unwrap();
        // Unprepare destroys and forgets; twice is fine.
        assert_eq!(again.unprepare("uid-a").unwrap(), 1);
        assert!(fake.instances.lock().unwrap().is_empty());
        assert_eq!(again.unprepare("uid-a").unwrap(), 0);
        assert!(Journal::open(dir.path()).entries().is_empty());
    }

    #[test]
    fn a_foreign_instance_at_the_placement_or_a_refusal_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeMig::default());
        fake.instances.lock().unwrap().insert((9, 0), "MIG-operator".into());
        let dm = DynamicMig::new(Arc::new(Journal::open(dir.path())), fake.clone());
        let e = dm.prepare("uid-a", &placement_device(0)).unwrap_err();
        assert!(e.contains("gpu-0-mig-3g40gb-0") && e.contains("taken"), "{e}");
        assert!(dm.journal.entries().is_empty(), "the intent is dropped");
        *fake.refuse.lock().unwrap() = Some("GPU 0 has MIG mode off (pending off)".into());
        let e = dm.prepare("uid-a", &placement_device(4)).unwrap_err();
        assert!(e.contains("MIG mode off"), "{e}");
        assert!(Journal::open(dir.path()).entries().is_empty());
        assert_eq!(fake.instances.lock().unwrap().len(), 1, "the operator's instance is untouched");
        assert_eq!(dm.unprepare("uid-a").unwrap(), 0);
        assert_eq!(fake.instances.lock().unwrap().len(), 1);
    }

    /// Through the kubelet-facing driver: a placement claim prepared gets the MIG device's CDI
    /// name and one allocation of it; a claim the allocator refuses after its instance was made
    /// leaves no instance and no journal entry behind.
    #[tokio::test]
    async fn the_driver_makes_the_instance_and_a_refused_claim_leaves_none() {
        use k8s_openapi::api::resource::v1::ResourceClaim;
        use tessera_region::{ComputeMode, Priority};

        use crate::dra::prepare::tests::{Claims, Statuses};
        use crate::dra::prepare::{ClaimAllocations, ClaimOwner, DraDriver};
        use crate::dra::{ClaimDriver, ClaimRef};
        use crate::state::{AllocatedDevice, Allocation};

        /// Admits claims whose UID starts with "ok", recording what they hold.
        #[derive(Default)]
        struct Allocator(Mutex<Vec<(String, Vec<AllocatedDevice>)>>);
        impl ClaimAllocations for Allocator {
            fn allocate_claim(&self, owner: &ClaimOwner, devices: Vec<AllocatedDevice>) -> Result<Allocation, String> {
                if !owner.claim.uid.starts_with("ok") {
                    return Err("GPU 0 has no room".into());
                }
                self.0.lock().unwrap().push((owner.claim.uid.clone(), devices.clone()));
                Ok(Allocation {
                    id: "a1".into(),
                    resource: crate::allocator::DRA_RESOURCE.into(),
                    container: Default::default(),
                    source: crate::state::Source::NodeApi,
                    created_unix_ns: 0,
                    devices,
                    claim: Some(Box::new(crate::state::Claim {
                        owner: Some(owner.claim.uid.clone()),
                        lease: crate::state::Lease::None,
                    })),
                })
            }
            fn release_claim(&self, _: &str) -> Result<bool, String> {
                Ok(false)
            }
            fn claim_allocations(&self) -> Vec<Allocation> {
                Vec::new()
            }
        }
        let claim = |uid: &str| -> ResourceClaim {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "infer", "namespace": "ml", "uid": uid},
                "spec": {},
                "status": {"allocation": {"devices": {"results": [{"request": "mig", "driver": "gpu.tessera.io",
                    "pool": "node-a", "device": "gpu-0-mig-3g40gb-4"}]}}}
            }))
            .unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeMig::default());
        let allocator = Arc::new(Allocator::default());
        let dynamic = Arc::new(DynamicMig::new(Arc::new(Journal::open(dir.path())), fake.clone()));
        let nodes: crate::dra::claim_specs::NodesOf = Arc::new(|_: &str| Some(Vec::new()));
        let specs = Arc::new(crate::dra::claim_specs::ClaimSpecs::new(
            dir.path().join("cdi"),
            tessera_region::cdi::NodeDevices::default(),
            dir.path().join("run"),
            nodes,
        ));
        let driver = |uid: &str| DraDriver {
            claims: Arc::new(Claims(claim(uid))),
            allocations: allocator.clone(),
            specs: specs.clone(),
            status: Arc::new(crate::dra::status::StatusWriter::new(Arc::new(Statuses::default()))),
            devices: tokio::sync::watch::channel(publish(&h100(Vec::new()), &BTreeSet::new())).1,
            pool: "node-a".into(),
            default_priority: Priority::Normal,
            default_compute_mode: ComputeMode::Strict,
            dynamic_mig: Some(dynamic.clone()),
        };
        let c = |uid: &str| ClaimRef { namespace: "ml".into(), uid: uid.into(), name: "infer".into() };
        let e = driver("no-room").prepare(&c("no-room")).await.unwrap_err();
        assert_eq!(e, "GPU 0 has no room");
        assert!(fake.instances.lock().unwrap().is_empty(), "the instance made for it is gone");
        assert!(dynamic.journal.entries().is_empty());
        assert_eq!(*fake.created.lock().unwrap(), 1);

        let ok = driver("ok-1").prepare(&c("ok-1")).await.unwrap();
        assert_eq!(ok[0].cdi_device_ids, ["tessera.io/claim=ok-1-MIG-made-2"]);
        let held = allocator.0.lock().unwrap().clone();
        assert_eq!(held.len(), 1);
        assert_eq!((held[0].1[0].physical_uuid.as_str(), held[0].1[0].memory_limit), ("MIG-made-2", None));
        driver("ok-1").unprepare(&c("ok-1")).await.unwrap();
        assert!(fake.instances.lock().unwrap().is_empty());
    }

    #[test]
    fn entries_without_an_instance_are_forgotten_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path());
        let made = |claim: &str, gpu: &str, start| Made {
            claim_uid: claim.into(),
            gpu_uuid: gpu.into(),
            profile: "3g.40gb".into(),
            profile_id: 9,
            start,
        };
        j.store(vec![made("a", "GPU-0", 4), made("b", "GPU-0", 0), made("c", "GPU-gone", 0)]).unwrap();
        // GPU 0 holds a 3g.40gb at 4 only.
        let inv = h100(vec![instance(1, "3g.40gb", 9, 4, 4)]);
        assert_eq!(j.forget_missing(&inv).unwrap(), 1);
        let left: Vec<String> = Journal::open(dir.path()).entries().into_iter().map(|m| m.claim_uid).collect();
        assert_eq!(left, ["a", "c"], "b's instance is gone; c's GPU may come back");
        assert_eq!(j.forget_missing(&inv).unwrap(), 0);
    }

    #[test]
    fn a_damaged_journal_is_set_aside_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(DYNAMIC_MIG_FILE), b"{\"version\": 1, \"instances\": [{\"claimUid\": ").unwrap();
        let j = Journal::open(dir.path());
        assert!(j.entries().is_empty());
        let aside: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("dra-dynamic-mig.state.damaged-"))
            .collect();
        assert_eq!(aside.len(), 1);
        let twice = br#"{"version": 1, "instances": [
            {"claimUid": "a", "gpuUuid": "GPU-0", "profile": "3g.40gb", "profileId": 9, "start": 0},
            {"claimUid": "b", "gpuUuid": "GPU-0", "profile": "3g.40gb", "profileId": 9, "start": 0}]}"#;
        assert!(parse(twice).unwrap_err().contains("listed twice"));
        assert!(parse(br#"{"version": 2, "instances": []}"#).unwrap_err().contains("version 2"));
    }
}
