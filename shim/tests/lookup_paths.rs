//! The hard memory limit on each of the three ways programs reach the driver: linked against
//! libcuda, dlopen + dlsym, and dlopen + cuGetProcAddress_v2 (as CUDA runtimes do).

mod common;

use common::*;
use tessera_sim_testkit::{SimNode, binary};

/// 16 chunks of 128 MiB fill the limit exactly beside one context.
const CHUNK_MIB: u64 = 128;
const LIMIT: u64 = (OVERHEAD_MIB + 16 * CHUNK_MIB) * MIB;

/// Runs tessera-workload on `node` with the shim preloaded and no container, its limit given by
/// `TESSERA_MEMORY_LIMIT=limit`: its exit code and its JSON report.
fn standalone(node: &SimNode, limit: &str, args: &[&str]) -> (Option<i32>, serde_json::Value) {
    let out = node
        .command(binary("tessera-workload"))
        .env("LD_PRELOAD", shim())
        .env("TESSERA_MEMORY_LIMIT", limit)
        .args(args)
        .output()
        .unwrap();
    (out.status.code(), serde_json::from_slice(out.stdout.trim_ascii_end()).unwrap())
}

#[test]
fn every_lookup_path_stops_exactly_at_the_limit() {
    let node = node();
    for lookup in ["linked", "dlsym", "getprocaddress"] {
        let c = Container::new(&memory_limits(LIMIT));
        let (code, r, stderr) = workload(
            &c,
            &node,
            &["--lookup", lookup, "--alloc-mib", "4096", "--chunk-mib", "128", "--kernels", "5", "--kernel-us", "100"],
        );
        assert_eq!(code, 3, "{lookup}: exit code 3 is out of memory: {r}\n{stderr}");
        assert_eq!(r["alloc_error"], "CUDA_ERROR_OUT_OF_MEMORY", "{lookup}: {r}");
        assert!(r["error"].is_null(), "{lookup}: {r}");
        assert_eq!(r["allocated_bytes"].as_u64().unwrap(), 16 * CHUNK_MIB * MIB, "{lookup}: up to the limit exactly");
        assert_eq!(r["mem_total"].as_u64().unwrap(), LIMIT, "{lookup}: cuMemGetInfo total is the limit");
        assert_eq!(r["device_total_bytes"].as_u64().unwrap(), LIMIT, "{lookup}: cuDeviceTotalMem is the limit");
        assert_eq!(
            r["mem_free_before"].as_u64().unwrap(),
            LIMIT - OVERHEAD_MIB * MIB,
            "{lookup}: free is the limit less the context"
        );
        assert_eq!(r["mem_free_after_alloc"].as_u64().unwrap(), 0, "{lookup}: nothing left, and no underflow");
        assert_eq!(r["kernels"], 5, "{lookup}: launches pass through the launch hooks: {r}");
        assert!(stderr.is_empty(), "{lookup}: the shim says nothing when all is well: {stderr}");
        // Everything was given back: the allocations freed, the context released.
        let region = c.region();
        region.reap();
        assert_eq!(region.used(0), 0, "{lookup}: the container holds nothing after the process");
    }
}

#[test]
fn without_a_limit_the_gpu_is_the_whole_gpu() {
    let node = node();
    let c = Container::new(&tessera_region::Limits::default());
    let (code, r, stderr) = workload(&c, &node, &["--alloc-mib", "4096"]);
    assert_eq!(code, 0, "{r}\n{stderr}");
    assert_eq!(r["allocated_bytes"].as_u64().unwrap(), 4 * GIB);
    assert!(r["mem_total"].as_u64().unwrap() > 79 * GIB, "{r}");
}

#[test]
fn standalone_limits_come_from_the_environment() {
    let node = node();
    for lookup in ["linked", "getprocaddress"] {
        let (code, r) = standalone(&node, "1GiB", &["--lookup", lookup, "--alloc-mib", "2048", "--chunk-mib", "100"]);
        assert_eq!(code, Some(3), "{r}");
        // 1024 MiB less the 300 MiB context: seven chunks of 100 MiB.
        assert_eq!(r["allocated_bytes"].as_u64().unwrap(), 700 * MIB, "{r}");
        assert_eq!(r["mem_total"].as_u64().unwrap(), GIB, "{r}");
    }
}

#[test]
fn a_per_device_limit_applies_to_its_device_only() {
    let node = node();
    let (code, r) = standalone(&node, "1=1GiB", &["--device", "1", "--alloc-mib", "2048", "--chunk-mib", "100"]);
    assert_eq!(code, Some(3), "{r}");
    assert_eq!(r["mem_total"].as_u64().unwrap(), GIB, "{r}");
    let (code, r) = standalone(&node, "1=1GiB", &["--device", "0", "--alloc-mib", "2048", "--chunk-mib", "100"]);
    assert_eq!(code, Some(0), "device 0 has no limit: {r}");
}
