//! `tessera-sim mig`: MIG mode and instances, by profile name as nvidia-smi takes them.

use clap::Subcommand;
use tessera_sim_model::{MigModeChange, Node};

#[derive(Subcommand)]
pub enum MigCommand {
    /// Ask for MIG mode on or off (applied at the next reset, as on a real GPU).
    Mode {
        #[arg(long)]
        gpu: u32,
        #[arg(value_parser = ["on", "off"])]
        mode: String,
    },
    /// Create a GPU instance (and by default its full-size compute instance).
    Create {
        #[arg(long)]
        gpu: u32,
        /// Profile name, e.g. 1g.10gb, 3g.40gb, 1g.10gb+me.
        #[arg(long)]
        profile: String,
        /// First memory slice; default: the first that fits.
        #[arg(long)]
        placement: Option<u32>,
        /// Create only the GPU instance.
        #[arg(long)]
        no_compute_instance: bool,
    },
    /// Destroy a GPU instance and its compute instances (refused while in use).
    Destroy {
        #[arg(long)]
        gpu: u32,
        #[arg(long)]
        gi: u32,
    },
}

pub fn run(node: &Node, cmd: &MigCommand) -> Result<(), String> {
    match cmd {
        MigCommand::Mode { gpu, mode } => {
            match node.set_mig_mode(*gpu, mode == "on").map_err(|e| e.to_string())? {
                MigModeChange::PendingReset { in_use } => {
                    let why = if in_use { " (processes use the GPU, so the driver could not reset it)" } else { "" };
                    println!(
                        "GPU {gpu}: MIG mode {mode} is pending{why}; run `tessera-sim reset --gpu {gpu}` to apply it"
                    );
                }
                MigModeChange::Applied | MigModeChange::Unchanged => println!("GPU {gpu}: MIG mode is {mode}"),
            }
            Ok(())
        }
        MigCommand::Create { gpu, profile, placement, no_compute_instance } => {
            let model = node.gpu(*gpu).map_err(|e| e.to_string())?.model;
            let p = model.gi_profile_by_name(profile).ok_or_else(|| {
                let known: Vec<_> =
                    model.mig.as_ref().map(|m| m.gi_profiles.iter().map(|p| p.name).collect()).unwrap_or_default();
                format!("{} has no MIG profile {profile:?}; it has: {}", model.key, known.join(", "))
            })?;
            let gi = node.create_gpu_instance(*gpu, p.nvml_profile, *placement).map_err(|e| e.to_string())?;
            print!("GPU {gpu}: GPU instance {} ({}) at {}", gi.id, p.name, gi.start);
            if !no_compute_instance {
                let full = model
                    .ci_profiles_for(p)
                    .into_iter()
                    .find(|(c, _, _)| c.is_default_in(p))
                    .map(|(c, _, _)| c.nvml_profile);
                let full = full.ok_or("no full-size compute instance profile")?;
                let ci = node.create_compute_instance(*gpu, gi.id, full, None).map_err(|e| e.to_string())?;
                print!(
                    ", compute instance {} {}",
                    ci.id,
                    node.gpu(*gpu).map_err(|e| e.to_string())?.mig_uuid(gi.id, ci.id, ci.serial)
                );
            }
            println!();
            Ok(())
        }
        MigCommand::Destroy { gpu, gi } => {
            for ci in node.compute_instances(*gpu, Some(*gi)).map_err(|e| e.to_string())? {
                node.destroy_compute_instance(*gpu, *gi, ci.id).map_err(|e| e.to_string())?;
            }
            node.destroy_gpu_instance(*gpu, *gi).map_err(|e| e.to_string())?;
            println!("GPU {gpu}: GPU instance {gi} destroyed");
            Ok(())
        }
    }
}
