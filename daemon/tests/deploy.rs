//! The deployment files in deploy/: the systemd unit is a valid Type=notify unit that reloads
//! with SIGHUP (checked by systemd-analyze when the machine has it, against the built binary),
//! and the Kubernetes kustomization renders, validates against the 1.34 and 1.37 schemas, and
//! mounts what its embedded configuration names.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use tessera_daemon::config::Config;
use tessera_daemon::config::kubernetes::Mode;
use tessera_region::paths;

mod common;

use common::which;

fn deploy(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn systemd_unit_is_notify_and_reloads_with_sighup() {
    let unit = deploy("systemd/tesserad.service");
    let lines: Vec<&str> = unit.lines().map(str::trim).collect();
    assert!(lines.contains(&"Type=notify"), "{unit}");
    assert!(lines.contains(&"ExecReload=/bin/kill -HUP $MAINPID"), "{unit}");
    let exec = lines.iter().find(|l| l.starts_with("ExecStart=")).expect("ExecStart");
    assert_eq!(*exec, format!("ExecStart={} --config {}", paths::DAEMON, paths::DAEMON_CONFIG));
    assert!(lines.contains(&"RuntimeDirectoryPreserve=yes"), "allocations must survive a restart: {unit}");
}

/// Every region is a tmpfs tesserad mounts under runtime_dir, which the runtime must see: a unit
/// option that gives the service a mount namespace of its own would hide every region from
/// containers (their region would be an empty file). And a path the unit requires that a plain
/// host lacks fails the start with 226/NAMESPACE: any such path must be optional (`-`).
#[test]
fn systemd_unit_keeps_the_hosts_mount_namespace() {
    let unit = deploy("systemd/tesserad.service");
    let namespacing = [
        "ProtectSystem=",
        "ProtectHome=",
        "PrivateTmp=",
        "PrivateDevices=",
        "PrivateMounts=",
        "ReadWritePaths=",
        "ReadOnlyPaths=",
        "InaccessiblePaths=",
        "TemporaryFileSystem=",
        "BindPaths=",
        "BindReadOnlyPaths=",
        "ProtectKernelTunables=",
        "ProtectKernelModules=",
        "ProtectKernelLogs=",
        "ProtectControlGroups=",
        "ProtectClock=",
        "ProtectHostname=",
        "ProtectProc=",
        "MountFlags=",
        "RootDirectory=",
        "RootImage=",
    ];
    for line in unit.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
        let bad = namespacing.iter().find(|o| line.starts_with(*o));
        assert!(bad.is_none(), "{line}: puts tesserad in a mount namespace whose region mounts never reach the host");
    }
}

#[test]
fn systemd_analyze_verifies_the_unit() {
    let unit = deploy("systemd/tesserad.service");
    let Ok(out) = std::process::Command::new("systemd-analyze").arg("--version").output() else {
        return common::skip("systemd-analyze is not installed (scripts/deps.sh installs Debian's systemd)");
    };
    assert!(out.status.success());
    // Verify a copy that points at the built daemon (the unit names the installed path), which
    // systemd-analyze checks is executable.
    let tmp = tempfile::tempdir().expect("tempdir");
    let copy = tmp.path().join("tesserad.service");
    let daemon = tessera_sim_testkit::binary("tesserad");
    std::fs::write(&copy, unit.replace(paths::DAEMON, &daemon.display().to_string())).expect("copy");
    let verify = |file: &Path| {
        let out = std::process::Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(file)
            .output()
            .expect("systemd-analyze");
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        // Only complaints about this unit count (the host's own units may have their own).
        let ours = text.lines().any(|l| l.contains("tesserad.service"));
        (out.status.success() && !ours, text)
    };
    let (ok, text) = verify(&copy);
    assert!(ok, "systemd-analyze verify:\n{text}");
    // The check can fail: a unit naming a program that is not there is refused.
    std::fs::write(&copy, unit.replace(paths::DAEMON, "/nonexistent/tesserad")).expect("copy");
    let (ok, text) = verify(&copy);
    assert!(!ok, "systemd-analyze verify accepted a missing ExecStart program:\n{text}");
}

/// The renderer: `kubectl kustomize` (Debian's kubernetes-client), or SKIP.
fn kubectl() -> Option<PathBuf> {
    common::installed("kubectl", "Debian package kubernetes-client; scripts/deps.sh installs it")
}

/// kubernetes-validate: the virtual environment scripts/deps.sh makes, else on PATH, or SKIP.
fn validator() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/k8s-validate/bin");
    let found = Some(venv.join("kubernetes-validate")).filter(|p| p.is_file()).or_else(|| which("kubernetes-validate"));
    if found.is_none() {
        common::skip("kubernetes-validate is not installed (scripts/deps.sh puts it in target/k8s-validate)");
    }
    found
}

/// `kubectl kustomize deploy/kubernetes/<dir>`: the YAML text.
fn render(kubectl: &Path, dir: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes").join(dir);
    let out = Command::new(kubectl).arg("kustomize").arg(&path).output().expect("kubectl kustomize");
    assert!(out.status.success(), "kubectl kustomize {dir}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

/// The rendered documents as JSON (PyYAML from the validator's environment).
fn documents(validator: &Path, yaml: &str) -> Vec<Value> {
    let python = validator.with_file_name("python");
    let python = if python.is_file() { python } else { PathBuf::from("python3") };
    common::yaml_documents(&python, yaml)
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// Both overlays render, validate strictly against the Kubernetes 1.34 and 1.37 schemas (a
/// kind the schemas do not know counts as a failure, not a warning), and say what tesserad
/// needs: its configuration's directories mounted from the same host paths, the runtime
/// directory Bidirectional, the host's driver root where the configuration says, the installer
/// as an init container with the host's root, probes, requests, the token only in DRA mode, and
/// the mode itself in the configuration (the DRA overlay ran the device plugin: its
/// configuration never said `mode = "dra"`).
#[test]
fn kustomize_overlays_render_validate_and_mount_what_the_config_names() {
    let (Some(kubectl), Some(validator)) = (kubectl(), validator()) else { return };
    for (overlay, token, mode) in
        [("overlays/device-plugin", false, Mode::DevicePlugin), ("overlays/dra", true, Mode::Dra)]
    {
        let docs = check_daemon_manifests(overlay, &validator, &render(&kubectl, overlay), token, mode);
        assert_eq!(find(&docs, "RuntimeClass", "tessera")["handler"], tessera_daemon::install::HANDLER);
    }
}

/// Validates every document of `yaml` strictly against the Kubernetes 1.34 and 1.37 schemas (a
/// kind the schemas do not know counts as a failure, not a warning).
fn validate_strictly(validator: &Path, what: &str, yaml: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("rendered.yaml");
    std::fs::write(&file, yaml).unwrap();
    for (version, valid, said) in validate_file(validator, &file) {
        assert!(valid, "{what} against {version}:\n{said}");
    }
}

/// What every rendering of the DaemonSet must say (the kustomize overlays and the Helm chart
/// alike): see `kustomize_overlays_render_validate_and_mount_what_the_config_names`. Returns the
/// documents and the parsed configuration.
fn check_daemon_manifests(overlay: &str, validator: &Path, yaml: &str, token: bool, mode: Mode) -> Vec<Value> {
    validate_strictly(validator, overlay, yaml);
    let docs = documents(validator, yaml);
    let ds = find(&docs, "DaemonSet", "tesserad");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["automountServiceAccountToken"], token, "{overlay}: the token only where DRA needs it");
    assert_eq!(pod["hostPID"], true);
    let cm = find(&docs, "ConfigMap", "tessera-config");
    let cfg = Config::parse(cm["data"]["config.toml"].as_str().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    let volumes = pod["volumes"].as_array().unwrap();
    let host_path = |volume: &str| {
        volumes.iter().find(|v| v["name"] == volume).and_then(|v| v["hostPath"]["path"].as_str()).map(String::from)
    };
    let daemon = &pod["containers"].as_array().unwrap().iter().find(|c| c["name"] == "tesserad").unwrap();
    assert_eq!(daemon["command"][0], paths::DAEMON);
    let mounts = daemon["volumeMounts"].as_array().unwrap();
    let mount = |path: &Path| {
        let path = path.to_str().unwrap().trim_end_matches('/');
        mounts.iter().find(|m| m["mountPath"] == path).unwrap_or_else(|| panic!("{overlay}: {path} is not mounted"))
    };
    for dir in
        [&cfg.device_plugin_dir, &cfg.state_dir, &cfg.runtime_dir, &cfg.injection.cdi_spec_dir, &cfg.injection.dev_root]
    {
        let m = mount(dir);
        let host = host_path(m["name"].as_str().unwrap());
        assert_eq!(
            host.as_deref(),
            Some(dir.to_str().unwrap().trim_end_matches('/')),
            "{overlay}: {} is the host's",
            dir.display()
        );
    }
    for kubelet in [&cfg.kubernetes.plugins_dir, &cfg.kubernetes.plugins_registry_dir] {
        let m = mount(kubelet);
        assert_eq!(host_path(m["name"].as_str().unwrap()).as_deref(), kubelet.to_str(), "{overlay}: the kubelet's");
    }
    let pod_resources = cfg.pod_resources_socket.parent().unwrap();
    let m = mount(pod_resources);
    assert_eq!(host_path(m["name"].as_str().unwrap()).as_deref(), pod_resources.to_str(), "{overlay}: the kubelet's");
    assert_eq!(mount(&cfg.runtime_dir)["mountPropagation"], "Bidirectional", "regions' mounts must reach the host");
    let driver = mount(&cfg.injection.driver_root);
    assert_eq!(host_path(driver["name"].as_str().unwrap()).as_deref(), cfg.injection.host_driver_root().to_str());
    assert_eq!(mount(Path::new(paths::DAEMON_CONFIG).parent().unwrap())["readOnly"], true);
    // The installer first, with the host's root.
    let init = &pod["initContainers"][0];
    assert_eq!(init["command"][0], paths::CLI);
    assert_eq!(init["command"][1], "install");
    let root = init["command"][3].as_str().unwrap();
    let root_mount = init["volumeMounts"].as_array().unwrap().iter().find(|m| m["mountPath"] == root).unwrap();
    assert_eq!(host_path(root_mount["name"].as_str().unwrap()).as_deref(), Some("/"));
    // Probes on what the daemon serves; the metrics port is the configured one.
    let port = cfg.telemetry.metrics_listen.as_deref().and_then(|l| l.rsplit(':').next()).unwrap();
    assert_eq!(daemon["ports"][0]["containerPort"].to_string(), port);
    assert_eq!(daemon["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(daemon["livenessProbe"]["httpGet"]["port"], daemon["ports"][0]["name"]);
    assert_eq!(daemon["readinessProbe"]["exec"]["command"][0], paths::CLI);
    for c in pod["containers"].as_array().unwrap().iter().chain(pod["initContainers"].as_array().unwrap()) {
        assert!(c["resources"]["requests"]["cpu"].is_string() && c["resources"]["requests"]["memory"].is_string());
        // The image's own user is nobody: root only where the manifest says so.
        assert_eq!(c["securityContext"]["runAsUser"], 0, "{}", c["name"]);
    }
    let svc = find(&docs, "Service", "tesserad-metrics");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], daemon["ports"][0]["name"]);
    // The Service and the DaemonSet select the daemons' pods by labels those pods carry.
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    for selector in [&svc["spec"]["selector"], &ds["spec"]["selector"]["matchLabels"]] {
        let selector = selector.as_object().unwrap();
        assert!(
            !selector.is_empty() && selector.iter().all(|(k, v)| &labels[k] == v),
            "{overlay}: {selector:?} ⊄ {labels}"
        );
    }
    assert_eq!(cfg.kubernetes.mode, mode, "{overlay}: the configuration's mode");
    let node_name = daemon["env"].as_array().unwrap().iter().find(|e| e["name"] == "NODE_NAME");
    assert_eq!(
        node_name.map(|e| &e["valueFrom"]["fieldRef"]["fieldPath"]),
        Some(&Value::from("spec.nodeName")),
        "{overlay}: the DRA driver's node"
    );
    docs
}

/// Helm v4, built from helm.sh/helm/v4 by scripts/deps.sh into target/helm/, else on PATH, or SKIP.
fn helm() -> Option<PathBuf> {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/helm/v4.3.2/helm");
    let found = Some(built).filter(|p| p.is_file()).or_else(|| which("helm"));
    if found.is_none() {
        common::skip("helm is not built (scripts/deps.sh builds Helm v4 into target/helm)");
    }
    found
}

/// `helm template tessera deploy/helm/tessera --namespace tessera-system ARGS`: the YAML, or what
/// Helm said.
fn helm_template(helm: &Path, args: &[&str]) -> Result<String, String> {
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/tessera");
    let out = Command::new(helm)
        .args(["template", "tessera"])
        .arg(&chart)
        .args(["--namespace", "tessera-system"])
        .args(args)
        .output()
        .expect("helm template");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).expect("utf-8"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn config_of(docs: &[Value]) -> Config {
    Config::parse(find(docs, "ConfigMap", "tessera-config")["data"]["config.toml"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The Helm chart renders each mode as the overlays do: the same checks, the same volumes,
/// mounts and configuration as the kustomize rendering of that mode, and in DRA modes the same
/// DeviceClasses and RBAC rules.
#[test]
fn helm_chart_renders_each_mode_as_the_overlays_do() {
    let (Some(helm), Some(kubectl), Some(validator)) = (helm(), kubectl(), validator()) else { return };
    for (mode, token, want, overlay) in [
        ("device-plugin", false, Mode::DevicePlugin, Some("overlays/device-plugin")),
        ("dra", true, Mode::Dra, Some("overlays/dra")),
        ("both", true, Mode::Both, None),
    ] {
        let what = format!("helm --set mode={mode}");
        let yaml = helm_template(&helm, &["--set", &format!("mode={mode}")]).unwrap_or_else(|e| panic!("{what}: {e}"));
        let docs = check_daemon_manifests(&what, &validator, &yaml, token, want);
        let classes: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "DeviceClass").collect();
        assert_eq!(classes.len(), if token { 4 } else { 0 }, "{what}: DeviceClasses");
        assert_eq!(docs.iter().any(|d| d["kind"] == "ClusterRole"), token, "{what}: RBAC only for DRA");
        let Some(overlay) = overlay else { continue };
        let kustomized = documents(&validator, &render(&kubectl, overlay));
        let pod = |docs: &[Value]| find(docs, "DaemonSet", "tesserad")["spec"]["template"]["spec"].clone();
        let (ours, theirs) = (pod(&docs), pod(&kustomized));
        assert_eq!(ours["volumes"], theirs["volumes"], "{what}: volumes as {overlay}'s");
        let (a, b) = (&ours["containers"][0], &theirs["containers"][0]);
        assert_eq!(a["volumeMounts"], b["volumeMounts"], "{what}: mounts as {overlay}'s");
        assert_eq!((&a["command"], &a["env"]), (&b["command"], &b["env"]), "{what}: as {overlay}'s");
        assert_eq!(ours["initContainers"][0]["command"], theirs["initContainers"][0]["command"]);
        assert_eq!(config_of(&docs), config_of(&kustomized), "{what}: the configuration {overlay} gives");
        for d in kustomized.iter().filter(|d| d["kind"] == "DeviceClass" || d["kind"] == "ClusterRole") {
            let name = d["metadata"]["name"].as_str().unwrap();
            let kind = d["kind"].as_str().unwrap();
            let key = if kind == "ClusterRole" { "rules" } else { "spec" };
            assert_eq!(find(&docs, kind, name)[key], d[key], "{what}: {kind} {name} as {overlay}'s");
        }
    }
}

/// The guard against what crashes kube-scheduler 1.34 (a request for more than one shared
/// device; docs/kubernetes.md): the overlay `dra-k8s-1.34` is the DRA overlay and the policy
/// with its binding, validated strictly; the chart renders the same policy and binding in modes
/// dra and both on a cluster before 1.35 only (`shareCountGuard.create: auto`), always with
/// `true`, never with `false`, and refuses any other value by name. The real API server enforcing
/// it: tests/flows/kube_cluster.rs, on 1.34.
#[test]
fn the_1_34_share_guard_is_one_policy_in_the_overlay_and_the_chart() {
    let (Some(helm), Some(kubectl), Some(validator)) = (helm(), kubectl(), validator()) else { return };
    let overlay = "overlays/dra-k8s-1.34";
    let docs = check_daemon_manifests(overlay, &validator, &render(&kubectl, overlay), true, Mode::Dra);
    let name = "tessera-one-share-per-request";
    let policy = find(&docs, "ValidatingAdmissionPolicy", name);
    let binding = find(&docs, "ValidatingAdmissionPolicyBinding", name);
    assert_eq!(binding["spec"], json!({"policyName": name, "validationActions": ["Deny"]}));
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    let guards = |args: &[&str]| -> Vec<Value> {
        let yaml = helm_template(&helm, args).unwrap_or_else(|e| panic!("helm {args:?}: {e}"));
        documents(&validator, &yaml).into_iter().filter(|d| d["metadata"]["name"] == name).collect()
    };
    for mode in ["dra", "both"] {
        let set = format!("mode={mode}");
        let got = guards(&["--set", &set, "--kube-version", "1.34.4"]);
        assert_eq!(got.len(), 2, "mode {mode} on 1.34: the policy and its binding");
        let chart = |kind: &str| got.iter().find(|d| d["kind"] == kind).expect(kind)["spec"].clone();
        assert_eq!(chart("ValidatingAdmissionPolicy"), policy["spec"], "the chart's policy is the overlay's");
        assert_eq!(chart("ValidatingAdmissionPolicyBinding"), binding["spec"]);
        assert!(guards(&["--set", &set, "--kube-version", "1.35.0"]).is_empty(), "mode {mode}: not from 1.35");
        assert_eq!(
            guards(&["--set", &set, "--set", "shareCountGuard.create=true", "--kube-version", "1.37.2"]).len(),
            2
        );
        assert!(
            guards(&["--set", &set, "--set", "shareCountGuard.create=false", "--kube-version", "1.34.4"]).is_empty()
        );
    }
    assert!(guards(&["--set", "mode=device-plugin", "--kube-version", "1.34.4"]).is_empty(), "no DRA: no guard");
    let e = helm_template(&helm, &["--set", "mode=dra", "--set", "shareCountGuard.create=maybe"]).expect_err("maybe");
    assert!(e.contains("shareCountGuard") && e.contains("auto"), "{e}");
}

/// Values a user sets reach the configuration and the mounts: another driver root and kubelet
/// root, whole numbers (Helm reads YAML numbers as floats: written `500.0`, tesserad refuses
/// them), MIG profiles (keys with dots), strings with quotes; metrics off. Bad values are refused
/// by name before anything is rendered.
#[test]
fn helm_values_reach_the_configuration_and_bad_ones_are_refused_by_name() {
    let (Some(helm), Some(validator)) = (helm(), validator()) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let values = tmp.path().join("values.yaml");
    std::fs::write(
        &values,
        r#"
mode: both
hostDriverRoot: /run/nvidia/driver
kubeletRoot: /var/lib/k0s/kubelet
config:
  log_format: json
  enforcement:
    interval_ms: 250
  kubernetes:
    labels: false
    mode: dra
  partitions:
    default:
      whole: true
    "1":
      mig:
        "1g.10gb": 7
  injection:
    driver_root: /elsewhere
"#,
    )
    .unwrap();
    let yaml = helm_template(&helm, &["-f", values.to_str().unwrap()]).unwrap_or_else(|e| panic!("{e}"));
    let docs = check_daemon_manifests("helm custom values", &validator, &yaml, true, Mode::Both);
    let cfg = config_of(&docs);
    assert_eq!(cfg.kubernetes.mode, Mode::Both, "the chart's mode wins over config.kubernetes.mode");
    assert!(!cfg.kubernetes.labels);
    assert_eq!(cfg.enforcement.interval_ms, 250);
    assert_eq!(cfg.partitions["1"].mig.as_ref().unwrap()["1g.10gb"], 7);
    assert_eq!(cfg.injection.driver_root, Path::new("/driver-root"), "the chart's mount wins");
    assert_eq!(cfg.injection.host_driver_root(), Path::new("/run/nvidia/driver"));
    assert_eq!(cfg.kubernetes.plugins_dir, Path::new("/var/lib/k0s/kubelet/plugins"));
    assert_eq!(cfg.device_plugin_dir, Path::new("/var/lib/k0s/kubelet/device-plugins/"));

    // Metrics off: no listener, no Service, a liveness probe on the node API.
    let yaml = helm_template(&helm, &["--set", "metrics.port=0"]).unwrap_or_else(|e| panic!("{e}"));
    let docs = documents(&validator, &yaml);
    assert_eq!(config_of(&docs).telemetry.metrics_listen, None);
    assert!(!docs.iter().any(|d| d["kind"] == "Service"));
    let daemon = &find(&docs, "DaemonSet", "tesserad")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(daemon["livenessProbe"]["exec"]["command"][0], paths::CLI);

    for (set, names) in [
        ("mode=dra-and-more", "mode"),
        ("kubeletRoot=var/lib/kubelet", "kubeletRoot"),
        ("hostDriverRoot=relative", "hostDriverRoot"),
        ("metrics.port=70000", "port"),
    ] {
        let e = helm_template(&helm, &["--set", set]).expect_err(set);
        assert!(e.contains(names), "{set}: {e}");
    }
}

/// The ServiceMonitor (kept apart: it needs the Prometheus Operator's CRD) selects the metrics
/// Service by its labels and scrapes its named port.
#[test]
fn the_service_monitor_scrapes_the_metrics_service() {
    let (Some(kubectl), Some(validator)) = (kubectl(), validator()) else { return };
    let monitor = documents(&validator, &render(&kubectl, "monitoring"));
    let base = documents(&validator, &render(&kubectl, "overlays/device-plugin"));
    let sm = find(&monitor, "ServiceMonitor", "tesserad");
    let svc = find(&base, "Service", "tesserad-metrics");
    assert_eq!(sm["metadata"]["namespace"], svc["metadata"]["namespace"]);
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&svc["metadata"]["labels"][k], v, "the ServiceMonitor selects label {k}");
    }
    assert_eq!(sm["spec"]["endpoints"][0]["port"], svc["spec"]["ports"][0]["name"]);
    assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
}

/// The ResourceSlices tesserad writes (whole GPUs, shareable GPUs with consumable capacity, MIG
/// devices (unhealthy ones removed, or tainted), dynamic MIG placements with their GPUs' shared counters) validate strictly against
/// the 1.34 and 1.37 schemas in both layouts (counters beside their devices up to 1.34, in
/// slices of their own from 1.35); an object with a field the schemas lack is refused, so the
/// check can fail.
#[test]
fn resource_slices_validate_against_the_1_34_and_1_37_schemas() {
    use tessera_daemon::dra::devices::{DraDevice, DraKind, GpuCounters, MigPlacement};
    use tessera_daemon::dra::slices::{SliceLayout, build_pool};
    let Some(validator) = validator() else { return };
    let device = |name: &str, kind: DraKind, memory: u64| DraDevice {
        name: name.into(),
        kind,
        uuid: format!("{name}-uuid"),
        gpu_index: 0,
        gpu_uuid: "GPU-0".into(),
        product: "NVIDIA H100 80GB HBM3".into(),
        memory,
        sm: 100,
        driver_version: "550.54.15".into(),
        cuda_driver_version: "12.4".into(),
        numa_node: Some(1),
        pci_bus_id: "00000000:18:00.0".into(),
        health: Default::default(),
    };
    let counters = GpuCounters {
        name: "gpu-2-counter-set".into(),
        memory: 81_152 << 20,
        multiprocessors: 132,
        memory_slices: (0..8).collect(),
    };
    let placement = |profile: &str, id: u32, start: u32, size: u32, sms: u32, mib: u64| DraDevice {
        gpu_index: 2,
        gpu_uuid: "GPU-2".into(),
        ..device(
            &format!("gpu-2-mig-{}-{start}", profile.replace('.', "")),
            DraKind::MigPlacement(MigPlacement {
                profile: profile.into(),
                profile_id: id,
                start,
                size,
                multiprocessors: sms,
                counters: counters.clone(),
            }),
            mib << 20,
        )
    };
    let devices = [
        device("gpu-0", DraKind::Gpu, 80 << 30),
        device("gpu-0-shared", DraKind::Shared, 81_559_289_856),
        device("gpu-1-mig-2-0", DraKind::Mig { profile: "3g.40gb".into(), gi: 2, ci: 0 }, 40 << 30),
        placement("1g.10gb", 19, 6, 1, 16, 9_984),
        placement("3g.40gb", 9, 4, 4, 60, 40_448),
        placement("7g.80gb", 0, 0, 8, 132, 81_152),
    ];
    let check = |obj: &Value| validate_both(&validator, obj);
    let object = |s: &k8s_openapi::api::resource::v1::ResourceSlice| {
        let mut v = serde_json::to_value(s).unwrap();
        v["apiVersion"] = "resource.k8s.io/v1".into();
        v["kind"] = "ResourceSlice".into();
        v
    };
    let single = object(&tessera_daemon::dra::slices::build("node-a", &devices[..3], 3));
    for (ok, said) in check(&single) {
        assert!(ok, "{said}\n{single:#}");
    }
    for (layout, slices) in [(SliceLayout::Combined, 3), (SliceLayout::Separate, 3)] {
        let pool = build_pool("node-a", &devices, 3, layout);
        assert_eq!(pool.len(), slices, "{layout:?}");
        let mut counters_seen = false;
        for s in &pool {
            let obj = object(s);
            counters_seen |= obj["spec"]["sharedCounters"].is_array();
            for (ok, said) in check(&obj) {
                assert!(ok, "{layout:?} {said}\n{obj:#}");
            }
        }
        assert!(counters_seen, "{layout:?}: the counter set was published");
    }
    // The 1.36+ layout: unhealthy devices stay, tainted NoExecute (failed) or NoSchedule
    // (recovering), with the time the taint was added.
    use tessera_daemon::device_health::Health;
    use tessera_daemon::dra::slices::{Unhealthy, build_with};
    let mut sick = devices.clone();
    sick[0].health = Health::Unhealthy("unhealthy: XID 79 (GPU has fallen off the bus)".into());
    sick[2].health = Health::Unhealthy("recovering: reset (volatile ECC counters cleared)".into());
    let mut tainted = serde_json::to_value(build_with("node-a", &sick[..3], 4, Unhealthy::Taint, None)).unwrap();
    tainted["apiVersion"] = "resource.k8s.io/v1".into();
    tainted["kind"] = "ResourceSlice".into();
    let effects: Vec<&Value> =
        tainted["spec"]["devices"].as_array().unwrap().iter().map(|d| &d["taints"][0]["effect"]).collect();
    assert_eq!(effects, [&Value::from("NoExecute"), &Value::Null, &Value::from("NoSchedule")]);
    for (ok, said) in check(&tainted) {
        assert!(ok, "{said}\n{tainted:#}");
    }
    let mut bad = tainted.clone();
    bad["spec"]["devices"][0]["taints"][0]["severity"] = "high".into();
    for (ok, said) in check(&bad) {
        assert!(!ok, "a taint field the schema lacks was accepted: {said}");
    }

    let mut bad = single.clone();
    bad["spec"]["devices"][0]["capacity"]["memory"]["bogus"] = 1.into();
    for (ok, said) in check(&bad) {
        assert!(!ok, "a field the schema lacks was accepted: {said}");
    }
    let mut bad = object(&build_pool("node-a", &devices, 3, SliceLayout::Combined)[1]);
    bad["spec"]["devices"][0]["consumesCounters"][0]["bogus"] = 1.into();
    for (ok, said) in check(&bad) {
        assert!(!ok, "a field the schema lacks was accepted in a counter consumption: {said}");
    }
}

/// The DRA overlay's DeviceClasses select this driver's four device types; the example claims
/// (a whole GPU, 8Gi + 30% of an H100, one claim shared by two pods, a MIG 3g.40gb existing or
/// made on demand) validate
/// against 1.34 and 1.37 and name only those classes.
#[test]
fn dra_classes_and_example_claims_validate_and_fit_together() {
    let (Some(kubectl), Some(validator)) = (kubectl(), validator()) else { return };
    let overlay = documents(&validator, &render(&kubectl, "overlays/dra"));
    let mut classes = std::collections::BTreeMap::new();
    for name in ["gpu.tessera.io", "gpu-share.tessera.io", "mig.tessera.io", "mig-dynamic.tessera.io"] {
        let c = find(&overlay, "DeviceClass", name);
        let cel = c["spec"]["selectors"][0]["cel"]["expression"].as_str().unwrap().to_owned();
        assert!(cel.contains(&format!("device.driver == \"{}\"", tessera_daemon::dra::DRIVER)), "{name}: {cel}");
        classes.insert(name, cel);
    }
    for (name, ty) in [
        ("gpu.tessera.io", "gpu"),
        ("gpu-share.tessera.io", "shared"),
        ("mig.tessera.io", "mig"),
        ("mig-dynamic.tessera.io", "mig-placement"),
    ] {
        assert!(classes[name].contains(&format!(".type == \"{ty}\"")), "{name} selects type {ty}");
    }
    let rbac = find(&overlay, "ClusterRole", "tessera-dra");
    let rules = rbac["rules"].as_array().unwrap();
    let allows = |resource: &str, verb: &str| {
        rules.iter().any(|r| {
            r["resources"].as_array().unwrap().iter().any(|x| x == resource)
                && r["verbs"].as_array().unwrap().iter().any(|x| x == verb)
        })
    };
    for (resource, verb) in [
        ("resourceslices", "create"),
        ("resourceslices", "update"),
        ("resourceslices", "delete"),
        ("resourceclaims", "get"),
        ("resourceclaims/status", "patch"),
        ("nodes", "get"),
        ("nodes", "patch"),
        ("events", "create"),
        ("events", "patch"),
    ] {
        assert!(allows(resource, verb), "the driver's role may {verb} {resource}");
    }
    // Events are written through events.k8s.io/v1, Node labels through the core group.
    let group_of = |resource: &str| -> Vec<String> {
        rules
            .iter()
            .filter(|r| r["resources"].as_array().unwrap().iter().any(|x| x == resource))
            .flat_map(|r| r["apiGroups"].as_array().unwrap().iter().map(|g| g.as_str().unwrap().to_owned()))
            .collect()
    };
    assert!(group_of("events").iter().any(|g| g == "events.k8s.io"), "{:?}", group_of("events"));
    assert_eq!(group_of("nodes"), [""], "nodes only in the core group");
    assert!(!allows("nodes", "update") && !allows("nodes", "delete"), "labels need patch, nothing more");

    let yaml = render(&kubectl, "../kubernetes/examples/dra");
    validate_strictly(&validator, "examples", &yaml);
    let docs = documents(&validator, &yaml);
    let mut named = std::collections::BTreeSet::new();
    for d in docs.iter().filter(|d| d["kind"] == "ResourceClaimTemplate" || d["kind"] == "ResourceClaim") {
        let spec = if d["kind"] == "ResourceClaim" { &d["spec"] } else { &d["spec"]["spec"] };
        for r in spec["devices"]["requests"].as_array().unwrap() {
            let class = r["exactly"]["deviceClassName"].as_str().unwrap();
            assert!(classes.contains_key(class), "{} names class {class} the overlay lacks", d["metadata"]["name"]);
            named.insert(class.to_owned());
        }
    }
    assert_eq!(named.len(), 4, "every class has an example: {named:?}");
    let share = find(&docs, "ResourceClaimTemplate", "share-8gi-30pct-h100");
    let request = &share["spec"]["spec"]["devices"]["requests"][0]["exactly"];
    assert_eq!(request["capacity"]["requests"], json!({"memory": "8Gi", "sm": "30"}));
    // Two pods on one claim.
    let users = docs
        .iter()
        .filter(|d| d["kind"] == "Pod" && d["spec"]["resourceClaims"][0]["resourceClaimName"] == "shared-16gi-50pct")
        .count();
    assert_eq!(users, 2);
}

/// Runs kubernetes-validate on `obj` against 1.34 and 1.37: (valid, what it said) per version.
fn validate_both(validator: &Path, obj: &Value) -> [(bool, String); 2] {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("object.json");
    std::fs::write(&file, serde_json::to_vec(obj).unwrap()).unwrap();
    validate_file(validator, &file).map(|(version, valid, said)| (valid, format!("{version}: {said}")))
}

/// Runs kubernetes-validate strictly on `file` against 1.34 and 1.37: per version, whether it
/// is valid (it succeeded and said nothing) and what it said.
fn validate_file(validator: &Path, file: &Path) -> [(&'static str, bool, String); 2] {
    ["1.34.0", "1.37.0"].map(|version| {
        let out = Command::new(validator)
            .args(["--strict", "--quiet", "-k", version])
            .arg(file)
            .output()
            .expect("kubernetes-validate");
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (version, out.status.success() && said.trim().is_empty(), said)
    })
}

/// The Events tesserad writes (a first occurrence, and a series) on a Node and on a Pod validate
/// strictly against the 1.34 and 1.37 events.k8s.io/v1 schemas; a field they lack is refused.
#[test]
fn kubernetes_events_validate_against_the_1_34_and_1_37_schemas() {
    use tessera_daemon::kubernetes::event_recorder::{Coalescer, Write, occurrences};
    use tessera_proto::tessera::v1 as api;
    let Some(validator) = validator() else { return };
    let fault = api::Event {
        kind: api::EventKind::Fault as i32,
        device_uuid: "GPU-1".into(),
        message: "XID 79 (GPU has fallen off the bus)".into(),
        affected: vec![api::Holder {
            allocation_id: "a1".into(),
            container: Some(api::ContainerIdentity {
                pod_namespace: "ml".into(),
                pod_name: "trainer-0".into(),
                pod_uid: "0f2a".into(),
                ..Default::default()
            }),
        }],
        detail: Some(api::event::Detail::Fault(api::Fault { marks_unhealthy: true, ..Default::default() })),
        ..Default::default()
    };
    let mut c = Coalescer::new("tesserad-node-a");
    let now = std::time::Instant::now();
    let wall = k8s_openapi::jiff::Timestamp::now();
    for o in occurrences("node-a", &fault) {
        c.observe(o, now, wall);
    }
    // The Node's fault twice: created with its series.
    c.observe(occurrences("node-a", &fault)[0].clone(), now, wall);
    let events: Vec<Value> = c
        .due(now)
        .into_iter()
        .map(|(w, _)| match w {
            Write::Create(e) => serde_json::to_value(*e).unwrap(),
            other => panic!("a new series is created: {other:?}"),
        })
        .collect();
    assert_eq!(events.len(), 2);
    assert!(events.iter().any(|e| e["series"]["count"] == 2), "{events:#?}");
    for e in &events {
        assert_eq!((e["apiVersion"].as_str(), e["kind"].as_str()), (Some("events.k8s.io/v1"), Some("Event")));
        for (ok, said) in validate_both(&validator, e) {
            assert!(ok, "{said}\n{e:#}");
        }
    }
    let mut bad = events[0].clone();
    bad["series"]["state"] = "Ongoing".into();
    for (ok, said) in validate_both(&validator, &bad) {
        assert!(!ok, "a field the schema lacks was accepted: {said}");
    }
}

/// The Node label patch (labels set, one of ours removed with null) validates as a Node against
/// the 1.34 and 1.37 schemas, and every key and value is a valid label key and value.
#[test]
fn node_label_patch_validates_against_the_1_34_and_1_37_schemas() {
    use tessera_daemon::discovery::{Gpu, Inventory};
    use tessera_daemon::kubernetes::labels::{OWNED, labels, patch};
    let Some(validator) = validator() else { return };
    let gpu = |index: u32| Gpu {
        index,
        uuid: format!("GPU-{index}"),
        name: "NVIDIA H100 80GB HBM3".into(),
        memory_total: 81_559 << 20,
        pci_bus_id: format!("00000000:1{index}:00.0"),
        numa_node: Some(0),
        minor: Some(index),
        mig: None,
        nvlink_peers: Vec::new(),
        processes: Vec::new(),
    };
    let inv = Inventory {
        library: "/usr/lib/libnvidia-ml.so.1".into(),
        driver_version: "570.133.20".into(),
        cuda_driver_version: 12080,
        gpus: vec![gpu(0), gpu(1)],
        topology: Vec::new(),
    };
    let wanted = labels(&inv);
    let want = |k: &str| wanted.get(k).map(String::as_str);
    assert_eq!(want("tessera.io/gpu.count"), Some("2"));
    assert_eq!(want("tessera.io/gpu.product"), Some("NVIDIA-H100-80GB-HBM3"));
    assert_eq!(want("tessera.io/gpu.memory"), Some("81559"));
    assert_eq!((want("tessera.io/gpu.driver.major"), want("tessera.io/gpu.driver.rev")), (Some("570"), Some("20")));
    assert_eq!((want("tessera.io/cuda.driver.major"), want("tessera.io/cuda.driver.minor")), (Some("12"), Some("8")));
    assert_eq!((want("tessera.io/mig.capable"), want("tessera.io/mig.strategy")), (Some("false"), Some("none")));
    let current = std::collections::BTreeMap::from([
        ("tessera.io/gpu.family".to_string(), "ampere".to_string()),
        ("kubernetes.io/hostname".to_string(), "node-a".to_string()),
    ]);
    let mut without_family = wanted.clone();
    without_family.remove("tessera.io/gpu.family");
    let p = patch(&current, &without_family).expect("a patch");
    assert_eq!(p["metadata"]["labels"]["tessera.io/gpu.family"], Value::Null, "ours, no longer wanted: removed");
    assert!(p["metadata"]["labels"].get("kubernetes.io/hostname").is_none(), "others' never named");
    let name_ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && s.as_bytes()[0].is_ascii_alphanumeric()
            && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
    };
    for (k, v) in p["metadata"]["labels"].as_object().unwrap() {
        assert!(OWNED.contains(&k.as_str()), "{k}");
        let (prefix, name) = k.split_once('/').unwrap();
        assert!(prefix == "tessera.io" && name_ok(name), "label key {k}");
        assert!(v.is_null() || name_ok(v.as_str().unwrap()), "label value {v} of {k}");
    }
    let mut node = p.clone();
    node["apiVersion"] = "v1".into();
    node["kind"] = "Node".into();
    node["metadata"]["name"] = "node-a".into();
    for (ok, said) in validate_both(&validator, &node) {
        assert!(ok, "{said}\n{node:#}");
    }
    let mut bad = node.clone();
    bad["metadata"]["labelz"] = json!({});
    for (ok, said) in validate_both(&validator, &bad) {
        assert!(!ok, "a field the schema lacks was accepted: {said}");
    }
}
