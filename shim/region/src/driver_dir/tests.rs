use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

use super::*;
use crate::driver::{DriverConfig, discover};

const LIB: &str = "usr/lib/x86_64-linux-gnu";

/// A fake driver root: a versioned libcuda with its soname and development links, NVML with its
/// soname link, a library whose link points outside its directory, and a tool.
fn fake_root(root: &Path) -> DriverFiles {
    let lib = root.join(LIB);
    fs::create_dir_all(&lib).unwrap();
    fs::create_dir_all(root.join("usr/bin")).unwrap();
    fs::create_dir_all(root.join("opt/nvidia")).unwrap();
    fs::write(lib.join("libcuda.so.550.54.15"), b"cuda 550").unwrap();
    symlink("libcuda.so.550.54.15", lib.join("libcuda.so.1")).unwrap();
    symlink("libcuda.so.1", lib.join("libcuda.so")).unwrap();
    fs::write(lib.join("libnvidia-ml.so.550.54.15"), b"nvml 550").unwrap();
    symlink("libnvidia-ml.so.550.54.15", lib.join("libnvidia-ml.so.1")).unwrap();
    fs::write(root.join("opt/nvidia/libnvidia-cfg.so.550.54.15"), b"cfg 550").unwrap();
    symlink("../../../opt/nvidia/libnvidia-cfg.so.550.54.15", lib.join("libnvidia-cfg.so.1")).unwrap();
    let smi = root.join("usr/bin/nvidia-smi");
    fs::write(&smi, b"#!tool").unwrap();
    fs::set_permissions(&smi, fs::Permissions::from_mode(0o755)).unwrap();
    discover(&DriverConfig { root: root.into(), ..DriverConfig::default() })
}

/// A temporary directory (kept by the caller) with a fake driver root in it (`root`), that root's
/// files, and where the driver directories go (`driver`).
fn fake_host() -> (tempfile::TempDir, PathBuf, DriverFiles, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let files = fake_root(&root);
    let parent = tmp.path().join("driver");
    (tmp, root, files, parent)
}

fn ino(p: &Path) -> (u64, u64) {
    let m = fs::symlink_metadata(p).unwrap();
    (m.dev(), m.ino())
}

fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn copying() -> Options {
    Options { force_copy: true, ..Options::default() }
}

#[test]
fn lays_out_files_soname_links_and_tools_under_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let files = fake_root(&root);
    assert_eq!(files.libraries.len(), 6, "{files:?}");
    let parent = tmp.path().join("state/driver");
    let p = prepare(&files, &parent).unwrap();

    let key = p.dir.file_name().unwrap().to_str().unwrap();
    assert_eq!(key.len(), 16);
    assert!(key.chars().all(|c| c.is_ascii_hexdigit()), "{key}");
    assert_eq!(p.dir, parent.join(key));
    assert!(p.built);
    assert_eq!(p.counts, Counts { hard_links: 4, copies: 0, symlinks: 3 });
    assert_eq!(p.moved_aside, None);
    assert_eq!(names(&parent), [key], "only the directory, no temporaries");
    assert_eq!(mode(&parent), 0o700);

    let lib = p.dir.join(LIB);
    assert_eq!(fs::read_link(lib.join("libcuda.so.1")).unwrap(), Path::new("libcuda.so.550.54.15"));
    assert_eq!(fs::read_link(lib.join("libcuda.so")).unwrap(), Path::new("libcuda.so.1"));
    assert_eq!(fs::read_link(lib.join("libnvidia-ml.so.1")).unwrap(), Path::new("libnvidia-ml.so.550.54.15"));
    assert_eq!(ino(&lib.join("libcuda.so.550.54.15")), ino(&root.join(LIB).join("libcuda.so.550.54.15")));
    // A link out of its directory: the file it resolves to, under the link's name.
    let cfg = lib.join("libnvidia-cfg.so.1");
    assert!(fs::symlink_metadata(&cfg).unwrap().is_file());
    assert_eq!(ino(&cfg), ino(&root.join("opt/nvidia/libnvidia-cfg.so.550.54.15")));
    assert_eq!(fs::read(lib.join("libcuda.so")).unwrap(), b"cuda 550", "links resolve inside the directory");
    assert_eq!(fs::read(p.dir.join("usr/bin/nvidia-smi")).unwrap(), b"#!tool");
    assert_eq!(mode(&p.dir.join("usr/bin/nvidia-smi")), 0o755);
    for d in [&p.dir, &p.dir.join("usr"), &p.dir.join("usr/bin"), &lib] {
        assert_eq!(mode(d), 0o755, "{}", d.display());
    }
    assert_eq!(names(&p.dir), ["usr"], "nothing outside the files' paths (opt/ is not gathered)");
    assert_eq!(names(&p.dir.join("usr")), ["bin", "lib"]);
}

#[test]
fn a_complete_directory_is_reused_as_it_is() {
    let (_tmp, _root, files, parent) = fake_host();
    let first = prepare(&files, &parent).unwrap();
    let smi = first.dir.join("usr/bin/nvidia-smi");
    let before = (ino(&first.dir), ino(&smi), fs::metadata(&first.dir).unwrap().modified().unwrap());
    let again = prepare(&files, &parent).unwrap();
    assert_eq!(again.dir, first.dir);
    assert!(!again.built);
    assert_eq!(again.counts, first.counts);
    assert_eq!((ino(&again.dir), ino(&smi), fs::metadata(&again.dir).unwrap().modified().unwrap()), before);
    assert_eq!(names(&parent).len(), 1);
}

#[test]
fn a_driver_upgrade_gives_a_new_directory_and_leaves_the_old_one() {
    let (_tmp, root, files, parent) = fake_host();
    let old = prepare(&files, &parent).unwrap();
    // The package manager replaces the file (a new inode), as an upgrade does.
    let lib = root.join(LIB).join("libcuda.so.550.54.15");
    fs::remove_file(&lib).unwrap();
    fs::write(&lib, b"cuda 550, patched").unwrap();
    let new = prepare(&files, &parent).unwrap();
    assert_ne!(new.dir, old.dir);
    assert!(new.built);
    assert_eq!(fs::read(new.dir.join(LIB).join("libcuda.so.1")).unwrap(), b"cuda 550, patched");
    assert_eq!(fs::read(old.dir.join(LIB).join("libcuda.so.1")).unwrap(), b"cuda 550", "old one untouched");
    // A tool's mode alone is a change too.
    fs::set_permissions(root.join("usr/bin/nvidia-smi"), fs::Permissions::from_mode(0o700)).unwrap();
    let third = prepare(&files, &parent).unwrap();
    assert_ne!(third.dir, new.dir);
    assert_eq!(names(&parent).len(), 3, "no directory is ever removed");
}

#[test]
fn a_damaged_directory_is_moved_aside_and_rebuilt() {
    type Damage = fn(&Path);
    let cases: [(&str, Damage); 7] = [
        ("file missing", |d| fs::remove_file(d.join("usr/bin/nvidia-smi")).unwrap()),
        ("file replaced", |d| {
            let f = d.join(LIB).join("libcuda.so.550.54.15");
            fs::remove_file(&f).unwrap();
            fs::write(&f, b"evil 550").unwrap();
        }),
        ("soname link retargeted", |d| {
            let l = d.join(LIB).join("libcuda.so.1");
            fs::remove_file(&l).unwrap();
            symlink("/tmp/evil.so", &l).unwrap();
        }),
        ("link replaced by a file", |d| {
            let l = d.join(LIB).join("libnvidia-ml.so.1");
            fs::remove_file(&l).unwrap();
            fs::write(&l, b"nvml 550").unwrap();
        }),
        ("an extra library", |d| fs::write(d.join(LIB).join("libevil.so"), b"x").unwrap()),
        ("a directory made writable", |d| fs::set_permissions(d.join(LIB), fs::Permissions::from_mode(0o777)).unwrap()),
        ("the directory replaced by a file", |d| {
            fs::remove_dir_all(d).unwrap();
            fs::write(d, b"").unwrap();
        }),
    ];
    for (what, damage) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let files = fake_root(&tmp.path().join("root"));
        let parent = tmp.path().join("driver");
        let good = prepare(&files, &parent).unwrap();
        damage(&good.dir);
        let p = prepare(&files, &parent).unwrap();
        assert_eq!(p.dir, good.dir, "{what}: the same key");
        assert!(p.built, "{what}");
        let aside = p.moved_aside.unwrap_or_else(|| panic!("{what}: not noticed"));
        assert_eq!(aside.from, good.dir);
        let key = good.dir.file_name().unwrap().to_str().unwrap();
        let aside_name = aside.to.file_name().unwrap().to_str().unwrap();
        assert!(aside_name.starts_with(&format!("{key}.damaged-")), "{what}: {aside_name}");
        assert!(fs::symlink_metadata(&aside.to).is_ok(), "{what}: kept, not deleted");
        assert!(!aside.reason.is_empty());
        assert_eq!(fs::read(p.dir.join(LIB).join("libcuda.so.1")).unwrap(), b"cuda 550", "{what}");
        assert!(check(&p.dir, &plan(&files).unwrap()).is_ok(), "{what}: rebuilt whole");
        let again = prepare(&files, &parent).unwrap();
        assert!(!again.built && again.moved_aside.is_none(), "{what}: the rebuilt one is trusted");
    }
}

#[test]
fn a_second_damage_in_the_same_second_gets_its_own_name() {
    let (_tmp, _root, files, parent) = fake_host();
    let mut aside = BTreeSet::new();
    for _ in 0..3 {
        let p = prepare(&files, &parent).unwrap();
        fs::remove_file(p.dir.join("usr/bin/nvidia-smi")).unwrap();
        if let Some(m) = prepare(&files, &parent).unwrap().moved_aside {
            aside.insert(m.to);
        }
    }
    assert_eq!(aside.len(), 3, "{aside:?}");
}

#[test]
fn leftover_temporaries_are_removed_but_not_a_live_builders() {
    let (_tmp, _root, files, parent) = fake_host();
    fs::create_dir_all(&parent).unwrap();
    let dead = parent.join(".tmp-0123456789abcdef-999999999");
    let ours = parent.join(format!(".tmp-0123456789abcdef-{}", std::process::id()));
    let odd = parent.join(".tmp-junk");
    let live = parent.join(".tmp-0123456789abcdef-1");
    for d in [&dead, &ours, &live] {
        fs::create_dir_all(d.join(LIB)).unwrap();
        fs::write(d.join(LIB).join("libcuda.so.1"), b"half").unwrap();
    }
    fs::write(&odd, b"").unwrap();
    let other = parent.join("0123456789abcdef.damaged-5");
    fs::create_dir(&other).unwrap();
    let p = prepare(&files, &parent).unwrap();
    let mut removed = p.removed_leftovers.clone();
    removed.sort();
    let mut want = vec![dead.clone(), ours.clone(), odd.clone()];
    want.sort();
    assert_eq!(removed, want);
    assert!(!dead.exists() && !ours.exists() && !odd.exists());
    assert!(live.exists(), "pid 1 is alive: its build is left alone");
    assert!(other.exists(), "damaged directories are never removed");
}

#[test]
fn copies_keep_mode_and_time_and_are_checked() {
    let (_tmp, root, files, parent) = fake_host();
    let p = prepare_with(&files, &parent, &copying()).unwrap();
    assert_eq!(p.counts, Counts { hard_links: 0, copies: 4, symlinks: 3 });
    let host = root.join("usr/bin/nvidia-smi");
    let copy = p.dir.join("usr/bin/nvidia-smi");
    assert_ne!(ino(&copy), ino(&host));
    assert_eq!(fs::read(&copy).unwrap(), fs::read(&host).unwrap());
    assert_eq!(mode(&copy), 0o755);
    let (h, c) = (fs::metadata(&host).unwrap(), fs::metadata(&copy).unwrap());
    assert_eq!((c.mtime(), c.mtime_nsec()), (h.mtime(), h.mtime_nsec()));
    // The same directory whether or not hard links would work now.
    let again = prepare(&files, &parent).unwrap();
    assert!(!again.built);
    assert_eq!(again.counts, p.counts);
    // A copy whose time was changed (or whose content was rewritten in place) is not trusted.
    let f = fs::File::options().write(true).open(&copy).unwrap();
    f.set_modified(SystemTime::UNIX_EPOCH).unwrap();
    let rebuilt = prepare_with(&files, &parent, &copying()).unwrap();
    assert!(rebuilt.moved_aside.is_some());
    let f = fs::File::options().append(true).open(rebuilt.dir.join(LIB).join("libcuda.so.550.54.15")).unwrap();
    f.set_len(3).unwrap();
    assert!(prepare_with(&files, &parent, &copying()).unwrap().moved_aside.is_some());
}

#[test]
fn across_filesystems_files_are_copied() {
    // /dev/shm is a tmpfs: a hard link into it from the temp directory's filesystem is a real
    // EXDEV. Where both are the same filesystem, the forced copy above covers the copy path.
    let tmp = tempfile::tempdir().unwrap();
    let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
        println!("SKIP across_filesystems_files_are_copied: no /dev/shm");
        return;
    };
    if fs::metadata(tmp.path()).unwrap().dev() == fs::metadata(shm.path()).unwrap().dev() {
        println!("SKIP across_filesystems_files_are_copied: /dev/shm is on the temp directory's filesystem");
        return;
    }
    let files = fake_root(&tmp.path().join("root"));
    let p = prepare(&files, &shm.path().join("driver")).unwrap();
    assert_eq!(p.counts, Counts { hard_links: 0, copies: 4, symlinks: 3 });
    assert_eq!(fs::read(p.dir.join(LIB).join("libcuda.so.1")).unwrap(), b"cuda 550");
    assert!(!prepare(&files, &shm.path().join("driver")).unwrap().built);
}

#[test]
fn links_resolve_inside_the_driver_root() {
    // The daemon sees the host's root at /driver-root: an absolute link means the host's file,
    // and `..` cannot climb out of the root.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let mut files = fake_root(&root);
    let lib = root.join(LIB);
    symlink("/opt/nvidia/libnvidia-cfg.so.550.54.15", lib.join("libnvidia-ptxjitcompiler.so.1")).unwrap();
    fs::create_dir_all(root.join("etc")).unwrap();
    fs::write(root.join("etc/hostname"), b"the driver root's").unwrap();
    symlink("../../../../../../../../etc/hostname", lib.join("libnvidia-opencl.so.1")).unwrap();
    symlink("libnvidia-loop.so.2", lib.join("libnvidia-loop.so.1")).unwrap();
    symlink("libnvidia-loop.so.1", lib.join("libnvidia-loop.so.2")).unwrap();
    files.libraries.push(lib.join("libnvidia-ptxjitcompiler.so.1"));
    files.libraries.push(lib.join("libnvidia-opencl.so.1"));
    let p = prepare(&files, &tmp.path().join("driver")).unwrap();
    let got = p.dir.join(LIB);
    assert_eq!(fs::read(got.join("libnvidia-ptxjitcompiler.so.1")).unwrap(), b"cfg 550");
    assert_eq!(fs::read(got.join("libnvidia-opencl.so.1")).unwrap(), b"the driver root's");
    // A loop is an error naming it, not a hang.
    files.libraries.push(lib.join("libnvidia-loop.so.1"));
    let e = prepare(&files, &tmp.path().join("driver")).unwrap_err();
    assert_eq!(e.source.raw_os_error(), Some(libc::ELOOP), "{e}");
    assert!(e.to_string().contains("libnvidia-loop.so.1"), "{e}");
}

#[test]
fn a_failed_build_leaves_nothing_behind() {
    let (_tmp, root, files, parent) = fake_host();
    // The disk fills up half way.
    let opts = Options { force_copy: true, fail_at: Some(PathBuf::from(LIB).join("libnvidia-ml.so.1")) };
    let e = prepare_with(&files, &parent, &opts).unwrap_err();
    assert!(e.to_string().contains("libnvidia-ml.so.1"), "{e}");
    assert_eq!(e.source.raw_os_error(), Some(libc::ENOSPC));
    assert!(names(&parent).is_empty(), "{:?}", names(&parent));
    // A file gone since discovery.
    fs::remove_file(root.join("usr/bin/nvidia-smi")).unwrap();
    let e = prepare(&files, &parent).unwrap_err();
    assert!(e.to_string().contains("usr/bin/nvidia-smi"), "{e}");
    assert!(names(&parent).is_empty());
    // A dangling soname link.
    fs::write(root.join("usr/bin/nvidia-smi"), b"#!tool").unwrap();
    fs::remove_file(root.join(LIB).join("libnvidia-ml.so.550.54.15")).unwrap();
    let e = prepare(&files, &parent).unwrap_err();
    assert!(e.to_string().contains("libnvidia-ml"), "{e}");
    assert!(names(&parent).is_empty());
}

#[test]
fn a_parent_that_cannot_hold_it_is_an_error_naming_it() {
    let (_tmp, _root, files, parent) = fake_host();
    fs::write(&parent, b"not a directory").unwrap();
    let e = prepare(&files, &parent).unwrap_err();
    assert!(e.to_string().contains(&parent.display().to_string()), "{e}");
    assert_eq!(fs::read(&parent).unwrap(), b"not a directory", "left as it was");
    let e = prepare(&files, &parent.join("below")).unwrap_err();
    assert!(e.to_string().contains("driver"), "{e}");
}

#[test]
fn files_outside_the_root_or_none_at_all_are_refused() {
    let (_tmp, _root, mut files, parent) = fake_host();
    let e = prepare(&DriverFiles { root: files.root.clone(), ..DriverFiles::default() }, &parent).unwrap_err();
    assert!(e.to_string().contains("no driver files"), "{e}");
    files.binaries.push(PathBuf::from("/bin/sh"));
    let e = prepare(&files, &parent).unwrap_err();
    assert!(e.to_string().contains("/bin/sh") && e.to_string().contains("not under the driver root"), "{e}");
    files.binaries.pop();
    files.binaries.push(files.root.join("usr/bin/../bin/nvidia-smi"));
    let e = prepare(&files, &parent).unwrap_err();
    assert!(e.to_string().contains("not a file path"), "{e}");
    assert!(!parent.exists(), "nothing made for refused input");
}

/// Set in the child of [`a_kill_at_any_point_leaves_no_directory_or_a_complete_one`]: the driver
/// root and the parent to build in.
const CRASH_CHILD: &str = "TESSERA_BUNDLE_CRASH_CHILD";

#[test]
fn a_kill_at_any_point_leaves_no_directory_or_a_complete_one() {
    if let Ok(paths) = std::env::var(CRASH_CHILD) {
        let (root, parent) = paths.split_once(':').unwrap();
        let files = discover(&DriverConfig { root: root.into(), ..DriverConfig::default() });
        prepare_with(&files, Path::new(parent), &copying()).unwrap();
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let files = fake_root(&root);
    // Big enough that copying and syncing it takes a while.
    fs::write(root.join(LIB).join("libnvidia-nvvm.so.4"), vec![7u8; 8 << 20]).unwrap();
    let files = DriverFiles {
        libraries: [files.libraries, vec![root.join(LIB).join("libnvidia-nvvm.so.4")]].concat(),
        ..files
    };
    let parent = tmp.path().join("driver");
    let plan = plan(&files).unwrap();
    let key = parent.join(key(&plan));
    let (mut complete, mut absent, mut half) = (0, 0, 0);
    for delay_ms in (0..24).map(|i| i * 3) {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "driver_dir::tests::a_kill_at_any_point_leaves_no_directory_or_a_complete_one"])
            .env(CRASH_CHILD, format!("{}:{}", root.display(), parent.display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let tmp_left =
            fs::read_dir(&parent).map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with(".tmp-")));
        if key.exists() {
            assert_eq!(check(&key, &plan).map(|_| ()), Ok(()), "killed after {delay_ms} ms");
            complete += 1;
            fs::remove_dir_all(&key).unwrap();
        } else {
            absent += 1;
            half += usize::from(tmp_left.unwrap_or(false));
        }
    }
    let p = prepare(&files, &parent).unwrap();
    println!(
        "killed builds: {complete} complete, {absent} with no directory ({half} of them half built); {} leftovers removed",
        p.removed_leftovers.len()
    );
    assert!(p.built);
    assert_eq!(names(&parent), [key.file_name().unwrap().to_str().unwrap()], "leftovers removed");
}
