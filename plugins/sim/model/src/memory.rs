//! Device memory: per GPU, per memory domain (whole GPU or one MIG GPU instance), per process.
//!
//! What a process holds lives in its own slot; totals are sums over live slots, so a process that
//! dies holds nothing the moment its slot is reaped, whatever it was doing when it died.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::*;

use crate::layout::*;
use crate::region::{Guard, slot_comm};
use crate::{Node, Result, SimError};

const MIB: u64 = 1 << 20;

/// Memory of a GPU or of a MIG GPU instance, as NVML's nvmlMemory_v2_t describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    pub total: u64,
    /// Held by the driver and firmware; never allocatable.
    pub reserved: u64,
    /// Allocated by processes (contexts included).
    pub used: u64,
    pub free: u64,
}

/// One process's memory on a GPU (or on one of its MIG instances).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUsage {
    pub pid: u32,
    pub name: String,
    pub used_bytes: u64,
    /// GPU instance id / compute instance id when the process runs on a MIG device.
    pub gi_id: Option<u32>,
    pub ci_id: Option<u32>,
}

pub(crate) fn clear_slot(p: &ProcSlot) {
    p.pid.store(0, Relaxed);
    p.sticky_xid.store(0, Relaxed);
    p.pid_ns.store(0, Relaxed);
    for c in &p.comm {
        c.store(0, Relaxed);
    }
    for g in 0..MAX_GPUS {
        p.ctx_units[g].store(0, Relaxed);
        for d in 0..DOMAINS {
            p.mem[g][d].store(0, Relaxed);
        }
        for u in 0..UNITS {
            p.served[g][u].store(0, Relaxed);
        }
    }
    for w in &p.active_streams {
        w.store(0, Relaxed);
    }
    for s in &p.streams {
        s.place.store(FREE_STREAM, Relaxed);
        s.submitted.store(0, Relaxed);
        s.served.store(0, Relaxed);
    }
    p.pending_mask.store(0, Relaxed);
    crate::checkpoint::clear(&p.checkpoint);
}

/// Frees everything a (dead) process held and makes its slot free.
pub(crate) fn release_slot(g: &Guard, slot: usize) {
    let s = g.shared();
    clear_slot(&s.procs[slot]);
    s.header.used_slots[slot / 64].fetch_and(!(1 << (slot % 64)), Release);
}

/// Restores every invariant after a lock holder died mid-change: dead slots reaped, stream
/// progress within what was submitted, active-stream bits matching the streams.
pub(crate) fn repair(g: &Guard) {
    g.reap();
    let s = g.shared();
    for slot in g.used_slots().collect::<Vec<_>>() {
        let p = &s.procs[slot];
        for (i, st) in p.streams.iter().enumerate() {
            let sub = st.submitted.load(Relaxed);
            if st.served.load(Relaxed) > sub {
                st.served.store(sub, Relaxed);
            }
            let active = st.place.load(Relaxed) != FREE_STREAM && st.served.load(Relaxed) < sub;
            let bit = 1u64 << (i % 64);
            if active {
                p.active_streams[i / 64].fetch_or(bit, Relaxed);
            } else {
                p.active_streams[i / 64].fetch_and(!bit, Relaxed);
            }
        }
    }
}

impl Node {
    /// Allocatable bytes of a memory domain: the whole GPU less what the driver reserves, or a
    /// GPU instance's memory.
    pub(crate) fn domain_capacity(&self, g: &Guard, gpu: u32, domain: usize) -> Result<u64> {
        let id = self.gpu(gpu)?;
        let gs = &g.shared().gpus[gpu as usize];
        if domain == 0 {
            if gs.mig_current.load(Relaxed) != 0 {
                return Err(SimError::NotSupported(format!("GPU {gpu} is in MIG mode; use its MIG devices")));
            }
            return Ok(id.model.memory_bytes - id.model.reserved_bytes);
        }
        let gi = gs.gis.get(domain - 1).filter(|e| e.valid.load(Relaxed) != 0);
        let gi = gi.ok_or_else(|| SimError::NotFound(format!("GPU instance slot {} on GPU {gpu}", domain - 1)))?;
        let profile = id
            .model
            .mig
            .as_ref()
            .and_then(|m| m.gi_profiles.iter().find(|p| p.nvml_profile == gi.nvml_profile.load(Relaxed)));
        profile.map(|p| p.memory_mib * MIB).ok_or_else(|| SimError::State("GPU instance with unknown profile".into()))
    }

    pub(crate) fn domain_used(g: &Guard, gpu: u32, domain: usize) -> u64 {
        g.used_slots().map(|s| g.shared().procs[s].mem[gpu as usize][domain].load(Relaxed)).sum()
    }

    /// Takes `bytes` of device memory for this process in a memory domain of a GPU
    /// (0: the whole GPU; 1 + k: MIG GPU-instance slot k). Fails with `OutOfMemory` beyond the
    /// physical size, counting every process on the node.
    pub fn alloc(&self, gpu: u32, domain: usize, bytes: u64) -> Result<()> {
        let slot = self.region.own_slot()?;
        if domain >= DOMAINS {
            return Err(SimError::InvalidArgument(format!("memory domain {domain}")));
        }
        let g = self.region.lock();
        self.check_gpu(gpu)?;
        let cap = self.domain_capacity(&g, gpu, domain)?;
        let fits = |g: &Guard| Self::domain_used(g, gpu, domain).checked_add(bytes).filter(|&t| t <= cap);
        let Some(total) = fits(&g).or_else(|| if g.reap() == 0 { None } else { fits(&g) }) else {
            return Err(SimError::OutOfMemory);
        };
        g.shared().procs[slot].mem[gpu as usize][domain].fetch_add(bytes, Relaxed);
        g.shared().gpus[gpu as usize].mem_high_water[domain].fetch_max(total, Relaxed);
        Ok(())
    }

    /// The most memory a domain ever held at one instant since the node's state was made (or
    /// [`Node::reset_high_water`]): every allocation updates it under the node's lock.
    pub fn memory_high_water(&self, gpu: u32, domain: usize) -> Result<u64> {
        self.check_gpu(gpu)?;
        let d = self.region.shared().gpus[gpu as usize].mem_high_water.get(domain);
        d.map(|d| d.load(Relaxed)).ok_or_else(|| SimError::InvalidArgument(format!("memory domain {domain}")))
    }

    /// Starts a domain's high-water mark again from what it holds now.
    pub fn reset_high_water(&self, gpu: u32, domain: usize) -> Result<()> {
        let g = self.region.lock();
        self.check_gpu(gpu)?;
        if domain >= DOMAINS {
            return Err(SimError::InvalidArgument(format!("memory domain {domain}")));
        }
        let now = Self::domain_used(&g, gpu, domain);
        g.shared().gpus[gpu as usize].mem_high_water[domain].store(now, Relaxed);
        Ok(())
    }

    /// Returns memory taken with [`Node::alloc`].
    pub fn free(&self, gpu: u32, domain: usize, bytes: u64) {
        let Some(cell) = self.own_cell(gpu, domain) else { return };
        let _ = cell.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(bytes)));
    }

    /// This process's count of what it holds in a domain (none before it has a slot).
    fn own_cell(&self, gpu: u32, domain: usize) -> Option<&AtomicU64> {
        self.region.own_proc().and_then(|p| p.mem.get(gpu as usize)?.get(domain))
    }

    /// What this process holds in a domain.
    pub fn own_usage(&self, gpu: u32, domain: usize) -> u64 {
        self.own_cell(gpu, domain).map_or(0, |c| c.load(Relaxed))
    }

    /// Memory of a whole GPU (`domain` 0) or of one of its GPU instances. Reaps dead processes
    /// first, so their memory never shows as used.
    pub fn memory_info(&self, gpu: u32, domain: usize) -> Result<MemoryInfo> {
        let g = self.region.lock();
        self.check_gpu(gpu)?;
        g.reap();
        let id = self.gpu(gpu)?;
        if domain == 0 {
            let used: u64 = (0..DOMAINS).map(|d| Self::domain_used(&g, gpu, d)).sum();
            let total = id.model.memory_bytes;
            let reserved = id.model.reserved_bytes;
            return Ok(MemoryInfo { total, reserved, used, free: total.saturating_sub(reserved + used) });
        }
        let total = self.domain_capacity(&g, gpu, domain)?;
        let used = Self::domain_used(&g, gpu, domain);
        Ok(MemoryInfo { total, reserved: 0, used, free: total.saturating_sub(used) })
    }

    /// Processes holding memory or a context on a GPU; with `unit` (1 + compute-instance slot),
    /// only those on that MIG device.
    pub fn processes(&self, gpu: u32, unit: Option<usize>) -> Result<Vec<ProcessUsage>> {
        let g = self.region.lock();
        self.check_gpu(gpu)?;
        g.reap();
        let gs = &g.shared().gpus[gpu as usize];
        let mut out = Vec::new();
        for s in g.used_slots() {
            let p = &g.shared().procs[s];
            let ctx = p.ctx_units[gpu as usize].load(Relaxed);
            for u in 0..UNITS {
                if let Some(want) = unit
                    && want != u
                {
                    continue;
                }
                let (domain, gi_id, ci_id) = if u == 0 {
                    (0, None, None)
                } else {
                    let ci = &gs.cis[u - 1];
                    if ci.valid.load(Relaxed) == 0 {
                        continue;
                    }
                    let gi_slot = ci.gi_slot.load(Relaxed) as usize;
                    (1 + gi_slot, Some(gs.gis[gi_slot].id.load(Relaxed)), Some(ci.id.load(Relaxed)))
                };
                let used = p.mem[gpu as usize][domain].load(Relaxed);
                if ctx & (1 << u) != 0 || (u == 0 && used > 0) {
                    out.push(ProcessUsage {
                        pid: p.pid.load(Relaxed),
                        name: slot_comm(p),
                        used_bytes: used,
                        gi_id,
                        ci_id,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Marks that this process holds a context on an execution unit (NVML lists it from then on).
    pub fn context_opened(&self, gpu: u32, unit: usize) -> Result<()> {
        let slot = self.region.own_slot()?;
        if unit >= UNITS || gpu as usize >= MAX_GPUS {
            return Err(SimError::InvalidArgument(format!("execution unit {gpu}/{unit}")));
        }
        self.region.shared().procs[slot].ctx_units[gpu as usize].fetch_or(1 << unit, Relaxed);
        Ok(())
    }

    /// Undoes [`Node::context_opened`] when the process's last context there is gone.
    pub fn context_closed(&self, gpu: u32, unit: usize) {
        if let Some(slot) = self.region.own_slot_if_any()
            && unit < UNITS
            && (gpu as usize) < MAX_GPUS
        {
            self.region.shared().procs[slot].ctx_units[gpu as usize].fetch_and(!(1 << unit), Relaxed);
        }
    }

    /// The XID of a fault that destroyed this process's contexts, if any (CUDA calls then fail).
    pub fn sticky_xid(&self) -> Option<u32> {
        let slot = self.region.own_slot_if_any()?;
        match self.region.shared().procs[slot].sticky_xid.load(Relaxed) {
            0 => None,
            x => Some(x),
        }
    }

    /// Device memory a new CUDA context takes.
    pub fn context_overhead_bytes(&self) -> u64 {
        self.description.context_overhead_mib * MIB
    }

    /// Releases the slots of processes that have died; returns how many.
    pub fn reap(&self) -> usize {
        self.region.lock().reap()
    }
}

#[cfg(test)]
mod tests {
    use crate::SimError;
    use crate::testutil::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn allocation_shows_in_every_handle_and_frees() {
        let t = default_node();
        let other = reopen(&t.state);
        let before = other.memory_info(0, 0).unwrap();
        assert_eq!(before.total, 81559 * (1 << 20));
        assert_eq!(before.used, 0);
        t.node.alloc(0, 0, 3 * GIB).unwrap();
        let during = other.memory_info(0, 0).unwrap();
        assert_eq!(during.used, 3 * GIB);
        assert_eq!(during.free, before.free - 3 * GIB);
        assert_eq!(other.memory_info(1, 0).unwrap().used, 0, "another GPU is untouched");
        let procs = other.processes(0, None).unwrap();
        assert_eq!(procs.len(), 1);
        assert_eq!(procs[0].pid, std::process::id());
        assert_eq!(procs[0].used_bytes, 3 * GIB);
        t.node.free(0, 0, 3 * GIB);
        assert_eq!(other.memory_info(0, 0).unwrap().used, 0);
    }

    #[test]
    fn out_of_memory_at_the_physical_size_across_processes() {
        let t = default_node();
        let other = reopen(&t.state);
        let cap = t.node.memory_info(0, 0).unwrap().free;
        t.node.alloc(0, 0, cap - GIB).unwrap();
        assert_eq!(other.alloc(0, 0, 2 * GIB), Err(SimError::OutOfMemory));
        other.alloc(0, 0, GIB).unwrap();
        assert_eq!(t.node.alloc(0, 0, 1), Err(SimError::OutOfMemory));
        assert_eq!(t.node.memory_info(0, 0).unwrap().free, 0);
    }

    #[test]
    fn a_closed_handle_leaves_nothing_behind() {
        let t = default_node();
        let other = reopen(&t.state);
        other.alloc(2, 0, 5 * GIB).unwrap();
        assert_eq!(t.node.memory_info(2, 0).unwrap().used, 5 * GIB);
        close(other);
        assert_eq!(t.node.memory_info(2, 0).unwrap().used, 0);
        assert!(t.node.processes(2, None).unwrap().is_empty());
    }

    #[test]
    fn sigkilled_process_memory_is_freed() {
        let t = default_node();
        let (mut c, _out) = child(&format!("alloc 1 {}", 7 * GIB), &t.state);
        assert_eq!(t.node.memory_info(1, 0).unwrap().used, 7 * GIB);
        assert_eq!(t.node.processes(1, None).unwrap()[0].pid, c.id());
        c.kill().unwrap();
        c.wait().unwrap();
        assert_eq!(t.node.memory_info(1, 0).unwrap().used, 0);
        assert!(t.node.processes(1, None).unwrap().is_empty());
        // The freed memory is usable again at once.
        let free = t.node.memory_info(1, 0).unwrap().free;
        t.node.alloc(1, 0, free).unwrap();
    }

    #[test]
    fn held_exits_stay_listed_with_their_memory_until_released() {
        let t = default_node();
        assert!(!t.node.hold_exits(true), "not held at first");
        let (mut c, _out) = child(&format!("alloc 1 {}", 3 * GIB), &t.state);
        let pid = c.id();
        c.kill().unwrap();
        c.wait().unwrap();
        for _ in 0..3 {
            let procs = t.node.processes(1, None).unwrap();
            assert_eq!(procs.iter().map(|p| (p.pid, p.used_bytes)).collect::<Vec<_>>(), [(pid, 3 * GIB)]);
            assert_eq!(t.node.memory_info(1, 0).unwrap().used, 3 * GIB);
        }
        assert!(t.node.hold_exits(false));
        assert!(t.node.processes(1, None).unwrap().is_empty(), "reaped at the next query");
        assert_eq!(t.node.memory_info(1, 0).unwrap().used, 0);
    }

    #[test]
    fn mig_mode_gpu_has_no_whole_gpu_memory_domain() {
        let t = node_from(Some("[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nmig = true\n"));
        assert!(matches!(t.node.alloc(0, 0, 1), Err(SimError::NotSupported(_))));
    }
}
