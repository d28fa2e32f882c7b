//! The kubelet's DRA resource-health service (`DRAResourceHealth.NodeWatchResources`, KEP-4680),
//! v1 and v1alpha1, served on the DRA socket beside `DRAPlugin`: one stream per kubelet
//! connection, each message the health of every device this node publishes (a complete list, as
//! the API asks), sent at once, again on every change of the published devices (the health
//! monitor's faults and recoveries reach them through the controller), and every [`RESEND`] so
//! the kubelet never times a device out to unknown.
//!
//! A device is `UNHEALTHY` while the health monitor holds it out of service (lost, unhealthy or
//! still recovering; the reason is the message), `HEALTHY` otherwise, and `UNKNOWN` for every
//! device when health checking is off (`[health] enabled = false`): nobody is looking.

use std::pin::Pin;
use std::time::Duration;

use tessera_proto::dra_health::{v1, v1alpha1};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::devices::DraDevice;
use crate::client_input::cut_to;

/// How often the whole list is sent again without a change.
pub const RESEND: Duration = Duration::from_secs(10);
/// `health_check_timeout_seconds`: three missed resends before the kubelet says unknown.
pub const TIMEOUT_SECONDS: i64 = 30;
/// The longest message the kubelet keeps.
const MAX_MESSAGE: usize = 1024;

/// What one device's health is, as the service reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy,
    Unknown,
}

/// One device's line in a response, whichever version carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    pub pool: String,
    pub device: String,
    pub health: Health,
    /// Unix seconds.
    pub last_updated: i64,
    pub message: String,
}

/// The health of every device in `devices`, determined at `now` (Unix seconds).
pub fn report(pool: &str, devices: &[DraDevice], monitored: bool, now: i64) -> Vec<DeviceHealth> {
    devices
        .iter()
        .map(|d| {
            let (health, message) = match (d.health.reason(), monitored) {
                (_, false) => (Health::Unknown, "health checking is off ([health] enabled = false)".to_owned()),
                (Some(why), true) => (Health::Unhealthy, why.to_owned()),
                (None, true) => (Health::Healthy, String::new()),
            };
            let message = cut_to(message, MAX_MESSAGE);
            DeviceHealth { pool: pool.to_owned(), device: d.name.clone(), health, last_updated: now, message }
        })
        .collect()
}

fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The service: the published devices (with their health) of this node's pool.
#[derive(Debug, Clone)]
pub struct HealthService {
    pool: String,
    devices: watch::Receiver<Vec<DraDevice>>,
    monitored: bool,
}

impl HealthService {
    /// Reports `devices` of `pool`; `monitored`: whether the health monitor runs.
    pub fn new(pool: impl Into<String>, devices: watch::Receiver<Vec<DraDevice>>, monitored: bool) -> HealthService {
        HealthService { pool: pool.into(), devices, monitored }
    }

    /// A stream of reports, converted by `convert`, until the receiver goes.
    fn watch<T: Send + 'static>(&self, convert: fn(Vec<DeviceHealth>) -> T) -> ReceiverStream<Result<T, Status>> {
        let (tx, rx) = mpsc::channel(4);
        let mut devices = self.devices.clone();
        let (pool, monitored) = (self.pool.clone(), self.monitored);
        tokio::spawn(async move {
            loop {
                let now = devices.borrow_and_update().clone();
                let message = convert(report(&pool, &now, monitored, unix_now()));
                if tx.send(Ok(message)).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = devices.changed() => if changed.is_err() { return },
                    () = tokio::time::sleep(RESEND) => {}
                    () = tx.closed() => return,
                }
            }
        });
        ReceiverStream::new(rx)
    }

    /// The v1 server.
    pub fn v1(&self) -> v1::dra_resource_health_server::DraResourceHealthServer<V1> {
        v1::dra_resource_health_server::DraResourceHealthServer::new(V1(self.clone()))
    }

    /// The v1alpha1 server.
    pub fn v1alpha1(&self) -> v1alpha1::dra_resource_health_server::DraResourceHealthServer<V1alpha1> {
        v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(V1alpha1(self.clone()))
    }
}

/// The v1 service.
#[derive(Debug)]
pub struct V1(HealthService);
/// The v1alpha1 service: the same messages in another package.
#[derive(Debug)]
pub struct V1alpha1(HealthService);

type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

macro_rules! health_service {
    ($wrapper:ident, $api:ident) => {
        impl $wrapper {
            fn convert(devices: Vec<DeviceHealth>) -> $api::NodeWatchResourcesResponse {
                let devices = devices
                    .into_iter()
                    .map(|d| $api::DeviceHealth {
                        device: Some($api::DeviceIdentifier { pool_name: d.pool, device_name: d.device }),
                        health: match d.health {
                            Health::Healthy => $api::HealthStatus::Healthy,
                            Health::Unhealthy => $api::HealthStatus::Unhealthy,
                            Health::Unknown => $api::HealthStatus::Unknown,
                        } as i32,
                        last_updated_time: d.last_updated,
                        health_check_timeout_seconds: TIMEOUT_SECONDS,
                        message: d.message,
                    })
                    .collect();
                $api::NodeWatchResourcesResponse { devices }
            }
        }

        #[tonic::async_trait]
        impl $api::dra_resource_health_server::DraResourceHealth for $wrapper {
            type NodeWatchResourcesStream = Stream<$api::NodeWatchResourcesResponse>;

            async fn node_watch_resources(
                &self,
                _: Request<$api::NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                tracing::debug!("the kubelet watches device health ({})", stringify!($api));
                Ok(Response::new(Box::pin(self.0.watch(Self::convert))))
            }
        }
    };
}

health_service!(V1, v1);
health_service!(V1alpha1, v1alpha1);

#[cfg(test)]
mod tests {
    use tessera_proto::dra_health::v1::dra_resource_health_server::DraResourceHealth;
    use tokio_stream::StreamExt;

    use super::*;

    fn device(name: &str, unhealthy: Option<&str>) -> DraDevice {
        DraDevice::test_gpu(name, unhealthy)
    }

    fn states(r: &v1::NodeWatchResourcesResponse) -> Vec<(String, String, v1::HealthStatus, String)> {
        r.devices
            .iter()
            .map(|d| {
                let id = d.device.clone().expect("device");
                (id.pool_name, id.device_name, d.health(), d.message.clone())
            })
            .collect()
    }

    #[tokio::test]
    async fn every_device_at_start_then_on_every_change() {
        let (tx, rx) = watch::channel(vec![device("gpu-0", None), device("gpu-1", None)]);
        let service = HealthService::new("node-a", rx, true);
        let mut stream = V1(service)
            .node_watch_resources(Request::new(v1::NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        use v1::HealthStatus::{Healthy, Unhealthy};
        assert_eq!(
            states(&first),
            [
                ("node-a".into(), "gpu-0".into(), Healthy, String::new()),
                ("node-a".into(), "gpu-1".into(), Healthy, String::new())
            ]
        );
        assert!(first.devices.iter().all(|d| d.last_updated_time > 1_700_000_000), "Unix seconds");
        assert!(first.devices.iter().all(|d| d.health_check_timeout_seconds == TIMEOUT_SECONDS));

        tx.send_replace(vec![
            device("gpu-0", None),
            device("gpu-1", Some("unhealthy: XID 79 (GPU has fallen off the bus)")),
        ]);
        let fault = stream.next().await.unwrap().unwrap();
        assert_eq!(states(&fault)[1].2, Unhealthy);
        assert_eq!(states(&fault)[1].3, "unhealthy: XID 79 (GPU has fallen off the bus)");
        assert_eq!(states(&fault)[0].2, Healthy, "the other device stays healthy, and is still listed");

        tx.send_replace(vec![device("gpu-0", None), device("gpu-1", None)]);
        let back = stream.next().await.unwrap().unwrap();
        assert_eq!(states(&back)[1].2, Healthy);

        // The publisher gone (the daemon stopping): the stream ends.
        drop(tx);
        assert!(stream.next().await.is_none());
    }

    #[tokio::test]
    async fn the_v1alpha1_service_says_the_same_and_unknown_when_nobody_checks() {
        use tessera_proto::dra_health::v1alpha1::dra_resource_health_server::DraResourceHealth as Alpha;
        let (_tx, rx) = watch::channel(vec![device("gpu-0", Some("lost: not answering"))]);
        let mut stream = V1alpha1(HealthService::new("node-a", rx, false))
            .node_watch_resources(Request::new(v1alpha1::NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let r = stream.next().await.unwrap().unwrap();
        assert_eq!(r.devices.len(), 1);
        assert_eq!(r.devices[0].health(), v1alpha1::HealthStatus::Unknown);
        assert!(r.devices[0].message.contains("[health] enabled = false"));
    }

    #[test]
    fn long_reasons_are_cut_as_the_kubelet_would() {
        let long = "é".repeat(1000);
        let r = report("p", &[device("gpu-0", Some(&long))], true, 1);
        assert!(r[0].message.len() <= MAX_MESSAGE && r[0].message.ends_with("..."));
    }
}
