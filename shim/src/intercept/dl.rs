//! `dlsym` and `dlvsym` interposition: a program (or a CUDA runtime) that opens the driver with
//! `dlopen` and looks its functions up by name gets our hooks for the hooked names.
//!
//! Both exports are tiny assembly trampolines. They ask [`decide`] whether to substitute a hook;
//! if not (every name that is not a hooked CUDA/NVML name, so nearly every call), they *jump* to
//! glibc's function with the caller's own registers and return address, so glibc sees the
//! original caller: `RTLD_NEXT` keeps meaning "after the caller", not "after libtessera".
//!
//! glibc's functions are found by reading libc's (or, before glibc 2.34, libdl's) ELF symbol
//! table ([`super::elf`]): any by-name lookup from here would find our own exports. Then, as the
//! design asks, the `dlsym` we forward to is refined to `dlvsym(RTLD_NEXT, "dlsym",
//! "GLIBC_2.34")`, falling back to `"GLIBC_2.2.5"`, so that another `dlsym` interposer loaded
//! after us stays in the chain. Nothing here allocates; a reentrant call during set-up (a
//! malloc interposer calling `dlsym`) uses the libc function found first.

use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::*};

use super::elf;

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
type DlvsymFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> *mut c_void;

/// Where the trampolines jump when no hook is substituted (read by the assembly as a word).
static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);
static REAL_DLVSYM: AtomicUsize = AtomicUsize::new(0);
/// 0: not refined yet, 1: refining, 2: done.
static REFINED: AtomicU8 = AtomicU8::new(0);

const LIBS: &[&[u8]] = &[b"libc.so.6", b"libdl.so.2"];
// glibc moved dlsym into libc in 2.34, keeping libdl.so.2 as an empty shim: prefer libdl's only
// where libc has none. `elf::lookup` takes the first library in this order that defines it.

/// Stands in for glibc's function if it cannot be found (never on a glibc system).
unsafe extern "C" fn missing_dlsym(_h: *mut c_void, _s: *const c_char) -> *mut c_void {
    std::ptr::null_mut()
}

unsafe extern "C" fn missing_dlvsym(_h: *mut c_void, _s: *const c_char, _v: *const c_char) -> *mut c_void {
    std::ptr::null_mut()
}

/// Finds glibc's `dlsym` and `dlvsym` (once; cheap after).
#[inline]
fn ensure() {
    if REFINED.load(Acquire) == 2 {
        return;
    }
    ensure_slow();
}

#[cold]
fn ensure_slow() {
    if REAL_DLSYM.load(Acquire) == 0 {
        let s = elf::lookup(LIBS, b"dlsym", None).unwrap_or(missing_dlsym as *const () as usize);
        let v = elf::lookup(LIBS, b"dlvsym", None).unwrap_or(missing_dlvsym as *const () as usize);
        REAL_DLVSYM.store(v, Release);
        REAL_DLSYM.store(s, Release);
    }
    if REFINED.compare_exchange(0, 1, AcqRel, Acquire).is_err() {
        return; // another thread (or an outer call on this one) is refining; the libc one serves
    }
    let v = REAL_DLVSYM.load(Acquire);
    if v != missing_dlvsym as *const () as usize {
        // SAFETY: v is glibc's dlvsym (found above), which has this signature.
        let dlvsym: DlvsymFn = unsafe { std::mem::transmute::<usize, DlvsymFn>(v) };
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
            // SAFETY: valid C strings; RTLD_NEXT from this library names the objects after it.
            let p = unsafe { dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                REAL_DLSYM.store(p as usize, Release);
                break;
            }
        }
    }
    REFINED.store(2, Release);
}

/// The real `dlsym`, for our own lookups (never our export).
pub(crate) fn real_dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    ensure();
    // SAFETY: REAL_DLSYM holds glibc's dlsym (or the null-returning stand-in), set by ensure.
    let f: DlsymFn = unsafe { std::mem::transmute::<usize, DlsymFn>(REAL_DLSYM.load(Acquire)) };
    // SAFETY: the caller passes a handle (or pseudo-handle) and a C string, as dlsym needs.
    unsafe { f(handle, name) }
}

/// Whether the caller of `dlsym`/`dlvsym` gets our hook for `name` instead of what glibc finds:
/// the hook's address, or null to let glibc answer. `found` is what glibc finds for the name
/// (relative to libtessera for `RTLD_NEXT`, which is what matters here: whether the next
/// definition is the driver's).
fn substitute(handle: *mut c_void, name: *const c_char, found: impl FnOnce() -> *mut c_void) -> *mut c_void {
    if name.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: dlsym's caller passes a NUL-terminated name.
    let Some(hook) = (unsafe { super::hook_for(name) }) else { return std::ptr::null_mut() };
    let _ = handle;
    let p = found();
    if p.is_null() {
        return std::ptr::null_mut();
    }
    if p == hook {
        return hook;
    }
    // SAFETY: name is a NUL-terminated string (above).
    let nvml = unsafe { CStr::from_ptr(name) }.to_bytes().starts_with(b"nvml");
    let driver = if nvml { crate::real::nvml_handle_if_loaded() } else { crate::real::cuda_handle_if_loaded() };
    if driver.is_some_and(|h| real_dlsym(h, name) == p) || in_driver_file(p, nvml) {
        return hook;
    }
    std::ptr::null_mut()
}

/// Whether `p` lies in a file named as the driver library (`libcuda.so*`, `libnvidia-ml.so*`),
/// for a driver loaded under a path the by-name lookup does not match.
fn in_driver_file(p: *mut c_void, nvml: bool) -> bool {
    // SAFETY: Dl_info is plain data; dladdr fills it for any address.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: info is a valid out-struct.
    if unsafe { libc::dladdr(p, &mut info) } == 0 || info.dli_fname.is_null() {
        return false;
    }
    // SAFETY: dladdr set a NUL-terminated path owned by the loader.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes();
    let file = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
    file.starts_with(if nvml { b"libnvidia-ml.so" } else { b"libcuda.so" })
}

/// Called by the `dlsym` trampoline.
extern "C" fn dlsym_decide(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    crate::ffi::guard(std::ptr::null_mut(), || {
        ensure();
        substitute(handle, name, || real_dlsym(handle, name))
    })
}

/// Called by the `dlvsym` trampoline.
extern "C" fn dlvsym_decide(handle: *mut c_void, name: *const c_char, version: *const c_char) -> *mut c_void {
    crate::ffi::guard(std::ptr::null_mut(), || {
        ensure();
        substitute(handle, name, || {
            // SAFETY: REAL_DLVSYM holds glibc's dlvsym (or the stand-in), set by ensure.
            let f: DlvsymFn = unsafe { std::mem::transmute::<usize, DlvsymFn>(REAL_DLVSYM.load(Acquire)) };
            // SAFETY: the caller's handle, name and version, as dlvsym needs.
            unsafe { f(handle, name, version) }
        })
    })
}

#[cfg(target_arch = "x86_64")]
mod trampolines {
    use super::*;

    /// `dlsym`: our hook for a hooked driver name, else glibc's answer for the original caller.
    ///
    /// # Safety
    /// As glibc's `dlsym`.
    #[unsafe(naked)]
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
        // On entry rsp is 8 mod 16 (the return address); two pushes and 8 more bytes align it
        // for the call. The arguments are restored before the jump, and the jump (not a call)
        // leaves the caller's return address on top: glibc sees the original caller.
        core::arch::naked_asm!(
            "push rdi",
            "push rsi",
            "sub rsp, 8",
            "call {decide}",
            "add rsp, 8",
            "pop rsi",
            "pop rdi",
            "test rax, rax",
            "jz 2f",
            "ret",
            "2:",
            "jmp qword ptr [rip + {real}]",
            decide = sym dlsym_decide,
            real = sym REAL_DLSYM,
        )
    }

    /// `dlvsym`: as [`dlsym`], with a version.
    ///
    /// # Safety
    /// As glibc's `dlvsym`.
    #[unsafe(naked)]
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn dlvsym(handle: *mut c_void, symbol: *const c_char, version: *const c_char) -> *mut c_void {
        // Three pushes leave rsp 0 mod 16 for the call.
        core::arch::naked_asm!(
            "push rdi",
            "push rsi",
            "push rdx",
            "call {decide}",
            "pop rdx",
            "pop rsi",
            "pop rdi",
            "test rax, rax",
            "jz 2f",
            "ret",
            "2:",
            "jmp qword ptr [rip + {real}]",
            decide = sym dlvsym_decide,
            real = sym REAL_DLVSYM,
        )
    }
}

#[cfg(target_arch = "aarch64")]
mod trampolines {
    use super::*;

    /// `dlsym`: our hook for a hooked driver name, else glibc's answer for the original caller.
    ///
    /// # Safety
    /// As glibc's `dlsym`.
    #[unsafe(naked)]
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
        core::arch::naked_asm!(
            "stp x29, x30, [sp, #-32]!",
            "mov x29, sp",
            "stp x0, x1, [sp, #16]",
            "bl {decide}",
            "mov x16, x0",
            "ldp x0, x1, [sp, #16]",
            "ldp x29, x30, [sp], #32",
            "cbz x16, 2f",
            "mov x0, x16",
            "ret",
            "2:",
            "adrp x16, {real}",
            "ldr x16, [x16, :lo12:{real}]",
            "br x16",
            decide = sym dlsym_decide,
            real = sym REAL_DLSYM,
        )
    }

    /// `dlvsym`: as [`dlsym`], with a version.
    ///
    /// # Safety
    /// As glibc's `dlvsym`.
    #[unsafe(naked)]
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn dlvsym(handle: *mut c_void, symbol: *const c_char, version: *const c_char) -> *mut c_void {
        core::arch::naked_asm!(
            "stp x29, x30, [sp, #-48]!",
            "mov x29, sp",
            "stp x0, x1, [sp, #16]",
            "str x2, [sp, #32]",
            "bl {decide}",
            "mov x16, x0",
            "ldp x0, x1, [sp, #16]",
            "ldr x2, [sp, #32]",
            "ldp x29, x30, [sp], #48",
            "cbz x16, 2f",
            "mov x0, x16",
            "ret",
            "2:",
            "adrp x16, {real}",
            "ldr x16, [x16, :lo12:{real}]",
            "br x16",
            decide = sym dlvsym_decide,
            real = sym REAL_DLVSYM,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_dlsym_is_glibcs() {
        let p = real_dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr());
        assert_eq!(p as usize, libc::getpid as *const () as usize);
        assert!(real_dlsym(libc::RTLD_DEFAULT, c"no_such_symbol_anywhere".as_ptr()).is_null());
        assert_ne!(REAL_DLSYM.load(Relaxed), missing_dlsym as *const () as usize);
        assert_ne!(REAL_DLVSYM.load(Relaxed), missing_dlvsym as *const () as usize);
    }
}
