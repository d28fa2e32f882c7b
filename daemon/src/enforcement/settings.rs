//! `[enforcement]`: what the daemon does when an allocation's processes hold more device memory
//! than its limit, by the driver's own figures, and how often it looks.

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// The longest poll interval accepted: a breach must end within a second, and a kill takes one
/// poll to decide and the next to confirm.
pub const MAX_INTERVAL_MS: u64 = 500;
/// The shortest: below this the poll's own cost (NVML and /proc reads) starts to matter.
pub const MIN_INTERVAL_MS: u64 = 10;

/// `[enforcement]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// `kill` (SIGKILL the allocation's newest processes on the device until it is under its
    /// limit) or `report` (an event and a metric, nothing killed).
    pub action: Action,
    /// Milliseconds between polls of NVML's per-process memory (10..=500).
    pub interval_ms: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { action: Action::Kill, interval_ms: MAX_INTERVAL_MS }
    }
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
    if !(MIN_INTERVAL_MS..=MAX_INTERVAL_MS).contains(&s.interval_ms) {
        return Err(ConfigError::new(
            "enforcement.interval_ms",
            format!(
                "{} is out of range {MIN_INTERVAL_MS}..={MAX_INTERVAL_MS} (a breach must be seen and ended within 1 s)",
                s.interval_ms
            ),
        ));
    }
    Ok(())
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
        let e = Config::parse("[enforcement]\nintervl_ms = 100\n").unwrap_err();
        assert!(e.to_string().contains("intervl_ms"), "{e}");
    }
}
