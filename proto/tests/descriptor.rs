//! The wire contract, read back from `FILE_DESCRIPTOR_SET`: packages, services, methods and the
//! exact field numbers and types of the kubelet messages.

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, FileDescriptorProto, FileDescriptorSet, ServiceDescriptorProto};

fn set() -> FileDescriptorSet {
    FileDescriptorSet::decode(tessera_proto::FILE_DESCRIPTOR_SET).expect("descriptor set decodes")
}

fn file<'a>(set: &'a FileDescriptorSet, package: &str) -> &'a FileDescriptorProto {
    set.file.iter().find(|f| f.package() == package).unwrap_or_else(|| panic!("package {package}"))
}

fn message<'a>(file: &'a FileDescriptorProto, name: &str) -> &'a DescriptorProto {
    file.message_type.iter().find(|m| m.name() == name).unwrap_or_else(|| panic!("message {name}"))
}

fn service<'a>(file: &'a FileDescriptorProto, name: &str) -> &'a ServiceDescriptorProto {
    file.service.iter().find(|s| s.name() == name).unwrap_or_else(|| panic!("service {name}"))
}

/// Asserts a field's number, type and label; `type_name` for message fields (".pkg.Name").
#[track_caller]
fn field(msg: &DescriptorProto, name: &str, number: i32, ty: Type, label: Label, type_name: Option<&str>) {
    let f = msg.field.iter().find(|f| f.name() == name).unwrap_or_else(|| panic!("{}.{name}", msg.name()));
    assert_eq!(f.number(), number, "{}.{name} number", msg.name());
    assert_eq!(f.r#type(), ty, "{}.{name} type", msg.name());
    assert_eq!(f.label(), label, "{}.{name} label", msg.name());
    if let Some(type_name) = type_name {
        assert_eq!(f.type_name(), type_name, "{}.{name} type name", msg.name());
    }
}

#[test]
fn device_plugin_v1beta1_wire_contract() {
    let set = set();
    let f = file(&set, "v1beta1");
    assert_eq!(f.name(), "kubelet/deviceplugin/v1beta1/api.proto");
    assert_eq!(f.syntax(), "proto3");

    let registration = service(f, "Registration");
    let m: Vec<_> = registration.method.iter().map(|m| (m.name(), m.input_type(), m.output_type())).collect();
    assert_eq!(m, [("Register", ".v1beta1.RegisterRequest", ".v1beta1.Empty")]);

    let plugin = service(f, "DevicePlugin");
    let m: Vec<_> = plugin
        .method
        .iter()
        .map(|m| (m.name(), m.input_type(), m.output_type(), m.server_streaming(), m.client_streaming()))
        .collect();
    assert_eq!(
        m,
        [
            ("GetDevicePluginOptions", ".v1beta1.Empty", ".v1beta1.DevicePluginOptions", false, false),
            ("ListAndWatch", ".v1beta1.Empty", ".v1beta1.ListAndWatchResponse", true, false),
            (
                "GetPreferredAllocation",
                ".v1beta1.PreferredAllocationRequest",
                ".v1beta1.PreferredAllocationResponse",
                false,
                false
            ),
            ("Allocate", ".v1beta1.AllocateRequest", ".v1beta1.AllocateResponse", false, false),
            (
                "PreStartContainer",
                ".v1beta1.PreStartContainerRequest",
                ".v1beta1.PreStartContainerResponse",
                false,
                false
            ),
        ]
    );

    use Label::{Optional as One, Repeated};
    let opts = message(f, "DevicePluginOptions");
    field(opts, "pre_start_required", 1, Type::Bool, One, None);
    field(opts, "get_preferred_allocation_available", 2, Type::Bool, One, None);

    let reg = message(f, "RegisterRequest");
    field(reg, "version", 1, Type::String, One, None);
    field(reg, "endpoint", 2, Type::String, One, None);
    field(reg, "resource_name", 3, Type::String, One, None);
    field(reg, "options", 4, Type::Message, One, Some(".v1beta1.DevicePluginOptions"));

    field(message(f, "ListAndWatchResponse"), "devices", 1, Type::Message, Repeated, Some(".v1beta1.Device"));
    field(message(f, "TopologyInfo"), "nodes", 1, Type::Message, Repeated, Some(".v1beta1.NUMANode"));
    field(message(f, "NUMANode"), "ID", 1, Type::Int64, One, None);

    let device = message(f, "Device");
    field(device, "ID", 1, Type::String, One, None);
    field(device, "health", 2, Type::String, One, None);
    field(device, "topology", 3, Type::Message, One, Some(".v1beta1.TopologyInfo"));

    field(message(f, "PreStartContainerRequest"), "devices_ids", 1, Type::String, Repeated, None);
    assert!(message(f, "PreStartContainerResponse").field.is_empty());
    assert!(message(f, "Empty").field.is_empty());

    let pref = message(f, "ContainerPreferredAllocationRequest");
    field(pref, "available_deviceIDs", 1, Type::String, Repeated, None);
    field(pref, "must_include_deviceIDs", 2, Type::String, Repeated, None);
    field(pref, "allocation_size", 3, Type::Int32, One, None);
    field(
        message(f, "PreferredAllocationRequest"),
        "container_requests",
        1,
        Type::Message,
        Repeated,
        Some(".v1beta1.ContainerPreferredAllocationRequest"),
    );
    field(
        message(f, "PreferredAllocationResponse"),
        "container_responses",
        1,
        Type::Message,
        Repeated,
        Some(".v1beta1.ContainerPreferredAllocationResponse"),
    );
    field(message(f, "ContainerPreferredAllocationResponse"), "deviceIDs", 1, Type::String, Repeated, None);

    field(
        message(f, "AllocateRequest"),
        "container_requests",
        1,
        Type::Message,
        Repeated,
        Some(".v1beta1.ContainerAllocateRequest"),
    );
    field(message(f, "ContainerAllocateRequest"), "devices_ids", 1, Type::String, Repeated, None);
    field(message(f, "CDIDevice"), "name", 1, Type::String, One, None);
    field(
        message(f, "AllocateResponse"),
        "container_responses",
        1,
        Type::Message,
        Repeated,
        Some(".v1beta1.ContainerAllocateResponse"),
    );

    let car = message(f, "ContainerAllocateResponse");
    field(car, "envs", 1, Type::Message, Repeated, Some(".v1beta1.ContainerAllocateResponse.EnvsEntry"));
    field(car, "mounts", 2, Type::Message, Repeated, Some(".v1beta1.Mount"));
    field(car, "devices", 3, Type::Message, Repeated, Some(".v1beta1.DeviceSpec"));
    field(car, "annotations", 4, Type::Message, Repeated, Some(".v1beta1.ContainerAllocateResponse.AnnotationsEntry"));
    field(car, "cdi_devices", 5, Type::Message, Repeated, Some(".v1beta1.CDIDevice"));
    for entry in ["EnvsEntry", "AnnotationsEntry"] {
        let e = car.nested_type.iter().find(|n| n.name() == entry).expect("map entry");
        assert!(e.options.as_ref().is_some_and(|o| o.map_entry()), "{entry} is a map");
        field(e, "key", 1, Type::String, One, None);
        field(e, "value", 2, Type::String, One, None);
    }

    let mount = message(f, "Mount");
    field(mount, "container_path", 1, Type::String, One, None);
    field(mount, "host_path", 2, Type::String, One, None);
    field(mount, "read_only", 3, Type::Bool, One, None);
    let spec = message(f, "DeviceSpec");
    field(spec, "container_path", 1, Type::String, One, None);
    field(spec, "host_path", 2, Type::String, One, None);
    field(spec, "permissions", 3, Type::String, One, None);

    // Nothing beyond the published API.
    assert_eq!(f.message_type.len(), 20);
    assert_eq!(f.service.len(), 2);
}

#[test]
fn pod_resources_v1_wire_contract() {
    let set = set();
    let f = file(&set, "v1");
    assert_eq!(f.name(), "kubelet/podresources/v1/api.proto");
    let lister = service(f, "PodResourcesLister");
    let m: Vec<_> = lister.method.iter().map(|m| (m.name(), m.input_type(), m.output_type())).collect();
    assert_eq!(
        m,
        [
            ("List", ".v1.ListPodResourcesRequest", ".v1.ListPodResourcesResponse"),
            ("GetAllocatableResources", ".v1.AllocatableResourcesRequest", ".v1.AllocatableResourcesResponse"),
            ("Get", ".v1.GetPodResourcesRequest", ".v1.GetPodResourcesResponse"),
        ]
    );

    use Label::{Optional as One, Repeated};
    let pod = message(f, "PodResources");
    field(pod, "name", 1, Type::String, One, None);
    field(pod, "namespace", 2, Type::String, One, None);
    field(pod, "containers", 3, Type::Message, Repeated, Some(".v1.ContainerResources"));
    field(pod, "cpu_ids", 4, Type::Int64, Repeated, None);
    field(pod, "memory", 5, Type::Message, Repeated, Some(".v1.ContainerMemory"));

    let container = message(f, "ContainerResources");
    field(container, "devices", 2, Type::Message, Repeated, Some(".v1.ContainerDevices"));
    field(container, "dynamic_resources", 5, Type::Message, Repeated, Some(".v1.DynamicResource"));

    let devices = message(f, "ContainerDevices");
    field(devices, "resource_name", 1, Type::String, One, None);
    field(devices, "device_ids", 2, Type::String, Repeated, None);
    field(devices, "topology", 3, Type::Message, One, Some(".v1.TopologyInfo"));

    let memory = message(f, "ContainerMemory");
    field(memory, "size", 2, Type::Uint64, One, None);

    let dynamic = message(f, "DynamicResource");
    assert!(dynamic.field.iter().all(|f| f.number() != 1), "field 1 stays retired");
    assert!(dynamic.reserved_range.iter().any(|r| r.start() == 1 && r.end() == 2));
    field(dynamic, "claim_name", 2, Type::String, One, None);
    field(dynamic, "claim_resources", 4, Type::Message, Repeated, Some(".v1.ClaimResource"));

    let claim = message(f, "ClaimResource");
    field(claim, "cdi_devices", 1, Type::Message, Repeated, Some(".v1.CDIDevice"));
    field(claim, "device_name", 4, Type::String, One, None);
    let share = claim.field.iter().find(|f| f.name() == "share_id").expect("share_id");
    assert_eq!((share.number(), share.proto3_optional()), (5, true));

    field(message(f, "GetPodResourcesRequest"), "pod_namespace", 2, Type::String, One, None);
    field(message(f, "GetPodResourcesResponse"), "pod_resources", 1, Type::Message, One, Some(".v1.PodResources"));
    field(message(f, "AllocatableResourcesResponse"), "cpu_ids", 2, Type::Int64, Repeated, None);
}

#[test]
fn tessera_v1_enums_start_unspecified_and_services_are_complete() {
    let set = set();
    let f = file(&set, "tessera.v1");
    assert_eq!(f.name(), "tessera/v1/node.proto");
    let node = service(f, "Node");
    let m: Vec<_> = node.method.iter().map(|m| (m.name(), m.server_streaming())).collect();
    assert_eq!(
        m,
        [
            ("ListDevices", false),
            ("ListPartitions", false),
            ("ListAllocations", false),
            ("ApplyLayout", false),
            ("WatchEvents", true),
            ("GetUsage", false),
            ("Reload", false),
            ("Trace", false),
            ("Allocate", false),
            ("Release", false),
            ("SetLimits", false),
            ("Park", false),
            ("Resume", false),
        ]
    );
    use Label::{Optional as One, Repeated};
    // The on-demand allocation messages: field numbers are the wire contract.
    field(message(f, "AllocateRequest"), "memory_bytes", 1, Type::Uint64, One, None);
    field(message(f, "AllocateRequest"), "sm_percent", 2, Type::Uint32, One, None);
    field(message(f, "AllocateRequest"), "priority", 3, Type::Enum, One, Some(".tessera.v1.Priority"));
    field(message(f, "AllocateRequest"), "gpu", 5, Type::String, One, None);
    field(message(f, "AllocateRequest"), "lease", 7, Type::Enum, One, Some(".tessera.v1.Lease"));
    field(message(f, "AllocateResponse"), "cdi_devices", 2, Type::String, Repeated, None);
    field(message(f, "ReleaseRequest"), "allocation_id", 1, Type::String, One, None);
    field(message(f, "SetLimitsRequest"), "memory_bytes", 2, Type::Uint64, One, None);
    field(message(f, "SetLimitsRequest"), "sm_percent", 3, Type::Uint32, One, None);
    field(message(f, "Allocation"), "owner", 7, Type::String, One, None);
    field(message(f, "Allocation"), "lease", 8, Type::Enum, One, Some(".tessera.v1.Lease"));
    field(message(f, "Allocation"), "state", 9, Type::Enum, One, Some(".tessera.v1.AllocationState"));
    field(message(f, "ParkRequest"), "allocation_id", 1, Type::String, One, None);
    field(message(f, "ParkResponse"), "bytes", 2, Type::Uint64, One, None);
    field(message(f, "ParkResponse"), "duration_nanos", 3, Type::Uint64, One, None);
    field(message(f, "ResumeRequest"), "allocation_id", 1, Type::String, One, None);
    assert!(!f.enum_type.is_empty());
    for e in &f.enum_type {
        let zero = &e.value[0];
        assert_eq!(zero.number(), 0, "{}", e.name());
        assert!(zero.name().ends_with("_UNSPECIFIED"), "{} starts with {}", e.name(), zero.name());
    }
}

#[test]
fn plugin_registration_v1_wire_contract() {
    let set = set();
    let f = file(&set, "pluginregistration");
    assert_eq!(f.name(), "kubelet/pluginregistration/v1/api.proto");
    assert_eq!(f.syntax(), "proto3");
    let registration = service(f, "Registration");
    let m: Vec<_> = registration.method.iter().map(|m| (m.name(), m.input_type(), m.output_type())).collect();
    assert_eq!(
        m,
        [
            ("GetInfo", ".pluginregistration.InfoRequest", ".pluginregistration.PluginInfo"),
            (
                "NotifyRegistrationStatus",
                ".pluginregistration.RegistrationStatus",
                ".pluginregistration.RegistrationStatusResponse"
            ),
        ]
    );
    use Label::{Optional as One, Repeated};
    let info = message(f, "PluginInfo");
    field(info, "type", 1, Type::String, One, None);
    field(info, "name", 2, Type::String, One, None);
    field(info, "endpoint", 3, Type::String, One, None);
    field(info, "supported_versions", 4, Type::String, Repeated, None);
    let status = message(f, "RegistrationStatus");
    field(status, "plugin_registered", 1, Type::Bool, One, None);
    field(status, "error", 2, Type::String, One, None);
    assert!(message(f, "RegistrationStatusResponse").field.is_empty());
    assert!(message(f, "InfoRequest").field.is_empty());
}

/// v1 and v1beta1 are the same service and messages in two packages.
#[test]
fn dra_v1_and_v1beta1_wire_contract() {
    let set = set();
    for version in ["v1", "v1beta1"] {
        let package = format!("k8s.io.kubelet.pkg.apis.dra.{version}");
        let f = file(&set, &package);
        assert_eq!(f.name(), format!("kubelet/dra/{version}/api.proto"));
        assert_eq!(f.syntax(), "proto3");
        let p = |name: &str| format!(".{package}.{name}");
        let plugin = service(f, "DRAPlugin");
        let m: Vec<_> = plugin
            .method
            .iter()
            .map(|m| (m.name().to_owned(), m.input_type().to_owned(), m.output_type().to_owned()))
            .collect();
        assert_eq!(
            m,
            [
                (
                    "NodePrepareResources".to_owned(),
                    p("NodePrepareResourcesRequest"),
                    p("NodePrepareResourcesResponse")
                ),
                (
                    "NodeUnprepareResources".to_owned(),
                    p("NodeUnprepareResourcesRequest"),
                    p("NodeUnprepareResourcesResponse")
                ),
            ],
            "{version}"
        );
        use Label::{Optional as One, Repeated};
        field(message(f, "NodePrepareResourcesRequest"), "claims", 1, Type::Message, Repeated, Some(&p("Claim")));
        field(message(f, "NodeUnprepareResourcesRequest"), "claims", 1, Type::Message, Repeated, Some(&p("Claim")));
        // map<string, …> claims = 1: a repeated entry message with key 1 and value 2.
        for (response, value) in [
            ("NodePrepareResourcesResponse", "NodePrepareResourceResponse"),
            ("NodeUnprepareResourcesResponse", "NodeUnprepareResourceResponse"),
        ] {
            let msg = message(f, response);
            let entry = p(&format!("{response}.ClaimsEntry"));
            field(msg, "claims", 1, Type::Message, Repeated, Some(&entry));
            let nested = msg.nested_type.iter().find(|n| n.name() == "ClaimsEntry").expect("ClaimsEntry");
            assert!(nested.options.as_ref().is_some_and(|o| o.map_entry()), "{response}.claims is a map");
            field(nested, "key", 1, Type::String, One, None);
            field(nested, "value", 2, Type::Message, One, Some(&p(value)));
        }
        let prepared = message(f, "NodePrepareResourceResponse");
        field(prepared, "devices", 1, Type::Message, Repeated, Some(&p("Device")));
        field(prepared, "error", 2, Type::String, One, None);
        field(message(f, "NodeUnprepareResourceResponse"), "error", 1, Type::String, One, None);
        let device = message(f, "Device");
        field(device, "request_names", 1, Type::String, Repeated, None);
        field(device, "pool_name", 2, Type::String, One, None);
        field(device, "device_name", 3, Type::String, One, None);
        field(device, "cdi_device_ids", 4, Type::String, Repeated, None);
        let claim = message(f, "Claim");
        field(claim, "namespace", 1, Type::String, One, None);
        field(claim, "uid", 2, Type::String, One, None);
        field(claim, "name", 3, Type::String, One, None);
    }
}

/// The resource-health service: v1 and v1alpha1 are the same service and messages in packages
/// `v1` and `v1alpha1` (pod-resources is package `v1` too: found by file name).
#[test]
fn dra_health_v1_and_v1alpha1_wire_contract() {
    let set = set();
    for version in ["v1", "v1alpha1"] {
        let name = format!("kubelet/dra-health/{version}/api.proto");
        let f = set.file.iter().find(|f| f.name() == name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!((f.package(), f.syntax()), (version, "proto3"));
        let p = |n: &str| format!(".{version}.{n}");
        let health = service(f, "DRAResourceHealth");
        let m: Vec<_> = health
            .method
            .iter()
            .map(|m| (m.name().to_owned(), m.input_type().to_owned(), m.output_type().to_owned(), m.server_streaming()))
            .collect();
        assert_eq!(
            m,
            [("NodeWatchResources".to_owned(), p("NodeWatchResourcesRequest"), p("NodeWatchResourcesResponse"), true)],
            "{version}"
        );
        assert!(message(f, "NodeWatchResourcesRequest").field.is_empty());
        let status = f.enum_type.iter().find(|e| e.name() == "HealthStatus").expect("HealthStatus");
        let values: Vec<_> = status.value.iter().map(|v| (v.name(), v.number())).collect();
        assert_eq!(values, [("UNKNOWN", 0), ("HEALTHY", 1), ("UNHEALTHY", 2)]);
        use Label::{Optional as One, Repeated};
        let id = message(f, "DeviceIdentifier");
        field(id, "pool_name", 1, Type::String, One, None);
        field(id, "device_name", 2, Type::String, One, None);
        let d = message(f, "DeviceHealth");
        field(d, "device", 1, Type::Message, One, Some(&p("DeviceIdentifier")));
        field(d, "health", 2, Type::Enum, One, Some(&p("HealthStatus")));
        field(d, "last_updated_time", 3, Type::Int64, One, None);
        field(d, "health_check_timeout_seconds", 4, Type::Int64, One, None);
        field(d, "message", 5, Type::String, One, None);
        field(
            message(f, "NodeWatchResourcesResponse"),
            "devices",
            1,
            Type::Message,
            Repeated,
            Some(&p("DeviceHealth")),
        );
    }
    // The generated server's path is what the kubelet calls.
    assert_eq!(
        <tessera_proto::dra_health::v1::dra_resource_health_server::DraResourceHealthServer<Never> as tonic::server::NamedService>::NAME,
        "v1.DRAResourceHealth"
    );
    assert_eq!(tessera_proto::dra_health::v1::DRA_RESOURCE_HEALTH_SERVICE, "v1.DRAResourceHealth");
    assert_eq!(tessera_proto::dra_health::v1alpha1::DRA_RESOURCE_HEALTH_SERVICE, "v1alpha1.DRAResourceHealth");
}

/// A server type that never serves, to name the generated service's `NAME`.
struct Never;

#[tonic::async_trait]
impl tessera_proto::dra_health::v1::dra_resource_health_server::DraResourceHealth for Never {
    type NodeWatchResourcesStream =
        tokio_stream::Empty<Result<tessera_proto::dra_health::v1::NodeWatchResourcesResponse, tonic::Status>>;

    async fn node_watch_resources(
        &self,
        _: tonic::Request<tessera_proto::dra_health::v1::NodeWatchResourcesRequest>,
    ) -> Result<tonic::Response<Self::NodeWatchResourcesStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("never"))
    }
}
