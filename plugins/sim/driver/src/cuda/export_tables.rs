//! `cuGetExportTable`: the driver's private tables, which the CUDA runtime (libcudart 12.x) asks
//! for by UUID right after it has looked the public functions up, and without which it refuses to
//! run. A table is an array of words: most begin with their own size in bytes, then function
//! pointers; the context-local-storage one begins with its functions and ends with a null word.
//!
//! Which tables exist, their layouts and what each entry must do are documented by open
//! re-implementations of the driver; this is our own implementation of those facts. The entries
//! the runtime depends on do what a real driver does: module loading from the runtime's fat
//! binaries, the primary context, context-local storage (with destructors run at teardown), the
//! integrity check ([`super::integrity`]) and the context checks. An entry whose meaning is not
//! known answers `CUDA_ERROR_NOT_SUPPORTED` (and says so under `TESSERA_SIM_TRACE`) instead of
//! being a null word the runtime would jump to. A table the sim does not have is
//! `CUDA_ERROR_NOT_FOUND`, as a real driver answers for tables it does not have.

use std::ffi::{c_int, c_uchar, c_uint, c_void};
use std::ptr;

use tessera_abi::cuda_exports;

use super::context::{self, StorageDtor};
use super::init::driver;
use super::{CUresult, INVALID_CONTEXT, INVALID_VALUE, NOT_FOUND, NOT_SUPPORTED, R, handles, put, run, sys, trace};

/// A table as the runtime reads it: words (sizes and function pointers).
#[repr(transparent)]
struct Table<const N: usize>([*const (); N]);

// SAFETY: the tables are immutable after initialization; they hold function addresses and
// integers only.
unsafe impl<const N: usize> Sync for Table<N> {}

impl<const N: usize> Table<N> {
    fn start(&'static self) -> *const c_void {
        self.0.as_ptr().cast()
    }
}

/// The first word of most tables: the table's size in bytes.
const fn size_word<const N: usize>() -> *const () {
    ptr::without_provenance(N * size_of::<usize>())
}

/// An entry whose meaning is not known: takes nothing, changes nothing, answers NOT_SUPPORTED
/// (under the C calling convention a caller may pass any arguments to it).
extern "C" fn unknown_entry<const TABLE: usize, const INDEX: usize>() -> CUresult {
    trace::line(format_args!("export table {} entry {INDEX} called (not modelled)", KNOWN[TABLE].0));
    NOT_SUPPORTED
}

macro_rules! unknown {
    ($table:expr, $index:expr) => {
        unknown_entry::<$table, $index> as *const ()
    };
}

// ---- The runtime interface (6bd5fb6c-5bf4-e74a-8987-d93912fd9df9) ----------------------------

/// Entry 1: a module from a fat binary the runtime registered (`__fatBinC_Wrapper_t`).
unsafe extern "C" fn module_from_fatbin(module: *mut sys::CUmodule, wrapper: *const c_void) -> CUresult {
    // SAFETY: the runtime passes an out-pointer and an image it registered.
    run(|| unsafe { super::module::load_data(module, wrapper) })
}

/// Entry 2: a device's primary context, made but neither retained nor activated.
unsafe extern "C" fn primary_context(pctx: *mut sys::CUcontext, dev: c_int) -> CUresult {
    run(|| {
        super::need(pctx)?;
        let h = context::primary_handle(dev)?;
        // SAFETY: pctx is the caller's out-pointer (checked above).
        unsafe { put(pctx, handles::as_ptr(h)) }
    })
}

/// Entry 6: as entry 1, with JIT options (ignored: nothing is compiled).
unsafe extern "C" fn module_from_fatbin_ext(
    module: *mut sys::CUmodule,
    wrapper: *const c_void,
    _options: *mut c_void,
    _values: *mut c_void,
    _count: c_uint,
) -> CUresult {
    // SAFETY: the runtime passes an out-pointer and an image it registered.
    run(|| unsafe { super::module::load_data(module, wrapper) })
}

/// Entry 7: a notification with nothing to do on the sim.
extern "C" fn runtime_notice(_arg: usize) {}

/// Entry 8: a module from a fat binary's own header (the image first, then the out-pointer).
unsafe extern "C" fn module_from_fatbin_header(
    image: *const c_void,
    module: *mut sys::CUmodule,
    _options: *mut c_void,
    _values: *mut c_void,
    _count: c_uint,
) -> CUresult {
    // SAFETY: the runtime passes an image and an out-pointer.
    run(|| unsafe { super::module::load_data(module, image) })
}

/// Entry 12: load the JIT compilers (the sim compiles nothing).
extern "C" fn load_compilers() -> CUresult {
    CUresult::CUDA_SUCCESS
}

static CUDART_INTERFACE: Table<13> = Table([
    size_word::<13>(),
    module_from_fatbin as *const (),
    primary_context as *const (),
    unknown!(0, 3),
    unknown!(0, 4),
    unknown!(0, 5),
    module_from_fatbin_ext as *const (),
    runtime_notice as *const (),
    module_from_fatbin_header as *const (),
    unknown!(0, 9),
    unknown!(0, 10),
    unknown!(0, 11),
    load_compilers as *const (),
]);

// ---- Tools (profiler) tables -----------------------------------------------------------------

/// Entry 2 of the tools TLS table: the calling thread's current context, as `cuCtxGetCurrent`
/// (the runtime inside cuBLAS calls it before its first handle is made, and follows the pointer).
unsafe extern "C" fn tls_current_context(pctx: *mut sys::CUcontext) -> CUresult {
    // SAFETY: the same contract as cuCtxGetCurrent: pctx is the caller's out-pointer.
    unsafe { context::cuCtxGetCurrent(pctx) }
}

/// The tools' thread-local interface: a size word, then functions.
static TOOLS_TLS: Table<4> =
    Table([size_word::<4>(), unknown!(1, 1), tls_current_context as *const (), unknown!(1, 3)]);

/// Buffers the runtime's callback hooks live in (written by the runtime, read by tools).
struct HookBuffer<const N: usize>(std::cell::UnsafeCell<[u32; N]>);

// SAFETY: the driver never reads or writes the buffers; they are the runtime's memory.
unsafe impl<const N: usize> Sync for HookBuffer<N> {}

static HOOKS_1: HookBuffer<1024> = HookBuffer(std::cell::UnsafeCell::new([0; 1024]));
static HOOKS_2: HookBuffer<14> = HookBuffer(std::cell::UnsafeCell::new([0; 14]));

/// # Safety
/// `p` and `size` must be null or valid out-pointers.
unsafe fn give_buffer<const N: usize>(b: &'static HookBuffer<N>, p: *mut *mut c_void, size: *mut usize) {
    if !p.is_null() && !size.is_null() {
        // SAFETY: both checked non-null; valid for writes by the caller's contract.
        unsafe {
            *p = b.0.get().cast();
            *size = N;
        }
    }
}

unsafe extern "C" fn hook_buffer_1(p: *mut *mut c_void, size: *mut usize) {
    // SAFETY: the caller's out-pointers.
    unsafe { give_buffer(&HOOKS_1, p, size) }
}

unsafe extern "C" fn hook_buffer_2(p: *mut *mut c_void, size: *mut usize) {
    // SAFETY: the caller's out-pointers.
    unsafe { give_buffer(&HOOKS_2, p, size) }
}

static TOOLS_RUNTIME_CALLBACK_HOOKS: Table<7> = Table([
    size_word::<7>(),
    unknown!(2, 1),
    hook_buffer_1 as *const (),
    unknown!(2, 3),
    unknown!(2, 4),
    unknown!(2, 5),
    hook_buffer_2 as *const (),
]);

// ---- Context-local storage -------------------------------------------------------------------

unsafe extern "C" fn storage_put(
    ctx: sys::CUcontext,
    key: *mut c_void,
    value: *mut c_void,
    dtor: Option<StorageDtor>,
) -> CUresult {
    run(|| context::storage_put(ctx, key as usize, value as usize, dtor))
}

unsafe extern "C" fn storage_delete(ctx: sys::CUcontext, key: *mut c_void) -> CUresult {
    run(|| context::storage_delete(ctx, key as usize))
}

unsafe extern "C" fn storage_get(value: *mut *mut c_void, ctx: sys::CUcontext, key: *mut c_void) -> CUresult {
    run(|| {
        super::need(value)?;
        let v = context::storage_get(ctx, key as usize)?;
        // SAFETY: value is the caller's out-pointer (checked above).
        unsafe { put(value, handles::as_ptr(v)) }
    })
}

/// No size word: three functions and a null terminator.
static CONTEXT_LOCAL_STORAGE: Table<4> =
    Table([storage_put as *const (), storage_delete as *const (), storage_get as *const (), ptr::null()]);

// ---- Context creation, heap, device extensions -------------------------------------------------

unsafe extern "C" fn ctx_create_bypass(pctx: *mut sys::CUcontext, flags: c_uint, dev: c_int) -> CUresult {
    // SAFETY: the caller's out-pointer; cuCtxCreate_v2 has this signature.
    unsafe { super::context::cuCtxCreate_v2(pctx, flags, dev) }
}

static CTX_CREATE_BYPASS: Table<2> = Table([size_word::<2>(), ctx_create_bypass as *const ()]);

/// The driver's host heap for the runtime: not modelled.
static HEAP_ACCESS: Table<3> = Table([size_word::<3>(), unknown!(5, 1), unknown!(5, 2)]);

/// Entry 13: a per-device flag real drivers answer 0 for on the GPUs the sim models.
unsafe extern "C" fn device_flag(result: *mut c_uchar, dev: c_int) -> CUresult {
    run(|| {
        driver()?.device(dev)?;
        // SAFETY: result is the caller's out-pointer (put checks it).
        unsafe { put(result, 0) }
    })
}

static DEVICE_EXTENDED_RT: Table<26> = Table([
    size_word::<26>(),
    unknown!(6, 1),
    unknown!(6, 2),
    unknown!(6, 3),
    unknown!(6, 4),
    unknown!(6, 5),
    unknown!(6, 6),
    unknown!(6, 7),
    unknown!(6, 8),
    unknown!(6, 9),
    unknown!(6, 10),
    unknown!(6, 11),
    unknown!(6, 12),
    device_flag as *const (),
    unknown!(6, 14),
    unknown!(6, 15),
    unknown!(6, 16),
    unknown!(6, 17),
    unknown!(6, 18),
    unknown!(6, 19),
    unknown!(6, 20),
    unknown!(6, 21),
    unknown!(6, 22),
    unknown!(6, 23),
    unknown!(6, 24),
    unknown!(6, 25),
]);

// ---- Integrity and context checks ------------------------------------------------------------

/// Entry 1: the keyed digest the runtime checks the driver with.
unsafe extern "C" fn integrity_check(version: c_uint, unix_seconds: u64, result: *mut [u64; 2]) -> CUresult {
    run(|| {
        super::need(result)?;
        let d = driver()?;
        let driver_version = d.node.description().cuda_driver_version;
        let devices = d
            .devices
            .iter()
            .map(|dev| (dev.uuid, dev.ident.pci_domain as i32, dev.ident.pci_bus as i32, dev.ident.pci_device as i32))
            .collect();
        let facts = super::integrity::Facts {
            version,
            unix_seconds,
            driver_version,
            pid: std::process::id(),
            // SAFETY: pthread_self has no preconditions.
            thread: unsafe { libc::pthread_self() } as u32,
            cudart_table: CUDART_INTERFACE.start() as usize,
            integrity_table: INTEGRITY_CHECK.start() as usize,
            check_fn: INTEGRITY_CHECK.0[1] as usize,
            devices,
        };
        // SAFETY: result is the caller's out-pointer (checked above).
        unsafe { put(result, super::integrity::answer(&facts)) }
    })
}

static INTEGRITY_CHECK: Table<3> = Table([size_word::<3>(), integrity_check as *const (), unknown!(7, 2)]);

/// Entry 2: whether a context needs the runtime's attention; nothing does on the sim.
unsafe extern "C" fn context_check(_ctx: sys::CUcontext, result: *mut u32, _detail: *mut *const c_void) -> CUresult {
    // SAFETY: result is the caller's out-pointer (put checks it).
    run(|| unsafe { put(result, 0) })
}

/// Entry 3: a flag word, 0 on real drivers.
extern "C" fn context_flag() -> u32 {
    0
}

static CONTEXT_CHECKS: Table<4> =
    Table([size_word::<4>(), unknown!(8, 1), context_check as *const (), context_flag as *const ()]);

// ---- Tools context (21318c60-9714-3248-8ca6-41ff7324c8f2) ------------------------------------

/// Entry 4: a context's unique id, as `cuCtxGetId` (cuBLAS asks before its first GEMM).
unsafe extern "C" fn tools_context_id(ctx: sys::CUcontext, id: *mut u64) -> CUresult {
    // SAFETY: the same contract as cuCtxGetId: id is the caller's out-pointer.
    unsafe { context::cuCtxGetId(ctx, id) }
}

/// Entry 51: the driver's stream for a stream handle the caller holds in `ctx` (the default
/// streams' special handles too; the last argument says whether it is the per-thread one), as
/// the handle itself once it names a stream. cuBLAS asks, then entry 39 for the stream's id, to
/// key the workspaces of its triangular solves by stream (and by thread on the per-thread
/// stream); without them every `trsm` failed (`CUBLAS_STATUS_INTERNAL_ERROR`).
unsafe extern "C" fn tools_stream(
    _ctx: sys::CUcontext,
    stream: sys::CUstream,
    out: *mut sys::CUstream,
    _per_thread: c_int,
) -> CUresult {
    let mut id = 0;
    // SAFETY: a valid out-pointer for the id; the handle is checked by the call.
    match unsafe { super::stream::cuStreamGetId(stream, &mut id) } {
        // SAFETY: out is the caller's out-pointer (null or misaligned: INVALID_VALUE).
        CUresult::CUDA_SUCCESS => run(|| unsafe { put(out, stream) }),
        e => e,
    }
}

/// Entry 39: the id of a stream entry 51 gave, as `cuStreamGetId`.
unsafe extern "C" fn tools_stream_id(_ctx: sys::CUcontext, stream: sys::CUstream, id: *mut u64) -> CUresult {
    // SAFETY: the same contract as cuStreamGetId: id is the caller's out-pointer.
    unsafe { super::stream::cuStreamGetId(stream, id) }
}

/// Words `1..N` of a table whose entries are all unknown, after its size word.
macro_rules! unknown_entries {
    ($table:expr, $n:literal; $($index:literal)*) => {
        [size_word::<$n>(), $(unknown!($table, $index)),*]
    };
}

/// The tools' context interface: a size word and 94 functions (as recent drivers serve it).
static TOOLS_CONTEXT: Table<95> = Table({
    let mut t = unknown_entries!(9, 95; 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94);
    t[4] = tools_context_id as *const ();
    t[39] = tools_stream_id as *const ();
    t[51] = tools_stream as *const ();
    t
});

// ---- The GPU's layout (1734dc26-800d-4745-8726-c0f1e7dd8bca) ----------------------------------

/// Each device's TPC-to-GPC map ([`super::occupancy::tpc_gpcs`]), by ordinal, made once: the
/// driver's memory, which callers read and never free.
static GPC_MAPS: std::sync::OnceLock<Vec<Box<[u8]>>> = std::sync::OnceLock::new();

/// Entry 4: the current context's device's layout: one byte per TPC (two SMs), the GPC it is
/// in, and a second word handed back to entry 13 (the sim writes the map's length). cuBLASLt
/// asks before it picks a kernel with thread-block clusters (Hopper's half-precision GEMMs) to
/// place clusters GPC by GPC; it looks the table up once and calls this entry without checking
/// the lookup, so a driver without the table crashes it.
unsafe extern "C" fn gpc_map(map: *mut *const u8, handle: *mut usize) -> CUresult {
    run(|| {
        super::need(map)?;
        super::need(handle)?;
        let devices = &driver()?.devices;
        let dev = context::current()?.dev;
        let maps = GPC_MAPS.get_or_init(|| {
            devices.iter().map(|d| super::occupancy::tpc_gpcs(d.sm_count, d.model.cc_major).into()).collect()
        });
        let m = maps.get(usize::try_from(dev.ordinal).map_err(|_| INVALID_CONTEXT)?).ok_or(INVALID_CONTEXT)?;
        // SAFETY: both are the caller's out-pointers (checked above); the map lives as long as
        // the process.
        unsafe {
            put(map, m.as_ptr())?;
            put(handle, m.len())
        }
    })
}

/// Entry 13: hand back what entry 4 gave; the map is the driver's, kept for later calls.
extern "C" fn gpc_map_release(_map: *const u8, _handle: usize) -> CUresult {
    CUresult::CUDA_SUCCESS
}

/// A size word and 15 entries. The real table's length is not known: cuBLASLt calls entries 4
/// and 13 (CUPTI and its profiler libraries ask for the table too, for entries not known here).
static GPU_LAYOUT: Table<16> = Table({
    let mut t = unknown_entries!(10, 16; 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    t[4] = gpc_map as *const ();
    t[13] = gpc_map_release as *const ();
    t
});

// ---- Tools' modules (6e163fbe-b958-444d-835c-e182aff1991e) ----------------------------------

/// What entry 7 calls back with each function: the caller's data, the function, its module.
type EachFunction = Option<unsafe extern "C" fn(*mut c_void, sys::CUfunction, sys::CUmodule)>;

/// Entry 7: calls `each` with every function of `module` (in `ctx`, which the sim does not
/// need: a module has one context) and answers how many there were, not a `CUresult`: cuFFT
/// takes a function of a one-kernel module so, keeping what it is handed and checking for 1; a
/// bad module is 0. A cubin or fatbin module has one function standing for its kernels
/// ([`super::module::functions_of`]).
unsafe extern "C" fn module_functions(
    _ctx: sys::CUcontext,
    module: sys::CUmodule,
    each: EachFunction,
    data: *mut c_void,
) -> c_int {
    crate::ffi::guard(0, || {
        let Ok(funcs) = super::module::functions_of(module as usize) else { return 0 };
        if let Some(f) = each {
            for h in &funcs {
                // SAFETY: the caller's callback, called with its own data, as its contract says.
                unsafe { f(data, handles::as_ptr(*h), module) };
            }
        }
        c_int::try_from(funcs.len()).unwrap_or(c_int::MAX)
    })
}

/// A size word and 15 entries (the real table's length is not known; cuFFT checks it holds
/// entry 7, the one it calls).
static TOOLS_MODULE: Table<16> = Table({
    let mut t = unknown_entries!(11, 16; 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    t[7] = module_functions as *const ();
    t
});

// ---- The lookup ------------------------------------------------------------------------------

/// A table served: its name, UUID and where it starts.
type Known = (&'static str, [u8; 16], fn() -> *const c_void);

/// Every table served: its name (for traces), UUID (bytes as the runtime passes them) and start.
/// `unknown!(T, _)` refers to a table by its index here.
static KNOWN: [Known; 12] = [
    ("CUDART_INTERFACE", uuid(0x6bd5fb6c_5bf4_e74a_8987_d93912fd9df9), || CUDART_INTERFACE.start()),
    ("TOOLS_TLS", uuid(0x42d85a81_23f6_cb47_8298_f6e78a3aecdc), || TOOLS_TLS.start()),
    ("TOOLS_RUNTIME_CALLBACK_HOOKS", uuid(0xa094798c_2e74_2e74_93f2_0800200c0a66), || {
        TOOLS_RUNTIME_CALLBACK_HOOKS.start()
    }),
    ("CONTEXT_LOCAL_STORAGE", uuid(0xc693336e_1121_df11_a8c3_68f355d89593), || CONTEXT_LOCAL_STORAGE.start()),
    ("CTX_CREATE_BYPASS", uuid(0x0ca50b8c_1004_929a_89a7_d0df10e77286), || CTX_CREATE_BYPASS.start()),
    ("HEAP_ACCESS", uuid(0x195bcbf4_d67d_024a_acc5_1d29cea631ae), || HEAP_ACCESS.start()),
    ("DEVICE_EXTENDED_RT", uuid(0xb10541e1_f7c7_c74a_9f64_f223be99f1e2), || DEVICE_EXTENDED_RT.start()),
    ("INTEGRITY_CHECK", uuid(0xd4082055_bde6_704b_8d34_ba123c66e1f2), || INTEGRITY_CHECK.start()),
    ("CONTEXT_CHECKS", uuid(0x263e8860_7cd2_6143_92f6_bbd5006dfa7e), || CONTEXT_CHECKS.start()),
    ("TOOLS_CONTEXT", uuid(0x21318c60_9714_3248_8ca6_41ff7324c8f2), || TOOLS_CONTEXT.start()),
    ("GPU_LAYOUT", uuid(0x1734dc26_800d_4745_8726_c0f1e7dd8bca), || GPU_LAYOUT.start()),
    ("TOOLS_MODULE", uuid(0x6e163fbe_b958_444d_835c_e182aff1991e), || TOOLS_MODULE.start()),
];

/// A UUID's bytes in the order it is written.
const fn uuid(v: u128) -> [u8; 16] {
    v.to_be_bytes()
}

fn uuid_text(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// The table with this UUID.
fn find(id: &[u8; 16]) -> R<*const c_void> {
    match KNOWN.iter().find(|k| &k.1 == id) {
        Some(k) => Ok((k.2)()),
        None => {
            trace::line(format_args!("cuGetExportTable({}): no such table", uuid_text(id)));
            Err(NOT_FOUND)
        }
    }
}

cuda_exports! {
    fn cuGetExportTable(ppExportTable, pExportTableId) {
        run(|| {
            if ppExportTable.is_null() || pExportTableId.is_null() {
                return Err(INVALID_VALUE);
            }
            // SAFETY: non-null; the caller passes a CUuuid (16 bytes, any value valid).
            let id = unsafe { super::get(pExportTableId) }?;
            let id: [u8; 16] = id.bytes.map(|b| b as u8);
            let table = find(&id)?;
            // SAFETY: ppExportTable is the caller's out-pointer (checked non-null above).
            unsafe { put(ppExportTable, table) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(id: u128) -> R<*const usize> {
        find(&uuid(id)).map(|p| p.cast())
    }

    #[test]
    fn tables_start_with_their_size() {
        for (name, id, start) in &KNOWN {
            let t = start().cast::<usize>();
            // SAFETY: every table has at least one word.
            let first = unsafe { *t };
            if *name == "CONTEXT_LOCAL_STORAGE" {
                // SAFETY: that table has four words.
                assert_eq!(unsafe { *t.add(3) }, 0, "{name} ends with a null word");
            } else {
                assert!(first % 8 == 0 && (16..=95 * 8).contains(&first), "{name}: size word {first}");
            }
            assert_eq!(find(id).ok(), Some(start()));
        }
        // SAFETY: the CUDART table has 13 words.
        assert_eq!(unsafe { *table(0x6bd5fb6c_5bf4_e74a_8987_d93912fd9df9).unwrap() }, 13 * 8);
    }

    #[test]
    fn the_gpu_layout_table_serves_its_map_and_release_entries() {
        let t = table(0x1734dc26_800d_4745_8726_c0f1e7dd8bca).expect("cuBLASLt calls it without checking the lookup");
        // SAFETY: the table has 16 words.
        let words = unsafe { std::slice::from_raw_parts(t, 16) };
        assert_eq!(words[0], 16 * 8);
        assert_eq!(words[4], gpc_map as *const () as usize);
        assert_eq!(words[13], gpc_map_release as *const () as usize);
        assert!(words.iter().all(|&w| w != 0), "no null word to jump to");
        let mut handle = 0usize;
        // SAFETY: a null map out-pointer is refused before anything is written.
        assert_eq!(unsafe { gpc_map(ptr::null_mut(), &mut handle) }, INVALID_VALUE);
        assert_eq!(gpc_map_release(ptr::null(), 0), CUresult::CUDA_SUCCESS);
    }

    #[test]
    fn unknown_tables_are_not_found() {
        assert_eq!(table(0xf8cff951_2146_8b4e_b9e2_fb469e7c0dd9).err(), Some(NOT_FOUND));
        assert_eq!(table(0).err(), Some(NOT_FOUND));
    }

    #[test]
    fn uuid_bytes_are_in_written_order() {
        assert_eq!(uuid(0x6bd5fb6c_5bf4_e74a_8987_d93912fd9df9)[..4], [0x6b, 0xd5, 0xfb, 0x6c]);
        assert_eq!(uuid_text(&uuid(0x6bd5fb6c_5bf4_e74a_8987_d93912fd9df9)), "6bd5fb6c-5bf4-e74a-8987-d93912fd9df9");
    }

    #[test]
    fn unknown_entries_answer_not_supported() {
        assert_eq!(unknown_entry::<0, 3>(), NOT_SUPPORTED);
        assert_eq!(context_flag(), 0);
    }
}
