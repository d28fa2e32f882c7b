//! A host without a kubelet: `tessera alloc` carves a share from the simulated GPU's free room;
//! a host process (no container) run with the answer's env and libtessera.so preloaded is held
//! to it, and while it runs `tessera limits set` moves its limit both ways; the allocation
//! survives `kill -9` of the daemon between Allocate and use; refusals name what is free;
//! `tessera release` gives everything back, twice without complaint.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Stdio};

use tessera_sim_testkit::SimNode;
use tessera_tests::kubelet::{cgroup_root, node_api, spawn};
use tessera_tests::{Tesserad, ok, shim, tessera};

const GIB: u64 = 1 << 30;
const OVERHEAD_MIB: u64 = 300;

/// A CUDA driver client (ctypes: the shim's dlsym path) taking "MiB" lines on stdin and
/// answering each with cuMemAlloc's result code: 0 success, 2 out of memory.
const DRIVER: &str = r#"
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
dev = ctypes.c_int()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
print("ready", flush=True)
for line in sys.stdin:
    ptr = ctypes.c_uint64()
    print(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(line) << 20)), flush=True)
"#;

struct Driver {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Driver {
    fn start(node: &SimNode, env: &serde_json::Map<String, serde_json::Value>, dir: &Path) -> Driver {
        let script = dir.join("driver.py");
        std::fs::write(&script, DRIVER).expect("script");
        let mut cmd = node.command("python3");
        cmd.arg(&script).env("LD_PRELOAD", shim()).stdin(Stdio::piped()).stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v.as_str().expect("env values are strings"));
        }
        let mut child = cmd.spawn().expect("python3");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("read");
        assert_eq!(line.trim(), "ready", "the driver client did not start");
        Driver { child, stdin, stdout }
    }

    /// cuMemAlloc of `mib` MiB: its result code.
    fn alloc(&mut self, mib: u64) -> u32 {
        writeln!(self.stdin, "{mib}").expect("write");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read");
        line.trim().parse().unwrap_or_else(|_| panic!("not a result code: {line:?}"))
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carved_share_limits_a_host_process_live_and_is_released() {
    if std::process::Command::new("python3").arg("--version").output().is_err() {
        assert!(
            std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(),
            "TESSERA_REQUIRE_RUNTIMES is set, but no python3"
        );
        println!("SKIP: python3 is not installed");
        return;
    }
    let node = SimNode::with_description(&format!(
        "context_overhead_mib = {OVERHEAD_MIB}\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n"
    ));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // Enforcement reports rather than kills: this flow checks what the shim does with a lowered
    // limit; with `kill` the daemon's next poll (within 500 ms, sooner than a loaded machine
    // runs the steps below) kills a process holding more than the new limit, newest first
    // (`daemon/tests/enforcement.rs`).
    let config = tessera_tests::kubelet::write_config(&node, dir, "[enforcement]\naction = \"report\"\n");
    let log = dir.join("tesserad.log");
    let mut daemon = spawn(&node, &config, &dir.join("no-notify"), &log);
    let mut api = node_api(&dir.join("run/tessera.sock")).await;
    let gpu = api
        .list_devices(tessera_proto::tessera::v1::ListDevicesRequest::default())
        .await
        .expect("devices")
        .into_inner()
        .devices
        .remove(0);

    // Allocate: one JSON object with what a container or a host process needs.
    let out = ok(&tessera(dir, &["alloc", "--memory", "2GiB", "--sm", "30", "--owner", "fn-1", "--json"]));
    let answer: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let id = answer["id"].as_str().expect("id").to_owned();
    assert_eq!(answer["devices"][0]["uuid"], gpu.uuid.as_str(), "{answer}");
    assert_eq!(answer["devices"][0]["memory_limit_bytes"], 2 * GIB, "{answer}");
    assert_eq!(answer["devices"][0]["sm_percent"], 30, "{answer}");
    assert_eq!(answer["cdi_devices"], serde_json::json!([format!("tessera.io/gpu={}", gpu.uuid)]));
    assert_eq!(answer["owner"], "fn-1");
    let env = answer["env"].as_object().expect("env").clone();
    let alloc_dir = dir.join("run/alloc").join(&id);
    assert_eq!(env["TESSERA_ALLOCATION"], id.as_str());
    assert_eq!(env["TESSERA_LIMITS"], alloc_dir.join("limits").to_str().unwrap());
    assert_eq!(env["TESSERA_REGION"], alloc_dir.join("region").to_str().unwrap());

    // Refusals say which GPU has how much free: all but 2 GiB, and 70% SM.
    let free = gpu.memory_bytes - 2 * GIB;
    let too_big = format!("{}B", free + (1 << 20));
    let out = tessera(dir, &["alloc", "--memory", &too_big, "--sm", "10"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("no GPU has room") && err.contains(&format!("GPU 0 ({}): {} MiB of", gpu.uuid, free >> 20)),
        "{err}"
    );
    let out = tessera(dir, &["alloc", "--memory", "1GiB", "--sm", "71"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("70% SM free"), "{err}");
    let out = tessera(dir, &["alloc", "--memory", "1GiB", "--sm", "10", "--gpu", "3"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no GPU \"3\""), "{out:?}");

    // The daemon is killed between Allocate and first use: the allocation is still there after
    // its restart, directory and all.
    drop(daemon);
    daemon = spawn(&node, &config, &dir.join("no-notify"), &log);
    let _ = node_api(&dir.join("run/tessera.sock")).await;
    let list: serde_json::Value = serde_json::from_str(&ok(&tessera(dir, &["allocations", "--json"]))).expect("json");
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(list[0]["id"], id.as_str());
    assert_eq!(list[0]["owner"], "fn-1");
    assert_eq!(list[0]["source"], "node_api");

    // A host process with the answer's env: 300 MiB of context + 1 GiB fit in 2 GiB, 1 more does not.
    let mut driver = Driver::start(&node, &env, dir);
    assert_eq!(driver.alloc(1024), 0);
    assert_eq!(driver.alloc(1024), 2, "past the 2 GiB limit: CUDA_ERROR_OUT_OF_MEMORY");
    // Raised while it runs: the same process gets the room at once.
    ok(&tessera(dir, &["limits", "set", &id, "--memory", "4GiB", "--sm", "50", "--priority", "high"]));
    assert_eq!(driver.alloc(1024), 0, "the running process sees the raised limit");
    let limits = std::fs::read_to_string(alloc_dir.join("limits")).expect("limits");
    assert!(limits.contains("priority = \"high\"") && limits.contains("sm_percent = 50"), "{limits}");
    // Lowered below what it holds: the shim refuses new allocations and takes nothing away.
    ok(&tessera(dir, &["limits", "set", &id, "--memory", "1GiB"]));
    assert_eq!(driver.alloc(1), 2, "the running process sees the lowered limit");
    let list: serde_json::Value = serde_json::from_str(&ok(&tessera(dir, &["allocations", "--json"]))).expect("json");
    assert_eq!(list[0]["devices"][0]["memory_limit_bytes"], GIB, "the record changed too: {list}");
    // Raising past the GPU is refused and changes nothing.
    let out = tessera(dir, &["limits", "set", &id, "--sm", "100", "--memory", "200GiB"]);
    let whole = format!("has {0} MiB of {0} MiB and 100% strict SM left", gpu.memory_bytes >> 20);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains(&whole), "{out:?}");
    assert!(std::fs::read_to_string(alloc_dir.join("limits")).expect("limits").contains("sm_percent = 50"));
    drop(driver);

    // Release: the record, the directory and its region go; twice is fine.
    assert!(ok(&tessera(dir, &["release", &id])).contains(&format!("released {id}")));
    assert!(!alloc_dir.exists());
    assert!(ok(&tessera(dir, &["release", &id])).contains("already released"));
    assert_eq!(ok(&tessera(dir, &["allocations", "--json"])).trim(), "[]");
    // The whole GPU's room is back.
    let all = format!("{}B", gpu.memory_bytes);
    ok(&tessera(dir, &["alloc", "--memory", &all, "--sm", "100"]));
    drop(daemon);
}

/// `tessera alloc --mig PROFILE` takes a free MIG device whole and `--whole N` whole GPUs with
/// nothing on them; both are exclusive against shares, in both directions, and refusals name
/// what holds each GPU or instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_devices_and_whole_gpus_through_the_cli() {
    let node = SimNode::with_description(
        "numa_nodes = 1\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\nmig = true\n\
         [[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n",
    );
    let (tesserad, _) = Tesserad::start(&node, "[partitions.\"0\"]\nmig = { \"3g.40gb\" = 2 }\n").await;
    let dir = tesserad.dir();
    let json = |args: &[&str]| -> serde_json::Value {
        let mut all = vec!["alloc"];
        all.extend(args);
        all.push("--json");
        serde_json::from_str(ok(&tessera(dir, &all)).trim()).expect("json")
    };
    let refused = |args: &[&str]| -> String {
        let mut all = vec!["alloc"];
        all.extend(args);
        let out = tessera(dir, &all);
        assert!(!out.status.success(), "{args:?} was not refused");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };

    // Two 3g.40gb instances: one each, then none, naming their holders.
    let m1 = json(&["--mig", "3g.40gb"]);
    let m2 = json(&["--mig", "3g.40gb", "--lease", "container"]);
    let (u1, u2) = (m1["devices"][0]["uuid"].as_str().unwrap(), m2["devices"][0]["uuid"].as_str().unwrap());
    assert!(u1.starts_with("MIG-") && u2.starts_with("MIG-") && u1 != u2, "{m1} {m2}");
    assert_eq!(m1["devices"][0]["kind"], "mig");
    assert_eq!(m1["resource"], "node-api/mig");
    assert_eq!(m1["cdi_devices"][0], format!("tessera.io/mig={u1}"));
    assert_eq!(m1["env"]["TESSERA_VISIBLE_DEVICES"], u1);
    let limits = std::fs::read_to_string(m1["env"]["TESSERA_LIMITS"].as_str().unwrap()).expect("limits");
    assert!(limits.contains(u1), "{limits}");
    let err = refused(&["--mig", "3g.40gb"]);
    let (i1, i2) = (m1["id"].as_str().unwrap(), m2["id"].as_str().unwrap());
    assert!(err.contains("no free MIG device of profile 3g.40gb") && err.contains(i1) && err.contains(i2), "{err}");
    assert!(refused(&["--mig", "7g.80gb"]).contains("no 7g.80gb instance"));

    // GPU 1 whole; then no share anywhere (GPU 0 is in MIG mode), no second whole GPU.
    let w = json(&["--whole", "1"]);
    let gpu1 = w["devices"][0]["uuid"].as_str().unwrap().to_owned();
    assert_eq!(
        (w["devices"][0]["kind"].as_str(), w["devices"][0]["memory_limit_bytes"].as_u64()),
        (Some("gpu"), Some(0))
    );
    assert_eq!(w["cdi_devices"][0], format!("tessera.io/gpu={gpu1}"));
    let err = refused(&["--memory", "1GiB", "--sm", "10"]);
    assert!(err.contains("MIG mode is on") && err.contains("): 0 MiB of ") && err.contains("0% SM free"), "{err}");
    assert!(refused(&["--whole", "1"]).contains("1 whole GPU asked, 0 free"));
    // Given back: a share is carved there, and the GPU is no longer given whole, naming the share.
    ok(&tessera(dir, &["release", w["id"].as_str().unwrap()]));
    let s = json(&["--memory", "1GiB", "--sm", "10"]);
    let err = refused(&["--whole", "1"]);
    assert!(err.contains(&format!("held by {}", s["id"].as_str().unwrap())), "{err}");
    // Asking for two kinds at once is a usage error.
    let err = refused(&["--whole", "1", "--memory", "1GiB", "--sm", "5"]);
    assert!(err.contains("cannot be used with"), "{err}");
    assert!(refused(&["--sm", "5"]).contains("--memory"));
}

/// `tessera-workload` on the allocation's host paths: with `shim` under libtessera.so (its
/// region mapped), else bypassing it (no `LD_PRELOAD`); in `cgroup` (a `cgroup.procs` file)
/// when given, moved there before it touches the GPU. Holds `mib` until killed; returns once it
/// says so (its output kept open).
fn holding(
    node: &SimNode,
    env: &serde_json::Map<String, serde_json::Value>,
    shim_loaded: bool,
    cgroup: Option<&Path>,
    mib: u64,
) -> Reaped {
    let exe = tessera_sim_testkit::binary("tessera-workload");
    let args = format!("--alloc-mib {mib} --hold 3600");
    let script = match cgroup {
        Some(procs) => format!("echo $$ > {procs:?} && exec {exe:?} {args}"),
        None => format!("exec {exe:?} {args}"),
    };
    let mut cmd = node.command("/bin/sh");
    cmd.arg("-c").arg(script).stdout(Stdio::piped()).env_remove("LD_PRELOAD");
    if shim_loaded {
        cmd.env("LD_PRELOAD", shim());
    }
    for (k, v) in env {
        cmd.env(k, v.as_str().expect("env values are strings"));
    }
    let mut child = cmd.spawn().expect("tessera-workload");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    let reaped = Reaped(child, out);
    assert!(line.contains("holding"), "the workload did not get its memory: {line:?}");
    reaped
}

/// A child killed and waited for when dropped (a failing test leaves none behind).
struct Reaped(Child, #[allow(dead_code)] BufReader<ChildStdout>);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Unattributed-process events up to and including the one for `pid`: the pids they name.
async fn unattributed_until(events: &mut tonic::Streaming<tessera_proto::tessera::v1::Event>, pid: u32) -> Vec<u32> {
    let mut seen = Vec::new();
    loop {
        let e = tokio::time::timeout(std::time::Duration::from_secs(30), events.message())
            .await
            .unwrap_or_else(|_| panic!("no unattributed_process event for pid {pid} in time; before it: {seen:?}"))
            .expect("event stream")
            .expect("event stream open");
        if let Some(tessera_proto::tessera::v1::event::Detail::UnattributedProcess(p)) = &e.detail {
            seen.push(p.pid);
            if p.pid == pid {
                return seen;
            }
        }
    }
}

/// Whether `/proc/<pid>/stat` says zombie.
fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
}

/// A process of an allocation that exits is listed by the driver for a moment after its
/// mappings and its region slot are gone (seen twice on an H200): no `unattributed_process`
/// for it, since it was attributed while it lived. The simulator holds exited processes in
/// NVML's lists (`tessera-sim exits hold`) and the test keeps the exited process a zombie (its
/// pid and start time still in `/proc`); a process of no allocation started after it is
/// reported, so a poll saw the exited one listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_attributed_in_its_life_is_not_reported_when_it_exits() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, mut api) = Tesserad::start(&node, "[enforcement]\naction = \"report\"\ninterval_ms = 100\n").await;
    let dir = tesserad.dir();
    let req = tessera_proto::tessera::v1::WatchEventsRequest {
        kinds: vec![tessera_proto::tessera::v1::EventKind::UnattributedProcess as i32],
        ..Default::default()
    };
    let mut events = api.watch_events(req).await.expect("watch").into_inner();
    let answer: serde_json::Value =
        serde_json::from_str(ok(&tessera(dir, &["alloc", "--memory", "4GiB", "--sm", "30", "--json"])).trim())
            .expect("json");
    let env = answer["env"].as_object().expect("env").clone();
    let sim = |what: &str| {
        let out = node.command(tessera_sim_testkit::binary("tessera-sim")).args(["exits", what]).output().unwrap();
        assert!(out.status.success(), "tessera-sim exits {what}: {out:?}");
    };
    sim("hold");

    // Alive under the shim (its region mapped): attributed at a poll, which also reports a
    // process of no allocation started after it.
    let mut member = holding(&node, &env, true, None, 512);
    let none = serde_json::Map::new();
    let stray = holding(&node, &none, false, None, 64);
    let reported = unattributed_until(&mut events, stray.0.id()).await;
    let pid = member.0.id();
    assert!(!reported.contains(&pid), "reported while it lived: {reported:?}");

    // It exits: its mappings go, its region slot is free to reap, and the driver lists it on.
    member.0.kill().expect("kill");
    while !zombie(pid) {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let later = holding(&node, &none, false, None, 64);
    let reported = unattributed_until(&mut events, later.0.id()).await;
    let listed = node.command(tessera_sim_testkit::binary("tessera-sim")).args(["status", "--json"]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&listed.stdout).replace([' ', '\n'], "").contains(&format!("\"pid\":{pid},")),
        "the exited process is still listed by the driver"
    );
    assert!(!reported.contains(&pid), "an exited process of an allocation was reported: {reported:?}");
    sim("release");
}

/// A cgroup directory, removed (with its parent) when dropped.
struct CgroupDir(std::path::PathBuf, std::path::PathBuf);

impl Drop for CgroupDir {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.1).is_ok() || !self.1.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A host process of a node API allocation that bypasses the shim (`tessera-workload` without
/// `LD_PRELOAD`) is enforced as a container's is, found by the cgroup its caller named
/// (`tessera alloc --cgroup`): past the share's memory the newest of its processes is killed,
/// with a `limit_breach` for the allocation (it was an `unattributed_process`, never enforced);
/// one within it and a process beside the cgroup are left alone. Naming the root cgroup, or
/// the cgroup's file system path, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_process_bypassing_the_shim_is_held_to_its_share_by_its_cgroup() {
    use std::os::unix::process::ExitStatusExt;
    use tessera_proto::tessera::v1 as api;
    let Some(root) = cgroup_root() else { return };
    let node = SimNode::with_description(&format!(
        "context_overhead_mib = {OVERHEAD_MIB}\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n"
    ));
    let (tesserad, mut api) = Tesserad::start(&node, "[enforcement]\naction = \"kill\"\ninterval_ms = 200\n").await;
    let dir = tesserad.dir();

    // The platform's cgroup for the function, and the name /proc/<pid>/cgroup gives it.
    let name = format!("/tessera-fn-{}/fn-1", std::process::id());
    let parent = root.join(format!("tessera-fn-{}", std::process::id()));
    let cgroup = CgroupDir(parent, root.join(&name[1..]));
    std::fs::create_dir_all(&cgroup.1).expect("make the cgroup");
    let procs = cgroup.1.join("cgroup.procs");

    // What would take every process of the node, or is not what /proc shows: refused.
    for (bad, why) in [("/", "root cgroup"), ("/sys/fs/cgroup/pids/fn", "file system path")] {
        let out = tessera(dir, &["alloc", "--memory", "1GiB", "--sm", "10", "--cgroup", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("cgroup: ") && err.contains(why), "{bad}: {err}");
    }
    assert_eq!(ok(&tessera(dir, &["allocations", "--json"])).trim(), "[]", "nothing allocated by a refusal");

    let answer: serde_json::Value = serde_json::from_str(
        ok(&tessera(dir, &["alloc", "--memory", "2GiB", "--sm", "30", "--cgroup", &name, "--json"])).trim(),
    )
    .expect("json");
    let id = answer["id"].as_str().expect("id").to_owned();
    let env = answer["env"].as_object().expect("env").clone();
    let req = api::WatchEventsRequest {
        kinds: vec![api::EventKind::LimitBreach as i32, api::EventKind::UnattributedProcess as i32],
        ..Default::default()
    };
    let mut events = api.watch_events(req).await.expect("watch").into_inner();

    // Within the share (1 GiB + its context), then beside the cgroup (no allocation's).
    let mut modest = holding(&node, &env, false, Some(&procs), 1024);
    let mut beside = holding(&node, &serde_json::Map::new(), false, None, 3072);
    // Past the share with the first: 1 + 1.5 GiB and two contexts in 2 GiB. The newest goes.
    let mut greedy = holding(&node, &env, false, Some(&procs), 1536);
    let held = std::time::Instant::now();
    let status = greedy.0.wait().expect("wait");
    println!(
        "serverless host: a bypassing process over its share, found by its cgroup, was killed {} ms after it held the memory",
        held.elapsed().as_millis()
    );
    assert_eq!(status.signal(), Some(9), "SIGKILLed: {status:?}");

    let mut unattributed = Vec::new();
    let breach = loop {
        let e = tokio::time::timeout(std::time::Duration::from_secs(30), events.message())
            .await
            .expect("a limit_breach in time")
            .expect("event stream")
            .expect("event stream open");
        match e.detail {
            Some(api::event::Detail::UnattributedProcess(p)) => unattributed.push(p.pid),
            Some(api::event::Detail::LimitBreach(b)) => break b,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(breach.allocation_id, id);
    assert_eq!(breach.action, api::BreachAction::Killed as i32);
    assert_eq!(breach.killed_pids, [greedy.0.id()]);
    assert_eq!(breach.used_bytes, (1024 + 1536 + 2 * OVERHEAD_MIB) << 20);
    assert_eq!(breach.limit_bytes, 2 * GIB);
    assert!(!unattributed.contains(&greedy.0.id()) && !unattributed.contains(&modest.0.id()), "{unattributed:?}");
    assert!(modest.0.try_wait().expect("try_wait").is_none(), "within its share: left alone");
    assert!(beside.0.try_wait().expect("try_wait").is_none(), "beside the cgroup: never this allocation's");
}

/// The same cgroup holds the allocation's processes to its strict SM share: a bypassing
/// `tessera-workload` launching back to back in a 25% share is SIGKILLed once a 1 s window holds
/// more than its share plus the tolerance, with a `limit_breach` (`limit` SM) for the allocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_process_bypassing_the_shim_is_held_to_its_sm_share_by_its_cgroup() {
    use std::os::unix::process::ExitStatusExt;
    use tessera_proto::tessera::v1 as api;
    let Some(root) = cgroup_root() else { return };
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, mut api) = Tesserad::start(
        &node,
        "[enforcement]\naction = \"kill\"\nsm_action = \"kill\"\ninterval_ms = 100\nsm_window_ms = 1000\n",
    )
    .await;
    let dir = tesserad.dir();
    let name = format!("/tessera-fn-sm-{}/fn-1", std::process::id());
    let cgroup = CgroupDir(root.join(format!("tessera-fn-sm-{}", std::process::id())), root.join(&name[1..]));
    std::fs::create_dir_all(&cgroup.1).expect("make the cgroup");
    let answer: serde_json::Value = serde_json::from_str(
        ok(&tessera(
            dir,
            &["alloc", "--memory", "2GiB", "--sm", "25", "--compute-mode", "strict", "--cgroup", &name, "--json"],
        ))
        .trim(),
    )
    .expect("json");
    let id = answer["id"].as_str().expect("id").to_owned();
    let req = api::WatchEventsRequest {
        kinds: vec![api::EventKind::LimitBreach as i32, api::EventKind::UnattributedProcess as i32],
        ..Default::default()
    };
    let mut events = api.watch_events(req).await.expect("watch").into_inner();

    // Back to back, 16 kernels of 1 ms in flight, no shim: all of the GPU.
    let exe = tessera_sim_testkit::binary("tessera-workload");
    let script = format!(
        "echo $$ > {:?} && exec {exe:?} --kernel-us 1000 --depth 16 --rate 0 --seconds 30",
        cgroup.1.join("cgroup.procs")
    );
    let started = std::time::Instant::now();
    let mut spinner = node
        .command("/bin/sh")
        .arg("-c")
        .arg(script)
        .env_remove("LD_PRELOAD")
        .stdout(Stdio::null())
        .spawn()
        .expect("tessera-workload");
    let status = spinner.wait().expect("wait");
    println!(
        "serverless host: a bypassing process over its SM share, found by its cgroup, was killed {} ms after it started",
        started.elapsed().as_millis()
    );
    assert_eq!(status.signal(), Some(9), "SIGKILLed: {status:?}");
    let e = tokio::time::timeout(std::time::Duration::from_secs(30), events.message())
        .await
        .expect("an event in time")
        .expect("event stream")
        .expect("event stream open");
    let Some(api::event::Detail::LimitBreach(b)) = &e.detail else { panic!("not a limit_breach: {}", e.message) };
    assert_eq!((b.allocation_id.as_str(), b.limit), (id.as_str(), api::BreachLimit::Sm as i32), "{}", e.message);
    assert_eq!(b.killed_pids, [spinner.id()]);
    assert_eq!((b.sm_percent_limit, b.window_ms), (25, 1000));
}
