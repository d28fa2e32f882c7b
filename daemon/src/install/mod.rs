//! `tessera install` / `tessera uninstall`: puts the hook, the runtime wrapper and the shim on a
//! host and configures its container runtimes to use them (docs/install.md). Run by hand on a
//! systemd host, or by the DaemonSet's init container with the host's `/` as `--host-root`.
//!
//! - Idempotent: what is already as it should be is left alone, an upgrade rewrites only what
//!   changed.
//! - Touches nothing it did not write: every file it writes is recorded, with its checksum, in a
//!   manifest (`/var/lib/tessera/install.json`); a file in its way that it did not write is an
//!   error, never overwritten. containerd's `config.toml` is edited by marked blocks only.
//! - `uninstall` removes what the manifest lists and is unchanged since, removes the marked
//!   blocks, and so gives back the host as it was.

mod containerd;
mod host;

use std::collections::BTreeSet;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tessera_region::paths;

pub use containerd::HANDLER;

/// The manifest of what `tessera install` wrote (host path).
pub const MANIFEST: &str = "/var/lib/tessera/install.json";
/// containerd's configuration (host path).
pub const CONTAINERD_CONFIG: &str = "/etc/containerd/config.toml";
/// docker's daemon configuration (host path).
pub const DOCKER_CONFIG: &str = "/etc/docker/daemon.json";

/// A container runtime the installer configures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Runtime {
    Containerd,
    Crio,
    Podman,
    Docker,
}

impl Runtime {
    /// Host paths whose presence says the runtime is installed.
    fn probes(self) -> &'static [&'static str] {
        match self {
            Runtime::Containerd => &["/usr/bin/containerd", "/usr/local/bin/containerd", "/etc/containerd"],
            Runtime::Crio => &["/usr/bin/crio", "/usr/local/bin/crio", "/etc/crio"],
            Runtime::Podman => &["/usr/bin/podman", "/usr/local/bin/podman"],
            Runtime::Docker => &["/usr/bin/dockerd", "/usr/local/bin/dockerd", "/etc/docker"],
        }
    }

    /// What the operator has to do for the runtime to see the change.
    fn restart(self) -> Option<&'static str> {
        match self {
            Runtime::Containerd => Some(
                "containerd: restart it (systemctl restart containerd) to load the tessera runtime handler and CDI",
            ),
            Runtime::Crio => Some("crio: restart it (systemctl restart crio) to load the hooks.d entry"),
            Runtime::Podman => None,
            Runtime::Docker => Some("docker: restart it (systemctl restart docker) to load the tessera runtime"),
        }
    }
}

/// `tessera install`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct InstallArgs {
    /// The host's root file system (the DaemonSet mounts the host's / here).
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub host_root: PathBuf,
    /// The runtimes to configure; repeat for several. Default: those found on the host.
    #[arg(long = "runtime", value_enum, value_name = "RUNTIME")]
    pub runtimes: Vec<Runtime>,
    /// Where tessera-hook, tessera-runtime and libtessera.so are. Default: beside this program
    /// (libtessera.so also in ../lib/tessera/).
    #[arg(long, value_name = "DIR")]
    pub from: Option<PathBuf>,
    /// The daemon's runtime directory on the host: the hooks.d entry names the hook
    /// configuration tesserad writes there.
    #[arg(long, value_name = "DIR", default_value = paths::RUNTIME_DIR)]
    pub runtime_dir: PathBuf,
    /// Say what would change and change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// `tessera uninstall`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct UninstallArgs {
    /// The host's root file system.
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub host_root: PathBuf,
    /// Say what would change and change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// One thing the installer owns on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Entry {
    /// A whole file it wrote, with the CRC-32 and size of what it wrote.
    File { path: PathBuf, crc32: u32, size: u64 },
    /// Marked blocks in a file it did not create ([`containerd::BEGIN`]).
    Blocks { path: PathBuf },
    /// A directory it created (removed if empty).
    Dir { path: PathBuf },
}

/// `install.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    pub runtimes: BTreeSet<Runtime>,
    pub entries: Vec<Entry>,
}

impl Manifest {
    fn load(root: &Path) -> Result<Manifest, String> {
        let path = host::resolve(root, Path::new(MANIFEST)).map_err(|e| format!("{MANIFEST}: {e}"))?;
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| {
                format!("{}: damaged ({e}); move it aside and run `tessera install` again", path.display())
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Manifest { version: 1, ..Manifest::default() }),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    fn owns_file(&self, p: &Path) -> Option<u32> {
        self.entries.iter().find_map(|e| match e {
            Entry::File { path, crc32, .. } if path == p => Some(*crc32),
            _ => None,
        })
    }

    fn record(&mut self, entry: Entry) {
        let path = |e: &Entry| match e {
            Entry::File { path, .. } | Entry::Blocks { path } | Entry::Dir { path } => path.clone(),
        };
        match self.entries.iter_mut().find(|e| path(e) == path(&entry)) {
            Some(e) => *e = entry, // in place: a second run writes the same manifest
            None => self.entries.push(entry),
        }
    }
}

/// What one run did (or, dry, would do), one line each, and the restarts needed.
#[derive(Debug, Default)]
pub struct Report {
    pub lines: Vec<String>,
    pub restarts: Vec<&'static str>,
}

struct Installer<'a> {
    root: &'a Path,
    dry: bool,
    manifest: Manifest,
    report: Report,
    changed: BTreeSet<Runtime>,
}

impl Installer<'_> {
    fn at(&self, host: &str) -> Result<PathBuf, String> {
        host::resolve(self.root, Path::new(host)).map_err(|e| format!("{host}: {e}"))
    }

    /// Makes `host`'s directories, recording those it creates.
    fn dirs(&mut self, host: &Path) -> Result<(), String> {
        let mut missing = Vec::new();
        for a in host.ancestors().take_while(|a| *a != Path::new("/")) {
            if self.at(&a.display().to_string())?.exists() {
                break;
            }
            missing.push(a.to_path_buf());
        }
        for d in missing.into_iter().rev() {
            let real = self.at(&d.display().to_string())?;
            self.say(format!("create {}/", d.display()));
            if !self.dry {
                // The daemon's state directory (the manifest's) is the daemon's alone: 0700.
                let mode = if d == Path::new(paths::STATE_DIR) { 0o700 } else { 0o755 };
                std::fs::DirBuilder::new().mode(mode).create(&real).map_err(|e| format!("{}: {e}", d.display()))?;
            }
            self.manifest.record(Entry::Dir { path: d });
        }
        Ok(())
    }

    /// Writes a whole file it owns; refuses one in the way that it did not write.
    fn file(&mut self, host: &str, bytes: &[u8], mode: u32, runtime: Option<Runtime>) -> Result<(), String> {
        let real = self.at(host)?;
        let crc = crc32fast::hash(bytes);
        let current = std::fs::read(&real).ok();
        if current.as_deref() == Some(bytes) {
            if self.manifest.owns_file(Path::new(host)).is_some() {
                self.say(format!("unchanged {host}"));
            } else {
                self.say(format!("unchanged {host} (already there, not ours: left in place at uninstall)"));
            }
            return Ok(());
        }
        if let Some(cur) = &current {
            match self.manifest.owns_file(Path::new(host)) {
                None => {
                    return Err(format!(
                        "{host} exists and was not written by tessera install; move it aside (or remove it) and run again"
                    ));
                }
                Some(c) if c != crc32fast::hash(cur) => {
                    return Err(format!(
                        "{host} was changed since tessera install wrote it; move it aside (or remove it) and run again"
                    ));
                }
                Some(_) => {}
            }
        }
        self.dirs(Path::new(host).parent().unwrap_or(Path::new("/")))?;
        self.say(format!("{} {host}", if current.is_some() { "update" } else { "write" }));
        if !self.dry {
            // A new file renamed over the old: a container starting meanwhile runs either one.
            crate::state::durable::write_file(&real, bytes, mode).map_err(|e| format!("{host}: {e}"))?;
        }
        self.manifest.record(Entry::File { path: host.into(), crc32: crc, size: bytes.len() as u64 });
        if let Some(r) = runtime {
            self.changed.insert(r);
        }
        Ok(())
    }

    fn say(&mut self, line: String) {
        self.report.lines.push(if self.dry { format!("would {line}") } else { line });
    }
}

/// Where the programs to install are: `--from`, else beside this executable.
fn sources(from: Option<&Path>) -> Result<[(PathBuf, &'static str, u32); 3], String> {
    let dir = match from {
        Some(d) => d.to_path_buf(),
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find this program's directory ({e}); pass --from DIR"))?
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
    };
    let find = |names: &[PathBuf]| -> Result<PathBuf, String> {
        names.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
            format!("{} not found; pass --from DIR naming the directory that holds it", names[0].display())
        })
    };
    Ok([
        (find(&[dir.join("tessera-hook")])?, paths::HOOK, 0o755),
        (find(&[dir.join("tessera-runtime")])?, paths::RUNTIME_WRAPPER, 0o755),
        (find(&[dir.join("../lib/tessera/libtessera.so"), dir.join("libtessera.so")])?, paths::SHIM, 0o644),
    ])
}

/// The hooks.d entry (podman, CRI-O): the hook with the configuration tesserad writes.
pub fn hooks_d_entry(runtime_dir: &Path) -> String {
    let config = runtime_dir.join(paths::GENERATED_HOOK_CONFIG);
    let entry = serde_json::json!({
        "version": "1.0.0",
        "hook": {
            "path": paths::HOOK,
            "args": ["tessera-hook", "--config", config, "createRuntime"],
            "env": [tessera_region::cdi::HOOK_ENV],
        },
        "when": { "always": true },
        "stages": ["createRuntime"],
    });
    serde_json::to_string_pretty(&entry).unwrap_or_default() + "\n"
}

/// `tessera install`: everything is checked (a dry run) before anything is written, so a
/// refusal leaves the host as it was.
pub fn install(args: &InstallArgs) -> Result<Report, String> {
    let checked = install_pass(args, true)?;
    if args.dry_run { Ok(checked) } else { install_pass(args, false) }
}

fn install_pass(args: &InstallArgs, dry: bool) -> Result<Report, String> {
    let root = &args.host_root;
    if !root.is_dir() {
        return Err(format!("--host-root {}: not a directory", root.display()));
    }
    let loaded = Manifest::load(root)?;
    let mut ins =
        Installer { root, dry, manifest: loaded.clone(), report: Report::default(), changed: BTreeSet::new() };
    let runtimes: BTreeSet<Runtime> = if args.runtimes.is_empty() {
        [Runtime::Containerd, Runtime::Crio, Runtime::Podman, Runtime::Docker]
            .into_iter()
            .filter(|r| r.probes().iter().any(|p| ins.at(p).is_ok_and(|p| p.exists())))
            .collect()
    } else {
        args.runtimes.iter().copied().collect()
    };
    for (src, dst, mode) in sources(args.from.as_deref())? {
        let bytes = std::fs::read(&src).map_err(|e| format!("{}: {e}", src.display()))?;
        ins.file(dst, &bytes, mode, None)?;
    }
    ins.dirs(Path::new(paths::CDI_SPEC_DIR))?;
    if runtimes.contains(&Runtime::Crio) || runtimes.contains(&Runtime::Podman) {
        let path = format!("{}/{}", paths::HOOKS_D, paths::HOOKS_D_FILE);
        let entry = hooks_d_entry(&args.runtime_dir);
        let r = if runtimes.contains(&Runtime::Crio) { Some(Runtime::Crio) } else { None };
        ins.file(&path, entry.as_bytes(), 0o644, r)?;
    }
    if runtimes.contains(&Runtime::Containerd) {
        containerd_config(&mut ins)?;
    }
    if runtimes.contains(&Runtime::Docker) {
        docker_config(&mut ins)?;
    }
    ins.manifest.runtimes.extend(runtimes.iter().copied());
    ins.report.restarts = ins.changed.iter().filter_map(|r| r.restart()).collect();
    if runtimes.is_empty() {
        ins.report.lines.push("no container runtime found or named (--runtime): programs installed only".into());
    }
    let manifest_dir = Path::new(MANIFEST).parent().unwrap_or(Path::new("/"));
    ins.dirs(manifest_dir)?;
    if !ins.dry && ins.manifest != loaded {
        let text = serde_json::to_vec_pretty(&ins.manifest).map_err(|e| e.to_string())?;
        let path = ins.at(MANIFEST)?;
        crate::state::durable::write_file(&path, &text, 0o644).map_err(|e| format!("{MANIFEST}: {e}"))?;
    }
    Ok(ins.report)
}

fn containerd_config(ins: &mut Installer<'_>) -> Result<(), String> {
    let real = ins.at(CONTAINERD_CONFIG)?;
    let original = match std::fs::read_to_string(&real) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{CONTAINERD_CONFIG}: {e}")),
    };
    let owned = ins.manifest.owns_file(Path::new(CONTAINERD_CONFIG)).is_some();
    let edited = containerd::edit(original.as_deref(), paths::RUNTIME_WRAPPER, paths::CDI_SPEC_DIRS)
        .map_err(|e| format!("{CONTAINERD_CONFIG}: {e}"))?;
    if original.is_none() || owned {
        // No file: the whole file is ours.
        return ins.file(CONTAINERD_CONFIG, edited.as_bytes(), 0o644, Some(Runtime::Containerd));
    }
    if original.as_deref() == Some(edited.as_str()) {
        ins.say(format!("unchanged {CONTAINERD_CONFIG}"));
    } else {
        ins.say(format!("edit {CONTAINERD_CONFIG} (marked blocks: the tessera runtime handler, CDI)"));
        if !ins.dry {
            crate::state::durable::write_file(&real, edited.as_bytes(), 0o644)
                .map_err(|e| format!("{CONTAINERD_CONFIG}: {e}"))?;
        }
        ins.changed.insert(Runtime::Containerd);
    }
    ins.manifest.record(Entry::Blocks { path: CONTAINERD_CONFIG.into() });
    Ok(())
}

fn docker_config(ins: &mut Installer<'_>) -> Result<(), String> {
    let ours = serde_json::json!({
        "runtimes": { HANDLER: { "path": paths::RUNTIME_WRAPPER } },
        "features": { "cdi": true },
    });
    let text = serde_json::to_string_pretty(&ours).unwrap_or_default() + "\n";
    let real = ins.at(DOCKER_CONFIG)?;
    if real.exists() && ins.manifest.owns_file(Path::new(DOCKER_CONFIG)).is_none() {
        // The operator's file: not rewritten (a JSON rewrite would reorder it); say what to add.
        ins.say(format!("leave {DOCKER_CONFIG} (not ours): add these keys to it by hand, then restart docker: {ours}"));
        return Ok(());
    }
    ins.file(DOCKER_CONFIG, text.as_bytes(), 0o644, Some(Runtime::Docker))
}

/// `tessera uninstall`.
pub fn uninstall(args: &UninstallArgs) -> Result<Report, String> {
    let root = &args.host_root;
    let mut ins = Installer {
        root,
        dry: args.dry_run,
        manifest: Manifest::load(root)?,
        report: Report::default(),
        changed: BTreeSet::new(),
    };
    if ins.manifest.entries.is_empty() {
        ins.report.lines.push(format!("nothing to remove: no {MANIFEST}"));
        return Ok(ins.report);
    }
    let entries = std::mem::take(&mut ins.manifest.entries);
    // The manifest goes first: its directory is one of those to remove when empty.
    let manifest = ins.at(MANIFEST)?;
    if !ins.dry {
        std::fs::remove_file(&manifest).map_err(|e| format!("{MANIFEST}: {e}"))?;
    }
    for entry in entries.iter().rev() {
        match entry {
            Entry::File { path, crc32, .. } => {
                let host = path.display().to_string();
                let real = ins.at(&host)?;
                match std::fs::read(&real) {
                    Ok(b) if crc32fast::hash(&b) == *crc32 => {
                        ins.say(format!("remove {host}"));
                        if !ins.dry {
                            std::fs::remove_file(&real).map_err(|e| format!("{host}: {e}"))?;
                        }
                    }
                    Ok(_) => ins.say(format!("keep {host}: changed since tessera install wrote it")),
                    Err(_) => {}
                }
            }
            Entry::Blocks { path } => {
                let host = path.display().to_string();
                let real = ins.at(&host)?;
                if let Ok(text) = std::fs::read_to_string(&real) {
                    let restored = containerd::strip(&text);
                    if restored != text {
                        ins.say(format!("restore {host} (remove the marked blocks)"));
                        if !ins.dry {
                            crate::state::durable::write_file(&real, restored.as_bytes(), 0o644)
                                .map_err(|e| format!("{host}: {e}"))?;
                        }
                    }
                }
            }
            Entry::Dir { path } => {
                let host = path.display().to_string();
                let real = ins.at(&host)?;
                let empty = std::fs::read_dir(&real).map(|mut d| d.next().is_none()).unwrap_or(false);
                if empty {
                    ins.say(format!("remove {host}/"));
                    if !ins.dry {
                        std::fs::remove_dir(&real).map_err(|e| format!("{host}: {e}"))?;
                    }
                }
            }
        }
    }
    ins.report.restarts = ins.manifest.runtimes.iter().filter_map(|r| r.restart()).collect();
    Ok(ins.report)
}

/// The command's end: the report on stdout (one line per action, then the restarts needed) and
/// success, or the error on stderr and failure.
pub fn finish(result: Result<Report, String>) -> std::process::ExitCode {
    match result {
        Ok(report) => {
            for l in &report.lines {
                println!("{l}");
            }
            for r in &report.restarts {
                println!("restart needed: {r}");
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tessera: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
