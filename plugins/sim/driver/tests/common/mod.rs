//! What the CUDA tests of the driver share: the CUresult values they check, the model's handle on
//! a test's node, loading and launching a kernel through the library's exports, and the reading
//! of a real card (`card_facts.rs`, `granularity.rs`) with the node it sat in.

#![allow(dead_code)] // each test binary uses a part

use std::ffi::{CStr, CString, c_char, c_uint, c_void};
use std::path::PathBuf;

use serde_json::Value;

use tessera_sim_model::Node;
use tessera_sim_testkit::SimNode;

/// The simulator's one library, loaded as a program loads libcuda.so.1 and libnvidia-ml.so.1
/// (`card_facts.rs`, `granularity.rs`).
pub struct Lib(pub libloading::Library);

impl Lib {
    pub fn sym<T: Copy>(&self, name: &str) -> T {
        // SAFETY: every caller names T as the symbol's C signature (cuda.h 13.0 / nvml.h).
        unsafe { *self.0.get::<T>(name.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}")) }
    }
}

/// Calls an export of a [`Lib`] by name with the C signature given:
/// `call!(lib, cuInit(0) as fn(c_uint))`.
#[allow(unused_macros)] // each test binary uses a part
macro_rules! call {
    ($lib:expr, $name:ident($($arg:expr),* $(,)?) as fn($($t:ty),* $(,)?)) => {{
        let f: unsafe extern "C" fn($($t),*) -> u32 = $lib.sym(stringify!($name));
        // SAFETY: the symbol has this C signature and the arguments are valid for it.
        unsafe { f($($arg),*) }
    }};
}

pub const MIB: u64 = 1 << 20;

// CUresult values (cuda.h 12.8).
pub const SUCCESS: u32 = 0;
pub const INVALID_VALUE: u32 = 1;
pub const OUT_OF_MEMORY: u32 = 2;
pub const NOT_INITIALIZED: u32 = 3;
pub const DEVICE_UNAVAILABLE: u32 = 46;
pub const NO_DEVICE: u32 = 100;
pub const INVALID_DEVICE: u32 = 101;
pub const INVALID_CONTEXT: u32 = 201;
pub const INVALID_HANDLE: u32 = 400;
pub const ILLEGAL_STATE: u32 = 401;
pub const NOT_FOUND: u32 = 500;
pub const NOT_READY: u32 = 600;
pub const ILLEGAL_ADDRESS: u32 = 700;
pub const LAUNCH_FAILED: u32 = 719;
pub const NOT_SUPPORTED: u32 = 801;
pub const STREAM_CAPTURE_UNSUPPORTED: u32 = 900;

/// A driver handle (context, stream, module, function, ...), opaque to the caller.
pub type Handle = *mut c_void;

/// A second handle on the test's node, as another process (or `tessera-sim`) has.
pub fn model(node: &SimNode) -> Node {
    Node::open(node.description.as_deref(), Some(&node.state)).expect("open the node's state")
}

/// The export `name` of the driver library as a C function pointer of type `T`.
fn export<T: Copy>(lib: &libloading::Library, name: &str) -> T {
    // SAFETY: every caller names T as the export's C signature (cuda.h 12.8).
    unsafe { *lib.get::<T>(name.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}")) }
}

/// Loads `image` as a module of the current context and returns its function `name`.
pub fn function(lib: &libloading::Library, image: &CStr, name: &str) -> Handle {
    let load: unsafe extern "C" fn(*mut Handle, *const c_void) -> u32 = export(lib, "cuModuleLoadData");
    let get: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> u32 = export(lib, "cuModuleGetFunction");
    let (mut module, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    let cname = CString::new(name).unwrap();
    // SAFETY: valid out-pointers, a NUL-terminated image and name.
    unsafe {
        assert_eq!(load(&mut module, image.as_ptr().cast()), SUCCESS, "cuModuleLoadData");
        assert_eq!(get(&mut f, module, cname.as_ptr()), SUCCESS, "cuModuleGetFunction {name}");
    }
    f
}

/// Launches `f` without parameters as one block of `threads` threads on `stream`, through the
/// export `entry` (`cuLaunchKernel` or `cuLaunchKernel_ptsz`): the driver's answer.
pub fn launch_kernel(lib: &libloading::Library, entry: &str, f: Handle, threads: c_uint, stream: Handle) -> u32 {
    // Both entries have cuLaunchKernel's signature (its table row names the `_ptsz` twin).
    let launch: tessera_abi::cuda::pfn::cuLaunchKernel = export(lib, entry);
    let none: *mut *mut c_void = std::ptr::null_mut();
    // SAFETY: the handles go to the driver, which checks them (tests pass bad ones on purpose);
    // no kernel parameters.
    unsafe { launch(f.cast(), 1, 1, 1, threads, 1, 1, 0, stream.cast(), none, none) as u32 }
}

/// The reading of a real card the tests check: `TESSERA_CARD_FACTS`, else `tests/data/h200-facts.json`.
pub fn facts_path() -> PathBuf {
    match std::env::var_os("TESSERA_CARD_FACTS") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/h200-facts.json"),
    }
}

pub fn facts() -> Value {
    let path = facts_path();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// The node the card sat in: one board of the catalog model with the card's name, the driver and
/// CUDA versions it reported, passed through to a VM if NVML said so.
pub fn node_for(f: &Value) -> SimNode {
    let name = f["name"].as_str().expect("facts: name");
    let model = tessera_sim_model::catalog::builtin_models()
        .iter()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("no catalog model is named {name:?}"));
    let virt = match f["virt_mode"].as_u64() {
        Some(1) => "virtualization_mode = \"passthrough\"\n",
        _ => "",
    };
    SimNode::with_description(&format!(
        "driver_version = {driver}\ncuda_driver_version = {cuda}\n{virt}[[gpu]]\nmodel = \"{key}\"\ncount = 1\n",
        driver = f["driver"],
        cuda = f["cuDriverGetVersion"],
        key = model.key,
    ))
}
