//! `tessera-sim install --driver-root DIR`: what a real driver installs that tools look for,
//! under DIR as under `/` on a real node, so that tesserad, the hook and NVIDIA's tools (the CDI
//! generator, the device plugin) can be pointed at it:
//! - `usr/lib/x86_64-linux-gnu/`: libcuda.so.<version> and libnvidia-ml.so.<version> (the sim,
//!   with their real SONAMEs) and their links, and small loadable stubs under the names of the
//!   other libraries the container toolkit injects;
//! - `usr/bin/nvidia-smi`: this program, answering as nvidia-smi over the node;
//! - `proc/driver/...`: the kernel module's proc tree, kept current after MIG changes
//!   (see `tessera_sim_model::driver_root`);
//! - `dev/`: nvidia0..N, nvidiactl, nvidia-uvm(-tools), nvidia-modeset and the MIG capability
//!   devices under nvidia-caps: character devices with the driver's numbers when run as root,
//!   else empty regular files (tools that only look for the paths are satisfied; tools that
//!   open them as devices need root).

use std::path::{Path, PathBuf};

use tessera_sim_model::Node;
use tessera_sim_model::driver_root::mig_minor;

use crate::install::{install, link};

pub const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";
const STUB: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libstub.so"));
/// The libraries of a driver the NVIDIA container toolkit injects besides libcuda and libnvidia-ml.
pub const STUB_LIBRARIES: [&str; 8] = [
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-cfg.so",
    "libnvidia-opencl.so",
    "libnvidia-allocator.so",
    "libnvidia-gpucomp.so",
    "libcudadebugger.so",
    "libnvidia-pkcs11-openssl3.so",
];

/// The driver's character-device majors: 195 for nvidia*, and (dynamic on a real node) the
/// numbers a typical node shows for nvidia-uvm and nvidia-caps.
const NVIDIA_MAJOR: u32 = 195;
const UVM_MAJOR: u32 = 510;
const CAPS_MAJOR: u32 = 511;

fn err(what: &str, p: &Path, e: impl std::fmt::Display) -> String {
    format!("{what} {}: {e}", p.display())
}

pub fn install_root(node: &Node, root: &Path, lib: Option<&Path>) -> Result<(), String> {
    let version = node.description().driver_version.clone();
    let lib_dir = root.join(LIB_DIR);
    install(&lib_dir, lib, &version)?;
    for name in STUB_LIBRARIES {
        let soname = format!("{name}.1");
        let mut copy = STUB.to_vec();
        crate::soname::set(&mut copy, &soname).map_err(|e| format!("stub library: {e}"))?;
        let path = lib_dir.join(format!("{name}.{version}"));
        std::fs::write(&path, copy).map_err(|e| err("write", &path, e))?;
        link(&lib_dir, &format!("{name}.{version}"), &soname)?;
    }
    install_nvidia_smi(node, root)?;
    node.register_driver_root(root).map_err(|e| err("write the proc tree under", root, e))?;
    make_devices(node, &root.join("dev"))
}

/// Copies this program as `usr/bin/nvidia-smi`, with the node it answers for beside it.
fn install_nvidia_smi(node: &Node, root: &Path) -> Result<(), String> {
    let bin = root.join("usr/bin");
    std::fs::create_dir_all(&bin).map_err(|e| err("create", &bin, e))?;
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let target = bin.join("nvidia-smi");
    let tmp = bin.join(format!(".nvidia-smi.{}", std::process::id()));
    std::fs::copy(&exe, &tmp).map_err(|e| err("copy to", &tmp, e))?;
    std::fs::rename(&tmp, &target).map_err(|e| err("rename into", &target, e))?;
    let mut env = format!("{}={}\n", tessera_sim_model::ENV_STATE, node.state_path().display());
    if let Some(d) = std::env::var_os(tessera_sim_model::ENV_NODE) {
        env.push_str(&format!("{}={}\n", tessera_sim_model::ENV_NODE, PathBuf::from(d).display()));
    }
    let file = bin.join(crate::nvidia_smi::NODE_FILE);
    std::fs::write(&file, env).map_err(|e| err("write", &file, e))
}

fn make_devices(node: &Node, dev: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dev.join("nvidia-caps")).map_err(|e| err("create", dev, e))?;
    let mut nodes: Vec<(PathBuf, u32, u32)> = vec![
        (dev.join("nvidiactl"), NVIDIA_MAJOR, 255),
        (dev.join("nvidia-modeset"), NVIDIA_MAJOR, 254),
        (dev.join("nvidia-uvm"), UVM_MAJOR, 0),
        (dev.join("nvidia-uvm-tools"), UVM_MAJOR, 1),
        (dev.join("nvidia-caps/nvidia-cap1"), CAPS_MAJOR, 1),
        (dev.join("nvidia-caps/nvidia-cap2"), CAPS_MAJOR, 2),
    ];
    for id in node.gpus() {
        nodes.push((dev.join(format!("nvidia{}", id.minor)), NVIDIA_MAJOR, id.minor));
        for ci in node.compute_instances(id.index, None).unwrap_or_default() {
            for minor in [mig_minor(id.minor, ci.gi_id, None), mig_minor(id.minor, ci.gi_id, Some(ci.id))] {
                nodes.push((dev.join(format!("nvidia-caps/nvidia-cap{minor}")), CAPS_MAJOR, minor));
            }
        }
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    for (path, major, minor) in nodes {
        let _ = std::fs::remove_file(&path);
        if root {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| err("path", &path, e))?;
            // SAFETY: c is a NUL-terminated path; mknod creates one device node or fails.
            let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(major, minor)) };
            if rc != 0 {
                return Err(err("mknod", &path, std::io::Error::last_os_error()));
            }
            // As the driver makes them: readable and writable by all (mknod's mode obeys the umask).
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o666))
                .map_err(|e| err("chmod", &path, e))?;
        } else {
            std::fs::write(&path, b"").map_err(|e| err("create", &path, e))?;
        }
    }
    Ok(())
}
