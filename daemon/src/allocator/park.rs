//! Park and resume of an allocation (issue 33): the core's operation over [`crate::park`]'s
//! mechanism. The allocation's processes are those that joined its accounting region (their
//! host pids, as enforcement finds them); the region's `park_state` is written around each step
//! so the shim's books show the memory as parked, not used. One park or resume per allocation at
//! a time: the state is taken (`parking` / `resuming`) before the driver is called.
//!
//! Not yet here (issue 33): the state journalled on disk before a park starts and recovered at
//! start, parked memory counted as free by admission, preemption, events and metrics. A parked
//! allocation's state lives in this process only: a restarted tesserad sees it as running.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tessera_region::region::{ParkState, Region};
use tonic::Status;

use super::DaemonAllocator;
use crate::park::{Checkpointer, ParkError};

/// How long a park waits for the processes' GPU work to finish when the caller gives no timeout.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// The allocations not running: parking, parked or resuming, with their processes.
#[derive(Debug, Default)]
pub struct Parking {
    entries: Mutex<HashMap<String, Entry>>,
}

#[derive(Debug, Clone)]
struct Entry {
    state: ParkState,
    pids: Vec<u32>,
    bytes: u64,
}

/// What a park or resume did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkOutcome {
    pub state: ParkState,
    /// Device memory moved, bytes (the region's books of its processes).
    pub bytes: u64,
    pub duration: Duration,
    pub pids: Vec<u32>,
}

impl Parking {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A driver's refusal as the node API answers it: the caller's to fix (FAILED_PRECONDITION),
/// unless the API itself is missing.
fn refused(id: &str, what: &str, e: ParkError) -> Status {
    match e {
        ParkError::Library { .. } => Status::unavailable(format!("cannot {what} allocation {id}: {e}")),
        ParkError::Driver { .. } => Status::failed_precondition(format!("cannot {what} allocation {id}: {e}")),
    }
}

fn state_name(s: ParkState) -> &'static str {
    match s {
        ParkState::Running => "running",
        ParkState::Parking => "parking",
        ParkState::Parked => "parked",
        ParkState::Resuming => "resuming",
    }
}

impl DaemonAllocator {
    /// Where allocation `id`'s memory is (running when it was never parked).
    pub fn park_state(&self, id: &str) -> ParkState {
        self.parking.lock().get(id).map_or(ParkState::Running, |e| e.state)
    }

    fn known(&self, id: &str) -> Result<(), Status> {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if store.get(id).is_none() {
            return Err(Status::not_found(format!(
                "no allocation {id}; `tessera allocations` lists the allocations of this node"
            )));
        }
        Ok(())
    }

    /// The processes of allocation `id` (host pids of its region's live slots; dead ones reaped)
    /// and what they hold on its devices, bytes. No region yet: none.
    fn processes(&self, id: &str) -> Result<(Option<Region>, Vec<u32>, u64), Status> {
        let path = self.dirs.region_path(id);
        // Only an existing region: opening must not create one.
        if !path.exists() {
            return Ok((None, Vec::new(), 0));
        }
        let region = Region::open_or_create(&path).map_err(|e| {
            Status::internal(format!("allocation {id}: cannot open its region {}: {e}", path.display()))
        })?;
        let snapshot = region.reap_and_snapshot();
        let pids = region.pids().into_iter().map(|(pid, host)| if host != 0 { host } else { pid }).collect();
        let bytes = snapshot.devices.iter().map(|d| d.used).sum();
        Ok((Some(region), pids, bytes))
    }

    /// Parks allocation `id`: every process of it locked (within `lock_timeout`) and checkpointed
    /// by `ck`, all or none. NOT_FOUND for an unknown id; FAILED_PRECONDITION when it is not
    /// running, has no process, or the driver refuses one (the program then runs on).
    pub fn park(&self, id: &str, ck: &Checkpointer, lock_timeout: Duration) -> Result<ParkOutcome, Status> {
        self.known(id)?;
        {
            let mut entries = self.parking.lock();
            if let Some(e) = entries.get(id) {
                return Err(Status::failed_precondition(format!(
                    "allocation {id} is {}, not running; only a running allocation can be parked",
                    state_name(e.state)
                )));
            }
            entries.insert(id.to_owned(), Entry { state: ParkState::Parking, pids: Vec::new(), bytes: 0 });
        }
        let result = self.park_taken(id, ck, lock_timeout);
        let mut entries = self.parking.lock();
        match &result {
            Ok(done) => {
                entries.insert(id.to_owned(), Entry { state: done.state, pids: done.pids.clone(), bytes: done.bytes });
            }
            Err(_) => {
                entries.remove(id);
            }
        }
        result
    }

    fn park_taken(&self, id: &str, ck: &Checkpointer, lock_timeout: Duration) -> Result<ParkOutcome, Status> {
        let (region, pids, bytes) = self.processes(id)?;
        let Some(region) = region.filter(|_| !pids.is_empty()) else {
            return Err(Status::failed_precondition(format!(
                "allocation {id} has no process: none has joined its region; only a running CUDA program \
                 started with the allocation's environment can be parked"
            )));
        };
        region.set_park_state(ParkState::Parking);
        match ck.park(&pids, Some(lock_timeout)) {
            Ok(duration) => {
                region.set_park_state(ParkState::Parked);
                Ok(ParkOutcome { state: ParkState::Parked, bytes, duration, pids })
            }
            Err(e) => {
                region.set_park_state(ParkState::Running);
                Err(refused(id, "park", e))
            }
        }
    }

    /// Resumes allocation `id`: its processes restored and unlocked by `ck`, all or none.
    /// NOT_FOUND for an unknown id; FAILED_PRECONDITION when it is not parked, or when its
    /// memory does not fit on the GPU now (it stays parked; the message says how much it needs).
    pub fn resume(&self, id: &str, ck: &Checkpointer) -> Result<ParkOutcome, Status> {
        self.known(id)?;
        let entry = {
            let mut entries = self.parking.lock();
            let Some(e) = entries.get_mut(id).filter(|e| e.state == ParkState::Parked) else {
                let now = entries.get(id).map_or(ParkState::Running, |e| e.state);
                return Err(Status::failed_precondition(format!(
                    "allocation {id} is {}, not parked; nothing to resume",
                    state_name(now)
                )));
            };
            e.state = ParkState::Resuming;
            e.clone()
        };
        let (region, _, _) = self.processes(id)?;
        if let Some(r) = &region {
            r.set_park_state(ParkState::Resuming);
        }
        let result = ck.resume(&entry.pids);
        let mut entries = self.parking.lock();
        match result {
            Ok(duration) => {
                if let Some(r) = &region {
                    r.set_park_state(ParkState::Running);
                }
                entries.remove(id);
                Ok(ParkOutcome { state: ParkState::Running, bytes: entry.bytes, duration, pids: entry.pids })
            }
            Err(e) => {
                if let Some(r) = &region {
                    r.set_park_state(ParkState::Parked);
                }
                if let Some(back) = entries.get_mut(id) {
                    back.state = ParkState::Parked;
                }
                let gib = entry.bytes as f64 / f64::from(1u32 << 30);
                Err(Status::failed_precondition(format!(
                    "{} (it needs {gib:.2} GiB back on its GPU; it stays parked)",
                    refused(id, "resume", e).message()
                )))
            }
        }
    }
}
