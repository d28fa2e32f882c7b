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
            whole: false,
            preemptible: false,
        }],
        claim: None,
    }
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<_> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    v.sort();
    v
}

/// What an allocation directory holds: a region of its own in a capped tmpfs as root, a
/// plain file otherwise.
fn expected_names() -> Vec<&'static str> {
    if is_root() { vec![".region", "ledger", "limits", "region"] } else { vec!["ledger", "limits", "region"] }
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// Release detaches the region's two mounts by name; anything else mounted below the
/// directory is found in the mount table, and nothing is left mounted either way.
#[test]
fn remove_leaves_no_mount_behind() {
    if !is_root() {
        return;
    }
    let tmp = crate::state::mount::TestDir::new();
    let dirs = AllocDirs::new(tmp.path());
    let plain = dirs.create(&alloc("00000000000000a1")).unwrap();
    let extra = dirs.create(&alloc("00000000000000a2")).unwrap();
    std::fs::create_dir(extra.join("extra")).unwrap();
    mount::capped_tmpfs(&extra.join("extra"), 4096).unwrap();
    assert_eq!(mount::points_under(&extra).len(), 3, "region, its tmpfs and the extra mount");
    for (id, dir) in [("00000000000000a1", &plain), ("00000000000000a2", &extra)] {
        assert!(dirs.remove(id).unwrap());
        assert!(!dir.exists());
    }
    assert!(mount::points_under(tmp.path()).is_empty(), "{:?}", mount::points_under(tmp.path()));
    assert!(!dirs.remove("00000000000000a1").unwrap(), "a second remove finds nothing");
}

#[test]
fn create_update_remove() {
    let tmp = crate::state::mount::TestDir::new();
    let dirs = AllocDirs::new(tmp.path());
    let mut a = alloc("0123456789abcdef");
    let dir = dirs.create(&a).unwrap();
    assert_eq!(dir, tmp.path().join("alloc/0123456789abcdef"));
    assert_eq!(mode(dirs.root()), 0o700, "no host user reaches any allocation");
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
    assert_eq!(names(&dir), expected_names());

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
    let tmp = crate::state::mount::TestDir::new();
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
    assert_eq!(mode(&dirs.limits_path(&a.id)), 0o644, "container processes of any uid read it");
    let region = Region::open_or_create(&dirs.region_path(&a.id)).unwrap();
    assert_eq!(names(&dir), expected_names());
    assert_eq!(mode(&tmp.path().join("spare")), 0o700);
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

    // A ready spare's limits are there, empty, until it is taken (out of sight in `spare/`).
    for name in spare_names() {
        let limits = tmp.path().join("spare").join(name).join(LIMITS_FILE);
        assert_eq!(std::fs::metadata(&limits).unwrap().len(), 0);
        assert_eq!(mode(&limits), 0o644);
    }

    // A spare that cannot be moved into place (taken from its place by hand) is thrown away,
    // never handed out half made: the allocation gets a whole directory.
    let gone = tmp.path().join("gone");
    std::fs::create_dir(&gone).unwrap();
    for name in spare_names() {
        std::fs::rename(tmp.path().join("spare").join(&name), gone.join(&name)).unwrap();
    }
    let c = alloc("third");
    let dir = dirs.create(&c).unwrap();
    assert_eq!(Limits::load(&dirs.limits_path(&c.id)).unwrap(), c.limits());
    assert_eq!(names(&dir), expected_names());
    wait_for("the lost spares replaced", || dirs.spares_ready() == 2 && spare_names().len() == 2);

    // `alloc/` removed by hand while spares are kept: the next allocation makes it again.
    crate::state::mount::detach_all_under(&tmp.path().join("alloc"));
    std::fs::remove_dir_all(tmp.path().join("alloc")).unwrap();
    let d = alloc("fourth");
    let dir = dirs.create(&d).unwrap();
    assert_eq!(Limits::load(&dirs.limits_path(&d.id)).unwrap(), d.limits());
    assert_eq!(names(&dir), expected_names());
    assert_eq!(mode(&tmp.path().join("alloc")), 0o700);
    assert_eq!(dirs.ids().unwrap(), ["fourth"]);
}

/// A directory that exists already (a restart bringing it up to date) is never replaced by a
/// spare: its limits are rewritten in place, its region kept, and the spare stays ready, empty
/// and unmarked, for the next allocation.
#[test]
fn an_existing_directory_is_brought_up_to_date_and_the_spare_kept() {
    use crate::state::record::{Claim, Lease};
    let tmp = crate::state::mount::TestDir::new();
    let dirs = AllocDirs::new(tmp.path());
    let mut a = alloc("existing");
    a.claim = Some(Box::new(Claim { owner: Some("fn-1".into()), lease: Lease::Container }));
    let dir = dirs.create(&a).unwrap();
    let region = Region::open_or_create(&dirs.region_path(&a.id)).unwrap();
    let generation = region.config_generation();
    dirs.keep_spares(1).unwrap();
    wait_for("one spare", || dirs.spares_ready() == 1);

    a.devices[0].memory_limit = Some(2 << 30);
    assert_eq!(dirs.create(&a).unwrap(), dir);
    assert_eq!(Limits::load(&dirs.limits_path(&a.id)).unwrap(), a.limits());
    assert!(region.config_generation() > generation, "the same region, told of the new limits");
    assert_eq!(dirs.spares_ready(), 1, "the spare was not used");
    let spare = std::fs::read_dir(tmp.path().join("spare")).unwrap().next().unwrap().unwrap().path();
    assert_eq!(std::fs::metadata(spare.join(LIMITS_FILE)).unwrap().len(), 0, "the spare's limits emptied");
    assert!(!tessera_region::owner::is_leased(&spare), "the spare unmarked");

    // The spare then serves the next allocation whole.
    let b = alloc("next");
    dirs.create(&b).unwrap();
    assert_eq!(Limits::load(&dirs.limits_path(&b.id)).unwrap(), b.limits());
    assert!(!tessera_region::owner::is_leased(&dirs.dir(&b.id)));
    dirs.stop_spares();
}

/// Only an allocation leased to its container has the marker the runtime wrapper adds its
/// poststop entry for, whether its directory came from a spare or was made on the spot, and
/// again after a restart that finds the directory without it.
#[test]
fn only_a_leased_allocation_is_marked() {
    use crate::state::record::{Claim, Lease};
    let tmp = crate::state::mount::TestDir::new();
    let dirs = AllocDirs::new(tmp.path());
    let leased = |id: &str| {
        let mut a = alloc(id);
        a.claim = Some(Box::new(Claim { owner: Some("fn-1".into()), lease: Lease::Container }));
        a
    };
    let marker = |id: &str| tmp.path().join("alloc").join(id).join(tessera_region::owner::LEASE_FILE);
    let on_the_spot = leased("leased1");
    let dir = dirs.create(&on_the_spot).unwrap();
    assert!(tessera_region::owner::is_leased(&dir));
    assert_eq!(std::fs::read_to_string(marker("leased1")).unwrap(), "container\n");
    assert_eq!(mode(&marker("leased1")), 0o644);
    let mut until_released = alloc("kept1");
    until_released.claim = Some(Box::new(Claim { owner: None, lease: Lease::None }));
    assert!(!tessera_region::owner::is_leased(&dirs.create(&until_released).unwrap()));
    assert!(!tessera_region::owner::is_leased(&dirs.create(&alloc("kubelet1")).unwrap()));
    // Lost (a crash between the rename and the marker): made again by the restart's create.
    std::fs::remove_file(marker("leased1")).unwrap();
    dirs.create(&on_the_spot).unwrap();
    assert!(marker("leased1").is_file());

    dirs.keep_spares(2).unwrap();
    wait_for("two spares", || dirs.spares_ready() == 2);
    assert!(tessera_region::owner::is_leased(&dirs.create(&leased("leased2")).unwrap()));
    wait_for("the pool refilled", || dirs.spares_ready() == 2);
    let from_spare = dirs.create(&alloc("kubelet2")).unwrap();
    assert!(!tessera_region::owner::is_leased(&from_spare), "a spare carries no marker of its own");
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

/// Says SKIP (or fails under TESSERA_REQUIRE_RUNTIMES) where mounts cannot be made.
fn root_or_skip(why: &str) -> bool {
    if is_root() {
        return true;
    }
    assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "TESSERA_REQUIRE_RUNTIMES is set, but {why}");
    println!("SKIP: {why}");
    false
}

/// As a hostile container would: the region cannot be grown into the host's memory, replaced
/// or removed, and the limits beside it cannot be reached by an unprivileged host user.
#[test]
fn a_region_cannot_grow_and_host_users_reach_nothing() {
    if !root_or_skip("regions in capped tmpfs need root") {
        return;
    }
    use std::os::unix::fs::FileExt;
    use std::os::unix::process::CommandExt;
    let tmp = crate::state::mount::TestDir::new();
    let dirs = AllocDirs::new(tmp.path());
    let a = alloc("hostile");
    let dir = dirs.create(&a).unwrap();
    let region_path = dirs.region_path(&a.id);
    let points = mount::points_under(&dir);
    assert_eq!(points.len(), 2, "the region's tmpfs and its bind mount: {points:?}");

    let f = std::fs::OpenOptions::new().read(true).write(true).open(&region_path).unwrap();
    // Writing past the region's end: the tmpfs holds the region and nothing more.
    let big = vec![0x5au8; 1 << 20];
    let mut written = 0u64;
    let err = loop {
        match f.write_at(&big, tessera_region::LAYOUT_SIZE as u64 + written) {
            Ok(n) => written += n as u64,
            Err(e) => break e,
        }
        assert!(written < 8 << 20, "wrote {written} bytes past the region");
    };
    assert_eq!(err.raw_os_error(), Some(nix::libc::ENOSPC), "{err}");
    // Not even the sparse trace ring's worth can be added: at most the region's own size.
    assert!(written <= tessera_region::LAYOUT_SIZE as u64, "{written}");
    // The region is a mount point: it cannot be removed or replaced.
    assert_eq!(std::fs::remove_file(&region_path).unwrap_err().raw_os_error(), Some(nix::libc::EBUSY));
    std::fs::write(dir.join("evil"), b"x").unwrap();
    assert_eq!(std::fs::rename(dir.join("evil"), &region_path).unwrap_err().raw_os_error(), Some(nix::libc::EBUSY));

    // An unprivileged host user reaches neither the limits nor the region.
    for target in [dirs.limits_path(&a.id), region_path.clone(), dirs.root().to_path_buf()] {
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg("ls \"$1\" >/dev/null && echo x >> \"$1\"")
            .arg("sh")
            .arg(&target)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        assert!(!out.status.success(), "nobody reached {}", target.display());
        assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"), "{out:?}");
    }

    // Removing the allocation takes its mounts too.
    assert!(dirs.remove(&a.id).unwrap());
    assert!(mount::points_under(tmp.path()).is_empty());
    assert!(!dir.exists());
}

/// A full runtime dir: the allocation fails with an error naming the file, nothing dies.
#[test]
fn a_full_runtime_dir_is_a_clear_error() {
    let Some(fs) = tessera_region::testing::TestTmpfs::mount(256 << 10) else { return };
    let dirs = AllocDirs::new(fs.path());
    let first = alloc("before");
    dirs.create(&first).unwrap();
    fs.fill();
    let err = dirs.create(&alloc("after")).unwrap_err().to_string();
    assert!(err.contains("No space left") && err.contains("after"), "{err}");
    // The allocation made before is intact.
    assert_eq!(Limits::load(&dirs.limits_path(&first.id)).unwrap(), first.limits());
    unmount_under(fs.path().join("alloc").as_path());
}

/// The same with spares kept: the error is as clear, nothing half made appears, and the spares
/// are kept (not thrown away one by one), serving the next allocation once there is room.
#[test]
fn a_full_runtime_dir_keeps_its_spares() {
    let Some(fs) = tessera_region::testing::TestTmpfs::mount(512 << 10) else { return };
    let dirs = AllocDirs::new(fs.path());
    dirs.keep_spares(2).unwrap();
    wait_for("two spares", || dirs.spares_ready() == 2);
    fs.fill();
    let err = dirs.create(&alloc("after")).unwrap_err().to_string();
    assert!(err.contains("No space left") && err.contains("after"), "{err}");
    assert!(!dirs.dir("after").join(LIMITS_FILE).exists(), "no directory half made");
    assert_eq!(dirs.spares_ready(), 2, "the spares kept");
    std::fs::remove_file(fs.join("filler")).unwrap();
    let _ = std::fs::remove_dir_all(dirs.dir("after"));
    let a = alloc("later");
    dirs.create(&a).unwrap();
    assert_eq!(Limits::load(&dirs.limits_path(&a.id)).unwrap(), a.limits());
    dirs.stop_spares();
    unmount_under(fs.path().join("alloc").as_path());
}

/// An `AllocDirs` dropped without `stop_spares` takes its spares and their region mounts with
/// it (tests and a failed start left `spare/N` regions mounted under temporary runtime dirs);
/// one that never kept spares leaves another's alone.
#[test]
fn dropped_spares_leave_nothing_mounted_and_only_the_keepers_go() {
    let tmp = crate::state::mount::TestDir::new();
    let spare = tmp.path().join(SPARE_SUBDIR);
    let keeper = AllocDirs::new(tmp.path());
    keeper.keep_spares(2).unwrap();
    wait_for("two spares", || keeper.spares_ready() == 2);
    let regions = crate::state::mount::points_under(&spare).len();

    // A second `AllocDirs` over the same runtime dir (another process's view) that kept none.
    drop(AllocDirs::new(tmp.path()));
    assert_eq!(keeper.spares_ready(), 2);
    assert_eq!(crate::state::mount::points_under(&spare).len(), regions);

    let clone = keeper.clone();
    drop(keeper);
    assert!(spare.exists(), "a clone still holds the pool");
    drop(clone);
    wait_for("the spares removed", || !spare.exists());
    assert!(crate::state::mount::points_under(tmp.path()).is_empty());
}

/// The rename into place never replaces what is there: an empty directory (which a plain
/// rename would replace), a file, or a symbolic link (not followed); and nothing moves then.
#[test]
fn a_spare_is_never_renamed_over_anything() {
    let tmp = crate::state::mount::TestDir::new();
    let from = tmp.path().join("spare");
    std::fs::create_dir(&from).unwrap();
    std::fs::write(from.join(LIMITS_FILE), "x").unwrap();
    let empty_dir = tmp.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    let file = tmp.path().join("file");
    std::fs::write(&file, "mine").unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink("/nonexistent-target", &link).unwrap();
    for to in [&empty_dir, &file, &link] {
        let err = rename_new(&from, to).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists, "{}", to.display());
        assert!(from.join(LIMITS_FILE).is_file(), "the spare stays where it was");
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
    assert!(std::fs::read_dir(&empty_dir).unwrap().next().is_none());
    let to = tmp.path().join("new");
    rename_new(&from, &to).unwrap();
    assert!(to.join(LIMITS_FILE).is_file() && !from.exists());
}
