//! A guard against SIGBUS from a region whose file shrank under its mapping.
//!
//! A region is a shared file: any process that may write it (every process of its container)
//! may also `ftruncate` it. Pages past the new end then raise SIGBUS in every process that maps
//! the region: in the daemon, which maps every container's region, and in the container's
//! other processes. The guard keeps that from killing anyone: each mapping a [`crate::Region`]
//! makes is registered here, and a SIGBUS whose address falls inside one replaces that whole
//! mapping with private zero pages and lets the faulting access run again. The region then reads
//! as zeros (its magic word gone), [`crate::Region::is_damaged`] says so, and the owner reports
//! it. A SIGBUS anywhere else goes to the handler that was there before, or kills the process as
//! it would have without the guard.
//!
//! There is no cap on how many mappings are guarded: the registry is a list of fixed-size
//! segments of atomics, linked by atomic pointers. A segment is allocated by `register` (never by
//! the handler), published with one compare-and-swap on the last segment's `next`, and never
//! freed, so a pointer the handler loads stays valid for the life of the process; freed slots are
//! reused. (A fixed table of 8192 slots left the daemon's mappings past that unguarded: with
//! about 8,000 allocations, a container truncating its region killed tesserad with SIGBUS.)
//!
//! The handler is async-signal-safe: atomic loads along the segment list and one `mmap`.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize};

/// Slots per segment of the registry.
const SEGMENT: usize = 1024;
/// A slot being filled: skipped by the handler.
const FILLING: usize = usize::MAX;

/// One segment of the registry: `SEGMENT` slots (start 0: free) and the link to the next.
struct Segment {
    starts: [AtomicUsize; SEGMENT],
    lens: [AtomicUsize; SEGMENT],
    tripped: [AtomicBool; SEGMENT],
    /// Slots taken; a full segment is skipped by `register` without a scan.
    used: AtomicUsize,
    /// The next segment, or null; set once, never cleared.
    next: AtomicPtr<Segment>,
}

impl Segment {
    const fn new() -> Segment {
        Segment {
            starts: [const { AtomicUsize::new(0) }; SEGMENT],
            lens: [const { AtomicUsize::new(0) }; SEGMENT],
            tripped: [const { AtomicBool::new(false) }; SEGMENT],
            used: AtomicUsize::new(0),
            next: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// The segment after this one, if any.
    fn next(&self) -> Option<&'static Segment> {
        let p = self.next.load(Acquire);
        // SAFETY: a non-null `next` points to a segment leaked by `register` (Box::into_raw,
        // never freed) and fully built before it was published with Release.
        (!p.is_null()).then(|| unsafe { &*p })
    }
}

/// The first segment; the others hang off it.
static FIRST: Segment = Segment::new();
/// The SIGBUS action in place before ours; set once, before ours is installed.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Installs the SIGBUS handler once per process (later calls do nothing). An error leaves the
/// process as it was: regions then work unguarded.
pub fn install() -> std::io::Result<()> {
    static RESULT: OnceLock<Option<i32>> = OnceLock::new();
    let failed = RESULT.get_or_init(|| {
        // SAFETY: sigaction is plain data; all zeroes is a valid value to be filled in.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: reads the current action into `old`; a null new action changes nothing.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) } != 0 {
            return std::io::Error::last_os_error().raw_os_error();
        }
        let _ = PREVIOUS.set(old);
        // SAFETY: as above.
        let mut new: libc::sigaction = unsafe { std::mem::zeroed() };
        new.sa_sigaction = on_sigbus as *const () as usize;
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        // SAFETY: `new.sa_mask` is a valid sigset_t to empty.
        unsafe { libc::sigemptyset(&mut new.sa_mask) };
        // SAFETY: installs a handler that is async-signal-safe (see `on_sigbus`).
        if unsafe { libc::sigaction(libc::SIGBUS, &new, std::ptr::null_mut()) } != 0 {
            return std::io::Error::last_os_error().raw_os_error();
        }
        None
    });
    match failed {
        None => Ok(()),
        Some(code) => Err(std::io::Error::from_raw_os_error(*code)),
    }
}

/// A registered mapping: its slot in the registry.
#[derive(Debug)]
pub(crate) struct Guarded {
    segment: &'static Segment,
    slot: usize,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Segment")
    }
}

impl Guarded {
    /// Registers `len` bytes mapped at `start`. Never fails: a new segment is added when every
    /// slot is taken.
    pub(crate) fn register(start: usize, len: usize) -> Guarded {
        let mut segment: &'static Segment = &FIRST;
        loop {
            if segment.used.load(Relaxed) < SEGMENT {
                for slot in 0..SEGMENT {
                    if segment.starts[slot].compare_exchange(0, FILLING, AcqRel, Relaxed).is_ok() {
                        segment.used.fetch_add(1, Relaxed);
                        segment.lens[slot].store(len, Relaxed);
                        segment.tripped[slot].store(false, Relaxed);
                        segment.starts[slot].store(start, Release);
                        return Guarded { segment, slot };
                    }
                }
            }
            segment = match segment.next() {
                Some(next) => next,
                None => {
                    let new = Box::into_raw(Box::new(Segment::new()));
                    match segment.next.compare_exchange(std::ptr::null_mut(), new, AcqRel, Acquire) {
                        // SAFETY: `new` was just leaked from a Box and is now published; it is
                        // never freed.
                        Ok(_) => unsafe { &*new },
                        Err(other) => {
                            // SAFETY: `new` lost the race and was never published: still ours.
                            drop(unsafe { Box::from_raw(new) });
                            // SAFETY: as in `Segment::next`.
                            unsafe { &*other }
                        }
                    }
                }
            };
        }
    }

    /// Whether a SIGBUS replaced this mapping with zero pages.
    pub(crate) fn tripped(&self) -> bool {
        self.segment.tripped[self.slot].load(Acquire)
    }
}

impl Drop for Guarded {
    /// Unregisters; the owner unmaps after this.
    fn drop(&mut self) {
        self.segment.starts[self.slot].store(0, Release);
        self.segment.used.fetch_sub(1, Relaxed);
    }
}

/// The segment and slot whose mapping holds `addr`, with the mapping's start and length.
fn slot_of(addr: usize) -> Option<(&'static Segment, usize, usize, usize)> {
    let mut segment = Some(&FIRST);
    while let Some(s) = segment {
        for slot in 0..SEGMENT {
            let start = s.starts[slot].load(Acquire);
            if start == 0 || start == FILLING || addr < start {
                continue;
            }
            let len = s.lens[slot].load(Relaxed);
            if addr - start < len {
                return Some((s, slot, start, len));
            }
        }
        segment = s.next();
    }
    None
}

extern "C" fn on_sigbus(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler; si_addr is the
    // faulting address for SIGBUS.
    let addr = if info.is_null() { 0 } else { (unsafe { (*info).si_addr() }) as usize };
    if let Some((segment, slot, start, len)) = slot_of(addr) {
        // SAFETY: [start, start + len) is a region mapping this process made and has not unmapped
        // (it is unregistered before munmap); replacing it with fresh private zero pages of the
        // same size keeps every reference into it valid. mmap is a plain system call.
        let p = unsafe {
            libc::mmap(
                start as *mut c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            segment.tripped[slot].store(true, Release);
            return; // the faulting access runs again, on zero pages
        }
    }
    chain(sig, info, ctx);
}

/// Passes a SIGBUS that is not ours to the action there was before the guard.
fn chain(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    let prev = PREVIOUS.get();
    let handler = prev.map_or(libc::SIG_DFL, |p| p.sa_sigaction);
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // Back to the default action; returning re-runs the access, which then kills the
        // process with SIGBUS exactly as it would have without the guard.
        // SAFETY: sigaction is plain data; all zeroes with SIG_DFL is the default action.
        let mut dfl: libc::sigaction = unsafe { std::mem::zeroed() };
        dfl.sa_sigaction = libc::SIG_DFL;
        // SAFETY: sigaction is async-signal-safe.
        unsafe { libc::sigaction(sig, &dfl, std::ptr::null_mut()) };
        return;
    }
    let siginfo = prev.is_some_and(|p| p.sa_flags & libc::SA_SIGINFO != 0);
    // SAFETY: `handler` is the function the program installed for SIGBUS, of the kind its
    // SA_SIGINFO flag says; we call it as the kernel would have.
    unsafe {
        if siginfo {
            let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = std::mem::transmute(handler);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(c_int) = std::mem::transmute(handler);
            f(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::Region;

    fn tmpfs_dir() -> tempfile::TempDir {
        let shm = std::path::Path::new("/dev/shm");
        if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }.unwrap()
    }

    /// A container process truncates its region: the mappers read zeros and say so, nobody dies.
    #[test]
    fn a_region_shrunk_under_its_mapping_reads_as_damaged_zeros() {
        let dir = tmpfs_dir();
        let path = dir.path().join("region");
        let r = Region::open_or_create(&path).unwrap();
        let other = Region::open_or_create(&path).unwrap();
        r.bump_config_generation();
        assert_eq!(other.config_generation(), 1);
        assert!(!r.is_damaged());
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(0).unwrap();
        // Without the guard, this read is a SIGBUS that kills the test process.
        assert_eq!(r.config_generation(), 0);
        r.bump_config_generation();
        assert!(r.is_damaged());
        // The other mapping faults on its own first read (here, the header's), and recovers too.
        assert!(other.is_damaged());
        assert_eq!(other.snapshot().config_generation, 0);
        // A region of the wrong size is refused at open, naming the sizes.
        let err = Region::open_or_create(&path).err().unwrap().to_string();
        assert!(err.contains("bytes"), "{err}");
    }

    /// The daemon maps every container's region: 20,000 mappings are all guarded, the last one
    /// as much as the first (a fixed table of 8192 left those past it unguarded, and a truncated
    /// region killed the daemon with SIGBUS). In a child process: a failure there is a death.
    #[test]
    fn twenty_thousand_mappings_are_all_guarded() {
        const MAPPINGS: usize = 20_000;
        if std::env::var_os("TESSERA_GUARD_MANY_CHILD").is_some() {
            use std::os::fd::AsRawFd;
            crate::guard::install().unwrap();
            let dir = tmpfs_dir();
            let path = dir.path().join("small-region");
            let f = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path).unwrap();
            f.set_len(4096).unwrap();
            let mut maps = Vec::with_capacity(MAPPINGS);
            for _ in 0..MAPPINGS {
                // SAFETY: a fresh shared mapping of the test's own 4096-byte file (each its own
                // mapping of offset 0: the kernel cannot merge them).
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        4096,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        f.as_raw_fd(),
                        0,
                    )
                };
                assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
                maps.push((p as usize, super::Guarded::register(p as usize, 4096)));
            }
            // SAFETY: inside the last mapping, which is ours and mapped.
            unsafe { std::ptr::write_volatile((maps[MAPPINGS - 1].0) as *mut u8, 7) };
            // The tenant's move: the file shrinks under every mapping.
            f.set_len(0).unwrap();
            for i in [MAPPINGS - 1, 8192, 0, MAPPINGS / 2] {
                let (p, guard) = &maps[i];
                // SAFETY: inside a live mapping; past the file's end now, so this faults.
                let v = unsafe { std::ptr::read_volatile(*p as *const u8) };
                assert_eq!(v, 0, "mapping {i} reads as zeros");
                assert!(guard.tripped(), "mapping {i} is said to be damaged");
            }
            println!("survived {MAPPINGS}");
            std::process::exit(0);
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "guard::tests::twenty_thousand_mappings_are_all_guarded",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TESSERA_GUARD_MANY_CHILD", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("survived 20000"),
            "{:?}: {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A SIGBUS outside every region still kills the process, as without the guard.
    #[test]
    fn other_sigbus_still_kills() {
        if std::env::var_os("TESSERA_GUARD_CHILD").is_some() {
            crate::guard::install().unwrap();
            let dir = tmpfs_dir();
            let _r = Region::open_or_create(&dir.path().join("region")).unwrap();
            let path = dir.path().join("plain");
            let f = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path).unwrap();
            f.set_len(4096).unwrap();
            use std::os::fd::AsRawFd;
            // SAFETY: a fresh shared mapping of the test's own 4096-byte file.
            let p =
                unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
            assert_ne!(p, libc::MAP_FAILED);
            f.set_len(0).unwrap();
            // SAFETY: inside the mapping; the page is past the file's end now, so this faults.
            let v = unsafe { std::ptr::read_volatile(p.cast::<u8>()) };
            println!("survived with {v}");
            std::process::exit(0);
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "guard::tests::other_sigbus_still_kills", "--nocapture", "--test-threads=1"])
            .env("TESSERA_GUARD_CHILD", "1")
            .output()
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGBUS),
            "{:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
    }

    /// A region made on a full file system is a clear error, not a SIGBUS.
    #[test]
    fn a_region_on_a_full_file_system_is_an_error() {
        let Some(fs) = crate::testing::TestTmpfs::mount(256 << 10) else { return };
        fs.fill();
        let err = Region::open_or_create(&fs.join("region")).err().expect("no room for a region");
        let text = err.to_string();
        assert!(text.contains("allocate the accounting blocks") && text.contains("No space left"), "{text}");
        let names: Vec<_> = std::fs::read_dir(fs.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["filler"], "no half-made region or temporary file left");
    }
}
