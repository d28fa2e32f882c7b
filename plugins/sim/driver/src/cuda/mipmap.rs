//! Mipmapped arrays (`cuMipmappedArrayCreate`, `cuMipmappedArrayDestroy`,
//! `cuMipmappedArrayGetLevel`, `cuMipmappedArrayGetMemoryRequirements`): one device allocation
//! holding every level, each level a CUDA array (descriptors, copies) into it.
//!
//! Level `i` of a `width × height × depth` array is `max(1, width >> i)` wide, `max(1, height >> i)`
//! high (0 for a 1D array), and `max(1, depth >> i)` deep (0 for 1D and 2D arrays; layered and
//! cubemap arrays keep their depth, the layer or face count, at every level). The array takes, as
//! a real driver lays levels out, each level's bytes (`w × max(h, 1) × max(d, 1) × element
//! size`) rounded up to the texture alignment (512 bytes, `CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT`),
//! summed over the levels; that sum is charged to the device, and is the size
//! `cuMipmappedArrayGetMemoryRequirements` reports (its alignment: the VMM granularity, 2 MiB).
//!
//! Not modelled: sparse and deferred-mapping mipmapped arrays (`CUDA_ARRAY3D_SPARSE`,
//! `CUDA_ARRAY3D_DEFERRED_MAPPING`: `CUDA_ERROR_NOT_SUPPORTED`), and so
//! `cuMipmappedArrayGetSparseProperties`.

use std::ffi::c_uint;
use std::sync::Arc;

use tessera_abi::cuda::raw::Array3dDesc;
use tessera_abi::cuda_exports;

use super::handles::{self, mipmap};
use super::init::driver;
use super::memory::{Array, MemKind, alloc_in, ctx_for_work, format_bytes, release};
use super::{INVALID_HANDLE, INVALID_VALUE, NOT_SUPPORTED, R, need, put, run, sys};

/// The start of every level is aligned to this (the texture alignment).
const LEVEL_ALIGN: u64 = 512;

/// `CUDA_ARRAY3D_*` flags.
const LAYERED: u32 = 0x01;
const SURFACE_LDST: u32 = 0x02;
const CUBEMAP: u32 = 0x04;
const TEXTURE_GATHER: u32 = 0x08;
const COLOR_ATTACHMENT: u32 = 0x20;
const SPARSE: u32 = 0x40;
const DEFERRED_MAPPING: u32 = 0x80;

/// A mipmapped array: its storage and its levels (array handles, level 0 first).
pub(crate) struct Mipmap {
    pub ctx: usize,
    pub base: u64,
    pub bytes: u64,
    pub levels: Vec<usize>,
}

/// One level's shape: (width, height, depth).
fn level_shape(width: u64, height: u64, depth: u64, flags: u32, i: u32) -> (u64, u64, u64) {
    let shrink = |v: u64| if v == 0 { 0 } else { (v >> i).max(1) };
    let d = if flags & (LAYERED | CUBEMAP) != 0 { depth } else { shrink(depth) };
    (shrink(width), shrink(height), d)
}

/// Bytes of each level of a mipmapped array, aligned as laid out (see the module's doc).
pub(crate) fn level_bytes(width: u64, height: u64, depth: u64, flags: u32, elem: u64, levels: u32) -> Option<Vec<u64>> {
    (0..levels)
        .map(|i| {
            let (w, h, d) = level_shape(width, height, depth, flags, i);
            w.checked_mul(h.max(1))?.checked_mul(d.max(1))?.checked_mul(elem)?.checked_next_multiple_of(LEVEL_ALIGN)
        })
        .collect()
}

/// Checks a mipmapped array's descriptor and level count; the element size.
fn validate(d: &Array3dDesc, levels: c_uint) -> R<u64> {
    let (w, h, depth, flags) = (d.width as u64, d.height as u64, d.depth as u64, d.flags);
    if flags & (SPARSE | DEFERRED_MAPPING) != 0 {
        return Err(NOT_SUPPORTED);
    }
    if flags & !(LAYERED | SURFACE_LDST | CUBEMAP | TEXTURE_GATHER | COLOR_ATTACHMENT) != 0 {
        return Err(INVALID_VALUE);
    }
    let fb = format_bytes(d.format)?;
    if w == 0 || !matches!(d.channels, 1 | 2 | 4) || (h == 0 && depth > 0) {
        return Err(INVALID_VALUE);
    }
    if flags & CUBEMAP != 0 {
        let faces_ok = if flags & LAYERED != 0 { depth > 0 && depth % 6 == 0 } else { depth == 6 };
        if w != h || !faces_ok {
            return Err(INVALID_VALUE);
        }
    }
    if flags & LAYERED != 0 && depth == 0 {
        return Err(INVALID_VALUE);
    }
    // At most as many levels as halvings of the largest extent that shrinks, plus one.
    let shrinking = if flags & (LAYERED | CUBEMAP) != 0 { w.max(h) } else { w.max(h).max(depth) };
    let most = 64 - shrinking.leading_zeros();
    if levels == 0 || levels > most {
        return Err(INVALID_VALUE);
    }
    Ok(fb * d.channels as u64)
}

fn create(d: &Array3dDesc, levels: c_uint) -> R<usize> {
    let elem = validate(d, levels)?;
    let (w, h, depth) = (d.width as u64, d.height as u64, d.depth as u64);
    let sizes = level_bytes(w, h, depth, d.flags, elem, levels).ok_or(INVALID_VALUE)?;
    let bytes = sizes.iter().try_fold(0u64, |a, &b| a.checked_add(b)).ok_or(INVALID_VALUE)?;
    let (node, ctx) = ctx_for_work()?;
    let base = alloc_in(node, &ctx, bytes, MemKind::Array, false)?;
    let handle = handles::new_handle();
    let mut reg = handles::write();
    let mut offset = 0;
    let mut level_handles = Vec::with_capacity(sizes.len());
    for (i, &size) in sizes.iter().enumerate() {
        let (lw, lh, ld) = level_shape(w, h, depth, d.flags, i as u32);
        let level = Array {
            ctx: ctx.handle,
            width: lw,
            height: lh,
            depth: ld,
            format: d.format,
            channels: d.channels,
            flags: d.flags,
            elem,
            base: base + offset,
            bytes: size,
            mipmap: handle,
        };
        let lh = handles::new_handle();
        reg.arrays.insert(lh, Arc::new(level));
        level_handles.push(lh);
        offset += size;
    }
    reg.mipmaps.insert(handle, Arc::new(Mipmap { ctx: ctx.handle, base, bytes, levels: level_handles }));
    Ok(handle)
}

cuda_exports! {
    fn cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels) {
        run(|| {
            need(pHandle)?;
            need(pMipmappedArrayDesc)?;
            // SAFETY: checked non-null and aligned; Array3dDesc has the descriptor's layout with the
            // enum read as a raw integer.
            let d = unsafe { pMipmappedArrayDesc.cast::<Array3dDesc>().read() };
            let h = create(&d, numMipmapLevels)?;
            // SAFETY: pHandle is the caller's out-pointer (checked above).
            unsafe { put(pHandle, handles::as_ptr(h)) }
        })
    }

    fn cuMipmappedArrayDestroy(hMipmappedArray) {
        run(|| {
            let node = driver()?.node;
            let alloc = {
                let mut reg = handles::write();
                let m = reg.mipmaps.remove(&(hMipmappedArray as usize)).ok_or(INVALID_HANDLE)?;
                for l in &m.levels {
                    reg.arrays.remove(l);
                }
                reg.mem.remove(&m.base)
            };
            if let Some(a) = alloc {
                release(node, &a);
            }
            Ok(())
        })
    }

    fn cuMipmappedArrayGetLevel(pLevelArray, hMipmappedArray, level) {
        run(|| {
            need(pLevelArray)?;
            let m = mipmap(hMipmappedArray)?;
            let l = *m.levels.get(level as usize).ok_or(INVALID_VALUE)?;
            // SAFETY: pLevelArray is the caller's out-pointer (checked above).
            unsafe { put(pLevelArray, handles::as_ptr(l)) }
        })
    }
}

/// `CUDA_ARRAY_MEMORY_REQUIREMENTS`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MemoryRequirements {
    size: usize,
    alignment: usize,
    reserved: [c_uint; 4],
}
const _: () =
    assert!(std::mem::size_of::<MemoryRequirements>() == std::mem::size_of::<sys::CUDA_ARRAY_MEMORY_REQUIREMENTS>());

cuda_exports! {
    fn cuMipmappedArrayGetMemoryRequirements(memoryRequirements, mipmap, device) {
        run(|| {
            need(memoryRequirements)?;
            driver()?.device(device)?;
            let m = self::mipmap(mipmap)?;
            let r = MemoryRequirements {
                size: m.bytes as usize,
                alignment: super::vmm::GRANULARITY as usize,
                reserved: [0; 4],
            };
            // SAFETY: the caller's out-pointer (checked above), of this layout (asserted above).
            unsafe { put(memoryRequirements.cast::<MemoryRequirements>(), r) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_halve_to_one_and_align() {
        // 2D 1024 x 512 RGBA8, 11 levels: 2 MiB, 512 KiB, ... down to 1 x 1 (4 bytes -> 512).
        let sizes = level_bytes(1024, 512, 0, 0, 4, 11).unwrap();
        assert_eq!(sizes[0], 1024 * 512 * 4);
        assert_eq!(sizes[1], 512 * 256 * 4);
        assert_eq!(sizes[9], 512, "2 x 1 x 4 bytes, aligned");
        assert_eq!(sizes[10], 512, "1 x 1 x 4 bytes, aligned");
        // A layered 2D array keeps its layers at every level; a 3D one halves its depth.
        assert_eq!(
            level_bytes(64, 64, 8, LAYERED, 4, 3).unwrap(),
            vec![64 * 64 * 8 * 4, 32 * 32 * 8 * 4, 16 * 16 * 8 * 4]
        );
        assert_eq!(level_bytes(64, 64, 8, 0, 4, 3).unwrap(), vec![64 * 64 * 8 * 4, 32 * 32 * 4 * 4, 16 * 16 * 2 * 4]);
        // 1D.
        assert_eq!(level_bytes(1000, 0, 0, 0, 1, 2).unwrap(), vec![1024, 512]);
        assert_eq!(level_bytes(u64::MAX, 2, 0, 0, 4, 1), None);
    }

    #[test]
    fn level_counts_are_bounded_by_the_largest_shrinking_extent() {
        let d = |w: usize, h: usize, depth: usize, flags: u32| Array3dDesc {
            width: w,
            height: h,
            depth,
            format: 0x20,
            channels: 1,
            flags,
        };
        assert_eq!(validate(&d(1024, 1, 0, 0), 11), Ok(4));
        assert_eq!(validate(&d(1024, 1, 0, 0), 12), Err(INVALID_VALUE));
        assert_eq!(validate(&d(4, 4, 0, 0), 0), Err(INVALID_VALUE));
        assert_eq!(validate(&d(16, 16, 6, CUBEMAP), 5), Ok(4));
        assert_eq!(validate(&d(16, 8, 6, CUBEMAP), 1), Err(INVALID_VALUE), "faces are square");
        assert_eq!(validate(&d(16, 16, 5, CUBEMAP), 1), Err(INVALID_VALUE), "six faces");
        assert_eq!(validate(&d(16, 16, 12, CUBEMAP | LAYERED), 1), Ok(4));
        assert_eq!(validate(&d(16, 16, 4, SPARSE), 1), Err(NOT_SUPPORTED));
        assert_eq!(validate(&d(16, 16, 4, 0x1000), 1), Err(INVALID_VALUE));
    }
}
