//! SIGKILL to exactly the process that was judged: the pid is pinned with a pidfd, then its start
//! time is checked again, so a pid reused in between is never signalled.

use std::os::fd::{FromRawFd, OwnedFd};

use crate::procfs::ProcFs;

/// Why a kill was not sent.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KillError {
    #[error("the process is gone")]
    Gone,
    #[error("pid {0} is another process now")]
    Reused(u32),
    #[error("{0}")]
    Os(String),
}

/// Sends SIGKILL to `pid` if it is still the process that started at `start`.
pub fn kill(procfs: &ProcFs, pid: u32, start: u64) -> Result<(), KillError> {
    let pid_t = libc::pid_t::try_from(pid).map_err(|_| KillError::Gone)?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid_t, 0) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ESRCH) => Err(KillError::Gone),
            // Kernels before 5.3: the start-time check, then kill(2) (a small window remains).
            Some(libc::ENOSYS) => {
                check(procfs, pid, start)?;
                // SAFETY: kill takes a pid and a signal number.
                os(unsafe { libc::kill(pid_t, libc::SIGKILL) } as libc::c_long)
            }
            _ => Err(KillError::Os(e.to_string())),
        };
    }
    // SAFETY: `fd` is a descriptor pidfd_open just returned; the OwnedFd closes it once.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // The pidfd pins the process: if the start time still matches now, the pidfd is that process.
    check(procfs, pid, start)?;
    use std::os::fd::AsRawFd;
    // SAFETY: a live pidfd, a signal number, no siginfo, no flags.
    os(unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    })
}

fn check(procfs: &ProcFs, pid: u32, start: u64) -> Result<(), KillError> {
    match procfs.start_time(pid) {
        None => Err(KillError::Gone),
        Some(s) if s != start => Err(KillError::Reused(pid)),
        Some(_) => Ok(()),
    }
}

fn os(rc: libc::c_long) -> Result<(), KillError> {
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ESRCH) { Err(KillError::Gone) } else { Err(KillError::Os(e.to_string())) }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    #[test]
    fn kills_the_process_judged_and_never_a_reused_pid() {
        let procfs = ProcFs::default();
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let start = procfs.start_time(child.id()).unwrap();
        assert_eq!(kill(&procfs, child.id(), start + 1), Err(KillError::Reused(child.id())), "another start time");
        assert_eq!(child.try_wait().unwrap(), None, "still running");
        kill(&procfs, child.id(), start).unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert_eq!(kill(&procfs, child.id(), start), Err(KillError::Gone), "reaped");
    }
}
