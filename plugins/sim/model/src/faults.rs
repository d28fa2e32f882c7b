//! Fault injection and recovery, the operations `tessera-sim` performs on a node: what a real GPU
//! does when it raises an XID, counts ECC errors, falls off the bus, or is reset.

use std::sync::atomic::Ordering::*;

use crate::events::{EventKind, publish};
use crate::layout::*;
use crate::{Node, Result, SimError};

/// XID a GPU raises when it falls off the bus.
pub const XID_FALLEN_OFF_BUS: u32 = 79;
/// XIDs of row remapping: 63 recorded a remap, 64 failed to.
pub const XID_ROW_REMAP: u32 = 63;
pub const XID_ROW_REMAP_FAILURE: u32 = 64;
/// The sticky mark of contexts that a GPU reset destroyed (not an XID).
pub const STICKY_RESET: u32 = 0xFFFF_0000;

/// Health counters of one GPU, as NVML exposes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuHealth {
    pub lost: bool,
    pub last_xid: u32,
    pub ecc_corrected_volatile: u64,
    pub ecc_uncorrected_volatile: u64,
    pub ecc_corrected_aggregate: u64,
    pub ecc_uncorrected_aggregate: u64,
    pub remapped_correctable: u64,
    pub remapped_uncorrectable: u64,
    pub remap_pending: bool,
    pub remap_failure: bool,
    /// `nvmlDeviceGpuRecoveryAction_t`: [`RECOVERY_NONE`], [`RECOVERY_GPU_RESET`], ….
    pub recovery_action: u32,
}

/// The driver's recovery actions (`nvmlDeviceGpuRecoveryAction_t`).
pub const RECOVERY_NONE: u32 = 0;
pub const RECOVERY_GPU_RESET: u32 = 1;
pub const RECOVERY_NODE_REBOOT: u32 = 2;

/// XIDs after which NVIDIA's XID catalog has the GPU reset (the driver reports the recovery
/// action GPU_RESET until one happens): uncorrectable memory errors (48, 63 with a remap
/// pending, 64, 94, 95), GPU/engine hangs and firmware faults (61, 62, 74, 119, 120, 140).
const RESET_XIDS: [u32; 11] = [48, 61, 62, 63, 64, 74, 94, 95, 119, 120, 140];

impl Node {
    /// The GPU's health counters (readable even when it is lost, for the simulator's own CLI).
    pub fn health(&self, gpu: u32) -> Result<GpuHealth> {
        self.gpu(gpu)?;
        let gs = &self.region.shared().gpus[gpu as usize];
        Ok(GpuHealth {
            lost: gs.lost.load(Acquire) != 0,
            last_xid: gs.last_xid.load(Relaxed),
            ecc_corrected_volatile: gs.ecc_corrected_volatile.load(Relaxed),
            ecc_uncorrected_volatile: gs.ecc_uncorrected_volatile.load(Relaxed),
            ecc_corrected_aggregate: gs.ecc_corrected_aggregate.load(Relaxed),
            ecc_uncorrected_aggregate: gs.ecc_uncorrected_aggregate.load(Relaxed),
            remapped_correctable: gs.remapped_correctable.load(Relaxed),
            remapped_uncorrectable: gs.remapped_uncorrectable.load(Relaxed),
            remap_pending: gs.remap_pending.load(Relaxed) != 0,
            remap_failure: gs.remap_failure.load(Relaxed) != 0,
            recovery_action: gs.recovery_action.load(Relaxed),
        })
    }

    /// Holds processes that exit in NVML's process lists, memory and all (`true`), or lets them
    /// go (`false`: the next query reaps them), as a real driver lists an exiting process for a
    /// moment while it tears its contexts down. Returns whether they were held before.
    pub fn hold_exits(&self, hold: bool) -> bool {
        let _g = self.region.lock();
        self.region.shared().header.hold_exits.swap(u32::from(hold), AcqRel) != 0
    }

    /// Raises an XID on a GPU (or on one MIG instance of it). With `pid`, that process's
    /// contexts die with it (its CUDA calls fail from then on), as an application fault does.
    pub fn inject_xid(&self, gpu: u32, xid: u32, mig: Option<(u32, u32)>, pid: Option<u32>) -> Result<()> {
        if xid == 0 {
            return Err(SimError::InvalidArgument("XID 0 does not exist".into()));
        }
        if xid == XID_FALLEN_OFF_BUS {
            return self.fall_off_bus(gpu);
        }
        let g = self.region.lock();
        self.gpu(gpu)?;
        let gs = &g.shared().gpus[gpu as usize];
        if let Some(pid) = pid {
            let slot = g.used_slots().find(|&s| g.shared().procs[s].pid.load(Relaxed) == pid);
            let slot = slot.ok_or_else(|| SimError::NotFound(format!("process {pid} on the simulated node")))?;
            g.shared().procs[slot].sticky_xid.store(xid, Release);
        }
        match xid {
            XID_ROW_REMAP => {
                gs.remapped_uncorrectable.fetch_add(1, Relaxed);
                gs.remap_pending.store(1, Relaxed);
            }
            XID_ROW_REMAP_FAILURE => gs.remap_failure.store(1, Relaxed),
            _ => {}
        }
        if RESET_XIDS.contains(&xid) {
            gs.recovery_action.store(RECOVERY_GPU_RESET, Relaxed);
        }
        gs.last_xid.store(xid, Relaxed);
        publish(&g, gpu, EventKind::XidCritical, u64::from(xid), mig);
        Ok(())
    }

    /// Adds ECC errors; each kind raises its NVML event.
    pub fn inject_ecc(&self, gpu: u32, corrected: u64, uncorrected: u64) -> Result<()> {
        let g = self.region.lock();
        self.gpu(gpu)?;
        let gs = &g.shared().gpus[gpu as usize];
        if corrected > 0 {
            gs.ecc_corrected_volatile.fetch_add(corrected, Relaxed);
            gs.ecc_corrected_aggregate.fetch_add(corrected, Relaxed);
            publish(&g, gpu, EventKind::SingleBitEcc, corrected, None);
        }
        if uncorrected > 0 {
            gs.ecc_uncorrected_volatile.fetch_add(uncorrected, Relaxed);
            gs.ecc_uncorrected_aggregate.fetch_add(uncorrected, Relaxed);
            publish(&g, gpu, EventKind::DoubleBitEcc, uncorrected, None);
        }
        Ok(())
    }

    /// The GPU falls off the bus: XID 79, and every NVML and CUDA call on it fails as GPU-lost
    /// until a reset.
    pub fn fall_off_bus(&self, gpu: u32) -> Result<()> {
        let g = self.region.lock();
        self.gpu(gpu)?;
        let gs = &g.shared().gpus[gpu as usize];
        gs.lost.store(1, Release);
        gs.last_xid.store(XID_FALLEN_OFF_BUS, Relaxed);
        publish(&g, gpu, EventKind::XidCritical, u64::from(XID_FALLEN_OFF_BUS), None);
        Ok(())
    }

    /// Resets a GPU: back on the bus, volatile ECC counts cleared, a pending MIG mode applied
    /// (destroying its MIG instances), and every context on it destroyed (its processes' memory
    /// there freed, their CUDA calls failing from then on).
    pub fn reset(&self, gpu: u32) -> Result<()> {
        // A reset applies a pending MIG mode: the driver roots' proc trees follow.
        let _roots = self.refreshing_driver_roots();
        let g = self.region.lock();
        self.gpu(gpu)?;
        let s = g.shared();
        let gs = &s.gpus[gpu as usize];
        let was_lost = gs.lost.load(Acquire) != 0;
        gs.recovery_action.store(RECOVERY_NONE, Relaxed);
        // The fault the reset recovered from is history: the GPU reads healthy again.
        gs.last_xid.store(0, Relaxed);
        for slot in g.used_slots() {
            let p = &s.procs[slot];
            let held = p.mem[gpu as usize].iter().any(|m| m.load(Relaxed) > 0);
            if held || p.ctx_units[gpu as usize].load(Relaxed) != 0 {
                p.sticky_xid.store(if was_lost { XID_FALLEN_OFF_BUS } else { STICKY_RESET }, Release);
                p.ctx_units[gpu as usize].store(0, Relaxed);
                for m in &p.mem[gpu as usize] {
                    m.store(0, Relaxed);
                }
            }
            for (i, st) in p.streams.iter().enumerate() {
                if st.place.load(Relaxed) >> 8 == gpu && st.place.load(Relaxed) != FREE_STREAM {
                    st.served.store(st.submitted.load(Relaxed), Relaxed);
                    p.active_streams[i / 64].fetch_and(!(1 << (i % 64)), Relaxed);
                }
            }
        }
        let pending = gs.mig_pending.load(Relaxed);
        if pending != gs.mig_current.load(Relaxed) {
            for e in &gs.cis {
                e.valid.store(0, Relaxed);
            }
            for e in &gs.gis {
                e.valid.store(0, Relaxed);
            }
            gs.mig_current.store(pending, Relaxed);
            publish(&g, gpu, EventKind::MigConfigChange, u64::from(pending), None);
        }
        gs.ecc_corrected_volatile.store(0, Relaxed);
        gs.ecc_uncorrected_volatile.store(0, Relaxed);
        gs.remap_pending.store(0, Relaxed);
        gs.lost.store(0, Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::EventKind;
    use crate::testutil::*;

    #[test]
    fn lost_gpu_fails_work_until_reset() {
        let t = default_node();
        let watcher = reopen(&t.state);
        let mut cursor = watcher.event_cursor();
        t.node.alloc(2, 0, 1 << 30).unwrap();
        let s = t.node.stream_create(2, 0, 0).unwrap();
        t.node.fall_off_bus(2).unwrap();
        let ev = watcher.next_event(&mut cursor, |_| true, Duration::from_secs(1)).unwrap().unwrap();
        assert_eq!((ev.gpu, ev.kind, ev.data), (2, EventKind::XidCritical, 79));
        assert_eq!(t.node.alloc(2, 0, 1), Err(SimError::GpuLost(2)));
        assert_eq!(t.node.launch(s, 1000), Err(SimError::GpuLost(2)));
        assert_eq!(watcher.memory_info(2, 0), Err(SimError::GpuLost(2)));
        assert!(watcher.health(2).unwrap().lost);
        assert!(t.node.alloc(3, 0, 1).is_ok(), "other GPUs are fine");
        t.node.reset(2).unwrap();
        assert!(!watcher.health(2).unwrap().lost);
        assert_eq!(t.node.sticky_xid(), Some(XID_FALLEN_OFF_BUS), "the reset destroyed our context there");
        assert_eq!(watcher.memory_info(2, 0).unwrap().used, 0);
        let fresh = reopen(&t.state);
        fresh.alloc(2, 0, 1 << 30).unwrap();
    }

    #[test]
    fn xid_and_ecc_raise_events_and_counters() {
        let t = default_node();
        let mut cursor = t.node.event_cursor();
        t.node.inject_xid(1, 48, None, None).unwrap();
        t.node.inject_ecc(1, 5, 2).unwrap();
        t.node.inject_xid(0, 13, Some((1, 0)), None).unwrap();
        let mut got = Vec::new();
        while let Some(e) = t.node.next_event(&mut cursor, |_| true, Duration::from_millis(10)).unwrap() {
            got.push((e.gpu, e.kind, e.data, e.gi_id, e.ci_id));
        }
        assert_eq!(
            got,
            vec![
                (1, EventKind::XidCritical, 48, None, None),
                (1, EventKind::SingleBitEcc, 5, None, None),
                (1, EventKind::DoubleBitEcc, 2, None, None),
                (0, EventKind::XidCritical, 13, Some(1), Some(0)),
            ]
        );
        let h = t.node.health(1).unwrap();
        assert_eq!((h.ecc_corrected_volatile, h.ecc_uncorrected_aggregate, h.last_xid), (5, 2, 48));
        t.node.reset(1).unwrap();
        let h = t.node.health(1).unwrap();
        assert_eq!((h.ecc_corrected_volatile, h.ecc_corrected_aggregate), (0, 5), "volatile counts clear on reset");
    }

    #[test]
    fn an_application_xid_poisons_only_its_process() {
        let t = default_node();
        let victim = reopen(&t.state);
        victim.alloc(0, 0, 1).unwrap();
        t.node.alloc(0, 0, 1).unwrap();
        assert_eq!((victim.sticky_xid(), t.node.sticky_xid()), (None, None));
        // Both handles live in this process; the XID lands on one process slot, not the GPU.
        t.node.inject_xid(0, 13, None, Some(std::process::id())).unwrap();
        let poisoned = [victim.sticky_xid(), t.node.sticky_xid()];
        assert_eq!(poisoned.iter().filter(|x| **x == Some(13)).count(), 1);
        assert!(!t.node.health(0).unwrap().lost);
        assert!(matches!(t.node.inject_xid(0, 13, None, Some(u32::MAX)), Err(SimError::NotFound(_))));
    }

    #[test]
    fn row_remap_xids_set_remap_state() {
        let t = default_node();
        t.node.inject_xid(4, XID_ROW_REMAP, None, None).unwrap();
        let h = t.node.health(4).unwrap();
        assert!(h.remap_pending && !h.remap_failure && h.remapped_uncorrectable == 1);
        t.node.inject_xid(4, XID_ROW_REMAP_FAILURE, None, None).unwrap();
        assert!(t.node.health(4).unwrap().remap_failure);
    }

    #[test]
    fn event_wait_times_out_and_wakes() {
        let t = default_node();
        let mut cursor = t.node.event_cursor();
        let begin = std::time::Instant::now();
        assert_eq!(t.node.next_event(&mut cursor, |_| true, Duration::from_millis(50)).unwrap(), None);
        assert!(begin.elapsed() >= Duration::from_millis(50));
        let state = t.state.clone();
        let injector = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            reopen(&state).inject_xid(6, 94, None, None).unwrap();
        });
        let ev = t.node.next_event(&mut cursor, |e| e.gpu == 6, Duration::from_secs(10)).unwrap().unwrap();
        assert_eq!(ev.data, 94);
        injector.join().unwrap();
    }
}
