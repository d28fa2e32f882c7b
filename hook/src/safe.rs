//! Paths inside a container's root file system, resolved the way the kernel does with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`: `..` stops at the root, an absolute symlink
//! starts again from the root, magic links (`/proc/self/root`) are refused. Where openat2 is
//! missing (ENOSYS) the same rules are applied one component at a time with `O_NOFOLLOW` opens and
//! `readlinkat`, so no symlink is ever followed by the kernel.
//!
//! Everything returned is an `O_PATH` descriptor; callers act on descriptors (`*at` calls,
//! `move_mount` onto the fd), never on a path string again, so nothing can be swapped in between
//! (the lesson of CVE-2024-0132).

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use crate::sys;

const MAX_LINKS: u32 = 40;

/// A container root file system, held open.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
    /// Always walk component by component (tests; kernels without openat2).
    walk_only: bool,
}

/// Directories already resolved inside a root, by their path in it.
#[derive(Debug, Default)]
pub struct DirCache(Vec<(std::path::PathBuf, OwnedFd)>);

/// What [`Root::mknod`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeOutcome {
    Created,
    /// The same device node was already there.
    Existing,
}

/// What [`Root::link_cached`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkOutcome {
    Created,
    /// The same link was already there.
    Existing,
    /// The image has a regular file there: left alone (the caller mounts over it instead).
    Occupied,
}

fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

impl Root {
    /// Opens the root directory (a host path the runtime gave us).
    pub fn open(path: &Path) -> io::Result<Root> {
        let c = sys::cstr(path.as_os_str())?;
        let fd = sys::openat(
            // SAFETY: AT_FDCWD is a valid "directory fd" for *at calls; it is never closed.
            unsafe { BorrowedFd::borrow_raw(libc::AT_FDCWD) },
            &c,
            libc::O_PATH | libc::O_DIRECTORY,
            0,
        )?;
        Ok(Root { fd, walk_only: false })
    }

    /// The same root, resolved only by the component walk (the ENOSYS fallback), for tests.
    pub fn walk_only(mut self) -> Root {
        self.walk_only = true;
        self
    }

    /// An `O_PATH` descriptor of `path` inside the root, every symlink resolved inside the root.
    pub fn resolve(&self, path: &Path) -> io::Result<OwnedFd> {
        if !self.walk_only {
            let rel = relative(path);
            let c = sys::cstr(rel.as_os_str())?;
            match sys::openat2(self.fd.as_fd(), &c, libc::O_PATH, sys::RESOLVE_IN_ROOT | sys::RESOLVE_NO_MAGICLINKS) {
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {}
                r => return r,
            }
        }
        self.walk(path, false).map(|(fd, _)| fd)
    }

    /// The component walk; with `create`, a missing name is made as a directory (mode 0755) and
    /// the walk goes on into it, so that links are followed inside the root as they would be.
    /// Returns what it found with its `fstat` (each component is looked at once: the callers
    /// need its type, and whether a mount is already there, from the same answer).
    fn walk(&self, path: &Path, create: bool) -> io::Result<(OwnedFd, libc::stat)> {
        // The directories entered below the root (the root itself is borrowed, not duplicated).
        let mut stack: Vec<OwnedFd> = Vec::new();
        let mut todo: VecDeque<OsString> = components(path).into();
        let mut links = 0;
        while let Some(name) = todo.pop_front() {
            if name == ".." {
                stack.pop();
                continue;
            }
            let cur = stack.last().map_or(self.fd.as_fd(), |d| d.as_fd());
            let c = sys::cstr(&name)?;
            let fd = match sys::openat(cur, &c, libc::O_PATH | libc::O_NOFOLLOW, 0) {
                Err(e) if create && e.raw_os_error() == Some(libc::ENOENT) => {
                    match sys::mkdirat(cur, &c, 0o755) {
                        Ok(()) => {}
                        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                        Err(e) => return Err(e),
                    }
                    sys::openat(cur, &c, libc::O_PATH | libc::O_NOFOLLOW, 0)?
                }
                r => r?,
            };
            let st = sys::fstat(fd.as_fd())?;
            let mode = st.st_mode & libc::S_IFMT;
            if mode == libc::S_IFLNK {
                links += 1;
                if links > MAX_LINKS {
                    return Err(errno(libc::ELOOP));
                }
                let target = sys::readlinkat(cur, &c)?;
                let target = Path::new(&target);
                if target.is_absolute() {
                    stack.clear();
                }
                for (i, comp) in components(target).into_iter().enumerate() {
                    todo.insert(i, comp);
                }
            } else if todo.is_empty() {
                return Ok((fd, st));
            } else if mode == libc::S_IFDIR {
                stack.push(fd);
            } else {
                return Err(errno(libc::ENOTDIR));
            }
        }
        // The path ended on a directory already entered (`..`, a link to one) or the root.
        let fd = match stack.pop() {
            Some(fd) => fd,
            None => self.fd.try_clone()?,
        };
        let st = sys::fstat(fd.as_fd())?;
        Ok((fd, st))
    }

    /// The first existing component of `path` (lexically, from the root) that is a symbolic link,
    /// if any; the walk stops at the first missing component. Never follows anything.
    pub fn first_symlink(&self, path: &Path) -> io::Result<Option<std::path::PathBuf>> {
        self.first_symlink_cached(path, &mut DirCache::default())
    }

    /// [`Root::first_symlink`], reusing the directories earlier walks found to be real
    /// directories (`cache`: one per check; three dozen targets share a few parents, and each
    /// component walked costs an `openat` and an `fstat`).
    pub fn first_symlink_cached(&self, path: &Path, cache: &mut DirCache) -> io::Result<Option<std::path::PathBuf>> {
        let mut seen = std::path::PathBuf::from("/");
        // The directory the walk is in: an index into the cache (None: the root).
        let mut cur: Option<usize> = None;
        for name in components(path) {
            if name == ".." {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, "path has \"..\""));
            }
            seen.push(&name);
            if let Some(i) = cache.0.iter().position(|(p, _)| *p == seen) {
                cur = Some(i);
                continue;
            }
            let dir = cur.map_or(self.fd.as_fd(), |i| cache.0[i].1.as_fd());
            let fd = match sys::openat(dir, &sys::cstr(&name)?, libc::O_PATH | libc::O_NOFOLLOW, 0) {
                Ok(fd) => fd,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
                Err(e) => return Err(e),
            };
            let mode = sys::fstat(fd.as_fd())?.st_mode & libc::S_IFMT;
            if mode == libc::S_IFLNK {
                return Ok(Some(seen));
            }
            if mode != libc::S_IFDIR {
                return Ok(None);
            }
            cache.0.push((seen.clone(), fd));
            cur = Some(cache.0.len() - 1);
        }
        Ok(None)
    }

    /// Makes every missing directory of `path` (mode 0755) inside the root; returns the last one,
    /// with its `fstat`.
    pub fn mkdir_all(&self, path: &Path) -> io::Result<(OwnedFd, libc::stat)> {
        let (dir, st) = self.walk(path, true)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(errno(libc::ENOTDIR));
        }
        Ok((dir, st))
    }

    /// A regular file at `path` (created empty, mode 0644, when missing), for a file bind mount.
    /// A symbolic link there (an image's `libcuda.so.1 -> libcuda.so.535.104.05`, dangling or
    /// not, or one aimed at `/etc/passwd`) is replaced by the file, never followed: what is
    /// mounted there is the injected file, and nothing is written through the link.
    pub fn file(&self, path: &Path) -> io::Result<(OwnedFd, libc::stat)> {
        self.file_cached(path, &mut DirCache::default())
    }

    /// [`Root::file`], reusing the parent directories already resolved for earlier files (two
    /// dozen libraries share one directory). With the file's `fstat`.
    pub fn file_cached(&self, path: &Path, cache: &mut DirCache) -> io::Result<(OwnedFd, libc::stat)> {
        let (parent, name) = split(path)?;
        let dir = self.parent_cached(parent, cache)?;
        let c = sys::cstr(name)?;
        let create = || -> io::Result<()> {
            match sys::openat(dir.as_fd(), &c, libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_WRONLY, 0o644)
            {
                Ok(_) => Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
                Err(e) => Err(e),
            }
        };
        create()?;
        let mut fd = sys::openat(dir.as_fd(), &c, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        let mut st = sys::fstat(fd.as_fd())?;
        if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            // The link itself goes (unlinkat acts on the entry in this directory, inside the
            // root), and the file takes its place.
            sys::unlinkat(dir.as_fd(), &c)?;
            create()?;
            fd = sys::openat(dir.as_fd(), &c, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
            st = sys::fstat(fd.as_fd())?;
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "exists and is not a regular file"));
        }
        Ok((fd, st))
    }

    /// A symbolic link at `path` holding `target`, parent directories made inside the root as
    /// for [`Root::file_cached`]. A link already there with another target (an image's stale
    /// `libcuda.so.1`) is replaced, the link itself and never what it points to; a regular file
    /// is left alone ([`LinkOutcome::Occupied`]); anything else there is an error.
    pub fn link_cached(&self, path: &Path, target: &Path, cache: &mut DirCache) -> io::Result<LinkOutcome> {
        let (parent, name) = split(path)?;
        let dir = self.parent_cached(parent, cache)?;
        let (c, t) = (sys::cstr(name)?, sys::cstr(target.as_os_str())?);
        match sys::symlinkat(&t, dir.as_fd(), &c) {
            Ok(()) => return Ok(LinkOutcome::Created),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
        let fd = sys::openat(dir.as_fd(), &c, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        match sys::fstat(fd.as_fd())?.st_mode & libc::S_IFMT {
            libc::S_IFREG => Ok(LinkOutcome::Occupied),
            libc::S_IFLNK if sys::readlinkat(dir.as_fd(), &c)? == target.as_os_str() => Ok(LinkOutcome::Existing),
            libc::S_IFLNK => {
                sys::unlinkat(dir.as_fd(), &c)?;
                sys::symlinkat(&t, dir.as_fd(), &c)?;
                Ok(LinkOutcome::Created)
            }
            _ => Err(io::Error::new(io::ErrorKind::AlreadyExists, "exists and is not a file or a link")),
        }
    }

    /// The directory `parent` inside the root (made when missing), from `cache` when an earlier
    /// call resolved it.
    fn parent_cached<'c>(&self, parent: &Path, cache: &'c mut DirCache) -> io::Result<&'c OwnedFd> {
        Ok(match cache.0.iter().position(|(p, _)| p == parent) {
            Some(i) => &cache.0[i].1,
            None => {
                let (fd, _) = self.mkdir_all(parent)?;
                cache.0.push((parent.to_path_buf(), fd));
                &cache.0.last().expect("just pushed").1
            }
        })
    }

    /// A directory at `path`, made when missing, for a directory bind mount; with its `fstat`.
    pub fn dir(&self, path: &Path) -> io::Result<(OwnedFd, libc::stat)> {
        self.mkdir_all(path)
    }

    /// A character device node at `path` (mode 0666). An existing node with the same numbers is
    /// kept; anything else there is an error. `EPERM` (a user namespace) is returned as is.
    pub fn mknod(&self, path: &Path, major: u32, minor: u32) -> io::Result<NodeOutcome> {
        self.mknod_cached(path, major, minor, &mut DirCache::default())
    }

    /// [`Root::mknod`], reusing the parent directories already resolved (the nodes share `/dev`).
    pub fn mknod_cached(&self, path: &Path, major: u32, minor: u32, cache: &mut DirCache) -> io::Result<NodeOutcome> {
        let (parent, name) = split(path)?;
        let dir = self.parent_cached(parent, cache)?;
        let dev = libc::makedev(major, minor);
        match sys::mknodat(dir.as_fd(), &sys::cstr(name)?, libc::S_IFCHR | 0o666, dev) {
            Ok(()) => Ok(NodeOutcome::Created),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let fd = sys::openat(dir.as_fd(), &sys::cstr(name)?, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
                let st = sys::fstat(fd.as_fd())?;
                if st.st_mode & libc::S_IFMT == libc::S_IFCHR && st.st_rdev == dev {
                    Ok(NodeOutcome::Existing)
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("exists and is not device {major}:{minor}"),
                    ))
                }
            }
            Err(e) => Err(e),
        }
    }
}

/// `path` as [`Root::first_symlink`] names it: from `/`, `.` and empty components dropped.
pub fn absolute(path: &Path) -> std::path::PathBuf {
    let mut p = std::path::PathBuf::from("/");
    p.extend(components(path));
    p
}

/// Whether the file `a` was found to be (its `fstat`) is the one descriptor `b` names (a bind
/// mount of one onto the other already done).
pub fn same_file(a: &libc::stat, b: BorrowedFd<'_>) -> bool {
    sys::fstat(b).is_ok_and(|y| a.st_dev == y.st_dev && a.st_ino == y.st_ino)
}

fn relative(path: &Path) -> std::path::PathBuf {
    let rel: std::path::PathBuf = components(path).iter().collect();
    if rel.as_os_str().is_empty() { ".".into() } else { rel }
}

/// The names of a path, `.` dropped, `..` kept (resolution handles it), root ignored.
fn components(path: &Path) -> Vec<OsString> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some(OsString::from("..")),
            _ => None,
        })
        .collect()
}

fn split(path: &Path) -> io::Result<(&Path, &OsStr)> {
    match (path.parent(), path.file_name()) {
        (Some(p), Some(n)) if n.as_bytes() != b".." => Ok((p, n)),
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} has no file name", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn fd_path(fd: &OwnedFd) -> std::path::PathBuf {
        std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(fd))).unwrap()
    }

    /// A root full of traps pointing at a victim directory outside it.
    fn hostile() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        let victim = dir.path().join("victim");
        std::fs::create_dir_all(root.join("real")).unwrap();
        std::fs::create_dir_all(&victim).unwrap();
        std::fs::write(victim.join("keep"), b"host").unwrap();
        symlink(&victim, root.join("etc")).unwrap(); // absolute, to a host path
        symlink("../../../../../../victim", root.join("up")).unwrap();
        symlink("/proc/self/root", root.join("magic")).unwrap();
        symlink("loop2", root.join("loop1")).unwrap();
        symlink("loop1", root.join("loop2")).unwrap();
        symlink("/real", root.join("abs")).unwrap();
        (dir, root, victim)
    }

    fn check_stays_inside(r: Root, root: &Path, victim: &Path) {
        // The absolute link is followed inside the root: <root>/<victim path> does not exist.
        let e = r.resolve(Path::new("/etc/keep")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        // Making files through it makes them inside the root.
        let (fd, _) = r.file(Path::new("/etc/ld.so.preload")).unwrap();
        let made = fd_path(&fd);
        assert!(made.starts_with(root), "{}", made.display());
        assert!(root.join(victim.strip_prefix("/").unwrap()).join("ld.so.preload").is_file());
        // `..` stops at the root.
        let fd = r.resolve(Path::new("/up")).unwrap_err();
        assert_eq!(fd.raw_os_error(), Some(libc::ENOENT));
        let fd = r.resolve(Path::new("/../../real")).unwrap();
        assert_eq!(fd_path(&fd), root.join("real"));
        assert_eq!(fd_path(&r.resolve(Path::new("abs")).unwrap()), root.join("real"));
        assert_eq!(r.resolve(Path::new("/loop1")).unwrap_err().raw_os_error(), Some(libc::ELOOP));
        assert_eq!(r.mknod(Path::new("/dev/nvidia0"), 1, 3).unwrap(), NodeOutcome::Created);
        assert_eq!(r.mknod(Path::new("/dev/nvidia0"), 1, 3).unwrap(), NodeOutcome::Existing);
        assert!(r.mknod(Path::new("/dev/nvidia0"), 1, 5).is_err());
        assert_eq!(r.first_symlink(Path::new("/etc/ld.so.preload")).unwrap(), Some("/etc".into()));
        assert_eq!(r.first_symlink(Path::new("/real/x/y")).unwrap(), None);
        assert_eq!(r.first_symlink(Path::new("/abs")).unwrap(), Some("/abs".into()));
        // One cache across walks (as the wrapper checks its targets) answers the same, in any
        // order: a cached directory never hides a link below or beside it.
        let paths = ["/real/x/y", "/etc/ld.so.preload", "/real/x", "/abs/x", "/real", "/etc", "/loop1/z", "/up"];
        let mut cache = DirCache::default();
        for _ in 0..2 {
            for p in paths {
                let p = Path::new(p);
                assert_eq!(r.first_symlink_cached(p, &mut cache).unwrap(), r.first_symlink(p).unwrap(), "{p:?}");
            }
        }
        // The victim is untouched.
        let names: Vec<_> = std::fs::read_dir(victim).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["keep"]);
    }

    #[test]
    fn a_link_where_a_file_goes_is_replaced_never_followed() {
        for walk_only in [false, true] {
            let (_d, root, victim) = hostile();
            let lib = root.join("usr/lib/x86_64-linux-gnu");
            std::fs::create_dir_all(&lib).unwrap();
            std::fs::write(lib.join("libcuda.so.550.54"), b"the image's stub").unwrap();
            symlink("libcuda.so.535.104.05", lib.join("libcuda.so.1")).unwrap(); // dangling
            symlink("libcuda.so.550.54", lib.join("libcuda.so")).unwrap(); // stale but there
            symlink(victim.join("keep"), lib.join("libnvidia-ml.so.1")).unwrap(); // out of the root
            symlink("/etc/passwd", lib.join("libnvidia-ptxjitcompiler.so.1")).unwrap();
            let r = Root::open(&root).unwrap();
            let r = if walk_only { r.walk_only() } else { r };
            for name in ["libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1"] {
                let path = Path::new("/usr/lib/x86_64-linux-gnu").join(name);
                let (fd, _) = r.file(&path).unwrap();
                assert_eq!(fd_path(&fd), lib.join(name), "the file is where the link was");
                let meta = std::fs::symlink_metadata(lib.join(name)).unwrap();
                assert!(meta.file_type().is_file() && meta.len() == 0, "{name}: {meta:?}");
            }
            assert_eq!(std::fs::read(lib.join("libcuda.so.550.54")).unwrap(), b"the image's stub");
            assert_eq!(std::fs::read(victim.join("keep")).unwrap(), b"host", "nothing written through");
            assert!(!root.join("etc/passwd").exists());
        }
    }

    #[test]
    fn openat2_keeps_inside_the_root() {
        let (_d, root, victim) = hostile();
        let r = Root::open(&root).unwrap();
        // No procfs in this root: the link leads nowhere inside it.
        assert_eq!(r.resolve(Path::new("/magic/tmp")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
        // A magic link (procfs' `root`) is refused outright.
        let proc = Root::open(Path::new("/proc/self")).unwrap();
        assert_eq!(proc.resolve(Path::new("root/tmp")).unwrap_err().raw_os_error(), Some(libc::ELOOP));
        check_stays_inside(r, &root, &victim);
    }

    #[test]
    fn component_walk_keeps_inside_the_root() {
        let (_d, root, victim) = hostile();
        let r = Root::open(&root).unwrap().walk_only();
        // The walk reads /proc/self/root as the string "/": it stays inside the root.
        let e = r.resolve(Path::new("/magic/victim")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        check_stays_inside(r, &root, &victim);
    }

    /// A link made, kept, or replaced (never followed); an image's regular file left alone; a
    /// directory refused; a parent reached through the image's links resolved inside the root.
    #[test]
    fn links_are_made_inside_the_root_and_never_through_a_link() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path();
        let rootp = base.join("root");
        let victim = base.join("victim");
        std::fs::create_dir_all(rootp.join("usr/lib")).unwrap();
        std::fs::create_dir_all(&victim).unwrap();
        std::fs::write(victim.join("passwd"), "host").unwrap();
        for walk in [false, true] {
            let _ = std::fs::remove_dir_all(rootp.join("usr/lib"));
            std::fs::create_dir_all(rootp.join("usr/lib/dir")).unwrap();
            std::fs::write(rootp.join("usr/lib/image.so"), "image").unwrap();
            symlink(victim.join("passwd"), rootp.join("usr/lib/stale.so")).unwrap();
            let _ = std::fs::remove_file(rootp.join("lib"));
            symlink(&victim, rootp.join("lib")).unwrap();
            let root = if walk { Root::open(&rootp).unwrap().walk_only() } else { Root::open(&rootp).unwrap() };
            let mut c = DirCache::default();
            let t = Path::new("/usr/lib/tessera/driver/x");
            assert_eq!(root.link_cached(Path::new("/usr/lib/new.so"), t, &mut c).unwrap(), LinkOutcome::Created);
            assert_eq!(std::fs::read_link(rootp.join("usr/lib/new.so")).unwrap(), t);
            assert_eq!(root.link_cached(Path::new("/usr/lib/new.so"), t, &mut c).unwrap(), LinkOutcome::Existing);
            assert_eq!(root.link_cached(Path::new("/usr/lib/stale.so"), t, &mut c).unwrap(), LinkOutcome::Created);
            assert_eq!(std::fs::read_link(rootp.join("usr/lib/stale.so")).unwrap(), t);
            assert_eq!(root.link_cached(Path::new("/usr/lib/image.so"), t, &mut c).unwrap(), LinkOutcome::Occupied);
            assert_eq!(std::fs::read_to_string(rootp.join("usr/lib/image.so")).unwrap(), "image");
            assert!(root.link_cached(Path::new("/usr/lib/dir"), t, &mut c).is_err());
            // `/lib` is the image's link to a host directory: followed inside the root only.
            root.link_cached(Path::new("/lib/x.so"), t, &mut DirCache::default()).unwrap();
            let inside = rootp.join(victim.strip_prefix("/").unwrap());
            assert!(std::fs::symlink_metadata(inside.join("x.so")).unwrap().file_type().is_symlink(), "walk {walk}");
            assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 1, "walk {walk}");
            assert_eq!(std::fs::read_to_string(victim.join("passwd")).unwrap(), "host");
            let top = victim.strip_prefix("/").unwrap().components().next().unwrap();
            std::fs::remove_dir_all(rootp.join(top)).unwrap();
        }
    }
}
