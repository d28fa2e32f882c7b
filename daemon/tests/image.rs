//! The container image (deploy/image/Containerfile), built offline by scripts/build-image.sh
//! from this build and run with podman: `tesserad --version`, the installer against a temporary
//! host root (and uninstall), no shell inside, nobody as its default user. Needs root and podman;
//! prints SKIP otherwise (a failure under `TESSERA_REQUIRE_RUNTIMES`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repository").to_path_buf()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Removes the test's image when dropped.
struct Image(String);

impl Drop for Image {
    fn drop(&mut self) {
        let _ = Command::new("podman").args(["rmi", "--force", &self.0]).output();
    }
}

fn podman_run(image: &str, args: &[&str]) -> Output {
    // Debian 12's podman 4.3 needs runc and explicit limits here (docs/hook.md).
    Command::new("podman")
        .args(["run", "--rm", "--runtime", "runc", "--network", "none"])
        .args(["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"])
        .args(args.iter().take_while(|a| **a != image))
        .arg(image)
        .args(args.iter().skip_while(|a| **a != image).skip(1))
        .output()
        .expect("podman run")
}

#[test]
fn the_image_builds_offline_and_runs_the_daemon_and_the_installer() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return common::skip("the image test needs root (podman build and run)");
    }
    match Command::new("podman").arg("info").output() {
        Err(e) => return common::skip(&format!("podman is not installed (Debian package podman): {e}")),
        Ok(o) if !o.status.success() => {
            return common::skip(&format!("podman cannot work here (podman info failed): {}", text(&o).trim()));
        }
        Ok(_) => {}
    }
    let tag = format!("localhost/tessera-test:{}", std::process::id());
    // What this test run built (debug); the glibc-2.17 shim when it was built, else the debug one.
    let built = tessera_sim_testkit::binary("tesserad").parent().unwrap().to_path_buf();
    let profile = built.file_name().unwrap().to_str().unwrap().to_string();
    let shim_217 = repo().join("target/glibc-2.17/x86_64-unknown-linux-gnu/release/libtessera.so");
    let shim = if shim_217.is_file() { shim_217 } else { built.join("libtessera.so") };
    let out = Command::new(repo().join("scripts/build-image.sh"))
        .args(["--tag", &tag, "--profile", &profile, "--no-build"])
        .env("TESSERA_IMAGE_SHIM", &shim)
        .current_dir(repo())
        .output()
        .expect("build-image.sh");
    let _image = Image(tag.clone());
    assert!(out.status.success(), "build-image.sh failed:\n{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), tag);

    let out = podman_run(&tag, &[&tag, "--version"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("tesserad {}", env!("CARGO_PKG_VERSION")));

    let inspect = Command::new("podman")
        .args(["image", "inspect", "--format", "{{.Config.User}} {{.Size}}", &tag])
        .output()
        .unwrap();
    let inspected = String::from_utf8_lossy(&inspect.stdout).to_string();
    let (user, size) = inspected.trim().split_once(' ').unwrap();
    assert_eq!(user, "65534:65534", "root only where a manifest asks for it");
    println!("image {tag}: {} MB", size.parse::<u64>().unwrap_or(0) >> 20);

    // No shell, no tools: only the programs.
    let out = podman_run(&tag, &["--entrypoint", "/bin/sh", &tag, "-c", "true"]);
    assert!(!out.status.success(), "the image has a shell: {}", text(&out));

    // The installer, as the DaemonSet's init container runs it (as root), on a host with containerd.
    let host = tempfile::Builder::new().prefix("tessera-image-host").tempdir().unwrap();
    std::fs::create_dir_all(host.path().join("usr/bin")).unwrap();
    std::fs::write(host.path().join("usr/bin/containerd"), "").unwrap();
    let volume = format!("{}:/host", host.path().display());
    let install = |cmd: &str| {
        podman_run(
            &tag,
            &[
                "--user",
                "0",
                "-v",
                &volume,
                "--entrypoint",
                "/usr/local/bin/tessera",
                &tag,
                cmd,
                "--host-root",
                "/host",
            ],
        )
    };
    let out = install("install");
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("restart needed: containerd"), "{}", text(&out));
    let staged = repo().join("target/image/context/rootfs");
    for file in [tessera_region::paths::HOOK, tessera_region::paths::RUNTIME_WRAPPER, tessera_region::paths::SHIM] {
        let on_host = std::fs::read(host.path().join(&file[1..])).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(on_host, std::fs::read(staged.join(&file[1..])).unwrap(), "{file} is the image's");
    }
    let config = std::fs::read_to_string(host.path().join("etc/containerd/config.toml")).unwrap();
    assert!(config.contains("BinaryName = \"/usr/local/bin/tessera-runtime\""), "{config}");
    let out = install("uninstall");
    assert!(out.status.success(), "{}", text(&out));
    let mut left: Vec<_> = walk(host.path());
    left.sort();
    assert_eq!(left, ["usr", "usr/bin", "usr/bin/containerd"], "uninstall left: {left:?}");
}

fn walk(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p.clone());
            }
            out.push(p.strip_prefix(root).unwrap().display().to_string());
        }
    }
    out
}
