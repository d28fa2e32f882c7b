//! A DRA claim end to end on the simulated node: the scheduler's allocation result for 8Gi + 30%
//! of GPU 0 (a ResourceClaim in the test API server) → NodePrepareResources through the test
//! kubelet's DRA client → the CDI name tesserad answers, resolved in the claim's own spec
//! (`tessera.io-claim_<uid>.json`) → a CUDA workload run with exactly what that spec gives a
//! container (its env, `/etc/ld.so.preload` and the allocation's files, each container path taken
//! to its host path through the spec's mounts) → CUDA_ERROR_OUT_OF_MEMORY past 8 GiB and 0.30 ±
//! 0.05 of the GPU → NodeUnprepareResources: record, directory, region mount and spec gone.
//! The same in a runc container (root, runc, busybox) whose config.json gets only what the claim's
//! spec says (applied as a CDI runtime does, its createRuntime hook entry included): the simulated
//! driver from the driver root and the shim come from the spec, and the limits hold inside.
//! The claim's opaque configuration of driver `gpu.tessera.io` (priority, compute mode) reaches
//! the allocation: in its limits file, and in what the workload achieves (work-conserving alone on
//! the GPU takes far more than its 30%).

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::{Value, json};
use tessera_proto::dra::v1;
use tessera_proto::tessera::v1 as api;
use tessera_sim_testkit::{SimNode, binary, sim_library};
use tessera_tests::kube::section;
use tessera_tests::kubelet::apiserver::ApiServer;
use tessera_tests::kubelet::dra_kubelet::{claim, register, v1_client};
use tessera_tests::kubelet::{node_api, spawn};

const MIB: u64 = 1 << 20;
/// The simulated driver's memory per context, which counts against the claim as on a real GPU.
const OVERHEAD_MIB: u64 = 300;

/// These tests measure shares of one simulated GPU on a small machine: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A host's GPU files under `dir`, and tesserad's `[injection]` for them: the GPU's and the
/// control device nodes (mknod as root, else links to /dev/null: the process does not open
/// them), a driver root holding the simulated driver as `libcuda.so.1`, the built shim and hook.
fn fake_host(dir: &Path) -> String {
    let dev = dir.join("dev");
    std::fs::create_dir_all(&dev).expect("dev");
    let root = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")));
    for (name, minor) in [("nvidia0", 0), ("nvidiactl", 255)] {
        let path = dev.join(name);
        if root {
            tessera_tests::mknod(&path, 195, minor);
        } else {
            std::os::unix::fs::symlink("/dev/null", &path).expect("symlink");
        }
    }
    tessera_tests::sim_driver_injection(dir, &dir.join("cdi"))
}

/// The scheduler's allocation of `memory` and `sm` of GPU 0's shareable device, with the opaque
/// configuration `config` of driver gpu.tessera.io when not null.
fn claim_object(uid: &str, name: &str, memory: &str, sm: &str, config: Value) -> Value {
    let mut devices = json!({"results": [{"request": "gpu", "driver": "gpu.tessera.io", "pool": "node-a",
        "device": "gpu-0-shared", "shareID": "5e0c7a3e-3c1b-4d9e-8f00-00000000000a",
        "consumedCapacity": {"memory": memory, "sm": sm}}]});
    if !config.is_null() {
        devices["config"] = json!([{"source": "FromClaim", "requests": ["gpu"],
            "opaque": {"driver": "gpu.tessera.io", "parameters": config}}]);
    }
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ml", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share.tessera.io"}}]}},
        "status": {"allocation": {"devices": devices},
            "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"), "uid": format!("{uid}-pod")}]}
    })
}

/// What a CDI runtime gives a container for one device: the spec's and the device's env,
/// mounts (host, container) and device nodes.
#[derive(Debug, Default)]
struct Applied {
    env: Vec<(String, String)>,
    mounts: Vec<(PathBuf, PathBuf, bool)>,
    nodes: Vec<String>,
    /// Container paths our hook entry links into the driver directory (`--link PATH`).
    links: Vec<PathBuf>,
}

impl Applied {
    /// Device `name` of `spec` with the spec's own edits, as the CDI library merges them.
    fn of(spec: &Value, name: &str) -> Applied {
        let device = spec["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .find(|d| d["name"] == name)
            .unwrap_or_else(|| panic!("no device {name} in {spec:#}"));
        let mut out = Applied::default();
        for edits in [&spec["containerEdits"], &device["containerEdits"]] {
            for e in edits["env"].as_array().into_iter().flatten() {
                let (k, v) = e.as_str().expect("env").split_once('=').expect("NAME=VALUE");
                out.env.retain(|(ek, _)| ek != k);
                out.env.push((k.into(), v.into()));
            }
            for m in edits["mounts"].as_array().into_iter().flatten() {
                let ro = m["options"].as_array().expect("options").iter().any(|o| o == "ro");
                let container = PathBuf::from(m["containerPath"].as_str().expect("containerPath"));
                out.mounts.retain(|(_, c, _)| *c != container);
                out.mounts.push((PathBuf::from(m["hostPath"].as_str().expect("hostPath")), container, ro));
            }
            for n in edits["deviceNodes"].as_array().into_iter().flatten() {
                out.nodes.push(n["path"].as_str().expect("path").into());
            }
            for h in edits["hooks"].as_array().into_iter().flatten() {
                let args: Vec<&str> = h["args"].as_array().expect("args").iter().filter_map(|a| a.as_str()).collect();
                out.links.extend(args.windows(2).filter(|w| w[0] == "--link").map(|w| PathBuf::from(w[1])));
            }
        }
        out
    }

    /// Where container path `p` comes from on the host: through the deepest mount holding it,
    /// a driver file's link first taken to its place in the driver directory.
    fn host(&self, p: &str) -> PathBuf {
        let linked = self.links.iter().any(|l| l == Path::new(p));
        let p = if linked {
            Path::new("/usr/lib/tessera/driver").join(p.trim_start_matches('/'))
        } else {
            PathBuf::from(p)
        };
        let p = p.as_path();
        let (host, container, _) = self
            .mounts
            .iter()
            .filter(|(_, c, _)| p.starts_with(c))
            .max_by_key(|(_, c, _)| c.components().count())
            .unwrap_or_else(|| panic!("{} is not mounted by the spec: {:?}", p.display(), self.mounts));
        let rest = p.strip_prefix(container).expect("prefix");
        if rest.as_os_str().is_empty() { host.clone() } else { host.join(rest) }
    }

    fn mount(&self, container: &str) -> Option<&(PathBuf, PathBuf, bool)> {
        self.mounts.iter().find(|(_, c, _)| c == Path::new(container))
    }

    /// The workload as a process of that container: the spec's env (container paths taken to
    /// their host paths), the library `/etc/ld.so.preload` names preloaded, the simulated node.
    fn workload(&self, node: &SimNode, args: &[&str]) -> Output {
        let mut cmd = node.command(binary("tessera-workload"));
        for (k, v) in &self.env {
            let v = if v.starts_with('/') { self.host(v).display().to_string() } else { v.clone() };
            cmd.env(k, v);
        }
        let preload = std::fs::read_to_string(self.host("/etc/ld.so.preload")).expect("the preload file");
        let shim: Vec<String> = preload.lines().map(|l| self.host(l.trim()).display().to_string()).collect();
        cmd.env("LD_PRELOAD", shim.join(":")).args(args).output().expect("tessera-workload")
    }
}

/// The JSON report a workload printed last.
fn report(out: &Output) -> Value {
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().rfind(|l| !l.trim().is_empty()).unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {text}{}", String::from_utf8_lossy(&out.stderr)))
}

/// A daemon in mode `dra` with the test API server and kubelet, ready to prepare.
struct Setup {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    node: SimNode,
    apiserver: ApiServer,
    endpoint: PathBuf,
    _daemon: tessera_tests::kubelet::Daemon,
}

impl Setup {
    async fn start() -> Setup {
        let node = SimNode::with_description(&format!(
            "context_overhead_mib = {OVERHEAD_MIB}\nnuma_nodes = 1\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 1\n"
        ));
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().to_path_buf();
        let apiserver = ApiServer::start().await;
        let registry = dir.join("kubelet/plugins_registry");
        std::fs::create_dir_all(&registry).expect("registry");
        let body = format!(
            "pod_resources_socket = \"\"\n{}[kubernetes]\nmode = \"dra\"\nnode_name = \"node-a\"\nkubeconfig = {:?}\n\
             plugins_dir = {:?}\nplugins_registry_dir = {registry:?}\n",
            fake_host(&dir),
            apiserver.kubeconfig(&dir),
            dir.join("kubelet/plugins"),
        );
        let config = tessera_tests::kubelet::write_config(&node, &dir, &body);
        let (daemon, _) = spawn(&node, &config, &dir.join("no-notify"), &dir.join("tesserad.log"));
        let endpoint = register(&registry.join("gpu.tessera.io-reg.sock")).await.endpoint;
        Setup { _tmp: tmp, dir, node, apiserver, endpoint, _daemon: daemon }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("tesserad.log")).unwrap_or_default()
    }

    /// NodePrepareResources of claim `uid`: its one device's CDI name, and what that gives.
    async fn prepare(&self, uid: &str, name: &str) -> (String, Applied) {
        let mut kubelet = v1_client(&self.endpoint).await;
        let req = v1::NodePrepareResourcesRequest { claims: vec![claim("ml", uid, name)] };
        let mut answer = kubelet.node_prepare_resources(req).await.expect("NodePrepareResources").into_inner();
        let answer = answer.claims.remove(uid).expect("an answer for the claim");
        assert_eq!(answer.error, "", "log:\n{}", self.log());
        let [device] = answer.devices.as_slice() else { panic!("one device: {answer:?}") };
        let [id] = device.cdi_device_ids.as_slice() else { panic!("one CDI name: {device:?}") };
        // As a CDI runtime resolves it: vendor/class=name, in the spec directory.
        let (kind, name) = id.split_once('=').expect("vendor/class=name");
        assert_eq!(kind, "tessera.io/claim");
        let spec = self.spec_with(name).unwrap_or_else(|| panic!("no spec holds {id}"));
        (name.to_owned(), Applied::of(&spec, name))
    }

    /// The spec in the CDI directory that holds device `name`.
    fn spec_with(&self, name: &str) -> Option<Value> {
        let dir = std::fs::read_dir(self.dir.join("cdi")).expect("the CDI directory");
        dir.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".json")).find_map(|e| {
            let spec: Value = serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok()?;
            spec["devices"].as_array()?.iter().any(|d| d["name"] == name).then_some(spec)
        })
    }

    async fn unprepare(&self, uid: &str, name: &str) {
        let mut kubelet = v1_client(&self.endpoint).await;
        let req = v1::NodeUnprepareResourcesRequest { claims: vec![claim("ml", uid, name)] };
        let mut answer = kubelet.node_unprepare_resources(req).await.expect("NodeUnprepareResources").into_inner();
        assert_eq!(answer.claims.remove(uid).expect("an answer").error, "");
    }

    async fn allocations(&self) -> Vec<api::Allocation> {
        let mut api = node_api(&self.dir.join("run/tessera.sock")).await;
        api.list_allocations(api::ListAllocationsRequest::default())
            .await
            .expect("ListAllocations")
            .into_inner()
            .allocations
    }
}

fn mounted_under(dir: &Path) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let dir = dir.display().to_string();
    table.lines().filter_map(|l| l.split(' ').nth(4)).filter(|p| p.starts_with(&dir)).map(String::from).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_8gi_and_30_percent_limits_a_process_under_its_cdi_spec_until_unprepared() {
    let _serial = SERIAL.lock().await;
    let s = Setup::start().await;
    s.apiserver.put_claim(claim_object("uid-train", "train", "8Gi", "30", Value::Null));
    let (name, applied) = s.prepare("uid-train", "train").await;
    let held = s.allocations().await;
    let [alloc] = held.as_slice() else { panic!("one allocation: {held:?}") };
    assert_eq!((alloc.owner.as_str(), alloc.devices[0].memory_limit_bytes), ("uid-train", 8 << 30));

    // What the spec gives the container: the GPU's node, the allocation, the shim.
    assert!(applied.nodes.contains(&"/dev/nvidia0".to_string()), "{:?}", applied.nodes);
    let env = |k: &str| applied.env.iter().find(|(ek, _)| ek == k).map(|(_, v)| v.as_str());
    assert_eq!(env("TESSERA_ALLOCATION"), Some(alloc.id.as_str()));
    let alloc_dir = s.dir.join("run/alloc").join(&alloc.id);
    assert_eq!(applied.mount("/run/tessera/alloc"), Some(&(alloc_dir.clone(), "/run/tessera/alloc".into(), true)));
    let region = applied.mount("/run/tessera/alloc/region").expect("the region");
    assert_eq!((region.0.clone(), region.2), (alloc_dir.join("region"), false));
    assert_eq!(applied.host(env("TESSERA_LIMITS").expect("TESSERA_LIMITS")), alloc_dir.join("limits"));
    assert_eq!(applied.host("/usr/lib/tessera/libtessera.so"), tessera_tests::shim());
    // The driver's file, through the driver directory tesserad made under its state directory.
    let driver = applied.host("/usr/lib/x86_64-linux-gnu/libcuda.so.1");
    assert!(driver.starts_with(s.dir.join("state/driver")), "{}", driver.display());
    let host_file = s.dir.join("driver/usr/lib/x86_64-linux-gnu/libcuda.so.1");
    assert_eq!(std::fs::read(&driver).expect("driver file"), std::fs::read(&host_file).expect("host file"));

    // Past 8 GiB: CUDA_ERROR_OUT_OF_MEMORY at the limit (the context's memory counts).
    let out = applied.workload(&s.node, &["--alloc-mib", &(8192 + 1024).to_string(), "--chunk-mib", "512"]);
    let r = report(&out);
    assert_eq!(out.status.code(), Some(3), "OOM exits 3: {r}");
    assert_eq!(r["alloc_error"], "CUDA_ERROR_OUT_OF_MEMORY", "{r}");
    let got = r["allocated_bytes"].as_u64().expect("allocated");
    let limit = 8u64 << 30;
    assert!(got + OVERHEAD_MIB * MIB <= limit && got + OVERHEAD_MIB * MIB + 512 * MIB > limit, "{got} of {limit}");
    assert_eq!(r["mem_total"].as_u64(), Some(limit), "cuMemGetInfo shows the claim's size: {r}");

    // 30% of the GPU's time (2 ms kernels kept 4 deep, as shim/tests/compute.rs measures).
    let out = applied.workload(&s.node, &["--kernel-us", "2000", "--seconds", "2", "--depth", "4"]);
    let r = report(&out);
    assert!(r["error"].is_null(), "{r}");
    let share = r["achieved_share"].as_f64().expect("achieved_share");
    eprintln!("claim of 30%: achieved {share:.3}");
    assert!((share - 0.30).abs() <= 0.05, "achieved {share} of the GPU under a 30% claim: {r}");

    // Unprepared: the record, the directory, the region's mount, the spec go.
    s.unprepare("uid-train", "train").await;
    assert!(s.allocations().await.is_empty());
    assert!(!alloc_dir.exists());
    assert!(mounted_under(&alloc_dir).is_empty(), "{:?}", mounted_under(&alloc_dir));
    assert!(s.spec_with(&name).is_none(), "the claim's spec is gone");
    assert!(!s.dir.join("cdi/tessera.io-claim_uid-train.json").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claims_opaque_config_reaches_its_allocation() {
    let _serial = SERIAL.lock().await;
    let s = Setup::start().await;
    let config = json!({"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig",
        "priority": "high", "computeMode": "work-conserving"});
    s.apiserver.put_claim(claim_object("uid-burst", "burst", "4Gi", "30", config));
    let (_, applied) = s.prepare("uid-burst", "burst").await;
    let limits = std::fs::read_to_string(applied.host("/run/tessera/alloc/limits")).expect("limits");
    assert!(limits.contains("priority = \"high\""), "{limits}");
    assert!(limits.contains("compute_mode = \"work-conserving\""), "{limits}");
    assert!(limits.contains("sm_percent = 30"), "{limits}");
    // Work-conserving, alone on the GPU: it lends itself the idle time, far past its 30%.
    let out = applied.workload(&s.node, &["--kernel-us", "1000", "--seconds", "2", "--depth", "4"]);
    let r = report(&out);
    let share = r["achieved_share"].as_f64().expect("achieved_share");
    eprintln!("work-conserving claim of 30%, alone: achieved {share:.3}");
    assert!(share >= 0.85, "a work-conserving 30% claim alone took {share}: {r}");

    // A refused configuration names what is wrong, and prepares nothing.
    let bad = json!({"priority": "urgent"});
    s.apiserver.put_claim(claim_object("uid-bad", "bad", "1Gi", "10", bad));
    let mut kubelet = v1_client(&s.endpoint).await;
    let req = v1::NodePrepareResourcesRequest { claims: vec![claim("ml", "uid-bad", "bad")] };
    let answer = kubelet.node_prepare_resources(req).await.expect("NodePrepareResources").into_inner();
    let error = &answer.claims["uid-bad"].error;
    assert!(error.contains("priority \"urgent\" is not one of"), "{error}");
    assert_eq!(s.allocations().await.len(), 1, "the refused claim left an allocation");
    s.unprepare("uid-burst", "burst").await;
}

/// Copies `file` into `rootfs` at `at` (relative), with every library `ldd` says it needs at its
/// own path: a root file system just big enough to run it.
fn copy_with_libraries(rootfs: &Path, file: &Path, at: Option<&str>) {
    if let Some(at) = at {
        let dest = rootfs.join(at);
        std::fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir");
        std::fs::copy(file, &dest).expect("copy");
    }
    let out = std::process::Command::new("ldd").arg(file).output().expect("ldd");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = line.split("=>").last().and_then(|p| p.split_whitespace().next()).filter(|p| p.starts_with('/'));
        if let Some(lib) = path {
            let dest = rootfs.join(lib.trim_start_matches('/'));
            if !dest.exists() {
                std::fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir");
                std::fs::copy(lib, &dest).unwrap_or_else(|e| panic!("{lib}: {e}"));
            }
        }
    }
}

/// Applies device `name` of CDI `spec` to the bundle's config.json as a CDI runtime does (the
/// spec's edits, then the device's): env, device nodes with their cgroup rules, bind mounts
/// (sorted so that a mount comes after the one holding it), hooks.
fn apply_cdi(config: &Path, spec: &Value, name: &str) {
    let mut oci: Value = serde_json::from_slice(&std::fs::read(config).expect("config.json")).expect("json");
    let device = spec["devices"].as_array().expect("devices").iter().find(|d| d["name"] == name).expect("device");
    for edits in [&spec["containerEdits"], &device["containerEdits"]] {
        for e in edits["env"].as_array().into_iter().flatten() {
            oci["process"]["env"].as_array_mut().expect("env").push(e.clone());
        }
        for n in edits["deviceNodes"].as_array().into_iter().flatten() {
            let node = json!({"path": n["path"], "type": "c", "major": n["major"], "minor": n["minor"],
                "fileMode": 0o666, "uid": 0, "gid": 0});
            if !oci["linux"]["devices"].is_array() {
                oci["linux"]["devices"] = json!([]);
            }
            oci["linux"]["devices"].as_array_mut().expect("devices").push(node);
            let rule = json!({"allow": true, "type": "c", "major": n["major"], "minor": n["minor"], "access": "rwm"});
            oci["linux"]["resources"]["devices"].as_array_mut().expect("device rules").push(rule);
        }
        for m in edits["mounts"].as_array().into_iter().flatten() {
            let mounts = oci["mounts"].as_array_mut().expect("mounts");
            mounts.retain(|x| x["destination"] != m["containerPath"]);
            mounts.push(json!({"destination": m["containerPath"], "type": "bind", "source": m["hostPath"],
                "options": m["options"]}));
        }
        for h in edits["hooks"].as_array().into_iter().flatten() {
            let kind = h["hookName"].as_str().expect("hookName").to_owned();
            let hook = json!({"path": h["path"], "args": h["args"], "env": h["env"]});
            let list = &mut oci["hooks"][kind];
            if !list.is_array() {
                *list = json!([]);
            }
            list.as_array_mut().expect("hooks").push(hook);
        }
    }
    let depth = |m: &Value| Path::new(m["destination"].as_str().unwrap_or("/")).components().count();
    oci["mounts"].as_array_mut().expect("mounts").sort_by_key(depth);
    std::fs::write(config, serde_json::to_vec_pretty(&oci).expect("json")).expect("write config.json");
}

const CONTAINER_SCRIPT: &str = r#"
echo "limits-writable $( (echo x >> /run/tessera/alloc/limits) 2>/dev/null && echo yes || echo no)"
echo "region-writable $(test -w /run/tessera/alloc/region && echo yes || echo no)"
echo "ledger-writable $( (printf xxxxxxxx | dd of=/run/tessera/alloc/ledger bs=8 count=1 conv=notrunc) 2>/dev/null && echo yes || echo no)"
echo "preload $(cat /etc/ld.so.preload)"
echo "allocation $TESSERA_ALLOCATION"
for f in /dev/nvidia*; do [ -c "$f" ] && echo "node $f"; done
echo BEGIN-OOM
/usr/local/bin/tessera-workload --alloc-mib 9216 --chunk-mib 512
echo "END-OOM $?"
echo BEGIN-SHARE
/usr/local/bin/tessera-workload --kernel-us 2000 --seconds 2 --depth 4
echo "END-SHARE $?"
echo BEGIN-NOENV
env -u TESSERA_LIMITS -u TESSERA_REGION -u TESSERA_LEDGER /usr/local/bin/tessera-workload --alloc-mib 9216 --chunk-mib 512
echo "END-NOENV $?"
echo BEGIN-OWNENV
TESSERA_LIMITS= TESSERA_REGION=/tmp/own-region TESSERA_MEMORY_LIMIT=1TiB /usr/local/bin/tessera-workload --alloc-mib 9216 --chunk-mib 512
echo "END-OWNENV $?"
"#;

/// The same claim in a runc container that gets its devices, files and environment only from
/// the claim's CDI spec (applied to config.json as a CDI runtime does, its createRuntime hook
/// entry included): a root file system holding busybox and the workload with its libraries; the
/// driver (the simulated one, from the driver root) and the shim come from the spec.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_reaches_a_runc_container_through_its_cdi_spec() {
    if !tessera_tests::runc_usable() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let s = Setup::start().await;
    let Some(rootfs) = tessera_tests::busybox_rootfs(&s.dir.join("rootfs")) else { return };
    copy_with_libraries(&rootfs, &binary("tessera-workload"), Some("usr/local/bin/tessera-workload"));
    copy_with_libraries(&rootfs, &tessera_tests::shim(), None);
    copy_with_libraries(&rootfs, &sim_library(), None);
    s.apiserver.put_claim(claim_object("uid-runc", "boxed", "8Gi", "30", Value::Null));
    let (name, _) = s.prepare("uid-runc", "boxed").await;
    let alloc = s.allocations().await.pop().expect("the claim's allocation");
    let spec = s.spec_with(&name).expect("the claim's spec");

    // The simulated GPU's state, as the real driver's device files would be: the same file.
    let sim_env: Vec<String> = s
        .node
        .env()
        .into_iter()
        .filter(|(k, _)| k != "LD_LIBRARY_PATH")
        .map(|(k, v)| format!("{k}={}", v.to_string_lossy()))
        .collect();
    let bundle = s.dir.join("bundle");
    tessera_tests::runc_bundle(&bundle, &rootfs, CONTAINER_SCRIPT, &sim_env, Value::Null);
    let config = bundle.join("config.json");
    apply_cdi(&config, &spec, &name);
    let mut oci: Value = serde_json::from_slice(&std::fs::read(&config).expect("read")).expect("json");
    let sim_root = s.node.root.display().to_string();
    oci["mounts"].as_array_mut().expect("mounts").push(json!({"destination": sim_root, "type": "bind",
        "source": sim_root, "options": ["rbind", "rw"]}));
    std::fs::write(&config, serde_json::to_vec_pretty(&oci).expect("json")).expect("write");

    let runc = tokio::process::Command::new("runc");
    let limit = std::time::Duration::from_secs(120);
    let (status, text) = tessera_tests::run_bundle(runc, &s.dir.join("runc-state"), &bundle, "claim-ctr", limit).await;
    assert!(status.success(), "{text}\nlog:\n{}", s.log());
    for want in [
        "limits-writable no".to_string(),
        "region-writable yes".into(),
        "ledger-writable no".into(),
        "preload /usr/lib/tessera/libtessera.so".into(),
        format!("allocation {}", alloc.id),
        "node /dev/nvidia0".into(),
    ] {
        assert!(text.contains(&want), "{want:?} in:\n{text}");
    }
    let (oom, status) = section(&text, "OOM");
    assert_eq!((status.as_str(), oom["alloc_error"].as_str()), ("3", Some("CUDA_ERROR_OUT_OF_MEMORY")), "{oom}");
    let got = oom["allocated_bytes"].as_u64().expect("allocated");
    let limit = 8u64 << 30;
    assert!(got + OVERHEAD_MIB * MIB <= limit && got + OVERHEAD_MIB * MIB + 512 * MIB > limit, "{got} of {limit}");
    // A hostile tenant's own environment: the limits, region and ledger come from the mounted
    // allocation directory whatever it says (unset, or a private region and a limit of its own).
    for tag in ["NOENV", "OWNENV"] {
        let (o, status) = section(&text, tag);
        assert_eq!((status.as_str(), o["alloc_error"].as_str()), ("3", Some("CUDA_ERROR_OUT_OF_MEMORY")), "{tag}: {o}");
        let got_here = o["allocated_bytes"].as_u64().expect("allocated");
        assert!(got_here + OVERHEAD_MIB * MIB <= limit, "{tag}: {got_here} of {limit}");
    }
    let (r, status) = section(&text, "SHARE");
    assert_eq!(status, "0", "{r}");
    let share = r["achieved_share"].as_f64().expect("achieved_share");
    eprintln!("claim of 30% in a runc container: achieved {share:.3}");
    assert!((share - 0.30).abs() <= 0.05, "achieved {share} in the container: {r}");

    s.unprepare("uid-runc", "boxed").await;
    assert!(s.spec_with(&name).is_none());
    assert!(!s.dir.join("run/alloc").join(&alloc.id).exists());
}
