//! The accounting region: one container's shared, fixed-layout, atomics-only mapped file.
//!
//! Every process of the container maps it (through `libtessera.so`), and so does the daemon. It
//! holds per device the container's total memory use, a context-size hint and the compute
//! limiter's bucket; per process a slot with its usage and counters.
//!
//! # Not a source of limits
//! Every process of the container can write the whole region. Limits are therefore never read
//! from it: [`Region::try_reserve`] takes the limit from its caller (the shim's private copy of
//! the read-only limits file). What a container writes here can disturb its own accounting and
//! reports, never another container's limit; the daemon enforces from the driver's own numbers.
//! The layout is [`Shared`]: `#[repr(C)]`, [`LAYOUT_SIZE`] bytes, checked by magic, version and
//! size on open.
//!
//! # Crash safety without process-shared locks
//! - Reserving memory is a CAS on the device total that refuses to pass the limit; only then is
//!   the process's slot increased. Releasing decreases the slot first, then the total. A process
//!   killed between the two steps leaves the total too high (the container is refused a little
//!   early), never too low (the limit is never passed) — and only until the next reap, which
//!   [`Region::reconcile`]s: each slot carries a guard word (operations started, operations in
//!   flight) that lets a reader know when totals and slots were read with nothing half-done, and
//!   then set each total to the sum of the slots.
//! - A process's slot is alive while the process holds an open-file-description (OFD) write lock
//!   on byte `(1 << 40) + slot` of the file; the kernel drops it when the process dies, however it
//!   dies. [`Region::reap`] finds slots whose lock is gone, takes the lock itself (so one reaper
//!   wins), returns the slot's usage to the device totals and frees the slot.
//! - Claiming a slot is a CAS on its state word (FREE → LIVE with a new generation) and then the
//!   lock; the claimer checks after locking that the state word is still its own, so a reaper that
//!   got between the two steps makes it claim another slot instead of sharing one.
//! - The file is built under a temporary name and linked into place: nobody maps a half-made file.
//!
//! Hot paths ([`Region::try_reserve`], [`Region::release`], the `record_*` calls) are a handful of
//! atomic operations: no lock, no syscall, no allocation. The header and device entries are
//! populated when the region is opened and a process's slot when it joins, so they take no page
//! fault either — as long as the file lives on tmpfs (`/run`): on a disk file
//! system, the first write to a page after each writeback faults.
//!
//! # Fork
//! OFD locks belong to the open file description, which a forked child shares: the parent's slot
//! then stays alive as long as the child keeps the descriptor. A process that forks without exec
//! should open a new `Region` in the child and join from it. The descriptor is close-on-exec.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64};

use crate::sys;
use crate::trace::TraceRing;

/// Devices per container.
pub const MAX_DEVICES: usize = 16;
/// Processes per container at once.
pub const MAX_PROCS: usize = 1024;
/// Path of the region file; unset, the shim uses an anonymous region of its own.
pub const ENV_REGION: &str = "TESSERA_REGION";
/// Longest device UUID a device entry holds.
pub const MAX_UUID_LEN: usize = 64;
/// `b"TSREGION"`, first 8 bytes of every region file.
pub const MAGIC: u64 = u64::from_le_bytes(*b"TSREGION");
/// Bumped on every layout change.
pub const LAYOUT_VERSION: u32 = 3;
/// Size of the region file in bytes.
pub const LAYOUT_SIZE: usize = std::mem::size_of::<Shared>();
/// Slot `i`'s liveness lock is on byte `LIVENESS_BASE + i`, far past the mapped data.
pub const LIVENESS_BASE: i64 = 1 << 40;

// ---------------------------------------------------------------------------------------------
// Layout. Everything is an atomic and every all-zero value is valid: a fresh file needs only its
// header written. Change anything here and bump LAYOUT_VERSION.
// ---------------------------------------------------------------------------------------------

#[repr(C, align(64))]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub max_devices: AtomicU32,
    pub layout_size: AtomicU64,
    pub max_procs: AtomicU32,
    /// Non-zero: the daemon asks for a trace; processes record into [`Shared::trace`].
    pub trace_requested: AtomicU32,
    /// Bumped by the daemon after rewriting the limits file.
    pub config_generation: AtomicU64,
    /// [`ParkState`], written by tesserad while it parks or resumes the container's memory (the
    /// driver's checkpoint API). A reserved word before (zero in every region: running), so naming
    /// it changes no layout. The container can write it too: it is what the container's own
    /// views show, never what the daemon decides by.
    pub park_state: AtomicU64,
    pub _reserved: [AtomicU64; 2],
}

/// Where a container's device memory is: on its GPUs, or moved to host memory by a park.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParkState {
    Running = 0,
    Parking = 1,
    /// Checkpointed: the memory the devices' totals count is in host memory, not on the GPU.
    Parked = 2,
    Resuming = 3,
}

impl ParkState {
    /// A word read from the region (anything unknown reads as running: the memory is counted).
    pub fn from_raw(v: u64) -> ParkState {
        match v {
            1 => ParkState::Parking,
            2 => ParkState::Parked,
            3 => ParkState::Resuming,
            _ => ParkState::Running,
        }
    }
}

/// Where joins start looking for a free slot; on its own cache line.
#[repr(C, align(64))]
pub struct JoinHint {
    pub next: AtomicU64,
    pub _reserved: [AtomicU64; 7],
}

/// Atomics the compute limiter owns: zero-initialized. This crate interprets only the three
/// the daemon's ledger reads ([`crate::ledger`]); like every word here, they are the container's
/// to write, so they steer nothing but the container's own standing in the ledger.
#[repr(C)]
pub struct ComputeBucket {
    pub tokens_ns: AtomicI64,
    pub refill_ns: AtomicU64,
    pub window_start_ns: AtomicU64,
    pub window_used_ns: AtomicU64,
    /// Launches while the container had high priority: the ledger watches it change (a count,
    /// not a time, so no clock is compared across processes or time namespaces).
    pub high_launches: AtomicU64,
    /// The container's use of the GPU over its last window (ppm), for others' lending.
    pub usage_ppm: AtomicU64,
    /// Bumped with every `usage_ppm` written: the ledger counts a usage only while it is fresh.
    pub usage_updates: AtomicU64,
    pub spare: [AtomicU64; 9],
}

/// One device the container uses.
#[repr(C, align(64))]
pub struct DeviceEntry {
    /// Hash of the UUID (never 0); 0: entry free. Set once by a CAS, never changed: it is what
    /// makes two processes naming one device get one entry.
    pub key: AtomicU64,
    /// Bytes of `uuid` (0 until written; written after `key`, identically by anyone).
    pub uuid_len: AtomicU32,
    /// OOM denials of the container's processes that are gone (folded in by [`Region::reap`],
    /// saturating). Version 2 kept its SM share mirror here; limits are never read from here.
    pub exited_oom_denials: AtomicU32,
    /// Bytes a CUDA context took on this device when a process of the container last measured
    /// one (0: none yet): what the next context reserves before it is created. A hint only —
    /// any process may write it; readers bound it and true the reservation up to the measurement.
    pub context_hint: AtomicU64,
    /// The container's bytes on the device (≥ the sum of its slots').
    pub used: AtomicU64,
    /// Highest `used` seen.
    pub peak: AtomicU64,
    /// Launches, GPU time and throttled time (ns) of the container's processes that are gone,
    /// folded in by [`Region::reap`] when it frees their slots: with the live slots' counters,
    /// the container's exact totals however rarely anyone samples.
    pub exited: [AtomicU64; 3],
    pub uuid: [AtomicU64; MAX_UUID_LEN / 8],
    /// On its own cache lines, away from `used`.
    pub bucket: ComputeBucket,
}

/// One process's counters for one device.
#[repr(C)]
pub struct SlotDevice {
    pub used: AtomicU64,
    pub peak: AtomicU64,
    pub launches: AtomicU64,
    pub gpu_time_ns: AtomicU64,
    pub throttled_ns: AtomicU64,
    pub oom_denials: AtomicU64,
}

/// One process.
#[repr(C, align(64))]
pub struct ProcSlot {
    /// `generation << 2 | kind`; kind FREE (0) or LIVE (1).
    pub state: AtomicU64,
    /// Pid in the container's namespace; written last by a join (0: joining, or free).
    pub pid: AtomicU32,
    /// Pid in the host's namespace; 0 until known.
    pub host_pid: AtomicU32,
    /// Clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub start_time: AtomicU64,
    /// Monotonic ns of the last heartbeat.
    pub heartbeat_ns: AtomicU64,
    /// Process name, NUL-padded.
    pub comm: [AtomicU64; 2],
    /// Monotonic ns of the join.
    pub joined_ns: AtomicU64,
    /// Guard of memory operations: operations started << 16 | operations in flight. Lets
    /// [`Region::reconcile`] see that no reservation or release was half-done while it read.
    pub inflight: AtomicU64,
    pub devices: [SlotDevice; MAX_DEVICES],
}

/// The whole file.
#[repr(C)]
pub struct Shared {
    pub header: Header,
    pub join: JoinHint,
    pub devices: [DeviceEntry; MAX_DEVICES],
    pub slots: [ProcSlot; MAX_PROCS],
    /// On-demand trace entries (layout version 2); see [`crate::trace`].
    pub trace: TraceRing,
}

// The layout is a file format: pin it.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<Header>() == 64);
    assert!(size_of::<JoinHint>() == 64);
    assert!(size_of::<ComputeBucket>() == 128);
    assert!(offset_of!(DeviceEntry, uuid) == 64);
    assert!(offset_of!(DeviceEntry, bucket) == 128);
    assert!(size_of::<DeviceEntry>() == 256);
    assert!(size_of::<SlotDevice>() == 48);
    assert!(offset_of!(ProcSlot, devices) == 64);
    assert!(size_of::<ProcSlot>() == 832);
    assert!(offset_of!(Shared, devices) == 128);
    assert!(offset_of!(Shared, slots) == 128 + 256 * MAX_DEVICES);
    assert!(offset_of!(Shared, trace) == 856_192);
    assert!(LAYOUT_SIZE == 1_904_832);
};

/// `inflight`: one more operation started, one more in flight.
const OP_START: u64 = (1 << 16) + 1;
const BUSY_MASK: u64 = 0xFFFF;

const FREE: u64 = 0;
const LIVE: u64 = 1;

fn kind(state: u64) -> u64 {
    state & 3
}

fn next_state(state: u64, kind: u64) -> u64 {
    (((state >> 2) + 1) << 2) | kind
}

// ---------------------------------------------------------------------------------------------

/// A process's slot, from [`Region::join`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    pub index: usize,
}

/// A reservation refused: the container's total on the device and its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denied {
    pub used: u64,
    pub limit: u64,
}

/// What can go wrong opening or using a region; names the path and the reason.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: String,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a region of this build's layout.
    #[error("{path}: {reason}")]
    Incompatible { path: String, reason: String },
    #[error("{path}: all {MAX_PROCS} process slots are held by live processes")]
    Full { path: String },
    #[error("{path}: all {MAX_DEVICES} device entries are taken; no room for {uuid:?}")]
    TooManyDevices { path: String, uuid: String },
    #[error("{path}: device {uuid:?}: {reason}")]
    InvalidUuid { path: String, uuid: String, reason: String },
}

/// A container's accounting region, mapped. One per process (a second handle on the same file acts
/// as another process: its own file description, its own liveness locks).
pub struct Region {
    shared: NonNull<Shared>,
    fd: i32,
    /// The path, for messages (`"anonymous region"` for a memfd).
    name: String,
    anonymous: bool,
    /// This process's pid and comm, read when the region was opened; read again by a join from
    /// a forked child.
    info: sys::ProcInfo,
    /// Slots this handle joined: their locks are ours, so probing them would say "free".
    own: [AtomicU64; MAX_PROCS / 64],
    /// The mapping's entry in the SIGBUS guard (a shared file another process may shrink).
    guard: Option<crate::guard::Guarded>,
}

// SAFETY: the mapping holds only atomics and stays mapped for the Region's life (unmapped in
// Drop); the fd is only used for fcntl, which is thread-safe. Any thread may use a Region.
unsafe impl Send for Region {}
// SAFETY: as above: every access through &Region is an atomic operation or a syscall.
unsafe impl Sync for Region {}

impl Region {
    /// Opens the region at `path`, creating it if there is none. A new file is built under a
    /// temporary name and linked into place (of two racing creators one wins, the other opens its
    /// file), mode 0666: container processes may run as any uid. A file of another layout (magic,
    /// version or size) is refused.
    pub fn open_or_create(path: &Path) -> Result<Region, RegionError> {
        for _ in 0..3 {
            if let Some(r) = Region::open(path)? {
                return Ok(r);
            }
            Region::create(path)?;
        }
        Err(RegionError::Io {
            path: path.display().to_string(),
            op: "open",
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        })
    }

    /// A region in a memfd, private to this process: for standalone use without [`ENV_REGION`].
    /// There are no other processes; [`Region::reap`] does nothing.
    pub fn anonymous() -> Result<Region, RegionError> {
        let name = "anonymous region".to_string();
        // SAFETY: the name is a valid NUL-terminated string.
        let fd = unsafe { libc::memfd_create(c"tessera-region".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io_err(&name, "memfd_create"));
        }
        // SAFETY: fd is our fresh memfd.
        if unsafe { libc::ftruncate(fd, LAYOUT_SIZE as libc::off_t) } != 0 {
            let e = io_err(&name, "ftruncate");
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        let shared = match map(fd) {
            Ok(p) => p,
            Err(source) => {
                // SAFETY: fd is ours.
                unsafe { libc::close(fd) };
                return Err(RegionError::Io { path: name, op: "mmap", source });
            }
        };
        // SAFETY: a fresh mapping of LAYOUT_SIZE zero bytes: a valid Shared.
        init_header(unsafe { shared.as_ref() });
        // Private to this process: nobody else can shrink it, so no guard.
        Ok(Region {
            shared,
            fd,
            name,
            anonymous: true,
            info: sys::ProcInfo::current(),
            own: Default::default(),
            guard: None,
        })
    }

    /// Opens an existing region; `None` when there is no file.
    fn open(path: &Path) -> Result<Option<Region>, RegionError> {
        let name = path.display().to_string();
        let cpath = c_path(path, &name)?;
        // SAFETY: cpath is a valid C string.
        let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            let source = std::io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::ENOENT) {
                return Ok(None);
            }
            return Err(RegionError::Io { path: name, op: "open", source });
        }
        let close = |e: RegionError| {
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            e
        };
        check_file(fd, &name).map_err(close)?;
        // Installed before the first shared mapping; without it the region still works, unguarded.
        if let Err(e) = crate::guard::install() {
            eprintln!(
                "tessera: {name}: cannot install the SIGBUS guard ({e}); a shrunk region would kill this process"
            );
        }
        let shared = map(fd).map_err(|source| close(RegionError::Io { path: name.clone(), op: "mmap", source }))?;
        let guard = Some(crate::guard::Guarded::register(shared.as_ptr() as usize, LAYOUT_SIZE));
        Ok(Some(Region {
            shared,
            fd,
            name,
            anonymous: false,
            info: sys::ProcInfo::current(),
            own: Default::default(),
            guard,
        }))
    }

    /// Builds a region file under a temporary name and links it to `path` (EEXIST: someone else won).
    fn create(path: &Path) -> Result<(), RegionError> {
        let name = path.display().to_string();
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|source| RegionError::Io {
            path: name.clone(),
            op: "create directory",
            source,
        })?;
        let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let tmp = dir.join(format!(".{file}.{}.{}.tmp", std::process::id(), sys::monotonic_ns()));
        let tmp_name = tmp.display().to_string();
        let ctmp = c_path(&tmp, &tmp_name)?;
        let cpath = c_path(path, &name)?;
        // SAFETY: ctmp is a valid C string.
        let fd = unsafe {
            libc::open(
                ctmp.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o666 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io_err(&tmp_name, "create"));
        }
        let built = (|| {
            // Container processes may run as any uid; the umask must not narrow that.
            // SAFETY: fd is open.
            if unsafe { libc::fchmod(fd, 0o666) } != 0 {
                return Err(io_err(&tmp_name, "chmod"));
            }
            // SAFETY: fd is open; the file is sparse (zeroes) until written.
            if unsafe { libc::ftruncate(fd, LAYOUT_SIZE as libc::off_t) } != 0 {
                return Err(io_err(&tmp_name, "ftruncate"));
            }
            // Allocate the accounting blocks now: writing the header into a hole of a full file
            // system would raise SIGBUS instead of an error, and a disk file system would
            // allocate in page faults on the hot path. The trace ring is left sparse: it costs
            // memory only once a trace writes to it (a failed fault there is caught by the guard).
            allocate(fd, std::mem::offset_of!(Shared, trace)).map_err(|source| RegionError::Io {
                path: tmp_name.clone(),
                op: "allocate the accounting blocks",
                source,
            })?;
            let shared =
                map_lazy(fd).map_err(|source| RegionError::Io { path: tmp_name.clone(), op: "mmap", source })?;
            // SAFETY: LAYOUT_SIZE zero bytes: a valid Shared, seen by nobody else yet.
            init_header(unsafe { shared.as_ref() });
            // SAFETY: we mapped LAYOUT_SIZE bytes at shared above.
            unsafe { libc::munmap(shared.as_ptr().cast(), LAYOUT_SIZE) };
            // SAFETY: fd is open.
            if unsafe { libc::fsync(fd) } != 0 {
                return Err(io_err(&tmp_name, "fsync"));
            }
            // SAFETY: both are valid C strings; link fails with EEXIST if another creator won.
            if unsafe { libc::link(ctmp.as_ptr(), cpath.as_ptr()) } != 0 {
                let source = std::io::Error::last_os_error();
                if source.raw_os_error() != Some(libc::EEXIST) {
                    return Err(RegionError::Io { path: name.clone(), op: "link", source });
                }
            }
            Ok(())
        })();
        // SAFETY: fd and the temporary name are ours.
        unsafe {
            libc::close(fd);
            libc::unlink(ctmp.as_ptr());
        }
        built?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    #[inline(always)]
    fn shared(&self) -> &Shared {
        // SAFETY: the mapping lives as long as self and holds a valid Shared (size and header
        // checked at open; any bytes are valid atomics).
        unsafe { self.shared.as_ref() }
    }

    /// The raw layout, for readers that need a field no method gives. Prefer the methods: they
    /// keep the invariants (total before slot, slot before total).
    #[inline]
    pub fn layout(&self) -> &Shared {
        self.shared()
    }

    /// The path, or `"anonymous region"`.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn is_anonymous(&self) -> bool {
        self.anonymous
    }

    /// Whether the region can no longer be trusted to be shared: its file shrank under the
    /// mapping (the SIGBUS guard replaced the mapping with zero pages, see [`crate::guard`]), or
    /// something overwrote its header. Its counters then mean nothing; the owner should report it.
    pub fn is_damaged(&self) -> bool {
        let h = &self.shared().header;
        self.guard.as_ref().is_some_and(crate::guard::Guarded::tripped)
            || h.magic.load(Relaxed) != MAGIC
            || h.version.load(Relaxed) != LAYOUT_VERSION
            || h.layout_size.load(Relaxed) != LAYOUT_SIZE as u64
    }

    /// Claims a free process slot for the calling process: a CAS on the slot's state word, then an
    /// OFD lock on the slot's liveness byte. Records pid and comm; host pid and start time are left 0
    /// for the daemon to fill where it needs them (`sys::ProcInfo`). When no slot
    /// is free, reaps dead ones and tries again.
    pub fn join(&self) -> Result<Slot, RegionError> {
        let s = self.shared();
        let start = s.join.next.fetch_add(1, Relaxed) as usize;
        for pass in 0..2 {
            for k in 0..MAX_PROCS {
                let i = (start + k) % MAX_PROCS;
                let slot = &s.slots[i];
                let state = slot.state.load(Relaxed);
                if kind(state) != FREE {
                    continue;
                }
                let claimed = next_state(state, LIVE);
                if slot.state.compare_exchange(state, claimed, AcqRel, Relaxed).is_err() {
                    continue;
                }
                if self.lock_claimed(i, claimed)? {
                    self.init_slot(i);
                    return Ok(Slot { index: i });
                }
            }
            if pass == 0 && self.reap() == 0 {
                break;
            }
        }
        Err(RegionError::Full { path: self.name.clone() })
    }

    /// Takes slot `i`'s liveness lock after our CAS made its state `claimed`. False when a reaper
    /// took the slot from us in between (it saw LIVE without a lock); we then claim another. A slot
    /// we leave LIVE without a lock is freed by the next reap.
    fn lock_claimed(&self, i: usize, claimed: u64) -> Result<bool, RegionError> {
        let state = &self.shared().slots[i].state;
        for _ in 0..100 {
            match sys::ofd_try_lock(self.fd, LIVENESS_BASE + i as i64) {
                Ok(sys::Lock::Taken) => {
                    if state.load(Acquire) == claimed {
                        self.own[i / 64].fetch_or(1 << (i % 64), Relaxed);
                        return Ok(true);
                    }
                    sys::ofd_unlock(self.fd, LIVENESS_BASE + i as i64);
                    return Ok(false);
                }
                // A reaper holds it for a moment: it will free the slot, or leave it to us.
                Ok(sys::Lock::Busy) => {
                    if state.load(Acquire) != claimed {
                        return Ok(false);
                    }
                    std::thread::yield_now();
                }
                Err(source) => {
                    return Err(RegionError::Io { path: self.name.clone(), op: "lock (F_OFD_SETLK)", source });
                }
            }
        }
        Ok(false)
    }

    fn init_slot(&self, i: usize) {
        let p = &self.shared().slots[i];
        let fresh;
        let info = if self.info.pid == std::process::id() {
            &self.info
        } else {
            fresh = sys::ProcInfo::current();
            &fresh
        };
        for d in &p.devices {
            // `used` is already 0: a slot is freed only after its usage is returned.
            d.peak.store(0, Relaxed);
            d.launches.store(0, Relaxed);
            d.gpu_time_ns.store(0, Relaxed);
            d.throttled_ns.store(0, Relaxed);
            d.oom_denials.store(0, Relaxed);
        }
        p.host_pid.store(info.host_pid, Relaxed);
        p.start_time.store(info.start_time, Relaxed);
        p.comm[0].store(u64::from_le_bytes(info.comm[..8].try_into().unwrap_or_default()), Relaxed);
        p.comm[1].store(u64::from_le_bytes(info.comm[8..].try_into().unwrap_or_default()), Relaxed);
        let now = sys::monotonic_ns();
        p.joined_ns.store(now, Relaxed);
        p.heartbeat_ns.store(now, Relaxed);
        p.pid.store(info.pid, Release);
    }

    /// The daemon records a slot's host pid once it has resolved it.
    pub fn set_host_pid(&self, slot: Slot, host_pid: u32) {
        if let Some(p) = self.shared().slots.get(slot.index) {
            p.host_pid.store(host_pid, Relaxed);
        }
    }

    /// The device entry for `uuid`: found, or claimed on first use (a CAS on the entry's key;
    /// entries are claimed in order and never freed, so every process gets the same index).
    pub fn device(&self, uuid: &str) -> Result<usize, RegionError> {
        let invalid = |reason: &str| RegionError::InvalidUuid {
            path: self.name.clone(),
            uuid: uuid.to_string(),
            reason: reason.to_string(),
        };
        if uuid.is_empty() {
            return Err(invalid("is empty"));
        }
        if uuid.len() > MAX_UUID_LEN {
            return Err(invalid(&format!("is longer than {MAX_UUID_LEN} bytes")));
        }
        if uuid.bytes().any(|b| b == 0) {
            return Err(invalid("holds a NUL byte"));
        }
        let key = uuid_key(uuid);
        for (i, e) in self.shared().devices.iter().enumerate() {
            let mut k = e.key.load(Acquire);
            if k == 0 {
                k = match e.key.compare_exchange(0, key, AcqRel, Acquire) {
                    Ok(_) => key,
                    Err(actual) => actual,
                };
            }
            if k != key {
                continue;
            }
            // Whoever finds the name unwritten writes it: all write the same bytes, so a writer
            // killed half-way harms nobody.
            if e.uuid_len.load(Acquire) == 0 {
                for (w, chunk) in e.uuid.iter().zip(uuid.as_bytes().chunks(8)) {
                    let mut b = [0u8; 8];
                    b[..chunk.len()].copy_from_slice(chunk);
                    w.store(u64::from_le_bytes(b), Relaxed);
                }
                e.uuid_len.store(uuid.len() as u32, Release);
            } else if self.device_uuid(i).as_deref() != Some(uuid) {
                return Err(invalid(&format!(
                    "its key collides with device {i} ({:?}): a corrupt region",
                    self.device_uuid(i).unwrap_or_default()
                )));
            }
            return Ok(i);
        }
        Err(RegionError::TooManyDevices { path: self.name.clone(), uuid: uuid.to_string() })
    }

    /// The entry of device `uuid` if a process of the container has named it; claims nothing
    /// (the daemon looks, only the container's processes claim).
    pub fn find_device(&self, uuid: &str) -> Option<usize> {
        let key = uuid_key(uuid);
        let i = self.shared().devices.iter().position(|e| e.key.load(Acquire) == key)?;
        // The name checked word by word (the daemon asks every 10 ms: no String made).
        let e = &self.shared().devices[i];
        let named = e.uuid_len.load(Acquire) as usize == uuid.len()
            && e.uuid.iter().zip(uuid.as_bytes().chunks(8)).all(|(w, chunk)| {
                let mut b = [0u8; 8];
                b[..chunk.len()].copy_from_slice(chunk);
                w.load(Relaxed) == u64::from_le_bytes(b)
            });
        named.then_some(i)
    }

    /// The key of device entry `dev` (0: free): what the ledger's views are keyed by.
    pub fn device_key(&self, dev: usize) -> u64 {
        self.shared().devices.get(dev).map_or(0, |e| e.key.load(Acquire))
    }

    /// The UUID of device entry `dev`, once claimed.
    pub fn device_uuid(&self, dev: usize) -> Option<String> {
        let e = self.shared().devices.get(dev)?;
        let len = e.uuid_len.load(Acquire) as usize;
        if len == 0 || len > MAX_UUID_LEN {
            return None;
        }
        let mut bytes = [0u8; MAX_UUID_LEN];
        for (w, out) in e.uuid.iter().zip(bytes.chunks_mut(8)) {
            out.copy_from_slice(&w.load(Relaxed).to_le_bytes());
        }
        String::from_utf8(bytes[..len].to_vec()).ok()
    }

    /// The context-size hint of device `dev` (0: none); see [`DeviceEntry::context_hint`].
    pub fn context_hint(&self, dev: usize) -> u64 {
        self.shared().devices.get(dev).map_or(0, |d| d.context_hint.load(Relaxed))
    }

    pub fn set_context_hint(&self, dev: usize, bytes: u64) {
        if let Some(d) = self.shared().devices.get(dev) {
            d.context_hint.store(bytes, Relaxed);
        }
    }

    /// Counts one allocation refused by the memory limit on device `dev` for `slot`'s process
    /// (`tessera_container_oom_denials_total`); an out-of-range slot or device is ignored.
    pub fn count_oom_denial(&self, slot: Slot, dev: usize) {
        if let Some(mine) = self.shared().slots.get(slot.index).and_then(|p| p.devices.get(dev)) {
            mine.oom_denials.fetch_add(1, Relaxed);
        }
    }

    /// Reserves `bytes` on device `dev` for `slot`'s process, within `limit` (`None`: no limit):
    /// the caller's, never a value from the region, which the container can write. Lock-free: a
    /// CAS raises the device total unless that would pass the limit, THEN the slot (and its peak)
    /// is raised; a process killed in between leaves the total too high (until
    /// [`Region::reconcile`]), never too low. On refusal, counts an OOM denial on the slot and
    /// returns the total and the limit. An out-of-range slot or device is refused.
    #[inline]
    pub fn try_reserve(&self, slot: Slot, dev: usize, bytes: u64, limit: Option<u64>) -> Result<(), Denied> {
        let r = self.try_reserve_uncounted(slot, dev, bytes, limit);
        if r.is_err() {
            self.count_oom_denial(slot, dev);
        }
        r
    }

    /// [`Region::try_reserve`] without counting a refusal: for a caller that tries more than once
    /// (or checks a limit of its own first) and counts the one refusal its program sees with
    /// [`Region::count_oom_denial`].
    #[inline]
    pub fn try_reserve_uncounted(&self, slot: Slot, dev: usize, bytes: u64, limit: Option<u64>) -> Result<(), Denied> {
        let s = self.shared();
        let (Some(d), Some(p)) = (s.devices.get(dev), s.slots.get(slot.index)) else {
            return Err(Denied { used: 0, limit: 0 });
        };
        let mine = &p.devices[dev];
        // SeqCst throughout: reconcile reasons about the order of the guard, the total and the
        // slot (on x86 every read-modify-write is SeqCst anyway).
        p.inflight.fetch_add(OP_START, SeqCst);
        let total = match limit {
            None => d.used.fetch_add(bytes, SeqCst).saturating_add(bytes),
            Some(limit) => {
                let mut cur = d.used.load(Relaxed);
                loop {
                    let next = match cur.checked_add(bytes) {
                        Some(n) if n <= limit => n,
                        _ => {
                            p.inflight.fetch_sub(1, SeqCst);
                            return Err(Denied { used: cur, limit });
                        }
                    };
                    match d.used.compare_exchange_weak(cur, next, SeqCst, Relaxed) {
                        Ok(_) => break next,
                        Err(actual) => cur = actual,
                    }
                }
            }
        };
        let held = mine.used.fetch_add(bytes, SeqCst).saturating_add(bytes);
        p.inflight.fetch_sub(1, SeqCst);
        if total > d.peak.load(Relaxed) {
            d.peak.fetch_max(total, Relaxed);
        }
        if held > mine.peak.load(Relaxed) {
            mine.peak.fetch_max(held, Relaxed);
        }
        Ok(())
    }

    /// Returns `bytes` reserved by `slot` on `dev`: the slot first, THEN the total. Never more than
    /// the slot holds.
    #[inline]
    pub fn release(&self, slot: Slot, dev: usize, bytes: u64) {
        let s = self.shared();
        let (Some(d), Some(p)) = (s.devices.get(dev), s.slots.get(slot.index)) else {
            return;
        };
        let mine = &p.devices[dev].used;
        p.inflight.fetch_add(OP_START, SeqCst);
        let mut cur = mine.load(Relaxed);
        loop {
            let take = cur.min(bytes);
            if take == 0 {
                break;
            }
            match mine.compare_exchange_weak(cur, cur - take, SeqCst, Relaxed) {
                Ok(_) => {
                    d.used.fetch_sub(take, SeqCst);
                    break;
                }
                Err(actual) => cur = actual,
            }
        }
        p.inflight.fetch_sub(1, SeqCst);
    }

    /// The container's total on device `dev`.
    pub fn used(&self, dev: usize) -> u64 {
        self.shared().devices.get(dev).map_or(0, |d| d.used.load(Relaxed))
    }

    /// What `slot`'s process holds on device `dev`.
    pub fn slot_used(&self, slot: Slot, dev: usize) -> u64 {
        self.slot_device(slot, dev).map_or(0, |d| d.used.load(Relaxed))
    }

    #[inline(always)]
    fn slot_device(&self, slot: Slot, dev: usize) -> Option<&SlotDevice> {
        self.shared().slots.get(slot.index)?.devices.get(dev)
    }

    fn owns(&self, i: usize) -> bool {
        self.own[i / 64].load(Relaxed) & (1 << (i % 64)) != 0
    }

    /// Frees the slots of processes that are gone (their liveness lock is no longer held): their
    /// usage is subtracted from the device totals. Slots this handle joined are skipped. Then
    /// [`Region::reconcile`]s the totals. Returns how many slots were freed. Costs one `fcntl` per
    /// live slot of another handle; not for hot paths.
    pub fn reap(&self) -> usize {
        if self.anonymous {
            return 0;
        }
        let mut freed = 0;
        for (i, p) in self.shared().slots.iter().enumerate() {
            let state = p.state.load(Acquire);
            if kind(state) == LIVE && !self.owns(i) && self.free_if_dead(i, state) {
                freed += 1;
            }
        }
        self.reconcile();
        freed
    }

    /// Frees slot `i`, seen LIVE in `state` and not joined by this handle, when its process is
    /// gone (its liveness lock is no longer held): its usage is subtracted from the device totals
    /// and its counters join the exited totals. Returns whether it freed the slot.
    fn free_if_dead(&self, i: usize, state: u64) -> bool {
        let s = self.shared();
        let p = &s.slots[i];
        let byte = LIVENESS_BASE + i as i64;
        if sys::ofd_held_by_other(self.fd, byte) {
            return false;
        }
        // Take the lock ourselves: one reaper wins, and a joiner between its CAS and its lock
        // will see the state change and go elsewhere.
        if !matches!(sys::ofd_try_lock(self.fd, byte), Ok(sys::Lock::Taken)) {
            return false;
        }
        let freed = p.state.load(Acquire) == state;
        if freed {
            // The owner is dead: whatever it had in flight stays in doubt (in the totals)
            // for reconcile; the guard now counts only us.
            let ops = p.inflight.load(SeqCst) & !BUSY_MASK;
            p.inflight.store(ops + OP_START, SeqCst);
            for (d, mine) in s.devices.iter().zip(&p.devices) {
                // Slot first, then total; a reaper killed here leaves the total too high.
                let held = mine.used.swap(0, SeqCst);
                if held != 0 {
                    d.used.fetch_sub(held, SeqCst);
                }
                // The dead process's counters join the container's exited totals: out of the
                // slot first, so a reader may briefly miss them but never counts them twice.
                let counters = [&mine.launches, &mine.gpu_time_ns, &mine.throttled_ns];
                for (total, c) in d.exited.iter().zip(counters) {
                    let n = c.swap(0, SeqCst);
                    if n != 0 {
                        total.fetch_add(n, SeqCst);
                    }
                }
                let ooms = u32::try_from(mine.oom_denials.swap(0, SeqCst)).unwrap_or(u32::MAX);
                if ooms != 0 {
                    let _ = d.exited_oom_denials.fetch_update(SeqCst, SeqCst, |v| Some(v.saturating_add(ooms)));
                }
            }
            p.inflight.store(ops + OP_START - 1, SeqCst);
            p.pid.store(0, Relaxed);
            p.host_pid.store(0, Relaxed);
            p.state.store(next_state(state, FREE), Release);
        }
        sys::ofd_unlock(self.fd, byte);
        freed
    }

    /// Returns to the device totals what processes killed half-way through a reservation or a
    /// release left there (the total raised but not the slot, or the slot lowered but not the
    /// total): sets each total to the sum of the slots, when a consistent reading shows that no
    /// operation was in flight (every slot's guard idle and unchanged around the reading of totals
    /// and slots). A slot killed mid-operation keeps its guard busy until it is reaped, so this
    /// succeeds after the reap ([`Region::reap`] calls it). Returns the bytes returned.
    pub fn reconcile(&self) -> u64 {
        if self.anonymous {
            return 0;
        }
        let s = self.shared();
        let mut guards = [0u64; MAX_PROCS];
        for _ in 0..4 {
            let mut idle = true;
            for (g, p) in guards.iter_mut().zip(&s.slots) {
                *g = p.inflight.load(SeqCst);
                idle &= *g & BUSY_MASK == 0;
            }
            if !idle {
                std::thread::yield_now();
                continue;
            }
            let totals: [u64; MAX_DEVICES] = std::array::from_fn(|d| s.devices[d].used.load(SeqCst));
            let mut sums = [0u64; MAX_DEVICES];
            // A free slot holds nothing (its usage is returned before it is freed), so only the
            // others are summed: 16 words each, against 16 for each of 1,024 slots (most of a
            // scrape's time went here). A slot joined meanwhile changes its guard: read again.
            for p in s.slots.iter().filter(|p| kind(p.state.load(SeqCst)) != FREE) {
                for (sum, mine) in sums.iter_mut().zip(&p.devices) {
                    *sum = sum.saturating_add(mine.used.load(SeqCst));
                }
            }
            if guards.iter().zip(&s.slots).any(|(&g, p)| p.inflight.load(SeqCst) != g) {
                continue;
            }
            // No operation ran between the two guard readings, so totals and sums were read
            // together. A total that moved since fails its CAS and keeps its excess for next time.
            let mut returned = 0;
            for (d, (&total, &sum)) in s.devices.iter().zip(totals.iter().zip(&sums)) {
                if total > sum && d.used.compare_exchange(total, sum, SeqCst, SeqCst).is_ok() {
                    returned += total - sum;
                }
            }
            return returned;
        }
        0
    }

    #[inline]
    pub fn record_launch(&self, slot: Slot, dev: usize) {
        self.count_launch(slot, dev);
    }

    /// Counts a launch on the slot's device and returns the count before it (0 for an
    /// out-of-range slot or device): one uncontended increment on the process's own slot.
    #[inline(always)]
    pub fn count_launch(&self, slot: Slot, dev: usize) -> u64 {
        self.slot_device(slot, dev).map_or(0, |d| d.launches.fetch_add(1, Relaxed))
    }

    #[inline]
    pub fn record_gpu_time(&self, slot: Slot, dev: usize, ns: u64) {
        if let Some(d) = self.slot_device(slot, dev) {
            d.gpu_time_ns.fetch_add(ns, Relaxed);
        }
    }

    #[inline]
    pub fn record_throttled(&self, slot: Slot, dev: usize, ns: u64) {
        if let Some(d) = self.slot_device(slot, dev) {
            d.throttled_ns.fetch_add(ns, Relaxed);
        }
    }

    /// Device `dev`'s compute bucket. Panics when `dev >= MAX_DEVICES` (indices come from
    /// [`Region::device`]).
    #[inline]
    pub fn bucket(&self, dev: usize) -> &ComputeBucket {
        &self.shared().devices[dev].bucket
    }

    /// Stamps the slot with the monotonic clock (vDSO: no syscall).
    #[inline]
    pub fn heartbeat(&self, slot: Slot) {
        if let Some(p) = self.shared().slots.get(slot.index) {
            p.heartbeat_ns.store(sys::monotonic_ns(), Relaxed);
        }
    }

    /// Bumped by the daemon after rewriting the limits file; the shim rereads it when this changes.
    #[inline(always)]
    pub fn config_generation(&self) -> u64 {
        self.shared().header.config_generation.load(Acquire)
    }

    /// Where the container's memory is ([`ParkState`]).
    pub fn park_state(&self) -> ParkState {
        ParkState::from_raw(self.shared().header.park_state.load(Acquire))
    }

    /// For tesserad: the container's memory is being parked, parked, being resumed, or running.
    pub fn set_park_state(&self, state: ParkState) {
        self.shared().header.park_state.store(state as u64, Release);
    }

    pub fn bump_config_generation(&self) {
        self.shared().header.config_generation.fetch_add(1, AcqRel);
    }

    /// `(pid, host pid)` of every joined slot (host pid 0: not known yet). Dead processes not yet
    /// reaped are included: call [`Region::reap`] first.
    pub fn pids(&self) -> Vec<(u32, u32)> {
        self.live_slots().map(|(_, p, pid)| (pid, p.host_pid.load(Relaxed))).collect()
    }

    /// Joined slots that have finished joining: (index, slot, pid).
    fn live_slots(&self) -> impl Iterator<Item = (usize, &ProcSlot, u32)> {
        self.shared().slots.iter().enumerate().filter_map(|(i, p)| {
            if kind(p.state.load(Acquire)) != LIVE {
                return None;
            }
            let pid = p.pid.load(Acquire);
            (pid != 0).then_some((i, p, pid))
        })
    }

    /// Everything, for the daemon: claimed devices (uuid, limits, total) and joined processes with
    /// their per-device counters (one per claimed device, in device order). Values are read one by
    /// one, not as one atomic picture. Call [`Region::reap`] first to leave out dead processes.
    pub fn snapshot(&self) -> Snapshot {
        let devices = self.device_snapshots();
        let processes = self.live_slots().map(|(i, p, pid)| process_snapshot(i, p, pid, devices.len())).collect();
        self.snapshot_of(devices, processes)
    }

    /// [`Region::reap`] then [`Region::snapshot`] in one pass over the slots instead of four (the
    /// reap's, the reconcile's two, the snapshot's): for the daemon, which samples every region
    /// at every scrape, most of whose slots are free. Dead processes' slots are freed as `reap`
    /// frees them; [`Region::reconcile`] then runs only when it may have something to return: a
    /// slot was freed now, or a device total is above what the slots hold (a process killed
    /// mid-operation, a reaper killed half-way, a reconcile that gave up). A total read while a
    /// reservation is under way can hide an excess from one call; the next call sees it. A
    /// process that joins during the call shows in the next one.
    pub fn reap_and_snapshot(&self) -> Snapshot {
        let s = self.shared();
        // The slots not free after reaping; few, against MAX_PROCS.
        let mut held: Vec<usize> = Vec::new();
        let mut freed = false;
        for (i, p) in s.slots.iter().enumerate() {
            let state = p.state.load(Acquire);
            if kind(state) == FREE {
                continue;
            }
            if kind(state) == LIVE && !self.anonymous && !self.owns(i) && self.free_if_dead(i, state) {
                freed = true;
            } else {
                held.push(i);
            }
        }
        // Totals first, then what the slots hold (as reconcile reads them): a release between
        // the two readings makes a total look high (a reconcile for nothing); a reservation
        // between can hide an excess until the next call.
        let totals: [u64; MAX_DEVICES] = std::array::from_fn(|d| s.devices[d].used.load(SeqCst));
        let mut sums = [0u64; MAX_DEVICES];
        for &i in &held {
            for (sum, mine) in sums.iter_mut().zip(&s.slots[i].devices) {
                *sum = sum.saturating_add(mine.used.load(SeqCst));
            }
        }
        if freed || totals.iter().zip(&sums).any(|(total, sum)| total > sum) {
            self.reconcile();
        }
        let devices = self.device_snapshots();
        let processes = held
            .into_iter()
            .filter_map(|i| {
                let p = &s.slots[i];
                if kind(p.state.load(Acquire)) != LIVE {
                    return None;
                }
                let pid = p.pid.load(Acquire);
                (pid != 0).then(|| process_snapshot(i, p, pid, devices.len()))
            })
            .collect();
        self.snapshot_of(devices, processes)
    }

    /// A snapshot of these devices and processes, with the region's header as it reads now.
    fn snapshot_of(&self, devices: Vec<DeviceSnapshot>, processes: Vec<ProcessSnapshot>) -> Snapshot {
        Snapshot {
            config_generation: self.config_generation(),
            trace_requested: self.trace_requested(),
            park_state: self.park_state(),
            devices,
            processes,
        }
    }

    /// The claimed device entries, in order: while parked, the totals show as parked, not used.
    fn device_snapshots(&self) -> Vec<DeviceSnapshot> {
        let s = self.shared();
        let parked = self.park_state() == ParkState::Parked;
        (0..MAX_DEVICES)
            .map_while(|i| {
                let e = &s.devices[i];
                let total = e.used.load(Relaxed);
                (e.key.load(Acquire) != 0).then(|| DeviceSnapshot {
                    index: i,
                    uuid: self.device_uuid(i).unwrap_or_default(),
                    used: if parked { 0 } else { total },
                    parked: if parked { total } else { 0 },
                    peak: e.peak.load(Relaxed),
                    exited_launches: e.exited[0].load(Relaxed),
                    exited_gpu_time_ns: e.exited[1].load(Relaxed),
                    exited_throttled_ns: e.exited[2].load(Relaxed),
                    exited_oom_denials: u64::from(e.exited_oom_denials.load(Relaxed)),
                })
            })
            .collect()
    }
}

/// Slot `i` (process `pid`) and its counters on the first `devices` devices.
fn process_snapshot(i: usize, p: &ProcSlot, pid: u32, devices: usize) -> ProcessSnapshot {
    let mut comm = [0u8; 16];
    comm[..8].copy_from_slice(&p.comm[0].load(Relaxed).to_le_bytes());
    comm[8..].copy_from_slice(&p.comm[1].load(Relaxed).to_le_bytes());
    let n = comm.iter().position(|&c| c == 0).unwrap_or(16);
    ProcessSnapshot {
        slot: i,
        pid,
        host_pid: p.host_pid.load(Relaxed),
        start_time: p.start_time.load(Relaxed),
        comm: String::from_utf8_lossy(&comm[..n]).into_owned(),
        joined_ns: p.joined_ns.load(Relaxed),
        heartbeat_ns: p.heartbeat_ns.load(Relaxed),
        devices: p.devices[..devices]
            .iter()
            .enumerate()
            .map(|(dev, d)| ProcessDeviceSnapshot {
                dev,
                used: d.used.load(Relaxed),
                peak: d.peak.load(Relaxed),
                launches: d.launches.load(Relaxed),
                gpu_time_ns: d.gpu_time_ns.load(Relaxed),
                throttled_ns: d.throttled_ns.load(Relaxed),
                oom_denials: d.oom_denials.load(Relaxed),
            })
            .collect(),
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // Out of the guard's table before the mapping goes.
        drop(self.guard.take());
        // SAFETY: we mapped LAYOUT_SIZE bytes at shared and own fd. Closing fd drops the liveness
        // locks of the slots this handle joined: they become reapable, as at process death.
        unsafe {
            libc::munmap(self.shared.as_ptr().cast(), LAYOUT_SIZE);
            libc::close(self.fd);
        }
    }
}

/// A region's contents at one moment (read field by field), for the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub config_generation: u64,
    pub trace_requested: bool,
    pub park_state: ParkState,
    pub devices: Vec<DeviceSnapshot>,
    pub processes: Vec<ProcessSnapshot>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSnapshot {
    pub index: usize,
    pub uuid: String,
    /// The container's total on the GPU (0 while parked).
    pub used: u64,
    /// The container's total moved to host memory by a park (0 unless parked).
    pub parked: u64,
    pub peak: u64,
    /// The counters of the container's processes that are gone (reaped).
    pub exited_launches: u64,
    pub exited_gpu_time_ns: u64,
    pub exited_throttled_ns: u64,
    pub exited_oom_denials: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSnapshot {
    /// Slot index: `Slot { index: slot }` for [`Region::set_host_pid`].
    pub slot: usize,
    pub pid: u32,
    /// 0: not known yet.
    pub host_pid: u32,
    /// Clock ticks after boot, as in `/proc/<pid>/stat` field 22.
    pub start_time: u64,
    pub comm: String,
    pub joined_ns: u64,
    pub heartbeat_ns: u64,
    /// One per claimed device, in device order.
    pub devices: Vec<ProcessDeviceSnapshot>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessDeviceSnapshot {
    pub dev: usize,
    pub used: u64,
    pub peak: u64,
    pub launches: u64,
    pub gpu_time_ns: u64,
    pub throttled_ns: u64,
    pub oom_denials: u64,
}

/// FNV-1a, 64 bits: stable across builds (the shim and the daemon may be built apart). Never 0.
pub(crate) fn uuid_key(uuid: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in uuid.as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}

fn init_header(s: &Shared) {
    let h = &s.header;
    h.version.store(LAYOUT_VERSION, Relaxed);
    h.max_devices.store(MAX_DEVICES as u32, Relaxed);
    h.max_procs.store(MAX_PROCS as u32, Relaxed);
    h.layout_size.store(LAYOUT_SIZE as u64, Relaxed);
    h.magic.store(MAGIC, Release);
}

/// Allocates the first `len` bytes of `fd`'s file: `fallocate`, or where the file system has
/// none, writing zeroes. Out of space is an error here rather than a SIGBUS later.
fn allocate(fd: i32, len: usize) -> std::io::Result<()> {
    // SAFETY: fd is open; fallocate only changes the file's allocation.
    if unsafe { libc::fallocate(fd, 0, 0, len as libc::off_t) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
        return Err(e);
    }
    let zeros = [0u8; 4096];
    let mut off = 0;
    while off < len {
        let n = zeros.len().min(len - off);
        // SAFETY: fd is open; zeros is a valid buffer of at least n bytes.
        let w = unsafe { libc::pwrite(fd, zeros.as_ptr().cast(), n, off as libc::off_t) };
        if w < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        off += w as usize;
    }
    Ok(())
}

fn io_err(path: &str, op: &'static str) -> RegionError {
    RegionError::Io { path: path.to_string(), op, source: std::io::Error::last_os_error() }
}

fn c_path(path: &Path, name: &str) -> Result<CString, RegionError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| RegionError::Incompatible { path: name.to_string(), reason: "path holds a NUL byte".into() })
}

/// Refuses anything but a region file of this build's layout, before mapping it.
fn check_file(fd: i32, name: &str) -> Result<(), RegionError> {
    let incompatible = |reason: String| RegionError::Incompatible {
        path: name.to_string(),
        reason: format!("{reason}; remove it (no process may be using it) to make a new one"),
    };
    // SAFETY: stat is plain data; fstat fills it for an open fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open and st writable.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io_err(name, "stat"));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(incompatible("not a regular file".into()));
    }
    let mut header = [0u8; 24];
    // SAFETY: header is writable for its length.
    let n = unsafe { libc::pread(fd, header.as_mut_ptr().cast(), header.len(), 0) };
    if n < 0 {
        return Err(io_err(name, "read"));
    }
    // The header as the atomics store it: native byte order.
    let word = |at: usize| u64::from_ne_bytes(header[at..at + 8].try_into().unwrap_or_default());
    if (n as usize) < header.len() || word(0) != MAGIC {
        return Err(incompatible(format!("not a tessera accounting region ({} bytes, no region header)", st.st_size)));
    }
    let version = u32::from_ne_bytes(header[8..12].try_into().unwrap_or_default());
    if version != LAYOUT_VERSION {
        return Err(incompatible(format!(
            "a region of layout version {version}; this build uses version {LAYOUT_VERSION}"
        )));
    }
    let layout_size = word(16);
    if layout_size != LAYOUT_SIZE as u64 || st.st_size as u64 != LAYOUT_SIZE as u64 {
        return Err(incompatible(format!(
            "a region of {layout_size} bytes in a file of {}; this build's layout is {LAYOUT_SIZE} bytes",
            st.st_size
        )));
    }
    Ok(())
}

/// Maps the whole region, then faults in what every user touches on its hot paths now: the
/// header and the device entries (2 pages). A process's own slot is faulted in by the join that
/// writes it, also off the hot path; other processes' slots only when a reap or a snapshot reads
/// them. Faulting in every slot (210 pages) took about 0.3 ms of each process's start-up. The
/// trace ring is left alone: it costs memory only once a trace writes to it.
fn map(fd: i32) -> std::io::Result<NonNull<Shared>> {
    let p = map_lazy(fd)?;
    let accounting = std::mem::offset_of!(Shared, slots);
    // SAFETY: p maps LAYOUT_SIZE bytes, more than `accounting`; populating changes no contents.
    if unsafe { libc::madvise(p.as_ptr().cast(), accounting, libc::MADV_POPULATE_WRITE) } != 0 {
        // Before Linux 5.14: a read of each page faults it in as MAP_POPULATE did.
        let base = p.as_ptr().cast::<u8>();
        for off in (0..accounting).step_by(4096) {
            // SAFETY: off < accounting <= LAYOUT_SIZE, inside the mapping; a volatile read of a
            // byte (other processes may write it; the value is not used).
            unsafe { std::ptr::read_volatile(base.add(off)) };
        }
    }
    Ok(p)
}

/// Maps the whole region with no page faulted in (a creator that only writes the header).
fn map_lazy(fd: i32) -> std::io::Result<NonNull<Shared>> {
    // SAFETY: mapping LAYOUT_SIZE bytes of an fd whose size was checked (or set), shared read-write.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), LAYOUT_SIZE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    NonNull::new(p.cast()).ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};

    /// Opening a region faults in its accounting blocks only: the trace ring takes no memory (or
    /// disk) until a trace writes to it.
    #[test]
    fn the_trace_ring_stays_unallocated_until_written() {
        use std::os::unix::fs::MetadataExt;
        // On tmpfs, the runtime dir's normal home, as there a fault in a hole allocates memory.
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }.unwrap();
        let path = dir.path().join("region");
        let r = Region::open_or_create(&path).unwrap();
        let again = Region::open_or_create(&path).unwrap();
        let accounting = std::mem::offset_of!(Shared, trace) as u64;
        let used = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(used <= accounting + (64 << 10), "{used} bytes allocated; the accounting part is {accounting}");
        assert!(used + (512 << 10) < LAYOUT_SIZE as u64, "{used} of {LAYOUT_SIZE} bytes allocated");
        drop((r, again));
    }

    fn file_region() -> (tempfile::TempDir, std::path::PathBuf, Region) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let r = Region::open_or_create(&path).unwrap();
        (dir, path, r)
    }

    /// A process's own handle on the region at `path`, joined and holding `bytes` on `device`: the
    /// handle, the device's index and the process's slot.
    fn process_holding(path: &std::path::Path, device: &str, bytes: u64) -> (Region, usize, Slot) {
        let r = Region::open_or_create(path).unwrap();
        let dev = r.device(device).unwrap();
        let me = r.join().unwrap();
        r.try_reserve(me, dev, bytes, None).unwrap();
        (r, dev, me)
    }

    /// The daemon's look-up claims nothing and finds only the device named exactly.
    #[test]
    fn find_device_claims_nothing_and_matches_the_whole_name() {
        let (_dir, _path, r) = file_region();
        let long = "MIG-0123456789abcdef-0123456789abcdef-0123456789";
        assert_eq!(r.find_device("GPU-a"), None);
        assert_eq!(r.device_key(0), 0, "nothing claimed by looking");
        let (a, b) = (r.device("GPU-a").unwrap(), r.device(long).unwrap());
        assert_eq!((r.find_device("GPU-a"), r.find_device(long)), (Some(a), Some(b)));
        assert_eq!(r.find_device("GPU-ab"), None);
        assert_eq!(r.find_device(&long[..long.len() - 1]), None);
        assert_ne!(r.device_key(a), 0);
    }

    #[test]
    fn reserve_up_to_the_limit_exactly() {
        let r = Region::anonymous().unwrap();
        let dev = r.device("GPU-a").unwrap();
        let limit = Some(1000);
        let me = r.join().unwrap();
        assert_eq!(r.try_reserve(me, dev, 600, limit), Ok(()));
        assert_eq!(r.try_reserve(me, dev, 400, limit), Ok(()));
        assert_eq!(r.used(dev), 1000);
        assert_eq!(r.try_reserve(me, dev, 1, limit), Err(Denied { used: 1000, limit: 1000 }));
        assert_eq!(r.try_reserve(me, dev, u64::MAX, limit), Err(Denied { used: 1000, limit: 1000 }));
        assert_eq!(r.used(dev), 1000);
        r.release(me, dev, 400);
        assert_eq!((r.used(dev), r.slot_used(me, dev)), (600, 600));
        assert_eq!(r.try_reserve(me, dev, 400, limit), Ok(()));
        // Never more than the slot holds.
        r.release(me, dev, 5000);
        assert_eq!((r.used(dev), r.slot_used(me, dev)), (0, 0));
        r.release(me, dev, 1);
        assert_eq!(r.used(dev), 0);

        let snap = r.snapshot();
        assert_eq!(snap.devices[0].peak, 1000);
        let p = &snap.processes[0];
        assert_eq!((p.devices[0].peak, p.devices[0].oom_denials), (1000, 2));

        // A limit below the use refuses until enough is released; None lifts it.
        assert_eq!(r.try_reserve(me, dev, 800, limit), Ok(()));
        assert_eq!(r.try_reserve(me, dev, 1, Some(500)), Err(Denied { used: 800, limit: 500 }));
        assert_eq!(r.try_reserve(me, dev, 1 << 40, None), Ok(()));
        assert_eq!(r.used(dev), 800 + (1 << 40));
    }

    #[test]
    fn bad_indices_are_harmless() {
        let r = Region::anonymous().unwrap();
        let me = r.join().unwrap();
        assert_eq!(r.try_reserve(me, MAX_DEVICES, 1, None), Err(Denied { used: 0, limit: 0 }));
        assert!(r.try_reserve(Slot { index: MAX_PROCS }, 0, 1, None).is_err());
        r.release(me, MAX_DEVICES, 1);
        r.record_launch(me, MAX_DEVICES);
        r.record_gpu_time(Slot { index: MAX_PROCS }, 0, 1);
        r.set_context_hint(MAX_DEVICES, 1);
        assert_eq!(r.context_hint(MAX_DEVICES), 0);
        assert_eq!(r.used(MAX_DEVICES), 0);
        assert_eq!(r.device_uuid(MAX_DEVICES), None);
    }

    #[test]
    fn devices_are_claimed_once_and_shared() {
        let (_dir, path, a) = file_region();
        let b = Region::open_or_create(&path).unwrap();
        assert_eq!(a.device("GPU-0").unwrap(), 0);
        assert_eq!(b.device("MIG-1").unwrap(), 1);
        assert_eq!(b.device("GPU-0").unwrap(), 0);
        assert_eq!(a.device("MIG-1").unwrap(), 1);
        assert_eq!(a.device_uuid(1).as_deref(), Some("MIG-1"));
        assert_eq!(a.device_uuid(2), None);
        let long_mig = "MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/13/0";
        assert_eq!(b.device(long_mig).unwrap(), 2);
        assert_eq!(a.device_uuid(2).as_deref(), Some(long_mig));

        a.set_context_hint(0, 300 << 20);
        assert_eq!((b.context_hint(0), b.context_hint(1)), (300 << 20, 0));

        for i in 3..MAX_DEVICES {
            assert_eq!(a.device(&format!("GPU-{i}")).unwrap(), i);
        }
        let e = a.device("GPU-one-too-many").unwrap_err().to_string();
        assert!(e.starts_with(&path.display().to_string()) && e.contains("all 16 device entries"), "{e}");
        assert_eq!(a.device("GPU-7").unwrap(), 7, "existing entries are still found when full");
        let e = a.device(&"x".repeat(65)).unwrap_err().to_string();
        assert!(e.contains("longer than 64 bytes"), "{e}");
        assert!(a.device("").is_err());
    }

    #[test]
    fn racing_device_claims_get_one_entry() {
        let (_dir, path, _r) = file_region();
        let regions: Vec<Region> = (0..8).map(|_| Region::open_or_create(&path).unwrap()).collect();
        let got: Vec<Vec<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = regions
                .iter()
                .enumerate()
                .map(|(t, r)| {
                    s.spawn(move || {
                        (0..12).map(|k| r.device(&format!("GPU-{}", (k + t) % 12)).unwrap()).collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let r = &regions[0];
        for (t, indices) in got.iter().enumerate() {
            for (k, &i) in indices.iter().enumerate() {
                assert_eq!(r.device_uuid(i).unwrap(), format!("GPU-{}", (k + t) % 12));
            }
        }
        assert_eq!(r.snapshot().devices.len(), 12);
    }

    #[test]
    fn file_is_world_writable_and_created_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("region");
        let regions: Vec<Region> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8).map(|_| s.spawn(|| Region::open_or_create(&path).unwrap())).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        regions[3].bump_config_generation();
        assert!(regions.iter().all(|r| r.config_generation() == 1));
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o666);
        assert_eq!(meta.len(), LAYOUT_SIZE as u64);
        // Only the region: no temporary files left.
        assert_eq!(std::fs::read_dir(path.parent().unwrap()).unwrap().count(), 1);
    }

    #[test]
    fn other_layouts_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let expect = |what: &str| {
            let e = Region::open_or_create(&path).err().unwrap().to_string();
            assert!(e.starts_with(&path.display().to_string()) && e.contains(what), "{e}");
        };
        std::fs::write(&path, b"hello").unwrap();
        expect("not a tessera accounting region");
        let mut bytes = vec![0u8; LAYOUT_SIZE];
        std::fs::write(&path, &bytes).unwrap();
        expect("not a tessera accounting region");
        bytes[..8].copy_from_slice(&MAGIC.to_ne_bytes());
        bytes[8..12].copy_from_slice(&7u32.to_ne_bytes());
        bytes[16..24].copy_from_slice(&(LAYOUT_SIZE as u64).to_ne_bytes());
        std::fs::write(&path, &bytes).unwrap();
        expect(&format!("layout version 7; this build uses version {LAYOUT_VERSION}"));
        bytes[8..12].copy_from_slice(&LAYOUT_VERSION.to_ne_bytes());
        bytes[16..24].copy_from_slice(&4096u64.to_ne_bytes());
        std::fs::write(&path, &bytes).unwrap();
        expect("a region of 4096 bytes");
        bytes[16..24].copy_from_slice(&(LAYOUT_SIZE as u64).to_ne_bytes());
        bytes.push(0);
        std::fs::write(&path, &bytes).unwrap();
        expect(&format!("in a file of {}", LAYOUT_SIZE + 1));
        bytes.pop();
        std::fs::write(&path, &bytes).unwrap();
        Region::open_or_create(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(Region::open_or_create(&path).is_err());
    }

    #[test]
    fn a_dropped_handle_is_reaped_and_its_memory_returned() {
        let (_dir, path, daemon) = file_region();
        let dev = daemon.device("GPU-a").unwrap();
        let mine = daemon.join().unwrap();
        daemon.try_reserve(mine, dev, 10, None).unwrap();
        let other = Region::open_or_create(&path).unwrap();
        let s = other.join().unwrap();
        other.try_reserve(s, dev, 1000, None).unwrap();
        other.record_launch(s, dev);
        assert_eq!(daemon.reap(), 0, "live slots are not reaped");
        assert_eq!(other.reap(), 0, "nor our own");
        assert_eq!(daemon.pids().len(), 2);
        drop(other);
        assert_eq!(daemon.used(dev), 1010);
        assert_eq!(daemon.reap(), 1);
        assert_eq!(daemon.used(dev), 10);
        assert_eq!(daemon.slot_used(s, dev), 0);
        assert_eq!(daemon.reap(), 0);
        assert_eq!(daemon.pids().len(), 1);
        // The freed slot is joinable again, with fresh counters.
        let third = Region::open_or_create(&path).unwrap();
        let mut slots = Vec::new();
        loop {
            let t = third.join().unwrap();
            slots.push(t);
            if t == s {
                break;
            }
        }
        let snap = third.snapshot();
        let p = snap.processes.iter().find(|p| p.slot == s.index).unwrap();
        assert_eq!((p.devices[dev].launches, p.devices[dev].used), (0, 0));
    }

    #[test]
    fn a_reaped_process_leaves_its_counters_in_the_exited_totals() {
        let (_dir, path, daemon) = file_region();
        let dev = daemon.device("GPU-a").unwrap();
        for (launches, ooms) in [(500u64, 1u64), (300, 2)] {
            let p = Region::open_or_create(&path).unwrap();
            let s = p.join().unwrap();
            for _ in 0..launches {
                p.record_launch(s, dev);
            }
            p.record_gpu_time(s, dev, launches * 10);
            p.record_throttled(s, dev, 7);
            for _ in 0..ooms {
                p.try_reserve(s, dev, 100, Some(10)).unwrap_err();
            }
            // Gone before anyone sampled it.
            drop(p);
        }
        assert_eq!(daemon.reap(), 2);
        let d = &daemon.snapshot().devices[dev];
        assert_eq!(
            (d.exited_launches, d.exited_gpu_time_ns, d.exited_throttled_ns, d.exited_oom_denials),
            (800, 8000, 14, 3),
            "every launch of both processes, none lost"
        );
        assert_eq!(daemon.reap(), 0);
        assert_eq!(daemon.snapshot().devices[dev].exited_launches, 800, "folded once");
    }

    #[test]
    fn join_fills_every_slot_then_reaps() {
        let (_dir, path, a) = file_region();
        let b = Region::open_or_create(&path).unwrap();
        let mut seen = HashSet::new();
        for _ in 0..MAX_PROCS - 1 {
            assert!(seen.insert(b.join().unwrap().index));
        }
        assert!(seen.insert(a.join().unwrap().index));
        let e = a.join().unwrap_err().to_string();
        assert!(e.contains("all 1024 process slots"), "{e}");
        drop(b);
        let s = a.join().unwrap();
        assert!(seen.contains(&s.index));
        assert_eq!(a.pids().len(), 2);
    }

    #[test]
    fn a_parked_container_shows_its_memory_parked_not_used() {
        let (_dir, path, daemon) = file_region();
        let (r, d, me) = process_holding(&path, "GPU-0", 3 << 30);
        assert_eq!(daemon.park_state(), ParkState::Running, "a fresh region runs");
        let row = |s: &Snapshot| (s.park_state, s.devices[d].used, s.devices[d].parked);
        assert_eq!(row(&daemon.reap_and_snapshot()), (ParkState::Running, 3 << 30, 0));
        for (state, used, parked) in [
            (ParkState::Parking, 3 << 30, 0),
            (ParkState::Parked, 0, 3 << 30),
            (ParkState::Resuming, 3 << 30, 0),
            (ParkState::Running, 3 << 30, 0),
        ] {
            daemon.set_park_state(state);
            assert_eq!(r.park_state(), state, "the container's processes see it");
            assert_eq!(row(&daemon.reap_and_snapshot()), (state, used, parked));
            assert_eq!(row(&daemon.snapshot()), (state, used, parked));
        }
        // The books themselves never moved: what the process holds is what it holds after.
        assert_eq!(r.slot_used(me, d), 3 << 30);
        assert_eq!(r.used(d), 3 << 30);
        // A word the container scribbled reads as running: its memory stays counted.
        daemon.shared().header.park_state.store(77, Relaxed);
        assert_eq!(row(&daemon.snapshot()), (ParkState::Running, 3 << 30, 0));
    }

    #[test]
    fn snapshot_and_counters() {
        let (_dir, path, daemon) = file_region();
        let r = Region::open_or_create(&path).unwrap();
        let d0 = r.device("GPU-0").unwrap();
        let d1 = r.device("GPU-1").unwrap();
        let me = r.join().unwrap();
        r.try_reserve(me, d1, 60, Some(100)).unwrap();
        r.try_reserve(me, d1, 50, Some(100)).unwrap_err();
        r.record_launch(me, d1);
        r.record_launch(me, d1);
        r.record_gpu_time(me, d1, 5000);
        r.record_throttled(me, d1, 700);
        r.heartbeat(me);
        daemon.set_host_pid(me, 4242);
        daemon.set_trace_requested(true);
        assert!(r.trace_requested());
        let snap = daemon.snapshot();
        assert!(snap.trace_requested);
        assert_eq!(snap.devices.len(), 2);
        assert_eq!(
            snap.devices[d1],
            DeviceSnapshot {
                index: d1,
                uuid: "GPU-1".into(),
                used: 60,
                parked: 0,
                peak: 60,
                exited_launches: 0,
                exited_gpu_time_ns: 0,
                exited_throttled_ns: 0,
                exited_oom_denials: 0
            }
        );
        assert_eq!(snap.processes.len(), 1);
        let p = &snap.processes[0];
        assert_eq!((p.slot, p.pid, p.host_pid), (me.index, std::process::id(), 4242));
        assert_eq!(p.start_time, 0, "the daemon's to read");
        let comm = std::fs::read_to_string("/proc/self/comm").unwrap();
        assert_eq!(p.comm, comm.trim_end());
        assert!(p.heartbeat_ns >= p.joined_ns && p.joined_ns > 0);
        assert_eq!(
            p.devices[d0],
            ProcessDeviceSnapshot {
                dev: d0,
                used: 0,
                peak: 0,
                launches: 0,
                gpu_time_ns: 0,
                throttled_ns: 0,
                oom_denials: 0
            }
        );
        assert_eq!(
            p.devices[d1],
            ProcessDeviceSnapshot {
                dev: d1,
                used: 60,
                peak: 60,
                launches: 2,
                gpu_time_ns: 5000,
                throttled_ns: 700,
                oom_denials: 1
            }
        );
        assert_eq!(daemon.pids(), vec![(std::process::id(), 4242)]);
        let b = daemon.bucket(d1);
        b.tokens_ns.store(-5, SeqCst);
        assert_eq!(r.bucket(d1).tokens_ns.load(SeqCst), -5);
    }

    #[test]
    fn host_pid_is_left_for_the_daemon_to_fill() {
        let r = Region::anonymous().unwrap();
        let me = r.join().unwrap();
        let p = r.snapshot().processes.into_iter().find(|p| p.slot == me.index).unwrap();
        assert_eq!((p.pid, p.host_pid, p.start_time), (std::process::id(), 0, 0));
        r.set_host_pid(me, 4242);
        let p = r.snapshot().processes.into_iter().find(|p| p.slot == me.index).unwrap();
        assert_eq!(p.host_pid, 4242);
    }

    #[test]
    fn anonymous_region_reaps_nothing() {
        let r = Region::anonymous().unwrap();
        assert!(r.is_anonymous());
        let a = r.join().unwrap();
        let b = r.join().unwrap();
        assert_ne!(a, b);
        assert_eq!(r.reap(), 0);
    }

    /// Many processes (separate handles on one file) × many threads, reserving and releasing at
    /// random against one limit: the total never passes the limit and ends at exactly what the
    /// successful reservations minus the releases add up to.
    #[test]
    fn concurrent_reservations_never_pass_the_limit() {
        const HANDLES: usize = 6;
        const THREADS: usize = 4;
        const LIMIT: u64 = 1 << 20;
        let (_dir, path, daemon) = file_region();
        let dev = daemon.device("GPU-shared").unwrap();
        let regions: Vec<Arc<Region>> =
            (0..HANDLES).map(|_| Arc::new(Region::open_or_create(&path).unwrap())).collect();
        let slots: Vec<Slot> = regions.iter().map(|r| r.join().unwrap()).collect();
        let stop = AtomicBool::new(false);
        let (held, denials): (Vec<u64>, Vec<u64>) = std::thread::scope(|s| {
            let watcher = s.spawn(|| {
                let mut max = 0;
                while !stop.load(SeqCst) {
                    max = max.max(daemon.used(dev));
                }
                max
            });
            // Reconciling all along must never take what an operation in flight holds.
            let reconciler = s.spawn(|| {
                let mut rounds = 0u64;
                while !stop.load(SeqCst) {
                    assert_eq!(daemon.reconcile(), 0);
                    rounds += 1;
                }
                rounds
            });
            let workers: Vec<_> = (0..HANDLES * THREADS)
                .map(|t| {
                    let r = regions[t % HANDLES].clone();
                    let slot = slots[t % HANDLES];
                    s.spawn(move || {
                        let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (t as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
                        let mut next = move || {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            rng
                        };
                        let mut mine: Vec<u64> = Vec::new();
                        let mut denied = 0;
                        for _ in 0..20_000 {
                            if mine.len() < 16 && next() % 3 != 0 {
                                let bytes = 1 + next() % (LIMIT / 16);
                                match r.try_reserve(slot, dev, bytes, Some(LIMIT)) {
                                    Ok(()) => mine.push(bytes),
                                    Err(d) => {
                                        assert!(d.used + bytes > d.limit && d.limit == LIMIT);
                                        denied += 1;
                                    }
                                }
                            } else if !mine.is_empty() {
                                let i = (next() as usize) % mine.len();
                                r.release(slot, dev, mine.swap_remove(i));
                            }
                        }
                        (mine.iter().sum::<u64>(), denied)
                    })
                })
                .collect();
            let out = workers.into_iter().map(|h| h.join().unwrap()).unzip();
            stop.store(true, SeqCst);
            assert!(watcher.join().unwrap() <= LIMIT);
            assert!(reconciler.join().unwrap() > 0);
            out
        });
        let total: u64 = held.iter().sum();
        assert_eq!(daemon.used(dev), total);
        let by_slot: u64 = slots.iter().map(|&s| daemon.slot_used(s, dev)).sum();
        assert_eq!(by_slot, total);
        assert!(denials.iter().sum::<u64>() > 0, "the limit was reached");
        let snap = daemon.snapshot();
        let counted: u64 = snap.processes.iter().map(|p| p.devices[dev].oom_denials).sum();
        assert_eq!(counted, denials.iter().sum::<u64>());
        assert!(snap.devices[dev].peak <= LIMIT);
        drop(regions);
        assert_eq!(daemon.reap(), HANDLES);
        assert_eq!(daemon.used(dev), 0);
    }

    #[test]
    fn reconcile_returns_what_a_half_done_operation_left() {
        let (_dir, path, daemon) = file_region();
        let (r, dev, me) = process_holding(&path, "GPU-a", 500);
        assert_eq!(daemon.reconcile(), 0, "nothing to return");
        // A process killed after raising the total, before raising its slot, in the middle of
        // its operation (guard busy): in doubt, left alone.
        let l = r.layout();
        l.slots[me.index].inflight.fetch_add(OP_START, SeqCst);
        l.devices[dev].used.fetch_add(300, SeqCst);
        assert_eq!(daemon.reconcile(), 0);
        assert_eq!(r.used(dev), 800);
        // Once no operation is in flight (here: the guard left; in life: the slot reaped) the
        // excess goes back.
        l.slots[me.index].inflight.fetch_sub(1, SeqCst);
        assert_eq!(daemon.reconcile(), 300);
        assert_eq!((r.used(dev), r.slot_used(me, dev)), (500, 500));
        // The dead process's slot: reaped, its guard reset, the excess returned by the reap.
        l.slots[me.index].inflight.fetch_add(OP_START, SeqCst);
        l.devices[dev].used.fetch_add(300, SeqCst);
        drop(r);
        assert_eq!(daemon.reap(), 1);
        assert_eq!(daemon.used(dev), 0);
    }

    /// The daemon's one-pass sample: the picture `snapshot` gives, the slots `reap` frees, and
    /// what a process killed mid-operation left returned, now or once no operation is in doubt.
    #[test]
    fn reap_and_snapshot_is_reap_then_snapshot_in_one_pass() {
        let (_dir, path, daemon) = file_region();
        let a = Region::open_or_create(&path).unwrap();
        let (sa, ga) = (a.join().unwrap(), a.device("GPU-a").unwrap());
        let b = Region::open_or_create(&path).unwrap();
        let (sb, gb) = (b.join().unwrap(), b.device("GPU-b").unwrap());
        a.try_reserve(sa, ga, 100, None).unwrap();
        a.record_launch(sa, ga);
        b.try_reserve(sb, gb, 200, None).unwrap();
        b.record_launch(sb, gb);
        b.record_gpu_time(sb, gb, 50);
        // Both alive: the snapshot's picture; nothing freed, nothing returned.
        let snap = daemon.reap_and_snapshot();
        assert_eq!(snap, daemon.snapshot());
        assert_eq!(snap.processes.len(), 2);
        assert_eq!((snap.devices[ga].used, snap.devices[gb].used), (100, 200));

        // b is killed in the middle of a reservation on GPU-a: the total raised, not its slot.
        let l = b.layout();
        l.slots[sb.index].inflight.fetch_add(OP_START, SeqCst);
        l.devices[ga].used.fetch_add(300, SeqCst);
        drop(b);
        let snap = daemon.reap_and_snapshot();
        assert_eq!(snap.processes.iter().map(|p| p.slot).collect::<Vec<_>>(), [sa.index], "b's slot freed");
        assert_eq!(snap.devices[ga].used, 100, "the excess b left is returned");
        assert_eq!(snap.devices[gb].used, 0, "b's memory is returned");
        let d = &snap.devices[gb];
        assert_eq!((d.exited_launches, d.exited_gpu_time_ns), (1, 50), "b's counters kept");
        assert_eq!(daemon.reap(), 0, "freed once");
        assert_eq!(snap, daemon.snapshot());

        // A live process in the middle of a reservation: in doubt, left alone; returned by a
        // later call that frees nothing, once no operation is in flight (as after a reconcile
        // that gave up, or a reaper killed half-way).
        let l = a.layout();
        l.slots[sa.index].inflight.fetch_add(OP_START, SeqCst);
        l.devices[ga].used.fetch_add(7, SeqCst);
        assert_eq!(daemon.reap_and_snapshot().devices[ga].used, 107);
        l.slots[sa.index].inflight.fetch_sub(1, SeqCst);
        assert_eq!(daemon.reap_and_snapshot().devices[ga].used, 100);
        assert_eq!(a.slot_used(sa, ga), 100, "the live process keeps what it holds");
    }

    /// A container that scribbles over its slots' state words: a slot marked live without a
    /// process is freed, an odd kind is not shown as a process, the real process is kept.
    #[test]
    fn reap_and_snapshot_survives_scribbled_slots() {
        let (_dir, path, daemon) = file_region();
        let a = Region::open_or_create(&path).unwrap();
        let (sa, ga) = (a.join().unwrap(), a.device("GPU-a").unwrap());
        a.try_reserve(sa, ga, 100, None).unwrap();
        let l = a.layout();
        // Live without a liveness lock.
        l.slots[700].state.store(LIVE, SeqCst);
        l.slots[700].pid.store(4242, SeqCst);
        // A kind no join writes.
        l.slots[900].state.store(3, SeqCst);
        l.slots[900].pid.store(4343, SeqCst);
        let snap = daemon.reap_and_snapshot();
        assert_eq!(snap.processes.iter().map(|p| p.pid).collect::<Vec<_>>(), [std::process::id()]);
        assert_eq!(kind(l.slots[700].state.load(SeqCst)), FREE, "a live slot without a process is freed");
        assert_eq!(kind(l.slots[900].state.load(SeqCst)), 3, "not a live slot: not reaped");
        assert_eq!((snap.devices[ga].used, a.slot_used(sa, ga)), (100, 100));
    }

    /// Joins, leaves (by dropping the handle: the lock goes as at death) and reaps racing: no two
    /// live handles ever share a slot, and every byte comes back.
    #[test]
    fn joins_and_reaps_race_safely() {
        let (_dir, path, daemon) = file_region();
        let dev = daemon.device("GPU-a").unwrap();
        let live: Mutex<HashSet<usize>> = Mutex::new(HashSet::new());
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let reapers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let r = Region::open_or_create(&path).unwrap();
                        let mut n = 0;
                        while !stop.load(SeqCst) {
                            n += r.reap();
                        }
                        n
                    })
                })
                .collect();
            let joiners: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        for _ in 0..300 {
                            let r = Region::open_or_create(&path).unwrap();
                            let slot = r.join().unwrap();
                            assert!(live.lock().unwrap().insert(slot.index), "slot {} given twice", slot.index);
                            r.try_reserve(slot, dev, 7, None).unwrap();
                            assert_eq!(r.slot_used(slot, dev), 7);
                            live.lock().unwrap().remove(&slot.index);
                            drop(r);
                        }
                    })
                })
                .collect();
            for j in joiners {
                j.join().unwrap();
            }
            stop.store(true, SeqCst);
            for r in reapers {
                r.join().unwrap();
            }
        });
        daemon.reap();
        assert_eq!(daemon.used(dev), 0);
        assert!(daemon.pids().is_empty());
    }

    /// Not an assertion: what the hot path costs (build with --release for real figures).
    #[test]
    fn reserve_release_cost() {
        let r = Region::anonymous().unwrap();
        let dev = r.device("GPU-a").unwrap();
        let me = r.join().unwrap();
        let n = 2_000_000u64;
        let t = std::time::Instant::now();
        for i in 0..n {
            let b = std::hint::black_box(4096 + (i & 1));
            r.try_reserve(me, dev, b, Some(1 << 40)).unwrap();
            r.release(me, dev, b);
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        let t = std::time::Instant::now();
        for _ in 0..n {
            r.record_launch(std::hint::black_box(me), dev);
        }
        let launch = t.elapsed().as_nanos() as f64 / n as f64;
        let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
        println!("reserve+release: {ns:.1} ns per pair; record_launch: {launch:.1} ns ({profile} build)");
        assert_eq!(r.used(dev), 0);
    }
}
