//! A kernel's span on its stream is its own GPU time only while nothing else runs on the GPU;
//! time-sliced with another container's kernels it lasts longer than the time it got. NVML's
//! per-process utilization tells what the container's processes really got (a real GPU reports
//! it, so it is fair to use): every window, the container's first launcher compares that with
//! the spans it measured, and the ratio scales spans into GPU time until the next window.

use std::ffi::{CString, c_uint};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlProcessUtilizationSample_t, nvmlReturn_enum_NVML_SUCCESS};
use tessera_region::MAX_DEVICES;

use crate::real;
use crate::state::ShimState;

/// How often the factor is brought up to date.
const WINDOW_NS: u64 = 100_000_000;
/// A window closes while at most this much GPU time of measured launches is in flight (it may
/// have run in the window, and counts in the next): 5% of a window.
const MAX_UNALIGNED_NS: u64 = WINDOW_NS / 20;
/// Kernels this short are many to a window: those in flight at its start and at its end are
/// alike in steady state, and cancel out (4 containers queueing 64 kernels of 100 µs each,
/// time-sliced, hold 25 ms in flight at any time).
const SHORT_KERNEL_NS: u64 = WINDOW_NS / 50;
/// A window with more in flight closes after this long all the same.
const MAX_WINDOW_NS: u64 = 2_000_000_000;
/// Spans below this much in a window say too little to judge by.
const MIN_EVIDENCE_NS: u64 = 2_000_000;
/// The least factor applied (ppm): a span counts for at least this much of itself.
const FLOOR_PPM: u64 = 50_000;
/// The factor, in ppm, lives in the bucket's first spare word (0: none yet, spans count whole).
const FACTOR: usize = 0;
/// NVML's readings lag the spans: a long kernel's span is harvested in one window, while NVML
/// shows part of its time in the windows after (100 ms kernels alone: 55 ms of a 100 ms span in
/// its window, 20 and 12 in the next two, judged by nothing, so the factor sank to 0.6-0.8 and the
/// share was let through at 0.36-0.39 instead of 0.30). GPU time NVML shows in a window with too
/// few spans to judge by is kept here (ns, the bucket's second spare word) and counted in the next
/// window judged. Capped at a long window's worth; the container can write it, but more only
/// brings the factor towards 1, its spans counted whole.
const CARRY: usize = 1;

static HANDLES: [AtomicUsize; MAX_DEVICES] = [const { AtomicUsize::new(0) }; MAX_DEVICES];
static NVML_UP: AtomicBool = AtomicBool::new(false);

/// A measured span, as the container's own GPU time; also counted for the next factor update,
/// `weight` times (the launches it stands for: `sample`).
pub fn own_time(st: &ShimState, dev: usize, span: i64, weight: i64) -> i64 {
    let b = st.region.bucket(dev);
    b.window_used_ns.fetch_add(span.max(0).saturating_mul(weight.max(1)) as u64, Relaxed);
    match b.spare[FACTOR].load(Relaxed) {
        0 => span,
        // Never over 1 when applied (nor under the floor: the word is in the region, which the
        // container can write).
        f => (span as i128 * f.clamp(FLOOR_PPM, 1_000_000) as i128 / 1_000_000) as i64,
    }
}

/// Once per window per container and device: factor = NVML GPU time / measured spans. Returns
/// the container's use of the GPU over the window (ppm) to whoever closed the window.
/// `in_flight`: this process's measured launches not yet harvested; `mean_ns`: the device's mean
/// kernel (what a launch is charged).
pub fn maybe_update(st: &ShimState, dev: usize, now: u64, in_flight: u64, mean_ns: u64) -> Option<u64> {
    let b = st.region.bucket(dev);
    let start = b.window_start_ns.load(Acquire);
    let aligned = mean_ns <= SHORT_KERNEL_NS || in_flight.saturating_mul(mean_ns) <= MAX_UNALIGNED_NS;
    if start != 0 && (now < start + WINDOW_NS || (!aligned && now < start.saturating_add(MAX_WINDOW_NS))) {
        return None;
    }
    if b.window_start_ns.compare_exchange(start, now, AcqRel, Relaxed).is_err() || start == 0 {
        return None;
    }
    let window = now - start;
    let spans = b.window_used_ns.swap(0, AcqRel);
    let got = container_gpu_time(st, dev, window);
    if spans >= MIN_EVIDENCE_NS
        && let Some(got) = got
    {
        let got = got.saturating_add(b.spare[CARRY].swap(0, AcqRel).min(MAX_WINDOW_NS));
        let f = (got as u128 * 1_000_000 / spans as u128).clamp(u128::from(FLOOR_PPM), 1_000_000) as u64;
        let old = b.spare[FACTOR].load(Relaxed);
        let next = if old == 0 { f } else { (old.clamp(FLOOR_PPM, 1_000_000) + f) / 2 };
        b.spare[FACTOR].store(next, Relaxed);
    } else if let Some(got) = got
        && got > 0
    {
        let carried = b.spare[CARRY].load(Relaxed);
        b.spare[CARRY].store(carried.saturating_add(got).min(MAX_WINDOW_NS), Relaxed);
    }
    let used = got.unwrap_or(spans).min(window);
    Some((used as u128 * 1_000_000 / window.max(1) as u128) as u64)
}

/// GPU time the container's processes got on the device over the last `window` ns, by NVML.
fn container_gpu_time(st: &ShimState, dev: usize, window: u64) -> Option<u64> {
    let nvml = real::nvml()?;
    if !NVML_UP.load(Acquire) {
        // SAFETY: nvmlInit_v2 takes no arguments; NVML counts inits, we never shut down.
        if unsafe { (nvml.nvmlInit_v2)() } != nvmlReturn_enum_NVML_SUCCESS {
            return None;
        }
        NVML_UP.store(true, Release);
    }
    let handle = match HANDLES[dev].load(Relaxed) {
        0 => {
            let uuid = CString::new(st.region.device_uuid(dev)?).ok()?;
            let mut h: nvmlDevice_t = std::ptr::null_mut();
            // SAFETY: uuid is a valid C string and h a valid out-pointer.
            if unsafe { (nvml.nvmlDeviceGetHandleByUUID)(uuid.as_ptr(), &mut h) } != nvmlReturn_enum_NVML_SUCCESS {
                return None;
            }
            HANDLES[dev].store(h as usize, Relaxed);
            h
        }
        h => h as nvmlDevice_t,
    };
    let since_us = realtime_us().saturating_sub(window / 1000);
    // SAFETY: the sample struct is plain data; zeroed is a valid value.
    let mut samples: [nvmlProcessUtilizationSample_t; 64] = unsafe { std::mem::zeroed() };
    let mut count = samples.len() as c_uint;
    // SAFETY: handle is NVML's; the buffer holds `count` samples.
    let rc = unsafe { (nvml.nvmlDeviceGetProcessUtilization)(handle, samples.as_mut_ptr(), &mut count, since_us) };
    if rc != nvmlReturn_enum_NVML_SUCCESS {
        return None;
    }
    let samples = &samples[..(count as usize).min(samples.len())];
    let ours: Vec<u32> = st.region.pids().into_iter().map(|(pid, host)| if host != 0 { host } else { pid }).collect();
    let mut total_pct = 0u64;
    for &want in &ours {
        let mine: Vec<_> = samples.iter().filter(|s| s.pid == want).collect();
        if !mine.is_empty() {
            total_pct += mine.iter().map(|s| u64::from(s.smUtil)).sum::<u64>() / mine.len() as u64;
        }
    }
    Some(total_pct.min(100) * window / 100)
}

fn realtime_us() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}
