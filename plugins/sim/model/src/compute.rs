//! Kernel time: each execution unit (a whole GPU or one MIG compute instance) serves the streams
//! that have work, in order within a stream, time-sliced among processes.
//!
//! The model is a fluid processor-sharing queue evaluated lazily: whoever touches a unit (a
//! launch, a query, a wait, an NVML utilization read) first advances it to "now". Between two
//! changes each busy process gets 1/P of the unit, split evenly among its busy streams, so a
//! process's received time is what NVML calls its SM utilization, and a stream's work finishes
//! when its served time reaches the work submitted before it. Events are stamped with the exact
//! instant their stream reached them, so elapsed times are what a busy GPU would report.

use std::sync::atomic::Ordering::*;
use std::time::Duration;

use crate::clock::monotonic_ns;
use crate::layout::*;
use crate::region::Guard;
use crate::{Node, Result, SimError};

/// A stream of this process (index into its slot's stream table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamId(pub u32);

/// Total work submitted to a stream up to and including some launch; it is done when the
/// stream's served time reaches it.
pub type Ticket = u64;

/// A recorded event: the instant its stream reached it, once known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventMark {
    pub stream: StreamId,
    pub ticket: Ticket,
    state: MarkState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MarkState {
    Done(u64),
    Pending {
        index: u32,
        generation: u32,
    },
    /// The pending table was full: completion is observed, not stamped, when next seen.
    Unstamped,
}

impl EventMark {
    /// The monotonic completion time, if the event is known to be complete.
    pub fn done_at(&self) -> Option<u64> {
        match self.state {
            MarkState::Done(t) => Some(t),
            _ => None,
        }
    }
}

/// Utilization snapshots are taken at most this often (the ring then spans 1.6 s).
const SNAPSHOT_NS: u64 = 50_000_000;

fn place(gpu: u32, unit: usize) -> u32 {
    gpu << 8 | unit as u32
}

struct Active {
    slot: usize,
    stream: usize,
    /// P * S_p: one unit of this stream's work takes this many ns of wall time.
    divisor: u64,
}

/// Streams with work on a unit, with their sharing divisors.
fn active_streams(g: &Guard, key: u32) -> Vec<Active> {
    let s = g.shared();
    let mut out = Vec::new();
    let mut procs = 0u64;
    for slot in g.used_slots() {
        let p = &s.procs[slot];
        let first = out.len();
        for (w, word) in p.active_streams.iter().enumerate() {
            let mut bits = word.load(Relaxed);
            while bits != 0 {
                let i = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if p.streams[i].place.load(Relaxed) == key {
                    out.push(Active { slot, stream: i, divisor: 0 });
                }
            }
        }
        let n = (out.len() - first) as u64;
        if n > 0 {
            procs += 1;
            for a in &mut out[first..] {
                a.divisor = n;
            }
        }
    }
    for a in &mut out {
        a.divisor *= procs;
    }
    out
}

/// Serves a unit's streams up to `now`, stamping events and utilization snapshots on the way.
pub(crate) fn advance(g: &Guard, gpu: u32, unit: usize, now: u64) {
    let s = g.shared();
    let us = &s.gpus[gpu as usize].units[unit];
    let mut t = us.served_until.load(Relaxed);
    if t == 0 || t > now {
        t = now;
    }
    let key = place(gpu, unit);
    let mut active = active_streams(g, key);
    while t < now {
        if active.is_empty() {
            if unit == 0 {
                snapshot_if_due(g, gpu, now);
            }
            t = now;
            break;
        }
        let drain = active
            .iter()
            .map(|a| {
                let st = &s.procs[a.slot].streams[a.stream];
                (st.submitted.load(Relaxed) - st.served.load(Relaxed)).saturating_mul(a.divisor)
            })
            .min()
            .unwrap_or(u64::MAX);
        let mut step = drain.min(now - t);
        if unit == 0 {
            let last =
                s.gpus[gpu as usize].util[slot_of(s.gpus[gpu as usize].util_head.load(Relaxed))].ts.load(Relaxed);
            if last > 0 && t >= last {
                step = step.min((last + SNAPSHOT_NS).saturating_sub(t).max(1));
            }
        }
        let mut drained = false;
        for a in &active {
            let p = &s.procs[a.slot];
            let st = &p.streams[a.stream];
            let served = st.served.load(Relaxed);
            let left = st.submitted.load(Relaxed) - served;
            let inc = if left.saturating_mul(a.divisor) <= step { left } else { step / a.divisor };
            if inc == left {
                drained = true;
            }
            stamp_events(p, a.stream, served, served + inc, t, a.divisor);
            st.served.store(served + inc, Relaxed);
            p.served[gpu as usize][unit].fetch_add(inc, Relaxed);
        }
        us.busy_ns.fetch_add(step, Relaxed);
        t += step;
        if unit == 0 {
            us.served_until.store(t, Relaxed);
            snapshot_if_due(g, gpu, t);
        }
        if drained {
            for a in &active {
                let p = &s.procs[a.slot];
                let st = &p.streams[a.stream];
                if st.served.load(Relaxed) >= st.submitted.load(Relaxed) {
                    p.active_streams[a.stream / 64].fetch_and(!(1 << (a.stream % 64)), Relaxed);
                }
            }
            active = active_streams(g, key);
        }
    }
    us.served_until.store(t, Relaxed);
}

fn stamp_events(p: &ProcSlot, stream: usize, from: u64, to: u64, t0: u64, divisor: u64) {
    let mut bits = p.pending_mask.load(Relaxed);
    while bits != 0 {
        let i = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let ev = &p.events[i];
        if ev.stream.load(Relaxed) as usize != stream || ev.done_ts.load(Relaxed) != 0 {
            continue;
        }
        let ticket = ev.ticket.load(Relaxed);
        if ticket <= to {
            ev.done_ts.store(t0 + ticket.saturating_sub(from) * divisor, Relaxed);
        }
    }
}

fn slot_of(head: u64) -> usize {
    (head % UTIL_RING as u64) as usize
}

fn snapshot_if_due(g: &Guard, gpu: u32, t: u64) {
    let gs = &g.shared().gpus[gpu as usize];
    let head = gs.util_head.load(Relaxed);
    let last = gs.util[slot_of(head)].ts.load(Relaxed);
    if last != 0 && t < last + SNAPSHOT_NS {
        return;
    }
    let next = if last == 0 { head } else { head + 1 };
    let snap = &gs.util[slot_of(next)];
    snap.ts.store(t, Relaxed);
    snap.busy_ns.store(gs.units[0].busy_ns.load(Relaxed), Relaxed);
    for (i, cell) in snap.served.iter().enumerate() {
        let used = g.shared().header.used_slots[i / 64].load(Relaxed) & (1 << (i % 64)) != 0;
        cell.store(if used { g.shared().procs[i].served[gpu as usize][0].load(Relaxed) } else { 0 }, Relaxed);
    }
    gs.util_head.store(next, Relaxed);
}

/// Per-process share of a window: GPU utilization and what each process received.
#[derive(Debug, Clone, PartialEq)]
pub struct UtilWindow {
    pub from_ns: u64,
    pub to_ns: u64,
    /// Percent of the window the GPU was executing something.
    pub gpu_percent: u32,
    /// (pid, percent of the window its kernels ran) for every process that ran.
    pub processes: Vec<(u32, u32)>,
}

impl Node {
    fn own_stream(&self, s: StreamId) -> Result<(usize, &StreamState)> {
        let slot = self.region.own_slot()?;
        let st = self.region.shared().procs[slot]
            .streams
            .get(s.0 as usize)
            .ok_or_else(|| SimError::InvalidArgument(format!("stream {}", s.0)))?;
        if st.place.load(Relaxed) == FREE_STREAM {
            return Err(SimError::InvalidArgument(format!("stream {} is not open", s.0)));
        }
        Ok((slot, st))
    }

    fn check_unit(&self, g: &Guard, gpu: u32, unit: usize) -> Result<()> {
        self.check_gpu(gpu)?;
        if unit >= UNITS {
            return Err(SimError::InvalidArgument(format!("execution unit {unit}")));
        }
        let gs = &g.shared().gpus[gpu as usize];
        let mig = gs.mig_current.load(Relaxed) != 0;
        if (unit == 0 && mig) || (unit > 0 && gs.cis[unit - 1].valid.load(Relaxed) == 0) {
            return Err(SimError::NotFound(format!("execution unit {unit} on GPU {gpu}")));
        }
        Ok(())
    }

    /// Opens a stream on an execution unit (0: the whole GPU; 1 + k: compute-instance slot k).
    pub fn stream_create(&self, gpu: u32, unit: usize, priority: i32) -> Result<StreamId> {
        let slot = self.region.own_slot()?;
        let g = self.region.lock();
        self.check_unit(&g, gpu, unit)?;
        let p = &g.shared().procs[slot];
        let i = p
            .streams
            .iter()
            .position(|s| s.place.load(Relaxed) == FREE_STREAM)
            .ok_or(SimError::TooMany("streams in this process"))?;
        let st = &p.streams[i];
        st.submitted.store(0, Relaxed);
        st.served.store(0, Relaxed);
        st.priority.store(priority, Relaxed);
        st.place.store(place(gpu, unit), Relaxed);
        Ok(StreamId(i as u32))
    }

    /// Closes a stream; work still queued on it is dropped from the unit.
    pub fn stream_destroy(&self, s: StreamId) {
        let Ok((slot, st)) = self.own_stream(s) else { return };
        let g = self.region.lock();
        let key = st.place.load(Relaxed);
        advance(&g, key >> 8, (key & 0xff) as usize, monotonic_ns());
        let p = &g.shared().procs[slot];
        p.active_streams[s.0 as usize / 64].fetch_and(!(1 << (s.0 % 64)), Relaxed);
        st.place.store(FREE_STREAM, Relaxed);
    }

    /// Queues `duration_ns` of kernel time on a stream; returns the ticket that marks its end.
    pub fn launch(&self, s: StreamId, duration_ns: u64) -> Result<Ticket> {
        let (slot, st) = self.own_stream(s)?;
        let key = st.place.load(Relaxed);
        let (gpu, unit) = (key >> 8, (key & 0xff) as usize);
        let g = self.region.lock();
        self.check_gpu(gpu)?;
        advance(&g, gpu, unit, monotonic_ns());
        let ticket = st.submitted.load(Relaxed) + duration_ns;
        st.submitted.store(ticket, Relaxed);
        if duration_ns > 0 {
            g.shared().procs[slot].active_streams[s.0 as usize / 64].fetch_or(1 << (s.0 % 64), Relaxed);
        }
        Ok(ticket)
    }

    /// The ticket of everything queued on a stream so far.
    pub fn stream_tail(&self, s: StreamId) -> Result<Ticket> {
        Ok(self.own_stream(s)?.1.submitted.load(Relaxed))
    }

    /// Whether a stream has served `ticket`.
    pub fn stream_reached(&self, s: StreamId, ticket: Ticket) -> Result<bool> {
        Ok(self.progress(s, ticket)?.is_none())
    }

    /// None when done, else a lower bound on the wall time still needed.
    fn progress(&self, s: StreamId, ticket: Ticket) -> Result<Option<u64>> {
        let (slot, st) = self.own_stream(s)?;
        let key = st.place.load(Relaxed);
        let (gpu, unit) = (key >> 8, (key & 0xff) as usize);
        if st.served.load(Acquire) >= ticket {
            return Ok(None);
        }
        let g = self.region.lock();
        self.check_gpu(gpu)?;
        advance(&g, gpu, unit, monotonic_ns());
        let served = st.served.load(Relaxed);
        if served >= ticket {
            return Ok(None);
        }
        let divisor = active_streams(&g, key)
            .iter()
            .find(|a| a.slot == slot && a.stream == s.0 as usize)
            .map_or(1, |a| a.divisor);
        Ok(Some((ticket - served).saturating_mul(divisor)))
    }

    /// Blocks until a stream has served `ticket` (or its GPU is lost, or `timeout` passes).
    pub fn stream_wait(&self, s: StreamId, ticket: Ticket, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(|t| monotonic_ns().saturating_add(t.as_nanos() as u64));
        while let Some(left) = self.progress(s, ticket)? {
            if let Some(d) = deadline
                && monotonic_ns() >= d
            {
                return Err(SimError::Timeout);
            }
            wait_a_little(left);
        }
        Ok(())
    }

    /// Records an event at the current tail of a stream.
    pub fn event_record(&self, s: StreamId) -> Result<EventMark> {
        let (slot, st) = self.own_stream(s)?;
        let key = st.place.load(Relaxed);
        let g = self.region.lock();
        let now = monotonic_ns();
        advance(&g, key >> 8, (key & 0xff) as usize, now);
        let ticket = st.submitted.load(Relaxed);
        if st.served.load(Relaxed) >= ticket {
            return Ok(EventMark { stream: s, ticket, state: MarkState::Done(now) });
        }
        let p = &g.shared().procs[slot];
        let mask = p.pending_mask.load(Relaxed);
        if mask == u64::MAX {
            return Ok(EventMark { stream: s, ticket, state: MarkState::Unstamped });
        }
        let index = (!mask).trailing_zeros() as usize;
        let ev = &p.events[index];
        let generation = ev.generation.load(Relaxed).wrapping_add(1);
        ev.generation.store(generation, Relaxed);
        ev.stream.store(s.0, Relaxed);
        ev.ticket.store(ticket, Relaxed);
        ev.done_ts.store(0, Relaxed);
        p.pending_mask.fetch_or(1 << index, Relaxed);
        Ok(EventMark { stream: s, ticket, state: MarkState::Pending { index: index as u32, generation } })
    }

    /// Whether an event is complete; on completion its time is fixed in the mark.
    pub fn event_poll(&self, mark: &mut EventMark) -> Result<bool> {
        match mark.state {
            MarkState::Done(_) => return Ok(true),
            MarkState::Unstamped => {
                if self.stream_reached(mark.stream, mark.ticket)? {
                    mark.state = MarkState::Done(monotonic_ns());
                    return Ok(true);
                }
                return Ok(false);
            }
            MarkState::Pending { .. } => {}
        }
        if !self.stream_reached(mark.stream, mark.ticket)? {
            return Ok(false);
        }
        let MarkState::Pending { index, generation } = mark.state else { unreachable!() };
        let slot = self.region.own_slot()?;
        let _g = self.region.lock();
        let p = &self.region.shared().procs[slot];
        let ev = &p.events[index as usize];
        let done = if ev.generation.load(Relaxed) == generation { ev.done_ts.load(Relaxed) } else { 0 };
        mark.state = MarkState::Done(if done == 0 { monotonic_ns() } else { done });
        if ev.generation.load(Relaxed) == generation {
            p.pending_mask.fetch_and(!(1 << index), Relaxed);
        }
        Ok(true)
    }

    /// Blocks until an event is complete; returns its monotonic completion time.
    pub fn event_wait(&self, mark: &mut EventMark) -> Result<u64> {
        self.stream_wait(mark.stream, mark.ticket, None)?;
        self.event_poll(mark)?;
        Ok(mark.done_at().unwrap_or_else(monotonic_ns))
    }

    /// Forgets an event that will not be waited for (frees its pending entry).
    pub fn event_forget(&self, mark: &EventMark) {
        if let (MarkState::Pending { index, generation }, Some(slot)) = (mark.state, self.region.own_slot_if_any()) {
            let _g = self.region.lock();
            let p = &self.region.shared().procs[slot];
            if p.events[index as usize].generation.load(Relaxed) == generation {
                p.pending_mask.fetch_and(!(1 << index), Relaxed);
            }
        }
    }

    /// GPU time this process has received on a unit, in ns.
    pub fn own_gpu_time(&self, gpu: u32, unit: usize) -> u64 {
        self.region.own_proc().and_then(|p| p.served.get(gpu as usize)?.get(unit)).map_or(0, |c| c.load(Relaxed))
    }

    /// Utilization of a whole GPU over the window ending now that starts at `since_ns`
    /// (monotonic), or over about the last second when `since_ns` is 0 or older than the history.
    pub fn utilization(&self, gpu: u32, since_ns: u64) -> Result<UtilWindow> {
        let g = self.region.lock();
        self.check_gpu(gpu)?;
        let now = monotonic_ns();
        advance(&g, gpu, 0, now);
        let gs = &g.shared().gpus[gpu as usize];
        let head = gs.util_head.load(Relaxed);
        let want = if since_ns == 0 { now.saturating_sub(1_000_000_000) } else { since_ns };
        // The newest snapshot at or before `want` (else the oldest one kept), and the one after it.
        let mut base = None;
        let mut after = None;
        for back in 0..UTIL_RING as u64 {
            let Some(i) = head.checked_sub(back) else { break };
            let snap = &gs.util[slot_of(i)];
            let ts = snap.ts.load(Relaxed);
            if ts == 0 || ts > now {
                break;
            }
            if ts <= want {
                after = base;
                base = Some(snap);
                break;
            }
            // Newest first: the last one seen after `want` is the one right after the base.
            base = Some(snap);
        }
        let used: Vec<usize> = g.used_slots().collect();
        let Some(base) = base.filter(|b| b.ts.load(Relaxed) < now) else {
            return Ok(UtilWindow { from_ns: now, to_ns: now, gpu_percent: 0, processes: Vec::new() });
        };
        // The window starts at `want`, not at the snapshot before it: the counters are read there
        // between that snapshot and the next (or now), as GPU time accrues evenly between two
        // snapshots 50 ms apart at most. Starting at the older snapshot instead dilutes a window
        // that holds a burst of work with the idle time before it (a 30% share of 100 ms kernels
        // read about a fifth short, and the shim, which scales spans by it, let them through at 0.37).
        let base_ts = base.ts.load(Relaxed);
        let from = want.max(base_ts).min(now - 1);
        // The snapshot after the base, or the live counters now when there is none.
        let next_ts = after.map_or(now, |a| a.ts.load(Relaxed));
        let next_busy = after.map_or_else(|| gs.units[0].busy_ns.load(Relaxed), |a| a.busy_ns.load(Relaxed));
        let next_served = |s: usize| {
            after.map_or_else(
                || g.shared().procs[s].served[gpu as usize][0].load(Relaxed),
                |a| a.served[s].load(Relaxed),
            )
        };
        let at_from = |old: u64, new: u64| {
            let gap = next_ts.saturating_sub(base_ts).max(1);
            old + (new.saturating_sub(old) as u128 * from.saturating_sub(base_ts) as u128 / gap as u128) as u64
        };
        let span = (now - from).max(1);
        let busy = gs.units[0].busy_ns.load(Relaxed).saturating_sub(at_from(base.busy_ns.load(Relaxed), next_busy));
        let pct = |x: u64| ((x as u128 * 100 + span as u128 / 2) / span as u128).min(100) as u32;
        let mut processes = Vec::new();
        for s in used {
            let p = &g.shared().procs[s];
            let start = at_from(base.served[s].load(Relaxed), next_served(s));
            let got = p.served[gpu as usize][0].load(Relaxed).saturating_sub(start);
            if got > 0 || p.ctx_units[gpu as usize].load(Relaxed) & 1 != 0 {
                processes.push((p.pid.load(Relaxed), pct(got)));
            }
        }
        Ok(UtilWindow { from_ns: from, to_ns: now, gpu_percent: pct(busy), processes })
    }
}

/// Sleeps most of an expected wait, then yields, the way CUDA's auto sync mode spins: a sleep
/// alone would add the scheduler's wake-up latency to every short kernel.
fn wait_a_little(expected_ns: u64) {
    const SPIN_BELOW: u64 = 200_000;
    const MAX_SLEEP: u64 = 2_000_000;
    if expected_ns > SPIN_BELOW {
        std::thread::sleep(Duration::from_nanos((expected_ns - SPIN_BELOW / 2).min(MAX_SLEEP)));
    } else {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::*;

    const MS: u64 = 1_000_000;

    /// Records an event, queues `ms` of work, records another, all behind a long kernel that
    /// keeps the stream busy: both events are then stamped by the model where the queued work
    /// reaches them, not when the host's calls land. `None` if the host was so late that the long
    /// kernel had ended first (the caller tries again).
    fn timed_behind_busy_stream(t: &TestNode, s: crate::StreamId, ms: u64) -> Option<u64> {
        let busy = t.node.launch(s, 50 * MS).unwrap();
        let mut start = t.node.event_record(s).unwrap();
        let ticket = t.node.launch(s, ms * MS).unwrap();
        let mut end = t.node.event_record(s).unwrap();
        let in_time = !t.node.stream_reached(s, busy).unwrap();
        assert!(!t.node.event_poll(&mut end).unwrap(), "queued work is not done at once");
        t.node.stream_wait(s, ticket, None).unwrap();
        let elapsed = t.node.event_wait(&mut end).unwrap() - t.node.event_wait(&mut start).unwrap();
        in_time.then_some(elapsed)
    }

    #[test]
    fn a_kernel_takes_its_duration_and_events_time_it() {
        let t = default_node();
        let s = t.node.stream_create(0, 0, 0).unwrap();
        // Stamped by the model: exactly the kernel's 2 ms of GPU time (no wall-clock slack: the
        // host's own delays between its calls do not enter).
        let mut tries = 0;
        let elapsed = loop {
            tries += 1;
            assert!(tries <= 5, "the host kept up once in 5 tries");
            if let Some(e) = timed_behind_busy_stream(&t, s, 2) {
                break e;
            }
        };
        assert_eq!(elapsed, 2 * MS);
        assert_eq!(t.node.own_gpu_time(0, 0), tries * 52 * MS, "each try ran its 50 + 2 ms");
        // An event on an idle stream is done at once.
        let mut idle = t.node.event_record(s).unwrap();
        assert!(t.node.event_poll(&mut idle).unwrap());
    }

    #[test]
    fn streams_run_in_order() {
        let t = default_node();
        let s = t.node.stream_create(0, 0, 0).unwrap();
        let a = t.node.launch(s, MS).unwrap();
        let b = t.node.launch(s, 200 * MS).unwrap();
        assert_eq!(b, a + 200 * MS);
        t.node.stream_wait(s, a, None).unwrap();
        // The second kernel starts only when the first ends, so it has 200 ms still to go.
        assert!(!t.node.stream_reached(s, b).unwrap());
        t.node.stream_wait(s, b, None).unwrap();
        assert!(t.node.stream_reached(s, b).unwrap());
    }

    /// Runs `attempt` (on a node of its own) until the host made its timed calls in time: it
    /// returns `None` when they took longer than its test allows. With the calls close enough
    /// together, the model's timeline is what the test computes, whatever else the machine does.
    fn until_in_time<T>(mut attempt: impl FnMut() -> Option<T>) -> T {
        (0..20).find_map(|_| attempt()).expect("the host made the calls in time once in 20 tries")
    }

    #[test]
    fn two_processes_share_a_gpu_evenly() {
        let (t, other, ea, eb) = until_in_time(|| {
            let t = default_node();
            let other = reopen(&t.state);
            let a = t.node.stream_create(3, 0, 0).unwrap();
            let b = other.stream_create(3, 0, 0).unwrap();
            let began = std::time::Instant::now();
            let mut a0 = t.node.event_record(a).unwrap();
            let mut b0 = other.event_record(b).unwrap();
            t.node.launch(a, 20 * MS).unwrap();
            other.launch(b, 20 * MS).unwrap();
            let mut a1 = t.node.event_record(a).unwrap();
            let mut b1 = other.event_record(b).unwrap();
            // Within 2 ms B starts at most 2 ms after A, so each ends 38-42 ms after its start
            // event (A alone for that while, then both at half speed).
            let in_time = began.elapsed() < std::time::Duration::from_millis(2);
            let ea = t.node.event_wait(&mut a1).unwrap() - t.node.event_wait(&mut a0).unwrap();
            let eb = other.event_wait(&mut b1).unwrap() - other.event_wait(&mut b0).unwrap();
            in_time.then_some((t, other, ea, eb))
        });
        // Both ran at half speed while the other was busy: ~40 ms each, 20 ms of GPU time each.
        for e in [ea, eb] {
            assert!((38 * MS..=42 * MS).contains(&e), "elapsed {e} ns");
        }
        assert_eq!(t.node.own_gpu_time(3, 0), 20 * MS);
        assert_eq!(other.own_gpu_time(3, 0), 20 * MS);
        let u = t.node.utilization(3, 0).unwrap();
        assert!(u.gpu_percent > 0);
        assert_eq!(u.processes.len(), 2);
    }

    #[test]
    fn a_process_with_two_streams_gets_one_share() {
        let elapsed = until_in_time(|| {
            let t = default_node();
            let other = reopen(&t.state);
            let a1 = t.node.stream_create(0, 0, 0).unwrap();
            let a2 = t.node.stream_create(0, 0, 0).unwrap();
            let b = other.stream_create(0, 0, 0).unwrap();
            let began = std::time::Instant::now();
            t.node.launch(a1, 10 * MS).unwrap();
            t.node.launch(a2, 10 * MS).unwrap();
            let mut b0 = other.event_record(b).unwrap();
            other.launch(b, 10 * MS).unwrap();
            let mut b1 = other.event_record(b).unwrap();
            // Within 1 ms B's kernel starts at most 1 ms after its start event, with A still busy.
            let in_time = began.elapsed() < std::time::Duration::from_millis(1);
            let elapsed = other.event_wait(&mut b1).unwrap() - other.event_wait(&mut b0).unwrap();
            in_time.then_some(elapsed)
        });
        // B had half the GPU (A's two streams share A's half), so its 10 ms took 20 ms, not the
        // 30 ms that sharing per stream would give.
        assert!((20 * MS..=21 * MS).contains(&elapsed), "B's 10 ms kernel took {elapsed} ns");
    }

    #[test]
    fn utilization_reports_a_busy_gpu() {
        let t = default_node();
        let s = t.node.stream_create(5, 0, 0).unwrap();
        let start = crate::monotonic_ns();
        let mut last = 0;
        for _ in 0..30 {
            last = t.node.launch(s, 5 * MS).unwrap();
        }
        t.node.stream_wait(s, last, None).unwrap();
        // Queued back to back, the work kept the GPU busy from the first launch to the last end.
        let u = t.node.utilization(5, start).unwrap();
        assert!(u.gpu_percent >= 90, "busy GPU shows {}%", u.gpu_percent);
        assert_eq!(u.processes.len(), 1);
        assert!(u.processes[0].1 >= 90);
        let idle = t.node.utilization(6, 0).unwrap();
        assert_eq!(idle.gpu_percent, 0);
    }

    #[test]
    fn dead_process_work_leaves_the_gpu() {
        let t = default_node();
        let (mut c, _out) = child(&format!("launch 4 {}", 10_000 * MS), &t.state);
        let s = t.node.stream_create(4, 0, 0).unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
        t.node.reap();
        let tk = t.node.launch(s, MS).unwrap();
        let begin = crate::monotonic_ns();
        t.node.stream_wait(s, tk, None).unwrap();
        assert!(crate::monotonic_ns() - begin < 500 * MS, "the dead process's 10 s of work no longer shares the GPU");
    }
}
