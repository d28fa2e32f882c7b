//! tesserad's log lines fit journald and `kubectl logs`: with stderr not a terminal, no ANSI
//! colour codes and no Rust debug forms (`Some(…)`, tuples) in what it logs about the node;
//! `--log-format json` (or `log_format = "json"`) gives one JSON object per line.

mod common;

use std::process::Output;

use tessera_sim_testkit::SimNode;

/// `tesserad --once` on a simulated node (one GPU in MIG mode, one whole), stderr captured.
fn once(node: &SimNode, dir: &std::path::Path, body: &str, extra: &[&str]) -> Output {
    let config = common::write_config(node, dir, body);
    node.command(tessera_sim_testkit::binary("tesserad"))
        .arg("--config")
        .arg(&config)
        .arg("--once")
        .args(extra)
        .output()
        .expect("run tesserad")
}

const NODE: &str = r#"
[[gpu]]
model = "H100-SXM5-80GB"
mig = true
[[gpu]]
model = "H100-SXM5-80GB"
"#;

#[test]
fn text_logs_have_no_colours_and_no_debug_forms() {
    let node = SimNode::with_description(NODE);
    let dir = tempfile::tempdir().expect("tempdir");
    let out = once(&node, dir.path(), "", &[]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("GPU"), "the inventory is logged:\n{log}");
    assert!(!log.contains('\u{1b}'), "ANSI escape codes on a pipe:\n{log}");
    for debug_form in ["Some(", "None", "((", "[]", "{ "] {
        assert!(!log.contains(debug_form), "Rust debug form {debug_form:?} in:\n{log}");
    }
    assert!(log.contains("mig=on (0 instances)") || log.contains("mig=on ("), "MIG state in words:\n{log}");
}

#[test]
fn json_logs_are_one_object_per_line_from_the_flag_or_the_config() {
    let node = SimNode::with_description(NODE);
    for (body, extra) in [("", &["--log-format", "json"][..]), ("log_format = \"json\"", &[][..])] {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = once(&node, dir.path(), body, extra);
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{log}");
        let lines: Vec<&str> = log.lines().collect();
        assert!(lines.len() >= 3, "{log}");
        for line in &lines {
            let v: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not one JSON object ({e}): {line}"));
            assert!(v["level"].is_string() && v["message"].is_string() && v["timestamp"].is_string(), "{line}");
        }
        let gpu = lines
            .iter()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|v| v["message"] == "GPU")
            .unwrap_or_else(|| panic!("no GPU line in {log}"));
        assert_eq!(gpu["index"], 0, "fields are JSON values: {gpu}");
    }
    // A format tesserad does not know is refused, naming the choices.
    let dir = tempfile::tempdir().expect("tempdir");
    let out = once(&node, dir.path(), "log_format = \"xml\"", &[]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && log.contains("log_format") && log.contains("text"), "{log}");
}
