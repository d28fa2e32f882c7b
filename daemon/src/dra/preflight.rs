//! Whether this cluster can run the DRA driver at all, asked once at start in `kubernetes.mode`
//! `dra` and `both`: an API server that serves `resource.k8s.io/v1` (Kubernetes 1.34 or newer,
//! with the group not turned off by `--runtime-config`), and a kubelet on this node with a DRA
//! plugin API tesserad speaks (v1beta1 from 1.32, v1 from 1.34). Where one is missing, tesserad
//! says which in one log line and serves every GPU through the device plugin instead, as
//! `mode = "device-plugin"` would (never an exit, which a DaemonSet would restart forever).
//! An API server that cannot be asked (down, unreachable) proves nothing: the DRA driver starts
//! as configured and its publisher retries.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;

/// How long the questions may take together before the answer is "cannot tell".
pub const ASK_TIMEOUT: Duration = Duration::from_secs(10);

/// The first Kubernetes minor version that serves `resource.k8s.io/v1`.
pub const FIRST_V1_MINOR: u32 = 34;
/// The first kubelet minor version with a DRA plugin API tesserad serves (v1beta1).
pub const FIRST_KUBELET_MINOR: u32 = 32;

/// Why the DRA driver cannot run on this cluster.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error(
        "the API server is {version}, older than Kubernetes 1.34: it does not serve resource.k8s.io/v1, \
         which the DRA driver gpu.tessera.io needs (upgrade the control plane to 1.34 or newer)"
    )]
    ApiServerTooOld { version: String },
    #[error(
        "the API server ({version}) does not serve resource.k8s.io/v1 (turned off by kube-apiserver's \
         --runtime-config?): the DRA driver gpu.tessera.io needs it (set resource.k8s.io/v1=true)"
    )]
    NoResourceV1 { version: String },
    #[error(
        "the kubelet on node {node} is {version}, which has no DRA plugin API this driver speaks \
         (v1beta1 from Kubernetes 1.32, v1 from 1.34): upgrade the kubelet"
    )]
    KubeletTooOld { node: String, version: String },
}

/// (major, minor) of a Kubernetes version: `major` and `minor` (`1`, `33+`), else `gitVersion`
/// (`v1.33.2-gke.100`).
pub fn major_minor(major: &str, minor: &str, git_version: &str) -> Option<(u32, u32)> {
    let number = |s: &str| s.trim_end_matches('+').parse::<u32>().ok();
    number(major).zip(number(minor)).or_else(|| {
        let mut parts = git_version.trim_start_matches('v').split(['.', '-', '+']);
        number(parts.next()?).zip(number(parts.next()?))
    })
}

/// What the API server and this node's kubelet say: `Ok(None)` when DRA can run, `Ok(Some(why))`
/// when it cannot, `Err` when they could not be asked (then nothing is known).
pub async fn check(client: &kube::Client, node: &str) -> Result<Option<Unavailable>, String> {
    let info = client.apiserver_version().await.map_err(|e| format!("GET /version: {e}"))?;
    let version = info.git_version.clone();
    if major_minor(&info.major, &info.minor, &info.git_version).is_some_and(|v| v < (1, FIRST_V1_MINOR)) {
        return Ok(Some(Unavailable::ApiServerTooOld { version }));
    }
    match client.list_api_group_resources("resource.k8s.io/v1").await {
        Ok(list) if list.resources.iter().any(|r| r.name == "resourceslices") => {}
        Ok(_) => return Ok(Some(Unavailable::NoResourceV1 { version })),
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Some(Unavailable::NoResourceV1 { version })),
        Err(e) => return Err(format!("GET /apis/resource.k8s.io/v1: {e}")),
    }
    // The Node may not be registered yet, or readable (RBAC): then the kubelet is not judged.
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    if let Ok(Some(n)) = nodes.get_opt(node).await {
        let kubelet = n.status.and_then(|s| s.node_info).map(|i| i.kubelet_version).unwrap_or_default();
        if major_minor("", "", &kubelet).is_some_and(|v| v < (1, FIRST_KUBELET_MINOR)) {
            return Ok(Some(Unavailable::KubeletTooOld { node: node.to_owned(), version: kubelet }));
        }
    }
    Ok(None)
}

/// [`check`] within [`ASK_TIMEOUT`]; `None` (with a warning) when it could not tell.
pub async fn unavailable(client: &kube::Client, node: &str) -> Option<Unavailable> {
    match tokio::time::timeout(ASK_TIMEOUT, check(client, node)).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot ask the API server whether it serves DRA; starting the DRA driver as configured");
            None
        }
        Err(_) => {
            tracing::warn!(
                timeout_s = ASK_TIMEOUT.as_secs(),
                "the API server did not answer whether it serves DRA; starting the DRA driver as configured"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_as_the_api_server_and_kubelet_write_them() {
        assert_eq!(major_minor("1", "33", "v1.33.2"), Some((1, 33)));
        assert_eq!(major_minor("1", "34+", ""), Some((1, 34)));
        assert_eq!(major_minor("", "", "v1.31.4-gke.100"), Some((1, 31)));
        assert_eq!(major_minor("", "", "v1.37.2"), Some((1, 37)));
        assert_eq!(major_minor("", "", "garbage"), None);
    }

    #[test]
    fn each_reason_names_what_is_missing_and_what_to_do() {
        let old = Unavailable::ApiServerTooOld { version: "v1.33.2".into() }.to_string();
        assert!(old.contains("v1.33.2") && old.contains("resource.k8s.io/v1") && old.contains("upgrade"), "{old}");
        let off = Unavailable::NoResourceV1 { version: "v1.37.2".into() }.to_string();
        assert!(off.contains("--runtime-config") && off.contains("resource.k8s.io/v1=true"), "{off}");
        let kubelet = Unavailable::KubeletTooOld { node: "n1".into(), version: "v1.31.0".into() }.to_string();
        assert!(kubelet.contains("n1") && kubelet.contains("v1.31.0") && kubelet.contains("kubelet"), "{kubelet}");
    }
}
