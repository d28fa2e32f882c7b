//! Launch hooks: every way work reaches a GPU's SMs (kernels, extended and cooperative launches,
//! graphs, each with its per-thread-default-stream flavour) goes through the compute limiter:
//! `before_launch` (which may hold the thread to keep the container's SM share) and
//! `after_launch` with whether the driver accepted the launch.

use crate::ffi::*;
use tessera_abi::cuda_exports;
use tessera_region::TraceFunc;

use crate::memory::alloc::flavour;
use crate::real::RealCuda;
use crate::state::{enter, enter_launch};
use crate::trace::Launch;

/// Runs a launch of `function` (null: a graph) through the limiter. A stream whose device cannot
/// be told (a stale handle: the driver will refuse it) launches without it. While a trace is asked for, the call is an API
/// span and the kernel is measured (CUDA events) for a kernel span; otherwise tracing costs one
/// relaxed load.
///
/// A launch on a device with no SM share, in a normal-priority container, is the fast path: the
/// generation check, the stream's device (a cache hit, or none to look up for the default
/// stream of a one-device process), one increment of the slot's own launch counter.
///
/// `known`: the stream's device as the fast path found it (from this call's driver answers, the
/// generation unchanged), so that it is not asked again.
#[inline]
fn gated(
    func: TraceFunc,
    function: CUfunction,
    stream: CUstream,
    known: Option<usize>,
    call: impl FnOnce(&'static RealCuda) -> CUresult,
) -> CUresult {
    guard(CUDA_ERROR_UNKNOWN, || match enter_launch() {
        Ok((s, cu)) if s.region.trace_requested() => {
            s.refresh();
            let dev = s.device_of_stream(stream.cast());
            let traced = Launch { func, function: function as usize };
            crate::trace::api(s, func, dev, || launch(cu, dev, stream, Some(traced), call))
        }
        Ok((s, cu)) => match known.or_else(|| s.device_of_stream(stream.cast())) {
            Some(dev) if s.plain_launch(dev) => {
                s.count_launch(dev);
                call(cu)
            }
            dev => {
                s.refresh();
                launch(cu, dev, stream, None, call)
            }
        },
        Err(rc) => rc,
    })
}

/// The real driver when a launch on `stream` takes the fast path ([`ShimState::fast_launch`]:
/// counted, nothing else to do), else `Err` with the stream's device if it was found: the hook
/// then runs [`gated`]. Not `eligible` (the launch must take the full path): `Err(None)`.
///
/// [`ShimState::fast_launch`]: crate::state::ShimState::fast_launch
#[inline(always)]
fn fast(eligible: bool, stream: CUstream) -> Result<&'static RealCuda, Option<usize>> {
    if !eligible {
        return Err(None);
    }
    let s = crate::state::get().ok_or(None)?;
    let cu = crate::real::cuda_ready().ok_or(None)?;
    s.fast_launch(stream.cast()).map(|()| cu)
}

#[inline(always)]
fn launch(
    cu: &'static RealCuda,
    dev: Option<usize>,
    stream: CUstream,
    trace: Option<Launch>,
    call: impl FnOnce(&'static RealCuda) -> CUresult,
) -> CUresult {
    let Some(dev) = dev else { return call(cu) };
    let g = crate::compute::before_launch(dev, stream.cast(), trace);
    // The limiter found the region damaged (a wait no launch could have run up, a header
    // overwritten): fail closed rather than launch unlimited.
    if crate::state::get().is_some_and(|s| s.is_failed_closed()) {
        crate::compute::after_launch(g, false);
        return CUDA_ERROR_NOT_PERMITTED;
    }
    let rc = call(cu);
    crate::compute::after_launch(g, rc == CUDA_SUCCESS);
    rc
}

/// One launch export and its slow half. The export takes the fast path ([`fast`]: counted,
/// straight to the driver) when its stream allows it (and the optional `if` holds), else calls
/// `$slow`, kept out of line, which runs the whole limiter ([`gated`]) around the same call.
/// `$call` is the real driver's function called with the caller's arguments, given `$cu`.
macro_rules! launch_hook {
    (@stream stream $s:ident) => { $s };
    (@stream config $c:ident) => {{
        // SAFETY: the caller's configuration (cuda.h's contract).
        unsafe { config_stream($c.cast()) }
    }};
    (
        $name:ident, $slow:ident, $how:ident $s:ident, function $function:ident,
        $(if $eligible:expr,)? ($($arg:ident),* $(,)?), |$cu:ident| $call:expr
    ) => {
        #[doc = concat!("# Safety\nAs cuda.h's `", stringify!($name), "`.")]
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "C" fn $name($($arg: tessera_abi::cuda::params::$name::$arg),*) -> CUresult {
            let stream = launch_hook!(@stream $how $s);
            let known = match fast($($eligible &&)? true, stream) {
                Ok($cu) => {
                    // SAFETY: the caller's arguments, passed on unchanged.
                    return unsafe { $call };
                }
                Err(known) => known,
            };
            // SAFETY: the caller's arguments, passed on unchanged (this function's contract).
            unsafe { $slow(known, $($arg),*) }
        }

        #[doc = concat!("`", stringify!($name), "` past the fast path: the whole limiter (`known`: the stream's device, if the fast path found it).\n\n# Safety\nAs cuda.h's `", stringify!($name), "`.")]
        #[inline(never)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $slow(known: Option<usize>, $($arg: tessera_abi::cuda::params::$name::$arg),*) -> CUresult {
            let stream = launch_hook!(@stream $how $s);
            gated(TraceFunc::$name, $function, stream, known, |$cu| {
                // SAFETY: the caller's arguments, passed on unchanged.
                unsafe { $call }
            })
        }

        // The export has the table's signature.
        const _: tessera_abi::cuda::pfn::$name = $name;
    };
}

launch_hook!(cuLaunchKernel, slow_cuLaunchKernel, stream hStream, function f,
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra), |cu| (cu.cuLaunchKernel)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra));
launch_hook!(cuLaunchKernel_ptsz, slow_cuLaunchKernel_ptsz, stream hStream, function f,
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra), |cu| (cu.cuLaunchKernel_ptsz)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra));
launch_hook!(cuLaunchCooperativeKernel, slow_cuLaunchCooperativeKernel, stream hStream, function f,
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams), |cu| (cu.cuLaunchCooperativeKernel)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams));
launch_hook!(cuLaunchCooperativeKernel_ptsz, slow_cuLaunchCooperativeKernel_ptsz, stream hStream, function f,
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams), |cu| (cu.cuLaunchCooperativeKernel_ptsz)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams));

/// The stream of a `CUlaunchConfig` (null config: the null stream; the driver refuses it).
///
/// # Safety
/// `config` must be null or point to a `CUlaunchConfig`.
unsafe fn config_stream(config: *const CUlaunchConfigHead) -> CUstream {
    // SAFETY: as this function's contract.
    unsafe { get(config) }.map_or(std::ptr::null_mut(), |c| c.h_stream)
}

/// Calls the driver's `cuLaunchKernelEx` (or its `_ptsz` twin) when it has one, else
/// `CUDA_ERROR_NOT_SUPPORTED`.
///
/// # Safety
/// As cuda.h's `cuLaunchKernelEx`.
#[inline(always)]
unsafe fn launch_ex(
    real: Option<tessera_abi::cuda::pfn::cuLaunchKernelEx>,
    config: tessera_abi::cuda::params::cuLaunchKernelEx::config,
    f: CUfunction,
    kernel_params: *mut *mut std::ffi::c_void,
    extra: *mut *mut std::ffi::c_void,
) -> CUresult {
    match real {
        // SAFETY: the caller's arguments, passed on unchanged (this function's contract).
        Some(real) => unsafe { real(config, f, kernel_params, extra) },
        None => CUDA_ERROR_NOT_SUPPORTED,
    }
}

// `cuLaunchKernelEx` is optional in the driver (CUDA 11.8+): without it the fast path is not
// taken and the limiter's path answers `CUDA_ERROR_NOT_SUPPORTED`, as before the fast path.
launch_hook!(cuLaunchKernelEx, slow_cuLaunchKernelEx, config config, function f,
if crate::real::cuda_ready().is_some_and(|cu| cu.cuLaunchKernelEx.is_some()),
(config, f, kernelParams, extra), |cu| launch_ex(cu.cuLaunchKernelEx, config, f, kernelParams, extra));
launch_hook!(cuLaunchKernelEx_ptsz, slow_cuLaunchKernelEx_ptsz, config config, function f,
if crate::real::cuda_ready().is_some_and(|cu| cu.cuLaunchKernelEx_ptsz.is_some()),
(config, f, kernelParams, extra), |cu| launch_ex(cu.cuLaunchKernelEx_ptsz, config, f, kernelParams, extra));

cuda_exports! {
    /// # Safety
    /// As cuda.h's `cuGraphLaunch`, and `cuGraphLaunch_ptsz`.
    fn cuGraphLaunch(hGraphExec, hStream) twin cuGraphLaunch_ptsz(ptsz) {
        // A graph with memory nodes takes the full path: its memory is reserved there.
        let known = match fast(!crate::memory::graph::any_memory_nodes(), hStream) {
            Ok(cu) => {
                let launch = flavour(ptsz, cu.cuGraphLaunch, cu.cuGraphLaunch_ptsz);
                // SAFETY: the caller's arguments, passed on unchanged.
                return unsafe { launch(hGraphExec, hStream) };
            }
            Err(known) => known,
        };
        // SAFETY: the caller's arguments, passed on unchanged (this function's contract).
        unsafe { slow_graph_launch(hGraphExec, hStream, ptsz, known) }
    }
}

/// `cuGraphLaunch` (`cuGraphLaunch_ptsz` when `ptsz`) past the fast path: the whole limiter
/// (`known`: the stream's device, if the fast path found it).
///
/// # Safety
/// As cuda.h's `cuGraphLaunch`.
#[inline(never)]
unsafe fn slow_graph_launch(hGraphExec: CUgraphExec, hStream: CUstream, ptsz: bool, known: Option<usize>) -> CUresult {
    let trace = flavour(ptsz, TraceFunc::cuGraphLaunch, TraceFunc::cuGraphLaunch_ptsz);
    gated(trace, std::ptr::null_mut(), hStream, known, |cu| {
        let launch = flavour(ptsz, cu.cuGraphLaunch, cu.cuGraphLaunch_ptsz);
        // SAFETY: the caller's arguments, passed on unchanged.
        crate::memory::graph::launched(hGraphExec, || unsafe { launch(hGraphExec, hStream) })
    })
}

/// Forgets the stream's device before the driver destroys it, then destroys it.
fn stream_destroyed(stream: CUstream, call: impl FnOnce(&'static RealCuda) -> CUresult) -> CUresult {
    guard(CUDA_ERROR_UNKNOWN, || match enter() {
        Ok((s, cu)) => {
            s.forget_stream(stream.cast());
            call(cu)
        }
        Err(rc) => rc,
    })
}

cuda_exports! {
    /// # Safety
    /// As cuda.h's legacy `cuStreamDestroy`.
    fn cuStreamDestroy(hStream) {
        // SAFETY: the caller's argument, passed on unchanged.
        stream_destroyed(hStream, |cu| unsafe { (cu.cuStreamDestroy)(hStream) })
    }

    /// # Safety
    /// As cuda.h's `cuStreamDestroy_v2`.
    fn cuStreamDestroy_v2(hStream) {
        // SAFETY: the caller's argument, passed on unchanged.
        stream_destroyed(hStream, |cu| unsafe { (cu.cuStreamDestroy_v2)(hStream) })
    }
}
