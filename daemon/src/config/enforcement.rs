//! `[enforcement]`: what the daemon does when an allocation's processes hold more device memory
//! than its limit, or take more SM time than their strict share, by the driver's own figures,
//! and how often it looks.

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// The longest poll interval accepted: a breach must end within a second, and a kill takes one
/// poll to decide and the next to confirm.
pub const MAX_INTERVAL_MS: u64 = 500;
/// The shortest: below this the poll's own cost (NVML and /proc reads) starts to matter.
pub const MIN_INTERVAL_MS: u64 = 10;
/// SM time is judged over a window: an honest program may read up to one kernel over its share
/// in any window (a launch is let through whole), so shorter ones misjudge long kernels; longer
/// ones let a bypassing process run free longer (until it has had the ceiling's share of one).
pub const SM_WINDOW_MS: std::ops::RangeInclusive<u64> = 1000..=60_000;
/// Points over its share an allocation's SM time may read before it is a breach.
pub const SM_TOLERANCE_PERCENT: std::ops::RangeInclusive<u32> = 1..=50;

/// `[enforcement]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// `kill` (SIGKILL the allocation's newest processes on the device until it is under its
    /// limit) or `report` (an event and a metric, nothing killed).
    pub action: Action,
    /// Milliseconds between polls of NVML's per-process memory (10..=500).
    pub interval_ms: u64,
    /// SM time over a strict share: `kill`, `report` or `off`; unset: as `action`, except that
    /// with no shim injected (`injection.shim_path = ""`) it is `report`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sm_action: Option<SmAction>,
    /// The window SM time is averaged over, in milliseconds (1000..=60000).
    pub sm_window_ms: u64,
    /// Points over its share the average may read before it is a breach (1..=50).
    pub sm_tolerance_percent: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            action: Action::Kill,
            interval_ms: MAX_INTERVAL_MS,
            sm_action: None,
            sm_window_ms: 10_000,
            sm_tolerance_percent: 10,
        }
    }
}

impl Settings {
    /// What an SM-time breach gets: `None` when SM time is not enforced. `shim_injected`: whether
    /// containers get `libtessera.so`. Without it no process has a limiter, so every busy one
    /// would be over its share: unless `sm_action` says otherwise, that is reported, not killed.
    pub fn sm(&self, shim_injected: bool) -> Option<Action> {
        match self.sm_action {
            None if !shim_injected => Some(Action::Report),
            None => Some(self.action),
            Some(SmAction::Kill) => Some(Action::Kill),
            Some(SmAction::Report) => Some(Action::Report),
            Some(SmAction::Off) => None,
        }
    }
}

/// `sm_action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SmAction {
    Kill,
    Report,
    Off,
}

/// What a breach gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    #[default]
    Kill,
    Report,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Kill => "kill",
            Action::Report => "report",
        }
    }
}

/// Checks `[enforcement]`; the error names the key.
pub fn validate(s: &Settings) -> Result<(), ConfigError> {
    within(
        "interval_ms",
        s.interval_ms,
        MIN_INTERVAL_MS..=MAX_INTERVAL_MS,
        "a breach must be seen and ended within 1 s",
    )?;
    within("sm_window_ms", s.sm_window_ms, SM_WINDOW_MS, "SM time is judged by its average over this window")?;
    within(
        "sm_tolerance_percent",
        s.sm_tolerance_percent,
        SM_TOLERANCE_PERCENT,
        "points over its share an allocation may read",
    )
}

/// `value` of `[enforcement]`'s `key` within `range`; else the error, which says why the range is what it is.
fn within<T: PartialOrd + std::fmt::Display>(
    key: &str,
    value: T,
    range: std::ops::RangeInclusive<T>,
    why: &str,
) -> Result<(), ConfigError> {
    if range.contains(&value) {
        return Ok(());
    }
    Err(ConfigError::new(
        format!("enforcement.{key}"),
        format!("{value} is out of range {}..={} ({why})", range.start(), range.end()),
    ))
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    use super::*;

    #[test]
    fn keys_defaults_and_errors_name_the_key() {
        let d = Config::default().enforcement;
        assert_eq!((d.action, d.interval_ms), (Action::Kill, 500));
        let c = Config::parse("[enforcement]\naction = \"report\"\ninterval_ms = 100\n").unwrap();
        assert_eq!((c.enforcement.action, c.enforcement.interval_ms), (Action::Report, 100));
        for bad in ["interval_ms = 0", "interval_ms = 501", "interval_ms = 2000"] {
            let e = Config::parse(&format!("[enforcement]\n{bad}\n")).unwrap_err();
            assert_eq!(e.key, "enforcement.interval_ms", "{bad}: {e}");
        }
        let e = Config::parse("[enforcement]\naction = \"terminate\"\n").unwrap_err();
        assert!(e.key.starts_with("enforcement"), "{e}");
        assert!(e.to_string().contains("kill") && e.to_string().contains("report"), "{e}");
        assert_eq!((d.sm(true), d.sm_window_ms, d.sm_tolerance_percent), (Some(Action::Kill), 10_000, 10));
        let c = Config::parse("[enforcement]\naction = \"report\"\n").unwrap();
        assert_eq!(c.enforcement.sm(true), Some(Action::Report), "unset: as action");
        let c = Config::parse("[enforcement]\nsm_action = \"off\"\nsm_window_ms = 2000\nsm_tolerance_percent = 5\n")
            .unwrap();
        assert_eq!((c.enforcement.sm(true), c.enforcement.action), (None, Action::Kill));
        assert_eq!((c.enforcement.sm_window_ms, c.enforcement.sm_tolerance_percent), (2000, 5));
        // No shim injected: unset reports; an explicit kill still kills.
        assert_eq!(Config::default().enforcement.sm(false), Some(Action::Report));
        let k = Config::parse("[enforcement]\nsm_action = \"kill\"\n").unwrap();
        assert_eq!(k.enforcement.sm(false), Some(Action::Kill));
        for (bad, key) in [
            ("sm_window_ms = 999", "enforcement.sm_window_ms"),
            ("sm_window_ms = 60001", "enforcement.sm_window_ms"),
            ("sm_tolerance_percent = 0", "enforcement.sm_tolerance_percent"),
            ("sm_tolerance_percent = 51", "enforcement.sm_tolerance_percent"),
        ] {
            let e = Config::parse(&format!("[enforcement]\n{bad}\n")).unwrap_err();
            assert_eq!(e.key, key, "{bad}: {e}");
        }
        let e = Config::parse("[enforcement]\nsm_action = \"throttle\"\n").unwrap_err();
        assert!(e.to_string().contains("off"), "{e}");
        let e = Config::parse("[enforcement]\nintervl_ms = 100\n").unwrap_err();
        assert!(e.to_string().contains("intervl_ms"), "{e}");
    }
}
