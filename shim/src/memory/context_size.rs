//! A context's size from tesserad: what a process of an allocation charges its first primary
//! context on a GPU without measuring it, so that it never loads NVML in the common case.
//!
//! The figure comes from the allocation directory's `context-sizes` file (beside `limits`, as
//! root wrote it, read-only in the container: `tessera_region::context_sizes`), read once per
//! process. Only where tesserad measured the GPU, the file is well formed, its figure sane, and
//! the context is one like those tesserad measured (a primary context without the flag that
//! keeps local memory at its largest, and without `CUDA_DEVICE_MAX_CONNECTIONS`, which changes
//! how many channels a context makes); anything else is measured as before (`context`: on the
//! spot, or later by the helper thread that loads NVML). A limit taken from the environment
//! (`TESSERA_MEMORY_LIMIT`, no limits file) has no such file.
//!
//! The figure is charged exactly: the context is reserved that much before it is made (refused
//! with `CUDA_ERROR_OUT_OF_MEMORY` when it does not fit) and never trued up. A context that took
//! more on the GPU than the figure is left to tesserad's enforcement, which compares the driver's
//! own per-process figures with the limit (docs/security.md).

use std::ffi::{c_int, c_uint};
use std::sync::OnceLock;

use tessera_region::context_sizes::{CONTEXT_SIZES_FILE, ContextSizes};

use super::{Charge, Kind};
use crate::ffi::*;
use crate::real::RealCuda;
use crate::state::ShimState;

/// `CU_CTX_LMEM_RESIZE_TO_MAX`: a context that keeps its local memory at the largest size a
/// kernel asked for holds more than one with the default flags.
const LMEM_RESIZE_TO_MAX: c_uint = 0x10;

/// The file's figures, read once (`None`: no file, a damaged one, or an environment under which
/// contexts are not the size measured).
fn sizes(s: &ShimState) -> Option<&'static ContextSizes> {
    static SIZES: OnceLock<Option<ContextSizes>> = OnceLock::new();
    SIZES
        .get_or_init(|| {
            if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_some() {
                return None;
            }
            let dir = s.limits_dir()?;
            ContextSizes::load(&dir.join(CONTEXT_SIZES_FILE)).filter(|t| !t.is_empty())
        })
        .as_ref()
}

/// Whether this process has any figure at all (read at `cuInit`: without one, NVML starts
/// loading on the helper thread at once).
#[inline(never)]
pub(crate) fn any(s: &ShimState) -> bool {
    sizes(s).is_some()
}

/// The size to charge a new primary context on CUDA device `ordinal` (region device `dev`), if
/// tesserad's figure applies to it.
pub(crate) fn for_primary(s: &ShimState, cu: &RealCuda, dev: usize, ordinal: c_int) -> Option<u64> {
    let sizes = sizes(s)?;
    let size = sizes.get(&s.uuid_of(dev)?)?;
    let (mut flags, mut active): (c_uint, c_int) = (0, 0);
    // SAFETY: valid out-pointers; a device ordinal the driver checks.
    let rc = unsafe { (cu.cuDevicePrimaryCtxGetState)(ordinal, &mut flags, &mut active) };
    (rc == CUDA_SUCCESS && flags & LMEM_RESIZE_TO_MAX == 0).then_some(size)
}

/// Creates a process's first primary context on a device charged `size`, tesserad's figure
/// (`context_size`): reserved before, kept after, nothing measured.
pub(super) fn create(
    s: &ShimState,
    dev: usize,
    ordinal: c_int,
    size: u64,
    create: impl FnOnce() -> (CUresult, Option<CUcontext>),
) -> CUresult {
    if !s.reserve(dev, size) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let (rc, ctx) = create();
    let Some(ctx) = ctx.filter(|_| rc == CUDA_SUCCESS) else {
        s.refund(dev, size);
        return rc;
    };
    super::context::made(s, ctx, ordinal, true);
    s.mem.contexts.insert(ctx as u64, Charge { dev, bytes: size, ctx: ctx as usize, kind: Kind::Context });
    rc
}
