//! Per-container usage read from the accounting regions.
//!
//! [`UsageSampler::sample`] opens each allocation's region (keeping the handle for the next
//! sample), reaps dead processes, snapshots it and turns the per-process counters into one
//! picture per container and physical device:
//!
//! - memory used and peak are the container's totals on the device (the region keeps them);
//! - launches, GPU time, throttled time and OOM denials are the region's exited totals (a dead
//!   process's final counters, folded in when its slot is reaped, by whoever reaps it) plus the
//!   live processes' counters: exact whatever the sampling period, the same for every sampler
//!   (`tessera top` and `/metrics` agree), and never backwards (Prometheus counters);
//! - rates (achieved SM percent, launches per second) are over the window since this sampler's
//!   previous sample of the same allocation; the first sample has a window of 0 and rates of 0.
//!
//! An allocation's devices are matched to the region's by physical UUID (case-insensitive): two
//! shares of one GPU in the same allocation are one region device and one [`DeviceUsage`], whose
//! `device_id` joins the shares' ids with commas. Regions that cannot be opened are logged and
//! left out (fail soft): telemetry never stops the daemon.

use std::collections::{HashMap, HashSet};

use tessera_region::{Region, Snapshot};

use crate::state::record::unix_ns;
use crate::state::{AllocDirs, AllocatedDevice, Allocation, ContainerIdentity};

/// Usage of every sampled container at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsageReport {
    /// When the sample was taken: nanoseconds since the Unix epoch.
    pub time_unix_ns: u64,
    pub containers: Vec<ContainerUsage>,
}

/// One allocation's usage.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerUsage {
    pub allocation_id: String,
    /// The extended resource it was allocated under.
    pub resource: String,
    pub container: ContainerIdentity,
    /// Live processes joined to the region (after reaping dead ones).
    pub processes: u32,
    /// One per physical device of the allocation, in the allocation's order.
    pub devices: Vec<DeviceUsage>,
}

/// One container's usage of one physical device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceUsage {
    /// The allocation's device ids on this physical device, comma-joined (shares of one GPU).
    pub device_id: String,
    /// The physical device (GPU or MIG UUID).
    pub uuid: String,
    /// Bytes the container holds on the device now.
    pub memory_used: u64,
    /// The most it has held at once.
    pub memory_peak: u64,
    /// The allocation's memory limit on the device (shares summed); `None`: no limit.
    pub memory_limit: Option<u64>,
    /// The allocation's SM limit on the device (shares summed, at most 100); `None`: no limit.
    pub sm_limit_percent: Option<u32>,
    /// GPU time over wall time in the window, percent (may pass 100 when kernels overlap).
    pub sm_achieved_percent: f64,
    /// Kernel launches per second in the window.
    pub launches_per_second: f64,
    /// Cumulative (monotonic) since the sampler first saw the allocation's processes.
    pub launches: u64,
    pub gpu_time_ns: u64,
    pub throttled_ns: u64,
    pub oom_denials: u64,
    /// The window the rates are over: nanoseconds since the previous sample (0: first sample).
    pub window_ns: u64,
}

/// The per-process counters on one device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counters {
    launches: u64,
    gpu_time_ns: u64,
    throttled_ns: u64,
    oom_denials: u64,
}

impl Counters {
    fn add(&mut self, o: &Counters) {
        self.launches = self.launches.saturating_add(o.launches);
        self.gpu_time_ns = self.gpu_time_ns.saturating_add(o.gpu_time_ns);
        self.throttled_ns = self.throttled_ns.saturating_add(o.throttled_ns);
        self.oom_denials = self.oom_denials.saturating_add(o.oom_denials);
    }

    fn max(&mut self, o: &Counters) {
        self.launches = self.launches.max(o.launches);
        self.gpu_time_ns = self.gpu_time_ns.max(o.gpu_time_ns);
        self.throttled_ns = self.throttled_ns.max(o.throttled_ns);
        self.oom_denials = self.oom_denials.max(o.oom_denials);
    }
}

/// What the sampler keeps per allocation between samples.
struct Tracked {
    region: Region,
    /// Monotonic clock of the previous sample; `None` before the first.
    last_ns: Option<u64>,
    /// The allocation's devices `plan` was made from; new limits make it again.
    devices: Vec<AllocatedDevice>,
    /// One entry per physical device of the allocation, in the allocation's order.
    plan: Vec<Planned>,
}

/// One physical device of an allocation: what its usage reports that does not change between
/// samples (made once, not at every scrape), and the counters reported last time.
struct Planned {
    /// The allocation's device ids on it, comma-joined.
    device_id: String,
    /// As the allocation's first device on it spells it.
    uuid: String,
    memory_limit: Option<u64>,
    sm_limit_percent: Option<u32>,
    /// Cumulative counters reported last time.
    reported: Counters,
}

/// The physical devices of `alloc`, in its order; counters reported before carried over from
/// `old` (matched by UUID, case-insensitive).
fn plan(alloc: &Allocation, old: &[Planned]) -> Vec<Planned> {
    let limits = alloc.limits();
    let mut plan: Vec<Planned> = Vec::new();
    for d in &alloc.devices {
        let uuid = &d.physical_uuid;
        if plan.iter().any(|p| p.uuid.eq_ignore_ascii_case(uuid)) {
            continue;
        }
        let device_id = alloc
            .devices
            .iter()
            .filter(|o| o.physical_uuid.eq_ignore_ascii_case(uuid))
            .map(|o| o.device_id.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let limit = limits.devices.iter().find(|l| l.uuid.eq_ignore_ascii_case(uuid));
        plan.push(Planned {
            device_id,
            uuid: uuid.clone(),
            memory_limit: limit.and_then(|l| l.memory_limit),
            sm_limit_percent: limit.and_then(|l| l.sm_percent),
            reported: old
                .iter()
                .find(|p| p.uuid.eq_ignore_ascii_case(uuid))
                .map_or_else(Counters::default, |p| p.reported),
        });
    }
    plan
}

/// Samples the accounting regions; keeps the previous sample of each allocation for rates and
/// for counters that outlive their processes. Not shared: one per consumer (its rates are over
/// its own sampling interval).
#[derive(Default)]
pub struct UsageSampler {
    tracked: HashMap<String, Tracked>,
    /// Allocations whose region could not be opened, warned about once until it opens again.
    warned: HashSet<String>,
}

impl std::fmt::Debug for UsageSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageSampler").field("allocations", &self.tracked.len()).finish()
    }
}

impl UsageSampler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens (or reuses an open handle to) each allocation's region, reaps dead processes,
    /// snapshots it, and computes rates against this sampler's previous sample of the same
    /// allocation (first sample: rates 0, window 0). Regions that cannot be opened (or whose
    /// file is not there) are reported with a tracing warning and left out (fail soft).
    /// Allocations not in `allocations` are forgotten. `now_ns` is the monotonic clock.
    pub fn sample(&mut self, allocations: &[Allocation], dirs: &AllocDirs, now_ns: u64) -> UsageReport {
        let live: HashSet<&str> = allocations.iter().map(|a| a.id.as_str()).collect();
        self.tracked.retain(|id, _| live.contains(id.as_str()));
        self.warned.retain(|id| live.contains(id.as_str()));
        let mut containers = Vec::with_capacity(allocations.len());
        for alloc in allocations {
            if !self.tracked.contains_key(&alloc.id) {
                let path = dirs.region_path(&alloc.id);
                // Only an existing region: a missing one would otherwise be created here, with
                // its directory, for an allocation being removed.
                let opened = if path.exists() {
                    Region::open_or_create(&path).map_err(|e| e.to_string())
                } else {
                    Err(format!("{}: no region file", path.display()))
                };
                match opened {
                    Ok(region) => {
                        self.warned.remove(&alloc.id);
                        self.tracked.insert(
                            alloc.id.clone(),
                            Tracked { region, last_ns: None, devices: Vec::new(), plan: Vec::new() },
                        );
                    }
                    Err(e) => {
                        if self.warned.insert(alloc.id.clone()) {
                            tracing::warn!(allocation = %alloc.id, "usage: cannot open the accounting region: {e}");
                        }
                        continue;
                    }
                }
            }
            let Some(t) = self.tracked.get_mut(&alloc.id) else { continue };
            // Dead processes reaped and the region read in one pass over its slots.
            let snap = t.region.reap_and_snapshot();
            // A container shrank or overwrote its region: its counters are zeros or lies. Say
            // so once and leave it out; enforcement reads the driver's numbers, not these.
            if t.region.is_damaged() {
                if self.warned.insert(alloc.id.clone()) {
                    tracing::error!(
                        allocation = %alloc.id,
                        region = %t.region.name(),
                        "usage: the accounting region was truncated or overwritten by a process that maps it; \
                         its usage is not reported"
                    );
                }
                continue;
            }
            containers.push(t.update(alloc, &snap, now_ns));
        }
        UsageReport { time_unix_ns: unix_ns(), containers }
    }
}

impl Tracked {
    /// Folds a fresh snapshot in and reports the allocation's usage.
    fn update(&mut self, alloc: &Allocation, snap: &Snapshot, now_ns: u64) -> ContainerUsage {
        if self.devices != alloc.devices {
            self.plan = plan(alloc, &self.plan);
            self.devices.clone_from(&alloc.devices);
        }
        let window_ns = self.last_ns.map_or(0, |last| now_ns.saturating_sub(last));

        // Cumulative per region device (as the snapshot lists them): what exited processes left
        // in the region (folded in when they are reaped) + what the live ones have now.
        let mut cumulative: Vec<Counters> = snap
            .devices
            .iter()
            .map(|d| Counters {
                launches: d.exited_launches,
                gpu_time_ns: d.exited_gpu_time_ns,
                throttled_ns: d.exited_throttled_ns,
                oom_denials: d.exited_oom_denials,
            })
            .collect();
        for p in &snap.processes {
            for d in &p.devices {
                if let Some(c) = cumulative.get_mut(d.dev) {
                    c.add(&Counters {
                        launches: d.launches,
                        gpu_time_ns: d.gpu_time_ns,
                        throttled_ns: d.throttled_ns,
                        oom_denials: d.oom_denials,
                    });
                }
            }
        }

        let mut devices = Vec::with_capacity(self.plan.len());
        for planned in &mut self.plan {
            // The region's entries for this device, matched by UUID (case-insensitive).
            let mut now = Counters::default();
            let mut region_dev = None;
            for (r, c) in snap.devices.iter().zip(&cumulative) {
                if r.uuid.eq_ignore_ascii_case(&planned.uuid) {
                    now.add(c);
                    region_dev.get_or_insert(r);
                }
            }
            let before = planned.reported;
            // Never backwards, whatever a racy reading says.
            now.max(&before);
            planned.reported = now;
            let secs = window_ns as f64 / 1e9;
            let (sm_achieved_percent, launches_per_second) = if window_ns == 0 {
                (0.0, 0.0)
            } else {
                (
                    (now.gpu_time_ns - before.gpu_time_ns) as f64 / window_ns as f64 * 100.0,
                    (now.launches - before.launches) as f64 / secs,
                )
            };
            devices.push(DeviceUsage {
                device_id: planned.device_id.clone(),
                uuid: planned.uuid.clone(),
                memory_used: region_dev.map_or(0, |r| r.used),
                memory_peak: region_dev.map_or(0, |r| r.peak),
                memory_limit: planned.memory_limit,
                sm_limit_percent: planned.sm_limit_percent,
                sm_achieved_percent,
                launches_per_second,
                launches: now.launches,
                gpu_time_ns: now.gpu_time_ns,
                throttled_ns: now.throttled_ns,
                oom_denials: now.oom_denials,
                window_ns,
            });
        }
        self.last_ns = Some(now_ns);

        ContainerUsage {
            allocation_id: alloc.id.clone(),
            resource: alloc.resource.clone(),
            container: alloc.container.clone(),
            processes: u32::try_from(snap.processes.len()).unwrap_or(u32::MAX),
            devices,
        }
    }
}

#[cfg(test)]
mod tests {
    use tessera_region::Slot;

    use super::*;
    use crate::state::{AllocatedDevice, Source};

    use crate::state::record::tests::dev;

    const SEC: u64 = 1_000_000_000;

    fn alloc(id: &str, devices: Vec<AllocatedDevice>) -> Allocation {
        Allocation {
            id: id.to_string(),
            resource: "tessera.io/share".to_string(),
            container: ContainerIdentity::of_pod("ns", "pod", "c"),
            source: Source::Kubelet,
            created_unix_ns: unix_ns(),
            devices,
            claim: None,
        }
    }

    /// Allocation `id` of `devices`, its directory created under `tmp`: the directories, the
    /// allocation.
    fn created(tmp: &crate::state::mount::TestDir, id: &str, devices: Vec<AllocatedDevice>) -> (AllocDirs, Allocation) {
        let dirs = AllocDirs::new(tmp.path());
        let a = alloc(id, devices);
        dirs.create(&a).unwrap();
        (dirs, a)
    }

    /// A container process: its own handle on the region (dropping it = the process exiting).
    struct Proc {
        region: Region,
        slot: Slot,
    }

    impl Proc {
        fn join(dirs: &AllocDirs, id: &str) -> Proc {
            let region = Region::open_or_create(&dirs.region_path(id)).unwrap();
            let slot = region.join().unwrap();
            Proc { region, slot }
        }

        fn dev(&self, uuid: &str) -> usize {
            self.region.device(uuid).unwrap()
        }

        fn work(&self, uuid: &str, launches: u64, gpu_ns: u64, throttled_ns: u64) {
            let d = self.dev(uuid);
            for _ in 0..launches {
                self.region.record_launch(self.slot, d);
            }
            self.region.record_gpu_time(self.slot, d, gpu_ns);
            self.region.record_throttled(self.slot, d, throttled_ns);
        }
    }

    #[test]
    fn first_sample_then_rates_and_shares_of_one_gpu() {
        let tmp = crate::state::mount::TestDir::new();
        let dirs = AllocDirs::new(tmp.path());
        let a = alloc(
            "a1",
            vec![
                dev("GPU-aaaa::0", "GPU-aaaa", Some(1 << 30), Some(20)),
                dev("GPU-aaaa::1", "GPU-aaaa", Some(1 << 30), Some(30)),
                dev("MIG-bbbb", "MIG-bbbb", None, None),
            ],
        );
        dirs.create(&a).unwrap();
        let p = Proc::join(&dirs, "a1");
        let ga = p.dev("GPU-aaaa");
        p.region.try_reserve(p.slot, ga, 300 << 20, Some(2 << 30)).unwrap();
        p.region.release(p.slot, ga, 100 << 20);
        assert!(p.region.try_reserve(p.slot, ga, 4 << 30, Some(2 << 30)).is_err());
        p.work("GPU-aaaa", 10, SEC / 2, 1000);

        let mut s = UsageSampler::new();
        let r = s.sample(std::slice::from_ref(&a), &dirs, 100 * SEC);
        assert!(r.time_unix_ns > 0);
        assert_eq!(r.containers.len(), 1);
        let c = &r.containers[0];
        assert_eq!(c.allocation_id, "a1");
        assert_eq!(c.resource, "tessera.io/share");
        assert_eq!(c.container.pod_name.as_deref(), Some("pod"));
        assert_eq!(c.processes, 1);
        assert_eq!(c.devices.len(), 2, "one per physical device");
        let d = &c.devices[0];
        assert_eq!(d.device_id, "GPU-aaaa::0,GPU-aaaa::1");
        assert_eq!(d.uuid, "GPU-aaaa");
        assert_eq!(d.memory_used, 200 << 20);
        assert_eq!(d.memory_peak, 300 << 20);
        assert_eq!(d.memory_limit, Some(2 << 30));
        assert_eq!(d.sm_limit_percent, Some(50));
        assert_eq!((d.launches, d.gpu_time_ns, d.throttled_ns, d.oom_denials), (10, SEC / 2, 1000, 1));
        assert_eq!((d.window_ns, d.sm_achieved_percent, d.launches_per_second), (0, 0.0, 0.0));
        // The MIG device was never touched by the container: zeros, its limits from the record.
        let m = &c.devices[1];
        assert_eq!((m.device_id.as_str(), m.uuid.as_str()), ("MIG-bbbb", "MIG-bbbb"));
        assert_eq!((m.memory_used, m.memory_peak, m.memory_limit, m.sm_limit_percent), (0, 0, None, None));
        assert_eq!((m.launches, m.gpu_time_ns), (0, 0));

        // 2 s later: 40 more launches and 0.5 s more GPU time: 20 launches/s, 25 %.
        p.work("GPU-aaaa", 40, SEC / 2, 0);
        let r = s.sample(std::slice::from_ref(&a), &dirs, 102 * SEC);
        let d = &r.containers[0].devices[0];
        assert_eq!(d.window_ns, 2 * SEC);
        assert_eq!((d.launches, d.gpu_time_ns), (50, SEC));
        assert_eq!(d.launches_per_second, 20.0);
        assert_eq!(d.sm_achieved_percent, 25.0);
    }

    #[test]
    fn counters_of_exited_processes_are_kept() {
        let tmp = crate::state::mount::TestDir::new();
        let (dirs, a) = created(&tmp, "a2", vec![dev("GPU-cccc", "GPU-cccc", None, Some(50))]);
        let p1 = Proc::join(&dirs, "a2");
        let p2 = Proc::join(&dirs, "a2");
        let d1 = p1.dev("GPU-cccc");
        p1.region.try_reserve(p1.slot, d1, 1000, None).unwrap();
        p1.work("GPU-cccc", 3, 300, 30);
        p2.work("GPU-cccc", 4, 400, 40);

        let mut s = UsageSampler::new();
        let r = s.sample(std::slice::from_ref(&a), &dirs, SEC);
        let c = &r.containers[0];
        assert_eq!(c.processes, 2);
        assert_eq!((c.devices[0].launches, c.devices[0].gpu_time_ns, c.devices[0].throttled_ns), (7, 700, 70));
        assert_eq!(c.devices[0].memory_used, 1000);

        // p1 does a little more, then exits: the sampler reaps it; its memory goes back, its
        // final counters (4 launches, not the 3 last sampled) stay in the totals.
        p1.work("GPU-cccc", 1, 100, 0);
        drop(p1);
        p2.work("GPU-cccc", 1, 100, 0);
        let r = s.sample(std::slice::from_ref(&a), &dirs, 2 * SEC);
        let c = &r.containers[0];
        assert_eq!(c.processes, 1);
        let d = &c.devices[0];
        assert_eq!(d.memory_used, 0);
        assert_eq!(d.memory_peak, 1000);
        assert_eq!((d.launches, d.gpu_time_ns, d.throttled_ns), (9, 900, 70), "exact, nothing lost");
        assert_eq!(d.window_ns, SEC);
        assert_eq!(d.launches_per_second, 2.0);

        // A new process takes a slot (perhaps p1's): its counters add on top.
        let p3 = Proc::join(&dirs, "a2");
        p3.work("GPU-cccc", 5, 500, 5);
        drop(p2);
        let r = s.sample(std::slice::from_ref(&a), &dirs, 3 * SEC);
        let d = &r.containers[0].devices[0];
        assert_eq!(r.containers[0].processes, 1);
        assert_eq!((d.launches, d.gpu_time_ns, d.throttled_ns), (14, 1400, 75));
        assert_eq!(d.sm_achieved_percent, 500.0 / SEC as f64 * 100.0);
        drop(p3);
        let r = s.sample(std::slice::from_ref(&a), &dirs, 4 * SEC);
        let d = &r.containers[0].devices[0];
        assert_eq!(r.containers[0].processes, 0);
        assert_eq!((d.launches, d.gpu_time_ns, d.throttled_ns), (14, 1400, 75));
        assert_eq!((d.launches_per_second, d.sm_achieved_percent), (0.0, 0.0));
    }

    #[test]
    fn short_processes_between_samples_are_counted_exactly_by_every_sampler() {
        let tmp = crate::state::mount::TestDir::new();
        let (dirs, a) = created(&tmp, "a3", vec![dev("GPU-ffff", "GPU-ffff", None, Some(50))]);
        let mut top = UsageSampler::new();
        assert_eq!(top.sample(std::slice::from_ref(&a), &dirs, SEC).containers[0].devices[0].launches, 0);
        // Two processes start and end between two samples of `top`.
        for launches in [500, 300] {
            let p = Proc::join(&dirs, "a3");
            p.work("GPU-ffff", launches, launches * 10, 1);
            drop(p);
        }
        let d = &top.sample(std::slice::from_ref(&a), &dirs, 2 * SEC).containers[0].devices[0];
        assert_eq!((d.launches, d.gpu_time_ns, d.throttled_ns), (800, 8000, 2));
        // A sampler that starts later (the metrics endpoint) sees the same totals.
        let mut metrics = UsageSampler::new();
        let d = &metrics.sample(std::slice::from_ref(&a), &dirs, 3 * SEC).containers[0].devices[0];
        assert_eq!((d.launches, d.gpu_time_ns, d.throttled_ns), (800, 8000, 2));
    }

    #[test]
    fn new_limits_show_at_the_next_sample_and_counters_carry_on() {
        let tmp = crate::state::mount::TestDir::new();
        let (dirs, mut a) = created(&tmp, "a5", vec![dev("GPU-abcd::0", "GPU-abcd", Some(1 << 30), Some(20))]);
        let p = Proc::join(&dirs, "a5");
        p.work("GPU-abcd", 5, 100, 0);
        let mut s = UsageSampler::new();
        let d = &s.sample(std::slice::from_ref(&a), &dirs, SEC).containers[0].devices[0];
        assert_eq!((d.memory_limit, d.sm_limit_percent, d.launches), (Some(1 << 30), Some(20), 5));
        // The limits change (SetLimits) and a second share of the GPU joins the allocation.
        a.devices[0].memory_limit = Some(2 << 30);
        a.devices.push(dev("GPU-abcd::1", "gpu-ABCD", Some(1 << 30), Some(30)));
        p.work("GPU-abcd", 5, 100, 0);
        let c = &s.sample(std::slice::from_ref(&a), &dirs, 2 * SEC).containers[0];
        assert_eq!(c.devices.len(), 1, "one physical device, whatever the spelling");
        let d = &c.devices[0];
        assert_eq!(d.device_id, "GPU-abcd::0,GPU-abcd::1");
        assert_eq!((d.memory_limit, d.sm_limit_percent), (Some(3 << 30), Some(50)));
        assert_eq!((d.launches, d.launches_per_second), (10, 5.0), "the counters carry on");
    }

    #[test]
    fn missing_regions_are_left_out_and_removed_allocations_forgotten() {
        let tmp = crate::state::mount::TestDir::new();
        let dirs = AllocDirs::new(tmp.path());
        let a = alloc("ok", vec![dev("GPU-dddd", "GPU-dddd", None, None)]);
        let gone = alloc("gone", vec![dev("GPU-eeee", "GPU-eeee", None, None)]);
        dirs.create(&a).unwrap();
        let mut s = UsageSampler::new();
        let both = [gone.clone(), a.clone()];
        let r = s.sample(&both, &dirs, SEC);
        assert_eq!(r.containers.iter().map(|c| c.allocation_id.as_str()).collect::<Vec<_>>(), ["ok"]);
        assert!(!dirs.region_path("gone").exists(), "the sampler creates no region");
        // A region that is not a region: left out too.
        std::fs::create_dir_all(dirs.dir("gone")).unwrap();
        std::fs::write(dirs.region_path("gone"), b"junk").unwrap();
        let r = s.sample(&both, &dirs, 2 * SEC);
        assert_eq!(r.containers.len(), 1);
        // Once it exists, it is sampled (first sample: window 0).
        std::fs::remove_file(dirs.region_path("gone")).unwrap();
        dirs.create(&gone).unwrap();
        let r = s.sample(&both, &dirs, 3 * SEC);
        assert_eq!(r.containers.len(), 2);
        assert_eq!(r.containers[0].devices[0].window_ns, 0);
        assert_eq!(r.containers[1].devices[0].window_ns, SEC);
        // Dropped from the list: forgotten (a later return starts afresh).
        s.sample(std::slice::from_ref(&a), &dirs, 4 * SEC);
        assert_eq!(s.tracked.len(), 1);
        let r = s.sample(&both, &dirs, 5 * SEC);
        assert_eq!(r.containers[0].devices[0].window_ns, 0);
    }
}
