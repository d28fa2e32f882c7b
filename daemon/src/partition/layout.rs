//! The declared partitions resolved against the discovered node: which GPUs are managed and
//! how, with what only the hardware can tell checked now (GPUs named exist, MIG is supported,
//! profile names exist on the model, shares fit the memory). Errors name the config key.

use std::collections::BTreeMap;

use crate::config::{Config, ConfigError, GpuSelector, PartitionKind};
use crate::discovery::{Gpu, Inventory};

use super::mig_plan::Desired;
use super::shares::plan_shares;

/// How one managed GPU is to be partitioned.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuLayout<'c> {
    pub index: u32,
    pub uuid: String,
    /// The `partitions` key it was declared under (`default`, `"0"`, `"GPU-…"`).
    pub key: String,
    pub kind: PartitionKind<'c>,
}

impl GpuLayout<'_> {
    /// The MIG state this layout needs.
    pub fn desired(&self) -> Desired<'_> {
        match self.kind {
            PartitionKind::Mig { profiles, .. } => Desired::On(profiles),
            PartitionKind::Whole | PartitionKind::Shares(_) => Desired::Off,
        }
    }
}

/// Resolves `config.partitions` for the GPUs of `inv`; GPUs no entry names are left out.
pub fn resolve<'c>(config: &'c Config, inv: &Inventory) -> Result<Vec<GpuLayout<'c>>, ConfigError> {
    let mut named: BTreeMap<u32, &str> = BTreeMap::new();
    for key in config.partitions.keys() {
        let at = format!("partitions.{}", crate::config::quote_key(key));
        let gpu = match GpuSelector::parse(key).map_err(|r| ConfigError::new(&at, r))? {
            GpuSelector::Default => continue,
            GpuSelector::Index(i) => inv.gpu(i).ok_or_else(|| {
                ConfigError::new(&at, format!("there is no GPU {i}: the node has {} GPUs", inv.gpus.len()))
            })?,
            GpuSelector::Uuid(u) => {
                inv.gpu_by_uuid(&u).ok_or_else(|| ConfigError::new(&at, format!("no GPU on this node has UUID {u}")))?
            }
        };
        if let Some(other) = named.insert(gpu.index, key) {
            return Err(ConfigError::new(
                &at,
                format!(
                    "names GPU {} as partitions.{} does too; declare it once",
                    gpu.index,
                    crate::config::quote_key(other)
                ),
            ));
        }
    }
    let mut out = Vec::new();
    for gpu in &inv.gpus {
        let Some((key, spec)) = config.partition_for(gpu.index, &gpu.uuid) else { continue };
        let at = format!("partitions.{}", crate::config::quote_key(key));
        let kind = spec.kind().ok_or_else(|| ConfigError::new(&at, "declares no single partition kind"))?;
        check(&at, gpu, kind)?;
        out.push(GpuLayout { index: gpu.index, uuid: gpu.uuid.clone(), key: key.to_string(), kind });
    }
    Ok(out)
}

fn check(at: &str, gpu: &Gpu, kind: PartitionKind<'_>) -> Result<(), ConfigError> {
    match kind {
        PartitionKind::Whole => Ok(()),
        PartitionKind::Shares(s) => plan_shares(&gpu.uuid, gpu.memory_total, s)
            .map(|_| ())
            .map_err(|e| ConfigError::new(format!("{at}.shares"), format!("GPU {} ({}): {e}", gpu.index, gpu.name))),
        PartitionKind::Mig { profiles, shares } => {
            let Some(mig) = &gpu.mig else {
                return Err(ConfigError::new(
                    format!("{at}.mig"),
                    format!("GPU {} ({}) does not support MIG", gpu.index, gpu.name),
                ));
            };
            for name in profiles.keys() {
                let Some(p) = mig.capability.profile(name) else {
                    return Err(ConfigError::new(
                        format!("{at}.mig.{}", crate::config::quote_key(name)),
                        format!(
                            "GPU {} ({}) has no MIG profile {name:?}; {}",
                            gpu.index,
                            gpu.name,
                            super::mig_plan::offered(&mig.capability.names())
                        ),
                    ));
                };
                let count = profiles[name];
                if count > p.instance_count {
                    return Err(ConfigError::new(
                        format!("{at}.mig.{}", crate::config::quote_key(name)),
                        format!("{count} instances; GPU {} fits at most {}", gpu.index, p.instance_count),
                    ));
                }
            }
            for (name, s) in shares.into_iter().flatten() {
                let key = format!("{at}.mig_shares.{}", crate::config::quote_key(name));
                let p = mig.capability.profile(name).expect("checked above: mig_shares profiles are in mig");
                plan_shares("MIG-", p.memory_mib << 20, s)
                    .map_err(|e| ConfigError::new(key, format!("a {name} instance: {e}")))?;
            }
            Ok(())
        }
    }
}
