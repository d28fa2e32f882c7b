//! The journal's group flush, for the one change acknowledged before its frame is flushed: a
//! kubelet `Allocate`'s new record ([`super::Store::insert_flushed_soon`]).
//!
//! Why that change may wait: the kubelet writes its own durable record of the answer (its device
//! manager checkpoint, fsynced) right after the answer arrives, and tesserad rebuilds a record
//! that a power cut took from the journal's tail out of that checkpoint at its next start
//! (`crate::kubelet::checkpoint`). If the kubelet's copy did not survive either, the kubelet asks
//! again. A `kill -9` of tesserad loses nothing: the frame is in the page cache once written.
//! Every other change still flushes before it returns.
//!
//! One thread, started at the first request: 2 ms after it, it flushes whatever file it was last
//! handed, so the requests that come in meanwhile share that flush (a group commit). It then looks
//! again every 2 ms for a while (50 ms) before it sleeps until woken: a wake is a system call and,
//! on a VM, an interrupt to another CPU, on the request's path before its answer, and the
//! kubelet's Allocates come in bursts (a node's pods starting). A later change
//! that flushes on its own (any other change, a compaction) covers the frames before it too. A
//! failed flush is said and remembered: the store compacts (rewrites every record and flushes
//! it) before its next change.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// The flusher of one store's journal.
#[derive(Debug)]
pub struct JournalFlush {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Default for JournalFlush {
    fn default() -> JournalFlush {
        JournalFlush::lingering(LINGER)
    }
}

#[derive(Debug)]
struct Shared {
    pending: Mutex<Pending>,
    wake: Condvar,
    /// Told after each flush (tests wait on it).
    flushed: Condvar,
    /// A flush failed since the store last asked ([`JournalFlush::take_failure`]).
    failed: AtomicBool,
    /// How many looks, [`AFTER`] apart, the thread makes after a flush before it sleeps until
    /// woken ([`LINGER`]; tests set their own).
    linger: u32,
    /// Requests that had to wake the thread (tests read it).
    #[cfg(test)]
    wakes: std::sync::atomic::AtomicU64,
}

/// [`Shared::linger`] of tesserad: 50 ms.
const LINGER: u32 = 25;

#[derive(Debug, Default)]
struct Pending {
    /// The journal to flush next, with its path (for the error), if a frame waits.
    file: Option<(Arc<File>, PathBuf)>,
    stop: bool,
    /// The thread sleeps until woken (else it looks by itself soon: no wake needed).
    waiting: bool,
    /// Requests made, and the request the last finished flush covered.
    asked: u64,
    done: u64,
}

impl JournalFlush {
    fn lingering(linger: u32) -> JournalFlush {
        let shared = Shared {
            pending: Mutex::default(),
            wake: Condvar::new(),
            flushed: Condvar::new(),
            failed: AtomicBool::new(false),
            linger,
            #[cfg(test)]
            wakes: Default::default(),
        };
        JournalFlush { shared: Arc::new(shared), thread: None }
    }

    /// Asks for `file` (the journal at `path`) to be flushed soon; starts the thread at the first
    /// ask. If no thread can be started, flushes here and now (the caller then pays the flush,
    /// as every change did before).
    pub fn request(&mut self, file: &Arc<File>, path: &std::path::Path) -> std::io::Result<()> {
        if self.thread.is_none() {
            let shared = Arc::clone(&self.shared);
            match std::thread::Builder::new().name("tessera-journal-flush".into()).spawn(move || run(&shared)) {
                Ok(t) => self.thread = Some(t),
                Err(e) => {
                    tracing::warn!(error = %e, "no journal flush thread; the record is flushed before the answer");
                    return file.sync_data();
                }
            }
        }
        let mut p = self.shared.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        p.file = Some((Arc::clone(file), path.to_path_buf()));
        p.asked += 1;
        if p.waiting {
            #[cfg(test)]
            self.shared.wakes.fetch_add(1, Ordering::Relaxed);
            self.shared.wake.notify_one();
        }
        Ok(())
    }

    /// Whether a flush failed since the last call (the store then compacts before its next change).
    pub fn take_failure(&self) -> bool {
        self.shared.failed.swap(false, Ordering::AcqRel)
    }

    /// Waits until every request made so far is flushed; how many requests that is.
    #[cfg(test)]
    pub fn wait_idle(&self) -> u64 {
        let mut p = self.shared.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while p.done < p.asked {
            p = self.shared.flushed.wait(p).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        p.asked
    }
}

impl Drop for JournalFlush {
    /// The thread flushes what is still asked for, then ends: a store dropped (tesserad's orderly
    /// stop) leaves nothing unflushed.
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.shared.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).stop = true;
            self.shared.wake.notify_one();
            let _ = t.join();
        }
    }
}

/// How long the thread waits after a request before it flushes: the answer that made the request
/// leaves first (the flush's own CPU, in the file system and the block layer, would otherwise
/// land beside it on a small node), and what else is written meanwhile shares the flush.
const AFTER: std::time::Duration = std::time::Duration::from_millis(2);

fn run(shared: &Shared) {
    loop {
        {
            let mut p = shared.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut looks = 0;
            while p.file.is_none() && !p.stop && looks < shared.linger {
                drop(p);
                std::thread::sleep(AFTER);
                looks += 1;
                p = shared.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            while p.file.is_none() && !p.stop {
                p.waiting = true;
                p = shared.wake.wait(p).unwrap_or_else(std::sync::PoisonError::into_inner);
                p.waiting = false;
            }
            if p.file.is_none() {
                return;
            }
            if !p.stop {
                drop(p);
                std::thread::sleep(AFTER);
            }
        }
        let job = {
            let mut p = shared.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match p.file.take() {
                Some(job) => (job, p.asked),
                None => return,
            }
        };
        let ((file, path), covers) = job;
        if let Err(e) = file.sync_data() {
            shared.failed.store(true, Ordering::Release);
            tracing::error!(
                file = %path.display(),
                error = %e,
                "cannot flush the allocation journal: a kubelet allocation answered already may be lost at a \
                 power cut (rebuilt then from the kubelet's checkpoint); every record is written again before \
                 the next change"
            );
        }
        shared.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).done = covers;
        shared.flushed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_flushed_and_a_dropped_flusher_flushes_what_is_left() {
        let (file, path) = (Arc::new(tempfile::tempfile().unwrap()), PathBuf::from("journal"));
        let mut f = JournalFlush::default();
        f.request(&file, &path).unwrap();
        assert_eq!(f.wait_idle(), 1);
        assert!(!f.take_failure());
        f.request(&file, &path).unwrap();
        let shared = Arc::clone(&f.shared);
        drop(f);
        let p = shared.pending.lock().unwrap();
        assert!(p.file.is_none() && p.done == 2, "the drop flushed what was asked");
    }

    /// Waits until the thread sleeps until woken.
    fn until_waiting(f: &JournalFlush) {
        while !f.shared.pending.lock().unwrap().waiting {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    #[test]
    fn a_sleeping_thread_is_woken_and_a_lingering_one_is_not() {
        let (file, path) = (Arc::new(tempfile::tempfile().unwrap()), PathBuf::from("journal"));
        // No linger: each request after the thread went to sleep wakes it, and is flushed.
        let mut f = JournalFlush::lingering(0);
        f.request(&file, &path).unwrap();
        assert_eq!(f.wait_idle(), 1);
        for n in 1..=3 {
            until_waiting(&f);
            f.request(&file, &path).unwrap();
            assert_eq!(f.shared.wakes.load(Ordering::Relaxed), n);
            assert_eq!(f.wait_idle(), n + 1);
        }
        // A long linger: the requests after a flush find the thread looking by itself, wake
        // nothing, and are flushed all the same; a dropped flusher ends at once.
        let mut f = JournalFlush::lingering(u32::MAX);
        f.request(&file, &path).unwrap();
        assert_eq!(f.wait_idle(), 1);
        for n in 2..=4 {
            f.request(&file, &path).unwrap();
            assert_eq!(f.wait_idle(), n);
        }
        assert_eq!(f.shared.wakes.load(Ordering::Relaxed), 0);
        drop(f);
    }

    #[test]
    fn a_failed_flush_is_remembered_once() {
        // A pipe cannot be fdatasync'ed (EINVAL): the flush fails as a broken disk's would.
        let mut fds = [0; 2];
        // SAFETY: a valid array of two.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: pipe(2) just made both; each is owned once.
        let (r, w) = unsafe {
            use std::os::fd::FromRawFd;
            (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]))
        };
        let w = Arc::new(w);
        let mut f = JournalFlush::default();
        f.request(&w, std::path::Path::new("pipe")).unwrap();
        f.wait_idle();
        assert!(f.take_failure(), "the failure is told");
        assert!(!f.take_failure(), "and told once");
        drop(r);
    }
}
