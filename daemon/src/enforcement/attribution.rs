//! Which allocation a GPU process belongs to.
//!
//! - By cgroup: a process whose `/proc/<pid>/cgroup` names an allocation's container id belongs
//!   to it. The id comes from the daemon's record (the pod-resources API or an adopted owner
//!   record) or the owner record the hook wrote (`<runtime_dir>/alloc/<id>/owner`). Runtimes put
//!   the id in the cgroup path as a whole component (`/kubepods/…/<id>`, `/docker/<id>`) or as
//!   the tail of one (`cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope`,
//!   `libpod-<id>.scope`, `cri-containerd:<id>`); only those forms match, never a substring.
//! - Else by the cgroup the node API's caller named for the allocation (`tessera alloc --cgroup
//!   PATH`, kept in the allocation's directory as `cgroup`, which only root writes): a process
//!   whose cgroup is PATH or below it belongs to it, the deepest such PATH deciding when several
//!   match (several allocations naming one PATH share it, as a container's allocations do). A
//!   host process that bypasses the shim is found this way; it cannot leave its cgroup without
//!   write access to another's `cgroup.procs`. A container with an allocation of its own is
//!   found by its id first, whatever cgroup it sits under.
//! - Else by the region's process slots, as a hint only: a tenant writes its region, so a slot
//!   naming a pid counts only when that process really maps the allocation's region file (same
//!   device and inode in `/proc/<pid>/maps`). A tenant can put any pid in its slots; it cannot
//!   make another process map its region.
//!
//! - Else as it was last seen ([`Seen`]): a process (pid and start time) attributed at an
//!   earlier poll keeps that attribution for as long as NVML lists it and one of its allocations
//!   lives. A process that exits is still listed by the driver for a moment while its contexts
//!   are torn down, after its mappings are gone and its region slot reaped; and a process cannot
//!   shed its allocation by unmapping its region.
//!
//! A process may belong to several allocations (one container asking for two resources); on a
//! device, it counts against those of them that hold the device, whose limits add up. A process
//! that belongs to allocations none of which holds its device counts against them with a limit
//! of 0: it holds memory where its container was given none.

use std::collections::{HashMap, HashSet};

use super::decision::ProcKey;
use crate::state::Allocation;

/// An allocation's region file, as `stat` names it.
pub type FileId = (u64, u64);

/// One allocation, as attribution needs it.
#[derive(Debug, Clone)]
pub struct Entry {
    pub id: String,
    /// Per physical device (UUID, lowercase): the memory limit; `None`: unlimited.
    pub limits: Vec<(String, Option<u64>)>,
}

/// How a process was found to belong to its allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Cgroup,
    Region,
}

/// The allocations each process was found to belong to, by (pid, start time), while NVML lists
/// it: a pid reused by another process is another key.
#[derive(Debug, Default)]
pub struct Seen {
    owners: HashMap<ProcKey, Vec<String>>,
}

/// What [`Seen`] recalls of a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recall {
    /// Never seen attributed.
    Never,
    /// Seen attributed to allocations all released since.
    Released,
    /// Seen attributed: its allocations still live (indices in the index, ascending).
    Owners(Vec<usize>),
}

impl Seen {
    /// Remembers that `process` belongs to `owners` (indices of `index`).
    pub fn remember(&mut self, index: &Index, process: ProcKey, owners: &[usize]) {
        let ids: Vec<String> = owners.iter().map(|&i| index.entry(i).id.clone()).collect();
        if self.owners.get(&process) != Some(&ids) {
            self.owners.insert(process, ids);
        }
    }

    pub fn recall(&self, index: &Index, process: ProcKey) -> Recall {
        let Some(ids) = self.owners.get(&process) else { return Recall::Never };
        let mut owners: Vec<usize> = ids.iter().filter_map(|id| index.position(id)).collect();
        owners.sort_unstable();
        owners.dedup();
        if owners.is_empty() { Recall::Released } else { Recall::Owners(owners) }
    }

    /// Forgets the processes NVML no longer lists.
    pub fn retain_listed(&mut self, listed: &HashSet<ProcKey>) {
        self.owners.retain(|k, _| listed.contains(k));
    }
}

/// The allocations of the node, indexed for attribution.
#[derive(Debug, Default)]
pub struct Index {
    entries: Vec<Entry>,
    /// Allocation id -> entry.
    by_id: HashMap<String, usize>,
    /// Container id (lowercase) -> entries.
    by_container: HashMap<String, Vec<usize>>,
    /// Host pid a region slot names -> (entry, the region file).
    claims: HashMap<u32, Vec<(usize, FileId)>>,
    /// Cgroup paths named by node API callers -> entries.
    cgroups: HashMap<String, Vec<usize>>,
}

/// The name of the file, in an allocation's directory, holding the cgroup its processes run in.
pub const CGROUP_FILE: &str = "cgroup";

/// A cgroup path as `tessera alloc --cgroup` takes it (`AllocateRequest.cgroup`): `None` for
/// none; an error saying what is wrong. The path is the one `/proc/<pid>/cgroup` shows (from the
/// hierarchy's root, as in `/system.slice/fn-42.scope`): absolute, normalized, not the root
/// itself (every process of the node would be the allocation's).
pub fn cgroup_arg(text: &str) -> Result<Option<String>, String> {
    let path = text.trim();
    let example = "as /proc/PID/cgroup shows it, such as /system.slice/fn-42.scope";
    if path.is_empty() {
        return Ok(None);
    }
    if path.len() > 4096 || path.chars().any(char::is_control) {
        return Err("cgroup: at most 4096 bytes, no control characters".into());
    }
    if !path.starts_with('/') {
        return Err(format!("cgroup: {path:?} is not absolute; give the cgroup's path {example}"));
    }
    if path.starts_with("/sys/fs/cgroup") {
        return Err(format!(
            "cgroup: {path:?} is a file system path; give the cgroup's path {example} (without the mount point)"
        ));
    }
    if path == "/" {
        return Err("cgroup: \"/\" is the root cgroup: every process of the node would be this allocation's; name the cgroup its processes alone run in".into());
    }
    if path.ends_with('/') || path[1..].split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err(format!(
            "cgroup: {path:?} is not a normalized path (no empty, \".\" or \"..\" parts, no trailing \"/\")"
        ));
    }
    Ok(Some(path.to_owned()))
}

/// The cgroup recorded in allocation directory `dir`, if any (checked as [`cgroup_arg`]).
pub fn read_cgroup(dir: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(CGROUP_FILE)).ok()?;
    cgroup_arg(&text).ok().flatten()
}

/// Records `cgroup` in allocation directory `dir` (a whole file, replaced atomically).
pub fn write_cgroup(dir: &std::path::Path, cgroup: &str) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = dir.join(".cgroup.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(format!("{cgroup}\n").as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(CGROUP_FILE))
}

impl Index {
    /// `containers`: more container ids per allocation id (the owner records); `claims`:
    /// (allocation id, host pid, region file) for every joined region slot.
    pub fn new(
        allocations: &[Allocation],
        containers: &HashMap<String, String>,
        claims: &[(String, u32, FileId)],
    ) -> Index {
        Index::with_cgroups(allocations, containers, claims, &HashMap::new())
    }

    /// [`Index::new`], and `cgroups`: the cgroup named for an allocation, by allocation id.
    pub fn with_cgroups(
        allocations: &[Allocation],
        containers: &HashMap<String, String>,
        claims: &[(String, u32, FileId)],
        cgroups: &HashMap<String, String>,
    ) -> Index {
        let mut index = Index::default();
        let mut position = HashMap::new();
        for (i, a) in allocations.iter().enumerate() {
            position.insert(a.id.as_str(), i);
            let limits =
                a.limits().devices.into_iter().map(|d| (d.uuid.to_ascii_lowercase(), d.memory_limit)).collect();
            index.by_id.insert(a.id.clone(), i);
            index.entries.push(Entry { id: a.id.clone(), limits });
            if let Some(c) = cgroups.get(&a.id) {
                index.cgroups.entry(c.clone()).or_default().push(i);
            }
            let ids = a.container.container_id.iter().chain(containers.get(&a.id));
            for c in ids.map(|c| c.trim().to_ascii_lowercase()).filter(|c| !c.is_empty()) {
                let list = index.by_container.entry(c).or_default();
                if !list.contains(&i) {
                    list.push(i);
                }
            }
        }
        for (id, pid, file) in claims {
            if let Some(&i) = position.get(id.as_str())
                && *pid != 0
            {
                index.claims.entry(*pid).or_default().push((i, *file));
            }
        }
        index
    }

    pub fn entry(&self, i: usize) -> &Entry {
        &self.entries[i]
    }

    /// The entry of allocation `id`, if it lives.
    pub fn position(&self, id: &str) -> Option<usize> {
        self.by_id.get(id).copied()
    }

    /// The allocations process `pid` belongs to (indices, ascending) and how that was found;
    /// `None`: it belongs to none. `cgroups` are its cgroup paths; `maps(file)` says whether it
    /// maps that file.
    pub fn owners(&self, pid: u32, cgroups: &[String], maps: impl Fn(FileId) -> bool) -> Option<(Vec<usize>, Via)> {
        let mut found: Vec<usize> = Vec::new();
        for path in cgroups {
            for component in path.split('/') {
                for id in container_ids_in(component) {
                    if let Some(list) = self.by_container.get(&id) {
                        found.extend(list);
                    }
                }
            }
        }
        if found.is_empty() && !self.cgroups.is_empty() {
            // The deepest named cgroup at or above any of the process's.
            let mut deepest: Option<&str> = None;
            for path in cgroups {
                let mut at = path.trim_end_matches('/');
                while !at.is_empty() {
                    if self.cgroups.contains_key(at) {
                        if deepest.is_none_or(|d| at.len() > d.len()) {
                            deepest = Some(at);
                        }
                        break;
                    }
                    at = at.rsplit_once('/').map_or("", |(parent, _)| parent);
                }
            }
            if let Some(list) = deepest.and_then(|d| self.cgroups.get(d)) {
                found.extend(list);
            }
        }
        if !found.is_empty() {
            found.sort_unstable();
            found.dedup();
            return Some((found, Via::Cgroup));
        }
        let mut found: Vec<usize> =
            self.claims.get(&pid)?.iter().filter(|(_, file)| maps(*file)).map(|(i, _)| *i).collect();
        found.sort_unstable();
        found.dedup();
        (!found.is_empty()).then_some((found, Via::Region))
    }

    /// Of `owners`, those holding device `uuid`, and their summed limit there (`None`:
    /// unlimited). None of them holding it: all of them, with a limit of 0.
    pub fn on_device(&self, owners: &[usize], uuid: &str) -> (Vec<usize>, Option<u64>) {
        let uuid = uuid.to_ascii_lowercase();
        let mut holders = Vec::new();
        let mut limit = Some(0u64);
        for &i in owners {
            if let Some((_, l)) = self.entries[i].limits.iter().find(|(u, _)| *u == uuid) {
                holders.push(i);
                limit = limit.zip(*l).map(|(a, b)| a.saturating_add(b));
            }
        }
        if holders.is_empty() { (owners.to_vec(), Some(0)) } else { (holders, limit) }
    }
}

/// The container ids a cgroup path component can carry, lowercase: the component itself, and
/// the tail after the last `-` or `:` of the component without `.scope`.
fn container_ids_in(component: &str) -> impl Iterator<Item = String> + '_ {
    let c = component.strip_suffix(".scope").unwrap_or(component);
    let dash = c.rsplit_once('-').map(|(_, t)| t);
    let colon = c.rsplit_once(':').map(|(_, t)| t);
    std::iter::once(component)
        .chain(Some(c))
        .chain(dash)
        .chain(colon)
        .filter(|s| !s.is_empty())
        .map(str::to_ascii_lowercase)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::tests::dev;
    use crate::state::{ContainerIdentity, Source};

    const CID: &str = "4f2b8c1e9a7d6b5c4f2b8c1e9a7d6b5c4f2b8c1e9a7d6b5c4f2b8c1e9a7d6b5c";

    fn alloc(id: &str, container: Option<&str>, devices: &[(&str, Option<u64>)]) -> Allocation {
        Allocation {
            id: id.into(),
            resource: "tessera.io/gpu".into(),
            container: ContainerIdentity { container_id: container.map(str::to_string), ..Default::default() },
            source: Source::Kubelet,
            created_unix_ns: 1,
            devices: devices.iter().map(|(u, l)| dev(u, u, *l, None)).collect(),
            claim: None,
        }
    }

    fn never(_: FileId) -> bool {
        false
    }

    #[test]
    fn every_runtime_cgroup_form_names_the_container() {
        let a = alloc("a1", None, &[("GPU-x", Some(100))]);
        let owners = HashMap::from([("a1".to_string(), CID.to_string())]);
        let index = Index::new(&[a], &owners, &[]);
        for path in [
            format!("/kubepods/burstable/pod1234/{CID}"),
            format!("/kubepods.slice/kubepods-pod1.slice/cri-containerd-{CID}.scope"),
            format!("/kubepods.slice/kubepods-pod1.slice/crio-{CID}.scope"),
            format!("/system.slice/docker-{CID}.scope"),
            format!("/docker/{CID}"),
            format!("/machine.slice/libpod-{CID}.scope/container"),
            format!("/system.slice/containerd.service/kubepods-besteffort-pod1.slice:cri-containerd:{CID}"),
            format!("/tessera-test/{}", CID.to_ascii_uppercase()),
        ] {
            assert_eq!(index.owners(7, std::slice::from_ref(&path), never), Some((vec![0], Via::Cgroup)), "{path}");
        }
    }

    #[test]
    fn a_substring_or_prefix_of_an_id_is_not_a_match() {
        let a = alloc("a1", Some(CID), &[("GPU-x", Some(100))]);
        let index = Index::new(&[a], &HashMap::new(), &[]);
        for path in [
            format!("/docker/{CID}0"),
            format!("/docker/x{CID}"),
            format!("/docker/{}", &CID[..12]),
            "/".to_string(),
            "/user.slice/session-3.scope".to_string(),
        ] {
            assert_eq!(index.owners(7, std::slice::from_ref(&path), never), None, "{path}");
        }
    }

    #[test]
    fn a_region_slot_counts_only_when_the_process_maps_that_region() {
        let a = alloc("a1", None, &[("GPU-x", Some(100))]);
        let b = alloc("b1", Some(CID), &[("GPU-x", Some(100))]);
        let claims = vec![("a1".to_string(), 42, (1, 10)), ("a1".to_string(), 43, (1, 10))];
        let index = Index::new(&[a, b], &HashMap::new(), &claims);
        // 42 maps a1's region: a1's.
        assert_eq!(index.owners(42, &["/".into()], |f| f == (1, 10)), Some((vec![0], Via::Region)));
        // 43 is named by a1's slots (a tenant can write any pid there) but maps no region: nobody's.
        assert_eq!(index.owners(43, &["/".into()], |f| f == (9, 9)), None);
        // A process in b1's container that a1's slots name: the cgroup decides, b1's.
        let path = format!("/docker/{CID}");
        assert_eq!(index.owners(42, &[path], |_| true), Some((vec![1], Via::Cgroup)));
        // A pid no slot names.
        assert_eq!(index.owners(44, &["/".into()], |_| true), None);
    }

    /// A process found attributed keeps it while listed: its exit (mappings gone, region slot
    /// reaped, the driver still listing it) is no `unattributed_process`.
    #[test]
    fn a_process_seen_attributed_keeps_it_while_listed_and_its_allocation_lives() {
        let a = alloc("a1", None, &[("GPU-x", Some(100))]);
        let b = alloc("b1", None, &[("GPU-x", Some(100))]);
        let claims = vec![("b1".to_string(), 42, (1, 10))];
        let index = Index::new(&[a.clone(), b.clone()], &HashMap::new(), &claims);
        let mut seen = Seen::default();
        // Alive, mapping b1's region: b1's.
        let (owners, via) = index.owners(42, &["/".into()], |f| f == (1, 10)).unwrap();
        assert_eq!((owners.as_slice(), via), (&[1][..], Via::Region));
        seen.remember(&index, (42, 7), &owners);
        // Exiting: no mappings, its slot reaped (no claim), still listed.
        let index = Index::new(&[a.clone(), b.clone()], &HashMap::new(), &[]);
        assert_eq!(index.owners(42, &["/".into()], never), None);
        assert_eq!(seen.recall(&index, (42, 7)), Recall::Owners(vec![1]));
        // Another process on the same pid was never seen.
        assert_eq!(seen.recall(&index, (42, 8)), Recall::Never);
        // b1 released: the memory is known to have been b1's.
        let index = Index::new(std::slice::from_ref(&a), &HashMap::new(), &[]);
        assert_eq!(seen.recall(&index, (42, 7)), Recall::Released);
        // No longer listed: forgotten.
        seen.retain_listed(&HashSet::from([(43, 1)]));
        let index = Index::new(&[a, b], &HashMap::new(), &[]);
        assert_eq!(seen.recall(&index, (42, 7)), Recall::Never);
    }

    /// A host process of a node API allocation that bypasses the shim is found by the cgroup its
    /// caller named: at or below it, component by component, the deepest named one deciding; a
    /// container with an allocation of its own stays its own; nothing above or beside matches.
    #[test]
    fn a_named_cgroup_takes_its_processes_and_nothing_beside_it() {
        let fns = alloc("fns", None, &[("GPU-x", Some(100))]);
        let one = alloc("one", None, &[("GPU-x", Some(50))]);
        let two = alloc("two", None, &[("GPU-x", Some(70))]);
        let pod = alloc("pod", Some(CID), &[("GPU-x", Some(30))]);
        let cgroups = HashMap::from([
            ("fns".to_string(), "/fns".to_string()),
            ("one".to_string(), "/fns/fn-1".to_string()),
            ("two".to_string(), "/fns/fn-1".to_string()),
        ]);
        let index = Index::with_cgroups(&[fns, one, two, pod], &HashMap::new(), &[], &cgroups);
        let of = |paths: &[&str]| {
            let paths: Vec<String> = paths.iter().map(|p| p.to_string()).collect();
            index.owners(9, &paths, never)
        };
        assert_eq!(of(&["/fns/fn-1"]), Some((vec![1, 2], Via::Cgroup)), "one cgroup named twice: both, limits add up");
        assert_eq!(of(&["/fns/fn-1/worker/7"]), Some((vec![1, 2], Via::Cgroup)), "below it");
        assert_eq!(
            of(&["/fns/fn-10"]),
            Some((vec![0], Via::Cgroup)),
            "a sibling whose name starts the same: the parent's"
        );
        assert_eq!(of(&["/fns"]), Some((vec![0], Via::Cgroup)));
        assert_eq!(of(&["/", "/other/fns/fn-1", "/fnsx"]), None, "above, beside, or a prefix of a name: nobody's");
        // cgroup v1: one line per hierarchy; the deepest match on any decides.
        assert_eq!(of(&["/fns", "/fns/fn-1"]), Some((vec![1, 2], Via::Cgroup)));
        // A container with an allocation of its own, under a named cgroup: its own.
        assert_eq!(of(&[&format!("/fns/fn-1/docker-{CID}.scope")]), Some((vec![3], Via::Cgroup)));
    }

    #[test]
    fn a_cgroup_argument_is_checked() {
        assert_eq!(cgroup_arg(""), Ok(None));
        assert_eq!(cgroup_arg(" /system.slice/fn-42.scope\n"), Ok(Some("/system.slice/fn-42.scope".into())));
        for (bad, why) in [
            ("/", "root cgroup"),
            ("system.slice/fn.scope", "not absolute"),
            ("/sys/fs/cgroup/pids/fn", "file system path"),
            ("/a//b", "normalized"),
            ("/a/../b", "normalized"),
            ("/a/", "normalized"),
            ("/a\u{7}b", "control"),
        ] {
            let e = cgroup_arg(bad).unwrap_err();
            assert!(e.starts_with("cgroup: ") && e.contains(why), "{bad:?}: {e}");
        }
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(read_cgroup(tmp.path()), None);
        write_cgroup(tmp.path(), "/fns/fn-1").unwrap();
        assert_eq!(read_cgroup(tmp.path()).as_deref(), Some("/fns/fn-1"));
        std::fs::write(tmp.path().join(CGROUP_FILE), "/\n").unwrap();
        assert_eq!(read_cgroup(tmp.path()), None, "what the argument check refuses is never read");
    }

    #[test]
    fn limits_per_device_add_up_and_a_foreign_device_has_none() {
        let a = alloc("a1", Some(CID), &[("GPU-x", Some(100)), ("MIG-y", Some(7))]);
        let b = alloc("b1", Some(CID), &[("GPU-x", Some(50))]);
        let c = alloc("c1", Some(CID), &[("GPU-z", None)]);
        let index = Index::new(&[a, b, c], &HashMap::new(), &[]);
        let (owners, via) = index.owners(1, &[format!("/docker/{CID}")], never).unwrap();
        assert_eq!((owners.as_slice(), via), (&[0, 1, 2][..], Via::Cgroup));
        assert_eq!(index.on_device(&owners, "gpu-X"), (vec![0, 1], Some(150)), "two allocations, one device");
        assert_eq!(index.on_device(&owners, "MIG-y"), (vec![0], Some(7)), "a MIG device's own limit");
        assert_eq!(index.on_device(&owners, "GPU-z"), (vec![2], None), "no limit");
        assert_eq!(index.on_device(&owners, "GPU-other"), (vec![0, 1, 2], Some(0)), "not theirs: nothing allowed");
    }
}
