use super::check::{Sample, parse};
use super::*;
use crate::state::ContainerIdentity;
use crate::usage::{ContainerUsage, DeviceUsage};

/// Asserts that `text` declares metric family `family` of type `kind`.
#[track_caller]
fn declared(text: &str, family: &str, kind: &str) {
    assert!(text.contains(&format!("# TYPE {family} {kind}\n")), "no {kind} {family} in:\n{text}");
}

fn find<'a>(samples: &'a [Sample], name: &str, label: (&str, &str)) -> Vec<&'a Sample> {
    samples.iter().filter(|(n, l, _)| n == name && l.get(label.0).map(String::as_str) == Some(label.1)).collect()
}

fn device(uuid: &str, id: &str) -> DeviceUsage {
    DeviceUsage {
        device_id: id.to_string(),
        uuid: uuid.to_string(),
        memory_used: 3 << 30,
        memory_peak: 4 << 30,
        memory_limit: Some(8 << 30),
        sm_limit_percent: Some(25),
        sm_achieved_percent: 12.5,
        launches_per_second: 3.0,
        launches: 12345,
        gpu_time_ns: 1_500_000_000,
        throttled_ns: 250_000_000,
        oom_denials: 2,
        window_ns: 1_000_000_000,
    }
}

fn metrics() -> NodeMetrics {
    let mut unlimited = device("MIG-1", "MIG-1");
    unlimited.memory_limit = None;
    unlimited.sm_limit_percent = None;
    let on = crate::enforcement::OnDevice {
        allocation: "a1".into(),
        namespace: "team-a".into(),
        pod: "train-0".into(),
        container: "main".into(),
        uuid: "GPU-0".into(),
        device_id: "GPU-0::0,GPU-0::1".into(),
    };
    NodeMetrics {
        hostname: "node-1".into(),
        gpus: vec![
            GpuMetrics {
                index: 0,
                uuid: "GPU-0".into(),
                model: "NVIDIA H100 80GB HBM3".into(),
                pci_bus_id: "00000000:17:00.0".into(),
                memory_used: 1536 * MIB + 5,
                memory_total: 81559 * MIB,
                utilization_percent: Some(37),
                healthy: true,
                mig_profile: None,
                parent_uuid: None,
                gpu_instance_id: None,
                last_xid: Some(0),
                holder: None,
                layout_converged: Some(false),
                sensors: GpuSensors {
                    temperature_c: Some(41),
                    power_mw: Some(123_456),
                    sm_clock_mhz: Some(1980),
                    mem_clock_mhz: Some(2619),
                    ecc_corrected_volatile: Some(3),
                    ecc_uncorrected_volatile: Some(0),
                },
            },
            GpuMetrics {
                index: 1,
                uuid: "MIG-1".into(),
                model: "NVIDIA A100 \"SXM\"\nrev\\2".into(),
                pci_bus_id: "00000000:18:00.0".into(),
                memory_used: 0,
                memory_total: 10 * 1024 * MIB,
                utilization_percent: None,
                healthy: false,
                mig_profile: Some("1g.10gb".into()),
                parent_uuid: Some("GPU-1".into()),
                gpu_instance_id: Some(13),
                last_xid: None,
                holder: None,
                layout_converged: None,
                sensors: GpuSensors::default(),
            },
        ],
        usage: UsageReport {
            time_unix_ns: 1,
            containers: vec![
                ContainerUsage {
                    allocation_id: "a1".into(),
                    resource: "tessera.io/share".into(),
                    container: ContainerIdentity::of_pod("team-a", "train-0", "main"),
                    processes: 3,
                    devices: vec![device("GPU-0", "GPU-0::0,GPU-0::1"), unlimited],
                },
                ContainerUsage {
                    allocation_id: "a2".into(),
                    resource: "tessera.io/gpu".into(),
                    container: ContainerIdentity::default(),
                    processes: 0,
                    devices: vec![device("GPU-0", "GPU-0")],
                },
            ],
        },
        allocations: 2,
        events_total: 17,
        faults_total: 1,
        enforcement: crate::enforcement::Metrics {
            breaches: vec![crate::enforcement::BreachCount { on: on.clone(), action: "kill", limit: "sm", count: 4 }],
            sm_time: vec![crate::enforcement::SmTime { on: on.clone(), ns: 2_500_000_000, as_of_ns: 1 }],
            unattributed_gpu_processes: 2,
        },
        kubelet_withdrawn: [("tessera.io/gpu".into(), 0), ("tessera.io/gpu-share".into(), 3)].into(),
        filesystems: vec![
            FilesystemMetrics {
                dir: "state_dir".into(),
                path: "/var/lib/tessera".into(),
                avail_bytes: 123 << 20,
                size_bytes: 10 << 30,
            },
            FilesystemMetrics {
                dir: "runtime_dir".into(),
                path: "/run/tessera".into(),
                avail_bytes: 1 << 30,
                size_bytes: 2 << 30,
            },
        ],
        park: Default::default(),
    }
}

#[test]
fn renders_valid_text_with_exact_values() {
    let text = render(&metrics());
    let samples = parse(&text);

    let fb = find(&samples, "DCGM_FI_DEV_FB_USED", ("UUID", "GPU-0"));
    assert_eq!(fb.len(), 1);
    assert_eq!(fb[0].2, 1536.0, "MiB, rounded down");
    let l = &fb[0].1;
    assert_eq!(l["gpu"], "0");
    assert_eq!(l["device"], "nvidia0");
    assert_eq!(l["modelName"], "NVIDIA H100 80GB HBM3");
    assert_eq!(l["Hostname"], "node-1");
    assert_eq!(l["pci_bus_id"], "00000000:17:00.0");
    assert!(!l.contains_key("GPU_I_PROFILE"));
    assert_eq!(find(&samples, "DCGM_FI_DEV_FB_FREE", ("UUID", "GPU-0"))[0].2, (81559 - 1536 - 1) as f64);
    assert_eq!(find(&samples, "DCGM_FI_DEV_GPU_UTIL", ("UUID", "GPU-0"))[0].2, 37.0);
    assert!(find(&samples, "DCGM_FI_DEV_GPU_UTIL", ("UUID", "MIG-1")).is_empty(), "unknown: left out");
    for (name, want) in [
        ("DCGM_FI_DEV_GPU_TEMP", 41.0),
        ("DCGM_FI_DEV_POWER_USAGE", 123.456),
        ("DCGM_FI_DEV_SM_CLOCK", 1980.0),
        ("DCGM_FI_DEV_MEM_CLOCK", 2619.0),
        ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 3.0),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0.0),
    ] {
        assert_eq!(find(&samples, name, ("UUID", "GPU-0"))[0].2, want, "{name}");
        assert!(find(&samples, name, ("UUID", "MIG-1")).is_empty(), "{name}: not known for the MIG device");
    }
    declared(&text, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter");
    let mig = find(&samples, "DCGM_FI_DEV_FB_FREE", ("UUID", "MIG-1"));
    assert_eq!(mig[0].2, 10240.0);
    assert_eq!(mig[0].1["GPU_I_PROFILE"], "1g.10gb");
    assert_eq!(mig[0].1["modelName"], "NVIDIA A100 \"SXM\"\nrev\\2", "escaped and parsed back");
    assert_eq!(find(&samples, "tessera_gpu_healthy", ("UUID", "GPU-0"))[0].2, 1.0);
    assert_eq!(find(&samples, "tessera_gpu_healthy", ("UUID", "MIG-1"))[0].2, 0.0);

    let a1 = |name: &str| {
        let s = find(&samples, name, ("allocation", "a1"));
        s.into_iter().find(|s| s.1["UUID"] == "GPU-0").map(|s| s.2)
    };
    assert_eq!(a1("tessera_container_memory_used_bytes"), Some((3u64 << 30) as f64));
    assert_eq!(a1("tessera_container_memory_peak_bytes"), Some((4u64 << 30) as f64));
    assert_eq!(a1("tessera_container_memory_limit_bytes"), Some((8u64 << 30) as f64));
    assert_eq!(a1("tessera_container_sm_achieved_percent"), Some(12.5));
    assert_eq!(a1("tessera_container_sm_limit_percent"), Some(25.0));
    assert_eq!(a1("tessera_container_launches_total"), Some(12345.0));
    assert_eq!(a1("tessera_container_gpu_seconds_total"), Some(1.5));
    assert_eq!(a1("tessera_container_throttled_seconds_total"), Some(0.25));
    assert_eq!(a1("tessera_container_oom_denials_total"), Some(2.0));
    let used = find(&samples, "tessera_container_memory_used_bytes", ("allocation", "a1"));
    assert_eq!(used.len(), 2);
    let l = &used[0].1;
    assert_eq!((l["namespace"].as_str(), l["pod"].as_str(), l["container"].as_str()), ("team-a", "train-0", "main"));
    assert_eq!((l["resource"].as_str(), l["device_id"].as_str()), ("tessera.io/share", "GPU-0::0,GPU-0::1"));
    // No limit: no sample.
    assert_eq!(find(&samples, "tessera_container_memory_limit_bytes", ("UUID", "MIG-1")).len(), 0);
    assert_eq!(find(&samples, "tessera_container_sm_limit_percent", ("UUID", "MIG-1")).len(), 0);
    // Unknown pod: empty labels (Prometheus drops them).
    let a2 = find(&samples, "tessera_container_memory_used_bytes", ("allocation", "a2"));
    assert_eq!(a2[0].1["pod"], "");
    assert_eq!(find(&samples, "tessera_container_processes", ("allocation", "a1"))[0].2, 3.0);

    let node = |name: &str| samples.iter().find(|s| s.0 == name && s.1.is_empty()).map(|s| s.2);
    assert_eq!(node("tessera_allocations"), Some(2.0));
    assert_eq!(node("tessera_events_total"), Some(17.0));
    assert_eq!(node("tessera_faults_total"), Some(1.0));
    assert_eq!(node("tessera_unattributed_gpu_processes"), Some(2.0));
    // Every served resource, 0 included.
    let withdrawn = |r: &str| find(&samples, "tessera_kubelet_devices_withdrawn", ("resource", r))[0].2;
    assert_eq!((withdrawn("tessera.io/gpu"), withdrawn("tessera.io/gpu-share")), (0.0, 3.0));
    declared(&text, "tessera_kubelet_devices_withdrawn", "gauge");
    let breach = find(&samples, "tessera_container_limit_breaches_total", ("allocation", "a1"));
    assert_eq!(breach.len(), 1);
    assert_eq!(
        (breach[0].1["action"].as_str(), breach[0].1["limit"].as_str(), breach[0].1["pod"].as_str(), breach[0].2),
        ("kill", "sm", "train-0", 4.0)
    );
    declared(&text, "tessera_container_limit_breaches_total", "counter");
    let sm = find(&samples, "tessera_container_sm_seconds_total", ("allocation", "a1"));
    assert_eq!((sm.len(), sm[0].1["pod"].as_str(), sm[0].2), (1, "train-0", 2.5));
    declared(&text, "tessera_container_sm_seconds_total", "counter");
    declared(&text, "tessera_container_launches_total", "counter");
    declared(&text, "DCGM_FI_DEV_FB_USED", "gauge");
}

/// The bytes themselves, as scrapers read them: label order, escapes, number formats.
#[test]
fn exact_lines() {
    let text = render(&metrics());
    let gpu0 = r#"{gpu="0",UUID="GPU-0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",pci_bus_id="00000000:17:00.0"}"#;
    let a1 = r#"{allocation="a1",resource="tessera.io/share",UUID="GPU-0",device_id="GPU-0::0,GPU-0::1",namespace="team-a",pod="train-0",container="main"}"#;
    for line in [
        format!("DCGM_FI_DEV_FB_USED{gpu0} 1536\n"),
        format!("DCGM_FI_DEV_POWER_USAGE{gpu0} 123.456\n"),
        r#"tessera_gpu_healthy{gpu="1",UUID="MIG-1",device="nvidia1",modelName="NVIDIA A100 \"SXM\"\nrev\\2",Hostname="node-1",pci_bus_id="00000000:18:00.0",GPU_I_PROFILE="1g.10gb",GPU_I_ID="13"} 0"#.to_string() + "\n",
        format!("tessera_container_launches_total{a1} 12345\n"),
        format!("tessera_container_gpu_seconds_total{a1} 1.5\n"),
        format!("tessera_container_sm_achieved_percent{a1} 12.5\n"),
        r#"tessera_container_processes{allocation="a2",resource="tessera.io/gpu",namespace="",pod="",container=""} 0"#.to_string() + "\n",
        "# HELP tessera_allocations Allocations held on the node.\n# TYPE tessera_allocations gauge\ntessera_allocations 2\n".to_string(),
    ] {
        assert!(text.contains(&line), "missing {line:?} in:\n{text}");
    }
}

#[test]
fn last_xid_is_a_gauge_on_whole_gpus_only() {
    let mut m = metrics();
    let text = render(&m);
    declared(&text, "DCGM_FI_DEV_XID_ERRORS", "gauge");
    assert!(text.contains("# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.\n"));
    let samples = parse(&text);
    assert_eq!(find(&samples, "DCGM_FI_DEV_XID_ERRORS", ("UUID", "GPU-0"))[0].2, 0.0, "none seen: 0");
    assert!(find(&samples, "DCGM_FI_DEV_XID_ERRORS", ("UUID", "MIG-1")).is_empty(), "per GPU, not per MIG");
    m.gpus[0].last_xid = Some(79);
    let samples = parse(&render(&m));
    let x = find(&samples, "DCGM_FI_DEV_XID_ERRORS", ("UUID", "GPU-0"));
    assert_eq!((x.len(), x[0].2), (1, 79.0));
    assert_eq!((x[0].1["gpu"].as_str(), x[0].1["Hostname"].as_str()), ("0", "node-1"));
}

/// What the alert rules (deploy/monitoring) need beyond usage: a managed GPU's layout, and
/// the free space where the journal and the allocation directories live.
#[test]
fn layout_and_state_filesystem_series() {
    let mut m = metrics();
    let text = render(&m);
    declared(&text, "tessera_gpu_layout_converged", "gauge");
    declared(&text, "tessera_state_filesystem_avail_bytes", "gauge");
    let samples = parse(&text);
    let conv = find(&samples, "tessera_gpu_layout_converged", ("UUID", "GPU-0"));
    assert_eq!((conv.len(), conv[0].2, conv[0].1["gpu"].as_str()), (1, 0.0, "0"), "diverged: 0");
    assert!(find(&samples, "tessera_gpu_layout_converged", ("UUID", "MIG-1")).is_empty(), "not managed: none");
    let fs = |name: &str, dir: &str| find(&samples, name, ("dir", dir)).iter().map(|s| s.2).collect::<Vec<_>>();
    assert_eq!(fs("tessera_state_filesystem_avail_bytes", "state_dir"), [(123u64 << 20) as f64]);
    assert_eq!(fs("tessera_state_filesystem_size_bytes", "state_dir"), [(10u64 << 30) as f64]);
    assert_eq!(fs("tessera_state_filesystem_avail_bytes", "runtime_dir"), [(1u64 << 30) as f64]);
    let l = &find(&samples, "tessera_state_filesystem_avail_bytes", ("dir", "state_dir"))[0].1;
    assert_eq!(l["path"], "/var/lib/tessera");
    assert_eq!(l.len(), 2, "dir and path only: {l:?}");

    m.gpus[0].layout_converged = Some(true);
    m.filesystems.clear();
    let text = render(&m);
    let samples = parse(&text);
    assert_eq!(find(&samples, "tessera_gpu_layout_converged", ("UUID", "GPU-0"))[0].2, 1.0);
    assert!(!text.contains("tessera_state_filesystem"), "not known: no family");
}

#[test]
fn mig_series_carry_the_gpu_instance_id() {
    let samples = parse(&render(&metrics()));
    for name in ["DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "tessera_gpu_healthy"] {
        let mig = find(&samples, name, ("UUID", "MIG-1"));
        assert_eq!((mig[0].1["GPU_I_ID"].as_str(), mig[0].1["GPU_I_PROFILE"].as_str()), ("13", "1g.10gb"));
        let whole = find(&samples, name, ("UUID", "GPU-0"));
        assert!(!whole[0].1.contains_key("GPU_I_ID"), "{name}: a whole GPU has no instance id");
    }
}

#[test]
fn a_device_one_container_holds_carries_its_pod() {
    let mut m = metrics();
    m.gpus[1].holder =
        Some(PodLabels { namespace: "team-b".into(), pod: "infer-\"0\"".into(), container: "server".into() });
    let samples = parse(&render(&m));
    for name in ["DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "tessera_gpu_healthy"] {
        let l = &find(&samples, name, ("UUID", "MIG-1"))[0].1;
        assert_eq!(
            (l["namespace"].as_str(), l["pod"].as_str(), l["container"].as_str()),
            ("team-b", "infer-\"0\"", "server"),
            "{name}"
        );
        let whole = &find(&samples, name, ("UUID", "GPU-0"))[0].1;
        assert!(!whole.contains_key("pod") && !whole.contains_key("namespace"), "{name}: no holder, no labels");
    }
}

#[test]
fn empty_node_is_valid() {
    let m = NodeMetrics { hostname: "h".into(), ..Default::default() };
    let samples = parse(&render(&m));
    // 4, and parking's gauge, its three counters per op and the preemptions (always there, 0
    // when never used).
    assert_eq!(samples.len(), 12, "only the node's own: {samples:?}");
}

#[test]
fn odd_values_stay_parseable() {
    let mut m = metrics();
    m.hostname = "we\\ird\"host\nname".into();
    m.usage.containers[0].devices[0].sm_achieved_percent = 1e-9;
    m.usage.containers[0].devices[0].launches = u64::MAX;
    let samples = parse(&render(&m));
    let h = find(&samples, "tessera_gpu_healthy", ("UUID", "GPU-0"));
    assert_eq!(h[0].1["Hostname"], "we\\ird\"host\nname");
    let sm = find(&samples, "tessera_container_sm_achieved_percent", ("allocation", "a1"));
    assert_eq!(sm.iter().find(|s| s.1["UUID"] == "GPU-0").unwrap().2, 1e-9);
}

#[test]
fn checker_refuses_broken_text() {
    for bad in [
        "x 1\n",                                    // no HELP/TYPE
        "# HELP x h\n# TYPE x gauge\nx NaN\n",      // not finite
        "# HELP x h\n# TYPE x gauge\nx{a=\"1} 1\n", // unterminated
        "# HELP x h\n# TYPE x gauge\n# HELP x h\nx 1\n",
        "# HELP x h\n# TYPE x gauge\nx{a=\"\\q\"} 1\n",
        "# HELP x h\n# TYPE x gauge\nx 1\nx 2\n",
    ] {
        assert!(std::panic::catch_unwind(|| parse(bad)).is_err(), "accepted {bad:?}");
    }
}

#[test]
fn parking_is_a_gauge_and_counters_per_op() {
    let mut m = metrics();
    m.park = crate::allocator::park::ParkMetrics {
        parked: 2,
        parks: 3,
        park_seconds: 0.25,
        park_bytes: 3 << 30,
        resumes: 1,
        resume_seconds: 0.125,
        resume_bytes: 1 << 30,
        preemptions: 2,
    };
    let text = render(&m);
    let samples = parse(&text);
    let one = |name: &str, label: (&str, &str)| {
        let found = find(&samples, name, label);
        assert_eq!(found.len(), 1, "{name} {label:?}\n{text}");
        found[0].2
    };
    assert!(text.contains("# TYPE tessera_allocations_parked gauge\ntessera_allocations_parked 2\n"), "{text}");
    assert_eq!(one("tessera_park_operations_total", ("op", "park")), 3.0);
    assert_eq!(one("tessera_park_operations_total", ("op", "resume")), 1.0);
    assert_eq!(one("tessera_park_seconds_total", ("op", "park")), 0.25);
    assert_eq!(one("tessera_park_bytes_total", ("op", "resume")), f64::from(1u32 << 30));
    declared(&text, "tessera_park_bytes_total", "counter");
    assert!(text.contains("# TYPE tessera_preemptions_total counter\ntessera_preemptions_total 2\n"), "{text}");
}
