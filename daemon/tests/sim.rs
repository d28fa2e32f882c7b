//! The daemon's first layer against the simulated node: each test has a node of its own
//! (`SimNode::with_description`) and runs its body in a child process (`run_isolated`),
//! since a process keeps one NVML connection.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use tessera_daemon::config::Config;
use tessera_daemon::discovery::{Ancestor, Inventory, Session, Source};
use tessera_daemon::partition::{self, Desired, MigAction, PlanError};
use tessera_sim_testkit::{SimNode, binary};

const EIGHT_H100: &str = "numa_nodes = 2\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 8\nnvlink = true\n";
const TWO_H100_MIG: &str = "[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 2\nmig = true\n";

fn session(node: &SimNode) -> Session {
    Session::open(Some(&node.nvml_path()), false).expect("NVML over the simulated node")
}

fn sim_status(node: &SimNode) -> serde_json::Value {
    let out = node.command(binary("tessera-sim")).args(["status", "--json"]).output().unwrap();
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).unwrap()
}

fn layout(list: &[(&str, u32)]) -> std::collections::BTreeMap<String, u32> {
    list.iter().map(|(p, c)| (p.to_string(), *c)).collect()
}

fn plan_apply(s: &Session, gpu: u32, want: Desired<'_>, held: &BTreeSet<String>) -> Result<partition::Applied, String> {
    let inv = s.inventory().unwrap();
    let g = inv.gpu(gpu).unwrap();
    let p = partition::plan(want, g.mig.as_ref(), held, &g.processes).map_err(|e| e.to_string())?;
    partition::apply(s, gpu, &p, g.mig.as_ref().map(|m| &m.capability)).map_err(|e| e.to_string())
}

#[test]
fn discovers_the_eight_h100_node() {
    let node = SimNode::with_description(EIGHT_H100);
    node.run_isolated("discovers_the_eight_h100_node", || {
        let s = session(&node);
        assert_eq!(s.source(), Source::Configured);
        let inv: Inventory = s.inventory().unwrap();
        let status = sim_status(&node);
        assert_eq!(inv.gpus.len(), 8);
        assert_eq!(inv.driver_version, status["driver_version"]);
        for (g, want) in inv.gpus.iter().zip(status["gpus"].as_array().unwrap()) {
            assert_eq!(g.uuid, want["uuid"], "UUIDs are the simulator's");
            assert_eq!(g.name, "NVIDIA H100 80GB HBM3");
            assert_eq!(g.name, want["name"]);
            assert_eq!(g.pci_bus_id, want["bus_id"]);
            assert_eq!(g.memory_total, want["memory_total"]);
            assert_eq!(g.numa_node, Some(if g.index < 4 { 0 } else { 1 }));
            assert_eq!(u64::from(g.numa_node.unwrap()), want["numa_node"]);
            let others: Vec<u32> = (0..8).filter(|&i| i != g.index).collect();
            assert_eq!(g.nvlink_peers, others, "all-to-all over NVSwitch");
            let mig = g.mig.as_ref().expect("H100 does MIG");
            assert!(!mig.current && !mig.pending && mig.instances.is_empty());
            assert_eq!(mig.capability.compute_slices, 7);
            let p = mig.capability.profile("4g.40gb").unwrap();
            assert_eq!((p.placements.clone(), p.placement_size), (vec![0], 4));
            assert_eq!(mig.capability.profile("1g.10gb").unwrap().placements, (0..7).collect::<Vec<_>>());
        }
        assert_eq!(inv.topology.len(), 28);
        let near = inv.common_ancestor(0, 1).unwrap();
        let far = inv.common_ancestor(0, 7).unwrap();
        assert!(near < far, "{near} vs {far}");
        assert_eq!(far, Ancestor::System, "across NUMA nodes");
    });
}

#[test]
fn a_mig_layout_is_applied_then_already_there() {
    let node = SimNode::with_description(TWO_H100_MIG);
    node.run_isolated("a_mig_layout_is_applied_then_already_there", || {
        let s = session(&node);
        let want = layout(&[("3g.40gb", 1), ("4g.40gb", 1)]);
        let a = plan_apply(&s, 1, Desired::On(&want), &BTreeSet::new()).unwrap();
        assert_eq!(a.done.len(), 2);
        assert!(!a.pending_reset);
        let inv = s.inventory().unwrap();
        let mig = inv.gpu(1).unwrap().mig.as_ref().unwrap();
        let mut got: Vec<(String, u32)> = mig.instances.iter().map(|i| (i.profile.clone(), i.start)).collect();
        got.sort();
        assert_eq!(got, vec![("3g.40gb".to_string(), 4), ("4g.40gb".to_string(), 0)]);
        assert!(mig.instances.iter().all(|i| i.devices.len() == 1 && i.devices[0].uuid.starts_with("MIG-")));
        // The simulator agrees.
        let status = sim_status(&node);
        let sim_uuids: BTreeSet<String> = status["gpus"][1]["mig_instances"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["uuid"].as_str().unwrap().to_string())
            .collect();
        let ours: BTreeSet<String> = mig.instances.iter().map(|i| i.devices[0].uuid.clone()).collect();
        assert_eq!(ours, sim_uuids);
        // Again: nothing to do.
        let again = plan_apply(&s, 1, Desired::On(&want), &BTreeSet::new()).unwrap();
        assert!(again.done.is_empty() && !again.pending_reset, "{again:?}");
        assert_eq!(s.inventory().unwrap().gpu(1).unwrap().mig, inv.gpu(1).unwrap().mig);
    });
}

#[test]
fn a_layout_change_is_refused_for_an_instance_in_use() {
    let node = SimNode::with_description(TWO_H100_MIG);
    node.run_isolated("a_layout_change_is_refused_for_an_instance_in_use", || {
        let s = session(&node);
        let two = layout(&[("3g.40gb", 2)]);
        plan_apply(&s, 0, Desired::On(&two), &BTreeSet::new()).unwrap();
        let inv = s.inventory().unwrap();
        let busy = &inv.gpu(0).unwrap().mig.as_ref().unwrap().instances[0];
        let uuid = busy.devices[0].uuid.clone();
        let mut w = node
            .command(binary("tessera-workload"))
            .args(["--alloc-mib", "1024", "--hold", "60"])
            .env("CUDA_VISIBLE_DEVICES", &uuid)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let first = BufReader::new(w.stdout.take().unwrap()).lines().next().unwrap().unwrap();
        assert!(first.contains("holding"), "{first}");
        let sevens = layout(&[("1g.10gb", 7)]);
        let e = plan_apply(&s, 0, Desired::On(&sevens), &BTreeSet::new()).unwrap_err();
        assert!(e.contains("in use") && e.contains("processes"), "{e}");
        // Nothing was destroyed.
        let now = s.inventory().unwrap();
        assert_eq!(now.gpu(0).unwrap().mig.as_ref().unwrap().instances.len(), 2);
        // A layout that keeps it goes ahead around it.
        let keep = layout(&[("3g.40gb", 1), ("1g.10gb", 3)]);
        let a = plan_apply(&s, 0, Desired::On(&keep), &BTreeSet::new()).unwrap();
        assert!(a.done.iter().any(|x| matches!(x, MigAction::DestroyInstance { .. })));
        let now = s.inventory().unwrap();
        let mig = now.gpu(0).unwrap().mig.as_ref().unwrap();
        assert!(mig.instances.iter().any(|i| i.devices.iter().any(|d| d.uuid == uuid)), "the busy one stays");
        assert_eq!(mig.instances.len(), 4);
        w.kill().unwrap();
        w.wait().unwrap();
        // Held by an allocation (no process): refused the same way.
        let held: BTreeSet<String> = [uuid].into();
        let e = plan_apply(&s, 0, Desired::On(&sevens), &held).unwrap_err();
        assert!(e.contains("allocated"), "{e}");
    });
}

#[test]
fn an_ampere_mode_change_pends_until_a_reset() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"A100-SXM4-40GB\"\ncount = 1\n");
    node.run_isolated("an_ampere_mode_change_pends_until_a_reset", || {
        let s = session(&node);
        let mig = s.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(!mig.switches_in_place, "an A100 takes its MIG mode at a reset");
        let want = layout(&[("1g.5gb", 7)]);
        let a = plan_apply(&s, 0, Desired::On(&want), &BTreeSet::new()).unwrap();
        assert_eq!(a.done, vec![MigAction::SetMode { enable: true }]);
        assert!(a.pending_reset);
        let mig = s.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(!mig.current && mig.pending);
        // Asked again: still pending, nothing more done.
        let again = plan_apply(&s, 0, Desired::On(&want), &BTreeSet::new()).unwrap();
        assert!(again.done.is_empty() && again.pending_reset);
        let reset = node.command(binary("tessera-sim")).args(["reset", "--gpu", "0"]).output().unwrap();
        assert!(reset.status.success());
        let after = plan_apply(&s, 0, Desired::On(&want), &BTreeSet::new()).unwrap();
        assert_eq!(after.done.len(), 7, "{after:?}");
        assert!(!after.pending_reset);
        assert_eq!(s.inventory().unwrap().gpus[0].mig.as_ref().unwrap().instances.len(), 7);
        // Back to whole: instances destroyed, mode off pending.
        let off = plan_apply(&s, 0, Desired::Off, &BTreeSet::new()).unwrap();
        assert!(off.pending_reset && off.done.len() == 8, "{off:?}");
        let mig = s.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(mig.current && !mig.pending && mig.instances.is_empty());
    });
}

#[test]
fn a_hopper_mode_change_takes_effect_at_once() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    node.run_isolated("a_hopper_mode_change_takes_effect_at_once", || {
        let s = session(&node);
        assert!(s.inventory().unwrap().gpus[0].mig.as_ref().unwrap().switches_in_place);
        let want = layout(&[("1g.10gb", 7)]);
        let a = plan_apply(&s, 0, Desired::On(&want), &BTreeSet::new()).unwrap();
        assert_eq!(a.done, vec![MigAction::SetMode { enable: true }]);
        assert!(!a.pending_reset, "no reset needed: {a:?}");
        let mig = s.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(mig.current && mig.pending);
        // The instances, with no reset in between.
        let after = plan_apply(&s, 0, Desired::On(&want), &BTreeSet::new()).unwrap();
        assert_eq!(after.done.len(), 7, "{after:?}");
        // Back to whole: instances destroyed and the mode off, at once.
        let off = plan_apply(&s, 0, Desired::Off, &BTreeSet::new()).unwrap();
        assert!(!off.pending_reset && off.done.len() == 8, "{off:?}");
        let mig = s.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(!mig.current && !mig.pending && mig.instances.is_empty());
    });
}

#[test]
fn configs_are_checked_against_the_node() {
    let node =
        SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 2\n[[gpu]]\nmodel = \"H200-141GB\"\n");
    node.run_isolated("configs_are_checked_against_the_node", || {
        let s = session(&node);
        let inv = s.inventory().unwrap();
        let h200 = inv.gpu(2).unwrap().mig.as_ref().unwrap();
        assert!(h200.capability.profile("1g.18gb").is_some(), "{:?}", h200.capability.names());
        let bad = |text: &str| partition::resolve(&Config::parse(text).unwrap(), &inv).unwrap_err();
        let e = bad("[partitions.9]\nwhole = true\n");
        assert_eq!(e.key, "partitions.9");
        let e = bad("[partitions.0]\nmig = { \"2g.99gb\" = 1 }\n");
        assert_eq!(e.key, "partitions.0.mig.\"2g.99gb\"");
        assert!(e.reason.contains("3g.40gb"), "{e}");
        let e = bad("[partitions.2]\nmig = { \"1g.10gb\" = 1 }\n");
        assert!(e.reason.contains("1g.18gb"), "the H200's own table: {e}");
        let e = bad("[[partitions.1.shares]]\nmemory = \"90GiB\"\n");
        assert_eq!(e.key, "partitions.1.shares");
        let e = bad(&format!("[partitions.0]\nwhole = true\n[partitions.{:?}]\nwhole = true\n", inv.gpus[0].uuid));
        assert!(e.reason.contains("declare it once"), "{e}");
        let e =
            bad("[partitions.0]\nmig = { \"3g.40gb\" = 1 }\nmig_shares = { \"3g.40gb\" = [{ memory = \"50GiB\" }] }\n");
        assert!(e.key.starts_with("partitions.0.mig_shares"), "{e}");
        let ok = Config::parse("[partitions.default]\nwhole = true\n[partitions.1]\nshares = { count = 4 }\n").unwrap();
        let l = partition::resolve(&ok, &inv).unwrap();
        assert_eq!(l.len(), 3);
        let shares = partition::plan_all_shares(&inv, &l).unwrap();
        assert_eq!(shares.len(), 4);
        assert!(shares.iter().all(|x| x.parent_uuid == inv.gpus[1].uuid && x.sm_percent == 25));
        assert!(matches!(
            partition::plan(Desired::On(&layout(&[("1g.10gb", 1)])), None, &BTreeSet::new(), &[]),
            Err(PlanError::NotSupported)
        ));
    });
}

fn tesserad(node: &SimNode, config: &str) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.toml");
    std::fs::write(&p, config).unwrap();
    let mut c: Command = node.command(env!("CARGO_BIN_EXE_tesserad"));
    c.arg("--config").arg(&p).arg("--sim").arg("--once").env("TESSERA_SIM_LIB", node.nvml_path());
    c.output().unwrap()
}

#[test]
fn tesserad_refuses_bad_configs_and_applies_good_ones() {
    let node = SimNode::with_description(TWO_H100_MIG);
    let bad = tesserad(&node, "[health]\ninterval_seconds = 0\n");
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("health.interval_seconds: 0 is out of range"), "{err}");
    let bad = tesserad(&node, "[partitions.0]\nmig = { \"5g.50gb\" = 1 }\n");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("partitions.0.mig.\"5g.50gb\""));
    let good = "[partitions.0]\nmig = { \"3g.40gb\" = 2 }\nmig_shares = { \"3g.40gb\" = { count = 2 } }\n";
    let out = tesserad(&node, good);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.lines().next().unwrap_or("").contains("NVML library"), "first line says which library: {log}");
    assert!(text.contains("layout: applied 2 change(s)"), "{text}");
    assert_eq!(text.matches(" share MIG-").count(), 4, "{text}");
    let again = tesserad(&node, good);
    assert!(String::from_utf8_lossy(&again.stdout).contains("layout: as declared"));
}

/// Without `--sim` or `sim = true`, a node with no driver is an error naming the library, even
/// with the simulator at hand; `sim = true` alone selects it.
#[test]
fn tesserad_never_falls_back_to_the_simulator() {
    let driver_present = Command::new("ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("libnvidia-ml.so.1 "));
    let node = SimNode::with_description(TWO_H100_MIG);
    let dir = tempfile::tempdir().unwrap();
    let run = |config: &str| {
        let p = dir.path().join("config.toml");
        std::fs::write(&p, config).unwrap();
        let mut c: Command = node.command(env!("CARGO_BIN_EXE_tesserad"));
        // The node's library directory stays off the loader's path (a driver-less node); the
        // simulator's library is still named, as it would be beside the executable.
        c.arg("--config").arg(&p).arg("--once").env("TESSERA_SIM_LIB", node.nvml_path()).env_remove("LD_LIBRARY_PATH");
        c.output().unwrap()
    };
    if driver_present {
        println!("SKIP: an NVIDIA driver is installed here; a node without one cannot be shown");
    } else {
        let out = run("");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("no NVIDIA driver: cannot load libnvidia-ml.so.1"), "{err}");
        assert!(err.contains("/etc/ld.so.cache") && err.contains("--sim"), "{err}");
        assert!(!err.contains("simulated node,"), "the simulator was not loaded: {err}");
    }
    let out = run("sim = true\n");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("the simulated node, as asked"), "{log}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("GPU 0"));
}
