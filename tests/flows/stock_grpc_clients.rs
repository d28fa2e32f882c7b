//! Stock gRPC clients on tesserad's Unix sockets. grpc-core 1.57+ (Python, C++, Ruby) sends the
//! percent-encoded socket path as `:authority`, grpc-java the path itself; h2 used to reset such
//! streams (PROTOCOL_ERROR). Here: raw HTTP/2 requests with both authorities get answers from the
//! node API and a kubelet plugin socket, and the documented Python example client
//! (examples/python/tessera_client.py, stock grpcio with its defaults, modules generated from
//! proto/ at run time) drives Allocate, SetLimits, ListAllocations, a refusal and Release.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use tessera_sim_testkit::SimNode;
use tessera_tests::Tesserad;
use tessera_tests::kubelet::{TestKubelet, node_api, spawn};

/// One HPACK literal header field without indexing, new name, no Huffman coding.
fn literal(block: &mut Vec<u8>, name: &str, value: &str) {
    assert!(name.len() < 127 && value.len() < 127, "one-byte lengths only");
    block.push(0x00);
    block.push(name.len() as u8);
    block.extend_from_slice(name.as_bytes());
    block.push(value.len() as u8);
    block.extend_from_slice(value.as_bytes());
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len() as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const GOAWAY: u8 = 7;

/// A unary gRPC call of `path` with an empty request message and `authority`, over raw HTTP/2:
/// `Ok` when the server answered with a response message, `Err` naming what it did instead.
fn raw_call(socket: &Path, path: &str, authority: &str) -> Result<(), String> {
    let mut s = UnixStream::connect(socket).map_err(|e| format!("{}: {e}", socket.display()))?;
    // A safety net against a hang, not a measurement.
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    frame(&mut out, SETTINGS, 0, 0, &[]);
    let mut block = Vec::new();
    for (k, v) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        literal(&mut block, k, v);
    }
    frame(&mut out, HEADERS, 0x4, 1, &block);
    frame(&mut out, DATA, 0x1, 1, &[0, 0, 0, 0, 0]);
    s.write_all(&out).map_err(|e| e.to_string())?;
    loop {
        let mut head = [0u8; 9];
        s.read_exact(&mut head).map_err(|e| format!("reading a frame: {e}"))?;
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).map_err(|e| format!("reading a frame: {e}"))?;
        match (kind, stream) {
            (SETTINGS, 0) if flags & 1 == 0 => {
                let mut ack = Vec::new();
                frame(&mut ack, SETTINGS, 1, 0, &[]);
                s.write_all(&ack).map_err(|e| e.to_string())?;
            }
            (DATA, 1) if len >= 5 => return Ok(()),
            (RST_STREAM, 1) => return Err(format!("RST_STREAM {:?}", payload)),
            (GOAWAY, _) => return Err(format!("GOAWAY {:?}", payload)),
            // Trailers without a message: the call failed (grpc-status in the block).
            (HEADERS, 1) if flags & 1 == 1 => return Err("trailers without a response message".into()),
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_authorities_stock_clients_send_are_accepted() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let config = tessera_tests::kubelet::write_config(&node, dir, "");
    let mut kubelet = TestKubelet::start(&dir.join("plugins"));
    let _daemon = spawn(&node, &config, &dir.join("no-notify"), &dir.join("tesserad.log"));
    let socket = dir.join("run/tessera.sock");
    let _ = node_api(&socket).await;
    let (reg, _) = kubelet.next_registration().await;
    let plugin = dir.join("plugins").join(&reg.endpoint);

    let percent = socket.display().to_string().replace('/', "%2F");
    let socket_path = socket.display().to_string();
    for authority in ["localhost", percent.as_str(), socket_path.as_str()] {
        let node_call = raw_call(&socket, "/tessera.v1.Node/ListAllocations", authority);
        assert_eq!(node_call, Ok(()), "node API, :authority {authority:?}");
        let plugin_call = raw_call(&plugin, "/v1beta1.DevicePlugin/GetDevicePluginOptions", authority);
        assert_eq!(plugin_call, Ok(()), "plugin socket, :authority {authority:?}");
    }
    // Still HTTP/2 as h2 checks it otherwise: an unknown method is an answer, not a hang.
    assert!(raw_call(&socket, "/tessera.v1.Node/NoSuchCall", "localhost").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_example_client_runs_with_grpcio_defaults() {
    let Some(python) =
        tessera_tests::venv_python("TESSERA_GRPC_PYTHON", "grpc-python", "import grpc, grpc_tools", "grpcio")
    else {
        return;
    };
    let node = SimNode::with_description("[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n");
    let (tesserad, _) = Tesserad::start(&node, "").await;
    let socket = tesserad.dir().join("run/tessera.sock");

    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/python/tessera_client.py");
    let out = std::process::Command::new(&python)
        .arg(&example)
        .arg("--socket")
        .arg(&socket)
        .args(["--memory-mib", "2048", "--sm", "20", "--owner", "fn-py"])
        .output()
        .expect("python");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let steps: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"))).collect();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap_or("")).collect();
    assert_eq!(names, ["allocate", "set_limits", "list", "refused", "release"], "{text}");
    let id = steps[0]["id"].as_str().expect("id");
    assert_eq!(steps[0]["memory_limit_bytes"], 2048u64 << 20);
    assert_eq!(steps[0]["env"]["TESSERA_ALLOCATION"], id);
    assert_eq!(steps[1]["sm_percent"], 40);
    assert_eq!(steps[2]["ids"], serde_json::json!([id]));
    assert_eq!(steps[2]["owners"], serde_json::json!(["fn-py"]));
    assert_eq!(steps[3]["code"], "RESOURCE_EXHAUSTED");
    assert!(steps[3]["message"].as_str().is_some_and(|m| m.contains("no GPU has room")), "{text}");
    assert_eq!(steps[4]["released"], true);
    assert_eq!(steps[4]["released_again"], false);
}
