//! JIT linking (`cuLink*`), as CuPy and Numba use it to link relocatable device code. Nothing is
//! compiled: linking PTX inputs gives PTX that declares every entry of the inputs (so a module
//! loaded from it resolves exactly those names); any binary input (cubin, fatbin, object,
//! library) makes the output an opaque image, in which every name resolves. The output stays
//! valid until `cuLinkDestroy`, as the real driver's does.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::{Mutex, MutexGuard};

use tessera_abi::cuda_exports;

use super::init::driver;
use super::{CUresult, INVALID_HANDLE, INVALID_VALUE, R, cstr, handles, need, put, run, sys};

/// `CUjitInputType`: CUBIN, PTX, FATBINARY, OBJECT, LIBRARY (NVVM and later: not supported).
const INPUT_PTX: c_int = 1;
const INPUT_LAST: c_int = 4;

/// What an opaque linked image starts with: an ELF magic, as a cubin does.
const OPAQUE_IMAGE: &[u8] = b"\x7fELF tessera-sim linked image\0";

#[derive(Default)]
struct Link {
    ptx: Vec<u8>,
    binary: bool,
    inputs: usize,
    /// The linked image, once complete.
    output: Option<Vec<u8>>,
}

static LINKS: Mutex<Option<HashMap<usize, Link>>> = Mutex::new(None);

fn links() -> MutexGuard<'static, Option<HashMap<usize, Link>>> {
    LINKS.lock().unwrap_or_else(|e| e.into_inner())
}

fn with_link<T>(state: sys::CUlinkState, f: impl FnOnce(&mut Link) -> R<T>) -> R<T> {
    let mut g = links();
    let link = g.as_mut().and_then(|m| m.get_mut(&(state as usize))).ok_or(INVALID_HANDLE)?;
    f(link)
}

fn create(state: *mut sys::CUlinkState) -> R {
    need(state)?;
    driver()?;
    super::context::current()?;
    let h = handles::new_handle();
    links().get_or_insert_with(HashMap::new).insert(h, Link::default());
    // SAFETY: state is the caller's out-pointer (checked above).
    unsafe { put(state, handles::as_ptr(h)) }
}

cuda_exports! {
    fn cuLinkCreate_v2(_numOptions, _options, _optionValues, stateOut) {
        run(|| create(stateOut))
    }

    fn cuLinkCreate(numOptions, options, optionValues, stateOut) {
        // SAFETY: the same contract as cuLinkCreate_v2.
        unsafe { cuLinkCreate_v2(numOptions, options, optionValues, stateOut) }
    }
}

fn add(state: sys::CUlinkState, kind: c_int, data: &[u8]) -> R {
    if !(0..=INPUT_LAST).contains(&kind) {
        return Err(if kind > INPUT_LAST { CUresult::CUDA_ERROR_NOT_SUPPORTED } else { INVALID_VALUE });
    }
    with_link(state, |l| {
        if l.output.is_some() {
            return Err(INVALID_VALUE);
        }
        // A binary given as PTX (CuPy passes NVRTC's cubins so) is a binary.
        if kind == INPUT_PTX && !super::module::is_binary(data) {
            let text = data.split(|&b| b == 0).next().unwrap_or(data);
            l.ptx.extend_from_slice(text);
            l.ptx.push(b'\n');
        } else {
            l.binary = true;
        }
        l.inputs += 1;
        Ok(())
    })
}

cuda_exports! {
    fn cuLinkAddData_v2(state, type_, data, size, _name, _numOptions, _options, _optionValues) {
        run(|| {
            driver()?;
            if data.is_null() || size == 0 {
                return Err(INVALID_VALUE);
            }
            // SAFETY: the caller passes `size` readable bytes at `data`.
            let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size) };
            add(state, type_, bytes)
        })
    }

    fn cuLinkAddData(state, type_, data, size, name, numOptions, options, optionValues) {
        // SAFETY: the same contract as cuLinkAddData_v2.
        unsafe { cuLinkAddData_v2(state, type_, data, size, name, numOptions, options, optionValues) }
    }

    fn cuLinkAddFile_v2(state, type_, path, _numOptions, _options, _optionValues) {
        run(|| {
            driver()?;
            // SAFETY: the caller's NUL-terminated path.
            let path = unsafe { cstr(path) }?;
            let bytes = std::fs::read(path).map_err(|_| CUresult::CUDA_ERROR_FILE_NOT_FOUND)?;
            add(state, type_, &bytes)
        })
    }

    fn cuLinkAddFile(state, type_, path, numOptions, options, optionValues) {
        // SAFETY: the same contract as cuLinkAddFile_v2.
        unsafe { cuLinkAddFile_v2(state, type_, path, numOptions, options, optionValues) }
    }

    fn cuLinkComplete(state, cubinOut, sizeOut) {
        run(|| {
            need(cubinOut)?;
            need(sizeOut)?;
            driver()?;
            let (p, n) = with_link(state, |l| {
                if l.inputs == 0 {
                    return Err(INVALID_VALUE);
                }
                let out = l.output.get_or_insert_with(|| {
                    if l.binary {
                        OPAQUE_IMAGE.to_vec()
                    } else {
                        let mut text = std::mem::take(&mut l.ptx);
                        text.push(0);
                        text
                    }
                });
                Ok((out.as_mut_ptr(), out.len()))
            })?;
            // SAFETY: both are the caller's out-pointers (checked above); the image lives in the link
            // state until cuLinkDestroy (its Vec is not touched again before).
            unsafe {
                put(cubinOut, p.cast())?;
                put(sizeOut, n)
            }
        })
    }

    fn cuLinkDestroy(state) {
        run(|| {
            driver()?;
            links().as_mut().and_then(|m| m.remove(&(state as usize))).map(drop).ok_or(INVALID_HANDLE)
        })
    }
}
