//! The allocation store under `kill -9`: a child process inserts and removes records as fast as it
//! can, printing each id once the call has returned (committed); the parent kills it at a random
//! moment, reopens the store and checks that every committed change is there, whole, and nothing
//! else is (but the one change that was in flight).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_daemon::state::{AllocatedDevice, Allocation, ContainerIdentity, Source, Store};
use tessera_region::{ComputeMode, Priority};

const ROLE: &str = "TESSERA_STATE_CRASH_CHILD";
const ROUNDS: usize = 16;
/// The child keeps at most this many of its records; past it, each insert is followed by a removal.
const LIVE: usize = 16;

/// The record for `id`, all of it derived from the id, so a reader can tell a whole record.
fn record(id: &str) -> Allocation {
    let n = u64::from_str_radix(id, 16).unwrap();
    Allocation {
        id: id.to_string(),
        resource: "tessera.io/share".to_string(),
        container: ContainerIdentity {
            pod_namespace: Some("crash".to_string()),
            pod_name: Some(format!("pod-{id}")),
            pod_uid: Some(format!("uid-{n}")),
            container_name: Some("main".to_string()),
            container_id: None,
        },
        source: Source::Kubelet,
        created_unix_ns: n,
        devices: (0..(n % 4 + 1))
            .map(|i| AllocatedDevice {
                device_id: format!("GPU-{id}::{i}"),
                physical_uuid: format!("GPU-{id}"),
                memory_limit: Some((i + 1) << 30),
                sm_percent: Some(10 + i as u32),
                priority: Priority::High,
                compute_mode: ComputeMode::WorkConserving,
                whole: false,
                preemptible: false,
            })
            .collect(),
        claim: None,
    }
}

/// A small PRNG (xorshift64*), seeded from the clock and printed so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Runs only in the child: opens the store, then inserts and removes forever.
#[test]
fn crash_child_entry() {
    let Some(dir) = std::env::var_os(ROLE) else { return };
    let mut store = Store::open(Path::new(&dir)).unwrap();
    let mut live: Vec<String> = store.list().map(|a| a.id.clone()).collect();
    println!("ready");
    loop {
        let id = Allocation::new_id();
        store.insert(&record(&id)).unwrap();
        println!("I {id}");
        live.push(id);
        if live.len() > LIVE {
            let old = live.remove(0);
            store.remove(&old).unwrap().unwrap();
            println!("R {old}");
        }
    }
}

/// What the child reported, in order: `(true, id)` a committed insert, `(false, id)` a committed
/// removal.
fn committed(out: &str) -> Vec<(bool, String)> {
    // Only whole lines: a line cut by the kill was not printed.
    let whole = match out.rfind('\n') {
        Some(end) => &out[..=end],
        None => "",
    };
    let mut events = Vec::new();
    for line in whole.lines() {
        if let Some(id) = line.strip_prefix("I ") {
            events.push((true, id.to_string()));
        } else if let Some(id) = line.strip_prefix("R ") {
            events.push((false, id.to_string()));
        }
    }
    events
}

fn dir_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    v.sort();
    v
}

#[test]
fn committed_records_survive_kill_9() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir: PathBuf = tmp.path().join("state");
    let seed = tessera_daemon::state::record::unix_ns() | 1;
    eprintln!("seed {seed}");
    let mut rng = Rng(seed);
    // What the store holds after the previous round.
    let mut expected: BTreeSet<String> = BTreeSet::new();
    let (mut total_inserted, mut total_removed, mut in_flight_seen, mut tmp_left) = (0, 0, 0, 0);

    for round in 0..ROUNDS {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["crash_child_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, &dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut head = String::new();
        let started = Instant::now();
        loop {
            head.clear();
            assert!(out.read_line(&mut head).unwrap() > 0, "round {round}: the child exited before it was ready");
            if head.trim_end().ends_with("ready") {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "round {round}: the child never got ready");
        }
        let delay = rng.range(5, 200);
        std::thread::sleep(Duration::from_millis(delay));
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert!(!status.success(), "round {round}: the child was not killed: {status}");
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        let events = committed(&rest);

        // The model: the child's own list (it starts from the store's records, by id), replayed.
        // Every committed removal must be the one the child's rule picks.
        let mut live: Vec<String> = expected.iter().cloned().collect();
        let (mut inserted, mut removed) = (0, 0);
        let mut next_is_removal = false;
        for (insert, id) in &events {
            if *insert {
                assert!(!next_is_removal, "round {round}: an insert where a removal was due");
                assert!(expected.insert(id.clone()), "round {round}: id {id} inserted twice");
                live.push(id.clone());
                inserted += 1;
                next_is_removal = live.len() > LIVE;
            } else {
                assert!(next_is_removal, "round {round}: a removal that was not due");
                assert_eq!(&live.remove(0), id, "round {round}: removed another record than the oldest");
                assert!(expected.remove(id), "round {round}: removed {id}, which was not there");
                removed += 1;
                next_is_removal = false;
            }
        }

        // At most the journal's compaction can be caught half done.
        let tmp_before = dir_files(&dir).iter().filter(|f| f.ends_with(".tmp")).count();
        assert!(tmp_before <= 1, "round {round}: {:?}", dir_files(&dir));
        tmp_left += tmp_before;
        let store = Store::open(&dir).unwrap_or_else(|e| panic!("round {round}: open failed: {e}"));
        assert_eq!(store.removed_tmp().len(), tmp_before, "round {round}");
        assert!(store.set_aside().is_empty(), "round {round}: corrupt records: {:?}", store.set_aside());
        let actual: BTreeSet<String> = store.list().map(|a| a.id.clone()).collect();
        assert_eq!(actual.len(), store.len());
        for a in store.list() {
            assert_eq!(a, &record(&a.id), "round {round}: record {} is not whole", a.id);
        }
        // The journal and the lock, nothing half-written left over.
        assert_eq!(dir_files(&dir), ["allocations.journal", "lock"], "round {round}");

        let missing: Vec<_> = expected.difference(&actual).cloned().collect();
        let extra: Vec<_> = actual.difference(&expected).cloned().collect();
        // At the kill at most one call was in flight, and the child's rule says which kind: a
        // removal of the oldest live record, or an insert of a new id. Either may or may not have
        // reached the disk; a committed change is never undone.
        let in_flight_ok = match (missing.as_slice(), extra.as_slice()) {
            ([], []) => true,
            ([gone], []) => next_is_removal && gone == &live[0],
            ([], [_new]) => !next_is_removal,
            _ => false,
        };
        assert!(
            in_flight_ok,
            "round {round} (seed {seed}, {delay} ms): committed but missing {missing:?}, never committed {extra:?}"
        );
        if !missing.is_empty() || !extra.is_empty() {
            in_flight_seen += 1;
        }
        total_inserted += inserted;
        total_removed += removed;
        eprintln!(
            "round {round}: killed after {delay} ms: {inserted} inserts, {removed} removals committed; \
             {} records; in flight: -{missing:?} +{extra:?}",
            actual.len()
        );
        expected = actual;
        drop(store);
    }
    eprintln!(
        "{total_inserted} inserts, {total_removed} removals committed; {in_flight_seen} rounds caught a call in flight; \
         {tmp_left} leftover temporary files cleaned"
    );
    assert!(total_inserted > ROUNDS, "the child committed too little to test anything: {total_inserted}");
    assert!(total_removed > 0, "no removal was ever committed");
}
