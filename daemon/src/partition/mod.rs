//! Partitioning: MIG layouts (planned purely in [`mig_plan`], carried out through NVML in
//! [`apply`]) and time-sliced shares ([`shares`]), for the layouts the configuration declares
//! ([`layout`]).

pub mod apply;
pub mod layout;
pub mod mig_plan;
pub mod shares;

use std::collections::BTreeSet;

pub use apply::{Applied, ApplyError, apply};
pub use layout::{GpuLayout, resolve};
pub use mig_plan::{Desired, MigAction, MigPlan, PlanError, plan};
pub use shares::{Share, ShareError, plan_shares};

use crate::config::PartitionKind;
use crate::discovery::{Inventory, Session};

/// What happened to one managed GPU.
#[derive(Debug)]
pub struct GpuOutcome {
    pub index: u32,
    /// The actions applied and whether a reset is pending, or why nothing (more) could change.
    pub result: Result<Applied, String>,
}

/// Plans and applies the MIG side of every layout. A GPU that cannot be changed (in use, no
/// fit, NVML refusing) is reported and the others still go ahead. `held` names MIG devices
/// allocations hold.
pub fn apply_layouts(
    session: &Session,
    inv: &Inventory,
    layouts: &[GpuLayout<'_>],
    held: &BTreeSet<String>,
) -> Vec<GpuOutcome> {
    layouts
        .iter()
        .map(|l| {
            let gpu = inv.gpu(l.index).expect("layouts come from this inventory");
            let result =
                plan(l.desired(), gpu.mig.as_ref(), held, &gpu.processes).map_err(|e| e.to_string()).and_then(|p| {
                    let cap = gpu.mig.as_ref().map(|m| &m.capability);
                    apply(session, l.index, &p, cap).map_err(|e| e.to_string())
                });
            GpuOutcome { index: l.index, result }
        })
        .collect()
}

/// The shares the layouts declare, on the devices as they are now (`inv` taken after applying):
/// shares of whole GPUs, and of every MIG device of the profiles `mig_shares` names.
pub fn plan_all_shares(inv: &Inventory, layouts: &[GpuLayout<'_>]) -> Result<Vec<Share>, ShareError> {
    let mut out = Vec::new();
    for l in layouts {
        let gpu = inv.gpu(l.index).expect("layouts come from this inventory");
        match l.kind {
            PartitionKind::Shares(s) => out.extend(plan_shares(&gpu.uuid, gpu.memory_total, s)?),
            PartitionKind::Mig { shares: Some(per_profile), .. } => {
                for gi in gpu.mig.iter().flat_map(|m| &m.instances) {
                    if let Some(s) = per_profile.get(&gi.profile) {
                        for d in &gi.devices {
                            out.extend(plan_shares(&d.uuid, d.memory_total, s)?);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Ok(out)
}
