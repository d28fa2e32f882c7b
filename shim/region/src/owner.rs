//! Who holds an allocation, as the hook or the wrapper sees it: `<runtime_dir>/alloc/<id>/owner`
//! (JSON) with the runtime's container id and, when a CRI runtime started it, the pod's namespace,
//! name and uid and the container's name from the annotations containerd and CRI-O set. The
//! daemon names the allocation from it where the kubelet's pod-resources API cannot (a
//! serverless platform, a plain host). Reporting only: a record that cannot be written never
//! fails a container start.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The file's name inside the allocation directory.
pub const OWNER_FILE: &str = "owner";

/// The record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_name: Option<String>,
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
pub const DELETED_FILE: &str = "deleted";

/// Records that container `container_id` using the allocation in `dir` was deleted.
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
pub const LEASE_FILE: &str = "lease";

/// Whether the allocation in `dir` is leased to its container ([`LEASE_FILE`]).
pub fn is_leased(dir: &Path) -> bool {
    dir.join(LEASE_FILE).is_file()
}

/// The id of the container the `poststop` hook last recorded as deleted in `dir`.
pub fn read_deleted(dir: &Path) -> Option<String> {
    std::fs::read_to_string(dir.join(DELETED_FILE)).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

impl Owner {
    /// From the container id and the OCI annotations (containerd's `io.kubernetes.cri.*`, else
    /// CRI-O's `io.kubernetes.*`).
    pub fn from_annotations(container_id: Option<&str>, annotations: &BTreeMap<String, String>) -> Owner {
        let get = |keys: &[&str]| keys.iter().find_map(|k| annotations.get(*k)).filter(|v| !v.is_empty()).cloned();
        Owner {
            container_id: container_id.filter(|c| !c.is_empty()).map(String::from),
            pod_namespace: get(&["io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"]),
            pod_name: get(&["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"]),
            pod_uid: get(&["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"]),
            container_name: get(&["io.kubernetes.cri.container-name", "io.kubernetes.container.name"]),
            runtime_state: None,
            cgroup: None,
        }
    }

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

#[cfg(test)]
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
        let o = Owner::from_annotations(Some("abc123"), &ann);
        assert_eq!(o.pod_namespace.as_deref(), Some("team-a"));
        assert_eq!(o.pod_name.as_deref(), Some("trainer"));
        assert_eq!(o.container_name.as_deref(), Some("main"));
        assert_eq!(o.pod_uid.as_deref(), Some("u-1"), "CRI-O's key where containerd's is absent");
        let tmp = tempfile::tempdir().unwrap();
        o.write(tmp.path()).unwrap();
        assert_eq!(Owner::read(tmp.path()), Some(o));
        assert_eq!(Owner::from_annotations(None, &BTreeMap::new()), Owner::default());
    }
}
