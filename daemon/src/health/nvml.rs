//! The NVML side of health checking: an event set (raw calls through the session's function
//! table, as nvml-wrapper 0.13's `EventData` drops the MIG instance ids) and the liveness probe.

use std::cell::RefCell;
use std::ffi::c_uint;
use std::mem;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper_sys::bindings::*;

use crate::discovery::Session;

/// Event types the monitor acts on: XIDs and uncorrectable ECC errors. Corrected (single-bit)
/// ECC errors are not registered: they take nothing out of service.
pub const WANTED: u64 = (nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError) as u64;
const XID: u64 = nvmlEventTypeXidCriticalError as u64;
const DBE: u64 = nvmlEventTypeDoubleBitEccError as u64;
/// `gpuInstanceId` / `computeInstanceId` of an event that names no MIG instance.
const NO_INSTANCE: u32 = 0xFFFF_FFFF;

/// One event, as `nvmlEventSetWait_v2` delivers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawEvent {
    Xid { gpu: u32, xid: u32, mig: Option<(u32, u32)> },
    DoubleBitEcc { gpu: u32 },
    Other { gpu: u32, kind: u64 },
}

/// An NVML event set, freed when dropped.
pub struct EventSet<'a> {
    nvml: &'a Nvml,
    set: nvmlEventSet_t,
    /// Registered GPUs by handle: an event of a lost GPU must be placed without asking NVML
    /// about that GPU (which fails with GPU_IS_LOST).
    handles: RefCell<Vec<(usize, u32)>>,
}

// SAFETY: the handle is an opaque token NVML accepts from any thread; the set is used by one
// thread at a time (it is moved, never shared).
unsafe impl Send for EventSet<'_> {}

impl<'a> EventSet<'a> {
    pub fn new(nvml: &'a Nvml) -> Result<EventSet<'a>, NvmlError> {
        let create = nvml_sym(nvml.lib().nvmlEventSetCreate.as_ref())?;
        let mut set: nvmlEventSet_t = std::ptr::null_mut();
        // SAFETY: `set` is a valid out pointer for the handle.
        nvml_try(unsafe { create(&mut set) })?;
        Ok(EventSet { nvml, set, handles: RefCell::new(Vec::new()) })
    }

    /// Registers the wanted event types GPU `index` supports. `Ok(false)`: it supports none.
    pub fn register(&self, index: u32) -> Result<bool, NvmlError> {
        let lib = self.nvml.lib();
        let supported = nvml_sym(lib.nvmlDeviceGetSupportedEventTypes.as_ref())?;
        let register = nvml_sym(lib.nvmlDeviceRegisterEvents.as_ref())?;
        let dev = self.nvml.device_by_index(index)?;
        let mut types: u64 = 0;
        // SAFETY: the handle is live for the session; `types` is a valid out pointer.
        nvml_try(unsafe { supported(dev.handle(), &mut types) })?;
        let types = types & WANTED;
        if types == 0 {
            return Ok(false);
        }
        // SAFETY: the device handle and the event set are live; the types are supported ones.
        nvml_try(unsafe { register(dev.handle(), types, self.set) })?;
        // SAFETY: only the handle's value is kept, as a key.
        let key = unsafe { dev.handle() } as usize;
        let mut handles = self.handles.borrow_mut();
        handles.retain(|&(h, i)| h != key && i != index);
        handles.push((key, index));
        Ok(true)
    }

    /// The next event, waiting up to `timeout_ms`; `Ok(None)` when none came.
    pub fn wait(&self, timeout_ms: u32) -> Result<Option<RawEvent>, NvmlError> {
        let lib = self.nvml.lib();
        let wait = nvml_sym(lib.nvmlEventSetWait_v2.as_ref())?;
        let index = nvml_sym(lib.nvmlDeviceGetIndex.as_ref())?;
        // SAFETY: zeroes are a valid value of this plain C struct.
        let mut data: nvmlEventData_t = unsafe { mem::zeroed() };
        // SAFETY: the set is live; `data` is a valid out pointer of the v2 struct.
        match nvml_try(unsafe { wait(self.set, &mut data, timeout_ms as c_uint) }) {
            Ok(()) => {}
            Err(NvmlError::Timeout) => return Ok(None),
            Err(e) => return Err(e),
        }
        let known = self.handles.borrow().iter().find(|&&(h, _)| h == data.device as usize).map(|&(_, i)| i);
        let gpu = match known {
            Some(i) => i,
            None => {
                let mut gpu: c_uint = 0;
                // SAFETY: the event's device handle came from NVML; `gpu` is a valid out pointer.
                nvml_try(unsafe { index(data.device, &mut gpu) })?;
                gpu
            }
        };
        let instance = |v: u32| (v != NO_INSTANCE).then_some(v);
        Ok(Some(if data.eventType & XID != 0 {
            let mig = instance(data.gpuInstanceId).zip(instance(data.computeInstanceId));
            RawEvent::Xid { gpu, xid: u32::try_from(data.eventData).unwrap_or(u32::MAX), mig }
        } else if data.eventType & DBE != 0 {
            RawEvent::DoubleBitEcc { gpu }
        } else {
            RawEvent::Other { gpu, kind: data.eventType }
        }))
    }
}

impl Drop for EventSet<'_> {
    fn drop(&mut self) {
        if let Ok(free) = nvml_sym(self.nvml.lib().nvmlEventSetFree.as_ref()) {
            // SAFETY: the set is live and freed exactly once, here.
            let _ = unsafe { free(self.set) };
        }
    }
}

/// Counters a reset clears (the evidence that one happened), as far as the GPU reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Volatile (since the last reset / driver load) uncorrected ECC errors.
    pub ecc_uncorrected: Option<u64>,
    /// Volatile corrected ECC errors.
    pub ecc_corrected: Option<u64>,
    /// A row remap waits for the next reset.
    pub remap_pending: Option<bool>,
    /// What the driver says the GPU needs (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, drivers 550+):
    /// 0 nothing, 1 a GPU reset, 2 a node reboot, 3 drain P2P, 4 drain and reset.
    pub recovery_action: Option<u32>,
}

/// What a liveness probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The GPU answers.
    Alive(Counters),
    /// NVML says the GPU is lost (off the bus).
    Lost,
    /// The GPU does not answer for another reason.
    Failed(String),
}

/// Probes GPU `index`: a fresh handle, its memory info (any call fails on a lost GPU), then the
/// counters a reset clears.
pub fn probe(session: &Session, index: u32) -> Probe {
    let nvml = session.nvml();
    let dev = match nvml.device_by_index(index).and_then(|d| d.memory_info().map(|_| d)) {
        Ok(d) => d,
        Err(NvmlError::GpuLost) => return Probe::Lost,
        Err(e) => return Probe::Failed(e.to_string()),
    };
    let ecc = |kind| match dev.total_ecc_errors(kind, EccCounter::Volatile) {
        Ok(n) => Ok(Some(n)),
        Err(NvmlError::GpuLost) => Err(()),
        Err(_) => Ok(None),
    };
    let (Ok(ecc_uncorrected), Ok(ecc_corrected)) = (ecc(MemoryError::Uncorrected), ecc(MemoryError::Corrected)) else {
        return Probe::Lost;
    };
    let remap_pending = match remapped_rows_pending(nvml, &dev) {
        Ok(p) => Some(p),
        Err(NvmlError::GpuLost) => return Probe::Lost,
        Err(_) => None,
    };
    let recovery_action = match recovery_action(nvml, &dev) {
        Ok(a) => a,
        Err(NvmlError::GpuLost) => return Probe::Lost,
        Err(_) => None,
    };
    Probe::Alive(Counters { ecc_uncorrected, ecc_corrected, remap_pending, recovery_action })
}

/// The driver's recovery action for the GPU through `nvmlDeviceGetFieldValues`; `None` where the
/// driver does not know the field (older than 550).
fn recovery_action(nvml: &Nvml, dev: &nvml_wrapper::Device<'_>) -> Result<Option<u32>, NvmlError> {
    use nvml_wrapper_sys::bindings::{field_id, nvmlFieldValue_t, nvmlReturn_enum_NVML_SUCCESS};
    let f = nvml_sym(nvml.lib().nvmlDeviceGetFieldValues.as_ref())?;
    // SAFETY: nvmlFieldValue_t is plain data (integers and a union of numbers): all zeroes is valid.
    let mut value: nvmlFieldValue_t = unsafe { std::mem::zeroed() };
    value.fieldId = field_id::NVML_FI_DEV_GET_GPU_RECOVERY_ACTION;
    // SAFETY: the handle is live for the session; one writable value with its field id set.
    nvml_try(unsafe { f(dev.handle(), 1, &mut value) })?;
    if value.nvmlReturn != nvmlReturn_enum_NVML_SUCCESS {
        return Ok(None);
    }
    // SAFETY: the field's value type is an unsigned int (nvmlDeviceGpuRecoveryAction_t).
    Ok(Some(unsafe { value.value.uiVal }))
}

/// `nvmlDeviceGetRemappedRows`' pending flag (nvml-wrapper 0.13 has no wrapper for it).
fn remapped_rows_pending(nvml: &Nvml, dev: &nvml_wrapper::Device<'_>) -> Result<bool, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceGetRemappedRows.as_ref())?;
    let (mut corr, mut unc, mut pending, mut failed): (c_uint, c_uint, c_uint, c_uint) = (0, 0, 0, 0);
    // SAFETY: the handle is live for the session; all four are valid out pointers.
    nvml_try(unsafe { f(dev.handle(), &mut corr, &mut unc, &mut pending, &mut failed) })?;
    Ok(pending != 0)
}
