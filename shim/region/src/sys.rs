//! What the region needs from the OS: the clock, facts about this process, liveness locks.

/// CLOCK_MONOTONIC in ns: system-wide, so one process's stamp means the same in another (vDSO, no syscall).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid, writable timespec; clock_gettime only writes it.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// What a process slot records about its process.
#[derive(Clone, Copy)]
pub struct ProcInfo {
    pub pid: u32,
    /// The pid in the host's PID namespace: 0 here, for the daemon to fill once it has resolved
    /// it (`Region::set_host_pid`). The shim cannot tell cheaply: the namespace's identity is a
    /// `/proc` look-up of tens of µs at every process start, and inside a container it would
    /// only ever say "not the host's".
    pub host_pid: u32,
    /// Start time in clock ticks after boot: 0 here (reading `/proc/self/stat` costs every
    /// process start about 10 µs, and nothing reads it from the slot: the daemon reads a
    /// process's start time from `/proc` where it needs one, as before a kill).
    pub start_time: u64,
    pub comm: [u8; 16],
}

unsafe extern "C" {
    /// The C library's basename of `argv[0]` (glibc and musl), set before any constructor runs.
    static program_invocation_short_name: *const std::ffi::c_char;
}

impl ProcInfo {
    /// This process: its pid (in its own PID namespace) and its name as the kernel's `comm` has
    /// it (the program's file name, at most 15 bytes), taken from the C library's
    /// `program_invocation_short_name` with no system call: `/proc/self/comm` is a `/proc`
    /// look-up, and `PR_GET_NAME` names the calling thread, which need not be the main one.
    pub fn current() -> ProcInfo {
        let mut comm = [0u8; 16];
        // SAFETY: the C library sets this to a NUL-terminated string that lives as long as the
        // process (or leaves it null, checked), and nothing here writes it.
        let name = unsafe { program_invocation_short_name };
        if !name.is_null() {
            // SAFETY: non-null and NUL-terminated, per the above.
            let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes();
            let n = name.len().min(15);
            comm[..n].copy_from_slice(&name[..n]);
        }
        ProcInfo { pid: std::process::id(), host_pid: 0, start_time: 0, comm }
    }
}

/// An open-file-description lock request on one byte.
fn flock(kind: i32, offset: i64) -> libc::flock {
    // SAFETY: flock is plain data; all zeroes is a valid value (l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = offset as libc::off_t;
    fl.l_len = 1;
    fl
}

/// How a non-blocking lock attempt went.
pub enum Lock {
    Taken,
    Busy,
}

/// Takes the OFD write lock on `offset` without waiting.
pub fn ofd_try_lock(fd: i32, offset: i64) -> std::io::Result<Lock> {
    let mut fl = flock(libc::F_WRLCK, offset);
    // SAFETY: fd is an open descriptor and fl a valid flock for the duration of the call.
    if unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &mut fl) } == 0 {
        return Ok(Lock::Taken);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN | libc::EACCES) => Ok(Lock::Busy),
        _ => Err(e),
    }
}

pub fn ofd_unlock(fd: i32, offset: i64) {
    let mut fl = flock(libc::F_UNLCK, offset);
    // SAFETY: as in ofd_try_lock. Unlocking a byte we hold cannot fail short of a bad fd.
    unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &mut fl) };
}

/// Whether another open file description holds a lock on `offset` (ours never conflict, so never
/// show). An error answers "held": reaping a live process would be worse than keeping a dead one.
pub fn ofd_held_by_other(fd: i32, offset: i64) -> bool {
    let mut fl = flock(libc::F_WRLCK, offset);
    // SAFETY: as in ofd_try_lock; F_OFD_GETLK only writes fl.
    let rc = unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut fl) };
    rc != 0 || fl.l_type != libc::F_UNLCK as libc::c_short
}
