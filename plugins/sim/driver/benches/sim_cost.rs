//! The simulated driver's own cost per call, so measurements of Tessera's overhead (the shim, the
//! daemon's queries) can subtract it. Every figure is reported beside a baseline measured in the
//! same run (a `getppid` system call), since these machines are shared and noisy.
//!
//! Run: `cargo bench -p tessera-sim-driver --bench sim_cost` (after `cargo build --workspace`).

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use libloading::{Library, Symbol};

struct Sim {
    _node: tessera_sim_testkit::SimNode,
    lib: Library,
}

fn sim() -> Sim {
    let node = tessera_sim_testkit::SimNode::new();
    // SAFETY: set before the library is loaded and before any other thread exists.
    unsafe {
        for (k, v) in node.env() {
            std::env::set_var(k, v);
        }
    }
    // SAFETY: loading our own simulated driver, whose initializers do nothing.
    let lib = unsafe { Library::new(node.cuda_path()) }.expect("load the simulated driver");
    Sim { _node: node, lib }
}

macro_rules! sym {
    ($lib:expr, $name:literal, $ty:ty) => {{
        // SAFETY: the symbol has this C signature in nvml.h / cuda.h.
        let s: Result<Symbol<$ty>, _> = unsafe { $lib.get($name) };
        *s.unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy($name)))
    }};
}

fn bench(c: &mut Criterion) {
    let s = sim();
    type NvmlInit = unsafe extern "C" fn() -> c_uint;
    type NvmlCount = unsafe extern "C" fn(*mut c_uint) -> c_uint;
    type NvmlHandle = unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_uint;
    type NvmlMem = unsafe extern "C" fn(*mut c_void, *mut [u64; 3]) -> c_uint;
    type NvmlUtil = unsafe extern "C" fn(*mut c_void, *mut [c_uint; 2]) -> c_uint;
    type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
    type CuRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
    type CuSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
    type CuGetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
    type CuLoad = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int;
    type CuGetFn = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> c_int;
    type CuLaunch = unsafe extern "C" fn(
        *mut c_void,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> c_int;
    type CuAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type CuFree = unsafe extern "C" fn(u64) -> c_int;
    type CuSync = unsafe extern "C" fn(*mut c_void) -> c_int;

    let nvml_init = sym!(s.lib, b"nvmlInit_v2\0", NvmlInit);
    let nvml_count = sym!(s.lib, b"nvmlDeviceGetCount_v2\0", NvmlCount);
    let nvml_handle = sym!(s.lib, b"nvmlDeviceGetHandleByIndex_v2\0", NvmlHandle);
    let nvml_mem = sym!(s.lib, b"nvmlDeviceGetMemoryInfo\0", NvmlMem);
    let nvml_util = sym!(s.lib, b"nvmlDeviceGetUtilizationRates\0", NvmlUtil);
    let cu_init = sym!(s.lib, b"cuInit\0", CuInit);
    let retain = sym!(s.lib, b"cuDevicePrimaryCtxRetain\0", CuRetain);
    let set_current = sym!(s.lib, b"cuCtxSetCurrent\0", CuSetCurrent);
    let get_current = sym!(s.lib, b"cuCtxGetCurrent\0", CuGetCurrent);
    let load = sym!(s.lib, b"cuModuleLoadData\0", CuLoad);
    let get_fn = sym!(s.lib, b"cuModuleGetFunction\0", CuGetFn);
    let launch = sym!(s.lib, b"cuLaunchKernel\0", CuLaunch);
    let alloc = sym!(s.lib, b"cuMemAlloc_v2\0", CuAlloc);
    let free = sym!(s.lib, b"cuMemFree_v2\0", CuFree);
    let sync = sym!(s.lib, b"cuStreamSynchronize\0", CuSync);

    // SAFETY: set-up calls with valid out-pointers; handles come from the library itself.
    let (dev, func) = unsafe {
        assert_eq!(nvml_init(), 0);
        let mut dev = std::ptr::null_mut();
        assert_eq!(nvml_handle(0, &mut dev), 0);
        assert_eq!(cu_init(0), 0);
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(set_current(ctx), 0);
        let mut module = std::ptr::null_mut();
        assert_eq!(load(&mut module, c"bench".as_ptr().cast()), 0);
        let mut func = std::ptr::null_mut();
        assert_eq!(get_fn(&mut func, module, c"bench_1ns".as_ptr()), 0);
        (dev, func)
    };

    let mut g = c.benchmark_group("sim_cost");
    // SAFETY: getppid has no preconditions.
    g.bench_function("baseline_getppid_syscall", |b| b.iter(|| black_box(unsafe { libc::getppid() })));
    g.bench_function("nvmlDeviceGetCount_v2", |b| {
        let mut n = 0;
        // SAFETY: n is a valid out-pointer.
        b.iter(|| black_box(unsafe { nvml_count(&mut n) }))
    });
    g.bench_function("nvmlDeviceGetMemoryInfo", |b| {
        let mut m = [0u64; 3];
        // SAFETY: dev is a live handle; m has nvmlMemory_t's layout (three unsigned long long).
        b.iter(|| black_box(unsafe { nvml_mem(dev, &mut m) }))
    });
    g.bench_function("nvmlDeviceGetUtilizationRates", |b| {
        let mut u = [0u32; 2];
        // SAFETY: dev is a live handle; u has nvmlUtilization_t's layout (two unsigned int).
        b.iter(|| black_box(unsafe { nvml_util(dev, &mut u) }))
    });
    g.bench_function("cuCtxGetCurrent", |b| {
        let mut c = std::ptr::null_mut();
        // SAFETY: c is a valid out-pointer.
        b.iter(|| black_box(unsafe { get_current(&mut c) }))
    });
    g.bench_function("cuLaunchKernel_1ns", |b| {
        let null = std::ptr::null_mut();
        // SAFETY: func is a live function of the current context; NULL stream, no parameters.
        b.iter(|| black_box(unsafe { launch(func, 1, 1, 1, 32, 1, 1, 0, null, null.cast(), null.cast()) }));
        // SAFETY: the NULL stream of the current context.
        unsafe { sync(null) };
    });
    g.bench_function("cuMemAlloc_cuMemFree_1MiB", |b| {
        b.iter(|| {
            let mut p = 0u64;
            // SAFETY: p is a valid out-pointer.
            assert_eq!(unsafe { alloc(&mut p, 1 << 20) }, 0);
            // SAFETY: p was just allocated.
            black_box(unsafe { free(p) })
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2)).warm_up_time(std::time::Duration::from_millis(500));
    targets = bench
}
criterion_main!(benches);
