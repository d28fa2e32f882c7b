//! The driver's files under a driver root (`tessera-sim install --driver-root DIR`) that follow
//! the node's state: the proc tree NVIDIA's kernel module keeps (`proc/driver/nvidia/version`,
//! `gpus/<bus>/information`, `capabilities/.../access`, `nvidia-caps/mig-minors`). A node keeps
//! the list of its driver roots beside its state file (`<state>.driver-roots`), and rewrites
//! their proc trees after every MIG change, as the kernel module updates its own.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::Node;

/// MIG capability minors as the driver numbers them (`nvidia-caps/mig-minors`): config 1,
/// monitor 2, then per GPU (32) per GPU instance (15) the instance's access and its compute
/// instances' (8).
const MIG_GPUS: u32 = 32;
const MIG_GIS: u32 = 15;
const MIG_CIS: u32 = 8;

/// The capability minor of a GPU instance's access file (`ci`: a compute instance's inside it).
pub fn mig_minor(gpu: u32, gi: u32, ci: Option<u32>) -> u32 {
    3 + gpu * MIG_GIS * (1 + MIG_CIS) + gi * (1 + MIG_CIS) + ci.map_or(0, |c| 1 + c)
}

/// The text of `proc/driver/nvidia-caps/mig-minors`: every minor the driver could hand out.
pub fn mig_minors() -> String {
    let mut s = String::from("config 1\nmonitor 2\n");
    for gpu in 0..MIG_GPUS {
        for gi in 0..MIG_GIS {
            writeln!(s, "gpu{gpu}/gi{gi}/access {}", mig_minor(gpu, gi, None)).unwrap();
            for ci in 0..MIG_CIS {
                writeln!(s, "gpu{gpu}/gi{gi}/ci{ci}/access {}", mig_minor(gpu, gi, Some(ci))).unwrap();
            }
        }
    }
    s
}

fn access(minor: u32) -> String {
    // 0444, as the driver creates them by default.
    format!("DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
}

fn write(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

impl Node {
    /// Where the node lists its driver roots.
    fn driver_roots_file(&self) -> PathBuf {
        let mut p = self.state_path().as_os_str().to_owned();
        p.push(".driver-roots");
        PathBuf::from(p)
    }

    /// Adds a driver root whose proc tree follows this node, and writes it.
    pub fn register_driver_root(&self, root: &Path) -> std::io::Result<()> {
        let file = self.driver_roots_file();
        let mut roots: Vec<String> =
            std::fs::read_to_string(&file).unwrap_or_default().lines().map(String::from).collect();
        let root_text = root.to_string_lossy().into_owned();
        if !roots.contains(&root_text) {
            roots.push(root_text);
            write(&file, &(roots.join("\n") + "\n"))?;
        }
        self.write_proc_tree(root)
    }

    /// A guard that rewrites the driver roots' proc trees ([`Node::refresh_driver_roots`]) when
    /// dropped. A MIG change takes it before the node's lock, so the refresh comes after the
    /// lock is released, whatever the change did (not while unwinding from a panic).
    pub(crate) fn refreshing_driver_roots(&self) -> RefreshDriverRoots<'_> {
        RefreshDriverRoots(self)
    }

    /// Rewrites the proc tree of every registered driver root (after a MIG change). A root that
    /// cannot be written is reported on stderr and skipped: the MIG change itself stands.
    pub fn refresh_driver_roots(&self) {
        let Ok(text) = std::fs::read_to_string(self.driver_roots_file()) else { return };
        for root in text.lines().filter(|l| !l.is_empty()) {
            if let Err(e) = self.write_proc_tree(Path::new(root)) {
                eprintln!("tessera-sim: cannot update the proc tree under {root}: {e}");
            }
        }
    }

    /// Writes `root/proc/driver/...` from the node's current state.
    pub fn write_proc_tree(&self, root: &Path) -> std::io::Result<()> {
        let d = self.description();
        let proc = root.join("proc/driver/nvidia");
        write(
            &proc.join("version"),
            &format!(
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {}  (tessera-sim)\nGCC version:  gcc version 12.2.0\n",
                d.driver_version
            ),
        )?;
        write(&root.join("proc/driver/nvidia-caps/mig-minors"), &mig_minors())?;
        let caps = proc.join("capabilities");
        write(&caps.join("mig/config"), &access(1))?;
        write(&caps.join("mig/monitor"), &access(2))?;
        for id in self.gpus() {
            // The kernel module names the directory by the bus id in lower case, domain of 4 digits.
            let bus = id.bus_id.to_lowercase();
            let bus = bus.strip_prefix("0000").unwrap_or(&bus);
            let info = format!(
                "Model: \t\t {}\nIRQ:   \t\t {}\nGPU UUID: \t {}\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {}\nDevice Minor: \t {}\nGPU Firmware: \t {}\nGPU Excluded:\t No\n",
                id.model.name,
                100 + id.index,
                id.uuid,
                bus,
                id.minor,
                d.driver_version
            );
            write(&proc.join("gpus").join(bus).join("information"), &info)?;
            // The MIG capabilities of the instances that exist now.
            let gpu_caps = caps.join(format!("gpu{}", id.minor)).join("mig");
            let _ = std::fs::remove_dir_all(&gpu_caps);
            let gis = self.gpu_instances(id.index).unwrap_or_default();
            let cis = self.compute_instances(id.index, None).unwrap_or_default();
            for gi in &gis {
                let dir = gpu_caps.join(format!("gi{}", gi.id));
                write(&dir.join("access"), &access(mig_minor(id.minor, gi.id, None)))?;
                for ci in cis.iter().filter(|c| c.gi_id == gi.id) {
                    write(&dir.join(format!("ci{}/access", ci.id)), &access(mig_minor(id.minor, gi.id, Some(ci.id))))?;
                }
            }
        }
        Ok(())
    }
}

/// See [`Node::refreshing_driver_roots`].
pub(crate) struct RefreshDriverRoots<'a>(&'a Node);

impl Drop for RefreshDriverRoots<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.0.refresh_driver_roots();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minors_follow_the_drivers_numbering() {
        assert_eq!(mig_minor(0, 0, None), 3);
        assert_eq!(mig_minor(0, 0, Some(0)), 4);
        assert_eq!(mig_minor(0, 1, None), 12);
        assert_eq!(mig_minor(1, 0, None), 3 + 135);
        let text = mig_minors();
        assert!(text.starts_with("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n"));
        assert!(text.contains("gpu1/gi2/ci3/access 160\n"), "3 + 135 + 18 + 4");
        assert_eq!(text.lines().count(), 2 + 32 * 15 * 9);
    }
}
