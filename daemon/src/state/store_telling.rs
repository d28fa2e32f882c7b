//! [`Store::lock_telling_after`]: a lock on the store whose holdings notifications wait until it
//! is let go.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::Store;

impl Store {
    /// Locks `store` so that the changes made through the lock are told to
    /// [`Store::holdings_changes`] once it is let go rather than as each is made: a follower
    /// woken by the change then finds the store free instead of waiting on the lock, on another
    /// CPU, while the change's caller still holds it (the kubelet's `Allocate`, which makes its
    /// allocation directory after the record). Told once, however many changes were made; on a
    /// current-thread runtime, once the tasks ready when the lock is let go have run (see
    /// [`TellingAfter`]'s drop).
    pub fn lock_telling_after(store: &Mutex<Store>) -> TellingAfter<'_> {
        let mut guard = store.lock().unwrap_or_else(PoisonError::into_inner);
        guard.hold_back = true;
        TellingAfter { guard: Some(guard) }
    }
}

/// The store locked by [`Store::lock_telling_after`]: when let go, the lock is released first,
/// then a change made to what the records hold is told.
pub struct TellingAfter<'a> {
    guard: Option<MutexGuard<'a, Store>>,
}

impl std::ops::Deref for TellingAfter<'_> {
    type Target = Store;
    fn deref(&self) -> &Store {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for TellingAfter<'_> {
    fn deref_mut(&mut self) -> &mut Store {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl Drop for TellingAfter<'_> {
    fn drop(&mut self) {
        let Some(mut store) = self.guard.take() else { return };
        store.hold_back = false;
        let pending = std::mem::take(&mut store.held_pending);
        let held = Arc::clone(&store.held);
        drop(store);
        if !pending {
            return;
        }
        let tell = Tell(held);
        // On a current-thread runtime (the device plugins' thread, whose handler made the change):
        // told by a task of its own that first lets the tasks ready now run (the handler's answer
        // written out), so that waking the follower (a write to another thread's runtime, an
        // interrupt to another CPU on a VM) comes after the answer, not before it. A task that
        // never runs (the runtime shut down) tells when it is dropped.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) if rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread => {
                rt.spawn(async move {
                    tokio::task::yield_now().await;
                    drop(tell);
                });
            }
            _ => drop(tell),
        }
    }
}

/// Tells [`Store::holdings_changes`] of a change when dropped.
struct Tell(Arc<tokio::sync::watch::Sender<u64>>);

impl Drop for Tell {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n += 1);
    }
}
