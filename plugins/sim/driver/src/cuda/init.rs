//! `cuInit`, `cuDriverGetVersion`, and the device list: which GPUs and MIG devices CUDA
//! enumerates, in which order, under `CUDA_VISIBLE_DEVICES`.
//!
//! The list is fixed by the first successful `cuInit`, as a real driver fixes it: a GPU switched to
//! MIG mode or a compute instance created later is not seen by a process already initialized.

use std::ffi::c_int;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};
use std::sync::{Mutex, OnceLock};

use tessera_abi::cuda_exports;
use tessera_sim_model::{GpuIdentity, GpuModel, Node};

use super::context::Primary;
use super::{CUresult, INVALID_DEVICE, R, run};

/// One CUDA device: a whole GPU, or one MIG compute instance.
pub(crate) struct Device {
    pub ordinal: c_int,
    pub gpu: u32,
    /// Execution unit in the model: 0 for the whole GPU, 1 + compute-instance slot for MIG.
    pub unit: usize,
    /// Memory domain in the model: 0 for the whole GPU, 1 + GPU-instance slot for MIG.
    pub domain: usize,
    pub ident: &'static GpuIdentity,
    pub model: &'static GpuModel,
    /// `cuDeviceGetName`: the board's name, with the MIG profile for a MIG device.
    pub name: String,
    pub uuid: [u8; 16],
    pub sm_count: u32,
    /// `cuDeviceTotalMem`: the board's memory, or the GPU instance's.
    pub total_mem: u64,
    /// (GPU instance id, compute instance id) of a MIG device.
    pub mig: Option<(u32, u32)>,
    /// The primary context's state.
    pub primary: Mutex<Primary>,
    /// Handle of the device's current memory pool (0: the default pool, made on first use).
    pub mem_pool: AtomicUsize,
    /// Handle of the default memory pool once made.
    pub default_pool: Mutex<usize>,
}

/// The initialized driver: the node and the devices this process enumerates.
pub(crate) struct Driver {
    pub node: &'static Node,
    pub devices: Vec<Device>,
}

static DRIVER: OnceLock<Driver> = OnceLock::new();
static INIT_LOCK: Mutex<()> = Mutex::new(());
/// Set in a child forked after `cuInit`: CUDA state does not survive `fork`.
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn forked_child() {
    if DRIVER.get().is_some() {
        FORKED.store(true, Relaxed);
    }
}

/// The driver, once `cuInit` succeeded (`NOT_INITIALIZED` before, and in a forked child).
pub(crate) fn driver() -> R<&'static Driver> {
    if FORKED.load(Relaxed) {
        return Err(CUresult::CUDA_ERROR_NOT_INITIALIZED);
    }
    DRIVER.get().ok_or(CUresult::CUDA_ERROR_NOT_INITIALIZED)
}

impl Driver {
    /// The device with this ordinal.
    pub(crate) fn device(&self, ordinal: c_int) -> R<&Device> {
        usize::try_from(ordinal).ok().and_then(|i| self.devices.get(i)).ok_or(INVALID_DEVICE)
    }
}

/// A CUDA device the node offers, before `CUDA_VISIBLE_DEVICES` selects among them.
struct Candidate {
    gpu: u32,
    unit: usize,
    domain: usize,
    name: String,
    uuid_str: String,
    sm_count: u32,
    total_mem: u64,
    mig: Option<(u32, u32)>,
}

/// Every GPU with the CUDA devices it offers: itself, or in MIG mode its compute instances (none
/// if it has none). A GPU off the bus offers nothing.
fn offered(node: &Node) -> Vec<(u32, Vec<Candidate>)> {
    let mut out = Vec::new();
    for id in node.gpus() {
        let gpu = id.index;
        if node.check_gpu(gpu).is_err() {
            out.push((gpu, Vec::new()));
            continue;
        }
        let mig_on = matches!(node.mig_mode(gpu), Ok((true, _)));
        if !mig_on {
            out.push((
                gpu,
                vec![Candidate {
                    gpu,
                    unit: 0,
                    domain: 0,
                    name: id.model.name.to_string(),
                    uuid_str: id.uuid.clone(),
                    sm_count: id.model.sm_count,
                    total_mem: id.model.cuda_total_mem_bytes,
                    mig: None,
                }],
            ));
            continue;
        }
        let gis = node.gpu_instances(gpu).unwrap_or_default();
        let cis = node.compute_instances(gpu, None).unwrap_or_default();
        let devs = cis
            .iter()
            .filter_map(|ci| {
                let gi = gis.iter().find(|g| g.id == ci.gi_id)?;
                Some(Candidate {
                    gpu,
                    unit: ci.unit(),
                    domain: ci.domain(),
                    name: format!("{} MIG {}", id.model.name, ci.profile.name_in(gi.profile)),
                    uuid_str: id.mig_uuid(ci.gi_id, ci.id, ci.serial),
                    sm_count: ci.sm_count,
                    total_mem: gi.profile.memory_bytes(),
                    mig: Some((ci.gi_id, ci.id)),
                })
            })
            .collect();
        out.push((gpu, devs));
    }
    out
}

/// The GPUs this process can open, as the real driver enumerates them: where the driver's control
/// node `<dev>/nvidiactl` exists (a GPU node, or a container given GPUs), a GPU whose
/// `<dev>/nvidia<index>` is missing is not there (a container handed one GPU's node sees that GPU
/// alone, as device 0). Without `nvidiactl` (a host with no driver files: the simulated node's
/// own tests) every GPU.
fn reachable(offered: Vec<(u32, Vec<Candidate>)>, dev: &Path) -> Vec<(u32, Vec<Candidate>)> {
    if !dev.join("nvidiactl").exists() {
        return offered;
    }
    offered.into_iter().filter(|(gpu, _)| dev.join(format!("nvidia{gpu}")).exists()).collect()
}

/// Applies `CUDA_VISIBLE_DEVICES` as the real driver does: a comma-separated list of GPU indices,
/// `GPU-<uuid>` and `MIG-<uuid>` entries (a unique prefix of the UUID is enough; the older
/// `MIG-GPU-<uuid>/<gi>/<ci>` form is accepted too), in the order given. The first entry that is
/// invalid, unknown or repeated ends the list; an empty variable hides every device.
fn select(node: &Node, offered: Vec<(u32, Vec<Candidate>)>, visible: Option<&str>) -> Vec<Candidate> {
    let Some(visible) = visible else {
        return offered.into_iter().flat_map(|(_, c)| c).collect();
    };
    let mut pool: Vec<(u32, Vec<Option<Candidate>>)> =
        offered.into_iter().map(|(g, c)| (g, c.into_iter().map(Some).collect())).collect();
    let mut chosen = Vec::new();
    let uuid_of = |gpu: u32| node.gpus()[gpu as usize].uuid.to_ascii_lowercase();
    for entry in visible.split(',').map(str::trim) {
        let lower = entry.to_ascii_lowercase();
        // Indices into the GPU list: every CUDA device that GPU offers.
        let gpu_pos = if !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit()) {
            entry.parse::<usize>().ok().filter(|&i| i < pool.len())
        } else if lower.starts_with("gpu-") {
            unique(pool.iter().enumerate().filter(|(_, (g, _))| uuid_of(*g).starts_with(&lower)).map(|(i, _)| i))
        } else {
            None
        };
        if let Some(pos) = gpu_pos {
            let slot = &mut pool[pos].1;
            if slot.iter().any(Option::is_none) {
                break; // listed twice
            }
            chosen.extend(slot.iter_mut().filter_map(Option::take));
            continue;
        }
        let mig = if let Some(rest) = lower.strip_prefix("mig-gpu-") {
            // MIG-GPU-<uuid>/<gi>/<ci>
            let mut parts = rest.split('/');
            let (u, gi, ci) =
                (parts.next(), parts.next().and_then(|s| s.parse().ok()), parts.next().and_then(|s| s.parse().ok()));
            match (u, gi, ci, parts.next()) {
                (Some(u), Some(gi), Some(ci), None) => {
                    let want = format!("gpu-{u}");
                    find_mig(&pool, |g, c| uuid_of(g) == want && c.mig == Some((gi, ci)))
                }
                _ => None,
            }
        } else if lower.starts_with("mig-") {
            let matches: Vec<_> = pool
                .iter()
                .enumerate()
                .flat_map(|(i, (_, cs))| cs.iter().enumerate().map(move |(j, c)| (i, j, c)))
                .filter(|(_, _, c)| c.as_ref().is_some_and(|c| c.uuid_str.to_ascii_lowercase().starts_with(&lower)))
                .map(|(i, j, _)| (i, j))
                .collect();
            if matches.len() == 1 { Some(matches[0]) } else { None }
        } else {
            None
        };
        match mig.and_then(|(i, j)| pool[i].1[j].take()) {
            Some(c) => chosen.push(c),
            None => break,
        }
    }
    chosen
}

fn unique(mut it: impl Iterator<Item = usize>) -> Option<usize> {
    let first = it.next()?;
    it.next().is_none().then_some(first)
}

fn find_mig(pool: &[(u32, Vec<Option<Candidate>>)], want: impl Fn(u32, &Candidate) -> bool) -> Option<(usize, usize)> {
    pool.iter()
        .enumerate()
        .find_map(|(i, (g, cs))| cs.iter().position(|c| c.as_ref().is_some_and(|c| want(*g, c))).map(|j| (i, j)))
}

/// The 16 bytes of a "GPU-…"/"MIG-…" UUID string.
pub(crate) fn uuid_bytes(s: &str) -> [u8; 16] {
    let hex: Vec<u8> = s
        .split_once('-')
        .map_or(s, |(_, rest)| rest)
        .bytes()
        .filter(u8::is_ascii_hexdigit)
        .map(|b| (b as char).to_digit(16).unwrap_or(0) as u8)
        .collect();
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = hex.get(2 * i).copied().unwrap_or(0) << 4 | hex.get(2 * i + 1).copied().unwrap_or(0);
    }
    out
}

fn init() -> R {
    let _g = INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if DRIVER.get().is_some() {
        return Ok(());
    }
    let node = crate::process::node().map_err(|_| CUresult::CUDA_ERROR_NO_DEVICE)?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let chosen = select(node, reachable(offered(node), Path::new("/dev")), visible.as_deref());
    if chosen.is_empty() {
        return Err(CUresult::CUDA_ERROR_NO_DEVICE);
    }
    let devices = chosen
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let ident = &node.gpus()[c.gpu as usize];
            Device {
                ordinal: i as c_int,
                gpu: c.gpu,
                unit: c.unit,
                domain: c.domain,
                ident,
                model: ident.model,
                uuid: uuid_bytes(&c.uuid_str),
                name: c.name,
                sm_count: c.sm_count,
                total_mem: c.total_mem,
                mig: c.mig,
                primary: Mutex::new(Primary::default()),
                mem_pool: AtomicUsize::new(0),
                default_pool: Mutex::new(0),
            }
        })
        .collect();
    // SAFETY: registering a fork handler with a plain extern "C" fn is always sound.
    unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    super::checkpoint::start(node)?;
    let _ = DRIVER.set(Driver { node, devices });
    Ok(())
}

cuda_exports! {
    /// `cuInit`: opens the node and fixes the device list (flags must be 0).
    fn cuInit(Flags) {
        run(|| {
            if FORKED.load(Relaxed) {
                return Err(CUresult::CUDA_ERROR_NOT_INITIALIZED);
            }
            if Flags != 0 {
                return Err(super::INVALID_VALUE);
            }
            init()
        })
    }

    /// `cuDriverGetVersion`: the node's CUDA driver version (works before `cuInit`, as the real one does).
    fn cuDriverGetVersion(driverVersion) {
        run(|| {
            let v = crate::process::node().map_or(12080, |n| n.description().cuda_driver_version);
            // SAFETY: driverVersion is the caller's out-pointer.
            unsafe { super::put(driverVersion, v as c_int) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_bytes_reads_the_hex() {
        let b = uuid_bytes("GPU-01234567-89ab-cdef-0123-456789abcdef");
        assert_eq!(b[0], 0x01);
        assert_eq!(b[7], 0xef);
        assert_eq!(b[15], 0xef);
        assert_eq!(uuid_bytes("MIG-ffffffff-0000-0000-0000-000000000001")[15], 1);
    }

    fn candidate(gpu: u32) -> (u32, Vec<Candidate>) {
        let c = Candidate {
            gpu,
            unit: 0,
            domain: 0,
            name: String::new(),
            uuid_str: format!("GPU-{gpu}"),
            sm_count: 1,
            total_mem: 1,
            mig: None,
        };
        (gpu, vec![c])
    }

    #[test]
    fn a_container_given_one_gpus_node_sees_that_gpu_alone() {
        let dev = tempfile::tempdir().expect("tempdir");
        let gpus = |list: Vec<(u32, Vec<Candidate>)>| list.iter().map(|(g, _)| *g).collect::<Vec<_>>();
        // No driver files: every GPU (the sim's own tests on a bare host).
        assert_eq!(gpus(reachable(vec![candidate(0), candidate(1)], dev.path())), [0, 1]);
        // The control node and GPU 1's: GPU 1 only.
        std::fs::write(dev.path().join("nvidiactl"), "").expect("nvidiactl");
        std::fs::write(dev.path().join("nvidia1"), "").expect("nvidia1");
        assert_eq!(gpus(reachable(vec![candidate(0), candidate(1)], dev.path())), [1]);
        // Neither GPU's node: none.
        std::fs::remove_file(dev.path().join("nvidia1")).expect("rm");
        assert!(reachable(vec![candidate(0), candidate(1)], dev.path()).is_empty());
    }
}
