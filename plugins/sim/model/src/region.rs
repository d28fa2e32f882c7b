//! The mapped state file: creating it atomically, opening it, the robust lock, and process slots.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering::*};

use crate::layout::*;
use crate::node::NodeDescription;
use crate::{Result, SimError};

pub struct Region {
    shared: *const Shared,
    /// Our own open file description: it carries our slot's liveness lock.
    fd: AtomicI32,
    path: CString,
    /// Our process slot + 1 (0: none yet).
    slot: AtomicU32,
}

// SAFETY: the mapping is shared memory made only of atomics and a process-shared mutex; the raw
// pointer stays valid for the Region's life (unmapped in Drop) and may be used from any thread.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

fn errno_msg(what: &str, path: &Path) -> SimError {
    SimError::State(format!("{what} {}: {}", path.display(), std::io::Error::last_os_error()))
}

impl Region {
    pub fn open_or_create(path: &Path, desc: &NodeDescription) -> Result<Region> {
        match Region::open(path) {
            Ok(r) => Ok(r),
            Err(None) => {
                Region::create(path, desc)?;
                Region::open(path).map_err(|e| e.unwrap_or_else(|| errno_msg("open", path)))
            }
            Err(Some(e)) => Err(e),
        }
    }

    /// Opens an existing file; `Err(None)` when there is none.
    fn open(path: &Path) -> std::result::Result<Region, Option<SimError>> {
        let cpath = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| Some(SimError::State(format!("{}: path has a NUL byte", path.display()))))?;
        // SAFETY: cpath is a valid NUL-terminated string.
        let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOENT) {
                return Err(None);
            }
            return Err(Some(SimError::State(format!("open {}: {err}", path.display()))));
        }
        // SAFETY: stat is plain data; fstat writes it for a valid fd.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open and st is writable.
        if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_size as usize != LAYOUT_SIZE {
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Err(Some(SimError::State(format!(
                "{} is not a state file of this version (size {} bytes, expected {LAYOUT_SIZE}); remove it",
                path.display(),
                st.st_size
            ))));
        }
        let shared = map(fd).map_err(|e| {
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            Some(SimError::State(format!("mmap {}: {e}", path.display())))
        })?;
        let region = Region { shared, fd: AtomicI32::new(fd), path: cpath, slot: AtomicU32::new(0) };
        let h = &region.shared().header;
        if h.magic.load(Acquire) != MAGIC
            || h.version.load(Relaxed) != VERSION
            || h.layout_size.load(Relaxed) != LAYOUT_SIZE as u64
        {
            return Err(Some(SimError::State(format!(
                "{} is not a tessera-sim state file of layout version {VERSION}; remove it",
                path.display()
            ))));
        }
        Ok(region)
    }

    /// Builds the file under a temporary name and links it into place, so that no process ever
    /// maps a half-made file; of two racing creators, one wins and the other opens its file.
    fn create(path: &Path, desc: &NodeDescription) -> Result<()> {
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| SimError::State(format!("create {}: {e}", dir.display())))?;
        let text = desc.canonical_text();
        if text.len() > DESC_MAX {
            return Err(SimError::Description(format!("description is {} bytes; at most {DESC_MAX}", text.len())));
        }
        let tmp = dir.join(format!(
            ".{}.{}.{}.tmp",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("state"),
            std::process::id(),
            crate::clock::monotonic_ns()
        ));
        let ctmp =
            CString::new(tmp.as_os_str().as_bytes()).map_err(|_| SimError::State("path has a NUL byte".into()))?;
        // SAFETY: ctmp is a valid C string.
        let fd =
            unsafe { libc::open(ctmp.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o666) };
        if fd < 0 {
            return Err(errno_msg("create", &tmp));
        }
        let cleanup = |e: SimError| {
            // SAFETY: fd and ctmp are ours.
            unsafe {
                libc::close(fd);
                libc::unlink(ctmp.as_ptr());
            }
            e
        };
        // Device nodes of a real driver are world read-write; the sim's shared state is its device.
        // SAFETY: fd is open.
        unsafe { libc::fchmod(fd, 0o666) };
        // SAFETY: fd is open; the file is sparse until written.
        if unsafe { libc::ftruncate(fd, LAYOUT_SIZE as libc::off_t) } != 0 {
            return Err(cleanup(errno_msg("size", &tmp)));
        }
        let shared = map(fd).map_err(|e| cleanup(SimError::State(format!("mmap {}: {e}", tmp.display()))))?;
        // SAFETY: the mapping is LAYOUT_SIZE bytes of zeroes, a valid Shared, and nobody else sees it yet.
        let s = unsafe { &*shared };
        init_mutex(&s.header).map_err(cleanup)?;
        for (i, chunk) in text.as_bytes().chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            s.desc[i].store(u64::from_le_bytes(w), Relaxed);
        }
        s.header.desc_len.store(text.len() as u32, Relaxed);
        for (g, id) in desc.identities().iter().enumerate() {
            let mode = u32::from(id.initial_mig);
            s.gpus[g].mig_current.store(mode, Relaxed);
            s.gpus[g].mig_pending.store(mode, Relaxed);
        }
        for p in &s.procs {
            for st in &p.streams {
                st.place.store(FREE_STREAM, Relaxed);
            }
        }
        s.header.version.store(VERSION, Relaxed);
        s.header.layout_size.store(LAYOUT_SIZE as u64, Relaxed);
        s.header.magic.store(MAGIC, Release);
        // SAFETY: shared was mapped with LAYOUT_SIZE bytes above.
        unsafe { libc::munmap(shared as *mut libc::c_void, LAYOUT_SIZE) };
        // SAFETY: fd is open.
        if unsafe { libc::fsync(fd) } != 0 {
            return Err(cleanup(errno_msg("fsync", &tmp)));
        }
        let cpath = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| cleanup(SimError::State("path has a NUL byte".into())))?;
        // SAFETY: both are valid C strings. link() fails with EEXIST if another creator won.
        let linked = unsafe { libc::link(ctmp.as_ptr(), cpath.as_ptr()) };
        let link_err = std::io::Error::last_os_error();
        // SAFETY: fd and ctmp are ours.
        unsafe {
            libc::close(fd);
            libc::unlink(ctmp.as_ptr());
        }
        if linked != 0 && link_err.raw_os_error() != Some(libc::EEXIST) {
            return Err(SimError::State(format!("link {}: {link_err}", path.display())));
        }
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    pub fn shared(&self) -> &Shared {
        // SAFETY: the mapping lives as long as self and holds a valid Shared (checked at open).
        unsafe { &*self.shared }
    }

    pub fn gpu(&self, gpu: u32) -> Option<&GpuState> {
        self.shared().gpus.get(gpu as usize)
    }

    /// This process's own slot, once it has one.
    pub fn own_proc(&self) -> Option<&ProcSlot> {
        self.own_slot_if_any().map(|s| &self.shared().procs[s])
    }

    pub fn description_text(&self) -> Result<String> {
        let s = self.shared();
        let len = s.header.desc_len.load(Relaxed) as usize;
        if len > DESC_MAX {
            return Err(SimError::State("description length out of range".into()));
        }
        let mut bytes = Vec::with_capacity(len.next_multiple_of(8));
        for w in &s.desc[..len.div_ceil(8)] {
            bytes.extend_from_slice(&w.load(Relaxed).to_le_bytes());
        }
        bytes.truncate(len);
        String::from_utf8(bytes).map_err(|_| SimError::State("description is not UTF-8".into()))
    }

    /// Takes the node lock. A holder that died leaves the lock to us; we repair and go on.
    pub fn lock(&self) -> Guard<'_> {
        let m = self.shared().header.lock.get();
        // SAFETY: m points to a process-shared robust mutex initialized by the file's creator.
        let rc = unsafe { libc::pthread_mutex_lock(m) };
        let guard = Guard { region: self };
        if rc == libc::EOWNERDEAD {
            // SAFETY: we hold the mutex (EOWNERDEAD means we own it); mark it usable again.
            unsafe { libc::pthread_mutex_consistent(m) };
            guard.region.shared().header.dirty.store(1, Relaxed);
        } else if rc != 0 {
            // ENOTRECOVERABLE cannot happen: every owner-died path marks the mutex consistent.
            panic!("tessera-sim: node lock failed: {}", std::io::Error::from_raw_os_error(rc));
        }
        if guard.region.shared().header.dirty.load(Relaxed) != 0 {
            crate::memory::repair(&guard);
            guard.region.shared().header.dirty.store(0, Relaxed);
        }
        guard
    }

    /// Our process slot, claiming one on first use.
    pub fn own_slot(&self) -> Result<usize> {
        let s = self.slot.load(Acquire);
        if s != 0 {
            return Ok(s as usize - 1);
        }
        let g = self.lock();
        let s = self.slot.load(Acquire);
        if s != 0 {
            return Ok(s as usize - 1);
        }
        let slot = g.claim_slot()?;
        self.slot.store(slot as u32 + 1, Release);
        Ok(slot)
    }

    /// Our slot if we have claimed one.
    pub fn own_slot_if_any(&self) -> Option<usize> {
        match self.slot.load(Acquire) {
            0 => None,
            s => Some(s as usize - 1),
        }
    }

    pub fn after_fork_in_child(&self) {
        // The parent's slot and its lock belong to the parent; get our own file description.
        self.slot.store(0, Release);
        // SAFETY: path is a valid C string.
        let fd = unsafe { libc::open(self.path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd >= 0 {
            let old = self.fd.swap(fd, AcqRel);
            // SAFETY: old was our descriptor; closing the child's copy drops nothing of the parent's.
            unsafe { libc::close(old) };
        }
    }

    /// Whether a process holds slot `slot` (its liveness lock is held by someone).
    pub(crate) fn slot_alive(&self, slot: usize) -> bool {
        let mut fl = liveness_flock(slot, libc::F_WRLCK);
        // SAFETY: fd is open and fl is a valid flock.
        let rc = unsafe { libc::fcntl(self.fd.load(Relaxed), libc::F_OFD_GETLK, &mut fl) };
        rc == 0 && fl.l_type != libc::F_UNLCK as i16
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: we mapped LAYOUT_SIZE bytes at shared and own fd. Closing fd releases our
        // liveness lock, which is right: the process no longer uses the node through this Region.
        unsafe {
            libc::munmap(self.shared as *mut libc::c_void, LAYOUT_SIZE);
            libc::close(*self.fd.get_mut());
        }
    }
}

fn map(fd: i32) -> std::result::Result<*const Shared, std::io::Error> {
    // SAFETY: mapping a regular file of LAYOUT_SIZE bytes, shared and read-write.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), LAYOUT_SIZE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
    };
    if p == libc::MAP_FAILED { Err(std::io::Error::last_os_error()) } else { Ok(p as *const Shared) }
}

fn init_mutex(h: &Header) -> Result<()> {
    // SAFETY: attr is initialized by pthread_mutexattr_init before use and destroyed after;
    // the mutex memory is ours alone (the file is not yet visible).
    unsafe {
        let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
        libc::pthread_mutexattr_init(&mut attr);
        libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
        libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
        let rc = libc::pthread_mutex_init(h.lock.get(), &attr);
        libc::pthread_mutexattr_destroy(&mut attr);
        if rc != 0 {
            return Err(SimError::State(format!("mutex init: {}", std::io::Error::from_raw_os_error(rc))));
        }
    }
    Ok(())
}

fn liveness_flock(slot: usize, kind: i32) -> libc::flock {
    // SAFETY: flock is plain data; zero is a valid starting value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = LIVENESS_BASE + slot as i64;
    fl.l_len = 1;
    fl
}

/// Proof that the node lock is held; unlocks on drop.
pub struct Guard<'a> {
    pub region: &'a Region,
}

impl Guard<'_> {
    pub fn shared(&self) -> &Shared {
        self.region.shared()
    }

    pub fn own_slot(&self) -> Option<usize> {
        self.region.own_slot_if_any()
    }

    /// Slots in use, in order.
    pub fn used_slots(&self) -> impl Iterator<Item = usize> + '_ {
        // Walk set bits word by word: a launch pays for the processes present, not for 256 slots.
        self.shared().header.used_slots.iter().enumerate().flat_map(|(w, word)| {
            let mut bits = word.load(Relaxed);
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let i = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    w * 64 + i
                })
            })
        })
    }

    /// Releases the slots of processes that are gone (their liveness lock was dropped by the
    /// kernel). Returns how many were reclaimed.
    pub fn reap(&self) -> usize {
        if self.shared().header.hold_exits.load(Acquire) != 0 {
            return 0;
        }
        let own = self.own_slot();
        let dead: Vec<usize> = self.used_slots().filter(|&s| Some(s) != own && !self.region.slot_alive(s)).collect();
        for &s in &dead {
            crate::memory::release_slot(self, s);
        }
        dead.len()
    }

    fn claim_slot(&self) -> Result<usize> {
        for attempt in 0..2 {
            let words = &self.shared().header.used_slots;
            for i in 0..MAX_PROCS {
                if words[i / 64].load(Relaxed) & (1 << (i % 64)) != 0 {
                    continue;
                }
                let mut fl = liveness_flock(i, libc::F_WRLCK);
                // SAFETY: fd is open and fl is valid; non-blocking set.
                let rc = unsafe { libc::fcntl(self.region.fd.load(Relaxed), libc::F_OFD_SETLK, &mut fl) };
                if rc != 0 {
                    continue; // someone still holds it: a slot mid-release, leave it
                }
                let p = &self.shared().procs[i];
                crate::memory::clear_slot(p);
                p.pid.store(std::process::id(), Relaxed);
                p.pid_ns.store(pid_namespace(), Relaxed);
                let comm = process_comm();
                p.comm[0].store(u64::from_le_bytes(comm[..8].try_into().unwrap()), Relaxed);
                p.comm[1].store(u64::from_le_bytes(comm[8..].try_into().unwrap()), Relaxed);
                words[i / 64].fetch_or(1 << (i % 64), Release);
                return Ok(i);
            }
            if attempt == 0 && self.reap() == 0 {
                break;
            }
        }
        Err(SimError::TooMany("processes on the simulated node"))
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        // SAFETY: this guard holds the mutex (taken in Region::lock).
        unsafe { libc::pthread_mutex_unlock(self.region.shared().header.lock.get()) };
    }
}

pub(crate) fn pid_namespace() -> u64 {
    std::fs::metadata("/proc/self/ns/pid").map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap_or(0)
}

fn process_comm() -> [u8; 16] {
    let mut out = [0u8; 16];
    if let Ok(s) = std::fs::read("/proc/self/comm") {
        let s = s.strip_suffix(b"\n").unwrap_or(&s);
        let n = s.len().min(15);
        out[..n].copy_from_slice(&s[..n]);
    }
    out
}

/// A slot's process name.
pub fn slot_comm(p: &ProcSlot) -> String {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&p.comm[0].load(Relaxed).to_le_bytes());
    b[8..].copy_from_slice(&p.comm[1].load(Relaxed).to_le_bytes());
    let n = b.iter().position(|&c| c == 0).unwrap_or(16);
    String::from_utf8_lossy(&b[..n]).into_owned()
}
