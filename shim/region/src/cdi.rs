//! CDI specs for Tessera's devices: what the daemon writes (one spec per class: `tessera.io/gpu`,
//! `tessera.io/mig`, `tessera.io/share`; and one spec per prepared DRA claim, kind
//! `tessera.io/claim`, in `tessera.io-claim_<claim UID>.json`) and what the hook and the wrapper
//! read back.
//!
//! Device names: the CDI grammar allows `A-Z a-z 0-9 _ - . :` (starting and ending with a letter or
//! digit), so a share id `GPU-<uuid>::3` is a valid name as it is; [`cdi_device_name`] keeps valid
//! ids unchanged and replaces any other character with `_`.
//!
//! Each device's edits carry a marker variable `TESSERA_CDI_DEVICE_<KEY>=<canonical name>`, so the
//! hook can tell which devices a CDI-aware runtime injected (aliases carry their canonical name's
//! marker). Each spec's edits carry the control nodes, the driver's files, the shim, and a
//! `createRuntime` hook entry running `tessera-hook` (allocation check, limits, region, preload).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::driver::DriverFiles;
use crate::paths::{
    CONTAINER_ALLOC_DIR, DRIVER_CONTAINER_DIR, ENV_ALLOCATION, LIMITS_FILE, PRELOAD_PATH, REGION_FILE,
    SHIM_CONTAINER_PATH,
};

pub const VENDOR: &str = "tessera.io";
/// The CDI version written by default (device annotations need 0.6.0).
pub const CDI_VERSION: &str = "0.6.0";
/// For runtimes whose CDI library stops at 0.5.0 (podman 4.3): written without annotations.
pub const CDI_VERSION_COMPAT: &str = "0.5.0";
/// The device classes, in the order specs are written and names are looked up.
pub const CLASSES: &[&str] = &["gpu", "mig", "share"];
/// The class of the per-claim specs (DRA): one file per prepared claim, many specs of this kind.
pub const CLAIM_CLASS: &str = "claim";
/// Every class a `tessera.io` spec may have.
pub const ALL_CLASSES: &[&str] = &["gpu", "mig", "share", CLAIM_CLASS];
/// Prefix of the per-device marker variable.
pub const DEVICE_MARKER_PREFIX: &str = "TESSERA_CDI_DEVICE_";
/// Device annotation carrying the UUID the container's CUDA sees (0.6.0 specs only).
pub const ANNOTATION_UUID: &str = "tessera.io/uuid";
/// The only environment any hook entry we write gets.
pub const HOOK_ENV: &str = "PATH=/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    #[serde(default)]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    pub hook_name: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
}

/// What the daemon knows; no NVML needed to build specs from it.
#[derive(Debug, Clone, Default)]
pub struct NodeDevices {
    pub devices: Vec<NodeDevice>,
    /// nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset (host paths); absent ones skipped.
    pub control_nodes: Vec<PathBuf>,
    /// From [`crate::driver::discover`].
    pub driver: DriverFiles,
    /// Host path of the driver directory ([`crate::driver_dir`]): `driver`'s files gathered under one
    /// directory at their paths relative to the driver root. Set: a spec gets one mount of it at
    /// [`DRIVER_CONTAINER_DIR`] and a link per file; `None`: a mount per file.
    pub driver_dir: Option<PathBuf>,
    /// Host path of libtessera.so.
    pub shim: Option<PathBuf>,
    /// Host path of tessera-hook (the `createRuntime` hook entry).
    pub hook_binary: PathBuf,
    /// The hook's configuration file, always passed as `--config`: a spec's hook must find the
    /// configuration of the daemon that wrote it, whatever that daemon's paths are.
    pub hook_config: PathBuf,
    /// The device root the nodes are under (their container path is `/dev/<relative>`).
    pub dev_root: PathBuf,
    /// cdiVersion to write: [`CDI_VERSION`] when none; [`CDI_VERSION_COMPAT`] drops annotations.
    pub cdi_version: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeDevice {
    /// "gpu" | "mig" | "share".
    pub class: String,
    /// GPU-uuid, MIG-uuid, GPU-uuid::3.
    pub name: String,
    /// e.g. "0", "0:1".
    pub aliases: Vec<String>,
    /// The GPU or MIG uuid the container's CUDA sees.
    pub uuid: String,
    /// Host paths: /dev/nvidia3, /dev/nvidia-caps/nvidia-cap21, ...
    pub nodes: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {reason}", path.display())]
    Parse { path: PathBuf, reason: String },
    #[error("{key}: {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> CdiError {
    CdiError::Invalid { key: key.into(), reason: reason.into() }
}

/// A device id as a CDI device name: valid ids unchanged (`GPU-…::3` included), any character
/// outside `A-Za-z0-9_.:-` replaced with `_`.
pub fn cdi_device_name(device_id: &str) -> String {
    device_id.chars().map(|c| if c.is_ascii_alphanumeric() || "_-.:".contains(c) { c } else { '_' }).collect()
}

/// Whether `name` is a valid CDI device name.
pub fn is_valid_device_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"_-.:".contains(c))
}

/// The marker variable's name for a canonical device name.
pub fn marker_key(canonical: &str) -> String {
    let key: String =
        canonical.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect();
    format!("{DEVICE_MARKER_PREFIX}{key}")
}

/// The UUID the container's CUDA sees for a device id: a share's parent GPU, else the id.
pub fn uuid_of(device_id: &str) -> &str {
    device_id.split_once("::").map_or(device_id, |(parent, _)| parent)
}

/// One spec per class present, devices in the order given, aliases after their device.
pub fn build_specs(node: &NodeDevices) -> Result<Vec<Spec>, CdiError> {
    let version = node.cdi_version.clone().unwrap_or_else(|| CDI_VERSION.into());
    if version != CDI_VERSION && version != CDI_VERSION_COMPAT {
        return Err(invalid("cdi_version", format!("{version:?} is not {CDI_VERSION} or {CDI_VERSION_COMPAT}")));
    }
    let annotations = version == CDI_VERSION;
    let dev_root = if node.dev_root.as_os_str().is_empty() { Path::new("/dev") } else { &node.dev_root };
    let common = common_edits(node, dev_root)?;
    let mut specs = Vec::new();
    for class in CLASSES {
        let mut devices = Vec::new();
        for (i, d) in node.devices.iter().enumerate().filter(|(_, d)| d.class == *class) {
            let key = |f: &str| format!("devices[{i}].{f}");
            let name = cdi_device_name(&d.name);
            if !is_valid_device_name(&name) {
                return Err(invalid(key("name"), format!("{:?} is not a valid CDI device name", d.name)));
            }
            let mut edits =
                ContainerEdits { env: vec![format!("{}={}", marker_key(&name), name)], ..Default::default() };
            for n in &d.nodes {
                edits.device_nodes.push(device_node(n, dev_root).map_err(|e| invalid(key("nodes"), e))?);
            }
            let mut ann = BTreeMap::new();
            if annotations {
                ann.insert(ANNOTATION_UUID.to_string(), d.uuid.clone());
            }
            let names = std::iter::once(name.clone()).chain(d.aliases.iter().map(|a| cdi_device_name(a)));
            for n in names {
                if devices.iter().any(|x: &Device| x.name == n) {
                    return Err(invalid(key("aliases"), format!("{n:?} is already a {class} device name")));
                }
                devices.push(Device { name: n, annotations: ann.clone(), container_edits: edits.clone() });
            }
        }
        if let Some((i, d)) = node.devices.iter().enumerate().find(|(_, d)| !CLASSES.contains(&d.class.as_str())) {
            return Err(invalid(format!("devices[{i}].class"), format!("{:?} is not gpu, mig or share", d.class)));
        }
        if !devices.is_empty() {
            specs.push(Spec {
                cdi_version: version.clone(),
                kind: format!("{VENDOR}/{class}"),
                annotations: BTreeMap::new(),
                devices,
                container_edits: common.clone(),
            });
        }
    }
    Ok(specs)
}

fn common_edits(node: &NodeDevices, dev_root: &Path) -> Result<ContainerEdits, CdiError> {
    let mut edits = ContainerEdits::default();
    for (i, n) in node.control_nodes.iter().enumerate() {
        if !n.exists() {
            continue;
        }
        edits.device_nodes.push(device_node(n, dev_root).map_err(|e| invalid(format!("control_nodes[{i}]"), e))?);
    }
    let ro = || ["ro", "nosuid", "nodev", "bind"].map(String::from).to_vec();
    let driver_files = node.driver.libraries.iter().chain(&node.driver.binaries);
    // With a driver directory: one mount, and each file's usual path a link into it (made by the
    // hook entry below, `--link`); the kernel's work per mount was most of a start's cost.
    let mut links = Vec::new();
    match &node.driver_dir {
        Some(dir) if !node.driver.libraries.is_empty() || !node.driver.binaries.is_empty() => {
            edits.mounts.push(Mount {
                host_path: dir.display().to_string(),
                container_path: DRIVER_CONTAINER_DIR.into(),
                options: ro(),
            });
            for f in driver_files {
                links.push("--link".to_string());
                links.push(node.driver.container_path(f).display().to_string());
            }
        }
        _ => {
            for f in driver_files {
                edits.mounts.push(Mount {
                    host_path: f.display().to_string(),
                    container_path: node.driver.container_path(f).display().to_string(),
                    options: ro(),
                });
            }
        }
    }
    if let Some(shim) = &node.shim {
        edits.mounts.push(Mount {
            host_path: shim.display().to_string(),
            container_path: SHIM_CONTAINER_PATH.into(),
            options: ro(),
        });
    }
    let mut args = vec!["tessera-hook".to_string(), "--config".into(), node.hook_config.display().to_string()];
    let mut poststop = args.clone();
    args.push("createRuntime".into());
    args.extend(links);
    edits.hooks.push(Hook {
        hook_name: "createRuntime".into(),
        path: node.hook_binary.display().to_string(),
        args,
        env: vec![HOOK_ENV.into()],
    });
    // After the container is deleted: tells tesserad, for `--lease container` allocations.
    poststop.push("poststop".into());
    edits.hooks.push(Hook {
        hook_name: "poststop".into(),
        path: node.hook_binary.display().to_string(),
        args: poststop,
        env: vec![HOOK_ENV.into()],
    });
    Ok(edits)
}

/// A character device node's CDI entry, its numbers read with stat() from the host node.
fn device_node(host: &Path, dev_root: &Path) -> Result<DeviceNode, String> {
    let m = std::fs::metadata(host).map_err(|e| format!("{}: {e}", host.display()))?;
    if !m.file_type().is_char_device() {
        return Err(format!("{} is not a character device", host.display()));
    }
    let rdev = m.rdev();
    let container = match host.strip_prefix(dev_root) {
        Ok(rel) => Path::new("/dev").join(rel),
        Err(_) => host.to_path_buf(),
    };
    Ok(DeviceNode {
        path: container.display().to_string(),
        host_path: Some(host.display().to_string()),
        kind: Some("c".into()),
        major: Some(libc::major(rdev) as i64),
        minor: Some(libc::minor(rdev) as i64),
        permissions: Some("rwm".into()),
    })
}

/// The file a class's spec is written to.
pub fn spec_file_name(class: &str) -> String {
    format!("{VENDOR}-{class}.json")
}

/// Whether `class` is a class of Tessera's specs (the per-device classes and `claim`).
pub fn is_class(class: &str) -> bool {
    ALL_CLASSES.contains(&class)
}

/// The class a spec file's name says: `tessera.io-<class>.json`, or CDI's transient form
/// `tessera.io-<class>_<id>.json` (a claim's spec); `None` for other names.
pub fn file_class(name: &str) -> Option<&str> {
    let stem = name.strip_prefix(VENDOR)?.strip_prefix('-')?.strip_suffix(".json")?;
    let class = stem.split_once('_').map_or(stem, |(c, _)| c);
    is_class(class).then_some(class)
}

/// Writes `spec` to `dir/name` atomically: a temporary file, fsync, rename, fsync of the
/// directory (the caller's `sync_dir`, so that many files cost one directory sync).
fn write_spec_file(dir: &Path, name: &str, spec: &Spec, key: &str) -> Result<(), CdiError> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let mut text = serde_json::to_vec_pretty(spec).map_err(|e| invalid(key, e.to_string()))?;
    text.push(b'\n');
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&tmp)?;
        f.write_all(&text)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(CdiError::Io { path, source: e });
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<(), CdiError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|source| CdiError::Io { path: dir.into(), source })
}

/// Writes each spec to `tessera.io-<class>.json` atomically (temporary file, fsync, rename, fsync
/// of the directory) and removes the `tessera.io-<class>.json` of classes no longer present. Other
/// files are never touched: other vendors' specs, and the per-claim specs
/// (`tessera.io-claim_<uid>.json`), which live as long as their claim is prepared.
pub fn write_specs(dir: &Path, specs: &[Spec]) -> Result<(), CdiError> {
    std::fs::create_dir_all(dir).map_err(|source| CdiError::Io { path: dir.into(), source })?;
    let mut keep = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let class = spec
            .kind
            .strip_prefix(VENDOR)
            .and_then(|k| k.strip_prefix('/'))
            .filter(|c| CLASSES.contains(c))
            .ok_or_else(|| invalid(format!("specs[{i}].kind"), format!("{:?} is not a {VENDOR} class", spec.kind)))?;
        let name = spec_file_name(class);
        write_spec_file(dir, &name, spec, &format!("specs[{i}]"))?;
        keep.push(name);
    }
    for class in CLASSES {
        let name = spec_file_name(class);
        let path = dir.join(&name);
        if keep.contains(&name) {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(CdiError::Io { path, source }),
        }
    }
    sync_dir(dir)
}

/// One mount of what an allocation gives a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationMount {
    pub host_path: PathBuf,
    pub container_path: PathBuf,
    /// Read-write (the region); else read-only.
    pub writable: bool,
}

/// What allocation directory `alloc_dir` (`<runtime_dir>/alloc/<id>` on the host) gives a
/// container, whatever puts it there (a claim's CDI spec, the hook and the wrapper): the
/// directory read-only at [`CONTAINER_ALLOC_DIR`] (the container can neither replace its limits
/// nor add files), then its region read-write on top, in this order.
pub fn allocation_mounts(alloc_dir: &Path) -> [AllocationMount; 2] {
    [
        AllocationMount {
            host_path: alloc_dir.to_path_buf(),
            container_path: CONTAINER_ALLOC_DIR.into(),
            writable: false,
        },
        AllocationMount {
            host_path: alloc_dir.join(REGION_FILE),
            container_path: Path::new(CONTAINER_ALLOC_DIR).join(REGION_FILE),
            writable: true,
        },
    ]
}

/// The environment that names allocation `allocation` and its files to the shim, in this order:
/// `TESSERA_ALLOCATION`, `TESSERA_LIMITS`, `TESSERA_REGION` (the shim prefers the mounted
/// directory to the last two: a tenant writes its own environment).
pub fn allocation_env(allocation: &str) -> [(&'static str, String); 3] {
    [
        (ENV_ALLOCATION, allocation.to_owned()),
        (crate::ENV_LIMITS, format!("{CONTAINER_ALLOC_DIR}/{LIMITS_FILE}")),
        (crate::ENV_REGION, format!("{CONTAINER_ALLOC_DIR}/{REGION_FILE}")),
    ]
}

/// What a prepared DRA claim gives a container, for [`build_claim_spec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimDevices {
    /// The claim's UID (the spec's file and device names carry it).
    pub claim_uid: String,
    /// The allocation the claim was prepared into (`TESSERA_ALLOCATION`).
    pub allocation: String,
    /// `<runtime_dir>/alloc/<id>` on the host: mounted read-only, its `region` read-write.
    pub alloc_dir: PathBuf,
    /// The host file naming the shim's container path, mounted at `/etc/ld.so.preload` (the one
    /// the hook makes and mounts: `<runtime_dir>/hook/ld.so.preload`).
    pub preload: PathBuf,
    /// The claim's devices: `uuid` the GPU or MIG UUID, `nodes` its host nodes (`class`, `name`
    /// and `aliases` are not used: the device is named by [`claim_device_name`]).
    pub devices: Vec<NodeDevice>,
}

/// The CDI device name of device `uuid` of claim `claim_uid`: `<claim UID>-<UUID>`.
pub fn claim_device_name(claim_uid: &str, uuid: &str) -> String {
    cdi_device_name(&format!("{claim_uid}-{uuid}"))
}

/// The file a claim's spec is written to: `tessera.io-claim_<uid>.json` (CDI's transient spec name).
pub fn claim_spec_file_name(claim_uid: &str) -> String {
    format!("{VENDOR}-{CLAIM_CLASS}_{}.json", cdi_device_name(claim_uid))
}

/// The spec of one prepared claim, kind `tessera.io/claim`: one device per device of the claim,
/// each with its nodes, the allocation's directory (read-only) and region (read-write), the
/// preload naming the shim, and the environment the shim reads; the spec's own edits are the
/// class specs' (control nodes, driver files, the shim, the createRuntime entry). Always cdiVersion
/// 0.6.0 (the UUID annotation is how the hook checks a device against the allocation): the
/// runtimes a kubelet with DRA drives (containerd 1.7+, CRI-O) read it.
pub fn build_claim_spec(node: &NodeDevices, claim: &ClaimDevices) -> Result<Spec, CdiError> {
    let dev_root = if node.dev_root.as_os_str().is_empty() { Path::new("/dev") } else { &node.dev_root };
    if claim.devices.is_empty() {
        return Err(invalid("devices", format!("claim {} has no device", claim.claim_uid)));
    }
    let bind = |mode: &str, extra: &[&str]| {
        [mode, "nosuid", "nodev"].iter().chain(extra).chain(&["bind"]).map(|s| (*s).to_owned()).collect::<Vec<_>>()
    };
    let mut mounts: Vec<Mount> = allocation_mounts(&claim.alloc_dir)
        .into_iter()
        .map(|m| Mount {
            host_path: m.host_path.display().to_string(),
            container_path: m.container_path.display().to_string(),
            options: bind(if m.writable { "rw" } else { "ro" }, &["noexec"]),
        })
        .collect();
    if node.shim.is_some() {
        mounts.push(Mount {
            host_path: claim.preload.display().to_string(),
            container_path: PRELOAD_PATH.into(),
            options: bind("ro", &[]),
        });
    }
    let mut devices: Vec<Device> = Vec::new();
    for (i, d) in claim.devices.iter().enumerate() {
        let name = claim_device_name(&claim.claim_uid, &d.uuid);
        if !is_valid_device_name(&name) {
            return Err(invalid(format!("devices[{i}]"), format!("{name:?} is not a valid CDI device name")));
        }
        if devices.iter().any(|x| x.name == name) {
            continue;
        }
        let env = allocation_env(&claim.allocation).into_iter().map(|(k, v)| format!("{k}={v}"));
        let mut edits = ContainerEdits {
            env: std::iter::once(format!("{}={name}", marker_key(&name))).chain(env).collect(),
            mounts: mounts.clone(),
            ..Default::default()
        };
        for n in &d.nodes {
            edits.device_nodes.push(device_node(n, dev_root).map_err(|e| invalid(format!("devices[{i}].nodes"), e))?);
        }
        let annotations = BTreeMap::from([(ANNOTATION_UUID.to_string(), d.uuid.clone())]);
        devices.push(Device { name, annotations, container_edits: edits });
    }
    // No poststop entry: a claim's allocation is never leased (the kubelet releases it through
    // NodeUnprepareResources), so no process of ours runs at its containers' deletion.
    let mut common = common_edits(node, dev_root)?;
    common.hooks.retain(|h| h.hook_name != "poststop");
    Ok(Spec {
        cdi_version: CDI_VERSION.into(),
        kind: format!("{VENDOR}/{CLAIM_CLASS}"),
        annotations: BTreeMap::new(),
        devices,
        container_edits: common,
    })
}

/// Writes a claim's spec to `tessera.io-claim_<uid>.json`, atomically (a reader sees the old
/// spec or the new one, never a part; the rename is durable before this returns).
pub fn write_claim_spec(dir: &Path, claim_uid: &str, spec: &Spec) -> Result<(), CdiError> {
    if spec.kind != format!("{VENDOR}/{CLAIM_CLASS}") {
        return Err(invalid("kind", format!("{:?} is not {VENDOR}/{CLAIM_CLASS}", spec.kind)));
    }
    std::fs::create_dir_all(dir).map_err(|source| CdiError::Io { path: dir.into(), source })?;
    write_spec_file(dir, &claim_spec_file_name(claim_uid), spec, "spec")?;
    sync_dir(dir)
}

/// Removes a claim's spec; `Ok(false)` when there was none.
pub fn remove_claim_spec(dir: &Path, claim_uid: &str) -> Result<bool, CdiError> {
    let path = dir.join(claim_spec_file_name(claim_uid));
    match std::fs::remove_file(&path) {
        Ok(()) => sync_dir(dir).map(|()| true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(CdiError::Io { path, source }),
    }
}

/// The claim UIDs (as their file names carry them) of the claim specs in `dir`.
pub fn claim_spec_uids(dir: &Path) -> Result<Vec<String>, CdiError> {
    let prefix = format!("{VENDOR}-{CLAIM_CLASS}_");
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(CdiError::Io { path: dir.into(), source }),
    };
    let mut uids: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix(&prefix).and_then(|n| n.strip_suffix(".json")).map(str::to_owned)
        })
        .collect();
    uids.sort();
    Ok(uids)
}

/// Reads the `tessera.io-*.json` specs in `dir` (a missing directory holds none). A spec that
/// cannot be read, parsed, or is not of a Tessera class is an error naming the file.
pub fn load_specs(dir: &Path) -> Result<Vec<Spec>, CdiError> {
    load_specs_for(dir, None)
}

/// [`load_specs`], skipping the files named after a class not in `classes`
/// (`tessera.io-<class>.json` and `tessera.io-<class>_<id>.json`, as tesserad names them). A file
/// named otherwise is always read.
pub fn load_specs_for(dir: &Path, classes: Option<&[&str]>) -> Result<Vec<Spec>, CdiError> {
    Ok(load_named(dir, classes)?.into_iter().map(|(_, s)| s).collect())
}

/// [`load_specs_for`] with each spec's file name.
fn load_named(dir: &Path, classes: Option<&[&str]>) -> Result<Vec<(String, Spec)>, CdiError> {
    let mut specs = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(specs),
        Err(source) => return Err(CdiError::Io { path: dir.into(), source }),
    };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{VENDOR}-")) && n.ends_with(".json") && wanted(n, classes))
        })
        .collect();
    paths.sort();
    for path in paths {
        let text = std::fs::read(&path).map_err(|source| CdiError::Io { path: path.clone(), source })?;
        let spec: Spec =
            serde_json::from_slice(&text).map_err(|e| CdiError::Parse { path: path.clone(), reason: e.to_string() })?;
        let class_ok = spec.kind.strip_prefix(VENDOR).and_then(|k| k.strip_prefix('/')).is_some_and(is_class);
        if !class_ok {
            return Err(CdiError::Parse { path, reason: format!("kind: {:?} is not a {VENDOR} class", spec.kind) });
        }
        if let Some((i, d)) = spec.devices.iter().enumerate().find(|(_, d)| !is_valid_device_name(&d.name)) {
            return Err(CdiError::Parse { path, reason: format!("devices[{i}].name: {:?} is not valid", d.name) });
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        specs.push((name, spec));
    }
    Ok(specs)
}

/// The specs of several directories; for a kind found in more than one, the later directory wins
/// (CDI's precedence: `/var/run/cdi` over `/etc/cdi`). Claim specs, many of one kind, are kept
/// per file (a later directory's file of the same name wins).
pub fn load_spec_dirs(dirs: &[PathBuf]) -> Result<Vec<Spec>, CdiError> {
    load_spec_dirs_for(dirs, None)
}

/// [`load_spec_dirs`] of the files [`load_specs_for`] reads for `classes`.
pub fn load_spec_dirs_for(dirs: &[PathBuf], classes: Option<&[&str]>) -> Result<Vec<Spec>, CdiError> {
    let mut by_kind: BTreeMap<String, Spec> = BTreeMap::new();
    let mut claims: BTreeMap<String, Spec> = BTreeMap::new();
    for d in dirs {
        for (file, s) in load_named(d, classes)? {
            if s.class() == CLAIM_CLASS {
                claims.insert(file, s);
            } else {
                by_kind.insert(s.kind.clone(), s);
            }
        }
    }
    // In class order, then the claims.
    let mut out: Vec<Spec> = CLASSES.iter().filter_map(|c| by_kind.remove(&format!("{VENDOR}/{c}"))).collect();
    out.extend(claims.into_values());
    Ok(out)
}

/// Whether spec file `name` may hold a class in `classes`: unless it is named after another class.
fn wanted(name: &str, classes: Option<&[&str]>) -> bool {
    let Some(classes) = classes else { return true };
    file_class(name).is_none_or(|c| classes.contains(&c))
}

impl Spec {
    /// The class part of the kind (`gpu` for `tessera.io/gpu`).
    pub fn class(&self) -> &str {
        self.kind.rsplit('/').next().unwrap_or("")
    }
}

impl Device {
    /// The canonical name (the marker's value): the device's own name for a canonical entry, the
    /// aliased device's name for an alias.
    pub fn canonical(&self) -> &str {
        self.container_edits
            .env
            .iter()
            .find_map(|e| e.strip_prefix(DEVICE_MARKER_PREFIX).and_then(|kv| kv.split_once('=')).map(|(_, v)| v))
            .unwrap_or(&self.name)
    }

    /// The UUID the container's CUDA sees: the annotation when present, else derived from the name.
    pub fn uuid(&self) -> &str {
        self.annotations.get(ANNOTATION_UUID).map_or_else(|| uuid_of(self.canonical()), |s| s.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{CLAIM_UID, claim_spec, fake_node};

    #[test]
    fn names() {
        assert_eq!(cdi_device_name("GPU-5c89-x::3"), "GPU-5c89-x::3");
        assert!(is_valid_device_name("GPU-5c89-x::3"));
        assert_eq!(cdi_device_name("a b/c"), "a_b_c");
        assert!(!is_valid_device_name("-a") && !is_valid_device_name("a:") && !is_valid_device_name(""));
        assert_eq!(marker_key("GPU-aa::3"), "TESSERA_CDI_DEVICE_GPU_AA__3");
        assert_eq!(uuid_of("GPU-aa::3"), "GPU-aa");
        assert_eq!(uuid_of("MIG-bb"), "MIG-bb");
    }

    #[test]
    fn build_write_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let node = fake_node(dir.path());
        let specs = build_specs(&node).unwrap();
        assert_eq!(
            specs.iter().map(|s| s.kind.as_str()).collect::<Vec<_>>(),
            ["tessera.io/gpu", "tessera.io/mig", "tessera.io/share"]
        );
        let gpu = &specs[0];
        assert_eq!(gpu.cdi_version, "0.6.0");
        assert_eq!(gpu.devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["GPU-aaaa", "0"]);
        let n = &gpu.devices[0].container_edits.device_nodes[0];
        assert_eq!((n.path.as_str(), n.major, n.minor), ("/dev/nvidia0", Some(195), Some(0)));
        assert_eq!(gpu.devices[1].canonical(), "GPU-aaaa");
        assert_eq!(gpu.devices[0].annotations[ANNOTATION_UUID], "GPU-aaaa");
        // nvidia-modeset is absent: skipped.
        let ctl: Vec<_> = gpu.container_edits.device_nodes.iter().map(|n| n.path.as_str()).collect();
        assert_eq!(ctl, ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
        let mig = &specs[1];
        assert_eq!(mig.devices[0].container_edits.device_nodes[1].path, "/dev/nvidia-caps/nvidia-cap21");
        assert_eq!(specs[2].devices[0].uuid(), "GPU-aaaa");
        let hook = &gpu.container_edits.hooks[0];
        assert_eq!(
            (hook.hook_name.as_str(), hook.env.as_slice()),
            ("createRuntime", [HOOK_ENV.to_string()].as_slice())
        );
        // Always `--config`: the hook must find the writing daemon's paths, not its own defaults.
        assert_eq!(hook.path, crate::paths::HOOK);
        assert_eq!(hook.args, ["tessera-hook", "--config", "/run/tessera/hook.toml", "createRuntime"]);
        let post = &gpu.container_edits.hooks[1];
        assert_eq!((post.hook_name.as_str(), post.args.last().map(String::as_str)), ("poststop", Some("poststop")));

        let cdi = dir.path().join("cdi");
        std::fs::create_dir_all(&cdi).unwrap();
        std::fs::write(cdi.join("nvidia.com-gpu.json"), "{}").unwrap();
        write_specs(&cdi, &specs).unwrap();
        let text = std::fs::read_to_string(cdi.join("tessera.io-gpu.json")).unwrap();
        assert!(text.contains("\"cdiVersion\": \"0.6.0\"") && text.contains("\"containerEdits\""), "{text}");
        assert_eq!(load_specs(&cdi).unwrap(), specs);

        // A class gone: its file goes; other vendors' files stay; no temporary files remain.
        write_specs(&cdi, &specs[..1]).unwrap();
        let mut names: Vec<_> = std::fs::read_dir(&cdi).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["nvidia.com-gpu.json", "tessera.io-gpu.json"]);
        assert_eq!(load_spec_dirs(&[dir.path().join("none"), cdi.clone()]).unwrap(), specs[..1]);
    }

    #[test]
    fn a_claim_spec_carries_the_allocation_and_lives_beside_the_class_specs() {
        let dir = tempfile::tempdir().unwrap();
        let node = fake_node(dir.path());
        let run = dir.path().join("run");
        let spec = claim_spec(&node, &run, Path::new("/opt/libtessera.so"));
        assert_eq!((spec.kind.as_str(), spec.cdi_version.as_str()), ("tessera.io/claim", CDI_VERSION));
        // GPU-aaaa whole and a share of it: one device (the claim holds the GPU once).
        let name = format!("{CLAIM_UID}-GPU-aaaa");
        assert_eq!(spec.devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), [name.as_str()]);
        assert!(is_valid_device_name(&name));
        let d = &spec.devices[0];
        assert_eq!(d.uuid(), "GPU-aaaa");
        assert_eq!(d.canonical(), name);
        let env = &d.container_edits.env;
        for want in [
            format!("{}={name}", marker_key(&name)),
            "TESSERA_ALLOCATION=a1".into(),
            "TESSERA_LIMITS=/run/tessera/alloc/limits".into(),
            "TESSERA_REGION=/run/tessera/alloc/region".into(),
        ] {
            assert!(env.contains(&want), "{want} in {env:?}");
        }
        let nodes: Vec<_> =
            d.container_edits.device_nodes.iter().map(|n| (n.path.as_str(), n.major, n.minor)).collect();
        assert_eq!(nodes, [("/dev/nvidia0", Some(195), Some(0))]);
        let mounts: Vec<_> = d
            .container_edits
            .mounts
            .iter()
            .map(|m| (m.host_path.clone(), m.container_path.as_str(), m.options.join(",")))
            .collect();
        assert_eq!(
            mounts,
            [
                (
                    run.join("alloc/a1").display().to_string(),
                    "/run/tessera/alloc",
                    "ro,nosuid,nodev,noexec,bind".into()
                ),
                (
                    run.join("alloc/a1/region").display().to_string(),
                    "/run/tessera/alloc/region",
                    "rw,nosuid,nodev,noexec,bind".into()
                ),
                (
                    run.join("hook/ld.so.preload").display().to_string(),
                    "/etc/ld.so.preload",
                    "ro,nosuid,nodev,bind".into()
                ),
            ]
        );
        // The spec's own edits are the class specs': control nodes, the shim, the createRuntime
        // entry; not the poststop entry (a claim is never leased: nothing to hear at deletion).
        let shim = spec.container_edits.mounts.iter().find(|m| m.container_path == SHIM_CONTAINER_PATH).unwrap();
        assert_eq!(shim.host_path, "/opt/libtessera.so");
        let hooks: Vec<_> = spec.container_edits.hooks.iter().map(|h| h.hook_name.as_str()).collect();
        assert_eq!(hooks, ["createRuntime"]);
        assert_eq!(spec.container_edits.device_nodes.len(), 2);

        // Written beside the class specs; rewriting the class specs (any classes) keeps it.
        let cdi = dir.path().join("cdi");
        let classes = build_specs(&node).unwrap();
        write_specs(&cdi, &classes).unwrap();
        write_claim_spec(&cdi, CLAIM_UID, &spec).unwrap();
        assert!(cdi.join(format!("tessera.io-claim_{CLAIM_UID}.json")).is_file());
        write_specs(&cdi, &classes[..1]).unwrap();
        write_specs(&cdi, &[]).unwrap();
        assert_eq!(claim_spec_uids(&cdi).unwrap(), [CLAIM_UID]);
        assert_eq!(load_specs(&cdi).unwrap(), std::slice::from_ref(&spec));
        // Two claims of one kind, and the class specs: all read, claims after the classes.
        write_specs(&cdi, &classes).unwrap();
        let mut other = spec.clone();
        other.devices[0].name = "other-GPU-aaaa".into();
        write_claim_spec(&cdi, "other", &other).unwrap();
        let all = load_spec_dirs(&[dir.path().join("none"), cdi.clone()]).unwrap();
        let kinds: Vec<&str> = all.iter().map(|s| s.kind.as_str()).collect();
        assert_eq!(
            kinds,
            ["tessera.io/gpu", "tessera.io/mig", "tessera.io/share", "tessera.io/claim", "tessera.io/claim"]
        );
        // Only the claims, when only they are wanted.
        assert_eq!(load_specs_for(&cdi, Some(&[CLAIM_CLASS])).unwrap().len(), 2);
        // Removed, once; nothing else goes.
        assert!(remove_claim_spec(&cdi, CLAIM_UID).unwrap());
        assert!(!remove_claim_spec(&cdi, CLAIM_UID).unwrap());
        assert_eq!(claim_spec_uids(&cdi).unwrap(), ["other"]);
        assert_eq!(load_specs(&cdi).unwrap().len(), 4);
        // A claim spec of the wrong kind is not written; a claim without devices not built.
        assert!(write_claim_spec(&cdi, "x", &classes[0]).unwrap_err().to_string().starts_with("kind: "));
        let empty = ClaimDevices {
            claim_uid: "x".into(),
            allocation: "a".into(),
            alloc_dir: run.clone(),
            preload: run.clone(),
            devices: vec![],
        };
        assert!(build_claim_spec(&node, &empty).unwrap_err().to_string().contains("has no device"));
        assert_eq!(file_class("tessera.io-claim_x.json"), Some("claim"));
        assert_eq!(file_class("tessera.io-gpu.json"), Some("gpu"));
        assert_eq!(file_class("tessera.io-extra.json"), None);
    }

    #[test]
    fn readers_never_see_half_a_spec() {
        let dir = tempfile::tempdir().unwrap();
        let node = fake_node(dir.path());
        let full = build_specs(&node).unwrap();
        let mut small = full.clone();
        small[0].devices.truncate(1);
        let cdi = dir.path().join("cdi");
        write_specs(&cdi, &full).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (cdi, stop) = (cdi.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut reads = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let specs = load_specs(&cdi).expect("every read sees a whole spec");
                    assert!(specs.len() == 3, "a class vanished mid-rewrite");
                    reads += 1;
                }
                reads
            })
        };
        for i in 0..40 {
            write_specs(&cdi, if i % 2 == 0 { &small } else { &full }).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
    }

    /// A driver directory: the specs mount it once and the hook entry links each file into it;
    /// no files found, or none prepared, means a mount per file (or none) as before.
    #[test]
    fn a_driver_directory_is_one_mount_and_the_hook_links_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut node = fake_node(dir.path());
        let lib = Path::new("/usr/lib/x86_64-linux-gnu");
        node.driver = DriverFiles {
            root: "/".into(),
            libraries: vec![lib.join("libcuda.so.1"), lib.join("libnvidia-ml.so.1")],
            binaries: vec!["/usr/bin/nvidia-smi".into()],
        };
        node.driver_dir = Some("/var/lib/tessera/driver/k1".into());
        let specs = build_specs(&node).unwrap();
        let edits = &specs[0].container_edits;
        let driver: Vec<_> = edits.mounts.iter().map(|m| (m.host_path.as_str(), m.container_path.as_str())).collect();
        assert_eq!(driver, [("/var/lib/tessera/driver/k1", DRIVER_CONTAINER_DIR)]);
        assert_eq!(edits.mounts[0].options, ["ro", "nosuid", "nodev", "bind"]);
        let create = edits.hooks.iter().find(|h| h.hook_name == "createRuntime").unwrap();
        assert_eq!(
            create.args[4..],
            [
                "--link",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                "--link",
                "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
                "--link",
                "/usr/bin/nvidia-smi"
            ]
        );
        let poststop = edits.hooks.iter().find(|h| h.hook_name == "poststop").unwrap();
        assert!(!poststop.args.iter().any(|a| a == "--link"));
        node.driver_dir = None;
        let per_file = build_specs(&node).unwrap();
        assert_eq!(per_file[0].container_edits.mounts.len(), 3);
        node.driver = DriverFiles::default();
        node.driver_dir = Some("/var/lib/tessera/driver/k1".into());
        assert!(build_specs(&node).unwrap()[0].container_edits.mounts.is_empty());
    }

    #[test]
    fn compat_version_has_no_annotations() {
        let dir = tempfile::tempdir().unwrap();
        let mut node = fake_node(dir.path());
        node.cdi_version = Some(CDI_VERSION_COMPAT.into());
        let specs = build_specs(&node).unwrap();
        assert!(specs.iter().all(|s| s.cdi_version == "0.5.0" && s.devices.iter().all(|d| d.annotations.is_empty())));
        assert_eq!(specs[1].devices[0].uuid(), "MIG-bbbb");
        node.cdi_version = Some("0.9.9".into());
        assert!(build_specs(&node).unwrap_err().to_string().starts_with("cdi_version: "));
    }

    #[test]
    fn bad_inputs_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let mut node = fake_node(dir.path());
        node.devices[0].nodes.push(dir.path().join("dev/missing"));
        assert!(build_specs(&node).unwrap_err().to_string().starts_with("devices[0].nodes: "));
        let mut node = fake_node(dir.path());
        node.devices[2].aliases.push("0".into());
        node.devices[1].class = "tpu".into();
        assert!(build_specs(&node).unwrap_err().to_string().starts_with("devices[1].class: "));
        let mut node = fake_node(dir.path());
        node.devices[0].aliases.push("GPU-aaaa".into());
        assert!(build_specs(&node).unwrap_err().to_string().starts_with("devices[0].aliases: "));
        let cdi = dir.path().join("cdi");
        std::fs::create_dir_all(&cdi).unwrap();
        std::fs::write(cdi.join("tessera.io-gpu.json"), "{\"cdiVersion\": 1}").unwrap();
        let e = load_specs(&cdi).unwrap_err().to_string();
        assert!(e.starts_with(&cdi.join("tessera.io-gpu.json").display().to_string()), "{e}");
    }
}
