//! Framebuffer memory (v1 and v2) and BAR1.
//!
//! v1 (`nvmlMemory_t`): `used` is everything not free, the driver's reserve included, so
//! `total == used + free`. v2 (`nvmlMemory_v2_t`): `reserved` on its own, `used` only what
//! processes allocated, `total == reserved + used + free`. A MIG device reports its GPU instance's
//! memory; a GPU in MIG mode reports the whole board (all instances together).

use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::{MemoryInfo, Node};

use super::handles::{self, Dev};
use super::*;
use crate::latency;

const MIB: u64 = 1 << 20;

fn memory(node: &Node, device: nvmlDevice_t) -> R<MemoryInfo> {
    match handles::device(node, device)? {
        Dev::Gpu(g) => node.memory_info(g, 0).nv(),
        Dev::Mig(m) => node.memory_info(m.gpu, m.ci.domain()).nv(),
    }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetMemoryInfo` (v1): used includes the reserved memory.
    fn nvmlDeviceGetMemoryInfo(device, memory_out) {
        let _card = latency::floor("nvmlDeviceGetMemoryInfo");
        let node = node()?;
        handles::decode_device(node, device)?;
        need(memory_out)?;
        let m = memory(node, device)?;
        let v1 = nvmlMemory_t { total: m.total, free: m.free, used: m.total - m.free };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(memory_out, v1) }
    }

    /// `nvmlDeviceGetMemoryInfo_v2`: the caller sets `version = nvmlMemory_v2`; reserved separate.
    fn nvmlDeviceGetMemoryInfo_v2(device, memory_out) {
        let _card = latency::floor("nvmlDeviceGetMemoryInfo");
        let node = node()?;
        handles::decode_device(node, device)?;
        // SAFETY: memory_out is null or valid for reads and writes by the caller's contract.
        let version = unsafe { get(memory_out.cast_const().cast::<u32>()) }?;
        if version != struct_version::<nvmlMemory_v2_t>(2) {
            return Err(VERSION_MISMATCH);
        }
        let m = memory(node, device)?;
        let v2 = nvmlMemory_v2_t { version, total: m.total, reserved: m.reserved, free: m.free, used: m.used };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(memory_out, v2) }
    }
}

nvml_guarded_exports! {
    /// `nvmlDeviceGetBAR1MemoryInfo`: the board's aperture; the driver maps the board's idle figure
    /// (1 MiB on H100 and A100, 4.9 MiB on the H200), each process with a context 2 MiB more (what
    /// `nvidia-smi -q` shows on an idle or lightly used board).
    fn nvmlDeviceGetBAR1MemoryInfo(device, bar1_memory) {
        let node = node()?;
        let gpu = handles::whole_gpu(node, device)?;
        need(bar1_memory)?;
        let m = node.gpu(gpu).nv()?.model;
        let total = m.bar1_bytes;
        let procs = node.processes(gpu, None).nv()?.len() as u64;
        let used = (m.idle_bar1_used_bytes + 2 * procs * MIB).min(total);
        let info = nvmlBAR1Memory_t { bar1Total: total, bar1Free: total - used, bar1Used: used };
        // SAFETY: checked non-null and aligned; valid for a write by the caller's contract.
        unsafe { put(bar1_memory, info) }
    }
}
