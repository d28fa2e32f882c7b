//! Short blocking work (a journal flush, a directory made) inside a request handler.
//!
//! `spawn_blocking` hands the work to a pool thread and the answer back to a worker: two wake-ups
//! of sleeping threads on every request, each tens of microseconds on a busy or virtualised host,
//! and the tail of the kubelet's Allocate. `block_in_place` runs the work on the handler's own
//! thread instead, after handing that worker's other tasks to another thread, so nothing waits
//! on a wake-up and the async workers still never stall.

use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `work` on the calling thread. On tesserad's multi-threaded runtime the worker's other
/// tasks move to another thread first (`block_in_place`); on a current-thread runtime (tests)
/// or outside any runtime it simply runs.
pub fn run<T>(work: impl FnOnce() -> T) -> T {
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

#[cfg(test)]
mod tests {
    use super::run;

    #[test]
    fn runs_outside_a_runtime() {
        assert_eq!(run(|| 7), 7);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn runs_on_a_current_thread_runtime() {
        assert_eq!(run(|| std::thread::current().id()), std::thread::current().id());
    }

    /// Inside a task (a handler), the work runs on that task's thread, and a task it spawned just
    /// before (queued on the same worker) still runs while the work blocks: the worker's queue
    /// moved to another thread.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inside_a_task_other_tasks_go_on() {
        let handler = tokio::spawn(async {
            let (tx, rx) = std::sync::mpsc::channel();
            let other = tokio::spawn(async move { tx.send(std::thread::current().id()).expect("send") });
            let here = std::thread::current().id();
            let (ran_on, other_ran_on) = run(|| {
                let other_ran_on = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("the other task ran");
                (std::thread::current().id(), other_ran_on)
            });
            other.await.expect("other task");
            (here, ran_on, other_ran_on)
        });
        let (here, ran_on, other_ran_on) = handler.await.expect("handler");
        assert_eq!(ran_on, here, "the work ran on the handler's thread");
        assert_ne!(other_ran_on, here, "the other task ran elsewhere while the work blocked");
    }
}
