//! Laying the driver library out under the names programs load, and running the workload on it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use tessera_sim_model::Node;

/// The two libraries the one driver library is laid out as: its name and the SONAME its copy carries.
pub const LIBRARIES: [&str; 2] = ["libcuda.so", "libnvidia-ml.so"];
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

/// Lays the driver library out in `dir` as a real driver installs its two libraries: for each,
/// a copy `<name>.<driver version>` carrying the real SONAME (`<name>.1`), the link `<name>.1`
/// to it, and the development link `<name>` to `<name>.1`. Copies are written whole under a
/// temporary name and renamed, so a process loading an old copy keeps a whole file.
pub fn install(dir: &Path, lib: Option<&Path>, driver_version: &str) -> Result<(), String> {
    let lib = find_lib(lib)?;
    let elf = std::fs::read(&lib).map_err(|e| format!("read {}: {e}", lib.display()))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    for name in LIBRARIES {
        let soname = format!("{name}.1");
        let versioned = format!("{name}.{driver_version}");
        let mut copy = elf.clone();
        crate::soname::set(&mut copy, &soname).map_err(|e| format!("{}: {e}", lib.display()))?;
        let tmp = dir.join(format!(".{versioned}.{}", std::process::id()));
        std::fs::write(&tmp, &copy).map_err(|e| format!("write {}: {e}", tmp.display()))?;
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", tmp.display()))?;
        let target = dir.join(&versioned);
        std::fs::rename(&tmp, &target).map_err(|e| format!("rename into {}: {e}", target.display()))?;
        link(dir, &versioned, &soname)?;
        link(dir, &soname, name)?;
    }
    Ok(())
}

/// Makes `dir/name` a symbolic link to `target` (relative), replacing what was there.
pub fn link(dir: &Path, target: &str, name: &str) -> Result<(), String> {
    let path = dir.join(name);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("replace {}: {e}", path.display())),
    }
    std::os::unix::fs::symlink(target, &path).map_err(|e| format!("link {}: {e}", path.display()))
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
    install(&lib_dir, None, &node.description().driver_version)?;
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
