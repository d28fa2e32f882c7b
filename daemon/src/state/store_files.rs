//! The store's whole files in its directory: the names found there (which are the store's own),
//! a compacted journal written beside the old one and renamed over it, a damaged journal kept as
//! found, and the legacy `<id>.json` records read back.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::{CORRUPT_EXT, DYNAMIC_MIG_FILE, EVENTS_FILE, LEGACY_TMP_EXT, LOCK_FILE, RECORD_EXT, StateError, io_err};
use crate::state::journal::{self, OpRef};
use crate::state::record::{Allocation, unix_ns, valid_id};

/// The names in `dir`, sorted (a non-UTF-8 name is logged and skipped: none is ours).
pub(super) fn file_names(dir: &Path) -> Result<Vec<String>, StateError> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir, "read directory"))? {
        let entry = entry.map_err(io_err(dir, "read directory"))?;
        match entry.file_name().into_string() {
            Ok(name) => names.push(name),
            Err(name) => {
                tracing::warn!(dir = %dir.display(), "ignoring a file with a non-UTF-8 name: {}", name.to_string_lossy())
            }
        }
    }
    names.sort();
    Ok(names)
}

/// Whether `name` (not a `.json` record) is one of the store's own files (or was: the temporary
/// files are gone by the time this is asked).
pub(super) fn ours(name: &str) -> bool {
    // The daemon's other state shares the directory: the driver directories (`crate::cdi`), the
    // kept events (and their damaged or half-written copies), the DRA driver's dynamic MIG
    // journal (and its damaged copies), the context sizes measured (`enforcement::context_size`,
    // one file per driver version, and damaged copies). Named "not an allocation record" at
    // every start before.
    name == tessera_region::paths::DRIVER_DIRS
        || name.starts_with(tessera_region::context_sizes::CONTEXT_SIZES_FILE)
        || name.starts_with(EVENTS_FILE)
        || name.starts_with(DYNAMIC_MIG_FILE)
        || name == LOCK_FILE
        || name == journal::FILE_NAME
        || name == journal::TMP_NAME
        || name.ends_with(LEGACY_TMP_EXT)
        || name.starts_with(journal::CORRUPT_PREFIX)
        || name.contains(&format!("{RECORD_EXT}{CORRUPT_EXT}"))
}

/// Writes `records` as the journal: `allocations.journal.tmp`, one put frame each, zeros to the
/// capacity for them and `reserve` more bytes, fsync, renamed over the journal. Returns the file
/// (open for writing), the frames' end and the capacity. The caller fsyncs the directory.
pub(super) fn write_snapshot<'a>(
    dir: &Path,
    records: impl Iterator<Item = &'a Allocation>,
    reserve: u64,
) -> Result<(File, u64, u64), StateError> {
    let journal_path = dir.join(journal::FILE_NAME);
    let tmp = dir.join(journal::TMP_NAME);
    let mut frames = Vec::new();
    let mut records_n = 0;
    for record in records {
        records_n += 1;
        let frame = journal::encode(&OpRef::Put(record)).map_err(|reason| StateError::Encode {
            id: record.id.clone(),
            path: journal_path.clone(),
            reason,
        })?;
        frames.extend(frame);
    }
    let header = journal::Header { records: records_n, bytes: frames.len() as u64 };
    let mut head = journal::encode(&OpRef::Header(header)).map_err(|reason| StateError::Encode {
        id: String::new(),
        path: journal_path.clone(),
        reason,
    })?;
    head.extend(frames);
    let frames = head;
    let end = frames.len() as u64;
    let capacity = journal::capacity_for(end.saturating_add(reserve));
    let written = (|| {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err(&tmp, "create"))?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600)).map_err(io_err(&tmp, "chmod 0600"))?;
        file.write_all_at(&frames, 0).map_err(io_err(&tmp, "write"))?;
        journal::zero_fill(&file, end, capacity).map_err(io_err(&tmp, "zero-fill"))?;
        file.sync_all().map_err(io_err(&tmp, "fsync"))?;
        std::fs::rename(&tmp, &journal_path)
            .map_err(io_err(&journal_path, "rename the compacted journal into place"))?;
        Ok(file)
    })();
    match written {
        Ok(file) => Ok((file, end, capacity)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Keeps the damaged journal as found: `allocations.journal.corrupt-<unix-ns>`, a hard link to it
/// (no space needed, whatever its size; the compaction then renames a new journal over the old
/// name), or a byte copy where links are refused. An earlier copy that is this very file (an open
/// that could not compact) is reused.
pub(super) fn keep_copy(dir: &Path, journal_path: &Path, names: &[String]) -> Result<PathBuf, StateError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(journal_path).map_err(io_err(journal_path, "stat"))?;
    for name in names.iter().filter(|n| n.starts_with(journal::CORRUPT_PREFIX)) {
        let path = dir.join(name);
        if std::fs::metadata(&path).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino()) {
            return Ok(path);
        }
    }
    let base = format!("{}{}", journal::CORRUPT_PREFIX, unix_ns());
    let mut n = 0;
    loop {
        let name = if n == 0 { base.clone() } else { format!("{base}.{n}") };
        let path = dir.join(name);
        if path.symlink_metadata().is_ok() {
            n += 1;
            continue;
        }
        match std::fs::hard_link(journal_path, &path) {
            Ok(()) => {
                sync_dir(dir)?;
                return Ok(path);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => n += 1,
            Err(e) => {
                tracing::warn!(file = %journal_path.display(), error = %e, "cannot link the damaged journal; copying it");
                std::fs::copy(journal_path, &path)
                    .and_then(|_| File::open(&path)?.sync_all())
                    .map_err(io_err(&path, "copy the damaged journal"))?;
                sync_dir(dir)?;
                return Ok(path);
            }
        }
    }
}

pub(super) fn sync_dir(dir: &Path) -> Result<(), StateError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir, "fsync directory"))
}

/// Renames `path` to `<path>.corrupt` (or `.corrupt.N` if that is taken).
pub(super) fn move_aside(path: &Path) -> Result<PathBuf, StateError> {
    crate::state::durable::move_aside(path).map_err(io_err(path, "move corrupt record aside"))
}

/// A legacy record file's contents, checked against its file name.
pub(super) fn parse_record(file_id: &str, bytes: &[u8]) -> Result<Allocation, String> {
    valid_id(file_id)?;
    let record: Allocation = serde_json::from_slice(bytes).map_err(|e| format!("not a valid record: {e}"))?;
    if record.id != file_id {
        return Err(format!("the record's id {:?} differs from its file name", record.id));
    }
    Ok(record)
}
