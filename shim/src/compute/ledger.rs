//! The node ledger: one small file shared by the limiters of every container on the node
//! (TESSERA_LEDGER, mounted into each), so that a container can see what the others on its GPU
//! are doing without asking anyone: who has high priority and launched lately, and how much of
//! the GPU each used in its last window. Advisory data only: atomics, no lock, and an entry that
//! stops being refreshed simply ages out.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

use tessera_region::Priority;

const MAGIC: u64 = u64::from_le_bytes(*b"TSLEDGR1");
pub const DEVICES: usize = 64;
pub const ENTRIES: usize = 32;
/// An entry not refreshed for this long belongs to nobody.
const STALE_NS: u64 = 30_000_000_000;
pub const ENV_LEDGER: &str = "TESSERA_LEDGER";

#[repr(C)]
pub struct Entry {
    /// The container's key (0: free).
    key: AtomicU64,
    priority: AtomicU32,
    share_ppm: AtomicU32,
    last_launch_ns: AtomicU64,
    /// The container's GPU use over its last window, ppm of the GPU, and when it was measured.
    usage_ppm: AtomicU64,
    usage_ns: AtomicU64,
}

#[repr(C)]
struct Device {
    /// The device UUID, NUL-padded (0 in the first word: free).
    uuid: [AtomicU64; 6],
    entries: [Entry; ENTRIES],
}

#[repr(C)]
struct File {
    magic: AtomicU64,
    size: AtomicU64,
    devices: [Device; DEVICES],
}

const SIZE: usize = std::mem::size_of::<File>();

/// The mapped ledger.
pub struct Ledger {
    file: *const File,
}

// SAFETY: the mapping is shared memory made only of atomics, valid for the process's life.
unsafe impl Send for Ledger {}
// SAFETY: as above.
unsafe impl Sync for Ledger {}

/// Others on a device, as one container's limiter needs them.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Others {
    /// A high-priority container launched within `window` ns.
    pub high_active: bool,
    /// What the other containers used in their last windows, ppm of the GPU.
    pub usage_ppm: u64,
}

impl Ledger {
    /// Maps the ledger at `path`, creating it if missing (sized, then linked into place).
    pub fn open(path: &Path) -> std::io::Result<Ledger> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        // SAFETY: c is a valid C string.
        let mut fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            let tmp = CString::new(format!("{}.{}.tmp", path.display(), std::process::id()))
                .map_err(|_| std::io::ErrorKind::InvalidInput)?;
            // SAFETY: tmp is a valid C string; a new file only we know of.
            let t = unsafe {
                libc::open(tmp.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o666)
            };
            if t < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: t is our new file; zero-filled by ftruncate, which is the empty ledger but the header.
            unsafe {
                libc::fchmod(t, 0o666);
                libc::ftruncate(t, SIZE as libc::off_t);
                let mut hdr = [0u8; 16];
                hdr[..8].copy_from_slice(&MAGIC.to_le_bytes());
                hdr[8..].copy_from_slice(&(SIZE as u64).to_le_bytes());
                libc::pwrite(t, hdr.as_ptr().cast(), 16, 0);
                libc::fsync(t);
                // Whoever links first wins; the loser opens the winner's file.
                libc::link(tmp.as_ptr(), c.as_ptr());
                libc::unlink(tmp.as_ptr());
                libc::close(t);
                fd = libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            }
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        // SAFETY: a shared read-write mapping of the whole file; fd is closed after (the mapping stays).
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), SIZE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        // SAFETY: fd is ours.
        unsafe { libc::close(fd) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let l = Ledger { file: p as *const File };
        if l.f().magic.load(Acquire) != MAGIC || l.f().size.load(Relaxed) != SIZE as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} is not a ledger of this version", path.display()),
            ));
        }
        Ok(l)
    }

    fn f(&self) -> &File {
        // SAFETY: mapped for SIZE bytes for the life of self; checked magic and size.
        unsafe { &*self.file }
    }

    fn device(&self, uuid: &str) -> Option<&Device> {
        let want = pack(uuid);
        for d in &self.f().devices {
            if (0..6).all(|i| d.uuid[i].load(Acquire) == want[i]) {
                return Some(d);
            }
        }
        // Claim a free device record: its first word is the claim.
        for d in &self.f().devices {
            if d.uuid[0].compare_exchange(0, want[0], AcqRel, Acquire).is_ok() {
                for (cell, w) in d.uuid.iter().zip(want).skip(1) {
                    cell.store(w, Release);
                }
                return Some(d);
            }
            if (0..6).all(|i| d.uuid[i].load(Acquire) == want[i]) {
                return Some(d);
            }
        }
        None
    }

    /// This container's entry on a device, claimed on first use (or taken over when stale).
    pub fn entry(&self, uuid: &str, key: u64, now: u64) -> Option<&Entry> {
        let d = self.device(uuid)?;
        if let Some(e) = d.entries.iter().find(|e| e.key.load(Acquire) == key) {
            return Some(e);
        }
        for e in &d.entries {
            let k = e.key.load(Acquire);
            let stale =
                k != 0 && now.saturating_sub(e.last_launch_ns.load(Relaxed).max(e.usage_ns.load(Relaxed))) > STALE_NS;
            if (k == 0 || stale) && e.key.compare_exchange(k, key, AcqRel, Acquire).is_ok() {
                e.last_launch_ns.store(now, Relaxed);
                e.usage_ppm.store(0, Relaxed);
                e.usage_ns.store(now, Relaxed);
                return Some(e);
            }
        }
        None
    }

    /// What the other containers on the device are doing, seen from `key`.
    pub fn others(&self, uuid: &str, key: u64, now: u64, window: u64) -> Others {
        let Some(d) = self.device(uuid) else { return Others::default() };
        let mut o = Others::default();
        for e in &d.entries {
            let k = e.key.load(Acquire);
            if k == 0 || k == key {
                continue;
            }
            let last = e.last_launch_ns.load(Relaxed);
            if e.priority.load(Relaxed) == Priority::High as u32 && now.saturating_sub(last) < window {
                o.high_active = true;
            }
            if now.saturating_sub(e.usage_ns.load(Relaxed)) < 2 * window.max(200_000_000) {
                o.usage_ppm += e.usage_ppm.load(Relaxed);
            }
        }
        o
    }
}

impl Entry {
    pub fn launched(&self, now: u64, priority: Priority, share_ppm: u32) {
        self.last_launch_ns.store(now, Relaxed);
        self.priority.store(priority as u32, Relaxed);
        self.share_ppm.store(share_ppm, Relaxed);
    }

    pub fn set_usage(&self, ppm: u64, now: u64) {
        self.usage_ppm.store(ppm, Relaxed);
        self.usage_ns.store(now, Relaxed);
    }
}

fn pack(uuid: &str) -> [u64; 6] {
    let mut b = [0u8; 48];
    let n = uuid.len().min(47);
    b[..n].copy_from_slice(&uuid.as_bytes()[..n]);
    let mut w = [0u64; 6];
    for (i, c) in b.chunks(8).enumerate() {
        w[i] = u64::from_le_bytes(c.try_into().expect("8 bytes"));
    }
    w
}

/// A stable key for a container: FNV-1a of its identity (container id, else region path).
pub fn container_key(identity: &str) -> u64 {
    identity.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_see_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger");
        let a = Ledger::open(&path).unwrap();
        let b = Ledger::open(&path).unwrap();
        let now = 1_000_000_000_000;
        let (ka, kb) = (container_key("a"), container_key("b"));
        a.entry("GPU-x", ka, now).unwrap().launched(now, Priority::High, 0);
        b.entry("GPU-x", kb, now).unwrap().set_usage(300_000, now);
        let seen_by_b = b.others("GPU-x", kb, now + 1_000_000, 50_000_000);
        assert!(seen_by_b.high_active);
        let seen_by_a = a.others("GPU-x", ka, now, 50_000_000);
        assert_eq!(seen_by_a, Others { high_active: false, usage_ppm: 300_000 });
        // The high-priority container went quiet: no longer active after the window.
        assert!(!b.others("GPU-x", kb, now + 60_000_000, 50_000_000).high_active);
        // Another GPU is another table.
        assert_eq!(b.others("GPU-y", kb, now, 50_000_000), Others::default());
    }
}
