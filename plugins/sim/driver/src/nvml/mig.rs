//! Multi-Instance GPU: mode, GPU-instance and compute-instance profiles, placements, capacity,
//! creation and destruction, enumeration, and MIG device handles.
//!
//! Profiles come in two numberings, as in NVML: the `NVML_*_INSTANCE_PROFILE_*` enum the
//! `...ProfileInfo` queries take, and the profile *id* (`info.id`, e.g. 19 for 1g.10gb) that every
//! other call takes. The placement and capacity rules are the model's (the catalog's real tables).

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::{CiProfile, ComputeInstance, GiProfile, GpuInstance, GpuModel, MigModeChange, Node, SimError};

use super::handles::{self, Dev, DevRef, ci_handle, gi_handle, gpu_handle, mig_handle};
use super::*;

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of the current header (nvml-wrapper-sys predates two profiles).
const GI_PROFILE_COUNT: u32 = 0x12;
/// `NVML_COMPUTE_INSTANCE_PROFILE_COUNT` of the current header.
const CI_PROFILE_COUNT: u32 = 0x9;

/// `nvmlComputeInstanceInfo_t` as `nvmlComputeInstanceGetInfo` (v1) writes it: without `placement`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ComputeInstanceInfoV1 {
    device: nvmlDevice_t,
    gpu_instance: nvmlGpuInstance_t,
    id: c_uint,
    profile_id: c_uint,
}

/// The model of a MIG-capable GPU (`NOT_SUPPORTED` for others).
fn mig_model(node: &Node, gpu: u32) -> R<&'static GpuModel> {
    let m = node.gpu(gpu).nv()?.model;
    if m.mig.is_none() {
        return Err(NOT_SUPPORTED);
    }
    Ok(m)
}

/// Whether MIG mode is on now.
fn mig_on(node: &Node, gpu: u32) -> R<bool> {
    Ok(node.mig_mode(gpu).nv()?.0)
}

/// A GPU-instance profile by id (`INVALID_ARGUMENT` for an id the board does not have).
fn gi_profile_by_id(node: &Node, gpu: u32, id: u32) -> R<&'static GiProfile> {
    mig_model(node, gpu)?.gi_profile_by_id(id).ok_or(INVALID_ARGUMENT)
}

/// A GPU-instance profile by `NVML_GPU_INSTANCE_PROFILE_*` (out of range: `INVALID_ARGUMENT`;
/// not offered by the board: `NOT_SUPPORTED`).
fn gi_profile_by_enum(node: &Node, gpu: u32, profile: u32) -> R<&'static GiProfile> {
    let m = mig_model(node, gpu)?;
    if profile >= GI_PROFILE_COUNT {
        return Err(INVALID_ARGUMENT);
    }
    m.gi_profile(profile).ok_or(NOT_SUPPORTED)
}

fn gi_info_v1(p: &GiProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: u32::from(p.p2p_supported),
        sliceCount: p.slice_count,
        instanceCount: p.instance_count,
        multiprocessorCount: p.sm_count,
        copyEngineCount: p.copy_engines,
        decoderCount: p.decoders,
        encoderCount: p.encoders,
        jpegCount: p.jpegs,
        ofaCount: p.ofas,
        memorySizeMB: p.memory_mib,
    }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetMigMode`.
    fn nvmlDeviceGetMigMode(device, current_mode, pending_mode) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(current_mode)?;
        need(pending_mode)?;
        let (current, pending) = node.mig_mode(gpu).nv()?;
        // SAFETY: both pointers are checked non-null and aligned; valid for writes by the caller's contract.
        unsafe {
            put(current_mode, u32::from(current))?;
            put(pending_mode, u32::from(pending))
        }
    }

    /// `nvmlDeviceSetMigMode`, per architecture (docs/sim.md, "MIG mode changes"):
    /// - Ampere: the mode becomes pending until the next GPU reset; `NVML_SUCCESS` with
    ///   `activationStatus` `NVML_ERROR_RESET_REQUIRED`, or `NVML_ERROR_IN_USE` while processes use
    ///   the GPU (the driver could not reset it);
    /// - Hopper and later: the mode takes effect at once (`activationStatus` `NVML_SUCCESS`);
    ///   refused with `IN_USE` (return code and `activationStatus`) while processes use the GPU.
    ///
    /// Already in that mode: `NVML_SUCCESS` twice. Disabling while GPU instances exist: `IN_USE`.
    fn nvmlDeviceSetMigMode(device, mode, activation_status) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(activation_status)?;
        let enable = match mode {
            NVML_DEVICE_MIG_DISABLE => false,
            NVML_DEVICE_MIG_ENABLE => true,
            _ => return Err(INVALID_ARGUMENT),
        };
        mig_model(node, gpu)?;
        let activation = match node.set_mig_mode(gpu, enable) {
            Ok(MigModeChange::PendingReset { in_use: true }) => IN_USE,
            Ok(MigModeChange::PendingReset { in_use: false }) => RESET_REQUIRED,
            Ok(MigModeChange::Applied | MigModeChange::Unchanged) => SUCCESS,
            Err(SimError::InUse(_)) => {
                // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
                unsafe { put(activation_status, IN_USE) }?;
                return Err(IN_USE);
            }
            Err(e) => return Err(code(&e)),
        };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(activation_status, activation) }
    }

    /// `nvmlDeviceGetGpuInstanceProfileInfo`: a profile by `NVML_GPU_INSTANCE_PROFILE_*`.
    fn nvmlDeviceGetGpuInstanceProfileInfo(device, profile, info) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(info)?;
        let p = gi_profile_by_enum(node, gpu, profile)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(info, gi_info_v1(p)) }
    }
}

/// Writes a versioned GPU-instance profile info (v2 or v3, by the caller's `version`).
///
/// # Safety
/// `info` must be null or valid for reads of a `u32` and writes of the struct its version names.
unsafe fn put_gi_info_versioned(info: *mut nvmlGpuInstanceProfileInfo_v2_t, p: &GiProfile) -> R {
    // SAFETY: as this function's contract.
    let version = unsafe { get(info.cast_const().cast::<u32>()) }?;
    let v1 = gi_info_v1(p);
    if version == struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2) {
        // SAFETY: zeroes are a valid value of this plain C struct.
        let mut v2: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
        v2.version = version;
        v2.id = v1.id;
        v2.isP2pSupported = v1.isP2pSupported;
        v2.sliceCount = v1.sliceCount;
        v2.instanceCount = v1.instanceCount;
        v2.multiprocessorCount = v1.multiprocessorCount;
        v2.copyEngineCount = v1.copyEngineCount;
        v2.decoderCount = v1.decoderCount;
        v2.encoderCount = v1.encoderCount;
        v2.jpegCount = v1.jpegCount;
        v2.ofaCount = v1.ofaCount;
        v2.memorySizeMB = v1.memorySizeMB;
        fill_chars(&mut v2.name, &p.smi_name());
        // SAFETY: the caller declared a v2 struct; info was checked non-null and aligned.
        return unsafe { put(info, v2) };
    }
    if version == struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3) {
        // SAFETY: zeroes are a valid value of this plain C struct.
        let mut v3: nvmlGpuInstanceProfileInfo_v3_t = unsafe { std::mem::zeroed() };
        v3.version = version;
        v3.id = v1.id;
        v3.sliceCount = v1.sliceCount;
        v3.instanceCount = v1.instanceCount;
        v3.multiprocessorCount = v1.multiprocessorCount;
        v3.copyEngineCount = v1.copyEngineCount;
        v3.decoderCount = v1.decoderCount;
        v3.encoderCount = v1.encoderCount;
        v3.jpegCount = v1.jpegCount;
        v3.ofaCount = v1.ofaCount;
        v3.memorySizeMB = v1.memorySizeMB;
        fill_chars(&mut v3.name, &p.smi_name());
        v3.capabilities = if p.p2p_supported { NVML_GPU_INSTANCE_PROFILE_CAPS_P2P } else { 0 };
        // SAFETY: the caller declared a v3 struct; info was checked non-null and aligned.
        return unsafe { put(info.cast::<nvmlGpuInstanceProfileInfo_v3_t>(), v3) };
    }
    Err(INVALID_ARGUMENT)
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetGpuInstanceProfileInfoV`: versioned (v2 or v3) info, MIG mode on.
    fn nvmlDeviceGetGpuInstanceProfileInfoV(device, profile, info) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(info)?;
        // Listed with MIG off too, as a real H200 listed them (issue 35).
        let p = gi_profile_by_enum(node, gpu, profile)?;
        // SAFETY: info is valid for the struct its version names (caller's contract).
        unsafe { put_gi_info_versioned(info, p) }
    }

    /// `nvmlDeviceGetGpuInstanceProfileInfoByIdV`: the same by profile id.
    fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(device, profile_id, info) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(info)?;
        // Listed with MIG off too, as the unversioned call and a real H200 do.
        let p = gi_profile_by_id(node, gpu, profile_id)?;
        // SAFETY: info is valid for the struct its version names (caller's contract).
        unsafe { put_gi_info_versioned(info, p) }
    }
}

fn gi_placements(node: &Node, device: nvmlDevice_t, profile_id: u32) -> R<Vec<nvmlGpuInstancePlacement_t>> {
    let gpu = handles::physical_gpu(node, device)?;
    let p = gi_profile_by_id(node, gpu, profile_id)?;
    Ok(p.placements.iter().map(|&start| nvmlGpuInstancePlacement_t { start, size: p.placement_size }).collect())
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`: every placement the profile allows (whatever
    /// exists already, MIG mode on or off). Null `placements` asks for the count; otherwise `*count`
    /// is the buffer's capacity (`INSUFFICIENT_SIZE` with the needed count when short).
    fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(device, profile_id, placements, count) {
        let node = node()?;
        handles::decode_device(node, device)?;
        need(count)?;
        let list = gi_placements(node, device, profile_id)?;
        if placements.is_null() {
            // SAFETY: count is checked non-null and aligned; valid for a write by the caller's contract.
            return unsafe { put(count, list.len() as u32) };
        }
        // SAFETY: count is valid for reads and writes, placements for `*count` elements (caller's contract).
        unsafe { fill_list(count, placements, list) }
    }

    /// `nvmlDeviceGetGpuInstancePossiblePlacements` (v1): `count` is output only and a non-null
    /// buffer must hold every placement of the profile (the v1 contract).
    fn nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, placements, count) {
        let node = node()?;
        handles::decode_device(node, device)?;
        need(count)?;
        let list = gi_placements(node, device, profile_id)?;
        if !placements.is_null() {
            need(placements)?;
            for (i, p) in list.iter().enumerate() {
                // SAFETY: the v1 contract: a non-null buffer holds all of the profile's placements.
                unsafe { placements.add(i).write(*p) };
            }
        }
        // SAFETY: count is checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(count, list.len() as u32) }
    }

    /// `nvmlDeviceGetGpuInstanceRemainingCapacity`: how many more instances of a profile fit now.
    fn nvmlDeviceGetGpuInstanceRemainingCapacity(device, profile_id, count) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(count)?;
        let p = gi_profile_by_id(node, gpu, profile_id)?;
        let n = node.gi_remaining_capacity(gpu, p.nvml_profile).nv()?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(count, n) }
    }
}

fn create_gi(
    device: nvmlDevice_t,
    profile_id: u32,
    placement: Option<nvmlGpuInstancePlacement_t>,
) -> R<nvmlGpuInstance_t> {
    let node = node()?;
    let gpu = handles::physical_gpu(node, device)?;
    let p = gi_profile_by_id(node, gpu, profile_id)?;
    let start = match placement {
        Some(pl) if pl.size != p.placement_size => return Err(INVALID_ARGUMENT),
        Some(pl) => Some(pl.start),
        None => None,
    };
    let gi = node.create_gpu_instance(gpu, p.nvml_profile, start).nv()?;
    gi_handle(gpu, gi.id)
}

nvml_guarded_exports! {
    /// `nvmlDeviceCreateGpuInstance`: at the first placement that fits (`INSUFFICIENT_RESOURCES` if none).
    fn nvmlDeviceCreateGpuInstance(device, profile_id, gpu_instance) {
        node()?;
        need(gpu_instance)?;
        let h = create_gi(device, profile_id, None)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(gpu_instance, h) }
    }

    /// `nvmlDeviceCreateGpuInstanceWithPlacement`: a placement the profile does not allow is
    /// `INVALID_ARGUMENT`, one overlapping an existing instance `INSUFFICIENT_RESOURCES`.
    fn nvmlDeviceCreateGpuInstanceWithPlacement(device, profile_id, placement, gpu_instance) {
        node()?;
        need(gpu_instance)?;
        // SAFETY: placement is null or valid for a read by the caller's contract.
        let pl = unsafe { get(placement) }?;
        let h = create_gi(device, profile_id, Some(pl))?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(gpu_instance, h) }
    }

    /// `nvmlGpuInstanceDestroy`: `IN_USE` while it has compute instances or processes hold its memory.
    fn nvmlGpuInstanceDestroy(gpu_instance) {
        let node = node()?;
        let (gpu, gi) = handles::gpu_instance(node, gpu_instance)?;
        node.destroy_gpu_instance(gpu, gi.id).nv()
    }

    /// `nvmlDeviceGetGpuInstances`: the instances of a profile; the buffer must hold the profile's
    /// instance count (the header's contract).
    fn nvmlDeviceGetGpuInstances(device, profile_id, gpu_instances, count) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(count)?;
        need(gpu_instances)?;
        let p = gi_profile_by_id(node, gpu, profile_id)?;
        let gis: Vec<GpuInstance> =
            node.gpu_instances(gpu).nv()?.into_iter().filter(|g| g.profile.id == p.id).collect();
        let n = gis.len().min(p.instance_count as usize);
        for (i, gi) in gis[..n].iter().enumerate() {
            let h = gi_handle(gpu, gi.id)?;
            // SAFETY: gpu_instances is non-null, aligned and holds the profile's instance count (>= n).
            unsafe { gpu_instances.add(i).write(h) };
        }
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(count, n as u32) }
    }

    /// `nvmlDeviceGetGpuInstanceById`: `NOT_FOUND` for no such instance.
    fn nvmlDeviceGetGpuInstanceById(device, id, gpu_instance) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(gpu_instance)?;
        let gi = node.gpu_instances(gpu).nv()?.into_iter().find(|g| g.id == id).ok_or(NOT_FOUND)?;
        let h = gi_handle(gpu, gi.id)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(gpu_instance, h) }
    }

    /// `nvmlGpuInstanceGetInfo`: parent device, id, profile id, placement.
    fn nvmlGpuInstanceGetInfo(gpu_instance, info) {
        let node = node()?;
        let (gpu, gi) = handles::gpu_instance(node, gpu_instance)?;
        need(info)?;
        let v = nvmlGpuInstanceInfo_t {
            device: gpu_handle(gpu),
            id: gi.id,
            profileId: gi.profile.id,
            placement: nvmlGpuInstancePlacement_t { start: gi.start, size: gi.profile.placement_size },
        };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(info, v) }
    }
}

/// The compute-instance profiles a GPU instance offers: (profile, instance count, placements).
fn offered(node: &Node, gpu: u32, gi: &GpuInstance) -> R<Vec<(&'static CiProfile, u32, Vec<u32>)>> {
    Ok(mig_model(node, gpu)?.ci_profiles_for(gi.profile))
}

/// A compute-instance profile a GPU instance offers (out of range: `INVALID_ARGUMENT`; not
/// offered in this GPU instance: `NOT_SUPPORTED`).
fn ci_offer(node: &Node, gpu: u32, gi: &GpuInstance, profile: u32) -> R<(&'static CiProfile, u32, Vec<u32>)> {
    if profile >= CI_PROFILE_COUNT {
        return Err(INVALID_ARGUMENT);
    }
    offered(node, gpu, gi)?.into_iter().find(|(p, _, _)| p.nvml_profile == profile).ok_or(NOT_SUPPORTED)
}

fn ci_info_v1(gi: &GiProfile, p: &CiProfile, count: u32) -> nvmlComputeInstanceProfileInfo_t {
    nvmlComputeInstanceProfileInfo_t {
        id: p.nvml_profile,
        sliceCount: p.slice_count,
        instanceCount: count,
        multiprocessorCount: p.sm_count_in(gi),
        sharedCopyEngineCount: gi.copy_engines,
        sharedDecoderCount: gi.decoders,
        sharedEncoderCount: gi.encoders,
        sharedJpegCount: gi.jpegs,
        sharedOfaCount: gi.ofas,
    }
}

nvml_guarded_exports! {
    /// `nvmlGpuInstanceGetComputeInstanceProfileInfo`: a profile by `NVML_COMPUTE_INSTANCE_PROFILE_*`
    /// (the engines are the GPU instance's, shared by its compute instances).
    fn nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, profile, eng_profile, info) {
        let node = node()?;
        let (gpu, gi) = handles::gpu_instance(node, gpu_instance)?;
        need(info)?;
        if eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
            return Err(INVALID_ARGUMENT);
        }
        let (p, count, _) = ci_offer(node, gpu, &gi, profile)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(info, ci_info_v1(gi.profile, p, count)) }
    }

    /// `nvmlGpuInstanceGetComputeInstanceProfileInfoV`: versioned (v2 or v3, by the caller's `version`).
    fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(gpu_instance, profile, eng_profile, info) {
        let node = node()?;
        let (gpu, gi) = handles::gpu_instance(node, gpu_instance)?;
        // SAFETY: info is null or valid for a read of its leading version (caller's contract).
        let version = unsafe { get(info.cast_const().cast::<u32>()) }?;
        if eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
            return Err(INVALID_ARGUMENT);
        }
        let (p, count, _) = ci_offer(node, gpu, &gi, profile)?;
        let v1 = ci_info_v1(gi.profile, p, count);
        let name = format!("MIG {}", p.name_in(gi.profile));
        if version == struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2) {
            // SAFETY: zeroes are a valid value of this plain C struct.
            let mut v2: nvmlComputeInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            v2.version = version;
            v2.id = v1.id;
            v2.sliceCount = v1.sliceCount;
            v2.instanceCount = v1.instanceCount;
            v2.multiprocessorCount = v1.multiprocessorCount;
            v2.sharedCopyEngineCount = v1.sharedCopyEngineCount;
            v2.sharedDecoderCount = v1.sharedDecoderCount;
            v2.sharedEncoderCount = v1.sharedEncoderCount;
            v2.sharedJpegCount = v1.sharedJpegCount;
            v2.sharedOfaCount = v1.sharedOfaCount;
            fill_chars(&mut v2.name, &name);
            // SAFETY: the caller declared a v2 struct; info was checked non-null and aligned.
            return unsafe { put(info, v2) };
        }
        if version == struct_version::<nvmlComputeInstanceProfileInfo_v3_t>(3) {
            // SAFETY: zeroes are a valid value of this plain C struct.
            let mut v3: nvmlComputeInstanceProfileInfo_v3_t = unsafe { std::mem::zeroed() };
            v3.version = version;
            v3.id = v1.id;
            v3.sliceCount = v1.sliceCount;
            v3.instanceCount = v1.instanceCount;
            v3.multiprocessorCount = v1.multiprocessorCount;
            v3.sharedCopyEngineCount = v1.sharedCopyEngineCount;
            v3.sharedDecoderCount = v1.sharedDecoderCount;
            v3.sharedEncoderCount = v1.sharedEncoderCount;
            v3.sharedJpegCount = v1.sharedJpegCount;
            v3.sharedOfaCount = v1.sharedOfaCount;
            fill_chars(&mut v3.name, &name);
            v3.capabilities = 0;
            // SAFETY: the caller declared a v3 struct; info was checked non-null and aligned.
            return unsafe { put(info.cast::<nvmlComputeInstanceProfileInfo_v3_t>(), v3) };
        }
        Err(INVALID_ARGUMENT)
    }

    /// `nvmlGpuInstanceGetComputeInstanceRemainingCapacity`.
    fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gpu_instance, profile_id, count) {
        let node = node()?;
        let (gpu, gi) = handles::gpu_instance(node, gpu_instance)?;
        need(count)?;
        ci_offer(node, gpu, &gi, profile_id)?;
        let n = node.ci_remaining_capacity(gpu, gi.id, profile_id).nv()?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(count, n) }
    }

    /// `nvmlGpuInstanceGetComputeInstancePossiblePlacements`: every placement of the profile inside
    /// the GPU instance, in its compute slices. Null `placements` asks for the count.
    fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(gpu_instance, profile_id, placements, count) {
        let node = node()?;
        let (gpu, gi) = handles::gpu_instance(node, gpu_instance)?;
        need(count)?;
        let (p, _, starts) = ci_offer(node, gpu, &gi, profile_id)?;
        let list: Vec<_> =
            starts.iter().map(|&start| nvmlComputeInstancePlacement_t { start, size: p.slice_count }).collect();
        if placements.is_null() {
            // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
            return unsafe { put(count, list.len() as u32) };
        }
        // SAFETY: count is valid for reads and writes, placements for `*count` elements (caller's contract).
        unsafe { fill_list(count, placements, list) }
    }
}

fn create_ci(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: u32,
    placement: Option<nvmlComputeInstancePlacement_t>,
) -> R<nvmlComputeInstance_t> {
    let node = node()?;
    let (gpu, gi) = handles::gpu_instance(node, gpu_instance)?;
    let (p, _, _) = ci_offer(node, gpu, &gi, profile_id)?;
    let start = match placement {
        Some(pl) if pl.size != p.slice_count => return Err(INVALID_ARGUMENT),
        Some(pl) => Some(pl.start),
        None => None,
    };
    let ci = node.create_compute_instance(gpu, gi.id, profile_id, start).nv()?;
    ci_handle(gpu, gi.id, ci.id)
}

nvml_guarded_exports! {
    /// `nvmlGpuInstanceCreateComputeInstance`: at the first placement that fits.
    fn nvmlGpuInstanceCreateComputeInstance(gpu_instance, profile_id, compute_instance) {
        node()?;
        need(compute_instance)?;
        let h = create_ci(gpu_instance, profile_id, None)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(compute_instance, h) }
    }

    /// `nvmlGpuInstanceCreateComputeInstanceWithPlacement`: `INSUFFICIENT_RESOURCES` when the
    /// placement is taken.
    fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(gpu_instance, profile_id, placement, compute_instance) {
        node()?;
        need(compute_instance)?;
        // SAFETY: placement is null or valid for a read by the caller's contract.
        let pl = unsafe { get(placement) }?;
        let h = create_ci(gpu_instance, profile_id, Some(pl))?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(compute_instance, h) }
    }

    /// `nvmlComputeInstanceDestroy`: `IN_USE` while a process has a context on it.
    fn nvmlComputeInstanceDestroy(compute_instance) {
        let node = node()?;
        let m = handles::compute_instance(node, compute_instance)?;
        node.destroy_compute_instance(m.gpu, m.gi.id, m.ci.id).nv()
    }

    /// `nvmlGpuInstanceGetComputeInstances`: the compute instances of a profile; the buffer must hold
    /// the profile's instance count (the header's contract).
    fn nvmlGpuInstanceGetComputeInstances(gpu_instance, profile_id, compute_instances, count) {
        let node = node()?;
        let (gpu, gi) = handles::gpu_instance(node, gpu_instance)?;
        need(count)?;
        need(compute_instances)?;
        let (_, max, _) = ci_offer(node, gpu, &gi, profile_id)?;
        let cis: Vec<ComputeInstance> = node
            .compute_instances(gpu, Some(gi.id))
            .nv()?
            .into_iter()
            .filter(|c| c.profile.nvml_profile == profile_id)
            .collect();
        let n = cis.len().min(max as usize);
        for (i, ci) in cis[..n].iter().enumerate() {
            let h = ci_handle(gpu, gi.id, ci.id)?;
            // SAFETY: compute_instances is non-null, aligned and holds the profile's instance count (>= n).
            unsafe { compute_instances.add(i).write(h) };
        }
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(count, n as u32) }
    }

    /// `nvmlGpuInstanceGetComputeInstanceById`: `NOT_FOUND` for no such instance.
    fn nvmlGpuInstanceGetComputeInstanceById(gpu_instance, id, compute_instance) {
        let node = node()?;
        let (gpu, gi) = handles::gpu_instance(node, gpu_instance)?;
        need(compute_instance)?;
        let ci =
            node.compute_instances(gpu, Some(gi.id)).nv()?.into_iter().find(|c| c.id == id).ok_or(NOT_FOUND)?;
        let h = ci_handle(gpu, gi.id, ci.id)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(compute_instance, h) }
    }
}

fn ci_info(m: &handles::MigDevice) -> R<nvmlComputeInstanceInfo_t> {
    Ok(nvmlComputeInstanceInfo_t {
        device: gpu_handle(m.gpu),
        gpuInstance: gi_handle(m.gpu, m.gi.id)?,
        id: m.ci.id,
        profileId: m.ci.profile.nvml_profile,
        placement: nvmlComputeInstancePlacement_t { start: m.ci.start, size: m.ci.profile.slice_count },
    })
}

nvml_guarded_exports! {
    /// `nvmlComputeInstanceGetInfo_v2`: parent device and GPU instance, id, profile id, placement.
    fn nvmlComputeInstanceGetInfo_v2(compute_instance, info) {
        let node = node()?;
        let m = handles::compute_instance(node, compute_instance)?;
        need(info)?;
        let v = ci_info(&m)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(info, v) }
    }

    /// `nvmlComputeInstanceGetInfo` (v1): without the placement.
    fn nvmlComputeInstanceGetInfo(compute_instance, info) {
        let node = node()?;
        let m = handles::compute_instance(node, compute_instance)?;
        let out = info.cast::<ComputeInstanceInfoV1>();
        need(out)?;
        let v = ci_info(&m)?;
        let v1 = ComputeInstanceInfoV1 {
            device: v.device,
            gpu_instance: v.gpuInstance,
            id: v.id,
            profile_id: v.profileId,
        };
        // SAFETY: checked non-null and aligned; the v1 struct is a prefix of the caller's.
        unsafe { put(out, v1) }
    }

    /// `nvmlDeviceIsMigDeviceHandle`.
    fn nvmlDeviceIsMigDeviceHandle(device, is_mig_device) {
        let node = node()?;
        let dev = handles::device(node, device)?;
        need(is_mig_device)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(is_mig_device, u32::from(matches!(dev, Dev::Mig(_)))) }
    }
}

/// A MIG device handle (`INVALID_ARGUMENT` for a GPU handle).
fn mig_device(node: &Node, device: nvmlDevice_t) -> R<handles::MigDevice> {
    match handles::device(node, device)? {
        Dev::Mig(m) => Ok(m),
        Dev::Gpu(_) => Err(INVALID_ARGUMENT),
    }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetGpuInstanceId`: of a MIG device.
    fn nvmlDeviceGetGpuInstanceId(device, id) {
        let node = node()?;
        handles::decode_device(node, device)?;
        need(id)?;
        let m = mig_device(node, device)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(id, m.gi.id) }
    }

    /// `nvmlDeviceGetComputeInstanceId`: of a MIG device.
    fn nvmlDeviceGetComputeInstanceId(device, id) {
        let node = node()?;
        handles::decode_device(node, device)?;
        need(id)?;
        let m = mig_device(node, device)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(id, m.ci.id) }
    }

    /// `nvmlDeviceGetMaxMigDeviceCount`: the board's compute slices with MIG on, else 0.
    fn nvmlDeviceGetMaxMigDeviceCount(device, count) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(count)?;
        let m = node.gpu(gpu).nv()?.model;
        let n = match &m.mig {
            Some(spec) if mig_on(node, gpu)? => spec.compute_slices,
            _ => 0,
        };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(count, n) }
    }

    /// `nvmlDeviceGetMigDeviceHandleByIndex`: MIG devices in (GPU instance id, compute instance id)
    /// order; an index past the maximum is `INVALID_ARGUMENT`, one with no device `NOT_FOUND`.
    fn nvmlDeviceGetMigDeviceHandleByIndex(device, index, mig_device_out) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        need(mig_device_out)?;
        let spec = mig_model(node, gpu)?.mig.as_ref().ok_or(NOT_SUPPORTED)?;
        if !mig_on(node, gpu)? || index >= spec.compute_slices {
            return Err(INVALID_ARGUMENT);
        }
        let cis = node.compute_instances(gpu, None).nv()?;
        let ci = cis.get(index as usize).ok_or(NOT_FOUND)?;
        let h = mig_handle(gpu, ci.gi_id, ci.id)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(mig_device_out, h) }
    }

    /// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`: the parent GPU of a MIG device.
    fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig_device_in, device) {
        let node = node()?;
        let r = handles::decode_device(node, mig_device_in)?;
        need(device)?;
        let DevRef::Mig(..) = r else {
            return Err(INVALID_ARGUMENT);
        };
        let m = mig_device(node, mig_device_in)?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(device, gpu_handle(m.gpu)) }
    }
}
