//! The whole path into a container: the kubelet allocates a share from tesserad (simulated node);
//! tesserad wrote the CDI specs (fake device nodes and driver root, as a host has them) and the
//! allocation's directory; a runc container started through `tessera-runtime` with the env the
//! kubelet's answer carries sees exactly its GPU's node and the control nodes, the driver's
//! library, libtessera.so in /etc/ld.so.preload, and its share's limits file, read-only; the
//! wrapper's owner record then names the allocation's container and pod in the node API.

use std::path::Path;
use std::time::Duration;

use tessera_proto::deviceplugin::v1beta1::Empty;
use tessera_sim_testkit::{SimNode, binary};
use tessera_tests::kubelet::{TestKubelet, allocate, next_list, spawn};
use tessera_tests::{RuncTest, run_bundle, runc_bundle, runc_test};

const PROBE: &str = r#"
for f in /dev/nvidia*; do [ -c "$f" ] && echo "node $f $(stat -c '%t:%T' $f)"; done
echo "lib $(cat /usr/lib/x86_64-linux-gnu/libcuda.so.1)"
echo "preload $(cat /etc/ld.so.preload)"
echo "limits-writable $( (echo x >> /run/tessera/alloc/limits) 2>/dev/null && echo yes || echo no)"
cat /run/tessera/alloc/limits
echo "ledger-readable $(test -r /run/tessera/alloc/ledger && head -c 8 /run/tessera/alloc/ledger)"
echo "ledger-writable $( (printf xxxxxxxx | dd of=/run/tessera/alloc/ledger bs=8 count=1 conv=notrunc) 2>/dev/null && echo yes || echo no)"
echo "dir-writable $( (touch /run/tessera/alloc/evil) 2>/dev/null && echo yes || echo no)"
echo "limits-replaceable $( (mv /run/tessera/alloc/region /run/tessera/alloc/limits) 2>/dev/null && echo yes || echo no)"
echo "region-removable $( (rm /run/tessera/alloc/region) 2>/dev/null && echo yes || echo no)"
echo "region-grows $( (dd if=/dev/zero of=/run/tessera/alloc/region bs=1048576 count=64 seek=2 conv=notrunc) 2>/dev/null && echo yes || echo no)"
: > /run/tessera/alloc/region && echo "region-truncated"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_share_reaches_a_runc_container() {
    // The host as the daemon and the runtime see it: device nodes and the driver's files.
    let devices = [("nvidia0", 195, 0), ("nvidia1", 195, 1), ("nvidiactl", 195, 255), ("nvidia-uvm", 235, 0)];
    let Some(RuncTest { tmp, rootfs, host }) = runc_test(&devices) else { return };
    let dir = tmp.path();

    let node = SimNode::with_description(tessera_tests::ONE_H100);
    let config = tessera_tests::kubelet::write_config(
        &node,
        dir,
        &format!("{}[partitions.default]\nshares = {{ count = 2 }}", host.injection_config()),
    );
    let log = dir.join("tesserad.log");
    let mut kubelet = TestKubelet::start(&dir.join("plugins"));
    let (_daemon, _) = spawn(&node, &config, &dir.join("no-notify"), &log);
    let (reg, _) = kubelet.next_registration().await;
    let mut plugin = kubelet.connect(&reg).await;
    let mut list = plugin.list_and_watch(Empty {}).await.expect("list").into_inner();
    let share = next_list(&mut list).await.devices[1].id.clone();
    let answer = allocate(&mut plugin, &[&share]).await;
    assert_eq!(answer.cdi_devices[0].name, format!("tessera.io/share={share}"));

    // The spec the daemon wrote names the share the kubelet handed out.
    let spec_path = dir.join("cdi/tessera.io-share.json");
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_path).unwrap_or_else(|e| panic!("{}: {e}", spec_path.display())))
            .expect("spec json");
    assert_eq!(spec["kind"], "tessera.io/share");
    let names: Vec<&str> =
        spec["devices"].as_array().expect("devices").iter().filter_map(|d| d["name"].as_str()).collect();
    assert!(names.contains(&share.as_str()), "{names:?}");

    // The daemon maps the new allocation's region (usage), as it would for metrics.
    let mut api = tessera_tests::kubelet::node_api(&dir.join("run/tessera.sock")).await;
    api.get_usage(tessera_proto::tessera::v1::GetUsageRequest::default()).await.expect("usage");

    // The runtime wrapper in front of runc, with the env the kubelet's answer carries.
    let hook_config = host.write_hook_config();
    let bundle = dir.join("bundle");
    let env: Vec<String> = ["TESSERA_VISIBLE_DEVICES", "TESSERA_ALLOCATION"]
        .iter()
        .map(|key| format!("{key}={}", answer.envs[*key]))
        .collect();
    // As containerd's CRI plugin annotates a pod's container.
    let annotations = serde_json::json!({
        "io.kubernetes.cri.sandbox-namespace": "team-a",
        "io.kubernetes.cri.sandbox-name": "trainer",
        "io.kubernetes.cri.container-name": "main",
    });
    runc_bundle(&bundle, &rootfs, PROBE, &env, annotations);
    let container_id = format!("flow-{}", std::process::id());
    let mut wrapper = tokio::process::Command::new(binary("tessera-runtime"));
    wrapper.env("TESSERA_HOOK_CONFIG", &hook_config);
    let (status, text) =
        run_bundle(wrapper, &dir.join("runc-state"), &bundle, &container_id, Duration::from_secs(60)).await;
    assert!(status.success(), "{text}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    let nodes: Vec<&str> = text.lines().filter(|l| l.starts_with("node ")).collect();
    assert_eq!(nodes, ["node /dev/nvidia-uvm eb:0", "node /dev/nvidia0 c3:0", "node /dev/nvidiactl c3:ff"], "{text}");
    assert!(text.contains("lib fake-libcuda"), "{text}");
    assert!(text.contains("preload /usr/lib/tessera/libtessera.so"), "{text}");
    assert!(text.contains("limits-writable no"), "{text}");
    // A hostile container: it cannot add files, replace or remove its region, or grow it past
    // the region's own tmpfs (a few MiB at most, never the host's /run). Truncating it is
    // possible, and harms only itself: the daemon survives (below).
    // Nor can it write the daemon's ledger, which tells it of its neighbours (a tenant that could
    // would claim high priority, or speak for another).
    for line in [
        "dir-writable no",
        "limits-replaceable no",
        "region-removable no",
        "region-grows no",
        "region-truncated",
        "ledger-readable TSLEDGR2",
        "ledger-writable no",
    ] {
        assert!(text.contains(line), "{line}:\n{text}");
    }
    let host_limits = std::fs::read_to_string(Path::new(&answer.mounts[0].host_path).join("limits")).expect("limits");
    assert!(text.contains(host_limits.trim()), "the container reads its share's limits:\n{text}\nhost:\n{host_limits}");

    // The wrapper's owner record names the allocation's container in the daemon's reports.
    let id = answer.envs["TESSERA_ALLOCATION"].clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let list = api
            .list_allocations(tessera_proto::tessera::v1::ListAllocationsRequest::default())
            .await
            .expect("allocations")
            .into_inner();
        let c = list.allocations.iter().find(|a| a.id == id).and_then(|a| a.container.clone()).unwrap_or_default();
        if c.container_id == container_id {
            assert_eq!(
                (c.pod_namespace.as_str(), c.pod_name.as_str(), c.container_name.as_str()),
                ("team-a", "trainer", "main")
            );
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the allocation was not named: {c:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The container truncated its region under the daemon's mapping: the daemon reads it
    // without dying (no SIGBUS), leaves its usage out and says why.
    api.get_usage(tessera_proto::tessera::v1::GetUsageRequest::default()).await.expect("usage after truncation");
    api.list_allocations(tessera_proto::tessera::v1::ListAllocationsRequest::default()).await.expect("still serving");
    let daemon_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(daemon_log.contains("truncated or overwritten"), "{daemon_log}");
}
