//! `/metrics` on a MIG node, against the built `tesserad` and the simulated node: each MIG device
//! has dcgm-exporter series of its own with `GPU_I_PROFILE` and `GPU_I_ID` (the node API's ids),
//! a whole GPU has neither; `DCGM_FI_DEV_XID_ERRORS` is per GPU, 0 until an XID, then the last
//! one, also when the XID names a MIG instance.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Instant;

use tessera_proto::tessera::v1 as api;
use tessera_sim_testkit::{SimNode, binary, mig_and_whole};

mod common;

use common::{WAIT, spawn};

/// The samples of `name`: labels and value (a plain reading of the text format: our label values
/// here hold no escapes).
fn samples(body: &str, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    body.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .map(|rest| {
            let (labels, value) = rest.rsplit_once("} ").expect("labels then value");
            let labels = labels
                .split("\",")
                .map(|kv| {
                    let (k, v) = kv.split_once("=\"").expect("k=\"v\"");
                    (k.to_string(), v.trim_end_matches('"').to_string())
                })
                .collect();
            (labels, value.parse().expect("a number"))
        })
        .collect()
}

fn scrape(addr: SocketAddr) -> String {
    let (code, body) = common::prometheus::get(addr, "/metrics").expect("/metrics answers");
    assert_eq!(code, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_devices_have_instance_series_and_xids_show_per_gpu() {
    let node = SimNode::with_description(&mig_and_whole("H100-SXM5-80GB"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let (metrics, config) = common::write_config_with_metrics(
        &node,
        tmp.path(),
        "[partitions.\"0\"]\nmig = { \"3g.40gb\" = 2 }\n[partitions.\"1\"]\nwhole = true\n",
    );
    let log = tmp.path().join("tesserad.log");
    let (_daemon, _) = spawn(&node, &config, &tmp.path().join("notify.sock"), &log);
    let mut api = common::node_api(&tmp.path().join("run/tessera.sock")).await;
    let devices = api.list_devices(api::ListDevicesRequest::default()).await.expect("devices").into_inner().devices;
    let migs: BTreeMap<String, (String, String)> = devices
        .iter()
        .filter(|d| d.kind == api::DeviceKind::Mig as i32)
        .map(|d| {
            let m = d.mig.as_ref().expect("a MIG device's instance");
            (d.uuid.clone(), (m.profile.clone(), m.gpu_instance_id.to_string()))
        })
        .collect();
    assert_eq!(migs.len(), 2, "{devices:?}");
    let gpu = |i: u32| devices.iter().find(|d| d.kind == api::DeviceKind::Gpu as i32 && d.index == i).expect("GPU");
    let (gpu0, gpu1) = (gpu(0).uuid.clone(), gpu(1).uuid.clone());

    let body = scrape(metrics);
    let free = samples(&body, "DCGM_FI_DEV_FB_FREE");
    let shown: BTreeMap<String, (String, String)> = free
        .iter()
        .filter(|(l, _)| l["UUID"].starts_with("MIG-"))
        .map(|(l, _)| (l["UUID"].clone(), (l["GPU_I_PROFILE"].clone(), l["GPU_I_ID"].clone())))
        .collect();
    assert_eq!(shown, migs, "one series per MIG device, with the node API's profile and instance id\n{body}");
    let ids: BTreeSet<&String> = shown.values().map(|(_, id)| id).collect();
    assert_eq!(ids.len(), 2, "two instances, two ids");
    for (l, v) in &free {
        if l["UUID"].starts_with("MIG-") {
            assert_eq!(l["gpu"], "0", "{l:?}");
            assert!(*v > 30_000.0 && *v <= 40_960.0, "a 3g.40gb instance's free MiB: {v}");
        } else {
            assert!(!l.contains_key("GPU_I_ID") && !l.contains_key("GPU_I_PROFILE"), "a whole GPU: {l:?}");
        }
    }

    // XIDs: per GPU, 0 until one is seen.
    let xids = |body: &str| -> BTreeMap<String, f64> {
        samples(body, "DCGM_FI_DEV_XID_ERRORS").into_iter().map(|(l, v)| (l["UUID"].clone(), v)).collect()
    };
    assert_eq!(xids(&body), BTreeMap::from([(gpu0.clone(), 0.0), (gpu1.clone(), 0.0)]), "{body}");
    // An application XID naming a MIG instance: shown on its GPU (dcgm's XID field is per GPU).
    let (gi, ci) = (shown.values().next().expect("an instance").1.clone(), "0".to_string());
    let inject = node
        .command(binary("tessera-sim"))
        .args(["inject", "xid", "--gpu", "0", "--xid", "43", "--gi", &gi, "--ci", &ci])
        .output()
        .expect("tessera-sim inject xid");
    assert!(inject.status.success(), "{}", String::from_utf8_lossy(&inject.stderr));
    let want = BTreeMap::from([(gpu0, 43.0), (gpu1, 0.0)]);
    let deadline = Instant::now() + WAIT;
    loop {
        let body = scrape(metrics);
        if xids(&body) == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "wanted {want:?}\n{body}\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
