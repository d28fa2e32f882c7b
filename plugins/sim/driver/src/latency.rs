//! What a call costs on a real driver: the sim's calls answer in well under a microsecond, a real
//! H200's in several (an NVML query is an ioctl into the kernel module). So that the daemon's
//! polls, its scrapes and the shim's context true-up are measured at what a real driver costs,
//! each call measured on the card takes at least the card's time: [`CARD`], by function name.
//!
//! `TESSERA_SIM_LATENCY` (read once per process): `on` or unset, the card's figures; `off` (or
//! `0`), none (unit tests); a number, the figures scaled by it (`0.5`, `2`). Calls the card was
//! not timed on get no latency.
//!
//! A call's figure is a floor from its entry, not a sum: the call returns once its own work is done
//! and the figure has passed since it began, so its whole time is the card's (or the sim's own,
//! were that longer). The wait is a spin on the monotonic clock: `Instant::now()` is a vDSO read,
//! no system call, so it is exact to well under a microsecond, where a sleep would take at least
//! the kernel's timer slack (50 µs by default) and a wake-up. A real driver's thread is busy for
//! that time too.

use std::hint::spin_loop;
use std::io::Write;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The variable that sets the figures.
pub(crate) const VARIABLE: &str = "TESSERA_SIM_LATENCY";

/// Each call's time on a real H200 SXM (driver 580.159.04, CUDA 13.0, idle, one process), in
/// nanoseconds: the mean of 200 calls (50 for utilization) from Python `ctypes`, from
/// `shared/reference/h200-facts.json` (`measured_call_latency_us`). Those include the probe's own
/// call overhead (under 0.6 µs: the sim's whole call took 0.6–0.9 µs through it).
pub(crate) const CARD: [(&str, u64); 5] = [
    ("cuMemGetInfo_v2", 8_300),
    ("nvmlDeviceGetComputeRunningProcesses_v3", 26_500),
    ("nvmlDeviceGetCount_v2", 930),
    ("nvmlDeviceGetMemoryInfo", 8_400),
    ("nvmlDeviceGetProcessUtilization", 2_700),
];

/// How the figures apply: a factor on each (0 is off).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scale(f64);

impl Scale {
    /// `TESSERA_SIM_LATENCY`'s value: `on`/unset (1), `off` (0), or a factor. `Err` names what is
    /// wrong.
    pub(crate) fn parse(value: Option<&str>) -> Result<Scale, String> {
        match value.map(str::trim) {
            None | Some("" | "on") => Ok(Scale(1.0)),
            Some("off") => Ok(Scale(0.0)),
            Some(v) => match v.parse::<f64>() {
                Ok(f) if f.is_finite() && (0.0..=1000.0).contains(&f) => Ok(Scale(f)),
                _ => Err(format!(
                    "{VARIABLE}={v:?} is not on, off or a scale factor from 0 to 1000 (such as 0.5); \
                     the card's latencies apply"
                )),
            },
        }
    }

    /// The time `name` takes at least, if it takes any.
    pub(crate) fn floor_of(self, name: &str) -> Option<Duration> {
        if self.0 == 0.0 {
            return None;
        }
        let (_, ns) = CARD.iter().find(|(n, _)| *n == name)?;
        Some(Duration::from_nanos((*ns as f64 * self.0) as u64))
    }
}

/// This process's scale, read once; a bad value is said on stderr once and the card's apply.
fn scale() -> Scale {
    static SCALE: OnceLock<Scale> = OnceLock::new();
    *SCALE.get_or_init(|| {
        let value = std::env::var_os(VARIABLE);
        Scale::parse(value.as_ref().map(|v| v.to_str().unwrap_or("?"))).unwrap_or_else(|e| {
            let _ = writeln!(std::io::stderr().lock(), "tessera-sim: {e}");
            Scale(1.0)
        })
    })
}

/// Held for a call's body: on drop, waits until the call has taken its card's time.
pub(crate) struct Floor(Option<Instant>);

/// Starts `name`'s floor; `name` is a row of [`CARD`] (the call's own, or the version whose work
/// it does).
pub(crate) fn floor(name: &str) -> Floor {
    debug_assert!(CARD.iter().any(|(n, _)| *n == name), "{name} has no row in latency::CARD");
    Floor(scale().floor_of(name).map(|d| Instant::now() + d))
}

impl Drop for Floor {
    fn drop(&mut self) {
        if let Some(until) = self.0 {
            while Instant::now() < until {
                spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_or_unset_is_the_cards_figures_and_off_is_none() {
        for on in [None, Some("on"), Some(""), Some("1")] {
            let s = Scale::parse(on).unwrap();
            assert_eq!(s.floor_of("nvmlDeviceGetComputeRunningProcesses_v3"), Some(Duration::from_nanos(26_500)));
            assert_eq!(s.floor_of("cuMemGetInfo_v2"), Some(Duration::from_nanos(8_300)));
        }
        for off in [Some("off"), Some("0")] {
            let s = Scale::parse(off).unwrap();
            for (name, _) in CARD {
                assert_eq!(s.floor_of(name), None, "{name} with {off:?}");
            }
        }
    }

    #[test]
    fn a_factor_scales_every_figure_and_an_unmeasured_call_has_none() {
        let half = Scale::parse(Some("0.5")).unwrap();
        assert_eq!(half.floor_of("nvmlDeviceGetMemoryInfo"), Some(Duration::from_nanos(4_200)));
        assert_eq!(half.floor_of("cuLaunchKernel"), None);
        assert_eq!(Scale::parse(None).unwrap().floor_of("nvmlDeviceGetGraphicsRunningProcesses_v3"), None);
    }

    #[test]
    fn a_bad_value_is_refused_naming_the_variable_and_what_it_takes() {
        for bad in ["fast", "-1", "NaN", "inf", "1e9"] {
            let e = Scale::parse(Some(bad)).unwrap_err();
            assert!(e.contains(VARIABLE) && e.contains(bad) && e.contains("on, off"), "{e}");
        }
    }

    #[test]
    fn every_row_is_an_exported_name() {
        let names: Vec<&str> = include_str!("../exports/cuda.names")
            .lines()
            .chain(include_str!("../exports/nvml.names").lines())
            .filter_map(|line| line.split_whitespace().next())
            .collect();
        for (name, _) in CARD {
            assert!(names.contains(&name), "{name} is not an exported name");
        }
    }
}
