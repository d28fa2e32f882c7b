//! The compute limiter: each container gets its SM share of a GPU's time, on every launch path,
//! and high-priority containers run first.
//!
//! - `bucket`: the container's budget of GPU nanoseconds, shared by its processes in the region.
//! - `sample`: which throttled launches are measured (every one for long kernels, one in up to
//!   16 for tiny ones) and what each is charged, so that the bucket gets the real GPU time on
//!   average without two CUDA events on every launch.
//! - `measure`: what a measured kernel really took, from CUDA events recorded around it.
//! - `service`: how much of that was the container's own GPU time when other containers' kernels
//!   were time-sliced with it, from NVML's per-process utilization (what a GPU reports, no more).
//! - the ledger (`tessera_region::ledger`): what the other containers on the GPU are doing, as
//!   tesserad publishes it into a file the container only reads (a high-priority neighbour busy,
//!   the others' recent use), for yielding to high priority and for lending idle time in
//!   work-conserving mode. The container tells the daemon its own activity through its region.
//!
//! A device with no share and a normal-priority container takes the fast path: one counter
//! increment in the region and a generation check, nothing else.

mod bucket;
mod measure;
mod sample;
mod service;

use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::time::Duration;

use tessera_region::ledger::{self, Ledger, Watch};
use tessera_region::{ComputeMode, MAX_DEVICES, Priority, monotonic_ns as now_ns};

use crate::state::{self, ShimState};
use crate::trace::Launch;

/// A throttled wait sleeps at most this long before looking again (limits may change meanwhile).
const MAX_NAP_NS: u64 = 5_000_000;
/// The most GPU time a container's compute budget may owe (10 minutes: kernels running that long
/// at once under a share). More was written into the region, not run up by launches: the
/// process fails closed instead of sleeping it off (at a 30% share, `i64::MIN / 2` ns of debt was
/// a sleep of centuries).
const MAX_DEBT_NS: u64 = 600_000_000_000;
/// Before the device's first measurement, a throttled launch waits at most this long for the
/// measured ones in flight (a kernel may wait on work the same thread queues later).
const FIRST_MEASURE_WAIT_NS: u64 = 2_000_000_000;
/// A high-priority container counts as busy for this long after its last launch.
const HIGH_ACTIVE_NS: u64 = 50_000_000;
/// Work-conserving containers leave this much of the GPU unclaimed when borrowing.
const LEND_MARGIN_PPM: i64 = 20_000;

/// What `before_launch` decided, handed back to `after_launch`.
pub struct Gate {
    /// The device and what its bucket was charged, refunded if the driver refuses the launch.
    charged: Option<(usize, i64)>,
    inner: Option<measure::Pending>,
}

impl Gate {
    const PASS: Gate = Gate { charged: None, inner: None };
}

/// Draws which throttled launches are measured; seeded afresh whenever the policy is read.
static RNG: sample::Rng = sample::Rng::new(0);

/// The container-wide settings the limiter needs on every launch, cached per config generation.
#[derive(Clone, Copy)]
struct Policy {
    priority: Priority,
    mode: ComputeMode,
}

/// The policy as of config generation POLICY_GEN (u64::MAX: never read): lock-free, since every
/// launch reads it.
static POLICY_GEN: AtomicU64 = AtomicU64::new(u64::MAX);
static POLICY_BITS: AtomicU64 = AtomicU64::new(0);

fn policy(st: &ShimState) -> Policy {
    let generation = st.region.config_generation();
    if POLICY_GEN.load(Acquire) != generation {
        let limits = st.limits();
        let bits = limits.priority as u64 | (limits.compute_mode as u64) << 8;
        POLICY_BITS.store(bits, Relaxed);
        RNG.reseed(now_ns() ^ u64::from(std::process::id()).rotate_left(32));
        POLICY_GEN.store(generation, Release);
    }
    let bits = POLICY_BITS.load(Relaxed);
    let priority = match bits & 0xff {
        x if x == Priority::High as u64 => Priority::High,
        x if x == Priority::Low as u64 => Priority::Low,
        _ => Priority::Normal,
    };
    let mode = if (bits >> 8) & 0xff == ComputeMode::WorkConserving as u64 {
        ComputeMode::WorkConserving
    } else {
        ComputeMode::Strict
    };
    Policy { priority, mode }
}

/// The daemon's view of the others on this container's GPUs, opened on first need: the one in
/// the mounted allocation directory (a tenant's `TESSERA_LEDGER` must not hide a high-priority
/// neighbour), else `TESSERA_LEDGER`, else `ledger` beside the limits file. None (standalone,
/// or an older daemon): no yielding and no lending, said once.
fn the_ledger() -> Option<&'static Ledger> {
    static L: OnceLock<Option<Ledger>> = OnceLock::new();
    L.get_or_init(|| {
        let mounted = state::mounted_alloc_dir().map(|dir| dir.join(ledger::LEDGER_FILE));
        let path = mounted
            .or_else(|| {
                ledger::ledger_path(
                    std::env::var_os(ledger::ENV_LEDGER).as_deref(),
                    std::env::var_os(tessera_region::ENV_LIMITS).as_deref(),
                )
            })
            .or_else(|| {
                eprintln!(
                    "tessera: no ledger (TESSERA_LEDGER, or a limits file beside one); priorities and lending are off"
                );
                None
            })?;
        Ledger::open_ro(&path).map_err(|e| eprintln!("tessera: {e}; priorities and lending are off")).ok()
    })
    .as_ref()
}

/// The others on region device `dev`, as the daemon last published them.
fn view(st: &ShimState, dev: usize) -> Option<&'static ledger::DeviceView> {
    the_ledger()?.view(st.region.device_key(dev))
}

/// Called by every launch hook (cuLaunchKernel, _ptsz, Ex, cooperative, graph launch) before the
/// real driver call, with the launch's region device index and stream. May block to enforce the
/// container's SM share or to yield to a high-priority container. `trace`: a trace is being
/// recorded and this launch (its hook and kernel) is traced: the kernel is measured (also when not
/// throttled) and recorded as a kernel span once complete.
pub fn before_launch(dev: usize, stream: *mut c_void, trace: Option<Launch>) -> Gate {
    let Some(st) = state::get() else { return Gate::PASS };
    st.region.record_launch(st.slot, dev);
    let share = st.sm_percent(dev).filter(|&p| p < 100);
    let p = policy(st);
    if share.is_none() && p.priority == Priority::Normal {
        return match trace {
            None => Gate::PASS,
            Some(f) => traced_only(st, dev, stream, f),
        };
    }
    match p.priority {
        Priority::High => {
            // Seen by the daemon, which tells the low-priority containers on this GPU.
            st.region.bucket(dev).high_launches.fetch_add(1, Relaxed);
            return match trace {
                None => Gate::PASS,
                Some(f) => traced_only(st, dev, stream, f),
            };
        }
        Priority::Low => yield_to_high(st, dev),
        Priority::Normal => {}
    }
    match share {
        Some(pct) => throttle(st, dev, pct, p, stream, trace),
        None => match trace {
            None => Gate::PASS,
            Some(f) => traced_only(st, dev, stream, f),
        },
    }
}

/// A launch the limiter lets through, measured only for the trace: nothing is charged.
#[cold]
fn traced_only(st: &'static ShimState, dev: usize, stream: *mut c_void, f: Launch) -> Gate {
    measure::harvest(st);
    Gate { charged: None, inner: measure::start(st, dev, stream, None, Some(f)) }
}

/// Called after the real driver call; `accepted` is whether it returned CUDA_SUCCESS: a refused
/// launch is refunded its charge.
pub fn after_launch(gate: Gate, accepted: bool) {
    let Some(st) = state::get() else { return };
    if !accepted && let Some((dev, charge)) = gate.charged {
        bucket::correct(st.region.bucket(dev), -charge);
    }
    if let Some(p) = gate.inner {
        measure::finish(st, p, accepted);
    }
}

/// A low-priority container waits while a high-priority one on its GPU is busy.
fn yield_to_high(st: &ShimState, dev: usize) {
    /// When this process last saw each device's high-priority count change.
    static WATCHES: [Watch; MAX_DEVICES] = [const { Watch::new() }; MAX_DEVICES];
    let (Some(v), Some(w)) = (view(st, dev), WATCHES.get(dev)) else { return };
    let begin = now_ns();
    while w.high_active(v, now_ns(), HIGH_ACTIVE_NS) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let waited = now_ns() - begin;
    if waited > 1_000_000 {
        st.region.record_throttled(st.slot, dev, waited);
    }
}

/// The share this launch is held to: the container's own, or in work-conserving mode whatever
/// the others on the GPU leave idle, if that is more.
fn effective_ppm(st: &ShimState, dev: usize, pct: u32, p: Policy) -> i64 {
    let own = bucket::share_ppm(pct);
    if p.mode != ComputeMode::WorkConserving {
        return own;
    }
    // No ledger: the others are unknown, so nothing is borrowed. A ledger without this device:
    // the daemon has no neighbour on it to tell of.
    let Some(l) = the_ledger() else { return own };
    let others = l.view(st.region.device_key(dev)).map_or(0, |v| v.others_usage_ppm());
    let idle = 1_000_000 - others.min(1_000_000) as i64 - LEND_MARGIN_PPM;
    own.max(idle)
}

/// Until a kernel has been measured on the device, every launch there is charged a guess (100
/// µs): a program queueing kernels of 500 ms ran one of them per launch it queued before the
/// first was measured, a whole queue past its share. So the second launch waits for the first
/// measurement (at most [`FIRST_MEASURE_WAIT_NS`]): one kernel's overshoot at most, the one
/// the share's accounting allows any launch (a launch is let through whole).
fn first_measurement(st: &ShimState, dev: usize) {
    let sampler = measure::sampler(dev);
    if sampler.measured() || measure::in_flight() == 0 {
        return;
    }
    let begin = now_ns();
    loop {
        measure::harvest(st);
        if sampler.measured() || measure::in_flight() == 0 || now_ns() - begin >= FIRST_MEASURE_WAIT_NS {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    st.region.record_throttled(st.slot, dev, now_ns() - begin);
}

fn throttle(
    st: &'static ShimState,
    dev: usize,
    mut pct: u32,
    p: Policy,
    stream: *mut c_void,
    trace: Option<Launch>,
) -> Gate {
    let b = st.region.bucket(dev);
    // Before the plan: the launch after the device's first is charged what that one took.
    first_measurement(st, dev);
    // Decided first, before anything about this launch is known (a traced launch is measured
    // for the trace anyway, so at weight 1).
    let plan = measure::sampler(dev).plan(&RNG, trace.is_some());
    // A launch captured into a graph (`cuStreamBeginCapture`) runs nothing: the graph's
    // launches are charged, by their kernels. Asked of measured launches only (one driver call
    // more there): an unmeasured one captured is charged the mean, as before.
    if plan.measure && measure::capturing(stream) {
        return Gate::PASS;
    }
    // Completed measurements are settled on measured launches and before any wait, not on every
    // launch: an unmeasured launch of a tiny kernel takes no lock and makes no driver call here.
    let mut settled = false;
    let charge = loop {
        let now = now_ns();
        let ppm = effective_ppm(st, dev, pct, p);
        if plan.measure || settled {
            measure::harvest(st);
        }
        if let Some(used_ppm) =
            service::maybe_update(st, dev, now, measure::in_flight() as u64, measure::sampler(dev).expected() as u64)
        {
            // For the daemon, which tells the others on the GPU (their lending).
            b.usage_ppm.store(used_ppm, Relaxed);
            b.usage_updates.fetch_add(1, Release);
        }
        bucket::refill(b, now, ppm);
        match bucket::try_take(b, plan.charge, ppm) {
            Ok(()) => break Some(plan.charge),
            // Settled corrections may be refunds: look at them before waiting.
            Err(_) if !settled => settled = true,
            Err(wait) => {
                // A debt no launch of this container could have run up was written into the
                // region (or garbage was): sleeping on it could be forever. Fail closed.
                if wait > MAX_DEBT_NS.saturating_mul(1_000_000) / ppm.max(1) as u64 {
                    st.fail_closed("its compute budget owes more GPU time than any launch could have taken");
                    break None;
                }
                if !st.region_intact() {
                    break None;
                }
                std::thread::sleep(Duration::from_nanos(wait.clamp(20_000, MAX_NAP_NS)));
                st.region.record_throttled(st.slot, dev, now_ns() - now);
                // The share may have changed, or been lifted, while we slept.
                st.refresh();
                match st.sm_percent(dev).filter(|&p| p < 100) {
                    Some(p) => pct = p,
                    None => break None,
                }
            }
        }
    };
    let Some(charge) = charge else {
        // The share was lifted: nothing charged, measured only for a trace.
        return Gate { charged: None, inner: trace.and_then(|f| measure::start(st, dev, stream, None, Some(f))) };
    };
    let inner = if plan.measure { measure::start(st, dev, stream, Some(plan), trace) } else { None };
    Gate { charged: Some((dev, charge)), inner }
}
