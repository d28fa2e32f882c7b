//! The kubelet's own record of what it was granted (its device manager's checkpoint,
//! `<device_plugin_dir>/kubelet_internal_checkpoint`), and the kubelet allocations rebuilt from
//! it at start when the journal lost them.
//!
//! Why: a kubelet `Allocate`'s record is flushed a moment after the answer leaves
//! ([`crate::state::journal_flush`]). The kubelet writes the answer into its checkpoint (and
//! fsyncs it) as soon as it arrives, and starts the container from that copy ever after, a reboot
//! included, without asking again. A power cut between the two flushes would leave the kubelet
//! holding an answer whose allocation tesserad no longer knows: no directory, no limits, and the
//! container could not start. Here such an answer is found (by the `TESSERA_ALLOCATION` it
//! carries) and its record made again, with the same id, from the devices the kubelet names.
//!
//! The checkpoint is the kubelet's (root's, 0600) and its format internal to the kubelet: it is
//! only read, never changed; anything in it that does not parse, is not one of ours, or names a
//! device not offered now is passed over (and said), never trusted into a record.
//!
//! The file (kubelet 1.20 and later; JSON, Go's encoding: `[]byte` as base64):
//!
//! ```text
//! {"Data": {"PodDeviceEntries": [{"PodUID": "…", "ContainerName": "…", "ResourceName": "…",
//!   "DeviceIDs": {"<numa node or -1>": ["<device id>", …]}, "AllocResp": "<base64 protobuf
//!   ContainerAllocateResponse>"}], "RegisteredDevices": {…}}, "Checksum": 123}
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use base64::Engine as _;
use prost::Message as _;
use serde::Deserialize;
use tessera_proto::deviceplugin::v1beta1::ContainerAllocateResponse;

use super::DaemonAllocator;
use super::kubelet::ALLOCATION_ENV;
use crate::state::{Allocation, ContainerIdentity, Source, record::unix_ns};

/// The checkpoint's name in the kubelet's device plugin directory.
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

/// One container's devices of one resource, as the kubelet keeps them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletGrant {
    /// The pod's UID and the container's name, as the kubelet keeps them.
    pub container: ContainerIdentity,
    pub resource: String,
    /// Every NUMA node's ids together, in the kubelet's order.
    pub device_ids: Vec<String>,
    /// The `TESSERA_ALLOCATION` of the answer the kubelet keeps: `None` where the answer is not
    /// one of tesserad's (another plugin's resource, or an answer that does not decode).
    pub allocation: Option<String>,
}

#[derive(Deserialize)]
struct File {
    #[serde(rename = "Data")]
    data: Data,
}

#[derive(Deserialize)]
struct Data {
    #[serde(rename = "PodDeviceEntries", default)]
    entries: Option<Vec<Entry>>,
}

#[derive(Deserialize)]
struct Entry {
    #[serde(rename = "PodUID", default)]
    pod_uid: String,
    #[serde(rename = "ContainerName", default)]
    container_name: String,
    #[serde(rename = "ResourceName", default)]
    resource: String,
    /// NUMA node → ids (`null` when the kubelet had none).
    #[serde(rename = "DeviceIDs", default)]
    device_ids: Option<BTreeMap<String, Option<Vec<String>>>>,
    #[serde(rename = "AllocResp", default)]
    alloc_resp: Option<String>,
}

/// Reads the kubelet's checkpoint in `device_plugin_dir`: `Ok(None)` when there is none (no
/// kubelet has run here, or it kept nothing), `Err` naming the file and what is wrong with it.
pub fn read(device_plugin_dir: &Path) -> Result<Option<Vec<KubeletGrant>>, String> {
    let path = device_plugin_dir.join(CHECKPOINT_FILE);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read the kubelet's checkpoint {}: {e}", path.display())),
    };
    parse(&text).map(Some).map_err(|e| format!("the kubelet's checkpoint {} does not parse: {e}", path.display()))
}

/// The grants in a checkpoint's bytes.
pub fn parse(text: &[u8]) -> Result<Vec<KubeletGrant>, String> {
    let file: File = serde_json::from_slice(text).map_err(|e| e.to_string())?;
    Ok(file
        .data
        .entries
        .unwrap_or_default()
        .into_iter()
        .map(|e| {
            // By NUMA node in numeric order, as the kubelet lists them ("-1" for none first).
            let mut numa: Vec<(i64, Vec<String>)> = e
                .device_ids
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k.parse().unwrap_or(i64::MAX), v.unwrap_or_default()))
                .collect();
            numa.sort_by_key(|(k, _)| *k);
            KubeletGrant {
                container: ContainerIdentity {
                    pod_uid: Some(e.pod_uid).filter(|s| !s.is_empty()),
                    container_name: Some(e.container_name).filter(|s| !s.is_empty()),
                    ..ContainerIdentity::default()
                },
                resource: e.resource,
                device_ids: numa.into_iter().flat_map(|(_, ids)| ids).collect(),
                allocation: e.alloc_resp.as_deref().and_then(allocation_of),
            }
        })
        .collect())
}

/// The `TESSERA_ALLOCATION` of a kept answer (base64 of its protobuf encoding).
fn allocation_of(resp: &str) -> Option<String> {
    let bytes = base64::engine::general_purpose::STANDARD.decode(resp).ok()?;
    let resp = ContainerAllocateResponse::decode(bytes.as_slice()).ok()?;
    resp.envs.get(ALLOCATION_ENV).cloned()
}

impl DaemonAllocator {
    /// Makes again every kubelet allocation in `grants` that the records lost: the grant's
    /// answer names an allocation id the store does not hold, its resource and devices are
    /// offered now, and no kubelet record holds any of its devices (a record in the journal is
    /// newer than any answer it superseded). Each is recorded durably, with its directory, and
    /// said. Returns the ids made again.
    ///
    /// Call once the offer is published (the devices' limits come from it) and before the device
    /// plugins serve.
    pub fn recover_kubelet_grants(&self, grants: &[KubeletGrant]) -> Vec<String> {
        let offer = self.offer();
        let mut store = crate::state::Store::lock_telling_after(&self.store);
        let mut made = Vec::new();
        for g in grants {
            let Some(id) = &g.allocation else { continue };
            if store.get(id).is_some() {
                continue;
            }
            let say = |why: &str| {
                tracing::warn!(
                    id = %id, resource = %g.resource, pod_uid = ?g.container.pod_uid,
                    "the kubelet's checkpoint keeps allocation {id}, which the records lost, but it is not made \
                     again: {why}"
                )
            };
            if let Err(why) = crate::state::record::valid_id(id) {
                say(&format!("its id is not one tesserad makes ({why})"));
                continue;
            }
            let Some(res) = offer.resources.get(&g.resource) else {
                say("its resource is not served now");
                continue;
            };
            let devices = match self.devices(&offer, res, &g.device_ids) {
                Ok(d) if !d.is_empty() => d,
                Ok(_) => {
                    say("it names no device");
                    continue;
                }
                Err(e) => {
                    say(e.message());
                    continue;
                }
            };
            let wanted: BTreeSet<&str> = g.device_ids.iter().map(String::as_str).collect();
            if store.holding(wanted.iter().copied()).any(|a| a.source == Source::Kubelet) {
                say("a kubelet allocation the records hold has some of its devices (made after it)");
                continue;
            }
            let alloc = Allocation {
                id: id.clone(),
                resource: g.resource.clone(),
                container: g.container.clone(),
                source: Source::Kubelet,
                created_unix_ns: unix_ns(),
                devices,
                claim: None,
            };
            match self.record(&mut store, &alloc) {
                Ok(()) => {
                    tracing::warn!(
                        id = %id, resource = %g.resource, pod_uid = ?g.container.pod_uid,
                        devices = %g.device_ids.join(","),
                        "allocation {id} made again from the kubelet's checkpoint: the records had lost it (a power \
                         cut before its flush); its container keeps its limits"
                    );
                    made.push(id.clone());
                }
                Err(e) => tracing::error!(id = %id, error = %e.message(), "cannot make allocation {id} again"),
            }
        }
        made
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint as the kubelet writes it, with one entry per `(resource, ids, answer env)`.
    fn checkpoint(entries: &[(&str, &[&str], Option<&str>)]) -> Vec<u8> {
        let entries: Vec<serde_json::Value> = entries
            .iter()
            .enumerate()
            .map(|(i, (res, ids, alloc))| {
                let mut resp = ContainerAllocateResponse::default();
                if let Some(a) = alloc {
                    resp.envs.insert(ALLOCATION_ENV.into(), (*a).into());
                }
                serde_json::json!({
                    "PodUID": format!("pod-{i}"),
                    "ContainerName": "main",
                    "ResourceName": res,
                    "DeviceIDs": {"-1": ids},
                    "AllocResp": base64::engine::general_purpose::STANDARD.encode(resp.encode_to_vec()),
                })
            })
            .collect();
        serde_json::to_vec(&serde_json::json!({
            "Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}},
            "Checksum": 1234,
        }))
        .unwrap()
    }

    #[test]
    fn a_checkpoint_gives_each_entrys_devices_and_allocation() {
        let text =
            checkpoint(&[("tessera.io/gpu-share", &["GPU-0::1", "GPU-0::2"], Some("a1b2")), ("other/x", &["x"], None)]);
        let g = parse(&text).unwrap();
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].resource, "tessera.io/gpu-share");
        assert_eq!(g[0].device_ids, ["GPU-0::1", "GPU-0::2"]);
        assert_eq!(g[0].allocation.as_deref(), Some("a1b2"));
        assert_eq!(g[0].container.pod_uid.as_deref(), Some("pod-0"));
        assert_eq!(g[0].container.container_name.as_deref(), Some("main"));
        assert_eq!(g[1].allocation, None);
    }

    #[test]
    fn numa_nodes_are_joined_in_order_and_nulls_are_empty() {
        let text = br#"{"Data":{"PodDeviceEntries":[{"PodUID":"p","ContainerName":"c","ResourceName":"r",
            "DeviceIDs":{"1":["b"],"-1":null,"0":["a"]},"AllocResp":null}],"RegisteredDevices":null},"Checksum":0}"#;
        let g = parse(text).unwrap();
        assert_eq!(g[0].device_ids, ["a", "b"]);
        assert_eq!(g[0].allocation, None);
        let empty = br#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":null},"Checksum":0}"#;
        assert!(parse(empty).unwrap().is_empty());
    }

    #[test]
    fn a_damaged_checkpoint_is_an_error_and_a_damaged_answer_is_none() {
        for bad in [&b""[..], b"{", b"[]", br#"{"Data":{"PodDeviceEntries":[{"DeviceIDs":["not a map"]}]}}"#] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let text = br#"{"Data":{"PodDeviceEntries":[{"ResourceName":"r","AllocResp":"not base64!"},
            {"ResourceName":"r","AllocResp":"/////w=="}]},"Checksum":0}"#;
        let g = parse(text).unwrap();
        assert_eq!(g.iter().map(|g| g.allocation.clone()).collect::<Vec<_>>(), [None, None]);
    }

    /// A power cut took a kubelet record's frame before its flush (removed from the store here)
    /// and the reboot its directory; the kubelet's checkpoint still keeps the answer. The record
    /// is made again with its id, devices and limits; what the checkpoint keeps that is not ours,
    /// names what is not offered, or was superseded by a later record is passed over and said.
    #[test]
    fn a_kubelet_record_the_journal_lost_is_made_again_from_the_checkpoint_and_nothing_else() {
        use crate::allocator::kubelet::Allocator;
        use crate::allocator::tests::{allocator, resources};
        use crate::config::Placement;
        let share = "tessera.io/gpu-share";
        let ids = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let lost = a.allocate(share, &ids(&["GPU-a::0"])).unwrap().envs[ALLOCATION_ENV].clone();
        let superseded = a.allocate(share, &ids(&["GPU-b::0"])).unwrap().envs[ALLOCATION_ENV].clone();
        let newer = a.allocate(share, &ids(&["GPU-b::0", "GPU-b::1"])).unwrap().envs[ALLOCATION_ENV].clone();
        assert!(a.allocations().iter().all(|r| r.id != superseded), "the overlapping ask replaced it");
        drop(a);
        // The loss: its frame gone from the journal, its directory with the runtime dir.
        let dirs = crate::state::AllocDirs::new(&tmp.path().join("run"));
        let mut store = crate::state::Store::open(&tmp.path().join("state")).unwrap();
        store.remove(&lost).unwrap();
        dirs.remove(&lost).unwrap();
        let a = DaemonAllocator::new(&crate::config::Config::default(), resources(), store, dirs.clone());
        a.reconcile();
        let text = checkpoint(&[
            (share, &["GPU-a::0"], Some(&lost)),
            (share, &["GPU-b::0"], Some(&superseded)),
            (share, &["GPU-b::0", "GPU-b::1"], Some(&newer)),
            (share, &["GPU-a::1"], Some("../../etc")),
            (share, &["GPU-z::9"], Some("0123456789abcdef0123456789abcdef")),
            ("vendor.example/fpga", &["f0"], Some("fedcba9876543210fedcba9876543210")),
            ("nvidia.com/gpu", &["GPU-a::1"], None),
        ]);
        let grants = parse(&text).unwrap();
        let (made, log) = crate::testlog::logged(|| a.recover_kubelet_grants(&grants));
        assert_eq!(made, std::slice::from_ref(&lost), "{log}");
        let rec = a.allocations().into_iter().find(|r| r.id == lost).expect("made again");
        assert_eq!(rec.source, Source::Kubelet);
        assert_eq!(rec.resource, share);
        assert_eq!(rec.devices.iter().map(|d| d.device_id.as_str()).collect::<Vec<_>>(), ["GPU-a::0"]);
        assert_eq!(rec.container.pod_uid.as_deref(), Some("pod-0"));
        let limits = tessera_region::Limits::load(&dirs.limits_path(&lost)).unwrap();
        assert_eq!(limits.devices[0].memory_limit, Some(1 << 30), "the offer's limits");
        assert!(log.contains(&format!("allocation {lost} made again from the kubelet's checkpoint")), "{log}");
        assert!(log.contains("a kubelet allocation the records hold has some of its devices"), "{log}");
        assert!(log.contains("its id is not one tesserad makes"), "{log}");
        assert!(log.contains("unknown device id"), "{log}");
        assert!(log.contains("its resource is not served now"), "{log}");
        assert_eq!(a.allocations().len(), 2, "the kept newer one and the one made again");
        // Durable: a restart finds it in the journal; a second pass makes nothing.
        drop(a);
        let store = crate::state::Store::open(&tmp.path().join("state")).unwrap();
        assert!(store.get(&lost).is_some());
        let a = DaemonAllocator::new(&crate::config::Config::default(), resources(), store, dirs);
        assert!(a.recover_kubelet_grants(&grants).is_empty());
    }

    #[test]
    fn a_missing_checkpoint_is_none_and_an_unreadable_one_names_its_file() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        std::fs::write(dir.path().join(CHECKPOINT_FILE), b"{\"Data\":").unwrap();
        let e = read(dir.path()).unwrap_err();
        assert!(e.contains(CHECKPOINT_FILE) && e.contains("does not parse"), "{e}");
    }
}
