//! tessera-workload-linked: the workload linked directly against libcuda.so.1, the way programs
//! built with `-lcuda` call the driver.

use std::process::ExitCode;

use clap::Parser;
use tessera_workload::api::{Driver, Lookup};
use tessera_workload::{Plan, finish, for_each_driver_fn, run};

macro_rules! linked_driver {
    ($($field:ident : $base:literal => $sym:ident ( $($arg:ty),* $(,)? );)*) => {
        #[link(name = "cuda")]
        unsafe extern "C" {
            $(fn $sym($(_: $arg),*) -> i32;)*
        }

        fn linked() -> Driver {
            Driver { $($field: $sym,)* }
        }
    };
}

for_each_driver_fn!(linked_driver);

#[derive(Parser)]
#[command(name = "tessera-workload-linked", version, about = "CUDA workload linked directly against libcuda")]
struct Args {
    #[command(flatten)]
    plan: Plan,
}

fn main() -> ExitCode {
    let mut args = Args::parse();
    args.plan.lookup = Lookup::Linked;
    finish(&run(&linked(), &args.plan))
}
