//! The CUDA half of the simulated driver, through its C ABI, as a program linked against
//! `libcuda.so.1` sees it.
//!
//! Each test runs in a process of its own against a node of its own (`SimNode::run_isolated`):
//! the driver keeps one node connection and one device list per process. The tests watch and drive
//! the node from the side through a second `Node` handle on the same state file, as `tessera-sim`
//! and other processes would (memory accounting, faults, MIG instances).
//!
//! Build the library first: `cargo build -p tessera-sim-driver && cargo test -p tessera-sim-driver --test cuda`.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tessera_sim_model::Node;
use tessera_sim_testkit::{SimNode, mig_and_whole};

mod common;
use common::*;

const GIB: u64 = 1 << 30;

/// The default node's board.
const H100_NAME: &str = "NVIDIA H100 80GB HBM3";
const H100_MEMORY: u64 = 81_559 * MIB;
const H100_RESERVED: u64 = 454 * MIB;
/// What a context takes (the description's default `context_overhead_mib`).
const CONTEXT_OVERHEAD: u64 = 256 * MIB;

type CUdeviceptr = u64;

/// The driver library, loaded as a program loads libcuda.so.1.
struct Cuda {
    lib: libloading::Library,
}

/// Calls an export by name with the C signature given: `call!(cu, cuInit(0) as fn(c_uint))`.
macro_rules! call {
    ($cu:expr, $name:ident($($arg:expr),* $(,)?) as fn($($t:ty),* $(,)?)) => {{
        let f: unsafe extern "C" fn($($t),*) -> u32 = $cu.sym(stringify!($name));
        // SAFETY: the symbol has this C signature (cuda.h 12.8) and the arguments are valid for it.
        unsafe { f($($arg),*) }
    }};
}

impl Cuda {
    fn load(node: &SimNode) -> Cuda {
        // SAFETY: loading the simulated driver runs no initializers (nothing runs at load time).
        let lib = unsafe { libloading::Library::new(node.cuda_path()) }.expect("load libcuda.so.1");
        Cuda { lib }
    }

    /// An exported function as a C function pointer of type `T`.
    fn sym<T: Copy>(&self, name: &str) -> T {
        // SAFETY: every caller names T as the symbol's C signature.
        unsafe { *self.lib.get::<T>(name.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}")) }
    }

    /// The raw address of an export (to compare with what `cuGetProcAddress` hands out).
    fn addr(&self, name: &str) -> *mut c_void {
        self.sym::<*mut c_void>(name)
    }

    fn init(&self) {
        assert_eq!(call!(self, cuInit(0) as fn(c_uint)), SUCCESS);
    }

    fn device_count(&self) -> i32 {
        let mut n = -1;
        assert_eq!(call!(self, cuDeviceGetCount(&mut n) as fn(*mut c_int)), SUCCESS);
        n
    }

    fn name(&self, dev: c_int) -> String {
        let mut buf = [0 as c_char; 128];
        assert_eq!(call!(self, cuDeviceGetName(buf.as_mut_ptr(), 128, dev) as fn(*mut c_char, c_int, c_int)), SUCCESS);
        // SAFETY: the driver NUL-terminates what it writes.
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
    }

    fn uuid(&self, dev: c_int) -> [u8; 16] {
        let mut u = [0u8; 16];
        assert_eq!(call!(self, cuDeviceGetUuid_v2(u.as_mut_ptr(), dev) as fn(*mut u8, c_int)), SUCCESS);
        u
    }

    fn attribute(&self, attr: c_int, dev: c_int) -> i32 {
        let mut v = -12345;
        assert_eq!(
            call!(self, cuDeviceGetAttribute(&mut v, attr, dev) as fn(*mut c_int, c_int, c_int)),
            SUCCESS,
            "attribute {attr}"
        );
        v
    }

    fn ctx_create(&self, dev: c_int) -> Handle {
        let mut ctx = std::ptr::null_mut();
        assert_eq!(call!(self, cuCtxCreate_v2(&mut ctx, 0, dev) as fn(*mut Handle, c_uint, c_int)), SUCCESS);
        ctx
    }

    fn set_current(&self, ctx: Handle) {
        assert_eq!(call!(self, cuCtxSetCurrent(ctx) as fn(Handle)), SUCCESS);
    }

    fn mem_info(&self) -> (u64, u64) {
        let (mut free, mut total) = (0usize, 0usize);
        assert_eq!(call!(self, cuMemGetInfo_v2(&mut free, &mut total) as fn(*mut usize, *mut usize)), SUCCESS);
        (free as u64, total as u64)
    }

    fn try_alloc(&self, bytes: u64) -> Result<CUdeviceptr, u32> {
        let mut p = 0;
        match call!(self, cuMemAlloc_v2(&mut p, bytes as usize) as fn(*mut CUdeviceptr, usize)) {
            SUCCESS => Ok(p),
            e => Err(e),
        }
    }

    fn alloc(&self, bytes: u64) -> CUdeviceptr {
        self.try_alloc(bytes).expect("cuMemAlloc")
    }

    fn free(&self, p: CUdeviceptr) {
        assert_eq!(call!(self, cuMemFree_v2(p) as fn(CUdeviceptr)), SUCCESS);
    }

    /// Makes a physical allocation (virtual memory management) of `bytes` with the properties
    /// `prop` (a CUmemAllocationProp): its handle, or the error.
    fn mem_create(&self, bytes: u64, prop: &[u8; 32]) -> Result<u64, u32> {
        let mut h = 0u64;
        match call!(
            self,
            cuMemCreate(&mut h, bytes as usize, prop.as_ptr().cast(), 0) as fn(*mut u64, usize, *const c_void, u64)
        ) {
            SUCCESS => Ok(h),
            e => Err(e),
        }
    }

    fn htod(&self, dst: CUdeviceptr, src: &[u8]) -> u32 {
        call!(self, cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) as fn(CUdeviceptr, *const c_void, usize))
    }

    fn dtoh(&self, dst: &mut [u8], src: CUdeviceptr) -> u32 {
        call!(self, cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) as fn(*mut c_void, CUdeviceptr, usize))
    }

    /// Loads an image and returns the function `name` of it.
    fn function(&self, image: &CStr, name: &str) -> Handle {
        function(&self.lib, image, name)
    }

    /// Launches `f` as one block of 128 threads on `stream`.
    fn launch(&self, f: Handle, stream: Handle) -> u32 {
        launch_kernel(&self.lib, "cuLaunchKernel", f, 128, stream)
    }

    fn stream(&self) -> Handle {
        let mut s = std::ptr::null_mut();
        assert_eq!(call!(self, cuStreamCreate(&mut s, 0) as fn(*mut Handle, c_uint)), SUCCESS);
        s
    }

    fn sync(&self, stream: Handle) -> u32 {
        call!(self, cuStreamSynchronize(stream) as fn(Handle))
    }

    fn event(&self, flags: c_uint) -> Handle {
        let mut e = std::ptr::null_mut();
        assert_eq!(call!(self, cuEventCreate(&mut e, flags) as fn(*mut Handle, c_uint)), SUCCESS);
        e
    }

    fn record(&self, event: Handle, stream: Handle) {
        assert_eq!(call!(self, cuEventRecord(event, stream) as fn(Handle, Handle)), SUCCESS);
    }

    fn elapsed(&self, start: Handle, end: Handle) -> Result<f32, u32> {
        let mut ms = -1.0f32;
        match call!(self, cuEventElapsedTime(&mut ms, start, end) as fn(*mut f32, Handle, Handle)) {
            SUCCESS => Ok(ms),
            e => Err(e),
        }
    }
}

/// Opaque images: any function name resolves.
const CUBIN: &CStr = c"\x7fELF opaque cubin";

/// Runs `body` in a process of its own (see the module's doc) against a default node, every
/// GPU visible, with the driver loaded.
fn with_driver(test_name: &str, body: impl FnOnce(&SimNode, &Cuda)) {
    with_driver_seeing(test_name, None, body);
}

/// As [`with_driver`], with CUDA_VISIBLE_DEVICES set to `devices` (unset: `None`).
fn with_driver_seeing(test_name: &str, devices: Option<&str>, body: impl FnOnce(&SimNode, &Cuda)) {
    let node = SimNode::new();
    node.run_isolated(test_name, || {
        visible(devices);
        let cu = Cuda::load(&node);
        body(&node, &cu);
    });
}

/// As [`with_driver`], after `cuInit` with a context on GPU 0, the body given the model.
fn with_context(test_name: &str, body: impl FnOnce(&Node, &Cuda)) {
    with_driver(test_name, |node, cu| {
        let m = model(node);
        cu.init();
        cu.ctx_create(0);
        body(&m, cu);
    });
}

/// As [`with_context`], the body also given the graph calls and a stream of its own.
fn with_graphs(test_name: &str, body: impl FnOnce(&Node, &Cuda, &Graphs, Handle)) {
    with_context(test_name, |m, cu| body(m, cu, &Graphs { cu }, cu.stream()));
}

/// Sets or clears CUDA_VISIBLE_DEVICES for this (isolated, single-threaded) process, before cuInit.
fn visible(v: Option<&str>) {
    // SAFETY: called at the start of an isolated child's body, before any thread that reads the
    // environment exists.
    unsafe {
        match v {
            Some(v) => std::env::set_var("CUDA_VISIBLE_DEVICES", v),
            None => std::env::remove_var("CUDA_VISIBLE_DEVICES"),
        }
    }
}

/// The model's 16 UUID bytes of a "GPU-…"/"MIG-…" string.
fn uuid_bytes(s: &str) -> [u8; 16] {
    let hex: String = s.split_once('-').unwrap().1.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

#[test]
fn default_node_enumerates_eight_h100() {
    with_driver("default_node_enumerates_eight_h100", |node, cu| {
        let m = model(node);
        // Before cuInit: only the version and error strings answer.
        let mut n = 0;
        assert_eq!(call!(cu, cuDeviceGetCount(&mut n) as fn(*mut c_int)), NOT_INITIALIZED);
        let mut v = 0;
        assert_eq!(call!(cu, cuDriverGetVersion(&mut v) as fn(*mut c_int)), SUCCESS);
        assert_eq!(v, 12080);
        assert_eq!(call!(cu, cuInit(1) as fn(c_uint)), INVALID_VALUE);
        cu.init();
        assert_eq!(cu.device_count(), 8);
        for dev in 0..8 {
            assert_eq!(cu.name(dev), H100_NAME);
            assert_eq!(cu.uuid(dev), uuid_bytes(&m.gpus()[dev as usize].uuid));
        }
        let mut d = 0;
        assert_eq!(call!(cu, cuDeviceGet(&mut d, 8) as fn(*mut c_int, c_int)), INVALID_DEVICE);
        assert_eq!(call!(cu, cuDeviceGet(std::ptr::null_mut(), 0) as fn(*mut c_int, c_int)), INVALID_VALUE);
        // Attributes from the catalog.
        assert_eq!(cu.attribute(16, 0), 132); // MULTIPROCESSOR_COUNT
        assert_eq!((cu.attribute(75, 0), cu.attribute(76, 0)), (9, 0)); // compute capability
        assert_eq!(cu.attribute(13, 0), 1_980_000); // CLOCK_RATE, kHz
        assert_eq!(cu.attribute(36, 0), 2_619_000); // MEMORY_CLOCK_RATE, kHz
        assert_eq!(cu.attribute(37, 0), 5120); // GLOBAL_MEMORY_BUS_WIDTH
        assert_eq!(cu.attribute(38, 0), 52_428_800); // L2_CACHE_SIZE
        assert_eq!(cu.attribute(10, 0), 32); // WARP_SIZE
        assert_eq!(cu.attribute(1, 0), 1024); // MAX_THREADS_PER_BLOCK
        assert_eq!(cu.attribute(97, 0), 232_448); // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        assert_eq!(cu.attribute(33, 0), 0x18); // PCI_BUS_ID
        assert_eq!(cu.attribute(33, 7), 0xdb);
        assert_eq!(cu.attribute(139, 0) as u32, 0x2330_10de); // GPU_PCI_DEVICE_ID
        assert_eq!(cu.attribute(115, 0), 1); // MEMORY_POOLS_SUPPORTED
        assert_eq!(cu.attribute(102, 0), 1); // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        assert_eq!(cu.attribute(83, 0), 1); // MANAGED_MEMORY
        assert_eq!(cu.attribute(41, 0), 1); // UNIFIED_ADDRESSING
        let mut x = 0;
        assert_eq!(call!(cu, cuDeviceGetAttribute(&mut x, 9999, 0) as fn(*mut c_int, c_int, c_int)), INVALID_VALUE);
        assert_eq!(call!(cu, cuDeviceGetAttribute(&mut x, 138, 0) as fn(*mut c_int, c_int, c_int)), INVALID_VALUE);
        // Memory, compute capability, PCI identity, peers.
        let mut total = 0usize;
        assert_eq!(call!(cu, cuDeviceTotalMem_v2(&mut total, 3) as fn(*mut usize, c_int)), SUCCESS);
        assert_eq!(total as u64, H100_MEMORY);
        let (mut major, mut minor) = (0, 0);
        assert_eq!(
            call!(cu, cuDeviceComputeCapability(&mut major, &mut minor, 0) as fn(*mut c_int, *mut c_int, c_int)),
            SUCCESS
        );
        assert_eq!((major, minor), (9, 0));
        let mut bus = [0 as c_char; 32];
        assert_eq!(call!(cu, cuDeviceGetPCIBusId(bus.as_mut_ptr(), 32, 2) as fn(*mut c_char, c_int, c_int)), SUCCESS);
        // SAFETY: NUL-terminated by the driver.
        let bus_id = unsafe { CStr::from_ptr(bus.as_ptr()) }.to_str().unwrap().to_string();
        assert_eq!(bus_id, "0000:3a:00.0");
        let mut back = -1;
        assert_eq!(call!(cu, cuDeviceGetByPCIBusId(&mut back, bus.as_ptr()) as fn(*mut c_int, *const c_char)), SUCCESS);
        assert_eq!(back, 2);
        let mut can = -1;
        assert_eq!(call!(cu, cuDeviceCanAccessPeer(&mut can, 0, 7) as fn(*mut c_int, c_int, c_int)), SUCCESS);
        assert_eq!(can, 1);
        assert_eq!(
            call!(cu, cuDeviceGetP2PAttribute(&mut can, 3, 0, 7) as fn(*mut c_int, c_int, c_int, c_int)),
            SUCCESS
        );
        assert_eq!(can, 1, "NVLink carries native atomics");
        // Error names and strings, for every code, and none for a made-up one.
        let mut s: *const c_char = std::ptr::null();
        assert_eq!(call!(cu, cuGetErrorName(719, &mut s) as fn(c_uint, *mut *const c_char)), SUCCESS);
        // SAFETY: a static string of the driver.
        assert_eq!(unsafe { CStr::from_ptr(s) }.to_str().unwrap(), "CUDA_ERROR_LAUNCH_FAILED");
        assert_eq!(call!(cu, cuGetErrorString(2, &mut s) as fn(c_uint, *mut *const c_char)), SUCCESS);
        // SAFETY: as above.
        assert_eq!(unsafe { CStr::from_ptr(s) }.to_str().unwrap(), "out of memory");
        assert_eq!(call!(cu, cuGetErrorString(12345, &mut s) as fn(c_uint, *mut *const c_char)), INVALID_VALUE);
        assert!(s.is_null());
    });
}

#[test]
fn visible_devices_reorder_and_filter() {
    let node = SimNode::new();
    node.run_isolated("visible_devices_reorder_and_filter", || {
        let m = model(&node);
        let uuid = |i: usize| m.gpus()[i].uuid.clone();
        // A full UUID, an index, and a unique UUID prefix, in that order.
        visible(Some(&format!("{},1,{}", uuid(3), &uuid(5)[..12])));
        let cu = Cuda::load(&node);
        cu.init();
        assert_eq!(cu.device_count(), 3);
        let order: Vec<[u8; 16]> = (0..3).map(|d| cu.uuid(d)).collect();
        assert_eq!(order, vec![uuid_bytes(&uuid(3)), uuid_bytes(&uuid(1)), uuid_bytes(&uuid(5))]);
        assert_eq!(cu.attribute(33, 0), 0x5d); // PCI bus of GPU 3
    });
}

#[test]
fn visible_devices_end_at_an_unknown_entry() {
    with_driver_seeing(
        "visible_devices_end_at_an_unknown_entry",
        Some("6,GPU-ffffffff-0000-0000-0000-000000000000,2"),
        |_, cu| {
            cu.init();
            assert_eq!(cu.device_count(), 1);
            assert_eq!(cu.attribute(33, 0), 0xba); // GPU 6
        },
    );
}

#[test]
fn visible_devices_empty_hides_every_device() {
    with_driver_seeing("visible_devices_empty_hides_every_device", Some(""), |_, cu| {
        assert_eq!(call!(cu, cuInit(0) as fn(c_uint)), NO_DEVICE);
        let mut n = 0;
        assert_eq!(call!(cu, cuDeviceGetCount(&mut n) as fn(*mut c_int)), NOT_INITIALIZED);
    });
}

#[test]
fn mem_get_info_moves_by_exactly_what_is_allocated() {
    with_driver("mem_get_info_moves_by_exactly_what_is_allocated", |node, cu| {
        let m = model(node);
        cu.init();
        let mut dummy = 0;
        assert_eq!(call!(cu, cuMemAlloc_v2(&mut dummy, 16) as fn(*mut CUdeviceptr, usize)), INVALID_CONTEXT);
        let before = m.memory_info(0, 0).unwrap();
        assert_eq!(before.used, 0);
        cu.ctx_create(0);
        assert_eq!(m.memory_info(0, 0).unwrap().used, CONTEXT_OVERHEAD, "a context charges its overhead");
        let (free0, total) = cu.mem_info();
        assert_eq!(total, H100_MEMORY);
        assert_eq!(free0, H100_MEMORY - H100_RESERVED - CONTEXT_OVERHEAD);
        // As the card holds them (docs/sim.md): 1 byte opens a 2 MiB chunk, 4 KiB goes into it,
        // more than 1 MiB takes whole 2 MiB pages.
        let sizes = [(1u64, 2 * MIB), (4096, 0), (100 * MIB + 3, 102 * MIB), (3 * GIB, 3 * GIB)];
        let mut ptrs = Vec::new();
        let mut held = 0;
        for (s, takes) in sizes {
            ptrs.push(cu.alloc(s));
            held += takes;
            assert_eq!(cu.mem_info().0, free0 - held);
            assert_eq!(m.memory_info(0, 0).unwrap().used, CONTEXT_OVERHEAD + held);
        }
        assert_eq!(cu.try_alloc(0), Err(INVALID_VALUE));
        for p in ptrs {
            cu.free(p);
        }
        assert_eq!(cu.mem_info().0, free0);
        assert_eq!(call!(cu, cuMemFree_v2(12345) as fn(CUdeviceptr)), INVALID_VALUE);
        // The legacy 32-bit entry points work on the same accounting.
        let (mut f32_, mut t32) = (0u32, 0u32);
        assert_eq!(call!(cu, cuMemGetInfo(&mut f32_, &mut t32) as fn(*mut c_uint, *mut c_uint)), SUCCESS);
        assert_eq!((f32_, t32), (u32::MAX, u32::MAX));
        let mut small = 0u32;
        assert_eq!(call!(cu, cuMemAlloc(&mut small, 1024) as fn(*mut c_uint, c_uint)), SUCCESS);
        assert_eq!(cu.mem_info().0, free0 - 2 * MIB, "a legacy allocation takes a page of its own");
        assert_eq!(call!(cu, cuMemFree(small) as fn(c_uint)), SUCCESS);
        assert_eq!(cu.mem_info().0, free0);
    });
}

#[test]
fn a_stream_answers_the_priority_and_flags_it_was_made_with() {
    with_context("a_stream_answers_the_priority_and_flags_it_was_made_with", |_, cu| {
        let query = |s: Handle| {
            let (mut priority, mut flags) = (7 as c_int, 7 as c_uint);
            assert_eq!(call!(cu, cuStreamGetPriority(s, &mut priority) as fn(Handle, *mut c_int)), SUCCESS);
            assert_eq!(call!(cu, cuStreamGetFlags(s, &mut flags) as fn(Handle, *mut c_uint)), SUCCESS);
            (priority, flags)
        };
        let mut s = std::ptr::null_mut();
        // CU_STREAM_NON_BLOCKING at priority -2 (within the range, -5 to 0).
        let create = call!(cu, cuStreamCreateWithPriority(&mut s, 1, -2) as fn(*mut Handle, c_uint, c_int));
        assert_eq!(create, SUCCESS);
        assert_eq!(query(s), (-2, 1));
        assert_eq!(query(cu.stream()), (0, 0));
        // The default (null) stream.
        assert_eq!(query(std::ptr::null_mut()), (0, 0));
        let null = std::ptr::null_mut();
        assert_eq!(call!(cu, cuStreamGetFlags(s, null) as fn(Handle, *mut c_uint)), INVALID_VALUE);
    });
}

#[test]
fn out_of_memory_at_the_physical_size_leaks_nothing() {
    with_context("out_of_memory_at_the_physical_size_leaks_nothing", |m, cu| {
        let (free, _) = cu.mem_info();
        assert_eq!(cu.try_alloc(free + 1), Err(OUT_OF_MEMORY));
        assert_eq!(cu.mem_info().0, free, "a refused allocation holds nothing");
        // Linear memory takes whole 2 MiB pages: what is left under a page, managed memory takes.
        let all = cu.alloc(free / (2 * MIB) * (2 * MIB));
        let rest = cu.mem_info().0;
        assert!(rest < 2 * MIB, "{rest} bytes left");
        let mut p = 0;
        if rest > 0 {
            let rc = call!(cu, cuMemAllocManaged(&mut p, rest as usize, 1) as fn(*mut CUdeviceptr, usize, c_uint));
            assert_eq!(rc, SUCCESS);
        }
        assert_eq!(cu.mem_info().0, 0);
        assert_eq!(cu.try_alloc(1), Err(OUT_OF_MEMORY));
        if rest > 0 {
            cu.free(p);
            assert_eq!(cu.try_alloc(1), Err(OUT_OF_MEMORY), "a new 2 MiB chunk does not fit in what is left");
            assert_eq!(
                call!(cu, cuMemAllocManaged(&mut p, rest as usize, 1) as fn(*mut CUdeviceptr, usize, c_uint)),
                SUCCESS
            );
        }
        let filler = p;
        let mut s = std::ptr::null_mut();
        // Other families are refused too, and leave nothing behind; managed memory, which pages
        // to the host, is not (as on a real driver), and takes nothing of the full device.
        assert_eq!(call!(cu, cuMemAllocManaged(&mut p, 4096, 1) as fn(*mut CUdeviceptr, usize, c_uint)), SUCCESS);
        assert_eq!(cu.mem_info().0, 0);
        cu.free(p);
        assert_eq!(call!(cu, cuStreamCreate(&mut s, 0) as fn(*mut Handle, c_uint)), SUCCESS);
        assert_eq!(call!(cu, cuMemAllocAsync(&mut p, 4096, s) as fn(*mut CUdeviceptr, usize, Handle)), OUT_OF_MEMORY);
        let mut c2 = std::ptr::null_mut();
        assert_eq!(call!(cu, cuCtxCreate_v2(&mut c2, 0, 0) as fn(*mut Handle, c_uint, c_int)), OUT_OF_MEMORY);
        cu.free(all);
        if rest > 0 {
            cu.free(filler);
        }
        assert_eq!(cu.mem_info().0, free);
        assert_eq!(m.memory_info(0, 0).unwrap().used, CONTEXT_OVERHEAD);
    });
}

#[test]
fn managed_memory_may_exceed_the_device_and_is_charged_what_fits() {
    with_context("managed_memory_may_exceed_the_device_and_is_charged_what_fits", |m, cu| {
        let (free, total) = cu.mem_info();
        let used = m.memory_info(0, 0).unwrap().used;
        let (mut a, mut b) = (0, 0);
        // Twice the device: allowed, the device holds what was free.
        let big = 2 * total as usize;
        assert_eq!(call!(cu, cuMemAllocManaged(&mut a, big, 1) as fn(*mut CUdeviceptr, usize, c_uint)), SUCCESS);
        assert_eq!(cu.mem_info().0, 0);
        assert_eq!(m.memory_info(0, 0).unwrap().used, used + free);
        // The memory is real: its last byte can be written and read back.
        let last = a + big as u64 - 1;
        assert_eq!(cu.htod(last, &[42]), SUCCESS);
        let mut back = [0u8];
        assert_eq!(cu.dtoh(&mut back, last), SUCCESS);
        assert_eq!(back, [42]);
        assert_eq!(call!(cu, cuMemAllocManaged(&mut b, 1 << 20, 1) as fn(*mut CUdeviceptr, usize, c_uint)), SUCCESS);
        // Freed in any order, everything charged comes back, and nothing more.
        cu.free(a);
        assert_eq!(cu.mem_info().0, free);
        cu.free(b);
        assert_eq!(cu.mem_info().0, free);
        assert_eq!(m.memory_info(0, 0).unwrap().used, used);
        // A bad flag is still refused.
        assert_eq!(call!(cu, cuMemAllocManaged(&mut a, 4096, 4) as fn(*mut CUdeviceptr, usize, c_uint)), INVALID_VALUE);
    });
}

/// `CUmemAllocationProp` for pinned device memory on `dev`.
fn vmm_prop(dev: c_int) -> [u8; 32] {
    let mut p = [0u8; 32];
    p[0..4].copy_from_slice(&1u32.to_ne_bytes()); // CU_MEM_ALLOCATION_TYPE_PINNED
    p[8..12].copy_from_slice(&1u32.to_ne_bytes()); // CU_MEM_LOCATION_TYPE_DEVICE
    p[12..16].copy_from_slice(&dev.to_ne_bytes());
    p
}

#[test]
fn every_allocation_family_is_charged_and_refunded() {
    with_driver("every_allocation_family_is_charged_and_refunded", |node, cu| {
        let m = model(node);
        cu.init();
        cu.ctx_create(1);
        let used = || m.memory_info(1, 0).unwrap().used;
        let (free0, _) = cu.mem_info();
        let base = used();
        let check = |what: &str, bytes: u64| {
            assert_eq!(cu.mem_info().0, free0 - bytes, "{what}: cuMemGetInfo");
            assert_eq!(used(), base + bytes, "{what}: the model");
        };
        // Pitched: rows of 1000 bytes take 1024.
        let (mut p, mut pitch) = (0, 0usize);
        assert_eq!(
            call!(
                cu,
                cuMemAllocPitch_v2(&mut p, &mut pitch, 1000, 300, 4)
                    as fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint)
            ),
            SUCCESS
        );
        assert_eq!(pitch, 1024);
        check("pitch: 300 KiB, carved from a 2 MiB chunk", 2 * MIB);
        cu.free(p);
        check("pitch freed", 0);
        // Managed.
        assert_eq!(
            call!(cu, cuMemAllocManaged(&mut p, 5 * MIB as usize, 1) as fn(*mut CUdeviceptr, usize, c_uint)),
            SUCCESS
        );
        check("managed", 5 * MIB);
        cu.free(p);
        check("managed freed", 0);
        // Stream-ordered, from the default pool and from a pool of our own.
        let s = cu.stream();
        assert_eq!(
            call!(cu, cuMemAllocAsync(&mut p, 7 * MIB as usize, s) as fn(*mut CUdeviceptr, usize, Handle)),
            SUCCESS
        );
        check("async", 7 * MIB);
        let mut pool = std::ptr::null_mut();
        assert_eq!(call!(cu, cuDeviceGetMemPool(&mut pool, 1) as fn(*mut Handle, c_int)), SUCCESS);
        let mut used_pool = 0u64;
        assert_eq!(
            call!(
                cu,
                cuMemPoolGetAttribute(pool, 7, (&mut used_pool as *mut u64).cast()) as fn(Handle, c_int, *mut c_void)
            ),
            SUCCESS
        );
        assert_eq!(used_pool, 7 * MIB);
        assert_eq!(call!(cu, cuMemFreeAsync(p, s) as fn(CUdeviceptr, Handle)), SUCCESS);
        check("async freed", 0);
        let mut props = [0u8; 88];
        props[0..4].copy_from_slice(&1u32.to_ne_bytes()); // PINNED
        props[8..12].copy_from_slice(&1u32.to_ne_bytes()); // DEVICE
        props[12..16].copy_from_slice(&1i32.to_ne_bytes()); // device 1
        let mut own = std::ptr::null_mut();
        assert_eq!(
            call!(cu, cuMemPoolCreate(&mut own, props.as_ptr().cast()) as fn(*mut Handle, *const c_void)),
            SUCCESS
        );
        assert_eq!(
            call!(
                cu,
                cuMemAllocFromPoolAsync(&mut p, 3 * MIB as usize, own, s)
                    as fn(*mut CUdeviceptr, usize, Handle, Handle)
            ),
            SUCCESS
        );
        check("from pool", 3 * MIB);
        assert_eq!(call!(cu, cuMemFreeAsync(p, s) as fn(CUdeviceptr, Handle)), SUCCESS);
        assert_eq!(call!(cu, cuMemPoolDestroy(own) as fn(Handle)), SUCCESS);
        check("from pool freed", 0);
        // Virtual memory management: charged on create, refunded on release.
        let prop = vmm_prop(1);
        let mut gran = 0usize;
        assert_eq!(
            call!(
                cu,
                cuMemGetAllocationGranularity(&mut gran, prop.as_ptr().cast(), 0)
                    as fn(*mut usize, *const c_void, c_int)
            ),
            SUCCESS
        );
        assert_eq!(gran as u64, 2 * MIB);
        assert_eq!(cu.mem_create(3 * MIB, &prop), Err(INVALID_VALUE));
        let h = cu.mem_create(4 * MIB, &prop).expect("cuMemCreate");
        check("cuMemCreate", 4 * MIB);
        assert_eq!(call!(cu, cuMemRelease(h) as fn(u64)), SUCCESS);
        check("cuMemRelease", 0);
        // Arrays: 64 x 32 float4.
        let desc: [usize; 3] = [64, 32, (0x20usize) | (4usize << 32)];
        let mut arr = std::ptr::null_mut();
        assert_eq!(
            call!(cu, cuArrayCreate_v2(&mut arr, desc.as_ptr().cast()) as fn(*mut Handle, *const c_void)),
            SUCCESS
        );
        check("array", 64 * 32 * 16);
        assert_eq!(call!(cu, cuArrayDestroy(arr) as fn(Handle)), SUCCESS);
        check("array destroyed", 0);
        // Pinned host memory is host memory: not charged.
        let mut host = std::ptr::null_mut();
        assert_eq!(call!(cu, cuMemAllocHost_v2(&mut host, 8 * MIB as usize) as fn(*mut *mut c_void, usize)), SUCCESS);
        check("pinned host", 0);
        let mut ty = 0u32;
        assert_eq!(
            call!(
                cu,
                cuPointerGetAttribute((&mut ty as *mut u32).cast(), 2, host as u64)
                    as fn(*mut c_void, c_int, CUdeviceptr)
            ),
            SUCCESS
        );
        assert_eq!(ty, 1, "CU_MEMORYTYPE_HOST");
        assert_eq!(call!(cu, cuMemFreeHost(host) as fn(*mut c_void)), SUCCESS);
        // A second context on the device charges its own overhead; destroying it refunds it.
        let c2 = cu.ctx_create(1);
        check("second context", CONTEXT_OVERHEAD);
        let _leaked = cu.alloc(MIB);
        assert_eq!(call!(cu, cuCtxDestroy_v2(c2) as fn(Handle)), SUCCESS);
        assert_eq!(used(), base, "a context's memory goes with it");
    });
}

#[test]
fn copies_and_memsets_move_real_bytes() {
    with_context("copies_and_memsets_move_real_bytes", |_, cu| {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let (a, b) = (cu.alloc(4096), cu.alloc(4096));
        assert_eq!(cu.htod(a, &data), SUCCESS);
        assert_eq!(call!(cu, cuMemcpyDtoD_v2(b, a, 4096) as fn(CUdeviceptr, CUdeviceptr, usize)), SUCCESS);
        let mut back = vec![0u8; 4096];
        assert_eq!(cu.dtoh(&mut back, b), SUCCESS);
        assert_eq!(back, data);
        // Unified addressing: cuMemcpy between host and device memory.
        let mut again = vec![0u8; 4096];
        assert_eq!(
            call!(cu, cuMemcpy(again.as_mut_ptr() as u64, a, 4096) as fn(CUdeviceptr, CUdeviceptr, usize)),
            SUCCESS
        );
        assert_eq!(again, data);
        // Memsets of each width.
        assert_eq!(call!(cu, cuMemsetD8_v2(a, 0xab, 10) as fn(CUdeviceptr, u8, usize)), SUCCESS);
        assert_eq!(call!(cu, cuMemsetD16_v2(a + 16, 0x1234, 4) as fn(CUdeviceptr, u16, usize)), SUCCESS);
        assert_eq!(call!(cu, cuMemsetD32_v2(a + 32, 0xdead_beef, 2) as fn(CUdeviceptr, u32, usize)), SUCCESS);
        assert_eq!(call!(cu, cuMemsetD32_v2(a + 1, 0, 2) as fn(CUdeviceptr, u32, usize)), INVALID_VALUE, "misaligned");
        assert_eq!(cu.dtoh(&mut back, a), SUCCESS);
        assert_eq!(&back[..10], &[0xab; 10]);
        assert_eq!(back[10], data[10]);
        assert_eq!(&back[16..24], &[0x34, 0x12, 0x34, 0x12, 0x34, 0x12, 0x34, 0x12]);
        assert_eq!(&back[32..40], &[0xef, 0xbe, 0xad, 0xde, 0xef, 0xbe, 0xad, 0xde]);
        // A 2D memset: three rows of two 16-bit elements, 100 bytes apart, the gaps left alone.
        let d2d16 =
            call!(cu, cuMemsetD2D16_v2(a + 200, 100, 0x0102, 2, 3) as fn(CUdeviceptr, usize, u16, usize, usize));
        assert_eq!(d2d16, SUCCESS);
        assert_eq!(cu.dtoh(&mut back, a), SUCCESS);
        for row in [200, 300, 400] {
            assert_eq!(&back[row..row + 4], &[0x02, 0x01, 0x02, 0x01], "row at {row}");
            assert_eq!(back[row + 4], data[row + 4], "after the row at {row}");
        }
        // Asynchronous copies on a stream.
        let s = cu.stream();
        let src = vec![0x5au8; 1000];
        assert_eq!(
            call!(
                cu,
                cuMemcpyHtoDAsync_v2(b, src.as_ptr().cast(), 1000, s) as fn(CUdeviceptr, *const c_void, usize, Handle)
            ),
            SUCCESS
        );
        let mut out = vec![0u8; 1000];
        assert_eq!(
            call!(
                cu,
                cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), b, 1000, s)
                    as fn(*mut c_void, CUdeviceptr, usize, Handle)
            ),
            SUCCESS
        );
        assert_eq!(cu.sync(s), SUCCESS);
        assert_eq!(out, src);
        // A 2D copy: 4 rows of 8 bytes out of rows 64 bytes apart.
        let mut copy2d = [0u8; 128];
        let field = |buf: &mut [u8; 128], off: usize, v: u64| buf[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        field(&mut copy2d, 0, 0); // srcXInBytes
        field(&mut copy2d, 8, 1); // srcY
        copy2d[16..20].copy_from_slice(&2u32.to_ne_bytes()); // srcMemoryType: device
        field(&mut copy2d, 32, a); // srcDevice
        field(&mut copy2d, 48, 64); // srcPitch
        copy2d[72..76].copy_from_slice(&1u32.to_ne_bytes()); // dstMemoryType: host
        let mut dst2d = [0u8; 32];
        field(&mut copy2d, 80, dst2d.as_mut_ptr() as u64); // dstHost
        field(&mut copy2d, 104, 8); // dstPitch
        field(&mut copy2d, 112, 8); // WidthInBytes
        field(&mut copy2d, 120, 4); // Height
        assert_eq!(cu.htod(a, &data), SUCCESS);
        assert_eq!(call!(cu, cuMemcpy2D_v2(copy2d.as_ptr().cast()) as fn(*const c_void)), SUCCESS);
        for r in 0..4 {
            assert_eq!(&dst2d[r * 8..r * 8 + 8], &data[(r + 1) * 64..(r + 1) * 64 + 8]);
        }
        // Outside what was allocated: refused, nothing written.
        assert_eq!(cu.htod(a + 4000, &data[..200]), INVALID_VALUE);
        assert_eq!(cu.htod(0xdead_0000, &data[..8]), INVALID_VALUE);
        assert_eq!(cu.dtoh(&mut back[..8], 0xdead_0000), INVALID_VALUE);
        // Virtual memory: one physical allocation mapped twice shows the same bytes; without
        // access a copy is refused.
        let prop = vmm_prop(0);
        let h = cu.mem_create(2 * MIB, &prop).expect("cuMemCreate");
        let mut va = 0u64;
        assert_eq!(
            call!(cu, cuMemAddressReserve(&mut va, 4 * MIB as usize, 0, 0, 0) as fn(*mut u64, usize, usize, u64, u64)),
            SUCCESS
        );
        let map = |at: u64| call!(cu, cuMemMap(at, 2 * MIB as usize, 0, h, 0) as fn(u64, usize, usize, u64, u64));
        assert_eq!(map(va), SUCCESS);
        assert_eq!(map(va + 2 * MIB), SUCCESS);
        assert_eq!(cu.htod(va, &data[..64]), INVALID_VALUE, "mapped without access");
        let mut access = [0u8; 12];
        access[0..4].copy_from_slice(&1u32.to_ne_bytes()); // DEVICE
        access[8..12].copy_from_slice(&3u32.to_ne_bytes()); // READWRITE
        assert_eq!(
            call!(
                cu,
                cuMemSetAccess(va, 4 * MIB as usize, access.as_ptr().cast(), 1) as fn(u64, usize, *const c_void, usize)
            ),
            SUCCESS
        );
        assert_eq!(cu.htod(va, &data[..64]), SUCCESS);
        let mut alias = [0u8; 64];
        assert_eq!(cu.dtoh(&mut alias, va + 2 * MIB), SUCCESS);
        assert_eq!(&alias[..], &data[..64]);
        assert_eq!(call!(cu, cuMemUnmap(va, 4 * MIB as usize) as fn(u64, usize)), SUCCESS);
        assert_eq!(cu.dtoh(&mut alias, va), INVALID_VALUE, "unmapped");
        assert_eq!(call!(cu, cuMemRelease(h) as fn(u64)), SUCCESS);
        assert_eq!(call!(cu, cuMemAddressFree(va, 4 * MIB as usize) as fn(u64, usize)), SUCCESS);
    });
}

#[test]
fn kernel_time_shows_in_events_and_waits() {
    with_context("kernel_time_shows_in_events_and_waits", |_, cu| {
        let k = cu.function(CUBIN, "k_2ms");
        let busy = cu.function(CUBIN, "k_50ms");
        let s = cu.stream();
        let (start, end) = (cu.event(0), cu.event(0));
        // Behind a 50 ms kernel both events are stamped where the queued work reaches them (the
        // device's clock), not when these calls land: the elapsed time is the kernel's own,
        // exactly, whatever the host's delays. Tried again where the host was so late that the
        // 50 ms kernel had ended before the second event was recorded.
        let timed = |kernel: Handle, stream: Handle, sync: &dyn Fn() -> u32| -> Option<f32> {
            assert_eq!(cu.launch(busy, stream), SUCCESS);
            cu.record(start, stream);
            let t0 = Instant::now();
            assert_eq!(cu.launch(kernel, stream), SUCCESS);
            cu.record(end, stream);
            let in_time = call!(cu, cuEventQuery(start) as fn(Handle)) == NOT_READY;
            assert_eq!(call!(cu, cuEventQuery(end) as fn(Handle)), NOT_READY);
            assert_eq!(call!(cu, cuStreamQuery(stream) as fn(Handle)), NOT_READY);
            assert_eq!(cu.elapsed(start, end), Err(NOT_READY));
            assert_eq!(sync(), SUCCESS);
            let waited = t0.elapsed();
            assert!(waited >= Duration::from_micros(1900), "returned after {waited:?}");
            assert_eq!(call!(cu, cuStreamQuery(stream) as fn(Handle)), SUCCESS);
            let ms = cu.elapsed(start, end).unwrap();
            in_time.then_some(ms)
        };
        let exactly = |kernel: Handle, stream: Handle, sync: &dyn Fn() -> u32| -> f32 {
            (0..5).find_map(|_| timed(kernel, stream, sync)).expect("the host kept up once in 5 tries")
        };
        let ms = exactly(k, s, &|| cu.sync(s));
        assert!((ms - 2.0).abs() < 1e-3, "elapsed {ms} ms");
        // The legacy default stream, and a C++-mangled name with a duration.
        let k2 = cu.function(CUBIN, "_Z10spin_500usPf");
        let ms = exactly(k2, std::ptr::null_mut(), &|| call!(cu, cuEventSynchronize(end) as fn(Handle)));
        assert!((ms - 0.5).abs() < 1e-3, "elapsed {ms} ms");
        // Timing disabled, or never recorded: no elapsed time.
        let untimed = cu.event(2);
        cu.record(untimed, s);
        assert_eq!(cu.elapsed(start, untimed), Err(INVALID_HANDLE));
        assert_eq!(cu.elapsed(start, cu.event(0)), Err(INVALID_HANDLE));
        // Bad launches.
        let launch = |f: Handle, threads: c_uint| launch_kernel(&cu.lib, "cuLaunchKernel", f, threads, s);
        assert_eq!(launch(k, 2048), INVALID_VALUE, "more threads than a block holds");
        assert_eq!(launch(0x1234 as Handle, 32), INVALID_HANDLE);
        assert_eq!(cu.launch(k, 0x5678 as Handle), INVALID_HANDLE, "a made-up stream");
        // PTX text is read for what it declares.
        let ptx = c".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry work_3us(\n)\n{\n ret;\n}\n";
        let mut module = std::ptr::null_mut();
        assert_eq!(
            call!(cu, cuModuleLoadData(&mut module, ptx.as_ptr().cast()) as fn(*mut Handle, *const c_void)),
            SUCCESS
        );
        let mut f = std::ptr::null_mut();
        assert_eq!(
            call!(
                cu,
                cuModuleGetFunction(&mut f, module, c"work_3us".as_ptr()) as fn(*mut Handle, Handle, *const c_char)
            ),
            SUCCESS
        );
        assert_eq!(
            call!(
                cu,
                cuModuleGetFunction(&mut f, module, c"missing".as_ptr()) as fn(*mut Handle, Handle, *const c_char)
            ),
            NOT_FOUND
        );
        let mut name: *const c_char = std::ptr::null();
        let k_name = cu.function(CUBIN, "k_2ms");
        assert_eq!(call!(cu, cuFuncGetName(&mut name, k_name) as fn(*mut *const c_char, Handle)), SUCCESS);
        // SAFETY: the name lives as long as the function's module.
        assert_eq!(unsafe { CStr::from_ptr(name) }.to_str().unwrap(), "k_2ms");
        let mut regs = 0;
        assert_eq!(call!(cu, cuFuncGetAttribute(&mut regs, 6, k_name) as fn(*mut c_int, c_int, Handle)), SUCCESS);
        assert_eq!(regs, 90, "BINARY_VERSION of a compute capability 9.0 device");
        // Host functions run after the work before them.
        static RAN_AT: AtomicU64 = AtomicU64::new(0);
        extern "C" fn mark(start: *mut c_void) {
            // SAFETY: the test passes a pointer to its Instant, alive until the stream is synchronized.
            let t0 = unsafe { &*(start as *const Instant) };
            RAN_AT.store(t0.elapsed().as_micros() as u64, Ordering::SeqCst);
        }
        let t0 = Instant::now();
        assert_eq!(cu.launch(k, s), SUCCESS);
        let f: Option<extern "C" fn(*mut c_void)> = Some(mark);
        assert_eq!(
            call!(
                cu,
                cuLaunchHostFunc(s, f, (&t0 as *const Instant).cast_mut().cast())
                    as fn(Handle, Option<extern "C" fn(*mut c_void)>, *mut c_void)
            ),
            SUCCESS
        );
        assert_eq!(cu.sync(s), SUCCESS);
        let at = RAN_AT.load(Ordering::SeqCst);
        assert!(at >= 1900, "the host function ran {at} us after the launch");
    });
}

#[test]
fn two_processes_share_a_gpu_by_time_slicing() {
    const NAME: &str = "two_processes_share_a_gpu_by_time_slicing";
    let node = SimNode::new();
    if tessera_sim_testkit::in_child() {
        node.run_isolated(NAME, || {
            visible(None);
            let cu = Cuda::load(&node);
            cu.init();
            cu.ctx_create(0);
            let k = cu.function(CUBIN, "k_4ms");
            let s = cu.stream();
            let (start, end) = (cu.event(0), cu.event(0));
            // Start together with the other process.
            std::fs::write(node.root.join(format!("ready-{}", std::process::id())), b"").unwrap();
            let t = Instant::now();
            while std::fs::read_dir(&node.root)
                .unwrap()
                .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("ready-"))
                .count()
                < 2
            {
                assert!(t.elapsed() < Duration::from_secs(20), "the other process never started");
                std::thread::sleep(Duration::from_millis(1));
            }
            cu.record(start, s);
            for _ in 0..25 {
                assert_eq!(cu.launch(k, s), SUCCESS);
            }
            cu.record(end, s);
            assert_eq!(cu.sync(s), SUCCESS);
            // 100 ms of work, sharing the GPU with 100 ms of the other's: about twice as long.
            let ms = cu.elapsed(start, end).unwrap();
            assert!((150.0..260.0).contains(&ms), "100 ms of kernels took {ms} ms on a shared GPU");
        });
        return;
    }
    std::thread::scope(|s| {
        let a = s.spawn(|| node.run_isolated(NAME, || {}));
        let b = s.spawn(|| node.run_isolated(NAME, || {}));
        a.join().unwrap();
        b.join().unwrap();
    });
}

#[test]
fn proc_address_resolves_versions_and_default_stream_flavours() {
    with_driver("proc_address_resolves_versions_and_default_stream_flavours", |_, cu| {
        type GetProc = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> u32;
        let get: GetProc = cu.sym("cuGetProcAddress_v2");
        let resolve = |name: &str, version: c_int, flags: u64| {
            let cname = CString::new(name).unwrap();
            let (mut p, mut status) = (std::ptr::null_mut(), -1);
            // SAFETY: the cuGetProcAddress_v2 signature, with valid pointers.
            let r = unsafe { get(cname.as_ptr(), &mut p, version, flags, &mut status) };
            (r, p, status)
        };
        // Before cuInit, as runtimes look cuInit itself up.
        assert_eq!(resolve("cuInit", 12080, 0), (SUCCESS, cu.addr("cuInit"), 0));
        cu.init();
        assert_eq!(resolve("cuMemAlloc", 12000, 0).1, cu.addr("cuMemAlloc_v2"));
        assert_eq!(resolve("cuMemAlloc", 3020, 0).1, cu.addr("cuMemAlloc_v2"));
        assert_eq!(resolve("cuMemAlloc", 2000, 0).1, cu.addr("cuMemAlloc"));
        assert_eq!(resolve("cuCtxCreate", 3020, 0).1, cu.addr("cuCtxCreate_v2"));
        assert_eq!(resolve("cuCtxCreate", 12050, 0).1, cu.addr("cuCtxCreate_v4"));
        assert_eq!(resolve("cuCtxDestroy", 12080, 0).1, cu.addr("cuCtxDestroy_v2"));
        assert_eq!(resolve("cuGetProcAddress", 12000, 0).1, cu.addr("cuGetProcAddress_v2"));
        assert_eq!(resolve("cuEventElapsedTime", 12080, 0).1, cu.addr("cuEventElapsedTime_v2"));
        assert_eq!(resolve("cuGraphInstantiate", 12000, 0).1, cu.addr("cuGraphInstantiateWithFlags"));
        // Per-thread default stream flavours.
        assert_eq!(resolve("cuLaunchKernel", 12000, 2).1, cu.addr("cuLaunchKernel_ptsz"));
        assert_eq!(resolve("cuLaunchKernel", 12000, 1).1, cu.addr("cuLaunchKernel"));
        assert_eq!(resolve("cuLaunchKernel", 12000, 0).1, cu.addr("cuLaunchKernel"));
        assert_eq!(resolve("cuMemcpyHtoD", 12000, 2).1, cu.addr("cuMemcpyHtoD_v2_ptds"));
        assert_eq!(resolve("cuMemcpyAsync", 12000, 2).1, cu.addr("cuMemcpyAsync_ptsz"));
        assert_eq!(resolve("cuStreamSynchronize", 12000, 2).1, cu.addr("cuStreamSynchronize_ptsz"));
        assert_eq!(resolve("cuEventRecord", 12000, 2).1, cu.addr("cuEventRecord_ptsz"));
        assert_eq!(resolve("cuStreamBeginCapture", 12000, 2).1, cu.addr("cuStreamBeginCapture_v2_ptsz"));
        assert_eq!(resolve("cuLaunchKernel", 6050, 2).1, cu.addr("cuLaunchKernel"), "no per-thread streams before 7.0");
        // Unknown names, versions too old for a name, and bad flags.
        assert_eq!(resolve("cuNoSuchFunction", 12080, 0), (NOT_FOUND, std::ptr::null_mut(), 1));
        assert_eq!(resolve("cuLaunchKernelEx", 11000, 0), (NOT_FOUND, std::ptr::null_mut(), 2));
        assert_eq!(resolve("cuMemAlloc_v2", 12080, 0).0, NOT_FOUND, "base names only");
        assert_eq!(resolve("cuInit", 12080, 7).0, INVALID_VALUE);
        // The CUDA 11.3 entry point (no status).
        let mut p = std::ptr::null_mut();
        assert_eq!(
            call!(
                cu,
                cuGetProcAddress(c"cuStreamQuery".as_ptr(), &mut p, 11030, 2)
                    as fn(*const c_char, *mut *mut c_void, c_int, u64)
            ),
            SUCCESS
        );
        assert_eq!(p, cu.addr("cuStreamQuery_ptsz"));
        // What cuGetProcAddress hands out works.
        let (_, f, _) = resolve("cuDeviceGetCount", 12080, 0);
        // SAFETY: cuDeviceGetCount's signature.
        let f: unsafe extern "C" fn(*mut c_int) -> u32 = unsafe { std::mem::transmute(f) };
        let mut n = 0;
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { f(&mut n) }, SUCCESS);
        assert_eq!(n, 8);
        let mut table: *const c_void = std::ptr::null();
        let id = [0u8; 16];
        assert_eq!(
            call!(cu, cuGetExportTable(&mut table, id.as_ptr().cast()) as fn(*mut *const c_void, *const c_void)),
            NOT_FOUND,
            "a table the driver does not have"
        );
    });
}

/// An export table by UUID, as the CUDA runtime asks for it.
fn export_table(cu: &Cuda, id: u128) -> Result<*const usize, u32> {
    let mut table: *const c_void = std::ptr::null();
    let id = id.to_be_bytes();
    match call!(cu, cuGetExportTable(&mut table, id.as_ptr().cast()) as fn(*mut *const c_void, *const c_void)) {
        SUCCESS => Ok(table.cast()),
        e => Err(e),
    }
}

/// Entry `i` of a table as a function of type `T`.
fn entry<T: Copy>(table: *const usize, i: usize) -> T {
    assert_eq!(size_of::<T>(), size_of::<usize>());
    // SAFETY: callers index within the table and name the entry's C signature as T.
    unsafe { std::mem::transmute_copy(&*table.add(i)) }
}

const CUDART_INTERFACE: u128 = 0x6bd5fb6c_5bf4_e74a_8987_d93912fd9df9;
const CONTEXT_LOCAL_STORAGE: u128 = 0xc693336e_1121_df11_a8c3_68f355d89593;
const INTEGRITY_CHECK: u128 = 0xd4082055_bde6_704b_8d34_ba123c66e1f2;

type StoragePut = unsafe extern "C" fn(Handle, usize, usize, Option<extern "C" fn(Handle, usize, usize)>) -> u32;
type StorageDelete = unsafe extern "C" fn(Handle, usize) -> u32;
type StorageGet = unsafe extern "C" fn(*mut usize, Handle, usize) -> u32;

/// What the storage destructor saw: the number of calls and the last (context, key, value) sum.
static DTOR_CALLS: AtomicU64 = AtomicU64::new(0);
static DTOR_LAST: AtomicU64 = AtomicU64::new(0);

extern "C" fn storage_dtor(ctx: Handle, key: usize, value: usize) {
    DTOR_CALLS.fetch_add(1, Ordering::SeqCst);
    DTOR_LAST.store((ctx as u64) ^ (key as u64) ^ (value as u64), Ordering::SeqCst);
}

#[test]
fn the_runtime_tables_keep_context_storage_and_check_the_driver() {
    with_driver("the_runtime_tables_keep_context_storage_and_check_the_driver", |_, cu| {
        cu.init();
        // Tables the driver does not have, and bad arguments.
        assert_eq!(export_table(cu, 0xf8cff951_2146_8b4e_b9e2_fb469e7c0dd9), Err(NOT_FOUND));
        let mut table: *const c_void = std::ptr::null();
        assert_eq!(
            call!(cu, cuGetExportTable(&mut table, std::ptr::null()) as fn(*mut *const c_void, *const c_void)),
            INVALID_VALUE
        );
        // The runtime interface: its size, and the primary context it hands out before retaining.
        let rt = export_table(cu, CUDART_INTERFACE).expect("CUDART_INTERFACE");
        // SAFETY: the table's first word.
        assert_eq!(unsafe { *rt }, 13 * 8);
        let primary_of: unsafe extern "C" fn(*mut Handle, c_int) -> u32 = entry(rt, 2);
        let mut primary: Handle = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { primary_of(&mut primary, 0) }, SUCCESS);
        // SAFETY: a bad device.
        assert_eq!(unsafe { primary_of(&mut primary, 99) }, INVALID_DEVICE);
        let (mut flags, mut active) = (0u32, -1);
        assert_eq!(
            call!(cu, cuDevicePrimaryCtxGetState(0, &mut flags, &mut active) as fn(c_int, *mut c_uint, *mut c_int)),
            SUCCESS
        );
        assert_eq!(active, 0, "handed out, not retained");
        let mut retained: Handle = std::ptr::null_mut();
        assert_eq!(call!(cu, cuDevicePrimaryCtxRetain(&mut retained, 0) as fn(*mut Handle, c_int)), SUCCESS);
        assert_eq!(retained, primary, "the retained context is the one handed out");

        // Context-local storage: no size word; get, put, replace, delete, destructors.
        let cls = export_table(cu, CONTEXT_LOCAL_STORAGE).expect("CONTEXT_LOCAL_STORAGE");
        let (putf, deletef, getf): (StoragePut, StorageDelete, StorageGet) =
            (entry(cls, 0), entry(cls, 1), entry(cls, 2));
        // SAFETY: the entry's signature; contexts are handles the driver checks.
        let put = |c, k, v, d| unsafe { putf(c, k, v, d) };
        // SAFETY: as above.
        let delete = |c, k| unsafe { deletef(c, k) };
        let get = |c, k| {
            let mut v = 0usize;
            // SAFETY: as above, with a valid out-pointer.
            match unsafe { getf(&mut v, c, k) } {
                SUCCESS => Ok(v),
                e => Err(e),
            }
        };
        let null = std::ptr::null_mut();
        assert_eq!(get(primary, 0x10), Err(INVALID_HANDLE), "nothing stored yet");
        assert_eq!(put(primary, 0x10, 0xAA, None), SUCCESS);
        assert_eq!(put(primary, 0x10, 0xBB, Some(storage_dtor)), SUCCESS, "replaces");
        assert_eq!(get(primary, 0x10), Ok(0xBB));
        assert_eq!(get(0xdead0 as Handle, 0x10), Err(INVALID_CONTEXT));
        assert_eq!(get(null, 0x10), Err(INVALID_CONTEXT), "no current context");
        assert_eq!(call!(cu, cuCtxSetCurrent(primary) as fn(Handle)), SUCCESS);
        assert_eq!(get(null, 0x10), Ok(0xBB), "null: the current context");
        assert_eq!(put(null, 0x20, 0xCC, Some(storage_dtor)), SUCCESS);
        assert_eq!(delete(primary, 0x20), SUCCESS);
        assert_eq!(get(primary, 0x20), Err(INVALID_HANDLE), "deleted");
        assert_eq!(DTOR_CALLS.load(Ordering::SeqCst), 0, "delete runs no destructor");
        // A reset tears the primary context down: its destructors run, once, and it is empty.
        assert_eq!(call!(cu, cuDevicePrimaryCtxReset_v2(0) as fn(c_int)), SUCCESS);
        assert_eq!(DTOR_CALLS.load(Ordering::SeqCst), 1);
        assert_eq!(DTOR_LAST.load(Ordering::SeqCst), (primary as u64) ^ 0x10 ^ 0xBB);
        assert_eq!(get(primary, 0x10), Err(INVALID_HANDLE), "a reset context is empty");
        // A destroyed regular context runs its destructors too.
        let ctx = cu.ctx_create(1);
        assert_eq!(put(ctx, 0x30, 0xDD, Some(storage_dtor)), SUCCESS);
        assert_eq!(call!(cu, cuCtxDestroy_v2(ctx) as fn(Handle)), SUCCESS);
        assert_eq!(DTOR_CALLS.load(Ordering::SeqCst), 2);
        assert_eq!(DTOR_LAST.load(Ordering::SeqCst), (ctx as u64) ^ 0x30 ^ 0xDD);
        assert_eq!(get(ctx, 0x30), Err(INVALID_CONTEXT), "the context is gone");

        // An entry the sim does not model answers NOT_SUPPORTED (the driver's host heap).
        let heap = export_table(cu, 0x195bcbf4_d67d_024a_acc5_1d29cea631ae).expect("HEAP_ACCESS");
        let heap_alloc: unsafe extern "C" fn(*mut *const c_void, usize, usize) -> u32 = entry(heap, 1);
        let mut record = std::ptr::null();
        // SAFETY: a valid out-pointer; the entry writes nothing.
        assert_eq!(unsafe { heap_alloc(&mut record, 64, 0) }, NOT_SUPPORTED);

        // The integrity check: fixed words for its first revisions, else a digest of the
        // process, the thread, the time and the devices.
        let ic = export_table(cu, INTEGRITY_CHECK).expect("INTEGRITY_CHECK");
        let check: unsafe extern "C" fn(c_uint, u64, *mut [u64; 2]) -> u32 = entry(ic, 1);
        let answer = |version, time| {
            let mut r = [0u64; 2];
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { check(version, time, &mut r) }, SUCCESS);
            r
        };
        assert_eq!(answer(12080, 5), [0x3341_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8]);
        assert_eq!(answer(12092, 5), answer(12092, 5));
        assert_ne!(answer(12092, 5), answer(12092, 6));
        assert_ne!(answer(12092, 5), answer(12082, 5));
        let here = answer(12092, 5);
        let other_thread = std::thread::spawn(move || {
            let mut r = [0u64; 2];
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { check(12092, 5, &mut r) }, SUCCESS);
            r
        });
        assert_ne!(other_thread.join().unwrap(), here, "the thread is part of the digest");
    });
}

#[test]
fn a_captured_graph_replays_in_order() {
    with_context("a_captured_graph_replays_in_order", |_, cu| {
        let k = cu.function(CUBIN, "k_1ms");
        // Non-blocking, so that synchronous copies on the legacy stream do not wait on the capture.
        let mut s = std::ptr::null_mut();
        assert_eq!(call!(cu, cuStreamCreate(&mut s, 1) as fn(*mut Handle, c_uint)), SUCCESS);
        let buf = cu.alloc(64);
        assert_eq!(call!(cu, cuMemsetD8_v2(buf, 0, 64) as fn(CUdeviceptr, u8, usize)), SUCCESS);
        assert_eq!(call!(cu, cuStreamBeginCapture_v2(s, 0) as fn(Handle, c_uint)), SUCCESS);
        assert_eq!(call!(cu, cuStreamBeginCapture_v2(s, 0) as fn(Handle, c_uint)), 401, "already capturing");
        for _ in 0..3 {
            assert_eq!(cu.launch(k, s), SUCCESS);
        }
        assert_eq!(call!(cu, cuMemsetD8Async(buf, 0x77, 64, s) as fn(CUdeviceptr, u8, usize, Handle)), SUCCESS);
        let mut status = 9u32;
        assert_eq!(call!(cu, cuStreamIsCapturing(s, &mut status) as fn(Handle, *mut c_uint)), SUCCESS);
        assert_eq!(status, 1, "CU_STREAM_CAPTURE_STATUS_ACTIVE");
        let (mut id, mut graph, mut deps, mut ndeps) = (0u64, std::ptr::null_mut(), std::ptr::null::<Handle>(), 0usize);
        assert_eq!(
            call!(
                cu,
                cuStreamGetCaptureInfo_v2(s, &mut status, &mut id, &mut graph, &mut deps, &mut ndeps)
                    as fn(Handle, *mut c_uint, *mut u64, *mut Handle, *mut *const Handle, *mut usize)
            ),
            SUCCESS
        );
        assert!(id > 0 && !graph.is_null());
        assert_eq!(ndeps, 1);
        // Nothing ran while capturing.
        let mut byte = [0u8; 1];
        assert_eq!(cu.dtoh(&mut byte, buf), SUCCESS);
        assert_eq!(byte[0], 0, "the captured memset has not run");
        let mut captured = std::ptr::null_mut();
        assert_eq!(call!(cu, cuStreamEndCapture(s, &mut captured) as fn(Handle, *mut Handle)), SUCCESS);
        assert_eq!(captured, graph);
        assert_eq!(call!(cu, cuStreamQuery(s) as fn(Handle)), SUCCESS);
        let mut n = 0usize;
        assert_eq!(
            call!(cu, cuGraphGetNodes(captured, std::ptr::null_mut(), &mut n) as fn(Handle, *mut Handle, *mut usize)),
            SUCCESS
        );
        assert_eq!(n, 4);
        let mut nodes = [std::ptr::null_mut(); 4];
        assert_eq!(
            call!(cu, cuGraphGetNodes(captured, nodes.as_mut_ptr(), &mut n) as fn(Handle, *mut Handle, *mut usize)),
            SUCCESS
        );
        let mut ty = -1;
        assert_eq!(call!(cu, cuGraphNodeGetType(nodes[3], &mut ty) as fn(Handle, *mut c_int)), SUCCESS);
        assert_eq!(ty, 2, "CU_GRAPH_NODE_TYPE_MEMSET");
        let mut exec = std::ptr::null_mut();
        assert_eq!(
            call!(cu, cuGraphInstantiateWithFlags(&mut exec, captured, 0) as fn(*mut Handle, Handle, u64)),
            SUCCESS
        );
        // Two replays: 6 ms of kernels, in order on the stream, then the memset. Timed behind a
        // 50 ms kernel, so both events are stamped in the device's clock, not when the host's
        // calls land (tried again where the host was so late that the 50 ms had ended first).
        let (start, end) = (cu.event(0), cu.event(0));
        let busy = cu.function(CUBIN, "k_50ms");
        let timed = |replays: &dyn Fn()| -> f32 {
            (0..5)
                .find_map(|_| {
                    assert_eq!(cu.launch(busy, s), SUCCESS);
                    cu.record(start, s);
                    replays();
                    cu.record(end, s);
                    let in_time = call!(cu, cuEventQuery(start) as fn(Handle)) == NOT_READY;
                    assert_eq!(cu.sync(s), SUCCESS);
                    let ms = cu.elapsed(start, end).unwrap();
                    in_time.then_some(ms)
                })
                .expect("the host kept up once in 5 tries")
        };
        let ms = timed(&|| {
            for _ in 0..2 {
                assert_eq!(call!(cu, cuGraphLaunch(exec, s) as fn(Handle, Handle)), SUCCESS);
            }
        });
        assert!((ms - 6.0).abs() < 1e-3, "two replays of 3 x 1 ms took {ms} ms");
        assert_eq!(cu.dtoh(&mut byte, buf), SUCCESS);
        assert_eq!(byte[0], 0x77);
        // A graph built by hand.
        let mut g = std::ptr::null_mut();
        assert_eq!(call!(cu, cuGraphCreate(&mut g, 0) as fn(*mut Handle, c_uint)), SUCCESS);
        let mut params = [0u8; 72];
        params[0..8].copy_from_slice(&(k as u64).to_ne_bytes());
        for (i, v) in [1u32, 1, 1, 32, 1, 1, 0].iter().enumerate() {
            params[8 + 4 * i..12 + 4 * i].copy_from_slice(&v.to_ne_bytes());
        }
        let (mut n1, mut n2) = (std::ptr::null_mut(), std::ptr::null_mut());
        let add = |out: *mut Handle, deps: *const Handle, nd: usize| {
            call!(
                cu,
                cuGraphAddKernelNode_v2(out, g, deps, nd, params.as_ptr().cast())
                    as fn(*mut Handle, Handle, *const Handle, usize, *const c_void)
            )
        };
        assert_eq!(add(&mut n1, std::ptr::null(), 0), SUCCESS);
        assert_eq!(add(&mut n2, &n1, 1), SUCCESS);
        let bogus = 0x99 as Handle;
        assert_eq!(add(&mut n2, &bogus, 1), INVALID_VALUE, "a dependency outside the graph");
        assert_eq!(call!(cu, cuGraphInstantiateWithFlags(&mut exec, g, 0) as fn(*mut Handle, Handle, u64)), SUCCESS);
        let ms = timed(&|| assert_eq!(call!(cu, cuGraphLaunch(exec, s) as fn(Handle, Handle)), SUCCESS));
        assert!((ms - 2.0).abs() < 1e-3, "two 1 ms kernel nodes took {ms} ms");
        assert_eq!(call!(cu, cuGraphExecDestroy(exec) as fn(Handle)), SUCCESS);
        // Waiting on a capturing stream is refused and ends the capture in error.
        assert_eq!(call!(cu, cuStreamBeginCapture_v2(s, 2) as fn(Handle, c_uint)), SUCCESS);
        assert_eq!(cu.launch(k, s), SUCCESS);
        assert_eq!(cu.sync(s), STREAM_CAPTURE_UNSUPPORTED);
        let mut broken = 0x1 as Handle;
        assert_eq!(call!(cu, cuStreamEndCapture(s, &mut broken) as fn(Handle, *mut Handle)), 901);
        assert!(broken.is_null());
        assert_eq!(call!(cu, cuGraphDestroy(g) as fn(Handle)), SUCCESS);
        assert_eq!(call!(cu, cuGraphDestroy(captured) as fn(Handle)), SUCCESS);
    });
}

#[test]
fn a_lost_gpu_fails_calls_and_a_reset_recovers() {
    with_driver("a_lost_gpu_fails_calls_and_a_reset_recovers", |node, cu| {
        let m = model(node);
        cu.init();
        let other = cu.ctx_create(1);
        let p1 = cu.alloc(MIB);
        let ctx = cu.ctx_create(0);
        let k = cu.function(CUBIN, "k_50ms");
        let s = cu.stream();
        let _p = cu.alloc(GIB);
        assert_eq!(cu.launch(k, s), SUCCESS);
        m.fall_off_bus(0).unwrap();
        assert_eq!(cu.try_alloc(MIB), Err(DEVICE_UNAVAILABLE), "new work on a lost GPU");
        assert_eq!(cu.launch(k, s), DEVICE_UNAVAILABLE);
        assert_eq!(cu.sync(s), LAUNCH_FAILED, "work in flight on a lost GPU");
        assert_eq!(call!(cu, cuCtxSynchronize() as fn()), LAUNCH_FAILED);
        // The GPU comes back; the contexts it had are gone, with their memory.
        m.reset(0).unwrap();
        assert_eq!(cu.try_alloc(MIB), Err(LAUNCH_FAILED), "the old context stays failed");
        assert_eq!(m.memory_info(0, 0).unwrap().used, 0);
        assert_eq!(call!(cu, cuCtxDestroy_v2(ctx) as fn(Handle)), SUCCESS);
        assert_eq!(m.memory_info(0, 0).unwrap().used, 0, "nothing refunded twice");
        cu.ctx_create(0);
        let p = cu.alloc(MIB);
        assert_eq!(m.memory_info(0, 0).unwrap().used, CONTEXT_OVERHEAD + 2 * MIB, "1 MiB: its 2 MiB chunk");
        assert_eq!(cu.launch(cu.function(CUBIN, "k_1ms"), std::ptr::null_mut()), SUCCESS);
        assert_eq!(call!(cu, cuCtxSynchronize() as fn()), SUCCESS);
        cu.free(p);
        assert_eq!(m.memory_info(0, 0).unwrap().used, CONTEXT_OVERHEAD);
        // A context on another GPU never noticed.
        cu.set_current(other);
        cu.free(p1);
        assert_eq!(m.memory_info(1, 0).unwrap().used, CONTEXT_OVERHEAD);
    });
}

#[test]
fn an_xid_aimed_at_the_process_is_sticky() {
    with_context("an_xid_aimed_at_the_process_is_sticky", |m, cu| {
        let p = cu.alloc(MIB);
        m.inject_xid(0, 31, None, Some(std::process::id())).unwrap();
        assert_eq!(cu.try_alloc(MIB), Err(ILLEGAL_ADDRESS));
        assert_eq!(call!(cu, cuCtxSynchronize() as fn()), ILLEGAL_ADDRESS);
        assert_eq!(cu.htod(p, &[1, 2, 3]), ILLEGAL_ADDRESS);
        let mut c = std::ptr::null_mut();
        assert_eq!(call!(cu, cuCtxCreate_v2(&mut c, 0, 1) as fn(*mut Handle, c_uint, c_int)), ILLEGAL_ADDRESS);
        assert_eq!(cu.try_alloc(MIB), Err(ILLEGAL_ADDRESS), "still");
        // Queries that need no context still answer, and freeing still returns the memory.
        assert_eq!(cu.device_count(), 8);
        cu.free(p);
        assert_eq!(m.memory_info(0, 0).unwrap().used, CONTEXT_OVERHEAD);
    });
}

/// Makes a 1g.10gb GPU instance with one compute instance on GPU 0 of a [`mig_and_whole`] node.
fn make_mig_device(m: &Node) -> (tessera_sim_model::GpuInstance, tessera_sim_model::ComputeInstance) {
    let gi = m.create_gpu_instance(0, 0, None).unwrap(); // NVML_GPU_INSTANCE_PROFILE_1_SLICE
    let ci = m.create_compute_instance(0, gi.id, 0, None).unwrap(); // NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE
    (gi, ci)
}

#[test]
fn mig_compute_instances_are_cuda_devices() {
    let node = SimNode::with_description(&mig_and_whole("H100-SXM5-80GB"));
    node.run_isolated("mig_compute_instances_are_cuda_devices", || {
        visible(None);
        let m = model(&node);
        let (gi, ci) = make_mig_device(&m);
        let cu = Cuda::load(&node);
        cu.init();
        // The MIG GPU shows as its one compute instance, the other GPU whole.
        assert_eq!(cu.device_count(), 2);
        assert_eq!(cu.name(0), format!("{H100_NAME} MIG 1g.10gb"));
        assert_eq!(cu.name(1), H100_NAME);
        assert_eq!(cu.uuid(0), uuid_bytes(&m.gpus()[0].mig_uuid(gi.id, ci.id, ci.serial)));
        assert_eq!(cu.attribute(16, 0), ci.sm_count as i32);
        let gi_memory = gi.profile.memory_mib * MIB;
        let mut total = 0usize;
        assert_eq!(call!(cu, cuDeviceTotalMem_v2(&mut total, 0) as fn(*mut usize, c_int)), SUCCESS);
        assert_eq!(total as u64, gi_memory);
        // Memory comes from the GPU instance.
        cu.ctx_create(0);
        let (free, total) = cu.mem_info();
        assert_eq!(total, gi_memory);
        assert_eq!(free, gi_memory - CONTEXT_OVERHEAD);
        let p = cu.alloc(100 * MIB);
        assert_eq!(m.memory_info(0, gi.slot + 1).unwrap().used, CONTEXT_OVERHEAD + 100 * MIB);
        assert_eq!(cu.try_alloc(free), Err(OUT_OF_MEMORY), "the instance's memory is all there is");
        cu.free(p);
        // Kernels run on the compute instance.
        let k = cu.function(CUBIN, "k_1ms");
        assert_eq!(cu.launch(k, std::ptr::null_mut()), SUCCESS);
        assert_eq!(call!(cu, cuCtxSynchronize() as fn()), SUCCESS);
    });
}

#[test]
fn mig_device_selected_by_uuid() {
    let node = SimNode::with_description(&mig_and_whole("H100-SXM5-80GB"));
    node.run_isolated("mig_device_selected_by_uuid", || {
        let m = model(&node);
        let _first = make_mig_device(&m);
        let (gi, ci) = make_mig_device(&m);
        visible(Some(&m.gpus()[0].mig_uuid(gi.id, ci.id, ci.serial)));
        let cu = Cuda::load(&node);
        cu.init();
        assert_eq!(cu.device_count(), 1);
        assert_eq!(cu.uuid(0), uuid_bytes(&m.gpus()[0].mig_uuid(gi.id, ci.id, ci.serial)));
        let mut can = -1;
        assert_eq!(call!(cu, cuDeviceCanAccessPeer(&mut can, 0, 0) as fn(*mut c_int, c_int, c_int)), SUCCESS);
        assert_eq!(can, 0);
    });
}

#[test]
fn contexts_primary_and_regular() {
    with_driver("contexts_primary_and_regular", |node, cu| {
        let m = model(node);
        cu.init();
        let mut cur = 0x1 as Handle;
        assert_eq!(call!(cu, cuCtxGetCurrent(&mut cur) as fn(*mut Handle)), SUCCESS);
        assert!(cur.is_null());
        assert_eq!(call!(cu, cuCtxSynchronize() as fn()), INVALID_CONTEXT);
        // Primary context: retained twice, one handle, one charge.
        let (mut p1, mut p2) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(call!(cu, cuDevicePrimaryCtxRetain(&mut p1, 2) as fn(*mut Handle, c_int)), SUCCESS);
        assert_eq!(call!(cu, cuDevicePrimaryCtxRetain(&mut p2, 2) as fn(*mut Handle, c_int)), SUCCESS);
        assert_eq!(p1, p2);
        assert_eq!(m.memory_info(2, 0).unwrap().used, CONTEXT_OVERHEAD);
        let (mut flags, mut active) = (9u32, 0);
        assert_eq!(
            call!(cu, cuDevicePrimaryCtxGetState(2, &mut flags, &mut active) as fn(c_int, *mut c_uint, *mut c_int)),
            SUCCESS
        );
        assert_eq!((flags, active), (0, 1));
        cu.set_current(p1);
        let mut dev = -1;
        assert_eq!(call!(cu, cuCtxGetDevice(&mut dev) as fn(*mut c_int)), SUCCESS);
        assert_eq!(dev, 2);
        let p = cu.alloc(10 * MIB);
        // Reset: everything it held goes; the retained handle keeps working.
        assert_eq!(call!(cu, cuDevicePrimaryCtxReset_v2(2) as fn(c_int)), SUCCESS);
        assert_eq!(call!(cu, cuMemFree_v2(p) as fn(CUdeviceptr)), INVALID_VALUE, "freed by the reset");
        assert_eq!(m.memory_info(2, 0).unwrap().used, CONTEXT_OVERHEAD);
        let q = cu.alloc(MIB);
        cu.free(q);
        for _ in 0..2 {
            assert_eq!(call!(cu, cuDevicePrimaryCtxRelease_v2(2) as fn(c_int)), SUCCESS);
        }
        assert_eq!(call!(cu, cuDevicePrimaryCtxRelease_v2(2) as fn(c_int)), INVALID_CONTEXT);
        assert_eq!(m.memory_info(2, 0).unwrap().used, 0);
        assert_eq!(cu.try_alloc(MIB), Err(709), "CONTEXT_IS_DESTROYED: a primary context not retained");
        // Regular contexts and the stack.
        let a = cu.ctx_create(3);
        let b = cu.ctx_create(4);
        let mut popped = std::ptr::null_mut();
        assert_eq!(call!(cu, cuCtxPopCurrent_v2(&mut popped) as fn(*mut Handle)), SUCCESS);
        assert_eq!(popped, b);
        assert_eq!(call!(cu, cuCtxGetCurrent(&mut cur) as fn(*mut Handle)), SUCCESS);
        assert_eq!(cur, a);
        assert_eq!(call!(cu, cuCtxPushCurrent_v2(b) as fn(Handle)), SUCCESS);
        assert_eq!(call!(cu, cuCtxDestroy_v2(b) as fn(Handle)), SUCCESS);
        assert_eq!(call!(cu, cuCtxDestroy_v2(b) as fn(Handle)), INVALID_CONTEXT);
        assert_eq!(call!(cu, cuCtxPushCurrent_v2(b) as fn(Handle)), INVALID_CONTEXT);
        assert_eq!(call!(cu, cuCtxDestroy_v2(0x4242 as Handle) as fn(Handle)), INVALID_CONTEXT);
        let mut version = 0u32;
        assert_eq!(call!(cu, cuCtxGetApiVersion(a, &mut version) as fn(Handle, *mut c_uint)), SUCCESS);
        assert_eq!(version, 3020);
        let (mut least, mut greatest) = (9, 9);
        assert_eq!(
            call!(cu, cuCtxGetStreamPriorityRange(&mut least, &mut greatest) as fn(*mut c_int, *mut c_int)),
            SUCCESS
        );
        assert_eq!((least, greatest), (0, -5));
        let mut limit = 0usize;
        assert_eq!(call!(cu, cuCtxGetLimit(&mut limit, 2) as fn(*mut usize, c_int)), SUCCESS);
        assert_eq!(limit, 8 << 20, "malloc heap");
        assert_eq!(call!(cu, cuCtxSetLimit(0, 4096) as fn(c_int, usize)), SUCCESS);
        assert_eq!(call!(cu, cuCtxGetLimit(&mut limit, 0) as fn(*mut usize, c_int)), SUCCESS);
        assert_eq!(limit, 4096);
        assert_eq!(call!(cu, cuCtxGetLimit(&mut limit, 42) as fn(*mut usize, c_int)), INVALID_VALUE);
        // Handles that are not what they claim.
        assert_eq!(cu.sync(0x1234_5678 as Handle), INVALID_HANDLE);
        assert_eq!(call!(cu, cuEventQuery(0x1234_5678 as Handle) as fn(Handle)), INVALID_HANDLE);
        let mut s = std::ptr::null_mut();
        assert_eq!(call!(cu, cuStreamCreate(&mut s, 0x10) as fn(*mut Handle, c_uint)), INVALID_VALUE);
        assert_eq!(call!(cu, cuStreamCreate(std::ptr::null_mut(), 0) as fn(*mut Handle, c_uint)), INVALID_VALUE);
        assert_eq!(call!(cu, cuCtxDestroy_v2(a) as fn(Handle)), SUCCESS);
        assert_eq!(m.memory_info(3, 0).unwrap().used, 0);
        assert_eq!(m.memory_info(4, 0).unwrap().used, 0);
    });
}

/// Raising a context's stack, printf FIFO or malloc heap limit takes device memory as the driver
/// reserves it (the stack for every thread the device holds at once), refused with
/// `CUDA_ERROR_OUT_OF_MEMORY` when it does not fit; lowered or destroyed, it comes back.
#[test]
fn raising_a_contexts_limits_takes_device_memory() {
    with_context("raising_a_contexts_limits_takes_device_memory", |m, cu| {
        let used = || m.memory_info(0, 0).unwrap().used;
        let base = used();
        let set = |limit: c_int, v: usize| call!(cu, cuCtxSetLimit(limit, v) as fn(c_int, usize));
        let get = |limit: c_int| {
            let mut v = 0usize;
            assert_eq!(call!(cu, cuCtxGetLimit(&mut v, limit) as fn(*mut usize, c_int)), SUCCESS);
            v as u64
        };
        // An H100: 132 SMs of 2048 threads each.
        let resident = 132 * 2048;
        assert_eq!(set(0, 8 << 10), SUCCESS);
        assert_eq!(used() - base, 7 * 1024 * resident, "7 KiB more stack for every resident thread");
        assert_eq!(set(2, 1 << 30), SUCCESS);
        assert_eq!(set(1, 3 << 20), SUCCESS);
        let stack_and_fifo = 7 * 1024 * resident + (2 << 20);
        assert_eq!(used() - base, stack_and_fifo, "the FIFO past its default; the heap waits for a module");
        cu.function(CUBIN, "k_1ms");
        let limits = stack_and_fifo + (1 << 30) - (8 << 20);
        assert_eq!(used() - base, limits, "the heap taken with the context's first module");
        // What does not fit is refused, and changes nothing.
        assert_eq!(set(2, 100 << 30), OUT_OF_MEMORY);
        assert_eq!(set(0, 1 << 20), OUT_OF_MEMORY, "1 MiB of stack for 270,336 threads: 264 GiB");
        assert_eq!((used() - base, get(2), get(0)), (limits, 1 << 30, 8 << 10));
        // Lowered: given back; below its default it holds nothing more.
        assert_eq!(set(0, 512), SUCCESS);
        assert_eq!(set(2, 1 << 20), SUCCESS);
        assert_eq!(used() - base, 2 << 20);
        assert_eq!(set(2, 64 << 20), SUCCESS);
        let mut ctx = std::ptr::null_mut();
        assert_eq!(call!(cu, cuCtxGetCurrent(&mut ctx) as fn(*mut Handle)), SUCCESS);
        assert_eq!(call!(cu, cuCtxDestroy_v2(ctx) as fn(Handle)), SUCCESS);
        assert_eq!(used(), 0, "destroyed with its context");
        // A heap that does not fit is refused by the module load that would take it.
        cu.ctx_create(0);
        assert_eq!(set(2, 100 << 30), SUCCESS, "nothing taken yet");
        let mut module = std::ptr::null_mut();
        let load = call!(cu, cuModuleLoadData(&mut module, CUBIN.as_ptr().cast()) as fn(*mut Handle, *const c_void));
        assert_eq!(load, 303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED");
        assert_eq!(set(2, 1 << 30), SUCCESS);
        cu.function(CUBIN, "k_1ms");
        assert_eq!(used(), CONTEXT_OVERHEAD + (1 << 30) - (8 << 20));
    });
}

#[test]
fn default_streams_and_cross_stream_waits() {
    with_driver("default_streams_and_cross_stream_waits", |_, cu| {
        cu.init();
        let main_ctx = cu.ctx_create(0) as usize;
        let k2 = cu.function(CUBIN, "k_2ms");
        let k1 = cu.function(CUBIN, "k_1ms");
        let legacy = 0x1 as Handle;
        let per_thread = 0x2 as Handle;
        // The `_ptsz` flavour takes NULL as the per-thread default stream, not the legacy one.
        assert_eq!(launch_kernel(&cu.lib, "cuLaunchKernel_ptsz", k2, 32, std::ptr::null_mut()), SUCCESS);
        assert_eq!(call!(cu, cuStreamQuery(per_thread) as fn(Handle)), NOT_READY);
        assert_eq!(call!(cu, cuStreamQuery(legacy) as fn(Handle)), SUCCESS, "the legacy stream has nothing queued");
        assert_eq!(call!(cu, cuStreamSynchronize_ptsz(std::ptr::null_mut()) as fn(Handle)), SUCCESS);
        assert_eq!(call!(cu, cuStreamQuery(per_thread) as fn(Handle)), SUCCESS);
        // Another thread has a per-thread default stream of its own.
        assert_eq!(cu.launch(k2, per_thread), SUCCESS);
        std::thread::scope(|s| {
            s.spawn(|| {
                let per_thread = 0x2 as Handle;
                cu.set_current(main_ctx as Handle);
                assert_eq!(call!(cu, cuStreamQuery(per_thread) as fn(Handle)), SUCCESS);
            });
        });
        assert_eq!(cu.sync(per_thread), SUCCESS);
        // A stream waiting on an event recorded in another starts after it.
        let (a, b) = (cu.stream(), cu.stream());
        let (start, mid, end) = (cu.event(0), cu.event(0), cu.event(0));
        cu.record(start, a);
        assert_eq!(cu.launch(k2, a), SUCCESS);
        cu.record(mid, a);
        assert_eq!(call!(cu, cuStreamWaitEvent(b, mid, 0) as fn(Handle, Handle, c_uint)), SUCCESS);
        assert_eq!(cu.launch(k1, b), SUCCESS);
        cu.record(end, b);
        assert_eq!(cu.sync(b), SUCCESS);
        let ms = cu.elapsed(start, end).unwrap();
        // At least the two kernels back to back (the wait ordered them); the upper bound only
        // catches a lost wake-up, since the wait blocks a host thread on a shared machine.
        assert!((2.9..50.0).contains(&ms), "2 ms then 1 ms across two streams took {ms} ms");
        // Synchronizing the legacy stream waits for the blocking streams too.
        assert_eq!(cu.launch(k2, a), SUCCESS);
        let t0 = Instant::now();
        assert_eq!(cu.sync(std::ptr::null_mut()), SUCCESS);
        assert!(t0.elapsed() >= Duration::from_micros(1800));
        // A pinned buffer and a synchronous copy after a kernel: the copy waits for it.
        assert_eq!(cu.launch(k2, a), SUCCESS);
        let dev = cu.alloc(16);
        let t0 = Instant::now();
        assert_eq!(cu.htod(dev, &[7u8; 16]), SUCCESS);
        assert!(t0.elapsed() >= Duration::from_micros(1800), "cuMemcpyHtoD is ordered after blocking streams");
    });
}

#[test]
fn jit_linking_keeps_the_entries_of_its_inputs() {
    with_context("jit_linking_keeps_the_entries_of_its_inputs", |_, cu| {
        let link = || {
            let mut state = std::ptr::null_mut();
            assert_eq!(
                call!(
                    cu,
                    cuLinkCreate_v2(0, std::ptr::null_mut(), std::ptr::null_mut(), &mut state)
                        as fn(c_uint, *mut c_int, *mut *mut c_void, *mut Handle)
                ),
                SUCCESS
            );
            state
        };
        let add = |state: Handle, kind: c_int, data: &[u8]| {
            call!(
                cu,
                cuLinkAddData_v2(
                    state,
                    kind,
                    data.as_ptr().cast_mut().cast(),
                    data.len(),
                    c"input".as_ptr(),
                    0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut()
                )
                    as fn(Handle, c_int, *mut c_void, usize, *const c_char, c_uint, *mut c_int, *mut *mut c_void)
            )
        };
        let complete = |state: Handle| {
            let (mut image, mut size) = (std::ptr::null_mut::<c_void>(), 0usize);
            let r = call!(cu, cuLinkComplete(state, &mut image, &mut size) as fn(Handle, *mut *mut c_void, *mut usize));
            (r, image, size)
        };
        let load_and_get = |image: *mut c_void, name: &CStr| {
            let mut module = std::ptr::null_mut();
            assert_eq!(call!(cu, cuModuleLoadData(&mut module, image) as fn(*mut Handle, *const c_void)), SUCCESS);
            let mut f = std::ptr::null_mut();
            call!(cu, cuModuleGetFunction(&mut f, module, name.as_ptr()) as fn(*mut Handle, Handle, *const c_char))
        };
        // Two PTX inputs: the linked image declares both entries, and nothing else.
        let state = link();
        assert_eq!(complete(state).0, INVALID_VALUE, "nothing to link");
        let a = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry first_2us(\n)\n{\n ret;\n}\n\0";
        let b = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry second_1ms(\n)\n{\n ret;\n}\n";
        assert_eq!(add(state, 1, a), SUCCESS);
        assert_eq!(add(state, 1, b), SUCCESS);
        assert_eq!(add(state, 9, b), NOT_SUPPORTED, "an input kind the sim does not take");
        let (r, image, size) = complete(state);
        assert_eq!(r, SUCCESS);
        assert!(size > a.len(), "{size}");
        assert_eq!(load_and_get(image, c"first_2us"), SUCCESS);
        assert_eq!(load_and_get(image, c"second_1ms"), SUCCESS);
        assert_eq!(load_and_get(image, c"third"), NOT_FOUND);
        assert_eq!(add(state, 1, b), INVALID_VALUE, "a completed link takes no more input");
        assert_eq!(call!(cu, cuLinkDestroy(state) as fn(Handle)), SUCCESS);
        assert_eq!(call!(cu, cuLinkDestroy(state) as fn(Handle)), INVALID_HANDLE, "destroyed once");
        assert_eq!(add(state, 1, b), INVALID_HANDLE);
        // A cubin (even one passed as PTX, as CuPy passes NVRTC's): an opaque image.
        let state = link();
        assert_eq!(add(state, 1, b"\x7fELF\x02\x01\x01"), SUCCESS);
        let (r, image, _) = complete(state);
        assert_eq!(r, SUCCESS);
        assert_eq!(load_and_get(image, c"anything_5us"), SUCCESS);
        assert_eq!(call!(cu, cuLinkDestroy(state) as fn(Handle)), SUCCESS);

        // Occupancy of a 256-thread block on an H100: 2048 threads per SM.
        let f = cu.function(CUBIN, "k");
        let mut n = -1;
        assert_eq!(
            call!(
                cu,
                cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&mut n, f, 256, 0, 0)
                    as fn(*mut c_int, Handle, c_int, usize, c_uint)
            ),
            SUCCESS
        );
        assert_eq!(n, 8);
        assert_eq!(
            call!(
                cu,
                cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&mut n, f, 256, 0, 4)
                    as fn(*mut c_int, Handle, c_int, usize, c_uint)
            ),
            INVALID_VALUE,
            "unknown flags"
        );
        assert_eq!(
            call!(
                cu,
                cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, 0x1234 as Handle, 256, 0)
                    as fn(*mut c_int, Handle, c_int, usize)
            ),
            INVALID_HANDLE
        );
    });
}

#[test]
fn functions_the_sim_does_not_model_resolve_and_say_so() {
    with_driver("functions_the_sim_does_not_model_resolve_and_say_so", |_, cu| {
        type GetProc = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> u32;
        let get: GetProc = cu.sym("cuGetProcAddress_v2");
        for (name, version, flags, symbol) in [
            ("cuIpcGetMemHandle", 12080, 0, "cuIpcGetMemHandle"),
            ("cuIpcOpenMemHandle", 12080, 0, "cuIpcOpenMemHandle_v2"),
            ("cuMemcpy3D", 12080, 2, "cuMemcpy3D_v2_ptds"),
            ("cuStreamWaitValue32", 12080, 2, "cuStreamWaitValue32_v2_ptsz"),
            ("cuGraphExecUpdate", 11000, 0, "cuGraphExecUpdate"),
            ("cuGraphExecUpdate", 12080, 0, "cuGraphExecUpdate_v2"),
        ] {
            let cname = CString::new(name).unwrap();
            let (mut p, mut status) = (std::ptr::null_mut(), -1);
            // SAFETY: the cuGetProcAddress_v2 signature, with valid pointers.
            let r = unsafe { get(cname.as_ptr(), &mut p, version, flags, &mut status) };
            assert_eq!((r, status), (SUCCESS, 0), "{name}");
            assert_eq!(p, cu.addr(symbol), "{name} {version} {flags}");
        }
        cu.init();
        let mut handle = [0u8; 64];
        // (Memory handles are modelled; event handles are not.)
        assert_eq!(
            call!(cu, cuIpcGetEventHandle(handle.as_mut_ptr(), std::ptr::null_mut()) as fn(*mut u8, Handle)),
            NOT_SUPPORTED
        );
        assert_eq!(handle, [0u8; 64], "nothing written");
        assert_eq!(
            call!(cu, cuIpcGetMemHandle(handle.as_mut_ptr(), 0) as fn(*mut u8, CUdeviceptr)),
            INVALID_VALUE,
            "not an allocation"
        );
    });
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` for `bytes` of pinned memory on device 0.
fn graph_alloc_params(bytes: usize) -> cudarc::driver::sys::CUDA_MEM_ALLOC_NODE_PARAMS {
    // SAFETY: all-zero is a valid value of this plain C struct (null pointers, zero enums listed).
    let mut p: cudarc::driver::sys::CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
    p.poolProps.allocType = cudarc::driver::sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.poolProps.location.type_ = cudarc::driver::sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.bytesize = bytes;
    p
}

type AllocParams = cudarc::driver::sys::CUDA_MEM_ALLOC_NODE_PARAMS;

/// Graph helpers over the driver: create, add memory nodes, instantiate, launch, attributes.
struct Graphs<'a> {
    cu: &'a Cuda,
}

impl Graphs<'_> {
    fn create(&self) -> Handle {
        let mut g = std::ptr::null_mut();
        assert_eq!(call!(self.cu, cuGraphCreate(&mut g, 0) as fn(*mut Handle, c_uint)), SUCCESS);
        g
    }
    /// Adds an allocation node (after `deps`); its node and its address, or the error.
    fn alloc(&self, g: Handle, deps: &[Handle], p: &mut AllocParams) -> Result<(Handle, u64), u32> {
        let mut n = std::ptr::null_mut();
        let rc = call!(
            self.cu,
            cuGraphAddMemAllocNode(&mut n, g, deps.as_ptr(), deps.len(), p)
                as fn(*mut Handle, Handle, *const Handle, usize, *mut AllocParams)
        );
        if rc == SUCCESS { Ok((n, p.dptr)) } else { Err(rc) }
    }
    fn free(&self, g: Handle, deps: &[Handle], dptr: u64) -> Result<Handle, u32> {
        let mut n = std::ptr::null_mut();
        let rc = call!(
            self.cu,
            cuGraphAddMemFreeNode(&mut n, g, deps.as_ptr(), deps.len(), dptr)
                as fn(*mut Handle, Handle, *const Handle, usize, u64)
        );
        if rc == SUCCESS { Ok(n) } else { Err(rc) }
    }
    fn instantiate(&self, g: Handle, flags: u64) -> Result<Handle, u32> {
        let mut e = std::ptr::null_mut();
        let rc = call!(self.cu, cuGraphInstantiateWithFlags(&mut e, g, flags) as fn(*mut Handle, Handle, u64));
        if rc == SUCCESS { Ok(e) } else { Err(rc) }
    }
    fn launch(&self, e: Handle, s: Handle) -> u32 {
        call!(self.cu, cuGraphLaunch(e, s) as fn(Handle, Handle))
    }
    fn exec_destroy(&self, e: Handle) {
        assert_eq!(call!(self.cu, cuGraphExecDestroy(e) as fn(Handle)), SUCCESS);
    }
    fn attr(&self, dev: c_int, a: c_int) -> u64 {
        let mut v = 0u64;
        assert_eq!(call!(self.cu, cuDeviceGetGraphMemAttribute(dev, a, &mut v) as fn(c_int, c_int, *mut u64)), SUCCESS);
        v
    }
    /// (used, reserved) of a device's graph pool.
    fn pool(&self, dev: c_int) -> (u64, u64) {
        (self.attr(dev, 0), self.attr(dev, 2))
    }
    fn trim(&self, dev: c_int) {
        assert_eq!(call!(self.cu, cuDeviceGraphMemTrim(dev) as fn(c_int)), SUCCESS);
    }
}

/// `CUgraphNodeParams` for a child graph node: type 4, then the child graph and its ownership
/// at byte 16 (256 bytes in all).
#[repr(C)]
struct ChildParams {
    type_: c_int,
    reserved0: [c_int; 3],
    graph: Handle,
    ownership: c_uint,
    rest: [u32; 57],
}

#[test]
fn child_graphs_are_cloned_without_memory_nodes_or_moved_with_them() {
    with_graphs("child_graphs_are_cloned_without_memory_nodes_or_moved_with_them", |m, cu, gr, s| {
        let used = || m.memory_info(0, 0).unwrap().used;
        let base = used();
        let embed = |parent: Handle, child: Handle, ownership: c_uint| {
            let mut n = std::ptr::null_mut();
            let mut p = ChildParams { type_: 4, reserved0: [0; 3], graph: child, ownership, rest: [0; 57] };
            let rc = call!(
                cu,
                cuGraphAddNode(&mut n, parent, std::ptr::null(), 0, &mut p)
                    as fn(*mut Handle, Handle, *const Handle, usize, *mut ChildParams)
            );
            (rc, n)
        };
        let child_of = |n: Handle| {
            let mut g = std::ptr::null_mut();
            let rc = call!(cu, cuGraphChildGraphNodeGetGraph(n, &mut g) as fn(Handle, *mut Handle));
            (rc, g)
        };
        let node_type = |n: Handle| {
            let mut t: c_int = -1;
            assert_eq!(call!(cu, cuGraphNodeGetType(n, &mut t) as fn(Handle, *mut c_int)), SUCCESS);
            t
        };

        // Cloned: a child without memory nodes, through either call; its graph is a copy.
        let plain = gr.create();
        let mut n = std::ptr::null_mut();
        let rc = call!(
            cu,
            cuGraphAddEmptyNode(&mut n, plain, std::ptr::null(), 0) as fn(*mut Handle, Handle, *const Handle, usize)
        );
        assert_eq!(rc, SUCCESS);
        let parent = gr.create();
        let mut cloned = std::ptr::null_mut();
        let rc = call!(
            cu,
            cuGraphAddChildGraphNode(&mut cloned, parent, std::ptr::null(), 0, plain)
                as fn(*mut Handle, Handle, *const Handle, usize, Handle)
        );
        assert_eq!(rc, SUCCESS);
        assert_eq!(node_type(cloned), 4, "CU_GRAPH_NODE_TYPE_GRAPH");
        let (rc, copy) = child_of(cloned);
        assert_eq!(rc, SUCCESS);
        assert_ne!(copy, plain, "a clone, not the graph given");
        assert_eq!(embed(parent, plain, 0).0, SUCCESS, "cuGraphAddNode, CLONE");
        assert_eq!(call!(cu, cuGraphDestroy(copy) as fn(Handle)), INVALID_VALUE, "an embedded graph is its node's");
        assert_eq!(call!(cu, cuGraphDestroy(plain) as fn(Handle)), SUCCESS, "the original is the caller's still");

        // With a memory node: never cloned; moved, it allocates when its parent launches.
        let child = gr.create();
        let mut p = graph_alloc_params(64 * MIB as usize);
        gr.alloc(child, &[], &mut p).unwrap();
        let holder = gr.create();
        let rc = call!(
            cu,
            cuGraphAddChildGraphNode(&mut n, holder, std::ptr::null(), 0, child)
                as fn(*mut Handle, Handle, *const Handle, usize, Handle)
        );
        assert_eq!(rc, INVALID_VALUE, "a cloned child may not hold memory nodes");
        assert_eq!(embed(holder, child, 0).0, INVALID_VALUE, "nor through cuGraphAddNode");
        assert_eq!(embed(child, child, 1).0, INVALID_VALUE, "not into itself");
        let (rc, moved) = embed(holder, child, 1);
        assert_eq!(rc, SUCCESS);
        assert_eq!(child_of(moved), (SUCCESS, child), "moved: the very graph");
        assert_eq!(embed(parent, child, 1).0, INVALID_VALUE, "not into a second parent");
        assert_eq!(embed(child, holder, 1).0, INVALID_VALUE, "not its parent into itself");
        assert_eq!(gr.instantiate(child, 0), Err(INVALID_VALUE), "not instantiated by itself");
        assert_eq!(
            gr.alloc(child, &[], &mut graph_alloc_params(MIB as usize)),
            Err(INVALID_VALUE),
            "no new memory nodes"
        );
        let e = gr.instantiate(holder, 0).unwrap();
        assert_eq!(used(), base);
        assert_eq!(gr.launch(e, s), SUCCESS);
        assert_eq!(used(), base + 64 * MIB, "the moved child's allocation");
        gr.exec_destroy(e);
        // Destroying the parent destroys what it embeds.
        assert_eq!(call!(cu, cuGraphDestroy(holder) as fn(Handle)), SUCCESS);
        assert_eq!(gr.instantiate(child, 0), Err(INVALID_VALUE), "gone with its parent");
        assert_eq!(call!(cu, cuGraphDestroy(parent) as fn(Handle)), SUCCESS);
        // Node types cuGraphAddNode does not model (an event wait node) say so; a kernel node is
        // modelled (tests/graph_nodes.rs), and one without a function refused.
        let g = gr.create();
        for (type_, expected) in [(6, NOT_SUPPORTED), (0, INVALID_VALUE)] {
            let mut p =
                ChildParams { type_, reserved0: [0; 3], graph: std::ptr::null_mut(), ownership: 0, rest: [0; 57] };
            let rc = call!(
                cu,
                cuGraphAddNode(&mut n, g, std::ptr::null(), 0, &mut p)
                    as fn(*mut Handle, Handle, *const Handle, usize, *mut ChildParams)
            );
            assert_eq!(rc, expected, "node type {type_}");
        }
    });
}

#[test]
fn graph_memory_nodes_allocate_at_launch_and_free_at_their_free_node() {
    with_graphs("graph_memory_nodes_allocate_at_launch_and_free_at_their_free_node", |m, cu, gr, s| {
        let (free, _) = cu.mem_info();
        let used = || m.memory_info(0, 0).unwrap().used;
        let base = used();
        // An allocation node reserves its address when added; nothing is charged yet.
        let g = gr.create();
        let mut p = graph_alloc_params(256 * MIB as usize);
        let (n, dptr) = gr.alloc(g, &[], &mut p).unwrap();
        assert_ne!(dptr, 0);
        assert_eq!(used(), base);
        let mut back = graph_alloc_params(0);
        assert_eq!(call!(cu, cuGraphMemAllocNodeGetParams(n, &mut back) as fn(Handle, *mut AllocParams)), SUCCESS);
        assert_eq!((back.bytesize, back.dptr, back.poolProps.location.id), (p.bytesize, dptr, 0));
        let e = gr.instantiate(g, 0).unwrap();
        assert_eq!(used(), base, "instantiating takes nothing");
        assert_eq!(
            gr.instantiate(g, 0),
            Err(INVALID_VALUE),
            "one executable graph at a time for a graph with memory nodes"
        );
        // Launching charges it, at that address; the memory is real.
        assert_eq!(gr.launch(e, s), SUCCESS);
        assert_eq!(used(), base + 256 * MIB);
        assert_eq!(cu.mem_info().0, free - 256 * MIB);
        assert_eq!(gr.pool(0), (256 * MIB, 256 * MIB), "USED_MEM_CURRENT, RESERVED_MEM_CURRENT");
        assert_eq!(cu.htod(dptr + 100, &[5]), SUCCESS);
        // The graph cannot run again while its allocation lives.
        assert_eq!(gr.launch(e, s), INVALID_VALUE);
        assert_eq!(used(), base + 256 * MIB, "a refused launch charges nothing");
        // Freed outside the graph (cuMemFree), the memory stays in the device's graph pool.
        cu.free(dptr);
        assert_eq!(used(), base + 256 * MIB, "kept by the graph pool");
        assert_eq!(gr.pool(0), (0, 256 * MIB));
        assert_eq!((gr.attr(0, 1), gr.attr(0, 3)), (256 * MIB, 256 * MIB), "high watermarks");
        // Relaunched, it takes its memory from the pool: nothing new is charged.
        assert_eq!(gr.launch(e, s), SUCCESS);
        assert_eq!(used(), base + 256 * MIB);
        assert_eq!(gr.pool(0), (256 * MIB, 256 * MIB));
        // A free node in another graph ends it.
        let g2 = gr.create();
        let f = gr.free(g2, &[], dptr).unwrap();
        let mut got = 0u64;
        assert_eq!(call!(cu, cuGraphMemFreeNodeGetParams(f, &mut got) as fn(Handle, *mut u64)), SUCCESS);
        assert_eq!(got, dptr);
        let mut ty: c_int = -1;
        assert_eq!(call!(cu, cuGraphNodeGetType(f, &mut ty) as fn(Handle, *mut c_int)), SUCCESS);
        assert_eq!(ty, 11, "CU_GRAPH_NODE_TYPE_MEM_FREE");
        let e2 = gr.instantiate(g2, 0).unwrap();
        assert_eq!(gr.launch(e2, s), SUCCESS);
        assert_eq!(gr.pool(0), (0, 256 * MIB));
        assert_eq!(gr.launch(e2, s), INVALID_VALUE, "freed twice");
        // Destroying the executable graphs returns nothing; trimming returns the pool's free part.
        gr.exec_destroy(e);
        gr.exec_destroy(e2);
        assert_eq!(used(), base + 256 * MIB);
        gr.trim(0);
        assert_eq!(used(), base);
        assert_eq!(gr.pool(0), (0, 0));
        // Destroyed, its graph may be instantiated again.
        let e = gr.instantiate(g, 0).unwrap();
        // More than the device has: the launch fails with OUT_OF_MEMORY and charges nothing.
        let g3 = gr.create();
        let mut big = graph_alloc_params(free as usize + 1);
        gr.alloc(g3, &[], &mut big).unwrap();
        let e3 = gr.instantiate(g3, 0).unwrap();
        assert_eq!(gr.launch(e3, s), OUT_OF_MEMORY);
        assert_eq!(used(), base);
        assert_eq!(gr.pool(0), (0, 0));
        // Bad requests.
        assert_eq!(gr.alloc(g3, &[], &mut graph_alloc_params(0)), Err(INVALID_VALUE));
        let mut elsewhere = graph_alloc_params(MIB as usize);
        elsewhere.poolProps.location.id = 99;
        assert_eq!(gr.alloc(g3, &[], &mut elsewhere), Err(INVALID_VALUE), "no such device");
        assert_eq!(gr.free(g3, &[], 0x1234), Err(INVALID_VALUE), "not a graph allocation");
        assert_eq!(gr.instantiate(gr.create(), 0x1 | 0x4).err(), Some(INVALID_VALUE), "auto-free with device launch");
        let mut v = 5u64;
        assert_eq!(call!(cu, cuDeviceSetGraphMemAttribute(0, 1, &mut v) as fn(c_int, c_int, *mut u64)), INVALID_VALUE);
        v = 0;
        assert_eq!(call!(cu, cuDeviceSetGraphMemAttribute(0, 1, &mut v) as fn(c_int, c_int, *mut u64)), SUCCESS);
        assert_eq!(gr.attr(0, 1), 0, "the high watermark reset to current");
        gr.exec_destroy(e);
    });
}

#[test]
fn the_graph_pool_reuses_freed_memory_and_follows_each_node_to_its_device() {
    with_graphs("the_graph_pool_reuses_freed_memory_and_follows_each_node_to_its_device", |m, cu, gr, s| {
        let used = |gpu: u32| m.memory_info(gpu, 0).unwrap().used;
        let (base0, base1) = (used(0), used(1));
        // alloc A (1 GiB) -> free A -> alloc B (512 MiB) -> free B: B reuses A's memory.
        let g = gr.create();
        let (a, pa) = gr.alloc(g, &[], &mut graph_alloc_params(GIB as usize)).unwrap();
        let fa = gr.free(g, &[a], pa).unwrap();
        let (b, pb) = gr.alloc(g, &[fa], &mut graph_alloc_params(512 * MIB as usize)).unwrap();
        gr.free(g, &[b], pb).unwrap();
        // A node on device 1 allocates there, whatever stream launches the graph.
        let mut on1 = graph_alloc_params(128 * MIB as usize);
        on1.poolProps.location.id = 1;
        let (_, p1) = gr.alloc(g, &[], &mut on1).unwrap();
        let e = gr.instantiate(g, 0).unwrap();
        for launch in 0..3 {
            assert_eq!(gr.launch(e, s), if launch == 0 { SUCCESS } else { INVALID_VALUE }, "launch {launch}");
        }
        assert_eq!(used(0), base0 + GIB, "the in-graph free let B reuse A's memory");
        assert_eq!(gr.pool(0), (0, GIB));
        assert_eq!(used(1), base1 + 128 * MIB);
        assert_eq!(gr.pool(1), (128 * MIB, 128 * MIB));
        // cuMemFreeAsync ends a graph allocation too.
        assert_eq!(call!(cu, cuMemFreeAsync(p1, s) as fn(CUdeviceptr, Handle)), SUCCESS);
        assert_eq!(gr.pool(1), (0, 128 * MIB));
        // Several launches of a graph that frees what it allocates take nothing more.
        for _ in 0..5 {
            assert_eq!(gr.launch(e, s), SUCCESS);
            assert_eq!(call!(cu, cuMemFreeAsync(p1, s) as fn(CUdeviceptr, Handle)), SUCCESS);
        }
        assert_eq!((used(0), used(1)), (base0 + GIB, base1 + 128 * MIB));
        // A launch that runs out of memory midway takes nothing: what it allocated goes back to the pool.
        let g2 = gr.create();
        let (x, px) = gr.alloc(g2, &[], &mut graph_alloc_params(2 * GIB as usize)).unwrap();
        let (free, _) = cu.mem_info();
        gr.alloc(g2, &[x], &mut graph_alloc_params(free as usize)).unwrap();
        let e2 = gr.instantiate(g2, 0).unwrap();
        assert_eq!(gr.launch(e2, s), OUT_OF_MEMORY);
        assert_eq!(gr.pool(0), (0, 2 * GIB), "the first node's memory stays in the pool");
        assert_eq!(call!(cu, cuMemFree_v2(px) as fn(CUdeviceptr)), INVALID_VALUE, "no live allocation is left behind");
        gr.trim(0);
        gr.trim(1);
        assert_eq!((used(0), used(1)), (base0, base1));
    });
}

#[test]
fn auto_free_relaunches_and_captured_stream_ordered_allocations_are_graph_memory() {
    with_graphs("auto_free_relaunches_and_captured_stream_ordered_allocations_are_graph_memory", |m, cu, gr, s| {
        let used = || m.memory_info(0, 0).unwrap().used;
        let base = used();
        // AUTO_FREE_ON_LAUNCH: a relaunch frees the previous launch's allocation first.
        let g = gr.create();
        gr.alloc(g, &[], &mut graph_alloc_params(64 * MIB as usize)).unwrap();
        let e = gr.instantiate(g, 0x1).unwrap();
        for _ in 0..3 {
            assert_eq!(gr.launch(e, s), SUCCESS);
        }
        assert_eq!(gr.pool(0), (64 * MIB, 64 * MIB));
        assert_eq!(used(), base + 64 * MIB);
        // cuMemAllocAsync and cuMemFreeAsync on a capturing stream become memory nodes.
        assert_eq!(call!(cu, cuStreamBeginCapture_v2(s, 0) as fn(Handle, c_uint)), SUCCESS);
        let mut p = 0u64;
        assert_eq!(
            call!(cu, cuMemAllocAsync(&mut p, 32 * MIB as usize, s) as fn(*mut CUdeviceptr, usize, Handle)),
            SUCCESS
        );
        assert_ne!(p, 0);
        assert_eq!(used(), base + 64 * MIB, "captured: nothing allocated yet");
        assert_eq!(call!(cu, cuMemFreeAsync(p, s) as fn(CUdeviceptr, Handle)), SUCCESS);
        let mut captured = std::ptr::null_mut();
        assert_eq!(call!(cu, cuStreamEndCapture(s, &mut captured) as fn(Handle, *mut Handle)), SUCCESS);
        let mut n = 0usize;
        assert_eq!(
            call!(cu, cuGraphGetNodes(captured, std::ptr::null_mut(), &mut n) as fn(Handle, *mut Handle, *mut usize)),
            SUCCESS
        );
        assert_eq!(n, 2, "an allocation node and a free node");
        let ce = gr.instantiate(captured, 0).unwrap();
        assert_eq!(gr.launch(ce, s), SUCCESS);
        assert_eq!(gr.pool(0), (64 * MIB, 96 * MIB), "the pool had nothing free: it grew, and keeps what was freed");
        assert_eq!(used(), base + 96 * MIB);
        gr.exec_destroy(e);
        gr.exec_destroy(ce);
        gr.trim(0);
        assert_eq!(used(), base + 64 * MIB, "a live allocation outlives its executable graph and a trim");
    });
}

#[test]
fn pools_keep_freed_memory_up_to_their_release_threshold() {
    with_context("pools_keep_freed_memory_up_to_their_release_threshold", |m, cu| {
        let s = cu.stream();
        let used = || m.memory_info(0, 0).unwrap().used;
        let base = used();
        let mut pool = std::ptr::null_mut();
        assert_eq!(call!(cu, cuDeviceGetDefaultMemPool(&mut pool, 0) as fn(*mut Handle, c_int)), SUCCESS);
        let attr = |a: c_int| {
            let mut v = 0u64;
            assert_eq!(
                call!(cu, cuMemPoolGetAttribute(pool, a, (&raw mut v).cast()) as fn(Handle, c_int, *mut c_void)),
                SUCCESS
            );
            v
        };
        let alloc = |bytes: u64| {
            let mut p = 0;
            assert_eq!(
                call!(cu, cuMemAllocAsync(&mut p, bytes as usize, s) as fn(*mut CUdeviceptr, usize, Handle)),
                SUCCESS
            );
            p
        };
        let free_async = |p: CUdeviceptr| {
            assert_eq!(call!(cu, cuMemFreeAsync(p, s) as fn(CUdeviceptr, Handle)), SUCCESS);
        };
        // Threshold 0 (the default): a free returns the memory.
        free_async(alloc(64 * MIB));
        assert_eq!(used(), base);
        // Threshold 1 GiB: freed memory stays reserved, counted on the device, and is reused.
        let mut threshold = GIB;
        assert_eq!(
            call!(cu, cuMemPoolSetAttribute(pool, 4, (&raw mut threshold).cast()) as fn(Handle, c_int, *mut c_void)),
            SUCCESS
        );
        free_async(alloc(512 * MIB));
        assert_eq!(used(), base + 512 * MIB, "kept by the pool");
        assert_eq!((attr(5), attr(7)), (512 * MIB, 0), "reserved, used");
        let p = alloc(256 * MIB);
        assert_eq!(used(), base + 512 * MIB, "served from the reserve: no new charge");
        assert_eq!((attr(5), attr(7)), (512 * MIB, 256 * MIB));
        cu.free(p); // cuMemFree of a pool allocation goes back to the pool too
        assert_eq!(used(), base + 512 * MIB);
        // A free beyond the threshold releases the excess.
        free_async(alloc(2 * GIB));
        assert_eq!(used(), base + GIB, "kept up to the threshold");
        assert_eq!(attr(5), GIB);
        // Trimming releases the reserve down to what is asked.
        assert_eq!(call!(cu, cuMemPoolTrimTo(pool, 100 * MIB as usize) as fn(Handle, usize)), SUCCESS);
        assert_eq!(used(), base + 100 * MIB);
        assert_eq!(call!(cu, cuMemPoolTrimTo(pool, 0) as fn(Handle, usize)), SUCCESS);
        assert_eq!(used(), base);
        assert_eq!(attr(5), 0);
        // The device's whole memory can still be allocated once the reserve is used up.
        free_async(alloc(GIB));
        let (free, _) = cu.mem_info();
        let all = alloc(free + GIB);
        assert_eq!(cu.mem_info().0, 0);
        free_async(all);
        assert_eq!(used(), base + GIB);
    });
}

/// `CUDA_ARRAY3D_DESCRIPTOR` as the driver reads it (the format as its raw value).
#[repr(C)]
struct Array3d {
    width: usize,
    height: usize,
    depth: usize,
    format: u32,
    channels: c_uint,
    flags: c_uint,
}

#[test]
fn mipmapped_arrays_are_charged_their_levels_and_each_level_is_an_array() {
    with_context("mipmapped_arrays_are_charged_their_levels_and_each_level_is_an_array", |m, cu| {
        let used = || m.memory_info(0, 0).unwrap().used;
        let base = used();
        let create = |d: &Array3d, levels: c_uint| {
            let mut h = std::ptr::null_mut();
            let rc = call!(cu, cuMipmappedArrayCreate(&mut h, d, levels) as fn(*mut Handle, *const Array3d, c_uint));
            if rc == SUCCESS { Ok(h) } else { Err(rc) }
        };
        // 4096 x 4096 RGBA float (16 bytes a texel), the full chain of 13 levels: every level's
        // bytes, each rounded up to 512, summed.
        let rgba = Array3d { width: 4096, height: 4096, depth: 0, format: 0x20, channels: 4, flags: 0 };
        let h = create(&rgba, 13).unwrap();
        let expected: u64 = (0..13).map(|i| ((4096u64 >> i) * (4096 >> i) * 16).next_multiple_of(512)).sum();
        assert_eq!(used(), base + expected);
        let mut req = [0usize; 4];
        assert_eq!(
            call!(
                cu,
                cuMipmappedArrayGetMemoryRequirements(req.as_mut_ptr().cast(), h, 0) as fn(*mut c_void, Handle, c_int)
            ),
            SUCCESS
        );
        assert_eq!((req[0] as u64, req[1] as u64), (expected, 2 * MIB), "size, alignment");
        // Each level is an array: its descriptor, and bytes copied through it.
        let level = |i: c_uint| {
            let mut a = std::ptr::null_mut();
            let rc = call!(cu, cuMipmappedArrayGetLevel(&mut a, h, i) as fn(*mut Handle, Handle, c_uint));
            if rc == SUCCESS { Ok(a) } else { Err(rc) }
        };
        let l3 = level(3).unwrap();
        let mut d = Array3d { width: 0, height: 0, depth: 9, format: 0, channels: 0, flags: 9 };
        assert_eq!(call!(cu, cuArray3DGetDescriptor_v2(&mut d, l3) as fn(*mut Array3d, Handle)), SUCCESS);
        assert_eq!((d.width, d.height, d.depth, d.format, d.channels), (512, 512, 0, 0x20, 4));
        let l12 = level(12).unwrap();
        assert_eq!(call!(cu, cuArray3DGetDescriptor_v2(&mut d, l12) as fn(*mut Array3d, Handle)), SUCCESS);
        assert_eq!((d.width, d.height), (1, 1));
        let bytes: Vec<u8> = (0..16).collect();
        assert_eq!(
            call!(cu, cuMemcpyHtoA_v2(l12, 0, bytes.as_ptr().cast(), 16) as fn(Handle, usize, *const c_void, usize)),
            SUCCESS
        );
        let mut back = [0u8; 16];
        assert_eq!(
            call!(cu, cuMemcpyAtoH_v2(back.as_mut_ptr().cast(), l12, 0, 16) as fn(*mut c_void, Handle, usize, usize)),
            SUCCESS
        );
        assert_eq!(back.to_vec(), bytes);
        assert_eq!(level(13), Err(INVALID_VALUE), "no 14th level");
        assert_eq!(call!(cu, cuArrayDestroy(l3) as fn(Handle)), INVALID_VALUE, "a level goes with its mipmapped array");
        // Destroying returns everything; the handle and its levels are gone.
        assert_eq!(call!(cu, cuMipmappedArrayDestroy(h) as fn(Handle)), SUCCESS);
        assert_eq!(used(), base);
        assert_eq!(call!(cu, cuMipmappedArrayDestroy(h) as fn(Handle)), INVALID_HANDLE);
        assert_eq!(call!(cu, cuArray3DGetDescriptor_v2(&mut d, l3) as fn(*mut Array3d, Handle)), INVALID_HANDLE);
        // A layered array keeps its layers at every level.
        let layered = Array3d { width: 256, height: 256, depth: 10, format: 0x01, channels: 1, flags: 0x01 };
        let h = create(&layered, 3).unwrap();
        assert_eq!(used(), base + (256 * 256 + 128 * 128 + 64 * 64) * 10);
        // Bad requests charge nothing.
        assert_eq!(create(&rgba, 14), Err(INVALID_VALUE), "more levels than halvings");
        assert_eq!(create(&rgba, 0), Err(INVALID_VALUE));
        let sparse = Array3d { flags: 0x40, ..rgba };
        assert_eq!(create(&sparse, 1), Err(NOT_SUPPORTED), "sparse arrays are not modelled");
        let huge = Array3d { width: 131072, height: 65536, depth: 0, format: 0x20, channels: 4, flags: 0 };
        assert_eq!(create(&huge, 1), Err(OUT_OF_MEMORY), "128 GiB: more than the board");
        assert_eq!(used(), base + (256 * 256 + 128 * 128 + 64 * 64) * 10);
        let mut sp = [0u8; 64];
        assert_eq!(
            call!(cu, cuMipmappedArrayGetSparseProperties(sp.as_mut_ptr().cast(), h) as fn(*mut c_void, Handle)),
            NOT_SUPPORTED
        );
        // Destroying the context frees it.
        let mut ctx = std::ptr::null_mut();
        assert_eq!(call!(cu, cuCtxGetCurrent(&mut ctx) as fn(*mut Handle)), SUCCESS);
        assert_eq!(call!(cu, cuCtxDestroy_v2(ctx) as fn(Handle)), SUCCESS);
        assert_eq!(used(), base - CONTEXT_OVERHEAD);
    });
}
