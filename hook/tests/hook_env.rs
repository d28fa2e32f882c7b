//! The lesson of CVE-2025-23266: nothing from the container's environment reaches the hook's own
//! process. The image asks for a preload of its own library; the hook (run by runc with the env of
//! its hook entry only) never loads it, and a hook started with LD_PRELOAD refuses to act.

mod common;

use std::process::Command;

use common::*;

#[test]
fn hook_refuses_to_run_with_a_preload() {
    for var in ["LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH"] {
        let out = Command::new(HOOK)
            .env_clear()
            .env(var, "/nonexistent/evil.so")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{var}: {err}");
        assert!(err.contains(&format!("tessera-hook: refusing to run with {var} in the environment")), "{err}");
    }
}

#[test]
fn image_preload_never_reaches_the_hook() {
    let node = Node::new();
    if !is_root() || which("runc").is_none() || which("gcc").is_none() {
        skip("needs root, runc and gcc");
        return;
    }
    let rootfs = busybox_rootfs(&node.path().join("rootfs")).unwrap();
    let mark = node.path().join("pwned");
    let src = node.path().join("evil.c");
    std::fs::write(
        &src,
        format!(
            "#include <fcntl.h>\n__attribute__((constructor)) static void evil(void) {{ open(\"{}\", O_CREAT | O_WRONLY, 0644); }}\n",
            mark.display()
        ),
    )
    .unwrap();
    let so = rootfs.join("evil.so");
    let out = Command::new("gcc").args(["-shared", "-fPIC", "-o"]).arg(&so).arg(&src).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // Both the relative trick (cwd of a hook in the root) and the host path of the library.
    let env = [
        "TESSERA_VISIBLE_DEVICES=0".to_string(),
        "TESSERA_ALLOCATION=a1".to_string(),
        format!("LD_PRELOAD=/proc/self/cwd/evil.so:{}", so.display()),
    ];
    let env: Vec<&str> = env.iter().map(String::as_str).collect();
    let b = bundle(&node.path().join("b"), &rootfs, PROBE, &env, Some(&node));
    let out = Command::new("runc")
        .arg("--root")
        .arg(node.path().join("state"))
        .args(["run", "--bundle"])
        .arg(&b)
        .arg(format!("preload-{}", std::process::id()))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert_gpu0(&all);
    assert!(!mark.exists(), "the image's library ran on the host: {all}");
}
