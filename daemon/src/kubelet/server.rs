//! Serving device plugins to the kubelet: one socket per resource in the device-plugin
//! directory, registration, and re-registration when the kubelet restarts.
//!
//! The kubelet restarting shows as its `kubelet.sock` recreated (a new inode or ctime) and, since
//! it removes every plugin socket on start, as our own socket gone. Both are checked on every
//! inotify event in the directory (`dir_watch`), and every [`POLL_INTERVAL`] where inotify is
//! not available; either re-serves the plugin on a fresh socket and registers again. A kubelet
//! socket that exists but does not answer yet (bound, not yet listening: no file event marks the
//! moment it listens) is retried every 1 ms for [`REFUSED_FAST_FOR`] after it appeared, so the
//! registration follows the kubelet's listen by a millisecond at most, then every
//! [`POLL_INTERVAL`] (a socket left by a kubelet that is gone).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tessera_proto::deviceplugin::v1beta1::{self as dp, RegisterRequest};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Server;

use super::plugin::DevicePlugin;

/// How often the sockets are checked without an inotify event, and the longest wait between two
/// registration attempts.
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How soon a registration the kubelet refused is retried at first (it binds before it listens).
const FIRST_RETRY: Duration = Duration::from_millis(1);
/// How long after a kubelet socket appeared a refusal is retried every [`FIRST_RETRY`]; past it,
/// every [`POLL_INTERVAL`].
pub const REFUSED_FAST_FOR: Duration = Duration::from_secs(2);
/// How long one registration attempt may take.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a stopped server may take to wind down before it is aborted.
const STOP_GRACE: Duration = Duration::from_secs(1);

/// Errors serving a plugin.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("resource {0} is served twice")]
    DuplicateResource(String),
    #[error("plugin task for {resource} failed: {reason}")]
    Task { resource: String, reason: String },
}

/// The socket file name for `resource`: `tessera.io/gpu` → `tessera.io_gpu.sock`.
pub fn socket_name(resource: &str) -> String {
    let safe: String = resource
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' })
        .collect();
    format!("{safe}.sock")
}

/// A file's identity: a recreated file has a new inode or ctime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

fn file_id(path: &Path) -> Option<FileId> {
    std::fs::symlink_metadata(path).ok().map(|m| FileId {
        dev: m.dev(),
        ino: m.ino(),
        ctime: m.ctime(),
        ctime_nsec: m.ctime_nsec(),
    })
}

/// Serves one plugin in `plugin_dir` until `shutdown` turns true (or its sender goes), registering
/// with the kubelet each time it (re)serves. `registrations` counts successful registrations.
pub async fn serve_plugin(
    plugin_dir: PathBuf,
    plugin: DevicePlugin,
    mut shutdown: watch::Receiver<bool>,
    mut dir_events: Option<watch::Receiver<u64>>,
    registrations: watch::Sender<u64>,
) -> Result<(), KubeletError> {
    let name = socket_name(plugin.resource());
    let socket = plugin_dir.join(&name);
    let kubelet_socket = plugin_dir.join(dp::KUBELET_SOCKET_NAME);
    loop {
        if *shutdown.borrow() {
            break;
        }
        let (stop_tx, server) = start_server(&socket, &plugin)?;
        let own_id = file_id(&socket);
        if own_id.is_none() {
            // Removed between its bind and this look (a restarting kubelet clears the
            // directory): serve again, or the checks below would take "none" for ours.
            stop_server(stop_tx, server);
            tokio::time::sleep(FIRST_RETRY).await;
            continue;
        }

        // Register, retrying until the kubelet answers; why it waits is logged once per reason.
        let mut waiting: Option<String> = None;
        // The kubelet socket that refused, and since when (a new one starts the fast retries over).
        let mut refusing: Option<(FileId, std::time::Instant)> = None;
        let kubelet_id = loop {
            let id = file_id(&kubelet_socket);
            let why = match id {
                None => "no such file (no kubelet yet)".to_string(),
                // Still refusing: a plain connect says so for a few microseconds, where a
                // registration attempt costs a gRPC channel (the reason logged stays the first).
                Some(_) if refusing.is_some() && still_refused(&kubelet_socket) => {
                    waiting.clone().unwrap_or_else(|| "connection refused".into())
                }
                Some(_) => match register(&kubelet_socket, &name, plugin.resource()).await {
                    Ok(()) => {
                        registrations.send_modify(|n| *n += 1);
                        tracing::info!(resource = plugin.resource(), socket = %socket.display(), "registered with the kubelet");
                        break id;
                    }
                    Err(e) => e,
                },
            };
            if waiting.as_deref() != Some(why.as_str()) {
                let (path, every) = (kubelet_socket.display(), POLL_INTERVAL.as_millis());
                if id.is_none() {
                    tracing::info!(
                        resource = plugin.resource(),
                        "kubelet socket {path}: {why}; retrying every {every} ms"
                    );
                } else {
                    tracing::warn!(
                        resource = plugin.resource(),
                        "kubelet socket {path}: {why}; retrying every {every} ms"
                    );
                }
                waiting = Some(why);
            }
            if file_id(&socket) != own_id {
                // Our socket went while waiting: serve again before registering.
                break None;
            }
            // No socket: until the directory changes. A socket that refused: every millisecond
            // while it is new (its kubelet is about to listen), then less often.
            let delay = match id {
                None => {
                    refusing = None;
                    POLL_INTERVAL
                }
                Some(id) => {
                    let since = match refusing {
                        Some((seen, since)) if seen == id => since,
                        _ => refusing.insert((id, std::time::Instant::now())).1,
                    };
                    if since.elapsed() < REFUSED_FAST_FOR { FIRST_RETRY } else { POLL_INTERVAL }
                }
            };
            if wait_or_shutdown(&mut shutdown, &mut dir_events, delay).await {
                break None;
            }
        };

        // Watch for the kubelet restarting.
        if kubelet_id.is_some() {
            loop {
                if wait_or_shutdown(&mut shutdown, &mut dir_events, POLL_INTERVAL).await {
                    break;
                }
                if file_id(&kubelet_socket) != kubelet_id {
                    tracing::info!(resource = plugin.resource(), "kubelet socket recreated; re-registering");
                    break;
                }
                if file_id(&socket) != own_id {
                    tracing::info!(resource = plugin.resource(), "plugin socket removed; re-serving");
                    break;
                }
            }
        }
        stop_server(stop_tx, server);
    }
    remove_socket(&socket)?;
    Ok(())
}

/// Whether connecting to a Unix socket is refused (bound, nobody listening).
fn still_refused(path: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(path).is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
}

/// Waits for a change in the directory, or `delay`; true when shutdown was asked for.
async fn wait_or_shutdown(
    shutdown: &mut watch::Receiver<bool>,
    dir_events: &mut Option<watch::Receiver<u64>>,
    delay: Duration,
) -> bool {
    let changed_dir = async {
        match dir_events {
            Some(rx) => {
                if rx.changed().await.is_err() {
                    // The watcher ended: poll from now on.
                    *dir_events = None;
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        changed = shutdown.changed() => changed.is_err() || *shutdown.borrow(),
        () = changed_dir => *shutdown.borrow(),
        () = tokio::time::sleep(delay) => *shutdown.borrow(),
    }
}

fn remove_socket(socket: &Path) -> Result<(), KubeletError> {
    match std::fs::remove_file(socket) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(KubeletError::Io { action: "removing", path: socket.to_owned(), source }),
    }
}

type ServerTask = JoinHandle<Result<(), tonic::transport::Error>>;

/// Binds a fresh socket (owner-only) and serves the plugin on it until the returned sender says
/// stop.
fn start_server(socket: &Path, plugin: &DevicePlugin) -> Result<(watch::Sender<bool>, ServerTask), KubeletError> {
    let listener = crate::socket::bind_owner_only_tokio(socket).map_err(|source| KubeletError::Io {
        action: "binding",
        path: socket.to_owned(),
        source,
    })?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let service = dp::device_plugin_server::DevicePluginServer::new(plugin.with_stop(stop_rx.clone()));
    let mut stop = stop_rx;
    let server = tokio::spawn(Server::builder().add_service(service).serve_with_incoming_shutdown(
        crate::socket::Incoming::new(listener, "device plugin"),
        async move {
            let _ = stop.wait_for(|s| *s).await;
        },
    ));
    Ok((stop_tx, server))
}

/// Stops a server in the background: graceful first, aborted after [`STOP_GRACE`].
fn stop_server(stop: watch::Sender<bool>, mut server: ServerTask) {
    let _ = stop.send(true);
    tokio::spawn(async move {
        if tokio::time::timeout(STOP_GRACE, &mut server).await.is_err() {
            server.abort();
        }
    });
}

/// An error with its sources ("transport error: connection refused"), which tonic's own
/// message leaves out.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        source = s.source();
    }
    text
}

/// One registration with the kubelet.
async fn register(kubelet_socket: &Path, endpoint: &str, resource: &str) -> Result<(), String> {
    let kubelet = crate::socket::unix_endpoint(kubelet_socket, REGISTER_TIMEOUT)?;
    let channel = kubelet.connect().await.map_err(|e| error_chain(&e))?;
    let mut client = dp::registration_client::RegistrationClient::new(channel);
    client
        .register(RegisterRequest {
            version: dp::VERSION.to_owned(),
            endpoint: endpoint.to_owned(),
            resource_name: resource.to_owned(),
            options: Some(DevicePlugin::options()),
        })
        .await
        .map_err(|status| format!("kubelet refused the registration: {status}"))?;
    Ok(())
}

struct Running {
    registrations: watch::Receiver<u64>,
    task: JoinHandle<Result<(), KubeletError>>,
}

/// The thread every plugin server of a [`PluginSet`] runs on: a current-thread runtime of its
/// own. The kubelet calls one plugin at a time, and on one thread a call is read, answered
/// (Allocate's journal flush included, inline: `crate::blocking`) and written without waking
/// any other thread; on the daemon's multi-threaded runtime each call woke sibling workers and
/// handed the flush to a pool thread, which cost the call more than the flush itself. A flush
/// that stalls holds up only these servers, whose caller waits for that answer anyway.
struct PluginThread {
    handle: tokio::runtime::Handle,
    /// The thread's id in the kernel (`/proc/self/task/<tid>`): the tests read its counters.
    #[cfg_attr(not(test), allow(dead_code))]
    tid: i32,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PluginThread {
    fn start(plugin_dir: &Path) -> Result<Self, KubeletError> {
        let io = |source| KubeletError::Io {
            action: "starting the device-plugin thread for",
            path: plugin_dir.to_owned(),
            source,
        };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(io)?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tessera-kubelet".into())
            .spawn(move || {
                let _ = tid_tx.send(nix::unistd::gettid().as_raw());
                runtime.block_on(async move {
                    let _ = stopped.await;
                });
                // Dropped here, outside any async context: the tasks still there are cancelled.
                drop(runtime);
            })
            .map_err(io)?;
        let tid = tid_rx.recv().unwrap_or(0);
        tracing::debug!(tid, "device-plugin servers' thread started");
        Ok(Self { handle, tid, stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for PluginThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take()
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
    }
}

/// One server per resource, all stopped together; they run on a thread of their own.
pub struct PluginSet {
    plugin_dir: PathBuf,
    shutdown: watch::Sender<bool>,
    running: BTreeMap<String, Running>,
    /// The directory's inotify events, for every plugin task; `None`: they poll.
    dir_events: Option<(watch::Receiver<u64>, JoinHandle<()>)>,
    thread: PluginThread,
}

impl std::fmt::Debug for PluginSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginSet").field("resources", &self.running.keys().collect::<Vec<_>>()).finish()
    }
}

impl PluginSet {
    /// Starts serving every plugin in `plugin_dir`, on a thread of their own ([`PluginThread`]).
    /// Fails before starting anything when a resource appears twice.
    pub fn start(plugin_dir: impl Into<PathBuf>, plugins: Vec<DevicePlugin>) -> Result<Self, KubeletError> {
        let plugin_dir = plugin_dir.into();
        let mut names = std::collections::BTreeSet::new();
        for plugin in &plugins {
            if !names.insert(socket_name(plugin.resource())) {
                return Err(KubeletError::DuplicateResource(plugin.resource().to_owned()));
            }
        }
        let thread = PluginThread::start(&plugin_dir)?;
        let (shutdown, _) = watch::channel(false);
        // The watch registers with the reactor of the thread its task runs on.
        let dir_events = {
            let _on_thread = thread.handle.enter();
            super::dir_watch::watch_dir(&plugin_dir)
        };
        let events = dir_events.as_ref().map(|(rx, _)| rx.clone());
        let running = plugins
            .into_iter()
            .map(|plugin| {
                let (tx, rx) = watch::channel(0);
                let resource = plugin.resource().to_owned();
                let task = thread.handle.spawn(serve_plugin(
                    plugin_dir.clone(),
                    plugin,
                    shutdown.subscribe(),
                    events.clone(),
                    tx,
                ));
                (resource, Running { registrations: rx, task })
            })
            .collect();
        Ok(Self { plugin_dir, shutdown, running, dir_events, thread })
    }

    /// Starts serving one more resource (a layout change made a new kind of device). Refused when
    /// the resource is already served.
    pub fn add(&mut self, plugin: DevicePlugin) -> Result<(), KubeletError> {
        let resource = plugin.resource().to_owned();
        if self.running.keys().any(|r| socket_name(r) == socket_name(&resource)) {
            return Err(KubeletError::DuplicateResource(resource));
        }
        let (tx, rx) = watch::channel(0);
        let events = self.dir_events.as_ref().map(|(rx, _)| rx.clone());
        let task = self.thread.handle.spawn(serve_plugin(
            self.plugin_dir.clone(),
            plugin,
            self.shutdown.subscribe(),
            events,
            tx,
        ));
        self.running.insert(resource, Running { registrations: rx, task });
        Ok(())
    }

    /// The resources served.
    pub fn resources(&self) -> impl Iterator<Item = &str> {
        self.running.keys().map(String::as_str)
    }

    /// How many times `resource` has registered so far (changes on each registration).
    pub fn registrations(&self, resource: &str) -> Option<watch::Receiver<u64>> {
        self.running.get(resource).map(|r| r.registrations.clone())
    }

    /// Waits until every resource has registered at least once (readiness).
    pub async fn wait_registered(&self) {
        for running in self.running.values() {
            let mut rx = running.registrations.clone();
            let _ = rx.wait_for(|n| *n > 0).await;
        }
    }

    /// Stops every server, removes their sockets and reports the first failure; then their
    /// thread ends.
    pub async fn stop(self) -> Result<(), KubeletError> {
        let _ = self.shutdown.send(true);
        if let Some((_, watcher)) = &self.dir_events {
            watcher.abort();
        }
        let mut result = Ok(());
        for (resource, running) in self.running {
            let outcome = match running.task.await {
                Ok(r) => r,
                Err(e) => Err(KubeletError::Task { resource, reason: e.to_string() }),
            };
            if result.is_ok() {
                result = outcome;
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use prost::Message;
    use tessera_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
    use tessera_proto::deviceplugin::v1beta1::{AllocateRequest, ContainerAllocateRequest, Empty};
    use tokio::sync::watch;
    use tonic::Status;

    use super::{PluginSet, socket_name};
    use crate::kubelet::{Allocator, ContainerAllocation, DevicePlugin, PluginDevice};

    /// Answers with about 1 KB of environment: past h2's 256-byte threshold for chaining a payload.
    struct BigAnswers;

    impl Allocator for BigAnswers {
        fn allocate(&self, _: &str, ids: &[String]) -> Result<ContainerAllocation, Status> {
            let envs =
                (0..24).map(|i| (format!("TESSERA_TEST_{i:02}"), format!("{}-{i:032}", ids.join(",")))).collect();
            Ok(ContainerAllocation { envs, annotations: HashMap::new(), ..Default::default() })
        }

        fn preferred(&self, _: &str, _: &[String], _: &[String], _: usize) -> Vec<String> {
            Vec::new()
        }
    }

    /// Write-type system calls the thread has made so far (`/proc/<tid>/io`).
    fn writes(tid: i32) -> u64 {
        let path = format!("/proc/self/task/{tid}/io");
        let io = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e} (task I/O accounting)"));
        io.lines()
            .find_map(|l| l.strip_prefix("syscw:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{path} has no syscw line: {io}"))
    }

    /// One write per Allocate answer (headers, data and trailers together), so the kubelet's
    /// reader wakes once: the vendored h2 copies a payload of up to 4 KiB into its buffer instead
    /// of chaining it, which made such an answer two writes. The servers' writes are all made on
    /// the plugin set's own thread.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_allocate_answer_is_one_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (_tx, rx) = watch::channel(vec![PluginDevice::healthy("GPU-0", None)]);
        let plugin = DevicePlugin::new("tessera.io/gpu", rx, Arc::new(BigAnswers));
        let set = PluginSet::start(dir.path(), vec![plugin]).expect("start");
        let socket = dir.path().join(socket_name("tessera.io/gpu"));
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("unix://{}", socket.display())).expect("endpoint");
        let mut channel = None;
        for _ in 0..500 {
            if let Ok(c) = endpoint.connect().await {
                channel = Some(c);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let mut client = DevicePluginClient::new(channel.expect("the plugin socket answers"));
        // The connection's settings are exchanged by the first call.
        client.get_device_plugin_options(Empty {}).await.expect("options");
        let request = || AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: vec!["GPU-0".into()] }],
        };
        let before = writes(set.thread.tid);
        for _ in 0..10 {
            let answer = client.allocate(request()).await.expect("allocate").into_inner();
            assert!(answer.encoded_len() > 512, "an answer over h2's chaining threshold");
        }
        assert_eq!(writes(set.thread.tid) - before, 10, "one write per answer");
        set.stop().await.expect("stop");
    }
}
