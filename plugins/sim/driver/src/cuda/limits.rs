//! A context's limits (`cuCtxGetLimit`, `cuCtxSetLimit`) and the device memory they hold beyond
//! what the context's overhead covers (their defaults):
//! - the stack of every thread the device can hold at once (`CU_LIMIT_STACK_SIZE` times SMs
//!   times threads per SM: the driver reserves local memory for all of them), taken when set (an
//!   H200 took 1,937,768,448 bytes for 8 KiB: 7 KiB more for 270,336 threads);
//! - the printf FIFO past its default, taken when set;
//! - the malloc heap past its default, taken when a module is loaded into the context (NVIDIA's
//!   programming guide, "Heap Memory Allocation"; an H200 took nothing when it was set to 1 GiB),
//!   and from the context's first load on when set. The sim cannot tell which modules call
//!   `malloc`, so any module load takes it; one that does not fit fails the load with
//!   `CUDA_ERROR_SHARED_OBJECT_INIT_FAILED`, as the guide says.
//!
//! What does not fit is `CUDA_ERROR_OUT_OF_MEMORY`; lowered, it comes back; with its context,
//! all of it does (it is part of the context's charge).

use std::ffi::c_int;
use std::sync::atomic::Ordering::*;

use tessera_abi::cuda_exports;
use tessera_sim_model::Node;

use super::context::{Ctx, current};
use super::errors::poll_faults;
use super::init::{Device, driver};
use super::{CUresult, INVALID_VALUE, OUT_OF_MEMORY, R, need, put, run};

/// Limits a context keeps (`CUlimit` values 0..=9).
const LIMITS: usize = 10;

/// A context's limits, and whether a module has been loaded into it (its heap is then taken).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    values: [u64; LIMITS],
    loaded: bool,
}

impl Limits {
    /// A new context's (`CUlimit` order): stack 1 KiB, printf FIFO 1 MiB, malloc heap 8 MiB,
    /// sync depth 2, pending launches 2048, L2 fetch granularity 64, no persisting L2, no CIG.
    pub(crate) fn defaults() -> Limits {
        Limits { values: [1024, 1 << 20, 8 << 20, 2, 2048, 64, 0, 0, 0, 0], loaded: false }
    }

    /// The device memory these limits hold beyond the defaults.
    fn memory(&self, dev: &Device) -> u64 {
        let d = Limits::defaults().values;
        let resident = u64::from(dev.sm_count) * u64::from(dev.model.limits.max_threads_per_sm);
        let past = |i: usize| self.values[i].saturating_sub(d[i]);
        let heap = if self.loaded { past(2) } else { 0 };
        past(0).saturating_mul(resident).saturating_add(past(1)).saturating_add(heap)
    }
}

/// Changes a context's limits by `edit`, charging or refunding the memory that changes.
fn change(node: &Node, ctx: &Ctx, edit: impl FnOnce(Limits) -> Limits) -> R {
    // Held while the memory moves, so two threads changing limits at once charge each change once.
    let mut limits = ctx.limits.lock().unwrap_or_else(|e| e.into_inner());
    let next = edit(*limits);
    let (before, after) = (limits.memory(ctx.dev), next.memory(ctx.dev));
    let (d, epoch) = (ctx.dev, ctx.epoch.load(Acquire));
    if after > before {
        let e = super::memory::charge(node, d.gpu, d.domain, after - before)?;
        if e != epoch {
            // A reset since the context was made: the context is gone with it.
            super::memory::refund(node, d.gpu, d.domain, after - before, e);
            return Err(CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED);
        }
        ctx.charged.fetch_add(after - before, AcqRel);
    } else if before > after {
        super::memory::refund(node, d.gpu, d.domain, before - after, epoch);
        ctx.charged.fetch_sub(before - after, AcqRel);
    }
    *limits = next;
    Ok(())
}

/// A module is being loaded into `ctx`: its first load takes the malloc heap as set.
pub(crate) fn module_loading(node: &Node, ctx: &Ctx) -> R {
    if ctx.limits.lock().unwrap_or_else(|e| e.into_inner()).loaded {
        return Ok(());
    }
    match change(node, ctx, |now| Limits { loaded: true, ..now }) {
        Err(OUT_OF_MEMORY) => Err(CUresult::CUDA_ERROR_SHARED_OBJECT_INIT_FAILED),
        other => other,
    }
}

fn limit_index(limit: c_int, dev: &Device) -> R<usize> {
    match limit {
        // Synchronization depth of the device runtime is gone on Hopper (CDP2 has none).
        3 if dev.model.cc_major >= 9 => Err(CUresult::CUDA_ERROR_UNSUPPORTED_LIMIT),
        // Shared memory size and CIG: only for CIG contexts (not simulated).
        7 => Err(CUresult::CUDA_ERROR_UNSUPPORTED_LIMIT),
        0..=9 => Ok(limit as usize),
        _ => Err(INVALID_VALUE),
    }
}

cuda_exports! {
    fn cuCtxGetLimit(pvalue, limit) {
        run(|| {
            need(pvalue)?;
            driver()?;
            let ctx = current()?;
            let i = limit_index(limit, ctx.dev)?;
            let v = ctx.limits.lock().unwrap_or_else(|e| e.into_inner()).values[i];
            // SAFETY: pvalue is the caller's out-pointer (checked above).
            unsafe { put(pvalue, v as usize) }
        })
    }

    fn cuCtxSetLimit(limit, value) {
        run(|| {
            let node = driver()?.node;
            poll_faults(node)?;
            let ctx = current()?;
            ctx.check(node)?;
            let i = limit_index(limit, ctx.dev)?;
            let v = value as u64;
            let v = match i {
                5 if v > 128 => return Err(INVALID_VALUE),
                // Persisting L2 lines: clamped to the device's maximum, as the driver does.
                6 => v.min(super::device::max_persisting_l2(ctx.dev)),
                8 | 9 => return Err(CUresult::CUDA_ERROR_UNSUPPORTED_LIMIT),
                _ => v,
            };
            change(node, &ctx, |mut next| {
                next.values[i] = v;
                next
            })
        })
    }
}
