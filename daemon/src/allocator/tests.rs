use super::kubelet::{Allocator, ContainerAllocation};
use super::*;
use crate::carve;
use crate::resources::{Kind, Resource, ResourceDevice};
use crate::state::{AllocatedDevice, Lease, Source};

const SHARE: &str = "tessera.io/gpu-share";

pub(crate) fn resources() -> Arc<Resources> {
    let mut r = Resources::default();
    let devices = ["GPU-a", "GPU-b"]
        .iter()
        .enumerate()
        .flat_map(|(g, uuid)| {
            (0..2).map(move |n| ResourceDevice {
                id: format!("{uuid}::{n}"),
                physical_uuid: (*uuid).to_string(),
                gpu_index: g as u32,
                numa_node: Some(0),
                health: crate::device_health::Health::Healthy,
                memory_limit: Some(1 << 30),
                sm_percent: Some(50),
                nodes: vec![std::path::PathBuf::from(format!("/dev/nvidia{g}"))],
            })
        })
        .collect();
    r.resources.insert(SHARE.into(), Resource { name: SHARE.into(), kind: Kind::Share, devices });
    Arc::new(r)
}

pub(crate) fn allocator(dir: &std::path::Path, placement: Placement) -> DaemonAllocator {
    let mut config = Config::default();
    config.resources.share_placement = placement;
    std::fs::create_dir_all(dir.join("run")).unwrap();
    let store = Store::open(&dir.join("state")).unwrap();
    DaemonAllocator::new(&config, resources(), store, AllocDirs::new(&dir.join("run")))
}

fn ids(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// After a journal loss, a record whose directory is gone while others' remain is kept and
/// said (its release may have been in what was lost); its directory is made again.
#[test]
fn a_record_back_without_its_directory_after_a_loss_is_kept_and_said() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    let x = a.allocate_share(&share(1, 10, "0"), &rooms()).unwrap();
    let y = a.allocate_share(&share(1, 10, "0"), &rooms()).unwrap();
    drop(a);
    let dirs = AllocDirs::new(&tmp.path().join("run"));
    dirs.remove(&y.id).unwrap();
    // The journal's end cut off: a loss (nothing of x or y is lost: both were put before).
    let journal = tmp.path().join("state/allocations.journal");
    let len = std::fs::metadata(&journal).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&journal).unwrap().set_len(len - 1).unwrap();
    let store = Store::open_with_dirs(&tmp.path().join("state"), &dirs).unwrap();
    assert!(store.loss().is_some());
    let a = DaemonAllocator::new(&Config::default(), resources(), store, dirs.clone());
    let (kept, log) = crate::testlog::logged(|| a.reconcile());
    assert_eq!(kept, 2);
    assert!(log.contains(&format!("allocation {} is in its records but its directory was gone", y.id)), "{log}");
    assert!(!log.contains(&format!("allocation {} is", x.id)), "{log}");
    assert!(dirs.limits_path(&y.id).exists(), "kept, its directory made again");
}

/// The offer's index finds each device as a scan of the resource does (the first of an id),
/// nothing for an unknown id or one of another resource, and follows a new offer.
#[test]
fn the_offer_finds_devices_as_a_scan_does_and_follows_a_new_offer() {
    let mut r = (*resources()).clone();
    let res = r.resources.get_mut(SHARE).unwrap();
    let mut twin = res.devices[1].clone();
    twin.sm_percent = Some(7);
    res.devices.push(twin);
    let offer = Offer::of(Arc::new(r));
    let res = &offer.resources.resources[SHARE];
    for d in &res.devices {
        assert_eq!(offer.device(res, &d.id), res.device(&d.id), "{}", d.id);
    }
    assert_eq!(offer.device(res, "GPU-a::1").unwrap().sm_percent, Some(50), "the first of an id");
    assert!(offer.device(res, "GPU-c::0").is_none());
    let other = Resource { name: "other".into(), kind: Kind::Share, devices: Vec::new() };
    assert!(offer.device(&other, "GPU-a::0").is_none());

    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    let e = a.allocate(SHARE, &ids(&["GPU-c::0"])).unwrap_err();
    assert!(e.message().contains("unknown device id \"GPU-c::0\""), "{e:?}");
    let mut more = (*resources()).clone();
    let mut c = more.resources[SHARE].devices[0].clone();
    c.id = "GPU-c::0".into();
    more.resources.get_mut(SHARE).unwrap().devices.push(c);
    a.set_resources(Arc::new(more));
    a.allocate(SHARE, &ids(&["GPU-c::0"])).unwrap();
}

/// A device allocated again to another container replaces the record that held it (found
/// through the store's index of holders), and the same devices again reuse the record.
#[test]
fn a_device_allocated_again_replaces_its_stale_record_and_the_same_ask_reuses() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    let first = a.allocate(SHARE, &ids(&["GPU-a::0", "GPU-b::0"])).unwrap();
    let again = a.allocate(SHARE, &ids(&["GPU-b::0", "GPU-a::0"])).unwrap();
    let id = |c: &ContainerAllocation| c.envs["TESSERA_ALLOCATION"].clone();
    assert_eq!(id(&first), id(&again), "the same record");
    let other = a.allocate(SHARE, &ids(&["GPU-b::1"])).unwrap();
    let store = a.store.lock().unwrap();
    assert_eq!(store.list().count(), 2);
    drop(store);
    // GPU-a::0 to a new container: the record holding it (with GPU-b::0) goes.
    let replaced = a.allocate(SHARE, &ids(&["GPU-a::0"])).unwrap();
    let store = a.store.lock().unwrap();
    let held: Vec<Vec<&str>> = store.list().map(|r| r.devices.iter().map(|d| d.device_id.as_str()).collect()).collect();
    assert_eq!(held.len(), 2, "{held:?}");
    assert!(held.contains(&vec!["GPU-a::0"]) && held.contains(&vec!["GPU-b::1"]), "{held:?}");
    assert_ne!(id(&replaced), id(&first));
    assert_eq!(store.holding(["GPU-b::0"]).count(), 0);
    drop(store);
    drop(other);
}

#[test]
fn shares_are_packed_or_spread() {
    let tmp = crate::state::mount::TestDir::new();
    let all = ids(&["GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-b::1"]);
    let packed = allocator(tmp.path(), Placement::Packed);
    packed.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap();
    let free = ids(&["GPU-a::0", "GPU-a::1", "GPU-b::1"]);
    assert_eq!(packed.preferred(SHARE, &free, &[], 1), ["GPU-b::1"]);
    drop(packed);
    let tmp = crate::state::mount::TestDir::new();
    let spread = allocator(tmp.path(), Placement::Spread);
    assert_eq!(spread.preferred(SHARE, &all, &ids(&["GPU-a::0"]), 2), ["GPU-a::0", "GPU-b::0"]);
    // A must-include id repeated is named once.
    assert_eq!(spread.preferred(SHARE, &all, &ids(&["GPU-a::0", "GPU-a::0"]), 2), ["GPU-a::0", "GPU-b::0"]);
}

#[test]
fn without_cdi_the_answer_carries_nodes_and_the_shim() {
    let tmp = crate::state::mount::TestDir::new();
    let dev = tmp.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(dev.join("nvidiactl"), "").unwrap();
    let mut config = Config::default();
    config.injection.cdi_spec_dir = std::path::PathBuf::new();
    config.injection.dev_root = dev.clone();
    config.injection.shim_path = "/opt/tessera/libtessera.so".into();
    config.runtime_dir = tmp.path().join("run");
    std::fs::create_dir_all(&config.runtime_dir).unwrap();
    let mut res = (*resources()).clone();
    for d in res.resources.values_mut().flat_map(|r| &mut r.devices) {
        d.nodes = vec![dev.join(format!("nvidia{}", d.gpu_index))];
    }
    let store = Store::open(&tmp.path().join("state")).unwrap();
    let a = DaemonAllocator::new(&config, Arc::new(res), store, AllocDirs::new(&config.runtime_dir));
    let answer = a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap();
    assert!(answer.cdi_devices.is_empty(), "no CDI names for a runtime without CDI");
    let specs: Vec<(String, &str, &str)> = answer
        .device_specs
        .iter()
        .map(|d| (d.host_path.clone(), d.container_path.as_str(), d.permissions.as_str()))
        .collect();
    let host = |n: &str| dev.join(n).display().to_string();
    assert_eq!(specs, [(host("nvidiactl"), "/dev/nvidiactl", "rw"), (host("nvidia1"), "/dev/nvidia1", "rw")]);
    let mounts: Vec<(&str, &str, bool)> =
        answer.mounts.iter().map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only)).collect();
    let preload = config.runtime_dir.join("ld.so.preload");
    // The allocation directory read-only, its region read-write on top.
    let dir = a.dirs.dir(&answer.envs["TESSERA_ALLOCATION"]);
    assert_eq!(
        mounts[..2],
        [
            (dir.to_str().unwrap(), "/run/tessera/alloc", true),
            (dir.join("region").to_str().unwrap(), "/run/tessera/alloc/region", false),
        ]
    );
    assert_eq!(
        mounts[2..],
        [
            ("/opt/tessera/libtessera.so", "/usr/lib/tessera/libtessera.so", true),
            (preload.to_str().unwrap(), "/etc/ld.so.preload", true),
        ]
    );
    assert_eq!(std::fs::read_to_string(&preload).unwrap(), "/usr/lib/tessera/libtessera.so\n");
    // With CDI (the default), the names alone.
    let b = allocator(&tmp.path().join("cdi"), Placement::Packed);
    let answer = b.allocate(SHARE, &ids(&["GPU-a::0"])).unwrap();
    assert_eq!(answer.cdi_devices, ["tessera.io/share=GPU-a::0"]);
    assert!(answer.device_specs.is_empty());
}

#[test]
fn allocate_records_reuses_and_drops_stale() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    let first = a.allocate(SHARE, &ids(&["GPU-a::0", "GPU-a::1"])).unwrap();
    let id = first.envs["TESSERA_ALLOCATION"].clone();
    let limits = tessera_region::Limits::load(&tmp.path().join("run/alloc").join(&id).join("limits")).unwrap();
    assert_eq!(limits.devices[0].memory_limit, Some(2 << 30), "two shares of one GPU add up");
    assert_eq!(limits.devices[0].sm_percent, Some(100));
    assert_eq!(first.envs["TESSERA_VISIBLE_DEVICES"], "GPU-a::0,GPU-a::1");
    assert_eq!(first.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
    // Same set, any order: the same record.
    let again = a.allocate(SHARE, &ids(&["GPU-a::1", "GPU-a::0"])).unwrap();
    assert_eq!(again.envs["TESSERA_ALLOCATION"], id);
    assert_eq!(a.allocations().len(), 1);
    // A request overlapping it: the old record is stale and goes with its directory.
    let other = a.allocate(SHARE, &ids(&["GPU-a::1"])).unwrap();
    assert_ne!(other.envs["TESSERA_ALLOCATION"], id);
    assert_eq!(a.allocations().len(), 1);
    assert!(!tmp.path().join("run/alloc").join(&id).exists());
    assert!(a.allocate(SHARE, &ids(&["GPU-z::0"])).is_err());
}

pub(crate) fn rooms() -> Vec<GpuRoom> {
    ["GPU-a", "GPU-b"]
        .iter()
        .enumerate()
        .map(|(i, uuid)| GpuRoom {
            index: i as u32,
            uuid: (*uuid).into(),
            model: "NVIDIA H100".into(),
            memory_total: 4 << 30,
            unavailable: None,
            mig_mode: false,
            mig: Vec::new(),
            mig_profiles: Vec::new(),
            nodes: Vec::new(),
        })
        .collect()
}

pub(crate) fn share(gib: u64, sm: u32, gpu: &str) -> ShareRequest {
    ShareRequest {
        device: DeviceAsk::Share,
        memory: gib << 30,
        sm_percent: sm,
        priority: None,
        compute_mode: Some(ComputeMode::Strict),
        gpu: gpu.into(),
        owner: Some("fn-a".into()),
        lease: Lease::None,
        preemptible: false,
    }
}

/// The kubelet's fixed shares and the node API's carved ones come out of the same room.
#[test]
fn carved_shares_count_the_kubelets_and_never_overcommit() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    // The kubelet holds two 1 GiB, 50% shares of GPU-a: 2 GiB and 100% SM.
    a.allocate(SHARE, &ids(&["GPU-a::0", "GPU-a::1"])).unwrap();
    let err = a.allocate_share(&share(1, 10, "0"), &rooms()).unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(err.message().contains("GPU 0 (GPU-a): 2 GiB of 4 GiB free, 0% SM free"), "{}", err.message());
    // Packed: GPU-b is the only one with SM left; filled to its memory, then refused.
    let first = a.allocate_share(&share(3, 60, ""), &rooms()).unwrap();
    assert_eq!(first.devices[0].physical_uuid, "GPU-b");
    assert_eq!(first.source, Source::NodeApi);
    assert_eq!(first.claim.as_ref().unwrap().owner.as_deref(), Some("fn-a"));
    let err = a.allocate_share(&share(2, 10, ""), &rooms()).unwrap_err();
    assert!(err.message().contains("GPU 1 (GPU-b): 1 GiB of 4 GiB free, 40% SM free"), "{}", err.message());
    let second = a.allocate_share(&share(1, 40, ""), &rooms()).unwrap();
    assert_eq!(second.devices[0].physical_uuid, "GPU-b");
    // The record is durable and its limits file says what was asked.
    let limits = tessera_region::Limits::load(&a.dirs.limits_path(&second.id)).unwrap();
    assert_eq!((limits.devices[0].memory_limit, limits.devices[0].sm_percent), (Some(1 << 30), Some(40)));
    // Bad requests name the field.
    assert!(a.allocate_share(&share(0, 10, ""), &rooms()).unwrap_err().message().starts_with("memory_bytes"));
    assert!(a.allocate_share(&share(1, 101, ""), &rooms()).unwrap_err().message().starts_with("sm_percent"));
    let err = a.allocate_share(&share(1, 1, "GPU-zz"), &rooms()).unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    // The other way round: the kubelet's share of GPU-b does not fit beside the carved ones
    // (4 GiB of 4 GiB held), and is refused naming them.
    a.set_rooms(rooms());
    let err = a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(err.message().contains(&first.id) && err.message().contains("4 GiB"), "{}", err.message());
    // Once the larger one is released it fits (1 GiB + 40% held, 1 GiB + 50% asked), and the
    // kubelet's stale-record rule leaves the carved share beside it alone.
    a.release(&first.id).unwrap();
    a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap();
    assert!(a.allocations().iter().any(|r| r.id == second.id));
}

/// GPU 2, an A100 in MIG mode with a 3g.20gb device of each UUID in `slots`.
fn mig_room(slots: &[&str]) -> GpuRoom {
    let slot = |uuid: &&str| carve::MigSlot {
        uuid: (*uuid).into(),
        profile: "3g.20gb".into(),
        memory_total: 20 << 30,
        unavailable: None,
    };
    GpuRoom {
        index: 2,
        uuid: "GPU-m".into(),
        model: "NVIDIA A100".into(),
        memory_total: 40 << 30,
        unavailable: None,
        mig_mode: true,
        mig: slots.iter().map(slot).collect(),
        mig_profiles: vec!["3g.20gb".into(), "7g.40gb".into()],
        nodes: Vec::new(),
    }
}

/// Whole GPUs are exclusive both ways; a MIG device goes to one allocation at a time.
#[test]
fn whole_gpus_and_mig_devices_through_allocate() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    let mut gpus = rooms();
    gpus.push(mig_room(&["MIG-m0"]));
    let ask =
        |device: DeviceAsk| ShareRequest { device, memory: 0, sm_percent: 0, compute_mode: None, ..share(0, 0, "") };
    let share_a = a.allocate_share(&share(1, 10, "0"), &gpus).unwrap();
    // GPU-a has a share: the one whole GPU is GPU-b; a second is refused naming the share.
    let whole = a.allocate_share(&ask(DeviceAsk::Whole(1)), &gpus).unwrap();
    assert_eq!((whole.resource.as_str(), whole.devices[0].physical_uuid.as_str()), (WHOLE_RESOURCE, "GPU-b"));
    assert_eq!((whole.devices[0].memory_limit, whole.devices[0].sm_percent), (None, None));
    let err = a.allocate_share(&ask(DeviceAsk::Whole(1)), &gpus).unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(err.message().contains(&format!("GPU 0 (GPU-a): held by {}", share_a.id)), "{}", err.message());
    assert!(err.message().contains("GPU 2 (GPU-m): MIG mode is on"), "{}", err.message());
    // Nothing is carved from the GPU held whole.
    let err = a.allocate_share(&share(1, 1, "1"), &gpus).unwrap_err();
    assert!(err.message().contains("0 MiB of 4 GiB free, 0% SM free"), "{}", err.message());
    // Its limits lowered, it is still held whole: they bind its container, and nothing is
    // carved beside it (it was: the record read as a 1 GiB / 10% share). Never above the GPU.
    let lower = LimitChange { memory: Some(1 << 30), sm_percent: Some(10), ..Default::default() };
    let lowered = a.set_limits(&whole.id, lower, &gpus).unwrap();
    assert!(lowered.devices[0].whole && lowered.devices[0].is_whole());
    let err = a.allocate_share(&share(1, 1, "1"), &gpus).unwrap_err();
    assert!(err.message().contains("0 MiB of 4 GiB free, 0% SM free"), "{}", err.message());
    let err = a.set_limits(&whole.id, LimitChange { memory: Some(5 << 30), ..Default::default() }, &gpus);
    assert_eq!(err.unwrap_err().code(), tonic::Code::InvalidArgument);
    // The MIG device, once; its limits file names it.
    let mig = a.allocate_share(&ask(DeviceAsk::Mig("3g.20gb".into())), &gpus).unwrap();
    assert_eq!((mig.resource.as_str(), mig.devices[0].device_id.as_str()), (MIG_RESOURCE, "MIG-m0"));
    let limits = tessera_region::Limits::load(&a.dirs.limits_path(&mig.id)).unwrap();
    assert_eq!(limits.devices[0].uuid, "MIG-m0");
    let err = a.allocate_share(&ask(DeviceAsk::Mig("3g.20gb".into())), &gpus).unwrap_err();
    assert!(err.message().contains(&format!("MIG-m0 held by {}", mig.id)), "{}", err.message());
    // A MIG device's limit: lowered, never above the device (10 TiB on 20 GiB was taken).
    let err = a.set_limits(&mig.id, LimitChange { memory: Some(10 << 40), ..Default::default() }, &gpus);
    let err = err.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("more than device MIG-m0's 20 GiB"), "{}", err.message());
    let lowered = a.set_limits(&mig.id, LimitChange { memory: Some(8 << 30), ..Default::default() }, &gpus);
    assert!(lowered.unwrap().devices[0].whole);
    let err = a.allocate_share(&ask(DeviceAsk::Mig("7g.80gb".into())), &gpus).unwrap_err();
    assert!(err.message().contains("GPU 2 (GPU-m): no 7g.80gb instance"), "{}", err.message());
    // Bad requests name the field.
    let err = a.allocate_share(&ShareRequest { memory: 1 << 30, ..ask(DeviceAsk::Whole(1)) }, &gpus).unwrap_err();
    assert!(err.message().starts_with("memory_bytes, sm_percent"), "{}", err.message());
    assert!(a.allocate_share(&ask(DeviceAsk::Whole(0)), &gpus).unwrap_err().message().starts_with("whole_gpus"));
    // Parking frees memory, not a device: only a share is preemptible.
    for device in [DeviceAsk::Whole(1), DeviceAsk::Mig("3g.20gb".into())] {
        let err = a.allocate_share(&ShareRequest { preemptible: true, ..ask(device) }, &gpus).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().starts_with("preemptible: only for shares"), "{}", err.message());
    }
    // Released, the GPU can be carved again and given whole to the next.
    a.release(&whole.id).unwrap();
    a.release(&mig.id).unwrap();
    assert_eq!(a.allocate_share(&ask(DeviceAsk::Mig("3g.20gb".into())), &gpus).unwrap().devices[0].device_id, "MIG-m0");
    assert_eq!(a.allocate_share(&share(4, 100, "1"), &gpus).unwrap().devices[0].physical_uuid, "GPU-b");
}

/// The kubelet's free devices that would be refused beside the node API's carved shares are
/// withdrawn (from the allocator's holdings, as the offer publishes them), exactly those and as
/// few as can be: what the kubelet's `Allocate` refuses; a pod's own device never is; released,
/// they come back. Every change of what the records hold is told, the kubelet's too (they move
/// which free devices fit); naming a container is not.
#[test]
fn free_kubelet_devices_that_no_longer_fit_are_withdrawn_until_the_room_is_back() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    a.set_rooms(rooms());
    let share_mode = ComputeMode::from_name(&Config::default().limits.compute_mode).unwrap_or_default();
    let memory_of =
        |uuid: &str| rooms().into_iter().find(|g| g.uuid.eq_ignore_ascii_case(uuid)).map(|g| g.memory_total);
    let withdrawn = || a.holdings().withdrawn_from_kubelet(&a.resources(), memory_of, share_mode);
    let mut told = a.holdings_changes();
    let pair = |id: &str| (SHARE.to_string(), id.to_string());
    assert!(withdrawn().is_empty());
    // The kubelet's own allocations fit together by plan: nothing withdrawn, but told.
    a.allocate(SHARE, &ids(&["GPU-a::0"])).unwrap();
    assert!(withdrawn().is_empty());
    assert!(told.has_changed().unwrap());
    told.mark_unchanged();
    // Naming the pod's container changes nothing held: not told.
    let id = a.allocations()[0].id.clone();
    let named = ContainerIdentity { pod_name: Some("p".into()), ..Default::default() };
    assert!(a.set_container(&id, named).unwrap());
    assert!(!told.has_changed().unwrap());

    // 1 GiB and 10% carved from GPU-a: beside the pod's share (50%) the other (50%) no longer
    // fits; the pod's own stays.
    let carved = a.allocate_share(&share(1, 10, "0"), &rooms()).unwrap();
    assert!(told.has_changed().unwrap());
    told.mark_unchanged();
    assert_eq!(withdrawn(), BTreeSet::from([pair("GPU-a::1")]));
    // 3 GiB and 1% from GPU-b: one of its two 1 GiB shares still fits, the second does not.
    let big = a.allocate_share(&share(3, 1, "1"), &rooms()).unwrap();
    assert_eq!(withdrawn(), BTreeSet::from([pair("GPU-a::1"), pair("GPU-b::1")]));
    // The kept ones can all be allocated; then the withdrawn one would be refused.
    a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap();
    assert_eq!(withdrawn(), BTreeSet::from([pair("GPU-a::1"), pair("GPU-b::1")]));
    assert_eq!(a.allocate(SHARE, &ids(&["GPU-b::1"])).unwrap_err().code(), tonic::Code::ResourceExhausted);
    assert_eq!(a.allocate(SHARE, &ids(&["GPU-a::1"])).unwrap_err().code(), tonic::Code::ResourceExhausted);

    // Released, the room is back.
    told.mark_unchanged();
    a.release(&carved.id).unwrap();
    assert!(told.has_changed().unwrap());
    assert_eq!(withdrawn(), BTreeSet::from([pair("GPU-b::1")]));
    a.release(&big.id).unwrap();
    assert!(withdrawn().is_empty());
}

/// A MIG device the node API holds is not handed to the kubelet too, nor a share of it, and
/// the other way round; released, it goes to whoever asks next.
#[test]
fn a_mig_device_goes_to_the_node_api_or_the_kubelet_never_both() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    let mut gpus = rooms();
    gpus.push(mig_room(&["MIG-m0", "MIG-m1"]));
    a.set_rooms(gpus.clone());
    // The kubelet is offered MIG-m0 whole, and MIG-m1 as two shares.
    let device = |id: &str, uuid: &str, memory: Option<u64>, sm: Option<u32>| ResourceDevice {
        id: id.into(),
        physical_uuid: uuid.into(),
        gpu_index: 2,
        numa_node: None,
        health: crate::device_health::Health::Healthy,
        memory_limit: memory,
        sm_percent: sm,
        nodes: Vec::new(),
    };
    let (mig, mig_share) = ("tessera.io/mig-3g.20gb", "tessera.io/mig-3g.20gb-share");
    let mut offer = (*resources()).clone();
    offer.resources.insert(
        mig.into(),
        Resource { name: mig.into(), kind: Kind::Mig, devices: vec![device("MIG-m0", "MIG-m0", None, None)] },
    );
    let halves = ["MIG-m1::0", "MIG-m1::1"].map(|id| device(id, "MIG-m1", Some(10 << 30), Some(50)));
    offer
        .resources
        .insert(mig_share.into(), Resource { name: mig_share.into(), kind: Kind::Share, devices: halves.to_vec() });
    a.set_resources(Arc::new(offer));
    let ask = ShareRequest {
        device: DeviceAsk::Mig("3g.20gb".into()),
        memory: 0,
        sm_percent: 0,
        compute_mode: None,
        ..share(0, 0, "")
    };

    // The node API takes MIG-m0 first: the kubelet's Allocate of it is refused, naming it.
    let carved = a.allocate_share(&ask, &gpus).unwrap();
    assert_eq!(carved.devices[0].physical_uuid, "MIG-m0");
    let err = a.allocate(mig, &ids(&["MIG-m0"])).unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(
        err.message().starts_with("MIG device MIG-m0 (GPU 2): 20 GiB and 100% strict SM are held"),
        "{}",
        err.message()
    );
    assert!(err.message().contains(&carved.id), "{}", err.message());
    // The kubelet holds a share of MIG-m1: the node API's next MIG device is not MIG-m1.
    a.allocate(mig_share, &ids(&["MIG-m1::0"])).unwrap();
    let err = a.allocate_share(&ask, &gpus).unwrap_err();
    assert!(err.message().contains("MIG-m1 held by"), "{}", err.message());
    // The other share of MIG-m1 fits beside the first.
    a.allocate(mig_share, &ids(&["MIG-m1::1"])).unwrap();
    // Released by the node API, MIG-m0 goes to the kubelet; then not back to the node API.
    a.release(&carved.id).unwrap();
    a.allocate(mig, &ids(&["MIG-m0"])).unwrap();
    let err = a.allocate_share(&ask, &gpus).unwrap_err();
    assert!(err.message().contains("MIG-m0 held by"), "{}", err.message());
    assert_eq!(a.allocations().len(), 3);
}

/// Eight threads carve, change and release shares of two GPUs at once, until both are full:
/// no GPU is ever over-admitted (memory or strict SM), the store's per-GPU sums stay what its
/// records add up to, and after a restart admission still sees every record.
#[test]
fn concurrent_allocates_never_over_admit_a_gpu() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Spread);
    let gpus = rooms();
    let check = |a: &DaemonAllocator| {
        let store = a.store.lock().unwrap();
        assert_eq!(store.loads(), &crate::state::load::Loads::of(store.list()), "sums out of step with the records");
        for g in &gpus {
            let h = carve::held(g, store.list(), None);
            assert!(h.memory <= g.memory_total && h.strict_sm <= 100, "{} over-admitted: {h:?}", g.uuid);
        }
    };
    std::thread::scope(|scope| {
        for t in 0..8u64 {
            let (a, gpus) = (&a, &gpus);
            scope.spawn(move || {
                let mut mine = Vec::new();
                let mut refused = 0;
                for i in 0..60u64 {
                    let req = ShareRequest {
                        memory: [256 << 20, 512 << 20, 1 << 30][((t + i) % 3) as usize],
                        sm_percent: [10, 15, 30][((t * 7 + i) % 3) as usize],
                        compute_mode: Some(if i % 4 == 0 { ComputeMode::WorkConserving } else { ComputeMode::Strict }),
                        ..share(1, 10, "")
                    };
                    match a.allocate_share(&req, gpus) {
                        Ok(alloc) => mine.push(alloc.id),
                        Err(e) => {
                            assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{}", e.message());
                            refused += 1;
                        }
                    }
                    if i % 5 == 4 && !mine.is_empty() {
                        assert!(a.release(&mine.remove(0)).unwrap());
                    }
                    if i % 7 == 6
                        && let Some(id) = mine.last()
                    {
                        let grow = LimitChange { memory: Some(768 << 20), sm_percent: Some(20), priority: None };
                        if let Err(e) = a.set_limits(id, grow, gpus) {
                            assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{}", e.message());
                        }
                    }
                }
                assert!(refused > 0, "thread {t}: the GPUs never filled up, so nothing was tested");
            });
        }
    });
    check(&a);
    let held: Vec<carve::Held> = {
        let store = a.store.lock().unwrap();
        gpus.iter().map(|g| carve::held(g, store.list(), None)).collect()
    };
    // After a restart the sums come from the journal's records alone.
    drop(a);
    let a = allocator(tmp.path(), Placement::Spread);
    check(&a);
    let store = a.store.lock().unwrap();
    for (g, before) in gpus.iter().zip(&held) {
        assert_eq!(carve::held_in(g, store.loads(), None), *before, "{} after a restart", g.uuid);
    }
    drop(store);
    // Full GPUs stay full: a share bigger than what is left anywhere is refused.
    let free = gpus.iter().zip(&held).map(|(g, h)| g.memory_total - h.memory).max().unwrap();
    let too_big = ShareRequest { memory: free + 1, sm_percent: 1, ..share(1, 1, "") };
    assert_eq!(a.allocate_share(&too_big, &gpus).unwrap_err().code(), tonic::Code::ResourceExhausted);
}

#[test]
fn release_is_idempotent_and_takes_the_directory() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    let x = a.allocate_share(&share(1, 10, ""), &rooms()).unwrap();
    assert!(a.dirs.dir(&x.id).is_dir());
    assert!(a.release(&x.id).unwrap());
    assert!(!a.dirs.dir(&x.id).exists());
    assert!(a.allocations().is_empty());
    assert!(!a.release(&x.id).unwrap(), "a second release succeeds, saying it was gone");
    assert_eq!(a.release("../etc").unwrap_err().code(), tonic::Code::InvalidArgument);
    // The room is back.
    a.allocate_share(&share(4, 100, "0"), &rooms()).unwrap();
}

#[test]
fn set_limits_rewrites_the_record_and_the_file_within_the_room() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    let x = a.allocate_share(&share(1, 30, "0"), &rooms()).unwrap();
    let y = a.allocate_share(&share(2, 50, "0"), &rooms()).unwrap();
    let region = tessera_region::Region::open_or_create(&a.dirs.region_path(&x.id)).unwrap();
    let g0 = region.config_generation();
    let change = LimitChange { memory: Some(2 << 30), sm_percent: Some(50), priority: Some(Priority::High) };
    let got = a.set_limits(&x.id, change, &rooms()).unwrap();
    assert_eq!(got.devices[0].memory_limit, Some(2 << 30));
    assert_eq!(a.allocations().iter().find(|r| r.id == x.id).unwrap(), &got, "the record changed");
    let limits = tessera_region::Limits::load(&a.dirs.limits_path(&x.id)).unwrap();
    assert_eq!((limits.devices[0].memory_limit, limits.devices[0].sm_percent), (Some(2 << 30), Some(50)));
    assert_eq!(limits.priority, Priority::High);
    assert_eq!(region.config_generation(), g0 + 1, "running shims are told");
    // Past the room (y holds 2 GiB and 50%): refused, nothing changed.
    let err = a.set_limits(&x.id, LimitChange { memory: Some(3 << 30), ..Default::default() }, &rooms());
    let err = err.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(err.message().contains("has 2 GiB of 4 GiB and 50% strict SM left"), "{}", err.message());
    let err = a.set_limits(&y.id, LimitChange { sm_percent: Some(51), ..Default::default() }, &rooms());
    assert_eq!(err.unwrap_err().code(), tonic::Code::ResourceExhausted);
    assert_eq!(region.config_generation(), g0 + 1);
    assert_eq!(a.set_limits("nope", change, &rooms()).unwrap_err().code(), tonic::Code::NotFound);
    // Lowering below what is in use is allowed (the shim refuses new allocations past it).
    a.set_limits(&x.id, LimitChange { memory: Some(1 << 20), ..Default::default() }, &rooms()).unwrap();
    // The limits file cannot be written (a directory in its place): refused, and the record
    // stays as the file says (it kept the new terms, which the daemon then enforced alone).
    let before = a.allocations().into_iter().find(|r| r.id == x.id).unwrap();
    let limits = a.dirs.limits_path(&x.id);
    std::fs::remove_file(&limits).unwrap();
    std::fs::create_dir_all(limits.join("x")).unwrap();
    let err = a.set_limits(&x.id, LimitChange { memory: Some(2 << 20), ..Default::default() }, &rooms());
    assert_eq!(err.unwrap_err().code(), tonic::Code::Internal);
    assert_eq!(a.allocations().into_iter().find(|r| r.id == x.id).unwrap(), before);
}

fn claim(uid: &str, pods: &[(&str, &str)]) -> ClaimOwner {
    ClaimOwner {
        claim: crate::dra::ClaimRef { namespace: "ml".into(), uid: uid.into(), name: format!("claim-{uid}") },
        pods: pods.iter().map(|(n, u)| ((*n).to_owned(), (*u).to_owned())).collect(),
    }
}

fn on(gpu: &str, memory: Option<u64>, sm: Option<u32>) -> AllocatedDevice {
    AllocatedDevice {
        device_id: gpu.into(),
        physical_uuid: gpu.into(),
        memory_limit: memory,
        sm_percent: sm,
        priority: Priority::Normal,
        compute_mode: ComputeMode::Strict,
        whole: false,
        preemptible: false,
    }
}

#[test]
fn a_claim_owns_one_record_with_its_consumed_capacity() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    a.set_rooms(rooms());
    let first = a.allocate_claim(&claim("uid-1", &[("p", "pod-1")]), vec![on("GPU-a", Some(1 << 30), Some(30))]);
    let first = first.unwrap();
    assert_eq!((first.resource.as_str(), first.source), (DRA_RESOURCE, Source::NodeApi));
    assert_eq!(first.claim.as_ref().unwrap().owner.as_deref(), Some("uid-1"));
    assert_eq!(first.container.pod_namespace.as_deref(), Some("ml"));
    assert_eq!((first.container.pod_name.as_deref(), first.container.pod_uid.as_deref()), (Some("p"), Some("pod-1")));
    let limits = tessera_region::Limits::load(&a.dirs.limits_path(&first.id)).unwrap();
    assert_eq!((limits.devices[0].memory_limit, limits.devices[0].sm_percent), (Some(1 << 30), Some(30)));
    // Prepared again (other devices even: a hostile retry): the same record, nothing added.
    let again = a.allocate_claim(&claim("uid-1", &[]), vec![on("GPU-a", Some(3 << 30), Some(70))]).unwrap();
    assert_eq!(again, first);
    assert_eq!(a.allocations().len(), 1);
    // A directory lost (a reboot cleared the runtime dir) comes back on the next prepare.
    a.dirs.remove(&first.id).unwrap();
    a.allocate_claim(&claim("uid-1", &[]), Vec::new()).unwrap();
    assert!(a.dirs.limits_path(&first.id).exists());
    assert!(a.release_claim("uid-1").unwrap());
    assert!(!a.dirs.dir(&first.id).exists());
    assert!(!a.release_claim("uid-1").unwrap(), "a second unprepare succeeds, saying it was gone");
    assert!(a.allocations().is_empty());
}

#[test]
fn claims_are_admitted_beside_every_other_record_and_survive_a_restart() {
    let tmp = crate::state::mount::TestDir::new();
    let a = allocator(tmp.path(), Placement::Packed);
    a.set_rooms(rooms());
    // A carved share holds 2 GiB and 50% of GPU-a (4 GiB).
    a.allocate_share(&share(2, 50, "0"), &rooms()).unwrap();
    let err = a.allocate_claim(&claim("big", &[]), vec![on("GPU-a", Some(3 << 30), Some(10))]).unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(err.message().contains("GPU 0 (GPU-a) has 2 GiB of 4 GiB and 50% strict SM left"), "{}", err.message());
    let err = a.allocate_claim(&claim("busy", &[]), vec![on("GPU-a", Some(1 << 30), Some(51))]).unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    // A whole GPU asks all of it: refused where anything is held, granted where nothing is.
    assert!(a.allocate_claim(&claim("whole-a", &[]), vec![on("GPU-a", None, None)]).is_err());
    let whole = a.allocate_claim(&claim("whole-b", &[]), vec![on("GPU-b", None, None)]).unwrap();
    // The kubelet's share of GPU-b no longer fits either: one store, one rule.
    assert_eq!(a.allocate(SHARE, &ids(&["GPU-b::0"])).unwrap_err().code(), tonic::Code::ResourceExhausted);
    let fits = a.allocate_claim(&claim("fits", &[]), vec![on("GPU-a", Some(2 << 30), Some(50))]).unwrap();
    // Refused claims left nothing behind.
    assert_eq!(a.allocations().len(), 3);
    assert!(a.allocate_claim(&claim("", &[]), vec![on("GPU-a", None, None)]).is_err());
    // A new process over the same state: the claims' records are found, not made again.
    drop(a);
    let b = allocator(tmp.path(), Placement::Packed);
    b.set_rooms(rooms());
    assert_eq!(b.allocate_claim(&claim("fits", &[]), Vec::new()).unwrap(), fits);
    assert_eq!(b.allocate_claim(&claim("whole-b", &[]), Vec::new()).unwrap(), whole);
    assert_eq!(b.allocations().len(), 3);
    // Through the trait the DRA driver uses.
    let dra: &dyn ClaimAllocations = &b;
    assert!(dra.release_claim("fits").unwrap());
    assert!(!dra.release_claim("fits").unwrap());
    assert!(
        dra.allocate_claim(&claim("x", &[]), vec![on("GPU-a", Some(3 << 30), Some(40))]).unwrap_err().contains("left")
    );
}
