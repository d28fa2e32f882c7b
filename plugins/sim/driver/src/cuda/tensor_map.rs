//! Tensor maps, the descriptors of the Tensor Memory Accelerator (`cuTensorMapEncodeTiled`,
//! `cuTensorMapEncodeIm2col`, `cuTensorMapReplaceAddress`): host-side encoding that a kernel then
//! takes as a parameter. XLA's Triton GEMMs and cuBLASLt's and cuDNN's Hopper kernels build them
//! before a launch; answered `CUDA_ERROR_NOT_SUPPORTED`, every such candidate failed on the sim
//! (XLA's autotuner dropped them) where a real driver ran it.
//!
//! Each parameter is checked against what cuda.h (12.9) requires, `CUDA_ERROR_INVALID_VALUE`
//! otherwise. The 128 opaque bytes are the sim's own encoding (no kernel reads them here): the
//! address, a marker with the map's kind and enums, the dimensions, strides, box and element
//! strides; `cuTensorMapReplaceAddress` reads the marker back to check the new address's
//! alignment, as the map's data type and interleave ask. The encoding is host work, so no
//! context is needed and it is answered on every model (cuda.h says maps are for compute
//! capability 9.0 and later; what a real driver answers before that is not known here).

use std::ffi::{c_int, c_uint, c_void};

use tessera_abi::cuda_exports;

use super::init::driver;
use super::{INVALID_VALUE, R, run, sys};

/// Marks a map the sim encoded ("TMAP"), in the second word's high half.
const MARKER: u64 = 0x544d_4150 << 32;
/// The largest rank a map has.
const MAX_RANK: usize = 5;
/// `CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B`, `_16U4_ALIGN16B`, `_16U6_ALIGN16B`: packed sub-byte types.
const U4_ALIGN8B: c_uint = 13;
const U4_ALIGN16B: c_uint = 14;
const U6_ALIGN16B: c_uint = 15;
/// `CU_TENSOR_MAP_INTERLEAVE_NONE`, `_32B`.
const INTERLEAVE_NONE: c_uint = 0;
const INTERLEAVE_32B: c_uint = 2;
/// `CU_TENSOR_MAP_SWIZZLE_NONE`, `_32B`.
const SWIZZLE_NONE: c_uint = 0;
const SWIZZLE_32B: c_uint = 1;

/// Half-bytes an element of each data type takes in memory (packed types: 16 values in 8 or 16
/// bytes).
const NIBBLES: [u64; 16] = [2, 4, 8, 8, 16, 16, 4, 8, 16, 4, 8, 8, 8, 1, 2, 2];
/// Whether each data type is floating point (the NaN fill needs one).
const FLOAT: [bool; 16] =
    [false, false, false, false, false, false, true, true, true, true, true, true, true, false, false, false];

/// What both encodings share.
struct Common {
    data_type: c_uint,
    rank: usize,
    address: u64,
    dims: [u64; MAX_RANK],
    strides: [u64; MAX_RANK - 1],
    element_strides: [u32; MAX_RANK],
    interleave: c_uint,
    swizzle: c_uint,
    l2: c_uint,
    oob: c_uint,
}

/// The map's kind, in its marker.
#[derive(Clone, Copy)]
enum Kind {
    Tiled = 1,
    Im2col = 2,
}

fn check(ok: bool) -> R {
    if ok { Ok(()) } else { Err(INVALID_VALUE) }
}

/// Reads `n` values of a caller's array (null with `n` > 0: `INVALID_VALUE`).
///
/// # Safety
/// `p` must be null or valid for reads of `n` values.
unsafe fn array<T: Copy + Default, const N: usize>(p: *const T, n: usize) -> R<[T; N]> {
    let mut out = [T::default(); N];
    if n == 0 {
        return Ok(out);
    }
    check(!p.is_null() && p.is_aligned() && n <= N)?;
    // SAFETY: p is non-null and aligned and holds n values by the caller's contract; n <= N.
    out[..n].copy_from_slice(unsafe { std::slice::from_raw_parts(p, n) });
    Ok(out)
}

/// The alignment the global address needs: 32 bytes for a 32-byte interleave or a 16-byte
/// aligned packed type, else 16.
fn address_alignment(data_type: c_uint, interleave: c_uint) -> u64 {
    if interleave == INTERLEAVE_32B || matches!(data_type, U4_ALIGN16B | U6_ALIGN16B) { 32 } else { 16 }
}

/// The bytes a swizzle pattern spans (the box's inner dimension must fit in it).
fn swizzle_span(swizzle: c_uint) -> u64 {
    match swizzle {
        1 => 32,
        2 => 64,
        _ => 128,
    }
}

impl Common {
    /// Reads and checks what both encodings share, for ranks `ranks`.
    ///
    /// # Safety
    /// The arrays must be null or hold `rank` (`rank - 1` for the strides) values.
    #[allow(clippy::too_many_arguments)]
    unsafe fn read(
        ranks: std::ops::RangeInclusive<usize>,
        data_type: c_uint,
        rank: u32,
        address: *mut c_void,
        dims: *const u64,
        strides: *const u64,
        element_strides: *const u32,
        (interleave, swizzle, l2, oob): (c_uint, c_uint, c_uint, c_uint),
    ) -> R<Common> {
        let rank = rank as usize;
        check(ranks.contains(&rank) && (data_type as usize) < NIBBLES.len())?;
        check(interleave <= 2 && swizzle <= 6 && l2 <= 3 && oob <= 1)?;
        check(interleave == INTERLEAVE_NONE || rank >= 3)?;
        // SAFETY: the arrays hold rank (strides: rank - 1) values by the caller's contract.
        let (dims, strides, element_strides) = unsafe {
            (
                array::<u64, MAX_RANK>(dims, rank)?,
                array::<u64, 4>(strides, rank - 1)?,
                array::<u32, MAX_RANK>(element_strides, rank)?,
            )
        };
        let c = Common {
            data_type,
            rank,
            address: address as u64,
            dims,
            strides,
            element_strides,
            interleave,
            swizzle,
            l2,
            oob,
        };
        check(c.address.is_multiple_of(address_alignment(data_type, interleave)))?;
        check(c.dims[..rank].iter().all(|&d| (1..=1 << 32).contains(&d)))?;
        match data_type {
            U4_ALIGN16B | U6_ALIGN16B => check(c.dims[0].is_multiple_of(128))?,
            U4_ALIGN8B => check(c.dims[0].is_multiple_of(2))?,
            _ => {}
        }
        let stride_unit =
            if interleave == INTERLEAVE_32B || matches!(data_type, U4_ALIGN16B | U6_ALIGN16B) { 32 } else { 16 };
        check(c.strides[..rank - 1].iter().all(|&s| s.is_multiple_of(stride_unit) && s < 1 << 40))?;
        check(c.element_strides[..rank].iter().all(|&e| (1..=8).contains(&e)))?;
        check(interleave != INTERLEAVE_32B || swizzle == SWIZZLE_32B)?;
        match data_type {
            U6_ALIGN16B => check(interleave == INTERLEAVE_NONE && matches!(swizzle, 0 | 3 | 4 | 6))?,
            U4_ALIGN16B => check(matches!(swizzle, 0 | 3 | 4))?,
            _ => {}
        }
        check(oob == 0 || FLOAT[data_type as usize])?;
        Ok(c)
    }

    /// Bytes of `elements` elements of the map's type.
    fn bytes(&self, elements: u64) -> u64 {
        (elements * NIBBLES[self.data_type as usize]).div_ceil(2)
    }

    /// Checks the box's inner dimension, `elements` wide, against the swizzle span.
    fn check_inner(&self, elements: u64) -> R {
        check(
            self.interleave != INTERLEAVE_NONE
                || self.swizzle == SWIZZLE_NONE
                || self.bytes(elements) <= swizzle_span(self.swizzle),
        )
    }

    /// The encoding: the address, the marker, then the dimensions and strides; `rest` the
    /// kind's own words (from the eleventh).
    fn encode(&self, kind: Kind, rest: [u64; 5]) -> [u64; 16] {
        let mut q = [0u64; 16];
        q[0] = self.address;
        q[1] = MARKER
            | (kind as u64) << 24
            | (self.data_type as u64) << 16
            | (self.rank as u64) << 12
            | (self.interleave as u64) << 8
            | (self.swizzle as u64) << 4
            | (self.l2 as u64) << 1
            | self.oob as u64;
        q[2..7].copy_from_slice(&self.dims);
        q[7..11].copy_from_slice(&self.strides);
        q[11..].copy_from_slice(&rest);
        q
    }

    /// The element strides, 8 bits each.
    fn packed_element_strides(&self) -> u64 {
        self.element_strides.iter().enumerate().fold(0, |w, (i, &e)| w | (e as u64) << (8 * i))
    }
}

/// Writes an encoding to the caller's map (null or not 64-byte aligned: `INVALID_VALUE`).
///
/// # Safety
/// `map` must be null or valid for a write of a `CUtensorMap`.
unsafe fn store(map: *mut sys::CUtensorMap, words: [u64; 16]) -> R {
    check(!map.is_null() && (map as usize).is_multiple_of(64))?;
    // SAFETY: map is non-null and aligned, and valid for a write by the caller's contract.
    unsafe { (*map).opaque = words };
    Ok(())
}

cuda_exports! {
    fn cuTensorMapEncodeTiled(tensorMap, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides, boxDim, elementStrides, interleave, swizzle, l2Promotion, oobFill) {
        run(|| {
            driver()?;
            let enums = (interleave, swizzle, l2Promotion, oobFill);
            // SAFETY: the arrays hold tensorRank (strides: tensorRank - 1) values by cuda.h's contract.
            let c = unsafe {
                Common::read(1..=MAX_RANK, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides, elementStrides, enums)?
            };
            // SAFETY: as above.
            let boxes = unsafe { array::<u32, MAX_RANK>(boxDim, c.rank)? };
            check(boxes[..c.rank].iter().all(|&b| (1..=256).contains(&b)))?;
            let inner = boxes[0] as u64;
            check(c.interleave != INTERLEAVE_NONE || c.bytes(inner).is_multiple_of(16))?;
            check(!matches!(c.data_type, U4_ALIGN16B | U6_ALIGN16B) || inner == 128)?;
            c.check_inner(inner)?;
            let packed_boxes = boxes.iter().enumerate().fold(0u64, |w, (i, &b)| w | (b as u64) << (12 * i));
            let rest = [packed_boxes, c.packed_element_strides(), 0, 0, 0];
            // SAFETY: tensorMap is the caller's out-pointer for one map.
            unsafe { store(tensorMap, c.encode(Kind::Tiled, rest)) }
        })
    }

    fn cuTensorMapEncodeIm2col(tensorMap, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides, pixelBoxLowerCorner, pixelBoxUpperCorner, channelsPerPixel, pixelsPerColumn, elementStrides, interleave, swizzle, l2Promotion, oobFill) {
        run(|| {
            driver()?;
            let enums = (interleave, swizzle, l2Promotion, oobFill);
            // SAFETY: the arrays hold tensorRank (strides: tensorRank - 1) values by cuda.h's contract.
            let c = unsafe {
                Common::read(3..=MAX_RANK, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides, elementStrides, enums)?
            };
            // The {D, H, W} corners: one per spatial dimension, in a range that narrows with the rank.
            let spatial = c.rank - 2;
            let bound: c_int = match c.rank {
                3 => 1 << 15,
                4 => 1 << 7,
                _ => 1 << 4,
            };
            // SAFETY: both corner arrays hold tensorRank - 2 values by cuda.h's contract.
            let (lower, upper) = unsafe {
                (array::<c_int, 3>(pixelBoxLowerCorner, spatial)?, array::<c_int, 3>(pixelBoxUpperCorner, spatial)?)
            };
            check(lower[..spatial].iter().chain(&upper[..spatial]).all(|v| (-bound..bound).contains(v)))?;
            let channels = channelsPerPixel as u64;
            check((1..=256).contains(&channels) && (1..=1024).contains(&pixelsPerColumn))?;
            check(!matches!(c.data_type, U4_ALIGN16B | U6_ALIGN16B) || channels == 128)?;
            c.check_inner(channels)?;
            let corners = |v: [c_int; 3]| v.iter().enumerate().fold(0u64, |w, (i, &o)| w | ((o as u16) as u64) << (16 * i));
            let rest = [channels | (pixelsPerColumn as u64) << 16, c.packed_element_strides(), corners(lower), corners(upper), 0];
            // SAFETY: tensorMap is the caller's out-pointer for one map.
            unsafe { store(tensorMap, c.encode(Kind::Im2col, rest)) }
        })
    }

    fn cuTensorMapReplaceAddress(tensorMap, globalAddress) {
        run(|| {
            driver()?;
            check(!tensorMap.is_null() && (tensorMap as usize).is_multiple_of(64))?;
            // SAFETY: tensorMap is non-null and aligned, a map the caller holds (cuda.h's contract).
            let words = unsafe { &mut (*tensorMap).opaque };
            // Only a map this driver encoded can take a new address.
            check(words[1] >> 32 == MARKER >> 32)?;
            let (data_type, interleave) = ((words[1] >> 16 & 0xff) as c_uint, (words[1] >> 8 & 0xf) as c_uint);
            check((globalAddress as u64).is_multiple_of(address_alignment(data_type, interleave)))?;
            words[0] = globalAddress as u64;
            Ok(())
        })
    }
}
