//! Enforcement from the driver's own numbers: the second line behind `libtessera.so`.
//!
//! The shim limits what an honest program allocates; a program that skips it (a raw `dlsym` of
//! the driver, a static binary, ioctls) is limited by nothing in the container. So tesserad
//! polls NVML's per-process memory on every GPU every `[enforcement] interval_ms` (default
//! 500 ms; [`sample`]), finds each process's allocation ([`attribution`]: its cgroup against the
//! container id of the allocation's record or owner record, else a region slot that the process
//! really maps), adds up each allocation's processes per device (GPU or MIG UUID: a share's
//! limit is its device's), and compares that with the limit in the daemon's own record, never
//! with anything a tenant can write. Over the limit ([`decision`]):
//!
//! - `action = "kill"`: the allocation's processes on that device are SIGKILLed newest first
//!   until it is under the limit ([`kill`], through a pidfd, so a reused pid is never hit); one
//!   `limit_breach` event per kill;
//! - `action = "report"`: a `limit_breach` event when the breach starts, when it changes
//!   materially (its processes, or a tenth of the limit), and when it ends.
//!
//! Only a process attributed to the breaching allocation is ever killed. A GPU process in no
//! container with an allocation, in no cgroup named with `tessera alloc --cgroup`, that maps no
//! allocation's region and was never seen attributed (a host process of an allocation made
//! without `--cgroup` that bypasses the shim, or a process of no allocation at all) cannot be
//! attributed: it is reported (an `unattributed_process` event and a warning, once per process)
//! and counted (`tessera_unattributed_gpu_processes`), never killed. Breaches are
//! counted per allocation and device in `tessera_container_limit_breaches_total`.
//!
//! A process that bypasses the shim thus holds more than its limit for at most one interval
//! plus a poll, and the kill itself (under 1 s at the default).
//!
//! There is no slack for honest programs: NVML's figure counts the GPU's 2 MiB pages, not the
//! bytes asked, and the shim charges linear memory the same way (`shim/src/memory/granularity.rs`),
//! so a program under the shim is refused before this figure passes its limit. A tolerance here
//! would let every process, shim or none, keep that much more.
//!
//! Each GPU's context size is measured by a probe of tesserad's own and published into the
//! allocations' directories ([`context_size`]), so the shim need not load NVML to measure it.
//!
//! SM time is judged the same way from NVML's per-process utilization ([`sm_time`]): a strict
//! share whose processes took more than its SM percent plus `sm_tolerance_percent` points of an
//! `sm_window_ms` window is a breach (`sm_action`, by default as `action`): its processes that do
//! not map its region are killed first, then the heaviest, until the rest fit.

pub mod attribution;
pub mod context_size;
pub mod decision;
pub mod kill;
pub mod sample;
pub mod sm_time;
mod stats;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_proto::tessera::v1 as api;
use tessera_region::Region;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use self::attribution::{FileId, Index, Recall, Seen};
use self::decision::{Decision, Group, GroupKey, Holding, Phase, ProcKey, Tracker};
pub use self::stats::{BreachCount, Metrics, OnDevice, SmTime, Stats};
pub use crate::config::enforcement::{Action, Settings};
use crate::node::{self, NodeController};
use crate::procfs::ProcFs;
use crate::state::Allocation;

/// What one poll did, for the bench and the log.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PollOutcome {
    /// Processes NVML listed.
    pub processes: usize,
    pub attributed: usize,
    pub unattributed: usize,
    pub killed: Vec<u32>,
    pub events: usize,
}

/// The enforcement loop.
pub struct Enforcer {
    controller: Arc<NodeController>,
    stats: Arc<Stats>,
    procfs: ProcFs,
    tracker: Tracker,
    /// The allocations each listed process was found to belong to.
    seen: Seen,
    /// Container ids from the owner records, by allocation id.
    owners: HashMap<String, String>,
    /// The cgroups node API callers named (`cgroup` in the allocation's directory), by
    /// allocation id.
    cgroups: HashMap<String, String>,
    /// Open regions and their files, by allocation id.
    regions: HashMap<String, (Region, FileId)>,
    /// GPUs NVML would not list, warned about once until they answer.
    failing: HashSet<u32>,
    /// SM time's windows.
    sm: sm_time::Watch,
    /// When each GPU's utilization was last read (µs since the epoch).
    utilization_read: HashMap<u32, u64>,
    /// GPUs whose utilization NVML would not give, warned about once until it does.
    utilization_failing: HashSet<u32>,
    /// The records as of the store's change count `changes`: copied only when they changed.
    allocations: Arc<Vec<Allocation>>,
    changes: Option<u64>,
    /// Their ids.
    live: Arc<HashSet<String>>,
    /// Each GPU's context size, measured and published into the allocations' directories.
    context: context_size::Publisher,
}

impl std::fmt::Debug for Enforcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enforcer").field("regions", &self.regions.len()).finish_non_exhaustive()
    }
}

impl Enforcer {
    pub fn new(controller: Arc<NodeController>, stats: Arc<Stats>) -> Enforcer {
        Enforcer {
            controller,
            stats,
            procfs: ProcFs::default(),
            tracker: Tracker::default(),
            seen: Seen::default(),
            owners: HashMap::new(),
            cgroups: HashMap::new(),
            regions: HashMap::new(),
            failing: HashSet::new(),
            sm: sm_time::Watch::default(),
            utilization_read: HashMap::new(),
            utilization_failing: HashSet::new(),
            allocations: Arc::new(Vec::new()),
            changes: None,
            live: Arc::new(HashSet::new()),
            context: context_size::Publisher::default(),
        }
    }

    /// Starts the loop; it reads `[enforcement]` from the configuration in effect at each poll
    /// (a reload applies at once) and stops within one interval of `shutdown`.
    pub fn spawn(
        controller: Arc<NodeController>,
        stats: Arc<Stats>,
        mut shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        tokio::task::spawn_blocking(move || {
            let mut enforcer = Enforcer::new(controller, stats);
            let s = enforcer.settings();
            tracing::info!(action = s.action.as_str(), interval_ms = s.interval_ms, "enforcement: polling NVML");
            if !enforcer.shim_injected() && s.sm_action.is_none() && s.action == Action::Kill {
                tracing::warn!(
                    "enforcement: injection.shim_path is empty, so containers get no limiter: SM time over a strict share is reported, not killed (set [enforcement] sm_action = \"kill\" to kill)"
                );
            }
            loop {
                let began = Instant::now();
                let settings = enforcer.settings();
                enforcer.poll(&settings);
                let next = began + Duration::from_millis(settings.interval_ms);
                // Sleep in slices so a stop is seen promptly.
                loop {
                    if *shutdown.borrow_and_update() || shutdown.has_changed().is_err() {
                        return;
                    }
                    let left = next.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    // A new allocation gets the context sizes within a slice, not a poll.
                    enforcer.publish_context_sizes();
                    std::thread::sleep(left.min(Duration::from_millis(50)));
                }
            }
        })
    }

    fn settings(&self) -> Settings {
        self.controller.view().config.enforcement.clone()
    }

    /// Whether containers get `libtessera.so` (`injection.shim_path` set).
    fn shim_injected(&self) -> bool {
        !self.controller.view().config.injection.shim_path.as_os_str().is_empty()
    }

    /// One poll: sample, attribute, decide, act, report.
    pub fn poll(&mut self, settings: &Settings) -> PollOutcome {
        let inventory = self.controller.view().inventory;
        let sample = sample::sample(self.controller.session().nvml(), &inventory);
        for (gpu, why) in &sample.failed {
            if self.failing.insert(*gpu) {
                tracing::warn!(gpu, error = %why, "enforcement: NVML does not list this GPU's processes; not enforced there");
            }
        }
        self.failing.retain(|g| sample.failed.iter().any(|(f, _)| f == g));
        let mut outcome = PollOutcome { processes: sample.processes.len(), ..Default::default() };

        let allocations = self.allocations();
        // With no process listed there is nothing to attribute: no owner record is read and no
        // index is built over every allocation (an idle poll's cost does not grow with them).
        let idle = sample.processes.is_empty();
        if !idle {
            self.refresh_owners(&allocations);
        }
        let mut index = Index::new(if idle { &[] } else { &allocations[..] }, &self.owners, &[]);
        let mut claims_loaded = false;

        let mut groups: BTreeMap<GroupKey, Group> = BTreeMap::new();
        let mut listed = HashSet::new();
        let mut unattributed: Vec<(ProcKey, &sample::GpuProcess)> = Vec::new();
        let probe = self.context.probe_pid();
        for p in &sample.processes {
            // tesserad's own context probe: of no allocation, gone in a moment.
            if Some(p.pid) == probe {
                continue;
            }
            // Gone between NVML's list and /proc: its memory is going with it.
            let Some(start) = self.procfs.start_time(p.pid) else { continue };
            listed.insert((p.pid, start));
            let cgroups = self.procfs.cgroup_paths(p.pid).unwrap_or_default();
            let procfs = &self.procfs;
            let mut owners = index.owners(p.pid, &cgroups, |f| procfs.maps_inode(p.pid, f.0, f.1));
            if owners.is_none() && !claims_loaded {
                // Only now are the named cgroups and the regions' slots worth reading.
                claims_loaded = true;
                let claims = self.claims(&allocations);
                self.refresh_cgroups(&allocations);
                index = Index::with_cgroups(&allocations, &self.owners, &claims, &self.cgroups);
                let procfs = &self.procfs;
                owners = index.owners(p.pid, &cgroups, |f| procfs.maps_inode(p.pid, f.0, f.1));
            }
            let owners = match owners {
                Some((owners, _via)) => {
                    self.seen.remember(&index, (p.pid, start), &owners);
                    owners
                }
                // Found before (an exiting process is listed after its mappings and region
                // slot are gone), while one of its allocations lives.
                None => match self.seen.recall(&index, (p.pid, start)) {
                    Recall::Owners(owners) => owners,
                    // Its allocations released as it exits: nothing to judge, nothing to say.
                    Recall::Released if self.procfs.exiting(p.pid) => continue,
                    Recall::Released | Recall::Never => {
                        unattributed.push(((p.pid, start), p));
                        continue;
                    }
                },
            };
            outcome.attributed += 1;
            let (holders, limit) = index.on_device(&owners, &p.device_uuid);
            let key = GroupKey {
                allocations: holders.iter().map(|&i| index.entry(i).id.clone()).collect(),
                device_uuid: p.device_uuid.clone(),
            };
            groups
                .entry(key.clone())
                .or_insert_with(|| Group { key, gpu_index: p.gpu_index, limit, processes: Vec::new() })
                .processes
                .push(Holding { pid: p.pid, start, used: p.used });
        }
        self.seen.retain_listed(&listed);
        let groups: Vec<Group> = groups.into_values().collect();
        for d in self.tracker.decide(settings.action, &groups, &listed) {
            outcome.events += 1;
            self.act(d, &allocations, &mut outcome);
        }
        let listed_gpus: HashSet<u32> =
            inventory.gpus.iter().map(|g| g.index).filter(|i| !sample.failed.iter().any(|(f, _)| f == i)).collect();
        self.judge_sm_time(settings, &groups, &allocations, &listed_gpus, &mut outcome);

        outcome.unattributed = unattributed.len();
        let keys: Vec<ProcKey> = unattributed.iter().map(|(k, _)| *k).collect();
        let fresh: HashSet<ProcKey> = self.tracker.new_unattributed(&keys).into_iter().collect();
        for (k, p) in unattributed.iter().filter(|(k, _)| fresh.contains(k)) {
            outcome.events += 1;
            self.report_unattributed(k.0, p);
        }
        self.stats.lock().unattributed_gpu_processes = unattributed.len() as u64;
        self.context.step(&self.controller, &allocations[..], self.changes);
        outcome
    }

    /// Writes the context sizes into allocations' directories that lack them (nothing when
    /// neither the records nor the sizes changed since the last time).
    pub fn publish_context_sizes(&mut self) {
        let allocations = self.allocations();
        self.context.publish(&self.controller, &allocations[..], self.changes);
    }

    /// The records, copied again only when the store changed; what was kept for allocations
    /// that are gone (owners, open regions) goes then.
    fn allocations(&mut self) -> Arc<Vec<Allocation>> {
        let (changes, fresh) = self
            .controller
            .allocator()
            .allocations_changed_since(self.changes, |records| records.iter().map(|&a| a.clone()).collect::<Vec<_>>());
        if let Some(records) = fresh {
            self.changes = Some(changes);
            let live: HashSet<String> = records.iter().map(|a| a.id.clone()).collect();
            self.owners.retain(|id, _| live.contains(id));
            self.regions.retain(|id, _| live.contains(id));
            self.allocations = Arc::new(records);
            self.live = Arc::new(live);
        }
        Arc::clone(&self.allocations)
    }

    /// Container ids from the owner records the hook wrote, for allocations whose record has
    /// none (read until one is found; an allocation's container does not change).
    fn refresh_owners(&mut self, allocations: &[Allocation]) {
        let live: HashSet<&str> = allocations.iter().map(|a| a.id.as_str()).collect();
        self.owners.retain(|id, _| live.contains(id.as_str()));
        self.cgroups.retain(|id, _| live.contains(id.as_str()));
        self.regions.retain(|id, _| live.contains(id.as_str()));
        let dirs = self.controller.allocator().dirs();
        for a in allocations {
            if a.container.container_id.is_some() || self.owners.contains_key(&a.id) {
                continue;
            }
            if let Some(c) = tessera_region::owner::Owner::read(&dirs.dir(&a.id)).and_then(|o| o.container.container_id)
            {
                self.owners.insert(a.id.clone(), c);
            }
        }
    }

    /// The cgroups named for node API allocations (read until found: the directory is made
    /// before the file is written, and a recorded cgroup does not change).
    fn refresh_cgroups(&mut self, allocations: &[Allocation]) {
        let dirs = self.controller.allocator().dirs();
        for a in allocations {
            if !matches!(a.source, crate::state::Source::NodeApi | crate::state::Source::Recovered)
                || self.cgroups.contains_key(&a.id)
            {
                continue;
            }
            if let Some(c) = attribution::read_cgroup(&dirs.dir(&a.id)) {
                self.cgroups.insert(a.id.clone(), c);
            }
        }
    }

    /// (allocation, host pid, region file) of every joined slot of every allocation's region.
    fn claims(&mut self, allocations: &[Allocation]) -> Vec<(String, u32, FileId)> {
        let dirs = self.controller.allocator().dirs();
        let mut out = Vec::new();
        for a in allocations {
            if !self.regions.contains_key(&a.id) {
                let path = dirs.region_path(&a.id);
                // Only an existing region: opening must not create one.
                let Ok(meta) = std::fs::metadata(&path) else { continue };
                match Region::open_or_create(&path) {
                    Ok(r) => {
                        self.regions.insert(a.id.clone(), (r, (meta.dev(), meta.ino())));
                    }
                    Err(e) => {
                        tracing::debug!(allocation = %a.id, error = %e, "enforcement: cannot open the region");
                        continue;
                    }
                }
            }
            let Some((region, file)) = self.regions.get(&a.id) else { continue };
            for (pid, host_pid) in region.pids() {
                // Host pid when the shim knew it; else the pid it saw (the same without a pid
                // namespace). Either is checked against the process's own mappings.
                let pid = if host_pid != 0 { host_pid } else { pid };
                out.push((a.id.clone(), pid, *file));
            }
        }
        out
    }

    /// SM time: reads the utilization of the GPUs the groups are on, counts each allocation's SM
    /// time by the driver, adds the strict shares' readings to their windows, and acts on what
    /// they decide. `listed_gpus`: the GPUs whose processes this poll listed (a group missing
    /// there is gone).
    fn judge_sm_time(
        &mut self,
        settings: &Settings,
        groups: &[Group],
        allocations: &[Allocation],
        listed_gpus: &HashSet<u32>,
        outcome: &mut PollOutcome,
    ) {
        let action = settings.sm(self.shim_injected());
        if action.is_none() {
            self.sm.clear();
        }
        let tolerance = settings.sm_tolerance_percent;
        let now_us = crate::state::record::unix_ns() / 1000;
        let mut per_gpu: HashMap<u32, Option<GpuUse>> = HashMap::new();
        let mut readings = Vec::new();
        let live = Arc::clone(&self.live);
        let mut sm_time: Vec<(&Allocation, &str, u64)> = Vec::new();
        for g in groups {
            // NVML gives no per-process utilization inside MIG instances (hardware-isolated anyway).
            if g.key.device_uuid.starts_with("MIG-") {
                continue;
            }
            let read = match per_gpu.entry(g.gpu_index) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(self.read_utilization(g.gpu_index, now_us, settings.interval_ms))
                }
            };
            let Some((period_ns, used)) = read else { continue };
            let uses: Vec<sm_time::Use> = g
                .processes
                .iter()
                .map(|p| sm_time::Use { process: (p.pid, p.start), percent: used.get(&p.pid).copied().unwrap_or(0) })
                .collect();
            // The group's SM time this period, shared evenly among its allocations.
            let percent: u64 = uses.iter().map(|u| u64::from(u.percent)).sum::<u64>().min(100);
            let members: Vec<&Allocation> = allocations.iter().filter(|a| g.key.allocations.contains(&a.id)).collect();
            let ns = (u128::from(percent) * u128::from(*period_ns) / 100) as u64 / members.len().max(1) as u64;
            sm_time.extend(members.iter().map(|a| (*a, g.key.device_uuid.as_str(), ns)));
            if action.is_none() {
                continue;
            }
            // Judged only when every holder is capped there (the members found are the key's).
            let caps: Option<Vec<u32>> =
                members.iter().map(|a| sm_time::cap(&a.limits(), &g.key.device_uuid)).collect();
            let Some(cap) =
                caps.filter(|c| !c.is_empty() && c.len() == g.key.allocations.len()).map(|c| c.iter().sum::<u32>())
            else {
                continue;
            };
            if cap.saturating_add(tolerance) >= 100 {
                continue;
            }
            readings.push(sm_time::Reading {
                key: g.key.clone(),
                gpu_index: g.gpu_index,
                cap,
                period_ns: *period_ns,
                uses,
            });
        }
        self.stats.add_sm_time(&sm_time, &live, now_us * 1000);
        let Some(action) = action else { return };
        // A GPU listed whose utilization could not be read says nothing about its groups.
        let read: HashSet<u32> =
            listed_gpus.iter().copied().filter(|g| per_gpu.get(g).is_none_or(Option::is_some)).collect();
        let dirs = self.controller.allocator().dirs();
        let procfs = &self.procfs;
        let mut under_shim = |key: &GroupKey, (pid, _): ProcKey| {
            key.allocations.iter().any(|id| {
                std::fs::metadata(dirs.region_path(id)).is_ok_and(|m| procfs.maps_inode(pid, m.dev(), m.ino()))
            })
        };
        let decisions = self.sm.decide(action, settings.sm_window_ms, tolerance, readings, &read, &mut under_shim);
        for d in decisions {
            outcome.events += 1;
            self.act_sm(d, allocations, outcome);
        }
    }

    /// GPU `gpu`'s per-process SM utilization since its last reading (at most a second back:
    /// an older mark would claim more time than the driver's history holds; none: one interval
    /// back), and the period it covers; `None` when NVML gives none (warned once).
    fn read_utilization(&mut self, gpu: u32, now_us: u64, interval_ms: u64) -> Option<GpuUse> {
        let since = self
            .utilization_read
            .get(&gpu)
            .copied()
            .filter(|&t| t < now_us && now_us - t <= 1_000_000)
            .unwrap_or(now_us.saturating_sub(interval_ms * 1000));
        match sample::utilization(self.controller.session().nvml(), gpu, since) {
            Ok(u) => {
                self.utilization_failing.remove(&gpu);
                self.utilization_read.insert(gpu, now_us);
                Some(((now_us - since) * 1000, u))
            }
            Err(e) => {
                if self.utilization_failing.insert(gpu) {
                    tracing::warn!(gpu, error = %e, "enforcement: NVML gives no per-process utilization for this GPU; SM time not enforced there");
                }
                None
            }
        }
    }

    /// Carries out an SM-time decision and publishes its event.
    fn act_sm(&mut self, d: sm_time::Decision, allocations: &[Allocation], outcome: &mut PollOutcome) {
        let (acted, used, cap, window_ms) = match d {
            sm_time::Decision::Kill { key, gpu_index, used, cap, window_ms, pids, victims } => {
                let killed = self.kill_victims(&key, victims, outcome);
                (Acted::killed(key, gpu_index, pids, killed), used, cap, window_ms)
            }
            sm_time::Decision::Report { key, gpu_index, used, cap, window_ms, pids, phase } => {
                (Acted::reported(key, gpu_index, pids, phase), used, cap, window_ms)
            }
        };
        let seconds = window_ms as f64 / 1000.0;
        let message = |a: &Acted, who: &str, on: &str| {
            let what = format!(
                "allocation {who} took {used}% of a {seconds:.1} s window's SM time on {on}, over its strict share of {cap}%"
            );
            match (a.action, a.phase) {
                (api::BreachAction::Killed, _) if a.killed.is_empty() => format!("{what}; nothing left to kill"),
                (api::BreachAction::Killed, _) => format!(
                    "{what}; killed pid {} (processes outside the shim first, then the heaviest)",
                    join(&a.killed)
                ),
                (_, Phase::Ended) => format!("allocation {who} is back within its strict share of {cap}% on {on}"),
                _ => format!("{what} (pids {}); reported, not killed", join(&a.pids)),
            }
        };
        let figures = api::LimitBreach {
            sm_percent_used: used,
            sm_percent_limit: cap,
            window_ms: u32::try_from(window_ms).unwrap_or(u32::MAX),
            ..Default::default()
        };
        self.publish_acted(allocations, acted, api::BreachLimit::Sm, message, figures);
    }

    /// SIGKILLs `victims` through a pidfd (each one's start time checked, so a reused pid is never
    /// hit); the pids killed. One that cannot be killed is logged, and no longer counted as
    /// killed, so a later poll tries again.
    fn kill_victims(
        &mut self,
        key: &GroupKey,
        victims: impl IntoIterator<Item = ProcKey>,
        outcome: &mut PollOutcome,
    ) -> Vec<u32> {
        let mut killed = Vec::new();
        let mut failed = Vec::new();
        for (pid, start) in victims {
            match kill::kill(&self.procfs, pid, start) {
                Ok(()) => killed.push(pid),
                // Gone already, or its pid reused: nothing of it is left to kill.
                Err(kill::KillError::Gone | kill::KillError::Reused(_)) => {}
                Err(e) => {
                    self.tracker.kill_failed((pid, start));
                    failed.push(format!("pid {pid}: {e}"));
                }
            }
        }
        if !failed.is_empty() {
            tracing::error!(allocation = %key.allocations.join(","), failed = %failed.join("; "), "enforcement: cannot kill");
        }
        outcome.killed.extend(&killed);
        killed
    }

    /// The records of `ids`, each named by its container: one that has not learnt its container
    /// from the owner record yet (the lease pass adopts them once a second) adopts it now, so a
    /// breach soon after a container started says whose it was (its event named no container, and
    /// its metrics no pod, when the kill came first).
    fn members_named(&mut self, allocations: &[Allocation], ids: &[String]) -> Vec<Allocation> {
        let pick = |records: &[Allocation]| -> Vec<Allocation> {
            records.iter().filter(|a| ids.contains(&a.id)).cloned().collect()
        };
        let members = pick(allocations);
        if members.iter().any(|a| a.container.container_id.is_none())
            && self.controller.allocator().adopt_owner_records() > 0
        {
            return pick(&self.allocations());
        }
        members
    }

    /// Publishes the event of what a decision came to, and counts the breach in the metrics for
    /// each member when it was a kill or it started: `message` says it from the members' names
    /// and the GPU and device it was on; `figures` holds the limit's own (bytes, or SM percents).
    fn publish_acted(
        &mut self,
        allocations: &[Allocation],
        acted: Acted,
        limit: api::BreachLimit,
        message: impl FnOnce(&Acted, &str, &str) -> String,
        figures: api::LimitBreach,
    ) {
        let named = self.members_named(allocations, &acted.key.allocations);
        let members: Vec<&Allocation> = named.iter().collect();
        let uuid = acted.key.device_uuid.clone();
        let device_id = device_ids(&members, &uuid);
        if acted.action == api::BreachAction::Killed || acted.phase == Phase::Started {
            let action_name = if acted.action == api::BreachAction::Killed { "kill" } else { "report" };
            let limit_name = if limit == api::BreachLimit::Sm { "sm" } else { "memory" };
            for a in &members {
                self.stats.breach(a, &uuid, &device_id, action_name, limit_name);
            }
        }
        let message = message(&acted, &who(&members), &format!("GPU {} device {uuid}", acted.gpu_index));
        let severity = if acted.phase == Phase::Ended { api::Severity::Info } else { api::Severity::Warning };
        let detail = api::LimitBreach {
            allocation_id: acted.key.allocations.first().cloned().unwrap_or_default(),
            pids: acted.pids,
            action: acted.action as i32,
            killed_pids: acted.killed,
            phase: breach_phase(acted.phase) as i32,
            gpu_index: acted.gpu_index,
            limit: limit as i32,
            ..figures
        };
        self.controller.events().publish(api::Event {
            kind: api::EventKind::LimitBreach as i32,
            severity: severity as i32,
            time_unix_nano: crate::state::record::unix_ns(),
            device_id,
            device_kind: device_kind(&members, &uuid) as i32,
            device_uuid: uuid,
            affected: members.iter().map(|a| node::holder(a)).collect(),
            message,
            detail: Some(api::event::Detail::LimitBreach(detail)),
            ..Default::default()
        });
    }

    /// Carries out a decision and publishes its event.
    fn act(&mut self, d: Decision, allocations: &[Allocation], outcome: &mut PollOutcome) {
        let (acted, used, limit) = match d {
            Decision::Kill { key, gpu_index, used, limit, pids, victims } => {
                let killed = self.kill_victims(&key, victims.iter().map(|v| (v.pid, v.start)), outcome);
                (Acted::killed(key, gpu_index, pids, killed), used, limit)
            }
            Decision::Report { key, gpu_index, used, limit, pids, phase } => {
                (Acted::reported(key, gpu_index, pids, phase), used, limit)
            }
        };
        let message = |a: &Acted, who: &str, on: &str| {
            let what = format!("allocation {who} holds {} on {on}, over its limit of {}", mib(used), mib(limit));
            match (a.action, a.phase) {
                (api::BreachAction::Killed, _) if a.killed.is_empty() => format!("{what}; nothing left to kill"),
                (api::BreachAction::Killed, _) => format!("{what}; killed pid {} (newest first)", join(&a.killed)),
                (_, Phase::Started) => format!("{what} (pids {}); reported, not killed", join(&a.pids)),
                (_, Phase::Changed) => format!("{what} (pids {}); still over, reported", join(&a.pids)),
                (_, Phase::Ended) => {
                    format!("allocation {who} is back under its limit of {} on {on} ({} held)", mib(limit), mib(used))
                }
            }
        };
        let figures = api::LimitBreach { used_bytes: used, limit_bytes: limit, ..Default::default() };
        self.publish_acted(allocations, acted, api::BreachLimit::Memory, message, figures);
    }

    fn report_unattributed(&self, pid: u32, p: &sample::GpuProcess) {
        let command = self.procfs.command(pid);
        let message = format!(
            "pid {pid} ({}) holds {} on GPU {} device {} but belongs to no allocation; not enforced",
            if command.is_empty() { "?" } else { &command },
            mib(p.used),
            p.gpu_index,
            p.device_uuid
        );
        let kind = if p.device_uuid.starts_with("MIG-") { api::DeviceKind::Mig } else { api::DeviceKind::Gpu };
        self.controller.events().publish(api::Event {
            kind: api::EventKind::UnattributedProcess as i32,
            severity: api::Severity::Warning as i32,
            time_unix_nano: crate::state::record::unix_ns(),
            device_id: p.device_uuid.clone(),
            device_uuid: p.device_uuid.clone(),
            device_kind: kind as i32,
            message,
            detail: Some(api::event::Detail::UnattributedProcess(api::UnattributedProcess {
                pid,
                used_bytes: p.used,
                gpu_index: p.gpu_index,
                command,
            })),
            ..Default::default()
        });
    }
}

/// One GPU's reading: the period it covers (ns) and each pid's SM percent over it.
type GpuUse = (u64, HashMap<u32, u32>);

/// What a decision on a breach (of memory or SM time) came to: the group and its GPU, the pids
/// seen, and whether they were killed (those killed) or reported (in which phase).
struct Acted {
    key: GroupKey,
    gpu_index: u32,
    pids: Vec<u32>,
    action: api::BreachAction,
    phase: Phase,
    killed: Vec<u32>,
}

impl Acted {
    fn killed(key: GroupKey, gpu_index: u32, pids: Vec<u32>, killed: Vec<u32>) -> Acted {
        Acted { key, gpu_index, pids, action: api::BreachAction::Killed, phase: Phase::Started, killed }
    }

    fn reported(key: GroupKey, gpu_index: u32, pids: Vec<u32>, phase: Phase) -> Acted {
        Acted { key, gpu_index, pids, action: api::BreachAction::Reported, phase, killed: Vec::new() }
    }
}

fn breach_phase(phase: Phase) -> api::BreachPhase {
    match phase {
        Phase::Started => api::BreachPhase::Started,
        Phase::Changed => api::BreachPhase::Changed,
        Phase::Ended => api::BreachPhase::Ended,
    }
}

/// The allocations, each with its container's name when known.
fn who(members: &[&Allocation]) -> String {
    members
        .iter()
        .map(|a| match a.container.display_name() {
            Some(n) => format!("{} ({n})", a.id),
            None => a.id.clone(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The allocations' device ids on the device `uuid`, comma-joined (the UUID when none holds it).
fn device_ids(members: &[&Allocation], uuid: &str) -> String {
    let ids: Vec<&str> = members
        .iter()
        .flat_map(|a| &a.devices)
        .filter(|d| d.physical_uuid.eq_ignore_ascii_case(uuid))
        .map(|d| d.device_id.as_str())
        .collect();
    if ids.is_empty() { uuid.to_string() } else { ids.join(",") }
}

fn device_kind(members: &[&Allocation], uuid: &str) -> api::DeviceKind {
    let share = members
        .iter()
        .flat_map(|a| &a.devices)
        .any(|d| d.physical_uuid.eq_ignore_ascii_case(uuid) && d.device_id != d.physical_uuid);
    match (share, uuid.starts_with("MIG-")) {
        (true, _) => api::DeviceKind::Share,
        (false, true) => api::DeviceKind::Mig,
        (false, false) => api::DeviceKind::Gpu,
    }
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes >> 20)
}

fn join(pids: &[u32]) -> String {
    pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
}
