//! Modules, libraries and functions. No code runs on the simulated GPU, so any image loads: a
//! cubin or fatbin is taken as it is (every function name resolves), PTX text is read for its
//! `.entry` and `.global` declarations (names it does not declare are `NOT_FOUND`, as they would
//! be on a real driver).
//!
//! A kernel's duration on the GPU comes from its name: a name ending in `_<N>ns`, `_<N>us` or
//! `_<N>ms` (e.g. `spin_250us`, or C++ `_Z10spin_250usPf`) takes that long; a name ending in
//! `_argns` takes as many nanoseconds as its first parameter (a `u64`) says, launch by launch (as
//! the workload's spin kernel does on a real GPU); any other takes 5 µs.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicI32, Ordering::*};
use std::sync::{Arc, Mutex};

use tessera_abi::cuda_exports;

use super::context;
use super::handles::{self, Registry, library, module};
use super::init::driver;
use super::memory::{Alloc, MemKind, map_anon, unmap};
use super::{CUresult, INVALID_HANDLE, INVALID_VALUE, NOT_FOUND, R, cstr, need, put, put_opt, run, sys};

/// What any kernel not named for a duration takes.
pub(crate) const DEFAULT_KERNEL_NS: u64 = 5_000;
/// Bytes of a global an opaque image is asked for (its size is not known without parsing it).
const OPAQUE_GLOBAL_BYTES: u64 = 256;

/// What we know of a loaded image.
#[derive(Clone)]
enum Image {
    /// A cubin or fatbin: any name resolves.
    Opaque,
    /// PTX: its entry points and its globals with their sizes.
    Ptx { entries: Vec<String>, globals: Vec<(String, u64)> },
}

impl Image {
    fn has_function(&self, name: &str) -> bool {
        match self {
            Image::Opaque => true,
            Image::Ptx { entries, .. } => entries.iter().any(|e| e == name),
        }
    }

    fn global_size(&self, name: &str) -> Option<u64> {
        match self {
            Image::Opaque => Some(OPAQUE_GLOBAL_BYTES),
            Image::Ptx { globals, .. } => globals.iter().find(|g| g.0 == name).map(|g| g.1),
        }
    }
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'$' | b'.')
}

/// Reads the declarations of PTX text.
fn parse_ptx(text: &str) -> Image {
    let mut entries = Vec::new();
    let mut globals = Vec::new();
    for line in text.lines() {
        let toks: Vec<&str> =
            line.split(|c: char| c.is_whitespace() || c == ';' || c == ',').filter(|t| !t.is_empty()).collect();
        if let Some(i) = toks.iter().position(|t| *t == ".entry") {
            if let Some(name) = toks.get(i + 1) {
                let name: String = name.bytes().take_while(|&b| is_ident(b)).map(char::from).collect();
                if !name.is_empty() {
                    entries.push(name);
                }
            }
        } else if toks.contains(&".global") {
            let mut elem = 1u64;
            let mut name = None;
            let mut it = toks.iter().skip_while(|t| **t != ".global").skip(1);
            while let Some(t) = it.next() {
                match *t {
                    ".align" => {
                        it.next();
                    }
                    ".b8" | ".u8" | ".s8" => elem = 1,
                    ".b16" | ".u16" | ".s16" | ".f16" => elem = 2,
                    ".b32" | ".u32" | ".s32" | ".f32" => elem = 4,
                    ".b64" | ".u64" | ".s64" | ".f64" => elem = 8,
                    t if t.starts_with('.') => {}
                    t => {
                        name = Some(t);
                        break;
                    }
                }
            }
            if let Some(n) = name {
                let base: String = n.bytes().take_while(|&b| is_ident(b)).map(char::from).collect();
                let count = n
                    .split_once('[')
                    .and_then(|(_, r)| r.split_once(']'))
                    .and_then(|(c, _)| c.trim().parse::<u64>().ok())
                    .unwrap_or(1);
                if !base.is_empty() {
                    globals.push((base, elem * count.max(1)));
                }
            }
        }
    }
    Image::Ptx { entries, globals }
}

/// Whether an image starts as a binary one does: an ELF cubin, a fatbin, or a fatbin wrapper.
pub(crate) fn is_binary(b: &[u8]) -> bool {
    b.starts_with(b"\x7fELF") || b.starts_with(&[0x50, 0xed, 0x55, 0xba]) || b.starts_with(&[0xb1, 0x43, 0x62, 0x46])
}

/// Classifies an image given as bytes (a file).
fn image_from_bytes(b: &[u8]) -> Image {
    if is_binary(b) {
        return Image::Opaque;
    }
    match std::str::from_utf8(b.split(|&c| c == 0).next().unwrap_or(b)) {
        Ok(t) if t.contains(".version") || t.contains(".entry") => parse_ptx(t),
        _ => Image::Opaque,
    }
}

/// Classifies an image given by pointer: ELF (cubin) and fatbin images are opaque; anything else
/// is NUL-terminated PTX text, as `cuModuleLoadData` defines.
///
/// # Safety
/// `p` must point to a loadable image: a cubin, a fatbin, or NUL-terminated text.
unsafe fn image_from_ptr(p: *const c_void) -> R<Image> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    let b = p.cast::<u8>();
    let mut head = [0u8; 4];
    for (i, h) in head.iter_mut().enumerate() {
        // SAFETY: the image holds at least the bytes up to its first NUL, and none of the magic
        // numbers has a NUL in its first four bytes; we stop at the first NUL.
        *h = unsafe { *b.add(i) };
        if *h == 0 {
            break;
        }
    }
    if head.contains(&0) {
        // Text shorter than four bytes.
        // SAFETY: NUL-terminated (found above).
        let t = unsafe { CStr::from_ptr(p.cast()) };
        return Ok(image_from_bytes(t.to_bytes()));
    }
    if is_binary(&head) {
        return Ok(Image::Opaque);
    }
    // SAFETY: not a binary image, so NUL-terminated text by the API contract.
    let t = unsafe { CStr::from_ptr(p.cast()) };
    Ok(image_from_bytes(t.to_bytes()))
}

/// The base name of a possibly mangled C++ name: `_Z10spin_250usPf` is `spin_250us`,
/// `_ZN2ns6k_2msEv` is `k_2ms`.
fn base_name(name: &str) -> &str {
    let Some(rest) = name.strip_prefix("_Z") else { return name };
    let b = rest.as_bytes();
    let mut i = 0;
    let nested = b.first() == Some(&b'N');
    if nested {
        i = 1;
        while i < b.len() && matches!(b[i], b'r' | b'V' | b'K') {
            i += 1;
        }
    }
    let mut last = name;
    loop {
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let Ok(len) = rest[start..i].parse::<usize>() else { return last };
        let Some(ident) = rest.get(i..i + len) else { return last };
        last = ident;
        i += len;
        if !nested || b.get(i) == Some(&b'E') || i >= b.len() {
            return last;
        }
    }
}

/// Whether a kernel takes its duration from its first parameter (`u64` ns): its name ends in
/// `_argns`.
pub(crate) fn duration_from_arg(name: &str) -> bool {
    base_name(name).ends_with("_argns")
}

/// A kernel's duration on the GPU, from its name.
pub(crate) fn kernel_duration_ns(name: &str) -> u64 {
    let base = base_name(name);
    let Some((_, suffix)) = base.rsplit_once('_') else { return DEFAULT_KERNEL_NS };
    let (num, unit) = if let Some(n) = suffix.strip_suffix("ns") {
        (n, 1)
    } else if let Some(n) = suffix.strip_suffix("us") {
        (n, 1_000)
    } else if let Some(n) = suffix.strip_suffix("ms") {
        (n, 1_000_000)
    } else {
        return DEFAULT_KERNEL_NS;
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return DEFAULT_KERNEL_NS;
    }
    num.parse::<u64>().ok().and_then(|n| n.checked_mul(unit)).unwrap_or(DEFAULT_KERNEL_NS)
}

/// A function (`CUfunction`), or a context-independent kernel (`CUkernel`).
pub(crate) struct Func {
    pub handle: usize,
    pub name: CString,
    pub duration_ns: u64,
    /// The duration is the first parameter's (`u64` ns) at each launch; `duration_ns` when the
    /// launch has none (a graph's node, `extra`-style parameters).
    pub duration_from_arg: bool,
    /// Module it belongs to (0 for a `CUkernel`).
    pub module: usize,
    /// Library it came from (0 for a module's own function).
    pub library: usize,
    /// Context it belongs to (0: any, for a `CUkernel`).
    pub ctx: usize,
    pub max_dynamic_smem: AtomicI32,
    pub carveout: AtomicI32,
    pub non_portable_cluster: AtomicI32,
    pub cluster: [AtomicI32; 3],
    pub sched_pref: AtomicI32,
    pub cache_config: AtomicI32,
}

impl Func {
    fn new(name: &str, module: usize, library: usize, ctx: usize) -> Func {
        Func {
            handle: handles::new_handle(),
            name: CString::new(name).unwrap_or_default(),
            duration_ns: kernel_duration_ns(name),
            duration_from_arg: duration_from_arg(name),
            module,
            library,
            ctx,
            max_dynamic_smem: AtomicI32::new(48 * 1024),
            carveout: AtomicI32::new(-1),
            non_portable_cluster: AtomicI32::new(0),
            cluster: [const { AtomicI32::new(0) }; 3],
            sched_pref: AtomicI32::new(0),
            cache_config: AtomicI32::new(0),
        }
    }
}

pub(crate) struct Module {
    pub handle: usize,
    pub ctx: usize,
    /// Library it was made from (0: loaded directly).
    pub library: usize,
    image: Image,
    funcs: Mutex<HashMap<String, usize>>,
    /// Globals: name to (address, bytes).
    globals: Mutex<HashMap<String, (u64, u64)>>,
}

pub(crate) struct Library {
    pub handle: usize,
    image: Image,
    kernels: Mutex<HashMap<String, usize>>,
    /// Per context: the module of this library there.
    modules: Mutex<HashMap<usize, usize>>,
}

fn load(image: Image, library: usize) -> R<usize> {
    let node = driver()?.node;
    super::errors::poll_faults(node)?;
    let ctx = context::current()?;
    ctx.check(node)?;
    super::limits::module_loading(node, &ctx)?;
    let m = Module {
        handle: handles::new_handle(),
        ctx: ctx.handle,
        library,
        image,
        funcs: Mutex::new(HashMap::new()),
        globals: Mutex::new(HashMap::new()),
    };
    let h = m.handle;
    handles::write().modules.insert(h, Arc::new(m));
    Ok(h)
}

cuda_exports! {
    fn cuModuleLoad(module, fname) {
        run(|| {
            need(module)?;
            // SAFETY: fname is the caller's NUL-terminated path.
            let path = unsafe { cstr(fname) }?;
            driver()?;
            let bytes = std::fs::read(path).map_err(|_| CUresult::CUDA_ERROR_FILE_NOT_FOUND)?;
            let h = load(image_from_bytes(&bytes), 0)?;
            // SAFETY: module is the caller's out-pointer (checked above).
            unsafe { put(module, handles::as_ptr(h)) }
        })
    }
}

/// Loads an image given by pointer.
///
/// # Safety
/// `module` must be null or a valid out-pointer; `image` a loadable image.
pub(crate) unsafe fn load_data(module: *mut sys::CUmodule, image: *const c_void) -> R {
    need(module)?;
    driver()?;
    // SAFETY: as this function's contract.
    let img = unsafe { image_from_ptr(image) }?;
    let h = load(img, 0)?;
    // SAFETY: module is the caller's out-pointer (checked above).
    unsafe { put(module, handles::as_ptr(h)) }
}

cuda_exports! {
    fn cuModuleLoadData(module, image) {
        // SAFETY: the caller's out-pointer and image.
        run(|| unsafe { load_data(module, image) })
    }

    /// `cuModuleLoadDataEx`: JIT options are accepted and ignored (nothing is compiled).
    fn cuModuleLoadDataEx(module, image, _numOptions, _options, _optionValues) {
        // SAFETY: the caller's out-pointer and image.
        run(|| unsafe { load_data(module, image) })
    }

    fn cuModuleLoadFatBinary(module, fatCubin) {
        // SAFETY: the caller's out-pointer and image.
        run(|| unsafe { load_data(module, fatCubin) })
    }
}

/// Removes a module, its functions and its globals.
fn unload(reg: &mut Registry, h: usize) -> Vec<Alloc> {
    let Some(m) = reg.modules.remove(&h) else { return Vec::new() };
    // Only its own functions: cuBLAS unloads hundreds of modules at exit, each with many.
    for f in m.funcs.lock().unwrap_or_else(|e| e.into_inner()).values() {
        reg.funcs.remove(f);
    }
    let globals: Vec<u64> = m.globals.lock().unwrap_or_else(|e| e.into_inner()).values().map(|g| g.0).collect();
    globals.iter().filter_map(|b| reg.mem.remove(b)).collect()
}

cuda_exports! {
    fn cuModuleUnload(hmod) {
        run(|| {
            driver()?;
            let freed = {
                let mut reg = handles::write();
                if !reg.modules.contains_key(&(hmod as usize)) {
                    return Err(INVALID_HANDLE);
                }
                unload(&mut reg, hmod as usize)
            };
            for a in freed {
                unmap(a.base, a.map_len);
            }
            Ok(())
        })
    }
}

/// What stands for the functions of a cubin or fatbin module, whose names the sim does not read.
const OPAQUE_FUNCTION: &str = "module_function";

/// The functions of module `h` (the tools' module table lists them): each PTX entry; for a
/// cubin or fatbin, one function standing for them all.
pub(crate) fn functions_of(h: usize) -> R<Vec<usize>> {
    let m = module(handles::as_ptr(h))?;
    match &m.image {
        Image::Ptx { entries, .. } => entries.iter().map(|e| function_in(&m, e)).collect(),
        Image::Opaque => Ok(vec![function_in(&m, OPAQUE_FUNCTION)?]),
    }
}

/// The function of a module by name, made on first use.
fn function_in(m: &Module, name: &str) -> R<usize> {
    if !m.image.has_function(name) {
        return Err(NOT_FOUND);
    }
    // The registry is locked before the module's table, as everywhere.
    let mut reg = handles::write();
    let mut funcs = m.funcs.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&h) = funcs.get(name) {
        return Ok(h);
    }
    let f = Func::new(name, m.handle, m.library, m.ctx);
    let h = f.handle;
    reg.funcs.insert(h, Arc::new(f));
    funcs.insert(name.to_string(), h);
    Ok(h)
}

cuda_exports! {
    fn cuModuleGetFunction(hfunc, hmod, name) {
        run(|| {
            need(hfunc)?;
            // SAFETY: name is the caller's NUL-terminated string.
            let name = unsafe { cstr(name) }?;
            let m = module(hmod)?;
            let h = function_in(&m, name)?;
            // SAFETY: hfunc is the caller's out-pointer (checked above).
            unsafe { put(hfunc, handles::as_ptr(h)) }
        })
    }
}

/// A module global: device memory of its declared size, made on first use (module memory is part
/// of the image and not charged separately).
fn global_in(m: &Module, name: &str, low: bool) -> R<(u64, u64)> {
    let size = m.image.global_size(name).ok_or(NOT_FOUND)?;
    if let Some(&g) = m.globals.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
        return Ok(g);
    }
    let base =
        map_anon(size, true).or_else(|| if low { None } else { map_anon(size, false) }).ok_or(super::OUT_OF_MEMORY)?;
    let Some(ctx) = handles::read().ctxs.get(&m.ctx).cloned() else {
        unmap(base, size as usize);
        return Err(super::INVALID_CONTEXT);
    };
    // The registry is locked before the module's table (as unloading does), never inside it.
    let mut reg = handles::write();
    let mut globals = m.globals.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&g) = globals.get(name) {
        drop(globals);
        drop(reg);
        unmap(base, size as usize);
        return Ok(g);
    }
    if !reg.modules.contains_key(&m.handle) {
        drop(globals);
        drop(reg);
        unmap(base, size as usize);
        return Err(INVALID_HANDLE);
    }
    reg.mem.insert(base, Alloc::new(base, size, MemKind::Global, m.ctx, ctx.dev));
    globals.insert(name.to_string(), (base, size));
    Ok((base, size))
}

cuda_exports! {
    fn cuModuleGetGlobal_v2(dptr, bytes, hmod, name) {
        run(|| {
            // SAFETY: name is the caller's NUL-terminated string.
            let name = unsafe { cstr(name) }?;
            let m = module(hmod)?;
            let (b, s) = global_in(&m, name, false)?;
            // SAFETY: both are the caller's optional out-pointers.
            unsafe {
                put_opt(dptr, b)?;
                put_opt(bytes, s as usize)
            }
        })
    }

    fn cuModuleGetGlobal(dptr, bytes, hmod, name) {
        run(|| {
            // SAFETY: name is the caller's NUL-terminated string.
            let name = unsafe { cstr(name) }?;
            let m = module(hmod)?;
            let (b, s) = global_in(&m, name, true)?;
            let b = c_uint::try_from(b).map_err(|_| super::OUT_OF_MEMORY)?;
            // SAFETY: both are the caller's optional out-pointers.
            unsafe {
                put_opt(dptr, b)?;
                put_opt(bytes, s as c_uint)
            }
        })
    }

    /// `cuModuleGetLoadingMode`: eager loading (`CU_MODULE_EAGER_LOADING`).
    fn cuModuleGetLoadingMode(mode) {
        run(|| {
            need(mode)?;
            driver()?;
            // SAFETY: mode is the caller's out-pointer (checked above).
            unsafe { put(mode, 1) }
        })
    }
}

// ---- Libraries and kernels -------------------------------------------------------------------

fn new_library(image: Image) -> R<usize> {
    driver()?;
    let l = Library {
        handle: handles::new_handle(),
        image,
        kernels: Mutex::new(HashMap::new()),
        modules: Mutex::new(HashMap::new()),
    };
    let h = l.handle;
    handles::write().libraries.insert(h, Arc::new(l));
    Ok(h)
}

cuda_exports! {
    fn cuLibraryLoadData(library, code, _jitOptions, _jitOptionsValues, _numJitOptions, _libraryOptions, _libraryOptionValues, _numLibraryOptions) {
        run(|| {
            need(library)?;
            driver()?;
            // SAFETY: code is the caller's image.
            let img = unsafe { image_from_ptr(code) }?;
            let h = new_library(img)?;
            // SAFETY: library is the caller's out-pointer (checked above).
            unsafe { put(library, handles::as_ptr(h)) }
        })
    }

    fn cuLibraryLoadFromFile(library, fileName, _jitOptions, _jitOptionsValues, _numJitOptions, _libraryOptions, _libraryOptionValues, _numLibraryOptions) {
        run(|| {
            need(library)?;
            // SAFETY: fileName is the caller's NUL-terminated path.
            let path = unsafe { cstr(fileName) }?;
            driver()?;
            let bytes = std::fs::read(path).map_err(|_| CUresult::CUDA_ERROR_FILE_NOT_FOUND)?;
            let h = new_library(image_from_bytes(&bytes))?;
            // SAFETY: library is the caller's out-pointer (checked above).
            unsafe { put(library, handles::as_ptr(h)) }
        })
    }

    fn cuLibraryUnload(library) {
        run(|| {
            driver()?;
            let lib = handles::write().libraries.remove(&(library as usize)).ok_or(INVALID_HANDLE)?;
            let mods: Vec<usize> = lib.modules.lock().unwrap_or_else(|e| e.into_inner()).values().copied().collect();
            let freed = {
                let mut reg = handles::write();
                for k in lib.kernels.lock().unwrap_or_else(|e| e.into_inner()).values() {
                    reg.funcs.remove(k);
                }
                mods.into_iter().flat_map(|m| unload(&mut reg, m)).collect::<Vec<_>>()
            };
            for a in freed {
                unmap(a.base, a.map_len);
            }
            Ok(())
        })
    }
}

cuda_exports! {
    fn cuLibraryGetKernel(pKernel, library, name) {
        run(|| {
            need(pKernel)?;
            // SAFETY: name is the caller's NUL-terminated string.
            let name = unsafe { cstr(name) }?;
            let lib = self::library(library)?;
            if !lib.image.has_function(name) {
                return Err(NOT_FOUND);
            }
            let mut reg = handles::write();
            let mut kernels = lib.kernels.lock().unwrap_or_else(|e| e.into_inner());
            let h = match kernels.get(name) {
                Some(&h) => h,
                None => {
                    let f = Func::new(name, 0, lib.handle, 0);
                    let h = f.handle;
                    reg.funcs.insert(h, Arc::new(f));
                    kernels.insert(name.to_string(), h);
                    h
                }
            };
            drop(kernels);
            drop(reg);
            // SAFETY: pKernel is the caller's out-pointer (checked above).
            unsafe { put(pKernel, handles::as_ptr(h)) }
        })
    }
}

/// The library's module in the current context, made on first use.
fn library_module(lib: &Library) -> R<usize> {
    let ctx = context::current()?;
    let mut mods = lib.modules.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&m) = mods.get(&ctx.handle).filter(|m| handles::read().modules.contains_key(m)) {
        return Ok(m);
    }
    let m = load(lib.image.clone(), lib.handle)?;
    mods.insert(ctx.handle, m);
    Ok(m)
}

cuda_exports! {
    fn cuLibraryGetModule(pMod, library) {
        run(|| {
            need(pMod)?;
            let lib = self::library(library)?;
            let m = library_module(&lib)?;
            // SAFETY: pMod is the caller's out-pointer (checked above).
            unsafe { put(pMod, handles::as_ptr(m)) }
        })
    }
}

fn func(h: usize) -> R<Arc<Func>> {
    driver()?;
    handles::read().funcs.get(&h).cloned().ok_or(INVALID_HANDLE)
}

/// Fails unless `h` is a function or kernel this process holds.
pub(crate) fn check_function(h: usize) -> R {
    func(h).map(drop)
}

/// A function's compile-time cluster dimensions (zeros: none required) and whether it allows a
/// non-portable cluster size (`CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED`).
pub(crate) fn cluster_attributes(h: usize) -> R<([u32; 3], bool)> {
    let f = func(h)?;
    let dim = |i: usize| f.cluster[i].load(Relaxed).max(0) as u32;
    Ok(([dim(0), dim(1), dim(2)], f.non_portable_cluster.load(Relaxed) != 0))
}

cuda_exports! {
    fn cuKernelGetFunction(pFunc, kernel) {
        run(|| {
            need(pFunc)?;
            let k = func(kernel as usize)?;
            if k.module != 0 {
                return Err(INVALID_HANDLE);
            }
            let lib = self::library(handles::as_ptr(k.library))?;
            let m = library_module(&lib)?;
            let m = handles::read().modules.get(&m).cloned().ok_or(INVALID_HANDLE)?;
            let h = function_in(&m, k.name.to_str().unwrap_or_default())?;
            // SAFETY: pFunc is the caller's out-pointer (checked above).
            unsafe { put(pFunc, handles::as_ptr(h)) }
        })
    }
}

fn get_name(name: *mut *const c_char, h: usize) -> R {
    need(name)?;
    let f = func(h)?;
    // The string lives as long as the function (its module or library stays loaded).
    let p = f.name.as_ptr();
    // SAFETY: name is the caller's out-pointer (checked above).
    unsafe { put(name, p) }
}

cuda_exports! {
    fn cuFuncGetName(name, hfunc) also cuKernelGetName {
        run(|| get_name(name, hfunc as usize))
    }

    fn cuFuncGetModule(hmod, hfunc) {
        run(|| {
            need(hmod)?;
            let f = func(hfunc as usize)?;
            if f.module == 0 {
                return Err(INVALID_VALUE);
            }
            // SAFETY: hmod is the caller's out-pointer (checked above).
            unsafe { put(hmod, handles::as_ptr(f.module)) }
        })
    }
}

/// The compute capability (as 90 for 9.0) of the device a function's attributes are asked for.
fn cc_of(dev: Option<c_int>) -> R<i32> {
    let d = driver()?;
    let device = match dev {
        Some(o) => d.device(o)?,
        None => context::current().map(|c| c.dev).or_else(|_| d.device(0))?,
    };
    Ok((device.model.cc_major * 10 + device.model.cc_minor) as i32)
}

fn func_attribute(f: &Func, attrib: c_int, dev: Option<c_int>) -> R<c_int> {
    Ok(match attrib {
        0 => 1024,            // MAX_THREADS_PER_BLOCK
        1..=3 => 0,           // SHARED_SIZE_BYTES, CONST_SIZE_BYTES, LOCAL_SIZE_BYTES
        4 => 32,              // NUM_REGS
        5 | 6 => cc_of(dev)?, // PTX_VERSION, BINARY_VERSION
        7 => 0,               // CACHE_MODE_CA
        8 => f.max_dynamic_smem.load(Relaxed),
        9 => f.carveout.load(Relaxed),
        10 => 0, // CLUSTER_SIZE_MUST_BE_SET
        11..=13 => f.cluster[(attrib - 11) as usize].load(Relaxed),
        14 => f.non_portable_cluster.load(Relaxed),
        15 => f.sched_pref.load(Relaxed),
        _ => return Err(INVALID_VALUE),
    })
}

fn set_func_attribute(f: &Func, attrib: c_int, value: c_int, dev: Option<c_int>) -> R {
    let d = driver()?;
    let device = match dev {
        Some(o) => d.device(o)?,
        None => context::current().map(|c| c.dev).or_else(|_| d.device(0))?,
    };
    match attrib {
        8 if (0..=device.model.limits.max_shared_mem_per_block_optin as c_int).contains(&value) => {
            f.max_dynamic_smem.store(value, Relaxed)
        }
        9 if (-1..=100).contains(&value) => f.carveout.store(value, Relaxed),
        11..=13 if value >= 0 => f.cluster[(attrib - 11) as usize].store(value, Relaxed),
        14 if matches!(value, 0 | 1) => f.non_portable_cluster.store(value, Relaxed),
        15 if (0..=2).contains(&value) => f.sched_pref.store(value, Relaxed),
        _ => return Err(INVALID_VALUE),
    }
    Ok(())
}

cuda_exports! {
    fn cuFuncGetAttribute(pi, attrib, hfunc) {
        run(|| {
            need(pi)?;
            let f = func(hfunc as usize)?;
            let v = func_attribute(&f, attrib, None)?;
            // SAFETY: pi is the caller's out-pointer (checked above).
            unsafe { put(pi, v) }
        })
    }

    fn cuFuncSetAttribute(hfunc, attrib, value) {
        run(|| set_func_attribute(&*func(hfunc as usize)?, attrib, value, None))
    }

    fn cuKernelGetAttribute(pi, attrib, kernel, dev) {
        run(|| {
            need(pi)?;
            let f = func(kernel as usize)?;
            let v = func_attribute(&f, attrib, Some(dev))?;
            // SAFETY: pi is the caller's out-pointer (checked above).
            unsafe { put(pi, v) }
        })
    }

    fn cuKernelSetAttribute(attrib, val, kernel, dev) {
        run(|| set_func_attribute(&*func(kernel as usize)?, attrib, val, Some(dev)))
    }

    fn cuFuncSetCacheConfig(hfunc, config) {
        run(|| {
            let f = func(hfunc as usize)?;
            if !(0..=3).contains(&config) {
                return Err(INVALID_VALUE);
            }
            f.cache_config.store(config, Relaxed);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_come_from_names() {
        assert_eq!(kernel_duration_ns("spin_250us"), 250_000);
        assert_eq!(kernel_duration_ns("k_2ms"), 2_000_000);
        assert_eq!(kernel_duration_ns("tiny_700ns"), 700);
        assert_eq!(kernel_duration_ns("_Z10spin_250usPf"), 250_000);
        assert_eq!(kernel_duration_ns("_ZN2ns5k_3msEv"), 3_000_000);
        assert_eq!(kernel_duration_ns("gemm"), DEFAULT_KERNEL_NS);
        assert_eq!(kernel_duration_ns("gemm_fp16"), DEFAULT_KERNEL_NS);
        assert_eq!(kernel_duration_ns("x_us"), DEFAULT_KERNEL_NS);
        assert!(duration_from_arg("tessera_spin_argns"));
        assert!(duration_from_arg("_Z10spin_argnsPm"));
        assert!(!duration_from_arg("spin_250us"));
        assert!(!duration_from_arg("argns"));
    }

    #[test]
    fn ptx_declarations_are_read() {
        let ptx = ".version 8.0\n.target sm_90\n.global .align 4 .b8 table[64];\n.global .f32 scale;\n\
                   .visible .entry spin_1ms(\n.param .u64 p\n)\n{ ret; }\n";
        let Image::Ptx { entries, globals } = parse_ptx(ptx) else { panic!() };
        assert_eq!(entries, vec!["spin_1ms".to_string()]);
        assert_eq!(globals, vec![("table".to_string(), 64), ("scale".to_string(), 4)]);
        assert!(matches!(image_from_bytes(b"\x7fELF\x02\x01"), Image::Opaque));
    }
}
