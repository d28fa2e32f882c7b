//! The driver directory: the host driver's user-space files ([`DriverFiles`]) gathered once into
//! one host directory, so that a container gets one read-only bind mount of it (at
//! [`crate::paths::DRIVER_CONTAINER_DIR`]) instead of one mount per file.
//!
//! Layout: `<parent>/<key>/<path relative to the driver root>` for every library and tool. A
//! soname link whose target is another listed file in the same directory is the same relative
//! link here; any other file is a hard link of the file it resolves to (inside the driver root),
//! or a copy (mode and modification time kept) where a hard link is refused (another filesystem
//! or mount: `EXDEV`; `fs.protected_hardlinks`: `EPERM`).
//!
//! `<key>` is a digest of every file's relative path and its resolved file's identity (size,
//! modification time, device, inode, mode) and of every link's target, so a driver upgrade gives a
//! new directory. A directory is never deleted or changed once built: running containers may
//! still have it mounted. Old ones are left for the operator; a damaged one is renamed aside
//! (`<key>.damaged-<unix seconds>`), never deleted.
//!
//! Crash safety: a directory is built as `<parent>/.tmp-<key>-<pid>`, checked, synced and renamed
//! to `<parent>/<key>`, so a crash at any point leaves either no `<key>` or a complete one; the
//! next [`prepare`] removes leftover temporaries. An existing `<key>` is checked entry by entry
//! before it is trusted. docs/hook.md, "Driver directory", describes the whole.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use crate::driver::DriverFiles;

/// Part of every key: a change of layout never reuses a directory of the old one.
const FORMAT: &[u8] = b"tessera-driver-dir-1";
/// Directories being built: `.tmp-<key>-<pid>`.
const TMP_PREFIX: &str = ".tmp-";
/// The mode of every directory under `<key>` (containers read through the mount).
const DIR_MODE: u32 = 0o755;
/// The mode of `<parent>` when this creates it: state is owner-only.
const PARENT_MODE: u32 = 0o700;

/// One builder at a time in this process: two would share a `.tmp-<key>-<pid>` name.
static BUILDING: Mutex<()> = Mutex::new(());

/// What [`prepare`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// `<parent>/<key>`.
    pub dir: PathBuf,
    /// Built by this call; `false`: an earlier one was found complete and reused as it is.
    pub built: bool,
    /// How its files are held.
    pub counts: Counts,
    /// An earlier `<key>` found damaged and renamed aside before rebuilding.
    pub moved_aside: Option<MovedAside>,
    /// Leftover temporaries of an interrupted build, removed.
    pub removed_leftovers: Vec<PathBuf>,
}

/// How a driver directory holds its entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Files sharing the host file's inode (no disk used).
    pub hard_links: usize,
    /// Files copied (disk used: their size, unless the filesystem shared the blocks).
    pub copies: usize,
    /// Soname links recreated as links.
    pub symlinks: usize,
}

/// A damaged directory renamed aside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovedAside {
    pub from: PathBuf,
    pub to: PathBuf,
    /// The first problem found.
    pub reason: String,
}

/// A driver directory could not be prepared: what was being done, on which path, and why. No
/// partial directory is left behind.
#[derive(Debug, thiserror::Error)]
#[error("driver directory: {what} {}: {source}", path.display())]
pub struct BundleError {
    pub what: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl BundleError {
    fn new(what: &'static str, path: &Path, source: io::Error) -> BundleError {
        BundleError { what, path: path.to_path_buf(), source }
    }

    fn invalid(what: &'static str, path: &Path, msg: String) -> BundleError {
        BundleError::new(what, path, io::Error::new(io::ErrorKind::InvalidInput, msg))
    }
}

/// Knobs for tests.
#[derive(Debug, Clone, Default)]
pub(crate) struct Options {
    /// Copy every file, as if hard links were refused.
    pub force_copy: bool,
    /// Fail while building this relative path, as a full disk would.
    #[cfg(test)]
    pub fail_at: Option<PathBuf>,
}

/// The driver directory for `files` under `parent`: an existing complete `<parent>/<key>`, or
/// one built now. Never deletes or changes a directory that may be in use (any `<key>`, old or
/// current): a damaged one is renamed aside and a new one built. `parent` is created (0700) when
/// missing. On error nothing partial is left, and the caller should fall back to one mount per
/// file.
pub fn prepare(files: &DriverFiles, parent: &Path) -> Result<Prepared, BundleError> {
    prepare_with(files, parent, &Options::default())
}

pub(crate) fn prepare_with(files: &DriverFiles, parent: &Path, opts: &Options) -> Result<Prepared, BundleError> {
    let _one = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    let plan = plan(files)?;
    let key = key(&plan);
    ensure_parent(parent)?;
    let removed_leftovers = remove_leftovers(parent);
    let dir = parent.join(&key);
    let mut moved_aside = None;
    match fs::symlink_metadata(&dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(BundleError::new("reading", &dir, e)),
        Ok(_) => match check(&dir, &plan) {
            Ok(counts) => return Ok(Prepared { dir, built: false, counts, moved_aside: None, removed_leftovers }),
            Err(reason) => {
                let to = move_aside(parent, &key)?;
                moved_aside = Some(MovedAside { from: dir.clone(), to, reason });
            }
        },
    }
    let counts = build(parent, &key, &plan, opts)?;
    Ok(Prepared { dir, built: true, counts, moved_aside, removed_leftovers })
}

/// What one entry under `<key>` must be.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expect {
    Dir,
    /// A relative link, exactly this target.
    Link(PathBuf),
    /// The resolved host file's content: a hard link of it or a copy.
    File(HostFile),
}

/// A resolved host file as found when planning.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime: i64,
    mtime_nsec: i64,
    modified: SystemTime,
    mode: u32,
}

impl HostFile {
    fn of(path: PathBuf, m: &fs::Metadata) -> io::Result<HostFile> {
        Ok(HostFile {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
            modified: m.modified()?,
            mode: m.mode() & 0o7777,
            path,
        })
    }
}

type Plan = BTreeMap<PathBuf, Expect>;

/// Every entry of the directory for `files`, by path relative to `<key>` (parents before
/// children: `Path` orders by component).
fn plan(files: &DriverFiles) -> Result<Plan, BundleError> {
    let listed: BTreeSet<&Path> = files.libraries.iter().chain(&files.binaries).map(PathBuf::as_path).collect();
    if listed.is_empty() {
        return Err(BundleError::invalid("gathering", &files.root, "no driver files were found under it".into()));
    }
    let mut plan = Plan::new();
    for &host in &listed {
        let rel = host.strip_prefix(&files.root).map_err(|_| {
            BundleError::invalid("gathering", host, format!("is not under the driver root {}", files.root.display()))
        })?;
        if rel.as_os_str().is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(BundleError::invalid("gathering", host, "is not a file path under the driver root".into()));
        }
        // Whatever it is, it must end at a regular file (no dangling or looping links).
        let resolved = resolve_in_root(&files.root, rel).map_err(|e| BundleError::new("resolving", host, e))?;
        let meta = fs::metadata(&resolved).map_err(|e| BundleError::new("reading", &resolved, e))?;
        if !meta.is_file() {
            return Err(BundleError::invalid(
                "gathering",
                host,
                format!("{} is not a regular file", resolved.display()),
            ));
        }
        let own = fs::symlink_metadata(host).map_err(|e| BundleError::new("reading", host, e))?;
        let expect = match sibling_link(host, &own, &listed) {
            Some(target) => Expect::Link(target),
            None => Expect::File(HostFile::of(resolved, &meta).map_err(|e| BundleError::new("reading", host, e))?),
        };
        for dir in rel.ancestors().skip(1).filter(|d| !d.as_os_str().is_empty()) {
            if plan.entry(dir.to_path_buf()).or_insert(Expect::Dir) != &Expect::Dir {
                return Err(BundleError::invalid("gathering", host, format!("{} is also a file", dir.display())));
            }
        }
        if plan.insert(rel.to_path_buf(), expect).is_some() {
            return Err(BundleError::invalid("gathering", host, "another driver file has the same path".into()));
        }
    }
    Ok(plan)
}

/// `root/rel` with every link followed as if `root` were `/`: an absolute target is under `root`
/// and `..` stops at it. A daemon in a container sees the host's driver root at `/driver-root`,
/// where a link to `/usr/lib/…` means the host's file, not the daemon image's.
fn resolve_in_root(root: &Path, rel: &Path) -> io::Result<PathBuf> {
    /// Links followed at most, as the kernel's path walk (ELOOP).
    const MAX_LINKS: usize = 40;
    let mut todo: Vec<OsString> = Vec::new();
    let push = |todo: &mut Vec<OsString>, p: &Path| {
        for c in p.components().rev() {
            match c {
                Component::Normal(n) => todo.push(n.to_os_string()),
                Component::ParentDir => todo.push(OsString::from("..")),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
    };
    push(&mut todo, rel);
    let mut done = PathBuf::new();
    let mut links = 0;
    while let Some(name) = todo.pop() {
        if name == ".." {
            done.pop();
            continue;
        }
        let here = root.join(&done).join(&name);
        if !fs::symlink_metadata(&here)?.file_type().is_symlink() {
            done.push(name);
            continue;
        }
        links += 1;
        if links > MAX_LINKS {
            return Err(io::Error::from_raw_os_error(libc::ELOOP));
        }
        let target = fs::read_link(&here)?;
        if target.is_absolute() {
            done.clear();
        }
        push(&mut todo, &target);
    }
    Ok(root.join(done))
}

/// The target of `host` when it is a link to another listed file in its own directory (a soname
/// link): recreated as the same link.
fn sibling_link(host: &Path, own: &fs::Metadata, listed: &BTreeSet<&Path>) -> Option<PathBuf> {
    if !own.file_type().is_symlink() {
        return None;
    }
    let target = fs::read_link(host).ok()?;
    let mut parts = target.components();
    let one_name = matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None));
    (one_name && listed.contains(host.parent()?.join(&target).as_path())).then_some(target)
}

/// The directory's name: fnv1a-64 over the layout version and every entry.
fn key(plan: &Plan) -> String {
    let mut b = FORMAT.to_vec();
    for (rel, e) in plan {
        b.extend_from_slice(rel.as_os_str().as_bytes());
        b.push(0);
        match e {
            Expect::Dir => b.push(b'd'),
            Expect::Link(t) => {
                b.push(b'l');
                b.extend_from_slice(t.as_os_str().as_bytes());
                b.push(0);
            }
            Expect::File(f) => {
                b.push(b'f');
                for n in [f.size, f.mtime as u64, f.mtime_nsec as u64, f.dev, f.ino, u64::from(f.mode)] {
                    b.extend_from_slice(&n.to_le_bytes());
                }
            }
        }
    }
    format!("{:016x}", crate::fnv1a(&b))
}

fn ensure_parent(parent: &Path) -> Result<(), BundleError> {
    match fs::metadata(parent) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => {
            let e = io::Error::new(io::ErrorKind::NotADirectory, "exists and is not a directory");
            return Err(BundleError::new("creating", parent, e));
        }
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(BundleError::new("reading", parent, e)),
        Err(_) => {}
    }
    let up = parent.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(up) = up {
        fs::create_dir_all(up).map_err(|e| BundleError::new("creating", up, e))?;
    }
    match fs::DirBuilder::new().mode(PARENT_MODE).create(parent) {
        Ok(()) => {
            fs::set_permissions(parent, fs::Permissions::from_mode(PARENT_MODE))
                .map_err(|e| BundleError::new("setting the mode of", parent, e))?;
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(BundleError::new("creating", parent, e)),
    }
    if let Some(up) = up {
        sync_dir(up).map_err(|e| BundleError::new("syncing", up, e))?;
    }
    Ok(())
}

/// Removes `.tmp-*` entries left by an interrupted build, except those of a builder that may
/// still be running (another process whose pid is alive; from another pid namespace it is only
/// litter). What is left is never trusted: only `<key>` is.
fn remove_leftovers(parent: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(parent) else { return Vec::new() };
    let own = std::process::id();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| n.starts_with(TMP_PREFIX)) else { continue };
        let pid = name.rsplit('-').next().and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| p != own && alive(p)) {
            continue;
        }
        let path = entry.path();
        let gone = match entry.file_type() {
            Ok(t) if t.is_dir() => fs::remove_dir_all(&path),
            _ => fs::remove_file(&path),
        };
        if gone.is_ok() {
            removed.push(path);
        }
    }
    removed
}

fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 sends nothing; it only asks whether the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Renames a damaged `<parent>/<key>` to `<parent>/<key>.damaged-<unix seconds>[-n]`.
fn move_aside(parent: &Path, key: &str) -> Result<PathBuf, BundleError> {
    let from = parent.join(key);
    let secs = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut to = parent.join(format!("{key}.damaged-{secs}"));
    let mut n = 0;
    while fs::symlink_metadata(&to).is_ok() {
        n += 1;
        to = parent.join(format!("{key}.damaged-{secs}-{n}"));
    }
    fs::rename(&from, &to).map_err(|e| BundleError::new("moving aside the damaged", &from, e))?;
    sync_dir(parent).map_err(|e| BundleError::new("syncing", parent, e))?;
    Ok(to)
}

/// Checks `dir` against `plan`: every entry present and as expected, nothing else. `Err` names
/// the first problem.
fn check(dir: &Path, plan: &Plan) -> Result<Counts, String> {
    let top = fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !top.is_dir() || top.mode() & 0o7777 != DIR_MODE {
        return Err(format!("{} is not a directory of mode 0755", dir.display()));
    }
    let mut found = BTreeMap::new();
    walk(dir, Path::new(""), &mut found).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    let mut counts = Counts::default();
    for (rel, expect) in plan {
        let Some(m) = found.remove(rel) else { return Err(format!("{} is missing", rel.display())) };
        let ok = match expect {
            Expect::Dir => m.is_dir() && m.mode() & 0o7777 == DIR_MODE,
            Expect::Link(target) => {
                counts.symlinks += 1;
                m.file_type().is_symlink() && fs::read_link(dir.join(rel)).is_ok_and(|t| &t == target)
            }
            Expect::File(h) if m.is_file() && (m.dev(), m.ino()) == (h.dev, h.ino) => {
                counts.hard_links += 1;
                true
            }
            Expect::File(h) => {
                counts.copies += 1;
                m.is_file()
                    && m.size() == h.size
                    && (m.mtime(), m.mtime_nsec()) == (h.mtime, h.mtime_nsec)
                    && m.mode() & 0o7777 == h.mode
            }
        };
        if !ok {
            return Err(format!("{} is not what was gathered", rel.display()));
        }
    }
    match found.keys().next() {
        Some(extra) => Err(format!("{} was not gathered", extra.display())),
        None => Ok(counts),
    }
}

/// Every entry under `dir`, links not followed.
fn walk(dir: &Path, rel: &Path, found: &mut BTreeMap<PathBuf, fs::Metadata>) -> io::Result<()> {
    for entry in fs::read_dir(dir.join(rel))? {
        let entry = entry?;
        let r = rel.join(entry.file_name());
        let m = fs::symlink_metadata(dir.join(&r))?;
        if m.is_dir() {
            walk(dir, &r, found)?;
        }
        found.insert(r, m);
    }
    Ok(())
}

/// Builds `<parent>/.tmp-<key>-<pid>`, checks and syncs it and renames it to `<parent>/<key>`;
/// on any error the temporary is removed.
fn build(parent: &Path, key: &str, plan: &Plan, opts: &Options) -> Result<Counts, BundleError> {
    let tmp = parent.join(format!("{TMP_PREFIX}{key}-{}", std::process::id()));
    let done = fill(&tmp, plan, opts).and_then(|counts| {
        let dir = parent.join(key);
        fs::rename(&tmp, &dir).map_err(|e| BundleError::new("renaming into place", &tmp, e))?;
        sync_dir(parent).map_err(|e| BundleError::new("syncing", parent, e))?;
        Ok(counts)
    });
    if done.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    done
}

fn fill(tmp: &Path, plan: &Plan, opts: &Options) -> Result<Counts, BundleError> {
    make_dir(tmp)?;
    let mut counts = Counts::default();
    for (rel, expect) in plan {
        let dst = tmp.join(rel);
        #[cfg(test)]
        if opts.fail_at.as_deref() == Some(rel.as_path()) {
            return Err(BundleError::new("copying to", &dst, io::Error::from_raw_os_error(libc::ENOSPC)));
        }
        match expect {
            Expect::Dir => make_dir(&dst)?,
            Expect::Link(target) => {
                std::os::unix::fs::symlink(target, &dst).map_err(|e| BundleError::new("linking", &dst, e))?;
                counts.symlinks += 1;
            }
            Expect::File(h) => {
                let linked = if opts.force_copy {
                    Err(io::Error::from_raw_os_error(libc::EXDEV))
                } else {
                    fs::hard_link(&h.path, &dst)
                };
                match linked {
                    Ok(()) => counts.hard_links += 1,
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EXDEV | libc::EPERM)) => {
                        copy(h, &dst).map_err(|e| BundleError::new("copying to", &dst, e))?;
                        counts.copies += 1;
                    }
                    Err(e) => return Err(BundleError::new("hard-linking to", &dst, e)),
                }
            }
        }
    }
    // A host file replaced while it was gathered would give a directory its key does not name.
    check(tmp, plan).map_err(|why| {
        BundleError::invalid("checking", tmp, format!("the driver's files changed while gathering them: {why}"))
    })?;
    for dir in plan.iter().filter(|(_, e)| **e == Expect::Dir).map(|(rel, _)| tmp.join(rel)) {
        sync_dir(&dir).map_err(|e| BundleError::new("syncing", &dir, e))?;
    }
    sync_dir(tmp).map_err(|e| BundleError::new("syncing", tmp, e))?;
    Ok(counts)
}

fn make_dir(dir: &Path) -> Result<(), BundleError> {
    fs::DirBuilder::new().mode(DIR_MODE).create(dir).map_err(|e| BundleError::new("creating", dir, e))?;
    // The umask may have taken bits away.
    fs::set_permissions(dir, fs::Permissions::from_mode(DIR_MODE))
        .map_err(|e| BundleError::new("setting the mode of", dir, e))
}

/// A copy of `h` at `dst` with its mode and modification time, synced. `io::copy` between files
/// uses copy_file_range, which shares blocks where the filesystem can (reflinks).
fn copy(h: &HostFile, dst: &Path) -> io::Result<()> {
    let mut src = fs::File::open(&h.path)?;
    let mut out = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(dst)?;
    io::copy(&mut src, &mut out)?;
    out.set_permissions(fs::Permissions::from_mode(h.mode))?;
    out.set_times(fs::FileTimes::new().set_modified(h.modified))?;
    out.sync_all()
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests;
