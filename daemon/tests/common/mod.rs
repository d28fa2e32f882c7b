//! The test kubelet shared by the daemon's integration tests: a Registration server on
//! `kubelet.sock` in a temporary directory that records registrations, then drives the plugins'
//! DevicePlugin side as the kubelet does.
#![allow(dead_code)] // each test crate uses its own part

pub mod apiserver;
pub mod containerd;
pub mod dra_kubelet;
pub mod prometheus;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tessera_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use tessera_proto::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
use tessera_proto::deviceplugin::v1beta1::{self as dp, Empty, ListAndWatchResponse, RegisterRequest};
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};

pub const WAIT: Duration = Duration::from_secs(5);

/// The kubelet's Registration side: records every request with when it arrived.
struct Recorder {
    seen: mpsc::UnboundedSender<(RegisterRequest, Instant)>,
}

#[tonic::async_trait]
impl Registration for Recorder {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = request.into_inner();
        if req.version != dp::VERSION {
            return Err(Status::invalid_argument(format!("unsupported version {}", req.version)));
        }
        self.seen.send((req, Instant::now())).map_err(|_| Status::internal("test gone"))?;
        Ok(Response::new(Empty {}))
    }
}

pub struct TestKubelet {
    pub dir: PathBuf,
    pub seen: mpsc::UnboundedReceiver<(RegisterRequest, Instant)>,
    pub server: JoinHandle<()>,
    pub started: Instant,
}

/// A kubelet that has bound `kubelet.sock` and does not listen yet (a kubelet starting up:
/// connecting is refused until [`BoundKubelet::listen`]).
pub struct BoundKubelet {
    dir: PathBuf,
    fd: std::os::fd::OwnedFd,
}

impl BoundKubelet {
    pub fn bind(dir: &Path) -> BoundKubelet {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, bind, socket};
        use std::os::fd::AsRawFd;
        let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).expect("socket");
        let addr = UnixAddr::new(&dir.join(dp::KUBELET_SOCKET_NAME)).expect("socket path");
        bind(fd.as_raw_fd(), &addr).expect("bind kubelet.sock");
        BoundKubelet { dir: dir.to_owned(), fd }
    }

    /// Listens and serves from now on (`started` is this moment).
    pub fn listen(self) -> TestKubelet {
        use nix::sys::socket::{Backlog, listen};
        listen(&self.fd, Backlog::new(128).expect("backlog")).expect("listen");
        let listener = std::os::unix::net::UnixListener::from(self.fd);
        listener.set_nonblocking(true).expect("nonblocking");
        TestKubelet::serve(&self.dir, UnixListener::from_std(listener).expect("tokio listener"))
    }
}

impl TestKubelet {
    pub fn start(dir: &Path) -> Self {
        let listener = UnixListener::bind(dir.join(dp::KUBELET_SOCKET_NAME)).expect("bind kubelet.sock");
        Self::serve(dir, listener)
    }

    fn serve(dir: &Path, listener: UnixListener) -> Self {
        let (tx, seen) = mpsc::unbounded_channel();
        let started = Instant::now();
        let server = tokio::spawn(async move {
            Server::builder()
                .add_service(RegistrationServer::new(Recorder { seen: tx }))
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await
                .expect("test kubelet serves");
        });
        Self { dir: dir.to_owned(), seen, server, started }
    }

    pub async fn next_registration(&mut self) -> (RegisterRequest, Instant) {
        tokio::time::timeout(WAIT, self.seen.recv()).await.expect("registered in time").expect("kubelet open")
    }

    /// Connects to the endpoint a plugin registered, as the kubelet does.
    pub async fn connect(&self, req: &RegisterRequest) -> DevicePluginClient<Channel> {
        let path = self.dir.join(&req.endpoint);
        let endpoint = Endpoint::from_shared(format!("unix://{}", path.display())).expect("unix endpoint");
        for _ in 0..100 {
            if let Ok(channel) = endpoint.connect().await {
                return DevicePluginClient::new(channel);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("could not connect to {}", path.display());
    }

    /// Stops the kubelet and removes the sockets, as a restarting kubelet does.
    pub async fn stop(self) {
        self.server.abort();
        let _ = self.server.await;
        for entry in std::fs::read_dir(&self.dir).expect("read plugin dir") {
            let path = entry.expect("dir entry").path();
            if path.extension().is_some_and(|e| e == "sock") {
                std::fs::remove_file(&path).expect("remove socket");
            }
        }
    }
}

/// Allocate of `devices` for one container, as the kubelet asks it: that container's answer.
pub async fn allocate(plugin: &mut DevicePluginClient<Channel>, devices: &[&str]) -> dp::ContainerAllocateResponse {
    let devices_ids = devices.iter().map(|d| d.to_string()).collect();
    let request = dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids }] };
    let mut resp = plugin.allocate(request).await.expect("allocate").into_inner();
    resp.container_responses.remove(0)
}

/// The documents of `yaml` as JSON, read by PyYAML in `python` (empty documents left out).
pub fn yaml_documents(python: &Path, yaml: &str) -> Vec<serde_json::Value> {
    use std::io::Write;
    let mut child = std::process::Command::new(python)
        .args(["-c", "import json,sys,yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python");
    child.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).expect("json")
}

pub async fn next_list(stream: &mut tonic::Streaming<ListAndWatchResponse>) -> ListAndWatchResponse {
    tokio::time::timeout(WAIT, stream.message()).await.expect("list in time").expect("stream ok").expect("stream open")
}

/// The daemon, killed when dropped (a failing test leaves none behind).
pub struct Daemon(pub Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Test directories whose mounts are detached when the test binary exits.
static MOUNTED_DIRS: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Detaches, when this test binary exits, the mounts a daemon leaves under `dir`: each region is
/// a tmpfs of its own (as root), and allocations outlive a killed daemon by design, so a plain
/// removal of the temporary directory would leave them mounted. At exit, not at drop: a test may
/// restart the daemon on the same directory.
pub fn unmount_at_exit(dir: &Path) {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    extern "C" fn detach_all() {
        let dirs = MOUNTED_DIRS.lock().map(|d| d.clone()).unwrap_or_default();
        for d in dirs {
            tessera_daemon::state::mount::detach_all_under(&d);
        }
    }
    // SAFETY: registers a plain extern "C" function with no arguments; it runs at exit, after
    // every test, and only detaches mounts.
    REGISTER.call_once(|| unsafe {
        libc::atexit(detach_all);
    });
    if let Ok(mut d) = MOUNTED_DIRS.lock() {
        d.push(dir.to_path_buf());
    }
}

/// Starts the built `tesserad` on `node` with `config`, readiness to `notify`, stderr to `log`.
pub fn spawn(node: &tessera_sim_testkit::SimNode, config: &Path, notify: &Path, log: &Path) -> (Daemon, Instant) {
    if let Some(dir) = config.parent() {
        unmount_at_exit(dir);
    }
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("log file");
    let started = Instant::now();
    let child = node
        .command(tessera_sim_testkit::binary("tesserad"))
        .arg("--config")
        .arg(config)
        .env("NOTIFY_SOCKET", notify)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn tesserad");
    (Daemon(child), started)
}

/// The configuration every flow starts from: the simulated node's NVML library and, under `dir`,
/// the kubelet's plugin directory (`plugins`), the state (`state`) and runtime (`run`)
/// directories; then `body` (more keys, tables).
pub fn config_text(node: &tessera_sim_testkit::SimNode, dir: &Path, body: &str) -> String {
    format!(
        "nvml_library = {:?}\ndevice_plugin_dir = {:?}\nstate_dir = {:?}\nruntime_dir = {:?}\n{body}\n",
        node.nvml_path(),
        dir.join("plugins"),
        dir.join("state"),
        dir.join("run"),
    )
}

/// Writes [`config_text`] to `<dir>/config.toml` and makes the plugin directory; the path.
pub fn write_config(node: &tessera_sim_testkit::SimNode, dir: &Path, body: &str) -> PathBuf {
    std::fs::create_dir_all(dir.join("plugins")).expect("plugin dir");
    let path = dir.join("config.toml");
    std::fs::write(&path, config_text(node, dir, body)).expect("config");
    path
}

/// Runs the built `tessera` CLI against `socket`: its exit code and its stdout and stderr together.
/// Polls `f` every 25 ms until it gives a value; after `within`, fails with what its last `Err`
/// said and the daemon's log at `log`.
pub async fn eventually<T>(within: Duration, log: &Path, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + within;
    loop {
        let last = match f() {
            Ok(v) => return v,
            Err(last) => last,
        };
        assert!(Instant::now() < deadline, "{last}; log:\n{}", std::fs::read_to_string(log).unwrap_or_default());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// tesserad on `node` with [`write_config`]`(node, dir, body)` and no notify socket, logging to
/// `dir/tesserad.log`: the daemon and that log's path.
pub fn start_daemon(node: &tessera_sim_testkit::SimNode, dir: &Path, body: &str) -> (Daemon, PathBuf) {
    let config = write_config(node, dir, body);
    let log = dir.join("tesserad.log");
    let (daemon, _) = spawn(node, &config, &dir.join("no-notify"), &log);
    (daemon, log)
}

/// [`write_config`] with `/metrics` on a free port of 127.0.0.1 (`[telemetry] metrics_listen`)
/// ahead of `body`: that address and the file.
pub fn write_config_with_metrics(
    node: &tessera_sim_testkit::SimNode,
    dir: &Path,
    body: &str,
) -> (std::net::SocketAddr, PathBuf) {
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr");
    (metrics, write_config(node, dir, &format!("[telemetry]\nmetrics_listen = \"{metrics}\"\n{body}")))
}

pub fn tessera(socket: &Path, args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(tessera_sim_testkit::binary("tessera"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .expect("run tessera");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// A node API client on `socket`, retrying while the daemon starts (up to [`WAIT`]).
pub async fn node_api(socket: &Path) -> tessera_proto::tessera::v1::node_client::NodeClient<Channel> {
    let endpoint = Endpoint::from_shared(format!("unix://{}", socket.display())).expect("unix endpoint");
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(channel) = endpoint.connect().await {
            return tessera_proto::tessera::v1::node_client::NodeClient::new(channel);
        }
        assert!(Instant::now() < deadline, "node API not reachable at {}", socket.display());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The program `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

/// The program `name` on PATH, or `None` with a [`skip`] line saying it is not installed and `how`
/// to get it.
pub fn installed(name: &str, how: &str) -> Option<PathBuf> {
    let found = which(name);
    if found.is_none() {
        skip(&format!("{name} is not installed ({how})"));
    }
    found
}

/// A cgroup hierarchy root a test can make groups in: cgroup v1's pids hierarchy, or the v2 root
/// (the path a process's `/proc/<pid>/cgroup` line shows is from there). `None`, with a [`skip`]
/// line, where none can be made (not root).
pub fn cgroup_root() -> Option<PathBuf> {
    let root =
        ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"].into_iter().map(Path::new).find(|r| r.join("cgroup.procs").exists());
    let why = match root {
        Some(r) => {
            // One name per call: tests probe in parallel.
            static PROBES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let probe = r.join(format!("tessera-probe-{}-{n}", std::process::id()));
            match std::fs::create_dir(&probe) {
                Ok(()) => {
                    let _ = std::fs::remove_dir(&probe);
                    return Some(r.to_path_buf());
                }
                Err(e) => format!("cannot make a cgroup under {} ({e}); this test needs root", r.display()),
            }
        }
        None => "no cgroup hierarchy with cgroup.procs under /sys/fs/cgroup".to_string(),
    };
    skip(&why);
    None
}

/// Prints `SKIP: why` and returns; fails instead when `TESSERA_REQUIRE_RUNTIMES` is set (CI runs as
/// root with every tool installed, so a skip there is a broken machine, not a pass).
pub fn skip(why: &str) {
    assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "TESSERA_REQUIRE_RUNTIMES is set, but {why}");
    println!("SKIP: {why}");
    eprintln!("SKIP: {why}");
}

/// A host's GPU files under `dir` as the CDI specs name them: `dev/nvidia0`, `dev/nvidia1` and
/// `dev/nvidiactl` (character devices: made with mknod as root, else links to /dev/null), an
/// empty driver root, a stand-in shim; tesserad's `[injection]` section for them.
pub fn fake_gpu_host(dir: &Path) -> String {
    let dev = dir.join("dev");
    std::fs::create_dir_all(&dev).expect("dev");
    let root = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")));
    for (name, minor) in [("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)] {
        let path = dev.join(name);
        if root {
            let ok = std::process::Command::new("mknod").arg(&path).args(["c", "195", &minor.to_string()]).status();
            assert!(ok.is_ok_and(|s| s.success()), "mknod {}", path.display());
        } else {
            std::os::unix::fs::symlink("/dev/null", &path).expect("symlink");
        }
    }
    std::fs::create_dir_all(dir.join("driver")).expect("driver root");
    std::fs::write(dir.join("libtessera.so"), "stand-in").expect("shim");
    format!(
        "[injection]\ncdi_spec_dir = {:?}\ndriver_root = {:?}\ndev_root = {dev:?}\nshim_path = {:?}\n",
        dir.join("cdi"),
        dir.join("driver"),
        dir.join("libtessera.so")
    )
}
