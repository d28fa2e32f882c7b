//! The calling thread's current context's CUDA ordinal, as the shim last learned it: a launch on
//! a default stream in a process that sees several devices must know that device, and asking the
//! driver (`cuCtxGetCurrent`) on every launch cost more than the rest of the launch hook.
//!
//! A thread's current context changes only through calls the shim hooks: `cuCtxSetCurrent`,
//! `cuCtxPushCurrent`/`cuCtxPopCurrent` (below), `cuCtxCreate` (which makes the new context
//! current), and the calls that end a context (`cuCtxDestroy`, `cuCtxDetach`, a primary
//! context's release or reset). The first kind forgets this thread's view, the second every
//! thread's (an epoch), so the next launch asks the driver again. Between those, the view is the
//! driver's last answer. The shim's own push/pop pairs (learning a context's device) leave the
//! current context as it was.
//!
//! A change the shim did not see (a library calling the driver by a path no hook covers) would
//! leave the view stale, so it is checked against the driver every [`CHECK_EVERY`] uses. A
//! mismatch turns the view off for the process: every launch asks the driver from then on, as
//! before, and one line on stderr says so. The launch hooks use the view only while no device of
//! the process has an SM share or a priority (`ShimState::cached_device_of_stream`), so a stale
//! view can at worst count a launch on the wrong device; it never lets a launch skip the limiter.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};

use tessera_abi::cuda_exports;

use crate::ffi::*;
use crate::real::RealCuda;
use crate::state::enter;

/// Uses of a view between two checks against the driver.
const CHECK_EVERY: u32 = 64;

/// One thread's view: the ordinal + 1 (0: none), the epoch it was learned in, and how many more
/// uses it has before the next check.
#[derive(Clone, Copy)]
struct View {
    ordinal_plus_1: u32,
    epoch: u32,
    left: u32,
}

impl View {
    const NONE: View = View { ordinal_plus_1: 0, epoch: 0, left: 0 };
}

thread_local! {
    static VIEW: Cell<View> = const { Cell::new(View::NONE) };
}

/// Moves whenever a context ends (or the view is turned off): every thread's view is stale.
static EPOCH: AtomicU32 = AtomicU32::new(1);
/// A stale view was found: views are no longer kept.
static OFF: AtomicBool = AtomicBool::new(false);

/// The current context's ordinal: this thread's view while it holds, else `ask` (the driver and
/// the context cache; `None`: no context, or one not cached yet), which becomes the view.
#[inline(always)]
pub(crate) fn ordinal(ask: impl FnOnce() -> Option<usize>) -> Option<usize> {
    let epoch = EPOCH.load(Relaxed);
    VIEW.with(|cell| {
        let v = cell.get();
        if v.ordinal_plus_1 != 0 && v.epoch == epoch && v.left != 0 {
            cell.set(View { left: v.left - 1, ..v });
            return Some(v.ordinal_plus_1 as usize - 1);
        }
        learn(cell, v, epoch, ask())
    })
}

/// Asked the driver: checks a view that was due for it, then keeps the answer as the view.
#[cold]
#[inline(never)]
fn learn(cell: &Cell<View>, was: View, epoch: u32, answer: Option<usize>) -> Option<usize> {
    let due = was.ordinal_plus_1 != 0 && was.epoch == epoch;
    if let Some(now) = answer
        && due
        && was.ordinal_plus_1 as usize - 1 != now
    {
        turn_off();
    }
    cell.set(match answer {
        Some(o) if !OFF.load(Relaxed) && o < u32::MAX as usize => {
            View { ordinal_plus_1: o as u32 + 1, epoch, left: CHECK_EVERY - 1 }
        }
        _ => View::NONE,
    });
    answer
}

/// Called on a launch's fast path, outside the hooks' panic guard: the warning is written with
/// `writeln!`, whose error is dropped (`eprintln!` panics when stderr cannot be written).
#[cold]
fn turn_off() {
    if !OFF.swap(true, Relaxed) {
        EPOCH.fetch_add(1, Relaxed);
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "tessera: this process changed its current CUDA context by a path libtessera.so does not see; \
             each launch now asks the driver for its device"
        );
    }
}

/// This thread's current context may have changed (set, pushed, popped, created).
#[inline]
pub(crate) fn forget_this_thread() {
    VIEW.with(|cell| cell.set(View::NONE));
}

/// A context ended: whichever thread had it current has a stale view.
#[inline]
pub(crate) fn forget_every_thread() {
    EPOCH.fetch_add(1, Relaxed);
}

/// Whether views are kept (false once one was found stale).
#[cfg(test)]
fn trusted() -> bool {
    !OFF.load(Relaxed)
}

/// A hooked call that changes the calling thread's current context: the driver's, then the view
/// forgotten (whatever it answered: a failed call may have changed nothing, and asking again
/// costs one driver call).
fn switched(call: impl FnOnce(&'static RealCuda) -> CUresult) -> CUresult {
    guard(CUDA_ERROR_UNKNOWN, || match enter() {
        Ok((_, cu)) => {
            let rc = call(cu);
            forget_this_thread();
            rc
        }
        Err(rc) => rc,
    })
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuCtxSetCurrent`.
    fn cuCtxSetCurrent(ctx) {
        // SAFETY: the caller's argument, passed on unchanged.
        switched(|cu| unsafe { (cu.cuCtxSetCurrent)(ctx) })
    }

    /// # Safety
    /// As cuda.h's `cuCtxPushCurrent_v2`.
    fn cuCtxPushCurrent_v2(ctx) {
        // SAFETY: the caller's argument, passed on unchanged.
        switched(|cu| unsafe { (cu.cuCtxPushCurrent_v2)(ctx) })
    }

    /// # Safety
    /// As cuda.h's `cuCtxPopCurrent_v2`.
    fn cuCtxPopCurrent_v2(pctx) {
        // SAFETY: the caller's argument, passed on unchanged.
        switched(|cu| unsafe { (cu.cuCtxPopCurrent_v2)(pctx) })
    }

    /// # Safety
    /// As cuda.h's legacy `cuCtxPushCurrent`.
    fn cuCtxPushCurrent(ctx) {
        switched(|cu| match cu.cuCtxPushCurrent {
            // SAFETY: the caller's argument, passed on unchanged.
            Some(real) => unsafe { real(ctx) },
            None => CUDA_ERROR_NOT_SUPPORTED,
        })
    }

    /// # Safety
    /// As cuda.h's legacy `cuCtxPopCurrent`.
    fn cuCtxPopCurrent(pctx) {
        switched(|cu| match cu.cuCtxPopCurrent {
            // SAFETY: the caller's argument, passed on unchanged.
            Some(real) => unsafe { real(pctx) },
            None => CUDA_ERROR_NOT_SUPPORTED,
        })
    }

    /// # Safety
    /// As cuda.h's deprecated `cuCtxDetach`: it destroys the context when its count reaches zero.
    fn cuCtxDetach(ctx) {
        let rc = switched(|cu| match cu.cuCtxDetach {
            // SAFETY: the caller's argument, passed on unchanged.
            Some(real) => unsafe { real(ctx) },
            None => CUDA_ERROR_NOT_SUPPORTED,
        });
        forget_every_thread();
        rc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The view's epoch and its switch-off are process-wide: each test runs alone in a child
    /// process of the test binary, so no other test's context ending moves its counts.
    fn isolated(name: &str, body: fn()) -> String {
        const CHILD: &str = "TESSERA_TEST_CURRENT_CHILD";
        if std::env::var(CHILD).is_ok_and(|n| n == name) {
            body();
            return String::new();
        }
        let exe = std::env::current_exe().expect("current_exe");
        let out = std::process::Command::new(exe)
            .args(["--exact", &format!("current::tests::{name}"), "--nocapture", "--test-threads", "1"])
            .env(CHILD, name)
            .output()
            .expect("run the child");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{name} failed in its child: {stderr}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child ran {name}");
        stderr
    }

    /// Uses of the view, each answered by the driver with the next of `answers` when asked.
    fn asks(answers: &[Option<usize>]) -> (Vec<Option<usize>>, usize) {
        let asked = Cell::new(0);
        let got = answers
            .iter()
            .map(|&a| {
                ordinal(|| {
                    asked.set(asked.get() + 1);
                    a
                })
            })
            .collect();
        (got, asked.get())
    }

    #[test]
    fn learned_once_then_checked_every_64_uses() {
        isolated("learned_once_then_checked_every_64_uses", || {
            let n = 3 * CHECK_EVERY as usize;
            let (got, asked) = asks(&vec![Some(1); n]);
            assert!(got.iter().all(|&g| g == Some(1)));
            assert_eq!(asked, 3, "asked on the first use and at each check");
            assert!(trusted());
        });
    }

    #[test]
    fn a_switch_on_this_thread_is_asked_again() {
        isolated("a_switch_on_this_thread_is_asked_again", || {
            assert_eq!(ordinal(|| Some(0)), Some(0));
            assert_eq!(ordinal(|| unreachable!("the view holds")), Some(0));
            forget_this_thread();
            assert_eq!(ordinal(|| Some(1)), Some(1));
            assert_eq!(ordinal(|| unreachable!("the new view holds")), Some(1));
            assert!(trusted(), "a switch the shim saw is no mismatch");
        });
    }

    #[test]
    fn a_context_ended_anywhere_is_asked_again_on_every_thread() {
        isolated("a_context_ended_anywhere_is_asked_again_on_every_thread", || {
            let (learned_tx, learned_rx) = std::sync::mpsc::channel();
            let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
            let other = std::thread::spawn(move || {
                assert_eq!(ordinal(|| Some(2)), Some(2));
                learned_tx.send(()).expect("send");
                go_rx.recv().expect("go");
                let asked = Cell::new(false);
                let got = ordinal(|| {
                    asked.set(true);
                    Some(3)
                });
                (got, asked.get())
            });
            learned_rx.recv().expect("learned");
            forget_every_thread();
            go_tx.send(()).expect("go");
            assert_eq!(other.join().expect("thread"), (Some(3), true));
            assert!(trusted());
        });
    }

    #[test]
    fn no_answer_keeps_no_view() {
        isolated("no_answer_keeps_no_view", || {
            let (got, asked) = asks(&[None, None, Some(4), Some(4)]);
            assert_eq!(got, [None, None, Some(4), Some(4)]);
            assert_eq!(asked, 3, "a missing answer is asked again; a real one is kept");
        });
    }

    /// A view found stale at its check turns views off for the process: the driver's answer
    /// wins, every use asks from then on, and stderr says so once.
    #[test]
    fn a_stale_view_turns_views_off() {
        let stderr = isolated("a_stale_view_turns_views_off", || {
            assert_eq!(ordinal(|| Some(0)), Some(0));
            for _ in 1..CHECK_EVERY {
                assert_eq!(ordinal(|| unreachable!("the view holds")), Some(0));
            }
            assert!(trusted());
            // The check: the driver now says ordinal 1 (a switch the shim did not see).
            assert_eq!(ordinal(|| Some(1)), Some(1));
            assert!(!trusted());
            let (got, asked) = asks(&[Some(1), Some(1), Some(0)]);
            assert_eq!(got, [Some(1), Some(1), Some(0)]);
            assert_eq!(asked, 3, "every use asks once views are off");
        });
        if !stderr.is_empty() {
            assert_eq!(stderr.matches("by a path libtessera.so does not see").count(), 1, "said once: {stderr}");
        }
    }
}
