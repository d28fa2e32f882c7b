//! The container's limit across its processes: concurrent allocation, SIGKILLed processes, and
//! failing closed on a bad config.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::*;
use serde_json::Value;
use tessera_sim_model::Node;
use tessera_sim_testkit::binary;

#[test]
fn processes_of_one_container_never_pass_the_limit_together() {
    let node = node();
    let limit = 4 * GIB;
    let chunk = 64 * MIB;
    let c = Container::new(&memory_limits(limit));
    let region = c.region();
    let lookups = ["linked", "dlsym", "getprocaddress"];
    let n = 6;
    // All start at once and race for the same 4 GiB in 64 MiB steps, each wanting 1 GiB.
    let mut kids: Vec<_> = (0..n)
        .map(|i| {
            c.command(&node, binary("tessera-workload"))
                .args(["--lookup", lookups[i % 3], "--alloc-mib", "1024", "--chunk-mib", "64", "--hold", "30"])
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    let (mut held, mut contexts) = (0, 0);
    for k in &mut kids {
        let line = BufReader::new(k.stdout.take().unwrap()).lines().next().expect("a line").unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        match v["holding"].as_u64() {
            Some(h) => {
                held += h;
                contexts += 1;
            }
            // Late starters may find the limit full before their context fits: refused cleanly.
            None => assert_eq!(v["error"]["name"], "CUDA_ERROR_OUT_OF_MEMORY", "{line}"),
        }
    }
    // Each takes at most 1 GiB and its context: at least three fit.
    assert!(contexts >= 3, "{contexts} of {n} got a context");
    let total = held + contexts * OVERHEAD_MIB * MIB;
    assert!(total <= limit, "the container holds {total} of {limit}");
    // Every refusal was for a chunk or a context that did not fit in what was left.
    assert!(total > limit - chunk.max(OVERHEAD_MIB * MIB), "they filled the limit: {total} of {limit}");
    assert_eq!(region.used(0), total, "the region counts what they hold");
    let model = Node::open_state(&node.state, None).unwrap();
    assert_eq!(model.memory_info(0, 0).unwrap().used, total, "the GPU holds exactly that");
    for mut k in kids {
        k.kill().unwrap();
        k.wait().unwrap();
    }
}

/// Starts a workload in `c` that holds `mib` on device 0.
fn hold(c: &Container, node: &tessera_sim_testkit::SimNode, mib: &str) -> std::process::Child {
    holding(c.command(node, binary("tessera-workload")), &["--alloc-mib", mib, "--hold", "60"]).0
}

#[test]
fn a_sigkilled_processs_memory_comes_back_within_a_second() {
    let node = node();
    let limit = 3 * GIB;
    let c = Container::new(&memory_limits(limit));
    let mut a = hold(&c, &node, "2048");
    let (code, r, _) = workload(&c, &node, &["--alloc-mib", "2048"]);
    assert_eq!(code, 3, "A holds 2 GiB of 3: {r}");

    // Reclaimed by the next allocation that does not fit.
    a.kill().unwrap();
    a.wait().unwrap();
    let (code, r, stderr) = workload(&c, &node, &["--alloc-mib", "2048"]);
    assert_eq!(code, 0, "A's 2 GiB came back: {r}\n{stderr}");

    // Reclaimed by cuMemGetInfo.
    let mut a = hold(&c, &node, "2048");
    a.kill().unwrap();
    a.wait().unwrap();
    let (code, r, _) = workload(&c, &node, &["--alloc-mib", "0"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["mem_free_before"].as_u64().unwrap(), limit - OVERHEAD_MIB * MIB, "A's usage is gone: {r}");
    let region = c.region();
    region.reap();
    assert_eq!(region.used(0), 0);
}

/// Runs the workload with `env` and checks that CUDA was refused with exactly one line naming
/// `what` on stderr.
fn refused(node: &tessera_sim_testkit::SimNode, env: &[(&str, &std::ffi::OsStr)], what: &str) {
    for lookup in ["linked", "dlsym", "getprocaddress"] {
        let out = node
            .command(binary("tessera-workload"))
            .env("LD_PRELOAD", shim())
            .envs(env.iter().copied())
            .args(["--lookup", lookup, "--alloc-mib", "64"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let r: Value = serde_json::from_slice(out.stdout.trim_ascii_end()).unwrap_or_else(|e| panic!("{e}: {stderr}"));
        assert_eq!(out.status.code(), Some(1), "{lookup}: {r}");
        assert_eq!(r["error"]["call"], "cuInit", "{lookup}: {r}");
        assert_eq!(r["error"]["name"], "CUDA_ERROR_NOT_PERMITTED", "{lookup}: {r}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{lookup}: exactly one line: {stderr}");
        assert!(
            lines[0].starts_with(&format!("tessera: {what}: ")) && lines[0].ends_with("; CUDA disabled"),
            "{lookup}: {}",
            lines[0]
        );
    }
}

#[test]
fn a_bad_config_fails_closed_with_one_line() {
    let node = node();
    // Malformed: a size that is not one.
    let c = Container::with_limits_text("version = 1\n[[devices]]\nuuid = \"*\"\nmemory_limit = \"lots\"\n");
    let env = c.env();
    let limits = c.limits.display().to_string();
    refused(&node, &[("TESSERA_LIMITS", env[1].1.as_os_str()), ("TESSERA_REGION", env[2].1.as_os_str())], &limits);
    // Not TOML.
    let c = Container::with_limits_text("this is { not toml");
    let limits = c.limits.display().to_string();
    refused(&node, &[("TESSERA_LIMITS", c.limits.as_os_str())], &limits);
    // Unreadable: not there at all.
    let missing = c.limits.with_file_name("missing");
    refused(&node, &[("TESSERA_LIMITS", missing.as_os_str())], &missing.display().to_string());
    // A bad variable for standalone use.
    refused(&node, &[("TESSERA_MEMORY_LIMIT", std::ffi::OsStr::new("8QB"))], "TESSERA_MEMORY_LIMIT");
}
