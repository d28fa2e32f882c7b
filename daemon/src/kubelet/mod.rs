//! The kubelet device-plugin API (v1beta1): one [`DevicePlugin`] service per resource, each served
//! on its own socket in the kubelet's device-plugin directory and registered with the kubelet;
//! [`PluginSet`] runs many and re-registers them when the kubelet restarts.
//!
//! Self-contained: devices come in through a `watch` channel of [`PluginDevice`]s and every
//! decision goes to an [`Allocator`], so the daemon wires discovery, health and state in.

mod dir_watch;
mod plugin;
mod server;

pub use plugin::{Allocator, ContainerAllocation, DevicePlugin, HostDevice, HostMount, PluginDevice};
pub use server::{KubeletError, POLL_INTERVAL, PluginSet, REFUSED_FAST_FOR, serve_plugin, socket_name};
