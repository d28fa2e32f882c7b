//! Records and what is on disk brought back together: at start, every stored allocation's
//! directory (and ledger view) made again where it is missing and a trace left running stopped;
//! as containers start, what the hook or the runtime wrapper recorded of them (`owner`) copied
//! into their records.

use std::collections::HashSet;

use super::DaemonAllocator;

/// What `adopt_owner_records` follows: the unnamed allocations' directories, as of the store's
/// change count `changes`.
#[derive(Debug, Default)]
pub(super) struct OwnerWatch {
    events: crate::state::dir_events::DirEvents,
    changes: Option<u64>,
}

impl DaemonAllocator {
    /// Brings every stored allocation's directory back where it is missing (after a reboot
    /// cleared the runtime dir); directories present are left alone (their containers run),
    /// but a trace left running in their region is stopped.
    /// Returns how many records there are.
    pub fn reconcile(&self) -> usize {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // After a journal loss, a record whose directory is gone while others' survived may be
        // one released before the damage (its removal was in what was lost): it is kept (a
        // held allocation must not be dropped on a guess) and said, so an operator can release it.
        let runtime_survived = store.loss().is_some() && store.list().any(|a| self.dirs.limits_path(&a.id).exists());
        for alloc in store.list() {
            if !self.dirs.limits_path(&alloc.id).exists() {
                if runtime_survived {
                    tracing::error!(
                        id = %alloc.id,
                        "after the journal's damage, allocation {} is in its records but its directory was gone \
                         while others' remain: it may have been released before; kept (`tessera release {}` if \
                         nothing holds it)",
                        alloc.id,
                        alloc.id
                    );
                }
                if let Err(e) = self.dirs.create(alloc) {
                    tracing::error!(id = %alloc.id, error = %e, "cannot recreate the allocation directory");
                }
            }
            // A directory an older tesserad made has no ledger view: made now, before more of its
            // container's processes start (a process looks for it once).
            let ledger = self.dirs.ledger_path(&alloc.id);
            if self.dirs.dir(&alloc.id).is_dir()
                && ledger.symlink_metadata().is_err()
                && let Err(e) = tessera_region::ledger::Ledger::create(&ledger)
            {
                tracing::warn!(id = %alloc.id, error = %e, "cannot make the allocation's ledger view");
            }
            // A trace that a previous daemon did not finish (it died mid-trace) stops here: no
            // one is reading the ring, and recording costs every launch.
            if let Ok(region) = tessera_region::Region::open_or_create(&self.dirs.region_path(&alloc.id))
                && region.trace_requested()
            {
                region.set_trace_requested(false);
                tracing::info!(id = %alloc.id, "stopped a trace left running by an earlier daemon");
            }
        }
        store.len()
    }

    /// Fills what allocations do not know of their container from the records the hook or the
    /// runtime wrapper left in their directories (`owner`: the runtime's container id, and the
    /// pod from a CRI runtime's annotations); what is known already (from the kubelet's
    /// pod-resources API) is kept. Returns how many allocations changed.
    ///
    /// Only the directories written into since the last pass are read (inotify; each once when
    /// first followed): the lease and pod-resources passes call this every second or two, and a
    /// thousand unused allocations were a thousand failed opens each time.
    pub fn adopt_owner_records(&self) -> usize {
        let mut watch = self.owner_watch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let OwnerWatch { events, changes } = &mut *watch;
        // Known values are kept, and a record always names its container: an allocation that
        // knows its container id has nothing to learn from it (not followed).
        let (now, unnamed) = self.allocations_changed_since(*changes, |records| {
            records.iter().filter(|a| a.container.container_id.is_none()).map(|a| a.id.clone()).collect::<Vec<_>>()
        });
        let mut to_read: HashSet<String> = HashSet::new();
        if let Some(ids) = unnamed {
            *changes = Some(now);
            to_read.extend(events.follow(&self.dirs, ids.iter().map(String::as_str)));
        }
        to_read.extend(events.changed());
        let mut changed = 0;
        for id in to_read {
            let alloc = {
                let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                store.get(&id).filter(|a| a.container.container_id.is_none()).cloned()
            };
            let Some(alloc) = alloc else { continue };
            let Some(owner) = tessera_region::owner::Owner::read(&self.dirs.dir(&alloc.id)) else { continue };
            let mut c = alloc.container.clone();
            let fill = |field: &mut Option<String>, value: Option<String>| {
                if field.is_none() {
                    *field = value;
                }
            };
            fill(&mut c.container_id, owner.container.container_id);
            fill(&mut c.pod_namespace, owner.container.pod_namespace);
            fill(&mut c.pod_name, owner.container.pod_name);
            fill(&mut c.pod_uid, owner.container.pod_uid);
            fill(&mut c.container_name, owner.container.container_name);
            match self.set_container(&alloc.id, c) {
                Ok(true) => changed += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(id = %alloc.id, error = %e, "cannot name the allocation from its owner record")
                }
            }
        }
        changed
    }
}
