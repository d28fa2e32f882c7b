//! Park and resume of a pod's GPU share on a real Kubernetes node (issue 33, items 4 and 9):
//! a DRA share claim allocated by kube-scheduler, its pod's CUDA program running in a containerd
//! container (its own PID namespace and cgroup), parked by the allocation ID the claim's
//! `status.devices[].data.allocationID` names, as docs/kubernetes.md tells a platform to, and
//! resumed. The container's process is found by its host pid (it calls itself by its
//! namespace's), its memory leaves the GPU while the pod stays Running, and comes back.
//!
//! Run by scripts/test.sh with the cluster up, as `kube_cluster` is (the same SKIP and
//! `TESSERA_REQUIRE_RUNTIMES` rules, tests/kube.rs).

use std::sync::MutexGuard;

use serde_json::{Value, json};
use tessera_sim_model::Node;
use tessera_tests::kube::{Kube, Tesserad, claim, dra_config, pod, serial, uses};
use tessera_tests::{ok, tessera};

const GIB: u64 = 1 << 30;
const H100: &str = "[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n";

/// The pod's phase, as the API server has it.
fn phase(kube: &Kube, name: &str) -> String {
    kube.get(&["pod", name]).and_then(|p| p["status"]["phase"].as_str().map(str::to_owned)).unwrap_or_default()
}

/// `NSpid` of a host process: its pid in each PID namespace it is in, outermost first.
fn ns_pids(pid: u64) -> Vec<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:")).unwrap_or_default();
    line.split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

/// The cluster (none: the test says SKIP, or fails under `TESSERA_REQUIRE_RUNTIMES`), held for
/// this test alone; tesserad in DRA mode over one simulated H100, what an earlier failed run
/// left of `pods` and `claims` deleted, the device classes applied; the simulated node, to read
/// its GPU.
fn dra_node(pods: &[&str], claims: &[&str]) -> Option<(Kube, MutexGuard<'static, ()>, Tesserad, Node)> {
    let kube = Kube::find()?;
    let serial = serial();
    let t = Tesserad::start(&kube, H100, &dra_config(&kube));
    kube.clean(pods, claims, &|| t.log());
    kube.apply_dra_classes();
    let m = Node::open(None, Some(&t.node.state)).expect("the simulated node");
    Some((kube, serial, t, m))
}

/// The GPU's used memory, by NVML.
fn used(m: &Node) -> u64 {
    m.memory_info(0, 0).expect("NVML memory").used
}

/// Claim `c` and pod `name` running `script` (a `tessera-workload` that says `holding`) with it,
/// once the program holds its memory: the claim's allocation id, from its `status.devices`.
fn run_holding(kube: &Kube, t: &Tesserad, c: &Value, name: &str, script: &str) -> String {
    let extra = || t.log();
    let claim_name = c["metadata"]["name"].as_str().expect("the claim's name");
    kube.apply(c);
    kube.apply(&pod(kube, t, name, script, json!({}), uses(claim_name)));
    kube.wait("the pod's program holding its memory", &extra, || {
        let logs = kube.kubectl(&["logs", name], None);
        String::from_utf8_lossy(&logs.stdout).contains("holding").then_some(())
    });
    kube.wait("the claim's allocationID", &extra, || {
        let c = kube.get(&["resourceclaim", claim_name])?;
        c["status"]["devices"].as_array()?.first()?["data"]["allocationID"].as_str().map(str::to_owned)
    })
}

#[test]
fn a_pods_share_is_parked_and_resumed_by_its_claims_allocation_id() {
    let (pods, claims) = (["kube-park"], ["park-share"]);
    let Some((kube, _serial, t, m)) = dra_node(&pods, &claims) else { return };
    let extra = || t.log();

    let c = claim("park-share", "gpu-share.tessera.io", json!({"memory": "8Gi", "sm": "30"}), "");
    let id = run_holding(&kube, &t, &c, "kube-park", "tessera-workload --alloc-mib 1024 --hold 3600");
    let before = used(&m);
    assert!(before >= GIB, "the program's GiB is on the GPU: {before}");

    let out = ok(&tessera(t.dir.path(), &["park", &id, "--json"]));
    let parked: Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(parked["state"], "parked", "{parked}\n{}", t.log());
    assert!(parked["bytes"].as_u64().is_some_and(|b| b >= GIB), "{parked}");
    let pids: Vec<u64> = parked["pids"].as_array().expect("pids").iter().filter_map(Value::as_u64).collect();
    assert_eq!(pids.len(), 1, "the container's one CUDA process: {parked}");
    let inside = ns_pids(pids[0]);
    assert!(
        inside.len() >= 2 && inside[0] == pids[0] && inside[inside.len() - 1] != pids[0],
        "parked by its host pid, a process of the container's own PID namespace: NSpid {inside:?}"
    );
    assert_eq!(used(&m), 0, "NVML: the share's memory is off the GPU");
    assert_eq!(phase(&kube, "kube-park"), "Running", "the pod runs on while parked");
    let listed = t.allocations();
    let state = listed.iter().find(|a| a["id"] == id.as_str()).map(|a| a["state"].clone());
    assert_eq!(state, Some(json!("parked")), "{listed:?}");

    ok(&tessera(t.dir.path(), &["resume", &id]));
    assert_eq!(used(&m), before, "its memory is back");
    assert_eq!(phase(&kube, "kube-park"), "Running");
    let listed = t.allocations();
    let state = listed.iter().find(|a| a["id"] == id.as_str()).map(|a| a["state"].clone());
    assert_eq!(state, Some(json!("running")), "{listed:?}");

    kube.clean(&pods, &claims, &extra);
    kube.wait("the claim unprepared", &extra, || t.allocations().is_empty().then_some(()));
}

/// `tessera allocations --json`: allocation `id`'s state and the allocation it was preempted by.
fn state(t: &Tesserad, id: &str) -> (String, String) {
    let listed = t.allocations();
    let a = listed.iter().find(|a| a["id"] == id).unwrap_or_else(|| panic!("{id} is listed: {listed:?}"));
    (a["state"].as_str().unwrap_or_default().to_owned(), a["preempted_by"].as_str().unwrap_or_default().to_owned())
}

/// DRA preemption end to end (issue 33, item 3): a claim whose opaque configuration says
/// `preemptible: true` at priority low is parked when a node API share of high priority does not
/// fit beside it on its GPU; the pod runs on (its CUDA calls wait), and once the high share is
/// released the claim's share is resumed on its own and its program reads its data back intact.
#[test]
fn a_preemptible_claims_share_is_parked_for_a_higher_priority_share_and_resumed_after() {
    let (pods, claims) = (["kube-preempted"], ["preemptible-share"]);
    let Some((kube, _serial, t, m)) = dra_node(&pods, &claims) else { return };
    let extra = || t.log();

    let mut c = claim("preemptible-share", "gpu-share.tessera.io", json!({"memory": "8Gi", "sm": "30"}), "");
    c["spec"]["devices"]["config"] = json!([{"requests": ["gpu"], "opaque": {"driver": "gpu.tessera.io",
        "parameters": {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig",
                       "priority": "low", "preemptible": true}}}]);
    // 1 GiB with a pattern it reads back after a 25 s hold (parked and resumed meanwhile).
    let script = "tessera-workload --alloc-mib 1024 --verify --hold 25; echo \"END $?\"";
    let low = run_holding(&kube, &t, &c, "kube-preempted", script);
    let listed = t.allocations();
    let entry = listed.iter().find(|a| a["id"] == low.as_str()).expect("the claim's allocation");
    assert_eq!(entry["preemptible"].as_bool(), Some(true), "the claim's opaque configuration: {entry}");
    let before = used(&m);
    assert!(before >= GIB, "{before}");

    // All of the GPU but 4 GiB at high priority: it fits only if the claim's 8 GiB are parked.
    let out =
        ok(&tessera(t.dir.path(), &["alloc", "--memory", "77463MiB", "--sm", "10", "--priority", "high", "--json"]));
    let top: Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let top = top["id"].as_str().expect("id").to_owned();
    assert_eq!(state(&t, &low), ("parked".to_owned(), top.clone()), "{}", t.log());
    assert_eq!(used(&m), 0, "NVML: the claim's memory is off the GPU");
    assert_eq!(phase(&kube, "kube-preempted"), "Running", "the pod runs on while parked");

    // The room back: resumed by tesserad, no one asking.
    ok(&tessera(t.dir.path(), &["release", &top]));
    kube.wait("the claim's share resumed", &extra, || (state(&t, &low).0 == "running").then_some(()));
    assert_eq!(state(&t, &low).1, "", "no longer preempted");
    assert_eq!(used(&m), before, "its memory is back");
    let (phase, logs) = kube.finished("kube-preempted", &extra);
    assert_eq!(phase, "Succeeded", "{logs}");
    let report: Value = logs
        .lines()
        .rfind(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no report: {logs}"));
    assert_eq!(report["verified_after_hold_bytes"], 1u64 << 20, "its data intact: {report}");
    assert!(logs.contains("END 0"), "{logs}");

    kube.clean(&pods, &claims, &extra);
    kube.wait("the claim unprepared", &extra, || t.allocations().is_empty().then_some(()));
}
