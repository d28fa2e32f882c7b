//! What the node serves the kubelet: what the device plugins serve of the controller's offer (all
//! of it in `kubernetes.mode = "device-plugin"`, nothing in `dra`, in `both` only the GPUs a
//! `[partitions]` entry manages, so that no GPU is offered twice), one plugin per resource
//! ([`PluginSet`]), `Allocate` answered by the allocation core. The offer's withdrawn devices
//! (free devices that no longer fit beside what the records hold: `View::withdrawn_from_kubelet`)
//! are told unhealthy, and the controller is told what the kubelet is offered ([`KubeletOffer`],
//! for `ListDevices` and the metrics). [`start`] serves and follows the controller's offer, the
//! one channel, in a task of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{Allocator, DevicePlugin, KubeletError, PluginDevice, PluginSet};
use crate::allocator::DaemonAllocator;
use crate::config::Config;
use crate::config::kubernetes::Mode;
use crate::node::{KubeletOffer, NodeController};
use crate::resources::{Resource, Resources};
use crate::view::{Face, View};

/// What the device plugin serves of what `view` offers in `mode`: the devices of the GPUs whose
/// face is the device plugin ([`View::face_of`]: all in `device-plugin`, none in `dra`, in `both`
/// the GPUs a `[partitions]` entry manages); a resource left without devices is dropped.
pub fn of_view(mode: Mode, view: &View) -> Arc<Resources> {
    if mode == Mode::DevicePlugin {
        return Arc::clone(&view.resources);
    }
    let mut out = (*view.resources).clone();
    for r in out.resources.values_mut() {
        r.devices.retain(|d| view.face_of(mode, d.gpu_index) == Face::DevicePlugin);
    }
    out.resources.retain(|_, r| !r.devices.is_empty());
    Arc::new(out)
}

/// Serves what `mode` gives the device plugin (in `cfg.device_plugin_dir`), registering with the
/// kubelet in the background, and follows the controller's publishes (layouts, health, what the
/// records hold) until `shutdown` turns true; the task then stops the plugins and says how that
/// went. `Err`: a plugin could not start. `started`: when tesserad started (the registration is
/// logged with the time since).
pub fn start(
    controller: Arc<NodeController>,
    cfg: &Config,
    mode: Mode,
    started: Instant,
    mut shutdown: watch::Receiver<bool>,
) -> Result<JoinHandle<Result<(), KubeletError>>, KubeletError> {
    let mut offer_rx = controller.watch_offer();
    let offer = offer_rx.borrow_and_update().clone();
    let mut plugins = Plugins::default();
    let mut served = of_view(mode, &offer);
    let mut set = plugins.start(cfg, &offer, &served, &controller)?;
    let mut last = offer;
    Ok(tokio::spawn(async move {
        let mut registered = false;
        loop {
            tokio::select! {
                () = set.wait_registered(), if !registered => {
                    registered = true;
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    tracing::info!(resources = set.resources().count(), ms_since_start = ms, "registered");
                }
                changed = offer_rx.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    // Every change of what the records hold is published too (the kubelet's own
                    // move which of its free devices fit while some are withdrawn): no other
                    // channel to follow, nothing to look at again on a timer.
                    let offer = offer_rx.borrow_and_update().clone();
                    // What is served changes with the node, not with what is held (published
                    // on every allocation): not worked out again then.
                    let node_changed = !offer.only_holdings_differ(&last);
                    if node_changed {
                        served = of_view(mode, &offer);
                    }
                    plugins.update(&mut set, &offer, &served, &controller, node_changed);
                    last = offer;
                }
                _ = shutdown.wait_for(|stop| *stop) => break,
            }
        }
        let result = set.stop().await;
        drop(plugins);
        result
    }))
}

/// `res`'s devices as the kubelet sees them.
fn plugin_devices(res: &Resource) -> Vec<PluginDevice> {
    res.devices
        .iter()
        .map(|d| PluginDevice {
            id: d.id.clone(),
            healthy: d.health.is_healthy(),
            numa_node: d.numa_node.map(i64::from),
        })
        .collect()
}

/// One device list per served resource; a resource that appears after start (a layout change)
/// gets a plugin of its own, one that disappears is served with no devices.
#[derive(Default)]
struct Plugins {
    senders: BTreeMap<String, watch::Sender<Vec<PluginDevice>>>,
    /// The kubelet's free devices told unhealthy because they no longer fit beside what the
    /// records hold (`View::withdrawn_from_kubelet`).
    withdrawn: BTreeSet<(String, String)>,
}

impl Plugins {
    /// `res`'s devices as the kubelet is told them: the withdrawn ones unhealthy.
    fn devices(&self, res: &Resource) -> Vec<PluginDevice> {
        let mut devices = plugin_devices(res);
        let withdrawn: BTreeSet<&str> =
            self.withdrawn.iter().filter(|(r, _)| *r == res.name).map(|(_, id)| id.as_str()).collect();
        if !withdrawn.is_empty() {
            for d in &mut devices {
                if withdrawn.contains(d.id.as_str()) {
                    d.healthy = false;
                }
            }
        }
        devices
    }

    fn plugin(&mut self, res: &Resource, allocator: &Arc<DaemonAllocator>) -> DevicePlugin {
        let (tx, rx) = watch::channel(self.devices(res));
        self.senders.insert(res.name.clone(), tx);
        tracing::info!(resource = %res.name, devices = res.devices.len(), "serving");
        DevicePlugin::new(&res.name, rx, Arc::clone(allocator) as Arc<dyn Allocator>)
    }

    fn start(
        &mut self,
        cfg: &Config,
        offer: &View,
        resources: &Resources,
        controller: &NodeController,
    ) -> Result<PluginSet, KubeletError> {
        self.follow_withdrawn(controller, offer, resources, true);
        let plugins = resources.resources.values().map(|r| self.plugin(r, controller.allocator())).collect();
        PluginSet::start(&cfg.device_plugin_dir, plugins)
    }

    /// Takes the offer's withdrawn devices, saying what changed, and tells the controller what
    /// the kubelet is now offered (for `tessera status` and the metrics) when that changed
    /// (`served_changed`: what is served may have). Whether the withdrawn devices changed.
    fn follow_withdrawn(
        &mut self,
        controller: &NodeController,
        offer: &View,
        resources: &Resources,
        served_changed: bool,
    ) -> bool {
        let now = only_served(offer.withdrawn_from_kubelet(), resources);
        if now == self.withdrawn && !served_changed {
            return false;
        }
        let show = |set: &mut dyn Iterator<Item = &(String, String)>| {
            set.map(|(r, id)| format!("{r} {id}")).collect::<Vec<_>>().join(", ")
        };
        let out = show(&mut now.difference(&self.withdrawn));
        if !out.is_empty() {
            tracing::info!(devices = %out, "withdrawn from the kubelet (told unhealthy): no room beside the node API's allocations");
        }
        let back = show(&mut self.withdrawn.difference(&now));
        if !back.is_empty() {
            tracing::info!(devices = %back, "offered to the kubelet again: the room is back");
        }
        let changed = now != self.withdrawn;
        self.withdrawn = now;
        controller.set_kubelet_offer(KubeletOffer {
            resources: resources.resources.keys().cloned().collect(),
            withdrawn: self.withdrawn.clone(),
        });
        changed
    }

    /// Follows a new offer; `served_changed`: what is served (`resources`) may differ from the
    /// last call's. When neither it nor the withdrawn devices changed (a publish of what the
    /// records hold, on every allocation, that withdraws nothing new), every device list is as
    /// sent: none is built again.
    fn update(
        &mut self,
        set: &mut PluginSet,
        offer: &View,
        resources: &Resources,
        controller: &NodeController,
        served_changed: bool,
    ) {
        if !self.follow_withdrawn(controller, offer, resources, served_changed) && !served_changed {
            return;
        }
        let allocator = controller.allocator();
        for res in resources.resources.values() {
            match self.senders.get(&res.name) {
                Some(tx) => {
                    let devices = self.devices(res);
                    tx.send_if_modified(|d| {
                        let changed = *d != devices;
                        *d = devices;
                        changed
                    });
                }
                None => {
                    let plugin = self.plugin(res, allocator);
                    if let Err(e) = set.add(plugin) {
                        tracing::error!(resource = %res.name, error = %e, "cannot serve a new resource");
                    }
                }
            }
        }
        for (name, tx) in &self.senders {
            if !resources.resources.contains_key(name) {
                tx.send_if_modified(|d| {
                    let changed = !d.is_empty();
                    d.clear();
                    changed
                });
            }
        }
    }
}

/// The withdrawn `(resource, device id)`s the device plugins serve (`served`): in mode `dra`, or
/// for a GPU DRA has in `both`, the kubelet is offered none of it, so none of it is withdrawn
/// from the kubelet (nor logged, counted or marked so).
fn only_served(mut withdrawn: BTreeSet<(String, String)>, served: &Resources) -> BTreeSet<(String, String)> {
    withdrawn.retain(|(r, id)| served.resources.get(r).is_some_and(|res| res.devices.iter().any(|d| &d.id == id)));
    withdrawn
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{Kind, ResourceDevice};

    fn device(id: &str, gpu: u32) -> ResourceDevice {
        ResourceDevice {
            id: id.into(),
            physical_uuid: format!("GPU-{gpu}"),
            gpu_index: gpu,
            numa_node: None,
            health: crate::device_health::Health::Healthy,
            memory_limit: None,
            sm_percent: None,
            nodes: Vec::new(),
        }
    }

    #[test]
    fn in_both_modes_the_device_plugin_keeps_only_the_partitioned_gpus() {
        let mut all = Resources::default();
        for (name, kind, devices) in [
            ("tessera.io/gpu", Kind::Gpu, vec![device("GPU-0", 0), device("GPU-1", 1)]),
            ("tessera.io/gpu-share", Kind::Share, vec![device("GPU-1::0", 1), device("GPU-1::1", 1)]),
        ] {
            all.resources.insert(name.into(), Resource { name: name.into(), kind, devices });
        }
        let served =
            |mode: Mode, partitioned: &[u32]| (*of_view(mode, &View::for_test(all.clone(), partitioned))).clone();
        assert_eq!(served(Mode::DevicePlugin, &[1]), all);
        assert!(served(Mode::Dra, &[1]).resources.is_empty());
        let both = served(Mode::Both, &[1]);
        let ids: Vec<&str> = both.resources.values().flat_map(|r| &r.devices).map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["GPU-1", "GPU-1::0", "GPU-1::1"], "GPU 0 is DRA's");
        // No GPU partitioned: the device plugin serves nothing, not empty resources.
        assert!(served(Mode::Both, &[]).resources.is_empty());
        // What is withdrawn is told only of what is served: nothing in dra, GPU 1's in both.
        let withdrawn: BTreeSet<(String, String)> = [("tessera.io/gpu", "GPU-0"), ("tessera.io/gpu-share", "GPU-1::1")]
            .map(|(r, d)| (r.into(), d.into()))
            .into();
        assert!(only_served(withdrawn.clone(), &served(Mode::Dra, &[1])).is_empty());
        let kept = only_served(withdrawn.clone(), &both);
        assert_eq!(kept, BTreeSet::from([("tessera.io/gpu-share".to_string(), "GPU-1::1".to_string())]));
        assert_eq!(only_served(withdrawn.clone(), &all), withdrawn);
    }
}
