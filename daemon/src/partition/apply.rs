//! Applying a [`MigPlan`] through NVML, in order; the first failure stops that GPU's plan and is
//! reported with the action it stopped at. Nothing here decides anything: the planner did.

use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_SUCCESS;

use super::mig_plan::{MigAction, MigPlan};
use crate::discovery::mig_calls;
use crate::discovery::{MigCapability, Session};

/// What applying one GPU's plan did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Applied {
    /// The actions carried out, in order.
    pub done: Vec<MigAction>,
    /// A MIG mode change waits for a GPU reset.
    pub pending_reset: bool,
}

/// An action NVML refused.
#[derive(Debug, thiserror::Error)]
#[error("{action:?}: {source}")]
pub struct ApplyError {
    pub action: MigAction,
    pub source: NvmlError,
    /// What was done before it.
    pub done: Vec<MigAction>,
}

/// Carries out `plan` on GPU `index`.
pub fn apply(
    session: &Session,
    index: u32,
    plan: &MigPlan,
    cap: Option<&MigCapability>,
) -> Result<Applied, ApplyError> {
    let nvml = session.nvml();
    let mut out = Applied { done: Vec::new(), pending_reset: plan.pending_reset };
    for action in &plan.actions {
        let fail = |source, done: &Vec<MigAction>| ApplyError { action: action.clone(), source, done: done.clone() };
        let dev = nvml.device_by_index(index).map_err(|e| fail(e, &out.done))?;
        let slices = |profile: &str| cap.and_then(|c| c.profile(profile)).map(|p| (p.slice_count, p.placement_size));
        let r: Result<(), NvmlError> = match action {
            // `activationStatus`: SUCCESS when the mode is in effect (in place on Hopper and
            // later); RESET_REQUIRED, or IN_USE when the driver could not reset a busy GPU
            // itself, when it waits for a reset (Ampere).
            MigAction::SetMode { enable } => dev.set_mig_mode(*enable).map(|status| {
                out.pending_reset = status != nvmlReturn_enum_NVML_SUCCESS;
            }),
            MigAction::DestroyInstance { gi_id, .. } => mig_calls::gpu_instance_by_id(nvml, &dev, *gi_id)
                .and_then(|gi| mig_calls::destroy_gpu_instance(nvml, gi)),
            MigAction::CreateComputeInstance { gi_id, profile } => {
                let (s, _) = slices(profile).ok_or(NvmlError::InvalidArg).map_err(|e| fail(e, &out.done))?;
                mig_calls::gpu_instance_by_id(nvml, &dev, *gi_id)
                    .and_then(|gi| mig_calls::create_full_compute_instance(nvml, gi, s))
            }
            MigAction::CreateInstance { profile, profile_id, start } => {
                let (s, size) = slices(profile).ok_or(NvmlError::InvalidArg).map_err(|e| fail(e, &out.done))?;
                mig_calls::create_gpu_instance(nvml, &dev, *profile_id, *start, size).and_then(|gi| {
                    mig_calls::create_full_compute_instance(nvml, gi, s).inspect_err(|_| {
                        // Leave no GPU instance without its compute instance behind.
                        let _ = mig_calls::destroy_gpu_instance(nvml, gi);
                    })
                })
            }
        };
        r.map_err(|e| fail(e, &out.done))?;
        tracing::info!(gpu = index, "MIG: {action}");
        out.done.push(action.clone());
    }
    Ok(out)
}
