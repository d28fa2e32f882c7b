//! A real Prometheus server for tests (Debian's `prometheus` package, installed by
//! scripts/deps.sh): started on a free loopback port scraping one target every second, queried
//! through its HTTP API, killed on drop.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PROMETHEUS: &str = "/usr/bin/prometheus";
const WAIT: Duration = Duration::from_secs(30);

/// A Prometheus server, killed on drop.
pub struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: std::path::PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `target` every second, on a free loopback port (tried again on
    /// another port if it exits at start, e.g. because the port was taken in between).
    pub fn start(dir: &Path, target: SocketAddr) -> Prometheus {
        assert!(
            Path::new(PROMETHEUS).exists(),
            "{PROMETHEUS} is missing: install Debian's `prometheus` package (scripts/deps.sh does)"
        );
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: tesserad\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let mut last_log = String::new();
        for attempt in 0..3 {
            let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
            let log = dir.join(format!("prometheus-{attempt}.log"));
            let child = Command::new(PROMETHEUS)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={}", dir.join(format!("data-{attempt}")).display()))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=info")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {PROMETHEUS}: {e}"));
            let mut p = Prometheus { child, addr, log };
            let deadline = Instant::now() + WAIT;
            while Instant::now() < deadline {
                if p.child.try_wait().unwrap().is_some() {
                    break;
                }
                if get(addr, "/-/ready").is_some_and(|(code, _)| code == 200) {
                    return p;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            last_log = std::fs::read_to_string(&p.log).unwrap_or_default();
            let _ = p.child.kill();
        }
        panic!("Prometheus did not become ready; its log:\n{last_log}");
    }

    /// An instant query: the result vector as (labels, value).
    pub fn query(&self, q: &str) -> Vec<(serde_json::Map<String, serde_json::Value>, f64)> {
        let (code, body) = get(self.addr, &format!("/api/v1/query?query={}", encode(q)))
            .unwrap_or_else(|| panic!("Prometheus query {q:?}: no answer"));
        assert_eq!(code, 200, "query {q:?}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{body}");
        v["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let labels = r["metric"].as_object().unwrap().clone();
                let value = r["value"][1].as_str().unwrap().parse::<f64>().unwrap();
                (labels, value)
            })
            .collect()
    }

    /// Polls `q` until it gives exactly one sample equal to `want` (what Prometheus scraped last
    /// may lag one interval behind); fails after 30 s with what it last saw and the log.
    pub fn wait_for(&self, q: &str, want: f64) -> serde_json::Map<String, serde_json::Value> {
        let deadline = Instant::now() + WAIT;
        loop {
            let r = self.query(q);
            if let [(labels, v)] = r.as_slice()
                && *v == want
            {
                return labels.clone();
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                panic!("{q}: wanted {want}, Prometheus has {r:?}\nits log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A minimal HTTP/1.0 GET: (status, body); `None` if nothing answers.
pub fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    let code = head.split(' ').nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
