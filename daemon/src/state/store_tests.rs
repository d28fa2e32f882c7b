use std::os::unix::fs::MetadataExt;

use super::*;

use crate::state::record::tests::sample;

/// A record of about 2 KB, to fill the journal with fewer writes.
fn big(id: &str) -> Allocation {
    let mut a = sample(id);
    a.container.pod_uid = Some("u".repeat(2000));
    a
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    v.sort();
    v
}

fn ids<'a>(records: impl IntoIterator<Item = &'a Allocation>) -> Vec<String> {
    records.into_iter().map(|a| a.id.clone()).collect()
}

fn journal_meta(dir: &Path) -> std::fs::Metadata {
    std::fs::metadata(dir.join(journal::FILE_NAME)).unwrap()
}

/// The journal's bytes and where its frames start (walking the headers).
fn frames(dir: &Path) -> (Vec<u8>, Vec<usize>) {
    let bytes = std::fs::read(dir.join(journal::FILE_NAME)).unwrap();
    let (mut offsets, mut at) = (Vec::new(), 0);
    while at + journal::HEADER_LEN <= bytes.len() && bytes[at..at + 4] == journal::MAGIC.to_le_bytes() {
        offsets.push(at);
        at += journal::HEADER_LEN + u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
    }
    // The header frame every compaction writes first is not a change.
    assert_eq!(offsets.first(), Some(&0), "a header frame at offset 0");
    assert!(bytes[journal::HEADER_LEN..].starts_with(b"{\"header\":"), "a header frame at offset 0");
    offsets.remove(0);
    (bytes, offsets)
}

/// A store in `<tmp>/state` holding `ids` (inserted in order), closed.
fn store_with(ids: &[&str]) -> (crate::state::mount::TestDir, PathBuf) {
    let tmp = crate::state::mount::TestDir::new();
    let dir = tmp.path().join("state");
    let mut s = Store::open(&dir).unwrap();
    for id in ids {
        s.insert(&sample(id)).unwrap();
    }
    (tmp, dir)
}

#[test]
fn insert_get_list_remove_and_reopen() {
    let tmp = crate::state::mount::TestDir::new();
    let dir = tmp.path().join("state");
    let mut s = Store::open(&dir).unwrap();
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    assert!(s.is_empty());
    s.insert(&sample("b")).unwrap();
    s.insert(&sample("a")).unwrap();
    assert_eq!(s.get("a"), Some(&sample("a")));
    assert_eq!(ids(s.list()), ["a", "b"]);
    let err = s.insert(&sample("a")).unwrap_err();
    assert!(matches!(err, StateError::Duplicate { .. }), "{err}");
    assert!(err.to_string().contains("allocations.journal: allocation \"a\" already exists"), "{err}");
    assert_eq!(s.remove("b").unwrap(), Some(sample("b")));
    assert_eq!(s.remove("b").unwrap(), None);
    let mut changed = sample("a");
    changed.devices[0].sm_percent = Some(10);
    s.update(&changed).unwrap();
    assert!(matches!(s.update(&sample("zz")), Err(StateError::NotFound { .. })));
    assert_eq!(read_records(&dir).unwrap(), [changed.clone()], "a reader beside the owner");
    drop(s);

    assert_eq!(files(&dir), ["allocations.journal", "lock"]);
    let meta = journal_meta(&dir);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), journal::MIN_CAPACITY, "preallocated");
    // The changes are frames from offset 0, zeros after them.
    let (bytes, offsets) = frames(&dir);
    assert_eq!(offsets.len(), 4);
    let replay = journal::scan(&bytes);
    assert!(bytes[replay.end as usize..].iter().all(|&b| b == 0));
    let inode = meta.ino();
    let mut s = Store::open(&dir).unwrap();
    assert_eq!(s.list().cloned().collect::<Vec<_>>(), [changed.clone()]);
    assert!(s.set_aside().is_empty() && s.removed_tmp().is_empty() && s.loss().is_none());
    // A whole journal is not compacted at open (a restart needs no free space): written on.
    assert_eq!(journal_meta(&dir).ino(), inode);
    s.insert(&sample("c")).unwrap();
    drop(s);
    assert_eq!(journal_meta(&dir).ino(), inode);
    assert_eq!(frames(&dir).1.len(), 5);
    assert_eq!(ids(&read_records(&dir).unwrap()), ["a", "c"]);
}

#[test]
fn a_lock_telling_after_tells_the_holdings_change_once_it_is_let_go() {
    let tmp = crate::state::mount::TestDir::new();
    let store = std::sync::Mutex::new(Store::open(&tmp.path().join("state")).unwrap());
    let mut told = store.lock().unwrap().holdings_changes();
    told.borrow_and_update();
    {
        let mut s = Store::lock_telling_after(&store);
        s.insert(&sample("a")).unwrap();
        s.insert(&sample("b")).unwrap();
        assert!(s.remove("b").unwrap().is_some());
        assert!(!told.has_changed().unwrap(), "not told while the lock is held");
    }
    assert!(told.has_changed().unwrap(), "told once let go");
    told.borrow_and_update();
    // A plain lock tells at once again; a lock telling after that changes nothing tells nothing.
    store.lock().unwrap().insert(&sample("c")).unwrap();
    assert!(told.has_changed().unwrap());
    told.borrow_and_update();
    drop(Store::lock_telling_after(&store));
    assert!(!told.has_changed().unwrap());
    // One released early (an error path's `?`) still tells what it changed.
    let early = || -> Result<(), StateError> {
        let mut s = Store::lock_telling_after(&store);
        s.remove("c")?;
        s.insert(&sample("a"))?;
        Ok(())
    };
    assert!(matches!(early(), Err(StateError::Duplicate { .. })));
    assert!(told.has_changed().unwrap());
    assert_eq!(ids(store.lock().unwrap().list()), ["a"]);
}

#[test]
fn bad_ids_are_refused() {
    let tmp = crate::state::mount::TestDir::new();
    let mut s = Store::open(tmp.path()).unwrap();
    for bad in ["", "../escape", "a.b"] {
        let err = s.insert(&sample(bad)).unwrap_err();
        assert!(matches!(err, StateError::InvalidId { .. }), "{err}");
    }
    assert!(s.is_empty());
    assert_eq!(files(tmp.path()), ["allocations.journal", "lock"]);
    assert!(frames(tmp.path()).1.is_empty(), "nothing written");
}

#[test]
fn a_second_owner_is_refused() {
    let tmp = crate::state::mount::TestDir::new();
    let s = Store::open(tmp.path()).unwrap();
    let err = Store::open(tmp.path()).unwrap_err();
    assert!(matches!(err, StateError::Locked { .. }), "{err}");
    assert!(err.to_string().contains("lock"), "{err}");
    drop(s);
    Store::open(tmp.path()).unwrap();
}

#[test]
fn a_torn_last_write_is_dropped_and_nothing_set_aside() {
    // The last frame's second half never reached the disk.
    let (_tmp, dir) = store_with(&["a", "b", "c"]);
    let (mut bytes, offsets) = frames(&dir);
    let end = journal::scan(&bytes).end as usize;
    bytes[(offsets[2] + end) / 2..end].fill(0);
    std::fs::write(dir.join(journal::FILE_NAME), &bytes).unwrap();
    let s = Store::open(&dir).unwrap();
    assert_eq!(ids(s.list()), ["a", "b"]);
    assert!(s.set_aside().is_empty(), "{:?}", s.set_aside());
    assert_eq!(files(&dir), ["allocations.journal", "lock"]);
    drop(s);

    // A partial frame after the last one, zeros after it.
    let (_tmp, dir) = store_with(&["a", "b", "c"]);
    let (mut bytes, _) = frames(&dir);
    let end = journal::scan(&bytes).end as usize;
    let d = journal::encode(&OpRef::Put(&sample("d"))).unwrap();
    bytes[end..end + d.len() / 3].copy_from_slice(&d[..d.len() / 3]);
    std::fs::write(dir.join(journal::FILE_NAME), &bytes).unwrap();
    let mut s = Store::open(&dir).unwrap();
    assert_eq!(ids(s.list()), ["a", "b", "c"]);
    assert!(s.set_aside().is_empty(), "{:?}", s.set_aside());
    // The tail is clean again: the next write lands whole and replays.
    s.insert(&sample("e")).unwrap();
    drop(s);
    let s = Store::open(&dir).unwrap();
    assert_eq!(ids(s.list()), ["a", "b", "c", "e"]);
    assert!(s.set_aside().is_empty());
    drop(s);
}

/// A store in `<tmp>/state` holding `ids`, each with its allocation directory under
/// `<tmp>/run`, closed; and those directories.
fn store_and_dirs(ids: &[&str]) -> (crate::state::mount::TestDir, PathBuf, AllocDirs) {
    let (tmp, dir) = store_with(ids);
    std::fs::create_dir(tmp.path().join("run")).unwrap();
    let dirs = AllocDirs::new(&tmp.path().join("run"));
    for id in ids {
        dirs.create(&sample(id)).unwrap();
    }
    (tmp, dir, dirs)
}

/// Damages the journal with `damage`, reopens with the directories, and checks that the loss
/// is reported with a copy of the journal as found, and that every record comes back (from the
/// journal or its directory): `read` from the journal, the rest recovered.
fn reopen_after(ids_in: &[&str], damage: impl FnOnce(&File, &[usize]), read: &[&str], reason: &str) {
    let (_tmp, dir, dirs) = store_and_dirs(ids_in);
    let path = dir.join(journal::FILE_NAME);
    let (_, offsets) = frames(&dir);
    damage(&OpenOptions::new().write(true).open(&path).unwrap(), &offsets);
    let found = std::fs::read(&path).unwrap();
    let s = Store::open_with_dirs(&dir, &dirs).unwrap();
    assert_eq!(s.set_aside().len(), 1, "{:?}", s.set_aside());
    assert!(s.set_aside()[0].reason.contains(reason), "{:?}", s.set_aside());
    let loss = s.loss().expect("the loss is reported");
    assert_eq!(loss.read, read.len(), "{loss:?}");
    let want_recovered: Vec<String> = ids_in.iter().filter(|id| !read.contains(id)).map(|id| id.to_string()).collect();
    assert_eq!(loss.recovered, want_recovered);
    assert!(loss.unreadable.is_empty(), "{loss:?}");
    assert_eq!(std::fs::read(&loss.copy).unwrap(), found, "the journal kept as found");
    assert_eq!(ids(s.list()), ids_in, "nothing dropped");
    for id in &want_recovered {
        let r = s.get(id).unwrap();
        assert_eq!((r.source, r.limits().devices), (crate::state::Source::Recovered, sample(id).limits().devices));
    }
    for id in read {
        assert_eq!(s.get(id), Some(&sample(id)), "read whole from the journal");
    }
    let copy = loss.copy.clone();
    drop(s);
    // Written into a fresh journal: the next open finds it whole, and the copy still there.
    let s = Store::open_with_dirs(&dir, &dirs).unwrap();
    assert!(s.loss().is_none() && s.set_aside().is_empty());
    assert_eq!(ids(s.list()), ids_in);
    assert_eq!(std::fs::read(&copy).unwrap(), found);
}

#[test]
fn a_truncated_journal_is_reported_and_its_allocations_recovered_from_their_directories() {
    // Cut inside c's frame, and cut to nothing but a's.
    reopen_after(&["a", "b", "c"], |f, o| f.set_len(o[2] as u64 + 20).unwrap(), &["a", "b"], "truncated");
    reopen_after(&["a", "b", "c"], |f, o| f.set_len(o[1] as u64).unwrap(), &["a"], "truncated");
}

#[test]
fn the_daemons_other_state_files_are_known_and_strangers_are_not() {
    for name in ["events.pb", "events.pb.corrupt", "events.pb.tmp-7", "dra-dynamic-mig.state", "lock", "driver"] {
        assert!(ours(name), "{name}");
    }
    assert!(ours("dra-dynamic-mig.state.damaged-1796000000"));
    assert!(ours("context-sizes-580.95.05") && ours("context-sizes-580.95.05.corrupt"));
    assert!(!ours("notes.txt") && !ours("events"));
}

#[test]
fn a_missing_journal_with_directories_left_is_a_loss_and_they_are_recovered() {
    let (_tmp, dir, dirs) = store_and_dirs(&["a", "b"]);
    std::fs::rename(dir.join(journal::FILE_NAME), dir.join("moved-away")).unwrap();
    let s = Store::open_with_dirs(&dir, &dirs).unwrap();
    let loss = s.loss().expect("reported: loaded as empty, its devices were handed out again");
    assert_eq!((loss.read, loss.recovered.clone()), (0, vec!["a".to_string(), "b".to_string()]));
    assert_eq!(ids(s.list()), ["a", "b"]);
    assert_eq!(s.get("a").unwrap().source, crate::state::Source::Recovered);
    drop(s);
    let s = Store::open_with_dirs(&dir, &dirs).unwrap();
    assert!(s.loss().is_none(), "written into a new journal");
    assert_eq!(ids(s.list()), ["a", "b"]);
    // A first start (no journal, no directories) is no loss.
    let (_tmp2, dir2) = store_with(&[]);
    std::fs::remove_file(dir2.join(journal::FILE_NAME)).ok();
    let empty = AllocDirs::new(&_tmp2.path().join("run"));
    assert!(Store::open_with_dirs(&dir2, &empty).unwrap().loss().is_none());
}

#[test]
fn a_release_cut_short_before_its_directory_went_is_finished_at_open() {
    let (_tmp, dir, dirs) = store_and_dirs(&["a", "b"]);
    let mut s = Store::open_with_dirs(&dir, &dirs).unwrap();
    // kill -9 between the removal's flush and the directory's removal.
    s.remove("a").unwrap();
    drop(s);
    assert!(dirs.dir("a").is_dir());
    let s = Store::open_with_dirs(&dir, &dirs).unwrap();
    assert!(s.loss().is_none());
    assert_eq!(ids(s.list()), ["b"]);
    assert!(!dirs.dir("a").exists(), "the release finished");
    assert!(dirs.dir("b").is_dir(), "a held allocation's directory is kept");
}

#[test]
fn an_empty_journal_is_reported_and_its_allocations_recovered() {
    reopen_after(&["a", "b"], |f, _| f.set_len(0).unwrap(), &[], "empty");
}

#[test]
fn a_zero_filled_journal_is_reported_and_its_allocations_recovered() {
    // All of it zeroed (a file system that lost its blocks).
    let zero_all = |f: &File, _: &[usize]| journal::zero_fill(f, 0, journal::MIN_CAPACITY).unwrap();
    reopen_after(&["a", "b", "c"], zero_all, &[], "zero-filled");
    // Only the tail of a compacted snapshot: the header says three records, two are left.
    let (_tmp, dir, dirs) = store_and_dirs(&["a", "b", "c"]);
    let mut s = Store::open(&dir).unwrap();
    s.compact(0).unwrap();
    drop(s);
    let (_, offsets) = frames(&dir);
    let f = OpenOptions::new().write(true).open(dir.join(journal::FILE_NAME)).unwrap();
    journal::zero_fill(&f, offsets[2] as u64, journal::MIN_CAPACITY).unwrap();
    let s = Store::open_with_dirs(&dir, &dirs).unwrap();
    let loss = s.loss().expect("the loss is reported");
    assert_eq!((loss.read, loss.snapshot, loss.recovered.clone()), (2, Some(3), vec!["c".to_string()]));
    assert!(s.set_aside()[0].reason.contains("snapshot of 3 records"), "{:?}", s.set_aside());
    assert_eq!(ids(s.list()), ["a", "b", "c"]);
}

#[test]
fn a_huge_sparse_journal_is_read_frame_by_frame() {
    // 1 TiB, mostly a hole, with one frame far into it: read whole, it could not fit in
    // memory; read a window at a time with the holes skipped, it opens at once.
    let (_tmp, dir, dirs) = store_and_dirs(&["a", "b", "d"]);
    let path = dir.join(journal::FILE_NAME);
    let (_, offsets) = frames(&dir);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    let far = 1u64 << 39;
    f.write_all_at(&journal::encode(&OpRef::Remove("b")).unwrap(), far).unwrap();
    journal::zero_fill(&f, offsets[2] as u64, journal::MIN_CAPACITY).unwrap();
    f.set_len(1 << 40).unwrap();
    drop(f);
    let s = Store::open_with_dirs(&dir, &dirs).unwrap();
    assert_eq!(ids(s.list()), ["a", "d"], "b removed by the frame after the hole; d from its directory");
    let loss = s.loss().unwrap();
    assert_eq!((loss.read, loss.recovered.clone()), (1, vec!["d".to_string()]));
    assert_eq!(
        s.set_aside()[0].reason,
        format!(
            "offset {}: no frame header (magic 0x00000000, not 0x314a54f7); replay resumed at the next whole frame, offset {far}",
            offsets[2]
        )
    );
    // Kept as a link, not a copy (no space needed); the journal rewritten small.
    assert_eq!(std::fs::metadata(&loss.copy).unwrap().len(), 1 << 40);
    assert_eq!(journal_meta(&dir).len(), journal::MIN_CAPACITY);
}

#[test]
fn garbage_in_the_middle_is_reported_and_what_it_hid_recovered() {
    reopen_after(
        &["a", "b", "c", "d"],
        |f, o| f.write_all_at(&[0x5a; 40], o[1] as u64 + 10).unwrap(),
        &["a", "c", "d"],
        "checksum",
    );
}

#[test]
fn damage_in_the_middle_is_set_aside_and_later_records_recovered() {
    let names: Vec<String> = (0..10).map(|i| format!("r{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let (_tmp, dir) = store_with(&refs);
    let mut updated = sample("r7");
    updated.devices[0].sm_percent = Some(10);
    {
        let mut s = Store::open(&dir).unwrap();
        s.remove("r5").unwrap();
        s.update(&updated).unwrap();
    }
    // Flip bytes inside r3's frame (the open compacted: one frame per record, by id).
    let (mut bytes, offsets) = frames(&dir);
    assert_eq!(offsets.len(), 12);
    let at = offsets[3] + journal::HEADER_LEN + 30;
    for b in &mut bytes[at..at + 4] {
        *b ^= 0xa5;
    }
    std::fs::write(dir.join(journal::FILE_NAME), &bytes).unwrap();

    let s = Store::open(&dir).unwrap();
    assert_eq!(ids(s.list()), ["r0", "r1", "r2", "r4", "r6", "r7", "r8", "r9"]);
    assert_eq!(s.get("r7"), Some(&updated), "the update after the damage is kept");
    assert_eq!(s.set_aside().len(), 1, "{:?}", s.set_aside());
    let aside = &s.set_aside()[0];
    assert_eq!(aside.file, dir.join(journal::FILE_NAME));
    let copy = aside.moved_to.file_name().unwrap().to_str().unwrap().to_string();
    assert!(copy.starts_with(journal::CORRUPT_PREFIX), "{copy}");
    assert!(aside.reason.starts_with(&format!("offset {}: ", offsets[3])), "{}", aside.reason);
    assert!(aside.reason.contains("checksum"), "{}", aside.reason);
    assert_eq!(std::fs::read(&aside.moved_to).unwrap(), bytes, "copied byte for byte");
    assert_eq!(files(&dir), ["allocations.journal".to_string(), copy.clone(), "lock".to_string()]);
    drop(s);
    // Compacted: nothing more to report.
    let s = Store::open(&dir).unwrap();
    assert!(s.set_aside().is_empty());
    assert_eq!(s.len(), 8);
    assert_eq!(files(&dir), ["allocations.journal".to_string(), copy, "lock".to_string()]);
}

#[test]
fn compaction_keeps_the_live_records_and_bounds_the_file() {
    let tmp = crate::state::mount::TestDir::new();
    let dir = tmp.path().join("state");
    let mut s = Store::open(&dir).unwrap();
    let mut live = std::collections::VecDeque::new();
    let (mut written, mut inode, mut compactions) = (0, journal_meta(&dir).ino(), 0);
    let mut i = 0;
    // Over 2.5 MB of frames through a 1 MiB file, 8 records live.
    while written < 5 * journal::MIN_CAPACITY / 2 {
        let id = format!("{i:016x}");
        i += 1;
        written += journal::encode(&OpRef::Put(&big(&id))).unwrap().len() as u64;
        s.insert(&big(&id)).unwrap();
        live.push_back(id);
        if live.len() > 8 {
            let old = live.pop_front().unwrap();
            written += journal::encode(&OpRef::Remove(&old)).unwrap().len() as u64;
            s.remove(&old).unwrap().unwrap();
        }
        let meta = journal_meta(&dir);
        assert_eq!(meta.len(), journal::MIN_CAPACITY);
        if meta.ino() != inode {
            inode = meta.ino();
            compactions += 1;
        }
    }
    assert!(compactions >= 2, "compacted {compactions} times");
    let want: Vec<String> = live.iter().cloned().collect();
    assert_eq!(ids(s.list()), want);
    assert_eq!(ids(&read_records(&dir).unwrap()), want);

    // 1.4 MB live: the file grows to 4 × that, in 64 KiB steps.
    for n in 0..700 {
        s.insert(&big(&format!("grow{n}"))).unwrap();
    }
    let live_bytes: u64 = s.list().map(|a| journal::encode(&OpRef::Put(a)).unwrap().len() as u64).sum();
    let size = journal_meta(&dir).len();
    assert_eq!(size % journal::CAPACITY_STEP, 0);
    assert!(size > journal::MIN_CAPACITY, "{size}");
    assert!(size <= 4 * live_bytes + journal::CAPACITY_STEP, "{size} for {live_bytes} live bytes");
    drop(s);
    let s = Store::open(&dir).unwrap();
    assert_eq!(s.len(), 708);
    assert!(s.set_aside().is_empty() && s.removed_tmp().is_empty());
    assert_eq!(journal_meta(&dir).len(), size, "not compacted at open: it fits");
}

#[test]
fn legacy_record_files_are_migrated() {
    let tmp = crate::state::mount::TestDir::new();
    let dir = tmp.path();
    let mut newer = sample("b");
    newer.devices[0].sm_percent = Some(5);
    {
        let mut s = Store::open(dir).unwrap();
        s.insert(&newer).unwrap();
    }
    let legacy = |a: &Allocation| {
        let mut bytes = serde_json::to_vec_pretty(a).unwrap();
        bytes.push(b'\n');
        bytes
    };
    std::fs::write(dir.join("a.json"), legacy(&sample("a"))).unwrap();
    std::fs::write(dir.join("b.json"), legacy(&sample("b"))).unwrap();
    std::fs::write(dir.join("bad.json"), b"{\"id\": \"bad\", \"resou").unwrap();
    std::fs::write(dir.join("empty.json"), b"").unwrap();
    // A whole record under another record's name is not trusted either.
    std::fs::write(dir.join("other.json"), legacy(&sample("renamed"))).unwrap();
    std::fs::write(dir.join("good.json.tmp"), b"{\"half\":").unwrap();
    std::fs::write(dir.join("bad.json.corrupt"), b"an older one").unwrap();
    std::fs::write(dir.join("events.pb"), b"not ours").unwrap();
    std::fs::create_dir(dir.join(tessera_region::paths::DRIVER_DIRS)).unwrap();
    std::fs::write(dir.join("driver/k.json"), b"a driver file").unwrap();
    let before = files(dir);
    // A reader sees what the owner will, and changes nothing.
    assert_eq!(read_records(dir).unwrap(), [sample("a"), newer.clone()]);
    assert_eq!(files(dir), before);

    let s = Store::open(dir).unwrap();
    assert_eq!(s.list().cloned().collect::<Vec<_>>(), [sample("a"), newer.clone()], "the journal's b wins");
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
    assert_eq!(s.removed_tmp(), [dir.join("good.json.tmp")]);
    assert_eq!(
        files(dir),
        [
            "allocations.journal",
            "bad.json.corrupt",
            "bad.json.corrupt.1",
            "driver",
            "empty.json.corrupt",
            "events.pb",
            "lock",
            "other.json.corrupt"
        ]
    );
    assert_eq!(std::fs::read(dir.join("bad.json.corrupt")).unwrap(), b"an older one");
    assert_eq!(std::fs::read(dir.join("events.pb")).unwrap(), b"not ours");
    assert_eq!(std::fs::read(dir.join("driver/k.json")).unwrap(), b"a driver file");
    drop(s);
    // In the journal now; nothing more to do on the next open.
    let s = Store::open(dir).unwrap();
    assert!(s.set_aside().is_empty() && s.removed_tmp().is_empty());
    assert_eq!(s.list().cloned().collect::<Vec<_>>(), [sample("a"), newer]);
}

#[test]
fn a_leftover_compaction_file_is_removed_and_reported() {
    let (_tmp, dir) = store_with(&["a"]);
    let mut half = journal::encode(&OpRef::Put(&sample("ghost"))).unwrap();
    half.truncate(50);
    std::fs::write(dir.join(journal::TMP_NAME), &half).unwrap();
    let s = Store::open(&dir).unwrap();
    assert_eq!(s.removed_tmp(), [dir.join(journal::TMP_NAME)]);
    assert_eq!(ids(s.list()), ["a"]);
    assert!(s.set_aside().is_empty());
    assert_eq!(files(&dir), ["allocations.journal", "lock"]);
}

#[test]
fn after_a_failed_write_the_next_change_starts_a_fresh_file() {
    let (_tmp, dir) = store_with(&["a"]);
    let mut s = Store::open(&dir).unwrap();
    // What a failed append leaves: stray bytes past the end, and the flag it sets.
    s.journal.write_all_at(b"stray bytes", s.offset + 100).unwrap();
    s.needs_compaction = true;
    let inode = journal_meta(&dir).ino();
    s.insert(&sample("b")).unwrap();
    assert_ne!(journal_meta(&dir).ino(), inode, "compacted first");
    assert!(!s.needs_compaction);
    drop(s);
    let s = Store::open(&dir).unwrap();
    assert_eq!(ids(s.list()), ["a", "b"]);
    assert!(s.set_aside().is_empty(), "{:?}", s.set_aside());
}

#[test]
fn read_records_takes_no_lock_and_writes_nothing() {
    let tmp = crate::state::mount::TestDir::new();
    assert!(matches!(read_records(&tmp.path().join("none")), Err(StateError::Io { .. })));
    assert!(read_records(tmp.path()).unwrap().is_empty());
    assert!(files(tmp.path()).is_empty());
    let mut s = Store::open(tmp.path()).unwrap();
    s.insert(&sample("a")).unwrap();
    assert_eq!(read_records(tmp.path()).unwrap(), [sample("a")]);
    s.remove("a").unwrap();
    assert!(read_records(tmp.path()).unwrap().is_empty());
}

/// A record inserted to be flushed soon is written at once (a reader, or a store opened after a
/// `kill -9`, finds it), flushed by the group flush, and a later change flushed on the spot keeps
/// both; the frames are those of an insert flushed at once.
#[test]
fn a_record_flushed_soon_is_written_before_it_returns_and_flushed_after() {
    let tmp = crate::state::mount::TestDir::new();
    let dir = tmp.path().join("state");
    let mut s = Store::open(&dir).unwrap();
    s.insert_flushed_soon(&sample("a1")).unwrap();
    assert_eq!(ids(&read_records(&dir).unwrap()), ["a1"], "written before it returned");
    assert_eq!(s.flush.wait_idle(), 1, "one flush asked for, and done");
    s.insert_flushed_soon(&sample("b2")).unwrap();
    s.insert(&sample("c3")).unwrap();
    assert!(s.insert_flushed_soon(&sample("c3")).is_err(), "a duplicate is refused as by insert");
    let (_, offsets) = frames(&dir);
    assert_eq!(offsets.len(), 3, "one frame per change");
    drop(s);
    let s = Store::open(&dir).unwrap();
    assert_eq!(ids(s.list()), ["a1", "b2", "c3"]);
    assert!(s.loss().is_none());
}
