//! Preempted allocations resumed once their room is back (issue 33, item 3), whichever way the
//! room came back: a record released through any way in (the node API's `Release`, a lease
//! ended, the kubelet's record gone, a DRA claim unprepared), a limit lowered, an operator's
//! park, a GPU healthy again or a layout change; and the park events, with their reason.
//!
//! One task ([`NodeController::follow_preempted`]) follows the store's holdings changes, the
//! published offer and the allocator's operator parks, and runs a resume pass off the async
//! workers (a checkpoint restore can take seconds): no way in waits for it, the kubelet's gRPC
//! path least of all. A pass is serialized with preemptions in flight (the allocator's
//! `preempting` lock), so it never takes back the room a preemption parked for its share.

use std::sync::Arc;
use std::time::Duration;

use tessera_proto::tessera::v1 as api;
use tokio::sync::watch;

use super::NodeController;
use crate::allocator::park::ParkOutcome;
use crate::allocator::preempt::Move;

/// While a preempted allocation waits, a pass runs at least this often too: memory taken
/// outside the records (a process the driver lists beside them) frees no record.
pub const RETRY: Duration = Duration::from_secs(10);

/// Why a park or resume the node API's `Park` / `Resume` asked for was done, in its event.
pub const OPERATOR: &str = "operator";

impl NodeController {
    /// `allocation_parked` / `allocation_resumed` on the event stream, with the bytes moved, how
    /// long it took and why (`operator`, `preempted by <id>`, `room back`, `preemption undone:
    /// ...`).
    pub fn publish_park(&self, id: &str, parked: bool, done: &ParkOutcome, reason: &str) {
        let record = self.allocator.allocations_where(|a| a.id == id).into_iter().next();
        let uuid = record.as_ref().and_then(|a| a.devices.first()).map(|d| d.physical_uuid.clone()).unwrap_or_default();
        let (kind, verb) = if parked {
            (api::EventKind::AllocationParked, "parked")
        } else {
            (api::EventKind::AllocationResumed, "resumed")
        };
        let affected =
            record.map(|a| api::Holder { allocation_id: a.id.clone(), container: Some(super::identity(&a.container)) });
        self.events.publish(api::Event {
            kind: kind as i32,
            severity: api::Severity::Info as i32,
            time_unix_nano: crate::state::record::unix_ns(),
            device_id: uuid.clone(),
            device_uuid: uuid,
            affected: affected.into_iter().collect(),
            message: format!(
                "allocation {id} {verb} ({reason}): {} MiB in {:.3} s, processes {:?}",
                done.bytes >> 20,
                done.duration.as_secs_f64(),
                done.pids
            ),
            detail: Some(api::event::Detail::AllocationPark(api::AllocationPark {
                allocation_id: id.to_owned(),
                bytes: done.bytes,
                duration_nanos: done.duration.as_nanos() as u64,
                pids: done.pids.clone(),
                reason: reason.to_owned(),
            })),
            ..Default::default()
        });
    }

    /// Preemption's parks and resumes on the event stream, in order.
    pub fn publish_moves(&self, moves: &[Move]) {
        for m in moves {
            self.publish_park(&m.id, m.parked, &m.outcome, &m.reason);
        }
    }

    /// One resume pass: the parks of allocations released meanwhile are forgotten, and those
    /// preempted that fit again resume (highest priority first), each published as
    /// `allocation_resumed` with reason `room back`. Blocking (the driver's restore): called off
    /// the async workers, and at start before any face serves. Returns how many resumed.
    pub fn resume_preempted(&self) -> usize {
        self.allocator.forget_released();
        if !self.allocator.has_preempted() {
            return 0;
        }
        let library = self.session.library();
        let moves = self
            .allocator
            .resume_preempted(|| crate::allocator::park::checkpoint_api(library), &self.allocator.rooms());
        for m in &moves {
            tracing::info!(id = %m.id, bytes = m.outcome.bytes, "preempted allocation resumed: its room is back");
        }
        self.publish_moves(&moves);
        moves.len()
    }

    /// Runs a resume pass ([`Self::resume_preempted`]) after every change that may give room
    /// back, until `shutdown` turns true: what the records hold (every way in releases through
    /// the store), the offer published (rooms: health, layouts), an operator's park; and every
    /// [`RETRY`] while a preempted allocation waits. Changes that come together make one pass.
    pub fn follow_preempted(self: &Arc<Self>, mut shutdown: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        let controller = Arc::clone(self);
        let mut holdings = self.allocator.holdings_changes();
        let mut offer = self.watch_offer();
        let parks = self.allocator.parks_changed();
        tokio::spawn(async move {
            loop {
                holdings.borrow_and_update();
                offer.borrow_and_update();
                if controller.allocator.any_parked() {
                    let c = Arc::clone(&controller);
                    if let Err(e) = tokio::task::spawn_blocking(move || c.resume_preempted()).await {
                        tracing::error!(error = %e, "the resume pass of preempted allocations failed");
                    }
                }
                let waiting = controller.allocator.has_preempted();
                tokio::select! {
                    changed = holdings.changed() => if changed.is_err() { return },
                    changed = offer.changed() => if changed.is_err() { return },
                    () = parks.notified() => {}
                    () = tokio::time::sleep(RETRY), if waiting => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            }
        })
    }
}
