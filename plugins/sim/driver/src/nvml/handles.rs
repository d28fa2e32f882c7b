//! Opaque handles: addresses of cells in static tables, so a handle is stable for the life of the
//! process and an incoming one is validated by address before anything is read.
//!
//! - `nvmlDevice_t` of a GPU: cell `gpu` of [`GPUS`]; of a MIG device (a compute instance as
//!   CUDA sees it): cell `(gpu, gi id, ci id)` of [`MIG_DEVICES`];
//! - `nvmlGpuInstance_t`: cell `(gpu, gi id)` of [`GPU_INSTANCES`];
//! - `nvmlComputeInstance_t`: cell `(gpu, gi id, ci id)` of [`COMPUTE_INSTANCES`];
//! - `nvmlEventSet_t`: cell `k` of [`EVENT_SETS`] (its state lives in `events`).
//!
//! A MIG handle names instance ids, as NVML's do: after the instance is destroyed it is invalid
//! (`INVALID_ARGUMENT`); an instance created later with the same ids makes it valid again.

use std::ffi::c_void;

use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::{ComputeInstance, GpuInstance, MAX_GPUS, MAX_MIG, Node, SimError};

use super::*;

/// One handle's cell: 8 bytes, 8-aligned, so handles look like the pointers they stand for.
#[repr(C, align(8))]
pub(crate) struct Cell(u8);

/// GPU instance ids the tables hold per GPU (the model hands out 1..=MAX_MIG).
pub(crate) const GI_IDS: usize = MAX_MIG + 1;
/// Compute instance ids per GPU instance (the model hands out 0..MAX_MIG).
pub(crate) const CI_IDS: usize = MAX_MIG + 1;
/// Event sets open at once in one process.
pub(crate) const MAX_EVENT_SETS: usize = 64;

static GPUS: [Cell; MAX_GPUS] = [const { Cell(0) }; MAX_GPUS];
static MIG_DEVICES: [Cell; MAX_GPUS * GI_IDS * CI_IDS] = [const { Cell(0) }; MAX_GPUS * GI_IDS * CI_IDS];
static GPU_INSTANCES: [Cell; MAX_GPUS * GI_IDS] = [const { Cell(0) }; MAX_GPUS * GI_IDS];
static COMPUTE_INSTANCES: [Cell; MAX_GPUS * GI_IDS * CI_IDS] = [const { Cell(0) }; MAX_GPUS * GI_IDS * CI_IDS];
static EVENT_SETS: [Cell; MAX_EVENT_SETS] = [const { Cell(0) }; MAX_EVENT_SETS];

/// The index of the cell `p` points at, if it points exactly at one.
fn index_in(table: &'static [Cell], p: *const c_void) -> Option<usize> {
    let off = (p as usize).checked_sub(table.as_ptr() as usize)?;
    let size = std::mem::size_of::<Cell>();
    (off % size == 0 && off / size < table.len()).then_some(off / size)
}

/// The address of cell `i`, as an opaque handle. The cell is never written through it.
fn cell_ptr<H>(table: &'static [Cell], i: usize) -> *mut H {
    std::ptr::from_ref(&table[i]).cast_mut().cast()
}

fn mig_index(gpu: u32, gi: u32, ci: u32) -> R<usize> {
    let (gi, ci) = (gi as usize, ci as usize);
    if gpu as usize >= MAX_GPUS || gi >= GI_IDS || ci >= CI_IDS {
        return Err(UNKNOWN);
    }
    Ok((gpu as usize * GI_IDS + gi) * CI_IDS + ci)
}

fn split_mig(i: usize) -> (u32, u32, u32) {
    ((i / (GI_IDS * CI_IDS)) as u32, (i / CI_IDS % GI_IDS) as u32, (i % CI_IDS) as u32)
}

/// The handle of GPU `index`.
pub(crate) fn gpu_handle(index: u32) -> nvmlDevice_t {
    cell_ptr(&GPUS, index as usize)
}

/// The MIG device handle of compute instance `ci` in GPU instance `gi` of a GPU.
pub(crate) fn mig_handle(gpu: u32, gi: u32, ci: u32) -> R<nvmlDevice_t> {
    Ok(cell_ptr(&MIG_DEVICES, mig_index(gpu, gi, ci)?))
}

/// The handle of GPU instance `gi` of a GPU.
pub(crate) fn gi_handle(gpu: u32, gi: u32) -> R<nvmlGpuInstance_t> {
    if gpu as usize >= MAX_GPUS || gi as usize >= GI_IDS {
        return Err(UNKNOWN);
    }
    Ok(cell_ptr(&GPU_INSTANCES, gpu as usize * GI_IDS + gi as usize))
}

/// The handle of compute instance `ci` of GPU instance `gi` of a GPU.
pub(crate) fn ci_handle(gpu: u32, gi: u32, ci: u32) -> R<nvmlComputeInstance_t> {
    Ok(cell_ptr(&COMPUTE_INSTANCES, mig_index(gpu, gi, ci)?))
}

/// The handle of event-set slot `k`.
pub(crate) fn event_set_handle(k: usize) -> nvmlEventSet_t {
    cell_ptr(&EVENT_SETS, k)
}

/// The slot an event-set handle names (`INVALID_ARGUMENT` for anything else).
pub(crate) fn event_set_slot(set: nvmlEventSet_t) -> R<usize> {
    index_in(&EVENT_SETS, set.cast_const().cast()).ok_or(INVALID_ARGUMENT)
}

/// A MIG device (compute instance) and its GPU instance, as they stand now.
#[derive(Debug, Clone)]
pub(crate) struct MigDevice {
    pub gpu: u32,
    pub gi: GpuInstance,
    pub ci: ComputeInstance,
}

/// What a device handle names.
#[derive(Debug, Clone)]
pub(crate) enum Dev {
    Gpu(u32),
    Mig(MigDevice),
}

impl Dev {
    /// The physical GPU (the parent of a MIG device).
    pub fn gpu(&self) -> u32 {
        match self {
            Dev::Gpu(g) => *g,
            Dev::Mig(m) => m.gpu,
        }
    }
}

/// Lost GPUs answer `GPU_IS_LOST`; a MIG instance that no longer exists makes the handle invalid.
fn mig_lookup(e: SimError) -> nvmlReturn_t {
    match e {
        SimError::GpuLost(_) => GPU_IS_LOST,
        _ => INVALID_ARGUMENT,
    }
}

/// Resolves a GPU instance of a GPU by id, as it stands now.
pub(crate) fn find_gi(node: &Node, gpu: u32, gi_id: u32) -> R<GpuInstance> {
    let gis = node.gpu_instances(gpu).map_err(mig_lookup)?;
    gis.into_iter().find(|g| g.id == gi_id).ok_or(INVALID_ARGUMENT)
}

/// Resolves a compute instance and its GPU instance by ids.
pub(crate) fn find_mig(node: &Node, gpu: u32, gi_id: u32, ci_id: u32) -> R<MigDevice> {
    let gi = find_gi(node, gpu, gi_id)?;
    let cis = node.compute_instances(gpu, Some(gi_id)).map_err(mig_lookup)?;
    let ci = cis.into_iter().find(|c| c.id == ci_id).ok_or(INVALID_ARGUMENT)?;
    Ok(MigDevice { gpu, gi, ci })
}

/// Validates a device handle without touching the GPU's state (lost or not).
pub(crate) fn decode_device(node: &Node, device: nvmlDevice_t) -> R<DevRef> {
    let p = device.cast_const().cast();
    if let Some(i) = index_in(&GPUS, p) {
        if i < node.gpus().len() {
            return Ok(DevRef::Gpu(i as u32));
        }
        return Err(INVALID_ARGUMENT);
    }
    if let Some(i) = index_in(&MIG_DEVICES, p) {
        let (gpu, gi, ci) = split_mig(i);
        if (gpu as usize) < node.gpus().len() {
            return Ok(DevRef::Mig(gpu, gi, ci));
        }
    }
    Err(INVALID_ARGUMENT)
}

/// A device handle decoded but not yet resolved against the GPU's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DevRef {
    Gpu(u32),
    Mig(u32, u32, u32),
}

/// Resolves a device handle: a valid GPU (`GPU_IS_LOST` if it has fallen off the bus) or a MIG
/// device that exists now.
pub(crate) fn device(node: &Node, device: nvmlDevice_t) -> R<Dev> {
    match decode_device(node, device)? {
        DevRef::Gpu(g) => {
            node.check_gpu(g).nv()?;
            Ok(Dev::Gpu(g))
        }
        DevRef::Mig(gpu, gi, ci) => {
            node.check_gpu(gpu).nv()?;
            Ok(Dev::Mig(find_mig(node, gpu, gi, ci)?))
        }
    }
}

/// A whole-GPU handle, for queries a MIG device does not answer (`NOT_SUPPORTED` for those).
pub(crate) fn whole_gpu(node: &Node, h: nvmlDevice_t) -> R<u32> {
    match device(node, h)? {
        Dev::Gpu(g) => Ok(g),
        Dev::Mig(_) => Err(NOT_SUPPORTED),
    }
}

/// A whole-GPU handle, for operations on the physical device (`INVALID_ARGUMENT` for a MIG device).
pub(crate) fn physical_gpu(node: &Node, h: nvmlDevice_t) -> R<u32> {
    match device(node, h)? {
        Dev::Gpu(g) => Ok(g),
        Dev::Mig(_) => Err(INVALID_ARGUMENT),
    }
}

/// Resolves a GPU-instance handle to (GPU, instance as it stands now).
pub(crate) fn gpu_instance(node: &Node, h: nvmlGpuInstance_t) -> R<(u32, GpuInstance)> {
    let i = index_in(&GPU_INSTANCES, h.cast_const().cast()).ok_or(INVALID_ARGUMENT)?;
    let (gpu, gi) = ((i / GI_IDS) as u32, (i % GI_IDS) as u32);
    if gpu as usize >= node.gpus().len() {
        return Err(INVALID_ARGUMENT);
    }
    node.check_gpu(gpu).nv()?;
    Ok((gpu, find_gi(node, gpu, gi)?))
}

/// Resolves a compute-instance handle.
pub(crate) fn compute_instance(node: &Node, h: nvmlComputeInstance_t) -> R<MigDevice> {
    let i = index_in(&COMPUTE_INSTANCES, h.cast_const().cast()).ok_or(INVALID_ARGUMENT)?;
    let (gpu, gi, ci) = split_mig(i);
    if gpu as usize >= node.gpus().len() {
        return Err(INVALID_ARGUMENT);
    }
    node.check_gpu(gpu).nv()?;
    find_mig(node, gpu, gi, ci)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_garbage_is_refused() {
        let h = gpu_handle(3);
        assert_eq!(index_in(&GPUS, h.cast_const().cast()), Some(3));
        let m = mig_handle(2, 5, 1).unwrap();
        assert_eq!(split_mig(index_in(&MIG_DEVICES, m.cast_const().cast()).unwrap()), (2, 5, 1));
        let inside = (h as usize + 1) as *const c_void;
        assert_eq!(index_in(&GPUS, inside), None);
        assert_eq!(index_in(&GPUS, std::ptr::null()), None);
        assert_eq!(index_in(&GPUS, 0xdead_beef_usize as *const c_void), None);
        assert_eq!(index_in(&MIG_DEVICES, h.cast_const().cast()), None);
        let e = event_set_handle(7);
        assert_eq!(event_set_slot(e), Ok(7));
        assert_eq!(event_set_slot(h.cast()), Err(INVALID_ARGUMENT));
    }
}
