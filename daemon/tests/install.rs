//! `tessera install` / `tessera uninstall` against a temporary host root: what it writes, that a
//! second run changes nothing, that it never overwrites what it did not write, that uninstall
//! gives back the host byte for byte; and, with a real containerd 1.6 started from the
//! configuration it wrote, that a container run through the installed `tessera` handler's
//! wrapper gets exactly its GPU's (fake, mknod'ed) device nodes.

mod common;

use common::which;

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tessera_region::paths;

const TESSERA: &str = env!("CARGO_BIN_EXE_tessera");
const GPU0: &str = "GPU-11111111-2222-3333-4444-555555555555";
const HOST_CONTAINERD: &str = "version = 2\n# the operator's\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"registry.k8s.io/pause:3.9\"\n  [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n    SystemdCgroup = true\n";

/// The directory of the built hook, wrapper and shim (`cargo build --workspace`).
fn built() -> PathBuf {
    tessera_sim_testkit::binary("tessera-hook").parent().expect("target dir").to_path_buf()
}

fn tessera(args: &[&str]) -> Output {
    Command::new(TESSERA).args(args).output().expect("run tessera")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A host: `/var/run -> /run` as on Debian, containerd and podman present, the operator's
/// containerd configuration.
fn host() -> tempfile::TempDir {
    let h = tempfile::Builder::new().prefix("tessera-install-test").tempdir().expect("tempdir");
    let r = h.path();
    for d in ["run", "var", "usr/bin", "etc/containerd", "etc/containers"] {
        std::fs::create_dir_all(r.join(d)).unwrap();
    }
    symlink("/run", r.join("var/run")).unwrap();
    std::fs::write(r.join("usr/bin/containerd"), "").unwrap();
    std::fs::write(r.join("usr/bin/podman"), "").unwrap();
    std::fs::write(r.join("etc/containerd/config.toml"), HOST_CONTAINERD).unwrap();
    h
}

/// Every path under `root` with its kind and content, to compare whole trees.
fn tree(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let what = if m.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(&p).unwrap().display())
            } else if m.is_dir() {
                stack.push(p.clone());
                "dir".into()
            } else {
                let bytes = std::fs::read(&p).unwrap();
                format!("{:o} {} bytes crc {:08x}", m.permissions().mode_bits(), bytes.len(), crc32(&bytes))
            };
            out.push((p.strip_prefix(root).unwrap().display().to_string(), what));
        }
    }
    out.sort();
    out
}

/// CRC-32 (IEEE), enough to tell contents apart in a tree listing.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in bytes {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

trait ModeBits {
    fn mode_bits(&self) -> u32;
}
impl ModeBits for std::fs::Permissions {
    fn mode_bits(&self) -> u32 {
        std::os::unix::fs::PermissionsExt::mode(self) & 0o7777
    }
}

fn install(root: &Path, extra: &[&str]) -> Output {
    let from = built();
    let mut args = vec!["install", "--host-root", root.to_str().unwrap(), "--from", from.to_str().unwrap()];
    args.extend_from_slice(extra);
    tessera(&args)
}

/// `tessera install` on the host `root` with `extra`, which must fail saying `says`.
fn install_refused(root: &Path, extra: &[&str], says: &str) {
    let out = install(root, extra);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(says), "{}", text(&out));
}

#[test]
fn install_writes_what_the_runtimes_need_and_uninstall_gives_the_host_back() {
    let h = host();
    let r = h.path();
    let before = tree(r);

    // A dry run changes nothing and says what it would do.
    let out = install(r, &["--dry-run"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(&format!("would write {}", paths::HOOK)), "{}", text(&out));
    assert_eq!(tree(r), before, "a dry run wrote something");

    let out = install(r, &[]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    let hook = std::fs::read(r.join(&paths::HOOK[1..])).unwrap();
    assert_eq!(hook, std::fs::read(built().join("tessera-hook")).unwrap());
    assert!(r.join(&paths::RUNTIME_WRAPPER[1..]).is_file() && r.join(&paths::SHIM[1..]).is_file());
    // /var/run/cdi followed the host's own link: /run/cdi of the host root.
    assert!(r.join("run/cdi").is_dir(), "{said}");
    // hooks.d (podman found): the hook with the configuration tesserad writes.
    let entry: serde_json::Value =
        serde_json::from_slice(&std::fs::read(r.join("etc/containers/oci/hooks.d/tessera-hook.json")).unwrap())
            .unwrap();
    assert_eq!(entry["hook"]["path"], paths::HOOK);
    assert_eq!(entry["hook"]["args"][2], "/run/tessera/hook.toml");
    // containerd: the operator's settings kept, the handler and CDI added.
    let cfg: toml::Table = std::fs::read_to_string(r.join("etc/containerd/config.toml")).unwrap().parse().unwrap();
    let cri = &cfg["plugins"]["io.containerd.grpc.v1.cri"];
    assert_eq!(cri["sandbox_image"].as_str(), Some("registry.k8s.io/pause:3.9"));
    assert_eq!(cri["enable_cdi"].as_bool(), Some(true));
    assert_eq!(cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"].as_bool(), Some(true));
    assert_eq!(
        cri["containerd"]["runtimes"]["tessera"]["options"]["BinaryName"].as_str(),
        Some(paths::RUNTIME_WRAPPER)
    );
    assert!(said.contains("restart needed: containerd"), "{said}");
    assert!(r.join("var/lib/tessera/install.json").is_file());
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(r.join("var/lib/tessera")).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o700, "the daemon's state directory is its alone");

    // Again: nothing changes, no restart asked for.
    let installed = tree(r);
    let out = install(r, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!text(&out).contains("restart needed"), "{}", text(&out));
    assert!(text(&out).lines().all(|l| l.starts_with("unchanged")), "{}", text(&out));
    assert_eq!(tree(r), installed);

    let out = tessera(&["uninstall", "--host-root", r.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(tree(r), before, "uninstall left the host changed:\n{}", text(&out));
}

#[test]
fn install_never_overwrites_what_it_did_not_write() {
    let h = host();
    let r = h.path();
    std::fs::create_dir_all(r.join("usr/local/bin")).unwrap();
    std::fs::write(r.join("usr/local/bin/tessera-runtime"), "the operator's own build").unwrap();
    let before = tree(r);
    install_refused(
        r,
        &["--runtime", "containerd"],
        "/usr/local/bin/tessera-runtime exists and was not written by tessera install",
    );
    // Checked before anything was written: the host is as it was.
    assert_eq!(tree(r), before);
    assert_eq!(std::fs::read_to_string(r.join("usr/local/bin/tessera-runtime")).unwrap(), "the operator's own build");
    assert_eq!(std::fs::read_to_string(r.join("etc/containerd/config.toml")).unwrap(), HOST_CONTAINERD);

    // A file of ours changed since: install refuses to overwrite it, uninstall keeps it.
    std::fs::remove_file(r.join("usr/local/bin/tessera-runtime")).unwrap();
    assert!(install(r, &["--runtime", "containerd"]).status.success());
    std::fs::write(r.join(&paths::HOOK[1..]), "patched by hand").unwrap();
    let out = install(r, &["--runtime", "containerd"]);
    assert!(!out.status.success() && text(&out).contains("was changed since"), "{}", text(&out));
    let out = tessera(&["uninstall", "--host-root", r.to_str().unwrap()]);
    assert!(text(&out).contains("keep /usr/local/bin/tessera-hook: changed since"), "{}", text(&out));
    assert_eq!(std::fs::read_to_string(r.join(&paths::HOOK[1..])).unwrap(), "patched by hand");
    assert_eq!(std::fs::read_to_string(r.join("etc/containerd/config.toml")).unwrap(), HOST_CONTAINERD);
}

#[test]
fn a_containerd_config_it_cannot_edit_safely_is_refused_unchanged() {
    let h = host();
    let r = h.path();
    let v1 = "[plugins.cri]\n  sandbox_image = \"pause\"\n";
    std::fs::write(r.join("etc/containerd/config.toml"), v1).unwrap();
    install_refused(
        r,
        &["--runtime", "containerd"],
        "/etc/containerd/config.toml: config version 1 (no `version` key) is not supported",
    );
    assert_eq!(std::fs::read_to_string(r.join("etc/containerd/config.toml")).unwrap(), v1);
}

// ---- real containerd 1.6 ----

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn mknod(p: &Path, major: u32, minor: u32) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path during the call.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(major, minor)) };
    assert_eq!(rc, 0, "mknod {}: {}", p.display(), std::io::Error::last_os_error());
}

fn busybox_rootfs(root: &Path) -> Option<PathBuf> {
    let busybox = Path::new("/bin/busybox");
    if !busybox.is_file() {
        common::skip("busybox is not installed (Debian package busybox-static)");
        return None;
    }
    for d in ["bin", "dev", "proc", "sys", "etc", "tmp", "run"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "stat", "echo", "head", "ls"] {
        symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    Some(root.to_path_buf())
}

#[test]
fn containerd_1_6_runs_a_gpu_container_through_the_installed_handler() {
    if !is_root() {
        return common::skip("the containerd test needs root (mknod, containers)");
    }
    if which("containerd").is_none() || which("ctr").is_none() || which("runc").is_none() {
        return common::skip("containerd, ctr or runc is not installed (Debian packages containerd, runc)");
    }
    // A host with no containerd configuration: install writes the whole file.
    let h = tempfile::Builder::new().prefix("tessera-install-ctr").tempdir().expect("tempdir");
    let r = h.path();
    let out = install(r, &["--runtime", "containerd"]);
    assert!(out.status.success(), "{}", text(&out));
    let config = r.join("etc/containerd/config.toml");

    // containerd reads the file it wrote: the tessera handler names the installed wrapper, and
    // the default runc runtime is still there (declaring a runtime replaces containerd's table).
    let dump = Command::new("containerd").arg("--config").arg(&config).args(["config", "dump"]).output().unwrap();
    let dump_text = text(&dump);
    assert!(dump.status.success(), "{dump_text}");
    let dumped: toml::Table = String::from_utf8_lossy(&dump.stdout).parse().expect("config dump is TOML");
    let runtimes = &dumped["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"];
    assert_eq!(runtimes["runc"]["runtime_type"].as_str(), Some("io.containerd.runc.v2"), "{dump_text}");
    let binary = runtimes["tessera"]["options"]["BinaryName"].as_str().expect("BinaryName");
    assert_eq!(binary, paths::RUNTIME_WRAPPER);
    let wrapper = r.join(&binary[1..]); // the installed copy, in the host root

    // The fake node: device nodes, driver files, CDI specs, an allocation of GPU 0.
    let node = r.join("node");
    let dev = node.join("dev");
    mknod(&dev.join("nvidia0"), 195, 0);
    mknod(&dev.join("nvidia1"), 195, 1);
    mknod(&dev.join("nvidiactl"), 195, 255);
    let driver = node.join("driver");
    std::fs::create_dir_all(driver.join("usr/lib/x86_64-linux-gnu")).unwrap();
    std::fs::write(driver.join("usr/lib/x86_64-linux-gnu/libcuda.so.1"), "fake-libcuda").unwrap();
    let run = node.join("run");
    let alloc = run.join("alloc/a1");
    std::fs::create_dir_all(&alloc).unwrap();
    std::fs::write(
        alloc.join("limits"),
        format!("version = 1\n[[devices]]\nuuid = \"{GPU0}\"\nmemory_limit = 1073741824\n"),
    )
    .unwrap();
    std::fs::write(alloc.join("region"), "").unwrap();
    let hook_config = tessera_region::hook_config::HookConfig {
        cdi_spec_dirs: vec![r.join("run/cdi")],
        runtime_dir: run.clone(),
        driver_root: driver.clone(),
        dev_root: dev.clone(),
        shim_path: Some(r.join(&paths::SHIM[1..])),
        runtime: which("runc").unwrap().display().to_string(),
        ..Default::default()
    };
    let hook_config_path = node.join("hook.toml");
    std::fs::write(&hook_config_path, hook_config.render()).unwrap();
    let drv = tessera_region::driver::DriverConfig { root: driver, dev_root: dev.clone(), ..Default::default() };
    let gpu = |uuid: &str, alias: &str, node: &str| tessera_region::cdi::NodeDevice {
        class: "gpu".into(),
        name: uuid.into(),
        aliases: vec![alias.into()],
        uuid: uuid.into(),
        nodes: vec![dev.join(node)],
    };
    let specs = tessera_region::cdi::build_specs(&tessera_region::cdi::NodeDevices {
        devices: vec![gpu(GPU0, "0", "nvidia0"), gpu("GPU-66666666-7777-8888-9999-000000000000", "1", "nvidia1")],
        control_nodes: tessera_region::driver::control_nodes(&drv),
        driver: tessera_region::driver::discover(&drv),
        driver_dir: None,
        shim: hook_config.shim_path.clone(),
        hook_binary: r.join(&paths::HOOK[1..]),
        hook_config: hook_config_path.clone(),
        dev_root: dev.clone(),
        cdi_version: None,
    })
    .unwrap();
    tessera_region::cdi::write_specs(&r.join("run/cdi"), &specs).unwrap();

    // containerd with the written configuration (its own root, state and socket).
    let base = node.join("containerd");
    std::fs::create_dir_all(&base).unwrap();
    let log = std::fs::File::create(base.join("containerd.log")).unwrap();
    let err = std::fs::File::create(base.join("containerd.err")).unwrap();
    let d = common::containerd::Containerd::start(&base, &config, &hook_config_path, log, err);
    if !d.answers() {
        let why = std::fs::read_to_string(base.join("containerd.err")).unwrap_or_default();
        return common::skip(&format!("containerd did not start here: {why}"));
    }
    let run_in = |id: &str, env: &[&str], script: &str| {
        let rootfs = busybox_rootfs(&node.join(format!("rootfs-{id}")))?;
        let mut c = Command::new("ctr");
        c.arg("--address").arg(&d.sock).args(["--namespace", "tessera-install-test", "run", "--rm", "--runc-binary"]);
        c.arg(&wrapper);
        for e in env {
            c.args(["--env", e]);
        }
        c.arg("--rootfs").arg(rootfs).arg(format!("{id}-{}", std::process::id())).args(["/bin/sh", "-c", script]);
        Some(c.stdin(std::process::Stdio::null()).output().unwrap())
    };
    let Some(probe) = run_in("probe", &[], "echo ok") else { return };
    if !(probe.status.success() && String::from_utf8_lossy(&probe.stdout).contains("ok")) {
        return common::skip(&format!("containerd cannot run containers here: {}", text(&probe)));
    }
    let script = "for f in /dev/nvidia*; do echo \"node $f $(stat -c '%t:%T' $f)\"; done; echo \"lib $(cat /usr/lib/x86_64-linux-gnu/libcuda.so.1)\"; echo \"limits $(head -c 11 /run/tessera/alloc/limits)\"";
    let Some(out) = run_in("gpu", &["TESSERA_VISIBLE_DEVICES=0", "TESSERA_ALLOCATION=a1"], script) else { return };
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    let nodes: Vec<&str> = all.lines().filter(|l| l.starts_with("node ")).collect();
    assert_eq!(nodes, ["node /dev/nvidia0 c3:0", "node /dev/nvidiactl c3:ff"], "{all}");
    assert!(all.contains("lib fake-libcuda") && all.contains("limits version = 1"), "{all}");
    // GPU 1 is not the allocation's: the start is refused.
    let Some(out) = run_in("refused", &["TESSERA_VISIBLE_DEVICES=1", "TESSERA_ALLOCATION=a1"], "echo STARTED") else {
        return;
    };
    assert!(!out.status.success() && !text(&out).contains("STARTED"), "{}", text(&out));

    drop(d);
    let out = tessera(&["uninstall", "--host-root", r.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!config.exists() && !wrapper.exists(), "{}", text(&out));
}
