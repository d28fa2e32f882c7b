//! tessera-sim as an operator uses it: layout, status, faults, MIG, bad input.

use std::process::Output;

use tessera_sim_testkit::{SimNode, binary};

fn sim(node: &SimNode, args: &[&str]) -> Output {
    node.command(binary("tessera-sim")).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn install_lays_out_both_driver_names() {
    let node = SimNode::new();
    let dir = node.root.join("drivers");
    let o = sim(&node, &["install", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    for name in ["libnvidia-ml.so.1", "libnvidia-ml.so", "libcuda.so.1", "libcuda.so"] {
        let target = std::fs::read_link(dir.join(name)).unwrap();
        assert_eq!(target.to_str(), Some("libtessera_sim.so"), "{name}");
    }
    let copy = std::fs::read(dir.join("libtessera_sim.so")).unwrap();
    assert_eq!(copy, std::fs::read(tessera_sim_testkit::sim_library()).unwrap());
}

#[test]
fn status_shows_the_default_node() {
    let node = SimNode::new();
    let o = sim(&node, &["status", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    assert!(gpus.iter().all(|g| g["name"] == "NVIDIA H100 80GB HBM3" && g["lost"] == false));
    assert_eq!(gpus[0]["memory_total"], 81559u64 << 20);
    let o = sim(&node, &["status"]);
    assert!(text(&o).contains("simulated node: 8 GPUs"), "{}", text(&o));
}

#[test]
fn faults_show_and_reset_recovers() {
    let node = SimNode::new();
    assert!(sim(&node, &["inject", "lost", "--gpu", "3"]).status.success());
    assert!(sim(&node, &["inject", "ecc", "--gpu", "1", "--uncorrected", "2"]).status.success());
    assert!(sim(&node, &["inject", "xid", "--gpu", "1", "--xid", "48"]).status.success());
    let v: serde_json::Value = serde_json::from_slice(&sim(&node, &["status", "--json"]).stdout).unwrap();
    assert_eq!(v["gpus"][3]["lost"], true);
    assert_eq!(v["gpus"][1]["ecc_uncorrected"], 2);
    assert_eq!(v["gpus"][1]["last_xid"], 48);
    assert!(text(&sim(&node, &["status"])).contains("LOST"));
    assert!(sim(&node, &["reset", "--gpu", "3"]).status.success());
    let v: serde_json::Value = serde_json::from_slice(&sim(&node, &["status", "--json"]).stdout).unwrap();
    assert_eq!(v["gpus"][3]["lost"], false);
}

#[test]
fn mig_through_the_cli() {
    let node = SimNode::new();
    let o = sim(&node, &["mig", "mode", "--gpu", "0", "on"]);
    assert!(text(&o).contains("pending"), "{}", text(&o));
    assert!(
        !sim(&node, &["mig", "create", "--gpu", "0", "--profile", "1g.10gb"]).status.success(),
        "not before the reset"
    );
    assert!(sim(&node, &["reset", "--gpu", "0"]).status.success());
    let o = sim(&node, &["mig", "create", "--gpu", "0", "--profile", "4g.40gb"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("MIG-"));
    let o = sim(&node, &["mig", "create", "--gpu", "0", "--profile", "3g.40gb", "--placement", "0"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("overlaps"), "{}", text(&o));
    let o = sim(&node, &["mig", "create", "--gpu", "0", "--profile", "9g.1tb"]);
    assert!(text(&o).contains("has no MIG profile \"9g.1tb\"") && text(&o).contains("3g.40gb"), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&sim(&node, &["status", "--json"]).stdout).unwrap();
    assert_eq!(v["gpus"][0]["mig_instances"][0]["profile"], "4g.40gb");
    assert!(sim(&node, &["mig", "destroy", "--gpu", "0", "--gi", "1"]).status.success());
}

#[test]
fn bad_descriptions_and_state_files_are_named() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 99\n");
    let o = sim(&node, &["status"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("node.toml") && text(&o).contains("at most 16"), "{}", text(&o));
    let node = SimNode::new();
    std::fs::write(&node.state, b"not a state file").unwrap();
    let o = sim(&node, &["status"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("node.state") && text(&o).contains("remove it"), "{}", text(&o));
}

#[test]
fn a_state_file_belongs_to_its_description() {
    let node = SimNode::new();
    assert!(sim(&node, &["status"]).status.success());
    let other = node.root.join("other.toml");
    std::fs::write(&other, "[[gpu]]\nmodel = \"A100-SXM4-40GB\"\n").unwrap();
    let o = node.command(binary("tessera-sim")).args(["--node", other.to_str().unwrap(), "status"]).output().unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("another node description"), "{}", text(&o));
}
