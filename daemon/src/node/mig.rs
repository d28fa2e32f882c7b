//! The MIG lifecycle after a mode change. On a GPU that switches MIG mode in place (Hopper and
//! later) the controller applies the whole layout in one step ([`predict_in_place`] for dry
//! runs). On one that takes the mode at a GPU reset (Ampere), a layout that turns MIG on or off is
//! left `pending_reset`, and this module finishes it:
//!
//! - **Reset seen**: once NVML shows the mode in effect (current = pending), the layout in effect
//!   is applied to that GPU, whoever reset it.
//! - **`reset = "when-free"`**: tesserad resets the GPU itself (`nvmlDeviceResetGpu`) once no
//!   allocation holds any of its devices and no process uses it.
//! - **Dry runs** predict the inventory a plan leaves ([`predict`], [`predict_reset`]), so a dry
//!   run reports what the real run will (instances made by a plan get placeholder UUIDs).
//! - **On demand** (DRA's dynamic MIG): one GPU instance at a named placement made
//!   ([`NodeController::ensure_mig_placement`]) or destroyed ([`NodeController::remove_mig_placement`])
//!   on a GPU no `[partitions]` entry manages, through the same apply code, then the picture
//!   refreshed and published like any other change.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tessera_proto::tessera::v1 as api;
use tokio::sync::watch;

use super::{Live, NodeController, Origin};
use crate::discovery::{Gpu, MigDevice, MigInstance};
use crate::partition::{self, MigAction, MigPlan};
use crate::resources::Resources;
use crate::state::Allocation;

/// How often GPUs waiting for a reset are looked at (only while some GPU waits).
pub const PENDING_RESET_CHECK: Duration = Duration::from_secs(1);

/// The prefix of the UUID a dry run gives a MIG device a plan would create.
pub const PLANNED_UUID_PREFIX: &str = "MIG-planned-";

/// Whether nothing holds or uses `gpu`: no allocation of it, of its MIG devices or of shares of
/// either, and no process on it.
pub fn is_free(gpu: &Gpu, allocations: &[Allocation]) -> bool {
    let mut mine: BTreeSet<&str> = BTreeSet::from([gpu.uuid.as_str()]);
    mine.extend(gpu.mig.iter().flat_map(|m| &m.instances).flat_map(|gi| &gi.devices).map(|d| d.uuid.as_str()));
    gpu.processes.is_empty()
        && !allocations.iter().flat_map(|a| &a.devices).any(|d| mine.contains(d.physical_uuid.as_str()))
}

/// `gpu` as it will be once `plan` is applied.
pub fn predict(gpu: &Gpu, plan: &MigPlan) -> Gpu {
    let mut out = gpu.clone();
    let Some(mig) = out.mig.as_mut() else { return out };
    for action in &plan.actions {
        match action {
            MigAction::SetMode { enable } => mig.pending = *enable,
            MigAction::DestroyInstance { gi_id, .. } => mig.instances.retain(|gi| gi.gi_id != *gi_id),
            MigAction::CreateComputeInstance { gi_id, profile } => {
                let memory = mig.capability.profile(profile).map_or(0, |p| p.memory_mib << 20);
                if let Some(gi) = mig.instances.iter_mut().find(|gi| gi.gi_id == *gi_id) {
                    gi.devices.push(planned_device(gpu.index, *gi_id, memory));
                }
            }
            MigAction::CreateInstance { profile, profile_id, start } => {
                let Some(p) = mig.capability.profile(profile) else { continue };
                let gi_id = (1..).find(|id| mig.instances.iter().all(|gi| gi.gi_id != *id)).unwrap_or(0);
                mig.instances.push(MigInstance {
                    gi_id,
                    profile: profile.clone(),
                    profile_id: *profile_id,
                    start: *start,
                    size: p.placement_size,
                    devices: vec![planned_device(gpu.index, gi_id, p.memory_mib << 20)],
                });
            }
        }
    }
    mig.instances.sort_by_key(|gi| gi.gi_id);
    out
}

/// `gpu` after a reset: the pending MIG mode in effect (a change destroys every instance) and
/// no processes.
pub fn predict_reset(gpu: &Gpu) -> Gpu {
    let mut out = predict_in_place(gpu);
    out.processes.clear();
    out
}

/// `gpu` once a GPU that switches MIG mode in place has taken the mode asked for (a change
/// destroys every instance; processes stay).
pub fn predict_in_place(gpu: &Gpu) -> Gpu {
    let mut out = gpu.clone();
    if let Some(mig) = out.mig.as_mut()
        && mig.current != mig.pending
    {
        mig.current = mig.pending;
        mig.instances.clear();
    }
    out
}

fn planned_device(gpu: u32, gi_id: u32, memory_total: u64) -> MigDevice {
    MigDevice {
        uuid: format!("{PLANNED_UUID_PREFIX}{gpu}-{gi_id}"),
        gi_id,
        ci_id: 0,
        memory_total,
        processes: Vec::new(),
    }
}

impl NodeController {
    /// Finishes MIG mode changes that wait for a reset: GPUs where NVML shows the reset, and
    /// free GPUs whose policy is `reset = "when-free"` (tesserad resets them), get the layout in
    /// effect applied. Returns those GPUs' results (empty when none was due).
    pub fn finish_pending_resets(&self) -> Vec<api::GpuLayoutResult> {
        let view = self.view();
        let waiting: Vec<u32> =
            view.status.iter().filter(|(_, s)| s.state == api::PartitionState::PendingReset).map(|(i, _)| *i).collect();
        if waiting.is_empty() {
            return Vec::new();
        }
        let inv = match self.session.inventory() {
            Ok(inv) => inv,
            Err(e) => {
                tracing::warn!(error = %e, "discovery while GPUs wait for a reset");
                return Vec::new();
            }
        };
        let allocations = self.allocator.allocations();
        let refused = self.lock().reset_refused.clone();
        let due: BTreeSet<u32> = waiting
            .into_iter()
            .filter(|&i| {
                let Some(gpu) = inv.gpu(i) else { return false };
                let reset_seen = gpu.mig.as_ref().is_none_or(|m| m.current == m.pending);
                let may_reset = view.config.reset_policy(i, &gpu.uuid) == crate::config::ResetPolicy::WhenFree
                    && !refused.contains(&i)
                    && is_free(gpu, &allocations);
                reset_seen || may_reset
            })
            .collect();
        if due.is_empty() {
            return Vec::new();
        }
        match self.apply_config((*view.config).clone(), &due, false, Origin::Reset) {
            Ok(results) => {
                for r in &results {
                    tracing::info!(
                        gpu = r.gpu_index,
                        outcome = api::LayoutOutcome::try_from(r.outcome).map(|o| o.as_str_name()).unwrap_or("?"),
                        created = r.created_device_ids.len(),
                        removed = r.removed_device_ids.len(),
                        "MIG mode change finished after the reset"
                    );
                }
                results
            }
            Err(e) => {
                tracing::warn!(error = %e, "applying the layouts that waited for a reset");
                Vec::new()
            }
        }
    }
}

/// A GPU-instance profile at one placement on one GPU (by UUID: indices may change).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Placement {
    pub gpu_uuid: String,
    /// Profile name (`3g.40gb`), for messages; the id decides.
    pub profile: String,
    pub profile_id: u32,
    pub start: u32,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at memory slice {} of {}", self.profile, self.start, self.gpu_uuid)
    }
}

/// Why `gpu` cannot host `p` now (MIG mode, management, profile, overlap), or `None` when it
/// can. An instance of `p` itself at `p.start` is not an overlap.
pub fn placement_refusal(gpu: &Gpu, managed: bool, p: &Placement) -> Option<String> {
    let Some(mig) = &gpu.mig else { return Some(format!("GPU {} ({}) does not support MIG", gpu.index, gpu.name)) };
    if !(mig.current && mig.pending) {
        return Some(format!(
            "GPU {} has MIG mode {} (pending {}): dynamic MIG needs it on; enable MIG mode and reset the GPU",
            gpu.index,
            if mig.current { "on" } else { "off" },
            if mig.pending { "on" } else { "off" }
        ));
    }
    if managed {
        return Some(format!(
            "GPU {} is laid out by a [partitions] entry, which owns its MIG instances; dynamic MIG is for GPUs no entry names",
            gpu.index
        ));
    }
    let Some(profile) = mig.capability.profile_by_id(p.profile_id) else {
        return Some(format!("GPU {} has no MIG profile id {} ({})", gpu.index, p.profile_id, p.profile));
    };
    if !profile.placements.contains(&p.start) {
        return Some(format!(
            "{} cannot start at memory slice {} on GPU {} (it may start at {:?})",
            profile.name, p.start, gpu.index, profile.placements
        ));
    }
    let end = p.start + profile.placement_size;
    mig.instances
        .iter()
        .filter(|gi| !(gi.profile_id == p.profile_id && gi.start == p.start))
        .find(|gi| gi.start < end && p.start < gi.start + gi.size)
        .map(|gi| {
            format!(
                "{} at memory slices {}..{} overlaps GPU instance {} ({}, slices {}..{}) on GPU {}",
                profile.name,
                p.start,
                end,
                gi.gi_id,
                gi.profile,
                gi.start,
                gi.start + gi.size,
                gpu.index
            )
        })
}

impl NodeController {
    /// Makes sure a GPU instance of `p` exists at its placement with its compute instance, and
    /// returns its MIG device. An instance already there is reused only when `adopt` says it is
    /// the caller's (made by an earlier call that did not return); otherwise it is refused as
    /// taken. Refused, with the reason, when the GPU cannot host it now
    /// ([`placement_refusal`]). The new picture is published before returning.
    pub fn ensure_mig_placement(&self, p: &Placement, adopt: bool) -> Result<MigDevice, String> {
        let live = self.lock();
        let inv = self.session.inventory().map_err(|e| format!("discovery: {e}"))?;
        let gpu = inv.gpu_by_uuid(&p.gpu_uuid).ok_or_else(|| format!("no GPU {} on this node", p.gpu_uuid))?;
        let managed = live.view.partitioned(gpu.index);
        if let Some(why) = placement_refusal(gpu, managed, p) {
            return Err(why);
        }
        let mig = gpu.mig.as_ref().expect("checked by placement_refusal");
        let profile = mig.capability.profile_by_id(p.profile_id).expect("checked by placement_refusal").clone();
        let existing = mig.instances.iter().find(|gi| gi.profile_id == p.profile_id && gi.start == p.start);
        let action = match existing {
            Some(gi) if !adopt => {
                return Err(format!(
                    "{p} is taken by GPU instance {} that tesserad did not make for this claim; the claim must be allocated again",
                    gi.gi_id
                ));
            }
            Some(gi) => match gi.devices.first() {
                Some(d) => return Ok(d.clone()),
                // A crash between the GPU instance and its compute instance.
                None => MigAction::CreateComputeInstance { gi_id: gi.gi_id, profile: profile.name.clone() },
            },
            None => {
                MigAction::CreateInstance { profile: profile.name.clone(), profile_id: p.profile_id, start: p.start }
            }
        };
        let plan = MigPlan { actions: vec![action], pending_reset: false };
        partition::apply(&self.session, gpu.index, &plan, Some(&mig.capability))
            .map_err(|e| format!("the driver refused to create {p}: {}", e.source))?;
        let made = self.refresh_locked(live)?;
        made.gpu_by_uuid(&p.gpu_uuid)
            .and_then(|g| g.mig.as_ref())
            .and_then(|m| m.instances.iter().find(|gi| gi.profile_id == p.profile_id && gi.start == p.start))
            .and_then(|gi| gi.devices.first().cloned())
            .ok_or_else(|| format!("{p} was created but NVML does not list its MIG device"))
    }

    /// Destroys the GPU instance at `p`'s placement when there is one; `Ok(false)` when there is
    /// none. Refused while an allocation holds its MIG device or processes run on it.
    pub fn remove_mig_placement(&self, p: &Placement) -> Result<bool, String> {
        let live = self.lock();
        let inv = self.session.inventory().map_err(|e| format!("discovery: {e}"))?;
        let Some(gpu) = inv.gpu_by_uuid(&p.gpu_uuid) else { return Ok(false) };
        let Some(gi) =
            gpu.mig.iter().flat_map(|m| &m.instances).find(|gi| gi.profile_id == p.profile_id && gi.start == p.start)
        else {
            return Ok(false);
        };
        let uuids: BTreeSet<&str> = gi.devices.iter().map(|d| d.uuid.as_str()).collect();
        if let Some(a) = self
            .allocator
            .allocations()
            .into_iter()
            .find(|a| a.devices.iter().any(|d| uuids.contains(d.physical_uuid.as_str())))
        {
            return Err(format!("{p}: its MIG device is still allocated ({}); not destroyed", a.id));
        }
        if gi.has_processes() {
            let pids: Vec<u32> = gi.devices.iter().flat_map(|d| d.processes.iter().copied()).collect();
            return Err(format!("{p}: processes {pids:?} still run on it; not destroyed"));
        }
        let plan = MigPlan {
            actions: vec![MigAction::DestroyInstance { gi_id: gi.gi_id, profile: gi.profile.clone() }],
            pending_reset: false,
        };
        let cap = gpu.mig.as_ref().map(|m| &m.capability);
        partition::apply(&self.session, gpu.index, &plan, cap)
            .map_err(|e| format!("the driver refused to destroy {p}: {}", e.source))?;
        self.refresh_locked(live)?;
        Ok(true)
    }

    /// After an on-demand MIG change: the node discovered again, what is offered rebuilt from
    /// the configuration in effect (no layout planned), and published. Returns the inventory.
    fn refresh_locked(&self, mut live: std::sync::MutexGuard<'_, Live>) -> Result<crate::discovery::Inventory, String> {
        let inv = self.session.inventory().map_err(|e| format!("discovery after a MIG change: {e}"))?;
        let config = std::sync::Arc::clone(&live.view.config);
        let layouts = partition::resolve(&config, &inv).map_err(|e| e.to_string())?;
        let shares = partition::plan_all_shares(&inv, &layouts).map_err(|e| e.to_string())?;
        let mut resources = Resources::build(&config, &inv, &layouts, &shares);
        resources.mark_unhealthy(&live.view.health);
        live.view.inventory = inv.clone();
        live.view.shares = std::sync::Arc::new(shares);
        self.publish(live, resources);
        Ok(inv)
    }
}

/// Looks at GPUs waiting for a reset every [`PENDING_RESET_CHECK`] until shutdown.
pub async fn watch_pending_resets(controller: Arc<NodeController>, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(PENDING_RESET_CHECK) => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        let c = Arc::clone(&controller);
        let _ = tokio::task::spawn_blocking(move || c.finish_pending_resets()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::{GiProfile, MigCapability, MigInfo};
    use crate::state::record::tests::dev;

    fn gpu(current: bool, pending: bool, instances: Vec<MigInstance>) -> Gpu {
        let p = |name: &str, id, slices, mem, size| GiProfile {
            name: name.into(),
            id,
            nvml_profile: 0,
            slice_count: slices,
            instance_count: 7 / slices,
            memory_mib: mem,
            multiprocessors: 16 * slices,
            placement_size: size,
            placements: vec![0],
        };
        Gpu {
            index: 3,
            uuid: "GPU-x".into(),
            name: "H100".into(),
            memory_total: 80 << 30,
            pci_bus_id: String::new(),
            numa_node: None,
            minor: None,
            mig: Some(MigInfo {
                current,
                pending,
                switches_in_place: false,
                capability: MigCapability {
                    profiles: vec![p("1g.10gb", 19, 1, 9984, 1), p("3g.40gb", 9, 3, 40320, 4)],
                    compute_slices: 7,
                },
                instances,
            }),
            nvlink_peers: Vec::new(),
            processes: Vec::new(),
        }
    }

    fn instance(gi_id: u32, profile: &str) -> MigInstance {
        MigInstance {
            gi_id,
            profile: profile.into(),
            profile_id: 9,
            start: 0,
            size: 4,
            devices: vec![MigDevice {
                uuid: format!("MIG-{gi_id}"),
                gi_id,
                ci_id: 0,
                memory_total: 1,
                processes: vec![],
            }],
        }
    }

    #[test]
    fn predictions_follow_the_plan_and_the_reset() {
        let g = gpu(true, true, vec![instance(1, "3g.40gb"), instance(2, "3g.40gb")]);
        let plan = MigPlan {
            actions: vec![
                MigAction::DestroyInstance { gi_id: 1, profile: "3g.40gb".into() },
                MigAction::CreateInstance { profile: "1g.10gb".into(), profile_id: 19, start: 0 },
                MigAction::CreateInstance { profile: "1g.10gb".into(), profile_id: 19, start: 1 },
            ],
            pending_reset: false,
        };
        let after = predict(&g, &plan);
        let m = after.mig.as_ref().unwrap();
        let names: Vec<(u32, &str)> = m.instances.iter().map(|gi| (gi.gi_id, gi.profile.as_str())).collect();
        assert_eq!(names, [(1, "1g.10gb"), (2, "3g.40gb"), (3, "1g.10gb")], "freed ids are reused, lowest first");
        assert_eq!(m.instances[0].devices[0].uuid, "MIG-planned-3-1");
        assert_eq!(m.instances[0].devices[0].memory_total, 9984 << 20);

        // MIG off: instances go now, the mode at the reset.
        let plan = MigPlan {
            actions: vec![
                MigAction::DestroyInstance { gi_id: 1, profile: "3g.40gb".into() },
                MigAction::DestroyInstance { gi_id: 2, profile: "3g.40gb".into() },
                MigAction::SetMode { enable: false },
            ],
            pending_reset: true,
        };
        let after = predict(&g, &plan);
        let m = after.mig.as_ref().unwrap();
        assert!(m.current && !m.pending && m.instances.is_empty());
        let reset = predict_reset(&after);
        assert!(!reset.mig.as_ref().unwrap().current);
        // A reset without a pending change keeps the instances.
        assert_eq!(predict_reset(&g).mig.as_ref().unwrap().instances.len(), 2);
    }

    #[test]
    fn a_placement_is_refused_with_the_reason_the_gpu_cannot_host_it() {
        let p = |profile: &str, profile_id, start| Placement {
            gpu_uuid: "GPU-x".into(),
            profile: profile.into(),
            profile_id,
            start,
        };
        let three = p("3g.40gb", 9, 0);
        let mut on = gpu(true, true, vec![]);
        on.mig.as_mut().unwrap().capability.profiles[1].placements = vec![0, 4];
        assert_eq!(placement_refusal(&on, false, &three), None);
        let e = placement_refusal(&gpu(false, false, vec![]), false, &three).unwrap();
        assert!(e.contains("MIG mode off (pending off)") && e.contains("enable MIG mode"), "{e}");
        let e = placement_refusal(&gpu(true, false, vec![]), false, &three).unwrap();
        assert!(e.contains("MIG mode on (pending off)"), "{e}");
        let e = placement_refusal(&on, true, &three).unwrap();
        assert!(e.contains("[partitions] entry"), "{e}");
        let e = placement_refusal(&on, false, &p("3g.40gb", 9, 2)).unwrap();
        assert!(e.contains("cannot start at memory slice 2") && e.contains("[0, 4]"), "{e}");
        let e = placement_refusal(&on, false, &p("2g.20gb", 14, 0)).unwrap();
        assert!(e.contains("no MIG profile id 14"), "{e}");
        // An instance over slices 0..4: the 3g at 0 overlaps it unless it is that very instance.
        let mut busy = on.clone();
        busy.mig.as_mut().unwrap().instances = vec![instance(1, "3g.40gb")];
        busy.mig.as_mut().unwrap().instances[0].profile_id = 19;
        let e = placement_refusal(&busy, false, &three).unwrap();
        assert!(e.contains("overlaps GPU instance 1 (3g.40gb, slices 0..4)"), "{e}");
        busy.mig.as_mut().unwrap().instances[0].profile_id = 9;
        assert_eq!(placement_refusal(&busy, false, &three), None, "the instance of the placement itself");
        assert_eq!(placement_refusal(&busy, false, &p("3g.40gb", 9, 4)), None);
        let mut none = on.clone();
        none.mig = None;
        assert!(placement_refusal(&none, false, &three).unwrap().contains("does not support MIG"));
    }

    #[test]
    fn a_gpu_is_free_only_when_nothing_holds_or_uses_it() {
        use crate::state::{Allocation, ContainerIdentity, Source};
        let g = gpu(true, true, vec![instance(1, "3g.40gb")]);
        assert!(is_free(&g, &[]));
        let mut busy = g.clone();
        busy.processes.push(42);
        assert!(!is_free(&busy, &[]), "a process on the GPU");
        let held = |physical: &str| Allocation {
            id: "a".into(),
            resource: "tessera.io/gpu-share".into(),
            container: ContainerIdentity::default(),
            source: Source::Kubelet,
            created_unix_ns: 0,
            claim: None,
            devices: vec![dev(&format!("{physical}::0"), physical, None, None)],
        };
        assert!(!is_free(&g, &[held("MIG-1")]), "a share of one of its MIG devices");
        assert!(!is_free(&g, &[held("GPU-x")]), "the GPU");
        assert!(is_free(&g, &[held("GPU-y")]), "another GPU's");
    }
}
