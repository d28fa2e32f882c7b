//! The driver functions the raw-ABI tests call, found the way `dlopen` + `dlsym` programs find
//! them (so, under the preload, through the shim's `dlsym`).

#![allow(non_snake_case)] // the functions carry cuda.h's names

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

pub type R = c_int;
pub type H = *mut c_void;
pub const SUCCESS: R = 0;
pub const OUT_OF_MEMORY: R = 2;
/// `CUDA_ERROR_NOT_PERMITTED`.
pub const NOT_PERMITTED: R = 800;

macro_rules! api {
    ($($name:ident($($t:ty),*);)*) => {
        #[allow(non_snake_case)]
        pub struct Cuda {
            _lib: libloading::Library,
            $(pub $name: unsafe extern "C" fn($($t),*) -> R,)*
        }

        impl Cuda {
            /// dlopen("libcuda.so.1") and dlsym every function.
            pub fn load() -> Cuda {
                // SAFETY: loading the (simulated) driver runs only its own initializers.
                let lib = unsafe { libloading::Library::new("libcuda.so.1") }.expect("dlopen libcuda.so.1");
                $(
                    // SAFETY: the driver's function of this name has this signature (cuda.h).
                    let $name = *unsafe {
                        lib.get::<unsafe extern "C" fn($($t),*) -> R>(concat!(stringify!($name), "\0").as_bytes())
                    }
                    .expect(stringify!($name));
                )*
                Cuda { _lib: lib, $($name,)* }
            }
        }
    };
}

api! {
    cuInit(c_uint);
    cuDeviceGet(*mut c_int, c_int);
    cuDeviceGetUuid(*mut [u8; 16], c_int);
    cuDeviceTotalMem_v2(*mut usize, c_int);
    cuDevicePrimaryCtxRetain(*mut H, c_int);
    cuDevicePrimaryCtxRelease_v2(c_int);
    cuCtxSetCurrent(H);
    cuCtxPushCurrent_v2(H);
    cuCtxPopCurrent_v2(*mut H);
    cuCtxSynchronize();
    cuCtxSetLimit(c_int, usize);
    cuCtxGetLimit(*mut usize, c_int);
    cuCtxCreate_v2(*mut H, c_uint, c_int);
    cuCtxDestroy_v2(H);
    cuMemGetInfo_v2(*mut usize, *mut usize);
    cuMemAlloc_v2(*mut u64, usize);
    cuMemAlloc(*mut c_uint, c_uint);
    cuMemFree_v2(u64);
    cuMemFree(c_uint);
    cuMemAllocPitch_v2(*mut u64, *mut usize, usize, usize, c_uint);
    cuMemAllocManaged(*mut u64, usize, c_uint);
    cuMemCreate(*mut u64, usize, *const MemAllocProp, u64);
    cuMemRelease(u64);
    cuMemAddressReserve(*mut u64, usize, usize, u64, u64);
    cuMemAddressFree(u64, usize);
    cuMemMap(u64, usize, usize, u64, u64);
    cuMemUnmap(u64, usize);
    cuMemRetainAllocationHandle(*mut u64, *mut c_void);
    cuMemAllocAsync(*mut u64, usize, H);
    cuMemFreeAsync(u64, H);
    cuMemAllocFromPoolAsync(*mut u64, usize, H, H);
    cuDeviceGetDefaultMemPool(*mut H, c_int);
    cuMemPoolCreate(*mut H, *const MemPoolProps);
    cuMemPoolDestroy(H);
    cuMemPoolSetAttribute(H, c_int, *mut c_void);
    cuMemPoolTrimTo(H, usize);
    cuArrayCreate_v2(*mut H, *const ArrayDesc);
    cuArray3DCreate_v2(*mut H, *const Array3dDesc);
    cuArrayDestroy(H);
    cuStreamCreate(*mut H, c_uint);
    cuStreamSynchronize(H);
    cuStreamDestroy_v2(H);
    cuModuleLoadData(*mut H, *const c_void);
    cuModuleGetFunction(*mut H, H, *const c_char);
    cuLaunchKernel(H, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, H, *mut *mut c_void, *mut *mut c_void);
    cuLaunchKernelEx(*const LaunchConfig, H, *mut *mut c_void, *mut *mut c_void);
    cuLaunchCooperativeKernel(H, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, H, *mut *mut c_void);
    cuStreamBeginCapture_v2(H, c_uint);
    cuStreamEndCapture(H, *mut H);
    cuGraphInstantiateWithFlags(*mut H, H, u64);
    cuGraphLaunch(H, H);
    cuGraphCreate(*mut H, c_uint);
    cuGraphAddMemAllocNode(*mut H, H, *const H, usize, *mut MemAllocNodeParams);
    cuGraphAddMemFreeNode(*mut H, H, *const H, usize, u64);
    cuGraphAddChildGraphNode(*mut H, H, *const H, usize, H);
    cuGraphAddNode(*mut H, H, *const H, usize, *mut ChildGraphNodeParams);
    cuGraphExecDestroy(H);
    cuGraphUpload(H, H);
    cuDeviceGraphMemTrim(c_int);
    cuDeviceGetGraphMemAttribute(c_int, c_int, *mut u64);
    cuMipmappedArrayCreate(*mut H, *const Array3dDesc, c_uint);
    cuMipmappedArrayDestroy(H);
    cuMipmappedArrayGetLevel(*mut H, H, c_uint);
    cuGetProcAddress_v2(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int);
}

/// `CUmemPoolProps` (a pinned device pool), its enums as raw integers.
#[repr(C)]
pub struct MemPoolProps {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

impl MemPoolProps {
    pub fn device(ordinal: c_int) -> MemPoolProps {
        MemPoolProps {
            alloc_type: 1,
            handle_types: 0,
            location_type: 1,
            location_id: ordinal,
            win32_security_attributes: std::ptr::null_mut(),
            max_size: 0,
            usage: 0,
            reserved: [0; 54],
        }
    }
}

/// `CUmemAllocationProp` (pinned device memory).
#[repr(C)]
pub struct MemAllocProp {
    pub alloc_type: c_uint,
    pub handle_types: c_uint,
    pub location_type: c_uint,
    pub location_id: c_int,
    pub win32: *mut c_void,
    pub flags: [u8; 8],
}

impl MemAllocProp {
    pub fn device(ordinal: c_int) -> MemAllocProp {
        MemAllocProp {
            alloc_type: 1,
            handle_types: 0,
            location_type: 1,
            location_id: ordinal,
            win32: std::ptr::null_mut(),
            flags: [0; 8],
        }
    }
}

/// `CUgraphNodeParams` for a child graph node (`CU_GRAPH_NODE_TYPE_GRAPH`): the type, the
/// union's `CUDA_CHILD_GRAPH_NODE_PARAMS` (graph, ownership) at byte 16, 256 bytes in all.
#[repr(C)]
pub struct ChildGraphNodeParams {
    pub type_: c_int,
    pub reserved0: [c_int; 3],
    pub graph: H,
    /// `CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE` (0) or `_MOVE` (1).
    pub ownership: c_uint,
    pub rest: [u32; 57],
}
const _: () = assert!(std::mem::size_of::<ChildGraphNodeParams>() == 256);

impl ChildGraphNodeParams {
    pub fn moved(graph: H) -> ChildGraphNodeParams {
        ChildGraphNodeParams { type_: 4, reserved0: [0; 3], graph, ownership: 1, rest: [0; 57] }
    }
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (pinned device memory, no access descriptors).
#[repr(C)]
pub struct MemAllocNodeParams {
    pub alloc_type: c_uint,
    pub handle_types: c_uint,
    pub location_type: c_uint,
    pub location_id: c_int,
    pub pool_rest: [u64; 9],
    pub access_descs: *const c_void,
    pub access_desc_count: usize,
    pub bytesize: usize,
    pub dptr: u64,
}

impl MemAllocNodeParams {
    pub fn device(ordinal: c_int, bytes: u64) -> MemAllocNodeParams {
        MemAllocNodeParams {
            alloc_type: 1,
            handle_types: 0,
            location_type: 1,
            location_id: ordinal,
            pool_rest: [0; 9],
            access_descs: std::ptr::null(),
            access_desc_count: 0,
            bytesize: bytes as usize,
            dptr: 0,
        }
    }
}

/// `CUDA_ARRAY_DESCRIPTOR` and `CUDA_ARRAY3D_DESCRIPTOR`, as the ABI table lays them out.
pub use tessera_abi::cuda::raw::{Array3dDesc, ArrayDesc};

/// `CUlaunchConfig` (no attributes).
#[repr(C)]
pub struct LaunchConfig {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared: c_uint,
    pub stream: H,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

/// Fails the test unless the driver call succeeded.
#[track_caller]
pub fn ck(what: &str, rc: R) {
    assert_eq!(rc, SUCCESS, "{what} failed with CUresult {rc}");
}

/// What `dlsym(RTLD_DEFAULT, name)` finds.
pub fn global(name: &CStr) -> *mut c_void {
    // SAFETY: a C string; RTLD_DEFAULT searches the global scope.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

/// The file name of the object an address lies in.
pub fn object_of(p: *const c_void) -> String {
    let mut info: libc::Dl_info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: info is a valid out-struct; p is any address.
    if unsafe { libc::dladdr(p, &mut info) } == 0 || info.dli_fname.is_null() {
        return String::new();
    }
    // SAFETY: dladdr returned the loader's NUL-terminated path.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    path.rsplit('/').next().unwrap_or_default().to_string()
}

/// A PTX module with one kernel (its name carries its duration on the simulated node).
pub fn ptx(name: &str) -> String {
    format!(".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry {name}()\n{{\nret;\n}}\n\0")
}

/// A kernel of the current context (`name` is a `tessera_test_spin_*` kernel: its duration).
pub fn kernel(cu: &Cuda, name: &str) -> H {
    let image = ptx(name);
    let cname = std::ffi::CString::new(name).unwrap();
    let (mut module, mut f): (H, H) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out-pointers and C strings.
    unsafe {
        ck("cuModuleLoadData", (cu.cuModuleLoadData)(&mut module, image.as_ptr().cast()));
        ck("cuModuleGetFunction", (cu.cuModuleGetFunction)(&mut f, module, cname.as_ptr()));
    }
    f
}

/// The simulated driver's own `name`, found behind the shim's back as a hostile tenant would:
/// the driver file's dynamic symbol table read from disk, added to where the loader mapped it
/// (located through a function the shim does not hook). No lookup the shim interposes is used.
pub fn behind_the_shim(name: &str) -> *const c_void {
    // SAFETY: the driver is loaded already; dlopen only takes another reference.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }.expect("dlopen libcuda.so.1");
    // SAFETY: the symbol exists; only its address is used.
    let probe: *mut c_void = *unsafe { lib.get::<*mut c_void>(b"cuCtxGetCurrent\0") }.expect("cuCtxGetCurrent");
    // SAFETY: an all-zero Dl_info is a valid value of this plain C struct.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: probe is an address inside a loaded object; info a valid out-pointer.
    assert_ne!(unsafe { libc::dladdr(probe, &mut info) }, 0, "dladdr");
    // SAFETY: dladdr filled dli_fname with the object's path, a C string it keeps alive.
    let file = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_str().expect("utf-8 path").to_string();
    let symbols = super::elf::Elf::read(std::path::Path::new(&file)).dynamic_symbols();
    let at = |n: &str| {
        let value = symbols.iter().find(|s| s.0 == n && s.1 != 0).unwrap_or_else(|| panic!("{n} in {file}")).1;
        info.dli_fbase as usize + value as usize
    };
    assert_eq!(at("cuCtxGetCurrent"), probe as usize, "the table read from the file places the loader's symbol");
    at(name) as *const c_void
}

/// The driver set up in this process: cuInit, device 0's primary context current.
pub struct Session {
    pub cu: Cuda,
    pub ctx: H,
}

// SAFETY: the context handle is an opaque value the driver accepts from any thread.
unsafe impl Sync for Session {}

impl Session {
    pub fn start(ordinal: c_int) -> Session {
        let cu = Cuda::load();
        // SAFETY: valid out-pointers throughout.
        unsafe {
            ck("cuInit", (cu.cuInit)(0));
            let mut ctx: H = std::ptr::null_mut();
            ck("cuDevicePrimaryCtxRetain", (cu.cuDevicePrimaryCtxRetain)(&mut ctx, ordinal));
            ck("cuCtxSetCurrent", (cu.cuCtxSetCurrent)(ctx));
            Session { cu, ctx }
        }
    }

    /// (free, total) by cuMemGetInfo.
    pub fn mem_info(&self) -> (u64, u64) {
        let (mut f, mut t) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        ck("cuMemGetInfo", unsafe { (self.cu.cuMemGetInfo_v2)(&mut f, &mut t) });
        (f as u64, t as u64)
    }

    /// The UUID text of a device, as the region names it.
    pub fn uuid(&self, ordinal: c_int) -> String {
        let mut u = [0u8; 16];
        // SAFETY: a valid out-pointer of 16 bytes.
        ck("cuDeviceGetUuid", unsafe { (self.cu.cuDeviceGetUuid)(&mut u, ordinal) });
        let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
        format!("GPU-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
    }

    /// Allocates with cuMemAlloc_v2: the pointer, or the error code.
    pub fn alloc(&self, bytes: u64) -> Result<u64, R> {
        let mut p = 0u64;
        // SAFETY: a valid out-pointer.
        match unsafe { (self.cu.cuMemAlloc_v2)(&mut p, bytes as usize) } {
            SUCCESS => Ok(p),
            rc => Err(rc),
        }
    }

    pub fn free(&self, p: u64) {
        // SAFETY: p came from cuMemAlloc*.
        ck("cuMemFree", unsafe { (self.cu.cuMemFree_v2)(p) });
    }
}
