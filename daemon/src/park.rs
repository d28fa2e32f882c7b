//! Parking an allocation's processes through NVIDIA's driver checkpoint API (issue 33): their
//! device memory moved to host memory and back at the same addresses, without stopping them.
//!
//! This module is the mechanism, over a set of process ids: load the API from the driver library
//! (`cuCheckpointProcess*` in `libcuda.so.1`; the simulated node's library exports it too), park
//! them all or none, resume them all or none, and finish or roll back what a killed tesserad left
//! half-done. Never half-parked: a park that fails on one process restores and unlocks every
//! process it touched, so the program runs on; a resume that fails (its memory does not fit)
//! checkpoints again the processes it restored and leaves them parked.
//!
//! The allocation core uses it (`allocator/park.rs`: the node API's Park and Resume, the
//! journal written before each step, admission of a resume, recovery at start).

use std::ffi::{c_int, c_uint, c_void};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `CUresult` values the checkpoint API documents.
const CUDA_SUCCESS: c_uint = 0;
/// A lock's timeout passed before the process's GPU work finished.
pub const CUDA_ERROR_NOT_READY: c_uint = 600;

/// A process's `CUprocessState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    Running,
    Locked,
    Checkpointed,
    Failed,
}

/// Why a park, a resume or a recovery could not be done.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    #[error("cannot load the driver's checkpoint API from {path}: {reason}")]
    Library { path: PathBuf, reason: String },
    #[error("process {pid}: {call} failed: {} ({})", code_name(*code), code_meaning(*code))]
    Driver { pid: u32, call: &'static str, code: c_uint },
}

/// The name of a `CUresult` the checkpoint API answers.
pub fn code_name(code: c_uint) -> String {
    match code {
        1 => "CUDA_ERROR_INVALID_VALUE".into(),
        2 => "CUDA_ERROR_OUT_OF_MEMORY".into(),
        3 => "CUDA_ERROR_NOT_INITIALIZED".into(),
        401 => "CUDA_ERROR_ILLEGAL_STATE".into(),
        600 => "CUDA_ERROR_NOT_READY".into(),
        801 => "CUDA_ERROR_NOT_SUPPORTED".into(),
        other => format!("CUresult {other}"),
    }
}

/// What a code means for whoever asked for the park or resume, and what to do.
fn code_meaning(code: c_uint) -> &'static str {
    match code {
        1 => "no such process: it has exited, or was killed before the driver answered",
        2 => "its memory does not fit on the GPU now; free some and resume again",
        3 => "the process has no CUDA context; only CUDA processes can be parked",
        401 => "the process is not in the state this step needs (parked or running already?)",
        600 => "its GPU work did not finish within the lock timeout; try again when it is idle",
        801 => "it holds memory shared with another process (IPC or peer mappings), which cannot cross a checkpoint",
        _ => "see the driver's documentation of cuCheckpointProcess*",
    }
}

type InitFn = unsafe extern "C" fn(c_uint) -> c_uint;
type LockFn = unsafe extern "C" fn(c_int, *mut LockArgs) -> c_uint;
type StepFn = unsafe extern "C" fn(c_int, *mut c_void) -> c_uint;
type StateFn = unsafe extern "C" fn(c_int, *mut c_uint) -> c_uint;

/// `CUcheckpointLockArgs` (cuda.h 12.8 and later).
#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

/// The driver libraries this process has initialized, kept loaded for the rest of its life.
static INITIALIZED: std::sync::Mutex<Vec<(PathBuf, libloading::Library)>> = std::sync::Mutex::new(Vec::new());

/// Calls `cuInit` once in this process for the library at `path`, and keeps it loaded from then
/// on. NVIDIA documents that a restore needs persistence mode on, or `cuInit` called before: with
/// persistence off, a GPU whose last process was checkpointed is torn down, and the caller's
/// initialized driver is what keeps it up until the resume (also one after a restart of
/// tesserad). Done at the first park or resume, not at start: a node that never parks pays
/// nothing. A failure is logged and the park goes on: with persistence mode on it is not needed.
fn keep_initialized(path: &Path) {
    let mut done = INITIALIZED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if done.iter().any(|(p, _)| p == path) {
        return;
    }
    // SAFETY: as in `Checkpointer::load`, loading the driver library is what every CUDA program does.
    let lib = match unsafe { libloading::Library::new(path) } {
        Ok(lib) => lib,
        Err(e) => return tracing::warn!(path = %path.display(), error = %e, "cannot load the driver to initialize it"),
    };
    // SAFETY: cuInit has this signature in cuda.h.
    match unsafe { lib.get::<InitFn>(b"cuInit") }.map(|f| *f) {
        // SAFETY: cuInit takes flags 0 and may be called by any thread, any number of times.
        Ok(init) => match unsafe { init(0) } {
            CUDA_SUCCESS => tracing::debug!(path = %path.display(), "driver initialized for parks"),
            code => tracing::warn!(
                path = %path.display(),
                error = %code_name(code),
                "cuInit failed: a resume needs persistence mode on (nvidia-smi -pm 1) when tesserad cannot initialize the driver"
            ),
        },
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "the driver has no cuInit"),
    }
    done.push((path.to_path_buf(), lib));
}

/// The driver's checkpoint API, loaded from a driver library.
pub struct Checkpointer {
    lock: LockFn,
    checkpoint: StepFn,
    restore: StepFn,
    unlock: StepFn,
    state: StateFn,
    // Kept loaded as long as the function pointers above are used.
    _lib: libloading::Library,
}

impl Checkpointer {
    /// Loads the API from `path` (`libcuda.so.1` of the driver, or the simulated node's library).
    pub fn load(path: &Path) -> Result<Checkpointer, ParkError> {
        let err = |reason: String| ParkError::Library { path: path.to_path_buf(), reason };
        // SAFETY: loading the driver library runs its initializers, which the driver supports in
        // any process (it is what every CUDA program does first).
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| err(e.to_string()))?;
        fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
            // SAFETY: each caller names T as the symbol's C signature in cuda.h.
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| format!("{name}: {e} (a driver before r570?)"))
        }
        keep_initialized(path);
        Ok(Checkpointer {
            lock: sym(&lib, "cuCheckpointProcessLock").map_err(err)?,
            checkpoint: sym(&lib, "cuCheckpointProcessCheckpoint").map_err(err)?,
            restore: sym(&lib, "cuCheckpointProcessRestore").map_err(err)?,
            unlock: sym(&lib, "cuCheckpointProcessUnlock").map_err(err)?,
            state: sym(&lib, "cuCheckpointProcessGetState").map_err(err)?,
            _lib: lib,
        })
    }

    fn check(pid: u32, call: &'static str, code: c_uint) -> Result<(), ParkError> {
        if code == CUDA_SUCCESS { Ok(()) } else { Err(ParkError::Driver { pid, call, code }) }
    }

    /// Locks `pid`, giving up after `timeout` (`None`: waits as long as its work runs).
    pub fn lock(&self, pid: u32, timeout: Option<Duration>) -> Result<(), ParkError> {
        let ms = timeout.map_or(0, |t| t.as_millis().clamp(1, u128::from(c_uint::MAX)) as c_uint);
        let mut args = LockArgs { timeout_ms: ms, reserved0: 0, reserved1: [0; 7] };
        // SAFETY: the function has this signature (cuda.h); args is a valid, zeroed-reserved struct.
        Self::check(pid, "cuCheckpointProcessLock", unsafe { (self.lock)(pid as c_int, &mut args) })
    }

    fn step(&self, f: StepFn, call: &'static str, pid: u32) -> Result<(), ParkError> {
        // SAFETY: the function has this signature (cuda.h); a null args pointer is documented.
        Self::check(pid, call, unsafe { f(pid as c_int, std::ptr::null_mut()) })
    }

    pub fn checkpoint(&self, pid: u32) -> Result<(), ParkError> {
        self.step(self.checkpoint, "cuCheckpointProcessCheckpoint", pid)
    }

    pub fn restore(&self, pid: u32) -> Result<(), ParkError> {
        self.step(self.restore, "cuCheckpointProcessRestore", pid)
    }

    pub fn unlock(&self, pid: u32) -> Result<(), ParkError> {
        self.step(self.unlock, "cuCheckpointProcessUnlock", pid)
    }

    pub fn state(&self, pid: u32) -> Result<ProcessState, ParkError> {
        let mut s: c_uint = 99;
        // SAFETY: the function has this signature (cuda.h: CUprocessState is a 4-byte enum); s is
        // a valid out-pointer.
        Self::check(pid, "cuCheckpointProcessGetState", unsafe { (self.state)(pid as c_int, &mut s) })?;
        Ok(match s {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            _ => ProcessState::Failed,
        })
    }

    /// Parks every process of `pids`, or none: locks them all (each within `lock_timeout`), then
    /// checkpoints them all. On any failure what was done is undone (restored, unlocked) and the
    /// first error returned: the program runs on. Returns how long it took.
    pub fn park(&self, pids: &[u32], lock_timeout: Option<Duration>) -> Result<Duration, ParkError> {
        let started = Instant::now();
        let mut locked = Vec::new();
        let mut parked = Vec::new();
        let result = (|| {
            for &pid in pids {
                self.lock(pid, lock_timeout)?;
                locked.push(pid);
            }
            for &pid in pids {
                self.checkpoint(pid)?;
                parked.push(pid);
            }
            Ok(())
        })();
        if let Err(e) = result {
            for &pid in &parked {
                let _ = self.restore(pid);
            }
            for &pid in &locked {
                let _ = self.unlock(pid);
            }
            return Err(e);
        }
        Ok(started.elapsed())
    }

    /// Resumes every process of `pids`, or none: restores them all, then unlocks them all. A
    /// restore that fails (its memory does not fit) checkpoints again those already restored, so
    /// the allocation stays parked whole. Returns how long it took.
    pub fn resume(&self, pids: &[u32]) -> Result<Duration, ParkError> {
        let started = Instant::now();
        let mut restored = Vec::new();
        for &pid in pids {
            if let Err(e) = self.restore(pid) {
                for &back in &restored {
                    let _ = self.checkpoint(back);
                }
                return Err(e);
            }
            restored.push(pid);
        }
        for &pid in pids {
            self.unlock(pid)?;
        }
        Ok(started.elapsed())
    }

    /// After a restart: leaves no process of `pids` locked. A park the journal holds as done
    /// (`parked`) keeps its checkpointed processes parked and checkpoints the locked ones (it is
    /// finished); otherwise a park or resume in flight is rolled back to running (restored and
    /// unlocked). Processes gone or without CUDA are skipped. Returns the processes left parked.
    pub fn recover(&self, pids: &[u32], parked: bool) -> Result<Vec<u32>, ParkError> {
        let mut left_parked = Vec::new();
        for &pid in pids {
            let state = match self.state(pid) {
                Ok(s) => s,
                Err(ParkError::Driver { code: 1 | 3, .. }) => continue,
                Err(e) => return Err(e),
            };
            match (state, parked) {
                (ProcessState::Locked, true) => {
                    self.checkpoint(pid)?;
                    left_parked.push(pid);
                }
                (ProcessState::Checkpointed, true) => left_parked.push(pid),
                (ProcessState::Locked, false) => self.unlock(pid)?,
                (ProcessState::Checkpointed, false) => {
                    self.restore(pid)?;
                    self.unlock(pid)?;
                }
                (ProcessState::Running | ProcessState::Failed, _) => {}
            }
        }
        Ok(left_parked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_what_is_wrong_and_what_to_do() {
        let e = ParkError::Driver { pid: 42, call: "cuCheckpointProcessCheckpoint", code: 801 };
        let text = e.to_string();
        assert!(text.contains("process 42") && text.contains("CUDA_ERROR_NOT_SUPPORTED"), "{text}");
        assert!(text.contains("IPC or peer mappings"), "{text}");
        let e = ParkError::Driver { pid: 9, call: "cuCheckpointProcessLock", code: 1 };
        assert!(e.to_string().contains("no such process: it has exited"), "{e}");
        let e = ParkError::Driver { pid: 7, call: "cuCheckpointProcessRestore", code: 2 };
        assert!(e.to_string().contains("does not fit"), "{e}");
        let missing = Checkpointer::load(Path::new("/nonexistent/libcuda.so.1")).err().unwrap();
        assert!(missing.to_string().contains("/nonexistent/libcuda.so.1"), "{missing}");
    }
}
