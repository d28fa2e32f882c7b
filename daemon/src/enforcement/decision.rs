//! What to do about what one poll found: which processes to kill (newest first, until the
//! allocation is under its limit), which breaches to report, and which unattributed processes
//! are new. Pure, apart from the memory of earlier polls ([`Tracker`]) that keeps a steady
//! breach or a long-lived unattributed process from being one event per poll.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use crate::config::enforcement::Action;

/// A process, as long as it lives: (host pid, start time). A reused pid is another process.
pub type ProcKey = (u32, u64);

/// One process's memory on the device of a [`Group`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    pub pid: u32,
    /// Start time (clock ticks since boot): larger is newer.
    pub start: u64,
    pub used: u64,
}

impl Holding {
    fn key(&self) -> ProcKey {
        (self.pid, self.start)
    }
}

/// What enforcement judges: the allocations a set of processes belongs to, on one device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupKey {
    /// Allocation ids, sorted (usually one).
    pub allocations: Vec<String>,
    /// The device (GPU or MIG UUID).
    pub device_uuid: String,
}

/// One group's usage in a poll.
#[derive(Debug, Clone)]
pub struct Group {
    pub key: GroupKey,
    pub gpu_index: u32,
    /// `None`: no limit on the device.
    pub limit: Option<u64>,
    pub processes: Vec<Holding>,
}

impl Group {
    pub fn used(&self) -> u64 {
        self.processes.iter().map(|p| p.used).sum()
    }
}

/// Where a reported breach stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Started,
    Changed,
    Ended,
}

/// One thing to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Kill `victims` (newest first); `used` and `pids` are the group's before the kill.
    Kill { key: GroupKey, gpu_index: u32, used: u64, limit: u64, pids: Vec<u32>, victims: Vec<Holding> },
    /// Report a breach (no kill).
    Report { key: GroupKey, gpu_index: u32, used: u64, limit: u64, pids: Vec<u32>, phase: Phase },
}

/// The newest processes whose memory, once gone, leaves `processes` at or under `limit`: sorted
/// newest first (start time, then pid), taken until the rest fit. Empty when they fit already.
pub fn victims(processes: &[Holding], limit: u64) -> Vec<Holding> {
    let mut total: u64 = processes.iter().map(|p| p.used).sum();
    let mut newest_first = processes.to_vec();
    newest_first.sort_by_key(|p| std::cmp::Reverse((p.start, p.pid)));
    let mut out = Vec::new();
    for p in newest_first {
        if total <= limit {
            break;
        }
        total = total.saturating_sub(p.used);
        out.push(p);
    }
    out
}

/// A breach being reported.
#[derive(Debug, Clone)]
struct Open {
    gpu_index: u32,
    limit: u64,
    /// What the last event said.
    used: u64,
    pids: BTreeSet<u32>,
}

/// Memory of earlier polls.
#[derive(Debug, Default)]
pub struct Tracker {
    /// Reported breaches still going on.
    open: BTreeMap<GroupKey, Open>,
    /// Processes signalled, until NVML stops listing them: their memory is on its way out, they
    /// are not killed (nor reported) again.
    killed: HashSet<ProcKey>,
    /// Unattributed processes already reported.
    unattributed: HashSet<ProcKey>,
}

impl Tracker {
    /// Decides for one poll. `groups`: every group with processes on its device this poll;
    /// `listed`: every process NVML lists (to forget killed ones that are gone).
    pub fn decide(&mut self, action: Action, groups: &[Group], listed: &HashSet<ProcKey>) -> Vec<Decision> {
        self.killed.retain(|k| listed.contains(k));
        let mut out = Vec::new();
        let mut over = BTreeSet::new();
        for g in groups {
            let Some(limit) = g.limit else { continue };
            // The dying are as good as gone.
            let alive: Vec<Holding> = g.processes.iter().copied().filter(|p| !self.killed.contains(&p.key())).collect();
            let used: u64 = alive.iter().map(|p| p.used).sum();
            if used <= limit {
                continue;
            }
            over.insert(g.key.clone());
            let mut pids: Vec<Holding> = alive.clone();
            pids.sort_by_key(|p| (p.start, p.pid));
            let pids: Vec<u32> = pids.iter().map(|p| p.pid).collect();
            match action {
                Action::Kill => {
                    let victims = victims(&alive, limit);
                    self.killed.extend(victims.iter().map(Holding::key));
                    out.push(Decision::Kill { key: g.key.clone(), gpu_index: g.gpu_index, used, limit, pids, victims });
                }
                Action::Report => {
                    let now: BTreeSet<u32> = pids.iter().copied().collect();
                    let phase = match self.open.get(&g.key) {
                        None => Some(Phase::Started),
                        Some(o) if o.pids != now || o.limit != limit || material(o.used, used, limit) => {
                            Some(Phase::Changed)
                        }
                        Some(_) => None,
                    };
                    if let Some(phase) = phase {
                        self.open.insert(g.key.clone(), Open { gpu_index: g.gpu_index, limit, used, pids: now });
                        out.push(Decision::Report {
                            key: g.key.clone(),
                            gpu_index: g.gpu_index,
                            used,
                            limit,
                            pids,
                            phase,
                        });
                    }
                }
            }
        }
        // Reported breaches that ended (under the limit, the processes gone, or kill mode now).
        let ended: Vec<GroupKey> =
            self.open.keys().filter(|k| !over.contains(*k) || action == Action::Kill).cloned().collect();
        for key in ended {
            let Some(o) = self.open.remove(&key) else { continue };
            let g = groups.iter().find(|g| g.key == key);
            let used = g.map_or(0, Group::used);
            let pids = g.map(|g| g.processes.iter().map(|p| p.pid).collect()).unwrap_or_default();
            out.push(Decision::Report { key, gpu_index: o.gpu_index, used, limit: o.limit, pids, phase: Phase::Ended });
        }
        out
    }

    /// A kill that could not be sent: the process may be tried again next poll.
    pub fn kill_failed(&mut self, k: ProcKey) {
        self.killed.remove(&k);
    }

    /// Of the unattributed processes of this poll, those not reported before (each is reported
    /// once for as long as it lives).
    pub fn new_unattributed(&mut self, now: &[ProcKey]) -> Vec<ProcKey> {
        let current: HashSet<ProcKey> = now.iter().copied().collect();
        self.unattributed.retain(|k| current.contains(k));
        now.iter().copied().filter(|k| self.unattributed.insert(*k)).collect()
    }
}

/// Whether usage moved enough since the last event to be worth another: a tenth of the limit,
/// at least 64 MiB.
fn material(before: u64, now: u64, limit: u64) -> bool {
    before.abs_diff(now) >= (limit / 10).max(64 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn h(pid: u32, start: u64, mib: u64) -> Holding {
        Holding { pid, start, used: mib * MIB }
    }

    fn group(procs: &[Holding], limit_mib: Option<u64>) -> Group {
        Group {
            key: GroupKey { allocations: vec!["a1".into()], device_uuid: "GPU-x".into() },
            gpu_index: 0,
            limit: limit_mib.map(|l| l * MIB),
            processes: procs.to_vec(),
        }
    }

    fn listed(g: &Group) -> HashSet<ProcKey> {
        g.processes.iter().map(Holding::key).collect()
    }

    #[test]
    fn victims_are_the_newest_until_under_the_limit() {
        let procs = [h(10, 100, 400), h(11, 300, 300), h(12, 200, 500)];
        // 1200 over 1000: the newest (start 300) alone brings it to 900.
        assert_eq!(victims(&procs, 1000 * MIB), [h(11, 300, 300)]);
        // Over 500: newest, then the next newest (start 200), leaving 400.
        assert_eq!(victims(&procs, 500 * MIB), [h(11, 300, 300), h(12, 200, 500)]);
        // A limit of 0: everyone, newest first.
        assert_eq!(victims(&procs, 0), [h(11, 300, 300), h(12, 200, 500), h(10, 100, 400)]);
        // At the limit exactly: nobody.
        assert!(victims(&procs, 1200 * MIB).is_empty());
        // Same start tick: the higher pid is the newer.
        assert_eq!(victims(&[h(5, 1, 10), h(6, 1, 10)], 10 * MIB), [h(6, 1, 10)]);
    }

    #[test]
    fn kill_once_then_wait_for_the_memory_to_go() {
        let mut t = Tracker::default();
        let g = group(&[h(1, 1, 600), h(2, 2, 600)], Some(1000));
        let d = t.decide(Action::Kill, std::slice::from_ref(&g), &listed(&g));
        assert!(
            matches!(&d[..], [Decision::Kill { victims, used, .. }] if victims == &[h(2, 2, 600)] && *used == 1200 * MIB)
        );
        // Still listed next poll (dying): not killed again, no new decision.
        assert!(t.decide(Action::Kill, std::slice::from_ref(&g), &listed(&g)).is_empty());
        // Gone; the survivor alone is under the limit.
        let g = group(&[h(1, 1, 600)], Some(1000));
        assert!(t.decide(Action::Kill, std::slice::from_ref(&g), &listed(&g)).is_empty());
        // A new process reuses pid 2 (another start time) and passes the limit again: killed.
        let g = group(&[h(1, 1, 600), h(2, 9, 600)], Some(1000));
        let d = t.decide(Action::Kill, std::slice::from_ref(&g), &listed(&g));
        assert!(matches!(&d[..], [Decision::Kill { victims, .. }] if victims == &[h(2, 9, 600)]));
    }

    #[test]
    fn under_or_without_a_limit_nothing_happens() {
        let mut t = Tracker::default();
        for g in [group(&[h(1, 1, 1000)], Some(1000)), group(&[h(1, 1, 99_999)], None)] {
            assert!(t.decide(Action::Kill, std::slice::from_ref(&g), &listed(&g)).is_empty());
            assert!(t.decide(Action::Report, std::slice::from_ref(&g), &listed(&g)).is_empty());
        }
    }

    #[test]
    fn a_steady_reported_breach_is_one_event_until_it_changes_or_ends() {
        let mut t = Tracker::default();
        let phase = |d: &[Decision]| match d {
            [Decision::Report { phase, .. }] => Some(*phase),
            [] => None,
            other => panic!("{other:?}"),
        };
        let g = group(&[h(1, 1, 1200)], Some(1000));
        assert_eq!(phase(&t.decide(Action::Report, std::slice::from_ref(&g), &listed(&g))), Some(Phase::Started));
        for _ in 0..10 {
            assert_eq!(phase(&t.decide(Action::Report, std::slice::from_ref(&g), &listed(&g))), None, "steady");
        }
        // A few MiB more: not material.
        let g = group(&[h(1, 1, 1210)], Some(1000));
        assert_eq!(phase(&t.decide(Action::Report, std::slice::from_ref(&g), &listed(&g))), None);
        // A new process: changed.
        let g = group(&[h(1, 1, 1210), h(2, 2, 10)], Some(1000));
        assert_eq!(phase(&t.decide(Action::Report, std::slice::from_ref(&g), &listed(&g))), Some(Phase::Changed));
        // 200 MiB more (a tenth of the limit is 100): changed.
        let g = group(&[h(1, 1, 1410), h(2, 2, 10)], Some(1000));
        assert_eq!(phase(&t.decide(Action::Report, std::slice::from_ref(&g), &listed(&g))), Some(Phase::Changed));
        // Under the limit: ended, once.
        let g = group(&[h(1, 1, 900)], Some(1000));
        let d = t.decide(Action::Report, std::slice::from_ref(&g), &listed(&g));
        assert!(matches!(&d[..], [Decision::Report { phase: Phase::Ended, used, .. }] if *used == 900 * MIB), "{d:?}");
        assert_eq!(phase(&t.decide(Action::Report, std::slice::from_ref(&g), &listed(&g))), None);
        // The processes gone altogether while over: ended.
        let g = group(&[h(1, 1, 1200)], Some(1000));
        assert_eq!(phase(&t.decide(Action::Report, std::slice::from_ref(&g), &listed(&g))), Some(Phase::Started));
        assert_eq!(phase(&t.decide(Action::Report, &[], &HashSet::new())), Some(Phase::Ended));
    }

    #[test]
    fn an_unattributed_process_is_reported_once_while_it_lives() {
        let mut t = Tracker::default();
        assert_eq!(t.new_unattributed(&[(1, 1), (2, 2)]), [(1, 1), (2, 2)]);
        assert!(t.new_unattributed(&[(1, 1), (2, 2)]).is_empty());
        assert!(t.new_unattributed(&[(1, 1)]).is_empty());
        // pid 2 again, another process.
        assert_eq!(t.new_unattributed(&[(1, 1), (2, 7)]), [(2, 7)]);
    }
}
