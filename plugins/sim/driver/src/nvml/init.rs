//! Initialization (reference-counted, as NVML's) and the system-level queries.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU32, Ordering};

use tessera_sim_model::Node;

use super::*;
use crate::ffi::guard;

/// Successful `nvmlInit*` calls not yet matched by `nvmlShutdown`.
static REFS: AtomicU32 = AtomicU32::new(0);

pub(super) fn node() -> R<&'static Node> {
    if REFS.load(Ordering::Acquire) == 0 {
        return Err(UNINITIALIZED);
    }
    crate::process::node().map_err(|_| UNINITIALIZED)
}

/// The node whether or not NVML is initialized, for the few queries NVML answers without init.
fn node_any() -> R<&'static Node> {
    crate::process::node().map_err(|_| UNINITIALIZED)
}

fn init() -> R {
    // No driver (no node) is what a machine without the kernel module reports.
    crate::process::node().map_err(|_| DRIVER_NOT_LOADED)?;
    REFS.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

nvml_exports! {
    /// `nvmlInit_v2`: opens the node on first use; each call must be matched by `nvmlShutdown`.
    ///
    /// `nvmlInit` (v1, NVML 4.304 and older): the same as v2 here.
    fn nvmlInit_v2() also nvmlInit {
        guard(NVML_ERROR_UNKNOWN, || status(init))
    }

    /// `nvmlInitWithFlags`: as `nvmlInit_v2`; the flags (no GPUs / no attach) change nothing, the
    /// simulated node always has its GPUs attached.
    fn nvmlInitWithFlags(_flags) {
        guard(NVML_ERROR_UNKNOWN, || status(init))
    }
}

nvml_guarded_exports! {
    /// `nvmlShutdown`: drops one reference; the last one closes every event set.
    fn nvmlShutdown() {
        let prev = REFS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .map_err(|_| UNINITIALIZED)?;
        if prev == 1 {
            super::events::free_all();
        }
        Ok(())
    }

    /// `nvmlSystemGetDriverVersion`: the node description's driver version, e.g. "570.133.20".
    fn nvmlSystemGetDriverVersion(version, length) {
        let node = node()?;
        // SAFETY: version holds `length` bytes by the caller's contract.
        unsafe { put_str(version, length, &node.description().driver_version) }
    }
}

/// The NVML library version: the CUDA major version, then the driver version ("12.570.133.20").
fn nvml_version(node: &Node) -> String {
    let d = node.description();
    format!("{}.{}", d.cuda_driver_version / 1000, d.driver_version)
}

nvml_guarded_exports! {
    /// `nvmlSystemGetNVMLVersion` (answered without init, as NVML does).
    fn nvmlSystemGetNVMLVersion(version, length) {
        if version.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let v = nvml_version(node_any()?);
        // SAFETY: version holds `length` bytes by the caller's contract.
        unsafe { put_str(version, length, &v) }
    }
}

fn cuda_version() -> R<c_int> {
    Ok(node_any()?.description().cuda_driver_version as c_int)
}

nvml_guarded_exports! {
    /// `nvmlSystemGetCudaDriverVersion`: e.g. 12080 for CUDA 12.8.
    ///
    /// `nvmlSystemGetCudaDriverVersion_v2`: what `cuDriverGetVersion` of this same library returns.
    fn nvmlSystemGetCudaDriverVersion(cuda_driver_version) also nvmlSystemGetCudaDriverVersion_v2 {
        need(cuda_driver_version)?;
        let v = cuda_version()?;
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(cuda_driver_version, v) }
    }
}

/// A process's name as NVML reports it: its argv[0] (the comm name for processes without one).
fn process_name(pid: u32) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
    if !argv0.is_empty() {
        return Some(String::from_utf8_lossy(argv0).into_owned());
    }
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(comm.trim_end_matches('\n').to_string())
}

nvml_guarded_exports! {
    /// `nvmlSystemGetProcessName`: cropped to `length` (with its NUL); `NOT_FOUND` for no such process.
    fn nvmlSystemGetProcessName(pid, name, length) {
        node()?;
        if name.is_null() || length == 0 {
            return Err(INVALID_ARGUMENT);
        }
        let full = process_name(pid).ok_or(NOT_FOUND)?;
        let mut end = full.len().min(length as usize - 1);
        while !full.is_char_boundary(end) {
            end -= 1;
        }
        // SAFETY: name holds `length` bytes by the caller's contract, and end + 1 <= length.
        unsafe { put_str(name, length, &full[..end]) }
    }
}
