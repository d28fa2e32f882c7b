//! The process-global state: the container's limits, its accounting region and this process's
//! slot in it, the device map, and the allocation tracker.
//!
//! Nothing happens at load time. The state is made on the first CUDA or NVML call that needs it
//! (`cuInit` normally), once: in a container with an allocation, the limits file and region
//! tessera-hook mounted at `/run/tessera/alloc` (whatever the environment says); standalone, the
//! limits from `TESSERA_LIMITS` (a file) or the `TESSERA_*` variables (none: no limits), the
//! region from `TESSERA_REGION` (none: an anonymous one). A
//! config that cannot be read or is malformed prints exactly one line on stderr and disables
//! CUDA for the process ([`ensure`] fails from then on: fail closed).
//!
//! Limits come only from what the container cannot write: the read-only limits file (or, standalone,
//! the environment), parsed into this process's own memory. The region is shared with every
//! process of the container, so nothing enforced is read from it: each process keeps its own copy
//! of every device's memory limit and SM share, and never holds more than the limit by itself
//! whatever the region's totals say.
//!
//! Live reload: the daemon rewrites the limits file atomically, then bumps the region's config
//! generation. Every intercepted call compares the generation (one atomic load) with the one it
//! last saw and re-reads the file when it moved. The generation is only a prompt (any process of
//! the container can write it): the file is also looked at (one `stat`) at most once a second,
//! and re-read when it was replaced, so holding the generation back delays a change by a second.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex};

use tessera_region::{ENV_LIMITS, ENV_REGION, Limits, MAX_DEVICES, Priority, Region, Slot, monotonic_ns};

use crate::ffi::*;
use crate::memory::Tracker;
use crate::real::{self, RealCuda};

/// Where the limits came from, for reloads.
enum Source {
    /// A limits file (re-read when the generation moves).
    File(PathBuf),
    /// Environment variables (fixed for the life of the process).
    Env,
    /// Nothing configured: no limits.
    None,
}

/// CUDA ordinals this process maps (a driver exposes at most a few dozen devices).
const MAX_ORDINALS: usize = 64;
/// Size of the context → ordinal cache.
const CTX_CACHE: usize = 512;
/// Streams whose device is remembered (direct-mapped; a collision only costs a driver call).
const STREAM_CACHE: usize = 1024;
/// The limits file is looked at (whatever the generation says) at most this often.
const FILE_CHECK_NS: u64 = 1_000_000_000;
/// Intercepted calls on a thread between two looks at the clock for that check.
const FILE_CHECK_CALLS: u32 = 256;

/// What identifies one version of the limits file: the daemon replaces it by a rename.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
struct FileStamp {
    ino: u64,
    mtime_ns: i128,
    size: u64,
}

fn stamp(path: &std::path::Path) -> Option<FileStamp> {
    std::fs::metadata(path).ok().as_ref().map(stamp_of)
}

fn stamp_of(m: &std::fs::Metadata) -> FileStamp {
    use std::os::unix::fs::MetadataExt;
    FileStamp {
        ino: m.ino(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        size: m.size(),
    }
}

/// The limits this process enforces per region device, from its own parsed copy of the limits
/// (never from the region).
struct Enforced {
    /// Memory limit + 1; 0: none.
    memory: [AtomicU64; MAX_DEVICES],
    /// SM share in percent; 0: none.
    sm_percent: [AtomicU32; MAX_DEVICES],
    /// What this process holds per device (its own tally, beside its region slot's).
    held: [AtomicU64; MAX_DEVICES],
    /// A launch on the device needs nothing of the compute limiter: no SM share below 100% and
    /// normal priority (set with the other limits; false until the device is known).
    plain: [AtomicBool; MAX_DEVICES],
    /// Bit `dev` set: a known device whose launches do need the limiter. While none is, a
    /// launch may take its device from the thread's view of its current context (`current`).
    limited: AtomicU32,
}

// One bit per region device in `Enforced::limited`.
const _: () = assert!(MAX_DEVICES <= 32);

/// A device this process has seen: its CUDA ordinal (if seen through CUDA), the index its
/// `index:N` limits entry would have, its UUID and its region index.
#[derive(Clone)]
struct Known {
    ordinal: Option<c_int>,
    index: u32,
    uuid: String,
    dev: usize,
}

pub(crate) struct ShimState {
    pub region: Region,
    pub slot: Slot,
    source: Source,
    /// The current limits: a pointer from `Arc::into_raw` whose strong count we never release
    /// (old versions are kept alive, so a reader's pointer never dangles; reloads are rare).
    limits: AtomicPtr<Limits>,
    seen_generation: AtomicU64,
    reload_lock: Mutex<()>,
    /// The limits file as last read, and when it was last looked at.
    file_stamp: Mutex<Option<FileStamp>>,
    file_checked_ns: AtomicU64,
    enforced: Enforced,
    /// Whether any limits source is configured (else NVML and memory queries pass through).
    pub(crate) configured: bool,
    /// CUDA ordinal → region device index + 1 (0: not mapped yet).
    by_ordinal: [AtomicU32; MAX_ORDINALS],
    known: Mutex<Vec<Known>>,
    /// Direct-mapped cache: context handle << 8 | (ordinal + 1). Boxed, as `stream_cache`.
    ctx_cache: Box<[AtomicU64; CTX_CACHE]>,
    /// The driver enumerates exactly one device here (seen at `cuInit`): the default streams'
    /// device is ordinal 0's, whatever context is current (a launch without one fails anyway).
    one_device: AtomicBool,
    /// Stream handle << 8 | (region device index + 1): a stream's device, learned once (its
    /// first launch or stream-ordered allocation), forgotten when the stream or its context goes.
    /// On the heap from zeroed pages (`zeroed_cache`): built inline, its 8 KiB would be written
    /// at start-up, on the stack and again in the state's box, page faults every process pays.
    stream_cache: Box<[AtomicU64; STREAM_CACHE]>,
    pub(crate) mem: Tracker,
    /// When this process last reaped for a memory query (ns on the monotonic clock).
    last_reap_ns: AtomicU64,
    /// The region was found damaged: every hooked call fails closed from then on.
    damaged: AtomicBool,
}

impl ShimState {
    /// The container's current limits (re-read when the config generation has moved).
    pub fn limits(&self) -> Arc<Limits> {
        self.refresh();
        let p = self.limits.load(Acquire);
        // SAFETY: p came from Arc::into_raw and that strong reference is never released, so the
        // allocation is alive; we add one reference for the Arc we hand out.
        unsafe {
            Arc::increment_strong_count(p);
            Arc::from_raw(p)
        }
    }

    /// Re-reads the limits if the daemon bumped the config generation, or (looked at once a
    /// second) the file was replaced. One atomic load and a thread-local count when neither.
    #[inline]
    pub(crate) fn refresh(&self) {
        if self.refresh_generation() {
            return;
        }
        thread_local!(static CALLS: Cell<u32> = const { Cell::new(0) });
        let n = CALLS.with(|c| {
            let n = c.get().wrapping_add(1);
            c.set(n);
            n
        });
        if n.is_multiple_of(FILE_CHECK_CALLS) {
            self.check_file();
        }
    }

    /// Re-reads the limits if the daemon bumped the config generation (true: it had moved).
    #[inline(always)]
    fn refresh_generation(&self) -> bool {
        let g = self.region.config_generation();
        if g != self.seen_generation.load(Relaxed) {
            self.reload(Some(g));
            return true;
        }
        false
    }

    /// Whether a launch on region device `dev` needs nothing of the compute limiter.
    #[inline(always)]
    pub(crate) fn plain_launch(&self, dev: usize) -> bool {
        self.enforced.plain.get(dev).is_some_and(|p| p.load(Relaxed))
    }

    /// Counts a launch on a device in this process's slot. Every [`FILE_CHECK_CALLS`]th launch
    /// on a device also looks at the limits file (as [`ShimState::refresh`] does for other calls,
    /// with the slot's own counter instead of a thread-local one).
    #[inline(always)]
    pub(crate) fn count_launch(&self, dev: usize) {
        let before = self.region.count_launch(self.slot, dev);
        if before % u64::from(FILE_CHECK_CALLS) == u64::from(FILE_CHECK_CALLS) - 1 {
            self.check_file_guarded();
        }
    }

    /// The fast path of a launch on `stream`: `Ok` when the launch needs nothing of the limiter
    /// and has been counted (the caller then calls the driver). `Err` when anything else is
    /// needed: the generation moved, a trace is asked for, the stream's device is not cached
    /// (or has a share, or the container a priority); the caller then takes the full path,
    /// which counts the launch itself. `Err(Some(dev))`: the stream's device, found here from
    /// the driver's answer of this call (the full path then need not ask the driver again: on a
    /// default stream that is a second `cuCtxGetCurrent`). Nothing here can panic, and nothing
    /// allocates.
    #[inline(always)]
    pub(crate) fn fast_launch(&self, stream: *mut c_void) -> Result<(), Option<usize>> {
        if self.region.config_generation() != self.seen_generation.load(Relaxed) || self.region.trace_requested() {
            return Err(None);
        }
        let Some((dev, exact)) = self.cached_device_of_stream(stream) else { return Err(None) };
        if !self.plain_launch(dev) {
            return Err(exact.then_some(dev));
        }
        self.count_launch(dev);
        Ok(())
    }

    /// A stream's device when it is known without learning anything: a cached stream, the one
    /// device of a process that sees one, or the current context's when its device is cached.
    /// With whether it is exact: false when it came from the thread's remembered ordinal
    /// ([`crate::current`]), good for counting a launch but not for limiting one.
    #[inline(always)]
    fn cached_device_of_stream(&self, stream: *mut c_void) -> Option<(usize, bool)> {
        if matches!(stream as usize, 0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD) {
            let (ordinal, exact) = if self.one_device.load(Relaxed) {
                (0, true)
            } else if self.enforced.limited.load(Acquire) == 0 {
                // No device needs the limiter: a stale view could only miscount a launch.
                (crate::current::ordinal(|| self.cached_current_ordinal())?, false)
            } else {
                (self.cached_current_ordinal()?, true)
            };
            return match self.by_ordinal.get(ordinal)?.load(Acquire) {
                0 => None,
                v => Some((v as usize - 1, exact)),
            };
        }
        let key = stream as u64;
        let v = self.stream_cache.get(cache_slot(key, STREAM_CACHE))?.load(Relaxed);
        (v != 0 && v >> 8 == key).then(|| ((v & 0xff) as usize - 1, true))
    }

    /// The current context's CUDA ordinal when the context is cached (a driver call: kept out of
    /// line, so that the fast path needs no registers saved).
    #[inline(never)]
    fn cached_current_ordinal(&self) -> Option<usize> {
        let cu = real::cuda_ready()?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: ctx is a valid out-pointer.
        if unsafe { (cu.cuCtxGetCurrent)(&mut ctx) } != CUDA_SUCCESS || ctx.is_null() {
            return None;
        }
        let key = ctx as u64;
        let v = self.ctx_cache.get(ctx_slot(key))?.load(Relaxed);
        (v != 0 && v >> 8 == key).then(|| (v & 0xff) as usize - 1)
    }

    /// Notes how many devices the driver enumerates (after a successful `cuInit`).
    pub(crate) fn learn_device_count(&self, cu: &RealCuda) {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer.
        let ok = unsafe { (cu.cuDeviceGetCount)(&mut n) } == CUDA_SUCCESS;
        self.one_device.store(ok && n == 1, Relaxed);
    }

    /// [`ShimState::check_file`] from outside the hooks' guard (the fast path): a panic stops here.
    #[cold]
    #[inline(never)]
    fn check_file_guarded(&self) {
        guard((), || self.check_file());
    }

    /// Re-reads the limits file if it was replaced since it was read (at most once a second).
    /// Also looks at the region's header (every [`FILE_CHECK_CALLS`] calls).
    #[cold]
    fn check_file(&self) {
        self.region_intact();
        let Source::File(path) = &self.source else { return };
        let now = monotonic_ns();
        let last = self.file_checked_ns.load(Relaxed);
        if now.saturating_sub(last) < FILE_CHECK_NS
            || self.file_checked_ns.compare_exchange(last, now, Relaxed, Relaxed).is_err()
        {
            return;
        }
        let seen = *self.file_stamp.lock().unwrap_or_else(|e| e.into_inner());
        if stamp(path) != seen {
            self.reload(None);
        }
    }

    /// Whether the region is still what it was made as (magic, layout version and size, its
    /// file not shrunk under the mapping). The first time it is not, the process fails closed:
    /// one line on stderr, and every hooked call answers `CUDA_ERROR_NOT_PERMITTED` from then on
    /// (its counters, the compute budget's among them, mean nothing any more: waiting on them
    /// could be forever).
    pub(crate) fn region_intact(&self) -> bool {
        if self.damaged.load(Relaxed) {
            return false;
        }
        if self.region.is_damaged() {
            self.fail_closed("its header was overwritten or its file shrank");
            return false;
        }
        true
    }

    /// The region can no longer be trusted (`why`): CUDA is disabled in this process, said once.
    #[cold]
    pub(crate) fn fail_closed(&self, why: &str) {
        if !self.damaged.swap(true, AcqRel) {
            // No launch takes the fast path any more: the slow one answers the error.
            for p in &self.enforced.plain {
                p.store(false, Release);
            }
            eprintln!("tessera: {}: the accounting region is damaged ({why}); CUDA disabled", self.region.name());
        }
    }

    /// Whether this process failed closed on a damaged region.
    #[inline(always)]
    pub(crate) fn is_failed_closed(&self) -> bool {
        self.damaged.load(Relaxed)
    }

    /// Re-reads the limits file; `g`: the generation that prompted it.
    #[cold]
    fn reload(&self, g: Option<u64>) {
        // A generation moved by garbage written over the region, not by the daemon.
        if !self.region_intact() {
            return;
        }
        let Ok(_guard) = self.reload_lock.try_lock() else { return };
        if g.is_some_and(|g| self.seen_generation.load(Acquire) == g) {
            return;
        }
        if let Source::File(path) = &self.source {
            match Limits::load_with_metadata(path) {
                Ok((l, read)) => {
                    self.install(l);
                    *self.file_stamp.lock().unwrap_or_else(|e| e.into_inner()) = Some(stamp_of(&read));
                }
                Err(e) => eprintln!("tessera: {e}; keeping the previous limits"),
            }
        }
        if let Some(g) = g {
            self.seen_generation.store(g, Release);
        }
    }

    /// Makes `l` the current limits and applies them to every known device.
    fn install(&self, l: Limits) {
        let p = Arc::into_raw(Arc::new(l)).cast_mut();
        self.limits.store(p, Release);
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for k in known {
            self.apply(&k);
        }
    }

    /// Sets the device's enforced limits from the current limits.
    fn apply(&self, k: &Known) {
        let p = self.limits.load(Acquire);
        // SAFETY: as in `limits`: the pointee is never freed.
        let l = unsafe { &*p };
        let d = l.device(&k.uuid, k.index);
        let (Some(memory), Some(sm), Some(plain)) =
            (self.enforced.memory.get(k.dev), self.enforced.sm_percent.get(k.dev), self.enforced.plain.get(k.dev))
        else {
            return;
        };
        let share = d.and_then(|d| d.sm_percent).unwrap_or(0);
        memory.store(d.and_then(|d| d.memory_limit).map_or(0, |m| m.saturating_add(1)), Release);
        sm.store(share, Release);
        let is_plain = l.priority == Priority::Normal && (share == 0 || share >= 100);
        // Marked limited before it stops being plain, so no launch sees neither.
        if !is_plain {
            self.enforced.limited.fetch_or(1 << k.dev, Release);
        }
        plain.store(is_plain, Release);
        if is_plain {
            self.enforced.limited.fetch_and(!(1 << k.dev), Release);
        }
    }

    /// The memory limit this process enforces on a region device (`None`: none).
    #[inline]
    pub(crate) fn memory_limit(&self, dev: usize) -> Option<u64> {
        self.enforced.memory.get(dev)?.load(Acquire).checked_sub(1)
    }

    /// The SM share (percent) this process enforces on a region device (`None`: none).
    #[inline]
    pub(crate) fn sm_percent(&self, dev: usize) -> Option<u32> {
        Some(self.enforced.sm_percent.get(dev)?.load(Acquire)).filter(|&p| p != 0)
    }

    /// The directory of the limits file this process read (its allocation's), if it read one.
    pub(crate) fn limits_dir(&self) -> Option<&std::path::Path> {
        match &self.source {
            Source::File(p) => p.parent(),
            _ => None,
        }
    }

    /// The UUID of a region device this process has mapped.
    pub(crate) fn uuid_of(&self, dev: usize) -> Option<String> {
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known.iter().find(|k| k.dev == dev).map(|k| k.uuid.clone())
    }

    /// The region device index of a CUDA ordinal (mapping it on first sight).
    pub(crate) fn device_of_ordinal(&self, ordinal: c_int) -> Option<usize> {
        let o = usize::try_from(ordinal).ok()?;
        if let Some(slot) = self.by_ordinal.get(o) {
            let v = slot.load(Acquire);
            if v != 0 {
                return Some(v as usize - 1);
            }
        }
        self.map_ordinal(ordinal)
    }

    #[cold]
    fn map_ordinal(&self, ordinal: c_int) -> Option<usize> {
        let cu = real::cuda()?;
        let mut u = uuid_zero();
        // SAFETY: u is a valid out-pointer for a CUuuid.
        if unsafe { (cu.cuDeviceGetUuid)(&mut u, ordinal) } != CUDA_SUCCESS {
            return None;
        }
        let uuid = self.uuid_key(&uuid_bytes(&u), ordinal);
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        let dev = match known.iter_mut().find(|k| k.uuid.eq_ignore_ascii_case(&uuid)) {
            Some(k) => {
                // Seen through NVML first: now we know its CUDA ordinal.
                k.ordinal = Some(ordinal);
                k.index = ordinal as u32;
                let k = k.clone();
                self.apply(&k);
                k.dev
            }
            None => {
                let dev = match self.region.device(&uuid) {
                    Ok(dev) => dev,
                    Err(e) => {
                        self.say_unmapped(ordinal, &e);
                        return None;
                    }
                };
                let k = Known { ordinal: Some(ordinal), index: ordinal as u32, uuid, dev };
                self.apply(&k);
                known.push(k);
                dev
            }
        };
        if let Some(slot) = self.by_ordinal.get(ordinal as usize) {
            slot.store(dev as u32 + 1, Release);
        }
        Some(dev)
    }

    /// Whether CUDA device `ordinal` exists but has no entry in the region (its table full, or an
    /// entry garbled: the container can write the region). With limits to hold, no context is
    /// made there (`memory::context`): unmapped, its allocations would pass uncounted.
    #[cold]
    pub(crate) fn unmappable(&self, ordinal: c_int) -> bool {
        let Some(cu) = real::cuda() else { return false };
        let mut u = uuid_zero();
        // SAFETY: u is a valid out-pointer for a CUuuid.
        if unsafe { (cu.cuDeviceGetUuid)(&mut u, ordinal) } != CUDA_SUCCESS {
            return false;
        }
        let uuid = self.uuid_key(&uuid_bytes(&u), ordinal);
        self.region.device(&uuid).is_err()
    }

    /// One line on stderr, once per process, for a device the region has no entry for.
    #[cold]
    fn say_unmapped(&self, ordinal: c_int, e: &tessera_region::RegionError) {
        static SAID: AtomicBool = AtomicBool::new(false);
        if self.configured && !SAID.swap(true, Relaxed) {
            eprintln!(
                "tessera: CUDA device {ordinal}: {e}; no context is made on it (its memory could not be counted)"
            );
        }
    }

    /// The region device index of a device NVML names by UUID (`index`: its NVML index, used
    /// for `index:N` limits until CUDA tells its ordinal).
    pub(crate) fn device_of_uuid(&self, uuid: &str, index: u32) -> Option<usize> {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = known.iter().find(|k| k.uuid.eq_ignore_ascii_case(uuid)) {
            return Some(k.dev);
        }
        let dev = self.region.device(uuid).ok()?;
        let k = Known { ordinal: None, index, uuid: uuid.to_string(), dev };
        self.apply(&k);
        known.push(k);
        Some(dev)
    }

    /// The UUID text of a CUDA device: `GPU-…`, or `MIG-…` when the limits name it so (CUDA
    /// reports a MIG device's UUID bytes without saying which it is).
    fn uuid_key(&self, bytes: &[u8; 16], _ordinal: c_int) -> String {
        let gpu = uuid_text("GPU-", bytes);
        let mig = uuid_text("MIG-", bytes);
        // SAFETY: as in `limits`: the pointee is never freed.
        let l = unsafe { &*self.limits.load(Acquire) };
        if l.devices.iter().any(|d| d.uuid.eq_ignore_ascii_case(&mig)) { mig } else { gpu }
    }

    /// The region device index of the calling thread's current context's device.
    pub fn current_device(&self) -> Option<usize> {
        let (_, ordinal) = self.current_context()?;
        self.device_of_ordinal(ordinal)
    }

    /// The calling thread's current context and its CUDA ordinal.
    pub(crate) fn current_context(&self) -> Option<(CUcontext, c_int)> {
        let cu = real::cuda()?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: ctx is a valid out-pointer.
        if unsafe { (cu.cuCtxGetCurrent)(&mut ctx) } != CUDA_SUCCESS || ctx.is_null() {
            return None;
        }
        Some((ctx, self.ordinal_of_context(cu, ctx)?))
    }

    /// The region device index of a stream's device (a null or special stream: the current
    /// context's).
    pub fn device_of_stream(&self, stream: *mut c_void) -> Option<usize> {
        if matches!(stream as usize, 0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD) {
            if self.one_device.load(Relaxed) {
                return self.device_of_ordinal(0);
            }
            return self.current_device();
        }
        let key = stream as u64;
        let slot = &self.stream_cache[cache_slot(key, STREAM_CACHE)];
        let v = slot.load(Relaxed);
        if v != 0 && v >> 8 == key {
            return Some((v & 0xff) as usize - 1);
        }
        let cu = real::cuda()?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: stream is the caller's handle; ctx a valid out-pointer.
        if unsafe { (cu.cuStreamGetCtx)(stream.cast(), &mut ctx) } != CUDA_SUCCESS || ctx.is_null() {
            return None;
        }
        let ordinal = self.ordinal_of_context(cu, ctx)?;
        let dev = self.device_of_ordinal(ordinal)?;
        if key >> 56 == 0 && dev < 255 {
            slot.store(key << 8 | (dev as u64 + 1), Relaxed);
        }
        Some(dev)
    }

    /// Forgets a stream about to be destroyed (its handle may come back for a stream elsewhere).
    pub(crate) fn forget_stream(&self, stream: *mut c_void) {
        let key = stream as u64;
        let slot = &self.stream_cache[cache_slot(key, STREAM_CACHE)];
        let v = slot.load(Relaxed);
        if v >> 8 == key {
            let _ = slot.compare_exchange(v, 0, Relaxed, Relaxed);
        }
    }

    /// Forgets every stream: a context went, and its streams with it (rare: a reset or destroy).
    pub(crate) fn forget_all_streams(&self) {
        for slot in self.stream_cache.iter() {
            slot.store(0, Relaxed);
        }
    }

    /// A context's CUDA ordinal: from the cache, else by asking the driver in that context.
    pub(crate) fn ordinal_of_context(&self, cu: &RealCuda, ctx: CUcontext) -> Option<c_int> {
        let key = ctx as u64;
        let slot = &self.ctx_cache[ctx_slot(key)];
        let v = slot.load(Relaxed);
        if v != 0 && v >> 8 == key {
            return Some((v & 0xff) as c_int - 1);
        }
        // SAFETY: ctx is a context handle from the driver; push/pop leave the stack as it was.
        let ordinal = unsafe {
            if (cu.cuCtxPushCurrent_v2)(ctx) != CUDA_SUCCESS {
                return None;
            }
            let mut d: CUdevice = -1;
            let rc = (cu.cuCtxGetDevice)(&mut d);
            let mut popped: CUcontext = std::ptr::null_mut();
            (cu.cuCtxPopCurrent_v2)(&mut popped);
            if rc != CUDA_SUCCESS {
                return None;
            }
            d
        };
        self.remember_context(ctx, ordinal);
        Some(ordinal)
    }

    /// Records which device a context is on.
    pub(crate) fn remember_context(&self, ctx: CUcontext, ordinal: c_int) {
        let key = ctx as u64;
        if key >> 56 != 0 || !(0..255).contains(&ordinal) {
            return;
        }
        self.ctx_cache[ctx_slot(key)].store(key << 8 | (ordinal as u64 + 1), Relaxed);
    }

    /// Forgets a destroyed context.
    pub(crate) fn forget_context(&self, ctx: CUcontext) {
        let key = ctx as u64;
        let slot = &self.ctx_cache[ctx_slot(key)];
        let v = slot.load(Relaxed);
        if v >> 8 == key {
            let _ = slot.compare_exchange(v, 0, Relaxed, Relaxed);
        }
    }

    /// Reserves `bytes` on a device for this process, within the limit of its own copy of the
    /// limits: this process alone never passes it (its own tally), and the container's total in
    /// the region does not either (on a denial, dead processes' usage is reclaimed and the
    /// reservation tried once more). False: over the limit. On a denial, a context of ours whose
    /// true-up was deferred is trued up first (`memory::context`), and the memory pools are read
    /// again (`memory::pools`): neither a context's excess reservation nor what a pool released
    /// since it was read must ever be the reason for a refusal. A refusal is counted once in the
    /// region (`tessera_container_oom_denials_total`), whichever limit refused it: the process's
    /// own tally (a lone process) or the container's total.
    pub(crate) fn reserve(&self, dev: usize, bytes: u64) -> bool {
        let ok = self.reserve_uncounted(dev, bytes);
        if !ok {
            self.region.count_oom_denial(self.slot, dev);
        }
        ok
    }

    /// [`Self::reserve`] without counting a refusal: for a first try that another follows.
    pub(crate) fn reserve_uncounted(&self, dev: usize, bytes: u64) -> bool {
        if bytes == 0 {
            return true;
        }
        self.reserve_once(dev, bytes)
            || (crate::memory::context::settle(self, dev) && self.reserve_once(dev, bytes))
            || (crate::memory::pools::settle_all(self) && self.reserve_once(dev, bytes))
    }

    fn reserve_once(&self, dev: usize, bytes: u64) -> bool {
        let Some(held) = self.enforced.held.get(dev) else { return false };
        let limit = self.memory_limit(dev);
        let own =
            held.fetch_update(AcqRel, Acquire, |h| h.checked_add(bytes).filter(|&t| limit.is_none_or(|l| t <= l)));
        if own.is_err() {
            return false;
        }
        if self.region.try_reserve_uncounted(self.slot, dev, bytes, limit).is_ok() {
            return true;
        }
        self.region.reap();
        if self.region.try_reserve_uncounted(self.slot, dev, bytes, limit).is_ok() {
            return true;
        }
        held.fetch_sub(bytes, AcqRel);
        false
    }

    /// Charges `bytes` the driver already took on a device, whatever the limit (a true-up of
    /// memory that cannot be refused any more: the charge stays true).
    pub(crate) fn charge_unchecked(&self, dev: usize, bytes: u64) {
        if bytes == 0 {
            return;
        }
        if let Some(held) = self.enforced.held.get(dev) {
            held.fetch_add(bytes, AcqRel);
            let _ = self.region.try_reserve(self.slot, dev, bytes, None);
        }
    }

    /// Reclaims dead processes' usage before a memory query reports it, at most every 100 ms
    /// (a reap costs a syscall per live process; monitoring tools may poll).
    pub(crate) fn reap_for_query(&self) {
        let now = monotonic_ns();
        let last = self.last_reap_ns.load(Relaxed);
        if now.saturating_sub(last) >= 100_000_000
            && self.last_reap_ns.compare_exchange(last, now, Relaxed, Relaxed).is_ok()
        {
            self.region.reap();
        }
    }

    /// Returns `bytes` reserved on a device.
    pub(crate) fn refund(&self, dev: usize, bytes: u64) {
        if bytes > 0 {
            if let Some(held) = self.enforced.held.get(dev) {
                let _ = held.fetch_update(AcqRel, Acquire, |h| Some(h.saturating_sub(bytes)));
            }
            self.region.release(self.slot, dev, bytes);
        }
    }

    /// What this process holds on a device, by its own tally.
    pub(crate) fn held(&self, dev: usize) -> u64 {
        self.enforced.held.get(dev).map_or(0, |h| h.load(Acquire))
    }
}

#[inline(always)]
fn ctx_slot(key: u64) -> usize {
    cache_slot(key, CTX_CACHE)
}

/// A handle's slot in a direct-mapped cache of `len` entries (Fibonacci hashing).
#[inline(always)]
fn cache_slot(key: u64, len: usize) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % len
}

// ---- The one instance ----------------------------------------------------------------------

static STATE: AtomicPtr<ShimState> = AtomicPtr::new(std::ptr::null_mut());
/// Set when the config was bad: CUDA stays disabled in this process.
static DISABLED: AtomicBool = AtomicBool::new(false);
/// 0 free, 1 someone is initializing (a spin flag, not a mutex: a fork child resets it).
static INIT: AtomicU8 = AtomicU8::new(0);
static ATFORK: AtomicBool = AtomicBool::new(false);

/// The state once made (`None` before the first CUDA/NVML call through us, and when disabled).
#[inline(always)]
pub(crate) fn get() -> Option<&'static ShimState> {
    let p = STATE.load(Acquire);
    // SAFETY: a non-null STATE points to a leaked ShimState, never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// CUDA is disabled in this process (a bad config).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Disabled;

/// The state, made now if need be; `Err` if the config is bad (fail closed).
#[inline]
pub(crate) fn ensure() -> Result<&'static ShimState, Disabled> {
    if let Some(s) = get() {
        return Ok(s);
    }
    ensure_slow()
}

#[cold]
fn ensure_slow() -> Result<&'static ShimState, Disabled> {
    loop {
        if DISABLED.load(Acquire) {
            return Err(Disabled);
        }
        if let Some(s) = get() {
            return Ok(s);
        }
        if INIT.compare_exchange(0, 1, AcqRel, Acquire).is_ok() {
            break;
        }
        std::thread::yield_now();
    }
    let made = match make() {
        Ok(s) => {
            STATE.store(Box::into_raw(Box::new(s)), Release);
            Ok(get().expect("just stored"))
        }
        Err(line) => {
            eprintln!("{line}");
            DISABLED.store(true, Release);
            Err(Disabled)
        }
    };
    if !ATFORK.swap(true, AcqRel) {
        // SAFETY: registering a plain function with no captured state.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    }
    INIT.store(0, Release);
    made
}

/// In a child forked after initialization: the parent's slot and allocations are the parent's;
/// the child starts over (with a slot of its own) if it uses CUDA. The parent's state is left
/// as it is (leaked in the child).
extern "C" fn forked_child() {
    STATE.store(std::ptr::null_mut(), Release);
    INIT.store(0, Release);
}

/// Makes the state from the environment; `Err` is the one line to print.
/// The allocation directory tessera-hook mounted into this container (read-only, holding the
/// limits file), if there is one. Its limits, region and ledger are the process's whatever the
/// environment says: unsetting or repointing `TESSERA_LIMITS`, `TESSERA_REGION` or
/// `TESSERA_LEDGER` must not lift a limit. Looked at once.
pub(crate) fn mounted_alloc_dir() -> Option<&'static std::path::Path> {
    static MOUNTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let dir = std::path::Path::new(tessera_region::CONTAINER_ALLOC_DIR);
    MOUNTED.get_or_init(|| is_file(&dir.join("limits"))).then_some(dir)
}

/// Whether `path` is a regular file (following links), by one `stat`: std's first failing
/// `statx` of a process asks the kernel a second time whether `statx` exists at all.
fn is_file(path: &std::path::Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: all-zero is a valid `stat` to be filled.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a writable `stat`.
    unsafe { libc::stat(c.as_ptr(), &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFREG }
}

fn make() -> Result<ShimState, String> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let mounted = mounted_alloc_dir();
    // A limits file's metadata comes from the file read: the stamp later looks are compared with.
    let from_file = |path: PathBuf| match Limits::load_with_metadata(&path) {
        Ok((l, m)) => (Ok(Some(l)), Source::File(path), Some(m)),
        Err(e) => (Err(e), Source::File(path), None),
    };
    let (limits, source, read) = match (mounted, var(ENV_LIMITS)) {
        (Some(dir), _) => from_file(dir.join("limits")),
        // What `Limits::from_env` would load first.
        (None, Some(p)) => from_file(PathBuf::from(p.trim())),
        (None, None) => (Limits::from_env(|k| std::env::var(k).ok()), Source::Env, None),
    };
    let limits = limits.map_err(|e| format!("tessera: {e}; CUDA disabled"))?;
    let (limits, source, configured) = match (limits, source) {
        (Some(l), s) => (l, s, true),
        (None, _) => (Limits::default(), Source::None, false),
    };
    let region_path = match mounted {
        Some(dir) => Some(dir.join("region")),
        None => var(ENV_REGION).map(|p| PathBuf::from(p.trim())),
    };
    let region = match region_path {
        Some(p) => Region::open_or_create(&p).map_err(|e| format!("tessera: {}: {e}; CUDA disabled", p.display()))?,
        None => Region::anonymous().map_err(|e| format!("tessera: anonymous region: {e}; CUDA disabled"))?,
    };
    let slot = region.join().map_err(|e| format!("tessera: joining the region: {e}; CUDA disabled"))?;
    let generation = region.config_generation();
    let file_stamp = read.as_ref().map(stamp_of);
    Ok(ShimState {
        file_stamp: Mutex::new(file_stamp),
        file_checked_ns: AtomicU64::new(monotonic_ns()),
        enforced: Enforced {
            memory: [const { AtomicU64::new(0) }; MAX_DEVICES],
            sm_percent: [const { AtomicU32::new(0) }; MAX_DEVICES],
            held: [const { AtomicU64::new(0) }; MAX_DEVICES],
            plain: [const { AtomicBool::new(false) }; MAX_DEVICES],
            limited: AtomicU32::new(0),
        },
        limits: AtomicPtr::new(Arc::into_raw(Arc::new(limits)).cast_mut()),
        seen_generation: AtomicU64::new(generation),
        reload_lock: Mutex::new(()),
        configured,
        source,
        by_ordinal: [const { AtomicU32::new(0) }; MAX_ORDINALS],
        known: Mutex::new(Vec::new()),
        ctx_cache: zeroed_cache(),
        one_device: AtomicBool::new(false),
        stream_cache: zeroed_cache(),
        mem: Tracker::new(),
        last_reap_ns: AtomicU64::new(0),
        damaged: AtomicBool::new(false),
        region,
        slot,
    })
}

/// A cache of `N` empty entries from the allocator's zeroed memory (`calloc`: fresh pages are
/// not written), so that a page is touched only when an entry on it is first used.
fn zeroed_cache<const N: usize>() -> Box<[AtomicU64; N]> {
    // SAFETY: all-zero bytes are a valid AtomicU64 (its value 0), so a zeroed array of them is
    // initialized.
    unsafe { Box::<[AtomicU64; N]>::new_zeroed().assume_init() }
}

/// The prologue of a CUDA hook: the real driver and the state (made if need be), the config
/// generation checked. `Err` is what the hook returns without calling the driver.
#[inline]
pub(crate) fn enter() -> Result<(&'static ShimState, &'static RealCuda), CUresult> {
    let (s, cu) = enter_launch()?;
    s.refresh();
    Ok((s, cu))
}

/// [`enter`] for a launch hook: the config generation is checked, and the limits file is looked
/// at by [`ShimState::count_launch`] or [`ShimState::refresh`] (no thread-local count here).
#[inline(always)]
pub(crate) fn enter_launch() -> Result<(&'static ShimState, &'static RealCuda), CUresult> {
    let s = ensure().map_err(|_| CUDA_ERROR_NOT_PERMITTED)?;
    let cu = real::cuda().ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
    s.refresh_generation();
    if s.is_failed_closed() {
        return Err(CUDA_ERROR_NOT_PERMITTED);
    }
    Ok((s, cu))
}
