//! What a platform team watches (deploy/monitoring, docs/metrics.md): the alert rules pass their
//! promtool unit tests, and those tests catch a rule that never fires or always does; the
//! generated files (the Grafana dashboard's JSON, the PrometheusRule, the Helm chart's copies) are
//! what their sources make; every query of the rules and the dashboard names series and labels
//! tesserad's exporter writes, and the rules' test series are labelled as it labels them.
//!
//! Needs promtool (Debian's prometheus package) and the Python environment scripts/deps.sh makes
//! in target/monitoring (grafanalib, PyYAML, matplotlib); without them each test prints SKIP, or
//! fails under TESSERA_REQUIRE_RUNTIMES.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tessera_daemon::enforcement::{BreachCount, Metrics, OnDevice, SmTime};
use tessera_daemon::state::ContainerIdentity;
use tessera_daemon::telemetry::prometheus::{FilesystemMetrics, GpuMetrics, GpuSensors, NodeMetrics, PodLabels};
use tessera_daemon::usage::{ContainerUsage, DeviceUsage, UsageReport};

mod common;

use common::which;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace").to_path_buf()
}

fn monitoring() -> PathBuf {
    root().join("deploy/monitoring")
}

fn promtool() -> Option<PathBuf> {
    common::installed("promtool", "Debian package prometheus; scripts/deps.sh installs it")
}

/// The Python of target/monitoring (TESSERA_MONITORING_PYTHON names another), with its packages.
fn python() -> Option<PathBuf> {
    let python = std::env::var_os("TESSERA_MONITORING_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/monitoring/bin/python"));
    let ok = Command::new(&python)
        .args(["-c", "import grafanalib, yaml, matplotlib"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        common::skip(&format!(
            "{} has no grafanalib, PyYAML or matplotlib (scripts/deps.sh makes target/monitoring)",
            python.display()
        ));
        return None;
    }
    Some(python)
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    (out.status.success(), text(&out))
}

/// The alerts of a rules file, in order.
fn alerts(rules: &str) -> Vec<String> {
    rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).map(str::to_string).collect()
}

/// `rules` with the expression of alert `name` replaced by `expr` (a one-line `expr:` or a
/// folded one whose lines are indented deeper).
fn with_expr(rules: &str, name: &str, expr: &str) -> String {
    let mut out = Vec::new();
    let (mut in_alert, mut skipping) = (false, None::<usize>);
    for line in rules.lines() {
        let indent = line.len() - line.trim_start().len();
        if let Some(depth) = skipping {
            if indent > depth && !line.trim().is_empty() {
                continue;
            }
            skipping = None;
        }
        if let Some(alert) = line.trim().strip_prefix("- alert: ") {
            in_alert = alert == name;
        }
        if in_alert && line.trim_start().starts_with("expr:") {
            out.push(format!("{}expr: {expr}", " ".repeat(indent)));
            skipping = Some(indent);
            in_alert = false;
            continue;
        }
        out.push(line.to_string());
    }
    out.join("\n") + "\n"
}

/// `promtool check rules` and `promtool test rules` pass; and the tests have teeth: for each
/// alert, a rule that never fires fails its firing case, and one that always fires fails its
/// quiet case.
#[test]
fn alert_rules_pass_their_promtool_tests_and_the_tests_catch_broken_rules() {
    let Some(promtool) = promtool() else { return };
    let dir = monitoring();
    let (ok, out) = run(Command::new(&promtool).arg("check").arg("rules").arg(dir.join("tessera-rules.yaml")));
    assert!(ok, "promtool check rules:\n{out}");
    let (ok, out) = run(Command::new(&promtool).args(["test", "rules"]).arg(dir.join("tessera-rules.test.yaml")));
    assert!(ok && out.contains("SUCCESS"), "promtool test rules:\n{out}");

    let rules = std::fs::read_to_string(dir.join("tessera-rules.yaml")).unwrap();
    let names = alerts(&rules);
    assert_eq!(names.len(), 11, "{names:?}");
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(dir.join("tessera-rules.test.yaml"), tmp.path().join("tessera-rules.test.yaml")).unwrap();
    for name in &names {
        // vector(1) has no labels: it fires for every quiet case; 'vector(0) > 1' never fires.
        for (expr, what) in [("vector(0) > 1", "never fires"), ("vector(1)", "always fires")] {
            let broken = with_expr(&rules, name, expr);
            assert_ne!(broken, rules, "{name}: its expr was not found");
            std::fs::write(tmp.path().join("tessera-rules.yaml"), &broken).unwrap();
            let (ok, out) =
                run(Command::new(&promtool).args(["test", "rules"]).arg(tmp.path().join("tessera-rules.test.yaml")));
            assert!(!ok, "{name} rewritten so that it {what}: promtool's tests still pass:\n{out}");
            assert!(out.contains(&format!("alertname: {name},")), "{name} ({what}): another case failed:\n{out}");
        }
    }
}

/// The dashboard's JSON, the PrometheusRule and the Helm chart's copies are what
/// deploy/monitoring/generate.py makes of their sources; a stale one is found.
#[test]
fn generated_monitoring_files_are_up_to_date() {
    let Some(python) = python() else { return };
    let generate = monitoring().join("generate.py");
    let (ok, out) = run(Command::new(&python).arg(&generate).arg("--check"));
    assert!(ok, "generate.py --check:\n{out}");

    // A copy of the sources with the dashboard's title changed: the check names the stale files.
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path();
    for dir in ["deploy/monitoring", "deploy/kubernetes/monitoring", "deploy/helm/tessera/files"] {
        std::fs::create_dir_all(copy.join(dir)).unwrap();
        for entry in std::fs::read_dir(root().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.is_file() {
                std::fs::copy(&path, copy.join(dir).join(path.file_name().unwrap())).unwrap();
            }
        }
    }
    // Each source edited in turn (then put back): the check fails naming the files made of it.
    let stale_after = |source: &str, from: &str, to: &str, stale: [&str; 2]| {
        let source = copy.join(source);
        let text = std::fs::read_to_string(&source).unwrap();
        std::fs::write(&source, text.replace(from, to)).unwrap();
        let (ok, out) = run(Command::new(&python).arg(copy.join("deploy/monitoring/generate.py")).arg("--check"));
        assert!(!ok, "{} edited passed the check:\n{out}", source.display());
        for file in stale {
            assert!(out.contains(file), "{file} not named:\n{out}");
        }
        std::fs::write(&source, text).unwrap();
    };
    stale_after(
        "deploy/monitoring/dashboard.py",
        "title=\"Tessera\",",
        "title=\"Tessera (edited)\",",
        ["deploy/monitoring/tessera-dashboard.json", "deploy/helm/tessera/files/tessera-dashboard.json"],
    );
    // And the rules: the PrometheusRule and the chart's copy.
    stale_after(
        "deploy/monitoring/tessera-rules.yaml",
        "for: 10m",
        "for: 15m",
        ["deploy/kubernetes/monitoring/prometheusrule.yaml", "deploy/helm/tessera/files/tessera-rules.yaml"],
    );
}

/// Every family the exporter writes, with every optional label: a managed GPU with its sensors
/// and a holder, a MIG device, a container with limits, enforcement's series, the filesystems
/// and the kubelet's withdrawn devices.
fn everything() -> NodeMetrics {
    let gpu = "GPU-5d3c2f9e-0000-4000-8000-000000000000";
    let on = OnDevice {
        allocation: "a1b2c3d4".into(),
        namespace: "team-a".into(),
        pod: "trainer-0".into(),
        container: "main".into(),
        uuid: gpu.into(),
        device_id: format!("{gpu}::0"),
    };
    let holder = PodLabels { namespace: "team-a".into(), pod: "trainer-0".into(), container: "main".into() };
    NodeMetrics {
        hostname: "node-7".into(),
        gpus: vec![
            GpuMetrics {
                index: 0,
                uuid: gpu.into(),
                model: "NVIDIA H100 80GB HBM3".into(),
                pci_bus_id: "00000000:17:00.0".into(),
                memory_used: 1 << 30,
                memory_total: 80 << 30,
                utilization_percent: Some(40),
                healthy: true,
                sensors: GpuSensors {
                    temperature_c: Some(40),
                    power_mw: Some(100_000),
                    sm_clock_mhz: Some(1980),
                    mem_clock_mhz: Some(2619),
                    ecc_corrected_volatile: Some(0),
                    ecc_uncorrected_volatile: Some(0),
                },
                last_xid: Some(0),
                layout_converged: Some(true),
                ..Default::default()
            },
            GpuMetrics {
                index: 1,
                uuid: "MIG-0b7e0a5c-0000-4000-8000-000000000001".into(),
                model: "NVIDIA H100 80GB HBM3".into(),
                pci_bus_id: "00000000:2A:00.0".into(),
                memory_total: 40 << 30,
                healthy: true,
                mig_profile: Some("3g.40gb".into()),
                parent_uuid: Some("GPU-8a1e44c0-0000-4000-8000-000000000001".into()),
                gpu_instance_id: Some(2),
                holder: Some(holder),
                ..Default::default()
            },
        ],
        usage: UsageReport {
            time_unix_ns: 1,
            containers: vec![ContainerUsage {
                allocation_id: on.allocation.clone(),
                resource: "tessera.io/share".into(),
                container: ContainerIdentity::of_pod("team-a", "trainer-0", "main"),
                processes: 1,
                devices: vec![DeviceUsage {
                    device_id: on.device_id.clone(),
                    uuid: gpu.into(),
                    memory_used: 1 << 30,
                    memory_peak: 2 << 30,
                    memory_limit: Some(8 << 30),
                    sm_limit_percent: Some(30),
                    sm_achieved_percent: 29.5,
                    launches_per_second: 100.0,
                    launches: 1000,
                    gpu_time_ns: 1_000_000_000,
                    throttled_ns: 100_000_000,
                    oom_denials: 1,
                    window_ns: 1_000_000_000,
                }],
            }],
        },
        allocations: 1,
        events_total: 3,
        faults_total: 1,
        enforcement: Metrics {
            breaches: vec![BreachCount { on: on.clone(), action: "kill", limit: "memory", count: 1 }],
            sm_time: vec![SmTime { on, ns: 1, as_of_ns: 1 }],
            unattributed_gpu_processes: 0,
        },
        kubelet_withdrawn: [("tessera.io/share".into(), 0)].into(),
        filesystems: vec![FilesystemMetrics {
            dir: "state_dir".into(),
            path: "/var/lib/tessera".into(),
            avail_bytes: 1 << 30,
            size_bytes: 10 << 30,
        }],
        park: Default::default(),
    }
}

fn check(python: &Path, scrape: &str) -> (bool, String) {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("metrics.txt");
    std::fs::write(&file, scrape).unwrap();
    run(Command::new(python).arg(monitoring().join("check.py")).arg(&file))
}

/// Every series and label the rules, the dashboard's panels, annotations and variables query is
/// one tesserad's exporter writes; the rules' test series are labelled as it labels them; each
/// alert has a firing and a quiet case; the PrometheusRule holds the plain file's rules. Without
/// one family in the scrape, or with a label renamed, the check fails naming it.
#[test]
fn every_query_names_a_series_tesserad_exports() {
    let Some(python) = python() else { return };
    let scrape = tessera_daemon::telemetry::render(&everything());
    let (ok, out) = check(&python, &scrape);
    assert!(ok, "check.py:\n{out}");
    println!("{out}");
    assert!(out.contains("11 alerts tested, 0 problems"), "{out}");

    // The check can fail: a family the queries use, gone from the scrape.
    let without: String = scrape
        .lines()
        .filter(|l| !l.contains("tessera_container_throttled_seconds_total"))
        .map(|l| format!("{l}\n"))
        .collect();
    let (ok, out) = check(&python, &without);
    assert!(!ok, "{out}");
    assert!(out.contains("rule TesseraAllocationThrottled: tessera_container_throttled_seconds_total is not a series tesserad exports"), "{out}");
    assert!(out.contains("panel 'Throttled time'"), "{out}");
    assert!(out.contains("test series tessera_container_throttled_seconds_total"), "{out}");
    // A label the exporter does not write (the pod's label renamed).
    let renamed = scrape.replace("pod=\"", "pod_name=\"");
    let (ok, out) = check(&python, &renamed);
    assert!(!ok, "{out}");
    assert!(out.contains("label pod is on no series tesserad exports"), "{out}");
}

/// What `kubectl kustomize deploy/kubernetes/monitoring` and the Helm chart with
/// `monitoring.*.create=true` install: the rules of the plain file in a PrometheusRule, the
/// dashboard's JSON in a ConfigMap Grafana's sidecar loads, and a ServiceMonitor that names the
/// job as the rules expect; with the chart's defaults, none of them.
#[test]
fn kustomize_and_helm_install_the_rules_and_the_dashboard() {
    let Some(python) = python() else { return };
    let kubectl = which("kubectl");
    let helm = Some(root().join("target/helm/v4.3.2/helm")).filter(|p| p.is_file()).or_else(|| which("helm"));
    let (Some(kubectl), Some(helm)) = (kubectl, helm) else {
        common::skip("kubectl or helm is missing (scripts/deps.sh installs kubectl and builds Helm into target/helm)");
        return;
    };
    const CHECK: &str = r#"
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
rules = yaml.safe_load(open(sys.argv[1]))
dash = open(sys.argv[2]).read()
kinds = sorted(d["kind"] for d in docs if d["kind"] in ("PrometheusRule", "ServiceMonitor") or d["metadata"]["name"] == "tessera-dashboard")
if sys.argv[3] == "none":
    assert kinds == [], kinds
    sys.exit(0)
assert kinds == ["ConfigMap", "PrometheusRule", "ServiceMonitor"], kinds
pr = next(d for d in docs if d["kind"] == "PrometheusRule")
assert pr["spec"] == rules, "the PrometheusRule's rules differ from tessera-rules.yaml"
cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tessera-dashboard")
assert cm["metadata"]["labels"]["grafana_dashboard"] == "1", cm["metadata"]
assert json.loads(cm["data"]["tessera-dashboard.json"]) == json.loads(dash), "the dashboard differs"
sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
assert sm["spec"]["jobLabel"] == "app.kubernetes.io/name", sm["spec"]
print("ok")
"#;
    let check = |yaml: &[u8], want: &str| {
        let mut child = Command::new(&python)
            .arg("-c")
            .arg(CHECK)
            .arg(monitoring().join("tessera-rules.yaml"))
            .arg(monitoring().join("tessera-dashboard.json"))
            .arg(want)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write as _;
        child.stdin.take().unwrap().write_all(yaml).unwrap();
        let out = child.wait_with_output().unwrap();
        (out.status.success(), text(&out))
    };
    let kustomized =
        Command::new(&kubectl).arg("kustomize").arg(root().join("deploy/kubernetes/monitoring")).output().unwrap();
    assert!(kustomized.status.success(), "{}", text(&kustomized));
    let (ok, out) = check(&kustomized.stdout, "all");
    assert!(ok, "kustomize: {out}");

    let chart = root().join("deploy/helm/tessera");
    let helm_template = |sets: &[&str]| {
        let mut cmd = Command::new(&helm);
        cmd.args(["template", "tessera"]).arg(&chart).args(["--namespace", "tessera-system"]);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "helm template {sets:?}: {}", text(&out));
        out.stdout
    };
    let all = helm_template(&[
        "monitoring.serviceMonitor.create=true",
        "monitoring.rules.create=true",
        "monitoring.dashboard.create=true",
    ]);
    let (ok, out) = check(&all, "all");
    assert!(ok, "helm: {out}");
    let (ok, out) = check(&helm_template(&[]), "none");
    assert!(ok, "helm defaults: {out}");
    // The check can fail: the chart's copy of the rules edited.
    let (ok, _) = check(&String::from_utf8(all).unwrap().replacen("for: 5m", "for: 6m", 1).into_bytes(), "all");
    assert!(!ok, "an edited PrometheusRule passed");
}
