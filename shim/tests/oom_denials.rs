//! Every allocation the memory limit refuses is counted once in the container's region, which
//! tesserad exports as `tessera_container_oom_denials_total` (and the OOM alert and dashboard of
//! deploy/monitoring read): whether the process's own tally refused it (a container of one
//! process: before, nothing was counted at all) or the container's total did (before, each
//! refusal counted twice: the reservation is tried again after a reap).

mod common;

use common::*;
use tessera_sim_testkit::binary;

/// The container's OOM denials as the daemon reads them: live processes' and exited ones'.
fn denials(c: &Container) -> u64 {
    let region = c.region();
    region.reap();
    let snap = region.snapshot();
    let live: u64 = snap.processes.iter().map(|p| p.devices[0].oom_denials).sum();
    live + snap.devices[0].exited_oom_denials
}

#[test]
fn a_refusal_of_a_lone_process_is_counted_once() {
    let node = node();
    let c = Container::new(&memory_limits(GIB));
    // 300 MiB of context and 500 MiB fit in 1 GiB; the second 500 MiB does not.
    let (_, r, err) = workload(&c, &node, &["--alloc-mib", "1500", "--chunk-mib", "500"]);
    assert_eq!(r["alloc_error"], "CUDA_ERROR_OUT_OF_MEMORY", "{r}\n{err}");
    assert_eq!(r["allocations"], 1, "{r}");
    assert_eq!(denials(&c), 1);
    let (_, r, _) = workload(&c, &node, &["--alloc-mib", "1500", "--chunk-mib", "500"]);
    assert_eq!(r["alloc_error"], "CUDA_ERROR_OUT_OF_MEMORY", "{r}");
    assert_eq!(denials(&c), 2, "the exited process's denial is kept beside the new one");
}

#[test]
fn a_refusal_by_the_containers_total_is_counted_once() {
    let node = node();
    let c = Container::new(&memory_limits(2 * GIB));
    // One process holds 300 + 1000 MiB; the next one's own 300 + 500 MiB would fit alone, not
    // beside it.
    let (mut holder, _) =
        holding(c.command(&node, binary("tessera-workload")), &["--alloc-mib", "1000", "--hold", "60"]);
    let (_, r, err) = workload(&c, &node, &["--alloc-mib", "500"]);
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert_eq!(r["alloc_error"], "CUDA_ERROR_OUT_OF_MEMORY", "{r}\n{err}");
    assert_eq!(denials(&c), 1);
}
