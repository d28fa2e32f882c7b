//! Preemption by priority (issue 33): a node API share that does not fit parks preemptible
//! allocations of lower priority on its GPU instead of being refused, and they are resumed once
//! their memory fits again.
//!
//! The rules: only allocations every device of which is preemptible (`--preemptible`, the DRA
//! opaque config's `preemptible`), none held whole, of a priority below the asked one, running,
//! with a process to park, holding memory on the GPU the share goes to; lowest priority first,
//! then the most recently made, as few as needed (one not needed after all is let off); the GPU
//! that needs the fewest parked (then the fewest bytes). Parking frees memory, not SM time (a parked allocation
//! keeps its limits): a share refused for SM time preempts nothing. All or nothing: when the
//! candidates together do not free enough, nothing is parked and the refusal says so; when a
//! park or the share itself fails, what was parked is resumed. From the plan to the share made
//! (or undone) the allocator's `preempting` lock is held, as it is by a resume pass: that pass
//! never takes back room a preemption in flight parked, and two preemptions never pick one
//! victim. Lock order: `preempting`, then the store's, then the parking table's.
//!
//! A preempted park is journalled with the allocation it made room for
//! ([`DaemonAllocator::park_for`]), so it is told from an operator's park (never resumed but by
//! `Resume`) across restarts too. [`DaemonAllocator::resume_preempted`] resumes the preempted
//! ones, highest priority first, each admitted as an operator's resume is; one that does not fit
//! waits for the next change (`NodeController::follow_preempted` runs a pass on every change of
//! the records, whichever way in made it, of the offer, and on an operator's park).

use std::time::Duration;

use tessera_region::Priority;
use tonic::Status;

use super::park::ParkOutcome;
use super::{DaemonAllocator, DeviceAsk, ShareRequest};
use crate::carve::{self, GpuRoom};
use crate::park::Checkpointer;
use crate::state::Allocation;

/// An allocation preemption may park to make room on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Candidate {
    pub id: String,
    pub priority: Priority,
    pub created_unix_ns: u64,
    /// What parking it frees on the GPU, bytes.
    pub memory: u64,
}

/// Which of `candidates` to park so that `need` bytes fit where `free` are: lowest priority
/// first, then the most recently made; then those not needed after all are let off (the
/// latest chosen first: a lower-priority one stays parked rather than a higher one).
/// `None` when all of them together do not free enough.
pub(super) fn choose(candidates: &[Candidate], free: u64, need: u64) -> Option<Vec<&Candidate>> {
    let mut order: Vec<&Candidate> = candidates.iter().collect();
    order.sort_by(|a, b| {
        (a.priority as u8)
            .cmp(&(b.priority as u8))
            .then(b.created_unix_ns.cmp(&a.created_unix_ns))
            .then(a.id.cmp(&b.id))
    });
    let mut chosen = Vec::new();
    let mut freed = 0u64;
    for c in order {
        if free.saturating_add(freed) >= need {
            break;
        }
        freed = freed.saturating_add(c.memory);
        chosen.push(c);
    }
    if free.saturating_add(freed) < need {
        return None;
    }
    for i in (0..chosen.len()).rev() {
        let without = freed - chosen[i].memory;
        if free.saturating_add(without) >= need {
            freed = without;
            chosen.remove(i);
        }
    }
    Some(chosen)
}

/// A park or resume preemption did, for the event stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    pub id: String,
    /// Parked (else resumed).
    pub parked: bool,
    pub outcome: ParkOutcome,
    /// `preempted by <id>`, `room back`, `preemption undone: <why>`.
    pub reason: String,
}

/// What an `Allocate` that may preempt did: the share (or the refusal) and the parks and
/// resumes on the way, in order.
#[derive(Debug)]
pub struct Preemption {
    pub result: Result<Allocation, Status>,
    pub moves: Vec<Move>,
}

/// Where preemption would make room: a GPU and the allocations to park there.
#[derive(Debug)]
struct Plan {
    gpu: String,
    victims: Vec<String>,
    bytes: u64,
}

impl DaemonAllocator {
    /// The node API's `Allocate`, preempting: as [`Self::allocate_share`], but a share refused
    /// for room is made by parking preemptible allocations of lower priority on its GPU through
    /// the checkpoint API `ck` gives (loaded only then), each within `lock_timeout`.
    pub fn allocate_preempting(
        &self,
        req: &ShareRequest,
        gpus: &[GpuRoom],
        ck: impl FnOnce() -> Result<Checkpointer, Status>,
        lock_timeout: Duration,
    ) -> Preemption {
        let refused = match self.allocate_share(req, gpus) {
            Err(e) if e.code() == tonic::Code::ResourceExhausted && req.device == DeviceAsk::Share => e,
            result => return Preemption { result, moves: Vec::new() },
        };
        let priority = req.priority.unwrap_or(self.defaults().priority);
        // From the plan to the share made (or undone): no resume pass takes the room back, no
        // other preemption picks the same victims.
        let _preempting = self.preempting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (plan, had_candidates) = self.plan(req, priority, gpus);
        let Some(plan) = plan else {
            let result = Err(if had_candidates {
                Status::resource_exhausted(format!(
                    "{}; parking the preemptible allocations of lower priority would not make room either \
                     (nothing was parked)",
                    refused.message()
                ))
            } else {
                refused
            });
            return Preemption { result, moves: Vec::new() };
        };
        let ck = match ck() {
            Ok(ck) => ck,
            Err(e) => {
                let why = format!("{}; preemption would make room but {}", refused.message(), e.message());
                return Preemption { result: Err(Status::resource_exhausted(why)), moves: Vec::new() };
            }
        };
        let id = Allocation::new_id();
        let reason = format!("preempted by {id}");
        let mut moves = Vec::new();
        for victim in &plan.victims {
            match self.park_for(victim, &ck, lock_timeout, Some(&id)) {
                Ok(outcome) => moves.push(Move { id: victim.clone(), parked: true, outcome, reason: reason.clone() }),
                Err(e) => {
                    let why = format!("parking {victim} failed: {}", e.message());
                    self.undo(&ck, gpus, &mut moves, &why);
                    let result = Err(Status::resource_exhausted(format!(
                        "{}; preemption could not make room: {why}; nothing stays parked",
                        refused.message()
                    )));
                    return Preemption { result, moves };
                }
            }
        }
        let pinned = ShareRequest { gpu: plan.gpu.clone(), ..req.clone() };
        let result = self.carve_share(&pinned, gpus, id);
        match &result {
            Ok(a) => {
                tracing::info!(id = %a.id, gpu = %plan.gpu, parked = ?plan.victims, bytes = plan.bytes, "share made by preemption")
            }
            Err(e) => {
                let why = format!("the share was refused after parking: {}", e.message());
                self.undo(&ck, gpus, &mut moves, &why);
            }
        }
        Preemption { result, moves }
    }

    /// Resumes what a failed preemption parked (all of it: never half).
    fn undo(&self, ck: &Checkpointer, gpus: &[GpuRoom], moves: &mut Vec<Move>, why: &str) {
        let parked: Vec<String> = moves.iter().filter(|m| m.parked).map(|m| m.id.clone()).collect();
        for id in parked {
            match self.resume(&id, ck, gpus) {
                Ok(outcome) => {
                    moves.push(Move { id, parked: false, outcome, reason: format!("preemption undone: {why}") })
                }
                Err(e) => {
                    tracing::error!(%id, error = %e.message(), "preemption undone, but this allocation could not be resumed: it stays parked and is resumed once it fits")
                }
            }
        }
    }

    /// Where parking makes room for `req` at `priority`, and whether any candidate was found
    /// at all. Under the store's lock, as admission is.
    fn plan(&self, req: &ShareRequest, priority: Priority, gpus: &[GpuRoom]) -> (Option<Plan>, bool) {
        let compute_mode = req.compute_mode.unwrap_or(self.defaults().compute_mode);
        let ask = carve::Ask { memory: req.memory, sm_percent: req.sm_percent, compute_mode };
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let taken = self.parking_ids();
        let mut best: Option<Plan> = None;
        let mut had_candidates = false;
        for gpu in gpus.iter().filter(|g| carve::selects(&req.gpu, g) && g.unavailable.is_none() && !g.mig_mode) {
            let held = self.beside_parked(&store, gpu, carve::held_in(gpu, store.loads(), None));
            // Parking frees no SM time: the share must fit there as it is.
            if !carve::fits(gpu, carve::Held { memory: 0, ..held }, ask) {
                continue;
            }
            let candidates: Vec<Candidate> = store
                .list()
                .filter(|a| a.preemptible() && (a.priority() as u8) < (priority as u8) && !taken.contains(&a.id))
                // A device held whole stays held whole parked: no room made there.
                .filter(|a| !a.devices.iter().any(|d| d.is_whole()))
                .filter_map(|a| {
                    let on_gpu = a.devices.iter().filter(|d| d.physical_uuid.eq_ignore_ascii_case(&gpu.uuid));
                    let memory: u64 = on_gpu.map(|d| d.holds().0.unwrap_or(gpu.memory_total)).sum();
                    (memory > 0).then(|| Candidate {
                        id: a.id.clone(),
                        priority: a.priority(),
                        created_unix_ns: a.created_unix_ns,
                        memory,
                    })
                })
                // Only one whose park can succeed: a process has joined its region.
                .filter(|c| self.has_processes(&c.id))
                .collect();
            had_candidates |= !candidates.is_empty();
            let free = gpu.memory_total.saturating_sub(held.memory);
            let Some(chosen) = choose(&candidates, free, req.memory) else { continue };
            let plan = Plan {
                gpu: gpu.uuid.clone(),
                bytes: chosen.iter().map(|c| c.memory).sum(),
                victims: chosen.into_iter().map(|c| c.id.clone()).collect(),
            };
            let better = best.as_ref().is_none_or(|b| (plan.victims.len(), plan.bytes) < (b.victims.len(), b.bytes));
            if better {
                best = Some(plan);
            }
        }
        (best, had_candidates)
    }

    /// Resumes the allocations parked by preemption whose memory fits again, highest priority
    /// first (then the oldest), each admitted as `Resume` is against `rooms`; one that does not
    /// fit stays parked and waits for the next release. `ck` is loaded only when one is parked.
    /// A device not among `rooms` (not published yet) waits too: it could not be admitted.
    pub fn resume_preempted<E: std::fmt::Display>(
        &self,
        ck: impl FnOnce() -> Result<Checkpointer, E>,
        rooms: &[GpuRoom],
    ) -> Vec<Move> {
        let _preempting = self.preempting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut waiting: Vec<(u8, u64, String)> = {
            let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            self.preempted()
                .into_iter()
                .filter_map(|id| store.get(&id).map(|a| (a.clone(), id)))
                .filter(|(a, _)| a.devices.iter().all(|d| super::admission::room_of(rooms, &d.physical_uuid).is_some()))
                .map(|(a, id)| (a.priority() as u8, a.created_unix_ns, id))
                .collect()
        };
        if waiting.is_empty() {
            return Vec::new();
        }
        waiting.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let ck = match ck() {
            Ok(ck) => ck,
            Err(e) => {
                tracing::error!(error = %e, "preempted allocations wait: no checkpoint API to resume them");
                return Vec::new();
            }
        };
        let mut moves = Vec::new();
        for (_, _, id) in waiting {
            match self.resume(&id, &ck, rooms) {
                Ok(outcome) => moves.push(Move { id, parked: false, outcome, reason: "room back".into() }),
                Err(e) => tracing::debug!(%id, why = %e.message(), "preempted allocation waits to resume"),
            }
        }
        moves
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn c(id: &str, priority: Priority, created: u64, gib: u64) -> Candidate {
        Candidate { id: id.into(), priority, created_unix_ns: created, memory: gib * GIB }
    }

    fn ids(chosen: Option<Vec<&Candidate>>) -> Option<Vec<&str>> {
        chosen.map(|v| v.into_iter().map(|c| c.id.as_str()).collect())
    }

    #[test]
    fn the_lowest_priority_then_the_newest_is_parked_and_only_as_much_as_needed() {
        let all = [
            c("normal-old", Priority::Normal, 1, 4),
            c("low-old", Priority::Low, 2, 4),
            c("low-new", Priority::Low, 3, 4),
        ];
        assert_eq!(ids(choose(&all, 0, 4 * GIB)), Some(vec!["low-new"]));
        assert_eq!(ids(choose(&all, 1, 4 * GIB)), Some(vec!["low-new"]), "4 GiB suffice with a byte free");
        assert_eq!(ids(choose(&all, 0, 8 * GIB)), Some(vec!["low-new", "low-old"]));
        assert_eq!(ids(choose(&all, 2 * GIB, 10 * GIB)), Some(vec!["low-new", "low-old"]));
        assert_eq!(ids(choose(&all, 0, 12 * GIB)), Some(vec!["low-new", "low-old", "normal-old"]));
        assert_eq!(ids(choose(&all, 4 * GIB, 4 * GIB)), Some(vec![]), "it fits: nothing parked");
    }

    #[test]
    fn one_not_needed_after_all_is_let_off() {
        // The small low one first, then the big normal one alone would do: the small one is let
        // off (as few as needed).
        let all = [c("low-small", Priority::Low, 1, 1), c("normal-big", Priority::Normal, 2, 10)];
        assert_eq!(ids(choose(&all, 0, 10 * GIB)), Some(vec!["normal-big"]));
        assert_eq!(ids(choose(&all, 0, 11 * GIB)), Some(vec!["low-small", "normal-big"]));
    }

    #[test]
    fn not_enough_preemptible_memory_parks_nothing() {
        let all = [c("a", Priority::Low, 1, 2), c("b", Priority::Low, 2, 2)];
        assert_eq!(ids(choose(&all, GIB, 6 * GIB)), None);
        assert_eq!(ids(choose(&[], 0, 1)), None);
    }
}
