//! The MIG lifecycle and dry runs, against the built `tesserad` and `tessera` on the simulated
//! node (no kubelet: the daemon serves the node API alone), on both kinds of GPU:
//! - an A100 takes a MIG mode at the next GPU reset: a change left `pending_reset` finishes by
//!   itself once the GPU is reset (`tessera-sim reset`), with no reload; with
//!   `reset = "when-free"` tesserad resets it, and one `layout apply` turns MIG on or off;
//! - an H100 switches in place: one `layout apply` turns MIG on or off, with no reset, whatever
//!   the reset policy;
//! - for every kind of change, `--dry-run` prints exactly what the real run then prints (for
//!   `layout apply` and `reload`).

use std::path::Path;
use std::time::{Duration, Instant};

use tessera_proto::tessera::v1 as api;
use tessera_sim_testkit::{SimNode, binary, mig_and_whole};

mod common;

use common::{WAIT, spawn, tessera};

/// The GPU that switches MIG mode in place.
const H100: &str = "H100-SXM5-80GB";
/// The GPU that takes a MIG mode at the next reset.
const A100: &str = "A100-SXM4-40GB";

/// What tesserad logs when it resets a GPU for a MIG mode change.
const RESET_LOGGED: &str = "GPU reset to finish its MIG mode change";

fn layouts(gpu1_reset: &str, gpu1: &str) -> String {
    layouts_with("3g.40gb", gpu1_reset, gpu1)
}

fn layouts_with(gpu0_profile: &str, gpu1_reset: &str, gpu1: &str) -> String {
    format!("[partitions.\"0\"]\nmig = {{ \"{gpu0_profile}\" = 2 }}\n[partitions.\"1\"]\n{gpu1}\n{gpu1_reset}\n")
}

/// Runs `args` with `--dry-run`, then for real; asserts both print the same and exit the same.
/// Returns the real run's output.
#[track_caller]
fn same_as_dry_run(socket: &Path, args: &[&str], log: &Path) -> String {
    let mut dry_args = args.to_vec();
    dry_args.push("--dry-run");
    let (dry_code, dry) = tessera(socket, &dry_args);
    assert!(dry.contains("(dry run)"), "a dry run says so: {dry}");
    let (code, real) = tessera(socket, args);
    assert!(!real.contains("(dry run)"), "{real}");
    assert_eq!(
        dry.replace(" (dry run)", ""),
        real,
        "`tessera {}`: the dry run predicted otherwise\n{}",
        args.join(" "),
        std::fs::read_to_string(log).unwrap_or_default()
    );
    assert_eq!(dry_code, code, "{real}");
    real
}

async fn partition(socket: &Path, gpu: u32) -> api::Partition {
    let mut api = common::node_api(socket).await;
    let list = api.list_partitions(api::ListPartitionsRequest::default()).await.expect("partitions").into_inner();
    list.partitions.into_iter().find(|p| p.gpu_index == gpu).expect("GPU listed")
}

/// `tessera layout apply --gpu GPU LAYOUT…`, after its dry run ([`same_as_dry_run`]): its output.
fn apply_layout(socket: &Path, log: &Path, gpu: &str, layout: &[&str]) -> String {
    let mut args = vec!["layout", "apply", "--gpu", gpu];
    args.extend_from_slice(layout);
    same_as_dry_run(socket, &args, log)
}

fn start(node: &SimNode, dir: &Path, body: &str) -> (common::Daemon, std::path::PathBuf, std::path::PathBuf) {
    let config = common::write_config(node, dir, body);
    let log = dir.join("tesserad.log");
    let (daemon, _) = spawn(node, &config, &dir.join("notify.sock"), &log);
    (daemon, dir.join("run/tessera.sock"), log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_a100_mig_mode_change_finishes_by_itself_after_the_reset() {
    let node = SimNode::with_description(&mig_and_whole(A100));
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_daemon, socket, log) = start(&node, tmp.path(), &layouts_with("3g.20gb", "", "whole = true"));
    let _ = common::node_api(&socket).await;

    let (code, text) = tessera(&socket, &["layout", "apply", "--gpu", "1", "--mig", "1g.5gb=7"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("pending_reset -> whole (+0 -1 devices)"), "{text}");
    assert!(text.contains("reset_required: the MIG mode change takes effect at the next GPU reset"), "{text}");
    let p = partition(&socket, 1).await;
    assert_eq!(p.state, api::PartitionState::PendingReset as i32, "{p:?}");
    // `reset = "never"` (the default): tesserad waits for someone else's reset.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(partition(&socket, 1).await.state, api::PartitionState::PendingReset as i32);

    // The operator resets the GPU; nothing else: the layout is applied once NVML shows it.
    let out = node.command(binary("tessera-sim")).args(["reset", "--gpu", "1"]).output().expect("tessera-sim");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let deadline = Instant::now() + WAIT;
    loop {
        let p = partition(&socket, 1).await;
        if p.state == api::PartitionState::Converged as i32 && p.device_ids.len() == 7 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not finished after the reset: {p:?}\n{}",
            std::fs::read_to_string(&log).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, text) = tessera(&socket, &["events", "--replay", "10"]);
    assert!(text.contains("partition_changed") && text.contains("7 device(s) created"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_runs_predict_every_kind_of_change() {
    let node = SimNode::with_description(&mig_and_whole(H100));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let (_daemon, socket, log) = start(&node, dir, &layouts("reset = \"when-free\"", "whole = true"));
    let _ = common::node_api(&socket).await;
    let apply = |gpu: &str, layout: &[&str]| apply_layout(&socket, &log, gpu, layout);

    // MIG re-layout: one 3g kept, four 1g made.
    let out = apply("0", &["--mig", "3g.40gb=1,1g.10gb=4"]);
    assert!(out.contains("applied -> mig 1g.10gb x4, 3g.40gb x1 (+4 -1 devices)"), "{out}");
    // The same again: nothing to do.
    let out = apply("0", &["--mig", "3g.40gb=1,1g.10gb=4"]);
    assert!(out.contains("unchanged -> mig 1g.10gb x4, 3g.40gb x1 (+0 -0 devices)"), "{out}");
    // Does not fit: refused, exit 3.
    let out = apply("0", &["--mig", "4g.40gb=1,3g.40gb=2"]);
    assert!(out.contains("refused") && out.contains("does_not_fit"), "{out}");
    // Whole GPU to shares and back.
    let out = apply("1", &["--shares", "4"]);
    assert!(out.contains("applied -> shares x4 (+4 -1 devices)"), "{out}");
    // MIG on: one command end to end; an H100 needs no reset for it.
    let out = apply("1", &["--mig", "1g.10gb=7"]);
    assert!(out.contains("applied -> mig 1g.10gb x7 (+7 -4 devices)"), "{out}");
    assert_eq!(partition(&socket, 1).await.state, api::PartitionState::Converged as i32);
    // And off again.
    let out = apply("1", &["--whole"]);
    assert!(out.contains("applied -> whole (+1 -7 devices)"), "{out}");
    // MIG off with reset = "never": the same, at once.
    let out = apply("0", &["--whole"]);
    assert!(out.contains("applied -> whole (+1 -5 devices)"), "{out}");
    assert!(!out.contains("GPU 0: GPU 0"), "no doubled prefix: {out}");
    assert!(!out.contains("reset_required"), "{out}");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!text.contains(RESET_LOGGED), "tesserad reset an H100:\n{text}");
    // A GPU that does not exist.
    let out = apply("9", &["--whole"]);
    assert!(out.contains("GPU 9: refused: GPU 9 does not exist (this node has GPUs 0-1)"), "{out}");

    // Reload: the file's layouts come back (GPU 0: MIG on again; GPU 1 from whole to 2 shares).
    std::fs::write(
        dir.join("config.toml"),
        common::config_text(&node, dir, &layouts("reset = \"when-free\"", "shares = { count = 2 }")),
    )
    .expect("config");
    let out = same_as_dry_run(&socket, &["reload"], &log);
    assert!(out.contains(": applied\n"), "{out}");
    assert!(out.contains("applied -> mig 3g.40gb x2 (+2 -1 devices)"), "{out}");
    assert!(out.contains("applied -> shares x2 (+2 -1 devices)"), "{out}");
    let out = same_as_dry_run(&socket, &["reload"], &log);
    assert!(out.contains(": unchanged\n"), "{out}");

    // A clumsy edit that is not TOML at all: refused with the parser's words and line, exit 2,
    // nothing changed; the good file back is no change either.
    let good = std::fs::read_to_string(dir.join("config.toml")).expect("config");
    std::fs::write(dir.join("config.toml"), format!("[sim\n{good}")).expect("config");
    let (code, out) = tessera(&socket, &["reload"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains(": rejected\n  error: ") && out.contains("line "), "{out}");
    assert!(!out.contains("error :"), "no empty key printed: {out}");
    std::fs::write(dir.join("config.toml"), good).expect("config");
    let out = same_as_dry_run(&socket, &["reload"], &log);
    assert!(out.contains(": unchanged\n"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_a100_mode_change_takes_a_reset_and_dry_runs_say_so() {
    let node = SimNode::with_description(&mig_and_whole(A100));
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_daemon, socket, log) =
        start(&node, tmp.path(), &layouts_with("3g.20gb", "reset = \"when-free\"", "whole = true"));
    let _ = common::node_api(&socket).await;
    let apply = |gpu: &str, layout: &[&str]| apply_layout(&socket, &log, gpu, layout);
    // MIG on with reset = "when-free": tesserad resets the free GPU, then makes the instances.
    let out = apply("1", &["--mig", "1g.5gb=7"]);
    assert!(out.contains("applied -> mig 1g.5gb x7 (+7 -1 devices)"), "{out}");
    assert_eq!(partition(&socket, 1).await.state, api::PartitionState::Converged as i32);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(text.matches(RESET_LOGGED).count(), 1, "one reset, by tesserad:\n{text}");
    // And off again, the same way.
    let out = apply("1", &["--whole"]);
    assert!(out.contains("applied -> whole (+1 -7 devices)"), "{out}");
    // MIG off with reset = "never": the instances go now, the mode waits for a reset.
    let out = apply("0", &["--whole"]);
    assert!(out.contains("pending_reset -> mig (empty) (+0 -2 devices)"), "{out}");
    assert!(out.contains("reset_required"), "{out}");
    assert_eq!(partition(&socket, 0).await.state, api::PartitionState::PendingReset as i32);
}
