//! Paths of the host as seen from a `--host-root` (the host's `/` mounted in the installer's
//! container): symbolic links are followed inside that root, never out of it, so the host's
//! `/var/run -> /run` leads to the host's `/run`, not the container's.

use std::path::{Component, Path, PathBuf};

/// Most links followed while resolving one path (as the kernel's ELOOP limit).
const MAX_LINKS: u32 = 40;

/// `host` (an absolute host path) under `root`, its links resolved inside `root`. Components that
/// do not exist yet are kept as they are (the installer is about to create them).
pub fn resolve(root: &Path, host: &Path) -> std::io::Result<PathBuf> {
    let mut pending: Vec<std::ffi::OsString> = host.components().rev().filter_map(|c| name(c)).collect();
    let mut done = PathBuf::new(); // relative to root
    let mut links = 0;
    while let Some(part) = pending.pop() {
        if part == ".." {
            done.pop();
            continue;
        }
        let candidate = done.join(&part);
        match std::fs::symlink_metadata(root.join(&candidate)) {
            Ok(m) if m.file_type().is_symlink() => {
                links += 1;
                if links > MAX_LINKS {
                    return Err(std::io::Error::other(format!("{}: too many symbolic links", host.display())));
                }
                let target = std::fs::read_link(root.join(&candidate))?;
                if target.is_absolute() {
                    done = PathBuf::new();
                }
                pending.extend(target.components().rev().filter_map(|c| name(c)));
            }
            _ => done = candidate,
        }
    }
    Ok(root.join(done))
}

fn name(c: Component<'_>) -> Option<std::ffi::OsString> {
    match c {
        Component::Normal(n) => Some(n.to_os_string()),
        Component::ParentDir => Some("..".into()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_followed_inside_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("run")).unwrap();
        std::fs::create_dir_all(root.join("var")).unwrap();
        std::os::unix::fs::symlink("/run", root.join("var/run")).unwrap();
        std::os::unix::fs::symlink("../../../../etc", root.join("run/escape")).unwrap();
        assert_eq!(resolve(root, Path::new("/var/run/cdi")).unwrap(), root.join("run/cdi"));
        // `..` never climbs above the root.
        assert_eq!(resolve(root, Path::new("/run/escape/x")).unwrap(), root.join("etc/x"));
        std::os::unix::fs::symlink("/loop", root.join("loop")).unwrap();
        assert!(resolve(root, Path::new("/loop/x")).unwrap_err().to_string().contains("too many"));
    }
}
