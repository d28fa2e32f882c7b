//! Which NVML library the daemon loads: the real driver by default, the simulated node only with
//! `--sim` (or `sim = true`). Never the simulator on its own: a node with no driver is an error
//! naming the library tried and where the loader looked, so a broken driver install is never
//! mistaken for eight healthy simulated GPUs.

use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;

use super::DiscoveryError;
use crate::config::DRIVER_NVML;

/// Environment variable naming the simulated driver library.
pub const SIM_LIB_ENV: &str = "TESSERA_SIM_LIB";
/// The simulated driver's file name, as cargo builds it (`target/<profile>/`).
pub const SIM_LIB_NAME: &str = "libtessera_sim.so";

/// Why a library was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `nvml_library` in the configuration.
    Configured,
    /// The real driver's default library.
    Driver,
    /// `--sim` or `sim = true`.
    SimRequested,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Configured => "configured nvml_library",
            Source::Driver => "the NVIDIA driver",
            Source::SimRequested => "the simulated node, as asked (--sim or sim = true)",
        })
    }
}

/// The simulated driver library: `$TESSERA_SIM_LIB`, else `libtessera_sim.so` beside the
/// executable (or one directory up, for test binaries in `target/<profile>/deps`).
pub fn sim_library() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(SIM_LIB_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [dir.join(SIM_LIB_NAME), dir.parent()?.join(SIM_LIB_NAME)].into_iter().find(|p| p.exists())
}

fn init(path: &Path) -> Result<Nvml, nvml_wrapper::error::NvmlError> {
    Nvml::builder().lib_path(path.as_os_str()).init()
}

/// Loads NVML for the daemon's life, choosing the library as the module describes; logs which
/// (and why) as its first line. The driver's library is looked for under `driver_root`
/// ([`driver_library`]).
pub fn load(
    configured: Option<&Path>,
    sim: bool,
    driver_root: &Path,
) -> Result<(Nvml, PathBuf, Source), DiscoveryError> {
    load_with(&driver_library(driver_root), configured, sim)
}

/// The driver's NVML: the bare name for the dynamic loader when the driver root is `/`; else
/// the first `libnvidia-ml.so.1` in the driver root's library directories (a daemon in a
/// container sees the host's driver where it is mounted; the loader's own paths are the
/// image's), or the first of them when none has it (the error then names that path).
pub fn driver_library(driver_root: &Path) -> PathBuf {
    if driver_root == Path::new("/") {
        return PathBuf::from(DRIVER_NVML);
    }
    let dirs = tessera_region::driver::DriverConfig::default().library_dirs;
    let candidates: Vec<PathBuf> = dirs.iter().map(|d| driver_root.join(d).join(DRIVER_NVML)).collect();
    candidates.iter().find(|p| p.exists()).unwrap_or(&candidates[0]).clone()
}

/// [`load`], with the driver's library named `driver` (tests name one that is absent).
fn load_with(driver: &Path, configured: Option<&Path>, sim: bool) -> Result<(Nvml, PathBuf, Source), DiscoveryError> {
    let (path, source, nvml) = if sim {
        let p = sim_library().ok_or_else(|| DiscoveryError::NoSimLibrary {
            why: format!("set {SIM_LIB_ENV} or put {SIM_LIB_NAME} beside the executable"),
        })?;
        let nvml = init(&p).map_err(|e| DiscoveryError::Load { path: p.clone(), source: e })?;
        (p, Source::SimRequested, nvml)
    } else if let Some(p) = configured {
        let nvml = init(p).map_err(|e| DiscoveryError::Load { path: p.to_path_buf(), source: e })?;
        (p.to_path_buf(), Source::Configured, nvml)
    } else {
        let nvml = init(driver).map_err(|e| DiscoveryError::NoDriver {
            library: driver.to_path_buf(),
            searched: searched(driver),
            reason: e.to_string(),
        })?;
        (driver.to_path_buf(), Source::Driver, nvml)
    };
    tracing::info!(library = %path.display(), "NVML library: {} ({source})", path.display());
    Ok((nvml, path, source))
}

/// Where the dynamic loader looks for a bare library name, as `ld.so(8)` orders it.
fn searched(library: &Path) -> String {
    if library.is_absolute() {
        return "the library directories of injection.driver_root (usr/lib/x86_64-linux-gnu, usr/lib64, …)".into();
    }
    let env = std::env::var("LD_LIBRARY_PATH").ok().filter(|v| !v.is_empty());
    let env = env.map_or_else(|| "LD_LIBRARY_PATH (unset)".to_string(), |v| format!("LD_LIBRARY_PATH ({v})"));
    format!("{env}, the ld.so cache (/etc/ld.so.cache, see `ldconfig -p`), /lib and /usr/lib")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_an_error_naming_the_library_never_the_simulator() {
        // The simulator is right there (as on a developer's machine): it is still not used.
        let absent = Path::new("libnvidia-ml-absent-for-test.so.1");
        let err = load_with(absent, None, false).map(|(_, p, s)| (p, s)).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, DiscoveryError::NoDriver { .. }), "{text}");
        assert!(text.contains("libnvidia-ml-absent-for-test.so.1"), "{text}");
        assert!(text.contains("LD_LIBRARY_PATH") && text.contains("/etc/ld.so.cache"), "{text}");
        assert!(text.contains("--sim"), "says how to ask for the simulator: {text}");
    }

    #[test]
    fn the_driver_library_is_found_under_a_mounted_driver_root() {
        assert_eq!(driver_library(Path::new("/")), Path::new(DRIVER_NVML));
        let tmp = tempfile::tempdir().unwrap();
        let lib64 = tmp.path().join("usr/lib64");
        std::fs::create_dir_all(&lib64).unwrap();
        // None there yet: the first library directory is named (the error says where).
        assert_eq!(driver_library(tmp.path()), tmp.path().join("usr/lib/x86_64-linux-gnu").join(DRIVER_NVML));
        std::fs::write(lib64.join(DRIVER_NVML), "not really").unwrap();
        assert_eq!(driver_library(tmp.path()), lib64.join(DRIVER_NVML));
        let err = load_with(&driver_library(tmp.path()), None, false).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("usr/lib64/libnvidia-ml.so.1") && err.contains("injection.driver_root"), "{err}");
    }
}
