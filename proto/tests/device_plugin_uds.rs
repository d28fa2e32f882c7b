//! A trivial Registration server and DevicePlugin server on Unix sockets in a temporary
//! directory, driven through the generated clients: every value must come back as sent.

use std::collections::HashMap;
use std::path::Path;
use std::pin::Pin;
use std::time::Duration;

use tessera_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use tessera_proto::deviceplugin::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use tessera_proto::deviceplugin::v1beta1::registration_client::RegistrationClient;
use tessera_proto::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
use tessera_proto::deviceplugin::v1beta1::{
    self as dp, AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, ContainerPreferredAllocationResponse, Device, DevicePluginOptions, DeviceSpec,
    Empty, ListAndWatchResponse, Mount, NumaNode, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest, TopologyInfo,
};
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};

const RESOURCE: &str = "tessera.io/gpu";

/// The kubelet's side: records every registration it is sent.
struct TestRegistration {
    seen: mpsc::UnboundedSender<RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for TestRegistration {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = request.into_inner();
        if req.version != dp::VERSION {
            return Err(Status::invalid_argument(format!("unsupported version {}", req.version)));
        }
        self.seen.send(req).map_err(|_| Status::internal("test gone"))?;
        Ok(Response::new(Empty {}))
    }
}

fn device(id: &str, health: &str, numa: i64) -> Device {
    Device { id: id.into(), health: health.into(), topology: Some(TopologyInfo { nodes: vec![NumaNode { id: numa }] }) }
}

/// Two GPUs; the second update marks GPU 1 unhealthy.
fn updates() -> [ListAndWatchResponse; 2] {
    [
        ListAndWatchResponse { devices: vec![device("GPU-0", dp::HEALTHY, 0), device("GPU-1", dp::HEALTHY, 1)] },
        ListAndWatchResponse { devices: vec![device("GPU-0", dp::HEALTHY, 0), device("GPU-1", dp::UNHEALTHY, 1)] },
    ]
}

fn container_response(ids: &[String]) -> ContainerAllocateResponse {
    ContainerAllocateResponse {
        envs: HashMap::from([
            ("NVIDIA_VISIBLE_DEVICES".to_owned(), "void".to_owned()),
            ("TESSERA_ALLOCATION".to_owned(), ids.join(",")),
        ]),
        mounts: vec![
            Mount { container_path: "/run/tessera".into(), host_path: "/run/tessera/alloc/a1".into(), read_only: true },
            Mount { container_path: "/opt/tessera/lib".into(), host_path: "/usr/lib/tessera".into(), read_only: false },
        ],
        devices: vec![DeviceSpec {
            container_path: "/dev/nvidia0".into(),
            host_path: "/dev/nvidia0".into(),
            permissions: "rw".into(),
        }],
        annotations: HashMap::from([("tessera.io/allocation".to_owned(), "a1".to_owned())]),
        cdi_devices: ids.iter().map(|id| CdiDevice { name: format!("tessera.io/gpu={id}") }).collect(),
    }
}

struct TestPlugin;

#[tonic::async_trait]
impl DevicePlugin for TestPlugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions { pre_start_required: true, get_preferred_allocation_available: true }))
    }

    type ListAndWatchStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            for update in updates() {
                if tx.send(Ok(update)).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // A real plugin keeps the stream open; hold it until the client goes away.
            tx.closed().await;
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
                // The must-include devices first, then the highest-numbered available ones.
                let mut ids = c.must_include_device_i_ds.clone();
                let mut rest: Vec<String> =
                    c.available_device_i_ds.into_iter().filter(|id| !ids.contains(id)).collect();
                rest.sort_unstable_by(|a, b| b.cmp(a));
                let size = usize::try_from(c.allocation_size).unwrap_or(0);
                ids.extend(rest.into_iter().take(size.saturating_sub(ids.len())));
                ContainerPreferredAllocationResponse { device_i_ds: ids }
            })
            .collect();
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, request: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let container_responses =
            request.into_inner().container_requests.iter().map(|c| container_response(&c.devices_ids)).collect();
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        if request.into_inner().devices_ids.is_empty() {
            return Err(Status::invalid_argument("no devices"));
        }
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

async fn connect(path: &Path) -> Channel {
    let endpoint = Endpoint::from_shared(format!("unix://{}", path.display())).expect("unix endpoint");
    // The server task may not be accepting yet: retry briefly.
    for _ in 0..100 {
        if let Ok(channel) = endpoint.connect().await {
            return channel;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("could not connect to {}", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_then_serve_the_kubelet_over_unix_sockets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kubelet_sock = dir.path().join(dp::KUBELET_SOCKET_NAME);
    let plugin_endpoint = "tessera-gpu.sock";
    let plugin_sock = dir.path().join(plugin_endpoint);

    // The kubelet's Registration server.
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel();
    let kubelet_listener = UnixListener::bind(&kubelet_sock).expect("bind kubelet socket");
    let kubelet = tokio::spawn(
        Server::builder()
            .add_service(RegistrationServer::new(TestRegistration { seen: seen_tx }))
            .serve_with_incoming(UnixListenerStream::new(kubelet_listener)),
    );

    // The plugin's DevicePlugin server.
    let plugin_listener = UnixListener::bind(&plugin_sock).expect("bind plugin socket");
    let plugin = tokio::spawn(
        Server::builder()
            .add_service(DevicePluginServer::new(TestPlugin))
            .serve_with_incoming(UnixListenerStream::new(plugin_listener)),
    );

    // Register, as the plugin does.
    let options = DevicePluginOptions { pre_start_required: true, get_preferred_allocation_available: true };
    let mut registration = RegistrationClient::new(connect(&kubelet_sock).await);
    let sent = RegisterRequest {
        version: dp::VERSION.into(),
        endpoint: plugin_endpoint.into(),
        resource_name: RESOURCE.into(),
        options: Some(options),
    };
    registration.register(sent.clone()).await.expect("register");
    assert_eq!(seen_rx.recv().await.expect("registration seen"), sent);
    let wrong = RegisterRequest { version: "v1alpha".into(), ..sent.clone() };
    let status = registration.register(wrong).await.expect_err("wrong version refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    // Then the kubelet's side against the plugin.
    let mut client = DevicePluginClient::new(connect(&plugin_sock).await);
    let got = client.get_device_plugin_options(Empty {}).await.expect("options").into_inner();
    assert_eq!(got, options);

    let mut stream = client.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
    for want in updates() {
        let got = tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("update in time")
            .expect("stream ok")
            .expect("stream open");
        assert_eq!(got, want);
    }
    let second_gpu = &updates()[1].devices[1];
    assert_eq!(second_gpu.health, "Unhealthy");
    assert_eq!(second_gpu.topology.as_ref().map(|t| t.nodes[0].id), Some(1));
    drop(stream);

    let preferred = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["GPU-0".into(), "GPU-1".into(), "GPU-2".into(), "GPU-3".into()],
                must_include_device_i_ds: vec!["GPU-0".into()],
                allocation_size: 2,
            }],
        })
        .await
        .expect("preferred allocation")
        .into_inner();
    assert_eq!(
        preferred.container_responses,
        vec![ContainerPreferredAllocationResponse { device_i_ds: vec!["GPU-0".into(), "GPU-3".into()] }]
    );

    let request = AllocateRequest {
        container_requests: vec![
            ContainerAllocateRequest { devices_ids: vec!["GPU-0".into(), "GPU-1".into()] },
            ContainerAllocateRequest { devices_ids: vec!["GPU-2".into()] },
        ],
    };
    let allocated = client.allocate(request.clone()).await.expect("allocate").into_inner();
    assert_eq!(allocated.container_responses.len(), 2);
    for (got, asked) in allocated.container_responses.iter().zip(&request.container_requests) {
        assert_eq!(got, &container_response(&asked.devices_ids));
    }
    let first = &allocated.container_responses[0];
    assert_eq!(
        first.cdi_devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
        ["tessera.io/gpu=GPU-0", "tessera.io/gpu=GPU-1"]
    );
    assert_eq!(first.envs["TESSERA_ALLOCATION"], "GPU-0,GPU-1");
    assert_eq!(first.annotations["tessera.io/allocation"], "a1");
    assert!(first.mounts[0].read_only && !first.mounts[1].read_only);
    assert_eq!(first.devices[0].permissions, "rw");

    client
        .pre_start_container(PreStartContainerRequest { devices_ids: vec!["GPU-0".into()] })
        .await
        .expect("pre-start");
    let status = client
        .pre_start_container(PreStartContainerRequest { devices_ids: vec![] })
        .await
        .expect_err("pre-start without devices refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    kubelet.abort();
    plugin.abort();
}
