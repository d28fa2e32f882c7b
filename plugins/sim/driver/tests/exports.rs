//! Every function NVIDIA's headers declare resolves in libtessera_sim.so, under every versioned
//! name a real driver exports, through `dlsym` and, for CUDA, through `cuGetProcAddress` by
//! version and flags; what the sim does not model answers the not-supported code, never crashes.
//!
//! The names are `exports/cuda.names` and `exports/nvml.names`, which `exports/derive-names.py`
//! derives from the headers. Where the CUDA headers are at hand (the runtime wheel of the virtual
//! environment `scripts/deps.sh` makes), a test derives the list again and compares; nvml.h comes
//! from NVIDIA's go-nvml repository, which no package registry serves, so its list is checked in
//! only (regenerate it with the script when the header moves).

use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_sim_testkit::{SimNode, profile_dir, sim_library};

fn exports_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("exports")
}

/// (symbol, base name, version, flavour) of every CUDA export.
fn cuda_names() -> Vec<(String, String, i32, String)> {
    let text = std::fs::read_to_string(exports_dir().join("cuda.names")).unwrap();
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].to_string(), f[1].to_string(), f[2].parse().unwrap(), f[3].to_string())
        })
        .collect()
}

fn nvml_names() -> Vec<String> {
    std::fs::read_to_string(exports_dir().join("nvml.names")).unwrap().lines().map(str::to_string).collect()
}

/// A node whose driver is CUDA 12.9, the version of the headers the list comes from.
fn node_12_9() -> SimNode {
    SimNode::with_description(
        "driver_version = \"575.57.08\"\ncuda_driver_version = 12090\n[[gpu]]\nmodel = \"H100-SXM5-80GB\"\ncount = 2\n",
    )
}

type GetProc = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;

#[test]
fn every_declared_name_resolves_by_dlsym_and_by_cu_get_proc_address() {
    let node = node_12_9();
    node.run_isolated("every_declared_name_resolves_by_dlsym_and_by_cu_get_proc_address", || {
        // SAFETY: loading the simulated driver runs no code at load time.
        let lib = unsafe { libloading::Library::new(sim_library()) }.unwrap();
        let sym = |name: &str| -> *mut c_void {
            // SAFETY: only the address is taken, nothing is called.
            unsafe { lib.get::<*mut c_void>(name.as_bytes()) }.map(|s| *s).unwrap_or(std::ptr::null_mut())
        };
        let missing: Vec<String> =
            cuda_names().iter().map(|n| n.0.clone()).chain(nvml_names()).filter(|n| sym(n).is_null()).collect();
        assert!(missing.is_empty(), "not exported: {missing:?}");

        // SAFETY: cuGetProcAddress_v2 has this signature in cuda.h.
        let get_proc: GetProc = unsafe { std::mem::transmute(sym("cuGetProcAddress_v2")) };
        let mut wrong = Vec::new();
        let names = cuda_names();
        assert!(names.len() > 600, "{} names", names.len());
        for (symbol, base, version, flavour) in &names {
            let flags = if flavour == "No" { 0 } else { 2 }; // CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            let c = CString::new(base.as_str()).unwrap();
            let (mut f, mut status) = (std::ptr::null_mut(), -1);
            // SAFETY: valid string and out-pointers.
            let rc = unsafe { get_proc(c.as_ptr(), &mut f, *version, flags, &mut status) };
            if rc != 0 || status != 0 || f != sym(symbol) {
                wrong.push(format!("{base}@{version}/{flavour}: rc {rc} status {status}, expected {symbol}"));
            }
        }
        assert!(wrong.is_empty(), "{} lookups wrong:\n{}", wrong.len(), wrong.join("\n"));
        // The newest version is what a caller built for 12.9 gets, and asking for a version older
        // than a function's first is VERSION_NOT_SUFFICIENT (2), as a real driver answers.
        let c = CString::new("cuLogsCurrent").unwrap();
        let (mut f, mut status) = (std::ptr::null_mut(), -1);
        // SAFETY: valid string and out-pointers.
        assert_eq!(unsafe { get_proc(c.as_ptr(), &mut f, 12080, 0, &mut status) }, 500); // CUDA_ERROR_NOT_FOUND
        assert_eq!((f, status), (std::ptr::null_mut(), 2));
    });
}

#[test]
fn not_modelled_functions_answer_not_supported() {
    let node = node_12_9();
    node.run_isolated("not_modelled_functions_answer_not_supported", || {
        // SAFETY: loading the simulated driver runs no code at load time.
        let lib = unsafe { libloading::Library::new(sim_library()) }.unwrap();
        // SAFETY: the signatures of cuda.h / nvml.h; the not-modelled ones are called with
        // arguments a real driver would accept and ignore them.
        unsafe {
            let cu_init = lib.get::<unsafe extern "C" fn(c_uint) -> c_int>(b"cuInit").unwrap();
            assert_eq!(cu_init(0), 0);
            let ext = lib
                .get::<unsafe extern "C" fn(*mut c_void, *const c_void) -> c_int>(b"cuImportExternalMemory")
                .unwrap();
            let mut out = std::ptr::null_mut::<c_void>();
            assert_eq!(ext((&raw mut out).cast(), std::ptr::null()), 801); // CUDA_ERROR_NOT_SUPPORTED

            let vgpu = lib
                .get::<unsafe extern "C" fn(*mut c_void, *mut c_uint) -> c_int>(b"nvmlDeviceGetHostVgpuMode")
                .unwrap();
            let mut mode: c_uint = 99;
            assert_eq!(vgpu(std::ptr::null_mut(), &mut mode), 1, "NVML_ERROR_UNINITIALIZED before nvmlInit");
            let init = lib.get::<unsafe extern "C" fn() -> c_int>(b"nvmlInit_v2").unwrap();
            assert_eq!(init(), 0);
            let by_index = lib
                .get::<unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_int>(b"nvmlDeviceGetHandleByIndex_v2")
                .unwrap();
            let mut dev = std::ptr::null_mut();
            assert_eq!(by_index(0, &mut dev), 0);
            assert_eq!(vgpu(dev, &mut mode), 3, "NVML_ERROR_NOT_SUPPORTED on bare metal");
            assert_eq!(mode, 99, "nothing written");

            // Modelled: a bare-metal GPU is not virtualized; S-class units: none.
            let virt = lib
                .get::<unsafe extern "C" fn(*mut c_void, *mut c_uint) -> c_int>(b"nvmlDeviceGetVirtualizationMode")
                .unwrap();
            assert_eq!(virt(dev, &mut mode), 0);
            assert_eq!(mode, 0, "NVML_GPU_VIRTUALIZATION_MODE_NONE");
            assert_eq!(virt(dev, std::ptr::null_mut()), 2, "null out-pointer: INVALID_ARGUMENT");
            assert_eq!(virt(0x10 as *mut c_void, &mut mode), 2, "made-up handle: INVALID_ARGUMENT");
            let units = lib.get::<unsafe extern "C" fn(*mut c_uint) -> c_int>(b"nvmlUnitGetCount").unwrap();
            let mut n: c_uint = 7;
            assert_eq!(units(&mut n), 0);
            assert_eq!(n, 0);
        }
    });
}

/// The CUDA include directory of the runtime wheel in the virtual environment, or `None` with
/// a SKIP line (an error when `TESSERA_REQUIRE_RUNTIMES` is set).
fn cuda_include() -> Option<PathBuf> {
    let venv = std::env::var_os("TESSERA_CUDA_RUNTIMES")
        .map(PathBuf::from)
        .unwrap_or_else(|| profile_dir().parent().expect("target dir").join("cuda-runtimes"));
    let found = std::fs::read_dir(venv.join("lib")).ok().into_iter().flatten().flatten().find_map(|e| {
        let inc = e.path().join("site-packages/nvidia/cuda_runtime/include");
        inc.join("cuda.h").exists().then_some(inc)
    });
    if found.is_none() {
        let why = format!("no CUDA headers in {} (scripts/deps.sh installs the runtime wheel there)", venv.display());
        assert!(std::env::var_os("TESSERA_REQUIRE_RUNTIMES").is_none(), "TESSERA_REQUIRE_RUNTIMES is set, but {why}");
        println!("SKIP: {why}");
    }
    found
}

#[test]
fn the_cuda_name_list_is_what_the_headers_declare() {
    let Some(include) = cuda_include() else { return };
    let o = Command::new("python3")
        .arg(exports_dir().join("derive-names.py"))
        .arg("cuda")
        .arg(&include)
        .output()
        .expect("run python3");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let derived = String::from_utf8(o.stdout).unwrap();
    let committed = std::fs::read_to_string(exports_dir().join("cuda.names")).unwrap();
    assert!(derived == committed, "exports/cuda.names is stale: regenerate it from {}", include.display());
}
