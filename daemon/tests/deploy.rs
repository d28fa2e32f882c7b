//! The deployment files in deploy/: the systemd unit is a valid Type=notify unit that reloads
//! with SIGHUP (checked by systemd-analyze when the machine has it, against the built binary),
//! and the DaemonSet's embedded configuration is one tesserad accepts, with the kubelet's
//! device-plugin directory mounted where that configuration says.

use std::path::Path;

use tessera_daemon::config::Config;
use tessera_hook::paths;

mod common;

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
