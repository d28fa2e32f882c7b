//! The DRA driver in tesserad (`kubernetes.mode` = `dra` or `both`): the node's ResourceSlice
//! publisher and the kubelet plugin, over the controller's picture and the daemon's allocator.
//!
//! The published devices follow the controller: every publish of what is offered (a layout
//! change, a health change, a change of what the records hold) recomputes them from its view,
//! so an unhealthy GPU leaves the slice and comes back on recovery, and what the node API's own
//! allocations hold is left out until released. In mode `both`, GPUs with a `[partitions]`
//! entry stay with the device plugin and are not published (`View::face_of`, the one rule). Dynamic MIG placements are published on GPUs with MIG on
//! that no `[partitions]` entry manages; the instances prepare makes are published again
//! through the controller (it publishes after each one), with the journal read each time.

use std::collections::BTreeSet;
use std::sync::Arc;

use tessera_region::{ComputeMode, Priority};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::DraPlugin;
use super::claim_specs::{ClaimSpecs, NodesOf};
use super::claims::KubeClaims;
use super::devices::{DraDevice, from_inventory, without_node_api};
use super::dynamic_mig::{DynamicMig, Journal, MigControl, with_placements};
use super::health_service::HealthService;
use super::prepare::{ClaimAllocations, DraDriver};
use super::slices::{MEMORY_STEP, Publisher};
use super::status::{KubeClaimStatus, StatusWriter};
use crate::config::Config;
use crate::config::kubernetes::{Mode, node_name};
use crate::node::NodeController;
use crate::node::mig::Placement;
use crate::view::{Face, View};

/// The devices to publish from `view` in `mode` (`dra` or `both`): those of the GPUs whose face
/// is DRA ([`View::face_of`]); `made`: the placements dynamic MIG made (its journal), offered on
/// GPUs no `[partitions]` entry manages. What the node API's own allocations hold (the view's
/// holdings) is taken out.
pub fn published(view: &View, mode: Mode, made: &BTreeSet<Placement>) -> Vec<DraDevice> {
    let devices = from_inventory(&view.inventory, |g| view.face_of(mode, g.index) == Face::Dra, &view.health);
    let devices = with_placements(devices, &view.inventory, |g| !view.partitioned(g.index), made, &view.health);
    without_node_api(devices, &view.holdings, MEMORY_STEP)
}

/// The per-claim CDI specs over the daemon's injection settings, device nodes from the
/// controller's current view. `Err` when no spec directory is configured: the kubelet passes a
/// claim to the runtime by CDI names only.
pub fn claim_specs(controller: Arc<NodeController>, cfg: &Config) -> Result<ClaimSpecs, String> {
    let inj = &cfg.injection;
    if inj.cdi_spec_dir.as_os_str().is_empty() {
        return Err("kubernetes.mode dra/both needs injection.cdi_spec_dir: the kubelet hands a claim to the \
                    container runtime by CDI names only"
            .into());
    }
    let nodes: NodesOf = Arc::new(move |uuid: &str| crate::cdi::device_nodes(&controller.view(), uuid));
    Ok(ClaimSpecs::new(
        inj.cdi_spec_dir.clone(),
        crate::cdi::base(inj, &cfg.runtime_dir, &cfg.state_dir),
        cfg.runtime_dir.clone(),
        nodes,
    ))
}

/// The mode tesserad runs in: `kubernetes.mode`, unless it asks for DRA (`dra`, `both`) on a
/// cluster that cannot run it ([`super::preflight`]): then, saying why in one line, the device
/// plugin serves every GPU (`device-plugin`). A missing node name or API server configuration is
/// left to [`start`], which names it.
pub async fn effective_mode(cfg: &Config) -> Mode {
    let mode = cfg.kubernetes.mode;
    if !mode.dra() {
        return mode;
    }
    let (Ok(node), Ok(client)) =
        (node_name(cfg), crate::kube_client::connect(cfg.kubernetes.kubeconfig.as_deref()).await)
    else {
        return mode;
    };
    match super::preflight::unavailable(&client, &node).await {
        None => mode,
        Some(why) => {
            tracing::error!(
                configured = ?mode,
                "DRA driver {} off: {why}; the device plugin serves every GPU instead (as kubernetes.mode = \"device-plugin\")",
                super::DRIVER
            );
            Mode::DevicePlugin
        }
    }
}

/// Starts the publisher and the kubelet plugin; they run until `shutdown` turns true. `Err`
/// says what is missing (no node name, no API server).
pub async fn start(
    controller: Arc<NodeController>,
    cfg: &Config,
    shutdown: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, String> {
    let node = node_name(cfg)?;
    let client = crate::kube_client::connect(cfg.kubernetes.kubeconfig.as_deref()).await?;
    let mode = cfg.kubernetes.mode;
    let journal = Arc::new(Journal::open(&cfg.state_dir));
    match journal.forget_missing(&controller.view().inventory) {
        Ok(0) => {}
        Ok(n) => tracing::info!(entries = n, "dynamic MIG: journal entries without an instance forgotten"),
        Err(e) => tracing::warn!(error = %e, "dynamic MIG: cannot prune the journal"),
    }
    let mut offered = controller.watch_offer();
    let offer = offered.borrow_and_update().clone();
    let (devices_tx, devices_rx) = watch::channel(published(&offer, mode, &journal.placements()));
    let follow = {
        let journal = Arc::clone(&journal);
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            // One channel: the offer is published again when what the records hold changes too.
            loop {
                tokio::select! {
                    changed = offered.changed() => if changed.is_err() { return },
                    changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return },
                }
                let offer = offered.borrow_and_update().clone();
                let now = published(&offer, mode, &journal.placements());
                devices_tx.send_if_modified(|d| {
                    let changed = *d != now;
                    *d = now;
                    changed
                });
            }
        })
    };
    let publisher = Publisher::new(client.clone(), node.clone());
    let publishing = tokio::spawn(publisher.run(devices_rx.clone(), shutdown.clone(), watch::channel(0).0));
    let allocations = Arc::clone(controller.allocator()) as Arc<dyn ClaimAllocations>;
    let specs = Arc::new(claim_specs(Arc::clone(&controller), cfg)?);
    // The specs of the claims prepared before this start: written again (a lost file comes
    // back), and those of claims no longer prepared removed, before the kubelet is served.
    let (written, removed) = specs.reconcile(&allocations.claim_allocations());
    if written + removed > 0 {
        tracing::info!(written, removed, "claim CDI specs reconciled with the allocations");
    }
    let health = HealthService::new(node.clone(), devices_rx.clone(), cfg.health.enabled);
    let driver = DraDriver {
        claims: Arc::new(KubeClaims::new(client.clone())),
        allocations,
        specs,
        status: Arc::new(StatusWriter::new(Arc::new(KubeClaimStatus::new(client)))),
        devices: devices_rx,
        pool: node.clone(),
        default_priority: Priority::from_name(&cfg.limits.priority).unwrap_or_default(),
        default_compute_mode: ComputeMode::from_name(&cfg.limits.compute_mode).unwrap_or_default(),
        dynamic_mig: Some(Arc::new(DynamicMig::new(journal, Arc::clone(&controller) as Arc<dyn MigControl>))),
    };
    let plugin = DraPlugin::new(&cfg.kubernetes.plugins_dir, Arc::new(driver)).with_health(health);
    let registry = cfg.kubernetes.plugins_registry_dir.clone();
    std::fs::create_dir_all(&registry)
        .map_err(|e| format!("kubernetes.plugins_registry_dir {}: {e}", registry.display()))?;
    tracing::info!(%node, ?mode, "DRA driver starting");
    Ok(tokio::spawn(async move {
        if let Err(e) = plugin.serve(registry, shutdown).await {
            tracing::error!(error = %e, "the DRA kubelet plugin stopped");
        }
        let _ = publishing.await;
        follow.abort();
    }))
}
