//! tesserad's park mechanism (daemon/src/park.rs) against the simulated node: CUDA workloads
//! parked and resumed through the driver's checkpoint API, all or nothing, and what a killed
//! tesserad leaves half-done finished or rolled back, never a process left locked.

use serde_json::Value;
use tessera_daemon::park::{Checkpointer, ProcessState};
use tessera_sim_model::Node;
use tessera_sim_testkit::{SimNode, Workload, binary, spawn_workload};

const MIB: u64 = 1 << 20;

/// A workload holding 256 MiB with a pattern for `hold` seconds, then reading it back.
fn holder(node: &SimNode) -> Workload {
    spawn_workload(node.command(binary("tessera-workload")).args(["--alloc-mib", "256", "--verify", "--hold", "15"]))
}

fn used(m: &Node) -> u64 {
    m.memory_info(0, 0).unwrap().used
}

/// What each test starts from: the checkpoint API, the model, a [`holder`] workload (with its
/// pid and its further lines) and what the GPU held with it.
struct Start {
    ck: Checkpointer,
    m: Node,
    w: Workload,
    before: u64,
}

/// Runs `body` in a process of its own on a node of its own (see `SimNode::run_isolated`).
fn with_holder(test_name: &str, body: impl FnOnce(Start)) {
    let node = SimNode::new();
    node.run_isolated(test_name, || {
        let ck = Checkpointer::load(&node.cuda_path()).unwrap();
        let m = Node::open(None, Some(&node.state)).unwrap();
        let w = holder(&node);
        let before = used(&m);
        body(Start { ck, m, w, before });
    });
}

#[test]
fn a_park_fails_whole_and_a_resume_waits_for_room() {
    with_holder("a_park_fails_whole_and_a_resume_waits_for_room", |Start { ck, m, w: (mut w, pid, lines), before }| {
        // A process with no CUDA context beside it: the park fails whole, the workload runs on.
        let mut plain = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let e = ck.park(&[pid, plain.id()], None).unwrap_err().to_string();
        assert!(e.contains(&format!("process {}", plain.id())) && e.contains("no CUDA context"), "{e}");
        assert_eq!(ck.state(pid).unwrap(), ProcessState::Running, "never half-parked");
        assert_eq!(used(&m), before);
        plain.kill().unwrap();
        plain.wait().unwrap();

        ck.park(&[pid], Some(std::time::Duration::from_secs(5))).unwrap();
        assert_eq!(ck.state(pid).unwrap(), ProcessState::Checkpointed);
        assert_eq!(used(&m), 0, "NVML: its memory is free");
        // Another takes all but 64 MiB: the resume is refused, saying so, and it stays parked.
        let free = m.memory_info(0, 0).unwrap().free;
        m.alloc(0, 0, free - 64 * MIB).unwrap();
        let e = ck.resume(&[pid]).unwrap_err().to_string();
        assert!(e.contains("CUDA_ERROR_OUT_OF_MEMORY") && e.contains("does not fit"), "{e}");
        assert_eq!(ck.state(pid).unwrap(), ProcessState::Checkpointed);
        m.free(0, 0, free - 64 * MIB);
        ck.resume(&[pid]).unwrap();
        assert_eq!(ck.state(pid).unwrap(), ProcessState::Running);
        assert_eq!(used(&m), before);
        let report: Value = serde_json::from_str(&lines.last().unwrap().unwrap()).unwrap();
        assert!(w.wait().unwrap().success(), "{report}");
        assert_eq!(report["verified_after_hold_bytes"], MIB, "its data intact: {report}");
    });
}

#[test]
fn recovery_after_a_killed_tesserad_leaves_no_process_locked() {
    let name = "recovery_after_a_killed_tesserad_leaves_no_process_locked";
    with_holder(name, |Start { ck, m, w: (mut w, pid, _lines), before }| {
        // Killed after the lock: rolled back to running.
        ck.lock(pid, None).unwrap();
        assert_eq!(ck.recover(&[pid], false).unwrap(), Vec::<u32>::new());
        assert_eq!(ck.state(pid).unwrap(), ProcessState::Running);
        // Killed after the checkpoint, the park not yet journalled as done: rolled back.
        ck.lock(pid, None).unwrap();
        ck.checkpoint(pid).unwrap();
        ck.recover(&[pid], false).unwrap();
        assert_eq!((ck.state(pid).unwrap(), used(&m)), (ProcessState::Running, before));
        // Journalled as parked, killed before the checkpoint of this process: finished.
        ck.lock(pid, None).unwrap();
        assert_eq!(ck.recover(&[pid], true).unwrap(), vec![pid]);
        assert_eq!((ck.state(pid).unwrap(), used(&m)), (ProcessState::Checkpointed, 0));
        ck.resume(&[pid]).unwrap();
        // A process gone is skipped.
        w.kill().unwrap();
        w.wait().unwrap();
        assert_eq!(ck.recover(&[pid], false).unwrap(), Vec::<u32>::new());
    });
}
