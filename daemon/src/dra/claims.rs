//! A ResourceClaim's allocation result, read from the API server: the kubelet's
//! NodePrepareResources names a claim (namespace, name, UID) and nothing more. Only results of
//! this driver in this node's pool count; the opaque configuration of this driver (priority,
//! compute mode, preemptible) applies to the requests it names (all when it names none).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde::Deserialize;
use tessera_region::{ComputeMode, Priority};

use super::devices::parse_quantity;
use super::{ClaimRef, DRIVER};

/// One device the scheduler allocated to the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantedDevice {
    /// The claim's request it satisfies (`gpu`, or `gpu/sub` for a sub-request).
    pub request: String,
    pub pool: String,
    pub device: String,
    /// Consumed capacity by name (`memory` in bytes, `sm` in percent), for shareable devices.
    pub consumed: BTreeMap<String, u64>,
    /// Set for a device allocated many times (allowMultipleAllocations).
    pub share_id: Option<String>,
    /// From the opaque configuration for this request; `None`: the daemon's default.
    pub priority: Option<Priority>,
    pub compute_mode: Option<ComputeMode>,
    /// The opaque configuration's `preemptible`: the share may be parked for a node API
    /// allocation of higher priority (issue 33).
    pub preemptible: bool,
}

/// What NodePrepareResources needs of a claim.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClaimAllocation {
    pub devices: Vec<GrantedDevice>,
    /// The pods the claim is reserved for (namespace is the claim's): name and UID.
    pub pods: Vec<(String, String)>,
}

/// The opaque configuration of driver `gpu.tessera.io` (`parameters` of an opaque config).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OpaqueConfig {
    /// `gpu.tessera.io/v1alpha1`, informational.
    #[serde(default)]
    pub api_version: Option<String>,
    /// `GpuConfig`, informational.
    #[serde(default)]
    pub kind: Option<String>,
    /// `low`, `normal` or `high`.
    #[serde(default)]
    pub priority: Option<String>,
    /// `strict` or `work-conserving`.
    #[serde(default)]
    pub compute_mode: Option<String>,
    /// `true`: the share may be parked to make room for an allocation of higher priority.
    #[serde(default)]
    pub preemptible: Option<bool>,
}

/// Where claims are read from (the API server; a table in tests).
#[tonic::async_trait]
pub trait ClaimSource: Send + Sync + 'static {
    async fn read(&self, claim: &ClaimRef) -> Result<ResourceClaim, String>;
}

/// Claims read through kube-rs.
pub struct KubeClaims {
    client: kube::Client,
}

impl KubeClaims {
    pub fn new(client: kube::Client) -> KubeClaims {
        KubeClaims { client }
    }
}

#[tonic::async_trait]
impl ClaimSource for KubeClaims {
    async fn read(&self, claim: &ClaimRef) -> Result<ResourceClaim, String> {
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(self.client.clone(), &claim.namespace);
        api.get(&claim.name).await.map_err(|e| match e {
            kube::Error::Api(s) if s.code == 404 => {
                format!("ResourceClaim {}/{} does not exist (deleted?)", claim.namespace, claim.name)
            }
            e => format!("reading ResourceClaim {}/{}: {e}", claim.namespace, claim.name),
        })
    }
}

/// The allocation result of `rc` for this driver and `pool` (this node), checked against what the
/// kubelet asked for: the same UID (a claim deleted and made again under the same name is
/// another claim), allocated, at least one device here.
pub fn allocation(rc: &ResourceClaim, claim: &ClaimRef, pool: &str) -> Result<ClaimAllocation, String> {
    let what = format!("ResourceClaim {}/{}", claim.namespace, claim.name);
    let uid = rc.metadata.uid.as_deref().unwrap_or_default();
    if uid != claim.uid {
        return Err(format!("{what} has UID {uid:?}, not {:?} as the kubelet asked: it was replaced", claim.uid));
    }
    let status = rc.status.as_ref();
    let Some(alloc) = status.and_then(|s| s.allocation.as_ref()) else {
        return Err(format!("{what} is not allocated"));
    };
    let results = alloc.devices.as_ref().and_then(|d| d.results.as_ref()).map(Vec::as_slice).unwrap_or_default();
    let configs = alloc.devices.as_ref().and_then(|d| d.config.as_ref()).map(Vec::as_slice).unwrap_or_default();
    // Opaque configs of this driver, in order: a later one for the same request wins.
    let mut opaque: Vec<(Option<Vec<String>>, OpaqueConfig)> = Vec::new();
    for (i, c) in configs.iter().enumerate() {
        let Some(o) = c.opaque.as_ref().filter(|o| o.driver == DRIVER) else { continue };
        let parsed: OpaqueConfig = serde_json::from_value(o.parameters.0.clone())
            .map_err(|e| format!("{what}: status.allocation.devices.config[{i}].opaque.parameters: {e}"))?;
        if let Some(p) = &parsed.priority
            && Priority::from_name(p).is_none()
        {
            return Err(format!("{what}: config[{i}] priority {p:?} is not one of \"low\", \"normal\", \"high\""));
        }
        if let Some(m) = &parsed.compute_mode
            && ComputeMode::from_name(m).is_none()
        {
            return Err(format!("{what}: config[{i}] computeMode {m:?} is not one of \"strict\", \"work-conserving\""));
        }
        opaque.push((c.requests.clone(), parsed));
    }
    let mut devices = Vec::new();
    for r in results.iter().filter(|r| r.driver == DRIVER && r.pool == pool) {
        let mut consumed = BTreeMap::new();
        for (name, q) in r.consumed_capacity.iter().flatten() {
            let n = parse_quantity(&q.0).ok_or_else(|| {
                format!("{what}: consumed capacity {name} of device {} is {:?}, not a whole number", r.device, q.0)
            })?;
            consumed.insert(name.clone(), n);
        }
        let parent = r.request.split('/').next().unwrap_or_default();
        let mut priority = None;
        let mut compute_mode = None;
        let mut preemptible = None;
        for (requests, cfg) in &opaque {
            let applies = requests.as_ref().is_none_or(|rs| rs.iter().any(|q| q == &r.request || q == parent));
            if applies {
                priority = cfg.priority.as_deref().and_then(Priority::from_name).or(priority);
                compute_mode = cfg.compute_mode.as_deref().and_then(ComputeMode::from_name).or(compute_mode);
                preemptible = cfg.preemptible.or(preemptible);
            }
        }
        devices.push(GrantedDevice {
            request: r.request.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            consumed,
            share_id: r.share_id.clone(),
            priority,
            compute_mode,
            preemptible: preemptible.unwrap_or(false),
        });
    }
    if devices.is_empty() {
        return Err(format!("{what} has no device of driver {DRIVER} in pool {pool:?}"));
    }
    let pods = status
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods")
        .map(|r| (r.name.clone(), r.uid.clone()))
        .collect();
    Ok(ClaimAllocation { devices, pods })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim_ref() -> ClaimRef {
        ClaimRef { namespace: "ml".into(), uid: "uid-1".into(), name: "train".into() }
    }

    fn claim(status: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "train", "namespace": "ml", "uid": "uid-1"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share.tessera.io"}}]}},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn reads_this_drivers_devices_capacity_config_and_pods() {
        let rc = claim(serde_json::json!({
            "allocation": {"devices": {
                "results": [
                    {"request": "gpu", "driver": "gpu.tessera.io", "pool": "node-a", "device": "gpu-1-shared",
                     "shareID": "7c1b3c8e-0000-4000-8000-000000000001",
                     "consumedCapacity": {"memory": "8Gi", "sm": "30"}},
                    {"request": "nic", "driver": "net.example.com", "pool": "node-a", "device": "eth1"},
                    {"request": "gpu", "driver": "gpu.tessera.io", "pool": "node-b", "device": "gpu-0"}
                ],
                "config": [
                    {"source": "FromClaim", "opaque": {"driver": "gpu.tessera.io",
                        "parameters": {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig", "priority": "high",
                                       "preemptible": true}}},
                    {"source": "FromClaim", "requests": ["other"], "opaque": {"driver": "gpu.tessera.io",
                        "parameters": {"computeMode": "work-conserving"}}},
                    {"source": "FromClass", "opaque": {"driver": "net.example.com", "parameters": {"mtu": 9000}}}
                ]
            }},
            "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "pod-uid"}]
        }));
        let a = allocation(&rc, &claim_ref(), "node-a").unwrap();
        assert_eq!(a.devices.len(), 1, "other drivers' and other nodes' results are not ours");
        let d = &a.devices[0];
        assert_eq!((d.pool.as_str(), d.device.as_str(), d.request.as_str()), ("node-a", "gpu-1-shared", "gpu"));
        assert_eq!(d.consumed, BTreeMap::from([("memory".into(), 8 << 30), ("sm".into(), 30)]));
        assert_eq!(d.priority, Some(Priority::High));
        assert_eq!(d.compute_mode, None, "the work-conserving config names another request");
        assert!(d.preemptible);
        assert_eq!(a.pods, [("trainer-0".to_string(), "pod-uid".to_string())]);
    }

    #[test]
    fn refuses_what_it_cannot_honour() {
        let unallocated = claim(serde_json::json!({}));
        assert!(allocation(&unallocated, &claim_ref(), "n").unwrap_err().ends_with("is not allocated"));
        let rc = claim(serde_json::json!({"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.tessera.io", "pool": "n", "device": "gpu-0"}]}}}));
        let replaced = ClaimRef { uid: "uid-2".into(), ..claim_ref() };
        assert!(allocation(&rc, &replaced, "n").unwrap_err().contains("it was replaced"));
        assert!(allocation(&rc, &claim_ref(), "other").unwrap_err().contains("no device of driver gpu.tessera.io"));
        let bad = |params: serde_json::Value| {
            claim(serde_json::json!({"allocation": {"devices": {
                "results": [{"request": "gpu", "driver": "gpu.tessera.io", "pool": "n", "device": "gpu-0"}],
                "config": [{"source": "FromClaim", "opaque": {"driver": "gpu.tessera.io", "parameters": params}}]}}}))
        };
        let e = allocation(&bad(serde_json::json!({"priority": "urgent"})), &claim_ref(), "n").unwrap_err();
        assert!(e.contains("priority \"urgent\""), "{e}");
        let e = allocation(&bad(serde_json::json!({"memory": "8Gi"})), &claim_ref(), "n").unwrap_err();
        assert!(e.contains("unknown field `memory`"), "{e}");
        let e = allocation(&bad(serde_json::json!({"preemptible": "yes"})), &claim_ref(), "n").unwrap_err();
        assert!(e.contains("parameters") && e.contains("expected a boolean"), "{e}");
        let plain = allocation(&bad(serde_json::json!({"priority": "low"})), &claim_ref(), "n").unwrap();
        assert!(!plain.devices[0].preemptible, "not preemptible unless asked");
        let frac = claim(serde_json::json!({"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.tessera.io", "pool": "n", "device": "gpu-0-shared",
             "consumedCapacity": {"sm": "500m"}}]}}}));
        assert!(allocation(&frac, &claim_ref(), "n").unwrap_err().contains("not a whole number"));
    }
}
