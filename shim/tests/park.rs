//! A program under the shim parked and resumed through the driver's checkpoint API (issue 33):
//! its data intact at the same addresses, the GPU's memory free while parked (what NVML reads),
//! and the container's region showing the memory parked, not used, then used again, its books
//! unchanged across.

mod common;

use std::ffi::{OsString, c_int};

use common::*;
use serde_json::Value;
use tessera_region::region::ParkState;
use tessera_sim_model::Node;
use tessera_sim_testkit::{binary, spawn_workload};

const TARGET: &str = "TESSERA_PARK_TEST_TARGET";

/// The checkpoint API, from the simulated driver, as tesserad calls it.
fn checkpoint_call(lib: &libloading::Library, name: &str, pid: u32) -> u32 {
    // SAFETY: cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock} take (int pid, args*), args
    // may be null (cuda.h 12.9).
    let f: libloading::Symbol<unsafe extern "C" fn(c_int, *mut u8) -> u32> =
        unsafe { lib.get(name.as_bytes()) }.unwrap_or_else(|e| panic!("{name}: {e}"));
    // SAFETY: as above; a null args pointer is documented.
    unsafe { f(pid as c_int, std::ptr::null_mut()) }
}

#[test]
fn a_program_under_the_shim_is_parked_and_resumed_with_its_data_and_books_intact() {
    let test = "a_program_under_the_shim_is_parked_and_resumed_with_its_data_and_books_intact";
    let node = node();
    let c = Container::new(&memory_limits(4 * GIB));
    let (mut workload, pid, lines) = spawn_workload(
        c.command(&node, binary("tessera-workload"))
            // The hold outlasts the park (a second or two); a read after it waits while parked.
            .args(["--alloc-mib", "512", "--chunk-mib", "128", "--verify", "--hold", "15"]),
    );
    let region = c.region();
    let held = region.used(0);
    assert!(held >= 512 * MIB, "the shim's books hold the workload's memory: {held}");

    // The parker (tesserad's part) runs in a process of its own pointed at the node.
    let mut env: Vec<(String, OsString)> = node.env();
    env.push((TARGET.into(), format!("{pid} {}", c.region.display()).into()));
    wait_child(test, spawn_child(&format!("{test}_parker"), env));

    let last = lines.last().expect("the report").unwrap();
    let report: Value = serde_json::from_str(&last).unwrap();
    assert!(workload.wait().unwrap().success(), "{report}");
    assert_eq!(report["verified_after_hold_bytes"], 4 * MIB, "every chunk read back intact after the resume: {report}");
}

/// The parking side: lock, checkpoint, look, restore, unlock, as tesserad does around the region.
#[test]
fn a_program_under_the_shim_is_parked_and_resumed_with_its_data_and_books_intact_parker() {
    let Some(target) = std::env::var_os(TARGET) else { return };
    let target = target.into_string().unwrap();
    let (pid, region_path) = target.split_once(' ').unwrap();
    let pid: u32 = pid.parse().unwrap();
    let region = tessera_region::Region::open_or_create(std::path::Path::new(region_path)).unwrap();
    let lib_dir = std::env::var("LD_LIBRARY_PATH").unwrap();
    let lib_path =
        lib_dir.split(':').map(|d| std::path::Path::new(d).join("libcuda.so.1")).find(|p| p.exists()).unwrap();
    // SAFETY: loading the simulated driver runs no initializers.
    let lib = unsafe { libloading::Library::new(lib_path) }.unwrap();
    let model = Node::open_from_env().unwrap();
    let gpu_used = || model.memory_info(0, 0).unwrap().used;
    let held = region.used(0);
    let before = gpu_used();
    assert!(before >= held, "the GPU holds what the region counts");

    region.set_park_state(ParkState::Parking);
    assert_eq!(checkpoint_call(&lib, "cuCheckpointProcessLock", pid), 0);
    assert_eq!(checkpoint_call(&lib, "cuCheckpointProcessCheckpoint", pid), 0);
    region.set_park_state(ParkState::Parked);
    assert_eq!(gpu_used(), 0, "NVML: the parked program's memory is free");
    assert!(model.processes(0, None).unwrap().iter().all(|p| p.pid != pid), "NVML: and it is not listed");
    let snap = region.reap_and_snapshot();
    assert_eq!((snap.devices[0].used, snap.devices[0].parked), (0, held), "the region: parked, not used");
    assert_eq!(snap.processes.len(), 1, "the parked process keeps its slot");
    assert_eq!(region.used(0), held, "the shim's own books do not move");

    region.set_park_state(ParkState::Resuming);
    assert_eq!(checkpoint_call(&lib, "cuCheckpointProcessRestore", pid), 0);
    assert_eq!(checkpoint_call(&lib, "cuCheckpointProcessUnlock", pid), 0);
    region.set_park_state(ParkState::Running);
    assert_eq!(gpu_used(), before, "NVML: its memory is back");
    let snap = region.reap_and_snapshot();
    assert_eq!((snap.devices[0].used, snap.devices[0].parked), (held, 0));
}
