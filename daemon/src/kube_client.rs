//! The connection to the Kubernetes API server, for every face that talks to it: the DRA driver
//! (slices, claims, their status) and the Kubernetes writer (Events, Node labels).

/// A client for the API server: `kubeconfig` when given, else kube-rs's inference (`KUBECONFIG`,
/// the in-cluster service account, `~/.kube/config`).
pub async fn connect(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client, String> {
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("kubernetes.kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| format!("kubernetes.kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            format!("no API server configured (KUBECONFIG, in-cluster service account, kubernetes.kubeconfig): {e}")
        })?,
    };
    kube::Client::try_from(config).map_err(|e| format!("API server client: {e}"))
}
