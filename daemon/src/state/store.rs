//! The crash-safe allocation store: one JSON file per allocation, `<dir>/<id>.json`.
//!
//! Every change is durable and atomic before the call returns: a record is written to
//! `<id>.json.tmp`, fsynced, renamed over `<id>.json`, and the directory fsynced; a removal unlinks
//! the file and fsyncs the directory. After `kill -9` at any moment, [`Store::open`] finds each
//! record either whole or absent: leftover `*.tmp` files are deleted, and a record file that does
//! not parse (damaged by something else) is moved aside to `<id>.json.corrupt` and logged, never
//! silently dropped and never a reason to fail. An in-memory index mirrors the directory.
//!
//! One process owns a store at a time: [`Store::open`] takes an exclusive lock on `<dir>/lock`.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::record::{Allocation, valid_id};

const RECORD_EXT: &str = ".json";
const TMP_EXT: &str = ".tmp";
const CORRUPT_EXT: &str = ".corrupt";
const LOCK_FILE: &str = "lock";

/// What went wrong with the store; every variant names the path (or the id) and the reason.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{}: {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: the allocation store is in use by another process", path.display())]
    Locked { path: PathBuf },
    #[error("allocation {id:?}: {reason}")]
    InvalidId { id: String, reason: String },
    #[error("{}: allocation {id:?} already exists", path.display())]
    Duplicate { id: String, path: PathBuf },
    #[error("{}: allocation {id:?} does not exist", path.display())]
    NotFound { id: String, path: PathBuf },
    #[error("{}: cannot encode allocation {id:?}: {reason}", path.display())]
    Encode { id: String, path: PathBuf, reason: String },
}

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> StateError {
    let path = path.to_path_buf();
    move |source| StateError::Io { path, op, source }
}

/// A record file [`Store::open`] found unreadable and moved aside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetAside {
    /// The record file as found.
    pub file: PathBuf,
    /// Where it is now.
    pub moved_to: PathBuf,
    /// Why it was not a record.
    pub reason: String,
}

/// The allocation records of the node, on disk and mirrored in memory.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    index: BTreeMap<String, Allocation>,
    set_aside: Vec<SetAside>,
    removed_tmp: Vec<PathBuf>,
    /// Held for the store's life: the exclusive lock on `<dir>/lock`.
    _lock: File,
}

impl Store {
    /// Opens the store in `dir`, creating the directory (mode 0700) if needed, and loads every
    /// record. Leftover temporary files are deleted; a record that does not parse, or whose id
    /// differs from its file name, is renamed to `<file>.corrupt` with an error logged that names
    /// it (see [`Store::set_aside`]). Fails only on I/O errors and when another process holds the
    /// store.
    pub fn open(dir: &Path) -> Result<Store, StateError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir, "create directory"))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io_err(dir, "chmod 0700"))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(io_err(&lock_path, "open"))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Err(StateError::Locked { path: lock_path }),
            Err(TryLockError::Error(e)) => return Err(io_err(&lock_path, "lock")(e)),
        }

        let mut store = Store {
            dir: dir.to_path_buf(),
            index: BTreeMap::new(),
            set_aside: Vec::new(),
            removed_tmp: Vec::new(),
            _lock: lock,
        };
        let mut names: Vec<String> = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io_err(dir, "read directory"))? {
            let entry = entry.map_err(io_err(dir, "read directory"))?;
            match entry.file_name().into_string() {
                Ok(name) => names.push(name),
                Err(name) => tracing::warn!(dir = %dir.display(), "ignoring a file with a non-UTF-8 name: {name:?}"),
            }
        }
        names.sort();
        let mut changed = false;
        for name in names {
            let path = dir.join(&name);
            if name.ends_with(TMP_EXT) {
                // A write that never committed: its rename did not happen, so the record it would
                // have replaced (if any) is still whole.
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err(&path, "remove leftover temporary file")(e)),
                }
                tracing::info!(file = %path.display(), "removed an uncommitted temporary record");
                store.removed_tmp.push(path);
                changed = true;
                continue;
            }
            let Some(id) = name.strip_suffix(RECORD_EXT) else {
                if name != LOCK_FILE && !name.ends_with(CORRUPT_EXT) {
                    tracing::warn!(file = %path.display(), "ignoring a file that is not an allocation record");
                }
                continue;
            };
            let bytes = std::fs::read(&path).map_err(io_err(&path, "read"))?;
            match parse_record(id, &bytes) {
                Ok(record) => {
                    store.index.insert(id.to_string(), record);
                }
                Err(reason) => {
                    let moved_to = store.move_aside(&path)?;
                    tracing::error!(
                        file = %path.display(),
                        moved_to = %moved_to.display(),
                        "corrupt allocation record {}: {reason}; moved aside to {}",
                        path.display(),
                        moved_to.display()
                    );
                    store.set_aside.push(SetAside { file: path, moved_to, reason });
                    changed = true;
                }
            }
        }
        if changed {
            store.sync_dir()?;
        }
        Ok(store)
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The record files [`Store::open`] moved aside as corrupt.
    pub fn set_aside(&self) -> &[SetAside] {
        &self.set_aside
    }

    /// The uncommitted temporary files [`Store::open`] deleted.
    pub fn removed_tmp(&self) -> &[PathBuf] {
        &self.removed_tmp
    }

    /// The file that holds the record `id`.
    pub fn record_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}{RECORD_EXT}"))
    }

    /// Adds a record, durably; refuses an id already stored.
    pub fn insert(&mut self, alloc: &Allocation) -> Result<(), StateError> {
        valid_id(&alloc.id).map_err(|reason| StateError::InvalidId { id: alloc.id.clone(), reason })?;
        if self.index.contains_key(&alloc.id) {
            return Err(StateError::Duplicate { id: alloc.id.clone(), path: self.record_path(&alloc.id) });
        }
        self.write(alloc)
    }

    /// Replaces a stored record (same id) with `alloc`, durably and atomically: after a crash the
    /// old record or the new one is found, never neither.
    pub fn update(&mut self, alloc: &Allocation) -> Result<(), StateError> {
        if !self.index.contains_key(&alloc.id) {
            return Err(StateError::NotFound { id: alloc.id.clone(), path: self.record_path(&alloc.id) });
        }
        self.write(alloc)
    }

    /// Removes a record, durably; returns it, or `None` if there was none.
    pub fn remove(&mut self, id: &str) -> Result<Option<Allocation>, StateError> {
        if !self.index.contains_key(id) {
            return Ok(None);
        }
        let path = self.record_path(id);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&path, "remove")(e)),
        }
        // The file is gone from the directory either way: the index follows it, even if the
        // directory sync below fails (it is then retried by the next change's sync).
        let removed = self.index.remove(id);
        self.sync_dir()?;
        Ok(removed)
    }

    pub fn get(&self, id: &str) -> Option<&Allocation> {
        self.index.get(id)
    }

    /// Every record, by id.
    pub fn list(&self) -> impl Iterator<Item = &Allocation> {
        self.index.values()
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// tmp → fsync → rename → fsync(dir); the index is updated once the record is committed.
    fn write(&mut self, alloc: &Allocation) -> Result<(), StateError> {
        let path = self.record_path(&alloc.id);
        let mut bytes = serde_json::to_vec_pretty(alloc).map_err(|e| StateError::Encode {
            id: alloc.id.clone(),
            path: path.clone(),
            reason: e.to_string(),
        })?;
        bytes.push(b'\n');
        let tmp = self.dir.join(format!("{}{RECORD_EXT}{TMP_EXT}", alloc.id));
        let written = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io_err(&tmp, "create"))?;
            f.write_all(&bytes).map_err(io_err(&tmp, "write"))?;
            f.sync_all().map_err(io_err(&tmp, "fsync"))?;
            drop(f);
            std::fs::rename(&tmp, &path).map_err(io_err(&path, "rename into place"))
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        // The record is in the directory now; the index mirrors the directory. If the directory
        // sync fails the caller hears of it, and the next sync (any later change) makes it durable.
        self.index.insert(alloc.id.clone(), alloc.clone());
        self.sync_dir()
    }

    fn sync_dir(&self) -> Result<(), StateError> {
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io_err(&self.dir, "fsync directory"))
    }

    /// Renames `path` to `<path>.corrupt` (or `.corrupt.N` if that is taken).
    fn move_aside(&self, path: &Path) -> Result<PathBuf, StateError> {
        let base = format!("{}{CORRUPT_EXT}", path.display());
        let mut target = PathBuf::from(&base);
        let mut n = 1;
        while target.symlink_metadata().is_ok() {
            target = PathBuf::from(format!("{base}.{n}"));
            n += 1;
        }
        std::fs::rename(path, &target).map_err(io_err(path, "move corrupt record aside"))?;
        Ok(target)
    }
}

/// A record file's contents, checked against its file name.
fn parse_record(file_id: &str, bytes: &[u8]) -> Result<Allocation, String> {
    valid_id(file_id)?;
    let record: Allocation = serde_json::from_slice(bytes).map_err(|e| format!("not a valid record: {e}"))?;
    if record.id != file_id {
        return Err(format!("the record's id {:?} differs from its file name", record.id));
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::{AllocatedDevice, ContainerIdentity, Source};
    use tessera_region::{ComputeMode, Priority};

    fn sample(id: &str) -> Allocation {
        Allocation {
            id: id.to_string(),
            resource: "tessera.io/gpu".to_string(),
            container: ContainerIdentity { pod_name: Some(format!("pod-{id}")), ..Default::default() },
            source: Source::Kubelet,
            created_unix_ns: 42,
            devices: vec![AllocatedDevice {
                device_id: "GPU-1234::0".to_string(),
                physical_uuid: "GPU-1234".to_string(),
                memory_limit: Some(1 << 30),
                sm_percent: Some(50),
                priority: Priority::Normal,
                compute_mode: ComputeMode::Strict,
            }],
        }
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    }

    #[test]
    fn insert_get_list_remove_and_reopen() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let mut s = Store::open(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(s.is_empty());
        s.insert(&sample("b")).unwrap();
        s.insert(&sample("a")).unwrap();
        assert_eq!(s.get("a"), Some(&sample("a")));
        assert_eq!(s.list().map(|a| a.id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        let err = s.insert(&sample("a")).unwrap_err();
        assert!(matches!(err, StateError::Duplicate { .. }), "{err}");
        assert!(err.to_string().contains("a.json"), "{err}");
        assert_eq!(s.remove("b").unwrap(), Some(sample("b")));
        assert_eq!(s.remove("b").unwrap(), None);
        let mut changed = sample("a");
        changed.devices[0].sm_percent = Some(10);
        s.update(&changed).unwrap();
        assert!(matches!(s.update(&sample("zz")), Err(StateError::NotFound { .. })));
        drop(s);

        assert_eq!(files(&dir), ["a.json", "lock"]);
        let mode = std::fs::metadata(dir.join("a.json")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let s = Store::open(&dir).unwrap();
        assert_eq!(s.list().cloned().collect::<Vec<_>>(), [changed]);
        assert!(s.set_aside().is_empty());
    }

    #[test]
    fn bad_ids_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let mut s = Store::open(tmp.path()).unwrap();
        for bad in ["", "../escape", "a.b"] {
            let err = s.insert(&sample(bad)).unwrap_err();
            assert!(matches!(err, StateError::InvalidId { .. }), "{err}");
        }
        assert!(s.is_empty());
        assert_eq!(files(tmp.path()), ["lock"]);
    }

    #[test]
    fn a_second_owner_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::open(tmp.path()).unwrap();
        let err = Store::open(tmp.path()).unwrap_err();
        assert!(matches!(err, StateError::Locked { .. }), "{err}");
        assert!(err.to_string().contains("lock"), "{err}");
        drop(s);
        Store::open(tmp.path()).unwrap();
    }

    #[test]
    fn corrupt_records_are_set_aside_and_tmp_files_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        {
            let mut s = Store::open(dir).unwrap();
            s.insert(&sample("good")).unwrap();
            s.insert(&sample("renamed")).unwrap();
        }
        std::fs::write(dir.join("bad.json"), b"{\"id\": \"bad\", \"resou").unwrap();
        std::fs::write(dir.join("empty.json"), b"").unwrap();
        // A whole record under another record's name is not trusted either.
        std::fs::rename(dir.join("renamed.json"), dir.join("other.json")).unwrap();
        std::fs::write(dir.join("good.json.tmp"), b"{\"half\":").unwrap();
        std::fs::write(dir.join("new.json.tmp"), b"").unwrap();
        std::fs::write(dir.join("bad.json.corrupt"), b"an older one").unwrap();

        let s = Store::open(dir).unwrap();
        assert_eq!(s.list().map(|a| a.id.as_str()).collect::<Vec<_>>(), ["good"]);
        let aside: Vec<_> = s
            .set_aside()
            .iter()
            .map(|a| {
                (
                    a.file.file_name().unwrap().to_str().unwrap().to_string(),
                    a.moved_to.file_name().unwrap().to_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            aside,
            [
                ("bad.json".to_string(), "bad.json.corrupt.1".to_string()),
                ("empty.json".to_string(), "empty.json.corrupt".to_string()),
                ("other.json".to_string(), "other.json.corrupt".to_string()),
            ]
        );
        assert!(s.set_aside()[2].reason.contains("differs from its file name"), "{:?}", s.set_aside());
        assert_eq!(s.removed_tmp().len(), 2);
        assert_eq!(
            files(dir),
            ["bad.json.corrupt", "bad.json.corrupt.1", "empty.json.corrupt", "good.json", "lock", "other.json.corrupt"]
        );
        assert_eq!(std::fs::read(dir.join("bad.json.corrupt")).unwrap(), b"an older one");
        drop(s);
        // Nothing more to do on the next open.
        let s = Store::open(dir).unwrap();
        assert!(s.set_aside().is_empty() && s.removed_tmp().is_empty());
        assert_eq!(s.len(), 1);
    }
}
