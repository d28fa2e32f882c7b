//! Interprocess sharing of device memory (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle`,
//! `cuIpcCloseMemHandle`), between processes of the node, as PyTorch's multiprocess tensors and
//! NCCL use it.
//!
//! Device memory is an anonymous mapping; exporting one moves it, in place and with its bytes, onto
//! a memfd (only the resident pages are copied), and the 64-byte handle names the exporter's pid
//! and that memfd. The importer opens it through `/proc/<pid>/fd/<fd>` (so both must share a pid
//! namespace, and the exporter must be alive and still hold the allocation) and maps the same
//! pages: what one writes, the other reads. The allocation is charged once, to the exporter;
//! importing charges nothing, as on a real GPU where one allocation is shared.
//!
//! Where the sim differs: a real driver keeps the memory alive after the exporter frees it until
//! every importer closes it; here the importer keeps the pages (its mapping) but the memory is no
//! longer counted on the device.

use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{LazyLock, Mutex, MutexGuard};

use tessera_abi::cuda_exports;

use super::handles;
use super::memory::{Alloc, MemKind};
use super::{INVALID_CONTEXT, INVALID_HANDLE, INVALID_VALUE, OUT_OF_MEMORY, R, need, put, run};
use super::{context, init::driver};

const MAGIC: &[u8; 8] = b"TSIMIPC1";
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the one flag of `cuIpcOpenMemHandle`.
const LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// Whether any allocation of this process was exported (it cannot cross a checkpoint).
pub(crate) fn any_exported() -> bool {
    !exported().is_empty()
}

/// The memfds of this process's exported allocations, by base address.
fn exported() -> MutexGuard<'static, HashMap<u64, OwnedFd>> {
    static EXPORTED: LazyLock<Mutex<HashMap<u64, OwnedFd>>> = LazyLock::new(Default::default);
    EXPORTED.lock().unwrap_or_else(|p| p.into_inner())
}

/// Called when an allocation is released: its memfd (if exported) goes with it.
pub(crate) fn forget(base: u64) {
    exported().remove(&base);
}

/// What a handle carries.
struct Handle {
    pid: u32,
    fd: i32,
    size: u64,
}

impl Handle {
    fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.fd.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    fn decode(b: &[u8; 64]) -> R<Handle> {
        if &b[..8] != MAGIC {
            return Err(INVALID_VALUE);
        }
        let word = |r: std::ops::Range<usize>| b[r].try_into().map_err(|_| INVALID_VALUE);
        Ok(Handle {
            pid: u32::from_le_bytes(word(8..12)?),
            fd: i32::from_le_bytes(word(12..16)?),
            size: u64::from_le_bytes(b[16..24].try_into().map_err(|_| INVALID_VALUE)?),
        })
    }
}

/// Moves an anonymous mapping onto a new memfd, in place, keeping its resident bytes.
fn move_to_memfd(base: u64, len: usize) -> R<OwnedFd> {
    // SAFETY: memfd_create with a static NUL-terminated name creates a new file descriptor.
    let raw = unsafe { libc::memfd_create(c"tessera-sim-ipc".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(OUT_OF_MEMORY);
    }
    // SAFETY: raw is a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: plain syscall on our descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(OUT_OF_MEMORY);
    }
    // Copy only the pages the program touched: untouched ones read as zero in both.
    let page = 4096usize;
    let pages = len.div_ceil(page);
    let mut resident = vec![0u8; pages];
    // SAFETY: (base, len) is our mapping; resident holds one byte per page.
    let known = unsafe { libc::mincore(base as *mut c_void, len, resident.as_mut_ptr()) } == 0;
    for (i, r) in resident.iter().enumerate() {
        if known && r & 1 == 0 {
            continue;
        }
        let off = i * page;
        let n = page.min(len - off);
        // SAFETY: reading n bytes of our own mapping at base + off, within its length.
        let written =
            unsafe { libc::pwrite(fd.as_raw_fd(), (base as usize + off) as *const c_void, n, off as libc::off_t) };
        if written != n as isize {
            return Err(OUT_OF_MEMORY);
        }
    }
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: MAP_FIXED replaces exactly our own mapping (base, len), whose bytes are now in fd.
    let p =
        unsafe { libc::mmap(base as *mut c_void, len, prot, libc::MAP_SHARED | libc::MAP_FIXED, fd.as_raw_fd(), 0) };
    if p as u64 != base {
        return Err(OUT_OF_MEMORY);
    }
    Ok(fd)
}

fn get_mem_handle(dptr: u64) -> R<[u8; 64]> {
    let node = driver()?.node;
    super::errors::poll_faults(node)?;
    let reg = handles::read();
    let a = reg.mem.get(&dptr).filter(|a| a.kind == MemKind::Device).ok_or(INVALID_VALUE)?;
    let mut exported = exported();
    let fd = match exported.entry(dptr) {
        std::collections::hash_map::Entry::Occupied(e) => e.get().as_raw_fd(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(move_to_memfd(a.base, a.map_len)?).as_raw_fd(),
    };
    Ok(Handle { pid: std::process::id(), fd, size: a.size }.encode())
}

fn open_mem_handle(bytes: &[u8; 64], flags: c_uint) -> R<u64> {
    let node = driver()?.node;
    super::errors::poll_faults(node)?;
    if flags & !LAZY_ENABLE_PEER_ACCESS != 0 {
        return Err(INVALID_VALUE);
    }
    let h = Handle::decode(bytes)?;
    let ctx = context::current()?;
    ctx.check(node)?;
    if h.pid == std::process::id() {
        // A real driver refuses to open a process's own handle.
        return Err(INVALID_CONTEXT);
    }
    let path = format!("/proc/{}/fd/{}\0", h.pid, h.fd);
    // SAFETY: path is NUL-terminated; open creates a new descriptor or fails.
    let raw = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        // The exporter is gone, or freed the allocation.
        return Err(INVALID_HANDLE);
    }
    // SAFETY: raw is a new descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a stat into st on success.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(INVALID_HANDLE);
    }
    // SAFETY: fstat succeeded, so st is initialized.
    let st = unsafe { st.assume_init() };
    let len = usize::try_from(h.size).map_err(|_| INVALID_VALUE)?;
    if (st.st_size as u64) < h.size || len == 0 {
        return Err(INVALID_HANDLE);
    }
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: a new shared mapping of the memfd; it touches no existing memory.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(OUT_OF_MEMORY);
    }
    let base = p as u64;
    let a = Alloc { map_len: len, ..Alloc::new(base, h.size, MemKind::Imported, ctx.handle, ctx.dev) };
    handles::write().mem.insert(base, a);
    Ok(base)
}

fn close_mem_handle(dptr: u64) -> R {
    let node = driver()?.node;
    let a = {
        let mut reg = handles::write();
        if !reg.mem.get(&dptr).is_some_and(|a| a.kind == MemKind::Imported) {
            return Err(INVALID_VALUE);
        }
        reg.mem.remove(&dptr).expect("checked above")
    };
    super::memory::release(node, &a);
    Ok(())
}

cuda_exports! {
    fn cuIpcGetMemHandle(pHandle, dptr) {
        run(|| {
            need(pHandle)?;
            let bytes = get_mem_handle(dptr)?;
            // SAFETY: pHandle is the caller's out-pointer (checked above); the struct is 64 chars.
            unsafe { put(pHandle.cast::<[u8; 64]>(), bytes) }
        })
    }

    fn cuIpcOpenMemHandle_v2(pdptr, handle, Flags) {
        run(|| {
            need(pdptr)?;
            let bytes: [u8; 64] = handle.reserved.map(|c| c as u8);
            let p = open_mem_handle(&bytes, Flags)?;
            // SAFETY: pdptr is the caller's out-pointer (checked above).
            unsafe { put(pdptr, p) }
        })
    }

    /// The CUDA 4.1 entry point, by value as well.
    fn cuIpcOpenMemHandle(pdptr, handle, Flags) {
        // SAFETY: same contract.
        unsafe { cuIpcOpenMemHandle_v2(pdptr, handle, Flags) }
    }

    fn cuIpcCloseMemHandle(dptr) {
        run(|| close_mem_handle(dptr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_foreign_bytes_are_refused() {
        let h = Handle { pid: 4242, fd: 17, size: 256 << 20 };
        let back = Handle::decode(&h.encode()).unwrap();
        assert_eq!((back.pid, back.fd, back.size), (4242, 17, 256 << 20));
        assert_eq!(Handle::decode(&[0u8; 64]).err(), Some(INVALID_VALUE), "a zeroed handle");
        let mut other = h.encode();
        other[0] ^= 1;
        assert_eq!(Handle::decode(&other).err(), Some(INVALID_VALUE), "another driver's handle");
    }

    #[test]
    fn moving_to_a_memfd_keeps_the_bytes_in_place() {
        let len = 3 * 4096 + 100;
        let base = super::super::memory::map_anon(len as u64, false).unwrap();
        // SAFETY: base is a fresh mapping of len bytes.
        unsafe {
            *((base + 5000) as *mut u8) = 9;
            *((base + len as u64 - 1) as *mut u8) = 3;
        }
        let fd = move_to_memfd(base, len).unwrap();
        // SAFETY: the mapping is still ours, now shared with fd.
        unsafe {
            assert_eq!(*((base + 5000) as *const u8), 9);
            assert_eq!(*((base + len as u64 - 1) as *const u8), 3);
            assert_eq!(*(base as *const u8), 0, "untouched pages read zero");
            *(base as *mut u8) = 1;
        }
        let mut b = [0u8; 1];
        // SAFETY: reading one byte of our own memfd.
        assert_eq!(unsafe { libc::pread(fd.as_raw_fd(), b.as_mut_ptr().cast(), 1, 0) }, 1);
        assert_eq!(b, [1], "writes through the mapping land in the memfd");
        super::super::memory::unmap(base, len);
    }
}
