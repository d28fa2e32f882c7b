//! Laying the driver library out under the names programs load, and running the workload on it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use tessera_sim_model::Node;

/// The one library plays both of NVIDIA's: NVML and the CUDA driver.
pub const NAMES: [&str; 4] = ["libnvidia-ml.so.1", "libnvidia-ml.so", "libcuda.so.1", "libcuda.so"];
const LIB: &str = "libtessera_sim.so";

fn find_lib(explicit: Option<&Path>) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = match explicit {
        Some(p) => vec![p.to_path_buf()],
        None => std::env::var_os("TESSERA_SIM_LIB")
            .map(PathBuf::from)
            .into_iter()
            .chain(std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join(LIB))))
            .collect(),
    };
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| format!("cannot find {LIB} (looked at {candidates:?}); build it with cargo build -p tessera-sim-driver or pass --lib"))
}

/// Copies the library into `dir` and links every driver name to it. Returns the copy's path.
pub fn install(dir: &Path, lib: Option<&Path>) -> Result<PathBuf, String> {
    let lib = find_lib(lib)?;
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let target = dir.join(LIB);
    // Copy to a temporary name and rename: a process loading the old copy keeps a whole file.
    let tmp = dir.join(format!(".{LIB}.{}", std::process::id()));
    std::fs::copy(&lib, &tmp).map_err(|e| format!("copy {} to {}: {e}", lib.display(), tmp.display()))?;
    std::fs::rename(&tmp, &target).map_err(|e| format!("rename into {}: {e}", target.display()))?;
    for name in NAMES {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(LIB, &link).map_err(|e| format!("link {}: {e}", link.display()))?;
    }
    Ok(target)
}

/// Replaces this process with tessera-workload (found beside this program), pointed at the node.
pub fn exec_workload(node: &Node, description: Option<&Path>, args: &[String]) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = exe.parent().ok_or("no program directory")?;
    let workload = dir.join("tessera-workload");
    if !workload.is_file() {
        return Err(format!("{} is missing; build it with cargo build -p tessera-workload", workload.display()));
    }
    let lib_dir = node.state_path().with_extension("lib");
    install(&lib_dir, None)?;
    let mut ld = lib_dir.into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        ld.push(":");
        ld.push(old);
    }
    let mut cmd = std::process::Command::new(&workload);
    cmd.args(args).env("LD_LIBRARY_PATH", ld).env(tessera_sim_model::ENV_STATE, node.state_path());
    if let Some(d) = description {
        cmd.env(tessera_sim_model::ENV_NODE, d);
    }
    Err(format!("exec {}: {}", workload.display(), cmd.exec()))
}
