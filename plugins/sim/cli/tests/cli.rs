//! tessera-sim as an operator uses it: layout, status, faults, MIG, bad input.

use std::path::Path;
use std::process::{Command, Output};

use tessera_sim_testkit::{SimNode, binary};

fn sim(node: &SimNode, args: &[&str]) -> Output {
    node.command(binary("tessera-sim")).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A dynamic-section entry of an ELF file, as `readelf -d` prints it (e.g. "SONAME", "NEEDED").
fn dynamic(path: &Path, tag: &str) -> Vec<String> {
    let o = Command::new("readelf").arg("-d").arg(path).output().expect("run readelf (binutils)");
    assert!(o.status.success(), "readelf {}: {}", path.display(), text(&o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.contains(&format!("({tag})")))
        .filter_map(|l| Some(l.split('[').nth(1)?.trim_end_matches(']').to_string()))
        .collect()
}

#[test]
fn install_lays_out_versioned_libraries_with_real_sonames() {
    let node = SimNode::new();
    let dir = node.root.join("drivers");
    let o = sim(&node, &["install", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    for (name, soname) in [("libcuda.so", "libcuda.so.1"), ("libnvidia-ml.so", "libnvidia-ml.so.1")] {
        let versioned = format!("{name}.570.133.20");
        assert_eq!(std::fs::read_link(dir.join(soname)).unwrap().to_str(), Some(versioned.as_str()));
        assert_eq!(std::fs::read_link(dir.join(name)).unwrap().to_str(), Some(soname));
        assert_eq!(dynamic(&dir.join(&versioned), "SONAME"), [soname], "{versioned}");
    }
    // The built library keeps its own placeholder name: only the copies are renamed.
    assert_eq!(dynamic(&tessera_sim_testkit::sim_library(), "SONAME"), ["libtessera_sim.so"]);
    // Installing again over a layout replaces it (an upgrade of the driver).
    let o = sim(&node, &["install", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn a_program_linked_with_lcuda_records_libcuda_so_1_and_runs() {
    let node = SimNode::new();
    let dir = node.root.join("drivers");
    assert!(sim(&node, &["install", dir.to_str().unwrap()]).status.success());
    let src = node.root.join("prog.c");
    std::fs::write(
        &src,
        "#include <stdio.h>\n\
         int cuInit(unsigned); int cuDriverGetVersion(int *);\n\
         int nvmlInit_v2(void); int nvmlDeviceGetCount_v2(unsigned *);\n\
         int main(void) { int v = 0; unsigned n = 0;\n\
           if (cuInit(0) || cuDriverGetVersion(&v) || nvmlInit_v2() || nvmlDeviceGetCount_v2(&n)) return 1;\n\
           printf(\"cuda %d gpus %u\\n\", v, n); return 0; }\n",
    )
    .unwrap();
    let exe = node.root.join("prog");
    let o = Command::new("cc")
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&dir)
        // Both libraries define every name (one implementation): keep both, as with NVIDIA's.
        .args(["-Wl,--no-as-needed", "-lcuda", "-lnvidia-ml"])
        .output()
        .expect("run cc");
    assert!(o.status.success(), "cc: {}", text(&o));
    let needed = dynamic(&exe, "NEEDED");
    assert!(needed.contains(&"libcuda.so.1".to_string()), "{needed:?}");
    assert!(needed.contains(&"libnvidia-ml.so.1".to_string()), "{needed:?}");
    // Run with only the installed layout on the library path: both real names resolve, and the
    // two libraries (two copies in one process, as NVIDIA's two) see the same node.
    let o = node.command(&exe).env("LD_LIBRARY_PATH", &dir).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "cuda 12080 gpus 8");
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
