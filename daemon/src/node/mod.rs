//! The node controller: the daemon's live picture of the node (configuration in effect,
//! inventory, shares, what is offered, per-GPU layout status, health) and the one place that
//! changes it. Start-up, reloads and the node API's `ApplyLayout` all go through [`converge`]:
//! resolve the layouts against the node, refuse what would take a device from an allocation,
//! plan and apply MIG changes, re-plan shares, rebuild the offered resources, publish them
//! (kubelet plugins watch them) and emit partition events.
//!
//! Changes touch only free devices: a device an allocation holds is never removed or resized;
//! the GPU keeps its layout and the result says which allocation holds what.
//!
//! [`converge`]: NodeController::apply_config

pub mod layout;
pub mod mig;
pub mod preempted;
mod reconfigure;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tessera_proto::tessera::v1 as api;
use tokio::sync::watch;

use crate::allocator::DaemonAllocator;
use crate::config::{self, Config, ConfigError};
use crate::device_health::NodeHealth;
use crate::discovery::{Gpu, Inventory, Session};
use crate::events::EventBus;
use crate::partition::{self, GpuLayout, PlanError, Share};
use crate::resources::Resources;
use crate::state::{AllocDirs, Allocation, Store};
use crate::view::{GpuStatus, View};

/// What asked for a configuration to be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Start,
    Reload,
    Api,
    /// A GPU waiting for a reset to finish a MIG mode change ([`mig`]).
    Reset,
}

/// Where the configuration came from (what a reload re-reads).
#[derive(Debug, Clone)]
pub struct ConfigSource {
    pub path: PathBuf,
    /// Named on the command line: a missing file is an error, not the defaults.
    pub explicit: bool,
}

/// The CDI specs are written from the view's offer (`cdi` stands below the controller).
impl<'a> From<&'a View> for crate::cdi::Offer<'a> {
    fn from(view: &'a View) -> crate::cdi::Offer<'a> {
        crate::cdi::Offer {
            inventory: &view.inventory,
            resources: &view.resources,
            dev_root: &view.config.injection.dev_root,
        }
    }
}

/// Why the daemon cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("discovery: {0}")]
    Discovery(String),
}

/// The controller.
pub struct NodeController {
    session: Session,
    source: ConfigSource,
    allocator: Arc<DaemonAllocator>,
    events: Arc<EventBus>,
    live: Mutex<Live>,
    /// The offer as last published ([`Self::watch_offer`]).
    offer_tx: watch::Sender<Arc<View>>,
    /// What the kubelet is told of the device plugin's offer; `None` while no device plugin runs.
    kubelet_offer: Mutex<Option<Arc<KubeletOffer>>>,
}

/// The device plugin's offer as the kubelet was last told it (set by whoever serves the
/// kubelet, read by the node API and the metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeletOffer {
    /// The resources served.
    pub resources: BTreeSet<String>,
    /// Free devices told unhealthy because they no longer fit beside what the records hold
    /// (`View::withdrawn_from_kubelet`): `(resource, device id)`.
    pub withdrawn: BTreeSet<(String, String)>,
}

impl std::fmt::Debug for NodeController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeController").field("source", &self.source).finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct Live {
    /// The file's configuration as last loaded (what a reload diffs against).
    file_config: Arc<Config>,
    view: View,
    /// GPUs whose reset tesserad tried and the driver refused: not retried on its own (a new
    /// apply or reload tries again).
    reset_refused: BTreeSet<u32>,
}

/// How long after a change to what the records hold its publish waits
/// ([`NodeController::follow_records`]).
const PUBLISH_HOLDINGS_AFTER: std::time::Duration = std::time::Duration::from_millis(1);

/// Allocation directories kept ready for Allocate: a burst larger than this makes the rest on the
/// request path (about 2 ms each) while the pool refills.
const SPARE_ALLOC_DIRS: usize = 8;

impl NodeController {
    /// Discovers the node, loads the allocation state, applies the configured layouts and
    /// builds what is offered. Returns the controller and the per-GPU results.
    pub fn start(
        session: Session,
        config: Config,
        source: ConfigSource,
        store: Store,
        events: Arc<EventBus>,
    ) -> Result<(NodeController, Vec<api::GpuLayoutResult>), StartError> {
        let inventory = session.inventory().map_err(|e| StartError::Discovery(e.to_string()))?;
        // Layout errors the hardware reveals (unknown profiles, shares too big) refuse the start.
        partition::resolve(&config, &inventory)?;
        let dirs = AllocDirs::new(&config.runtime_dir);
        if let Err(e) = dirs.keep_spares(SPARE_ALLOC_DIRS) {
            tracing::warn!(error = %e, "no spare allocation directories: each Allocate makes its own region");
        }
        let allocator = Arc::new(DaemonAllocator::new(&config, Arc::new(Resources::default()), store, dirs));
        let kept = allocator.reconcile();
        tracing::info!(allocations = kept, state = %config.state_dir.display(), "state loaded");
        // A park or resume a killed tesserad left half-done: finished or rolled back (issue 33).
        let parked = allocator.recover_parks(|| crate::allocator::park::checkpoint_api(session.library()));
        if !parked.is_empty() {
            tracing::info!(allocations = ?parked, "parked allocations kept parked");
        }
        let config = Arc::new(config);
        let view = View {
            config: Arc::clone(&config),
            inventory,
            shares: Arc::default(),
            resources: Arc::new(Resources::default()),
            status: BTreeMap::new(),
            health: NodeHealth::default(),
            holdings: Arc::new(allocator.holdings()),
        };
        let (offer_tx, _) = watch::channel(Arc::new(view.clone()));
        let controller = NodeController {
            session,
            source,
            allocator,
            events,
            live: Mutex::new(Live { file_config: Arc::clone(&config), view, reset_refused: BTreeSet::new() }),
            offer_tx,
            kubelet_offer: Mutex::new(None),
        };
        let all: BTreeSet<u32> = controller.view().inventory.gpus.iter().map(|g| g.index).collect();
        let results = controller.apply_config((*config).clone(), &all, false, Origin::Start)?;
        // Kubelet allocations a power cut took from the journal's tail, made again from the
        // kubelet's own checkpoint now that the devices' limits are offered, before the device
        // plugins serve (`allocator::kubelet_grants`).
        if config.kubernetes.mode.device_plugin() {
            controller.recover_kubelet_grants(&config.device_plugin_dir);
        }
        // Allocations preempted before a restart whose room is back (the allocation they were
        // parked for released, or never made: killed between the park and the record) resume
        // now, once the rooms are published and before any face serves (issue 33).
        controller.resume_preempted();
        Ok((controller, results))
    }

    /// Reads the kubelet's checkpoint in `device_plugin_dir` and makes again the kubelet
    /// allocations it keeps that the records lost; a checkpoint that cannot be read is said and
    /// left as it is (it is the kubelet's).
    fn recover_kubelet_grants(&self, device_plugin_dir: &std::path::Path) {
        match crate::allocator::kubelet_grants::read(device_plugin_dir) {
            Ok(None) => {}
            Ok(Some(grants)) => {
                let made = self.allocator.recover_kubelet_grants(&grants);
                if !made.is_empty() {
                    self.publish_holdings();
                }
            }
            Err(e) => tracing::warn!(
                "{e}; kubelet allocations lost from the records (only after a power cut) cannot be made again from it"
            ),
        }
    }

    /// The NVML session (for health checks and usage).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The kubelet-facing allocator.
    pub fn allocator(&self) -> &Arc<DaemonAllocator> {
        &self.allocator
    }

    /// The event bus.
    pub fn events(&self) -> &Arc<EventBus> {
        &self.events
    }

    /// Where the configuration is read from.
    pub fn source(&self) -> &ConfigSource {
        &self.source
    }

    /// The offer, as published after every change of what the node offers (layouts, devices,
    /// health with its reason) and of what the allocation records hold of it (while
    /// [`Self::follow_records`] runs): the one value every face follows. The device plugin serves
    /// its resources with the devices that no longer fit withdrawn, the DRA driver publishes its
    /// devices less what the node API holds, the Node's labels and the CDI specs follow its
    /// inventory; each reads this snapshot, not the controller's lock.
    pub fn watch_offer(&self) -> watch::Receiver<Arc<View>> {
        self.offer_tx.subscribe()
    }

    /// Publishes the offer again whenever what the allocation records hold changes (a record
    /// made, released or given new limits, through any way in), until `shutdown` turns true:
    /// the faces then follow one channel, [`Self::watch_offer`]. Changes that come together are
    /// published once; a change that leaves the holdings as published publishes nothing.
    pub fn follow_records(self: &Arc<Self>, mut shutdown: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        let controller = Arc::clone(self);
        let mut changes = self.allocator.holdings_changes();
        tokio::spawn(async move {
            loop {
                // Every change since the receiver was made (or last looked at) is in this one.
                changes.borrow_and_update();
                controller.publish_holdings();
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() { return },
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
                // The change's caller is still answering (the kubelet's Allocate: the answer
                // leaves right after the record): publish a moment later, off its way, with
                // whatever else changed meanwhile.
                tokio::time::sleep(PUBLISH_HOLDINGS_AFTER).await;
            }
        })
    }

    /// Publishes the view again with the allocator's holdings, when they differ from those
    /// published.
    fn publish_holdings(&self) {
        let mut live = self.lock();
        let holdings = self.allocator.holdings();
        if *live.view.holdings == holdings {
            return;
        }
        live.view.holdings = Arc::new(holdings);
        self.offer_tx.send_replace(Arc::new(live.view.clone()));
    }

    /// What the kubelet was last told of the device plugin's offer; `None` while none is served.
    pub fn kubelet_offer(&self) -> Option<Arc<KubeletOffer>> {
        self.kubelet_offer.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Records what the kubelet is now told (see [`Self::kubelet_offer`]).
    pub fn set_kubelet_offer(&self, offer: KubeletOffer) {
        *self.kubelet_offer.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(offer));
    }

    /// A copy of the live picture.
    pub fn view(&self) -> View {
        self.lock().view.clone()
    }

    /// Every allocation record.
    pub fn allocations(&self) -> Vec<Allocation> {
        self.allocator.allocations()
    }

    /// The GPUs as Allocate sees them: shares carved from those with MIG off, whole GPUs, MIG
    /// devices; with why some cannot be used now.
    pub fn gpu_rooms(&self) -> Vec<crate::carve::GpuRoom> {
        rooms_of(&self.view())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The GPUs of `view` as Allocate sees them ([`NodeController::gpu_rooms`]).
fn rooms_of(view: &View) -> Vec<crate::carve::GpuRoom> {
    let dev_root = &view.config.injection.dev_root;
    view.inventory
        .gpus
        .iter()
        .map(|g| crate::carve::GpuRoom {
            index: g.index,
            uuid: g.uuid.clone(),
            model: g.name.clone(),
            memory_total: g.memory_total,
            unavailable: view.health.of(g.index, &g.uuid).reason().map(|why| format!("unhealthy: {why}")),
            mig_mode: g.mig.as_ref().is_some_and(|m| m.current || m.pending),
            // Only instances in effect (MIG mode on now), each with its one compute instance.
            mig: g
                .mig
                .iter()
                .filter(|m| m.current)
                .flat_map(|m| &m.instances)
                .flat_map(|gi| gi.devices.iter().map(move |d| (gi, d)))
                .map(|(gi, d)| crate::carve::MigSlot {
                    uuid: d.uuid.clone(),
                    profile: gi.profile.clone(),
                    memory_total: d.memory_total,
                    unavailable: view.health.of(g.index, &d.uuid).reason().map(|why| format!("unhealthy: {why}")),
                })
                .collect(),
            mig_profiles: g.mig.as_ref().map(|m| m.capability.names()).unwrap_or_default(),
            nodes: g.minor.map(|m| dev_root.join(format!("nvidia{m}"))).into_iter().collect(),
        })
        .collect()
}

impl NodeController {
    /// Marks GPUs and devices healthy or not (the health monitor's input) and republishes what
    /// is offered when that changes anything.
    pub fn set_health(&self, health: NodeHealth) {
        let mut live = self.lock();
        if live.view.health == health {
            return;
        }
        live.view.health = health;
        let mut res = (*live.view.resources).clone();
        res.mark_unhealthy(&live.view.health);
        self.publish(live, res);
    }

    /// Publishes the live view with `resources` and the allocator's holdings: the allocator's
    /// resources and rooms first (a device the faces are told of can be allocated), then the
    /// offer the faces read. All under the lock, so that publishes (this one and
    /// [`Self::publish_holdings`]) reach the faces in the order they were made.
    fn publish(&self, mut live: std::sync::MutexGuard<'_, Live>, resources: Resources) {
        let resources = Arc::new(resources);
        live.view.resources = Arc::clone(&resources);
        live.view.holdings = Arc::new(self.allocator.holdings());
        self.allocator.set_resources(resources);
        self.allocator.set_rooms(rooms_of(&live.view));
        self.offer_tx.send_replace(Arc::new(live.view.clone()));
    }

    /// Makes `config` the configuration in effect: layouts resolved, GPUs in `touched` reported
    /// on, changes that would take a held device refused per GPU (that GPU keeps its entry),
    /// MIG plans applied (unless `dry_run`), shares re-planned, resources rebuilt and published.
    fn apply_config(
        &self,
        mut config: Config,
        touched: &BTreeSet<u32>,
        dry_run: bool,
        origin: Origin,
    ) -> Result<Vec<api::GpuLayoutResult>, ConfigError> {
        let starting = origin == Origin::Start;
        // A refused API request leaves nothing behind (its GPU's status stays as it was); a
        // refused file layout stays wanted, so its GPU shows as diverged with the reasons.
        let from_api = origin == Origin::Api;
        // One change at a time: the lock is held from planning to publishing.
        let mut live = self.lock();
        let inv = self.session.inventory().map_err(|e| ConfigError::new("", format!("discovery: {e}")))?;
        let allocations = self.allocator.allocations();
        let held = held_devices(&allocations);
        let held_set: BTreeSet<String> = held.keys().cloned().collect();
        let before_res = Arc::clone(&live.view.resources);
        let before_config = Arc::clone(&live.view.config);

        // 1. Refuse, per GPU, what would take a held device; those GPUs keep their entry.
        let layouts = partition::resolve(&config, &inv)?;
        let mut issues: BTreeMap<u32, Vec<api::LayoutIssue>> = BTreeMap::new();
        let mut refused = BTreeSet::new();
        for l in &layouts {
            let gpu = inv.gpu(l.index).expect("layouts come from this inventory");
            if let Some(reason) = live.view.health.gpu(l.index)
                && !starting
                && before_config.partition_for(gpu.index, &gpu.uuid).map(|(_, s)| s)
                    != config.partition_for(gpu.index, &gpu.uuid).map(|(_, s)| s)
            {
                issues.entry(l.index).or_default().push(issue(
                    api::LayoutIssueKind::Unhealthy,
                    &gpu.uuid,
                    format!("the GPU is unhealthy ({reason}); its layout is kept"),
                ));
                refused.insert(l.index);
                continue;
            }
            let conflicts = taken_devices(gpu, l, &allocations);
            if !conflicts.is_empty() {
                issues.entry(l.index).or_default().extend(conflicts);
                refused.insert(l.index);
            }
        }
        for &index in &refused {
            let gpu = inv.gpu(index).expect("refused GPUs come from this inventory");
            let mut keep = match before_config.partition_for(gpu.index, &gpu.uuid) {
                Some((_, spec)) if !starting => spec.clone(),
                _ => layout::current_spec(gpu, &live.view.shares),
            };
            let key = entry_key(&config, gpu);
            keep.reset = config.partitions.get(&key).and_then(|s| s.reset);
            config.partitions.insert(key, keep);
        }
        let layouts = partition::resolve(&config, &inv)?;

        // 2. Plan (and apply) the MIG side. A dry run predicts the inventory each plan leaves.
        let mut outcome: BTreeMap<u32, api::LayoutOutcome> = BTreeMap::new();
        let mut pending = BTreeSet::new();
        let mut predicted = inv.clone();
        let mut reset_gpus = BTreeSet::new();
        for l in &layouts {
            let gpu = inv.gpu(l.index).expect("layouts come from this inventory");
            if refused.contains(&l.index) {
                outcome.insert(l.index, api::LayoutOutcome::Refused);
            }
            let plan = match partition::plan(l.desired(), gpu.mig.as_ref(), &held_set, &gpu.processes) {
                Ok(p) => p,
                Err(e) => {
                    issues.entry(l.index).or_default().push(plan_issue(gpu, &e, &held));
                    outcome.insert(l.index, api::LayoutOutcome::Refused);
                    continue;
                }
            };
            let mut plan = plan;
            let mut after = mig::predict(gpu, &plan);
            if !dry_run && !self.apply_plan(gpu, &plan, &mut issues, &mut outcome) {
                continue;
            }
            // A mode change on a GPU that switches MIG mode in place (Hopper and later) is in
            // effect now: its instances are planned from what NVML shows at once. On one that
            // takes it at a reset (Ampere), reset the GPU now if its policy allows and nothing
            // holds it.
            let in_place = plan.pending_reset && gpu.mig.as_ref().is_some_and(|m| m.switches_in_place);
            let may_reset = plan.pending_reset
                && !in_place
                && config.reset_policy(gpu.index, &gpu.uuid) == config::ResetPolicy::WhenFree
                && mig::is_free(gpu, &allocations);
            if in_place || may_reset {
                let reset = if dry_run {
                    Some(if in_place { mig::predict_in_place(&after) } else { mig::predict_reset(&after) })
                } else if in_place {
                    let fresh = self
                        .session
                        .inventory()
                        .map_err(|e| ConfigError::new("", format!("discovery after a MIG mode change: {e}")))?;
                    fresh.gpu(gpu.index).cloned()
                } else {
                    match self.session.reset_gpu(gpu.index) {
                        Ok(()) => {
                            tracing::info!(
                                gpu = gpu.index,
                                "GPU reset to finish its MIG mode change (reset = when-free)"
                            );
                            reset_gpus.insert(gpu.index);
                            live.reset_refused.remove(&gpu.index);
                            let fresh = self
                                .session
                                .inventory()
                                .map_err(|e| ConfigError::new("", format!("discovery after a GPU reset: {e}")))?;
                            fresh.gpu(gpu.index).cloned()
                        }
                        Err(e) => {
                            tracing::warn!(gpu = gpu.index, error = %e, "cannot reset the GPU; its MIG mode change waits");
                            live.reset_refused.insert(gpu.index);
                            issues.entry(l.index).or_default().push(issue(
                                api::LayoutIssueKind::DriverError,
                                &gpu.uuid,
                                format!("tesserad could not reset the GPU (reset = \"when-free\"): {e}"),
                            ));
                            None
                        }
                    }
                };
                if let Some(reset) = reset {
                    match partition::plan(l.desired(), reset.mig.as_ref(), &held_set, &reset.processes) {
                        Ok(p) => {
                            if !dry_run && !self.apply_plan(&reset, &p, &mut issues, &mut outcome) {
                                continue;
                            }
                            after = mig::predict(&reset, &p);
                            plan = p;
                        }
                        Err(e) => {
                            issues.entry(l.index).or_default().push(plan_issue(&reset, &e, &held));
                            outcome.insert(l.index, api::LayoutOutcome::Refused);
                            continue;
                        }
                    }
                }
            }
            if plan.pending_reset {
                pending.insert(l.index);
                issues.entry(l.index).or_default().push(issue(
                    api::LayoutIssueKind::ResetRequired,
                    &gpu.uuid,
                    "the MIG mode change takes effect at the next GPU reset (tesserad finishes the layout then)".into(),
                ));
            }
            if let Some(g) = predicted.gpus.iter_mut().find(|g| g.index == l.index) {
                *g = after;
            }
        }

        // 3. What the node offers now.
        let after_inv = if dry_run {
            predicted
        } else {
            self.session.inventory().map_err(|e| ConfigError::new("", format!("discovery after partitioning: {e}")))?
        };
        let after_layouts = partition::resolve(&config, &after_inv)?;
        let shares = partition::plan_all_shares(&after_inv, &after_layouts)
            .map_err(|e| ConfigError::new("partitions", e.to_string()))?;
        let mut resources = Resources::build(&config, &after_inv, &after_layouts, &shares);
        resources.mark_unhealthy(&live.view.health);

        // 4. Per-GPU results and events.
        let mut results = Vec::new();
        let mut status = live.view.status.clone();
        for gpu in &after_inv.gpus {
            let managed = after_layouts.iter().any(|l| l.index == gpu.index);
            let ids = |r: &Resources| -> BTreeSet<String> {
                r.devices_of_gpu(gpu.index).map(|(_, d)| d.id.clone()).collect()
            };
            let (old_ids, new_ids) = (ids(&before_res), ids(&resources));
            let created: Vec<String> = new_ids.difference(&old_ids).cloned().collect();
            let removed: Vec<String> = old_ids.difference(&new_ids).cloned().collect();
            let gpu_issues = issues.remove(&gpu.index).unwrap_or_default();
            let result_outcome = outcome.get(&gpu.index).copied().unwrap_or(if pending.contains(&gpu.index) {
                api::LayoutOutcome::PendingReset
            } else if created.is_empty() && removed.is_empty() {
                api::LayoutOutcome::Unchanged
            } else {
                api::LayoutOutcome::Applied
            });
            let api_refusal = from_api && result_outcome == api::LayoutOutcome::Refused;
            if managed && !dry_run && !api_refusal {
                let state = match result_outcome {
                    api::LayoutOutcome::Refused | api::LayoutOutcome::Partial => api::PartitionState::Diverged,
                    api::LayoutOutcome::PendingReset => api::PartitionState::PendingReset,
                    _ => api::PartitionState::Converged,
                };
                status.insert(gpu.index, GpuStatus { state, issues: gpu_issues.clone() });
            } else if !managed && !dry_run && !api_refusal {
                status.remove(&gpu.index);
            }
            let current = layout::api_from_spec(&layout::current_spec(gpu, &shares));
            if !dry_run && (!created.is_empty() || !removed.is_empty()) && !starting {
                let previous =
                    inv.gpu(gpu.index).map(|g| layout::api_from_spec(&layout::current_spec(g, &live.view.shares)));
                self.events.publish(api::Event {
                    kind: api::EventKind::PartitionChanged as i32,
                    severity: api::Severity::Info as i32,
                    device_id: gpu.uuid.clone(),
                    device_uuid: gpu.uuid.clone(),
                    device_kind: api::DeviceKind::Gpu as i32,
                    message: format!(
                        "GPU {}: {} device(s) created, {} removed",
                        gpu.index,
                        created.len(),
                        removed.len()
                    ),
                    detail: Some(api::event::Detail::PartitionChange(api::PartitionChange {
                        previous,
                        current: Some(current.clone()),
                        created_device_ids: created.clone(),
                        removed_device_ids: removed.clone(),
                    })),
                    ..Default::default()
                });
            }
            if touched.contains(&gpu.index) || !created.is_empty() || !removed.is_empty() {
                results.push(api::GpuLayoutResult {
                    gpu_id: gpu.uuid.clone(),
                    gpu_uuid: gpu.uuid.clone(),
                    gpu_index: gpu.index,
                    outcome: result_outcome as i32,
                    layout: Some(current),
                    created_device_ids: created,
                    removed_device_ids: removed,
                    issues: gpu_issues,
                });
            }
        }
        if dry_run {
            return Ok(results);
        }

        // 5. Publish.
        live.view.config = Arc::new(config);
        live.view.inventory = after_inv;
        live.view.shares = Arc::new(shares);
        live.view.status = status;
        self.publish(live, resources);
        Ok(results)
    }
}

impl NodeController {
    /// Applies `plan` on `gpu`; false, with the issue and outcome recorded, when the driver
    /// refused an action.
    fn apply_plan(
        &self,
        gpu: &Gpu,
        plan: &partition::MigPlan,
        issues: &mut BTreeMap<u32, Vec<api::LayoutIssue>>,
        outcome: &mut BTreeMap<u32, api::LayoutOutcome>,
    ) -> bool {
        if plan.actions.is_empty() {
            return true;
        }
        let cap = gpu.mig.as_ref().map(|m| &m.capability);
        match partition::apply(&self.session, gpu.index, plan, cap) {
            Ok(_) => true,
            Err(e) => {
                let partial = !e.done.is_empty();
                issues.entry(gpu.index).or_default().push(issue(
                    api::LayoutIssueKind::DriverError,
                    &gpu.uuid,
                    format!("the driver refused {:?}: {}", e.action, e.source),
                ));
                outcome
                    .insert(gpu.index, if partial { api::LayoutOutcome::Partial } else { api::LayoutOutcome::Refused });
                false
            }
        }
    }
}

/// The `partitions` key that decides `gpu`'s layout if it names only that GPU: its UUID key or
/// index key when present, else the index (a new entry over `default`).
fn entry_key(config: &Config, gpu: &Gpu) -> String {
    if config.partitions.contains_key(&gpu.uuid) { gpu.uuid.clone() } else { gpu.index.to_string() }
}

/// The GPUs a node has, for errors: `GPUs 0-7`, `GPU 0`, `no GPUs`.
fn gpu_range(inv: &Inventory) -> String {
    let mut idx: Vec<u32> = inv.gpus.iter().map(|g| g.index).collect();
    idx.sort_unstable();
    match idx.as_slice() {
        [] => "this node has no GPUs".into(),
        [one] => format!("this node has GPU {one}"),
        [first, .., last] if (last - first) as usize + 1 == idx.len() => format!("this node has GPUs {first}-{last}"),
        _ => format!("this node has GPUs {}", idx.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// Held device ids and physical UUIDs → the allocations holding them.
fn held_devices(allocations: &[Allocation]) -> BTreeMap<String, Vec<api::Holder>> {
    let mut held: BTreeMap<String, Vec<api::Holder>> = BTreeMap::new();
    for a in allocations {
        let holder = holder(a);
        for d in &a.devices {
            held.entry(d.device_id.clone()).or_default().push(holder.clone());
            if d.physical_uuid != d.device_id {
                held.entry(d.physical_uuid.clone()).or_default().push(holder.clone());
            }
        }
    }
    held
}

/// The API's holder for an allocation.
pub fn holder(a: &Allocation) -> api::Holder {
    api::Holder { allocation_id: a.id.clone(), container: Some(identity(&a.container)) }
}

/// The API's container identity.
pub fn identity(c: &crate::state::ContainerIdentity) -> api::ContainerIdentity {
    api::ContainerIdentity {
        pod_namespace: c.pod_namespace.clone().unwrap_or_default(),
        pod_name: c.pod_name.clone().unwrap_or_default(),
        pod_uid: c.pod_uid.clone().unwrap_or_default(),
        container_name: c.container_name.clone().unwrap_or_default(),
        container_id: c.container_id.clone().unwrap_or_default(),
    }
}

/// Held devices on `gpu` that layout `l` would remove or resize. MIG instances themselves are
/// the planner's to keep (it refuses to destroy a held one); this covers whole GPUs, shares of
/// the GPU and shares of kept MIG instances.
fn taken_devices(gpu: &Gpu, l: &GpuLayout<'_>, allocations: &[Allocation]) -> Vec<api::LayoutIssue> {
    use crate::config::PartitionKind;
    let mig_on = gpu.mig.as_ref().is_some_and(|m| m.current);
    let mig_devices: BTreeMap<&str, (&str, u64)> = gpu
        .mig
        .iter()
        .flat_map(|m| &m.instances)
        .flat_map(|gi| gi.devices.iter().map(move |d| (d.uuid.as_str(), (gi.profile.as_str(), d.memory_total))))
        .collect();
    let mut out = Vec::new();
    for a in allocations {
        for d in &a.devices {
            let on_gpu = d.physical_uuid == gpu.uuid;
            let mig_parent = mig_devices.get(d.physical_uuid.as_str());
            if !on_gpu && mig_parent.is_none() {
                continue;
            }
            let is_share = d.device_id != d.physical_uuid;
            let survives = match (l.kind, on_gpu, is_share) {
                // The node API's and claims' devices are no layout's (a carved share, a GPU or a
                // MIG device given whole): any layout that leaves MIG off keeps them, and their
                // MIG devices are the planner's to keep. Counting a carved share as the whole GPU
                // held refused every shares layout on its GPU, at start too, where the GPU then
                // lost its shares.
                // A part of the GPU recovered from its directory after a journal loss: its
                // device id is lost, so it is kept as a carved share is (whole, it is held whole
                // below). Taken as the whole GPU held, it refused the GPU's shares layout.
                _ if a.source == crate::state::Source::NodeApi
                    || (a.source == crate::state::Source::Recovered && !d.is_whole()) =>
                {
                    !on_gpu || !matches!(l.kind, PartitionKind::Mig { .. })
                }
                // The whole GPU held: only a whole layout (MIG off) keeps it.
                (PartitionKind::Whole, true, false) => !mig_on,
                (_, true, false) => false,
                // A share of the GPU: kept when the new shares plan the same share.
                (PartitionKind::Shares(spec), true, true) => {
                    partition::plan_shares(&gpu.uuid, gpu.memory_total, spec).is_ok_and(|s| same_share(&s, d))
                }
                (_, true, true) => false,
                // A MIG device: the planner decides.
                (_, false, false) => true,
                // A share of a MIG device: kept when its profile's shares plan the same share.
                (PartitionKind::Mig { shares, .. }, false, true) => {
                    let (profile, memory) = *mig_parent.expect("checked above");
                    shares.and_then(|s| s.get(profile)).is_some_and(|spec| {
                        partition::plan_shares(&d.physical_uuid, memory, spec).is_ok_and(|s| same_share(&s, d))
                    })
                }
                (_, false, true) => false,
            };
            if !survives {
                out.push(api::LayoutIssue {
                    kind: api::LayoutIssueKind::InUse as i32,
                    device_id: d.device_id.clone(),
                    message: format!(
                        "{} is allocated ({}); the layout would remove or resize it, so the GPU keeps its layout",
                        d.device_id, a.id
                    ),
                    holders: vec![holder(a)],
                });
            }
        }
    }
    out
}

fn same_share(planned: &[Share], held: &crate::state::AllocatedDevice) -> bool {
    planned.iter().any(|s| {
        s.id == held.device_id && Some(s.memory_limit) == held.memory_limit && Some(s.sm_percent) == held.sm_percent
    })
}

fn plan_issue(gpu: &Gpu, e: &PlanError, held: &BTreeMap<String, Vec<api::Holder>>) -> api::LayoutIssue {
    let message = e.to_string();
    match e {
        PlanError::NotSupported => issue(api::LayoutIssueKind::MigUnsupported, &gpu.uuid, message),
        PlanError::UnknownProfile { .. } => issue(api::LayoutIssueKind::UnknownProfile, &gpu.uuid, message),
        PlanError::NoFit { .. } => issue(api::LayoutIssueKind::DoesNotFit, &gpu.uuid, message),
        PlanError::GpuInUse { .. } => issue(api::LayoutIssueKind::InUse, &gpu.uuid, message),
        PlanError::InUse { gi_id, .. } => {
            let device = gpu
                .mig
                .iter()
                .flat_map(|m| &m.instances)
                .find(|gi| gi.gi_id == *gi_id)
                .and_then(|gi| gi.devices.first())
                .map(|d| d.uuid.clone())
                .unwrap_or_default();
            api::LayoutIssue {
                kind: api::LayoutIssueKind::InUse as i32,
                holders: held.get(&device).cloned().unwrap_or_default(),
                device_id: device,
                message,
            }
        }
    }
}

fn issue(kind: api::LayoutIssueKind, device: &str, message: String) -> api::LayoutIssue {
    api::LayoutIssue { kind: kind as i32, device_id: device.to_owned(), message, holders: Vec::new() }
}
