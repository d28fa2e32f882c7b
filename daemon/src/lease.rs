//! Leases (`tessera alloc --lease container`): a node API allocation bound to the first
//! container that uses it — the one the hook's or the runtime wrapper's owner record names, which
//! [`DaemonAllocator::adopt_owner_records`] copies into the record — is released when that
//! container is deleted:
//!
//! - its `poststop` hook (added by `tessera-runtime`) leaves the container's id in the
//!   allocation's `deleted` file;
//! - a container that vanished without it (CDI: no poststop entry runs for a container the
//!   runtime deleted on its own; the runtime's state removed; a host rebooted): the runtime's
//!   state directory the wrapper or the hook recorded is gone, or, where no state directory could
//!   be told, the container's cgroup the hook recorded is. Only once the owner record is older
//!   than [`STATE_GRACE`]: the wrapper records it just before the runtime creates that directory.
//!
//! A leased allocation no container has used yet lives until it is used or released.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::allocator::DaemonAllocator;
use crate::state::{AllocDirs, Allocation};

/// How often leases are checked.
pub const INTERVAL: Duration = Duration::from_secs(1);
/// How old an owner record must be before a missing runtime state directory counts.
pub const STATE_GRACE: Duration = Duration::from_secs(10);

/// Why `alloc`'s lease has ended, if it has.
pub fn ended(alloc: &Allocation, dirs: &AllocDirs, now: SystemTime) -> Option<String> {
    if !alloc.leased_to_container() {
        return None;
    }
    let bound = alloc.container.container_id.as_deref()?;
    let dir = dirs.dir(&alloc.id);
    if tessera_region::owner::read_deleted(&dir).as_deref() == Some(bound) {
        return Some(format!("container {bound} was deleted"));
    }
    let owner_file = dir.join(tessera_region::owner::OWNER_FILE);
    let owner = tessera_region::owner::Owner::read(&dir)?;
    if owner.container.container_id.as_deref() != Some(bound) {
        return None;
    }
    let (what, path) = match (owner.runtime_state, owner.cgroup) {
        (Some(state), _) => ("runtime state", state),
        (None, Some(cgroup)) => ("cgroup", cgroup),
        (None, None) => return None,
    };
    let age = std::fs::metadata(&owner_file).and_then(|m| m.modified()).ok().and_then(|t| now.duration_since(t).ok());
    if age.is_some_and(|a| a >= STATE_GRACE) && !Path::new(&path).exists() {
        return Some(format!("container {bound} is gone (its {what} {path} does not exist)"));
    }
    None
}

/// One pass: binds leases to their containers, releases those whose container is gone. Returns
/// the allocations released, with why.
pub fn sweep(allocator: &DaemonAllocator) -> Vec<(String, String)> {
    allocator.adopt_owner_records();
    let now = SystemTime::now();
    let mut released = Vec::new();
    for alloc in allocator.allocations_where(Allocation::leased_to_container) {
        let Some(why) = ended(&alloc, allocator.dirs(), now) else { continue };
        match allocator.release(&alloc.id) {
            Ok(_) => {
                tracing::info!(id = %alloc.id, reason = %why, "lease ended: allocation released");
                released.push((alloc.id, why));
            }
            Err(e) => tracing::warn!(id = %alloc.id, error = %e, "cannot release an ended lease"),
        }
    }
    released
}

/// Sweeps every [`INTERVAL`] until `shutdown` turns true.
pub fn spawn(allocator: Arc<DaemonAllocator>, mut shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let a = Arc::clone(&allocator);
            if let Err(e) = tokio::task::spawn_blocking(move || sweep(&a)).await {
                tracing::error!(error = %e, "lease pass failed");
            }
            tokio::select! {
                () = tokio::time::sleep(INTERVAL) => {}
                _ = shutdown.wait_for(|s| *s) => return,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::state::mount::TestDir;
    use crate::state::record::tests::sample;
    use crate::state::{Claim, ContainerIdentity, Lease};
    use tessera_region::owner::{Owner, record_deleted};

    fn leased(id: &str, bound: Option<&str>) -> Allocation {
        let mut a = sample(id);
        a.claim = Some(Box::new(Claim { owner: None, lease: Lease::Container }));
        a.container = ContainerIdentity { container_id: bound.map(String::from), ..Default::default() };
        a
    }

    /// An allocation `id` leased to container c1, created in allocation directories under `tmp`:
    /// the directories, the allocation, its directory.
    fn leased_to_c1(tmp: &TestDir, id: &str) -> (AllocDirs, Allocation, PathBuf) {
        let dirs = AllocDirs::new(tmp.path());
        let a = leased(id, Some("c1"));
        let dir = dirs.create(&a).unwrap();
        (dirs, a, dir)
    }

    #[test]
    fn a_lease_ends_with_its_container_only() {
        let tmp = TestDir::new();
        let (dirs, a, dir) = leased_to_c1(&tmp, "l1");
        let now = SystemTime::now();
        assert_eq!(ended(&a, &dirs, now), None, "bound, running");
        // Another container's deletion does not end it.
        record_deleted(&dir, "c2").unwrap();
        assert_eq!(ended(&a, &dirs, now), None);
        record_deleted(&dir, "c1").unwrap();
        assert_eq!(ended(&a, &dirs, now).as_deref(), Some("container c1 was deleted"));
        // Not leased, or not bound yet: never.
        let mut plain = a.clone();
        plain.claim = None;
        assert_eq!(ended(&plain, &dirs, now), None);
        assert_eq!(ended(&leased("l1", None), &dirs, now), None);
    }

    #[test]
    fn a_vanished_runtime_state_ends_it_after_the_grace() {
        let tmp = TestDir::new();
        let (dirs, a, dir) = leased_to_c1(&tmp, "l2");
        let state = tmp.path().join("runc/c1");
        std::fs::create_dir_all(&state).unwrap();
        let owner = Owner {
            container: ContainerIdentity { container_id: Some("c1".into()), ..Default::default() },
            runtime_state: Some(state.display().to_string()),
            ..Default::default()
        };
        owner.write(&dir).unwrap();
        let later = SystemTime::now() + STATE_GRACE;
        assert_eq!(ended(&a, &dirs, later), None, "its state is there");
        std::fs::remove_dir(&state).unwrap();
        assert_eq!(ended(&a, &dirs, SystemTime::now()), None, "within the grace: the runtime may be creating it");
        assert!(ended(&a, &dirs, later).is_some_and(|w| w.contains("runtime state") && w.contains("does not exist")));
    }

    /// CDI: the hook records the container's cgroup where it cannot tell the runtime's state
    /// directory; the state directory wins when both are known (a stopped container keeps its
    /// state directory until deleted).
    #[test]
    fn a_vanished_cgroup_ends_it_when_no_state_directory_is_known() {
        let tmp = TestDir::new();
        let (dirs, a, dir) = leased_to_c1(&tmp, "l3");
        let cgroup = tmp.path().join("cgroup/c1");
        let state = tmp.path().join("runc/c1");
        std::fs::create_dir_all(&cgroup).unwrap();
        std::fs::create_dir_all(&state).unwrap();
        // Past the grace of every owner record this test writes (it rewrites the record below).
        let later = SystemTime::now() + 2 * STATE_GRACE;
        let mut owner = Owner {
            container: ContainerIdentity { container_id: Some("c1".into()), ..Default::default() },
            cgroup: Some(cgroup.display().to_string()),
            runtime_state: Some(state.display().to_string()),
        };
        owner.write(&dir).unwrap();
        std::fs::remove_dir(&cgroup).unwrap();
        assert_eq!(ended(&a, &dirs, later), None, "its state directory is there: stopped, not deleted");
        owner.runtime_state = None;
        owner.write(&dir).unwrap();
        assert_eq!(ended(&a, &dirs, SystemTime::now()), None, "within the grace");
        assert!(ended(&a, &dirs, later).is_some_and(|w| w.contains("its cgroup") && w.contains("does not exist")));
        std::fs::create_dir_all(&cgroup).unwrap();
        assert_eq!(ended(&a, &dirs, later), None);
        // A record naming another container never ends this one's lease.
        owner.container.container_id = Some("c2".into());
        std::fs::remove_dir(&cgroup).unwrap();
        owner.write(&dir).unwrap();
        assert_eq!(ended(&a, &dirs, later), None);
    }
}
