//! `tessera alloc`, `tessera release`, `tessera limits set`, `tessera allocations`: allocations
//! without a kubelet (the node API's `Allocate`, `Release`, `SetLimits`, `ListAllocations`).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tonic::transport::Channel;

use super::{container_name, enum_name, mib, print_table, row, status_err};

#[derive(Args, Debug)]
pub struct AllocArgs {
    /// A share's device memory with its unit: KiB, MiB, GiB, TiB (Ki, Mi, Gi, Ti) are powers of
    /// 1024; K, M, G, T (KB, MB, GB, TB) powers of 1000, as in Kubernetes; B bytes.
    #[arg(long, value_parser = parse_size, required_unless_present_any = ["mig", "whole"], requires = "sm")]
    memory: Option<u64>,
    /// A share's percent of the GPU's SM time, 1..=100.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100), requires = "memory")]
    sm: Option<u32>,
    /// Instead of a share: a free MIG device of this profile, whole (e.g. 3g.40gb).
    #[arg(long, value_name = "PROFILE", conflicts_with_all = ["memory", "sm", "whole", "compute_mode", "preemptible"])]
    mig: Option<String>,
    /// Instead of a share: this many whole GPUs, exclusive (no GPU with any allocation on it).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..),
          conflicts_with_all = ["memory", "sm", "compute_mode", "preemptible"])]
    whole: Option<u32>,
    /// Only this GPU: an index, a UUID or a model name (default: any, as `share_placement` says).
    #[arg(long)]
    gpu: Option<String>,
    /// Default: the daemon's `limits.priority`.
    #[arg(long, value_enum)]
    priority: Option<PriorityArg>,
    /// Default: the daemon's `limits.compute_mode`.
    #[arg(long, value_enum)]
    compute_mode: Option<ComputeModeArg>,
    /// Who it is for (free text: a function, a job).
    #[arg(long)]
    owner: Option<String>,
    /// `container`: released when the first container that uses it is deleted.
    #[arg(long, value_enum, default_value_t = LeaseArg::None)]
    lease: LeaseArg,
    /// The cgroup its host processes run in, as /proc/PID/cgroup shows it (e.g.
    /// /system.slice/fn-42.scope): every GPU process at or below it is enforced against this
    /// allocation, shim or no shim.
    #[arg(long, value_name = "PATH")]
    cgroup: Option<String>,
    /// May be parked (its memory moved to host, its processes locked) to make room for an
    /// allocation of higher priority on its GPU; resumed once its memory fits again.
    #[arg(long)]
    preemptible: bool,
    /// Print one JSON object: id, devices, cdi_devices, env, owner, lease.
    #[arg(long, conflicts_with = "env")]
    json: bool,
    /// Print only the environment, `KEY=VALUE` per line (for `env $(tessera alloc ... --env) ...`).
    #[arg(long)]
    env: bool,
}

#[derive(Subcommand, Debug)]
pub enum LimitsCommand {
    /// Change a live allocation's limits; its processes see them within 100 ms.
    Set(SetArgs),
}

#[derive(Args, Debug)]
pub struct SetArgs {
    /// The allocation id.
    id: String,
    /// The new memory limit, with its unit as `alloc --memory` reads it (GiB powers of 1024, GB
    /// powers of 1000).
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    sm: Option<u32>,
    #[arg(long, value_enum)]
    priority: Option<PriorityArg>,
}

#[derive(ValueEnum, Debug, Clone, Copy)]
pub enum PriorityArg {
    Low,
    Normal,
    High,
}

impl PriorityArg {
    fn api(self) -> api::Priority {
        match self {
            PriorityArg::Low => api::Priority::Low,
            PriorityArg::Normal => api::Priority::Normal,
            PriorityArg::High => api::Priority::High,
        }
    }
}

#[derive(ValueEnum, Debug, Clone, Copy)]
pub enum ComputeModeArg {
    Strict,
    WorkConserving,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseArg {
    None,
    Container,
}

/// A size, as the configuration and `TESSERA_MEMORY_LIMIT` read one (`tessera_region::parse_size_with_unit`):
/// the unit required, `Ki Mi Gi Ti` (`KiB` …) powers of 1024, `K M G T` (`KB` …) powers of
/// 1000, `B` bytes. The CLI had a parser of its own, which took `8GB` as 8 GiB and a bare `4096`
/// as bytes where the configuration refuses it, and called an overflow "not above 0".
pub fn parse_size(text: &str) -> Result<u64, String> {
    match tessera_region::parse_size_with_unit(text)? {
        0 => Err(format!("{text:?}: must be above 0")),
        bytes => Ok(bytes),
    }
}

/// The longest lock timeout the driver takes: `CUcheckpointLockArgs.timeoutMs` is an unsigned
/// 32-bit count of milliseconds (about 49.7 days).
const MAX_LOCK_TIMEOUT_MS: u64 = u32::MAX as u64;

/// A duration for `park --lock-timeout`: a number (decimals allowed) and its unit, `ms`, `s`,
/// `m` or `h`; at least 1 ms (the driver counts whole milliseconds), at most
/// [`MAX_LOCK_TIMEOUT_MS`]. The unit is required, as for sizes: a bare `10` could be either.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    let units = "ms, s, m or h (e.g. 500ms, 30s, 2m)";
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim());
    let value: f64 = match number.parse() {
        Ok(v) if !number.is_empty() => v,
        _ => return Err(format!("{text:?} is not a duration: write a number and its unit, {units}")),
    };
    let ms_per_unit = match unit {
        "" => return Err(format!("{text:?} has no unit: write \"{s}s\" (seconds) or \"{s}ms\" (milliseconds)")),
        "ms" => 1.0,
        "s" => 1e3,
        "m" | "min" => 60e3,
        "h" => 3600e3,
        other => return Err(format!("{text:?}: unknown unit {other:?}; write {units}")),
    };
    let ms = value * ms_per_unit;
    if ms < 1.0 {
        return Err(format!("{text:?}: must be at least 1ms (the driver counts whole milliseconds)"));
    }
    if ms > MAX_LOCK_TIMEOUT_MS as f64 {
        return Err(format!(
            "{text:?} is more than the driver's longest lock timeout, {MAX_LOCK_TIMEOUT_MS}ms (about 49 days)"
        ));
    }
    Ok(Duration::from_nanos((ms * 1e6).round() as u64))
}

fn allocation_json(a: &api::Allocation) -> serde_json::Value {
    serde_json::json!({
        "id": a.id,
        "resource": a.resource_name,
        "source": enum_name::<api::AllocationSource>(a.source).to_lowercase(),
        "owner": a.owner,
        "lease": enum_name::<api::Lease>(a.lease).to_lowercase(),
        "container": a.container.as_ref().map(|c| serde_json::json!({
            "pod_namespace": c.pod_namespace, "pod_name": c.pod_name, "pod_uid": c.pod_uid,
            "container_name": c.container_name, "container_id": c.container_id,
        })),
        "devices": a.devices.iter().map(|d| serde_json::json!({
            "device_id": d.device_id, "uuid": d.uuid, "kind": enum_name::<api::DeviceKind>(d.kind).to_lowercase(),
            "memory_limit_bytes": d.memory_limit_bytes, "sm_percent": d.sm_percent, "priority": d.priority,
        })).collect::<Vec<_>>(),
        "created_unix_nano": a.created_unix_nano,
        "state": enum_name::<api::AllocationState>(a.state).to_lowercase(),
        "preemptible": a.preemptible,
        "preempted_by": a.preempted_by,
    })
}

/// `tessera alloc`.
pub async fn alloc(client: &mut NodeClient<Channel>, a: AllocArgs) -> Result<ExitCode, String> {
    let req = api::AllocateRequest {
        memory_bytes: a.memory.unwrap_or(0),
        sm_percent: a.sm.unwrap_or(0),
        mig_profile: a.mig.unwrap_or_default(),
        whole_gpus: a.whole.unwrap_or(0),
        priority: a.priority.map_or(api::Priority::Unspecified, PriorityArg::api) as i32,
        compute_mode: match a.compute_mode {
            None => api::ComputeMode::Unspecified,
            Some(ComputeModeArg::Strict) => api::ComputeMode::Strict,
            Some(ComputeModeArg::WorkConserving) => api::ComputeMode::WorkConserving,
        } as i32,
        gpu: a.gpu.unwrap_or_default(),
        owner: a.owner.unwrap_or_default(),
        lease: match a.lease {
            LeaseArg::None => api::Lease::None,
            LeaseArg::Container => api::Lease::Container,
        } as i32,
        cgroup: a.cgroup.unwrap_or_default(),
        preemptible: a.preemptible,
    };
    let resp = client.allocate(req).await.map_err(status_err)?.into_inner();
    let alloc = resp.allocation.unwrap_or_default();
    let mut env: Vec<(&String, &String)> = resp.env.iter().collect();
    env.sort();
    if a.json {
        let mut out = allocation_json(&alloc);
        out["cdi_devices"] = serde_json::json!(resp.cdi_devices);
        out["env"] = serde_json::json!(resp.env);
        println!("{out}");
    } else if a.env {
        for (k, v) in env {
            println!("{k}={v}");
        }
    } else {
        for d in &alloc.devices {
            if d.memory_limit_bytes == 0 && d.sm_percent == 0 {
                let kind = enum_name::<api::DeviceKind>(d.kind).to_lowercase();
                println!("allocation {} on {}: the whole {kind}", alloc.id, d.uuid);
            } else {
                println!(
                    "allocation {} on {}: {} memory, {}% SM",
                    alloc.id,
                    d.uuid,
                    mib(d.memory_limit_bytes),
                    d.sm_percent
                );
            }
        }
        println!("cdi devices: {}", resp.cdi_devices.join(","));
        for (k, v) in env {
            println!("{k}={v}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `tessera release ID`: succeeds whether or not it was still there.
pub async fn release(client: &mut NodeClient<Channel>, id: String) -> Result<ExitCode, String> {
    let r = client.release(api::ReleaseRequest { allocation_id: id.clone() }).await.map_err(status_err)?.into_inner();
    if r.released {
        println!("released {id}");
    } else {
        println!("{id}: no such allocation (already released)");
    }
    Ok(ExitCode::SUCCESS)
}

/// What `tessera park` and `tessera resume` print: a line, or one JSON object.
fn moved(verb: &str, id: &str, a: Option<&api::Allocation>, bytes: u64, nanos: u64, pids: &[u32], json: bool) {
    let state = a.map(|a| enum_name::<api::AllocationState>(a.state).to_lowercase()).unwrap_or_default();
    if json {
        println!(
            "{}",
            serde_json::json!({"id": id, "state": state, "bytes": bytes, "duration_nanos": nanos, "pids": pids})
        );
    } else {
        let pids = pids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        println!("{verb} {id}: {} in {:.3} s, processes {pids}; now {state}", mib(bytes), nanos as f64 / 1e9);
    }
}

/// `tessera park ID [--lock-timeout DURATION] [--json]` (no timeout: the daemon's default).
pub async fn park(
    client: &mut NodeClient<Channel>,
    id: String,
    lock_timeout: Option<Duration>,
    json: bool,
) -> Result<ExitCode, String> {
    // 0 asks for the daemon's default; parse_duration never gives less than 1 ms.
    let lock_timeout_nanos = lock_timeout.map_or(0, |t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX));
    let r = client
        .park(api::ParkRequest { allocation_id: id.clone(), lock_timeout_nanos })
        .await
        .map_err(status_err)?
        .into_inner();
    moved("parked", &id, r.allocation.as_ref(), r.bytes, r.duration_nanos, &r.pids, json);
    Ok(ExitCode::SUCCESS)
}

/// `tessera resume ID [--json]`.
pub async fn resume(client: &mut NodeClient<Channel>, id: String, json: bool) -> Result<ExitCode, String> {
    let r = client.resume(api::ResumeRequest { allocation_id: id.clone() }).await.map_err(status_err)?.into_inner();
    moved("resumed", &id, r.allocation.as_ref(), r.bytes, r.duration_nanos, &r.pids, json);
    Ok(ExitCode::SUCCESS)
}

/// `tessera limits set ID ...`.
pub async fn limits(client: &mut NodeClient<Channel>, command: LimitsCommand) -> Result<ExitCode, String> {
    let LimitsCommand::Set(s) = command;
    if s.memory.is_none() && s.sm.is_none() && s.priority.is_none() {
        return Err("say what to change: --memory, --sm or --priority".into());
    }
    let r = client
        .set_limits(api::SetLimitsRequest {
            allocation_id: s.id.clone(),
            memory_bytes: s.memory,
            sm_percent: s.sm,
            priority: s.priority.map_or(api::Priority::Unspecified, PriorityArg::api) as i32,
        })
        .await
        .map_err(status_err)?
        .into_inner();
    let a = r.allocation.unwrap_or_default();
    for d in &a.devices {
        println!(
            "{} {}: {} memory, {}% SM, priority {}",
            a.id,
            d.device_id,
            mib(d.memory_limit_bytes),
            d.sm_percent,
            d.priority
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// An allocation's state as the table shows it: a preempted one says by whom, a preemptible
/// one that it may be parked.
fn state_shown(a: &api::Allocation) -> String {
    let state = enum_name::<api::AllocationState>(a.state).to_lowercase();
    if !a.preempted_by.is_empty() {
        format!("{state} (preempted by {})", a.preempted_by)
    } else if a.preemptible {
        format!("{state} (preemptible)")
    } else {
        state
    }
}

/// `tessera allocations [--json]`.
pub async fn allocations(client: &mut NodeClient<Channel>, json: bool) -> Result<ExitCode, String> {
    let list = super::connect::list_allocations(client).await?;
    if json {
        println!("{}", serde_json::Value::Array(list.iter().map(allocation_json).collect()));
        return Ok(ExitCode::SUCCESS);
    }
    let mut rows =
        vec![row(["ALLOCATION", "RESOURCE", "CONTAINER", "DEVICES", "MEMORY", "SM%", "STATE", "SOURCE", "OWNER"])];
    for a in &list {
        let mut owner = a.owner.clone();
        if a.lease == api::Lease::Container as i32 {
            owner = format!("{owner} (lease: container)").trim().to_owned();
        }
        rows.push(row([
            a.id.clone(),
            a.resource_name.clone(),
            a.container.as_ref().map(container_name).unwrap_or_default(),
            a.devices.iter().map(|d| d.device_id.as_str()).collect::<Vec<_>>().join(","),
            a.devices.iter().map(|d| mib(d.memory_limit_bytes)).collect::<Vec<_>>().join(","),
            a.devices.iter().map(|d| d.sm_percent.to_string()).collect::<Vec<_>>().join(","),
            state_shown(a),
            enum_name::<api::AllocationSource>(a.source).to_lowercase(),
            owner,
        ]));
    }
    print_table(&rows);
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::{parse_duration, parse_size};
    use std::time::Duration;

    #[test]
    fn lock_timeouts_read_with_their_unit() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("2min"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration(" 10 s "), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("4294967295ms"), Ok(Duration::from_millis(u32::MAX.into())));
        assert!(parse_duration("10").unwrap_err().contains("has no unit"));
        assert!(parse_duration("10us").unwrap_err().contains("unknown unit \"us\""));
        assert!(parse_duration("0s").unwrap_err().contains("at least 1ms"));
        assert!(parse_duration("0.5ms").unwrap_err().contains("at least 1ms"));
        assert!(parse_duration("50d").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("4294967296ms").unwrap_err().contains("longest lock timeout"));
        assert!(parse_duration("1200h").unwrap_err().contains("longest lock timeout"));
        for bad in ["", "s", "-1s", "ten seconds", "1.2.3s", "."] {
            assert!(parse_duration(bad).unwrap_err().contains("is not a duration"), "{bad:?}");
        }
    }

    #[test]
    fn sizes_read_as_the_configuration_reads_them() {
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("512Mi"), Ok(512 << 20));
        assert_eq!(parse_size("8GB"), Ok(8_000_000_000), "decimal, as in the configuration and Kubernetes");
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert!(parse_size("4096").unwrap_err().contains("has no unit"));
        assert!(parse_size("0B").unwrap_err().contains("above 0"));
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("8 potatoes").unwrap_err().contains("is not a size"));
        assert!(parse_size("99999999TiB").unwrap_err().contains("is more than"), "an overflow says so");
    }

    /// `--help` says what the parser does: it told users KB/MB/GB meant KiB/MiB/GiB, while the
    /// parser (and docs/cli.md) read them as powers of 1000.
    #[test]
    fn the_help_says_what_the_parser_reads() {
        use clap::CommandFactory;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            alloc: super::AllocArgs,
        }
        let help = Cli::command().render_long_help().to_string();
        let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(help.contains("KiB, MiB, GiB, TiB (Ki, Mi, Gi, Ti) are powers of 1024"), "{help}");
        assert!(help.contains("K, M, G, T (KB, MB, GB, TB) powers of 1000"), "{help}");
        assert!(!help.contains("mean the same"), "{help}");
        assert_eq!(parse_size("1KB"), Ok(1000));
        assert_eq!(parse_size("1KiB"), Ok(1024));
    }
}
