//! The kubelet side of the DRA driver: the `Registration` service the kubelet's plugin watcher
//! finds in `plugins_registry`, and the `DRAPlugin` service (v1 and v1beta1: the same messages in
//! two packages) it then calls. Every claim is handed to a [`ClaimDriver`] on its own; a failure
//! of one claim is that claim's `error`, never the call's, as the API asks.
//!
//! The kubelet removes plugin sockets it finds stale and re-registers plugins whose registration
//! socket is recreated, so [`DraPlugin::serve`] re-binds a socket that disappears (checked every
//! [`RECHECK`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_proto::dra::{v1, v1beta1};
use tessera_proto::dra_health;
use tessera_proto::pluginregistration::v1 as reg;
use tokio::sync::watch;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use super::health_service::HealthService;
use super::{DRIVER, REGISTRATION_SOCKET, SERVICE_SOCKET};

/// How often the sockets are checked for removal.
pub const RECHECK: Duration = Duration::from_millis(200);

/// A claim as the kubelet names it (the allocation core's: a claim's record is owned by its UID).
pub use crate::allocator::ClaimRef;

/// One prepared device of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The claim's requests it serves.
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    /// Fully qualified CDI device names.
    pub cdi_device_ids: Vec<String>,
}

/// What the daemon does for each claim. Both calls must be idempotent: the kubelet repeats them
/// after its own restarts and after ours.
#[tonic::async_trait]
pub trait ClaimDriver: Send + Sync + 'static {
    async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, String>;
    async fn unprepare(&self, claim: &ClaimRef) -> Result<(), String>;
}

/// The DRA plugin: both services over one [`ClaimDriver`].
#[derive(Clone)]
pub struct DraPlugin {
    driver: Arc<dyn ClaimDriver>,
    /// The DRA service's socket (what `GetInfo` names).
    endpoint: PathBuf,
    /// Every `NotifyRegistrationStatus` the kubelet sent: (registered, error).
    status: watch::Sender<Option<(bool, String)>>,
    /// The resource-health service served beside it, when set ([`DraPlugin::with_health`]).
    health: Option<HealthService>,
}

impl std::fmt::Debug for DraPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraPlugin").field("endpoint", &self.endpoint).finish_non_exhaustive()
    }
}

/// Sockets could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("binding {}: {source}", path.display())]
pub struct BindError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

impl DraPlugin {
    /// The plugin whose service listens in `<plugins_dir>/gpu.tessera.io/`.
    pub fn new(plugins_dir: &Path, driver: Arc<dyn ClaimDriver>) -> DraPlugin {
        let endpoint = plugins_dir.join(DRIVER).join(SERVICE_SOCKET);
        DraPlugin { driver, endpoint, status: watch::channel(None).0, health: None }
    }

    /// Also serves the kubelet's resource-health service (v1 and v1alpha1) on the DRA socket,
    /// and names it in `GetInfo`.
    pub fn with_health(mut self, health: HealthService) -> DraPlugin {
        self.health = Some(health);
        self
    }

    /// The DRA service's socket.
    pub fn endpoint(&self) -> &Path {
        &self.endpoint
    }

    /// The kubelet's last word on the registration: `Some((registered, error))`.
    pub fn registration_status(&self) -> watch::Receiver<Option<(bool, String)>> {
        self.status.subscribe()
    }

    /// What `GetInfo` answers.
    pub fn info(&self) -> reg::PluginInfo {
        reg::PluginInfo {
            r#type: reg::DRA_PLUGIN.to_owned(),
            name: DRIVER.to_owned(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: [v1::DRA_PLUGIN_SERVICE, v1beta1::DRA_PLUGIN_SERVICE]
                .into_iter()
                .chain(self.health.iter().flat_map(|_| {
                    [dra_health::v1::DRA_RESOURCE_HEALTH_SERVICE, dra_health::v1alpha1::DRA_RESOURCE_HEALTH_SERVICE]
                }))
                .map(str::to_owned)
                .collect(),
        }
    }

    /// Serves the DRA service, then the registration socket in `registry_dir` (so the kubelet
    /// never finds a registration naming a socket not yet there), until `shutdown` turns true;
    /// re-binds a socket someone removed. Removes both sockets at the end.
    pub async fn serve(self, registry_dir: PathBuf, mut shutdown: watch::Receiver<bool>) -> Result<(), BindError> {
        let registration = registry_dir.join(REGISTRATION_SOCKET);
        if let Some(dir) = self.endpoint.parent() {
            std::fs::create_dir_all(dir).map_err(|source| BindError { path: dir.to_owned(), source })?;
        }
        loop {
            let (stop_tx, stop_rx) = watch::channel(false);
            let service = self.bind_service(stop_rx.clone())?;
            let service_id = file_id(&self.endpoint);
            let registrar = self.bind_registration(&registration, stop_rx)?;
            let registration_id = file_id(&registration);
            tracing::info!(socket = %registration.display(), endpoint = %self.endpoint.display(), "DRA driver {DRIVER} serving");
            let stop = loop {
                tokio::select! {
                    changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { break true },
                    () = tokio::time::sleep(RECHECK) => {}
                }
                if file_id(&self.endpoint) != service_id || file_id(&registration) != registration_id {
                    tracing::info!("a DRA socket was removed; serving and registering again");
                    break false;
                }
            };
            let _ = stop_tx.send(true);
            for task in [service, registrar] {
                if tokio::time::timeout(Duration::from_secs(1), task).await.is_err() {
                    tracing::warn!("a DRA server did not stop within 1 s");
                }
            }
            if stop {
                break;
            }
        }
        for path in [&registration, &self.endpoint] {
            let _ = std::fs::remove_file(path);
        }
        Ok(())
    }

    fn bind_service(&self, stop: watch::Receiver<bool>) -> Result<tokio::task::JoinHandle<()>, BindError> {
        let listener = crate::socket::bind_owner_only_tokio(&self.endpoint)
            .map_err(|source| BindError { path: self.endpoint.clone(), source })?;
        let router = Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(V1(self.clone())))
            .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1(self.clone())))
            .add_optional_service(self.health.as_ref().map(HealthService::v1))
            .add_optional_service(self.health.as_ref().map(HealthService::v1alpha1));
        Ok(spawn_serving(router, listener, stop, "DRA service"))
    }

    fn bind_registration(
        &self,
        path: &Path,
        stop: watch::Receiver<bool>,
    ) -> Result<tokio::task::JoinHandle<()>, BindError> {
        let listener =
            crate::socket::bind_owner_only_tokio(path).map_err(|source| BindError { path: path.to_owned(), source })?;
        let router = Server::builder().add_service(reg::registration_server::RegistrationServer::new(self.clone()));
        Ok(spawn_serving(router, listener, stop, "DRA registration service"))
    }

    /// Prepares every claim on its own, concurrently.
    async fn prepare(&self, claims: Vec<impl Into<ClaimRef>>) -> HashMap<String, Result<Vec<PreparedDevice>, String>> {
        self.each_claim(claims, "claim not prepared", |driver, claim| async move { driver.prepare(&claim).await }).await
    }

    async fn unprepare(&self, claims: Vec<impl Into<ClaimRef>>) -> HashMap<String, Result<(), String>> {
        self.each_claim(claims, "claim not unprepared", |driver, claim| async move { driver.unprepare(&claim).await })
            .await
    }

    /// Runs `call` for every claim on its own, concurrently, answering by claim UID. A claim the
    /// kubelet sent malformed is refused without calling the driver; every failure is logged as
    /// `failed`.
    async fn each_claim<T, Run>(
        &self,
        claims: Vec<impl Into<ClaimRef>>,
        failed: &'static str,
        call: impl Fn(Arc<dyn ClaimDriver>, ClaimRef) -> Run,
    ) -> HashMap<String, Result<T, String>>
    where
        T: Send + 'static,
        Run: std::future::Future<Output = Result<T, String>> + Send + 'static,
    {
        let runs = claims.into_iter().map(Into::into).map(|claim: ClaimRef| {
            let checked = check(&claim);
            // Not polled (so the driver is not called) unless the claim passed the check.
            let run = call(Arc::clone(&self.driver), claim.clone());
            async move {
                let result = match checked {
                    Ok(()) => run.await,
                    Err(e) => Err(e.message().to_owned()),
                };
                if let Err(e) = &result {
                    tracing::warn!(claim = %claim.uid, namespace = %claim.namespace, name = %claim.name, error = %e, "{failed}");
                }
                (claim.uid, result)
            }
        });
        futures_join_all(runs).await.into_iter().collect()
    }
}

/// Serves `router` on `listener` until `stop` turns true; `service` names it when it fails.
fn spawn_serving(
    router: tonic::transport::server::Router,
    listener: tokio::net::UnixListener,
    mut stop: watch::Receiver<bool>,
    service: &'static str,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let serve =
            router.serve_with_incoming_shutdown(crate::socket::Incoming::new(listener, "DRA plugin"), async move {
                let _ = stop.wait_for(|s| *s).await;
            });
        if let Err(e) = serve.await {
            tracing::error!(error = %e, "the {service} stopped");
        }
    })
}

/// Runs futures concurrently and collects their outputs in order (no `futures` crate needed).
async fn futures_join_all<F: std::future::Future + Send + 'static>(runs: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let tasks: Vec<_> = runs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        match t.await {
            Ok(v) => out.push(v),
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
    out
}

/// A claim the kubelet sent must name a UID (the map key) and where to read it.
fn check(claim: &ClaimRef) -> Result<(), Status> {
    if claim.uid.is_empty() {
        return Err(Status::invalid_argument("claim without uid"));
    }
    if claim.namespace.is_empty() || claim.name.is_empty() {
        return Err(Status::invalid_argument(format!("claim {}: namespace and name are required", claim.uid)));
    }
    Ok(())
}

fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

#[tonic::async_trait]
impl reg::registration_server::Registration for DraPlugin {
    async fn get_info(&self, _: Request<reg::InfoRequest>) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(self.info()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let s = request.into_inner();
        if s.plugin_registered {
            tracing::info!("the kubelet registered DRA driver {DRIVER}");
        } else {
            tracing::error!(error = %s.error, "the kubelet refused DRA driver {DRIVER}");
        }
        self.status.send_replace(Some((s.plugin_registered, s.error)));
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// The v1 service.
struct V1(DraPlugin);
/// The v1beta1 service: the same messages in another package.
struct V1beta1(DraPlugin);

/// The two packages' messages, converted field by field through one macro.
macro_rules! dra_service {
    ($wrapper:ident, $api:ident) => {
        impl From<$api::Claim> for ClaimRef {
            fn from(c: $api::Claim) -> Self {
                ClaimRef { namespace: c.namespace, uid: c.uid, name: c.name }
            }
        }

        impl From<PreparedDevice> for $api::Device {
            fn from(d: PreparedDevice) -> Self {
                $api::Device {
                    request_names: d.requests,
                    pool_name: d.pool,
                    device_name: d.device,
                    cdi_device_ids: d.cdi_device_ids,
                }
            }
        }

        #[tonic::async_trait]
        impl $api::dra_plugin_server::DraPlugin for $wrapper {
            async fn node_prepare_resources(
                &self,
                request: Request<$api::NodePrepareResourcesRequest>,
            ) -> Result<Response<$api::NodePrepareResourcesResponse>, Status> {
                let answers = self.0.prepare(request.into_inner().claims).await;
                let claims = answers
                    .into_iter()
                    .map(|(uid, result)| {
                        let answer = match result {
                            Ok(devices) => $api::NodePrepareResourceResponse {
                                devices: devices.into_iter().map($api::Device::from).collect(),
                                error: String::new(),
                            },
                            Err(error) => $api::NodePrepareResourceResponse { devices: Vec::new(), error },
                        };
                        (uid, answer)
                    })
                    .collect();
                Ok(Response::new($api::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$api::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$api::NodeUnprepareResourcesResponse>, Status> {
                let answers = self.0.unprepare(request.into_inner().claims).await;
                let claims = answers
                    .into_iter()
                    .map(|(uid, result)| {
                        (uid, $api::NodeUnprepareResourceResponse { error: result.err().unwrap_or_default() })
                    })
                    .collect();
                Ok(Response::new($api::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_service!(V1, v1);
dra_service!(V1beta1, v1beta1);
