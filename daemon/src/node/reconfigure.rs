//! The configuration changed while tesserad runs: a reload of the file (SIGHUP, the node API's
//! `Reload`: live keys applied, restart-only ones reported, layouts re-planned) and a layout asked
//! for through the node API (`ApplyLayout`: it becomes the GPU's configuration entry). Both end in
//! the controller's one `apply_config`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tessera_proto::tessera::v1 as api;

use super::{NodeController, Origin, entry_key, gpu_range, issue, layout};
use crate::config::{self, Config};

impl NodeController {
    /// The node API's `ApplyLayout`: per target, the GPU's configuration entry replaced by the
    /// layout asked for (an `all` target replaces `default` and drops per-GPU entries not named
    /// by another target). A malformed request is an error naming the field; what cannot be
    /// done on a GPU is in its result.
    pub fn apply_layout(&self, req: &api::ApplyLayoutRequest) -> Result<api::ApplyLayoutResponse, String> {
        use api::layout_target::Gpus;
        let view = self.view();
        let mut config = (*view.config).clone();
        let mut named: BTreeMap<u32, usize> = BTreeMap::new();
        let mut all_target = None;
        let mut not_found = Vec::new();
        let mut specs = Vec::new();
        if req.targets.is_empty() {
            return Err("targets: empty; name at least one GPU or all".into());
        }
        for (i, t) in req.targets.iter().enumerate() {
            let layout = t.layout.as_ref().ok_or_else(|| format!("targets[{i}].layout: missing"))?;
            let spec = layout::spec_from_api(layout).map_err(|e| format!("targets[{i}].{e}"))?;
            let gpu = match &t.gpus {
                None => return Err(format!("targets[{i}].gpus: none of all, uuid, index is set")),
                Some(Gpus::All(_)) => {
                    if all_target.replace(i).is_some() {
                        return Err(format!("targets[{i}]: `all` is given twice"));
                    }
                    specs.push((None, spec));
                    continue;
                }
                Some(Gpus::Uuid(u)) => view.inventory.gpu_by_uuid(u),
                Some(Gpus::Index(n)) => view.inventory.gpu(*n),
            };
            let Some(gpu) = gpu else {
                let what = match &t.gpus {
                    Some(Gpus::Uuid(u)) => u.clone(),
                    Some(Gpus::Index(n)) => n.to_string(),
                    _ => String::new(),
                };
                not_found.push(api::GpuLayoutResult {
                    gpu_id: what.clone(),
                    // No GPU: never 0, which is one (gpu_uuid is empty too).
                    gpu_index: u32::MAX,
                    outcome: api::LayoutOutcome::Refused as i32,
                    issues: vec![issue(
                        api::LayoutIssueKind::NotFound,
                        &what,
                        format!("targets[{i}]: GPU {what} does not exist ({})", gpu_range(&view.inventory)),
                    )],
                    ..Default::default()
                });
                continue;
            };
            if let Some(j) = named.insert(gpu.index, i) {
                return Err(format!("targets[{i}]: GPU {} is already named by targets[{j}]", gpu.index));
            }
            specs.push((Some(gpu.index), spec));
        }
        let mut touched = BTreeSet::new();
        for (index, spec) in specs {
            match index {
                None => {
                    config.partitions.retain(|key, _| match config::GpuSelector::parse(key) {
                        Ok(config::GpuSelector::Index(n)) => named.contains_key(&n),
                        Ok(config::GpuSelector::Uuid(u)) => {
                            view.inventory.gpu_by_uuid(&u).is_some_and(|g| named.contains_key(&g.index))
                        }
                        _ => false,
                    });
                    let mut spec = spec;
                    // The layout changes, not who may reset the GPU.
                    spec.reset = config.partitions.get("default").and_then(|s| s.reset);
                    config.partitions.insert("default".into(), spec);
                    touched.extend(view.inventory.gpus.iter().map(|g| g.index));
                }
                Some(index) => {
                    let gpu = view.inventory.gpu(index).expect("found above");
                    let key = entry_key(&config, gpu);
                    let mut spec = spec;
                    spec.reset = config.partitions.get(&key).and_then(|s| s.reset);
                    config.partitions.insert(key, spec);
                    touched.insert(index);
                }
            }
        }
        let mut results =
            self.apply_config(config, &touched, req.dry_run, Origin::Api).map_err(|e| format!("layout: {e}"))?;
        results.extend(not_found);
        Ok(api::ApplyLayoutResponse { results, dry_run: req.dry_run })
    }

    /// Re-reads the configuration file (SIGHUP or the node API) and applies what can change
    /// live; layouts changed through the API are replaced by the file's.
    pub fn reload(&self, dry_run: bool) -> api::ReloadResponse {
        let path = self.source.path.display().to_string();
        let new = match Config::load(&self.source.path, self.source.explicit) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "reload refused: the configuration is invalid; nothing changed");
                return rejected(path, dry_run, e.key, e.reason);
            }
        };
        let (old_file, in_effect) = {
            let live = self.lock();
            (Arc::clone(&live.file_config), Arc::clone(&live.view.config))
        };
        // Live keys against the file last read; keys read only at start against what runs, and
        // what runs is kept for them: measured against the last file, a restart-only change
        // reported once took effect at the next reload, and a file put back still "needed" one.
        let diff = config::reload(&old_file, &new);
        let running = config::reload(&in_effect, &new);
        let value = |c: &Config, key: &str| lookup(c, key);
        let change = |was: &Config, c: &config::Change, reason: &str| api::ConfigChange {
            key: c.key.clone(),
            old_value: value(was, &c.key),
            new_value: value(&new, &c.key),
            reason: reason.into(),
        };
        let applied: Vec<_> =
            diff.changes.iter().filter(|c| c.when == config::When::Live).map(|c| change(&old_file, c, "")).collect();
        let needs_restart: Vec<_> = running
            .changes
            .iter()
            .filter(|c| c.when == config::When::Restart)
            .map(|c| change(&in_effect, c, "read only at start; the running value is kept until a restart"))
            .collect();
        // Layouts: the file's, over what is in effect (which may carry API changes).
        let mut effective = running.effective.clone();
        effective.partitions = new.partitions.clone();
        let view = self.view();
        let touched: BTreeSet<u32> = view
            .inventory
            .gpus
            .iter()
            .filter(|g| {
                in_effect.partition_for(g.index, &g.uuid).map(|(_, s)| s)
                    != new.partition_for(g.index, &g.uuid).map(|(_, s)| s)
            })
            .map(|g| g.index)
            .collect();
        let layouts = match self.apply_config(effective.clone(), &touched, dry_run, Origin::Reload) {
            Ok(r) => r,
            Err(e) => return rejected(path, dry_run, e.key, e.reason),
        };
        if !dry_run {
            self.allocator.set_defaults(&effective);
            self.lock().file_config = Arc::new(new);
        }
        // A layout counts as changed when its entry changed or its devices did (a GPU that
        // finished a MIG mode change after a reset).
        let layouts_changed = !touched.is_empty()
            || layouts.iter().any(|l| !l.created_device_ids.is_empty() || !l.removed_device_ids.is_empty());
        let outcome = if applied.is_empty() && needs_restart.is_empty() && !layouts_changed {
            api::ReloadOutcome::Unchanged
        } else if needs_restart.is_empty() {
            api::ReloadOutcome::Applied
        } else {
            api::ReloadOutcome::Partial
        };
        tracing::info!(
            outcome = api::ReloadOutcome::try_from(outcome as i32).map(|o| o.as_str_name()).unwrap_or("?"),
            live = applied.len(),
            restart = needs_restart.len(),
            dry_run,
            "configuration reloaded"
        );
        api::ReloadResponse {
            outcome: outcome as i32,
            config_path: path,
            applied,
            needs_restart,
            errors: Vec::new(),
            layouts,
            dry_run,
        }
    }
}

/// A reload refused for `key`: nothing changed.
fn rejected(config_path: String, dry_run: bool, key: String, reason: String) -> api::ReloadResponse {
    api::ReloadResponse {
        outcome: api::ReloadOutcome::Rejected as i32,
        config_path,
        errors: vec![api::ConfigError { key, reason }],
        dry_run,
        ..Default::default()
    }
}

/// A configuration value by dotted key, as TOML text (empty when absent).
fn lookup(config: &Config, key: &str) -> String {
    let Ok(mut v) = toml::Value::try_from(config) else { return String::new() };
    for part in split_key(key) {
        match v.get(&part) {
            Some(next) => v = next.clone(),
            None => return String::new(),
        }
    }
    match v {
        toml::Value::String(s) => s,
        other => other.to_string(),
    }
}

/// `a."b.c".d` → [a, b.c, d].
fn split_key(key: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in key.chars() {
        match c {
            '"' => quoted = !quoted,
            '.' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    out.push(cur);
    out
}
