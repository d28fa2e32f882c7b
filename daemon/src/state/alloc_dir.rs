//! The per-allocation directories, `<runtime_dir>/alloc/<id>/`, mounted into the container:
//!
//! - `limits` (0644): what the shim enforces, built from the record ([`Allocation::limits`]);
//!   rewritten atomically to change limits live.
//! - `region` (0666, made by the region crate): the accounting region the shim and the daemon
//!   share. After a limits rewrite its config generation is bumped; the shim rereads the limits
//!   when it sees the change (within 100 ms).
//! - `ledger` (0644, `tessera_region::ledger`): the daemon's view of the other containers on the
//!   allocation's GPUs, written in place by [`crate::ledger`]; the container only reads it.
//!
//! Who can reach them (docs/security.md): `alloc/` and `spare/` are 0700, so no unprivileged
//! host user can reach any allocation's files; an allocation's own directory is 0755 because it
//! is what a container sees at `/run/tessera/alloc`, and its processes run as any uid.
//!
//! A container may write its region, so it may also resize it. So that it cannot fill a host
//! file system through it, the region lives alone in a tmpfs of its own exactly its size
//! (`<id>/.region/`, 3 inodes) and is bind-mounted onto `<id>/region`: growing it fails with
//! ENOSPC. (Shrinking it is caught by the region crate's SIGBUS guard.) Mounting needs
//! CAP_SYS_ADMIN; without it (an unprivileged test run) the region is a plain file and a warning
//! says once that it is not capped.
//!
//! Creating a region costs milliseconds, too much for the kubelet's Allocate. With
//! [`AllocDirs::keep_spares`] a background thread keeps a few directories ready under
//! `<runtime_dir>/spare/`, each holding a fresh region; [`AllocDirs::create`] renames one into
//! place (its mounts move with it) and writes only the limits.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::time::Duration;

use tessera_region::ledger::{LEDGER_FILE, Ledger, LedgerError};
use tessera_region::{Region, RegionError};

use super::mount;
use super::record::{Allocation, valid_id};

/// The directory under the runtime dir that holds one directory per allocation, and the names of
/// the limits file and the region in one: the contract crate's (the hook and the shim find them
/// by the same names).
pub use tessera_region::paths::{ALLOC_SUBDIR, LIMITS_FILE, REGION_FILE};
/// The directory under the runtime dir that holds the ready-made spare directories. On the same
/// file system as [`ALLOC_SUBDIR`], so taking one is a rename.
pub const SPARE_SUBDIR: &str = "spare";
/// The region's own size-capped tmpfs inside an allocation directory.
pub const REGION_STORE: &str = ".region";

/// An allocation's directory: what a container sees at `/run/tessera/alloc`.
const DIR_MODE: u32 = 0o755;
/// `alloc/` and `spare/`: root's alone.
const PRIVATE_MODE: u32 = 0o700;

/// What went wrong with an allocation directory; names the path and the reason.
#[derive(Debug, thiserror::Error)]
pub enum AllocDirError {
    #[error("{}: {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("allocation {id:?}: {reason}")]
    InvalidId { id: String, reason: String },
    /// The limits file could not be written (invalid limits are refused before writing).
    #[error("{}: writing limits: {source}", path.display())]
    Limits {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: no such allocation directory", path.display())]
    Missing { path: PathBuf },
    #[error(transparent)]
    Region(#[from] RegionError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> AllocDirError {
    let path = path.to_path_buf();
    move |source| AllocDirError::Io { path, op, source }
}

/// The allocation directories under one runtime dir.
#[derive(Debug, Clone)]
pub struct AllocDirs {
    root: PathBuf,
    spares: Arc<Spares>,
}

/// Ready-made directories, each with a fresh region, and the wish for how many to keep.
#[derive(Debug)]
struct Spares {
    dir: PathBuf,
    state: Mutex<SpareState>,
    /// Whether a spare's limits are flushed when written: not where the spares live on a tmpfs
    /// (the runtime dir under /run), whose flush does nothing but cost a system call.
    flush_limits: AtomicBool,
    /// Wakes the refill thread when a spare is taken (or the spares are stopped).
    taken: Condvar,
    seq: AtomicU64,
    /// Held by the refill thread while it makes a spare, so that [`AllocDirs::stop_spares`]
    /// finds none half made.
    building: Mutex<()>,
}

#[derive(Debug, Default)]
struct SpareState {
    ready: Vec<Spare>,
    keep: usize,
    /// Set by [`AllocDirs::stop_spares`]: no spare is made or handed out any more.
    stopped: bool,
    /// Set by [`AllocDirs::keep_spares`]: the spare directory is this process's to remove.
    kept: bool,
}

/// The last clone of an `AllocDirs` that kept spares is gone without [`AllocDirs::stop_spares`]
/// (a test's, or a start that failed after `keep_spares`): its spares go with it, so no region
/// stays mounted that nothing holds. Nothing else holds the pool now: the refill thread holds it
/// only while making a spare, and then this runs on that thread when it lets go.
impl Drop for Spares {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if state.kept && !state.stopped {
            remove_spare_dir(&self.dir);
        }
    }
}

impl AllocDirs {
    /// The directories under `<runtime_dir>/alloc`; nothing is created until [`AllocDirs::create`].
    pub fn new(runtime_dir: &Path) -> AllocDirs {
        AllocDirs {
            root: runtime_dir.join(ALLOC_SUBDIR),
            spares: Arc::new(Spares {
                dir: runtime_dir.join(SPARE_SUBDIR),
                state: Mutex::new(SpareState::default()),
                flush_limits: AtomicBool::new(true),
                taken: Condvar::new(),
                seq: AtomicU64::new(0),
                building: Mutex::new(()),
            }),
        }
    }

    /// Keeps `count` spare directories ready, made by a background thread (it ends when the last
    /// clone of these `AllocDirs` is dropped). Spares left by an earlier process are deleted first:
    /// nothing records them, and a fresh region costs little off the request path.
    pub fn keep_spares(&self, count: usize) -> Result<(), AllocDirError> {
        unmount_under(&self.spares.dir);
        match std::fs::remove_dir_all(&self.spares.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&self.spares.dir, "remove old spare directories")(e)),
        }
        if let Some(runtime_dir) = self.spares.dir.parent() {
            std::fs::create_dir_all(runtime_dir).map_err(io_err(runtime_dir, "create directory"))?;
        }
        make_dir(&self.spares.dir, PRIVATE_MODE)?;
        let on_tmpfs = nix::sys::statfs::statfs(&self.spares.dir)
            .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC);
        self.spares.flush_limits.store(!on_tmpfs, Ordering::Relaxed);
        {
            let mut state = self.spares.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.keep = count;
            state.kept = true;
        }
        let spares = Arc::downgrade(&self.spares);
        std::thread::Builder::new()
            .name("tessera-spare-dirs".into())
            .spawn(move || refill(spares))
            .map_err(io_err(&self.spares.dir, "start the spare directory thread"))?;
        Ok(())
    }

    /// Stops keeping spares and removes them, their region mounts with them (a clean stop:
    /// nothing stays mounted that no allocation holds). Waits for a spare being made; later
    /// allocation directories are made on the spot.
    pub fn stop_spares(&self) {
        {
            let mut state = self.spares.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.stopped = true;
            state.keep = 0;
            state.ready.clear();
        }
        self.spares.taken.notify_all();
        let _building = self.spares.building.lock().unwrap_or_else(PoisonError::into_inner);
        remove_spare_dir(&self.spares.dir);
    }

    /// How many spare directories are ready now.
    pub fn spares_ready(&self) -> usize {
        self.spares.state.lock().unwrap_or_else(PoisonError::into_inner).ready.len()
    }

    /// Writes `limits` (and the lease marker, when `leased`) into a spare directory and moves it
    /// to `dir`, which must not exist yet (it is never replaced); false if no spare was moved.
    fn take_spare(&self, dir: &Path, limits: &[u8], leased: bool) -> bool {
        let flush = self.spares.flush_limits.load(Ordering::Relaxed);
        let mut state = self.spares.state.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(spare) = state.ready.pop() {
            if let Err(e) = spare.complete(limits, leased, flush) {
                // The runtime dir's file system refuses the write (full): the spare itself is
                // sound and goes back; the directory made on the spot says why it cannot be.
                tracing::debug!(spare = %spare.dir.display(), error = %e, "cannot complete a spare allocation directory");
                spare.put_back(&mut state.ready, leased);
                return false;
            }
            let completed = match rename_new(&spare.dir, dir) {
                // `alloc/` itself gone (removed by hand while running): made again.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && !self.root.is_dir() => {
                    make_dir(&self.root, PRIVATE_MODE)
                        .map_err(std::io::Error::other)
                        .and_then(|()| rename_new(&spare.dir, dir))
                }
                moved => moved,
            };
            match completed {
                Ok(()) => {
                    // The refill thread is woken only once the pool is half spent (else its own
                    // timeout tops it up): waking a sleeping thread is a syscall and, on a VM, an
                    // interrupt to another CPU, on the request's path before its answer.
                    let low = state.ready.len() <= state.keep / 2;
                    drop(state);
                    if low {
                        self.spares.taken.notify_one();
                    }
                    return true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    // The directory is there already (brought up to date after a restart): the
                    // spare goes back as it was, for the next allocation.
                    spare.put_back(&mut state.ready, leased);
                    return false;
                }
                Err(e) => {
                    tracing::warn!(spare = %spare.dir.display(), error = %e, "cannot use a spare allocation directory");
                    discard_spare(&spare.dir);
                }
            }
        }
        false
    }

    /// `<runtime_dir>/alloc`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<runtime_dir>/alloc/<id>`.
    pub fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    pub fn limits_path(&self, id: &str) -> PathBuf {
        self.dir(id).join(LIMITS_FILE)
    }

    pub fn region_path(&self, id: &str) -> PathBuf {
        self.dir(id).join(REGION_FILE)
    }

    pub fn ledger_path(&self, id: &str) -> PathBuf {
        self.dir(id).join(LEDGER_FILE)
    }

    /// Creates (or, after a restart, brings up to date) the directory of `alloc`: writes its
    /// limits (and, for an allocation leased to its container, the lease marker the runtime
    /// wrapper looks for: [`tessera_region::owner::LEASE_FILE`]) and creates its region. Returns
    /// the directory. If a limits file was already there it is replaced and the region's config
    /// generation bumped, as [`AllocDirs::update_limits`].
    pub fn create(&self, alloc: &Allocation) -> Result<PathBuf, AllocDirError> {
        check_id(&alloc.id)?;
        let dir = self.dir(&alloc.id);
        let leased = alloc.leased_to_container();
        // A spare holds a fresh region and empty limits: the limits complete it before it is
        // renamed into place, so the directory appears whole (no temporary file, no second
        // rename). The rename refuses an existing directory, which is then brought up to date
        // below: no look beforehand on the request's path.
        if self.spares_ready() > 0 {
            let limits = alloc.limits();
            limits.validate().map_err(|e| AllocDirError::Limits {
                path: self.limits_path(&alloc.id),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
            })?;
            if self.take_spare(&dir, limits.to_toml().as_bytes(), leased) {
                return Ok(dir);
            }
        }
        make_dir(&self.root, PRIVATE_MODE)?;
        make_dir(&dir, DIR_MODE)?;
        let limits_path = self.limits_path(&alloc.id);
        let rewrite = limits_path.symlink_metadata().is_ok();
        alloc
            .limits()
            .write_atomic(&limits_path)
            .map_err(|source| AllocDirError::Limits { path: limits_path, source })?;
        if leased && !tessera_region::owner::is_leased(&dir) {
            write_lease(&dir).map_err(io_err(&dir.join(tessera_region::owner::LEASE_FILE), "write"))?;
        }
        if self.region_path(&alloc.id).symlink_metadata().is_err() {
            make_region(&dir)?;
        }
        if self.ledger_path(&alloc.id).symlink_metadata().is_err() {
            Ledger::create(&self.ledger_path(&alloc.id))?;
        }
        let region = Region::open_or_create(&self.region_path(&alloc.id))?;
        if rewrite {
            region.bump_config_generation();
        }
        Ok(dir)
    }

    /// Rewrites the limits of an existing allocation directory atomically from `alloc`, then bumps
    /// its region's config generation so running shims reload them.
    pub fn update_limits(&self, alloc: &Allocation) -> Result<(), AllocDirError> {
        check_id(&alloc.id)?;
        let dir = self.dir(&alloc.id);
        if !dir.is_dir() {
            return Err(AllocDirError::Missing { path: dir });
        }
        let limits_path = self.limits_path(&alloc.id);
        alloc
            .limits()
            .write_atomic(&limits_path)
            .map_err(|source| AllocDirError::Limits { path: limits_path, source })?;
        Region::open_or_create(&self.region_path(&alloc.id))?.bump_config_generation();
        Ok(())
    }

    /// Deletes the directory of allocation `id` and what is in it; `false` if there was none.
    pub fn remove(&self, id: &str) -> Result<bool, AllocDirError> {
        check_id(id)?;
        let dir = self.dir(id);
        // The two mounts every directory has, detached by name: reading the mount table (over
        // 2,000 entries beside 1,000 allocations) on every release cost milliseconds and held the
        // namespace's lock against Allocate's spares being mounted.
        for point in [dir.join(REGION_FILE), dir.join(REGION_STORE)] {
            let _ = mount::detach(&point);
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(_) => {
                // Something else is mounted below it: find it in the mount table, then again.
                unmount_under(&dir);
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => Ok(true),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                    Err(e) => Err(io_err(&dir, "remove directory")(e)),
                }
            }
        }
    }

    /// The ids of the allocation directories present (to reconcile with the store at start).
    pub fn ids(&self) -> Result<Vec<String>, AllocDirError> {
        let entries = match std::fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(&self.root, "read directory")(e)),
        };
        let mut ids = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err(&self.root, "read directory"))?;
            if let Ok(name) = entry.file_name().into_string()
                && valid_id(&name).is_ok()
                && entry.file_type().is_ok_and(|t| t.is_dir())
            {
                ids.push(name);
            }
        }
        ids.sort();
        Ok(ids)
    }
}

/// A ready spare directory and its limits file (empty, 0644), kept open so that taking the spare
/// costs one write and the rename.
#[derive(Debug)]
struct Spare {
    dir: PathBuf,
    limits: std::fs::File,
}

impl Spare {
    /// Writes the limits (flushed when `flush`, as [`tessera_region::Limits::write_atomic`]
    /// leaves them) and the lease marker: the directory whole, still out of sight.
    fn complete(&self, limits: &[u8], leased: bool, flush: bool) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.limits.write_all_at(limits, 0)?;
        if flush {
            self.limits.sync_all()?;
        }
        if leased { write_lease(&self.dir) } else { Ok(()) }
    }

    /// Back to as it was made (empty limits, no marker) and into `ready`; thrown away if it
    /// cannot be.
    fn put_back(self, ready: &mut Vec<Spare>, leased: bool) {
        match self.undo(leased) {
            Ok(()) => ready.push(self),
            Err(_) => discard_spare(&self.dir),
        }
    }

    fn undo(&self, leased: bool) -> std::io::Result<()> {
        self.limits.set_len(0)?;
        if leased {
            match std::fs::remove_file(self.dir.join(tessera_region::owner::LEASE_FILE)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }
}

/// Renames `from` to `to`, which must not exist (`AlreadyExists` if it does, whatever it is; a
/// plain rename would replace an empty directory).
fn rename_new(from: &Path, to: &Path) -> std::io::Result<()> {
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    match renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE) {
        Ok(()) => Ok(()),
        // A file system without the flag: look, then rename (this process alone makes these).
        Err(nix::errno::Errno::EINVAL) => {
            if to.symlink_metadata().is_ok() {
                return Err(std::io::Error::from(std::io::ErrorKind::AlreadyExists));
            }
            std::fs::rename(from, to)
        }
        Err(e) => Err(e.into()),
    }
}

/// Leaves the lease marker in allocation directory `dir`. Not flushed: /run is tmpfs, and after a
/// restart [`AllocDirs::create`] writes it again from the record.
fn write_lease(dir: &Path) -> std::io::Result<()> {
    write_new_file(&dir.join(tessera_region::owner::LEASE_FILE), b"container\n", false)
}

/// Creates `path` (it must not exist) with `bytes`, mode 0644: container processes of any uid read
/// an allocation directory's files, and nothing in them is secret. `flush`: fsynced too.
fn write_new_file(path: &Path, bytes: &[u8], flush: bool) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = new_file(path)?;
    f.write_all(bytes)?;
    if flush { f.sync_all() } else { Ok(()) }
}

/// Creates `path` (it must not exist), empty, mode 0644, open for writing.
fn new_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(path)?;
    // The umask may have narrowed the mode.
    f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    Ok(f)
}

/// How long the refill thread, woken by a take, waits before it builds.
const REFILL_AFTER_TAKE: Duration = Duration::from_millis(2);

/// The pause after each spare of a refill: its ~0.5 ms of CPU (the region's tmpfs, the file, the
/// mounts) comes in slices between the requests of a busy kubelet rather than as one burst.
const BETWEEN_SPARES: Duration = Duration::from_millis(1);

/// The refill loop: makes spares while fewer than wished are ready; ends with the `AllocDirs`.
fn refill(spares: Weak<Spares>) {
    loop {
        let Some(sp) = spares.upgrade() else { return };
        let (missing, woken) = {
            let state = sp.state.lock().unwrap_or_else(PoisonError::into_inner);
            if state.stopped {
                return;
            }
            let (state, woken) = if state.ready.len() >= state.keep {
                // Woken by a take that half spent the pool, or after a while: to top up what
                // other takes left, or to notice the `AllocDirs` is gone.
                let (state, waited) =
                    sp.taken.wait_timeout(state, Duration::from_millis(500)).unwrap_or_else(PoisonError::into_inner);
                (state, !waited.timed_out())
            } else {
                (state, false)
            };
            (state.keep.saturating_sub(state.ready.len()), woken)
        };
        if woken && missing > 0 {
            // Woken by a take on a request's path, before its answer: let the answer go first
            // rather than build beside it (the pool still holds half).
            std::thread::sleep(REFILL_AFTER_TAKE);
        }
        for _ in 0..missing {
            let building = sp.building.lock().unwrap_or_else(PoisonError::into_inner);
            if sp.state.lock().unwrap_or_else(PoisonError::into_inner).stopped {
                return;
            }
            match make_spare(&sp) {
                Ok(spare) => {
                    sp.state.lock().unwrap_or_else(PoisonError::into_inner).ready.push(spare);
                    drop(building);
                    std::thread::sleep(BETWEEN_SPARES);
                }
                Err(e) => {
                    // The request path still works without spares; retry later, quietly.
                    tracing::warn!(error = %e, "cannot make a spare allocation directory");
                    drop(building);
                    drop(sp);
                    std::thread::sleep(Duration::from_secs(5));
                    break;
                }
            }
        }
    }
}

/// One spare: a 0755 directory with a fresh region, built under a temporary name, then renamed so
/// a half-made one is never handed out.
fn make_spare(sp: &Spares) -> Result<Spare, AllocDirError> {
    let n = sp.seq.fetch_add(1, Ordering::Relaxed);
    let building = sp.dir.join(format!("{n}.tmp"));
    let ready = sp.dir.join(n.to_string());
    unmount_under(&building);
    let _ = std::fs::remove_dir_all(&building);
    make_dir(&building, DIR_MODE)?;
    let limits = building.join(LIMITS_FILE);
    let made = make_region(&building)
        .and_then(|()| Ledger::create(&building.join(LEDGER_FILE)).map(drop).map_err(AllocDirError::from))
        .and_then(|()| new_file(&limits).map_err(io_err(&limits, "create")))
        .and_then(|f| std::fs::rename(&building, &ready).map(|()| f).map_err(io_err(&ready, "rename into place")));
    match made {
        Ok(limits) => Ok(Spare { dir: ready, limits }),
        Err(e) => {
            discard_spare(&building);
            Err(e)
        }
    }
}

/// Throws away a spare that could not be used (or made): its mounts, then its files.
fn discard_spare(dir: &Path) {
    unmount_under(dir);
    let _ = std::fs::remove_dir_all(dir);
}

/// Makes the region of allocation directory `dir`: in a tmpfs of its own exactly its size,
/// bind-mounted onto `dir/region`; a plain file where this process may not mount.
fn make_region(dir: &Path) -> Result<(), AllocDirError> {
    let store = dir.join(REGION_STORE);
    let target = dir.join(REGION_FILE);
    make_dir(&store, PRIVATE_MODE)?;
    match mount::capped_tmpfs(&store, tessera_region::LAYOUT_SIZE as u64) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(nix::libc::EPERM) => {
            warn_uncapped(&e);
            let _ = std::fs::remove_dir(&store);
            Region::open_or_create(&target)?;
            return Ok(());
        }
        Err(e) => return Err(io_err(&store, "mount a tmpfs for the region")(e)),
    }
    let made = (|| {
        let inner = store.join(REGION_FILE);
        drop(Region::open_or_create(&inner)?);
        std::fs::File::create(&target).map_err(io_err(&target, "create the region's mount point"))?;
        mount::bind(&inner, &target).map_err(io_err(&target, "bind-mount the region"))
    })();
    if made.is_err() {
        unmount_under(dir);
        let _ = std::fs::remove_file(&target);
    }
    made
}

/// Says once that regions are plain files (a container could grow its region).
fn warn_uncapped(e: &std::io::Error) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        tracing::warn!(
            error = %e,
            "cannot mount a size-capped tmpfs per region (tesserad needs CAP_SYS_ADMIN): regions are plain files, \
             and a container could grow its own"
        );
    });
}

/// Detaches every mount at or below `dir` (deepest first), so the tree can be removed.
/// Removes the spare directory `dir` and the region mounts inside it.
fn remove_spare_dir(dir: &Path) {
    unmount_under(dir);
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the spare directories"),
    }
}

fn unmount_under(dir: &Path) {
    for point in mount::points_under(dir) {
        if let Err(e) = mount::detach(&point) {
            tracing::warn!(path = %point.display(), error = %e, "cannot unmount");
        }
    }
}

fn check_id(id: &str) -> Result<(), AllocDirError> {
    valid_id(id).map_err(|reason| AllocDirError::InvalidId { id: id.to_string(), reason })
}

/// Creates `dir` if missing and gives it `mode` (the umask may have narrowed it; an existing
/// directory of a looser mode, from an older tesserad, is narrowed).
fn make_dir(dir: &Path, mode: u32) -> Result<(), AllocDirError> {
    // Already there (every Allocate after the first): one stat, no mkdir.
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() && m.permissions().mode() & 0o7777 == mode => return Ok(()),
        Ok(m) if m.is_dir() => {}
        _ => match std::fs::create_dir(dir) {
            Ok(()) => {}
            // Made meanwhile by another thread: its mode is set below all the same.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(io_err(dir, "create directory")(e)),
        },
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(io_err(dir, "chmod"))
}

#[cfg(test)]
#[path = "alloc_dir_tests.rs"]
mod tests;
