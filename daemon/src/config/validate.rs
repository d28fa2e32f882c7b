//! Checks that need the whole configuration but no hardware. The first problem found is returned,
//! naming its key. MIG profile names are only checked for their shape here; whether the GPU's
//! model has them is checked against the discovered model (`partition::layout`).

use std::net::SocketAddr;

use super::{Config, ConfigError, GpuSelector, PartitionSpec, SharesSpec, absolute, is_dns_subdomain};

/// Most shares of one device (each needs at least 1% of its SM time).
pub const MAX_SHARES: u32 = 100;

fn injection(i: &super::Injection) -> Result<(), ConfigError> {
    if !i.cdi_spec_dir.as_os_str().is_empty() {
        absolute("injection.cdi_spec_dir", &i.cdi_spec_dir)?;
    }
    if !["0.6.0", "0.5.0"].contains(&i.cdi_version.as_str()) {
        return Err(ConfigError::new(
            "injection.cdi_version",
            format!("{:?}: expected \"0.6.0\", or \"0.5.0\" for runtimes that refuse newer specs", i.cdi_version),
        ));
    }
    absolute("injection.driver_root", &i.driver_root)?;
    if !i.host_driver_root.as_os_str().is_empty() {
        absolute("injection.host_driver_root", &i.host_driver_root)?;
    }
    absolute("injection.dev_root", &i.dev_root)?;
    if !i.shim_path.as_os_str().is_empty() {
        absolute("injection.shim_path", &i.shim_path)?;
    }
    absolute("injection.hook_path", &i.hook_path)
}

pub(super) fn validate(c: &Config) -> Result<(), ConfigError> {
    if let Some(lib) = &c.nvml_library
        && lib.as_os_str().is_empty()
    {
        return Err(ConfigError::new("nvml_library", "is empty; leave it out for the driver's libnvidia-ml.so.1"));
    }
    absolute("device_plugin_dir", &c.device_plugin_dir)?;
    absolute("state_dir", &c.state_dir)?;
    absolute("runtime_dir", &c.runtime_dir)?;
    if let Some(sock) = &c.node_api_socket {
        absolute("node_api_socket", sock)?;
    }
    // sun_path holds 108 bytes with the terminating NUL.
    if c.node_api_socket().as_os_str().len() > 107 {
        let key = if c.node_api_socket.is_some() { "node_api_socket" } else { "runtime_dir" };
        return Err(ConfigError::new(key, "the node API socket path is longer than a Unix socket allows (107 bytes)"));
    }
    if !c.pod_resources_socket.as_os_str().is_empty() {
        absolute("pod_resources_socket", &c.pod_resources_socket)?;
        if c.pod_resources_socket.as_os_str().len() > 107 {
            return Err(ConfigError::new("pod_resources_socket", "longer than a Unix socket path allows (107 bytes)"));
        }
    }
    resource_prefix(&c.resources.prefix)?;
    injection(&c.injection)?;
    if let Some(addr) = &c.telemetry.metrics_listen {
        match crate::socket::unix_path(addr) {
            Some(Err(why)) => return Err(ConfigError::new("telemetry.metrics_listen", format!("{addr:?}: {why}"))),
            Some(Ok(_)) => {}
            None if addr.parse::<SocketAddr>().is_err() => {
                return Err(ConfigError::new(
                    "telemetry.metrics_listen",
                    format!(
                        "{addr:?} is not a listen address such as \"127.0.0.1:9400\" or \"[::]:9400\", nor an owner-only socket such as \"unix:/run/tessera/metrics.sock\""
                    ),
                ));
            }
            None => {}
        }
    }
    if let Some(ep) = &c.telemetry.otlp_endpoint {
        let rest = ep.strip_prefix("http://").or_else(|| ep.strip_prefix("https://"));
        if rest.is_none_or(str::is_empty) {
            return Err(ConfigError::new(
                "telemetry.otlp_endpoint",
                format!("{ep:?} is not an http:// or https:// URL of an OTLP/gRPC collector"),
            ));
        }
    }
    if !(1..=3600).contains(&c.health.interval_seconds) {
        return Err(ConfigError::new(
            "health.interval_seconds",
            format!("{} is out of range 1..=3600", c.health.interval_seconds),
        ));
    }
    if c.health.recovery_check_ms > 3_600_000 {
        return Err(ConfigError::new(
            "health.recovery_check_ms",
            format!("{} is out of range 0..=3600000", c.health.recovery_check_ms),
        ));
    }
    if let Some(x) = c.health.fatal_xids.iter().find(|x| c.health.ignored_xids.contains(x)) {
        return Err(ConfigError::new(
            "health.fatal_xids",
            format!("XID {x} is also in health.ignored_xids; an XID is either ignored or fatal"),
        ));
    }
    super::enforcement::validate(&c.enforcement)?;
    if tessera_region::ComputeMode::from_name(&c.limits.compute_mode).is_none() {
        return Err(ConfigError::new(
            "limits.compute_mode",
            format!("{:?} is not one of \"strict\", \"work-conserving\"", c.limits.compute_mode),
        ));
    }
    if tessera_region::Priority::from_name(&c.limits.priority).is_none() {
        return Err(ConfigError::new(
            "limits.priority",
            format!("{:?} is not one of \"low\", \"normal\", \"high\"", c.limits.priority),
        ));
    }
    if c.limits.max_allocations == 0 {
        return Err(ConfigError::new(
            "limits.max_allocations",
            "0 would refuse every node API Allocate; give at least 1 (default 1024)",
        ));
    }
    super::kubernetes::validate(&c.kubernetes)?;
    for (key, spec) in &c.partitions {
        let at = format!("partitions.{}", quote_key(key));
        GpuSelector::parse(key).map_err(|r| ConfigError::new(&at, r))?;
        partition(&at, spec)?;
    }
    Ok(())
}

/// A key part as TOML needs it written (`"1g.10gb"` quoted, `0` bare).
pub(crate) fn quote_key(k: &str) -> String {
    if !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        k.to_string()
    } else {
        format!("{k:?}")
    }
}

fn resource_prefix(prefix: &str) -> Result<(), ConfigError> {
    if !prefix.contains('.') || !is_dns_subdomain(prefix) {
        return Err(ConfigError::new(
            "resources.prefix",
            format!("{prefix:?} is not a DNS subdomain such as \"tessera.io\" (lowercase letters, digits, '-', '.')"),
        ));
    }
    Ok(())
}

/// Whether a name has the shape of a MIG GPU-instance profile: `<N>g.<M>gb`, optionally `+me`.
pub fn is_profile_name(name: &str) -> bool {
    let base = name.strip_suffix("+me").unwrap_or(name);
    let Some((g, mem)) = base.split_once("g.") else { return false };
    let Some(gb) = mem.strip_suffix("gb") else { return false };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(g) && digits(gb)
}

fn partition(at: &str, spec: &PartitionSpec) -> Result<(), ConfigError> {
    let declared: Vec<&str> =
        [spec.whole.then_some("whole"), spec.mig.as_ref().map(|_| "mig"), spec.shares.as_ref().map(|_| "shares")]
            .into_iter()
            .flatten()
            .collect();
    match declared.len() {
        0 if spec.mig_shares.is_some() => {
            return Err(ConfigError::new(format!("{at}.mig_shares"), "needs a `mig` layout beside it"));
        }
        0 => {
            return Err(ConfigError::new(
                at,
                "declares no partition: set one of `whole = true`, `mig = { … }`, `shares = …`",
            ));
        }
        1 => {}
        _ => {
            return Err(ConfigError::new(
                at,
                format!("declares {}; choose one of `whole`, `mig`, `shares`", declared.join(" and ")),
            ));
        }
    }
    if let Some(mig) = &spec.mig {
        for (name, &count) in mig {
            let key = format!("{at}.mig.{}", quote_key(name));
            if !is_profile_name(name) {
                return Err(ConfigError::new(
                    key,
                    "is not a MIG profile name such as \"1g.10gb\", \"3g.40gb\" or \"1g.10gb+me\"",
                ));
            }
            if count == 0 {
                return Err(ConfigError::new(key, "count is 0; leave the profile out instead"));
            }
            if count > 7 {
                return Err(ConfigError::new(key, format!("{count} instances: no GPU has more than 7")));
            }
        }
    }
    if let Some(ms) = &spec.mig_shares {
        let Some(mig) = &spec.mig else {
            return Err(ConfigError::new(format!("{at}.mig_shares"), "needs a `mig` layout beside it"));
        };
        for (name, shares) in ms {
            let key = format!("{at}.mig_shares.{}", quote_key(name));
            if !mig.contains_key(name) {
                return Err(ConfigError::new(key, format!("profile {name:?} is not in {at}.mig")));
            }
            shares_spec(&key, shares)?;
        }
    }
    if let Some(s) = &spec.shares {
        shares_spec(&format!("{at}.shares"), s)?;
    }
    Ok(())
}

/// The checks on shares that need no device: counts, percentages, sizes present.
pub(crate) fn shares_spec(key: &str, s: &SharesSpec) -> Result<(), ConfigError> {
    match s {
        SharesSpec::Equal { count } => {
            if !(1..=MAX_SHARES).contains(count) {
                return Err(ConfigError::new(
                    format!("{key}.count"),
                    format!("{count} is out of range 1..={MAX_SHARES}"),
                ));
            }
        }
        SharesSpec::Explicit(list) => {
            if list.is_empty() {
                return Err(ConfigError::new(key, "is an empty list; give at least one share"));
            }
            if list.len() > MAX_SHARES as usize {
                return Err(ConfigError::new(key, format!("{} shares; at most {MAX_SHARES}", list.len())));
            }
            let mut sum = 0u32;
            for (i, share) in list.iter().enumerate() {
                if let Some(p) = share.sm_percent {
                    if !(1..=100).contains(&p) {
                        return Err(ConfigError::new(
                            format!("{key}[{i}].sm_percent"),
                            format!("{p} is out of range 1..=100"),
                        ));
                    }
                    sum += p;
                }
                if share.memory.is_some_and(|m| m.0 == 0) {
                    return Err(ConfigError::new(format!("{key}[{i}].memory"), "is 0 bytes"));
                }
            }
            if sum > 100 {
                return Err(ConfigError::new(
                    format!("{key}.sm_percent"),
                    format!("the shares' SM percentages sum to {sum}, over 100"),
                ));
            }
            let open = list.iter().filter(|s| s.sm_percent.is_none()).count() as u32;
            if open > 100 - sum {
                return Err(ConfigError::new(
                    format!("{key}.sm_percent"),
                    format!(
                        "{} percent is left for {open} shares without sm_percent; each needs at least 1",
                        100 - sum
                    ),
                ));
            }
        }
    }
    Ok(())
}
