//! tessera-workload: reaches the driver by dlopen (dlsym or cuGetProcAddress_v2), or hands over
//! to tessera-workload-linked for a direct link.

use std::os::unix::process::CommandExt;
use std::process::ExitCode;

use clap::Parser;
use tessera_workload::api::{Lookup, load};
use tessera_workload::{Plan, finish, run};

#[derive(Parser)]
#[command(name = "tessera-workload", version, about = "CUDA workload: allocate, launch timed kernels, report JSON")]
struct Args {
    #[command(flatten)]
    plan: Plan,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.plan.lookup == Lookup::Linked {
        let exe = std::env::current_exe().expect("current_exe");
        let linked = exe.with_file_name("tessera-workload-linked");
        let err = std::process::Command::new(&linked).args(std::env::args_os().skip(1)).exec();
        eprintln!("tessera-workload: exec {}: {err}", linked.display());
        return ExitCode::from(1);
    }
    match load(args.plan.lookup) {
        Ok(cu) => finish(&run(&cu, &args.plan)),
        Err(e) => {
            eprintln!("tessera-workload: {e}");
            ExitCode::from(1)
        }
    }
}
