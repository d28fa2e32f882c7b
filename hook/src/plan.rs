//! What a container asked for, checked against its allocation, and everything it gets — computed
//! in full before anything is changed (the hook and the wrapper then only apply a [`Plan`]).
//!
//! Requests: env `TESSERA_VISIBLE_DEVICES` (else `NVIDIA_VISIBLE_DEVICES`), annotation
//! `tessera.io/devices` (comma lists of UUIDs, share ids, aliases such as indexes, or one of
//! `all`, `none`, `void`), annotations `cdi.k8s.io/<anything>` holding `tessera.io/<class>=<name>`
//! names, and the marker variables of devices a CDI-aware runtime already injected. Naming the
//! allocation (env `TESSERA_ALLOCATION`, annotation `tessera.io/allocation`) and nothing else asks
//! for all it holds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tessera_region::cdi::{self, Spec};
use tessera_region::hook_config::HookConfig;
use tessera_region::paths::{self, CONTAINER_ALLOC_DIR, ENV_ALLOCATION, PRELOAD_PATH};

pub const ENV_VISIBLE: &str = "TESSERA_VISIBLE_DEVICES";
pub const ENV_NVIDIA_VISIBLE: &str = "NVIDIA_VISIBLE_DEVICES";
pub const ANNOTATION_DEVICES: &str = "tessera.io/devices";
pub const ANNOTATION_ALLOCATION: &str = "tessera.io/allocation";
pub const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";
/// The container's loader configuration entry naming the directories of the driver's libraries.
pub const LD_CONF_PATH: &str = "/etc/ld.so.conf.d/000-tessera.conf";

/// One line, naming the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InjectError(pub String);

impl InjectError {
    pub fn new(msg: impl Into<String>) -> InjectError {
        InjectError(msg.into())
    }
}

/// What the hook and wrapper read from a container's config.json (and the hook's state).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerInfo {
    /// process.env, the last value of a name winning.
    pub env: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedDevice {
    pub class: String,
    /// Canonical CDI device name.
    pub name: String,
    pub uuid: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEdit {
    /// In the container.
    pub path: PathBuf,
    pub host_path: PathBuf,
    pub major: u32,
    pub minor: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEdit {
    pub host_path: PathBuf,
    pub container_path: PathBuf,
    pub read_only: bool,
}

/// A driver file's usual path made a link into the driver directory's mount (one mount for all
/// of the driver's files instead of one each; see docs/hook.md, "Driver directory").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkEdit {
    /// In the container: where the loader looks (`/usr/lib/x86_64-linux-gnu/libcuda.so.1`).
    pub path: PathBuf,
    /// In the container: the same relative path under [`paths::DRIVER_CONTAINER_DIR`].
    pub target: PathBuf,
    /// On the host: the file in the driver directory, bind-mounted at `path` instead where the
    /// image has a regular file there (a link would mean deleting the image's file).
    pub host_path: PathBuf,
}

/// Everything one container gets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub devices: Vec<PlannedDevice>,
    pub device_nodes: Vec<NodeEdit>,
    /// In order: a mount may go inside an earlier one (the region inside the allocation directory).
    pub mounts: Vec<MountEdit>,
    /// Made after the mounts (they point into the driver directory's mount).
    pub links: Vec<LinkEdit>,
    pub env: Vec<(String, String)>,
    pub allocation: Option<String>,
    /// Host files some mounts come from (the preload, the loader entry), with their content: made
    /// by [`ensure_files`] before the mounts.
    pub files: Vec<(PathBuf, String)>,
}

enum List {
    All,
    None,
    Void,
    Ids(Vec<String>),
}

fn parse_list(field: &str, value: &str) -> Result<List, InjectError> {
    let items: Vec<&str> = value.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if items.is_empty() {
        return Ok(List::Void);
    }
    for kw in ["all", "none", "void"] {
        if items.iter().any(|i| i.eq_ignore_ascii_case(kw)) {
            if items.len() > 1 {
                return Err(InjectError(format!("{field}: {kw:?} cannot be combined with other values in {value:?}")));
            }
            return Ok(match kw {
                "all" => List::All,
                "none" => List::None,
                _ => List::Void,
            });
        }
    }
    if let Some(bad) = items.iter().find(|i| !i.chars().all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c))) {
        return Err(InjectError(format!("{field}: {bad:?} is not a device id")));
    }
    Ok(List::Ids(items.into_iter().map(String::from).collect()))
}

/// A device a request names: (field, class if qualified, id).
struct Ask {
    field: String,
    class: Option<String>,
    id: String,
}

/// Whether the container may be asking for anything of ours: cheap, no spec read. A container
/// that does not (most) costs the hook and the wrapper no more than this, and a broken spec
/// on the node cannot stop it from starting.
pub fn may_ask(info: &ContainerInfo) -> bool {
    let listed = |v: &String| !matches!(v.trim(), "" | "void");
    let named = |v: &String| !v.trim().is_empty();
    info.annotations.get(ANNOTATION_DEVICES).is_some_and(listed)
        // Naming an allocation is a request of its own: its devices, unless a list says `void`.
        || info.env.get(ENV_ALLOCATION).is_some_and(named)
        || info.annotations.get(ANNOTATION_ALLOCATION).is_some_and(named)
        || info.env.get(ENV_VISIBLE).is_some_and(listed)
        || (!info.env.contains_key(ENV_VISIBLE) && info.env.get(ENV_NVIDIA_VISIBLE).is_some_and(listed))
        || info.annotations.iter().any(|(k, v)| k.starts_with(CDI_ANNOTATION_PREFIX) && v.contains(cdi::VENDOR))
        || info.env.keys().any(|k| k.starts_with(cdi::DEVICE_MARKER_PREFIX))
}

/// What a container asks for, before any spec is read.
struct Requests {
    asks: Vec<Ask>,
    /// The field that asked for `all`.
    all_from: Option<String>,
    /// `none`: the driver without devices.
    driver_only: bool,
    allocation: Option<String>,
}

impl Requests {
    fn is_empty(&self) -> bool {
        self.asks.is_empty() && self.all_from.is_none() && !self.driver_only
    }
}

fn requests(cfg: &HookConfig, info: &ContainerInfo) -> Result<Requests, InjectError> {
    let mut asks: Vec<Ask> = Vec::new();
    let mut all_from: Option<String> = None;
    let mut driver_only = false;
    let mut lists: Vec<(String, String)> = Vec::new();
    if let Some(v) = info.annotations.get(ANNOTATION_DEVICES) {
        lists.push((format!("annotation {ANNOTATION_DEVICES}"), v.clone()));
    }
    if let Some(v) = info.env.get(ENV_VISIBLE) {
        lists.push((ENV_VISIBLE.into(), v.clone()));
    } else if let Some(v) = info.env.get(ENV_NVIDIA_VISIBLE) {
        lists.push((ENV_NVIDIA_VISIBLE.into(), v.clone()));
    }
    let allocation = allocation_id(info)?;
    let mut void = false;
    for (field, value) in &lists {
        match parse_list(field, value)? {
            // CUDA base images set NVIDIA_VISIBLE_DEVICES=all: without an allocation it asks nothing.
            List::All if field == ENV_NVIDIA_VISIBLE && allocation.is_none() && cfg.require_allocation => {}
            List::All => all_from = Some(field.clone()),
            List::None => driver_only = true,
            List::Void => void = true,
            List::Ids(ids) => asks.extend(ids.into_iter().map(|id| Ask { field: field.clone(), class: None, id })),
        }
    }
    for (key, value) in &info.annotations {
        if !key.starts_with(CDI_ANNOTATION_PREFIX) {
            continue;
        }
        for name in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let field = format!("annotation {key}");
            let Some((kind, id)) = name.split_once('=') else {
                return Err(InjectError(format!("{field}: {name:?} is not a CDI device name (vendor/class=name)")));
            };
            let Some(class) = kind.strip_prefix(cdi::VENDOR).and_then(|k| k.strip_prefix('/')) else { continue };
            if !cdi::is_class(class) {
                return Err(InjectError(format!("{field}: {kind:?} is not a {} class", cdi::VENDOR)));
            }
            asks.push(Ask { field, class: Some(class.into()), id: id.into() });
        }
    }
    for (key, value) in &info.env {
        if key.starts_with(cdi::DEVICE_MARKER_PREFIX) {
            asks.push(Ask { field: key.clone(), class: None, id: value.clone() });
        }
    }
    // Naming the allocation and nothing else asks for all it holds (issue 11): such a container
    // ran without a GPU. An explicit `void` still means no devices.
    if asks.is_empty() && all_from.is_none() && !driver_only && !void {
        all_from = allocation_field(info);
    }
    Ok(Requests { asks, all_from, driver_only, allocation })
}

/// The field that names the allocation, for messages; the annotation wins, as in [`allocation_id`].
fn allocation_field(info: &ContainerInfo) -> Option<String> {
    let named = |v: Option<&String>| v.is_some_and(|v| !v.trim().is_empty());
    if named(info.annotations.get(ANNOTATION_ALLOCATION)) {
        Some(format!("annotation {ANNOTATION_ALLOCATION}"))
    } else if named(info.env.get(ENV_ALLOCATION)) {
        Some(ENV_ALLOCATION.to_string())
    } else {
        None
    }
}

/// The spec classes a request can need, told from the shape of what it names (no spec read);
/// `None`: any. The GPU class is always in: a share's parent GPU, indexes and `all` resolve there.
fn classes_needed(r: &Requests) -> Option<Vec<&'static str>> {
    let mut classes = vec!["gpu"];
    let mut add = |c: &'static str| {
        if !classes.contains(&c) {
            classes.push(c);
        }
    };
    for a in &r.asks {
        match a.class.as_deref() {
            Some(c) => add(cdi::ALL_CLASSES.iter().copied().find(|k| *k == c)?),
            None => add(class_of_id(&a.id)?),
        }
    }
    if r.all_from.is_some() && r.allocation.is_some() {
        // The allocation may hold MIG instances.
        add("mig");
    }
    Some(classes)
}

/// The class a device id names by its shape: a MIG or GPU UUID, a share id (`<uuid>::<n>`), a GPU
/// index (`0`), a MIG alias (`0:1`) or a claim's device (`<claim UID>-<UUID>`, the claim UID a
/// UUID as Kubernetes makes them); `None` for anything else.
fn class_of_id(id: &str) -> Option<&'static str> {
    let prefix = id.get(..4).map(str::to_ascii_uppercase);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let claim_device = id.get(..37).is_some_and(|p| {
        p.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 | 36 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
    });
    if claim_device {
        Some(cdi::CLAIM_CLASS)
    } else if id.contains("::") {
        Some("share")
    } else if prefix.as_deref() == Some("MIG-") {
        Some("mig")
    } else if prefix.as_deref() == Some("GPU-") || digits(id) {
        Some("gpu")
    } else if id.split_once(':').is_some_and(|(g, m)| digits(g) && digits(m)) {
        Some("mig")
    } else {
        None
    }
}

/// Reads the CDI specs a request needs and computes the plan (the hook's and the wrapper's path).
/// Only the spec files of the classes the request can name are read: on a node with many MIG
/// instances and shares, parsing every spec was the larger part of an injection. A guess that
/// misses (a name of an unusual shape, an error) is retried with every spec, so the result is
/// always that of [`plan`] over all of them.
pub fn plan_from_spec_dirs(cfg: &HookConfig, info: &ContainerInfo) -> Result<Option<Plan>, InjectError> {
    let load = |classes: Option<&[&str]>| {
        cdi::load_spec_dirs_for(&cfg.cdi_spec_dirs, classes).map_err(|e| InjectError(format!("CDI spec {e}")))
    };
    if let Ok(r) = requests(cfg, info)
        && let Some(classes) = classes_needed(&r)
        && classes.len() < cdi::ALL_CLASSES.len()
        && let Ok(Ok(plan)) = load(Some(&classes)).map(|specs| plan_requests(cfg, &specs, r))
    {
        return Ok(plan);
    }
    plan(cfg, &load(None)?, info)
}

/// Computes the plan; `None` when the container asks for nothing of ours.
pub fn plan(cfg: &HookConfig, specs: &[Spec], info: &ContainerInfo) -> Result<Option<Plan>, InjectError> {
    plan_requests(cfg, specs, requests(cfg, info)?)
}

/// [`plan`] of requests already read from the container.
fn plan_requests(cfg: &HookConfig, specs: &[Spec], r: Requests) -> Result<Option<Plan>, InjectError> {
    if r.is_empty() {
        return Ok(None);
    }
    let Requests { asks, all_from, driver_only, allocation } = r;

    // The allocation and what it admits.
    let mut plan = Plan { allocation: allocation.clone(), ..Plan::default() };
    let allowed: Option<Vec<String>> = match &allocation {
        Some(id) => Some(load_allocation(cfg, id)?),
        None if cfg.require_allocation => {
            let what = asks.first().map_or_else(|| all_from.clone().unwrap_or_default(), |a| a.field.clone());
            return Err(InjectError(format!(
                "{what}: devices asked for, but no allocation is named (set {ENV_ALLOCATION} or annotation {ANNOTATION_ALLOCATION})"
            )));
        }
        None => None,
    };

    // Resolve every ask to a spec device.
    let mut chosen: Vec<(usize, usize, String)> = Vec::new();
    for a in &asks {
        let (s, d) = find_device(specs, a.class.as_deref(), &a.id).ok_or_else(|| {
            InjectError(format!("{}: {:?} is not a device in the CDI specs ({})", a.field, a.id, dirs(cfg)))
        })?;
        chosen.push((s, d, a.field.clone()));
    }
    if let Some(field) = &all_from {
        match &allowed {
            Some(uuids) => {
                for u in uuids {
                    let (s, d) =
                        ["gpu", "mig"].iter().find_map(|c| find_device(specs, Some(c), u)).ok_or_else(|| {
                            InjectError(format!(
                                "{field}: allocated device {u:?} is not in the CDI specs ({})",
                                dirs(cfg)
                            ))
                        })?;
                    chosen.push((s, d, field.clone()));
                }
            }
            None => {
                for (s, spec) in specs.iter().enumerate().filter(|(_, s)| s.class() == "gpu") {
                    for (d, dev) in spec.devices.iter().enumerate() {
                        if dev.canonical() == dev.name {
                            chosen.push((s, d, field.clone()));
                        }
                    }
                }
            }
        }
    }

    // Check against the allocation; gather the edits.
    let mut classes: Vec<usize> = Vec::new();
    for (s, d, field) in &chosen {
        let spec = &specs[*s];
        let dev = &spec.devices[*d];
        let uuid = dev.uuid().to_string();
        if let (Some(uuids), Some(id)) = (&allowed, &allocation)
            && !uuids.iter().any(|u| u.eq_ignore_ascii_case(&uuid))
        {
            return Err(InjectError(format!(
                "{field}: device {:?} is not allocated to this container (allocation {id:?} holds {})",
                dev.canonical(),
                if uuids.is_empty() { "no devices".to_string() } else { uuids.join(", ") }
            )));
        }
        if !plan.devices.iter().any(|p| p.name == dev.canonical() && p.class == spec.class()) {
            plan.devices.push(PlannedDevice { class: spec.class().into(), name: dev.canonical().into(), uuid });
        }
        add_edits(&mut plan, &dev.container_edits, &format!("{} device {:?}", spec.kind, dev.name))?;
        if !classes.contains(s) {
            classes.push(*s);
        }
    }
    if driver_only && classes.is_empty() {
        classes.extend(specs.iter().position(|s| s.class() == "gpu"));
    }
    for s in classes {
        add_edits(&mut plan, &specs[s].container_edits, &format!("{} spec", specs[s].kind))?;
    }

    // The shim, its preload, the allocation directory, the environment.
    if let Some(shim) = &cfg.shim_path {
        if shim.is_file() {
            push_mount(&mut plan, shim.clone(), paths::SHIM_CONTAINER_PATH.into(), true)?;
            let preload = cfg.runtime_dir.join("hook").join("ld.so.preload");
            push_mount(&mut plan, preload.clone(), PRELOAD_PATH.into(), true)?;
            plan.files.push((preload, paths::preload_content()));
        } else if allocation.is_some() {
            return Err(InjectError(format!("shim_path: {} does not exist", shim.display())));
        }
    }
    // The loader entry: the directories the driver's libraries went to (the cache itself is not
    // rebuilt: see docs/hook.md, "ld cache").
    let mut lib_dirs: Vec<String> = Vec::new();
    for path in plan.mounts.iter().map(|m| &m.container_path).chain(plan.links.iter().map(|l| &l.path)) {
        let is_lib =
            path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("lib") && n.contains(".so"));
        if let Some(dir) = path.parent().filter(|_| is_lib).map(|d| d.display().to_string())
            && path != Path::new(paths::SHIM_CONTAINER_PATH)
            && !lib_dirs.contains(&dir)
        {
            lib_dirs.push(dir);
        }
    }
    if !lib_dirs.is_empty() {
        let content: String = lib_dirs.iter().map(|d| format!("{d}\n")).collect();
        let host =
            cfg.runtime_dir.join("hook").join(format!("ld.so.conf-{:016x}", tessera_region::fnv1a(content.as_bytes())));
        push_mount(&mut plan, host.clone(), LD_CONF_PATH.into(), true)?;
        plan.files.push((host, content));
    }
    if let Some(id) = &allocation {
        let dir = cfg.runtime_dir.join(paths::ALLOC_SUBDIR).join(id);
        for m in cdi::allocation_mounts(&dir) {
            push_mount(&mut plan, m.host_path, m.container_path, !m.writable)?;
        }
        plan.env.extend(cdi::allocation_env(id).map(|(k, v)| (k.to_owned(), v)));
    }
    let mut uuids: Vec<&str> = Vec::new();
    for d in &plan.devices {
        if !uuids.contains(&d.uuid.as_str()) {
            uuids.push(&d.uuid);
        }
    }
    let visible = if uuids.is_empty() { "none".to_string() } else { uuids.join(",") };
    plan.env.push((ENV_VISIBLE.into(), visible));
    Ok(Some(plan))
}

fn dirs(cfg: &HookConfig) -> String {
    cfg.cdi_spec_dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// The allocation a container names (env `TESSERA_ALLOCATION` or annotation
/// `tessera.io/allocation`), checked; `None` when it names none.
pub fn named_allocation(info: &ContainerInfo) -> Result<Option<String>, InjectError> {
    allocation_id(info)
}

/// The allocation's id, from env `TESSERA_ALLOCATION` or annotation `tessera.io/allocation`.
fn allocation_id(info: &ContainerInfo) -> Result<Option<String>, InjectError> {
    let env = info.env.get(ENV_ALLOCATION).map(|s| s.trim()).filter(|s| !s.is_empty());
    let ann = info.annotations.get(ANNOTATION_ALLOCATION).map(|s| s.trim()).filter(|s| !s.is_empty());
    let (field, id) = match (env, ann) {
        (Some(e), Some(a)) if e != a => {
            return Err(InjectError(format!(
                "annotation {ANNOTATION_ALLOCATION}: {a:?} differs from {ENV_ALLOCATION}={e:?}"
            )));
        }
        (_, Some(a)) => (format!("annotation {ANNOTATION_ALLOCATION}"), a),
        (Some(e), None) => (ENV_ALLOCATION.to_string(), e),
        (None, None) => return Ok(None),
    };
    let ok =
        id.len() <= 128 && id.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) && !id.starts_with('.');
    if !ok {
        return Err(InjectError(format!("{field}: {id:?} is not an allocation id")));
    }
    Ok(Some(id.to_string()))
}

/// The UUIDs an allocation holds (its limits file's UUID entries).
fn load_allocation(cfg: &HookConfig, id: &str) -> Result<Vec<String>, InjectError> {
    let dir = cfg.runtime_dir.join(paths::ALLOC_SUBDIR).join(id);
    let limits = tessera_region::Limits::load(&dir.join("limits"))
        .map_err(|e| InjectError(format!("allocation {id:?}: {e}")))?;
    let region = dir.join("region");
    match std::fs::symlink_metadata(&region) {
        Ok(m) if m.is_file() => {}
        Ok(_) => return Err(InjectError(format!("allocation {id:?}: {} is not a regular file", region.display()))),
        Err(e) => return Err(InjectError(format!("allocation {id:?}: {}: {e}", region.display()))),
    }
    Ok(limits
        .devices
        .iter()
        .map(|d| d.uuid.clone())
        .filter(|u| u != tessera_region::ALL_DEVICES && !u.starts_with("index:"))
        .collect())
}

/// A device by name or alias: exact first, then ignoring ASCII case; classes in order.
fn find_device(specs: &[Spec], class: Option<&str>, id: &str) -> Option<(usize, usize)> {
    let name = cdi::cdi_device_name(id);
    let in_class = |s: &&Spec| class.is_none_or(|c| s.class() == c);
    for exact in [true, false] {
        for (si, spec) in specs.iter().enumerate().filter(|(_, s)| in_class(s)) {
            if let Some(di) = spec
                .devices
                .iter()
                .position(|d| if exact { d.name == name } else { d.name.eq_ignore_ascii_case(&name) })
            {
                return Some((si, di));
            }
        }
    }
    None
}

fn add_edits(plan: &mut Plan, edits: &cdi::ContainerEdits, what: &str) -> Result<(), InjectError> {
    for (i, n) in edits.device_nodes.iter().enumerate() {
        let field = format!("{what}: deviceNodes[{i}]");
        if n.kind.as_deref().is_some_and(|k| k != "c") {
            return Err(InjectError(format!("{field}.type: {:?} is not \"c\"", n.kind)));
        }
        let num = |v: Option<i64>, f: &str| {
            v.and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| InjectError(format!("{field}.{f}: missing or out of range")))
        };
        let edit = NodeEdit {
            path: checked_container_path(&n.path, &format!("{field}.path"))?,
            host_path: PathBuf::from(n.host_path.as_deref().unwrap_or(&n.path)),
            major: num(n.major, "major")?,
            minor: num(n.minor, "minor")?,
        };
        match plan.device_nodes.iter().find(|e| e.path == edit.path) {
            Some(e) if (e.major, e.minor) != (edit.major, edit.minor) => {
                return Err(InjectError(format!("{field}: {} given twice with different numbers", n.path)));
            }
            Some(_) => {}
            None => plan.device_nodes.push(edit),
        }
    }
    for (i, m) in edits.mounts.iter().enumerate() {
        let field = format!("{what}: mounts[{i}]");
        let ro = m.options.iter().any(|o| o == "ro");
        let path = checked_container_path(&m.container_path, &format!("{field}.containerPath"))?;
        if !m.host_path.starts_with('/') {
            return Err(InjectError(format!("{field}.hostPath: {:?} is not absolute", m.host_path)));
        }
        push_mount(plan, m.host_path.clone().into(), path, ro)?;
    }
    // Our own hook entry's `--link` arguments (a CDI runtime runs that entry; the hook and the
    // wrapper read them here): every other hook entry is the runtime's business.
    for (i, h) in edits.hooks.iter().enumerate() {
        if Path::new(&h.path).file_name().is_none_or(|n| n != "tessera-hook") {
            continue;
        }
        let mut args = h.args.iter();
        while let Some(a) = args.next() {
            if a == "--link" {
                let field = format!("{what}: hooks[{i}]: --link");
                let path = args.next().ok_or_else(|| InjectError(format!("{field}: needs a path")))?;
                add_link(plan, checked_container_path(path, &field)?)
                    .map_err(|e| InjectError(format!("{field}: {e}")))?;
            }
        }
    }
    for (i, e) in edits.env.iter().enumerate() {
        let Some((k, v)) = e.split_once('=') else {
            return Err(InjectError(format!("{what}: env[{i}]: {e:?} is not NAME=VALUE")));
        };
        if !plan.env.iter().any(|(pk, _)| pk == k) {
            plan.env.push((k.into(), v.into()));
        }
    }
    Ok(())
}

/// Makes `path` a link to its copy in the driver directory, which the plan must mount already.
pub fn add_link(plan: &mut Plan, path: PathBuf) -> Result<(), InjectError> {
    let dir = Path::new(paths::DRIVER_CONTAINER_DIR);
    let Some(mount) = plan.mounts.iter().find(|m| m.container_path == dir) else {
        return Err(InjectError(format!("{}: no driver directory is mounted at {}", path.display(), dir.display())));
    };
    let rel = path.strip_prefix("/").unwrap_or(&path);
    if rel.as_os_str().is_empty() || path.starts_with(dir) || path.starts_with(CONTAINER_ALLOC_DIR) {
        return Err(InjectError(format!("{}: not a path a driver file can be linked at", path.display())));
    }
    let edit = LinkEdit { target: dir.join(rel), host_path: mount.host_path.join(rel), path };
    if let Some(m) = plan.mounts.iter().find(|m| m.container_path == edit.path) {
        return Err(InjectError(format!(
            "{}: both a link into the driver directory and a mount of {}",
            edit.path.display(),
            m.host_path.display()
        )));
    }
    if !plan.links.contains(&edit) {
        plan.links.push(edit);
    }
    Ok(())
}

fn checked_container_path(p: &str, field: &str) -> Result<PathBuf, InjectError> {
    let path = Path::new(p);
    if !path.is_absolute() || path.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
        return Err(InjectError(format!("{field}: {p:?} is not an absolute path without \"..\"")));
    }
    Ok(path.to_path_buf())
}

fn push_mount(plan: &mut Plan, host: PathBuf, container: PathBuf, read_only: bool) -> Result<(), InjectError> {
    match plan.mounts.iter().find(|m| m.container_path == container) {
        Some(m) if m.host_path != host => Err(InjectError(format!(
            "mount {}: given from both {} and {}",
            container.display(),
            m.host_path.display(),
            host.display()
        ))),
        Some(_) => Ok(()),
        None => {
            plan.mounts.push(MountEdit { host_path: host, container_path: container, read_only });
            Ok(())
        }
    }
}

/// Makes the plan's host files (atomically) where they are missing or differ.
pub fn ensure_files(plan: &Plan) -> Result<(), InjectError> {
    for (path, want) in &plan.files {
        if std::fs::read_to_string(path).is_ok_and(|s| &s == want) {
            continue;
        }
        let err = |e: std::io::Error| InjectError(format!("{}: {e}", path.display()));
        let dir = path.parent().ok_or_else(|| InjectError(format!("{}: no parent", path.display())))?;
        std::fs::create_dir_all(dir).map_err(err)?;
        let tmp = dir.join(format!(".tmp.{}", std::process::id()));
        std::fs::write(&tmp, want).map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tessera_region::testing::fake_node;

    pub(crate) struct Fixture {
        pub dir: tempfile::TempDir,
        pub cfg: HookConfig,
        pub specs: Vec<Spec>,
    }

    pub(crate) fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let node = fake_node(dir.path());
        let specs = cdi::build_specs(&node).unwrap();
        let run = dir.path().join("run");
        let alloc = run.join("alloc/a1");
        std::fs::create_dir_all(&alloc).unwrap();
        std::fs::write(alloc.join("limits"), "version = 1\n[[devices]]\nuuid = \"GPU-aaaa\"\nmemory_limit = 1024\n")
            .unwrap();
        std::fs::write(alloc.join("region"), b"").unwrap();
        let shim = dir.path().join("libtessera.so");
        std::fs::write(&shim, b"elf").unwrap();
        let cfg = HookConfig {
            cdi_spec_dirs: vec![dir.path().join("cdi")],
            runtime_dir: run,
            driver_root: dir.path().into(),
            dev_root: dir.path().join("dev"),
            runtime: "runc".into(),
            require_allocation: true,
            shim_path: Some(shim),
        };
        Fixture { dir, cfg, specs }
    }

    fn info(env: &[(&str, &str)], ann: &[(&str, &str)]) -> ContainerInfo {
        ContainerInfo {
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            annotations: ann.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    fn err(f: &Fixture, env: &[(&str, &str)], ann: &[(&str, &str)]) -> String {
        plan(&f.cfg, &f.specs, &info(env, ann)).unwrap_err().0
    }

    #[test]
    fn device_ids_tell_their_class_by_shape() {
        assert_eq!(class_of_id("GPU-aaaa::3"), Some("share"));
        assert_eq!(class_of_id("mig-bbbb"), Some("mig"));
        assert_eq!(class_of_id("GPU-aaaa"), Some("gpu"));
        assert_eq!(class_of_id("12"), Some("gpu"));
        assert_eq!(class_of_id("1:0"), Some("mig"));
        assert_eq!(class_of_id("trainer-gpu"), None);
        assert_eq!(class_of_id("1:"), None);
    }

    /// The hook's and wrapper's path reads only the spec files a request can need, and always
    /// plans as over every spec.
    #[test]
    fn only_the_needed_specs_are_read_and_the_plan_is_the_same() {
        let f = fixture();
        let dir = &f.cfg.cdi_spec_dirs[0];
        cdi::write_specs(dir, &f.specs).unwrap();
        let asks: &[&[(&str, &str)]] = &[
            &[(ENV_VISIBLE, "0"), (ENV_ALLOCATION, "a1")],
            &[(ENV_VISIBLE, "GPU-aaaa::3"), (ENV_ALLOCATION, "a1")],
            &[(ENV_VISIBLE, "all"), (ENV_ALLOCATION, "a1")],
            &[(ENV_VISIBLE, "none")],
        ];
        for env in asks {
            let i = info(env, &[]);
            assert_eq!(plan_from_spec_dirs(&f.cfg, &i), plan(&f.cfg, &f.specs, &i), "{env:?}");
        }
        // A broken MIG spec does not stop a GPU or share request, which never reads it...
        std::fs::write(dir.join("tessera.io-mig.json"), "{ not json").unwrap();
        for env in &asks[..2] {
            let i = info(env, &[]);
            assert_eq!(plan_from_spec_dirs(&f.cfg, &i), plan(&f.cfg, &f.specs, &i), "{env:?}");
        }
        // ...while a request that may name a MIG instance reads it and reports it, whether the
        // shape says so or a name of no known shape makes every spec be read.
        for id in ["1:0", "MIG-bbbb", "trainer"] {
            let e = plan_from_spec_dirs(&f.cfg, &info(&[(ENV_VISIBLE, id), (ENV_ALLOCATION, "a1")], &[])).unwrap_err();
            assert!(e.0.starts_with("CDI spec ") && e.0.contains("tessera.io-mig.json"), "{id}: {e}");
        }
        // A spec of a Tessera class under another file name is always read.
        std::fs::remove_file(dir.join("tessera.io-mig.json")).unwrap();
        let i = info(&[(ENV_VISIBLE, "MIG-bbbb")], &[]);
        let mut cfg = f.cfg.clone();
        cfg.require_allocation = false;
        assert!(plan_from_spec_dirs(&cfg, &i).unwrap_err().0.contains("not a device in the CDI specs"));
        let mig = f.specs.iter().find(|s| s.class() == "mig").unwrap();
        std::fs::write(dir.join("tessera.io-extra.json"), serde_json::to_vec(mig).unwrap()).unwrap();
        let p = plan_from_spec_dirs(&cfg, &i).unwrap().unwrap();
        assert_eq!(p.devices[0].name, "MIG-bbbb");
    }

    /// A spec with a driver directory: one mount of it, and each driver file's usual path a link
    /// to the same path under it; the loader entry names the links' directories.
    #[test]
    fn a_driver_directory_is_one_mount_and_a_link_per_file() {
        let f = fixture();
        let lib = Path::new("/usr/lib/x86_64-linux-gnu");
        let mut node = fake_node(f.dir.path());
        node.driver = tessera_region::driver::DriverFiles {
            root: "/".into(),
            libraries: vec![lib.join("libcuda.so.1"), lib.join("libcuda.so.550.54.15")],
            binaries: vec!["/usr/bin/nvidia-smi".into()],
        };
        node.driver_dir = Some("/var/lib/tessera/driver/k1".into());
        let specs = cdi::build_specs(&node).unwrap();
        let p = plan(&f.cfg, &specs, &info(&[(ENV_VISIBLE, "0"), (ENV_ALLOCATION, "a1")], &[])).unwrap().unwrap();
        let dir = Path::new(paths::DRIVER_CONTAINER_DIR);
        let driver: Vec<_> = p
            .mounts
            .iter()
            .filter(|m| m.host_path.starts_with("/var/lib/tessera") || m.container_path.starts_with(lib))
            .collect();
        assert_eq!(
            driver,
            [&MountEdit {
                host_path: "/var/lib/tessera/driver/k1".into(),
                container_path: dir.into(),
                read_only: true
            }]
        );
        let links: Vec<_> = p.links.iter().map(|l| (l.path.clone(), l.target.clone(), l.host_path.clone())).collect();
        assert_eq!(
            links,
            [
                (
                    lib.join("libcuda.so.1"),
                    dir.join("usr/lib/x86_64-linux-gnu/libcuda.so.1"),
                    PathBuf::from("/var/lib/tessera/driver/k1/usr/lib/x86_64-linux-gnu/libcuda.so.1")
                ),
                (
                    lib.join("libcuda.so.550.54.15"),
                    dir.join("usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"),
                    PathBuf::from("/var/lib/tessera/driver/k1/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15")
                ),
                (
                    "/usr/bin/nvidia-smi".into(),
                    dir.join("usr/bin/nvidia-smi"),
                    PathBuf::from("/var/lib/tessera/driver/k1/usr/bin/nvidia-smi")
                ),
            ]
        );
        let conf = p.files.iter().find(|(h, _)| h.to_string_lossy().contains("ld.so.conf")).unwrap();
        assert_eq!(conf.1, "/usr/lib/x86_64-linux-gnu\n");
        // The same files without a driver directory: a mount each, no links, the same loader entry.
        node.driver_dir = None;
        let specs = cdi::build_specs(&node).unwrap();
        let q = plan(&f.cfg, &specs, &info(&[(ENV_VISIBLE, "0"), (ENV_ALLOCATION, "a1")], &[])).unwrap().unwrap();
        assert!(q.links.is_empty());
        assert_eq!(q.mounts.iter().filter(|m| m.container_path.starts_with(lib)).count(), 2);
        assert!(q.files.contains(conf));
    }

    /// `--link` names only paths outside the driver directory and the allocation directory, and
    /// only where the driver directory is mounted.
    #[test]
    fn links_need_the_driver_directory_and_a_sane_path() {
        let mut p = Plan::default();
        let e = add_link(&mut p, "/usr/lib/libcuda.so.1".into()).unwrap_err();
        assert!(e.0.contains("no driver directory is mounted at /usr/lib/tessera/driver"), "{e}");
        push_mount(&mut p, "/d".into(), paths::DRIVER_CONTAINER_DIR.into(), true).unwrap();
        for bad in ["/", "/usr/lib/tessera/driver/x", "/run/tessera/alloc/limits"] {
            assert!(add_link(&mut p, bad.into()).unwrap_err().0.contains("not a path a driver file"), "{bad}");
        }
        push_mount(&mut p, "/h/x".into(), "/usr/lib/x".into(), true).unwrap();
        assert!(add_link(&mut p, "/usr/lib/x".into()).unwrap_err().0.contains("both a link"));
        add_link(&mut p, "/usr/lib/y".into()).unwrap();
        add_link(&mut p, "/usr/lib/y".into()).unwrap();
        assert_eq!(p.links.len(), 1);
        // From a spec: a `--link` with no path, or a relative one, names the hook entry.
        let mut edits = cdi::ContainerEdits::default();
        edits.hooks.push(cdi::Hook {
            hook_name: "createRuntime".into(),
            path: "/usr/local/bin/tessera-hook".into(),
            args: vec!["tessera-hook".into(), "--link".into(), "usr/lib/z".into()],
            env: vec![],
        });
        let e = add_edits(&mut p, &edits, "gpu spec").unwrap_err();
        assert!(e.0.contains("gpu spec: hooks[0]: --link") && e.0.contains("not an absolute path"), "{e}");
        edits.hooks[0].args.truncate(2);
        assert!(add_edits(&mut p, &edits, "gpu spec").unwrap_err().0.contains("needs a path"));
        // Another program's hook entry is the runtime's business, whatever its arguments.
        edits.hooks[0].path = "/usr/bin/nvidia-ctk".into();
        add_edits(&mut p, &edits, "gpu spec").unwrap();
    }

    #[test]
    fn nothing_asked_is_no_plan() {
        let f = fixture();
        assert!(!may_ask(&info(&[("PATH", "/bin"), (ENV_VISIBLE, "void")], &[("cdi.k8s.io/x", "nvidia.com/gpu=0")])));
        assert!(may_ask(&info(&[(ENV_NVIDIA_VISIBLE, "all")], &[])));
        assert!(!may_ask(&info(&[(ENV_VISIBLE, ""), (ENV_NVIDIA_VISIBLE, "all")], &[])));
        assert_eq!(plan(&f.cfg, &f.specs, &info(&[("PATH", "/bin")], &[])).unwrap(), None);
        assert_eq!(plan(&f.cfg, &f.specs, &info(&[(ENV_VISIBLE, "void")], &[])).unwrap(), None);
        // A CUDA image's default asks nothing without an allocation.
        assert_eq!(plan(&f.cfg, &f.specs, &info(&[(ENV_NVIDIA_VISIBLE, "all")], &[])).unwrap(), None);
        // An allocation named with an explicit `void`: no devices, as `void` always means.
        assert_eq!(plan(&f.cfg, &f.specs, &info(&[(ENV_VISIBLE, "void"), (ENV_ALLOCATION, "a1")], &[])).unwrap(), None);
        // An allocation named but missing is an error, not a container without its GPU.
        let e = plan(&f.cfg, &f.specs, &info(&[(ENV_ALLOCATION, "nope")], &[])).unwrap_err();
        assert!(e.0.starts_with("allocation \"nope\": "), "{e}");
    }

    #[test]
    fn allocated_device_by_every_way_of_asking() {
        let f = fixture();
        for (env, ann) in [
            (vec![(ENV_VISIBLE, "GPU-aaaa"), (ENV_ALLOCATION, "a1")], vec![]),
            (vec![(ENV_VISIBLE, "0"), (ENV_ALLOCATION, "a1")], vec![]),
            (vec![(ENV_NVIDIA_VISIBLE, "all"), (ENV_ALLOCATION, "a1")], vec![]),
            (vec![], vec![(ANNOTATION_DEVICES, "gpu-AAAA"), (ANNOTATION_ALLOCATION, "a1")]),
            (vec![(ENV_ALLOCATION, "a1")], vec![("cdi.k8s.io/x", "nvidia.com/gpu=0,tessera.io/gpu=GPU-aaaa")]),
            (vec![(ENV_ALLOCATION, "a1"), ("TESSERA_CDI_DEVICE_GPU_AAAA", "GPU-aaaa")], vec![]),
            // Naming the allocation is the request (issue 31, item 6): it ran without a GPU.
            (vec![(ENV_ALLOCATION, "a1")], vec![]),
            (vec![], vec![(ANNOTATION_ALLOCATION, "a1")]),
            (vec![(ENV_ALLOCATION, "a1")], vec![(ANNOTATION_ALLOCATION, "a1")]),
        ] {
            assert!(may_ask(&info(&env, &ann)), "{env:?} {ann:?}");
            let p = plan(&f.cfg, &f.specs, &info(&env, &ann)).unwrap().unwrap();
            assert_eq!(
                p.devices,
                [PlannedDevice { class: "gpu".into(), name: "GPU-aaaa".into(), uuid: "GPU-aaaa".into() }],
                "{env:?} {ann:?}"
            );
            let nodes: Vec<_> = p.device_nodes.iter().map(|n| (n.path.to_str().unwrap(), n.major, n.minor)).collect();
            assert_eq!(nodes, [("/dev/nvidia0", 195, 0), ("/dev/nvidiactl", 195, 255), ("/dev/nvidia-uvm", 510, 0)]);
            let mounts: Vec<_> = p.mounts.iter().map(|m| (m.container_path.to_str().unwrap(), m.read_only)).collect();
            assert_eq!(
                mounts,
                [
                    (paths::SHIM_CONTAINER_PATH, true),
                    (PRELOAD_PATH, true),
                    (CONTAINER_ALLOC_DIR, true),
                    ("/run/tessera/alloc/region", false)
                ]
            );
            let env: BTreeMap<_, _> = p.env.iter().cloned().collect();
            assert_eq!(env["TESSERA_LIMITS"], "/run/tessera/alloc/limits");
            assert_eq!(env[ENV_VISIBLE], "GPU-aaaa");
            assert_eq!(env["TESSERA_CDI_DEVICE_GPU_AAAA"], "GPU-aaaa");
        }
        // A share maps to its parent GPU.
        let p = plan(&f.cfg, &f.specs, &info(&[(ENV_VISIBLE, "GPU-aaaa::3"), (ENV_ALLOCATION, "a1")], &[]))
            .unwrap()
            .unwrap();
        assert_eq!(p.devices[0].class, "share");
        assert_eq!(p.devices[0].uuid, "GPU-aaaa");
    }

    /// A DRA claim's devices, as a CDI runtime injects them (the claim spec's env) or as an
    /// older kubelet names them (a `cdi.k8s.io/` annotation): the claim's GPU with its
    /// allocation's limits and region; a claim device of another allocation is refused.
    #[test]
    fn a_claim_device_brings_its_allocation() {
        let f = fixture();
        let shim = f.cfg.shim_path.clone().unwrap();
        let claim = tessera_region::testing::claim_spec(&fake_node(f.dir.path()), &f.cfg.runtime_dir, &shim);
        let mut specs = f.specs.clone();
        specs.push(claim.clone());
        let name = claim.devices[0].name.clone();
        assert_eq!(class_of_id(&name), Some(cdi::CLAIM_CLASS));
        let injected: Vec<(String, String)> = claim.devices[0]
            .container_edits
            .env
            .iter()
            .map(|e| e.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())).unwrap())
            .collect();
        let env: Vec<(&str, &str)> = injected.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let by_annotation = format!("tessera.io/claim={name}");
        for (env, ann) in [
            (env.clone(), vec![]),
            (vec![(ENV_ALLOCATION, "a1")], vec![("cdi.k8s.io/gpu.tessera.io_claim", by_annotation.as_str())]),
        ] {
            let p = plan(&f.cfg, &specs, &info(&env, &ann)).unwrap().unwrap();
            assert_eq!(
                p.devices,
                [PlannedDevice { class: "claim".into(), name: name.clone(), uuid: "GPU-aaaa".into() }],
                "{env:?} {ann:?}"
            );
            let mounts: Vec<_> = p.mounts.iter().map(|m| (m.container_path.to_str().unwrap(), m.read_only)).collect();
            for want in [
                (CONTAINER_ALLOC_DIR, true),
                ("/run/tessera/alloc/region", false),
                (PRELOAD_PATH, true),
                (paths::SHIM_CONTAINER_PATH, true),
            ] {
                assert!(mounts.contains(&want), "{want:?} in {mounts:?}");
            }
            assert_eq!(p.device_nodes[0].path, Path::new("/dev/nvidia0"));
            assert_eq!(p.allocation.as_deref(), Some("a1"));
        }
        // The same through the spec files, reading only what a claim device needs.
        let dir = &f.cfg.cdi_spec_dirs[0];
        cdi::write_specs(dir, &f.specs).unwrap();
        cdi::write_claim_spec(dir, tessera_region::testing::CLAIM_UID, &claim).unwrap();
        std::fs::write(dir.join("tessera.io-mig.json"), "{ not json").unwrap();
        let p = plan_from_spec_dirs(&f.cfg, &info(&env, &[])).unwrap().unwrap();
        assert_eq!(p.devices[0].name, name);
        // A hostile container naming the claim device with another allocation: refused.
        let a2 = f.cfg.runtime_dir.join("alloc/a2");
        std::fs::create_dir_all(&a2).unwrap();
        std::fs::write(a2.join("limits"), "version = 1\n[[devices]]\nuuid = \"GPU-bbbb\"\n").unwrap();
        std::fs::write(a2.join("region"), b"").unwrap();
        let hostile = info(&[(ENV_ALLOCATION, "a2")], &[("cdi.k8s.io/x", by_annotation.as_str())]);
        let e = plan(&f.cfg, &specs, &hostile).unwrap_err().0;
        assert!(e.contains("is not allocated to this container (allocation \"a2\" holds GPU-bbbb)"), "{e}");
    }

    #[test]
    fn refusals_name_the_field() {
        let f = fixture();
        let e = err(&f, &[(ENV_VISIBLE, "MIG-bbbb"), (ENV_ALLOCATION, "a1")], &[]);
        assert_eq!(
            e,
            "TESSERA_VISIBLE_DEVICES: device \"MIG-bbbb\" is not allocated to this container (allocation \"a1\" holds GPU-aaaa)"
        );
        let e = err(&f, &[(ENV_VISIBLE, "1:0"), (ENV_ALLOCATION, "a1")], &[]);
        assert!(e.contains("\"MIG-bbbb\" is not allocated"), "{e}");
        let e = err(&f, &[(ENV_VISIBLE, "GPU-aaaa")], &[]);
        assert!(e.starts_with("TESSERA_VISIBLE_DEVICES: devices asked for, but no allocation is named"), "{e}");
        let e = err(&f, &[(ENV_VISIBLE, "GPU-zzzz"), (ENV_ALLOCATION, "a1")], &[]);
        assert!(e.starts_with("TESSERA_VISIBLE_DEVICES: \"GPU-zzzz\" is not a device in the CDI specs"), "{e}");
        let e = err(&f, &[(ENV_VISIBLE, "all,0")], &[]);
        assert!(e.starts_with("TESSERA_VISIBLE_DEVICES: \"all\" cannot be combined"), "{e}");
        let e = err(&f, &[(ENV_VISIBLE, "0"), (ENV_ALLOCATION, "../etc")], &[]);
        assert_eq!(e, "TESSERA_ALLOCATION: \"../etc\" is not an allocation id");
        let e = err(&f, &[(ENV_VISIBLE, "0"), (ENV_ALLOCATION, "nope")], &[]);
        assert!(e.starts_with("allocation \"nope\": ") && e.contains("alloc/nope/limits"), "{e}");
        let e = err(&f, &[(ENV_ALLOCATION, "a1")], &[("cdi.k8s.io/x", "tessera.io/gpu")]);
        assert!(e.starts_with("annotation cdi.k8s.io/x: \"tessera.io/gpu\" is not a CDI device name"), "{e}");
        let e = err(&f, &[(ENV_ALLOCATION, "a1")], &[("cdi.k8s.io/x", "tessera.io/tpu=0")]);
        assert!(e.starts_with("annotation cdi.k8s.io/x: \"tessera.io/tpu\" is not a tessera.io class"), "{e}");
        let e = err(&f, &[(ENV_VISIBLE, "0"), (ENV_ALLOCATION, "a1")], &[(ANNOTATION_ALLOCATION, "a2")]);
        assert!(e.starts_with("annotation tessera.io/allocation: \"a2\" differs"), "{e}");
        std::fs::write(f.cfg.runtime_dir.join("alloc/a1/limits"), "version = 1\n[[devices]]\nuuid = 5\n").unwrap();
        let e = err(&f, &[(ENV_VISIBLE, "0"), (ENV_ALLOCATION, "a1")], &[]);
        assert!(e.ends_with("devices[0].uuid: expected a string, found an integer"), "{e}");
        std::fs::remove_file(f.cfg.shim_path.as_ref().unwrap()).unwrap();
        std::fs::write(f.cfg.runtime_dir.join("alloc/a1/limits"), "version = 1\n").unwrap();
        let e = err(&f, &[(ENV_VISIBLE, "none"), (ENV_ALLOCATION, "a1")], &[]);
        assert!(e.starts_with("shim_path: "), "{e}");
        drop(f.dir);
    }

    #[test]
    fn standalone_host_needs_no_allocation() {
        let mut f = fixture();
        f.cfg.require_allocation = false;
        let p = plan(&f.cfg, &f.specs, &info(&[(ENV_VISIBLE, "all")], &[])).unwrap().unwrap();
        assert_eq!(p.devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["GPU-aaaa"]);
        assert!(p.mounts.iter().all(|m| !m.container_path.starts_with(CONTAINER_ALLOC_DIR)));
        let p = plan(&f.cfg, &f.specs, &info(&[(ENV_VISIBLE, "1:0")], &[])).unwrap().unwrap();
        let nodes: Vec<_> = p.device_nodes.iter().map(|n| n.path.to_str().unwrap()).collect();
        assert_eq!(nodes, ["/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidiactl", "/dev/nvidia-uvm"]);
        let p = plan(&f.cfg, &f.specs, &info(&[(ENV_VISIBLE, "none")], &[])).unwrap().unwrap();
        assert!(p.devices.is_empty() && p.device_nodes.len() == 2);
        assert!(p.env.contains(&(ENV_VISIBLE.into(), "none".into())));
    }
}
