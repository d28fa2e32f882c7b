//! What fits: every way in admits a new or changed record beside every other record on each GPU
//! or MIG device it names, from the store's per-device sums (one store, one rule).

use tessera_region::ComputeMode;
use tonic::Status;

use crate::carve::{self, GpuRoom};
use crate::state::{AllocatedDevice, Allocation, Source, Store};

/// Where device `uuid` is: its GPU, whether it is a MIG device of it, and its memory.
pub(super) fn room_of<'r>(rooms: &'r [GpuRoom], uuid: &str) -> Option<(&'r GpuRoom, bool, u64)> {
    rooms.iter().find_map(|g| {
        if g.uuid.eq_ignore_ascii_case(uuid) {
            return Some((g, false, g.memory_total));
        }
        g.mig.iter().find(|m| m.uuid.eq_ignore_ascii_case(uuid)).map(|m| (g, true, m.memory_total))
    })
}

/// Whether the kubelet's new allocation of `devices` fits beside every record on each GPU or MIG
/// device it names (a whole device counts as all of it): a MIG device the node API or a claim
/// holds would otherwise be handed out twice, as no GPU's sums cover it.
pub(super) fn admit_beside(rooms: &[GpuRoom], store: &Store, devices: &[AllocatedDevice]) -> Result<(), Status> {
    let mut uuids: Vec<&str> = devices.iter().map(|d| d.physical_uuid.as_str()).collect();
    uuids.sort_unstable();
    uuids.dedup();
    for uuid in uuids {
        let Some((gpu, mig, total)) = room_of(rooms, uuid) else { continue };
        let (others_memory, others_sm) = store.loads().device(uuid).held(total);
        let (mut memory, mut sm) = (0u64, 0u32);
        for d in devices.iter().filter(|d| d.physical_uuid.eq_ignore_ascii_case(uuid)) {
            memory = memory.saturating_add(d.memory_limit.unwrap_or(total));
            if d.compute_mode == ComputeMode::Strict {
                sm = sm.saturating_add(d.sm_percent.unwrap_or(100));
            }
        }
        if others_memory.saturating_add(memory) > total || others_sm.saturating_add(sm) > 100 {
            let held_by: Vec<&str> = store
                .list()
                .filter(|a| a.source != Source::Kubelet)
                .filter(|a| a.devices.iter().any(|d| d.physical_uuid.eq_ignore_ascii_case(uuid)))
                .map(|a| a.id.as_str())
                .collect();
            let on = if mig {
                format!("MIG device {uuid} (GPU {})", gpu.index)
            } else {
                format!("GPU {} ({uuid})", gpu.index)
            };
            return Err(Status::resource_exhausted(format!(
                "{on}: {} and {}% strict SM are held (node API allocations {}); {} and {}% more do not fit",
                carve::size(others_memory),
                others_sm,
                if held_by.is_empty() { "none".to_string() } else { held_by.join(", ") },
                carve::size(memory),
                sm
            )));
        }
    }
    Ok(())
}

/// Whether claim `uid`'s new allocation fits on each GPU it names beside every other record there
/// (carve's rule: memory limits sum to at most the GPU's memory, strict SM percents to 100).
pub(super) fn admit_claim(rooms: &[GpuRoom], store: &Store, uid: &str, alloc: &Allocation) -> Result<(), Status> {
    for gpu in rooms.iter().filter(|g| alloc.devices.iter().any(|d| d.physical_uuid.eq_ignore_ascii_case(&g.uuid))) {
        let others = carve::held_in(gpu, store.loads(), None);
        let mine = carve::held(gpu, [alloc], None);
        if others.memory.saturating_add(mine.memory) > gpu.memory_total
            || others.strict_sm.saturating_add(mine.strict_sm) > 100
        {
            return Err(Status::resource_exhausted(format!(
                "claim {uid}: GPU {} ({}) has {} of {} and {}% strict SM left beside its other allocations; \
                 the claim asks {} and {}%",
                gpu.index,
                gpu.uuid,
                carve::size(gpu.memory_total.saturating_sub(others.memory)),
                carve::size(gpu.memory_total),
                100u32.saturating_sub(others.strict_sm),
                carve::size(mine.memory),
                mine.strict_sm
            )));
        }
    }
    Ok(())
}

/// Whether allocation `id`'s new limits (`alloc`, was `current`) fit: a device held whole takes no
/// memory limit above its own memory; on a GPU, beside every other record there (its own old
/// limits not counted); on a MIG device (no room known here), limits may shrink, never grow.
pub(super) fn admit_change(
    gpus: &[GpuRoom],
    store: &Store,
    id: &str,
    current: &Allocation,
    alloc: &Allocation,
    memory: Option<u64>,
) -> Result<(), Status> {
    let mut checked: Vec<&str> = Vec::new();
    for d in &alloc.devices {
        if checked.contains(&d.physical_uuid.as_str()) {
            continue;
        }
        checked.push(&d.physical_uuid);
        // A device held whole: no limit above its own memory (a MIG device is found among its
        // GPU's). A share's room is checked beside the others below.
        let size = || {
            gpus.iter().find_map(|g| {
                if g.uuid.eq_ignore_ascii_case(&d.physical_uuid) {
                    return Some(g.memory_total);
                }
                g.mig.iter().find(|m| m.uuid.eq_ignore_ascii_case(&d.physical_uuid)).map(|m| m.memory_total)
            })
        };
        let size = if d.whole { size() } else { None };
        if let (Some(size), Some(memory)) = (size, memory)
            && memory > size
        {
            return Err(Status::invalid_argument(format!(
                "memory_bytes: {} is more than device {}'s {}",
                carve::size(memory),
                d.physical_uuid,
                carve::size(size)
            )));
        }
        match gpus.iter().find(|g| g.uuid.eq_ignore_ascii_case(&d.physical_uuid)) {
            Some(gpu) => {
                let mine = carve::held(gpu, [alloc], None);
                let others = carve::held_in(gpu, store.loads(), Some(current));
                let total = carve::Held {
                    memory: others.memory.saturating_add(mine.memory),
                    strict_sm: others.strict_sm.saturating_add(mine.strict_sm),
                };
                if total.memory > gpu.memory_total || total.strict_sm > 100 {
                    return Err(Status::resource_exhausted(format!(
                        "GPU {} ({}) has {} of {} and {}% strict SM left beside the other allocations; \
                         allocation {id} would hold {} and {}%",
                        gpu.index,
                        gpu.uuid,
                        carve::size(gpu.memory_total.saturating_sub(others.memory)),
                        carve::size(gpu.memory_total),
                        100u32.saturating_sub(others.strict_sm),
                        carve::size(mine.memory),
                        mine.strict_sm
                    )));
                }
            }
            None => {
                // A MIG device (no room known here): limits may shrink, never grow.
                let grows = alloc.devices.iter().zip(&current.devices).any(|(new, old)| {
                    new.physical_uuid == d.physical_uuid
                        && (new.memory_limit.unwrap_or(u64::MAX) > old.memory_limit.unwrap_or(u64::MAX)
                            || new.sm_percent.unwrap_or(100) > old.sm_percent.unwrap_or(100))
                });
                if grows {
                    return Err(Status::failed_precondition(format!(
                        "device {}: limits on it can be lowered, not raised",
                        d.physical_uuid
                    )));
                }
            }
        }
    }
    Ok(())
}
