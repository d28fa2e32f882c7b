//! Planning a MIG layout, the way mig-parted does, as a pure function of the wanted profile
//! counts, the model's MIG table and the instances that exist: no NVML here.
//!
//! - **Idempotent**: instances that already match are kept; a GPU that matches gets no actions.
//! - **Every placement tried**: which instances to keep (most first) and where each new one goes
//!   are searched exhaustively over the model's placement lists (`possible_placements`), so a
//!   layout that fits only in some order (4g.40gb + 3g.40gb on H100: 4g must take slices 0–3,
//!   which a 3g created first would have taken) is found; creation then uses explicit placements.
//! - **Nothing in use destroyed**: an instance with processes, or one the caller marks as held
//!   by an allocation, is kept or the plan is refused.
//! - **Mode changes pend**: turning MIG on or off is planned as `SetMode` and the plan is marked
//!   `pending_reset`; nothing is forced.

use std::collections::{BTreeMap, BTreeSet};

use crate::discovery::{GiProfile, MigCapability, MigInfo, MigInstance};

/// What a GPU should look like.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Desired<'a> {
    /// MIG mode off (a whole GPU, or shares of it).
    Off,
    /// MIG mode on with these instances (profile name → count).
    On(&'a BTreeMap<String, u32>),
}

/// One step, in the order they are to be applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigAction {
    /// Ask for a MIG mode; it applies at the next GPU reset.
    SetMode { enable: bool },
    /// Destroy a GPU instance (its compute instances first).
    DestroyInstance { gi_id: u32, profile: String },
    /// Give a kept GPU instance that has none its full compute instance.
    CreateComputeInstance { gi_id: u32, profile: String },
    /// Create a GPU instance at a placement, and its full compute instance.
    CreateInstance { profile: String, profile_id: u32, start: u32 },
}

impl std::fmt::Display for MigAction {
    /// For logs and reports: `create 3g.40gb at 4`, not Rust's debug form.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MigAction::SetMode { enable } => {
                write!(f, "MIG mode {} (at the next reset)", if *enable { "on" } else { "off" })
            }
            MigAction::DestroyInstance { gi_id, profile } => write!(f, "destroy {profile} GPU instance {gi_id}"),
            MigAction::CreateComputeInstance { gi_id, profile } => {
                write!(f, "create the compute instance of {profile} GPU instance {gi_id}")
            }
            MigAction::CreateInstance { profile, start, .. } => write!(f, "create {profile} at placement {start}"),
        }
    }
}

/// The actions for one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MigPlan {
    pub actions: Vec<MigAction>,
    /// A MIG mode change was asked for (or already is pending): the layout can be made only
    /// after a GPU reset.
    pub pending_reset: bool,
}

impl MigPlan {
    /// Nothing to do and nothing pending.
    pub fn is_noop(&self) -> bool {
        self.actions.is_empty() && !self.pending_reset
    }
}

/// Why a layout cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("the GPU does not support MIG")]
    NotSupported,
    #[error("the GPU has no MIG profile {profile:?}; {}", offered(available))]
    UnknownProfile { profile: String, available: Vec<String> },
    #[error("GPU instance {gi_id} ({profile}) is in use ({why}) and the layout does not keep it")]
    InUse { gi_id: u32, profile: String, why: String },
    #[error("MIG mode cannot change while processes use the GPU (pids {pids:?})")]
    GpuInUse { pids: Vec<u32> },
    #[error("{wanted} does not fit on the GPU{}", if kept.is_empty() { String::new() } else { format!(" beside the instances in use ({})", kept.join(", ")) })]
    NoFit { wanted: String, kept: Vec<String> },
}

/// The profiles a GPU offers, for errors: a driver may list none.
pub(crate) fn offered(available: &[String]) -> String {
    if available.is_empty() {
        "its driver lists no MIG profiles".into()
    } else {
        format!("it has {}", available.join(", "))
    }
}

/// Plans one GPU. `mig` is `None` for a GPU without MIG; `held` names MIG device UUIDs that
/// allocations hold (treated as in use even with no process on them); `gpu_processes` are
/// the pids on the GPU (a mode change waits for them).
pub fn plan(
    desired: Desired<'_>,
    mig: Option<&MigInfo>,
    held: &BTreeSet<String>,
    gpu_processes: &[u32],
) -> Result<MigPlan, PlanError> {
    let Some(mig) = mig else {
        return match desired {
            Desired::Off => Ok(MigPlan::default()),
            Desired::On(_) => Err(PlanError::NotSupported),
        };
    };
    let in_use = |gi: &MigInstance| -> Option<String> {
        let pids: Vec<u32> = gi.devices.iter().flat_map(|d| d.processes.iter().copied()).collect();
        if !pids.is_empty() {
            return Some(format!("processes {pids:?}"));
        }
        gi.devices.iter().find(|d| held.contains(&d.uuid)).map(|d| format!("{} is allocated", d.uuid))
    };
    match desired {
        Desired::Off => {
            if !mig.current {
                // Off now; undo a pending "on" (applies at once, no reset).
                let actions = if mig.pending { vec![MigAction::SetMode { enable: false }] } else { vec![] };
                return Ok(MigPlan { actions, pending_reset: false });
            }
            if let Some((gi, why)) = mig.instances.iter().find_map(|gi| in_use(gi).map(|w| (gi, w))) {
                return Err(PlanError::InUse { gi_id: gi.gi_id, profile: gi.profile.clone(), why });
            }
            if !gpu_processes.is_empty() {
                return Err(PlanError::GpuInUse { pids: gpu_processes.to_vec() });
            }
            let mut actions: Vec<MigAction> = mig
                .instances
                .iter()
                .map(|gi| MigAction::DestroyInstance { gi_id: gi.gi_id, profile: gi.profile.clone() })
                .collect();
            if mig.pending {
                actions.push(MigAction::SetMode { enable: false });
            }
            Ok(MigPlan { actions, pending_reset: true })
        }
        Desired::On(wanted) => {
            for name in wanted.keys() {
                if mig.capability.profile(name).is_none() {
                    return Err(PlanError::UnknownProfile { profile: name.clone(), available: mig.capability.names() });
                }
            }
            if !mig.current {
                if mig.pending {
                    return Ok(MigPlan { actions: vec![], pending_reset: true });
                }
                if !gpu_processes.is_empty() {
                    return Err(PlanError::GpuInUse { pids: gpu_processes.to_vec() });
                }
                return Ok(MigPlan { actions: vec![MigAction::SetMode { enable: true }], pending_reset: true });
            }
            let mut actions = Vec::new();
            if !mig.pending {
                // On now but asked off at the next reset: ask for on again (applies at once).
                actions.push(MigAction::SetMode { enable: true });
            }
            actions.extend(plan_instances(wanted, &mig.capability, &mig.instances, &in_use)?);
            Ok(MigPlan { actions, pending_reset: false })
        }
    }
}

/// With MIG on: which instances to keep, destroy and create.
fn plan_instances(
    wanted: &BTreeMap<String, u32>,
    cap: &MigCapability,
    existing: &[MigInstance],
    in_use: &dyn Fn(&MigInstance) -> Option<String>,
) -> Result<Vec<MigAction>, PlanError> {
    let mut must_keep: Vec<&MigInstance> = Vec::new();
    let mut candidates: Vec<&MigInstance> = Vec::new();
    for gi in existing {
        match in_use(gi) {
            Some(why) => {
                let wanted_n = wanted.get(&gi.profile).copied().unwrap_or(0);
                let kept_n = must_keep.iter().filter(|k| k.profile == gi.profile).count() as u32;
                if kept_n >= wanted_n {
                    return Err(PlanError::InUse { gi_id: gi.gi_id, profile: gi.profile.clone(), why });
                }
                must_keep.push(gi);
            }
            None if wanted.contains_key(&gi.profile) && cap.profile_by_id(gi.profile_id).is_some() => {
                candidates.push(gi)
            }
            None => {}
        }
    }
    // Subsets of the free matching instances, most kept first (n ≤ 7: at most 128).
    let n = candidates.len();
    let mut masks: Vec<u32> = (0..1u32 << n).collect();
    masks.sort_by_key(|m| (std::cmp::Reverse(m.count_ones()), *m));
    for mask in masks {
        let kept: Vec<&MigInstance> =
            must_keep.iter().copied().chain((0..n).filter(|i| mask & (1 << i) != 0).map(|i| candidates[i])).collect();
        let mut remaining = wanted.clone();
        let mut over = false;
        for k in &kept {
            let r = remaining.get_mut(&k.profile).expect("kept profiles are wanted");
            if *r == 0 {
                over = true;
                break;
            }
            *r -= 1;
        }
        if over {
            continue;
        }
        let Some(placed) = fit(cap, &kept, &remaining) else { continue };
        let kept_ids: BTreeSet<u32> = kept.iter().map(|k| k.gi_id).collect();
        let mut actions: Vec<MigAction> = existing
            .iter()
            .filter(|gi| !kept_ids.contains(&gi.gi_id))
            .map(|gi| MigAction::DestroyInstance { gi_id: gi.gi_id, profile: gi.profile.clone() })
            .collect();
        let mut kept_sorted = kept.clone();
        kept_sorted.sort_by_key(|k| k.gi_id);
        actions.extend(
            kept_sorted
                .iter()
                .filter(|k| k.devices.is_empty())
                .map(|k| MigAction::CreateComputeInstance { gi_id: k.gi_id, profile: k.profile.clone() }),
        );
        actions.extend(placed.into_iter().map(|(p, start)| MigAction::CreateInstance {
            profile: p.name.clone(),
            profile_id: p.id,
            start,
        }));
        return Ok(actions);
    }
    let wanted_text = wanted.iter().map(|(p, c)| format!("{c} x {p}")).collect::<Vec<_>>().join(" + ");
    Err(PlanError::NoFit {
        wanted: if wanted_text.is_empty() { "nothing".into() } else { wanted_text },
        kept: must_keep.iter().map(|k| format!("{} at {}", k.profile, k.start)).collect(),
    })
}

/// Places the remaining instances beside the kept ones: a backtracking search over every
/// placement of every profile. Returns (profile, start) in creation order.
fn fit<'c>(
    cap: &'c MigCapability,
    kept: &[&MigInstance],
    remaining: &BTreeMap<String, u32>,
) -> Option<Vec<(&'c GiProfile, u32)>> {
    let mut todo: Vec<&GiProfile> = Vec::new();
    for (name, &count) in remaining {
        let p = cap.profile(name)?;
        todo.extend(std::iter::repeat_n(p, count as usize));
    }
    // Largest first: they have the fewest placements, so dead ends show early.
    todo.sort_by_key(|p| (std::cmp::Reverse(p.placement_size), std::cmp::Reverse(p.slice_count), p.id));
    let mut occupied: Vec<Slot> = kept
        .iter()
        .map(|k| Slot { start: k.start, size: k.size, slices: slices_of(cap, k), profile_id: k.profile_id })
        .collect();
    let mut out = Vec::new();
    search(cap, &todo, &mut occupied, &mut out).then_some(out)
}

#[derive(Clone, Copy)]
struct Slot {
    start: u32,
    size: u32,
    slices: u32,
    profile_id: u32,
}

fn slices_of(cap: &MigCapability, gi: &MigInstance) -> u32 {
    cap.profile_by_id(gi.profile_id).map_or(0, |p| p.slice_count)
}

fn search<'c>(
    cap: &'c MigCapability,
    todo: &[&'c GiProfile],
    occupied: &mut Vec<Slot>,
    out: &mut Vec<(&'c GiProfile, u32)>,
) -> bool {
    let Some((&p, rest)) = todo.split_first() else { return true };
    let used: u32 = occupied.iter().map(|s| s.slices).sum();
    let same = occupied.iter().filter(|s| s.profile_id == p.id).count() as u32;
    if used + p.slice_count > cap.compute_slices || same >= p.instance_count {
        return false;
    }
    // Identical profiles are interchangeable: place them in increasing order only.
    let after = out.iter().rev().find(|(q, _)| q.id == p.id).map(|&(_, s)| s);
    for &start in &p.placements {
        if after.is_some_and(|a| start <= a) {
            continue;
        }
        let overlaps = occupied.iter().any(|s| start < s.start + s.size && s.start < start + p.placement_size);
        if overlaps {
            continue;
        }
        occupied.push(Slot { start, size: p.placement_size, slices: p.slice_count, profile_id: p.id });
        out.push((p, start));
        if search(cap, rest, occupied, out) {
            return true;
        }
        out.pop();
        occupied.pop();
    }
    false
}

#[cfg(test)]
#[path = "mig_plan_tests.rs"]
mod tests;
