//! `tessera-sim`: the simulated GPU node's own tool. It lays the driver library out where
//! programs look for NVIDIA's, shows the node's state, injects faults and drives MIG the way an
//! operator would on a real node, and starts the workload program against the node.

mod driver_root;
mod install;
mod mig;
mod nvidia_smi;
mod soname;
mod status;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tessera_sim_model::{Node, NodeDescription, SimError};

#[derive(Parser)]
#[command(name = "tessera-sim", version, about = "Simulated GPU node: layout, state, faults, MIG")]
struct Cli {
    /// Node description (TOML). Default: $TESSERA_SIM_NODE, else the built-in 8 x H100 node.
    #[arg(long, global = true, value_name = "FILE")]
    node: Option<PathBuf>,
    /// State file. Default: $TESSERA_SIM_STATE, else a per-description file in the runtime dir.
    #[arg(long, global = true, value_name = "FILE")]
    state: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Lay the driver library out in DIR as a real driver installs libcuda and libnvidia-ml:
    /// libcuda.so.<driver version> (SONAME libcuda.so.1) with the links libcuda.so.1 and
    /// libcuda.so, and the same for libnvidia-ml; for LD_LIBRARY_PATH or nvml-wrapper's lib_path.
    Install {
        /// The directory for the libraries (not with --driver-root).
        #[arg(required_unless_present = "driver_root", conflicts_with = "driver_root")]
        dir: Option<PathBuf>,
        /// Lay out a whole driver root instead: versioned libraries and the toolkit's stub
        /// libraries under usr/lib/x86_64-linux-gnu, usr/bin/nvidia-smi over the node, the proc
        /// tree under proc/driver (kept current after MIG changes) and the device nodes under dev
        /// (character devices as root, empty files otherwise).
        #[arg(long, value_name = "DIR")]
        driver_root: Option<PathBuf>,
        /// The built libtessera_sim.so (default: beside this program, or $TESSERA_SIM_LIB).
        #[arg(long)]
        lib: Option<PathBuf>,
    },
    /// Print the node: GPUs, memory, utilization, health, MIG instances, processes.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Inject a fault.
    #[command(subcommand)]
    Inject(Inject),
    /// Reset a GPU: back on the bus, volatile ECC cleared, pending MIG mode applied, its contexts destroyed.
    Reset {
        #[arg(long)]
        gpu: u32,
    },
    /// MIG mode and instances.
    #[command(subcommand)]
    Mig(mig::MigCommand),
    /// Print NVML events as they happen (XIDs, ECC, MIG changes).
    Events {
        /// Stop after this many seconds (default: run until interrupted).
        #[arg(long)]
        seconds: Option<u64>,
    },
    /// Processes that exit: `hold` keeps them in NVML's process lists (memory and all) until
    /// `release`, as a real driver lists an exiting process while it tears its contexts down.
    Exits {
        #[arg(value_enum)]
        action: Exits,
    },
    /// Run the workload program (tessera-workload) against this node; arguments follow `--`.
    Workload {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Exits {
    Hold,
    Release,
}

#[derive(Subcommand)]
enum Inject {
    /// Raise an XID (79 also takes the GPU off the bus).
    Xid {
        #[arg(long)]
        gpu: u32,
        #[arg(long)]
        xid: u32,
        /// The MIG GPU instance the error is attributed to.
        #[arg(long, requires = "ci")]
        gi: Option<u32>,
        /// The MIG compute instance the error is attributed to.
        #[arg(long, requires = "gi")]
        ci: Option<u32>,
        /// The process whose contexts the fault kills (an application error).
        #[arg(long)]
        pid: Option<u32>,
    },
    /// Add ECC errors.
    Ecc {
        #[arg(long)]
        gpu: u32,
        #[arg(long, default_value_t = 0)]
        corrected: u64,
        #[arg(long, default_value_t = 0)]
        uncorrected: u64,
    },
    /// Make the GPU fall off the bus (XID 79; every call on it fails until a reset).
    Lost {
        #[arg(long)]
        gpu: u32,
    },
}

fn open(cli: &Cli) -> Result<Node, SimError> {
    let node = cli.node.clone().or_else(|| std::env::var_os(tessera_sim_model::ENV_NODE).map(PathBuf::from));
    let state = cli.state.clone().or_else(|| std::env::var_os(tessera_sim_model::ENV_STATE).map(PathBuf::from));
    Node::open(node.as_deref(), state.as_deref())
}

/// The node description (--node, else $TESSERA_SIM_NODE, else the default node), without
/// opening the node's state.
fn description(cli: &Cli) -> Result<NodeDescription, String> {
    let path = cli.node.clone().or_else(|| std::env::var_os(tessera_sim_model::ENV_NODE).map(PathBuf::from));
    match path {
        Some(p) => NodeDescription::load(&p).map_err(|e| e.to_string()),
        None => Ok(NodeDescription::default_node()),
    }
}

fn run(cli: Cli) -> Result<(), String> {
    match &cli.command {
        Command::Install { dir, lib, driver_root } => {
            if let Some(root) = driver_root {
                driver_root::install_root(&open(&cli).map_err(|e| e.to_string())?, root, lib.as_deref())?;
                println!("{}", root.display());
            } else if let Some(dir) = dir {
                install::install(dir, lib.as_deref(), &description(&cli)?.driver_version)?;
                println!("{}", dir.display());
            }
            Ok(())
        }
        Command::Status { json } => status::print(&open(&cli).map_err(|e| e.to_string())?, *json),
        Command::Inject(what) => {
            let node = open(&cli).map_err(|e| e.to_string())?;
            // Say what was done: a script's log should show the fault it caused.
            let done = match *what {
                Inject::Xid { gpu, xid, gi, ci, pid } => node.inject_xid(gpu, xid, gi.zip(ci), pid).map(|()| {
                    let on = gi
                        .zip(ci)
                        .map_or(String::new(), |(g, c)| format!(" on GPU instance {g}, compute instance {c}"));
                    let by = pid.map_or(String::new(), |p| format!(", attributed to pid {p}"));
                    format!("GPU {gpu}: XID {xid} raised{on}{by}")
                }),
                Inject::Ecc { gpu, corrected, uncorrected } => {
                    if corrected == 0 && uncorrected == 0 {
                        return Err("inject ecc: give --corrected and/or --uncorrected".into());
                    }
                    node.inject_ecc(gpu, corrected, uncorrected).map(|()| {
                        format!("GPU {gpu}: {corrected} corrected and {uncorrected} uncorrected ECC errors added")
                    })
                }
                Inject::Lost { gpu } => node.fall_off_bus(gpu).map(|()| {
                    format!("GPU {gpu}: fallen off the bus (XID 79); `tessera-sim reset --gpu {gpu}` brings it back")
                }),
            }
            .map_err(|e| e.to_string())?;
            println!("{done}");
            Ok(())
        }
        Command::Reset { gpu } => open(&cli)
            .and_then(|n| n.reset(*gpu))
            .map(|()| println!("GPU {gpu}: reset (back on the bus, volatile ECC counts and the last XID cleared)"))
            .map_err(|e| e.to_string()),
        Command::Mig(m) => mig::run(&open(&cli).map_err(|e| e.to_string())?, m),
        Command::Events { seconds } => status::follow_events(&open(&cli).map_err(|e| e.to_string())?, *seconds),
        Command::Exits { action } => {
            let node = open(&cli).map_err(|e| e.to_string())?;
            match action {
                Exits::Hold => {
                    node.hold_exits(true);
                    println!("processes that exit stay listed by NVML until `tessera-sim exits release`");
                }
                Exits::Release => {
                    node.hold_exits(false);
                    println!("processes that exit are reaped again (those held go at the next query)");
                }
            }
            Ok(())
        }
        Command::Workload { args } => {
            let node = open(&cli).map_err(|e| e.to_string())?;
            install::exec_workload(&node, cli.node.as_deref(), args)
        }
    }
}

fn main() -> ExitCode {
    if nvidia_smi::invoked_as_nvidia_smi() {
        return nvidia_smi::main();
    }
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera-sim: {e}");
            ExitCode::FAILURE
        }
    }
}
