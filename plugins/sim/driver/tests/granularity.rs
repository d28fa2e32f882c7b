//! What a real card held for what a program asked (`measured_granularity` in the reading
//! `card_facts.rs` checks), replayed on the sim through `libcuda.so.1` and `libnvidia-ml.so.1`
//! as a program calls them: each case's growth of NVML's per-process figure
//! (`nvmlDeviceGetComputeRunningProcesses_v3`'s `usedGpuMemory`) is the card's, NVML's used memory
//! and `cuMemGetInfo`'s free memory move by the same, and freeing gives it all back. The
//! allocations are distinct, and each is usable for the bytes asked (a memset and a copy of all
//! of them). A case this test cannot replay fails it, naming the case.
//!
//! The rule the sim follows (`src/cuda/suballoc.rs`, docs/sim.md): more than 1 MiB takes whole
//! 2 MiB pages; 1 MiB or less is carved from a 2 MiB chunk shared with other such allocations.

#[macro_use]
mod common;

use std::ffi::{c_int, c_uint, c_void};

use common::{Lib, MIB, SUCCESS, facts, facts_path, node_for};
use nvml_wrapper_sys::bindings::*;
use serde_json::Value;

type Dev = *mut c_void;

/// A program on the card's node: CUDA initialized with the primary context current, NVML too.
struct Program {
    lib: Lib,
    dev: Dev,
}

impl Program {
    fn start(node: &tessera_sim_testkit::SimNode) -> Program {
        // SAFETY: loading the simulated driver runs no initializers.
        let lib = Lib(unsafe { libloading::Library::new(node.cuda_path()) }.expect("load libcuda.so.1"));
        assert_eq!(call!(lib, cuInit(0) as fn(c_uint)), SUCCESS, "cuInit");
        let mut ctx: *mut c_void = std::ptr::null_mut();
        assert_eq!(call!(lib, cuDevicePrimaryCtxRetain(&mut ctx, 0) as fn(*mut *mut c_void, c_int)), SUCCESS);
        assert_eq!(call!(lib, cuCtxSetCurrent(ctx) as fn(*mut c_void)), SUCCESS);
        assert_eq!(call!(lib, nvmlInit_v2() as fn()), SUCCESS, "nvmlInit_v2");
        let mut dev: Dev = std::ptr::null_mut();
        assert_eq!(call!(lib, nvmlDeviceGetHandleByIndex_v2(0, &mut dev) as fn(c_uint, *mut Dev)), SUCCESS);
        Program { lib, dev }
    }

    /// NVML's figure for this process on the GPU.
    fn own(&self) -> u64 {
        // SAFETY: nvmlProcessInfo_t is plain data; all zeroes is a valid value.
        let mut infos: [nvmlProcessInfo_t; 16] = unsafe { std::mem::zeroed() };
        let mut count: c_uint = 16;
        let rc = call!(
            self.lib,
            nvmlDeviceGetComputeRunningProcesses_v3(self.dev, &mut count, infos.as_mut_ptr())
                as fn(Dev, *mut c_uint, *mut nvmlProcessInfo_t)
        );
        assert_eq!(rc, SUCCESS, "nvmlDeviceGetComputeRunningProcesses_v3");
        let me = std::process::id();
        infos[..count as usize].iter().find(|p| p.pid == me).map_or(0, |p| p.usedGpuMemory)
    }

    /// NVML's used memory of the GPU, and `cuMemGetInfo`'s free memory.
    fn books(&self) -> (u64, u64) {
        // SAFETY: nvmlMemory_t is plain data.
        let mut m: nvmlMemory_t = unsafe { std::mem::zeroed() };
        assert_eq!(call!(self.lib, nvmlDeviceGetMemoryInfo(self.dev, &mut m) as fn(Dev, *mut nvmlMemory_t)), SUCCESS);
        let (mut free, mut total) = (0usize, 0usize);
        assert_eq!(call!(self.lib, cuMemGetInfo_v2(&mut free, &mut total) as fn(*mut usize, *mut usize)), SUCCESS);
        (m.used, free as u64)
    }

    fn alloc(&self, bytes: u64) -> Result<u64, u32> {
        let mut p = 0u64;
        match call!(self.lib, cuMemAlloc_v2(&mut p, bytes as usize) as fn(*mut u64, usize)) {
            SUCCESS => Ok(p),
            rc => Err(rc),
        }
    }

    fn free(&self, p: u64) {
        assert_eq!(call!(self.lib, cuMemFree_v2(p) as fn(u64)), SUCCESS, "cuMemFree_v2");
    }

    fn limit(&self, limit: c_int) -> u64 {
        let mut v = 0usize;
        assert_eq!(call!(self.lib, cuCtxGetLimit(&mut v, limit) as fn(*mut usize, c_int)), SUCCESS);
        v as u64
    }

    fn set_limit(&self, limit: c_int, v: u64) -> u32 {
        call!(self.lib, cuCtxSetLimit(limit, v as usize) as fn(c_int, usize))
    }

    fn attribute(&self, attr: c_int) -> u64 {
        let mut v: c_int = 0;
        assert_eq!(call!(self.lib, cuDeviceGetAttribute(&mut v, attr, 0) as fn(*mut c_int, c_int, c_int)), SUCCESS);
        v as u64
    }

    /// Sets every byte of each allocation to its index and reads its whole size back: distinct
    /// memory, usable for the bytes asked.
    fn check_usable(&self, ptrs: &[u64], bytes: u64, diffs: &mut Vec<String>, case: &str) {
        let mut sorted = ptrs.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] + bytes > w[1]) {
            diffs.push(format!("{case}: allocations overlap"));
        }
        for (i, &p) in ptrs.iter().enumerate() {
            let v = (i % 251) as u8 + 1;
            assert_eq!(call!(self.lib, cuMemsetD8_v2(p, v, bytes as usize) as fn(u64, u8, usize)), SUCCESS);
        }
        let mut back = vec![0u8; bytes as usize];
        for (i, &p) in ptrs.iter().enumerate() {
            let v = (i % 251) as u8 + 1;
            let rc = call!(
                self.lib,
                cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), p, bytes as usize) as fn(*mut c_void, u64, usize)
            );
            assert_eq!(rc, SUCCESS, "cuMemcpyDtoH_v2");
            if back.iter().any(|&b| b != v) {
                diffs.push(format!("{case}: allocation {i} does not hold what was set in it"));
                return;
            }
        }
    }
}

/// `N x cuMemAlloc ...`: N allocations of `asked / N` bytes each.
fn allocations(key: &str, case: &Value) -> Option<(u64, u64)> {
    let (n, rest) = key.split_once(" x ")?;
    let n: u64 = n.parse().ok()?;
    let asked = case["asked"].as_u64()?;
    (rest.starts_with("cuMemAlloc ") && n > 0 && asked % n == 0).then_some((n, asked / n))
}

/// `cuCtxSetLimit <limit> <from> -> <to>`: the limit and the value set.
fn limit_set(key: &str) -> Option<(c_int, u64)> {
    let rest = key.strip_prefix("cuCtxSetLimit ")?;
    let (what, to) = rest.split_once(" -> ")?;
    let limit = if what.starts_with("stack") {
        0
    } else if what.starts_with("printf") {
        1
    } else if what.starts_with("malloc heap") {
        2
    } else {
        return None;
    };
    let (n, unit) = to.split_once(' ')?;
    let scale = match unit {
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    Some((limit, n.parse::<u64>().ok()? * scale))
}

fn replay_allocations(p: &Program, case: &str, (n, size): (u64, u64), card: &Value, diffs: &mut Vec<String>) {
    let Some(held) = card["driver_per_process"].as_u64() else {
        return diffs.push(format!("{case}: no driver_per_process"));
    };
    let (own, (used, free)) = (p.own(), p.books());
    let ptrs: Vec<u64> = (0..n).map(|_| p.alloc(size).expect("cuMemAlloc_v2")).collect();
    let grew = p.own() - own;
    if grew != held {
        diffs.push(format!("{case}: NVML's per-process figure grew by {grew}, the card's by {held}"));
    }
    let (used_now, free_now) = p.books();
    if (used_now - used, free - free_now) != (grew, grew) {
        diffs.push(format!(
            "{case}: NVML's used memory grew by {}, cuMemGetInfo's free fell by {}, the process's figure by {grew}",
            used_now - used,
            free - free_now
        ));
    }
    p.check_usable(&ptrs, size, diffs, case);
    for &q in &ptrs {
        p.free(q);
    }
    if (p.own(), p.books()) != (own, (used, free)) {
        diffs.push(format!("{case}: freeing everything did not give the memory back"));
    }
}

fn replay_limit(p: &Program, case: &str, (limit, value): (c_int, u64), card: &Value, diffs: &mut Vec<String>) {
    let (before, own) = (p.limit(limit), p.own());
    if p.set_limit(limit, value) != SUCCESS {
        return diffs.push(format!("{case}: cuCtxSetLimit refused"));
    }
    let took = p.own() - own;
    let want = card["device_memory_taken_at_set"].as_u64().or(card["device_memory_taken"].as_u64());
    match want {
        Some(want) if want != took => diffs.push(format!("{case}: took {took} at set, the card {want}")),
        Some(_) => {}
        None => diffs.push(format!("{case}: no device_memory_taken")),
    }
    if let Some(threads) = card["resident_threads"].as_u64() {
        // MULTIPROCESSOR_COUNT × MAX_THREADS_PER_MULTIPROCESSOR.
        let resident = p.attribute(16) * p.attribute(39);
        if resident != threads {
            diffs.push(format!("{case}: {resident} resident threads, the card {threads}"));
        }
    }
    assert_eq!(p.set_limit(limit, before), SUCCESS);
    if p.own() != own {
        diffs.push(format!("{case}: setting the limit back did not give the memory back"));
    }
}

/// Runs `body` in a process of its own on the card's node, as a [`Program`], given the facts.
fn on_the_card(test: &str, body: impl FnOnce(&Program, &Value)) {
    let f = facts();
    let node = node_for(&f);
    node.run_isolated(test, || body(&Program::start(&node), &f));
}

#[test]
fn each_measured_case_holds_what_the_card_held() {
    on_the_card("each_measured_case_holds_what_the_card_held", |p, f| {
        let cases = f["measured_granularity"].as_object().expect("facts: measured_granularity");
        let mut diffs = Vec::new();
        for (key, card) in cases.iter().filter(|(k, _)| !k.starts_with('_')) {
            if let Some(a) = allocations(key, card) {
                replay_allocations(p, key, a, card, &mut diffs);
            } else if let Some(l) = limit_set(key) {
                replay_limit(p, key, l, card, &mut diffs);
            } else {
                diffs.push(format!("{key}: no replay for this case; teach granularity.rs to replay it"));
            }
        }
        assert!(diffs.is_empty(), "{} differs from {}:\n  {}", diffs.len(), facts_path().display(), diffs.join("\n  "));
    });
}

/// The rule between the card's measurements, and a chunk's life: allocations of at most 1 MiB
/// share 2 MiB chunks, which go back once all their allocations are freed; more than 1 MiB takes
/// whole pages of its own; pitched allocations follow the same rule by their pitch times height.
#[test]
fn small_allocations_share_chunks_and_larger_ones_take_whole_pages() {
    on_the_card("small_allocations_share_chunks_and_larger_ones_take_whole_pages", |p, _| {
        let base = p.own();
        let grew = || p.own() - base;

        let small: Vec<u64> = (0..256).map(|_| p.alloc(1024).unwrap()).collect();
        assert_eq!(grew(), 2 * MIB, "256 x 1 KiB: one chunk");
        for &q in &small[..255] {
            p.free(q);
        }
        assert_eq!(grew(), 2 * MIB, "the chunk stays while one allocation is in it");
        let again = p.alloc(4096).unwrap();
        assert_eq!(grew(), 2 * MIB, "a new small allocation goes into the chunk's free room");
        p.free(small[255]);
        p.free(again);
        assert_eq!(grew(), 0, "its last allocation freed: the chunk goes back");

        let halves: Vec<u64> = (0..2).map(|_| p.alloc(MIB).unwrap()).collect();
        assert_eq!(grew(), 2 * MIB, "two of 1 MiB share a chunk");
        let over = p.alloc(MIB + 1).unwrap();
        assert_eq!(grew(), 4 * MIB, "1 MiB + 1 takes a page of its own");
        let big = p.alloc(3 * MIB).unwrap();
        assert_eq!(grew(), 8 * MIB, "3 MiB takes two pages");
        for q in halves.into_iter().chain([over, big]) {
            p.free(q);
        }
        assert_eq!(grew(), 0);

        // Pitched: 100 rows of 1000 bytes, pitched to 1024: 100 KiB, carved from a chunk.
        let (mut q, mut pitch) = (0u64, 0usize);
        let rc = call!(
            p.lib,
            cuMemAllocPitch_v2(&mut q, &mut pitch, 1000, 100, 4) as fn(*mut u64, *mut usize, usize, usize, c_uint)
        );
        assert_eq!((rc, pitch), (SUCCESS, 1024));
        assert_eq!(grew(), 2 * MIB);
        p.free(q);
        assert_eq!(grew(), 0);
    });
}
