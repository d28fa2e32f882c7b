//! The real single-node cluster `scripts/kube.sh` runs, as the kube_cluster tests and the
//! `kube` benchmark use it: kubectl over its kubeconfig, waits with the cluster's logs on failure,
//! and tesserad over a simulated node of its own registered with its kubelet.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tessera_sim_testkit::{SimNode, binary};

use crate::kubelet::Daemon;

/// How long the cluster gets for anything it does (pods start in seconds; a loaded CI machine
/// may take much longer, and a deadline here is a bound, never a measurement).
pub const WAIT: Duration = Duration::from_secs(240);

/// One tesserad registers with the one kubelet at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The running cluster, as `scripts/kube.sh env` describes it.
pub struct Kube {
    pub env: HashMap<String, String>,
}

impl Kube {
    /// The cluster, or `None` with a SKIP line (a failure under `TESSERA_REQUIRE_RUNTIMES`).
    pub fn find() -> Option<Kube> {
        if std::env::var_os("TESSERA_KUBE_DEFERRED").is_some() {
            // scripts/test.sh runs these again, alone, once the cluster is up.
            println!("DEFERRED: scripts/test.sh runs the kube_cluster tests after the others, with the cluster up");
            return None;
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kube.sh");
        let out = Command::new(&script).arg("env").output().expect("run scripts/kube.sh env");
        if !out.status.success() {
            crate::kubelet::skip(&format!(
                "no Kubernetes cluster is up (scripts/kube.sh up starts one): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
            return None;
        }
        let env = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
            .collect();
        Some(Kube { env })
    }

    pub fn var(&self, key: &str) -> &str {
        self.env.get(key).unwrap_or_else(|| panic!("scripts/kube.sh env printed no {key}"))
    }

    pub fn node(&self) -> &str {
        self.var("KUBE_NODE_NAME")
    }

    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut c = Command::new(self.var("KUBECTL"));
        c.arg("--kubeconfig").arg(self.var("KUBECONFIG")).args(args);
        c.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().expect("run kubectl");
        if let Some(text) = stdin {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("kubectl stdin");
        }
        child.wait_with_output().expect("kubectl")
    }

    /// kubectl's stdout; a failure names the command and shows the cluster's logs.
    pub fn ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.kubectl(args, stdin);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn apply(&self, object: &Value) {
        self.ok(&["apply", "-f", "-"], Some(&object.to_string()));
    }

    /// `kubectl get ARGS -o json`, or `None` when it fails (not found).
    pub fn get(&self, args: &[&str]) -> Option<Value> {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        let out = self.kubectl(&all, None);
        out.status.success().then(|| serde_json::from_slice(&out.stdout).expect("kubectl json"))
    }

    /// The last lines of the kubelet's, containerd's, the API server's and the scheduler's logs.
    pub fn logs(&self) -> String {
        let dir = PathBuf::from(self.var("KUBE_LOG_DIR"));
        let mut text = String::new();
        for name in ["kubelet", "containerd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"] {
            let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            text.push_str(&format!("----- {name}.log (last 40 lines)\n"));
            for l in &lines[lines.len().saturating_sub(40)..] {
                text.push_str(l);
                text.push('\n');
            }
        }
        text
    }

    /// Polls `f` every half second until it gives a value; past [`WAIT`] fails naming `what`,
    /// with the cluster's logs and `extra` (tesserad's).
    pub fn wait<T>(&self, what: &str, extra: &dyn Fn() -> String, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}\n{}\n{}", extra(), self.logs());
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Applies the DeviceClasses of `deploy/kubernetes/overlays/dra` (as an operator would).
    pub fn apply_dra_classes(&self) {
        let classes = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/overlays/dra/deviceclass.yaml");
        self.ok(&["apply", "-f", &classes.display().to_string()], None);
    }

    pub fn node_object(&self) -> Value {
        self.get(&["node", self.node()]).expect("the node")
    }

    /// Deletes a pod and waits until it is gone.
    pub fn delete_pod(&self, name: &str, extra: &dyn Fn() -> String) {
        self.ok(&["delete", "pod", name, "--ignore-not-found", "--wait=false"], None);
        self.wait(&format!("pod {name} deleted"), extra, || self.get(&["pod", name]).is_none().then_some(()));
    }

    /// Deletes `pods` and `claims` (each may be missing) and waits until they are gone.
    pub fn clean(&self, pods: &[&str], claims: &[&str], extra: &dyn Fn() -> String) {
        for p in pods {
            self.delete_pod(p, extra);
        }
        let mut args = vec!["delete", "resourceclaim", "--ignore-not-found", "--wait=true", "--timeout=240s"];
        args.extend_from_slice(claims);
        self.ok(&args, None);
    }

    /// Waits until running pod `name` has printed `DONE` (its script then sleeps, so that its
    /// claims stay reserved and prepared while the test looks); its logs.
    pub fn done(&self, name: &str, extra: &dyn Fn() -> String) -> String {
        self.wait(&format!("pod {name} printed DONE"), extra, || {
            let pod = self.get(&["pod", name])?;
            let phase = pod["status"]["phase"].as_str().unwrap_or_default().to_owned();
            assert!(
                phase != "Failed" && phase != "Succeeded",
                "pod {name} ended ({phase}) before DONE: {pod:#}\n{}",
                self.ok(&["logs", name], None)
            );
            let out = self.kubectl(&["logs", name], None);
            let logs = String::from_utf8_lossy(&out.stdout).into_owned();
            logs.lines().any(|l| l == "DONE").then_some(logs)
        })
    }

    /// Waits until pod `name` has finished (Succeeded or Failed); its phase and its logs.
    pub fn finished(&self, name: &str, extra: &dyn Fn() -> String) -> (String, String) {
        let phase = self.wait(&format!("pod {name} finished"), extra, || {
            let pod = self.get(&["pod", name])?;
            let phase = pod["status"]["phase"].as_str()?.to_owned();
            (phase == "Succeeded" || phase == "Failed").then_some(phase)
        });
        let logs = self.ok(&["logs", name], None);
        (phase, logs)
    }
}

/// A simulated GPU host under `dir`, as tesserad's `[injection]` names it and as containerd's
/// CDI gives it to containers: device nodes (mknod), a driver root whose libcuda.so.1 and
/// libnvidia-ml.so.1 are the simulated driver, the built shim and hook; CDI specs go where
/// containerd reads them.
pub fn sim_host(kube: &Kube, dir: &Path) -> String {
    let dev = dir.join("dev");
    for (name, minor) in [("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)] {
        crate::mknod(&dev.join(name), 195, minor);
    }
    crate::sim_driver_injection(dir, Path::new(kube.var("KUBE_CDI_SPEC_DIR")))
}

/// The last lines of tesserad's log at `path`.
pub fn log_tail(path: &Path) -> String {
    let log = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    format!("----- tesserad.log (last 60 lines)\n{}", lines[lines.len().saturating_sub(60)..].join("\n"))
}

/// tesserad over its own simulated node, registered with the cluster's kubelet.
pub struct Tesserad {
    pub dir: tempfile::TempDir,
    pub node: SimNode,
    pub daemon: Daemon,
}

impl Tesserad {
    /// Starts tesserad with `body` after the common keys (the kubelet's directories, the
    /// cluster's kubeconfig and node name, the simulated host's injection).
    pub fn start(kube: &Kube, description: &str, body: &str) -> Tesserad {
        Tesserad::start_prepared(kube, description, body, |_, _| {})
    }

    /// [`Tesserad::start`] over a node `prepare` changes before tesserad starts (MIG on, an
    /// operator's instances).
    pub fn start_prepared(
        kube: &Kube,
        description: &str,
        body: &str,
        prepare: impl FnOnce(&SimNode, &Path),
    ) -> Tesserad {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = SimNode::with_description(description);
        prepare(&node, dir.path());
        let injection = sim_host(kube, dir.path());
        let config = dir.path().join("config.toml");
        let text = format!(
            "nvml_library = {:?}\ndevice_plugin_dir = {:?}\npod_resources_socket = {:?}\nstate_dir = {:?}\n\
             runtime_dir = {:?}\n{body}\n{injection}",
            node.nvml_path(),
            kube.var("KUBELET_DEVICE_PLUGIN_DIR"),
            kube.var("KUBELET_POD_RESOURCES_SOCKET"),
            dir.path().join("state"),
            dir.path().join("run"),
        );
        std::fs::write(&config, text).expect("config");
        crate::kubelet::unmount_at_exit(dir.path());
        let daemon = Tesserad::spawn(dir.path(), &node);
        Tesserad { dir, node, daemon }
    }

    /// tesserad on the configuration and state in `dir`, its log appended to `dir/tesserad.log`.
    pub fn spawn(dir: &Path, node: &SimNode) -> Daemon {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("tesserad.log")).expect("log");
        let child = node
            .command(binary("tesserad"))
            .arg("--config")
            .arg(dir.join("config.toml"))
            // A deleted pod's share is released 2 s after the kubelet stops listing it, not 60 s.
            .env("TESSERA_POD_RESOURCES_GRACE_SECONDS", "2")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn tesserad");
        Daemon(child)
    }

    pub fn pid(&self) -> u32 {
        self.daemon.0.id()
    }

    /// kill -9, as the OOM killer or a node's crash would.
    pub fn kill_9(&mut self) {
        self.daemon.0.kill().expect("kill -9 tesserad");
        self.daemon.0.wait().expect("reap tesserad");
    }

    /// A new tesserad on the same configuration and state (after [`Tesserad::kill_9`]).
    pub fn respawn(&mut self) {
        self.daemon = Tesserad::spawn(self.dir.path(), &self.node);
    }

    /// The allocation directories under tesserad's runtime directory (their names are the ids).
    pub fn alloc_dirs(&self) -> Vec<String> {
        let mut ids: Vec<String> = std::fs::read_dir(self.dir.path().join("run/alloc"))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        ids.retain(|n| !n.starts_with('.'));
        ids.sort();
        ids
    }

    /// The mounts under tesserad's allocation directories (the allocations' regions; not the
    /// spare directories' kept ready under `run/spare`).
    pub fn alloc_mounts(&self) -> Vec<String> {
        let dir = self.dir.path().join("run/alloc").display().to_string();
        std::fs::read_to_string("/proc/self/mounts")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(1))
            .filter(|m| m.starts_with(&dir))
            .map(str::to_owned)
            .collect()
    }

    pub fn log(&self) -> String {
        log_tail(&self.dir.path().join("tesserad.log"))
    }

    /// `tessera allocations --json`.
    pub fn allocations(&self) -> Vec<Value> {
        let out = crate::tessera(self.dir.path(), &["allocations", "--json"]);
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str::<Value>(text.trim()).ok().and_then(|v| v.as_array().cloned()).unwrap_or_default()
    }

    /// The pod spec's parts that let a container reach this simulated node, as the real driver's
    /// device files would: the sim's state (the same file, at the same path, and where it is),
    /// and the CUDA workload program.
    pub fn sim_volumes(&self) -> (Value, Value, Value) {
        let root = self.node.root.display().to_string();
        let env: Vec<Value> = self
            .node
            .env()
            .into_iter()
            .filter(|(k, _)| k != "LD_LIBRARY_PATH")
            .map(|(k, v)| json!({"name": k, "value": v.to_string_lossy()}))
            .collect();
        let mounts = json!([
            {"name": "sim", "mountPath": root},
            {"name": "workload", "mountPath": "/usr/local/bin/tessera-workload", "readOnly": true},
        ]);
        let volumes = json!([
            {"name": "sim", "hostPath": {"path": root, "type": "Directory"}},
            {"name": "workload", "hostPath": {"path": binary("tessera-workload").display().to_string(), "type": "File"}},
        ]);
        (json!(env), mounts, volumes)
    }
}

/// A pod of the test image running `script`, with `resources` and the simulated node reachable.
pub fn pod(kube: &Kube, t: &Tesserad, name: &str, script: &str, resources: Value, claims: Value) -> Value {
    let (env, mounts, volumes) = t.sim_volumes();
    let mut container = json!({"name": "main", "image": kube.var("TEST_IMAGE"), "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", script], "env": env, "volumeMounts": mounts, "resources": resources});
    let mut spec = json!({"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "volumes": volumes});
    if !claims.is_null() {
        container["resources"]["claims"] =
            json!(claims.as_array().expect("claims").iter().map(|c| json!({"name": c["name"]})).collect::<Vec<_>>());
        spec["resourceClaims"] = claims;
    }
    spec["containers"] = json!([container]);
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec})
}

/// The JSON report printed between `BEGIN-<tag>` and `END-<tag> <status>`, and that status.
pub fn section(text: &str, tag: &str) -> (Value, String) {
    let start = text.find(&format!("BEGIN-{tag}\n")).unwrap_or_else(|| panic!("no {tag} in:\n{text}"));
    let rest = &text[start..];
    let end = rest.find(&format!("END-{tag} ")).unwrap_or_else(|| panic!("no end of {tag} in:\n{text}"));
    let status = rest[end..].lines().next().unwrap_or_default().split(' ').nth(1).unwrap_or_default().to_owned();
    let line =
        rest[..end].lines().rfind(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no report for {tag}:\n{text}"));
    (serde_json::from_str(line).expect("a report"), status)
}

/// A ResourceClaim `name` of one device of `class`, with `capacity` requests unless null and a
/// CEL `selector` unless empty.
pub fn claim(name: &str, class: &str, capacity: Value, selector: &str) -> Value {
    let mut exactly = json!({"deviceClassName": class});
    if !capacity.is_null() {
        exactly["capacity"] = json!({"requests": capacity});
    }
    if !selector.is_empty() {
        exactly["selectors"] = json!([{"cel": {"expression": selector}}]);
    }
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}})
}

/// The pod's `resourceClaims` entry naming claim `name`.
pub fn uses(name: &str) -> Value {
    json!([{"name": "gpu", "resourceClaimName": name}])
}

/// The configuration of a tesserad in DRA mode on this cluster.
pub fn dra_config(kube: &Kube) -> String {
    format!(
        "[kubernetes]\nmode = \"dra\"\nkubeconfig = {:?}\nnode_name = {:?}\nplugins_dir = {:?}\nplugins_registry_dir = {:?}\n",
        kube.var("KUBECONFIG"),
        kube.node(),
        kube.var("KUBELET_PLUGINS_DIR"),
        kube.var("KUBELET_PLUGINS_REGISTRY_DIR"),
    )
}
