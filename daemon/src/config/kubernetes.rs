//! `[kubernetes]`: how the node's GPUs reach Kubernetes — the device plugin (count resources),
//! Dynamic Resource Allocation (the DRA driver `gpu.tessera.io`: ResourceSlices, the kubelet's
//! DRA service), or both on disjoint GPUs — and where the kubelet and the API server are.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ConfigError, absolute, is_dns_subdomain};

/// `kubernetes.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// The device plugin only (count resources such as `tessera.io/gpu-share`).
    #[default]
    DevicePlugin,
    /// The DRA driver only: every GPU is published in ResourceSlices.
    Dra,
    /// Both, on disjoint GPUs: the GPUs a `[partitions]` entry names stay with the device
    /// plugin, the others are published for DRA.
    Both,
}

impl Mode {
    /// Whether the device-plugin servers run.
    pub fn device_plugin(self) -> bool {
        matches!(self, Mode::DevicePlugin | Mode::Both)
    }

    /// Whether the DRA driver runs.
    pub fn dra(self) -> bool {
        matches!(self, Mode::Dra | Mode::Both)
    }
}

/// `[kubernetes]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Kubernetes {
    /// `device-plugin`, `dra` or `both`.
    pub mode: Mode,
    /// The kubelet's plugins directory: the DRA service's socket goes in `<plugins_dir>/gpu.tessera.io/`.
    pub plugins_dir: PathBuf,
    /// The kubelet's plugin-registration directory, which its plugin watcher watches.
    pub plugins_registry_dir: PathBuf,
    /// A kubeconfig file for the API server. Unset: `KUBECONFIG`, else the in-cluster service
    /// account, else `~/.kube/config`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<PathBuf>,
    /// This node's name in the cluster. Unset: the `NODE_NAME` environment variable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Patch GPU labels (`tessera.io/…`) onto the Node when an API server is configured.
    pub labels: bool,
}

impl Default for Kubernetes {
    fn default() -> Self {
        Kubernetes {
            mode: Mode::DevicePlugin,
            plugins_dir: PathBuf::from("/var/lib/kubelet/plugins"),
            plugins_registry_dir: PathBuf::from("/var/lib/kubelet/plugins_registry"),
            kubeconfig: None,
            node_name: None,
            labels: true,
        }
    }
}

/// The longest socket path a Unix socket takes (`sun_path` holds 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;
/// The longest socket name the DRA driver puts in either directory (`gpu.tessera.io-reg.sock`,
/// `gpu.tessera.io/dra.sock`).
const LONGEST_SOCKET_NAME: usize = "gpu.tessera.io/dra.sock".len() + 1;

pub(super) fn validate(k: &Kubernetes) -> Result<(), ConfigError> {
    for (key, dir) in
        [("kubernetes.plugins_dir", &k.plugins_dir), ("kubernetes.plugins_registry_dir", &k.plugins_registry_dir)]
    {
        absolute(key, dir)?;
        if dir.as_os_str().len() + LONGEST_SOCKET_NAME > MAX_SOCKET_PATH {
            return Err(ConfigError::new(
                key,
                format!(
                    "{:?} is too long: the sockets in it would pass the {MAX_SOCKET_PATH} bytes a Unix socket path may have",
                    dir.display().to_string()
                ),
            ));
        }
    }
    if let Some(path) = &k.kubeconfig {
        if path.as_os_str().is_empty() {
            return Err(ConfigError::new(
                "kubernetes.kubeconfig",
                "is empty; leave it out for KUBECONFIG or the in-cluster service account",
            ));
        }
        absolute("kubernetes.kubeconfig", path)?;
    }
    if let Some(name) = &k.node_name
        && !is_node_name(name)
    {
        return Err(ConfigError::new(
            "kubernetes.node_name",
            format!(
                "{name:?} is not a node name (a DNS subdomain: lowercase letters, digits, '-' and '.', at most 253); \
                 leave it out to use NODE_NAME"
            ),
        ));
    }
    Ok(())
}

/// This node's name: the `kubernetes.node_name` key, else `NODE_NAME`.
pub fn node_name(cfg: &super::Config) -> Result<String, String> {
    if let Some(name) = &cfg.kubernetes.node_name {
        return Ok(name.clone());
    }
    match std::env::var("NODE_NAME") {
        Ok(name) if is_node_name(&name) => Ok(name),
        Ok(name) => Err(format!(
            "NODE_NAME {name:?} is not a node name (lowercase letters, digits, '-' and '.'); \
             set it to the Node's name or set kubernetes.node_name"
        )),
        Err(_) => Err("kubernetes.mode needs this node's name: set NODE_NAME (the downward API's spec.nodeName) \
             or kubernetes.node_name"
            .into()),
    }
}

/// Whether `name` is a Kubernetes node name (an RFC 1123 DNS subdomain).
pub fn is_node_name(name: &str) -> bool {
    is_dns_subdomain(name)
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    #[track_caller]
    fn refused(text: &str, key: &str, reason_part: &str) {
        let e = Config::parse(text).expect_err("should be refused");
        assert_eq!(e.key, key, "{e}");
        assert!(e.reason.contains(reason_part), "reason {:?} lacks {reason_part:?}", e.reason);
    }

    #[test]
    fn defaults_are_the_kubelets_directories_and_the_device_plugin() {
        let k = Config::parse("").unwrap().kubernetes;
        assert_eq!(k.mode, Mode::DevicePlugin);
        assert!(k.mode.device_plugin() && !k.mode.dra());
        assert_eq!(k.plugins_dir, PathBuf::from("/var/lib/kubelet/plugins"));
        assert_eq!(k.plugins_registry_dir, PathBuf::from("/var/lib/kubelet/plugins_registry"));
        assert_eq!((k.kubeconfig, k.node_name, k.labels), (None, None, true));
    }

    #[test]
    fn every_key_parses() {
        let c = Config::parse(
            r#"
[kubernetes]
mode = "both"
plugins_dir = "/k/plugins"
plugins_registry_dir = "/k/registry"
kubeconfig = "/etc/tessera/kubeconfig"
node_name = "gpu-node-7.example"
labels = false
"#,
        )
        .unwrap();
        let k = c.kubernetes;
        assert_eq!(k.mode, Mode::Both);
        assert!(k.mode.device_plugin() && k.mode.dra());
        assert_eq!(k.plugins_dir, PathBuf::from("/k/plugins"));
        assert_eq!(k.plugins_registry_dir, PathBuf::from("/k/registry"));
        assert_eq!(k.kubeconfig, Some(PathBuf::from("/etc/tessera/kubeconfig")));
        assert_eq!(k.node_name.as_deref(), Some("gpu-node-7.example"));
        assert!(!k.labels);
        assert_eq!(Config::parse("[kubernetes]\nmode = \"dra\"").unwrap().kubernetes.mode, Mode::Dra);
    }

    #[test]
    fn mistakes_name_the_key() {
        refused("[kubernetes]\nmode = \"plugin\"", "kubernetes.mode", "unknown variant");
        refused("[kubernetes]\nplugins_dir = \"plugins\"", "kubernetes.plugins_dir", "not an absolute path");
        refused("[kubernetes]\nplugins_registry_dir = \"reg\"", "kubernetes.plugins_registry_dir", "absolute");
        let long = format!("[kubernetes]\nplugins_dir = \"/{}\"", "d".repeat(90));
        refused(&long, "kubernetes.plugins_dir", "too long");
        refused("[kubernetes]\nkubeconfig = \"\"", "kubernetes.kubeconfig", "is empty");
        refused("[kubernetes]\nkubeconfig = \"kube.yaml\"", "kubernetes.kubeconfig", "absolute");
        refused("[kubernetes]\nnode_name = \"Node_1\"", "kubernetes.node_name", "not a node name");
        refused("[kubernetes]\nnode_name = \"\"", "kubernetes.node_name", "not a node name");
        refused("[kubernetes]\nnode_name = \"a..b\"", "kubernetes.node_name", "not a node name");
        refused("[kubernetes]\nlabels = \"yes\"", "kubernetes.labels", "expected a boolean");
        refused("[kubernetes]\nmodes = \"dra\"", "kubernetes.modes", "unknown field");
    }

    #[test]
    fn node_names() {
        assert!(is_node_name("ip-10-0-0-1.ec2.internal"));
        assert!(is_node_name("n"));
        assert!(!is_node_name("-n"));
        assert!(!is_node_name(&"a".repeat(64)));
        assert!(!is_node_name("UPPER"));
    }
}
