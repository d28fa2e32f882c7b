//! What the region needs from the OS: the clock, facts about this process, liveness locks.

use std::os::unix::fs::MetadataExt;

/// CLOCK_MONOTONIC in ns: system-wide, so one process's stamp means the same in another (vDSO, no syscall).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid, writable timespec; clock_gettime only writes it.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The inode of the initial PID namespace (`PROC_PID_INIT_INO`, fixed since Linux 3.8).
const INIT_PID_NS_INO: u64 = 0xEFFF_FFFC;

/// What a process slot records about its process.
#[derive(Clone, Copy)]
pub struct ProcInfo {
    pub pid: u32,
    /// The pid in the host's (initial) PID namespace when this process lives there, else 0.
    pub host_pid: u32,
    /// Start time in clock ticks after boot (`/proc/self/stat` field 22): with the pid, names the
    /// process uniquely (pids are reused, start times are not).
    pub start_time: u64,
    pub comm: [u8; 16],
}

impl ProcInfo {
    pub fn current() -> ProcInfo {
        let pid = std::process::id();
        let mut info = ProcInfo { pid, host_pid: 0, start_time: 0, comm: [0; 16] };
        // `NSpid` in /proc/self/status cannot tell: a container mounts its own /proc, whose NSpid
        // starts at the container's namespace. Only the namespace's identity can.
        if std::fs::metadata("/proc/self/ns/pid").is_ok_and(|m| m.ino() == INIT_PID_NS_INO) {
            info.host_pid = pid;
        }
        if let Ok(stat) = std::fs::read("/proc/self/stat") {
            // "pid (comm) state ppid …": comm may hold spaces and parentheses; it ends at the last ')'.
            if let (Some(open), Some(close)) =
                (stat.iter().position(|&b| b == b'('), stat.iter().rposition(|&b| b == b')'))
                && open < close
            {
                let comm = &stat[open + 1..close];
                let n = comm.len().min(15);
                info.comm[..n].copy_from_slice(&comm[..n]);
                // Fields after comm start with field 3 (state); starttime is field 22.
                info.start_time = std::str::from_utf8(&stat[close + 1..])
                    .ok()
                    .and_then(|rest| rest.split_ascii_whitespace().nth(22 - 3))
                    .and_then(|f| f.parse().ok())
                    .unwrap_or(0);
            }
        }
        info
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
