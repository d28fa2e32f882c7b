//! The NVML half of the simulated driver, through the client the daemon uses (nvml-wrapper) and,
//! for what it does not wrap, through the raw symbols (nvml-wrapper-sys's typed table, or
//! libloading for the legacy unversioned exports).
//!
//! Each test runs in a process of its own against a node of its own (`SimNode::run_isolated`):
//! the driver keeps one node connection per process. The tests drive the node's state from the
//! side, as `tessera-sim` and other processes would, through a second `Node` handle on the same
//! state file (faults, memory held by "another" process, kernels keeping a GPU busy).
//!
//! Build the library first: `cargo build -p tessera-sim-driver && cargo test -p tessera-sim-driver --test nvml`.

use std::ffi::{CStr, c_char, c_uint};
use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, MemoryLocation, TemperatureSensor, TemperatureThreshold, TopologyLevel,
};
use nvml_wrapper::enum_wrappers::nv_link::Capability;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{EventSet, Nvml};
use nvml_wrapper_sys::bindings::*;
use tessera_sim_model::{Node, NodeDescription};
use tessera_sim_testkit::{SimNode, mig_and_whole};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

const SUCCESS: u32 = nvmlReturn_enum_NVML_SUCCESS;
const UNINITIALIZED: u32 = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const INVALID_ARGUMENT: u32 = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: u32 = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NOT_FOUND: u32 = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const INSUFFICIENT_SIZE: u32 = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const TIMEOUT: u32 = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
const GPU_IS_LOST: u32 = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
const RESET_REQUIRED: u32 = nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED;
const IN_USE: u32 = nvmlReturn_enum_NVML_ERROR_IN_USE;
const INSUFFICIENT_RESOURCES: u32 = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
const VERSION_MISMATCH: u32 = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;

/// NVML through nvml-wrapper, as the daemon opens it.
fn open(node: &SimNode) -> Nvml {
    Nvml::builder().lib_path(node.nvml_path().as_os_str()).init().expect("nvmlInit_v2 on the simulated node")
}

/// A second handle on the node's state, as another process (or `tessera-sim`) would hold.
fn model(node: &SimNode) -> Node {
    let description = node.description.as_ref().map(|p| NodeDescription::load(p).expect("description"));
    Node::open_state(&node.state, description).expect("open the node state")
}

/// The library for symbols nvml-wrapper-sys does not bind (the legacy unversioned exports).
fn library(node: &SimNode) -> libloading::Library {
    // SAFETY: the simulated driver runs nothing at load time.
    unsafe { libloading::Library::new(node.nvml_path()) }.expect("dlopen the simulated driver")
}

/// A symbol of the library, as a plain function pointer.
fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> T {
    let name = format!("{name}\0");
    // SAFETY: callers name a symbol whose C type is T.
    unsafe { *lib.get::<T>(name.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}")) }
}

fn text(buf: &[c_char]) -> String {
    // SAFETY: NVML NUL-terminates what it writes; the buffers are zero-initialized anyway.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// Runs `body` in a process of its own (see the module's doc) against `node`, with NVML open.
fn with_nvml(node: SimNode, test_name: &str, body: impl FnOnce(&SimNode, &Nvml)) {
    node.run_isolated(test_name, || body(&node, &open(&node)));
}

/// The next event of `set` as NVML's raw record, read through nvmlEventSetWait_v2 (2 s at most).
fn raw_event(raw: &NvmlLib, set: &EventSet) -> nvmlEventData_t {
    // SAFETY: zeroes are a valid nvmlEventData_t.
    let mut ev: nvmlEventData_t = unsafe { std::mem::zeroed() };
    // SAFETY: the set handle is the one nvml-wrapper holds; valid out-pointer.
    assert_eq!(unsafe { raw.nvmlEventSetWait_v2(set.handle(), &mut ev, 2000) }, SUCCESS);
    ev
}

/// Polls `f` until it returns `Some`, for up to `secs` seconds.
fn eventually<T>(secs: u64, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "condition not reached in {secs} s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn init_is_reference_counted_and_system_queries_answer() {
    let node = SimNode::new();
    node.run_isolated("init_is_reference_counted_and_system_queries_answer", || {
        let lib = library(&node);
        let init_v2: unsafe extern "C" fn() -> u32 = sym(&lib, "nvmlInit_v2");
        let init_v1: unsafe extern "C" fn() -> u32 = sym(&lib, "nvmlInit");
        let init_flags: unsafe extern "C" fn(c_uint) -> u32 = sym(&lib, "nvmlInitWithFlags");
        let shutdown: unsafe extern "C" fn() -> u32 = sym(&lib, "nvmlShutdown");
        let count_v2: unsafe extern "C" fn(*mut c_uint) -> u32 = sym(&lib, "nvmlDeviceGetCount_v2");
        let count_v1: unsafe extern "C" fn(*mut c_uint) -> u32 = sym(&lib, "nvmlDeviceGetCount");
        let error_string: unsafe extern "C" fn(u32) -> *const c_char = sym(&lib, "nvmlErrorString");
        let mut n = 0;
        // SAFETY: every call passes valid pointers or deliberately null ones the API must refuse.
        unsafe {
            assert_eq!(count_v2(&mut n), UNINITIALIZED);
            assert_eq!(shutdown(), UNINITIALIZED);
            assert_eq!(init_v2(), SUCCESS);
            assert_eq!(init_v1(), SUCCESS);
            assert_eq!(init_flags(0), SUCCESS);
            assert_eq!(count_v2(std::ptr::null_mut()), INVALID_ARGUMENT);
            assert_eq!(count_v2(&mut n), SUCCESS);
            assert_eq!(n, 8);
            assert_eq!(count_v1(&mut n), SUCCESS);
            assert_eq!(n, 8);
            assert_eq!(shutdown(), SUCCESS);
            assert_eq!(shutdown(), SUCCESS);
            assert_eq!(count_v2(&mut n), SUCCESS, "one reference left");
            assert_eq!(shutdown(), SUCCESS);
            assert_eq!(count_v2(&mut n), UNINITIALIZED, "after as many shutdowns as inits");
            for (code, want) in [
                (0, "Success"),
                (2, "Invalid Argument"),
                (15, "GPU is lost"),
                (19, "In use by another client"),
                (999, "Unknown Error"),
                (12345, "Unknown Error"),
            ] {
                assert_eq!(CStr::from_ptr(error_string(code)).to_str().unwrap(), want);
            }
            for code in 0..=30 {
                assert!(!CStr::from_ptr(error_string(code)).to_bytes().is_empty());
            }
        }

        let nvml = open(&node);
        assert_eq!(nvml.sys_driver_version().unwrap(), "570.133.20");
        assert_eq!(nvml.sys_nvml_version().unwrap(), "12.570.133.20");
        assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12080);
        let cuda_v1: unsafe extern "C" fn(*mut i32) -> u32 = sym(&lib, "nvmlSystemGetCudaDriverVersion");
        let mut v = 0;
        // SAFETY: valid out-pointer.
        assert_eq!(unsafe { cuda_v1(&mut v) }, SUCCESS);
        assert_eq!(v, 12080);
        let me = nvml.sys_process_name(std::process::id(), 256).unwrap();
        let exe = std::env::current_exe().unwrap();
        assert!(me.ends_with(exe.file_name().unwrap().to_str().unwrap()) || me.contains("nvml"), "{me}");
        assert_eq!(nvml.sys_process_name(std::process::id(), 4).unwrap().len(), 3, "cropped to the buffer");
        assert!(matches!(nvml.sys_process_name(0x7fff_fff0, 64), Err(NvmlError::NotFound)));
    });
}

#[test]
fn identity_of_an_h100_node() {
    let node = SimNode::new();
    with_nvml(node, "identity_of_an_h100_node", |node, nvml| {
        let sim = model(node);
        assert_eq!(nvml.device_count().unwrap(), 8);
        for i in 0..8 {
            let d = nvml.device_by_index(i).unwrap();
            let id = &sim.gpus()[i as usize];
            assert_eq!(d.name().unwrap(), "NVIDIA H100 80GB HBM3");
            let uuid = d.uuid().unwrap();
            assert_eq!(uuid, id.uuid);
            assert!(uuid.starts_with("GPU-") && uuid.len() == 40, "{uuid}");
            assert_eq!(d.serial().unwrap(), id.serial);
            assert_eq!(d.index().unwrap(), i);
            assert_eq!(d.minor_number().unwrap(), i);
            assert_eq!(d.numa_node_id().unwrap(), if i < 4 { 0 } else { 1 });
            assert_eq!(d.board_id().unwrap(), id.board_id);
        }
        let d0 = nvml.device_by_index(0).unwrap();
        let pci = d0.pci_info().unwrap();
        assert_eq!(pci.bus_id, "00000000:18:00.0");
        assert_eq!((pci.domain, pci.bus, pci.device), (0, 0x18, 0));
        assert_eq!(pci.pci_device_id, 0x2330_10DE);
        assert_eq!(pci.pci_sub_system_id, Some(0x16C1_10DE));
        let cc = d0.cuda_compute_capability().unwrap();
        assert_eq!((cc.major, cc.minor), (9, 0));
        assert_eq!(format!("{:?}", d0.architecture().unwrap()), "Hopper");
        assert_eq!(format!("{:?}", d0.brand().unwrap()), "Nvidia");
        assert_eq!(d0.max_pcie_link_gen().unwrap(), 5);
        assert_eq!(d0.memory_bus_width().unwrap(), 5120);

        // Lookups by UUID, serial and bus id (all the forms NVML accepts) find the same GPU.
        let d5 = nvml.device_by_index(5).unwrap();
        let uuid5 = d5.uuid().unwrap();
        // SAFETY: handles are compared, never dereferenced.
        let h5 = unsafe { d5.handle() };
        // SAFETY: as above.
        unsafe {
            assert_eq!(nvml.device_by_uuid(uuid5.as_str()).unwrap().handle(), h5);
            #[allow(deprecated)]
            let by_serial = nvml.device_by_serial(d5.serial().unwrap().as_str()).unwrap();
            assert_eq!(by_serial.handle(), h5);
            for bus in ["00000000:AB:00.0", "0000:ab:00.0", "0:ab:0", "ab:00.0"] {
                assert_eq!(nvml.device_by_pci_bus_id(bus).unwrap().handle(), h5, "{bus}");
            }
        }
        assert!(matches!(nvml.device_by_uuid("GPU-00000000-0000-0000-0000-000000000000"), Err(NvmlError::NotFound)));
        assert!(matches!(nvml.device_by_pci_bus_id("0000:99:00.0"), Err(NvmlError::NotFound)));
        assert!(matches!(nvml.device_by_pci_bus_id("not a bus id"), Err(NvmlError::InvalidArg)));
        assert!(matches!(nvml.device_by_index(8), Err(NvmlError::InvalidArg)));

        // The raw ABI: legacy PCI layouts, bad handles and pointers, short buffers.
        let raw = nvml.lib();
        let lib = library(node);
        // SAFETY: the handle is only passed back to the library.
        let h0 = unsafe { d0.handle() };
        #[repr(C)]
        struct PciLegacy {
            bus_id: [c_char; 16],
            domain: u32,
            bus: u32,
            device: u32,
            pci_device_id: u32,
            pci_sub_system_id: u32,
            reserved: [u32; 4],
            canary: [u8; 16],
        }
        for name in ["nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2"] {
            let f: unsafe extern "C" fn(nvmlDevice_t, *mut PciLegacy) -> u32 = sym(&lib, name);
            let mut p = PciLegacy {
                bus_id: [0; 16],
                domain: 9,
                bus: 9,
                device: 9,
                pci_device_id: 0,
                pci_sub_system_id: 0,
                reserved: [7; 4],
                canary: [0xAB; 16],
            };
            // SAFETY: p is a writable struct larger than the legacy layout.
            assert_eq!(unsafe { f(h0, &mut p) }, SUCCESS, "{name}");
            assert_eq!(text(&p.bus_id), "0000:18:00.0", "{name}: the legacy bus id form");
            assert_eq!((p.domain, p.bus, p.device, p.pci_device_id), (0, 0x18, 0, 0x2330_10DE));
            assert_eq!(p.reserved, [0; 4]);
            assert_eq!(p.canary, [0xAB; 16], "{name} must write only the 52-byte legacy struct");
        }
        // SAFETY: zeroes are a valid nvmlPciInfo_t.
        let mut p3: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid handle and out-pointer.
        assert_eq!(unsafe { raw.nvmlDeviceGetPciInfo_v3(h0, &mut p3) }, SUCCESS);
        assert_eq!(text(&p3.busIdLegacy), "0000:18:00.0");
        assert_eq!(text(&p3.busId), "00000000:18:00.0");

        let mut name = [0 as c_char; 96];
        let garbage = [
            std::ptr::null_mut(),
            0x1234 as nvmlDevice_t,
            (h0 as usize + 1) as nvmlDevice_t,
            name.as_mut_ptr().cast::<nvmlDevice_st>(),
            (h0 as usize + 8 * 4096) as nvmlDevice_t,
        ];
        for bad in garbage {
            assert_eq!(
                // SAFETY: the library must refuse the handle without dereferencing it.
                unsafe { raw.nvmlDeviceGetName(bad, name.as_mut_ptr(), 96) },
                INVALID_ARGUMENT,
                "{bad:?}"
            );
            assert_eq!(
                // SAFETY: as above.
                unsafe { raw.nvmlDeviceGetTemperature(bad, 0, &mut 0) },
                INVALID_ARGUMENT,
                "{bad:?}"
            );
        }
        // SAFETY: deliberately null or short buffers.
        unsafe {
            assert_eq!(raw.nvmlDeviceGetName(h0, std::ptr::null_mut(), 96), INVALID_ARGUMENT);
            assert_eq!(raw.nvmlDeviceGetName(h0, name.as_mut_ptr(), 8), INSUFFICIENT_SIZE);
            assert_eq!(raw.nvmlDeviceGetUUID(h0, name.as_mut_ptr(), 40), INSUFFICIENT_SIZE, "a UUID needs 41 bytes");
            assert_eq!(raw.nvmlDeviceGetUUID(h0, name.as_mut_ptr(), 41), SUCCESS);
            assert_eq!(raw.nvmlDeviceGetMemoryInfo(h0, std::ptr::null_mut()), INVALID_ARGUMENT);
            assert_eq!(raw.nvmlDeviceGetHandleByIndex_v2(0, std::ptr::null_mut()), INVALID_ARGUMENT);
            let misaligned = (name.as_mut_ptr() as usize + 1) as *mut c_uint;
            assert_eq!(raw.nvmlDeviceGetIndex(h0, misaligned), INVALID_ARGUMENT);
        }
    });
}

#[test]
fn memory_and_processes_of_an_h100() {
    let node = SimNode::new();
    with_nvml(node, "memory_and_processes_of_an_h100", |node, nvml| {
        let d = nvml.device_by_index(0).unwrap();
        let m = d.memory_info().unwrap();
        assert_eq!(m.total, 81_559 * MIB);
        assert_eq!(m.reserved, 454 * MIB);
        assert_eq!(m.used, 0);
        assert_eq!(m.free, m.total - m.reserved);
        let raw = nvml.lib();
        // SAFETY: the handle is only passed back to the library.
        let h = unsafe { d.handle() };
        let v1 = |h| {
            let mut v = nvmlMemory_t { total: 0, free: 0, used: 0 };
            // SAFETY: valid handle and out-pointer.
            assert_eq!(unsafe { raw.nvmlDeviceGetMemoryInfo(h, &mut v) }, SUCCESS);
            v
        };
        let mem = v1(h);
        assert_eq!(
            (mem.total, mem.used, mem.free),
            (81_559 * MIB, 454 * MIB, (81_559 - 454) * MIB),
            "v1 counts the reserve as used"
        );
        let mut bad = nvmlMemory_v2_t { version: 0, total: 0, reserved: 0, free: 0, used: 0 };
        assert_eq!(
            // SAFETY: valid handle and out-pointer with a wrong version.
            unsafe { raw.nvmlDeviceGetMemoryInfo_v2(h, &mut bad) },
            VERSION_MISMATCH
        );
        let bar1 = d.bar1_memory_info().unwrap();
        assert_eq!(bar1.total, 131_072 * MIB);
        assert_eq!(bar1.used + bar1.free, bar1.total);
        assert_eq!(d.running_compute_processes().unwrap(), Vec::<ProcessInfo>::new());

        // Another holder of the node takes memory on GPU 0: NVML sees it and who holds it.
        let other = model(node);
        other.alloc(0, 0, 3 * GIB).unwrap();
        let m = d.memory_info().unwrap();
        assert_eq!(m.used, 3 * GIB);
        assert_eq!(m.free, m.total - m.reserved - 3 * GIB);
        assert_eq!(v1(h).used, 454 * MIB + 3 * GIB);
        let me = std::process::id();
        let procs = d.running_compute_processes().unwrap();
        assert_eq!(
            procs,
            vec![ProcessInfo {
                pid: me,
                used_gpu_memory: UsedGpuMemory::Used(3 * GIB),
                gpu_instance_id: None,
                compute_instance_id: None
            }]
        );
        let lib = library(node);
        let procs_v2: unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_v2_t) -> u32 =
            sym(&lib, "nvmlDeviceGetComputeRunningProcesses_v2");
        let mut infos2 = [nvmlProcessInfo_v2_t { pid: 0, usedGpuMemory: 0, gpuInstanceId: 0, computeInstanceId: 0 }; 4];
        let mut count = 4;
        assert_eq!(
            // SAFETY: the buffer holds `count` entries.
            unsafe { procs_v2(h, &mut count, infos2.as_mut_ptr()) },
            SUCCESS
        );
        assert_eq!(count, 1);
        assert_eq!(
            (infos2[0].pid, infos2[0].usedGpuMemory, infos2[0].gpuInstanceId, infos2[0].computeInstanceId),
            (me, 3 * GIB, u32::MAX, u32::MAX)
        );
        assert_eq!(d.running_graphics_processes().unwrap(), Vec::<ProcessInfo>::new());
        assert_eq!(nvml.device_by_index(1).unwrap().running_compute_processes().unwrap(), Vec::<ProcessInfo>::new());

        // The count protocol, on the v1 layout (no MIG ids) from the legacy symbol.
        let procs_v1: unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_v1_t) -> u32 =
            sym(&lib, "nvmlDeviceGetComputeRunningProcesses");
        count = 0;
        assert_eq!(
            // SAFETY: a null buffer with count 0 asks for the count.
            unsafe { procs_v1(h, &mut count, std::ptr::null_mut()) },
            INSUFFICIENT_SIZE
        );
        assert_eq!(count, 1);
        let mut infos = [nvmlProcessInfo_v1_t { pid: 0, usedGpuMemory: 0 }; 2];
        count = 2;
        assert_eq!(
            // SAFETY: the buffer holds `count` entries.
            unsafe { procs_v1(h, &mut count, infos.as_mut_ptr()) },
            SUCCESS
        );
        assert_eq!(count, 1);
        assert_eq!((infos[0].pid, infos[0].usedGpuMemory), (me, 3 * GIB));
        count = 1;
        assert_eq!(
            // SAFETY: non-zero count with a null buffer must be refused, not written.
            unsafe { procs_v1(h, &mut count, std::ptr::null_mut()) },
            INVALID_ARGUMENT
        );

        other.free(0, 0, 3 * GIB);
        assert_eq!(d.memory_info().unwrap().used, 0);
        drop(other);
        assert_eq!(d.running_compute_processes().unwrap(), Vec::<ProcessInfo>::new(), "a closed holder is reaped");
    });
}

#[test]
fn utilization_power_and_clocks_follow_launched_work() {
    let node = SimNode::new();
    with_nvml(node, "utilization_power_and_clocks_follow_launched_work", |node, nvml| {
        let busy = nvml.device_by_index(0).unwrap();
        let idle = nvml.device_by_index(1).unwrap();
        assert_eq!(idle.utilization_rates().unwrap().gpu, 0);
        assert_eq!(idle.power_usage().unwrap(), 72_000);
        assert_eq!(idle.clock_info(Clock::SM).unwrap(), 345);
        assert_eq!(idle.clock_info(Clock::Memory).unwrap(), 2619);
        assert_eq!(idle.max_clock_info(Clock::SM).unwrap(), 1980);
        let idle_temp = idle.temperature(TemperatureSensor::Gpu).unwrap();
        assert!((25..45).contains(&idle_temp), "{idle_temp}");
        assert_eq!(idle.enforced_power_limit().unwrap(), 700_000);
        assert_eq!(idle.power_management_limit().unwrap(), 700_000);
        let c = idle.power_management_limit_constraints().unwrap();
        assert_eq!((c.min_limit, c.max_limit), (200_000, 700_000));
        assert_eq!(idle.temperature_threshold(TemperatureThreshold::Slowdown).unwrap(), 89);
        assert_eq!(idle.temperature_threshold(TemperatureThreshold::Shutdown).unwrap(), 92);
        assert!(matches!(idle.fan_speed(0), Err(NvmlError::NotSupported)), "SXM boards have no fans");
        assert_eq!(format!("{:?}", idle.performance_state().unwrap()), "Zero");
        assert!(matches!(idle.process_utilization_stats(None), Err(NvmlError::NotFound)), "nothing ran");

        // Another process keeps GPU 0 busy for a few seconds.
        let other = model(node);
        let stream = other.stream_create(0, 0, 0).unwrap();
        other.launch(stream, 4_000_000_000).unwrap();
        let u = eventually(5, || busy.utilization_rates().ok().filter(|u| u.gpu >= 90));
        assert!(u.memory > 0 && u.memory <= u.gpu);
        assert!(busy.power_usage().unwrap() > 500_000);
        assert!(busy.temperature(TemperatureSensor::Gpu).unwrap() > idle_temp);
        assert_eq!(busy.clock_info(Clock::SM).unwrap(), 1980);
        assert_eq!(idle.utilization_rates().unwrap().gpu, 0, "GPU 1 stays idle");

        let me = std::process::id();
        let samples = busy.process_utilization_stats(None).unwrap();
        let mine = samples.iter().find(|s| s.pid == me).expect("a sample of the busy process");
        assert!(mine.sm_util >= 90, "{mine:?}");
        let now_us = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64;
        assert!(mine.timestamp > now_us - 5_000_000 && mine.timestamp <= now_us + 1_000_000);
        assert!(
            matches!(busy.process_utilization_stats(now_us + 60_000_000), Err(NvmlError::NotFound)),
            "no sample newer than the future"
        );

        // The raw count protocol: a null buffer gets INSUFFICIENT_SIZE and the count.
        let raw = nvml.lib();
        // SAFETY: the handle is only passed back to the library.
        let h = unsafe { busy.handle() };
        let mut count = 0;
        assert_eq!(
            // SAFETY: null buffer with a valid count pointer.
            unsafe { raw.nvmlDeviceGetProcessUtilization(h, std::ptr::null_mut(), &mut count, 0) },
            INSUFFICIENT_SIZE
        );
        assert!(count >= 1);
        other.stream_destroy(stream);
    });
}

#[test]
fn mig_instances_under_the_real_rules() {
    let node = SimNode::with_description(&mig_and_whole("H100-SXM5-80GB"));
    with_nvml(node, "mig_instances_under_the_real_rules", |node, nvml| {
        let raw = nvml.lib();
        let lib = library(node);
        let sim = model(node);
        let d0 = nvml.device_by_index(0).unwrap();
        // SAFETY: handles are only passed back to the library.
        let h0 = unsafe { d0.handle() };
        let mode = d0.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (1, 1));
        assert_eq!(d0.mig_device_count().unwrap(), 7);
        assert!(matches!(d0.utilization_rates(), Err(NvmlError::NotSupported)), "no whole-GPU utilization in MIG mode");

        // Profiles, by NVML_GPU_INSTANCE_PROFILE_* (nvml-wrapper) and versioned (raw).
        let p1g = d0.profile_info(NVML_GPU_INSTANCE_PROFILE_1_SLICE).unwrap();
        assert_eq!(
            (p1g.id, p1g.slice_count, p1g.instance_count, p1g.multiprocessor_count, p1g.memory_size_mb),
            (19, 1, 7, 16, 9_984)
        );
        let p3g = d0.profile_info(NVML_GPU_INSTANCE_PROFILE_3_SLICE).unwrap();
        assert_eq!(
            (p3g.id, p3g.slice_count, p3g.instance_count, p3g.multiprocessor_count, p3g.memory_size_mb),
            (9, 3, 2, 60, 40_448)
        );
        assert!(matches!(d0.profile_info(0x12), Err(NvmlError::InvalidArg)));
        assert!(matches!(d0.profile_info(NVML_GPU_INSTANCE_PROFILE_8_SLICE), Err(NvmlError::NotSupported)));
        // SAFETY: zeroes are valid values of these plain C structs.
        let mut v2: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
        v2.version = std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32 | 2 << 24;
        assert_eq!(
            // SAFETY: valid handle and a v2 struct declared as such.
            unsafe { raw.nvmlDeviceGetGpuInstanceProfileInfoV(h0, NVML_GPU_INSTANCE_PROFILE_1_SLICE, &mut v2,) },
            SUCCESS
        );
        assert_eq!((v2.id, v2.memorySizeMB, text(&v2.name)), (19, 9_984, "MIG 1g.10gb".to_string()));
        // SAFETY: as above.
        let mut v3: nvmlGpuInstanceProfileInfo_v3_t = unsafe { std::mem::zeroed() };
        v3.version = std::mem::size_of::<nvmlGpuInstanceProfileInfo_v3_t>() as u32 | 3 << 24;
        assert_eq!(
            // SAFETY: a v3 struct declared as such.
            unsafe {
                raw.nvmlDeviceGetGpuInstanceProfileInfoV(h0, NVML_GPU_INSTANCE_PROFILE_7_SLICE, (&raw mut v3).cast())
            },
            SUCCESS
        );
        assert_eq!(
            (v3.id, v3.sliceCount, v3.memorySizeMB, text(&v3.name), v3.capabilities),
            (0, 7, 81_152, "MIG 7g.80gb".to_string(), 0)
        );
        v2.version = 1;
        assert_eq!(
            // SAFETY: a struct with a version the library must refuse.
            unsafe { raw.nvmlDeviceGetGpuInstanceProfileInfoV(h0, 0, &mut v2) },
            INVALID_ARGUMENT
        );

        // Placements of 3g: {0,4} x 4 memory slices; the count protocol.
        let mut count = 0;
        assert_eq!(
            // SAFETY: a null buffer asks for the count.
            unsafe { raw.nvmlDeviceGetGpuInstancePossiblePlacements_v2(h0, 9, std::ptr::null_mut(), &mut count,) },
            SUCCESS
        );
        assert_eq!(count, 2);
        let mut pl = [nvmlGpuInstancePlacement_t { start: 99, size: 99 }; 2];
        count = 1;
        assert_eq!(
            // SAFETY: the buffer holds 2 >= count entries.
            unsafe { raw.nvmlDeviceGetGpuInstancePossiblePlacements_v2(h0, 9, pl.as_mut_ptr(), &mut count,) },
            INSUFFICIENT_SIZE
        );
        assert_eq!(count, 2);
        assert_eq!(
            // SAFETY: as above.
            unsafe { raw.nvmlDeviceGetGpuInstancePossiblePlacements_v2(h0, 9, pl.as_mut_ptr(), &mut count,) },
            SUCCESS
        );
        assert_eq!(pl.map(|p| (p.start, p.size)), [(0, 4), (4, 4)]);
        let placements_v1: unsafe extern "C" fn(
            nvmlDevice_t,
            c_uint,
            *mut nvmlGpuInstancePlacement_t,
            *mut c_uint,
        ) -> u32 = sym(&lib, "nvmlDeviceGetGpuInstancePossiblePlacements");
        let mut all = [nvmlGpuInstancePlacement_t { start: 0, size: 0 }; 7];
        assert_eq!(
            // SAFETY: the buffer holds every placement of the 1g profile.
            unsafe { placements_v1(h0, 19, all.as_mut_ptr(), &mut count) },
            SUCCESS
        );
        assert_eq!(count, 7);
        assert_eq!(all.map(|p| p.start), [0, 1, 2, 3, 4, 5, 6]);

        let capacity = |profile: u32| {
            let mut n = 0;
            assert_eq!(
                // SAFETY: valid handle and out-pointer.
                unsafe { raw.nvmlDeviceGetGpuInstanceRemainingCapacity(h0, profile, &mut n) },
                SUCCESS
            );
            n
        };
        assert_eq!(capacity(9), 2);
        assert_eq!(capacity(19), 7);

        // MIG changes and XIDs of MIG instances come as events on the parent GPU.
        let set = d0
            .register_events(
                EventTypes::MIG_CONFIG_CHANGE | EventTypes::CRITICAL_XID_ERROR,
                nvml.create_event_set().unwrap(),
            )
            .unwrap();

        // A 3g instance at memory slice 4; conflicting and invalid placements are refused.
        let create_at = |profile: u32, start: u32, size: u32| {
            let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
            let p = nvmlGpuInstancePlacement_t { start, size };
            let rc =
                // SAFETY: valid handle, placement and out-pointer.
                unsafe { raw.nvmlDeviceCreateGpuInstanceWithPlacement(h0, profile, &p, &mut gi) };
            (rc, gi)
        };
        let (rc, gi) = create_at(9, 4, 4);
        assert_eq!(rc, SUCCESS);
        assert_eq!(create_at(9, 4, 4).0, INSUFFICIENT_RESOURCES, "the same slices again");
        assert_eq!(create_at(19, 5, 1).0, INSUFFICIENT_RESOURCES, "a 1g inside the 3g");
        assert_eq!(create_at(9, 3, 4).0, INVALID_ARGUMENT, "3g cannot start at slice 3");
        assert_eq!(create_at(9, 0, 2).0, INVALID_ARGUMENT, "wrong placement size");
        assert_eq!(create_at(1234, 0, 1).0, INVALID_ARGUMENT, "no such profile id");
        assert_eq!(capacity(9), 1);
        assert_eq!(capacity(19), 4, "slices 0..4 are left for 1g");

        // SAFETY: zeroes are a valid nvmlGpuInstanceInfo_t.
        let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(
            // SAFETY: valid GPU-instance handle and out-pointer.
            unsafe { raw.nvmlGpuInstanceGetInfo(gi, &mut info) },
            SUCCESS
        );
        assert_eq!((info.device, info.profileId, info.placement.start, info.placement.size), (h0, 9, 4, 4));
        let gi_id = info.id;
        let mut by_id: nvmlGpuInstance_t = std::ptr::null_mut();
        assert_eq!(
            // SAFETY: valid handle and out-pointer.
            unsafe { raw.nvmlDeviceGetGpuInstanceById(h0, gi_id, &mut by_id) },
            SUCCESS
        );
        assert_eq!(by_id, gi, "handles are stable");
        assert_eq!(
            // SAFETY: as above.
            unsafe { raw.nvmlDeviceGetGpuInstanceById(h0, gi_id + 1, &mut by_id) },
            NOT_FOUND
        );
        let mut list = [std::ptr::null_mut(); 2];
        assert_eq!(
            // SAFETY: the buffer holds the 3g profile's instance count.
            unsafe { raw.nvmlDeviceGetGpuInstances(h0, 9, list.as_mut_ptr(), &mut count) },
            SUCCESS
        );
        assert_eq!((count, list[0]), (1, gi));

        // Compute-instance profiles inside the 3g: 1c x3 (16 SMs), 3c x1 (60 SMs), no 4c.
        // SAFETY: zeroes are a valid nvmlComputeInstanceProfileInfo_t.
        let mut cip: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid handle and out-pointer.
        unsafe {
            assert_eq!(
                raw.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi,
                    NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
                    0,
                    &mut cip
                ),
                SUCCESS
            );
            assert_eq!(
                (cip.id, cip.sliceCount, cip.instanceCount, cip.multiprocessorCount, cip.sharedCopyEngineCount),
                (0, 1, 3, 16, 3)
            );
            assert_eq!(
                raw.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi,
                    NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
                    0,
                    &mut cip
                ),
                SUCCESS
            );
            assert_eq!((cip.instanceCount, cip.multiprocessorCount), (1, 60));
            assert_eq!(
                raw.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi,
                    NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
                    0,
                    &mut cip
                ),
                NOT_SUPPORTED
            );
            assert_eq!(raw.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 9, 0, &mut cip), INVALID_ARGUMENT);
            let mut civ: nvmlComputeInstanceProfileInfo_v2_t = std::mem::zeroed();
            civ.version = std::mem::size_of::<nvmlComputeInstanceProfileInfo_v2_t>() as u32 | 2 << 24;
            assert_eq!(raw.nvmlGpuInstanceGetComputeInstanceProfileInfoV(gi, 0, 0, &mut civ), SUCCESS);
            assert_eq!(text(&civ.name), "MIG 1c.3g.40gb");
            let mut cpl = [nvmlComputeInstancePlacement_t { start: 9, size: 9 }; 3];
            count = 3;
            assert_eq!(
                raw.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi, 0, cpl.as_mut_ptr(), &mut count),
                SUCCESS
            );
            assert_eq!(cpl.map(|p| (p.start, p.size)), [(0, 1), (1, 1), (2, 1)]);
        }

        // Two 1c compute instances: one at slice 1, one first-fit (slice 0).
        let create_ci = |start: Option<u32>| {
            let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
            // SAFETY: valid handles and out-pointers.
            let rc = unsafe {
                match start {
                    Some(s) => raw.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
                        gi,
                        0,
                        &nvmlComputeInstancePlacement_t { start: s, size: 1 },
                        &mut ci,
                    ),
                    None => raw.nvmlGpuInstanceCreateComputeInstance(gi, 0, &mut ci),
                }
            };
            (rc, ci)
        };
        let (rc, ci_a) = create_ci(Some(1));
        assert_eq!(rc, SUCCESS);
        let (rc, ci_b) = create_ci(None);
        assert_eq!(rc, SUCCESS);
        assert_eq!(create_ci(Some(1)).0, INSUFFICIENT_RESOURCES, "slice 1 is taken");
        let mut n = 0;
        assert_eq!(
            // SAFETY: valid handle and out-pointer.
            unsafe { raw.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0, &mut n) },
            SUCCESS
        );
        assert_eq!(n, 1);
        // SAFETY: zeroes are a valid nvmlComputeInstanceInfo_t.
        let mut cinfo: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
        assert_eq!(
            // SAFETY: valid handle and out-pointer.
            unsafe { raw.nvmlComputeInstanceGetInfo_v2(ci_a, &mut cinfo) },
            SUCCESS
        );
        assert_eq!(
            (cinfo.device, cinfo.gpuInstance, cinfo.profileId, cinfo.placement.start, cinfo.placement.size),
            (h0, gi, 0, 1, 1)
        );
        let ci_a_id = cinfo.id;
        #[repr(C)]
        struct CiInfoV1 {
            device: nvmlDevice_t,
            gpu_instance: nvmlGpuInstance_t,
            id: u32,
            profile_id: u32,
            canary: [u32; 2],
        }
        let ci_info_v1: unsafe extern "C" fn(nvmlComputeInstance_t, *mut CiInfoV1) -> u32 =
            sym(&lib, "nvmlComputeInstanceGetInfo");
        let mut old = CiInfoV1 {
            device: std::ptr::null_mut(),
            gpu_instance: std::ptr::null_mut(),
            id: 99,
            profile_id: 99,
            canary: [7, 7],
        };
        // SAFETY: valid handle; the struct is larger than the v1 layout.
        assert_eq!(unsafe { ci_info_v1(ci_a, &mut old) }, SUCCESS);
        assert_eq!((old.device, old.gpu_instance, old.id, old.profile_id, old.canary), (h0, gi, ci_a_id, 0, [7, 7]));

        // SAFETY: a GPU instance with compute instances cannot go.
        assert_eq!(unsafe { raw.nvmlGpuInstanceDestroy(gi) }, IN_USE);

        // Three configuration changes so far (one GPU instance, two compute instances), then an
        // XID attributed to a compute instance carries its ids.
        for _ in 0..3 {
            assert_eq!(set.wait(2000).unwrap().event_type, EventTypes::MIG_CONFIG_CHANGE);
        }
        sim.inject_xid(0, 43, Some((gi_id, ci_a_id)), None).unwrap();
        let ev = raw_event(raw, &set);
        assert_eq!(
            (ev.device, ev.eventType, ev.eventData, ev.gpuInstanceId, ev.computeInstanceId),
            (h0, 8, 43, gi_id, ci_a_id)
        );
        set.release_events().unwrap();

        // MIG devices: the two compute instances, in (GI id, CI id) order.
        let m0 = d0.mig_device_by_index(0).unwrap();
        assert!(d0.mig_device_by_index(1).is_ok());
        assert!(matches!(d0.mig_device_by_index(2), Err(NvmlError::NotFound)));
        assert!(matches!(d0.mig_device_by_index(7), Err(NvmlError::InvalidArg)));
        assert!(m0.mig_is_mig_device_handle().unwrap());
        assert!(!d0.mig_is_mig_device_handle().unwrap());
        assert_eq!(m0.name().unwrap(), "NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb");
        let mig_uuid = m0.uuid().unwrap();
        assert!(mig_uuid.starts_with("MIG-") && mig_uuid.len() == 40, "{mig_uuid}");
        // SAFETY: handles are compared, never dereferenced.
        let hm0 = unsafe { m0.handle() };
        assert_eq!(
            // SAFETY: as above.
            unsafe { nvml.device_by_uuid(mig_uuid.as_str()).unwrap().handle() },
            hm0
        );
        // SAFETY: as above.
        assert_eq!(unsafe { m0.mig_parent_device().unwrap().handle() }, h0);
        let (mut gid, mut cid) = (0, 0);
        // SAFETY: valid handle and out-pointers.
        unsafe {
            assert_eq!(raw.nvmlDeviceGetGpuInstanceId(hm0, &mut gid), SUCCESS);
            assert_eq!(raw.nvmlDeviceGetComputeInstanceId(hm0, &mut cid), SUCCESS);
            assert_eq!(raw.nvmlDeviceGetGpuInstanceId(h0, &mut gid), INVALID_ARGUMENT, "not a MIG device handle");
        }
        assert_eq!(gid, gi_id);
        let serial = sim.compute_instances(0, Some(gi_id)).unwrap().into_iter().find(|c| c.id == cid).unwrap().serial;
        assert_eq!(mig_uuid, sim.gpus()[0].mig_uuid(gi_id, cid, serial));
        let mm = m0.memory_info().unwrap();
        assert_eq!(
            (mm.total, mm.used, mm.reserved),
            (40_448 * MIB, 0, 0),
            "a MIG device has its GPU instance's memory"
        );
        let attrs = m0.attributes().unwrap();
        assert_eq!(
            (
                attrs.multiprocessor_count,
                attrs.gpu_instance_slice_count,
                attrs.compute_instance_slice_count,
                attrs.memory_size_mb
            ),
            (16, 3, 1, 40_448)
        );
        assert_eq!(m0.running_compute_processes().unwrap(), Vec::<ProcessInfo>::new());
        assert!(matches!(m0.utilization_rates(), Err(NvmlError::NotSupported)));

        // A process with a context and memory on the MIG device: listed there and on the GPU.
        let ci = sim.compute_instances(0, Some(gi_id)).unwrap().into_iter().find(|c| c.id == cid).unwrap();
        sim.context_opened(0, ci.unit()).unwrap();
        sim.alloc(0, ci.domain(), 256 * MIB).unwrap();
        let me = std::process::id();
        let want = ProcessInfo {
            pid: me,
            used_gpu_memory: UsedGpuMemory::Used(256 * MIB),
            gpu_instance_id: Some(gi_id),
            compute_instance_id: Some(cid),
        };
        assert_eq!(m0.running_compute_processes().unwrap(), vec![want.clone()]);
        assert_eq!(d0.running_compute_processes().unwrap(), vec![want]);
        let m1 = d0.mig_device_by_index(1).unwrap();
        assert_eq!(
            m1.running_compute_processes().unwrap(),
            Vec::<ProcessInfo>::new(),
            "only that instance's processes"
        );
        assert_eq!(m0.memory_info().unwrap().used, 256 * MIB);
        assert_eq!(m1.memory_info().unwrap().used, 256 * MIB, "both compute instances share the GPU instance's memory");
        let busy_ci = if cid == ci_a_id { ci_a } else { ci_b };
        assert_eq!(
            // SAFETY: valid compute-instance handle.
            unsafe { raw.nvmlComputeInstanceDestroy(busy_ci) },
            IN_USE,
            "a process runs there"
        );
        sim.free(0, ci.domain(), 256 * MIB);
        sim.context_closed(0, ci.unit());

        // Tear down: compute instances, then the GPU instance; stale handles are refused.
        // SAFETY: valid handles; the stale ones must be refused without being dereferenced.
        unsafe {
            assert_eq!(raw.nvmlComputeInstanceDestroy(ci_a), SUCCESS);
            assert_eq!(raw.nvmlComputeInstanceDestroy(ci_b), SUCCESS);
            assert_eq!(raw.nvmlComputeInstanceDestroy(ci_b), INVALID_ARGUMENT);
            assert_eq!(raw.nvmlDeviceGetName(hm0, [0 as c_char; 96].as_mut_ptr(), 96), INVALID_ARGUMENT);
            assert_eq!(raw.nvmlGpuInstanceDestroy(gi), SUCCESS);
            assert_eq!(raw.nvmlGpuInstanceGetInfo(gi, &mut info), INVALID_ARGUMENT);
            assert_eq!(raw.nvmlGpuInstanceDestroy(0x40 as nvmlGpuInstance_t), INVALID_ARGUMENT);
            assert_eq!(
                raw.nvmlComputeInstanceDestroy(hm0.cast()),
                INVALID_ARGUMENT,
                "a device handle is no compute instance"
            );
        }
        assert_eq!(capacity(9), 2);

        // GPU 1 (an H100) has MIG off: enabling it takes effect at once, as on Hopper.
        let d1 = nvml.device_by_index(1).unwrap();
        // SAFETY: the handle is only passed back to the library.
        let h1 = unsafe { d1.handle() };
        assert_eq!(d1.mig_device_count().unwrap(), 0);
        let mut gi1: nvmlGpuInstance_t = std::ptr::null_mut();
        assert_eq!(
            // SAFETY: valid handle and out-pointer.
            unsafe { raw.nvmlDeviceCreateGpuInstance(h1, 19, &mut gi1) },
            NOT_SUPPORTED
        );
        sim.alloc(1, 0, GIB).unwrap();
        assert!(matches!(d1.set_mig_mode(true), Err(NvmlError::InUse)), "a process holds memory on the GPU");
        let mode = d1.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (0, 0), "a refused change leaves nothing pending");
        sim.free(1, 0, GIB);
        assert_eq!(d1.set_mig_mode(true).unwrap(), SUCCESS, "Hopper: no reset needed");
        let mode = d1.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (1, 1));
        assert_eq!(
            // SAFETY: as above.
            unsafe { raw.nvmlDeviceCreateGpuInstance(h1, 19, &mut gi1) },
            SUCCESS
        );
        assert_eq!(d1.set_mig_mode(true).unwrap(), SUCCESS, "already on: nothing to activate");
        let mut activation = 0;
        assert_eq!(
            // SAFETY: valid handle and out-pointer.
            unsafe { raw.nvmlDeviceSetMigMode(h1, NVML_DEVICE_MIG_DISABLE, &mut activation) },
            IN_USE,
            "GPU instances exist"
        );
        assert_eq!(activation, IN_USE);
        // SAFETY: valid handles.
        unsafe {
            assert_eq!(raw.nvmlGpuInstanceDestroy(gi1), SUCCESS);
            assert_eq!(raw.nvmlDeviceSetMigMode(h1, 7, &mut activation), INVALID_ARGUMENT);
            assert_eq!(raw.nvmlDeviceSetMigMode(h1, NVML_DEVICE_MIG_DISABLE, &mut activation), SUCCESS);
        }
        assert_eq!(activation, SUCCESS);
        let mode = d1.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (0, 0), "off at once");
    });
}

#[test]
fn ampere_mig_mode_waits_for_a_reset_and_says_why() {
    let node = SimNode::with_description("[[gpu]]\nmodel = \"A100-SXM4-40GB\"\ncount = 1\n");
    with_nvml(node, "ampere_mig_mode_waits_for_a_reset_and_says_why", |node, nvml| {
        let sim = model(node);
        let raw = nvml.lib();
        let d0 = nvml.device_by_index(0).unwrap();
        // SAFETY: the handle is only passed back to the library.
        let h0 = unsafe { d0.handle() };
        // A process on the GPU: the mode is recorded, the driver could not reset the GPU.
        sim.alloc(0, 0, GIB).unwrap();
        assert_eq!(d0.set_mig_mode(true).unwrap(), IN_USE);
        let mode = d0.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (0, 1));
        sim.free(0, 0, GIB);
        assert_eq!(d0.set_mig_mode(true).unwrap(), RESET_REQUIRED);
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        assert_eq!(
            // SAFETY: valid handle and out-pointer.
            unsafe { raw.nvmlDeviceCreateGpuInstance(h0, 19, &mut gi) },
            NOT_SUPPORTED,
            "still pending"
        );
        sim.reset(0).unwrap();
        let mode = d0.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (1, 1));
        // SAFETY: as above.
        assert_eq!(unsafe { raw.nvmlDeviceCreateGpuInstance(h0, 19, &mut gi) }, SUCCESS);
        // SAFETY: a live GPU-instance handle.
        assert_eq!(unsafe { raw.nvmlGpuInstanceDestroy(gi) }, SUCCESS);
        assert_eq!(d0.set_mig_mode(false).unwrap(), RESET_REQUIRED, "off waits for a reset too");
        let mode = d0.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (1, 0));
        // The bare-metal answer, whatever the MIG mode.
        assert_eq!(d0.virtualization_mode().unwrap(), nvml_wrapper::enum_wrappers::device::GpuVirtualizationMode::Bare);
    });
}

#[test]
fn events_faults_and_recovery() {
    let node = SimNode::new();
    with_nvml(node, "events_faults_and_recovery", |node, nvml| {
        let sim = model(node);
        let d2 = nvml.device_by_index(2).unwrap();
        let supported = d2.supported_event_types().unwrap();
        assert!(supported.contains(
            EventTypes::CRITICAL_XID_ERROR | EventTypes::SINGLE_BIT_ECC_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR
        ));
        let wanted =
            EventTypes::CRITICAL_XID_ERROR | EventTypes::SINGLE_BIT_ECC_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
        sim.inject_xid(2, 31, None, None).unwrap();
        let set = d2.register_events(wanted, nvml.create_event_set().unwrap()).unwrap();
        assert!(matches!(set.wait(50), Err(NvmlError::Timeout)), "events before registration are not recorded");

        // An XID on the registered GPU; one on an unregistered GPU is not delivered.
        sim.inject_xid(3, 43, None, None).unwrap();
        sim.inject_xid(2, 13, None, None).unwrap();
        let ev = set.wait(2000).unwrap();
        assert_eq!(ev.event_type, EventTypes::CRITICAL_XID_ERROR);
        assert_eq!(ev.event_data, Some(XidError::Value(13)));
        assert_eq!(ev.device.index().unwrap(), 2);
        assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));

        // ECC errors: events and counters.
        sim.inject_ecc(2, 5, 1).unwrap();
        let ev = set.wait(2000).unwrap();
        assert_eq!((ev.event_type, ev.event_data), (EventTypes::SINGLE_BIT_ECC_ERROR, None));
        assert_eq!(set.wait(2000).unwrap().event_type, EventTypes::DOUBLE_BIT_ECC_ERROR);
        assert_eq!(d2.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile).unwrap(), 5);
        assert_eq!(d2.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Aggregate).unwrap(), 1);
        assert_eq!(
            d2.memory_error_counter(MemoryError::Corrected, EccCounter::Volatile, MemoryLocation::Device).unwrap(),
            5
        );
        assert!(matches!(
            d2.memory_error_counter(MemoryError::Corrected, EccCounter::Volatile, MemoryLocation::L1Cache),
            Err(NvmlError::NotSupported)
        ));
        let ecc = d2.is_ecc_enabled().unwrap();
        assert!(ecc.currently_enabled && ecc.pending_enabled);
        assert!(
            matches!(
                d2.retired_pages(nvml_wrapper::enum_wrappers::device::RetirementCause::DoubleBitEccError),
                Err(NvmlError::NotSupported)
            ),
            "Hopper remaps rows"
        );

        // Row remapping (XID 63): counted, pending until a reset.
        let raw = nvml.lib();
        // SAFETY: the handle is only passed back to the library.
        let h2 = unsafe { d2.handle() };
        let remapped = || {
            let (mut c, mut u, mut p, mut f) = (9, 9, 9, 9);
            assert_eq!(
                // SAFETY: valid handle and out-pointers.
                unsafe { raw.nvmlDeviceGetRemappedRows(h2, &mut c, &mut u, &mut p, &mut f) },
                SUCCESS
            );
            (c, u, p, f)
        };
        assert_eq!(remapped(), (0, 0, 0, 0));
        sim.inject_xid(2, 63, None, None).unwrap();
        assert_eq!(set.wait(2000).unwrap().event_data, Some(XidError::Value(63)));
        assert_eq!(remapped(), (0, 1, 1, 0));

        // The raw event record: MIG ids unset, and the v1 symbol writes only the v1 layout.
        sim.inject_xid(2, 48, None, None).unwrap();
        let mut data = raw_event(raw, &set);
        assert_eq!(
            (data.device, data.eventType, data.eventData, data.gpuInstanceId, data.computeInstanceId),
            (h2, 8, 48, u32::MAX, u32::MAX)
        );
        let lib = library(node);
        let wait_v1: unsafe extern "C" fn(nvmlEventSet_t, *mut nvmlEventData_t, c_uint) -> u32 =
            sym(&lib, "nvmlEventSetWait");
        sim.inject_xid(2, 94, None, None).unwrap();
        data.gpuInstanceId = 7;
        data.computeInstanceId = 7;
        // SAFETY: as above.
        assert_eq!(unsafe { wait_v1(set.handle(), &mut data, 2000) }, SUCCESS);
        assert_eq!((data.eventData, data.gpuInstanceId, data.computeInstanceId), (94, 7, 7));
        // SAFETY: deliberately bad set handles and data pointers.
        unsafe {
            assert_eq!(raw.nvmlEventSetWait_v2(0x99 as nvmlEventSet_t, &mut data, 10), INVALID_ARGUMENT);
            assert_eq!(raw.nvmlEventSetWait_v2(set.handle(), std::ptr::null_mut(), 10), INVALID_ARGUMENT);
            assert_eq!(raw.nvmlDeviceRegisterEvents(h2, 1 << 40, set.handle()), INVALID_ARGUMENT);
        }

        // The GPU falls off the bus: XID 79, then GPU_IS_LOST everywhere on it.
        sim.fall_off_bus(2).unwrap();
        let ev = set.wait(2000).unwrap();
        assert_eq!(ev.event_data, Some(XidError::Value(79)));
        assert!(matches!(d2.name(), Err(NvmlError::GpuLost)));
        assert!(matches!(d2.memory_info(), Err(NvmlError::GpuLost)));
        assert!(matches!(d2.utilization_rates(), Err(NvmlError::GpuLost)));
        assert!(matches!(d2.temperature(TemperatureSensor::Gpu), Err(NvmlError::GpuLost)));
        assert!(matches!(d2.running_compute_processes(), Err(NvmlError::GpuLost)));
        assert!(matches!(nvml.device_by_index(2), Err(NvmlError::GpuLost)));
        assert_eq!(
            // SAFETY: as above.
            unsafe { raw.nvmlEventSetWait_v2(set.handle(), &mut data, 50) },
            GPU_IS_LOST
        );
        assert_eq!(nvml.device_by_index(3).unwrap().name().unwrap(), "NVIDIA H100 80GB HBM3", "other GPUs are fine");

        // A reset brings it back: volatile counters cleared, aggregate kept, remap applied.
        sim.reset(2).unwrap();
        assert_eq!(d2.name().unwrap(), "NVIDIA H100 80GB HBM3");
        assert_eq!(nvml.device_by_index(2).unwrap().memory_info().unwrap().used, 0);
        assert_eq!(d2.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile).unwrap(), 0);
        assert_eq!(d2.total_ecc_errors(MemoryError::Corrected, EccCounter::Aggregate).unwrap(), 5);
        assert_eq!(remapped(), (0, 1, 0, 0));
        assert_eq!(
            // SAFETY: as above.
            unsafe { raw.nvmlEventSetWait_v2(set.handle(), &mut data, 50) },
            TIMEOUT
        );
        set.release_events().unwrap();
    });
}

#[test]
fn topology_and_nvlink_of_an_hgx_board() {
    let node = SimNode::new();
    with_nvml(node, "topology_and_nvlink_of_an_hgx_board", |_, nvml| {
        let d: Vec<_> = (0..8).map(|i| nvml.device_by_index(i).unwrap()).collect();
        let dev = |i| nvml.device_by_index(i).unwrap();
        assert_eq!(d[0].topology_common_ancestor(dev(1)).unwrap(), TopologyLevel::Single);
        assert_eq!(d[0].topology_common_ancestor(dev(2)).unwrap(), TopologyLevel::Node);
        assert_eq!(d[0].topology_common_ancestor(dev(4)).unwrap(), TopologyLevel::System);
        let idx = |v: Vec<nvml_wrapper::Device>| v.iter().map(|x| x.index().unwrap()).collect::<Vec<_>>();
        assert_eq!(idx(d[0].topology_nearest_gpus(TopologyLevel::Single).unwrap()), vec![1]);
        assert_eq!(idx(d[0].topology_nearest_gpus(TopologyLevel::Node).unwrap()), vec![1, 2, 3]);
        assert_eq!(idx(d[5].topology_nearest_gpus(TopologyLevel::System).unwrap()), vec![0, 1, 2, 3, 4, 6, 7]);
        assert_eq!(idx(nvml.topology_gpu_set(0).unwrap()), vec![0, 1, 2, 3], "CPU 0 is on NUMA node 0");

        let raw = nvml.lib();
        // SAFETY: handles are only passed back to the library.
        let (h0, h7) = unsafe { (d[0].handle(), d[7].handle()) };
        let p2p = |index| {
            let mut s = 99;
            assert_eq!(
                // SAFETY: valid handles and out-pointer.
                unsafe { raw.nvmlDeviceGetP2PStatus(h0, h7, index, &mut s) },
                SUCCESS
            );
            s
        };
        assert_eq!(p2p(nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK), nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK);
        assert_eq!(p2p(nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_READ), nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK);
        assert_eq!(
            p2p(nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_PCI),
            nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED
        );

        let link = d[0].link_wrapper_for(0);
        assert!(link.is_active().unwrap());
        assert_eq!(link.version().unwrap(), nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_4_0);
        assert!(link.has_capability(Capability::P2p).unwrap());
        assert!(!link.has_capability(Capability::SysMemAccess).unwrap());
        let remote = link.remote_pci_info().unwrap();
        assert_eq!(remote.pci_device_id, 0x22A3_10DE, "an NVSwitch");
        assert_eq!(remote.bus_id, "00000000:05:00.0");
        let last = d[0].link_wrapper_for(17).remote_pci_info().unwrap();
        assert_ne!(last.bus_id, remote.bus_id, "links spread over the switches");
        assert!(matches!(d[0].link_wrapper_for(18).is_active(), Err(NvmlError::InvalidArg)));
    });
}

#[test]
fn a_node_without_nvlink_or_mig() {
    let node = SimNode::with_description(
        "gpus_per_pcie_switch = 4\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\ncount = 2\nnvlink = false\n",
    );
    with_nvml(node, "a_node_without_nvlink_or_mig", |_, nvml| {
        let d0 = nvml.device_by_index(0).unwrap();
        let d1 = nvml.device_by_index(1).unwrap();
        assert_eq!(d0.name().unwrap(), "NVIDIA A100-SXM4-40GB");
        assert_eq!(d0.memory_info().unwrap().total, 40_960 * MIB);
        let cc = d0.cuda_compute_capability().unwrap();
        assert_eq!((cc.major, cc.minor), (8, 0));
        assert!(!d0.link_wrapper_for(0).is_active().unwrap(), "links present but not wired");
        assert!(matches!(d0.link_wrapper_for(0).remote_pci_info(), Err(NvmlError::NotSupported)));
        assert_eq!(d0.topology_common_ancestor(nvml.device_by_index(1).unwrap()).unwrap(), TopologyLevel::Single);
        let mode = d0.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (0, 0));
        assert_eq!(d0.mig_device_count().unwrap(), 0);
        assert!(matches!(d0.mig_device_by_index(0), Err(NvmlError::InvalidArg)));
        let raw = nvml.lib();
        // SAFETY: handles are only passed back to the library.
        let (h0, h1) = unsafe { (d0.handle(), d1.handle()) };
        let mut s = 99;
        assert_eq!(
            // SAFETY: valid handles and out-pointer.
            unsafe { raw.nvmlDeviceGetP2PStatus(h0, h1, nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK, &mut s,) },
            SUCCESS
        );
        assert_eq!(s, nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED);
    });
}

#[test]
fn reset_gpu_applies_a_pending_mig_mode_like_the_sim_cli() {
    // An A100 (GPU 1) keeps its MIG mode pending until a reset.
    let node = SimNode::with_description(
        "[[gpu]]\nmodel = \"A100-SXM4-40GB\"\ncount = 1\nmig = true\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\ncount = 1\n",
    );
    with_nvml(node, "reset_gpu_applies_a_pending_mig_mode_like_the_sim_cli", |node, nvml| {
        let lib = library(node);
        let reset: unsafe extern "C" fn(nvmlDevice_t) -> nvmlReturn_t = sym(&lib, "nvmlDeviceResetGpu");
        let d1 = nvml.device_by_index(1).unwrap();
        // SAFETY: the handle is only passed back to the library.
        let h1 = unsafe { d1.handle() };
        assert_eq!(d1.set_mig_mode(true).unwrap(), RESET_REQUIRED);
        // SAFETY: a live device handle.
        assert_eq!(unsafe { reset(h1) }, SUCCESS);
        let mode = d1.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (1, 1), "the pending MIG mode is applied");
        // A stale pointer is refused, not followed.
        // SAFETY: the library checks a handle before using it.
        assert_eq!(unsafe { reset(0x10 as nvmlDevice_t) }, INVALID_ARGUMENT);
    });
}
