//! The shared half of the driver's checkpoint API (`cuCheckpointProcessLock`, `…Checkpoint`,
//! `…Restore`, `…Unlock`, `…GetState`, `…GetRestoreThreadId`).
//!
//! As in NVIDIA's driver, another process asks and the target process does the work: each CUDA
//! process runs a checkpoint thread (started by `cuInit`, its id is the restore thread id) that
//! sleeps on its slot's `request_futex`. A caller posts one request at a time into the target's
//! slot (a CAS from 0, so two callers never mix), wakes the thread and sleeps on `reply_futex`
//! until the reply carries its ticket, or the target is gone. The thread writes the reply and
//! frees the mailbox whatever became of the caller, so a caller killed mid-request leaves nothing
//! held.
//!
//! `state` is the process's `CUprocessState` and the word its CUDA calls sleep on while it is not
//! running. Parking moves what the slot holds (`mem`, `ctx_units`) to `parked_mem` /
//! `parked_units`: NVML and admission see it free, and the process unlisted, as the driver
//! releases a checkpointed process's allocations and device handles. A restore takes it back only
//! if it fits. The bytes themselves stay in the process's own memory, so a parked process that
//! dies leaves nothing behind: its slot is reaped as any other, and its host copy goes with it.

use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::*;
use std::time::Duration;

use crate::layout::*;
use crate::{Node, Result, SimError};

/// `CUprocessState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    Running = 0,
    Locked = 1,
    Checkpointed = 2,
    Failed = 3,
}

impl ProcessState {
    pub fn from_raw(v: u32) -> ProcessState {
        match v {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            _ => ProcessState::Failed,
        }
    }
}

/// What a caller asks of a process's checkpoint thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointOp {
    /// Lock, giving up after this many milliseconds (0: wait as long as it takes).
    Lock {
        timeout_ms: u32,
    },
    Checkpoint,
    Restore,
    Unlock,
}

/// The longest lock timeout a request carries (28 bits of milliseconds, about 74 hours).
const MAX_TIMEOUT_MS: u32 = (1 << 28) - 1;

impl CheckpointOp {
    fn encode(self) -> u64 {
        match self {
            CheckpointOp::Lock { timeout_ms } => (u64::from(timeout_ms.min(MAX_TIMEOUT_MS)) << 4) | 1,
            CheckpointOp::Checkpoint => 2,
            CheckpointOp::Restore => 3,
            CheckpointOp::Unlock => 4,
        }
    }

    fn decode(v: u64) -> Option<CheckpointOp> {
        match v & 0xf {
            1 => Some(CheckpointOp::Lock { timeout_ms: ((v & 0xffff_ffff) >> 4) as u32 }),
            2 => Some(CheckpointOp::Checkpoint),
            3 => Some(CheckpointOp::Restore),
            4 => Some(CheckpointOp::Unlock),
            _ => None,
        }
    }
}

/// A request as the checkpoint thread receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointRequest {
    pub op: CheckpointOp,
    raw: u64,
}

pub(crate) fn clear(c: &CheckpointState) {
    c.state.store(ProcessState::Running as u32, Relaxed);
    c.restore_tid.store(0, Relaxed);
    c.request.store(0, Relaxed);
    for r in &c.replies {
        r.store(0, Relaxed);
    }
    for g in 0..MAX_GPUS {
        c.parked_units[g].store(0, Relaxed);
        for d in 0..DOMAINS {
            c.parked_mem[g][d].store(0, Relaxed);
        }
    }
}

fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: i64::from(timeout.subsec_nanos()) };
    // SAFETY: futex wait on a u32 in our shared mapping with a valid relative timeout; it
    // returns at once if the word no longer equals `seen`.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, seen, &ts as *const libc::timespec, 0, 0)
    };
}

fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: futex wake on a u32 inside our shared mapping; waking never blocks or faults.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0, 0, 0) };
}

/// The process the caller calls `pid`, as its slot records it: its pid in its own (innermost)
/// PID namespace and that namespace, from `/proc`. `None` when the caller sees no such process,
/// or may not inspect it (the namespace link needs ptrace read access, as the driver's checkpoint
/// needs its caller to be allowed to act on the target): a tenant cannot reach another's process.
fn resolve_pid(pid: u32) -> Option<(u32, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let inner = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|v| v.split_whitespace().last()?.parse().ok())
        .unwrap_or(pid);
    let ns = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(format!("/proc/{pid}/ns/pid")).ok()?);
    Some((inner, ns))
}

/// How long a caller sleeps between looks at whether its target is still alive.
const ALIVE_CHECK: Duration = Duration::from_millis(50);

impl Node {
    fn own_checkpoint(&self) -> Result<&CheckpointState> {
        let slot = self.region.own_slot()?;
        Ok(&self.region.shared().procs[slot].checkpoint)
    }

    // ---- the target process's side (its checkpoint thread and its CUDA entry points) ----

    /// Makes this process a checkpointable CUDA process, served by the thread `tid`.
    pub fn checkpoint_serve(&self, tid: u32) -> Result<()> {
        let c = self.own_checkpoint()?;
        c.restore_tid.store(tid, Release);
        Ok(())
    }

    /// This process's `CUprocessState` word: its CUDA calls run only while it reads 0.
    pub fn checkpoint_gate(&self) -> Result<&AtomicU32> {
        Ok(&self.own_checkpoint()?.state)
    }

    /// Sleeps until this process is running again (a CUDA call of a locked process).
    pub fn checkpoint_wait_running(&self) {
        let Ok(c) = self.own_checkpoint() else { return };
        loop {
            let s = c.state.load(Acquire);
            if s == ProcessState::Running as u32 {
                return;
            }
            futex_wait(&c.state, s, Duration::from_secs(1));
        }
    }

    /// Sets this process's state; a return to running wakes its waiting CUDA calls.
    pub fn checkpoint_set_state(&self, state: ProcessState) -> Result<()> {
        let c = self.own_checkpoint()?;
        c.state.store(state as u32, Release);
        futex_wake_all(&c.state);
        Ok(())
    }

    /// Waits up to `timeout` for a request to this process's checkpoint thread.
    pub fn checkpoint_next_request(&self, timeout: Duration) -> Result<Option<CheckpointRequest>> {
        let c = self.own_checkpoint()?;
        let seen = c.request_futex.load(Acquire);
        let take = || {
            let raw = c.request.load(Acquire);
            CheckpointOp::decode(raw).map(|op| CheckpointRequest { op, raw })
        };
        if let Some(r) = take() {
            return Ok(Some(r));
        }
        futex_wait(&c.request_futex, seen, timeout);
        Ok(take())
    }

    /// Answers a request (`result` is a `CUresult`) and frees the mailbox for the next caller.
    pub fn checkpoint_reply(&self, req: &CheckpointRequest, result: u32) -> Result<()> {
        let c = self.own_checkpoint()?;
        let ticket = req.raw >> 32;
        c.replies[ticket as usize % CHECKPOINT_REPLIES].store((ticket << 32) | u64::from(result), Release);
        c.request.store(0, Release);
        c.reply_futex.fetch_add(1, Release);
        futex_wake_all(&c.reply_futex);
        Ok(())
    }

    /// Moves everything this process holds on every GPU to its parked books: NVML and
    /// admission see it free and the process unlisted. Returns the bytes moved.
    pub fn checkpoint_park_memory(&self) -> Result<u64> {
        let slot = self.region.own_slot()?;
        let _g = self.region.lock();
        let p = &self.region.shared().procs[slot];
        let mut moved = 0;
        for g in 0..MAX_GPUS {
            let units = p.ctx_units[g].swap(0, Relaxed);
            p.checkpoint.parked_units[g].fetch_or(units, Relaxed);
            for d in 0..DOMAINS {
                let bytes = p.mem[g][d].swap(0, Relaxed);
                p.checkpoint.parked_mem[g][d].fetch_add(bytes, Relaxed);
                moved += bytes;
            }
        }
        Ok(moved)
    }

    /// Takes this process's parked memory back onto its GPUs, all of it or none: `OutOfMemory`
    /// when a memory domain has not the room (every process counted), `GpuLost` when a GPU is
    /// gone. Returns the bytes taken back.
    pub fn checkpoint_unpark_memory(&self) -> Result<u64> {
        let slot = self.region.own_slot()?;
        let g = self.region.lock();
        let p = &self.region.shared().procs[slot];
        let wanted = |gpu: usize, d: usize| p.checkpoint.parked_mem[gpu][d].load(Relaxed);
        let short = |g: &crate::region::Guard| -> Result<bool> {
            for gpu in 0..self.gpus().len().min(MAX_GPUS) {
                for d in 0..DOMAINS {
                    let w = wanted(gpu, d);
                    if w == 0 {
                        continue;
                    }
                    self.check_gpu(gpu as u32)?;
                    let cap = self.domain_capacity(g, gpu as u32, d)?;
                    if Self::domain_used(g, gpu as u32, d).saturating_add(w) > cap {
                        return Ok(true);
                    }
                }
            }
            Ok(false)
        };
        if short(&g)? && (g.reap() == 0 || short(&g)?) {
            return Err(SimError::OutOfMemory);
        }
        let mut moved = 0;
        for gpu in 0..MAX_GPUS {
            let units = p.checkpoint.parked_units[gpu].swap(0, Relaxed);
            p.ctx_units[gpu].fetch_or(units, Relaxed);
            for d in 0..DOMAINS {
                let bytes = p.checkpoint.parked_mem[gpu][d].swap(0, Relaxed);
                if bytes > 0 {
                    let total = p.mem[gpu][d].fetch_add(bytes, Relaxed) + bytes;
                    let others: u64 = Self::domain_used(&g, gpu as u32, d).saturating_sub(total);
                    g.shared().gpus[gpu].mem_high_water[d].fetch_max(others + total, Relaxed);
                }
                moved += bytes;
            }
        }
        Ok(moved)
    }

    /// What this process has parked, in bytes, over every GPU.
    pub fn own_parked_bytes(&self) -> u64 {
        let Some(slot) = self.region.own_slot_if_any() else { return 0 };
        let c = &self.region.shared().procs[slot].checkpoint;
        c.parked_mem.iter().flatten().map(|b| b.load(Relaxed)).sum()
    }

    // ---- another process's side ----

    /// The live slot of the CUDA process the caller calls `pid` (its `(slot, pid in its own
    /// namespace)`): `NotFound` when no process of that id uses the node, or the caller cannot
    /// see it or may not inspect it, `NotSupported` when it never ran `cuInit`.
    fn checkpoint_slot(&self, pid: u32) -> Result<(usize, u32)> {
        let not_found = || SimError::NotFound(format!("process {pid} on the node"));
        let (inner, ns) = resolve_pid(pid).ok_or_else(not_found)?;
        let g = self.region.lock();
        g.reap();
        let p = |s: usize| &g.shared().procs[s];
        let mut found: Vec<usize> =
            g.used_slots().filter(|&s| p(s).pid.load(Relaxed) == inner && p(s).pid_ns.load(Relaxed) == ns).collect();
        found.sort_by_key(|&s| p(s).checkpoint.restore_tid.load(Acquire) == 0);
        let slot = *found.first().ok_or_else(not_found)?;
        if p(slot).checkpoint.restore_tid.load(Acquire) == 0 {
            return Err(SimError::NotSupported(format!("process {pid} has not initialized CUDA")));
        }
        Ok((slot, inner))
    }

    /// Whether `slot` still belongs to the live process `pid` (in its own namespace).
    fn checkpoint_target_alive(&self, slot: usize, pid: u32) -> bool {
        self.region.shared().procs[slot].pid.load(Relaxed) == pid && self.region.slot_alive(slot)
    }

    /// The state and the restore thread id of the CUDA process `pid`.
    pub fn checkpoint_state_of(&self, pid: u32) -> Result<(ProcessState, u32)> {
        let (slot, _) = self.checkpoint_slot(pid)?;
        let c = &self.region.shared().procs[slot].checkpoint;
        Ok((ProcessState::from_raw(c.state.load(Acquire)), c.restore_tid.load(Acquire)))
    }

    /// Asks the CUDA process `pid` to perform `op` and waits for its answer (a `CUresult`).
    /// `NotFound` when the process is not on the node; `InvalidArgument` when it died before it
    /// answered (killed while a lock waited for its GPU work, say): it is no process now, even
    /// while a zombie its parent has not reaped, not one that never initialized CUDA.
    pub fn checkpoint_request(&self, pid: u32, op: CheckpointOp) -> Result<u32> {
        let (slot, inner) = self.checkpoint_slot(pid)?;
        let c = &self.region.shared().procs[slot].checkpoint;
        let gone = || SimError::InvalidArgument(format!("process {pid} exited before it answered"));
        let ticket = loop {
            let t = c.next_ticket.fetch_add(1, Relaxed).wrapping_add(1);
            if t == 0 {
                continue; // 0 is no ticket
            }
            let raw = (u64::from(t) << 32) | op.encode();
            if c.request.compare_exchange(0, raw, AcqRel, Acquire).is_ok() {
                break t;
            }
            // Another caller's request is being served: wait for its reply, then try again.
            let seen = c.reply_futex.load(Acquire);
            if !self.checkpoint_target_alive(slot, inner) {
                return Err(gone());
            }
            if c.request.load(Acquire) != 0 {
                futex_wait(&c.reply_futex, seen, ALIVE_CHECK);
            }
        };
        c.request_futex.fetch_add(1, Release);
        futex_wake_all(&c.request_futex);
        loop {
            let seen = c.reply_futex.load(Acquire);
            let reply = c.replies[ticket as usize % CHECKPOINT_REPLIES].load(Acquire);
            if (reply >> 32) as u32 == ticket {
                return Ok(reply as u32);
            }
            if !self.checkpoint_target_alive(slot, inner) {
                // The mailbox is the dead slot's; clearing it is the reaper's job.
                return Err(gone());
            }
            futex_wait(&c.reply_futex, seen, ALIVE_CHECK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn ops_survive_their_encoding() {
        for op in [
            CheckpointOp::Lock { timeout_ms: 0 },
            CheckpointOp::Lock { timeout_ms: 1500 },
            CheckpointOp::Lock { timeout_ms: MAX_TIMEOUT_MS },
            CheckpointOp::Checkpoint,
            CheckpointOp::Restore,
            CheckpointOp::Unlock,
        ] {
            assert_eq!(CheckpointOp::decode(op.encode() | (7 << 32)), Some(op));
        }
        assert_eq!(
            CheckpointOp::decode(CheckpointOp::Lock { timeout_ms: u32::MAX }.encode()).unwrap(),
            CheckpointOp::Lock { timeout_ms: MAX_TIMEOUT_MS }
        );
        assert_eq!(CheckpointOp::decode(0), None);
    }

    #[test]
    fn parked_memory_is_free_for_others_and_comes_back_only_when_it_fits() {
        let t = default_node();
        let other = reopen(&t.state);
        t.node.alloc(0, 0, 10 * GIB).unwrap();
        t.node.context_opened(0, 0).unwrap();
        assert_eq!(t.node.checkpoint_park_memory().unwrap(), 10 * GIB);
        assert_eq!(other.memory_info(0, 0).unwrap().used, 0, "parked memory is free");
        assert!(other.processes(0, None).unwrap().is_empty(), "a parked process is not listed");
        assert_eq!(t.node.own_parked_bytes(), 10 * GIB);
        // Another process takes all but 5 GiB: the restore is refused, and changes nothing.
        let free = other.memory_info(0, 0).unwrap().free;
        other.alloc(0, 0, free - 5 * GIB).unwrap();
        assert_eq!(t.node.checkpoint_unpark_memory(), Err(SimError::OutOfMemory));
        assert_eq!(t.node.own_parked_bytes(), 10 * GIB);
        assert_eq!(t.node.own_usage(0, 0), 0);
        // Room again: the restore takes it all back, listed as before.
        other.free(0, 0, free - 5 * GIB);
        assert_eq!(t.node.checkpoint_unpark_memory().unwrap(), 10 * GIB);
        assert_eq!(other.memory_info(0, 0).unwrap().used, 10 * GIB);
        let procs = other.processes(0, None).unwrap();
        assert_eq!(procs.iter().map(|p| p.used_bytes).collect::<Vec<_>>(), [10 * GIB]);
        assert_eq!(t.node.own_parked_bytes(), 0);
    }

    #[test]
    fn a_process_that_never_ran_cuinit_or_is_not_there_is_refused() {
        let t = default_node();
        let other = reopen(&t.state);
        other.alloc(0, 0, 1).unwrap(); // a slot, but no checkpoint thread
        let me = std::process::id();
        assert!(matches!(t.node.checkpoint_state_of(me), Err(SimError::NotSupported(_))));
        assert!(matches!(t.node.checkpoint_request(u32::MAX - 1, CheckpointOp::Unlock), Err(SimError::NotFound(_))));
    }

    #[test]
    fn requests_reach_the_serving_thread_and_replies_their_caller() {
        let t = default_node();
        let target = reopen(&t.state);
        target.checkpoint_serve(4242).unwrap();
        let me = std::process::id();
        assert_eq!(t.node.checkpoint_state_of(me).unwrap(), (ProcessState::Running, 4242));
        std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..2 {
                    let req = loop {
                        if let Some(r) = target.checkpoint_next_request(Duration::from_secs(5)).unwrap() {
                            break r;
                        }
                    };
                    let code = match req.op {
                        CheckpointOp::Lock { timeout_ms } => {
                            target.checkpoint_set_state(ProcessState::Locked).unwrap();
                            timeout_ms
                        }
                        _ => 999,
                    };
                    target.checkpoint_reply(&req, code).unwrap();
                }
            });
            // Two callers at once: each gets its own answer.
            let a = s.spawn(|| t.node.checkpoint_request(me, CheckpointOp::Lock { timeout_ms: 77 }).unwrap());
            let b = reopen(&t.state).checkpoint_request(me, CheckpointOp::Restore).unwrap();
            assert_eq!(a.join().unwrap(), 77);
            assert_eq!(b, 999);
        });
        assert_eq!(t.node.checkpoint_state_of(me).unwrap().0, ProcessState::Locked);
    }

    #[test]
    fn a_caller_learns_that_its_target_died() {
        let t = default_node();
        // The child serves nothing: it announces a checkpoint thread and never answers.
        let (mut c, _out) = child("serve-silently", &t.state);
        let pid = c.id();
        std::thread::scope(|s| {
            let waiting = s.spawn(|| t.node.checkpoint_request(pid, CheckpointOp::Checkpoint));
            // Killed once the request is posted (before, the caller would find no process: a
            // different answer, and a race under load).
            let (slot, _) = t.node.checkpoint_slot(pid).unwrap();
            let posted = std::time::Instant::now();
            while t.node.region.shared().procs[slot].checkpoint.request.load(Acquire) == 0 {
                assert!(posted.elapsed() < std::time::Duration::from_secs(60), "the request was never posted");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            c.kill().unwrap();
            c.wait().unwrap();
            assert!(matches!(waiting.join().unwrap(), Err(SimError::InvalidArgument(_))));
        });
    }
}
