//! The kubelet device-plugin servers against a test kubelet of our own: a Registration server on
//! `kubelet.sock` in a temporary directory that records registrations, then drives the plugin's
//! DevicePlugin side as the kubelet does. Covers register, list and watch, prefer, allocate,
//! refusals, a kubelet restart (re-registration measured) and two resources from one set.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;

use tessera_daemon::kubelet::{
    Allocator, ContainerAllocation, DevicePlugin, HostDevice, HostMount, PluginDevice, PluginSet, REFUSED_FAST_FOR,
    socket_name,
};
use tessera_proto::deviceplugin::v1beta1::{
    self as dp, AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreStartContainerRequest, PreferredAllocationRequest,
};
use tokio::sync::watch;
use tonic::Status;

mod common;

use common::{BoundKubelet, TestKubelet, WAIT, next_list};

const GPU: &str = "tessera.io/gpu";
const SHARE: &str = "tessera.io/gpu-share";

/// Prefers must-include ids, then the highest-numbered; answers with CDI names, env and mounts.
struct FakeAllocator;

impl Allocator for FakeAllocator {
    fn allocate(&self, resource: &str, device_ids: &[String]) -> Result<ContainerAllocation, Status> {
        Ok(ContainerAllocation {
            cdi_devices: device_ids.iter().map(|id| format!("{resource}={id}")).collect(),
            envs: HashMap::from([("TESSERA_DEVICES".to_owned(), device_ids.join(","))]),
            mounts: vec![HostMount {
                host_path: "/run/tessera/alloc/a1".into(),
                container_path: "/run/tessera".into(),
                read_only: true,
            }],
            device_specs: vec![HostDevice {
                host_path: "/dev/nvidia0".into(),
                container_path: "/dev/nvidia0".into(),
                permissions: "rw".into(),
            }],
            annotations: HashMap::from([("tessera.io/allocation".to_owned(), "a1".to_owned())]),
        })
    }

    fn preferred(&self, _: &str, available: &[String], must_include: &[String], size: usize) -> Vec<String> {
        let mut ids = must_include.to_vec();
        let mut rest: Vec<String> = available.iter().filter(|id| !ids.contains(id)).cloned().collect();
        rest.sort_unstable_by(|a, b| b.cmp(a));
        ids.extend(rest.into_iter().take(size.saturating_sub(ids.len())));
        ids
    }
}

fn gpus(n: usize) -> Vec<PluginDevice> {
    (0..n).map(|i| PluginDevice::healthy(format!("GPU-{i}"), Some(i64::try_from(i % 2).expect("small")))).collect()
}

fn plugin(resource: &str, devices: watch::Receiver<Vec<PluginDevice>>) -> DevicePlugin {
    DevicePlugin::new(resource, devices, Arc::new(FakeAllocator))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_list_prefer_allocate_then_survive_a_kubelet_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut kubelet = TestKubelet::start(dir.path());
    let (devices_tx, devices_rx) = watch::channel(gpus(4));
    let set = PluginSet::start(dir.path(), vec![plugin(GPU, devices_rx)]).expect("start plugins");

    // Registration.
    let (req, _) = kubelet.next_registration().await;
    assert_eq!(req.version, dp::VERSION);
    assert_eq!(req.resource_name, GPU);
    assert_eq!(req.endpoint, socket_name(GPU));
    assert_eq!(req.options, Some(DevicePlugin::options()));
    let socket = dir.path().join(&req.endpoint);
    let mode = std::fs::metadata(&socket).expect("plugin socket").permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "plugin socket is owner-only");

    let mut client = kubelet.connect(&req).await;
    let options = client.get_device_plugin_options(Empty {}).await.expect("options").into_inner();
    assert!(options.get_preferred_allocation_available);
    assert!(!options.pre_start_required);

    // ListAndWatch: the list at once, then every change.
    let mut stream = client.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
    let first = next_list(&mut stream).await;
    assert_eq!(first.devices.len(), 4);
    assert!(first.devices.iter().all(|d| d.health == dp::HEALTHY));
    assert_eq!(first.devices[1].topology.as_ref().map(|t| t.nodes[0].id), Some(1));
    devices_tx.send_modify(|d| d[1].healthy = false);
    let second = next_list(&mut stream).await;
    assert_eq!(second.devices[1].id, "GPU-1");
    assert_eq!(second.devices[1].health, dp::UNHEALTHY);
    assert_eq!(second.devices[0].health, dp::HEALTHY);

    // GetPreferredAllocation: through the allocator, per container.
    let preferred = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["GPU-0".into(), "GPU-2".into(), "GPU-3".into()],
                must_include_device_i_ds: vec!["GPU-0".into()],
                allocation_size: 2,
            }],
        })
        .await
        .expect("preferred")
        .into_inner();
    assert_eq!(preferred.container_responses[0].device_i_ds, ["GPU-0", "GPU-3"]);

    // Allocate: what the allocator answers arrives, per container.
    let allocated = client
        .allocate(AllocateRequest {
            container_requests: vec![
                ContainerAllocateRequest { devices_ids: vec!["GPU-0".into(), "GPU-3".into()] },
                ContainerAllocateRequest { devices_ids: vec!["GPU-2".into()] },
            ],
        })
        .await
        .expect("allocate")
        .into_inner();
    assert_eq!(allocated.container_responses.len(), 2);
    let c0 = &allocated.container_responses[0];
    assert_eq!(
        c0.cdi_devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
        ["tessera.io/gpu=GPU-0", "tessera.io/gpu=GPU-3"]
    );
    assert_eq!(c0.envs["TESSERA_DEVICES"], "GPU-0,GPU-3");
    assert_eq!(c0.mounts[0].host_path, "/run/tessera/alloc/a1");
    assert!(c0.mounts[0].read_only);
    assert_eq!(c0.devices[0].permissions, "rw");
    assert_eq!(c0.annotations["tessera.io/allocation"], "a1");
    assert_eq!(allocated.container_responses[1].envs["TESSERA_DEVICES"], "GPU-2");

    // Unknown and unhealthy ids are refused, named.
    for (bad, why) in [("GPU-9", "unknown"), ("GPU-1", "unhealthy")] {
        let status = client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest { devices_ids: vec!["GPU-0".into(), bad.into()] }],
            })
            .await
            .expect_err("bad id refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains(bad) && status.message().contains(why), "{}", status.message());
    }
    client
        .pre_start_container(PreStartContainerRequest { devices_ids: vec!["GPU-0".into()] })
        .await
        .expect("pre-start");
    drop(stream);
    drop(client);

    // Kubelet restart: it goes, its socket and ours are removed, it comes back.
    kubelet.stop().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut kubelet = TestKubelet::start(dir.path());
    let (req, at) = kubelet.next_registration().await;
    let took = at.duration_since(kubelet.started);
    println!("re-registered {took:?} after the kubelet restarted (sockets removed)");
    assert_eq!(req.resource_name, GPU);
    let mut client = kubelet.connect(&req).await;
    let mut stream = client.list_and_watch(Empty {}).await.expect("list and watch again").into_inner();
    assert_eq!(next_list(&mut stream).await.devices[1].health, dp::UNHEALTHY);
    drop(stream);

    // Kubelet socket recreated alone (our socket left in place): noticed too.
    kubelet.server.abort();
    std::fs::remove_file(dir.path().join(dp::KUBELET_SOCKET_NAME)).expect("remove kubelet.sock");
    let mut kubelet = TestKubelet::start(dir.path());
    let (_, at) = kubelet.next_registration().await;
    let took = at.duration_since(kubelet.started);
    println!("re-registered {took:?} after kubelet.sock was recreated");
    // The count moves once the kubelet's answer is back.
    let mut count = set.registrations(GPU).expect("resource served");
    tokio::time::timeout(WAIT, count.wait_for(|n| *n >= 3)).await.expect("counted in time").expect("set running");

    set.stop().await.expect("stop plugins");
    assert!(!socket.exists(), "plugin socket removed on stop");
}

/// CPU time this process has used (user and system).
fn process_cpu() -> Duration {
    // SAFETY: a zeroed rusage is a valid out-struct for getrusage.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF and a valid out-pointer.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) }, 0);
    let t = |v: libc::timeval| Duration::new(v.tv_sec as u64, v.tv_usec as u32 * 1000);
    t(r.ru_utime) + t(r.ru_stime)
}

/// A kubelet binds its socket before it listens, and no file event marks the listen: the plugin,
/// refused meanwhile, retries every millisecond while the socket is new, so it registers as soon
/// as the kubelet listens (issue 15 item 4), not after a backed-off wait. `--nocapture` prints how
/// long after the listen each registration came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_that_binds_before_it_listens_is_registered_with_once_it_listens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bound = BoundKubelet::bind(dir.path());
    let (_devices_tx, devices_rx) = watch::channel(gpus(2));
    let set = PluginSet::start(dir.path(), vec![plugin(GPU, devices_rx)]).expect("start plugins");
    let mut registrations = set.registrations(GPU).expect("resource served");
    // Refused for a while (the plugin keeps trying), then the kubelet listens.
    let cpu = process_cpu();
    tokio::time::sleep(Duration::from_millis(150)).await;
    println!("the retries took {:?} of CPU over 150 ms (this whole test process)", process_cpu() - cpu);
    assert_eq!(*registrations.borrow_and_update(), 0, "nothing registers while the kubelet refuses");
    let mut kubelet = bound.listen();
    let (req, at) = kubelet.next_registration().await;
    assert_eq!(req.resource_name, GPU);
    println!("registered {:?} after the kubelet listened (bound 150 ms before)", at.duration_since(kubelet.started));
    // And again for a kubelet that restarts the same way, this time long after the plugin began
    // waiting on a socket that stayed unanswered past the fast retries.
    kubelet.stop().await;
    let bound = BoundKubelet::bind(dir.path());
    tokio::time::sleep(REFUSED_FAST_FOR + Duration::from_millis(250)).await;
    let mut kubelet = bound.listen();
    let (_, at) = kubelet.next_registration().await;
    println!(
        "registered {:?} after the kubelet listened (bound {:?} before)",
        at.duration_since(kubelet.started),
        REFUSED_FAST_FOR + Duration::from_millis(250)
    );
    set.stop().await.expect("stop plugins");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_set_registers_two_resources() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut kubelet = TestKubelet::start(dir.path());
    let (_gpu_tx, gpu_rx) = watch::channel(gpus(2));
    let (_share_tx, share_rx) = watch::channel(vec![
        PluginDevice::healthy("GPU-0::0", Some(0)),
        PluginDevice::healthy("GPU-0::1", Some(0)),
        PluginDevice::healthy("GPU-0::2", Some(0)),
    ]);
    let set = PluginSet::start(dir.path(), vec![plugin(GPU, gpu_rx), plugin(SHARE, share_rx)]).expect("start");
    assert_eq!(set.resources().collect::<Vec<_>>(), [GPU, SHARE]);
    tokio::time::timeout(WAIT, set.wait_registered()).await.expect("all registered");

    let mut seen = HashMap::new();
    for _ in 0..2 {
        let (req, _) = kubelet.next_registration().await;
        seen.insert(req.resource_name.clone(), req);
    }
    assert_eq!(seen[GPU].endpoint, "tessera.io_gpu.sock");
    assert_eq!(seen[SHARE].endpoint, "tessera.io_gpu-share.sock");
    for (resource, want) in [(GPU, 2), (SHARE, 3)] {
        let mut client = kubelet.connect(&seen[resource]).await;
        let mut stream = client.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
        assert_eq!(next_list(&mut stream).await.devices.len(), want, "{resource}");
        let allocated = common::allocate(&mut client, &[if resource == GPU { "GPU-1" } else { "GPU-0::2" }]).await;
        assert!(allocated.cdi_devices[0].name.starts_with(resource));
    }

    // A resource served twice is refused up front.
    let (_tx, rx) = watch::channel(gpus(1));
    let err = PluginSet::start(dir.path(), vec![plugin(GPU, rx.clone()), plugin(GPU, rx)]).expect_err("duplicate");
    assert!(err.to_string().contains(GPU));

    set.stop().await.expect("stop");
    assert!(!dir.path().join("tessera.io_gpu.sock").exists());
    assert!(!dir.path().join("tessera.io_gpu-share.sock").exists());
}
