//! Leases in CDI mode (podman 4.3 reading tesserad's specs, runc underneath): a container that
//! asks for its GPU by CDI name with `TESSERA_ALLOCATION` set is bound to its leased allocation
//! by the spec's hook, which records what vanishes when the runtime deletes the container (its
//! state directory, else its cgroup); tesserad's lease pass releases the allocation once it is
//! gone, whether or not any poststop hook ran. Deleted with `podman rm -f`, and killed with
//! SIGKILL under `--rm`: record, directory and region mount all go.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tessera_sim_testkit::SimNode;
use tessera_tests::kubelet::{node_api, skip, start_daemon};
use tessera_tests::{FakeHost, GPU0_DEVICES, ONE_H100, RuncTest, busybox_rootfs, ok, tessera};

/// podman 4.3 reads CDI specs from this one global directory only.
const CDI_DIR: &str = "/var/run/cdi";

/// One user of podman's CDI directory at a time, across test binaries (the hook's tests too).
struct Lock(#[allow(dead_code)] std::fs::File);

fn lock() -> Lock {
    let f = std::fs::File::create("/tmp/tessera-hook-podman.lock").expect("lock file");
    // SAFETY: flock on an open descriptor we own; blocks until the lock is ours.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock");
    Lock(f)
}

/// tesserad's specs out of podman's directory when the test ends, however it ends.
struct Specs;

impl Drop for Specs {
    fn drop(&mut self) {
        for class in ["gpu", "mig", "share"] {
            let _ = std::fs::remove_file(Path::new(CDI_DIR).join(format!("tessera.io-{class}.json")));
        }
    }
}

fn podman(args: &[&str]) -> Output {
    Command::new("podman").args(args).stdin(std::process::Stdio::null()).output().expect("run podman")
}

fn podman_run(rootfs: &Path, extra: &[&str], script: &str) -> Output {
    let mut args = vec!["run", "-d", "--runtime", "runc", "--network", "none"];
    // podman 4.3 cannot raise rlimits itself here: explicit values.
    args.extend(["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]);
    args.extend(extra);
    let root = rootfs.display().to_string();
    args.extend(["--rootfs", &root, "/bin/sh", "-c", script]);
    podman(&args)
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn podman_usable(rootfs: &Path) -> bool {
    if !std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")))
    {
        skip("podman tests need root");
        return false;
    }
    match Command::new("podman").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => {
            skip("podman is not installed (Debian package podman)");
            return false;
        }
    }
    let probe = podman(&[
        "run",
        "--rm",
        "--runtime",
        "runc",
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
        "--rootfs",
        rootfs.to_str().expect("utf-8"),
        "/bin/sh",
        "-c",
        "echo ok",
    ]);
    if !(probe.status.success() && text(&probe).contains("ok")) {
        skip(&format!("podman cannot run containers here: {}", text(&probe)));
        return false;
    }
    true
}

fn alloc(dir: &Path) -> (String, String) {
    let out = ok(&tessera(dir, &["alloc", "--memory", "2GiB", "--sm", "20", "--lease", "container", "--json"]));
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    let cdi = v["cdi_devices"][0].as_str().expect("a CDI name").to_owned();
    (v["id"].as_str().expect("id").to_owned(), cdi)
}

fn listed(dir: &Path, id: &str) -> Option<serde_json::Value> {
    let list: serde_json::Value = serde_json::from_str(&ok(&tessera(dir, &["allocations", "--json"]))).expect("json");
    list.as_array().expect("array").iter().find(|a| a["id"] == id).cloned()
}

/// Waits (bounded) until `id` is bound to container `cid`.
fn wait_bound(dir: &Path, id: &str, cid: &str, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let a = listed(dir, id);
        if a.as_ref().is_some_and(|a| a["container"]["container_id"] == cid) {
            return;
        }
        assert!(Instant::now() < deadline, "{id} not bound to {cid}: {a:?}\n{}", read(log));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits (bounded: the lease pass's grace and more) until `id` is released; the daemon's reason.
fn wait_released(dir: &Path, id: &str, log: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    while listed(dir, id).is_some() {
        assert!(Instant::now() < deadline, "{id} was not released:\n{}", read(log));
        std::thread::sleep(Duration::from_millis(200));
    }
    read(log).lines().filter(|l| l.contains(id) && l.contains("lease ended")).collect::<Vec<_>>().join("\n")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// Nothing of allocation `id` is left: no directory, no region mount.
fn nothing_left(dir: &Path, id: &str) {
    let alloc_dir = dir.join("run/alloc").join(id);
    assert!(!alloc_dir.exists(), "{} is left", alloc_dir.display());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(!mounts.contains(&alloc_dir.display().to_string()), "a mount under {} is left", alloc_dir.display());
}

#[test]
fn a_cdi_container_deleted_or_killed_releases_its_lease() {
    let _l = lock();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let Some(rootfs) = busybox_rootfs(&dir.join("rootfs")) else { return };
    if !podman_usable(&rootfs) {
        return;
    }
    let host = FakeHost::new(dir, GPU0_DEVICES);
    let node = SimNode::with_description(ONE_H100);
    // tesserad writes its specs where podman reads them, in the version podman 4.3 takes.
    let injection = host
        .injection_config()
        .replace(&format!("{:?}", dir.join("cdi").display().to_string()), &format!("{CDI_DIR:?}"))
        + "cdi_version = \"0.5.0\"\n";
    let _specs = Specs;
    let (_daemon, log) = start_daemon(&node, dir, &injection);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let _ = node_api(&dir.join("run/tessera.sock")).await;
    });
    let spec = Path::new(CDI_DIR).join("tessera.io-gpu.json");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !spec.exists() {
        assert!(Instant::now() < deadline, "no spec in {CDI_DIR}:\n{}", read(&log));
        std::thread::sleep(Duration::from_millis(50));
    }

    // 1. Deleted while running (`podman rm -f`).
    let (id, cdi) = alloc(dir);
    let env = format!("TESSERA_ALLOCATION={id}");
    let out = podman_run(&rootfs, &["--device", &cdi, "-e", &env], "cat /run/tessera/alloc/limits; sleep 600");
    assert!(out.status.success(), "{}\n{}", text(&out), read(&log));
    let cid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    wait_bound(dir, &id, &cid, &log);
    let owner: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("run/alloc").join(&id).join("owner")).expect("owner record"))
            .expect("owner json");
    assert!(
        owner["runtime_state"].as_str().is_some_and(|s| s.ends_with(&cid)) || owner["cgroup"].is_string(),
        "the hook recorded nothing that vanishes with the container: {owner}"
    );
    let logs = podman(&["logs", &cid]);
    assert!(text(&logs).contains("sm_percent = 20"), "the container read its limits: {}", text(&logs));
    let rm = podman(&["rm", "-f", "-t", "0", &cid]);
    assert!(rm.status.success(), "{}", text(&rm));
    let why = wait_released(dir, &id, &log);
    println!("deleted: {why}");
    assert!(why.contains(&cid), "released for its container: {why}");
    nothing_left(dir, &id);

    // 2. Its process killed with SIGKILL (`--rm`: podman deletes what is left).
    let (id2, cdi) = alloc(dir);
    let env = format!("TESSERA_ALLOCATION={id2}");
    let out = podman_run(&rootfs, &["--rm", "--device", &cdi, "-e", &env], "sleep 600");
    assert!(out.status.success(), "{}\n{}", text(&out), read(&log));
    let cid2 = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    wait_bound(dir, &id2, &cid2, &log);
    let inspect = podman(&["inspect", "-f", "{{.State.Pid}}", &cid2]);
    let pid = String::from_utf8_lossy(&inspect.stdout).trim().parse::<i32>().expect("pid");
    assert!(pid > 1);
    // SAFETY: kill(2) on the container's init, a process this test started through podman.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let why = wait_released(dir, &id2, &log);
    println!("killed: {why}");
    assert!(why.contains(&cid2), "released for its container: {why}");
    nothing_left(dir, &id2);
    // The first allocation's neighbour on the GPU is unaffected: a plain one stays.
    let out = ok(&tessera(dir, &["alloc", "--memory", "1GiB", "--sm", "10", "--json"]));
    let plain: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(listed(dir, plain["id"].as_str().expect("id")).is_some(), "an unleased allocation stays");
}

/// A runtime that applies the CDI edits but runs no poststop entry for them (the case the lease
/// reconcile exists for): runc with the spec's `createRuntime` hook and environment only. The
/// hook records runc's state directory; deleting the container (`runc delete --force`), or
/// killing its process and deleting it, releases the lease by the reconcile alone.
#[test]
fn without_a_poststop_the_vanished_runtime_state_releases_the_lease() {
    let Some(RuncTest { tmp, rootfs, host }) = tessera_tests::runc_test(GPU0_DEVICES) else { return };
    let dir = tmp.path();
    let node = SimNode::with_description(ONE_H100);
    let (_daemon, log) = start_daemon(&node, dir, &host.injection_config());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let _ = node_api(&dir.join("run/tessera.sock")).await;
    });
    let state_root = dir.join("runc-state");
    let runc = |args: &[&str]| -> Output {
        Command::new("runc").arg("--root").arg(&state_root).args(args).output().expect("runc")
    };

    for (name, kill_first) in [("fn-deleted", false), ("fn-killed", true)] {
        let (id, cdi) = alloc(dir);
        let bundle = dir.join(name);
        let env = cdi_edits(&dir.join("cdi"), &cdi, &mut vec![format!("TESSERA_ALLOCATION={id}")]);
        tessera_tests::runc_bundle(&bundle, &rootfs, "sleep 600", &env.0, serde_json::Value::Null);
        let mut oci: serde_json::Value =
            serde_json::from_slice(&std::fs::read(bundle.join("config.json")).expect("config")).expect("json");
        oci["hooks"] = serde_json::json!({ "createRuntime": env.1 });
        std::fs::write(bundle.join("config.json"), oci.to_string()).expect("config");
        // Detached: the container must not hold the test's pipes.
        let status = Command::new("runc")
            .arg("--root")
            .arg(&state_root)
            .args(["run", "--detach", "--bundle", bundle.to_str().expect("utf-8"), name])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("runc run");
        assert!(status.success(), "runc run {name}:\n{}", read(&log));
        wait_bound(dir, &id, name, &log);
        let owner = std::fs::read_to_string(dir.join("run/alloc").join(&id).join("owner")).expect("owner");
        assert!(owner.contains(&state_root.join(name).display().to_string()), "runc's state dir recorded: {owner}");
        if kill_first {
            let out = runc(&["kill", name, "KILL"]);
            assert!(out.status.success(), "{}", text(&out));
            // Stopped, not deleted: the lease holds (past the lease pass's grace for a new record).
            std::thread::sleep(tessera_daemon::lease::STATE_GRACE + Duration::from_secs(2));
            assert!(listed(dir, &id).is_some(), "released while its container still exists");
        }
        let out = runc(&["delete", "--force", name]);
        assert!(out.status.success(), "{}", text(&out));
        let why = wait_released(dir, &id, &log);
        println!("{name}: {why}");
        assert!(why.contains("does not exist") && why.contains(name), "released by the reconcile: {why}");
        nothing_left(dir, &id);
    }
}

/// The environment and `createRuntime` hooks a CDI runtime applies for device `cdi` (the spec in
/// `spec_dir`), `env` first; poststop entries left out.
fn cdi_edits(spec_dir: &Path, cdi: &str, env: &mut Vec<String>) -> (Vec<String>, Vec<serde_json::Value>) {
    let (kind, name) = cdi.split_once('=').expect("a CDI name");
    let class = kind.rsplit('/').next().expect("class");
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(spec_dir.join(format!("tessera.io-{class}.json"))).expect("the device's spec"),
    )
    .expect("spec json");
    let device = spec["devices"].as_array().expect("devices").iter().find(|d| d["name"] == name).expect("the device");
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(String::from)).collect()
    };
    env.extend(strings(&spec["containerEdits"]["env"]));
    env.extend(strings(&device["containerEdits"]["env"]));
    let hooks = spec["containerEdits"]["hooks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|h| h["hookName"] == "createRuntime")
        .map(|h| serde_json::json!({ "path": h["path"], "args": h["args"], "env": h["env"] }))
        .collect();
    (env.clone(), hooks)
}
