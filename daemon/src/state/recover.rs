//! Allocation records rebuilt from their directories, for a journal that lost them.
//!
//! A directory `<runtime_dir>/alloc/<id>/` whose `limits` file reads back says what the
//! allocation enforces: its devices (by the UUID the container sees), their memory and SM limits,
//! its priority and compute mode; an `owner` file (written by the hook or the wrapper) names its
//! container. What it cannot say is the resource and the device ids the kubelet knows: a rebuilt
//! record names each device by its UUID, its resource is empty and its source
//! [`Source::Recovered`], so nothing (the pod-resources release, a new `Allocate`) mistakes it for
//! one it can match; the GPUs it names stay held, and its container keeps its limits. Only reads.

use std::time::UNIX_EPOCH;

use tessera_region::Limits;
use tessera_region::owner::Owner;

use super::alloc_dir::AllocDirs;
use super::record::{AllocatedDevice, Allocation, Source, unix_ns};

/// The record of allocation `id` as its directory tells it; `Err` says why it cannot.
pub fn from_dir(dirs: &AllocDirs, id: &str) -> Result<Allocation, String> {
    let limits_path = dirs.limits_path(id);
    let limits = Limits::load(&limits_path).map_err(|e| e.to_string())?;
    let created_unix_ns = std::fs::metadata(&limits_path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .and_then(|d| u64::try_from(d.as_nanos()).ok())
        .unwrap_or_else(unix_ns);
    let owner = Owner::read(&dirs.dir(id)).unwrap_or_default();
    Ok(Allocation {
        id: id.to_string(),
        resource: String::new(),
        container: owner.container,
        source: Source::Recovered,
        created_unix_ns,
        // A node API allocation's owner is in its record only; its lease to its container is
        // also in the directory (the marker the runtime's poststop entry looks for): kept, so
        // the container's end still releases it.
        claim: tessera_region::owner::is_leased(&dirs.dir(id))
            .then(|| Box::new(super::record::Claim { owner: None, lease: super::record::Lease::Container })),
        devices: limits
            .devices
            .iter()
            .map(|d| AllocatedDevice {
                device_id: d.uuid.clone(),
                physical_uuid: d.uuid.clone(),
                memory_limit: d.memory_limit,
                sm_percent: d.sm_percent,
                priority: limits.priority,
                compute_mode: limits.compute_mode,
                whole: false,
                preemptible: false,
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ContainerIdentity;
    use crate::state::record::tests::sample;

    #[test]
    fn a_directory_gives_back_its_limits_and_owner() {
        let tmp = crate::state::mount::TestDir::new();
        let dirs = AllocDirs::new(tmp.path());
        let a = sample("r1");
        dirs.create(&a).unwrap();
        let container =
            ContainerIdentity { container_id: Some("c0ffee".into()), pod_name: Some("p".into()), ..Default::default() };
        let owner = Owner { container, ..Owner::default() };
        owner.write(&dirs.dir("r1")).unwrap();
        let r = from_dir(&dirs, "r1").unwrap();
        assert_eq!(r.id, "r1");
        assert_eq!(r.source, Source::Recovered);
        assert_eq!(r.resource, "");
        assert_eq!(r.container.container_id.as_deref(), Some("c0ffee"));
        assert_eq!(r.container.pod_name.as_deref(), Some("p"));
        assert_eq!(r.devices.len(), 1);
        assert_eq!(r.devices[0].physical_uuid, "GPU-1234");
        assert_eq!(r.devices[0].device_id, "GPU-1234");
        assert_eq!((r.devices[0].memory_limit, r.devices[0].sm_percent), (Some(1 << 30), Some(50)));
        // The same limits as before: the container's enforcement does not change.
        assert_eq!(r.limits().devices, a.limits().devices);
        assert!(r.created_unix_ns > 0);

        // No owner file: an unnamed record. A limits file that does not parse: refused, named.
        dirs.create(&sample("r2")).unwrap();
        assert_eq!(from_dir(&dirs, "r2").unwrap().container, ContainerIdentity::default());
        std::fs::write(dirs.limits_path("r2"), "version = 99\n").unwrap();
        let err = from_dir(&dirs, "r2").unwrap_err();
        assert!(err.contains("limits") && err.contains("version"), "{err}");
        assert!(from_dir(&dirs, "none").unwrap_err().contains("none/limits"));
        assert!(!r.leased_to_container());
    }

    /// A node API allocation leased to its container keeps its lease (the marker is in its
    /// directory), so the container's end still releases it; recovered without it, it stayed.
    #[test]
    fn a_leased_directory_gives_back_its_lease() {
        let tmp = crate::state::mount::TestDir::new();
        let dirs = AllocDirs::new(tmp.path());
        let mut a = sample("r3");
        a.claim = Some(Box::new(crate::state::record::Claim {
            owner: Some("fn".into()),
            lease: crate::state::record::Lease::Container,
        }));
        dirs.create(&a).unwrap();
        assert!(from_dir(&dirs, "r3").unwrap().leased_to_container());
    }
}
