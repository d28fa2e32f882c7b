//! The per-claim CDI specs: what NodePrepareResources hands the kubelet must give the container
//! the claim's allocation, and the kubelet can only pass CDI device names. So each prepared claim
//! gets a spec of its own, kind `tessera.io/claim`, in `<cdi_spec_dir>/tessera.io-claim_<uid>.json`
//! (built by `tessera_region::cdi::build_claim_spec`): per device of the claim its nodes, the
//! allocation's directory (read-only) with its region (read-write), `/etc/ld.so.preload` naming
//! the shim, and `TESSERA_ALLOCATION` / `TESSERA_LIMITS` / `TESSERA_REGION`; the spec's own edits
//! are the class specs' (control nodes, driver files, the shim, the hook entries).
//!
//! Lifetime: written (atomically, durably) after the allocation record and before the kubelet is
//! answered; removed after the record on unprepare. At start, [`ClaimSpecs::reconcile`] writes
//! the spec of every claim with a record again and removes the specs of claims without one, so a
//! kill -9 anywhere in between leaves neither a prepared claim without its spec nor a spec
//! without its claim.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_region::cdi::{self, ClaimDevices, NodeDevice, NodeDevices};

use crate::state::Allocation;

/// The host device nodes of a GPU or MIG device by UUID; `None` when the node has no such device.
pub type NodesOf = Arc<dyn Fn(&str) -> Option<Vec<PathBuf>> + Send + Sync>;

/// Writes and removes the claims' specs.
pub struct ClaimSpecs {
    dir: PathBuf,
    /// Control nodes, driver files, shim, hook entries (no devices).
    base: NodeDevices,
    runtime_dir: PathBuf,
    nodes: NodesOf,
}

impl std::fmt::Debug for ClaimSpecs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimSpecs").field("dir", &self.dir).finish_non_exhaustive()
    }
}

/// The claim UID an allocation made for a claim is owned by.
pub fn claim_uid(alloc: &Allocation) -> Option<&str> {
    (alloc.resource == crate::allocator::DRA_RESOURCE).then(|| alloc.claim.as_ref()?.owner.as_deref()).flatten()
}

/// The fully qualified CDI name of device `uuid` of claim `claim_uid`.
pub fn cdi_id(claim_uid: &str, uuid: &str) -> String {
    format!("{}/{}={}", cdi::VENDOR, cdi::CLAIM_CLASS, cdi::claim_device_name(claim_uid, uuid))
}

impl ClaimSpecs {
    /// Specs in `dir` over `base` (the class specs' common parts), allocation directories under
    /// `runtime_dir`, device nodes from `nodes`.
    pub fn new(dir: PathBuf, base: NodeDevices, runtime_dir: PathBuf, nodes: NodesOf) -> ClaimSpecs {
        ClaimSpecs { dir, base, runtime_dir, nodes }
    }

    /// The spec directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes the spec of the claim that owns `alloc` (again: the same content for the same
    /// record); returns, per device UUID of the allocation, its CDI name.
    pub fn write(&self, alloc: &Allocation) -> Result<Vec<(String, String)>, String> {
        let uid = claim_uid(alloc).ok_or_else(|| format!("allocation {} is not a claim's", alloc.id))?;
        let mut devices: Vec<NodeDevice> = Vec::new();
        for d in &alloc.devices {
            if devices.iter().any(|n| n.uuid == d.physical_uuid) {
                continue;
            }
            let nodes = (self.nodes)(&d.physical_uuid)
                .ok_or_else(|| format!("claim {uid}: device {} is not on this node", d.physical_uuid))?;
            devices.push(NodeDevice {
                class: cdi::CLAIM_CLASS.into(),
                name: cdi::claim_device_name(uid, &d.physical_uuid),
                aliases: Vec::new(),
                uuid: d.physical_uuid.clone(),
                nodes,
            });
        }
        let hook_dir = self.runtime_dir.join("hook");
        let claim = ClaimDevices {
            claim_uid: uid.to_owned(),
            allocation: alloc.id.clone(),
            alloc_dir: self.runtime_dir.join(crate::state::alloc_dir::ALLOC_SUBDIR).join(&alloc.id),
            preload: hook_dir.join("ld.so.preload"),
            devices,
        };
        if self.base.shim.is_some() {
            // The file the hook makes and mounts too; the same bytes, so both agree.
            let text = tessera_region::paths::preload_content();
            if std::fs::read_to_string(&claim.preload).ok().as_deref() != Some(text.as_str()) {
                std::fs::create_dir_all(&hook_dir).map_err(|e| format!("{}: {e}", hook_dir.display()))?;
                crate::state::durable::write_file(&claim.preload, text.as_bytes(), 0o644)
                    .map_err(|e| format!("{}: {e}", claim.preload.display()))?;
            }
        }
        let spec = cdi::build_claim_spec(&self.base, &claim).map_err(|e| format!("claim {uid}: CDI spec: {e}"))?;
        cdi::write_claim_spec(&self.dir, uid, &spec).map_err(|e| format!("claim {uid}: writing its CDI spec: {e}"))?;
        Ok(claim.devices.iter().map(|d| (d.uuid.clone(), cdi_id(uid, &d.uuid))).collect())
    }

    /// Removes claim `uid`'s spec; `Ok(false)` when there was none.
    pub fn remove(&self, uid: &str) -> Result<bool, String> {
        cdi::remove_claim_spec(&self.dir, uid).map_err(|e| format!("claim {uid}: removing its CDI spec: {e}"))
    }

    /// After a start: every claim with a record in `allocations` gets its spec (written again),
    /// and the specs of claims without one go. Returns (written, removed); failures are logged,
    /// never fatal (a claim whose spec cannot be written is written again by its next prepare).
    pub fn reconcile(&self, allocations: &[Allocation]) -> (usize, usize) {
        let mut prepared = BTreeSet::new();
        let mut written = 0;
        for a in allocations {
            let Some(uid) = claim_uid(a) else { continue };
            prepared.insert(cdi::cdi_device_name(uid));
            match self.write(a) {
                Ok(_) => written += 1,
                Err(e) => {
                    tracing::error!(claim = uid, allocation = %a.id, error = %e, "cannot write a claim's CDI spec")
                }
            }
        }
        let mut removed = 0;
        match cdi::claim_spec_uids(&self.dir) {
            Ok(uids) => {
                for uid in uids.iter().filter(|u| !prepared.contains(*u)) {
                    match self.remove(uid) {
                        Ok(_) => {
                            removed += 1;
                            tracing::info!(claim = %uid, "removed the CDI spec of a claim no longer prepared");
                        }
                        Err(e) => tracing::error!(error = %e, "cannot remove a stale claim CDI spec"),
                    }
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot list the claim CDI specs"),
        }
        (written, removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::tests::dev;
    use crate::state::{Claim, ContainerIdentity, Lease, Source};

    pub(crate) fn claim_allocation(id: &str, uid: &str, uuid: &str) -> Allocation {
        Allocation {
            id: id.into(),
            resource: crate::allocator::DRA_RESOURCE.into(),
            container: ContainerIdentity::default(),
            source: Source::NodeApi,
            created_unix_ns: 0,
            devices: vec![dev(uuid, uuid, Some(8 << 30), Some(30))],
            claim: Some(Box::new(Claim { owner: Some(uid.into()), lease: Lease::None })),
        }
    }

    fn specs(dir: &Path) -> ClaimSpecs {
        let base = NodeDevices {
            shim: Some(PathBuf::from("/usr/local/lib/tessera/libtessera.so")),
            hook_binary: PathBuf::from("/usr/local/bin/tessera-hook"),
            hook_config: dir.join("run/hook.toml"),
            ..NodeDevices::default()
        };
        let nodes: NodesOf = Arc::new(|uuid: &str| (uuid != "GPU-gone").then(Vec::new));
        ClaimSpecs::new(dir.join("cdi"), base, dir.join("run"), nodes)
    }

    #[test]
    fn written_on_prepare_kept_for_records_and_removed_without_them() {
        let tmp = tempfile::tempdir().unwrap();
        let s = specs(tmp.path());
        let a = claim_allocation("a1", "uid-1", "GPU-0");
        let ids = s.write(&a).unwrap();
        assert_eq!(ids, [("GPU-0".to_string(), "tessera.io/claim=uid-1-GPU-0".to_string())]);
        let file = tmp.path().join("cdi/tessera.io-claim_uid-1.json");
        let first = std::fs::read(&file).unwrap();
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("run/hook/ld.so.preload")).unwrap(),
            "/usr/lib/tessera/libtessera.so\n"
        );
        // Again: the same bytes.
        s.write(&a).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), first);
        // A restart with the record: kept (written again); a spec without a record goes.
        let b = claim_allocation("a2", "uid-2", "GPU-0");
        s.write(&b).unwrap();
        std::fs::remove_file(&file).unwrap();
        assert_eq!(s.reconcile(std::slice::from_ref(&a)), (1, 1));
        assert_eq!(std::fs::read(&file).unwrap(), first);
        assert_eq!(cdi::claim_spec_uids(s.dir()).unwrap(), ["uid-1"]);
        // Other allocations are not claims; a device the node lacks is an error naming it.
        let mut plain = a.clone();
        plain.resource = "node-api/gpu-share".into();
        assert!(s.write(&plain).unwrap_err().contains("is not a claim's"));
        let gone = claim_allocation("a3", "uid-3", "GPU-gone");
        assert!(s.write(&gone).unwrap_err().contains("device GPU-gone is not on this node"));
        assert!(s.remove("uid-1").unwrap());
        assert!(!s.remove("uid-1").unwrap());
    }
}
