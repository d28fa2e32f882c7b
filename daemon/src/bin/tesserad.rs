//! `tesserad`: load and validate the configuration, open the NVML session, then run the node
//! (`serve`: the controller over the crash-safe state store and every face, each starting its
//! own tasks, until SIGTERM or SIGINT; `faces`: which, in what order). `--once` prints what was
//! found and applied and exits instead (`once`); `host`: directories, systemd, logging.

#[path = "tesserad/faces.rs"]
mod faces;
#[path = "tesserad/host.rs"]
mod host;
#[path = "tesserad/once.rs"]
mod once;
#[path = "tesserad/serve.rs"]
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use tessera_daemon::config::{self, Config};
use tessera_daemon::discovery::Session;
use tessera_daemon::node::ConfigSource;

#[derive(Parser, Debug)]
#[command(name = "tesserad", version, about = "Tessera node daemon: GPU discovery and partitioning")]
struct Args {
    /// Configuration file.
    #[arg(long, value_name = "FILE", default_value = config::DEFAULT_PATH)]
    config: PathBuf,
    /// Use the simulated node (libtessera_sim.so) instead of the NVIDIA driver.
    #[arg(long)]
    sim: bool,
    /// Discover, apply the layout, print a summary and exit (no kubelet servers).
    #[arg(long)]
    once: bool,
    /// Log lines as `text` or `json` (one object per line). Default: the configuration's
    /// `log_format`, else text.
    #[arg(long, value_enum, value_name = "FORMAT")]
    log_format: Option<config::LogFormat>,
}

fn main() -> ExitCode {
    let started = Instant::now();
    // tesserad's own context probe (`enforcement::context_size`): nothing else of the daemon runs.
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(tessera_daemon::enforcement::context_size::PROBE_ARG) {
        return tessera_daemon::enforcement::context_size::probe_main(&argv[2..]);
    }
    let args = Args::parse();
    let explicit = args.config.as_os_str() != config::DEFAULT_PATH;
    let cfg = match Config::load(&args.config, explicit) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tesserad: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    host::init_logging(args.log_format.unwrap_or(cfg.log_format));
    let session = match Session::open_in(cfg.nvml_library.as_deref(), args.sim || cfg.sim, &cfg.injection.driver_root) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tesserad: {e}");
            return ExitCode::from(1);
        }
    };
    if args.once {
        return once::once(&session, &cfg);
    }
    let source = ConfigSource { path: args.config, explicit };
    serve::serve(session, cfg, source, started)
}
