//! Park and resume through the node API and the CLI (issue 33) on the simulated node: a host
//! process under libtessera.so, in a carved share, is parked (NVML shows its memory freed, the
//! allocation lists as parked), its resume is refused while the GPU is full and says how much it
//! needs, then it resumes and runs on (its data across a park: daemon/tests/park.rs). Bad input: an unknown id, an
//! allocation with no process, a resume of a running one, a second park of a parked one, a share
//! whose program exports memory by CUDA IPC, a lock timeout the CLI cannot read.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Stdio};

use tessera_proto::tessera::v1 as api;
use tessera_sim_model::Node;
use tessera_sim_testkit::SimNode;
use tessera_tests::kubelet::{node_api, spawn};
use tessera_tests::{Tesserad, ok, shim, tessera};
use tonic::Code;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// A workload killed and waited for when dropped (a failing test leaves none behind).
struct Reaped(Child, #[allow(dead_code)] BufReader<ChildStdout>);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Reaped {
    fn alive(mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

fn used(m: &Node) -> u64 {
    m.memory_info(0, 0).expect("NVML memory").used
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_parks_frees_its_gpu_memory_and_resumes_when_it_fits() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, mut api) = Tesserad::start(&node, "").await;
    let dir = tesserad.dir();
    let show_log = || tesserad.log();
    let m = Node::open(None, Some(&node.state)).expect("the simulated node");

    // An unknown id: NOT_FOUND, naming it.
    let e = api.park(api::ParkRequest { allocation_id: "a-0000000000000000".into(), ..Default::default() }).await;
    let e = e.expect_err("unknown id");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(e.message().contains("a-0000000000000000"), "{}", e.message());

    let out = ok(&tessera(dir, &["alloc", "--memory", "2GiB", "--sm", "30", "--json"]));
    let answer: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let id = answer["id"].as_str().expect("id").to_owned();
    let env = answer["env"].as_object().expect("env").clone();
    let park = |id: &str| api::ParkRequest { allocation_id: id.into(), ..Default::default() };
    let resume = |id: &str| api::ResumeRequest { allocation_id: id.into() };

    // No process yet: nothing to park; and a running allocation has nothing to resume.
    let e = api.clone().park(park(&id)).await.expect_err("no process");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("has no process"), "{}", e.message());
    let e = api.clone().resume(resume(&id)).await.expect_err("running");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("is running, not parked"), "{}", e.message());

    // A host process under the shim holding 1 GiB.
    let mut cmd = node.command(tessera_sim_testkit::binary("tessera-workload"));
    cmd.args(["--alloc-mib", "1024", "--hold", "3600"]).stdout(Stdio::piped());
    cmd.env("LD_PRELOAD", shim());
    for (k, v) in &env {
        cmd.env(k, v.as_str().expect("env values are strings"));
    }
    let mut child = cmd.spawn().expect("tessera-workload");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    let pid = child.id();
    let mut workload = Reaped(child, out);
    let before = used(&m);
    assert!(before >= GIB, "the workload holds its GiB: {before}");

    let parked = api.clone().park(park(&id)).await.unwrap_or_else(|e| panic!("{e:?}\n{}", show_log())).into_inner();
    assert_eq!(parked.pids, vec![pid]);
    assert!(parked.bytes >= GIB, "{}", parked.bytes);
    assert_eq!(parked.allocation.as_ref().expect("allocation").state, api::AllocationState::Parked as i32);
    assert_eq!(used(&m), 0, "NVML: its memory is free");
    let list = ok(&tessera(dir, &["allocations", "--json"]));
    assert!(list.contains("\"state\":\"parked\""), "{list}");
    assert!(ok(&tessera(dir, &["allocations"])).contains("parked"));
    // Parked twice: refused, it stays parked.
    let e = api.clone().park(park(&id)).await.expect_err("parked already");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("is parked, not running"), "{}", e.message());

    // Its 2 GiB are free for admission while it is parked: a share of all but 1 GiB of the GPU
    // is admitted; its resume is then refused by admission, naming the GPU and what is free.
    let devices = api.list_devices(api::ListDevicesRequest::default()).await.expect("devices").into_inner();
    let total = devices.devices.iter().map(|d| d.memory_bytes).max().expect("a GPU");
    let big = api
        .allocate(api::AllocateRequest { memory_bytes: total - GIB, sm_percent: 10, ..Default::default() })
        .await
        .unwrap_or_else(|e| panic!("the parked share's room is free: {e:?}\n{}", show_log()))
        .into_inner()
        .allocation
        .expect("allocation")
        .id;
    let e = api.clone().resume(resume(&id)).await.expect_err("no room by the records");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("needs 2.00 GiB, 1.00 GiB are free") && e.message().contains("GPU 0"),
        "{}",
        e.message()
    );
    let over = api::AllocateRequest { memory_bytes: GIB + 1, sm_percent: 10, ..Default::default() };
    assert_eq!(api.clone().allocate(over).await.expect_err("full").code(), Code::ResourceExhausted);
    assert!(api.release(api::ReleaseRequest { allocation_id: big }).await.expect("release").into_inner().released);

    // The GPU taken but for 64 MiB: the resume is refused saying what it needs, and it stays parked.
    let free = m.memory_info(0, 0).expect("NVML").free;
    m.alloc(0, 0, free - 64 * MIB).expect("fill the GPU");
    let e = api.clone().resume(resume(&id)).await.expect_err("no room");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("does not fit") && e.message().contains("GiB"), "{}", e.message());
    let cli = tessera(dir, &["resume", &id]);
    let out = String::from_utf8_lossy(&cli.stderr);
    assert!(!cli.status.success(), "the CLI fails too: {out}");
    assert!(out.contains("does not fit"), "{out}");
    assert!(ok(&tessera(dir, &["allocations", "--json"])).contains("\"state\":\"parked\""));
    m.free(0, 0, free - 64 * MIB);

    // Room again: the CLI resumes it, and its memory is back.
    let out = ok(&tessera(dir, &["resume", &id, "--json"]));
    let resumed: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(resumed["state"], "running", "{resumed}");
    assert_eq!(used(&m), before);
    assert!(ok(&tessera(dir, &["allocations", "--json"])).contains("\"state\":\"running\""));
    // The CLI parks and resumes it again.
    assert!(ok(&tessera(dir, &["park", &id])).contains("now parked"));
    assert_eq!(used(&m), 0);
    assert!(ok(&tessera(dir, &["resume", &id])).contains("now running"));
    assert_eq!(used(&m), before);
    assert!(matches!(workload.0.try_wait(), Ok(None)), "the workload runs on after two parks and resumes");
    // Parked with its process alive, it cannot be released (the process would stay locked);
    // with the process gone it can.
    assert!(ok(&tessera(dir, &["park", &id])).contains("now parked"));
    let e = api.clone().release(api::ReleaseRequest { allocation_id: id.clone() }).await.expect_err("locked process");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains(&format!("`tessera resume {id}` first")), "{}", e.message());
    drop(workload);
    assert!(
        api.release(api::ReleaseRequest { allocation_id: id.clone() }).await.expect("release").into_inner().released
    );
    assert!(!dir.join("state/park").join(&id).exists(), "its journal entry goes with it");
    // Events: each park and resume, with its bytes and duration (refusals are none).
    let events = ok(&tessera(dir, &["events", "--replay", "100", "--json"]));
    let moves: Vec<serde_json::Value> = events
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("one JSON object a line"))
        .filter(|e| e["kind"] == "ALLOCATION_PARKED" || e["kind"] == "ALLOCATION_RESUMED")
        .collect();
    let kinds: Vec<&str> = moves.iter().map(|e| e["kind"].as_str().unwrap_or("")).collect();
    assert_eq!(
        kinds,
        ["ALLOCATION_PARKED", "ALLOCATION_RESUMED", "ALLOCATION_PARKED", "ALLOCATION_RESUMED", "ALLOCATION_PARKED"],
        "{events}"
    );
    for e in &moves {
        assert_eq!(e["detail"]["allocation_id"], id.as_str(), "{e}");
        assert!(e["detail"]["bytes"].as_u64().is_some_and(|b| b >= GIB), "{e}");
        assert!(e["detail"]["duration_nanos"].as_u64().is_some(), "{e}");
        assert_eq!(e["detail"]["pids"], serde_json::json!([pid]), "{e}");
    }
}

/// `kill -9` of tesserad with an allocation parked, mid-park (its processes locked, the journal
/// saying `parking`) and with a damaged journal entry: a restart keeps the parked one parked (it
/// resumes), rolls the one in flight back to running (no process left locked), and moves the
/// damaged entry aside.
#[test]
fn a_killed_tesserad_finishes_or_rolls_back_its_parks_at_start() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    // In a child pointed at the node: the test locks a process through the sim's checkpoint API.
    node.run_isolated("a_killed_tesserad_finishes_or_rolls_back_its_parks_at_start", || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        rt.block_on(killed_tesserad(&node));
    });
}

async fn killed_tesserad(node: &SimNode) {
    use tessera_daemon::allocator::park::JournalEntry;
    use tessera_daemon::park::{Checkpointer, ProcessState};
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let config = tessera_tests::kubelet::write_config(node, dir, "");
    let log = dir.join("tesserad.log");
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let socket = dir.join("run/tessera.sock");
    let daemon = spawn(node, &config, &dir.join("no-notify"), &log);
    let mut api = node_api(&socket).await;
    let m = Node::open(None, Some(&node.state)).expect("the simulated node");
    let ck = Checkpointer::load(&node.cuda_path()).expect("the sim's checkpoint API");

    let mut workloads = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let out = ok(&tessera(dir, &["alloc", "--memory", "2GiB", "--sm", "30", "--json"]));
        let answer: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
        ids.push(answer["id"].as_str().expect("id").to_owned());
        let mut cmd = node.command(tessera_sim_testkit::binary("tessera-workload"));
        cmd.args(["--alloc-mib", "512", "--hold", "3600"]).stdout(Stdio::piped()).env("LD_PRELOAD", shim());
        for (k, v) in answer["env"].as_object().expect("env") {
            cmd.env(k, v.as_str().expect("env values are strings"));
        }
        let mut child = cmd.spawn().expect("tessera-workload");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        out.read_line(&mut String::new()).expect("read");
        workloads.push(Reaped(child, out));
    }
    let (parked_id, inflight_id) = (&ids[0], &ids[1]);
    let (parked_pid, inflight_pid) = (workloads[0].0.id(), workloads[1].0.id());
    let before = used(&m);
    api.park(api::ParkRequest { allocation_id: parked_id.clone(), ..Default::default() })
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", show_log()));
    drop(daemon); // SIGKILL

    // Killed mid-park of the second: its process locked, the journal saying `parking`.
    ck.lock(inflight_pid, None).expect("lock");
    let journal = dir.join("state/park");
    let entry = JournalEntry {
        id: inflight_id.clone(),
        state: "parking".into(),
        pids: vec![inflight_pid],
        bytes: 512 << 20,
        preempted_by: None,
    };
    std::fs::write(journal.join(inflight_id), entry.encode()).expect("journal");
    // And a damaged entry for an allocation that does not exist.
    std::fs::write(journal.join("a-00000000000000ff"), b"{\"id\":\"a-00000000000000ff\"}\n00000000\n")
        .expect("damaged");

    let _daemon = spawn(node, &config, &dir.join("no-notify"), &log);
    let mut api = node_api(&socket).await;
    assert_eq!(
        ck.state(inflight_pid).expect("state"),
        ProcessState::Running,
        "rolled back, not left locked\n{}",
        show_log()
    );
    assert!(!journal.join(inflight_id).exists(), "its entry is gone");
    assert_eq!(ck.state(parked_pid).expect("state"), ProcessState::Checkpointed, "the park journalled as done stays");
    assert!(journal.join("a-00000000000000ff.corrupt").exists(), "the damaged entry is moved aside");
    let list = api.list_allocations(api::ListAllocationsRequest::default()).await.expect("list").into_inner();
    let state = |id: &str| list.allocations.iter().find(|a| a.id == id).expect("listed").state;
    assert_eq!(state(parked_id), api::AllocationState::Parked as i32);
    assert_eq!(state(inflight_id), api::AllocationState::Running as i32);
    assert!(used(&m) < before, "the parked one's memory is still free");
    // The parked one resumes through the restarted daemon.
    let resumed = api
        .resume(api::ResumeRequest { allocation_id: parked_id.clone() })
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", show_log()))
        .into_inner();
    assert_eq!(resumed.pids, vec![parked_pid]);
    assert_eq!(used(&m), before);
    assert!(!journal.join(parked_id).exists());
    for w in workloads {
        assert!(w.alive(), "both workloads run on");
    }
}

// Preemption by priority (issue 33, item 3).

/// `tessera alloc ARGS --json`: the allocation's id and env.
fn alloc(dir: &std::path::Path, args: &[&str]) -> (String, serde_json::Map<String, serde_json::Value>) {
    let mut all = vec!["alloc"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = ok(&tessera(dir, &all));
    let answer: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let id = answer["id"].as_str().expect("id").to_owned();
    (id, answer["env"].as_object().expect("env").clone())
}

/// A `tessera-workload` under the shim in an allocation's env, holding its memory (`args`), once
/// it says so.
fn workload(node: &SimNode, env: &serde_json::Map<String, serde_json::Value>, args: &[&str]) -> Reaped {
    let mut cmd = node.command(tessera_sim_testkit::binary("tessera-workload"));
    cmd.args(args).stdout(Stdio::piped()).env("LD_PRELOAD", shim());
    for (k, v) in env {
        cmd.env(k, v.as_str().expect("env values are strings"));
    }
    let mut child = cmd.spawn().expect("tessera-workload");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    assert!(line.contains("holding"), "the workload holds its memory: {line}");
    Reaped(child, out)
}

impl Reaped {
    /// Waits for the workload to end: whether it succeeded, and its report (its last line).
    fn report(&mut self) -> (bool, serde_json::Value) {
        let ok = self.0.wait().expect("wait").success();
        let last = (&mut self.1).lines().map_while(Result::ok).filter(|l| !l.trim().is_empty()).last();
        (ok, serde_json::from_str(&last.unwrap_or_default()).unwrap_or_default())
    }
}

/// `tessera allocations --json`, by id.
fn listed(dir: &std::path::Path) -> std::collections::HashMap<String, serde_json::Value> {
    let list: serde_json::Value =
        serde_json::from_str(&ok(&tessera(dir, &["allocations", "--json"]))).expect("a JSON array");
    list.as_array().expect("array").iter().map(|a| (a["id"].as_str().expect("id").to_owned(), a.clone())).collect()
}

/// `id`'s state and the allocation it was preempted by, as `tessera allocations --json` says.
fn state(dir: &std::path::Path, id: &str) -> (String, String) {
    let all = listed(dir);
    let a = all.get(id).unwrap_or_else(|| panic!("{id} is listed: {all:?}"));
    (a["state"].as_str().expect("state").to_owned(), a["preempted_by"].as_str().expect("preempted_by").to_owned())
}

/// Polls (bounded) until `id` is in `want` state, as the CLI lists it.
async fn wait_state(dir: &std::path::Path, id: &str, want: &str) {
    let log = dir.join("tesserad.log");
    tessera_tests::kubelet::eventually(std::time::Duration::from_secs(60), &log, || {
        let (now, by) = state(dir, id);
        if now == want { Ok(()) } else { Err(format!("{id} is {now} (preempted by {by:?}), not {want}")) }
    })
    .await;
}

/// The `allocation_parked` / `allocation_resumed` events so far: (kind, allocation, reason).
fn park_events(dir: &std::path::Path) -> Vec<(String, String, String)> {
    let events = ok(&tessera(dir, &["events", "--replay", "1000", "--json"]));
    events
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("one JSON object a line"))
        .filter(|e| e["kind"] == "ALLOCATION_PARKED" || e["kind"] == "ALLOCATION_RESUMED")
        .map(|e| {
            let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
            (s(&e["kind"]), s(&e["detail"]["allocation_id"]), s(&e["detail"]["reason"]))
        })
        .collect()
}

/// A share for [`busy_workload`]: work conserving, since under a strict share of 20% a kernel
/// of two minutes is over its share, and enforcement kills the process within seconds (a park
/// then fails on a process gone, not on a busy one).
const BUSY_SHARE: [&str; 6] = ["--memory", "20GiB", "--sm", "20", "--compute-mode", "work-conserving"];

/// A `tessera-workload` under the shim in an allocation's env, busy with one kernel of two
/// minutes, once the simulated GPU shows it running: a lock waits for its GPU work.
async fn busy_workload(
    node: &SimNode,
    env: &serde_json::Map<String, serde_json::Value>,
    dir: &std::path::Path,
) -> Reaped {
    let m = Node::open(None, Some(&node.state)).expect("the simulated node");
    let mut cmd = node.command(tessera_sim_testkit::binary("tessera-workload"));
    cmd.args(["--alloc-mib", "64", "--kernels", "1", "--kernel-us", "120000000", "--hold", "3600"]);
    cmd.stdout(Stdio::piped()).env("LD_PRELOAD", shim());
    for (k, v) in env {
        cmd.env(k, v.as_str().expect("env values are strings"));
    }
    let mut child = cmd.spawn().expect("tessera-workload");
    let pid = child.id();
    let out = BufReader::new(child.stdout.take().expect("stdout"));
    let busy = Reaped(child, out);
    tessera_tests::kubelet::eventually(std::time::Duration::from_secs(60), &dir.join("tesserad.log"), || {
        let w = m.utilization(0, 0).map_err(|e| e.to_string())?;
        let running = w.processes.iter().any(|(p, pct)| *p == pid && *pct > 0);
        if running { Ok(()) } else { Err(format!("{pid} runs no kernel yet: {:?}", w.processes)) }
    })
    .await;
    busy
}

fn high(memory_bytes: u64) -> api::AllocateRequest {
    api::AllocateRequest { memory_bytes, sm_percent: 10, priority: api::Priority::High as i32, ..Default::default() }
}

/// The GPU's memory as the node API counts it.
async fn gpu_memory(api: &mut tessera_proto::tessera::v1::node_client::NodeClient<tonic::transport::Channel>) -> u64 {
    let devices = api.list_devices(api::ListDevicesRequest::default()).await.expect("devices").into_inner();
    devices.devices.iter().map(|d| d.memory_bytes).max().expect("a GPU")
}

/// Prometheus `/metrics` at `addr`, its body.
fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("metrics");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    out
}

/// (a) A low-priority preemptible share with a live process fills the GPU; a high-priority
/// Allocate that does not fit succeeds by parking it (NVML shows its memory freed, the listing
/// and the event name the new allocation); releasing the new one resumes it ("room back"), and
/// the process's data is intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_of_higher_priority_parks_a_preemptible_one_which_resumes_once_the_room_is_back() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr");
    let (tesserad, mut api) = Tesserad::start(&node, &format!("[telemetry]\nmetrics_listen = \"{port}\"\n")).await;
    let dir = tesserad.dir();
    let show_log = || tesserad.log();
    let m = Node::open(None, Some(&node.state)).expect("the simulated node");
    let total = gpu_memory(&mut api).await;

    // All but 20 GiB of the GPU, low priority, preemptible, with a process holding 256 MiB and
    // a pattern it reads back after its hold.
    let low_size = format!("{}B", total - 20 * GIB);
    let (low, env) = alloc(dir, &["--memory", &low_size, "--sm", "30", "--priority", "low", "--preemptible"]);
    let mut w = workload(&node, &env, &["--alloc-mib", "256", "--verify", "--hold", "20"]);
    let before = used(&m);
    assert!(before >= 256 * MIB, "the workload holds its memory: {before}");
    let table = ok(&tessera(dir, &["allocations"]));
    assert!(table.contains("running (preemptible)"), "{table}");
    assert_eq!(listed(dir)[&low]["preemptible"], true);

    // 30 GiB at high priority: it does not fit beside the low one, which is parked for it.
    let made = api.allocate(high(30 * GIB)).await.unwrap_or_else(|e| panic!("{e:?}\n{}", show_log())).into_inner();
    let top = made.allocation.expect("allocation").id;
    assert_eq!(state(dir, &low), ("parked".to_owned(), top.clone()));
    assert_eq!(used(&m), 0, "NVML: the parked process's memory is free");
    let table = ok(&tessera(dir, &["allocations"]));
    assert!(table.contains(&format!("parked (preempted by {top})")), "{table}");
    let events = park_events(dir);
    assert_eq!(
        events,
        [("ALLOCATION_PARKED".to_owned(), low.clone(), format!("preempted by {top}"))],
        "{}",
        show_log()
    );
    let metrics = scrape(&port.to_string());
    assert!(metrics.contains("\ntessera_preemptions_total 1\n"), "{metrics}");
    assert!(metrics.contains("\ntessera_allocations_parked 1\n"), "{metrics}");

    // Its room back: resumed on its own, its memory back, named as such.
    assert!(
        api.release(api::ReleaseRequest { allocation_id: top.clone() }).await.expect("release").into_inner().released
    );
    wait_state(dir, &low, "running").await;
    assert_eq!(state(dir, &low).1, "", "no longer preempted");
    assert_eq!(used(&m), before);
    let events = park_events(dir);
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[1], ("ALLOCATION_RESUMED".to_owned(), low.clone(), "room back".to_owned()));
    // The program went on where it stopped: its data read back after its hold.
    let (done, report) = w.report();
    assert!(done, "{report}");
    assert_eq!(report["verified_after_hold_bytes"], MIB, "its data intact: {report}");
}

/// (b, c, d) Only a preemptible share of lower priority is parked, the lowest priority first
/// and as few as needed, and only when that makes room: beside a low share that is not
/// preemptible and a high one that is, parking the low and the normal preemptible shares would
/// not make room for a high ask, so nothing is parked and the refusal says so; an ask either one
/// makes room for parks the low one alone; one that needs both parks both, and both resume; with
/// only the share that is not preemptible left, a high ask is refused as before, nothing parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_preemptible_shares_of_lower_priority_are_parked_and_only_when_that_makes_room() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, mut api) = Tesserad::start(&node, "").await;
    let dir = tesserad.dir();
    let show_log = || tesserad.log();
    let total = gpu_memory(&mut api).await;
    let hold = ["--alloc-mib", "64", "--hold", "3600"];
    let (fixed, env) = alloc(dir, &["--memory", "30GiB", "--sm", "20", "--priority", "low"]);
    let _w1 = workload(&node, &env, &hold);
    let (peer, env) = alloc(dir, &["--memory", "30GiB", "--sm", "20", "--priority", "high", "--preemptible"]);
    let w2 = workload(&node, &env, &hold);
    let (low, env) = alloc(dir, &["--memory", "10GiB", "--sm", "20", "--priority", "low", "--preemptible"]);
    let w3 = workload(&node, &env, &hold);
    // Newer and smaller than the low one, but of higher priority.
    let (mid, env) = alloc(dir, &["--memory", "5GiB", "--sm", "10", "--priority", "normal", "--preemptible"]);
    let w4 = workload(&node, &env, &hold);
    let free = total - 75 * GIB;
    let all_running = || {
        for id in [&fixed, &peer, &low, &mid] {
            assert_eq!(state(dir, id), ("running".to_owned(), String::new()), "{id}\n{}", show_log());
        }
    };

    // (d, b, c) Parking the low and the normal preemptible shares frees 15 GiB: not enough for
    // 16 GiB more than is free. The low share that is not preemptible, and the high one, would
    // make room: neither is parked, and neither is anything else.
    let e = api.allocate(high(free + 16 * GIB)).await.expect_err("no room");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains("parking the preemptible allocations of lower priority would not make room either")
            && e.message().contains("nothing was parked"),
        "{}",
        e.message()
    );
    all_running();
    assert!(park_events(dir).is_empty());

    // 5 GiB more than is free: either would make room; the low one is parked, and only it.
    let made = api.allocate(high(free + 5 * GIB)).await.unwrap_or_else(|e| panic!("{e:?}\n{}", show_log()));
    let top = made.into_inner().allocation.expect("allocation").id;
    assert_eq!(state(dir, &low), ("parked".to_owned(), top.clone()));
    for id in [&fixed, &peer, &mid] {
        assert_eq!(state(dir, id).0, "running", "{id}");
    }
    assert!(api.release(api::ReleaseRequest { allocation_id: top }).await.expect("release").into_inner().released);
    wait_state(dir, &low, "running").await;

    // 12 GiB more than is free: the low one is not enough alone, so both are parked; both resume
    // once it is released.
    let made = api.allocate(high(free + 12 * GIB)).await.unwrap_or_else(|e| panic!("{e:?}\n{}", show_log()));
    let top = made.into_inner().allocation.expect("allocation").id;
    for id in [&low, &mid] {
        assert_eq!(state(dir, id), ("parked".to_owned(), top.clone()), "{id}");
    }
    for id in [&fixed, &peer] {
        assert_eq!(state(dir, id).0, "running", "{id}");
    }
    assert!(api.release(api::ReleaseRequest { allocation_id: top }).await.expect("release").into_inner().released);
    wait_state(dir, &low, "running").await;
    wait_state(dir, &mid, "running").await;
    let events = park_events(dir);
    assert_eq!(events.iter().filter(|e| e.0 == "ALLOCATION_PARKED").count(), 3, "{events:?}");
    // In one pass, the higher priority first.
    let resumed = |id: &String| ("ALLOCATION_RESUMED".to_owned(), id.clone(), "room back".to_owned());
    assert_eq!(events[events.len() - 2..], [resumed(&mid), resumed(&low)], "{events:?}");

    // (b) Only the share that is not preemptible left beside the free room: a high ask it would
    // make room for is refused as it always was (no word of parking), and it runs on.
    drop((w2, w3, w4));
    for id in [&peer, &low, &mid] {
        let released = api.release(api::ReleaseRequest { allocation_id: id.clone() }).await.expect("release");
        assert!(released.into_inner().released, "{id}");
    }
    let e = api.allocate(high(total - 30 * GIB + GIB)).await.expect_err("no room");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(!e.message().contains("park"), "{}", e.message());
    assert_eq!(state(dir, &fixed), ("running".to_owned(), String::new()));
    let parks = park_events(dir).into_iter().filter(|e| e.0 == "ALLOCATION_PARKED").count();
    assert_eq!(parks, 3, "no more preemption: {:?}", park_events(dir));
}

/// A preempted share resumes whichever way its room comes back: here its preemptor is leased
/// to a container, and the lease pass releases it once that container is deleted (no node API
/// `Release`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_share_resumes_when_its_preemptors_lease_ends() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, mut api) = Tesserad::start(&node, "").await;
    let dir = tesserad.dir();
    let total = gpu_memory(&mut api).await;
    let low_size = format!("{}B", total - 20 * GIB);
    let (low, env) = alloc(dir, &["--memory", &low_size, "--sm", "30", "--priority", "low", "--preemptible"]);
    let w = workload(&node, &env, &["--alloc-mib", "256", "--hold", "3600"]);
    let (top, _) = alloc(dir, &["--memory", "30GiB", "--sm", "10", "--priority", "high", "--lease", "container"]);
    assert_eq!(state(dir, &low), ("parked".to_owned(), top.clone()));

    // Its container named (as the hook's owner record does), then deleted (as its poststop
    // hook records it): the lease pass releases it.
    let alloc_dir = dir.join("run/alloc").join(&top);
    std::fs::write(alloc_dir.join(".owner.tmp"), br#"{"container_id":"c-preemptor"}"#).expect("owner record");
    std::fs::rename(alloc_dir.join(".owner.tmp"), alloc_dir.join("owner")).expect("owner record");
    std::fs::write(alloc_dir.join(".deleted.tmp"), b"c-preemptor").expect("deleted");
    std::fs::rename(alloc_dir.join(".deleted.tmp"), alloc_dir.join("deleted")).expect("deleted");
    wait_state(dir, &low, "running").await;
    assert!(!listed(dir).contains_key(&top), "released by its lease");
    assert!(tesserad.log().contains("lease ended"), "{}", tesserad.log());
    let events = park_events(dir);
    assert_eq!(events.last(), Some(&("ALLOCATION_RESUMED".to_owned(), low.clone(), "room back".to_owned())));
    assert!(w.alive(), "the workload runs on");
}

/// `kill -9` of tesserad while a share is parked by preemption: a restart keeps it parked for
/// its preemptor (the journal names it) while that one holds its room; and when the preemptor's
/// record is gone at start (the daemon killed after the park and before the record was written
/// is the same), it resumes before the node API serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_preempted_when_tesserad_was_killed_resumes_at_start_once_its_room_is_back() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let config = tessera_tests::kubelet::write_config(&node, dir, "");
    let log = dir.join("tesserad.log");
    let show_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let socket = dir.join("run/tessera.sock");
    let daemon = spawn(&node, &config, &dir.join("no-notify"), &log);
    let mut api = node_api(&socket).await;
    let m = Node::open(None, Some(&node.state)).expect("the simulated node");
    let total = gpu_memory(&mut api).await;
    let low_size = format!("{}B", total - 20 * GIB);
    let (low, env) = alloc(dir, &["--memory", &low_size, "--sm", "30", "--priority", "low", "--preemptible"]);
    let w = workload(&node, &env, &["--alloc-mib", "256", "--hold", "3600"]);
    let before = used(&m);
    let first = api.allocate(high(30 * GIB)).await.unwrap_or_else(|e| panic!("{e:?}\n{}", show_log()));
    let first = first.into_inner().allocation.expect("allocation").id;
    assert_eq!(state(dir, &low), ("parked".to_owned(), first.clone()));

    // Killed with the preemptor holding its room: still parked for it after the restart.
    drop(daemon); // SIGKILL
    let daemon = spawn(&node, &config, &dir.join("no-notify"), &log);
    let mut api = node_api(&socket).await;
    assert_eq!(state(dir, &low), ("parked".to_owned(), first.clone()), "{}", show_log());
    assert_eq!(used(&m), 0);
    // Released: resumed by the restarted daemon.
    assert!(
        api.release(api::ReleaseRequest { allocation_id: first.clone() }).await.expect("release").into_inner().released
    );
    wait_state(dir, &low, "running").await;
    assert_eq!(used(&m), before);

    // Preempted again, killed, and the preemptor's record gone while tesserad is down: at start
    // the room is back, and it resumes before the node API answers.
    let second = api.allocate(high(30 * GIB)).await.unwrap_or_else(|e| panic!("{e:?}\n{}", show_log()));
    let second = second.into_inner().allocation.expect("allocation").id;
    assert_eq!(state(dir, &low), ("parked".to_owned(), second.clone()));
    drop(daemon); // SIGKILL
    {
        let mut store = tessera_daemon::state::Store::open(&dir.join("state")).expect("the store");
        store.remove(&second).expect("remove").expect("the preemptor's record");
    }
    let _daemon = spawn(&node, &config, &dir.join("no-notify"), &log);
    let mut api = node_api(&socket).await;
    assert_eq!(state(dir, &low), ("running".to_owned(), String::new()), "{}", show_log());
    // The restarted tesserad measures the GPU's context size once (enforcement::context_size):
    // its probe holds a context for a moment, beside the resumed memory.
    tessera_tests::kubelet::eventually(std::time::Duration::from_secs(60), &log, || {
        let now = used(&m);
        if now == before { Ok(()) } else { Err(format!("{now} B used on the GPU, {before} B before")) }
    })
    .await;
    assert_eq!(used(&m), before, "its memory is back");
    assert!(!dir.join("state/park").join(&low).exists(), "its journal entry is gone");
    assert!(!listed(dir).contains_key(&second));
    // The events (kept across restarts): each preemption and each resume, the last at start.
    let events = park_events(dir);
    let parked = |by: &str| ("ALLOCATION_PARKED".to_owned(), low.clone(), format!("preempted by {by}"));
    let resumed = ("ALLOCATION_RESUMED".to_owned(), low.clone(), "room back".to_owned());
    assert_eq!(events, [parked(&first), resumed.clone(), parked(&second), resumed], "{}", show_log());
    let mut w = w;
    assert!(matches!(w.0.try_wait(), Ok(None)), "the workload runs on");

    // Its process killed while it is preempted: once the room is back it runs again, with
    // nothing to restore, and is released as any other.
    let third = api.allocate(high(30 * GIB)).await.unwrap_or_else(|e| panic!("{e:?}\n{}", show_log()));
    let third = third.into_inner().allocation.expect("allocation").id;
    assert_eq!(state(dir, &low), ("parked".to_owned(), third.clone()));
    drop(w);
    assert!(api.release(api::ReleaseRequest { allocation_id: third }).await.expect("release").into_inner().released);
    wait_state(dir, &low, "running").await;
    assert_eq!(used(&m), 0, "nothing of it is left on the GPU");
    assert!(!dir.join("state/park").join(&low).exists());
    assert!(api.release(api::ReleaseRequest { allocation_id: low }).await.expect("release").into_inner().released);
}

/// All or nothing: a preemption that needs two shares parked, the second of which cannot be
/// (its GPU work does not finish within the lock timeout), resumes the first and refuses the
/// share, saying why; nothing stays parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preemption_that_cannot_park_all_it_needs_parks_nothing() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, mut api) = Tesserad::start(&node, "").await;
    let dir = tesserad.dir();
    let show_log = || tesserad.log();
    let total = gpu_memory(&mut api).await;
    let (low, env) = alloc(dir, &["--memory", "20GiB", "--sm", "20", "--priority", "low", "--preemptible"]);
    let _idle = workload(&node, &env, &["--alloc-mib", "64", "--hold", "3600"]);
    // Normal priority, preemptible, busy with one kernel of two minutes: the driver cannot park
    // it (a lock waits for its GPU work, 10 s at most, then says CUDA_ERROR_NOT_READY).
    let (busy, env) = alloc(dir, &[&BUSY_SHARE[..], &["--priority", "normal", "--preemptible"]].concat());
    let running = busy_workload(&node, &env, dir).await;

    // 30 GiB more than is free: both must be parked; the low one is, the busy one cannot be. The
    // low one is resumed, the share refused.
    let free = total - 40 * GIB;
    let e = api.allocate(high(free + 30 * GIB)).await.expect_err("not all parked");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains(&format!("preemption could not make room: parking {busy} failed"))
            && e.message().contains("nothing stays parked"),
        "{}\n{}",
        e.message(),
        show_log()
    );
    for id in [&low, &busy] {
        assert_eq!(state(dir, id), ("running".to_owned(), String::new()), "{id}");
    }
    assert_eq!(listed(dir).len(), 2, "no share made");
    let events = park_events(dir);
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!((events[0].0.as_str(), &events[0].1), ("ALLOCATION_PARKED", &low));
    assert!(events[0].2.starts_with("preempted by "), "{events:?}");
    assert_eq!((events[1].0.as_str(), &events[1].1), ("ALLOCATION_RESUMED", &low));
    assert!(events[1].2.starts_with(&format!("preemption undone: parking {busy} failed")), "{events:?}");
    assert!(events[1].2.contains("cuCheckpointProcessLock failed: CUDA_ERROR_NOT_READY"), "{events:?}");
    assert!(running.alive(), "the busy process runs on, its kernel too");
}

/// `tessera park ID --lock-timeout DURATION`: a busy program's park gives up after that long,
/// saying so, and the program runs on; an idle one parks within it. A duration the CLI cannot
/// read is refused before anything is asked of the daemon, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_park_waits_for_gpu_work_as_long_as_its_lock_timeout_says() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, _api) = Tesserad::start(&node, "").await;
    let dir = tesserad.dir();
    let (idle, env) = alloc(dir, &["--memory", "2GiB", "--sm", "20"]);
    for (bad, why) in [
        ("10", "has no unit: write \"10s\" (seconds) or \"10ms\""),
        ("0s", "must be at least 1ms"),
        ("10us", "unknown unit \"us\""),
        ("soon", "is not a duration"),
        ("4294967296ms", "more than the driver's longest lock timeout"),
    ] {
        let out = tessera(dir, &["park", &idle, "--lock-timeout", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("--lock-timeout") && err.contains(why), "{bad}: {err}");
    }
    assert_eq!(state(dir, &idle), ("running".to_owned(), String::new()), "nothing was parked");
    assert!(park_events(dir).is_empty());

    let _idle = workload(&node, &env, &["--alloc-mib", "64", "--hold", "3600"]);
    let out = ok(&tessera(dir, &["park", &idle, "--lock-timeout", "5s", "--json"]));
    let parked: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(parked["state"], "parked", "{parked}");
    ok(&tessera(dir, &["resume", &idle]));

    let (busy, env) = alloc(dir, &BUSY_SHARE);
    let running = busy_workload(&node, &env, dir).await;
    let out = tessera(dir, &["park", &busy, "--lock-timeout", "300ms"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("cuCheckpointProcessLock failed: CUDA_ERROR_NOT_READY"), "{err}");
    assert!(err.contains("lock timeout: 300ms"), "the timeout asked for reached the driver: {err}");
    assert_eq!(state(dir, &busy), ("running".to_owned(), String::new()));
    assert!(running.alive(), "the busy program runs on");
}

/// Bad input: a share whose program exports its memory by CUDA IPC cannot be parked, since such
/// memory cannot cross a checkpoint. Through the node API and the CLI alike the park is refused
/// saying so, and nothing moves: the allocation runs, its memory stays on the GPU, no event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_with_memory_shared_by_cuda_ipc_is_not_parked() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, mut api) = Tesserad::start(&node, "").await;
    let dir = tesserad.dir();
    let m = Node::open(None, Some(&node.state)).expect("the simulated node");
    let (id, env) = alloc(dir, &["--memory", "2GiB", "--sm", "20"]);
    let exporter = workload(&node, &env, &["--alloc-mib", "256", "--ipc-export", "--hold", "3600"]);
    let held = used(&m);
    assert!(held >= 256 * MIB, "{held}");

    let refused = |message: &str| {
        for want in ["CUDA_ERROR_NOT_SUPPORTED", "IPC or peer mappings", "cannot cross a checkpoint"] {
            assert!(message.contains(want), "{want:?} in {message}");
        }
    };
    let e = api.park(api::ParkRequest { allocation_id: id.clone(), ..Default::default() }).await;
    let e = e.expect_err("memory exported by IPC");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    refused(e.message());
    let out = tessera(dir, &["park", &id]);
    assert!(!out.status.success());
    refused(&String::from_utf8_lossy(&out.stderr));

    assert_eq!(state(dir, &id), ("running".to_owned(), String::new()));
    assert_eq!(used(&m), held, "nothing moved off the GPU");
    assert!(park_events(dir).is_empty());
    assert!(!dir.join("state/park").join(&id).exists(), "no journal entry left");
    assert!(exporter.alive(), "the program runs on");
}
