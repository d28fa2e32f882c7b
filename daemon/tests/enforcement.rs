//! Enforcement from the driver's own numbers, against the built `tesserad` on the simulated node
//! with the test kubelet: workloads that bypass the shim entirely (`tessera-workload` without
//! `LD_PRELOAD`) hold memory, attributed to their allocation by cgroup the way a runtime places
//! a container (a cgroup whose path ends in the container id of the allocation's owner record):
//!
//! - `action = "kill"`: the one over its share's limit is SIGKILLed (time printed; the goal is
//!   1 s), with a `limit_breach` event naming the allocation, container, GPU, pids, used, limit
//!   and action, in `tessera events` and in `/metrics`; one under its limit and one that belongs
//!   to no allocation run to their end; the latter is reported as unattributed;
//! - `action = "report"`: the one over its limit is reported when the breach starts and ends,
//!   and never killed;
//! - SM time: a bypassing workload launching back to back in a 25% share is killed once a
//!   window's average is over its share, and so is the one started in its place; one launching
//!   at a rate within its share runs to its end; in report mode the breach is reported when it
//!   starts and when its process is gone;
//! - memory under the shim: an honest program of many small buffers, charged by the shim as the
//!   driver holds them (2 MiB chunks), is refused at its limit by NVML's figure and never killed.
//!
//! Moving a process into a cgroup needs root: without it the tests print SKIP (and fail when
//! `TESSERA_REQUIRE_RUNTIMES` is set, as in CI).

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use tessera_proto::deviceplugin::v1beta1::Empty;
use tessera_proto::tessera::v1 as api;
use tessera_region::owner::ContainerIdentity;
use tessera_sim_testkit::{SimNode, binary};

mod common;

use common::{TestKubelet, WAIT, cgroup_root, spawn};

const MIB: u64 = 1 << 20;
const OVERHEAD_MIB: u64 = 300;

/// A container's cgroup, `<root>/tessera-test-<pid>-<n>/<container id>`, removed when dropped.
struct Cgroup {
    parent: PathBuf,
    path: PathBuf,
}

impl Cgroup {
    fn new(root: &Path, tag: &str, container_id: &str) -> Cgroup {
        let parent = root.join(format!("tessera-test-{}-{tag}", std::process::id()));
        let path = parent.join(container_id);
        std::fs::create_dir_all(&path).expect("make the cgroup");
        Cgroup { parent, path }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir(&self.parent);
    }
}

/// A 64-hex-digit container id, as containerd and CRI-O make them.
fn container_id(seed: u64) -> String {
    let n = u64::from(std::process::id()) << 32 | seed;
    format!("{:016x}{:016x}{:016x}{:016x}", n, n ^ 0x5555, n ^ 0xaaaa, n.rotate_left(17))
}

/// The workload with no shim at all, holding `mib` for `hold` seconds, in `cgroup` when given
/// (it moves itself there before it touches the GPU). Returns once it says it holds the memory,
/// or once its output ends (killed first).
fn bypassing_workload(node: &SimNode, cgroup: Option<&Cgroup>, mib: u64, hold: u32) -> (Workload, Option<String>) {
    let exe = binary("tessera-workload");
    let args = format!("--alloc-mib {mib} --hold {hold}");
    let script = match cgroup {
        Some(c) => format!("echo $$ > {:?} && exec {:?} {args}", c.path.join("cgroup.procs"), exe),
        None => format!("exec {exe:?} {args}"),
    };
    let mut child =
        node.command("/bin/sh").arg("-c").arg(script).env_remove("LD_PRELOAD").stdout(Stdio::piped()).spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    let line = out.read_line(&mut line).ok().filter(|&n| n > 0).map(|_| line);
    (Workload { child, _out: out }, line)
}

/// A running workload; its output stays open (it prints again when it ends).
struct Workload {
    child: Child,
    _out: BufReader<ChildStdout>,
}

impl Workload {
    fn id(&self) -> u32 {
        self.child.id()
    }

    fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        self.child.wait()
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The workload with no shim at all, launching 1 ms kernels for `seconds` (`rate` a second; 0:
/// back to back, 16 in flight), in `cgroup`.
fn launching_workload(node: &SimNode, cgroup: &Cgroup, rate: u32, seconds: u32) -> Child {
    let exe = binary("tessera-workload");
    let args = format!("--kernel-us 1000 --depth 16 --rate {rate} --seconds {seconds}");
    let script = format!("echo $$ > {:?} && exec {:?} {args}", cgroup.path.join("cgroup.procs"), exe);
    node.command("/bin/sh")
        .arg("-c")
        .arg(script)
        .env_remove("LD_PRELOAD")
        .stdout(Stdio::null())
        .spawn()
        .expect("tessera-workload")
}

/// [`bypassing_workload`], which must get to hold the memory.
fn holding_workload(node: &SimNode, cgroup: Option<&Cgroup>, mib: u64, hold: u32) -> Workload {
    let (child, line) = bypassing_workload(node, cgroup, mib, hold);
    assert!(line.as_deref().is_some_and(|l| l.contains("holding")), "{line:?}");
    child
}

/// Allocates one share through the kubelet; (allocation id, allocation directory, the share's
/// memory limit in bytes).
async fn allocate_share(
    plugin: &mut tessera_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient<
        tonic::transport::Channel,
    >,
    share: &str,
) -> (String, PathBuf) {
    let answer = common::allocate(plugin, &[share]).await;
    (answer.envs["TESSERA_ALLOCATION"].clone(), PathBuf::from(&answer.mounts[0].host_path))
}

/// The next event of `kinds`, up to `WAIT`.
async fn next_event(events: &mut tonic::Streaming<api::Event>, what: &str) -> api::Event {
    tokio::time::timeout(WAIT, events.message())
        .await
        .unwrap_or_else(|_| panic!("no {what} event in time"))
        .expect("event stream ok")
        .expect("event stream open")
}

fn breach(e: &api::Event) -> &api::LimitBreach {
    match &e.detail {
        Some(api::event::Detail::LimitBreach(b)) => b,
        other => panic!("not a limit breach: {other:?} ({})", e.message),
    }
}

/// A node with one 80 GiB GPU in 4 shares, tesserad running with `enforcement`, the kubelet
/// registered: (node, tempdir, daemon, plugin client, share ids, metrics address, node API).
struct Setup {
    node: SimNode,
    dir: tempfile::TempDir,
    _daemon: common::Daemon,
    _kubelet: TestKubelet,
    plugin: tessera_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient<tonic::transport::Channel>,
    shares: Vec<String>,
    metrics: std::net::SocketAddr,
    api: api::node_client::NodeClient<tonic::transport::Channel>,
}

async fn setup(enforcement: &str) -> Setup {
    setup_with(enforcement, "[partitions.default]\nshares = { count = 4 }").await
}

/// [`setup`] with the GPU split as `partitions` says.
async fn setup_with(enforcement: &str, partitions: &str) -> Setup {
    let node = SimNode::with_description(&format!(
        "context_overhead_mib = {OVERHEAD_MIB}\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n"
    ));
    let dir = tempfile::tempdir().expect("tempdir");
    let (metrics, config) =
        common::write_config_with_metrics(&node, dir.path(), &format!("[enforcement]\n{enforcement}\n{partitions}"));
    let mut kubelet = TestKubelet::start(&dir.path().join("plugins"));
    let (daemon, _) = spawn(&node, &config, &dir.path().join("no-notify"), &dir.path().join("tesserad.log"));
    let (reg, _) = kubelet.next_registration().await;
    let mut plugin = kubelet.connect(&reg).await;
    let shares = {
        let mut list = plugin.list_and_watch(Empty {}).await.expect("list");
        common::next_list(list.get_mut()).await.devices.iter().map(|d| d.id.clone()).collect()
    };
    let api = common::node_api(&dir.path().join("run/tessera.sock")).await;
    Setup { node, dir, _daemon: daemon, _kubelet: kubelet, plugin, shares, metrics, api }
}

impl Setup {
    /// The events of `kinds` from now on.
    async fn watch(&self, kinds: &[api::EventKind]) -> tonic::Streaming<api::Event> {
        let req = api::WatchEventsRequest { kinds: kinds.iter().map(|&k| k as i32).collect(), ..Default::default() };
        self.api.clone().watch_events(req).await.expect("watch").into_inner()
    }

    /// What `/metrics` answers.
    fn metrics(&self) -> String {
        let (code, body) = common::prometheus::get(self.metrics, "/metrics").expect("metrics answer");
        assert_eq!(code, 200);
        body
    }
}

/// The line of series `family` for allocation `id` in a `/metrics` answer.
fn line_of<'a>(body: &'a str, family: &str, id: &str) -> &'a str {
    let of = |l: &&str| l.strip_prefix(family).is_some_and(|rest| rest.starts_with('{')) && l.contains(id);
    body.lines().find(of).unwrap_or_else(|| panic!("no {family} series for {id}:\n{body}"))
}

/// The share's memory limit, from the node API.
async fn limit_of(api: &mut api::node_client::NodeClient<tonic::transport::Channel>, id: &str) -> u64 {
    let resp = api
        .get_usage(api::GetUsageRequest { allocation_id: id.into(), ..Default::default() })
        .await
        .expect("usage")
        .into_inner();
    resp.containers[0].devices[0].memory_limit_bytes
}

fn log_of(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("tesserad.log")).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_bypassing_the_shim_is_killed_over_its_limit_and_nothing_else_is() {
    let Some(root) = cgroup_root() else { return };
    let mut s = setup("action = \"kill\"\ninterval_ms = 200").await;
    let (over_id, over_dir) = allocate_share(&mut s.plugin, &s.shares[0]).await;
    let (under_id, under_dir) = allocate_share(&mut s.plugin, &s.shares[1]).await;
    let limit = limit_of(&mut s.api, &over_id).await;
    assert!(limit > 0, "a share has a memory limit");

    // What the hook records for each container; the cgroups runtimes would make.
    let (over_cid, under_cid) = (container_id(1), container_id(2));
    let owner = |cid: &str, pod: &str| tessera_region::owner::Owner {
        container: ContainerIdentity {
            container_id: Some(cid.into()),
            pod_namespace: Some("team-a".into()),
            pod_name: Some(pod.into()),
            container_name: Some("main".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    owner(&over_cid, "greedy").write(&over_dir).expect("owner record");
    owner(&under_cid, "modest").write(&under_dir).expect("owner record");
    let over_cg = Cgroup::new(&root, "over", &over_cid);
    let under_cg = Cgroup::new(&root, "under", &under_cid);

    let mut events = s.watch(&[api::EventKind::LimitBreach, api::EventKind::UnattributedProcess]).await;

    // Under its limit, and a process of no allocation: both must run to their end.
    let mut modest = holding_workload(&s.node, Some(&under_cg), 1024, 4);
    let mut stray = holding_workload(&s.node, None, 512, 4);
    let unattributed = next_event(&mut events, "unattributed_process").await;
    assert_eq!(unattributed.kind, api::EventKind::UnattributedProcess as i32, "{}", unattributed.message);
    match &unattributed.detail {
        Some(api::event::Detail::UnattributedProcess(p)) => {
            assert_eq!((p.pid, p.used_bytes, p.gpu_index), (stray.id(), (512 + OVERHEAD_MIB) * MIB, 0));
            assert_eq!(p.command, "tessera-workloa", "comm is 15 characters at most");
        }
        other => panic!("{other:?}"),
    }

    // Over its limit with no shim in the way: killed.
    let over_mib = limit / MIB + 512;
    let started = Instant::now();
    let (mut greedy, _) = bypassing_workload(&s.node, Some(&over_cg), over_mib, 30);
    let status = greedy.wait().expect("wait");
    let took = started.elapsed();
    println!(
        "enforcement: a bypassing process over its limit was killed {} ms after it held the memory",
        took.as_millis()
    );
    assert_eq!(
        status.signal(),
        Some(libc_sigkill()),
        "SIGKILLed, not ended on its own: {status:?}\n{}",
        log_of(s.dir.path())
    );

    let e = next_event(&mut events, "limit_breach").await;
    assert_eq!(e.kind, api::EventKind::LimitBreach as i32, "{}", e.message);
    let b = breach(&e);
    assert_eq!(b.allocation_id, over_id);
    assert_eq!(b.action, api::BreachAction::Killed as i32);
    assert_eq!(b.pids, [greedy.id()]);
    assert_eq!(b.killed_pids, [greedy.id()]);
    // The driver holds whole 2 MiB pages.
    assert_eq!(b.used_bytes, (over_mib.next_multiple_of(2) + OVERHEAD_MIB) * MIB);
    assert_eq!(b.limit_bytes, limit);
    assert_eq!(b.gpu_index, 0);
    assert_eq!(e.device_id, s.shares[0]);
    assert_eq!(e.device_kind, api::DeviceKind::Share as i32);
    let holder = &e.affected[0];
    let c = holder.container.clone().unwrap_or_default();
    assert_eq!((holder.allocation_id.as_str(), c.container_id.as_str()), (over_id.as_str(), over_cid.as_str()));
    assert!(e.message.contains(&format!("killed pid {}", greedy.id())), "{}", e.message);

    // The others were left alone and ended on their own.
    assert_eq!(modest.wait().expect("wait").code(), Some(0), "under its limit: untouched");
    assert_eq!(stray.wait().expect("wait").code(), Some(0), "unattributed: reported, never killed");
    let more = tokio::time::timeout(Duration::from_millis(600), events.message()).await;
    assert!(more.is_err(), "no other breach: {more:?}");

    // `tessera events` and /metrics show it.
    let out = std::process::Command::new(binary("tessera"))
        .arg("--socket")
        .arg(s.dir.path().join("run/tessera.sock"))
        .args(["events", "--replay", "50"])
        .output()
        .expect("tessera events");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("limit_breach")).unwrap_or_else(|| panic!("no limit_breach:\n{text}"));
    assert!(line.contains(&over_id) && line.contains("team-a/greedy/main"), "{line}");
    assert!(text.lines().any(|l| l.contains("unattributed_process") && l.contains(&stray.id().to_string())), "{text}");
    let body = s.metrics();
    let series = line_of(&body, "tessera_container_limit_breaches_total", &over_id);
    assert!(
        series.contains("action=\"kill\"") && series.contains("pod=\"greedy\"") && series.ends_with(" 1"),
        "{series}"
    );
    assert!(!body.lines().any(|l| l.starts_with("tessera_container_limit_breaches_total{") && l.contains(&under_id)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_mode_reports_a_breach_once_and_kills_nothing() {
    let Some(root) = cgroup_root() else { return };
    let mut s = setup("action = \"report\"\ninterval_ms = 100").await;
    let (id, dir) = allocate_share(&mut s.plugin, &s.shares[2]).await;
    let limit = limit_of(&mut s.api, &id).await;
    let cid = container_id(3);
    let container = ContainerIdentity { container_id: Some(cid.clone()), ..Default::default() };
    tessera_region::owner::Owner { container, ..Default::default() }.write(&dir).expect("owner");
    let cg = Cgroup::new(&root, "report", &cid);
    let mut events = s.watch(&[api::EventKind::LimitBreach]).await;

    // Over the limit for 3 s: about 30 polls, one event when it starts, one when it ends.
    let over_mib = limit / MIB + 256;
    let mut greedy = holding_workload(&s.node, Some(&cg), over_mib, 3);
    let started = next_event(&mut events, "limit_breach started").await;
    let b = breach(&started);
    assert_eq!((b.action, b.phase), (api::BreachAction::Reported as i32, api::BreachPhase::Started as i32));
    assert_eq!(
        (b.allocation_id.as_str(), b.pids.as_slice(), b.killed_pids.len()),
        (id.as_str(), &[greedy.id()][..], 0)
    );
    assert_eq!((b.used_bytes, b.limit_bytes), ((over_mib.next_multiple_of(2) + OVERHEAD_MIB) * MIB, limit));
    assert_eq!(greedy.wait().expect("wait").code(), Some(0), "reported, not killed");
    let ended = next_event(&mut events, "limit_breach ended").await;
    assert_eq!(breach(&ended).phase, api::BreachPhase::Ended as i32, "the next event is the end: {}", ended.message);
    assert_eq!(ended.severity, api::Severity::Info as i32);

    let body = s.metrics();
    let series = line_of(&body, "tessera_container_limit_breaches_total", &id);
    assert!(series.contains("action=\"report\"") && series.ends_with(" 1"), "one breach, however many polls: {series}");
}

/// Writes the owner record a hook would for a container in pod `pod`, and makes its cgroup.
fn container(root: &Path, dir: &Path, seed: u64, pod: &str) -> (String, Cgroup) {
    let cid = container_id(seed);
    tessera_region::owner::Owner {
        container: ContainerIdentity {
            container_id: Some(cid.clone()),
            pod_namespace: Some("team-a".into()),
            pod_name: Some(pod.into()),
            container_name: Some("main".into()),
            ..Default::default()
        },
        ..Default::default()
    }
    .write(dir)
    .expect("owner record");
    let cg = Cgroup::new(root, pod, &cid);
    (cid, cg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_taking_more_sm_time_than_its_share_is_killed_and_one_within_it_is_not() {
    let Some(root) = cgroup_root() else { return };
    // Four shares: 25% SM each, strict, normal priority. A 1 s window at 100 ms polls.
    let mut s = setup("action = \"kill\"\ninterval_ms = 100\nsm_window_ms = 1000").await;
    let (greedy_id, greedy_dir) = allocate_share(&mut s.plugin, &s.shares[0]).await;
    let (modest_id, modest_dir) = allocate_share(&mut s.plugin, &s.shares[1]).await;
    let (_, greedy_cg) = container(&root, &greedy_dir, 11, "spinner");
    let (_, modest_cg) = container(&root, &modest_dir, 12, "paced");
    let mut events = s.watch(&[api::EventKind::LimitBreach]).await;

    // About 10% of the GPU (100 kernels of 1 ms a second) for 4 s, no shim: within its 25%.
    let mut modest = launching_workload(&s.node, &modest_cg, 100, 4);
    // Back to back with 16 in flight, no shim: all the GPU the other leaves.
    let started = Instant::now();
    let mut greedy = launching_workload(&s.node, &greedy_cg, 0, 30);
    let status = greedy.wait().expect("wait");
    println!(
        "enforcement: a bypassing process over its SM share was killed {} ms after it started",
        started.elapsed().as_millis()
    );
    assert_eq!(status.signal(), Some(libc_sigkill()), "SIGKILLed: {status:?}\n{}", log_of(s.dir.path()));

    let e = next_event(&mut events, "limit_breach").await;
    let b = breach(&e);
    assert_eq!(b.limit, api::BreachLimit::Sm as i32, "{}", e.message);
    assert_eq!((b.allocation_id.as_str(), b.action), (greedy_id.as_str(), api::BreachAction::Killed as i32));
    assert_eq!((b.pids.as_slice(), b.killed_pids.as_slice()), (&[greedy.id()][..], &[greedy.id()][..]));
    assert_eq!((b.sm_percent_limit, b.window_ms, b.used_bytes, b.limit_bytes), (25, 1000, 0, 0));
    assert!(b.sm_percent_used > 35 && b.sm_percent_used <= 100, "{}", e.message);
    assert_eq!(e.device_id, s.shares[0]);
    assert!(
        e.message.contains("SM time") && e.message.contains(&format!("killed pid {}", greedy.id())),
        "{}",
        e.message
    );

    // One started in its place is judged by its own time in what is left of the window.
    let started = Instant::now();
    let mut again = launching_workload(&s.node, &greedy_cg, 0, 30);
    let status = again.wait().expect("wait");
    println!(
        "enforcement: the process started in its place was killed {} ms after it started",
        started.elapsed().as_millis()
    );
    assert_eq!(status.signal(), Some(libc_sigkill()), "SIGKILLed too: {status:?}");
    let e = next_event(&mut events, "limit_breach (again)").await;
    assert_eq!((breach(&e).killed_pids.as_slice(), breach(&e).limit), (&[again.id()][..], api::BreachLimit::Sm as i32));

    // `tessera events --json` carries the breach's figures for scripts.
    let out = std::process::Command::new(binary("tessera"))
        .arg("--socket")
        .arg(s.dir.path().join("run/tessera.sock"))
        .args(["events", "--replay", "50", "--json"])
        .output()
        .expect("tessera events --json");
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
        .find(|e| e["kind"] == "LIMIT_BREACH")
        .expect("a limit_breach line");
    let d = &line["detail"];
    assert_eq!((d["limit"].as_str(), d["action"].as_str()), (Some("SM"), Some("KILLED")), "{line}");
    assert_eq!((d["sm_percent_limit"].as_u64(), d["window_ms"].as_u64()), (Some(25), Some(1000)), "{line}");
    assert_eq!(d["killed_pids"], serde_json::json!([greedy.id()]), "{line}");
    assert!(d.get("used_bytes").is_none(), "no memory figures on an SM breach: {line}");

    // `tessera top` shows the driver's figure beside the container's own: the paced one, still
    // running, at about 10% of the GPU over the frame.
    let out = std::process::Command::new(binary("tessera"))
        .arg("--socket")
        .arg(s.dir.path().join("run/tessera.sock"))
        .args(["top", "--once", "--json", "--interval-ms", "600"])
        .output()
        .expect("tessera top");
    let frame: serde_json::Value = serde_json::from_slice(&out.stdout).expect("top --json");
    let paced = frame["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["allocation_id"] == modest_id.as_str()))
        .unwrap_or_else(|| panic!("no paced container in {frame}"));
    let driver = paced["devices"][0]["sm_driver_percent"].as_f64().expect("sm_driver_percent");
    println!("enforcement: tessera top, the paced container's SM by the driver: {driver:.1}%");
    assert!((3.0..=30.0).contains(&driver), "about 10%: {driver} ({paced})");
    assert!(paced["devices"][0]["sm_driver_nanos"].as_u64().is_some_and(|n| n > 0), "{paced}");

    // Within its share, though it has no shim either: untouched, and nothing more reported.
    assert_eq!(modest.wait().expect("wait").code(), Some(0), "within its share: untouched");
    let more = tokio::time::timeout(Duration::from_millis(600), events.message()).await;
    assert!(more.is_err(), "no other breach: {more:?}");
    let body = s.metrics();
    let series = line_of(&body, "tessera_container_limit_breaches_total", &greedy_id);
    assert!(
        series.contains("limit=\"sm\"") && series.contains("action=\"kill\"") && series.ends_with(" 2"),
        "{series}"
    );
    assert!(!body.lines().any(|l| l.starts_with("tessera_container_limit_breaches_total{") && l.contains(&modest_id)));
    // The driver's own count of each one's SM time: the paced one about 10% of its 4 s.
    let sm_seconds = |id: &str| -> f64 {
        let line = body
            .lines()
            .find(|l| l.starts_with("tessera_container_sm_seconds_total{") && l.contains(id))
            .unwrap_or_else(|| panic!("no SM time series for {id}:\n{body}"));
        line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"))
    };
    let (paced, spun) = (sm_seconds(&modest_id), sm_seconds(&greedy_id));
    println!("enforcement: SM time by NVML: paced {paced:.3} s over 4 s, the two spinners {spun:.3} s");
    assert!((0.15..=0.8).contains(&paced), "paced at about 10% for 4 s: {paced} s");
    assert!(spun >= 0.35, "each spinner had at least 35% of the 1 s window: {spun} s");
}

/// The workload under the shim (`libtessera.so` preloaded, the allocation's limits and region),
/// launching kernels of `kernel_us`, two in flight, for `seconds`, in `cgroup`.
fn shimmed_workload(
    node: &SimNode,
    cgroup: &Cgroup,
    alloc_dir: &Path,
    kernel_us: u64,
    seconds: u32,
    more: &str,
) -> Child {
    let exe = binary("tessera-workload");
    let args = format!("--kernel-us {kernel_us} --depth 2 --seconds {seconds} {more}");
    let script = format!("echo $$ > {:?} && exec {:?} {args}", cgroup.path.join("cgroup.procs"), exe);
    node.command("/bin/sh")
        .arg("-c")
        .arg(script)
        .env("LD_PRELOAD", tessera_sim_testkit::profile_dir().join("libtessera.so"))
        .env("TESSERA_LIMITS", alloc_dir.join("limits"))
        .env("TESSERA_REGION", alloc_dir.join("region"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("tessera-workload")
}

/// An honest program under the shim whose kernels run 500 ms each, in a 25% strict share, with
/// SM enforcement on at its defaults (a 10 s window, 10 points of tolerance): let through at
/// its share, one kernel at a time, it is never over the share plus the one kernel a launch may
/// take whole, and runs to its end. Before (issue 34), the shim let it take 0.5-0.75 of the GPU
/// (its spans judged against NVML's reading of the wrong window) and tesserad killed it ("45% of
/// a 10 s window").
/// [`honest_under_the_shim`] with kernels of 500 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_honest_program_with_500_ms_kernels_under_the_shim_is_not_killed() {
    honest_under_the_shim(500_000, 14, "", 1, 21).await;
}

/// [`honest_under_the_shim`] launching CUDA graphs of 100 kernels of 1 ms: each `cuGraphLaunch`
/// is 100 ms of SM time to NVML, and the shim charges it that (its kernels), not one launch's
/// guess.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_honest_program_launching_graphs_of_100_kernels_under_the_shim_is_not_killed() {
    honest_under_the_shim(1000, 12, "--launch graph --graph-kernels 100", 100, 22).await;
}

/// An honest program under the shim whose launches each run `kernel_us` × `per_launch` of GPU
/// time, in a 25% strict share (share 0), with SM enforcement on at its defaults (a 10 s window,
/// 10 points of tolerance): let through at its share, one launch at a time, it is never over the
/// share plus the one launch a launch may take whole, and runs to its end. Before (issue 34),
/// the shim let 500 ms kernels take 0.5-0.75 of the GPU (its spans judged against NVML's reading
/// of the wrong window) and tesserad killed the program ("45% of a 10 s window"); with the shim
/// before 135f4e1 this test's program was SIGKILLed within 9 s.
async fn honest_under_the_shim(kernel_us: u64, seconds: u32, more: &str, per_launch: u64, seed: u64) {
    let Some(root) = cgroup_root() else { return };
    let mut s = setup("action = \"kill\"\ninterval_ms = 200").await;
    let (id, dir) = allocate_share(&mut s.plugin, &s.shares[0]).await;
    let (_, cg) = container(&root, &dir, seed, "honest");
    let mut events = s.watch(&[api::EventKind::LimitBreach]).await;

    let started = Instant::now();
    let honest = shimmed_workload(&s.node, &cg, &dir, kernel_us, seconds, more);
    let out = honest.wait_with_output().expect("wait");
    let wall = started.elapsed().as_secs_f64();
    let report = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "not killed: {:?}\n{report}\n{}", out.status, log_of(s.dir.path()));
    let r: serde_json::Value = serde_json::from_str(report.lines().last().unwrap_or("")).expect("report");
    let more_events = tokio::time::timeout(Duration::from_millis(600), events.message()).await;
    assert!(more_events.is_err(), "no breach: {more_events:?}");
    // What the driver counted: its share, and not a launch more.
    let body = s.metrics();
    let line = line_of(&body, "tessera_container_sm_seconds_total", &id);
    let sm: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"));
    let launch_s = (kernel_us * per_launch) as f64 / 1e6;
    let paced = r["launch_share"].as_f64().unwrap_or(0.0);
    println!(
        "enforcement: {} ms launches ({more}) in a 25% share, under the shim: {:.3} of the GPU by the driver over \
         {wall:.1} s ({} launches, let through at {paced:.3})",
        launch_s * 1e3,
        sm / wall,
        r["kernels"],
    );
    assert!(sm / wall <= 0.25 + launch_s / wall + 0.02, "{sm} s of SM time in {wall} s");
    // Let through near its share (±5 points, as the shim's own share tests hold on a shared
    // machine: graphs of 100 ms read 0.271 in a full run; the ±2-point goal is a benchmark figure).
    assert!((paced - 0.25).abs() <= 0.05, "{r}");
}

/// An honest program under the shim allocating buffers of 5,000 bytes until one is refused, in a
/// 1 GiB share with kill mode polling every 100 ms. The driver packs such buffers into 2 MiB
/// chunks and NVML's per-process figure, which tesserad holds against the limit, counts the
/// chunks: the shim charges them the same way, so the program is refused with
/// `CUDA_ERROR_OUT_OF_MEMORY` right at its limit by the driver's own figure, holds there while
/// tesserad polls, and is never killed. (Charged as asked, 5,000 bytes of each 8 KiB the sim
/// holds, it would have been let through to about 1.5 GiB by NVML's figure, and killed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_honest_program_of_many_small_buffers_is_refused_at_its_limit_and_not_killed() {
    const GIB: u64 = 1 << 30;
    let Some(root) = cgroup_root() else { return };
    let partitions = "[[partitions.default.shares]]\nmemory = \"1GiB\"\n[[partitions.default.shares]]";
    let mut s = setup_with("action = \"kill\"\ninterval_ms = 100", partitions).await;
    let (id, dir) = allocate_share(&mut s.plugin, &s.shares[0]).await;
    assert_eq!(limit_of(&mut s.api, &id).await, GIB, "the first share is the 1 GiB one");
    let (_, cg) = container(&root, &dir, 31, "small-buffers");
    let model = tessera_sim_model::Node::open(s.node.description.as_deref(), Some(&s.node.state)).expect("sim node");
    model.reset_high_water(0, 0).expect("high-water mark");
    let mut events = s.watch(&[api::EventKind::LimitBreach]).await;

    let more = "--alloc-mib 4096 --chunk-bytes 5000 --hold 2";
    let out = shimmed_workload(&s.node, &cg, &dir, 1000, 0, more).wait_with_output().expect("wait");
    let report = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(3), "refused, not killed: {:?}\n{report}\n{}", out.status, log_of(s.dir.path()));
    let r: serde_json::Value = serde_json::from_str(report.lines().last().unwrap_or("")).expect("report");
    assert_eq!(r["alloc_error"], "CUDA_ERROR_OUT_OF_MEMORY", "{r}");
    let no_breach = tokio::time::timeout(Duration::from_millis(600), events.message()).await;
    assert!(no_breach.is_err(), "no breach: {no_breach:?}");
    let peak = model.memory_high_water(0, 0).expect("high-water mark");
    let (buffers, free) =
        (r["allocations"].as_u64().unwrap_or(0), r["mem_free_after_alloc"].as_u64().unwrap_or(u64::MAX));
    println!(
        "enforcement: {buffers} buffers of 5,000 bytes ({} MiB asked) in a 1 GiB share: the GPU held at most {} MiB, \
         {} KiB left free",
        (buffers * 5000) >> 20,
        peak >> 20,
        free >> 10
    );
    assert!(peak <= GIB, "the driver's own figure never passed the limit: {peak}");
    assert!(free < 2 * MIB, "let through right up to its limit (less than a chunk left): {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sm_report_mode_reports_the_breach_and_its_end_and_kills_nothing() {
    let Some(root) = cgroup_root() else { return };
    let mut s = setup("action = \"kill\"\nsm_action = \"report\"\ninterval_ms = 100\nsm_window_ms = 1000").await;
    let (id, dir) = allocate_share(&mut s.plugin, &s.shares[3]).await;
    let (_, cg) = container(&root, &dir, 13, "reported");
    let mut events = s.watch(&[api::EventKind::LimitBreach]).await;

    let mut greedy = launching_workload(&s.node, &cg, 0, 3);
    let started = next_event(&mut events, "limit_breach started").await;
    let b = breach(&started);
    assert_eq!((b.limit, b.action), (api::BreachLimit::Sm as i32, api::BreachAction::Reported as i32));
    assert_eq!((b.phase, b.pids.as_slice()), (api::BreachPhase::Started as i32, &[greedy.id()][..]));
    assert_eq!(greedy.wait().expect("wait").code(), Some(0), "reported, not killed");
    let ended = next_event(&mut events, "limit_breach ended").await;
    assert_eq!(breach(&ended).phase, api::BreachPhase::Ended as i32, "the next event is the end: {}", ended.message);
    let body = s.metrics();
    let series = line_of(&body, "tessera_container_limit_breaches_total", &id);
    assert!(
        series.contains("limit=\"sm\"") && series.contains("action=\"report\"") && series.ends_with(" 1"),
        "{series}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_shim_injected_sm_time_is_reported_not_killed_unless_asked() {
    let Some(root) = cgroup_root() else { return };
    // An operator who turned the shim off: no container has a limiter, so every busy process
    // would be over its share. `action = "kill"` still holds memory; SM time is reported.
    let mut s = setup("action = \"kill\"\ninterval_ms = 100\nsm_window_ms = 1000\n[injection]\nshim_path = \"\"").await;
    let (id, dir) = allocate_share(&mut s.plugin, &s.shares[2]).await;
    let (_, cg) = container(&root, &dir, 14, "unshimmed");
    let mut events = s.watch(&[api::EventKind::LimitBreach]).await;

    let mut busy = launching_workload(&s.node, &cg, 0, 2);
    let e = next_event(&mut events, "limit_breach").await;
    let b = breach(&e);
    assert_eq!((b.allocation_id.as_str(), b.limit), (id.as_str(), api::BreachLimit::Sm as i32));
    assert_eq!((b.action, b.phase), (api::BreachAction::Reported as i32, api::BreachPhase::Started as i32));
    assert_eq!(busy.wait().expect("wait").code(), Some(0), "reported, not killed");
    let log = log_of(s.dir.path());
    assert!(log.contains("injection.shim_path is empty") && log.contains("sm_action"), "{log}");
}

/// VMM memory held through shareable handles alone: `N` allocations of `SIZE_MIB` made on device
/// 0, each exported as a file descriptor and released at once (what was created is no longer
/// held), then imported from its descriptor and mapped. The driver keeps such memory alive while
/// a handle or a mapping refers to it (cuda.h, `cuMemRelease`). Prints "holding", then sleeps.
const IMPORTER: &str = r#"
import ctypes, os, sys, time
from ctypes import byref, c_int, c_uint, c_size_t, c_void_p, c_ulonglong, c_ubyte
cu = ctypes.CDLL("libcuda.so.1")
class Prop(ctypes.Structure):
    _fields_ = [("type", c_uint), ("handleTypes", c_uint), ("locType", c_uint), ("locId", c_int),
                ("win32", c_void_p), ("flags", c_ubyte * 8)]
def ok(rc, what):
    if rc != 0:
        sys.exit(f"{what}: CUresult {rc}")
N, SIZE = int(sys.argv[1]), int(sys.argv[2]) << 20
ok(cu.cuInit(0), "cuInit")
dev, ctx = c_int(), c_void_p()
ok(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
ok(cu.cuCtxCreate_v2(byref(ctx), 0, dev), "cuCtxCreate")
for i in range(N):
    h, fd = c_ulonglong(), c_int(-1)
    ok(cu.cuMemCreate(byref(h), c_size_t(SIZE), byref(Prop(1, 1, 1, 0)), c_ulonglong(0)), "cuMemCreate")
    ok(cu.cuMemExportToShareableHandle(byref(fd), h, 1, c_ulonglong(0)), "export")
    ok(cu.cuMemRelease(h), "cuMemRelease")
    imported, ptr = c_ulonglong(), c_ulonglong()
    ok(cu.cuMemImportFromShareableHandle(byref(imported), c_void_p(fd.value), 1), "import")
    os.close(fd.value)
    ok(cu.cuMemAddressReserve(byref(ptr), c_size_t(SIZE), c_size_t(0), c_ulonglong(0), c_ulonglong(0)), "reserve")
    ok(cu.cuMemMap(ptr, c_size_t(SIZE), c_size_t(0), imported, c_ulonglong(0)), "cuMemMap")
print("holding", flush=True)
time.sleep(20)
"#;

/// Memory a process holds only through imported shareable handles (what it created, exported
/// and released at once) counts against its allocation's limit as any other: NVML's figure for
/// it holds the imports, and over the limit it is killed. Before, the simulated driver charged an
/// import to no one and stopped counting the memory at the exporter's release: the process held
/// 20 GiB in a 19.8 GiB share, its figure was its context alone, and it slept on untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_held_through_imported_handles_counts_against_the_limit() {
    let Some(root) = cgroup_root() else { return };
    let mut s = setup("action = \"kill\"\ninterval_ms = 200").await;
    let (id, dir) = allocate_share(&mut s.plugin, &s.shares[0]).await;
    let limit = limit_of(&mut s.api, &id).await;
    let (_cid, cg) = container(&root, &dir, 7, "importer");
    let mut events = s.watch(&[api::EventKind::LimitBreach]).await;

    const PIECE_MIB: u64 = 2048;
    let pieces = limit / (PIECE_MIB * MIB) + 1;
    let script =
        format!("echo $$ > {:?} && exec python3 -c '{IMPORTER}' {pieces} {PIECE_MIB}", cg.path.join("cgroup.procs"));
    let mut child = s
        .node
        .command("/bin/sh")
        .arg("-c")
        .arg(script)
        .env_remove("LD_PRELOAD")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    assert_eq!(line.trim(), "holding", "the importer got its memory: {line:?}");
    let status = child.wait().expect("wait");
    assert_eq!(status.signal(), Some(libc_sigkill()), "SIGKILLed over its limit: {status:?}\n{}", log_of(s.dir.path()));
    let e = next_event(&mut events, "limit_breach").await;
    let b = breach(&e);
    assert_eq!((b.allocation_id.as_str(), b.pids.as_slice()), (id.as_str(), [child.id()].as_slice()));
    assert_eq!(b.used_bytes, pieces * PIECE_MIB * MIB + OVERHEAD_MIB * MIB, "its imports and its context");
    assert_eq!(b.limit_bytes, limit);
}

fn libc_sigkill() -> i32 {
    9
}

/// tesserad measures the GPU's context size with a probe of its own (NVML's figure for it: the
/// node's 300 MiB) and publishes it into the allocation's directory, root's and 0644, where
/// another uid can neither rewrite, replace nor remove it; the probe is never reported as a
/// process of no allocation. (The shim's side, and a damaged file: shim/tests/context_sizes.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_context_size_is_measured_and_published_where_no_tenant_can_write_it() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    use tessera_region::context_sizes::{CONTEXT_SIZES_FILE, ContextSizes};
    let Some(_root) = cgroup_root() else { return };
    let mut s = setup("action = \"kill\"\ninterval_ms = 100").await;
    let mut events = s.watch(&[api::EventKind::UnattributedProcess]).await;
    let (_, dir) = allocate_share(&mut s.plugin, &s.shares[0]).await;
    let path = dir.join(CONTEXT_SIZES_FILE);
    let deadline = Instant::now() + WAIT;
    while !path.exists() {
        assert!(Instant::now() < deadline, "not published:\n{}", log_of(s.dir.path()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let model = tessera_sim_model::Node::open(s.node.description.as_deref(), Some(&s.node.state)).expect("sim node");
    let uuid = model.gpu(0).expect("GPU 0").uuid.clone();
    let table = ContextSizes::load(&path).expect("well formed");
    assert_eq!(table.get(&uuid), Some(OVERHEAD_MIB * MIB), "the context's size on the GPU");
    let meta = std::fs::metadata(&path).expect("stat");
    assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o644));
    let before = std::fs::read(&path).expect("read");
    let (f, d) = (path.display(), dir.display());
    for attempt in [
        format!("printf 'tessera-context-sizes 1\\n{uuid} 1048576\\n' > {f}"),
        format!("printf x > {d}/.forged && mv -f {d}/.forged {f}"),
        format!("rm -f {f}"),
        format!("chmod 666 {f}"),
    ] {
        let out = std::process::Command::new("/bin/sh").arg("-c").arg(&attempt).uid(65534).gid(65534).output();
        assert!(!out.expect("sh").status.success(), "as uid 65534, {attempt:?} succeeded");
    }
    assert_eq!(std::fs::read(&path).expect("read"), before, "unchanged");
    let none = tokio::time::timeout(Duration::from_millis(300), events.message()).await;
    assert!(none.is_err(), "the probe is not an unattributed process: {none:?}");
}
