//! `tessera-hook`: the OCI hook (createRuntime, or prestart on older runtimes).
//!
//! `tessera-hook [--config PATH] [createRuntime|prestart] [--link PATH]...` reads the container's
//! state on stdin. `--link PATH` (from a spec with a driver directory): PATH becomes a link to the
//! same path under the driver directory's mount, as the spec's own entry says.
//! Exit 0 with nothing done when the container asks for no Tessera device; otherwise one line on
//! stderr and exit 1 when anything is wrong (the runtime then fails the start).

use std::io::Read;
use std::path::PathBuf;

use tessera_region::hook_config::{DEFAULT_PATH, HookConfig};

fn main() {
    // Before anything else: the hook never runs with an environment someone else chose.
    let preloaded = ["LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH"].iter().find(|v| std::env::var_os(v).is_some());
    tessera_hook::sanitize_env();
    if let Some(v) = preloaded {
        // The loader honoured it before main: refuse to act on a process that may be tampered with.
        fail(&format!("refusing to run with {v} in the environment (hook entries must set env)"));
    }
    let mut args = std::env::args().skip(1);
    let mut config = PathBuf::from(DEFAULT_PATH);
    let mut poststop = false;
    let mut alloc_dir = None;
    let mut links = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--config" => config = args.next().map(PathBuf::from).unwrap_or_else(|| fail("--config needs a path")),
            "createRuntime" | "prestart" => {}
            "poststop" => poststop = true,
            "--alloc-dir" => {
                alloc_dir = Some(args.next().map(PathBuf::from).unwrap_or_else(|| fail("--alloc-dir needs a path")))
            }
            "--link" => links.push(args.next().map(PathBuf::from).unwrap_or_else(|| fail("--link needs a path"))),
            "--version" | "version" => {
                println!("tessera-hook {}", env!("CARGO_PKG_VERSION"));
                return;
            }
            other => fail(&format!("unknown argument {other:?}")),
        }
    }
    let mut state = Vec::new();
    if let Err(e) = std::io::stdin().take(tessera_hook::oci::MAX_JSON + 1).read_to_end(&mut state) {
        fail(&format!("state: {e}"));
    }
    if poststop {
        // The container is deleted: say so in its allocation's directory (the daemon releases a
        // leased allocation bound to it). Nothing to do when the allocation is gone already, or
        // the container named none.
        let id = tessera_hook::oci::container_id(&state).unwrap_or_else(|e| fail(&e.0));
        let dir = match alloc_dir {
            Some(d) => d,
            // From a CDI spec: the allocation the bundle's config.json names.
            None => match poststop_alloc_dir(&config, &state) {
                Ok(Some(d)) => d,
                Ok(None) => return,
                Err(e) => fail(&e),
            },
        };
        if dir.is_dir()
            && let Err(e) = tessera_region::owner::record_deleted(&dir, &id)
        {
            fail(&format!("{}: {e}", dir.display()));
        }
        return;
    }
    let cfg = HookConfig::load(&config).unwrap_or_else(|e| fail(&e.to_string()));
    match tessera_hook::apply::run_hook(&cfg, &state, &links) {
        Ok(_) => {}
        Err(e) => fail(&e.0),
    }
}

/// The allocation directory of the container a poststop state describes: its bundle's config.json
/// names the allocation; the hook configuration says where allocations live.
fn poststop_alloc_dir(config: &std::path::Path, state: &[u8]) -> Result<Option<PathBuf>, String> {
    let cfg = HookConfig::load(config).map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_slice(state).map_err(|e| format!("state: not valid JSON: {e}"))?;
    let Some(bundle) = v.get("bundle").and_then(|b| b.as_str()) else { return Ok(None) };
    // The bundle may be gone already (the runtime deleted it): nothing to say then.
    let Ok(oci) = tessera_hook::oci::read_config(std::path::Path::new(bundle)) else { return Ok(None) };
    let info = tessera_hook::oci::container_info(&oci, &Default::default()).map_err(|e| e.0)?;
    let id = tessera_hook::plan::named_allocation(&info).map_err(|e| e.0)?;
    Ok(id.map(|id| cfg.runtime_dir.join(tessera_region::paths::ALLOC_SUBDIR).join(id)))
}

fn fail(msg: &str) -> ! {
    eprintln!("tessera-hook: {msg}");
    std::process::exit(1);
}
