//! The crash-safe allocation store: an append-only journal, `<dir>/allocations.journal`.
//!
//! Every change is durable before the call returns (but for the kubelet's new records, flushed a
//! moment later by a group flush: [`Store::insert_flushed_soon`], [`super::journal_flush`]), at
//! the cost of one disk flush: it is encoded
//! as one checksummed frame (format: [`super::journal`]), written in place at the journal's end
//! into space the file already holds as written zeros, and fdatasynced (the file's size and block
//! map do not change, so there is no metadata to flush); only then does the in-memory index change.
//! A change whose write or flush fails returns the error (naming the journal and the change) and
//! leaves the index as it was; the bytes it may have written are zeroed, best effort, and the next
//! change first compacts the journal, so no unacknowledged frame stays in the file that later
//! frames follow. (As with any failed flush, whether such a change survives a crash before that
//! compaction is unknown.)
//!
//! After `kill -9` (or a power cut) at any moment, [`Store::open`] replays the journal and finds
//! each change whole or absent. A frame cut short by the crash is the last thing in the file and
//! was never acknowledged: it is dropped without a word. Damage done by anything else (a frame
//! that does not check out, with more after it; a journal cut short, emptied or zeroed: see
//! [`super::journal`]) is never silently dropped and never a reason to fail: the journal as found
//! is kept as `allocations.journal.corrupt-<unix-ns>` (a hard link, so it costs no space whatever
//! its size), an error is logged that names the copy and the offset, it is reported in
//! [`Store::set_aside`], and the replay resumes at the next whole frame. With
//! [`Store::open_with_dirs`], every allocation directory the replay left without a record (and did
//! not remove) is read back into one ([`super::recover`]); one error line gives the counts (read,
//! the snapshot's, recovered, unreadable), and [`Store::loss`] reports them.
//!
//! The journal is compacted when it needs to be: at open only after damage, a torn write, a
//! journal without a header, legacy files, or a file over 4 times the size its records need (a
//! whole journal is written on in place, so a restart needs no free space); and whenever a change
//! does not fit in the space left. One header frame and one put frame per live record are written
//! to `allocations.journal.tmp`, zero-filled to the new capacity (max(1 MiB, 4 × the live frames),
//! rounded up to 64 KiB), fsynced, renamed over the journal, and the directory fsynced. A leftover
//! `allocations.journal.tmp` (a compaction cut short; the journal it would have replaced is whole)
//! is deleted at open and reported in [`Store::removed_tmp`]. A compaction that fails for want of
//! space ([`StateError::NoSpace`], naming the file system to free) fails the change that needed
//! it, and nothing else; at open it is not fatal (changes fail until space is back).
//!
//! Stores from before the journal held one JSON file per record, `<id>.json`: [`Store::open`]
//! loads them (one that does not parse, or whose id differs from its file name, is moved aside to
//! `<id>.json.corrupt` and reported), writes them into the journal by the compaction, and only
//! then deletes them; leftover `<id>.json.tmp` files are deleted. Should a record be both in the
//! journal and in such a file, the journal's is kept. Other files in the directory (the daemon's
//! state dir holds the event log and layout files too) are left alone.
//!
//! One process owns a store at a time: [`Store::open`] takes an exclusive lock on `<dir>/lock`.
//! [`read_records`] reads a store without the lock and without writing anything (inspection).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions, TryLockError};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::alloc_dir::AllocDirs;
use super::holders::Holders;
use super::journal::{self, Op, OpRef};
use super::journal_flush::JournalFlush;
use super::load::Loads;
use super::record::{Allocation, valid_id};

#[path = "store_files.rs"]
mod files;
use files::{file_names, keep_copy, move_aside, ours, parse_record, sync_dir, write_snapshot};

const RECORD_EXT: &str = ".json";
const LEGACY_TMP_EXT: &str = ".json.tmp";
/// The daemon's kept events (`crate::events`), beside the journal.
pub const EVENTS_FILE: &str = "events.pb";
/// The DRA driver's dynamic MIG journal (`crate::dra::dynamic_mig`), beside the journal. Not
/// `.json`: every `<id>.json` here is read as an allocation record.
pub const DYNAMIC_MIG_FILE: &str = "dra-dynamic-mig.state";
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
    /// The state directory's file system is full (or its quota spent).
    #[error(
        "{}: {op}: no space left for the allocation store ({source}); free space on the file system of {} \
         (the journal needs at least 1 MiB to compact)",
        path.display(),
        path.parent().unwrap_or(path).display()
    )]
    NoSpace {
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
    move |source| match source.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT) => StateError::NoSpace { path, op, source },
        _ => StateError::Io { path, op, source },
    }
}

/// Something [`Store::open`] found unreadable and set aside: a legacy record file (moved), or a
/// damaged stretch of the journal (the journal copied as it was found).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetAside {
    /// The file as found: the record file, or the journal.
    pub file: PathBuf,
    /// Where it is now: the moved record file, or the journal's copy.
    pub moved_to: PathBuf,
    /// Why it was not a record; for the journal, the offset and what was wrong there.
    pub reason: String,
}

/// What a damaged journal lost, found by [`Store::open_with_dirs`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loss {
    /// Records the journal still gave.
    pub read: usize,
    /// Records its last snapshot held, by its header; `None`: no header was read.
    pub snapshot: Option<u64>,
    /// Ids of the records rebuilt from their allocation directories.
    pub recovered: Vec<String>,
    /// Allocation directories with no record that could not be read back: id, why.
    pub unreadable: Vec<(String, String)>,
    /// The journal as found (for a missing one, where it should have been).
    pub copy: PathBuf,
}

/// When a frame is flushed: before its change returns, or by the group flush a moment later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flush {
    Now,
    Soon,
}

/// Which change a journal write is for (named in its errors).
#[derive(Debug, Clone, Copy)]
enum Change {
    Insert,
    Update,
    Remove,
}

impl Change {
    fn write_op(self) -> &'static str {
        match self {
            Change::Insert => "write the insert to the journal",
            Change::Update => "write the update to the journal",
            Change::Remove => "write the removal to the journal",
        }
    }

    fn sync_op(self) -> &'static str {
        match self {
            Change::Insert => "fdatasync the insert",
            Change::Update => "fdatasync the update",
            Change::Remove => "fdatasync the removal",
        }
    }
}

/// The allocation records of the node, on disk and mirrored in memory.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    index: BTreeMap<String, Allocation>,
    /// What the records in `index` hold per physical device; changed with it.
    loads: Loads,
    /// Which records in `index` hold each device id; changed with it.
    holders: Holders,
    set_aside: Vec<SetAside>,
    removed_tmp: Vec<PathBuf>,
    loss: Option<Loss>,
    /// The journal, open for writing (shared with its group flush).
    journal: Arc<File>,
    /// Flushes the frames of [`Store::insert_flushed_soon`] off the caller's path.
    flush: JournalFlush,
    /// Where the next frame goes: the end of the last acknowledged frame.
    offset: u64,
    /// The journal's size; everything from `offset` on is zeros.
    capacity: u64,
    /// A write or flush failed (or a compaction's directory flush did): compact before the next
    /// frame is appended.
    needs_compaction: bool,
    /// Changes made since the store was opened: lets a loop that follows the records (the
    /// ledger's, every 10 ms) tell in one load that nothing changed.
    changes: u64,
    /// Bumped by every change to what the records hold ([`Store::holdings`]: a record made or
    /// released, its devices or limits changed), whoever made it; not by a change that leaves
    /// them as they were (a container named). The controller follows it to publish the holdings
    /// with its view.
    held: Arc<tokio::sync::watch::Sender<u64>>,
    /// Set while the store is locked through [`Store::lock_telling_after`]: a change to what the
    /// records hold is told when that lock is let go, not at once (`held_pending` says one was
    /// made).
    hold_back: bool,
    held_pending: bool,
    /// Held for the store's life: the exclusive lock on `<dir>/lock`.
    _lock: File,
}

impl Store {
    /// Opens the store in `dir` (see [`Store::open_with_dirs`]), with nothing to recover lost
    /// records from.
    pub fn open(dir: &Path) -> Result<Store, StateError> {
        Store::open_inner(dir, None)
    }

    /// Opens the store in `dir`, creating the directory (mode 0700) if needed, replays the journal
    /// and loads any legacy record files. Leftover temporary files are deleted (see
    /// [`Store::removed_tmp`]); journal damage and unreadable legacy records are set aside with an
    /// error logged that names them (see [`Store::set_aside`]). When the journal lost data, every
    /// allocation directory in `dirs` it holds no record for is read back into one (see
    /// [`super::recover`] and [`Store::loss`]).
    ///
    /// The journal is compacted only when it needs to be (damage, a torn write, no header, legacy
    /// files, or a file far larger than its records need); a compaction that fails (a full disk)
    /// does not stop the open: a whole journal is written on in place, and a damaged one is kept
    /// until a later change can compact it. Fails on other I/O errors, when the journal does not
    /// exist and cannot be made, and when another process holds the store.
    pub fn open_with_dirs(dir: &Path, dirs: &AllocDirs) -> Result<Store, StateError> {
        Store::open_inner(dir, Some(dirs))
    }

    fn open_inner(dir: &Path, dirs: Option<&AllocDirs>) -> Result<Store, StateError> {
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

        let names = file_names(dir)?;
        let mut removed_tmp = Vec::new();
        let mut set_aside = Vec::new();
        for name in names.iter().filter(|n| *n == journal::TMP_NAME || n.ends_with(LEGACY_TMP_EXT)) {
            // A write that never committed: a compaction whose rename did not happen (the journal
            // is whole), or a legacy record write whose rename did not.
            let path = dir.join(name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&path, "remove leftover temporary file")(e)),
            }
            tracing::info!(file = %path.display(), "removed an uncommitted temporary file");
            removed_tmp.push(path);
        }

        let journal_path = dir.join(journal::FILE_NAME);
        let existing = match OpenOptions::new().read(true).write(true).open(&journal_path) {
            Ok(f) => Some(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_err(&journal_path, "open")(e)),
        };
        let mut replay = match &existing {
            Some(f) => journal::scan_file(f).map_err(io_err(&journal_path, "read"))?,
            None => journal::Replay::default(),
        };
        if existing.is_some()
            && let Some(d) = journal::file_damage(&replay)
        {
            replay.torn = None;
            replay.damage.push(d);
        }
        let mut index = BTreeMap::new();
        let records_read = replay.puts();
        let removed = apply(&mut index, std::mem::take(&mut replay.ops));
        if let Some(at) = replay.torn {
            tracing::info!(file = %journal_path.display(), offset = at, "dropped a journal write cut short by a crash");
        }
        let damaged = !replay.damage.is_empty();
        let mut loss = None;
        if damaged {
            let copy = keep_copy(dir, &journal_path, &names)?;
            for damage in &replay.damage {
                tracing::error!(
                    file = %journal_path.display(),
                    offset = damage.offset,
                    copy = %copy.display(),
                    "damaged allocation journal {} at {damage}; the journal as found is kept as {}",
                    journal_path.display(),
                    copy.display()
                );
                set_aside.push(SetAside {
                    file: journal_path.clone(),
                    moved_to: copy.clone(),
                    reason: damage.to_string(),
                });
            }
            let mut l = Loss { read: index.len(), snapshot: replay.header.map(|h| h.records), copy, ..Loss::default() };
            if let Some(dirs) = dirs {
                recover_into(&mut index, &removed, dirs, &mut l);
            }
            tracing::error!(
                file = %journal_path.display(),
                records_read,
                kept = l.read,
                snapshot_records = l.snapshot.unwrap_or(0),
                recovered = l.recovered.len(),
                unreadable = l.unreadable.len(),
                "the allocation journal {} lost data: {} record(s) read from it{}; {} recovered from their \
                 allocation directories{}; {} directories unreadable; the journal as found is kept as {}",
                journal_path.display(),
                l.read,
                l.snapshot.map(|n| format!(" (its last snapshot held {n})")).unwrap_or_default(),
                l.recovered.len(),
                dirs.map(|d| format!(" under {}", d.root().display())).unwrap_or_else(|| " (none given)".into()),
                l.unreadable.len(),
                l.copy.display()
            );
            loss = Some(l);
        }
        // No journal at all while allocation directories remain: it was deleted or moved away (a
        // first start finds no directories). What it held is lost as a damaged journal's is, and
        // rebuilt from the directories the same way; loaded as empty, their devices were handed
        // out again.
        if existing.is_none()
            && let Some(dirs) = dirs
            && dirs.ids().is_ok_and(|ids| !ids.is_empty())
        {
            let mut l = Loss { copy: journal_path.clone(), ..Loss::default() };
            recover_into(&mut index, &removed, dirs, &mut l);
            tracing::error!(
                file = %journal_path.display(),
                recovered = l.recovered.len(),
                unreadable = l.unreadable.len(),
                "the allocation journal {} is missing while allocation directories remain under {}: {} allocation(s) \
                 recovered from them, {} unreadable",
                journal_path.display(),
                dirs.root().display(),
                l.recovered.len(),
                l.unreadable.len()
            );
            loss = Some(l);
        }
        // A release the journal holds whose directory is still there: the daemon stopped (kill -9)
        // between the two. Its removal is finished now; left, its region mounts stayed for good.
        if let Some(dirs) = dirs {
            for id in removed.iter().filter(|id| !index.contains_key(*id) && dirs.dir(id).is_dir()) {
                match dirs.remove(id) {
                    Ok(_) => tracing::info!(%id, "removed the directory of an allocation released before a restart"),
                    Err(e) => tracing::warn!(%id, error = %e, "cannot remove the directory of a released allocation"),
                }
            }
        }

        // Legacy record files: into the index (the journal's record wins), deleted once the
        // compaction below has put them in the journal.
        let mut legacy = Vec::new();
        for name in &names {
            let path = dir.join(name);
            let Some(id) = name.strip_suffix(RECORD_EXT) else {
                if !ours(name) {
                    tracing::warn!(file = %path.display(), "ignoring a file that is not an allocation record");
                }
                continue;
            };
            let bytes = std::fs::read(&path).map_err(io_err(&path, "read"))?;
            match parse_record(id, &bytes) {
                Ok(record) => {
                    if index.contains_key(id) {
                        tracing::info!(file = %path.display(), "legacy record file also in the journal; the journal's kept");
                    } else {
                        index.insert(id.to_string(), record);
                    }
                    legacy.push(path);
                }
                Err(reason) => {
                    let moved_to = move_aside(&path)?;
                    tracing::error!(
                        file = %path.display(),
                        moved_to = %moved_to.display(),
                        "corrupt allocation record {}: {reason}; moved aside to {}",
                        path.display(),
                        moved_to.display()
                    );
                    set_aside.push(SetAside { file: path, moved_to, reason });
                }
            }
        }

        // Compact only when needed: a clean journal is written on in place, so a restart needs
        // no free space.
        let live: u64 = index.values().map(|a| journal::encode(&OpRef::Put(a)).map_or(0, |f| f.len() as u64)).sum();
        let oversized = replay.len > journal::capacity_for(live).saturating_mul(4);
        let needs = damaged || replay.torn.is_some() || replay.header.is_none() || !legacy.is_empty() || oversized;
        let (journal, offset, capacity, needs_compaction) = match existing {
            Some(file) if !needs => (file, replay.end, replay.len, false),
            existing => match write_snapshot(dir, index.values(), 0) {
                Ok((file, offset, capacity)) => {
                    // The directory fsync also makes the removals and renames above durable.
                    let synced = sync_dir(dir);
                    if synced.is_ok() && !legacy.is_empty() {
                        for path in &legacy {
                            match std::fs::remove_file(path) {
                                Ok(()) => {}
                                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                                Err(e) => return Err(io_err(path, "remove migrated legacy record")(e)),
                            }
                        }
                        sync_dir(dir)?;
                        tracing::info!(dir = %dir.display(), records = legacy.len(), "moved legacy record files into the journal");
                    }
                    if let Err(e) = &synced {
                        tracing::warn!(error = %e, "the compacted journal is compacted again before the next change");
                    }
                    (file, offset, capacity, synced.is_err())
                }
                Err(e) => {
                    let Some(file) = existing else { return Err(e) };
                    if damaged || !legacy.is_empty() {
                        // Nothing may be appended after damage: every change compacts first, and
                        // fails (naming why) until it can.
                        tracing::error!(
                            file = %journal_path.display(),
                            "cannot rewrite the allocation journal: {e}; its records are kept in memory and \
                             written by the first change that can compact it; until then changes fail"
                        );
                        (file, replay.end, replay.len, true)
                    } else {
                        // A whole journal: write on after its last frame, a torn write zeroed first.
                        if let Some(at) = replay.torn {
                            let to = replay.len.min(at + (journal::HEADER_LEN + journal::MAX_PAYLOAD) as u64);
                            journal::zero_fill(&file, at, to)
                                .and_then(|()| file.sync_data())
                                .map_err(io_err(&journal_path, "zero a torn write"))?;
                        }
                        tracing::warn!(
                            file = %journal_path.display(),
                            "cannot compact the allocation journal at start: {e}; writing on in place"
                        );
                        (file, replay.end, replay.len, false)
                    }
                }
            },
        };
        Ok(Store {
            dir: dir.to_path_buf(),
            loads: Loads::of(index.values()),
            holders: Holders::of(index.values()),
            index,
            set_aside,
            removed_tmp,
            loss,
            journal: Arc::new(journal),
            flush: JournalFlush::default(),
            offset,
            capacity,
            needs_compaction,
            changes: 0,
            held: Arc::new(tokio::sync::watch::Sender::new(0)),
            hold_back: false,
            held_pending: false,
            _lock: lock,
        })
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What [`Store::open`] set aside: legacy record files moved aside as corrupt, and damaged
    /// stretches of the journal (each with the journal's copy).
    pub fn set_aside(&self) -> &[SetAside] {
        &self.set_aside
    }

    /// What a damaged journal lost at [`Store::open`], and what was recovered; `None` when nothing.
    pub fn loss(&self) -> Option<&Loss> {
        self.loss.as_ref()
    }

    /// The uncommitted temporary files [`Store::open`] deleted.
    pub fn removed_tmp(&self) -> &[PathBuf] {
        &self.removed_tmp
    }

    /// Adds a record, durably; refuses an id already stored.
    pub fn insert(&mut self, alloc: &Allocation) -> Result<(), StateError> {
        self.insert_with(alloc, Flush::Now)
    }

    /// Adds a record whose frame is written now and flushed a moment later, off the caller's way
    /// (a group flush, [`super::journal_flush`]): for the kubelet's `Allocate` only, whose answer
    /// the kubelet keeps durably itself. A `kill -9` loses nothing (the frame is written); a power
    /// cut before the flush may lose it, and the kubelet's checkpoint brings it back.
    pub fn insert_flushed_soon(&mut self, alloc: &Allocation) -> Result<(), StateError> {
        self.insert_with(alloc, Flush::Soon)
    }

    fn insert_with(&mut self, alloc: &Allocation, flush: Flush) -> Result<(), StateError> {
        valid_id(&alloc.id).map_err(|reason| StateError::InvalidId { id: alloc.id.clone(), reason })?;
        if self.index.contains_key(&alloc.id) {
            return Err(StateError::Duplicate { id: alloc.id.clone(), path: self.journal_path() });
        }
        self.append(&OpRef::Put(alloc), &alloc.id, Change::Insert, flush)?;
        self.loads.add(alloc);
        self.holders.add(alloc);
        self.index.insert(alloc.id.clone(), alloc.clone());
        self.changed(true);
        Ok(())
    }

    /// Replaces a stored record (same id) with `alloc`, durably and atomically: after a crash the
    /// old record or the new one is found, never neither.
    pub fn update(&mut self, alloc: &Allocation) -> Result<(), StateError> {
        if !self.index.contains_key(&alloc.id) {
            return Err(StateError::NotFound { id: alloc.id.clone(), path: self.journal_path() });
        }
        self.append(&OpRef::Put(alloc), &alloc.id, Change::Update, Flush::Now)?;
        self.loads.add(alloc);
        let mut held = true;
        if let Some(old) = self.index.insert(alloc.id.clone(), alloc.clone()) {
            self.loads.remove(&old);
            self.holders.remove(&old);
            held = old.devices != alloc.devices || old.source != alloc.source || old.resource != alloc.resource;
        }
        self.holders.add(alloc);
        self.changed(held);
        Ok(())
    }

    /// Removes a record, durably; returns it, or `None` if there was none.
    pub fn remove(&mut self, id: &str) -> Result<Option<Allocation>, StateError> {
        if !self.index.contains_key(id) {
            return Ok(None);
        }
        self.append(&OpRef::Remove(id), id, Change::Remove, Flush::Now)?;
        let removed = self.index.remove(id);
        if let Some(old) = &removed {
            self.loads.remove(old);
            self.holders.remove(old);
            self.changed(true);
        }
        Ok(removed)
    }

    /// Counts a change; `held`: it changed what the records hold.
    fn changed(&mut self, held: bool) {
        self.changes += 1;
        if held && self.hold_back {
            self.held_pending = true;
        } else if held {
            self.held.send_modify(|n| *n += 1);
        }
    }

    /// How many changes (inserts, updates, removals) were made since the store was opened.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Told of every change to what the records hold (see [`Store::holdings`]).
    pub fn holdings_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.held.subscribe()
    }

    /// What the records hold now, per physical device and holder, and the kubelet's devices
    /// (a copy: O(devices held), no scan of the records).
    pub fn holdings(&self) -> crate::holdings::Holdings {
        crate::holdings::Holdings { devices: self.loads.per_holder(), kubelet_devices: self.holders.kubelet_devices() }
    }

    pub fn get(&self, id: &str) -> Option<&Allocation> {
        self.index.get(id)
    }

    /// What the records hold per physical device (admission reads this, not every record).
    pub fn loads(&self) -> &Loads {
        &self.loads
    }

    /// The records holding any of `device_ids` (exact device ids), each once, in id order.
    pub fn holding<'a>(
        &'a self,
        device_ids: impl IntoIterator<Item = &'a str>,
    ) -> impl Iterator<Item = &'a Allocation> {
        self.holders.holding(device_ids).into_iter().filter_map(|id| self.index.get(id))
    }

    /// Whether a kubelet record of `resource` holds device `device_id` (one lookup).
    pub fn kubelet_holds(&self, device_id: &str, resource: &str) -> bool {
        self.holders.kubelet_holds(device_id, resource)
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

    fn journal_path(&self) -> PathBuf {
        self.dir.join(journal::FILE_NAME)
    }

    /// One frame at the journal's end, then fdatasync (now, or by the group flush: `flush`);
    /// compacts first when it does not fit (or a write or flush failed before). The caller
    /// updates the index once this returns `Ok`.
    fn append(&mut self, op: &OpRef<'_>, id: &str, change: Change, flush: Flush) -> Result<(), StateError> {
        let path = self.journal_path();
        let frame = journal::encode(op).map_err(|reason| StateError::Encode {
            id: id.to_string(),
            path: path.clone(),
            reason,
        })?;
        let len = frame.len() as u64;
        if self.flush.take_failure() {
            self.needs_compaction = true;
        }
        if self.needs_compaction || self.offset + len > self.capacity {
            self.compact(len)?;
        }
        let at = self.offset;
        let written = self.journal.write_all_at(&frame, at).map_err(io_err(&path, change.write_op())).and_then(|()| {
            match flush {
                Flush::Now => self.journal.sync_data(),
                Flush::Soon => self.flush.request(&self.journal, &path),
            }
            .map_err(io_err(&path, change.sync_op()))
        });
        if let Err(e) = written {
            // Not acknowledged: unwrite what may be there, and start the next change on a fresh
            // file (the compaction) rather than trust this one's tail.
            let _ = journal::zero_fill(&self.journal, at, at + len);
            self.needs_compaction = true;
            tracing::debug!(file = %path.display(), "{e}; the journal is compacted before the next change");
            return Err(e);
        }
        self.offset += len;
        Ok(())
    }

    /// Rewrites the journal as the live records, with room for `reserve` more bytes of frames.
    fn compact(&mut self, reserve: u64) -> Result<(), StateError> {
        let (file, offset, capacity) = write_snapshot(&self.dir, self.index.values(), reserve)?;
        // The new file is the journal now (renamed into place): write there from here on, and
        // compact again if the rename is not known to be durable.
        self.journal = Arc::new(file);
        self.offset = offset;
        self.capacity = capacity;
        self.needs_compaction = true;
        sync_dir(&self.dir)?;
        self.needs_compaction = false;
        tracing::debug!(file = %self.journal_path().display(), records = self.index.len(), bytes = offset, capacity, "journal compacted");
        Ok(())
    }
}

/// Reads the records of the store in `dir` without taking its lock and without writing anything:
/// the journal replayed (damage skipped as [`Store::open`] would, and logged), plus any legacy
/// `<id>.json` records it does not hold. By id. For inspection, and for a reader beside the daemon.
pub fn read_records(dir: &Path) -> Result<Vec<Allocation>, StateError> {
    let names = file_names(dir)?;
    let journal_path = dir.join(journal::FILE_NAME);
    let replay = match File::open(&journal_path) {
        Ok(f) => {
            let mut replay = journal::scan_file(&f).map_err(io_err(&journal_path, "read"))?;
            replay.damage.extend(journal::file_damage(&replay));
            replay
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => journal::Replay::default(),
        Err(e) => return Err(io_err(&journal_path, "open")(e)),
    };
    for damage in &replay.damage {
        tracing::warn!(file = %journal_path.display(), "damaged allocation journal at {damage}");
    }
    let mut index = BTreeMap::new();
    apply(&mut index, replay.ops);
    for name in &names {
        let Some(id) = name.strip_suffix(RECORD_EXT) else { continue };
        let path = dir.join(name);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            // Moved into the journal (by the owner's open) since the listing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(&path, "read")(e)),
        };
        match parse_record(id, &bytes) {
            Ok(record) => {
                index.entry(id.to_string()).or_insert(record);
            }
            Err(reason) => tracing::warn!(file = %path.display(), "corrupt allocation record: {reason}"),
        }
    }
    Ok(index.into_values().collect())
}

/// Replays `ops` into `index`; returns the ids the replay removed last (their directories, if a
/// crash left them, are not allocations any more).
fn apply(index: &mut BTreeMap<String, Allocation>, ops: Vec<Op>) -> BTreeSet<String> {
    let mut removed = BTreeSet::new();
    for op in ops {
        match op {
            Op::Put(record) => {
                removed.remove(&record.id);
                index.insert(record.id.clone(), record);
            }
            Op::Remove(id) => {
                index.remove(&id);
                removed.insert(id);
            }
            Op::Header(_) => {}
        }
    }
    removed
}

/// Adds a record for every allocation directory in `dirs` that `index` lacks and the journal did
/// not remove, read back from it.
fn recover_into(
    index: &mut BTreeMap<String, Allocation>,
    removed: &BTreeSet<String>,
    dirs: &AllocDirs,
    loss: &mut Loss,
) {
    let ids = match dirs.ids() {
        Ok(ids) => ids,
        Err(e) => {
            tracing::error!(dir = %dirs.root().display(), error = %e, "cannot list the allocation directories");
            loss.unreadable.push((String::new(), e.to_string()));
            return;
        }
    };
    let missing: Vec<String> = ids.into_iter().filter(|id| !index.contains_key(id) && !removed.contains(id)).collect();
    for id in missing {
        match super::recover::from_dir(dirs, &id) {
            Ok(record) => {
                tracing::warn!(%id, dir = %dirs.dir(&id).display(), "allocation recovered from its directory");
                loss.recovered.push(id.clone());
                index.insert(id, record);
            }
            Err(reason) => {
                tracing::error!(%id, dir = %dirs.dir(&id).display(), "cannot recover the allocation from its directory: {reason}");
                loss.unreadable.push((id, reason));
            }
        }
    }
}

#[path = "store_telling.rs"]
mod telling;
pub use telling::TellingAfter;

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
