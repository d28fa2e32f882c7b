//! The workload against the simulated node, on each of the three ways programs reach the driver.

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use serde_json::Value;
use tessera_sim_model::Node;
use tessera_sim_testkit::{SimNode, binary};

const GIB: u64 = 1 << 30;

fn run(node: &SimNode, args: &[&str]) -> (i32, Value) {
    let out = node.command(binary("tessera-workload")).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last =
        stdout.lines().last().unwrap_or_else(|| panic!("no output; stderr: {}", String::from_utf8_lossy(&out.stderr)));
    let v: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    (out.status.code().unwrap_or(-1), v)
}

#[test]
fn every_lookup_path_allocates_verifies_and_launches() {
    let node = SimNode::new();
    for lookup in ["linked", "dlsym", "getprocaddress"] {
        let (code, r) = run(
            &node,
            &["--lookup", lookup, "--alloc-mib", "1024", "--verify", "--kernels", "20", "--kernel-us", "500"],
        );
        assert_eq!(code, 0, "{lookup}: {r}");
        assert_eq!(r["lookup"], lookup);
        assert_eq!(r["device_name"], "NVIDIA H100 80GB HBM3");
        assert_eq!(r["driver_version"], 12080);
        assert_eq!(r["allocated_bytes"].as_u64().unwrap(), GIB);
        assert_eq!(r["verified_bytes"].as_u64().unwrap(), 1 << 20);
        let before = r["mem_free_before"].as_u64().unwrap();
        assert_eq!(
            before - r["mem_free_after_alloc"].as_u64().unwrap(),
            GIB,
            "{lookup}: cuMemGetInfo moves by exactly the allocation"
        );
        assert_eq!(r["kernels"], 20);
        // 20 kernels of 0.5 ms queued two deep on one stream: at least 10 ms of GPU time span.
        let span = r["gpu_span_ms"].as_f64().unwrap();
        assert!((10.0..200.0).contains(&span), "{lookup}: span {span} ms");
    }
}

#[test]
fn allocation_beyond_the_gpu_is_out_of_memory() {
    let node = SimNode::new();
    let (code, r) = run(&node, &["--alloc-mib", "100000", "--chunk-mib", "30000"]);
    assert_eq!(code, 3, "{r}");
    assert_eq!(r["alloc_error"], "CUDA_ERROR_OUT_OF_MEMORY");
    let got = r["allocated_bytes"].as_u64().unwrap();
    assert_eq!(got, (2 * 30000) << 20, "two 30000 MiB chunks fit in 80 GB, the third does not");
}

#[test]
fn device_selection_and_visible_devices() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"A100-SXM4-40GB\"\n[[gpu]]\nmodel = \"H200-141GB\"\n");
    let (code, r) = run(&node, &["--device", "1"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["device_name"], "NVIDIA H200");
    let model = Node::open_state(&node.state, None).unwrap();
    let h200 = model.gpus()[1].uuid.clone();
    let out = node.command(binary("tessera-workload")).env("CUDA_VISIBLE_DEVICES", &h200).output().unwrap();
    let r: Value = serde_json::from_slice(out.stdout.trim_ascii_end().rsplit(|b| *b == b'\n').next().unwrap()).unwrap();
    assert_eq!(r["device_name"], "NVIDIA H200", "device 0 is the only visible one, the H200");
}

/// Starts a workload that allocates and holds; returns it once it holds.
fn holding(node: &SimNode, args: &[&str]) -> std::process::Child {
    let mut c = node.command(binary("tessera-workload")).args(args).stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
    let first = lines.next().expect("a line").unwrap();
    assert!(first.contains("holding"), "{first}");
    c
}

#[test]
fn processes_share_one_device_model_and_sigkill_frees() {
    let node = SimNode::new();
    let mut a = holding(&node, &["--device", "2", "--alloc-mib", "4096", "--hold", "60"]);
    let model = Node::open_state(&node.state, None).unwrap();
    let context = model.context_overhead_bytes();
    assert_eq!(model.memory_info(2, 0).unwrap().used, 4 * GIB + context);
    let procs = model.processes(2, None).unwrap();
    assert_eq!(procs.iter().map(|p| p.pid).collect::<Vec<_>>(), vec![a.id()]);
    // Another process sees A's memory through CUDA.
    let (_, b) = run(&node, &["--device", "2"]);
    let total = b["mem_total"].as_u64().unwrap();
    let reserved = model.gpus()[2].model.reserved_bytes;
    assert_eq!(b["mem_free_before"].as_u64().unwrap(), total - reserved - 4 * GIB - 2 * context);
    a.kill().unwrap();
    a.wait().unwrap();
    assert_eq!(model.memory_info(2, 0).unwrap().used, 0, "SIGKILLed process's memory is freed");
    let (_, c) = run(&node, &["--device", "2"]);
    assert_eq!(c["mem_free_before"].as_u64().unwrap(), total - reserved - context);
}

#[test]
fn two_processes_time_slice_one_gpu() {
    let node = SimNode::new();
    let args = ["--device", "3", "--kernel-us", "2000", "--seconds", "1.5", "--depth", "4"];
    let spawn = || node.command(binary("tessera-workload")).args(args).stdout(Stdio::piped()).spawn().unwrap();
    let started = std::time::Instant::now();
    let (a, b) = (spawn(), spawn());
    let parse = |c: std::process::Child| -> Value {
        let out = c.wait_with_output().unwrap();
        serde_json::from_slice(out.stdout.trim_ascii_end()).unwrap()
    };
    let (ra, rb) = (parse(a), parse(b));
    let both_ms = started.elapsed().as_secs_f64() * 1e3;
    let (sa, sb) = (ra["achieved_share"].as_f64().unwrap(), rb["achieved_share"].as_f64().unwrap());
    // Each saturates its stream; the GPU serves both, about half each while both run.
    assert!(sa + sb > 0.8, "shares {sa} + {sb}");
    // One GPU never serves more kernel time than time passed (the two processes start and stop
    // at slightly different moments, so their own shares may add up to a little over 1).
    let (ka, kb) = (ra["kernel_time_ms"].as_f64().unwrap(), rb["kernel_time_ms"].as_f64().unwrap());
    assert!(ka + kb <= both_ms * 1.02, "{ka} + {kb} ms of kernels in {both_ms} ms");
    assert!((0.3..0.7).contains(&sa) && (0.3..0.7).contains(&sb), "shares {sa} / {sb}");
}
