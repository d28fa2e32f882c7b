//! Changes in the device-plugin directory, from inotify: a kubelet that restarts (its socket
//! recreated, ours removed) or appears is seen at once rather than at the next poll. A counter
//! bumped on every batch of events; the plugin tasks re-check their files when it moves.
//! Without inotify (or the directory) the tasks fall back to polling.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::Path;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The inotify instance, as tokio's reactor takes it (by raw descriptor).
struct Events(Inotify);

impl AsRawFd for Events {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Starts watching `dir`; `None` (after a warning) when inotify cannot watch it.
pub(crate) fn watch_dir(dir: &Path) -> Option<(watch::Receiver<u64>, JoinHandle<()>)> {
    let started = (|| {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        let what = AddWatchFlags::IN_CREATE
            | AddWatchFlags::IN_DELETE
            | AddWatchFlags::IN_MOVED_FROM
            | AddWatchFlags::IN_MOVED_TO
            | AddWatchFlags::IN_ATTRIB
            | AddWatchFlags::IN_DELETE_SELF
            | AddWatchFlags::IN_MOVE_SELF;
        inotify.add_watch(dir, what)?;
        Ok::<_, nix::Error>(inotify)
    })();
    // SAFETY: `Events` owns the inotify descriptor, which stays open and the same until the
    // AsyncFd (and so the Events inside it) is dropped; as_raw_fd returns exactly it.
    let registered = |i: Inotify| unsafe { AsyncFd::register(Events(i)) }.map_err(std::io::Error::from);
    let inotify = match started.map_err(std::io::Error::from).and_then(registered) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the device-plugin directory; polling it");
            return None;
        }
    };
    let (tx, rx) = watch::channel(0u64);
    let task = tokio::spawn(async move {
        loop {
            let Ok(mut ready) = inotify.readable().await else { return };
            match ready.try_io(|fd| fd.get_ref().0.read_events().map_err(std::io::Error::from)) {
                Ok(Ok(_events)) => {
                    if tx.is_closed() {
                        return; // nobody watches any more
                    }
                    tx.send_modify(|n| *n = n.wrapping_add(1));
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "reading the device-plugin directory's events failed; polling it");
                    return;
                }
                Err(_would_block) => {}
            }
        }
    });
    Some((rx, task))
}
