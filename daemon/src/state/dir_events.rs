//! Which allocation directories had a file written or moved into them since the last look, from
//! inotify: a pass that follows files the hook or the runtime wrapper leave there (`owner`,
//! `deleted`) reads only the directories that changed, not every allocation's every second. Its
//! idle cost then does not grow with the number of allocations (1,000 unused node API
//! allocations were 1,000 failed opens a second in the lease pass, and as many again in the
//! pod-resources pass).
//!
//! Where inotify cannot watch a directory (no instance, the per-user watch limit reached), that
//! directory is reported changed at every look, as before; a lost event (queue overflow) reports
//! every watched directory once.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsFd;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

use super::AllocDirs;

/// The watches over some allocation directories, by id.
pub struct DirEvents {
    /// `None` where inotify is not available: every directory followed reads as changed.
    inotify: Option<Inotify>,
    ids: HashMap<WatchDescriptor, String>,
    watched: HashMap<String, WatchDescriptor>,
    /// Followed, but not watched (adding the watch failed): changed at every look.
    unwatched: HashSet<String>,
}

impl std::fmt::Debug for DirEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirEvents")
            .field("inotify", &self.inotify.is_some())
            .field("watched", &self.watched.len())
            .field("unwatched", &self.unwatched.len())
            .finish()
    }
}

impl Default for DirEvents {
    fn default() -> Self {
        DirEvents::new()
    }
}

fn flags() -> AddWatchFlags {
    AddWatchFlags::IN_MOVED_TO | AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_ONLYDIR
}

impl DirEvents {
    pub fn new() -> DirEvents {
        let inotify = match Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC) {
            Ok(i) => Some(i),
            Err(e) => {
                tracing::warn!(error = %e, "no inotify: allocation directories are read at every pass");
                None
            }
        };
        DirEvents { inotify, ids: HashMap::new(), watched: HashMap::new(), unwatched: HashSet::new() }
    }

    /// Follows exactly the directories of `ids`: watches those not followed yet, drops the
    /// others. Returns the ids newly followed: what their directories hold now is for the caller
    /// to read once (it may predate the watch).
    pub fn follow<'a>(&mut self, dirs: &AllocDirs, ids: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let wanted: HashSet<&str> = ids.into_iter().collect();
        let gone: Vec<String> = self.watched.keys().filter(|id| !wanted.contains(id.as_str())).cloned().collect();
        for id in gone {
            if let Some(wd) = self.watched.remove(&id) {
                self.ids.remove(&wd);
                if let Some(i) = &self.inotify {
                    // Fails only when the directory went (the kernel dropped the watch with it).
                    let _ = i.rm_watch(wd);
                }
            }
        }
        self.unwatched.retain(|id| wanted.contains(id.as_str()));
        let mut new = Vec::new();
        for id in wanted {
            if self.watched.contains_key(id) || self.unwatched.contains(id) {
                continue;
            }
            new.push(id.to_owned());
            match self.inotify.as_ref().map(|i| i.add_watch(&dirs.dir(id), flags())) {
                Some(Ok(wd)) => {
                    // A directory removed and made again may come back with the descriptor of
                    // another id's old watch: the newest owner wins.
                    if let Some(old) = self.ids.insert(wd, id.to_owned()) {
                        self.watched.remove(&old);
                    }
                    self.watched.insert(id.to_owned(), wd);
                }
                Some(Err(e)) => {
                    if self.unwatched.is_empty() {
                        tracing::debug!(allocation = id, error = %e, "cannot watch an allocation directory; read at every pass");
                    }
                    self.unwatched.insert(id.to_owned());
                }
                None => {
                    self.unwatched.insert(id.to_owned());
                }
            }
        }
        new
    }

    /// The followed ids whose directories changed since the last look (with those that cannot be
    /// watched). After lost events, every followed id.
    pub fn changed(&mut self) -> HashSet<String> {
        let mut out: HashSet<String> = self.unwatched.clone();
        let Some(inotify) = &self.inotify else { return out };
        loop {
            match inotify.read_events() {
                Ok(events) if events.is_empty() => break,
                Ok(events) => {
                    for e in events {
                        if e.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                            out.extend(self.watched.keys().cloned());
                        } else if let Some(id) = self.ids.get(&e.wd) {
                            out.insert(id.clone());
                        }
                    }
                }
                // EAGAIN: nothing more to read.
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "reading inotify events; every directory is read");
                    out.extend(self.watched.keys().cloned());
                    break;
                }
            }
        }
        // The descriptor stays ours; nothing else reads it.
        let _ = inotify.as_fd();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_directories_written_into_are_reported() {
        let tmp = crate::state::mount::TestDir::new();
        let dirs = AllocDirs::new(tmp.path());
        for id in ["a", "b", "c"] {
            std::fs::create_dir_all(dirs.dir(id)).unwrap();
        }
        let mut ev = DirEvents::new();
        let mut new = ev.follow(&dirs, ["a", "b"]);
        new.sort();
        assert_eq!(new, ["a", "b"], "newly followed: read once");
        assert!(ev.changed().is_empty(), "nothing written yet");
        // Written in place, and moved into place (as the hook writes its records).
        std::fs::write(dirs.dir("a").join("owner"), "x").unwrap();
        std::fs::write(dirs.dir("b").join(".tmp"), "x").unwrap();
        assert_eq!(ev.changed(), HashSet::from(["a".to_owned(), "b".to_owned()]));
        assert!(ev.changed().is_empty(), "each change once");
        std::fs::rename(dirs.dir("b").join(".tmp"), dirs.dir("b").join("owner")).unwrap();
        assert_eq!(ev.changed(), HashSet::from(["b".to_owned()]));
        // Followed no more: not reported; a new one is.
        assert_eq!(ev.follow(&dirs, ["b", "c"]), ["c"]);
        std::fs::write(dirs.dir("a").join("deleted"), "x").unwrap();
        std::fs::write(dirs.dir("c").join("owner"), "x").unwrap();
        assert_eq!(ev.changed(), HashSet::from(["c".to_owned()]));
        // A directory that cannot be watched (it is not there) reads as changed at every look.
        assert_eq!(ev.follow(&dirs, ["b", "c", "missing"]), ["missing"]);
        assert_eq!(ev.changed(), HashSet::from(["missing".to_owned()]));
        assert_eq!(ev.changed(), HashSet::from(["missing".to_owned()]));
    }
}
