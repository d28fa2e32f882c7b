//! Park and resume through the node API and the CLI (issue 33) on the simulated node: a host
//! process under libtessera.so, in a carved share, is parked (NVML shows its memory freed, the
//! allocation lists as parked), its resume is refused while the GPU is full and says how much it
//! needs, then it resumes and runs on (its data across a park: daemon/tests/park.rs). Bad input: an unknown id, an
//! allocation with no process, a resume of a running one, a second park of a parked one.

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
    let entry =
        JournalEntry { id: inflight_id.clone(), state: "parking".into(), pids: vec![inflight_pid], bytes: 512 << 20 };
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
