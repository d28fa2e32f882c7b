//! The deployment files in deploy/: the systemd unit is a valid Type=notify unit that reloads
//! with SIGHUP (checked by systemd-analyze when the machine has it, against the built binary),
//! and the DaemonSet's embedded configuration is one tesserad accepts, with the kubelet's
//! device-plugin directory mounted where that configuration says.

use std::path::Path;

use tessera_daemon::config::Config;

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
    assert!(exec.contains("tesserad --config /etc/tessera/config.toml"), "{exec}");
    let Ok(out) = std::process::Command::new("systemd-analyze").arg("--version").output() else {
        println!("SKIP systemd-analyze verify: systemd-analyze is not installed");
        return;
    };
    assert!(out.status.success());
    // Verify a copy that points at the built daemon (the unit names the installed path).
    let tmp = tempfile::tempdir().expect("tempdir");
    let copy = tmp.path().join("tesserad.service");
    let daemon = tessera_sim_testkit::binary("tesserad");
    std::fs::write(&copy, unit.replace("/usr/local/bin/tesserad", &daemon.display().to_string())).expect("copy");
    let out = std::process::Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .expect("systemd-analyze");
    let text = String::from_utf8_lossy(&out.stderr);
    // Only complaints about this unit count (the host's own units may have their own).
    let ours: Vec<&str> = text.lines().filter(|l| l.contains("tesserad.service")).collect();
    assert!(ours.is_empty(), "systemd-analyze verify:\n{text}");
}

#[test]
fn daemonset_config_is_valid_and_mounts_what_it_names() {
    let yaml = deploy("kubernetes/daemonset.yaml");
    // The ConfigMap's config.toml: the indented block after `config.toml: |`.
    let start = yaml.find("config.toml: |").expect("config.toml in the ConfigMap");
    let block: Vec<&str> = yaml[start..]
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("    ") || l.trim().is_empty())
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect();
    let config = Config::parse(&block.join("\n")).unwrap_or_else(|e| panic!("embedded config: {e}"));
    for (path, what) in [
        (config.device_plugin_dir.to_str().expect("utf-8").trim_end_matches('/'), "device-plugin dir"),
        (config.state_dir.to_str().expect("utf-8"), "state dir"),
        (config.runtime_dir.to_str().expect("utf-8"), "runtime dir"),
    ] {
        assert!(yaml.contains(&format!("mountPath: {path}")), "the {what} {path} is not mounted");
        assert!(yaml.contains(&format!("path: {path}")), "the {what} {path} is not a hostPath");
    }
    assert!(yaml.contains("\"--config\", \"/etc/tessera/config.toml\""));
    assert!(yaml.contains("mountPath: /etc/tessera"));
}
