//! Reloading: which keys changed between two configurations, which of them the running daemon
//! can apply live (partitions, limits, health, enforcement, share placement) and which wait for a restart
//! (library, paths, sockets, names, listeners). The effective configuration takes the live changes
//! and keeps the running values of the rest.

use super::Config;

/// Keys (and everything under them) that can change while the daemon runs.
const LIVE: &[&str] = &["partitions", "limits", "health", "enforcement", "resources.share_placement"];

/// When a change takes effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Applied by the reload.
    Live,
    /// Kept at its running value until the daemon restarts.
    Restart,
}

/// One changed key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Dotted key, e.g. `partitions.0.mig` or `runtime_dir`.
    pub key: String,
    pub when: When,
}

/// The outcome of [`reload`].
#[derive(Debug, Clone, PartialEq)]
pub struct Reload {
    /// Every changed key, in key order.
    pub changes: Vec<Change>,
    /// What the daemon runs with now: `new`'s live parts, `old`'s others.
    pub effective: Config,
}

impl Reload {
    /// Keys applied live.
    pub fn live(&self) -> impl Iterator<Item = &str> {
        self.changes.iter().filter(|c| c.when == When::Live).map(|c| c.key.as_str())
    }

    /// Keys that need a restart.
    pub fn needs_restart(&self) -> impl Iterator<Item = &str> {
        self.changes.iter().filter(|c| c.when == When::Restart).map(|c| c.key.as_str())
    }
}

/// Diffs a running configuration and a newly loaded (already validated) one.
pub fn reload(old: &Config, new: &Config) -> Reload {
    let a = toml::Value::try_from(old).expect("a configuration serializes");
    let b = toml::Value::try_from(new).expect("a configuration serializes");
    let mut keys = Vec::new();
    diff("", &a, &b, &mut keys);
    let changes: Vec<Change> = keys
        .into_iter()
        .map(|key| {
            let live = LIVE.iter().any(|l| key == *l || key.starts_with(&format!("{l}.")));
            Change { key, when: if live { When::Live } else { When::Restart } }
        })
        .collect();
    let mut effective = old.clone();
    effective.partitions = new.partitions.clone();
    effective.limits = new.limits.clone();
    effective.health = new.health.clone();
    effective.enforcement = new.enforcement.clone();
    effective.resources.share_placement = new.resources.share_placement;
    Reload { changes, effective }
}

fn diff(prefix: &str, a: &toml::Value, b: &toml::Value, out: &mut Vec<String>) {
    let join = |k: &str| {
        let k = super::validate::quote_key(k);
        if prefix.is_empty() { k } else { format!("{prefix}.{k}") }
    };
    match (a, b) {
        (toml::Value::Table(ta), toml::Value::Table(tb)) => {
            let mut keys: Vec<&String> = ta.keys().chain(tb.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                match (ta.get(k), tb.get(k)) {
                    (Some(x), Some(y)) => diff(&join(k), x, y, out),
                    _ => out.push(join(k)),
                }
            }
        }
        _ if a != b => out.push(prefix.to_string()),
        _ => {}
    }
}
