//! The kubelet device-plugin API (v1beta1): one [`DevicePlugin`] service per resource, each served
//! on its own socket in the kubelet's device-plugin directory and registered with the kubelet;
//! [`PluginSet`] runs many and re-registers them when the kubelet restarts.
//!
//! The servers are self-contained: devices come in through a `watch` channel of
//! [`PluginDevice`]s and every decision goes to an [`Allocator`] (the allocation core's way in).
//! [`served`] is tesserad's device-plugin face over them: what the node serves of the
//! controller's offer, followed in a task of its own.

mod dir_watch;
mod plugin;
pub mod served;
mod server;

pub use crate::allocator::kubelet::{Allocator, ContainerAllocation, HostDevice, HostMount};
pub use plugin::{DevicePlugin, PluginDevice};
pub use server::{KubeletError, POLL_INTERVAL, PluginSet, REFUSED_FAST_FOR, serve_plugin, socket_name};
