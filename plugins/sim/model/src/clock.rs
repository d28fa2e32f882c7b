//! Time as every process on the node sees it: CLOCK_MONOTONIC is system-wide, so timestamps
//! written by one process mean the same in another (containers included).

/// Monotonic nanoseconds.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid, writable timespec; clock_gettime only writes it.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Converts a monotonic timestamp to microseconds since the Unix epoch (NVML's timestamps).
pub fn realtime_us_from_monotonic(mono_ns: u64) -> u64 {
    let now_mono = monotonic_ns();
    let now_real = clock_ns(libc::CLOCK_REALTIME);
    let real = (now_real as i128) - (now_mono as i128) + (mono_ns as i128);
    (real.max(0) / 1000) as u64
}
