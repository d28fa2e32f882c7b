//! The tools' private tables as NVIDIA's libraries use them. The module table
//! (`6e163fbe-b958-444d-835c-e182aff1991e`), as cuFFT takes the function of a one-kernel module:
//! entry 7 calls back with each function of a module and answers how many there were (without
//! the table every cuFFT plan failed on the sim, `CUFFT_INTERNAL_ERROR`: `jnp.fft` in JAX,
//! `torch.fft` in PyTorch). The context table (`21318c60-9714-3248-8ca6-41ff7324c8f2`), as cuBLAS
//! keys its triangular solves' workspaces by stream: entry 51 gives the stream a handle names,
//! entry 39 its id (without them every `trsm` failed: `solve_triangular` in JAX).
//!
//! Build the library first: `cargo build -p tessera-sim-driver && cargo test -p tessera-sim-driver --test tools_tables`.

use std::ffi::{CStr, c_int, c_uint, c_void};

use tessera_sim_testkit::SimNode;

mod common;
use common::{Handle, INVALID_HANDLE, INVALID_VALUE, NOT_FOUND, SUCCESS, function};

/// Calls an export by name with the C signature given.
macro_rules! call {
    ($lib:expr, $name:ident($($arg:expr),* $(,)?) as fn($($t:ty),* $(,)?)) => {{
        let f: libloading::Symbol<unsafe extern "C" fn($($t),*) -> u32> =
            // SAFETY: the symbol has this C signature (cuda.h 12.9).
            unsafe { $lib.get(stringify!($name).as_bytes()) }.expect(stringify!($name));
        // SAFETY: the arguments are valid for that signature.
        unsafe { f($($arg),*) }
    }};
}

const TOOLS_MODULE: u128 = 0x6e163fbe_b958_444d_835c_e182aff1991e;
const TOOLS_CONTEXT: u128 = 0x21318c60_9714_3248_8ca6_41ff7324c8f2;

/// A served table by UUID: its words.
fn table(cu: &libloading::Library, id: u128) -> *const usize {
    let (mut table, id) = (std::ptr::null::<usize>(), id.to_be_bytes());
    let rc = call!(cu, cuGetExportTable(&mut table, id.as_ptr()) as fn(*mut *const usize, *const u8));
    assert_eq!(rc, SUCCESS, "the table is served");
    table
}

/// Entry 7: (context, module, callback, data) -> the number of functions called back.
type ModuleFunctions = unsafe extern "C" fn(
    Handle,
    Handle,
    Option<unsafe extern "C" fn(*mut c_void, Handle, Handle)>,
    *mut c_void,
) -> c_int;

/// The callback: pushes each function onto the `Vec<Handle>` its data points at.
unsafe extern "C" fn collect(data: *mut c_void, f: Handle, _module: Handle) {
    // SAFETY: the test passes a live Vec<Handle> as the data.
    unsafe { (*data.cast::<Vec<Handle>>()).push(f) };
}

const TWO_ENTRIES: &CStr = c".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry fft_a_3us(\n)\n{\n ret;\n}\n.visible .entry fft_b_7us(\n)\n{\n ret;\n}\n";
const CUBIN: &CStr = c"\x7fELF an opaque cubin";

#[test]
fn the_tools_module_table_lists_a_modules_functions() {
    let node = SimNode::new();
    node.run_isolated("the_tools_module_table_lists_a_modules_functions", || {
        // SAFETY: loading the simulated driver runs no initializers.
        let cu = unsafe { libloading::Library::new(node.cuda_path()) }.expect("load libcuda.so.1");
        let mut ctx = std::ptr::null_mut();
        assert_eq!(call!(cu, cuInit(0) as fn(c_uint)), SUCCESS);
        assert_eq!(call!(cu, cuCtxCreate_v2(&mut ctx, 0, 0) as fn(*mut Handle, c_uint, i32)), SUCCESS);
        let table = table(&cu, TOOLS_MODULE);
        // SAFETY: a served table starts with its size in bytes; cuFFT needs entry 7 in it.
        let size = unsafe { *table };
        assert!(size > 7 * 8, "size word {size}");
        // SAFETY: entry 7 is within the table (checked above) and has this signature.
        let functions: ModuleFunctions = unsafe { std::mem::transmute(*table.add(7)) };
        let list = |module: Handle| {
            let mut seen: Vec<Handle> = Vec::new();
            // SAFETY: the callback and its data are valid for the call.
            let n = unsafe { functions(ctx, module, Some(collect), (&mut seen as *mut Vec<Handle>).cast()) };
            (n, seen)
        };

        // A PTX module: each entry, the same functions cuModuleGetFunction gives.
        let a = function(&cu, TWO_ENTRIES, "fft_a_3us");
        let mut module = std::ptr::null_mut();
        assert_eq!(call!(cu, cuFuncGetModule(&mut module, a) as fn(*mut Handle, Handle)), SUCCESS);
        let mut b = std::ptr::null_mut();
        let rc =
            call!(cu, cuModuleGetFunction(&mut b, module, c"fft_b_7us".as_ptr()) as fn(*mut Handle, Handle, *const i8));
        assert_eq!(rc, SUCCESS);
        let (n, mut seen) = list(module);
        seen.sort();
        let mut both = vec![a, b];
        both.sort();
        assert_eq!((n, seen), (2, both), "both entries, counted");

        // A cubin: one function stands for its kernels, handed back alike each time, and usable.
        let mut opaque = std::ptr::null_mut();
        let rc = call!(cu, cuModuleLoadData(&mut opaque, CUBIN.as_ptr().cast()) as fn(*mut Handle, *const c_void));
        assert_eq!(rc, SUCCESS);
        let (n, seen) = list(opaque);
        assert_eq!((n, seen.len()), (1, 1), "cuFFT checks for one");
        assert_eq!(list(opaque).1, seen, "the same function again");
        let mut owner = std::ptr::null_mut();
        assert_eq!(call!(cu, cuFuncGetModule(&mut owner, seen[0]) as fn(*mut Handle, Handle)), SUCCESS);
        assert_eq!(owner, opaque, "a function of that module");
        let rc = common::launch_kernel(&cu, "cuLaunchKernel", seen[0], 32, std::ptr::null_mut());
        assert_eq!(rc, SUCCESS, "it launches");
        assert_eq!(call!(cu, cuCtxSynchronize() as fn()), SUCCESS);

        // No callback: the count alone. Not a module: none.
        // SAFETY: a null callback is never called.
        assert_eq!(unsafe { functions(ctx, module, None, std::ptr::null_mut()) }, 2);
        assert_eq!(list(0xdead_0000 as Handle), (0, Vec::new()), "not a module");
        let mut none: *const usize = std::ptr::null();
        let unknown = 0xf8cff951_2146_8b4e_b9e2_fb469e7c0dd9u128.to_be_bytes();
        let rc = call!(cu, cuGetExportTable(&mut none, unknown.as_ptr()) as fn(*mut *const usize, *const u8));
        assert_eq!(rc, NOT_FOUND, "other tables are still not served");
    });
}

/// Entry 51: (context, stream handle, out stream, per-thread flag).
type ToolsStream = unsafe extern "C" fn(Handle, Handle, *mut Handle, c_int) -> u32;
/// Entry 39: (context, stream, out id).
type ToolsStreamId = unsafe extern "C" fn(Handle, Handle, *mut u64) -> u32;

#[test]
fn the_tools_context_table_resolves_streams() {
    let node = SimNode::new();
    node.run_isolated("the_tools_context_table_resolves_streams", || {
        // SAFETY: loading the simulated driver runs no initializers.
        let cu = unsafe { libloading::Library::new(node.cuda_path()) }.expect("load libcuda.so.1");
        let (mut ctx, mut s) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(call!(cu, cuInit(0) as fn(c_uint)), SUCCESS);
        assert_eq!(call!(cu, cuCtxCreate_v2(&mut ctx, 0, 0) as fn(*mut Handle, c_uint, i32)), SUCCESS);
        assert_eq!(call!(cu, cuStreamCreate(&mut s, 1) as fn(*mut Handle, c_uint)), SUCCESS);
        let t = table(&cu, TOOLS_CONTEXT);
        // SAFETY: the table has 95 words; entries 39 and 51 have these signatures.
        let (stream, stream_id): (ToolsStream, ToolsStreamId) = unsafe {
            (
                std::mem::transmute::<usize, ToolsStream>(*t.add(51)),
                std::mem::transmute::<usize, ToolsStreamId>(*t.add(39)),
            )
        };
        // The null stream, the per-thread stream's handle (2) and a created stream: each the
        // stream named, with the id cuStreamGetId gives.
        for (h, per_thread) in [(std::ptr::null_mut(), 0), (2 as Handle, 1), (s, 0)] {
            let (mut got, mut id, mut want) = (0x1 as Handle, 0u64, 1u64);
            // SAFETY: valid out-pointers; the handles go to the driver.
            unsafe {
                assert_eq!(stream(ctx, h, &mut got, per_thread), SUCCESS, "stream {h:?}");
                assert_eq!(stream_id(ctx, got, &mut id), SUCCESS);
            }
            assert_eq!(got, h);
            assert_eq!(call!(cu, cuStreamGetId(h, &mut want) as fn(Handle, *mut u64)), SUCCESS);
            assert_eq!(id, want, "the stream's id");
        }
        // SAFETY: as above; the driver checks the handle and the out-pointer.
        unsafe {
            let mut got = std::ptr::null_mut();
            assert_eq!(stream(ctx, 0xdead_0000 as Handle, &mut got, 0), INVALID_HANDLE, "not a stream");
            assert_eq!(stream(ctx, s, std::ptr::null_mut(), 0), INVALID_VALUE, "no out-pointer");
        }
    });
}
