use std::collections::BTreeSet;

use super::*;
use crate::dra::dynamic_mig::tests::{h100, publish};

/// Eight H100s with MIG on and one whole GPU: every placement of every GPU.
fn node() -> Vec<DraDevice> {
    let mut inv = h100(Vec::new());
    let one = inv.gpus[0].clone();
    for i in 1..8 {
        let mut g = one.clone();
        g.index = i;
        g.uuid = format!("GPU-{i}");
        inv.gpus.push(g);
    }
    let mut whole = one.clone();
    whole.index = 8;
    whole.uuid = "GPU-8".into();
    whole.mig = None;
    inv.gpus.push(whole);
    publish(&inv, &BTreeSet::new())
}

fn counters_in(s: &ResourceSlice) -> usize {
    s.spec.shared_counters.iter().flatten().map(|c| c.counters.len()).sum()
}

fn consumed_in(s: &ResourceSlice) -> usize {
    s.spec.devices.iter().flatten().flat_map(|d| d.consumes_counters.iter().flatten()).map(|c| c.counters.len()).sum()
}

/// Every counter a device consumes exists, with room, in a set `visible` lists.
fn check_consumption(devices: &[Device], visible: &[CounterSet]) {
    for d in devices {
        for c in d.consumes_counters.iter().flatten() {
            let set = visible.iter().find(|s| s.name == c.counter_set);
            let set = set.unwrap_or_else(|| panic!("{} consumes set {} it cannot see", d.name, c.counter_set));
            for (name, v) in &c.counters {
                let have = set.counters.get(name).unwrap_or_else(|| panic!("{}: no counter {name}", d.name));
                let (have, want) = (parse_quantity_or_panic(&have.value.0), parse_quantity_or_panic(&v.value.0));
                assert!(want <= have, "{}: {name} {want} > {have}", d.name);
            }
        }
    }
}

fn parse_quantity_or_panic(s: &str) -> u64 {
    crate::dra::devices::parse_quantity(s).unwrap_or_else(|| panic!("quantity {s}"))
}

#[test]
fn up_to_1_34_each_gpus_counters_share_a_slice_with_its_placements_within_the_limits() {
    let pool = build_pool("node-a", &node(), 4, SliceLayout::Combined);
    let names: Vec<&str> = pool.iter().map(|s| s.metadata.name.as_deref().unwrap()).collect();
    assert_eq!(names.len(), 10, "{names:?}");
    assert_eq!(names[0], "node-a-gpu.tessera.io");
    assert_eq!(names[1], "node-a-gpu.tessera.io-gpu-0");
    for s in &pool {
        assert_eq!((s.spec.pool.generation, s.spec.pool.resource_slice_count), (4, 10));
        let devices = s.spec.devices.as_deref().unwrap_or_default();
        // 1.34's limits: 128 devices, 32 counters in all sets, 1024 consumed counters a slice.
        assert!(devices.len() <= 128 && counters_in(s) <= 32 && consumed_in(s) <= 1024);
        // A device consumes only counters of its own slice.
        check_consumption(devices, s.spec.shared_counters.as_deref().unwrap_or_default());
    }
    let first = &pool[0];
    assert!(first.spec.shared_counters.is_none());
    let plain: Vec<&str> = first.spec.devices.iter().flatten().map(|d| d.name.as_str()).collect();
    assert_eq!(plain, ["gpu-8"]);
    // The shared device alone in its slice: kube-scheduler 1.34 checks a request's capacity
    // against the slice's device at the request's device index (0), not the one it allocates.
    let shared = pool.iter().find(|s| s.metadata.name.as_deref() == Some("node-a-gpu.tessera.io-shared-8")).unwrap();
    let only: Vec<&str> = shared.spec.devices.iter().flatten().map(|d| d.name.as_str()).collect();
    assert_eq!(only, ["gpu-8-shared"]);
    assert!(shared.spec.shared_counters.is_none());
    let gpu0 = &pool[1];
    assert_eq!(gpu0.spec.shared_counters.as_ref().unwrap()[0].name, "gpu-0-counter-set");
    assert_eq!(gpu0.spec.devices.as_ref().unwrap().len(), 18);
}

#[test]
fn from_1_35_a_slice_holds_devices_or_counters_never_both_within_the_limits() {
    let pool = build_pool("node-a", &node(), 0, SliceLayout::Separate);
    let all_sets: Vec<CounterSet> =
        pool.iter().flat_map(|s| s.spec.shared_counters.clone().unwrap_or_default()).collect();
    assert_eq!(all_sets.len(), 8);
    let names: BTreeSet<&str> = all_sets.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), 8, "counter set names are unique in the pool");
    let mut counter_slices = 0;
    for s in &pool {
        let devices = s.spec.devices.as_deref().unwrap_or_default();
        let sets = s.spec.shared_counters.as_deref().unwrap_or_default();
        assert!(devices.is_empty() || sets.is_empty(), "{:?} holds both", s.metadata.name);
        if !sets.is_empty() {
            counter_slices += 1;
            assert!(s.spec.devices.is_none(), "a counter slice sets no devices field at all");
            assert!(sets.len() <= MAX_COUNTER_SETS && sets.iter().all(|c| c.counters.len() <= 32));
        }
        // 1.37's limits: 64 devices where any consumes counters; at most 2 consumptions a device.
        assert!(devices.len() <= 64);
        assert!(devices.iter().all(|d| d.consumes_counters.as_ref().is_none_or(|c| c.len() <= 2)));
        check_consumption(devices, &all_sets);
        assert_eq!(s.spec.pool.resource_slice_count, i64::try_from(pool.len()).unwrap());
    }
    assert_eq!(counter_slices, 1);
    assert_eq!(pool.last().unwrap().metadata.name.as_deref(), Some("node-a-gpu.tessera.io-counters-0"));
    // Nine GPUs' sets take two counter slices.
    let mut more = node();
    let extra: Vec<DraDevice> = more
        .iter()
        .filter(|d| d.gpu_index == 0)
        .cloned()
        .map(|mut d| {
            d.gpu_index = 9;
            d.name = d.name.replacen("gpu-0", "gpu-9", 1);
            if let DraKind::MigPlacement(p) = &mut d.kind {
                p.counters.name = "gpu-9-counter-set".into();
            }
            d
        })
        .collect();
    more.extend(extra);
    let pool = build_pool("node-a", &more, 0, SliceLayout::Separate);
    let counter_slices: Vec<usize> =
        pool.iter().filter_map(|s| s.spec.shared_counters.as_ref()).map(Vec::len).collect();
    assert_eq!(counter_slices, [8, 1]);
}

#[test]
fn a_placement_consumes_its_memory_sms_and_memory_slices() {
    let d = node().into_iter().find(|d| d.name == "gpu-0-mig-3g40gb-4").unwrap();
    let dev = device(&d);
    let attrs = dev.attributes.as_ref().unwrap();
    assert_eq!(attrs["type"].string.as_deref(), Some("mig-placement"));
    assert_eq!(attrs["migProfile"].string.as_deref(), Some("3g.40gb"));
    assert_eq!(attrs["parentUUID"].string.as_deref(), Some("GPU-0"));
    assert_eq!((attrs["placementStart"].int, attrs["placementSize"].int), (Some(4), Some(4)));
    assert!(!attrs.contains_key("uuid"), "no UUID before it exists");
    let c = &dev.consumes_counters.as_ref().unwrap()[0];
    assert_eq!(c.counter_set, "gpu-0-counter-set");
    let consumed: Vec<(&str, &str)> = c.counters.iter().map(|(k, v)| (k.as_str(), v.value.0.as_str())).collect();
    assert_eq!(
        consumed,
        [
            ("memory", "40448Mi"),
            ("memory-slice-4", "1"),
            ("memory-slice-5", "1"),
            ("memory-slice-6", "1"),
            ("memory-slice-7", "1"),
            ("multiprocessors", "60")
        ]
    );
    assert_eq!(dev.capacity.as_ref().unwrap()["multiprocessors"].value.0, "60");
}

#[test]
fn the_layout_follows_the_version() {
    assert_eq!(SliceLayout::for_version("1", "34"), Some(SliceLayout::Combined));
    assert_eq!(SliceLayout::for_version("1", "33+"), Some(SliceLayout::Combined));
    assert_eq!(SliceLayout::for_version("1", "35"), Some(SliceLayout::Separate));
    assert_eq!(SliceLayout::for_version("1", "37"), Some(SliceLayout::Separate));
    assert_eq!(SliceLayout::for_version("2", "0"), Some(SliceLayout::Separate));
    assert_eq!(SliceLayout::for_version("", ""), None);
    let info = |major: &str, minor: &str, git: &str| k8s_openapi::apimachinery::pkg::version::Info {
        major: major.into(),
        minor: minor.into(),
        git_version: git.into(),
        ..Default::default()
    };
    assert_eq!(SliceLayout::for_info(&info("", "", "v1.34.3-gke.1")), Some(SliceLayout::Combined));
    assert_eq!(SliceLayout::for_info(&info("", "", "v1.36.0")), Some(SliceLayout::Separate));
    assert_eq!(SliceLayout::for_info(&info("", "", "nonsense")), None);
}

fn plain_device(name: &str, unhealthy: Option<&str>) -> DraDevice {
    DraDevice::test_gpu(name, unhealthy)
}

#[test]
fn taints_from_1_36() {
    assert_eq!(unhealthy_layout("1", "34"), Unhealthy::Remove);
    assert_eq!(unhealthy_layout("1", "35+"), Unhealthy::Remove);
    assert_eq!(unhealthy_layout("1", "36"), Unhealthy::Taint);
    assert_eq!(unhealthy_layout("1", "37+"), Unhealthy::Taint);
    assert_eq!(unhealthy_layout("2", "0"), Unhealthy::Taint);
    assert_eq!(unhealthy_layout("", ""), Unhealthy::Remove, "unknown: the safe layout");
}

#[test]
fn unhealthy_devices_leave_or_carry_a_taint_by_state() {
    let devices = [
        plain_device("gpu-0", None),
        plain_device("gpu-1", Some("unhealthy: XID 79 (GPU has fallen off the bus)")),
        plain_device("gpu-2", Some("lost: not answering")),
        plain_device("gpu-3", Some("recovering: reset (volatile ECC counters cleared)")),
    ];
    let names =
        |s: &ResourceSlice| -> Vec<String> { s.spec.devices.iter().flatten().map(|d| d.name.clone()).collect() };
    assert_eq!(names(&build("n", &devices, 0)), ["gpu-0"]);
    let tainted = build_with("n", &devices, 0, Unhealthy::Taint, None);
    assert_eq!(names(&tainted), ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
    let taints: Vec<(Option<String>, String)> = tainted
        .spec
        .devices
        .iter()
        .flatten()
        .map(|d| d.taints.clone().unwrap_or_default())
        .filter_map(|t| t.first().cloned())
        .map(|t| {
            assert_eq!(t.key, TAINT_KEY);
            assert!(t.time_added.is_some());
            (t.value, t.effect)
        })
        .collect();
    assert_eq!(
        taints,
        [
            (Some("unhealthy".into()), "NoExecute".into()),
            (Some("lost".into()), "NoExecute".into()),
            (Some("recovering".into()), "NoSchedule".into())
        ]
    );
    assert!(tainted.spec.devices.as_ref().unwrap()[0].taints.is_none(), "a healthy device carries none");
    // An unchanged fault keeps its time (no rewrite); a new effect gets a new one.
    let mut previous = tainted.spec.clone();
    let then = Time(k8s_openapi::jiff::Timestamp::from_second(1_000_000).unwrap());
    for d in previous.devices.iter_mut().flatten() {
        for t in d.taints.iter_mut().flatten() {
            t.time_added = Some(then.clone());
        }
    }
    let again = build_with("n", &devices, 0, Unhealthy::Taint, Some(&previous));
    assert_eq!(again.spec, previous);
    let mut changed = devices.clone();
    changed[3].health = crate::device_health::Health::Unhealthy("unhealthy: XID 48".into());
    let next = build_with("n", &changed, 0, Unhealthy::Taint, Some(&previous));
    let t = &next.spec.devices.as_ref().unwrap()[3].taints.as_ref().unwrap()[0];
    assert_eq!(t.effect, "NoExecute");
    assert_ne!(t.time_added, Some(then), "a new effect is a new taint");
    // A server that dropped the taints is noticed.
    assert!(taints_kept(&tainted, &tainted));
    assert!(!taints_kept(&tainted, &build("n", &devices, 0)));
}
