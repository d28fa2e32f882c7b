//! The MIG calls nvml-wrapper 0.13 lacks (GPU/compute-instance enumeration, creation and
//! destruction, versioned profile info, GI/CI ids of a MIG device), made through the function
//! table of the same loaded library (`Nvml::lib()`), so they share the daemon's one NVML session.
//! Its `possible_placements` is not used either: it returns an empty list (it never sets the
//! vector's length after the call fills it).

use std::ffi::{CStr, c_uint};
use std::mem;

use nvml_wrapper::Device;
use nvml_wrapper::Nvml;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper_sys::bindings::*;

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of current headers (nvml-wrapper-sys' predates two profiles).
const GI_PROFILE_COUNT: u32 = 0x12;

/// A GPU-instance profile's info, as `nvmlDeviceGetGpuInstanceProfileInfo(V)` give it.
pub(crate) struct RawProfile {
    pub nvml_profile: u32,
    pub info: nvmlGpuInstanceProfileInfo_t,
    /// From the versioned query (MIG mode on), without the "MIG " prefix.
    pub name: Option<String>,
}

/// Every GPU-instance profile the board offers.
pub(crate) fn profiles(nvml: &Nvml, dev: &Device) -> Result<Vec<RawProfile>, NvmlError> {
    let lib = nvml.lib();
    let info_v1 = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfo.as_ref())?;
    let info_v = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref()).ok();
    let mut out = Vec::new();
    for p in 0..GI_PROFILE_COUNT {
        // SAFETY: zeroes are a valid value of this plain C struct.
        let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { mem::zeroed() };
        // SAFETY: the handle is live for the session; info is a valid out pointer.
        match nvml_try(unsafe { info_v1(dev.handle(), p, &mut info) }) {
            Ok(()) => {}
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => continue,
            Err(e) => return Err(e),
        }
        let name = info_v.and_then(|f| {
            // SAFETY: zeroes are a valid value of this plain C struct.
            let mut v2: nvmlGpuInstanceProfileInfo_v2_t = unsafe { mem::zeroed() };
            v2.version = (mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32) | (2 << 24);
            // SAFETY: v2 is a versioned struct of the size its version names.
            nvml_try(unsafe { f(dev.handle(), p, &mut v2) }).ok()?;
            // SAFETY: the name is a NUL-terminated array NVML filled (zeroed before).
            let s = unsafe { CStr::from_ptr(v2.name.as_ptr()) }.to_string_lossy().into_owned();
            let s = s.strip_prefix("MIG ").unwrap_or(&s).to_string();
            (!s.is_empty()).then_some(s)
        });
        out.push(RawProfile { nvml_profile: p, info, name });
    }
    Ok(out)
}

/// Every placement a profile (by id) may take on an empty GPU.
pub(crate) fn possible_placements(nvml: &Nvml, dev: &Device, profile_id: u32) -> Result<Vec<(u32, u32)>, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstancePossiblePlacements_v2.as_ref())?;
    let mut count: c_uint = 0;
    // SAFETY: a null buffer asks for the count.
    nvml_try(unsafe { f(dev.handle(), profile_id, std::ptr::null_mut(), &mut count) })?;
    let mut buf = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    // SAFETY: buf holds `count` elements; count is its capacity on input.
    nvml_try(unsafe { f(dev.handle(), profile_id, buf.as_mut_ptr(), &mut count) })?;
    buf.truncate(count as usize);
    Ok(buf.into_iter().map(|p| (p.start, p.size)).collect())
}

/// A GPU instance: id, profile id, placement (start, size).
pub(crate) struct RawGi {
    pub id: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
}

/// The GPU instances of one profile.
pub(crate) fn gpu_instances(nvml: &Nvml, dev: &Device, profile_id: u32, max: u32) -> Result<Vec<RawGi>, NvmlError> {
    let lib = nvml.lib();
    let list = nvml_sym(lib.nvmlDeviceGetGpuInstances.as_ref())?;
    let get_info = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
    let mut handles: Vec<nvmlGpuInstance_t> = vec![std::ptr::null_mut(); max.max(1) as usize];
    let mut count: c_uint = 0;
    // SAFETY: the buffer holds the profile's instance count, as the header requires.
    nvml_try(unsafe { list(dev.handle(), profile_id, handles.as_mut_ptr(), &mut count) })?;
    handles.truncate(count as usize);
    let mut out = Vec::new();
    for h in handles {
        // SAFETY: zeroes are a valid value of this plain C struct.
        let mut info: nvmlGpuInstanceInfo_t = unsafe { mem::zeroed() };
        // SAFETY: h came from NVML; info is a valid out pointer.
        nvml_try(unsafe { get_info(h, &mut info) })?;
        out.push(RawGi {
            id: info.id,
            profile_id: info.profileId,
            start: info.placement.start,
            size: info.placement.size,
        });
    }
    Ok(out)
}

/// The (GPU-instance id, compute-instance id) of a MIG device.
pub(crate) fn mig_ids(nvml: &Nvml, mig: &Device) -> Result<(u32, u32), NvmlError> {
    let lib = nvml.lib();
    let gi = nvml_sym(lib.nvmlDeviceGetGpuInstanceId.as_ref())?;
    let ci = nvml_sym(lib.nvmlDeviceGetComputeInstanceId.as_ref())?;
    let (mut g, mut c): (c_uint, c_uint) = (0, 0);
    // SAFETY: the handle is live; g and c are valid out pointers.
    unsafe {
        nvml_try(gi(mig.handle(), &mut g))?;
        nvml_try(ci(mig.handle(), &mut c))?;
    }
    Ok((g, c))
}

/// A GPU instance's handle by id.
pub(crate) fn gpu_instance_by_id(nvml: &Nvml, dev: &Device, id: u32) -> Result<nvmlGpuInstance_t, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceById.as_ref())?;
    let mut h: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: the handle is live; h is a valid out pointer.
    nvml_try(unsafe { f(dev.handle(), id, &mut h) })?;
    Ok(h)
}

/// Creates a GPU instance of a profile (by id) at a placement.
pub(crate) fn create_gpu_instance(
    nvml: &Nvml,
    dev: &Device,
    profile_id: u32,
    start: u32,
    size: u32,
) -> Result<nvmlGpuInstance_t, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement.as_ref())?;
    let placement = nvmlGpuInstancePlacement_t { start, size };
    let mut h: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: the handle is live; placement and h are valid pointers.
    nvml_try(unsafe { f(dev.handle(), profile_id, &placement, &mut h) })?;
    Ok(h)
}

/// Creates the compute instance spanning a GPU instance (the profile whose slices equal the
/// GPU instance's, as `nvidia-smi mig -cgi … -C` does).
pub(crate) fn create_full_compute_instance(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gi_slices: u32,
) -> Result<(), NvmlError> {
    let lib = nvml.lib();
    let info = nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo.as_ref())?;
    let create = nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref())?;
    let mut chosen = None;
    for p in 0..9u32 {
        // SAFETY: zeroes are a valid value of this plain C struct.
        let mut ci: nvmlComputeInstanceProfileInfo_t = unsafe { mem::zeroed() };
        // SAFETY: gi came from NVML; ci is a valid out pointer.
        let r = unsafe { info(gi, p, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &mut ci) };
        if nvml_try(r).is_ok() && ci.sliceCount == gi_slices {
            chosen = Some(ci.id);
            break;
        }
    }
    let id = chosen.ok_or(NvmlError::NotSupported)?;
    let mut h: nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: gi came from NVML; h is a valid out pointer.
    nvml_try(unsafe { create(gi, id, &mut h) })
}

/// Destroys a GPU instance's compute instances, then the GPU instance.
pub(crate) fn destroy_gpu_instance(nvml: &Nvml, gi: nvmlGpuInstance_t) -> Result<(), NvmlError> {
    let lib = nvml.lib();
    let list = nvml_sym(lib.nvmlGpuInstanceGetComputeInstances.as_ref())?;
    let destroy_ci = nvml_sym(lib.nvmlComputeInstanceDestroy.as_ref())?;
    let destroy_gi = nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref())?;
    for p in 0..9u32 {
        let mut handles: Vec<nvmlComputeInstance_t> = vec![std::ptr::null_mut(); 8];
        let mut count: c_uint = 0;
        // SAFETY: the buffer holds 8 (every profile's instance count is at most 8).
        let r = unsafe { list(gi, p, handles.as_mut_ptr(), &mut count) };
        match nvml_try(r) {
            Ok(()) => {}
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => continue,
            Err(e) => return Err(e),
        }
        for &h in &handles[..count as usize] {
            // SAFETY: h came from NVML.
            nvml_try(unsafe { destroy_ci(h) })?;
        }
    }
    // SAFETY: gi came from NVML.
    nvml_try(unsafe { destroy_gi(gi) })
}
