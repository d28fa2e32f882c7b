//! The `/metrics` HTTP endpoint: hyper's HTTP/1 server on a TCP listener.
//!
//! `GET /metrics` (any query string) answers 200 with the [text format](super::prometheus);
//! `HEAD /metrics` the same headers without a body; another method on `/metrics` 405; any other
//! path 404. Each request asks the [`MetricsSource`] once and renders once, on a blocking thread
//! (reading the accounting regions touches files). Connections that send no complete request
//! head within 10 s are closed.

use std::convert::Infallible;
use std::net::{SocketAddr, ToSocketAddrs};
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

/// The configuration key [`bind`]'s errors name.
const KEY: &str = "telemetry.metrics_listen";
/// How long a connection may take to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for requests in flight.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

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
pub async fn serve(
    listener: tokio::net::TcpListener,
    source: Arc<dyn MetricsSource>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut conns = JoinSet::new();
    if let Ok(a) = listener.local_addr() {
        tracing::info!("metrics: serving http://{a}/metrics");
    }
    loop {
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|&stop| stop) => break,
            accepted = listener.accept() => accepted,
            // Reap finished connections as we go.
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
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
