//! Who a container is, written once for every part that names it: [`ContainerIdentity`] (the
//! pod's namespace, name and uid, the container's name and the runtime's container id), which
//! tesserad keeps in each allocation record and the hook writes into the owner record.
//!
//! The owner record (feature `host`): `<runtime_dir>/alloc/<id>/owner` (JSON), written by the
//! hook or the wrapper: the container's identity (the runtime's container id with, when a CRI
//! runtime started it, the pod's namespace, name and uid and the container's name from the
//! annotations containerd and CRI-O set) and what vanishes with the container. The daemon names
//! the allocation from it where the kubelet's pod-resources API cannot (a serverless platform, a
//! plain host). Reporting only: a record that cannot be written never fails a container start.
//! Beside it, the `lease` and `deleted` markers of `--lease container`.

#[cfg(feature = "host")]
use std::collections::BTreeMap;
#[cfg(feature = "host")]
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The container an allocation is for, as far as it is known (the kubelet's `Allocate` does not
/// say which pod it is for; the pod-resources API or the hook fill it in later). Strict in the
/// allocation record (an unknown key is refused); the owner record, which a hook of another
/// version may have written, is read leniently (see `Owner`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerIdentity {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
}

impl ContainerIdentity {
    /// The container `container` of the pod `namespace/pod`, its pod uid and container id not
    /// known.
    pub fn of_pod(namespace: impl Into<String>, pod: impl Into<String>, container: impl Into<String>) -> Self {
        ContainerIdentity {
            pod_namespace: Some(namespace.into()),
            pod_name: Some(pod.into()),
            container_name: Some(container.into()),
            ..Default::default()
        }
    }

    /// A short name for reports: `namespace/pod/container` when the pod is known, else the
    /// container id; `None` when nothing is known.
    pub fn display_name(&self) -> Option<String> {
        let nonempty = |s: &Option<String>| s.as_deref().map(str::trim).filter(|s| !s.is_empty()).map(str::to_string);
        if let Some(pod) = nonempty(&self.pod_name) {
            let mut name = match nonempty(&self.pod_namespace) {
                Some(ns) => format!("{ns}/{pod}"),
                None => pod,
            };
            if let Some(c) = nonempty(&self.container_name) {
                name = format!("{name}/{c}");
            }
            return Some(name);
        }
        nonempty(&self.container_id)
    }

    /// From the container id and the OCI annotations (containerd's `io.kubernetes.cri.*`, else
    /// CRI-O's `io.kubernetes.*`).
    #[cfg(feature = "host")]
    pub fn from_annotations(container_id: Option<&str>, annotations: &BTreeMap<String, String>) -> ContainerIdentity {
        let get = |keys: &[&str]| keys.iter().find_map(|k| annotations.get(*k)).filter(|v| !v.is_empty()).cloned();
        ContainerIdentity {
            pod_namespace: get(&["io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"]),
            pod_name: get(&["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"]),
            pod_uid: get(&["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"]),
            container_name: get(&["io.kubernetes.cri.container-name", "io.kubernetes.container.name"]),
            container_id: container_id.filter(|c| !c.is_empty()).map(String::from),
        }
    }
}

/// The owner record's name inside the allocation directory.
#[cfg(feature = "host")]
pub const OWNER_FILE: &str = "owner";

/// The owner record: the container's identity (its keys at the top level of the JSON object, as
/// they always were) and what vanishes with the container. Keys it does not know are ignored.
#[cfg(feature = "host")]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    #[serde(flatten)]
    pub container: ContainerIdentity,
    /// The runtime's state directory of the container (`<runc --root>/<id>`), when the runtime
    /// wrapper knows it: gone once the container is deleted, so the daemon can tell a container
    /// that vanished without its poststop hook (`--lease container`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_state: Option<String>,
    /// The container's cgroup directory (`/sys/fs/cgroup/...`), recorded by the hook where the
    /// runtime's state directory cannot be told: the runtime removes it when it deletes the
    /// container, so it serves the same purpose for a container that vanished without its
    /// poststop hook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
}

/// The file the `poststop` hook leaves in the allocation directory: the id of the container that
/// was deleted (a leased allocation bound to it is then released).
#[cfg(feature = "host")]
pub const DELETED_FILE: &str = "deleted";

/// Records that container `container_id` using the allocation in `dir` was deleted.
#[cfg(feature = "host")]
pub fn record_deleted(dir: &Path, container_id: &str) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{DELETED_FILE}.{}", std::process::id()));
    std::fs::write(&tmp, container_id)?;
    std::fs::rename(&tmp, dir.join(DELETED_FILE)).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The file tesserad leaves in the directory of an allocation made with `--lease container`
/// (its content: `container`). Only such an allocation needs to hear of its container's deletion,
/// so only for it does the runtime wrapper add its `poststop` entry: a process less at every
/// other container's deletion.
#[cfg(feature = "host")]
pub const LEASE_FILE: &str = "lease";

/// Whether the allocation in `dir` is leased to its container ([`LEASE_FILE`]).
#[cfg(feature = "host")]
pub fn is_leased(dir: &Path) -> bool {
    dir.join(LEASE_FILE).is_file()
}

/// The id of the container the `poststop` hook last recorded as deleted in `dir`.
#[cfg(feature = "host")]
pub fn read_deleted(dir: &Path) -> Option<String> {
    std::fs::read_to_string(dir.join(DELETED_FILE)).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

#[cfg(feature = "host")]
impl Owner {
    /// Writes the record into the allocation directory `dir` (temporary file, then rename, so a
    /// reader never sees half of it). Errors are returned for the caller to ignore or log.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.join(format!(".{OWNER_FILE}.{}", std::process::id()));
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, dir.join(OWNER_FILE)).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }

    /// The record in allocation directory `dir`, when there is a readable one.
    pub fn read(dir: &Path) -> Option<Owner> {
        serde_json::from_slice(&std::fs::read(dir.join(OWNER_FILE)).ok()?).ok()
    }
}

#[cfg(all(test, feature = "host"))]
mod tests {
    use super::*;

    #[test]
    fn cri_annotations_and_round_trip() {
        let ann: BTreeMap<String, String> = [
            ("io.kubernetes.cri.sandbox-namespace", "team-a"),
            ("io.kubernetes.cri.sandbox-name", "trainer"),
            ("io.kubernetes.cri.container-name", "main"),
            ("io.kubernetes.pod.uid", "u-1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let c = ContainerIdentity::from_annotations(Some("abc123"), &ann);
        assert_eq!(c.pod_namespace.as_deref(), Some("team-a"));
        assert_eq!(c.pod_name.as_deref(), Some("trainer"));
        assert_eq!(c.container_name.as_deref(), Some("main"));
        assert_eq!(c.pod_uid.as_deref(), Some("u-1"), "CRI-O's key where containerd's is absent");
        let o = Owner { container: c, runtime_state: Some("/run/runc/abc123".into()), cgroup: None };
        let tmp = tempfile::tempdir().unwrap();
        o.write(tmp.path()).unwrap();
        assert_eq!(Owner::read(tmp.path()), Some(o));
        assert_eq!(ContainerIdentity::from_annotations(None, &BTreeMap::new()), ContainerIdentity::default());
    }

    /// An owner record as the hook wrote it before the identity became one type (container id
    /// first, a key this version does not know) reads the same; the allocation record's identity
    /// stays strict.
    #[test]
    fn an_earlier_owner_record_reads_and_the_records_identity_stays_strict() {
        let tmp = tempfile::tempdir().unwrap();
        let earlier = r#"{"container_id":"c1","pod_namespace":"ns","pod_name":"p","pod_uid":"u","container_name":"main","runtime_state":"/run/runc/c1","cgroup":"/sys/fs/cgroup/x","from_a_later_hook":1}"#;
        std::fs::write(tmp.path().join(OWNER_FILE), earlier).unwrap();
        let o = Owner::read(tmp.path()).expect("read");
        assert_eq!(o.container.container_id.as_deref(), Some("c1"));
        assert_eq!(o.container.display_name().as_deref(), Some("ns/p/main"));
        assert_eq!((o.runtime_state.as_deref(), o.cgroup.as_deref()), (Some("/run/runc/c1"), Some("/sys/fs/cgroup/x")));
        // Written again: the same keys and values.
        o.write(tmp.path()).unwrap();
        let again: serde_json::Value =
            serde_json::from_slice(&std::fs::read(tmp.path().join(OWNER_FILE)).unwrap()).unwrap();
        let mut want: serde_json::Value = serde_json::from_str(earlier).unwrap();
        want.as_object_mut().unwrap().remove("from_a_later_hook");
        assert_eq!(again, want);
        // In an allocation record, an unknown key is an error naming it.
        let e = serde_json::from_str::<ContainerIdentity>(r#"{"container_id":"c1","cgroup":"/x"}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `cgroup`"), "{e}");
        let id: ContainerIdentity = serde_json::from_str(r#"{"pod_name":"p","container_id":"c1"}"#).unwrap();
        assert_eq!(id.display_name().as_deref(), Some("p"));
    }
}
