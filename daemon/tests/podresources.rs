//! The built `tesserad` with a fake kubelet pod-resources API (`PodResourcesLister::List` from a
//! list the test changes): an allocation made through the device plugin is named after the pod
//! that lists its device (node API, record on disk, limits file), keeps its name across a restart,
//! is kept while `List` fails, and is released (record and directory) once no pod lists it for the
//! grace period. With no pod-resources socket nothing is named or released, and nothing is logged
//! above debug about it.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_proto::deviceplugin::v1beta1::RegisterRequest;
use tessera_proto::podresources::v1::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};
use tessera_proto::podresources::v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices, ContainerResources,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tessera_sim_testkit::SimNode;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

mod common;

use common::{Daemon, TestKubelet};

const NODE: &str = "numa_nodes = 1
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 1
";

const SHARE: &str = "tessera.io/gpu-share";
/// The grace period the daemon runs with here (seconds).
const GRACE_S: u64 = 2;

/// The kubelet's pod-resources side: `List` answers `pods`, or fails while `fail` is set.
#[derive(Clone, Default)]
struct FakePodResources {
    pods: Arc<Mutex<Vec<PodResources>>>,
    fail: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl PodResourcesLister for FakePodResources {
    async fn list(&self, _: Request<ListPodResourcesRequest>) -> Result<Response<ListPodResourcesResponse>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.fail.load(Ordering::SeqCst) {
            return Err(Status::unavailable("kubelet restarting"));
        }
        Ok(Response::new(ListPodResourcesResponse { pod_resources: self.pods.lock().unwrap().clone() }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn get(&self, _: Request<GetPodResourcesRequest>) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

fn serve_pod_resources(socket: &Path) -> FakePodResources {
    std::fs::create_dir_all(socket.parent().expect("parent")).expect("pod-resources dir");
    let fake = FakePodResources::default();
    let listener = UnixListener::bind(socket).expect("bind pod-resources socket");
    let service = PodResourcesListerServer::new(fake.clone());
    tokio::spawn(async move {
        Server::builder()
            .add_service(service)
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await
            .expect("pod-resources serves");
    });
    fake
}

fn pod(namespace: &str, name: &str, container: &str, device: &str) -> PodResources {
    PodResources {
        name: name.into(),
        namespace: namespace.into(),
        containers: vec![ContainerResources {
            name: container.into(),
            devices: vec![ContainerDevices {
                resource_name: SHARE.into(),
                device_ids: vec![device.into()],
                topology: None,
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

struct Setup {
    node: SimNode,
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    config: PathBuf,
    log: PathBuf,
    /// Where `/metrics` answers.
    metrics: std::net::SocketAddr,
    _notify: UnixDatagram,
}

impl Setup {
    fn new(pod_resources_socket: &str) -> Setup {
        let node = SimNode::with_description(NODE);
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().to_owned();
        std::fs::create_dir(dir.join("plugins")).expect("plugin dir");
        let config = dir.join("config.toml");
        let metrics = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr");
        let text = format!(
            "nvml_library = {:?}\ndevice_plugin_dir = {:?}\nstate_dir = {:?}\nruntime_dir = {:?}\n\
             pod_resources_socket = {:?}\n[telemetry]\nmetrics_listen = \"{metrics}\"\n\
             [partitions.\"0\"]\nshares = {{ count = 2 }}\n",
            node.nvml_path(),
            dir.join("plugins"),
            dir.join("state"),
            dir.join("run"),
            pod_resources_socket.replace("<tmp>", &dir.display().to_string()),
        );
        std::fs::write(&config, text).expect("config");
        let notify = UnixDatagram::bind(dir.join("notify.sock")).expect("notify socket");
        let log = dir.join("tesserad.log");
        Setup { node, _tmp: tmp, dir, config, log, metrics, _notify: notify }
    }

    /// `tesserad` as `common::spawn` starts it, with a short grace period and debug logs of the
    /// pod-resources task.
    fn spawn(&self) -> Daemon {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("log");
        common::unmount_at_exit(&self.dir);
        let child = self
            .node
            .command(tessera_sim_testkit::binary("tesserad"))
            .arg("--config")
            .arg(&self.config)
            .env("NOTIFY_SOCKET", self.dir.join("notify.sock"))
            .env("TESSERA_POD_RESOURCES_GRACE_SECONDS", GRACE_S.to_string())
            .env("RUST_LOG", "info,tessera_daemon::podresources=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn tesserad");
        Daemon(child)
    }

    /// The `DCGM_FI_DEV_FB_USED` line of the GPU `uuid` in `/metrics`.
    fn fb_used_line(&self, uuid: &str) -> String {
        let (code, body) = common::prometheus::get(self.metrics, "/metrics").expect("/metrics answers");
        assert_eq!(code, 200, "{body}");
        let line =
            body.lines().find(|l| l.starts_with("DCGM_FI_DEV_FB_USED{") && l.contains(&format!("UUID=\"{uuid}\"")));
        line.unwrap_or_else(|| panic!("no DCGM_FI_DEV_FB_USED for {uuid}:\n{body}")).to_string()
    }

    fn show_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn client(&self) -> NodeClient<Channel> {
        let socket = self.dir.join("run/tessera.sock");
        let endpoint = tonic::transport::Endpoint::from_shared(format!("unix://{}", socket.display())).expect("uri");
        for _ in 0..400 {
            if let Ok(c) = endpoint.connect().await {
                return NodeClient::new(c);
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("node API not reachable:\n{}", self.show_log());
    }

    /// tesserad with the test kubelet, and share 0 allocated through it: the daemon, the kubelet,
    /// the node API, the share's id and the allocation's.
    async fn with_share_allocated(&self) -> (Daemon, TestKubelet, NodeClient<Channel>, String, String) {
        let mut kubelet = TestKubelet::start(&self.dir.join("plugins"));
        let daemon = self.spawn();
        let reg = share_registration(&mut kubelet).await;
        let mut api = self.client().await;
        let share = share_id(&mut api).await;
        let id = allocate(&kubelet, &reg, &share).await;
        (daemon, kubelet, api, share, id)
    }
}

async fn share_registration(kubelet: &mut TestKubelet) -> RegisterRequest {
    loop {
        let (req, _) = kubelet.next_registration().await;
        if req.resource_name == SHARE {
            return req;
        }
    }
}

/// Allocates share `device` through the kubelet; returns the allocation id.
async fn allocate(kubelet: &TestKubelet, reg: &RegisterRequest, device: &str) -> String {
    let mut plugin = kubelet.connect(reg).await;
    common::allocate(&mut plugin, &[device]).await.envs["TESSERA_ALLOCATION"].clone()
}

async fn allocations(api: &mut NodeClient<Channel>) -> Vec<api::Allocation> {
    api.list_allocations(api::ListAllocationsRequest::default())
        .await
        .expect("list allocations")
        .into_inner()
        .allocations
}

async fn share_id(api: &mut NodeClient<Channel>) -> String {
    let devices = api.list_devices(api::ListDevicesRequest::default()).await.expect("list").into_inner().devices;
    devices.iter().find(|d| d.kind == api::DeviceKind::Share as i32 && d.index == 0).expect("share 0").id.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_resources_name_and_release_allocations() {
    let s = Setup::new("<tmp>/pod-resources/kubelet.sock");
    let fake = serve_pod_resources(&s.dir.join("pod-resources/kubelet.sock"));
    let (daemon, _kubelet, mut api, share, id) = s.with_share_allocated().await;
    let gpu = {
        let devices = api.list_devices(api::ListDevicesRequest::default()).await.expect("list").into_inner().devices;
        devices.iter().find(|d| d.id == share).expect("share").uuid.clone()
    };
    // Held by one container whose pod is not known yet: the GPU's series name no pod.
    let line = s.fb_used_line(&gpu);
    assert!(!line.contains("pod=") && !line.contains("namespace="), "{line}");

    // The kubelet creates the container and lists its device: the allocation gets its name.
    fake.pods.lock().unwrap().push(pod("team-a", "trainer", "main", &share));
    let deadline = Instant::now() + Duration::from_secs(6);
    let named = loop {
        let list = allocations(&mut api).await;
        let c = list.iter().find(|a| a.id == id).and_then(|a| a.container.clone()).unwrap_or_default();
        if !c.pod_name.is_empty() {
            break c;
        }
        assert!(Instant::now() < deadline, "not named in time: {list:?}\n{}", s.show_log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((named.pod_namespace.as_str(), named.pod_name.as_str()), ("team-a", "trainer"));
    assert_eq!(named.container_name, "main");
    // The GPU only this container holds carries its pod, as dcgm-exporter's kubelet mapping does.
    let line = s.fb_used_line(&gpu);
    for label in ["container=\"main\"", "namespace=\"team-a\"", "pod=\"trainer\""] {
        assert!(line.contains(label), "{label} in {line}");
    }
    // The holder of the share says so too.
    let devices = api.list_devices(api::ListDevicesRequest::default()).await.expect("list").into_inner().devices;
    let holder = &devices.iter().find(|d| d.id == share).expect("share").holders[0];
    assert_eq!(holder.container.as_ref().expect("holder container").pod_name, "trainer");
    // Durable: the record and the limits file the shim reads.
    let records = tessera_daemon::state::store::read_records(&s.dir.join("state")).expect("records");
    let record = records.iter().find(|a| a.id == id).expect("record");
    assert_eq!(record.container.pod_name.as_deref(), Some("trainer"), "{record:?}");
    assert_eq!(record.container.pod_namespace.as_deref(), Some("team-a"), "{record:?}");
    let alloc_dir = s.dir.join("run/alloc").join(&id);
    let limits = tessera_region::Limits::load(&alloc_dir.join("limits")).expect("limits");
    assert_eq!(limits.container.as_deref(), Some("team-a/trainer/main"));

    // The kubelet restarts (List fails) and so does the daemon: the name is kept from disk, and
    // nothing is released while List fails, even past the grace period.
    fake.fail.store(true, Ordering::SeqCst);
    drop(daemon);
    fake.pods.lock().unwrap().clear();
    let daemon = s.spawn();
    let mut api = s.client().await;
    let list = allocations(&mut api).await;
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0].container.as_ref().expect("container").pod_name, "trainer", "kept across a restart");
    let calls = fake.calls.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(GRACE_S * 2 + 1)).await;
    assert!(fake.calls.load(Ordering::SeqCst) > calls, "the daemon keeps asking");
    assert_eq!(allocations(&mut api).await.len(), 1, "kept while List fails:\n{}", s.show_log());
    assert!(alloc_dir.exists());

    // The kubelet answers again, without the pod: released after the grace period.
    fake.fail.store(false, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(GRACE_S + 6);
    while !allocations(&mut api).await.is_empty() {
        assert!(Instant::now() < deadline, "not released in time:\n{}", s.show_log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!alloc_dir.exists(), "the directory goes with the record");
    let records = tessera_daemon::state::store::read_records(&s.dir.join("state")).expect("records");
    assert!(!records.iter().any(|a| a.id == id), "{records:?}");
    assert!(s.show_log().contains("allocation released"), "{}", s.show_log());
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_pod_resources_socket_changes_nothing() {
    let s = Setup::new("<tmp>/pod-resources/kubelet.sock");
    let (daemon, _kubelet, mut api, _, id) = s.with_share_allocated().await;
    tokio::time::sleep(Duration::from_secs(GRACE_S * 2 + 2)).await;
    let list = allocations(&mut api).await;
    assert_eq!(list.len(), 1, "never released without pod resources: {list:?}");
    assert_eq!(list[0].id, id);
    assert!(list[0].container.as_ref().is_none_or(|c| c.pod_name.is_empty()), "{list:?}");
    assert!(s.dir.join("run/alloc").join(&id).exists());
    drop(daemon);
    let log = s.show_log();
    assert!(log.contains("no pod-resources socket"), "a debug line says why: {log}");
    let noisy = log.lines().filter(|l| l.contains("pod") && (l.contains("WARN") || l.contains("ERROR")));
    assert_eq!(noisy.count(), 0, "{log}");
}
