//! The OCI hook's way of applying a plan (createRuntime, or prestart on older runtimes): the
//! container's mount namespace exists and its root file system is mounted, the process has not
//! started. Everything is prepared in the host's namespace first (detached bind mounts made with
//! `open_tree`, made read-only with `mount_setattr` before they are visible anywhere, the device
//! cgroup's `devices.allow` opened); then the hook joins the container's mount namespace, resolves
//! every target inside the root ([`crate::safe::Root`]) and attaches the mounts onto the resolved
//! descriptors. Nothing from the container's root is executed, and the hook's own environment is
//! never the container's.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::oci;
use crate::plan::{self, InjectError, Plan};
use crate::safe::{LinkOutcome, NodeOutcome, Root};
use crate::sys;
use tessera_region::hook_config::HookConfig;

/// What the hook did, for its log line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub devices: usize,
    pub mounts: usize,
    /// Driver files linked into the driver directory's mount.
    pub links: usize,
    pub skipped: usize,
}

/// The whole hook: state on stdin → config.json → plan → apply. `Ok(None)`: nothing asked.
/// `links`: the hook entry's own `--link` paths (a CDI runtime's; the spec's entry names the same).
pub fn run_hook(cfg: &HookConfig, state: &[u8], links: &[PathBuf]) -> Result<Option<Applied>, InjectError> {
    let state = oci::parse_state(state)?;
    let config = oci::read_config(&state.bundle)?;
    let info = oci::container_info(&config, &state.annotations)?;
    let root = oci::root_path(&config, &state.bundle)?;
    if !plan::may_ask(&info) {
        return Ok(None);
    }
    let Some(mut plan) = plan::plan_from_spec_dirs(cfg, &info)? else { return Ok(None) };
    for l in links {
        plan::add_link(&mut plan, l.clone())?;
    }
    // Nodes the runtime already made and admitted (CDI puts them in config.json) need nothing
    // from the hook; only the others need the device cgroup, which cgroup v2 does not offer.
    plan.device_nodes.retain(|n| !oci::grants_device(&config, n));
    let prepared = prepare(&plan, state.pid)?;
    let applied = apply(prepared, &plan, &root)?;
    // What tells the daemon this container is gone when no poststop hook runs for it (CDI): the
    // runtime's state directory, else its cgroup.
    let gone_when = Vanish { runtime_state: caller_runtime_state(&state.id), cgroup: container_cgroup(state.pid) };
    record_owner(cfg, &plan, Some(&state.id), &info.annotations, gone_when);
    Ok(Some(applied))
}

/// What disappears when the container is deleted, as far as the hook or the wrapper can tell.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Vanish {
    pub runtime_state: Option<PathBuf>,
    pub cgroup: Option<PathBuf>,
}

/// Leaves the owner record in the allocation's directory (reporting only: errors are ignored).
pub(crate) fn record_owner(
    cfg: &HookConfig,
    plan: &Plan,
    container_id: Option<&str>,
    annotations: &std::collections::BTreeMap<String, String>,
    gone_when: Vanish,
) {
    if let Some(id) = &plan.allocation {
        let dir = cfg.runtime_dir.join(tessera_region::paths::ALLOC_SUBDIR).join(id);
        let owner = tessera_region::owner::Owner {
            container: tessera_region::owner::ContainerIdentity::from_annotations(container_id, annotations),
            runtime_state: gone_when.runtime_state.map(|p| p.display().to_string()),
            cgroup: gone_when.cgroup.map(|p| p.display().to_string()),
        };
        let _ = owner.write(&dir);
    }
}

/// The state directory of container `id` kept by the runtime that runs this hook (its parent:
/// `runc create`, `runc run`; the root from its `--root`, runc's default otherwise). Only a
/// directory that exists now is named: a wrong guess must never look like a deleted container.
pub fn caller_runtime_state(id: &str) -> Option<PathBuf> {
    if id.is_empty() || id.contains('/') || id == "." || id == ".." {
        return None;
    }
    let cmdline = sys::read_proc(Path::new(&format!("/proc/{}/cmdline", std::os::unix::process::parent_id()))).ok()?;
    let state = runtime_state_of(&cmdline, id)?;
    state.is_dir().then_some(state)
}

/// [`caller_runtime_state`] from the runtime's NUL-separated command line.
fn runtime_state_of(cmdline: &[u8], id: &str) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    let args: Vec<std::ffi::OsString> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| std::ffi::OsString::from_vec(a.to_vec()))
        .collect();
    let sub = crate::wrapper::subcommand(&args)?;
    let runtime = args.first()?.to_string_lossy().into_owned();
    crate::wrapper::runtime_state(&args, sub, &runtime, id)
}

/// The cgroup directory of process `pid` (cgroup v2's unified path, else the v1 `pids` or
/// `memory` hierarchy's), when it exists.
pub fn container_cgroup(pid: i32) -> Option<PathBuf> {
    let text = sys::read_proc_text(Path::new(&format!("/proc/{pid}/cgroup"))).ok()?;
    cgroup_dir(&text, Path::new("/sys/fs/cgroup")).filter(|p| p.is_dir())
}

/// The directory under `root` that `/proc/<pid>/cgroup` text names (v2 when `root` is the
/// unified hierarchy, else the first of v1's `pids`, `memory`).
fn cgroup_dir(text: &str, root: &Path) -> Option<PathBuf> {
    let entries: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            Some((ctrls, path))
        })
        .collect();
    let under = |base: PathBuf, path: &str| -> Option<PathBuf> {
        let rel = path.trim_start_matches('/');
        // The root cgroup is no container's; a path with ".." is no one's.
        (!rel.is_empty() && !rel.split('/').any(|c| c == "..")).then(|| base.join(rel))
    };
    if root.join("cgroup.controllers").exists() {
        return entries.iter().find(|(c, _)| c.is_empty()).and_then(|(_, p)| under(root.to_path_buf(), p));
    }
    ["pids", "memory"].iter().find_map(|want| {
        let (_, p) = entries.iter().find(|(c, _)| c.split(',').any(|c| c == *want))?;
        under(root.join(want), p)
    })
}

struct Prepared {
    /// The hook's own mount namespace, to clone a host device node from when `mknod` is refused.
    host_ns: OwnedFd,
    ns: OwnedFd,
    allow: Option<std::fs::File>,
    mounts: Vec<(OwnedFd, bool)>,
}

fn host_err(what: &Path, e: impl std::fmt::Display) -> InjectError {
    InjectError(format!("{}: {e}", what.display()))
}

/// Host-side preparation; an error here leaves the container untouched.
fn prepare(plan: &Plan, pid: i32) -> Result<Prepared, InjectError> {
    plan::ensure_files(plan)?;
    let ns_path = PathBuf::from(format!("/proc/{pid}/ns/mnt"));
    let ns = std::fs::File::open(&ns_path).map_err(|e| host_err(&ns_path, e))?.into();
    let own = Path::new("/proc/self/ns/mnt");
    let host_ns = std::fs::File::open(own).map_err(|e| host_err(own, e))?.into();
    let allow = if plan.device_nodes.is_empty() { None } else { Some(device_cgroup(pid)?) };
    // Device nodes are made with mknod; a host node is cloned as a bind mount only where mknod
    // is refused (a user namespace), then. Cloning each up front cost a detached mount per node
    // that, unused, the kernel dissolves at close after an RCU grace period: milliseconds of
    // wall time per start. A missing host node is still an error before anything changes.
    for n in &plan.device_nodes {
        std::fs::metadata(&n.host_path).map_err(|e| host_err(&n.host_path, e))?;
    }
    let mut mounts = Vec::new();
    for m in &plan.mounts {
        let meta = std::fs::metadata(&m.host_path).map_err(|e| host_err(&m.host_path, e))?;
        let c = sys::cstr(m.host_path.as_os_str()).map_err(|e| host_err(&m.host_path, e))?;
        let tree = sys::open_tree_clone(&c, false).map_err(|e| host_err(&m.host_path, format!("open_tree: {e}")))?;
        let mut attrs = sys::MOUNT_ATTR_NOSUID | sys::MOUNT_ATTR_NODEV;
        if m.read_only {
            attrs |= sys::MOUNT_ATTR_RDONLY;
        }
        sys::mount_setattr(tree.as_fd(), attrs).map_err(|e| host_err(&m.host_path, format!("mount_setattr: {e}")))?;
        mounts.push((tree, meta.is_dir()));
    }
    Ok(Prepared { host_ns, ns, allow, mounts })
}

/// The container's cgroup v1 `devices.allow`, opened for writing. cgroup v2 has no such file: a
/// hook cannot extend its eBPF device filter, so the start is refused with a pointer to CDI or
/// the runtime wrapper, which put the rules in config.json before the runtime builds the filter.
fn device_cgroup(pid: i32) -> Result<std::fs::File, InjectError> {
    let cg = PathBuf::from(format!("/proc/{pid}/cgroup"));
    let text = sys::read_proc_text(&cg).map_err(|e| host_err(&cg, e))?;
    let rel = text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        ctrls.split(',').any(|c| c == "devices").then(|| path.to_string())
    });
    let Some(rel) = rel else {
        return Err(InjectError(
            "cgroup v2: a hook cannot admit devices to the container's device filter; use the CDI spec or tessera-runtime"
                .into(),
        ));
    };
    if rel.split('/').any(|c| c == "..") {
        return Err(InjectError(format!("{}: devices path {rel:?} has \"..\"", cg.display())));
    }
    // The usual place first (a statfs, not a read of the mount table, which costs milliseconds
    // on a node with many containers); else wherever the mount table says.
    let usual = Path::new("/sys/fs/cgroup/devices");
    let mountpoint = if is_cgroup_v1_devices(usual) {
        usual.to_string_lossy().into_owned()
    } else {
        let mounts =
            std::fs::read_to_string("/proc/self/mounts").map_err(|e| host_err(Path::new("/proc/self/mounts"), e))?;
        mounts
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f.len() > 3 && f[2] == "cgroup" && f[3].split(',').any(|o| o == "devices")).then(|| f[1].to_string())
            })
            .next()
            .ok_or_else(|| InjectError("cgroup v1 devices controller is not mounted".into()))?
    };
    let allow = Path::new(&mountpoint).join(rel.trim_start_matches('/')).join("devices.allow");
    std::fs::OpenOptions::new().write(true).open(&allow).map_err(|e| host_err(&allow, e))
}

/// A cgroup v1 mount whose root has `devices.allow`.
fn is_cgroup_v1_devices(dir: &Path) -> bool {
    const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;
    let Ok(c) = sys::cstr(dir.as_os_str()) else { return false };
    // SAFETY: an all-zero statfs is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated, `st` writable, both outlive the call.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == CGROUP_SUPER_MAGIC && dir.join("devices.allow").exists()
}

/// A detached bind mount of a host file (a device node, a driver file), made from the container's
/// mount namespace: back to the hook's own namespace for the `open_tree` (a path, and a clone, of
/// the host), then into the container's again, where the tree is attached. `root`'s descriptors
/// stay valid across. `read_only`: made read-only (and nosuid, nodev) before it is attached.
fn clone_host_file(p: &Prepared, host_path: &Path, read_only: bool) -> Result<OwnedFd, InjectError> {
    let c = sys::cstr(host_path.as_os_str()).map_err(|e| host_err(host_path, e))?;
    sys::setns_mnt(p.host_ns.as_fd())
        .map_err(|e| InjectError(format!("setns back into the host's mount namespace: {e}")))?;
    let tree = sys::open_tree_clone(&c, false).map_err(|e| host_err(host_path, e));
    sys::setns_mnt(p.ns.as_fd())
        .map_err(|e| InjectError(format!("setns into the container's mount namespace: {e}")))?;
    let tree = tree?;
    if read_only {
        let attrs = sys::MOUNT_ATTR_RDONLY | sys::MOUNT_ATTR_NOSUID | sys::MOUNT_ATTR_NODEV;
        sys::mount_setattr(tree.as_fd(), attrs).map_err(|e| host_err(host_path, format!("mount_setattr: {e}")))?;
    }
    Ok(tree)
}

fn apply(p: Prepared, plan: &Plan, root: &Path) -> Result<Applied, InjectError> {
    let mut done = Applied::default();
    if let Some(mut allow) = p.allow.as_ref() {
        for n in &plan.device_nodes {
            // One rule per write: the kernel parses each write as one rule.
            allow
                .write_all(format!("c {}:{} rwm", n.major, n.minor).as_bytes())
                .map_err(|e| InjectError(format!("devices.allow: c {}:{} rwm: {e}", n.major, n.minor)))?;
        }
    }
    sys::setns_mnt(p.ns.as_fd())
        .map_err(|e| InjectError(format!("setns into the container's mount namespace: {e}")))?;
    let root = Root::open(root).map_err(|e| host_err(root, e))?;
    let cerr = |path: &Path, e: std::io::Error| InjectError(format!("container {}: {e}", path.display()));
    // The directories resolved so far (the nodes share `/dev`, the libraries theirs).
    let mut dirs = crate::safe::DirCache::default();
    for n in &plan.device_nodes {
        match root.mknod_cached(&n.path, n.major, n.minor, &mut dirs) {
            Ok(NodeOutcome::Created) => done.devices += 1,
            Ok(NodeOutcome::Existing) => done.skipped += 1,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                // A user namespace: bind the host's node instead (on a file: the cached
                // directories stay as they were).
                let tree = clone_host_file(&p, &n.host_path, false)?;
                let (target, _) = root.file_cached(&n.path, &mut dirs).map_err(|e| cerr(&n.path, e))?;
                sys::move_mount(tree.as_fd(), target.as_fd()).map_err(|e| cerr(&n.path, e))?;
                done.devices += 1;
            }
            Err(e) => return Err(cerr(&n.path, e)),
        }
    }
    for (m, (tree, is_dir)) in plan.mounts.iter().zip(&p.mounts) {
        // A mount made on a directory hides what was cached under it: start afresh after one.
        let target = if *is_dir {
            dirs = crate::safe::DirCache::default();
            root.dir(&m.container_path)
        } else {
            root.file_cached(&m.container_path, &mut dirs)
        };
        let (target, found) = target.map_err(|e| cerr(&m.container_path, e))?;
        // Already there (a CDI runtime mounted it, or a second hook entry ran): same file, same
        // read-only state.
        if crate::safe::same_file(&found, tree.as_fd()) && sys::read_only(target.as_fd()) == Some(m.read_only) {
            done.skipped += 1;
            continue;
        }
        sys::move_mount(tree.as_fd(), target.as_fd()).map_err(|e| cerr(&m.container_path, e))?;
        done.mounts += 1;
    }
    // After the mounts (a link made before a directory mount over its parent would be hidden);
    // `dirs` is still good: it was started afresh after each directory mount.
    for l in &plan.links {
        match root.link_cached(&l.path, &l.target, &mut dirs).map_err(|e| cerr(&l.path, e))? {
            LinkOutcome::Created => done.links += 1,
            LinkOutcome::Existing => done.skipped += 1,
            LinkOutcome::Occupied => {
                // The image's own file stays in its layer; the driver's is mounted over it.
                let tree = clone_host_file(&p, &l.host_path, true)?;
                let (target, found) = root.file_cached(&l.path, &mut dirs).map_err(|e| cerr(&l.path, e))?;
                if !crate::safe::same_file(&found, tree.as_fd()) {
                    sys::move_mount(tree.as_fd(), target.as_fd()).map_err(|e| cerr(&l.path, e))?;
                    done.mounts += 1;
                }
            }
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_callers_state_directory_from_its_command_line() {
        let podman = b"runc\0--root\0/run/runc\0--systemd-cgroup\0create\0--bundle\0/b\0c1\0";
        assert_eq!(runtime_state_of(podman, "c1"), Some(PathBuf::from("/run/runc/c1")));
        let containerd = b"/usr/bin/runc\0--root=/run/containerd/runc/default\0create\0c2\0";
        assert_eq!(runtime_state_of(containerd, "c2"), Some(PathBuf::from("/run/containerd/runc/default/c2")));
        assert_eq!(runtime_state_of(b"runc\0run\0c3\0", "c3"), Some(PathBuf::from("/run/runc/c3")));
        // Another runtime without --root: not guessed.
        assert_eq!(runtime_state_of(b"crun\0create\0c4\0", "c4"), None);
        assert_eq!(runtime_state_of(b"", "c5"), None);
        // An id that would leave the root is never used.
        assert_eq!(caller_runtime_state("../etc"), None);
    }

    #[test]
    fn the_container_cgroup_v1_and_v2() {
        let tmp = tempfile::tempdir().unwrap();
        let v1 = "9:name=systemd:/x\n8:pids:/runc/c1\n4:memory:/runc/c1\n0::/\n";
        assert_eq!(cgroup_dir(v1, tmp.path()), Some(tmp.path().join("pids/runc/c1")));
        let no_pids = "4:cpu,memory:/m/c1\n";
        assert_eq!(cgroup_dir(no_pids, tmp.path()), Some(tmp.path().join("memory/m/c1")));
        std::fs::write(tmp.path().join("cgroup.controllers"), "pids memory").unwrap();
        assert_eq!(
            cgroup_dir("0::/system.slice/c1.scope\n", tmp.path()),
            Some(tmp.path().join("system.slice/c1.scope"))
        );
        // The root cgroup and paths that climb out are no container's.
        assert_eq!(cgroup_dir("0::/\n", tmp.path()), None);
        assert_eq!(cgroup_dir("0::/a/../../etc\n", tmp.path()), None);
    }
}
