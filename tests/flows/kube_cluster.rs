//! tesserad on a real Kubernetes node (scripts/kube.sh up: etcd, kube-apiserver, kube-scheduler,
//! kube-controller-manager, the kubelet and containerd 2 with CDI, built from their Go modules).
//! Each test starts tesserad over a simulated node of its own, creates objects through the real
//! API server with kubectl, and checks what a user would check: the Node's allocatable and labels,
//! a Pod's logs (a CUDA program inside its container), ResourceClaims' status.
//!
//! The cluster is found with `scripts/kube.sh env`; with none up the tests print a SKIP line, or
//! fail when `TESSERA_REQUIRE_RUNTIMES` is set (scripts/test.sh starts one, CI sets the variable).
//! scripts/test.sh runs the workspace's tests with `TESSERA_KUBE_DEFERRED` set (these then return
//! at once, saying so), then starts the cluster and runs these alone.
//! A failure prints the last lines of the components' logs and of tesserad's.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use tessera_sim_testkit::SimNode;
use tessera_tests::kube::{Kube, Tesserad, WAIT, claim, dra_config, log_tail, pod, section, serial, sim_host, uses};

const MIB: u64 = 1 << 20;
/// The simulated driver's memory per context, which counts against a share as on a real GPU.
const OVERHEAD_MIB: u64 = 300;
/// What a container sees of its GPU: its device nodes, the preload, the CUDA program's view of
/// the memory, and what happens past it.
const PROBE: &str = r#"
for f in /dev/nvidia*; do [ -c "$f" ] && echo "node $f"; done
echo "preload $(cat /etc/ld.so.preload)"
echo "allocation $TESSERA_ALLOCATION"
env | grep ^TESSERA_ | sort
ls -l /run/tessera/alloc/ /usr/lib/tessera/ 2>&1
cat /run/tessera/alloc/limits
echo BEGIN-TOTAL
tessera-workload
echo "END-TOTAL $?"
echo BEGIN-OOM
tessera-workload --alloc-mib 90000 --chunk-mib 512
echo "END-OOM $?"
echo DONE
"#;

const H100X2: &str = "[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 2\n";

/// tesserad's configuration in device-plugin mode on this cluster, then `partitions`.
fn device_plugin_config(kube: &Kube, partitions: &str) -> String {
    format!(
        "[kubernetes]\nmode = \"device-plugin\"\nkubeconfig = {:?}\nnode_name = {:?}\n{partitions}",
        kube.var("KUBECONFIG"),
        kube.node()
    )
}

/// Device-plugin mode against the real kubelet: registration, the Node's allocatable (a whole
/// GPU and two shares of the other), the `tessera.io/` labels as `kubectl get node -L` shows
/// them, a Pod asking for a share whose CUDA program sees the share's memory as the total and is
/// refused past it, and the allocation released when the Pod is deleted.
#[test]
fn device_plugin_share_runs_a_pod_on_the_real_kubelet() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let body = device_plugin_config(&kube, "[partitions.0]\nwhole = true\n[partitions.1]\nshares = { count = 2 }\n");
    let t = Tesserad::start(&kube, H100X2, &body);
    let extra = || t.log();

    // The kubelet took the registration: the Node offers one GPU and two shares.
    kube.wait("allocatable tessera.io/gpu = 1 and tessera.io/gpu-share = 2", &extra, || {
        let a = kube.node_object()["status"]["allocatable"].clone();
        (a["tessera.io/gpu"] == "1" && a["tessera.io/gpu-share"] == "2").then_some(())
    });

    // Labels: what `kubectl get node -L` prints.
    let columns = "tessera.io/gpu.product,tessera.io/gpu.count,tessera.io/gpu.memory,tessera.io/mig.strategy";
    let table = kube.wait("the tessera.io/ labels on the node", &extra, || {
        let out = kube.ok(&["get", "node", kube.node(), "-L", columns], None);
        out.contains("NVIDIA-H100-80GB-HBM3").then_some(out)
    });
    let header: Vec<&str> = table.lines().next().expect("header").split_whitespace().collect();
    let row: Vec<&str> = table.lines().nth(1).expect("the node's row").split_whitespace().collect();
    let column = |name: &str| {
        let i = header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no column {name}:\n{table}"));
        row[i]
    };
    assert_eq!(column("GPU.PRODUCT"), "NVIDIA-H100-80GB-HBM3", "{table}");
    assert_eq!(column("GPU.COUNT"), "2", "{table}");
    assert_eq!(column("GPU.MEMORY"), "81559", "{table}");
    assert_eq!(column("MIG.STRATEGY"), "none", "{table}");

    // A Pod asking for one share.
    kube.delete_pod("share-probe", &extra);
    kube.apply(&pod(&kube, &t, "share-probe", PROBE, json!({"limits": {"tessera.io/gpu-share": "1"}}), Value::Null));
    let (phase, logs) = kube.finished("share-probe", &extra);
    assert_eq!(phase, "Succeeded", "{logs}\n{}", t.log());
    let allocs = t.allocations();
    assert_eq!(allocs.len(), 1, "one allocation while the pod exists: {allocs:?}");
    let id = allocs[0]["id"].as_str().expect("id").to_owned();
    assert!(logs.contains(&format!("allocation {id}")), "{logs}");
    assert!(logs.contains("preload /usr/lib/tessera/libtessera.so"), "{logs}");
    let nodes: Vec<&str> = logs.lines().filter(|l| l.starts_with("node ")).collect();
    assert_eq!(nodes, ["node /dev/nvidia1", "node /dev/nvidiactl"], "the shared GPU's node only:\n{logs}");

    // Half of the GPU's memory (whole MiB), as the CUDA program inside sees it.
    let share_bytes = 81_559 / 2 * MIB;
    let (total, status) = section(&logs, "TOTAL");
    assert_eq!(status, "0", "{total}");
    assert_eq!(total["mem_total"].as_u64(), Some(share_bytes), "cuMemGetInfo's total is the share:\n{logs}");
    let (oom, status) = section(&logs, "OOM");
    assert_eq!((status.as_str(), oom["alloc_error"].as_str()), ("3", Some("CUDA_ERROR_OUT_OF_MEMORY")), "{oom}");
    let got = oom["allocated_bytes"].as_u64().expect("allocated_bytes");
    assert!(
        got + OVERHEAD_MIB * MIB <= share_bytes && got + OVERHEAD_MIB * MIB + 512 * MIB > share_bytes,
        "allocated {got} of a {share_bytes}-byte share"
    );

    // Deleting the Pod releases the allocation.
    kube.delete_pod("share-probe", &extra);
    kube.wait("the share's allocation released", &extra, || t.allocations().is_empty().then_some(()));
}

/// A power cut between the kubelet's Allocate answer and the flush of its record (the record is
/// flushed a moment after the answer): the real kubelet keeps the answer in its own checkpoint,
/// which tesserad's reader understands (the grant's resource, devices and allocation id), and a
/// tesserad that finds the record gone from its journal makes it again from there, with the same
/// id, devices and limits, while the pod keeps running. What the cut leaves is made here: tesserad
/// killed, the record's frames zeroed from the journal (as unflushed frames are after a cut).
#[test]
fn a_kubelet_record_lost_at_a_power_cut_is_made_again_from_the_kubelets_checkpoint() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let mut t =
        Tesserad::start(&kube, H100X2, &device_plugin_config(&kube, "[partitions.1]\nshares = { count = 2 }\n"));
    let log = t.dir.path().join("tesserad.log");
    let extra = move || log_tail(&log);
    kube.wait("allocatable tessera.io/gpu-share = 2", &extra, || {
        (kube.node_object()["status"]["allocatable"]["tessera.io/gpu-share"] == "2").then_some(())
    });
    kube.delete_pod("cut-share", &extra);
    kube.apply(&pod(&kube, &t, "cut-share", TOTAL_ONLY, json!({"limits": {"tessera.io/gpu-share": "1"}}), Value::Null));
    let logs = kube.done("cut-share", &extra);
    let allocs = t.allocations();
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    let id = allocs[0]["id"].as_str().expect("id").to_owned();
    assert!(logs.contains(&format!("allocation {id}")), "{logs}");
    let devices: Vec<String> = allocs[0]["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|d| d["device_id"].as_str().unwrap().into())
        .collect();

    // The real kubelet's checkpoint, as tesserad reads it.
    let grants = tessera_daemon::allocator::kubelet_grants::read(Path::new(kube.var("KUBELET_DEVICE_PLUGIN_DIR")))
        .expect("the kubelet's checkpoint parses")
        .expect("the kubelet keeps a checkpoint");
    let grant = grants
        .iter()
        .find(|g| g.allocation.as_deref() == Some(id.as_str()))
        .unwrap_or_else(|| panic!("no grant of allocation {id} in the kubelet's checkpoint: {grants:?}"));
    assert_eq!(grant.resource, "tessera.io/gpu-share");
    assert_eq!(grant.device_ids, devices);
    assert_eq!(grant.container.container_name.as_deref(), Some("main"));

    // The cut: tesserad gone, the record's frames not on the disk.
    t.kill_9();
    let journal = t.dir.path().join("state/allocations.journal");
    let mut bytes = std::fs::read(&journal).expect("the journal");
    let needle = format!("\"{id}\"");
    let at = bytes.windows(needle.len()).position(|w| w == needle.as_bytes()).expect("the record's frame");
    let start = bytes[..at]
        .windows(4)
        .rposition(|w| w == tessera_daemon::state::journal::MAGIC.to_le_bytes())
        .expect("its frame's magic");
    let end = bytes.iter().rposition(|b| *b != 0).expect("frames") + 1;
    bytes[start..end].fill(0);
    std::fs::write(&journal, &bytes).expect("write the journal");
    assert!(tessera_daemon::state::store::read_records(&t.dir.path().join("state")).unwrap().is_empty());

    t.respawn();
    let back = kube.wait("the allocation made again from the kubelet's checkpoint", &extra, || {
        t.allocations().into_iter().find(|a| a["id"].as_str() == Some(id.as_str()))
    });
    let again: Vec<&str> =
        back["devices"].as_array().unwrap().iter().map(|d| d["device_id"].as_str().unwrap()).collect();
    assert_eq!(again, devices);
    assert!(t.log().contains(&format!("allocation {id} made again from the kubelet's checkpoint")), "{}", t.log());
    let p = kube.get(&["pod", "cut-share"]).expect("the pod");
    assert_eq!(p["status"]["phase"], "Running", "{p:#}");

    kube.delete_pod("cut-share", &extra);
    kube.wait("the share's allocation released", &extra, || t.allocations().is_empty().then_some(()));
}

const TOTAL_ONLY: &str = r#"
for f in /dev/nvidia*; do [ -c "$f" ] && echo "node $f"; done
echo "allocation $TESSERA_ALLOCATION"
cat /run/tessera/alloc/limits
echo BEGIN-TOTAL
tessera-workload
echo "END-TOTAL $?"
echo DONE
sleep 3600
"#;

/// DRA with the real kube-scheduler (1.37 or whatever the cluster runs): tesserad's slices are
/// accepted; the scheduler allocates a whole GPU, and two claims of 8Gi and 30 SM on one GPU
/// (consumable capacity); each container gets exactly its device and limits; the claims'
/// `status.devices` carry the UUID, memory, SM and allocation id; a claim that cannot fit keeps
/// its pod Pending with the scheduler's reason; deleting pods and claims unprepares them.
#[test]
fn dra_claims_are_allocated_by_the_real_scheduler() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let pods = ["dra-whole", "dra-share-a", "dra-share-b", "dra-too-big"];
    let claims = ["whole-gpu", "share-a", "share-b", "too-big"];
    let body = dra_config(&kube);
    let t = Tesserad::start(&kube, H100X2, &body);
    let extra = || t.log();
    // What an earlier failed run left (its pods wait for a DRA driver to unprepare their claims:
    // this tesserad answers for claims it never prepared).
    kube.clean(&pods, &claims, &extra);
    kube.apply_dra_classes();

    // The API server accepted the slice: every device of both GPUs.
    let field = format!("spec.nodeName={}", kube.node());
    let devices = kube.wait("tesserad's ResourceSlice", &extra, || {
        let slices = kube.get(&["resourceslices", "--field-selector", &field])?;
        let mut names: Vec<String> = slices["items"]
            .as_array()?
            .iter()
            .filter(|s| s["spec"]["driver"] == "gpu.tessera.io")
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .filter_map(|d| d["name"].as_str().map(str::to_owned))
            .collect();
        names.sort();
        (names.len() == 4).then_some(names)
    });
    assert_eq!(devices, ["gpu-0", "gpu-0-shared", "gpu-1", "gpu-1-shared"]);

    // A whole GPU.
    kube.apply(&claim("whole-gpu", "gpu.tessera.io", Value::Null, ""));
    kube.apply(&pod(&kube, &t, "dra-whole", TOTAL_ONLY, json!({}), uses("whole-gpu")));
    let logs = kube.done("dra-whole", &extra);
    let whole = kube.get(&["resourceclaim", "whole-gpu"]).expect("the claim");
    let result = &whole["status"]["allocation"]["devices"]["results"][0];
    let device = result["device"].as_str().expect("allocated device").to_owned();
    assert!(device == "gpu-0" || device == "gpu-1", "{whole:#}");
    let index = &device[4..];
    let nodes: Vec<&str> = logs.lines().filter(|l| l.starts_with("node ")).collect();
    assert_eq!(nodes, [format!("node /dev/nvidia{index}"), "node /dev/nvidiactl".into()], "{logs}");
    let (total, status) = section(&logs, "TOTAL");
    assert_eq!((status.as_str(), total["mem_total"].as_u64()), ("0", Some(81_559 * MIB)), "the whole GPU: {logs}");
    let status = kube.wait("the whole GPU claim's status.devices", &extra, || {
        let c = kube.get(&["resourceclaim", "whole-gpu"])?;
        let entry = c["status"]["devices"].as_array()?.first()?.clone();
        (entry["data"]["uuid"].is_string()).then_some(entry)
    });
    assert_eq!((status["driver"].as_str(), status["device"].as_str()), (Some("gpu.tessera.io"), Some(device.as_str())));
    assert!(status["data"]["uuid"].as_str().is_some_and(|u| u.starts_with("GPU-")), "{status:#}");
    let id = status["data"]["allocationID"].as_str().expect("allocationID");
    assert!(logs.contains(&format!("allocation {id}")), "{status:#}\n{logs}");
    kube.delete_pod("dra-whole", &extra);
    kube.ok(&["delete", "resourceclaim", "whole-gpu", "--wait=true", "--timeout=240s"], None);
    kube.wait("the whole GPU unprepared", &extra, || t.allocations().is_empty().then_some(()));

    // Two claims of 8Gi and 30 SM, on GPU 0 both (consumable capacity).
    let on_gpu0 = r#"device.attributes["gpu.tessera.io"].index == 0"#;
    for name in ["share-a", "share-b"] {
        kube.apply(&claim(name, "gpu-share.tessera.io", json!({"memory": "8Gi", "sm": "30"}), on_gpu0));
        let script = format!("{PROBE}\nsleep 3600\n");
        kube.apply(&pod(&kube, &t, &format!("dra-{name}"), &script, json!({}), uses(name)));
    }
    let limit = 8u64 << 30;
    let mut ids = Vec::new();
    let mut share_ids = Vec::new();
    for name in ["share-a", "share-b"] {
        let logs = kube.done(&format!("dra-{name}"), &extra);
        let nodes: Vec<&str> = logs.lines().filter(|l| l.starts_with("node ")).collect();
        assert_eq!(nodes, ["node /dev/nvidia0", "node /dev/nvidiactl"], "{logs}");
        let (total, _) = section(&logs, "TOTAL");
        assert_eq!(total["mem_total"].as_u64(), Some(limit), "the claim's 8Gi as the total: {logs}");
        let (oom, status) = section(&logs, "OOM");
        assert_eq!((status.as_str(), oom["alloc_error"].as_str()), ("3", Some("CUDA_ERROR_OUT_OF_MEMORY")), "{oom}");
        let got = oom["allocated_bytes"].as_u64().expect("allocated_bytes");
        assert!(got + OVERHEAD_MIB * MIB <= limit && got + OVERHEAD_MIB * MIB + 512 * MIB > limit, "{got} of {limit}");
        assert!(logs.contains("sm_percent = 30"), "{logs}");
        let c = kube.wait(&format!("claim {name}'s status.devices"), &extra, || {
            let c = kube.get(&["resourceclaim", name])?;
            c["status"]["devices"].as_array()?.first()?["data"]["allocationID"].is_string().then_some(c)
        });
        let result = &c["status"]["allocation"]["devices"]["results"][0];
        assert_eq!(result["device"], "gpu-0-shared", "{c:#}");
        assert_eq!(
            (result["consumedCapacity"]["memory"].as_str(), result["consumedCapacity"]["sm"].as_str()),
            (Some("8Gi"), Some("30")),
            "{c:#}"
        );
        share_ids.push(result["shareID"].as_str().expect("shareID").to_owned());
        let data = &c["status"]["devices"][0]["data"];
        assert_eq!((data["memory"].as_str(), data["sm"].as_u64()), (Some("8Gi"), Some(30)), "{c:#}");
        let id = data["allocationID"].as_str().expect("allocationID").to_owned();
        assert!(logs.contains(&format!("allocation {id}")), "{c:#}\n{logs}");
        ids.push(id);
    }
    assert_ne!(share_ids[0], share_ids[1], "two shares of one device");
    assert_ne!(ids[0], ids[1]);
    assert_eq!(t.allocations().len(), 2, "{:?}", t.allocations());

    // More than any GPU has: Pending, with the scheduler's reason.
    kube.apply(&claim("too-big", "gpu-share.tessera.io", json!({"memory": "100Gi", "sm": "30"}), ""));
    kube.apply(&pod(&kube, &t, "dra-too-big", TOTAL_ONLY, json!({}), uses("too-big")));
    let reason = kube.wait("the scheduler's reason for dra-too-big", &extra, || {
        let p = kube.get(&["pod", "dra-too-big"])?;
        let cond = p["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == "PodScheduled")?.clone();
        (cond["status"] == "False").then(|| format!("{} {}", cond["reason"], cond["message"]))
    });
    assert!(reason.contains("Unschedulable") && reason.contains("claim"), "{reason}");
    assert_eq!(kube.get(&["pod", "dra-too-big"]).expect("pod")["status"]["phase"], "Pending");

    kube.clean(&pods, &claims, &extra);
    kube.wait("every claim unprepared", &extra, || t.allocations().is_empty().then_some(()));
}

/// Every `health` of the pod's containers' `allocatedResourcesStatus` entries.
fn resource_health(pod: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for c in pod["status"]["containerStatuses"].as_array().into_iter().flatten() {
        for entry in c["allocatedResourcesStatus"].as_array().into_iter().flatten() {
            for r in entry["resources"].as_array().into_iter().flatten() {
                out.push(format!(
                    "{}={}",
                    r["resourceID"].as_str().unwrap_or("?"),
                    r["health"].as_str().unwrap_or("?")
                ));
            }
        }
    }
    out
}

/// The taints' effects on device `name` of tesserad's slices for this node.
fn device_taints(kube: &Kube, name: &str) -> Option<Vec<String>> {
    let field = format!("spec.nodeName={}", kube.node());
    let slices = kube.get(&["resourceslices", "--field-selector", &field])?;
    let device = slices["items"]
        .as_array()?
        .iter()
        .filter(|s| s["spec"]["driver"] == "gpu.tessera.io")
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["name"] == name)?;
    Some(
        device["taints"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| format!("{}:{}", t["key"].as_str().unwrap_or("?"), t["effect"].as_str().unwrap_or("?")))
            .collect(),
    )
}

/// Health through the real components: XID 79 on the GPU a running pod's claim holds shows as
/// Unhealthy in the pod's `allocatedResourcesStatus`, as a NoExecute taint on the slice's device
/// (1.36+; the claim tolerates it, so the pod is not evicted while the test looks; before 1.36
/// the device leaves the slice), and as GPUFault Events on the Node and the Pod; after the GPU's
/// reset and the recovery check, the status is Healthy and the taint gone (the device back).
///
/// The pod's entry for the claim has the claim's own name: the 1.34 kubelet matches a
/// container's claim to the claim's health by comparing the entry's name with the
/// ResourceClaim's (`UpdateAllocatedResourcesStatus`), so with any other name it never shows
/// `allocatedResourcesStatus` (docs/kubernetes.md).
#[test]
fn a_gpu_fault_reaches_the_pod_status_the_slice_and_events() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let body = format!(
        "[kubernetes]\nmode = \"dra\"\nkubeconfig = {:?}\nnode_name = {:?}\nplugins_dir = {:?}\nplugins_registry_dir = {:?}\n\
         [health]\ninterval_seconds = 1\nrecovery_check_ms = 1500\n",
        kube.var("KUBECONFIG"),
        kube.node(),
        kube.var("KUBELET_PLUGINS_DIR"),
        kube.var("KUBELET_PLUGINS_REGISTRY_DIR"),
    );
    let t = Tesserad::start(&kube, H100X2, &body);
    let extra = || t.log();
    kube.clean(&["dra-health"], &["health-gpu"], &extra);
    kube.apply_dra_classes();
    kube.wait("gpu-1 published, untainted", &extra, || device_taints(&kube, "gpu-1").filter(|t| t.is_empty()));

    let mut c = claim("health-gpu", "gpu.tessera.io", Value::Null, r#"device.attributes["gpu.tessera.io"].index == 1"#);
    c["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] =
        json!([{"key": "gpu.tessera.io/unhealthy", "operator": "Exists", "effect": "NoExecute"}]);
    kube.apply(&c);
    let entry = json!([{"name": "health-gpu", "resourceClaimName": "health-gpu"}]);
    kube.apply(&pod(&kube, &t, "dra-health", "echo DONE; sleep 3600", json!({}), entry));
    // Before 1.36 an unhealthy device leaves the slice instead of being tainted.
    let tainted = !kube.var("KUBE_VERSION").starts_with("v1.34.");
    kube.done("dra-health", &extra);
    kube.wait("the pod's device Healthy", &extra, || {
        let h = resource_health(&kube.get(&["pod", "dra-health"])?);
        (!h.is_empty() && h.iter().all(|e| e.ends_with("=Healthy"))).then_some(())
    });

    let uuid = kube.wait("the claim's status.devices", &extra, || {
        let c = kube.get(&["resourceclaim", "health-gpu"])?;
        assert_eq!(c["status"]["allocation"]["devices"]["results"][0]["device"], "gpu-1", "{c:#}");
        c["status"]["devices"].as_array()?.first()?["data"]["uuid"].as_str().map(str::to_owned)
    });
    let sim = tessera_sim_model::Node::open(t.node.description.as_deref(), Some(&t.node.state)).expect("sim node");
    sim.inject_xid(1, 79, None, None).expect("GPU 1 falls off the bus");
    let health = kube.wait("the pod's device Unhealthy", &extra, || {
        let h = resource_health(&kube.get(&["pod", "dra-health"])?);
        h.iter().any(|e| e.ends_with("=Unhealthy")).then_some(h)
    });
    // The kubelet names the device by the CDI name tesserad answered: the claim's, with GPU 1's UUID.
    assert!(health.iter().any(|e| e.contains(&uuid) && e.ends_with("=Unhealthy")), "{uuid}: {health:?}");
    if tainted {
        let taints = kube.wait("gpu-1 tainted", &extra, || device_taints(&kube, "gpu-1").filter(|t| !t.is_empty()));
        assert_eq!(taints, ["gpu.tessera.io/unhealthy:NoExecute"]);
    } else {
        kube.wait("gpu-1 out of the slice", &extra, || device_taints(&kube, "gpu-1").is_none().then_some(()));
    }
    assert_eq!(device_taints(&kube, "gpu-0"), Some(vec![]), "GPU 0 is untouched");
    let kinds = kube.wait("GPUFault events on the Node and the Pod", &extra, || {
        let events = kube.get(&["events", "-n", "default", "--field-selector", "reason=GPUFault"])?;
        let mut kinds: Vec<String> = events["items"]
            .as_array()?
            .iter()
            .filter_map(|e| e["involvedObject"]["kind"].as_str().map(str::to_owned))
            .collect();
        kinds.sort();
        kinds.dedup();
        (kinds.len() == 2).then_some(kinds)
    });
    assert_eq!(kinds, ["Node", "Pod"]);
    let table = kube.ok(&["get", "events", "-n", "default", "--field-selector", "reason=GPUFault"], None);
    assert!(table.contains("GPUFault") && table.contains("dra-health"), "{table}");

    sim.reset(1).expect("reset GPU 1");
    kube.wait("the pod's device Healthy again", &extra, || {
        let h = resource_health(&kube.get(&["pod", "dra-health"])?);
        (!h.is_empty() && h.iter().all(|e| e.ends_with("=Healthy"))).then_some(())
    });
    kube.wait("gpu-1 back, untainted", &extra, || device_taints(&kube, "gpu-1").filter(|t| t.is_empty()));

    kube.delete_pod("dra-health", &extra);
    kube.ok(&["delete", "resourceclaim", "--ignore-not-found", "--wait=true", "--timeout=240s", "health-gpu"], None);
    kube.wait("the claim unprepared", &extra, || t.allocations().is_empty().then_some(()));
}

/// Faults: the kubelet and kube-apiserver restarted (`scripts/kube.sh restart`) while a pod holds
/// a share claim: the pod keeps running, the kubelet registers the DRA driver again, and deleting
/// the pod and its claim afterwards releases the allocation (nothing leaks).
#[test]
fn a_kubelet_and_apiserver_restart_keep_the_claim_and_leak_nothing() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let body = dra_config(&kube);
    let t = Tesserad::start(&kube, H100X2, &body);
    let extra = || t.log();
    kube.clean(&["dra-restart"], &["restart-share"], &extra);
    kube.apply_dra_classes();
    kube.apply(&claim("restart-share", "gpu-share.tessera.io", json!({"memory": "4Gi", "sm": "20"}), ""));
    kube.apply(&pod(&kube, &t, "dra-restart", "echo DONE; sleep 3600", json!({}), uses("restart-share")));
    kube.done("dra-restart", &extra);
    let before = t.allocations();
    assert_eq!(before.len(), 1, "{before:?}");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kube.sh");
    for component in ["kubelet", "kube-apiserver"] {
        let out = Command::new(&script).args(["restart", component]).output().expect("kube.sh restart");
        assert!(out.status.success(), "restart {component}: {}", String::from_utf8_lossy(&out.stderr));
        kube.wait(&format!("the node Ready after the {component} restart"), &extra, || {
            let node = kube.get(&["node", kube.node()])?;
            let ready =
                node["status"]["conditions"].as_array()?.iter().any(|c| c["type"] == "Ready" && c["status"] == "True");
            ready.then_some(())
        });
        kube.wait(&format!("the pod running after the {component} restart"), &extra, || {
            let p = kube.get(&["pod", "dra-restart"])?;
            let running = p["status"]["containerStatuses"][0]["state"]["running"].is_object();
            (p["status"]["phase"] == "Running" && running).then_some(())
        });
        let now = t.allocations();
        assert_eq!(now.len(), 1, "one allocation still, the same: {now:?}");
        assert_eq!(now[0]["id"], before[0]["id"]);
    }
    kube.clean(&["dra-restart"], &["restart-share"], &extra);
    kube.wait("the claim unprepared after the restarts", &extra, || t.allocations().is_empty().then_some(()));
}

/// Holds the first open of a file in one directory whose name contains a given text, at the
/// moment the opener asks for it (fanotify's permission events: the opening thread waits in the
/// kernel for our answer), and lets every other open through at once. So a test stops tesserad at
/// an exact point of its work (the first write of a claim's CDI spec: after the allocation record,
/// before the kubelet's answer) with nothing added to tesserad. Needs root (CAP_SYS_ADMIN).
struct OpenGate {
    dir: PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    held: std::sync::mpsc::Receiver<HeldOpen>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// An open the gate holds: the opener's pid and the file's path. Dropping it lets the open go on
/// (a killed opener has nothing left to go on).
struct HeldOpen {
    fan: std::sync::Arc<OwnedFd>,
    /// The event's descriptor of the file being opened (ours to close).
    file: OwnedFd,
    pid: i32,
    path: PathBuf,
}

impl Drop for HeldOpen {
    fn drop(&mut self) {
        allow(&self.fan, &self.file);
    }
}

/// Answers a permission event: the open goes on.
fn allow(fan: &OwnedFd, file: &OwnedFd) {
    let response = libc::fanotify_response { fd: file.as_raw_fd(), response: libc::FAN_ALLOW };
    // SAFETY: writes the plain struct's bytes to the fanotify group's descriptor, which we own;
    // the struct lives on this stack frame for the call. An error (the opener already gone) is
    // nothing to answer.
    let _ = unsafe {
        libc::write(fan.as_raw_fd(), (&raw const response).cast(), std::mem::size_of::<libc::fanotify_response>())
    };
}

impl OpenGate {
    fn new(dir: &Path, needle: &str) -> OpenGate {
        use std::os::fd::FromRawFd;
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        // SAFETY: plain system calls on integers; the result is checked before it is owned.
        let raw =
            unsafe { libc::fanotify_init(libc::FAN_CLASS_CONTENT | libc::FAN_CLOEXEC, libc::O_RDONLY as libc::c_uint) };
        assert!(raw >= 0, "fanotify_init (root, CAP_SYS_ADMIN): {}", std::io::Error::last_os_error());
        // SAFETY: a new descriptor, owned by nothing else.
        let fan = unsafe { OwnedFd::from_raw_fd(raw) };
        let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).expect("a path");
        // SAFETY: the group's descriptor and a NUL-terminated path that outlives the call.
        let marked = unsafe {
            libc::fanotify_mark(
                fan.as_raw_fd(),
                libc::FAN_MARK_ADD,
                libc::FAN_OPEN_PERM | libc::FAN_EVENT_ON_CHILD,
                libc::AT_FDCWD,
                path.as_ptr(),
            )
        };
        assert_eq!(marked, 0, "fanotify_mark {}: {}", dir.display(), std::io::Error::last_os_error());
        let (fan, stop) = (Arc::new(fan), Arc::new(AtomicBool::new(false)));
        let (tx, held) = std::sync::mpsc::channel();
        let thread = {
            let (fan, stop, needle) = (Arc::clone(&fan), Arc::clone(&stop), needle.to_owned());
            std::thread::spawn(move || {
                let mut caught = false;
                let size = std::mem::size_of::<libc::fanotify_event_metadata>();
                let mut buf = vec![0u8; 64 * size];
                while !stop.load(Ordering::SeqCst) {
                    // SAFETY: reads into a buffer we own, at most its length.
                    let n = unsafe { libc::read(fan.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                    if n < 0 {
                        let e = std::io::Error::last_os_error();
                        assert_eq!(e.kind(), std::io::ErrorKind::Interrupted, "reading fanotify events: {e}");
                        continue;
                    }
                    let mut at = 0;
                    while at + size <= n as usize {
                        // SAFETY: the kernel wrote whole event records; this one starts at `at`
                        // and has `size` bytes (read unaligned: the buffer is bytes).
                        let event: libc::fanotify_event_metadata =
                            unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
                        at += (event.event_len as usize).max(size);
                        if event.fd < 0 {
                            continue;
                        }
                        // SAFETY: the kernel opened this descriptor for us; we own and close it.
                        let file = unsafe { OwnedFd::from_raw_fd(event.fd) };
                        let path =
                            std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap_or_default();
                        let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
                        if !caught && name.contains(&needle) {
                            caught = true;
                            let _ = tx.send(HeldOpen { fan: Arc::clone(&fan), file, pid: event.pid, path });
                            continue;
                        }
                        allow(&fan, &file);
                    }
                }
            })
        };
        OpenGate { dir: dir.to_owned(), stop, held, thread: Some(thread) }
    }

    /// The held open, once there is one.
    fn held(&self, kube: &Kube, what: &str, extra: &dyn Fn() -> String) -> HeldOpen {
        self.held
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("{what}: not within {WAIT:?}\n{}\n{}", extra(), kube.logs()))
    }
}

impl Drop for OpenGate {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // An open of our own wakes the reader, which lets it through and stops.
        let wake = self.dir.join(format!(".open-gate-wake-{}", std::process::id()));
        let _ = std::fs::File::create(&wake);
        let _ = std::fs::remove_file(&wake);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // The group closes with the last held open: any open still waiting then goes on.
    }
}

/// The claim's uid (it must exist).
fn claim_uid(kube: &Kube, name: &str) -> String {
    let c = kube.get(&["resourceclaim", name]).unwrap_or_else(|| panic!("claim {name}"));
    c["metadata"]["uid"].as_str().expect("the claim's uid").to_owned()
}

/// The per-claim CDI spec tesserad writes for claim `uid`.
fn claim_spec(kube: &Kube, uid: &str) -> PathBuf {
    Path::new(kube.var("KUBE_CDI_SPEC_DIR")).join(format!("tessera.io-claim_{uid}.json"))
}

/// What a pod's container prints of its claim before it waits.
const ALLOCATION_THEN_WAIT: &str = r#"
for f in /dev/nvidia*; do [ -c "$f" ] && echo "node $f"; done
echo "allocation $TESSERA_ALLOCATION"
cat /run/tessera/alloc/limits
echo DONE
sleep 3600
"#;

/// Asserts that nothing of a prepared claim is left: no allocation record, directory, region
/// mount, or CDI spec.
fn assert_nothing_left(t: &Tesserad, spec: &Path) {
    assert_eq!(t.allocations(), Vec::<Value>::new(), "no allocation record\n{}", t.log());
    assert_eq!(t.alloc_dirs(), Vec::<String>::new(), "no allocation directory");
    assert_eq!(t.alloc_mounts(), Vec::<String>::new(), "no region mount");
    assert!(!spec.exists(), "no CDI spec: {}", spec.display());
}

/// Faults: tesserad is killed (kill -9) inside the kubelet's NodePrepareResources, after the
/// claim's allocation is recorded (its directory and region made) and before the kubelet is
/// answered: held at the first open of the claim's CDI spec (fanotify), then killed. The state it
/// leaves is a record without a spec. A new tesserad on the same state writes the spec again; the
/// kubelet's retry gets the same allocation (never a second), the pod runs with its device, the
/// claim's `status.devices` names that allocation, and deleting pod and claim leaves nothing.
#[test]
fn tesserad_killed_between_the_record_and_the_kubelets_answer_prepares_the_claim_once() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let mut t = Tesserad::start(&kube, H100X2, &dra_config(&kube));
    let log = t.dir.path().join("tesserad.log");
    let extra = move || log_tail(&log);
    kube.clean(&["dra-kill"], &["kill-share"], &extra);
    kube.apply_dra_classes();
    kube.apply(&claim("kill-share", "gpu-share.tessera.io", json!({"memory": "4Gi", "sm": "20"}), ""));
    let uid = claim_uid(&kube, "kill-share");
    let spec = claim_spec(&kube, &uid);
    let gate = OpenGate::new(Path::new(kube.var("KUBE_CDI_SPEC_DIR")), &format!("claim_{uid}.json."));
    kube.apply(&pod(&kube, &t, "dra-kill", ALLOCATION_THEN_WAIT, json!({}), uses("kill-share")));

    let held = gate.held(&kube, "tesserad writing the claim's CDI spec", &extra);
    assert_eq!(held.pid, t.pid() as i32, "tesserad opens {}", held.path.display());
    // Inside the prepare: the record and its directory are made, the spec is not, no container runs.
    let recorded = t.alloc_dirs();
    assert_eq!(recorded.len(), 1, "one allocation recorded: {recorded:?}");
    assert!(!spec.exists(), "the spec is not written yet");
    let p = kube.get(&["pod", "dra-kill"]).expect("the pod");
    assert!(p["status"]["containerStatuses"][0]["state"]["running"].is_null(), "{p:#}");
    t.kill_9();
    drop(held);
    drop(gate);
    assert_eq!(t.alloc_dirs(), recorded, "the killed tesserad's allocation stays");
    assert!(!spec.exists(), "killed before the spec");

    t.respawn();
    let logs = kube.done("dra-kill", &extra);
    let id = &recorded[0];
    assert!(logs.contains(&format!("allocation {id}")), "the recorded allocation, not a new one:\n{logs}");
    let nodes: Vec<&str> = logs.lines().filter(|l| l.starts_with("node ")).collect();
    assert_eq!(nodes.len(), 2, "one GPU and the control node: {logs}");
    assert!(logs.contains("sm_percent = 20"), "{logs}");
    let allocs = t.allocations();
    assert_eq!(allocs.len(), 1, "allocated once: {allocs:?}");
    assert_eq!(allocs[0]["id"].as_str(), Some(id.as_str()));
    assert_eq!(t.alloc_dirs(), recorded);
    assert!(spec.exists(), "the spec written again");
    kube.wait("the claim's status.devices naming the allocation", &extra, || {
        let c = kube.get(&["resourceclaim", "kill-share"])?;
        (c["status"]["devices"].as_array()?.first()?["data"]["allocationID"].as_str()? == id).then_some(())
    });

    kube.clean(&["dra-kill"], &["kill-share"], &extra);
    kube.wait("the claim unprepared", &extra, || t.allocations().is_empty().then_some(()));
    assert_nothing_left(&t, &spec);
}

/// Faults: a claim deleted while its pod starts (tesserad held inside NodePrepareResources, at
/// the first open of the claim's CDI spec). The claim only gets a deletion timestamp (it is
/// reserved for the pod), the prepare completes, the pod runs with one allocation, and once the
/// pod is deleted the claim goes and tesserad releases everything. Then the same with the pod
/// deleted too: the kubelet unprepares what it was preparing, and nothing is left.
#[test]
fn a_claim_deleted_while_its_pod_starts_leaks_nothing() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let t = Tesserad::start(&kube, H100X2, &dra_config(&kube));
    let extra = || t.log();
    kube.clean(&["dra-gone", "dra-gone-both"], &["gone-share", "gone-both"], &extra);
    kube.apply_dra_classes();
    let cdi = Path::new(kube.var("KUBE_CDI_SPEC_DIR"));

    // The claim alone.
    kube.apply(&claim("gone-share", "gpu-share.tessera.io", json!({"memory": "4Gi", "sm": "20"}), ""));
    let uid = claim_uid(&kube, "gone-share");
    let spec = claim_spec(&kube, &uid);
    let gate = OpenGate::new(cdi, &format!("claim_{uid}.json."));
    kube.apply(&pod(&kube, &t, "dra-gone", ALLOCATION_THEN_WAIT, json!({}), uses("gone-share")));
    let held = gate.held(&kube, "tesserad preparing claim gone-share", &extra);
    kube.ok(&["delete", "resourceclaim", "gone-share", "--wait=false"], None);
    let c = kube.get(&["resourceclaim", "gone-share"]).expect("the claim stays while its pod holds it");
    assert!(c["metadata"]["deletionTimestamp"].is_string(), "{c:#}");
    drop(held);
    drop(gate);
    let logs = kube.done("dra-gone", &extra);
    let allocs = t.allocations();
    assert_eq!(allocs.len(), 1, "allocated once: {allocs:?}");
    let id = allocs[0]["id"].as_str().expect("id");
    assert!(logs.contains(&format!("allocation {id}")), "{logs}");
    kube.delete_pod("dra-gone", &extra);
    kube.wait("the deleted claim gone with its pod", &extra, || {
        kube.get(&["resourceclaim", "gone-share"]).is_none().then_some(())
    });
    kube.wait("the claim unprepared", &extra, || t.allocations().is_empty().then_some(()));
    assert_nothing_left(&t, &spec);

    // The claim and the pod.
    kube.apply(&claim("gone-both", "gpu-share.tessera.io", json!({"memory": "4Gi", "sm": "20"}), ""));
    let uid = claim_uid(&kube, "gone-both");
    let spec = claim_spec(&kube, &uid);
    let gate = OpenGate::new(cdi, &format!("claim_{uid}.json."));
    kube.apply(&pod(&kube, &t, "dra-gone-both", ALLOCATION_THEN_WAIT, json!({}), uses("gone-both")));
    let held = gate.held(&kube, "tesserad preparing claim gone-both", &extra);
    kube.ok(&["delete", "pod", "dra-gone-both", "--wait=false"], None);
    kube.ok(&["delete", "resourceclaim", "gone-both", "--wait=false"], None);
    drop(held);
    drop(gate);
    kube.wait("pod dra-gone-both gone", &extra, || kube.get(&["pod", "dra-gone-both"]).is_none().then_some(()));
    kube.wait("claim gone-both gone", &extra, || kube.get(&["resourceclaim", "gone-both"]).is_none().then_some(()));
    kube.wait("the claim unprepared", &extra, || t.allocations().is_empty().then_some(()));
    assert_nothing_left(&t, &spec);
}

/// `scripts/kube.sh restart COMPONENT` with `env` (KUBE_FEATURE_GATES).
fn restart(component: &str, env: &[(&str, &str)]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kube.sh");
    let out = Command::new(&script).args(["restart", component]).envs(env.iter().copied()).output().expect("kube.sh");
    assert!(out.status.success(), "restart {component} with {env:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Restarts kube-apiserver as `up` configured it when dropped (also when the test fails), so the
/// next test meets the usual cluster.
struct UsualApiServer;

impl Drop for UsualApiServer {
    fn drop(&mut self) {
        restart("kube-apiserver", &[]);
    }
}

/// The lines of tesserad's log at `log` that contain `text`.
fn log_lines(log: &Path, text: &str) -> Vec<String> {
    let all = std::fs::read_to_string(log).unwrap_or_default();
    all.lines().filter(|l| l.contains(text)).map(str::to_owned).collect()
}

/// Bad input on the real cluster: kube-apiserver with the DRAConsumableCapacity gate off drops
/// `allowMultipleAllocations` from the shared devices tesserad writes. tesserad says so in one
/// line naming the gate, takes the shared devices out of the slice and keeps the whole GPUs (a
/// whole-GPU claim still runs), and keeps running. (An API server without resource.k8s.io/v1 and
/// a kubelet too old for DRA are met against the test API server, `daemon/tests/dra_flow.rs`:
/// kube-apiserver 1.37 started with `--runtime-config resource.k8s.io/v1=false` never becomes
/// ready, its own informers needing the group.)
#[test]
fn a_dra_feature_gate_off_gets_one_line_and_the_whole_gpus() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let field = format!("spec.nodeName={},spec.driver=gpu.tessera.io", kube.node());
    kube.apply_dra_classes();
    let _usual = UsualApiServer;

    // DRAConsumableCapacity off (kube-apiserver only: the server is what drops the fields).
    restart("kube-apiserver", &[("KUBE_FEATURE_GATES", "DRAConsumableCapacity=false")]);
    // An earlier tesserad's slices go: a server keeps a gated field a stored object already uses.
    kube.ok(&["delete", "resourceslices", "--field-selector", &field], None);
    let mut t = Tesserad::start(&kube, H100X2, &dra_config(&kube));
    let log = t.dir.path().join("tesserad.log");
    let extra = || log_tail(&log);
    kube.clean(&["gate-whole"], &["gate-whole"], &extra);
    let devices = kube.wait("the slice without the shared devices", &extra, || {
        let slices = kube.get(&["resourceslices", "--field-selector", &field])?;
        let mut names: Vec<String> = slices["items"]
            .as_array()?
            .iter()
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .filter_map(|d| d["name"].as_str().map(str::to_owned))
            .collect();
        names.sort();
        (!names.is_empty() && names.iter().all(|n| !n.ends_with("-shared"))).then_some(names)
    });
    assert_eq!(devices, ["gpu-0", "gpu-1"]);
    let said = kube.wait("tesserad naming the gate", &extra, || {
        let l = log_lines(&log, "feature gate is off");
        (!l.is_empty()).then_some(l)
    });
    assert_eq!(said.len(), 1, "one line: {said:?}");
    assert!(said[0].contains("DRAConsumableCapacity") && said[0].contains("allowMultipleAllocations"), "{}", said[0]);
    kube.apply(&claim("gate-whole", "gpu.tessera.io", Value::Null, ""));
    kube.apply(&pod(&kube, &t, "gate-whole", ALLOCATION_THEN_WAIT, json!({}), uses("gate-whole")));
    kube.done("gate-whole", &extra);
    kube.clean(&["gate-whole"], &["gate-whole"], &extra);
    kube.wait("the whole GPU unprepared", &extra, || t.allocations().is_empty().then_some(()));
    assert!(t.daemon.0.try_wait().expect("tesserad").is_none(), "tesserad runs\n{}", t.log());
    assert_eq!(log_lines(&log, "feature gate is off").len(), 1, "still one line");

    drop(t);
}

/// Install as documented (docs/install.md), device-plugin overlay: the image built by
/// `scripts/build-image.sh` (the debug build, as the tests built it), imported into containerd
/// (`scripts/kube.sh import-image`), `kubectl apply -k deploy/kubernetes/overlays/device-plugin`,
/// the node labelled `tessera.io/gpu=true`. What a node with a real driver has is given by a
/// patch, as an operator's overlay would: the configuration (the simulated node's NVML, its device
/// nodes and driver root, this kubelet's pod-resources socket) and the volumes reaching them (a
/// scratch directory as the installer's host root, so this machine's own files are never touched).
/// The init container installs into that root; tesserad, in its pod, registers with the kubelet
/// (the Node's allocatable `tessera.io/gpu: 2`); a pod asking for a GPU runs with its device.
/// `kubectl delete -k` and `tessera uninstall --host-root` leave the root as it was.
#[test]
fn the_device_plugin_overlay_installs_and_serves_the_kubelet() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let overlay = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/overlays/device-plugin");
    let overlay = overlay.display().to_string();
    installed_daemon_serves_the_kubelet(
        &kube,
        Mode::DevicePlugin,
        &|| drop(kube.ok(&["apply", "-k", &overlay], None)),
        &|| drop(kube.ok(&["delete", "-k", &overlay, "--wait=true", "--timeout=240s"], None)),
    );
}

/// Install as documented, DRA mode: `kubectl apply -k deploy/kubernetes/overlays/dra` (the
/// DeviceClasses, the driver's RBAC, the service account's token mounted), the same operator's
/// patch with `mode = "dra"` and this kubelet's plugin directories. tesserad, in its pod, reaches
/// the API server through the `kubernetes` Service (in-cluster configuration: its token, CA and
/// KUBERNETES_SERVICE_HOST), publishes its ResourceSlice, registers its DRA plugin with the
/// kubelet; a pod with a whole-GPU claim runs with its device; after `kubectl delete -k` no
/// slice of the driver is left on the node (the kubelet wipes an unregistered driver's slices).
#[test]
fn the_dra_overlay_installs_and_serves_the_kubelet() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let overlay = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/overlays/dra");
    let overlay = overlay.display().to_string();
    // The classes other tests applied by hand are the overlay's own: it takes them over.
    installed_daemon_serves_the_kubelet(&kube, Mode::Dra, &|| drop(kube.ok(&["apply", "-k", &overlay], None)), &|| {
        drop(kube.ok(&["delete", "-k", &overlay, "--wait=true", "--timeout=240s"], None))
    });
}

/// Install as documented, the Helm chart in device-plugin mode (Helm v4, `scripts/deps.sh`
/// builds it into target/helm): `helm install tessera deploy/helm/tessera` with the image's tag,
/// then the same as [`the_device_plugin_overlay_installs_and_serves_the_kubelet`]; `helm
/// uninstall` and `tessera uninstall --host-root` leave the root with no file.
#[test]
fn the_helm_chart_installs_and_serves_the_kubelet() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    helm_chart_serves_the_kubelet(&kube, Mode::DevicePlugin);
}

/// The Helm chart with `--set mode=dra`: the same as [`the_dra_overlay_installs_and_serves_the_kubelet`]
/// (the chart's DeviceClasses, RBAC and token; `helm uninstall` leaves no slice and no file).
#[test]
fn the_helm_chart_in_dra_mode_installs_and_serves_the_kubelet() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    helm_chart_serves_the_kubelet(&kube, Mode::Dra);
}

/// How the installed DaemonSet serves the kubelet.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    DevicePlugin,
    Dra,
}

fn helm_chart_serves_the_kubelet(kube: &Kube, mode: Mode) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let helm = std::fs::read_dir(root.join("target/helm"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("helm"))
        .find(|p| p.exists())
        .expect("Helm v4 in target/helm/<version>/helm (scripts/deps.sh builds it)");
    let chart = root.join("deploy/helm/tessera").display().to_string();
    let run = |args: &[&str]| {
        let out = Command::new(&helm).args(args).env("KUBECONFIG", kube.var("KUBECONFIG")).output().expect("helm");
        assert!(
            out.status.success(),
            "helm {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let set_mode = if mode == Mode::Dra { "mode=dra" } else { "mode=device-plugin" };
    installed_daemon_serves_the_kubelet(
        kube,
        mode,
        &|| {
            if mode == Mode::Dra {
                // Helm owns the DeviceClasses it installs: the ones other tests applied by hand go.
                kube.ok(
                    &[
                        "delete",
                        "deviceclass",
                        "--ignore-not-found",
                        "gpu.tessera.io",
                        "gpu-share.tessera.io",
                        "mig.tessera.io",
                        "mig-dynamic.tessera.io",
                    ],
                    None,
                );
            }
            run(&[
                "install",
                "tessera",
                &chart,
                "--namespace",
                "tessera-system",
                "--create-namespace",
                "--set",
                "image.tag=0.1.0",
                "--set",
                set_mode,
            ])
        },
        &|| run(&["uninstall", "tessera", "--namespace", "tessera-system", "--wait"]),
    );
}

/// The DaemonSet `install` puts in tessera-system (the overlay's or the chart's), run on this
/// node with the image built and imported, serves the kubelet; `uninstall` and `tessera
/// uninstall --host-root` leave the installer's root with no file.
fn installed_daemon_serves_the_kubelet(kube: &Kube, mode: Mode, install: &dyn Fn(), uninstall: &dyn Fn()) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let image = "localhost/tessera:0.1.0";
    let build = Command::new(root.join("scripts/build-image.sh"))
        .args(["--profile", "debug", "--no-build", "--tag", image])
        .env("TESSERA_IMAGE_SHIM", tessera_tests::shim())
        .output()
        .expect("scripts/build-image.sh");
    assert!(build.status.success(), "build-image: {}", String::from_utf8_lossy(&build.stderr));
    let import = Command::new(root.join("scripts/kube.sh")).args(["import-image", image]).output().expect("kube.sh");
    assert!(import.status.success(), "import-image: {}", String::from_utf8_lossy(&import.stderr));

    let dir = tempfile::tempdir().expect("tempdir");
    tessera_tests::kubelet::unmount_at_exit(dir.path());
    let node = SimNode::with_description(H100X2);
    let injection = sim_host(kube, dir.path());
    let host = dir.path().join("host");
    std::fs::create_dir_all(&host).expect("host root");
    // tesserad's directories are mounted Bidirectional (the regions it mounts reach the host), as
    // the shipped runtime volume is: containerd needs a shared mount there.
    for args in [&["--bind", "."][..], &["--make-shared"][..]] {
        let st = Command::new("mount").args(args).arg(dir.path()).current_dir(dir.path()).status().expect("mount");
        assert!(st.success(), "mount {args:?} {}", dir.path().display());
    }
    // DRA: the node from NODE_NAME and the API server in-cluster (as shipped); only the kubelet's
    // plugin directories are this cluster's own.
    let kubernetes = match mode {
        Mode::DevicePlugin => "[kubernetes]\nmode = \"device-plugin\"\n[partitions.default]\nwhole = true\n".to_owned(),
        Mode::Dra => format!(
            "[kubernetes]\nmode = \"dra\"\nplugins_dir = {:?}\nplugins_registry_dir = {:?}\n",
            kube.var("KUBELET_PLUGINS_DIR"),
            kube.var("KUBELET_PLUGINS_REGISTRY_DIR"),
        ),
    };
    let config = format!(
        "device_plugin_dir = \"/var/lib/kubelet/device-plugins/\"\nstate_dir = {:?}\nruntime_dir = {:?}\n\
         nvml_library = {:?}\npod_resources_socket = {:?}\n[telemetry]\nmetrics_listen = \"0.0.0.0:9400\"\n\
         {kubernetes}{injection}",
        dir.path().join("state"),
        dir.path().join("run"),
        dir.path().join("driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
        kube.var("KUBELET_POD_RESOURCES_SOCKET"),
    );
    let log = dir.path().join("none");
    let extra = || log_tail(&log);
    install();
    let cm = json!({"data": {"config.toml": config}});
    kube.ok(
        &["patch", "configmap", "tessera-config", "-n", "tessera-system", "--type", "merge", "-p", &cm.to_string()],
        None,
    );
    let path = |p: &Path| p.display().to_string();
    let env: Vec<Value> = node
        .env()
        .into_iter()
        .filter(|(k, _)| k != "LD_LIBRARY_PATH")
        .map(|(k, v)| json!({"name": k, "value": v.to_string_lossy()}))
        .collect();
    let ds = json!({"spec": {"template": {"spec": {
    "containers": [{"name": "tesserad", "env": env, "volumeMounts": [
        {"name": "sim", "mountPath": path(&node.root)},
        {"name": "test-dir", "mountPath": path(dir.path()), "mountPropagation": "Bidirectional"},
            // This containerd's CDI directory, at its own path (the hook, on the host, reads it there).
            {"name": "cdi", "mountPath": kube.var("KUBE_CDI_SPEC_DIR")},
        {"name": "kubelet-pod-resources", "mountPath": Path::new(kube.var("KUBELET_POD_RESOURCES_SOCKET")).parent().map(path)},
            // This kubelet's plugin directories, at their own paths (the sockets tesserad registers are the kubelet's paths).
            {"name": "plugins", "mountPath": kube.var("KUBELET_PLUGINS_DIR")},
            {"name": "plugins-registry", "mountPath": kube.var("KUBELET_PLUGINS_REGISTRY_DIR")},
    ]}],
    "volumes": [
        {"name": "host-root", "hostPath": {"path": path(&host), "type": "Directory"}},
        {"name": "driver-root", "hostPath": {"path": path(&dir.path().join("driver")), "type": "Directory"}},
        {"name": "sim", "hostPath": {"path": path(&node.root), "type": "Directory"}},
        {"name": "test-dir", "hostPath": {"path": path(dir.path()), "type": "Directory"}},
        {"name": "kubelet-pod-resources", "hostPath": {"path": Path::new(kube.var("KUBELET_POD_RESOURCES_SOCKET")).parent().map(path), "type": "Directory"}},
        {"name": "cdi", "hostPath": {"path": kube.var("KUBE_CDI_SPEC_DIR"), "type": "DirectoryOrCreate"}},
        {"name": "plugins", "hostPath": {"path": kube.var("KUBELET_PLUGINS_DIR"), "type": "DirectoryOrCreate"}},
        {"name": "plugins-registry", "hostPath": {"path": kube.var("KUBELET_PLUGINS_REGISTRY_DIR"), "type": "DirectoryOrCreate"}},
    ]}}}});
    kube.ok(
        &["patch", "daemonset", "tesserad", "-n", "tessera-system", "--type", "strategic", "-p", &ds.to_string()],
        None,
    );
    kube.ok(&["label", "node", kube.node(), "tessera.io/gpu=true", "--overwrite"], None);

    let tesserad_logs = || {
        let out = kube
            .kubectl(&["logs", "-n", "tessera-system", "daemonset/tesserad", "--all-containers", "--tail", "40"], None);
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    let both = || format!("{}\n{}", extra(), tesserad_logs());
    kube.wait("the DaemonSet's pod ready", &both, || {
        let ds = kube.get(&["daemonset", "tesserad", "-n", "tessera-system"])?;
        (ds["status"]["numberReady"] == 1).then_some(())
    });
    assert!(host.join("var/lib/tessera/install.json").exists(), "the init container installed into the host root");
    kube.delete_pod("overlay-gpu", &both);
    let mut p = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "overlay-gpu", "namespace": "default"},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": kube.var("TEST_IMAGE"), "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", ALLOCATION_THEN_WAIT], "env": env,
                "volumeMounts": [{"name": "sim", "mountPath": path(&node.root)}],
                "resources": {"limits": {"tessera.io/gpu": "1"}}}],
            "volumes": [{"name": "sim", "hostPath": {"path": path(&node.root), "type": "Directory"}}]}});
    let field = format!("spec.nodeName={}", kube.node());
    let slice_devices = || -> Option<Vec<String>> {
        let slices = kube.get(&["resourceslices", "--field-selector", &field])?;
        let mut names: Vec<String> = slices["items"]
            .as_array()?
            .iter()
            .filter(|s| s["spec"]["driver"] == "gpu.tessera.io")
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .filter_map(|d| d["name"].as_str().map(str::to_owned))
            .collect();
        names.sort();
        Some(names)
    };
    match mode {
        Mode::DevicePlugin => kube.wait("allocatable tessera.io/gpu = 2", &both, || {
            (kube.node_object()["status"]["allocatable"]["tessera.io/gpu"] == "2").then_some(())
        }),
        Mode::Dra => {
            kube.ok(
                &["delete", "resourceclaim", "installed-gpu", "--ignore-not-found", "--wait=true", "--timeout=240s"],
                None,
            );
            // Published through the kubernetes Service from inside the pod.
            let devices = kube.wait("the installed tesserad's ResourceSlice", &both, || {
                slice_devices().filter(|d| d.iter().any(|n| n == "gpu-0") && d.iter().any(|n| n == "gpu-1"))
            });
            assert!(devices.iter().all(|d| d.starts_with("gpu-")), "{devices:?}");
            kube.apply(&claim("installed-gpu", "gpu.tessera.io", Value::Null, ""));
            let main = &mut p["spec"]["containers"][0];
            main["resources"] = json!({"claims": [{"name": "gpu"}]});
            p["spec"]["resourceClaims"] = uses("installed-gpu");
        }
    }
    kube.apply(&p);
    let logs = kube.done("overlay-gpu", &both);
    let nodes: Vec<&str> = logs.lines().filter(|l| l.starts_with("node ")).collect();
    assert_eq!(nodes.len(), 2, "one GPU and the control node:\n{logs}");
    kube.delete_pod("overlay-gpu", &both);
    if mode == Mode::Dra {
        kube.ok(&["delete", "resourceclaim", "installed-gpu", "--wait=true", "--timeout=240s"], None);
    }

    uninstall();
    if mode == Mode::Dra {
        // The kubelet deletes the slices of a driver whose plugin went away.
        kube.wait("no slice of gpu.tessera.io left on the node", &extra, || {
            slice_devices().filter(|d| d.is_empty()).map(drop)
        });
    }
    kube.ok(&["label", "node", kube.node(), "tessera.io/gpu-"], None);
    let out = tessera_tests::tessera(dir.path(), &["uninstall", "--host-root", &path(&host)]);
    assert!(out.status.success(), "uninstall: {}", String::from_utf8_lossy(&out.stderr));
    let left: Vec<String> = walk(&host);
    assert_eq!(left, Vec::<String>::new(), "the host root as it was");
}

/// The files (not directories) under `dir`, relative.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap_or(&p).display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// Item 2b, an existing MIG device through the real kube-scheduler: GPU 0 of the simulated H100s
/// in MIG mode with an operator's 1g.10gb instance (its compute instance inside); tesserad
/// publishes it as `gpu-0-mig-...` (class `mig.tessera.io`); the scheduler allocates a claim of
/// that class to it; the container gets GPU 0's node, the instance's `nvidia-caps` access nodes
/// (the driver's `mig-minors` numbering, under the simulated host's /dev) and sees the
/// instance's memory as the total, not the GPU's; deleting pod and claim unprepares it.
#[test]
fn a_mig_device_is_allocated_by_the_real_scheduler() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let mut caps = Vec::new();
    let t = Tesserad::start_prepared(&kube, H100X2, &dra_config(&kube), |node, dir| {
        let sim = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
        sim.set_mig_mode(0, true).expect("MIG on");
        sim.reset(0).expect("reset GPU 0");
        let gi = sim.create_gpu_instance(0, 0, Some(0)).expect("the operator's 1g.10gb");
        let ci = sim.create_compute_instance(0, gi.id, 0, None).expect("its compute instance");
        // The driver's proc tree (mig-minors) in the driver root tesserad reads, and the access
        // nodes the driver would make for this instance.
        sim.register_driver_root(&dir.join("driver")).expect("the driver root's proc tree");
        for minor in [
            tessera_sim_model::driver_root::mig_minor(0, gi.id, None),
            tessera_sim_model::driver_root::mig_minor(0, gi.id, Some(ci.id)),
        ] {
            let name = format!("nvidia-cap{minor}");
            tessera_tests::mknod(&dir.join("dev/nvidia-caps").join(&name), 511, minor);
            caps.push(name);
        }
    });
    let extra = || t.log();
    kube.clean(&["dra-mig"], &["mig"], &extra);
    kube.apply_dra_classes();

    kube.apply(&claim("mig", "mig.tessera.io", Value::Null, ""));
    let script = format!("ls /dev/nvidia-caps | sed 's/^/cap /'\n{TOTAL_ONLY}");
    kube.apply(&pod(&kube, &t, "dra-mig", &script, json!({}), uses("mig")));
    let logs = kube.done("dra-mig", &extra);
    let c = kube.get(&["resourceclaim", "mig"]).expect("the claim");
    let device = c["status"]["allocation"]["devices"]["results"][0]["device"].as_str().unwrap_or_default().to_owned();
    assert!(device.starts_with("gpu-0-mig-"), "{c:#}");
    let nodes: Vec<&str> = logs.lines().filter(|l| l.starts_with("node ")).collect();
    assert_eq!(nodes, ["node /dev/nvidia0", "node /dev/nvidiactl"], "{logs}");
    let mut seen: Vec<String> = logs.lines().filter_map(|l| l.strip_prefix("cap ")).map(str::to_owned).collect();
    seen.sort();
    caps.sort();
    assert_eq!(seen, caps, "the instance's access nodes: {logs}");
    let (total, status) = section(&logs, "TOTAL");
    let mem = total["mem_total"].as_u64().unwrap_or(0);
    assert_eq!(status, "0", "{logs}");
    assert!(mem > 0 && mem < 20_000 * MIB, "the 1g.10gb instance's memory, not the GPU's: {logs}");
    kube.delete_pod("dra-mig", &extra);
    kube.ok(&["delete", "resourceclaim", "mig", "--wait=true", "--timeout=240s"], None);
    kube.wait("the MIG device unprepared", &extra, || t.allocations().is_empty().then_some(()));
    drop(t);
}

/// Item 2b, a dynamic MIG profile (partitionable devices) through the real kube-scheduler: GPU 0
/// in MIG mode with no instance; tesserad publishes its placements against GPU 0's counters; a
/// `mig-dynamic.tessera.io` claim for a 3g.40gb is allocated a placement, tesserad makes the
/// instance at prepare (the container sees its memory as the total and gets its access nodes),
/// and destroys it at unprepare.
#[test]
fn a_dynamic_mig_profile_is_made_at_prepare_and_destroyed_at_unprepare() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let t = Tesserad::start_prepared(&kube, H100X2, &dra_config(&kube), |node, dir| {
        let sim = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
        sim.set_mig_mode(0, true).expect("MIG on");
        sim.reset(0).expect("reset GPU 0");
        sim.register_driver_root(&dir.join("driver")).expect("the driver root's proc tree");
        // Every access node the driver could make on GPU 0 (the instance's ids come at prepare).
        for gi in 0..15 {
            let mut minors = vec![tessera_sim_model::driver_root::mig_minor(0, gi, None)];
            minors.extend((0..8).map(|ci| tessera_sim_model::driver_root::mig_minor(0, gi, Some(ci))));
            for minor in minors {
                tessera_tests::mknod(&dir.join(format!("dev/nvidia-caps/nvidia-cap{minor}")), 511, minor);
            }
        }
    });
    let extra = || t.log();
    let sim = tessera_sim_model::Node::open(t.node.description.as_deref(), Some(&t.node.state)).expect("sim node");
    kube.clean(&["dra-mig-dynamic"], &["mig-dynamic"], &extra);
    kube.apply_dra_classes();

    let profile = r#"device.attributes["gpu.tessera.io"].migProfile == "3g.40gb""#;
    kube.apply(&claim("mig-dynamic", "mig-dynamic.tessera.io", Value::Null, profile));
    let script = format!("ls /dev/nvidia-caps | sed 's/^/cap /'\n{TOTAL_ONLY}");
    kube.apply(&pod(&kube, &t, "dra-mig-dynamic", &script, json!({}), uses("mig-dynamic")));
    let logs = kube.done("dra-mig-dynamic", &extra);
    let c = kube.get(&["resourceclaim", "mig-dynamic"]).expect("the claim");
    let device = c["status"]["allocation"]["devices"]["results"][0]["device"].as_str().unwrap_or_default().to_owned();
    assert!(device.starts_with("gpu-0-mig-3g40gb-"), "{c:#}");
    let made = sim.gpu_instances(0).expect("GPU instances");
    assert_eq!(made.len(), 1, "one instance made at prepare");
    assert_eq!(made[0].profile.name.to_string(), "3g.40gb");
    let caps = logs.lines().filter(|l| l.starts_with("cap ")).count();
    assert_eq!(caps, 2, "the made instance's access nodes only: {logs}");
    let (total, status) = section(&logs, "TOTAL");
    let mem = total["mem_total"].as_u64().unwrap_or(0);
    assert_eq!(status, "0", "{logs}");
    assert!(mem > 30_000 * MIB && mem < 60_000 * MIB, "the 3g.40gb instance's memory, not the GPU's: {logs}");
    kube.delete_pod("dra-mig-dynamic", &extra);
    kube.ok(&["delete", "resourceclaim", "mig-dynamic", "--wait=true", "--timeout=240s"], None);
    kube.wait("the MIG instance destroyed at unprepare", &extra, || {
        (t.allocations().is_empty() && sim.gpu_instances(0).ok()?.is_empty()).then_some(())
    });
    drop(t);
}

/// Two shares in one claim, one of each GPU. From 1.35 a request for two shared devices gets
/// them. kube-scheduler 1.34 crashes on that request (it checks a request's capacity against
/// the slice's device at the request's own device index, past the one device of the 1.34 layout's
/// shared slices; seen here: "index out of range [1] with length 1" in
/// `CmpRequestOverCapacity`), so on 1.34 the guard of `deploy/kubernetes/overlays/dra-k8s-1.34`
/// refuses it when it is made, naming the way that works: a request per share. Either way the
/// container sees both GPUs, each limited to its share.
#[test]
fn two_shares_in_one_claim_run_and_1_34_refuses_what_crashes_its_scheduler() {
    let Some(kube) = Kube::find() else { return };
    let _serial = serial();
    let t = Tesserad::start(&kube, H100X2, &dra_config(&kube));
    let extra = || t.log();
    let (pods, claims) = (["dra-two-shares"], ["two-shares"]);
    kube.clean(&pods, &claims, &extra);
    kube.apply_dra_classes();
    let field = format!("spec.nodeName={}", kube.node());
    kube.wait("tesserad's ResourceSlices", &extra, || {
        let slices = kube.get(&["resourceslices", "--field-selector", &field])?;
        let devices: usize = slices["items"]
            .as_array()?
            .iter()
            .filter(|s| s["spec"]["driver"] == "gpu.tessera.io")
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum();
        (devices == 4).then_some(())
    });

    let mut two = claim("two-shares", "gpu-share.tessera.io", json!({"memory": "8Gi", "sm": "30"}), "");
    let one = two["spec"]["devices"]["requests"][0]["exactly"].clone();
    two["spec"]["devices"]["requests"][0]["exactly"]["count"] = json!(2);
    let guard = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/kubernetes/overlays/dra-k8s-1.34/share-count-guard.yaml")
        .display()
        .to_string();
    let v1_34 = kube.var("KUBE_VERSION").starts_with("v1.34.");
    if v1_34 {
        kube.ok(&["apply", "-f", &guard], None);
        // The policy is enforced once the API server has loaded it.
        let refused = kube.wait("the guard refusing two shares in one request", &extra, || {
            let out = kube.kubectl(&["create", "--dry-run=server", "-f", "-"], Some(&two.to_string()));
            let said = String::from_utf8_lossy(&out.stderr).into_owned();
            (!out.status.success()).then_some(said)
        });
        assert!(
            refused.contains("crashes kube-scheduler 1.34") && refused.contains("one share per request"),
            "{refused}"
        );
        let mut all = two.clone();
        all["spec"]["devices"]["requests"][0]["exactly"]["allocationMode"] = json!("All");
        all["spec"]["devices"]["requests"][0]["exactly"].as_object_mut().expect("exactly").remove("count");
        let out = kube.kubectl(&["create", "--dry-run=server", "-f", "-"], Some(&all.to_string()));
        assert!(!out.status.success(), "allocationMode All: {}", String::from_utf8_lossy(&out.stdout));
        // What works on 1.34: a request per share (each naming its GPU: two requests may also be
        // given two shares of one GPU, which the container then holds as one of their sum).
        let on = |index: u32| {
            let mut exactly = one.clone();
            exactly["selectors"] =
                json!([{"cel": {"expression": format!(r#"device.attributes["gpu.tessera.io"].index == {index}"#)}}]);
            exactly
        };
        two["spec"]["devices"]["requests"] =
            json!([{"name": "gpu", "exactly": on(0)}, {"name": "gpu-b", "exactly": on(1)}]);
    }
    kube.apply(&two);
    kube.apply(&pod(&kube, &t, "dra-two-shares", TOTAL_ONLY, json!({}), uses("two-shares")));
    let logs = kube.done("dra-two-shares", &extra);
    let nodes: Vec<&str> = logs.lines().filter(|l| l.starts_with("node ")).collect();
    assert_eq!(nodes, ["node /dev/nvidia0", "node /dev/nvidia1", "node /dev/nvidiactl"], "{logs}");
    assert_eq!(logs.matches("memory_limit = 8589934592").count(), 2, "both shares' limits: {logs}");
    let (total, _) = section(&logs, "TOTAL");
    assert_eq!(total["mem_total"].as_u64(), Some(8 << 30), "its share of GPU 0 as the total: {logs}");
    let c = kube.get(&["resourceclaim", "two-shares"]).expect("the claim");
    let mut devices: Vec<&str> = c["status"]["allocation"]["devices"]["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| {
            assert_eq!(r["consumedCapacity"], json!({"memory": "8Gi", "sm": "30"}), "{c:#}");
            r["device"].as_str().expect("device")
        })
        .collect();
    devices.sort();
    assert_eq!(devices, ["gpu-0-shared", "gpu-1-shared"], "{c:#}");

    kube.clean(&pods, &claims, &extra);
    kube.wait("the claim unprepared", &extra, || t.allocations().is_empty().then_some(()));
    if v1_34 {
        kube.ok(&["delete", "-f", &guard], None);
    }
}
