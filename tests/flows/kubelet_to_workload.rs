//! The whole node path without a container runtime: the kubelet allocates a share from tesserad
//! on the simulated node; a CUDA workload runs with libtessera.so preloaded and the allocation's
//! limits and region (the files the container would get, at their host paths); the share's
//! memory limit holds (CUDA_ERROR_OUT_OF_MEMORY past it); the node API's GetUsage, the
//! `tessera status` and `tessera top` tables, and a real Prometheus server scraping tesserad's
//! /metrics show what the workload holds, and nothing once it is killed.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tessera_sim_testkit::{SimNode, binary};
use tessera_tests::kubelet::prometheus::Prometheus;
use tessera_tests::kubelet::{TestKubelet, WAIT, allocate, spawn};
use tessera_tests::shim;

const MIB: u64 = 1 << 20;
const OVERHEAD_MIB: u64 = 300;

async fn usage(api: &mut NodeClient<tonic::transport::Channel>, id: &str) -> api::ContainerUsage {
    let resp = api
        .get_usage(api::GetUsageRequest { allocation_id: id.into(), ..Default::default() })
        .await
        .expect("usage")
        .into_inner();
    resp.containers.into_iter().next().expect("the allocation's usage")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_share_limits_the_workload_and_shows_in_usage() {
    let node = SimNode::with_description(&format!(
        "context_overhead_mib = {OVERHEAD_MIB}\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n"
    ));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // /metrics on a free loopback port, scraped by a real Prometheus server.
    let (metrics, config) =
        tessera_tests::kubelet::write_config_with_metrics(&node, dir, "[partitions.default]\nshares = { count = 4 }");
    let log = dir.join("tesserad.log");
    let mut kubelet = TestKubelet::start(&dir.join("plugins"));
    let (_daemon, _) = spawn(&node, &config, &dir.join("no-notify"), &log);
    let (reg, _) = kubelet.next_registration().await;
    assert_eq!(reg.resource_name, "tessera.io/gpu-share");

    // The kubelet allocates share 1.
    let mut plugin = kubelet.connect(&reg).await;
    let share = {
        let mut list = plugin.list_and_watch(tessera_proto::deviceplugin::v1beta1::Empty {}).await.expect("list");
        tessera_tests::kubelet::next_list(list.get_mut()).await.devices[1].id.clone()
    };
    let answer = allocate(&mut plugin, &[&share]).await;
    let id = answer.envs["TESSERA_ALLOCATION"].clone();
    let host_dir = PathBuf::from(&answer.mounts[0].host_path);
    let mut api = tessera_tests::kubelet::node_api(&dir.join("run/tessera.sock")).await;
    let limit = usage(&mut api, &id).await.devices[0].memory_limit_bytes;
    assert!(limit > 0, "a share has a memory limit");

    // What the container's processes get: the shim, and the allocation's files.
    let workload = |args: &[&str]| {
        let mut cmd = node.command(binary("tessera-workload"));
        cmd.env("LD_PRELOAD", shim())
            .env("TESSERA_LIMITS", host_dir.join("limits"))
            .env("TESSERA_REGION", host_dir.join("region"))
            .env("TESSERA_ALLOCATION", &id)
            .args(args);
        cmd
    };

    // Past the limit: refused at the limit, as a real driver refuses past the GPU's memory.
    let want_mib = (limit / MIB + 1024).to_string();
    let out = workload(&["--alloc-mib", &want_mib, "--chunk-mib", "1024"]).output().expect("workload");
    let report: serde_json::Value =
        serde_json::from_slice(out.stdout.split(|&b| b == b'\n').rfind(|l| !l.is_empty()).expect("a report"))
            .expect("json");
    assert_eq!(out.status.code(), Some(3), "OOM exits 3: {report}");
    assert_eq!(report["alloc_error"], "CUDA_ERROR_OUT_OF_MEMORY", "{report}");
    let got = report["allocated_bytes"].as_u64().expect("allocated");
    assert!(got + OVERHEAD_MIB * MIB <= limit && got + OVERHEAD_MIB * MIB + 1024 * MIB > limit, "{got} of {limit}");
    assert_eq!(report["mem_total"].as_u64(), Some(limit), "cuMemGetInfo shows the share's size");

    // Holding 4 GiB: the node API and the CLI see it.
    let mut holder = workload(&["--alloc-mib", "4096", "--hold", "60"]).stdout(Stdio::piped()).spawn().expect("spawn");
    let first = BufReader::new(holder.stdout.take().expect("stdout")).lines().next().expect("line").expect("read");
    assert!(first.contains("holding"), "{first}");
    let u = usage(&mut api, &id).await;
    assert_eq!(u.processes, 1);
    assert_eq!(u.devices[0].memory_used_bytes, (4096 + OVERHEAD_MIB) * MIB);
    assert_eq!(u.devices[0].device_id, share);
    let status = std::process::Command::new(binary("tessera"))
        .arg("--socket")
        .arg(dir.join("run/tessera.sock"))
        .arg("status")
        .output()
        .expect("tessera status");
    let text = String::from_utf8_lossy(&status.stdout);
    let row = text.lines().find(|l| l.starts_with(&share)).unwrap_or_else(|| panic!("no row for {share}:\n{text}"));
    assert!(row.contains(&id) && row.contains(&format!("{} MiB", 4096 + OVERHEAD_MIB)), "{row}");
    // `tessera top`: one frame, the container's row with what it holds against its limit.
    let top = std::process::Command::new(binary("tessera"))
        .arg("--socket")
        .arg(dir.join("run/tessera.sock"))
        .args(["top", "--once", "--interval-ms", "200"])
        .output()
        .expect("tessera top");
    let frame = String::from_utf8_lossy(&top.stdout);
    assert!(top.status.success(), "{frame}{}", String::from_utf8_lossy(&top.stderr));
    let row = frame.lines().find(|l| l.starts_with(&id)).unwrap_or_else(|| panic!("no row for {id}:\n{frame}"));
    assert!(
        row.contains(&share) && row.contains(&format!("{} MiB / {} MiB", 4096 + OVERHEAD_MIB, limit >> 20)),
        "{row}"
    );

    // Prometheus scrapes what it holds, with the share's labels, and the GPU's dcgm-style series.
    let prometheus = Prometheus::start(dir, metrics);
    let held = ((4096 + OVERHEAD_MIB) * MIB) as f64;
    let labels = prometheus.wait_for(&format!("tessera_container_memory_used_bytes{{allocation=\"{id}\"}}"), held);
    assert_eq!(labels.get("device_id").and_then(|v| v.as_str()), Some(share.as_str()), "{labels:?}");
    prometheus.wait_for(&format!("tessera_container_memory_limit_bytes{{allocation=\"{id}\"}}"), limit as f64);
    let fb = prometheus.query("DCGM_FI_DEV_FB_USED");
    assert!(fb.len() == 1 && fb[0].1 >= (4096 + OVERHEAD_MIB) as f64, "FB_USED (MiB): {fb:?}");
    // The sensors NVML reports, under dcgm-exporter's names; an H100 SXM5 draws at most 700 W.
    for (name, lo, hi) in [
        ("DCGM_FI_DEV_GPU_TEMP", 15.0, 100.0),
        ("DCGM_FI_DEV_POWER_USAGE", 1.0, 700.0),
        ("DCGM_FI_DEV_SM_CLOCK", 100.0, 2000.0),
        ("DCGM_FI_DEV_MEM_CLOCK", 100.0, 3000.0),
    ] {
        let v = prometheus.query(name);
        assert!(v.len() == 1 && (lo..=hi).contains(&v[0].1), "{name}: {v:?}");
    }
    // Corrected ECC errors counted as they happen; they leave the GPU healthy.
    prometheus.wait_for("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 0.0);
    let inject = node.command(binary("tessera-sim")).args(["inject", "ecc", "--gpu", "0", "--corrected", "3"]).output();
    let inject = inject.expect("tessera-sim inject ecc");
    assert!(inject.status.success(), "{}", String::from_utf8_lossy(&inject.stderr));
    prometheus.wait_for("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 3.0);
    prometheus.wait_for("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0.0);
    prometheus.wait_for("tessera_gpu_healthy", 1.0);
    // The last XID the health monitor saw, as dcgm-exporter shows it: 0 before any, then the
    // latest one (not the largest); application XIDs leave the GPU in service.
    prometheus.wait_for("DCGM_FI_DEV_XID_ERRORS", 0.0);
    for xid in ["43", "31"] {
        let inject = node.command(binary("tessera-sim")).args(["inject", "xid", "--gpu", "0", "--xid", xid]).output();
        let inject = inject.expect("tessera-sim inject xid");
        assert!(inject.status.success(), "{}", String::from_utf8_lossy(&inject.stderr));
        let labels = prometheus.wait_for("DCGM_FI_DEV_XID_ERRORS", xid.parse().expect("a number"));
        assert_eq!(labels.get("gpu").and_then(|v| v.as_str()), Some("0"), "{labels:?}");
    }
    prometheus.wait_for("tessera_gpu_healthy", 1.0);

    // Killed: its memory is back, and usage says so.
    holder.kill().expect("kill");
    holder.wait().expect("reap");
    let deadline = Instant::now() + WAIT;
    loop {
        let u = usage(&mut api, &id).await;
        if u.processes == 0 && u.devices[0].memory_used_bytes == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "usage after kill: {u:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
