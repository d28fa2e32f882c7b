//! Park and resume of an allocation (issue 33): the core's operation over [`crate::park`]'s
//! mechanism. The allocation's processes are those that joined its accounting region (their
//! host pids, as enforcement finds them); the region's `park_state` is written around each step
//! so the shim's books show the memory as parked, not used. One park or resume per allocation at
//! a time: the state is taken (`parking` / `resuming`) before the driver is called.
//!
//! Crash safety: the state is journalled before the driver is called, one small file per
//! allocation in `<state_dir>/park/<id>` (JSON, then its CRC-32 on a second line; written whole
//! and durably): `parking` with the pids before a park, `parked` once every process is
//! checkpointed, `resuming` before a resume, removed once running. At start
//! ([`DaemonAllocator::recover_parks`]) a park journalled as done is finished (processes left
//! parked), anything else is rolled back to running: no process is left locked. A damaged file
//! is moved aside and said.
//!
//! Admission: a parked allocation's memory is free for the node API's shares
//! ([`DaemonAllocator::beside_parked`]), and a resume is admitted again against every record not
//! parked. Not yet here (issue 33): the kubelet's and DRA's admission.
//!
//! Preemption (`super::preempt`) parks through [`DaemonAllocator::park_for`], the entry and the
//! journal naming the allocation it made room for; such a park is resumed by
//! [`DaemonAllocator::resume_preempted`] once it fits again, an operator's never.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tessera_region::region::{ParkState, Region};
use tonic::Status;

use super::DaemonAllocator;
use crate::carve::{self, GpuRoom};
use crate::park::{Checkpointer, ParkError};
use crate::procfs::ProcFs;
use crate::state::Store;

/// How long a park waits for the processes' GPU work to finish when the caller gives no timeout.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// The allocations not running: parking, parked or resuming, with their processes.
#[derive(Debug, Default)]
pub struct Parking {
    entries: Mutex<HashMap<String, Entry>>,
    /// Parks and resumes done since the daemon started.
    totals: Mutex<ParkMetrics>,
}

/// What the metrics show of parking (`tessera_allocations_parked`, `tessera_park_*_total`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ParkMetrics {
    /// Allocations parked now.
    pub parked: u64,
    /// Parks and resumes done since the daemon started, their time and the bytes they moved.
    pub parks: u64,
    pub park_seconds: f64,
    pub park_bytes: u64,
    pub resumes: u64,
    pub resume_seconds: f64,
    pub resume_bytes: u64,
    /// Of the parks, those preemption did (`tessera_preemptions_total`).
    pub preemptions: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    state: ParkState,
    pids: Vec<u32>,
    bytes: u64,
    /// Parked by preemption, for this allocation: resumed once it fits again
    /// ([`DaemonAllocator::resume_preempted`]); `None`: parked by an operator, resumed only when
    /// asked.
    preempted_by: Option<String>,
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

/// The checkpoint API from the library NVML came from: the driver's `libcuda.so.1` beside its
/// `libnvidia-ml.so.1`, or the simulated node's one library.
pub fn checkpoint_api(nvml_library: &Path) -> Result<Checkpointer, ParkError> {
    let cuda = match nvml_library.file_name().and_then(|n| n.to_str()) {
        Some(n) if n.starts_with("libnvidia-ml") => nvml_library.with_file_name("libcuda.so.1"),
        _ => nvml_library.to_path_buf(),
    };
    Checkpointer::load(&cuda)
}

/// One allocation's journalled park state, as `<state_dir>/park/<id>` holds it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JournalEntry {
    pub id: String,
    /// `parking`, `parked` or `resuming`.
    pub state: String,
    pub pids: Vec<u32>,
    pub bytes: u64,
    /// Parked by preemption, for this allocation (absent: by an operator; in entries from
    /// before preemption too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted_by: Option<String>,
}

impl JournalEntry {
    /// The file's bytes: the JSON, a newline, its CRC-32 in hex, a newline.
    pub fn encode(&self) -> Vec<u8> {
        let json = serde_json::to_string(self).unwrap_or_default();
        format!("{json}\n{:08x}\n", crc32fast::hash(json.as_bytes())).into_bytes()
    }

    /// Reads a file's bytes back, checking its CRC and that it is about `id`.
    pub fn decode(id: &str, bytes: &[u8]) -> Result<JournalEntry, String> {
        let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8".to_owned())?;
        let mut lines = text.lines();
        let (Some(json), Some(crc)) = (lines.next(), lines.next()) else {
            return Err("cut short (no checksum line)".into());
        };
        let got = crc32fast::hash(json.as_bytes());
        if u32::from_str_radix(crc.trim(), 16).ok() != Some(got) {
            return Err(format!("checksum fails (crc32 {got:08x}, file says {crc:?})"));
        }
        let e: JournalEntry = serde_json::from_str(json).map_err(|e| format!("not a park entry: {e}"))?;
        if e.id != id || !matches!(e.state.as_str(), "parking" | "parked" | "resuming") {
            return Err(format!("entry for {:?} in state {:?} under the name {id}", e.id, e.state));
        }
        Ok(e)
    }
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

/// A park the driver refused; one whose lock timed out says how long it waited.
fn lock_refused(id: &str, e: ParkError, lock_timeout: Duration) -> Status {
    let timed_out = matches!(e, ParkError::Driver { code: crate::park::CUDA_ERROR_NOT_READY, .. });
    let status = refused(id, "park", e);
    if timed_out {
        Status::failed_precondition(format!("{}; lock timeout: {lock_timeout:?}", status.message()))
    } else {
        status
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
    fn journal_dir(&self) -> PathBuf {
        self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).dir().join("park")
    }

    /// Writes allocation `id`'s park state durably before the step it announces.
    fn journal(
        &self,
        id: &str,
        state: ParkState,
        pids: &[u32],
        bytes: u64,
        preempted_by: Option<&str>,
    ) -> Result<(), Status> {
        let dir = self.journal_dir();
        let entry = JournalEntry {
            id: id.to_owned(),
            state: state_name(state).to_owned(),
            pids: pids.to_vec(),
            bytes,
            preempted_by: preempted_by.map(str::to_owned),
        };
        std::fs::create_dir_all(&dir)
            .and_then(|()| crate::state::durable::write_file(&dir.join(id), &entry.encode(), 0o600))
            .map_err(|e| {
                Status::internal(format!("allocation {id}: cannot journal its park state in {}: {e}", dir.display()))
            })
    }

    fn unjournal(&self, id: &str) {
        let path = self.journal_dir().join(id);
        if let Err(e) = std::fs::remove_file(&path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(%id, error = %e, path = %path.display(), "cannot remove the park journal entry");
        }
    }

    /// At start: what a killed tesserad left half-done is finished or rolled back, so that no
    /// process is left locked: a park journalled as done stays parked (its locked processes
    /// checkpointed), a park or resume in flight goes back to running. `api` is loaded only when
    /// the journal holds something. Returns the allocations left parked.
    pub fn recover_parks(&self, api: impl FnOnce() -> Result<Checkpointer, ParkError>) -> Vec<String> {
        let dir = self.journal_dir();
        let Ok(names) = std::fs::read_dir(&dir) else { return Vec::new() };
        let mut entries = Vec::new();
        for name in names.flatten() {
            let id = name.file_name().to_string_lossy().into_owned();
            if crate::state::record::valid_id(&id).is_err() {
                continue; // a temporary file of an interrupted write, or a set-aside one
            }
            let path = name.path();
            match std::fs::read(&path).map_err(|e| e.to_string()).and_then(|b| JournalEntry::decode(&id, &b)) {
                Ok(e) => entries.push(e),
                Err(why) => {
                    let aside = crate::state::durable::move_aside(&path);
                    tracing::error!(%id, %why, aside = ?aside, "park journal entry damaged, moved aside: its processes may stay locked; check them with the driver");
                }
            }
        }
        if entries.is_empty() {
            return Vec::new();
        }
        let ck = match api() {
            Ok(ck) => ck,
            Err(e) => {
                tracing::error!(error = %e, "park journal entries left, but no checkpoint API to finish them");
                return Vec::new();
            }
        };
        let mut parked = Vec::new();
        for e in entries {
            let done = e.state == "parked" && self.known(&e.id).is_ok();
            let region = self.processes(&e.id).ok().and_then(|(r, _, _)| r);
            match ck.recover(&e.pids, done) {
                Ok(left) if done && !left.is_empty() => {
                    if let Some(r) = &region {
                        r.set_park_state(ParkState::Parked);
                    }
                    tracing::info!(id = %e.id, pids = ?left, preempted_by = ?e.preempted_by, "park recovered: still parked");
                    let _ = self.journal(&e.id, ParkState::Parked, &left, e.bytes, e.preempted_by.as_deref());
                    let entry =
                        Entry { state: ParkState::Parked, pids: left, bytes: e.bytes, preempted_by: e.preempted_by };
                    self.parking.lock().insert(e.id.clone(), entry);
                    parked.push(e.id);
                }
                Ok(_) => {
                    if let Some(r) = &region {
                        r.set_park_state(ParkState::Running);
                    }
                    tracing::info!(id = %e.id, was = %e.state, "park recovered: running");
                    self.unjournal(&e.id);
                }
                Err(err) => tracing::error!(id = %e.id, error = %err, "park recovery failed; the entry is kept"),
            }
        }
        parked
    }

    /// Before the node API's `Release` (under the store's lock): refused while allocation `id`
    /// is parked, parking or resuming with a process of it alive (it would stay locked for
    /// good); with none alive its park state and journal entry go with it.
    pub(super) fn check_release_parked(&self, store: &Store, id: &str) -> Result<(), Status> {
        let mut entries = self.parking.lock();
        let Some(e) = entries.get(id) else { return Ok(()) };
        let alive: Vec<u32> = e.pids.iter().copied().filter(|p| Path::new(&format!("/proc/{p}")).exists()).collect();
        if e.state != ParkState::Parked || !alive.is_empty() {
            return Err(Status::failed_precondition(format!(
                "allocation {id} is {} with processes {alive:?} locked by the park: `tessera resume {id}` first, \
                 or end those processes, then release it",
                state_name(e.state)
            )));
        }
        entries.remove(id);
        // Not `unjournal`: the caller holds the store's lock.
        let path = store.dir().join("park").join(id);
        if let Err(e) = std::fs::remove_file(&path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(%id, error = %e, path = %path.display(), "cannot remove the park journal entry");
        }
        Ok(())
    }

    /// Forgets the parks of allocations released by another way in than the node API's
    /// `Release` (a kubelet's record gone, a DRA claim unprepared) once none of their processes
    /// is alive: their state and journal entry go, so they neither count as parked nor wait to
    /// be resumed. One with a process still alive stays (it would be left locked); said once.
    pub fn forget_released(&self) {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut entries = self.parking.lock();
        let gone: Vec<String> = entries
            .iter()
            .filter(|(id, e)| e.state == ParkState::Parked && store.get(id).is_none())
            .filter(|(_, e)| e.pids.iter().all(|p| !Path::new(&format!("/proc/{p}")).exists()))
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            entries.remove(&id);
            let path = store.dir().join("park").join(&id);
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(%id, error = %e, path = %path.display(), "cannot remove the park journal entry");
            }
            tracing::info!(%id, "released while parked, its processes gone: its park is forgotten");
        }
    }

    /// Whether any allocation is parked, parking or resuming.
    pub fn any_parked(&self) -> bool {
        !self.parking.lock().is_empty()
    }

    /// Parking's figures for the metrics.
    pub fn park_metrics(&self) -> ParkMetrics {
        let parked = self.parking.lock().values().filter(|e| e.state == ParkState::Parked).count() as u64;
        let totals = *self.parking.totals.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        ParkMetrics { parked, ..totals }
    }

    fn count(&self, parked: bool, done: &ParkOutcome) {
        let mut t = self.parking.totals.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if parked {
            t.parks += 1;
            t.park_seconds += done.duration.as_secs_f64();
            t.park_bytes += done.bytes;
        } else {
            t.resumes += 1;
            t.resume_seconds += done.duration.as_secs_f64();
            t.resume_bytes += done.bytes;
        }
    }

    /// Where allocation `id`'s memory is (running when it was never parked).
    pub fn park_state(&self, id: &str) -> ParkState {
        self.parking.lock().get(id).map_or(ParkState::Running, |e| e.state)
    }

    /// The allocation whose `Allocate` parked allocation `id`, while it is parked by preemption.
    pub fn preempted_by(&self, id: &str) -> Option<String> {
        self.parking.lock().get(id).and_then(|e| e.preempted_by.clone())
    }

    /// The allocations parked, parking or resuming now.
    pub(super) fn parking_ids(&self) -> std::collections::HashSet<String> {
        self.parking.lock().keys().cloned().collect()
    }

    /// Whether an allocation parked by preemption waits to be resumed.
    pub fn has_preempted(&self) -> bool {
        self.parking.lock().values().any(|e| e.state == ParkState::Parked && e.preempted_by.is_some())
    }

    /// Notified when an operator's park frees memory (see [`Self::resume_preempted`]).
    pub fn parks_changed(&self) -> std::sync::Arc<tokio::sync::Notify> {
        std::sync::Arc::clone(&self.parks_changed)
    }

    /// The allocations parked by preemption now.
    pub(super) fn preempted(&self) -> Vec<String> {
        let entries = self.parking.lock();
        entries
            .iter()
            .filter(|(_, e)| e.state == ParkState::Parked && e.preempted_by.is_some())
            .map(|(id, _)| id.clone())
            .collect()
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

    /// Whether allocation `id`'s region has a live slot (dead ones reaped). No host pid is
    /// looked up (that may take a pass over `/proc`): preemption asks this of each candidate
    /// under the store's lock, and [`Self::processes`] resolves the pids of those it parks.
    pub(super) fn has_processes(&self, id: &str) -> bool {
        let path = self.dirs.region_path(id);
        path.exists()
            && Region::open_or_create(&path).is_ok_and(|r| {
                r.reap_and_snapshot();
                !r.pids().is_empty()
            })
    }

    /// The processes of allocation `id` (host pids of its region's live slots; dead ones reaped)
    /// and what they hold on its devices, bytes. No region yet: none. A slot names its process
    /// by the pid it has in its own PID namespace (a container's, not the host's: the driver
    /// would lock whichever host process has that number), so each is resolved to the host
    /// process that maps this region under that pid (`ProcFs::host_pids`).
    pub(super) fn processes(&self, id: &str) -> Result<(Option<Region>, Vec<u32>, u64), Status> {
        let path = self.dirs.region_path(id);
        // Only an existing region: opening must not create one.
        let Ok(file) = std::fs::metadata(&path) else {
            return Ok((None, Vec::new(), 0));
        };
        let region = Region::open_or_create(&path).map_err(|e| {
            Status::internal(format!("allocation {id}: cannot open its region {}: {e}", path.display()))
        })?;
        let snapshot = region.reap_and_snapshot();
        let pids = ProcFs::default().host_pids(&region.pids(), file.dev(), file.ino());
        let bytes = snapshot.devices.iter().map(|d| d.used).sum();
        Ok((Some(region), pids, bytes))
    }

    /// Parks allocation `id`: every process of it locked (within `lock_timeout`) and checkpointed
    /// by `ck`, all or none. NOT_FOUND for an unknown id; FAILED_PRECONDITION when it is not
    /// running, has no process, or the driver refuses one (the program then runs on).
    pub fn park(&self, id: &str, ck: &Checkpointer, lock_timeout: Duration) -> Result<ParkOutcome, Status> {
        self.park_for(id, ck, lock_timeout, None)
    }

    /// [`Self::park`], by preemption for allocation `preempted_by` when given (journalled with
    /// it, so that it is resumed once it fits again, after a restart too).
    pub(super) fn park_for(
        &self,
        id: &str,
        ck: &Checkpointer,
        lock_timeout: Duration,
        preempted_by: Option<&str>,
    ) -> Result<ParkOutcome, Status> {
        self.known(id)?;
        {
            let mut entries = self.parking.lock();
            if let Some(e) = entries.get(id) {
                return Err(Status::failed_precondition(format!(
                    "allocation {id} is {}, not running; only a running allocation can be parked",
                    state_name(e.state)
                )));
            }
            let by = preempted_by.map(str::to_owned);
            entries.insert(
                id.to_owned(),
                Entry { state: ParkState::Parking, pids: Vec::new(), bytes: 0, preempted_by: by },
            );
        }
        let result = self.park_taken(id, ck, lock_timeout, preempted_by);
        let mut entries = self.parking.lock();
        match &result {
            Ok(done) => {
                let by = preempted_by.map(str::to_owned);
                let entry = Entry { state: done.state, pids: done.pids.clone(), bytes: done.bytes, preempted_by: by };
                entries.insert(id.to_owned(), entry);
                self.count(true, done);
                drop(entries);
                if preempted_by.is_some() {
                    self.parking.totals.lock().unwrap_or_else(std::sync::PoisonError::into_inner).preemptions += 1;
                } else {
                    // An operator's park frees memory no record gives back: preempted
                    // allocations may fit again.
                    self.parks_changed.notify_one();
                }
                return result;
            }
            Err(_) => {
                entries.remove(id);
            }
        }
        result
    }

    fn park_taken(
        &self,
        id: &str,
        ck: &Checkpointer,
        lock_timeout: Duration,
        preempted_by: Option<&str>,
    ) -> Result<ParkOutcome, Status> {
        let (region, pids, bytes) = self.processes(id)?;
        let Some(region) = region.filter(|_| !pids.is_empty()) else {
            return Err(Status::failed_precondition(format!(
                "allocation {id} has no process: none has joined its region; only a running CUDA program \
                 started with the allocation's environment can be parked"
            )));
        };
        self.journal(id, ParkState::Parking, &pids, bytes, preempted_by)?;
        region.set_park_state(ParkState::Parking);
        let parked = ck.park(&pids, Some(lock_timeout)).map_err(|e| lock_refused(id, e, lock_timeout));
        let parked = parked.and_then(|duration| {
            // Parked only once the journal says so; else it is undone, never half-parked.
            if let Err(e) = self.journal(id, ParkState::Parked, &pids, bytes, preempted_by) {
                let _ = ck.resume(&pids);
                return Err(e);
            }
            Ok(duration)
        });
        match parked {
            Ok(duration) => {
                region.set_park_state(ParkState::Parked);
                Ok(ParkOutcome { state: ParkState::Parked, bytes, duration, pids })
            }
            Err(e) => {
                region.set_park_state(ParkState::Running);
                self.unjournal(id);
                Err(e)
            }
        }
    }

    /// Memory of the parked allocations (but `except`) on GPU `gpu`, bytes: free for admission
    /// while they are parked. `entries` is the parking table, taken under the store's lock.
    fn parked_on(entries: &HashMap<String, Entry>, store: &Store, gpu: &GpuRoom, except: Option<&str>) -> u64 {
        entries
            .iter()
            .filter(|(id, e)| e.state == ParkState::Parked && Some(id.as_str()) != except)
            .filter_map(|(id, _)| store.get(id))
            .flat_map(|a| a.devices.iter())
            .filter(|d| d.physical_uuid.eq_ignore_ascii_case(&gpu.uuid))
            .map(|d| d.holds().0.unwrap_or(gpu.memory_total))
            .sum()
    }

    /// What the records hold on `gpu` (`held`), less the parked allocations' memory.
    pub(super) fn beside_parked(&self, store: &Store, gpu: &GpuRoom, held: carve::Held) -> carve::Held {
        let parked = Self::parked_on(&self.parking.lock(), store, gpu, None);
        carve::Held { memory: held.memory.saturating_sub(parked), ..held }
    }

    /// Resumes allocation `id`: its processes restored and unlocked by `ck`, all or none.
    /// Admitted first against `rooms`: its memory must fit again beside every record not parked
    /// (what was admitted into its room while it was parked). NOT_FOUND for an unknown id;
    /// FAILED_PRECONDITION when it is not parked, when it does not fit (saying the GiB it needs
    /// and those free, on which GPU), or when the driver finds no room; it then stays parked.
    pub fn resume(&self, id: &str, ck: &Checkpointer, rooms: &[GpuRoom]) -> Result<ParkOutcome, Status> {
        let entry = {
            let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let Some(record) = store.get(id) else {
                return Err(Status::not_found(format!(
                    "no allocation {id}; `tessera allocations` lists the allocations of this node"
                )));
            };
            let mut entries = self.parking.lock();
            let now = entries.get(id).map_or(ParkState::Running, |e| e.state);
            if now != ParkState::Parked {
                return Err(Status::failed_precondition(format!(
                    "allocation {id} is {}, not parked; nothing to resume",
                    state_name(now)
                )));
            }
            for d in &record.devices {
                let Some(gpu) = rooms.iter().find(|g| g.uuid.eq_ignore_ascii_case(&d.physical_uuid)) else { continue };
                let held = carve::held_in(gpu, store.loads(), Some(record)).memory;
                let held = held.saturating_sub(Self::parked_on(&entries, &store, gpu, Some(id)));
                let need = d.holds().0.unwrap_or(gpu.memory_total);
                let free = gpu.memory_total.saturating_sub(held);
                if need > free {
                    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
                    return Err(Status::failed_precondition(format!(
                        "allocation {id} does not fit on GPU {} ({}) now: it needs {:.2} GiB, {:.2} GiB are free beside \
                         the other allocations; release or park some, then resume again (it stays parked)",
                        gpu.index,
                        gpu.uuid,
                        gib(need),
                        gib(free)
                    )));
                }
            }
            // Taken as resuming under the store's lock: from here its room counts as held.
            let e = entries.get_mut(id).expect("parked, checked above");
            e.state = ParkState::Resuming;
            e.clone()
        };
        let (region, _, _) = self.processes(id).unwrap_or((None, Vec::new(), 0));
        let by = entry.preempted_by.as_deref();
        if let Err(e) = self.journal(id, ParkState::Resuming, &entry.pids, entry.bytes, by) {
            if let Some(back) = self.parking.lock().get_mut(id) {
                back.state = ParkState::Parked;
            }
            return Err(e);
        }
        if let Some(r) = &region {
            r.set_park_state(ParkState::Resuming);
        }
        // A process killed while parked has nothing to restore (its host copy went with it): the
        // others resume, and with none left the allocation simply runs again (empty).
        let live: Vec<u32> = entry.pids.iter().copied().filter(|p| Path::new(&format!("/proc/{p}")).exists()).collect();
        let resumed = if live.is_empty() { Ok(Duration::ZERO) } else { ck.resume(&live) };
        match resumed {
            Ok(duration) => {
                if let Some(r) = &region {
                    r.set_park_state(ParkState::Running);
                }
                self.unjournal(id);
                self.parking.lock().remove(id);
                let done = ParkOutcome { state: ParkState::Running, bytes: entry.bytes, duration, pids: live };
                self.count(false, &done);
                Ok(done)
            }
            Err(e) => {
                if let Some(r) = &region {
                    r.set_park_state(ParkState::Parked);
                }
                let _ = self.journal(id, ParkState::Parked, &entry.pids, entry.bytes, by);
                if let Some(back) = self.parking.lock().get_mut(id) {
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
