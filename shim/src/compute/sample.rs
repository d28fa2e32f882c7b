//! Which throttled launches are measured, and what each is charged, so that measuring costs a
//! launch of a tiny kernel a fraction of the two CUDA events it would otherwise pay (about a
//! microsecond with a real driver, far more than the kernel) while the bucket is still charged
//! the container's real GPU time on average, whatever the mix of kernels.
//!
//! Every throttled launch is charged `e`, the device's running mean of measured kernel times, as
//! it starts. Before the launch, with a PRNG that no kernel's duration can influence, it is picked
//! for measuring with probability `1/w`; a measured launch's charge is corrected by
//! `(own − e) · w` once its real GPU time `own` is known. Its expected charge is therefore
//! `e + (1/w) · (own − e) · w = own` exactly, for every launch, however `e` and `w` were chosen
//! (both are fixed before the draw): the Horvitz–Thompson estimate of the launch's time, with `e`
//! as a control variate so that steady kernels leave corrections of almost nothing. Launches that
//! are not picked are charged `e` and settle nothing: no events, no lock.
//!
//! `w` adapts to the kernels measured lately, by their root mean square `rms` (a running mean of
//! squared times): 1 (every launch measured, as before) while `rms` is [`FULL_NS`] or more,
//! where the events cost little beside the kernels; else the power of two at or below
//! `FULL_NS / rms`, at most [`MAX_WEIGHT`], so a tiny kernel's launch pays about a sixteenth of
//! the events' price. The square makes long kernels count: a tenant mixing 1 ms kernels among
//! 2 µs ones, even one in 64, has an `rms` over 100 µs and is measured in full; one long kernel
//! caught among tiny ones sends `w` to 1 for a few thousand launches (the mean square's weight
//! is 1/256 per launch a measurement stands for). A slow outlier (a kernel time-sliced with
//! another container's, a first launch that loads code) costs the same: a few milliseconds of
//! events, once. Until a device has a measurement, every launch is measured.
//!
//! The price of sampling is noise, never bias: a measured kernel that breaks the pattern lands
//! on the bucket as one lump of `w` times its excess (at most 16 times one kernel), which the
//! container then waits off as it would any debt; the launch after it is measured in full.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

/// Kernels this long (root mean square of own GPU times, ns) or longer are all measured.
pub const FULL_NS: i64 = 64_000;
/// The tiniest kernels: one launch in this many is measured.
pub const MAX_WEIGHT: i64 = 16;
/// Steady kernels are sampled while `weight` of them take at most this long (ns).
pub const STEADY_BUDGET_NS: i64 = 2_000_000;
/// Until a device has a measurement, a launch is charged this much.
pub const FIRST_GUESS_NS: i64 = 100_000;

/// A splitmix64 generator over one atomic word: any thread may draw, and a draw is one add.
pub struct Rng(AtomicU64);

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl Rng {
    pub const fn new(seed: u64) -> Rng {
        Rng(AtomicU64::new(seed))
    }

    pub fn reseed(&self, seed: u64) {
        self.0.store(seed, Relaxed);
    }

    pub fn next(&self) -> u64 {
        let mut z = self.0.fetch_add(GAMMA, Relaxed).wrapping_add(GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// What a throttled launch is charged and whether it is measured, decided before it is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Charged to the bucket as the launch starts (ns).
    pub charge: i64,
    /// One over the probability that the launch was picked for measuring.
    pub weight: i64,
    pub measure: bool,
}

/// One device's recent kernels, as this process measured them.
pub struct Sampler {
    /// Running mean of a measured kernel's own GPU time (ns); 0: none measured yet.
    mean_ns: AtomicI64,
    /// Running mean of its square (ns²).
    mean_sq: AtomicU64,
    /// Running mean of the time at the mean square's pace (ns): with `mean_sq`, the variance of
    /// the kernels of the last few thousand launches.
    slow_mean: AtomicU64,
}

impl Sampler {
    pub const fn new() -> Sampler {
        Sampler { mean_ns: AtomicI64::new(0), mean_sq: AtomicU64::new(0), slow_mean: AtomicU64::new(0) }
    }

    /// Whether a kernel has been measured on the device yet.
    pub fn measured(&self) -> bool {
        self.mean_ns.load(Relaxed) > 0
    }

    /// What a launch is charged as it starts: the mean of the kernels measured so far.
    pub fn expected(&self) -> i64 {
        match self.mean_ns.load(Relaxed) {
            e if e > 0 => e,
            _ => FIRST_GUESS_NS,
        }
    }

    /// One over the chance of measuring the next launch: the largest power of two up to
    /// [`MAX_WEIGHT`] whose square times the mean square is at most `FULL_NS²` (tiny kernels);
    /// or, where larger, whose square times the kernels' variance is at most `FULL_NS²`
    /// and which times the mean is at most [`STEADY_BUDGET_NS`] (steady kernels, GEMMs of one
    /// shape: 16 up to 125 µs, 8 at 200 µs, 2 at 1 ms; a measured one corrects its `w` launches by almost
    /// nothing, and a change of length is charged at the old mean for at most `w` launches).
    pub fn weight(&self) -> i64 {
        let mean = self.mean_ns.load(Relaxed);
        if mean <= 0 {
            return 1;
        }
        let max_k = MAX_WEIGHT.ilog2();
        // The largest 2^k with 4^k <= FULL_NS² / x: k = ⌊log2(FULL_NS² / x) / 2⌋.
        let k_of = |x: u64| ((FULL_NS * FULL_NS) as u64 / x.max(1)).checked_ilog2().map_or(0, |l| l / 2).min(max_k);
        let by_size = k_of(self.mean_sq.load(Relaxed));
        let slow = self.slow_mean.load(Relaxed);
        let variance = self.mean_sq.load(Relaxed).saturating_sub(slow.saturating_mul(slow));
        let by_budget = (STEADY_BUDGET_NS / mean).max(1).ilog2().min(max_k);
        let steady = k_of(variance).min(by_budget);
        1 << by_size.max(steady)
    }

    /// Plans a launch: its charge, its weight and whether it is measured (`forced`: a trace
    /// wants it measured anyway, so it is measured for certain, at weight 1).
    pub fn plan(&self, rng: &Rng, forced: bool) -> Plan {
        let charge = self.expected();
        let weight = if forced { 1 } else { self.weight() };
        let measure = weight == 1 || rng.next() & (weight as u64 - 1) == 0;
        Plan { charge, weight, measure }
    }

    /// A measured launch's own GPU time is known: learns from it and returns the correction to
    /// its charge ([`Plan::correction`]).
    pub fn settle(&self, plan: Plan, own: i64) -> i64 {
        self.learn(own, plan.weight);
        plan.correction(own)
    }

    /// The running means: the mean's weight is 1/8 per measurement (what a launch is charged
    /// follows the kernels quickly); the mean square's is 1/256 per launch the measurement
    /// stands for (`weight`), so that one long kernel keeps sampling dense for a few thousand
    /// launches. Racing threads may lose an update: it is advice.
    fn learn(&self, own: i64, weight: i64) {
        let own = own.max(1);
        let sq = (own as u64).saturating_mul(own as u64);
        let (old, old_sq) = (self.mean_ns.load(Relaxed), self.mean_sq.load(Relaxed));
        if old <= 0 {
            self.mean_ns.store(own, Relaxed);
            self.mean_sq.store(sq, Relaxed);
            self.slow_mean.store(own as u64, Relaxed);
            return;
        }
        self.mean_ns.store((old - old / 8 + own / 8).max(1), Relaxed);

        let w = weight.clamp(1, MAX_WEIGHT) as u64;
        self.mean_sq.store((old_sq - old_sq / 256 * w).saturating_add(sq / 256 * w), Relaxed);
        let slow = self.slow_mean.load(Relaxed);
        self.slow_mean.store((slow - slow / 256 * w).saturating_add(own as u64 / 256 * w), Relaxed);
    }
}

impl Plan {
    /// What to add to the charge of this launch, measured at `own` ns: `(own − charge) · weight`
    /// (the real time minus what was charged, were the launch alone; over the launches it stands
    /// for, the difference is right on average).
    pub fn correction(&self, own: i64) -> i64 {
        (own - self.charge).saturating_mul(self.weight)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// A second generator for the workloads' own randomness, unrelated to the sampler's draws.
    fn jitter(rng: &Rng, lo: i64, hi: i64) -> i64 {
        lo + (rng.next() % (hi - lo + 1) as u64) as i64
    }

    /// Runs `durations` through a sampler as the limiter does, settling each measured launch `lag` launches later (kernels complete after
    /// their launch). Returns (total charged after corrections, total real time, launches
    /// measured, measured launches of kernels at least `long_ns`, launches of such kernels).
    fn run(durations: impl Iterator<Item = i64>, seed: u64, lag: usize, long_ns: i64) -> (i64, i64, u64, u64, u64) {
        let (s, rng) = (Sampler::new(), Rng::new(seed));
        let (mut charged, mut real) = (0i64, 0i64);
        let (mut measured, mut long_measured, mut long) = (0, 0, 0);
        let mut pending: VecDeque<(Plan, i64)> = VecDeque::new();
        for own in durations {
            let plan = s.plan(&rng, false);
            charged += plan.charge;
            real += own;
            long += u64::from(own >= long_ns);
            if plan.measure {
                measured += 1;
                long_measured += u64::from(own >= long_ns);
                pending.push_back((plan, own));
            }
            while pending.len() > lag {
                let (p, o) = pending.pop_front().unwrap();
                charged += s.settle(p, o);
            }
        }
        for (p, o) in pending {
            charged += s.settle(p, o);
        }
        (charged, real, measured, long_measured, long)
    }

    #[test]
    fn every_launch_is_measured_until_the_device_has_a_measurement() {
        let (s, rng) = (Sampler::new(), Rng::new(7));
        for _ in 0..100 {
            let plan = s.plan(&rng, false);
            assert_eq!(plan, Plan { charge: FIRST_GUESS_NS, weight: 1, measure: true });
        }
    }

    #[test]
    fn tiny_kernels_are_sampled_and_long_ones_all_measured() {
        let weight_after = |times: &[i64]| {
            let s = Sampler::new();
            times.iter().for_each(|&t| s.learn(t, s.weight()));
            s.weight()
        };
        assert_eq!(weight_after(&[2_000]), MAX_WEIGHT, "2 µs kernels");
        // Kernels of varied lengths, by size: 8 µs to 64 µs.
        let varied = |lo: i64, hi: i64| {
            let work = Rng::new(5);
            (0..2_000).map(|_| jitter(&work, lo, hi)).collect::<Vec<_>>()
        };
        assert_eq!(weight_after(&varied(1_000, 15_000)), 8, "rms about 8.7 µs");
        // rms about 23 µs (by size, 2: 64/23 = 2.8), sd about 11 µs: 4 measured launches' lumps
        // of 4 × 11 µs are within what one 64 µs kernel's would be.
        assert_eq!(weight_after(&varied(1_000, 40_000)), 4);
        assert_eq!(weight_after(&varied(1_000, 200_000)), 1, "rms about 116 µs, sd about 57 µs");
        // Steady kernels (GEMMs of one shape), sampled whatever their length while 16 of them
        // take at most 2 ms (issue 34, item 3: no event pair on every launch).
        assert_eq!(weight_after(&[FULL_NS; 10]), MAX_WEIGHT);
        assert_eq!(weight_after(&[200_000; 10]), 8);
        assert_eq!(weight_after(&varied(198_000, 202_000)), 8, "200 µs ± 1%: sd about 1.2 µs");
        assert_eq!(weight_after(&varied(90_000, 110_000)), 8, "100 µs ± 10%: sd about 6 µs, lumps of 8 × 6 µs");
        assert_eq!(weight_after(&[125_000; 10]), MAX_WEIGHT);
        assert_eq!(weight_after(&[1_000_000; 10]), 2);
        assert_eq!(weight_after(&[2_000_000; 10]), 1);
        // A 1 ms kernel among 2 µs ones, one in 64: the square makes it count.
        let mix: Vec<i64> = (0..640).map(|i| if i % 64 == 63 { 1_000_000 } else { 2_000 }).collect();
        assert_eq!(weight_after(&mix), 1);
        // One slow outlier among steady tiny kernels, measured at weight 16 (so standing for 16):
        // every launch measured for a while, then sampled again.
        let mut times = vec![2_000; 100];
        times.push(200_000);
        assert_eq!(weight_after(&times), 1, "rms 200/4 = 50 µs");
        times.extend([2_000; 2_000]);
        assert_eq!(weight_after(&times), MAX_WEIGHT);
        // A long kernel caught among tiny ones: every launch measured for a while.
        let mut times = vec![2_000; 100];
        times.push(1_000_000);
        times.extend([2_000; 200]);
        assert_eq!(weight_after(&times), 1);
    }

    /// The estimator's promise, with its weight held at 16 (the sampler never learns): however the
    /// kernels alternate, the charges total the real time, and the draws pick tiny and long
    /// kernels alike, one in 16.
    #[test]
    fn the_estimate_is_unbiased_whatever_the_mix() {
        let s = Sampler::new();
        s.learn(1_000, 1);
        let rng = Rng::new(0x5eed);
        let work = Rng::new(42);
        let (mut charged, mut real) = (0i64, 0i64);
        let mut counts = [[0u64; 2]; 2]; // [tiny, long] x [launches, measured]
        for i in 0..400_000u64 {
            // Tiny and long in a pattern a hostile tenant might hope lines up with the draws:
            // every other launch, and also bursts of 16 long ones.
            let long = i % 2 == 1 || (i / 16) % 64 == 0;
            let own = if long { jitter(&work, 90_000, 110_000) } else { jitter(&work, 500, 1_500) };
            let plan = s.plan(&rng, false);
            assert_eq!(plan.weight, 16);
            charged += plan.charge;
            real += own;
            counts[usize::from(long)][0] += 1;
            if plan.measure {
                counts[usize::from(long)][1] += 1;
                charged += plan.correction(own);
            }
        }
        let error = (charged - real) as f64 / real as f64;
        assert!(error.abs() < 0.02, "charged {charged} for {real} ns: {:.2}% off", error * 100.0);
        for [launches, measured] in counts {
            let rate = measured as f64 / launches as f64;
            assert!((rate - 1.0 / 16.0).abs() < 0.005, "measured {measured} of {launches}");
        }
    }

    #[test]
    fn steady_tiny_kernels_cost_a_sixteenth_of_the_events() {
        let work = Rng::new(1);
        let durations = (0..200_000).map(|_| jitter(&work, 1_000, 3_000));
        let (charged, real, measured, _, _) = run(durations, 99, 8, i64::MAX);
        let error = (charged - real) as f64 / real as f64;
        assert!(error.abs() < 0.01, "{:.3}% off", error * 100.0);
        assert!((10_000..15_000).contains(&measured), "{measured} of 200000 measured");
    }

    /// A tenant alternating tiny kernels with long ones of the same function: once a long one is
    /// measured, all are (the peak), and the charges total the real time.
    #[test]
    fn long_kernels_among_tiny_ones_are_caught_and_charged() {
        for (every, seed) in [(2u64, 3u64), (16, 4), (64, 5)] {
            let durations = (0..100_000u64).map(|i| if i % every == every - 1 { 1_000_000 } else { 2_000 });
            let (charged, real, _, long_measured, long) = run(durations, seed, 16, 1_000_000);
            let error = (charged - real) as f64 / real as f64;
            assert!(error.abs() < 0.02, "long every {every}: {:.3}% off", error * 100.0);
            assert!(long_measured * 100 >= long * 95, "long every {every}: {long_measured} of {long} measured");
        }
    }

    /// A hostile tenant that watches the sampling (it can: the weight follows from what it
    /// launched) and slips 5 ms kernels in only while one launch in 16 is measured, going back
    /// to 2 µs ones as soon as a long one is caught. Each draw is still independent of the
    /// kernel it decides on, so the charges still total the real time.
    #[test]
    fn long_kernels_slipped_into_sparse_sampling_are_charged_in_full() {
        let (s, rng) = (Sampler::new(), Rng::new(0xbad));
        let (mut charged, mut real, mut slipped) = (0i64, 0i64, 0u64);
        for _ in 0..12_000_000u64 {
            let long = s.weight() == MAX_WEIGHT && s.mean_ns.load(Relaxed) > 0;
            let own = if long { 5_000_000 } else { 2_000 };
            slipped += u64::from(long);
            let plan = s.plan(&rng, false);
            charged += plan.charge;
            real += own;
            if plan.measure {
                charged += s.settle(plan, own);
            }
        }
        assert!(slipped > 100, "only {slipped} long kernels slipped in: the test tests nothing");
        let error = (charged - real) as f64 / real as f64;
        assert!(error.abs() < 0.03, "{slipped} long kernels: {:.3}% off", error * 100.0);
    }

    /// Times no kernel takes (a span of hours from a clock gone wrong) saturate, never wrap.
    #[test]
    fn absurd_times_saturate() {
        let s = Sampler::new();
        for _ in 0..3 {
            s.learn(i64::MAX, MAX_WEIGHT);
        }
        assert_eq!(s.weight(), 1);
        let plan = Plan { charge: 1_000, weight: MAX_WEIGHT, measure: true };
        assert_eq!(plan.correction(i64::MAX), i64::MAX);
    }

    #[test]
    fn the_same_seed_draws_the_same() {
        let (a, b) = (Rng::new(11), Rng::new(11));
        assert!((0..1000).all(|_| a.next() == b.next()));
        let c = Rng::new(12);
        assert!((0..1000).any(|_| a.next() != c.next()));
    }
}
