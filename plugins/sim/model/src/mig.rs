//! MIG: GPU instances (a memory domain and compute slices) and compute instances inside them
//! (execution units), under the real profile tables and placement rules of the catalog.

use std::sync::atomic::Ordering::*;

use crate::catalog::{CiProfile, GiProfile, GpuModel, MigSpec};
use crate::events::{EventKind, publish};
use crate::region::Guard;
use crate::{Node, Result, SimError};

/// A GPU instance.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuInstance {
    /// Slot in the GPU's table; memory domain 1 + slot.
    pub slot: usize,
    pub id: u32,
    pub profile: &'static GiProfile,
    /// First memory slice.
    pub start: u32,
}

/// A compute instance: what CUDA sees as a MIG device.
#[derive(Debug, Clone, PartialEq)]
pub struct ComputeInstance {
    /// Slot in the GPU's table; execution unit 1 + slot.
    pub slot: usize,
    pub gi_slot: usize,
    pub gi_id: u32,
    pub id: u32,
    pub profile: &'static CiProfile,
    pub sm_count: u32,
    /// First compute slice inside the GPU instance.
    pub start: u32,
    /// Creation serial: part of the MIG UUID.
    pub serial: u32,
}

impl ComputeInstance {
    /// The CUDA/NVML execution unit of this instance.
    pub fn unit(&self) -> usize {
        1 + self.slot
    }
    /// The memory domain it allocates from (its GPU instance's).
    pub fn domain(&self) -> usize {
        1 + self.gi_slot
    }
}

/// What asking for a MIG mode did (`nvmlDeviceSetMigMode`), as the model's architecture does it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigModeChange {
    /// The GPU was already in that mode (a pending change the other way is cancelled).
    Unchanged,
    /// Hopper and later: the mode took effect at once, no reset needed.
    Applied,
    /// Ampere: the mode is pending until the GPU is reset; `in_use` when processes use the GPU
    /// (the driver's own reset attempt is refused: `activationStatus` `NVML_ERROR_IN_USE`).
    PendingReset { in_use: bool },
}

impl GpuModel {
    /// Whether the model switches MIG mode in place (Hopper and later) rather than at the next
    /// GPU reset (Ampere).
    pub fn mig_mode_switches_in_place(&self) -> bool {
        self.architecture >= crate::catalog::NVML_DEVICE_ARCH_HOPPER
    }
}

fn mig_spec(model: &'static GpuModel) -> Result<&'static MigSpec> {
    model.mig.as_ref().ok_or_else(|| SimError::NotSupported(format!("{} has no MIG", model.key)))
}

fn overlaps(a: (u32, u32), b: (u32, u32)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

impl Node {
    fn model(&self, gpu: u32) -> Result<&'static GpuModel> {
        Ok(self.gpu(gpu)?.model)
    }

    /// (current, pending) MIG mode.
    pub fn mig_mode(&self, gpu: u32) -> Result<(bool, bool)> {
        self.check_gpu(gpu)?;
        mig_spec(self.model(gpu)?)?;
        let gs = &self.region.shared().gpus[gpu as usize];
        Ok((gs.mig_current.load(Relaxed) != 0, gs.mig_pending.load(Relaxed) != 0))
    }

    /// Asks for a MIG mode, as the model's driver does (docs/sim.md, "MIG mode changes"):
    /// - Ampere: the mode becomes pending and takes effect at the next reset, also while
    ///   processes use the GPU (the driver's own reset attempt then fails: `in_use`);
    /// - Hopper and later: the mode takes effect at once; refused while processes use the GPU.
    ///
    /// Disabling is refused while GPU instances exist, on every model.
    ///
    /// The driver roots' proc trees follow, whatever the change did.
    pub fn set_mig_mode(&self, gpu: u32, enable: bool) -> Result<MigModeChange> {
        let _roots = self.refreshing_driver_roots();
        let g = self.region.lock();
        self.check_gpu(gpu)?;
        let model = self.model(gpu)?;
        mig_spec(model)?;
        g.reap();
        let gs = &g.shared().gpus[gpu as usize];
        let busy = busy_on_gpu(&g, gpu);
        let current = gs.mig_current.load(Relaxed) != 0;
        if !enable && gs.gis.iter().any(|e| e.valid.load(Relaxed) != 0) {
            return Err(SimError::InUse(format!("GPU {gpu} still has GPU instances")));
        }
        if current == enable {
            gs.mig_pending.store(u32::from(enable), Relaxed);
            return Ok(MigModeChange::Unchanged);
        }
        if !model.mig_mode_switches_in_place() {
            gs.mig_pending.store(u32::from(enable), Relaxed);
            return Ok(MigModeChange::PendingReset { in_use: busy });
        }
        if busy {
            return Err(SimError::InUse(format!("processes are using GPU {gpu}")));
        }
        gs.mig_pending.store(u32::from(enable), Relaxed);
        gs.mig_current.store(u32::from(enable), Relaxed);
        publish(&g, gpu, EventKind::MigConfigChange, u64::from(enable), None);
        Ok(MigModeChange::Applied)
    }

    fn gis_locked(&self, g: &Guard, gpu: u32) -> Result<Vec<GpuInstance>> {
        let spec = mig_spec(self.model(gpu)?)?;
        let gs = &g.shared().gpus[gpu as usize];
        let mut out = Vec::new();
        for (slot, e) in gs.gis.iter().enumerate().filter(|(_, e)| e.valid.load(Relaxed) != 0) {
            let np = e.nvml_profile.load(Relaxed);
            let profile = spec.gi_profiles.iter().find(|p| p.nvml_profile == np);
            let profile = profile.ok_or_else(|| SimError::State(format!("GPU instance with unknown profile {np}")))?;
            out.push(GpuInstance { slot, id: e.id.load(Relaxed), profile, start: e.start.load(Relaxed) });
        }
        out.sort_by_key(|gi| gi.id);
        Ok(out)
    }

    fn require_mig(&self, g: &Guard, gpu: u32) -> Result<()> {
        self.check_gpu(gpu)?;
        mig_spec(self.model(gpu)?)?;
        if g.shared().gpus[gpu as usize].mig_current.load(Relaxed) == 0 {
            return Err(SimError::NotSupported(format!("MIG mode is disabled on GPU {gpu}")));
        }
        Ok(())
    }

    /// The GPU instances of a GPU, by id.
    pub fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>> {
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        self.gis_locked(&g, gpu)
    }

    fn gi_profile(&self, gpu: u32, nvml_profile: u32) -> Result<&'static GiProfile> {
        let spec = mig_spec(self.model(gpu)?)?;
        spec.gi_profiles.iter().find(|p| p.nvml_profile == nvml_profile).ok_or_else(|| {
            SimError::NotSupported(format!(
                "GPU instance profile {nvml_profile} on {}",
                self.model(gpu).map_or("?", |m| m.key)
            ))
        })
    }

    /// Placements a new instance of the profile could take now, given the existing instances.
    fn free_gi_placements(
        &self,
        existing: &[GpuInstance],
        model: &'static GpuModel,
        p: &'static GiProfile,
    ) -> Vec<u32> {
        let Some(spec) = model.mig.as_ref() else { return Vec::new() };
        let used_compute: u32 = existing.iter().map(|gi| gi.profile.slice_count).sum();
        let same = existing.iter().filter(|gi| gi.profile.nvml_profile == p.nvml_profile).count() as u32;
        if used_compute + p.slice_count > spec.compute_slices || same >= p.instance_count {
            return Vec::new();
        }
        p.placements
            .iter()
            .copied()
            .filter(|&start| {
                existing.iter().all(|gi| !overlaps((start, p.placement_size), (gi.start, gi.profile.placement_size)))
            })
            .collect()
    }

    /// Placements (first memory slice; each spans the profile's placement size) still free for
    /// a profile. With `all`, every placement the profile allows on an empty GPU.
    pub fn gi_placements(&self, gpu: u32, nvml_profile: u32, all: bool) -> Result<Vec<u32>> {
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        let p = self.gi_profile(gpu, nvml_profile)?;
        if all {
            return Ok(p.placements.to_vec());
        }
        let existing = self.gis_locked(&g, gpu)?;
        Ok(self.free_gi_placements(&existing, self.model(gpu)?, p))
    }

    /// How many more instances of a profile would fit, each placed first-fit.
    pub fn gi_remaining_capacity(&self, gpu: u32, nvml_profile: u32) -> Result<u32> {
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        let p = self.gi_profile(gpu, nvml_profile)?;
        let model = self.model(gpu)?;
        let mut existing = self.gis_locked(&g, gpu)?;
        let mut n = 0;
        while let Some(&start) = self.free_gi_placements(&existing, model, p).first() {
            existing.push(GpuInstance { slot: usize::MAX, id: 0, profile: p, start });
            n += 1;
        }
        Ok(n)
    }

    /// Creates a GPU instance, at `placement` (first memory slice) or the first that fits.
    ///
    /// The driver roots' proc trees follow, whatever the change did.
    pub fn create_gpu_instance(&self, gpu: u32, nvml_profile: u32, placement: Option<u32>) -> Result<GpuInstance> {
        let _roots = self.refreshing_driver_roots();
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        let p = self.gi_profile(gpu, nvml_profile)?;
        let existing = self.gis_locked(&g, gpu)?;
        let free = self.free_gi_placements(&existing, self.model(gpu)?, p);
        let start = match placement {
            Some(s) if !p.placements.contains(&s) => {
                return Err(SimError::InvalidArgument(format!(
                    "{} cannot start at memory slice {s}; allowed: {:?}",
                    p.name, p.placements
                )));
            }
            Some(s) if !free.contains(&s) => {
                return Err(SimError::InsufficientResources(format!(
                    "placement {s} of {} overlaps an existing instance",
                    p.name
                )));
            }
            Some(s) => s,
            None => *free
                .first()
                .ok_or_else(|| SimError::InsufficientResources(format!("no room for {} on GPU {gpu}", p.name)))?,
        };
        let gs = &g.shared().gpus[gpu as usize];
        let slot = gs.gis.iter().position(|e| e.valid.load(Relaxed) == 0).ok_or(SimError::TooMany("GPU instances"))?;
        let id = (1..).find(|id| existing.iter().all(|gi| gi.id != *id)).unwrap_or(1);
        let e = &gs.gis[slot];
        e.id.store(id, Relaxed);
        e.nvml_profile.store(nvml_profile, Relaxed);
        e.start.store(start, Relaxed);
        e.valid.store(1, Release);
        publish(&g, gpu, EventKind::MigConfigChange, 1, Some((id, u32::MAX)));
        Ok(GpuInstance { slot, id, profile: p, start })
    }

    /// Destroys a GPU instance; refused while it has compute instances or memory in use.
    ///
    /// The driver roots' proc trees follow, whatever the change did.
    pub fn destroy_gpu_instance(&self, gpu: u32, gi_id: u32) -> Result<()> {
        let _roots = self.refreshing_driver_roots();
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        g.reap();
        let gi = self.gis_locked(&g, gpu)?.into_iter().find(|gi| gi.id == gi_id);
        let gi = gi.ok_or_else(|| SimError::NotFound(format!("GPU instance {gi_id} on GPU {gpu}")))?;
        let gs = &g.shared().gpus[gpu as usize];
        let has_ci = gs.cis.iter().any(|c| c.valid.load(Relaxed) != 0 && c.gi_slot.load(Relaxed) as usize == gi.slot);
        if has_ci {
            return Err(SimError::InUse(format!("GPU instance {gi_id} still has compute instances")));
        }
        if g.used_slots().any(|s| g.shared().procs[s].mem[gpu as usize][1 + gi.slot].load(Relaxed) > 0) {
            return Err(SimError::InUse(format!("processes hold memory in GPU instance {gi_id}")));
        }
        gs.gis[gi.slot].valid.store(0, Release);
        publish(&g, gpu, EventKind::MigConfigChange, 0, Some((gi_id, u32::MAX)));
        Ok(())
    }

    fn cis_locked(&self, g: &Guard, gpu: u32, gis: &[GpuInstance]) -> Result<Vec<ComputeInstance>> {
        let spec = mig_spec(self.model(gpu)?)?;
        let gs = &g.shared().gpus[gpu as usize];
        let mut out = Vec::new();
        for (slot, c) in gs.cis.iter().enumerate().filter(|(_, c)| c.valid.load(Relaxed) != 0) {
            let gi_slot = c.gi_slot.load(Relaxed) as usize;
            let Some(gi) = gis.iter().find(|gi| gi.slot == gi_slot) else { continue };
            let np = c.nvml_profile.load(Relaxed);
            let profile = spec.ci_profiles.iter().find(|p| p.nvml_profile == np);
            let profile =
                profile.ok_or_else(|| SimError::State(format!("compute instance with unknown profile {np}")))?;
            out.push(ComputeInstance {
                slot,
                gi_slot,
                gi_id: gi.id,
                id: c.id.load(Relaxed),
                profile,
                sm_count: profile.sm_count_in(gi.profile),
                start: c.start.load(Relaxed),
                serial: c.serial.load(Relaxed),
            });
        }
        out.sort_by_key(|ci| (ci.gi_id, ci.id));
        Ok(out)
    }

    /// Every compute instance of a GPU (MIG devices, in NVML's order), or of one GPU instance.
    pub fn compute_instances(&self, gpu: u32, gi_id: Option<u32>) -> Result<Vec<ComputeInstance>> {
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        let gis = self.gis_locked(&g, gpu)?;
        let mut cis = self.cis_locked(&g, gpu, &gis)?;
        if let Some(id) = gi_id {
            if !gis.iter().any(|gi| gi.id == id) {
                return Err(SimError::NotFound(format!("GPU instance {id} on GPU {gpu}")));
            }
            cis.retain(|ci| ci.gi_id == id);
        }
        Ok(cis)
    }

    /// The compute-instance profiles a GPU instance offers: (profile, max count, placements).
    pub fn ci_profiles(&self, gpu: u32, gi_id: u32) -> Result<Vec<(&'static CiProfile, u32, Vec<u32>)>> {
        let gi = self.gpu_instances(gpu)?.into_iter().find(|gi| gi.id == gi_id);
        let gi = gi.ok_or_else(|| SimError::NotFound(format!("GPU instance {gi_id} on GPU {gpu}")))?;
        Ok(self.model(gpu)?.ci_profiles_for(gi.profile))
    }

    /// Placements still free in a GPU instance for a compute-instance profile.
    pub fn ci_placements(&self, gpu: u32, gi_id: u32, ci_profile: u32) -> Result<Vec<u32>> {
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        self.free_ci_placements(&g, gpu, gi_id, ci_profile).map(|(_, _, _, free)| free)
    }

    fn free_ci_placements(
        &self,
        g: &Guard,
        gpu: u32,
        gi_id: u32,
        ci_profile: u32,
    ) -> Result<(GpuInstance, &'static CiProfile, Vec<ComputeInstance>, Vec<u32>)> {
        let gis = self.gis_locked(g, gpu)?;
        let gi = gis.iter().find(|gi| gi.id == gi_id).cloned();
        let gi = gi.ok_or_else(|| SimError::NotFound(format!("GPU instance {gi_id} on GPU {gpu}")))?;
        let offered = self.model(gpu)?.ci_profiles_for(gi.profile);
        let (profile, count, placements) =
            offered.into_iter().find(|(p, _, _)| p.nvml_profile == ci_profile).ok_or_else(|| {
                SimError::NotSupported(format!(
                    "compute instance profile {ci_profile} in a {} instance",
                    gi.profile.name
                ))
            })?;
        let cis: Vec<_> = self.cis_locked(g, gpu, &gis)?.into_iter().filter(|c| c.gi_slot == gi.slot).collect();
        let used: u32 = cis.iter().map(|c| c.profile.slice_count).sum();
        let same = cis.iter().filter(|c| c.profile.nvml_profile == ci_profile).count() as u32;
        let free = if used + profile.slice_count > gi.profile.slice_count || same >= count {
            Vec::new()
        } else {
            placements
                .into_iter()
                .filter(|&s| cis.iter().all(|c| !overlaps((s, profile.slice_count), (c.start, c.profile.slice_count))))
                .collect()
        };
        Ok((gi, profile, cis, free))
    }

    /// How many more compute instances of a profile fit in a GPU instance.
    pub fn ci_remaining_capacity(&self, gpu: u32, gi_id: u32, ci_profile: u32) -> Result<u32> {
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        let (gi, profile, mut cis, _) = self.free_ci_placements(&g, gpu, gi_id, ci_profile)?;
        let (_, count, placements) = self
            .model(gpu)?
            .ci_profiles_for(gi.profile)
            .into_iter()
            .find(|(p, _, _)| p.nvml_profile == ci_profile)
            .expect("found above");
        let mut n = 0;
        loop {
            let used: u32 = cis.iter().map(|c| c.profile.slice_count).sum();
            let same = cis.iter().filter(|c| c.profile.nvml_profile == ci_profile).count() as u32;
            if used + profile.slice_count > gi.profile.slice_count || same >= count {
                break;
            }
            let next = placements
                .iter()
                .copied()
                .find(|&s| cis.iter().all(|c| !overlaps((s, profile.slice_count), (c.start, c.profile.slice_count))));
            let Some(start) = next else { break };
            cis.push(ComputeInstance {
                slot: usize::MAX,
                gi_slot: gi.slot,
                gi_id,
                id: 0,
                profile,
                sm_count: 0,
                start,
                serial: 0,
            });
            n += 1;
        }
        Ok(n)
    }

    /// Creates a compute instance in a GPU instance, at `placement` or the first that fits.
    ///
    /// The driver roots' proc trees follow, whatever the change did.
    pub fn create_compute_instance(
        &self,
        gpu: u32,
        gi_id: u32,
        ci_profile: u32,
        placement: Option<u32>,
    ) -> Result<ComputeInstance> {
        let _roots = self.refreshing_driver_roots();
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        let (gi, profile, cis, free) = self.free_ci_placements(&g, gpu, gi_id, ci_profile)?;
        let start = match placement {
            Some(s) if !free.contains(&s) => {
                return Err(SimError::InsufficientResources(format!("compute placement {s} is taken or not allowed")));
            }
            Some(s) => s,
            None => *free
                .first()
                .ok_or_else(|| SimError::InsufficientResources(format!("no room in GPU instance {gi_id}")))?,
        };
        let gs = &g.shared().gpus[gpu as usize];
        let slot =
            gs.cis.iter().position(|e| e.valid.load(Relaxed) == 0).ok_or(SimError::TooMany("compute instances"))?;
        let id = (0..).find(|id| cis.iter().all(|c| c.id != *id)).unwrap_or(0);
        let e = &gs.cis[slot];
        e.gi_slot.store(gi.slot as u32, Relaxed);
        e.id.store(id, Relaxed);
        e.nvml_profile.store(ci_profile, Relaxed);
        e.start.store(start, Relaxed);
        let serial = g.shared().header.event_seq.load(Relaxed) as u32;
        e.serial.store(serial, Relaxed);
        let unit = &gs.units[1 + slot];
        unit.served_until.store(0, Relaxed);
        unit.busy_ns.store(0, Relaxed);
        e.valid.store(1, Release);
        publish(&g, gpu, EventKind::MigConfigChange, 1, Some((gi_id, id)));
        Ok(ComputeInstance {
            slot,
            gi_slot: gi.slot,
            gi_id,
            id,
            profile,
            sm_count: profile.sm_count_in(gi.profile),
            start,
            serial,
        })
    }

    /// Destroys a compute instance; refused while a process holds a context on it.
    ///
    /// The driver roots' proc trees follow, whatever the change did.
    pub fn destroy_compute_instance(&self, gpu: u32, gi_id: u32, ci_id: u32) -> Result<()> {
        let _roots = self.refreshing_driver_roots();
        let g = self.region.lock();
        self.require_mig(&g, gpu)?;
        g.reap();
        let gis = self.gis_locked(&g, gpu)?;
        let ci = self.cis_locked(&g, gpu, &gis)?.into_iter().find(|c| c.gi_id == gi_id && c.id == ci_id);
        let ci = ci.ok_or_else(|| SimError::NotFound(format!("compute instance {gi_id}/{ci_id} on GPU {gpu}")))?;
        if g.used_slots().any(|s| g.shared().procs[s].ctx_units[gpu as usize].load(Relaxed) & (1 << ci.unit()) != 0) {
            return Err(SimError::InUse(format!("processes run on compute instance {gi_id}/{ci_id}")));
        }
        g.shared().gpus[gpu as usize].cis[ci.slot].valid.store(0, Release);
        publish(&g, gpu, EventKind::MigConfigChange, 0, Some((gi_id, ci_id)));
        Ok(())
    }
}

fn busy_on_gpu(g: &Guard, gpu: u32) -> bool {
    g.used_slots().any(|s| {
        let p = &g.shared().procs[s];
        p.ctx_units[gpu as usize].load(Relaxed) != 0 || p.mem[gpu as usize].iter().any(|m| m.load(Relaxed) > 0)
    })
}

#[cfg(test)]
mod tests {
    use super::MigModeChange;
    use crate::SimError;
    use crate::catalog::{
        NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, NVML_GPU_INSTANCE_PROFILE_1_SLICE, NVML_GPU_INSTANCE_PROFILE_3_SLICE,
        NVML_GPU_INSTANCE_PROFILE_4_SLICE, NVML_GPU_INSTANCE_PROFILE_7_SLICE,
    };
    use crate::testutil::*;

    fn mig_node() -> TestNode {
        node_from(Some("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 2\nmig = true\n"))
    }

    const A100: &str = "[[gpu]]\nmodel = \"A100-SXM4-40GB\"\ncount = 1\n";

    #[test]
    fn ampere_mode_change_is_pending_until_reset_even_in_use() {
        let t = node_from(Some(A100));
        let other = reopen(&t.state);
        assert_eq!(t.node.mig_mode(0).unwrap(), (false, false));
        other.alloc(0, 0, 1 << 20).unwrap();
        assert_eq!(t.node.set_mig_mode(0, true).unwrap(), MigModeChange::PendingReset { in_use: true });
        close(other);
        assert_eq!(t.node.set_mig_mode(0, true).unwrap(), MigModeChange::PendingReset { in_use: false });
        assert_eq!(t.node.mig_mode(0).unwrap(), (false, true));
        assert!(matches!(t.node.gpu_instances(0), Err(SimError::NotSupported(_))), "not before the reset");
        // Asked back before the reset: the pending change is cancelled.
        assert_eq!(t.node.set_mig_mode(0, false).unwrap(), MigModeChange::Unchanged);
        assert_eq!(t.node.mig_mode(0).unwrap(), (false, false));
        t.node.set_mig_mode(0, true).unwrap();
        t.node.reset(0).unwrap();
        assert_eq!(t.node.mig_mode(0).unwrap(), (true, true));
        assert!(t.node.gpu_instances(0).unwrap().is_empty());
    }

    #[test]
    fn hopper_mode_change_takes_effect_at_once_when_idle() {
        let t = default_node();
        let watcher = reopen(&t.state);
        let mut cursor = watcher.event_cursor();
        assert_eq!(t.node.set_mig_mode(0, true).unwrap(), MigModeChange::Applied);
        assert_eq!(t.node.mig_mode(0).unwrap(), (true, true));
        assert!(t.node.gpu_instances(0).unwrap().is_empty(), "MIG on, no reset");
        let ev = watcher.next_event(&mut cursor, |_| true, std::time::Duration::from_secs(1)).unwrap().unwrap();
        assert_eq!((ev.gpu, ev.kind, ev.data), (0, crate::EventKind::MigConfigChange, 1));
        assert_eq!(t.node.set_mig_mode(0, true).unwrap(), MigModeChange::Unchanged);
        // A reset keeps the mode: there is nothing pending.
        t.node.reset(0).unwrap();
        assert_eq!(t.node.mig_mode(0).unwrap(), (true, true));
        assert_eq!(t.node.set_mig_mode(0, false).unwrap(), MigModeChange::Applied);
        assert_eq!(t.node.mig_mode(0).unwrap(), (false, false));
    }

    #[test]
    fn hopper_mode_change_refused_while_in_use() {
        let t = default_node();
        let other = reopen(&t.state);
        other.alloc(0, 0, 1 << 20).unwrap();
        assert!(matches!(t.node.set_mig_mode(0, true), Err(SimError::InUse(_))));
        assert_eq!(t.node.mig_mode(0).unwrap(), (false, false), "nothing left pending");
        close(other);
        assert_eq!(t.node.set_mig_mode(0, true).unwrap(), MigModeChange::Applied);
    }

    #[test]
    fn disabling_is_refused_while_instances_exist_on_every_model() {
        for desc in [A100, "[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n"] {
            let t = node_from(Some(&format!("{desc}mig = true\n")));
            t.node.create_gpu_instance(0, NVML_GPU_INSTANCE_PROFILE_1_SLICE, None).unwrap();
            assert!(matches!(t.node.set_mig_mode(0, false), Err(SimError::InUse(_))), "{desc}");
            assert_eq!(t.node.mig_mode(0).unwrap(), (true, true), "{desc}");
        }
    }

    #[test]
    fn seven_small_instances_fill_the_gpu() {
        let t = mig_node();
        assert_eq!(t.node.gi_remaining_capacity(0, NVML_GPU_INSTANCE_PROFILE_1_SLICE).unwrap(), 7);
        for i in 0..7 {
            let gi = t.node.create_gpu_instance(0, NVML_GPU_INSTANCE_PROFILE_1_SLICE, None).unwrap();
            assert_eq!(gi.start, i);
        }
        assert!(matches!(
            t.node.create_gpu_instance(0, NVML_GPU_INSTANCE_PROFILE_1_SLICE, None),
            Err(SimError::InsufficientResources(_))
        ));
        assert_eq!(t.node.gi_remaining_capacity(0, NVML_GPU_INSTANCE_PROFILE_7_SLICE).unwrap(), 0);
    }

    #[test]
    fn placements_follow_the_profile_rules() {
        let t = mig_node();
        let big = t.node.create_gpu_instance(0, NVML_GPU_INSTANCE_PROFILE_4_SLICE, None).unwrap();
        assert_eq!((big.start, big.profile.name), (0, "4g.40gb"));
        // A 3g instance can only go at 4 now; placement 0 overlaps the 4g.
        assert_eq!(t.node.gi_placements(0, NVML_GPU_INSTANCE_PROFILE_3_SLICE, false).unwrap(), vec![4]);
        assert!(matches!(
            t.node.create_gpu_instance(0, NVML_GPU_INSTANCE_PROFILE_3_SLICE, Some(0)),
            Err(SimError::InsufficientResources(_))
        ));
        assert!(matches!(
            t.node.create_gpu_instance(0, NVML_GPU_INSTANCE_PROFILE_3_SLICE, Some(2)),
            Err(SimError::InvalidArgument(_))
        ));
        let small = t.node.create_gpu_instance(0, NVML_GPU_INSTANCE_PROFILE_3_SLICE, Some(4)).unwrap();
        assert_ne!(small.id, big.id);
        assert_eq!(t.node.gi_remaining_capacity(0, NVML_GPU_INSTANCE_PROFILE_1_SLICE).unwrap(), 0);
        let mem = t.node.memory_info(0, 1 + small.slot).unwrap();
        assert_eq!(mem.total, 40448 << 20);
    }

    #[test]
    fn compute_instances_and_in_use_refusals() {
        let t = mig_node();
        let gi = t.node.create_gpu_instance(1, NVML_GPU_INSTANCE_PROFILE_3_SLICE, None).unwrap();
        let offered = t.node.ci_profiles(1, gi.id).unwrap();
        assert!(offered.iter().any(|(p, n, _)| p.nvml_profile == NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE && *n == 3));
        let ci = t.node.create_compute_instance(1, gi.id, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, None).unwrap();
        assert_eq!(ci.sm_count, 16);
        assert_eq!(t.node.ci_remaining_capacity(1, gi.id, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE).unwrap(), 2);
        // A GPU instance with a compute instance cannot go.
        assert!(matches!(t.node.destroy_gpu_instance(1, gi.id), Err(SimError::InUse(_))));
        // A process on the compute instance keeps it.
        let other = reopen(&t.state);
        other.context_opened(1, ci.unit()).unwrap();
        other.alloc(1, ci.domain(), 1 << 30).unwrap();
        assert_eq!(t.node.processes(1, Some(ci.unit())).unwrap().len(), 1);
        assert!(matches!(t.node.destroy_compute_instance(1, gi.id, ci.id), Err(SimError::InUse(_))));
        close(other);
        t.node.destroy_compute_instance(1, gi.id, ci.id).unwrap();
        t.node.destroy_gpu_instance(1, gi.id).unwrap();
        assert!(t.node.gpu_instances(1).unwrap().is_empty());
    }

    #[test]
    fn work_on_a_compute_instance_is_its_own() {
        let t = mig_node();
        let gi = t.node.create_gpu_instance(0, NVML_GPU_INSTANCE_PROFILE_7_SLICE, None).unwrap();
        let ci = t.node.create_compute_instance(0, gi.id, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, None).unwrap();
        assert!(t.node.stream_create(0, 0, 0).is_err(), "no whole-GPU work in MIG mode");
        let s = t.node.stream_create(0, ci.unit(), 0).unwrap();
        let tk = t.node.launch(s, 1_000_000).unwrap();
        t.node.stream_wait(s, tk, None).unwrap();
        assert_eq!(t.node.own_gpu_time(0, ci.unit()), 1_000_000);
    }
}
