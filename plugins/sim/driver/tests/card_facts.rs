//! The simulated board answers what a real one answered: a reading of a real card (every
//! `cuDeviceGetAttribute` from 1 to 159, NVML's answers, the GPU-instance profiles) is compared,
//! answer by answer, with what the simulator's exported ABI gives for the same board, through
//! `libcuda.so.1` and `libnvidia-ml.so.1` as a program would call them. Every difference is listed
//! in one failure.
//!
//! The reading is `tests/data/h200-facts.json`: one NVIDIA H200 SXM, driver 580.159.04, CUDA 13.0
//! (our own probe; a copy of `shared/reference/h200-facts.json`). Another reading in the same form
//! is checked with `TESSERA_CARD_FACTS=path cargo test -p tessera-sim-driver --test card_facts`:
//! the board is the catalog model of that name, the node the driver and CUDA versions it gives.
//!
//! Not compared: the PCI location (attributes 33, 34 and 50, and NVML's board id, which the
//! driver derives from it) is the probed machine's own, so those are checked against the
//! simulated GPU's own location instead; the card's UUID is not in the file. `measured_*` are
//! timings and granularity, not answers: the timings are checked as floors here
//! (`calls_take_at_least_what_they_took_on_the_card`), the granularity is `tests/granularity.rs`'s.

#[macro_use]
mod common;

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

use common::{Lib, facts, facts_path, node_for};
use nvml_wrapper_sys::bindings::*;
use serde_json::Value;

/// An answer: a value, or the error the driver returned.
fn answer(rc: u32, v: Value) -> Value {
    if rc == 0 { v } else { Value::String(format!("rc{rc}")) }
}

/// NVML's error in the reading's form ("ERR Not Supported", as nvidia-ml-py prints it).
/// An NVML answer: `v` if the call returned success, else its error.
fn nvml_answer(lib: &Lib, rc: u32, v: Value) -> Value {
    if rc == 0 { v } else { nvml_err(lib, rc) }
}

fn nvml_err(lib: &Lib, rc: u32) -> Value {
    let f: unsafe extern "C" fn(u32) -> *const c_char = lib.sym("nvmlErrorString");
    // SAFETY: nvmlErrorString returns a static NUL-terminated string for any code.
    let s = unsafe { CStr::from_ptr(f(rc)) }.to_string_lossy().into_owned();
    Value::String(format!("ERR {s}"))
}

fn c_string(buf: &[c_char]) -> String {
    // SAFETY: the driver NUL-terminates what it writes, and the buffer is zeroed beforehand.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// Compares one answer, noting a difference.
fn check(diffs: &mut Vec<String>, what: &str, card: &Value, sim: Value) {
    if *card != sim {
        diffs.push(format!("{what}: card {card}, sim {sim}"));
    }
}

/// The CUDA answers: every attribute, the total memory, the name, the driver version.
fn cuda_diffs(lib: &Lib, f: &Value, diffs: &mut Vec<String>) {
    assert_eq!(call!(lib, cuInit(0) as fn(c_uint)), 0, "cuInit");
    let mut bus_id = [0 as c_char; 32];
    assert_eq!(call!(lib, cuDeviceGetPCIBusId(bus_id.as_mut_ptr(), 32, 0) as fn(*mut c_char, c_int, c_int)), 0);
    // "0000:18:00.0": domain, bus, device.
    let loc: Vec<i64> = c_string(&bus_id).split([':', '.']).map(|p| i64::from_str_radix(p, 16).unwrap()).collect();
    let attributes = f["attributes"].as_object().expect("facts: attributes");
    assert!(attributes.len() >= 159, "facts: attributes 1..159 expected, {} found", attributes.len());
    for (key, card) in attributes {
        let attr: c_int = key.parse().unwrap_or_else(|_| panic!("facts: attribute {key:?}"));
        let mut v: c_int = -12345;
        let rc = call!(lib, cuDeviceGetAttribute(&mut v, attr, 0) as fn(*mut c_int, c_int, c_int));
        let sim = answer(rc, Value::from(v));
        // The PCI location is the machine's own: the sim must answer its own.
        let own = match attr {
            33 => Some(loc[1]),
            34 => Some(loc[2]),
            50 => Some(loc[0]),
            _ => None,
        };
        match own {
            Some(own) => check(diffs, &format!("attribute {attr} (own PCI location)"), &Value::from(own), sim),
            None => check(diffs, &format!("attribute {attr}"), card, sim),
        }
    }
    let mut total = 0usize;
    let rc = call!(lib, cuDeviceTotalMem_v2(&mut total, 0) as fn(*mut usize, c_int));
    check(diffs, "cuDeviceTotalMem", &f["cuDeviceTotalMem"], answer(rc, Value::from(total)));
    let mut name = [0 as c_char; 256];
    let rc = call!(lib, cuDeviceGetName(name.as_mut_ptr(), 256, 0) as fn(*mut c_char, c_int, c_int));
    check(diffs, "cuDeviceGetName", &f["cuDeviceGetName"], answer(rc, Value::from(c_string(&name))));
    let mut version: c_int = 0;
    let rc = call!(lib, cuDriverGetVersion(&mut version) as fn(*mut c_int));
    check(diffs, "cuDriverGetVersion", &f["cuDriverGetVersion"], answer(rc, Value::from(version)));
}

type Dev = *mut c_void;

/// One NVML answer: a `c_uint` out-value of `fn(device, ..., *mut c_uint)`.
fn nv_uint(lib: &Lib, name: &str, dev: Dev) -> Value {
    let f: unsafe extern "C" fn(Dev, *mut c_uint) -> u32 = lib.sym(name);
    let mut v: c_uint = 0;
    // SAFETY: `name` has the signature nvmlReturn_t (nvmlDevice_t, unsigned int *) (or an enum of that size).
    let rc = unsafe { f(dev, &mut v) };
    nvml_answer(lib, rc, Value::from(v))
}

/// An NVML answer of two out-values, as the reading lists them ([current, pending], [major, minor]).
fn nv_pair(lib: &Lib, name: &str, dev: Dev) -> Value {
    let f: unsafe extern "C" fn(Dev, *mut c_uint, *mut c_uint) -> u32 = lib.sym(name);
    let (mut a, mut b): (c_uint, c_uint) = (0, 0);
    // SAFETY: `name` has the signature nvmlReturn_t (nvmlDevice_t, T *, T *) with T of 32 bits.
    let rc = unsafe { f(dev, &mut a, &mut b) };
    nvml_answer(lib, rc, Value::from(vec![a, b]))
}

/// An NVML string answer: `fn(device, char *, unsigned int)`.
fn nv_string(lib: &Lib, name: &str, dev: Dev) -> Value {
    let f: unsafe extern "C" fn(Dev, *mut c_char, c_uint) -> u32 = lib.sym(name);
    let mut buf = [0 as c_char; 256];
    // SAFETY: `name` writes at most 256 bytes into buf.
    let rc = unsafe { f(dev, buf.as_mut_ptr(), 256) };
    nvml_answer(lib, rc, Value::from(c_string(&buf)))
}

/// An NVML system string answer: `fn(char *, unsigned int)`.
fn nv_system_string(lib: &Lib, name: &str) -> Value {
    let f: unsafe extern "C" fn(*mut c_char, c_uint) -> u32 = lib.sym(name);
    let mut buf = [0 as c_char; 256];
    // SAFETY: `name` writes at most 256 bytes into buf.
    let rc = unsafe { f(buf.as_mut_ptr(), 256) };
    nvml_answer(lib, rc, Value::from(c_string(&buf)))
}

/// A GPU-instance profile as the reading lists it (nvidia-ml-py's field names).
fn gi_profile(lib: &Lib, dev: Dev, profile: u32) -> Value {
    let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe_zeroed();
    info.version = (std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32) | (2 << 24);
    let rc = call!(
        lib,
        nvmlDeviceGetGpuInstanceProfileInfoV(dev, profile, &mut info)
            as fn(Dev, c_uint, *mut nvmlGpuInstanceProfileInfo_v2_t)
    );
    if rc != 0 {
        return nvml_err(lib, rc);
    }
    serde_json::json!({
        "copyEngineCount": info.copyEngineCount,
        "decoderCount": info.decoderCount,
        "encoderCount": info.encoderCount,
        "id": info.id,
        "instanceCount": info.instanceCount,
        "isP2pSupported": info.isP2pSupported,
        "jpegCount": info.jpegCount,
        "memorySizeMB": info.memorySizeMB,
        "multiprocessorCount": info.multiprocessorCount,
        "name": c_string(&info.name),
        "ofaCount": info.ofaCount,
        "sliceCount": info.sliceCount,
    })
}

/// A zeroed plain C struct.
fn unsafe_zeroed<T: Copy>() -> T {
    // SAFETY: only used for NVML's plain C structs (integers and char arrays), for which zero is valid.
    unsafe { std::mem::zeroed() }
}

/// The NVML answers, key by key; a key this test cannot read is itself a difference, so that a
/// new kind of answer in a later reading is not passed over.
fn nvml_diffs(lib: &Lib, f: &Value, diffs: &mut Vec<String>) {
    assert_eq!(call!(lib, nvmlInit_v2() as fn()), 0, "nvmlInit_v2");
    let mut dev: Dev = std::ptr::null_mut();
    assert_eq!(call!(lib, nvmlDeviceGetHandleByIndex_v2(0, &mut dev) as fn(c_uint, *mut Dev)), 0);
    let mut pci: nvmlPciInfo_t = unsafe_zeroed();
    assert_eq!(call!(lib, nvmlDeviceGetPciInfo_v3(dev, &mut pci) as fn(Dev, *mut nvmlPciInfo_t)), 0);
    let facts = f.as_object().expect("facts: an object");
    for (key, card) in facts {
        let sim = match key.as_str() {
            // Not answers, or compared above through CUDA.
            "_about"
            | "measured_call_latency_us"
            | "measured_granularity"
            | "attributes"
            | "cuDeviceTotalMem"
            | "cuDeviceGetName"
            | "cuDriverGetVersion" => continue,
            // Derived from the PCI location, the machine's own: the sim answers from its own.
            "board_id" => {
                check(
                    diffs,
                    "board_id (own PCI location)",
                    &Value::from((pci.bus << 8) | pci.device),
                    nv_uint(lib, "nvmlDeviceGetBoardId", dev),
                );
                continue;
            }
            "arch" => nv_uint(lib, "nvmlDeviceGetArchitecture", dev),
            "brand" => nv_uint(lib, "nvmlDeviceGetBrand", dev),
            "bus_width" => nv_uint(lib, "nvmlDeviceGetMemoryBusWidth", dev),
            "compute_mode" => nv_uint(lib, "nvmlDeviceGetComputeMode", dev),
            "cores" => nv_uint(lib, "nvmlDeviceGetNumGpuCores", dev),
            "minor" => nv_uint(lib, "nvmlDeviceGetMinorNumber", dev),
            "max_mig" => nv_uint(lib, "nvmlDeviceGetMaxMigDeviceCount", dev),
            "pcie_gen_max" => nv_uint(lib, "nvmlDeviceGetMaxPcieLinkGeneration", dev),
            "pcie_width_max" => nv_uint(lib, "nvmlDeviceGetMaxPcieLinkWidth", dev),
            "persistence" => nv_uint(lib, "nvmlDeviceGetPersistenceMode", dev),
            "power_limit_mw" => nv_uint(lib, "nvmlDeviceGetPowerManagementLimit", dev),
            "power_usage_mw" => nv_uint(lib, "nvmlDeviceGetPowerUsage", dev),
            "virt_mode" => nv_uint(lib, "nvmlDeviceGetVirtualizationMode", dev),
            "cc" => nv_pair(lib, "nvmlDeviceGetCudaComputeCapability", dev),
            "ecc_mode" => nv_pair(lib, "nvmlDeviceGetEccMode", dev),
            "mig_mode" => nv_pair(lib, "nvmlDeviceGetMigMode", dev),
            "name" => nv_string(lib, "nvmlDeviceGetName", dev),
            "vbios" => nv_string(lib, "nvmlDeviceGetVbiosVersion", dev),
            "driver" => nv_system_string(lib, "nvmlSystemGetDriverVersion"),
            "nvml_version" => nv_system_string(lib, "nvmlSystemGetNVMLVersion"),
            "cuda_driver_version" => {
                let mut v: c_int = 0;
                let rc = call!(lib, nvmlSystemGetCudaDriverVersion(&mut v) as fn(*mut c_int));
                nvml_answer(lib, rc, Value::from(v))
            }
            "is_mig_device" => {
                // The probe printed ctypes' repr, "c_uint(0)".
                let v = nv_uint(lib, "nvmlDeviceIsMigDeviceHandle", dev);
                match v.as_u64() {
                    Some(n) => Value::from(format!("c_uint({n})")),
                    None => v,
                }
            }
            "temp" => {
                let mut t: c_uint = 0;
                let rc = call!(lib, nvmlDeviceGetTemperature(dev, 0, &mut t) as fn(Dev, c_uint, *mut c_uint));
                nvml_answer(lib, rc, Value::from(t))
            }
            "max_sm_clock" | "max_mem_clock" => {
                let clock: c_uint = if key == "max_sm_clock" { 1 } else { 2 }; // NVML_CLOCK_SM, NVML_CLOCK_MEM
                let mut v: c_uint = 0;
                let rc = call!(lib, nvmlDeviceGetMaxClockInfo(dev, clock, &mut v) as fn(Dev, c_uint, *mut c_uint));
                nvml_answer(lib, rc, Value::from(v))
            }
            "memory" => {
                let mut m: nvmlMemory_t = unsafe_zeroed();
                let rc = call!(lib, nvmlDeviceGetMemoryInfo(dev, &mut m) as fn(Dev, *mut nvmlMemory_t));
                nvml_answer(lib, rc, serde_json::json!({"free": m.free, "total": m.total, "used": m.used}))
            }
            "bar1" => {
                let mut b: nvmlBAR1Memory_t = unsafe_zeroed();
                let rc = call!(lib, nvmlDeviceGetBAR1MemoryInfo(dev, &mut b) as fn(Dev, *mut nvmlBAR1Memory_t));
                nvml_answer(
                    lib,
                    rc,
                    serde_json::json!({"bar1Free": b.bar1Free, "bar1Total": b.bar1Total, "bar1Used": b.bar1Used}),
                )
            }
            "utilization" => {
                let mut u: nvmlUtilization_t = unsafe_zeroed();
                let rc = call!(lib, nvmlDeviceGetUtilizationRates(dev, &mut u) as fn(Dev, *mut nvmlUtilization_t));
                nvml_answer(lib, rc, serde_json::json!({"gpu": u.gpu, "memory": u.memory}))
            }
            "process_utilization" => {
                // nvidia-ml-py first asks for the sample count with no buffer.
                let mut count: c_uint = 0;
                let rc = call!(
                    lib,
                    nvmlDeviceGetProcessUtilization(dev, std::ptr::null_mut(), &mut count, 0)
                        as fn(Dev, *mut nvmlProcessUtilizationSample_t, *mut c_uint, u64)
                );
                nvml_answer(lib, rc, Value::from(count))
            }
            "gpu_instance_profiles" => {
                let profiles = card.as_object().expect("facts: gpu_instance_profiles");
                for (p, card_profile) in profiles {
                    let id: u32 = p.parse().unwrap_or_else(|_| panic!("facts: profile {p:?}"));
                    let mut card_profile = card_profile.clone();
                    // `version` is the probe's own struct version field, not the driver's answer.
                    if let Some(o) = card_profile.as_object_mut() {
                        o.remove("version");
                    }
                    check(diffs, &format!("gpu_instance_profiles[{id}]"), &card_profile, gi_profile(lib, dev, id));
                }
                continue;
            }
            other => {
                diffs.push(format!("{other}: no reader for this key in the test; teach card_facts.rs to read it"));
                continue;
            }
        };
        check(diffs, key, card, sim);
    }
}

#[test]
fn the_board_answers_what_the_card_answered() {
    let f = facts();
    let node = node_for(&f);
    node.run_isolated("the_board_answers_what_the_card_answered", || {
        // SAFETY: loading the simulated driver runs no initializers.
        let lib = Lib(unsafe { libloading::Library::new(node.cuda_path()) }.expect("load libcuda.so.1"));
        let mut diffs = Vec::new();
        cuda_diffs(&lib, &f, &mut diffs);
        nvml_diffs(&lib, &f, &mut diffs);
        assert!(
            diffs.is_empty(),
            "{} answers differ from {}:\n  {}",
            diffs.len(),
            facts_path().display(),
            diffs.join("\n  ")
        );
    });
}

/// Calls `name` once with valid arguments (a context current, NVML initialized, `dev` the GPU);
/// `None` for a call this test cannot make.
fn call_timed(lib: &Lib, name: &str, dev: Dev) -> Option<(u32, std::time::Duration)> {
    let (mut free, mut total) = (0usize, 0usize);
    let mut count: c_uint = 0;
    let mut infos: [nvmlProcessInfo_t; 8] = unsafe_zeroed();
    let mut memory: nvmlMemory_t = unsafe_zeroed();
    let mut samples: [nvmlProcessUtilizationSample_t; 8] = unsafe_zeroed();
    let start = std::time::Instant::now();
    let rc = match name {
        "cuMemGetInfo_v2" => call!(lib, cuMemGetInfo_v2(&mut free, &mut total) as fn(*mut usize, *mut usize)),
        "nvmlDeviceGetComputeRunningProcesses_v3" => {
            count = 8;
            call!(
                lib,
                nvmlDeviceGetComputeRunningProcesses_v3(dev, &mut count, infos.as_mut_ptr())
                    as fn(Dev, *mut c_uint, *mut nvmlProcessInfo_t)
            )
        }
        "nvmlDeviceGetCount_v2" => call!(lib, nvmlDeviceGetCount_v2(&mut count) as fn(*mut c_uint)),
        "nvmlDeviceGetMemoryInfo" => {
            call!(lib, nvmlDeviceGetMemoryInfo(dev, &mut memory) as fn(Dev, *mut nvmlMemory_t))
        }
        // An idle GPU has no samples: NOT_FOUND (6), as the idle card answered.
        "nvmlDeviceGetProcessUtilization" => {
            count = 8;
            let rc = call!(
                lib,
                nvmlDeviceGetProcessUtilization(dev, samples.as_mut_ptr(), &mut count, 0)
                    as fn(Dev, *mut nvmlProcessUtilizationSample_t, *mut c_uint, u64)
            );
            if rc == nvmlReturn_enum_NVML_ERROR_NOT_FOUND { 0 } else { rc }
        }
        _ => return None,
    };
    Some((rc, start.elapsed()))
}

/// Every call timed on the card takes at least the card's time on the sim (`TESSERA_SIM_LATENCY`
/// on): the fastest of 20 calls, which the sim's wait makes a floor, not a timing to be lucky with.
/// `off` taking it away is the driver's unit test `on_or_unset_is_the_cards_figures_and_off_is_none`.
#[test]
fn calls_take_at_least_what_they_took_on_the_card() {
    let f = facts();
    let node = node_for(&f);
    node.run_isolated("calls_take_at_least_what_they_took_on_the_card", || {
        // SAFETY: this child runs this one test alone and has not loaded the driver yet, so no
        // other thread reads the environment while it is written.
        unsafe { std::env::set_var("TESSERA_SIM_LATENCY", "on") };
        // SAFETY: loading the simulated driver runs no initializers.
        let lib = Lib(unsafe { libloading::Library::new(node.cuda_path()) }.expect("load libcuda.so.1"));
        assert_eq!(call!(lib, cuInit(0) as fn(c_uint)), 0, "cuInit");
        let mut ctx: *mut c_void = std::ptr::null_mut();
        assert_eq!(call!(lib, cuDevicePrimaryCtxRetain(&mut ctx, 0) as fn(*mut *mut c_void, c_int)), 0);
        assert_eq!(call!(lib, cuCtxSetCurrent(ctx) as fn(*mut c_void)), 0);
        assert_eq!(call!(lib, nvmlInit_v2() as fn()), 0, "nvmlInit_v2");
        let mut dev: Dev = std::ptr::null_mut();
        assert_eq!(call!(lib, nvmlDeviceGetHandleByIndex_v2(0, &mut dev) as fn(c_uint, *mut Dev)), 0);
        let measured = f["measured_call_latency_us"].as_object().expect("facts: measured_call_latency_us");
        let mut diffs = Vec::new();
        for (name, card_us) in measured.iter().filter(|(k, _)| !k.starts_with('_')) {
            let card = std::time::Duration::from_secs_f64(card_us.as_f64().expect("a figure in µs") / 1e6);
            let mut fastest = std::time::Duration::MAX;
            for _ in 0..20 {
                match call_timed(&lib, name, dev) {
                    None => {
                        diffs.push(format!("{name}: no caller for it in the test; teach call_timed to call it"));
                        break;
                    }
                    Some((rc, _)) if rc != 0 => {
                        diffs.push(format!("{name}: returned {rc}"));
                        break;
                    }
                    Some((_, took)) => fastest = fastest.min(took),
                }
            }
            if fastest != std::time::Duration::MAX && fastest < card {
                diffs.push(format!("{name}: fastest of 20 calls {fastest:?}, the card took {card:?}"));
            }
        }
        assert!(diffs.is_empty(), "calls faster than the card:\n  {}", diffs.join("\n  "));
    });
}
