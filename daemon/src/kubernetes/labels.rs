//! Node labels in the style of NVIDIA's GPU Feature Discovery, under `tessera.io/` ([`OWNED`]):
//! what the node's GPUs are, for nodeSelectors and affinities. Computed from the inventory
//! ([`labels`], pure), patched onto the Node as a JSON merge patch of `metadata.labels` that sets
//! ours, removes those of ours that no longer apply, and names no other key ([`patch`]); kept
//! current by [`Labeller::run`] on every layout change (MIG mode, instances), checked again every
//! [`RESYNC`], failures retried from 100 ms doubling to 30 s.
//!
//! A node with several GPU models is labelled after its first GPU (as GPU Feature Discovery does);
//! `gpu.count` counts them all.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use serde_json::{Map, Value};
use tokio::sync::watch;

use crate::discovery::Inventory;
use crate::node::NodeController;

/// Every label tesserad writes; no other key is ever touched.
pub const OWNED: &[&str] = &[
    "tessera.io/gpu.present",
    "tessera.io/gpu.count",
    "tessera.io/gpu.product",
    "tessera.io/gpu.memory",
    "tessera.io/gpu.family",
    "tessera.io/gpu.compute.major",
    "tessera.io/gpu.compute.minor",
    "tessera.io/gpu.driver.major",
    "tessera.io/gpu.driver.minor",
    "tessera.io/gpu.driver.rev",
    "tessera.io/cuda.driver.major",
    "tessera.io/cuda.driver.minor",
    "tessera.io/cuda.runtime.major",
    "tessera.io/cuda.runtime.minor",
    "tessera.io/mig.capable",
    "tessera.io/mig.strategy",
];

/// The first retry after a failed patch, and the longest wait between retries.
pub const FIRST_RETRY: Duration = Duration::from_millis(100);
pub const MAX_RETRY: Duration = Duration::from_secs(30);
/// How often labels in place are checked again (someone may have removed them).
pub const RESYNC: Duration = Duration::from_secs(60);

/// `s` as a label value: letters, digits, `-`, `_`, `.`, at most 63, alphanumeric at both ends
/// (`NVIDIA H100 80GB HBM3` → `NVIDIA-H100-80GB-HBM3`).
pub fn label_value(s: &str) -> String {
    let mapped: String =
        s.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '-' }).collect();
    let mut v: String = mapped.chars().take(63).collect();
    while v.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        v.pop();
    }
    v.trim_start_matches(|c: char| !c.is_ascii_alphanumeric()).to_owned()
}

/// The labels `inv` calls for (none of the GPU ones on a node without GPUs).
pub fn labels(inv: &Inventory) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        debug_assert!(OWNED.contains(&k), "{k} is not in OWNED");
        out.insert(k.to_owned(), v);
    };
    let Some(first) = inv.gpus.first() else {
        put("tessera.io/gpu.present", "false".into());
        return out;
    };
    put("tessera.io/gpu.present", "true".into());
    put("tessera.io/gpu.count", inv.gpus.len().to_string());
    put("tessera.io/gpu.product", label_value(&first.name));
    put("tessera.io/gpu.memory", (first.memory_total >> 20).to_string());
    if let Some((arch, cc)) = crate::discovery::architecture(&first.name) {
        put("tessera.io/gpu.family", label_value(&arch.to_ascii_lowercase()));
        let (major, minor) = cc.split_once('.').unwrap_or((cc, "0"));
        put("tessera.io/gpu.compute.major", major.into());
        put("tessera.io/gpu.compute.minor", minor.into());
    }
    let mut driver = inv.driver_version.split('.');
    for key in ["tessera.io/gpu.driver.major", "tessera.io/gpu.driver.minor", "tessera.io/gpu.driver.rev"] {
        if let Some(part) = driver.next().map(label_value).filter(|p| !p.is_empty()) {
            put(key, part);
        }
    }
    if inv.cuda_driver_version > 0 {
        let (major, minor) = (inv.cuda_driver_version / 1000, (inv.cuda_driver_version % 1000) / 10);
        // The newest CUDA runtime the driver runs is the CUDA version it implements.
        for kind in ["driver", "runtime"] {
            put(&format!("tessera.io/cuda.{kind}.major"), major.to_string());
            put(&format!("tessera.io/cuda.{kind}.minor"), minor.to_string());
        }
    }
    put("tessera.io/mig.capable", inv.gpus.iter().any(|g| g.mig.is_some()).to_string());
    put("tessera.io/mig.strategy", mig_strategy(inv).into());
    out
}

/// `none` (no GPU in MIG mode), `single` (every GPU in MIG mode, all its MIG devices of one
/// profile), `mixed` (anything else), as GPU Feature Discovery names its strategies.
fn mig_strategy(inv: &Inventory) -> &'static str {
    let on: Vec<_> = inv.gpus.iter().filter_map(|g| g.mig.as_ref().filter(|m| m.current)).collect();
    if on.is_empty() {
        return "none";
    }
    let mut profiles = on.iter().flat_map(|m| m.instances.iter().map(|i| i.profile.as_str()));
    let first = profiles.next();
    if on.len() == inv.gpus.len() && profiles.all(|p| Some(p) == first) { "single" } else { "mixed" }
}

/// The merge patch that makes the Node's `current` labels carry `wanted`: our keys set or changed,
/// our keys no longer wanted set to null (removed), other keys absent (untouched). `None` when the
/// Node already has them.
pub fn patch(current: &BTreeMap<String, String>, wanted: &BTreeMap<String, String>) -> Option<Value> {
    let mut labels = Map::new();
    for (k, v) in wanted {
        if current.get(k) != Some(v) {
            labels.insert(k.clone(), Value::String(v.clone()));
        }
    }
    for k in OWNED {
        if current.contains_key(*k) && !wanted.contains_key(*k) {
            labels.insert((*k).to_owned(), Value::Null);
        }
    }
    (!labels.is_empty()).then(|| serde_json::json!({ "metadata": { "labels": labels } }))
}

/// Keeps the Node's labels current.
pub struct Labeller {
    api: kube::Api<Node>,
    node: String,
}

impl Labeller {
    pub fn new(client: kube::Client, node: impl Into<String>) -> Labeller {
        Labeller { api: kube::Api::all(client), node: node.into() }
    }

    /// One pass: read the Node's labels, patch ours. `Ok(true)` when it patched.
    pub async fn sync(&self, wanted: &BTreeMap<String, String>) -> Result<bool, kube::Error> {
        let node = self.api.get(&self.node).await?;
        let current = node.metadata.labels.unwrap_or_default();
        let Some(p) = patch(&current, wanted) else { return Ok(false) };
        self.api.patch(&self.node, &PatchParams::default(), &Patch::Merge(&p)).await?;
        Ok(true)
    }

    /// Syncs on every change of the labels the controller's offer makes (a layout change), every
    /// [`RESYNC`], and retries failures with backoff, until `shutdown` turns true.
    pub async fn run(self, controller: Arc<NodeController>, mut shutdown: watch::Receiver<bool>) {
        let mut offered = controller.watch_offer();
        let mut retry = FIRST_RETRY;
        loop {
            let wanted = labels(&offered.borrow_and_update().inventory);
            let wait = match self.sync(&wanted).await {
                Ok(patched) => {
                    if patched {
                        tracing::info!(node = %self.node, labels = wanted.len(), "Node labels patched");
                    }
                    retry = FIRST_RETRY;
                    RESYNC
                }
                Err(e) => {
                    tracing::warn!(node = %self.node, error = %e, retry_ms = retry.as_millis() as u64, "patching the Node's labels failed; retrying");
                    let now = retry;
                    retry = (retry * 2).min(MAX_RETRY);
                    now
                }
            };
            // A publish that leaves the labels as they are (what the records hold changes with
            // every allocation) asks the API server nothing.
            let until = tokio::time::Instant::now() + wait;
            loop {
                tokio::select! {
                    changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return },
                    changed = offered.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        if labels(&offered.borrow().inventory) != wanted {
                            break;
                        }
                    }
                    () = tokio::time::sleep_until(until) => break,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_label_values() {
        assert_eq!(label_value("NVIDIA H100 80GB HBM3"), "NVIDIA-H100-80GB-HBM3");
        assert_eq!(label_value(" (A100) "), "A100");
        assert_eq!(label_value(&"x".repeat(80)).len(), 63);
        assert_eq!(label_value("ada lovelace"), "ada-lovelace");
    }

    #[test]
    fn the_patch_sets_ours_removes_stale_ours_and_never_names_others() {
        let current: BTreeMap<String, String> = [
            ("kubernetes.io/hostname", "node-a"),
            ("tessera.io/pool", "blue"),
            ("nvidia.com/gpu.product", "NVIDIA-H100"),
            ("tessera.io/gpu.count", "2"),
            ("tessera.io/gpu.family", "hopper"),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
        let wanted: BTreeMap<String, String> = [("tessera.io/gpu.count", "2"), ("tessera.io/mig.strategy", "single")]
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        let p = patch(&current, &wanted).unwrap();
        assert_eq!(
            p,
            serde_json::json!({"metadata": {"labels": {"tessera.io/mig.strategy": "single", "tessera.io/gpu.family": null}}}),
            "unchanged ours left out; a foreign tessera.io/ key and others' keys never named"
        );
        let mut applied = current.clone();
        applied.remove("tessera.io/gpu.family");
        applied.insert("tessera.io/mig.strategy".into(), "single".into());
        assert_eq!(patch(&applied, &wanted), None, "nothing to do once applied");
    }
}
