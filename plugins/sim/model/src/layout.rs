//! The fixed layout of the shared state file. Every process maps the same bytes; all fields are
//! atomics (valid when zeroed) so that reads outside the lock are never torn, and a mapped file
//! is never reinterpreted under a different layout (magic, version and size are checked).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64};

pub const MAGIC: u64 = u64::from_le_bytes(*b"TSIMNODE");
/// Bumped on every layout change (5: the header's `hold_exits`; 6: each process slot's
/// checkpoint state, [`CheckpointState`]).
pub const VERSION: u32 = 6;
/// GPUs on one node.
pub const MAX_GPUS: usize = 16;
/// GPU instances, and compute instances, on one GPU (7 is the most any MIG GPU allows).
pub const MAX_MIG: usize = 8;
/// Memory domains per GPU: 0 is the whole GPU, 1 + k is GPU-instance slot k.
pub const DOMAINS: usize = 1 + MAX_MIG;
/// Execution units per GPU: 0 is the whole GPU, 1 + k is compute-instance slot k.
pub const UNITS: usize = 1 + MAX_MIG;
/// Processes using the node at once.
pub const MAX_PROCS: usize = 256;
/// Streams per process. A real driver has no cap near this; PyTorch alone opens 32 streams per
/// priority level per device it uses (128 on one H100 before the context's own default stream,
/// which is why 128 was too few: version 4).
pub const MAX_STREAMS: usize = 1024;
/// Events per process waiting for their stream to reach them.
pub const MAX_PENDING_EVENTS: usize = 64;
/// NVML events kept for readers.
pub const EVENT_RING: usize = 256;
/// Utilization snapshots kept per GPU.
pub const UTIL_RING: usize = 32;
/// Bytes of description text stored in the file.
pub const DESC_MAX: usize = 16 * 1024;
/// Liveness locks live at this offset + slot, past the end of the mapped data.
pub const LIVENESS_BASE: i64 = 1 << 40;

#[repr(C, align(64))]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub desc_len: AtomicU32,
    pub layout_size: AtomicU64,
    /// Set while a locked section mutates shared aggregates; a dead holder leaves it set.
    pub dirty: AtomicU32,
    /// Futex word bumped with every published event (waiters sleep on it).
    pub event_futex: AtomicU32,
    /// Sequence number of the next event.
    pub event_seq: AtomicU64,
    /// Bit per process slot in use.
    pub used_slots: [AtomicU64; MAX_PROCS / 64],
    pub lock: UnsafeCell<libc::pthread_mutex_t>,
    /// Nonzero: processes that exit are not reaped; NVML lists them, with their memory, until it
    /// is cleared (`tessera-sim exits hold|release`), as a real driver lists an exiting process
    /// while it tears its contexts down.
    pub hold_exits: AtomicU32,
}

/// A GPU instance (MIG): a memory domain and a set of compute slices.
#[repr(C)]
pub struct GiEntry {
    pub valid: AtomicU32,
    pub id: AtomicU32,
    pub nvml_profile: AtomicU32,
    pub start: AtomicU32,
}

/// A compute instance inside a GPU instance: an execution unit.
#[repr(C)]
pub struct CiEntry {
    pub valid: AtomicU32,
    /// Index into the GPU's GI table.
    pub gi_slot: AtomicU32,
    pub id: AtomicU32,
    pub nvml_profile: AtomicU32,
    pub start: AtomicU32,
    /// Creation serial (the node's event sequence at creation): a recreated instance gets a
    /// new MIG UUID, as on real GPUs.
    pub serial: AtomicU32,
}

/// Time-slicing state of one execution unit.
#[repr(C)]
pub struct UnitState {
    /// Monotonic ns up to which work has been served.
    pub served_until: AtomicU64,
    /// Total ns the unit has been executing something.
    pub busy_ns: AtomicU64,
}

/// A snapshot for utilization over a window: time, busy time, per-process served time (unit 0).
#[repr(C)]
pub struct UtilSnapshot {
    pub ts: AtomicU64,
    pub busy_ns: AtomicU64,
    pub served: [AtomicU64; MAX_PROCS],
}

#[repr(C)]
pub struct GpuState {
    pub lost: AtomicU32,
    pub mig_current: AtomicU32,
    pub mig_pending: AtomicU32,
    pub remap_pending: AtomicU32,
    pub remap_failure: AtomicU32,
    pub last_xid: AtomicU32,
    /// What the driver says the GPU needs (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): 0 none,
    /// 1 a GPU reset, 2 a node reboot. Set by faults, cleared by a reset.
    pub recovery_action: AtomicU32,
    pub _pad: AtomicU32,
    pub ecc_corrected_volatile: AtomicU64,
    pub ecc_uncorrected_volatile: AtomicU64,
    pub ecc_corrected_aggregate: AtomicU64,
    pub ecc_uncorrected_aggregate: AtomicU64,
    pub remapped_correctable: AtomicU64,
    pub remapped_uncorrectable: AtomicU64,
    pub gis: [GiEntry; MAX_MIG],
    pub cis: [CiEntry; MAX_MIG],
    pub units: [UnitState; UNITS],
    pub util_head: AtomicU64,
    pub util: [UtilSnapshot; UTIL_RING],
    /// The most memory each domain ever held at one instant (every process counted), kept under
    /// the lock by each allocation: tests prove a limit was never passed, even between samples.
    pub mem_high_water: [AtomicU64; DOMAINS],
}

/// One stream of one process.
#[repr(C)]
pub struct StreamState {
    /// gpu << 8 | unit, or FREE_STREAM.
    pub place: AtomicU32,
    pub priority: AtomicI32,
    /// Total ns of work ever submitted.
    pub submitted: AtomicU64,
    /// Total ns of work ever served; the stream is idle when served == submitted.
    pub served: AtomicU64,
    pub _pad: AtomicU64,
}
pub const FREE_STREAM: u32 = u32::MAX;

/// An event recorded on a busy stream: stamped with the time its stream reaches `ticket`.
#[repr(C)]
pub struct PendingEvent {
    pub stream: AtomicU32,
    pub generation: AtomicU32,
    pub ticket: AtomicU64,
    pub done_ts: AtomicU64,
    pub _pad: AtomicU64,
}

/// One process using the node.
#[repr(C)]
pub struct ProcSlot {
    pub pid: AtomicU32,
    /// XID of a fault that killed this process's contexts (0: none); CUDA calls then fail.
    pub sticky_xid: AtomicU32,
    pub pid_ns: AtomicU64,
    pub comm: [AtomicU64; 2],
    /// Per GPU: bit per execution unit on which the process holds a context.
    pub ctx_units: [AtomicU32; MAX_GPUS],
    /// Device memory held, per GPU and memory domain.
    pub mem: [[AtomicU64; DOMAINS]; MAX_GPUS],
    /// GPU time received, per GPU and execution unit.
    pub served: [[AtomicU64; UNITS]; MAX_GPUS],
    pub active_streams: [AtomicU64; MAX_STREAMS / 64],
    pub streams: [StreamState; MAX_STREAMS],
    pub pending_mask: AtomicU64,
    pub events: [PendingEvent; MAX_PENDING_EVENTS],
    pub checkpoint: CheckpointState,
}

/// Replies kept per process: a caller reads its own however many others were answered since,
/// up to this many.
pub const CHECKPOINT_REPLIES: usize = 8;

/// One process's part in the driver's checkpoint API (`cuCheckpointProcess*`, `checkpoint.rs`):
/// another process posts a request, the process's own checkpoint thread serves it.
#[repr(C)]
pub struct CheckpointState {
    /// `CUprocessState` (0 running, 1 locked, 2 checkpointed, 3 failed); also the futex word
    /// the process's CUDA calls wait on while it is not running.
    pub state: AtomicU32,
    /// Thread id of the process's checkpoint thread (0: none, the process never ran `cuInit`).
    pub restore_tid: AtomicU32,
    /// The request being served: ticket << 32 | lock timeout ms << 4 | op (0: none).
    pub request: AtomicU64,
    /// Futex word bumped with every request posted (the checkpoint thread sleeps on it).
    pub request_futex: AtomicU32,
    /// Futex word bumped with every reply (callers sleep on it).
    pub reply_futex: AtomicU32,
    /// The last replies, each at its ticket modulo their count: ticket << 32 | `CUresult`.
    pub replies: [AtomicU64; CHECKPOINT_REPLIES],
    /// Tickets handed to callers.
    pub next_ticket: AtomicU32,
    /// Per GPU: the execution units the process held contexts on when checkpointed.
    pub parked_units: [AtomicU32; MAX_GPUS],
    /// Device memory moved to host memory by a checkpoint, per GPU and memory domain; not
    /// counted as used until a restore takes it back.
    pub parked_mem: [[AtomicU64; DOMAINS]; MAX_GPUS],
}

/// An NVML-visible event.
#[repr(C)]
pub struct EventRecord {
    /// seq + 1 once written (0: never written).
    pub seq_plus_one: AtomicU64,
    pub gpu: AtomicU32,
    pub kind: AtomicU32,
    pub data: AtomicU64,
    pub gi_id: AtomicU32,
    pub ci_id: AtomicU32,
    pub ts_us: AtomicU64,
}

#[repr(C)]
pub struct Shared {
    pub header: Header,
    pub desc: [AtomicU64; DESC_MAX / 8],
    pub gpus: [GpuState; MAX_GPUS],
    pub procs: [ProcSlot; MAX_PROCS],
    pub events: [EventRecord; EVENT_RING],
}

pub const LAYOUT_SIZE: usize = std::mem::size_of::<Shared>();

// SAFETY: every field is an atomic, except the mutex, which is a process-shared pthread mutex
// designed for concurrent use from many threads and processes.
unsafe impl Sync for Shared {}
