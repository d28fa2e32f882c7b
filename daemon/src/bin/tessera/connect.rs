//! Reaching tesserad's node API, with errors that say what happened and what to do: no socket,
//! a socket only its owner may use, nothing listening, something that is not the node API.

use std::io::ErrorKind;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tonic::transport::Channel;

/// Why the socket cannot be used, checked directly (the gRPC transport hides the cause).
pub fn diagnose(socket: &Path) -> Option<String> {
    let at = socket.display();
    let meta = match std::fs::metadata(socket) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Some(format!(
                "no such file {at}: tesserad is not running, or its node_api_socket is elsewhere \
                 (pass --socket PATH or --config FILE)"
            ));
        }
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            return Some(format!("permission denied on {at}'s directory: run as root (sudo tessera …)"));
        }
        Err(e) => return Some(format!("{at}: {e}")),
    };
    if !meta.file_type().is_socket() {
        return Some(format!("{at} is not a socket: pass tesserad's node API socket with --socket"));
    }
    match std::os::unix::net::UnixStream::connect(socket) {
        Ok(_) => None,
        Err(e) if e.kind() == ErrorKind::PermissionDenied => Some(format!(
            "permission denied on {at}: the node API socket is owner-only (mode 0600); run as its owner (sudo tessera …)"
        )),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => Some(format!(
            "connection refused on {at}: nothing listens there (tesserad stopped and left its socket); start tesserad"
        )),
        Err(e) => Some(format!("{at}: {e}")),
    }
}

/// A client of the node API on `socket`.
pub async fn connect(socket: &Path) -> Result<NodeClient<Channel>, String> {
    if let Some(why) = diagnose(socket) {
        return Err(format!("cannot reach tesserad: {why}"));
    }
    let channel = tonic::transport::Endpoint::from_shared(format!("unix://{}", socket.display()))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("cannot reach tesserad at {}: {e}", socket.display()))?;
    Ok(NodeClient::new(channel))
}

/// A failed call, in words: the code, and the message when there is one; a server that does
/// not serve the node API is named as such.
pub fn status_err(s: tonic::Status) -> String {
    match s.code() {
        tonic::Code::Unimplemented => format!(
            "the socket's server does not serve tessera's node API (tessera.v1.Node){}: is --socket tesserad's \
             node_api_socket?",
            if s.message().is_empty() { String::new() } else { format!(" ({})", s.message()) }
        ),
        tonic::Code::Unavailable if s.message().is_empty() => "tesserad is not answering (unavailable)".into(),
        // The connection broke mid-call (tesserad stopped or was killed): whether the change
        // was made is for `tessera allocations` (or `status`) to say once it is back.
        tonic::Code::Unknown | tonic::Code::Unavailable if s.message().contains("transport error") => format!(
            "the connection to tesserad broke during the call ({}): did it stop? Once it is back, `tessera \
             allocations` or `tessera status` shows whether the change was made",
            s.message()
        ),
        code if s.message().is_empty() => format!("{code}"),
        code => format!("{code}: {}", s.message()),
    }
}

/// Every partition (GPU) the daemon manages.
pub async fn list_partitions(client: &mut NodeClient<Channel>) -> Result<Vec<api::Partition>, String> {
    Ok(client.list_partitions(api::ListPartitionsRequest::default()).await.map_err(status_err)?.into_inner().partitions)
}

/// Every allocation the daemon holds.
pub async fn list_allocations(client: &mut NodeClient<Channel>) -> Result<Vec<api::Allocation>, String> {
    Ok(client
        .list_allocations(api::ListAllocationsRequest::default())
        .await
        .map_err(status_err)?
        .into_inner()
        .allocations)
}

#[cfg(test)]
mod tests {
    use super::status_err;

    #[test]
    fn a_connection_broken_mid_call_is_said_to_be_one() {
        let text = status_err(tonic::Status::unknown("transport error"));
        assert!(text.starts_with("the connection to tesserad broke during the call"), "{text}");
        assert!(text.contains("tessera allocations"), "{text}");
        assert_eq!(
            status_err(tonic::Status::not_found("no allocation \"x\"")),
            "Some requested entity was not found: no allocation \"x\""
        );
    }
}
