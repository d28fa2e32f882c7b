//! The host driver's user-space files, found by name under a driver root: no NVML, no dlopen;
//! the control nodes every GPU container needs; and the driver's MIG capability minors
//! ([`MigMinors`]), which give a MIG device its `nvidia-caps` nodes.
//!
//! Libraries (`libcuda.so*`, `libnvidia-*.so*`, …) are looked for in the usual library
//! directories, tools (`nvidia-smi`, …) in the usual binary directories. Each file is mounted into
//! a container at its path relative to the driver root, which on glibc systems is a default search
//! directory of the dynamic loader (see docs/hook.md, "ld cache").

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where to look. `root` and `dev_root` are host paths; the directory lists are relative to `root`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverConfig {
    pub root: PathBuf,
    pub dev_root: PathBuf,
    pub library_dirs: Vec<PathBuf>,
    pub binary_dirs: Vec<PathBuf>,
}

impl Default for DriverConfig {
    fn default() -> DriverConfig {
        DriverConfig {
            root: PathBuf::from("/"),
            dev_root: PathBuf::from("/dev"),
            library_dirs: ["usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib64", "usr/lib"]
                .iter()
                .map(PathBuf::from)
                .collect(),
            binary_dirs: ["usr/bin", "bin"].iter().map(PathBuf::from).collect(),
        }
    }
}

/// What [`discover`] found: host paths, each under the driver root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverFiles {
    /// The driver root the files were found under (their container path is relative to it).
    pub root: PathBuf,
    pub libraries: Vec<PathBuf>,
    pub binaries: Vec<PathBuf>,
}

impl DriverFiles {
    /// Where a found file goes in a container: its path relative to the driver root, made absolute.
    pub fn container_path(&self, host: &Path) -> PathBuf {
        Path::new("/").join(host.strip_prefix(&self.root).unwrap_or(host))
    }
}

/// Library name prefixes of the driver's user-space part.
pub const LIBRARY_PREFIXES: &[&str] = &[
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-opencl.so",
    "libnvidia-cfg.so",
    "libnvidia-allocator.so",
    "libnvidia-gpucomp.so",
    "libnvcuvid.so",
    "libnvidia-encode.so",
    "libnvidia-opticalflow.so",
];

/// The driver's tools.
pub const BINARIES: &[&str] =
    &["nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"];

/// The control nodes every GPU container needs, by name under the device root.
pub const CONTROL_NODES: &[&str] = &["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"];

/// Finds the driver's libraries and tools under `cfg.root`. Missing directories are skipped; the
/// result is sorted so that specs are written the same way every time.
pub fn discover(cfg: &DriverConfig) -> DriverFiles {
    let mut files = DriverFiles { root: cfg.root.clone(), ..DriverFiles::default() };
    for dir in &cfg.library_dirs {
        let Ok(entries) = std::fs::read_dir(cfg.root.join(dir)) else { continue };
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                LIBRARY_PREFIXES.iter().any(|p| name.starts_with(p)) && is_file(&e.path())
            })
            .map(|e| e.path())
            .collect();
        found.sort();
        files.libraries.extend(found);
    }
    for dir in &cfg.binary_dirs {
        for name in BINARIES {
            let p = cfg.root.join(dir).join(name);
            if is_file(&p) && !files.binaries.iter().any(|b| b.file_name() == p.file_name()) {
                files.binaries.push(p);
            }
        }
    }
    // A directory reached twice (usr/lib64 as a link to usr/lib) gives each file once.
    dedup_by_identity(&mut files.libraries);
    files
}

/// The control nodes present under `cfg.dev_root` (absent ones skipped).
pub fn control_nodes(cfg: &DriverConfig) -> Vec<PathBuf> {
    CONTROL_NODES.iter().map(|n| cfg.dev_root.join(n)).filter(|p| p.exists()).collect()
}

/// Where the driver lists the MIG capability minors, under the driver root.
const MIG_MINORS: &str = "proc/driver/nvidia-caps/mig-minors";

/// The driver's MIG capability minors: (GPU minor, GI id, CI id or `None` for the GI's own
/// entry) → the `nvidia-cap<N>` minor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigMinors(BTreeMap<(u32, u32, Option<u32>), u32>);

impl MigMinors {
    /// `<driver_root>/proc/driver/nvidia-caps/mig-minors`; empty when there is none (no MIG,
    /// or a platform without capability device files).
    pub fn read(driver_root: &Path) -> MigMinors {
        std::fs::read_to_string(driver_root.join(MIG_MINORS)).map(|t| MigMinors::parse(&t)).unwrap_or_default()
    }

    /// The table's lines: `gpu0/gi1/access 12`, `gpu0/gi1/ci0/access 13` (others, like
    /// `config 1`, are not per instance).
    pub fn parse(text: &str) -> MigMinors {
        let mut out = BTreeMap::new();
        for line in text.lines() {
            let Some((path, minor)) = line.split_once(' ') else { continue };
            let Ok(minor) = minor.trim().parse() else { continue };
            let parts: Vec<&str> = path.split('/').collect();
            let num = |p: &str, prefix: &str| p.strip_prefix(prefix).and_then(|n| n.parse::<u32>().ok());
            match parts.as_slice() {
                [gpu, gi, "access"] => {
                    if let (Some(g), Some(i)) = (num(gpu, "gpu"), num(gi, "gi")) {
                        out.insert((g, i, None), minor);
                    }
                }
                [gpu, gi, ci, "access"] => {
                    if let (Some(g), Some(i), Some(c)) = (num(gpu, "gpu"), num(gi, "gi"), num(ci, "ci")) {
                        out.insert((g, i, Some(c)), minor);
                    }
                }
                _ => {}
            }
        }
        MigMinors(out)
    }

    /// The capability nodes of one MIG device: its GPU instance's, then its compute instance's.
    pub fn nodes(&self, dev_root: &Path, gpu_minor: u32, gi: u32, ci: u32) -> Vec<PathBuf> {
        [(gpu_minor, gi, None), (gpu_minor, gi, Some(ci))]
            .iter()
            .filter_map(|k| self.0.get(k))
            .map(|cap| dev_root.join(format!("nvidia-caps/nvidia-cap{cap}")))
            .collect()
    }
}

/// A regular file, or a link to one (a versioned library's soname link).
fn is_file(p: &Path) -> bool {
    std::fs::metadata(p).map(|m| m.is_file()).unwrap_or(false)
}

fn dedup_by_identity(paths: &mut Vec<PathBuf>) {
    use std::os::unix::fs::MetadataExt;
    let mut seen = Vec::new();
    paths.retain(|p| {
        let key = std::fs::symlink_metadata(p).map(|m| (m.dev(), m.ino())).ok();
        match key {
            Some(k) if seen.contains(&k) => false,
            Some(k) => {
                seen.push(k);
                true
            }
            None => false,
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_libraries_and_tools_under_a_fake_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let lib = root.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::write(lib.join("libcuda.so.550.54"), b"elf").unwrap();
        std::os::unix::fs::symlink("libcuda.so.550.54", lib.join("libcuda.so.1")).unwrap();
        std::fs::write(lib.join("libnvidia-ml.so.1"), b"elf").unwrap();
        std::fs::write(lib.join("libc.so.6"), b"not ours").unwrap();
        std::os::unix::fs::symlink("missing", lib.join("libnvidia-cfg.so.1")).unwrap();
        std::fs::write(root.join("usr/bin/nvidia-smi"), b"tool").unwrap();
        let cfg = DriverConfig { root: root.into(), ..DriverConfig::default() };
        let f = discover(&cfg);
        let names: Vec<_> = f.libraries.iter().map(|p| p.file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(names, ["libcuda.so.1", "libcuda.so.550.54", "libnvidia-ml.so.1"]);
        assert_eq!(f.binaries, vec![root.join("usr/bin/nvidia-smi")]);
        assert_eq!(f.container_path(&f.binaries[0]), Path::new("/usr/bin/nvidia-smi"));
        assert!(discover(&DriverConfig { root: root.join("nope"), ..cfg }).libraries.is_empty());
    }

    #[test]
    fn mig_minors_table() {
        let t = MigMinors::parse(
            "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu1/gi2/access 30\nbad line\n",
        );
        assert_eq!(t.0.len(), 3);
        let dev = Path::new("/dev");
        assert_eq!(
            t.nodes(dev, 0, 1, 0),
            [PathBuf::from("/dev/nvidia-caps/nvidia-cap12"), PathBuf::from("/dev/nvidia-caps/nvidia-cap13")]
        );
        assert_eq!(t.nodes(dev, 1, 2, 0), [PathBuf::from("/dev/nvidia-caps/nvidia-cap30")]);
        assert!(t.nodes(dev, 3, 1, 0).is_empty());
    }
}
