//! On-demand tracing end to end: the built `tesserad` on the simulated node with the test
//! kubelet allocates a share; `tessera-workload` runs with libtessera.so preloaded and the
//! allocation's limits and region, launching kernels; while nobody asks for a trace the region's
//! trace ring stays empty; `Node.Trace` for 1 s returns a valid Trace Event Format document with
//! the workload's cuLaunchKernel spans (per thread in order, not overlapping) and its kernels
//! (durations ≈ --kernel-us) named after the workload's kernel function (as the simulated
//! driver's `cuFuncGetName` reports it); the flag is cleared after; bad requests name their
//! field; and `tessera trace` writes the file and a one-line summary, its kernels named again (a
//! new trace session: the shim announces names anew).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tessera_proto::deviceplugin::v1beta1::Empty;
use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tessera_region::Region;
use tessera_sim_testkit::{SimNode, binary, profile_dir};
use tonic::transport::Channel;

mod common;

use common::{TestKubelet, WAIT, next_list, spawn};

const KERNEL_US: f64 = 500.0;
/// The workload's kernel function (`tessera-workload`'s PTX names it after its duration).
const KERNEL_NAME: &str = "tessera_spin_500us";

async fn client(socket: &Path) -> NodeClient<Channel> {
    common::node_api(socket).await
}

async fn launches(api: &mut NodeClient<Channel>, id: &str) -> u64 {
    let u = api
        .get_usage(api::GetUsageRequest { allocation_id: id.into(), ..Default::default() })
        .await
        .expect("usage")
        .into_inner();
    u.containers.iter().flat_map(|c| &c.devices).map(|d| d.launches).sum()
}

/// Checks the Trace Event Format and returns the complete events.
fn check_trace(doc: &serde_json::Value) -> Vec<serde_json::Value> {
    assert_eq!(doc["displayTimeUnit"], "ns");
    let events = doc["traceEvents"].as_array().expect("traceEvents");
    for e in events {
        for k in ["name", "ph", "ts", "pid", "tid"] {
            assert!(!e[k].is_null(), "event without {k}: {e}");
        }
        assert!(e["name"].is_string() && e["ph"].is_string(), "{e}");
        assert!(e["ts"].is_number() && e["pid"].is_u64() && e["tid"].is_u64(), "{e}");
        match e["ph"].as_str() {
            Some("X") => {
                let dur = e["dur"].as_f64().unwrap_or_else(|| panic!("X without dur: {e}"));
                assert!(dur >= 0.0, "{e}");
                assert!(e["ts"].as_f64().expect("ts") >= 0.0, "{e}");
                assert!(e["cat"].is_string() && e["args"].is_object(), "{e}");
            }
            Some("M") => assert!(e["args"]["name"].is_string() || e["args"]["sort_index"].is_number(), "{e}"),
            other => panic!("unexpected phase {other:?}: {e}"),
        }
    }
    events.iter().filter(|e| e["ph"] == "X").cloned().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_records_the_workloads_calls_and_kernels() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let config = common::write_config(&node, dir, "[partitions.default]\nshares = { count = 2 }");
    let log = dir.join("tesserad.log");
    let mut kubelet = TestKubelet::start(&dir.join("plugins"));
    let (_daemon, _) = spawn(&node, &config, &dir.join("no-notify"), &log);
    let (reg, _) = kubelet.next_registration().await;
    let mut plugin = kubelet.connect(&reg).await;
    let share = {
        let mut list = plugin.list_and_watch(Empty {}).await.expect("list");
        next_list(list.get_mut()).await.devices[0].id.clone()
    };
    let answer = common::allocate(&mut plugin, &[&share]).await;
    let id = answer.envs["TESSERA_ALLOCATION"].clone();
    let host_dir = PathBuf::from(&answer.mounts[0].host_path);
    let socket = dir.join("run/tessera.sock");
    let mut api = client(&socket).await;

    // Bad requests name their field.
    let err = api.trace(api::TraceRequest { allocation_id: id.clone(), seconds: 0 }).await.expect_err("0 s");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().starts_with("seconds:"), "{}", err.message());
    let err = api.trace(api::TraceRequest { allocation_id: id.clone(), seconds: 61 }).await.expect_err("61 s");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().starts_with("seconds:"), "{}", err.message());
    let err = api.trace(api::TraceRequest { allocation_id: "nope".into(), seconds: 1 }).await.expect_err("unknown");
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(err.message().starts_with("allocation_id:"), "{}", err.message());

    // A workload launching 500 µs kernels for a while.
    let shim = profile_dir().join("libtessera.so");
    assert!(shim.exists(), "{} is missing: build the workspace first", shim.display());
    let workload = node
        .command(binary("tessera-workload"))
        .env("LD_PRELOAD", &shim)
        .env("TESSERA_LIMITS", host_dir.join("limits"))
        .env("TESSERA_REGION", host_dir.join("region"))
        .env("TESSERA_ALLOCATION", &id)
        .args(["--alloc-mib", "64", "--kernel-us", &KERNEL_US.to_string(), "--seconds", "8"])
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn workload");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let pid = workload.id();
    let _kill = Kill(workload);
    let deadline = Instant::now() + WAIT;
    while launches(&mut api, &id).await < 50 {
        assert!(Instant::now() < deadline, "the workload does not launch");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Nobody asked: the ring stays empty.
    let region = Region::open_or_create(&host_dir.join("region")).expect("region");
    assert!(!region.trace_requested());
    assert_eq!(region.trace_cursor(), 0, "nothing is recorded without a trace request");

    // Trace for 1 s.
    let began = Instant::now();
    let r = api.trace(api::TraceRequest { allocation_id: id.clone(), seconds: 1 }).await.expect("trace").into_inner();
    let took = began.elapsed();
    assert!(took >= Duration::from_secs(1), "a 1 s trace answered after {took:?}");
    assert!(!region.trace_requested(), "the flag is cleared after the trace");
    let doc: serde_json::Value = serde_json::from_slice(&r.trace_json).expect("trace JSON");
    let x = check_trace(&doc);
    assert_eq!(r.events as usize, x.len());
    assert_eq!(r.processes, 1);
    assert!(r.duration_nanos >= 1_000_000_000, "{}", r.duration_nanos);
    assert_eq!(r.dropped, 0, "a 1 s trace of one process fits the ring");

    // cuLaunchKernel spans on the workload's thread, in order and not overlapping.
    let api_spans: Vec<_> = x.iter().filter(|e| e["cat"] == "cuda_api").collect();
    let launch_spans = api_spans.iter().filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with("cuLaunch")));
    assert!(launch_spans.count() >= 100, "launch spans: {}", api_spans.len());
    let mut by_tid: HashMap<u64, Vec<(f64, f64)>> = HashMap::new();
    for e in &api_spans {
        assert_eq!(e["pid"].as_u64(), Some(u64::from(pid)), "pid in the container's namespace: {e}");
        by_tid
            .entry(e["tid"].as_u64().expect("tid"))
            .or_default()
            .push((e["ts"].as_f64().expect("ts"), e["dur"].as_f64().expect("dur")));
    }
    for (tid, spans) in &by_tid {
        for w in spans.windows(2) {
            assert!(w[1].0 >= w[0].0, "tid {tid}: ts goes back: {w:?}");
            assert!(w[1].0 + 0.001 >= w[0].0 + w[0].1, "tid {tid}: API spans overlap: {w:?}");
        }
    }

    // Kernels, each ≈ 500 µs of GPU time, on their stream's track, one after another.
    let kernels: Vec<_> = x.iter().filter(|e| e["cat"] == "kernel").collect();
    assert!(kernels.len() >= 100, "kernels: {}", kernels.len());
    let mut durs: Vec<f64> = kernels.iter().map(|e| e["dur"].as_f64().expect("dur")).collect();
    durs.sort_by(f64::total_cmp);
    let median = durs[durs.len() / 2];
    println!(
        "trace: {} events, {} API spans, {} kernels (median {median:.1} µs, min {:.1}, max {:.1}), {} dropped",
        r.events,
        api_spans.len(),
        kernels.len(),
        durs[0],
        durs[durs.len() - 1],
        r.dropped
    );
    assert!((0.8 * KERNEL_US..=1.5 * KERNEL_US).contains(&median), "median kernel {median} µs");
    assert!(durs[0] > 0.5 * KERNEL_US, "shortest kernel {} µs", durs[0]);
    let mut tracks: HashMap<u64, Vec<(f64, f64)>> = HashMap::new();
    for k in &kernels {
        assert_eq!(k["name"], KERNEL_NAME, "{k}");
        assert!(k["args"]["function"].as_str().is_some_and(|f| f.starts_with("0x") && f != "0x0"), "{k}");
        assert_eq!(k["args"]["launched_by"].as_str().map(|n| n.starts_with("cuLaunch")), Some(true), "{k}");
        assert!(k["args"]["device"].as_str().is_some_and(|d| d.starts_with("GPU-")), "{k}");
        tracks
            .entry(k["tid"].as_u64().expect("tid"))
            .or_default()
            .push((k["ts"].as_f64().unwrap(), k["dur"].as_f64().unwrap()));
    }
    for spans in tracks.values() {
        for w in spans.windows(2) {
            assert!(w[1].0 + 0.001 >= w[0].0 + w[0].1, "kernels overlap on a stream: {w:?}");
        }
    }
    let meta: Vec<_> = doc["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "M").collect();
    assert!(
        meta.iter().any(|e| e["name"] == "process_name"
            && e["args"]["name"].as_str().is_some_and(|n| n.contains(&format!("(pid {pid})")))),
        "process name: {meta:?}"
    );

    // After the trace: nothing more is recorded.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let at = region.trace_cursor();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(region.trace_cursor(), at, "the shim stops recording when the flag is cleared");

    // The CLI: by allocation id, default-free path given with -o; a one-line summary.
    let out_file = dir.join("t.json");
    let out = std::process::Command::new(binary("tessera"))
        .arg("--socket")
        .arg(&socket)
        .args(["trace", &id, "--seconds", "1", "-o"])
        .arg(&out_file)
        .output()
        .expect("tessera trace");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("events") && text.contains(&id), "{text}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&out_file).expect("trace file")).expect("json");
    let kernels: Vec<_> = check_trace(&doc).into_iter().filter(|e| e["cat"] == "kernel").collect();
    assert!(!kernels.is_empty());
    assert!(kernels.iter().all(|k| k["name"] == KERNEL_NAME), "a second trace names kernels too: {kernels:?}");
    let out = std::process::Command::new(binary("tessera"))
        .arg("--socket")
        .arg(&socket)
        .args(["trace", "no-such-container", "--seconds", "1"])
        .output()
        .expect("tessera trace");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no allocation or container"));
}
