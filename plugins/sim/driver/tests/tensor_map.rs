//! Tensor maps (`cuTensorMapEncodeTiled`, `cuTensorMapEncodeIm2col`, `cuTensorMapReplaceAddress`)
//! through the library's exports, as XLA's, cuBLASLt's and cuDNN's Hopper kernels ask for them:
//! maps a GEMM and a convolution use are encoded, and each requirement cuda.h (12.9) states is
//! refused with `CUDA_ERROR_INVALID_VALUE` when broken.
//!
//! Build the library first: `cargo build -p tessera-sim-driver && cargo test -p tessera-sim-driver --test tensor_map`.

use std::ffi::{c_int, c_void};

use tessera_abi::cuda::pfn;
use tessera_sim_testkit::SimNode;

mod common;
use common::{INVALID_VALUE, NOT_INITIALIZED, SUCCESS};

/// `CUtensorMap`: 128 opaque bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Map([u64; 16]);

// CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapInterleave, CUtensorMapL2promotion values.
const INT32: u32 = 3;
const FLOAT16: u32 = 6;
const BFLOAT16: u32 = 9;
const SWIZZLE_NONE: u32 = 0;
const SWIZZLE_32B: u32 = 1;
const SWIZZLE_64B: u32 = 2;
const SWIZZLE_128B: u32 = 3;
const INTERLEAVE_NONE: u32 = 0;
const INTERLEAVE_32B: u32 = 2;
const L2_256B: u32 = 3;
const NAN_FILL: u32 = 1;

/// A tiled map's parameters; `tiled()` starts from a GEMM operand's (a 4096 x 1024 bf16 matrix
/// in 64 x 128 boxes, 128-byte swizzle).
#[derive(Clone)]
struct Tiled {
    data_type: u32,
    address: u64,
    dims: Vec<u64>,
    strides: Vec<u64>,
    boxes: Vec<u32>,
    element_strides: Vec<u32>,
    interleave: u32,
    swizzle: u32,
    oob: u32,
}

fn tiled() -> Tiled {
    Tiled {
        data_type: BFLOAT16,
        address: 0x7f00_0000_0200,
        dims: vec![1024, 4096],
        strides: vec![2048],
        boxes: vec![64, 128],
        element_strides: vec![1, 1],
        interleave: INTERLEAVE_NONE,
        swizzle: SWIZZLE_128B,
        oob: 0,
    }
}

struct Driver {
    lib: libloading::Library,
}

impl Driver {
    fn sym<T: Copy>(&self, name: &str) -> T {
        // SAFETY: every caller names T as the export's C signature (tessera_abi's table).
        unsafe { *self.lib.get::<T>(name.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}")) }
    }

    fn encode_at(&self, map: *mut Map, t: &Tiled) -> u32 {
        let f: pfn::cuTensorMapEncodeTiled = self.sym("cuTensorMapEncodeTiled");
        let rank = t.dims.len() as u32;
        // SAFETY: the arrays hold rank values (strides rank - 1), as the call reads; the map is
        // the caller's, or a bad pointer the driver must refuse before writing.
        unsafe {
            f(
                map.cast(),
                t.data_type,
                rank,
                t.address as *mut c_void,
                t.dims.as_ptr(),
                t.strides.as_ptr(),
                t.boxes.as_ptr(),
                t.element_strides.as_ptr(),
                t.interleave,
                t.swizzle,
                L2_256B,
                t.oob,
            ) as u32
        }
    }

    fn encode(&self, t: &Tiled) -> (u32, Map) {
        let mut map = Map([0; 16]);
        (self.encode_at(&mut map, t), map)
    }

    fn replace(&self, map: &mut Map, address: u64) -> u32 {
        let f: pfn::cuTensorMapReplaceAddress = self.sym("cuTensorMapReplaceAddress");
        // SAFETY: the map is ours.
        unsafe { f((map as *mut Map).cast(), address as *mut c_void) as u32 }
    }

    /// An NHWC fp16 image's im2col map (64 channels, 32 x 32 pixels, 8 images) with these
    /// corners (two each: H, W), channels and pixels, of `rank` (the arrays are cut to it).
    fn im2col(&self, rank: u32, lower: [c_int; 3], upper: [c_int; 3], channels: u32, pixels: u32) -> u32 {
        let f: pfn::cuTensorMapEncodeIm2col = self.sym("cuTensorMapEncodeIm2col");
        let dims = [64u64, 32, 32, 8, 1];
        let strides = [128u64, 4096, 131_072, 1_048_576];
        let element_strides = [1u32; 5];
        let mut map = Map([0; 16]);
        // SAFETY: every array holds at least rank values, as the call reads.
        unsafe {
            f(
                (&mut map as *mut Map).cast(),
                FLOAT16,
                rank,
                0x7f00_0000_0000 as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                lower.as_ptr(),
                upper.as_ptr(),
                channels,
                pixels,
                element_strides.as_ptr(),
                INTERLEAVE_NONE,
                SWIZZLE_128B,
                L2_256B,
                0,
            ) as u32
        }
    }
}

#[test]
fn tensor_maps_are_encoded_and_checked_as_cuda_h_says() {
    let node = SimNode::new();
    node.run_isolated("tensor_maps_are_encoded_and_checked_as_cuda_h_says", || {
        // SAFETY: loading the simulated driver runs no initializers.
        let cu = Driver { lib: unsafe { libloading::Library::new(node.cuda_path()) }.expect("load libcuda.so.1") };
        assert_eq!(cu.encode(&tiled()).0, NOT_INITIALIZED, "before cuInit");
        let init: pfn::cuInit = cu.sym("cuInit");
        // SAFETY: cuInit takes flags only.
        assert_eq!(unsafe { init(0) } as u32, SUCCESS);

        // Encoded without a context (host work), the address taken back by a replacement.
        let (rc, mut map) = cu.encode(&tiled());
        assert_eq!(rc, SUCCESS, "a GEMM operand's map");
        assert_eq!(map.0[0], tiled().address, "the map holds its address");
        assert_eq!(cu.replace(&mut map, 0x7f00_0010_0000), SUCCESS);
        assert_eq!(map.0[0], 0x7f00_0010_0000);
        assert_eq!(cu.replace(&mut map, 0x7f00_0010_0008), INVALID_VALUE, "a new address 16-byte aligned too");
        assert_eq!(cu.replace(&mut Map([0; 16]), 0x7f00_0010_0000), INVALID_VALUE, "not a map the driver encoded");
        let five = Tiled {
            dims: vec![64, 8, 8, 8, 8],
            strides: vec![128, 1024, 8192, 65_536],
            boxes: vec![64, 8, 8, 8, 8],
            element_strides: vec![1, 2, 2, 1, 8],
            ..tiled()
        };
        assert_eq!(cu.encode(&five).0, SUCCESS, "rank 5, strided elements");
        let int_map =
            Tiled { data_type: INT32, dims: vec![512, 4096], boxes: vec![16, 128], swizzle: SWIZZLE_64B, ..tiled() };
        assert_eq!(cu.encode(&int_map).0, SUCCESS, "64 bytes in a 64-byte swizzle");

        // Each requirement broken: INVALID_VALUE.
        let broken: Vec<(&str, Tiled)> = vec![
            ("rank 0", Tiled { dims: vec![], strides: vec![], boxes: vec![], element_strides: vec![], ..tiled() }),
            (
                "rank 6",
                Tiled {
                    dims: vec![8; 6],
                    strides: vec![16; 5],
                    boxes: vec![8; 6],
                    element_strides: vec![1; 6],
                    ..tiled()
                },
            ),
            ("a data type past the enum", Tiled { data_type: 16, ..tiled() }),
            ("an address 8-byte aligned", Tiled { address: 0x7f00_0000_0208, ..tiled() }),
            ("a dimension of 0", Tiled { dims: vec![1024, 0], ..tiled() }),
            ("a dimension past 2^32", Tiled { dims: vec![1024, (1 << 32) + 1], ..tiled() }),
            ("a stride off 16 bytes", Tiled { strides: vec![2056], ..tiled() }),
            ("a stride of 2^40", Tiled { strides: vec![1 << 40], ..tiled() }),
            ("a box of 257", Tiled { boxes: vec![64, 257], ..tiled() }),
            ("a box of 0", Tiled { boxes: vec![64, 0], ..tiled() }),
            ("an inner box of 8 bytes", Tiled { boxes: vec![4, 128], swizzle: SWIZZLE_NONE, ..tiled() }),
            ("128 bytes in a 32-byte swizzle", Tiled { swizzle: SWIZZLE_32B, ..tiled() }),
            ("a swizzle past the enum", Tiled { swizzle: 7, ..tiled() }),
            ("an element stride of 9", Tiled { element_strides: vec![1, 9], ..tiled() }),
            ("an element stride of 0", Tiled { element_strides: vec![1, 0], ..tiled() }),
            ("an interleave of rank 2", Tiled { interleave: INTERLEAVE_32B, swizzle: SWIZZLE_32B, ..tiled() }),
            ("a NaN fill of integers", Tiled { data_type: INT32, boxes: vec![32, 128], oob: NAN_FILL, ..tiled() }),
        ];
        for (what, t) in &broken {
            assert_eq!(cu.encode(t).0, INVALID_VALUE, "{what}");
        }
        let interleaved = Tiled {
            dims: vec![64, 8, 8],
            strides: vec![128, 1024],
            boxes: vec![64, 8, 8],
            element_strides: vec![1, 1, 1],
            interleave: INTERLEAVE_32B,
            ..tiled()
        };
        assert_eq!(cu.encode(&interleaved).0, INVALID_VALUE, "a 32-byte interleave needs the 32-byte swizzle");
        assert_eq!(cu.encode(&Tiled { swizzle: SWIZZLE_32B, ..interleaved.clone() }).0, SUCCESS);
        let mut maps = [Map([0; 16]); 2];
        let off = (maps.as_mut_ptr() as *mut u8).wrapping_add(32).cast::<Map>();
        assert_eq!(cu.encode_at(off, &tiled()), INVALID_VALUE, "a map 64-byte aligned");
        assert_eq!(cu.encode_at(std::ptr::null_mut(), &tiled()), INVALID_VALUE, "no map");

        // im2col: rank 3 to 5, corners within the rank's range, channels and pixels bounded.
        assert_eq!(cu.im2col(4, [-1, -1, 0], [-1, -1, 0], 64, 128), SUCCESS, "a 3 x 3 convolution's map");
        assert_eq!(cu.im2col(2, [0; 3], [0; 3], 64, 128), INVALID_VALUE, "rank 2");
        assert_eq!(cu.im2col(4, [-129, 0, 0], [0; 3], 64, 128), INVALID_VALUE, "a corner past [-128, 127]");
        assert_eq!(cu.im2col(3, [-129, 0, 0], [0; 3], 64, 128), SUCCESS, "rank 3's range is wider");
        assert_eq!(cu.im2col(5, [16, 0, 0], [0; 3], 64, 128), INVALID_VALUE, "a corner past [-16, 15]");
        assert_eq!(cu.im2col(4, [0; 3], [0; 3], 257, 128), INVALID_VALUE, "257 channels");
        assert_eq!(cu.im2col(4, [0; 3], [0; 3], 64, 1025), INVALID_VALUE, "1025 pixels");
        assert_eq!(
            cu.im2col(4, [0; 3], [0; 3], 128, 128),
            INVALID_VALUE,
            "256 bytes of channels in a 128-byte swizzle"
        );
    });
}
