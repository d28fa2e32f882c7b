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

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tessera_proto::tessera::v1 as api;
use tokio::sync::watch;

use super::{NodeController, Origin};
use crate::discovery::{Gpu, MigDevice, MigInstance};
use crate::partition::{MigAction, MigPlan};
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

    fn gpu(current: bool, pending: bool, instances: Vec<MigInstance>) -> Gpu {
        let p = |name: &str, id, slices, mem, size| GiProfile {
            name: name.into(),
            id,
            nvml_profile: 0,
            slice_count: slices,
            instance_count: 7 / slices,
            memory_mib: mem,
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
    fn a_gpu_is_free_only_when_nothing_holds_or_uses_it() {
        use crate::state::{AllocatedDevice, Allocation, ContainerIdentity, Source};
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
            devices: vec![AllocatedDevice {
                device_id: format!("{physical}::0"),
                physical_uuid: physical.into(),
                memory_limit: None,
                sm_percent: None,
                priority: Default::default(),
                compute_mode: Default::default(),
            }],
        };
        assert!(!is_free(&g, &[held("MIG-1")]), "a share of one of its MIG devices");
        assert!(!is_free(&g, &[held("GPU-x")]), "the GPU");
        assert!(is_free(&g, &[held("GPU-y")]), "another GPU's");
    }
}
