//! The driver's checkpoint API (`cuda.h`, "CUDA Checkpointing"): another process locks a CUDA
//! process, moves its device memory to host memory and back at the same addresses, and unlocks it.
//!
//! As in NVIDIA's driver the target process does the work: `cuInit` starts its checkpoint thread
//! (`cuda-checkpoint`; its id is what `cuCheckpointProcessGetRestoreThreadId` answers), which
//! serves the requests other processes post into its slot of the node's state (model
//! `checkpoint.rs`). While the process is not running, each of its CUDA calls waits at the gate
//! ([`enter`], taken by every export through `run`) on its state word, a process-shared futex.
//!
//! - Lock: new calls wait; the lock waits for the calls in flight and for every stream to drain,
//!   or gives up after `timeoutMs` with `CUDA_ERROR_NOT_READY`, leaving the process running.
//! - Checkpoint: the pages of every device allocation are moved (`mremap`, no copy) to host
//!   memory of the process and the addresses are left mapped without access; VMM memory is copied
//!   out of its memfd and the memfd's pages freed. The model then counts the memory free and the
//!   process unlisted. Memory shared with another process (IPC, shareable VMM handles) cannot
//!   cross a checkpoint: `CUDA_ERROR_NOT_SUPPORTED`, the process stays locked, nothing moved.
//! - Restore: takes the memory back in the model (all or nothing: `CUDA_ERROR_OUT_OF_MEMORY`
//!   when it does not fit, the process stays checkpointed), then the pages, at the same addresses.
//! - Unlock: running again; the waiting calls go on.
//!
//! A state the call does not apply to is `CUDA_ERROR_ILLEGAL_STATE`; a pid that is no process
//! `CUDA_ERROR_INVALID_VALUE` (also one that has exited, a zombie not yet reaped, and one that
//! dies before it answers: killed while a lock waits for its GPU work); a live process that never
//! initialized CUDA `CUDA_ERROR_NOT_INITIALIZED`.
//! The caller needs no `cuInit` of its own (only the node), as a checkpoint tool has no GPU work.
//! The host copy is the target's own memory: a parked process that is killed frees it.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tessera_abi::cuda_exports;
use tessera_sim_model::{CheckpointOp, CheckpointRequest, Node, ProcessState, SimError};

use super::handles;
use super::memory::MemKind;
use super::{CUresult, INVALID_VALUE, R, get, put, run, sys};

use CUresult::*;

// ---- the gate every CUDA call passes -------------------------------------------------------

/// This process's state word, once its checkpoint thread runs.
static GATE: OnceLock<&'static AtomicU32> = OnceLock::new();
/// CUDA calls of this process in flight (outermost calls only).
static IN_FLIGHT: AtomicU64 = AtomicU64::new(0);
/// Set in a child forked after the thread started: the parent's gate is not the child's.
static FORKED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Nesting depth of CUDA calls on this thread (an export calling another passes once).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// A CUDA call in flight; dropped when it returns.
pub(crate) struct Pass(bool);

/// Lets a CUDA call in, waiting while the process is locked or checkpointed.
pub(crate) fn enter() -> Pass {
    let Some(gate) = GATE.get() else { return Pass(false) };
    if FORKED.load(Relaxed) {
        return Pass(false);
    }
    let depth = DEPTH.get();
    if depth > 0 {
        DEPTH.set(depth + 1);
        return Pass(true);
    }
    loop {
        IN_FLIGHT.fetch_add(1, SeqCst);
        if gate.load(SeqCst) == ProcessState::Running as u32 {
            DEPTH.set(1);
            return Pass(true);
        }
        IN_FLIGHT.fetch_sub(1, SeqCst);
        if let Ok(node) = crate::process::node() {
            node.checkpoint_wait_running();
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        if self.0 {
            let depth = DEPTH.get() - 1;
            DEPTH.set(depth);
            if depth == 0 {
                IN_FLIGHT.fetch_sub(1, SeqCst);
            }
        }
    }
}

extern "C" fn forked_child() {
    FORKED.store(true, Relaxed);
}

// ---- the checkpoint thread -----------------------------------------------------------------

/// Starts this process's checkpoint thread (once; from `cuInit`) and returns when it serves.
pub(crate) fn start(node: &'static Node) -> R {
    static STARTED: Mutex<bool> = Mutex::new(false);
    let mut started = STARTED.lock().unwrap_or_else(|e| e.into_inner());
    if *started {
        return Ok(());
    }
    let gate = node.checkpoint_gate().map_err(|e| super::errors::sim(&e, super::errors::During::Work))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("cuda-checkpoint".into())
        .spawn(move || {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() } as u32;
            let _ = tx.send(node.checkpoint_serve(tid));
            serve(node);
        })
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    rx.recv().map_err(|_| CUDA_ERROR_UNKNOWN)?.map_err(|e| super::errors::sim(&e, super::errors::During::Work))?;
    let _ = GATE.set(gate);
    // SAFETY: registering a fork handler with a plain extern "C" fn is always sound.
    unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    *started = true;
    Ok(())
}

fn serve(node: &'static Node) {
    loop {
        let req = match node.checkpoint_next_request(Duration::from_secs(60)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(_) => return,
        };
        let code = crate::ffi::guard(CUDA_ERROR_UNKNOWN, || perform(node, &req));
        let _ = node.checkpoint_reply(&req, code as u32);
    }
}

fn state(node: &Node) -> ProcessState {
    node.checkpoint_gate().map(|g| ProcessState::from_raw(g.load(Acquire))).unwrap_or(ProcessState::Failed)
}

fn perform(node: &'static Node, req: &CheckpointRequest) -> CUresult {
    let want = |s: ProcessState| if state(node) == s { Ok(()) } else { Err(CUDA_ERROR_ILLEGAL_STATE) };
    let r = match req.op {
        CheckpointOp::Lock { timeout_ms } => want(ProcessState::Running).and_then(|()| lock(node, timeout_ms)),
        CheckpointOp::Checkpoint => want(ProcessState::Locked).and_then(|()| checkpoint(node)),
        CheckpointOp::Restore => want(ProcessState::Checkpointed).and_then(|()| restore(node)),
        CheckpointOp::Unlock => want(ProcessState::Locked).and_then(|()| set(node, ProcessState::Running)),
    };
    r.err().unwrap_or(CUDA_SUCCESS)
}

fn set(node: &Node, s: ProcessState) -> R {
    node.checkpoint_set_state(s).map_err(|_| CUDA_ERROR_UNKNOWN)
}

/// Locks: no new call starts; waits for the calls in flight and for every stream to drain.
fn lock(node: &'static Node, timeout_ms: u32) -> R {
    let deadline = (timeout_ms > 0).then(|| Instant::now() + Duration::from_millis(u64::from(timeout_ms)));
    let left = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
    let timed_out = || deadline.is_some_and(|d| Instant::now() >= d);
    set(node, ProcessState::Locked)?;
    // Pairs with the SeqCst increment and load in `enter`: either a call sees the lock, or the
    // lock sees the call in flight.
    std::sync::atomic::fence(SeqCst);
    let give_up = || {
        let _ = set(node, ProcessState::Running);
        Err(CUDA_ERROR_NOT_READY)
    };
    while IN_FLIGHT.load(SeqCst) > 0 {
        if timed_out() {
            return give_up();
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    for sid in all_streams() {
        let Ok(tail) = node.stream_tail(sid) else { continue };
        // Other errors (a stream gone, a GPU lost) leave nothing to wait for on that stream.
        if let Err(SimError::Timeout) = node.stream_wait(sid, tail, left()) {
            return give_up();
        }
    }
    Ok(())
}

/// Every stream of every context of this process.
fn all_streams() -> Vec<tessera_sim_model::StreamId> {
    let reg = handles::read();
    let mut out: Vec<_> = reg.ctxs.values().flat_map(|c| c.default_streams()).collect();
    out.extend(reg.streams.values().map(|s| s.sid));
    out
}

/// Device memory moved out while checkpointed.
enum Moved {
    /// Pages of an anonymous mapping, moved to `host`; `base` left mapped without access.
    Pages { base: u64, len: usize, host: u64 },
    /// A VMM allocation's memfd contents, copied out; its pages freed.
    Memfd { fd: c_int, len: usize, host: u64 },
}

static MOVED: Mutex<Vec<Moved>> = Mutex::new(Vec::new());

fn moved() -> std::sync::MutexGuard<'static, Vec<Moved>> {
    MOVED.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh anonymous mapping of `len` bytes (pages committed only when written).
fn host_area(len: usize) -> R<u64> {
    super::memory::map_anon(len as u64, false).ok_or(CUDA_ERROR_OUT_OF_MEMORY)
}

/// Moves the pages of `[base, base + len)` to a new host area; `base` stays mapped, empty and
/// without access, so nothing else can take the addresses.
fn move_out(base: u64, len: usize) -> R<Moved> {
    let host = host_area(len)?;
    let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP;
    // SAFETY: (base, len) is a private anonymous mapping of ours that no call touches while the
    // process is locked; host is our fresh mapping of the same length, which this replaces.
    let p = unsafe { libc::mremap(base as *mut c_void, len, len, flags, host as *mut c_void) };
    if p as u64 != host {
        super::memory::unmap(host, len);
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: (base, len) is still our mapping (DONTUNMAP left it, empty).
    unsafe { libc::mprotect(base as *mut c_void, len, libc::PROT_NONE) };
    Ok(Moved::Pages { base, len, host })
}

/// Copies a VMM allocation's memfd out to a host area and frees the memfd's pages.
fn copy_out(fd: c_int, len: usize) -> R<Moved> {
    let host = host_area(len)?;
    let mut off = 0usize;
    while off < len {
        // Only the written parts: holes read as zero on both sides.
        // SAFETY: lseek on our own descriptor.
        let data = unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            break;
        }
        // SAFETY: as above.
        let hole = (unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) }).max(data) as usize;
        let (start, end) = (data as usize, hole.min(len));
        if start >= end {
            break;
        }
        // SAFETY: host holds len bytes and [start, end) is within it; fd is our memfd.
        let n = unsafe { libc::pread(fd, (host as usize + start) as *mut c_void, end - start, start as libc::off_t) };
        if n != (end - start) as isize {
            super::memory::unmap(host, len);
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        off = end;
    }
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate on our own memfd; it frees pages, the size stays.
    unsafe { libc::fallocate(fd, mode, 0, len as libc::off_t) };
    Ok(Moved::Memfd { fd, len, host })
}

/// Puts moved memory back where it was.
fn move_in(m: &Moved) {
    match *m {
        Moved::Pages { base, len, host } => {
            let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
            // SAFETY: host is the mapping move_out made; base is our access-less placeholder of the
            // same length, which this replaces in one step (the pages return with read-write access).
            unsafe { libc::mremap(host as *mut c_void, len, len, flags, base as *mut c_void) };
        }
        Moved::Memfd { fd, len, host } => {
            // SAFETY: host holds len bytes we copied out; fd is the allocation's memfd of len bytes.
            unsafe { libc::pwrite(fd, host as *const c_void, len, 0) };
            super::memory::unmap(host, len);
        }
    }
}

fn checkpoint(node: &Node) -> R {
    let reg = handles::write();
    let shared = reg.mem.values().any(|a| a.kind == MemKind::Imported)
        || super::ipc::any_exported()
        || reg.phys.values().any(|p| p.shareable());
    if shared {
        super::trace::line(format_args!("checkpoint refused: memory shared with another process (IPC or VMM handles)"));
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let mut out = moved();
    let mut result = Ok(());
    for a in reg.mem.values().filter(|a| a.on_device() && a.map_len > 0) {
        match move_out(a.base, a.map_len) {
            Ok(m) => out.push(m),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if result.is_ok() {
        for p in reg.phys.values() {
            match copy_out(p.memfd(), p.size as usize) {
                Ok(m) => out.push(m),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
    }
    if result.is_ok() {
        result = node.checkpoint_park_memory().map(|_| ()).map_err(|_| CUDA_ERROR_UNKNOWN);
    }
    if let Err(e) = result {
        // Never half-checkpointed: what moved goes back, and the process stays locked.
        for m in out.drain(..) {
            move_in(&m);
        }
        return Err(e);
    }
    set(node, ProcessState::Checkpointed)
}

fn restore(node: &Node) -> R {
    node.checkpoint_unpark_memory().map_err(|e| super::errors::sim(&e, super::errors::During::Work))?;
    for m in moved().drain(..) {
        move_in(&m);
    }
    set(node, ProcessState::Locked)
}

// ---- the exports (called by another process on a target pid) --------------------------------

/// The node, for a caller that need not have run `cuInit`.
fn caller_node() -> R<&'static Node> {
    crate::process::node().map_err(|_| CUDA_ERROR_NOT_INITIALIZED)
}

/// A model refusal about the target `pid` as the driver reports it.
fn target_error(pid: u32, e: &SimError) -> CUresult {
    match e {
        // It died before it answered.
        SimError::InvalidArgument(_) => INVALID_VALUE,
        // No process of that id uses the node: no process at all (or one that has exited, a
        // zombie until its parent reaps it), or a live one without CUDA.
        SimError::NotFound(_) if !is_live_process(pid) => INVALID_VALUE,
        SimError::NotFound(_) | SimError::NotSupported(_) => CUDA_ERROR_NOT_INITIALIZED,
        _ => CUDA_ERROR_UNKNOWN,
    }
}

/// Whether `pid` (as the caller sees it) is a process that has not exited: `/proc/PID/stat`
/// exists and its state is neither zombie (`Z`) nor dead (`X`).
fn is_live_process(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // "PID (COMM) S ...": COMM may hold spaces and parentheses; the state follows the last ')'.
    let state = stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next());
    !matches!(state, Some("Z" | "X" | "x") | None)
}

fn target_pid(pid: c_int) -> R<u32> {
    u32::try_from(pid).ok().filter(|&p| p > 0).ok_or(INVALID_VALUE)
}

/// Reads an optional argument struct whose fields must all be zero (`reserved`).
///
/// # Safety
/// `args` must be null or valid for a read of `T`.
unsafe fn zeroed_args<T: Copy>(args: *const T) -> R {
    if args.is_null() {
        return Ok(());
    }
    // SAFETY: as this function's contract (alignment checked by `get`).
    let v = unsafe { get(args) }?;
    // SAFETY: T is a plain C struct of integers; viewing its bytes is sound.
    let bytes = unsafe { std::slice::from_raw_parts((&v as *const T).cast::<u8>(), std::mem::size_of::<T>()) };
    if bytes.iter().all(|&b| b == 0) { Ok(()) } else { Err(INVALID_VALUE) }
}

fn request(pid: c_int, op: CheckpointOp) -> R {
    let pid = target_pid(pid)?;
    let node = caller_node()?;
    match node.checkpoint_request(pid, op) {
        Ok(0) => Ok(()),
        Ok(code) => Err(code_of(code)),
        Err(e) => Err(target_error(pid, &e)),
    }
}

/// A `CUresult` the target answered, as the enum (an unknown value is `CUDA_ERROR_UNKNOWN`).
fn code_of(code: u32) -> CUresult {
    [
        CUDA_ERROR_INVALID_VALUE,
        CUDA_ERROR_OUT_OF_MEMORY,
        CUDA_ERROR_NOT_INITIALIZED,
        CUDA_ERROR_NOT_READY,
        CUDA_ERROR_ILLEGAL_STATE,
        CUDA_ERROR_NOT_SUPPORTED,
        CUDA_ERROR_DEVICE_UNAVAILABLE,
        CUDA_ERROR_TIMEOUT,
    ]
    .into_iter()
    .find(|c| *c as u32 == code)
    .unwrap_or(CUDA_ERROR_UNKNOWN)
}

cuda_exports! {
    fn cuCheckpointProcessGetRestoreThreadId(pid, tid) {
        run(|| {
            super::need(tid)?;
            let p = target_pid(pid)?;
            let (_, t) = caller_node()?.checkpoint_state_of(p).map_err(|e| target_error(p, &e))?;
            // SAFETY: tid is the caller's out-pointer (checked above).
            unsafe { put(tid, t as c_int) }
        })
    }

    fn cuCheckpointProcessGetState(pid, state) {
        run(|| {
            super::need(state)?;
            let p = target_pid(pid)?;
            let (s, _) = caller_node()?.checkpoint_state_of(p).map_err(|e| target_error(p, &e))?;
            let s = match s {
                ProcessState::Running => sys::CUprocessState::CU_PROCESS_STATE_RUNNING,
                ProcessState::Locked => sys::CUprocessState::CU_PROCESS_STATE_LOCKED,
                ProcessState::Checkpointed => sys::CUprocessState::CU_PROCESS_STATE_CHECKPOINTED,
                ProcessState::Failed => sys::CUprocessState::CU_PROCESS_STATE_FAILED,
            };
            // SAFETY: state is the caller's out-pointer (checked above).
            unsafe { put(state, s) }
        })
    }

    fn cuCheckpointProcessLock(pid, args) {
        run(|| {
            let timeout_ms = if args.is_null() {
                0
            } else {
                // SAFETY: args is the caller's struct (null checked above; alignment by `get`).
                let a = unsafe { get(args.cast_const()) }?;
                if a.reserved0 != 0 || a.reserved1.iter().any(|&r| r != 0) {
                    return Err(INVALID_VALUE);
                }
                a.timeoutMs
            };
            request(pid, CheckpointOp::Lock { timeout_ms })
        })
    }

    fn cuCheckpointProcessCheckpoint(pid, args) {
        run(|| {
            // SAFETY: args is null or the caller's struct.
            unsafe { zeroed_args(args.cast_const()) }?;
            request(pid, CheckpointOp::Checkpoint)
        })
    }

    fn cuCheckpointProcessRestore(pid, args) {
        run(|| {
            // SAFETY: args is null or the caller's struct.
            unsafe { zeroed_args(args.cast_const()) }?;
            request(pid, CheckpointOp::Restore)
        })
    }

    fn cuCheckpointProcessUnlock(pid, args) {
        run(|| {
            // SAFETY: args is null or the caller's struct.
            unsafe { zeroed_args(args.cast_const()) }?;
            request(pid, CheckpointOp::Unlock)
        })
    }
}
