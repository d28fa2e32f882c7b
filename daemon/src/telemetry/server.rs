//! The `/metrics` HTTP endpoint: hyper's HTTP/1 server on a TCP listener, or on an owner-only
//! Unix socket (`metrics_listen = "unix:PATH"`: mode 0600, bound through [`crate::socket`], so
//! only root, or whoever runs the daemon, can scrape; a TCP port, loopback included, is open to
//! every local user, and the series name every container's pod, limits and usage).
//!
//! `GET /metrics` (any query string) answers 200 with the [text format](super::prometheus);
//! `HEAD /metrics` the same headers without a body; another method on `/metrics` 405; any other
//! path 404. Each request asks the [`MetricsSource`] once and renders once, on a blocking thread
//! (reading the accounting regions touches files). Connections that send no complete request
//! head within 10 s are closed.

use std::convert::Infallible;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::TelemetryError;
use super::prometheus::{self, NodeMetrics};
use crate::socket::unix_path;

/// The configuration key [`bind`]'s errors name.
const KEY: &str = "telemetry.metrics_listen";
/// How long a connection may take to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for requests in flight.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Where `/metrics` is served.
#[derive(Debug)]
pub enum MetricsListener {
    /// A TCP address (non-blocking, ready for tokio).
    Tcp(std::net::TcpListener),
    /// An owner-only Unix socket (mode 0600) at `path`, with its identity when bound (removed at
    /// the end only while it is still this socket).
    Unix { listener: std::os::unix::net::UnixListener, path: PathBuf, identity: Option<(u64, u64)> },
}

/// Listens where `metrics_listen` says: `unix:PATH` an owner-only Unix socket (a stale socket
/// there replaced, anything else refused), else a TCP address as [`bind`] takes it. Errors name
/// `telemetry.metrics_listen`, the value and the reason.
pub fn listen(addr: &str) -> Result<MetricsListener, TelemetryError> {
    let err = |reason: String| TelemetryError::Listen { key: KEY, addr: addr.to_string(), reason };
    let Some(path) = unix_path(addr) else { return bind(addr).map(MetricsListener::Tcp) };
    let path = path.map_err(err)?;
    let listener =
        crate::socket::bind_owner_only(&path).map_err(|e| err(format!("cannot listen on {}: {e}", path.display())))?;
    listener.set_nonblocking(true).map_err(|e| err(format!("set non-blocking: {e}")))?;
    let identity = crate::socket::identity(&path);
    Ok(MetricsListener::Unix { listener, path, identity })
}

/// Serves `/metrics` on `listener` as [`serve`] does; a Unix socket is removed at the end if it
/// is still ours.
pub async fn serve_on(
    listener: MetricsListener,
    source: Arc<dyn MetricsSource>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    match listener {
        MetricsListener::Tcp(l) => serve(tokio::net::TcpListener::from_std(l)?, source, shutdown).await,
        MetricsListener::Unix { listener, path, identity } => {
            let served = serve(tokio::net::UnixListener::from_std(listener)?, source, shutdown).await;
            remove_if_ours(&path, identity);
            served
        }
    }
}

fn remove_if_ours(path: &Path, identity: Option<(u64, u64)>) {
    if identity.is_some() && crate::socket::identity(path) == identity {
        let _ = std::fs::remove_file(path);
    }
}

/// A listener [`serve`] accepts HTTP connections on.
pub trait Listen: Send + 'static {
    type Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    fn accept_one(&self) -> impl std::future::Future<Output = std::io::Result<Self::Stream>> + Send;
    /// Where it listens, for the log.
    fn describe(&self) -> String;
}

impl Listen for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    async fn accept_one(&self) -> std::io::Result<Self::Stream> {
        self.accept().await.map(|(s, _)| s)
    }
    fn describe(&self) -> String {
        self.local_addr().map(|a| format!("http://{a}/metrics")).unwrap_or_default()
    }
}

impl Listen for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept_one(&self) -> std::io::Result<Self::Stream> {
        self.accept().await.map(|(s, _)| s)
    }
    fn describe(&self) -> String {
        let path = self.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_path_buf));
        path.map(|p| format!("/metrics on the owner-only socket {}", p.display())).unwrap_or_default()
    }
}

/// What a scrape shows: called once per request, on a blocking thread.
pub trait MetricsSource: Send + Sync {
    fn metrics(&self) -> NodeMetrics;
}

/// Parses `addr` (`"127.0.0.1:9400"`, `"[::]:9400"`, or `"host:port"` resolved now) and listens
/// on it (non-blocking, ready for [`tokio::net::TcpListener::from_std`]). Errors name
/// `telemetry.metrics_listen`, the address and the reason.
pub fn bind(addr: &str) -> Result<std::net::TcpListener, TelemetryError> {
    let err = |reason: String| TelemetryError::Listen { key: KEY, addr: addr.to_string(), reason };
    let addrs: Vec<SocketAddr> = match addr.parse::<SocketAddr>() {
        Ok(a) => vec![a],
        Err(_) => {
            let port_ok = addr.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
            if !port_ok {
                return Err(err("not a listen address such as \"127.0.0.1:9400\" or \"[::]:9400\"".to_string()));
            }
            addr.to_socket_addrs().map_err(|e| err(format!("cannot resolve the host: {e}")))?.collect()
        }
    };
    let mut last = None;
    for a in &addrs {
        match std::net::TcpListener::bind(a) {
            Ok(l) => {
                l.set_nonblocking(true).map_err(|e| err(format!("set non-blocking: {e}")))?;
                return Ok(l);
            }
            Err(e) => last = Some(format!("cannot listen on {a}: {e}")),
        }
    }
    Err(err(last.unwrap_or_else(|| "the host resolves to no address".to_string())))
}

/// Serves `/metrics` on `listener` until `shutdown` becomes true (or its sender is dropped): then
/// stops accepting, lets requests in flight finish (up to 5 s) and returns. Accept errors (such
/// as running out of file descriptors) are logged and retried; they do not end the server.
pub async fn serve<L: Listen>(
    listener: L,
    source: Arc<dyn MetricsSource>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut conns = JoinSet::new();
    tracing::info!("metrics: serving {}", listener.describe());
    loop {
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|&stop| stop) => break,
            accepted = listener.accept_one() => accepted,
            // Reap finished connections as we go.
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let stream = match accepted {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!("metrics: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let source = source.clone();
        let mut stop = shutdown.clone();
        conns.spawn(async move {
            let svc = service_fn(move |req| handle(req, source.clone()));
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => return log_conn(r),
                _ = stop.wait_for(|&s| s) => conn.as_mut().graceful_shutdown(),
            }
            log_conn(conn.await);
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, async { while conns.join_next().await.is_some() {} }).await.is_err() {
        conns.abort_all();
    }
    Ok(())
}

fn log_conn(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        tracing::debug!("metrics: connection: {e}");
    }
}

async fn handle(req: Request<Incoming>, source: Arc<dyn MetricsSource>) -> Result<Response<Full<Bytes>>, Infallible> {
    // A liveness probe: the daemon's runtime answers; no metric is rendered for it.
    if req.uri().path() == "/healthz" {
        return Ok(plain(StatusCode::OK, "ok\n"));
    }
    if req.uri().path() != "/metrics" {
        return Ok(plain(StatusCode::NOT_FOUND, "not found: metrics are at /metrics\n"));
    }
    let head = match *req.method() {
        Method::GET => false,
        Method::HEAD => true,
        _ => {
            let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
            r.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            return Ok(r);
        }
    };
    let text = match tokio::task::spawn_blocking(move || prometheus::render(&source.metrics())).await {
        Ok(text) => text,
        Err(e) => {
            tracing::error!("metrics: rendering failed: {e}");
            return Ok(plain(StatusCode::INTERNAL_SERVER_ERROR, "rendering the metrics failed\n"));
        }
    };
    let len = text.len();
    let body = if head { Bytes::new() } else { Bytes::from(text) };
    let mut r = Response::new(Full::new(body));
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(prometheus::CONTENT_TYPE));
    r.headers_mut().insert(CONTENT_LENGTH, HeaderValue::from(len));
    Ok(r)
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Counting(AtomicUsize);

    impl MetricsSource for Counting {
        fn metrics(&self) -> NodeMetrics {
            let n = self.0.fetch_add(1, Ordering::SeqCst) + 1;
            NodeMetrics { hostname: "h".into(), allocations: n, ..Default::default() }
        }
    }

    /// One HTTP/1.1 request, `Connection: close`; returns the whole response.
    fn request(addr: SocketAddr, method: &str, path: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn routes_methods_and_shutdown() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let std_listener = bind("127.0.0.1:0").unwrap();
        let addr = std_listener.local_addr().unwrap();
        let source = Arc::new(Counting(AtomicUsize::new(0)));
        let (tx, rx) = watch::channel(false);
        let server = {
            let source: Arc<dyn MetricsSource> = source.clone();
            let _g = rt.enter();
            let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
            rt.spawn(serve(listener, source, rx))
        };

        let r = request(addr, "GET", "/metrics");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4; charset=utf-8\r\n"), "{r}");
        assert!(r.contains("\r\n\r\n# HELP "), "{r}");
        assert!(r.contains("\ntessera_allocations 1\n"), "{r}");
        let body = r.split_once("\r\n\r\n").unwrap().1;
        super::super::prometheus::check::parse(body);
        assert_eq!(source.0.load(Ordering::SeqCst), 1, "one render per request");

        let r = request(addr, "GET", "/metrics?x=1");
        assert!(r.contains("\ntessera_allocations 2\n"), "{r}");

        // Liveness: ok, and no render.
        let r = request(addr, "GET", "/healthz");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with("\r\n\r\nok\n"), "{r}");
        assert_eq!(source.0.load(Ordering::SeqCst), 2, "a probe renders nothing");

        let r = request(addr, "HEAD", "/metrics");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        assert!(body.is_empty(), "{r}");
        let len: usize = head
            .lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(|v| v.parse().unwrap()))
            .unwrap();
        assert!(len > 100, "{r}");

        assert!(request(addr, "GET", "/").starts_with("HTTP/1.1 404 "));
        assert!(request(addr, "GET", "/metricsx").starts_with("HTTP/1.1 404 "));
        let r = request(addr, "POST", "/metrics");
        assert!(r.starts_with("HTTP/1.1 405 "), "{r}");
        assert!(r.to_ascii_lowercase().contains("allow: get, head\r\n"), "{r}");
        assert_eq!(source.0.load(Ordering::SeqCst), 3);

        // An idle keep-alive connection does not hold shutdown up.
        let idle = std::net::TcpStream::connect(addr).unwrap();
        tx.send(true).unwrap();
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), server).await }).unwrap().unwrap().unwrap();
        assert!(std::net::TcpStream::connect(addr).is_err(), "no longer listening");
        drop(idle);
    }

    /// `unix:PATH`: an owner-only socket (0600, this user's), served, and removed at the end.
    #[test]
    fn a_unix_socket_is_owner_only_and_serves() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.sock");
        let listener = listen(&format!("unix:{}", path.display())).unwrap();
        assert!(matches!(listener, MetricsListener::Unix { .. }));
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "owner-only");
        // SAFETY: geteuid has no preconditions.
        assert_eq!(meta.uid(), unsafe { libc::geteuid() }, "the daemon's own");
        let (tx, rx) = watch::channel(false);
        let server = {
            let _g = rt.enter();
            rt.spawn(serve_on(listener, Arc::new(Counting(AtomicUsize::new(0))), rx))
        };
        let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n") && r.contains("\ntessera_allocations 1\n"), "{r}");
        tx.send(true).unwrap();
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), server).await }).unwrap().unwrap().unwrap();
        assert!(!path.exists(), "our socket is removed at the end");
    }

    #[test]
    fn a_bad_unix_path_is_refused_naming_the_key() {
        let tmp = tempfile::tempdir().unwrap();
        for (bad, why) in [
            ("unix:", "no socket path"),
            ("unix:run/metrics.sock", "not absolute"),
            ("unix:/run/tessera/", "directory"),
            ("unix:/run/../metrics.sock", "directory"),
            (&format!("unix:/{}", "m".repeat(120)), "at most 107"),
        ] {
            let e = listen(bad).unwrap_err().to_string();
            assert!(e.contains("telemetry.metrics_listen") && e.contains(bad) && e.contains(why), "{e}");
            let e = crate::config::Config::parse(&format!("[telemetry]\nmetrics_listen = {bad:?}\n")).unwrap_err();
            let e = e.to_string();
            assert!(e.starts_with("telemetry.metrics_listen") && e.contains(why), "{e}");
        }
        // Its directory missing, or a file that is not a socket there: refused at start, named.
        let missing = format!("unix:{}/no/such/dir/m.sock", tmp.path().display());
        let e = listen(&missing).unwrap_err().to_string();
        assert!(e.contains("telemetry.metrics_listen") && e.contains("cannot listen"), "{e}");
        let file = tmp.path().join("notes.txt");
        std::fs::write(&file, "keep").unwrap();
        let e = listen(&format!("unix:{}", file.display())).unwrap_err().to_string();
        assert!(e.contains("telemetry.metrics_listen") && e.contains("not a socket"), "{e}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
        assert!(
            crate::config::Config::parse("[telemetry]\nmetrics_listen = \"unix:/run/tessera/metrics.sock\"\n").is_ok()
        );
    }

    #[test]
    fn bind_errors_name_the_key() {
        for bad in ["9400", "nohost", ":9400", "127.0.0.1:99999", "127.0.0.1:x"] {
            let e = bind(bad).unwrap_err().to_string();
            assert!(e.contains("telemetry.metrics_listen") && e.contains(bad), "{e}");
        }
        let taken = bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let e = bind(&addr).unwrap_err().to_string();
        assert!(e.contains("telemetry.metrics_listen") && e.contains("cannot listen"), "{e}");
        let l = bind("localhost:0").unwrap();
        assert!(l.local_addr().unwrap().ip().is_loopback());
    }
}
