//! The container's compute budget on one device: a token bucket of GPU nanoseconds shared by all
//! the container's processes through the accounting region, lock-free.
//!
//! Tokens accrue at `share` of wall time, up to a small cap (the burst a container may take after
//! idling). A launch may start while the balance is not negative and is charged its expected GPU
//! time at once; when the kernel's real time is known the charge is corrected. So a container's
//! GPU time over any stretch longer than the cap is its share of that stretch.

use std::sync::atomic::Ordering::*;

use tessera_region::ComputeBucket;

/// Burst allowance: this much wall time's worth of tokens may be saved up.
pub const CAP_WINDOW_NS: i64 = 20_000_000;

/// Share in parts per million (precise enough for shares like 33.3%).
pub fn share_ppm(percent: u32) -> i64 {
    i64::from(percent.clamp(1, 100)) * 10_000
}

/// Adds the tokens earned since the last refill (once, whoever gets there first). Only the time
/// that whole tokens were earned for is consumed, so frequent refills lose nothing to rounding.
pub fn refill(b: &ComputeBucket, now: u64, ppm: i64) {
    let last = b.refill_ns.load(Acquire);
    if last > now.saturating_add(CAP_WINDOW_NS as u64) {
        // A stamp from the future was written by hand (the region is the container's to write):
        // start over from now rather than never refill again.
        let _ = b.refill_ns.compare_exchange(last, now, AcqRel, Relaxed);
        return;
    }
    if last >= now {
        return;
    }
    if last == 0 {
        // First use: start from an empty (not negative) balance.
        let _ = b.refill_ns.compare_exchange(0, now, AcqRel, Relaxed);
        return;
    }
    let earned = ((now - last) as i128 * ppm as i128 / 1_000_000) as i64;
    if earned <= 0 {
        return;
    }
    let spent = (earned as i128 * 1_000_000 / ppm.max(1) as i128) as u64;
    if b.refill_ns.compare_exchange(last, last + spent.min(now - last), AcqRel, Relaxed).is_err() {
        return; // another launcher refilled for this interval
    }
    let cap = (CAP_WINDOW_NS * ppm / 1_000_000).max(0);
    let _ = b.tokens_ns.fetch_update(AcqRel, Relaxed, |t| Some(t.saturating_add(earned).min(cap)));
}

/// Takes `cost` ns if the balance allows a launch now; else how long to wait (ns) for it to.
pub fn try_take(b: &ComputeBucket, cost: i64, ppm: i64) -> Result<(), u64> {
    let mut t = b.tokens_ns.load(Acquire);
    let cap = (CAP_WINDOW_NS * ppm / 1_000_000).max(0);
    if t > cap {
        // More than the bucket can ever hold was written by hand: no more than the cap counts.
        t = b.tokens_ns.fetch_min(cap, AcqRel).min(cap);
    }
    if t >= 0 {
        b.tokens_ns.fetch_sub(cost, AcqRel);
        return Ok(());
    }
    Err(((-t) as i128 * 1_000_000 / ppm.max(1) as i128) as u64)
}

/// Corrects an earlier charge once the real GPU time is known (`delta` = real − charged).
pub fn correct(b: &ComputeBucket, delta: i64) {
    b.tokens_ns.fetch_sub(delta, AcqRel);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket() -> ComputeBucket {
        // SAFETY: ComputeBucket is all atomics; zeroed is its initial state in the region.
        unsafe { std::mem::zeroed() }
    }

    #[test]
    fn steady_kernels_get_the_share() {
        // A 30% share and back-to-back 2 ms kernels: simulate 10 s of launches.
        let b = bucket();
        let ppm = share_ppm(30);
        let (mut now, mut gpu, kernel) = (1u64, 0u64, 2_000_000i64);
        refill(&b, now, ppm);
        while now < 10_000_000_000 {
            refill(&b, now, ppm);
            match try_take(&b, kernel, ppm) {
                Ok(()) => {
                    gpu += kernel as u64;
                    now += 1_000; // launch overhead
                }
                Err(wait) => now += wait.max(1),
            }
        }
        let share = gpu as f64 / now as f64;
        assert!((share - 0.30).abs() < 0.005, "share {share}");
    }

    #[test]
    fn idle_time_is_capped() {
        let b = bucket();
        let ppm = share_ppm(50);
        refill(&b, 1, ppm);
        refill(&b, 10_000_000_001, ppm);
        assert_eq!(b.tokens_ns.load(Relaxed), CAP_WINDOW_NS / 2);
    }

    /// What a hostile process of the container writes into its bucket buys no more than the
    /// burst cap: a huge balance counts as the cap, a refill stamp from the future starts over.
    #[test]
    fn hand_written_balances_and_stamps_are_bounded() {
        let b = bucket();
        let ppm = share_ppm(10);
        let cap = CAP_WINDOW_NS / 10;
        b.tokens_ns.store(i64::MAX, Relaxed);
        b.refill_ns.store(u64::MAX, Relaxed);
        let now = 5_000_000_000;
        refill(&b, now, ppm);
        assert_eq!(b.refill_ns.load(Relaxed), now, "the stamp starts over");
        let mut taken = 0;
        while try_take(&b, 1_000_000, ppm).is_ok() {
            taken += 1_000_000;
            assert!(taken <= cap + 1_000_000, "took {taken} ns without earning them");
        }
        assert_eq!(taken, cap + 1_000_000, "the cap, then one launch into debt");
        refill(&b, now + 1_000_000, ppm);
        assert!(try_take(&b, 1, ppm).is_err(), "still in debt: 1 ms earns 0.1 ms at 10%");
    }

    #[test]
    fn corrections_move_the_balance() {
        let b = bucket();
        let ppm = share_ppm(10);
        assert!(try_take(&b, 1_000, ppm).is_ok());
        correct(&b, 4_000);
        assert_eq!(b.tokens_ns.load(Relaxed), -5_000);
        assert_eq!(try_take(&b, 1, ppm), Err(50_000));
    }
}
