use super::*;

fn err(text: &str) -> ConfigError {
    Config::parse(text).expect_err("should be refused")
}

#[track_caller]
fn refused(text: &str, key: &str, reason_part: &str) {
    let e = err(text);
    assert_eq!(e.key, key, "{e}");
    assert!(e.reason.contains(reason_part), "reason {:?} lacks {reason_part:?}", e.reason);
}

#[test]
fn empty_file_is_the_defaults() {
    let c = Config::parse("").unwrap();
    assert_eq!(c, Config::default());
    assert_eq!(c.nvml_library, None);
    assert_eq!(c.device_plugin_dir, PathBuf::from("/var/lib/kubelet/device-plugins/"));
    assert_eq!(c.node_api_socket(), PathBuf::from("/run/tessera/tessera.sock"));
    assert_eq!(c.resources.prefix, "tessera.io");
    assert_eq!(c.resources.share_placement, Placement::Packed);
    assert_eq!(c.telemetry, Telemetry { metrics_listen: None, otlp_endpoint: None }, "nothing listens by default");
    assert!(c.health.enabled);
    assert!(c.partitions.is_empty());
}

const FULL: &str = r#"
nvml_library = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
sim = false
device_plugin_dir = "/tmp/dp"
state_dir = "/var/lib/tessera"
runtime_dir = "/run/tessera"
node_api_socket = "/run/tessera/api.sock"

[resources]
prefix = "gpu.example.com"
share_placement = "spread"

[telemetry]
metrics_listen = "127.0.0.1:9400"
otlp_endpoint = "http://collector:4317"

[health]
enabled = true
interval_seconds = 10
ignored_xids = [13, 31]

[limits]
compute_mode = "work-conserving"
priority = "low"

[partitions.default]
whole = true

[partitions.0]
mig = { "1g.10gb" = 7 }

[partitions.1]
mig = { "3g.40gb" = 2 }
mig_shares = { "3g.40gb" = { count = 2 } }

[partitions.2]
shares = { count = 4 }

[[partitions."GPU-1803e5e2-5c0c-53ac-8346-7fc75c124149".shares]]
memory = "20GiB"
sm_percent = 25

[[partitions."GPU-1803e5e2-5c0c-53ac-8346-7fc75c124149".shares]]
memory = "1073741824B"
"#;

#[test]
fn every_option_parses() {
    let c = Config::parse(FULL).unwrap();
    assert_eq!(c.resources.share_placement, Placement::Spread);
    assert_eq!(c.telemetry.metrics_listen.as_deref(), Some("127.0.0.1:9400"));
    assert_eq!(c.partitions["default"].kind(), Some(PartitionKind::Whole));
    assert!(
        matches!(c.partitions["0"].kind(), Some(PartitionKind::Mig { profiles, shares: None }) if profiles["1g.10gb"] == 7)
    );
    assert!(
        matches!(c.partitions["1"].kind(), Some(PartitionKind::Mig { shares: Some(s), .. }) if s["3g.40gb"] == SharesSpec::Equal { count: 2 })
    );
    assert_eq!(c.partitions["2"].shares, Some(SharesSpec::Equal { count: 4 }));
    let uuid = "GPU-1803e5e2-5c0c-53ac-8346-7fc75c124149";
    let SharesSpec::Explicit(list) = c.partitions[uuid].shares.as_ref().unwrap() else { panic!() };
    assert_eq!(list[0], ShareSize { memory: Some(ByteSize(20 << 30)), sm_percent: Some(25) });
    assert_eq!(list[1].memory, Some(ByteSize(1 << 30)));
    // By UUID before index before default.
    assert_eq!(c.partition_for(0, uuid).unwrap().0, uuid);
    assert_eq!(c.partition_for(0, "GPU-x").unwrap().0, "0");
    assert_eq!(c.partition_for(5, "GPU-x").unwrap().0, "default");
    // It survives a round trip (what reload diffs).
    let again = Config::parse(&toml::to_string(&c).unwrap()).unwrap();
    assert_eq!(again, c);
}

#[test]
fn syntax_errors_name_the_key() {
    refused("colour = 1\n", "colour", "unknown field");
    refused("[health]\nintervall = 3\n", "health.intervall", "unknown field");
    refused("[health]\ninterval_seconds = \"soon\"\n", "health.interval_seconds", "invalid type");
    refused("[resources]\nshare_placement = \"random\"\n", "resources.share_placement", "unknown variant");
    refused("[partitions.0]\nmig = { \"1g.10gb\" = -1 }\n", "partitions.0.mig", "");
    refused("[partitions.0]\nwhole = true\nmigs = {}\n", "partitions.0.migs", "unknown field");
    refused("[partitions.0]\nshares = { count = 2, size = 3 }\n", "partitions.0.shares", "unknown field");
    refused("[[partitions.0.shares]]\nmemory = \"20QB\"\n", "partitions.0.shares.memory", "not a size");
    let e = err("sim = 1\n");
    assert!(e.to_string().starts_with("sim: "), "{e}");
}

#[test]
fn semantic_errors_name_the_key() {
    refused("nvml_library = \"\"\n", "nvml_library", "empty");
    refused("state_dir = \"var/tessera\"\n", "state_dir", "absolute");
    refused("device_plugin_dir = \"dp\"\n", "device_plugin_dir", "absolute");
    refused("runtime_dir = \"run\"\n", "runtime_dir", "absolute");
    refused(&format!("node_api_socket = \"/{}\"\n", "x".repeat(120)), "node_api_socket", "longer");
    refused("[resources]\nprefix = \"Tessera\"\n", "resources.prefix", "DNS");
    refused("[telemetry]\nmetrics_listen = \"9400\"\n", "telemetry.metrics_listen", "listen address");
    refused("[telemetry]\notlp_endpoint = \"collector:4317\"\n", "telemetry.otlp_endpoint", "http");
    refused("[health]\ninterval_seconds = 0\n", "health.interval_seconds", "1..=3600");
    refused("[injection]\ncdi_version = \"1.0\"\n", "injection.cdi_version", "0.6.0");
    refused("[injection]\ncdi_spec_dir = \"cdi\"\n", "injection.cdi_spec_dir", "absolute");
    refused("[injection]\ndev_root = \"dev\"\n", "injection.dev_root", "absolute");
    refused("[injection]\nhost_driver_root = \"driver\"\n", "injection.host_driver_root", "absolute");
    refused("[injection]\nshim_path = \"lib/libtessera.so\"\n", "injection.shim_path", "absolute");
    assert!(Config::parse("[injection]\ncdi_spec_dir = \"\"\nshim_path = \"\"\n").is_ok(), "empty turns them off");
    refused("[injection]\ndriver_dir = \"no\"\n", "injection.driver_dir", "invalid type");
    refused("[limits]\ncompute_mode = \"fair\"\n", "limits.compute_mode", "strict");
    refused("[limits]\npriority = \"urgent\"\n", "limits.priority", "normal");
    refused("[partitions.gpu0]\nwhole = true\n", "partitions.gpu0", "GPU index");
    refused("[partitions.MIG-abc]\nwhole = true\n", "partitions.MIG-abc", "per GPU");
    refused("[partitions.0]\n", "partitions.0", "declares no partition");
    refused("[partitions.0]\nwhole = true\nshares = { count = 2 }\n", "partitions.0", "whole and shares");
    refused("[partitions.0]\nmig = { \"big\" = 1 }\n", "partitions.0.mig.big", "not a MIG profile name");
    refused("[partitions.0]\nmig = { \"1g.10gb\" = 0 }\n", "partitions.0.mig.\"1g.10gb\"", "count is 0");
    refused("[partitions.0]\nmig = { \"1g.10gb\" = 9 }\n", "partitions.0.mig.\"1g.10gb\"", "more than 7");
    refused(
        "[partitions.0]\nmig = { \"1g.10gb\" = 1 }\nmig_shares = { \"3g.40gb\" = { count = 2 } }\n",
        "partitions.0.mig_shares.\"3g.40gb\"",
        "not in partitions.0.mig",
    );
    refused(
        "[partitions.0]\nmig_shares = { \"3g.40gb\" = { count = 2 } }\n",
        "partitions.0.mig_shares",
        "needs a `mig`",
    );
    refused("[partitions.0]\nshares = { count = 0 }\n", "partitions.0.shares.count", "1..=100");
    refused("[partitions.0]\nshares = []\n", "partitions.0.shares", "empty list");
    let over = "[[partitions.0.shares]]\nsm_percent = 60\n[[partitions.0.shares]]\nsm_percent = 50\n";
    refused(over, "partitions.0.shares.sm_percent", "sum to 110");
    let none_left = "[[partitions.0.shares]]\nsm_percent = 100\n[[partitions.0.shares]]\nmemory = \"1GiB\"\n";
    refused(none_left, "partitions.0.shares.sm_percent", "0 percent is left for 1");
    refused("[[partitions.0.shares]]\nsm_percent = 101\n", "partitions.0.shares[0].sm_percent", "1..=100");
    refused("[[partitions.0.shares]]\nmemory = \"0B\"\n", "partitions.0.shares[0].memory", "0 bytes");
    refused("[[partitions.0.shares]]\nmemory = 8\n", "partitions.0.shares.memory", "8 has no unit");
    refused("[[partitions.0.shares]]\nmemory = \"8\"\n", "partitions.0.shares.memory", "has no unit");
}

#[test]
fn the_driver_directory_is_on_by_default_and_can_be_turned_off() {
    assert!(Config::default().injection.driver_dir);
    let off = Config::parse("[injection]\ndriver_dir = false\n").unwrap();
    assert!(!off.injection.driver_dir);
    let r = reload(&Config::default(), &off);
    assert_eq!(r.needs_restart().collect::<Vec<_>>(), ["injection.driver_dir"], "read at start only");
    assert!(r.effective.injection.driver_dir);
}

#[test]
fn load_names_the_file_and_a_missing_default_is_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.toml");
    assert_eq!(Config::load(&p, false).unwrap(), Config::default());
    assert!(Config::load(&p, true).is_err());
    std::fs::write(&p, "[health]\ninterval_seconds = 0\n").unwrap();
    let e = Config::load(&p, true).unwrap_err();
    assert_eq!(e.path.as_deref(), Some(p.as_path()));
    assert!(e.to_string().starts_with(&format!("{}: health.interval_seconds: ", p.display())), "{e}");
}

#[test]
fn reload_tells_live_from_restart() {
    let old = Config::parse(FULL).unwrap();
    let text = FULL
        .replace("runtime_dir = \"/run/tessera\"", "runtime_dir = \"/run/tessera2\"")
        .replace("interval_seconds = 10", "interval_seconds = 20")
        .replace("mig = { \"1g.10gb\" = 7 }", "mig = { \"1g.10gb\" = 3 }")
        .replace("share_placement = \"spread\"", "share_placement = \"packed\"")
        .replace("metrics_listen = \"127.0.0.1:9400\"", "metrics_listen = \"127.0.0.1:9500\"");
    let new = Config::parse(&text).unwrap();
    let r = reload(&old, &new);
    let live: Vec<&str> = r.live().collect();
    let restart: Vec<&str> = r.needs_restart().collect();
    assert_eq!(live, vec!["health.interval_seconds", "partitions.0.mig.\"1g.10gb\"", "resources.share_placement"]);
    assert_eq!(restart, vec!["runtime_dir", "telemetry.metrics_listen"]);
    assert_eq!(r.effective.health.interval_seconds, 20);
    assert_eq!(r.effective.partitions, new.partitions);
    assert_eq!(r.effective.runtime_dir, old.runtime_dir, "paths wait for a restart");
    assert_eq!(r.effective.telemetry, old.telemetry);
    assert!(reload(&old, &old).changes.is_empty());
}

#[test]
fn reset_policy_per_gpu_then_default_then_never() {
    let c = Config::parse(
        "[partitions.default]\nwhole = true\nreset = \"when-free\"\n[partitions.1]\nmig = {}\nreset = \"never\"\n[partitions.2]\nmig = {}\n",
    )
    .expect("parses");
    assert_eq!(c.reset_policy(0, "GPU-a"), ResetPolicy::WhenFree, "the default entry's");
    assert_eq!(c.reset_policy(1, "GPU-b"), ResetPolicy::Never, "the GPU's own entry wins");
    assert_eq!(c.reset_policy(2, "GPU-c"), ResetPolicy::WhenFree, "unset in the GPU's entry: the default's");
    let c = Config::parse("[partitions.0]\nmig = {}\n").expect("parses");
    assert_eq!(c.reset_policy(0, "GPU-a"), ResetPolicy::Never, "opt-in only");
    refused("[partitions.0]\nwhole = true\nreset = \"always\"\n", "partitions.0.reset", "unknown variant");
}

#[test]
fn max_allocations_defaults_to_1024_and_0_is_refused() {
    assert_eq!(Config::parse("").unwrap().limits.max_allocations, 1024);
    assert_eq!(Config::parse("[limits]\nmax_allocations = 5\n").unwrap().limits.max_allocations, 5);
    refused("[limits]\nmax_allocations = 0\n", "limits.max_allocations", "at least 1");
}
