//! A context size tesserad published (`context-sizes` beside `limits`): a process's first primary
//! context is charged exactly that, with nothing measured (no NVML true-up), and the limit holds
//! to the byte around it; a file that is missing, damaged, forged out of range, for another GPU,
//! or an environment whose contexts are not the size measured, falls back to measuring; and the
//! file, as tesserad lays it out, cannot be written by another uid.

mod common;

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;

use common::cuda::*;
use common::*;
use tessera_region::context_sizes::{CONTEXT_SIZES_FILE, CONTEXT_SIZES_HEADER, ContextSizes};
use tessera_sim_model::Node;
use tessera_sim_testkit::SimNode;

const LIMIT: u64 = GIB;
/// Published on purpose below the node's real 300 MiB: a true-up would show as 300 MiB.
const PUBLISHED_MIB: u64 = 280;

fn gpu0_uuid(node: &SimNode) -> String {
    let model = Node::open(node.description.as_deref(), Some(&node.state)).unwrap();
    model.gpu(0).unwrap().uuid.clone()
}

fn sizes_path(c: &Container) -> std::path::PathBuf {
    c.limits.parent().unwrap().join(CONTEXT_SIZES_FILE)
}

fn publish(c: &Container, uuid: &str, bytes: u64) {
    let mut t = ContextSizes::new();
    assert!(t.set(uuid, bytes));
    t.write_atomic(&sizes_path(c)).unwrap();
}

/// [`parent_node`] whose child starts a CUDA session on GPU 0 and runs `body` with it, its
/// region and the GPU's entry there.
fn in_a_session(body: impl FnOnce(&Session, &tessera_region::Region, usize)) -> Option<SimNode> {
    parent_node(|| {
        let s = Session::start(0);
        let (region, dev) = region_and_dev(&s);
        body(&s, &region, dev)
    })
}

fn var(k: &str) -> u64 {
    std::env::var(k).unwrap_or_else(|_| panic!("{k}")).parse().unwrap()
}

#[test]
fn a_published_size_is_charged_exactly_and_the_limit_holds_around_it() {
    let test = "a_published_size_is_charged_exactly_and_the_limit_holds_around_it";
    let Some(node) = in_a_session(|s, region, dev| {
        let want = PUBLISHED_MIB * MIB;
        assert_eq!(region.used(dev), want, "the published size, reserved before the context");
        // cuMemGetInfo trues up a context still waiting for it: none is.
        let _ = s.mem_info();
        assert_eq!(region.used(dev), want, "never measured");
        let room = LIMIT - want;
        let p = s.alloc(room).expect("everything the limit leaves beside the context");
        assert_eq!(s.alloc(MIB), Err(OUT_OF_MEMORY), "and not a byte more");
        assert_eq!(region.used(dev), LIMIT);
        s.free(p);
        assert_eq!(region.used(dev), want);
        let tasks = std::fs::read_dir("/proc/self/task").unwrap();
        for t in tasks.flatten() {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            assert_ne!(comm.trim(), "tessera-true-up", "no helper thread loads NVML");
        }
    }) else {
        return;
    };
    let c = Container::new(&memory_limits(LIMIT));
    publish(&c, &gpu0_uuid(&node), PUBLISHED_MIB * MIB);
    wait_child(test, spawn_child(test, container_env(&c, &node)));
    c.region().reap();
    assert_eq!(c.region().used(0), 0, "all of it came back");
}

/// A published size that does not fit the limit refuses the context, charging nothing.
#[test]
fn a_published_size_over_the_limit_refuses_the_context() {
    let test = "a_published_size_over_the_limit_refuses_the_context";
    let Some(node) = parent_node(|| {
        let cu = Cuda::load();
        let mut ctx: H = std::ptr::null_mut();
        // SAFETY: valid out-pointers.
        unsafe {
            ck("cuInit", (cu.cuInit)(0));
            assert_eq!((cu.cuDevicePrimaryCtxRetain)(&mut ctx, 0), OUT_OF_MEMORY);
        }
    }) else {
        return;
    };
    let c = Container::new(&memory_limits(256 * MIB));
    publish(&c, &gpu0_uuid(&node), PUBLISHED_MIB * MIB);
    wait_child(test, spawn_child(test, container_env(&c, &node)));
    assert_eq!(c.region().used(0), 0);
}

/// A case: the file's text (`None`: no file) and extra environment.
type Case = (Option<String>, Vec<(&'static str, &'static str)>);

/// Each case: the file's text (`None`: no file) and extra environment. The first context is then
/// measured as before: trued up to the node's real 300 MiB.
#[test]
fn a_missing_damaged_forged_or_foreign_file_falls_back_to_measuring() {
    let test = "a_missing_damaged_forged_or_foreign_file_falls_back_to_measuring";
    let Some(node) = in_a_session(|s, region, dev| {
        // The true-up runs on the helper thread, or now for cuMemGetInfo.
        let _ = s.mem_info();
        let got = settled(OVERHEAD_MIB * MIB, || region.used(dev));
        assert_eq!(got, OVERHEAD_MIB * MIB, "measured: the context's real size (case {})", var("CASE"));
    }) else {
        return;
    };
    let uuid = gpu0_uuid(&node);
    let other = "GPU-00000000-1111-2222-3333-444444444444";
    let cases: Vec<Case> = vec![
        (None, vec![]),
        (Some(String::new()), vec![]),
        (Some("garbage\n\u{0}\u{1}".into()), vec![]),
        // Forged small, so that the context would be nearly free: out of range, refused whole.
        (Some(format!("{CONTEXT_SIZES_HEADER}\n{uuid} 4096\n")), vec![]),
        (Some(format!("{CONTEXT_SIZES_HEADER}\n{uuid} 0\n")), vec![]),
        (Some(format!("{CONTEXT_SIZES_HEADER}\n{uuid} 3221225472\n")), vec![]),
        (Some(format!("{CONTEXT_SIZES_HEADER}\n{uuid} 293601280\n{other} 1\n")), vec![]),
        (Some(format!("tessera-context-sizes 9\n{uuid} 293601280\n")), vec![]),
        // Another GPU's figure only.
        (Some(format!("{CONTEXT_SIZES_HEADER}\n{other} 293601280\n")), vec![]),
        // A good figure, but contexts here are not the size tesserad measured.
        (Some(format!("{CONTEXT_SIZES_HEADER}\n{uuid} 293601280\n")), vec![("CUDA_DEVICE_MAX_CONNECTIONS", "8")]),
    ];
    for (i, (text, extra)) in cases.into_iter().enumerate() {
        let c = Container::new(&memory_limits(LIMIT));
        if let Some(t) = &text {
            std::fs::write(sizes_path(&c), t).unwrap();
        }
        let mut env = container_env(&c, &node);
        env.push(("CASE".into(), OsString::from(i.to_string())));
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), OsString::from(v))));
        wait_child(test, spawn_child(test, env));
    }
}

/// As tesserad lays an allocation's directory out (root's, 0755; the file root's, 0644), a
/// process of another uid can neither rewrite the file, replace it, nor remove it. (In a
/// container the directory is also mounted read-only: daemon/tests/enforcement.rs.)
#[test]
fn another_uid_cannot_write_replace_or_remove_the_file() {
    if !nix_is_root() {
        assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "needs root");
        eprintln!("SKIP: needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join(CONTEXT_SIZES_FILE);
    let mut t = ContextSizes::new();
    assert!(t.set("GPU-5a1c0b62-0e7e-4f5b-8c1e-2b8a3d9e4f10", 268435456));
    t.write_atomic(&path).unwrap();
    let before = std::fs::read(&path).unwrap();
    let f = path.display();
    let d = dir.path().display();
    for attempt in [
        format!("printf '{CONTEXT_SIZES_HEADER}\\nGPU-5a1c0b62-0e7e-4f5b-8c1e-2b8a3d9e4f10 1048576\\n' > {f}"),
        format!("printf x >> {f}"),
        format!("printf x > {d}/.new && mv -f {d}/.new {f}"),
        format!("rm -f {f}"),
        format!("chmod 666 {f}"),
        format!("truncate -s 0 {f}"),
    ] {
        let out = std::process::Command::new("/bin/sh").arg("-c").arg(&attempt).uid(65534).gid(65534).output().unwrap();
        assert!(!out.status.success(), "as uid 65534, {attempt:?} succeeded");
    }
    assert_eq!(std::fs::read(&path).unwrap(), before, "unchanged");
    assert_eq!(ContextSizes::load(Path::new(&path)), Some(t));
}

fn nix_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
