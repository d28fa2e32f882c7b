//! The per-allocation directories, `<runtime_dir>/alloc/<id>/`, mounted into the container:
//!
//! - `limits` (0644): what the shim enforces, built from the record ([`Allocation::limits`]);
//!   rewritten atomically to change limits live.
//! - `region` (0666, made by the region crate): the accounting region the shim and the daemon
//!   share. After a limits rewrite its config generation is bumped; the shim rereads the limits
//!   when it sees the change (within 100 ms).
//!
//! Directories are 0755: container processes run as any uid and must reach both files.
//!
//! Creating a region costs milliseconds (a 1.9 MB file, its accounting blocks allocated, its
//! header written), too much for the kubelet's Allocate. With [`AllocDirs::keep_spares`] a
//! background thread keeps a few directories ready under `<runtime_dir>/spare/`, each holding a
//! fresh region; [`AllocDirs::create`] renames one into place and writes only the limits.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::time::Duration;

use tessera_region::{Region, RegionError};

use super::record::{Allocation, valid_id};

/// The directory under the runtime dir that holds one directory per allocation.
pub const ALLOC_SUBDIR: &str = "alloc";
/// The directory under the runtime dir that holds the ready-made spare directories. On the same
/// file system as [`ALLOC_SUBDIR`], so taking one is a rename.
pub const SPARE_SUBDIR: &str = "spare";
/// The limits file's name inside an allocation directory.
pub const LIMITS_FILE: &str = "limits";
/// The region file's name inside an allocation directory.
pub const REGION_FILE: &str = "region";

const DIR_MODE: u32 = 0o755;

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
    /// Wakes the refill thread when a spare is taken.
    taken: Condvar,
    seq: AtomicU64,
}

#[derive(Debug, Default)]
struct SpareState {
    ready: Vec<PathBuf>,
    keep: usize,
}

impl AllocDirs {
    /// The directories under `<runtime_dir>/alloc`; nothing is created until [`AllocDirs::create`].
    pub fn new(runtime_dir: &Path) -> AllocDirs {
        AllocDirs {
            root: runtime_dir.join(ALLOC_SUBDIR),
            spares: Arc::new(Spares {
                dir: runtime_dir.join(SPARE_SUBDIR),
                state: Mutex::new(SpareState::default()),
                taken: Condvar::new(),
                seq: AtomicU64::new(0),
            }),
        }
    }

    /// Keeps `count` spare directories ready, made by a background thread (it ends when the last
    /// clone of these `AllocDirs` is dropped). Spares left by an earlier process are deleted first:
    /// nothing records them, and a fresh region costs little off the request path.
    pub fn keep_spares(&self, count: usize) -> Result<(), AllocDirError> {
        match std::fs::remove_dir_all(&self.spares.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&self.spares.dir, "remove old spare directories")(e)),
        }
        if let Some(runtime_dir) = self.spares.dir.parent() {
            std::fs::create_dir_all(runtime_dir).map_err(io_err(runtime_dir, "create directory"))?;
        }
        make_dir(&self.spares.dir)?;
        self.spares.state.lock().unwrap_or_else(PoisonError::into_inner).keep = count;
        let spares = Arc::downgrade(&self.spares);
        std::thread::Builder::new()
            .name("tessera-spare-dirs".into())
            .spawn(move || refill(spares))
            .map_err(io_err(&self.spares.dir, "start the spare directory thread"))?;
        Ok(())
    }

    /// How many spare directories are ready now.
    pub fn spares_ready(&self) -> usize {
        self.spares.state.lock().unwrap_or_else(PoisonError::into_inner).ready.len()
    }

    /// Moves a spare directory to `dir`; false if none is ready (or none could be moved).
    fn take_spare(&self, dir: &Path) -> bool {
        let mut state = self.spares.state.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(spare) = state.ready.pop() {
            match std::fs::rename(&spare, dir) {
                Ok(()) => {
                    drop(state);
                    self.spares.taken.notify_one();
                    return true;
                }
                Err(e) => {
                    tracing::warn!(spare = %spare.display(), error = %e, "cannot use a spare allocation directory");
                    let _ = std::fs::remove_dir_all(&spare);
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

    /// Creates (or, after a restart, brings up to date) the directory of `alloc`: writes its
    /// limits and creates its region. Returns the directory. If a limits file was already there
    /// it is replaced and the region's config generation bumped, as [`AllocDirs::update_limits`].
    pub fn create(&self, alloc: &Allocation) -> Result<PathBuf, AllocDirError> {
        check_id(&alloc.id)?;
        make_dir(&self.root)?;
        let dir = self.dir(&alloc.id);
        // A spare holds a fresh region and no limits: the limits below complete it.
        if dir.symlink_metadata().is_err() && self.take_spare(&dir) {
            let limits_path = self.limits_path(&alloc.id);
            alloc
                .limits()
                .write_atomic(&limits_path)
                .map_err(|source| AllocDirError::Limits { path: limits_path, source })?;
            return Ok(dir);
        }
        make_dir(&dir)?;
        let limits_path = self.limits_path(&alloc.id);
        let rewrite = limits_path.symlink_metadata().is_ok();
        alloc
            .limits()
            .write_atomic(&limits_path)
            .map_err(|source| AllocDirError::Limits { path: limits_path, source })?;
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
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err(&dir, "remove directory")(e)),
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

/// The refill loop: makes spares while fewer than wished are ready; ends with the `AllocDirs`.
fn refill(spares: Weak<Spares>) {
    loop {
        let Some(sp) = spares.upgrade() else { return };
        let missing = {
            let state = sp.state.lock().unwrap_or_else(PoisonError::into_inner);
            let state = if state.ready.len() >= state.keep {
                // Woken by a take, or after a while to notice the `AllocDirs` is gone.
                sp.taken.wait_timeout(state, Duration::from_millis(500)).unwrap_or_else(PoisonError::into_inner).0
            } else {
                state
            };
            state.keep.saturating_sub(state.ready.len())
        };
        for _ in 0..missing {
            match make_spare(&sp) {
                Ok(path) => sp.state.lock().unwrap_or_else(PoisonError::into_inner).ready.push(path),
                Err(e) => {
                    // The request path still works without spares; retry later, quietly.
                    tracing::warn!(error = %e, "cannot make a spare allocation directory");
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
fn make_spare(sp: &Spares) -> Result<PathBuf, AllocDirError> {
    let n = sp.seq.fetch_add(1, Ordering::Relaxed);
    let building = sp.dir.join(format!("{n}.tmp"));
    let ready = sp.dir.join(n.to_string());
    let _ = std::fs::remove_dir_all(&building);
    make_dir(&building)?;
    let made = Region::open_or_create(&building.join(REGION_FILE))
        .map_err(AllocDirError::from)
        .and_then(|_| std::fs::rename(&building, &ready).map_err(io_err(&ready, "rename into place")));
    if let Err(e) = made {
        let _ = std::fs::remove_dir_all(&building);
        return Err(e);
    }
    Ok(ready)
}

fn check_id(id: &str) -> Result<(), AllocDirError> {
    valid_id(id).map_err(|reason| AllocDirError::InvalidId { id: id.to_string(), reason })
}

/// Creates `dir` if missing and sets it to 0755 (the umask may have narrowed it).
fn make_dir(dir: &Path) -> Result<(), AllocDirError> {
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => return Ok(()),
        Err(e) => return Err(io_err(dir, "create directory")(e)),
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(DIR_MODE)).map_err(io_err(dir, "chmod 0755"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::{AllocatedDevice, ContainerIdentity, Source};
    use tessera_region::{ComputeMode, Limits, Priority};

    fn alloc(id: &str) -> Allocation {
        Allocation {
            id: id.to_string(),
            resource: "tessera.io/share".to_string(),
            container: ContainerIdentity { container_id: Some("abc123".into()), ..Default::default() },
            source: Source::Hook,
            created_unix_ns: 1,
            devices: vec![AllocatedDevice {
                device_id: "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f::1".to_string(),
                physical_uuid: "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f".to_string(),
                memory_limit: Some(8 << 30),
                sm_percent: Some(30),
                priority: Priority::Low,
                compute_mode: ComputeMode::WorkConserving,
            }],
        }
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn create_update_remove() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = AllocDirs::new(tmp.path());
        let mut a = alloc("0123456789abcdef");
        let dir = dirs.create(&a).unwrap();
        assert_eq!(dir, tmp.path().join("alloc/0123456789abcdef"));
        assert_eq!(mode(dirs.root()), 0o755);
        assert_eq!(mode(&dir), 0o755);
        assert_eq!(mode(&dirs.limits_path(&a.id)), 0o644);
        assert_eq!(mode(&dirs.region_path(&a.id)), 0o666);

        let limits = Limits::load(&dirs.limits_path(&a.id)).unwrap();
        assert_eq!(limits, a.limits());
        assert_eq!(limits.container.as_deref(), Some("abc123"));
        assert_eq!(limits.priority, Priority::Low);
        assert_eq!(limits.compute_mode, ComputeMode::WorkConserving);
        assert_eq!(limits.devices[0].uuid, "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f");
        assert_eq!(limits.devices[0].memory_limit, Some(8 << 30));
        assert_eq!(limits.devices[0].sm_percent, Some(30));

        let region = Region::open_or_create(&dirs.region_path(&a.id)).unwrap();
        let g0 = region.config_generation();
        a.devices[0].memory_limit = Some(2 << 30);
        a.devices[0].sm_percent = Some(70);
        dirs.update_limits(&a).unwrap();
        let limits = Limits::load(&dirs.limits_path(&a.id)).unwrap();
        assert_eq!(limits.devices[0].memory_limit, Some(2 << 30));
        assert_eq!(limits.devices[0].sm_percent, Some(70));
        assert_eq!(region.config_generation(), g0 + 1, "the shim's handle sees the bump");
        assert_eq!(mode(&dirs.limits_path(&a.id)), 0o644);
        // No temporary files left beside them.
        let mut names: Vec<_> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, ["limits", "region"]);

        // Re-creating (a daemon restart) rewrites and bumps, keeping the region.
        dirs.create(&a).unwrap();
        assert_eq!(region.config_generation(), g0 + 2);
        assert_eq!(dirs.ids().unwrap(), ["0123456789abcdef"]);

        assert!(dirs.remove(&a.id).unwrap());
        assert!(!dir.exists());
        assert!(!dirs.remove(&a.id).unwrap());
        assert!(matches!(dirs.update_limits(&a), Err(AllocDirError::Missing { .. })));
        assert!(dirs.ids().unwrap().is_empty());
    }

    fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
        let start = std::time::Instant::now();
        while !ok() {
            assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn spares_are_taken_and_refilled() {
        let tmp = tempfile::tempdir().unwrap();
        // Leftovers of an earlier process are cleared.
        std::fs::create_dir_all(tmp.path().join("spare/7.tmp")).unwrap();
        let dirs = AllocDirs::new(tmp.path());
        dirs.keep_spares(2).unwrap();
        wait_for("two spares", || dirs.spares_ready() == 2);
        let spare_names = || {
            let mut v: Vec<String> = std::fs::read_dir(tmp.path().join("spare"))
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            v.sort();
            v
        };
        assert_eq!(spare_names().len(), 2);
        assert!(!spare_names().iter().any(|n| n == "7.tmp"));

        let a = alloc("fromspare");
        let dir = dirs.create(&a).unwrap();
        assert_eq!(mode(&dir), 0o755);
        assert_eq!(mode(&dirs.region_path(&a.id)), 0o666);
        assert_eq!(Limits::load(&dirs.limits_path(&a.id)).unwrap(), a.limits());
        let region = Region::open_or_create(&dirs.region_path(&a.id)).unwrap();
        let mut names: Vec<_> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, ["limits", "region"]);
        assert_eq!(dirs.ids().unwrap(), ["fromspare"]);

        // Taken spares are replaced; each allocation gets a region of its own.
        wait_for("the pool refilled", || dirs.spares_ready() == 2);
        let b = alloc("second");
        dirs.create(&b).unwrap();
        let rb = Region::open_or_create(&dirs.region_path(&b.id)).unwrap();
        rb.bump_config_generation();
        assert_ne!(region.config_generation(), rb.config_generation(), "two regions, not one file");
        wait_for("the pool refilled again", || dirs.spares_ready() == 2);
        assert_eq!(spare_names().len(), 2);
    }

    #[test]
    fn invalid_limits_and_ids_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = AllocDirs::new(tmp.path());
        let mut a = alloc("x1");
        a.devices[0].sm_percent = Some(0);
        let err = dirs.create(&a).unwrap_err();
        assert!(err.to_string().contains("limits") && err.to_string().contains("sm_percent"), "{err}");
        assert!(!dirs.limits_path("x1").exists());
        assert!(matches!(dirs.remove("../x"), Err(AllocDirError::InvalidId { .. })));
        assert!(matches!(dirs.create(&alloc("a/b")), Err(AllocDirError::InvalidId { .. })));
    }
}
