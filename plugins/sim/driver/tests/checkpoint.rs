//! The driver's checkpoint API (`cuCheckpointProcess*`) on the sim, as a checkpoint tool uses it:
//! from one process on another's pid. The target is this test binary run again as a small CUDA
//! program (`target_entry`) that takes commands on stdin; the caller is the isolated test process,
//! which loads the library without `cuInit` (a checkpoint tool has no GPU work of its own) and
//! watches the node through the model, which is what NVML reads.
//!
//! Build the library first: `cargo build -p tessera-sim-driver && cargo test -p tessera-sim-driver --test checkpoint`.

use std::ffi::{c_int, c_uint, c_void};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::time::Instant;

use tessera_sim_model::Node;
use tessera_sim_testkit::SimNode;

mod common;
use common::*;

const RUNNING: u32 = 0;
const LOCKED: u32 = 1;
const CHECKPOINTED: u32 = 2;

/// What a context takes (the default description's `context_overhead_mib`).
const CONTEXT_OVERHEAD: u64 = 256 * MIB;

macro_rules! call {
    ($lib:expr, $name:ident($($arg:expr),* $(,)?) as fn($($t:ty),* $(,)?)) => {{
        let f: libloading::Symbol<unsafe extern "C" fn($($t),*) -> u32> =
            // SAFETY: the symbol has this C signature (cuda.h 12.8).
            unsafe { $lib.get(stringify!($name).as_bytes()) }.expect(stringify!($name));
        // SAFETY: the arguments are valid for that signature.
        unsafe { f($($arg),*) }
    }};
}

/// `CUcheckpointLockArgs`.
#[repr(C)]
#[derive(Default)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

/// The checkpoint API as a caller sees it.
struct Api {
    lib: libloading::Library,
}

impl Api {
    fn load(path: &std::path::Path) -> Api {
        // SAFETY: loading the simulated driver runs no initializers.
        Api { lib: unsafe { libloading::Library::new(path) }.expect("load libcuda.so.1") }
    }
    fn lock(&self, pid: u32, timeout_ms: Option<u32>) -> u32 {
        let mut a = LockArgs { timeout_ms: timeout_ms.unwrap_or(0), ..Default::default() };
        let p: *mut LockArgs = if timeout_ms.is_some() { &mut a } else { std::ptr::null_mut() };
        call!(self.lib, cuCheckpointProcessLock(pid as c_int, p) as fn(c_int, *mut LockArgs))
    }
    fn checkpoint(&self, pid: u32) -> u32 {
        call!(self.lib, cuCheckpointProcessCheckpoint(pid as c_int, std::ptr::null_mut()) as fn(c_int, *mut [u64; 8]))
    }
    fn restore(&self, pid: u32) -> u32 {
        call!(self.lib, cuCheckpointProcessRestore(pid as c_int, std::ptr::null_mut()) as fn(c_int, *mut [u64; 8]))
    }
    fn unlock(&self, pid: u32) -> u32 {
        call!(self.lib, cuCheckpointProcessUnlock(pid as c_int, std::ptr::null_mut()) as fn(c_int, *mut [u64; 8]))
    }
    fn state(&self, pid: u32) -> Result<u32, u32> {
        let mut s = 99u32;
        match call!(self.lib, cuCheckpointProcessGetState(pid as c_int, &mut s) as fn(c_int, *mut u32)) {
            SUCCESS => Ok(s),
            e => Err(e),
        }
    }
    fn restore_tid(&self, pid: u32) -> Result<i32, u32> {
        let mut t = -1;
        match call!(self.lib, cuCheckpointProcessGetRestoreThreadId(pid as c_int, &mut t) as fn(c_int, *mut c_int)) {
            SUCCESS => Ok(t),
            e => Err(e),
        }
    }
}

/// The target program, running as a child of the test.
struct Target {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

impl Target {
    /// Starts a CUDA process on GPU 0 holding `mib` MiB filled with a pattern (`extra` another
    /// command run before it reports ready, e.g. `ipc`).
    fn start(node: &SimNode, mib: u64) -> Target {
        Target::start_under(node, mib, None)
    }

    /// As [`Target::start`], run by `wrapper` (a program that runs its arguments as a child).
    fn start_under(node: &SimNode, mib: u64, wrapper: Option<&[&str]>) -> Target {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match wrapper {
            Some([program, args @ ..]) => {
                let mut c = node.command(program);
                c.args(args).arg(&exe);
                c
            }
            _ => node.command(&exe),
        };
        let mut child = cmd
            .args(["target_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, mib.to_string())
            .env(LIB, node.cuda_path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let input = child.stdin.take().unwrap();
        let output = BufReader::new(child.stdout.take().unwrap());
        let mut t = Target { child, input, output };
        t.expect("ready");
        t
    }
    fn pid(&self) -> u32 {
        self.child.id()
    }
    /// Reads lines until one starts with `word`; returns the rest of it.
    fn expect(&mut self, word: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.output.read_line(&mut line).unwrap() > 0, "target exited before {word:?}");
            // libtest may print its "test target_entry ... " before the program's first line.
            if let Some(at) = line.find(word) {
                return line[at + word.len()..].trim().to_string();
            }
        }
    }
    fn send(&mut self, cmd: &str) {
        writeln!(self.input, "{cmd}").unwrap();
        self.input.flush().unwrap();
    }
    /// Sends `cmd`, then reads until its answer, a line starting with `answer`: the rest of it.
    fn ask(&mut self, cmd: &str, answer: &str) -> String {
        self.send(cmd);
        self.expect(answer)
    }
    /// The target's own check of its buffer, at its original address: (address, checksum).
    fn check(&mut self) -> (String, String) {
        let rest = self.ask("check", "check");
        let mut w = rest.split_whitespace();
        let (rc, addr, sum) = (w.next().unwrap(), w.next().unwrap(), w.next().unwrap());
        assert_eq!(rc, "0", "the target's copy back failed");
        (addr.to_string(), sum.to_string())
    }
    /// The system call the target's main thread is in (`/proc/PID/task/PID/syscall`).
    fn main_thread_syscall(&self) -> Option<i64> {
        let text = std::fs::read_to_string(format!("/proc/{0}/task/{0}/syscall", self.pid())).ok()?;
        text.split_whitespace().next()?.parse().ok()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const ROLE: &str = "TESSERA_CHECKPOINT_TARGET_MIB";
const LIB: &str = "TESSERA_CHECKPOINT_TARGET_LIB";

/// The target program: `cuInit`, a context on device 0, a buffer of $ROLE MiB written with a
/// pattern; then commands on stdin: `check` (copies the buffer back and prints its checksum),
/// `call` (prints `calling`, makes one CUDA call, prints `returned RC`), `launch` (queues a kernel
/// of 1.5 s), `ipc` (exports the buffer for another process).
#[test]
fn target_entry() {
    let Some(mib) = std::env::var_os(ROLE) else { return };
    let mib: u64 = mib.to_str().unwrap().parse().unwrap();
    // SAFETY: loading the simulated driver runs no initializers.
    let lib = unsafe { libloading::Library::new(std::env::var_os(LIB).unwrap()) }.unwrap();
    assert_eq!(call!(lib, cuInit(0) as fn(c_uint)), SUCCESS);
    let mut ctx: Handle = std::ptr::null_mut();
    assert_eq!(call!(lib, cuCtxCreate_v2(&mut ctx, 0, 0) as fn(*mut Handle, c_uint, c_int)), SUCCESS);
    let len = (mib * MIB) as usize;
    let mut dptr = 0u64;
    assert_eq!(call!(lib, cuMemAlloc_v2(&mut dptr, len) as fn(*mut u64, usize)), SUCCESS);
    let pattern: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    assert_eq!(
        call!(lib, cuMemcpyHtoD_v2(dptr, pattern.as_ptr().cast(), len) as fn(u64, *const c_void, usize)),
        SUCCESS
    );
    drop(pattern);
    println!("ready");
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().as_str() {
            "check" => {
                let mut back = vec![0u8; len];
                let rc =
                    call!(lib, cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), dptr, len) as fn(*mut c_void, u64, usize));
                let sum = back
                    .iter()
                    .enumerate()
                    .fold(0u64, |s, (i, &b)| s.wrapping_mul(31).wrapping_add(u64::from(b) ^ i as u64));
                println!("check {rc} {dptr:#x} {sum:#x}");
            }
            "call" => {
                println!("calling");
                let rc = call!(lib, cuCtxSynchronize() as fn());
                println!("returned {rc}");
            }
            "launch" => {
                let ptx =
                    c".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry spin_1500ms(\n)\n{\n ret;\n}\n";
                let f = function(&lib, ptx, "spin_1500ms");
                let rc = launch_kernel(&lib, "cuLaunchKernel", f, 1, std::ptr::null_mut());
                println!("launched {rc}");
            }
            "ipc" => {
                let mut h = [0u8; 64];
                let rc = call!(lib, cuIpcGetMemHandle(h.as_mut_ptr(), dptr) as fn(*mut u8, u64));
                println!("exported {rc}");
            }
            other => panic!("unknown command {other:?}"),
        }
    }
}

/// Runs `body` in a process of its own against a node of its own, with the API loaded.
fn with_api(test_name: &str, body: impl FnOnce(&SimNode, &Node, &Api)) {
    let node = SimNode::new();
    node.run_isolated(test_name, || {
        let api = Api::load(&node.cuda_path());
        let m = model(&node);
        body(&node, &m, &api);
    });
}

/// As [`with_api`], with a target holding `mib` MiB started first, and its pid.
fn with_target(test_name: &str, mib: u64, body: impl FnOnce(&mut Target, u32, &Node, &Api)) {
    with_api(test_name, |node, m, api| {
        let mut t = Target::start(node, mib);
        let pid = t.pid();
        body(&mut t, pid, m, api);
    });
}

fn used_on_gpu0(m: &Node) -> u64 {
    m.memory_info(0, 0).unwrap().used
}

#[test]
fn park_and_resume_move_the_bytes_to_host_and_back_at_their_addresses() {
    with_target("park_and_resume_move_the_bytes_to_host_and_back_at_their_addresses", 256, |t, pid, m, api| {
        let before = t.check();
        assert_eq!(used_on_gpu0(m), 256 * MIB + CONTEXT_OVERHEAD);
        assert_eq!(api.state(pid), Ok(RUNNING));
        let tid = api.restore_tid(pid).unwrap();
        let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap();
        assert_eq!(comm.trim(), "cuda-checkpoint", "the restore thread is the target's checkpoint thread");

        let started = Instant::now();
        assert_eq!(api.lock(pid, None), SUCCESS);
        assert_eq!(api.state(pid), Ok(LOCKED));
        let locked = Instant::now();
        assert_eq!(api.checkpoint(pid), SUCCESS);
        let parked = Instant::now();
        assert_eq!(api.state(pid), Ok(CHECKPOINTED));
        // What NVML reads: the GPU's memory free, the process no longer listed.
        assert_eq!(used_on_gpu0(m), 0, "a checkpointed process's memory is free");
        assert!(m.processes(0, None).unwrap().iter().all(|p| p.pid != pid), "nor is it listed");

        let restoring = Instant::now();
        assert_eq!(api.restore(pid), SUCCESS);
        let restored = Instant::now();
        assert_eq!(api.state(pid), Ok(LOCKED));
        assert_eq!(used_on_gpu0(m), 256 * MIB + CONTEXT_OVERHEAD);
        assert_eq!(api.unlock(pid), SUCCESS);
        assert_eq!(api.state(pid), Ok(RUNNING));
        assert_eq!(t.check(), before, "same address, same bytes");
        assert!(
            m.processes(0, None).unwrap().iter().any(|p| p.pid == pid && p.used_bytes == 256 * MIB + CONTEXT_OVERHEAD)
        );
        let gib = 256.0 / 1024.0;
        println!(
            "figures: lock {:.1} ms, checkpoint {:.1} ms ({:.1} ms/GiB), restore {:.1} ms ({:.1} ms/GiB), 256 MiB written",
            (locked - started).as_secs_f64() * 1e3,
            (parked - locked).as_secs_f64() * 1e3,
            (parked - locked).as_secs_f64() * 1e3 / gib,
            (restored - restoring).as_secs_f64() * 1e3,
            (restored - restoring).as_secs_f64() * 1e3 / gib,
        );
        // Twice over: a second park and resume works as the first.
        for op in [api.lock(pid, Some(5000)), api.checkpoint(pid), api.restore(pid), api.unlock(pid)] {
            assert_eq!(op, SUCCESS);
        }
        assert_eq!(t.check(), before);
    });
}

#[test]
fn a_locked_process_waits_in_its_cuda_calls_until_unlocked() {
    with_target("a_locked_process_waits_in_its_cuda_calls_until_unlocked", 1, |t, pid, _m, api| {
        assert_eq!(api.lock(pid, None), SUCCESS);
        t.ask("call", "calling");
        // Its main thread sleeps on a futex (202), the process-shared state word, not in read (0).
        while t.main_thread_syscall() != Some(202) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(api.state(pid), Ok(LOCKED));
        assert_eq!(api.unlock(pid), SUCCESS);
        assert_eq!(t.expect("returned"), "0", "the waiting call goes on once unlocked");
        // And through a checkpoint too.
        assert_eq!(api.lock(pid, None), SUCCESS);
        assert_eq!(api.checkpoint(pid), SUCCESS);
        t.ask("call", "calling");
        while t.main_thread_syscall() != Some(202) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(api.restore(pid), SUCCESS);
        assert_eq!(api.unlock(pid), SUCCESS);
        assert_eq!(t.expect("returned"), "0");
    });
}

#[test]
fn a_lock_that_times_out_on_running_work_leaves_the_process_running() {
    with_target("a_lock_that_times_out_on_running_work_leaves_the_process_running", 1, |t, pid, _m, api| {
        assert_eq!(t.ask("launch", "launched"), "0");
        assert_eq!(api.lock(pid, Some(20)), NOT_READY, "a kernel of 1.5 s does not drain in 20 ms");
        assert_eq!(api.state(pid), Ok(RUNNING));
        let (addr, _) = t.check();
        assert!(!addr.is_empty(), "its calls still run");
        // Without a timeout the lock waits for the kernel.
        assert_eq!(api.lock(pid, None), SUCCESS);
        assert_eq!(api.unlock(pid), SUCCESS);
    });
}

/// A process killed while a lock waits for its GPU work (as enforcement kills one over its
/// share) is no process any more: the lock says so (`CUDA_ERROR_INVALID_VALUE`, as for any pid
/// that is no process), not that it never initialized CUDA, and so does every call on its pid
/// while it is a zombie its parent has not reaped yet.
#[test]
fn a_process_killed_while_a_lock_waits_is_no_process() {
    with_target("a_process_killed_while_a_lock_waits_is_no_process", 1, |t, pid, _m, api| {
        assert_eq!(t.ask("launch", "launched"), "0");
        std::thread::scope(|s| {
            // No timeout: the lock waits for the kernel of 1.5 s, the process locked meanwhile.
            let waiting = s.spawn(|| api.lock(pid, None));
            while api.state(pid) != Ok(LOCKED) {
                assert!(!waiting.is_finished(), "the lock returned before it took: {:?}", waiting.join());
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            // SAFETY: kill has no memory preconditions; pid is our child, not yet waited for.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
            assert_eq!(waiting.join().unwrap(), INVALID_VALUE, "the lock's target died");
        });
        // A zombie until waited for: still no process to the checkpoint API.
        assert!(std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap().contains(") Z "), "a zombie");
        assert_eq!(api.state(pid), Err(INVALID_VALUE));
        assert_eq!(api.restore_tid(pid), Err(INVALID_VALUE));
        assert_eq!(api.lock(pid, Some(20)), INVALID_VALUE);
        assert_eq!(api.unlock(pid), INVALID_VALUE);
        t.child.wait().unwrap();
        assert_eq!(api.state(pid), Err(INVALID_VALUE), "gone");
    });
}

#[test]
fn bad_input_and_wrong_states_get_the_documented_errors() {
    with_target("bad_input_and_wrong_states_get_the_documented_errors", 64, |t, pid, m, api| {
        let before = t.check();
        for bad in [0, u32::MAX] {
            assert_eq!(api.state(bad), Err(INVALID_VALUE), "pid {bad}");
            assert_eq!(api.lock(bad, None), INVALID_VALUE, "pid {bad}");
        }
        assert_eq!(api.lock(4_000_000, None), INVALID_VALUE, "no such process");
        // A live process that never initialized CUDA (this one) has no CUDA state to act on.
        let me = std::process::id();
        assert_eq!(api.state(me), Err(NOT_INITIALIZED));
        assert_eq!(api.restore_tid(me), Err(NOT_INITIALIZED));
        assert_eq!(api.lock(me, None), NOT_INITIALIZED);
        assert_eq!(api.checkpoint(me), NOT_INITIALIZED);
        // Null out-pointers, reserved fields set.
        assert_eq!(
            call!(api.lib, cuCheckpointProcessGetState(pid as c_int, std::ptr::null_mut()) as fn(c_int, *mut u32)),
            INVALID_VALUE
        );
        let mut a = LockArgs { reserved0: 1, ..Default::default() };
        assert_eq!(
            call!(api.lib, cuCheckpointProcessLock(pid as c_int, &mut a) as fn(c_int, *mut LockArgs)),
            INVALID_VALUE
        );
        let mut r = [0u64; 8];
        r[7] = 1;
        assert_eq!(
            call!(api.lib, cuCheckpointProcessRestore(pid as c_int, &mut r) as fn(c_int, *mut [u64; 8])),
            INVALID_VALUE
        );
        // Each call in a state it does not apply to.
        assert_eq!(api.checkpoint(pid), ILLEGAL_STATE);
        assert_eq!(api.restore(pid), ILLEGAL_STATE);
        assert_eq!(api.unlock(pid), ILLEGAL_STATE);
        assert_eq!(api.lock(pid, None), SUCCESS);
        assert_eq!(api.lock(pid, None), ILLEGAL_STATE);
        assert_eq!(api.restore(pid), ILLEGAL_STATE);
        assert_eq!(api.checkpoint(pid), SUCCESS);
        assert_eq!(api.checkpoint(pid), ILLEGAL_STATE);
        assert_eq!(api.unlock(pid), ILLEGAL_STATE);
        // No room to restore: refused, still checkpointed, nothing taken; room again: restored.
        let free = m.memory_info(0, 0).unwrap().free;
        m.alloc(0, 0, free - 32 * MIB).unwrap();
        assert_eq!(api.restore(pid), OUT_OF_MEMORY);
        assert_eq!(api.state(pid), Ok(CHECKPOINTED));
        m.free(0, 0, free - 32 * MIB);
        assert_eq!(api.restore(pid), SUCCESS);
        assert_eq!(api.unlock(pid), SUCCESS);
        assert_eq!(t.check(), before);
    });
}

#[test]
fn memory_shared_with_another_process_cannot_cross_a_checkpoint() {
    with_target("memory_shared_with_another_process_cannot_cross_a_checkpoint", 16, |t, pid, m, api| {
        assert_eq!(t.ask("ipc", "exported"), "0");
        let before = t.check();
        let used = used_on_gpu0(m);
        assert_eq!(api.lock(pid, None), SUCCESS);
        assert_eq!(api.checkpoint(pid), NOT_SUPPORTED);
        assert_eq!(api.state(pid), Ok(LOCKED), "refused before anything moved");
        assert_eq!(used_on_gpu0(m), used);
        assert_eq!(api.unlock(pid), SUCCESS);
        assert_eq!(t.check(), before);
    });
}

#[test]
fn a_parked_process_that_is_killed_leaves_nothing_behind() {
    with_target("a_parked_process_that_is_killed_leaves_nothing_behind", 64, |t, pid, m, api| {
        assert_eq!(api.lock(pid, None), SUCCESS);
        assert_eq!(api.checkpoint(pid), SUCCESS);
        assert_eq!(used_on_gpu0(m), 0);
        t.child.kill().unwrap();
        t.child.wait().unwrap();
        // Its slot is reaped with its parked books; its host copy was its own memory.
        assert_eq!(api.state(pid), Err(INVALID_VALUE), "gone");
        assert!(m.processes(0, None).unwrap().is_empty());
        let info = m.memory_info(0, 0).unwrap();
        assert_eq!(info.used, 0);
        m.alloc(0, 0, info.free).unwrap();
        m.free(0, 0, info.free);
    });
}

#[test]
fn a_process_in_a_pid_namespace_of_its_own_is_reached_by_the_pid_its_caller_sees() {
    with_api("a_process_in_a_pid_namespace_of_its_own_is_reached_by_the_pid_its_caller_sees", |node, m, api| {
        // A container's process: pid 1 in a PID namespace of its own (unshare needs root).
        if !std::process::Command::new("unshare").args(["--pid", "--fork", "true"]).status().is_ok_and(|s| s.success())
        {
            assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "unshare --pid failed (not root?)");
            println!("SKIP: unshare --pid failed (not root?)");
            return;
        }
        let mut t = Target::start_under(node, 16, Some(&["unshare", "--pid", "--fork"]));
        // The target is unshare's child; the caller names it by the pid it sees.
        let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", t.pid())).unwrap();
        let pid: u32 = children.split_whitespace().next().unwrap().parse().unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        assert!(status.lines().any(|l| l.starts_with("NSpid:") && l.ends_with("\t1")), "pid 1 inside: {status}");
        let before = t.check();
        // Pid 1 in the caller's view is its own init, never the other namespace's pid 1.
        assert_eq!(api.state(1), Err(NOT_INITIALIZED));
        assert_eq!(api.lock(1, None), NOT_INITIALIZED);
        assert_eq!(api.state(pid), Ok(RUNNING));
        assert_eq!(api.lock(pid, None), SUCCESS);
        assert_eq!(api.checkpoint(pid), SUCCESS);
        assert!(m.processes(0, None).unwrap().is_empty(), "parked: unlisted");
        assert_eq!(api.restore(pid), SUCCESS);
        assert_eq!(api.unlock(pid), SUCCESS);
        assert_eq!(t.check(), before);
    });
}
