//! `tessera-runtime`: the runtime wrapper. Edits config.json on `create`/`run`, then execs the real
//! runtime (config key `runtime`, default `runc` on PATH) with the original argv.
//! Configuration: `$TESSERA_HOOK_CONFIG`, else /etc/tessera/hook.toml, else the daemon's
//! /run/tessera/hook.toml when only that exists (`config::wrapper_config_path`).

use std::os::unix::process::CommandExt;
use std::path::Path;

use tessera_hook::wrapper;
use tessera_region::hook_config::{DEFAULT_PATH, ENV_CONFIG, HookConfig, wrapper_config_path};
use tessera_region::paths;

fn main() {
    let args: Vec<_> = std::env::args_os().collect();
    let generated = Path::new(paths::RUNTIME_DIR).join(paths::GENERATED_HOOK_CONFIG);
    let config = wrapper_config_path(std::env::var_os(ENV_CONFIG), Path::new(DEFAULT_PATH), &generated);
    let sub = wrapper::subcommand(&args);
    let log = sub.and_then(|s| wrapper::log_target(&args, s));
    let fail = |msg: String| -> ! {
        let line = format!("tessera-runtime: {msg}");
        eprintln!("{line}");
        if let Some((path, json)) = &log {
            let text = if *json {
                format!("{}\n", serde_json::json!({"level": "error", "msg": line}))
            } else {
                format!("{line}\n")
            };
            let _ = std::fs::OpenOptions::new().append(true).create(true).open(path).and_then(|mut f| {
                use std::io::Write;
                f.write_all(text.as_bytes())
            });
        }
        std::process::exit(1);
    };
    let cfg = HookConfig::load(&config).unwrap_or_else(|e| fail(e.to_string()));
    if let Some(s) = sub
        && matches!(args[s].to_str(), Some("create" | "run"))
    {
        let bundle = wrapper::bundle(&args, s).unwrap_or_else(|| fail("cannot tell the bundle directory".into()));
        // `create [options] <container-id>`: the id is the last argument.
        let id = args.last().filter(|_| args.len() > s + 1).and_then(|a| a.to_str());
        let state = id.and_then(|id| wrapper::runtime_state(&args, s, &cfg.runtime, id));
        if let Err(e) = wrapper::edit_bundle_for(&cfg, &bundle, id, state.as_deref()) {
            fail(e.0);
        }
    }
    let runtime = wrapper::real_runtime(&cfg).unwrap_or_else(|e| fail(e.0));
    let err = std::process::Command::new(&runtime).args(&args[1..]).exec();
    fail(format!("exec {}: {err}", runtime.display()));
}
