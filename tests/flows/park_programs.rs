//! Park and resume (issue 33, item 7) with a PyTorch training process on the simulated node: it
//! is parked mid-loop through the driver's checkpoint API (tesserad's `park::Checkpointer`), NVML
//! shows its memory freed, an online allocation takes that memory, runs and is released, and the
//! process resumes where it stopped: its weights' checksum equals that of an unparked run.
//!
//! The sim runs no kernel code, so each step's update is computed on the CPU and copied into the
//! weights on the device: the bytes that cross the park are real. PyTorch lives where
//! `pytorch_programs` finds it; without it the test prints a SKIP line (fails under
//! `TESSERA_REQUIRE_RUNTIMES`).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;

use serde_json::Value;
use tessera_daemon::park::{Checkpointer, ProcessState};
use tessera_sim_model::Node;
use tessera_sim_testkit::SimNode;
use tessera_tests::{GIB, venv_python};

/// 20 steps of a deterministic update of 1 Mi int64 weights, with 60 GiB more held on the device;
/// after step 5 it says so (and goes on). Prints the weights' checksum at the end.
const TRAIN: &str = r#"
import json, os, sys, torch
torch.manual_seed(0)
w = torch.randint(0, 1000, (1 << 20,), dtype=torch.int64).to("cuda")
held = torch.empty(60 << 30, dtype=torch.uint8, device="cuda")
host = w.cpu()
for step in range(20):
    host = (host * 31 + step) % 1000003
    w.copy_(host.to("cuda"))
    torch.cuda.synchronize()
    if step == 5:
        print(json.dumps({"mid_loop": os.getpid()}), flush=True)
back = w.cpu()
print(json.dumps({"checksum": int((back * torch.arange(back.numel())).sum() % (1 << 61)), "equal": bool(torch.equal(back, host))}), flush=True)
"#;

fn gpu0_used(m: &Node) -> u64 {
    m.memory_info(0, 0).unwrap().used
}

/// Runs the program; `mid_loop` is called with its pid when it reports step 5. Its last line.
fn train(node: &SimNode, python: &Path, mid_loop: impl FnOnce(u32)) -> Value {
    let mut c = node
        .command(python)
        .args(["-c", TRAIN])
        .env("CUDA_VISIBLE_DEVICES", "0")
        .stdout(Stdio::piped())
        .spawn()
        .expect("run python");
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&lines.next().expect("a line").unwrap()).unwrap();
    mid_loop(first["mid_loop"].as_u64().expect("mid_loop") as u32);
    let last: Value = serde_json::from_str(&lines.last().expect("the checksum").unwrap()).unwrap();
    assert!(c.wait().unwrap().success(), "{last}");
    last
}

#[test]
fn a_pytorch_process_parked_mid_loop_resumes_with_its_weights_intact() {
    let Some(python) = venv_python("TESSERA_TORCH_RUNTIME", "torch-runtime", "import torch", "PyTorch") else { return };
    let node = SimNode::new();
    node.run_isolated("a_pytorch_process_parked_mid_loop_resumes_with_its_weights_intact", || {
        let m = Node::open(None, Some(&node.state)).unwrap();
        let unparked = train(&node, &python, |_| {});
        assert_eq!(unparked["equal"], true, "{unparked}");

        let ck = Checkpointer::load(&node.cuda_path()).unwrap();
        let parked = train(&node, &python, |pid| {
            let before = gpu0_used(&m);
            assert!(before > 60 * GIB, "the process holds its 60 GiB: {before}");
            ck.park(&[pid], None).unwrap();
            assert_eq!(ck.state(pid).unwrap(), ProcessState::Checkpointed);
            // NVML: the memory is free and the process unlisted.
            assert_eq!(gpu0_used(&m), 0, "the parked process's memory is free");
            assert!(m.processes(0, None).unwrap().iter().all(|p| p.pid != pid));
            // An online allocation takes that memory (it fits only while the other is parked),
            // runs and is released; then the offline process resumes.
            let online = reopen(&node);
            online.alloc(0, 0, before).unwrap();
            let s = online.stream_create(0, 0, 0).unwrap();
            let t = online.launch(s, 1_000_000).unwrap();
            online.stream_wait(s, t, None).unwrap();
            assert!(ck.resume(&[pid]).is_err(), "no room to resume while the online work holds it");
            online.free(0, 0, before);
            ck.resume(&[pid]).unwrap();
            assert_eq!(gpu0_used(&m), before, "its memory is back");
        });
        assert_eq!(parked["equal"], true, "{parked}");
        assert_eq!(parked["checksum"], unparked["checksum"], "the same weights as the unparked run of the same seed");
    });
}

/// Another process's view of the node, with a slot of its own (the online work).
fn reopen(node: &SimNode) -> Node {
    Node::open(None, Some(&node.state)).unwrap()
}
