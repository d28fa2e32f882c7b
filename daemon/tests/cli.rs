//! The `tessera` CLI as scripts and people use it, against the built `tesserad` on the simulated
//! node: streaming commands end quietly when their reader goes away (`| head`), `top` writes no
//! screen control into a pipe and no `-0.0%`, every read command's `--json` parses, and
//! connection errors name the real cause.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_sim_testkit::{SimNode, binary};

mod common;

const NODE: &str = "numa_nodes = 1
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 2
";

fn tessera(socket: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(binary("tessera")).arg("--socket").arg(socket).args(args).output().expect("run tessera");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `tessera args` into a pipe, reads `lines` lines, closes the pipe (as `head` does), calls
/// `poke` (something more to print: a follower that printed everything waits for it) and asserts
/// the command then ends by itself, with status 0 and nothing on stderr.
#[track_caller]
fn ends_quietly_when_the_reader_goes(socket: &Path, args: &[&str], lines: usize, poke: &dyn Fn()) -> Vec<String> {
    let mut child = Command::new(binary("tessera"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tessera");
    let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
    let mut got = Vec::new();
    for _ in 0..lines {
        let mut line = String::new();
        reader.read_line(&mut line).expect("read a line");
        got.push(line);
    }
    drop(reader);
    poke();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "`tessera {}` kept running after its reader left", args.join(" "));
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut err).expect("stderr");
    assert!(status.success(), "`tessera {}`: {status:?}\n{err}", args.join(" "));
    assert!(err.is_empty(), "`tessera {}` wrote to stderr: {err}", args.join(" "));
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pipes_and_json() {
    let node = SimNode::with_description(NODE);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let config = common::write_config(&node, dir, "[partitions.default]\nwhole = true\n");
    let (_daemon, _) = common::spawn(&node, &config, &dir.join("notify.sock"), &dir.join("tesserad.log"));
    let socket = dir.join("run/tessera.sock");
    let _ = common::node_api(&socket).await;
    // A few kept events.
    let shares = |n: &str| {
        let (code, out, err) = tessera(&socket, &["layout", "apply", "--gpu", "1", "--shares", n]);
        assert_eq!(code, 0, "{out}{err}");
    };
    for n in ["2", "3", "4", "2"] {
        shares(n);
    }
    let new_event = || {
        shares("3");
        shares("2");
    };

    // `| head`: every streaming command ends quietly.
    let lines = ends_quietly_when_the_reader_goes(&socket, &["events", "--replay", "30", "--follow"], 2, &new_event);
    assert!(lines[0].contains("partition_changed"), "{lines:?}");
    ends_quietly_when_the_reader_goes(&socket, &["events", "--replay", "30", "--follow", "--json"], 1, &new_event);
    let frame = ends_quietly_when_the_reader_goes(&socket, &["top", "--interval-ms", "100"], 6, &|| {});
    let text = frame.concat();
    assert!(!text.contains('\x1b'), "no screen control into a pipe: {text:?}");
    assert!(!text.contains("-0.0%"), "{text}");
    assert!(text.contains("0.0%"), "idle GPUs show 0.0%: {text}");
    ends_quietly_when_the_reader_goes(&socket, &["top", "--interval-ms", "100", "--json"], 1, &|| {});

    // --json: each read command's output parses, with the documented fields.
    let (code, out, err) = tessera(&socket, &["events", "--replay", "10", "--json"]);
    assert_eq!(code, 0, "{err}");
    let events: Vec<serde_json::Value> =
        out.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
    assert_eq!(events.len(), 8, "{out}");
    assert_eq!(events[0]["kind"], "PARTITION_CHANGED");
    assert!(events[0]["sequence"].as_u64().is_some() && events[0]["time_unix_nano"].as_u64().is_some());
    assert!(events[0]["device_uuid"].as_str().is_some_and(|u| u.starts_with("GPU-")));
    // The detail by kind: a layout change names its layouts and the device ids it made.
    let d = &events[0]["detail"];
    assert!(d["current"].as_str().is_some_and(|l| !l.is_empty()), "{}", events[0]);
    assert!(d["created_device_ids"].as_array().is_some_and(|ids| !ids.is_empty()), "{}", events[0]);

    let (code, out, err) = tessera(&socket, &["layout", "show", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("layout show --json");
    let gpus = v["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 2);
    assert_eq!((gpus[1]["gpu_index"].as_u64(), gpus[1]["state"].as_str()), (Some(1), Some("CONVERGED")));
    assert_eq!(gpus[1]["current"], "shares x2");
    assert_eq!(gpus[1]["device_ids"].as_array().map(Vec::len), Some(2));
    assert_eq!(gpus[0]["mig_mode"], "DISABLED");

    let (code, out, err) = tessera(&socket, &["top", "--once", "--json", "--interval-ms", "100"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("top --once --json");
    assert!(v["containers"].as_array().is_some() && v["window_nanos"].as_u64().is_some(), "{v}");

    let (code, out, err) = tessera(&socket, &["status", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("status --json");
    assert_eq!(v["partitions"].as_array().map(Vec::len), Some(2));

    // Trace: an unknown container is refused before anything is recorded.
    let (code, _, err) = tessera(&socket, &["trace", "nobody/here", "--json"]);
    assert_ne!(code, 0);
    assert!(err.contains("no allocation or container"), "{err}");

    // A device's UUID given to release is said to be one, not "already released".
    let (code, _, err) = tessera(&socket, &["release", gpus[0]["gpu_uuid"].as_str().expect("uuid")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is a device, not an allocation"), "{err}");

    // Input repeated in an error is cut short: quoted whole, a 20,000-byte argument made the
    // status too large for the client's trailers ("h2 protocol error").
    let long = "A".repeat(20_000);
    let (code, _, err) = tessera(&socket, &["alloc", "--memory", "1GiB", "--sm", "1", "--gpu", &long]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no GPU") && err.contains("(20000 bytes)"), "{}", &err[..err.len().min(300)]);
    let (code, _, err) = tessera(&socket, &["limits", "set", &long, "--sm", "5"]);
    assert_eq!(code, 1);
    assert!(err.contains("(20000 bytes)") && !err.contains("h2 protocol"), "{}", &err[..err.len().min(300)]);

    // `tessera alloc ... | head -0`: its reader gone before it prints, it ends quietly (it
    // panicked, printing with std's macros), and so does `allocations --json`.
    ends_quietly_when_the_reader_goes(&socket, &["alloc", "--memory", "1GiB", "--sm", "10", "--gpu", "1"], 0, &|| {});
    ends_quietly_when_the_reader_goes(&socket, &["allocations", "--json"], 0, &|| {});
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_errors_name_the_cause() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let (code, _, err) = tessera(&dir.join("none.sock"), &["status"]);
    assert_eq!(code, 1);
    assert!(err.contains("no such file") && err.contains("--socket"), "{err}");
    std::fs::write(dir.join("file"), "").expect("file");
    let (_, _, err) = tessera(&dir.join("file"), &["status"]);
    assert!(err.contains("is not a socket"), "{err}");
    // A socket left behind by a daemon that is gone.
    drop(std::os::unix::net::UnixListener::bind(dir.join("stale.sock")).expect("bind"));
    let (_, _, err) = tessera(&dir.join("stale.sock"), &["status"]);
    assert!(err.contains("connection refused") && err.contains("start tesserad"), "{err}");
    // A gRPC server that is not the node API (the kubelet's registration socket).
    let kubelet = common::TestKubelet::start(dir);
    let (_, _, err) = tessera(&dir.join("kubelet.sock"), &["status"]);
    assert!(err.contains("does not serve tessera's node API"), "{err}");
    assert!(!err.trim_end().ends_with(':'), "{err}");
    kubelet.stop().await;

    // The owner-only socket, as another user.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return common::skip("connection_errors_name_the_cause (permission denied) needs root to run as another user");
    }
    let _listener = std::os::unix::net::UnixListener::bind(dir.join("owner.sock")).expect("bind");
    std::fs::set_permissions(dir.join("owner.sock"), std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = Command::new(binary("tessera"))
        .arg("--socket")
        .arg(dir.join("owner.sock"))
        .arg("status")
        .uid(65534)
        .gid(65534)
        .output()
        .expect("run tessera as nobody");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("permission denied on") && err.contains("owner-only"), "{err}");
}
