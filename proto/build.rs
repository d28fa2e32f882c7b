//! Compiles the .proto files with protox (no protoc binary) and generates prost messages plus tonic
//! clients and servers for every service. The encoded FileDescriptorSet is written next to the code
//! for `FILE_DESCRIPTOR_SET` (gRPC reflection).

use std::env;
use std::fs;
use std::path::PathBuf;

use prost::Message;

/// Relative to `proto/`; the path is the file's name inside the descriptor set.
const PROTOS: &[&str] = &[
    "kubelet/deviceplugin/v1beta1/api.proto",
    "kubelet/podresources/v1/api.proto",
    "kubelet/pluginregistration/v1/api.proto",
    "kubelet/dra/v1/api.proto",
    "kubelet/dra/v1beta1/api.proto",
    "tessera/v1/node.proto",
];

/// The kubelet's DRA resource-health service. Its packages are plain `v1` and `v1alpha1`, and
/// pod-resources is package `v1` too: generated apart (into `OUT_DIR/dra_health/`) so the two
/// `v1` packages do not share one Rust module.
const HEALTH_PROTOS: &[&str] = &["kubelet/dra-health/v1/api.proto", "kubelet/dra-health/v1alpha1/api.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let include = manifest_dir.join("proto");
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);

    println!("cargo:rerun-if-changed=build.rs");
    for proto in PROTOS.iter().chain(HEALTH_PROTOS) {
        println!("cargo:rerun-if-changed={}", include.join(proto).display());
    }

    // The descriptor set holds every file (no symbol of one `v1` file clashes with the other's).
    let all: Vec<&str> = PROTOS.iter().chain(HEALTH_PROTOS).copied().collect();
    let fds = protox::compile(&all, [&include]).map_err(|e| format!("protox: {e:?}"))?;
    fs::write(out_dir.join("tessera_proto_descriptor.bin"), fds.encode_to_vec())?;

    // A closure: the descriptor set's type is prost-types', not a dependency of this build script.
    let generate = |fds, out: &std::path::Path| {
        tonic_prost_build::configure()
            .build_server(true)
            .build_client(true)
            .build_transport(true)
            .emit_rerun_if_changed(false)
            .out_dir(out)
            .compile_fds(fds)
    };
    let fds = protox::compile(PROTOS, [&include]).map_err(|e| format!("protox: {e:?}"))?;
    generate(fds, &out_dir)?;
    let health_dir = out_dir.join("dra_health");
    fs::create_dir_all(&health_dir)?;
    let fds = protox::compile(HEALTH_PROTOS, [&include]).map_err(|e| format!("protox: {e:?}"))?;
    generate(fds, &health_dir)?;
    Ok(())
}
