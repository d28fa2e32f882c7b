//! Health as one value with its reason: what the health monitor found out of service
//! ([`NodeHealth`], published in the controller's view), and the one rule that says what that
//! means for a device ([`NodeHealth::of`]), so that the device plugin, DRA, the node API, the
//! metrics and the CDI specs all read the same answer.

use std::collections::BTreeMap;

/// A device's health as the node offers it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Health {
    #[default]
    Healthy,
    /// Out of service, with the health monitor's reason (`XID 79`, `lost`, `recovering`, ...).
    Unhealthy(String),
}

impl Health {
    pub fn is_healthy(&self) -> bool {
        matches!(self, Health::Healthy)
    }

    /// Why it is out; `None` while healthy.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Health::Healthy => None,
            Health::Unhealthy(why) => Some(why),
        }
    }
}

/// What is out of service on the node, each with its reason: whole GPUs (by index: an XID that
/// takes the GPU, a lost GPU, a GPU recovering after a reset) and single MIG devices (by UUID:
/// an XID confined to the instance).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeHealth {
    gpus: BTreeMap<u32, String>,
    devices: BTreeMap<String, String>,
}

impl NodeHealth {
    /// `gpus` out by index, `devices` (MIG devices) out by UUID, each with its reason.
    pub fn new(gpus: BTreeMap<u32, String>, devices: BTreeMap<String, String>) -> NodeHealth {
        NodeHealth { gpus, devices }
    }

    /// Nothing is out.
    pub fn is_all_healthy(&self) -> bool {
        self.gpus.is_empty() && self.devices.is_empty()
    }

    /// The health of a device on GPU `gpu` that is, or is carved from, the GPU or MIG device
    /// `uuid`: out with its GPU's reason while the GPU is out, else with its own reason.
    pub fn of(&self, gpu: u32, uuid: &str) -> Health {
        self.gpus
            .get(&gpu)
            .or_else(|| self.devices.get(uuid))
            .map_or(Health::Healthy, |why| Health::Unhealthy(why.clone()))
    }

    /// [`Self::of`] for something that spans several devices of GPU `gpu` (a MIG placement
    /// over existing instances): out while its GPU or any of them is.
    pub fn of_any<'a>(&self, gpu: u32, uuids: impl IntoIterator<Item = &'a str>) -> Health {
        if let Some(why) = self.gpus.get(&gpu) {
            return Health::Unhealthy(why.clone());
        }
        uuids
            .into_iter()
            .find_map(|u| self.devices.get(u))
            .map_or(Health::Healthy, |why| Health::Unhealthy(why.clone()))
    }

    /// The reason GPU `gpu` as a whole is out (not counting its MIG devices).
    pub fn gpu(&self, gpu: u32) -> Option<&str> {
        self.gpus.get(&gpu).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeHealth {
        NodeHealth::new(
            BTreeMap::from([(1, "XID 79".to_owned())]),
            BTreeMap::from([("MIG-a".to_owned(), "XID 94".to_owned()), ("MIG-b".to_owned(), "XID 95".to_owned())]),
        )
    }

    #[test]
    fn a_gpu_out_takes_every_device_on_it_with_its_reason() {
        let h = node();
        for uuid in ["GPU-1", "MIG-on-1", "MIG-a"] {
            assert_eq!(h.of(1, uuid), Health::Unhealthy("XID 79".into()), "{uuid}");
        }
        assert_eq!(h.gpu(1), Some("XID 79"));
        assert_eq!(h.of_any(1, ["MIG-b"]), Health::Unhealthy("XID 79".into()));
    }

    #[test]
    fn a_mig_device_out_takes_only_itself_and_what_spans_it() {
        let h = node();
        assert_eq!(h.of(0, "MIG-a"), Health::Unhealthy("XID 94".into()));
        assert_eq!(h.of(0, "MIG-c"), Health::Healthy);
        assert_eq!(h.of(0, "GPU-0"), Health::Healthy, "its GPU stays in service");
        assert_eq!(h.gpu(0), None);
        assert_eq!(h.of_any(0, ["MIG-c", "MIG-b"]), Health::Unhealthy("XID 95".into()));
        assert_eq!(h.of_any(0, ["MIG-c"]), Health::Healthy);
        assert_eq!(h.of(0, "MIG-a").reason(), Some("XID 94"));
        assert!(h.of(0, "MIG-c").is_healthy() && h.of(0, "MIG-c").reason().is_none());
    }

    #[test]
    fn nothing_found_is_all_healthy() {
        assert!(NodeHealth::default().is_all_healthy());
        assert!(!node().is_all_healthy());
        assert_eq!(NodeHealth::default().of(0, "GPU-0"), Health::Healthy);
    }
}
