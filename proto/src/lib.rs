//! Tessera's gRPC contracts, generated from the `.proto` files under `proto/` (no logic here).
//!
//! - [`deviceplugin::v1beta1`]: the Kubernetes device-plugin API (`Registration`, `DevicePlugin`)
//!   and the kubelet's constants for it.
//! - [`podresources::v1`]: the kubelet pod-resources API (`PodResourcesLister`).
//! - [`pluginregistration::v1`]: the kubelet's plugin registration (`Registration`), which DRA
//!   drivers serve in the kubelet's plugins_registry directory.
//! - [`dra::v1`] and [`dra::v1beta1`]: the kubelet's DRA plugin service (`DRAPlugin`).
//! - [`dra_health::v1`] and [`dra_health::v1alpha1`]: the kubelet's DRA resource-health service
//!   (`DRAResourceHealth`, KEP-4680), served beside `DRAPlugin`.
//! - [`tessera::v1`]: Tessera's own node API (`Node`).
//!
//! Every service has both a client (`*_client`) and a server (`*_server`) module.

/// The encoded `google.protobuf.FileDescriptorSet` of every API here (with source info), for gRPC
/// reflection and for tests that check the wire contract.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tessera_proto_descriptor.bin"));

/// The code generated from one protobuf package, in a module of its own (not linted: it is not
/// ours to shape), all of it re-exported: by package name, or by the file the build wrote apart.
macro_rules! generated {
    ($package:literal) => {
        #[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic, clippy::nursery)]
        mod generated {
            tonic::include_proto!($package);
        }
        pub use generated::*;
    };
    (file $path:literal) => {
        #[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic, clippy::nursery)]
        mod generated {
            include!(concat!(env!("OUT_DIR"), $path));
        }
        pub use generated::*;
    };
}

/// Kubernetes device-plugin API.
pub mod deviceplugin {
    /// Device-plugin API v1beta1 (protobuf package `v1beta1`).
    pub mod v1beta1 {
        generated!("v1beta1");

        use std::time::Duration;

        /// The API version a plugin registers with.
        pub const VERSION: &str = "v1beta1";
        /// API versions the kubelet accepts.
        pub const SUPPORTED_VERSIONS: &[&str] = &[VERSION];
        /// The kubelet's device-plugin directory: its socket and every plugin's socket live here.
        pub const DEVICE_PLUGIN_PATH: &str = "/var/lib/kubelet/device-plugins/";
        /// File name of the kubelet's Registration socket inside the device-plugin directory.
        pub const KUBELET_SOCKET_NAME: &str = "kubelet.sock";
        /// Full path of the kubelet's Registration socket.
        pub const KUBELET_SOCKET: &str = "/var/lib/kubelet/device-plugins/kubelet.sock";
        /// `Device.health` of a usable device.
        pub const HEALTHY: &str = "Healthy";
        /// `Device.health` of a device that must not be allocated.
        pub const UNHEALTHY: &str = "Unhealthy";
        /// How long the kubelet waits for `PreStartContainer`.
        pub const PRE_START_CONTAINER_RPC_TIMEOUT: Duration = Duration::from_secs(30);
    }
}

/// Kubelet pod-resources API.
pub mod podresources {
    /// Pod-resources API v1 (protobuf package `v1`).
    pub mod v1 {
        generated!("v1");

        /// Where the kubelet serves the pod-resources API by default.
        pub const POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
    }
}

/// The kubelet's plugin-registration API (the plugin watcher of `plugins_registry`).
pub mod pluginregistration {
    /// Plugin registration v1 (protobuf package `pluginregistration`).
    pub mod v1 {
        generated!("pluginregistration");

        /// `PluginInfo.type` of a DRA driver.
        pub const DRA_PLUGIN: &str = "DRAPlugin";
        /// The kubelet's plugin-registration directory.
        pub const PLUGINS_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
    }
}

/// The kubelet's Dynamic Resource Allocation plugin API.
pub mod dra {
    /// DRA plugin API v1 (protobuf package `k8s.io.kubelet.pkg.apis.dra.v1`), kubelets from 1.34.
    pub mod v1 {
        generated!("k8s.io.kubelet.pkg.apis.dra.v1");

        /// What a driver lists in `PluginInfo.supported_versions` for this service.
        pub const DRA_PLUGIN_SERVICE: &str = "v1.DRAPlugin";
    }

    /// DRA plugin API v1beta1 (protobuf package `k8s.io.kubelet.pkg.apis.dra.v1beta1`), for
    /// kubelets before 1.34; the same messages as v1.
    pub mod v1beta1 {
        generated!("k8s.io.kubelet.pkg.apis.dra.v1beta1");

        /// What a driver lists in `PluginInfo.supported_versions` for this service.
        pub const DRA_PLUGIN_SERVICE: &str = "v1beta1.DRAPlugin";
    }
}

/// The kubelet's DRA resource-health service (KEP-4680). Generated apart: its protobuf packages
/// are plain `v1` and `v1alpha1`, and pod-resources is package `v1` too.
pub mod dra_health {
    /// Resource health v1 (protobuf package `v1`), kubelets from 1.36.
    pub mod v1 {
        generated!(file "/dra_health/v1.rs");

        /// What a driver lists in `PluginInfo.supported_versions` when it serves this service.
        pub const DRA_RESOURCE_HEALTH_SERVICE: &str = "v1.DRAResourceHealth";
    }

    /// Resource health v1alpha1 (protobuf package `v1alpha1`), the same messages for kubelets
    /// from 1.34 (alpha, `ResourceHealthStatus` gate) until they speak v1.
    pub mod v1alpha1 {
        generated!(file "/dra_health/v1alpha1.rs");

        /// What a driver lists in `PluginInfo.supported_versions` when it serves this service.
        pub const DRA_RESOURCE_HEALTH_SERVICE: &str = "v1alpha1.DRAResourceHealth";
    }
}

/// Tessera's own APIs.
pub mod tessera {
    /// The node API v1 (protobuf package `tessera.v1`), served by tesserad to the CLI.
    pub mod v1 {
        generated!("tessera.v1");
    }
}

#[cfg(test)]
mod tests {
    use super::deviceplugin::v1beta1;

    #[test]
    fn kubelet_socket_is_in_the_plugin_dir() {
        assert_eq!(v1beta1::KUBELET_SOCKET, format!("{}{}", v1beta1::DEVICE_PLUGIN_PATH, v1beta1::KUBELET_SOCKET_NAME));
    }
}
