//! Kernel launches: a launch queues the kernel's duration (from its name) on the stream's model
//! stream, where the model time-slices it with every other process's work on the same GPU or MIG
//! instance. The path takes the registry's read lock once and allocates nothing; a capturing
//! stream records the launch instead.

use std::ffi::{c_uint, c_void};

use tessera_abi::cuda_exports;
use tessera_sim_model::GpuModel;

use super::errors::{Cu, poll_faults};
use super::graph::Op;
use super::handles;
use super::init::driver;
use super::module::Func;
use super::stream::resolve;
use super::{CUresult, INVALID_HANDLE, INVALID_VALUE, R, get, raw_u32, run, sys};

/// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE`.
const LAUNCH_ATTRIBUTE_COOPERATIVE: u32 = 2;

struct Launch {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    smem: c_uint,
    cooperative: bool,
}

fn check_shape(m: &GpuModel, sm_count: u32, l: &Launch, f: &Func) -> R {
    let threads = l.block.iter().map(|&b| u64::from(b)).product::<u64>();
    let bad_block = l.block.iter().zip(m.limits.max_block_dim).any(|(&b, max)| b == 0 || b > max);
    let bad_grid = l.grid.iter().zip(m.limits.max_grid_dim).any(|(&g, max)| g == 0 || g > max);
    if bad_block || bad_grid || threads > u64::from(m.limits.max_threads_per_block) {
        return Err(INVALID_VALUE);
    }
    if l.smem as i64 > i64::from(f.max_dynamic_smem.load(std::sync::atomic::Ordering::Relaxed)) {
        return Err(INVALID_VALUE);
    }
    if l.cooperative {
        // Every block must be resident at once.
        let per_sm = u64::from(m.limits.max_blocks_per_sm).min(u64::from(m.limits.max_threads_per_sm) / threads.max(1));
        let blocks = l.grid.iter().map(|&g| u64::from(g)).product::<u64>();
        if blocks > per_sm * u64::from(sm_count) {
            return Err(CUresult::CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
        }
    }
    Ok(())
}

/// The launch path.
fn launch(
    f: sys::CUfunction,
    l: Launch,
    stream: sys::CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> R {
    if !params.is_null() && !extra.is_null() {
        return Err(INVALID_VALUE);
    }
    let node = driver()?.node;
    poll_faults(node)?;
    let reg = handles::read();
    let func = reg.funcs.get(&(f as usize)).ok_or(INVALID_HANDLE)?;
    let t = resolve(&reg, node, stream, pt)?;
    t.ctx.check(node)?;
    if func.ctx != 0 && func.ctx != t.ctx.handle {
        return Err(INVALID_HANDLE);
    }
    check_shape(t.ctx.dev.model, t.ctx.dev.sm_count, &l, func)?;
    if let Some(c) = t.capture() {
        let func = func.clone();
        drop(reg);
        return c.add(Op::Kernel { func });
    }
    let duration = match func.duration_from_arg {
        // SAFETY: the caller's parameter array (cuda.h's contract): its first entry points to the
        // kernel's first parameter, a u64 for a kernel named `_argns`.
        true => unsafe { first_u64(params) }.unwrap_or(func.duration_ns),
        false => func.duration_ns,
    };
    node.launch(t.sid, duration).work().map(|_| ())
}

/// The first kernel parameter as a `u64`, if there is one.
///
/// # Safety
/// `params` must be null or a kernel parameter array whose first entry, if not null, points to
/// at least 8 readable bytes.
unsafe fn first_u64(params: *mut *mut c_void) -> Option<u64> {
    if params.is_null() {
        return None;
    }
    // SAFETY: as this function's contract.
    let first = unsafe { *params };
    // SAFETY: as this function's contract; the parameter need not be aligned.
    (!first.is_null()).then(|| unsafe { first.cast::<u64>().read_unaligned() })
}

cuda_exports! {
    #[allow(clippy::too_many_arguments)]
    fn cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra) twin cuLaunchKernel_ptsz(per_thread) {
        let l = Launch {
            grid: [gridDimX, gridDimY, gridDimZ],
            block: [blockDimX, blockDimY, blockDimZ],
            smem: sharedMemBytes,
            cooperative: false,
        };
        run(|| launch(f, l, hStream, kernelParams, extra, per_thread))
    }

    #[allow(clippy::too_many_arguments)]
    fn cuLaunchCooperativeKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams) twin cuLaunchCooperativeKernel_ptsz(per_thread) {
        let l = Launch {
            grid: [gridDimX, gridDimY, gridDimZ],
            block: [blockDimX, blockDimY, blockDimZ],
            smem: sharedMemBytes,
            cooperative: true,
        };
        run(|| launch(f, l, hStream, kernelParams, std::ptr::null_mut(), per_thread))
    }
}

/// `cuLaunchKernelEx`: the configuration struct, with its attributes (only cooperative launch
/// changes what is checked).
///
/// # Safety
/// `config` must be null or point to a `CUlaunchConfig` whose `attrs` hold `numAttrs` entries.
unsafe fn launch_ex(
    config: *const sys::CUlaunchConfig,
    f: sys::CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> R {
    // SAFETY: as this function's contract (null/misaligned checked by get); the struct holds
    // integers and pointers only.
    let c = unsafe { get(config) }?;
    let mut cooperative = false;
    let visit = |id, value: *const u8| {
        if id == LAUNCH_ATTRIBUTE_COOPERATIVE {
            // SAFETY: the cooperative value is the int at the start of the value union.
            cooperative |= unsafe { value.cast::<i32>().read_unaligned() } != 0;
        }
    };
    // SAFETY: the caller's configuration (cuda.h's contract).
    unsafe { for_each_attribute(&c, visit) }?;
    let l = Launch {
        grid: [c.gridDimX, c.gridDimY, c.gridDimZ],
        block: [c.blockDimX, c.blockDimY, c.blockDimZ],
        smem: c.sharedMemBytes,
        cooperative,
    };
    launch(f, l, c.hStream, params, extra, pt)
}

/// Calls `f` with each attribute of a launch configuration: its id (the raw integer C stored)
/// and a pointer to its value union.
///
/// # Safety
/// `c.attrs` must hold `c.numAttrs` entries (or be null, refused when any are counted).
pub(super) unsafe fn for_each_attribute(c: &sys::CUlaunchConfig, mut f: impl FnMut(u32, *const u8)) -> R {
    if c.numAttrs == 0 {
        return Ok(());
    }
    if c.attrs.is_null() {
        return Err(INVALID_VALUE);
    }
    for i in 0..c.numAttrs as usize {
        // SAFETY: attrs holds numAttrs entries (this function's contract); the id is read as the
        // raw integer C stored, whatever the enum holds.
        unsafe {
            let a = c.attrs.add(i);
            f(raw_u32(std::ptr::addr_of!((*a).id)), std::ptr::addr_of!((*a).value).cast::<u8>());
        }
    }
    Ok(())
}

cuda_exports! {
    fn cuLaunchKernelEx(config, f, kernelParams, extra) twin cuLaunchKernelEx_ptsz(per_thread) {
        // SAFETY: the caller's configuration, per the API contract.
        run(|| unsafe { launch_ex(config, f, kernelParams, extra, per_thread) })
    }
}

fn host_func(stream: sys::CUstream, f: sys::CUhostFn, data: *mut c_void, pt: bool) -> R {
    let f = f.ok_or(INVALID_VALUE)?;
    let node = driver()?.node;
    let t = super::stream::resolve_and_check(stream, pt)?;
    super::graph::submit(node, &t, Op::Host { f, data: data as usize })
}

cuda_exports! {
    fn cuLaunchHostFunc(hStream, fn_, userData) twin cuLaunchHostFunc_ptsz(per_thread) {
        run(|| host_func(hStream, fn_, userData, per_thread))
    }
}
