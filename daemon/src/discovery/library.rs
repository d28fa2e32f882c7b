//! Which NVML library the daemon loads: the real driver by default, the simulated node with
//! `--sim` (or `sim = true`), or when no driver can be loaded and no library was configured.

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
    /// No driver could be loaded, so the simulated node.
    SimFallback,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Configured => "configured nvml_library",
            Source::Driver => "the NVIDIA driver",
            Source::SimRequested => "the simulated node, as asked (--sim)",
            Source::SimFallback => "the simulated node: no NVIDIA driver could be loaded",
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
/// (and why) as its first line.
pub fn load(configured: Option<&Path>, sim: bool) -> Result<(Nvml, PathBuf, Source), DiscoveryError> {
    let sim_path = || {
        sim_library().ok_or_else(|| DiscoveryError::NoSimLibrary {
            why: format!("set {SIM_LIB_ENV} or put {SIM_LIB_NAME} beside the executable"),
        })
    };
    let (path, source, nvml) = if sim {
        let p = sim_path()?;
        let nvml = init(&p).map_err(|e| DiscoveryError::Load { path: p.clone(), source: e })?;
        (p, Source::SimRequested, nvml)
    } else if let Some(p) = configured {
        let nvml = init(p).map_err(|e| DiscoveryError::Load { path: p.to_path_buf(), source: e })?;
        (p.to_path_buf(), Source::Configured, nvml)
    } else {
        let driver = PathBuf::from(DRIVER_NVML);
        match init(&driver) {
            Ok(nvml) => (driver, Source::Driver, nvml),
            Err(driver_err) => {
                let p = sim_path().map_err(|_| DiscoveryError::Load { path: driver.clone(), source: driver_err })?;
                let nvml = init(&p).map_err(|e| DiscoveryError::Load { path: p.clone(), source: e })?;
                (p, Source::SimFallback, nvml)
            }
        }
    };
    tracing::info!(library = %path.display(), "NVML library: {} ({source})", path.display());
    Ok((nvml, path, source))
}
