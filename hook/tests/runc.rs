//! runc directly: the OCI hook in config.json, and the runtime wrapper in front of runc.
//! Each container checks from inside what it sees; hostile images prove nothing escapes.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

enum Via<'a> {
    Plain,
    Wrapper(&'a Node),
}

impl<'a> Via<'a> {
    /// The hook (which the bundle's config.json names: plain runc), or the wrapper in front of runc.
    fn hook_or_wrapper(via_hook: bool, node: &'a Node) -> Via<'a> {
        if via_hook { Via::Plain } else { Via::Wrapper(node) }
    }
}

fn runc(base: &Path, bundle: &Path, id: &str, via: Via<'_>) -> Output {
    let id = format!("{id}-{}", std::process::id());
    let mut cmd = match via {
        Via::Plain => Command::new("runc"),
        Via::Wrapper(node) => {
            let mut c = Command::new(WRAPPER);
            c.env("TESSERA_HOOK_CONFIG", &node.config);
            c
        }
    };
    cmd.arg("--root").arg(base.join("runc-state")).arg("run").arg("--bundle").arg(bundle).arg(&id);
    cmd.stdin(std::process::Stdio::null());
    cmd.output().expect("run runc")
}

/// runc is here and can run a plain container; else a SKIP line.
fn runc_works(base: &Path) -> bool {
    if !is_root() {
        return skip("runc tests need root");
    }
    if which("runc").is_none() {
        return skip("runc is not installed (Debian package runc)");
    }
    let Some(rootfs) = busybox_rootfs(&base.join("probe-rootfs")) else { return false };
    let b = bundle(&base.join("probe"), &rootfs, "echo ok", &[], None);
    let out = runc(base, &b, "probe", Via::Plain);
    if !(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok")) {
        return skip(&format!("runc cannot run containers here: {}", text(&out)));
    }
    true
}

/// `node`, when runc can run containers here ([`runc_works`]; else `None`, skipped).
fn runc_ready(node: Node) -> Option<Node> {
    runc_works(node.path()).then_some(node)
}

/// A runc test's start: a fresh node and a busybox root file system in it ([`runc_ready`]).
fn runc_test() -> Option<(Node, PathBuf)> {
    let node = runc_ready(Node::new())?;
    let rootfs = busybox_rootfs(&node.path().join("rootfs")).unwrap();
    Some((node, rootfs))
}

/// A bundle `b-NAME` of [`PROBE`] on `rootfs` asking for GPU 0, its hook in config.json when
/// `via_hook` (else for the wrapper to add).
fn probe_bundle(node: &Node, rootfs: &Path, name: &str, via_hook: bool) -> PathBuf {
    bundle(&node.path().join(format!("b-{name}")), rootfs, PROBE, ASK_GPU0, via_hook.then_some(node))
}

/// Runs the bundle `b` as container `id` through `via`, which must succeed: what it printed.
fn run_ok(node: &Node, b: &Path, id: &str, via: Via<'_>) -> String {
    let out = runc(node.path(), b, id, via);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    all
}

const ASK_GPU0: &[&str] = &["TESSERA_VISIBLE_DEVICES=0", "TESSERA_ALLOCATION=a1"];

#[test]
fn hook_injects_exactly_the_allocated_gpu() {
    let Some((node, rootfs)) = runc_test() else { return };
    let b = bundle(&node.path().join("b"), &rootfs, PROBE, ASK_GPU0, Some(&node));
    let all = run_ok(&node, &b, "hook-gpu0", Via::Plain);
    assert_gpu0(&all);
}

#[test]
fn wrapper_injects_exactly_the_allocated_gpu_and_env() {
    let Some((node, rootfs)) = runc_test() else { return };
    let b = bundle(&node.path().join("b"), &rootfs, PROBE, ASK_GPU0, None);
    let all = run_ok(&node, &b, "wrap-gpu0", Via::Wrapper(&node));
    assert_gpu0(&all);
    assert_eq!(
        lines(&all, "env "),
        [format!("env TESSERA_LIMITS=/run/tessera/alloc/limits TESSERA_ALLOCATION=a1 TESSERA_VISIBLE_DEVICES={GPU0}")],
        "{all}"
    );
}

#[test]
fn mig_device_gets_its_caps_node() {
    let Some((node, rootfs)) = runc_test() else { return };
    let env = ["TESSERA_VISIBLE_DEVICES=1:0", "TESSERA_ALLOCATION=a-mig"];
    let b = bundle(&node.path().join("b"), &rootfs, PROBE, &env, Some(&node));
    let all = run_ok(&node, &b, "hook-mig", Via::Plain);
    assert_eq!(
        lines(&all, "node "),
        [
            "node /dev/nvidia-uvm eb:0",
            "node /dev/nvidia-uvm-tools eb:1",
            "node /dev/nvidia1 c3:1",
            "node /dev/nvidiactl c3:ff",
            "node /dev/nvidia-caps/nvidia-cap21 ec:15",
        ],
        "{all}"
    );
    assert!(lines(&all, "open1 ")[0].contains("No such device or address"), "{all}");
}

#[test]
fn unallocated_device_is_refused_by_hook_and_wrapper() {
    let Some((node, rootfs)) = runc_test() else { return };
    let env = ["TESSERA_VISIBLE_DEVICES=1", "TESSERA_ALLOCATION=a1"];
    let marker = "echo STARTED";
    let b = bundle(&node.path().join("b1"), &rootfs, marker, &env, Some(&node));
    let out = runc(node.path(), &b, "hook-refused", Via::Plain);
    let all = text(&out);
    assert!(!out.status.success() && !all.contains("STARTED"), "{all}");
    // runc quotes the hook's stderr in its own log line.
    let unquoted = all.replace("\\\"", "\"");
    assert!(
        unquoted.contains(&format!("tessera-hook: TESSERA_VISIBLE_DEVICES: device \"{GPU1}\" is not allocated")),
        "{all}"
    );

    let b = bundle(&node.path().join("b2"), &rootfs, marker, &env, None);
    let before = std::fs::read(b.join("config.json")).unwrap();
    let out = runc(node.path(), &b, "wrap-refused", Via::Wrapper(&node));
    let all = text(&out);
    assert!(!out.status.success() && !all.contains("STARTED"), "{all}");
    assert!(all.contains("tessera-runtime: TESSERA_VISIBLE_DEVICES: device"), "{all}");
    assert_eq!(std::fs::read(b.join("config.json")).unwrap(), before, "config.json left as it was");

    // No allocation named: refused.
    let b = bundle(&node.path().join("b3"), &rootfs, marker, &["TESSERA_VISIBLE_DEVICES=0"], Some(&node));
    let out = runc(node.path(), &b, "hook-noalloc", Via::Plain);
    let all = text(&out);
    assert!(!out.status.success() && all.contains("no allocation is named"), "{all}");
}

#[test]
fn container_without_request_is_untouched() {
    let Some((node, rootfs)) = runc_test() else { return };
    // Even a broken spec on the node does not stop a container that asks for nothing.
    std::fs::write(node.cdi.join("tessera.io-gpu.json"), "{").unwrap();
    for (i, via_hook) in [true, false].into_iter().enumerate() {
        let b = bundle(&node.path().join(format!("b{i}")), &rootfs, PROBE, &[], via_hook.then_some(&node));
        let before = std::fs::read(b.join("config.json")).unwrap();
        let out = runc(node.path(), &b, &format!("plain-{via_hook}"), Via::hook_or_wrapper(via_hook, &node));
        let all = text(&out);
        assert!(out.status.success(), "{all}");
        assert!(lines(&all, "node ").is_empty() && lines(&all, "file ").is_empty(), "{all}");
        assert_eq!(std::fs::read(b.join("config.json")).unwrap(), before);
    }
    assert!(!rootfs.join("etc/ld.so.preload").exists());
}

#[test]
fn malformed_inputs_fail_the_start_with_one_line() {
    let Some((node, rootfs)) = runc_test() else { return };
    // Containers that print STARTED if they ever start, for the wrapper (no hook in config.json).
    let for_wrapper = |name: &str, env: &[&str]| bundle(&node.path().join(name), &rootfs, "echo STARTED", env, None);
    // A bad annotation value.
    let b = bundle(&node.path().join("b1"), &rootfs, "echo STARTED", &["TESSERA_ALLOCATION=a1"], Some(&node));
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    c["annotations"] = serde_json::json!({"cdi.k8s.io/x": "tessera.io/gpu"});
    std::fs::write(b.join("config.json"), c.to_string()).unwrap();
    let out = runc(node.path(), &b, "bad-ann", Via::Plain);
    let all = text(&out);
    assert!(!out.status.success() && !all.contains("STARTED"), "{all}");
    let unquoted = all.replace("\\\"", "\"");
    assert!(
        unquoted.contains("tessera-hook: annotation cdi.k8s.io/x: \"tessera.io/gpu\" is not a CDI device name"),
        "{all}"
    );
    // A broken limits file.
    node.allocation("broken", &[]);
    std::fs::write(node.run.join("alloc/broken/limits"), "version = 1\n[[devices]]\nuuid = 5\n").unwrap();
    let b = for_wrapper("b2", &["TESSERA_VISIBLE_DEVICES=0", "TESSERA_ALLOCATION=broken"]);
    let out = runc(node.path(), &b, "bad-limits", Via::Wrapper(&node));
    let all = text(&out);
    assert!(!out.status.success() && all.contains("devices[0].uuid: expected a string"), "{all}");
    // A broken spec: a container asking for a device gets the file named.
    let spec = node.cdi.join("tessera.io-gpu.json");
    std::fs::write(&spec, "{").unwrap();
    let b3 = for_wrapper("b3", &["TESSERA_VISIBLE_DEVICES=0", "TESSERA_ALLOCATION=a1"]);
    let out = runc(node.path(), &b3, "bad-spec", Via::Wrapper(&node));
    let all = text(&out);
    assert!(!out.status.success() && all.contains(&format!("tessera-runtime: CDI spec {}: ", spec.display())), "{all}");
    // The wrapper on a broken config.json.
    std::fs::write(b.join("config.json"), "{\"process\": {\"env\": 7}}").unwrap();
    let out = runc(node.path(), &b, "bad-config", Via::Wrapper(&node));
    let all = text(&out);
    assert!(
        !out.status.success()
            && all.contains("tessera-runtime: config.json: process.env: expected an array of strings"),
        "{all}"
    );
}

/// The entries runc 1.1.5 itself makes in a /dev that is a link to a host directory (it follows
/// the link on the host before any hook runs): not ours, listed so the check covers the rest.
const RUNC_DEV_LINKS: &[&str] = &["fd", "ptmx", "stdin", "stdout", "stderr"];

fn without_runc_links(v: &Path, snap: Vec<(String, String)>) -> Vec<(String, String)> {
    snap.into_iter().filter(|(p, _)| !RUNC_DEV_LINKS.iter().any(|n| Path::new(p) == v.join(n))).collect()
}

/// Hostile images: /etc, /usr/lib and /dev as links to a host directory, and no /etc at all.
/// The hook resolves every path inside the root: the start succeeds with everything inside.
/// The wrapper cannot (the runtime acts on the paths): it refuses such a root before runc runs.
/// The same with a driver directory (its links made inside the root, never through a link).
#[test]
fn hostile_images_write_nothing_outside() {
    let Some(node) = runc_ready(Node::new()) else { return };
    hostile_images_on(&node);
    hostile_images_on(&Node::with_driver_dir());
}

fn hostile_images_on(node: &Node) {
    let victim = victim(node.path());
    let before = snapshot(&victim);
    let cases: &[(&str, &[&str])] =
        &[("etc", &["etc"]), ("usrlib", &["usr/lib"]), ("dev", &["dev"]), ("all", &["etc", "usr/lib", "dev"])];
    for (name, links) in cases {
        for via_hook in [true, false] {
            let rootfs = node.path().join(format!("rootfs-{name}-{via_hook}"));
            busybox_rootfs(&rootfs).unwrap();
            for l in *links {
                std::fs::remove_dir_all(rootfs.join(l)).unwrap();
                std::os::unix::fs::symlink(&victim, rootfs.join(l)).unwrap();
            }
            let b = probe_bundle(node, &rootfs, &format!("{name}-{via_hook}"), via_hook);
            let out =
                runc(node.path(), &b, &format!("hostile-{name}-{via_hook}"), Via::hook_or_wrapper(via_hook, node));
            let all = text(&out);
            println!(
                "hostile {name} via {}: success={}",
                if via_hook { "hook" } else { "wrapper" },
                out.status.success()
            );
            if via_hook {
                assert!(out.status.success(), "{all}");
                // Everything landed inside the container's own root.
                assert_eq!(lines(&all, "preload "), ["preload /usr/lib/tessera/libtessera.so"], "{all}");
                assert!(lines(&all, "open0 ")[0].contains("No such device or address"), "{all}");
                assert_eq!(
                    without_runc_links(&victim, snapshot(&victim)),
                    before,
                    "victim changed: {name} via hook: {all}"
                );
                for n in RUNC_DEV_LINKS {
                    let _ = std::fs::remove_file(victim.join(n));
                }
            } else {
                assert!(!out.status.success(), "{all}");
                assert!(
                    all.contains("tessera-runtime: root file system: /") && all.contains("is a symbolic link"),
                    "{all}"
                );
                assert_eq!(snapshot(&victim), before, "victim changed: {name} via wrapper: {all}");
            }
        }
    }
    // No /etc at all: made inside the root, the start succeeds.
    for via_hook in [true, false] {
        let rootfs = node.path().join(format!("rootfs-noetc-{via_hook}"));
        busybox_rootfs(&rootfs).unwrap();
        std::fs::remove_dir_all(rootfs.join("etc")).unwrap();
        let b = probe_bundle(node, &rootfs, &format!("noetc-{via_hook}"), via_hook);
        let out = runc(node.path(), &b, &format!("noetc-{via_hook}"), Via::hook_or_wrapper(via_hook, node));
        let all = text(&out);
        assert!(out.status.success(), "{all}");
        assert_gpu0(&all);
    }
    assert_eq!(snapshot(&victim), before);
}

/// The hook listed for both prestart and createRuntime (or once per CDI spec): the second run
/// finds everything in place and changes nothing.
#[test]
fn hook_twice_is_idempotent() {
    let Some((node, rootfs)) = runc_test() else { return };
    let b = bundle(
        &node.path().join("b"),
        &rootfs,
        &format!(
            "{PROBE}\ngrep -c tessera-hook-test /proc/self/mountinfo; grep tessera-hook-test /proc/self/mountinfo | cut -d' ' -f4,5"
        ),
        ASK_GPU0,
        Some(&node),
    );
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    let entry = c["hooks"]["createRuntime"][0].clone();
    c["hooks"]["prestart"] = serde_json::json!([entry.clone()]);
    c["hooks"]["createRuntime"] = serde_json::json!([entry.clone(), entry]);
    std::fs::write(b.join("config.json"), c.to_string()).unwrap();
    let all = run_ok(&node, &b, "twice", Via::Plain);
    assert_gpu0(&all);
    // Mounts from the test's directory: the root, 3 libraries, nvidia-smi, shim, preload, loader
    // entry, allocation dir, region — once each.
    let count = all.lines().find(|l| l.chars().all(|c| c.is_ascii_digit()) && !l.is_empty()).unwrap();
    assert_eq!(count, "10", "{all}");
}

/// An image whose driver-library links are stale: `libcuda.so.1 -> libcuda.so.535.104.05`
/// (absent), `libnvidia-ml.so.1 -> /etc/passwd`, and one aimed at a host file. The container
/// starts with the injected libraries, by the hook and by the wrapper; each link is replaced inside
/// the root, and nothing is written through one (the image's /etc/passwd and the host file keep
/// their bytes).
#[test]
fn stale_driver_library_links_are_replaced_inside_the_root() {
    let Some(node) = runc_ready(Node::new()) else { return };
    let victim = victim(node.path());
    let before = snapshot(&victim);
    let host_passwd = std::fs::read("/etc/passwd").ok();
    for via_hook in [true, false] {
        let rootfs = node.path().join(format!("rootfs-stale-{via_hook}"));
        busybox_rootfs(&rootfs).unwrap();
        std::fs::write(rootfs.join("etc/passwd"), "root:x:0:0:image:/root:/bin/sh\n").unwrap();
        let lib = rootfs.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        std::os::unix::fs::symlink("libcuda.so.535.104.05", lib.join("libcuda.so.1")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", lib.join("libnvidia-ml.so.1")).unwrap();
        let host_file = std::fs::read_dir(&victim).unwrap().next().unwrap().unwrap().path();
        std::os::unix::fs::symlink(&host_file, lib.join("libcuda.so.550.54.15")).unwrap();
        let b = bundle(
            &node.path().join(format!("b-stale-{via_hook}")),
            &rootfs,
            PROBE,
            ASK_GPU0,
            via_hook.then_some(&node),
        );
        let out = runc(node.path(), &b, &format!("stale-{via_hook}"), Via::hook_or_wrapper(via_hook, &node));
        let all = text(&out);
        let via = if via_hook { "hook" } else { "wrapper" };
        assert!(out.status.success(), "via {via}: {all}");
        // The injected libraries are what the container sees at those paths.
        assert_gpu0(&all);
        // The links are gone from the image, replaced by (now unmounted) files of its own.
        for name in ["libcuda.so.1", "libnvidia-ml.so.1", "libcuda.so.550.54.15"] {
            let meta = std::fs::symlink_metadata(lib.join(name)).unwrap();
            assert!(meta.file_type().is_file(), "via {via}: {name} is still {meta:?}");
        }
        assert_eq!(std::fs::read_to_string(rootfs.join("etc/passwd")).unwrap(), "root:x:0:0:image:/root:/bin/sh\n");
        assert!(!lib.join("libcuda.so.535.104.05").exists(), "via {via}: nothing made through the link");
    }
    assert_eq!(snapshot(&victim), before, "the host file behind a link is untouched");
    assert_eq!(std::fs::read("/etc/passwd").ok(), host_passwd);
}

/// With a driver directory the container gets one read-only mount of it and a link per driver
/// file, by the hook and by the wrapper alike: the files read the same, no driver file is a mount
/// of its own, nothing is written into the directory from inside, and an image's own regular file
/// at a driver path keeps its bytes in the image (the driver's is mounted over it), while its
/// hostile link is replaced inside the root and nothing is written through it.
#[test]
fn a_driver_directory_is_one_mount_and_a_link_per_file() {
    let Some(node) = runc_ready(Node::with_driver_dir()) else { return };
    let victim = victim(node.path());
    let before = snapshot(&victim);
    let dir = node.driver_dir.clone().expect("a driver directory");
    let script = format!(
        "{PROBE}\necho \"link $(/bin/busybox readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1)\"\n\
         echo \"mounts $(grep -c x86_64-linux-gnu /proc/self/mountinfo) $(grep -c ' /usr/lib/tessera/driver ' /proc/self/mountinfo)\"\n\
         echo \"dir-writable $( (echo x > /usr/lib/tessera/driver/usr/bin/nvidia-smi) 2>/dev/null && echo yes || echo no)\"\n"
    );
    for via_hook in [true, false] {
        let via = if via_hook { "hook" } else { "wrapper" };
        let rootfs = node.path().join(format!("rootfs-dir-{via}"));
        busybox_rootfs(&rootfs).unwrap();
        let lib = rootfs.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnvidia-ml.so.1"), "image-nvml").unwrap();
        let host_file = victim.join("precious");
        std::os::unix::fs::symlink(&host_file, lib.join("libcuda.so.550.54.15")).unwrap();
        let b =
            bundle(&node.path().join(format!("b-dir-{via}")), &rootfs, &script, ASK_GPU0, via_hook.then_some(&node));
        let out = runc(node.path(), &b, &format!("dir-{via_hook}"), Via::hook_or_wrapper(via_hook, &node));
        let all = text(&out);
        assert!(out.status.success(), "via {via}: {all}");
        assert_gpu0(&all);
        assert_eq!(
            lines(&all, "link "),
            ["link /usr/lib/tessera/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1"],
            "via {via}: {all}"
        );
        // One mount over the image's libnvidia-ml.so.1, the driver directory once.
        assert_eq!(lines(&all, "mounts "), ["mounts 1 1"], "via {via}: {all}");
        assert_eq!(lines(&all, "dir-writable "), ["dir-writable no"], "via {via}: {all}");
        assert_eq!(std::fs::read_to_string(lib.join("libnvidia-ml.so.1")).unwrap(), "image-nvml", "via {via}");
        let made = std::fs::read_link(lib.join("libcuda.so.550.54.15")).unwrap();
        assert_eq!(made, Path::new("/usr/lib/tessera/driver/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"));
        // A second start over the same root finds its links in place.
        let again = if via_hook {
            runc(node.path(), &b, "dir-h2", Via::Plain)
        } else {
            runc(node.path(), &b, "dir-w2", Via::Wrapper(&node))
        };
        assert!(again.status.success(), "via {via}, again: {}", text(&again));
        assert_gpu0(&text(&again));
    }
    assert_eq!(snapshot(&victim), before, "the host file behind a link is untouched");
    assert_eq!(std::fs::read_to_string(dir.join("usr/bin/nvidia-smi")).unwrap(), "fake-smi");
}

/// The static builds of the hook and the wrapper (`scripts/build-static-hook.sh`, what hosts get)
/// inject exactly what the dynamic ones do, with a driver directory; they name no loader.
#[test]
fn static_hook_and_wrapper_inject_like_the_dynamic_ones() {
    let Some(node) = runc_ready(Node::with_driver_dir()) else { return };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/static/x86_64-unknown-linux-gnu/release");
    let (hook, wrapper) = (dir.join("tessera-hook"), dir.join("tessera-runtime"));
    if !hook.is_file() || !wrapper.is_file() {
        skip(&format!("no static build in {} (scripts/build-static-hook.sh)", dir.display()));
        return;
    }
    for bin in [&hook, &wrapper] {
        let elf = std::fs::read(bin).unwrap();
        // ELF64 program headers: PT_INTERP (3) would name a dynamic loader.
        let (off, size, n) = (
            u64::from_le_bytes(elf[32..40].try_into().unwrap()) as usize,
            u16::from_le_bytes(elf[54..56].try_into().unwrap()) as usize,
            u16::from_le_bytes(elf[56..58].try_into().unwrap()) as usize,
        );
        let interp =
            (0..n).any(|i| u32::from_le_bytes(elf[off + i * size..off + i * size + 4].try_into().unwrap()) == 3);
        assert!(!interp, "{} names a dynamic loader", bin.display());
    }
    let rootfs = busybox_rootfs(&node.path().join("rootfs-static-hook")).unwrap();
    let b = bundle(&node.path().join("b-static-hook"), &rootfs, PROBE, ASK_GPU0, Some(&node));
    let config = b.join("config.json");
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    c["hooks"]["createRuntime"][0]["path"] = serde_json::json!(hook.display().to_string());
    std::fs::write(&config, serde_json::to_vec(&c).unwrap()).unwrap();
    let out = runc(node.path(), &b, "static-hook", Via::Plain);
    assert!(out.status.success(), "{}", text(&out));
    assert_gpu0(&text(&out));

    let rootfs = busybox_rootfs(&node.path().join("rootfs-static-wrapper")).unwrap();
    let b = bundle(&node.path().join("b-static-wrapper"), &rootfs, PROBE, ASK_GPU0, None);
    let id = format!("static-wrapper-{}", std::process::id());
    let out = Command::new(&wrapper)
        .env("TESSERA_HOOK_CONFIG", &node.config)
        .arg("--root")
        .arg(node.path().join("runc-state"))
        .args(["run", "--bundle"])
        .arg(&b)
        .arg(&id)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_gpu0(&text(&out));
}
