//! The runtime wrapper (`tessera-runtime`), for containerd 1.6 and plain runc: on `create` (and
//! `run`) it edits the bundle's config.json — device nodes, device-cgroup rules, bind mounts,
//! environment — then execs the real runtime with the original argv. Every other subcommand passes
//! straight through. Path safety inside the root is then the runtime's own (runc resolves mount
//! targets inside the root); the wrapper itself only writes the bundle's config.json.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::oci;
use crate::plan::{self, InjectError};
use tessera_region::hook_config::HookConfig;

/// runc's global options that take a value.
const VALUE_OPTIONS: &[&str] = &["--root", "--log", "--log-format", "--criu", "--rootless"];

/// The subcommand's index in `args` (args[0] is the program), skipping global options.
pub fn subcommand(args: &[OsString]) -> Option<usize> {
    let mut i = 1;
    while i < args.len() {
        let a = args[i].to_string_lossy();
        if a == "--" {
            return (i + 1 < args.len()).then_some(i + 1);
        }
        if a.starts_with('-') {
            if VALUE_OPTIONS.contains(&a.as_ref()) {
                i += 1;
            }
            i += 1;
            continue;
        }
        return Some(i);
    }
    None
}

/// The bundle a `create`/`run` names: `--bundle X`, `--bundle=X`, `-b X`, `-b=X`, else the cwd.
pub fn bundle(args: &[OsString], sub: usize) -> Option<PathBuf> {
    let mut i = sub + 1;
    while i < args.len() {
        let a = args[i].to_string_lossy();
        for flag in ["--bundle", "-b"] {
            if a == flag {
                return args.get(i + 1).map(PathBuf::from);
            }
            if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
                return Some(PathBuf::from(v));
            }
        }
        i += 1;
    }
    std::env::current_dir().ok()
}

/// The `--log` file and its format, where runc's caller reads errors from.
pub fn log_target(args: &[OsString], sub: usize) -> Option<(PathBuf, bool)> {
    let mut log = None;
    let mut json = false;
    let mut i = 1;
    while i < sub {
        let a = args[i].to_string_lossy();
        let next = || args.get(i + 1).map(|s| s.to_string_lossy().into_owned());
        if a == "--log" {
            log = next().map(PathBuf::from);
        } else if let Some(v) = a.strip_prefix("--log=") {
            log = Some(v.into());
        } else if a == "--log-format" {
            json = next().as_deref() == Some("json");
        } else if a == "--log-format=json" {
            json = true;
        }
        i += 1;
    }
    log.map(|l| (l, json))
}

/// Edits the bundle for a create; `Ok(false)`: the container asks for nothing of ours.
pub fn edit_bundle(cfg: &HookConfig, bundle: &Path, container_id: Option<&str>) -> Result<bool, InjectError> {
    edit_bundle_for(cfg, bundle, container_id, None)
}

/// [`edit_bundle`], knowing where the runtime keeps the container's state (`runtime_state`,
/// recorded in the owner record). A container whose allocation is leased to it (`--lease
/// container`: [`tessera_region::owner::LEASE_FILE`]) also gets a `poststop` hook (`tessera-hook
/// poststop`, beside this program) telling the daemon when it is deleted.
pub fn edit_bundle_for(
    cfg: &HookConfig,
    bundle: &Path,
    container_id: Option<&str>,
    runtime_state: Option<&Path>,
) -> Result<bool, InjectError> {
    let mut config = oci::read_config(bundle)?;
    let info = oci::container_info(&config, &Default::default())?;
    if !plan::may_ask(&info) {
        return Ok(false);
    }
    let Some(mut plan) = plan::plan_from_spec_dirs(cfg, &info)? else { return Ok(false) };
    let rootfs = oci::root_path(&config, bundle)?;
    check_targets(&rootfs, &plan)?;
    make_links(&rootfs, &mut plan)?;
    oci::apply_to_config(&mut config, &plan)?;
    if let Some(dir) =
        plan.allocation.as_ref().map(|id| cfg.runtime_dir.join(tessera_region::paths::ALLOC_SUBDIR).join(id))
        && tessera_region::owner::is_leased(&dir)
        && let Some(hook) = std::env::current_exe().ok().and_then(|p| Some(p.parent()?.join("tessera-hook")))
        && hook.is_file()
    {
        oci::add_poststop(&mut config, &hook, &dir)?;
    }
    plan::ensure_files(&plan)?;
    oci::write_config(bundle, &config)?;
    let gone_when = crate::apply::Vanish { runtime_state: runtime_state.map(Path::to_path_buf), cgroup: None };
    crate::apply::record_owner(cfg, &plan, container_id, &info.annotations, gone_when);
    Ok(true)
}

/// Where runc keeps container `id`'s state: `<--root>/<id>`, runc's default root being
/// `/run/runc`; `None` for another runtime without `--root` (its default is its own).
pub fn runtime_state(args: &[OsString], sub: usize, runtime: &str, id: &str) -> Option<PathBuf> {
    let mut root = None;
    let mut i = 1;
    while i < sub {
        let a = args[i].to_string_lossy();
        if a == "--root" {
            root = args.get(i + 1).map(PathBuf::from);
            i += 1;
        } else if let Some(v) = a.strip_prefix("--root=") {
            root = Some(PathBuf::from(v));
        }
        i += 1;
    }
    let is_runc = Path::new(runtime).file_name().is_some_and(|n| n == "runc");
    root.or_else(|| is_runc.then(|| PathBuf::from("/run/runc"))).map(|r| r.join(id))
}

/// Refuses a root file system where a path the runtime will create or mount on passes through a
/// symbolic link: the runtime, not the wrapper, acts on these paths, and some runtimes (runc
/// 1.1.5 creating /dev entries) follow such links on the host. One exception: a file mount (a
/// driver library) whose own last component is a link (an image's stale
/// `libcuda.so.1 -> libcuda.so.535.104.05`) gets the link replaced by an empty file, inside the
/// root and never through the link ([`crate::safe::Root::file`]), for the runtime to mount on.
pub fn check_targets(rootfs: &Path, plan: &plan::Plan) -> Result<(), InjectError> {
    let root = crate::safe::Root::open(rootfs)
        .map_err(|e| InjectError(format!("config.json: root.path: {}: {e}", rootfs.display())))?;
    // Worked out once: each `is_dir` is a stat of a host path.
    let file_mounts: Vec<&PathBuf> =
        plan.mounts.iter().filter(|m| !m.host_path.is_dir()).map(|m| &m.container_path).collect();
    let targets = plan.device_nodes.iter().map(|n| &n.path).chain(plan.mounts.iter().map(|m| &m.container_path));
    // The targets share a few parent directories: each is walked once.
    let mut walked = crate::safe::DirCache::default();
    for t in targets {
        match root.first_symlink_cached(t, &mut walked) {
            Ok(None) => {}
            Ok(Some(link)) if link == crate::safe::absolute(t) && file_mounts.contains(&t) => {
                root.file(t).map_err(|e| InjectError(format!("root file system: {}: {e}", t.display())))?;
            }
            Ok(Some(link)) => {
                return Err(InjectError(format!(
                    "root file system: {} is a symbolic link; refusing to put {} through it",
                    link.display(),
                    t.display()
                )));
            }
            Err(e) => return Err(InjectError(format!("root file system: {}: {e}", t.display()))),
        }
    }
    Ok(())
}

/// Makes the plan's driver-file links in the root file system (the runtime has no way to: it
/// only mounts), inside the root and never through a link ([`crate::safe::Root::link_cached`]):
/// the wrapper acts on these paths itself, so [`check_targets`] need not refuse them.
/// Where the image has a regular file, the driver's file is mounted over it instead (a mount for
/// the runtime to make). A link outlives the container only where the root is a plain directory
/// shared by containers; it is the same link for the next.
pub fn make_links(rootfs: &Path, plan: &mut plan::Plan) -> Result<(), InjectError> {
    if plan.links.is_empty() {
        return Ok(());
    }
    let root = crate::safe::Root::open(rootfs)
        .map_err(|e| InjectError(format!("config.json: root.path: {}: {e}", rootfs.display())))?;
    let mut dirs = crate::safe::DirCache::default();
    for l in &plan.links {
        let made = root
            .link_cached(&l.path, &l.target, &mut dirs)
            .map_err(|e| InjectError(format!("root file system: {}: {e}", l.path.display())))?;
        if made == crate::safe::LinkOutcome::Occupied {
            plan.mounts.push(plan::MountEdit {
                host_path: l.host_path.clone(),
                container_path: l.path.clone(),
                read_only: true,
            });
        }
    }
    Ok(())
}

/// The real runtime: a path, or a name on PATH that is not this program itself.
pub fn real_runtime(cfg: &HookConfig) -> Result<PathBuf, InjectError> {
    if cfg.runtime.contains('/') {
        return Ok(PathBuf::from(&cfg.runtime));
    }
    let me = std::env::current_exe().and_then(|p| p.canonicalize()).ok();
    let path = std::env::var_os("PATH")
        .unwrap_or_else(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    for dir in std::env::split_paths(&path) {
        let p = dir.join(&cfg.runtime);
        if p.is_file() && p.canonicalize().ok() != me {
            return Ok(p);
        }
    }
    Err(InjectError(format!("runtime: {:?} is not on PATH", cfg.runtime)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<OsString> {
        s.split_whitespace().map(OsString::from).collect()
    }

    #[test]
    fn runtime_state_from_root() {
        let a = args("tessera-runtime --log x --root /run/containerd/runc/k8s.io create --bundle b c1");
        let sub = subcommand(&a).unwrap();
        assert_eq!(runtime_state(&a, sub, "runc", "c1"), Some(PathBuf::from("/run/containerd/runc/k8s.io/c1")));
        let a = args("tessera-runtime run c2");
        assert_eq!(runtime_state(&a, 1, "/usr/bin/runc", "c2"), Some(PathBuf::from("/run/runc/c2")));
        assert_eq!(runtime_state(&a, 1, "crun", "c2"), None);
    }

    #[test]
    fn finds_subcommand_and_bundle_like_runc_does() {
        let a = args("runc --root /r --log /l.json --log-format json --systemd-cgroup create --bundle /b c1");
        let s = subcommand(&a).unwrap();
        assert_eq!(a[s], "create");
        assert_eq!(bundle(&a, s).unwrap(), Path::new("/b"));
        assert_eq!(log_target(&a, s).unwrap(), (PathBuf::from("/l.json"), true));
        let a = args("runc create -b=/x c1");
        assert_eq!(bundle(&a, subcommand(&a).unwrap()).unwrap(), Path::new("/x"));
        let a = args("runc --debug run --bundle=/y c1");
        assert_eq!(bundle(&a, subcommand(&a).unwrap()).unwrap(), Path::new("/y"));
        let a = args("runc create c1");
        assert_eq!(bundle(&a, 1).unwrap(), std::env::current_dir().unwrap());
        assert_eq!(subcommand(&args("runc --root /r")), None);
        let a = args("runc --root=/r state c1");
        assert_eq!(a[subcommand(&a).unwrap()], "state");
    }
}
