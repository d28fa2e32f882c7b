//! The node API's on-demand allocations: `Allocate`, `Release`, `SetLimits` translated to the
//! allocator's calls, and the answer a container or a host process needs.

use std::collections::HashMap;

use tessera_proto::tessera::v1 as api;
use tessera_region::{ComputeMode, Priority};
use tonic::Status;

use crate::allocator::park::DEFAULT_LOCK_TIMEOUT;
use crate::allocator::{DRA_RESOURCE, DeviceAsk, LimitChange, ShareRequest};
use crate::node::NodeController;
use crate::node::preempted::OPERATOR;
use crate::park::Checkpointer;
use crate::resources::CDI_VENDOR;
use crate::state::{Allocation, Lease};

/// The request's priority; `None` for UNSPECIFIED, an error naming the field for a bad value.
pub fn priority(value: i32) -> Result<Option<Priority>, Status> {
    match api::Priority::try_from(value) {
        Ok(api::Priority::Unspecified) => Ok(None),
        Ok(api::Priority::Low) => Ok(Some(Priority::Low)),
        Ok(api::Priority::Normal) => Ok(Some(Priority::Normal)),
        Ok(api::Priority::High) => Ok(Some(Priority::High)),
        Err(_) => Err(Status::invalid_argument(format!("priority: {value} is not a Priority"))),
    }
}

fn compute_mode(value: i32) -> Result<Option<ComputeMode>, Status> {
    match api::ComputeMode::try_from(value) {
        Ok(api::ComputeMode::Unspecified) => Ok(None),
        Ok(api::ComputeMode::Strict) => Ok(Some(ComputeMode::Strict)),
        Ok(api::ComputeMode::WorkConserving) => Ok(Some(ComputeMode::WorkConserving)),
        Err(_) => Err(Status::invalid_argument(format!("compute_mode: {value} is not a ComputeMode"))),
    }
}

fn lease(value: i32) -> Result<Lease, Status> {
    match api::Lease::try_from(value) {
        Ok(api::Lease::Unspecified | api::Lease::None) => Ok(Lease::None),
        Ok(api::Lease::Container) => Ok(Lease::Container),
        Err(_) => Err(Status::invalid_argument(format!("lease: {value} is not a Lease"))),
    }
}

/// An owner is printed as it is by `tessera allocations` and in logs: at most 256 bytes, no
/// control characters, nor those that reorder or break the line they are shown in (U+202A-E,
/// U+2066-9, U+2028-9: a right-to-left override turned the rest of the row around).
fn check_owner(owner: &str) -> Result<(), Status> {
    let reorders = |c: char| matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{2028}' | '\u{2029}');
    if owner.len() > 256 || owner.chars().any(|c| c.is_control() || reorders(c)) {
        return Err(Status::invalid_argument(
            "owner: at most 256 bytes of UTF-8, no control, line-separator or bidirectional-override characters",
        ));
    }
    Ok(())
}

/// Whether `a` counts against `limits.max_allocations`: the node API's own (shares, MIG devices,
/// whole GPUs), not the kubelet's nor DRA claims (the scheduler bounds those by devices).
fn node_api_held(a: &Allocation) -> bool {
    a.claim.is_some() && a.resource != DRA_RESOURCE
}

/// Refuses an `Allocate` once `max` node API allocations are held, naming the key.
fn check_room(held: usize, max: u32) -> Result<(), Status> {
    if held >= max as usize {
        return Err(Status::resource_exhausted(format!(
            "limits.max_allocations: this node holds {held} node API allocations, the most it allows ({max}); \
             release some (`tessera allocations`, `tessera release`) or raise limits.max_allocations"
        )));
    }
    Ok(())
}

/// One `Allocate` at a time counts and adds, so that calls at once cannot pass the cap together.
static ALLOCATING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `Allocate`.
pub fn allocate(controller: &NodeController, req: &api::AllocateRequest) -> Result<api::AllocateResponse, Status> {
    let owner = req.owner.trim();
    check_owner(owner)?;
    let cgroup = crate::enforcement::attribution::cgroup_arg(&req.cgroup).map_err(Status::invalid_argument)?;
    let device = match (req.mig_profile.trim(), req.whole_gpus) {
        ("", 0) => DeviceAsk::Share,
        (profile, 0) => DeviceAsk::Mig(profile.to_owned()),
        ("", n) => DeviceAsk::Whole(n),
        _ => return Err(Status::invalid_argument("mig_profile, whole_gpus: ask for one of them, not both")),
    };
    let share = ShareRequest {
        device,
        memory: req.memory_bytes,
        sm_percent: req.sm_percent,
        priority: priority(req.priority)?,
        compute_mode: compute_mode(req.compute_mode)?,
        gpu: req.gpu.clone(),
        owner: (!owner.is_empty()).then(|| owner.to_owned()),
        lease: lease(req.lease)?,
        preemptible: req.preemptible,
    };
    let allocator = controller.allocator();
    let max = controller.view().config.limits.max_allocations;
    let _one_at_a_time = ALLOCATING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (_, held) =
        allocator.allocations_changed_since(None, |records| records.iter().filter(|a| node_api_held(a)).count());
    check_room(held.unwrap_or(0), max)?;
    // The rooms the controller published (health and layout changes republish them): no copy of
    // its whole picture on every call. A share that does not fit may park preemptible ones of
    // lower priority (issue 33): their parks (and any undone) are published either way.
    let made =
        allocator.allocate_preempting(&share, &allocator.rooms(), || checkpointer(controller), DEFAULT_LOCK_TIMEOUT);
    controller.publish_moves(&made.moves);
    let alloc = made.result?;
    // Where enforcement finds the allocation's host processes (docs/serverless.md).
    if let Some(c) = &cgroup
        && let Err(e) = crate::enforcement::attribution::write_cgroup(&allocator.dirs().dir(&alloc.id), c)
    {
        let _ = allocator.release(&alloc.id);
        return Err(Status::internal(format!("cgroup: cannot record it for {}: {e}; nothing was allocated", alloc.id)));
    }
    Ok(answer(controller, &alloc))
}

/// What a process needs to use `alloc`: its CDI names and its environment (host paths for a
/// standalone host process; the hook and the wrapper repoint them in a container).
pub fn answer(controller: &NodeController, alloc: &Allocation) -> api::AllocateResponse {
    let dirs = controller.allocator().dirs();
    let mut uuids: Vec<&str> = Vec::new();
    for d in &alloc.devices {
        if !uuids.contains(&d.physical_uuid.as_str()) {
            uuids.push(&d.physical_uuid);
        }
    }
    let env = HashMap::from([
        ("TESSERA_ALLOCATION".to_owned(), alloc.id.clone()),
        ("TESSERA_VISIBLE_DEVICES".to_owned(), uuids.join(",")),
        ("NVIDIA_VISIBLE_DEVICES".to_owned(), uuids.join(",")),
        ("TESSERA_LIMITS".to_owned(), dirs.limits_path(&alloc.id).display().to_string()),
        ("TESSERA_REGION".to_owned(), dirs.region_path(&alloc.id).display().to_string()),
    ]);
    api::AllocateResponse {
        allocation: Some(super::devices::allocation(alloc, &controller.allocator().resources())),
        cdi_devices: uuids
            .iter()
            .map(|u| {
                let class = if u.to_ascii_uppercase().starts_with("MIG-") { "mig" } else { "gpu" };
                format!("{CDI_VENDOR}/{class}={u}")
            })
            .collect(),
        env,
    }
}

/// `Release`.
pub fn release(controller: &NodeController, req: &api::ReleaseRequest) -> Result<api::ReleaseResponse, Status> {
    let released = controller.allocator().release(&req.allocation_id)?;
    // Nothing by that id; a device's UUID given instead is said to be one ("already released"
    // told a script it had given the device back).
    let id = req.allocation_id.as_str();
    let is_device = |rooms: &[crate::carve::GpuRoom]| {
        rooms.iter().any(|g| g.uuid.eq_ignore_ascii_case(id) || g.mig.iter().any(|m| m.uuid.eq_ignore_ascii_case(id)))
    };
    if !released && is_device(&controller.gpu_rooms()) {
        return Err(Status::invalid_argument(format!(
            "allocation_id: {id} is a device, not an allocation; `tessera allocations` names the allocation holding it"
        )));
    }
    Ok(api::ReleaseResponse { released })
}

/// `SetLimits`.
pub fn set_limits(controller: &NodeController, req: &api::SetLimitsRequest) -> Result<api::SetLimitsResponse, Status> {
    let change =
        LimitChange { memory: req.memory_bytes, sm_percent: req.sm_percent, priority: priority(req.priority)? };
    if change == LimitChange::default() {
        return Err(Status::invalid_argument("nothing to change: give memory_bytes, sm_percent or priority"));
    }
    let allocator = controller.allocator();
    let alloc = allocator.set_limits(&req.allocation_id, change, &allocator.rooms())?;
    Ok(api::SetLimitsResponse {
        allocation: Some(super::devices::allocation(&alloc, &controller.allocator().resources())),
    })
}

/// The node API's state of an allocation whose memory is where `s` says.
pub fn state(s: tessera_region::ParkState) -> api::AllocationState {
    match s {
        tessera_region::ParkState::Running => api::AllocationState::Running,
        tessera_region::ParkState::Parking => api::AllocationState::Parking,
        tessera_region::ParkState::Parked => api::AllocationState::Parked,
        tessera_region::ParkState::Resuming => api::AllocationState::Resuming,
    }
}

/// Allocation `id` as the node API shows it, with its park state.
fn shown(controller: &NodeController, id: &str) -> Option<api::Allocation> {
    let allocator = controller.allocator();
    let record = allocator.allocations_where(|a| a.id == id).into_iter().next()?;
    let mut shown = super::devices::allocation(&record, &allocator.resources());
    shown.state = state(allocator.park_state(id)) as i32;
    shown.preempted_by = allocator.preempted_by(id).unwrap_or_default();
    Some(shown)
}

/// The driver's checkpoint API ([`crate::allocator::park::checkpoint_api`]).
fn checkpointer(controller: &NodeController) -> Result<Checkpointer, Status> {
    crate::allocator::park::checkpoint_api(controller.session().library())
        .map_err(|e| Status::unavailable(format!("park and resume need the driver's checkpoint API: {e}")))
}

/// `Park`.
pub fn park(controller: &NodeController, req: &api::ParkRequest) -> Result<api::ParkResponse, Status> {
    let id = req.allocation_id.as_str();
    crate::state::record::valid_id(id).map_err(|why| Status::invalid_argument(format!("allocation_id: {why}")))?;
    let timeout = match req.lock_timeout_nanos {
        0 => DEFAULT_LOCK_TIMEOUT,
        n => std::time::Duration::from_nanos(n),
    };
    let done = controller.allocator().park(id, &checkpointer(controller)?, timeout)?;
    controller.publish_park(id, true, &done, OPERATOR);
    Ok(api::ParkResponse {
        allocation: shown(controller, id),
        bytes: done.bytes,
        duration_nanos: done.duration.as_nanos() as u64,
        pids: done.pids,
    })
}

/// `Resume`.
pub fn resume(controller: &NodeController, req: &api::ResumeRequest) -> Result<api::ResumeResponse, Status> {
    let id = req.allocation_id.as_str();
    crate::state::record::valid_id(id).map_err(|why| Status::invalid_argument(format!("allocation_id: {why}")))?;
    let allocator = controller.allocator();
    let done = allocator.resume(id, &checkpointer(controller)?, &allocator.rooms())?;
    controller.publish_park(id, false, &done, OPERATOR);
    Ok(api::ResumeResponse {
        allocation: shown(controller, id),
        bytes: done.bytes,
        duration_nanos: done.duration.as_nanos() as u64,
        pids: done.pids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_max_allocations_allocate_is_refused_naming_the_key() {
        assert!(check_room(1023, 1024).is_ok());
        let err = check_room(1024, 1024).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().starts_with("limits.max_allocations:"), "{}", err.message());
        let mut a = crate::state::record::tests::sample("x");
        assert!(!node_api_held(&a), "the kubelet's");
        a.claim = Some(Box::new(crate::state::Claim { owner: None, lease: Lease::None }));
        assert!(node_api_held(&a));
        a.resource = DRA_RESOURCE.into();
        assert!(!node_api_held(&a), "a DRA claim");
    }

    #[test]
    fn an_owner_that_would_garble_the_listing_is_refused_saying_in_bytes() {
        assert!(check_owner("team-a/fn-7").is_ok());
        assert!(check_owner(&"é".repeat(128)).is_ok(), "256 bytes");
        let err = check_owner(&"é".repeat(129)).unwrap_err();
        assert!(err.message().contains("256 bytes"), "{}", err.message());
        for bad in ["a\u{202e}b", "a\u{2028}b", "a\u{2066}b", "a\nb", "a\u{7}b"] {
            assert_eq!(check_owner(bad).unwrap_err().code(), tonic::Code::InvalidArgument, "{bad:?}");
        }
    }
}
