//! The allocation record: what the daemon handed out, to whom, and with which limits.
//!
//! Stored as JSON in the allocation store's journal (see [`super::store`]); the hook and the CDI
//! spec refer to it by [`Allocation::id`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tessera_region::{ComputeMode, DeviceLimits, LIMITS_VERSION, Limits, Priority};

use crate::holdings::Holder;

/// The longest allocation id accepted (ids name files and directories).
pub const MAX_ID_LEN: usize = 64;

/// The resource name of allocations made for DRA claims (NodePrepareResources); the record's
/// owner is the claim UID.
pub const DRA_RESOURCE: &str = "dra/gpu.tessera.io";

/// Who asked for the allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// The kubelet, through the device-plugin `Allocate` call.
    Kubelet,
    /// The node API (`tessera.v1`) or the CLI.
    NodeApi,
    /// The OCI hook alone (asked by env var or annotation).
    Hook,
    /// Rebuilt from its allocation directory after the journal lost it (see
    /// [`super::recover`]): resource and kubelet device ids unknown.
    Recovered,
}

/// The container an allocation is for: the contract crate's, the same type the hook's owner
/// record carries.
pub use tessera_region::owner::ContainerIdentity;

/// One device of an allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocatedDevice {
    /// The device as the kubelet / CDI knows it: a GPU UUID, a MIG UUID, or a share id
    /// `<uuid>::<n>`.
    pub device_id: String,
    /// The device the container actually sees and the shim enforces on: the GPU (`GPU-…`) or MIG
    /// device (`MIG-…`); for a share, the device it is a share of.
    pub physical_uuid: String,
    /// Bytes of device memory the container may hold; `None`: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit: Option<u64>,
    /// Percent of the device's SM time, 1..=100; `None`: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_percent: Option<u32>,
    #[serde(default)]
    pub priority: Priority,
    #[serde(default)]
    pub compute_mode: ComputeMode,
    /// Held whole (a GPU or MIG device given to this allocation alone) although its limits were
    /// lowered since (`SetLimits`): nothing is carved from it or given beside it. A device with
    /// no memory limit is held whole anyway ([`AllocatedDevice::is_whole`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub whole: bool,
    /// May be parked to make room for an allocation of higher priority (`--preemptible`,
    /// issue 33); absent in older records: not preemptible.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preemptible: bool,
}

impl AllocatedDevice {
    /// A device with these limits at normal priority, strict, not held whole beyond them.
    pub fn new(
        device_id: impl Into<String>,
        physical_uuid: impl Into<String>,
        memory_limit: Option<u64>,
        sm_percent: Option<u32>,
    ) -> Self {
        AllocatedDevice {
            device_id: device_id.into(),
            physical_uuid: physical_uuid.into(),
            memory_limit,
            sm_percent,
            priority: Priority::Normal,
            compute_mode: ComputeMode::Strict,
            whole: false,
            preemptible: false,
        }
    }

    /// Whether the allocation holds the whole device (all its memory, all its SM time, however
    /// its limits bind the container), not a share of it.
    pub fn is_whole(&self) -> bool {
        self.whole || self.memory_limit.is_none()
    }

    /// What it holds of its device, as admission counts it: its memory limit (`None`: all the
    /// device's memory) and its strict SM percent (0 for a work-conserving part). A device held
    /// whole holds all of it, whatever its limits say.
    pub fn holds(&self) -> (Option<u64>, u32) {
        if self.whole {
            return (None, 100);
        }
        let sm = if self.compute_mode == ComputeMode::Strict { self.sm_percent.unwrap_or(100) } else { 0 };
        (self.memory_limit, sm)
    }
}

/// How long a node API allocation lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Lease {
    /// Until it is released.
    #[default]
    None,
    /// Bound to the first container that uses it (its owner record names it); released when
    /// that container is deleted.
    Container,
}

/// What the node API was asked for beyond the devices: who for, and for how long.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    /// Free text from the caller (a function id, a job name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default)]
    pub lease: Lease,
}

/// One allocation: an id, the container when known, and its devices with their limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    /// Unique on the node; names the per-allocation directory
    /// (see [`valid_id`]). [`Allocation::new_id`] makes one.
    pub id: String,
    /// The extended resource it was allocated under, e.g. `tessera.io/gpu`.
    pub resource: String,
    #[serde(default)]
    pub container: ContainerIdentity,
    pub source: Source,
    /// When it was made: nanoseconds since the Unix epoch.
    pub created_unix_ns: u64,
    pub devices: Vec<AllocatedDevice>,
    /// Node API allocations only (absent in records from before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<Box<Claim>>,
}

impl Allocation {
    /// Whose record it is, as what is free is counted ([`crate::holdings`]): the kubelet's, a
    /// DRA claim's, the node API's own, or another's (the hook's, a recovered one).
    pub fn holder(&self) -> Holder {
        match self.source {
            Source::Kubelet => Holder::Kubelet,
            _ if self.resource == DRA_RESOURCE => Holder::Claim,
            Source::NodeApi => Holder::NodeApi,
            Source::Hook | Source::Recovered => Holder::Other,
        }
    }

    /// A fresh id: 16 lowercase hex digits from the kernel's random source (`getrandom(2)`: one
    /// call, no file to open on every Allocate; the clock and a counter if it fails).
    pub fn new_id() -> String {
        let mut bytes = [0u8; 8];
        // SAFETY: `bytes` is a writable buffer of exactly the length given.
        let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
        let random = got == bytes.len() as isize;
        let n = if random {
            u64::from_le_bytes(bytes)
        } else {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let c = COUNTER.fetch_add(1, Ordering::Relaxed);
            // splitmix64 of (time, pid, counter): distinct per call within this process.
            let mut z = unix_ns() ^ (u64::from(std::process::id()) << 40) ^ c.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        format!("{n:016x}")
    }

    /// Whether preemption may park it: every device of it is marked preemptible (a share that is
    /// not is never parked, even beside one that is).
    pub fn preemptible(&self) -> bool {
        !self.devices.is_empty() && self.devices.iter().all(|d| d.preemptible)
    }

    /// Its priority as preemption compares them: the highest of its devices'.
    pub fn priority(&self) -> Priority {
        self.devices.iter().map(|d| d.priority).max_by_key(|&p| p as u8).unwrap_or_default()
    }

    /// Whether the allocation is leased to the first container that uses it (`--lease container`).
    pub fn leased_to_container(&self) -> bool {
        self.claim.as_ref().is_some_and(|c| c.lease == Lease::Container)
    }

    /// The limits file the shim enforces for this allocation.
    ///
    /// `container` is the container's [display name](ContainerIdentity::display_name), else the
    /// allocation id. One device entry per physical device: two shares of one device in the same
    /// allocation add up (memory summed, SM percent summed up to 100). The file has one priority
    /// and one compute mode: the highest priority of the devices, and `strict` if any device is
    /// strict (the narrower mode wins).
    pub fn limits(&self) -> Limits {
        let mut devices: Vec<DeviceLimits> = Vec::new();
        for d in &self.devices {
            match devices.iter_mut().find(|e| e.uuid.eq_ignore_ascii_case(&d.physical_uuid)) {
                Some(e) => {
                    // No limit on one part means no limit on the device.
                    e.memory_limit = e.memory_limit.zip(d.memory_limit).map(|(a, b)| a.saturating_add(b));
                    e.sm_percent = e.sm_percent.zip(d.sm_percent).map(|(a, b)| a.saturating_add(b).min(100));
                }
                None => devices.push(DeviceLimits {
                    uuid: d.physical_uuid.clone(),
                    memory_limit: d.memory_limit,
                    sm_percent: d.sm_percent,
                }),
            }
        }
        let rank = |p: Priority| match p {
            Priority::Low => 0,
            Priority::Normal => 1,
            Priority::High => 2,
        };
        let priority = self.devices.iter().map(|d| d.priority).max_by_key(|&p| rank(p)).unwrap_or_default();
        let compute_mode =
            if self.devices.is_empty() || self.devices.iter().any(|d| d.compute_mode == ComputeMode::Strict) {
                ComputeMode::Strict
            } else {
                ComputeMode::WorkConserving
            };
        Limits {
            version: LIMITS_VERSION,
            container: Some(self.container.display_name().unwrap_or_else(|| self.id.clone())),
            priority,
            compute_mode,
            devices,
        }
    }
}

/// Nanoseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Whether `id` may name an allocation: 1..=[`MAX_ID_LEN`] bytes of ASCII letters, digits, `-`
/// and `_` (it names a file and a directory, so no `/`, no `.`); `Err` says why not.
pub fn valid_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("the id is empty".to_string());
    }
    if id.len() > MAX_ID_LEN {
        return Err(format!("the id {} is longer than {MAX_ID_LEN} bytes", crate::client_input::quoted(id)));
    }
    if !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(format!(
            "the id {} holds a character other than A-Z, a-z, 0-9, '-', '_'",
            crate::client_input::quoted(id)
        ));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A device of an allocation, normal priority and strict (other modules' tests use it too).
    pub(crate) fn dev(id: &str, uuid: &str, mem: Option<u64>, sm: Option<u32>) -> AllocatedDevice {
        AllocatedDevice::new(id, uuid, mem, sm)
    }

    /// A whole record with one share of 1 GiB and 50% (the store's and the journal's tests).
    pub(crate) fn sample(id: &str) -> Allocation {
        Allocation {
            id: id.to_string(),
            resource: "tessera.io/gpu".to_string(),
            container: ContainerIdentity { pod_name: Some(format!("pod-{id}")), ..Default::default() },
            source: Source::Kubelet,
            created_unix_ns: 42,
            devices: vec![dev("GPU-1234::0", "GPU-1234", Some(1 << 30), Some(50))],
            claim: None,
        }
    }

    fn alloc(devices: Vec<AllocatedDevice>) -> Allocation {
        Allocation {
            id: Allocation::new_id(),
            resource: "tessera.io/share".to_string(),
            container: ContainerIdentity::default(),
            source: Source::Kubelet,
            created_unix_ns: unix_ns(),
            devices,
            claim: None,
        }
    }

    #[test]
    fn new_ids_are_16_hex_and_distinct() {
        let ids: std::collections::BTreeSet<String> = (0..100).map(|_| Allocation::new_id()).collect();
        assert_eq!(ids.len(), 100);
        for id in &ids {
            assert_eq!(id.len(), 16);
            assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
            valid_id(id).unwrap();
        }
    }

    #[test]
    fn ids_that_would_escape_the_directory_are_refused() {
        for bad in ["", "../x", "a/b", "a.json", "a b", &"x".repeat(65)] {
            assert!(valid_id(bad).is_err(), "{bad:?}");
        }
        valid_id("pod-1_a").unwrap();
    }

    #[test]
    fn json_round_trip_and_defaults() {
        let mut a = alloc(vec![dev("GPU-a::0", "GPU-a", Some(1 << 30), Some(25))]);
        a.container.pod_name = Some("p".into());
        a.source = Source::NodeApi;
        let text = serde_json::to_string(&a).unwrap();
        assert!(text.contains("\"node-api\""), "{text}");
        assert!(!text.contains("pod_uid"), "{text}");
        assert_eq!(serde_json::from_str::<Allocation>(&text).unwrap(), a);
        assert!(!text.contains("claim"), "kubelet records carry no claim: {text}");
        a.claim = Some(Box::new(Claim { owner: Some("fn-1".into()), lease: Lease::Container }));
        let text = serde_json::to_string(&a).unwrap();
        assert!(text.contains("\"lease\":\"container\""), "{text}");
        assert_eq!(serde_json::from_str::<Allocation>(&text).unwrap(), a);
        assert!(!text.contains("preemptible"), "not preemptible: nothing written: {text}");
        a.devices[0].preemptible = true;
        let text = serde_json::to_string(&a).unwrap();
        assert!(text.contains("\"preemptible\":true"), "{text}");
        let back = serde_json::from_str::<Allocation>(&text).unwrap();
        assert!(back.preemptible() && back == a);
        // A record written before the field: not preemptible.
        let old = text.replace(",\"preemptible\":true", "");
        assert!(!serde_json::from_str::<Allocation>(&old).unwrap().preemptible(), "{old}");
        // Unknown keys are refused: a record is never half understood.
        let extra = text.replacen('{', "{\"bogus\":1,", 1);
        assert!(serde_json::from_str::<Allocation>(&extra).is_err());
    }

    #[test]
    fn limits_from_record() {
        let mut a = alloc(vec![
            dev("GPU-a::0", "GPU-a", Some(1 << 30), Some(60)),
            dev("GPU-a::1", "GPU-a", Some(1 << 30), Some(60)),
            dev("MIG-b", "MIG-b", None, Some(10)),
        ]);
        a.devices[2].priority = Priority::High;
        a.devices[0].compute_mode = ComputeMode::WorkConserving;
        a.devices[1].compute_mode = ComputeMode::WorkConserving;
        a.devices[2].compute_mode = ComputeMode::WorkConserving;
        a.container = ContainerIdentity::of_pod("ns", "pod", "c");
        let l = a.limits();
        l.validate().unwrap();
        assert_eq!(l.container.as_deref(), Some("ns/pod/c"));
        assert_eq!(l.priority, Priority::High);
        assert_eq!(l.compute_mode, ComputeMode::WorkConserving);
        assert_eq!(l.devices.len(), 2);
        assert_eq!(l.devices[0].memory_limit, Some(2 << 30));
        assert_eq!(l.devices[0].sm_percent, Some(100));
        assert_eq!(l.devices[1].memory_limit, None);

        let b = alloc(vec![dev("GPU-c", "GPU-c", None, None)]);
        let l = b.limits();
        assert_eq!(l.container.as_deref(), Some(b.id.as_str()));
        assert_eq!(l.compute_mode, ComputeMode::Strict);
        assert_eq!(l.priority, Priority::Normal);
    }
}
