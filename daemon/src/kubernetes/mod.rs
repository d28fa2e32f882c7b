//! What tesserad tells the Kubernetes API server about its node besides the DRA driver's
//! ResourceSlices (`dra/`):
//!
//! - [`event_recorder`]: every fault and recovery as an Event (events.k8s.io/v1) on the Node and on the
//!   Pod holding the device, repeats coalesced into a series count;
//! - [`labels`]: GPU Feature Discovery-style labels under `tessera.io/` on the Node, kept current.
//!
//! Both run when an API server is configured: in `kubernetes.mode` `dra` or `both` (which need
//! one), or with `kubernetes.kubeconfig` set in mode `device-plugin`. Labels can be turned off
//! with `kubernetes.labels = false`.

pub mod event_recorder;
pub mod labels;

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::node::NodeController;

/// Whether `cfg` configures an API server for Events and labels.
pub fn configured(cfg: &Config) -> bool {
    cfg.kubernetes.mode.dra() || cfg.kubernetes.kubeconfig.is_some()
}

/// Starts the Event recorder and (unless `kubernetes.labels = false`) the Node labeller; they run
/// until `shutdown` turns true. `Ok(None)` when no API server is configured; `Err` says what is
/// missing (no node name, an unreadable kubeconfig).
pub async fn start(
    controller: Arc<NodeController>,
    cfg: &Config,
    shutdown: watch::Receiver<bool>,
) -> Result<Option<JoinHandle<()>>, String> {
    if !configured(cfg) {
        tracing::info!("no API server configured: no Kubernetes Events or Node labels");
        return Ok(None);
    }
    let node = crate::config::kubernetes::node_name(cfg)?;
    let client = crate::kube_client::connect(cfg.kubernetes.kubeconfig.as_deref()).await?;
    let (_, bus) = controller.events().subscribe(0);
    let recorder = tokio::spawn(event_recorder::Recorder::new(client.clone(), node.clone()).run(bus, shutdown.clone()));
    let labeller = cfg
        .kubernetes
        .labels
        .then(|| tokio::spawn(labels::Labeller::new(client, node.clone()).run(Arc::clone(&controller), shutdown)));
    tracing::info!(%node, labels = cfg.kubernetes.labels, "Kubernetes Events and Node labels");
    Ok(Some(tokio::spawn(async move {
        let _ = recorder.await;
        if let Some(l) = labeller {
            let _ = l.await;
        }
    })))
}
