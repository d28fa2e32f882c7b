//! What `/proc` says about a host process: when it started (to order processes and to know a pid
//! was not reused), its cgroup paths, whether it maps a given file, its command name. The root
//! is a parameter so tests can lay out a fake `/proc`.

use std::path::{Path, PathBuf};

/// A `/proc` tree.
#[derive(Debug, Clone)]
pub struct ProcFs {
    root: PathBuf,
}

impl Default for ProcFs {
    fn default() -> Self {
        ProcFs { root: PathBuf::from("/proc") }
    }
}

impl ProcFs {
    pub fn at(root: impl Into<PathBuf>) -> ProcFs {
        ProcFs { root: root.into() }
    }

    fn file(&self, pid: u32, name: &str) -> PathBuf {
        self.root.join(pid.to_string()).join(name)
    }

    /// The process's start time (clock ticks since boot, field 22 of `stat`); `None`: gone.
    pub fn start_time(&self, pid: u32) -> Option<u64> {
        parse_start_time(&std::fs::read_to_string(self.file(pid, "stat")).ok()?)
    }

    /// Whether the process is on its way out: a zombie, or exiting (`PF_EXITING` in its flags:
    /// its files, the driver's among them, are being closed). `false` when it is gone.
    pub fn exiting(&self, pid: u32) -> bool {
        std::fs::read_to_string(self.file(pid, "stat")).is_ok_and(|s| parse_exiting(&s))
    }

    /// The paths of every hierarchy in `/proc/<pid>/cgroup` (v1 and v2 lines alike).
    pub fn cgroup_paths(&self, pid: u32) -> Option<Vec<String>> {
        Some(parse_cgroup(&std::fs::read_to_string(self.file(pid, "cgroup")).ok()?))
    }

    /// Whether the process maps the file with device `dev` and inode `ino` (a shim-loaded
    /// process maps its allocation's region; nothing else a tenant writes can make another
    /// process do so).
    pub fn maps_inode(&self, pid: u32, dev: u64, ino: u64) -> bool {
        std::fs::read_to_string(self.file(pid, "maps")).is_ok_and(|m| maps_has(&m, dev, ino))
    }

    /// `comm`, trimmed; empty when unreadable.
    pub fn command(&self, pid: u32) -> String {
        std::fs::read_to_string(self.file(pid, "comm")).map(|c| c.trim().to_string()).unwrap_or_default()
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The process's pid in its own (innermost) PID namespace: the last of `NSpid` in its
    /// `status` (the pid itself where the kernel predates `NSpid`); `None` when it is gone.
    pub fn inner_pid(&self, pid: u32) -> Option<u32> {
        let status = std::fs::read_to_string(self.file(pid, "status")).ok()?;
        Some(parse_inner_pid(&status).unwrap_or(pid))
    }

    /// The host pids (pids of this `/proc`) of the processes a region's slots name, each slot
    /// as `(pid, host pid)`: the pid as the process sees itself, and the host pid when someone
    /// recorded it (0: not known; the shim does not know it inside a container). A slot's
    /// process is the one that maps the region's file (`dev`, `ino`: only the allocation's own
    /// processes do) and whose innermost pid is the slot's: a process in this namespace is found
    /// at its own pid, one in a container's PID namespace by one pass over `/proc`. Each host
    /// process is named once, for one slot; slots whose process is gone or hidden are left out.
    pub fn host_pids(&self, slots: &[(u32, u32)], dev: u64, ino: u64) -> Vec<u32> {
        let mut found: Vec<u32> = Vec::with_capacity(slots.len());
        let mut wanted: Vec<u32> = Vec::new();
        let is_it = |host: u32, pid: u32| self.inner_pid(host) == Some(pid) && self.maps_inode(host, dev, ino);
        for &(pid, host) in slots {
            if host != 0 && !found.contains(&host) && self.maps_inode(host, dev, ino) {
                found.push(host);
            } else if !found.contains(&pid) && is_it(pid, pid) {
                found.push(pid);
            } else {
                wanted.push(pid);
            }
        }
        if wanted.is_empty() {
            return found;
        }
        let Ok(dir) = std::fs::read_dir(&self.root) else { return found };
        for entry in dir.flatten() {
            let Some(host) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            if found.contains(&host) {
                continue;
            }
            let Some(inner) = self.inner_pid(host) else { continue };
            if let Some(i) = wanted.iter().position(|&w| w == inner)
                && self.maps_inode(host, dev, ino)
            {
                found.push(host);
                wanted.swap_remove(i);
                if wanted.is_empty() {
                    break;
                }
            }
        }
        found
    }
}

/// The last pid of a `status` text's `NSpid:` line (the innermost namespace's).
fn parse_inner_pid(status: &str) -> Option<u32> {
    status.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_ascii_whitespace().last()?.parse().ok()
}

/// Field 22 of `/proc/<pid>/stat`, counted after the command's closing parenthesis (the command
/// may hold spaces and parentheses).
pub fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ")": field 3 (state) is the first; start time is field 22.
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Whether a `stat` line is a zombie's or dead process's (state `Z`, `X`, `x`) or an exiting
/// one's (`PF_EXITING`, 0x4, in field 9).
pub fn parse_exiting(stat: &str) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Some(close) = stat.rfind(')') else { return false };
    let mut f = stat[close + 1..].split_ascii_whitespace();
    let state = f.next().unwrap_or("");
    // After the state: ppid, pgrp, session, tty_nr, tpgid, then flags (field 9).
    let flags = f.nth(5).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
}

/// The path of each `hierarchy:controllers:path` line.
pub fn parse_cgroup(text: &str) -> Vec<String> {
    text.lines().filter_map(|l| l.splitn(3, ':').nth(2)).filter(|p| !p.is_empty()).map(str::to_string).collect()
}

/// Whether a `maps` text has a mapping of (dev, ino). Lines: `start-end perms offset maj:min inode path`.
fn maps_has(maps: &str, dev: u64, ino: u64) -> bool {
    let (major, minor) = (dev_major(dev), dev_minor(dev));
    maps.lines().any(|l| {
        let mut f = l.split_ascii_whitespace();
        let (Some(d), Some(i)) = (f.nth(3), f.next()) else { return false };
        if i.parse::<u64>().ok() != Some(ino) {
            return false;
        }
        let Some((ma, mi)) = d.split_once(':') else { return false };
        u64::from_str_radix(ma, 16).ok() == Some(major) && u64::from_str_radix(mi, 16).ok() == Some(minor)
    })
}

/// glibc's `major()` of a `dev_t`.
fn dev_major(dev: u64) -> u64 {
    ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0000_0fff)
}

/// glibc's `minor()` of a `dev_t`.
fn dev_minor(dev: u64) -> u64 {
    ((dev >> 12) & 0xffff_ff00) | (dev & 0x0000_00ff)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn a_slots_host_pid_is_the_process_that_maps_the_region_under_that_inner_pid() {
        let root = tempfile::tempdir().unwrap();
        let (dev, ino) = ((0xfd << 8) | 1, 12345);
        let region = "7f0000000000-7f0000200000 rw-s 00000000 fd:01 12345 /run/tessera/alloc/region\n";
        let other = "7f0000000000-7f0000200000 rw-s 00000000 fd:01 999 /elsewhere\n";
        let proc = |pid: u32, nspid: &str, maps: &str| {
            let d = root.path().join(pid.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("status"), format!("Name:\tx\nPid:\t{pid}\nNSpid:\t{nspid}\n")).unwrap();
            std::fs::write(d.join("maps"), maps).unwrap();
        };
        proc(1, "1", other); // the host's init: pid 1, but not the allocation's
        proc(100, "100", region); // a host process of the allocation
        proc(200, "200\t1", region); // pid 1 of a container, the allocation's
        proc(300, "300\t1", other); // pid 1 of another container
        proc(500, "500\t7", region);
        let fs = ProcFs::at(root.path());
        assert_eq!(fs.inner_pid(200), Some(1));
        assert_eq!(fs.inner_pid(100), Some(100));
        assert_eq!(fs.inner_pid(9999), None, "gone");

        let mut got = fs.host_pids(&[(1, 0), (100, 0)], dev, ino);
        got.sort_unstable();
        assert_eq!(got, vec![100, 200], "container pid 1 is host pid 200, not the host's init");
        proc(400, "400\t1", region); // pid 1 of a second container sharing the allocation
        let mut got = fs.host_pids(&[(1, 0), (1, 0), (100, 0)], dev, ino);
        got.sort_unstable();
        assert_eq!(got, vec![100, 200, 400], "two containers' pid 1, each named once");
        assert_eq!(fs.host_pids(&[(7, 500)], dev, ino), vec![500], "a recorded host pid that maps the region");
        assert_eq!(fs.host_pids(&[(7, 300)], dev, ino), vec![500], "a recorded host pid that does not: resolved again");
        assert!(fs.host_pids(&[(42, 0)], dev, ino).is_empty(), "a slot whose process is gone");
        assert!(fs.host_pids(&[(4242, 1)], dev, ino).is_empty(), "a slot forged to name the host's init");
        assert!(fs.host_pids(&[(4242, 300)], dev, ino).is_empty(), "or another container's process");
        assert!(fs.host_pids(&[(1, 0)], dev, 999 + 1).is_empty(), "another region");
    }

    #[test]
    fn start_time_survives_odd_command_names() {
        let stat = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_start_time(stat), Some(987_654));
        assert_eq!(parse_start_time("garbage"), None);
        let me = ProcFs::default();
        assert!(me.start_time(std::process::id()).is_some());
        assert_eq!(me.start_time(u32::MAX), None, "no such process");
    }

    #[test]
    fn a_zombie_or_exiting_process_is_on_its_way_out() {
        let line = |state: &str, flags: u64| {
            format!("7 (a b) {state} 1 7 7 0 -1 {flags} 100 0 0 0 1 2 0 0 20 0 1 0 99 1000 10")
        };
        assert!(!parse_exiting(&line("S", 0x40_0100)), "a sleeping process");
        assert!(parse_exiting(&line("Z", 0x40_0100)), "a zombie");
        assert!(parse_exiting(&line("D", 0x40_0104)), "PF_EXITING: closing its files");
        assert!(!parse_exiting("garbage"));
        assert!(!ProcFs::default().exiting(std::process::id()), "this test is not exiting");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not waited for: a zombie once it ends.
        while !ProcFs::default().exiting(pid) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(!ProcFs::default().exiting(pid), "gone");
    }

    #[test]
    fn cgroup_lines_of_v1_and_v2() {
        let text = "12:pids:/kubepods/pod1/abc\n0::/system.slice/cri-containerd-abc.scope\n1:name=systemd:\n";
        assert_eq!(parse_cgroup(text), ["/kubepods/pod1/abc", "/system.slice/cri-containerd-abc.scope"]);
    }

    #[test]
    fn a_mapped_file_is_found_by_device_and_inode() {
        let procfs = ProcFs::default();
        let me = std::process::id();
        let exe = std::fs::metadata("/proc/self/exe").unwrap();
        assert!(procfs.maps_inode(me, exe.dev(), exe.ino()), "this test's own executable is mapped");
        assert!(!procfs.maps_inode(me, exe.dev(), exe.ino() ^ 0x5a5a_5a5a), "another inode is not");
        let tmp = tempfile::NamedTempFile::new().unwrap();
        let meta = tmp.as_file().metadata().unwrap();
        assert!(!procfs.maps_inode(me, meta.dev(), meta.ino()), "an open, unmapped file is not");
        let maps = "7f00-7f01 rw-s 00000000 00:2a 123 /dev/shm/r\n";
        let dev = 0x2a;
        assert!(maps_has(maps, dev, 123));
        assert!(!maps_has(maps, dev, 124));
    }
}
