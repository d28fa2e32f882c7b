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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let include = manifest_dir.join("proto");
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);

    println!("cargo:rerun-if-changed=build.rs");
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", include.join(proto).display());
    }

    let fds = protox::compile(PROTOS, [&include]).map_err(|e| format!("protox: {e:?}"))?;
    fs::write(out_dir.join("tessera_proto_descriptor.bin"), fds.encode_to_vec())?;

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .build_transport(true)
        .emit_rerun_if_changed(false)
        .compile_fds(fds)?;
    Ok(())
}
