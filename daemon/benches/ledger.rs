//! What publishing the ledger costs tesserad: one publication (every allocation's view of the
//! others on its GPU) over N allocations on 8 GPUs, every GPU with a low-priority allocation (so
//! every allocation is published; a node without one publishes nothing), each container's region
//! naming its GPU and showing new activity every round. Baseline, interleaved in the same rounds:
//! the usage sampler's pass over the same regions (what a `/metrics` scrape or `tessera top`
//! reads). `cargo bench -p tessera-daemon --bench ledger`; `TESSERA_LEDGER_ROUNDS` (300).

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use tessera_daemon::state::{AllocDirs, AllocatedDevice, Allocation, ContainerIdentity, Source};
use tessera_daemon::usage::UsageSampler;
use tessera_region::ledger::{LEDGER_FILE, Ledger, Member, Publisher};
use tessera_region::{ComputeMode, Priority, Region};

const GPUS: usize = 8;

fn cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn p(v: &mut [Duration], q: f64) -> f64 {
    v.sort();
    v[((v.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e6
}

fn run(n: usize, rounds: usize) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dirs = AllocDirs::new(tmp.path());
    let mut allocations = Vec::new();
    let mut opened = Vec::new();
    for i in 0..n {
        let uuid = format!("GPU-00000000-0000-0000-0000-{:012}", i % GPUS);
        let priority = [Priority::High, Priority::Low, Priority::Normal][i % 3];
        let a = Allocation {
            id: format!("{i:016x}"),
            resource: "tessera.io/gpu-share".into(),
            container: ContainerIdentity::default(),
            source: Source::Kubelet,
            created_unix_ns: 0,
            devices: vec![AllocatedDevice {
                device_id: format!("{uuid}::{i}"),
                physical_uuid: uuid.clone(),
                memory_limit: Some(1 << 30),
                sm_percent: Some(10),
                priority,
                compute_mode: ComputeMode::Strict,
                whole: false,
                preemptible: false,
            }],
            claim: None,
        };
        let dir = dirs.dir(&a.id);
        std::fs::create_dir_all(&dir).expect("dir");
        let region = Region::open_or_create(&dirs.region_path(&a.id)).expect("region");
        region.device(&uuid).expect("device");
        let ledger = Ledger::create(&dir.join(LEDGER_FILE)).expect("ledger");
        opened.push((a.id.clone(), region, ledger, vec![(uuid, priority)]));
        allocations.push(a);
    }
    let mut publisher = Publisher::new();
    let mut sampler = UsageSampler::new();
    let (mut publish, mut sample) = (Vec::new(), Vec::new());
    let (mut publish_cpu, mut sample_cpu) = (0u64, 0u64);
    for round in 0..rounds {
        // Every container did something since the last look.
        for (_, region, _, _) in &opened {
            let b = region.bucket(0);
            b.high_launches.fetch_add(1, Relaxed);
            b.usage_ppm.store(100_000, Relaxed);
            b.usage_updates.fetch_add(1, Relaxed);
        }
        let members: Vec<Member> =
            opened.iter().map(|(id, region, ledger, devices)| Member { id, region, ledger, devices }).collect();
        let mut timed_publish = || {
            let (t, c) = (Instant::now(), cpu_ns());
            publisher.publish(tessera_region::monotonic_ns(), &members);
            (t.elapsed(), cpu_ns() - c)
        };
        let mut timed_sample = || {
            let (t, c) = (Instant::now(), cpu_ns());
            std::hint::black_box(sampler.sample(&allocations, &dirs, tessera_region::monotonic_ns()));
            (t.elapsed(), cpu_ns() - c)
        };
        // Interleaved, each first in turn.
        let (a, b) = if round % 2 == 0 {
            let a = timed_publish();
            (a, timed_sample())
        } else {
            let b = timed_sample();
            (timed_publish(), b)
        };
        if round >= 10 {
            publish.push(a.0);
            publish_cpu += a.1;
            sample.push(b.0);
            sample_cpu += b.1;
        }
    }
    let counted = (rounds - 10) as f64;
    let (pc, sc) = (publish_cpu as f64 / counted / 1e3, sample_cpu as f64 / counted / 1e3);
    println!(
        "{n:>5} allocations: publish p50 {:>8.1} µs p99 {:>8.1} µs cpu {pc:>8.1} µs ({:.2}% of a core at 100 Hz) | \
         usage sample p50 {:>8.1} µs p99 {:>8.1} µs cpu {sc:>8.1} µs | cpu ratio {:.3}",
        p(&mut publish, 0.5),
        p(&mut publish, 0.99),
        pc * 100.0 / 1e4,
        p(&mut sample, 0.5),
        p(&mut sample, 0.99),
        pc / sc
    );
}

fn main() {
    let rounds = std::env::var("TESSERA_LEDGER_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(300).max(20);
    for n in [10, 100, 1000] {
        run(n, rounds);
    }
}
