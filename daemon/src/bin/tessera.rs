//! `tessera`: the node's command line, a client of tesserad's node API (`tessera.v1` on its
//! owner-only Unix socket).
//!
//! - `tessera status`: GPUs, partitions, shares, who holds each device, and usage.
//! - `tessera layout apply`: re-partition GPUs (only free devices change).
//! - `tessera events`: the event stream (kept events first with `--replay`).
//! - `tessera allocations [--json]`, `tessera reload`.
//! - `tessera alloc`, `tessera release`, `tessera limits set`: shares carved on demand, given
//!   back and changed live, without a kubelet (`tessera/alloc.rs`).
//! - `tessera trace CONTAINER --seconds N [-o FILE]`: a Perfetto / Chrome trace of a container's
//!   CUDA calls and kernels.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

// stdout through `output::write`: a reader that goes away ends the command quietly. Defined
// before the modules so they use it too.
macro_rules! print {
    ($($arg:tt)*) => { $crate::output::write(format_args!($($arg)*)) };
}
macro_rules! println {
    () => { $crate::output::write(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::output::write(format_args!("{}\n", format_args!($($arg)*))) };
}

// Every module after the macros above (a module before them printed with std's, which panics
// on a closed pipe: `tessera alloc | head -0` lost the new allocation's id in a panic).
#[path = "tessera/alloc.rs"]
mod alloc;
#[path = "tessera/connect.rs"]
mod connect;
#[path = "tessera/json.rs"]
mod json;
#[path = "tessera/layout_report.rs"]
mod layout_report;
#[path = "tessera/output.rs"]
mod output;
#[path = "tessera/top.rs"]
mod top;

use clap::{Args, Parser, Subcommand};
use tessera_daemon::config::{self, Config};
use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tonic::transport::Channel;

#[derive(Parser, Debug)]
#[command(name = "tessera", version, about = "Tessera node CLI (talks to tesserad's node API)")]
struct Cli {
    /// The node API socket. Default: the daemon configuration's `node_api_socket`.
    #[arg(long, global = true, value_name = "PATH", env = "TESSERA_SOCKET")]
    socket: Option<PathBuf>,
    /// The daemon configuration (to find the socket).
    #[arg(long, global = true, value_name = "FILE", default_value = config::DEFAULT_PATH)]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// GPUs, partitions, shares, holders and usage.
    Status {
        /// Print the node API's answers as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Partition layouts.
    Layout {
        #[command(subcommand)]
        command: LayoutCommand,
    },
    /// Stream events (health, partition changes, faults, recoveries).
    Events {
        /// First print up to this many kept events.
        #[arg(long, default_value_t = 0)]
        replay: u32,
        /// Keep watching for new events (default: print the kept ones and stop).
        #[arg(long, short)]
        follow: bool,
        /// Only events about this device.
        #[arg(long)]
        device: Option<String>,
        /// One JSON object per event, one per line.
        #[arg(long)]
        json: bool,
    },
    /// A live view of the node: per container memory, SM share, launches, throttling, OOMs.
    Top {
        /// Refresh interval in milliseconds.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
        interval_ms: u64,
        /// Print one frame (after one interval, so rates have a window) and exit.
        #[arg(long)]
        once: bool,
        /// Frames as JSON, one per line.
        #[arg(long)]
        json: bool,
    },
    /// Allocations and who holds them.
    Allocations {
        /// Print a JSON array, one object per allocation.
        #[arg(long)]
        json: bool,
    },
    /// Carve a share of a GPU (memory and SM percent), or take a MIG device or whole GPUs, for a
    /// container or a host process.
    Alloc(alloc::AllocArgs),
    /// Give an allocation back (succeeds if it is already gone).
    Release {
        /// The allocation id.
        id: String,
    },
    /// Park an allocation: its processes' device memory moved to host memory (they wait, not
    /// stopped); the GPU memory is free until `tessera resume`.
    Park {
        /// The allocation id.
        id: String,
        /// How long each process's GPU work may take to finish before it is locked (a number and
        /// its unit: ms, s, m or h, e.g. 500ms, 30s, 2m); past it the park is refused and the
        /// program runs on. Default: the daemon's, 10 s.
        #[arg(long, value_name = "DURATION", value_parser = alloc::parse_duration)]
        lock_timeout: Option<std::time::Duration>,
        /// Print the answer as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Resume a parked allocation: its memory back on the GPU, its processes go on.
    Resume {
        /// The allocation id.
        id: String,
        /// Print the answer as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Change a live allocation's limits.
    Limits {
        #[command(subcommand)]
        command: alloc::LimitsCommand,
    },
    /// Re-read the daemon's configuration file (as SIGHUP does).
    Reload {
        #[arg(long)]
        dry_run: bool,
    },
    /// Put the hook, the runtime wrapper and the shim on this host and configure its runtimes.
    Install(tessera_daemon::install::InstallArgs),
    /// Undo `tessera install`: remove what it wrote, restore what it edited.
    Uninstall(tessera_daemon::install::UninstallArgs),
    /// Record a container's CUDA calls and kernels as a Perfetto / Chrome trace (JSON).
    Trace {
        /// The allocation id, or the container: `namespace/pod/container`, `pod/container`, `pod`,
        /// or a container id (or its first 12 characters).
        container: String,
        /// How long to record (1..=60).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=60))]
        seconds: u32,
        /// Where to write the trace. Default: `trace-<allocation id>.json`.
        #[arg(long, short)]
        output: Option<PathBuf>,
        /// Print the recording's summary as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum LayoutCommand {
    /// Apply a layout to some GPUs; devices in use are never removed.
    Apply(ApplyArgs),
    /// Show each GPU's layout: current, desired, state.
    Show {
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
struct ApplyArgs {
    /// Which GPUs: `all`, or an index or UUID; repeat for several.
    #[arg(long = "gpu", required = true)]
    gpus: Vec<String>,
    /// The whole GPU as one device (MIG off).
    #[arg(long, conflicts_with_all = ["mig", "shares"])]
    whole: bool,
    /// MIG instances, as mig-parted counts them: `1g.10gb=4,3g.40gb=1`.
    #[arg(long, conflicts_with = "shares")]
    mig: Option<String>,
    /// N equal time-sliced shares of the GPU (MIG off).
    #[arg(long)]
    shares: Option<u32>,
    /// Plan and report only.
    #[arg(long)]
    dry_run: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match &cli.command {
        Command::Install(a) => return tessera_daemon::install::finish(tessera_daemon::install::install(a)),
        Command::Uninstall(a) => return tessera_daemon::install::finish(tessera_daemon::install::uninstall(a)),
        _ => {} // the rest talk to tesserad
    }
    let socket = match &cli.socket {
        Some(s) => s.clone(),
        None => {
            let explicit = cli.config.as_os_str() != config::DEFAULT_PATH;
            match Config::load(&cli.config, explicit) {
                Ok(c) => c.node_api_socket(),
                Err(e) => {
                    eprintln!("tessera: {e}");
                    return ExitCode::from(2);
                }
            }
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tessera: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command, socket)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tessera: {e}");
            ExitCode::FAILURE
        }
    }
}

use connect::{connect, list_allocations, list_partitions, status_err};

async fn run(command: Command, socket: PathBuf) -> Result<ExitCode, String> {
    let mut client = connect(&socket).await?;
    match command {
        Command::Status { json } => status(&mut client, json).await,
        Command::Layout { command: LayoutCommand::Show { json } } => layout_show(&mut client, json).await,
        Command::Layout { command: LayoutCommand::Apply(a) } => layout_apply(&mut client, a).await,
        Command::Events { replay, follow, device, json } => events(&mut client, replay, follow, device, json).await,
        Command::Top { interval_ms, once, json } => top::run(&mut client, interval_ms, once, json).await,
        Command::Allocations { json } => alloc::allocations(&mut client, json).await,
        Command::Alloc(a) => alloc::alloc(&mut client, a).await,
        Command::Release { id } => alloc::release(&mut client, id).await,
        Command::Limits { command } => alloc::limits(&mut client, command).await,
        Command::Park { id, lock_timeout, json } => alloc::park(&mut client, id, lock_timeout, json).await,
        Command::Resume { id, json } => alloc::resume(&mut client, id, json).await,
        Command::Reload { dry_run } => reload(&mut client, dry_run).await,
        Command::Trace { container, seconds, output, json } => {
            trace(&mut client, &container, seconds, output, json).await
        }
        Command::Install(_) | Command::Uninstall(_) => unreachable!("handled before connecting"),
    }
}

async fn status(client: &mut NodeClient<Channel>, json: bool) -> Result<ExitCode, String> {
    let devices =
        client.list_devices(api::ListDevicesRequest::default()).await.map_err(status_err)?.into_inner().devices;
    let partitions = list_partitions(client).await?;
    let usage = client.get_usage(api::GetUsageRequest::default()).await.map_err(status_err)?.into_inner();
    if json {
        let out = serde_json::json!({
            "devices": devices.iter().map(device_json).collect::<Vec<_>>(),
            "partitions": partitions.iter().map(|p| serde_json::json!({
                "gpu_index": p.gpu_index, "gpu_uuid": p.gpu_uuid,
                "current": p.current.as_ref().map(describe_layout), "desired": p.desired.as_ref().map(describe_layout),
                "state": enum_name::<api::PartitionState>(p.state), "device_ids": p.device_ids,
                "issues": p.issues.iter().map(|i| &i.message).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "usage": usage.containers.iter().map(|c| serde_json::json!({
                "allocation_id": c.allocation_id, "processes": c.processes,
                "devices": c.devices.iter().map(|d| serde_json::json!({
                    "device_id": d.device_id, "uuid": d.uuid, "memory_used_bytes": d.memory_used_bytes,
                    "memory_limit_bytes": d.memory_limit_bytes, "sm_achieved_percent": d.sm_achieved_percent,
                    "sm_limit_percent": d.sm_limit_percent, "launches": d.launches,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
        return Ok(ExitCode::SUCCESS);
    }
    // Usage per device id (a container's usage row may name several shares).
    let mut used: BTreeMap<String, &api::DeviceUsage> = BTreeMap::new();
    for c in &usage.containers {
        for d in &c.devices {
            for id in d.device_id.split(',') {
                used.insert(id.to_owned(), d);
            }
        }
    }
    let mut gpu_rows = vec![row(["GPU", "UUID", "MODEL", "MEMORY", "MIG", "HEALTH", "LAYOUT", "STATE"])];
    let mut dev_rows = vec![row(["DEVICE", "KIND", "RESOURCE", "MEMORY", "SM%", "HELD BY", "USED", "SM NOW"])];
    for p in &partitions {
        let gpu = devices.iter().find(|d| d.id == p.gpu_uuid);
        gpu_rows.push(row([
            p.gpu_index.to_string(),
            p.gpu_uuid.clone(),
            gpu.map(|g| g.model.clone()).unwrap_or_default(),
            gpu.map(|g| mib(g.memory_bytes)).unwrap_or_default(),
            mig_mode(p),
            gpu.map(health).unwrap_or_default(),
            p.current.as_ref().map(describe_layout).unwrap_or_default(),
            enum_name::<api::PartitionState>(p.state).to_lowercase(),
        ]));
        for d in devices.iter().filter(|d| p.device_ids.contains(&d.id)) {
            let u = used.get(&d.id);
            dev_rows.push(row([
                d.id.clone(),
                enum_name::<api::DeviceKind>(d.kind).to_lowercase(),
                d.resource_name.clone(),
                mib(d.memory_bytes),
                d.sm_percent.to_string(),
                if d.kubelet_withdrawn { "- (withdrawn*)".into() } else { holders(d) },
                u.map(|u| mib(u.memory_used_bytes)).unwrap_or_else(|| "-".into()),
                u.map(|u| percent(u.sm_achieved_percent)).unwrap_or_else(|| "-".into()),
            ]));
        }
        for i in &p.issues {
            eprintln!("GPU {}: {}", p.gpu_index, i.message);
        }
    }
    print_table(&gpu_rows);
    println!();
    print_table(&dev_rows);
    let withdrawn = devices.iter().filter(|d| d.kubelet_withdrawn).count();
    if withdrawn > 0 {
        println!(
            "\n* {withdrawn} free device(s) told unhealthy to the kubelet: the node API's allocations leave \
             no room beside them (offered again once those are released; `tessera allocations` lists them)."
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn layout_show(client: &mut NodeClient<Channel>, as_json: bool) -> Result<ExitCode, String> {
    let partitions = list_partitions(client).await?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&json::partitions(&partitions)).unwrap_or_default());
        return Ok(ExitCode::SUCCESS);
    }
    let mut rows = vec![row(["GPU", "CURRENT", "DESIRED", "STATE", "MIG", "DEVICES"])];
    for p in &partitions {
        rows.push(row([
            p.gpu_index.to_string(),
            p.current.as_ref().map(describe_layout).unwrap_or_default(),
            p.desired.as_ref().map(describe_layout).unwrap_or_else(|| "(unmanaged)".into()),
            enum_name::<api::PartitionState>(p.state).to_lowercase(),
            mig_mode(p),
            p.device_ids.len().to_string(),
        ]));
    }
    print_table(&rows);
    for p in &partitions {
        for i in &p.issues {
            println!("GPU {}: {}", p.gpu_index, i.message);
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn layout_apply(client: &mut NodeClient<Channel>, a: ApplyArgs) -> Result<ExitCode, String> {
    use api::gpu_layout::Layout;
    let layout = if a.whole {
        Layout::Whole(api::WholeLayout {})
    } else if let Some(n) = a.shares {
        Layout::Shares(api::SharesLayout { count: n, sizes: Vec::new() })
    } else if let Some(m) = &a.mig {
        let mut profiles = Vec::new();
        for part in m.split(',').filter(|p| !p.is_empty()) {
            let (profile, count) = part.split_once('=').unwrap_or((part, "1"));
            let count = count.parse().map_err(|_| format!("--mig: {part:?}: the count after '=' must be a number"))?;
            profiles.push(api::MigProfileCount { profile: profile.to_owned(), count, shares: None });
        }
        Layout::Mig(api::MigLayout { profiles })
    } else {
        return Err("say which layout: --whole, --mig PROFILE=N,... or --shares N".into());
    };
    let targets = a
        .gpus
        .iter()
        .map(|g| {
            use api::layout_target::Gpus;
            let gpus = if g == "all" {
                Gpus::All(api::AllGpus {})
            } else if let Ok(i) = g.parse() {
                Gpus::Index(i)
            } else {
                Gpus::Uuid(g.clone())
            };
            api::LayoutTarget { gpus: Some(gpus), layout: Some(api::GpuLayout { layout: Some(layout.clone()) }) }
        })
        .collect();
    let resp = client
        .apply_layout(api::ApplyLayoutRequest { targets, dry_run: a.dry_run })
        .await
        .map_err(status_err)?
        .into_inner();
    print!("{}", layout_report::results(&resp.results, resp.dry_run));
    let refused = resp.results.iter().any(|r| {
        matches!(api::LayoutOutcome::try_from(r.outcome), Ok(api::LayoutOutcome::Refused | api::LayoutOutcome::Partial))
    });
    Ok(if refused { ExitCode::from(3) } else { ExitCode::SUCCESS })
}

async fn events(
    client: &mut NodeClient<Channel>,
    replay: u32,
    follow: bool,
    device: Option<String>,
    as_json: bool,
) -> Result<ExitCode, String> {
    let req = api::WatchEventsRequest { replay, kinds: Vec::new(), device_id: device.unwrap_or_default() };
    let mut stream = client.watch_events(req).await.map_err(status_err)?.into_inner();
    let mut seen = 0u32;
    loop {
        // Without --follow, stop once the replayed events are printed.
        let next = if follow || seen < replay {
            let wait = if follow { None } else { Some(std::time::Duration::from_millis(300)) };
            match wait {
                None => stream.message().await,
                Some(d) => match tokio::time::timeout(d, stream.message()).await {
                    Ok(m) => m,
                    Err(_) => break,
                },
            }
        } else {
            break;
        };
        match next.map_err(status_err)? {
            Some(e) if as_json => {
                seen += 1;
                println!("{}", json::event(&e));
            }
            Some(e) => {
                seen += 1;
                println!(
                    "{} #{} {} {} {} {}",
                    time(e.time_unix_nano),
                    e.sequence,
                    enum_name::<api::EventKind>(e.kind).to_lowercase(),
                    enum_name::<api::Severity>(e.severity).to_lowercase(),
                    if e.device_id.is_empty() { "-" } else { &e.device_id },
                    e.message
                );
            }
            None => break,
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn trace(
    client: &mut NodeClient<Channel>,
    container: &str,
    seconds: u32,
    output: Option<PathBuf>,
    as_json: bool,
) -> Result<ExitCode, String> {
    let list = list_allocations(client).await?;
    let id = resolve_allocation(&list, container)?;
    let output = output.unwrap_or_else(|| PathBuf::from(format!("trace-{id}.json")));
    // The output must be writable before seconds of recording go into it.
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&output)
        .map_err(|e| format!("{}: {e}; nothing was recorded (choose another -o)", output.display()))?;
    let r =
        client.trace(api::TraceRequest { allocation_id: id.clone(), seconds }).await.map_err(status_err)?.into_inner();
    {
        use std::io::Write;
        file.set_len(0)
            .and_then(|()| file.write_all(&r.trace_json))
            .map_err(|e| format!("{}: {e}", output.display()))?;
    }
    if r.events == 0 {
        eprintln!(
            "tessera: nothing was recorded: no process of allocation {id} made a CUDA call in {seconds} s \
             (is its workload running, with libtessera.so loaded?)"
        );
    }
    if as_json {
        println!("{}", json::trace(&output.display().to_string(), &id, &r));
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{}: {} events from {} process(es) of allocation {id} over {:.1} s{}",
        output.display(),
        r.events,
        r.processes,
        r.duration_nanos as f64 / 1e9,
        if r.dropped > 0 { format!(", {} dropped (the trace has gaps)", r.dropped) } else { String::new() }
    );
    Ok(ExitCode::SUCCESS)
}

/// The allocation `name` means: an allocation id, else exactly one allocation whose container is
/// `namespace/pod/container`, `pod/container`, `pod`, or whose container id is or starts with it.
fn resolve_allocation(list: &[api::Allocation], name: &str) -> Result<String, String> {
    if let Some(a) = list.iter().find(|a| a.id == name) {
        return Ok(a.id.clone());
    }
    let matches = |c: &api::ContainerIdentity| {
        let full = format!("{}/{}/{}", c.pod_namespace, c.pod_name, c.container_name);
        let short = format!("{}/{}", c.pod_name, c.container_name);
        (!c.pod_name.is_empty() && (full == name || short == name || c.pod_name == name))
            || (!c.container_id.is_empty() && name.len() >= 12 && c.container_id.starts_with(name))
    };
    let found: Vec<&api::Allocation> = list.iter().filter(|a| a.container.as_ref().is_some_and(matches)).collect();
    match found.as_slice() {
        [a] => Ok(a.id.clone()),
        [] => Err(format!("no allocation or container {name:?} (see `tessera allocations`)")),
        many => Err(format!(
            "{name:?} matches several allocations: {}; name one by its id",
            many.iter().map(|a| a.id.as_str()).collect::<Vec<_>>().join(", ")
        )),
    }
}

async fn reload(client: &mut NodeClient<Channel>, dry_run: bool) -> Result<ExitCode, String> {
    let r = client.reload(api::ReloadRequest { dry_run }).await.map_err(status_err)?.into_inner();
    println!(
        "{}: {}{}",
        r.config_path,
        enum_name::<api::ReloadOutcome>(r.outcome).to_lowercase(),
        if r.dry_run { " (dry run)" } else { "" }
    );
    for c in &r.applied {
        println!("  applied {}: {} -> {}", c.key, c.old_value, c.new_value);
    }
    for c in &r.needs_restart {
        println!("  needs a restart {}: {}", c.key, c.reason);
    }
    for e in &r.errors {
        // A file that is not TOML at all has no key to name.
        match e.key.as_str() {
            "" => println!("  error: {}", e.reason),
            key => println!("  error {key}: {}", e.reason),
        }
    }
    for line in layout_report::results(&r.layouts, false).lines() {
        println!("  {line}");
    }
    Ok(if r.outcome == api::ReloadOutcome::Rejected as i32 { ExitCode::from(2) } else { ExitCode::SUCCESS })
}

/// `mig 1g.10gb x4, 3g.40gb x1`, `shares x4`, `whole`.
fn describe_layout(l: &api::GpuLayout) -> String {
    use api::gpu_layout::Layout;
    let shares = |s: &api::SharesLayout| format!("shares x{}", s.count);
    match &l.layout {
        Some(Layout::Whole(_)) => "whole".into(),
        Some(Layout::Shares(s)) => shares(s),
        Some(Layout::Mig(m)) if m.profiles.is_empty() => "mig (empty)".into(),
        Some(Layout::Mig(m)) => format!(
            "mig {}",
            m.profiles
                .iter()
                .map(|p| match &p.shares {
                    Some(s) => format!("{} x{} ({})", p.profile, p.count, shares(s)),
                    None => format!("{} x{}", p.profile, p.count),
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None => "-".into(),
    }
}

fn mig_mode(p: &api::Partition) -> String {
    let name = |m: i32| match api::MigMode::try_from(m) {
        Ok(api::MigMode::Enabled) => "on",
        Ok(api::MigMode::Disabled) => "off",
        Ok(api::MigMode::Unsupported) => "n/a",
        _ => "?",
    };
    if p.pending_mig_mode == api::MigMode::Unspecified as i32 {
        name(p.mig_mode).into()
    } else {
        format!("{} ({} after reset)", name(p.mig_mode), name(p.pending_mig_mode))
    }
}

fn health(d: &api::Device) -> String {
    let h = enum_name::<api::Health>(d.health).to_lowercase();
    // The reason may start with the state itself (`unhealthy: XID 79`): say it once.
    let reason = d.health_reason.trim();
    let reason = reason
        .get(..h.len())
        .filter(|p| p.eq_ignore_ascii_case(&h))
        .map_or(reason, |_| reason[h.len()..].trim_start_matches([':', ' ', '-']));
    if reason.is_empty() { h } else { format!("{h} ({reason})") }
}

fn holders(d: &api::Device) -> String {
    if d.holders.is_empty() {
        return "-".into();
    }
    d.holders
        .iter()
        .map(|h| {
            let c = h.container.as_ref().map(container_name).unwrap_or_default();
            if c.is_empty() { h.allocation_id.clone() } else { format!("{} ({c})", h.allocation_id) }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn container_name(c: &api::ContainerIdentity) -> String {
    if !c.pod_name.is_empty() {
        let mut s = format!("{}/{}", c.pod_namespace, c.pod_name);
        if !c.container_name.is_empty() {
            s.push('/');
            s.push_str(&c.container_name);
        }
        s
    } else {
        c.container_id.chars().take(12).collect()
    }
}

fn device_json(d: &api::Device) -> serde_json::Value {
    serde_json::json!({
        "id": d.id, "uuid": d.uuid, "kind": enum_name::<api::DeviceKind>(d.kind), "parent_id": d.parent_id,
        "index": d.index, "model": d.model, "resource_name": d.resource_name, "cdi_name": d.cdi_name,
        "memory_bytes": d.memory_bytes, "sm_percent": d.sm_percent, "health": enum_name::<api::Health>(d.health),
        "health_reason": d.health_reason, "numa_node": d.numa_node,
        "holders": d.holders.iter().map(|h| &h.allocation_id).collect::<Vec<_>>(),
        "kubelet_withdrawn": d.kubelet_withdrawn,
    })
}

/// A proto enum's value name without its type prefix (`PARTITION_STATE_CONVERGED` → `CONVERGED`).
fn enum_name<E: TryFrom<i32> + ProtoEnum>(v: i32) -> String {
    E::try_from(v).map(|e| e.short_name()).unwrap_or_else(|_| v.to_string())
}

trait ProtoEnum {
    fn short_name(&self) -> String;
}

macro_rules! proto_enum {
    ($($t:ty => $prefix:literal),* $(,)?) => {$(
        impl ProtoEnum for $t {
            fn short_name(&self) -> String {
                self.as_str_name().trim_start_matches($prefix).to_owned()
            }
        }
    )*};
}

proto_enum!(
    api::PartitionState => "PARTITION_STATE_",
    api::DeviceKind => "DEVICE_KIND_",
    api::Health => "HEALTH_",
    api::LayoutOutcome => "LAYOUT_OUTCOME_",
    api::LayoutIssueKind => "LAYOUT_ISSUE_KIND_",
    api::EventKind => "EVENT_KIND_",
    api::Severity => "SEVERITY_",
    api::AllocationSource => "ALLOCATION_SOURCE_",
    api::Lease => "LEASE_",
    api::ReloadOutcome => "RELOAD_OUTCOME_",
    api::MigMode => "MIG_MODE_",
    api::BreachAction => "BREACH_ACTION_",
    api::BreachPhase => "BREACH_PHASE_",
    api::BreachLimit => "BREACH_LIMIT_",
    api::FaultKind => "FAULT_KIND_",
    api::AllocationState => "ALLOCATION_STATE_",
);

/// A percentage with one decimal; never `-0.0%` (a negative rate is a clock artefact).
fn percent(v: f64) -> String {
    format!("{:.1}%", non_negative(v))
}

/// `v`, or 0 when it is negative, `-0.0` or not a number.
fn non_negative(v: f64) -> f64 {
    if v > 0.0 { v } else { 0.0 }
}

fn mib(bytes: u64) -> String {
    if bytes == 0 { "-".into() } else { format!("{} MiB", bytes >> 20) }
}

fn time(unix_ns: u64) -> String {
    let secs = unix_ns / 1_000_000_000;
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    format!("{h:02}:{m:02}:{s:02}.{:03}Z", (unix_ns / 1_000_000) % 1000)
}

fn row<const N: usize>(cells: [impl Into<String>; N]) -> Vec<String> {
    cells.into_iter().map(Into::into).collect()
}

fn print_table(rows: &[Vec<String>]) {
    print!("{}", table(rows));
}

/// Rows as aligned columns, one line each.
fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> =
        (0..cols).map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r.iter().enumerate().map(|(i, s)| format!("{s:<w$}", w = widths[i])).collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}
