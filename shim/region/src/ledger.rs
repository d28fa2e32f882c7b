//! The ledger: what the other containers on a GPU are doing, as tesserad tells each container.
//!
//! A low-priority container yields while a high-priority one on its GPU is busy, and a
//! work-conserving one borrows what the others leave idle; each needs to know about the others.
//! They cannot be told through a file they all write (any tenant could then claim high priority,
//! or fake another's activity), so the daemon is the only writer:
//!
//! - each container writes its own activity into its own region ([`ComputeBucket`]'s
//!   `high_launches`, `usage_ppm`, `usage_updates`), which no other container maps;
//! - tesserad reads them with each allocation's priority from its record (never from anything a
//!   container writes) and publishes, per allocation, a small view of the *others* on each of
//!   its devices into `ledger` in the allocation's directory: read-only inside the container, as
//!   the whole directory is.
//!
//! A view says no more than what sharing a GPU tells a tenant anyway: whether another
//! high-priority container launched lately, and how much of the GPU the others used. A
//! container that lies in its own region changes only its own standing: a low or normal one
//! cannot become high (the record says), a high one can only look busy, which it may be, and a
//! usage figure moves lending, never anyone's own share.
//!
//! No clock crosses a process: `high_seen` is a count the daemon bumps on every publication that
//! saw another high-priority container launch; the shim judges "lately" by when, on its own
//! clock, it last saw that count change. A daemon that stops publishing is, within one window, the
//! same as no high-priority neighbour.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

use crate::limits::Priority;
use crate::region::{MAX_DEVICES, Region};

/// The view's file name in an allocation's directory (`TESSERA_LEDGER` overrides the path).
pub const LEDGER_FILE: &str = "ledger";
pub const ENV_LEDGER: &str = "TESSERA_LEDGER";
/// `b"TSLEDGR2"` (version 1 was a file every container wrote).
pub const LEDGER_MAGIC: u64 = u64::from_le_bytes(*b"TSLEDGR2");
pub const LEDGER_VERSION: u32 = 1;
pub const LEDGER_SIZE: usize = std::mem::size_of::<LedgerFile>();
/// A usage figure counts this long after its container last wrote one (it writes every 100 ms
/// while it launches throttled work).
pub const USAGE_FRESH_NS: u64 = 300_000_000;

#[repr(C, align(64))]
struct LedgerHeader {
    magic: AtomicU64,
    version: AtomicU32,
    devices: AtomicU32,
    size: AtomicU64,
    /// Bumped after every publication (for tests and diagnosis).
    publications: AtomicU64,
    _reserved: [AtomicU64; 4],
}

/// The others on one device, from one allocation's point of view.
#[repr(C, align(64))]
pub struct DeviceView {
    /// The device's key, as the region's ([`Region::device_key`]); 0: unused.
    key: AtomicU64,
    /// Publications that saw another high-priority allocation on the device launch.
    high_seen: AtomicU64,
    /// What the others used of the device over their last windows, ppm (fresh figures only).
    others_usage_ppm: AtomicU64,
    /// How many other allocations on the device their records make high priority: 0 ends a wait
    /// at once (a neighbour moved to normal priority stops being waited for).
    high_neighbours: AtomicU64,
    _reserved: [AtomicU64; 4],
}

#[repr(C)]
struct LedgerFile {
    header: LedgerHeader,
    devices: [DeviceView; MAX_DEVICES],
}

const _: () = {
    assert!(std::mem::size_of::<LedgerHeader>() == 64);
    assert!(std::mem::size_of::<DeviceView>() == 64);
    assert!(LEDGER_SIZE == 64 + 64 * MAX_DEVICES);
};

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("{path}: {op}: {source}")]
    Io { path: String, op: &'static str, source: std::io::Error },
    #[error("{path} is not a ledger of this version ({reason}); tesserad makes it anew")]
    Invalid { path: String, reason: String },
}

/// A mapped view: read-only in the shim, read-write in the daemon.
pub struct Ledger {
    file: NonNull<LedgerFile>,
    writable: bool,
}

// SAFETY: the mapping holds only atomics and stays mapped for the Ledger's life (unmapped in Drop).
unsafe impl Send for Ledger {}
// SAFETY: as above: every access through &Ledger is an atomic operation.
unsafe impl Sync for Ledger {}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: mapped by `map` for LEDGER_SIZE bytes; nothing borrows it past self.
        unsafe { libc::munmap(self.file.as_ptr().cast(), LEDGER_SIZE) };
    }
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("writable", &self.writable).finish()
    }
}

fn io<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> LedgerError + 'a {
    move |source| LedgerError::Io { path: path.display().to_string(), op, source }
}

impl Ledger {
    /// The daemon's: makes a fresh, empty view at `path` (mode 0644: root writes, the
    /// container's processes, any uid, read), built under a temporary name and renamed into place,
    /// so no reader maps a half-made file. A file already there is replaced (its readers keep the
    /// old one, which no longer changes: to them the others look idle).
    pub fn create(path: &Path) -> Result<Ledger, LedgerError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(format!(".{LEDGER_FILE}.{}.tmp", std::process::id()));
        let made = (|| {
            let mut f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o644)
                .open(&tmp)
                .map_err(io(&tmp, "create"))?;
            // The mode asked for is filtered by the umask; set it outright.
            f.set_permissions(std::fs::Permissions::from_mode(0o644)).map_err(io(&tmp, "chmod"))?;
            f.set_len(LEDGER_SIZE as u64).map_err(io(&tmp, "set_len"))?;
            let mut header = [0u8; 24];
            header[..8].copy_from_slice(&LEDGER_MAGIC.to_le_bytes());
            header[8..12].copy_from_slice(&LEDGER_VERSION.to_le_bytes());
            header[12..16].copy_from_slice(&(MAX_DEVICES as u32).to_le_bytes());
            header[16..24].copy_from_slice(&(LEDGER_SIZE as u64).to_le_bytes());
            f.write_all(&header).map_err(io(&tmp, "write"))?;
            let l = Ledger::map(&f, &tmp, true)?;
            std::fs::rename(&tmp, path).map_err(io(path, "rename"))?;
            Ok(l)
        })();
        if made.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        made
    }

    /// The daemon's: the view at `path`, checked; damage or another version is an error (the
    /// caller makes it anew with [`Ledger::create`]: it holds nothing that is not published again).
    pub fn open_rw(path: &Path) -> Result<Ledger, LedgerError> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(io(path, "open"))?;
        Ledger::map(&f, path, true)
    }

    /// The shim's: the view at `path`, mapped read-only.
    pub fn open_ro(path: &Path) -> Result<Ledger, LedgerError> {
        let f = File::open(path).map_err(io(path, "open"))?;
        Ledger::map(&f, path, false)
    }

    fn map(f: &File, path: &Path, writable: bool) -> Result<Ledger, LedgerError> {
        let invalid = |reason: String| LedgerError::Invalid { path: path.display().to_string(), reason };
        let meta = f.metadata().map_err(io(path, "stat"))?;
        if !meta.is_file() || meta.len() != LEDGER_SIZE as u64 {
            return Err(invalid(format!("{} bytes, not {LEDGER_SIZE}", meta.len())));
        }
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: a shared mapping of exactly the file's size (checked above) from a valid fd; the
        // fd may close after, the mapping stays. Only the daemon writes the file and never shrinks
        // it (it replaces it by rename), so no reader can fault past its end.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), LEDGER_SIZE, prot, libc::MAP_SHARED, f.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(io(path, "mmap")(std::io::Error::last_os_error()));
        }
        let l = Ledger { file: NonNull::new(p.cast()).expect("mmap never returns null on success"), writable };
        let h = &l.f().header;
        if h.magic.load(Acquire) != LEDGER_MAGIC {
            return Err(invalid("bad magic".into()));
        }
        let (version, devices) = (h.version.load(Relaxed), h.devices.load(Relaxed));
        if version != LEDGER_VERSION || devices as usize != MAX_DEVICES || h.size.load(Relaxed) != LEDGER_SIZE as u64 {
            return Err(invalid(format!("version {version}, {devices} devices")));
        }
        Ok(l)
    }

    fn f(&self) -> &LedgerFile {
        // SAFETY: mapped for LEDGER_SIZE bytes for the life of self; only atomics inside.
        unsafe { self.file.as_ref() }
    }

    /// The view of the device whose region key is `key`, if published.
    pub fn view(&self, key: u64) -> Option<&DeviceView> {
        (key != 0).then(|| self.f().devices.iter().find(|d| d.key.load(Acquire) == key)).flatten()
    }

    pub fn publications(&self) -> u64 {
        self.f().header.publications.load(Acquire)
    }

    /// Writes the view of device `key`, taking a free entry on first use. Only through a
    /// writable (the daemon's) mapping; a read-only one ignores it.
    fn publish(&self, key: u64, high_neighbours: u64, high_active: bool, others_usage_ppm: u64) {
        if !self.writable || key == 0 {
            return;
        }
        let d = self.f().devices.iter().find(|d| d.key.load(Relaxed) == key).or_else(|| {
            let free = self.f().devices.iter().find(|d| d.key.load(Relaxed) == 0)?;
            free.key.store(key, Release);
            Some(free)
        });
        if let Some(d) = d {
            d.others_usage_ppm.store(others_usage_ppm, Relaxed);
            d.high_neighbours.store(high_neighbours, Relaxed);
            if high_active {
                d.high_seen.fetch_add(1, Release);
            }
        }
    }
}

impl DeviceView {
    pub fn high_seen(&self) -> u64 {
        self.high_seen.load(Acquire)
    }

    pub fn others_usage_ppm(&self) -> u64 {
        self.others_usage_ppm.load(Relaxed)
    }

    pub fn high_neighbours(&self) -> u64 {
        self.high_neighbours.load(Relaxed)
    }
}

/// One allocation as the publisher sees it: its region (what the container wrote), its view
/// (what the daemon writes) and, per device, the priority its record grants.
pub struct Member<'a> {
    pub id: &'a str,
    pub region: &'a Region,
    pub ledger: &'a Ledger,
    /// (device UUID as the container sees it, priority from the record).
    pub devices: &'a [(String, Priority)],
}

/// What the publisher remembers of one allocation's device between publications.
#[derive(Default)]
struct Seen {
    /// The device's UUID as the record names it, and its key, worked out once.
    uuid: String,
    key: u64,
    /// The region's entry for it, once the container has named it (entries are never freed; a
    /// container that scribbles on its own entry changes only its own figures, as before).
    dev: Option<usize>,
    /// Whether the figures below were read at least once: the first look is a baseline.
    known: bool,
    high_launches: u64,
    usage_updates: u64,
    /// When (the publisher's clock) the container last wrote a usage figure.
    usage_at: Option<u64>,
}

impl Seen {
    fn new(uuid: &str) -> Seen {
        Seen { uuid: uuid.to_string(), key: crate::region::uuid_key(uuid), ..Seen::default() }
    }
}

/// One allocation as the publisher remembers it: the publication it was last listed in, and its
/// devices in the record's order.
#[derive(Default)]
struct Tracked {
    listed: u64,
    devices: Vec<Seen>,
}

impl Tracked {
    /// Keeps what was seen of each device the record still grants, in the record's order.
    fn follow(&mut self, devices: &[(String, Priority)]) {
        let same = self.devices.len() == devices.len()
            && self.devices.iter().zip(devices).all(|(s, (uuid, _))| s.uuid == *uuid);
        if !same {
            let mut old = std::mem::take(&mut self.devices);
            self.devices = devices
                .iter()
                .map(|(uuid, _)| match old.iter().position(|s| s.uuid == *uuid) {
                    Some(i) => old.swap_remove(i),
                    None => Seen::new(uuid),
                })
                .collect();
        }
    }
}

/// One device's figures in one publication, summed over its members.
struct Total {
    key: u64,
    usage: u64,
    highs: u64,
    launched: u64,
}

/// One member's device in one publication: which member, which [`Total`], and its own part.
struct Part {
    member: usize,
    total: usize,
    high: bool,
    launched: bool,
    usage: u64,
}

/// Publishes every member's view of the others, each time it is called (tesserad: every 10 ms
/// while a GPU has an allocation that reads its view).
#[derive(Default)]
pub struct Publisher {
    /// Per member id, what was seen of it.
    seen: HashMap<String, Tracked>,
    publications: u64,
    /// Kept between publications so that one allocates nothing once the members are known.
    totals: Vec<Total>,
    parts: Vec<Part>,
}

impl Publisher {
    pub fn new() -> Publisher {
        Publisher::default()
    }

    /// One publication at `now_ns` (the caller's monotonic clock). Members not listed are
    /// forgotten.
    pub fn publish(&mut self, now_ns: u64, members: &[Member]) {
        self.publications += 1;
        let this = self.publications;
        self.totals.clear();
        self.parts.clear();
        let mut listed = 0;
        for (i, m) in members.iter().enumerate() {
            let tracked = match self.seen.get_mut(m.id) {
                Some(t) => t,
                None => self.seen.entry(m.id.to_string()).or_default(),
            };
            if tracked.listed != this {
                listed += 1;
            }
            tracked.listed = this;
            tracked.follow(m.devices);
            for (s, (uuid, priority)) in tracked.devices.iter_mut().zip(m.devices) {
                if s.dev.is_none() {
                    s.dev = m.region.find_device(uuid);
                }
                let (launches, usage, updates) = match s.dev {
                    Some(dev) => {
                        let b = m.region.bucket(dev);
                        (b.high_launches.load(Relaxed), b.usage_ppm.load(Relaxed), b.usage_updates.load(Relaxed))
                    }
                    None => (0, 0, 0),
                };
                // A device seen for the first time is a baseline: nothing it did is known yet.
                let launched = s.known && s.high_launches != launches;
                if s.known && s.usage_updates != updates {
                    s.usage_at = Some(now_ns);
                }
                (s.known, s.high_launches, s.usage_updates) = (true, launches, updates);
                let fresh = s.usage_at.is_some_and(|t| now_ns.saturating_sub(t) < USAGE_FRESH_NS);
                // One tenant's figure is at most the whole GPU, whatever it wrote.
                let usage = if fresh { usage.min(1_000_000) } else { 0 };
                let high = *priority == Priority::High;
                // The keys are the node's devices named by records: a short list.
                let total = match self.totals.iter().position(|t| t.key == s.key) {
                    Some(t) => t,
                    None => {
                        self.totals.push(Total { key: s.key, usage: 0, highs: 0, launched: 0 });
                        self.totals.len() - 1
                    }
                };
                let t = &mut self.totals[total];
                t.usage += usage;
                t.highs += u64::from(high);
                t.launched += u64::from(launched && high);
                self.parts.push(Part { member: i, total, high, launched: launched && high, usage });
            }
        }
        if listed < self.seen.len() {
            self.seen.retain(|_, t| t.listed == this);
        }
        // Totals once per device, each member's own part taken out: linear in the members.
        for p in &self.parts {
            let t = &self.totals[p.total];
            let high_neighbours = t.highs - u64::from(p.high);
            let high_active = t.launched - u64::from(p.launched) > 0;
            members[p.member].ledger.publish(t.key, high_neighbours, high_active, t.usage - p.usage);
        }
        for m in members {
            if m.ledger.writable {
                m.ledger.f().header.publications.fetch_add(1, Release);
            }
        }
    }
}

/// Where a container's view is: `TESSERA_LEDGER` (`ledger`), else `ledger` beside the limits
/// file `TESSERA_LIMITS` names (`limits`); None when neither is set (standalone).
pub fn ledger_path(ledger: Option<&OsStr>, limits: Option<&OsStr>) -> Option<PathBuf> {
    match (ledger, limits) {
        (Some(p), _) if !p.is_empty() => Some(PathBuf::from(p)),
        (_, Some(l)) if !l.is_empty() => Some(Path::new(l).parent().unwrap_or(Path::new(".")).join(LEDGER_FILE)),
        _ => None,
    }
}

/// What a process of a container concludes from its view of one device, kept per process: when,
/// on its own clock, it last saw `high_seen` change.
pub struct Watch {
    last_count: AtomicU64,
    /// Monotonic ns of the last change seen (0: none yet).
    changed_ns: AtomicU64,
}

impl Default for Watch {
    fn default() -> Self {
        Watch::new()
    }
}

impl Watch {
    pub const fn new() -> Watch {
        Watch { last_count: AtomicU64::new(u64::MAX), changed_ns: AtomicU64::new(0) }
    }

    /// Whether another high-priority container on the device launched within `window_ns` before
    /// `now_ns`, as far as this process has seen, and is high priority still. The first look is a
    /// baseline.
    pub fn high_active(&self, view: &DeviceView, now_ns: u64, window_ns: u64) -> bool {
        if view.high_neighbours() == 0 {
            return false;
        }
        let count = view.high_seen();
        let last = self.last_count.swap(count, Relaxed);
        if last != count && last != u64::MAX {
            self.changed_ns.store(now_ns, Relaxed);
        }
        let changed = self.changed_ns.load(Relaxed);
        changed != 0 && now_ns.saturating_sub(changed) < window_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;

    struct Alloc {
        id: String,
        region: Region,
        ledger: Ledger,
        devices: Vec<(String, Priority)>,
        _dir: tempfile::TempDir,
    }

    fn alloc(id: &str, uuid: &str, priority: Priority) -> Alloc {
        let dir = tempfile::tempdir().unwrap();
        let region = Region::open_or_create(&dir.path().join("region")).unwrap();
        region.device(uuid).unwrap();
        let ledger = Ledger::create(&dir.path().join(LEDGER_FILE)).unwrap();
        Alloc { id: id.into(), region, ledger, devices: vec![(uuid.into(), priority)], _dir: dir }
    }

    fn publish(p: &mut Publisher, now: u64, all: &[&Alloc]) {
        let members: Vec<Member> = all
            .iter()
            .map(|a| Member { id: &a.id, region: &a.region, ledger: &a.ledger, devices: &a.devices })
            .collect();
        p.publish(now, &members);
    }

    fn high_seen(a: &Alloc, uuid: &str) -> u64 {
        a.ledger.view(crate::region::uuid_key(uuid)).map_or(0, DeviceView::high_seen)
    }

    fn launch(a: &Alloc, uuid: &str) {
        let dev = a.region.find_device(uuid).unwrap();
        a.region.bucket(dev).high_launches.fetch_add(1, Relaxed);
    }

    #[test]
    fn a_high_priority_neighbour_launching_is_seen_by_the_others_only() {
        let (high, low) = (alloc("h", "GPU-a", Priority::High), alloc("l", "GPU-a", Priority::Low));
        let elsewhere = alloc("e", "GPU-b", Priority::Low);
        let mut p = Publisher::new();
        publish(&mut p, 1, &[&high, &low, &elsewhere]);
        assert_eq!(high_seen(&low, "GPU-a"), 0, "the first look is a baseline");
        launch(&high, "GPU-a");
        publish(&mut p, 2, &[&high, &low, &elsewhere]);
        assert_eq!(high_seen(&low, "GPU-a"), 1);
        assert_eq!(high_seen(&high, "GPU-a"), 0, "a container is not its own neighbour");
        assert_eq!(high_seen(&elsewhere, "GPU-b"), 0, "another GPU's containers are not told");
        // Quiet: no change, nothing seen.
        publish(&mut p, 3, &[&high, &low, &elsewhere]);
        assert_eq!(high_seen(&low, "GPU-a"), 1);
        assert_eq!(low.ledger.publications(), 3);
    }

    #[test]
    fn a_device_named_late_and_a_record_that_changes_are_followed() {
        // The high-priority container has not started yet: its region names no device.
        let dir = tempfile::tempdir().unwrap();
        let mut high = Alloc {
            id: "h".into(),
            region: Region::open_or_create(&dir.path().join("region")).unwrap(),
            ledger: Ledger::create(&dir.path().join(LEDGER_FILE)).unwrap(),
            devices: vec![("GPU-a".into(), Priority::High)],
            _dir: dir,
        };
        let low = alloc("l", "GPU-a", Priority::Low);
        let mut p = Publisher::new();
        publish(&mut p, 1, &[&high, &low]);
        // It starts and launches: named after the first look, counted from nothing.
        high.region.device("GPU-a").unwrap();
        launch(&high, "GPU-a");
        publish(&mut p, 2, &[&high, &low]);
        assert_eq!(high_seen(&low, "GPU-a"), 1);
        // Its record gains a second device, listed first: what was seen of GPU-a is kept (its
        // launch since the last look counts), GPU-b starts as a baseline.
        high.devices.insert(0, ("GPU-b".into(), Priority::High));
        high.region.device("GPU-b").unwrap();
        launch(&high, "GPU-a");
        publish(&mut p, 3, &[&high, &low]);
        assert_eq!(high_seen(&low, "GPU-a"), 2, "GPU-a's count was kept across the change");
        publish(&mut p, 4, &[&high, &low]);
        assert_eq!(high_seen(&low, "GPU-a"), 2, "quiet: nothing seen");
        let view = low.ledger.view(crate::region::uuid_key("GPU-a")).unwrap();
        assert_eq!(view.high_neighbours(), 1);
        // Leaving and coming back under the same id starts from a baseline again.
        publish(&mut p, 5, &[&low]);
        launch(&high, "GPU-a");
        publish(&mut p, 6, &[&high, &low]);
        assert_eq!(high_seen(&low, "GPU-a"), 2, "the first look after a return is a baseline");
    }

    #[test]
    fn a_low_priority_container_cannot_make_others_yield_by_writing_its_region() {
        // Hostile: it bumps the counter a high-priority container would, and claims the whole GPU.
        let (normal, hostile) = (alloc("n", "GPU-a", Priority::Low), alloc("x", "GPU-a", Priority::Low));
        let mut p = Publisher::new();
        publish(&mut p, 1, &[&normal, &hostile]);
        for t in 2..10 {
            launch(&hostile, "GPU-a");
            let b = hostile.region.bucket(0);
            b.usage_ppm.store(u64::MAX, Relaxed);
            b.usage_updates.fetch_add(1, Relaxed);
            publish(&mut p, t, &[&normal, &hostile]);
        }
        assert_eq!(high_seen(&normal, "GPU-a"), 0, "the record says low: its launches are not a high neighbour's");
        let view = normal.ledger.view(crate::region::uuid_key("GPU-a")).unwrap();
        assert_eq!(view.others_usage_ppm(), 1_000_000, "a usage figure is bounded by the whole GPU");
    }

    #[test]
    fn usage_counts_while_fresh_and_a_member_that_leaves_changes_nothing() {
        let (a, b, c) = (
            alloc("a", "GPU-a", Priority::Normal),
            alloc("b", "GPU-a", Priority::Normal),
            alloc("c", "GPU-a", Priority::High),
        );
        let mut p = Publisher::new();
        publish(&mut p, 0, &[&a, &b, &c]);
        let write = |x: &Alloc, ppm| {
            let bk = x.region.bucket(0);
            bk.usage_ppm.store(ppm, Relaxed);
            bk.usage_updates.fetch_add(1, Relaxed);
        };
        write(&b, 300_000);
        write(&c, 200_000);
        publish(&mut p, 10, &[&a, &b, &c]);
        let view = |x: &Alloc| x.ledger.view(crate::region::uuid_key("GPU-a")).unwrap().others_usage_ppm();
        assert_eq!((view(&a), view(&b), view(&c)), (500_000, 200_000, 300_000));
        // b stops writing: its figure goes stale; c keeps writing.
        write(&c, 200_000);
        publish(&mut p, 10 + USAGE_FRESH_NS / 2, &[&a, &b, &c]);
        write(&c, 200_000);
        publish(&mut p, 10 + USAGE_FRESH_NS, &[&a, &b, &c]);
        assert_eq!(view(&a), 200_000);
        // The high-priority one is released: the others' counters do not move for it.
        let before = high_seen(&a, "GPU-a");
        publish(&mut p, 20 + USAGE_FRESH_NS, &[&a, &b]);
        assert_eq!(high_seen(&a, "GPU-a"), before);
    }

    #[test]
    fn a_watch_sees_activity_for_one_window_on_its_own_clock() {
        let (mut high, low) = (alloc("h", "GPU-a", Priority::High), alloc("l", "GPU-a", Priority::Low));
        let mut p = Publisher::new();
        publish(&mut p, 1, &[&high, &low]);
        let w = Watch::new();
        let view = || low.ledger.view(crate::region::uuid_key("GPU-a")).unwrap();
        assert!(!w.high_active(view(), 1_000, 50));
        launch(&high, "GPU-a");
        publish(&mut p, 2, &[&high, &low]);
        assert!(w.high_active(view(), 2_000, 50));
        assert!(w.high_active(view(), 2_040, 50));
        assert!(!w.high_active(view(), 2_060, 50), "no change for a window: the neighbour is idle, or the daemon gone");
        // Busy again, then moved to normal priority by its record: the wait ends at the next
        // publication, not a window later.
        launch(&high, "GPU-a");
        publish(&mut p, 3, &[&high, &low]);
        assert!(w.high_active(view(), 3_000, 50));
        high.devices[0].1 = Priority::Normal;
        launch(&high, "GPU-a");
        publish(&mut p, 4, &[&high, &low]);
        assert_eq!(view().high_neighbours(), 0);
        assert!(!w.high_active(view(), 3_001, 50));
    }

    #[test]
    fn the_view_is_beside_the_limits_file_unless_named() {
        let os = |s: &'static str| Some(OsStr::new(s));
        assert_eq!(ledger_path(None, os("/run/tessera/alloc/limits")), Some("/run/tessera/alloc/ledger".into()));
        assert_eq!(ledger_path(os("/x/view"), os("/run/tessera/alloc/limits")), Some("/x/view".into()));
        assert_eq!(ledger_path(os(""), None), None);
        assert_eq!(ledger_path(None, None), None);
    }

    #[test]
    fn a_damaged_or_foreign_file_is_refused_and_made_anew() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEDGER_FILE);
        std::fs::write(&path, b"not a ledger").unwrap();
        assert!(matches!(Ledger::open_rw(&path), Err(LedgerError::Invalid { .. })));
        std::fs::write(&path, vec![0u8; LEDGER_SIZE]).unwrap();
        let e = Ledger::open_ro(&path).unwrap_err().to_string();
        assert!(e.contains("not a ledger of this version"), "{e}");
        Ledger::create(&path).unwrap();
        let ro = Ledger::open_ro(&path).unwrap();
        assert_eq!(ro.publications(), 0);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        // A read-only mapping cannot publish.
        ro.publish(7, 1, true, 1);
        assert!(ro.view(7).is_none());
    }
}
