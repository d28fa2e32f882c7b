//! Park and resume of a process in a PID namespace of its own, as every container's is (issue
//! 33): the shim's region slot names the process by the pid it sees (1 here), which on the host
//! is another process altogether (the host's init). tesserad resolves the slot to the host
//! process that maps the allocation's region under that pid, and the driver is handed that
//! one: the park locks and checkpoints the right process, and its resume lets it run on.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

use tessera_proto::tessera::v1 as api;
use tessera_region::region::Region;
use tessera_sim_model::Node;
use tessera_sim_testkit::SimNode;
use tessera_tests::{Tesserad, ok, shim, tessera};

const GIB: u64 = 1 << 30;

/// The `unshare` wrapper, killed (and with it its child, `--kill-child`) when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether this machine can make PID namespaces (root and util-linux's `unshare`); where it
/// cannot, the test fails under `TESSERA_REQUIRE_RUNTIMES` and is skipped, said, elsewhere.
fn can_unshare() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let unshare = std::process::Command::new("unshare").arg("--version").output().is_ok_and(|o| o.status.success());
    if root && unshare {
        return true;
    }
    let why = if root { "util-linux's unshare is not installed" } else { "PID namespaces need root" };
    assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "TESSERA_REQUIRE_RUNTIMES is set, but {why}");
    println!("SKIP: {why}");
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_in_a_pid_namespace_of_its_own_is_parked_by_its_host_pid() {
    if !can_unshare() {
        return;
    }
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, mut api) = Tesserad::start(&node, "").await;
    let dir = tesserad.dir();
    let m = Node::open(None, Some(&node.state)).expect("the simulated node");
    let out = ok(&tessera(dir, &["alloc", "--memory", "2GiB", "--sm", "30", "--json"]));
    let answer: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let id = answer["id"].as_str().expect("id").to_owned();
    let env = answer["env"].as_object().expect("env").clone();

    // The workload as pid 1 of a new PID namespace with its own /proc, as in a container.
    let mut cmd = node.command("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", "--kill-child", "--"])
        .arg(tessera_sim_testkit::binary("tessera-workload"))
        .args(["--alloc-mib", "1024", "--hold", "3600"])
        .stdout(Stdio::piped())
        .env("LD_PRELOAD", shim());
    for (k, v) in &env {
        cmd.env(k, v.as_str().expect("env values are strings"));
    }
    let mut child = cmd.spawn().expect("unshare");
    let wrapper = child.id();
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let workload = Reaped(child);
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    assert!(line.contains("holding"), "the workload holds its memory: {line}");
    let children = std::fs::read_to_string(format!("/proc/{wrapper}/task/{wrapper}/children")).expect("children");
    let host: u32 = children.split_whitespace().next().and_then(|p| p.parse().ok()).expect("the workload's host pid");
    assert_ne!(host, 1);

    // Its slot names it as it sees itself, and nobody has said its host pid.
    let region = Region::open_or_create(std::path::Path::new(env["TESSERA_REGION"].as_str().expect("region path")))
        .expect("the region");
    assert_eq!(region.pids(), vec![(1, 0)], "pid 1 of its namespace");
    let before = m.memory_info(0, 0).expect("NVML memory").used;
    assert!(before >= GIB, "{before}");

    let park = api::ParkRequest { allocation_id: id.clone(), ..Default::default() };
    let parked = api.park(park).await.unwrap_or_else(|e| panic!("{e:?}\n{}", tesserad.log())).into_inner();
    assert_eq!(parked.pids, vec![host], "the host's pid of the workload, not its own pid 1");
    assert!(parked.bytes >= GIB, "{}", parked.bytes);
    assert_eq!(m.memory_info(0, 0).expect("NVML memory").used, 0, "NVML: its memory is free");
    assert!(ok(&tessera(dir, &["allocations"])).contains("parked"));

    api.resume(api::ResumeRequest { allocation_id: id.clone() })
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", tesserad.log()));
    assert_eq!(m.memory_info(0, 0).expect("NVML memory").used, before, "its memory is back");
    let mut workload = workload;
    assert!(matches!(workload.0.try_wait(), Ok(None)), "the program runs on");
    // The host's own pid 1 was never touched: it would not be running otherwise.
    assert!(std::path::Path::new("/proc/1").exists());
}
