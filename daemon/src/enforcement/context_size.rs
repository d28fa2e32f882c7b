//! Context sizes: what a CUDA context takes on each GPU, measured by tesserad and published into
//! every allocation's directory as `context-sizes` (`tessera_region::context_sizes`), so that the
//! shim charges a process's first context that size without loading NVML to measure it.
//!
//! The figure must come from something the tenant cannot write (the region's `context_hint` is
//! the container's): tesserad measures it itself. For a GPU that holds a share (not a whole GPU,
//! whose tenant would see the probe take its memory) and has no figure yet, it starts a probe, `tesserad --measure-context`, a child
//! of its own that loads the driver's `libcuda.so.1` (beside the NVML tesserad uses), makes the
//! GPU's primary context with default flags, says `ready` and waits; the figure is NVML's
//! per-process figure for that child on that GPU, read by tesserad (the child reports nothing
//! itself). One probe at a time, on a thread of its own, never on the poll; a GPU whose probe
//! fails is tried three times in all (a GPU in exclusive-process mode under a tenant, say), then
//! left to the shim's own measurement. MIG devices are not probed (their processes measure), nor
//! is a GPU with less than 1 GiB promised to no allocation (the probe would take a tenant's room).
//!
//! A figure is kept in tesserad's state (`<state_dir>/context-sizes-<driver version>`, 0600,
//! written atomically) and taken from there at the next start under the same driver: a restart
//! does not probe again (the probe's context would stand beside tenants' memory for a moment).
//! A kept file that does not read back whole is moved aside (`.corrupt`, as the daemon's other state: `state::durable::move_aside`; a warning
//! naming both paths) and its GPUs are measured again.
//!
//! The file is root's, 0644, written atomically into the allocation's directory, which the
//! container sees read-only; written when the table changes and once to each new allocation
//! (within the enforcement loop's 50 ms slice after its record: a process started before then
//! measures, as before).
//! Enforcement keeps comparing NVML's per-process figures with the limit, so a context that took
//! more than its figure cannot pass the limit unnoticed (docs/security.md).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;

use nvml_wrapper::enums::device::UsedGpuMemory;
use tessera_region::context_sizes::{CONTEXT_MAX, CONTEXT_MIN, CONTEXT_SIZES_FILE, ContextSizes};

use crate::carve::GpuRoom;
use crate::node::NodeController;
use crate::state::Allocation;

/// The probe's argument (`tesserad --measure-context LIBCUDA UUID`).
pub const PROBE_ARG: &str = "--measure-context";
/// Probes a GPU gets before it is left to the shim's own measurement.
const TRIES: u32 = 3;
/// Memory of a GPU that no allocation was promised, needed before a probe's context may take
/// some of it (a context is a few hundred MiB): on a GPU carved full, the probe could take memory
/// a tenant is entitled to and fail one of its allocations, so it is left to the shim's own
/// measurement there.
const PROBE_ROOM: u64 = 1 << 30;

/// The table, the probe running, and what each allocation's directory holds.
#[derive(Debug, Default)]
pub struct Publisher {
    table: ContextSizes,
    /// Bumped at each change of the table.
    version: u64,
    /// The version each allocation's directory holds.
    published: HashMap<String, u64>,
    probe: Option<(String, JoinHandle<Result<u64, String>>)>,
    tries: HashMap<String, u32>,
    /// The running probe's pid (0: none), which the poll leaves out of its judgement.
    probe_pid: Arc<AtomicU32>,
    /// (the store's change count, the table's version) when every directory was last written:
    /// nothing to do until one moves.
    done: Option<(Option<u64>, u64)>,
    /// Where the figures are kept across restarts (`None` inside: no driver version to key them
    /// by); `None`: not looked at yet.
    kept: Option<Option<PathBuf>>,
}

impl Publisher {
    /// The running probe's pid, if any: a process of tesserad's, of no allocation.
    pub fn probe_pid(&self) -> Option<u32> {
        Some(self.probe_pid.load(Ordering::SeqCst)).filter(|&p| p != 0)
    }

    /// The table as measured so far.
    pub fn table(&self) -> &ContextSizes {
        &self.table
    }

    /// One step, at each poll: takes a finished probe's figure, starts the next probe, writes
    /// the file where it is missing or old.
    /// (`changes`: the store's change count the records are from.)
    pub fn step(&mut self, controller: &Arc<NodeController>, allocations: &[Allocation], changes: Option<u64>) {
        if self.kept.is_none() {
            let path = kept_path(controller);
            if let Some(p) = &path {
                self.take_kept(p);
            }
            self.kept = Some(path);
        }
        self.finish_probe();
        if self.probe.is_none()
            && let Some(uuid) = self.next_gpu(allocations, &controller.allocator().rooms())
        {
            self.start_probe(controller, uuid);
        }
        self.publish(controller, allocations, changes);
    }

    fn finish_probe(&mut self) {
        if !self.probe.as_ref().is_some_and(|(_, h)| h.is_finished()) {
            return;
        }
        let Some((uuid, handle)) = self.probe.take() else { return };
        let result = handle.join().unwrap_or_else(|_| Err("the probe's thread panicked".into()));
        match result {
            Ok(bytes) if self.table.set(&uuid, bytes) => {
                self.version += 1;
                tracing::info!(gpu = %uuid, bytes, "context size measured; published to the GPU's allocations");
                if let Some(Some(path)) = &self.kept
                    && let Err(e) = self.table.write_atomic_private(path)
                {
                    tracing::warn!(error = %e, "context sizes not kept: the next start measures them again");
                }
            }
            Ok(bytes) => tracing::warn!(gpu = %uuid, bytes, "context size measured out of range; not published"),
            Err(e) => tracing::warn!(gpu = %uuid, error = %e, "context size not measured; the shim measures it"),
        }
    }

    /// Takes the figures kept at `path` by an earlier start under the same driver; a file that
    /// does not read back whole is moved aside, said, and its GPUs measured again.
    fn take_kept(&mut self, path: &Path) {
        if !path.exists() {
            return;
        }
        match ContextSizes::load(path) {
            Some(kept) => {
                let mut taken = 0;
                for (uuid, bytes) in kept.entries() {
                    taken += usize::from(self.table.set(uuid, *bytes));
                }
                if taken > 0 {
                    self.version += 1;
                }
                tracing::info!(file = %path.display(), gpus = taken, "context sizes kept from an earlier start under this driver: not measured again");
            }
            None => match crate::state::durable::move_aside(path) {
                Ok(aside) => tracing::warn!(file = %path.display(), moved_to = %aside.display(),
                    "kept context sizes are damaged: moved aside; the GPUs are measured again"),
                Err(e) => tracing::warn!(file = %path.display(), error = %e,
                    "kept context sizes are damaged and cannot be moved aside; the GPUs are measured again"),
            },
        }
    }

    /// A GPU shared by allocations (a whole GPU's tenant would see the probe's context take
    /// its memory), with no figure, tries left, and [`PROBE_ROOM`] promised to none (`rooms`:
    /// the GPUs and their memory).
    fn next_gpu(&self, allocations: &[Allocation], rooms: &[GpuRoom]) -> Option<String> {
        allocations
            .iter()
            .flat_map(|a| &a.devices)
            .filter(|d| !d.whole && d.physical_uuid.starts_with("GPU-"))
            .map(|d| &d.physical_uuid)
            .find(|u| {
                self.table.get(u).is_none()
                    && self.tries.get(*u).copied().unwrap_or(0) < TRIES
                    && unpromised(u, allocations, rooms) >= PROBE_ROOM
            })
            .cloned()
    }

    fn start_probe(&mut self, controller: &Arc<NodeController>, uuid: String) {
        // Only tesserad itself answers the probe's argument (not a bench or a test binary).
        let Some(exe) = std::env::current_exe().ok().filter(|e| e.file_name().is_some_and(|n| n == "tesserad")) else {
            self.tries.insert(uuid, TRIES);
            return;
        };
        *self.tries.entry(uuid.clone()).or_default() += 1;
        let cuda = cuda_library(controller.session().library());
        let (controller, pid, gpu) = (Arc::clone(controller), Arc::clone(&self.probe_pid), uuid.clone());
        let spawned = std::thread::Builder::new()
            .name("context-probe".into())
            .spawn(move || measure(&controller, &exe, &cuda, &gpu, &pid));
        match spawned {
            Ok(h) => self.probe = Some((uuid, h)),
            Err(e) => tracing::warn!(error = %e, "context size: no thread for the probe"),
        }
    }

    /// Writes the table into each live allocation's directory that lacks this version (between
    /// polls too: a new allocation gets it within the loop's 50 ms slice). `changes`: the
    /// store's change count the records are from; with it and the table unchanged since every
    /// directory was written, nothing is looked at.
    pub fn publish(&mut self, controller: &Arc<NodeController>, allocations: &[Allocation], changes: Option<u64>) {
        if self.table.is_empty() || self.done == Some((changes, self.version)) {
            return;
        }
        self.published.retain(|id, _| allocations.iter().any(|a| &a.id == id));
        let dirs = controller.allocator().dirs();
        let mut all = true;
        for a in allocations {
            if self.published.get(&a.id) == Some(&self.version) {
                continue;
            }
            let dir = dirs.dir(&a.id);
            // A directory not made yet (or gone): tried again next time.
            if !dir.is_dir() {
                all = false;
                continue;
            }
            match self.table.write_atomic(&dir.join(CONTEXT_SIZES_FILE)) {
                Ok(()) => {
                    self.published.insert(a.id.clone(), self.version);
                }
                Err(e) => {
                    all = false;
                    tracing::debug!(allocation = %a.id, error = %e, "context sizes not written");
                }
            }
        }
        self.done = all.then_some((changes, self.version));
    }
}

/// Where the figures are kept: `<state_dir>/context-sizes-<driver version>`, one file per driver
/// version (a context's size is the driver's: another version measures again). `None` without a
/// version fit for a file name.
fn kept_path(controller: &NodeController) -> Option<PathBuf> {
    let view = controller.view();
    let version = &view.inventory.driver_version;
    let fit = !version.is_empty()
        && version.len() <= 64
        && version.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    fit.then(|| view.config.state_dir.join(format!("{CONTEXT_SIZES_FILE}-{version}")))
}

/// Memory of GPU `uuid` that no allocation of `allocations` holds (one without a memory limit
/// holds it all); a GPU not in `rooms`: none.
fn unpromised(uuid: &str, allocations: &[Allocation], rooms: &[GpuRoom]) -> u64 {
    let Some(total) = rooms.iter().find(|g| g.uuid.eq_ignore_ascii_case(uuid)).map(|g| g.memory_total) else {
        return 0;
    };
    let promised: u64 = allocations
        .iter()
        .flat_map(|a| &a.devices)
        .filter(|d| d.physical_uuid.eq_ignore_ascii_case(uuid))
        .map(|d| d.holds().0.unwrap_or(total))
        .sum();
    total.saturating_sub(promised)
}

/// The driver's `libcuda.so.1` beside its NVML, or the simulated node's one library.
fn cuda_library(nvml_library: &Path) -> PathBuf {
    match nvml_library.file_name().and_then(|n| n.to_str()) {
        Some(n) if n.starts_with("libnvidia-ml") => nvml_library.with_file_name("libcuda.so.1"),
        _ => nvml_library.to_path_buf(),
    }
}

/// Runs the probe for GPU `uuid` and reads its context's size from NVML.
fn measure(controller: &NodeController, exe: &Path, cuda: &Path, uuid: &str, pid: &AtomicU32) -> Result<u64, String> {
    let mut child = Command::new(exe)
        .arg(PROBE_ARG)
        .arg(cuda)
        .arg(uuid)
        .env_remove("LD_PRELOAD")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("CUDA_DEVICE_MAX_CONNECTIONS")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    pid.store(child.id(), Ordering::SeqCst);
    let mut line = String::new();
    let read = child.stdout.take().map(|o| BufReader::new(o).read_line(&mut line));
    let figure = if line.trim() == "ready" {
        own_usage(controller, uuid, child.id())
    } else {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        Err(format!("the probe did not make a context ({read:?}): {}", err.trim()))
    };
    // Its end frees the context.
    drop(child.stdin.take());
    let _ = child.wait();
    pid.store(0, Ordering::SeqCst);
    figure.and_then(|b| {
        if (CONTEXT_MIN..=CONTEXT_MAX).contains(&b) { Ok(b) } else { Err(format!("{b} bytes: out of range")) }
    })
}

/// NVML's figure for process `pid` on GPU `uuid`.
fn own_usage(controller: &NodeController, uuid: &str, pid: u32) -> Result<u64, String> {
    let device = controller.session().nvml().device_by_uuid(uuid).map_err(|e| e.to_string())?;
    let listed = device.running_compute_processes().map_err(|e| e.to_string())?;
    match listed.iter().find(|p| p.pid == pid).map(|p| &p.used_gpu_memory) {
        Some(UsedGpuMemory::Used(b)) => Ok(*b),
        Some(UsedGpuMemory::Unavailable) => Err("NVML gives no figure for the probe".into()),
        None => Err("NVML does not list the probe".into()),
    }
}

/// The probe itself (`tesserad --measure-context LIBCUDA UUID`): makes the GPU's primary
/// context, says `ready`, and holds it until its input closes.
pub fn probe_main(args: &[String]) -> ExitCode {
    let [cuda, uuid] = args else {
        eprintln!("usage: tesserad {PROBE_ARG} LIBCUDA GPU-UUID");
        return ExitCode::from(2);
    };
    match make_context(Path::new(cuda), uuid) {
        Ok(lib) => {
            println!("ready");
            let _ = std::io::stdout().flush();
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            drop(lib);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tesserad {PROBE_ARG}: {e}");
            ExitCode::from(1)
        }
    }
}

type CuInit = unsafe extern "C" fn(u32) -> i32;
type CuCount = unsafe extern "C" fn(*mut i32) -> i32;
type CuUuid = unsafe extern "C" fn(*mut [u8; 16], i32) -> i32;
type CuRetain = unsafe extern "C" fn(*mut *mut std::ffi::c_void, i32) -> i32;

/// Loads the driver and retains GPU `uuid`'s primary context (held until the process ends).
fn make_context(cuda: &Path, uuid: &str) -> Result<libloading::Library, String> {
    // SAFETY: loading the driver's library runs only its own initializers.
    let lib = unsafe { libloading::Library::new(cuda) }.map_err(|e| e.to_string())?;
    // SAFETY: each type is cuda.h's signature of the function named.
    let (init, count, get_uuid, retain) = unsafe {
        let f = |e: libloading::Error| e.to_string();
        (
            *lib.get::<CuInit>(b"cuInit\0").map_err(f)?,
            *lib.get::<CuCount>(b"cuDeviceGetCount\0").map_err(f)?,
            *lib.get::<CuUuid>(b"cuDeviceGetUuid\0").map_err(f)?,
            *lib.get::<CuRetain>(b"cuDevicePrimaryCtxRetain\0").map_err(f)?,
        )
    };
    let ck = |what: &str, rc: i32| if rc == 0 { Ok(()) } else { Err(format!("{what}: CUDA error {rc}")) };
    let mut n = 0;
    // SAFETY: the driver's functions, with valid out-pointers.
    unsafe {
        ck("cuInit", init(0))?;
        ck("cuDeviceGetCount", count(&mut n))?;
    }
    for ordinal in 0..n {
        let mut u = [0u8; 16];
        // SAFETY: a 16-byte out-pointer and an ordinal below the count.
        unsafe { ck("cuDeviceGetUuid", get_uuid(&mut u, ordinal))? };
        if uuid_text(&u).eq_ignore_ascii_case(uuid) {
            let mut ctx = std::ptr::null_mut();
            // SAFETY: a valid out-pointer; the context is never released (the process's end).
            unsafe { ck("cuDevicePrimaryCtxRetain", retain(&mut ctx, ordinal))? };
            return Ok(lib);
        }
    }
    Err(format!("no CUDA device {uuid}"))
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML spells a GPU's UUID.
fn uuid_text(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::tests::dev;
    use crate::state::{ContainerIdentity, Source};

    fn share(id: &str, uuid: &str, gib: u64) -> Allocation {
        Allocation {
            id: id.into(),
            resource: "node-api/gpu-share".into(),
            container: ContainerIdentity::default(),
            source: Source::NodeApi,
            created_unix_ns: 1,
            devices: vec![dev(&format!("{uuid}::{id}"), uuid, Some(gib << 30), Some(10))],
            claim: None,
        }
    }

    #[test]
    fn a_gpu_is_probed_only_where_memory_promised_to_no_share_is_left() {
        let rooms = crate::allocator::tests::rooms();
        let (a, b) = (rooms[0].uuid.clone(), rooms[1].uuid.clone());
        let total = rooms[0].memory_total >> 30;
        let p = Publisher::default();
        // GPU a carved to within less than PROBE_ROOM of full: left alone; GPU b has room.
        let full = vec![share("s1", &a, total - 1), share("s2", &a, 1)];
        assert_eq!(unpromised(&a, &full, &rooms), 0);
        assert_eq!(p.next_gpu(&full, &rooms), None, "a GPU carved full is not probed");
        let mut both = full.clone();
        both.push(share("s3", &b, 2));
        assert_eq!(p.next_gpu(&both, &rooms), Some(b.clone()));
        let roomy = vec![share("s1", &a, total - 2)];
        assert_eq!(unpromised(&a, &roomy, &rooms), 2 << 30);
        assert_eq!(p.next_gpu(&roomy, &rooms), Some(a.clone()));
        assert_eq!(p.next_gpu(&roomy, &[]), None, "a GPU not known to the allocator is not probed");
    }

    #[test]
    fn the_driver_library_is_found_beside_nvml() {
        assert_eq!(
            cuda_library(Path::new("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")),
            Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
        );
        assert_eq!(cuda_library(Path::new("/opt/sim/libtessera_sim.so")), Path::new("/opt/sim/libtessera_sim.so"));
        let u = [0x5a, 0x1c, 0x0b, 0x62, 0x0e, 0x7e, 0x4f, 0x5b, 0x8c, 0x1e, 0x2b, 0x8a, 0x3d, 0x9e, 0x4f, 0x10];
        assert_eq!(uuid_text(&u), "GPU-5a1c0b62-0e7e-4f5b-8c1e-2b8a3d9e4f10");
    }
}
