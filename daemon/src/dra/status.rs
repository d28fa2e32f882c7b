//! `status.devices` of prepared claims (resource.k8s.io/v1, GA in 1.37): after a prepare, one
//! entry per device of this driver (driver, pool, device, the shareID of a shared device) whose
//! `data` says what the node granted: the UUID, the memory and SM limits, the allocation id.
//! Cleared (our entries removed) on unprepare.
//!
//! Written by server-side apply on the status subresource under the field manager
//! [`FIELD_MANAGER`], so only the entries this driver owns change, whoever else writes the list.
//! A failure never fails the prepare (an older API server may lack the field, or be down): the
//! write is retried in the background, 100 ms doubling to 30 s, until it succeeds, the claim is
//! gone or replaced (404, a UID conflict), the API server refuses it for good (another 4xx), or
//! a newer write for the same claim replaces it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{Value, json};

use super::{ClaimRef, DRIVER};

/// The field manager of the status writes.
pub const FIELD_MANAGER: &str = "gpu.tessera.io";
/// The first retry's delay; doubled after each failure up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// One device's entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceStatus {
    pub pool: String,
    pub device: String,
    pub share_id: Option<String>,
    /// The GPU or MIG device's UUID.
    pub uuid: String,
    /// Granted memory in bytes; `None`: the whole device.
    pub memory: Option<u64>,
    /// Granted SM percent; `None`: the whole device.
    pub sm_percent: Option<u32>,
    pub allocation: String,
}

impl DeviceStatus {
    /// The entry as `status.devices[]` holds it.
    pub fn to_json(&self) -> Value {
        let mut data = json!({
            "apiVersion": "gpu.tessera.io/v1alpha1",
            "kind": "GpuStatus",
            "uuid": self.uuid,
            "allocationID": self.allocation,
        });
        if let Some(m) = self.memory {
            data["memory"] = json!(super::devices::format_bytes(m));
        }
        if let Some(sm) = self.sm_percent {
            data["sm"] = json!(sm);
        }
        let mut entry = json!({"driver": DRIVER, "pool": self.pool, "device": self.device, "data": data});
        if let Some(id) = &self.share_id {
            entry["shareID"] = json!(id);
        }
        entry
    }
}

/// Why a write failed, and whether trying again can help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteError {
    pub message: String,
    pub retry: bool,
}

/// Where the entries are written (the API server; a recorder in tests).
#[tonic::async_trait]
pub trait ClaimStatusApi: Send + Sync + 'static {
    /// Makes `devices` this driver's entries of the claim's `status.devices` (none: clears them).
    async fn apply(&self, claim: &ClaimRef, devices: &[DeviceStatus]) -> Result<(), WriteError>;
}

/// The writes through kube-rs: server-side apply of `status.devices` on the status subresource,
/// with the claim's UID as a precondition (a claim replaced under the same name is not touched).
pub struct KubeClaimStatus {
    client: kube::Client,
}

impl KubeClaimStatus {
    pub fn new(client: kube::Client) -> KubeClaimStatus {
        KubeClaimStatus { client }
    }
}

/// The apply configuration: only what this manager owns.
pub fn apply_patch(claim: &ClaimRef, devices: &[DeviceStatus]) -> Value {
    let mut status = json!({});
    if !devices.is_empty() {
        status["devices"] = Value::Array(devices.iter().map(DeviceStatus::to_json).collect());
    }
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid},
        "status": status,
    })
}

#[tonic::async_trait]
impl ClaimStatusApi for KubeClaimStatus {
    async fn apply(&self, claim: &ClaimRef, devices: &[DeviceStatus]) -> Result<(), WriteError> {
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(self.client.clone(), &claim.namespace);
        let params = kube::api::PatchParams::apply(FIELD_MANAGER).force();
        let patch = kube::api::Patch::Apply(apply_patch(claim, devices));
        match api.patch_status(&claim.name, &params, &patch).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) => {
                let retry = s.code >= 500 || s.code == 429;
                Err(WriteError { message: format!("{} {}: {}", s.code, s.reason, s.message), retry })
            }
            Err(e) => Err(WriteError { message: e.to_string(), retry: true }),
        }
    }
}

/// The writes in flight, one per claim: a newer one for a claim replaces the older.
pub struct StatusWriter {
    api: Arc<dyn ClaimStatusApi>,
    pending: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
}

impl StatusWriter {
    pub fn new(api: Arc<dyn ClaimStatusApi>) -> StatusWriter {
        StatusWriter { api, pending: Mutex::new(HashMap::new()) }
    }

    /// Writes the claim's entries in the background (an empty list clears them).
    pub fn write(&self, claim: &ClaimRef, devices: Vec<DeviceStatus>) {
        let api = Arc::clone(&self.api);
        let c = claim.clone();
        let task = tokio::spawn(async move {
            let mut backoff = FIRST_BACKOFF;
            let mut failures = 0u32;
            loop {
                match api.apply(&c, &devices).await {
                    Ok(()) => {
                        if failures > 0 {
                            tracing::info!(claim = %c.uid, failures, "claim status.devices written after retries");
                        }
                        return;
                    }
                    Err(e) if e.retry => {
                        if failures == 0 {
                            tracing::warn!(claim = %c.uid, error = %e.message, "cannot write the claim's status.devices; retrying");
                        }
                        failures += 1;
                    }
                    Err(e) => {
                        tracing::warn!(claim = %c.uid, error = %e.message, "the API server refused the claim's status.devices (an API server before 1.37 may lack the field); not retried");
                        return;
                    }
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        });
        let mut pending = self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        pending.retain(|_, t| !t.is_finished());
        if let Some(old) = pending.insert(claim.uid.clone(), task) {
            old.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Fails the first `fail` writes (retryably unless `fatal`), records the rest.
    struct Recorder {
        fail: AtomicU32,
        fatal: bool,
        seen: Mutex<Vec<(String, usize)>>,
    }

    #[tonic::async_trait]
    impl ClaimStatusApi for Recorder {
        async fn apply(&self, claim: &ClaimRef, devices: &[DeviceStatus]) -> Result<(), WriteError> {
            self.seen.lock().unwrap().push((claim.uid.clone(), devices.len()));
            if self.fail.load(Ordering::SeqCst) > 0 {
                self.fail.fetch_sub(1, Ordering::SeqCst);
                return Err(WriteError { message: "503".into(), retry: !self.fatal });
            }
            Ok(())
        }
    }

    fn status() -> DeviceStatus {
        DeviceStatus {
            pool: "node-a".into(),
            device: "gpu-0-shared".into(),
            share_id: Some("7c1b3c8e-0000-4000-8000-000000000001".into()),
            uuid: "GPU-0".into(),
            memory: Some(8 << 30),
            sm_percent: Some(30),
            allocation: "a1".into(),
        }
    }

    #[test]
    fn the_entry_says_what_was_granted() {
        let c = ClaimRef { namespace: "ml".into(), uid: "uid-1".into(), name: "train".into() };
        let p = apply_patch(&c, &[status()]);
        assert_eq!(p["metadata"], json!({"name": "train", "namespace": "ml", "uid": "uid-1"}));
        assert_eq!(
            p["status"]["devices"][0],
            json!({"driver": "gpu.tessera.io", "pool": "node-a", "device": "gpu-0-shared",
                "shareID": "7c1b3c8e-0000-4000-8000-000000000001",
                "data": {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuStatus", "uuid": "GPU-0",
                    "allocationID": "a1", "memory": "8Gi", "sm": 30}})
        );
        // Cleared: this manager owns no entry any more.
        assert_eq!(apply_patch(&c, &[])["status"], json!({}));
    }

    /// Polls (up to 10 s) until `done` accepts what `api` saw.
    async fn until(api: &Recorder, done: impl Fn(&[(String, usize)]) -> bool) -> Vec<(String, usize)> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let seen = api.seen.lock().unwrap().clone();
            if done(&seen) || std::time::Instant::now() > deadline {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn failures_are_retried_in_the_background_and_refusals_are_not() {
        let c = ClaimRef { namespace: "ml".into(), uid: "uid-1".into(), name: "train".into() };
        let api = Arc::new(Recorder { fail: AtomicU32::new(3), fatal: false, seen: Mutex::default() });
        let w = StatusWriter::new(api.clone());
        w.write(&c, vec![status()]);
        let seen = until(&api, |s| s.len() >= 4).await;
        assert_eq!(seen.len(), 4, "three failures, then written: {seen:?}");
        let refused = Arc::new(Recorder { fail: AtomicU32::new(1), fatal: true, seen: Mutex::default() });
        let w = StatusWriter::new(refused.clone());
        w.write(&c, vec![status()]);
        until(&refused, |s| !s.is_empty()).await;
        // Five first back-offs later: still the one try.
        tokio::time::sleep(FIRST_BACKOFF * 5).await;
        assert_eq!(refused.seen.lock().unwrap().len(), 1, "a refusal is not retried");
        // A clear replaces a write still retrying: the last word is the clear.
        let api = Arc::new(Recorder { fail: AtomicU32::new(1000), fatal: false, seen: Mutex::default() });
        let w = StatusWriter::new(api.clone());
        w.write(&c, vec![status()]);
        until(&api, |s| s.len() >= 2).await;
        api.fail.store(0, Ordering::SeqCst);
        w.write(&c, Vec::new());
        until(&api, |s| s.last().is_some_and(|(_, n)| *n == 0)).await;
        tokio::time::sleep(FIRST_BACKOFF * 5).await;
        let seen = api.seen.lock().unwrap().clone();
        assert_eq!(seen.last(), Some(&("uid-1".to_string(), 0)), "{seen:?}");
        assert_eq!(seen.iter().filter(|(_, n)| *n == 0).count(), 1);
    }
}
