//! Health checking and recovery. [`HealthMonitor::spawn`] runs one thread that waits on NVML
//! events (XIDs, uncorrectable ECC errors) in short slices and probes the GPUs between them:
//!
//! - An XID is judged by the policy table ([`xid`]): application XIDs are attributed to the
//!   containers holding the device (a MIG device when the event names its instance) and take
//!   nothing out of service; fatal ones mark the device unhealthy (only the MIG device the event
//!   names, unless the XID is GPU-wide such as 79); informational ones are reported.
//! - A double-bit ECC error marks the GPU unhealthy.
//! - The liveness probe (every `interval_seconds`, and at once when an event wait says a GPU is
//!   lost) finds lost GPUs and GPUs that stopped answering even when no event came, and
//!   uncorrected ECC counts that rose without one.
//! - The same fault again on a device already out of service for it (an uncorrected ECC count
//!   that keeps rising) is reported at most every [`REPEAT_REPORT`], with a count, not on every
//!   probe.
//! - Out-of-service devices are probed every [`RECHECK`]. A reset leaves evidence NVML shows: a
//!   lost GPU answers again, the volatile ECC counters are cleared, a pending row remap is gone,
//!   or the driver's recovery action (which asked for a GPU reset) is back to none. With that, the device is `RECOVERING` and, after `recovery_check_ms` of passing probes (at
//!   least [`MIN_PROBES`]), healthy again and offered to the kubelet. A fault that leaves no such
//!   evidence keeps the device out of service until the daemon restarts.
//!
//! Every change goes to the kubelet at once (`NodeController::set_health`), then to the event
//! bus: a `Fault` event per fault (device, kind, XID, affected holders), a `HealthChanged`
//! event per health transition, and a `Recovery` event (with the downtime) when a device comes
//! back.

pub mod nvml;
mod report;
pub mod xid;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvml_wrapper::error::NvmlError;
use tessera_proto::tessera::v1 as api;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use self::nvml::{Counters, EventSet, Probe, RawEvent, probe};
use crate::config::Health;
use crate::node::NodeController;

/// Longest event wait while every device is healthy (bounds the shutdown delay).
pub const WAIT_MS: u32 = 100;
/// Event wait, and probe period of each out-of-service device, while some device is out of service.
pub const RECHECK: Duration = Duration::from_millis(50);
/// The same fault again on a device already out of service for it (an ECC count that keeps
/// rising, seen by every probe and event) is reported at most this often, with how many times it
/// came since the last report; in between it only updates the counters a reset is judged by.
pub const REPEAT_REPORT: Duration = Duration::from_secs(60);
/// Consecutive passing probes a recovering device needs, however short the check.
pub const MIN_PROBES: u32 = 2;

/// The health monitor.
#[derive(Debug)]
pub struct HealthMonitor;

impl HealthMonitor {
    /// Starts health checking for `controller`'s GPUs with `config` (the `[health]` section; later
    /// reloads are picked up at each poll). Stops within about [`WAIT_MS`] once `shutdown` turns
    /// true or its sender is dropped. Does nothing when `config.enabled` is false.
    pub fn spawn(controller: Arc<NodeController>, config: Health, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
        if !config.enabled {
            tracing::info!("health checking is off ([health] enabled = false)");
            return tokio::spawn(async {});
        }
        tokio::task::spawn_blocking(move || Monitor::new(controller, config).run(shutdown))
    }
}

/// A device the monitor judges.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    Gpu(u32),
    Mig { gpu: u32, uuid: String },
}

/// A device out of service.
#[derive(Debug, Clone)]
struct Outage {
    fault: api::FaultKind,
    xid: Option<u32>,
    reason: String,
    since: Instant,
    /// Unreachable (lost, or not answering): back when NVML answers again.
    lost: bool,
    /// The reset counters when the fault was seen.
    baseline: Counters,
    check: Option<Check>,
    /// When a `Fault` event for this outage was last published.
    reported: Instant,
    /// The same fault seen again since then, not yet reported.
    repeats: u64,
}

impl Outage {
    fn health(&self) -> api::Health {
        match (&self.check, self.lost) {
            (Some(_), _) => api::Health::Recovering,
            (None, true) => api::Health::Lost,
            (None, false) => api::Health::Unhealthy,
        }
    }

    fn describe(&self) -> String {
        let state = match self.health() {
            api::Health::Recovering => "recovering",
            api::Health::Lost => "lost",
            _ => "unhealthy",
        };
        format!("{state}: {}", self.reason)
    }
}

/// A recovery check in progress.
#[derive(Debug, Clone)]
struct Check {
    since: Instant,
    probes: u32,
    how: &'static str,
}

#[derive(Debug)]
struct GpuWatch {
    uuid: String,
    registered: bool,
    counters: Counters,
    outage: Option<Outage>,
    last_probe: Instant,
}

struct Monitor {
    controller: Arc<NodeController>,
    /// Events go to the bus from a thread of their own: publishing writes the kept events to
    /// disk, which must not delay the next fault reaching the kubelet.
    publisher: Option<std::sync::mpsc::Sender<api::Event>>,
    config: Health,
    gpus: BTreeMap<u32, GpuWatch>,
    /// MIG devices out of service, by UUID: (GPU index, outage).
    migs: BTreeMap<String, (u32, Outage)>,
}

fn health_name(h: api::Health) -> &'static str {
    match h {
        api::Health::Healthy => "healthy",
        api::Health::Unhealthy => "unhealthy",
        api::Health::Recovering => "recovering",
        api::Health::Lost => "lost",
        api::Health::Unspecified => "unknown",
    }
}

/// Which reset evidence `now` shows against `base`.
fn reset_seen(base: &Counters, now: &Counters) -> Option<&'static str> {
    let dropped = |b: Option<u64>, n: Option<u64>| matches!((b, n), (Some(b), Some(n)) if n < b);
    if dropped(base.ecc_uncorrected, now.ecc_uncorrected) || dropped(base.ecc_corrected, now.ecc_corrected) {
        return Some("reset (volatile ECC counters cleared)");
    }
    if base.remap_pending == Some(true) && now.remap_pending == Some(false) {
        return Some("reset (pending row remap applied)");
    }
    // The driver asked for a reset (or a drain and reset) and no longer does.
    if matches!(base.recovery_action, Some(1 | 4)) && now.recovery_action == Some(0) {
        return Some("reset (the driver's recovery action cleared)");
    }
    None
}

impl Monitor {
    fn new(controller: Arc<NodeController>, config: Health) -> Monitor {
        let now = Instant::now();
        let gpus = controller
            .view()
            .inventory
            .gpus
            .iter()
            .map(|g| {
                let watch = GpuWatch {
                    uuid: g.uuid.clone(),
                    registered: false,
                    counters: Counters::default(),
                    outage: None,
                    last_probe: now,
                };
                (g.index, watch)
            })
            .collect();
        Monitor { controller, publisher: None, config, gpus, migs: BTreeMap::new() }
    }

    fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let controller = Arc::clone(&self.controller);
        let (tx, rx) = std::sync::mpsc::channel::<api::Event>();
        let bus = Arc::clone(controller.events());
        let publisher = std::thread::Builder::new().name("tessera-health-events".into()).spawn(move || {
            for e in rx {
                bus.publish(e);
            }
        });
        let publisher = match publisher {
            Ok(handle) => {
                self.publisher = Some(tx);
                Some(handle)
            }
            Err(e) => {
                tracing::warn!(error = %e, "no event thread; health events are published inline");
                None
            }
        };
        let set = match EventSet::new(controller.session().nvml()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "no NVML event set: health relies on probes alone");
                None
            }
        };
        // First look: counters as they are now, lost GPUs, and event registration.
        let indices: Vec<u32> = self.gpus.keys().copied().collect();
        for &i in &indices {
            let p = probe(self.controller.session(), i);
            if let Probe::Alive(c) = &p {
                self.gpus.get_mut(&i).expect("known").counters = *c;
            }
            self.on_probe(i, p, set.as_ref());
        }
        tracing::info!(
            gpus = self.gpus.len(),
            registered = self.gpus.values().filter(|g| g.registered).count(),
            interval_s = self.config.interval_seconds,
            recovery_check_ms = self.config.recovery_check_ms,
            "health monitor started"
        );
        let mut next_poll = Instant::now() + Duration::from_secs(self.config.interval_seconds);
        let mut wait_errors = 0u64;
        loop {
            if *shutdown.borrow_and_update() || shutdown.has_changed().is_err() {
                break;
            }
            let out_of_service = self.gpus.values().any(|g| g.outage.is_some()) || !self.migs.is_empty();
            let slice = if out_of_service { RECHECK.as_millis() as u32 } else { WAIT_MS };
            let began = Instant::now();
            let mut poll_now = false;
            match set.as_ref().map(|s| s.wait(slice)) {
                None => std::thread::sleep(Duration::from_millis(u64::from(slice))),
                Some(Ok(Some(ev))) => self.on_event(ev),
                Some(Ok(None)) => {}
                Some(Err(e)) => {
                    // A registered GPU is lost: look at once unless we know already.
                    if matches!(e, NvmlError::GpuLost) {
                        poll_now = !self.gpus.values().any(|g| g.outage.as_ref().is_some_and(|o| o.lost));
                    } else {
                        wait_errors += 1;
                        if wait_errors.is_power_of_two() {
                            tracing::warn!(error = %e, count = wait_errors, "NVML event wait failed");
                        }
                    }
                    // Never spin on a wait that fails at once.
                    let spent = began.elapsed();
                    let slice = Duration::from_millis(u64::from(slice));
                    if spent < slice && !poll_now {
                        std::thread::sleep(slice - spent);
                    }
                }
            }
            let now = Instant::now();
            if poll_now || now >= next_poll {
                self.config = self.controller.view().config.health.clone();
                next_poll = now + Duration::from_secs(self.config.interval_seconds.max(1));
                self.forget_gone_migs();
                // Events already raised come first: they say more (an XID) than a probe does.
                for _ in 0..64 {
                    match set.as_ref().map(|s| s.wait(0)) {
                        Some(Ok(Some(ev))) => self.on_event(ev),
                        _ => break,
                    }
                }
                for i in self.gpus.keys().copied().collect::<Vec<_>>() {
                    let p = probe(self.controller.session(), i);
                    self.on_probe(i, p, set.as_ref());
                }
            } else {
                let due: Vec<u32> = self
                    .gpus
                    .iter()
                    .filter(|(i, g)| {
                        (g.outage.is_some() || self.migs.values().any(|(gpu, _)| gpu == *i))
                            && now.duration_since(g.last_probe) >= RECHECK
                    })
                    .map(|(i, _)| *i)
                    .collect();
                for i in due {
                    let p = probe(self.controller.session(), i);
                    self.on_probe(i, p, set.as_ref());
                }
            }
        }
        // Dropping the sender lets the event thread publish what is queued and end.
        drop(self.publisher.take());
        if let Some(handle) = publisher {
            let _ = handle.join();
        }
        tracing::info!("health monitor stopped");
    }

    // --- Events -------------------------------------------------------------------------------

    fn on_event(&mut self, ev: RawEvent) {
        match ev {
            RawEvent::Xid { gpu, xid, mig } => self.on_xid(gpu, xid, mig),
            RawEvent::DoubleBitEcc { gpu } => {
                let counters = self.counters_now(gpu);
                if let Some(o) = self.gpus.get(&gpu).and_then(|g| g.outage.as_ref())
                    && o.fault == api::FaultKind::EccDoubleBit
                    && o.check.is_none()
                    && counters.is_some_and(|c| c.ecc_uncorrected == o.baseline.ecc_uncorrected)
                {
                    // The probe found this one first.
                    return;
                }
                let count =
                    counters.and_then(|c| c.ecc_uncorrected).map_or(String::new(), |n| format!(" ({n} since reset)"));
                self.fault(
                    Target::Gpu(gpu),
                    api::FaultKind::EccDoubleBit,
                    None,
                    format!("double-bit ECC error{count}"),
                    counters.is_none(),
                    counters,
                );
            }
            RawEvent::Other { gpu, kind } => tracing::debug!(gpu, kind, "NVML event ignored"),
        }
    }

    fn on_xid(&mut self, gpu: u32, xid_no: u32, mig: Option<(u32, u32)>) {
        let Some(watch) = self.gpus.get(&gpu) else {
            tracing::warn!(gpu, xid = xid_no, "XID on a GPU not in the inventory");
            return;
        };
        // Every XID, ignored ones included: DCGM_FI_DEV_XID_ERRORS shows the last one seen.
        self.controller.events().note_xid(&watch.uuid, xid_no);
        let (action, what) = xid::classify(xid_no, &self.config);
        let mig_uuid = mig.and_then(|(gi, ci)| self.mig_uuid(gpu, gi, ci));
        if let (Some((gi, ci)), None) = (mig, &mig_uuid) {
            tracing::warn!(
                gpu,
                gi,
                ci,
                xid = xid_no,
                "XID names a MIG instance not in the inventory; judged on the GPU"
            );
        }
        let instance = mig_uuid.map(|uuid| Target::Mig { gpu, uuid });
        match action {
            xid::Action::Fatal { gpu_wide } => {
                let target = match instance {
                    Some(t) if !gpu_wide => t,
                    _ => Target::Gpu(gpu),
                };
                let counters = self.counters_now(gpu);
                let lost = xid_no == nvml_xid::FALLEN_OFF_BUS || counters.is_none();
                let kind =
                    if xid_no == nvml_xid::FALLEN_OFF_BUS { api::FaultKind::GpuLost } else { api::FaultKind::Xid };
                if let Some(w) = self.gpus.get_mut(&gpu)
                    && lost
                {
                    w.registered = false;
                }
                self.fault(target, kind, Some(xid_no), format!("XID {xid_no} ({what})"), lost, counters);
            }
            xid::Action::Application | xid::Action::Benign => {
                let target = instance.unwrap_or(Target::Gpu(gpu));
                let affected = self.holders(&target);
                let app = action == xid::Action::Application;
                let name = self.name(&target);
                let message = if app {
                    format!(
                        "XID {xid_no} ({what}) on {name}: caused by an application{}; the device stays in service",
                        attributed(&affected)
                    )
                } else {
                    format!("XID {xid_no} ({what}) on {name}: informational; the device stays in service")
                };
                let health = self.health_of(&target);
                let severity = if app { api::Severity::Warning } else { api::Severity::Info };
                let detail = api::Fault {
                    kind: api::FaultKind::Xid as i32,
                    xid: Some(xid_no),
                    marks_unhealthy: false,
                    health: health as i32,
                };
                self.publish(
                    api::EventKind::Fault,
                    severity,
                    &target,
                    affected,
                    message,
                    api::event::Detail::Fault(detail),
                );
            }
        }
    }

    // --- Probes -------------------------------------------------------------------------------

    fn counters_now(&self, gpu: u32) -> Option<Counters> {
        match probe(self.controller.session(), gpu) {
            Probe::Alive(c) => Some(c),
            _ => None,
        }
    }

    fn on_probe(&mut self, gpu: u32, p: Probe, set: Option<&EventSet<'_>>) {
        let now = Instant::now();
        let Some(w) = self.gpus.get_mut(&gpu) else { return };
        w.last_probe = now;
        match p {
            Probe::Lost | Probe::Failed(_) => {
                w.registered = false;
                let (kind, reason) = match &p {
                    Probe::Failed(e) => (api::FaultKind::ProbeFailed, format!("the GPU does not answer NVML ({e})")),
                    _ => (api::FaultKind::GpuLost, "NVML reports the GPU lost (probe)".to_string()),
                };
                if w.outage.as_ref().is_some_and(|o| o.lost && o.check.is_none()) {
                    return;
                }
                let baseline = w.outage.as_ref().map(|o| o.baseline);
                self.fault(Target::Gpu(gpu), kind, None, reason, true, baseline);
            }
            Probe::Alive(c) => {
                if !w.registered
                    && let Some(set) = set
                {
                    match set.register(gpu) {
                        Ok(any) => {
                            w.registered = true;
                            tracing::info!(gpu, events = any, "NVML events registered");
                        }
                        Err(e) => tracing::warn!(gpu, error = %e, "cannot register NVML events; probing only"),
                    }
                }
                let rose = matches!((w.counters.ecc_uncorrected, c.ecc_uncorrected), (Some(a), Some(b)) if b > a);
                let before = w.counters.ecc_uncorrected.unwrap_or(0);
                w.counters = c;
                if rose {
                    let dup = w.outage.as_ref().is_some_and(|o| {
                        o.fault == api::FaultKind::EccDoubleBit && o.baseline.ecc_uncorrected >= c.ecc_uncorrected
                    });
                    if !dup {
                        let reason = format!(
                            "double-bit ECC error (uncorrected count {before} -> {}, found by probe)",
                            c.ecc_uncorrected.unwrap_or(0)
                        );
                        self.fault(Target::Gpu(gpu), api::FaultKind::EccDoubleBit, None, reason, false, Some(c));
                        return;
                    }
                }
                self.check_recovery(&Target::Gpu(gpu), &c, now);
                let migs: Vec<String> =
                    self.migs.iter().filter(|(_, (g, _))| *g == gpu).map(|(u, _)| u.clone()).collect();
                for uuid in migs {
                    self.check_recovery(&Target::Mig { gpu, uuid }, &c, now);
                }
            }
        }
    }

    /// Advances `target`'s recovery with a passing probe showing `c`.
    fn check_recovery(&mut self, target: &Target, c: &Counters, now: Instant) {
        let needed = Duration::from_millis(self.config.recovery_check_ms);
        let Some(o) = self.outage_mut(target) else { return };
        if let Some(check) = &mut o.check {
            check.probes += 1;
            if now.duration_since(check.since) >= needed && check.probes >= MIN_PROBES {
                self.recover(target);
            }
            return;
        }
        let how = if o.lost { Some("reattached (the GPU answers NVML again)") } else { reset_seen(&o.baseline, c) };
        let Some(how) = how else { return };
        let previous = o.health();
        o.check = Some(Check { since: now, probes: 1, how });
        let reason = format!("{how}; checking for {} ms before returning it to service", needed.as_millis());
        self.push_health();
        self.health_changed(target, previous, api::Health::Recovering, reason);
    }

    // --- Transitions --------------------------------------------------------------------------

    /// Records a fault that takes `target` out of service (or keeps it out), tells the kubelet,
    /// then publishes the `Fault` (and `HealthChanged`) events.
    fn fault(
        &mut self,
        target: Target,
        kind: api::FaultKind,
        xid_no: Option<u32>,
        reason: String,
        lost: bool,
        counters: Option<Counters>,
    ) {
        let now = Instant::now();
        let baseline = counters.unwrap_or_default();
        let mut reason = reason;
        // The same fault again on a device already out for it: the counters follow (a reset is
        // judged against the latest), the event and the reason wait for REPEAT_REPORT (one every
        // 50 ms helps nobody; a new reason would rebuild what is offered each time).
        if let Some(o) = self.outage_mut(&target)
            && o.fault == kind
            && o.xid == xid_no
            && o.check.is_none()
            && (o.lost || !lost)
        {
            if counters.is_some() {
                o.baseline = baseline;
            }
            o.repeats += 1;
            if now.duration_since(o.reported) < REPEAT_REPORT {
                return;
            }
            reason = format!("{reason} (seen {} times since the last report)", o.repeats);
        }
        let (previous, current) = {
            let existing = self.outage_mut(&target);
            match existing {
                Some(o) => {
                    let previous = o.health();
                    o.fault = kind;
                    o.xid = xid_no.or(if kind == api::FaultKind::GpuLost { o.xid } else { None });
                    o.reason = reason.clone();
                    o.lost |= lost;
                    if counters.is_some() {
                        o.baseline = baseline;
                    }
                    o.check = None;
                    o.reported = now;
                    o.repeats = 0;
                    (previous, o.health())
                }
                None => {
                    let o = Outage {
                        fault: kind,
                        xid: xid_no,
                        reason: reason.clone(),
                        since: now,
                        lost,
                        baseline,
                        check: None,
                        reported: now,
                        repeats: 0,
                    };
                    let current = o.health();
                    match &target {
                        Target::Gpu(i) => {
                            if let Some(w) = self.gpus.get_mut(i) {
                                w.outage = Some(o);
                            }
                        }
                        Target::Mig { gpu, uuid } => {
                            self.migs.insert(uuid.clone(), (*gpu, o));
                        }
                    }
                    (api::Health::Healthy, current)
                }
            }
        };
        self.push_health();
        let affected = self.holders(&target);
        let name = self.name(&target);
        let message = format!(
            "{reason} on {name}: {} ({}){}",
            if previous == api::Health::Healthy { "taken out of service" } else { "kept out of service" },
            health_name(current),
            if affected.is_empty() {
                String::new()
            } else {
                format!("; affects {}", attributed(&affected).trim_start_matches(": "))
            }
        );
        let detail = api::Fault { kind: kind as i32, xid: xid_no, marks_unhealthy: true, health: current as i32 };
        self.publish(
            api::EventKind::Fault,
            api::Severity::Critical,
            &target,
            affected,
            message,
            api::event::Detail::Fault(detail),
        );
        if previous != current {
            self.health_changed(&target, previous, current, reason);
        }
    }

    /// `target` passed its recovery check: back in service.
    fn recover(&mut self, target: &Target) {
        let o = match target {
            Target::Gpu(i) => self.gpus.get_mut(i).and_then(|w| w.outage.take()),
            Target::Mig { uuid, .. } => self.migs.remove(uuid).map(|(_, o)| o),
        };
        let Some(o) = o else { return };
        self.push_health();
        let downtime = o.since.elapsed();
        let how = o.check.as_ref().map_or("check passed", |c| c.how);
        let name = self.name(target);
        let what = match (o.fault, o.xid) {
            (api::FaultKind::Xid, Some(x)) => format!("XID {x}"),
            (api::FaultKind::GpuLost, _) => "lost GPU".to_string(),
            (api::FaultKind::EccDoubleBit, _) => "double-bit ECC error".to_string(),
            _ => "failed probe".to_string(),
        };
        let message =
            format!("{name} recovered from {what} after {:.3} s: {how}; back in service", downtime.as_secs_f64());
        let detail = api::Recovery {
            from: o.fault as i32,
            xid: o.xid,
            downtime_nanos: u64::try_from(downtime.as_nanos()).unwrap_or(u64::MAX),
            how: how.to_string(),
        };
        let affected = self.holders(target);
        self.publish(
            api::EventKind::Recovery,
            api::Severity::Info,
            target,
            affected,
            message,
            api::event::Detail::Recovery(detail),
        );
        self.health_changed(target, api::Health::Recovering, api::Health::Healthy, "recovery check passed".into());
    }

    /// Drops MIG outages whose device no longer exists (its instance was destroyed).
    fn forget_gone_migs(&mut self) {
        if self.migs.is_empty() {
            return;
        }
        let view = self.controller.view();
        let present: BTreeSet<&str> = view
            .inventory
            .gpus
            .iter()
            .flat_map(|g| g.mig.iter().flat_map(|m| &m.instances))
            .flat_map(|gi| gi.devices.iter().map(|d| d.uuid.as_str()))
            .collect();
        let before = self.migs.len();
        self.migs.retain(|uuid, _| {
            let keep = present.contains(uuid.as_str());
            if !keep {
                tracing::info!(device = %uuid, "unhealthy MIG device destroyed; forgotten");
            }
            keep
        });
        if self.migs.len() != before {
            self.push_health();
        }
    }

    // --- Helpers ------------------------------------------------------------------------------

    fn outage_mut(&mut self, target: &Target) -> Option<&mut Outage> {
        match target {
            Target::Gpu(i) => self.gpus.get_mut(i).and_then(|w| w.outage.as_mut()),
            Target::Mig { uuid, .. } => self.migs.get_mut(uuid).map(|(_, o)| o),
        }
    }

    fn health_of(&self, target: &Target) -> api::Health {
        let gpu = match target {
            Target::Gpu(i) | Target::Mig { gpu: i, .. } => *i,
        };
        if let Some(o) = self.gpus.get(&gpu).and_then(|w| w.outage.as_ref()) {
            return o.health();
        }
        match target {
            Target::Mig { uuid, .. } => self.migs.get(uuid).map_or(api::Health::Healthy, |(_, o)| o.health()),
            Target::Gpu(_) => api::Health::Healthy,
        }
    }

    /// Tells the kubelet (and the node API) which devices are out of service.
    fn push_health(&self) {
        let gpus = self.gpus.iter().filter_map(|(i, w)| w.outage.as_ref().map(|o| (*i, o.describe()))).collect();
        let devices = self.migs.iter().map(|(u, (_, o))| (u.clone(), o.describe())).collect();
        self.controller.set_health(crate::device_health::NodeHealth::new(gpus, devices));
    }

    fn mig_uuid(&self, gpu: u32, gi: u32, ci: u32) -> Option<String> {
        self.controller.view().inventory.gpu(gpu)?.mig_device(gi, ci).map(|d| d.uuid.clone())
    }
}

/// XIDs the monitor treats specially.
mod nvml_xid {
    /// The GPU fell off the bus.
    pub const FALLEN_OFF_BUS: u32 = 79;
}

/// ": attributed to alloc-1 (ns/pod/container), …" or "" when nobody holds the device.
fn attributed(holders: &[api::Holder]) -> String {
    if holders.is_empty() {
        return String::new();
    }
    let names: Vec<String> = holders
        .iter()
        .map(|h| {
            let c = h.container.clone().unwrap_or_default();
            if c.pod_name.is_empty() && c.container_name.is_empty() {
                h.allocation_id.clone()
            } else {
                format!("{} ({}/{}/{})", h.allocation_id, c.pod_namespace, c.pod_name, c.container_name)
            }
        })
        .collect();
    format!(": attributed to {}", names.join(", "))
}

#[cfg(test)]
mod tests;
