//! The `DevicePlugin` gRPC service for one resource: devices come from a `watch` channel, the
//! decisions (which devices to prefer, what a container gets) from an [`Allocator`].

use std::pin::Pin;
use std::sync::Arc;

use tessera_proto::deviceplugin::v1beta1::{
    self as dp, AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, DeviceSpec, Empty, ListAndWatchResponse, Mount,
    NumaNode, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, TopologyInfo,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::allocator::kubelet::{Allocator, ContainerAllocation};

/// One device as the kubelet sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginDevice {
    /// The device id the kubelet allocates by (unique within the resource).
    pub id: String,
    /// Whether the device may be allocated.
    pub healthy: bool,
    /// The NUMA node the device is attached to, when known.
    pub numa_node: Option<i64>,
}

impl PluginDevice {
    /// A healthy device.
    pub fn healthy(id: impl Into<String>, numa_node: Option<i64>) -> Self {
        Self { id: id.into(), healthy: true, numa_node }
    }

    fn to_proto(&self) -> Device {
        Device {
            id: self.id.clone(),
            health: if self.healthy { dp::HEALTHY } else { dp::UNHEALTHY }.to_owned(),
            topology: self.numa_node.map(|id| TopologyInfo { nodes: vec![NumaNode { id }] }),
        }
    }
}

impl ContainerAllocation {
    fn into_proto(self) -> ContainerAllocateResponse {
        ContainerAllocateResponse {
            envs: self.envs,
            mounts: self
                .mounts
                .into_iter()
                .map(|m| Mount { container_path: m.container_path, host_path: m.host_path, read_only: m.read_only })
                .collect(),
            devices: self
                .device_specs
                .into_iter()
                .map(|d| DeviceSpec {
                    container_path: d.container_path,
                    host_path: d.host_path,
                    permissions: d.permissions,
                })
                .collect(),
            annotations: self.annotations,
            cdi_devices: self.cdi_devices.into_iter().map(|name| CdiDevice { name }).collect(),
        }
    }
}

/// The `DevicePlugin` service of one resource. Cheap to clone; the server clones it per serve.
#[derive(Clone)]
pub struct DevicePlugin {
    resource: String,
    devices: watch::Receiver<Vec<PluginDevice>>,
    allocator: Arc<dyn Allocator>,
    /// Set by the server: ends every `ListAndWatch` stream when this serve stops.
    stop: Option<watch::Receiver<bool>>,
}

impl std::fmt::Debug for DevicePlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePlugin").field("resource", &self.resource).finish_non_exhaustive()
    }
}

impl DevicePlugin {
    /// The plugin for `resource` (for example `tessera.io/gpu`).
    pub fn new(
        resource: impl Into<String>,
        devices: watch::Receiver<Vec<PluginDevice>>,
        allocator: Arc<dyn Allocator>,
    ) -> Self {
        Self { resource: resource.into(), devices, allocator, stop: None }
    }

    /// The resource name served.
    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// The options this plugin registers with and answers `GetDevicePluginOptions` with.
    pub fn options() -> DevicePluginOptions {
        DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }
    }

    /// A copy whose `ListAndWatch` streams end once `stop` turns true (or its sender goes).
    pub(crate) fn with_stop(&self, stop: watch::Receiver<bool>) -> Self {
        Self { stop: Some(stop), ..self.clone() }
    }

    /// Every id must be a known, healthy device of this resource.
    fn check_ids(&self, ids: &[String]) -> Result<(), Status> {
        let devices = self.devices.borrow();
        for id in ids {
            match devices.iter().find(|d| &d.id == id) {
                None => {
                    return Err(Status::invalid_argument(format!(
                        "unknown device id {id:?} for resource {}",
                        self.resource
                    )));
                }
                Some(d) if !d.healthy => {
                    return Err(Status::invalid_argument(format!(
                        "device {id:?} of resource {} is unhealthy",
                        self.resource
                    )));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

/// Each container asks for at least one device, and no device is named twice in one call: the
/// kubelet never does either, and taken as they came, a device named twice was a record holding
/// it twice (its container's limits doubled), one named by two containers was given to both
/// (the first one's record removed as stale by the second), and an empty ask made a record of
/// nothing each time.
fn check_distinct(requests: &[Vec<String>]) -> Result<(), Status> {
    let mut seen = std::collections::HashMap::new();
    for (c, ids) in requests.iter().enumerate() {
        if ids.is_empty() {
            return Err(Status::invalid_argument(format!("container_requests[{c}].devices_ids: empty")));
        }
        for id in ids {
            if let Some(first) = seen.insert(id.as_str(), c) {
                let at = if first == c { "twice".to_owned() } else { format!("also by container_requests[{first}]") };
                return Err(Status::invalid_argument(format!(
                    "container_requests[{c}].devices_ids: device {id:?} is named {at}"
                )));
            }
        }
    }
    Ok(())
}

async fn stopped(stop: Option<watch::Receiver<bool>>) {
    match stop {
        // `wait_for` fails only when the sender is gone: stopped too.
        Some(mut stop) => {
            let _ = stop.wait_for(|s| *s).await;
        }
        None => std::future::pending().await,
    }
}

#[tonic::async_trait]
impl dp::device_plugin_server::DevicePlugin for DevicePlugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(Self::options()))
    }

    type ListAndWatchStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let mut devices = self.devices.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let forward = async {
                let mut sender_alive = true;
                loop {
                    let list = devices.borrow_and_update().iter().map(PluginDevice::to_proto).collect();
                    if tx.send(Ok(ListAndWatchResponse { devices: list })).await.is_err() {
                        return;
                    }
                    if sender_alive && devices.changed().await.is_err() {
                        sender_alive = false;
                    }
                    if !sender_alive {
                        // No more changes can come: hold the stream open until the client goes.
                        tx.closed().await;
                        return;
                    }
                }
            };
            tokio::select! {
                () = forward => {}
                () = tx.closed() => {}
                () = stopped(stop) => {}
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| {
                let size = usize::try_from(c.allocation_size).unwrap_or(0);
                let device_i_ds = self.allocator.preferred(
                    &self.resource,
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    size,
                );
                ContainerPreferredAllocationResponse { device_i_ds }
            })
            .collect();
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, request: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let requests: Vec<Vec<String>> =
            request.into_inner().container_requests.into_iter().map(|c| c.devices_ids).collect();
        for ids in &requests {
            self.check_ids(ids)?;
        }
        check_distinct(&requests)?;
        // A journal flush and a directory made, on this handler's thread (no hop to a pool thread).
        let container_responses = crate::blocking::run(|| {
            requests
                .iter()
                .map(|ids| self.allocator.allocate(&self.resource, ids).map(ContainerAllocation::into_proto))
                .collect::<Result<Vec<_>, Status>>()
        })?;
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(ids: &[&[&str]]) -> Vec<Vec<String>> {
        ids.iter().map(|c| c.iter().map(|s| (*s).to_owned()).collect()).collect()
    }

    #[test]
    fn a_device_named_twice_or_an_empty_ask_is_refused_naming_where() {
        assert!(check_distinct(&ask(&[&["a", "b"], &["c"]])).is_ok());
        let err = check_distinct(&ask(&[&["a", "a"]])).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert_eq!(err.message(), "container_requests[0].devices_ids: device \"a\" is named twice");
        let err = check_distinct(&ask(&[&["a", "b"], &["b"]])).unwrap_err();
        assert_eq!(
            err.message(),
            "container_requests[1].devices_ids: device \"b\" is named also by container_requests[0]"
        );
        let err = check_distinct(&ask(&[&["a"], &[]])).unwrap_err();
        assert_eq!(err.message(), "container_requests[1].devices_ids: empty");
    }
}
