//! `scripts/bench.sh kube`: how long the real cluster (`scripts/kube.sh up`: kube-apiserver,
//! kube-scheduler, the kubelet, containerd 2) takes from a ResourceClaim created to its pod's
//! container running, with tesserad as the DRA driver over a simulated node, beside a pod with no
//! claim (the baseline: what the cluster itself takes) and, when built, NVIDIA's DRA driver over
//! the same simulated node (`TESSERA_BENCH_NVIDIA_PLUGIN`, whole GPUs only). Every round runs one
//! pod of each, in turn, so that the machine's noise falls on all alike; the ratios come from the
//! same run. Then 20 share claims packed on the node at once, beside 20 pods with no claim.
//!
//! "Running" is the moment a `kubectl get pods --watch` started before the round shows the pod
//! Ready (its one container started, no probe): one watch for the whole run, so no kubectl start
//! is timed. Nothing here is a test: it prints figures (docs/benchmarks.md keeps them).

use std::collections::HashMap;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tessera_tests::kube::{Kube, Tesserad, WAIT, claim, dra_config, uses};

/// Rounds of claim → running (the 30 pods of each; `TESSERA_BENCH_ROUNDS` for a quick look).
const ROUNDS: usize = 30;
/// Share pods packed on the node at once, and how many times.
const PACKED: usize = 20;
const PACK_ROUNDS: usize = 3;

fn rounds(default: usize) -> usize {
    std::env::var("TESSERA_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}
const H100X2: &str = "[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 2\n";

/// When each pod was first seen Ready, from one `kubectl get pods --watch`.
struct ReadyWatch {
    child: Child,
    seen: Arc<(Mutex<HashMap<String, Instant>>, Condvar)>,
}

impl ReadyWatch {
    fn start(kube: &Kube) -> ReadyWatch {
        let mut child = Command::new(kube.var("KUBECTL"))
            .args(["--kubeconfig", kube.var("KUBECONFIG"), "get", "pods", "--namespace", "default", "--watch"])
            .arg("--output=jsonpath={.metadata.name} {.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("kubectl get pods --watch");
        let seen: Arc<(Mutex<HashMap<String, Instant>>, Condvar)> = Arc::default();
        let out = child.stdout.take().expect("stdout");
        let shared = Arc::clone(&seen);
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let now = Instant::now();
                if let Some((name, "True")) = line.trim().split_once(' ') {
                    let (map, cv) = &*shared;
                    map.lock().unwrap().entry(name.to_owned()).or_insert(now);
                    cv.notify_all();
                }
            }
        });
        ReadyWatch { child, seen }
    }

    /// When pod `name` was first Ready (waits for it, at most [`WAIT`]).
    fn ready(&self, kube: &Kube, name: &str) -> Instant {
        let (map, cv) = &*self.seen;
        let (map, timeout) = cv.wait_timeout_while(map.lock().unwrap(), WAIT, |m| !m.contains_key(name)).unwrap();
        assert!(!timeout.timed_out(), "pod {name} not Ready within {WAIT:?}\n{}", kube.logs());
        map[name]
    }
}

impl Drop for ReadyWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A pod of the test image that sleeps, using claim `claim` when there is one.
fn sleeper(kube: &Kube, name: &str, claim: Option<&str>) -> Value {
    // Deleted gracefully (a grace period of 0 deletes the object at once, as --force does, and
    // the kubelet then unprepares the claim after its GPU was given to the next one: both drivers
    // refuse that prepare and the kubelet retries seconds later). It exits on SIGTERM.
    let mut container = json!({"name": "main", "image": kube.var("TEST_IMAGE"), "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"]});
    let mut spec = json!({"restartPolicy": "Never", "terminationGracePeriodSeconds": 5});
    if let Some(c) = claim {
        container["resources"] = json!({"claims": [{"name": "gpu"}]});
        spec["resourceClaims"] = uses(c);
    }
    spec["containers"] = json!([container]);
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"tessera.io/bench": "kube"}}, "spec": spec})
}

/// One way of asking for a GPU: its claim's class and capacity (none: a pod with no claim).
#[derive(Clone)]
struct Way {
    name: &'static str,
    class: Option<&'static str>,
    capacity: Value,
}

/// Creates `n` pods of `way` (each with its claim) at once; the time from the create's answer to
/// each pod's Ready, in order. Names are never used twice in a run: the kubelet refuses a claim
/// named as one it has not finished unpreparing ("old ResourceClaim with same name"), and retries
/// only after a back-off.
fn run(kube: &Kube, watch: &ReadyWatch, way: &Way, prefix: &str, n: usize) -> Vec<Duration> {
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let mut items = Vec::new();
    for name in &names {
        if let Some(class) = way.class {
            items.push(claim(name, class, way.capacity.clone(), ""));
        }
        items.push(sleeper(kube, name, way.class.map(|_| name.as_str())));
    }
    let asked = Instant::now();
    kube.ok(&["create", "-f", "-"], Some(&json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()));
    let created = Instant::now();
    if std::env::var_os("TESSERA_BENCH_TRACE").is_some() {
        eprintln!("{prefix}: create took {:.0} ms", ms(created - asked));
    }
    let times = names.iter().map(|name| watch.ready(kube, name) - created).collect();
    // Gone before the next round: pods first (the kubelet unprepares their claims), then claims.
    let mut args = vec!["delete", "pod", "--wait=true", "--timeout=240s"];
    args.extend(names.iter().map(String::as_str));
    kube.ok(&args, None);
    if way.class.is_some() {
        let mut args = vec!["delete", "resourceclaim", "--wait=true", "--timeout=240s"];
        args.extend(names.iter().map(String::as_str));
        kube.ok(&args, None);
    }
    times
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `q` quantile of sorted `v` (nearest rank).
fn quantile(v: &[Duration], q: f64) -> Duration {
    v[((v.len() as f64 - 1.0) * q).round() as usize]
}

fn report(what: &str, results: &[(String, Vec<Duration>)]) {
    println!("\n{what}");
    let base = results.first().map(|(_, v)| quantile(&sorted(v), 0.5));
    for (name, v) in results {
        let mut v = v.clone();
        v.sort();
        let (p50, p99) = (quantile(&v, 0.5), quantile(&v, 0.99));
        let ratio = base.map(|b| ms(p50) / ms(b)).unwrap_or(1.0);
        println!(
            "  {name:<26} n={:<3} p50 {:>8.1} ms  p99 {:>8.1} ms  max {:>8.1} ms  p50 / {} p50 = {ratio:.2}",
            v.len(),
            ms(p50),
            ms(p99),
            ms(v[v.len() - 1]),
            results[0].0,
        );
    }
}

fn main() {
    let Some(kube) = Kube::find() else {
        eprintln!("kube bench: no cluster (scripts/bench.sh kube starts one)");
        std::process::exit(2);
    };
    let t = Tesserad::start(&kube, H100X2, &dra_config(&kube));
    kube.apply_dra_classes();
    let slice = format!("spec.nodeName={}", kube.node());
    kube.wait("tesserad's ResourceSlice", &|| t.log(), || {
        let slices = kube.get(&["resourceslices", "--field-selector", &slice])?;
        slices["items"].as_array()?.iter().any(|s| s["spec"]["driver"] == "gpu.tessera.io").then_some(())
    });
    let nvidia = nvidia::start(&kube, &t);
    let watch = ReadyWatch::start(&kube);
    let mut ways = vec![
        Way { name: "pod, no claim", class: None, capacity: Value::Null },
        Way { name: "tesserad, whole GPU", class: Some("gpu.tessera.io"), capacity: Value::Null },
    ];
    if nvidia.is_some() {
        ways.push(Way { name: "NVIDIA DRA, whole GPU", class: Some(nvidia::CLASS), capacity: Value::Null });
    }
    let mut results: Vec<(String, Vec<Duration>)> = ways.iter().map(|w| (w.name.to_owned(), Vec::new())).collect();
    let n = rounds(ROUNDS);
    for round in 0..n {
        // Each round starts with a different way, so none is always first after a delete.
        for k in 0..ways.len() {
            let i = (round + k) % ways.len();
            let d = run(&kube, &watch, &ways[i], &format!("bench-{i}-{round}"), 1)[0];
            results[i].1.push(d);
        }
    }
    report(&format!("claim created -> container running ({n} rounds, one pod of each in turn)"), &results);
    if results.len() == 3 {
        let (a, b) = (quantile(&sorted(&results[1].1), 0.5), quantile(&sorted(&results[2].1), 0.5));
        println!("  tesserad p50 / NVIDIA DRA p50 = {:.2}", ms(a) / ms(b));
    }

    let packs = [
        Way { name: "20 pods, no claim", class: None, capacity: Value::Null },
        Way {
            name: "20 shares of 2Gi, 5 SM",
            class: Some("gpu-share.tessera.io"),
            capacity: json!({"memory": "2Gi", "sm": "5"}),
        },
    ];
    let mut all: Vec<(String, Vec<Duration>)> = packs.iter().map(|w| (w.name.to_owned(), Vec::new())).collect();
    let mut last: Vec<(String, Vec<Duration>)> = packs.iter().map(|w| (w.name.to_owned(), Vec::new())).collect();
    let packs_n = rounds(PACK_ROUNDS);
    for round in 0..packs_n {
        for k in 0..packs.len() {
            let i = (round + k) % packs.len();
            let times = run(&kube, &watch, &packs[i], &format!("pack-{i}-{round}"), PACKED);
            last[i].1.push(*times.iter().max().expect("pods"));
            all[i].1.extend(times);
        }
    }
    report(&format!("{PACKED} pods created at once -> each running ({packs_n} rounds)"), &all);
    report(&format!("{PACKED} pods created at once -> the last running ({packs_n} rounds)"), &last);
    if let Some(p) = &nvidia {
        eprintln!("{}", p.log_tail());
    }
    drop(nvidia);
    drop(t);
}

fn sorted(v: &[Duration]) -> Vec<Duration> {
    let mut v = v.to_vec();
    v.sort();
    v
}

/// NVIDIA's DRA driver (`sigs.k8s.io/dra-driver-nvidia-gpu`, its kubelet plugin), when
/// `scripts/bench.sh kube` built it: run as its DaemonSet would, over a driver root of the same
/// simulated node tesserad serves (`tessera-sim install --driver-root`: the simulated NVML and
/// CUDA libraries, `nvidia-smi`, the device nodes), with its default feature gates.
mod nvidia {
    use std::path::PathBuf;
    use std::process::{Child, Stdio};

    use serde_json::json;
    use tessera_sim_testkit::binary;
    use tessera_tests::kube::{Kube, Tesserad};

    pub const CLASS: &str = "gpu.nvidia.com";

    pub struct Plugin<'a> {
        kube: &'a Kube,
        child: Child,
        pub log: PathBuf,
        _root: tempfile::TempDir,
    }

    pub fn start<'a>(kube: &'a Kube, t: &Tesserad) -> Option<Plugin<'a>> {
        let plugin = std::env::var_os("TESSERA_BENCH_NVIDIA_PLUGIN")?;
        let hook = std::env::var_os("TESSERA_BENCH_NVIDIA_CDI_HOOK").expect("TESSERA_BENCH_NVIDIA_CDI_HOOK");
        let root = tempfile::tempdir().expect("tempdir");
        let driver = root.path().join("driver");
        let out = t.node.command(binary("tessera-sim")).arg("install").arg("--driver-root").arg(&driver).output();
        let out = out.expect("tessera-sim install");
        assert!(out.status.success(), "tessera-sim install --driver-root: {}", String::from_utf8_lossy(&out.stderr));
        let log = root.path().join("nvidia-plugin.log");
        let child = t
            .node
            .command(&plugin)
            .args(["--node-name", kube.node(), "--kubeconfig", kube.var("KUBECONFIG")])
            .args(["--cdi-root", kube.var("KUBE_CDI_SPEC_DIR")])
            .arg("--nvidia-driver-root")
            .arg(&driver)
            .arg("--container-driver-root")
            .arg(&driver)
            .arg("--nvidia-cdi-hook-path")
            .arg(&hook)
            .args(["--kubelet-registrar-directory-path", kube.var("KUBELET_PLUGINS_REGISTRY_DIR")])
            .args(["--kubelet-plugins-directory-path", kube.var("KUBELET_PLUGINS_DIR")])
            .args(["--image-name", "unused.invalid/dra:0"])
            .env("LD_LIBRARY_PATH", driver.join("usr/lib/x86_64-linux-gnu"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("NVIDIA's kubelet plugin");
        kube.apply(&json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": CLASS},
            "spec": {"selectors": [{"cel": {"expression":
                "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}}]}}));
        let p = Plugin { kube, child, log, _root: root };
        let field = format!("spec.nodeName={}", kube.node());
        kube.wait("NVIDIA's ResourceSlice", &|| p.log_tail(), || {
            let slices = kube.get(&["resourceslices", "--field-selector", &field])?;
            slices["items"].as_array()?.iter().any(|s| s["spec"]["driver"] == CLASS).then_some(())
        });
        Some(p)
    }

    impl Plugin<'_> {
        pub fn log_tail(&self) -> String {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            format!("----- NVIDIA plugin log\n{}", lines[lines.len().saturating_sub(40)..].join("\n"))
        }
    }

    impl Drop for Plugin<'_> {
        /// Stopped, its slices, class and plugin directory gone: the node as before.
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let field = format!("spec.nodeName={},spec.driver={CLASS}", self.kube.node());
            let _ = self.kube.kubectl(&["delete", "resourceslices", "--field-selector", &field], None);
            let _ = self.kube.kubectl(&["delete", "deviceclass", CLASS, "--ignore-not-found"], None);
            let dir = PathBuf::from(self.kube.var("KUBELET_PLUGINS_DIR")).join(CLASS);
            let _ = std::fs::remove_dir_all(dir);
            let reg = PathBuf::from(self.kube.var("KUBELET_PLUGINS_REGISTRY_DIR")).join(format!("{CLASS}-reg.sock"));
            let _ = std::fs::remove_file(reg);
        }
    }
}
