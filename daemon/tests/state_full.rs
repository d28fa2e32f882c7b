//! The allocation store on a full file system: a small tmpfs as the state directory (root only;
//! without root the test prints SKIP, and fails when `TESSERA_REQUIRE_RUNTIMES` is set, as CI
//! runs it). Out of space is a clear error, the Allocate fails, the store keeps working, a restart
//! needs no free space, and once space is back everything goes on.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use tessera_daemon::allocator::DaemonAllocator;
use tessera_daemon::config::Config;
use tessera_daemon::kubelet::Allocator;
use tessera_daemon::resources::{Kind, Resource, ResourceDevice, Resources};
use tessera_daemon::state::{AllocDirs, Allocation, ContainerIdentity, Source, StateError, Store};

/// A tmpfs of `size` mounted on `dir`, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tessera-test", dir.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(ok.success(), "mount a tmpfs on {}", dir.display());
        Tmpfs(dir.to_path_buf())
    }

    fn resize(&self, size: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,size={size}"), self.0.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(ok.success(), "remount {} at {size}", self.0.display());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Detaches every mount under a directory when dropped.
struct Detach(PathBuf);

impl Drop for Detach {
    fn drop(&mut self) {
        tessera_daemon::state::mount::detach_all_under(&self.0);
    }
}

/// Root is needed to mount; without it: SKIP, or a failure where runtimes are required.
fn need_root() -> bool {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let why = "not root: cannot mount a tmpfs for a full state directory";
    assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "TESSERA_REQUIRE_RUNTIMES is set, but {why}");
    println!("SKIP: {why}");
    false
}

/// A record of about 4 KB, to fill the journal with few writes.
fn record(id: &str) -> Allocation {
    Allocation {
        id: id.to_string(),
        resource: "tessera.io/gpu".to_string(),
        container: ContainerIdentity { pod_uid: Some("u".repeat(4000)), ..Default::default() },
        source: Source::NodeApi,
        created_unix_ns: 1,
        devices: Vec::new(),
        claim: None,
    }
}

const SHARE: &str = "tessera.io/gpu-share";

fn resources() -> Arc<Resources> {
    let mut r = Resources::default();
    let devices = (0..4)
        .map(|n| ResourceDevice {
            id: format!("GPU-a::{n}"),
            physical_uuid: "GPU-a".to_string(),
            gpu_index: 0,
            numa_node: Some(0),
            health: tessera_daemon::device_health::Health::Healthy,
            memory_limit: Some(1 << 30),
            sm_percent: Some(25),
            nodes: vec![PathBuf::from("/dev/nvidia0")],
        })
        .collect();
    r.resources.insert(SHARE.into(), Resource { name: SHARE.into(), kind: Kind::Share, devices });
    Arc::new(r)
}

#[test]
fn a_full_state_dir_fails_the_change_not_the_daemon() {
    if !need_root() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // The regions of the allocations made here are mounts: detached before the directory goes.
    let _regions = Detach(tmp.path().to_path_buf());
    let state = tmp.path().join("state");
    // Room for one journal (1 MiB) and not for a second one beside it.
    let fs = Tmpfs::mount(&state, "1600k");
    let mut store = Store::open(&state).unwrap();
    let mut acked = Vec::new();
    let err = loop {
        let id = format!("r{}", acked.len());
        match store.insert(&record(&id)) {
            Ok(()) => acked.push(id),
            Err(e) => break e,
        }
        assert!(acked.len() < 1000, "the journal never filled");
    };
    // The journal is full, and compacting it needs another 1 MiB: refused, clearly.
    assert!(matches!(err, StateError::NoSpace { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("no space left") && text.contains(state.to_str().unwrap()), "{text}");
    assert_eq!(store.len(), acked.len(), "the failed insert changed nothing");
    assert!(store.get(&format!("r{}", acked.len())).is_none());
    assert!(!state.join("allocations.journal.tmp").exists(), "no half-made compaction left");
    // A restart with the disk still full: nothing to compact, nothing needed.
    drop(store);
    let store = Store::open(&state).unwrap();
    assert_eq!(store.len(), acked.len());
    drop(store);

    // The same through the kubelet's Allocate: an error the kubelet reports, and the daemon lives.
    let run = tmp.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let dirs = AllocDirs::new(&run);
    let allocator = DaemonAllocator::new(&Config::default(), resources(), Store::open(&state).unwrap(), dirs.clone());
    let mut allocated = 0;
    let status = loop {
        match allocator.allocate(SHARE, &[format!("GPU-a::{}", allocated % 4)]) {
            Ok(_) => allocated += 1,
            Err(status) => break status,
        }
        assert!(allocated < 10, "the journal had room: {allocated}");
    };
    assert!(status.message().contains("no space left"), "{}", status.message());
    assert_eq!(allocator.allocations().len(), acked.len() + allocated.min(4), "nothing half made");
    drop(allocator);

    // Space back: the next change compacts and goes through; everything acknowledged is there.
    fs.resize("32m");
    let mut store = Store::open(&state).unwrap();
    let before = store.len();
    store.insert(&record("after")).unwrap();
    drop(store);
    let store = Store::open(&state).unwrap();
    assert_eq!(store.len(), before + 1);
    for id in &acked {
        assert!(store.get(id).is_some(), "{id} lost");
    }
    drop(store);

    // A damaged journal on a full disk: the open still works (the damage kept as a link, no
    // space needed), reports it, and changes fail until there is room to rewrite the journal.
    let journal = state.join("allocations.journal");
    std::fs::OpenOptions::new().write(true).open(&journal).unwrap().write_all_at(&[0x5a; 64], 300).unwrap();
    let used = std::fs::metadata(&journal).unwrap().len();
    fs.resize(&format!("{}k", used / 1024 + 200));
    let mut store = Store::open(&state).unwrap();
    assert_eq!(store.set_aside().len(), 1, "{:?}", store.set_aside());
    let copy = store.loss().unwrap().copy.clone();
    assert!(copy.exists());
    let err = store.insert(&record("while-full")).unwrap_err();
    assert!(matches!(err, StateError::NoSpace { .. }), "{err:?}");
    let kept = store.len();
    fs.resize("32m");
    store.insert(&record("while-full")).unwrap();
    drop(store);
    let store = Store::open(&state).unwrap();
    assert!(store.set_aside().is_empty(), "rewritten whole");
    assert_eq!(store.len(), kept + 1);
}
