//! The kubelet's side of DRA for tests, from the published protos: the plugin watcher (finds the
//! registration socket, asks GetInfo, reports NotifyRegistrationStatus) and a DRAPlugin client on
//! the endpoint the plugin named, v1 or v1beta1.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tessera_proto::dra::{v1, v1beta1};
use tessera_proto::pluginregistration::v1 as reg;
use tonic::transport::{Channel, Endpoint};

use super::WAIT;

async fn channel(path: &Path) -> Channel {
    let endpoint = Endpoint::from_shared(format!("unix://{}", path.display())).expect("unix endpoint");
    let deadline = Instant::now() + WAIT;
    loop {
        if path.exists()
            && let Ok(channel) = endpoint.connect().await
        {
            return channel;
        }
        assert!(Instant::now() < deadline, "nothing serves {}", path.display());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What the plugin watcher learnt from a registration socket.
pub struct Registered {
    pub info: reg::PluginInfo,
    pub endpoint: PathBuf,
}

/// Registers the plugin whose registration socket is `socket`, as the kubelet's plugin watcher
/// does: GetInfo, checks, NotifyRegistrationStatus(true).
pub async fn register(socket: &Path) -> Registered {
    let mut client = reg::registration_client::RegistrationClient::new(channel(socket).await);
    let info = client.get_info(reg::InfoRequest {}).await.expect("GetInfo").into_inner();
    let ok = info.r#type == reg::DRA_PLUGIN
        && info.supported_versions.iter().any(|v| v == v1::DRA_PLUGIN_SERVICE || v == v1beta1::DRA_PLUGIN_SERVICE);
    client
        .notify_registration_status(reg::RegistrationStatus {
            plugin_registered: ok,
            error: if ok { String::new() } else { format!("unsupported plugin {info:?}") },
        })
        .await
        .expect("NotifyRegistrationStatus");
    assert!(ok, "the kubelet would refuse {info:?}");
    let endpoint = PathBuf::from(&info.endpoint);
    Registered { info, endpoint }
}

pub async fn v1_client(endpoint: &Path) -> v1::dra_plugin_client::DraPluginClient<Channel> {
    v1::dra_plugin_client::DraPluginClient::new(channel(endpoint).await)
}

pub async fn v1beta1_client(endpoint: &Path) -> v1beta1::dra_plugin_client::DraPluginClient<Channel> {
    v1beta1::dra_plugin_client::DraPluginClient::new(channel(endpoint).await)
}

pub fn claim(namespace: &str, uid: &str, name: &str) -> v1::Claim {
    v1::Claim { namespace: namespace.into(), uid: uid.into(), name: name.into() }
}

/// The kubelet's resource-health client (v1) on a DRA endpoint.
pub async fn health_v1_client(
    endpoint: &Path,
) -> tessera_proto::dra_health::v1::dra_resource_health_client::DraResourceHealthClient<Channel> {
    tessera_proto::dra_health::v1::dra_resource_health_client::DraResourceHealthClient::new(channel(endpoint).await)
}

/// Opens the health stream as the kubelet does once a plugin names the service.
pub async fn watch_health(
    endpoint: &Path,
) -> tonic::Streaming<tessera_proto::dra_health::v1::NodeWatchResourcesResponse> {
    let mut client = health_v1_client(endpoint).await;
    client
        .node_watch_resources(tessera_proto::dra_health::v1::NodeWatchResourcesRequest {})
        .await
        .expect("NodeWatchResources")
        .into_inner()
}

/// Health messages until one where `done` accepts the (device name → health, message) map; that
/// map. Fails after [`WAIT`].
pub async fn health_until(
    stream: &mut tonic::Streaming<tessera_proto::dra_health::v1::NodeWatchResourcesResponse>,
    done: impl Fn(&std::collections::BTreeMap<String, (tessera_proto::dra_health::v1::HealthStatus, String)>) -> bool,
) -> std::collections::BTreeMap<String, (tessera_proto::dra_health::v1::HealthStatus, String)> {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let msg = tokio::time::timeout(left, stream.message())
            .await
            .expect("the health awaited in time")
            .expect("health stream ok")
            .expect("health stream open");
        let map = msg
            .devices
            .iter()
            .map(|d| {
                let id = d.device.clone().expect("device id");
                assert_eq!(id.pool_name, "node-a");
                (id.device_name, (d.health(), d.message.clone()))
            })
            .collect();
        if done(&map) {
            return map;
        }
    }
}
