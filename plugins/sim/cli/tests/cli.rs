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
    let said = |args: &[&str], what: &str| {
        let o = sim(&node, args);
        assert!(o.status.success() && text(&o).contains(what), "{args:?}: {}", text(&o));
    };
    said(&["inject", "lost", "--gpu", "3"], "GPU 3: fallen off the bus");
    said(
        &["inject", "ecc", "--gpu", "1", "--uncorrected", "2"],
        "GPU 1: 0 corrected and 2 uncorrected ECC errors added",
    );
    said(&["inject", "xid", "--gpu", "1", "--xid", "48"], "GPU 1: XID 48 raised");
    let v: serde_json::Value = serde_json::from_slice(&sim(&node, &["status", "--json"]).stdout).unwrap();
    assert_eq!(v["gpus"][3]["lost"], true);
    assert_eq!(v["gpus"][1]["ecc_uncorrected"], 2);
    assert_eq!(v["gpus"][1]["last_xid"], 48);
    assert!(text(&sim(&node, &["status"])).contains("LOST"));
    said(&["reset", "--gpu", "3"], "GPU 3: reset");
    let v: serde_json::Value = serde_json::from_slice(&sim(&node, &["status", "--json"]).stdout).unwrap();
    assert_eq!(v["gpus"][3]["lost"], false);
    // After a reset a GPU reads healthy: no XID or volatile ECC count left over.
    said(&["reset", "--gpu", "1"], "GPU 1: reset");
    let v: serde_json::Value = serde_json::from_slice(&sim(&node, &["status", "--json"]).stdout).unwrap();
    assert_eq!((v["gpus"][1]["last_xid"].as_u64(), v["gpus"][3]["last_xid"].as_u64()), (Some(0), Some(0)));
    let table = text(&sim(&node, &["status"]));
    for gpu in ["1", "3"] {
        let row = table.lines().find(|l| l.split_whitespace().next() == Some(gpu)).unwrap_or_default();
        assert!(row.trim_end().ends_with(" ok"), "GPU {gpu} after its reset: {row}");
    }
}

#[test]
fn mig_through_the_cli() {
    // An A100 takes its MIG mode at the next reset.
    let a100 = SimNode::with_description("[[gpu]]\nmodel = \"A100-SXM4-40GB\"\ncount = 1\n");
    let o = sim(&a100, &["mig", "mode", "--gpu", "0", "on"]);
    assert!(text(&o).contains("GPU 0: MIG mode on is pending;"), "{}", text(&o));
    assert!(
        !sim(&a100, &["mig", "create", "--gpu", "0", "--profile", "1g.5gb"]).status.success(),
        "not before the reset"
    );
    assert!(sim(&a100, &["reset", "--gpu", "0"]).status.success());
    let o = sim(&a100, &["mig", "create", "--gpu", "0", "--profile", "1g.5gb"]);
    assert!(o.status.success(), "{}", text(&o));

    // An H100 (the default node) switches at once.
    let node = SimNode::new();
    let o = sim(&node, &["mig", "mode", "--gpu", "0", "on"]);
    assert!(text(&o).contains("GPU 0: MIG mode is on"), "{}", text(&o));
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

#[test]
fn driver_root_has_what_nvidia_tools_look_for() {
    let node = SimNode::new();
    let root = node.root.join("driver");
    let o = sim(&node, &["install", "--driver-root", root.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    // NVIDIA's CDI generator reads the driver version from libcuda.so.<version>'s name.
    assert_eq!(std::fs::read_link(lib.join("libcuda.so.1")).unwrap().to_str(), Some("libcuda.so.570.133.20"));
    assert_eq!(dynamic(&lib.join("libnvidia-ml.so.570.133.20"), "SONAME"), ["libnvidia-ml.so.1"]);
    for stub in ["libnvidia-ptxjitcompiler.so", "libnvidia-cfg.so", "libnvidia-opencl.so"] {
        assert_eq!(dynamic(&lib.join(format!("{stub}.570.133.20")), "SONAME"), [format!("{stub}.1")]);
        assert!(lib.join(format!("{stub}.1")).exists(), "{stub}.1");
    }
    // The proc tree of the kernel module.
    let proc = root.join("proc/driver");
    let info = std::fs::read_to_string(proc.join("nvidia/gpus/0000:18:00.0/information")).unwrap();
    assert!(info.contains("NVIDIA H100 80GB HBM3") && info.contains("Device Minor: \t 0"), "{info}");
    let minors = std::fs::read_to_string(proc.join("nvidia-caps/mig-minors")).unwrap();
    assert!(minors.starts_with("config 1\nmonitor 2\ngpu0/gi0/access 3\n"), "{minors}");
    assert!(std::fs::read_to_string(proc.join("nvidia/version")).unwrap().contains("570.133.20"));
    // Device nodes: the driver's numbers as root, plain files otherwise (documented).
    for (name, major, minor) in
        [("nvidia0", 195, 0), ("nvidia7", 195, 7), ("nvidiactl", 195, 255), ("nvidia-caps/nvidia-cap1", 511, 1)]
    {
        let meta = std::fs::metadata(root.join("dev").join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            use std::os::unix::fs::{FileTypeExt, MetadataExt};
            assert!(meta.file_type().is_char_device(), "{name}");
            assert_eq!((libc::major(meta.rdev()), libc::minor(meta.rdev())), (major, minor), "{name}");
            assert_eq!(meta.mode() & 0o777, 0o666, "{name}");
        } else {
            println!("SKIP: not root, so {name} is a plain file (device numbers unchecked)");
            assert!(meta.is_file(), "{name}");
        }
    }
}

#[test]
fn driver_root_proc_tree_follows_mig_changes() {
    let node = SimNode::new();
    let root = node.root.join("driver");
    assert!(sim(&node, &["install", "--driver-root", root.to_str().unwrap()]).status.success());
    let caps = root.join("proc/driver/nvidia/capabilities");
    assert!(caps.join("mig/config").exists());
    assert!(!caps.join("gpu1/mig").exists(), "no instances yet");
    assert!(sim(&node, &["mig", "mode", "--gpu", "1", "on"]).status.success());
    let o = sim(&node, &["mig", "create", "--gpu", "1", "--profile", "3g.40gb"]);
    assert!(o.status.success(), "{}", text(&o));
    let gi = std::fs::read_dir(caps.join("gpu1/mig")).unwrap().next().unwrap().unwrap().path();
    let gi_id: u32 = gi.file_name().unwrap().to_str().unwrap().trim_start_matches("gi").parse().unwrap();
    let access = std::fs::read_to_string(gi.join("access")).unwrap();
    assert_eq!(access, format!("DeviceFileMinor: {}\nDeviceFileMode: 292\nDeviceFileModify: 1\n", 3 + 135 + gi_id * 9));
    assert!(gi.join("ci0/access").exists(), "the full-size compute instance");
    // nvidia-smi over the node lists the MIG device and shows the mode.
    let smi = root.join("usr/bin/nvidia-smi");
    let o =
        Command::new(&smi).arg("-L").env_remove("TESSERA_SIM_STATE").env_remove("TESSERA_SIM_NODE").output().unwrap();
    let listing = text(&o);
    assert!(
        listing.contains("GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-") && listing.contains("MIG 3g.40gb"),
        "{listing}"
    );
    assert!(sim(&node, &["mig", "destroy", "--gpu", "1", "--gi", &gi_id.to_string()]).status.success());
    assert!(!gi.exists(), "a destroyed instance's capabilities go");
}

#[test]
fn nvidia_smi_answers_queries_as_nvidia_smi_does() {
    let node = SimNode::new();
    let root = node.root.join("driver");
    assert!(sim(&node, &["install", "--driver-root", root.to_str().unwrap()]).status.success());
    let smi = |args: &[&str]| node.command(root.join("usr/bin/nvidia-smi")).args(args).output().unwrap();
    let o = smi(&["--query-gpu=index,name,memory.total,utilization.gpu,mig.mode.current", "--format=csv"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "index, name, memory.total [MiB], utilization.gpu [%], mig.mode.current");
    assert_eq!(lines[1], "0, NVIDIA H100 80GB HBM3, 81559 MiB, 0 %, Disabled");
    assert_eq!(lines.len(), 9);
    let o = smi(&["--query-gpu", "memory.total,memory.used", "--format=csv,noheader,nounits", "-i", "2,3"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "81559, 0\n81559, 0\n");
    let o = smi(&["--query-gpu=memory.bogus", "--format=csv"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("Field \"memory.bogus\" is not a valid field to query."), "{}", text(&o));
    let o = smi(&["--query-gpu=index", "--format=json"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = smi(&["-i", "9", "-L"]);
    assert_eq!(o.status.code(), Some(6), "{}", text(&o));
    let o = smi(&["-q"]);
    let q = text(&o);
    assert!(
        q.contains("Driver Version                            : 570.133.20")
            && q.contains("Attached GPUs                             : 8"),
        "{q}"
    );
    assert!(q.contains("GPU 00000000:18:00.0") && q.contains("Total                             : 81559 MiB"), "{q}");
}

#[test]
fn a_tool_with_fixed_paths_runs_against_the_driver_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let why = "not root: scripts/sim-driver-root-run.sh needs a mount namespace with overlays";
        assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "TESSERA_REQUIRE_RUNTIMES is set, but {why}");
        println!("SKIP: {why}");
        return;
    }
    let node = SimNode::new();
    let root = node.root.join("driver");
    assert!(sim(&node, &["install", "--driver-root", root.to_str().unwrap()]).status.success());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../scripts/sim-driver-root-run.sh");
    let probe = "nvidia-smi --query-gpu=count --format=csv,noheader -i 0; stat -c '%t:%T' /dev/nvidia3; \
                 head -1 /proc/driver/nvidia-caps/mig-minors; readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1";
    let o = node.command(&script).arg(&root).args(["--", "sh", "-c", probe]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "8\nc3:3\nconfig 1\nlibcuda.so.570.133.20\n");
    // Outside the namespace nothing changed.
    assert!(!Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.570.133.20").exists());
    assert!(
        std::fs::read_dir("/tmp")
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().starts_with(".tessera-sim-dev"))
    );
}
