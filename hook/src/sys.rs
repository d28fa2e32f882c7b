//! Thin wrappers over the Linux calls the hook needs and std lacks: openat2, the new mount API
//! (open_tree, mount_setattr, move_mount), mknodat, mkdirat, setns, readlinkat.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

pub const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
pub const RESOLVE_IN_ROOT: u64 = 0x10;

const OPEN_TREE_CLONE: libc::c_uint = 1;
const AT_RECURSIVE: libc::c_uint = 0x8000;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x04;
const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
pub const MOUNT_ATTR_RDONLY: u64 = 0x01;
pub const MOUNT_ATTR_NOSUID: u64 = 0x02;
pub const MOUNT_ATTR_NODEV: u64 = 0x04;

#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

pub fn cstr(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn fd_result(rc: libc::c_long) -> io::Result<OwnedFd> {
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as RawFd) })
}

fn unit_result(rc: libc::c_long) -> io::Result<()> {
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// openat2(2). `ENOSYS` where the kernel predates 5.6.
pub fn openat2(dir: BorrowedFd<'_>, path: &CStr, flags: i32, resolve: u64) -> io::Result<OwnedFd> {
    let how = OpenHow { flags: (flags | libc::O_CLOEXEC) as u64, mode: 0, resolve };
    // SAFETY: `path` is NUL-terminated and `how` a valid open_how of the size passed; both outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    fd_result(rc)
}

/// openat(2) with O_CLOEXEC added.
pub fn openat(dir: BorrowedFd<'_>, path: &CStr, flags: i32, mode: libc::mode_t) -> io::Result<OwnedFd> {
    // SAFETY: `path` is NUL-terminated and outlives the call.
    let rc = unsafe { libc::openat(dir.as_raw_fd(), path.as_ptr(), flags | libc::O_CLOEXEC, mode as libc::c_uint) };
    fd_result(rc as libc::c_long)
}

pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable stat buffer for the duration of the call.
    let rc = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
    unit_result(rc as libc::c_long).map(|_| st)
}

pub fn readlinkat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OsString> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: `name` is NUL-terminated; `buf` is writable for `buf.len()` bytes.
    let n = unsafe { libc::readlinkat(dir.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(OsString::from_vec(buf))
}

pub fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated and outlives the call.
    unit_result(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) } as libc::c_long)
}

/// Removes the directory entry `name` in `dir` (a file or a symbolic link itself, never what a
/// link points to).
pub fn unlinkat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated and outlives the call.
    unit_result(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) } as libc::c_long)
}

/// A symbolic link `name` in `dir` holding `target` (never resolved here).
pub fn symlinkat(target: &CStr, dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: both strings are NUL-terminated and outlive the call.
    unit_result(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) } as libc::c_long)
}

pub fn mknodat(dir: BorrowedFd<'_>, name: &CStr, mode: libc::mode_t, dev: libc::dev_t) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated and outlives the call.
    unit_result(unsafe { libc::mknodat(dir.as_raw_fd(), name.as_ptr(), mode, dev) } as libc::c_long)
}

/// A detached copy of the mount tree at `path` (open_tree(OPEN_TREE_CLONE)): a bind mount not yet
/// attached anywhere, made in the caller's mount namespace.
pub fn open_tree_clone(path: &CStr, recursive: bool) -> io::Result<OwnedFd> {
    let flags = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | if recursive { AT_RECURSIVE } else { 0 };
    // SAFETY: `path` is NUL-terminated and outlives the call.
    fd_result(unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) })
}

/// Sets mount attributes (MOUNT_ATTR_*) on a detached tree.
pub fn mount_setattr(tree: BorrowedFd<'_>, set: u64) -> io::Result<()> {
    let attr = MountAttr { attr_set: set, attr_clr: 0, propagation: 0, userns_fd: 0 };
    let empty = c"";
    // SAFETY: `empty` is NUL-terminated; `attr` is a valid mount_attr of the size passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            (libc::AT_EMPTY_PATH as libc::c_uint) | AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    unit_result(rc)
}

/// Attaches a detached tree on the file or directory `target` refers to.
pub fn move_mount(tree: BorrowedFd<'_>, target: BorrowedFd<'_>) -> io::Result<()> {
    let empty = c"";
    // SAFETY: both path arguments are the NUL-terminated empty string; the fds are open.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            target.as_raw_fd(),
            empty.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        )
    };
    unit_result(rc)
}

/// Joins the mount namespace `ns` (an open /proc/<pid>/ns/mnt). The caller must be single-threaded.
pub fn setns_mnt(ns: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: plain syscall on an open fd; no memory is passed.
    unit_result(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) } as libc::c_long)
}

/// Whether the mount `fd` is on is read-only (None: unknown).
pub fn read_only(fd: BorrowedFd<'_>) -> Option<bool> {
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable for the duration of the call; the fd is open.
    let rc = unsafe { libc::fstatvfs(fd.as_raw_fd(), &mut st) };
    (rc == 0).then_some(st.f_flag & libc::ST_RDONLY != 0)
}

/// A small file the kernel makes up as it is read (`/proc/<pid>/cgroup`, `cmdline`), whose size a
/// stat does not give: read into a page-sized buffer, so it takes one read and the one that sees
/// its end (std's reads, sized from a stat of 0, grew from 32 bytes: five reads for a cgroup
/// file, and the stat).
pub fn read_proc(path: &std::path::Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut buf = Vec::with_capacity(4096);
    std::fs::File::open(path)?.read_to_end(&mut buf)?;
    Ok(buf)
}

/// [`read_proc`] as text (invalid UTF-8 is an error, as `read_to_string`'s).
pub fn read_proc_text(path: &std::path::Path) -> io::Result<String> {
    String::from_utf8(read_proc(path)?).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}
