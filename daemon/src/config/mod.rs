//! The daemon's configuration: one TOML file (default [`DEFAULT_PATH`]), parsed with unknown keys
//! refused, then checked as a whole ([`validate`]) so that every mistake is an error naming the key
//! and the reason before anything touches a GPU. What depends on the hardware (MIG profile names,
//! whether shares fit a GPU's memory) is checked later against the discovered model
//! (`partition::layout`). Every option is documented in `docs/configuration.md`.

pub mod enforcement;
pub mod kubernetes;
mod reload;
mod shares;
mod validate;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tessera_region::paths;

pub use reload::{Change, Reload, When, reload};
pub use shares::{ByteSize, ShareSize, SharesSpec};
pub(crate) use validate::quote_key;
pub use validate::{MAX_SHARES, is_profile_name};

/// Where the daemon looks for its configuration when `--config` is not given.
pub const DEFAULT_PATH: &str = tessera_region::paths::DAEMON_CONFIG;
/// The NVML library of the real driver (what `nvml_library` means when unset).
pub const DRIVER_NVML: &str = "libnvidia-ml.so.1";

/// The whole configuration. Every field has a default, so an empty file is a valid configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// NVML library to load. Unset: the driver's `libnvidia-ml.so.1` (under `injection.driver_root`
    /// when that is not `/`); never the simulator unasked. Set: exactly this library.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvml_library: Option<PathBuf>,
    /// Use the simulated node (`libtessera_sim.so`) instead of the driver; same as `--sim`.
    pub sim: bool,
    /// The kubelet's device-plugin directory: its `kubelet.sock`, and our sockets beside it.
    pub device_plugin_dir: PathBuf,
    /// Crash-safe daemon state (allocations).
    pub state_dir: PathBuf,
    /// Runtime files: per-allocation directories (limits, region, ledger), the node API socket.
    pub runtime_dir: PathBuf,
    /// The node API (tessera.v1) socket. Unset: `<runtime_dir>/tessera.sock`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_api_socket: Option<PathBuf>,
    /// The kubelet's pod-resources API socket, read to learn which pod holds each allocation and
    /// which allocations' containers are gone. Empty: off.
    pub pod_resources_socket: PathBuf,
    /// tesserad's log lines on stderr: `text` (one line each, colours only on a terminal) or
    /// `json` (one object each, for log pipelines). `--log-format` overrides it.
    pub log_format: LogFormat,
    /// How resources are named and shares placed.
    pub resources: Resources,
    /// Metrics and OTLP export; nothing listens or sends unless configured.
    pub telemetry: Telemetry,
    /// GPU health checking.
    pub health: Health,
    /// Memory limits enforced from the driver's per-process figures (kill or report).
    pub enforcement: enforcement::Settings,
    /// Defaults for the limits of shares (what `libtessera.so` enforces).
    pub limits: ShareLimits,
    /// How containers get their devices: the CDI specs written for container runtimes.
    pub injection: Injection,
    /// Partitions: `default` for every GPU, or per GPU by index (`"0"`) or UUID (`"GPU-…"`).
    /// A GPU no entry names is left as it is (unmanaged).
    pub partitions: BTreeMap<String, PartitionSpec>,
    /// Device plugin, DRA or both; the kubelet's plugin directories and the API server.
    pub kubernetes: kubernetes::Kubernetes,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            nvml_library: None,
            sim: false,
            device_plugin_dir: PathBuf::from("/var/lib/kubelet/device-plugins/"),
            state_dir: PathBuf::from(paths::STATE_DIR),
            runtime_dir: PathBuf::from(paths::RUNTIME_DIR),
            node_api_socket: None,
            pod_resources_socket: PathBuf::from(tessera_proto::podresources::v1::POD_RESOURCES_SOCKET),
            log_format: LogFormat::Text,
            resources: Resources::default(),
            telemetry: Telemetry::default(),
            health: Health::default(),
            enforcement: enforcement::Settings::default(),
            limits: ShareLimits::default(),
            injection: Injection::default(),
            partitions: BTreeMap::new(),
            kubernetes: kubernetes::Kubernetes::default(),
        }
    }
}

/// `log_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (`journalctl`, `kubectl logs`).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[resources]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Resources {
    /// Resource name prefix (a DNS subdomain): `tessera.io/gpu`, `tessera.io/mig-1g.10gb`, ….
    pub prefix: String,
    /// Which share a request gets: `packed` (fill one GPU first) or `spread` (least loaded GPU).
    pub share_placement: Placement,
}

impl Default for Resources {
    fn default() -> Self {
        Resources { prefix: "tessera.io".into(), share_placement: Placement::Packed }
    }
}

/// Share placement policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Fill the busiest device that still has room (keeps whole devices free).
    #[default]
    Packed,
    /// Use the least busy device (spreads load).
    Spread,
}

/// `[telemetry]`: off by default.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Telemetry {
    /// Prometheus `/metrics` listen address (`host:port`), or `unix:PATH`: an owner-only Unix
    /// socket (0600), the private choice (a TCP port, loopback too, is open to every local
    /// user). Unset: no metrics endpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// OTLP/gRPC collector to export metrics and logs to (`http://…` or `https://…`). Unset: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
}

/// `[health]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Health {
    /// Watch XIDs, ECC errors and lost GPUs, and report devices unhealthy to the kubelet.
    pub enabled: bool,
    /// Seconds between polls of what NVML events do not report (1..=3600).
    pub interval_seconds: u64,
    /// XIDs caused by applications, not the GPU: they never make a device unhealthy.
    pub ignored_xids: Vec<u32>,
    /// XIDs that always make a device unhealthy, whatever the built-in XID table says.
    pub fatal_xids: Vec<u32>,
    /// How long a recovered device must keep passing probes before it is healthy again
    /// (milliseconds, 0..=3600000).
    pub recovery_check_ms: u64,
}

impl Default for Health {
    fn default() -> Self {
        // The application-caused XIDs the Kubernetes NVIDIA device plugin ignores too.
        Health {
            enabled: true,
            interval_seconds: 5,
            ignored_xids: vec![13, 31, 43, 45, 68, 109],
            fatal_xids: Vec::new(),
            recovery_check_ms: 10_000,
        }
    }
}

/// `[limits]`: how shares are enforced by `libtessera.so`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShareLimits {
    /// `strict` (never above the SM share) or `work-conserving` (borrow idle time).
    pub compute_mode: String,
    /// Priority of share allocations: `low`, `normal` or `high`.
    pub priority: String,
    /// The most allocations the node API's `Allocate` may hold at once (shares, MIG devices and
    /// whole GPUs together); past it `Allocate` is refused (RESOURCE_EXHAUSTED). Each costs two
    /// mounts, files and a little of every periodic pass.
    pub max_allocations: u32,
}

/// `limits.max_allocations` when unset.
pub const DEFAULT_MAX_ALLOCATIONS: u32 = 1024;

impl Default for ShareLimits {
    fn default() -> Self {
        ShareLimits {
            compute_mode: "strict".into(),
            priority: "normal".into(),
            max_allocations: DEFAULT_MAX_ALLOCATIONS,
        }
    }
}

/// `[injection]`: the CDI specs (`tessera.io/gpu`, `/mig`, `/share`) the daemon writes for
/// container runtimes, and the host files they put into containers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Injection {
    /// Where the specs are written (`tessera.io-<class>.json`). Empty: no specs.
    pub cdi_spec_dir: PathBuf,
    /// `0.6.0`, or `0.5.0` for runtimes that refuse newer specs (podman 4.3).
    pub cdi_version: String,
    /// The host driver's root as the daemon sees it: its libraries and tools (and NVML, when
    /// `nvml_library` is unset and this is not `/`), and `proc/driver/nvidia-caps/mig-minors`.
    pub driver_root: PathBuf,
    /// The same root as the host (and so the runtime and the hook) sees it, for the paths written
    /// into specs; empty: `driver_root`. A daemon in a container sees the host's driver root
    /// where it is mounted (`/driver-root`), the host at `/` or `/run/nvidia/driver`.
    #[serde(skip_serializing_if = "is_empty_path")]
    pub host_driver_root: PathBuf,
    /// Where the GPU device nodes are (`nvidia<minor>`, `nvidiactl`, `nvidia-caps/`).
    pub dev_root: PathBuf,
    /// `libtessera.so` on the host, preloaded in containers. Empty: no shim.
    pub shim_path: PathBuf,
    /// `tessera-hook` on the host (the specs' `createRuntime` hook).
    pub hook_path: PathBuf,
    /// Gather the driver's files once into `<state_dir>/driver/<key>` and give a container one
    /// mount of it (and a link per file); `false`: one mount per file.
    pub driver_dir: bool,
}

impl Default for Injection {
    fn default() -> Self {
        Injection {
            cdi_spec_dir: PathBuf::from(paths::CDI_SPEC_DIR),
            cdi_version: "0.6.0".into(),
            driver_root: PathBuf::from("/"),
            host_driver_root: PathBuf::new(),
            dev_root: PathBuf::from("/dev"),
            shim_path: PathBuf::from(paths::SHIM),
            hook_path: PathBuf::from(paths::HOOK),
            driver_dir: true,
        }
    }
}

impl Injection {
    /// The driver root as the host sees it: `host_driver_root`, else `driver_root`.
    pub fn host_driver_root(&self) -> &Path {
        if self.host_driver_root.as_os_str().is_empty() { &self.driver_root } else { &self.host_driver_root }
    }
}

fn is_empty_path(p: &Path) -> bool {
    p.as_os_str().is_empty()
}

/// One partition declaration (`[partitions.<key>]`): exactly one of `whole`, `mig`, `shares`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartitionSpec {
    /// The GPU is handed out whole (MIG mode turned off if it was on).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub whole: bool,
    /// MIG layout: profile name → count, as mig-parted declares them (`{ "1g.10gb" = 7 }`).
    /// Empty: MIG mode on, no instances.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig: Option<BTreeMap<String, u32>>,
    /// Time-slicing of the whole GPU: `{ count = N }` or a list of sizes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shares: Option<SharesSpec>,
    /// Time-slicing of MIG instances, per profile of `mig`: every instance of that profile is
    /// split the same way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_shares: Option<BTreeMap<String, SharesSpec>>,
    /// Whether tesserad may reset the GPU itself to finish a MIG mode change; unset: the
    /// `default` entry's, else `never`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reset: Option<ResetPolicy>,
}

/// `reset` in a `[partitions.<key>]` entry: who finishes a MIG mode change (which takes effect
/// only at a GPU reset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ResetPolicy {
    /// An operator resets the GPU (`nvidia-smi -r`); tesserad applies the layout once NVML shows it.
    #[default]
    Never,
    /// tesserad resets the GPU itself (`nvmlDeviceResetGpu`) once none of its devices is held
    /// and no process uses it.
    WhenFree,
}

/// What a validated [`PartitionSpec`] asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PartitionKind<'a> {
    /// The whole GPU, MIG mode off.
    Whole,
    /// A MIG layout, and shares of some of its profiles.
    Mig { profiles: &'a BTreeMap<String, u32>, shares: Option<&'a BTreeMap<String, SharesSpec>> },
    /// Shares of the whole GPU, MIG mode off.
    Shares(&'a SharesSpec),
}

impl PartitionKind<'_> {
    /// `whole`, `mig` or `shares`, as the file spells them.
    pub fn name(&self) -> &'static str {
        match self {
            PartitionKind::Whole => "whole",
            PartitionKind::Mig { .. } => "mig",
            PartitionKind::Shares(_) => "shares",
        }
    }
}

impl PartitionSpec {
    /// The kind; `None` when the spec declares none or several (which validation refuses).
    pub fn kind(&self) -> Option<PartitionKind<'_>> {
        match (self.whole, &self.mig, &self.shares) {
            (true, None, None) => Some(PartitionKind::Whole),
            (false, Some(profiles), None) => Some(PartitionKind::Mig { profiles, shares: self.mig_shares.as_ref() }),
            (false, None, Some(s)) => Some(PartitionKind::Shares(s)),
            _ => None,
        }
    }
}

/// Which GPU a `[partitions.<key>]` entry names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSelector {
    /// `default`: every GPU not named otherwise.
    Default,
    /// By NVML index.
    Index(u32),
    /// By UUID (`GPU-…`).
    Uuid(String),
}

impl GpuSelector {
    /// Parses a partitions key; the error is the reason.
    pub fn parse(key: &str) -> Result<GpuSelector, String> {
        if key == "default" {
            return Ok(GpuSelector::Default);
        }
        if !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()) {
            return key.parse().map(GpuSelector::Index).map_err(|_| format!("GPU index {key} is out of range"));
        }
        if key.starts_with("GPU-") && key.len() > 4 {
            return Ok(GpuSelector::Uuid(key.to_string()));
        }
        if key.starts_with("MIG-") {
            return Err(
                "partitions are declared per GPU (index or GPU-UUID); MIG instances come from the GPU's `mig` layout"
                    .into(),
            );
        }
        Err("expected `default`, a GPU index such as \"0\", or a GPU UUID (\"GPU-…\")".into())
    }
}

/// A configuration error: the file, the key (dotted, as in the file) and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The file, when the configuration came from one.
    pub path: Option<PathBuf>,
    /// The dotted key, e.g. `partitions.0.mig`; empty for the file as a whole.
    pub key: String,
    /// Why.
    pub reason: String,
}

impl ConfigError {
    pub(crate) fn new(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
        ConfigError { path: None, key: key.into(), reason: reason.into() }
    }
}

/// `p` of `key` is absolute; else the error.
fn absolute(key: &str, p: &Path) -> Result<(), ConfigError> {
    if p.is_absolute() {
        Ok(())
    } else {
        Err(ConfigError::new(key, format!("{:?} is not an absolute path", p.display().to_string())))
    }
}

/// Whether `name` is an RFC 1123 DNS subdomain: at most 253 bytes of dot-separated labels, each
/// 1 to 63 lowercase letters, digits and '-', not starting or ending with '-'.
fn is_dns_subdomain(name: &str) -> bool {
    let label = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    !name.is_empty() && name.len() <= 253 && name.split('.').all(label)
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(p) = &self.path {
            write!(f, "{}: ", p.display())?;
        }
        if self.key.is_empty() { write!(f, "{}", self.reason) } else { write!(f, "{}: {}", self.key, self.reason) }
    }
}

impl Config {
    /// Reads, parses and validates a configuration file. A missing file at the default path
    /// is the default configuration; a missing file named explicitly is an error.
    pub fn load(path: &Path, explicit: bool) -> Result<Config, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => String::new(),
            Err(e) => {
                return Err(ConfigError { path: Some(path.to_path_buf()), key: String::new(), reason: e.to_string() });
            }
        };
        Config::parse(&text).map_err(|mut e| {
            e.path = Some(path.to_path_buf());
            e
        })
    }

    /// Parses and validates configuration text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| {
            let key = e.span().map(|s| key_at(text, s.start)).unwrap_or_default();
            let line = e.span().map(|s| text[..s.start.min(text.len())].lines().count().max(1));
            let message = e.message().trim_end();
            let reason = match line {
                Some(l) => format!("{message} (line {l})"),
                None => message.to_string(),
            };
            ConfigError::new(key, reason)
        })?;
        validate::validate(&config)?;
        Ok(config)
    }

    /// The node API socket: configured, else `<runtime_dir>/tessera.sock`.
    pub fn node_api_socket(&self) -> PathBuf {
        self.node_api_socket.clone().unwrap_or_else(|| self.runtime_dir.join("tessera.sock"))
    }

    /// The partition declared for a GPU: by UUID, else by index, else `default`, else none.
    /// Returns the key it was declared under with it.
    pub fn partition_for(&self, index: u32, uuid: &str) -> Option<(&str, &PartitionSpec)> {
        let by = |k: &str| self.partitions.get_key_value(k).map(|(k, v)| (k.as_str(), v));
        by(uuid).or_else(|| by(&index.to_string())).or_else(|| by("default"))
    }

    /// The `reset` policy for a GPU: its entry's, else `[partitions.default]`'s, else `never`.
    pub fn reset_policy(&self, index: u32, uuid: &str) -> ResetPolicy {
        self.partition_for(index, uuid)
            .and_then(|(_, s)| s.reset)
            .or_else(|| self.partitions.get("default").and_then(|s| s.reset))
            .unwrap_or_default()
    }
}

/// The dotted key at a byte offset of TOML text, for serde errors (which carry a span, not a
/// path): the last table header before it, and the key on its line.
fn key_at(text: &str, offset: usize) -> String {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    let line = text[line_start..line_end].trim();
    let header_of = |l: &str| -> Option<String> {
        let l = l.trim();
        if !l.starts_with('[') {
            return None;
        }
        let inner = l.trim_start_matches('[');
        let end = inner.find(']')?;
        Some(clean_key(&inner[..end]))
    };
    if let Some(h) = header_of(line) {
        return h;
    }
    let header = text[..line_start].lines().rev().find_map(header_of);
    let key = line.split_once('=').map(|(k, _)| clean_key(k));
    match (header, key) {
        (Some(h), Some(k)) => format!("{h}.{k}"),
        (None, Some(k)) => k,
        (Some(h), None) => h,
        (None, None) => String::new(),
    }
}

/// `a . "b" .c` → `a.b.c`.
fn clean_key(k: &str) -> String {
    k.split('.').map(|p| p.trim().trim_matches('"').trim_matches('\'')).collect::<Vec<_>>().join(".")
}

#[cfg(test)]
mod tests;
