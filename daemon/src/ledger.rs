//! Priorities and lending between containers, told by the daemon: every 10 ms, each allocation
//! on a GPU where someone needs to know gets its view of the others there
//! (`tessera_region::ledger`): whether a high-priority neighbour launched, and what the others
//! used. The priority of each comes from its record, what it did from its own region; the view is
//! written into `ledger` in the allocation's directory, which the container only reads. So no
//! tenant can claim a priority it was not granted, nor speak for another (docs/security.md).
//!
//! Only GPUs with a reader are published: an allocation of low priority (it yields) or in
//! work-conserving mode (it borrows). A node without one costs a store check every 250 ms.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tessera_region::ledger::{Ledger, LedgerError, Member, Publisher};
use tessera_region::{ComputeMode, Priority, Region, monotonic_ns};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::allocator::DaemonAllocator;
use crate::state::{AllocDirs, Allocation};

/// How often views are published while a GPU has a reader (the shim's high-priority window is
/// 50 ms: a neighbour's launches are told within a fifth of it).
pub const PUBLISH_EVERY: Duration = Duration::from_millis(10);
/// How often the records are looked at while no GPU has a reader.
pub const IDLE_EVERY: Duration = Duration::from_millis(250);

/// An allocation being published: its files, open, and its devices as its record grants them.
struct Open {
    region: Region,
    ledger: Ledger,
    devices: Vec<(String, Priority)>,
}

/// The publishing loop's state: what is open, and what the publisher remembers.
#[derive(Default)]
pub struct Publishing {
    open: HashMap<String, Open>,
    /// The records that matter, as of the store's change count `changes`.
    members: Vec<Allocation>,
    changes: Option<u64>,
    publisher: Publisher,
    /// Allocations whose files could not be opened, warned about once.
    warned: HashSet<String>,
    /// Some member is not open yet: the records changed, or an open failed (tried every pass).
    to_open: bool,
}

impl Publishing {
    pub fn new() -> Publishing {
        Publishing::default()
    }

    /// One pass: follows the records if they changed, publishes every view that has a reader.
    /// Returns whether anything was published (the loop's pace).
    pub fn pass(&mut self, allocator: &DaemonAllocator, now_ns: u64) -> bool {
        let (changes, members) = allocator.allocations_changed_since(self.changes, with_readers);
        if let Some(members) = members {
            self.changes = Some(changes);
            self.members = members;
            let live: HashSet<&str> = self.members.iter().map(|a| a.id.as_str()).collect();
            self.open.retain(|id, _| live.contains(id.as_str()));
            self.warned.retain(|id| live.contains(id.as_str()));
            for a in &self.members {
                if let Some(o) = self.open.get_mut(&a.id) {
                    o.devices = devices_of(a);
                }
            }
            self.to_open = true;
        }
        if self.members.is_empty() {
            return false;
        }
        if self.to_open {
            self.to_open = false;
            let dirs = allocator.dirs();
            for a in &self.members {
                if self.open.contains_key(&a.id) {
                    continue;
                }
                match open(dirs, a) {
                    Ok(o) => {
                        self.warned.remove(&a.id);
                        self.open.insert(a.id.clone(), o);
                    }
                    Err(e) => {
                        self.to_open = true;
                        if self.warned.insert(a.id.clone()) {
                            tracing::warn!(allocation = %a.id, "ledger: {e}; its containers see no neighbours");
                        }
                    }
                }
            }
        }
        let members: Vec<Member> = self
            .open
            .iter()
            .map(|(id, o)| Member { id, region: &o.region, ledger: &o.ledger, devices: &o.devices })
            .collect();
        self.publisher.publish(now_ns, &members);
        true
    }
}

/// The allocations on GPUs where someone reads the ledger: a low-priority or work-conserving
/// allocation there, and everyone it shares the GPU with. Copied only then: a node without a
/// reader copies no record when they change (1,000 of them at every Allocate otherwise).
fn with_readers(records: &[&Allocation]) -> Vec<Allocation> {
    let read_on: HashSet<String> = records
        .iter()
        .flat_map(|a| &a.devices)
        .filter(|d| d.priority == Priority::Low || d.compute_mode == ComputeMode::WorkConserving)
        .map(|d| d.physical_uuid.to_ascii_lowercase())
        .collect();
    if read_on.is_empty() {
        return Vec::new();
    }
    records
        .iter()
        .filter(|a| a.devices.iter().any(|d| read_on.contains(&d.physical_uuid.to_ascii_lowercase())))
        .map(|&a| a.clone())
        .collect()
}

/// Each device the container sees, with the priority its record grants there.
fn devices_of(a: &Allocation) -> Vec<(String, Priority)> {
    a.devices.iter().map(|d| (d.physical_uuid.clone(), d.priority)).collect()
}

/// Opens an allocation's region and view; a view that is missing (a directory made by an older
/// tesserad) or damaged is made anew: it holds nothing that is not published again.
fn open(dirs: &AllocDirs, a: &Allocation) -> Result<Open, String> {
    let region_path = dirs.region_path(&a.id);
    // Only an existing region: a missing one would be created here, for an allocation being removed.
    if !region_path.exists() {
        return Err(format!("{}: no region file", region_path.display()));
    }
    let region = Region::open_or_create(&region_path).map_err(|e| e.to_string())?;
    let path = dirs.ledger_path(&a.id);
    let ledger = match Ledger::open_rw(&path) {
        Ok(l) => l,
        Err(e) => {
            if !matches!(&e, LedgerError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound) {
                tracing::warn!(allocation = %a.id, "ledger: {e}");
            }
            Ledger::create(&path).map_err(|e| e.to_string())?
        }
    };
    Ok(Open { region, ledger, devices: devices_of(a) })
}

/// The loop: publishes every [`PUBLISH_EVERY`] while a GPU has a reader, else looks again every
/// [`IDLE_EVERY`]. Ends at shutdown.
pub fn spawn(allocator: Arc<DaemonAllocator>, mut shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut state = Publishing::new();
        loop {
            let busy = state.pass(&allocator, monotonic_ns());
            tokio::select! {
                () = tokio::time::sleep(if busy { PUBLISH_EVERY } else { IDLE_EVERY }) => {}
                _ = shutdown.changed() => return,
            }
            if *shutdown.borrow() {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;

    use super::*;
    use crate::allocator::LimitChange;
    use crate::allocator::tests::{allocator, rooms, share};
    use crate::config::Placement;

    /// The container's side, as the shim does it: its region names the device, and a
    /// high-priority launch bumps the count the daemon watches.
    fn launch(dirs: &AllocDirs, id: &str, uuid: &str) {
        let region = Region::open_or_create(&dirs.region_path(id)).unwrap();
        let dev = region.device(uuid).unwrap();
        region.bucket(dev).high_launches.fetch_add(1, Relaxed);
    }

    fn high_seen(dirs: &AllocDirs, id: &str, uuid: &str) -> u64 {
        let view = Ledger::open_ro(&dirs.ledger_path(id)).unwrap();
        let region = Region::open_or_create(&dirs.region_path(id)).unwrap();
        let dev = region.device(uuid).unwrap();
        view.view(region.device_key(dev)).map_or(0, |v| v.high_seen())
    }

    #[test]
    fn a_low_priority_allocation_is_told_of_its_high_priority_neighbour_by_the_record() {
        let tmp = crate::state::mount::TestDir::new();
        let a = allocator(tmp.path(), Placement::Packed);
        let dirs = a.dirs().clone();
        let online = a.allocate_share(&share(1, 30, "0"), &rooms()).unwrap();
        let offline = a.allocate_share(&share(1, 30, "0"), &rooms()).unwrap();
        let (on, off) = (online.id.as_str(), offline.id.as_str());
        for id in [on, off] {
            assert!(dirs.ledger_path(id).exists(), "every allocation directory has its view");
            launch(&dirs, id, "GPU-a");
        }
        let mut p = Publishing::new();
        assert!(!p.pass(&a, 1), "both normal and strict: nobody reads, nothing is published");

        a.set_limits(on, LimitChange { priority: Some(Priority::High), ..Default::default() }, &rooms()).unwrap();
        a.set_limits(off, LimitChange { priority: Some(Priority::Low), ..Default::default() }, &rooms()).unwrap();
        assert!(p.pass(&a, 2), "a low-priority allocation reads: GPU-a is published");
        launch(&dirs, on, "GPU-a");
        assert!(p.pass(&a, 3));
        assert_eq!(high_seen(&dirs, off, "GPU-a"), 1, "the high-priority neighbour's launch is told");
        assert_eq!(high_seen(&dirs, on, "GPU-a"), 0);

        // The low one launches as hard as it likes in its own region: its record says low.
        for t in 4..8 {
            launch(&dirs, off, "GPU-a");
            p.pass(&a, t);
        }
        assert_eq!(high_seen(&dirs, on, "GPU-a"), 0);

        // A view a host user or a crash damaged is made anew, and published into again.
        a.release(off).unwrap();
        let third = a.allocate_share(&share(1, 30, "0"), &rooms()).unwrap();
        a.set_limits(&third.id, LimitChange { priority: Some(Priority::Low), ..Default::default() }, &rooms()).unwrap();
        std::fs::write(dirs.ledger_path(&third.id), b"scribbled").unwrap();
        p.pass(&a, 10);
        launch(&dirs, on, "GPU-a");
        launch(&dirs, &third.id, "GPU-a");
        p.pass(&a, 11);
        assert_eq!(high_seen(&dirs, &third.id, "GPU-a"), 1);

        // A directory an older tesserad made, without a view: the next start makes one.
        std::fs::remove_file(dirs.ledger_path(on)).unwrap();
        a.reconcile();
        assert!(Ledger::open_ro(&dirs.ledger_path(on)).is_ok());
    }
}
